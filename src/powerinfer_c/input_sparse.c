// input_sparse.c - the column copy of a matrix group and the input-sparse product (see
// input_sparse.h). Two graph nodes per product: `prepare` finds each chunk's kept columns
// and quantizes their inputs, `product` runs the columns. Each thread of the product owns
// whole tiles of output rows, and a row's sum runs over the chunks in column order, so
// results depend neither on the thread count nor on the rest of the batch.
#include "input_sparse.h"

#include "ggml-cpu.h"

#include <math.h>
#include <string.h>
#if defined(__SSE__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define PI_CM_VNNI 1
#endif

#define QK   32
#define QK_K 256
#define TILE PI_COLMAT_TILE

// ---- the file's blocks (ggml's formats; sizes checked against ggml_type_size) ---------------

struct cm_q4_0 { ggml_fp16_t d; uint8_t qs[QK / 2]; };
struct cm_q4_1 { ggml_fp16_t d, m; uint8_t qs[QK / 2]; };
struct cm_q5_0 { ggml_fp16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct cm_q5_1 { ggml_fp16_t d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct cm_q8_0 { ggml_fp16_t d; int8_t qs[QK]; };
struct cm_q4_K { ggml_fp16_t d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; };
struct cm_q5_K { ggml_fp16_t d, dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; };
struct cm_q6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; ggml_fp16_t d; };

static size_t block_struct_size(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q4_0: return sizeof(struct cm_q4_0);
        case GGML_TYPE_Q4_1: return sizeof(struct cm_q4_1);
        case GGML_TYPE_Q5_0: return sizeof(struct cm_q5_0);
        case GGML_TYPE_Q5_1: return sizeof(struct cm_q5_1);
        case GGML_TYPE_Q8_0: return sizeof(struct cm_q8_0);
        case GGML_TYPE_Q4_K: return sizeof(struct cm_q4_K);
        case GGML_TYPE_Q5_K: return sizeof(struct cm_q5_K);
        case GGML_TYPE_Q6_K: return sizeof(struct cm_q6_K);
        default:             return 0;
    }
}

bool pi_colmat_type_ok(enum ggml_type type) {
    const size_t s = block_struct_size(type);
    return s != 0 && s == ggml_type_size(type);
}

