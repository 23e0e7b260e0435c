// placement.c - which FFN neurons go on the device: the group solver (public, so tests
// can compare it with brute force) and the `<model>.generated.gpuidx` cache that
// PowerInfer reads and writes.
#include "powerinfer-impl.h"
#include "gguf_reader.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

// ---- the solver --------------------------------------------------------------------
//
// Neurons of a layer are sorted by activation count and taken in groups of a fixed size
// (the device tensors' row granularity), so a layer's device set is always a prefix of
// its sorted groups and group values never increase along a layer. The objective is the
// expected activated mass on the device (sum of the chosen groups' counts) under the
// byte budget, with an optional per-layer cap on the groups (the compute-balance bound:
// the device never takes more than a set share of a layer).
//
// When every layer's group costs the same number of bytes the problem is a partition
// matroid (at most max_groups[l] from layer l, at most budget/cost in all) with a linear
// objective, so taking groups by value, best first, is optimal; ties are broken by
// (layer, group) order, which keeps every layer's choice a prefix. With unequal costs
// (layers of different types) greedy by value per byte can be beaten, so a dynamic
// programme over layers and budget units (the gcd of the costs) solves it exactly when
// the table is small enough, and greedy by value per byte is the fallback.

struct pi_group_ref {
    double  value;
    int32_t layer;
    int32_t group;
};

static int cmp_group_ref(const void * a, const void * b) {
    const struct pi_group_ref * x = a, * y = b;
    if (x->value != y->value) return x->value > y->value ? -1 : 1;
    if (x->layer != y->layer) return x->layer < y->layer ? -1 : 1;
    return x->group < y->group ? -1 : x->group > y->group;
}

static uint64_t gcd_u64(uint64_t a, uint64_t b) {
    while (b) { uint64_t t = a % b; a = b; b = t; }
    return a;
}

// Greedy by value (equal costs) or by value per byte; fills n_chosen.
static int32_t place_greedy(int32_t n_layer, int32_t n_groups, const double * values, const uint64_t * cost,
                            const int32_t * max_groups, uint64_t budget, int32_t * n_chosen) {
    struct pi_group_ref * refs = malloc(sizeof(*refs) * (size_t) n_layer * n_groups);
    if (!refs) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory in the placement solver");
    }
    size_t n = 0;
    for (int32_t l = 0; l < n_layer; ++l) {
        n_chosen[l] = 0;
        for (int32_t g = 0; g < max_groups[l]; ++g) {
            refs[n++] = (struct pi_group_ref) { values[(size_t) l * n_groups + g] / (double) cost[l], l, g };
        }
    }
    qsort(refs, n, sizeof(*refs), cmp_group_ref);
    uint64_t used = 0;
    for (size_t i = 0; i < n; ++i) {
        const int32_t l = refs[i].layer;
        // Keep prefixes: a group is taken only after the layer's better ones.
        if (refs[i].group != n_chosen[l] || used + cost[l] > budget) {
            continue;
        }
        used += cost[l];
        n_chosen[l]++;
    }
    free(refs);
    return POWERINFER_OK;
}

// Exact DP for unequal costs: best[l][b] = max mass from layers < l within b units.
static int32_t place_dp(int32_t n_layer, int32_t n_groups, const double * values, const uint64_t * cost,
                        const int32_t * max_groups, uint64_t units, uint64_t unit, int32_t * n_chosen) {
    const size_t W = (size_t) units + 1;
    double *  best = malloc(sizeof(double) * W * 2);
    int32_t * pick = malloc(sizeof(int32_t) * W * (size_t) n_layer);
    double *  pre  = malloc(sizeof(double) * ((size_t) n_groups + 1));
    if (!best || !pick || !pre) {
        free(best); free(pick); free(pre);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory in the placement solver");
    }
    double * cur = best, * nxt = best + W;
    for (size_t b = 0; b < W; ++b) cur[b] = 0.0;
    for (int32_t l = 0; l < n_layer; ++l) {
        const uint64_t c = cost[l] / unit;
        pre[0] = 0.0;
        for (int32_t g = 0; g < max_groups[l]; ++g) pre[g + 1] = pre[g] + values[(size_t) l * n_groups + g];
        for (size_t b = 0; b < W; ++b) {
            double  v = cur[b];
            int32_t k = 0;
            for (int32_t j = 1; j <= max_groups[l] && (uint64_t) j * c <= b; ++j) {
                const double w = cur[b - (size_t) j * c] + pre[j];
                if (w > v) { v = w; k = j; }
            }
            nxt[b] = v;
            pick[(size_t) l * W + b] = k;
        }
        double * t = cur; cur = nxt; nxt = t;
    }
    size_t b = W - 1;
    for (int32_t l = n_layer - 1; l >= 0; --l) {
        n_chosen[l] = pick[(size_t) l * W + b];
        b -= (size_t) n_chosen[l] * (cost[l] / unit);
    }
    free(best); free(pick); free(pre);
    return POWERINFER_OK;
}

