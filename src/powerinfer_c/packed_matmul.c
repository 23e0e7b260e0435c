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
#define GROUP_BLOCK_BYTES_Q41 (PI_PACK_ROWS * 4 + PI_PACK_ROWS * QK / 2) // 16 fp16 scales + 16 fp16 mins + 16 x 16 bytes
#define GROUP_BLOCK_BYTES_Q4F (PI_PACK_ROWS * 8 + PI_PACK_ROWS * QK / 2) // 16 fp32 scales + 16 fp32 mins + 16 x 16 bytes
#define GROUP_BLOCK_BYTES_Q6F (PI_PACK_ROWS * 8 + PI_PACK_ROWS * QK)     // 2 x 16 fp32 scales + 16 x 32 bytes
#define QK_K 256
#define PACK_MAGIC 0x4b435050  // "PPCK" in op_params[0]: a packed weight

// The file's blocks, as ggml stores them (sizes checked against ggml_type_size).
struct blk_q4_0 { ggml_fp16_t d; uint8_t qs[QK / 2]; };
struct blk_q8_0 { ggml_fp16_t d; int8_t  qs[QK]; };
struct blk_q4_1 { ggml_fp16_t d; ggml_fp16_t m; uint8_t qs[QK / 2]; };
struct blk_q5_0 { ggml_fp16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct blk_q4_K { ggml_fp16_t d; ggml_fp16_t dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; };
struct blk_q6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; ggml_fp16_t d; };

// One quantized input block: Q8_0's scale (as its fp16 rounds it) and values, plus the
// correction for the weights' offset: -bias * sum(q), bias 128 (Q8), 16 (Q5), 8 (Q4) or 0 (Q41),
// and d * sum(q), which Q41's minimums multiply; the sums of q over 0-15 and 16-31 (Q6F's halves).
struct xq_block {
    float   d;
    int32_t corr;
    float   ds;
    int32_t s_lo, s_hi;
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

enum pi_pack_type pi_pack_type_of(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q4_0: return ggml_type_size(type) == sizeof(struct blk_q4_0) ? PI_PACK_Q4 : PI_PACK_NONE;
        case GGML_TYPE_Q4_1: return ggml_type_size(type) == sizeof(struct blk_q4_1) ? PI_PACK_Q41 : PI_PACK_NONE;
        case GGML_TYPE_Q5_0: return ggml_type_size(type) == sizeof(struct blk_q5_0) ? PI_PACK_Q5 : PI_PACK_NONE;
        case GGML_TYPE_Q8_0: return ggml_type_size(type) == sizeof(struct blk_q8_0) ? PI_PACK_Q8 : PI_PACK_NONE;
        case GGML_TYPE_Q4_K: return ggml_type_size(type) == sizeof(struct blk_q4_K) ? PI_PACK_Q4F : PI_PACK_NONE;
        case GGML_TYPE_Q6_K: return ggml_type_size(type) == sizeof(struct blk_q6_K) ? PI_PACK_Q6F : PI_PACK_NONE;
        default:             return PI_PACK_NONE;
    }
}

bool pi_pack_fits(enum ggml_type type, int64_t n_cols, int64_t n_rows) {
    return pi_pack_type_of(type) != PI_PACK_NONE && n_cols % ggml_blck_size(type) == 0 && n_cols > 0 &&
           n_rows % PI_PACK_ROWS == 0 && n_rows > 0;
}

static size_t group_block_bytes(enum pi_pack_type type) {
    switch (type) {
        case PI_PACK_Q4:  return GROUP_BLOCK_BYTES_Q4;
        case PI_PACK_Q41: return GROUP_BLOCK_BYTES_Q41;
        case PI_PACK_Q4F: return GROUP_BLOCK_BYTES_Q4F;
        case PI_PACK_Q6F: return GROUP_BLOCK_BYTES_Q6F;
        default:          return GROUP_BLOCK_BYTES_Q8;  // Q8, Q5
    }
}