// ggml's 6-bit scale and minimum of sub-block j of a Q4_K / Q5_K super-block.
static inline void k_scale_min(const uint8_t * s, int j, uint8_t * sc, uint8_t * m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m  = s[j + 4] & 63;
    } else {
        *sc = (uint8_t) ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *m  = (uint8_t) ((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// The unsigned integers q[0, 32) of 32-column block b of a row (weights b*32 .. b*32+31).
static void decode_q32(enum ggml_type type, const void * row, int64_t b, uint8_t * q) {
    switch (type) {
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1: {
            const uint8_t * qs = type == GGML_TYPE_Q4_0 ? ((const struct cm_q4_0 *) row)[b].qs : ((const struct cm_q4_1 *) row)[b].qs;
            for (int l = 0; l < 16; ++l) {
                q[l]      = qs[l] & 0x0F;
                q[l + 16] = qs[l] >> 4;
            }
            break;
        }
        case GGML_TYPE_Q5_0:
        case GGML_TYPE_Q5_1: {
            const uint8_t * qs = type == GGML_TYPE_Q5_0 ? ((const struct cm_q5_0 *) row)[b].qs : ((const struct cm_q5_1 *) row)[b].qs;
            const uint8_t * qb = type == GGML_TYPE_Q5_0 ? ((const struct cm_q5_0 *) row)[b].qh : ((const struct cm_q5_1 *) row)[b].qh;
            uint32_t qh;
            memcpy(&qh, qb, 4);
            for (int l = 0; l < 16; ++l) {
                q[l]      = (uint8_t) ((qs[l] & 0x0F) | (((qh >> l) & 1) << 4));
                q[l + 16] = (uint8_t) ((qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4));
            }
            break;
        }
        case GGML_TYPE_Q8_0: {
            const int8_t * qs = ((const struct cm_q8_0 *) row)[b].qs;
            for (int l = 0; l < QK; ++l) q[l] = (uint8_t) (qs[l] + 128);
            break;
        }
        case GGML_TYPE_Q4_K:
        case GGML_TYPE_Q5_K: {
            const int64_t sb = b / 8;
            const int j = (int) (b % 8);  // sub-blocks 2i, 2i+1: low, high nibbles of qs[32i .. 32i+31]
            const uint8_t * qs = type == GGML_TYPE_Q4_K ? ((const struct cm_q4_K *) row)[sb].qs : ((const struct cm_q5_K *) row)[sb].qs;
            qs += 32 * (j / 2);
            for (int l = 0; l < QK; ++l) q[l] = j % 2 ? qs[l] >> 4 : qs[l] & 0x0F;
            if (type == GGML_TYPE_Q5_K) {
                const uint8_t * qh = ((const struct cm_q5_K *) row)[sb].qh;  // bit j of qh[l]: weight l of sub-block j
                for (int l = 0; l < QK; ++l) q[l] |= (uint8_t) (((qh[l] >> j) & 1) << 4);
            }
            break;
        }
        case GGML_TYPE_Q6_K: {
            const struct cm_q6_K * x = (const struct cm_q6_K *) row + b / 8;
            const int j = (int) (b % 8), half = j / 4, g = j % 4;  // 128-weight half, 32-weight group in it
            const uint8_t * ql = x->ql + 64 * half;
            const uint8_t * qh = x->qh + 32 * half;
            for (int l = 0; l < QK; ++l) {
                const uint8_t lo = g % 2 ? ql[l + 32] : ql[l];
                q[l] = (uint8_t) ((g < 2 ? lo & 0x0F : lo >> 4) | (((qh[l] >> (2 * g)) & 3) << 4));
            }
            break;
        }
        default:
            GGML_ABORT("decode_q32: type %s has no column form", ggml_type_name(type));
    }
}

// ---- layout -------------------------------------------------------------------------------
//
// Within a tile of 64 rows, row 16m + 4L + d sits at position 16L + 4m + d. The kernel
// interleaves four columns' 64 positions with unpack instructions that work inside
// 128-bit lanes; this order makes their results come out as rows 16m .. 16m + 15 in
// register m. A tile of one column: positions p and p + 32 in the low and high nibbles of
// byte p (p < 32); then, for 5 and 6 bits, 64-bit masks of bit 4 (and bit 5) by position;
// 8 bits: one byte per position.

static inline int tile_pos(int r) {
    const int m = r / 16, L = (r % 16) / 4, d = r % 4;
    return 16 * L + 4 * m + d;
}

static size_t tile_rec_bytes(int bits) {
    return bits == 8 ? 64 : 32 + 8 * (size_t) (bits - 4);
}

static bool seg_kind(enum ggml_type type, struct pi_colmat_seg * s) {
    switch (type) {
        case GGML_TYPE_Q4_0: s->scales = PI_CM_D;  s->bits = 4; s->unit = 32; s->offset = 8;   return true;
        case GGML_TYPE_Q5_0: s->scales = PI_CM_D;  s->bits = 5; s->unit = 32; s->offset = 16;  return true;
        case GGML_TYPE_Q8_0: s->scales = PI_CM_D;  s->bits = 8; s->unit = 32; s->offset = 128; return true;
        case GGML_TYPE_Q4_1: s->scales = PI_CM_DM; s->bits = 4; s->unit = 32; s->offset = 0;   return true;
        case GGML_TYPE_Q5_1: s->scales = PI_CM_DM; s->bits = 5; s->unit = 32; s->offset = 0;   return true;
        case GGML_TYPE_Q4_K: s->scales = PI_CM_K;  s->bits = 4; s->unit = 32; s->offset = 0;   return true;
        case GGML_TYPE_Q5_K: s->scales = PI_CM_K;  s->bits = 5; s->unit = 32; s->offset = 0;   return true;
        case GGML_TYPE_Q6_K: s->scales = PI_CM_6K; s->bits = 6; s->unit = 16; s->offset = 32;  return true;
        default:             return false;
    }
}

// Bytes of one segment's scale arrays (rows padded to tiles), and where each starts.
struct scale_sizes { size_t d, m, sc, mins; };

static struct scale_sizes scale_sizes(const struct pi_colmat_seg * s, int64_t n_in) {
    const size_t rows = (size_t) s->n_tiles * TILE;
    struct scale_sizes z = { 0, 0, 0, 0 };
    switch (s->scales) {
        case PI_CM_D:  z.d = rows * (size_t) (n_in / QK) * 2; break;
        case PI_CM_DM: z.d = z.m = rows * (size_t) (n_in / QK) * 2; break;
        case PI_CM_K:  z.d = z.m = rows * (size_t) (n_in / QK_K) * 2; z.sc = z.mins = rows * (size_t) (n_in / QK); break;
        case PI_CM_6K: z.d = rows * (size_t) (n_in / QK_K) * 2; z.sc = rows * (size_t) (n_in / 16); break;
    }
    return z;
}

static size_t pad64(size_t n) { return (n + 63) & ~(size_t) 63; }

size_t pi_colmat_plan(struct pi_colmat * cm, struct ggml_tensor * const * w, int n) {
    memset(cm, 0, sizeof(*cm));
    if (n < 1 || n > PI_COLMAT_MAX_SEGS) {
        return 0;
    }
    const int64_t n_in = w[0]->ne[0];
    cm->n_in  = n_in;
    cm->chunk = 32;
    for (int k = 0; k < n; ++k) {
        struct pi_colmat_seg * s = &cm->seg[k];
        if (!w[k] || w[k]->ne[0] != n_in || w[k]->ne[2] != 1 || w[k]->ne[3] != 1 || !ggml_is_contiguous(w[k]) ||
            !pi_colmat_type_ok(w[k]->type) || !seg_kind(w[k]->type, s) || n_in % ggml_blck_size(w[k]->type) != 0 ||
            n_in % QK != 0 || w[k]->ne[1] % 16 != 0 || w[k]->ne[1] <= 0) {
            memset(cm, 0, sizeof(*cm));
            return 0;
        }
        s->type    = w[k]->type;
        s->row0    = cm->n_out;
        s->n_rows  = w[k]->ne[1];
        s->n_tiles = (s->n_rows + TILE - 1) / TILE;
        s->rec     = tile_rec_bytes(s->bits);
        s->col_off = cm->col_stride;
        cm->col_stride += (size_t) s->n_tiles * s->rec;
        cm->n_out += s->n_rows;
        if (s->unit < cm->chunk) cm->chunk = s->unit;
    }
    cm->n_segs     = n;
    cm->col_stride = pad64(cm->col_stride);
    size_t bytes = cm->col_stride * (size_t) n_in;
    for (int k = 0; k < n; ++k) {
        const struct scale_sizes z = scale_sizes(&cm->seg[k], n_in);
        bytes += pad64(z.d) + pad64(z.m) + pad64(z.sc) + pad64(z.mins);
    }
    cm->bytes = bytes;
    return bytes;
}

// The scale arrays of one row block: fills rows [row, row + 1) of every unit.
static void fill_scales(const struct pi_colmat_seg * s, const void * src_row, int64_t n_in, int64_t row,
                        ggml_fp16_t * d, ggml_fp16_t * m, uint8_t * sc, uint8_t * mins) {
    const size_t rows = (size_t) s->n_tiles * TILE;
    switch (s->scales) {
        case PI_CM_D:
            for (int64_t b = 0; b < n_in / QK; ++b) {
                d[(size_t) b * rows + row] = s->type == GGML_TYPE_Q4_0 ? ((const struct cm_q4_0 *) src_row)[b].d
                                           : s->type == GGML_TYPE_Q5_0 ? ((const struct cm_q5_0 *) src_row)[b].d
                                                                       : ((const struct cm_q8_0 *) src_row)[b].d;
            }
            break;
        case PI_CM_DM:
            for (int64_t b = 0; b < n_in / QK; ++b) {
                const bool q4 = s->type == GGML_TYPE_Q4_1;
                d[(size_t) b * rows + row] = q4 ? ((const struct cm_q4_1 *) src_row)[b].d : ((const struct cm_q5_1 *) src_row)[b].d;
                m[(size_t) b * rows + row] = q4 ? ((const struct cm_q4_1 *) src_row)[b].m : ((const struct cm_q5_1 *) src_row)[b].m;
            }
            break;
        case PI_CM_K:
            for (int64_t sb = 0; sb < n_in / QK_K; ++sb) {
                const bool q4 = s->type == GGML_TYPE_Q4_K;
                const struct cm_q4_K * x4 = (const struct cm_q4_K *) src_row + sb;
                const struct cm_q5_K * x5 = (const struct cm_q5_K *) src_row + sb;
                d[(size_t) sb * rows + row] = q4 ? x4->d : x5->d;
                m[(size_t) sb * rows + row] = q4 ? x4->dmin : x5->dmin;
                for (int j = 0; j < 8; ++j) {
                    k_scale_min(q4 ? x4->scales : x5->scales, j, &sc[(size_t) (sb * 8 + j) * rows + row],
                                &mins[(size_t) (sb * 8 + j) * rows + row]);
                }
            }
            break;
        case PI_CM_6K:
            for (int64_t sb = 0; sb < n_in / QK_K; ++sb) {
                const struct cm_q6_K * x = (const struct cm_q6_K *) src_row + sb;
                d[(size_t) sb * rows + row] = x->d;
                for (int h = 0; h < 16; ++h) sc[(size_t) (sb * 16 + h) * rows + row] = (uint8_t) x->scales[h];
            }
            break;
    }
}

void pi_colmat_bind(struct pi_colmat * cm, void * mem) {
    uint8_t * p = mem;
    cm->q = p;
    p += cm->col_stride * (size_t) cm->n_in;
    for (int k = 0; k < cm->n_segs; ++k) {
        struct pi_colmat_seg * s = &cm->seg[k];
        const struct scale_sizes z = scale_sizes(s, cm->n_in);
        s->d    = z.d    ? (const ggml_fp16_t *) p : NULL; p += pad64(z.d);
        s->m    = z.m    ? (const ggml_fp16_t *) p : NULL; p += pad64(z.m);
        s->sc   = z.sc   ? p : NULL;                        p += pad64(z.sc);
        s->mins = z.mins ? p : NULL;                        p += pad64(z.mins);
    }
}

// One column's tile record from its 64 q in position order.
static inline void pack_record(const uint8_t * v, int bits, uint8_t * rec) {
    if (bits == 8) {
        memcpy(rec, v, TILE);
        return;
    }
#ifdef PI_CM_VNNI
    const __m256i lo = _mm256_loadu_si256((const __m256i *) v), hi = _mm256_loadu_si256((const __m256i *) (v + 32));
    const __m256i mk = _mm256_set1_epi8(0x0F);
    _mm256_storeu_si256((__m256i *) rec, _mm256_or_si256(_mm256_and_si256(lo, mk),
                                                         _mm256_slli_epi16(_mm256_and_si256(hi, mk), 4)));
    const __m512i all = _mm512_loadu_si512(v);
    for (int hb = 4; hb < bits; ++hb) {
        const uint64_t m = _cvtmask64_u64(_mm512_test_epi8_mask(all, _mm512_set1_epi8((char) (1 << hb))));
        memcpy(rec + 32 + 8 * (hb - 4), &m, 8);
    }
#else
    for (int p = 0; p < 32; ++p) rec[p] = (uint8_t) ((v[p] & 0x0F) | ((v[p + 32] & 0x0F) << 4));
    for (int hb = 4; hb < bits; ++hb) {
        uint64_t m = 0;
        for (int p = 0; p < TILE; ++p) m |= (uint64_t) ((v[p] >> hb) & 1) << p;
        memcpy(rec + 32 + 8 * (hb - 4), &m, 8);
    }
#endif
}

void pi_colmat_fill(const struct pi_colmat * cm, struct ggml_tensor * const * w, int ith, int nth) {
    uint8_t q[TILE][QK];        // 64 rows x 32 columns of one block, row order
    uint8_t colq[QK][TILE];     // the same, a column's 64 q in position order
    int row_of[TILE];
    for (int p = 0; p < TILE; ++p) row_of[p] = tile_pos(p);  // the permutation is its own inverse
    for (int k = 0; k < cm->n_segs; ++k) {
        const struct pi_colmat_seg * s = &cm->seg[k];
        const int64_t t0 = s->n_tiles * ith / nth, t1 = s->n_tiles * (ith + 1) / nth;
        for (int64_t ti = t0; ti < t1; ++ti) {
            const int64_t r0 = ti * TILE;
            const int nr = (int) (s->n_rows - r0 < TILE ? s->n_rows - r0 : TILE);  // padding rows stay 0
            memset(q, 0, sizeof(q));
            for (int r = 0; r < nr; ++r) {
                fill_scales(s, (const char *) w[k]->data + (size_t) (r0 + r) * w[k]->nb[1], cm->n_in, r0 + r,
                            (ggml_fp16_t *) s->d, (ggml_fp16_t *) s->m, (uint8_t *) s->sc, (uint8_t *) s->mins);
            }
            for (int64_t b = 0; b < cm->n_in / QK; ++b) {
                for (int r = 0; r < nr; ++r) {
                    decode_q32(s->type, (const char *) w[k]->data + (size_t) (r0 + r) * w[k]->nb[1], b, q[r]);
                }
                for (int p = 0; p < TILE; ++p) {
                    const uint8_t * src = q[row_of[p]];
                    for (int l = 0; l < QK; ++l) colq[l][p] = src[l];
                }
                for (int l = 0; l < QK; ++l) {
                    pack_record(colq[l], s->bits,
                                (uint8_t *) cm->q + (size_t) (b * QK + l) * cm->col_stride + s->col_off + (size_t) ti * s->rec);
                }
            }
        }
    }
}

// q of row r (tile position p) in one column's tile record.
static inline uint8_t rec_q(const uint8_t * rec, int bits, int p) {
    if (bits == 8) {
        return rec[p];
    }
    uint8_t v = (uint8_t) (p < 32 ? rec[p] & 0x0F : rec[p - 32] >> 4);
    for (int hb = 4; hb < bits; ++hb) {
        v |= (uint8_t) (((rec[32 + 8 * (hb - 4) + p / 8] >> (p % 8)) & 1) << hb);
    }
    return v;
}

// (a, b) of a segment's row (segment-relative) for column j.
static inline void seg_ab(const struct pi_colmat_seg * s, int64_t row, int64_t j, float * a, float * b) {
    const size_t rows = (size_t) s->n_tiles * TILE;
    switch (s->scales) {
        case PI_CM_D:
            *a = ggml_fp16_to_fp32(s->d[(size_t) (j / QK) * rows + row]);
            *b = -(float) s->offset * *a;
            break;
        case PI_CM_DM:
            *a = ggml_fp16_to_fp32(s->d[(size_t) (j / QK) * rows + row]);
            *b = ggml_fp16_to_fp32(s->m[(size_t) (j / QK) * rows + row]);
            break;
        case PI_CM_K:
            *a = ggml_fp16_to_fp32(s->d[(size_t) (j / QK_K) * rows + row]) * (float) s->sc[(size_t) (j / QK) * rows + row];
            *b = -(ggml_fp16_to_fp32(s->m[(size_t) (j / QK_K) * rows + row]) * (float) s->mins[(size_t) (j / QK) * rows + row]);
            break;
        default:  // PI_CM_6K
            *a = ggml_fp16_to_fp32(s->d[(size_t) (j / QK_K) * rows + row]) * (float) (int8_t) s->sc[(size_t) (j / 16) * rows + row];
            *b = -(float) s->offset * *a;
            break;
    }
}

void pi_colmat_row(const struct pi_colmat * cm, int64_t r, float * w, float * a, float * b) {
    int k = 0;
    while (k + 1 < cm->n_segs && r >= cm->seg[k + 1].row0) ++k;
    const struct pi_colmat_seg * s = &cm->seg[k];
    const int64_t rr = r - s->row0, ti = rr / TILE;
    const int p = tile_pos((int) (rr % TILE));
    for (int64_t j = 0; j < cm->n_in; ++j) {
        const uint8_t * rec = cm->q + (size_t) j * cm->col_stride + s->col_off + (size_t) ti * s->rec;
        float aj, bj;
        seg_ab(s, rr, j, &aj, &bj);
        w[j] = aj * (float) rec_q(rec, s->bits, p) + bj;
        if (a) a[j] = aj;
        if (b) b[j] = bj;
    }
}

// ---- prepare: kept columns and quantized inputs ------------------------------------------
//
// dst: I32 [rec_len(C, T), n_in / C]. Per chunk of C columns:
//   [0]                   number of groups of 4 kept columns (the union over the batch)
//   [1, 1 + C)            their column ids, groups of 4; a group's unused slots repeat its first id
//   [1 + C + g*T + t]     token t's 8-bit inputs of group g, packed into one int32
//   then float dx[T]      token t's quantization step of this chunk's 32 columns
//   then float sx[T]      token t's sum of its kept inputs in the chunk

static inline int64_t rec_len(int64_t C, int64_t T) { return 1 + C + (C / 4) * T + 2 * T; }

static void prepare_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    struct pi_active_stat * stat = userdata;
    const struct ggml_tensor * x = dst->src[0];
    const int64_t n_in = x->ne[0], T = x->ne[1];
    const int64_t n_chunks = dst->ne[1], C = n_in / n_chunks, R = dst->ne[0];
    const float tau = stat->threshold;
    const int64_t c0 = n_chunks * ith / nth, c1 = n_chunks * (ith + 1) / nth;
    int64_t kept_total = 0;
    for (int64_t c = c0; c < c1; ++c) {
        int32_t * rec = (int32_t *) ((char *) dst->data + c * dst->nb[1]);
        int32_t * cols = rec + 1;
        int32_t * x4 = rec + 1 + C;
        float * dx = (float *) (rec + 1 + C + (C / 4) * T);
        float * sx = dx + T;
        const int64_t j0 = c * C, u0 = j0 / QK * QK;  // the chunk's columns; its 32-column quantization unit
        uint32_t keep[PI_COLMAT_MAX_TOKENS];  // bit l: column j0 + l kept for token t
        uint32_t any = 0;
        for (int64_t t = 0; t < T; ++t) {
            const float * xt = (const float *) ((const char *) x->data + t * x->nb[1]);
            float amax = 0.0f, s = 0.0f;
            uint32_t k = 0;
            for (int64_t j = u0; j < u0 + QK; ++j) {
                const float v = xt[j];
                if (!(fabsf(v) <= tau)) {  // NaN is kept: it must reach the output
                    amax = fmaxf(amax, fabsf(v));
                    if (j >= j0 && j < j0 + C) {
                        k |= 1u << (j - j0);
                        s += v;
                    }
                }
            }
            dx[t] = amax / 127.0f;
            sx[t] = isfinite(amax) ? s : NAN;
            keep[t] = k;
            any |= k;
            kept_total += __builtin_popcount(k);
        }
        int32_t n = 0;
        for (int l = 0; l < C; ++l) {
            if (any >> l & 1) cols[n++] = (int32_t) (j0 + l);
        }
        const int32_t n_groups = (n + 3) / 4;
        for (int32_t i = n; i < n_groups * 4; ++i) cols[i] = cols[i & ~3];
        rec[0] = n_groups;
        for (int64_t t = 0; t < T; ++t) {
            const float * xt = (const float *) ((const char *) x->data + t * x->nb[1]);
            const float id = dx[t] > 0.0f && isfinite(dx[t]) ? 1.0f / dx[t] : 0.0f;
            for (int32_t g = 0; g < n_groups; ++g) {
                uint32_t packed = 0;
                for (int i = 0; i < 4; ++i) {
                    const int32_t slot = 4 * g + i;
                    if (slot >= n) break;
                    const int64_t j = cols[slot];
                    if (keep[t] >> (j - j0) & 1) {
                        const float v = xt[j] * id;
                        const int8_t q8 = isfinite(v) ? (int8_t) roundf(v) : 0;
                        packed |= (uint32_t) (uint8_t) q8 << (8 * i);
                    }
                }
                x4[g * T + t] = (int32_t) packed;
            }
        }
        (void) R;
    }
    __atomic_fetch_add(&stat->n_active, kept_total, __ATOMIC_RELAXED);
    if (ith == 0) {
        __atomic_fetch_add(&stat->n_total, n_in * T, __ATOMIC_RELAXED);
    }
}

// ---- the product ------------------------------------------------------------------------

// One tile of one segment over one chunk's groups, scalar: acc[t][r] = sum q * x8.
static void tile_acc_scalar(const struct pi_colmat * cm, const struct pi_colmat_seg * s, int64_t ti, const int32_t * cols,
                            const int32_t * x4, int32_t n_groups, int64_t T, int32_t (*acc)[TILE]) {
    for (int64_t t = 0; t < T; ++t) memset(acc[t], 0, sizeof(acc[t]));
    for (int32_t g = 0; g < n_groups; ++g) {
        for (int i = 0; i < 4; ++i) {
            const uint8_t * rec = cm->q + (size_t) cols[4 * g + i] * cm->col_stride + s->col_off + (size_t) ti * s->rec;
            for (int r = 0; r < TILE; ++r) {
                const int32_t qv = rec_q(rec, s->bits, tile_pos(r));
                for (int64_t t = 0; t < T; ++t) {
                    acc[t][r] += qv * (int32_t) (int8_t) ((uint32_t) x4[g * T + t] >> (8 * i));
                }
            }
        }
    }
}

#ifdef PI_CM_VNNI
// 64 q of one column's tile as bytes, position order.
static inline __m512i tile_u8(const uint8_t * rec, int bits) {
    if (bits == 8) {
        return _mm512_loadu_si512(rec);
    }
    const __m256i v  = _mm256_loadu_si256((const __m256i *) rec);
    const __m256i mk = _mm256_set1_epi8(0x0F);
    __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, mk)),
                                   _mm256_and_si256(_mm256_srli_epi16(v, 4), mk), 1);
    if (bits >= 5) {
        uint64_t m;
        memcpy(&m, rec + 32, 8);
        u = _mm512_mask_add_epi8(u, _cvtu64_mask64(m), u, _mm512_set1_epi8(16));
    }
    if (bits == 6) {
        uint64_t m;
        memcpy(&m, rec + 40, 8);
        u = _mm512_mask_add_epi8(u, _cvtu64_mask64(m), u, _mm512_set1_epi8(32));
    }
    return u;
}

