// packed_matmul.c - the packed Q4_0x16 / Q8_0x16 matmul (see packed_matmul.h).
#include "packed_matmul.h"

#include "ggml-cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE__)
#include <immintrin.h>
#endif

#define QK 32
#define GROUP_BLOCK_BYTES_Q8 (PI_PACK_ROWS * 2 + PI_PACK_ROWS * QK)      // 16 fp16 scales + 16 x 32 bytes
#define GROUP_BLOCK_BYTES_Q4 (PI_PACK_ROWS * 2 + PI_PACK_ROWS * QK / 2)  // 16 fp16 scales + 16 x 16 bytes
#define PACK_MAGIC 0x4b435050  // "PPCK" in op_params[0]: a packed weight

// The file's blocks, as ggml stores them (sizes checked against ggml_type_size).
struct blk_q4_0 { ggml_fp16_t d; uint8_t qs[QK / 2]; };
struct blk_q8_0 { ggml_fp16_t d; int8_t  qs[QK]; };

// One quantized input block: Q8_0's scale (as its fp16 rounds it) and values, plus the
// correction for the weights' offset: -bias * sum(q), bias 128 (Q8) or 8 (Q4).
struct xq_block {
    float   d;
    int32_t corr;
    int8_t  q[QK];
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PI_PACK_VNNI 1
#endif

bool pi_pack_available(void) {
#ifdef PI_PACK_VNNI
    return true;
#else
    return false;
#endif
}

bool pi_pack_fits(enum ggml_type type, int64_t n_cols, int64_t n_rows) {
    const bool q4 = type == GGML_TYPE_Q4_0 && ggml_type_size(type) == sizeof(struct blk_q4_0);
    const bool q8 = type == GGML_TYPE_Q8_0 && ggml_type_size(type) == sizeof(struct blk_q8_0);
    return (q4 || q8) && n_cols % QK == 0 && n_cols > 0 && n_rows % PI_PACK_ROWS == 0 && n_rows > 0;
}

static size_t group_block_bytes(enum pi_pack_type type) {
    return type == PI_PACK_Q4 ? GROUP_BLOCK_BYTES_Q4 : GROUP_BLOCK_BYTES_Q8;
}

struct ggml_tensor * pi_pack_tensor(struct ggml_context * ctx, enum pi_pack_type type, int64_t n_rows, int64_t n_cols) {
    GGML_ASSERT((type == PI_PACK_Q4 || type == PI_PACK_Q8) && n_rows % PI_PACK_ROWS == 0 && n_cols % QK == 0);
    struct ggml_tensor * t = ggml_new_tensor_2d(ctx, GGML_TYPE_I8, n_cols / QK * (int64_t) group_block_bytes(type),
                                                n_rows / PI_PACK_ROWS);
    t->op_params[0] = PACK_MAGIC;
    t->op_params[1] = (int32_t) type;
    return t;
}

enum pi_pack_type pi_pack_type(const struct ggml_tensor * w) {
    GGML_ASSERT(w->type == GGML_TYPE_I8 && w->op_params[0] == PACK_MAGIC);
    return (enum pi_pack_type) w->op_params[1];
}

int64_t pi_pack_rows(const struct ggml_tensor * w) { return w->ne[1] * PI_PACK_ROWS; }
int64_t pi_pack_cols(const struct ggml_tensor * w) { return w->ne[0] / (int64_t) group_block_bytes(pi_pack_type(w)) * QK; }

// ---- packing -----------------------------------------------------------------------------------

void pi_pack_rows_exact(enum ggml_type type, const void * src, size_t row_stride, int64_t n_cols, int64_t r_begin,
                        int64_t r_end, void * dst) {
    const int64_t nb = n_cols / QK;
    const bool q4 = type == GGML_TYPE_Q4_0;
    const size_t gbb = group_block_bytes(q4 ? PI_PACK_Q4 : PI_PACK_Q8);
    for (int64_t r0 = r_begin; r0 < r_end; r0 += PI_PACK_ROWS) {
        uint8_t * g = (uint8_t *) dst + (size_t) (r0 / PI_PACK_ROWS) * (size_t) nb * gbb;
        for (int64_t b = 0; b < nb; ++b, g += gbb) {
            ggml_fp16_t * d = (ggml_fp16_t *) g;
            uint8_t *     w = g + PI_PACK_ROWS * 2;
            for (int r = 0; r < PI_PACK_ROWS; ++r) {
                const char * row = (const char *) src + (size_t) (r0 + r) * row_stride;
                if (q4) {
                    const struct blk_q4_0 * blk = (const struct blk_q4_0 *) row + b;
                    d[r] = blk->d;
                    for (int c = 0; c < 4; ++c) memcpy(w + c * 64 + r * 4, blk->qs + 4 * c, 4);
                } else {
                    const struct blk_q8_0 * blk = (const struct blk_q8_0 *) row + b;
                    d[r] = blk->d;
                    for (int k = 0; k < QK; ++k) w[(k / 4) * 64 + r * 4 + (k % 4)] = (uint8_t) (blk->qs[k] + 128);
                }
            }
        }
    }
}

// Rows of floats as ggml quantizes them to Q8_0 (its SIMD quantize_row: d = amax / 127 as
// fp16, q = round(x / d)), n a multiple of 32; dst: n / 32 blocks.
static void quantize_q8_0(const float * x, struct blk_q8_0 * dst, int64_t n) {
    ggml_get_type_traits_cpu(GGML_TYPE_Q8_0)->from_float(x, dst, n);
}

void pi_pack_q8_group_f32(const float * src, int64_t n_cols, int64_t r0, void * dst) {
    const int64_t nb = n_cols / QK;
    struct blk_q8_0 * rows = malloc(sizeof(struct blk_q8_0) * (size_t) nb * PI_PACK_ROWS);
    GGML_ASSERT(rows);
    for (int r = 0; r < PI_PACK_ROWS; ++r) {
        quantize_q8_0(src + (size_t) r * n_cols, rows + (size_t) r * nb, n_cols);
    }
    pi_pack_rows_exact(GGML_TYPE_Q8_0, rows, sizeof(struct blk_q8_0) * (size_t) nb, n_cols, 0, PI_PACK_ROWS,
                       (uint8_t *) dst + (size_t) (r0 / PI_PACK_ROWS) * (size_t) nb * GROUP_BLOCK_BYTES_Q8);
    free(rows);
}

// ---- the op ---------------------------------------------------------------------------------

// src: x F32 [n_cols, T]. dst: I8 [sizeof(xq_block) * n_blocks, T], one row of blocks per
// token; userdata: the weights' offset (bias) for the correction.
static void quantize_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const int32_t bias = (int32_t) (intptr_t) userdata;
    const struct ggml_tensor * x = dst->src[0];
    const int64_t n_blocks = x->ne[0] / QK;
    for (int64_t t = ith; t < x->ne[1]; t += nth) {
        const float * xr = (const float *) ((const char *) x->data + t * x->nb[1]);
        struct xq_block * out = (struct xq_block *) ((char *) dst->data + t * dst->nb[1]);
        for (int64_t b = 0; b < n_blocks; ++b) {
            struct blk_q8_0 q;
            quantize_q8_0(xr + b * QK, &q, QK);
            out[b].d = ggml_fp16_to_fp32(q.d);
            memcpy(out[b].q, q.qs, QK);
            int32_t s = 0;
            for (int i = 0; i < QK; ++i) s += q.qs[i];
            out[b].corr = -bias * s;
        }
    }
}

