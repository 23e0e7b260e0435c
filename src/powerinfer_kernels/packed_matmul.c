// packed_matmul.c - the packed Q4_0x16 / Q8_0x16 matmul (see packed_matmul.h).
#include "kernel_variant.h"  // first: this file is built once per ISA level
#include "packed_matmul.h"

#include "ggml-cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
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

// The kernel per level (compile-time: this file is built once per level, kernel_variant.h):
// AVX-512 VNNI (one 512-bit register per chunk), AVX-VNNI and AVX2 (two 256-bit halves of
// 8 rows), NEON dotprod (four quarters of 4 rows); without any, a scalar loop. All of them
// compute each row's integer sum exactly and then the same float operations per block and
// row (fma(sum, d_w * d_x, acc), then the minimum's or the second half's fma; the scalar
// loop calls fmaf), so every level gives the same bits.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PI_PACK_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PI_PACK_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define PI_PACK_NEON 1
#endif

bool pi_pack_available(void) {
#if defined(PI_PACK_VNNI) || defined(PI_PACK_AVX2) || defined(PI_PACK_NEON)
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

#ifdef PI_PACK_AVX2
// group_tile on 256-bit registers: acc[j][h] lane r = row 8h + r . token j, the same packed
// layout (half h of each 64-byte chunk holds rows 8h .. 8h+7). With AVX-VNNI, vpdpbusd as
// above. With AVX2 alone, vpmaddubsw (unsigned weight byte times signed input byte, pairs
// summed into int16 with saturation) stands in, kept exact by bounding each int16 lane: a
// weight byte u <= 15 (nibbles) makes a pair at most 2 * 15 * 128 = 3840 in size, so eight
// chunks sum in int16 (30720 < 32767) before one vpmaddwd widens them; 5-bit weights (<= 31)
// sum four chunks, 6-bit (<= 63) two; Q8's bytes (<= 255) split into their nibbles,
// u = 16 h + l, each summed over the eight chunks, then vpmaddwd by 16 and by 1. The row
// sums are the exact integers vpdpbusd gives, and the float operations are AVX-512's.
static inline __attribute__((always_inline)) void group_tile2(enum pi_pack_type pt, const uint8_t * wg, int64_t n_blocks,
                                                              const struct xq_block * const * xb, const int nt,
                                                              __m256 (*out)[2]) {
    const size_t gbb = group_block_bytes(pt), head = group_head_bytes(pt);
    const bool q4 = nibbles(pt), with_min = pt == PI_PACK_Q41 || pt == PI_PACK_Q4F, f32 = pt == PI_PACK_Q4F || pt == PI_PACK_Q6F;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
#if !defined(__AVXVNNI__)
    const __m256i ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
#endif
    __m256 acc[TILE_T][2];
    for (int j = 0; j < nt; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    const uint8_t * blk = wg;
    for (int64_t b = 0; b < n_blocks; ++b, blk += gbb) {
        for (int h = 0; h < 2; ++h) {
            const __m256 dw = f32 ? _mm256_loadu_ps((const float *) blk + 8 * h)
                                  : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) ((const ggml_fp16_t *) blk + 8 * h)));
            const __m256 mw = !with_min && pt != PI_PACK_Q6F ? _mm256_setzero_ps()
                            : f32 ? _mm256_loadu_ps((const float *) blk + PI_PACK_ROWS + 8 * h)
                                  : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) ((const ggml_fp16_t *) blk + PI_PACK_ROWS + 8 * h)));
            const uint8_t * wc = blk + head + 32 * h;  // chunk c's half: wc + 64 c
            __m256i wq[8];  // as in group_tile; Q8 without VNNI: the low nibbles, wh the high ones
#if !defined(__AVXVNNI__)
            __m256i wh[8];
