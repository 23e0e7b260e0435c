// gguf_reader.c - our own reader of the GGUF layout (header, key/value pairs, tensor
// infos), used for PowerInfer's "PWRI" files: GGUF v3 with another magic, which
// gguf.h rejects. The file is untrusted: every count, length, size and offset is
// checked against the bytes that are actually there before it is used (no sum can
// wrap: each is compared with what remains), and nothing is allocated beyond a
// constant times the file's size. The result is a gguf_context holding the same
// key/value pairs (so metadata code is shared with standard files) and a list of
// tensor infos whose data lies inside the file.
#include "gguf_reader.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The fewest bytes a key/value pair can take (8-byte length, a 1-byte key, 4-byte type,
// a 1-byte value) and a tensor info (8-byte length, a 1-byte name, 4-byte n_dims, no
// dimension, 4-byte type, 8-byte offset; zero dimensions is an error, reported as such):
// the header's counts are bounded by what the rest of the file could hold before
// anything is allocated from them.
#define MIN_KV_BYTES          14
#define MIN_TENSOR_INFO_BYTES 25

struct cursor {
    const uint8_t * p;
    const uint8_t * end;
};

static uint64_t remaining(const struct cursor * c) {
    return (uint64_t) (c->end - c->p);
}

static bool take(struct cursor * c, void * dst, size_t n) {
    if (remaining(c) < n) {
        return false;
    }
    memcpy(dst, c->p, n);
    c->p += n;
    return true;
}

// A length-prefixed string, returned NUL-terminated in a fresh allocation (at most the
// bytes left in the file, plus one); *len gets its stored length (it may hold a NUL).
static char * take_str(struct cursor * c, uint64_t * len) {
    uint64_t n;
    if (!take(c, &n, sizeof(n)) || n > remaining(c)) {
        return NULL;
    }
    char * s = malloc(n + 1);
    if (!s) {
        return NULL;
    }
    memcpy(s, c->p, n);
    s[n] = '\0';
    c->p += n;
    if (len) {
        *len = n;
    }
    return s;
}

static size_t scalar_size(enum gguf_type t) {
    switch (t) {
        case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
        case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
        case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
        default: return 0;
    }
}

static void set_scalar(struct gguf_context * g, const char * key, enum gguf_type t, const uint8_t * v) {
    switch (t) {
        case GGUF_TYPE_UINT8:   gguf_set_val_u8(g, key, *v); break;
        case GGUF_TYPE_INT8:    gguf_set_val_i8(g, key, (int8_t) *v); break;
        case GGUF_TYPE_BOOL:    gguf_set_val_bool(g, key, *v != 0); break;
        case GGUF_TYPE_UINT16:  { uint16_t x; memcpy(&x, v, 2); gguf_set_val_u16(g, key, x); break; }
        case GGUF_TYPE_INT16:   { int16_t x;  memcpy(&x, v, 2); gguf_set_val_i16(g, key, x); break; }
        case GGUF_TYPE_UINT32:  { uint32_t x; memcpy(&x, v, 4); gguf_set_val_u32(g, key, x); break; }
        case GGUF_TYPE_INT32:   { int32_t x;  memcpy(&x, v, 4); gguf_set_val_i32(g, key, x); break; }
        case GGUF_TYPE_FLOAT32: { float x;    memcpy(&x, v, 4); gguf_set_val_f32(g, key, x); break; }
        case GGUF_TYPE_UINT64:  { uint64_t x; memcpy(&x, v, 8); gguf_set_val_u64(g, key, x); break; }
        case GGUF_TYPE_INT64:   { int64_t x;  memcpy(&x, v, 8); gguf_set_val_i64(g, key, x); break; }
        case GGUF_TYPE_FLOAT64: { double x;   memcpy(&x, v, 8); gguf_set_val_f64(g, key, x); break; }
        default: break;
    }
}

static int32_t bad(const char * path, const char * what) {
    return pi_fail(POWERINFER_ERR_FORMAT, "'%s' is not a valid PowerInfer GGUF file: %s", path, what);
}

