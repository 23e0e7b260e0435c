// attention.c - attention over the f16 KV cache: every flash-attention context whose cache
// is on the CPU (context.c), batch-invariant by construction (several sequences stepping
// together, docs/parallel.md).
//
// Each (token, KV head) pair is computed alone: the scores of the head group's queries
// against the token's own cells, taken in position order from a list the context builds
// (so neither the rest of the batch nor where the sequence's cells sit in the cache can
// change a rounding), an exact two-pass softmax in fp32, and the weighted sum of V in
// fp32. ggml's reference flash attention, which batch-invariant contexts used before,
// visits every cell of the cache for every query head (skipping masked ones one by one),
// converts Q to fp16 and accumulates V in fp16; this reads each K and V row once per head
// group and only for the token's cells.
#include "kernel_variant.h"  // first: this file is built once per ISA level
#include "attention.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define PI_ATTN_NEON 1
#endif

// This file is built once per ISA level (kernel_variant.h). The AVX-512, AVX2 (+FMA, F16C)
// and NEON (aarch64) helpers below do the same operations per element in the fp16
// conversion, in block_mix (one fma per cell, cells in order) and in the exponential; the
// dot products' and the softmax sum's lane counts (16, 8, 4) and so their summation orders
// differ, as does the scalar fallback's (unfused). So results are batch-, tile- and
// thread-invariant within a level, not bitwise equal across levels.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PI_ATTN_AVX2 1

// Lanes [0, n) of 8 set (n may be <= 0 or > 8), for masked loads and stores.
static inline __m256i lanes_below(int64_t n) {
    const int32_t c = n < 0 ? 0 : n > 8 ? 8 : (int32_t) n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

// Cells are taken in blocks of PI_ATTN_BLOCK: a block's K (then V) rows are turned into
// fp32 once, in a buffer that stays in L1, and the rows PI_ATTN_PREFETCH cells ahead are
// prefetched meanwhile, so the loop waits on neither the conversion nor DRAM latency (the
// rows of one sequence's cells sit a whole cache row apart).
#define PI_ATTN_BLOCK 16
#define PI_ATTN_PREFETCH 64  // rows ahead

// The K rows of the token's cells and then its V rows form one stream of 2n rows, read in
// order; this prefetches rows [from, from + count) of it.
static inline void prefetch_stream(const struct ggml_tensor * kc, const struct ggml_tensor * vc, const int32_t * cells, int32_t n,
                                   int32_t from, int32_t count, int64_t g, int64_t d) {
    const size_t bytes = (size_t) d * sizeof(ggml_fp16_t);
    const int32_t end = from + count < 2 * n ? from + count : 2 * n;
    for (int32_t s = from; s < end; ++s) {
        const struct ggml_tensor * c = s < n ? kc : vc;
        const char * p = (const char *) c->data + cells[s < n ? s : s - n] * c->nb[1] + g * bytes;
        for (size_t o = 0; o < bytes; o += 64) {
            __builtin_prefetch(p + o, 0, 3);
        }
    }
}

#if defined(__AVX512F__)
// r[c] = the sum of the 16 lanes of v[c], c = 0..15, in one fixed order (pairs of lanes,
// then pairs of those, then across the four 128-bit quarters).
static inline __m512 sum16(const __m512 v[16]) {
    __m512 u[8], x[4];
    for (int k = 0; k < 8; ++k) {
        u[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    }
    for (int m = 0; m < 4; ++m) {
        const __m512d a = _mm512_castps_pd(u[2 * m]), b = _mm512_castps_pd(u[2 * m + 1]);
        x[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88), _mm512_shuffle_f32x4(z01, z23, 0xDD));
}
#elif defined(PI_ATTN_AVX2)
// r[c] = the sum of the 8 lanes of v[c], c = 0..7, in one fixed order (as sum16, on halves).
static inline __m256 sum8(const __m256 v[8]) {
    __m256 u[4], x[2];
    for (int k = 0; k < 4; ++k) {
        u[k] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    }
    for (int m = 0; m < 2; ++m) {
        const __m256d a = _mm256_castps_pd(u[2 * m]), b = _mm256_castps_pd(u[2 * m + 1]);
        x[m] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(x[0], x[1], 0x20), _mm256_permute2f128_ps(x[0], x[1], 0x31));
}
#endif

// buf[c * dv + k] <- row cells[c], KV head g, element k of the f16 cache c as fp32, for
// c < n; elements d..dv are zero.
static void load_block(const struct ggml_tensor * c, const int32_t * cells, int32_t n, int64_t g, int64_t d, int64_t dv, float * buf) {
    for (int32_t r = 0; r < n; ++r) {
        const ggml_fp16_t * src = (const ggml_fp16_t *) ((const char *) c->data + cells[r] * c->nb[1]) + g * d;
        float * out = buf + (size_t) r * dv;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= d; i += 16) {
            _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (src + i))));
        }
