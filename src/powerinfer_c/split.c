// split.c - hybrid placement: under a device memory budget, copy the dense parts and the
// hottest FFN neurons of a model to the device, and let the CPU sparse operators skip
// those neurons. Without a GPU backend the same path runs with the "device" emulated by
// a CPU buffer (POWERINFER_EMULATE_DEVICE=1 or model params .emulate_device), which is
// how the tests check the split, the accounting and the results.
//
// Placement order (first failure stops the dense classes, as in PowerInfer):
//   1. attention weights and attn_norm, layer by layer from layer 0 (every token reads
//      all of them: the most bytes of dense work saved per device byte);
//   2. the predictors fc1/fc2 (dense, read every token in predictor mode);
//   3. ffn_norm;
//   4. output_norm and the output (LM head) matrix;
//   5. the context's KV cache, when everything above fit;
//   6. the compute buffers, as measured by ggml's scheduler on this graph;
//   7. what is left: FFN neurons, hottest first, chosen by powerinfer_place_groups from
//      per-neuron activation counts, or reused from <model>.generated.gpuidx.
// Every byte is counted from the sizes ggml's allocator reports, in 64 bits, and the
// result is checked against the budget after the compute buffers are measured again
// with the FFN rows in place; the FFN share shrinks until it fits.
#include "powerinfer-impl.h"

#include "ggml-cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PI_DEVICE_MARGIN (512ull << 20)  // kept free on a real device when the budget is automatic
#define PI_MAX_DENSE     (16 * PI_MAX_LAYERS + 8)

static bool env_flag(const char * name) {
    const char * v = getenv(name);
    return v && *v && strcmp(v, "0") != 0;
}

// ---- device discovery --------------------------------------------------------------------

static void find_device(struct pi_split * sp, bool emulate) {
    if (emulate) {
        sp->emulated = true;
        sp->buft     = ggml_backend_cpu_buffer_type();
        snprintf(sp->device, sizeof(sp->device), "CPU emulation");
        return;
    }
    static bool loaded = false;
    if (!loaded) {
        ggml_backend_load_all();  // backends built as loadable modules (no-op when linked in)
        loaded = true;
    }
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        const enum ggml_backend_dev_type type = ggml_backend_dev_type(dev);
        if (type != GGML_BACKEND_DEVICE_TYPE_GPU && type != GGML_BACKEND_DEVICE_TYPE_IGPU) {
            continue;
        }
        ggml_backend_t backend = ggml_backend_dev_init(dev, NULL);
        if (!backend) {
            continue;
        }
        sp->backend = backend;
        sp->buft    = ggml_backend_dev_buffer_type(dev);
        snprintf(sp->device, sizeof(sp->device), "%s (%s)", ggml_backend_dev_name(dev), ggml_backend_dev_description(dev));
        return;
    }
}

static uint64_t free_device_memory(const struct pi_split * sp) {
    if (!sp->backend) {
        return 0;
    }
    size_t free_b = 0, total_b = 0;
    ggml_backend_dev_memory(ggml_backend_get_device(sp->backend), &free_b, &total_b);
    return free_b;
}

// Bytes a tensor of this shape takes in the device buffer (alignment included).
static uint64_t alloc_size(ggml_backend_buffer_type_t buft, const struct ggml_tensor * t) {
    const uint64_t align = ggml_backend_buft_get_alignment(buft);
    const uint64_t n     = ggml_backend_buft_get_alloc_size(buft, (struct ggml_tensor *) t);
    return (n + align - 1) / align * align;
}

// ---- dense classes -----------------------------------------------------------------------

struct dense_item {
    struct ggml_tensor ** slot;  // the model's pointer to redirect
    int32_t               group; // items of one group are placed together
};

static int32_t collect_dense(struct powerinfer_model * model, struct dense_item * items) {
    int32_t n = 0, g = 0;
    const int32_t n_layer = model->hp.n_layer;
    for (int32_t il = 0; il < n_layer; ++il, ++g) {
        struct pi_layer * l = &model->layers[il];
        struct ggml_tensor ** s[] = { &l->attn_norm, &l->attn_norm_b, &l->attn_norm_2, &l->attn_norm_2_b, &l->wqkv,
                                      &l->wq, &l->wk, &l->wv, &l->wo, &l->bq, &l->bk, &l->bv };
        for (size_t i = 0; i < sizeof(s) / sizeof(s[0]); ++i) {
            if (*s[i]) items[n++] = (struct dense_item) { s[i], g };
        }
    }
    if (model->hp.sparse_mode == POWERINFER_SPARSE_PREDICTOR) {
        for (int32_t il = 0; il < n_layer; ++il, ++g) {
            items[n++] = (struct dense_item) { &model->layers[il].fc1, g };
            items[n++] = (struct dense_item) { &model->layers[il].fc2, g };
        }
    }
    for (int32_t il = 0; il < n_layer && model->layers[il].ffn_norm; ++il, ++g) {
        items[n++] = (struct dense_item) { &model->layers[il].ffn_norm, g };
    }
    items[n++] = (struct dense_item) { &model->output_norm, g };
    if (model->output_norm_b) items[n++] = (struct dense_item) { &model->output_norm_b, g };
    items[n++] = (struct dense_item) { &model->output, g };
    return n;
}