// ---- a set of names (keys or tensor names) for the duplicate checks -----------------
// Open addressing over indices; the names themselves stay where they are (in the
// gguf_context or the tensor list) and are fetched through name_of.

typedef const char * (*name_of_fn)(const void * owner, int64_t idx);

struct name_set {
    int64_t *    slot;  // idx + 1, 0 when empty
    uint64_t     mask;
    name_of_fn   name_of;
    const void * owner;
};

static uint64_t hash_name(const char * s) {
    uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
    for (; *s; ++s) {
        h = (h ^ (uint8_t) *s) * 0x100000001b3ull;
    }
    return h;
}

static bool name_set_init(struct name_set * s, uint64_t n, name_of_fn name_of, const void * owner) {
    uint64_t cap = 16;
    while (cap < 2 * n) {
        cap *= 2;
    }
    s->slot    = calloc(cap, sizeof(*s->slot));
    s->mask    = cap - 1;
    s->name_of = name_of;
    s->owner   = owner;
    return s->slot != NULL;
}

// The slot holding `name`, or the empty slot where it would go.
static int64_t * name_set_slot(const struct name_set * s, const char * name) {
    for (uint64_t i = hash_name(name) & s->mask;; i = (i + 1) & s->mask) {
        if (s->slot[i] == 0 || strcmp(s->name_of(s->owner, s->slot[i] - 1), name) == 0) {
            return &s->slot[i];
        }
    }
}

static bool name_set_has(const struct name_set * s, const char * name) {
    return *name_set_slot(s, name) != 0;
}

// Adds a name known to be absent (the set never holds more than half its slots).
static void name_set_add(struct name_set * s, const char * name, int64_t idx) {
    *name_set_slot(s, name) = idx + 1;
}

static void name_set_free(struct name_set * s) {
    free(s->slot);
    s->slot = NULL;
}

static const char * key_name(const void * g, int64_t idx) {
    return gguf_get_key((const struct gguf_context *) g, idx);
}

static const char * tensor_name(const void * tensors, int64_t idx) {
    return ((const struct pi_tensor_info *) tensors)[idx].name;
}

// ---- key/value pairs ---------------------------------------------------------------

