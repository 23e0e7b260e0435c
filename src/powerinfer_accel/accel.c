// accel.c - the sparse operators inside libllama: a ggml backend of type ACCEL (ggml's
// extension point for CPU-side accelerators, as llama.cpp's BLAS backend) whose buffers hold
// the CPU-resident weights of a sparsified GGUF, so every architecture libllama runs (gemma3,
// qwen3, MoE, ...) gets input sparsity without a graph of ours (docs/accel.md).
//
// How it fits in libllama (llama-cpp-python 0.3.36's ggml):
// - llama_model_load puts a CPU weight in the first buffer type of its list whose device
//   accepts the op that uses the weight; ACCEL devices come first. This device accepts the
//   weights the armed rules name (powerinfer_accel_arm: a threshold per weight tensor read from
//   the file), the small weights beside them (norms, biases: fewer scheduler splits), and no
//   weight the CPU backend would repack (CPU_REPACK keeps its speed).
// - llama's context gives the scheduler a backend of this device before the CPU one. Its
//   graph_compute turns each MUL_MAT / MUL_MAT_ID of a sparse weight whose batch fits
//   (<= the max batch, PI_COLMAT_MAX_TOKENS) into a custom op that runs the input-sparse product
//   (src/powerinfer_kernels/input_sparse.c) on a column copy of the weight kept after its data, then
//   hands the whole split to a CPU backend it holds (one dispatch per split), and restores the
//   nodes. Larger batches run ggml's own MUL_MAT on the weight's data, which stays in ggml's
//   layout: the buffers are host memory and the CPU backend reads them as its own.
// - The column copy is written at a weight's first sparse use, by the threads of that step.
#include "accel.h"

#include "ggml-backend-impl.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "gguf.h"
#include "input_sparse.h"
#include "kernel_levels.h"
#include "powerinfer-impl.h"
#include "sparse_ops.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define ACCEL_ALIGN 64
#define ACCEL_NAME  "PowerInfer"

static size_t align_up(size_t n) { return (n + ACCEL_ALIGN - 1) / ACCEL_ALIGN * ACCEL_ALIGN; }

// ---------------------------------------------------------------- the armed rules

struct accel_rule {
    char    name[GGML_MAX_NAME];
    float   threshold;
    int32_t group, member;  // the group of matrices sharing its input it belongs to (-1: none)
};

// Matrices of one layer that read the same input with the same threshold (q/k/v; gate/up) share
// one column copy, as the core's: a column holds the input entry's weights in every matrix, so
// one product reads them together (one pass over the kept columns, one quantization of the
// input, one operator). The copy sits after the first member's data; the planned layout comes
// from the file's tensor shapes, read when armed.
struct accel_group_def {
    int32_t          n;                           // members, in segment order
    int32_t          rule[PI_COLMAT_MAX_SEGS];
    size_t           bytes;                       // the joint copy
    struct pi_colmat plan;
};

static pthread_mutex_t     g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct accel_rule * g_rules;    // of the next model to load (powerinfer_accel_arm)
static int32_t             g_n_rules;
static int32_t             g_mode;     // POWERINFER_ACCEL_*
static int32_t             g_tag;      // of the armed model; weights placed while armed carry it
static int32_t             g_tags;     // tags handed out
static int32_t             g_max_batch = PI_COLMAT_MAX_TOKENS;
static int32_t             g_ops_all = 1;  // claim every op the CPU runs next to ours (fewer splits)
static int32_t             g_groups_on = 1;  // POWERINFER_ACCEL_GROUPS=0: every matrix its own copy
static struct accel_group_def * g_group_defs;  // of the armed file
static int32_t             g_n_group_defs;
static struct accel_group ** g_group_objs;     // [g_n_group_defs]: the armed load's groups, as placed

static const struct accel_rule * rule_of(const char * name) {
    for (int32_t i = 0; i < g_n_rules; ++i) {
        if (strcmp(g_rules[i].name, name) == 0) return &g_rules[i];
    }
    return NULL;
}

static int add_rule(struct accel_rule ** rules, int32_t * n, int32_t * cap, const char * name, float threshold) {
    if (strlen(name) >= GGML_MAX_NAME) return 0;  // no tensor of ggml has such a name
    for (int32_t i = 0; i < *n; ++i) {
        if (strcmp((*rules)[i].name, name) == 0) {
            (*rules)[i].threshold = threshold;
            return 0;
        }
    }
    if (*n == *cap) {
        const int32_t c = *cap ? 2 * *cap : 64;
        struct accel_rule * r = realloc(*rules, (size_t) c * sizeof(*r));
        if (!r) return -1;
        *rules = r;
        *cap   = c;
    }
    snprintf((*rules)[*n].name, GGML_MAX_NAME, "%s", name);
    (*rules)[*n].group = (*rules)[*n].member = -1;
    (*rules)[(*n)++].threshold = threshold;
    return 0;
}

// The per-layer table of llama/qwen2 files: four inputs per layer, each read by these matrices.
static const char * const k_input_tensors[4][4] = {
    { "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_qkv.weight" },
    { "attn_output.weight", NULL, NULL, NULL },
    { "ffn_gate.weight", "ffn_up.weight", NULL, NULL },
    { "ffn_down.weight", NULL, NULL, NULL },
};

static int read_rules(const char * path, struct accel_rule ** out, int32_t * n_out) {
    struct gguf_init_params gp = { .no_alloc = true, .ctx = NULL };
    struct gguf_context * g = gguf_init_from_file(path, gp);
    if (!g) return pi_fail(POWERINFER_ERR_FORMAT, "%s: not a readable GGUF file", path);
    struct accel_rule * rules = NULL;
    int32_t n = 0, cap = 0;
    int status = POWERINFER_OK;
    char name[GGML_MAX_NAME + 32];
    const int64_t kin = gguf_find_key(g, PI_KEY_INPUT_THRESHOLDS);
    if (kin >= 0) {
        if (gguf_get_kv_type(g, kin) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, kin) != GGUF_TYPE_FLOAT32 ||
            gguf_get_arr_n(g, kin) % 4 != 0) {
            status = pi_fail(POWERINFER_ERR_FORMAT, "%s: %s is not an f32 array of four per layer", path, PI_KEY_INPUT_THRESHOLDS);
            goto done;
        }
        const float * v = gguf_get_arr_data(g, kin);
        const size_t n_layer = gguf_get_arr_n(g, kin) / 4;
        for (size_t il = 0; il < n_layer; ++il) {
            for (int k = 0; k < 4; ++k) {
                if (!(v[il * 4 + k] >= 0.0f) || !isfinite(v[il * 4 + k])) continue;  // < 0 or nan: dense
                for (int m = 0; m < 4 && k_input_tensors[k][m]; ++m) {
                    snprintf(name, sizeof(name), "blk.%zu.%s", il, k_input_tensors[k][m]);
                    if (add_rule(&rules, &n, &cap, name, v[il * 4 + k])) goto nomem;
                }
            }
        }
    }
    const int64_t kout = gguf_find_key(g, PI_KEY_OUTPUT_THRESHOLD);
    if (kout >= 0 && gguf_get_kv_type(g, kout) == GGUF_TYPE_FLOAT32) {
        const float t = gguf_get_val_f32(g, kout);
        if (t >= 0.0f && isfinite(t)) {
            // the output matrix; the token embeddings' copy that serves as the output when tied
            if (add_rule(&rules, &n, &cap, "output.weight", t) || add_rule(&rules, &n, &cap, "token_embd.weight", t)) goto nomem;
        }
    }
    const int64_t kn = gguf_find_key(g, PI_KEY_TENSOR_THRESHOLD_NAMES), kv = gguf_find_key(g, PI_KEY_TENSOR_THRESHOLD_VALUES);
    if (kn >= 0 || kv >= 0) {
        if (kn < 0 || kv < 0 || gguf_get_kv_type(g, kn) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, kn) != GGUF_TYPE_STRING ||
            gguf_get_kv_type(g, kv) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, kv) != GGUF_TYPE_FLOAT32 ||
            gguf_get_arr_n(g, kn) != gguf_get_arr_n(g, kv)) {
            status = pi_fail(POWERINFER_ERR_FORMAT, "%s: %s and %s must be a string and an f32 array of one length", path,
                             PI_KEY_TENSOR_THRESHOLD_NAMES, PI_KEY_TENSOR_THRESHOLD_VALUES);
            goto done;
        }
        const float * v = gguf_get_arr_data(g, kv);
        for (size_t i = 0; i < gguf_get_arr_n(g, kn); ++i) {
            const float t = v[i];
            if (!(t >= 0.0f) || !isfinite(t)) continue;
            if (add_rule(&rules, &n, &cap, gguf_get_arr_str(g, kn, i), t)) goto nomem;
        }
    }
    *out   = rules;
    *n_out = n;
    rules  = NULL;
    goto done;
nomem:
    status = pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory reading %s", path);
done:
    free(rules);
    gguf_free(g);
    return status;
}

static int32_t rule_index(const struct accel_rule * rules, int32_t n, const char * name) {
    for (int32_t i = 0; i < n; ++i) {
        if (strcmp(rules[i].name, name) == 0) return i;
    }
    return -1;
}

