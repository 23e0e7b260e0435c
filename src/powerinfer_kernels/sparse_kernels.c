// sparse_kernels.c - SIMD dot products and AXPYs over scattered weight rows (see
// sparse_kernels.h). The block layouts below are ggml's file format; their sizes are
// checked against ggml_type_size before a fused kernel is used.
#include "kernel_variant.h"  // first: this file is built once per ISA level
#include "sparse_kernels.h"

#include "ggml-cpu.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#define PI_QK 32
struct pi_block_q4_0 { ggml_fp16_t d; uint8_t qs[PI_QK / 2]; };
struct pi_block_q8_0 { ggml_fp16_t d; int8_t  qs[PI_QK]; };

#if defined(__SSE__)
#ifndef PI_PREFETCH_HINT
#define PI_PREFETCH_HINT _MM_HINT_T1
#endif
#define PI_PREFETCH(p) _mm_prefetch((const char *) (p), PI_PREFETCH_HINT)
#elif defined(__aarch64__)
#define PI_PREFETCH(p) __builtin_prefetch((p), 0, 2)  // PRFM PLDL2KEEP: into L2, as on x86
#endif

void pi_prefetch(const void * p, size_t n) {
#if defined(PI_PREFETCH)
    const char * c = p;
    for (size_t o = 0; o < n; o += 64) {
        PI_PREFETCH(c + o);
    }
#else
    (void) p; (void) n;
#endif
}

// Spreads the prefetch of next's rows over `steps` steps of a loop: step i issues the
// lines up to (i + 1) / steps of each row.
struct prefetcher {
    const struct pi_next_rows * next;
    int64_t lines, steps, done;
};

static inline void pf_init(struct prefetcher * pf, const struct pi_next_rows * next, int64_t steps) {
    pf->next  = next && next->k > 0 ? next : NULL;
    pf->lines = pf->next ? (int64_t) ((next->bytes + 63) / 64) : 0;
    pf->steps = steps > 0 ? steps : 1;
    pf->done  = 0;
}

static inline void pf_step(struct prefetcher * pf, int64_t i) {
#if defined(PI_PREFETCH)
    if (!pf->next) {
        return;
    }
    const int64_t target = (i + 1) * pf->lines / pf->steps;
    for (; pf->done < target; ++pf->done) {
        for (int j = 0; j < pf->next->k; ++j) {
            PI_PREFETCH((const char *) pf->next->rows[j] + pf->done * 64);
        }
    }
#else
    (void) pf; (void) i;
#endif
}

// Whatever of next is not prefetched yet, at once (kernels without a loop of their own).
static inline void pf_rest(struct prefetcher * pf) {
    pf_step(pf, pf->steps - 1);
}

static inline float fp16_to_fp32(ggml_fp16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(__aarch64__)
    __fp16 f;
    memcpy(&f, &h, sizeof(f));
    return (float) f;
#else
    return ggml_fp16_to_fp32(h);
#endif
}

static bool blocks_match(enum ggml_type type) {
    return (type == GGML_TYPE_Q4_0 && ggml_type_size(type) == sizeof(struct pi_block_q4_0)) ||
           (type == GGML_TYPE_Q8_0 && ggml_type_size(type) == sizeof(struct pi_block_q8_0));
}

// ---- dot products ---------------------------------------------------------------------------
//
// VNNI's vpdpbusd multiplies unsigned by signed bytes and adds groups of four into 32-bit
// lanes. Q4_0 weights are nibbles q in [0, 16) standing for q - 8: the kernel feeds q as
// the unsigned bytes and starts each lane at -8 * (sum of its four y), so the lanes hold
// exactly sum((q - 8) * y). Q8_0 weights w are signed: w ^ 0x80 = w + 128 as unsigned,
// with -128 * sum(y) to start. Two blocks fill a 512-bit register: lanes 0-7 belong to the
// first, 8-15 to the second, each scaled by its d_w * d_y before the float accumulation.
//
// The other levels take one block per step, lanes of four products each, summed exactly: AVX-VNNI's 256-bit vpdpbusd as above; AVX2 without it, Q4_0 through
// vpmaddubsw (nibble times y: at most 15 * 128 * 2 per int16 pair, no saturation) then
// vpmaddwd with ones and -8 * sum(y) in int16 pairs, Q8_0 by widening both sides to int16
// and vpmaddwd (exact for any bytes, where vpmaddubsw's sign trick would saturate at
// -128 * -128 pairs); NEON dotprod's sdot on signed bytes (Q4_0 as q - 8). Only the float
// accumulation order differs between levels (lanes per step, the final horizontal sum);
// within a level it is fixed, so results do not depend on threads or batches.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PI_DOT_SIMD 1
#define PI_DOT_BLOCKS 2  // blocks per step: n must be a multiple of PI_DOT_BLOCKS * 32

