// sparse_ops.c - neuron-aware CPU operators, as ggml custom ops: the FFN computed only
// for active neurons. Any weight type works through ggml's CPU type traits (vec_dot
// for up/gate rows, to_float for down rows). Work is split by active count; every
// output element is written by exactly one thread, in a fixed order, so results do
// not depend on scheduling.
#include "sparse_ops.h"

#include "ggml-cpu.h"

#include <math.h>
#if defined(__SSE__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

// ---- active index ----------------------------------------------------------------

static void active_index_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const struct ggml_tensor * score = dst->src[0];
    struct pi_active_stat * stat = userdata;
    const float threshold = stat->threshold;
    const int64_t n_ff = score->ne[0], n_tok = score->ne[1];
    int32_t * out = (int32_t *) dst->data;
    const uint8_t * skip = stat->skip;
    int32_t n = 0, n_skipped = 0;
    for (int64_t i = 0; i < n_ff; ++i) {
        for (int64_t t = 0; t < n_tok; ++t) {
            const float s = *(const float *) ((const char *) score->data + i * score->nb[0] + t * score->nb[1]);
            if (s > threshold) {
                if (skip && skip[i]) {
                    ++n_skipped;
                } else {
                    out[1 + n++] = (int32_t) i;
                }
                break;
            }
        }
    }
    out[0] = n;
    stat->n_active += n + n_skipped;
    stat->n_total  += n_ff;
}

static void cold_index_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const struct pi_active_stat * stat = userdata;
    const int64_t n_ff = dst->ne[0] - 1;
    int32_t * out = (int32_t *) dst->data;
    int32_t n = 0;
    for (int64_t i = 0; i < n_ff; ++i) {
        if (!stat->skip || !stat->skip[i]) {
            out[1 + n++] = (int32_t) i;
        }
    }
    out[0] = n;
}

struct ggml_tensor * pi_cold_index(struct ggml_context * ctx, struct ggml_tensor * ref, int64_t n_ff, struct pi_active_stat * stat) {
    struct ggml_tensor * args[1] = { ref };
    return ggml_custom_4d(ctx, GGML_TYPE_I32, n_ff + 1, 1, 1, 1, args, 1, cold_index_op, 1, stat);
}

struct ggml_tensor * pi_active_index(struct ggml_context * ctx, struct ggml_tensor * score, struct pi_active_stat * stat) {
    GGML_ASSERT(score->type == GGML_TYPE_F32);
    struct ggml_tensor * args[1] = { score };
    return ggml_custom_4d(ctx, GGML_TYPE_I32, score->ne[0] + 1, 1, 1, 1, args, 1, active_index_op, 1, stat);
}

// ---- activation histogram (calibration) ---------------------------------------------------

static void histogram_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    struct pi_active_stat * stat = userdata;
    const struct ggml_tensor * x = dst->src[0];
    const float scale = PI_HIST_BINS / (PI_HIST_LOG10_MAX - PI_HIST_LOG10_MIN);
    for (int64_t t = 0; t < x->ne[1]; ++t) {
        const float * row = (const float *) ((const char *) x->data + t * x->nb[1]);
        for (int64_t i = 0; i < x->ne[0]; ++i) {
            const float a = fabsf(row[i]);
            int b = a > 0.0f ? (int) ((log10f(a) - PI_HIST_LOG10_MIN) * scale) : 0;
            b = b < 0 ? 0 : b >= PI_HIST_BINS ? PI_HIST_BINS - 1 : b;
            stat->hist[b]++;
        }
    }
}

struct ggml_tensor * pi_activation_histogram(struct ggml_context * ctx, struct ggml_tensor * x, struct pi_active_stat * stat) {
    GGML_ASSERT(x->type == GGML_TYPE_F32 && ggml_is_contiguous(x) && stat->hist);
    struct ggml_tensor * args[1] = { x };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, 1, 1, 1, 1, args, 1, histogram_op, 1, stat);
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

