// placement.c - hybrid placement: under a device memory budget, decide what goes on the
// device (dense weights, the KV cache, the hottest FFN neurons), never exceeding the
// budget. The device comes from device.c, the copies are made by offload.c, the FFN sets
// are cached in gpuidx.c's file; the context being placed measures its own KV cache and
// compute buffers through the small interface it hands over (struct pi_placement_host).
// Without a GPU backend the same path runs with the "device" emulated by a CPU buffer
// (POWERINFER_EMULATE_DEVICE=1 or model params .emulate_device), which is how the tests
// check the split, the accounting and the results.
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

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PI_DEVICE_MARGIN (512ull << 20)  // kept free on a real device when the budget is automatic
#define PI_MAX_DENSE     (16 * PI_MAX_LAYERS + 8)

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

int32_t powerinfer_model_set_act_counts(struct powerinfer_model * model, const float * counts, int32_t n_layer, int32_t n_ff) {
    pi_clear_error();
    if (!model || !counts) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_model_set_act_counts: NULL argument");
    }
    if (n_layer != model->hp.n_layer || n_ff != model->hp.n_ff) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "activation counts are %d x %d; the model has %d layers of %d neurons",
                       n_layer, n_ff, model->hp.n_layer, model->hp.n_ff);
    }
    if (model->placement.decided) {
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

// ---- the budget walk ----------------------------------------------------------------------

static bool env_flag(const char * name) {
    const char * v = getenv(name);
    return v && *v && strcmp(v, "0") != 0;
}

// The dense classes in placement order; items of one group are placed together.
static int32_t collect_dense(struct powerinfer_model * model, struct pi_dense_item * items) {
    int32_t n = 0, g = 0;
    const int32_t n_layer = model->hp.n_layer;
    for (int32_t il = 0; il < n_layer; ++il, ++g) {
        struct pi_layer * l = &model->layers[il];
        struct ggml_tensor ** s[] = { &l->attn_norm, &l->attn_norm_b, &l->attn_norm_2, &l->attn_norm_2_b, &l->wqkv,
                                      &l->wq, &l->wk, &l->wv, &l->wo, &l->bq, &l->bk, &l->bv };
        for (size_t i = 0; i < sizeof(s) / sizeof(s[0]); ++i) {
            if (*s[i]) items[n++] = (struct pi_dense_item) { s[i], g };
        }
    }
    if (model->hp.sparse_mode == POWERINFER_SPARSE_PREDICTOR) {
        for (int32_t il = 0; il < n_layer; ++il, ++g) {
            items[n++] = (struct pi_dense_item) { &model->layers[il].fc1, g };
            items[n++] = (struct pi_dense_item) { &model->layers[il].fc2, g };
        }
    }
    for (int32_t il = 0; il < n_layer && model->layers[il].ffn_norm; ++il, ++g) {
        items[n++] = (struct pi_dense_item) { &model->layers[il].ffn_norm, g };
    }
    items[n++] = (struct pi_dense_item) { &model->output_norm, g };
    if (model->output_norm_b) items[n++] = (struct pi_dense_item) { &model->output_norm_b, g };
    items[n++] = (struct pi_dense_item) { &model->output, g };
    return n;
}

// Whole groups of dense items, in order, while they fit next to the compute-buffer
// estimate; returns how many items.
static int32_t fit_dense(const struct powerinfer_model * model, const struct pi_device * dev, const struct pi_dense_item * items,
                         int32_t n_all, uint64_t budget, uint64_t reserve) {
    int32_t n_items = 0;
    uint64_t used = 0;
    while (n_items < n_all) {
        int32_t end = n_items;
        uint64_t need = 0;
        bool copyable = true;
        while (end < n_all && items[end].group == items[n_items].group) {
            need += pi_device_alloc_size(dev, *items[end].slot);
            copyable &= pi_model_file_tensor(model, *items[end].slot) != NULL;
            ++end;
        }
        if (!copyable || used + need + reserve > budget) {
            break;
        }
        used += need;
        n_items = end;
    }
    return n_items;
}

struct count_ref { float c; int32_t i; };
static int cmp_count_ref(const void * a, const void * b) {
    const struct count_ref * x = a, * y = b;
    if (x->c != y->c) return x->c > y->c ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

// Chooses the device sets for `capacity` bytes from the activation counts; fills
// is_hot[il] (n_ff bytes each). *have_counts is false when the model has no counts.
static int32_t solve_ffn(const struct powerinfer_model * model, uint64_t capacity, uint8_t ** is_hot, bool * have_counts) {
    const int32_t n_layer = model->hp.n_layer, n_ff = model->hp.n_ff;
    const int32_t n_groups = (n_ff + PI_OFFLOAD_GROUP - 1) / PI_OFFLOAD_GROUP;
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
        for (int32_t i = 0; i < n_ff; ++i) values[(size_t) il * n_groups + i / PI_OFFLOAD_GROUP] += o[i].c;
        cost[il] = pi_offload_group_cost(model, il);
        maxg[il] = n_groups;
    }
    if ((rc = powerinfer_place_groups(n_layer, n_groups, values, cost, maxg, capacity, chosen)) != POWERINFER_OK) {
        goto done;
    }
    for (int32_t il = 0; il < n_layer; ++il) {
        memset(is_hot[il], 0, (size_t) n_ff);
        const int32_t k = chosen[il] * PI_OFFLOAD_GROUP < n_ff ? chosen[il] * PI_OFFLOAD_GROUP : n_ff;
        for (int32_t j = 0; j < k; ++j) is_hot[il][order[(size_t) il * n_ff + j].i] = 1;
    }
done:
    free(counts); free(order); free(values); free(cost); free(maxg); free(chosen);
    return rc;
}

// Device bytes the solver counts for n_hot[il] neurons per layer (before alignment).
static uint64_t ffn_cost(const struct powerinfer_model * model, const int64_t * n_hot) {
    uint64_t total = 0;
    for (int32_t il = 0; il < model->hp.n_layer; ++il) {
        total += (uint64_t) ((n_hot[il] + PI_OFFLOAD_GROUP - 1) / PI_OFFLOAD_GROUP) * pi_offload_group_cost(model, il);
    }
    return total;
}

static uint64_t ffn_cost_of_sets(const struct powerinfer_model * model, uint8_t * const * is_hot) {
    int64_t n_hot[PI_MAX_LAYERS];
    for (int32_t il = 0; il < model->hp.n_layer; ++il) {
        n_hot[il] = 0;
        for (int32_t i = 0; i < model->hp.n_ff; ++i) n_hot[il] += is_hot[il][i];
    }
    return ffn_cost(model, n_hot);
}

static uint64_t placement_total(const struct pi_placement * pl) {
    return pl->bytes_dense + pl->bytes_kv + pl->bytes_compute + pl->bytes_ffn;
}

// What the device holds now: the placed weights, the deciding context's KV cache and
// compute buffers while it exists, and the later contexts' compute buffers.
static uint64_t device_in_use(const struct pi_placement * pl) {
    return pl->bytes_dense + pl->bytes_ffn + (pl->first_alive ? pl->bytes_kv + pl->bytes_compute : 0) + pl->bytes_contexts;
}

int32_t pi_placement_admit(struct powerinfer_model * model, const struct pi_placement_host * host, uint64_t * device_bytes) {
    struct pi_placement * pl = &model->placement;
    *device_bytes = 0;
    uint64_t need = 0;
    int32_t rc = host->measure_compute(host->self, &need);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    const uint64_t used = device_in_use(pl);
    if (used + need > pl->budget) {
        host->drop_scheduler(host->self);
        return pi_fail(POWERINFER_ERR_NO_MEMORY,
                       "this context's compute buffers need %.1f MiB of device memory, but the model's %.1f MiB budget "
                       "has %.1f MiB left (its placement and other contexts hold the rest); use a smaller n_batch or "
                       "n_ctx, free another context, or load the model with a larger budget",
                       need / 1048576.0, pl->budget / 1048576.0, (used < pl->budget ? pl->budget - used : 0) / 1048576.0);
    }
    pl->bytes_contexts += need;
    *device_bytes = need;
    return POWERINFER_OK;
}

void pi_placement_release(struct powerinfer_model * model, bool first, uint64_t device_bytes) {
    struct pi_placement * pl = &model->placement;
    if (first) {
        pl->first_alive = false;
    }
    pl->bytes_contexts -= device_bytes < pl->bytes_contexts ? device_bytes : pl->bytes_contexts;
}

// Re-measures the compute buffers with what is placed now.
static int32_t remeasure(struct pi_placement * pl, const struct pi_placement_host * host) {
    return host->measure_compute(host->self, &pl->bytes_compute);
}

// 7: the FFN neurons with what the budget leaves (pl->active, dense classes all placed).
// The gpuidx cache is reused for the same capacity; when the compute buffers grow with
// the FFN rows, the excess is given up and the sets are solved again.
static int32_t place_ffn(struct powerinfer_model * model, const struct pi_placement_host * host, uint8_t ** is_hot) {
    static const char * const tag = "powerinfer: placement";
    struct pi_placement * pl = &model->placement;
    const int32_t n_layer = model->hp.n_layer, n_ff = model->hp.n_ff;
    // The compute buffers are measured now; keep a little for their growth with the
    // FFN rows (the loop below re-measures and shrinks if that was not enough).
    const uint64_t fixed = placement_total(pl) + pl->bytes_compute / 64 + (64u << 10);
    uint64_t capacity = pl->budget > fixed ? pl->budget - fixed : 0;
    const uint64_t capacity0 = capacity;  // the cache's key: what the first attempt had
    bool solved = false;
    char path[4096];
    snprintf(path, sizeof(path), "%s.generated.gpuidx", model->path);
    int32_t rc = POWERINFER_OK;
    for (int attempt = 0; attempt < 4 && capacity > 0 && rc == POWERINFER_OK; ++attempt) {
        bool have_counts = true;
        uint64_t cap_file = 0;
        pl->from_cache = false;
        if (attempt == 0 && !model->params.reset_gpu_index && access(path, F_OK) == 0 &&
            pi_gpuidx_read(model, path, &cap_file, is_hot) == POWERINFER_OK) {
            // Reused only for the same capacity and when its rows fit it.
            pl->from_cache = cap_file == capacity && ffn_cost_of_sets(model, is_hot) <= capacity;
            if (!pl->from_cache) {
                pi_log(POWERINFER_LOG_INFO, "%s: %s is for %.1f MiB, now %.1f MiB: solving again\n", tag, path,
                       cap_file / 1048576.0, capacity / 1048576.0);
            }
        }
        pi_clear_error();
        if (!pl->from_cache) {
            if ((rc = solve_ffn(model, capacity, is_hot, &have_counts)) != POWERINFER_OK) break;
            solved = have_counts;
            if (!have_counts) {
                pi_log(POWERINFER_LOG_WARN, "%s: the model has no activation counts (blk.N.ffn_act_count; "
                       "`powerinfer profile` makes them); FFN stays on the CPU\n", tag);
                break;
            }
        }
        if ((rc = pi_offload_ffn(model, &pl->device, is_hot)) != POWERINFER_OK) break;
        pl->bytes_ffn = pi_offload_ffn_bytes(&model->offload);
        if ((rc = remeasure(pl, host)) != POWERINFER_OK) break;
        if (placement_total(pl) <= pl->budget) break;
        // The compute buffers grew with the FFN rows: give up the excess and solve again.
        const uint64_t excess = placement_total(pl) - pl->budget;
        pi_log(POWERINFER_LOG_INFO, "%s: %.2f MiB over the budget, shrinking the FFN share\n", tag, excess / 1048576.0);
        // What the solver counted for the placed sets; the buffer's size above it is alignment.
        int64_t n_hot[PI_MAX_LAYERS];
        for (int32_t il = 0; il < n_layer; ++il) n_hot[il] = model->offload.layers[il].n_hot;
        const uint64_t est = ffn_cost(model, n_hot);
        const uint64_t cut = excess + pi_offload_group_cost(model, 0) + (pl->bytes_ffn > est ? pl->bytes_ffn - est : 0);
        capacity = capacity > cut ? capacity - cut : 0;
        pi_offload_free_ffn(&model->offload, n_layer);
        pl->bytes_ffn = 0;
        for (int32_t il = 0; il < n_layer; ++il) memset(is_hot[il], 0, (size_t) n_ff);
        pl->from_cache = false;
    }
    if (rc == POWERINFER_OK && placement_total(pl) > pl->budget) {
        pi_offload_free_ffn(&model->offload, n_layer);
        pl->bytes_ffn = 0;
        rc = remeasure(pl, host);
    }
    if (rc == POWERINFER_OK && solved) {
        // The sets placed, under the first attempt's capacity: the next load with the same
        // budget and context reuses them at once.
        for (int32_t il = 0; il < n_layer; ++il) {
            const struct pi_offload_layer * ol = &model->offload.layers[il];
            if (ol->is_hot) memcpy(is_hot[il], ol->is_hot, (size_t) n_ff);
            else memset(is_hot[il], 0, (size_t) n_ff);
        }
        if (pi_gpuidx_write(model, path, capacity0, (const uint8_t * const *) is_hot) != POWERINFER_OK) {
            pi_log(POWERINFER_LOG_WARN, "%s: %s\n", tag, powerinfer_last_error());
            pi_clear_error();
        }
    }
    return rc;
}

int32_t pi_placement_decide(struct powerinfer_model * model, const struct pi_placement_host * host) {
    struct pi_placement * pl = &model->placement;
    static const char * const tag = "powerinfer: placement";
    if (pl->decided) {
        return POWERINFER_OK;
    }
    pl->decided = true;
    const int64_t exact = model->params.vram_budget_bytes;
    const float gib = model->params.vram_budget_gib;
    const bool emulate = model->params.emulate_device || env_flag("POWERINFER_EMULATE_DEVICE");
    if (exact <= 0 && gib == 0.0f && !emulate) {
        return POWERINFER_OK;  // no device wanted
    }
    pi_device_find(&pl->device, emulate);
    if (!pl->device.buft) {
        pi_log(POWERINFER_LOG_INFO, "%s: no GPU backend in this ggml build (%s); running on the CPU\n", tag,
               ggml_backend_dev_count() > 0 ? "CPU only" : "no devices");
        return POWERINFER_OK;
    }
    if (exact > 0) {
        pl->budget = (uint64_t) exact;
    } else if (gib < 0.0f) {
        const uint64_t free_b = pi_device_free_memory(&pl->device);
        pl->budget = free_b > PI_DEVICE_MARGIN ? free_b - PI_DEVICE_MARGIN : 0;
    } else {
        pl->budget = (uint64_t) floor((double) gib * (double) (1ull << 30));
    }
    pi_log(POWERINFER_LOG_INFO, "%s: device %s, budget %.1f MiB\n", tag, pl->device.name, pl->budget / 1048576.0);
    if (pl->budget == 0) {
        return POWERINFER_OK;
    }

    // Compute-buffer estimate from the CPU-only reservation (the device share is at most
    // the whole graph's), with slack for the inputs the scheduler copies across.
    const uint64_t c_est = host->compute_estimate;
    const uint64_t slack = c_est / 32 + (64u << 10);

    // 1-4: dense classes, whole groups, in order, until one does not fit.
    struct pi_dense_item * items = malloc(sizeof(*items) * PI_MAX_DENSE);
    uint8_t ** is_hot = calloc((size_t) model->hp.n_layer, sizeof(uint8_t *));
    if (!items || !is_hot) {
        free(items);
        free(is_hot);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    const int32_t n_all   = collect_dense(model, items);
    const int32_t n_items = fit_dense(model, &pl->device, items, n_all, pl->budget, c_est + slack);
    const bool dense_all = n_items == n_all;
    int32_t rc = pi_offload_dense(model, &pl->device, items, n_items);
    pl->bytes_dense = pi_offload_dense_bytes(&model->offload);
    for (int32_t il = 0; il < model->hp.n_layer; ++il) {
        pl->n_layers_attn += pi_offload_holds(&model->offload, model->layers[il].wo);
    }

    // 5: the KV cache.
    if (rc == POWERINFER_OK && dense_all && pl->bytes_dense + host->kv_bytes + c_est + slack <= pl->budget) {
        rc = host->move_kv(host->self, pl->device.buft, &pl->bytes_kv);
        if (rc != POWERINFER_OK) {
            pl->bytes_kv = 0;
            rc = host->move_kv(host->self, NULL, NULL);
        }
    }
    pl->active = rc == POWERINFER_OK && (n_items > 0 || pl->bytes_kv > 0);

    // 6: the compute buffers as the scheduler lays them out.
    if (pl->active) {
        rc = remeasure(pl, host);
    }
    if (rc == POWERINFER_OK && pl->active && placement_total(pl) > pl->budget) {
        pi_log(POWERINFER_LOG_WARN, "%s: the compute buffers (%.1f MiB) do not fit next to the dense weights; nothing placed\n",
               tag, pl->bytes_compute / 1048576.0);
        pl->active = false;
    }

    // 7: FFN neurons with what is left.
    const int32_t mode = model->hp.sparse_mode;
    const int32_t n_layer = model->hp.n_layer, n_ff = model->hp.n_ff;
    for (int32_t il = 0; rc == POWERINFER_OK && il < n_layer; ++il) {
        if (!(is_hot[il] = calloc((size_t) n_ff, 1))) rc = pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    if (rc == POWERINFER_OK && pl->active && dense_all &&
        (mode == POWERINFER_SPARSE_GATE || mode == POWERINFER_SPARSE_PREDICTOR)) {
        rc = place_ffn(model, host, is_hot);
    }
    for (int32_t il = 0; il < n_layer; ++il) free(is_hot[il]);
    free(is_hot);

    if (rc == POWERINFER_OK && n_items == 0) {
        pi_log(POWERINFER_LOG_INFO, "%s: nothing fits in %.1f MiB (the compute buffers alone take about %.1f MiB); "
               "running on the CPU\n", tag, pl->budget / 1048576.0, (c_est + slack) / 1048576.0);
    }
    if (rc != POWERINFER_OK || !pl->active || placement_total(pl) > pl->budget) {
        // Nothing (more) on the device: back to the plain CPU path.
        host->drop_scheduler(host->self);
        pi_offload_free_ffn(&model->offload, n_layer);
        pi_offload_undo_dense(model, items, n_items);
        if (pl->bytes_kv) {
            const int32_t rc_kv = host->move_kv(host->self, NULL, NULL);
            rc = rc != POWERINFER_OK ? rc : rc_kv;
        }
        pl->bytes_dense = pl->bytes_kv = pl->bytes_compute = pl->bytes_ffn = 0;
        pl->n_layers_attn = 0;
        pl->active = false;
        free(items);
        return rc;
    }
    free(items);
    // A predictor now on the device is not read from its packed host copy any more.
    for (int32_t il = 0; il < n_layer; ++il) {
        struct pi_layer * l = &model->layers[il];
        struct ggml_tensor ** p[2] = { &l->fc1_p, &l->fc2_p };
        const struct ggml_tensor * w[2] = { l->fc1, l->fc2 };
        for (int k = 0; k < 2; ++k) {
            if (*p[k] && w[k]->buffer != model->buf_weights) {
                pi_release_pages((*p[k])->data, ggml_nbytes(*p[k]));
                *p[k] = NULL;
            }
        }
    }
    int64_t n_hot = 0;
    for (int32_t il = 0; il < n_layer; ++il) n_hot += model->offload.layers[il].n_hot;
    pi_log(POWERINFER_LOG_INFO,
           "%s: %s: attention of %d/%d layers, KV %s, FFN %.1f%% of neurons%s; %.1f of %.1f MiB "
           "(dense %.1f, KV %.1f, compute %.1f, FFN %.1f)\n",
           tag, pl->device.name, pl->n_layers_attn, n_layer, pl->bytes_kv ? "on the device" : "on the host",
           100.0 * n_hot / ((double) n_layer * n_ff), pl->from_cache ? " (from the gpuidx cache)" : "",
           placement_total(pl) / 1048576.0, pl->budget / 1048576.0, pl->bytes_dense / 1048576.0, pl->bytes_kv / 1048576.0,
           pl->bytes_compute / 1048576.0, pl->bytes_ffn / 1048576.0);
    return POWERINFER_OK;
}

void pi_placement_free(struct powerinfer_model * model) {
    pi_offload_free(model);
    pi_device_free(&model->placement.device);
    memset(&model->placement, 0, sizeof(model->placement));
}

// ---- public accounting ----------------------------------------------------------------

int32_t powerinfer_get_placement(const struct powerinfer_context * ctx, struct powerinfer_placement * out) {
    pi_clear_error();
    if (!ctx || !out) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_get_placement: NULL argument");
    }
    const struct powerinfer_model * model = ctx->model;
    const struct pi_placement * pl = &model->placement;
    memset(out, 0, sizeof(*out));
    snprintf(out->device, sizeof(out->device), "%s", pl->device.name[0] ? pl->device.name : "none");
    out->active        = pl->active;
    out->emulated      = pl->device.emulated;
    out->from_cache    = pl->from_cache;
    out->budget        = (int64_t) pl->budget;
    out->bytes_dense   = (int64_t) pl->bytes_dense;
    out->bytes_kv      = (int64_t) (pl->first_alive ? pl->bytes_kv : 0);
    out->bytes_compute = (int64_t) ((pl->first_alive ? pl->bytes_compute : 0) + pl->bytes_contexts);
    out->bytes_ffn     = (int64_t) pl->bytes_ffn;
    out->bytes_total   = (int64_t) device_in_use(pl);
    out->n_layers_attn = pl->n_layers_attn;
    for (int32_t il = 0; il < model->hp.n_layer; ++il) out->n_hot += model->offload.layers[il].n_hot;
    out->n_neurons = (int64_t) model->hp.n_layer * model->hp.n_ff;
    return POWERINFER_OK;
}

int32_t powerinfer_layer_hot_neurons(const struct powerinfer_context * ctx, int32_t il, int32_t * ids, int32_t n_max) {
    pi_clear_error();
    const struct powerinfer_model * model = ctx ? ctx->model : NULL;
    if (!model || il < 0 || il >= model->hp.n_layer) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "layer %d is out of range", il);
    }
    const struct pi_offload_layer * ol = &model->offload.layers[il];
    int32_t n = 0;
    for (int32_t i = 0; ol->is_hot && i < model->hp.n_ff; ++i) {
        if (ol->is_hot[i]) {
            if (ids && n < n_max) ids[n] = i;
            ++n;
        }
    }
    return n;
}
