// context.c - an inference context: KV cache, compute buffers, the decode loop
// (batched prompt processing and single-token decode) and the logits it produces.
#include "powerinfer-impl.h"

#include "ggml-cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>

#define PI_DEFAULT_N_BATCH 512u
#define PI_MAX_N_CTX       (1u << 22)
// Attention spans the cache in steps of this many cells (llama.cpp's padding). The
// extra cells are masked out; matching the padding keeps our sums in the same order
// as llama.cpp's, so quantized activations round the same way and tokens agree.
#define PI_KV_PAD          256u
// Largest batch that takes the sparse FFN path by default: above it the union of the
// batch's active neurons covers most of the layer and ggml's dense matmul wins
// (measured on the 7B-shaped synthetic model, see docs/formats.md).
#define PI_SPARSE_MAX_BATCH 8
#define PI_SPARSE_MAX_BATCH_LIMIT 32

static int32_t default_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int32_t) n : 1;
}

struct powerinfer_context_params powerinfer_context_default_params(void) {
    struct powerinfer_context_params p = {
        .n_ctx           = 512,
        .n_batch         = PI_DEFAULT_N_BATCH,
        .seed            = 0xFFFFFFFFu,
        .n_threads       = 0,
        .n_threads_batch = 0,
        .flash_attn      = -1,
        .embeddings      = false,
        .collect_activations = false,
        .sparse_max_batch = -1,
        .n_seq_max       = 1,
        .batch_invariant = false,
    };
    return p;
}

// Builds the graph for one chunk into the context's graph memory.
static struct ggml_cgraph * build_chunk(struct powerinfer_context * ctx, const struct pi_graph_params * gp,
                                        struct pi_graph_inputs * in) {
    struct ggml_init_params ip = {
        .mem_size   = ctx->graph_buf_size,
        .mem_buffer = ctx->graph_buf,
        .no_alloc   = true,
    };
    struct ggml_context * gctx = ggml_init(ip);
    if (!gctx) {
        return NULL;
    }
    struct ggml_cgraph * gf = pi_build_graph(gctx, ctx->model, &ctx->kv, gp, in);
    // The graph lives in graph_buf; the ggml_context header itself can go.
    ggml_free(gctx);
    return gf;
}

// Flash-attention contexts attend with pi_attention (attention.c) while the cache is on the
// CPU (no scheduler): batch-invariant by construction, which the parallel slots need, and
// faster than ggml's flash attention at decode (it reads each K and V row once per head
// group; Qwen2.5-Coder-1.5B at 40% input sparsity, 2 EPYC cores: the attention's share of
// a decode step 5.7% -> 3.3%, ggml's barrier waits 6.7% -> 4.4%) and no slower on a
// 450-token prompt (8.57 against 8.60-8.97 ms per token).
static bool use_pi_attention(const struct powerinfer_context * ctx) {
    return ctx->params.flash_attn && !ctx->sched;
}

// The largest graph of this context: n_batch tokens over the whole cache.
static struct ggml_cgraph * build_reserve_graph(struct powerinfer_context * ctx) {
    struct pi_graph_params gp = {
        .n_tokens   = (int32_t) ctx->params.n_batch,
        .n_kv       = (int32_t) ctx->kv.size,
        .n_outputs  = (int32_t) ctx->params.n_batch,
        .flash_attn = ctx->params.flash_attn,
        .pi_attn = use_pi_attention(ctx),
        .sparse_max_batch = ctx->params.sparse_max_batch,
        .sparse     = ctx->sparse,
        .inputs     = ctx->inputs,
        .input_ops  = ctx->input_ops,
    };
    struct pi_graph_inputs in = { .cap_x = ctx->capture.tx, .cap_act = ctx->capture.tact };
    ctx->last.valid = false;  // the graph memory now holds this one
    return build_chunk(ctx, &gp, &in);
}

static int32_t reserve_compute(struct powerinfer_context * ctx) {
    struct ggml_cgraph * gf = build_reserve_graph(ctx);
    if (!gf || !ggml_gallocr_reserve(ctx->galloc, gf)) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot reserve compute buffers for n_batch=%u, n_ctx=%u",
                       ctx->params.n_batch, ctx->kv.size);
    }
    pi_log(POWERINFER_LOG_INFO, "powerinfer: compute buffer %.1f MiB, KV cache %.1f MiB\n",
           ggml_gallocr_get_buffer_size(ctx->galloc, 0) / 1048576.0, pi_kv_cache_bytes(&ctx->kv) / 1048576.0);
    return POWERINFER_OK;
}

// ---- hybrid placement: the scheduler, the KV cache's home, compute measurement ----------

// A scheduler over [the devices, CPU] (emulated devices are CPU buffers: the CPU's) for
// what the model has placed.
static int32_t make_sched(struct powerinfer_context * ctx) {
    const struct pi_placement * pl = &ctx->model->placement;
    ggml_backend_t backends[PI_MAX_DEVICES + 1];
    int n = 0;
    for (int32_t d = 0; d < pl->n_dev; ++d) {
        if (pl->devs[d].dev.backend) backends[n++] = pl->devs[d].dev.backend;
    }
    backends[n++] = ctx->backend;
    ctx->sched = ggml_backend_sched_new(backends, NULL, n, PI_GRAPH_MAX_NODES, false, true);
    return ctx->sched ? POWERINFER_OK : pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot create the backend scheduler");
}

// Our operators (ggml_custom_4d: the sparse FFN, the active-set index, the histograms) are
// host functions: they run on the CPU. Some backends claim every op (ggml-rpc answers
// supports_op with yes without asking its worker), and the scheduler would send such a node,
// with its function pointer, to a worker that then jumps to an address of our process.
static void pin_custom_ops(struct powerinfer_context * ctx, struct ggml_cgraph * gf) {
    for (int i = 0; i < ggml_graph_n_nodes(gf); ++i) {
        struct ggml_tensor * node = ggml_graph_node(gf, i);
        if (node->op == GGML_OP_CUSTOM || node->op == GGML_OP_MAP_CUSTOM1 || node->op == GGML_OP_MAP_CUSTOM2 ||
            node->op == GGML_OP_MAP_CUSTOM3) {
            ggml_backend_sched_set_tensor_backend(ctx->sched, node, ctx->backend);
        }
    }
}

static void host_drop_scheduler(void * self) {
    struct powerinfer_context * ctx = self;
    if (ctx->sched) {
        ggml_backend_sched_free(ctx->sched);
        ctx->sched = NULL;
        ctx->last.valid = false;  // its graph was allocated by the scheduler
    }
}