// The tensor's bytes as stored in the file (repacked tensors keep the original there).
static const struct ggml_tensor * original(const struct powerinfer_model * model, const struct ggml_tensor * t) {
    const struct ggml_tensor * o = ggml_get_tensor(model->ctx_meta, ggml_get_name(t));
    return o && o->data && o->type == t->type && ggml_nbytes(o) == ggml_nbytes(t) ? o : NULL;
}

// Copies the first n_items of items to the device (sets sp->bytes_dense).
static int32_t place_dense(struct powerinfer_model * model, struct dense_item * items, int32_t n_items) {
    struct pi_split * sp = &model->split;
    if (n_items == 0) {
        return POWERINFER_OK;
    }
    struct ggml_init_params ip = { .mem_size = (size_t) (n_items + 1) * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true };
    sp->ctx_dense = ggml_init(ip);
    struct ggml_tensor ** copies = malloc(sizeof(*copies) * (size_t) n_items);
    if (!sp->ctx_dense || !copies) {
        free(copies);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    for (int32_t i = 0; i < n_items; ++i) {
        copies[i] = ggml_dup_tensor(sp->ctx_dense, *items[i].slot);
        ggml_set_name(copies[i], ggml_get_name(*items[i].slot));
    }
    sp->buf_dense = ggml_backend_alloc_ctx_tensors_from_buft(sp->ctx_dense, sp->buft);
    if (!sp->buf_dense) {
        free(copies);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate %s memory for the dense weights", sp->device);
    }
    ggml_backend_buffer_set_usage(sp->buf_dense, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (int32_t i = 0; i < n_items; ++i) {
        struct ggml_tensor * t = *items[i].slot;
        const struct ggml_tensor * o = original(model, t);
        ggml_backend_tensor_set(copies[i], o->data, 0, ggml_nbytes(o));
        // The host copies are no longer read (the token embeddings stay, for get_rows):
        // the file's pages, and a repacked copy's pages (never touched again, so giving
        // them back is safe).
        if (t != model->tok_embd) {
            pi_release_mapped_range(o->data, ggml_nbytes(o));
            if (t->data != o->data) {
                pi_release_mapped_range(t->data, ggml_nbytes(t));
            }
        }
        *items[i].slot = copies[i];
    }
    free(copies);
    sp->bytes_dense = ggml_backend_buffer_get_size(sp->buf_dense);
    return POWERINFER_OK;
}

// ---- FFN rows ----------------------------------------------------------------------------

static enum ggml_type down_type(enum ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16 ? t : GGML_TYPE_Q8_0;
}

// Device bytes of one group of PI_SPLIT_GROUP neurons of layer il.
static uint64_t group_cost(const struct powerinfer_model * model, int32_t il) {
    const struct pi_layer * l = &model->layers[il];
    const int64_t n_embd = model->hp.n_embd, g = PI_SPLIT_GROUP;
    uint64_t c = (uint64_t) g * ggml_row_size(l->ffn_up->type, n_embd);
    if (l->ffn_gate) c += (uint64_t) g * ggml_row_size(l->ffn_gate->type, n_embd);
    c += (uint64_t) n_embd * ggml_row_size(down_type(l->ffn_down_t->type), g);
    if (model->hp.sparse_mode == POWERINFER_SPARSE_PREDICTOR) c += (uint64_t) g * ggml_row_size(l->fc2->type, l->fc2->ne[0]);
    return c;
}

static void free_ffn(struct pi_split * sp, int32_t n_layer) {
    if (sp->buf_ffn) ggml_backend_buffer_free(sp->buf_ffn);
    if (sp->ctx_ffn) ggml_free(sp->ctx_ffn);
    sp->buf_ffn = NULL;
    sp->ctx_ffn = NULL;
    sp->bytes_ffn = 0;
    for (int32_t il = 0; il < n_layer; ++il) {
        struct pi_split_layer * sl = &sp->layers[il];
        free(sl->is_hot);
        memset(sl, 0, sizeof(*sl));
    }
}

struct count_ref { float c; int32_t i; };
static int cmp_count_ref(const void * a, const void * b) {
    const struct count_ref * x = a, * y = b;
    if (x->c != y->c) return x->c > y->c ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

// Chooses the device sets for `capacity` bytes from the activation counts; fills
// is_hot[il] (n_ff bytes each). Returns false when the model has no counts.
static int32_t solve_ffn(const struct powerinfer_model * model, uint64_t capacity, uint8_t ** is_hot, bool * have_counts) {
    const int32_t n_layer = model->hp.n_layer, n_ff = model->hp.n_ff;
    const int32_t n_groups = (n_ff + PI_SPLIT_GROUP - 1) / PI_SPLIT_GROUP;
    float *            counts = malloc(sizeof(float) * (size_t) n_ff);
    struct count_ref * order  = malloc(sizeof(*order) * (size_t) n_layer * n_ff);
    double *           values = calloc((size_t) n_layer * n_groups, sizeof(double));
    uint64_t *         cost   = malloc(sizeof(uint64_t) * (size_t) n_layer);
    int32_t *          maxg   = malloc(sizeof(int32_t) * (size_t) n_layer);
    int32_t *          chosen = malloc(sizeof(int32_t) * (size_t) n_layer);
    int32_t rc = POWERINFER_OK;
    *have_counts = true;
    if (!counts || !order || !values || !cost || !maxg || !chosen) {
        rc = pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory in placement");
        goto done;
    }
    for (int32_t il = 0; il < n_layer; ++il) {
        if (!pi_model_act_counts(model, il, counts)) {
            *have_counts = false;
            goto done;
        }
        struct count_ref * o = order + (size_t) il * n_ff;
        for (int32_t i = 0; i < n_ff; ++i) o[i] = (struct count_ref) { counts[i], i };
        qsort(o, (size_t) n_ff, sizeof(*o), cmp_count_ref);
        for (int32_t i = 0; i < n_ff; ++i) values[(size_t) il * n_groups + i / PI_SPLIT_GROUP] += o[i].c;
        cost[il] = group_cost(model, il);
        maxg[il] = n_groups;
    }
    if ((rc = powerinfer_place_groups(n_layer, n_groups, values, cost, maxg, capacity, chosen)) != POWERINFER_OK) {
        goto done;
    }
    for (int32_t il = 0; il < n_layer; ++il) {
        memset(is_hot[il], 0, (size_t) n_ff);
        const int32_t k = chosen[il] * PI_SPLIT_GROUP < n_ff ? chosen[il] * PI_SPLIT_GROUP : n_ff;
        for (int32_t j = 0; j < k; ++j) is_hot[il][order[(size_t) il * n_ff + j].i] = 1;
    }
done:
    free(counts); free(order); free(values); free(cost); free(maxg); free(chosen);
    return rc;
}

// Device bytes the sets in is_hot need (what solve_ffn budgets, before alignment).
static uint64_t ffn_bytes_for(const struct powerinfer_model * model, uint8_t * const * is_hot) {
    uint64_t total = 0;
    for (int32_t il = 0; il < model->hp.n_layer; ++il) {
        int64_t k = 0;
        for (int32_t i = 0; i < model->hp.n_ff; ++i) k += is_hot[il][i];
        total += (uint64_t) ((k + PI_SPLIT_GROUP - 1) / PI_SPLIT_GROUP) * group_cost(model, il);
    }
    return total;
}

// Gathers rows `ids` of a [ne0, n] tensor into dst (n_pad rows, zero padded), as bytes.
static void gather_rows(const struct ggml_tensor * src, const int32_t * ids, int32_t k, uint8_t * dst, int32_t n_pad) {
    const size_t rs = src->nb[1];
    for (int32_t j = 0; j < k; ++j) memcpy(dst + (size_t) j * rs, (const uint8_t *) src->data + (size_t) ids[j] * rs, rs);
    memset(dst + (size_t) k * rs, 0, (size_t) (n_pad - k) * rs);
}

// Copies the chosen rows into compact device tensors (one bulk copy per tensor); the
// split keeps its own copy of each non-empty mask.
static int32_t place_ffn(struct powerinfer_model * model, uint8_t * const * is_hot) {
    struct pi_split * sp = &model->split;
    const int32_t n_layer = model->hp.n_layer, n_ff = model->hp.n_ff;
    const int64_t n_embd = model->hp.n_embd;
    const bool pred = model->hp.sparse_mode == POWERINFER_SPARSE_PREDICTOR;
    struct ggml_init_params ip = { .mem_size = (size_t) (4 * n_layer + 1) * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true };
    sp->ctx_ffn = ggml_init(ip);
    int32_t ** ids = calloc((size_t) n_layer, sizeof(int32_t *));
    if (!sp->ctx_ffn || !ids) {
        free(ids);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    int32_t n_split_layers = 0;
    for (int32_t il = 0; il < n_layer; ++il) {
        struct pi_split_layer * sl = &sp->layers[il];
        const struct pi_layer * l = &model->layers[il];
        for (int32_t i = 0; i < n_ff; ++i) sl->n_hot += is_hot[il][i];
        if (sl->n_hot == 0) {
            continue;
        }
        sl->is_hot = malloc((size_t) n_ff);
        if (!sl->is_hot) {
            goto oom;
        }
        memcpy(sl->is_hot, is_hot[il], (size_t) n_ff);
        ++n_split_layers;
        sl->n_pad = (sl->n_hot + PI_SPLIT_GROUP - 1) / PI_SPLIT_GROUP * PI_SPLIT_GROUP;
        ids[il] = malloc(sizeof(int32_t) * (size_t) sl->n_hot);
        if (!ids[il]) {
            goto oom;
        }
        for (int32_t i = 0, j = 0; i < n_ff; ++i) if (sl->is_hot[i]) ids[il][j++] = i;
        sl->up = ggml_new_tensor_2d(sp->ctx_ffn, l->ffn_up->type, n_embd, sl->n_pad);
        ggml_format_name(sl->up, "blk.%d.ffn_up_dev", il);
        if (l->ffn_gate) {
            sl->gate = ggml_new_tensor_2d(sp->ctx_ffn, l->ffn_gate->type, n_embd, sl->n_pad);
            ggml_format_name(sl->gate, "blk.%d.ffn_gate_dev", il);
        }
        sl->down = ggml_new_tensor_2d(sp->ctx_ffn, down_type(l->ffn_down_t->type), sl->n_pad, n_embd);
        ggml_format_name(sl->down, "blk.%d.ffn_down_dev", il);
        if (pred) {
            sl->fc2 = ggml_new_tensor_2d(sp->ctx_ffn, l->fc2->type, l->fc2->ne[0], sl->n_pad);
            ggml_format_name(sl->fc2, "blk.%d.fc2_dev", il);
        }
    }
    if (n_split_layers == 0) {
        free(ids);
        return POWERINFER_OK;
    }
    sp->buf_ffn = ggml_backend_alloc_ctx_tensors_from_buft(sp->ctx_ffn, sp->buft);
    if (!sp->buf_ffn) {
        goto oom;
    }
    ggml_backend_buffer_set_usage(sp->buf_ffn, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    sp->bytes_ffn = ggml_backend_buffer_get_size(sp->buf_ffn);

    for (int32_t il = 0; il < n_layer; ++il) {
        struct pi_split_layer * sl = &sp->layers[il];
        const struct pi_layer * l = &model->layers[il];
        if (sl->n_hot == 0) {
            continue;
        }
        // Staging: the largest of the row gathers and the transposed down block.
        const size_t stage_rows = (size_t) sl->n_pad * (l->ffn_up->nb[1] > (size_t) ggml_row_size(GGML_TYPE_F32, n_embd)
                                                        ? l->ffn_up->nb[1] : (size_t) ggml_row_size(GGML_TYPE_F32, n_embd));
        uint8_t * stage = malloc(stage_rows + (size_t) sl->n_pad * n_embd * sizeof(float) * 2);
        if (!stage) {
            goto oom;
        }
        // Rows as stored in the file: the gate (gate mode) and fc2 may sit in repacked
        // buffers, whose layout interleaves rows.
        const struct ggml_tensor * srcs[3] = { original(model, l->ffn_up), l->ffn_gate ? original(model, l->ffn_gate) : NULL,
                                               pred ? original(model, l->fc2) : NULL };
        struct ggml_tensor *       dsts[3] = { sl->up, sl->gate, sl->fc2 };
        for (int k = 0; k < 3; ++k) {
            if (!dsts[k]) continue;
            if (!srcs[k]) {
                free(stage);
                for (int32_t j = 0; j < n_layer; ++j) free(ids[j]);
                free(ids);
                return pi_fail(POWERINFER_ERR_INTERNAL, "layer %d: the file's rows of %s are not available", il,
                               ggml_get_name(dsts[k]));
            }
            gather_rows(srcs[k], ids[il], sl->n_hot, stage, sl->n_pad);
            ggml_backend_tensor_set(dsts[k], stage, 0, ggml_nbytes(dsts[k]));
        }
        // Down: rows of ffn_down_t (neuron j's outputs) become column j of [n_pad, n_embd].
        float * rowsf = (float *) stage;                                   // [n_pad][n_embd]
        float * cols  = rowsf + (size_t) sl->n_pad * n_embd;               // [n_embd][n_pad]
        const struct ggml_type_traits * tt = ggml_get_type_traits(l->ffn_down_t->type);
        for (int32_t j = 0; j < sl->n_pad; ++j) {
            float * r = rowsf + (size_t) j * n_embd;
            if (j < sl->n_hot) {
                const void * src = (const uint8_t *) l->ffn_down_t->data + (size_t) ids[il][j] * l->ffn_down_t->nb[1];
                if (l->ffn_down_t->type == GGML_TYPE_F32) memcpy(r, src, sizeof(float) * (size_t) n_embd);
                else tt->to_float(src, r, n_embd);
            } else {
                memset(r, 0, sizeof(float) * (size_t) n_embd);
            }
        }
        for (int64_t e = 0; e < n_embd; ++e)
            for (int32_t j = 0; j < sl->n_pad; ++j) cols[(size_t) e * sl->n_pad + j] = rowsf[(size_t) j * n_embd + e];
        if (sl->down->type == GGML_TYPE_F32) {
            ggml_backend_tensor_set(sl->down, cols, 0, ggml_nbytes(sl->down));
        } else {
            uint8_t * q = malloc(ggml_nbytes(sl->down));
            if (!q) {
                free(stage);
                goto oom;
            }
            ggml_quantize_chunk(sl->down->type, cols, q, 0, n_embd, sl->n_pad, NULL);
            ggml_backend_tensor_set(sl->down, q, 0, ggml_nbytes(sl->down));
            free(q);
        }
        free(stage);
        // The host rows of these neurons are not read again (the CPU skips them).
        pi_release_mapped_range(l->ffn_up->data, ggml_nbytes(l->ffn_up));
        pi_release_mapped_range(l->ffn_down_t->data, ggml_nbytes(l->ffn_down_t));
        if (l->ffn_gate && model->hp.sparse_mode == POWERINFER_SPARSE_PREDICTOR) {
            pi_release_mapped_range(l->ffn_gate->data, ggml_nbytes(l->ffn_gate));
        }
    }
    for (int32_t il = 0; il < n_layer; ++il) free(ids[il]);
    free(ids);
    return POWERINFER_OK;
oom:
    for (int32_t il = 0; il < n_layer; ++il) free(ids[il]);
    free(ids);
    return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate %s memory for the FFN rows", sp->device);
}

// ---- orchestration -----------------------------------------------------------------------

static int32_t make_sched(struct powerinfer_context * ctx) {
    struct pi_split * sp = &ctx->model->split;
    ggml_backend_t backends[2];
    int n = 0;
    if (sp->backend) backends[n++] = sp->backend;
    backends[n++] = ctx->backend;
    ctx->sched = ggml_backend_sched_new(backends, NULL, n, PI_GRAPH_MAX_NODES, false, true);
    return ctx->sched ? POWERINFER_OK : pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot create the backend scheduler");
}

struct ggml_cgraph * pi_context_build_reserve_graph(struct powerinfer_context * ctx);

// A scheduler for what is placed now, and its device compute-buffer bytes for the
// largest graph of this context (sp->bytes_compute).
static int32_t remeasure(struct powerinfer_context * ctx) {
    if (ctx->sched) {
        ggml_backend_sched_free(ctx->sched);
        ctx->sched = NULL;
    }
    int32_t rc = make_sched(ctx);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    struct ggml_cgraph * gf = pi_context_build_reserve_graph(ctx);
    if (!gf || !ggml_backend_sched_reserve(ctx->sched, gf)) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot reserve the compute buffers");
    }
    ggml_backend_t dev = ctx->model->split.backend ? ctx->model->split.backend : ctx->backend;
    ctx->model->split.bytes_compute = ggml_backend_sched_get_buffer_size(ctx->sched, dev);
    return POWERINFER_OK;
}

// Re-creates the context's KV cache in buft (NULL: host memory); contents are not kept
// (placement happens before the first decode).
static int32_t move_kv(struct powerinfer_context * ctx, ggml_backend_buffer_type_t buft) {
    const bool v_trans = ctx->kv.v_trans;
    const uint32_t size = ctx->kv.size;
    pi_kv_cache_free(&ctx->kv);
    ctx->last.valid = false;
    return pi_kv_cache_init(&ctx->kv, ctx->model, size, v_trans, buft);
}

static uint64_t split_total(const struct pi_split * sp) {
    return sp->bytes_dense + sp->bytes_kv + sp->bytes_compute + sp->bytes_ffn;
}

static void undo_dense(struct powerinfer_model * model, struct dense_item * items, int32_t n_items) {
    struct pi_split * sp = &model->split;
    for (int32_t i = 0; i < n_items; ++i) {
        // Point back at the file's tensors (repacking is not redone: plain layout is fine).
        const struct ggml_tensor * o = ggml_get_tensor(model->ctx_meta, ggml_get_name(*items[i].slot));
        if (o) *items[i].slot = (struct ggml_tensor *) o;
    }
    if (model->output && model->output != model->tok_embd && strcmp(ggml_get_name(model->output), ggml_get_name(model->tok_embd)) == 0) {
        model->output = model->tok_embd;
    }
    if (sp->buf_dense) ggml_backend_buffer_free(sp->buf_dense);
    if (sp->ctx_dense) ggml_free(sp->ctx_dense);
    sp->buf_dense = NULL;
    sp->ctx_dense = NULL;
    sp->bytes_dense = 0;
    sp->n_layers_attn = 0;
}

int32_t pi_split_place(struct powerinfer_context * ctx) {
    struct powerinfer_model * model = ctx->model;
    struct pi_split * sp = &model->split;
    static const char * const tag = "powerinfer: placement";
    if (sp->decided) {
        return sp->active ? make_sched(ctx) : POWERINFER_OK;
    }
    sp->decided = true;
    const int64_t exact = model->params.vram_budget_bytes;
    const float gib = model->params.vram_budget_gib;
    const bool emulate = model->params.emulate_device || env_flag("POWERINFER_EMULATE_DEVICE");
    if (exact <= 0 && gib == 0.0f && !emulate) {
        return POWERINFER_OK;  // no device wanted
    }
    find_device(sp, emulate);
    if (!sp->buft) {
        pi_log(POWERINFER_LOG_INFO, "%s: no GPU backend in this ggml build (%s); running on the CPU\n", tag,
               ggml_backend_dev_count() > 0 ? "CPU only" : "no devices");
        return POWERINFER_OK;
    }
    if (exact > 0) {
        sp->budget = (uint64_t) exact;
    } else if (gib < 0.0f) {
        const uint64_t free_b = free_device_memory(sp);
        sp->budget = free_b > PI_DEVICE_MARGIN ? free_b - PI_DEVICE_MARGIN : 0;
    } else {
        sp->budget = (uint64_t) floor((double) gib * (double) (1ull << 30));
    }
    pi_log(POWERINFER_LOG_INFO, "%s: device %s, budget %.1f MiB\n", tag, sp->device, sp->budget / 1048576.0);
    if (sp->budget == 0) {
        return POWERINFER_OK;
    }

    // Compute-buffer estimate from the CPU-only reservation (the device share is at most
    // the whole graph's), with slack for the inputs the scheduler copies across.
    const uint64_t c_est = ctx->galloc ? ggml_gallocr_get_buffer_size(ctx->galloc, 0) : 0;
    const uint64_t slack = c_est / 32 + (64u << 10);

    // 1-4: dense classes, whole groups, in order, until one does not fit.
    struct dense_item * items = malloc(sizeof(*items) * PI_MAX_DENSE);
    if (!items) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    const int32_t n_all = collect_dense(model, items);
    int32_t n_items = 0;
    uint64_t used = 0;
    while (n_items < n_all) {
        int32_t end = n_items;
        uint64_t need = 0;
        bool copyable = true;
        while (end < n_all && items[end].group == items[n_items].group) {
            need += alloc_size(sp->buft, *items[end].slot);
            copyable &= original(model, *items[end].slot) != NULL;
            ++end;
        }
        if (!copyable || used + need + c_est + slack > sp->budget) {
            break;
        }
        used += need;
        n_items = end;
    }
    const bool dense_all = n_items == n_all;
    int32_t rc = place_dense(model, items, n_items);
    for (int32_t il = 0; il < model->hp.n_layer; ++il) {
        sp->n_layers_attn += model->layers[il].wo->buffer == sp->buf_dense && sp->buf_dense;
    }

    // 5: the KV cache.
    const uint64_t kv_bytes = ggml_backend_buffer_get_size(ctx->kv.buf);
    if (rc == POWERINFER_OK && dense_all && sp->bytes_dense + kv_bytes + c_est + slack <= sp->budget) {
        rc = move_kv(ctx, sp->buft);
        if (rc == POWERINFER_OK) {
            sp->bytes_kv = ggml_backend_buffer_get_size(ctx->kv.buf);
        } else {
            rc = move_kv(ctx, NULL);
        }
    }
    sp->active = rc == POWERINFER_OK && (n_items > 0 || sp->bytes_kv > 0);

    // 6: the compute buffers as the scheduler lays them out.
    if (sp->active) {
        rc = remeasure(ctx);
    }
    if (rc == POWERINFER_OK && sp->active && split_total(sp) > sp->budget) {
        pi_log(POWERINFER_LOG_WARN, "%s: the compute buffers (%.1f MiB) do not fit next to the dense weights; nothing placed\n",
               tag, sp->bytes_compute / 1048576.0);
        sp->active = false;
    }

    // 7: FFN neurons with what is left.
    const int32_t mode = model->hp.sparse_mode;
    const int32_t n_layer = model->hp.n_layer, n_ff = model->hp.n_ff;
    const bool ffn_ok = rc == POWERINFER_OK && sp->active && dense_all &&
                        (mode == POWERINFER_SPARSE_GATE || mode == POWERINFER_SPARSE_PREDICTOR);
    uint8_t ** is_hot = calloc((size_t) n_layer, sizeof(uint8_t *));
    for (int32_t il = 0; is_hot && il < n_layer; ++il) {
        is_hot[il] = calloc((size_t) n_ff, 1);
        if (!is_hot[il]) { rc = pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory"); break; }
    }
    if (!is_hot) rc = pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    if (ffn_ok && rc == POWERINFER_OK) {
        // The compute buffers are measured now; keep a little for their growth with the
        // FFN rows (the loop below re-measures and shrinks if that was not enough).
        const uint64_t fixed = split_total(sp) + sp->bytes_compute / 64 + (64u << 10);
        uint64_t capacity = sp->budget > fixed ? sp->budget - fixed : 0;
        char path[4096];
        snprintf(path, sizeof(path), "%s.generated.gpuidx", model->path);
        for (int attempt = 0; attempt < 4 && capacity > 0 && rc == POWERINFER_OK; ++attempt) {
            bool have_counts = true;
            uint64_t cap_file = 0;
            sp->from_cache = false;
            if (attempt == 0 && !model->params.reset_gpu_index && access(path, F_OK) == 0 &&
                pi_gpuidx_read(model, path, &cap_file, is_hot) == POWERINFER_OK) {
                // Reused only for the same capacity and when its rows fit it.
                sp->from_cache = cap_file == capacity && ffn_bytes_for(model, is_hot) <= capacity;
                if (!sp->from_cache) {
                    pi_log(POWERINFER_LOG_INFO, "%s: %s is for %.1f MiB, now %.1f MiB: solving again\n", tag, path,
                           cap_file / 1048576.0, capacity / 1048576.0);
                }
            }
            pi_clear_error();
            if (!sp->from_cache) {
                rc = solve_ffn(model, capacity, is_hot, &have_counts);
                if (rc != POWERINFER_OK) break;
                if (!have_counts) {
                    pi_log(POWERINFER_LOG_WARN, "%s: the model has no activation counts (blk.N.ffn_act_count; "
                           "`powerinfer profile` makes them); FFN stays on the CPU\n", tag);
                    break;
                }
                if (attempt == 0 && pi_gpuidx_write(model, path, capacity, (const uint8_t * const *) is_hot) != POWERINFER_OK) {
                    pi_log(POWERINFER_LOG_WARN, "%s: %s\n", tag, powerinfer_last_error());
                    pi_clear_error();
                }
            }
            if ((rc = place_ffn(model, is_hot)) != POWERINFER_OK || (rc = remeasure(ctx)) != POWERINFER_OK) {
                break;
            }
            if (split_total(sp) <= sp->budget) {
                break;
            }
            // The compute buffers grew with the FFN rows: give up the excess and solve again.
            const uint64_t excess = split_total(sp) - sp->budget;
            pi_log(POWERINFER_LOG_INFO, "%s: %.2f MiB over the budget, shrinking the FFN share\n", tag, excess / 1048576.0);
            // What the solver counted for the placed sets; the buffer's size above it is alignment.
            uint64_t est = 0;
            for (int32_t il = 0; il < n_layer; ++il) {
                est += (uint64_t) ((sp->layers[il].n_hot + PI_SPLIT_GROUP - 1) / PI_SPLIT_GROUP) * group_cost(model, il);
            }
            const uint64_t cut = excess + group_cost(model, 0) + (sp->bytes_ffn > est ? sp->bytes_ffn - est : 0);
            capacity = capacity > cut ? capacity - cut : 0;
            free_ffn(sp, n_layer);
            for (int32_t il = 0; il < n_layer; ++il) memset(is_hot[il], 0, (size_t) n_ff);
            sp->from_cache = false;
        }
        if (rc == POWERINFER_OK && split_total(sp) > sp->budget) {
            free_ffn(sp, n_layer);
            rc = remeasure(ctx);
        }
    }
    for (int32_t il = 0; is_hot && il < n_layer; ++il) free(is_hot[il]);
    free(is_hot);

    if (rc == POWERINFER_OK && n_items == 0) {
        pi_log(POWERINFER_LOG_INFO, "%s: nothing fits in %.1f MiB (the compute buffers alone take about %.1f MiB); "
               "running on the CPU\n", tag, sp->budget / 1048576.0, (c_est + slack) / 1048576.0);
    }
    if (rc != POWERINFER_OK || !sp->active || split_total(sp) > sp->budget) {
        // Nothing (more) on the device: back to the plain CPU path.
        if (ctx->sched) ggml_backend_sched_free(ctx->sched);
        ctx->sched = NULL;
        free_ffn(sp, n_layer);
        undo_dense(model, items, n_items);
        if (sp->bytes_kv) {
            const int32_t rc_kv = move_kv(ctx, NULL);
            rc = rc != POWERINFER_OK ? rc : rc_kv;
        }
        sp->bytes_kv = sp->bytes_compute = 0;
        sp->active = false;
        free(items);
        return rc;
    }
    free(items);
    for (int32_t il = 0; il < n_layer; ++il) {
        ctx->sparse[il].skip = sp->layers[il].is_hot;
    }
    int64_t n_hot = 0;
    for (int32_t il = 0; il < n_layer; ++il) n_hot += sp->layers[il].n_hot;
    pi_log(POWERINFER_LOG_INFO,
           "%s: %s: attention of %d/%d layers, KV %s, FFN %.1f%% of neurons%s; %.1f of %.1f MiB "
           "(dense %.1f, KV %.1f, compute %.1f, FFN %.1f)\n",
           tag, sp->device, sp->n_layers_attn, n_layer, sp->bytes_kv ? "on the device" : "on the host",
           100.0 * n_hot / ((double) n_layer * n_ff), sp->from_cache ? " (from the gpuidx cache)" : "",
           split_total(sp) / 1048576.0, sp->budget / 1048576.0, sp->bytes_dense / 1048576.0, sp->bytes_kv / 1048576.0,
           sp->bytes_compute / 1048576.0, sp->bytes_ffn / 1048576.0);
    return POWERINFER_OK;
}

void pi_split_free(struct powerinfer_model * model) {
    struct pi_split * sp = &model->split;
    free_ffn(sp, model->hp.n_layer);
    if (sp->buf_dense) ggml_backend_buffer_free(sp->buf_dense);
    if (sp->ctx_dense) ggml_free(sp->ctx_dense);
    if (sp->backend) ggml_backend_free(sp->backend);
    memset(sp, 0, sizeof(*sp));
}

// ---- public accounting ----------------------------------------------------------------

int32_t powerinfer_get_placement(const struct powerinfer_context * ctx, struct powerinfer_placement * out) {
    pi_clear_error();
    if (!ctx || !out) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_get_placement: NULL argument");
    }
    const struct pi_split * sp = &ctx->model->split;
    memset(out, 0, sizeof(*out));
    snprintf(out->device, sizeof(out->device), "%s", sp->device[0] ? sp->device : "none");
    out->active        = sp->active;
    out->emulated      = sp->emulated;
    out->from_cache    = sp->from_cache;
    out->budget        = (int64_t) sp->budget;
    out->bytes_dense   = (int64_t) sp->bytes_dense;
    out->bytes_kv      = (int64_t) sp->bytes_kv;
    out->bytes_compute = (int64_t) sp->bytes_compute;
    out->bytes_ffn     = (int64_t) sp->bytes_ffn;
    out->bytes_total   = (int64_t) split_total(sp);
    out->n_layers_attn = sp->n_layers_attn;
    for (int32_t il = 0; il < ctx->model->hp.n_layer; ++il) out->n_hot += sp->layers[il].n_hot;
    out->n_neurons = (int64_t) ctx->model->hp.n_layer * ctx->model->hp.n_ff;
    return POWERINFER_OK;
}

int32_t powerinfer_layer_hot_neurons(const struct powerinfer_context * ctx, int32_t il, int32_t * ids, int32_t n_max) {
    pi_clear_error();
    if (!ctx || il < 0 || il >= ctx->model->hp.n_layer) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "layer %d is out of range", il);
    }
    const struct pi_split_layer * sl = &ctx->model->split.layers[il];
    int32_t n = 0;
    for (int32_t i = 0; sl->is_hot && i < ctx->model->hp.n_ff; ++i) {
        if (sl->is_hot[i]) {
            if (ids && n < n_max) ids[n] = i;
            ++n;
        }
    }
    return n;
}