// Bytes before a group block's weight chunks: the scales (and minimums).
static size_t group_head_bytes(enum pi_pack_type type) {
    return type == PI_PACK_Q41 ? PI_PACK_ROWS * 4 : type == PI_PACK_Q4F || type == PI_PACK_Q6F ? PI_PACK_ROWS * 8
                                                                                                : PI_PACK_ROWS * 2;
}

// Whether the chunks hold nibbles (else bytes).
static bool nibbles(enum pi_pack_type type) {
    return type == PI_PACK_Q4 || type == PI_PACK_Q41 || type == PI_PACK_Q4F;
}

// One 32-weight block of a K-quant row, decoded exactly: q[32] unsigned, and the fp32 scales
// (Q4_K: one scale and one minimum, weight = scale[0] * q + min; Q6_K: scale[0] for weights
// 0-15, scale[1] for 16-31, weight = scale * (q - 32)). b: the block's index in the row.
static void k_block(enum ggml_type type, const void * row, int64_t b, uint8_t * q, float * scale, float * min) {
    const int64_t sb = b / (QK_K / QK), j = b % (QK_K / QK);  // super-block, 32-weight sub-block in it
    if (type == GGML_TYPE_Q4_K) {
        const struct blk_q4_K * x = (const struct blk_q4_K *) row + sb;
        const uint8_t * s = x->scales;
        uint8_t sc, m;  // ggml's 6-bit scale and minimum of sub-block j
        if (j < 4) {
            sc = s[j] & 63;
            m  = s[j + 4] & 63;
        } else {
            sc = (uint8_t) ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
            m  = (uint8_t) ((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
        }
        *scale = ggml_fp16_to_fp32(x->d) * sc;
        *min   = -(ggml_fp16_to_fp32(x->dmin) * m);
        // sub-blocks 2i and 2i + 1: the low and the high nibbles of qs[32 i .. 32 i + 31]
        const uint8_t * qs = x->qs + 32 * (j / 2);
        for (int l = 0; l < QK; ++l) q[l] = j % 2 ? qs[l] >> 4 : qs[l] & 0x0F;
    } else {
        const struct blk_q6_K * x = (const struct blk_q6_K *) row + sb;
        const int half = (int) j / 4, g = (int) j % 4;  // 128-weight half, then 32-weight group g in it
        const uint8_t * ql = x->ql + 64 * half;
        const uint8_t * qh = x->qh + 32 * half;
        const int8_t *  sc = x->scales + 8 * half;
        const float d = ggml_fp16_to_fp32(x->d);
        for (int l = 0; l < QK; ++l) {  // ggml's Q6_K: weight l + 32 g of the half
            const uint8_t lo = g % 2 ? ql[l + 32] : ql[l];
            const uint8_t lo4 = g < 2 ? lo & 0x0F : lo >> 4;
            q[l] = (uint8_t) (lo4 | (((qh[l] >> (2 * g)) & 3) << 4));
        }
        scale[0] = d * sc[2 * g];
        scale[1] = d * sc[2 * g + 1];
        *min = 0.0f;
    }
}

struct ggml_tensor * pi_pack_tensor(struct ggml_context * ctx, enum pi_pack_type type, int64_t n_rows, int64_t n_cols) {
    GGML_ASSERT(type >= PI_PACK_Q4 && type <= PI_PACK_Q6F && n_rows % PI_PACK_ROWS == 0 &&
                n_cols % QK == 0);
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
    const enum pi_pack_type pt = pi_pack_type_of(type);
    GGML_ASSERT(pt != PI_PACK_NONE);
    const bool q4 = pt == PI_PACK_Q4;
    const size_t gbb = group_block_bytes(pt);
    for (int64_t r0 = r_begin; r0 < r_end; r0 += PI_PACK_ROWS) {
        uint8_t * g = (uint8_t *) dst + (size_t) (r0 / PI_PACK_ROWS) * (size_t) nb * gbb;
        for (int64_t b = 0; b < nb; ++b, g += gbb) {
            ggml_fp16_t * d = (ggml_fp16_t *) g;
            uint8_t *     w = g + group_head_bytes(pt);
            for (int r = 0; r < PI_PACK_ROWS; ++r) {
                const char * row = (const char *) src + (size_t) (r0 + r) * row_stride;
                if (pt == PI_PACK_Q4F || pt == PI_PACK_Q6F) {
                    uint8_t q[QK];
                    float scale[2] = { 0.0f, 0.0f }, min = 0.0f;
                    k_block(type, row, b, q, scale, &min);
                    float * f = (float *) g;
                    if (pt == PI_PACK_Q4F) {
                        f[r]                = scale[0];
                        f[PI_PACK_ROWS + r] = min;
                        for (int k = 0; k < QK / 2; ++k) {
                            w[(k / 4) * 64 + r * 4 + (k % 4)] = (uint8_t) (q[k] | (q[k + 16] << 4));
                        }
                    } else {
                        f[r]                = scale[0];
                        f[PI_PACK_ROWS + r] = scale[1];
                        for (int k = 0; k < QK; ++k) w[(k / 4) * 64 + r * 4 + (k % 4)] = q[k];
                    }
                } else if (pt == PI_PACK_Q41) {
                    const struct blk_q4_1 * blk = (const struct blk_q4_1 *) row + b;
                    d[r]                = blk->d;
                    d[PI_PACK_ROWS + r] = blk->m;
                    for (int c = 0; c < 4; ++c) memcpy(w + c * 64 + r * 4, blk->qs + 4 * c, 4);
                } else if (pt == PI_PACK_Q5) {
                    const struct blk_q5_0 * blk = (const struct blk_q5_0 *) row + b;
                    uint32_t qh;
                    memcpy(&qh, blk->qh, sizeof(qh));
                    d[r] = blk->d;
                    for (int k = 0; k < QK / 2; ++k) {  // ggml's Q5_0: bit k of qh tops weight k, bit k + 16 weight k + 16
                        const uint8_t lo = (uint8_t) ((blk->qs[k] & 0x0F) | (((qh >> k) & 1u) << 4));
                        const uint8_t hi = (uint8_t) ((blk->qs[k] >> 4) | (((qh >> (k + 16)) & 1u) << 4));
                        w[(k / 4) * 64 + r * 4 + (k % 4)]               = lo;
                        w[((k + 16) / 4) * 64 + r * 4 + ((k + 16) % 4)] = hi;
                    }
                } else if (q4) {
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
            int32_t lo = 0, hi = 0;
            for (int i = 0; i < QK / 2; ++i) lo += q.qs[i];
            for (int i = QK / 2; i < QK; ++i) hi += q.qs[i];
            out[b].corr = -bias * (lo + hi);
            out[b].ds   = out[b].d * (float) (lo + hi);
            out[b].s_lo = lo;
            out[b].s_hi = hi;
        }
    }
}

#define TILE_T 4  // tokens per tile: each loaded weight chunk serves TILE_T tokens

#ifdef PI_PACK_VNNI
// One group of 16 rows against nt (<= TILE_T) tokens: acc[j] lane r = row r . token j.
// Q41 and Q4F add each row's minimum times d * sum(q) of the token's block after the scaled
// dot product; Q6F sums its two 16-weight halves apart, each with its own scale. Inlined
// with a constant pt and nt (group_tile_any), so each packing and token count compiles to
// its own loop: the token loop unrolls and the accumulators stay in registers (with a
// variable nt they lived on the stack, a store and a load in every block's chain).
// A token's integer sum runs as two chains of four vpdpbusd (halving the latency the
// block waits for); integer sums are exact in any order, so the result is the same.
static inline __attribute__((always_inline)) void group_tile(enum pi_pack_type pt, const uint8_t * wg, int64_t n_blocks,
                                                             const struct xq_block * const * xb, const int nt,
                                                             __m512 * out) {
    const size_t gbb = group_block_bytes(pt), head = group_head_bytes(pt);
    const bool q4 = nibbles(pt), with_min = pt == PI_PACK_Q41 || pt == PI_PACK_Q4F, f32 = pt == PI_PACK_Q4F || pt == PI_PACK_Q6F;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[TILE_T];
    for (int j = 0; j < nt; ++j) acc[j] = _mm512_setzero_ps();
    const uint8_t * blk = wg;
    for (int64_t b = 0; b < n_blocks; ++b, blk += gbb) {
        const __m512 dw = f32 ? _mm512_loadu_ps(blk) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) blk));
        const __m512 mw = !with_min && pt != PI_PACK_Q6F ? _mm512_setzero_ps()
                        : f32 ? _mm512_loadu_ps(blk + PI_PACK_ROWS * 4)  // Q4F: minimums, Q6F: scales of 16-31
                              : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (blk + PI_PACK_ROWS * 2)));
        __m512i wq[8];  // wq[c]: the 16 rows' weights 4c .. 4c+3 (Q4: low nibbles in 0-3, high in 4-7)
        if (q4) {
            for (int c = 0; c < 4; ++c) {
                const __m512i raw = _mm512_loadu_si512(blk + head + c * 64);
                wq[c]     = _mm512_and_si512(raw, m4);
                wq[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
            }
        } else {
            for (int c = 0; c < 8; ++c) wq[c] = _mm512_loadu_si512(blk + head + c * 64);
        }
        for (int j = 0; j < nt; ++j) {
            const struct xq_block * x = xb[j] + b;
            const int32_t * x4 = (const int32_t *) x->q;
            const __m512 dx = _mm512_set1_ps(x->d);
            if (pt == PI_PACK_Q6F) {
                __m512i lo = _mm512_set1_epi32(-32 * x->s_lo), hi = _mm512_set1_epi32(-32 * x->s_hi);
                for (int c = 0; c < 4; ++c) lo = _mm512_dpbusd_epi32(lo, wq[c], _mm512_set1_epi32(x4[c]));
                for (int c = 4; c < 8; ++c) hi = _mm512_dpbusd_epi32(hi, wq[c], _mm512_set1_epi32(x4[c]));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(dw, dx), acc[j]);
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(mw, dx), acc[j]);
                continue;
            }
            __m512i p0 = _mm512_set1_epi32(x->corr), p1 = _mm512_setzero_si512();
            for (int c = 0; c < 4; ++c) p0 = _mm512_dpbusd_epi32(p0, wq[c], _mm512_set1_epi32(x4[c]));
            for (int c = 4; c < 8; ++c) p1 = _mm512_dpbusd_epi32(p1, wq[c], _mm512_set1_epi32(x4[c]));
            const __m512i p = _mm512_add_epi32(p0, p1);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, dx), acc[j]);
            if (with_min) acc[j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x->ds), acc[j]);
        }
    }
    for (int j = 0; j < nt; ++j) out[j] = acc[j];
}

