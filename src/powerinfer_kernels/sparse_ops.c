// sparse_ops.c - neuron-aware CPU operators, as ggml custom ops: the FFN computed only
// for active neurons. The per-row arithmetic is sparse_kernels.c's (any weight type).
// Work is split by active count; every output element is written by exactly one thread,
// in a fixed order, so results depend neither on scheduling nor on the thread count.
#include "sparse_ops.h"
#include "sparse_kernels.h"

#include "ggml-cpu.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

// ---- active index ----------------------------------------------------------------

// The active list of a score; `rule` is a constant in each caller, so the test inlines.
static inline void active_index(struct ggml_tensor * dst, int ith, struct pi_active_stat * stat, enum pi_active_rule rule) {
    if (ith != 0) {
        return;
    }
    const struct ggml_tensor * score = dst->src[0];
    const float threshold = stat->threshold;
    const int64_t n_ff = score->ne[0], n_tok = score->ne[1];
    int32_t * out = (int32_t *) dst->data;
    const uint8_t * skip = rule == PI_ACTIVE_NONZERO ? NULL : stat->skip;
    int32_t * masks = out + n_ff + PI_INDEX_EXTRA;
    int32_t n = 0, n_skipped = 0;
    for (int64_t i = 0; i < n_ff; ++i) {
        uint32_t m = 0;
        for (int64_t t = 0; t < n_tok; ++t) {
            const float s = *(const float *) ((const char *) score->data + i * score->nb[0] + t * score->nb[1]);
            const bool on = rule == PI_ACTIVE_ABOVE    ? s > threshold
                          : rule == PI_ACTIVE_AT_LEAST ? s >= threshold
                                                       : s != 0.0f;  // NaN counts: it must reach the output
            if (on) {
                m |= t < PI_INDEX_MAX_TOKENS ? 1u << t : ~0u;
            }
        }
        if (m) {
            if (skip && skip[i]) {
                ++n_skipped;
            } else {
                masks[n] = n_tok > PI_INDEX_MAX_TOKENS ? -1 : (int32_t) m;
                out[1 + n++] = (int32_t) i;
            }
        }
    }
    out[0] = n;
    out[n_ff + 1] = out[n_ff + 2] = 0;
    if (rule != PI_ACTIVE_NONZERO) {  // that rule is the dense FFN's exact AXPY: not a sparse step
        stat->n_active += n + n_skipped;
        stat->n_total  += n_ff;
    } else if (n_tok == 1) {          // counted apart: it chooses a token's dense down path (graph.c)
        stat->nz_active += n;
        stat->nz_total  += n_ff;
    }
}

static void active_above_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    active_index(dst, ith, userdata, PI_ACTIVE_ABOVE);
}

static void active_at_least_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    active_index(dst, ith, userdata, PI_ACTIVE_AT_LEAST);
}

static void active_nonzero_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    active_index(dst, ith, userdata, PI_ACTIVE_NONZERO);
}

static void cold_index_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const struct pi_active_stat * stat = userdata;
    const int64_t n_ff = (dst->ne[0] - PI_INDEX_EXTRA) / 2;
    int32_t * out = (int32_t *) dst->data;
    int32_t * masks = out + n_ff + PI_INDEX_EXTRA;
    int32_t n = 0;
    for (int64_t i = 0; i < n_ff; ++i) {
        if (!stat->skip || !stat->skip[i]) {
            masks[n] = -1;  // every token
            out[1 + n++] = (int32_t) i;
        }
    }
    out[0] = n;
    out[n_ff + 1] = out[n_ff + 2] = 0;
}

struct ggml_tensor * pi_cold_index(struct ggml_context * ctx, struct ggml_tensor * ref, int64_t n_ff, struct pi_active_stat * stat) {
    struct ggml_tensor * args[1] = { ref };
    return ggml_custom_4d(ctx, GGML_TYPE_I32, PI_INDEX_LEN(n_ff), 1, 1, 1, args, 1, cold_index_op, 1, stat);
}