// Nibbles of two Q4_0 blocks as bytes [lo0 | hi0 | lo1 | hi1] (elements 0-15, 16-31 of each).
static inline __m512i q4_0_pair_u8(const struct pi_block_q4_0 * b) {
    const __m256i q  = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) b[0].qs)),
                                               _mm_loadu_si128((const __m128i *) b[1].qs), 1);
    const __m256i m  = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(q, m);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m);
    const __m512i z  = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // [lo0 lo1 hi0 hi1]
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
}

static inline __m512i q8_0_pair(const struct pi_block_q8_0 * b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) b[0].qs)),
                              _mm256_loadu_si256((const __m256i *) b[1].qs), 1);
}

// [s0 x 8 | s1 x 8] from two fp16 scales.
static inline __m512 scale_pair(ggml_fp16_t d0, ggml_fp16_t d1) {
    const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short) d0)), _mm_set1_epi16((short) d1), 1);
    return _mm512_cvtph_ps(h);
}

// k rows of Q4_0 or Q8_0 (is_q8) against Q8_0 y; nb blocks (even).
static void dot_rows_vnni(bool is_q8, int64_t nb, const void * const * rows, int k, const struct pi_block_q8_0 * y,
                          float * out, struct prefetcher * pf) {
    __m512 acc[PI_ROWS_MAX];
    for (int j = 0; j < k; ++j) acc[j] = _mm512_setzero_ps();
    const __m512i bias = _mm512_set1_epi8(is_q8 ? (char) 0x80 : 8);
    for (int64_t b = 0; b < nb; b += 2) {
        pf_step(pf, b / 2);
        const __m512i yv   = q8_0_pair(y + b);
        const __m512i init = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, yv));
        const __m512  dy   = scale_pair(y[b].d, y[b + 1].d);
        for (int j = 0; j < k; ++j) {
            __m512i w;
            __m512  dw;
            if (is_q8) {
                const struct pi_block_q8_0 * r = (const struct pi_block_q8_0 *) rows[j] + b;
                w  = _mm512_xor_si512(q8_0_pair(r), bias);
                dw = scale_pair(r[0].d, r[1].d);
            } else {
                const struct pi_block_q4_0 * r = (const struct pi_block_q4_0 *) rows[j] + b;
                w  = q4_0_pair_u8(r);
                dw = scale_pair(r[0].d, r[1].d);
            }
            const __m512i p = _mm512_dpbusd_epi32(init, w, yv);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, dy), acc[j]);
        }
    }
    for (int j = 0; j < k; ++j) out[j] = _mm512_reduce_add_ps(acc[j]);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PI_DOT_SIMD 1
#define PI_DOT_BLOCKS 1

// Q4_0's nibbles as 32 unsigned bytes in element order (low nibbles: 0-15, high: 16-31).
static inline __m256i q4_0_u8(const struct pi_block_q4_0 * b) {
    const __m128i q = _mm_loadu_si128((const __m128i *) b->qs);
    return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1),
                            _mm256_set1_epi8(0x0F));
}

