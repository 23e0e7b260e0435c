// input_sparse.c - the column copy of a matrix group and the input-sparse product (see
// input_sparse.h). Two graph nodes per product: `prepare` finds each chunk's kept columns
// and quantizes their inputs, `product` runs the columns. Each thread of the product owns
// whole tiles of output rows, and a row's sum runs over the chunks in column order, so
// results depend neither on the thread count nor on the rest of the batch.
#include "kernel_variant.h"  // first: this file is built once per ISA level
#include "input_sparse.h"
#include "kernel_levels.h"

#include "ggml-cpu.h"

#include <math.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

// The kernels of this build (kernel_variant.h: one build per ISA level): AVX-512 VNNI, AVX2
// (with 256-bit VNNI where the CPU has AVX-VNNI), NEON with the dot product instructions
// (aarch64, armv8.2-a + dotprod), or scalar. All give the same bits.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define PI_CM_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PI_CM_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define PI_CM_NEON 1
#endif
#if defined(PI_CM_VNNI) || defined(PI_CM_AVX2) || defined(PI_CM_NEON)
#define PI_CM_SIMD 1
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
// A column's rows come in tiles of 128, each two halves of 64. Within a half, row
// 16m + 4L + d sits at position 16L + 4m + d: the kernel interleaves four columns' 64
// positions with unpack instructions that work inside 128-bit lanes, and this order makes
// their results come out as rows 16m .. 16m + 15 in register m. A segment's part of a
// column is its tiles' low planes, then their high planes (so that the low planes, loaded
// whole, sit on cache-line boundaries):
//   low, 4 to 6 bits: 64 bytes a tile, byte p = position p of the first half in its low
//                 nibble and of the second half in its high nibble;
//   low, 8 bits:  128 bytes a tile, the first half's positions then the second's;
//   high:         5 and 6 bits: for each bit above the fourth, a 64-bit mask of it by
//                 position for the first half, then for the second (16 or 32 bytes a tile).

#define HALF (TILE / 2)

static inline int tile_pos(int r) {
    const int m = r / 16, L = (r % 16) / 4, d = r % 4;
    return 16 * L + 4 * m + d;
}

static size_t tile_lo_bytes(int bits) { return bits == 8 ? 128 : 64; }
static size_t tile_hi_bytes(int bits) { return bits == 8 ? 0 : 16 * (size_t) (bits - 4); }

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

// K-quants' 6-bit scales and minimums stay 6 bits, as in the file (bytes would read 20
// bytes a row and super-block where the file has 16: 2.7% more of a Q4_K matrix, read at
// every step whatever the sparsity). A group of them is a little-endian bit stream, value i
// at bits 6i .. 6i + 5:
//   sc:   per sub-block (32 columns), the rows in groups of 16: 12 bytes a group;
//   mins: per super-block and row, the row's 8 minimums: 6 bytes.
// The SIMD kernels load 16 (sc) or 64 (mins) bytes at a group's start, so each array has
// PI_CM_K6_SLACK bytes after it.
#define PI_CM_K6_SLACK 64

static inline uint8_t get6(const uint8_t * p, int i) {
    const int bit = 6 * i, b = bit / 8, sh = bit % 8;
    unsigned v = (unsigned) p[b] >> sh;
    if (sh > 2) v |= (unsigned) p[b + 1] << (8 - sh);
    return (uint8_t) (v & 63);
}

// Writes value i of a group; touches only the bytes that hold its bits (threads fill
// neighbouring groups at once).
static inline void put6(uint8_t * p, int i, uint8_t v) {
    const int bit = 6 * i, b = bit / 8, sh = bit % 8;
    p[b] = (uint8_t) ((p[b] & ~(63u << sh)) | ((unsigned) v << sh));
    if (sh > 2) p[b + 1] = (uint8_t) ((p[b + 1] & ~(63u >> (8 - sh))) | ((unsigned) v >> (8 - sh)));
}

// Bytes of the 6-bit scales of n rows (a multiple of 16) of one sub-block.
static inline size_t k6_bytes(int64_t n) { return (size_t) n / 16 * 12; }
// Where the group of 16 rows holding row `row`'s scale of sub-block sub starts (rows: the
// segment's padded rows); the scale is value row % 16 of the group.
static inline size_t sc_group(size_t rows, int64_t sub, int64_t row) { return (size_t) sub * k6_bytes((int64_t) rows) + k6_bytes(row); }
// The 8 minimums of row `row` in super-block sb.
static inline size_t min_group(size_t rows, int64_t sb, int64_t row) { return ((size_t) sb * rows + (size_t) row) * 6; }

static inline uint8_t k_sc(const uint8_t * sc, size_t rows, int64_t sub, int64_t row) { return get6(sc + sc_group(rows, sub, row), (int) (row % 16)); }
static inline uint8_t k_min(const uint8_t * mins, size_t rows, int64_t sub, int64_t row) { return get6(mins + min_group(rows, sub / 8, row), (int) (sub % 8)); }

static struct scale_sizes scale_sizes(const struct pi_colmat_seg * s, int64_t n_in) {
    const size_t rows = (size_t) s->n_tiles * TILE;
    struct scale_sizes z = { 0, 0, 0, 0 };
    switch (s->scales) {
        case PI_CM_D:  z.d = rows * (size_t) (n_in / QK) * 2; break;
        case PI_CM_DM: z.d = z.m = rows * (size_t) (n_in / QK) * 2; break;
        case PI_CM_K:
            z.d = z.m = rows * (size_t) (n_in / QK_K) * 2;
            z.sc   = k6_bytes((int64_t) rows) * (size_t) (n_in / QK) + PI_CM_K6_SLACK;
            z.mins = rows * 6 * (size_t) (n_in / QK_K) + PI_CM_K6_SLACK;
            break;
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
        s->pad0    = cm->n_pad;
        s->n_rows  = w[k]->ne[1];
        s->n_tiles = (s->n_rows + TILE - 1) / TILE;
        s->lo      = tile_lo_bytes(s->bits);
        s->hi      = tile_hi_bytes(s->bits);
        s->rec     = s->lo + s->hi;
        s->col_off = cm->col_stride;
        cm->col_stride += (size_t) s->n_tiles * s->rec;
        cm->n_out += s->n_rows;
        cm->n_pad += s->n_tiles * TILE;
        if (s->unit < cm->chunk) cm->chunk = s->unit;
    }
    cm->n_segs     = n;
    cm->col_stride = pad64(cm->col_stride);
    // K-quants only: the input is quantized per 256 (one step per super-block, as ggml's
    // Q8_K) and each row's sums fold in integers over a super-block; else per 32.
    cm->xblock = QK_K;
    for (int k = 0; k < n; ++k) {
        if (cm->seg[k].scales != PI_CM_K && cm->seg[k].scales != PI_CM_6K) cm->xblock = QK;
    }
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
                    uint8_t scj, mj;
                    k_scale_min(q4 ? x4->scales : x5->scales, j, &scj, &mj);
                    put6(sc + sc_group(rows, sb * 8 + j, row), (int) (row % 16), scj);
                    put6(mins + min_group(rows, sb, row), j, mj);
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

// The high plane of a 6-bit tile: bits 4-5 of position p at byte p % 32, bits 2 * (p / 32)
// and up. A half's 64 positions then come from one 32-byte load, copied to both 256-bit
// lanes and shifted by a constant per lane (half_u8); two bit masks per half, each added
// under its mask, cost more on the 2 EPYC cores measured (bench-input-sparse, Qwen2.5-1.5B's
// Q6_K down at 40%: 0.229 -> 0.219 ms and its head 3.15 -> 2.89 ms in a first test).
static inline void pack_hi2(const uint8_t * v, uint8_t * hi) {
    for (int i = 0; i < 32; ++i) {
        hi[i] = (uint8_t) (((v[i] >> 4) & 3) | (((v[32 + i] >> 4) & 3) << 2) | (((v[64 + i] >> 4) & 3) << 4) |
                           (((v[96 + i] >> 4) & 3) << 6));
    }
}

// One column's tile from its 128 q (two halves, each in position order): its low plane
// at lo, its high plane at hi: 5 bits, bit 4 of each half's positions as a 64-bit mask;
// 6 bits, pack_hi2's.
static inline void pack_record(const uint8_t * v, int bits, uint8_t * lo, uint8_t * hi) {
    if (bits == 8) {
        memcpy(lo, v, TILE);
        return;
    }
#ifdef PI_CM_VNNI
    const __m512i a = _mm512_loadu_si512(v), b = _mm512_loadu_si512(v + HALF);
    const __m512i mk = _mm512_set1_epi8(0x0F);
    _mm512_storeu_si512(lo, _mm512_or_si512(_mm512_and_si512(a, mk), _mm512_slli_epi16(_mm512_and_si512(b, mk), 4)));
    if (bits == 6) {
        pack_hi2(v, hi);
        return;
    }
    for (int hb = 4; hb < bits; ++hb) {
        const uint64_t ma = _cvtmask64_u64(_mm512_test_epi8_mask(a, _mm512_set1_epi8((char) (1 << hb))));
        const uint64_t mb = _cvtmask64_u64(_mm512_test_epi8_mask(b, _mm512_set1_epi8((char) (1 << hb))));
        memcpy(hi + 16 * (hb - 4), &ma, 8);
        memcpy(hi + 16 * (hb - 4) + 8, &mb, 8);
    }
#else
    for (int p = 0; p < HALF; ++p) lo[p] = (uint8_t) ((v[p] & 0x0F) | ((v[HALF + p] & 0x0F) << 4));
    if (bits == 6) {
        pack_hi2(v, hi);
        return;
    }
    for (int hb = 4; hb < bits; ++hb) {
        uint64_t ma = 0, mb = 0;
        for (int p = 0; p < HALF; ++p) {
            ma |= (uint64_t) ((v[p] >> hb) & 1) << p;
            mb |= (uint64_t) ((v[HALF + p] >> hb) & 1) << p;
        }
        memcpy(hi + 16 * (hb - 4), &ma, 8);
        memcpy(hi + 16 * (hb - 4) + 8, &mb, 8);
    }
#endif
}

// A segment's low and high planes of tile ti in the column at col (the segment's part).
static inline const uint8_t * tile_lo(const struct pi_colmat_seg * s, const uint8_t * col, int64_t ti) {
    return col + (size_t) ti * s->lo;
}
static inline const uint8_t * tile_hi(const struct pi_colmat_seg * s, const uint8_t * col, int64_t ti) {
    return col + (size_t) s->n_tiles * s->lo + (size_t) ti * s->hi;
}

void pi_colmat_fill(const struct pi_colmat * cm, struct ggml_tensor * const * w, int ith, int nth) {
    uint8_t q[TILE][QK];        // 128 rows x 32 columns of one block, row order
    uint8_t colq[QK][TILE];     // the same, a column's 128 q: two halves in position order
    int row_of[TILE];
    for (int p = 0; p < TILE; ++p) row_of[p] = (p / HALF) * HALF + tile_pos(p % HALF);  // the order is its own inverse
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
                    const uint8_t * col = cm->q + (size_t) (b * QK + l) * cm->col_stride + s->col_off;
                    pack_record(colq[l], s->bits, (uint8_t *) tile_lo(s, col, ti), (uint8_t *) tile_hi(s, col, ti));
                }
            }
        }
    }
}

// q at position p (of the first half, or p - 64 of the second) of one column's tile.
static inline uint8_t rec_q(const uint8_t * lo, const uint8_t * hi, int bits, int p) {
    if (bits == 8) {
        return lo[p];
    }
    const int h = p / HALF, pp = p % HALF;
    uint8_t v = (uint8_t) (h ? lo[pp] >> 4 : lo[pp] & 0x0F);
    if (bits == 6) {
        return (uint8_t) (v | ((hi[p % 32] >> (2 * (p / 32))) & 3) << 4);
    }
    for (int hb = 4; hb < bits; ++hb) {
        v |= (uint8_t) (((hi[16 * (hb - 4) + 8 * h + pp / 8] >> (pp % 8)) & 1) << hb);
    }
    return v;
}

// The position in a tile of row r of the tile.
static inline int row_pos(int r) { return (r / HALF) * HALF + tile_pos(r % HALF); }

// ---- prepare: kept columns and quantized inputs ------------------------------------------
//
// Per chunk of C columns a record of rec_len(C, T) int32:
//   [0]                   number of groups of 4 kept columns (the union over the batch)
//   [1, 1 + C)            their column ids, groups of 4; the unused slots repeat the last id
//   [1 + C + g*T + t]     token t's 8-bit inputs of group g, packed into one int32
//   then float dx[T]      token t's quantization step of the chunk's xblock columns
//   then sx[T]            token t's sum of its kept inputs in the chunk: float (xblock 32), or
//                         int32, the sum of their 8-bit values (xblock 256)

static inline int64_t rec_len(int64_t C, int64_t T) { return 1 + C + (C / 4) * T + 2 * T; }

static inline int32_t round_away(float v) { return (int32_t) (v >= 0.0f ? v + 0.5f : v - 0.5f); }  // roundf

// The sum of 16 floats in a fixed tree (v[i] + v[i + 8], then + 4, then (0 + 2) + (1 + 3)), the
// order of gcc's _mm512_reduce_add_ps: every level sums a chunk's kept inputs this way, so
// they all give the same bits.
static inline float sum16(const float * v) {
    float a[8], b[4];
    for (int i = 0; i < 8; ++i) a[i] = v[i + 8] + v[i];
    for (int i = 0; i < 4; ++i) b[i] = a[i + 4] + a[i];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

struct prep_view {
    int32_t * base;
    int64_t   R;         // int32 per record
    int64_t   n_chunks;
};

// Records of the chunks of quantization blocks [b0, b1) of x (F32 [n_in, T]); returns the
// kept entries counted per token.
static int64_t prepare_blocks(const struct pi_colmat * cm, float tau, const struct ggml_tensor * x, const struct prep_view * pv,
                              int64_t b0, int64_t b1) {
    const int64_t T = x->ne[1], C = cm->chunk, X = cm->xblock, R = pv->R;
    const bool kmode = X == QK_K;
    int64_t kept_total = 0;
    for (int64_t bx = b0; bx < b1; ++bx) {
        float dxs[PI_COLMAT_MAX_TOKENS], ids[PI_COLMAT_MAX_TOKENS];
        for (int64_t t = 0; t < T; ++t) {
            const float * xt = (const float *) ((const char *) x->data + t * x->nb[1]) + bx * X;
            float amax = 0.0f;
            bool bad = false;
#ifdef PI_CM_VNNI
            __m512 mx = _mm512_setzero_ps();
            __mmask16 nonfinite = 0;
            for (int64_t j = 0; j < X; j += 16) {
                const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(xt + j));
                const __mmask16 keep = _mm512_cmp_ps_mask(a, _mm512_set1_ps(tau), _CMP_NLE_UQ);  // !(a <= tau): NaN kept
                mx = _mm512_mask_max_ps(mx, keep, mx, a);
                nonfinite |= _mm512_mask_cmp_ps_mask(keep, a, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);
            }
            amax = _mm512_reduce_max_ps(mx);
            bad = nonfinite != 0;
#elif defined(PI_CM_AVX2)
            // the same max (exact in any order) and the same test, 8 a step: a kept NaN or
            // infinity makes the block's step NaN whatever amax holds
            __m256 mx = _mm256_setzero_ps();
            int nonfinite = 0;
            for (int64_t j = 0; j < X; j += 8) {
                const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(xt + j));
                const __m256 keep = _mm256_cmp_ps(a, _mm256_set1_ps(tau), _CMP_NLE_UQ);  // !(a <= tau): NaN kept
                mx = _mm256_max_ps(mx, _mm256_and_ps(keep, a));
                nonfinite |= _mm256_movemask_ps(_mm256_and_ps(keep, _mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ)));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            bad = nonfinite != 0;
#else
            for (int64_t j = 0; j < X; ++j) {
                const float a = fabsf(xt[j]);
                if (!(a <= tau)) {  // NaN is kept: it must reach the output
                    amax = a > amax ? a : amax;
                    bad |= !(a < INFINITY);
                }
            }
#endif
            dxs[t] = bad ? NAN : amax / 127.0f;
            ids[t] = dxs[t] > 0.0f && isfinite(dxs[t]) ? 1.0f / dxs[t] : 0.0f;
        }
        for (int64_t c = bx * X / C; c < (bx + 1) * X / C; ++c) {
            int32_t * rec = pv->base + c * R;
            int32_t * cols = rec + 1;
            int32_t * x4 = rec + 1 + C;
            float * dx = (float *) (rec + 1 + C + (C / 4) * T);
            float * sx = dx + T;
            int32_t * s8 = (int32_t *) sx;
            const int64_t j0 = c * C;
            uint32_t keep[PI_COLMAT_MAX_TOKENS];  // bit l: column j0 + l kept for token t
            uint32_t any = 0;
            for (int64_t t = 0; t < T; ++t) {
                const float * xt = (const float *) ((const char *) x->data + t * x->nb[1]) + j0;
                uint32_t k = 0;
#ifdef PI_CM_VNNI
                for (int64_t l = 0; l < C; l += 16) {
                    k |= (uint32_t) _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(xt + l)), _mm512_set1_ps(tau), _CMP_NLE_UQ) << l;
                }
#elif defined(PI_CM_AVX2)
                for (int64_t l = 0; l < C; l += 8) {
                    const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(xt + l));
                    k |= (uint32_t) _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(tau), _CMP_NLE_UQ)) << l;
                }
