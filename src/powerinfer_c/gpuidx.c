// gpuidx.c - PowerInfer's placement cache `<model>.generated.gpuidx`: which FFN neurons
// of each layer live on the device, for one device capacity. Read and written in
// PowerInfer's own layout so either program reuses the other's file.
#include "powerinfer-impl.h"
#include "gguf_reader.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

// PowerInfer's layout: GGUF v3 with the magic PWRI, general.architecture =
// "generic.gpu_index", generic.gpu_index.block_count, split.vram_capacity (u64), and per
// layer blk.N.gpu_idx (I32[n_ff], 1 = device) and blk.N.gpu_bucket (I32[k], ascending
// ids). We add powerinfer.gpuidx.model_size / model_mtime_ns / n_ff, so a cache made for
// another file is not reused. An empty bucket is written as one element (0) because a
// GGUF tensor cannot be empty; gpu_idx is what both readers trust.

#define PI_GPUIDX_ARCH "generic.gpu_index"

static bool model_file_id(const struct powerinfer_model * model, uint64_t * size, uint64_t * mtime_ns) {
    struct stat st;
    if (stat(model->path, &st) != 0) {
        return false;
    }
    *size     = (uint64_t) st.st_size;
    *mtime_ns = (uint64_t) st.st_mtim.tv_sec * 1000000000ull + (uint64_t) st.st_mtim.tv_nsec;
    return true;
}

int32_t pi_gpuidx_write(const struct powerinfer_model * model, const char * path, uint64_t capacity,
                        const uint8_t * const * is_hot) {
    const int32_t n_layer = model->hp.n_layer, n_ff = model->hp.n_ff;
    struct ggml_init_params ip = {
        .mem_size   = (size_t) 2 * n_layer * (ggml_tensor_overhead() + sizeof(int32_t) * (size_t) n_ff + 64) + 1024,
        .mem_buffer = NULL,
        .no_alloc   = false,
    };
    struct ggml_context * tctx = ggml_init(ip);
    struct gguf_context * g    = gguf_init_empty();
    if (!tctx || !g) {
        if (tctx) ggml_free(tctx);
        if (g) gguf_free(g);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory writing %s", path);
    }
    uint64_t size = 0, mtime = 0;
    model_file_id(model, &size, &mtime);
    gguf_set_val_str(g, "general.architecture", PI_GPUIDX_ARCH);
    gguf_set_val_u32(g, PI_GPUIDX_ARCH ".block_count", (uint32_t) n_layer);
    gguf_set_val_u64(g, "split.vram_capacity", capacity);
    gguf_set_val_u64(g, "powerinfer.gpuidx.model_size", size);
    gguf_set_val_u64(g, "powerinfer.gpuidx.model_mtime_ns", mtime);
    gguf_set_val_u32(g, "powerinfer.gpuidx.n_ff", (uint32_t) n_ff);
    for (int32_t il = 0; il < n_layer; ++il) {
        struct ggml_tensor * idx = ggml_new_tensor_1d(tctx, GGML_TYPE_I32, n_ff);
        int32_t * d = idx->data;
        int32_t k = 0;
        for (int32_t i = 0; i < n_ff; ++i) {
            d[i] = is_hot[il] && is_hot[il][i] ? 1 : 0;
            k += d[i];
        }
        struct ggml_tensor * bucket = ggml_new_tensor_1d(tctx, GGML_TYPE_I32, k > 0 ? k : 1);
        int32_t * bd = bucket->data;
        bd[0] = 0;
        for (int32_t i = 0, j = 0; i < n_ff; ++i) {
            if (d[i]) bd[j++] = i;
        }
        ggml_format_name(idx, "blk.%d.gpu_idx", il);
        ggml_format_name(bucket, "blk.%d.gpu_bucket", il);
        gguf_add_tensor(g, idx);
        gguf_add_tensor(g, bucket);
    }
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    bool ok = gguf_write_to_file(g, tmp, false);
    gguf_free(g);
    ggml_free(tctx);
    FILE * f = ok ? fopen(tmp, "r+b") : NULL;
    ok = f && fwrite("PWRI", 1, 4, f) == 4;
    if (f) ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        remove(tmp);
        return pi_fail(POWERINFER_ERR_IO, "cannot write the placement cache %s: %s", path, strerror(errno));
    }
    return POWERINFER_OK;
}