struct ggml_tensor * pi_active_index(struct ggml_context * ctx, struct ggml_tensor * score, enum pi_active_rule rule,
                                     struct pi_active_stat * stat) {
    GGML_ASSERT(score->type == GGML_TYPE_F32);
    struct ggml_tensor * args[1] = { score };
    ggml_custom_op_t op = rule == PI_ACTIVE_ABOVE ? active_above_op : rule == PI_ACTIVE_AT_LEAST ? active_at_least_op
                                                                                               : active_nonzero_op;
    return ggml_custom_4d(ctx, GGML_TYPE_I32, PI_INDEX_LEN(score->ne[0]), 1, 1, 1, args, 1, op, 1, stat);
}

// ---- activation histogram (calibration) ---------------------------------------------------

// log2(1 + m / 1024) for the top 10 bits m of a float's mantissa: with the exponent, log2 of
// any positive float within 0.0015 (0.02 of a bin).
static float g_log2_mant[1024];
static pthread_once_t g_log2_once = PTHREAD_ONCE_INIT;

static void log2_table_init(void) {
    for (int i = 0; i < 1024; ++i) g_log2_mant[i] = log2f(1.0f + (i + 0.5f) / 1024.0f);
}

static inline int hist_bin(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u &= 0x7fffffffu;  // |v|
    if (u == 0 || u >= 0x7f800000u) {
        return u == 0 ? 0 : PI_HIST_BINS - 1;  // 0 to the first bin; inf and NaN to the last
    }
    const int e = (int) (u >> 23) - 127;
    const float l10 = ((float) e + g_log2_mant[(u >> 13) & 1023]) * 0.30102999566f;
    const int b = (int) floorf((l10 - PI_HIST_LOG10_MIN) * (PI_HIST_BINS / (PI_HIST_LOG10_MAX - PI_HIST_LOG10_MIN)));
    return b < 0 ? 0 : b >= PI_HIST_BINS ? PI_HIST_BINS - 1 : b;
}

// Each thread counts its share of the tokens (or of one token's elements) into a local
// histogram and adds it in with atomics: the counts do not depend on the split.
void pi_histogram_add(const struct ggml_tensor * x, uint64_t * hist, int ith, int nth) {
    pthread_once(&g_log2_once, log2_table_init);
    const int64_t n = x->ne[0], T = x->ne[1], total = n * T;
    const int64_t i0 = total * ith / nth, i1 = total * (ith + 1) / nth;
    uint32_t local[PI_HIST_BINS] = { 0 };
    for (int64_t k = i0; k < i1;) {
        const int64_t t = k / n, end = (t + 1) * n < i1 ? (t + 1) * n : i1;
        const float * row = (const float *) ((const char *) x->data + t * x->nb[1]) - t * n;
        for (; k < end; ++k) local[hist_bin(row[k])]++;
    }
    for (int b = 0; b < PI_HIST_BINS; ++b) {
        if (local[b]) __atomic_fetch_add(&hist[b], (uint64_t) local[b], __ATOMIC_RELAXED);
    }
}

static void histogram_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    struct pi_active_stat * stat = userdata;
    pi_histogram_add(dst->src[0], stat->hist, ith, nth);
}

struct ggml_tensor * pi_activation_histogram(struct ggml_context * ctx, struct ggml_tensor * x, struct pi_active_stat * stat) {
    GGML_ASSERT(x->type == GGML_TYPE_F32 && ggml_is_contiguous(x) && stat->hist);
    struct ggml_tensor * args[1] = { x };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, 1, 1, 1, 1, args, 1, histogram_op, GGML_N_TASKS_MAX, stat);
}

// ---- conversion of the input to the weights' vec_dot type ----------------------------

static void convert_rows_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * x = dst->src[0];
    ggml_from_float_t from_float = ggml_get_type_traits_cpu(dst->type)->from_float;
    for (int64_t t = ith; t < x->ne[1]; t += nth) {
        from_float((const float *) ((const char *) x->data + t * x->nb[1]), (char *) dst->data + t * dst->nb[1], x->ne[0]);
    }
}

struct ggml_tensor * pi_convert_rows(struct ggml_context * ctx, struct ggml_tensor * x, enum ggml_type type) {
    if (type == GGML_TYPE_F32) {
        return x;
    }
    struct ggml_tensor * args[1] = { x };
    return ggml_custom_4d(ctx, type, x->ne[0], x->ne[1], 1, 1, args, 1, convert_rows_op, GGML_N_TASKS_MAX, NULL);
}

