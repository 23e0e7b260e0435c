// packed_matmul.h - Q4_0 and Q8_0 matmuls on weights packed for AVX-512 VNNI: one 512-bit
// load holds 4 consecutive weights (8 for Q4_0) of 16 output rows, which vpdpbusd
// multiplies with 4 broadcast input bytes into 16 row sums at once. They run both decode
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
// Both are the size of the plain type.
#pragma once

#include "ggml.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PI_PACK_ROWS 16

enum pi_pack_type {
    PI_PACK_Q4 = 1,
    PI_PACK_Q8 = 2,
};

// Whether this build has the kernels (AVX-512 with VNNI). Without them the matmul still
// runs (scalar), but callers should keep ggml's types.
bool pi_pack_available(void);

// Whether a ggml weight of this type and shape [n_cols, n_rows] packs exactly (Q4_0 or
// Q8_0, n_rows a multiple of PI_PACK_ROWS).
bool pi_pack_fits(enum ggml_type type, int64_t n_cols, int64_t n_rows);

// The descriptor of a packed n_rows x n_cols matrix in ctx: I8 [bytes of one group of
// rows, n_rows / PI_PACK_ROWS], the packing recorded in its op_params (a weight, never an
// op's result, so ggml leaves them alone). Allocate it like any tensor.
struct ggml_tensor * pi_pack_tensor(struct ggml_context * ctx, enum pi_pack_type type, int64_t n_rows, int64_t n_cols);
enum pi_pack_type pi_pack_type(const struct ggml_tensor * w);
int64_t pi_pack_rows(const struct ggml_tensor * w);
int64_t pi_pack_cols(const struct ggml_tensor * w);

// Packs a Q4_0 (into PI_PACK_Q4) or Q8_0 (into PI_PACK_Q8) matrix exactly: src row r at
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