static int32_t host_measure_compute(void * self, uint64_t * device_bytes) {
    struct powerinfer_context * ctx = self;
    host_drop_scheduler(ctx);
    int32_t rc = make_sched(ctx);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    struct ggml_cgraph * gf = build_reserve_graph(ctx);
    if (gf) pin_custom_ops(ctx, gf);
    if (!gf) {
        return pi_fail(POWERINFER_ERR_INTERNAL, "cannot build the graph that sizes the compute buffers");
    }
    if (!ggml_backend_sched_reserve(ctx->sched, gf)) {
        // A worker that went away (killed during the model's upload) refuses every buffer:
        // say that, not that the budget was too large.
        const int32_t gone = pi_placement_check(ctx->model);
        if (gone != POWERINFER_OK) {
            return gone;
        }
        // Name the devices and what they report free: the budget was above what one holds.
        char where[512] = "";
        size_t n = 0;
        const struct pi_placement * pl = &ctx->model->placement;
        for (int32_t d = 0; d < pl->n_dev && n < sizeof(where); ++d) {
            uint64_t f = 0, t = 0;
            pi_device_memory(&pl->devs[d].dev, &f, &t);
            n += (size_t) snprintf(where + n, sizeof(where) - n, "%s%s: %.1f of %.1f MiB free", d ? "; " : "",
                                   pl->devs[d].dev.name, f / 1048576.0, t / 1048576.0);
        }
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate the compute buffers on the devices (%s); a smaller "
                       "vram_budget, n_ctx or n_batch leaves them room", where);
    }
    // An emulated device's share is the CPU's whole buffer (it lives in host memory too).
    const struct pi_placement * pl = &ctx->model->placement;
    for (int32_t d = 0; d < pl->n_dev; ++d) {
        ggml_backend_t b = pl->devs[d].dev.backend ? pl->devs[d].dev.backend : ctx->backend;
        device_bytes[d] = ggml_backend_sched_get_buffer_size(ctx->sched, b);
    }
    return POWERINFER_OK;
}

// Re-creates the KV cache with each layer where bufts says (NULL: host memory); contents
// are not kept (placement happens before the first decode). The sizes come from the
// context's parameters, not from the cache: a failed move leaves no cache behind, and the
// move back to host memory that follows must make the context's whole cache again.
static int32_t host_move_kv(void * self, const ggml_backend_buffer_type_t * bufts) {
    struct powerinfer_context * ctx = self;
    const bool v_trans = !ctx->params.flash_attn;
    const uint32_t size = ctx->params.n_ctx;
    const uint32_t n_seq_max = ctx->params.n_seq_max;
    pi_kv_cache_free(&ctx->kv);
    ctx->last.valid = false;
    return pi_kv_cache_init(&ctx->kv, ctx->model, size, n_seq_max, v_trans, bufts);
}

static uint64_t host_kv_layer_bytes(void * self, int32_t il, ggml_backend_buffer_type_t buft) {
    const struct powerinfer_context * ctx = self;
    const uint64_t align = ggml_backend_buft_get_alignment(buft);
    uint64_t n = 0;
    const struct ggml_tensor * t[2] = { ctx->kv.k[il], ctx->kv.v[il] };
    for (int k = 0; k < 2; ++k) {
        n += (ggml_backend_buft_get_alloc_size(buft, (struct ggml_tensor *) t[k]) + align - 1) / align * align;
    }
    return n;
}

// The model's placement, decided by its first context (which hands over its KV cache and
// compute measurement); every context with something placed runs through a scheduler
// and lets its sparse operators skip the neurons on the device.
static int32_t place(struct powerinfer_context * ctx) {
    struct powerinfer_model * model = ctx->model;
    const struct pi_placement_host host = {
        .self             = ctx,
        .compute_estimate = ctx->galloc ? ggml_gallocr_get_buffer_size(ctx->galloc, 0) : 0,
        .move_kv          = host_move_kv,
        .kv_layer_bytes   = host_kv_layer_bytes,
        .measure_compute  = host_measure_compute,
        .drop_scheduler   = host_drop_scheduler,
    };
    if (!model->placement.decided) {
        const int32_t rc = pi_placement_decide(model, &host);
        if (rc != POWERINFER_OK) {
            return rc;
        }
        ctx->placed_first = model->placement.active;
        model->placement.first_alive = model->placement.active;
    } else if (model->placement.active) {
        // A later context: the KV cache stays in host memory; its compute buffers' device
        // share must fit in what the budget leaves.
        const int32_t rc = pi_placement_admit(model, &host, ctx->device_bytes);
        if (rc != POWERINFER_OK) {
            return rc;
        }
    }
    for (int32_t il = 0; model->placement.active && il < model->hp.n_layer; ++il) {
        ctx->sparse[il].skip = model->offload.layers[il].is_hot;
    }
    return POWERINFER_OK;
}