// Reads one key/value pair into g (keys: the names already in g).
static int32_t read_kv(struct cursor * c, struct gguf_context * g, struct name_set * keys, const char * path) {
    uint64_t key_len = 0;
    char * key = take_str(c, &key_len);
    if (!key) {
        return bad(path, "a key is truncated");
    }
    int32_t rc = POWERINFER_OK;
    uint32_t type;
    if (*key == '\0' || key_len != strlen(key)) {
        rc = bad(path, "a key is empty or contains a NUL byte");
    } else if (name_set_has(keys, key)) {
        rc = pi_fail(POWERINFER_ERR_FORMAT, "'%s' is not a valid PowerInfer GGUF file: key '%s' appears twice", path, key);
    } else if (!take(c, &type, sizeof(type)) || type >= GGUF_TYPE_COUNT) {
        rc = pi_fail(POWERINFER_ERR_FORMAT, "'%s' is not a valid PowerInfer GGUF file: key '%s' has a bad type", path, key);
    } else if (strcmp(key, "general.alignment") == 0 && type != GGUF_TYPE_UINT32) {
        // (checked before gguf.h's setter sees it: that one aborts)
        rc = pi_fail(POWERINFER_ERR_FORMAT, "'%s' is not a valid PowerInfer GGUF file: key '%s' has a bad type", path, key);
    } else if (type == GGUF_TYPE_STRING) {
        char * s = take_str(c, NULL);
        if (!s) rc = bad(path, "a string value is truncated");
        else { gguf_set_val_str(g, key, s); free(s); }
    } else if (type == GGUF_TYPE_ARRAY) {
        uint32_t et;
        uint64_t n;
        if (!take(c, &et, sizeof(et)) || !take(c, &n, sizeof(n))) {
            rc = bad(path, "an array header is truncated");
        } else if (et == GGUF_TYPE_STRING) {
            // Each string needs at least its 8-byte length: bound n before allocating.
            if (n > remaining(c) / 8) {
                rc = bad(path, "an array of strings is longer than the file");
            } else {
                char ** strs = calloc(n ? n : 1, sizeof(char *));
                uint64_t i = 0;
                for (; strs && i < n; ++i) {
                    if (!(strs[i] = take_str(c, NULL))) break;
                }
                if (!strs || i < n) rc = bad(path, "an array of strings is truncated");
                else gguf_set_arr_str(g, key, (const char **) strs, n);
                for (uint64_t j = 0; strs && j < i; ++j) free(strs[j]);
                free(strs);
            }
        } else if (scalar_size((enum gguf_type) et) == 0) {
            rc = pi_fail(POWERINFER_ERR_UNSUPPORTED, "'%s': key '%s' is an array of %s, which is not supported", path, key,
                         et < GGUF_TYPE_COUNT ? gguf_type_name((enum gguf_type) et) : "an unknown type");
        } else {
            const size_t es = scalar_size((enum gguf_type) et);
            if (n > remaining(c) / es) {
                rc = bad(path, "an array is longer than the file");
            } else {
                gguf_set_arr_data(g, key, (enum gguf_type) et, c->p, n);
                c->p += n * es;
            }
        }
    } else {
        uint8_t v[8];
        uint32_t u = 0;
        if (!take(c, v, scalar_size((enum gguf_type) type))) {
            rc = bad(path, "a value is truncated");
        } else if (strcmp(key, "general.alignment") == 0 &&
                   (type != GGUF_TYPE_UINT32 || (memcpy(&u, v, 4), u == 0 || (u & (u - 1)) != 0))) {
            rc = bad(path, "general.alignment is not a power of two of type u32");
        } else {
            set_scalar(g, key, (enum gguf_type) type, v);
        }
    }
    if (rc == POWERINFER_OK) {
        name_set_add(keys, key, gguf_get_n_kv(g) - 1);
    }
    free(key);
    return rc;
}

// ---- tensor infos ------------------------------------------------------------------

static enum ggml_type translate_type(uint32_t type, uint32_t flags) {
    if (flags & PI_GGUF_LEGACY_INT_TYPES) {
        switch (type) {
            case 16: return GGML_TYPE_I8;   // PowerInfer's ggml: I8 = 16, I16 = 17, I32 = 18
            case 17: return GGML_TYPE_I16;
            case 18: return GGML_TYPE_I32;
            default: break;
        }
    }
    return (enum ggml_type) type;
}

