// attention.c - attention over the f16 KV cache for batch-invariant contexts (several
// sequences stepping together, docs/parallel.md).
//
// Each (token, KV head) pair is computed alone: the scores of the head group's queries
// against the token's own cells, taken in position order from a list the context builds
// (so neither the rest of the batch nor where the sequence's cells sit in the cache can
// change a rounding), an exact two-pass softmax in fp32, and the weighted sum of V in
// fp32. ggml's reference flash attention, which batch-invariant contexts used before,
// visits every cell of the cache for every query head (skipping masked ones one by one),
// converts Q to fp16 and accumulates V in fp16; this reads each K and V row once per head
// group and only for the token's cells.
#include "powerinfer-impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Row `cell`, KV head `g`, of a [n_embd_kv, size] f16 cache, as fp32.
static inline void load_row(const struct ggml_tensor * c, int64_t cell, int64_t g, int64_t d, float * out) {
    const ggml_fp16_t * src = (const ggml_fp16_t *) ((const char *) c->data + cell * c->nb[1]) + g * d;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= d; i += 16) {
        _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (src + i))));
    }
#endif
    for (; i < d; ++i) {
        out[i] = ggml_fp16_to_fp32(src[i]);
    }
}

static inline float dot(const float * a, const float * b, int64_t d) {
    int64_t i = 0;
    float   s = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= d; i += 16) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    }
    s = _mm512_reduce_add_ps(acc);
#endif
    for (; i < d; ++i) {
        s += a[i] * b[i];
    }
    return s;
}

static inline void axpy(float * y, const float * x, float a, int64_t d) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 va = _mm512_set1_ps(a);
    for (; i + 16 <= d; i += 16) {
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(_mm512_loadu_ps(x + i), va, _mm512_loadu_ps(y + i)));
    }
#endif
    for (; i < d; ++i) {
        y[i] += a * x[i];
    }
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
    // Per thread: one K/V row as fp32 and the group's scores over the cells.
    float * row = malloc(sizeof(float) * (size_t) (d + group * n_kv));
    GGML_ASSERT(row);
    float * sc = row + d;
    for (int64_t w = ith; w < n_tokens * n_head_kv; w += nth) {
        const int64_t t = w / n_head_kv, g = w % n_head_kv;
        const int32_t * list = (const int32_t *) ((const char *) cells->data + t * cells->nb[1]);
        const int32_t n = list[0];
        const char * qt = (const char *) q->data + t * q->nb[2] + g * group * q->nb[1];  // the group's first query
        float * out = (float *) ((char *) dst->data + t * dst->nb[2]) + g * group * d;
        memset(out, 0, sizeof(float) * (size_t) (group * d));
        if (n <= 0) {
            continue;  // no cell to attend (cannot happen for a decoded token: it sees itself)
        }
        for (int32_t i = 0; i < n; ++i) {
            load_row(kc, list[1 + i], g, d, row);
            for (int64_t j = 0; j < group; ++j) {
                sc[j * n + i] = scale * dot((const float *) (qt + j * q->nb[1]), row, d);
            }
        }
        for (int64_t j = 0; j < group; ++j) {
            softmax(sc + j * n, n);
        }
        for (int32_t i = 0; i < n; ++i) {
            load_row(vc, list[1 + i], g, d, row);
            for (int64_t j = 0; j < group; ++j) {
                axpy(out + j * d, row, sc[j * n + i], d);
            }
        }
    }
    free(row);
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
