// placement.c - hybrid placement over the devices (device.c: GPUs, iGPUs, RPC workers, or
// emulated ones): under each device's memory budget, put dense weights, the KV cache and
// the hottest FFN neurons there (PowerInfer's hybrid split), or whole layers (llama.cpp's
// layer split), never exceeding a budget. The decision is placement_plan.c's, a pure
// function of the sizes measured here; offload.c copies; the FFN sets of a single device
// are cached in gpuidx.c's file. The context being placed measures its own KV cache and
// compute buffers through the small interface it hands over (struct pi_placement_host).
// Without a GPU backend the same path runs with the "devices" emulated by CPU buffers
// (POWERINFER_EMULATE_DEVICE=N or model params .emulate_device), which is how the tests
// check the split, the accounting and the results.
//
// Hybrid order, device after device (a class that fits on none stops the dense ones):
//   1. attention weights and attn_norm, layer by layer from layer 0;
//   2. the predictors fc1/fc2 (predictor mode);  3. ffn_norm;  4. output_norm and output;
//   5. each device's layers' KV caches, when every dense class is placed;
//   6. the compute buffers, as measured by ggml's scheduler on this graph;
//   7. what is left on each device: the hottest FFN neurons of the layers whose attention
//      it holds (one knapsack per device), from per-neuron activation counts, or reused
//      from <model>.generated.gpuidx (one device).
// Layer split: the last n_gpu_layers layers, whole, in contiguous ranges by the devices'
// shares (tensor_split, else their budgets); a layer's FFN as compact rows of all its
// neurons (files with ffn_down_t) or its dense tensors; the output too when n_gpu_layers
// exceeds the layers.
// Every byte is counted from the sizes each device's allocator reports, in 64 bits, and the
// result is checked against the budgets after the compute buffers are measured again with
// everything in place; a device's FFN share shrinks until it fits.
#include "powerinfer-impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PI_DEVICE_MARGIN (512ull << 20)  // kept free on a real device when the budget is automatic
#define PI_MAX_DENSE     (20 * PI_MAX_LAYERS + 8)
#define PI_NEVER_FITS    (UINT64_MAX / 4)  // the size of a class that cannot be copied