// acc[t][m] (rows 16m .. 16m+15 of the tile) += the tile's q of each group's 4 columns times
// token t's 4 inputs; tokens [tb, tb + nt), nt <= 4. bits is a constant in each caller.
static inline void tile_acc_vnni(const struct pi_colmat * cm, const struct pi_colmat_seg * s, int bits, int64_t ti,
                                 const int32_t * cols, const int32_t * x4, int32_t n_groups, int64_t T, int64_t tb, int nt,
                                 __m512i acc[4][4]) {
    const size_t off = s->col_off + (size_t) ti * s->rec;
    for (int t = 0; t < 4; ++t) {
        for (int m = 0; m < 4; ++m) acc[t][m] = _mm512_setzero_si512();
    }
    for (int32_t g = 0; g < n_groups; ++g) {
        const uint8_t * p0 = cm->q + (size_t) cols[4 * g + 0] * cm->col_stride + off;
        const uint8_t * p1 = cm->q + (size_t) cols[4 * g + 1] * cm->col_stride + off;
        const uint8_t * p2 = cm->q + (size_t) cols[4 * g + 2] * cm->col_stride + off;
        const uint8_t * p3 = cm->q + (size_t) cols[4 * g + 3] * cm->col_stride + off;
        // The same columns' next tiles, a few lines ahead (the rows of a thread are contiguous).
        _mm_prefetch((const char *) p0 + 8 * s->rec, _MM_HINT_T0);
        _mm_prefetch((const char *) p1 + 8 * s->rec, _MM_HINT_T0);
        _mm_prefetch((const char *) p2 + 8 * s->rec, _MM_HINT_T0);
        _mm_prefetch((const char *) p3 + 8 * s->rec, _MM_HINT_T0);
        const __m512i u0 = tile_u8(p0, bits), u1 = tile_u8(p1, bits), u2 = tile_u8(p2, bits), u3 = tile_u8(p3, bits);
        const __m512i a0 = _mm512_unpacklo_epi8(u0, u1), a1 = _mm512_unpackhi_epi8(u0, u1);
        const __m512i b0 = _mm512_unpacklo_epi8(u2, u3), b1 = _mm512_unpackhi_epi8(u2, u3);
        const __m512i w0 = _mm512_unpacklo_epi16(a0, b0), w1 = _mm512_unpackhi_epi16(a0, b0);
        const __m512i w2 = _mm512_unpacklo_epi16(a1, b1), w3 = _mm512_unpackhi_epi16(a1, b1);
        for (int t = 0; t < nt; ++t) {
            const __m512i xv = _mm512_set1_epi32(x4[g * T + tb + t]);
            acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], w0, xv);
            acc[t][1] = _mm512_dpbusd_epi32(acc[t][1], w1, xv);
            acc[t][2] = _mm512_dpbusd_epi32(acc[t][2], w2, xv);
            acc[t][3] = _mm512_dpbusd_epi32(acc[t][3], w3, xv);
        }
    }
}