// Software prefetch of the next active row while the current one is computed: the rows
// of a sparse op are scattered, so the hardware prefetchers, which follow streams inside
// a page, restart cold at every row.
#ifndef PI_PREFETCH_ROWS
#define PI_PREFETCH_ROWS 1
#endif
#ifndef PI_PREFETCH_HINT
#define PI_PREFETCH_HINT _MM_HINT_T0
#endif
static inline void prefetch_row(const char * p, size_t n) {
#if defined(__SSE__) && PI_PREFETCH_ROWS > 0
    for (size_t o = 0; o < n; o += 64) {
        _mm_prefetch(p + o, PI_PREFETCH_HINT);
    }
#else
    (void) p; (void) n;
#endif
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
    ggml_vec_dot_t vec_dot = ggml_get_type_traits_cpu(w->type)->vec_dot;

    int32_t k0, k1;
    split_active(n_active, ith, nth, &k0, &k1);
    // Inactive rows are zero. Thread ith owns the rows from its first active row (row 0
    // for thread 0) up to the next thread's first active row (n_ff for the last thread).
    const int64_t r0 = ith == 0 ? 0 : (k0 < n_active ? idx[1 + k0] : n_ff);
    const int64_t r1 = ith == nth - 1 ? n_ff : (k1 < n_active ? idx[1 + k1] : n_ff);
    for (int64_t t = 0; t < n_tok; ++t) {
        float * out = (float *) ((char *) dst->data + t * dst->nb[1]);
        int64_t r = r0;
        for (int32_t k = k0; k < k1; ++k) {
            const int64_t i = idx[1 + k];
            if (k + PI_PREFETCH_ROWS < k1 && PI_PREFETCH_ROWS > 0) {
                prefetch_row((const char *) w->data + (size_t) idx[1 + k + PI_PREFETCH_ROWS] * w->nb[1], w->nb[1]);
            }
            if (i > r) {
                memset(out + r, 0, (size_t) (i - r) * sizeof(float));
            }
            vec_dot((int) w->ne[0], out + i, 0, (const char *) w->data + i * w->nb[1], 0,
                    (const char *) xq->data + t * xq->nb[1], 0, 1);
            r = i + 1;
        }
        if (r1 > r) {
            memset(out + r, 0, (size_t) (r1 - r) * sizeof(float));
        }
    }
}

struct ggml_tensor * pi_sparse_matvec(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * xq,
                                      struct ggml_tensor * idx) {
    GGML_ASSERT(xq->type == ggml_get_type_traits_cpu(w->type)->vec_dot_type);
    GGML_ASSERT(w->ne[0] == xq->ne[0] && idx->type == GGML_TYPE_I32 && idx->ne[0] == w->ne[1] + 1);
    struct ggml_tensor * args[3] = { w, xq, idx };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], xq->ne[1], 1, 1, args, 3, sparse_matvec_op, GGML_N_TASKS_MAX, NULL);
}

// ---- sparse AXPY (down, over the rows of ffn_down_t) ---------------------------------

static _Thread_local float * g_row_buf;
static _Thread_local size_t  g_row_cap;

static float * row_buffer(size_t n) {
    if (n > g_row_cap) {
        float * p = realloc(g_row_buf, n * sizeof(float));
        if (!p) {
            return NULL;
        }
        g_row_buf = p;
        g_row_cap = n;
    }
    return g_row_buf;
}

// Weight blocks as ggml stores them (the layouts are ggml's file format; sizes are
// checked against ggml_type_size before use).
#define PI_QK 32
struct pi_block_q4_0 { ggml_fp16_t d; uint8_t qs[PI_QK / 2]; };
struct pi_block_q8_0 { ggml_fp16_t d; int8_t  qs[PI_QK]; };

static inline float fp16_to_fp32(ggml_fp16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return ggml_fp16_to_fp32(h);
#endif
}

// out[0, 32*n_blocks) += a * dequantized blocks, fused (decode: one token per row).
// The SIMD versions do per element exactly what the scalar loop does with FMA
// contraction (out = fma(a*d, q, out)), row after row, so results do not depend on
// which one runs or on how rows are paired.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PI_AXPY_SIMD 1
static inline __m512 q4_lo(__m128i q) {
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, _mm_set1_epi8(0x0F)), _mm_set1_epi8(8));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
}
static inline __m512 q4_hi(__m128i q) {
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F)), _mm_set1_epi8(8));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
}