#else
                for (int64_t l = 0; l < C; ++l) k |= (uint32_t) !(fabsf(xt[l]) <= tau) << l;
#endif
                keep[t] = k;
                any |= k;
                kept_total += __builtin_popcount(k);
            }
            int32_t n = 0;
            for (uint32_t m = any; m; m &= m - 1) cols[n++] = (int32_t) (j0 + __builtin_ctz(m));
            const int32_t n_groups = (n + 3) / 4;
            for (int32_t i = n; i < C; ++i) cols[i] = n ? cols[n - 1] : (int32_t) j0;
            rec[0] = n_groups;
            for (int64_t t = 0; t < T; ++t) {
                const float * xt = (const float *) ((const char *) x->data + t * x->nb[1]);
                const float id = ids[t];
                int32_t sum8 = 0;
                int8_t q[32] = { 0 };
#ifdef PI_CM_VNNI
                // the chunk's inputs quantized, token t's kept ones (others 0), packed down to the union's order;
                // the sum the fold needs: of the 8-bit values (xblock 256, one reduction a chunk) or of the inputs
                __m512i s8v = _mm512_setzero_si512();
                for (int64_t l = 0; l < C; l += 16) {
                    const __m512 xv = _mm512_loadu_ps(xt + j0 + l);
                    const __mmask16 kt = (__mmask16) (keep[t] >> l), ku = (__mmask16) (any >> l);
                    const __m512 v = _mm512_mul_ps(xv, _mm512_set1_ps(id));
                    // roundf: away from zero (ggml's quantization), NaN and inf to 0
                    const __m512 half = _mm512_or_ps(_mm512_and_ps(v, _mm512_set1_ps(-0.0f)), _mm512_set1_ps(0.5f));
                    const __mmask16 fin = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
                    const __m512i qi = _mm512_maskz_cvttps_epi32(kt & fin, _mm512_add_ps(v, half));
                    s8v = _mm512_add_epi32(s8v, qi);
                    const int pos = __builtin_popcount(any & ((1u << l) - 1));
                    _mm_storeu_si128((__m128i *) (q + pos), _mm512_cvtepi32_epi8(_mm512_maskz_compress_epi32(ku, qi)));
                }
                sum8 = _mm512_reduce_add_epi32(s8v);
#elif defined(PI_CM_AVX2)
                // the same, 8 a step: the quantized values (kept and finite, else 0) as bytes,
                // then the union's ones moved down in order (AVX2 has no compress)
                __m256i s8v = _mm256_setzero_si256();
                const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
                int32_t pos = 0;
                for (int64_t l = 0; l < C; l += 8) {
                    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xt + j0 + l), _mm256_set1_ps(id));
                    const __m256 half = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(0.5f));
                    const __m256 fin = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v), _mm256_set1_ps(INFINITY), _CMP_LT_OQ);
                    const __m256i kt = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int) (keep[t] >> l)), bit), bit);
                    const __m256i qi = _mm256_and_si256(_mm256_cvttps_epi32(_mm256_add_ps(v, half)),
                                                        _mm256_and_si256(kt, _mm256_castps_si256(fin)));
                    s8v = _mm256_add_epi32(s8v, qi);
                    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
                    const uint64_t bytes = (uint64_t) _mm_cvtsi128_si64(_mm_packs_epi16(w, w));
                    for (uint32_t m = (any >> l) & 0xFFu; m; m &= m - 1) q[pos++] = (int8_t) (bytes >> (8 * __builtin_ctz(m)));
                }
                const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8v), _mm256_extracti128_si256(s8v, 1));
                const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
                sum8 = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
#else
                for (int32_t i = 0; i < n; ++i) {
                    const int64_t j = cols[i];
                    if (keep[t] >> (j - j0) & 1) {
                        const float v = xt[j] * id;
                        const int32_t q8 = isfinite(v) ? round_away(v) : 0;
                        q[i] = (int8_t) q8;
                        sum8 += q8;
                    }
                }
#endif
                for (int32_t g = 0; g < n_groups; ++g) {
                    uint32_t packed;
                    memcpy(&packed, q + 4 * g, 4);
                    x4[g * T + t] = (int32_t) packed;
                }
                dx[t] = dxs[t];
                // the offsets' term sums the 8-bit inputs, as the weights' term does (and as
                // ggml's dot products do): w = a * q + b then meets one quantized input, and the
                // quantization's error scales with |w|, not with |a * q| (for Q4_1 on a real
                // layer's input, 3x less: SmolLM2's blk.0.attn_v 6.7% -> 2.2%, ggml's own 2.2%)
                if (kmode) {
                    s8[t] = sum8;
                } else {
                    sx[t] = isfinite(dxs[t]) ? (float) sum8 * dxs[t] : NAN;
                }
            }
        }
    }
    return kept_total;
}

// ---- the product ------------------------------------------------------------------------
//
// The columns are split into PI_CM_PIECES pieces (super-blocks with xblock 256, else
// chunks), a function of the shape alone; threads claim pieces from a counter, and each
// piece sums into its own partial output, so a thread reads whole kept columns: runs of
// the group's rows, long enough for the memory system. A second op adds the partials in
// piece order, so the result depends neither on the thread count nor on who ran what.
// In a piece, for each chunk, the groups of 4 kept columns add q * x8 into 32-bit sums per
// row (acc), 16 rows per register and one vpdpbusd per token; then the sums fold: with
// xblock 32 into the partial per chunk, y += a * dx * acc + b * sx (float scales); with
// xblock 256 into integer sums per super-block, t += sc * acc, and at its end
// y += d * dx * (t - offsets) (- dmin * dx * sum(m * s8) for Q4_K / Q5_K), as ggml's K-quant
// dot products do.

#ifndef PI_CM_PIECES
#define PI_CM_PIECES 16
#endif
// Tiles ahead whose lines a pass brings into L2 (about bandwidth x latency in flight).
// Measured on Qwen2.5-1.5B's gate+up (2 EPYC cores): 24 tiles ahead ran 8-10% faster than
// 12; columns shorter than that prefetch the next pass's columns at the same tile.
#ifndef PI_CM_PREFETCH_TILES
#define PI_CM_PREFETCH_TILES 24
#endif
// The scales, read once per chunk (sc) or super-block (d, m, mins) whenever it keeps a
// column, are prefetched too: a chunk's sc with its columns' tiles, a super-block's d, m
// and mins PI_CM_SCALE_AHEAD rows ahead of its fold. Measured on Qwen2.5-1.5B's down
// (bench-input-sparse, 2 EPYC cores, 40%): Q4_K 0.198 -> 0.183 ms, Q6_K 0.258 -> 0.247 ms
// (medians of 5); gate+up and q/k/v unchanged. 0 turns it off.
#ifndef PI_CM_SCALE_PREFETCH
#define PI_CM_SCALE_PREFETCH 1
#endif
#ifndef PI_CM_SCALE_AHEAD
#define PI_CM_SCALE_AHEAD 256
#endif

struct chunk_view {
    int32_t         n_groups;
    const int32_t * cols;
    const int32_t * x4;
    const float *   dx;
    const float *   sx;   // xblock 32
    const int32_t * s8;   // xblock 256
};

static inline struct chunk_view chunk_at(const struct prep_view * prep, int64_t c, int64_t C, int64_t T) {
    const int32_t * rec = prep->base + c * prep->R;
    const float * dx = (const float *) (rec + 1 + C + (C / 4) * T);
    return (struct chunk_view) { rec[0], rec + 1, rec + 1 + C, dx, dx + T, (const int32_t *) (dx + T) };
}

// The scale and offset of row `row` of a segment for column j (scalar; pi_colmat_row).
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
            *a = ggml_fp16_to_fp32(s->d[(size_t) (j / QK_K) * rows + row]) * (float) k_sc(s->sc, rows, j / QK, row);
            *b = -(ggml_fp16_to_fp32(s->m[(size_t) (j / QK_K) * rows + row]) * (float) k_min(s->mins, rows, j / QK, row));
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
    const int p = row_pos((int) (rr % TILE));
    for (int64_t j = 0; j < cm->n_in; ++j) {
        const uint8_t * col = cm->q + (size_t) j * cm->col_stride + s->col_off;
        float aj, bj;
        seg_ab(s, rr, j, &aj, &bj);
        w[j] = aj * (float) rec_q(tile_lo(s, col, ti), tile_hi(s, col, ti), s->bits, p) + bj;
        if (a) a[j] = aj;
        if (b) b[j] = bj;
    }
}

// The pieces: units (super-blocks or chunks) [unit0(p), unit0(p + 1)) of n_units.
static inline int64_t n_units_of(const struct pi_colmat * cm) { return cm->n_in / (cm->xblock == QK_K ? QK_K : cm->chunk); }

// Scratch of one piece: its partial output y [T][n_pad] (float), the sums acc and t
// [T][n_pad] (int32); rows of segment k from s->pad0 (each segment padded to whole tiles).
struct piece_buf {
    float *   y;
    int32_t * acc;
    int32_t * t;
    int64_t   ga, gb;  // the tiles (of all segments, in order) this piece computes
};

// The tiles of segment k within [ga, gb): [*ta, *tz) of the segment.
static inline void seg_tiles(const struct pi_colmat * cm, int k, int64_t ga, int64_t gb, int64_t * ta, int64_t * tz) {
    int64_t base = 0;
    for (int i = 0; i < k; ++i) base += cm->seg[i].n_tiles;
    const int64_t n = cm->seg[k].n_tiles;
    *ta = ga - base < 0 ? 0 : ga - base > n ? n : ga - base;
    *tz = gb - base < 0 ? 0 : gb - base > n ? n : gb - base;
}

// Zeroes the piece's rows of a [T][n_pad] plane of 4-byte values (y, acc or t): a column
// piece's row pieces share its plane of partials, so a piece touches only its own rows.
static void zero_piece_rows(void * plane, int64_t T, int64_t n_pad, struct piece_buf pb) {
    for (int64_t t = 0; t < T; ++t) {
        memset((uint32_t *) plane + t * n_pad + pb.ga * TILE, 0, sizeof(uint32_t) * (size_t) ((pb.gb - pb.ga) * TILE));
    }
}

// ---- scalar kernels (any CPU; the bits of the SIMD ones) --

static void piece_scalar(const struct pi_colmat * cm, const struct prep_view * prep, int64_t T, int64_t u0, int64_t u1,
                         struct piece_buf pb) {
    const int64_t C = cm->chunk, n_pad = cm->n_pad;
    const bool kmode = cm->xblock == QK_K;
    const int64_t per = kmode ? QK_K / C : 1;
    int64_t ra[PI_COLMAT_MAX_SEGS], rz[PI_COLMAT_MAX_SEGS];  // the piece's rows of each segment
    for (int k = 0; k < cm->n_segs; ++k) {
        int64_t ta, tz;
        seg_tiles(cm, k, pb.ga, pb.gb, &ta, &tz);
        ra[k] = ta * TILE < cm->seg[k].n_rows ? ta * TILE : cm->seg[k].n_rows;
        rz[k] = tz * TILE < cm->seg[k].n_rows ? tz * TILE : cm->seg[k].n_rows;
    }
    zero_piece_rows(pb.y, T, n_pad, pb);
    for (int64_t u = u0; u < u1; ++u) {
        zero_piece_rows(pb.t, T, n_pad, pb);
        bool any = false;
        const float * dx = NULL;
        const int64_t c0 = u * per;
        for (int64_t c = c0; c < c0 + per; ++c) {
            const struct chunk_view v = chunk_at(prep, c, C, T);
            if (v.n_groups == 0) continue;
            any = true;
            dx = v.dx;
            zero_piece_rows(pb.acc, T, n_pad, pb);
            for (int k = 0; k < cm->n_segs; ++k) {
                const struct pi_colmat_seg * s = &cm->seg[k];
                for (int32_t g = 0; g < v.n_groups; ++g) {
                    for (int i = 0; i < 4; ++i) {
                        const uint8_t * col = cm->q + (size_t) v.cols[4 * g + i] * cm->col_stride + s->col_off;
                        for (int64_t r = ra[k]; r < rz[k]; ++r) {
                            const int32_t qv = rec_q(tile_lo(s, col, r / TILE), tile_hi(s, col, r / TILE), s->bits, row_pos((int) (r % TILE)));
                            for (int64_t t = 0; t < T; ++t) {
                                pb.acc[t * n_pad + s->pad0 + r] += qv * (int32_t) (int8_t) ((uint32_t) v.x4[g * T + t] >> (8 * i));
                            }
                        }
                    }
                }
                const size_t rows = (size_t) s->n_tiles * TILE;
                const int64_t j = c * C;
                for (int64_t r = ra[k]; r < rz[k]; ++r) {
                    for (int64_t t = 0; t < T; ++t) {
                        const int32_t acc = pb.acc[t * n_pad + s->pad0 + r];
                        if (!kmode) {
                            float a, b;
                            seg_ab(s, r, j, &a, &b);
                            float * yp = &pb.y[t * n_pad + s->pad0 + r];
                            *yp = fmaf(b, v.sx[t], fmaf(a, v.dx[t] * (float) acc, *yp));
                        } else {
                            const int32_t sc = s->scales == PI_CM_K ? (int32_t) k_sc(s->sc, rows, j / QK, r)
                                                                    : (int32_t) (int8_t) s->sc[(size_t) (j / 16) * rows + r];
                            pb.t[t * n_pad + s->pad0 + r] += sc * acc;
                        }
                    }
                }
            }
        }
        if (!kmode || !any) continue;
        for (int k = 0; k < cm->n_segs; ++k) {
            const struct pi_colmat_seg * s = &cm->seg[k];
            const size_t rows = (size_t) s->n_tiles * TILE;
            for (int64_t r = ra[k]; r < rz[k]; ++r) {
                const float d = ggml_fp16_to_fp32(s->d[(size_t) u * rows + r]);
                for (int64_t t = 0; t < T; ++t) {
                    int32_t off = 0;  // the offsets' share: sum over the super-block's chunks of m * s8 or 32 * sc * s8
                    for (int64_t c = c0; c < c0 + per; ++c) {
                        const int32_t s8 = chunk_at(prep, c, C, T).s8[t];
                        off += s->scales == PI_CM_K ? (int32_t) k_min(s->mins, rows, c * C / QK, r) * s8
                                                    : 32 * (int32_t) (int8_t) s->sc[(size_t) (c * C / 16) * rows + r] * s8;
                    }
                    float * yp = &pb.y[t * n_pad + s->pad0 + r];
                    if (s->scales == PI_CM_K) {
                        const float dm = ggml_fp16_to_fp32(s->m[(size_t) u * rows + r]);
                        float yv = fmaf((float) pb.t[t * n_pad + s->pad0 + r], d * dx[t], *yp);
                        *yp = fmaf(-(float) off, dm * dx[t], yv);
                    } else {
                        *yp = fmaf((float) (pb.t[t * n_pad + s->pad0 + r] - off), d * dx[t], *yp);
                    }
                }
            }
        }
    }
}

#ifdef PI_CM_SIMD
// For the K-quant minimums' fold at super-block c0 / per's end: per token t, the sums S of
// its 8-bit inputs over each of the 8 sub-blocks, as S = l + 128 h with l = S & 127 (bytes of
// l8[t]) and h = S >> 7 (signed bytes of h8[t]; |S| <= 32 * 127, so h fits). False when no
// segment has minimums (nothing is computed).
static bool sub_sum_bytes(const struct pi_colmat * cm, const struct prep_view * prep, int64_t c0, int64_t T, uint64_t * l8,
                          uint64_t * h8) {
    bool any_min = false;
    for (int k = 0; k < cm->n_segs; ++k) any_min |= cm->seg[k].scales == PI_CM_K;
    const int64_t C = cm->chunk, per = QK_K / C;
    for (int64_t t = 0; t < T && any_min; ++t) {
        int32_t S[8] = { 0 };
        for (int64_t c = c0; c < c0 + per; ++c) S[(c - c0) * C / QK] += chunk_at(prep, c, C, T).s8[t];
        l8[t] = h8[t] = 0;
        for (int i = 0; i < 8; ++i) {
            l8[t] |= (uint64_t) (uint8_t) (S[i] & 127) << (8 * i);
            h8[t] |= (uint64_t) (uint8_t) (int8_t) (S[i] >> 7) << (8 * i);
        }
    }
    return any_min;
}