// Reads a gpuidx file; is_hot[il] (n_ff bytes each, caller-allocated) receives the device
// sets. *capacity gets split.vram_capacity. Returns POWERINFER_OK, or a negative status
// with the reason when the file is absent, malformed or made for another model.
int32_t pi_gpuidx_read(const struct powerinfer_model * model, const char * path, uint64_t * capacity, uint8_t ** is_hot) {
    const int32_t n_layer = model->hp.n_layer, n_ff = model->hp.n_ff;
    FILE * f = fopen(path, "rb");
    if (!f) {
        return pi_fail(POWERINFER_ERR_IO, "no placement cache %s", path);
    }
    uint8_t * data = NULL;
    long size = -1;
    if (fseek(f, 0, SEEK_END) == 0 && (size = ftell(f)) > 0 && size < (1l << 31) && fseek(f, 0, SEEK_SET) == 0) {
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
    struct pi_gguf_file gf;
    int32_t rc = size < 8 || memcmp(data, "PWRI", 4) != 0
        ? pi_fail(POWERINFER_ERR_FORMAT, "%s is not a PWRI placement file", path)
        : pi_gguf_read(path, data, (uint64_t) size, &gf);
    if (rc != POWERINFER_OK) {
        free(data);
        return rc;
    }
    int64_t id = gguf_find_key(gf.gguf, "general.architecture");
    if (id < 0 || gguf_get_kv_type(gf.gguf, id) != GGUF_TYPE_STRING || strcmp(gguf_get_val_str(gf.gguf, id), PI_GPUIDX_ARCH) != 0) {
        rc = pi_fail(POWERINFER_ERR_FORMAT, "%s: general.architecture is not %s", path, PI_GPUIDX_ARCH);
    }
    id = gguf_find_key(gf.gguf, "split.vram_capacity");
    if (rc == POWERINFER_OK && (id < 0 || gguf_get_kv_type(gf.gguf, id) != GGUF_TYPE_UINT64)) {
        rc = pi_fail(POWERINFER_ERR_FORMAT, "%s: split.vram_capacity (u64) is missing", path);
    }
    if (rc == POWERINFER_OK) {
        *capacity = gguf_get_val_u64(gf.gguf, id);
        // Ours: the model file it was made for (PowerInfer's files do not say).
        uint64_t msize = 0, mtime = 0;
        const int64_t is = gguf_find_key(gf.gguf, "powerinfer.gpuidx.model_size");
        const int64_t it = gguf_find_key(gf.gguf, "powerinfer.gpuidx.model_mtime_ns");
        if (is >= 0 && it >= 0 && model_file_id(model, &msize, &mtime) &&
            (gguf_get_kv_type(gf.gguf, is) != GGUF_TYPE_UINT64 || gguf_get_kv_type(gf.gguf, it) != GGUF_TYPE_UINT64 ||
             gguf_get_val_u64(gf.gguf, is) != msize || gguf_get_val_u64(gf.gguf, it) != mtime)) {
            rc = pi_fail(POWERINFER_ERR_FORMAT, "%s was made for another version of the model file", path);
        }
    }
    for (int32_t il = 0; rc == POWERINFER_OK && il < n_layer; ++il) {
        char name[GGML_MAX_NAME];
        snprintf(name, sizeof(name), "blk.%d.gpu_idx", il);
        const struct pi_tensor_info * ti = NULL;
        for (int64_t t = 0; t < gf.n_tensors; ++t) {
            if (strcmp(gf.tensors[t].name, name) == 0) ti = &gf.tensors[t];
        }
        if (!ti || ti->type != GGML_TYPE_I32 || ti->ne[0] != n_ff || ti->ne[1] != 1 ||
            gf.data_offset + ti->offset + ti->nbytes > (uint64_t) size) {
            rc = pi_fail(POWERINFER_ERR_FORMAT, "%s: %s is missing or not I32[%d]", path, name, n_ff);
            break;
        }
        const int32_t * d = (const int32_t *) (data + gf.data_offset + ti->offset);
        for (int32_t i = 0; i < n_ff; ++i) {
            if (d[i] != 0 && d[i] != 1) {
                rc = pi_fail(POWERINFER_ERR_FORMAT, "%s: %s[%d] = %d is not 0 or 1", path, name, i, d[i]);
                break;
            }
            is_hot[il][i] = (uint8_t) d[i];
        }
    }
    pi_gguf_file_free(&gf);
    free(data);
    return rc;
}