// The rows of a sparse op are scattered, so the hardware prefetchers, which follow streams
// inside a page, restart cold at every row: each kernel call is handed the next group of
// rows and prefetches them while it computes (sparse_kernels.h).

// The rows (bytes [off, off + len) of each; len 0: the whole row) of active entries
// [k, min(k + PI_ROWS_MAX, k_end)), for prefetching. Rows may be strided views, so a row's
// length is its data, not nb[1].
static inline struct pi_next_rows next_rows(const struct ggml_tensor * w, const int32_t * idx, int32_t k, int32_t k_end,
                                            size_t off, size_t len) {
    struct pi_next_rows nr = { .k = 0, .bytes = len ? len : ggml_row_size(w->type, w->ne[0]) };
    for (; k < k_end && nr.k < PI_ROWS_MAX; ++k) {
        nr.rows[nr.k++] = (const char *) w->data + (size_t) idx[1 + k] * w->nb[1] + off;
    }
    return nr;
}

// Entries [k0, k1) of the active list (1-based positions in idx) handled by thread ith.
static void split_active(int32_t n_active, int ith, int nth, int32_t * k0, int32_t * k1) {
    *k0 = (int32_t) ((int64_t) n_active * ith / nth);
    *k1 = (int32_t) ((int64_t) n_active * (ith + 1) / nth);
}

// ---- row-sparse matvec (up, gate) ------------------------------------------------------

static void sparse_matvec_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * w   = dst->src[0];
    const struct ggml_tensor * xq  = dst->src[1];
    const int32_t *            idx = (const int32_t *) dst->src[2]->data;
    const int64_t n_ff = dst->ne[0], n_tok = dst->ne[1];
    const int32_t n_active = idx[0];
    const int32_t * masks = pi_index_masks(idx, n_ff);

    int32_t k0, k1;
    split_active(n_active, ith, nth, &k0, &k1);
    // Inactive rows are zero. Thread ith owns the rows from its first active row (row 0
    // for thread 0) up to the next thread's first active row (n_ff for the last thread).
    const int64_t r0 = ith == 0 ? 0 : (k0 < n_active ? idx[1 + k0] : n_ff);
    const int64_t r1 = ith == nth - 1 ? n_ff : (k1 < n_active ? idx[1 + k1] : n_ff);
    for (int64_t t = 0; t < n_tok; ++t) {
        float * out = (float *) ((char *) dst->data + t * dst->nb[1]);
        const void * y = (const char *) xq->data + t * xq->nb[1];
        const uint32_t tbit = t < PI_INDEX_MAX_TOKENS ? 1u << t : ~0u;
        int64_t r = r0;
        struct pi_next_rows cur = next_rows(w, idx, k0, k1, 0, 0);
        for (int j = 0; j < cur.k; ++j) pi_prefetch(cur.rows[j], cur.bytes);
        for (int32_t k = k0; k < k1; k += PI_ROWS_MAX) {
            const int kn = cur.k;
            const struct pi_next_rows nxt = next_rows(w, idx, k + PI_ROWS_MAX, k1, 0, 0);
            float res[PI_ROWS_MAX];
            pi_rows_dot(w->type, w->ne[0], cur.rows, kn, y, res, &nxt);
            cur = nxt;
            for (int j = 0; j < kn; ++j) {
                const int64_t i = idx[1 + k + j];
                if (i > r) {
                    memset(out + r, 0, (size_t) (i - r) * sizeof(float));
                }
                out[i] = (uint32_t) masks[k + j] & tbit ? res[j] : 0.0f;
                r = i + 1;
            }
        }
        if (r1 > r) {
            memset(out + r, 0, (size_t) (r1 - r) * sizeof(float));
        }
    }
}

struct ggml_tensor * pi_sparse_matvec(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * xq,
                                      struct ggml_tensor * idx) {
    GGML_ASSERT(xq->type == ggml_get_type_traits_cpu(w->type)->vec_dot_type);
    GGML_ASSERT(w->ne[0] == xq->ne[0] && idx->type == GGML_TYPE_I32 && idx->ne[0] == PI_INDEX_LEN(w->ne[1]));
    struct ggml_tensor * args[3] = { w, xq, idx };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], xq->ne[1], 1, 1, args, 3, sparse_matvec_op, GGML_N_TASKS_MAX, NULL);
}

// ---- sparse AXPY (down, over the rows of ffn_down_t) ---------------------------------

