// test_sparse_ops.c - runs the sparse operators on inputs written by
// tests/test_sparse_ops.py and writes their results back for a numpy comparison.
//
// usage: test-sparse-ops TYPE N_THREADS IN OUT
//   IN:  int64 n_embd, n_ff, n_tok; f32 W[n_ff][n_embd]; f32 x[n_tok][n_embd];
//        f32 h[n_tok][n_ff]; int32 n_active; int32 idx[n_active] (ascending)
//   OUT: f32 W as quantized then dequantized [n_ff][n_embd]; f32 up[n_tok][n_ff];
//        f32 down[n_tok][n_embd] (W used as ffn_down_t);
//        f32 ffn[n_tok][n_embd]: the fused FFN with W as gate, up and ffn_down_t and ReLU
//        (h_i = relu(W_i . x) * (W_i . x) for the active i);
//        f32 packed[n_tok][n_ff]: the float W packed as Q8_0x16 (packed_matmul.h) times x;
//        for TYPE q4_0, q4_1, q5_0, q8_0, q4_K and q6_K: f32 exact[n_tok][n_ff]: W as TYPE packed exactly, times x
#include "packed_matmul.h"
#include "sparse_ops.h"

#include "ggml-cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int die(const char * msg) {
    fprintf(stderr, "test-sparse-ops: %s\n", msg);
    return 1;
}

static enum ggml_type type_by_name(const char * name) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * n = ggml_type_name((enum ggml_type) t);
        if (n && strcmp(n, name) == 0) {
            return (enum ggml_type) t;
        }
    }
    return GGML_TYPE_COUNT;
}

static bool read_all(FILE * f, void * dst, size_t n) {
    return fread(dst, 1, n, f) == n;
}

int main(int argc, char ** argv) {
    if (argc != 5) {
        return die("usage: test-sparse-ops TYPE N_THREADS IN OUT");
    }
    const enum ggml_type type = type_by_name(argv[1]);
    const int n_threads = atoi(argv[2]);
    if (type == GGML_TYPE_COUNT || n_threads < 1) {
        return die("unknown type or bad thread count");
    }
    FILE * in = fopen(argv[3], "rb");
    if (!in) {
        return die("cannot open input");
    }
    int64_t dims[3];
    if (!read_all(in, dims, sizeof(dims))) {
        return die("short input");
    }
    const int64_t n_embd = dims[0], n_ff = dims[1], n_tok = dims[2];
    float * w  = malloc(sizeof(float) * n_ff * n_embd);
    float * x  = malloc(sizeof(float) * n_tok * n_embd);
    float * h  = malloc(sizeof(float) * n_tok * n_ff);
    int32_t n_active;
    if (!w || !x || !h || !read_all(in, w, sizeof(float) * n_ff * n_embd) || !read_all(in, x, sizeof(float) * n_tok * n_embd) ||
        !read_all(in, h, sizeof(float) * n_tok * n_ff) || !read_all(in, &n_active, sizeof(n_active))) {
        return die("short input");
    }

    ggml_cpu_init();
    struct ggml_init_params ip = { .mem_size = 64 * 1024 * 1024 + (size_t) 8 * (n_ff + n_tok) * (n_embd + n_ff), .mem_buffer = NULL, .no_alloc = false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * tw  = ggml_new_tensor_2d(ctx, type, n_embd, n_ff);
    struct ggml_tensor * tx  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd, n_tok);
    struct ggml_tensor * th  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_ff, n_tok);
    struct ggml_tensor * idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, PI_INDEX_LEN(n_ff));
    ggml_quantize_chunk(type, w, tw->data, 0, n_ff, n_embd, NULL);
    memcpy(tx->data, x, ggml_nbytes(tx));
    memcpy(th->data, h, ggml_nbytes(th));
    int32_t * ids = (int32_t *) idx->data;
    memset(ids, 0, ggml_nbytes(idx));  // the work counters start at zero
    ids[0] = n_active;
    if (n_active < 0 || n_active > n_ff || !read_all(in, ids + 1, sizeof(int32_t) * (size_t) n_active)) {
        return die("bad active list");
    }
    for (int32_t k = 0; k < n_active; ++k) {
        ids[n_ff + PI_INDEX_EXTRA + k] = -1;  // active for every token
    }
    fclose(in);

    struct ggml_tensor * xq   = pi_convert_rows(ctx, tx, ggml_get_type_traits_cpu(type)->vec_dot_type);
    struct ggml_tensor * up   = pi_sparse_matvec(ctx, tw, xq, idx);
    struct ggml_tensor * down = pi_sparse_axpy(ctx, tw, th, idx);
    struct ggml_tensor * ffn  = n_tok <= 8 ? pi_sparse_ffn(ctx, tw, tw, NULL, tw, xq, xq, idx, PI_ACT_RELU) : NULL;
    struct ggml_tensor * tp   = pi_pack_tensor(ctx, PI_PACK_Q8, n_ff, n_embd);
    for (int64_t r0 = 0; r0 < n_ff; r0 += PI_PACK_ROWS) {
        pi_pack_q8_group_f32(w + r0 * n_embd, n_embd, r0, tp->data);
    }
    struct ggml_tensor * packed = pi_packed_matmul(ctx, tp, tx);
    struct ggml_tensor * exact = NULL;
    if (pi_pack_fits(type, n_embd, n_ff)) {
        struct ggml_tensor * te = pi_pack_tensor(ctx, pi_pack_type_of(type), n_ff, n_embd);
        pi_pack_rows_exact(type, tw->data, tw->nb[1], n_embd, 0, n_ff, te->data);
        exact = pi_packed_matmul(ctx, te, tx);
    }
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, up);
    ggml_build_forward_expand(gf, down);
    if (ffn) ggml_build_forward_expand(gf, ffn);
    ggml_build_forward_expand(gf, packed);
    if (exact) ggml_build_forward_expand(gf, exact);
    if (ggml_graph_compute_with_ctx(ctx, gf, n_threads) != GGML_STATUS_SUCCESS) {
        return die("graph compute failed");
    }

    FILE * out = fopen(argv[4], "wb");
    if (!out) {
        return die("cannot open output");
    }
    float * wd = malloc(sizeof(float) * n_embd);
    for (int64_t i = 0; i < n_ff; ++i) {
        const char * row = (const char *) tw->data + i * tw->nb[1];
        if (type == GGML_TYPE_F32) memcpy(wd, row, sizeof(float) * n_embd);
        else ggml_get_type_traits(type)->to_float(row, wd, n_embd);
        fwrite(wd, sizeof(float), (size_t) n_embd, out);
    }
    fwrite(up->data, 1, ggml_nbytes(up), out);
    fwrite(down->data, 1, ggml_nbytes(down), out);
    if (ffn) fwrite(ffn->data, 1, ggml_nbytes(ffn), out);
    fwrite(packed->data, 1, ggml_nbytes(packed), out);
    if (exact) fwrite(exact->data, 1, ggml_nbytes(exact), out);
    fclose(out);
    free(wd); free(w); free(x); free(h);
    ggml_free(ctx);
    return 0;
}