struct powerinfer_context * powerinfer_context_new(struct powerinfer_model * model, struct powerinfer_context_params params) {
    pi_clear_error();
    if (!model) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_context_new: model is NULL");
        return NULL;
    }
    if (model->params.vocab_only) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "the model was loaded with vocab_only; it has no weights to run");
        return NULL;
    }
    if (params.n_ctx == 0) {
        params.n_ctx = (uint32_t) model->hp.n_ctx_train;
    }
    params.n_ctx = GGML_PAD(params.n_ctx, PI_KV_PAD);
    if (params.n_ctx > PI_MAX_N_CTX) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "n_ctx = %u is larger than the supported maximum %u", params.n_ctx, PI_MAX_N_CTX);
        return NULL;
    }
    if (params.n_batch == 0) {
        params.n_batch = PI_DEFAULT_N_BATCH;
    }
    if (params.n_batch > params.n_ctx) {
        params.n_batch = params.n_ctx;
    }
    if (params.n_threads <= 0) {
        params.n_threads = model->params.n_threads > 0 ? model->params.n_threads : default_threads();
    }
    if (params.n_threads_batch <= 0) {
        params.n_threads_batch = params.n_threads;
    }
    if (params.sparse_max_batch < 0) {
        params.sparse_max_batch = PI_SPARSE_MAX_BATCH;
    }
    if (params.sparse_max_batch > PI_SPARSE_MAX_BATCH_LIMIT) {
        // Each token of a sparse batch keeps its own active set in a 32-bit mask.
        params.sparse_max_batch = PI_SPARSE_MAX_BATCH_LIMIT;
    }
    if (params.n_seq_max == 0) {
        params.n_seq_max = 1;
    }
    if (params.n_seq_max > PI_MAX_SEQ) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "n_seq_max = %u is larger than the supported maximum %d", params.n_seq_max,
                PI_MAX_SEQ);
        return NULL;
    }
    if (params.flash_attn < 0) {
        // Flash attention spends far less per decode step on the attention than the plain
        // graph's many small f16 products (measured: 7B-shaped predictor mode 1.65x -> 1.85x
        // llama-cpp-python); dense standard GGUFs keep the plain graph, bit for bit llama.cpp's.
        params.flash_attn = model->is_powerinfer || model->hp.sparse_mode != POWERINFER_SPARSE_DENSE;
    }
    params.flash_attn = params.flash_attn != 0;

    struct powerinfer_context * ctx = calloc(1, sizeof(*ctx));
    if (!ctx) {
        pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
        return NULL;
    }
    atomic_init(&ctx->n_refs, 1);
    ctx->model  = pi_model_retain(model);
    ctx->params = params;
    ctx->graph_buf_size = ggml_tensor_overhead() * PI_GRAPH_MAX_NODES + ggml_graph_overhead_custom(PI_GRAPH_MAX_NODES, false);
    ctx->graph_buf      = malloc(ctx->graph_buf_size);
    ctx->backend        = ggml_backend_cpu_init();
    ctx->galloc         = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
    ctx->sparse         = calloc((size_t) model->hp.n_layer, sizeof(*ctx->sparse));
    ctx->ubatch_buf     = malloc((size_t) 4 * params.n_batch * sizeof(int32_t));
    bool hist_ok = true;
    // POWERINFER_DOWN_PATH=axpy|matmul fixes the dense down path (measurements); unset: by the share.
    const char * down_env = getenv("POWERINFER_DOWN_PATH");
    ctx->down.forced = down_env && strcmp(down_env, "axpy") == 0 ? 1 : down_env && strcmp(down_env, "matmul") == 0 ? 2 : 0;
    for (int32_t il = 0; il < PI_MAX_LAYERS; ++il) {
        ctx->down.share[il] = -1.0f;  // not measured: the AXPY until a step says otherwise
        ctx->down.matmul[il] = ctx->down.forced == 2;
    }
    ctx->inputs = calloc((size_t) pi_n_inputs(model), sizeof(*ctx->inputs));
    ctx->input_ops = calloc((size_t) pi_n_inputs(model), sizeof(*ctx->input_ops));
    for (int32_t il = 0; ctx->sparse && il < model->hp.n_layer; ++il) {
        ctx->sparse[il].threshold = model->layers[il].sparse_tau;
        if (params.collect_activations) {
            ctx->sparse[il].hist = calloc(PI_HIST_BINS, sizeof(uint64_t));
            hist_ok &= ctx->sparse[il].hist != NULL;
        }
    }
    const int32_t n_threads_max = params.n_threads > params.n_threads_batch ? params.n_threads : params.n_threads_batch;
    for (int32_t k = 0; ctx->inputs && ctx->input_ops && k < pi_n_inputs(model); ++k) {
        ctx->inputs[k].threshold = pi_input_tau(model, k);
        ctx->input_ops[k] = (struct pi_input_op) { pi_input_cm(model, k), &ctx->inputs[k], n_threads_max, { 0 } };
        if (params.collect_activations) {  // |x| of every matrix's input (powerinfer sparsify)
            ctx->inputs[k].hist = calloc(PI_HIST_BINS, sizeof(uint64_t));
            hist_ok &= ctx->inputs[k].hist != NULL;
        }
    }
    if (!ctx->graph_buf || !ctx->backend || !ctx->galloc || !ctx->sparse || !ctx->inputs || !ctx->input_ops || !ctx->ubatch_buf ||
        !hist_ok) {
        pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot create the CPU backend");
        powerinfer_context_free(ctx);
        return NULL;
    }
    if (params.batch_invariant) {
        ggml_backend_cpu_set_use_ref(ctx->backend, true);
    }
    if (pi_kv_cache_init(&ctx->kv, model, params.n_ctx, params.n_seq_max, !params.flash_attn, NULL) != POWERINFER_OK ||
        reserve_compute(ctx) != POWERINFER_OK || place(ctx) != POWERINFER_OK) {
        powerinfer_context_free(ctx);
        return NULL;
    }
    if (ctx->sched && ctx->galloc) {
        // The scheduler allocates from here on.
        ggml_gallocr_free(ctx->galloc);
        ctx->galloc = NULL;
    }
    ctx->timings.t_load_ms = model->t_load_ms;
    return ctx;
}

struct powerinfer_context * pi_context_retain(struct powerinfer_context * ctx) {
    atomic_fetch_add(&ctx->n_refs, 1);
    return ctx;
}

void powerinfer_context_free(struct powerinfer_context * ctx) {
    if (!ctx || atomic_fetch_sub(&ctx->n_refs, 1) > 1) {
        return;  // a batcher still computes on it
    }
    if (ctx->model) {
        pi_placement_release(ctx->model, ctx->placed_first, ctx->device_bytes);
    }
    pi_kv_cache_free(&ctx->kv);
    if (ctx->sched)   ggml_backend_sched_free(ctx->sched);
    if (ctx->galloc)  ggml_gallocr_free(ctx->galloc);
    if (ctx->backend) ggml_backend_free(ctx->backend);
    free(ctx->graph_buf);
    free(ctx->ubatch_buf);
    free(ctx->scratch);
    free(ctx->logits);
    free(ctx->embd);
    for (int32_t il = 0; ctx->sparse && il < ctx->model->hp.n_layer; ++il) {
        free(ctx->sparse[il].hist);
    }
    for (int32_t k = 0; ctx->inputs && k < pi_n_inputs(ctx->model); ++k) {
        free(ctx->inputs[k].hist);
    }
    free(ctx->sparse);
    free(ctx->inputs);
    free(ctx->input_ops);
    free(ctx->capture.x);
    free(ctx->capture.act);
    free(ctx->capture.tx);
    free(ctx->capture.tact);
    struct powerinfer_model * model = ctx->model;
    free(ctx);
    powerinfer_model_free(model);
}

int32_t powerinfer_set_ffn_capture(struct powerinfer_context * ctx, bool enable) {
    pi_clear_error();
    if (!ctx) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_set_ffn_capture: context is NULL");
    }
    const struct pi_hparams * hp = &ctx->model->hp;
    if (enable && !ctx->capture.x) {
        const size_t nb = ctx->params.n_batch;
        ctx->capture.x    = malloc((size_t) hp->n_layer * nb * hp->n_embd * sizeof(float));
        ctx->capture.act  = malloc((size_t) hp->n_layer * nb * hp->n_ff * sizeof(float));
        ctx->capture.tx   = calloc((size_t) hp->n_layer, sizeof(struct ggml_tensor *));
        ctx->capture.tact = calloc((size_t) hp->n_layer, sizeof(struct ggml_tensor *));
        if (!ctx->capture.x || !ctx->capture.act || !ctx->capture.tx || !ctx->capture.tact) {
            free(ctx->capture.x);   free(ctx->capture.act);
            free(ctx->capture.tx);  free(ctx->capture.tact);
            memset(&ctx->capture, 0, sizeof(ctx->capture));
            return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate the FFN capture buffers (%d layers x %u tokens)",
                           hp->n_layer, ctx->params.n_batch);
        }
    }
    if (ctx->capture.enabled != enable) {
        ctx->last.valid = false;  // the graph changes
    }
    ctx->capture.enabled  = enable;
    ctx->capture.n_tokens = 0;
    return POWERINFER_OK;
}

int32_t powerinfer_get_ffn_capture(struct powerinfer_context * ctx, int32_t il, const float ** x_res, const float ** act) {
    pi_clear_error();
    if (!ctx || !x_res || !act) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_get_ffn_capture: NULL argument");
    }
    const struct pi_hparams * hp = &ctx->model->hp;
    if (il < 0 || il >= hp->n_layer) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "layer %d is out of range [0, %d)", il, hp->n_layer);
    }
    if (!ctx->capture.enabled || ctx->capture.n_tokens == 0) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "nothing captured: enable powerinfer_set_ffn_capture, then decode");
    }
    const size_t nb = ctx->params.n_batch;
    *x_res = ctx->capture.x + (size_t) il * nb * hp->n_embd;
    *act   = ctx->capture.act + (size_t) il * nb * hp->n_ff;
    return ctx->capture.n_tokens;
}