// Adds a[j] * row_j into out for the nonzero a[j] of up to PI_ROWS_MAX rows, in order.
struct axpy_group {
    const void * rows[PI_ROWS_MAX];
    float        a[PI_ROWS_MAX];
    int          n;
};

static inline void axpy_push(struct axpy_group * g, const void * row, float a) {
    if (a != 0.0f) {  // ReLU zeros and predicted-but-silent neurons cost nothing here
        g->rows[g->n] = row;
        g->a[g->n++]  = a;
    }
}

// Returns whether out was written (so the caller knows when out is still uninitialized:
// `init` asks the first call into out to start from 0 instead of reading it).
static inline bool axpy_flush(struct axpy_group * g, enum ggml_type type, int64_t n, float * out,
                              const struct pi_next_rows * next, bool init) {
    if (g->n == 0) {
        return false;
    }
    pi_rows_axpy(type, n, g->rows, g->a, g->n, out, next, init);
    g->n = 0;
    return true;
}

static void sparse_axpy_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * wt  = dst->src[0];
    const struct ggml_tensor * h   = dst->src[1];
    const int32_t *            idx = (const int32_t *) dst->src[2]->data;
    const int64_t n_embd = dst->ne[0], n_tok = dst->ne[1];
    const int32_t n_active = idx[0];

    // Each thread owns a slice of output columns, cut at weight-block boundaries, and
    // sums its slice over the active neurons in index order: no shared accumulators.
    const int64_t blck  = ggml_blck_size(wt->type);
    const int64_t n_blk = n_embd / blck;
    const int64_t c0 = n_blk * ith / nth * blck, c1 = n_blk * (ith + 1) / nth * blck;
    const int64_t len = c1 - c0;
    for (int64_t t = 0; t < n_tok; ++t) {
        memset((char *) dst->data + t * dst->nb[1] + c0 * sizeof(float), 0, (size_t) len * sizeof(float));
    }
    if (len == 0) {
        return;
    }
    const size_t slice_off = ggml_row_size(wt->type, c0), slice_bytes = ggml_row_size(wt->type, len);
    for (int64_t t = 0; t < n_tok; ++t) {
        float * out = (float *) ((char *) dst->data + t * dst->nb[1]) + c0;
        struct pi_next_rows cur = next_rows(wt, idx, 0, n_active, slice_off, slice_bytes);
        for (int j = 0; j < cur.k; ++j) pi_prefetch(cur.rows[j], cur.bytes);
        for (int32_t k = 0; k < n_active; k += PI_ROWS_MAX) {
            const struct pi_next_rows nxt = next_rows(wt, idx, k + PI_ROWS_MAX, n_active, slice_off, slice_bytes);
            struct axpy_group g = { .n = 0 };
            for (int j = 0; j < cur.k; ++j) {
                axpy_push(&g, cur.rows[j], *(const float *) ((const char *) h->data + (size_t) idx[1 + k + j] * h->nb[0] + t * h->nb[1]));
            }
            axpy_flush(&g, wt->type, len, out, &nxt, false);
            cur = nxt;
        }
    }
}

struct ggml_tensor * pi_sparse_axpy(struct ggml_context * ctx, struct ggml_tensor * wt, struct ggml_tensor * h,
                                    struct ggml_tensor * idx) {
    GGML_ASSERT(h->type == GGML_TYPE_F32 && h->ne[0] == wt->ne[1]);
    GGML_ASSERT(idx->type == GGML_TYPE_I32 && idx->ne[0] == PI_INDEX_LEN(wt->ne[1]));
    GGML_ASSERT(wt->ne[0] % ggml_blck_size(wt->type) == 0);
    struct ggml_tensor * args[3] = { wt, h, idx };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, wt->ne[0], h->ne[1], 1, 1, args, 3, sparse_axpy_op, GGML_N_TASKS_MAX, NULL);
}

// ---- fused sparse FFN (gate, up, activation and down of each active neuron) -------------
//
// Each active neuron is finished by one thread: its gate and up rows dotted with x, the
// activation, and its ffn_down_t row added into a partial sum, so a neuron's three rows
// are read together, once. The active list is cut into at most PI_FFN_MAX_CHUNKS chunks
// of at least PI_FFN_MIN_CHUNK neurons (a function of the list's length alone, never of
// the thread count); each chunk sums into its own partial in list order and a second op
// adds the partials in chunk order, so results do not depend on the number of threads.

