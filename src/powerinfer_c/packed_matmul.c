// packed_matmul.c - the Q8_0x16 matmul (see packed_matmul.h): weights packed so that one
// 512-bit load holds 4 consecutive weights of 16 output rows, which vpdpbusd multiplies
// with 4 broadcast input bytes into 16 row sums at once.
#include "packed_matmul.h"

#include "ggml-cpu.h"

#include <math.h>
#include <string.h>
#if defined(__SSE__)
#include <immintrin.h>
#endif

#define QK 32
#define GROUP_BLOCK_BYTES (PI_Q8P_ROWS * 2 + PI_Q8P_ROWS * QK)  // 16 fp16 scales + 16 x 32 weights

// One quantized input block: Q8_0's scale and values, plus -128 * sum(q), the correction
// for the weights being stored as w + 128.
struct q8x_block {
    float   d;
    int32_t corr;
    int8_t  q[QK];
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PI_Q8P 1
#endif

bool pi_q8p_available(void) {
#ifdef PI_Q8P
    return true;
#else
    return false;
#endif
}

size_t pi_q8p_nbytes(int64_t n_rows, int64_t n_cols) {
    return (size_t) (n_rows / PI_Q8P_ROWS) * (size_t) (n_cols / QK) * GROUP_BLOCK_BYTES;
}

struct ggml_tensor * pi_q8p_tensor(struct ggml_context * ctx, int64_t n_rows, int64_t n_cols) {
    GGML_ASSERT(n_rows % PI_Q8P_ROWS == 0 && n_cols % QK == 0);
    return ggml_new_tensor_2d(ctx, GGML_TYPE_I8, n_cols / QK * GROUP_BLOCK_BYTES, n_rows / PI_Q8P_ROWS);
}

int64_t pi_q8p_rows(const struct ggml_tensor * w) { return w->ne[1] * PI_Q8P_ROWS; }
int64_t pi_q8p_cols(const struct ggml_tensor * w) { return w->ne[0] / GROUP_BLOCK_BYTES * QK; }

// Q8_0's rounding of one block (ggml's reference: d = amax / 127, q = round(x / d)).
static void quantize_block(const float * x, float * d_out, int8_t * q) {
    float amax = 0.0f;
    for (int i = 0; i < QK; ++i) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
    for (int i = 0; i < QK; ++i) q[i] = (int8_t) roundf(x[i] * id);
    *d_out = d;
}

void pi_q8p_pack_group(const float * src, int64_t n_cols, int64_t r0, void * dst) {
    uint8_t * g = (uint8_t *) dst + (size_t) (r0 / PI_Q8P_ROWS) * (size_t) (n_cols / QK) * GROUP_BLOCK_BYTES;
    for (int64_t b = 0; b < n_cols / QK; ++b, g += GROUP_BLOCK_BYTES) {
        ggml_fp16_t * d = (ggml_fp16_t *) g;
        uint8_t *     w = g + PI_Q8P_ROWS * 2;
        for (int r = 0; r < PI_Q8P_ROWS; ++r) {
            float  dr;
            int8_t q[QK];
            // The block's scale goes through fp16 like Q8_0's, and the values are rounded
            // against the scale as stored.
            quantize_block(src + (size_t) r * n_cols + b * QK, &dr, q);
            d[r] = ggml_fp32_to_fp16(dr);
            for (int k = 0; k < QK; ++k) {
                w[(k / 4) * 64 + r * 4 + (k % 4)] = (uint8_t) (q[k] + 128);
            }
        }
    }
}

// ---- the op ---------------------------------------------------------------------------------

// src: x F32 [n_cols, T]. dst: I8 [sizeof(q8x_block) * n_blocks, T], one row of blocks per token.
static void quantize_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * x = dst->src[0];
    const int64_t n_blocks = x->ne[0] / QK;
    for (int64_t t = ith; t < x->ne[1]; t += nth) {
        const float * xr = (const float *) ((const char *) x->data + t * x->nb[1]);
        struct q8x_block * out = (struct q8x_block *) ((char *) dst->data + t * dst->nb[1]);
        for (int64_t b = 0; b < n_blocks; ++b) {
            quantize_block(xr + b * QK, &out[b].d, out[b].q);
            // Q8_0's scale is stored as fp16: use the same rounded value.
            out[b].d = ggml_fp16_to_fp32(ggml_fp32_to_fp16(out[b].d));
            int32_t s = 0;
            for (int i = 0; i < QK; ++i) s += out[b].q[i];
            out[b].corr = -128 * s;
        }
    }
}