#define PI_TILE_NT(PT)                                                          \
    switch (nt) {                                                               \
        case 1:  group_tile(PT, wg, n_blocks, xb, 1, acc); break;               \
        case 2:  group_tile(PT, wg, n_blocks, xb, 2, acc); break;               \
        case 3:  group_tile(PT, wg, n_blocks, xb, 3, acc); break;               \
        default: group_tile(PT, wg, n_blocks, xb, TILE_T, acc); break;          \
    }

static void group_tile_any(enum pi_pack_type pt, const uint8_t * wg, int64_t n_blocks, const struct xq_block * const * xb,
                           int nt, __m512 * acc) {
    switch (pt) {
        case PI_PACK_Q4:  PI_TILE_NT(PI_PACK_Q4); break;
        case PI_PACK_Q41: PI_TILE_NT(PI_PACK_Q41); break;
        case PI_PACK_Q4F: PI_TILE_NT(PI_PACK_Q4F); break;
        case PI_PACK_Q6F: PI_TILE_NT(PI_PACK_Q6F); break;
        case PI_PACK_Q5:  PI_TILE_NT(PI_PACK_Q5); break;
        default:          PI_TILE_NT(PI_PACK_Q8); break;
    }
}
#undef PI_TILE_NT
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
    const enum pi_pack_type pt = pi_pack_type(w);
    const size_t gbb = group_block_bytes(pt);
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
            group_tile_any(pt, wg, n_blocks, xb, nt, acc);
            for (int j = 0; j < nt; ++j) {
                _mm512_storeu_ps((float *) ((char *) dst->data + (t0 + j) * dst->nb[1]) + g * PI_PACK_ROWS, acc[j]);
            }