static int32_t read_tensor_info(struct cursor * c, struct pi_tensor_info * ti, uint32_t flags, const char * path) {
    uint64_t name_len = 0;
    char * name = take_str(c, &name_len);
    if (!name) {
        return bad(path, "a tensor name is truncated");
    }
    if (name_len >= GGML_MAX_NAME || name_len == 0 || name_len != strlen(name)) {
        int32_t rc = pi_fail(POWERINFER_ERR_FORMAT, "'%s': tensor name '%.40s' is empty or longer than %d bytes",
                             path, name, GGML_MAX_NAME - 1);
        free(name);
        return rc;
    }
    snprintf(ti->name, sizeof(ti->name), "%s", name);
    free(name);

    uint32_t n_dims, type;
    if (!take(c, &n_dims, sizeof(n_dims))) {
        return bad(path, "a tensor info is truncated");
    }
    if (n_dims == 0 || n_dims > GGML_MAX_DIMS) {
        return pi_fail(POWERINFER_ERR_FORMAT, "'%s': tensor '%s' has %u dimensions", path, ti->name, n_dims);
    }
    // nonzero: the product of the nonzero dimensions, which must fit an int64 (as gguf.h
    // requires); an empty dimension is allowed only with PI_GGUF_ALLOW_EMPTY.
    uint64_t nonzero = 1;
    bool empty = false;
    for (uint32_t d = 0; d < GGML_MAX_DIMS; ++d) {
        uint64_t ne = 1;
        if (d < n_dims && !take(c, &ne, sizeof(ne))) {
            return bad(path, "a tensor shape is truncated");
        }
        if (ne == 0 && !(flags & PI_GGUF_ALLOW_EMPTY)) {
            return pi_fail(POWERINFER_ERR_FORMAT, "'%s': tensor '%s' has an empty or overflowing shape", path, ti->name);
        }
        if (ne > (uint64_t) INT64_MAX || (ne != 0 && nonzero > (uint64_t) INT64_MAX / ne)) {
            return pi_fail(POWERINFER_ERR_FORMAT, "'%s': tensor '%s' has an empty or overflowing shape", path, ti->name);
        }
        ti->ne[d] = (int64_t) ne;
        nonzero *= ne != 0 ? ne : 1;
        empty |= ne == 0;
    }
    if (!take(c, &type, sizeof(type)) || !take(c, &ti->offset, sizeof(ti->offset))) {
        return bad(path, "a tensor info is truncated");
    }
    const enum ggml_type t = translate_type(type, flags);
    if ((uint32_t) t >= GGML_TYPE_COUNT || ggml_type_size(t) == 0 || ggml_blck_size(t) <= 0) {
        return pi_fail(POWERINFER_ERR_FORMAT, "'%s': tensor '%s' has an unknown type %u", path, ti->name, type);
    }
    ti->type = t;
    if (ti->ne[0] % ggml_blck_size(t) != 0) {
        return pi_fail(POWERINFER_ERR_FORMAT, "'%s': tensor '%s' row of %lld is not a multiple of the %s block size",
                       path, ti->name, (long long) ti->ne[0], ggml_type_name(t));
    }
    if (empty) {
        ti->nbytes = 0;
        return POWERINFER_OK;
    }
    // Byte size, with the overflow check gguf.h would do.
    const uint64_t rows = nonzero / (uint64_t) ti->ne[0];
    const uint64_t row  = (uint64_t) (ti->ne[0] / ggml_blck_size(t)) * ggml_type_size(t);
    if (row != 0 && rows > UINT64_MAX / row) {
        return pi_fail(POWERINFER_ERR_FORMAT, "'%s': tensor '%s' size overflows", path, ti->name);
    }
    ti->nbytes = rows * row;
    return POWERINFER_OK;
}

// ---- the file ----------------------------------------------------------------------

static int32_t read_tensor_infos(struct cursor * c, struct pi_gguf_file * out, uint64_t n_tensors, uint32_t flags,
                                 const char * path) {
    // Allocated only now, from a count the bytes left can hold.
    if (n_tensors > remaining(c) / MIN_TENSOR_INFO_BYTES) {
        return pi_fail(POWERINFER_ERR_FORMAT,
                       "'%s' is truncated: its header announces %llu tensors, more than its last %llu bytes can describe",
                       path, (unsigned long long) n_tensors, (unsigned long long) remaining(c));
    }
    out->tensors = calloc(n_tensors ? n_tensors : 1, sizeof(*out->tensors));
    struct name_set names = { 0 };
    if (!out->tensors || !name_set_init(&names, n_tensors, tensor_name, out->tensors)) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    int32_t rc = POWERINFER_OK;
    for (uint64_t i = 0; i < n_tensors && rc == POWERINFER_OK; ++i) {
        rc = read_tensor_info(c, &out->tensors[i], flags, path);
        if (rc == POWERINFER_OK && name_set_has(&names, out->tensors[i].name)) {
            rc = pi_fail(POWERINFER_ERR_FORMAT, "'%s': tensor '%s' appears twice", path, out->tensors[i].name);
        }
        if (rc == POWERINFER_OK) {
            name_set_add(&names, out->tensors[i].name, (int64_t) i);
            out->n_tensors = (int64_t) i + 1;
        }
    }
    name_set_free(&names);
    return rc;
}