uint32_t powerinfer_n_ctx(const struct powerinfer_context * ctx)   { return ctx->kv.size; }
uint32_t powerinfer_n_batch(const struct powerinfer_context * ctx) { return ctx->params.n_batch; }

void powerinfer_set_n_threads(struct powerinfer_context * ctx, int32_t n_threads, int32_t n_threads_batch) {
    if (n_threads > 0)       ctx->params.n_threads = n_threads;
    if (n_threads_batch > 0) ctx->params.n_threads_batch = n_threads_batch;
    // input mode's operators size their scratch by the threads (input_sparse.h)
    const int32_t n_max = ctx->params.n_threads > ctx->params.n_threads_batch ? ctx->params.n_threads : ctx->params.n_threads_batch;
    for (int32_t k = 0; k < pi_n_inputs(ctx->model); ++k) {
        if (ctx->input_ops[k].n_threads != n_max) {
            ctx->input_ops[k].n_threads = n_max;
            ctx->last.valid = false;
        }
    }
}

void pi_context_set_abort(struct powerinfer_context * ctx, bool (*fn)(void * data), void * data) {
    ggml_backend_cpu_set_abort_callback(ctx->backend, fn, data);
}

int32_t pi_context_reserve_outputs(struct powerinfer_context * ctx, int32_t rows) {
    if (rows <= ctx->logits_capacity) {
        return POWERINFER_OK;
    }
    float * p = realloc(ctx->logits, (size_t) rows * ctx->model->hp.n_vocab * sizeof(float));
    if (!p) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate logits for %d tokens", rows);
    }
    ctx->logits = p;
    if (ctx->params.embeddings) {
        float * e = realloc(ctx->embd, (size_t) rows * ctx->model->hp.n_embd * sizeof(float));
        if (!e) {
            return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate embeddings for %d tokens", rows);
        }
        ctx->embd = e;
    }
    ctx->logits_capacity = rows;
    return POWERINFER_OK;
}

static int32_t ensure_scratch(struct powerinfer_context * ctx, size_t bytes) {
    if (bytes <= ctx->scratch_size) {
        return POWERINFER_OK;
    }
    float * p = realloc(ctx->scratch, bytes);
    if (!p) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate %zu bytes of scratch", bytes);
    }
    ctx->scratch      = p;
    ctx->scratch_size = bytes;
    return POWERINFER_OK;
}

// One graph's worth of a batch: its tokens, their positions and sequences, the cells
// they go to, and which of them (chunk-local indices, ascending) keep logits.
struct pi_ubatch {
    const powerinfer_token * tokens;
    int32_t                  n_tokens;
    int32_t *                pos;
    int32_t *                seq;
    int32_t *                cells;
    int32_t *                out_idx;
    int32_t                  n_outputs;
};

// Token (sequence bit `bit`, position p) sees cell j when its sequence sees the cell and
// the cell holds a position <= p: causal attention within each sequence, nothing across.
static inline bool cell_visible(const struct pi_kv_cache * kv, int32_t j, uint64_t bit, int32_t p) {
    return (kv->cell_seq[j] & bit) && kv->cell_pos[j] <= p;
}

static int cmp_cell_pos(const void * a, const void * b, void * kv_) {
    const struct pi_kv_cache * kv = kv_;
    const int32_t ca = *(const int32_t *) a, cb = *(const int32_t *) b;
    const int32_t pa = kv->cell_pos[ca], pb = kv->cell_pos[cb];
    return pa != pb ? (pa < pb ? -1 : 1) : (ca > cb) - (ca < cb);
}

// Invariant attention's input: per token, the number of cells it sees, then those cells
// in position order (the order pi_attention sums them in, wherever they sit).
static int32_t set_cells(struct powerinfer_context * ctx, struct ggml_tensor * t, const struct pi_ubatch * ub, int32_t n_kv) {
    const size_t row = (size_t) n_kv + 1;
    int32_t rc = ensure_scratch(ctx, row * ub->n_tokens * sizeof(int32_t));
    if (rc != POWERINFER_OK) {
        return rc;
    }
    const struct pi_kv_cache * kv = &ctx->kv;
    for (int32_t i = 0; i < ub->n_tokens; ++i) {
        int32_t * list = (int32_t *) ctx->scratch + (size_t) i * row;
        const uint64_t bit = 1ull << ub->seq[i];
        const int32_t  p   = ub->pos[i];
        int32_t n = 0;
        bool sorted = true;
        for (int32_t j = 0; j < n_kv; ++j) {
            if (cell_visible(kv, j, bit, p)) {
                sorted &= n == 0 || kv->cell_pos[list[n]] < kv->cell_pos[j];
                list[1 + n++] = j;
            }
        }
        list[0] = n;
        if (!sorted) {
            qsort_r(list + 1, (size_t) n, sizeof(int32_t), cmp_cell_pos, (void *) kv);
        }
    }
    ggml_backend_tensor_set(t, ctx->scratch, 0, ggml_nbytes(t));
    return POWERINFER_OK;
}

// omp_pause_resource_all of the libgomp that ggml-cpu loaded, if any (looked up, not linked:
// a ggml built without OpenMP has none).
typedef int (*pi_omp_pause_fn)(int kind);
static pi_omp_pause_fn g_omp_pause;
static pthread_once_t  g_omp_pause_once = PTHREAD_ONCE_INIT;

// The first loaded object named libgomp* (the system's libgomp.so.1, or a copy a wheel bundles).
static int find_gomp(struct dl_phdr_info * info, size_t size, void * data) {
    (void) size;
    const char * slash = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
    const char * base  = slash ? slash + 1 : info->dlpi_name;
    if (base && strncmp(base, "libgomp", 7) == 0) {
        *(void **) data = dlopen(info->dlpi_name, RTLD_NOW | RTLD_NOLOAD);
        return *(void **) data != NULL;
    }
    return 0;
}

static void find_omp_pause(void) {
    void * h = NULL;
    dl_iterate_phdr(find_gomp, &h);
    if (h) {
        g_omp_pause = (pi_omp_pause_fn) dlsym(h, "omp_pause_resource_all");
    }
}

int32_t powerinfer_release_threads(void) {
    pthread_once(&g_omp_pause_once, find_omp_pause);
    if (!g_omp_pause) {
        return 0;
    }
    g_omp_pause(1);  // omp_pause_soft
    return 1;
}

// The attention mask: 0 where token i sees cell j (cell_visible), -inf elsewhere.
static int32_t set_mask(struct powerinfer_context * ctx, struct ggml_tensor * mask, const struct pi_ubatch * ub, int32_t n_kv) {
    const size_t n = (size_t) n_kv * ub->n_tokens;
    int32_t rc = ensure_scratch(ctx, n * sizeof(float));
    if (rc != POWERINFER_OK) {
        return rc;
    }
    const struct pi_kv_cache * kv = &ctx->kv;
    const bool f16 = mask->type == GGML_TYPE_F16;
    const ggml_fp16_t zero16 = ggml_fp32_to_fp16(0.0f), ninf16 = ggml_fp32_to_fp16(-INFINITY);
    for (int32_t i = 0; i < ub->n_tokens; ++i) {
        const uint64_t bit = 1ull << ub->seq[i];
        const int32_t  p   = ub->pos[i];
        for (int32_t j = 0; j < n_kv; ++j) {
            const bool on = cell_visible(kv, j, bit, p);
            if (f16) ((ggml_fp16_t *) ctx->scratch)[(size_t) i * n_kv + j] = on ? zero16 : ninf16;
            else     ctx->scratch[(size_t) i * n_kv + j] = on ? 0.0f : -INFINITY;
        }
    }
    ggml_backend_tensor_set(mask, ctx->scratch, 0, ggml_nbytes(mask));
    return POWERINFER_OK;
}