#elif defined(PI_ATTN_AVX2)
        for (; i + 8 <= d; i += 8) {
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (src + i))));
        }
#elif defined(PI_ATTN_NEON)
        for (; i + 8 <= d; i += 8) {
            const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16((const uint16_t *) (src + i)));
            vst1q_f32(out + i, vcvt_f32_f16(vget_low_f16(h)));
            vst1q_f32(out + i + 4, vcvt_high_f32_f16(h));
        }
#endif
        for (; i < d; ++i) {
            out[i] = ggml_fp16_to_fp32(src[i]);
        }
        for (; i < dv; ++i) {
            out[i] = 0.0f;
        }
    }
}

// s[c] <- scale * (q . buf row c), c < n <= PI_ATTN_BLOCK.
static void block_scores(const float * q, const float * buf, int32_t n, int64_t d, int64_t dv, float scale, float * s) {
#if defined(__AVX512F__)
    __m512 acc[PI_ATTN_BLOCK];
    for (int32_t c = 0; c < PI_ATTN_BLOCK; ++c) {
        acc[c] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < dv; k += 16) {
        const __mmask16 m  = d - k >= 16 ? 0xFFFF : (__mmask16) ((1u << (d - k)) - 1);
        const __m512    qk = _mm512_maskz_loadu_ps(m, q + k);
        for (int32_t c = 0; c < n; ++c) {
            acc[c] = _mm512_fmadd_ps(qk, _mm512_loadu_ps(buf + (size_t) c * dv + k), acc[c]);
        }
    }
    const __mmask16 m = n >= 16 ? 0xFFFF : (__mmask16) ((1u << n) - 1);
    _mm512_mask_storeu_ps(s, m, _mm512_mul_ps(_mm512_set1_ps(scale), sum16(acc)));
#elif defined(PI_ATTN_AVX2)
    const int64_t kend = (d + 7) / 8 * 8;  // <= dv; buf is zero from d on
    for (int32_t c0 = 0; c0 < n; c0 += 8) {
        const int32_t nc = n - c0 < 8 ? n - c0 : 8;
        __m256 acc[8];
        for (int32_t c = 0; c < 8; ++c) {
            acc[c] = _mm256_setzero_ps();
        }
        for (int64_t k = 0; k < kend; k += 8) {
            const __m256 qk = _mm256_maskload_ps(q + k, lanes_below(d - k));
            for (int32_t c = 0; c < nc; ++c) {
                acc[c] = _mm256_fmadd_ps(qk, _mm256_loadu_ps(buf + (size_t) (c0 + c) * dv + k), acc[c]);
            }
        }
        _mm256_maskstore_ps(s + c0, lanes_below(nc), _mm256_mul_ps(_mm256_set1_ps(scale), sum8(acc)));
    }
#elif defined(PI_ATTN_NEON)
    (void) dv;
    float qt[4] = { 0.0f, 0.0f, 0.0f, 0.0f };  // q's last d % 4 elements, zero-padded (buf is zero there)
    const int64_t d4 = d / 4 * 4;
    memcpy(qt, q + d4, sizeof(float) * (size_t) (d - d4));
    for (int32_t c0 = 0; c0 < n; c0 += 8) {
        const int32_t nc = n - c0 < 8 ? n - c0 : 8;
        float32x4_t acc[8];
        for (int32_t c = 0; c < nc; ++c) {
            acc[c] = vdupq_n_f32(0.0f);
        }
        for (int64_t k = 0; k < d; k += 4) {
            const float32x4_t qk = vld1q_f32(k < d4 ? q + k : qt);
            for (int32_t c = 0; c < nc; ++c) {
                acc[c] = vfmaq_f32(acc[c], qk, vld1q_f32(buf + (size_t) (c0 + c) * dv + k));
            }
        }
        for (int32_t c = 0; c < nc; ++c) {
            s[c0 + c] = scale * vaddvq_f32(acc[c]);
        }
    }
#else
    (void) dv;
    for (int32_t c = 0; c < n; ++c) {
        float a = 0.0f;
        for (int64_t k = 0; k < d; ++k) {
            a += q[k] * buf[(size_t) c * dv + k];
        }
        s[c] = scale * a;
    }
#endif
}