#endif
            if (q4) {
                for (int c = 0; c < 4; ++c) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *) (wc + c * 64));
                    wq[c]     = _mm256_and_si256(raw, m4);
                    wq[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
                }
            } else {
                for (int c = 0; c < 8; ++c) wq[c] = _mm256_loadu_si256((const __m256i *) (wc + c * 64));
#if !defined(__AVXVNNI__)
                if (pt == PI_PACK_Q8) {
                    for (int c = 0; c < 8; ++c) {
                        wh[c] = _mm256_and_si256(_mm256_srli_epi16(wq[c], 4), m4);
                        wq[c] = _mm256_and_si256(wq[c], m4);
                    }
                }
#endif
            }
            for (int j = 0; j < nt; ++j) {
                const struct xq_block * x = xb[j] + b;
                const int32_t * x4 = (const int32_t *) x->q;
                const __m256 dx = _mm256_set1_ps(x->d);
#if defined(__AVXVNNI__)
#define PI_DP(acc, c) _mm256_dpbusd_avx_epi32(acc, wq[c], _mm256_set1_epi32(x4[c]))
                if (pt == PI_PACK_Q6F) {
                    __m256i lo = _mm256_set1_epi32(-32 * x->s_lo), hi = _mm256_set1_epi32(-32 * x->s_hi);
                    for (int c = 0; c < 4; ++c) lo = PI_DP(lo, c);
                    for (int c = 4; c < 8; ++c) hi = PI_DP(hi, c);
                    acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(dw, dx), acc[j][h]);
                    acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(mw, dx), acc[j][h]);
                    continue;
                }
                __m256i p0 = _mm256_set1_epi32(x->corr), p1 = _mm256_setzero_si256();
                for (int c = 0; c < 4; ++c) p0 = PI_DP(p0, c);
                for (int c = 4; c < 8; ++c) p1 = PI_DP(p1, c);
                const __m256i p = _mm256_add_epi32(p0, p1);
#undef PI_DP
#else
#define PI_MB(w, c) _mm256_maddubs_epi16(w[c], _mm256_set1_epi32(x4[c]))
                if (pt == PI_PACK_Q6F) {  // two chunks per int16 sum
                    const __m256i lo = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(PI_MB(wq, 0), PI_MB(wq, 1)), ones),
                                                        _mm256_madd_epi16(_mm256_add_epi16(PI_MB(wq, 2), PI_MB(wq, 3)), ones));
                    const __m256i hi = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(PI_MB(wq, 4), PI_MB(wq, 5)), ones),
                                                        _mm256_madd_epi16(_mm256_add_epi16(PI_MB(wq, 6), PI_MB(wq, 7)), ones));
                    const __m256i lo32 = _mm256_add_epi32(lo, _mm256_set1_epi32(-32 * x->s_lo));
                    const __m256i hi32 = _mm256_add_epi32(hi, _mm256_set1_epi32(-32 * x->s_hi));
                    acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo32), _mm256_mul_ps(dw, dx), acc[j][h]);
                    acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi32), _mm256_mul_ps(mw, dx), acc[j][h]);
                    continue;
                }
                __m256i p;
                if (pt == PI_PACK_Q5) {  // four chunks per int16 sum
                    __m256i s0 = PI_MB(wq, 0), s1 = PI_MB(wq, 4);
                    for (int c = 1; c < 4; ++c) {
                        s0 = _mm256_add_epi16(s0, PI_MB(wq, c));
                        s1 = _mm256_add_epi16(s1, PI_MB(wq, c + 4));
                    }
                    p = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
                } else if (pt == PI_PACK_Q8) {  // nibbles: eight chunks per int16 sum, each
                    __m256i sl = PI_MB(wq, 0), sh = PI_MB(wh, 0);
                    for (int c = 1; c < 8; ++c) {
                        sl = _mm256_add_epi16(sl, PI_MB(wq, c));
                        sh = _mm256_add_epi16(sh, PI_MB(wh, c));
                    }
                    p = _mm256_add_epi32(_mm256_madd_epi16(sh, sixteen), _mm256_madd_epi16(sl, ones));
                } else {  // Q4, Q41, Q4F: eight chunks of nibbles
                    __m256i s0 = PI_MB(wq, 0);
                    for (int c = 1; c < 8; ++c) s0 = _mm256_add_epi16(s0, PI_MB(wq, c));
                    p = _mm256_madd_epi16(s0, ones);
                }
                p = _mm256_add_epi32(p, _mm256_set1_epi32(x->corr));