// The per-chunk scales of column j's sub-block (K: 6-bit per 32 columns; 6K: int8 per 16).
static inline const uint8_t * seg_sc(const struct pi_colmat_seg * s, int64_t j) {
    const size_t rows = (size_t) (s->n_tiles * TILE);
    return s->sc + (s->scales == PI_CM_6K ? (size_t) (j / 16) * rows : sc_group(rows, j / QK, 0));
}

// Groups of 4 columns per pass over acc, at most: one pass covers a Q6_K chunk of 16, half
// a 32-column one. Each pass loads and stores (or folds) the sums once, so fewer passes are
// less work per kept column. Measured on Qwen2.5-1.5B's groups (bench-input-sparse, 2 EPYC
// cores, 4 groups against 2): down Q4_K at 40% 0.150-0.164 ms against 0.165-0.180, at 50%
// 0.132-0.143 against 0.155-0.166; down Q6_K at 50% 0.227-0.231 against 0.230-0.267;
// gate+up at 50% 0.247-0.266 against 0.279-0.300 (40%: the same); q/k/v and o 5-15% faster.
#define PI_CM_PASS_GROUPS 4
// The 256-bit x86 kernels (dec_seg, dec_seg_batch: the avx2 and avxvnni levels) add a pass's
// products in 16 bits (see there): with 4-bit q that holds 8 groups, a whole 32-column chunk,
// so matrices of 4-bit q alone (Q4_K, Q4_0 segments) take up to 8 groups a pass and load and
// store each token's sums half as often (pass_groups).
#if defined(__AVX2__) && !defined(__AVX512VNNI__) && !defined(__aarch64__)
#define PI_CM_MAX_GROUPS 8
#else
#define PI_CM_MAX_GROUPS PI_CM_PASS_GROUPS
#endif

// A prefetch into L2 (x86: prefetcht1; aarch64: prfm pldl2keep) and into L1.
#ifdef PI_CM_NEON
#define PI_CM_PREFETCH_L2(p) __builtin_prefetch((const void *) (p), 0, 2)
#define PI_CM_PREFETCH_L1(p) __builtin_prefetch((const void *) (p), 0, 3)
#else
#define PI_CM_PREFETCH_L2(p) _mm_prefetch((const char *) (p), _MM_HINT_T1)
#define PI_CM_PREFETCH_L1(p) _mm_prefetch((const char *) (p), _MM_HINT_T0)
#endif

// A pass's prefetches at tile ti of [ta, tz): PI_CM_PREFETCH_TILES tiles ahead, these
// columns' later tiles (p), then the next pass's first (q: npf columns), with the scales of
// the chunk they belong to (for the fold at its last pass).
static inline __attribute__((always_inline)) void pass_prefetch(const struct pi_colmat_seg * s, const int BITS, const int NG,
                                                                const uint8_t * const * p, const uint8_t * const * q, int npf,
                                                                const int32_t * cols, const int32_t * pf, int64_t ti,
                                                                int64_t ta, int64_t tz) {
    const int64_t ahead = ti + (tz - ta < PI_CM_PREFETCH_TILES ? tz - ta : PI_CM_PREFETCH_TILES);
    const bool here = ahead < tz;
    const int64_t tp = here ? ahead : ta + (ahead - tz);
    const uint8_t * const * src = here ? p : q;
    const int n = here ? 4 * NG : (tp < tz ? npf : 0);
    const size_t plo = (size_t) tp * s->lo, phi = (size_t) s->n_tiles * s->lo + (size_t) tp * s->hi;
    for (int i = 0; i < n; ++i) {
        PI_CM_PREFETCH_L2(src[i] + plo);
        if (BITS == 8) PI_CM_PREFETCH_L2(src[i] + plo + 64);
        if (BITS > 4 && BITS < 8 && (phi & 63) < (size_t) s->hi) PI_CM_PREFETCH_L2(src[i] + phi);
    }
#if PI_CM_SCALE_PREFETCH
    if (n > 0 && s->sc) {
        const uint8_t * sp = seg_sc(s, here ? cols[0] : pf[0]) + (s->scales == PI_CM_6K ? (size_t) (tp * TILE) : k6_bytes(tp * TILE));
        PI_CM_PREFETCH_L2(sp);
        PI_CM_PREFETCH_L2(sp + 64);
    }
#endif
}


#endif

#ifdef PI_CM_VNNI
// ---- AVX-512 VNNI kernels --

// 64 q of one half (h) of one column's tile as bytes, in position order: its low plane at
// lo, its high plane at hi. BITS is a constant.
static inline __attribute__((always_inline)) __m512i half_u8(const uint8_t * lo, const uint8_t * hi, const int BITS, const int h) {
    if (BITS == 8) {
        return _mm512_loadu_si512(lo + 64 * h);
    }
    const __m512i v = _mm512_loadu_si512(lo);
    const __m512i u = _mm512_and_si512(h ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F));
    if (BITS == 6) {
        // pack_hi2: lane 0 holds positions 0-31 of the half, lane 1 positions 32-63; their
        // bits 4-5 sit at bit 4h (lane 0) and 4h + 2 (lane 1) of each byte
        const __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) hi));
        const __m512i t = h ? _mm512_srlv_epi16(b, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1))
                            : _mm512_sllv_epi16(b, _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1));
        return _mm512_ternarylogic_epi32(u, t, _mm512_set1_epi8(0x30), 0xF8);  // u | (t & 0x30)
    }
    if (BITS == 5) return _mm512_mask_add_epi8(u, _load_mask64((__mmask64 *) (hi + 8 * h)), u, _mm512_set1_epi8(16));
    return u;
}

// The q of one half (64 rows) of 4 columns interleaved for vpdpbusd: w[m] lane i holds the 4
// columns' q of row 16m + i.
static inline __attribute__((always_inline)) void half_w(const uint8_t * const * p, size_t lo, size_t hi, const int BITS,
                                                         const int h, __m512i * w) {
    const __m512i u0 = half_u8(p[0] + lo, p[0] + hi, BITS, h), u1 = half_u8(p[1] + lo, p[1] + hi, BITS, h);
    const __m512i u2 = half_u8(p[2] + lo, p[2] + hi, BITS, h), u3 = half_u8(p[3] + lo, p[3] + hi, BITS, h);
    const __m512i a0 = _mm512_unpacklo_epi8(u0, u1), a1 = _mm512_unpackhi_epi8(u0, u1);
    const __m512i b0 = _mm512_unpacklo_epi8(u2, u3), b1 = _mm512_unpackhi_epi8(u2, u3);
    w[0] = _mm512_unpacklo_epi16(a0, b0);
    w[1] = _mm512_unpackhi_epi16(a0, b0);
    w[2] = _mm512_unpacklo_epi16(a1, b1);
    w[3] = _mm512_unpackhi_epi16(a1, b1);
}

// A group of 16 rows' 6-bit scales (12 bytes at p) as 16 int32. Word i takes the two bytes
// that hold bits 6i .. 6i + 5 and shifts them down (AVX512BW: any AVX-512 CPU that runs
// these kernels).
static inline __m512i k_sc16(const uint8_t * p) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) p));
    const __m256i at = _mm256_setr_epi8(0, 1, 0, 1, 1, 2, 2, 3, 3, 4, 3, 4, 4, 5, 5, 6,  // words 0-7 from bytes 0-5
                                        6, 7, 6, 7, 7, 8, 8, 9, 9, 10, 9, 10, 10, 11, 11, 12);
    const __m256i sh = _mm256_setr_epi16(0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2);
    const __m256i w = _mm256_and_si256(_mm256_srlv_epi16(_mm256_shuffle_epi8(b, at), sh), _mm256_set1_epi16(63));
    return _mm512_cvtepu16_epi32(w);
}

// Eight rows' 6-bit minimums (6 bytes a row from p) as bytes, row i's 8 in 64-bit lane i:
// each row's 48 bits moved to its lane (vpermw), then spread from 6-bit to 8-bit fields in
// three halvings (24 -> 32, 12 -> 16, 6 -> 8 bits apart), each a shift and a bit select.
static inline __m512i k_min8(const uint8_t * p) {
    static const uint16_t at[32] = { 0, 1, 2, 0, 3, 4, 5, 0, 6, 7, 8, 0, 9, 10, 11, 0,
                                     12, 13, 14, 0, 15, 16, 17, 0, 18, 19, 20, 0, 21, 22, 23, 0 };
    __m512i v = _mm512_permutexvar_epi16(_mm512_loadu_si512(at), _mm512_loadu_si512(p));
    // (mask ? a : b) is ternary logic 0xCA on (mask, a, b)
    v = _mm512_ternarylogic_epi64(_mm512_set1_epi64(0x00FFFFFF00000000LL), _mm512_slli_epi64(v, 8), v, 0xCA);
    v = _mm512_ternarylogic_epi64(_mm512_set1_epi64(0x0FFF00000FFF0000LL), _mm512_slli_epi64(v, 4), v, 0xCA);
    v = _mm512_ternarylogic_epi64(_mm512_set1_epi64(0x3F003F003F003F00LL), _mm512_slli_epi64(v, 2), v, 0xCA);
    return _mm512_and_si512(v, _mm512_set1_epi8(63));
}

// Sixteen rows' sums v of token t: stored into acc at a, or (fold) folded into t's
// super-block sums, tsum[i] (+)= sc * v with sc the rows' scales at scp + r (Q6_K: sc * (v -
// 32 * s8[t]), its offset).
static inline __attribute__((always_inline)) void put_sums(__m512i v, int32_t * a, const bool fold, const uint8_t * scp,
                                                           int64_t r, const bool six, const int32_t * s8, int64_t t,
                                                           int32_t * tsum, size_t i, bool t_first) {
    if (!fold) {
        _mm512_storeu_si512(a, v);
        return;
    }
    if (six) v = _mm512_sub_epi32(v, _mm512_set1_epi32(32 * s8[t]));
    const __m512i sc = six ? _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (scp + r))) : k_sc16(scp + k6_bytes(r));
    const __m512i pv = _mm512_mullo_epi32(sc, v);
    _mm512_storeu_si512(tsum + i, t_first ? pv : _mm512_add_epi32(_mm512_loadu_si512(tsum + i), pv));
}

// acc (+)= the q of NG (1 to PI_CM_PASS_GROUPS) groups of 4 columns times each token's 4
// inputs per group, over segment s's rows: one pass over acc for 4 * NG columns. first: acc starts from 0
// (nothing is read). pf: 4 * NG columns (the next pass's) whose lines are brought into L2
// along the way, or NULL (a column's run of a segment can be short: down's 768 bytes).
//
// fold (xblock 256, the chunk's last pass; j its first column): instead of storing acc, adds
// sc * acc into t (t_first: t starts from 0), sc the segment's scale of column j per row;
// for Q6_K sc * (acc - 32 * s8), its offset (s8: the tokens' sums of the chunk's inputs).
static inline __attribute__((always_inline)) void groups_seg(const struct pi_colmat * cm, const struct pi_colmat_seg * s,
                                                             const int BITS, const int NG, const int32_t * cols,
                                                             const int32_t * x4, int64_t T, int32_t * acc, bool first,
                                                             const int32_t * pf, int npf, const bool fold, int64_t j,
                                                             int32_t * tsum, bool t_first, const int32_t * s8, int64_t ta,
                                                             int64_t tz) {
    const bool six = s->scales == PI_CM_6K;
    const uint8_t * scp = fold ? seg_sc(s, j) : NULL;
    const int64_t n_pad = cm->n_pad;
    const uint8_t * p[4 * PI_CM_PASS_GROUPS], * q[4 * PI_CM_PASS_GROUPS];
    for (int i = 0; i < 4 * NG; ++i) p[i] = cm->q + (size_t) cols[i] * cm->col_stride + s->col_off;
    for (int i = 0; i < npf; ++i) q[i] = cm->q + (size_t) pf[i] * cm->col_stride + s->col_off;
    const __m512i z = _mm512_setzero_si512();
    __m512i x0[PI_CM_PASS_GROUPS];  // token 0's inputs of each group
    for (int g = 0; g < NG; ++g) x0[g] = _mm512_set1_epi32(x4[g * T]);
    for (int64_t ti = ta; ti < tz; ++ti) {
        const size_t lo = (size_t) ti * s->lo, hi = (size_t) s->n_tiles * s->lo + (size_t) ti * s->hi;
        pass_prefetch(s, BITS, NG, p, q, npf, cols, pf, ti, ta, tz);
        for (int h = 0; h < 2; ++h) {
            const int64_t r = ti * TILE + h * HALF;
            if (r >= s->n_rows) break;
            if (T == 1) {
                // one token (a decode step): the groups' q go straight into four running sums,
                // so that no group's interleaved q waits in memory for the others
                int32_t * a = acc + s->pad0 + r;
                __m512i v[4];
                for (int m = 0; m < 4; ++m) v[m] = first ? z : _mm512_loadu_si512(a + 16 * m);
                for (int g = 0; g < NG; ++g) {
                    __m512i w[4];
                    half_w(p + 4 * g, lo, hi, BITS, h, w);
                    for (int m = 0; m < 4; ++m) v[m] = _mm512_dpbusd_epi32(v[m], w[m], x0[g]);
                }
                for (int m = 0; m < 4; ++m) {
                    put_sums(v[m], a + 16 * m, fold, scp, r + 16 * m, six, s8, 0, tsum, s->pad0 + r + 16 * m, t_first);
                }
                continue;
            }
            __m512i w[PI_CM_PASS_GROUPS][4];
            for (int g = 0; g < NG; ++g) half_w(p + 4 * g, lo, hi, BITS, h, w[g]);
            for (int64_t t = 0; t < T; ++t) {
                __m512i xt[PI_CM_PASS_GROUPS];
                for (int g = 0; g < NG; ++g) xt[g] = t == 0 ? x0[g] : _mm512_set1_epi32(x4[g * T + t]);
                int32_t * a = acc + t * n_pad + s->pad0 + r;
                for (int m = 0; m < 4; ++m) {
                    __m512i v = first ? z : _mm512_loadu_si512(a + 16 * m);
                    for (int g = 0; g < NG; ++g) v = _mm512_dpbusd_epi32(v, w[g][m], xt[g]);
                    put_sums(v, a + 16 * m, fold, scp, r + 16 * m, six, s8, t, tsum, t * n_pad + s->pad0 + r + 16 * m, t_first);
                }
            }
        }
    }
}

// xblock 32: y (+)= a * (dx * acc) + b * sx over every segment's rows (first: from 0).
static void fold_float(const struct pi_colmat * cm, const struct chunk_view * v, int64_t j, int64_t T, struct piece_buf pb,
                       bool first) {
    const int64_t n_pad = cm->n_pad;
    for (int k = 0; k < cm->n_segs; ++k) {
        const struct pi_colmat_seg * s = &cm->seg[k];
        const size_t rows = (size_t) s->n_tiles * TILE;
        int64_t ta, tz;
        seg_tiles(cm, k, pb.ga, pb.gb, &ta, &tz);
        const int64_t r_end = tz * TILE < s->n_rows ? tz * TILE : s->n_rows;
        for (int64_t r = ta * TILE; r < r_end; r += 16) {
            __m512 a, b;
            switch (s->scales) {
                case PI_CM_D:
                    a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (s->d + (size_t) (j / QK) * rows + r)));
                    b = _mm512_mul_ps(_mm512_set1_ps(-(float) s->offset), a);
                    break;
                case PI_CM_DM:
                    a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (s->d + (size_t) (j / QK) * rows + r)));
                    b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (s->m + (size_t) (j / QK) * rows + r)));
                    break;
                case PI_CM_K: {
                    const __m512 d  = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (s->d + (size_t) (j / QK_K) * rows + r)));
                    const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (s->m + (size_t) (j / QK_K) * rows + r)));
                    a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(k_sc16(s->sc + sc_group(rows, j / QK, r))));
                    uint8_t mn[16];  // a K-quant beside 32-block types (rare): its minimums gathered
                    for (int i = 0; i < 16; ++i) mn[i] = k_min(s->mins, rows, j / QK, r + i);
                    b = _mm512_sub_ps(_mm512_setzero_ps(),
                                      _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) mn)))));
                    break;
                }
                default: {  // PI_CM_6K
                    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (s->d + (size_t) (j / QK_K) * rows + r)));
                    a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (s->sc + (size_t) (j / 16) * rows + r)))));
                    b = _mm512_mul_ps(_mm512_set1_ps(-(float) s->offset), a);
                    break;
                }
            }
            for (int64_t t = 0; t < T; ++t) {
                const int64_t i = t * n_pad + s->pad0 + r;
                const __m512 x = _mm512_mul_ps(_mm512_set1_ps(v->dx[t]), _mm512_cvtepi32_ps(_mm512_loadu_si512(pb.acc + i)));
                __m512 yv = _mm512_fmadd_ps(a, x, first ? _mm512_setzero_ps() : _mm512_loadu_ps(pb.y + i));
                _mm512_storeu_ps(pb.y + i, _mm512_fmadd_ps(b, _mm512_set1_ps(v->sx[t]), yv));
            }
        }
    }
}