// out[0..d) += sum over c < n of p[c] * buf row c, adding the cells in order.
static void block_mix(float * out, const float * p, const float * buf, int32_t n, int64_t d, int64_t dv) {
#if defined(__AVX512F__)
    for (int64_t k = 0; k < dv; k += 16) {
        const __mmask16 m = d - k >= 16 ? 0xFFFF : (__mmask16) ((1u << (d - k)) - 1);
        __m512 a = _mm512_maskz_loadu_ps(m, out + k);
        for (int32_t c = 0; c < n; ++c) {
            a = _mm512_fmadd_ps(_mm512_set1_ps(p[c]), _mm512_loadu_ps(buf + (size_t) c * dv + k), a);
        }
        _mm512_mask_storeu_ps(out + k, m, a);
    }
#elif defined(PI_ATTN_AVX2)
    (void) dv;
    for (int64_t k = 0; k < d; k += 8) {
        const __m256i m = lanes_below(d - k);
        __m256 a = _mm256_maskload_ps(out + k, m);
        for (int32_t c = 0; c < n; ++c) {
            a = _mm256_fmadd_ps(_mm256_set1_ps(p[c]), _mm256_loadu_ps(buf + (size_t) c * dv + k), a);
        }
        _mm256_maskstore_ps(out + k, m, a);
    }
#elif defined(PI_ATTN_NEON)
    int64_t k = 0;
    for (; k + 4 <= d; k += 4) {
        float32x4_t a = vld1q_f32(out + k);
        for (int32_t c = 0; c < n; ++c) {
            a = vfmaq_f32(a, vdupq_n_f32(p[c]), vld1q_f32(buf + (size_t) c * dv + k));
        }
        vst1q_f32(out + k, a);
    }
    for (; k < d; ++k) {  // the same fma per element
        float a = out[k];
        for (int32_t c = 0; c < n; ++c) {
            a = fmaf(p[c], buf[(size_t) c * dv + k], a);
        }
        out[k] = a;
    }
#else
    for (int64_t k = 0; k < d; ++k) {
        float a = out[k];
        for (int32_t c = 0; c < n; ++c) {
            a += p[c] * buf[(size_t) c * dv + k];
        }
        out[k] = a;
    }
    (void) dv;
#endif
}