int32_t powerinfer_place_groups(int32_t n_layer, int32_t n_groups, const double * values, const uint64_t * cost,
                                const int32_t * max_groups, uint64_t budget, int32_t * n_chosen) {
    pi_clear_error();
    return pi_plan_groups(n_layer, n_groups, values, cost, max_groups, budget, n_chosen);
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

// ---- the devices and their budgets -----------------------------------------------------

static int32_t env_count(const char * name) {
    const char * v = getenv(name);
    if (!v || !*v) return 0;
    const long n = strtol(v, NULL, 10);
    return n > 0 ? (int32_t) (n < PI_MAX_DEVICES ? n : PI_MAX_DEVICES) : 0;
}

// Device d's budget in bytes: the caller's (per device, or one for all), else its free
// memory less a margin (512 MiB, at most a sixteenth of what it has).
static uint64_t device_budget(const struct powerinfer_model_params * p, const struct pi_device * dev, int32_t d) {
    uint64_t free_b = 0, total_b = 0;
    pi_device_memory(dev, &free_b, &total_b);
    const uint64_t margin = total_b / 16 < PI_DEVICE_MARGIN ? total_b / 16 : PI_DEVICE_MARGIN;
    const uint64_t avail  = free_b > margin ? free_b - margin : 0;  // the automatic budget
    uint64_t asked;
    if (p->device_budgets && d < p->n_device_budgets) {
        asked = p->device_budgets[d] > 0 ? (uint64_t) p->device_budgets[d] : 0;
    } else if (p->vram_budget_bytes > 0) {
        asked = (uint64_t) p->vram_budget_bytes;
    } else if (p->vram_budget_gib >= 0.0f) {
        asked = (uint64_t) floor((double) p->vram_budget_gib * (double) (1ull << 30));
    } else {
        return avail;
    }
    // A budget above what the device has free is clamped to the automatic one (what an
    // 8 GiB budget means on a 6 GiB card); an emulated device's memory is the host's.
    if (total_b > 0 && asked > avail) {
        pi_log(POWERINFER_LOG_WARN, "powerinfer: placement: the budget of %.1f MiB for %s is more than it has free "
               "(%.1f of %.1f MiB); using %.1f MiB\n", asked / 1048576.0, dev->name, free_b / 1048576.0,
               total_b / 1048576.0, avail / 1048576.0);
        return avail;
    }
    return asked;
}

// The plan's mode for these parameters (enum powerinfer_split_mode; see powerinfer.h).
static enum pi_plan_mode plan_mode(const struct powerinfer_model * model) {
    const int32_t sm = model->params.split_mode;
    if (sm == POWERINFER_SPLIT_LAYER) return PI_PLAN_LAYERS;
    if (sm == POWERINFER_SPLIT_HYBRID) return PI_PLAN_HYBRID;
    const bool sparse = model->hp.sparse_mode == POWERINFER_SPARSE_GATE || model->hp.sparse_mode == POWERINFER_SPARSE_PREDICTOR;
    return !sparse && model->params.n_gpu_layers != 0 ? PI_PLAN_LAYERS : PI_PLAN_HYBRID;
}

// ---- what there is to place, and its sizes on each device ------------------------------

// A layer split puts the FFN on its device as compact rows of every neuron (the rows
// placement's path) when the file has ffn_down_t, else as its dense tensors.
static bool layer_ffn_as_rows(const struct powerinfer_model * model, int32_t il) {
    return model->layers[il].ffn_down_t != NULL;
}

// The dense items in the hybrid order (a layer split takes the same ones, by layer, and the
// dense FFN of layers without ffn_down_t).
static int32_t collect_dense(struct powerinfer_model * model, enum pi_plan_mode mode, struct pi_dense_item * items) {
    int32_t n = 0;
    const int32_t n_layer = model->hp.n_layer;
    for (int32_t il = 0; il < n_layer; ++il) {
        struct pi_layer * l = &model->layers[il];
        struct ggml_tensor ** s[] = { &l->attn_norm, &l->attn_norm_b, &l->attn_norm_2, &l->attn_norm_2_b, &l->wqkv,
                                      &l->wq, &l->wk, &l->wv, &l->wo, &l->bq, &l->bk, &l->bv };
        for (size_t i = 0; i < sizeof(s) / sizeof(s[0]); ++i) {
            if (*s[i]) items[n++] = (struct pi_dense_item) { s[i], il, PI_ITEM_ATTN, PI_PLAN_HOST };
        }
    }
    if (model->hp.sparse_mode == POWERINFER_SPARSE_PREDICTOR) {
        for (int32_t il = 0; il < n_layer; ++il) {
            items[n++] = (struct pi_dense_item) { &model->layers[il].fc1, il, PI_ITEM_PRED, PI_PLAN_HOST };
            items[n++] = (struct pi_dense_item) { &model->layers[il].fc2, il, PI_ITEM_PRED, PI_PLAN_HOST };
        }
    }
    for (int32_t il = 0; il < n_layer && model->layers[il].ffn_norm; ++il) {
        items[n++] = (struct pi_dense_item) { &model->layers[il].ffn_norm, il, PI_ITEM_FFN_NORM, PI_PLAN_HOST };
    }
    items[n++] = (struct pi_dense_item) { &model->output_norm, -1, PI_ITEM_OUTPUT, PI_PLAN_HOST };
    if (model->output_norm_b) items[n++] = (struct pi_dense_item) { &model->output_norm_b, -1, PI_ITEM_OUTPUT, PI_PLAN_HOST };
    items[n++] = (struct pi_dense_item) { &model->output, -1, PI_ITEM_OUTPUT, PI_PLAN_HOST };
    for (int32_t il = 0; mode == PI_PLAN_LAYERS && il < n_layer; ++il) {
        struct pi_layer * l = &model->layers[il];
        if (layer_ffn_as_rows(model, il)) {
            continue;
        }
        struct ggml_tensor ** s[] = { &l->ffn_gate, &l->ffn_up, &l->ffn_down };
        for (size_t i = 0; i < sizeof(s) / sizeof(s[0]); ++i) {
            if (*s[i]) items[n++] = (struct pi_dense_item) { s[i], il, PI_ITEM_FFN, PI_PLAN_HOST };
        }
    }
    return n;
}

// Bytes of the compact rows of n neurons of layer il on a device (offload.c's tensors).
static uint64_t rows_bytes(const struct powerinfer_model * model, const struct pi_device * dev, int32_t il, int64_t n) {
    const int64_t groups = (n + PI_OFFLOAD_GROUP - 1) / PI_OFFLOAD_GROUP;
    const uint64_t align = ggml_backend_buft_get_alignment(dev->buft);
    return (uint64_t) groups * pi_offload_group_cost(model, il) + 4 * align;  // 4 tensors, each aligned
}

struct pi_plan_sizes {
    struct pi_plan_layer_bytes layers[PI_MAX_DEVICES][PI_MAX_LAYERS];
};

// The plan's input: every class's bytes on every device.
static int32_t plan_input(struct powerinfer_model * model, const struct pi_placement_host * host, enum pi_plan_mode mode,
                          const struct pi_dense_item * items, int32_t n_items, const uint64_t * reserve,
                          struct pi_plan_sizes * sizes, struct pi_plan_input * in) {
    struct pi_placement * pl = &model->placement;
    const int32_t n_layer = model->hp.n_layer;
    memset(in, 0, sizeof(*in));
    memset(sizes, 0, sizeof(*sizes));
    in->mode = mode;
    in->n_dev = pl->n_dev;
    in->n_layer = n_layer;
    in->n_gpu_layers = model->params.n_gpu_layers;
    const bool sparse = model->hp.sparse_mode == POWERINFER_SPARSE_GATE || model->hp.sparse_mode == POWERINFER_SPARSE_PREDICTOR;
    for (int32_t d = 0; d < pl->n_dev; ++d) {
        const struct pi_device * dev = &pl->devs[d].dev;
        struct pi_plan_device * pd = &in->dev[d];
        pd->budget  = pl->devs[d].budget;
        pd->reserve = reserve[d];
        pd->share   = d < model->params.n_tensor_split && model->params.tensor_split ? model->params.tensor_split[d] : 0.0;
        pd->layers  = sizes->layers[d];
        for (int32_t i = 0; i < n_items; ++i) {
            const uint64_t b = pi_model_file_tensor(model, *items[i].slot) ? pi_device_alloc_size(dev, *items[i].slot)
                                                                           : PI_NEVER_FITS;
            struct pi_plan_layer_bytes * lb = items[i].layer >= 0 ? &sizes->layers[d][items[i].layer] : NULL;
            switch (items[i].cls) {
                case PI_ITEM_ATTN:     lb->attn += b; break;
                case PI_ITEM_PRED:     lb->pred += b; break;
                case PI_ITEM_FFN_NORM: lb->ffn_norm += b; break;
                case PI_ITEM_FFN:      lb->ffn += b; break;
                case PI_ITEM_OUTPUT:   pd->output += b; break;
            }
        }
        if (dev->rpc) {
            // The LM head stays home: an RPC worker holding it would send n_vocab logits back
            // every token (196 KiB for SmolLM2) where the hidden state is n_embd floats.
            pd->output = PI_PLAN_NO_OUTPUT;
        }
        for (int32_t il = 0; il < n_layer; ++il) {
            struct pi_plan_layer_bytes * lb = &sizes->layers[d][il];
            lb->kv = host->kv_layer_bytes(host->self, il, dev->buft);
            if (mode == PI_PLAN_LAYERS && layer_ffn_as_rows(model, il)) {
                lb->ffn = rows_bytes(model, dev, il, model->hp.n_ff);
            }
            if (mode == PI_PLAN_HYBRID && sparse && model->layers[il].ffn_down_t) {
                lb->group = pi_offload_group_cost(model, il);
            }
        }
    }
    return POWERINFER_OK;
}

// ---- executing the plan ---------------------------------------------------------------------

static uint64_t device_total(const struct pi_placement_device * pd) {
    return pd->bytes_dense + pd->bytes_kv + pd->bytes_compute + pd->bytes_ffn;
}

// What a device holds now: the placed weights, the deciding context's KV cache and compute
// buffers while it exists, and the later contexts' compute buffers.
static uint64_t device_in_use(const struct pi_placement * pl, const struct pi_placement_device * pd) {
    return pd->bytes_dense + pd->bytes_ffn + (pl->first_alive ? pd->bytes_kv + pd->bytes_compute : 0) + pd->bytes_contexts;
}

static bool over_budget(const struct pi_placement * pl) {
    for (int32_t d = 0; d < pl->n_dev; ++d) {
        if (device_total(&pl->devs[d]) > pl->devs[d].budget) return true;
    }
    return false;
}

// Re-measures every device's compute buffers with what is placed now.
static int32_t remeasure(struct pi_placement * pl, const struct pi_placement_host * host) {
    uint64_t bytes[PI_MAX_DEVICES] = { 0 };
    const int32_t rc = host->measure_compute(host->self, bytes);
    for (int32_t d = 0; d < pl->n_dev; ++d) pl->devs[d].bytes_compute = rc == POWERINFER_OK ? bytes[d] : 0;
    return rc;
}

// The KV cache where the plan puts each layer's.
static int32_t move_kv(struct powerinfer_model * model, const struct pi_placement_host * host, const struct pi_plan * plan) {
    struct pi_placement * pl = &model->placement;
    ggml_backend_buffer_type_t bufts[PI_MAX_LAYERS] = { 0 };
    bool any = false;
    for (int32_t il = 0; il < model->hp.n_layer; ++il) {
        pl->kv_dev[il] = plan->kv[il];
        if (plan->kv[il] >= 0) {
            bufts[il] = pl->devs[plan->kv[il]].dev.buft;
            any = true;
        }
    }
    if (!any) {
        return POWERINFER_OK;
    }
    int32_t rc = host->move_kv(host->self, bufts);
    if (rc != POWERINFER_OK) {
        pi_log(POWERINFER_LOG_WARN, "powerinfer: placement: the KV cache could not move to the devices (%s); it stays in "
               "host memory\n", powerinfer_last_error());
        pi_clear_error();
        memset(pl->kv_dev, PI_PLAN_HOST, sizeof(pl->kv_dev));
        return host->move_kv(host->self, NULL);
    }
    for (int32_t il = 0; il < model->hp.n_layer; ++il) {
        if (plan->kv[il] >= 0) {
            pl->devs[plan->kv[il]].bytes_kv += host->kv_layer_bytes(host->self, il, bufts[il]);
        }
    }
    return POWERINFER_OK;
}

struct count_ref { float c; int32_t i; };
static int cmp_count_ref(const void * a, const void * b) {
    const struct count_ref * x = a, * y = b;
    if (x->c != y->c) return x->c > y->c ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

// The layers' neurons sorted by activation count (order[il * n_ff + k] = the k-th hottest)
// and the group values the solver reads. False when the model has no counts.
static bool sorted_counts(const struct powerinfer_model * model, int32_t * order, double * values) {
    const int32_t n_layer = model->hp.n_layer, n_ff = model->hp.n_ff;
    const int32_t n_groups = (n_ff + PI_OFFLOAD_GROUP - 1) / PI_OFFLOAD_GROUP;
    float * counts = malloc(sizeof(float) * (size_t) n_ff);
    struct count_ref * refs = malloc(sizeof(*refs) * (size_t) n_ff);
    bool ok = counts && refs;
    memset(values, 0, sizeof(double) * (size_t) n_layer * n_groups);
    for (int32_t il = 0; ok && il < n_layer; ++il) {
        if (!(ok = pi_model_act_counts(model, il, counts))) {
            break;
        }
        for (int32_t i = 0; i < n_ff; ++i) refs[i] = (struct count_ref) { counts[i], i };
        qsort(refs, (size_t) n_ff, sizeof(*refs), cmp_count_ref);
        for (int32_t i = 0; i < n_ff; ++i) {
            order[(size_t) il * n_ff + i] = refs[i].i;
            values[(size_t) il * n_groups + i / PI_OFFLOAD_GROUP] += refs[i].c;
        }
    }
    free(counts);
    free(refs);
    return ok;
}

static void release_ffn(struct powerinfer_model * model) {
    struct pi_placement * pl = &model->placement;
    pi_offload_free_ffn(&model->offload, model->hp.n_layer);
    for (int32_t d = 0; d < pl->n_dev; ++d) {
        pl->devs[d].bytes_ffn = 0;
        pl->devs[d].n_hot = 0;
    }
}

// Copies is_hot's rows to the layers' devices and measures again.
static int32_t copy_ffn(struct powerinfer_model * model, const struct pi_placement_host * host, uint8_t ** is_hot,
                        const int8_t * layer_dev) {
    struct pi_placement * pl = &model->placement;
    struct pi_device devs[PI_MAX_DEVICES];
    for (int32_t d = 0; d < pl->n_dev; ++d) devs[d] = pl->devs[d].dev;
    int32_t rc = pi_offload_ffn(model, devs, is_hot, layer_dev);
    for (int32_t d = 0; d < pl->n_dev; ++d) pl->devs[d].bytes_ffn = pi_offload_ffn_bytes(&model->offload, d);
    for (int32_t il = 0; il < model->hp.n_layer; ++il) {
        const struct pi_offload_layer * ol = &model->offload.layers[il];
        if (ol->n_hot > 0) pl->devs[ol->dev].n_hot += ol->n_hot;
    }
    return rc == POWERINFER_OK ? remeasure(pl, host) : rc;
}

// A layer split's FFN rows: every neuron of the layers the plan puts on a device.
static int32_t place_layer_rows(struct powerinfer_model * model, const struct pi_placement_host * host,
                                const struct pi_plan * plan, uint8_t ** is_hot) {
    const int32_t n_layer = model->hp.n_layer, n_ff = model->hp.n_ff;
    bool any = false;
    for (int32_t il = 0; il < n_layer; ++il) {
        const bool on = plan->ffn[il] >= 0 && layer_ffn_as_rows(model, il);
        memset(is_hot[il], on ? 1 : 0, (size_t) n_ff);
        any |= on;
    }
    return any ? copy_ffn(model, host, is_hot, plan->ffn) : POWERINFER_OK;
}

// 7 (hybrid): the hottest neurons with what each device has left. A single device's sets
// are reused from the gpuidx cache for the same capacity; when the compute buffers grow
// with the rows, a device's excess is given up and the sets are solved again.
static int32_t place_hot_rows(struct powerinfer_model * model, const struct pi_placement_host * host,
                              const struct pi_plan_input * in, const struct pi_plan * plan, uint8_t ** is_hot) {
    static const char * const tag = "powerinfer: placement";
    struct pi_placement * pl = &model->placement;
    const int32_t n_layer = model->hp.n_layer, n_ff = model->hp.n_ff;
    const int32_t n_groups = (n_ff + PI_OFFLOAD_GROUP - 1) / PI_OFFLOAD_GROUP;
    int32_t * order  = malloc(sizeof(int32_t) * (size_t) n_layer * n_ff);
    double *  values = malloc(sizeof(double) * (size_t) n_layer * n_groups);
    int32_t * chosen = malloc(sizeof(int32_t) * (size_t) n_layer);
    int32_t rc = POWERINFER_OK;
    if (!order || !values || !chosen) {
        rc = pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory in placement");
        goto done;
    }
    const bool have_counts = sorted_counts(model, order, values);
    uint64_t capacity[PI_MAX_DEVICES] = { 0 };
    for (int32_t d = 0; d < pl->n_dev; ++d) {
        // The compute buffers are measured now; keep a little for their growth with the rows
        // (the loop below measures again and shrinks if that was not enough).
        const uint64_t fixed = device_total(&pl->devs[d]) + pl->devs[d].bytes_compute / 64 + (64u << 10);
        capacity[d] = pl->devs[d].budget > fixed ? pl->devs[d].budget - fixed : 0;
    }
    const uint64_t capacity0 = capacity[0];  // the cache's key: what the first attempt had
    char path[4096];
    snprintf(path, sizeof(path), "%s.generated.gpuidx", model->path);
    const bool cache = pl->n_dev == 1;  // PowerInfer's file holds one device's sets
    bool solved = false;
    for (int attempt = 0; attempt < 4 && rc == POWERINFER_OK; ++attempt) {
        uint64_t cap_file = 0;
        pl->from_cache = false;
        if (cache && attempt == 0 && !model->params.reset_gpu_index && access(path, F_OK) == 0 &&
            pi_gpuidx_read(model, path, &cap_file, is_hot) == POWERINFER_OK) {
            int64_t n_hot = 0;
            for (int32_t il = 0; il < n_layer; ++il) for (int32_t i = 0; i < n_ff; ++i) n_hot += is_hot[il][i];
            // Reused only for the same capacity and when its rows fit it.
            uint64_t need = 0;
            for (int32_t il = 0; il < n_layer; ++il) {
                int64_t k = 0;
                for (int32_t i = 0; i < n_ff; ++i) k += is_hot[il][i];
                need += (uint64_t) ((k + PI_OFFLOAD_GROUP - 1) / PI_OFFLOAD_GROUP) * in->dev[0].layers[il].group;
            }
            pl->from_cache = cap_file == capacity[0] && need <= capacity[0] && n_hot >= 0;
            if (!pl->from_cache) {
                pi_log(POWERINFER_LOG_INFO, "%s: %s is for %.1f MiB, now %.1f MiB: solving again\n", tag, path,
                       cap_file / 1048576.0, capacity[0] / 1048576.0);
            }
        }
        pi_clear_error();
        if (!pl->from_cache) {
            if (!have_counts) {
                pi_log(POWERINFER_LOG_WARN, "%s: the model has no activation counts (blk.N.ffn_act_count; "
                       "`powerinfer profile` makes them); FFN stays on the CPU\n", tag);
                break;
            }
            if ((rc = pi_plan_ffn(in, plan, n_groups, values, capacity, chosen)) != POWERINFER_OK) break;
            for (int32_t il = 0; il < n_layer; ++il) {
                memset(is_hot[il], 0, (size_t) n_ff);
                const int32_t k = chosen[il] * PI_OFFLOAD_GROUP < n_ff ? chosen[il] * PI_OFFLOAD_GROUP : n_ff;
                for (int32_t j = 0; j < k; ++j) is_hot[il][order[(size_t) il * n_ff + j]] = 1;
            }
            solved = true;
        }
        if ((rc = copy_ffn(model, host, is_hot, plan->ffn)) != POWERINFER_OK) break;
        if (!over_budget(pl)) break;
        // The compute buffers grew with the rows: each device over its budget gives up the
        // excess (and a group for alignment), and the sets are solved again.
        for (int32_t d = 0; d < pl->n_dev; ++d) {
            const struct pi_placement_device * pd = &pl->devs[d];
            if (device_total(pd) <= pd->budget) continue;
            const uint64_t cut = device_total(pd) - pd->budget + pi_offload_group_cost(model, 0) + 4096;
            pi_log(POWERINFER_LOG_INFO, "%s: %s is %.2f MiB over its budget, shrinking its FFN share\n", tag, pd->dev.name,
                   (device_total(pd) - pd->budget) / 1048576.0);
            capacity[d] = capacity[d] > cut ? capacity[d] - cut : 0;
        }
        release_ffn(model);
        pl->from_cache = false;
    }
    if (rc == POWERINFER_OK && over_budget(pl)) {
        release_ffn(model);
        rc = remeasure(pl, host);
    }
    if (rc == POWERINFER_OK && cache && solved && pl->devs[0].bytes_ffn > 0) {
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
done:
    free(order); free(values); free(chosen);
    return rc;
}

// Back to the plain CPU path: every copy freed, the KV cache in host memory.
static int32_t undo(struct powerinfer_model * model, const struct pi_placement_host * host, struct pi_dense_item * items,
                    int32_t n_items) {
    struct pi_placement * pl = &model->placement;
    host->drop_scheduler(host->self);
    pi_offload_free_ffn(&model->offload, model->hp.n_layer);
    pi_offload_undo_dense(model, items, n_items);
    bool kv = false;
    for (int32_t d = 0; d < pl->n_dev; ++d) {
        kv |= pl->devs[d].bytes_kv > 0;
        pl->devs[d].bytes_dense = pl->devs[d].bytes_kv = pl->devs[d].bytes_compute = pl->devs[d].bytes_ffn = 0;
        pl->devs[d].n_layers_attn = 0;
        pl->devs[d].n_hot = 0;
    }
    pl->active = false;
    memset(pl->kv_dev, PI_PLAN_HOST, sizeof(pl->kv_dev));
    return kv ? host->move_kv(host->self, NULL) : POWERINFER_OK;
}

static void log_placement(const struct powerinfer_model * model) {
    const struct pi_placement * pl = &model->placement;
    const int32_t n_layer = model->hp.n_layer, n_ff = model->hp.n_ff;
    for (int32_t d = 0; d < pl->n_dev; ++d) {
        const struct pi_placement_device * pd = &pl->devs[d];
        pi_log(POWERINFER_LOG_INFO,
               "powerinfer: placement (%s): %s: attention of %d/%d layers, KV %.1f MiB, FFN %.1f%% of neurons%s; "
               "%.1f of %.1f MiB (dense %.1f, KV %.1f, compute %.1f, FFN %.1f)\n",
               pl->mode == PI_PLAN_LAYERS ? "layer split" : "hybrid", pd->dev.name, pd->n_layers_attn, n_layer,
               pd->bytes_kv / 1048576.0, 100.0 * pd->n_hot / ((double) n_layer * n_ff),
               pl->from_cache ? " (from the gpuidx cache)" : "", device_total(pd) / 1048576.0, pd->budget / 1048576.0,
               pd->bytes_dense / 1048576.0, pd->bytes_kv / 1048576.0, pd->bytes_compute / 1048576.0, pd->bytes_ffn / 1048576.0);
    }
}

int32_t pi_placement_decide(struct powerinfer_model * model, const struct pi_placement_host * host) {
    struct pi_placement * pl = &model->placement;
    static const char * const tag = "powerinfer: placement";
    if (pl->decided) {
        return POWERINFER_OK;
    }
    pl->decided = true;
    memset(pl->kv_dev, PI_PLAN_HOST, sizeof(pl->kv_dev));
    const struct powerinfer_model_params * mp = &model->params;
    const int32_t n_emulated = env_count("POWERINFER_EMULATE_DEVICE") ? env_count("POWERINFER_EMULATE_DEVICE")
                                                                      : mp->emulate_device ? 1 : 0;
    const bool nothing = (mp->vram_budget_bytes <= 0 && mp->vram_budget_gib == 0.0f && !mp->device_budgets) ||
                         mp->split_mode == POWERINFER_SPLIT_NONE;
    if (nothing && !(mp->rpc_servers && *mp->rpc_servers && mp->split_mode != POWERINFER_SPLIT_NONE)) {
        return POWERINFER_OK;  // no device wanted
    }
    struct pi_device devs[PI_MAX_DEVICES];
    const int32_t n_dev = pi_devices_open(devs, PI_MAX_DEVICES, n_emulated, mp->rpc_servers);
    if (n_dev < 0) {
        return n_dev;  // an RPC worker that cannot be reached: the load fails, naming it
    }
    if (n_dev == 0) {
        pi_log(POWERINFER_LOG_INFO, "%s: no GPU backend in this ggml build (%s); running on the CPU\n", tag,
               ggml_backend_dev_count() > 0 ? "CPU only" : "no devices");
        return POWERINFER_OK;
    }
    pl->n_dev = n_dev;
    pl->mode  = plan_mode(model);
    uint64_t any_budget = 0;
    for (int32_t d = 0; d < n_dev; ++d) {
        pl->devs[d].dev    = devs[d];
        pl->devs[d].budget = device_budget(mp, &devs[d], d);
        any_budget |= pl->devs[d].budget;
        pi_log(POWERINFER_LOG_INFO, "%s: device %s, budget %.1f MiB\n", tag, devs[d].name, pl->devs[d].budget / 1048576.0);
    }
    if (any_budget == 0) {
        return POWERINFER_OK;
    }

    // Compute-buffer estimate from the CPU-only reservation (a device's share is at most the
    // whole graph's), with slack for the inputs the scheduler copies across.
    const uint64_t c_est = host->compute_estimate;
    const uint64_t slack = c_est / 32 + (64u << 10);
    struct pi_dense_item * items = malloc(sizeof(*items) * PI_MAX_DENSE);
    struct pi_plan_sizes * sizes = malloc(sizeof(*sizes));
    struct pi_plan_input * in = malloc(sizeof(*in));
    struct pi_plan *       plan = malloc(sizeof(*plan));
    uint8_t ** is_hot = calloc((size_t) model->hp.n_layer, sizeof(uint8_t *));
    int32_t n_items = 0, rc = POWERINFER_OK;
    if (!items || !sizes || !in || !plan || !is_hot) {
        rc = pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
        goto done;
    }
    for (int32_t il = 0; il < model->hp.n_layer; ++il) {
        if (!(is_hot[il] = calloc((size_t) model->hp.n_ff, 1))) {
            rc = pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
            goto done;
        }
    }

    // 1-6, up to three times: the plan, the dense copies and the KV cache, then the compute
    // buffers as the scheduler lays them out. The first plan reserves the CPU-only estimate
    // for them; a device's share can be larger (a split graph copies its inputs across, a
    // partial layer split keeps the hidden state's copies), so when the measured buffers
    // do not fit the plan is undone and solved again reserving what was measured.
    uint64_t reserve[PI_MAX_DEVICES];
    for (int32_t d = 0; d < n_dev; ++d) reserve[d] = c_est + slack;
    n_items = collect_dense(model, pl->mode, items);
    for (int attempt = 0;; ++attempt) {
        if ((rc = plan_input(model, host, pl->mode, items, n_items, reserve, sizes, in)) != POWERINFER_OK ||
            (rc = pi_plan_solve(in, plan)) != POWERINFER_OK) {
            goto done;
        }
        int32_t n_placed = 0;
        for (int32_t i = 0; i < n_items; ++i) {
            const struct pi_dense_item * it = &items[i];
            switch (it->cls) {
                case PI_ITEM_ATTN:     items[i].dev = plan->attn[it->layer]; break;
                case PI_ITEM_PRED:     items[i].dev = plan->pred[it->layer]; break;
                case PI_ITEM_FFN_NORM: items[i].dev = plan->ffn_norm[it->layer]; break;
                case PI_ITEM_FFN:      items[i].dev = plan->ffn[it->layer]; break;
                case PI_ITEM_OUTPUT:   items[i].dev = plan->output; break;
            }
            n_placed += items[i].dev >= 0;
        }
        bool kv_planned = false;
        for (int32_t il = 0; il < model->hp.n_layer; ++il) kv_planned |= plan->kv[il] >= 0;
        if (n_placed == 0 && !kv_planned) {
            pi_log(POWERINFER_LOG_INFO, "%s: nothing fits in the devices' budgets (the compute buffers alone take about "
                   "%.1f MiB each); running on the CPU\n", tag, reserve[0] / 1048576.0);
            goto done;
        }
        rc = pi_offload_dense(model, devs, items, n_items);
        for (int32_t d = 0; d < n_dev; ++d) pl->devs[d].bytes_dense = pi_offload_dense_bytes(&model->offload, d);
        for (int32_t il = 0; il < model->hp.n_layer; ++il) {
            if (plan->attn[il] >= 0) pl->devs[plan->attn[il]].n_layers_attn++;
        }
        if (rc == POWERINFER_OK) rc = move_kv(model, host, plan);
        pl->active = rc == POWERINFER_OK;
        if (pl->active) rc = remeasure(pl, host);
        if (rc != POWERINFER_OK || !pl->active || !over_budget(pl)) {
            break;
        }
        // Over a budget: reserve what was measured (and the slack) where it grew, and again.
        bool grew = false;
        for (int32_t d = 0; d < n_dev; ++d) {
            const uint64_t want = pl->devs[d].bytes_compute + slack;
            if (want > reserve[d]) {
                reserve[d] = want;
                grew = true;
            }
        }
        const int32_t rc_undo = undo(model, host, items, n_items);
        if (rc_undo != POWERINFER_OK) {
            rc = rc_undo;
            goto done;
        }
        if (!grew || attempt == 2) {
            pi_log(POWERINFER_LOG_WARN, "%s: the compute buffers do not fit next to the dense weights; nothing placed\n", tag);
            goto done;
        }
        pi_log(POWERINFER_LOG_INFO, "%s: the compute buffers outgrew their reserve; solving again\n", tag);
    }

    // 7: FFN neurons (a layer split's whole FFNs; the hybrid's hottest ones).
    const int32_t mode = model->hp.sparse_mode;
    if (rc == POWERINFER_OK && pl->active) {
        if (pl->mode == PI_PLAN_LAYERS) {
            rc = place_layer_rows(model, host, plan, is_hot);
        } else if (plan->dense_all && (mode == POWERINFER_SPARSE_GATE || mode == POWERINFER_SPARSE_PREDICTOR)) {
            rc = place_hot_rows(model, host, in, plan, is_hot);
        }
    }
    for (int32_t d = 0; rc == POWERINFER_OK && d < n_dev; ++d) {
        if (pi_device_failed(&devs[d])) {
            pi_device_disconnect(&devs[d]);
            rc = pi_fail(POWERINFER_ERR_IO, "RPC worker %s stopped answering while the model was placed", devs[d].name);
        }
    }
    if (rc != POWERINFER_OK || !pl->active || over_budget(pl)) {
        const int32_t rc_undo = undo(model, host, items, n_items);
        rc = rc != POWERINFER_OK ? rc : rc_undo;
        goto done;
    }
    // A predictor now on a device is not read from its packed host copy any more.
    for (int32_t il = 0; il < model->hp.n_layer; ++il) {
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
    log_placement(model);
done:
    for (int32_t il = 0; is_hot && il < model->hp.n_layer; ++il) free(is_hot[il]);
    free(is_hot);
    free(items); free(sizes); free(in); free(plan);
    if (!pl->active) {
        // The devices stay open only while something is on them.
        for (int32_t d = 0; d < pl->n_dev; ++d) pi_device_free(&pl->devs[d].dev);
        memset(pl->devs, 0, sizeof(pl->devs));
        pl->n_dev = 0;
    }
    return rc;
}

int32_t pi_placement_admit(struct powerinfer_model * model, const struct pi_placement_host * host, uint64_t * device_bytes) {
    struct pi_placement * pl = &model->placement;
    memset(device_bytes, 0, sizeof(uint64_t) * PI_MAX_DEVICES);
    uint64_t need[PI_MAX_DEVICES] = { 0 }, kv[PI_MAX_DEVICES] = { 0 };
    // Its KV cache where the plan put the first context's, when that fits next to what the
    // devices hold: a layer's attention then reads its cache where it computes (a cache in
    // host memory would cross to an RPC worker every step).
    ggml_backend_buffer_type_t bufts[PI_MAX_LAYERS] = { 0 };
    bool any = false;
    for (int32_t il = 0; il < model->hp.n_layer; ++il) {
        if (pl->kv_dev[il] >= 0) {
            bufts[il] = pl->devs[pl->kv_dev[il]].dev.buft;
            kv[pl->kv_dev[il]] += host->kv_layer_bytes(host->self, il, bufts[il]);
            any = true;
        }
    }
    bool kv_fits = any;
    for (int32_t d = 0; any && d < pl->n_dev; ++d) {
        kv_fits &= device_in_use(pl, &pl->devs[d]) + kv[d] <= pl->devs[d].budget;
    }
    int32_t rc = POWERINFER_OK;
    if (kv_fits && host->move_kv(host->self, bufts) != POWERINFER_OK) {
        pi_clear_error();
        kv_fits = false;
        if ((rc = host->move_kv(host->self, NULL)) != POWERINFER_OK) return rc;
    }
    if (!kv_fits) memset(kv, 0, sizeof(kv));
    rc = host->measure_compute(host->self, need);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    for (int32_t d = 0; d < pl->n_dev; ++d) need[d] += kv[d];
    bool fits = true;
    for (int32_t d = 0; d < pl->n_dev; ++d) fits &= device_in_use(pl, &pl->devs[d]) + need[d] <= pl->devs[d].budget;
    if (!fits && kv_fits) {
        // The compute buffers with the KV cache there do not fit: the cache in host memory.
        if ((rc = host->move_kv(host->self, NULL)) != POWERINFER_OK || (rc = host->measure_compute(host->self, need)) != POWERINFER_OK) {
            return rc;
        }
        memset(kv, 0, sizeof(kv));
    }
    for (int32_t d = 0; d < pl->n_dev; ++d) {
        const struct pi_placement_device * pd = &pl->devs[d];
        const uint64_t used = device_in_use(pl, pd);
        if (used + need[d] > pd->budget) {
            host->drop_scheduler(host->self);
            return pi_fail(POWERINFER_ERR_NO_MEMORY,
                           "this context's compute buffers%s need %.1f MiB of %s, but the model's %.1f MiB budget there "
                           "has %.1f MiB left (its placement and other contexts hold the rest); use a smaller n_batch or "
                           "n_ctx, free another context, or load the model with a larger budget",
                           kv[d] ? " and KV cache" : "", need[d] / 1048576.0, pd->dev.name, pd->budget / 1048576.0,
                           (used < pd->budget ? pd->budget - used : 0) / 1048576.0);
        }
    }
    for (int32_t d = 0; d < pl->n_dev; ++d) {
        pl->devs[d].bytes_contexts += need[d];
        device_bytes[d] = need[d];
    }
    return POWERINFER_OK;
}

void pi_placement_release(struct powerinfer_model * model, bool first, const uint64_t * device_bytes) {
    struct pi_placement * pl = &model->placement;
    if (first) {
        pl->first_alive = false;
    }
    for (int32_t d = 0; d < pl->n_dev; ++d) {
        struct pi_placement_device * pd = &pl->devs[d];
        pd->bytes_contexts -= device_bytes[d] < pd->bytes_contexts ? device_bytes[d] : pd->bytes_contexts;
    }
}

int32_t pi_placement_check(struct powerinfer_model * model) {
    struct pi_placement * pl = &model->placement;
    for (int32_t d = 0; !pl->failed && d < pl->n_dev; ++d) {
        if (pi_device_failed(&pl->devs[d].dev)) {
            pl->failed = true;
            pi_device_disconnect(&pl->devs[d].dev);
            pi_log(POWERINFER_LOG_ERROR, "powerinfer: %s stopped answering; the model cannot compute any more\n",
                   pl->devs[d].dev.name);
        }
    }
    if (!pl->failed) {
        return POWERINFER_OK;
    }
    for (int32_t d = 0; d < pl->n_dev; ++d) {
        if (pi_device_failed(&pl->devs[d].dev)) {
            return pi_fail(POWERINFER_ERR_IO, "RPC worker %s stopped answering (it died, was stopped or the network "
                           "failed): this model cannot compute any more; load it again once the worker is back",
                           pl->devs[d].dev.name);
        }
    }
    return pi_fail(POWERINFER_ERR_IO, "an RPC worker of this model stopped answering: load the model again");
}

bool powerinfer_model_failed(const struct powerinfer_model * model) {
    return model && model->placement.failed;
}

void pi_placement_free(struct powerinfer_model * model) {
    pi_offload_free(model);
    for (int32_t d = 0; d < model->placement.n_dev; ++d) pi_device_free(&model->placement.devs[d].dev);
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
    if (pl->n_dev == 1) snprintf(out->device, sizeof(out->device), "%s", pl->devs[0].dev.name);
    else if (pl->n_dev > 1) snprintf(out->device, sizeof(out->device), "%d devices", pl->n_dev);
    else snprintf(out->device, sizeof(out->device), "none");
    out->n_devices  = pl->n_dev;
    out->active     = pl->active;
    out->emulated   = pl->n_dev > 0 && pl->devs[0].dev.emulated;
    out->from_cache = pl->from_cache;
    out->layer_split = pl->mode == PI_PLAN_LAYERS;
    for (int32_t d = 0; d < pl->n_dev; ++d) {
        const struct pi_placement_device * pd = &pl->devs[d];
        out->budget        += (int64_t) pd->budget;
        out->bytes_dense   += (int64_t) pd->bytes_dense;
        out->bytes_kv      += (int64_t) (pl->first_alive ? pd->bytes_kv : 0);
        out->bytes_compute += (int64_t) ((pl->first_alive ? pd->bytes_compute : 0) + pd->bytes_contexts);
        out->bytes_ffn     += (int64_t) pd->bytes_ffn;
        out->bytes_total   += (int64_t) device_in_use(pl, pd);
        out->n_hot         += pd->n_hot;
    }
    for (int32_t il = 0; il < model->hp.n_layer; ++il) {
        out->n_layers_attn += pi_offload_holds(&model->offload, model->layers[il].wo ? model->layers[il].wo : model->layers[il].wqkv);
    }
    out->n_neurons = (int64_t) model->hp.n_layer * model->hp.n_ff;
    return POWERINFER_OK;
}

int32_t powerinfer_get_placement_device(const struct powerinfer_context * ctx, int32_t i, struct powerinfer_placement_device * out) {
    pi_clear_error();
    if (!ctx || !out) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_get_placement_device: NULL argument");
    }
    const struct pi_placement * pl = &ctx->model->placement;
    if (i < 0 || i >= pl->n_dev) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "device %d is outside [0, %d)", i, pl->n_dev);
    }
    const struct pi_placement_device * pd = &pl->devs[i];
    memset(out, 0, sizeof(*out));
    snprintf(out->name, sizeof(out->name), "%s", pd->dev.name);
    out->rpc           = pd->dev.rpc;
    out->emulated      = pd->dev.emulated;
    out->budget        = (int64_t) pd->budget;
    out->bytes_dense   = (int64_t) pd->bytes_dense;
    out->bytes_kv      = (int64_t) (pl->first_alive ? pd->bytes_kv : 0);
    out->bytes_compute = (int64_t) ((pl->first_alive ? pd->bytes_compute : 0) + pd->bytes_contexts);
    out->bytes_ffn     = (int64_t) pd->bytes_ffn;
    out->bytes_total   = (int64_t) device_in_use(pl, pd);
    out->n_layers_attn = pd->n_layers_attn;
    out->n_hot         = pd->n_hot;
    uint64_t free_b = 0, total_b = 0;
    if (!pd->dev.emulated && !pl->failed) {
        pi_device_memory(&pd->dev, &free_b, &total_b);
    }
    out->memory_free  = (int64_t) free_b;
    out->memory_total = (int64_t) total_b;
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