// xblock 256, at a super-block's end: y (+)= d * dx * t (Q6_K: t holds its offsets already),
// and for Q4_K / Q5_K - dmin * dx * sum over sub-blocks s of m_s * S_s, S_s the sum of the
// tokens' 8-bit inputs in s. That sum is two vpdpbusd per 8 rows: S = l + 128 h with
// l = S & 127 and h = S >> 7 (|S| <= 32 * 127 = 4064, so h fits a signed byte), against a
// row's 8 minimums stored together.
static void fold_superblock(const struct pi_colmat * cm, const struct prep_view * prep, int64_t u, int64_t T,
                            const float * dx, struct piece_buf pb, bool first) {
    const int64_t C = cm->chunk, n_pad = cm->n_pad, per = QK_K / C, c0 = u * per;
    __m512i lo[PI_COLMAT_MAX_TOKENS], hi[PI_COLMAT_MAX_TOKENS];  // the sub-blocks' l and h bytes, lanes alternating 0-3 / 4-7
    uint64_t l8[PI_COLMAT_MAX_TOKENS], h8[PI_COLMAT_MAX_TOKENS];
    const bool any_min = sub_sum_bytes(cm, prep, c0, T, l8, h8);
    for (int64_t t = 0; t < T && any_min; ++t) {
        lo[t] = _mm512_set1_epi64((long long) l8[t]);
        hi[t] = _mm512_set1_epi64((long long) h8[t]);
    }
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd  = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int k = 0; k < cm->n_segs; ++k) {
        const struct pi_colmat_seg * s = &cm->seg[k];
        const size_t rows = (size_t) s->n_tiles * TILE;
        const bool mins = s->scales == PI_CM_K;
        int64_t ta, tz;
        seg_tiles(cm, k, pb.ga, pb.gb, &ta, &tz);
        const int64_t r_end = tz * TILE < s->n_rows ? tz * TILE : s->n_rows;
        for (int64_t r = ta * TILE; r < r_end; r += 16) {
#if PI_CM_SCALE_PREFETCH
            // the scales of rows PI_CM_SCALE_AHEAD on: a fold streams them from memory, one
            // read per super-block, which the pass's column prefetches do not cover
            if (r + PI_CM_SCALE_AHEAD < r_end) {
                const int64_t ra = r + PI_CM_SCALE_AHEAD;
                if (ra % 32 == 0) {
                    _mm_prefetch((const char *) (s->d + (size_t) u * rows + ra), _MM_HINT_T0);
                    if (mins) _mm_prefetch((const char *) (s->m + (size_t) u * rows + ra), _MM_HINT_T0);
                }
                if (mins) {
                    _mm_prefetch((const char *) (s->mins + min_group(rows, u, ra)), _MM_HINT_T0);
                    _mm_prefetch((const char *) (s->mins + min_group(rows, u, ra + 8)), _MM_HINT_T0);
                }
            }
#endif
            const __m512 d  = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (s->d + (size_t) u * rows + r)));
            const __m512 dm = mins ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (s->m + (size_t) u * rows + r)))
                                   : _mm512_setzero_ps();
            __m512i m0 = _mm512_setzero_si512(), m1 = m0;
            if (mins) {
                m0 = k_min8(s->mins + min_group(rows, u, r));      // rows r .. r + 7
                m1 = k_min8(s->mins + min_group(rows, u, r + 8));  // rows r + 8 .. r + 15
            }
            for (int64_t t = 0; t < T; ++t) {
                const int64_t i = t * n_pad + s->pad0 + r;
                const __m512 dxt = _mm512_set1_ps(dx[t]);
                const __m512 y0 = first ? _mm512_setzero_ps() : _mm512_loadu_ps(pb.y + i);
                __m512 yv = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(pb.t + i)), _mm512_mul_ps(d, dxt), y0);
                if (mins) {
                    const __m512i z = _mm512_setzero_si512();
                    // per lane: half a row's sum; lanes 2i, 2i+1 are row i's (of 8 in m0, then m1)
                    const __m512i a0 = _mm512_add_epi32(_mm512_dpbusd_epi32(z, m0, lo[t]), _mm512_slli_epi32(_mm512_dpbusd_epi32(z, m0, hi[t]), 7));
                    const __m512i a1 = _mm512_add_epi32(_mm512_dpbusd_epi32(z, m1, lo[t]), _mm512_slli_epi32(_mm512_dpbusd_epi32(z, m1, hi[t]), 7));
                    const __m512i off = _mm512_add_epi32(_mm512_permutex2var_epi32(a0, even, a1), _mm512_permutex2var_epi32(a0, odd, a1));
                    yv = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(off), _mm512_mul_ps(dm, dxt), yv);
                }
                _mm512_storeu_ps(pb.y + i, yv);
            }
        }
    }
}

#endif

#ifdef PI_CM_AVX2
// ---- AVX2 kernels (256-bit; vpdpbusd where the CPU has AVX-VNNI) --
//
// The same tile layout as the AVX-512 kernels, read 32 positions at a time: part P of half h
// holds positions 32P .. 32P + 31, and after the unpacks register m holds rows
// 16m + 8P .. 16m + 8P + 7 of the half. The integer sums are exact at every level, so the
// folds, which run the scalar kernels' float operations in their order, give their bits.
//
// Without VNNI a group's u8 x s8 products go through vpmaddubsw, whose 16-bit pair sums
// saturate above 32767: q of 4 and 5 bits (at most 31, times |x8| <= 127) keep a pass's four
// groups within 16 bits (4 * 2 * 31 * 127 = 31496), 6 bits two groups, and 8 bits (Q8_0,
// q up to 255) go signed: (q - 128) * x8 through the sign trick, plus 128 * sum(x8).

// 32 q of part P of half h of one column's tile, as bytes in position order.
static inline __attribute__((always_inline)) __m256i part_u8(const uint8_t * lo, const uint8_t * hi, const int BITS,
                                                             const int h, const int P) {
    if (BITS == 8) {
        return _mm256_loadu_si256((const __m256i *) (lo + 64 * h + 32 * P));
    }
    const __m256i v = _mm256_loadu_si256((const __m256i *) (lo + 32 * P));
    const __m256i u = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
    if (BITS == 6) {
        // pack_hi2: bits 4-5 of position 64h + 32P + i at bit 2 * (2h + P) of byte i
        const __m256i b = _mm256_loadu_si256((const __m256i *) hi);
        const int sh = 2 * (2 * h + P);
        const __m256i t = sh <= 4 ? _mm256_slli_epi16(b, 4 - sh) : _mm256_srli_epi16(b, sh - 4);
        return _mm256_or_si256(u, _mm256_and_si256(t, _mm256_set1_epi8(0x30)));
    }
    if (BITS == 5) {
        // bit 4 of the half's positions, a 64-bit mask: its bits 32P .. 32P + 31 spread to bytes
        uint32_t m32;
        memcpy(&m32, hi + 8 * h + 4 * P, 4);
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int) m32),
                                                   _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                    2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
        const __m256i bit = _mm256_set1_epi64x((long long) 0x8040201008040201ULL);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        return _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    return u;
}

// The q of part P of half h of 4 columns interleaved: w[m] lane i holds the 4 columns' q of
// row 16m + 8P + i.
static inline __attribute__((always_inline)) void part_w(const uint8_t * const * p, size_t lo, size_t hi, const int BITS,
                                                         const int h, const int P, __m256i * w) {
    const __m256i u0 = part_u8(p[0] + lo, p[0] + hi, BITS, h, P), u1 = part_u8(p[1] + lo, p[1] + hi, BITS, h, P);
    const __m256i u2 = part_u8(p[2] + lo, p[2] + hi, BITS, h, P), u3 = part_u8(p[3] + lo, p[3] + hi, BITS, h, P);
    const __m256i a0 = _mm256_unpacklo_epi8(u0, u1), a1 = _mm256_unpackhi_epi8(u0, u1);
    const __m256i b0 = _mm256_unpacklo_epi8(u2, u3), b1 = _mm256_unpackhi_epi8(u2, u3);
    w[0] = _mm256_unpacklo_epi16(a0, b0);
    w[1] = _mm256_unpackhi_epi16(a0, b0);
    w[2] = _mm256_unpacklo_epi16(a1, b1);
    w[3] = _mm256_unpackhi_epi16(a1, b1);
}

// Groups whose 16-bit pair sums can be added before widening (see above); 8 bits: each alone.
static inline int groups_per_widen(const int BITS) { return BITS <= 5 ? PI_CM_PASS_GROUPS : BITS == 6 ? 2 : 1; }

#if !defined(__AVXVNNI__)
// One group's products w . x (u8 q, s8 inputs) as 16-bit pair sums, exact (8 bits: of q - 128).
static inline __attribute__((always_inline)) __m256i pair_sums(__m256i w, __m256i x, const int BITS) {
    if (BITS == 8) {
        const __m256i ws = _mm256_xor_si256(w, _mm256_set1_epi8((char) 0x80));
        return _mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(x, ws));
    }
    return _mm256_maddubs_epi16(w, x);
}
#endif

// s += sum over groups [0, NG) of w[g] . x[g] per 32-bit lane (u8 q times the group's 4 s8
// inputs), exactly.
static inline __attribute__((always_inline)) __m256i dot_groups(__m256i s, const __m256i * w, const __m256i * x, int NG,
                                                                const int BITS) {
#if defined(__AVXVNNI__)
    (void) BITS;
    for (int g = 0; g < NG; ++g) s = _mm256_dpbusd_avx_epi32(s, w[g], x[g]);
    return s;
#else
    const int step = groups_per_widen(BITS);
    for (int g = 0; g < NG; g += step) {
        __m256i p16 = pair_sums(w[g], x[g], BITS);
        for (int k = g + 1; k < g + step && k < NG; ++k) p16 = _mm256_add_epi16(p16, pair_sums(w[k], x[k], BITS));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
    }
    return s;
#endif
}

// The exact sums need 128 * (the groups' inputs summed) added once per pass (8-bit q, no VNNI).
static inline __attribute__((always_inline)) __m256i q8_offset(const int32_t * x4, int NG, int64_t T, int64_t t, const int BITS) {
#if !defined(__AVXVNNI__)
    if (BITS == 8) {
        int32_t c = 0;
        for (int g = 0; g < NG; ++g) {
            const uint32_t v = (uint32_t) x4[g * T + t];
            c += (int8_t) v + (int8_t) (v >> 8) + (int8_t) (v >> 16) + (int8_t) (v >> 24);
        }
        return _mm256_set1_epi32(128 * c);
    }
#endif
    (void) x4; (void) NG; (void) T; (void) t; (void) BITS;
    return _mm256_setzero_si256();
}

// Rows 8P .. 8P + 7 of a group of 16 rows' 6-bit scales (12 bytes at p) as 8 int32: word i
// takes the two bytes holding bits 6i .. 6i + 5 and moves them to the top of the word (a
// multiply by 2^(10 - shift): AVX2 has no per-word shift), then down by 10.
static inline __m256i k_sc8(const uint8_t * p, int P) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) p));
    const __m256i at = _mm256_setr_epi8(0, 1, 0, 1, 1, 2, 2, 3, 3, 4, 3, 4, 4, 5, 5, 6,
                                        6, 7, 6, 7, 7, 8, 8, 9, 9, 10, 9, 10, 10, 11, 11, 12);
    const __m256i mul = _mm256_setr_epi16(1024, 16, 64, 256, 1024, 16, 64, 256, 1024, 16, 64, 256, 1024, 16, 64, 256);
    const __m256i w = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(b, at), mul), 10);
    return _mm256_cvtepu16_epi32(P ? _mm256_extracti128_si256(w, 1) : _mm256_castsi256_si128(w));
}

// Eight rows' sums v (rows r .. r + 7 of the segment) of token t: stored at a, or folded into
// t's super-block sums as the AVX-512 put_sums does.
static inline __attribute__((always_inline)) void put_sums8(__m256i v, int32_t * a, const bool fold, const uint8_t * scp,
                                                            int64_t r, const bool six, const int32_t * s8, int64_t t,
                                                            int32_t * tsum, size_t i, bool t_first) {
    if (!fold) {
        _mm256_storeu_si256((__m256i *) a, v);
        return;
    }
    if (six) v = _mm256_sub_epi32(v, _mm256_set1_epi32(32 * s8[t]));
    const __m256i sc = six ? _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (scp + r)))
                           : k_sc8(scp + k6_bytes(r & ~(int64_t) 15), (int) ((r / 8) & 1));
    const __m256i pv = _mm256_mullo_epi32(sc, v);
    _mm256_storeu_si256((__m256i *) (tsum + i),
                        t_first ? pv : _mm256_add_epi32(_mm256_loadu_si256((const __m256i *) (tsum + i)), pv));
}

// The one-token and batch kernels from here on (dec_seg, dec_seg_batch) serve the avxvnni
// level too. They add in 16 bits (vpmaddubsw) and widen once per pass with the K-quant scale
// (vpmaddwd); vpdpbusd widens every group to 32 bits, and the scale then costs a 32-bit
// multiply (groups_seg's general path, which the avxvnni level ran until 2026-12-08). On an
// AMD Zen 5 that executes AVX-VNNI (bench-input-sparse-avxvnni, 1 thread, in cache, 40%):
// gate+up Q4_K 0.484 -> 0.336 ms, down Q4_K 0.275 -> 0.200, down Q6_K 0.406 -> 0.321, the
// output matrix 5.92 -> 4.89; 4 tokens, gate+up 0.411 -> 0.364 ms a token.

// Group g's 4 column pointers at b (a plane's address at this tile, column 0): the offsets
// (column * stride) are read from memory at each use and added in the load's address. With
// 16 pointers live across a tile, gcc otherwise keeps them as spilled pointers, recomputed
// and stored again every tile (one token, in cache, 1 thread: 4-6% less time per pass).
static inline __attribute__((always_inline)) void group_ptrs(const uint8_t * b, const size_t * off, int g, const uint8_t ** pg) {
    for (int i = 0; i < 4; ++i) {
        size_t o = off[4 * g + i];
        __asm__("" : "+r"(o));
        pg[i] = b + o;
    }
}

// ---- decode (one token) without VNNI: 4-bit q, and 6-bit q with xblock 256 --
//
// A tile's low plane holds both halves' q, one in each nibble, so one load per column and part
// serves 64 rows: a group's 4 columns are interleaved first (the unpacks of part_w, on the
// raw bytes), then split into the halves' nibbles, which halves the loads and unpacks per
// weight. vpmaddubsw gives per row two 16-bit sums of column pairs, added over the pass's
// groups in 16 bits: 4-bit q, 8 groups: 16 * 15 * 127 = 30480; 6-bit q (4 groups) less 32 (Q6_K's offset,
// taken off in 16 bits as 32 * the pass's inputs per pair): 8 * 32 * 127 = 32512. The int16
// additions wrap, so the sums are exact wherever the final value fits, whatever the order.
// Then one vpmaddwd per 8 rows widens the pairs: with ones into acc (xblock 32), or with the
// rows' scales (16-bit, each twice) straight into the super-block's sums t (xblock 256):
// sc * acc added pass by pass is the same integer as sc * acc of the whole chunk, so no acc
// round trip and no 32-bit multiply; for Q6_K, sc * (acc - 32 * s8) (the groups' inputs sum
// to s8: unused slots are 0).

// The 6-bit scales of rows 8P .. 8P + 7 of a group of 16 rows (12 bytes at p), as 16-bit
// pairs: dword i holds row 8P + i's scale in both words (k_sc8's shift by a multiply).
static inline __attribute__((always_inline)) __m256i k_sc_pairs(const uint8_t * p, const int P) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) p));
    const __m256i at = P ? _mm256_setr_epi8(6, 7, 6, 7, 6, 7, 6, 7, 7, 8, 7, 8, 8, 9, 8, 9,
                                            9, 10, 9, 10, 9, 10, 9, 10, 10, 11, 10, 11, 11, 12, 11, 12)
                         : _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 1, 2, 1, 2, 2, 3, 2, 3,
                                            3, 4, 3, 4, 3, 4, 3, 4, 4, 5, 4, 5, 5, 6, 5, 6);
    const __m256i mul = _mm256_setr_epi16(1024, 1024, 16, 16, 64, 64, 256, 256, 1024, 1024, 16, 16, 64, 64, 256, 256);
    return _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(b, at), mul), 10);
}

// Q6_K's int8 scales of 8 rows (8 bytes at p) as 16-bit pairs: each byte to the high byte of
// both words of its dword, then an arithmetic shift down.
static inline __attribute__((always_inline)) __m256i sc6_pairs(const uint8_t * p) {
    int64_t v;
    memcpy(&v, p, 8);
    const __m256i at = _mm256_setr_epi8(-1, 0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3,
                                        -1, 4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7);
    return _mm256_srai_epi16(_mm256_shuffle_epi8(_mm256_set1_epi64x((long long) v), at), 8);
}