#define PI_DP_MAX_CELLS 50000000ull

int32_t powerinfer_place_groups(int32_t n_layer, int32_t n_groups, const double * values, const uint64_t * cost,
                                const int32_t * max_groups, uint64_t budget, int32_t * n_chosen) {
    pi_clear_error();
    if (n_layer <= 0 || n_groups < 0 || !values || !cost || !max_groups || !n_chosen) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_place_groups: invalid arguments");
    }
    bool equal = true;
    uint64_t unit = 0;
    for (int32_t l = 0; l < n_layer; ++l) {
        if (cost[l] == 0 || max_groups[l] < 0 || max_groups[l] > n_groups) {
            return pi_fail(POWERINFER_ERR_INVALID_ARG, "layer %d: group cost must be > 0 and max_groups in [0, %d]", l, n_groups);
        }
        for (int32_t g = 1; g < max_groups[l]; ++g) {
            if (values[(size_t) l * n_groups + g] > values[(size_t) l * n_groups + g - 1]) {
                return pi_fail(POWERINFER_ERR_INVALID_ARG, "layer %d: group values must not increase", l);
            }
        }
        equal &= cost[l] == cost[0];
        unit = gcd_u64(unit, cost[l]);
    }
    if (equal) {
        return place_greedy(n_layer, n_groups, values, cost, max_groups, budget, n_chosen);
    }
    const uint64_t units = budget / unit;
    if ((units + 1) * (uint64_t) n_layer <= PI_DP_MAX_CELLS) {
        return place_dp(n_layer, n_groups, values, cost, max_groups, units, unit, n_chosen);
    }
    pi_log(POWERINFER_LOG_WARN, "powerinfer: placement: unequal layer costs and a large budget; greedy by value per byte\n");
    return place_greedy(n_layer, n_groups, values, cost, max_groups, budget, n_chosen);
}

// ---- activation counts ------------------------------------------------------------------

// Per-neuron counts of layer il from the model's `blk.N.ffn_act_count` (F32 [n_ff]) into
// out. Returns false when the model has none.
bool pi_model_act_counts(const struct powerinfer_model * model, int32_t il, float * out) {
    if (model->act_counts) {
        memcpy(out, model->act_counts + (size_t) il * model->hp.n_ff, sizeof(float) * (size_t) model->hp.n_ff);
        return true;
    }
    char name[GGML_MAX_NAME];
    snprintf(name, sizeof(name), "blk.%d.ffn_act_count", il);
    const struct ggml_tensor * t = ggml_get_tensor(model->ctx_meta, name);
    if (!t || t->type != GGML_TYPE_F32 || ggml_nelements(t) != model->hp.n_ff || !t->data) {
        return false;
    }
    memcpy(out, t->data, sizeof(float) * (size_t) model->hp.n_ff);
    for (int32_t i = 0; i < model->hp.n_ff; ++i) {
        if (!(out[i] >= 0.0f)) {
            return false;  // NaN or negative: not counts
        }
    }
    return true;
}

// ---- the gpuidx cache ---------------------------------------------------------------------
//
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

int32_t powerinfer_model_set_act_counts(struct powerinfer_model * model, const float * counts, int32_t n_layer, int32_t n_ff) {
    pi_clear_error();
    if (!model || !counts) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_model_set_act_counts: NULL argument");
    }
    if (n_layer != model->hp.n_layer || n_ff != model->hp.n_ff) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "activation counts are %d x %d; the model has %d layers of %d neurons",
                       n_layer, n_ff, model->hp.n_layer, model->hp.n_ff);
    }
    if (model->split.decided) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "activation counts must be set before the first context is made");
    }
    for (size_t i = 0; i < (size_t) n_layer * n_ff; ++i) {
        if (!(counts[i] >= 0.0f) || isinf(counts[i])) {
            return pi_fail(POWERINFER_ERR_INVALID_ARG, "activation count %zu (layer %zu) = %g is not a finite count >= 0",
                           i % (size_t) n_ff, i / (size_t) n_ff, counts[i]);
        }
    }
    float * c = malloc(sizeof(float) * (size_t) n_layer * n_ff);
    if (!c) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    memcpy(c, counts, sizeof(float) * (size_t) n_layer * n_ff);
    free(model->act_counts);
    model->act_counts = c;
    return POWERINFER_OK;
}
