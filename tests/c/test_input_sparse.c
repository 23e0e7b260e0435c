// test_input_sparse.c - runs the input-sparse product (src/powerinfer_kernels/input_sparse.c) on
// inputs written by tests/test_input_sparse.py and writes its results back for a numpy
// comparison.
//
// usage: test-input-sparse N_THREADS IN OUT
//   IN:  int64 n_in, T, n_segs; then per segment: int64 ggml type, int64 rows;
//        f32 tau; per segment f32 W[rows][n_in]; f32 x[T][n_in]
//   OUT: int64 n_out; f32 ggml's dequantization of the quantized W [n_out][n_in];
//        f32 the copy's w, a, b [n_out][n_in] each (pi_colmat_row);
//        f32 y [T][n_out] (the batch); f32 y_alone [T][n_out] (each token alone);
//        f32 y_scalar [T][n_out] (the batch through the scalar kernels);
//        int64 kept, total (the operator's counters after the batch)
#include "input_sparse.h"

#include "ggml-cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static int die(const char * msg) {
    fprintf(stderr, "test-input-sparse: %s\n", msg);
    return 1;
}

static bool read_all(FILE * f, void * dst, size_t n) { return fread(dst, 1, n, f) == n; }

// Runs the product of x (T tokens starting at token t0) and writes y [T][n_out] to out.
static void run(const struct pi_colmat * cm, const float * x, int64_t T, int n_threads, struct pi_active_stat * stat,
                float * out) {
    struct ggml_init_params ip = { .mem_size = 16 * 1024 * 1024 + (size_t) 8 * T * (cm->n_in + cm->n_out) * 4,
                                   .mem_buffer = NULL, .no_alloc = false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * tx = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, cm->n_in, T);
    memcpy(tx->data, x, ggml_nbytes(tx));
    struct pi_input_op op = { cm, stat, n_threads, { 0 } };
    struct ggml_tensor * y = pi_input_sparse_matmul(ctx, &op, tx);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_graph_compute_with_ctx(ctx, gf, n_threads);
    memcpy(out, y->data, sizeof(float) * (size_t) (cm->n_out * T));
    ggml_free(ctx);
}

int main(int argc, char ** argv) {
    if (argc != 4) {
        return die("usage: test-input-sparse N_THREADS IN OUT");
    }
    const int n_threads = atoi(argv[1]);
    FILE * in = fopen(argv[2], "rb");
    if (!in || n_threads < 1) {
        return die("cannot open input or bad thread count");
    }
    int64_t dims[3];
    if (!read_all(in, dims, sizeof(dims))) return die("short input");
    const int64_t n_in = dims[0], T = dims[1], n_segs = dims[2];
    if (n_segs < 1 || n_segs > PI_COLMAT_MAX_SEGS || T < 1 || T > PI_COLMAT_MAX_TOKENS) return die("bad shape");
    int64_t types[PI_COLMAT_MAX_SEGS], rows[PI_COLMAT_MAX_SEGS], n_out = 0;
    for (int64_t k = 0; k < n_segs; ++k) {
        int64_t tr[2];
        if (!read_all(in, tr, sizeof(tr))) return die("short input");
        types[k] = tr[0];
        rows[k]  = tr[1];
        n_out += rows[k];
    }
    float tau;
    if (!read_all(in, &tau, sizeof(tau))) return die("short input");

    ggml_cpu_init();
    struct ggml_init_params ip = { .mem_size = 1024 * 1024 + (size_t) n_out * n_in * 4, .mem_buffer = NULL, .no_alloc = false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * w[PI_COLMAT_MAX_SEGS];
    float * deq = malloc(sizeof(float) * (size_t) (n_out * n_in));
    float * buf = malloc(sizeof(float) * (size_t) (rows[0] > 0 ? n_out * n_in : 1));
    if (!deq || !buf) return die("out of memory");
    int64_t r_at = 0;
    for (int64_t k = 0; k < n_segs; ++k) {
        w[k] = ggml_new_tensor_2d(ctx, (enum ggml_type) types[k], n_in, rows[k]);
        if (!read_all(in, buf, sizeof(float) * (size_t) (rows[k] * n_in))) return die("short input");
        ggml_quantize_chunk(w[k]->type, buf, w[k]->data, 0, rows[k], n_in, NULL);
        const struct ggml_type_traits * tt = ggml_get_type_traits(w[k]->type);
        for (int64_t r = 0; r < rows[k]; ++r) {
            tt->to_float((const char *) w[k]->data + r * w[k]->nb[1], deq + (r_at + r) * n_in, n_in);
        }
        r_at += rows[k];
    }
    float * x = malloc(sizeof(float) * (size_t) (T * n_in));
    if (!x || !read_all(in, x, sizeof(float) * (size_t) (T * n_in))) return die("short input");
    fclose(in);

    struct pi_colmat cm;
    const size_t bytes = pi_colmat_plan(&cm, w, (int) n_segs);
    if (bytes == 0) return die("these matrices have no column copy");
    void * mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return die("cannot map the copy");
    pi_colmat_bind(&cm, mem);
    for (int i = 0; i < 3; ++i) pi_colmat_fill(&cm, w, i, 3);  // three shares, as threads would

    FILE * out = fopen(argv[3], "wb");
    if (!out) return die("cannot open output");
    fwrite(&n_out, sizeof(n_out), 1, out);
    fwrite(deq, sizeof(float), (size_t) (n_out * n_in), out);
    float * rw = malloc(sizeof(float) * (size_t) (n_out * n_in));
    float * ra = malloc(sizeof(float) * (size_t) (n_out * n_in));
    float * rb = malloc(sizeof(float) * (size_t) (n_out * n_in));
    if (!rw || !ra || !rb) return die("out of memory");
    for (int64_t r = 0; r < n_out; ++r) pi_colmat_row(&cm, r, rw + r * n_in, ra + r * n_in, rb + r * n_in);
    fwrite(rw, sizeof(float), (size_t) (n_out * n_in), out);
    fwrite(ra, sizeof(float), (size_t) (n_out * n_in), out);
    fwrite(rb, sizeof(float), (size_t) (n_out * n_in), out);

    float * y = malloc(sizeof(float) * (size_t) (T * n_out));
    if (!y) return die("out of memory");
    struct pi_active_stat stat = { .threshold = tau };
    run(&cm, x, T, n_threads, &stat, y);
    fwrite(y, sizeof(float), (size_t) (T * n_out), out);
    const int64_t counts[2] = { stat.n_active, stat.n_total };
    for (int64_t t = 0; t < T; ++t) {
        struct pi_active_stat s1 = { .threshold = tau };
        run(&cm, x + t * n_in, 1, n_threads, &s1, y + t * n_out);
    }
    fwrite(y, sizeof(float), (size_t) (T * n_out), out);
    pi_colmat_force_scalar(true);
    struct pi_active_stat s2 = { .threshold = tau };
    run(&cm, x, T, n_threads, &s2, y);
    pi_colmat_force_scalar(false);
    fwrite(y, sizeof(float), (size_t) (T * n_out), out);
    fwrite(counts, sizeof(int64_t), 2, out);
    fclose(out);
    munmap(mem, bytes);
    free(deq); free(buf); free(x); free(rw); free(ra); free(rb); free(y);
    ggml_free(ctx);
    return 0;
}