#if defined(__AVX512F__)
// e^x for x <= 0 (scores minus their maximum): x = k ln2 + r (Cody-Waite), e^r by its
// Taylor polynomial to r^6 on |r| <= ln2/2 (relative error < 2e-7), times 2^k.
static inline __m512 exp_nonpos(__m512 x) {
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}
#elif defined(PI_ATTN_AVX2)
// exp_nonpos on 8 lanes, the same operations; p * 2^k (vscalefps) as two exact-then-rounded
// multiplications: p * 2^k1 with k1 = max(k, -125) is exact (p >= 0.7 keeps it normal),
// then times 2^k2, k2 = max(k - k1, -126), rounds once, as vscalefps does; below k = -251
// both give 0.
static inline __m256 exp_nonpos8(__m256 x) {
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i ki = _mm256_cvtps_epi32(k);  // integral already: exact (INT_MIN far below -251)
    const __m256i k1 = _mm256_max_epi32(ki, _mm256_set1_epi32(-125));
    const __m256i k2 = _mm256_max_epi32(_mm256_sub_epi32(ki, k1), _mm256_set1_epi32(-126));
    const __m256  e1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, _mm256_set1_epi32(127)), 23));
    const __m256  e2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, e1), e2);
}
#elif defined(PI_ATTN_NEON)
// exp_nonpos on 4 lanes, the same operations as exp_nonpos8 (vfmsq_f32(x, k, c) = x - k c fused).
static inline float32x4_t exp_nonpos4(float32x4_t x) {
    const float32x4_t k = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504089f)));
    float32x4_t r = vfmsq_f32(x, k, vdupq_n_f32(0.693145751953125f));
    r = vfmsq_f32(r, k, vdupq_n_f32(1.428606765330187e-06f));
    float32x4_t p = vdupq_n_f32(1.0f / 720);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 120), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 24), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 6), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    const int32x4_t ki = vcvtq_s32_f32(k);  // integral already: exact (saturating far below -251)
    const int32x4_t k1 = vmaxq_s32(ki, vdupq_n_s32(-125));
    const int32x4_t k2 = vmaxq_s32(vsubq_s32(ki, k1), vdupq_n_s32(-126));
    const float32x4_t e1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k1, vdupq_n_s32(127)), 23));
    const float32x4_t e2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k2, vdupq_n_s32(127)), 23));
    return vmulq_f32(vmulq_f32(p, e1), e2);
}
#endif