// Group g's q of part P of a tile, both halves: q[2h + i] holds rows 64h + 16m + 8P .. + 7,
// m = 2k + i (k: the low or the high bytes of each 128-bit lane, unpacklo or unpackhi), the
// 4 columns' q of a row in its 4 bytes. One load per column and plane serves both halves.
static inline __attribute__((always_inline)) void dec_unpack(const uint8_t * const * pg, size_t lo, size_t hi, const int BITS,
                                                             const int P, const int k, __m256i * q) {
    const __m256i nib = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    const __m256i u0 = _mm256_loadu_si256((const __m256i *) (pg[0] + lo + 32 * P));
    const __m256i u1 = _mm256_loadu_si256((const __m256i *) (pg[1] + lo + 32 * P));
    const __m256i u2 = _mm256_loadu_si256((const __m256i *) (pg[2] + lo + 32 * P));
    const __m256i u3 = _mm256_loadu_si256((const __m256i *) (pg[3] + lo + 32 * P));
    const __m256i a = k ? _mm256_unpackhi_epi8(u0, u1) : _mm256_unpacklo_epi8(u0, u1);
    const __m256i b = k ? _mm256_unpackhi_epi8(u2, u3) : _mm256_unpacklo_epi8(u2, u3);
    const __m256i w0 = _mm256_unpacklo_epi16(a, b), w1 = _mm256_unpackhi_epi16(a, b);
    q[0] = _mm256_and_si256(w0, nib);
    q[1] = _mm256_and_si256(w1, nib);
    q[2] = _mm256_and_si256(_mm256_srli_epi16(w0, 4), nib);
    q[3] = _mm256_and_si256(_mm256_srli_epi16(w1, 4), nib);
    if (BITS == 6) {
        // the high planes, interleaved as the low ones; pack_hi2: bits 4-5 of position
        // 64h + 32P + i at bit 2 * (2h + P) of byte i
        const __m256i v0 = _mm256_loadu_si256((const __m256i *) (pg[0] + hi));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *) (pg[1] + hi));
        const __m256i v2 = _mm256_loadu_si256((const __m256i *) (pg[2] + hi));
        const __m256i v3 = _mm256_loadu_si256((const __m256i *) (pg[3] + hi));
        const __m256i c = k ? _mm256_unpackhi_epi8(v0, v1) : _mm256_unpacklo_epi8(v0, v1);
        const __m256i d = k ? _mm256_unpackhi_epi8(v2, v3) : _mm256_unpacklo_epi8(v2, v3);
        const __m256i h0 = _mm256_unpacklo_epi16(c, d), h1 = _mm256_unpackhi_epi16(c, d);
        q[0] = _mm256_or_si256(q[0], _mm256_and_si256(P ? _mm256_slli_epi16(h0, 2) : _mm256_slli_epi16(h0, 4), top2));
        q[1] = _mm256_or_si256(q[1], _mm256_and_si256(P ? _mm256_slli_epi16(h1, 2) : _mm256_slli_epi16(h1, 4), top2));
        q[2] = _mm256_or_si256(q[2], _mm256_and_si256(P ? _mm256_srli_epi16(h0, 2) : h0, top2));
        q[3] = _mm256_or_si256(q[3], _mm256_and_si256(P ? _mm256_srli_epi16(h1, 2) : h1, top2));
    }
}

// Part P of both halves of a tile, for NG groups: into s[2h + i] the 16-bit sums of rows
// 64h + 16m + 8P .. + 7, m = 2k + i, from init (6 bits: minus 32 * the inputs). Four sums
// live, so nothing spills; P and k are constants.
static inline __attribute__((always_inline)) void dec_part(const uint8_t * bl, const uint8_t * bh, const size_t * off, const __m256i * x,
                                                           const int NG, const int BITS, const int P, const int k,
                                                           __m256i init, __m256i * s) {
    __m256i s00 = init, s01 = init, s10 = init, s11 = init;
    for (int g = 0; g < NG; ++g) {
        __m256i q[4];
        const uint8_t * pg[4];
        group_ptrs(bl, off, g, pg);
        dec_unpack(pg, 0, (size_t) (bh - bl), BITS, P, k, q);
        s00 = _mm256_add_epi16(s00, _mm256_maddubs_epi16(q[0], x[g]));
        s01 = _mm256_add_epi16(s01, _mm256_maddubs_epi16(q[1], x[g]));
        s10 = _mm256_add_epi16(s10, _mm256_maddubs_epi16(q[2], x[g]));
        s11 = _mm256_add_epi16(s11, _mm256_maddubs_epi16(q[3], x[g]));
        // keeps the sums in registers, added group by group (gcc would otherwise compute every
        // group's products first and spill them)
        __asm__("" : "+x"(s00), "+x"(s01), "+x"(s10), "+x"(s11));
    }
    s[0] = s00; s[1] = s01; s[2] = s10; s[3] = s11;
}

// The 16-bit multipliers that widen rows rr .. rr + 7's pair sums (dec_store): ones (xblock
// 32), or the rows' K-quant scales (see above).
static inline __attribute__((always_inline)) __m256i dec_scales(const bool kmode, const bool six, const uint8_t * scp, int64_t rr, const int P) {
    return !kmode ? _mm256_set1_epi16(1) : six ? sc6_pairs(scp + rr) : k_sc_pairs(scp + k6_bytes(rr & ~(int64_t) 15), P);
}

// Widens and stores dec_part's sums (see above): rows r0 + 64h + 16(2k + i) + 8P.
static inline __attribute__((always_inline)) void dec_store(const __m256i * s, int32_t * dst, int64_t r0, bool two,
                                                            const bool kmode, const bool six, const uint8_t * scp,
                                                            const int P, const int k, bool zero) {
    for (int h = 0; h < 2; ++h) {
        if (h && !two) break;
        for (int i = 0; i < 2; ++i) {
            const int64_t rr = r0 + HALF * h + 16 * (2 * k + i) + 8 * P;
            const __m256i v = _mm256_madd_epi16(s[2 * h + i], dec_scales(kmode, six, scp, rr, P));
            __m256i * d = (__m256i *) (dst + rr);
            _mm256_storeu_si256(d, zero ? v : _mm256_add_epi32(_mm256_loadu_si256(d), v));
        }
    }
}

// groups_seg for one token (same arguments; kmode: xblock 256): every pass adds into t (zero:
// t starts from 0 here), or into acc as groups_seg.
static inline __attribute__((always_inline)) void dec_seg(const struct pi_colmat * cm, const struct pi_colmat_seg * s,
                                                          const int BITS, const int NG, const int32_t * cols,
                                                          const int32_t * x4, int32_t * acc, bool first, const int32_t * pf,
                                                          int npf, int64_t j, int32_t * tsum, bool t_first, int64_t ta,
                                                          int64_t tz) {
    const bool kmode = cm->xblock == QK_K, six = BITS == 6;
    const bool zero = kmode ? first && t_first : first;
    int32_t * dst = (kmode ? tsum : acc) + s->pad0;
    const uint8_t * scp = kmode ? seg_sc(s, j) : NULL;
    const uint8_t * base = cm->q + s->col_off;
    const uint8_t * p[4 * PI_CM_MAX_GROUPS], * q[4 * PI_CM_MAX_GROUPS];  // for pass_prefetch
    size_t off[4 * PI_CM_MAX_GROUPS];
    for (int i = 0; i < 4 * NG; ++i) off[i] = (size_t) cols[i] * cm->col_stride;
    for (int i = 0; i < 4 * NG; ++i) p[i] = base + off[i];
    for (int i = 0; i < npf; ++i) q[i] = base + (size_t) pf[i] * cm->col_stride;
    __m256i x[PI_CM_MAX_GROUPS];
    __m256i init = _mm256_setzero_si256();  // 6 bits: minus 32 * each pair's inputs, summed over the groups
    for (int g = 0; g < NG; ++g) {
        x[g] = _mm256_set1_epi32(x4[g]);
        if (six) init = _mm256_sub_epi16(init, _mm256_maddubs_epi16(_mm256_set1_epi8(32), x[g]));
    }
    for (int64_t ti = ta; ti < tz; ++ti) {
        const size_t lo = (size_t) ti * s->lo, hi = (size_t) s->n_tiles * s->lo + (size_t) ti * s->hi;
        pass_prefetch(s, BITS, NG, p, q, npf, cols, pf, ti, ta, tz);
        const int64_t r0 = ti * TILE;
        const bool two = r0 + HALF < s->n_rows;  // the tile's second half has rows
        __m256i sums[4];
        dec_part(base + lo, base + hi, off, x, NG, BITS, 0, 0, init, sums);
        dec_store(sums, dst, r0, two, kmode, six, scp, 0, 0, zero);
        dec_part(base + lo, base + hi, off, x, NG, BITS, 0, 1, init, sums);
        dec_store(sums, dst, r0, two, kmode, six, scp, 0, 1, zero);
        dec_part(base + lo, base + hi, off, x, NG, BITS, 1, 0, init, sums);
        dec_store(sums, dst, r0, two, kmode, six, scp, 1, 0, zero);
        dec_part(base + lo, base + hi, off, x, NG, BITS, 1, 1, init, sums);
        dec_store(sums, dst, r0, two, kmode, six, scp, 1, 1, zero);
    }
}

// dec_seg for a batch of T tokens (each with its own inputs): each part's
// groups are unpacked once (dec_unpack) and kept, their rows' scale multipliers too, and every
// token runs its vpmaddubsw sums over them, widened by one vpmaddwd into t (or acc) as for
// one token. The unpacks, the scales and the 32-bit multiplies per token of groups_seg's batch
// path are gone; the sums are the same integers.
#define PI_CM_HAS_DEC_BATCH 1
static inline __attribute__((always_inline)) void dec_seg_batch(const struct pi_colmat * cm, const struct pi_colmat_seg * s,
                                                                const int BITS, const int NG, const int32_t * cols,
                                                                const int32_t * x4, int64_t T, int32_t * acc, bool first,
                                                                const int32_t * pf, int npf, int64_t j, int32_t * tsum,
                                                                bool t_first, int64_t ta, int64_t tz) {
    const bool kmode = cm->xblock == QK_K, six = BITS == 6;
    const bool zero = kmode ? first && t_first : first;
    const int64_t n_pad = cm->n_pad;
    int32_t * dst = (kmode ? tsum : acc) + s->pad0;
    const uint8_t * scp = kmode ? seg_sc(s, j) : NULL;
    const uint8_t * p[4 * PI_CM_MAX_GROUPS], * q[4 * PI_CM_MAX_GROUPS];
    for (int i = 0; i < 4 * NG; ++i) p[i] = cm->q + (size_t) cols[i] * cm->col_stride + s->col_off;
    for (int i = 0; i < npf; ++i) q[i] = cm->q + (size_t) pf[i] * cm->col_stride + s->col_off;
    __m256i init[PI_COLMAT_MAX_TOKENS];  // per token (6 bits): minus 32 * each pair's inputs, summed over the groups
    for (int64_t t = 0; t < T; ++t) {
        init[t] = _mm256_setzero_si256();
        for (int g = 0; six && g < NG; ++g) {
            init[t] = _mm256_sub_epi16(init[t], _mm256_maddubs_epi16(_mm256_set1_epi8(32), _mm256_set1_epi32(x4[g * T + t])));
        }
    }
    for (int64_t ti = ta; ti < tz; ++ti) {
        const size_t lo = (size_t) ti * s->lo, hi = (size_t) s->n_tiles * s->lo + (size_t) ti * s->hi;
        pass_prefetch(s, BITS, NG, p, q, npf, cols, pf, ti, ta, tz);
        const int64_t r0 = ti * TILE;
        const int nr = r0 + HALF < s->n_rows ? 4 : 2;  // row sets with rows: both halves', or the first's
        for (int P = 0; P < 2; ++P) {
            for (int k = 0; k < 2; ++k) {
                __m256i w[PI_CM_MAX_GROUPS][4], sc[4];
                int64_t rr[4];
                for (int g = 0; g < NG; ++g) dec_unpack(p + 4 * g, lo, hi, BITS, P, k, w[g]);
                for (int m = 0; m < nr; ++m) {
                    rr[m] = r0 + HALF * (m >> 1) + 16 * (2 * k + (m & 1)) + 8 * P;
                    sc[m] = dec_scales(kmode, six, scp, rr[m], P);
                }
                for (int64_t t = 0; t < T; ++t) {
                    __m256i x[PI_CM_MAX_GROUPS];
                    for (int g = 0; g < NG; ++g) x[g] = _mm256_set1_epi32(x4[g * T + t]);
                    int32_t * dt = dst + t * n_pad;
                    for (int m = 0; m < nr; ++m) {
                        __m256i sum = init[t];
                        for (int g = 0; g < NG; ++g) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[g][m], x[g]));
                        const __m256i v = _mm256_madd_epi16(sum, sc[m]);
                        __m256i * d = (__m256i *) (dt + rr[m]);
                        _mm256_storeu_si256(d, zero ? v : _mm256_add_epi32(_mm256_loadu_si256(d), v));
                    }
                }
            }
        }
    }
}

// A batch's pass over segment s when dec_seg_batch takes its type (4-bit q, or Q6_K): false
// otherwise. A function of its own, apart from groups_pass's one-token code.
static bool seg_batch(const struct pi_colmat * cm, const struct pi_colmat_seg * s, int NG, const int32_t * cols,
                      const int32_t * x4, int64_t T, int32_t * acc, bool first, const int32_t * pf, int npf, int64_t j,
                      int32_t * tsum, bool t_first, int64_t ta, int64_t tz) {
    if (!(s->bits == 4 || (s->bits == 6 && cm->xblock == QK_K))) return false;
#define PI_CM_NG(B, N) dec_seg_batch(cm, s, B, N, cols, x4, T, acc, first, pf, npf, j, tsum, t_first, ta, tz);
#define PI_CM_CASE(B) \
    switch (NG) { case 1: PI_CM_NG(B, 1) break; case 2: PI_CM_NG(B, 2) break; case 3: PI_CM_NG(B, 3) break; default: PI_CM_NG(B, 4) break; }
    if (s->bits == 4) {
#if PI_CM_MAX_GROUPS > 4
        switch (NG) {
            case 1: PI_CM_NG(4, 1) break; case 2: PI_CM_NG(4, 2) break; case 3: PI_CM_NG(4, 3) break;
            case 4: PI_CM_NG(4, 4) break; case 5: PI_CM_NG(4, 5) break; case 6: PI_CM_NG(4, 6) break;
            case 7: PI_CM_NG(4, 7) break; default: PI_CM_NG(4, 8) break;
        }
#else
        PI_CM_CASE(4);
#endif
    } else {
        PI_CM_CASE(6);
    }
#undef PI_CM_CASE
#undef PI_CM_NG
    return true;
}