#define TILE_T 4  // tokens per tile: each loaded weight chunk serves TILE_T tokens

#ifdef PI_PACK_VNNI
// One group of 16 rows against nt (<= TILE_T) tokens: acc[j] lane r = row r . token j.
static inline void group_tile(bool q4, const uint8_t * wg, int64_t n_blocks, const struct xq_block * const * xb, int nt,
                              __m512 * acc) {
    const size_t gbb = q4 ? GROUP_BLOCK_BYTES_Q4 : GROUP_BLOCK_BYTES_Q8;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < TILE_T; ++j) acc[j] = _mm512_setzero_ps();
    const uint8_t * blk = wg;
    for (int64_t b = 0; b < n_blocks; ++b, blk += gbb) {
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) blk));
        __m512i wq[8];  // wq[c]: the 16 rows' weights 4c .. 4c+3 (Q4: low nibbles in 0-3, high in 4-7)
        if (q4) {
            for (int c = 0; c < 4; ++c) {
                const __m512i raw = _mm512_loadu_si512(blk + PI_PACK_ROWS * 2 + c * 64);
                wq[c]     = _mm512_and_si512(raw, m4);
                wq[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
            }
        } else {
            for (int c = 0; c < 8; ++c) wq[c] = _mm512_loadu_si512(blk + PI_PACK_ROWS * 2 + c * 64);
        }
        for (int j = 0; j < nt; ++j) {
            const struct xq_block * x = xb[j] + b;
            const int32_t * x4 = (const int32_t *) x->q;
            __m512i p = _mm512_set1_epi32(x->corr);
            for (int c = 0; c < 8; ++c) p = _mm512_dpbusd_epi32(p, wq[c], _mm512_set1_epi32(x4[c]));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, _mm512_set1_ps(x->d)), acc[j]);
        }
    }
}
#endif