#else
            // Scalar: the same integer sums and per-block scaling, for builds without VNNI.
            const bool q4 = nibbles(pt), f32 = pt == PI_PACK_Q4F || pt == PI_PACK_Q6F;
            const size_t head = group_head_bytes(pt);
            for (int j = 0; j < nt; ++j) {
                float * out = (float *) ((char *) dst->data + (t0 + j) * dst->nb[1]) + g * PI_PACK_ROWS;
                for (int r = 0; r < PI_PACK_ROWS; ++r) out[r] = 0.0f;
                const uint8_t * blk = wg;
                for (int64_t b = 0; b < n_blocks; ++b, blk += gbb) {
                    const struct xq_block * x = xb[j] + b;
                    const ggml_fp16_t * d = (const ggml_fp16_t *) blk;
                    const float * f = (const float *) blk;
                    for (int r = 0; r < PI_PACK_ROWS; ++r) {
                        if (pt == PI_PACK_Q6F) {
                            int32_t lo = -32 * x->s_lo, hi = -32 * x->s_hi;
                            for (int k = 0; k < QK / 2; ++k) lo += packed_weight(false, blk + head, r, k) * x->q[k];
                            for (int k = QK / 2; k < QK; ++k) hi += packed_weight(false, blk + head, r, k) * x->q[k];
                            out[r] += (float) lo * (f[r] * x->d);
                            out[r] += (float) hi * (f[PI_PACK_ROWS + r] * x->d);
                            continue;
                        }
                        int32_t s = x->corr;
                        for (int k = 0; k < QK; ++k) s += packed_weight(q4, blk + head, r, k) * x->q[k];
                        out[r] += (float) s * ((f32 ? f[r] : ggml_fp16_to_fp32(d[r])) * x->d);
                        if (pt == PI_PACK_Q41) out[r] += ggml_fp16_to_fp32(d[PI_PACK_ROWS + r]) * x->ds;
                        if (pt == PI_PACK_Q4F) out[r] += f[PI_PACK_ROWS + r] * x->ds;
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
    const enum pi_pack_type pt = pi_pack_type(w);
    // Q6F corrects each half itself (from s_lo, s_hi); Q41 and Q4F have a minimum instead of an offset
    const intptr_t bias = pt == PI_PACK_Q4 ? 8 : pt == PI_PACK_Q5 ? 16 : pt == PI_PACK_Q8 ? 128 : 0;
    struct ggml_tensor * qargs[1] = { x };
    struct ggml_tensor * xq = ggml_custom_4d(ctx, GGML_TYPE_I8, (int64_t) sizeof(struct xq_block) * (n_cols / QK), x->ne[1],
                                             1, 1, qargs, 1, quantize_op, GGML_N_TASKS_MAX, (void *) bias);
    struct ggml_tensor * args[2] = { w, xq };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, pi_pack_rows(w), x->ne[1], 1, 1, args, 2, matmul_op, GGML_N_TASKS_MAX, NULL);
}