// (a, b) of 16 rows [row, row + 16) of a segment for column j.
static inline void seg_ab16(const struct pi_colmat_seg * s, int64_t row, int64_t j, __m512 * a, __m512 * b) {
    const size_t rows = (size_t) s->n_tiles * TILE;
    switch (s->scales) {
        case PI_CM_D:
            *a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (s->d + (size_t) (j / QK) * rows + row)));
            *b = _mm512_mul_ps(_mm512_set1_ps(-(float) s->offset), *a);
            break;
        case PI_CM_DM:
            *a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (s->d + (size_t) (j / QK) * rows + row)));
            *b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (s->m + (size_t) (j / QK) * rows + row)));
            break;
        case PI_CM_K: {
            const __m512 d  = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (s->d + (size_t) (j / QK_K) * rows + row)));
            const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (s->m + (size_t) (j / QK_K) * rows + row)));
            const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) (s->sc + (size_t) (j / QK) * rows + row))));
            const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) (s->mins + (size_t) (j / QK) * rows + row))));
            *a = _mm512_mul_ps(d, sc);
            *b = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dm, mn));
            break;
        }
        default: {  // PI_CM_6K
            const __m512 d  = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (s->d + (size_t) (j / QK_K) * rows + row)));
            const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (s->sc + (size_t) (j / 16) * rows + row))));
            *a = _mm512_mul_ps(d, sc);
            *b = _mm512_mul_ps(_mm512_set1_ps(-(float) s->offset), *a);
            break;
        }
    }
}