#undef PI_MB
#endif
                acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, dx), acc[j][h]);
                if (with_min) acc[j][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x->ds), acc[j][h]);
            }
        }
    }
    for (int j = 0; j < nt; ++j) {
        out[j][0] = acc[j][0];
        out[j][1] = acc[j][1];
    }
}

#define PI_TILE_NT(PT)                                                          \
    switch (nt) {                                                               \
        case 1:  group_tile2(PT, wg, n_blocks, xb, 1, acc); break;              \
        case 2:  group_tile2(PT, wg, n_blocks, xb, 2, acc); break;              \
        case 3:  group_tile2(PT, wg, n_blocks, xb, 3, acc); break;              \
        default: group_tile2(PT, wg, n_blocks, xb, TILE_T, acc); break;         \
    }

static void group_tile_any(enum pi_pack_type pt, const uint8_t * wg, int64_t n_blocks, const struct xq_block * const * xb,
                           int nt, __m256 (*acc)[2]) {
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

#ifdef PI_PACK_NEON
// group_tile on 128-bit registers: acc[j][qr] lane r = row 4 qr + r . token j (quarter qr of
// each chunk holds rows 4 qr .. 4 qr + 3). sdot multiplies signed bytes: nibbles and the 5-
// and 6-bit weights (< 128) are the same bytes signed; Q8's w + 128 goes back to w by xor
// 0x80, whose sum is then sum(w x) itself, which is corr + sum((w + 128) x): the same integer.
static inline __attribute__((always_inline)) void group_tile4(enum pi_pack_type pt, const uint8_t * wg, int64_t n_blocks,
                                                              const struct xq_block * const * xb, const int nt,
                                                              float32x4_t (*out)[4]) {
    const size_t gbb = group_block_bytes(pt), head = group_head_bytes(pt);
    const bool q4 = nibbles(pt), with_min = pt == PI_PACK_Q41 || pt == PI_PACK_Q4F, f32 = pt == PI_PACK_Q4F || pt == PI_PACK_Q6F;
    const uint8x16_t m4 = vdupq_n_u8(0x0F), sign = vdupq_n_u8(0x80);
    float32x4_t acc[TILE_T][4];
    for (int j = 0; j < nt; ++j) {
        for (int qr = 0; qr < 4; ++qr) acc[j][qr] = vdupq_n_f32(0.0f);
    }
    const uint8_t * blk = wg;
    for (int64_t b = 0; b < n_blocks; ++b, blk += gbb) {
        for (int qr = 0; qr < 4; ++qr) {
            const float32x4_t dw = f32 ? vld1q_f32((const float *) blk + 4 * qr)
                                       : vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *) blk + 4 * qr)));
            const float32x4_t mw = !with_min && pt != PI_PACK_Q6F ? vdupq_n_f32(0.0f)
                                 : f32 ? vld1q_f32((const float *) blk + PI_PACK_ROWS + 4 * qr)
                                       : vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *) blk + PI_PACK_ROWS + 4 * qr)));
            const uint8_t * wc = blk + head + 16 * qr;  // chunk c's quarter: wc + 64 c
            int8x16_t wq[8];
            if (q4) {
                for (int c = 0; c < 4; ++c) {
                    const uint8x16_t raw = vld1q_u8(wc + c * 64);
                    wq[c]     = vreinterpretq_s8_u8(vandq_u8(raw, m4));
                    wq[c + 4] = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
                }
            } else {
                for (int c = 0; c < 8; ++c) {
                    const uint8x16_t raw = vld1q_u8(wc + c * 64);
                    wq[c] = vreinterpretq_s8_u8(pt == PI_PACK_Q8 ? veorq_u8(raw, sign) : raw);
                }
            }
            for (int j = 0; j < nt; ++j) {
                const struct xq_block * x = xb[j] + b;
                const int8x16_t xlo = vld1q_s8(x->q), xhi = vld1q_s8(x->q + 16);
                const float32x4_t dx = vdupq_n_f32(x->d);
#define PI_DOT4(acc, w, xv)                                                                                   \
    vdotq_laneq_s32(vdotq_laneq_s32(vdotq_laneq_s32(vdotq_laneq_s32(acc, w[0], xv, 0), w[1], xv, 1), w[2], xv, 2), \
                    w[3], xv, 3)
                if (pt == PI_PACK_Q6F) {
                    const int32x4_t lo = PI_DOT4(vdupq_n_s32(-32 * x->s_lo), wq, xlo);
                    const int32x4_t hi = PI_DOT4(vdupq_n_s32(-32 * x->s_hi), (wq + 4), xhi);
                    acc[j][qr] = vfmaq_f32(acc[j][qr], vcvtq_f32_s32(lo), vmulq_f32(dw, dx));
                    acc[j][qr] = vfmaq_f32(acc[j][qr], vcvtq_f32_s32(hi), vmulq_f32(mw, dx));
                    continue;
                }
                const int32x4_t p0 = PI_DOT4(vdupq_n_s32(pt == PI_PACK_Q8 ? 0 : x->corr), wq, xlo);
                const int32x4_t p1 = PI_DOT4(vdupq_n_s32(0), (wq + 4), xhi);
#undef PI_DOT4
                const int32x4_t p = vaddq_s32(p0, p1);
                acc[j][qr] = vfmaq_f32(acc[j][qr], vcvtq_f32_s32(p), vmulq_f32(dw, dx));
                if (with_min) acc[j][qr] = vfmaq_f32(acc[j][qr], mw, vdupq_n_f32(x->ds));
            }
        }
    }
    for (int j = 0; j < nt; ++j) {
        for (int qr = 0; qr < 4; ++qr) out[j][qr] = acc[j][qr];
    }
}