// Alignment of every tensor, and its data inside the file (all compared with what is
// left, so nothing wraps).
static int32_t check_tensor_data(const struct pi_gguf_file * f, uint64_t size, uint32_t alignment, const char * path) {
    for (int64_t i = 0; i < f->n_tensors; ++i) {
        const struct pi_tensor_info * ti = &f->tensors[i];
        if (ti->offset % alignment != 0) {
            return pi_fail(POWERINFER_ERR_FORMAT, "'%s': tensor '%s' data is not aligned to %u bytes", path, ti->name,
                           alignment);
        }
        const uint64_t room = f->data_offset <= size ? size - f->data_offset : 0;
        if (f->data_offset > size || ti->offset > room || ti->nbytes > room - ti->offset) {
            return pi_fail(POWERINFER_ERR_FORMAT,
                           "'%s' is truncated: tensor '%s' needs %llu bytes at offset %llu of the data section, "
                           "which holds %llu bytes", path, ti->name, (unsigned long long) ti->nbytes,
                           (unsigned long long) ti->offset, (unsigned long long) room);
        }
    }
    return POWERINFER_OK;
}

int32_t pi_gguf_read_ex(const char * path, const uint8_t * data, uint64_t size, uint32_t flags, struct pi_gguf_file * out) {
    memset(out, 0, sizeof(*out));
    struct cursor c = { data, data + size };
    char     magic[4];
    uint32_t version;
    uint64_t n_tensors, n_kv;
    if (!take(&c, magic, 4) || !take(&c, &version, 4) || !take(&c, &n_tensors, 8) || !take(&c, &n_kv, 8)) {
        return bad(path, "the header is truncated");
    }
    if (version != 3) {
        return pi_fail(POWERINFER_ERR_FORMAT, "'%s': GGUF version %u is not supported (expected 3)", path, version);
    }
    if (n_kv > PI_GGUF_MAX_KV || n_tensors > PI_GGUF_MAX_TENSORS) {
        return pi_fail(POWERINFER_ERR_FORMAT, "'%s': implausible counts (%llu key/value pairs, %llu tensors)", path,
                       (unsigned long long) n_kv, (unsigned long long) n_tensors);
    }
    // Both counts are capped above, so these products cannot overflow.
    if (n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES > remaining(&c)) {
        return pi_fail(POWERINFER_ERR_FORMAT,
                       "'%s' is truncated: its header announces %llu key/value pairs and %llu tensors, "
                       "more than its %llu bytes can hold", path, (unsigned long long) n_kv,
                       (unsigned long long) n_tensors, (unsigned long long) size);
    }
    out->gguf = gguf_init_empty();
    struct name_set keys = { 0 };
    if (!out->gguf || !name_set_init(&keys, n_kv, key_name, out->gguf)) {
        pi_gguf_file_free(out);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    int32_t rc = POWERINFER_OK;
    for (uint64_t i = 0; i < n_kv && rc == POWERINFER_OK; ++i) {
        rc = read_kv(&c, out->gguf, &keys, path);
    }
    name_set_free(&keys);
    if (rc == POWERINFER_OK) {
        rc = read_tensor_infos(&c, out, n_tensors, flags, path);
    }
    uint32_t alignment = 32;
    const int64_t ka = rc == POWERINFER_OK ? gguf_find_key(out->gguf, "general.alignment") : -1;
    if (ka >= 0) {
        alignment = gguf_get_val_u32(out->gguf, ka);  // type and value checked when read
    }
    if (rc == POWERINFER_OK) {
        const uint64_t pos = (uint64_t) (c.p - data);  // <= size, and alignment <= 2^31: no wrap
        out->data_offset = (pos + alignment - 1) / alignment * alignment;
        rc = check_tensor_data(out, size, alignment, path);
    }
    if (rc != POWERINFER_OK) {
        pi_gguf_file_free(out);
    }
    return rc;
}

int32_t pi_gguf_read(const char * path, const uint8_t * data, uint64_t size, struct pi_gguf_file * out) {
    return pi_gguf_read_ex(path, data, size, 0, out);
}

void pi_gguf_file_free(struct pi_gguf_file * f) {
    if (f->gguf) {
        gguf_free(f->gguf);
    }
    free(f->tensors);
    memset(f, 0, sizeof(*f));
}