// The sum of v's 8 lanes, in one fixed order.
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static void dot_rows_vnni(bool is_q8, int64_t nb, const void * const * rows, int k, const struct pi_block_q8_0 * y,
                          float * out, struct prefetcher * pf) {
    __m256 acc[PI_ROWS_MAX];
    for (int j = 0; j < k; ++j) acc[j] = _mm256_setzero_ps();
    const __m256i bias = _mm256_set1_epi8(is_q8 ? (char) 0x80 : 8);
#if !defined(__AVXVNNI__)
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int64_t b = 0; b < nb; ++b) {
        pf_step(pf, b);
        const __m256i yv = _mm256_loadu_si256((const __m256i *) y[b].qs);
        const float   dy = fp16_to_fp32(y[b].d);
#if defined(__AVXVNNI__)
        const __m256i init = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), bias, yv));
#else
        // Q4_0: 8 * (y pair sums), subtracted in int16 (|(q - 8) y pairs| <= 2048); Q8_0: y as int16.
        const __m256i y8  = is_q8 ? _mm256_setzero_si256() : _mm256_maddubs_epi16(bias, yv);
        const __m256i ylo = is_q8 ? _mm256_cvtepi8_epi16(_mm256_castsi256_si128(yv)) : _mm256_setzero_si256();
        const __m256i yhi = is_q8 ? _mm256_cvtepi8_epi16(_mm256_extracti128_si256(yv, 1)) : _mm256_setzero_si256();
#endif
        for (int j = 0; j < k; ++j) {
            __m256i p;
            float   dw;
            if (is_q8) {
                const struct pi_block_q8_0 * r = (const struct pi_block_q8_0 *) rows[j] + b;
#if defined(__AVXVNNI__)
                p = _mm256_dpbusd_avx_epi32(init, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *) r->qs), bias), yv);
#else
                // lane i: elements 2i, 2i+1 (first half) plus 16+2i, 16+2i+1: four products, as VNNI's lanes hold four
                const __m256i wlo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) r->qs));
                const __m256i whi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) (r->qs + 16)));
                p = _mm256_add_epi32(_mm256_madd_epi16(wlo, ylo), _mm256_madd_epi16(whi, yhi));
#endif
                dw = fp16_to_fp32(r->d);
            } else {
                const struct pi_block_q4_0 * r = (const struct pi_block_q4_0 *) rows[j] + b;
#if defined(__AVXVNNI__)
                p = _mm256_dpbusd_avx_epi32(init, q4_0_u8(r), yv);
#else
                p = _mm256_madd_epi16(_mm256_sub_epi16(_mm256_maddubs_epi16(q4_0_u8(r), yv), y8), ones);
#endif
                dw = fp16_to_fp32(r->d);
            }
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * dy), acc[j]);
        }
    }
    for (int j = 0; j < k; ++j) out[j] = hsum8(acc[j]);
}

#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define PI_DOT_SIMD 1
#define PI_DOT_BLOCKS 1

static void dot_rows_vnni(bool is_q8, int64_t nb, const void * const * rows, int k, const struct pi_block_q8_0 * y,
                          float * out, struct prefetcher * pf) {
    float32x4_t acc[PI_ROWS_MAX];
    for (int j = 0; j < k; ++j) acc[j] = vdupq_n_f32(0.0f);
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    const int8x16_t  s8 = vdupq_n_s8(8);
    for (int64_t b = 0; b < nb; ++b) {
        pf_step(pf, b);
        const int8x16_t y0 = vld1q_s8(y[b].qs), y1 = vld1q_s8(y[b].qs + 16);
        const float     dy = fp16_to_fp32(y[b].d);
        for (int j = 0; j < k; ++j) {
            int8x16_t w0, w1;
            float     dw;
            if (is_q8) {
                const struct pi_block_q8_0 * r = (const struct pi_block_q8_0 *) rows[j] + b;
                w0 = vld1q_s8(r->qs);
                w1 = vld1q_s8(r->qs + 16);
                dw = fp16_to_fp32(r->d);
            } else {
                const struct pi_block_q4_0 * r = (const struct pi_block_q4_0 *) rows[j] + b;
                const uint8x16_t q = vld1q_u8(r->qs);
                w0 = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(q, m4)), s8);
                w1 = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(q, 4)), s8);
                dw = fp16_to_fp32(r->d);
            }
            const int32x4_t p = vdotq_s32(vdotq_s32(vdupq_n_s32(0), w0, y0), w1, y1);
            acc[j] = vfmaq_f32(acc[j], vcvtq_f32_s32(p), vdupq_n_f32(dw * dy));
        }
    }
    for (int j = 0; j < k; ++j) out[j] = vaddvq_f32(acc[j]);
}
#endif