// s[0..n) <- softmax(s), in place, fp32.
static void softmax(float * s, int32_t n) {
    float m = -INFINITY;
    for (int32_t i = 0; i < n; ++i) {
        m = s[i] > m ? s[i] : m;
    }
    float   sum = 0.0f;
    int32_t i   = 0;
#if defined(__AVX512F__)
    const __m512 vm = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    for (; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? 0xFFFF : (__mmask16) ((1u << (n - i)) - 1);
        const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), vm));
        _mm512_mask_storeu_ps(s + i, k, e);
        acc = _mm512_mask_add_ps(acc, k, acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
#elif defined(PI_ATTN_AVX2)
    const __m256 vm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (; i < n; i += 8) {
        const __m256i k = lanes_below(n - i);
        const __m256  e = exp_nonpos8(_mm256_sub_ps(_mm256_maskload_ps(s + i, k), vm));
        _mm256_maskstore_ps(s + i, k, e);
        acc = _mm256_add_ps(acc, _mm256_and_ps(e, _mm256_castsi256_ps(k)));
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#elif defined(PI_ATTN_NEON)
    const float32x4_t vm = vdupq_n_f32(m);
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (; i + 4 <= n; i += 4) {
        const float32x4_t e = exp_nonpos4(vsubq_f32(vld1q_f32(s + i), vm));
        vst1q_f32(s + i, e);
        acc = vaddq_f32(acc, e);
    }
    if (i < n) {  // the last n % 4 through the same exponential, the other lanes adding 0
        float t[4] = { m, m, m, m };
        memcpy(t, s + i, sizeof(float) * (size_t) (n - i));
        vst1q_f32(t, exp_nonpos4(vsubq_f32(vld1q_f32(t), vm)));
        for (int32_t l = n - i; l < 4; ++l) {
            t[l] = 0.0f;
        }
        memcpy(s + i, t, sizeof(float) * (size_t) (n - i));
        acc = vaddq_f32(acc, vld1q_f32(t));
        i = n;
    }
    sum = vaddvq_f32(acc);
#endif
    for (; i < n; ++i) {
        s[i] = expf(s[i] - m);
        sum += s[i];
    }
    const float inv = 1.0f / sum;
    for (i = 0; i < n; ++i) {
        s[i] *= inv;
    }
}

// Tiles: up to PI_ATTN_TILE consecutive tokens whose cell lists each extend the one before
// (a sequence's tokens in position order: a prompt chunk, or a verified draft) share every
// block of K and V rows, read and turned into fp32 once for the tile instead of once per
// token. Each token's scores and sums are the very operations it gets alone (a cell's score
// and a block's mix do not depend on the other cells of the block), so its result is too.
#define PI_ATTN_TILE 8

static const int32_t * cell_list(const struct ggml_tensor * cells, int64_t t) {
    return (const int32_t *) ((const char *) cells->data + t * cells->nb[1]);
}

// Whether token t + 1's cells are token t's and more, in the same order.
static bool extends(const struct ggml_tensor * cells, int64_t t) {
    const int32_t * a = cell_list(cells, t), * b = cell_list(cells, t + 1);
    return a[0] > 0 && b[0] >= a[0] && memcmp(a + 1, b + 1, sizeof(int32_t) * (size_t) a[0]) == 0;
}

// dst: F32 [d, n_head, n_tokens]; src: q [d, n_head, n_tokens] (any strides, rows of
// fp32), the K and V caches [n_kv_embd, size] f16, the cell lists I32 [1 + n_kv, n_tokens];
// userdata: the score scale's float bits.
static void attention_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const struct ggml_tensor * q = dst->src[0], * kc = dst->src[1], * vc = dst->src[2], * cells = dst->src[3];
    const int64_t d = q->ne[0], n_head = q->ne[1], n_tokens = q->ne[2], n_kv = cells->ne[0] - 1;
    const int64_t n_head_kv = kc->ne[0] / d, group = n_head / n_head_kv;
    const uint32_t bits = (uint32_t) (uintptr_t) userdata;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    // Per thread: one block of rows as fp32, a tile's scores over its cells, and the tiles
    // (every thread finds the same ones).
    const int64_t dv = (d + 15) / 16 * 16, n_pad = (n_kv + 15) / 16 * 16;
    float * buf = malloc(sizeof(float) * (size_t) (PI_ATTN_BLOCK * dv + PI_ATTN_TILE * group * n_pad));
    int32_t * tile = malloc(sizeof(int32_t) * (size_t) (n_tokens + 1));  // first token of each tile
    GGML_ASSERT(buf && tile);
    float * sc = buf + PI_ATTN_BLOCK * dv;
    int64_t n_tiles = 0;
    for (int64_t t = 0; t < n_tokens;) {
        tile[n_tiles++] = (int32_t) t;
        int64_t len = 1;
        while (t + len < n_tokens && len < PI_ATTN_TILE && extends(cells, t + len - 1)) {
            ++len;
        }
        t += len;
    }
    tile[n_tiles] = (int32_t) n_tokens;
    // Work items: (tile, KV head, part of the head group). With fewer (tile, KV head) pairs
    // than threads (a decode step of a model with few KV heads) each group is cut into parts
    // of its query heads; a head's operations are the same in any part, so its result is too.
    const int64_t pairs = n_tiles * n_head_kv;
    int64_t parts = 1;
    if (pairs < nth) {
        parts = (nth + pairs - 1) / pairs;
        parts = parts < group ? parts : group;
    }
    for (int64_t w = ith; w < pairs * parts; w += nth) {
        const int64_t pair = w / parts, part = w % parts;
        const int64_t t0 = tile[pair / n_head_kv], nt = tile[pair / n_head_kv + 1] - t0, g = pair % n_head_kv;
        const int64_t h0 = group * part / parts, h1 = group * (part + 1) / parts;  // the part's query heads
        const int32_t * longest = cell_list(cells, t0 + nt - 1);  // each token's cells are a prefix of it
        const int32_t   n = longest[0];
        const int32_t * cl = longest + 1;
        for (int64_t j = 0; j < nt; ++j) {
            memset((float *) ((char *) dst->data + (t0 + j) * dst->nb[2]) + (g * group + h0) * d, 0,
                   sizeof(float) * (size_t) ((h1 - h0) * d));
        }
        if (n <= 0) {
            continue;  // no cell to attend (cannot happen for a decoded token: it sees itself)
        }
        prefetch_stream(kc, vc, cl, n, 0, PI_ATTN_PREFETCH, g, d);
        for (int32_t i0 = 0; i0 < n; i0 += PI_ATTN_BLOCK) {
            const int32_t nb = n - i0 < PI_ATTN_BLOCK ? n - i0 : PI_ATTN_BLOCK;
            prefetch_stream(kc, vc, cl, n, i0 + PI_ATTN_PREFETCH, nb, g, d);
            load_block(kc, cl + i0, nb, g, d, dv, buf);
            for (int64_t j = 0; j < nt; ++j) {
                const int32_t nj = cell_list(cells, t0 + j)[0] - i0;  // the token's cells in this block
                const char * qt = (const char *) q->data + (t0 + j) * q->nb[2] + g * group * q->nb[1];
                for (int64_t h = h0; nj > 0 && h < h1; ++h) {
                    block_scores((const float *) (qt + h * q->nb[1]), buf, nj < nb ? nj : nb, d, dv, scale,
                                 sc + (j * group + h) * n_pad + i0);
                }
            }
        }
        for (int64_t j = 0; j < nt; ++j) {
            for (int64_t h = h0; h < h1; ++h) {
                softmax(sc + (j * group + h) * n_pad, cell_list(cells, t0 + j)[0]);
            }
        }
        for (int32_t i0 = 0; i0 < n; i0 += PI_ATTN_BLOCK) {
            const int32_t nb = n - i0 < PI_ATTN_BLOCK ? n - i0 : PI_ATTN_BLOCK;
            prefetch_stream(kc, vc, cl, n, n + i0 + PI_ATTN_PREFETCH, nb, g, d);
            load_block(vc, cl + i0, nb, g, d, dv, buf);
            for (int64_t j = 0; j < nt; ++j) {
                const int32_t nj = cell_list(cells, t0 + j)[0] - i0;
                float * out = (float *) ((char *) dst->data + (t0 + j) * dst->nb[2]) + g * group * d;
                for (int64_t h = h0; nj > 0 && h < h1; ++h) {
                    block_mix(out + h * d, sc + (j * group + h) * n_pad + i0, buf, nj < nb ? nj : nb, d, dv);
                }
            }
        }
    }
    free(tile);
    free(buf);
}

struct ggml_tensor * pi_attention(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * kc,
                                  struct ggml_tensor * vc, struct ggml_tensor * cells, int64_t n_head_kv, float scale) {
    GGML_ASSERT(q->type == GGML_TYPE_F32 && q->nb[0] == sizeof(float) && q->ne[3] == 1);
    GGML_ASSERT(kc->type == GGML_TYPE_F16 && vc->type == GGML_TYPE_F16 && kc->ne[0] == q->ne[0] * n_head_kv &&
                vc->ne[0] == kc->ne[0] && q->ne[1] % n_head_kv == 0);
    GGML_ASSERT(cells->type == GGML_TYPE_I32 && cells->ne[1] == q->ne[2]);
    uint32_t bits;
    memcpy(&bits, &scale, sizeof(bits));
    struct ggml_tensor * args[4] = { q, kc, vc, cells };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, q->ne[0], q->ne[1], q->ne[2], 1, args, 4, attention_op, GGML_N_TASKS_MAX,
                          (void *) (uintptr_t) bits);
}