#define PI_FFN_MIN_CHUNK  64
#define PI_FFN_MAX_CHUNKS 64

// Neurons per chunk for n_active active neurons (>= 1).
static inline int32_t ffn_chunk_size(int32_t n_active) {
    const int32_t k = (n_active + PI_FFN_MAX_CHUNKS - 1) / PI_FFN_MAX_CHUNKS;
    return k > PI_FFN_MIN_CHUNK ? k : PI_FFN_MIN_CHUNK;
}

struct pi_ffn_cfg {
    enum pi_ffn_act act;
    bool            gate;   // src: gate rows to dot (else a given activation, or no gate)
    bool            given;  // src: act(gate) computed elsewhere (gate mode)
};

// Every combination, so the op's userdata is static.
static const struct pi_ffn_cfg g_ffn_cfgs[4][3] = {
#define PI_CFG_ROW(a) { { a, false, false }, { a, true, false }, { a, false, true } }
    PI_CFG_ROW(PI_ACT_SILU), PI_CFG_ROW(PI_ACT_RELU), PI_CFG_ROW(PI_ACT_GELU), PI_CFG_ROW(PI_ACT_DRELU),
#undef PI_CFG_ROW
};

static inline float act_apply(enum pi_ffn_act act, float x) {
    switch (act) {
        case PI_ACT_RELU:
        case PI_ACT_DRELU: return x > 0.0f ? x : 0.0f;
        case PI_ACT_GELU: {
            const float c = 0.7978845608028654f;  // sqrt(2 / pi), the tanh form ggml uses
            return 0.5f * x * (1.0f + tanhf(c * x * (1.0f + 0.044715f * x * x)));
        }
        default: return x / (1.0f + expf(-x));
    }
}

// h of one neuron and token: act(g) * f(u) for gated FFNs (f = relu for dReLU), act(u) without a gate.
static inline float ffn_h(const struct pi_ffn_cfg * cfg, float g, float u) {
    if (!cfg->gate && !cfg->given) {
        return act_apply(cfg->act, u);
    }
    const float a = cfg->given ? g : act_apply(cfg->act, g);
    return a * (cfg->act == PI_ACT_DRELU ? (u > 0.0f ? u : 0.0f) : u);
}