// The groups of the rules: per layer, q/k/v and gate/up whose thresholds are equal and whose
// shapes and types have one column form (the file's tensor headers).
static int find_groups(const char * path, struct accel_rule * rules, int32_t n, struct accel_group_def ** out, int32_t * n_out) {
    static const char * const k_groups[2][PI_COLMAT_MAX_SEGS] = {
        { "attn_q.weight", "attn_k.weight", "attn_v.weight" },
        { "ffn_gate.weight", "ffn_up.weight", NULL },
    };
    *out   = NULL;
    *n_out = 0;
    struct ggml_context * meta = NULL;
    struct gguf_init_params gp = { .no_alloc = true, .ctx = &meta };
    struct gguf_context * g = gguf_init_from_file(path, gp);
    if (!g || !meta) {
        if (g) gguf_free(g);
        return POWERINFER_OK;  // read_rules read it: no groups, then
    }
    struct accel_group_def * defs = NULL;
    int32_t nd = 0, cap = 0;
    char name[GGML_MAX_NAME + 32];
    for (int32_t i = 0; i < n; ++i) {
        int il = -1, k = -1;
        for (int kk = 0; kk < 2 && k < 0; ++kk) {
            int used = 0;
            snprintf(name, sizeof(name), "blk.%%d.%s%%n", k_groups[kk][0]);
            if (sscanf(rules[i].name, name, &il, &used) == 1 && rules[i].name[used] == '\0') k = kk;
        }
        if (k < 0) continue;
        struct accel_group_def d = { 0 };
        struct ggml_tensor * w[PI_COLMAT_MAX_SEGS];
        bool ok = true;
        for (int m = 0; m < PI_COLMAT_MAX_SEGS && k_groups[k][m] && ok; ++m) {
            snprintf(name, sizeof(name), "blk.%d.%s", il, k_groups[k][m]);
            const int32_t r = rule_index(rules, n, name);
            w[m] = ggml_get_tensor(meta, name);
            ok = r >= 0 && w[m] && rules[r].threshold == rules[i].threshold && rules[r].group < 0;
            d.rule[d.n++] = r;
        }
        if (!ok || d.n < 2 || (d.bytes = pi_colmat_plan(&d.plan, w, d.n)) == 0) continue;
        if (nd == cap) {
            const int32_t c = cap ? 2 * cap : 64;
            struct accel_group_def * nd_ = realloc(defs, (size_t) c * sizeof(*defs));
            if (!nd_) {
                free(defs);
                gguf_free(g);
                ggml_free(meta);
                return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory reading %s", path);
            }
            defs = nd_;
            cap  = c;
        }
        for (int m = 0; m < d.n; ++m) {
            rules[d.rule[m]].group  = nd;
            rules[d.rule[m]].member = m;
        }
        defs[nd++] = d;
    }
    gguf_free(g);
    ggml_free(meta);
    *out   = defs;
    *n_out = nd;
    return POWERINFER_OK;
}

int32_t powerinfer_accel_arm(const char * path, int32_t mode) {
    if (mode < POWERINFER_ACCEL_SPARSE || mode > POWERINFER_ACCEL_CALIBRATE) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_accel_arm: mode %d is not sparse (1), passthrough (2) or calibrate (3)", mode);
    }
    struct accel_rule * rules = NULL;
    struct accel_group_def * defs = NULL;
    int32_t n = 0, n_defs = 0;
    if (mode != POWERINFER_ACCEL_CALIBRATE) {
        if (!path) return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_accel_arm: no file");
        int st = read_rules(path, &rules, &n);
        if (st == POWERINFER_OK && mode == POWERINFER_ACCEL_SPARSE && g_groups_on) st = find_groups(path, rules, n, &defs, &n_defs);
        if (st != POWERINFER_OK) {
            free(rules);
            return st;
        }
    }
    pthread_mutex_lock(&g_lock);
    free(g_rules);
    free(g_group_defs);
    g_rules   = rules;
    g_n_rules = n;
    free(g_group_objs);
    g_group_defs   = defs;
    g_n_group_defs = n_defs;
    g_group_objs   = n_defs > 0 ? calloc((size_t) n_defs, sizeof(*g_group_objs)) : NULL;
    if (n_defs > 0 && !g_group_objs) g_n_group_defs = 0;
    g_mode    = mode;
    g_tag     = ++g_tags;
    const int32_t tag = g_tag;
    pthread_mutex_unlock(&g_lock);
    return tag;
}

void powerinfer_accel_disarm(void) {
    pthread_mutex_lock(&g_lock);
    free(g_rules);
    free(g_group_defs);
    g_rules   = NULL;
    g_n_rules = 0;
    free(g_group_objs);
    g_group_defs   = NULL;
    g_group_objs   = NULL;
    g_n_group_defs = 0;
    g_mode    = POWERINFER_ACCEL_OFF;
    g_tag     = 0;
    pthread_mutex_unlock(&g_lock);
}

int32_t powerinfer_accel_rule_count(void) {
    pthread_mutex_lock(&g_lock);
    const int32_t n = g_n_rules;
    pthread_mutex_unlock(&g_lock);
    return n;
}

int32_t powerinfer_accel_set_max_batch(int32_t n) {
    if (n < 0 || n > PI_COLMAT_MAX_TOKENS) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "the sparse max batch must be in [0, %d], not %d", PI_COLMAT_MAX_TOKENS, n);
    }
    __atomic_store_n(&g_max_batch, n, __ATOMIC_RELAXED);
    return POWERINFER_OK;
}

// ---------------------------------------------------------------- the weights

// A weight in one of our buffers (weight_of). Sparse weights carry their column copies: one
// per matrix (an expert stack has one per expert), after the weight's data and its header.
struct accel_weight {
    char                  name[GGML_MAX_NAME];
    int32_t               tag, id;
    int32_t               mode;        // the armed mode it was placed under
    bool                  sparse;      // has column copies and a threshold
    int32_t               n_mats;      // matrices: 1, or the experts of a MUL_MAT_ID stack
    struct pi_colmat *    cm;          // [n_mats]
    struct pi_active_stat stat;        // threshold; kept and considered entries
    uint64_t *            hist;        // calibration: PI_HIST_BINS counts of |x| (every token)
    int32_t               filled;      // the column copies are written
    int32_t               sync[2];     // the fill's barrier
    struct ggml_tensor *  tensor;
    struct accel_group *  grp;         // a member of a group sharing one copy (cm NULL), or NULL
    int32_t               member;
    struct accel_weight * next;        // g_weights
};

// A group's shared state: its members as placed (NULL until then), the joint copy after member
// 0's data, one threshold and one pair of counters. Freed with its last member.
struct accel_group {
    int32_t               n, refs, id;  // id: member 0's record id (the operator's slot)
    struct accel_weight * member[PI_COLMAT_MAX_SEGS];
    struct pi_colmat      cm;
    bool                  bound;        // member 0 is placed and cm points after its data
    struct pi_active_stat stat;
    int32_t               filled, sync[2];
};

static struct accel_weight * g_weights;  // every live weight record (g_lock)
static int32_t               g_ids;

struct accel_buffer {
    void *                 data;
    size_t                 size;
    struct accel_weight ** records;  // this buffer's, to free with it
    int32_t                n_records, cap_records;
};

static ggml_backend_buffer_type_t accel_buft(void);
static ggml_backend_dev_t         accel_device(void);

static bool in_our_buffer(const struct ggml_tensor * t) {
    const struct ggml_tensor * base = t->view_src ? t->view_src : t;
    return base->buffer && base->buffer->buft == accel_buft();
}

// A weight's record sits in a header after its data, not in tensor->extra: ggml's CPU matmul
// takes a weight with an extra for a repacked one and skips its tiled kernels (ggml-cpu's
// tiled.cpp), which run prompts here 2x faster than the row dot products. The header is
// ACCEL_HDR bytes at data + align_up(nbytes), then come the column copies.
#define ACCEL_HDR   ACCEL_ALIGN
#define ACCEL_MAGIC 0x31574950u  // "PIW1"

struct accel_header {
    uint32_t              magic;
    struct accel_weight * w;
};

static struct accel_header * header_of(const struct ggml_tensor * t) {
    return (struct accel_header *) ((char *) t->data + align_up(ggml_nbytes(t)));
}

// The record of a weight in our buffers (a tensor of no op, in a buffer that is not a compute
// buffer: the ones init_tensor gave a header), else NULL.
static struct accel_weight * weight_of(const struct ggml_tensor * t) {
    if (!in_our_buffer(t) || t->view_src || t->op != GGML_OP_NONE || !t->data ||
        t->buffer->usage == GGML_BACKEND_BUFFER_USAGE_COMPUTE) {
        return NULL;
    }
    const struct accel_header * h = header_of(t);
    return h->magic == ACCEL_MAGIC ? h->w : NULL;
}

// Where a weight's column copies start.
static char * copies_of(const struct ggml_tensor * t) {
    return (char *) t->data + align_up(ggml_nbytes(t)) + ACCEL_HDR;
}

// The 2-D matrix e of w (a whole 2-D weight, or expert e of a stack), as a tensor header.
static struct ggml_tensor matrix_of(const struct ggml_tensor * w, int64_t e) {
    struct ggml_tensor m = *w;
    m.ne[2] = m.ne[3] = 1;
    m.nb[3] = m.nb[2] = m.nb[1] * m.ne[1];
    m.data = w->data ? (char *) w->data + e * w->nb[2] : NULL;
    m.view_src = NULL;
    m.extra = NULL;
    return m;
}

