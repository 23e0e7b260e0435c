// input_sparse.h - input sparsity on every matrix (training-free, TEAL-style): y = W x
// computed from only the columns of W whose input entry is kept, |x_j| > tau, so a decode
// step reads the kept fraction of each matrix's bytes. The matrices live in a second,
// column-major copy made at load from the file's quantized blocks, exactly: the same
// integers and the same scales, only rearranged (docs/input-sparsity.md).
//
// A column copy ("colmat") holds one or more matrices that share their input (q, k and v;
// gate and up; o; down), stacked by rows, so one column of the copy is one input entry's
// weights in every matrix of the group, contiguous in memory. A weight is
//   w[i, j] = a[i, u] * q[i, j] + b[i, u]
// with q an unsigned integer of 4, 5, 6 or 8 bits and (a, b) per row and per unit u of 16
// or 32 columns, computed from the file's own scales (ggml's block formats).
#pragma once

#include "ggml.h"
#include "sparse_ops.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PI_COLMAT_MAX_SEGS 3   // matrices in one group (q, k, v)
#define PI_COLMAT_TILE     128 // rows per tile; a segment's rows are padded to whole tiles
#define PI_COLMAT_MAX_TOKENS 32 // the largest batch the operator takes

// How a segment's scales turn into (a, b).
enum pi_colmat_scales {
    PI_CM_D,   // a = d per 32 columns, b = -offset * a (Q4_0, Q5_0, Q8_0)
    PI_CM_DM,  // a = d, b = m per 32 columns (Q4_1, Q5_1)
    PI_CM_K,   // a = d * sc, b = -dmin * m: d, dmin per 256 columns, sc, m per 32 (Q4_K, Q5_K)
    PI_CM_6K,  // a = d * sc, b = -32 * a: d per 256 columns, sc per 16 (Q6_K)
};

struct pi_colmat_seg {
    enum ggml_type         type;     // the file's type
    enum pi_colmat_scales  scales;
    int32_t                bits;     // of q: 4, 5, 6 or 8
    int32_t                unit;     // columns per (a, b): 16 or 32
    int32_t                offset;   // PI_CM_D / PI_CM_6K: b = -offset * a
    int64_t                row0;     // first row in the group's output
    int64_t                pad0;     // first row in the operator's scratch (segments padded to tiles)
    int64_t                n_rows;   // rows of the matrix
    int64_t                n_tiles;  // n_rows padded to PI_COLMAT_TILE, in tiles
    size_t                 col_off;  // byte offset of this segment's part of a column
    size_t                 rec;      // bytes of one tile of one column: lo + hi
    size_t                 lo, hi;   // of its low plane (nibbles, or bytes) and its high plane (5 and 6 bits)
    // Scale arrays, each [units][n_tiles * PI_COLMAT_TILE] (rows fastest), NULL when unused
    // (K's sc and mins keep the file's 6 bits, packed: input_sparse.c, get6):
    const ggml_fp16_t *    d;        // per 32 (D, DM) or per 256 columns (K, 6K)
    const ggml_fp16_t *    m;        // DM: per 32; K: dmin per 256
    const uint8_t *        sc;       // K: 6 bits per 32, 16 rows in 12 bytes (6K: int8 per 16)
    const uint8_t *        mins;     // K: 6 bits per 32, a row's 8 of a super-block in 6 bytes
};

struct pi_colmat {
    int64_t n_in;        // columns (the input's length)
    int64_t n_out;       // rows of all segments
    int64_t n_pad;       // rows of all segments, each padded to whole tiles
    int32_t chunk;       // columns per chunk: the smallest unit of the segments (16 or 32)
    int32_t xblock;      // columns per quantization step of the input: 256 when every segment is a
                         // K-quant (the sums then fold in integers per super-block), else 32
    int32_t n_segs;
    size_t  col_stride;  // bytes of one column (every segment), a multiple of 64
    const uint8_t * q;   // [n_in][col_stride]
    size_t  bytes;       // of the whole copy (columns and scales)
    struct pi_colmat_seg seg[PI_COLMAT_MAX_SEGS];
};

// Whether a ggml type has an exact column form.
bool pi_colmat_type_ok(enum ggml_type type);

// Plans the column copy of w[0..n) (each [n_in, rows], the same n_in, types with a column
// form, n_in a multiple of the types' block sizes and of 32): fills cm's shape and returns
// the bytes it needs (0 when the matrices cannot have one).
size_t pi_colmat_plan(struct pi_colmat * cm, struct ggml_tensor * const * w, int n);

// Points the copy at mem: pi_colmat_plan's bytes, 64-byte aligned and zero-filled (as a
// fresh anonymous mapping is).
void pi_colmat_bind(struct pi_colmat * cm, void * mem);

// Writes the bound copy from the matrices' data: tiles [ith * n / nth, (ith + 1) * n / nth)
// of every segment, so threads can share the work.
void pi_colmat_fill(const struct pi_colmat * cm, struct ggml_tensor * const * w, int ith, int nth);

// Row r of the copy, for tests: w[j] = a[j] * q + b[j] for j in [0, n_in) (a, b may be NULL).
void pi_colmat_row(const struct pi_colmat * cm, int64_t r, float * w, float * a, float * b);

// Runs the product's scalar kernels even where SIMD ones exist (tests compare the two).
void pi_colmat_force_scalar(bool on);

// One input-sparse product's matrices and counters; must outlive the graphs that use it.
struct pi_input_op {
    const struct pi_colmat * cm;
    struct pi_active_stat *  stat;  // threshold, and the kept / considered counters
    int32_t                  n_threads; // the most threads a graph will run the operator with (its scratch per thread)
    int32_t                  sync[3]; // the operator's own: barrier count and generation, piece counter (start at 0)
};

// The input-sparse product. x: F32 [n_in, T], T <= PI_COLMAT_MAX_TOKENS. Entry j of token t
// is kept when |x[j, t]| > op->stat->threshold; a batch reads the union of its tokens' kept
// columns, and each token uses only its own entries, so its result is the one it gets
// alone. Kept entries are quantized to 8 bits per cm->xblock columns (as ggml's Q8_K for
// K-quants, Q8_0 else). Result: F32 [n_out, T], y[:, t] = W x_t over the kept entries.
// stat->n_active / n_total count kept and considered entries per token.
// One graph node (a view of it), run by every thread of the pool.
struct ggml_tensor * pi_input_sparse_matmul(struct ggml_context * ctx, struct pi_input_op * op, struct ggml_tensor * x);

// The same product outside a graph (the ggml backend module, src/powerinfer_accel/): thread
// ith of nth (every one calls it, nth <= op->n_threads) computes y = W x into y (F32
// [n_out, T], row stride n_out) with `work` as its memory: pi_input_sparse_work_size bytes,
// 64-byte aligned, shared by the threads of one call. Bits equal to the graph node's.
size_t pi_input_sparse_work_size(const struct pi_colmat * cm, int64_t T, int n_threads);
void pi_input_sparse_run(struct pi_input_op * op, const struct ggml_tensor * x, float * y, void * work, int ith, int nth);
