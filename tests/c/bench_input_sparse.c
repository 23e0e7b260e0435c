// bench_input_sparse.c - the input-sparse product (input_sparse.c) against ggml's dense
// matmul on the same quantized matrices: time per token and bytes read at several
// sparsities, on the matrix groups of a Qwen2.5-1.5B-shaped layer (or any shape).
//
// usage: bench-input-sparse [N_THREADS [REPS]]
// BENCH_T=T: T tokens a product (a batch up to sparse_max_batch: parallel slots, the
// probes of sparsify), each with its own inputs; times stay per token.
#include "input_sparse.h"

#include "ggml-cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static float frand(unsigned * s) {
    *s = *s * 1664525u + 1013904223u;
    return ((*s >> 8) / 16777216.0f) * 2.0f - 1.0f;
}

struct group {
    const char * name;
    int n_in;
    int n;
    enum ggml_type type[3];
    int rows[3];
};

// Computes gf with n threads, its work buffer reused (ggml_graph_compute_with_ctx would
// allocate one in the context on every call).
static void compute(struct ggml_cgraph * gf, int n) {
    static void * work = NULL;
    static size_t work_size = 0;
    struct ggml_cplan plan = ggml_graph_plan(gf, n, NULL);
    if (plan.work_size > work_size) {
        free(work);
        work = malloc(plan.work_size);
        work_size = plan.work_size;
    }
    plan.work_data = work;
    ggml_graph_compute(gf, &plan);
}

static int cmp_float(const void * a, const void * b) {
    const float x = *(const float *) a, y = *(const float *) b;
    return (x > y) - (x < y);
}