// Bytes of one matrix's column copy (0: it has none), with its plan in *cm.
static size_t colmat_bytes(const struct ggml_tensor * w, struct pi_colmat * cm) {
    if (!pi_colmat_type_ok(w->type) || w->ne[3] != 1) return 0;
    struct ggml_tensor m = matrix_of(w, 0);
    struct ggml_tensor * mp = &m;
    return pi_colmat_plan(cm, &mp, 1);
}

// Whether a weight placed now gets column copies, and its threshold.
static bool wants_sparse(const struct ggml_tensor * w, float * threshold) {
    // (passthrough places the same weights and computes them with ggml: to measure the module's cost)
    if (g_mode == POWERINFER_ACCEL_CALIBRATE) {
        *threshold = 0.0f;
        return true;
    }
    const struct accel_rule * r = rule_of(w->name);
    if (!r) return false;
    *threshold = r->threshold;
    return true;
}

// A tensor's bytes; for a tensor of no op (a weight) its header after them, and for a sparse
// weight its column copies after that. Any other tensor (the compute buffers' nodes: a
// [1, n_tokens] f32 node of MoE routing is 4 bytes) asks for exactly ggml_nbytes: ggml
// asserts that only quantized or empty-op tensors ask for more.
static size_t weight_alloc_size(const struct ggml_tensor * t) {
    const size_t n = ggml_nbytes(t);
    size_t copies = 0;
    pthread_mutex_lock(&g_lock);
    float thr;
    struct pi_colmat cm;
    const struct accel_rule * r = g_mode == POWERINFER_ACCEL_SPARSE ? rule_of(t->name) : NULL;
    if (r && r->group >= 0 && r->group < g_n_group_defs) {
        if (r->member == 0) copies = align_up(g_group_defs[r->group].bytes);  // the group's copy
    } else if (g_mode == POWERINFER_ACCEL_SPARSE && wants_sparse(t, &thr)) {
        const size_t b = colmat_bytes(t, &cm);
        if (b) copies = align_up(b) * (size_t) t->ne[2];
    }
    pthread_mutex_unlock(&g_lock);
    return t->op == GGML_OP_NONE ? align_up(n) + ACCEL_HDR + copies : n;
}

static enum ggml_status accel_buffer_init_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * t) {
    // A record per weight. The compute buffers' nodes are initialised again at every graph
    // allocation (each new batch shape; every step with LLAMA_GRAPH_REUSE_DISABLE=1): records
    // of theirs would pile up until the context ends, and their ids grow the backends' tables.
    if (t->view_src != NULL || buffer->usage == GGML_BACKEND_BUFFER_USAGE_COMPUTE) return GGML_STATUS_SUCCESS;
    struct accel_buffer * ab = buffer->context;
    pthread_mutex_lock(&g_lock);
    float thr = 0.0f;
    struct pi_colmat cm0;
    const bool sparse = g_mode == POWERINFER_ACCEL_SPARSE && wants_sparse(t, &thr) && colmat_bytes(t, &cm0) > 0;
    const bool calibrated = g_mode == POWERINFER_ACCEL_CALIBRATE && colmat_bytes(t, &cm0) > 0;
    struct accel_weight * w = calloc(1, sizeof(*w));
    if (!w) {
        pthread_mutex_unlock(&g_lock);
        return GGML_STATUS_ALLOC_FAILED;
    }
    snprintf(w->name, sizeof(w->name), "%s", t->name);
    w->tag    = g_tag;
    w->id     = g_ids++;
    w->mode   = g_mode;
    w->tensor = t;
    w->stat.threshold = thr;
    w->n_mats = (int32_t) t->ne[2];
    if (calibrated && !(w->hist = calloc(PI_HIST_BINS, sizeof(uint64_t)))) {
        free(w);
        pthread_mutex_unlock(&g_lock);
        return GGML_STATUS_ALLOC_FAILED;
    }
    const struct accel_rule * gr = sparse ? rule_of(t->name) : NULL;
    if (gr && (gr->group < 0 || gr->group >= g_n_group_defs || !g_group_objs)) gr = NULL;
    if (gr) {  // a member of a group: the group's copy, after member 0's data
        const struct accel_group_def * d = &g_group_defs[gr->group];
        struct accel_group * grp = g_group_objs[gr->group];
        if (!grp && (grp = g_group_objs[gr->group] = calloc(1, sizeof(*grp)))) {
            grp->n              = d->n;
            grp->stat.threshold = thr;
        }
        if (!grp) {
            free(w->hist);
            free(w);
            pthread_mutex_unlock(&g_lock);
            return GGML_STATUS_ALLOC_FAILED;
        }
        grp->member[gr->member] = w;
        grp->refs++;
        if (gr->member == 0) {
            grp->cm = d->plan;
            pi_colmat_bind(&grp->cm, copies_of(t));
            grp->bound = true;
            grp->id    = w->id;
        }
        w->grp    = grp;
        w->member = gr->member;
        w->sparse = true;
    } else if (sparse) {
        w->cm = calloc((size_t) w->n_mats, sizeof(*w->cm));
        if (!w->cm) {
            free(w->cm);
            free(w->hist);
            free(w);
            pthread_mutex_unlock(&g_lock);
            return GGML_STATUS_ALLOC_FAILED;
        }
        const size_t per = align_up(colmat_bytes(t, &cm0));
        char * mem = copies_of(t);
        for (int32_t e = 0; e < w->n_mats; ++e) {
            w->cm[e] = cm0;
            pi_colmat_bind(&w->cm[e], mem + (size_t) e * per);
        }
        w->sparse = true;
    }
    if (ab->n_records == ab->cap_records) {
        const int32_t c = ab->cap_records ? 2 * ab->cap_records : 256;
        struct accel_weight ** r = realloc(ab->records, (size_t) c * sizeof(*r));
        if (!r) {
            free(w->cm);
            free(w->hist);
            free(w);
            pthread_mutex_unlock(&g_lock);
            return GGML_STATUS_ALLOC_FAILED;
        }
        ab->records     = r;
        ab->cap_records = c;
    }
    ab->records[ab->n_records++] = w;
    w->next   = g_weights;
    g_weights = w;
    pthread_mutex_unlock(&g_lock);
    *header_of(t) = (struct accel_header) { ACCEL_MAGIC, w };
    return GGML_STATUS_SUCCESS;
}

static void accel_buffer_free(ggml_backend_buffer_t buffer) {
    struct accel_buffer * ab = buffer->context;
    pthread_mutex_lock(&g_lock);
    for (int32_t i = 0; i < ab->n_records; ++i) {
        struct accel_weight * w = ab->records[i];
        for (struct accel_weight ** p = &g_weights; *p; p = &(*p)->next) {
            if (*p == w) {
                *p = w->next;
                break;
            }
        }
        if (w->grp) {
            w->grp->member[w->member] = NULL;
            if (w->member == 0) w->grp->bound = false;
            if (--w->grp->refs == 0) {
                for (int32_t g = 0; g < g_n_group_defs && g_group_objs; ++g) {
                    if (g_group_objs[g] == w->grp) g_group_objs[g] = NULL;
                }
                free(w->grp);
            }
        }
        free(w->cm);
        free(w->hist);
        free(w);
    }
    pthread_mutex_unlock(&g_lock);
    free(ab->records);
    if (ab->data) munmap(ab->data, ab->size);
    free(ab);
}

static void * accel_buffer_get_base(ggml_backend_buffer_t buffer) {
    struct accel_buffer * ab = buffer->context;
    return ab->data;
}

static void mark_unfilled(struct ggml_tensor * t) {
    struct accel_weight * w = weight_of(t);
    if (w && w->sparse) __atomic_store_n(&w->filled, 0, __ATOMIC_RELEASE);
    if (w && w->grp) __atomic_store_n(&w->grp->filled, 0, __ATOMIC_RELEASE);
}

static void accel_buffer_memset_tensor(ggml_backend_buffer_t b, struct ggml_tensor * t, uint8_t v, size_t off, size_t size) {
    memset((char *) t->data + off, v, size);
    mark_unfilled(t);
}

static void accel_buffer_set_tensor(ggml_backend_buffer_t b, struct ggml_tensor * t, const void * data, size_t off, size_t size) {
    memcpy((char *) t->data + off, data, size);
    mark_unfilled(t);
}

static void accel_buffer_get_tensor(ggml_backend_buffer_t b, const struct ggml_tensor * t, void * data, size_t off, size_t size) {
    memcpy(data, (const char *) t->data + off, size);
}

static bool accel_buffer_cpy_tensor(ggml_backend_buffer_t b, const struct ggml_tensor * src, struct ggml_tensor * dst) {
    if (src->buffer && ggml_backend_buffer_is_host(src->buffer)) {
        memcpy(dst->data, src->data, ggml_nbytes(src));
        mark_unfilled(dst);
        return true;
    }
    return false;
}

static void accel_buffer_clear(ggml_backend_buffer_t buffer, uint8_t v) {
    struct accel_buffer * ab = buffer->context;
    memset(ab->data, v, ab->size);
    for (int32_t i = 0; i < ab->n_records; ++i) {
        __atomic_store_n(&ab->records[i]->filled, 0, __ATOMIC_RELEASE);
        if (ab->records[i]->grp) __atomic_store_n(&ab->records[i]->grp->filled, 0, __ATOMIC_RELEASE);
    }
}