// The AVX-512 groups_seg's work (same arguments) on 256-bit registers.
static inline __attribute__((always_inline)) void groups_seg(const struct pi_colmat * cm, const struct pi_colmat_seg * s,
                                                             const int BITS, const int NG, const int32_t * cols,
                                                             const int32_t * x4, int64_t T, int32_t * acc, bool first,
                                                             const int32_t * pf, int npf, const bool fold, int64_t j,
                                                             int32_t * tsum, bool t_first, const int32_t * s8, int64_t ta,
                                                             int64_t tz) {
    // (6 bits, 4 groups: the path below measured faster while dec_seg kept 16 pointers, 0.72
    // against 0.92 ms on Qwen2.5-1.5B's Q6_K down with every column kept, in cache; with the
    // offsets of group_ptrs dec_seg takes 0.55 against 0.72, and the output matrix 9.2 against
    // 12.1 ms, 6.35 against 6.7 at 40%, 1 thread)
    if (T == 1 && (BITS == 4 || (BITS == 6 && cm->xblock == QK_K))) {
        dec_seg(cm, s, BITS, NG, cols, x4, acc, first, pf, npf, j, tsum, t_first, ta, tz);
        return;
    }
    const bool six = s->scales == PI_CM_6K;
    const uint8_t * scp = fold ? seg_sc(s, j) : NULL;
    const int64_t n_pad = cm->n_pad;
    const uint8_t * p[4 * PI_CM_PASS_GROUPS], * q[4 * PI_CM_PASS_GROUPS];
    for (int i = 0; i < 4 * NG; ++i) p[i] = cm->q + (size_t) cols[i] * cm->col_stride + s->col_off;
    for (int i = 0; i < npf; ++i) q[i] = cm->q + (size_t) pf[i] * cm->col_stride + s->col_off;
    __m256i x0[PI_CM_PASS_GROUPS];  // token 0's inputs of each group
    for (int g = 0; g < NG; ++g) x0[g] = _mm256_set1_epi32(x4[g * T]);
    const __m256i off0 = q8_offset(x4, NG, T, 0, BITS);
    for (int64_t ti = ta; ti < tz; ++ti) {
        const size_t lo = (size_t) ti * s->lo, hi = (size_t) s->n_tiles * s->lo + (size_t) ti * s->hi;
        pass_prefetch(s, BITS, NG, p, q, npf, cols, pf, ti, ta, tz);
        for (int h = 0; h < 2; ++h) {
            const int64_t r = ti * TILE + h * HALF;
            if (r >= s->n_rows) break;
            for (int P = 0; P < 2; ++P) {
                if (T == 1) {
                    int32_t * a = acc + s->pad0 + r;
                    __m256i v[4];
                    for (int m = 0; m < 4; ++m) {
                        v[m] = first ? off0 : _mm256_add_epi32(_mm256_loadu_si256((const __m256i *) (a + 16 * m + 8 * P)), off0);
                    }
                    // group by group into 16-bit sums (4 registers), widened once per
                    // groups_per_widen groups: few registers live, none spilled
#if defined(__AVXVNNI__)
                    for (int g = 0; g < NG; ++g) {
                        __m256i w[4];
                        part_w(p + 4 * g, lo, hi, BITS, h, P, w);
                        for (int m = 0; m < 4; ++m) v[m] = _mm256_dpbusd_avx_epi32(v[m], w[m], x0[g]);
                    }
#else
                    const int step = groups_per_widen(BITS);
                    for (int g0 = 0; g0 < NG; g0 += step) {
                        __m256i p16[4];
                        for (int g = g0; g < g0 + step && g < NG; ++g) {
                            __m256i w[4];
                            part_w(p + 4 * g, lo, hi, BITS, h, P, w);
                            for (int m = 0; m < 4; ++m) {
                                const __m256i pm = pair_sums(w[m], x0[g], BITS);
                                p16[m] = g == g0 ? pm : _mm256_add_epi16(p16[m], pm);
                            }
                        }
                        for (int m = 0; m < 4; ++m) v[m] = _mm256_add_epi32(v[m], _mm256_madd_epi16(p16[m], _mm256_set1_epi16(1)));
                    }
#endif
                    for (int m = 0; m < 4; ++m) {
                        const int64_t rr = r + 16 * m + 8 * P;
                        put_sums8(v[m], a + 16 * m + 8 * P, fold, scp, rr, six, s8, 0, tsum, s->pad0 + rr, t_first);
                    }
                    continue;
                }
                __m256i w[4][PI_CM_PASS_GROUPS];  // [m][g]
                for (int g = 0; g < NG; ++g) {
                    __m256i wg[4];
                    part_w(p + 4 * g, lo, hi, BITS, h, P, wg);
                    for (int m = 0; m < 4; ++m) w[m][g] = wg[m];
                }
                for (int64_t t = 0; t < T; ++t) {
                    __m256i xt[PI_CM_PASS_GROUPS];
                    for (int g = 0; g < NG; ++g) xt[g] = t == 0 ? x0[g] : _mm256_set1_epi32(x4[g * T + t]);
                    const __m256i off = t == 0 ? off0 : q8_offset(x4, NG, T, t, BITS);
                    int32_t * a = acc + t * n_pad + s->pad0 + r;
                    for (int m = 0; m < 4; ++m) {
                        __m256i v = first ? off : _mm256_add_epi32(_mm256_loadu_si256((const __m256i *) (a + 16 * m + 8 * P)), off);
                        v = dot_groups(v, w[m], xt, NG, BITS);
                        const int64_t rr = r + 16 * m + 8 * P;
                        put_sums8(v, a + 16 * m + 8 * P, fold, scp, rr, six, s8, t, tsum, t * n_pad + s->pad0 + rr, t_first);
                    }
                }
            }
        }
    }
}

// xblock 32: y (+)= a * (dx * acc) + b * sx over every segment's rows (first: from 0).
static void fold_float(const struct pi_colmat * cm, const struct chunk_view * v, int64_t j, int64_t T, struct piece_buf pb,
                       bool first) {
    const int64_t n_pad = cm->n_pad;
    for (int k = 0; k < cm->n_segs; ++k) {
        const struct pi_colmat_seg * s = &cm->seg[k];
        const size_t rows = (size_t) s->n_tiles * TILE;
        int64_t ta, tz;
        seg_tiles(cm, k, pb.ga, pb.gb, &ta, &tz);
        const int64_t r_end = tz * TILE < s->n_rows ? tz * TILE : s->n_rows;
        for (int64_t r = ta * TILE; r < r_end; r += 8) {
            __m256 a, b;
            switch (s->scales) {
                case PI_CM_D:
                    a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (s->d + (size_t) (j / QK) * rows + r)));
                    b = _mm256_mul_ps(_mm256_set1_ps(-(float) s->offset), a);
                    break;
                case PI_CM_DM:
                    a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (s->d + (size_t) (j / QK) * rows + r)));
                    b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (s->m + (size_t) (j / QK) * rows + r)));
                    break;
                case PI_CM_K: {
                    const __m256 d  = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (s->d + (size_t) (j / QK_K) * rows + r)));
                    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (s->m + (size_t) (j / QK_K) * rows + r)));
                    a = _mm256_mul_ps(d, _mm256_cvtepi32_ps(k_sc8(s->sc + sc_group(rows, j / QK, r & ~(int64_t) 15), (int) ((r / 8) & 1))));
                    int32_t mn[8];
                    for (int i = 0; i < 8; ++i) mn[i] = k_min(s->mins, rows, j / QK, r + i);
                    b = _mm256_sub_ps(_mm256_setzero_ps(),
                                      _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *) mn))));
                    break;
                }
                default: {  // PI_CM_6K
                    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (s->d + (size_t) (j / QK_K) * rows + r)));
                    a = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (s->sc + (size_t) (j / 16) * rows + r)))));
                    b = _mm256_mul_ps(_mm256_set1_ps(-(float) s->offset), a);
                    break;
                }
            }
            for (int64_t t = 0; t < T; ++t) {
                const int64_t i = t * n_pad + s->pad0 + r;
                const __m256 x = _mm256_mul_ps(_mm256_set1_ps(v->dx[t]), _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *) (pb.acc + i))));
                __m256 yv = _mm256_fmadd_ps(a, x, first ? _mm256_setzero_ps() : _mm256_loadu_ps(pb.y + i));
                _mm256_storeu_ps(pb.y + i, _mm256_fmadd_ps(b, _mm256_set1_ps(v->sx[t]), yv));
            }
        }
    }
}

// Four rows' 6-bit minimums (6 bytes a row from p) as bytes, row i's 8 in 64-bit lane i (the
// AVX-512 k_min8's halvings on four lanes).
static inline __m256i k_min4(const uint8_t * p) {
    __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) p)),
                                        _mm_loadu_si128((const __m128i *) (p + 12)), 1);
    v = _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 1, 2, 3, 4, 5, -1, -1, 6, 7, 8, 9, 10, 11, -1, -1,
                                                0, 1, 2, 3, 4, 5, -1, -1, 6, 7, 8, 9, 10, 11, -1, -1));
    const __m256i m1 = _mm256_set1_epi64x(0x00FFFFFF00000000LL), m2 = _mm256_set1_epi64x(0x0FFF00000FFF0000LL);
    const __m256i m3 = _mm256_set1_epi64x(0x3F003F003F003F00LL);
    v = _mm256_or_si256(_mm256_and_si256(m1, _mm256_slli_epi64(v, 8)), _mm256_andnot_si256(m1, v));
    v = _mm256_or_si256(_mm256_and_si256(m2, _mm256_slli_epi64(v, 4)), _mm256_andnot_si256(m2, v));
    v = _mm256_or_si256(_mm256_and_si256(m3, _mm256_slli_epi64(v, 2)), _mm256_andnot_si256(m3, v));
    return _mm256_and_si256(v, _mm256_set1_epi8(63));
}

// Per 64-bit lane (a row): its 8 minimums (u8) times 8 signed bytes, as two 32-bit halves.
static inline __m256i min_dot(__m256i m, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(m, x), _mm256_set1_epi16(1));
}

// xblock 256, at a super-block's end: the AVX-512 fold_superblock on 8 rows a step.
static void fold_superblock(const struct pi_colmat * cm, const struct prep_view * prep, int64_t u, int64_t T,
                            const float * dx, struct piece_buf pb, bool first) {
    const int64_t C = cm->chunk, n_pad = cm->n_pad, per = QK_K / C, c0 = u * per;
    __m256i lo[PI_COLMAT_MAX_TOKENS], hi[PI_COLMAT_MAX_TOKENS];  // the sub-blocks' l and h bytes
    uint64_t l8[PI_COLMAT_MAX_TOKENS], h8[PI_COLMAT_MAX_TOKENS];
    const bool any_min = sub_sum_bytes(cm, prep, c0, T, l8, h8);
    for (int64_t t = 0; t < T && any_min; ++t) {
        lo[t] = _mm256_set1_epi64x((long long) l8[t]);
        hi[t] = _mm256_set1_epi64x((long long) h8[t]);
    }
    for (int k = 0; k < cm->n_segs; ++k) {
        const struct pi_colmat_seg * s = &cm->seg[k];
        const size_t rows = (size_t) s->n_tiles * TILE;
        const bool mins = s->scales == PI_CM_K;
        int64_t ta, tz;
        seg_tiles(cm, k, pb.ga, pb.gb, &ta, &tz);
        const int64_t r_end = tz * TILE < s->n_rows ? tz * TILE : s->n_rows;
        for (int64_t r = ta * TILE; r < r_end; r += 8) {
#if PI_CM_SCALE_PREFETCH
            if (r + PI_CM_SCALE_AHEAD < r_end) {
                const int64_t ra = r + PI_CM_SCALE_AHEAD;
                if (ra % 32 == 0) {
                    _mm_prefetch((const char *) (s->d + (size_t) u * rows + ra), _MM_HINT_T0);
                    if (mins) _mm_prefetch((const char *) (s->m + (size_t) u * rows + ra), _MM_HINT_T0);
                }
                if (mins) _mm_prefetch((const char *) (s->mins + min_group(rows, u, ra)), _MM_HINT_T0);
            }
#endif
            const __m256 d  = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (s->d + (size_t) u * rows + r)));
            const __m256 dm = mins ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (s->m + (size_t) u * rows + r)))
                                   : _mm256_setzero_ps();
            __m256i m0 = _mm256_setzero_si256(), m1 = m0;
            if (mins) {
                m0 = k_min4(s->mins + min_group(rows, u, r));      // rows r .. r + 3
                m1 = k_min4(s->mins + min_group(rows, u, r + 4));  // rows r + 4 .. r + 7
            }
            for (int64_t t = 0; t < T; ++t) {
                const int64_t i = t * n_pad + s->pad0 + r;
                const __m256 dxt = _mm256_set1_ps(dx[t]);
                const __m256 y0 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(pb.y + i);
                __m256 yv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *) (pb.t + i))), _mm256_mul_ps(d, dxt), y0);
                if (mins) {
                    // per lane pair 2i, 2i + 1: row i's halves; hadd pairs them, in lanes
                    // (0, 1, 4, 5 | 2, 3, 6, 7), which the permute puts in order
                    const __m256i a0 = _mm256_add_epi32(min_dot(m0, lo[t]), _mm256_slli_epi32(min_dot(m0, hi[t]), 7));
                    const __m256i a1 = _mm256_add_epi32(min_dot(m1, lo[t]), _mm256_slli_epi32(min_dot(m1, hi[t]), 7));
                    const __m256i off = _mm256_permute4x64_epi64(_mm256_hadd_epi32(a0, a1), _MM_SHUFFLE(3, 1, 2, 0));
                    yv = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(off), _mm256_mul_ps(dm, dxt), yv);
                }
                _mm256_storeu_ps(pb.y + i, yv);
            }
        }
    }
}
#endif

#ifdef PI_CM_NEON
// ---- NEON dotprod kernels (aarch64, 128-bit; sdot) --
//
// The same tile layout, read 16 positions at a time: part P of half h holds positions
// 16P .. 16P + 15, which are rows 16m + 4P + d at byte 4m + d; after the zips register m
// holds rows 16m + 4P .. 16m + 4P + 3, lane d row 16m + 4P + d, so its 4 sums store to acc
// in row order. sdot multiplies signed bytes only (unsigned by signed needs i8mm): q of 4
// to 6 bits are valid signed bytes as they are; 8 bits (Q8_0, q up to 255) go as q - 128
// (xor 0x80), plus 128 * the inputs' sum, as the AVX2 kernels without VNNI do. The integer
// sums are exact, and the folds run the scalar kernels' float operations in their order,
// so every result has the scalar bits.

// 16 q of part P of half h of one column's tile, as bytes in position order (8 bits: q - 128).
static inline __attribute__((always_inline)) uint8x16_t part_u8(const uint8_t * lo, const uint8_t * hi, const int BITS,
                                                                const int h, const int P) {
    if (BITS == 8) {
        return veorq_u8(vld1q_u8(lo + 64 * h + 16 * P), vdupq_n_u8(0x80));
    }
    const uint8x16_t v = vld1q_u8(lo + 16 * P);
    const uint8x16_t u = h ? vshrq_n_u8(v, 4) : vandq_u8(v, vdupq_n_u8(0x0F));
    if (BITS == 6) {
        // pack_hi2: bits 4-5 of position 64h + 16P + i at bit 2 * (2h + P / 2) of byte 16 (P % 2) + i
        const uint8x16_t b = vld1q_u8(hi + 16 * (P % 2));
        const int sh = 4 - 2 * (2 * h + P / 2);  // left by sh (right by -sh)
        return vorrq_u8(u, vandq_u8(vshlq_u8(b, vdupq_n_s8((int8_t) sh)), vdupq_n_u8(0x30)));
    }
    if (BITS == 5) {
        // bit 4 of the half's positions, a 64-bit mask: its bits 16P .. 16P + 15 spread to bytes
        uint16_t m16;
        memcpy(&m16, hi + 8 * h + 2 * P, 2);
        const uint8x16_t spread = vcombine_u8(vdup_n_u8((uint8_t) m16), vdup_n_u8((uint8_t) (m16 >> 8)));
        const uint8x16_t bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040201008040201ULL));
        return vorrq_u8(u, vandq_u8(vtstq_u8(spread, bit), vdupq_n_u8(16)));
    }
    return u;
}

// The q of part P of half h of 4 columns interleaved: w[m] lane d holds the 4 columns' q of
// row 16m + 4P + d (column i in byte i), as signed bytes for sdot.
static inline __attribute__((always_inline)) void part_w(const uint8_t * const * p, size_t lo, size_t hi, const int BITS,
                                                         const int h, const int P, int8x16_t * w) {
    const uint8x16_t u0 = part_u8(p[0] + lo, p[0] + hi, BITS, h, P), u1 = part_u8(p[1] + lo, p[1] + hi, BITS, h, P);
    const uint8x16_t u2 = part_u8(p[2] + lo, p[2] + hi, BITS, h, P), u3 = part_u8(p[3] + lo, p[3] + hi, BITS, h, P);
    const uint16x8_t a0 = vreinterpretq_u16_u8(vzip1q_u8(u0, u1)), a1 = vreinterpretq_u16_u8(vzip2q_u8(u0, u1));
    const uint16x8_t b0 = vreinterpretq_u16_u8(vzip1q_u8(u2, u3)), b1 = vreinterpretq_u16_u8(vzip2q_u8(u2, u3));
    w[0] = vreinterpretq_s8_u16(vzip1q_u16(a0, b0));  // bytes 0-3 of each column: m = 0
    w[1] = vreinterpretq_s8_u16(vzip2q_u16(a0, b0));  // 4-7
    w[2] = vreinterpretq_s8_u16(vzip1q_u16(a1, b1));  // 8-11
    w[3] = vreinterpretq_s8_u16(vzip2q_u16(a1, b1));  // 12-15
}

// 128 * the sum of token t's inputs of NG groups (8-bit q only: what q - 128 leaves out).
static inline __attribute__((always_inline)) int32x4_t q8_offset(const int32_t * x4, int NG, int64_t T, int64_t t, const int BITS) {
    if (BITS != 8) return vdupq_n_s32(0);
    int32_t c = 0;
    for (int g = 0; g < NG; ++g) {
        const uint32_t v = (uint32_t) x4[g * T + t];
        c += (int8_t) v + (int8_t) (v >> 8) + (int8_t) (v >> 16) + (int8_t) (v >> 24);
    }
    return vdupq_n_s32(128 * c);
}

// Rows 4P .. 4P + 3 of a group of 16 rows' 6-bit scales (12 bytes at p) as 4 int32: their 24
// bits are bytes 3P .. 3P + 2 (the fourth byte read is the next group's or the slack).
static inline int32x4_t k_sc4(const uint8_t * p, int P) {
    uint32_t w;
    memcpy(&w, p + 3 * P, 4);
    const int32x4_t sh = { 0, -6, -12, -18 };
    return vreinterpretq_s32_u32(vandq_u32(vshlq_u32(vdupq_n_u32(w), sh), vdupq_n_u32(63)));
}