// src: up, gate (cfg->gate) or a (cfg->given), down_t, xq, xg (cfg->gate), idx.
// dst: F32 [n_embd, T, PI_FFN_MAX_CHUNKS] chunk partials.
static void sparse_ffn_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const struct pi_ffn_cfg * cfg = userdata;
    int s = 0;
    const struct ggml_tensor * up   = dst->src[s++];
    const struct ggml_tensor * gate = cfg->gate ? dst->src[s++] : NULL;
    const struct ggml_tensor * a    = cfg->given ? dst->src[s++] : NULL;
    const struct ggml_tensor * wt   = dst->src[s++];
    const struct ggml_tensor * xq   = dst->src[s++];
    const struct ggml_tensor * xg   = cfg->gate ? dst->src[s++] : NULL;
    const int32_t *            idx  = (const int32_t *) dst->src[s++]->data;
    const int64_t n_embd = dst->ne[0], n_tok = dst->ne[1];
    const int32_t n_active = idx[0];
    const int32_t * masks = pi_index_masks(idx, up->ne[1]);
    const int32_t chunk = ffn_chunk_size(n_active);
    const int32_t n_chunks = (n_active + chunk - 1) / chunk;
    // Threads claim chunks in order from a shared counter (memory latencies differ from
    // row to row, so a fixed share would leave a thread waiting); each chunk still sums
    // into its own partial. The last thread out zeroes the counters for the next run.
    int32_t * claimed  = (int32_t *) idx + up->ne[1] + 1;
    int32_t * finished = claimed + 1;
    for (int32_t c = __atomic_fetch_add(claimed, 1, __ATOMIC_RELAXED); c < n_chunks;
         c = __atomic_fetch_add(claimed, 1, __ATOMIC_RELAXED)) {
        float * part = (float *) ((char *) dst->data + (size_t) c * dst->nb[2]);
        bool written[PI_FFN_MAX_TOKENS] = { false };  // the first AXPY into a token's partial starts it from 0
        const int32_t k_lo = c * chunk, k_hi = k_lo + chunk < n_active ? k_lo + chunk : n_active;
        // Each group of PI_ROWS_MAX neurons prefetches the next group's rows as it goes:
        // the up rows during the up products, the gate rows during the gate products, the
        // down rows during the AXPY (the chunk's first group: at once).
        struct pi_next_rows up_cur = next_rows(up, idx, k_lo, k_hi, 0, 0), wt_cur = next_rows(wt, idx, k_lo, k_hi, 0, 0);
        struct pi_next_rows gate_cur = gate ? next_rows(gate, idx, k_lo, k_hi, 0, 0) : (struct pi_next_rows) { .k = 0 };
        for (int j = 0; j < up_cur.k; ++j) {
            pi_prefetch(up_cur.rows[j], up_cur.bytes);
            if (gate) pi_prefetch(gate_cur.rows[j], gate_cur.bytes);
            pi_prefetch(wt_cur.rows[j], wt_cur.bytes);
        }
        for (int32_t k = k_lo; k < k_hi; k += PI_ROWS_MAX) {
            const int kn = up_cur.k;
            const struct pi_next_rows up_nxt = next_rows(up, idx, k + PI_ROWS_MAX, k_hi, 0, 0);
            const struct pi_next_rows wt_nxt = next_rows(wt, idx, k + PI_ROWS_MAX, k_hi, 0, 0);
            const struct pi_next_rows gate_nxt = gate ? next_rows(gate, idx, k + PI_ROWS_MAX, k_hi, 0, 0)
                                                      : (struct pi_next_rows) { .k = 0 };
            for (int64_t t = 0; t < n_tok; ++t) {
                const bool last = t == n_tok - 1;  // the prefetches go with the last token's pass
                float u[PI_ROWS_MAX], g[PI_ROWS_MAX] = { 0 };
                pi_rows_dot(up->type, up->ne[0], up_cur.rows, kn, (const char *) xq->data + t * xq->nb[1], u,
                            last ? &up_nxt : NULL);
                if (gate) {
                    pi_rows_dot(gate->type, gate->ne[0], gate_cur.rows, kn, (const char *) xg->data + t * xg->nb[1], g,
                                last ? &gate_nxt : NULL);
                }
                float * out = (float *) ((char *) part + t * dst->nb[1]);
                struct axpy_group grp = { .n = 0 };
                for (int j = 0; j < kn; ++j) {
                    if (a) {
                        g[j] = *(const float *) ((const char *) a->data + (size_t) idx[1 + k + j] * a->nb[0] + t * a->nb[1]);
                    }
                    if ((uint32_t) masks[k + j] >> t & 1u) {
                        axpy_push(&grp, wt_cur.rows[j], ffn_h(cfg, g[j], u[j]));
                    }
                }
                if (grp.n == 0 && last) {
                    for (int j = 0; j < wt_nxt.k; ++j) pi_prefetch(wt_nxt.rows[j], wt_nxt.bytes);
                }
                written[t] |= axpy_flush(&grp, wt->type, n_embd, out, last ? &wt_nxt : NULL, !written[t]);
            }
            up_cur = up_nxt;
            gate_cur = gate_nxt;
            wt_cur = wt_nxt;
        }
        for (int64_t t = 0; t < n_tok; ++t) {
            if (!written[t]) memset((char *) part + t * dst->nb[1], 0, (size_t) n_embd * sizeof(float));
        }
    }
    if (__atomic_add_fetch(finished, 1, __ATOMIC_ACQ_REL) == nth) {
        __atomic_store_n(claimed, 0, __ATOMIC_RELAXED);
        __atomic_store_n(finished, 0, __ATOMIC_RELEASE);
    }
}