static const struct ggml_backend_buffer_i k_buffer_i = {
    .free_buffer   = accel_buffer_free,
    .get_base      = accel_buffer_get_base,
    .init_tensor   = accel_buffer_init_tensor,
    .memset_tensor = accel_buffer_memset_tensor,
    .set_tensor    = accel_buffer_set_tensor,
    .get_tensor    = accel_buffer_get_tensor,
    .cpy_tensor    = accel_buffer_cpy_tensor,
    .clear         = accel_buffer_clear,
    .reset         = NULL,
};

static const char * accel_buft_name(ggml_backend_buffer_type_t buft) { return ACCEL_NAME; }

static ggml_backend_buffer_t accel_buft_alloc(ggml_backend_buffer_type_t buft, size_t size) {
    struct accel_buffer * ab = calloc(1, sizeof(*ab));
    if (!ab) return NULL;
    ab->size = size ? size : ACCEL_ALIGN;
    // anonymous memory: zero-filled, as the column copies' padding needs (pi_colmat_bind)
    ab->data = mmap(NULL, ab->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ab->data == MAP_FAILED) {
        free(ab);
        pi_log(POWERINFER_LOG_ERROR, "powerinfer accel: cannot allocate a buffer of %zu bytes", size);
        return NULL;
    }
#ifdef MADV_HUGEPAGE
    madvise(ab->data, ab->size, MADV_HUGEPAGE);
#endif
    return ggml_backend_buffer_init(buft, k_buffer_i, ab, size);
}

static size_t accel_buft_alignment(ggml_backend_buffer_type_t buft) { return ACCEL_ALIGN; }

static size_t accel_buft_alloc_size(ggml_backend_buffer_type_t buft, const struct ggml_tensor * t) {
    return weight_alloc_size(t);
}

static bool accel_buft_is_host(ggml_backend_buffer_type_t buft) { return true; }

static ggml_backend_buffer_type_t accel_buft(void) {
    static struct ggml_backend_buffer_type buft = {
        .iface = {
            .get_name       = accel_buft_name,
            .alloc_buffer   = accel_buft_alloc,
            .get_alignment  = accel_buft_alignment,
            .get_max_size   = NULL,
            .get_alloc_size = accel_buft_alloc_size,
            .is_host        = accel_buft_is_host,
        },
        .device  = NULL,  // set by accel_device()
        .context = NULL,
    };
    return &buft;
}

// ---------------------------------------------------------------- the backend

struct accel_swap {
    struct ggml_tensor * node;
    enum ggml_op         op;
    int32_t              params[GGML_MAX_OP_PARAMS / sizeof(int32_t)];
    void *               extra;  // the node's, while it points at its group role
};

// What a group member's node does while swapped in (node->extra points here): the first of the
// group's nodes runs the joint product into a slot and takes its rows; the others take theirs.
struct accel_role {
    struct accel_group * grp;
    int32_t              member;
    bool                 runs;
    int32_t              slot_index;
    float *              slot;   // [T][the group's rows]: slot slot_index of be->slots
};

#define ACCEL_MAX_SLOTS 8

struct accel_backend {
    ggml_backend_t        cpu;        // computes every split, our nodes included
    int                   n_threads;
    struct pi_input_op ** ops;        // [weight id] -> its matrices' operator state in this backend
    int32_t               n_ops;
    void *                work;       // the custom nodes' memory (one node runs at a time)
    size_t                work_size;
    struct ggml_context * tmpl_ctx;   // a custom op node whose op and params our nodes take on
    struct ggml_tensor *  tmpl;
    struct accel_swap *   swapped;    // nodes turned into the custom op during a compute
    int32_t               n_swapped, cap_swapped;
    struct accel_role *   roles;      // of the group members' nodes in this compute
    int32_t               cap_roles;
    float *               slots;      // the groups' joint results: ACCEL_MAX_SLOTS of slot_floats
    size_t                slot_floats, cap_slots;
    int32_t               sync[2];    // the MoE loop's barrier
    struct ggml_context * part_ctx;   // calibration, masked inputs: a graph of one run of the split's nodes
    struct ggml_cgraph *  part;
    int                   part_size;
    float *               masked;     // a dense product's input under the rule (masked_compute)
    size_t                cap_masked; // floats
    struct ggml_tensor    masked_t;   // the tensor that points there
    struct ggml_tensor ** src_of;     // [cap_src]: nodes whose src[1] masked_compute moved,
    struct ggml_tensor ** src_was;    // and their own
    int32_t               n_src, cap_src;
};

static void spin_barrier(int32_t * sync, int nth) {
    if (nth <= 1) return;
    const int32_t gen = __atomic_load_n(&sync[1], __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&sync[0], 1, __ATOMIC_ACQ_REL) == nth) {
        __atomic_store_n(&sync[0], 0, __ATOMIC_RELAXED);
        __atomic_fetch_add(&sync[1], 1, __ATOMIC_RELEASE);
    } else {
        while (__atomic_load_n(&sync[1], __ATOMIC_ACQUIRE) == gen) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        }
    }
}

// The operator table's slot of record id (grown as records appear); NULL when out of memory.
static struct pi_input_op ** ops_slot(struct accel_backend * be, int32_t id) {
    if (id >= be->n_ops) {
        const int32_t n = id + 256;
        struct pi_input_op ** o = realloc(be->ops, (size_t) n * sizeof(*o));
        if (!o) return NULL;
        memset(o + be->n_ops, 0, (size_t) (n - be->n_ops) * sizeof(*o));
        be->ops   = o;
        be->n_ops = n;
    }
    return &be->ops[id];
}

static struct pi_input_op * ops_of(struct accel_backend * be, struct accel_weight * w) {
    if (!ops_slot(be, w->id)) return NULL;
    if (!be->ops[w->id]) {
        struct pi_input_op * op = calloc((size_t) w->n_mats, sizeof(*op));
        if (!op) return NULL;
        for (int32_t e = 0; e < w->n_mats; ++e) {
            op[e].cm   = &w->cm[e];
            op[e].stat = &w->stat;
        }
        be->ops[w->id] = op;
    }
    return be->ops[w->id];
}

// The group's operator state in this backend (in the table slot of member 0's record id).
static struct pi_input_op * group_ops_of(struct accel_backend * be, struct accel_group * grp) {
    if (!ops_slot(be, grp->id)) return NULL;
    if (!be->ops[grp->id]) {
        struct pi_input_op * op = calloc(1, sizeof(*op));
        if (!op) return NULL;
        op->cm   = &grp->cm;
        op->stat = &grp->stat;
        be->ops[grp->id] = op;
    }
    return be->ops[grp->id];
}

// The MoE layout inside the work memory: routed (expert, slot, token) triples, counts per
// expert, then the gathered inputs and the results of one piece of at most PI_COLMAT_MAX_TOKENS.
struct moe_layout {
    size_t  route, count, x, y, op, total;
    int64_t n_pairs;
};

static struct moe_layout moe_layout_of(const struct accel_weight * w, const struct ggml_tensor * node, size_t op_work) {
    const struct ggml_tensor * ids = node->src[2];
    struct moe_layout L;
    L.n_pairs = ids->ne[0] * ids->ne[1];
    L.route   = 0;
    L.count   = align_up((size_t) L.n_pairs * 2 * sizeof(int32_t));
    L.x       = L.count + align_up((size_t) (w->n_mats + 1) * sizeof(int32_t));
    L.y       = L.x + align_up((size_t) (w->cm[0].n_in * PI_COLMAT_MAX_TOKENS) * sizeof(float));
    L.op      = L.y + align_up((size_t) (w->cm[0].n_out * PI_COLMAT_MAX_TOKENS) * sizeof(float));
    L.total   = L.op + op_work;
    return L;
}

// Whether node (MUL_MAT / MUL_MAT_ID of a sparse weight) runs our product now.
static bool runs_sparse(const struct ggml_tensor * node) {
    const struct ggml_tensor * wt = node->src[0];
    const struct accel_weight * w = weight_of(wt);
    if (!w || !w->sparse || w->grp) return false;  // a group's members run together (group_pass)
    const struct ggml_tensor * x = node->src[1];
    if (x->type != GGML_TYPE_F32 || x->nb[0] != sizeof(float) || node->type != GGML_TYPE_F32) return false;
    const int64_t max_batch = __atomic_load_n(&g_max_batch, __ATOMIC_RELAXED);
    if (node->op == GGML_OP_MUL_MAT) {
        return w->n_mats == 1 && x->ne[2] == 1 && x->ne[3] == 1 && x->ne[1] <= max_batch && x->ne[1] >= 1 &&
               node->nb[0] == sizeof(float) && node->nb[1] == (size_t) node->ne[0] * sizeof(float);
    }
    if (node->op == GGML_OP_MUL_MAT_ID) {
        const struct ggml_tensor * ids = node->src[2];
        return ids->type == GGML_TYPE_I32 && x->ne[3] == 1 && ids->ne[1] <= max_batch && x->ne[2] == ids->ne[1] &&
               (x->ne[1] == 1 || x->ne[1] == ids->ne[0]) && node->nb[0] == sizeof(float);
    }
    return false;
}

// The column copies, written by the threads of the step that first needs them.
static void fill_once(struct accel_weight * w, int ith, int nth) {
    if (__atomic_load_n(&w->filled, __ATOMIC_ACQUIRE)) return;
    for (int32_t e = 0; e < w->n_mats; ++e) {
        struct ggml_tensor m = matrix_of(w->tensor, e);
        struct ggml_tensor * mp = &m;
        pi_colmat_fill(&w->cm[e], &mp, ith, nth);
    }
    spin_barrier(w->sync, nth);
    if (ith == 0) __atomic_store_n(&w->filled, 1, __ATOMIC_RELEASE);
}