// A token's dense down projection (graph.c build_down) through the matmul over the batch
// copy once a layer's nonzero activations reach PI_DOWN_MATMUL_ABOVE of its neurons, back
// to the AXPY below PI_DOWN_AXPY_BELOW (the gap keeps a layer near the crossover from
// rebuilding the graph every step). Measured on a 7B-shaped file whose neurons nearly all
// fire, and why these values: docs/sparse-engine.md.
#define PI_DOWN_MATMUL_ABOVE 0.50f
#define PI_DOWN_AXPY_BELOW   0.40f
#define PI_DOWN_SMOOTHING    0.25f  // weight of the newest step in the moving share

static void choose_down_paths(struct powerinfer_context * ctx) {
    if (ctx->down.forced) {
        return;
    }
    for (int32_t il = 0; il < ctx->model->hp.n_layer; ++il) {
        const struct pi_active_stat * st = &ctx->sparse[il];
        if (st->nz_total < ctx->down.seen_total[il] || st->nz_active < ctx->down.seen_active[il]) {
            ctx->down.seen_total[il] = st->nz_total;  // the counters were reset
            ctx->down.seen_active[il] = st->nz_active;
            continue;
        }
        const int64_t total = st->nz_total - ctx->down.seen_total[il];
        if (total <= 0) {
            continue;  // this step's layer took another path (sparse, hybrid, a matmul file)
        }
        const float step = (float) (st->nz_active - ctx->down.seen_active[il]) / (float) total;
        ctx->down.seen_total[il] = st->nz_total;
        ctx->down.seen_active[il] = st->nz_active;
        float * share = &ctx->down.share[il];
        *share = *share < 0.0f ? step : (1.0f - PI_DOWN_SMOOTHING) * *share + PI_DOWN_SMOOTHING * step;
        if (*share >= PI_DOWN_MATMUL_ABOVE) ctx->down.matmul[il] = 1;
        else if (*share < PI_DOWN_AXPY_BELOW) ctx->down.matmul[il] = 0;
    }
}