#define TILE_T 4  // tokens per tile: each loaded weight chunk serves TILE_T tokens

// src: w packed, xq from quantize_op. dst: F32 [n_rows, T]. Threads take groups of rows.
static void matmul_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * w  = dst->src[0];
    const struct ggml_tensor * xq = dst->src[1];
    const int64_t n_groups = w->ne[1], n_blocks = w->ne[0] / GROUP_BLOCK_BYTES, n_tok = dst->ne[1];
    const int64_t g0 = n_groups * ith / nth, g1 = n_groups * (ith + 1) / nth;
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t * wg = (const uint8_t *) w->data + g * w->nb[1];
        for (int64_t t0 = 0; t0 < n_tok; t0 += TILE_T) {
            const int nt = n_tok - t0 < TILE_T ? (int) (n_tok - t0) : TILE_T;
            const struct q8x_block * xb[TILE_T];
            for (int j = 0; j < nt; ++j) xb[j] = (const struct q8x_block *) ((const char *) xq->data + (t0 + j) * xq->nb[1]);
#ifdef PI_Q8P
            __m512 acc[TILE_T];
            for (int j = 0; j < TILE_T; ++j) acc[j] = _mm512_setzero_ps();
            const uint8_t * blk = wg;
            for (int64_t b = 0; b < n_blocks; ++b, blk += GROUP_BLOCK_BYTES) {
                const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) blk));
                __m512i wq[8];
                for (int q = 0; q < 8; ++q) wq[q] = _mm512_loadu_si512(blk + PI_Q8P_ROWS * 2 + q * 64);
                for (int j = 0; j < nt; ++j) {
                    const struct q8x_block * x = xb[j] + b;
                    const int32_t * x4 = (const int32_t *) x->q;
                    __m512i p = _mm512_set1_epi32(x->corr);
                    for (int q = 0; q < 8; ++q) p = _mm512_dpbusd_epi32(p, wq[q], _mm512_set1_epi32(x4[q]));
                    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, _mm512_set1_ps(x->d)), acc[j]);
                }
            }
            for (int j = 0; j < nt; ++j) {
                _mm512_storeu_ps((float *) ((char *) dst->data + (t0 + j) * dst->nb[1]) + g * PI_Q8P_ROWS, acc[j]);
            }
#else
            // Scalar: the same integer sums and scaling per block, for builds without VNNI.
            for (int j = 0; j < nt; ++j) {
                float * out = (float *) ((char *) dst->data + (t0 + j) * dst->nb[1]) + g * PI_Q8P_ROWS;
                for (int r = 0; r < PI_Q8P_ROWS; ++r) out[r] = 0.0f;
                const uint8_t * blk = wg;
                for (int64_t b = 0; b < n_blocks; ++b, blk += GROUP_BLOCK_BYTES) {
                    const struct q8x_block * x = xb[j] + b;
                    const ggml_fp16_t * d = (const ggml_fp16_t *) blk;
                    for (int r = 0; r < PI_Q8P_ROWS; ++r) {
                        int32_t s = x->corr;
                        for (int k = 0; k < QK; ++k) s += (int32_t) blk[PI_Q8P_ROWS * 2 + (k / 4) * 64 + r * 4 + k % 4] * x->q[k];
                        out[r] += (float) s * (ggml_fp16_to_fp32(d[r]) * x->d);
                    }
                }
            }
#endif
        }
    }
}

struct ggml_tensor * pi_q8p_matmul(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * x) {
    const int64_t n_cols = pi_q8p_cols(w);
    GGML_ASSERT(w->type == GGML_TYPE_I8 && x->type == GGML_TYPE_F32 && x->ne[0] == n_cols && ggml_is_contiguous(x));
    struct ggml_tensor * qargs[1] = { x };
    struct ggml_tensor * xq = ggml_custom_4d(ctx, GGML_TYPE_I8, (int64_t) sizeof(struct q8x_block) * (n_cols / QK), x->ne[1],
                                             1, 1, qargs, 1, quantize_op, GGML_N_TASKS_MAX, NULL);
    struct ggml_tensor * args[2] = { w, xq };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, pi_q8p_rows(w), x->ne[1], 1, 1, args, 2, matmul_op, GGML_N_TASKS_MAX, NULL);
}