static void fill_group_once(struct accel_group * grp, int ith, int nth) {
    if (__atomic_load_n(&grp->filled, __ATOMIC_ACQUIRE)) return;
    struct ggml_tensor * mats[PI_COLMAT_MAX_SEGS];
    for (int32_t m = 0; m < grp->n; ++m) mats[m] = grp->member[m]->tensor;
    pi_colmat_fill(&grp->cm, mats, ith, nth);
    spin_barrier(grp->sync, nth);
    if (ith == 0) __atomic_store_n(&grp->filled, 1, __ATOMIC_RELEASE);
}

// A group member's node: the first runs the joint product into its slot; each takes its rows.
static void run_group_member(struct accel_backend * be, struct ggml_tensor * node, const struct accel_role * role, int ith, int nth) {
    struct accel_group * grp = role->grp;
    const int64_t T = node->src[1]->ne[1];
    if (role->runs) {
        fill_group_once(grp, ith, nth);
        pi_input_sparse_run(be->ops[grp->id], node->src[1], role->slot, be->work, ith, nth);
        spin_barrier(be->sync, nth);
    }
    const struct pi_colmat_seg * sg = &grp->cm.seg[role->member];
    const int64_t n_out = grp->cm.n_out;
    for (int64_t t = ith; t < T; t += nth) {
        memcpy((float *) node->data + t * sg->n_rows, role->slot + t * n_out + sg->row0, (size_t) sg->n_rows * sizeof(float));
    }
}

static void run_mul_mat(struct accel_backend * be, struct ggml_tensor * node, struct accel_weight * w, int ith, int nth) {
    pi_input_sparse_run(&be->ops[w->id][0], node->src[1], (float *) node->data, be->work, ith, nth);
}

// MUL_MAT_ID: per expert, its routed (slot, token) inputs gathered into pieces of at most
// PI_COLMAT_MAX_TOKENS columns, the product, and the results put back where ggml puts them.
static void run_mul_mat_id(struct accel_backend * be, struct ggml_tensor * node, struct accel_weight * w, int ith, int nth) {
    const struct ggml_tensor * x = node->src[1], * ids = node->src[2];
    const int64_t n_in = w->cm[0].n_in, n_out = w->cm[0].n_out;
    const struct moe_layout L = moe_layout_of(w, node, 0);
    char * work = be->work;
    int32_t * route = (int32_t *) (work + L.route), * count = (int32_t *) (work + L.count);
    float * xg = (float *) (work + L.x), * yg = (float *) (work + L.y);
    void * opw = work + L.op;
    if (ith == 0) {  // a counting sort of the routed pairs by expert (in slot, token order)
        memset(count, 0, (size_t) (w->n_mats + 1) * sizeof(int32_t));
        for (int64_t t = 0; t < ids->ne[1]; ++t) {
            for (int64_t s = 0; s < ids->ne[0]; ++s) {
                const int32_t e = *(const int32_t *) ((const char *) ids->data + t * ids->nb[1] + s * ids->nb[0]);
                if (e >= 0 && e < w->n_mats) count[e + 1]++;
            }
        }
        for (int32_t e = 0; e < w->n_mats; ++e) count[e + 1] += count[e];
        int32_t * fill = (int32_t *) (work + L.y);  // scratch: the next free place per expert
        memcpy(fill, count, (size_t) w->n_mats * sizeof(int32_t));
        for (int64_t t = 0; t < ids->ne[1]; ++t) {
            for (int64_t s = 0; s < ids->ne[0]; ++s) {
                const int32_t e = *(const int32_t *) ((const char *) ids->data + t * ids->nb[1] + s * ids->nb[0]);
                if (e < 0 || e >= w->n_mats) continue;
                route[2 * fill[e]]     = (int32_t) s;
                route[2 * fill[e] + 1] = (int32_t) t;
                fill[e]++;
            }
        }
    }
    spin_barrier(be->sync, nth);
    struct pi_input_op * ops = be->ops[w->id];
    for (int32_t e = 0; e < w->n_mats; ++e) {
        for (int32_t p0 = count[e]; p0 < count[e + 1]; p0 += PI_COLMAT_MAX_TOKENS) {
            const int32_t k = count[e + 1] - p0 < PI_COLMAT_MAX_TOKENS ? count[e + 1] - p0 : PI_COLMAT_MAX_TOKENS;
            for (int32_t j = ith; j < k; j += nth) {  // gather
                const int32_t s = route[2 * (p0 + j)], t = route[2 * (p0 + j) + 1];
                const int64_t sx = x->ne[1] == 1 ? 0 : s;
                memcpy(xg + (size_t) j * n_in, (const char *) x->data + t * x->nb[2] + sx * x->nb[1], (size_t) n_in * sizeof(float));
            }
            spin_barrier(be->sync, nth);
            struct ggml_tensor xt = { 0 };
            xt.type  = GGML_TYPE_F32;
            xt.ne[0] = n_in;
            xt.ne[1] = k;
            xt.ne[2] = xt.ne[3] = 1;
            xt.nb[0] = sizeof(float);
            xt.nb[1] = (size_t) n_in * sizeof(float);
            xt.nb[2] = xt.nb[3] = xt.nb[1] * (size_t) k;
            xt.data  = xg;
            pi_input_sparse_run(&ops[e], &xt, yg, opw, ith, nth);
            spin_barrier(be->sync, nth);
            for (int32_t j = ith; j < k; j += nth) {  // scatter
                const int32_t s = route[2 * (p0 + j)], t = route[2 * (p0 + j) + 1];
                float * dst = (float *) ((char *) node->data + t * node->nb[2] + s * node->nb[1]);
                memcpy(dst, yg + (size_t) j * n_out, (size_t) n_out * sizeof(float));
            }
            spin_barrier(be->sync, nth);
        }
    }
}

// The custom op our nodes become: every thread of the CPU backend's pool calls it.
static void accel_custom(struct ggml_tensor * node, int ith, int nth, void * userdata) {
    struct accel_backend * be = userdata;
    struct accel_weight * w = weight_of(node->src[0]);
    if (w->grp) {
        run_group_member(be, node, node->extra, ith, nth);
        return;
    }
    fill_once(w, ith, nth);
    if (w->n_mats == 1) {
        run_mul_mat(be, node, w, ith, nth);
    } else {
        run_mul_mat_id(be, node, w, ith, nth);
    }
}

static bool ensure_work(struct accel_backend * be, size_t need) {
    if (need <= be->work_size) return true;
    void * p = NULL;
    need = align_up(need) + 4096;
    if (posix_memalign(&p, ACCEL_ALIGN, need) != 0) return false;
    free(be->work);
    be->work      = p;
    be->work_size = need;
    return true;
}

// Records node's op, params and extra, and turns it into our custom op.
static bool swap_node(struct accel_backend * be, struct ggml_tensor * node) {
    if (be->n_swapped == be->cap_swapped) {
        const int32_t c = be->cap_swapped ? 2 * be->cap_swapped : 512;
        struct accel_swap * sw = realloc(be->swapped, (size_t) c * sizeof(*sw));
        if (!sw) return false;
        be->swapped     = sw;
        be->cap_swapped = c;
    }
    struct accel_swap * sw = &be->swapped[be->n_swapped++];
    sw->node  = node;
    sw->op    = node->op;
    sw->extra = node->extra;
    memcpy(sw->params, node->op_params, sizeof(sw->params));
    node->op = GGML_OP_CUSTOM;
    memcpy(node->op_params, be->tmpl->op_params, sizeof(sw->params));  // (function, tasks, this backend)
    return true;
}

// Index of node in g, searching from `from`.
static int node_index(struct ggml_cgraph * g, const struct ggml_tensor * node, int from) {
    const int n = ggml_graph_n_nodes(g);
    for (int j = from; j < n; ++j) {
        if (ggml_graph_node(g, j) == node) return j;
    }
    return from;
}

// A slot free from node `at` on (its last reader before it), or a new one; -1: none left.
static int free_slot(int * slot_end, int * n_slots, int at) {
    for (int s = 0; s < *n_slots; ++s) {
        if (slot_end[s] < at) return s;
    }
    return *n_slots < ACCEL_MAX_SLOTS ? (*n_slots)++ : -1;
}