static void seg_tiles_vnni(const struct pi_colmat * cm, const struct pi_colmat_seg * s, int bits, int64_t ta, int64_t tz,
                           const struct ggml_tensor * prep, int64_t T, float * y, int64_t ldy) {
    const int64_t C = cm->chunk, n_chunks = prep->ne[1];
    for (int64_t c = 0; c < n_chunks; ++c) {
        const int32_t * rec = (const int32_t *) ((const char *) prep->data + c * prep->nb[1]);
        const int32_t n_groups = rec[0];
        if (n_groups == 0) continue;
        const int32_t * cols = rec + 1;
        const int32_t * x4 = rec + 1 + C;
        const float * dx = (const float *) (rec + 1 + C + (C / 4) * T);
        const float * sx = dx + T;
        for (int64_t ti = ta; ti < tz; ++ti) {
            for (int64_t tb = 0; tb < T; tb += 4) {
                const int nt = (int) (T - tb < 4 ? T - tb : 4);
                __m512i acc[4][4];
                tile_acc_vnni(cm, s, bits, ti, cols, x4, n_groups, T, tb, nt, acc);
                for (int m = 0; m < 4; ++m) {
                    const int64_t row = ti * TILE + 16 * m;
                    if (row >= s->n_rows) break;
                    __m512 a, b;
                    seg_ab16(s, row, c * C, &a, &b);
                    for (int t = 0; t < nt; ++t) {
                        float * yp = y + (tb + t) * ldy + s->row0 + row;
                        const __m512 v = _mm512_mul_ps(_mm512_set1_ps(dx[tb + t]), _mm512_cvtepi32_ps(acc[t][m]));
                        __m512 yv = _mm512_fmadd_ps(a, v, _mm512_loadu_ps(yp));
                        yv = _mm512_fmadd_ps(b, _mm512_set1_ps(sx[tb + t]), yv);
                        _mm512_storeu_ps(yp, yv);
                    }
                }
            }
        }
    }
}
#endif

