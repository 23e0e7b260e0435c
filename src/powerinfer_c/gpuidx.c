// gpuidx.c - PowerInfer's placement cache `<model>.generated.gpuidx`: which FFN neurons
// of each layer live on the device, for one device capacity. Read and written in
// PowerInfer's own layout so either program reuses the other's file.
#include "gpuidx.h"
#include "gguf_reader.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

// PowerInfer's layout (its powerinfer-py export_split.py, through its gguf-py): GGUF v3
// with the magic PWRI; the key/value pairs general.architecture = "generic.gpu_index",
// generic.gpu_index.block_count (u32) and split.vram_capacity (u64); then per layer N, in
// this order (PowerInfer reads them by position: 2N and 2N + 1), blk.N.gpu_idx (I32[n_ff],
// 1 = on the device) and blk.N.gpu_bucket (I32[k], the device neurons' ids ascending;
// k = 0 for a layer with none: an empty tensor). Its I32 is type code 18, the code of its
// (late 2023) ggml; today's ggml numbers I32 26 and has IQ3_XXS at 18. We write 18, so
// PowerInfer reads our files (26 would index past its type table), and read either.
// We add powerinfer.gpuidx.model_size / model_mtime_ns / n_ff, so a cache made for
// another file is not reused; PowerInfer ignores them.

#define PI_GPUIDX_ARCH      "generic.gpu_index"
#define PI_GPUIDX_ALIGNMENT 32
#define PI_GPUIDX_I32_CODE  18u  // PowerInfer's GGML_TYPE_I32
#define PI_GPUIDX_MAX_SIZE  (1ull << 31)

static bool model_file_id(const struct powerinfer_model * model, uint64_t id[2]) {
    struct stat st;
    if (!model->path || stat(model->path, &st) != 0) {
        return false;
    }
    id[0] = (uint64_t) st.st_size;
    id[1] = (uint64_t) st.st_mtim.tv_sec * 1000000000ull + (uint64_t) st.st_mtim.tv_nsec;
    return true;
}

// ---- writing -----------------------------------------------------------------------

struct bytes {
    uint8_t * p;
    size_t    n, cap;
    bool      failed;
};