// The groups whose members' nodes all read one input in this split, batches up to the max:
// their nodes become the custom op with a role (the first runs the product into a slot, which no
// other group uses until the group's last node). A group split across graphs, or beyond the
// slots, is left to ggml: its members have no copies of their own.
static void group_pass(struct accel_backend * be, struct ggml_cgraph * g) {
    const int n = ggml_graph_n_nodes(g);
    const int64_t max_batch = __atomic_load_n(&g_max_batch, __ATOMIC_RELAXED);
    int32_t n_roles = 0;
    for (int i = 0; i < n; ++i) {  // roles: at most one per node
        const struct ggml_tensor * node = ggml_graph_node(g, i);
        const struct accel_weight * w = node->op == GGML_OP_MUL_MAT ? weight_of(node->src[0]) : NULL;
        n_roles += w && w->grp;
    }
    if (n_roles == 0) return;
    if (n_roles > be->cap_roles) {
        struct accel_role * r = realloc(be->roles, (size_t) n_roles * sizeof(*r));
        if (!r) return;
        be->roles     = r;
        be->cap_roles = n_roles;
    }
    int32_t used = 0;
    int     slot_end[ACCEL_MAX_SLOTS] = { 0 };  // the node index of each slot's last reader
    int     n_slots = 0;
    size_t  slot_floats = 0;
    for (int i = 0; i < n; ++i) {
        struct ggml_tensor * node = ggml_graph_node(g, i);
        struct accel_weight * w = node->op == GGML_OP_MUL_MAT ? weight_of(node->src[0]) : NULL;
        if (!w || !w->grp) continue;
        struct accel_group * grp = w->grp;
        const struct ggml_tensor * x = node->src[1];
        // the group starts at its first node in this graph: find the others, after it (nodes
        // given a role are custom ops by now, so each node is taken once)
        if (!grp->bound) continue;
        if (x->type != GGML_TYPE_F32 || x->nb[0] != sizeof(float) || x->ne[2] != 1 || x->ne[3] != 1 ||
            x->ne[1] < 1 || x->ne[1] > max_batch) continue;
        struct ggml_tensor * nodes[PI_COLMAT_MAX_SEGS] = { 0 };
        int last = i, found = 0;
        for (int j = i; j < n && found < grp->n; ++j) {
            struct ggml_tensor * o = ggml_graph_node(g, j);
            if (o->op != GGML_OP_MUL_MAT || o->src[1] != x) continue;
            const struct accel_weight * ow = weight_of(o->src[0]);
            if (!ow || ow->grp != grp || nodes[ow->member] || o->type != GGML_TYPE_F32 ||
                o->nb[1] != (size_t) o->ne[0] * sizeof(float)) continue;
            nodes[ow->member] = o;
            last = j;
            found++;
        }
        // Every member found runs sparse. Complete here (the usual case), the first runs the
        // product for all; split across graphs (an eval callback asks for each node), each found
        // member runs it alone and takes its own rows: the same values, at the group's cost each.
        const bool complete = found == grp->n;
        struct pi_input_op * op = group_ops_of(be, grp);
        if (!op) continue;
        op->n_threads = be->n_threads;
        if (!ensure_work(be, pi_input_sparse_work_size(&grp->cm, x->ne[1], be->n_threads))) continue;
        const size_t need = (size_t) grp->cm.n_out * (size_t) x->ne[1];
        if (need > slot_floats) slot_floats = need;
        const int start = complete ? free_slot(slot_end, &n_slots, i) : 0;
        if (complete && start < 0) continue;  // left to ggml, dense; never with llama's graphs
        if (complete) slot_end[start] = last;
        for (int32_t m = 0; m < grp->n; ++m) {
            if (!nodes[m]) continue;
            int sl = start;
            if (!complete) {
                const int at = node_index(g, nodes[m], i);
                if ((sl = free_slot(slot_end, &n_slots, at)) < 0) break;
                slot_end[sl] = at;
            }
            struct accel_role * role = &be->roles[used];
            role->grp    = grp;
            role->member = m;
            role->runs   = !complete || nodes[m] == node;
            role->slot_index = sl;
            if (!swap_node(be, nodes[m])) continue;
            nodes[m]->extra = role;
            used++;
        }
    }
    // the slots, then each role's pointer into them
    slot_floats = (slot_floats + 15) / 16 * 16;
    const size_t total = slot_floats * (size_t) n_slots;
    if (total > be->cap_slots) {
        void * p = NULL;
        if (posix_memalign(&p, ACCEL_ALIGN, total * sizeof(float)) == 0) {
            free(be->slots);
            be->slots     = p;
            be->cap_slots = total;
        }
    }
    for (int32_t r = 0; r < used; ++r) {
        be->roles[r].slot = total <= be->cap_slots ? be->slots + (size_t) be->roles[r].slot_index * slot_floats : NULL;
    }
}

// Turns a sparse node into our custom op (its memory sized first); false leaves it to ggml.
static bool swap_in(struct accel_backend * be, struct ggml_tensor * node) {
    struct accel_weight * w = weight_of(node->src[0]);
    struct pi_input_op * ops = ops_of(be, w);
    if (!ops) return false;
    for (int32_t e = 0; e < w->n_mats; ++e) ops[e].n_threads = be->n_threads;
    const int64_t T = node->op == GGML_OP_MUL_MAT ? node->src[1]->ne[1] : PI_COLMAT_MAX_TOKENS;
    size_t need = pi_input_sparse_work_size(&w->cm[0], T, be->n_threads);
    if (node->op == GGML_OP_MUL_MAT_ID) need = moe_layout_of(w, node, need).total;
    if (!ensure_work(be, need)) return false;
    return swap_node(be, node);
}

static bool calibrating(const struct ggml_tensor * node) {
    if (node->op != GGML_OP_MUL_MAT && node->op != GGML_OP_MUL_MAT_ID) return false;
    const struct accel_weight * w = weight_of(node->src[0]);
    return w && w->hist && node->src[1]->type == GGML_TYPE_F32 && ggml_is_contiguous(node->src[1]);
}

// Computes nodes [start, end) of g (the part graph sized for g's nodes first).
static enum ggml_status compute_part(struct accel_backend * be, struct ggml_cgraph * g, int start, int end) {
    const int n = ggml_graph_n_nodes(g);
    if (!be->part || be->part_size < n) {
        ggml_free(be->part_ctx);
        struct ggml_init_params ip = { .mem_size = ggml_graph_overhead_custom((size_t) n, false), .mem_buffer = NULL, .no_alloc = true };
        be->part_ctx  = ggml_init(ip);
        be->part      = be->part_ctx ? ggml_new_graph_custom(be->part_ctx, (size_t) n, false) : NULL;
        be->part_size = be->part ? n : 0;
        if (!be->part) return GGML_STATUS_ALLOC_FAILED;
    }
    if (end <= start) return GGML_STATUS_SUCCESS;
    ggml_graph_clear(be->part);
    for (int k = start; k < end; ++k) ggml_graph_add_node(be->part, ggml_graph_node(g, k));
    return ggml_backend_graph_compute(be->cpu, be->part);
}

// Calibration: the split in runs that end before each calibrated matmul, whose input is then
// complete and counted; ggml computes every node (the dense model, exactly).
static enum ggml_status calibrate_compute(struct accel_backend * be, struct ggml_cgraph * g) {
    const int n = ggml_graph_n_nodes(g);
    for (int start = 0, i = 0; i <= n; ++i) {
        struct ggml_tensor * node = i < n ? ggml_graph_node(g, i) : NULL;
        if (node && !calibrating(node)) continue;
        const enum ggml_status st = compute_part(be, g, start, i);
        if (st != GGML_STATUS_SUCCESS) return st;
        if (node) {
            struct ggml_tensor flat = *node->src[1];  // every token's input, as [n_in, rows]
            flat.ne[1] = flat.ne[1] * flat.ne[2] * flat.ne[3];
            flat.ne[2] = flat.ne[3] = 1;
            pi_histogram_add(&flat, weight_of(node->src[0])->hist, 0, 1);
        }
        start = i;
    }
    return GGML_STATUS_SUCCESS;
}

// The threshold of a matmul that ggml computes densely on a sparse weight (a batch above the
// max, or a shape the product does not take), NAN for any other node.
static float dense_rule(const struct ggml_tensor * node) {
    if (node->op != GGML_OP_MUL_MAT && node->op != GGML_OP_MUL_MAT_ID) return NAN;
    const struct accel_weight * w = weight_of(node->src[0]);
    if (!w || !w->sparse || node->src[1]->type != GGML_TYPE_F32) return NAN;
    return w->grp ? w->grp->stat.threshold : w->stat.threshold;
}

// x with the entries |x| <= tau zeroed (NaN kept, as the product keeps it), contiguous, in y.
static void mask_input(const struct ggml_tensor * x, float tau, float * y) {
    for (int64_t i3 = 0; i3 < x->ne[3]; ++i3) {
        for (int64_t i2 = 0; i2 < x->ne[2]; ++i2) {
            for (int64_t i1 = 0; i1 < x->ne[1]; ++i1, y += x->ne[0]) {
                const char * row = (const char *) x->data + i1 * x->nb[1] + i2 * x->nb[2] + i3 * x->nb[3];
                for (int64_t i0 = 0; i0 < x->ne[0]; ++i0) {
                    const float v = *(const float *) (row + i0 * x->nb[0]);
                    y[i0] = fabsf(v) <= tau ? 0.0f : v;
                }
            }
        }
    }
}