static void seg_tiles_scalar(const struct pi_colmat * cm, const struct pi_colmat_seg * s, int64_t ta, int64_t tz,
                             const struct ggml_tensor * prep, int64_t T, float * y, int64_t ldy) {
    const int64_t C = cm->chunk, n_chunks = prep->ne[1];
    int32_t acc[PI_COLMAT_MAX_TOKENS][TILE];
    for (int64_t c = 0; c < n_chunks; ++c) {
        const int32_t * rec = (const int32_t *) ((const char *) prep->data + c * prep->nb[1]);
        const int32_t n_groups = rec[0];
        if (n_groups == 0) continue;
        const int32_t * x4 = rec + 1 + C;
        const float * dx = (const float *) (rec + 1 + C + (C / 4) * T);
        const float * sx = dx + T;
        for (int64_t ti = ta; ti < tz; ++ti) {
            tile_acc_scalar(cm, s, ti, rec + 1, x4, n_groups, T, acc);
            for (int r = 0; r < TILE && ti * TILE + r < s->n_rows; ++r) {
                const int64_t row = ti * TILE + r;
                float a, b;
                seg_ab(s, row, c * C, &a, &b);
                for (int64_t t = 0; t < T; ++t) {
                    float * yp = y + t * ldy + s->row0 + row;
                    *yp = fmaf(b, sx[t], fmaf(a, dx[t] * (float) acc[t][r], *yp));
                }
            }
        }
    }
}