// Builds (or reuses) the graph of one chunk whose tokens already hold their cells, sets
// its inputs and computes it; writes ub->n_outputs rows of logits to out (and of hidden
// states to out_embd), when given.
static int32_t compute_chunk(struct powerinfer_context * ctx, const struct pi_ubatch * ub, float * out, float * out_embd) {
    const int32_t n_tokens = ub->n_tokens, n_outputs = ub->n_outputs;
    const uint32_t pad = GGML_PAD(ctx->kv.hi, PI_KV_PAD);
    struct pi_graph_params gp = {
        .n_tokens   = n_tokens,
        .n_kv       = (int32_t) (pad < ctx->kv.size ? pad : ctx->kv.size),
        .n_outputs  = n_outputs,
        .flash_attn = ctx->params.flash_attn,
        .pi_attn = use_pi_attention(ctx),
        .sparse_max_batch = ctx->params.sparse_max_batch,
        .sparse     = ctx->sparse,
        .inputs     = ctx->inputs,
        .input_ops  = ctx->input_ops,
        .capture    = ctx->capture.enabled,
        .down_matmul = ctx->down.matmul,
    };
    const size_t n_layer_bytes = (size_t) ctx->model->hp.n_layer;
    for (int32_t i = 0; i < n_tokens; ++i) {
        gp.first_token |= ub->pos[i] == 0;
    }
    // The graph depends on the shapes only (positions and cache cells are inputs), so
    // the previous one is reused, already allocated, while they stay the same.
    struct pi_graph_inputs in = { .cap_x = ctx->capture.tx, .cap_act = ctx->capture.tact };
    // With the scheduler (placement on devices) reusing the graph also keeps its splits, so an
    // RPC worker is sent "compute the graph again" instead of the whole graph each step.
    struct ggml_cgraph * gf;
    if (ctx->last.valid && ctx->last.n_tokens == n_tokens && ctx->last.n_kv == gp.n_kv && ctx->last.n_outputs == n_outputs &&
        ctx->last.first_token == gp.first_token && memcmp(ctx->last.down_matmul, ctx->down.matmul, n_layer_bytes) == 0) {
        gf = ctx->last.gf;
        in = ctx->last.in;
    } else {
        ctx->last.valid = false;
        if (ctx->sched) {
            ggml_backend_sched_reset(ctx->sched);
        }
        // A new graph is reserved before it is allocated: ggml's allocator decides whether its
        // previous assignment still fits by the node and leaf counts and the nodes alone, and
        // then assigns leaves by their index, so a graph with the same counts whose leaves come
        // in another order (one layer's down projection switching between the AXPY and the
        // matmul) would take other leaves' assignments and leave an input unallocated (a
        // segfault in ggml_gallocr_init_tensor). Graphs are rebuilt only when their shapes
        // change (n_kv moves in steps of PI_KV_PAD), so the extra walk costs nothing measurable.
        if (ctx->sched) {
            // Placement: the scheduler splits the graph between the devices and the CPU. It
            // rewrites a graph's sources to its copies of cross-device inputs when it splits it,
            // so a graph is split once: the reserve gets a build of its own (the graph buffer is
            // reused by the second build).
            struct ggml_cgraph * rg = build_chunk(ctx, &gp, &in);
            if (!rg) {
                return pi_fail(POWERINFER_ERR_INTERNAL, "cannot build the compute graph");
            }
            pin_custom_ops(ctx, rg);
            bool ok = ggml_backend_sched_reserve(ctx->sched, rg);  // ends with a reset of the scheduler
            gf = ok ? build_chunk(ctx, &gp, &in) : NULL;
            if (ok && !gf) {
                return pi_fail(POWERINFER_ERR_INTERNAL, "cannot build the compute graph");
            }
            if (ok) {
                pin_custom_ops(ctx, gf);
                ok = ggml_backend_sched_alloc_graph(ctx->sched, gf);
            }
            if (!ok) {
                return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate the compute graph");
            }
        } else {
            gf = build_chunk(ctx, &gp, &in);
            if (!gf) {
                return pi_fail(POWERINFER_ERR_INTERNAL, "cannot build the compute graph");
            }
            if (!ggml_gallocr_reserve(ctx->galloc, gf) || !ggml_gallocr_alloc_graph(ctx->galloc, gf)) {
                return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate the compute graph");
            }
        }
        ctx->last.valid     = true;
        ctx->last.n_tokens  = n_tokens;
        ctx->last.n_kv      = gp.n_kv;
        ctx->last.n_outputs = n_outputs;
        ctx->last.first_token = gp.first_token;
        memcpy(ctx->last.down_matmul, ctx->down.matmul, n_layer_bytes);
        ctx->last.gf        = gf;
        ctx->last.in        = in;
    }

    ggml_backend_tensor_set(in.tokens, ub->tokens, 0, (size_t) n_tokens * sizeof(int32_t));
    ggml_backend_tensor_set(in.pos, ub->pos, 0, (size_t) n_tokens * sizeof(int32_t));
    const int64_t n_embd_kv = ctx->kv.k[0]->ne[0];
    int32_t rc = ensure_scratch(ctx, (size_t) n_tokens * (in.v_idxs ? n_embd_kv : 1) * sizeof(int64_t));
    if (rc != POWERINFER_OK) {
        return rc;
    }
    // Cache cells: token i goes to cell c_i; a transposed V cache stores channel j of token
    // i at element j * size + c_i.
    int64_t * cells = (int64_t *) ctx->scratch;
    for (int32_t i = 0; i < n_tokens; ++i) {
        cells[i] = ub->cells[i];
    }
    ggml_backend_tensor_set(in.k_idxs, cells, 0, (size_t) n_tokens * sizeof(int64_t));
    if (in.v_idxs) {
        for (int32_t i = 0; i < n_tokens; ++i) {
            for (int64_t j = 0; j < n_embd_kv; ++j) {
                cells[(size_t) i * n_embd_kv + j] = j * (int64_t) ctx->kv.size + ub->cells[i];
            }
        }
        ggml_backend_tensor_set(in.v_idxs, cells, 0, (size_t) n_tokens * n_embd_kv * sizeof(int64_t));
    }
    if (in.out_ids) {
        ggml_backend_tensor_set(in.out_ids, ub->out_idx, 0, (size_t) n_outputs * sizeof(int32_t));
    }
    if (in.first_tok) {
        float * first = (float *) ctx->scratch;  // holds n_tokens int64 at least
        for (int32_t i = 0; i < n_tokens; ++i) {
            first[i] = ub->pos[i] == 0 ? 1.0f : 0.0f;
        }
        ggml_backend_tensor_set(in.first_tok, first, 0, (size_t) n_tokens * sizeof(float));
    }
    if ((rc = in.kv_cells ? set_cells(ctx, in.kv_cells, ub, gp.n_kv) : set_mask(ctx, in.kq_mask, ub, gp.n_kv)) != POWERINFER_OK) {
        return rc;
    }

    ggml_backend_cpu_set_n_threads(ctx->backend, n_tokens > 1 ? ctx->params.n_threads_batch : ctx->params.n_threads);
    if (ctx->model->placement.failed) {
        return pi_placement_check(ctx->model);
    }
    enum ggml_status st = ctx->sched ? ggml_backend_sched_graph_compute(ctx->sched, gf)
                                     : ggml_backend_graph_compute(ctx->backend, gf);

    if (st == GGML_STATUS_ABORTED) {
        return pi_fail(POWERINFER_ERR_ABORTED, "the computation was interrupted by its abort callback");
    }
    if (st != GGML_STATUS_SUCCESS) {
        return pi_fail(POWERINFER_ERR_INTERNAL, "graph computation failed (ggml status %d)", (int) st);
    }
    if (out) {
        ggml_backend_tensor_get(in.logits, out, 0, (size_t) n_outputs * ctx->model->hp.n_vocab * sizeof(float));
    }
    if (out_embd) {
        ggml_backend_tensor_get(in.embd, out_embd, 0, (size_t) n_outputs * ctx->model->hp.n_embd * sizeof(float));
    }
    if (gp.capture) {
        const struct pi_hparams * hp = &ctx->model->hp;
        const size_t nb = ctx->params.n_batch;
        for (int32_t il = 0; il < hp->n_layer; ++il) {
            ggml_backend_tensor_get(in.cap_x[il], ctx->capture.x + (size_t) il * nb * hp->n_embd, 0,
                                    (size_t) n_tokens * hp->n_embd * sizeof(float));
            ggml_backend_tensor_get(in.cap_act[il], ctx->capture.act + (size_t) il * nb * hp->n_ff, 0,
                                    (size_t) n_tokens * hp->n_ff * sizeof(float));
        }
        ctx->capture.n_tokens = n_tokens;
    }
    if (ctx->sched && (rc = pi_placement_check(ctx->model)) != POWERINFER_OK) {
        return rc;  // an RPC worker went away: what came back is zeros
    }
    if (n_tokens == 1) {
        choose_down_paths(ctx);
    }
    return POWERINFER_OK;
}

// Computes one chunk of at most n_batch tokens in cells taken from the cache; on error
// the chunk's cells are free again.
static int32_t decode_chunk(struct powerinfer_context * ctx, struct pi_ubatch * ub, float * out, float * out_embd) {
    struct pi_kv_cache * kv = &ctx->kv;
    int32_t rc = pi_kv_place(kv, ub->n_tokens, ub->seq, ub->pos, ub->cells);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    rc = compute_chunk(ctx, ub, out, out_embd);
    if (rc != POWERINFER_OK) {
        for (int32_t i = 0; i < ub->n_tokens; ++i) {
            pi_kv_cell_free(kv, ub->cells[i]);
        }
    }
    return rc;
}

// The tokens of a batch, already checked, in chunks of n_batch. pos/seq NULL: positions
// pos0, pos0 + 1, ... of sequence 0; flags NULL: logits of every token with logits_all,
// else of the last. first_pos[s]: sequence s's first position in the batch (-1: none),
// where the cache is cut back to on error.
static int32_t decode_tokens(struct powerinfer_context * ctx, const powerinfer_token * tokens, int32_t n_tokens,
                             const int32_t * pos, int32_t pos0, const int32_t * seq, const int8_t * flags, bool logits_all,
                             const int32_t * first_pos, int32_t n_seqs) {
    int32_t n_out = 0;
    for (int32_t i = 0; i < n_tokens; ++i) {
        n_out += flags ? flags[i] != 0 : logits_all || i == n_tokens - 1;
    }
    int32_t rc = pi_context_reserve_outputs(ctx, n_out > 0 ? n_out : 1);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    const double t0 = pi_time_ms();
    ctx->n_outputs = 0;
    const int32_t n_batch = (int32_t) ctx->params.n_batch, n_vocab = ctx->model->hp.n_vocab;
    int32_t * buf = ctx->ubatch_buf;
    struct pi_ubatch ub = { .pos = buf, .seq = buf + n_batch, .cells = buf + 2 * n_batch, .out_idx = buf + 3 * n_batch };
    int32_t row = 0;
    for (int32_t done = 0; done < n_tokens; ) {
        const int32_t n = n_tokens - done < n_batch ? n_tokens - done : n_batch;
        ub.tokens    = tokens + done;
        ub.n_tokens  = n;
        ub.n_outputs = 0;
        for (int32_t i = 0; i < n; ++i) {
            const int32_t k = done + i;
            ub.pos[i] = pos ? pos[k] : pos0 + k;
            ub.seq[i] = seq ? seq[k] : 0;
            if (flags ? flags[k] != 0 : logits_all || k == n_tokens - 1) {
                ub.out_idx[ub.n_outputs++] = i;
            }
        }
        const bool keep = ub.n_outputs > 0;
        if (!keep) {
            // A chunk without outputs still computes one throw-away row: the last.
            ub.out_idx[0] = n - 1;
            ub.n_outputs  = 1;
        }
        float * out  = keep ? ctx->logits + (size_t) row * n_vocab : NULL;
        float * embd = keep && ctx->embd ? ctx->embd + (size_t) row * ctx->model->hp.n_embd : NULL;
        rc = decode_chunk(ctx, &ub, out, embd);
        if (rc != POWERINFER_OK) {
            for (int32_t s = 0; s < n_seqs; ++s) {
                if (first_pos[s] >= 0) {
                    pi_kv_seq_rm(&ctx->kv, s, first_pos[s], -1);
                }
            }
            return rc;
        }
        row  += keep ? ub.n_outputs : 0;
        done += n;
    }
    ctx->n_outputs = n_out;

    const double dt = pi_time_ms() - t0;
    // A step that brings each sequence one token further is generation; anything else a prompt.
    int32_t n_in = 0;
    for (int32_t s = 0; s < n_seqs; ++s) {
        n_in += first_pos[s] >= 0;
    }
    if (n_tokens > n_in) {
        ctx->timings.t_prompt_ms += dt;
        ctx->timings.n_prompt    += n_tokens;
    } else {
        ctx->timings.t_eval_ms += dt;
        ctx->timings.n_eval    += n_tokens;
    }
    return POWERINFER_OK;
}