// The split with input mode's rule on the products ggml computes densely (as the core's
// graph does, graph.c: input_mask_step): the split runs up to such a matmul, its input is
// copied under the rule, and the matmul (and the next ones reading the same input under the
// same threshold) read the copy. A token's result is then the sparse product's up to rounding
// whatever the batch: a prompt above the max batch, a prompt cache or a slot's reused prefix
// give the same tokens the same rule. This thread makes the copy (one pass over the input,
// small beside the matmul that follows).
static enum ggml_status masked_compute(struct accel_backend * be, struct ggml_cgraph * g) {
    const int n = ggml_graph_n_nodes(g);
    const struct ggml_tensor * cur_x = NULL;  // the input the copy holds, and its threshold
    float cur_tau = NAN;
    enum ggml_status st = GGML_STATUS_SUCCESS;
    int start = 0;
    be->n_src = 0;
    for (int i = 0; i < n && st == GGML_STATUS_SUCCESS; ++i) {
        struct ggml_tensor * node = ggml_graph_node(g, i);
        const float tau = dense_rule(node);
        if (isnan(tau)) continue;
        struct ggml_tensor * x = node->src[1];
        if (be->n_src == be->cap_src) {
            const int32_t c = be->cap_src ? 2 * be->cap_src : 256;
            struct ggml_tensor ** a = realloc(be->src_of, (size_t) c * sizeof(*a));
            if (a) be->src_of = a;
            struct ggml_tensor ** b = a ? realloc(be->src_was, (size_t) c * sizeof(*b)) : NULL;
            if (b) be->src_was = b;
            if (!a || !b) {
                st = GGML_STATUS_ALLOC_FAILED;
                break;
            }
            be->cap_src = c;
        }
        if (x != cur_x || tau != cur_tau) {
            if ((st = compute_part(be, g, start, i)) != GGML_STATUS_SUCCESS) break;  // x is complete now
            start = i;
            const size_t ne = (size_t) ggml_nelements(x);
            if (ne > be->cap_masked) {
                void * m = NULL;
                if (posix_memalign(&m, ACCEL_ALIGN, ne * sizeof(float)) != 0) {
                    st = GGML_STATUS_ALLOC_FAILED;
                    break;
                }
                free(be->masked);
                be->masked     = m;
                be->cap_masked = ne;
            }
            mask_input(x, tau, be->masked);
            struct ggml_tensor * t = &be->masked_t;
            *t = *x;  // its shape and name; contiguous, in our memory, computed
            t->op = GGML_OP_NONE;
            memset(t->src, 0, sizeof(t->src));
            t->view_src  = NULL;
            t->view_offs = 0;
            t->data      = be->masked;
            t->nb[0]     = sizeof(float);
            for (int d = 1; d < GGML_MAX_DIMS; ++d) t->nb[d] = t->nb[d - 1] * (size_t) t->ne[d - 1];
            cur_x   = x;
            cur_tau = tau;
        }
        be->src_of[be->n_src]    = node;
        be->src_was[be->n_src++] = x;
        node->src[1] = &be->masked_t;
    }
    if (st == GGML_STATUS_SUCCESS) st = compute_part(be, g, start, n);
    for (int32_t k = 0; k < be->n_src; ++k) be->src_of[k]->src[1] = be->src_was[k];
    be->n_src = 0;
    return st;
}

static enum ggml_status accel_graph_compute(ggml_backend_t backend, struct ggml_cgraph * g) {
    struct accel_backend * be = backend->context;
    be->n_swapped = 0;
    const int n = ggml_graph_n_nodes(g);
    for (int i = 0; i < n; ++i) {
        if (calibrating(ggml_graph_node(g, i))) return calibrate_compute(be, g);
    }
    for (int i = 0; i < n; ++i) {
        struct ggml_tensor * node = ggml_graph_node(g, i);
        if ((node->op == GGML_OP_MUL_MAT || node->op == GGML_OP_MUL_MAT_ID) && runs_sparse(node)) swap_in(be, node);
    }
    group_pass(be, g);
    enum ggml_status st = GGML_STATUS_SUCCESS;
    for (int32_t i = 0; i < be->n_swapped; ++i) {  // slots that could not be allocated
        const struct ggml_tensor * node = be->swapped[i].node;
        const struct accel_weight * w = weight_of(node->src[0]);
        if (w && w->grp && !((const struct accel_role *) node->extra)->slot) st = GGML_STATUS_ALLOC_FAILED;
    }
    bool rule = false;  // a matmul ggml computes densely on a sparse weight
    for (int i = 0; i < n && !rule; ++i) rule = !isnan(dense_rule(ggml_graph_node(g, i)));
    if (st == GGML_STATUS_SUCCESS) st = rule ? masked_compute(be, g) : ggml_backend_graph_compute(be->cpu, g);
    for (int32_t i = 0; i < be->n_swapped; ++i) {
        struct accel_swap * sw = &be->swapped[i];
        sw->node->op    = sw->op;
        sw->node->extra = sw->extra;
        memcpy(sw->node->op_params, sw->params, sizeof(sw->params));
    }
    be->n_swapped = 0;
    return st;
}

static const char * accel_backend_name(ggml_backend_t backend) { return ACCEL_NAME; }

static void accel_backend_free(ggml_backend_t backend) {
    struct accel_backend * be = backend->context;
    ggml_backend_free(be->cpu);
    for (int32_t i = 0; i < be->n_ops; ++i) free(be->ops[i]);
    free(be->ops);
    free(be->work);
    free(be->swapped);
    free(be->roles);
    free(be->slots);
    ggml_free(be->tmpl_ctx);
    ggml_free(be->part_ctx);
    free(be->masked);
    free(be->src_of);
    free(be->src_was);
    free(be);
    free(backend);
}

static const struct ggml_backend_i k_backend_i = {
    .get_name      = accel_backend_name,
    .free          = accel_backend_free,
    .graph_compute = accel_graph_compute,
};

static ggml_guid_t accel_guid(void) {
    static ggml_guid guid = { 0x70, 0x69, 0x2d, 0x61, 0x63, 0x63, 0x65, 0x6c, 0x2d, 0x73, 0x70, 0x61, 0x72, 0x73, 0x65, 0x01 };
    return &guid;
}

static void accel_set_n_threads(ggml_backend_t backend, int n_threads) {
    if (!backend || !ggml_guid_matches(backend->guid, accel_guid()) || n_threads < 1) return;
    struct accel_backend * be = backend->context;
    be->n_threads = n_threads;
    ggml_backend_cpu_set_n_threads(be->cpu, n_threads);
}

static ggml_backend_t accel_backend_init(void) {
    struct accel_backend * be = calloc(1, sizeof(*be));
    ggml_backend_t backend = calloc(1, sizeof(*backend));
    if (!be || !backend) goto fail;
    be->cpu = ggml_backend_cpu_init();
    if (!be->cpu) goto fail;
    be->n_threads = GGML_DEFAULT_N_THREADS;
    ggml_backend_cpu_set_n_threads(be->cpu, be->n_threads);
    struct ggml_init_params ip = { .mem_size = 4 * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true };
    be->tmpl_ctx = ggml_init(ip);
    if (!be->tmpl_ctx) goto fail;
    struct ggml_tensor * x = ggml_new_tensor_1d(be->tmpl_ctx, GGML_TYPE_F32, 1);
    struct ggml_tensor * args[1] = { x };
    // the node whose op and params (ggml_custom_op_params: our function, every thread, this
    // backend) each sparse node takes on for the time of a compute
    be->tmpl = ggml_custom_4d(be->tmpl_ctx, GGML_TYPE_F32, 1, 1, 1, 1, args, 1, accel_custom, GGML_N_TASKS_MAX, be);
    backend->guid    = accel_guid();
    backend->iface   = k_backend_i;
    backend->device  = accel_device();
    backend->context = be;
    return backend;
fail:
    if (be && be->cpu) ggml_backend_free(be->cpu);
    if (be && be->tmpl_ctx) ggml_free(be->tmpl_ctx);
    free(be);
    free(backend);
    return NULL;
}

// ---------------------------------------------------------------- the device

static ggml_backend_dev_t cpu_device(void) { return ggml_backend_reg_dev_get(ggml_backend_cpu_reg(), 0); }

static const char * accel_dev_name(ggml_backend_dev_t dev) { return ACCEL_NAME; }
static const char * accel_dev_description(ggml_backend_dev_t dev) { return "PowerInfer-Py input-sparse CPU kernels"; }
static void accel_dev_memory(ggml_backend_dev_t dev, size_t * free_mem, size_t * total) {
    ggml_backend_dev_memory(cpu_device(), free_mem, total);
}
static enum ggml_backend_dev_type accel_dev_type(ggml_backend_dev_t dev) { return GGML_BACKEND_DEVICE_TYPE_ACCEL; }

static void accel_dev_props(ggml_backend_dev_t dev, struct ggml_backend_dev_props * props) {
    props->name        = accel_dev_name(dev);
    props->description = accel_dev_description(dev);
    props->type        = GGML_BACKEND_DEVICE_TYPE_ACCEL;
    props->device_id   = NULL;
    accel_dev_memory(dev, &props->memory_free, &props->memory_total);
    props->caps.async                = false;
    props->caps.host_buffer          = false;
    props->caps.buffer_from_host_ptr = false;
    props->caps.events               = false;
}

static ggml_backend_t accel_dev_init_backend(ggml_backend_dev_t dev, const char * params) { return accel_backend_init(); }
static ggml_backend_buffer_type_t accel_dev_buft(ggml_backend_dev_t dev) { return accel_buft(); }

// Whether one of the CPU backend's extra buffer types (CPU_REPACK) would take the weight of op.
static bool cpu_repack_wants(const struct ggml_tensor * op) {
    ggml_backend_dev_t cdev = cpu_device();
    ggml_backend_dev_get_extra_bufts_t fn = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(cdev), "ggml_backend_dev_get_extra_bufts");
    if (!fn) return false;
    struct ggml_tensor * w = (struct ggml_tensor *) op->src[0];
    ggml_backend_buffer_t saved = w->buffer;
    bool wants = false;
    for (ggml_backend_buffer_type_t * b = fn(cdev); b && *b && !wants; ++b) {
        ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(*b, 0);
        w->buffer = dummy;
        wants = ggml_backend_dev_supports_op(cdev, op);
        w->buffer = saved;
        ggml_backend_buffer_free(dummy);
    }
    return wants;
}