// Four rows' Q6_K scales (int8 at p) as 4 int32.
static inline int32x4_t sc6_4(const uint8_t * p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u32(vdup_n_u32(w)))));
}

// Four rows' sums v (rows r .. r + 3 of the segment) of token t: stored at a, or folded into
// t's super-block sums as the AVX-512 put_sums does.
static inline __attribute__((always_inline)) void put_sums4(int32x4_t v, int32_t * a, const bool fold, const uint8_t * scp,
                                                            int64_t r, const bool six, const int32_t * s8, int64_t t,
                                                            int32_t * tsum, size_t i, bool t_first) {
    if (!fold) {
        vst1q_s32(a, v);
        return;
    }
    if (six) v = vsubq_s32(v, vdupq_n_s32(32 * s8[t]));
    const int32x4_t sc = six ? sc6_4(scp + r) : k_sc4(scp + k6_bytes(r), (int) ((r / 4) & 3));
    const int32x4_t pv = vmulq_s32(sc, v);
    vst1q_s32(tsum + i, t_first ? pv : vaddq_s32(vld1q_s32(tsum + i), pv));
}

// The AVX-512 groups_seg's work (same arguments) on 128-bit registers.
static inline __attribute__((always_inline)) void groups_seg(const struct pi_colmat * cm, const struct pi_colmat_seg * s,
                                                             const int BITS, const int NG, const int32_t * cols,
                                                             const int32_t * x4, int64_t T, int32_t * acc, bool first,
                                                             const int32_t * pf, int npf, const bool fold, int64_t j,
                                                             int32_t * tsum, bool t_first, const int32_t * s8, int64_t ta,
                                                             int64_t tz) {
    const bool six = s->scales == PI_CM_6K;
    const uint8_t * scp = fold ? seg_sc(s, j) : NULL;
    const int64_t n_pad = cm->n_pad;
    const uint8_t * p[4 * PI_CM_PASS_GROUPS], * q[4 * PI_CM_PASS_GROUPS];
    for (int i = 0; i < 4 * NG; ++i) p[i] = cm->q + (size_t) cols[i] * cm->col_stride + s->col_off;
    for (int i = 0; i < npf; ++i) q[i] = cm->q + (size_t) pf[i] * cm->col_stride + s->col_off;
    int8x16_t x0[PI_CM_PASS_GROUPS];  // token 0's inputs of each group, in every lane
    for (int g = 0; g < NG; ++g) x0[g] = vreinterpretq_s8_s32(vdupq_n_s32(x4[g * T]));
    const int32x4_t off0 = q8_offset(x4, NG, T, 0, BITS);
    for (int64_t ti = ta; ti < tz; ++ti) {
        const size_t lo = (size_t) ti * s->lo, hi = (size_t) s->n_tiles * s->lo + (size_t) ti * s->hi;
        pass_prefetch(s, BITS, NG, p, q, npf, cols, pf, ti, ta, tz);
        for (int h = 0; h < 2; ++h) {
            const int64_t r = ti * TILE + h * HALF;
            if (r >= s->n_rows) break;
            for (int P = 0; P < 4; ++P) {
                if (T == 1) {
                    // one token: group by group into four running sums
                    int32_t * a = acc + s->pad0 + r;
                    int32x4_t v[4];
                    for (int m = 0; m < 4; ++m) v[m] = first ? off0 : vaddq_s32(vld1q_s32(a + 16 * m + 4 * P), off0);
                    for (int g = 0; g < NG; ++g) {
                        int8x16_t w[4];
                        part_w(p + 4 * g, lo, hi, BITS, h, P, w);
                        for (int m = 0; m < 4; ++m) v[m] = vdotq_s32(v[m], w[m], x0[g]);
                    }
                    for (int m = 0; m < 4; ++m) {
                        const int64_t rr = r + 16 * m + 4 * P;
                        put_sums4(v[m], a + 16 * m + 4 * P, fold, scp, rr, six, s8, 0, tsum, s->pad0 + rr, t_first);
                    }
                    continue;
                }
                int8x16_t w[PI_CM_PASS_GROUPS][4];
                for (int g = 0; g < NG; ++g) part_w(p + 4 * g, lo, hi, BITS, h, P, w[g]);
                for (int64_t t = 0; t < T; ++t) {
                    int8x16_t xt[PI_CM_PASS_GROUPS];
                    for (int g = 0; g < NG; ++g) xt[g] = t == 0 ? x0[g] : vreinterpretq_s8_s32(vdupq_n_s32(x4[g * T + t]));
                    const int32x4_t off = t == 0 ? off0 : q8_offset(x4, NG, T, t, BITS);
                    int32_t * a = acc + t * n_pad + s->pad0 + r;
                    for (int m = 0; m < 4; ++m) {
                        int32x4_t v = first ? off : vaddq_s32(vld1q_s32(a + 16 * m + 4 * P), off);
                        for (int g = 0; g < NG; ++g) v = vdotq_s32(v, w[g][m], xt[g]);
                        const int64_t rr = r + 16 * m + 4 * P;
                        put_sums4(v, a + 16 * m + 4 * P, fold, scp, rr, six, s8, t, tsum, t * n_pad + s->pad0 + rr, t_first);
                    }
                }
            }
        }
    }
}

// Four fp16 values at p as floats.
static inline float32x4_t f16x4(const ggml_fp16_t * p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *) p)));
}

// xblock 32: y (+)= a * (dx * acc) + b * sx over every segment's rows (first: from 0), a and b
// as seg_ab computes them.
static void fold_float(const struct pi_colmat * cm, const struct chunk_view * v, int64_t j, int64_t T, struct piece_buf pb,
                       bool first) {
    const int64_t n_pad = cm->n_pad;
    for (int k = 0; k < cm->n_segs; ++k) {
        const struct pi_colmat_seg * s = &cm->seg[k];
        const size_t rows = (size_t) s->n_tiles * TILE;
        int64_t ta, tz;
        seg_tiles(cm, k, pb.ga, pb.gb, &ta, &tz);
        const int64_t r_end = tz * TILE < s->n_rows ? tz * TILE : s->n_rows;
        for (int64_t r = ta * TILE; r < r_end; r += 4) {
            float32x4_t a, b;
            switch (s->scales) {
                case PI_CM_D:
                    a = f16x4(s->d + (size_t) (j / QK) * rows + r);
                    b = vmulq_f32(vdupq_n_f32(-(float) s->offset), a);
                    break;
                case PI_CM_DM:
                    a = f16x4(s->d + (size_t) (j / QK) * rows + r);
                    b = f16x4(s->m + (size_t) (j / QK) * rows + r);
                    break;
                case PI_CM_K: {
                    const float32x4_t d  = f16x4(s->d + (size_t) (j / QK_K) * rows + r);
                    const float32x4_t dm = f16x4(s->m + (size_t) (j / QK_K) * rows + r);
                    a = vmulq_f32(d, vcvtq_f32_s32(k_sc4(s->sc + sc_group(rows, j / QK, r), (int) ((r / 4) & 3))));
                    int32_t mn[4];
                    for (int i = 0; i < 4; ++i) mn[i] = k_min(s->mins, rows, j / QK, r + i);
                    b = vnegq_f32(vmulq_f32(dm, vcvtq_f32_s32(vld1q_s32(mn))));
                    break;
                }
                default: {  // PI_CM_6K
                    const float32x4_t d = f16x4(s->d + (size_t) (j / QK_K) * rows + r);
                    a = vmulq_f32(d, vcvtq_f32_s32(sc6_4(s->sc + (size_t) (j / 16) * rows + r)));
                    b = vmulq_f32(vdupq_n_f32(-(float) s->offset), a);
                    break;
                }
            }
            for (int64_t t = 0; t < T; ++t) {
                const int64_t i = t * n_pad + s->pad0 + r;
                const float32x4_t x = vmulq_f32(vdupq_n_f32(v->dx[t]), vcvtq_f32_s32(vld1q_s32(pb.acc + i)));
                const float32x4_t yv = vfmaq_f32(first ? vdupq_n_f32(0.0f) : vld1q_f32(pb.y + i), a, x);
                vst1q_f32(pb.y + i, vfmaq_f32(yv, b, vdupq_n_f32(v->sx[t])));
            }
        }
    }
}

// Two rows' 6-bit minimums (6 bytes a row from p) as bytes, row i's 8 in 64-bit lane i (the
// AVX-512 k_min8's halvings on two lanes).
static inline uint8x16_t k_min2(const uint8_t * p) {
    static const uint8_t at[16] = { 0, 1, 2, 3, 4, 5, 255, 255, 6, 7, 8, 9, 10, 11, 255, 255 };
    uint64x2_t v = vreinterpretq_u64_u8(vqtbl1q_u8(vld1q_u8(p), vld1q_u8(at)));  // index 255: 0
    v = vbslq_u64(vdupq_n_u64(0x00FFFFFF00000000ULL), vshlq_n_u64(v, 8), v);
    v = vbslq_u64(vdupq_n_u64(0x0FFF00000FFF0000ULL), vshlq_n_u64(v, 4), v);
    v = vbslq_u64(vdupq_n_u64(0x3F003F003F003F00ULL), vshlq_n_u64(v, 2), v);
    return vandq_u8(vreinterpretq_u8_u64(v), vdupq_n_u8(63));
}

// Per 32-bit lane: 4 of a row's minimums times the sub-blocks' sums S = l + 128 h (l, h
// signed bytes), i.e. lanes 2i, 2i + 1 are the halves of row i's sum.
static inline int32x4_t min_dot(uint8x16_t m, int8x16_t l, int8x16_t h) {
    const int8x16_t ms = vreinterpretq_s8_u8(m);  // at most 63
    return vaddq_s32(vdotq_s32(vdupq_n_s32(0), ms, l), vshlq_n_s32(vdotq_s32(vdupq_n_s32(0), ms, h), 7));
}

// xblock 256, at a super-block's end: the AVX-512 fold_superblock on 4 rows a step.
static void fold_superblock(const struct pi_colmat * cm, const struct prep_view * prep, int64_t u, int64_t T,
                            const float * dx, struct piece_buf pb, bool first) {
    const int64_t C = cm->chunk, n_pad = cm->n_pad, per = QK_K / C, c0 = u * per;
    int8x16_t lo[PI_COLMAT_MAX_TOKENS], hi[PI_COLMAT_MAX_TOKENS];  // the sub-blocks' l and h bytes, in each 64-bit lane
    uint64_t l8[PI_COLMAT_MAX_TOKENS], h8[PI_COLMAT_MAX_TOKENS];
    const bool any_min = sub_sum_bytes(cm, prep, c0, T, l8, h8);
    for (int64_t t = 0; t < T && any_min; ++t) {
        lo[t] = vreinterpretq_s8_u64(vdupq_n_u64(l8[t]));
        hi[t] = vreinterpretq_s8_u64(vdupq_n_u64(h8[t]));
    }
    for (int k = 0; k < cm->n_segs; ++k) {
        const struct pi_colmat_seg * s = &cm->seg[k];
        const size_t rows = (size_t) s->n_tiles * TILE;
        const bool mins = s->scales == PI_CM_K;
        int64_t ta, tz;
        seg_tiles(cm, k, pb.ga, pb.gb, &ta, &tz);
        const int64_t r_end = tz * TILE < s->n_rows ? tz * TILE : s->n_rows;
        for (int64_t r = ta * TILE; r < r_end; r += 4) {
#if PI_CM_SCALE_PREFETCH
            if (r + PI_CM_SCALE_AHEAD < r_end) {
                const int64_t ra = r + PI_CM_SCALE_AHEAD;
                if (ra % 32 == 0) {
                    PI_CM_PREFETCH_L1(s->d + (size_t) u * rows + ra);
                    if (mins) PI_CM_PREFETCH_L1(s->m + (size_t) u * rows + ra);
                }
                if (mins && ra % 8 == 0) PI_CM_PREFETCH_L1(s->mins + min_group(rows, u, ra));
            }
#endif
            const float32x4_t d  = f16x4(s->d + (size_t) u * rows + r);
            const float32x4_t dm = mins ? f16x4(s->m + (size_t) u * rows + r) : vdupq_n_f32(0.0f);
            uint8x16_t m0 = vdupq_n_u8(0), m1 = m0;
            if (mins) {
                m0 = k_min2(s->mins + min_group(rows, u, r));      // rows r, r + 1
                m1 = k_min2(s->mins + min_group(rows, u, r + 2));  // rows r + 2, r + 3
            }
            for (int64_t t = 0; t < T; ++t) {
                const int64_t i = t * n_pad + s->pad0 + r;
                const float32x4_t dxt = vdupq_n_f32(dx[t]);
                const float32x4_t y0 = first ? vdupq_n_f32(0.0f) : vld1q_f32(pb.y + i);
                float32x4_t yv = vfmaq_f32(y0, vcvtq_f32_s32(vld1q_s32(pb.t + i)), vmulq_f32(d, dxt));
                if (mins) {
                    // pairwise: (row r's halves, row r + 1's) of m0, then m1's: rows in order
                    const int32x4_t off = vpaddq_s32(min_dot(m0, lo[t], hi[t]), min_dot(m1, lo[t], hi[t]));
                    yv = vfmsq_f32(yv, vcvtq_f32_s32(off), vmulq_f32(dm, dxt));
                }
                vst1q_f32(pb.y + i, yv);
            }
        }
    }
}
#endif

#ifdef PI_CM_SIMD
// One pass over the chunk's groups g .. g + NG - 1 (x4: [group][token]); only: every segment
// (-1), or that one.
static void groups_pass(const struct pi_colmat * cm, const int32_t * cols, const int32_t * x4, int NG, int64_t T,
                        int32_t * acc, bool first, const int32_t * pf, int npf, bool fold, int64_t j, int32_t * tsum,
                        bool t_first, const int32_t * s8, int64_t ga, int64_t gb, int only) {
    for (int k = only < 0 ? 0 : only; k < (only < 0 ? cm->n_segs : only + 1); ++k) {
        const struct pi_colmat_seg * s = &cm->seg[k];
        int64_t ta, tz;
        seg_tiles(cm, k, ga, gb, &ta, &tz);
        if (ta >= tz) continue;
#define PI_CM_NG(B, N) \
        if (fold) groups_seg(cm, s, B, N, cols, x4, T, acc, first, pf, npf, true, j, tsum, t_first, s8, ta, tz); \
        else      groups_seg(cm, s, B, N, cols, x4, T, acc, first, pf, npf, false, j, tsum, t_first, s8, ta, tz);
#define PI_CM_CASE(B) \
        switch (NG) { case 1: PI_CM_NG(B, 1) break; case 2: PI_CM_NG(B, 2) break; case 3: PI_CM_NG(B, 3) break; default: PI_CM_NG(B, 4) break; }
#if PI_CM_MAX_GROUPS > 4
        if (s->bits == 4 && NG > 4) {  // one token, 4-bit q (pass_groups)
            switch (NG) {
                case 5: dec_seg(cm, s, 4, 5, cols, x4, acc, first, pf, npf, j, tsum, t_first, ta, tz); break;
                case 6: dec_seg(cm, s, 4, 6, cols, x4, acc, first, pf, npf, j, tsum, t_first, ta, tz); break;
                case 7: dec_seg(cm, s, 4, 7, cols, x4, acc, first, pf, npf, j, tsum, t_first, ta, tz); break;
                default: dec_seg(cm, s, 4, 8, cols, x4, acc, first, pf, npf, j, tsum, t_first, ta, tz); break;
            }
            continue;
        }
#endif
        switch (s->bits) {
            case 4:  PI_CM_CASE(4); break;
            case 5:  PI_CM_CASE(5); break;
            case 6:  PI_CM_CASE(6); break;
            default: PI_CM_CASE(8); break;
        }
#undef PI_CM_CASE
#undef PI_CM_NG
    }
}

// groups_pass for a batch (T > 1): dec_seg_batch where it takes the segment's type. A
// function of its own, so that groups_pass's one-token code stays as it is.
static void groups_pass_batch(const struct pi_colmat * cm, const int32_t * cols, const int32_t * x4, int NG, int64_t T,
                              int32_t * acc, bool first, const int32_t * pf, int npf, bool fold, int64_t j, int32_t * tsum,
                              bool t_first, const int32_t * s8, int64_t ga, int64_t gb) {
#ifdef PI_CM_HAS_DEC_BATCH
    for (int k = 0; k < cm->n_segs; ++k) {
        const struct pi_colmat_seg * s = &cm->seg[k];
        int64_t ta, tz;
        seg_tiles(cm, k, ga, gb, &ta, &tz);
        if (ta < tz && !seg_batch(cm, s, NG, cols, x4, T, acc, first, pf, npf, j, tsum, t_first, ta, tz)) {
            groups_pass(cm, cols, x4, NG, T, acc, first, pf, npf, fold, j, tsum, t_first, s8, ga, gb, k);
        }
    }
#else
    groups_pass(cm, cols, x4, NG, T, acc, first, pf, npf, fold, j, tsum, t_first, s8, ga, gb, -1);
#endif
}