#define PI_TILE_NT(PT)                                                          \
    switch (nt) {                                                               \
        case 1:  group_tile4(PT, wg, n_blocks, xb, 1, acc); break;              \
        case 2:  group_tile4(PT, wg, n_blocks, xb, 2, acc); break;              \
        case 3:  group_tile4(PT, wg, n_blocks, xb, 3, acc); break;              \
        default: group_tile4(PT, wg, n_blocks, xb, TILE_T, acc); break;         \
    }

static void group_tile_any(enum pi_pack_type pt, const uint8_t * wg, int64_t n_blocks, const struct xq_block * const * xb,
                           int nt, float32x4_t (*acc)[4]) {
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
#elif defined(PI_PACK_AVX2)
            __m256 acc[TILE_T][2];
            group_tile_any(pt, wg, n_blocks, xb, nt, acc);
            for (int j = 0; j < nt; ++j) {
                float * o = (float *) ((char *) dst->data + (t0 + j) * dst->nb[1]) + g * PI_PACK_ROWS;
                _mm256_storeu_ps(o, acc[j][0]);
                _mm256_storeu_ps(o + 8, acc[j][1]);
            }
#elif defined(PI_PACK_NEON)
            float32x4_t acc[TILE_T][4];
            group_tile_any(pt, wg, n_blocks, xb, nt, acc);
            for (int j = 0; j < nt; ++j) {
                float * o = (float *) ((char *) dst->data + (t0 + j) * dst->nb[1]) + g * PI_PACK_ROWS;
                for (int qr = 0; qr < 4; ++qr) vst1q_f32(o + 4 * qr, acc[j][qr]);
            }
#else
            // Scalar: the same integer sums and per-block fmas, for builds without a kernel.
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
                            out[r] = fmaf((float) lo, f[r] * x->d, out[r]);
                            out[r] = fmaf((float) hi, f[PI_PACK_ROWS + r] * x->d, out[r]);
                            continue;
                        }
                        int32_t s = x->corr;
                        for (int k = 0; k < QK; ++k) s += packed_weight(q4, blk + head, r, k) * x->q[k];
                        out[r] = fmaf((float) s, (f32 ? f[r] : ggml_fp16_to_fp32(d[r])) * x->d, out[r]);
                        if (pt == PI_PACK_Q41) out[r] = fmaf(ggml_fp16_to_fp32(d[PI_PACK_ROWS + r]), x->ds, out[r]);
                        if (pt == PI_PACK_Q4F) out[r] = fmaf(f[PI_PACK_ROWS + r], x->ds, out[r]);
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