// llama's placement asks with the real, named weight in a zero-size buffer of ours.
static bool placement_query(const struct ggml_tensor * op) {
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        const struct ggml_tensor * s = op->src[i];
        if (s && s->buffer && s->buffer->buft == accel_buft() && s->buffer->size == 0) return true;
    }
    return false;
}

static bool accept_weight(const struct ggml_tensor * op) {
    if (!ggml_backend_dev_supports_op(cpu_device(), op)) return false;
    pthread_mutex_lock(&g_lock);
    bool yes = false;
    const int32_t mode = g_mode;
    if (mode != POWERINFER_ACCEL_OFF) {
        const struct ggml_tensor * w = op->src[0];
        float thr;
        struct pi_colmat cm;
        const bool matmul = op->op == GGML_OP_MUL_MAT || op->op == GGML_OP_MUL_MAT_ID;
        if (matmul && w->buffer && w->buffer->buft == accel_buft() && wants_sparse(w, &thr) && colmat_bytes(w, &cm) > 0) {
            yes = true;  // a sparse weight
        } else if (op->op == GGML_OP_GET_ROWS) {
            yes = false;  // the token embeddings stay where llama puts them
        } else {
            // a weight beside ours (a norm, a bias, a dense matmul ggml does not repack):
            // computing it here keeps the split count low, with ggml's own kernels
            yes = g_ops_all && (mode == POWERINFER_ACCEL_CALIBRATE || g_n_rules > 0);
            if (yes && matmul) {
                pthread_mutex_unlock(&g_lock);
                const bool repack = cpu_repack_wants(op);
                pthread_mutex_lock(&g_lock);
                yes = !repack;
            }
        }
    }
    pthread_mutex_unlock(&g_lock);
    return yes;
}

static bool accel_dev_supports_op(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    switch (op->op) {
        case GGML_OP_NONE:
        case GGML_OP_RESHAPE:
        case GGML_OP_VIEW:
        case GGML_OP_PERMUTE:
        case GGML_OP_TRANSPOSE:
            return true;
        default:
            break;
    }
    if (placement_query(op)) return accept_weight(op);
    if (op->op == GGML_OP_FLASH_ATTN_EXT) return false;  // with its layer on the CPU (llama keeps flash attention on then)
    for (int i = 0; i < GGML_MAX_SRC; ++i) {  // weights of others' buffers (CPU_REPACK, a GPU's) are theirs
        const struct ggml_tensor * s = op->src[i];
        if (!s) continue;
        const struct ggml_tensor * base = s->view_src ? s->view_src : s;
        if (base->buffer && base->buffer->usage == GGML_BACKEND_BUFFER_USAGE_WEIGHTS && base->buffer->buft != accel_buft()) {
            return false;
        }
    }
    if (op->op == GGML_OP_MUL_MAT || op->op == GGML_OP_MUL_MAT_ID) {
        if (in_our_buffer(op->src[0])) return ggml_backend_dev_supports_op(cpu_device(), op);
    }
    return g_ops_all && ggml_backend_dev_supports_op(cpu_device(), op);
}

static bool accel_dev_supports_buft(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft) {
    return buft == accel_buft() || ggml_backend_buft_is_host(buft);
}

static const struct ggml_backend_device_i k_device_i = {
    .get_name             = accel_dev_name,
    .get_description      = accel_dev_description,
    .get_memory           = accel_dev_memory,
    .get_type             = accel_dev_type,
    .get_props            = accel_dev_props,
    .init_backend         = accel_dev_init_backend,
    .get_buffer_type      = accel_dev_buft,
    .get_host_buffer_type = NULL,
    .buffer_from_host_ptr = NULL,
    .supports_op          = accel_dev_supports_op,
    .supports_buft        = accel_dev_supports_buft,
    .offload_op           = NULL,
};

// ---------------------------------------------------------------- the registry entry

static const char * accel_reg_name(ggml_backend_reg_t reg) { return ACCEL_NAME; }
static size_t accel_reg_dev_count(ggml_backend_reg_t reg) { return 1; }
static ggml_backend_dev_t accel_reg_dev_get(ggml_backend_reg_t reg, size_t i) { return i == 0 ? accel_device() : NULL; }
static void * accel_reg_proc(ggml_backend_reg_t reg, const char * name) {
    if (strcmp(name, "ggml_backend_set_n_threads") == 0) return (void *) accel_set_n_threads;
    return NULL;
}

static const struct ggml_backend_reg_i k_reg_i = {
    .get_name         = accel_reg_name,
    .get_device_count = accel_reg_dev_count,
    .get_device       = accel_reg_dev_get,
    .get_proc_address = accel_reg_proc,
};

static struct ggml_backend_reg g_reg = { .api_version = GGML_BACKEND_API_VERSION, .iface = k_reg_i, .context = NULL };
static struct ggml_backend_device g_dev = { .iface = k_device_i, .reg = &g_reg, .context = NULL };

static ggml_backend_dev_t accel_device(void) {
    accel_buft()->device = &g_dev;
    return &g_dev;
}

static void read_env(void) {
    const char * ops = getenv("POWERINFER_ACCEL_OPS");
    if (ops && strcmp(ops, "weights") == 0) g_ops_all = 0;
    const char * groups = getenv("POWERINFER_ACCEL_GROUPS");
    if (groups && strcmp(groups, "0") == 0) g_groups_on = 0;
}

ggml_backend_reg_t pi_accel_reg(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, read_env);
    accel_device();
    return &g_reg;
}

void * powerinfer_accel_backend_reg(void) { return pi_accel_reg(); }

int32_t powerinfer_accel_register(void) {
    static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    static bool done;
    pthread_mutex_lock(&m);
    if (!done) {
        ggml_backend_register(pi_accel_reg());
        done = true;
    }
    pthread_mutex_unlock(&m);
    return POWERINFER_OK;
}

bool powerinfer_accel_registered(void) {
    for (size_t i = 0; i < ggml_backend_reg_count(); ++i) {
        if (ggml_backend_reg_get(i) == &g_reg) return true;
    }
    return false;
}

// ---------------------------------------------------------------- what ran

int32_t powerinfer_accel_weights(int32_t tag, struct powerinfer_accel_weight * out, int32_t cap) {
    pthread_mutex_lock(&g_lock);
    int32_t n = 0;
    for (const struct accel_weight * w = g_weights; w; w = w->next) {
        if (w->tag != tag) continue;
        if (out && n < cap) {
            struct powerinfer_accel_weight * o = &out[n];
            memset(o, 0, sizeof(*o));
            snprintf(o->name, sizeof(o->name), "%s", w->name);
            o->sparse    = w->sparse;
            o->calibrated = w->hist != NULL;
            o->threshold = w->stat.threshold;
            o->n_mats    = w->n_mats;
            o->n_in      = w->tensor->ne[0];
            o->n_out     = w->tensor->ne[1];
            o->bytes     = ggml_nbytes(w->tensor);
            o->type      = (int32_t) w->tensor->type;
            const struct pi_active_stat * st = w->grp ? &w->grp->stat : &w->stat;  // a group's members share theirs
            o->n_active  = __atomic_load_n(&st->n_active, __ATOMIC_RELAXED);
            o->n_total   = __atomic_load_n(&st->n_total, __ATOMIC_RELAXED);
            o->group_size = w->grp ? w->grp->n : 1;
        }
        ++n;
    }
    pthread_mutex_unlock(&g_lock);
    return n;
}

int32_t powerinfer_accel_histogram(int32_t tag, const char * name, uint64_t * counts, int32_t n_bins, float * log10_min,
                                   float * log10_max) {
    if (n_bins != PI_HIST_BINS) return PI_HIST_BINS;
    pthread_mutex_lock(&g_lock);
    const struct accel_weight * found = NULL;
    for (const struct accel_weight * w = g_weights; w; w = w->next) {
        if (w->tag == tag && w->hist && strcmp(w->name, name) == 0) found = w;
    }
    if (found) {
        for (int b = 0; b < PI_HIST_BINS; ++b) counts[b] = __atomic_load_n(&found->hist[b], __ATOMIC_RELAXED);
        *log10_min = PI_HIST_LOG10_MIN;
        *log10_max = PI_HIST_LOG10_MAX;
    }
    pthread_mutex_unlock(&g_lock);
    return found ? PI_HIST_BINS : pi_fail(POWERINFER_ERR_INVALID_ARG, "no calibrated weight %s", name ? name : "(null)");
}

void powerinfer_accel_reset_stats(int32_t tag) {
    pthread_mutex_lock(&g_lock);
    for (struct accel_weight * w = g_weights; w; w = w->next) {
        if (w->tag != tag) continue;
        __atomic_store_n(&w->stat.n_active, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&w->stat.n_total, 0, __ATOMIC_RELAXED);
        if (w->grp) {
            __atomic_store_n(&w->grp->stat.n_active, 0, __ATOMIC_RELAXED);
            __atomic_store_n(&w->grp->stat.n_total, 0, __ATOMIC_RELAXED);
        }
        if (w->hist) memset(w->hist, 0, PI_HIST_BINS * sizeof(uint64_t));
    }
    pthread_mutex_unlock(&g_lock);
}