static int32_t check_tokens(const struct powerinfer_context * ctx, const powerinfer_token * tokens, int32_t n_tokens) {
    const int32_t n_vocab = ctx->model->hp.n_vocab;
    for (int32_t i = 0; i < n_tokens; ++i) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            return pi_fail(POWERINFER_ERR_INVALID_ARG, "token %d at index %d is out of range [0, %d)", tokens[i], i, n_vocab);
        }
    }
    return POWERINFER_OK;
}

int32_t powerinfer_decode(struct powerinfer_context * ctx, const powerinfer_token * tokens,
                          int32_t n_tokens, int32_t pos, bool logits_all) {
    pi_clear_error();
    if (!ctx || !tokens || n_tokens <= 0) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_decode: no tokens given");
    }
    const int32_t n_pos = pi_kv_seq_pos_max(&ctx->kv, 0) + 1;
    if (pos < 0 || pos > n_pos) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_decode: position %d is outside [0, %d] (cached positions)",
                       pos, n_pos);
    }
    if ((int64_t) pos + n_tokens > (int64_t) ctx->kv.size) {
        return pi_fail(POWERINFER_ERR_CONTEXT_FULL,
                       "context window exceeded: %d cached + %d new tokens > n_ctx = %u",
                       pos, n_tokens, ctx->kv.size);
    }
    int32_t rc = check_tokens(ctx, tokens, n_tokens);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    // Cells from pos on are overwritten: sequence 0 forgets them first.
    pi_kv_seq_rm(&ctx->kv, 0, pos, -1);
    const int32_t first_pos[1] = { pos };
    return decode_tokens(ctx, tokens, n_tokens, NULL, pos, NULL, NULL, logits_all, first_pos, 1);
}

int32_t powerinfer_decode_batch(struct powerinfer_context * ctx, struct powerinfer_batch batch) {
    pi_clear_error();
    if (!ctx || !batch.token || batch.n_tokens <= 0) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_decode_batch: no tokens given");
    }
    int32_t rc = check_tokens(ctx, batch.token, batch.n_tokens);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    const int32_t n_seq = (int32_t) ctx->kv.n_seq_max;
    int32_t first_pos[PI_MAX_SEQ], next_pos[PI_MAX_SEQ];
    for (int32_t s = 0; s < n_seq; ++s) {
        first_pos[s] = -1;
        next_pos[s]  = -1;
    }
    // Positions: each sequence's continue its cache, one after another.
    int32_t * pos = batch.pos ? NULL : malloc((size_t) batch.n_tokens * sizeof(int32_t));
    if (!batch.pos && !pos) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    for (int32_t i = 0; i < batch.n_tokens && rc == POWERINFER_OK; ++i) {
        const int32_t s = batch.seq_id ? batch.seq_id[i] : 0;
        if (s < 0 || s >= n_seq) {
            rc = pi_fail(POWERINFER_ERR_INVALID_ARG, "token %d: sequence id %d is outside [0, %d) (n_seq_max)", i, s, n_seq);
            break;
        }
        if (next_pos[s] < 0) {
            next_pos[s] = pi_kv_seq_pos_max(&ctx->kv, s) + 1;
            first_pos[s] = next_pos[s];
        }
        const int32_t p = batch.pos ? batch.pos[i] : next_pos[s];
        if (p != next_pos[s]) {
            rc = pi_fail(POWERINFER_ERR_INVALID_ARG,
                         "token %d of sequence %d has position %d; the sequence continues at position %d "
                         "(remove later positions with powerinfer_kv_seq_rm first)", i, s, p, next_pos[s]);
            break;
        }
        if (pos) pos[i] = p;
        next_pos[s] = p + 1;
    }
    int32_t n_new = batch.n_tokens;
    if (rc == POWERINFER_OK && (uint32_t) n_new > ctx->kv.size - ctx->kv.used) {
        rc = pi_fail(POWERINFER_ERR_CONTEXT_FULL, "KV cache full: %d new tokens, %u of %u cells free", n_new,
                     ctx->kv.size - ctx->kv.used, ctx->kv.size);
    }
    if (rc == POWERINFER_OK) {
        rc = decode_tokens(ctx, batch.token, batch.n_tokens, batch.pos ? batch.pos : pos, 0, batch.seq_id, batch.logits,
                           false, first_pos, n_seq);
    }
    free(pos);
    return rc;
}
int32_t powerinfer_n_outputs(const struct powerinfer_context * ctx) {
    return ctx->n_outputs;
}

float * powerinfer_get_logits_ith(struct powerinfer_context * ctx, int32_t i) {
    if (i < 0) {
        i += ctx->n_outputs;
    }
    if (i < 0 || i >= ctx->n_outputs) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "logits row %d is out of range (%d rows)", i, ctx->n_outputs);
        return NULL;
    }
    return ctx->logits + (size_t) i * ctx->model->hp.n_vocab;
}

float * powerinfer_get_embeddings_ith(struct powerinfer_context * ctx, int32_t i) {
    if (!ctx->embd) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "embeddings were not enabled for this context");
        return NULL;
    }
    return powerinfer_get_logits_ith(ctx, i) ? ctx->embd + (size_t) (i < 0 ? i + ctx->n_outputs : i) * ctx->model->hp.n_embd
                                            : NULL;
}

int32_t powerinfer_kv_pos(const struct powerinfer_context * ctx) {
    return pi_kv_seq_pos_max(&ctx->kv, 0) + 1;
}

int32_t powerinfer_kv_truncate(struct powerinfer_context * ctx, int32_t n_keep) {
    if (n_keep < 0) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_kv_truncate: n_keep = %d is negative", n_keep);
    }
    pi_kv_seq_rm(&ctx->kv, 0, n_keep, -1);
    return POWERINFER_OK;
}

