// sparse_kernels.h - the per-row arithmetic of the sparse operators (sparse_ops.c): dot
// products of a few weight rows with one quantized input, and AXPY of a few weight rows
// into a float output. Rows are scattered (the active neurons), so the kernels take row
// pointers; SIMD kernels cover the common types (Q4_0, Q8_0 at the AVX-512, AVX-VNNI, AVX2
// and NEON dotprod levels), and every other ggml type goes through ggml's own CPU type traits.
#pragma once

#include "ggml.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// Rows handled together by one kernel call (they share the input's loads).
#define PI_ROWS_MAX 4

// Brings n bytes from p towards the core ahead of use. Into L2, not L1: a row is dozens
// of cache lines, and filling L1's few miss buffers with them stalls the loads that the
// current row's arithmetic needs (measured: docs/benchmarks.md).
void pi_prefetch(const void * p, size_t n);

// Rows to bring in while the current ones are computed: the prefetches are spread over
// the kernel's loop, a few cache lines per step, so the memory system has the next rows in
// flight without a burst of requests that would overflow its miss buffers.
struct pi_next_rows {
    const void * rows[PI_ROWS_MAX];
    int          k;      // 0: nothing to prefetch
    size_t       bytes;  // of each row
};

// out[j] = row_j . y for j < k (k <= PI_ROWS_MAX): rows of `type` with n elements, y the
// same n elements converted to type's vec_dot_type (ggml_get_type_traits_cpu). next may be NULL.
void pi_rows_dot(enum ggml_type type, int64_t n, const void * const * rows, int k, const void * y, float * out,
                 const struct pi_next_rows * next);

// out[0, n) += a[j] * row_j for j = 0 .. k-1, in that order for every element, each
// step a fused multiply-add of the dequantized weight (so the result does not depend on
// how rows are grouped into calls). rows point at n elements of `type` (n a multiple of
// its block size). Types without a fused kernel are dequantized PI_AXPY_PIECE elements
// at a time on the stack. init: out holds nothing yet; the sums start from 0 (as if out
// were zeroed first).
#define PI_AXPY_PIECE 1024
void pi_rows_axpy(enum ggml_type type, int64_t n, const void * const * rows, const float * a, int k, float * out,
                  const struct pi_next_rows * next, bool init);