void pi_rows_dot(enum ggml_type type, int64_t n, const void * const * rows, int k, const void * y, float * out,
                 const struct pi_next_rows * next) {
    struct prefetcher pf;
#ifdef PI_DOT_SIMD
    if (blocks_match(type) && n % (PI_DOT_BLOCKS * PI_QK) == 0) {
        pf_init(&pf, next, n / PI_QK / PI_DOT_BLOCKS);
        dot_rows_vnni(type == GGML_TYPE_Q8_0, n / PI_QK, rows, k, (const struct pi_block_q8_0 *) y, out, &pf);
        return;
    }
#endif
    pf_init(&pf, next, 1);
    pf_rest(&pf);
    ggml_vec_dot_t vec_dot = ggml_get_type_traits_cpu(type)->vec_dot;
    for (int j = 0; j < k; ++j) {
        vec_dot((int) n, out + j, 0, rows[j], 0, y, 0, 1);
    }
}

// ---- AXPY -------------------------------------------------------------------------------
//
// Per element and row: out = fma(a * d, q, out) with q the weight's integer value, rows
// in order; the SIMD and scalar versions do the same per element, so every level (AVX-512,
// AVX2, NEON, scalar) gives the same bits.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PI_AXPY_SIMD 1

static void axpy_rows_q4_0(int64_t nb, const void * const * rows, const float * a, int k, float * out,
                           struct prefetcher * pf, bool init) {
    // vpermps looks the nibble up in [-8 .. 7]: the dequantized integer as a float.
    const __m512  lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i m   = _mm512_set1_epi32(0x0F);
    for (int64_t b = 0; b < nb; ++b, out += PI_QK) {
        pf_step(pf, b);
        __m512 o0 = init ? _mm512_setzero_ps() : _mm512_loadu_ps(out), o1 = init ? _mm512_setzero_ps() : _mm512_loadu_ps(out + 16);
        for (int j = 0; j < k; ++j) {
            const struct pi_block_q4_0 * blk = (const struct pi_block_q4_0 *) rows[j] + b;
            const __m512  s  = _mm512_set1_ps(a[j] * fp16_to_fp32(blk->d));
            const __m512i qd = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) blk->qs));
            o0 = _mm512_fmadd_ps(s, _mm512_permutexvar_ps(_mm512_and_si512(qd, m), lut), o0);
            o1 = _mm512_fmadd_ps(s, _mm512_permutexvar_ps(_mm512_srli_epi32(qd, 4), lut), o1);
        }
        _mm512_storeu_ps(out, o0);
        _mm512_storeu_ps(out + 16, o1);
    }
}

static void axpy_rows_q8_0(int64_t nb, const void * const * rows, const float * a, int k, float * out,
                           struct prefetcher * pf, bool init) {
    for (int64_t b = 0; b < nb; ++b, out += PI_QK) {
        pf_step(pf, b);
        __m512 o0 = init ? _mm512_setzero_ps() : _mm512_loadu_ps(out), o1 = init ? _mm512_setzero_ps() : _mm512_loadu_ps(out + 16);
        for (int j = 0; j < k; ++j) {
            const struct pi_block_q8_0 * blk = (const struct pi_block_q8_0 *) rows[j] + b;
            const __m512 s = _mm512_set1_ps(a[j] * fp16_to_fp32(blk->d));
            const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) blk->qs)));
            const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (blk->qs + 16))));
            o0 = _mm512_fmadd_ps(s, q0, o0);
            o1 = _mm512_fmadd_ps(s, q1, o1);
        }
        _mm512_storeu_ps(out, o0);
        _mm512_storeu_ps(out + 16, o1);
    }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PI_AXPY_SIMD 1