// Groups a pass takes: PI_CM_MAX_GROUPS where every segment has 4-bit q (see there), for a
// batch and for one token. One token first measured slower with 8 (gate+up 0.40 against 0.36
// ms), when dec_seg kept 32 spilled column pointers; with group_ptrs' offsets it is faster
// (Qwen2.5-1.5B, 40%, bench-input-sparse-avx2, alternating builds: 1 thread in cache gate+up
// 0.485 -> 0.46-0.476 ms, down Q4_K 0.274 -> 0.254-0.265; 2 threads gate+up 0.29-0.35 ->
// 0.26-0.29). 4 tokens: down Q4_K 0.143 against 0.173 ms a token.
static int32_t pass_groups(const struct pi_colmat * cm) {
    for (int k = 0; k < cm->n_segs; ++k) {
        if (cm->seg[k].bits != 4) return PI_CM_PASS_GROUPS;
    }
    return PI_CM_MAX_GROUPS;
}

static void piece_simd(const struct pi_colmat * cm, const struct prep_view * prep, int64_t T, int64_t u0, int64_t u1,
                       struct piece_buf pb) {
    const int64_t C = cm->chunk;
    const bool kmode = cm->xblock == QK_K;
    const int64_t per = kmode ? QK_K / C : 1, c_end = u1 * per;
    bool written = false;    // pb.y holds something
    bool t_written = false;  // pb.t holds this super-block's sums
    const int32_t G_pass = pass_groups(cm);
    // Up to G_pass groups per pass over acc (with xblock 256 the chunk's last pass
    // folds into t). Each pass brings the next pass's columns into L2 as it goes.
    int64_t c = u0 * per;
    while (c < c_end && chunk_at(prep, c, C, T).n_groups == 0) ++c;
    while (c < c_end) {
        const struct chunk_view v = chunk_at(prep, c, C, T);
        int64_t cn = c + 1;  // the next chunk with columns
        while (cn < c_end && chunk_at(prep, cn, C, T).n_groups == 0) ++cn;
        const struct chunk_view vn = cn < c_end ? chunk_at(prep, cn, C, T) : (struct chunk_view) { 0 };
        const int32_t G = G_pass;
        for (int32_t g = 0; g < v.n_groups; g += G) {
            const int ng = v.n_groups - g >= G ? G : v.n_groups - g;
            const bool last = g + G >= v.n_groups;
            const int32_t * pf = last ? vn.cols : v.cols + 4 * (g + G);
            const int npf = 4 * (last ? (vn.n_groups >= G ? G : vn.n_groups) : (v.n_groups - g - G >= G ? G : v.n_groups - g - G));
            const int32_t * x4 = v.x4 + g * T;
            if (T > 1) {
                groups_pass_batch(cm, v.cols + 4 * g, x4, ng, T, pb.acc, g == 0, pf, npf, kmode && last, c * C, pb.t,
                                  !t_written, v.s8, pb.ga, pb.gb);
            } else {
                groups_pass(cm, v.cols + 4 * g, x4, ng, T, pb.acc, g == 0, pf, npf, kmode && last, c * C, pb.t,
                            !t_written, v.s8, pb.ga, pb.gb, -1);
            }
        }
        if (!kmode) {
            fold_float(cm, &v, c * C, T, pb, !written);
            written = true;
        } else {
            t_written = true;
            if (cn >= c_end || cn / per != c / per) {  // the super-block's last chunk with columns
                fold_superblock(cm, prep, c / per, T, v.dx, pb, !written);
                written = true;
                t_written = false;
            }
        }
        c = cn;
    }
    if (!written) zero_piece_rows(pb.y, T, cm->n_pad, pb);
}
#endif

bool pi_colmat_simd(void) {
#ifdef PI_CM_SIMD
    return true;
#else
    return false;
#endif
}

// Forces the scalar kernels (tests compare the two).
static bool g_force_scalar = false;
void pi_colmat_force_scalar(bool on) { g_force_scalar = on; }

static inline void cpu_relax(void) {
#if defined(__SSE2__)
    _mm_pause();
#endif
}

// All nth threads of the op meet here (the op runs on every thread of ggml's pool). The
// counters live in the op and are never reset: a generation count tells rounds apart.
static void op_barrier(struct pi_input_op * op, int nth) {
    if (nth <= 1) {
        return;
    }
    const int32_t gen = __atomic_load_n(&op->sync[1], __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&op->sync[0], 1, __ATOMIC_ACQ_REL) == nth) {
        __atomic_store_n(&op->sync[0], 0, __ATOMIC_RELAXED);
        __atomic_fetch_add(&op->sync[1], 1, __ATOMIC_RELEASE);
    } else {
        while (__atomic_load_n(&op->sync[1], __ATOMIC_ACQUIRE) == gen) cpu_relax();
    }
}

// The pieces: a function of the shape alone (never of the batch or the threads), so that
// the sums, and their rounding, are the same however the work is shared. A grid: column
// pieces of whole units (up to PI_CM_PIECES), and, when those are fewer than
// PI_CM_MIN_PIECES and the columns long, each cut into row pieces, so that the threads
// that claim them share the work out evenly (a column run stays at least 32 tiles long).
#ifndef PI_CM_MIN_PIECES
#define PI_CM_MIN_PIECES 12
#endif
// Columns longer than this many tiles (an LM head's 151936 rows: 1187 tiles; a gate+up
// group from n_ff 4096 on) are cut into row pieces only, each running every kept column over
// its rows: one partial plane, which is y itself when no segment is padded, so no sum of
// partials and no barrier before it (a column piece of the whole head would need 600 KiB a
// token, and one per piece). A row's sum then runs in one piece, so the row pieces may
// follow the thread count (at least one each) without changing a bit. Measured on
// Qwen2.5-1.5B's Q6_K head (bench-input-sparse, 2 EPYC cores, 40%): pieces of ~300 tiles
// 3.56 ms, of ~600 3.84, of ~150 4.05, of ~50 5.06 (and the column grid, 6 x 2 pieces,
// 3.62). On its gate+up (140 tiles), `main` at 40% (alternating runs, 3-4 x 200 tokens):
// one row piece per thread 37.6-38.7 tok/s against the column grid's 36.1-37.9 (6 x 2
// pieces); two per thread 34.0. Qwen2.5-0.5B (76 tiles) at 40%: 63.5 against 61.6.
#ifndef PI_CM_LONG_TILES
#define PI_CM_LONG_TILES 64
#endif
#ifndef PI_CM_LONG_PIECE_TILES
#define PI_CM_LONG_PIECE_TILES 320
#endif

#define PI_CM_MAX_PIECES (PI_CM_PIECES * PI_CM_MIN_PIECES)

struct piece_grid {
    int64_t n_col, n_row, n_tiles;
};

static int64_t total_tiles(const struct pi_colmat * cm) {
    int64_t n = 0;
    for (int k = 0; k < cm->n_segs; ++k) n += cm->seg[k].n_tiles;
    return n;
}

static struct piece_grid grid_of(const struct pi_colmat * cm, int64_t n_threads) {
    struct piece_grid g;
    const int64_t n = n_units_of(cm);
    g.n_tiles = total_tiles(cm);
    if (g.n_tiles > PI_CM_LONG_TILES) {
        g.n_col = 1;
        g.n_row = (g.n_tiles + PI_CM_LONG_PIECE_TILES - 1) / PI_CM_LONG_PIECE_TILES;
        g.n_row = g.n_row < n_threads ? n_threads : g.n_row;
        g.n_row = g.n_row > PI_CM_MAX_PIECES ? PI_CM_MAX_PIECES : g.n_row;
        return g;
    }
    g.n_col = n < PI_CM_PIECES ? n : PI_CM_PIECES;
    g.n_row = 1;
    while (g.n_col * g.n_row < PI_CM_MIN_PIECES && g.n_tiles / (g.n_row + 1) >= 32) ++g.n_row;
    return g;
}

// The order in which the threads claim the pieces: the most work first (kept groups times
// tiles; ties by index), so that the last pieces claimed are short and no thread waits
// long for another at the op's end. Every thread computes the same order from the records;
// it decides only who runs a piece, never what a piece sums, so results do not depend on it.
static void piece_order(const struct pi_colmat * cm, const struct prep_view * pv, int64_t T, struct piece_grid G, int64_t * order) {
    const int64_t n_units = n_units_of(cm), C = cm->chunk, per = cm->xblock == QK_K ? QK_K / C : 1;
    const int64_t n = G.n_col * G.n_row;
    int64_t work[PI_CM_MAX_PIECES];
    for (int64_t cp = 0; cp < G.n_col; ++cp) {
        int64_t groups = 0;
        for (int64_t c = n_units * cp / G.n_col * per; c < n_units * (cp + 1) / G.n_col * per; ++c) {
            groups += 1 + chunk_at(pv, c, C, T).n_groups;  // 1: a chunk's fold
        }
        for (int64_t rp = 0; rp < G.n_row; ++rp) {
            work[cp * G.n_row + rp] = groups * (G.n_tiles * (rp + 1) / G.n_row - G.n_tiles * rp / G.n_row);
        }
    }
    for (int64_t i = 0; i < n; ++i) {  // insertion sort, descending work (n <= PI_CM_MAX_PIECES)
        int64_t j = i;
        while (j > 0 && work[order[j - 1]] < work[i]) {
            order[j] = order[j - 1];
            --j;
        }
        order[j] = i;
    }
}

// The op's memory, in 4-byte words: the result y [T][n_out]; the chunk records; per column
// piece its partial output [T][n_pad] (its row pieces write disjoint rows); per thread that
// claims pieces (slots) its two int32 scratch planes [T][n_pad]. Each part 64-byte aligned.
// When no segment is padded (n_pad == n_out: every matrix's rows whole tiles, as in the
// models measured here), y has a plane's layout and is the first column piece's plane: the
// sum of the partials then starts from it, and with one column piece (an LM head's row
// pieces) there is no sum and no barrier before it.
struct op_layout {
    size_t  prep, parts, scratch, total;
    int64_t slots;
    bool    y_plane;  // y is column piece 0's plane; parts holds pieces 1 ..
};

static struct op_layout layout_of(const struct pi_colmat * cm, int64_t T, int64_t n_threads) {
    const size_t align = 16, plane = (size_t) (cm->n_pad * T);
    const struct piece_grid G = grid_of(cm, n_threads);
    struct op_layout L;
    L.slots   = n_threads < G.n_col * G.n_row ? n_threads : G.n_col * G.n_row;
    L.prep    = ((size_t) (cm->n_out * T) + align - 1) / align * align;
    L.parts   = L.prep + ((size_t) (cm->n_in / cm->chunk * rec_len(cm->chunk, T)) + align - 1) / align * align;
    L.y_plane = cm->n_pad == cm->n_out;
    L.scratch = L.parts + (size_t) (G.n_col - L.y_plane) * plane;
    L.total   = L.scratch + 2 * (size_t) L.slots * plane;
    return L;
}

// Column piece cp's partial plane [T][n_pad]: y itself for piece 0 when L.y_plane. base: the
// op's memory (y is its start when the op is a graph node, a tensor of its own for pi_input_sparse_run).
static inline float * part_plane(float * base, float * y, const struct op_layout * L, int64_t plane, int64_t cp) {
    return L->y_plane ? (cp == 0 ? y : base + L->parts + (size_t) (cp - 1) * (size_t) plane)
                      : base + L->parts + (size_t) cp * (size_t) plane;
}

// prepare (threads by quantization blocks) | the pieces (claimed) | the sum of the pieces'
// partials (threads by rows), with two barriers: one graph node.
static void input_run(struct pi_input_op * op, const struct ggml_tensor * x, float * y, float * base, int ith, int nth) {
    const struct pi_colmat * cm = op->cm;
    const struct piece_grid G = grid_of(cm, op->n_threads);
    const int64_t T = x->ne[1], n_units = n_units_of(cm), n_pieces = G.n_col * G.n_row, n_pad = cm->n_pad;
    const struct op_layout L = layout_of(cm, T, op->n_threads);
    const struct prep_view pv = { (int32_t *) base + L.prep, rec_len(cm->chunk, T), cm->n_in / cm->chunk };

    const int64_t n_blocks = cm->n_in / cm->xblock;
    const int64_t kept = prepare_blocks(cm, op->stat->threshold, x, &pv, n_blocks * ith / nth, n_blocks * (ith + 1) / nth);
    __atomic_fetch_add(&op->stat->n_active, kept, __ATOMIC_RELAXED);
    if (ith == 0) {
        __atomic_fetch_add(&op->stat->n_total, cm->n_in * T, __ATOMIC_RELAXED);
        __atomic_store_n(&op->sync[2], 0, __ATOMIC_RELAXED);  // the piece counter
    }
    op_barrier(op, nth);

    // threads beyond the scratch slots (more than the graph was built for) claim no pieces
    int32_t * scratch = (int32_t *) base + L.scratch + 2 * (size_t) ith * (size_t) (n_pad * T);
    int64_t order[PI_CM_MAX_PIECES];
    if (ith < L.slots) piece_order(cm, &pv, T, G, order);
    for (; ith < L.slots;) {
        const int64_t i = __atomic_fetch_add(&op->sync[2], 1, __ATOMIC_RELAXED);
        if (i >= n_pieces) break;
        const int64_t p = order[i];
        const int64_t cp = p / G.n_row, rp = p % G.n_row;
        const struct piece_buf pb = { part_plane(base, y, &L, n_pad * T, cp), scratch, scratch + n_pad * T,
                                      G.n_tiles * rp / G.n_row, G.n_tiles * (rp + 1) / G.n_row };
        const int64_t u0 = n_units * cp / G.n_col, u1 = n_units * (cp + 1) / G.n_col;
#ifdef PI_CM_SIMD
        if (!g_force_scalar) {
            piece_simd(cm, &pv, T, u0, u1, pb);
            continue;
        }
#endif
        piece_scalar(cm, &pv, T, u0, u1, pb);
    }
    if (L.y_plane && G.n_col == 1) {
        return;  // the pieces wrote y; ggml's barrier ends the node
    }
    op_barrier(op, nth);

    // each row: the partials of the column pieces, in their order. Threads take whole tiles.
    for (int64_t g = G.n_tiles * ith / nth; g < G.n_tiles * (ith + 1) / nth; ++g) {
        int k = 0;
        int64_t tile0 = 0;  // segment k's first tile
        while (g >= tile0 + cm->seg[k].n_tiles) tile0 += cm->seg[k++].n_tiles;
        const struct pi_colmat_seg * s = &cm->seg[k];
        const int64_t r0 = (g - tile0) * TILE, r1 = r0 + TILE < s->n_rows ? r0 + TILE : s->n_rows;
        for (int64_t t = 0; t < T; ++t) {
            float * yt = y + t * cm->n_out + s->row0;
            if (!L.y_plane) {
                const float * p0 = part_plane(base, y, &L, n_pad * T, 0) + t * n_pad + s->pad0;
                for (int64_t r = r0; r < r1; ++r) yt[r] = p0[r];
            }
            for (int64_t cp = 1; cp < G.n_col; ++cp) {
                const float * pp = part_plane(base, y, &L, n_pad * T, cp) + t * n_pad + s->pad0;
                for (int64_t r = r0; r < r1; ++r) yt[r] += pp[r];
            }
        }
    }
}

static void input_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    input_run(userdata, dst->src[0], (float *) dst->data, (float *) dst->data, ith, nth);
}

size_t pi_input_sparse_work_size(const struct pi_colmat * cm, int64_t T, int n_threads) {
    return layout_of(cm, T, n_threads).total * sizeof(float);
}

void pi_input_sparse_run(struct pi_input_op * op, const struct ggml_tensor * x, float * y, void * work, int ith, int nth) {
    input_run(op, x, y, work, ith, nth);
}

struct ggml_tensor * pi_input_sparse_matmul(struct ggml_context * ctx, struct pi_input_op * op, struct ggml_tensor * x) {
    const struct pi_colmat * cm = op->cm;
    GGML_ASSERT(x->type == GGML_TYPE_F32 && x->ne[0] == cm->n_in && x->nb[0] == sizeof(float) && x->ne[2] == 1 && x->ne[3] == 1);
    GGML_ASSERT(x->ne[1] >= 1 && x->ne[1] <= PI_COLMAT_MAX_TOKENS);
    const int64_t T = x->ne[1];
    struct ggml_tensor * xa[1] = { x };
    GGML_ASSERT(op->n_threads >= 1);
    struct ggml_tensor * all = ggml_custom_4d(ctx, GGML_TYPE_F32, (int64_t) layout_of(cm, T, op->n_threads).total, 1, 1, 1, xa,
                                              1, input_op, GGML_N_TASKS_MAX, op);
    return ggml_view_2d(ctx, all, cm->n_out, T, (size_t) cm->n_out * sizeof(float), 0);
}