// src: partials, idx. dst: F32 [n_embd, T] = the partials of the chunks in use added in
// chunk order; threads own slices of columns.
static void sum_chunks_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * part = dst->src[0];
    const int32_t n_active = ((const int32_t *) dst->src[1]->data)[0];
    const int32_t chunk = ffn_chunk_size(n_active);
    const int32_t n_chunks = (n_active + chunk - 1) / chunk;
    const int64_t n_embd = dst->ne[0], n_tok = dst->ne[1];
    const int64_t n_blk = (n_embd + 15) / 16;
    const int64_t e0 = n_blk * ith / nth * 16, e1 = n_blk * (ith + 1) / nth * 16 < n_embd ? n_blk * (ith + 1) / nth * 16 : n_embd;
    if (e1 <= e0) {
        return;
    }
    for (int64_t t = 0; t < n_tok; ++t) {
        float * out = (float *) ((char *) dst->data + t * dst->nb[1]);
        if (n_chunks == 0) {
            memset(out + e0, 0, (size_t) (e1 - e0) * sizeof(float));
            continue;
        }
        memcpy(out + e0, (const float *) ((const char *) part->data + t * part->nb[1]) + e0, (size_t) (e1 - e0) * sizeof(float));
        for (int32_t c = 1; c < n_chunks; ++c) {
            const float * p = (const float *) ((const char *) part->data + t * part->nb[1] + (size_t) c * part->nb[2]);
            for (int64_t e = e0; e < e1; ++e) {
                out[e] += p[e];
            }
        }
    }
}

struct ggml_tensor * pi_sparse_ffn(struct ggml_context * ctx, struct ggml_tensor * up, struct ggml_tensor * gate,
                                   struct ggml_tensor * a, struct ggml_tensor * down_t, struct ggml_tensor * xq,
                                   struct ggml_tensor * xg, struct ggml_tensor * idx, enum pi_ffn_act act) {
    const int64_t n_embd = up->ne[0], n_ff = up->ne[1], n_tok = xq->ne[1];
    GGML_ASSERT(!(gate && a) && (unsigned) act < 4);
    GGML_ASSERT(xq->type == ggml_get_type_traits_cpu(up->type)->vec_dot_type && xq->ne[0] == n_embd);
    GGML_ASSERT(!gate || (gate->ne[0] == n_embd && gate->ne[1] == n_ff && xg &&
                          xg->type == ggml_get_type_traits_cpu(gate->type)->vec_dot_type && xg->ne[1] == n_tok));
    GGML_ASSERT(!a || (a->type == GGML_TYPE_F32 && a->ne[0] == n_ff && a->ne[1] == n_tok));
    GGML_ASSERT(down_t->ne[0] == n_embd && down_t->ne[1] == n_ff && n_embd % ggml_blck_size(down_t->type) == 0);
    GGML_ASSERT(idx->type == GGML_TYPE_I32 && idx->ne[0] == PI_INDEX_LEN(n_ff));
    GGML_ASSERT(n_tok <= PI_FFN_MAX_TOKENS);
    const struct pi_ffn_cfg * cfg = &g_ffn_cfgs[act][gate ? 1 : a ? 2 : 0];
    struct ggml_tensor * args[7];
    int n = 0;
    args[n++] = up;
    if (gate) args[n++] = gate;
    if (a) args[n++] = a;
    args[n++] = down_t;
    args[n++] = xq;
    if (gate) args[n++] = xg;
    args[n++] = idx;
    struct ggml_tensor * part = ggml_custom_4d(ctx, GGML_TYPE_F32, n_embd, n_tok, PI_FFN_MAX_CHUNKS, 1, args, n, sparse_ffn_op,
                                               GGML_N_TASKS_MAX, (void *) cfg);
    struct ggml_tensor * sargs[2] = { part, idx };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, n_embd, n_tok, 1, 1, sargs, 2, sum_chunks_op, GGML_N_TASKS_MAX, NULL);
}

// ---- exact top rows of the output matrix (input mode) -----------------------------------

#define PI_HEAD_EXACT_MAX 1024

// Sifts heap[i] down a min-heap of n (value, row) pairs; on equal values the higher row is
// the smaller, so the lower row survives a tie.
static void heap_down(float * v, int32_t * r, int32_t n, int32_t i) {
    for (;;) {
        int32_t m = i;
        const int32_t a = 2 * i + 1, b = a + 1;
        if (a < n && (v[a] < v[m] || (v[a] == v[m] && r[a] > r[m]))) m = a;
        if (b < n && (v[b] < v[m] || (v[b] == v[m] && r[b] > r[m]))) m = b;
        if (m == i) return;
        const float tv = v[i]; v[i] = v[m]; v[m] = tv;
        const int32_t tr = r[i]; r[i] = r[m]; r[m] = tr;
        i = m;
    }
}