// One block's 32 outputs in four registers; each row's integers widened to int32 and
// converted exactly (q - 8 for Q4_0's nibbles), then one fma per element, rows in order.
static void axpy_rows_q4_0(int64_t nb, const void * const * rows, const float * a, int k, float * out,
                           struct prefetcher * pf, bool init) {
    const __m256i m = _mm256_set1_epi32(0x0F), eight = _mm256_set1_epi32(8);
    for (int64_t b = 0; b < nb; ++b, out += PI_QK) {
        pf_step(pf, b);
        __m256 o[4];
        for (int i = 0; i < 4; ++i) o[i] = init ? _mm256_setzero_ps() : _mm256_loadu_ps(out + 8 * i);
        for (int j = 0; j < k; ++j) {
            const struct pi_block_q4_0 * blk = (const struct pi_block_q4_0 *) rows[j] + b;
            const __m256  s  = _mm256_set1_ps(a[j] * fp16_to_fp32(blk->d));
            const __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) blk->qs));        // bytes 0-7
            const __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (blk->qs + 8)));  // bytes 8-15
            o[0] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q0, m), eight)), o[0]);
            o[1] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q1, m), eight)), o[1]);
            o[2] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(q0, 4), eight)), o[2]);
            o[3] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(q1, 4), eight)), o[3]);
        }
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, o[i]);
    }
}

static void axpy_rows_q8_0(int64_t nb, const void * const * rows, const float * a, int k, float * out,
                           struct prefetcher * pf, bool init) {
    for (int64_t b = 0; b < nb; ++b, out += PI_QK) {
        pf_step(pf, b);
        __m256 o[4];
        for (int i = 0; i < 4; ++i) o[i] = init ? _mm256_setzero_ps() : _mm256_loadu_ps(out + 8 * i);
        for (int j = 0; j < k; ++j) {
            const struct pi_block_q8_0 * blk = (const struct pi_block_q8_0 *) rows[j] + b;
            const __m256 s = _mm256_set1_ps(a[j] * fp16_to_fp32(blk->d));
            for (int i = 0; i < 4; ++i) {
                const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (blk->qs + 8 * i)));
                o[i] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(q), o[i]);
            }
        }
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, o[i]);
    }
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define PI_AXPY_SIMD 1

// Eight float32x4 per block; vfmaq_f32(o, s, q) is fma(s, q, o), as the scalar fmaf.
static inline void axpy_i8x16(float32x4_t * o, float32x4_t s, int8x16_t q) {
    const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_s8(vget_high_s8(q));
    o[0] = vfmaq_f32(o[0], s, vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))));
    o[1] = vfmaq_f32(o[1], s, vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))));
    o[2] = vfmaq_f32(o[2], s, vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))));
    o[3] = vfmaq_f32(o[3], s, vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi))));
}

static void axpy_rows_q4_0(int64_t nb, const void * const * rows, const float * a, int k, float * out,
                           struct prefetcher * pf, bool init) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    const int8x16_t  s8 = vdupq_n_s8(8);
    for (int64_t b = 0; b < nb; ++b, out += PI_QK) {
        pf_step(pf, b);
        float32x4_t o[8];
        for (int i = 0; i < 8; ++i) o[i] = init ? vdupq_n_f32(0.0f) : vld1q_f32(out + 4 * i);
        for (int j = 0; j < k; ++j) {
            const struct pi_block_q4_0 * blk = (const struct pi_block_q4_0 *) rows[j] + b;
            const float32x4_t s = vdupq_n_f32(a[j] * fp16_to_fp32(blk->d));
            const uint8x16_t  q = vld1q_u8(blk->qs);
            axpy_i8x16(o, s, vsubq_s8(vreinterpretq_s8_u8(vandq_u8(q, m4)), s8));
            axpy_i8x16(o + 4, s, vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(q, 4)), s8));
        }
        for (int i = 0; i < 8; ++i) vst1q_f32(out + 4 * i, o[i]);
    }
}

