// packed_matmul.h - Q4_0 and Q8_0 matmuls on weights packed for VNNI: one 512-bit load
// holds 4 consecutive weights (8 for Q4_0) of 16 output rows, which vpdpbusd multiplies with
// 4 broadcast input bytes into 16 row sums at once (AVX-VNNI and AVX2 read the same chunk as
// two 256-bit halves of 8 rows, NEON dotprod as four quarters of 4; packed_matmul.c). They run both decode
// (one token) and batches faster than ggml's x86 kernels on this layout family (ggml has
// no Q8_0 repack on x86, and its repacked Q4_0 kernels leave bandwidth unused), and the
// packing from the file's Q4_0/Q8_0 blocks is exact: the same scales and integers.
//
// Layout: output rows in groups of PI_PACK_ROWS (16). Per group and per 32-element block
// of the input dimension, the 16 rows' fp16 scales, then 64-byte chunks in which row r
// holds 4 bytes at r * 4:
//   Q8 (Q8_0x16): 8 chunks; chunk c = weights 4c .. 4c+3 as w + 128 (544 bytes a block);
//   Q4 (Q4_0x16): 4 chunks; chunk c = Q4_0's bytes qs[4c .. 4c+3] (low nibbles: weights
//                 4c .. 4c+3, high nibbles: 16+4c .. 16+4c+3, each stored as q + 8; 288 bytes).
//   Q41 (Q4_1x16): the 16 rows' fp16 scales, then their fp16 minimums, then Q4's 4 chunks
//                 (nibbles as stored, 0..15; weight = d * q + m; 320 bytes).
//   Q5 (Q5_0x16): Q8's layout, each weight stored as its 5-bit q (0..31; weight = d * (q - 16)).
//   Q4F (from Q4_K): Q41 with fp32 scales and minimums (d * sc and -dmin * m of each 32-weight
//                 sub-block, exact in fp32; 384 bytes).
//   Q6F (from Q6_K): 16 fp32 scales of weights 0-15, 16 of weights 16-31 (d * sc of each 16),
//                 then Q8's 8 chunks holding the 6-bit q (0..63; weight = scale * (q - 32); 640 bytes).
// Q4, Q41 and Q8 are the size of the plain type; Q5, Q4F and Q6F 1.55x, 1.33x and 1.52x. Each batch column is computed alone, in the same
// order whatever the batch holds, so a column's result does not depend on the others
// (batch-invariant, which ggml's tiled and repacked kernels are not).
#pragma once

#include "ggml.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PI_PACK_ROWS 16

enum pi_pack_type {
    PI_PACK_NONE = 0,
    PI_PACK_Q4   = 1,
    PI_PACK_Q8   = 2,
    PI_PACK_Q41  = 3,
    PI_PACK_Q5   = 4,
    PI_PACK_Q4F  = 5,
    PI_PACK_Q6F  = 6,
};

// Whether this level has the kernels (AVX-512 VNNI, AVX-VNNI, AVX2, NEON dotprod). Without
// them (the scalar levels) the matmul still runs, with the same bits, but slowly: callers
// should keep ggml's types.
bool pi_pack_available(void);

// Whether a ggml weight of this type and shape [n_cols, n_rows] packs exactly (Q4_0, Q4_1,
// Q5_0, Q8_0, Q4_K or Q6_K, n_rows a multiple of PI_PACK_ROWS).
bool pi_pack_fits(enum ggml_type type, int64_t n_cols, int64_t n_rows);
// The packing a ggml type packs exactly into (PI_PACK_NONE: none).
enum pi_pack_type pi_pack_type_of(enum ggml_type type);

// The descriptor of a packed n_rows x n_cols matrix in ctx: I8 [bytes of one group of
// rows, n_rows / PI_PACK_ROWS], the packing recorded in its op_params (a weight, never an
// op's result, so ggml leaves them alone). Allocate it like any tensor.
struct ggml_tensor * pi_pack_tensor(struct ggml_context * ctx, enum pi_pack_type type, int64_t n_rows, int64_t n_cols);
enum pi_pack_type pi_pack_type(const struct ggml_tensor * w);
int64_t pi_pack_rows(const struct ggml_tensor * w);
int64_t pi_pack_cols(const struct ggml_tensor * w);

// Packs a Q4_0 (into PI_PACK_Q4), Q4_1 (PI_PACK_Q41), Q5_0 (PI_PACK_Q5), Q8_0 (PI_PACK_Q8),
// Q4_K (PI_PACK_Q4F) or Q6_K (PI_PACK_Q6F) matrix exactly: src row r at
// src + r * row_stride, n_rows x n_cols; dst: the packed tensor's data. Rows
// [r_begin, r_end) only (whole groups), so threads can share the work.
void pi_pack_rows_exact(enum ggml_type type, const void * src, size_t row_stride, int64_t n_cols, int64_t r_begin,
                        int64_t r_end, void * dst);

// Packs rows [r0, r0 + PI_PACK_ROWS) of a float matrix (row r at src + (r - r0) * n_cols)
// into their group of a PI_PACK_Q8 dst, quantized as ggml quantizes Q8_0.
void pi_pack_q8_group_f32(const float * src, int64_t n_cols, int64_t r0, void * dst);

// w: a packed matrix, x: F32 [n_cols, T]. Result: F32 [n_rows, T], out[r, t] = w_r . x_t
// with x quantized to Q8_0 per 32 elements, as ggml_mul_mat does for these types.
struct ggml_tensor * pi_packed_matmul(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * x);