// The weight of row r, element k of a group's block, as the unsigned byte the kernel uses.
static inline int32_t packed_weight(bool q4, const uint8_t * w, int r, int k) {
    if (!q4) {
        return w[(k / 4) * 64 + r * 4 + k % 4];
    }
    const int kk = k % 16;
    const uint8_t byte = w[(kk / 4) * 64 + r * 4 + kk % 4];
    return k < 16 ? byte & 0x0F : byte >> 4;
}

// src: w packed, xq from quantize_op. dst: F32 [n_rows, T]. Threads take groups of rows.
static void matmul_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * w  = dst->src[0];
    const struct ggml_tensor * xq = dst->src[1];
    const bool q4 = pi_pack_type(w) == PI_PACK_Q4;
    const size_t gbb = group_block_bytes(pi_pack_type(w));
    const int64_t n_groups = w->ne[1], n_blocks = w->ne[0] / (int64_t) gbb, n_tok = dst->ne[1];
    const int64_t g0 = n_groups * ith / nth, g1 = n_groups * (ith + 1) / nth;
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t * wg = (const uint8_t *) w->data + g * w->nb[1];
        for (int64_t t0 = 0; t0 < n_tok; t0 += TILE_T) {
            const int nt = n_tok - t0 < TILE_T ? (int) (n_tok - t0) : TILE_T;
            const struct xq_block * xb[TILE_T];
            for (int j = 0; j < nt; ++j) xb[j] = (const struct xq_block *) ((const char *) xq->data + (t0 + j) * xq->nb[1]);
#ifdef PI_PACK_VNNI
            __m512 acc[TILE_T];
            group_tile(q4, wg, n_blocks, xb, nt, acc);
            for (int j = 0; j < nt; ++j) {
                _mm512_storeu_ps((float *) ((char *) dst->data + (t0 + j) * dst->nb[1]) + g * PI_PACK_ROWS, acc[j]);
            }
#else
            // Scalar: the same integer sums and per-block scaling, for builds without VNNI.
            for (int j = 0; j < nt; ++j) {
                float * out = (float *) ((char *) dst->data + (t0 + j) * dst->nb[1]) + g * PI_PACK_ROWS;
                for (int r = 0; r < PI_PACK_ROWS; ++r) out[r] = 0.0f;
                const uint8_t * blk = wg;
                for (int64_t b = 0; b < n_blocks; ++b, blk += gbb) {
                    const struct xq_block * x = xb[j] + b;
                    const ggml_fp16_t * d = (const ggml_fp16_t *) blk;
                    for (int r = 0; r < PI_PACK_ROWS; ++r) {
                        int32_t s = x->corr;
                        for (int k = 0; k < QK; ++k) s += packed_weight(q4, blk + PI_PACK_ROWS * 2, r, k) * x->q[k];
                        out[r] += (float) s * (ggml_fp16_to_fp32(d[r]) * x->d);
                    }
                }
            }
#endif
        }
    }
}

struct ggml_tensor * pi_packed_matmul(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * x) {
    const int64_t n_cols = pi_pack_cols(w);
    GGML_ASSERT(x->type == GGML_TYPE_F32 && x->ne[0] == n_cols && x->nb[0] == sizeof(float) && x->ne[2] == 1 && x->ne[3] == 1);
    const intptr_t bias = pi_pack_type(w) == PI_PACK_Q4 ? 8 : 128;
    struct ggml_tensor * qargs[1] = { x };
    struct ggml_tensor * xq = ggml_custom_4d(ctx, GGML_TYPE_I8, (int64_t) sizeof(struct xq_block) * (n_cols / QK), x->ne[1],
                                             1, 1, qargs, 1, quantize_op, GGML_N_TASKS_MAX, (void *) bias);
    struct ggml_tensor * args[2] = { w, xq };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, pi_pack_rows(w), x->ne[1], 1, 1, args, 2, matmul_op, GGML_N_TASKS_MAX, NULL);
}