static void put(struct bytes * b, const void * src, size_t n) {
    if (b->failed) {
        return;
    }
    if (b->cap - b->n < n) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap - b->n < n) {
            cap *= 2;
        }
        uint8_t * p = realloc(b->p, cap);
        if (!p) {
            b->failed = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void put_u32(struct bytes * b, uint32_t v) { put(b, &v, sizeof(v)); }
static void put_u64(struct bytes * b, uint64_t v) { put(b, &v, sizeof(v)); }
static void put_str(struct bytes * b, const char * s) { put_u64(b, strlen(s)); put(b, s, strlen(s)); }
static void put_pad(struct bytes * b) {
    static const uint8_t zeros[PI_GPUIDX_ALIGNMENT] = { 0 };
    put(b, zeros, (PI_GPUIDX_ALIGNMENT - b->n % PI_GPUIDX_ALIGNMENT) % PI_GPUIDX_ALIGNMENT);
}
static void put_kv_u32(struct bytes * b, const char * k, uint32_t v) { put_str(b, k); put_u32(b, GGUF_TYPE_UINT32); put_u32(b, v); }
static void put_kv_u64(struct bytes * b, const char * k, uint64_t v) { put_str(b, k); put_u32(b, GGUF_TYPE_UINT64); put_u64(b, v); }

static uint64_t padded(uint64_t n) {
    return (n + PI_GPUIDX_ALIGNMENT - 1) / PI_GPUIDX_ALIGNMENT * PI_GPUIDX_ALIGNMENT;
}

static void put_tensor_info(struct bytes * b, const char * fmt, int32_t il, uint64_t ne, uint64_t * offset) {
    char name[GGML_MAX_NAME];
    snprintf(name, sizeof(name), fmt, il);
    put_str(b, name);
    put_u32(b, 1);
    put_u64(b, ne);
    put_u32(b, PI_GPUIDX_I32_CODE);
    put_u64(b, *offset);
    *offset += padded(ne * sizeof(int32_t));
}

int32_t pi_gpuidx_write(const struct powerinfer_model * model, const char * path, uint64_t capacity,
                        const uint8_t * const * is_hot) {
    const int32_t n_layer = model->hp.n_layer, n_ff = model->hp.n_ff;
    uint64_t id[2] = { 0, 0 };
    model_file_id(model, id);
    int32_t * n_hot = calloc((size_t) n_layer + 1, sizeof(*n_hot));
    int32_t * row   = malloc(((size_t) n_ff + 1) * sizeof(*row));
    struct bytes b  = { 0 };
    if (!n_hot || !row) {
        free(n_hot);
        free(row);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory writing %s", path);
    }
    for (int32_t il = 0; il < n_layer; ++il) {
        for (int32_t i = 0; i < n_ff; ++i) {
            n_hot[il] += is_hot[il] && is_hot[il][i] ? 1 : 0;
        }
    }
    put(&b, "PWRI", 4);
    put_u32(&b, 3);
    put_u64(&b, 2 * (uint64_t) n_layer);
    put_u64(&b, 6);
    put_str(&b, "general.architecture");
    put_u32(&b, GGUF_TYPE_STRING);
    put_str(&b, PI_GPUIDX_ARCH);
    put_kv_u32(&b, PI_GPUIDX_ARCH ".block_count", (uint32_t) n_layer);
    put_kv_u64(&b, "split.vram_capacity", capacity);
    put_kv_u64(&b, "powerinfer.gpuidx.model_size", id[0]);
    put_kv_u64(&b, "powerinfer.gpuidx.model_mtime_ns", id[1]);
    put_kv_u32(&b, "powerinfer.gpuidx.n_ff", (uint32_t) n_ff);
    uint64_t offset = 0;
    for (int32_t il = 0; il < n_layer; ++il) {
        put_tensor_info(&b, "blk.%d.gpu_idx", il, (uint64_t) n_ff, &offset);
        put_tensor_info(&b, "blk.%d.gpu_bucket", il, (uint64_t) n_hot[il], &offset);
    }
    put_pad(&b);
    for (int32_t il = 0; il < n_layer; ++il) {
        for (int32_t i = 0; i < n_ff; ++i) {
            row[i] = is_hot[il] && is_hot[il][i] ? 1 : 0;
        }
        put(&b, row, (size_t) n_ff * sizeof(*row));
        put_pad(&b);
        for (int32_t i = 0, j = 0; i < n_ff; ++i) {
            if (is_hot[il] && is_hot[il][i]) row[j++] = i;
        }
        put(&b, row, (size_t) n_hot[il] * sizeof(*row));
        put_pad(&b);
    }
    free(n_hot);
    free(row);
    if (b.failed) {
        free(b.p);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory writing %s", path);
    }
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE * f = fopen(tmp, "wb");
    bool ok = f && fwrite(b.p, 1, b.n, f) == b.n;
    if (f) ok = fclose(f) == 0 && ok;
    free(b.p);
    if (!ok || rename(tmp, path) != 0) {
        const int err = errno;
        remove(tmp);
        return pi_fail(POWERINFER_ERR_IO, "cannot write the placement cache %s: %s", path, strerror(err));
    }
    return POWERINFER_OK;
}

// ---- reading -----------------------------------------------------------------------

static const struct pi_tensor_info * find_tensor(const struct pi_gguf_file * gf, const char * fmt, int32_t il) {
    char name[GGML_MAX_NAME];
    snprintf(name, sizeof(name), fmt, il);
    for (int64_t t = 0; t < gf->n_tensors; ++t) {
        if (strcmp(gf->tensors[t].name, name) == 0) return &gf->tensors[t];
    }
    return NULL;
}

static bool is_vector(const struct pi_tensor_info * ti, int64_t n) {
    return ti->type == GGML_TYPE_I32 && ti->ne[0] == n && ti->ne[1] == 1 && ti->ne[2] == 1 && ti->ne[3] == 1;
}

// Element i of an I32 tensor (the data may be unaligned: general.alignment can be 1).
static int32_t elem(const uint8_t * data, const struct pi_gguf_file * gf, const struct pi_tensor_info * ti, int64_t i) {
    int32_t v;
    memcpy(&v, data + gf->data_offset + ti->offset + (uint64_t) i * sizeof(v), sizeof(v));
    return v;
}

// A u32 key that must be absent or equal `want`.
static bool u32_key_is(const struct gguf_context * g, const char * key, uint32_t want) {
    const int64_t id = gguf_find_key(g, key);
    return id < 0 || (gguf_get_kv_type(g, id) == GGUF_TYPE_UINT32 && gguf_get_val_u32(g, id) == want);
}

static int32_t read_layer(const char * path, const uint8_t * data, const struct pi_gguf_file * gf, int32_t il,
                          int32_t n_ff, uint8_t * is_hot) {
    // pi_gguf_read_ex checked that each tensor's bytes lie inside data[0, size).
    const struct pi_tensor_info * idx = find_tensor(gf, "blk.%d.gpu_idx", il);
    if (!idx || !is_vector(idx, n_ff)) {
        return pi_fail(POWERINFER_ERR_FORMAT, "%s: blk.%d.gpu_idx is missing or not I32[%d]", path, il, n_ff);
    }
    int64_t k = 0;
    for (int32_t i = 0; i < n_ff; ++i) {
        const int32_t v = elem(data, gf, idx, i);
        if (v != 0 && v != 1) {
            return pi_fail(POWERINFER_ERR_FORMAT, "%s: blk.%d.gpu_idx[%d] = %d is not 0 or 1", path, il, i, v);
        }
        is_hot[i] = (uint8_t) v;
        k += v;
    }
    // The bucket (what PowerInfer gathers the device rows by) must name the same
    // neurons; a lone 0 for an empty layer is what our earlier versions wrote.
    const struct pi_tensor_info * bucket = find_tensor(gf, "blk.%d.gpu_bucket", il);
    if (!bucket) {
        return POWERINFER_OK;
    }
    const bool placeholder = k == 0 && is_vector(bucket, 1) && elem(data, gf, bucket, 0) == 0;
    if (placeholder) {
        return POWERINFER_OK;
    }
    if (!is_vector(bucket, k)) {
        return pi_fail(POWERINFER_ERR_FORMAT, "%s: blk.%d.gpu_bucket is not I32[%lld] (the neurons gpu_idx marks)",
                       path, il, (long long) k);
    }
    for (int32_t i = 0, j = 0; i < n_ff; ++i) {
        if (is_hot[i] && elem(data, gf, bucket, j++) != i) {
            return pi_fail(POWERINFER_ERR_FORMAT, "%s: blk.%d.gpu_bucket[%d] is not neuron %d, which gpu_idx marks",
                           path, il, j - 1, i);
        }
    }
    return POWERINFER_OK;
}

int32_t pi_gpuidx_parse(const char * path, const uint8_t * data, uint64_t size, int32_t n_layer, int32_t n_ff,
                        const uint64_t * model_id, uint64_t * capacity, uint8_t ** is_hot) {
    if (n_layer <= 0 || n_ff <= 0) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "%s: no layers to read", path);
    }
    if (size < 8 || memcmp(data, "PWRI", 4) != 0) {
        return pi_fail(POWERINFER_ERR_FORMAT, "%s is not a PWRI placement file", path);
    }
    struct pi_gguf_file gf;
    int32_t rc = pi_gguf_read_ex(path, data, size, PI_GGUF_LEGACY_INT_TYPES | PI_GGUF_ALLOW_EMPTY, &gf);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    const struct gguf_context * g = gf.gguf;
    int64_t id = gguf_find_key(g, "general.architecture");
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_STRING || strcmp(gguf_get_val_str(g, id), PI_GPUIDX_ARCH) != 0) {
        rc = pi_fail(POWERINFER_ERR_FORMAT, "%s: general.architecture is not %s", path, PI_GPUIDX_ARCH);
    }
    id = gguf_find_key(g, "split.vram_capacity");
    if (rc == POWERINFER_OK && (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_UINT64)) {
        rc = pi_fail(POWERINFER_ERR_FORMAT, "%s: split.vram_capacity (u64) is missing", path);
    }
    if (rc == POWERINFER_OK) {
        *capacity = gguf_get_val_u64(g, id);
    }
    if (rc == POWERINFER_OK && (!u32_key_is(g, PI_GPUIDX_ARCH ".block_count", (uint32_t) n_layer) ||
                                !u32_key_is(g, "powerinfer.gpuidx.n_ff", (uint32_t) n_ff))) {
        rc = pi_fail(POWERINFER_ERR_FORMAT, "%s was made for a model of another shape (not %d layers of %d neurons)",
                     path, n_layer, n_ff);
    }
    if (rc == POWERINFER_OK && model_id) {
        // Ours: the model file it was made for (PowerInfer's files do not say).
        const int64_t is = gguf_find_key(g, "powerinfer.gpuidx.model_size");
        const int64_t it = gguf_find_key(g, "powerinfer.gpuidx.model_mtime_ns");
        if (is >= 0 && it >= 0 &&
            (gguf_get_kv_type(g, is) != GGUF_TYPE_UINT64 || gguf_get_kv_type(g, it) != GGUF_TYPE_UINT64 ||
             gguf_get_val_u64(g, is) != model_id[0] || gguf_get_val_u64(g, it) != model_id[1])) {
            rc = pi_fail(POWERINFER_ERR_FORMAT, "%s was made for another version of the model file", path);
        }
    }
    for (int32_t il = 0; rc == POWERINFER_OK && il < n_layer; ++il) {
        rc = read_layer(path, data, &gf, il, n_ff, is_hot[il]);
    }
    pi_gguf_file_free(&gf);
    return rc;
}