// Two rows at once: out += a0 * w0, then += a1 * w1, per element (one pass over out).
static void axpy2_q4_0(float * restrict out, const struct pi_block_q4_0 * restrict b0, float a0,
                       const struct pi_block_q4_0 * restrict b1, float a1, int64_t n_blocks) {
    for (int64_t b = 0; b < n_blocks; ++b, out += PI_QK) {
        const __m512 d0 = _mm512_set1_ps(a0 * fp16_to_fp32(b0[b].d));
        const __m512 d1 = _mm512_set1_ps(a1 * fp16_to_fp32(b1[b].d));
        const __m128i q0 = _mm_loadu_si128((const __m128i *) b0[b].qs);
        const __m128i q1 = _mm_loadu_si128((const __m128i *) b1[b].qs);
        __m512 o0 = _mm512_loadu_ps(out), o1 = _mm512_loadu_ps(out + 16);
        o0 = _mm512_fmadd_ps(d0, q4_lo(q0), o0);
        o1 = _mm512_fmadd_ps(d0, q4_hi(q0), o1);
        o0 = _mm512_fmadd_ps(d1, q4_lo(q1), o0);
        o1 = _mm512_fmadd_ps(d1, q4_hi(q1), o1);
        _mm512_storeu_ps(out, o0);
        _mm512_storeu_ps(out + 16, o1);
    }
}

static void axpy_q4_0(float * restrict out, const struct pi_block_q4_0 * restrict blk, int64_t n_blocks, float a) {
    for (int64_t b = 0; b < n_blocks; ++b, out += PI_QK) {
        const __m512 d = _mm512_set1_ps(a * fp16_to_fp32(blk[b].d));
        const __m128i q = _mm_loadu_si128((const __m128i *) blk[b].qs);
        _mm512_storeu_ps(out, _mm512_fmadd_ps(d, q4_lo(q), _mm512_loadu_ps(out)));
        _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(d, q4_hi(q), _mm512_loadu_ps(out + 16)));
    }
}

static void axpy_q8_0(float * restrict out, const struct pi_block_q8_0 * restrict blk, int64_t n_blocks, float a) {
    for (int64_t b = 0; b < n_blocks; ++b, out += PI_QK) {
        const __m512 d = _mm512_set1_ps(a * fp16_to_fp32(blk[b].d));
        const __m128i q0 = _mm_loadu_si128((const __m128i *) blk[b].qs);
        const __m128i q1 = _mm_loadu_si128((const __m128i *) (blk[b].qs + 16));
        _mm512_storeu_ps(out, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), _mm512_loadu_ps(out)));
        _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), _mm512_loadu_ps(out + 16)));
    }
}
#else
static void axpy_q4_0(float * restrict out, const struct pi_block_q4_0 * restrict blk, int64_t n_blocks, float a) {
    for (int64_t b = 0; b < n_blocks; ++b, out += PI_QK) {
        const float d = a * fp16_to_fp32(blk[b].d);
        const uint8_t * qs = blk[b].qs;
        for (int j = 0; j < PI_QK / 2; ++j) {
            out[j]              += d * (float) ((qs[j] & 0x0F) - 8);
            out[j + PI_QK / 2]  += d * (float) ((qs[j] >> 4) - 8);
        }
    }
}

static void axpy_q8_0(float * restrict out, const struct pi_block_q8_0 * restrict blk, int64_t n_blocks, float a) {
    for (int64_t b = 0; b < n_blocks; ++b, out += PI_QK) {
        const float d = a * fp16_to_fp32(blk[b].d);
        for (int j = 0; j < PI_QK; ++j) {
            out[j] += d * (float) blk[b].qs[j];
        }
    }
}
#endif