static void axpy_rows_q8_0(int64_t nb, const void * const * rows, const float * a, int k, float * out,
                           struct prefetcher * pf, bool init) {
    for (int64_t b = 0; b < nb; ++b, out += PI_QK) {
        pf_step(pf, b);
        float32x4_t o[8];
        for (int i = 0; i < 8; ++i) o[i] = init ? vdupq_n_f32(0.0f) : vld1q_f32(out + 4 * i);
        for (int j = 0; j < k; ++j) {
            const struct pi_block_q8_0 * blk = (const struct pi_block_q8_0 *) rows[j] + b;
            const float32x4_t s = vdupq_n_f32(a[j] * fp16_to_fp32(blk->d));
            axpy_i8x16(o, s, vld1q_s8(blk->qs));
            axpy_i8x16(o + 4, s, vld1q_s8(blk->qs + 16));
        }
        for (int i = 0; i < 8; ++i) vst1q_f32(out + 4 * i, o[i]);
    }
}
#else
static void axpy_rows_q4_0(int64_t nb, const void * const * rows, const float * a, int k, float * out,
                           struct prefetcher * pf, bool init) {
    pf_rest(pf);
    if (init) memset(out, 0, sizeof(float) * (size_t) nb * PI_QK);
    for (int j = 0; j < k; ++j) {
        const struct pi_block_q4_0 * blk = rows[j];
        for (int64_t b = 0; b < nb; ++b) {
            const float d = a[j] * fp16_to_fp32(blk[b].d);
            float * o = out + b * PI_QK;
            for (int i = 0; i < PI_QK / 2; ++i) {
                o[i]             = fmaf(d, (float) ((blk[b].qs[i] & 0x0F) - 8), o[i]);
                o[i + PI_QK / 2] = fmaf(d, (float) ((blk[b].qs[i] >> 4) - 8), o[i + PI_QK / 2]);
            }
        }
    }
}

static void axpy_rows_q8_0(int64_t nb, const void * const * rows, const float * a, int k, float * out,
                           struct prefetcher * pf, bool init) {
    pf_rest(pf);
    if (init) memset(out, 0, sizeof(float) * (size_t) nb * PI_QK);
    for (int j = 0; j < k; ++j) {
        const struct pi_block_q8_0 * blk = rows[j];
        for (int64_t b = 0; b < nb; ++b) {
            const float d = a[j] * fp16_to_fp32(blk[b].d);
            float * o = out + b * PI_QK;
            for (int i = 0; i < PI_QK; ++i) {
                o[i] = fmaf(d, (float) blk[b].qs[i], o[i]);
            }
        }
    }
}
#endif

void pi_rows_axpy(enum ggml_type type, int64_t n, const void * const * rows, const float * a, int k, float * out,
                  const struct pi_next_rows * next, bool init) {
    struct prefetcher pf;
    if (blocks_match(type)) {
        pf_init(&pf, next, n / PI_QK);
        (type == GGML_TYPE_Q4_0 ? axpy_rows_q4_0 : axpy_rows_q8_0)(n / PI_QK, rows, a, k, out, &pf, init);
        return;
    }
    pf_init(&pf, next, 1);
    pf_rest(&pf);
    if (init) memset(out, 0, sizeof(float) * (size_t) n);
    // Other types are dequantized a piece at a time into a stack buffer (pieces of whole
    // blocks; every ggml block size divides PI_AXPY_PIECE), rows in order for every element.
    ggml_to_float_t to_float = type == GGML_TYPE_F32 ? NULL : ggml_get_type_traits(type)->to_float;
    const int64_t blck  = ggml_blck_size(type);
    const int64_t piece = PI_AXPY_PIECE - PI_AXPY_PIECE % blck;
    float buf[PI_AXPY_PIECE];
    for (int64_t c0 = 0; c0 < n; c0 += piece) {
        const int64_t m = n - c0 < piece ? n - c0 : piece;
        const size_t off = ggml_row_size(type, c0);
        for (int j = 0; j < k; ++j) {
            const float * w = (const float *) ((const char *) rows[j] + off);
            if (to_float) {
                to_float((const char *) rows[j] + off, buf, m);
                w = buf;
            }
            const float s = a[j];
            float * o = out + c0;
            for (int64_t c = 0; c < m; ++c) {
                o[c] = fmaf(s, w[c], o[c]);
            }
        }
    }
}