// Reads a gpuidx file; is_hot[il] (n_ff bytes each, caller-allocated) receives the device
// sets. *capacity gets split.vram_capacity. Returns POWERINFER_OK, or a negative status
// with the reason when the file is absent, malformed or made for another model.
int32_t pi_gpuidx_read(const struct powerinfer_model * model, const char * path, uint64_t * capacity, uint8_t ** is_hot) {
    FILE * f = fopen(path, "rb");
    if (!f) {
        return pi_fail(POWERINFER_ERR_IO, "no placement cache %s", path);
    }
    struct stat st;
    uint8_t * data = NULL;
    uint64_t size = 0;
    if (fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0 &&
        (uint64_t) st.st_size < PI_GPUIDX_MAX_SIZE) {
        size = (uint64_t) st.st_size;
        data = malloc((size_t) size);
        if (data && fread(data, 1, (size_t) size, f) != (size_t) size) {
            free(data);
            data = NULL;
        }
    }
    fclose(f);
    if (!data) {
        return pi_fail(POWERINFER_ERR_IO, "cannot read the placement cache %s", path);
    }
    uint64_t id[2];
    const bool have_id = model_file_id(model, id);
    const int32_t rc = pi_gpuidx_parse(path, data, size, model->hp.n_layer, model->hp.n_ff, have_id ? id : NULL,
                                       capacity, is_hot);
    free(data);
    return rc;
}