static void axpy_f32(float * restrict out, const float * restrict w, int64_t n, float a) {
    for (int64_t c = 0; c < n; ++c) {
        out[c] += a * w[c];
    }
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
    // Fused dequantize-and-accumulate for the common types; any other type (or a
    // weight row shared by several tokens) is dequantized once with ggml's to_float.
    const bool fused_q4_0 = wt->type == GGML_TYPE_Q4_0 && ggml_type_size(wt->type) == sizeof(struct pi_block_q4_0);
    const bool fused_q8_0 = wt->type == GGML_TYPE_Q8_0 && ggml_type_size(wt->type) == sizeof(struct pi_block_q8_0);
    ggml_to_float_t to_float = wt->type == GGML_TYPE_F32 ? NULL : ggml_get_type_traits(wt->type)->to_float;
    float * row = to_float ? row_buffer((size_t) len) : NULL;
    GGML_ASSERT(!to_float || row);
    const size_t slice_off   = ggml_row_size(wt->type, c0);
    const size_t slice_bytes = ggml_row_size(wt->type, len);
    int32_t k = 0;
#ifdef PI_AXPY_SIMD
    if (n_tok == 1 && fused_q4_0) {
        // Decode: pairs of rows with a nonzero activation share one pass over the slice.
        float * out = (float *) dst->data + c0;
        const struct pi_block_q4_0 * pend = NULL;
        float apend = 0.0f;
        for (; k < n_active; ++k) {
            const int64_t i = idx[1 + k];
            if (k + 2 * PI_PREFETCH_ROWS < n_active && PI_PREFETCH_ROWS > 0) {  // rows go in pairs
                prefetch_row((const char *) wt->data + (size_t) idx[1 + k + 2 * PI_PREFETCH_ROWS] * wt->nb[1] + slice_off,
                             slice_bytes);
            }
            const float a = *(const float *) ((const char *) h->data + i * h->nb[0]);
            if (a == 0.0f) {
                continue;
            }
            const struct pi_block_q4_0 * src = (const struct pi_block_q4_0 *) ((const char *) wt->data + i * wt->nb[1] + slice_off);
            if (!pend) {
                pend  = src;
                apend = a;
                continue;
            }
            axpy2_q4_0(out, pend, apend, src, a, len / PI_QK);
            pend = NULL;
        }
        if (pend) {
            axpy_q4_0(out, pend, len / PI_QK, apend);
        }
    }
#endif
    for (; k < n_active; ++k) {
        const int64_t i = idx[1 + k];
        if (k + PI_PREFETCH_ROWS < n_active && PI_PREFETCH_ROWS > 0) {
            prefetch_row((const char *) wt->data + (size_t) idx[1 + k + PI_PREFETCH_ROWS] * wt->nb[1] + slice_off,
                         slice_bytes);
        }
        const char * src = (const char *) wt->data + i * wt->nb[1] + slice_off;
        const float * w = NULL;
        for (int64_t t = 0; t < n_tok; ++t) {
            const float a = *(const float *) ((const char *) h->data + i * h->nb[0] + t * h->nb[1]);
            if (a == 0.0f) {
                continue;  // ReLU zeros and predicted-but-silent neurons cost nothing here
            }
            float * out = (float *) ((char *) dst->data + t * dst->nb[1]) + c0;
            if (n_tok == 1 && fused_q4_0) {
                axpy_q4_0(out, (const struct pi_block_q4_0 *) src, len / PI_QK, a);
                continue;
            }
            if (n_tok == 1 && fused_q8_0) {
                axpy_q8_0(out, (const struct pi_block_q8_0 *) src, len / PI_QK, a);
                continue;
            }
            if (!w) {
                if (to_float) {
                    to_float(src, row, len);
                    w = row;
                } else {
                    w = (const float *) src;
                }
            }
            axpy_f32(out, w, len, a);
        }
    }
}

struct ggml_tensor * pi_sparse_axpy(struct ggml_context * ctx, struct ggml_tensor * wt, struct ggml_tensor * h,
                                    struct ggml_tensor * idx) {
    GGML_ASSERT(h->type == GGML_TYPE_F32 && h->ne[0] == wt->ne[1]);
    GGML_ASSERT(idx->type == GGML_TYPE_I32 && idx->ne[0] == wt->ne[1] + 1);
    GGML_ASSERT(wt->ne[0] % ggml_blck_size(wt->type) == 0);
    struct ggml_tensor * args[3] = { wt, h, idx };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, wt->ne[0], h->ne[1], 1, 1, args, 3, sparse_axpy_op, GGML_N_TASKS_MAX, NULL);
}
