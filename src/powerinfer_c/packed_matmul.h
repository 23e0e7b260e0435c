// packed_matmul.h - a Q8_0 matmul for batches on weights packed for AVX-512 VNNI, which
// ggml's CPU backend does not repack on x86. It serves the batch copy of the down
// projection (repack.c): the copy re-quantized to 8 bits stays within 0.5% of the file's
// values, and this kernel runs it about as fast as ggml's repacked 4-bit matmul.
//
// Packed layout ("Q8_0x16"): output rows in groups of 16; per group and per 32-element
// block of the input dimension, 16 fp16 scales then 8 chunks of 64 bytes, chunk q holding
// for each of the 16 rows its 4 weights of elements 4q .. 4q+3 (as w + 128, unsigned).
// Same size as Q8_0: 34 bytes per 32 weights.
#pragma once

#include "ggml.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PI_Q8P_ROWS 16

// Whether this build has the kernel (AVX-512 with VNNI); else callers keep plain Q8_0.
bool pi_q8p_available(void);

// Bytes of a packed matrix of n_rows (a multiple of PI_Q8P_ROWS) x n_cols (a multiple of 32).
size_t pi_q8p_nbytes(int64_t n_rows, int64_t n_cols);

// Packs rows [r0, r0 + PI_Q8P_ROWS) of a float matrix (row r at src + (r - r0) * n_cols,
// n_cols floats) into their group of dst, quantized as ggml quantizes Q8_0.
void pi_q8p_pack_group(const float * src, int64_t n_cols, int64_t r0, void * dst);

// The descriptor of a packed n_rows x n_cols matrix in ctx: I8 [bytes of one group of
// rows, n_rows / PI_Q8P_ROWS] (allocate it like any tensor; its shape gives the matrix's).
struct ggml_tensor * pi_q8p_tensor(struct ggml_context * ctx, int64_t n_rows, int64_t n_cols);
int64_t pi_q8p_rows(const struct ggml_tensor * w);
int64_t pi_q8p_cols(const struct ggml_tensor * w);

// w: from pi_q8p_tensor, x: F32 [n_cols, T]. Result: F32 [n_rows, T], out[r, t] = w_r . x_t
// with x quantized to Q8_0 per 32 elements, as ggml_mul_mat does for Q8_0 weights.
struct ggml_tensor * pi_q8p_matmul(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * x);