int main(int argc, char ** argv) {
    const int nth = argc > 1 ? atoi(argv[1]) : 2;
    const int reps = argc > 2 ? atoi(argv[2]) : 200;
    ggml_cpu_init();
    // Several layers' worth of each group, cycled, so the weights come from memory, not cache.
    const int n_copies_max = getenv("BENCH_COPIES") ? atoi(getenv("BENCH_COPIES")) : 8;  // 1: the weights stay in cache
    const struct group groups[] = {
        { "qkv (q4_K,q4_K,q6_K)", 1536, 3, { GGML_TYPE_Q4_K, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K }, { 1536, 256, 256 } },
        { "o (q4_K)", 1536, 1, { GGML_TYPE_Q4_K }, { 1536 } },
        { "gate+up (q4_K)", 1536, 2, { GGML_TYPE_Q4_K, GGML_TYPE_Q4_K }, { 8960, 8960 } },
        { "down (q4_K)", 8960, 1, { GGML_TYPE_Q4_K }, { 1536 } },
        { "down (q6_K)", 8960, 1, { GGML_TYPE_Q6_K }, { 1536 } },
        { "output (q6_K)", 1536, 1, { GGML_TYPE_Q6_K }, { 151936 } },  // the LM head: long columns, row pieces only
    };
    const float sparsities[] = { 0.0f, 0.25f, 0.40f, 0.50f };
    const int T = getenv("BENCH_T") ? atoi(getenv("BENCH_T")) : 1;
    if (T < 1 || T > 64) {
        fprintf(stderr, "BENCH_T must be in [1, 64]\n");
        return 1;
    }
    printf("threads %d; %d copies of each group cycled (2 of a group over 64M weights); per token (T = %d)\n", nth, n_copies_max, T);
    printf("| group | MiB | ggml dense ms | GB/s | sparsity | ours ms | GB/s of bytes read | vs dense |\n|---|---|---|---|---|---|---|---|\n");
    unsigned seed = 1;
    const char * only = getenv("BENCH_GROUP");  // one group's index, for profiling
    for (size_t gi = 0; gi < sizeof(groups) / sizeof(groups[0]); ++gi) {
        if (only && atoi(only) != (int) gi) continue;
        const struct group * g = &groups[gi];
        struct ggml_init_params ip = { .mem_size = (size_t) 3 << 30, .mem_buffer = NULL, .no_alloc = false };
        struct ggml_context * ctx = ggml_init(ip);
        struct ggml_tensor * w[8][3];
        struct pi_colmat cm[8];
        size_t wbytes = 0;
        size_t n_w = 0;
        for (int k = 0; k < g->n; ++k) n_w += (size_t) g->n_in * g->rows[k];
        const int n_copies = n_w > ((size_t) 64 << 20) && n_copies_max > 2 ? 2 : n_copies_max;  // two heads are far beyond the caches
        for (int c = 0; c < n_copies; ++c) {
            for (int k = 0; k < g->n; ++k) {
                w[c][k] = ggml_new_tensor_2d(ctx, g->type[k], g->n_in, g->rows[k]);
                float * f = malloc(sizeof(float) * (size_t) g->n_in * g->rows[k]);
                for (size_t i = 0; i < (size_t) g->n_in * g->rows[k]; ++i) f[i] = frand(&seed);
                ggml_quantize_chunk(g->type[k], f, w[c][k]->data, 0, g->rows[k], g->n_in, NULL);
                free(f);
                if (c == 0) wbytes += ggml_nbytes(w[c][k]);
            }
            const size_t bytes = pi_colmat_plan(&cm[c], w[c], g->n);
            void * mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            madvise(mem, bytes, MADV_HUGEPAGE);  // as the engine's copies (repack.c)
            pi_colmat_bind(&cm[c], mem);
            pi_colmat_fill(&cm[c], w[c], 0, 1);
        }
        // the dense reference: ggml's matmul of each segment
        struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, g->n_in, T);
        float * xs = (float *) x->data;
        for (int i = 0; i < g->n_in * T; ++i) {
            const float u = frand(&seed);
            xs[i] = u * u * u * 4.0f;  // heavy-tailed, as activations are
        }
        if (getenv("BENCH_CLUSTER")) {  // experiment: each 32-column chunk's entries sorted, so its kept columns are contiguous
            for (int c0 = 0; c0 < g->n_in * T; c0 += 32) qsort(xs + c0, 32, sizeof(float), cmp_float);
        }
        float * sorted = malloc(sizeof(float) * (size_t) g->n_in);
        for (int i = 0; i < g->n_in; ++i) sorted[i] = fabsf(xs[i]);
        qsort(sorted, (size_t) g->n_in, sizeof(float), cmp_float);
        // graphs: [0] ggml's dense matmuls, [1 + si] ours at sparsities[si]
        const int n_s = (int) (sizeof(sparsities) / sizeof(sparsities[0]));
        struct ggml_cgraph * gfs[1 + 8];
        struct pi_active_stat stats[8];
        struct pi_input_op ops[8][8];
        gfs[0] = ggml_new_graph(ctx);
        for (int c = 0; c < n_copies; ++c) {
            for (int k = 0; k < g->n; ++k) ggml_build_forward_expand(gfs[0], ggml_mul_mat(ctx, w[c][k], x));
        }
        for (int si = 0; si < n_s; ++si) {
            stats[si] = (struct pi_active_stat) { .threshold = sparsities[si] > 0 ? sorted[(int) (sparsities[si] * g->n_in)] : 0.0f };
            gfs[1 + si] = ggml_new_graph(ctx);
            for (int c = 0; c < n_copies; ++c) {
                ops[si][c] = (struct pi_input_op) { &cm[c], &stats[si], nth, { 0 } };
                ggml_build_forward_expand(gfs[1 + si], pi_input_sparse_matmul(ctx, &ops[si][c], x));
            }
        }
        // rounds alternate the graphs (the machine's speed drifts); the best round of each
        double best[1 + 8];
        for (int i = 0; i <= n_s; ++i) best[i] = 1e30;
        const int n_rounds = 20, per_round = reps / n_copies / n_rounds + 1;
        for (int round = 0; round < n_rounds; ++round) {
            for (int i = 0; i <= n_s; ++i) {
                compute(gfs[i], nth);
                const double t0 = now_ms();
                for (int r = 0; r < per_round; ++r) compute(gfs[i], nth);
                const double t = (now_ms() - t0) / (per_round * n_copies) / T;
                best[i] = t < best[i] ? t : best[i];
            }
        }
        const double t_dense = best[0];
        for (int si = 0; si < n_s; ++si) {
            const double t = best[1 + si];
            const double kept = (double) stats[si].n_active / (double) stats[si].n_total;
            const double scale_bytes = (double) cm[0].bytes - (double) cm[0].col_stride * cm[0].n_in;
            const double read = kept * cm[0].col_stride * cm[0].n_in + scale_bytes;
            printf("| %s | %.1f | %.3f | %.1f | %.0f%% (kept %.0f%%) | %.3f | %.1f | %.2fx |\n", g->name, wbytes / 1048576.0, t_dense,
                   wbytes / t_dense / 1e6, sparsities[si] * 100, kept * 100, t, read / t / 1e6, t_dense / t);
        }
        free(sorted);
        ggml_free(ctx);
    }
    return 0;
}