static int32_t check_seq(const struct powerinfer_context * ctx, int32_t seq, const char * what) {
    if (seq < 0 || (uint32_t) seq >= ctx->kv.n_seq_max) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "%s: sequence id %d is outside [0, %u) (n_seq_max)", what, seq,
                       ctx->kv.n_seq_max);
    }
    return POWERINFER_OK;
}

int32_t powerinfer_kv_seq_pos_max(const struct powerinfer_context * ctx, int32_t seq) {
    return seq >= 0 && (uint32_t) seq < ctx->kv.n_seq_max ? pi_kv_seq_pos_max(&ctx->kv, seq) : -1;
}

int32_t powerinfer_kv_seq_rm(struct powerinfer_context * ctx, int32_t seq, int32_t p0, int32_t p1) {
    pi_clear_error();
    if (seq != -1 && check_seq(ctx, seq, "powerinfer_kv_seq_rm") != POWERINFER_OK) {
        return POWERINFER_ERR_INVALID_ARG;
    }
    pi_kv_seq_rm(&ctx->kv, seq, p0 < 0 ? 0 : p0, p1);
    return POWERINFER_OK;
}

int32_t powerinfer_kv_seq_cp(struct powerinfer_context * ctx, int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    pi_clear_error();
    if (check_seq(ctx, src, "powerinfer_kv_seq_cp") != POWERINFER_OK ||
        check_seq(ctx, dst, "powerinfer_kv_seq_cp") != POWERINFER_OK) {
        return POWERINFER_ERR_INVALID_ARG;
    }
    if (src != dst) {
        pi_kv_seq_cp(&ctx->kv, src, dst, p0 < 0 ? 0 : p0, p1);
    }
    return POWERINFER_OK;
}

int32_t powerinfer_kv_seq_keep(struct powerinfer_context * ctx, int32_t seq) {
    pi_clear_error();
    if (check_seq(ctx, seq, "powerinfer_kv_seq_keep") != POWERINFER_OK) {
        return POWERINFER_ERR_INVALID_ARG;
    }
    pi_kv_seq_keep(&ctx->kv, seq);
    return POWERINFER_OK;
}

int32_t powerinfer_kv_used_cells(const struct powerinfer_context * ctx) {
    return (int32_t) ctx->kv.used;
}

int32_t powerinfer_sparse_max_batch(const struct powerinfer_context * ctx) {
    return ctx->params.sparse_max_batch;
}

struct powerinfer_timings powerinfer_get_timings(const struct powerinfer_context * ctx) {
    return ctx->timings;
}

void powerinfer_reset_timings(struct powerinfer_context * ctx) {
    double t_load = ctx->timings.t_load_ms;
    memset(&ctx->timings, 0, sizeof(ctx->timings));
    ctx->timings.t_load_ms = t_load;
    for (int32_t il = 0; il < ctx->model->hp.n_layer; ++il) {
        ctx->sparse[il].n_active = ctx->sparse[il].n_total = 0;
    }
    for (int32_t k = 0; k < pi_n_inputs(ctx->model); ++k) {
        ctx->inputs[k].n_active = ctx->inputs[k].n_total = 0;
    }
}

int32_t powerinfer_input_stats(const struct powerinfer_context * ctx, int32_t il, int32_t input, int64_t * n_kept,
                               int64_t * n_total) {
    const int32_t k = pi_input_index(ctx->model, il, input);
    if (k < 0) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "layer %d, input %d is out of range", il, input);
    }
    const struct pi_active_stat * st = &ctx->inputs[k];
    *n_kept  = st->n_active;
    *n_total = st->n_total;
    return POWERINFER_OK;
}

int32_t powerinfer_set_input_threshold(struct powerinfer_context * ctx, int32_t il, int32_t input, float tau) {
    const int32_t k = pi_input_index(ctx->model, il, input);
    if (k < 0) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "layer %d, input %d is out of range", il, input);
    }
    if (!(tau >= 0.0f) || isinf(tau)) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "an input threshold must be finite and >= 0, got %g", tau);
    }
    if (ctx->model->hp.sparse_mode != POWERINFER_SPARSE_INPUT || ctx->input_ops[k].cm->n_segs == 0) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "layer %d, input %d has no column copy (not input mode, or dense in the file)",
                       il, input);
    }
    ctx->inputs[k].threshold = tau;
    return POWERINFER_OK;
}

int32_t powerinfer_input_histogram(const struct powerinfer_context * ctx, int32_t il, int32_t input, uint64_t * counts,
                                   int32_t n_bins, float * log10_min, float * log10_max) {
    const int32_t k = pi_input_index(ctx->model, il, input);
    if (k < 0 || !ctx->inputs[k].hist) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "no input histogram for layer %d, input %d (collect_activations off?)", il, input);
    }
    if (n_bins != PI_HIST_BINS) {
        return PI_HIST_BINS;
    }
    memcpy(counts, ctx->inputs[k].hist, sizeof(uint64_t) * PI_HIST_BINS);
    *log10_min = PI_HIST_LOG10_MIN;
    *log10_max = PI_HIST_LOG10_MAX;
    return PI_HIST_BINS;
}

int32_t powerinfer_activation_histogram(const struct powerinfer_context * ctx, int32_t il, uint64_t * counts,
                                        int32_t n_bins, float * log10_min, float * log10_max) {
    if (il < 0 || il >= ctx->model->hp.n_layer || !ctx->sparse[il].hist) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "no activation histogram for layer %d (collect_activations off?)", il);
    }
    if (n_bins != PI_HIST_BINS) {
        return PI_HIST_BINS;
    }
    memcpy(counts, ctx->sparse[il].hist, sizeof(uint64_t) * PI_HIST_BINS);
    *log10_min = PI_HIST_LOG10_MIN;
    *log10_max = PI_HIST_LOG10_MAX;
    return PI_HIST_BINS;
}

int32_t powerinfer_down_path(const struct powerinfer_context * ctx, int32_t il, float * share) {
    if (il < 0 || il >= ctx->model->hp.n_layer) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "layer %d is out of range", il);
    }
    if (share) *share = ctx->down.share[il];
    return ctx->down.matmul[il];
}

int32_t powerinfer_sparse_stats(const struct powerinfer_context * ctx, int32_t il, int64_t * n_active, int64_t * n_total) {
    if (il < 0 || il >= ctx->model->hp.n_layer) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "layer %d is out of range", il);
    }
    if (ctx->model->hp.sparse_mode == POWERINFER_SPARSE_INPUT) {  // kept entries of the layer's inputs
        *n_active = *n_total = 0;
        for (int i = 0; i < POWERINFER_INPUT_COUNT; ++i) {
            *n_active += ctx->inputs[il * POWERINFER_INPUT_COUNT + i].n_active;
            *n_total  += ctx->inputs[il * POWERINFER_INPUT_COUNT + i].n_total;
        }
        return POWERINFER_OK;
    }
    *n_active = ctx->sparse[il].n_active;
    *n_total  = ctx->sparse[il].n_total;
    return POWERINFER_OK;
}