// Forces the scalar kernels (tests compare the two).
static bool g_force_scalar = false;
void pi_colmat_force_scalar(bool on) { g_force_scalar = on; }

static void product_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const struct pi_colmat * cm = userdata;
    const struct ggml_tensor * prep = dst->src[0];
    const int64_t T = dst->ne[1], ldy = dst->nb[1] / sizeof(float);
    float * y = (float *) dst->data;
    // Tiles of all segments in order; this thread's share.
    int64_t n_tiles = 0;
    for (int k = 0; k < cm->n_segs; ++k) n_tiles += cm->seg[k].n_tiles;
    const int64_t g0 = n_tiles * ith / nth, g1 = n_tiles * (ith + 1) / nth;
    int64_t base = 0;
    for (int k = 0; k < cm->n_segs; ++k) {
        const struct pi_colmat_seg * s = &cm->seg[k];
        const int64_t ta = (g0 > base ? g0 : base) - base, tz = (g1 < base + s->n_tiles ? g1 : base + s->n_tiles) - base;
        base += s->n_tiles;
        if (ta >= tz) continue;
        const int64_t r0 = ta * TILE, r1 = tz * TILE < s->n_rows ? tz * TILE : s->n_rows;
        for (int64_t t = 0; t < T; ++t) memset(y + t * ldy + s->row0 + r0, 0, sizeof(float) * (size_t) (r1 - r0));
#ifdef PI_CM_VNNI
        if (!g_force_scalar) {
            switch (s->bits) {
                case 4: seg_tiles_vnni(cm, s, 4, ta, tz, prep, T, y, ldy); break;
                case 5: seg_tiles_vnni(cm, s, 5, ta, tz, prep, T, y, ldy); break;
                case 6: seg_tiles_vnni(cm, s, 6, ta, tz, prep, T, y, ldy); break;
                default: seg_tiles_vnni(cm, s, 8, ta, tz, prep, T, y, ldy); break;
            }
            continue;
        }
#endif
        seg_tiles_scalar(cm, s, ta, tz, prep, T, y, ldy);
    }
}

struct ggml_tensor * pi_input_sparse_matmul(struct ggml_context * ctx, const struct pi_colmat * cm,
                                            struct ggml_tensor * x, struct pi_active_stat * stat) {
    GGML_ASSERT(x->type == GGML_TYPE_F32 && x->ne[0] == cm->n_in && x->nb[0] == sizeof(float) && x->ne[2] == 1 && x->ne[3] == 1);
    GGML_ASSERT(x->ne[1] >= 1 && x->ne[1] <= PI_COLMAT_MAX_TOKENS);
    const int64_t C = cm->chunk;
    struct ggml_tensor * xa[1] = { x };
    struct ggml_tensor * prep = ggml_custom_4d(ctx, GGML_TYPE_I32, rec_len(C, x->ne[1]), cm->n_in / C, 1, 1, xa, 1, prepare_op,
                                               GGML_N_TASKS_MAX, stat);
    struct ggml_tensor * pa[1] = { prep };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, cm->n_out, x->ne[1], 1, 1, pa, 1, product_op, GGML_N_TASKS_MAX, (void *) cm);
}
