// sparse_kernels.c - SIMD dot products and AXPYs over scattered weight rows (see
// sparse_kernels.h). The block layouts below are ggml's file format; their sizes are
// checked against ggml_type_size before a fused kernel is used.
#include "sparse_kernels.h"

#include "ggml-cpu.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>
#if defined(__SSE__)
#include <immintrin.h>
#endif

#define PI_QK 32
struct pi_block_q4_0 { ggml_fp16_t d; uint8_t qs[PI_QK / 2]; };
struct pi_block_q8_0 { ggml_fp16_t d; int8_t  qs[PI_QK]; };

#ifndef PI_PREFETCH_HINT
#define PI_PREFETCH_HINT _MM_HINT_T1
#endif

void pi_prefetch(const void * p, size_t n) {
#if defined(__SSE__)
    const char * c = p;
    for (size_t o = 0; o < n; o += 64) {
        _mm_prefetch(c + o, PI_PREFETCH_HINT);
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
#if defined(__SSE__)
    if (!pf->next) {
        return;
    }
    const int64_t target = (i + 1) * pf->lines / pf->steps;
    for (; pf->done < target; ++pf->done) {
        for (int j = 0; j < pf->next->k; ++j) {
            _mm_prefetch((const char *) pf->next->rows[j] + pf->done * 64, PI_PREFETCH_HINT);
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
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PI_DOT_VNNI 1

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
#endif

void pi_rows_dot(enum ggml_type type, int64_t n, const void * const * rows, int k, const void * y, float * out,
                 const struct pi_next_rows * next) {
    struct prefetcher pf;
#ifdef PI_DOT_VNNI
    if (blocks_match(type) && n % (2 * PI_QK) == 0) {
        pf_init(&pf, next, n / PI_QK / 2);
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
// in order; the SIMD and scalar versions do the same per element.
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
