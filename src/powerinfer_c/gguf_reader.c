// gguf_reader.c - our own reader of the GGUF layout (header, key/value pairs, tensor
// infos), used for PowerInfer's "PWRI" files: GGUF v3 with another magic, which
// gguf.h rejects. Every count, length and size is checked against the bytes that are
// actually there before it is used; the result is a gguf_context holding the same
// key/value pairs (so metadata code is shared with standard files) and a list of
// tensor infos.
#include "gguf_reader.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PI_GGUF_MAX_KV      (1u << 20)
#define PI_GGUF_MAX_TENSORS (1u << 20)

struct cursor {
    const uint8_t * p;
    const uint8_t * end;
};

static bool take(struct cursor * c, void * dst, size_t n) {
    if ((size_t) (c->end - c->p) < n) {
        return false;
    }
    memcpy(dst, c->p, n);
    c->p += n;
    return true;
}

// A length-prefixed string, returned NUL-terminated in a fresh allocation.
static char * take_str(struct cursor * c) {
    uint64_t len;
    if (!take(c, &len, sizeof(len)) || len > (uint64_t) (c->end - c->p)) {
        return NULL;
    }
    char * s = malloc(len + 1);
    if (!s) {
        return NULL;
    }
    memcpy(s, c->p, len);
    s[len] = '\0';
    c->p += len;
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

// Reads one key/value pair into g.
static int32_t read_kv(struct cursor * c, struct gguf_context * g, const char * path) {
    const uint8_t * key_start = c->p + sizeof(uint64_t);
    char * key = take_str(c);
    if (!key) {
        return bad(path, "a key is truncated");
    }
    int32_t rc = POWERINFER_OK;
    uint32_t type;
    if (*key == '\0' || (size_t) (c->p - key_start) != strlen(key)) {
        rc = bad(path, "a key is empty or contains a NUL byte");
    } else if (gguf_find_key(g, key) >= 0) {
        rc = pi_fail(POWERINFER_ERR_FORMAT, "'%s' is not a valid PowerInfer GGUF file: key '%s' appears twice", path, key);
    } else if (!take(c, &type, sizeof(type)) || type >= GGUF_TYPE_COUNT) {
        rc = pi_fail(POWERINFER_ERR_FORMAT, "'%s' is not a valid PowerInfer GGUF file: key '%s' has a bad type", path, key);
    } else if (strcmp(key, "general.alignment") == 0 && type != GGUF_TYPE_UINT32) {
        rc = pi_fail(POWERINFER_ERR_FORMAT, "'%s' is not a valid PowerInfer GGUF file: key '%s' has a bad type", path, key);
    } else if (type == GGUF_TYPE_STRING) {
        char * s = take_str(c);
        if (!s) rc = bad(path, "a string value is truncated");
        else { gguf_set_val_str(g, key, s); free(s); }
    } else if (type == GGUF_TYPE_ARRAY) {
        uint32_t et;
        uint64_t n;
        if (!take(c, &et, sizeof(et)) || !take(c, &n, sizeof(n))) {
            rc = bad(path, "an array header is truncated");
        } else if (et == GGUF_TYPE_STRING) {
            // Each string needs at least its 8-byte length: bound n before allocating.
            if (n > (uint64_t) (c->end - c->p) / 8) {
                rc = bad(path, "an array of strings is longer than the file");
            } else {
                char ** strs = calloc(n ? n : 1, sizeof(char *));
                uint64_t i = 0;
                for (; strs && i < n; ++i) {
                    if (!(strs[i] = take_str(c))) break;
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
            if (n > (uint64_t) (c->end - c->p) / es) {
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
    free(key);
    return rc;
}

static int32_t read_tensor_info(struct cursor * c, struct pi_tensor_info * ti, const char * path) {
    const uint8_t * name_start = c->p + sizeof(uint64_t);
    char * name = take_str(c);
    if (!name) {
        return bad(path, "a tensor name is truncated");
    }
    if (strlen(name) >= GGML_MAX_NAME || strlen(name) == 0 || (size_t) (c->p - name_start) != strlen(name)) {
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
    int64_t nelem = 1;
    for (uint32_t d = 0; d < GGML_MAX_DIMS; ++d) {
        uint64_t ne = 1;
        if (d < n_dims && !take(c, &ne, sizeof(ne))) {
            return bad(path, "a tensor shape is truncated");
        }
        if (ne == 0 || ne > (uint64_t) INT64_MAX || (uint64_t) nelem > (uint64_t) INT64_MAX / ne) {
            return pi_fail(POWERINFER_ERR_FORMAT, "'%s': tensor '%s' has an empty or overflowing shape", path, ti->name);
        }
        ti->ne[d] = (int64_t) ne;
        nelem *= (int64_t) ne;
    }
    if (!take(c, &type, sizeof(type)) || !take(c, &ti->offset, sizeof(ti->offset))) {
        return bad(path, "a tensor info is truncated");
    }
    if (type >= GGML_TYPE_COUNT || ggml_type_size((enum ggml_type) type) == 0 ||
        ggml_blck_size((enum ggml_type) type) <= 0) {
        return pi_fail(POWERINFER_ERR_FORMAT, "'%s': tensor '%s' has an unknown type %u", path, ti->name, type);
    }
    ti->type = (enum ggml_type) type;
    if (ti->ne[0] % ggml_blck_size(ti->type) != 0) {
        return pi_fail(POWERINFER_ERR_FORMAT, "'%s': tensor '%s' row of %lld is not a multiple of the %s block size",
                       path, ti->name, (long long) ti->ne[0], ggml_type_name(ti->type));
    }
    // Byte size, with the overflow check gguf.h would do.
    const uint64_t rows = (uint64_t) (nelem / ti->ne[0]);
    const uint64_t row  = (uint64_t) (ti->ne[0] / ggml_blck_size(ti->type)) * ggml_type_size(ti->type);
    if (row != 0 && rows > UINT64_MAX / row) {
        return pi_fail(POWERINFER_ERR_FORMAT, "'%s': tensor '%s' size overflows", path, ti->name);
    }
    ti->nbytes = rows * row;
    return POWERINFER_OK;
}

int32_t pi_gguf_read(const char * path, const uint8_t * data, uint64_t size, struct pi_gguf_file * out) {
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
    out->gguf = gguf_init_empty();
    out->tensors = calloc(n_tensors ? n_tensors : 1, sizeof(*out->tensors));
    if (!out->gguf || !out->tensors) {
        pi_gguf_file_free(out);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    int32_t rc = POWERINFER_OK;
    for (uint64_t i = 0; i < n_kv && rc == POWERINFER_OK; ++i) {
        rc = read_kv(&c, out->gguf, path);
    }
    for (uint64_t i = 0; i < n_tensors && rc == POWERINFER_OK; ++i) {
        rc = read_tensor_info(&c, &out->tensors[i], path);
        for (uint64_t j = 0; j < i && rc == POWERINFER_OK; ++j) {
            if (strcmp(out->tensors[j].name, out->tensors[i].name) == 0) {
                rc = pi_fail(POWERINFER_ERR_FORMAT, "'%s': tensor '%s' appears twice", path, out->tensors[i].name);
            }
        }
        out->n_tensors = (int64_t) i + 1;
    }
    uint32_t alignment = 32;
    const int64_t ka = rc == POWERINFER_OK ? gguf_find_key(out->gguf, "general.alignment") : -1;
    if (ka >= 0) {
        alignment = gguf_get_val_u32(out->gguf, ka);  // type and value checked when read
    }
    if (rc == POWERINFER_OK) {
        const uint64_t pos = (uint64_t) (c.p - data);
        out->data_offset = (pos + alignment - 1) / alignment * alignment;
        for (int64_t i = 0; i < out->n_tensors && rc == POWERINFER_OK; ++i) {
            if (out->tensors[i].offset % alignment != 0) {
                rc = pi_fail(POWERINFER_ERR_FORMAT, "'%s': tensor '%s' data is not aligned to %u bytes", path,
                             out->tensors[i].name, alignment);
            }
        }
    }
    if (rc != POWERINFER_OK) {
        pi_gguf_file_free(out);
    }
    return rc;
}

void pi_gguf_file_free(struct pi_gguf_file * f) {
    if (f->gguf) {
        gguf_free(f->gguf);
    }
    free(f->tensors);
    memset(f, 0, sizeof(*f));
}