// The k largest of y[0, n) by (value, then the lower row), NaN never among them, into
// (v, r) as a min-heap; returns how many (< k only when y holds fewer numbers).
static int32_t top_rows(const float * y, int64_t n_y, int32_t k, float * v, int32_t * r) {
    int32_t n = 0;
    for (int64_t i = 0; i < n_y; ++i) {
        const float yi = y[i];
        if (n < k) {
            if (yi != yi) continue;  // NaN: stays as computed
            v[n] = yi;
            r[n++] = (int32_t) i;
            if (n == k) {  // full: make it a heap
                for (int32_t j = k / 2 - 1; j >= 0; --j) heap_down(v, r, n, j);
            }
        } else if (yi > v[0]) {  // a tie loses to the root: its row is higher
            v[0] = yi;
            r[0] = (int32_t) i;
            heap_down(v, r, n, 0);
        }
    }
    return n;
}

// Two ops: the first finds each token's top rows (a token's whole vocabulary per thread) and
// writes them to a list [T][1 + k] (a count, then the rows: an active list's layout, which
// next_rows reads); the second computes the listed
// rows exactly, PI_ROWS_MAX at a time, the groups of every token dealt out to the threads in
// turn. So with one token both threads share its rows' reads, most of the time, and no
// thread writes a logit while another still reads them to choose its rows.
static void head_top_rows_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const int32_t k = (int32_t) (intptr_t) userdata;
    const struct ggml_tensor * logits = dst->src[0];
    float v[PI_HEAD_EXACT_MAX];
    for (int64_t t = ith; t < logits->ne[1]; t += nth) {
        int32_t * list = (int32_t *) ((char *) dst->data + t * dst->nb[1]);
        list[0] = top_rows((const float *) ((const char *) logits->data + t * logits->nb[1]), logits->ne[0], k, v, list + 1);
    }
}

static void head_exact_rows_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * w = dst->src[1], * xq = dst->src[2], * lists = dst->src[3];
    int64_t g = 0;  // the group's index over every token's list
    for (int64_t t = 0; t < dst->ne[1]; ++t) {
        float * y = (float *) ((char *) dst->data + t * dst->nb[1]);
        const int32_t * list = (const int32_t *) ((const char *) lists->data + t * lists->nb[1]);  // as an active list
        const void * y_q = (const char *) xq->data + t * xq->nb[1];
        for (int32_t j = 0; j < list[0]; j += PI_ROWS_MAX, ++g) {
            if (g % nth != ith) continue;
            const struct pi_next_rows cur = next_rows(w, list, j, list[0], 0, 0);
            // this thread's next group, when it is this token's
            const struct pi_next_rows nxt = next_rows(w, list, j + nth * PI_ROWS_MAX, list[0], 0, 0);
            float res[PI_ROWS_MAX];
            pi_rows_dot(w->type, w->ne[0], cur.rows, cur.k, y_q, res, &nxt);
            for (int q = 0; q < cur.k; ++q) y[list[1 + j + q]] = res[q];
        }
    }
}

struct ggml_tensor * pi_head_exact_top(struct ggml_context * ctx, struct ggml_tensor * logits, struct ggml_tensor * w,
                                       struct ggml_tensor * x, int32_t k) {
    GGML_ASSERT(logits->type == GGML_TYPE_F32 && ggml_is_contiguous(logits) && logits->ne[0] == w->ne[1]);
    GGML_ASSERT(x->type == GGML_TYPE_F32 && x->ne[0] == w->ne[0] && x->ne[1] == logits->ne[1]);
    GGML_ASSERT(k > 0 && k <= PI_HEAD_EXACT_MAX);
    struct ggml_tensor * largs[1] = { logits };
    struct ggml_tensor * lists = ggml_custom_4d(ctx, GGML_TYPE_I32, 1 + (int64_t) k, logits->ne[1], 1, 1, largs, 1,
                                                head_top_rows_op, GGML_N_TASKS_MAX, (void *) (intptr_t) k);
    struct ggml_tensor * args[3] = { w, pi_convert_rows(ctx, x, ggml_get_type_traits_cpu(w->type)->vec_dot_type), lists };
    return ggml_custom_inplace(ctx, logits, args, 3, head_exact_rows_op, GGML_N_TASKS_MAX, NULL);
}
