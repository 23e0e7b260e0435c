// bench_sparse_ops.c - throughput of the FFN operators on 7B-shaped layers, in GB/s of
// weights read, against ggml's dense matmul on the same machine (memory-bound decode)
// and in tokens/s (prompt batches). The layers together exceed the caches, as a model's do.
//
// usage: bench-sparse-ops [-t THREADS] [-l LAYERS] [-e N_EMBD] [-f N_FF] [-a ACTIVE_FRAC]
//                         [-r REPS] [-b BATCH] [--type Q4_0]
// Weights are random bytes in valid blocks (no quantization pass); activations use SiLU
// so every active neuron does the full work (no ReLU zeros).
#include "packed_matmul.h"
#include "sparse_ops.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static enum ggml_type type_by_name(const char * name) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * n = ggml_type_name((enum ggml_type) t);
        if (n && strcmp(n, name) == 0) return (enum ggml_type) t;
    }
    return GGML_TYPE_COUNT;
}

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
    g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
    return g_rng;
}

// Rows of weights quantized from random floats: a pool of 64 distinct rows, repeated.
static void fill_weights(struct ggml_tensor * t, void * host) {
    const int64_t n = t->ne[0], rows = ggml_nrows(t);
    const size_t rs = ggml_row_size(t->type, n);
    float * f = malloc(sizeof(float) * (size_t) n);
    for (int64_t r = 0; r < 64 && r < rows; ++r) {
        for (int64_t i = 0; i < n; ++i) f[i] = (float) ((int) (rnd() % 2001) - 1000) * 1e-5f;
        ggml_quantize_chunk(t->type, f, (char *) host + (size_t) r * rs, 0, 1, n, NULL);
    }
    for (int64_t r = 64; r < rows; ++r) memcpy((char *) host + (size_t) r * rs, (char *) host + (size_t) (r % 64) * rs, rs);
    free(f);
}

struct layer {
    struct ggml_tensor * down_p;                        // the down projection packed as Q8_0x16 (packed_matmul.h)
    struct ggml_tensor * gate_p;                        // the gate packed exactly (Q4_0x16 / Q8_0x16), when it fits
    struct ggml_tensor * bundle;                        // --bundle: [3 * n_embd, n_ff], gate|up|down_t rows per neuron
    struct ggml_tensor * gate, * up, * down_t, * down;  // plain CPU buffer (views into bundle with --bundle)
    struct ggml_tensor * idx;                           // an active list, I32 [PI_INDEX_LEN(n_ff)]
};

static ggml_backend_buffer_type_t repack_buft(void) {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    ggml_backend_dev_get_extra_bufts_t get =
        (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    ggml_backend_buffer_type_t * b = get ? get(dev) : NULL;
    return b && *b ? *b : NULL;
}

static double run(ggml_backend_t be, struct ggml_cgraph * gf, int reps) {
    ggml_backend_graph_compute(be, gf);  // warm-up (also pages in)
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
        const double t = now_s();
        ggml_backend_graph_compute(be, gf);
        const double dt = now_s() - t;
        best = dt < best ? dt : best;
    }
    return best;
}

int main(int argc, char ** argv) {
    int n_threads = 2, n_layer = 16, reps = 5, batch = 64, huge = 0, bundle = 0, shuffle = 0;
    double power = 0.0;
    int64_t n_embd = 4096, n_ff = 11008;
    double active = 0.12;
    enum ggml_type type = GGML_TYPE_Q4_0;
    for (int i = 1; i < argc; ++i) {
        const char * a = argv[i];
        const char * v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--huge")) { huge = 1; continue; }
        if (!strcmp(a, "--bundle")) { bundle = 1; continue; }
        if (!strcmp(a, "--shuffle")) { shuffle = 1; continue; }
        if (!v) { fprintf(stderr, "missing value for %s\n", a); return 2; }
        if (!strcmp(a, "-t")) n_threads = atoi(v);
        else if (!strcmp(a, "-l")) n_layer = atoi(v);
        else if (!strcmp(a, "-e")) n_embd = atoll(v);
        else if (!strcmp(a, "-f")) n_ff = atoll(v);
        else if (!strcmp(a, "-a")) active = atof(v);
        else if (!strcmp(a, "-r")) reps = atoi(v);
        else if (!strcmp(a, "-b")) batch = atoi(v);
        else if (!strcmp(a, "--type")) type = type_by_name(v);
        else if (!strcmp(a, "--power")) power = atof(v);
        else { fprintf(stderr, "unknown option %s\n", a); return 2; }
        ++i;
    }
    if (type == GGML_TYPE_COUNT || n_threads < 1 || n_layer < 1 || active <= 0 || active > 1 || batch < 1) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    ggml_cpu_init();
    ggml_backend_t be = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(be, n_threads);

    // Weights: plain layout for every op, plus repacked copies of gate for the dense reference.
    struct ggml_init_params wp = { .mem_size = (size_t) (8 * n_layer + 8) * ggml_tensor_overhead(), .no_alloc = true };
    struct ggml_context * wctx = ggml_init(wp);
    struct layer * L = calloc((size_t) n_layer, sizeof(*L));
    for (int il = 0; il < n_layer; ++il) {
        if (bundle) {
            const size_t rs = ggml_row_size(type, n_embd);
            L[il].bundle = ggml_new_tensor_2d(wctx, type, 3 * n_embd, n_ff);
            L[il].gate   = ggml_view_2d(wctx, L[il].bundle, n_embd, n_ff, 3 * rs, 0);
            L[il].up     = ggml_view_2d(wctx, L[il].bundle, n_embd, n_ff, 3 * rs, rs);
            L[il].down_t = ggml_view_2d(wctx, L[il].bundle, n_embd, n_ff, 3 * rs, 2 * rs);
        } else {
            L[il].gate   = ggml_new_tensor_2d(wctx, type, n_embd, n_ff);
            L[il].up     = ggml_new_tensor_2d(wctx, type, n_embd, n_ff);
            L[il].down_t = ggml_new_tensor_2d(wctx, type, n_embd, n_ff);
        }
        L[il].down   = ggml_new_tensor_2d(wctx, type, n_ff, n_embd);
        L[il].down_p = pi_pack_tensor(wctx, PI_PACK_Q8, n_embd, n_ff);
        if (pi_pack_fits(type, n_embd, n_ff)) {
            L[il].gate_p = pi_pack_tensor(wctx, pi_pack_type_of(type), n_ff, n_embd);
        }
        L[il].idx    = ggml_new_tensor_1d(wctx, GGML_TYPE_I32, PI_INDEX_LEN(n_ff));
    }
    ggml_backend_buffer_t wbuf;
    if (huge) {
        // One anonymous mapping advised to use 2 MiB pages (transparent huge pages).
        size_t total = 0;
        for (struct ggml_tensor * t = ggml_get_first_tensor(wctx); t; t = ggml_get_next_tensor(wctx, t)) {
            if (!t->view_src) total += GGML_PAD(ggml_nbytes(t), 64);
        }
        total = GGML_PAD(total, 2u << 20);
        uint8_t * mem = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        madvise(mem, total, MADV_HUGEPAGE);
        wbuf = ggml_backend_cpu_buffer_from_ptr(mem, total);
        size_t off = 0;
        for (struct ggml_tensor * t = ggml_get_first_tensor(wctx); t; t = ggml_get_next_tensor(wctx, t)) {
            if (t->view_src) continue;
            ggml_backend_tensor_alloc(wbuf, t, mem + off);
            off += GGML_PAD(ggml_nbytes(t), 64);
        }
        for (struct ggml_tensor * t = ggml_get_first_tensor(wctx); t; t = ggml_get_next_tensor(wctx, t)) {
            if (t->view_src) ggml_backend_view_init(t);
        }
    } else {
        wbuf = ggml_backend_alloc_ctx_tensors(wctx, be);
    }
    void * host = malloc(3 * ggml_nbytes(L[0].down) + ggml_nbytes(L[0].idx));
    // Firing probability of neuron i: uniform, or a power law (i + 1)^-power with the
    // requested mean, hottest first unless --shuffle.
    double * prob = malloc(sizeof(double) * (size_t) n_ff);
    {
        // prob[i] = min(c * (i + 1)^-power, 0.95), c found by bisection so the mean is `active`.
        double lo = 0, hi = 1e9;
        for (int it = 0; it < 200; ++it) {
            const double c = 0.5 * (lo + hi);
            double m = 0;
            for (int64_t i = 0; i < n_ff; ++i) m += fmin(c * pow((double) i + 1.0, -power), 0.95);
            if (m / n_ff < active) lo = c; else hi = c;
        }
        for (int64_t i = 0; i < n_ff; ++i) prob[i] = fmin(lo * pow((double) i + 1.0, -power), 0.95);
        if (shuffle) {
            for (int64_t i = n_ff - 1; i > 0; --i) {
                const int64_t j = (int64_t) (rnd() % (uint64_t) (i + 1));
                const double t = prob[i]; prob[i] = prob[j]; prob[j] = t;
            }
        }
    }
    const size_t row_bytes = ggml_row_size(type, n_embd);
    int64_t n_active_total = 0;
    for (int il = 0; il < n_layer; ++il) {
        {
            // Packed Q8_0x16 down: random rows, one group of 16 at a time.
            float * rows = malloc(sizeof(float) * PI_PACK_ROWS * (size_t) n_ff);
            void * packed = malloc(ggml_nbytes(L[il].down_p));
            for (int64_t r0 = 0; r0 < n_embd; r0 += PI_PACK_ROWS) {
                for (int64_t i = 0; i < PI_PACK_ROWS * n_ff; ++i) rows[i] = (float) ((int) (rnd() % 2001) - 1000) * 1e-5f;
                pi_pack_q8_group_f32(rows, n_ff, r0, packed);
            }
            ggml_backend_tensor_set(L[il].down_p, packed, 0, ggml_nbytes(L[il].down_p));
            free(rows);
            free(packed);
        }
        if (L[il].gate_p && !bundle) {
            void * packed = malloc(ggml_nbytes(L[il].gate_p));
            fill_weights(L[il].gate, host);
            pi_pack_rows_exact(type, host, ggml_row_size(type, n_embd), n_embd, 0, n_ff, packed);
            ggml_backend_tensor_set(L[il].gate_p, packed, 0, ggml_nbytes(L[il].gate_p));
            free(packed);
            ggml_backend_tensor_set(L[il].gate, host, 0, ggml_nbytes(L[il].gate));
        }
        struct ggml_tensor * ws[4] = { L[il].gate, L[il].up, L[il].down_t, L[il].down };
        if (L[il].gate_p && !bundle) ws[0] = NULL;  // filled above
        if (bundle) ws[0] = L[il].bundle, ws[1] = ws[2] = NULL;
        for (int k = 0; k < 4; ++k) {
            if (!ws[k]) continue;
            fill_weights(ws[k], host);
            ggml_backend_tensor_set(ws[k], host, 0, ggml_nbytes(ws[k]));
        }
        // Active neurons: neuron i with probability prob[i], ascending.
        int32_t * ids = host;
        memset(ids, 0, ggml_nbytes(L[il].idx));  // the work counters start at zero
        int32_t n = 0;
        for (int64_t i = 0; i < n_ff; ++i) {
            if ((double) (rnd() % 1000000) < prob[i] * 1e6) ids[1 + n++] = (int32_t) i;
        }
        for (int32_t k = 0; k < n; ++k) ids[n_ff + PI_INDEX_EXTRA + k] = -1;  // every token
        ids[0] = n;
        n_active_total += n;
        ggml_backend_tensor_set(L[il].idx, ids, 0, ggml_nbytes(L[il].idx));
    }
    // Repacked gate copies (what llama.cpp's dense matmul reads), when the CPU has a repack type.
    ggml_backend_buffer_type_t rb = type == GGML_TYPE_Q4_0 ? repack_buft() : NULL;  // the x86 repacks of this ggml: Q4_0, Q4_K, IQ4_NL
    struct ggml_context * rctx = ggml_init(wp);
    struct ggml_tensor ** rgate = calloc((size_t) n_layer, sizeof(*rgate));
    ggml_backend_buffer_t rbuf = NULL;
    if (rb) {
        for (int il = 0; il < n_layer; ++il) rgate[il] = ggml_dup_tensor(rctx, L[il].gate);
        rbuf = ggml_backend_alloc_ctx_tensors_from_buft(rctx, rb);
        for (int il = 0; rbuf && il < n_layer; ++il) {
            ggml_backend_tensor_get(L[il].gate, host, 0, ggml_nbytes(L[il].gate));
            ggml_backend_tensor_set(rgate[il], host, 0, ggml_nbytes(rgate[il]));
        }
    }
    free(host);

    const size_t gbuf = ggml_tensor_overhead() * 4096 + ggml_graph_overhead_custom(4096, false);
    printf("bench-sparse-ops: %d layers of %lldx%lld %s, %d threads, %.1f%% active (%.1f per layer; power law %g%s)%s%s\n",
           n_layer, (long long) n_embd, (long long) n_ff, ggml_type_name(type), n_threads,
           100.0 * n_active_total / (n_layer * n_ff), (double) n_active_total / n_layer, power,
           power > 0 ? (shuffle ? ", shuffled" : ", hottest first") : "", huge ? ", huge pages" : "",
           bundle ? ", bundled rows" : "");
    free(prob);
    printf("| op | T | ms per layer | GB/s of weights | tok/s (all layers) |\n|---|---|---|---|---|\n");

    for (int pass = 0; pass < (batch > 1 ? 2 : 1); ++pass) {
        const int T = pass == 0 ? 1 : batch;
        enum { DENSE_GATE, DENSE_GATE_REPACKED, PACKED_GATE, DENSE_DOWN, PACKED_DOWN, SEPARATE, FUSED, MATVEC, AXPY, AXPY_DOWN_T, N_OPS };
        static const char * names[N_OPS] = { "ggml mul_mat (gate, plain)", "ggml mul_mat (gate, repacked)",
                                             "packed matmul (gate, exact)",
                                             "ggml mul_mat (down, plain)", "packed Q8_0x16 matmul (down)",
                                             "sparse: matvec up+gate, axpy down",
                                             "sparse: fused", "sparse: matvec (gate only)", "sparse: axpy (down only)",
                                             "axpy over ffn_down_t (all rows)" };
        for (int op = 0; op < N_OPS; ++op) {
            if (op == DENSE_GATE_REPACKED && !rbuf) { printf("(no repacked buffer)\n"); continue; }
            if (op == PACKED_GATE && (!L[0].gate_p || bundle)) continue;
            if (T > 1 && (op == SEPARATE || op == FUSED || op == MATVEC || op == AXPY)) continue;
            struct ggml_init_params gp = { .mem_size = gbuf, .no_alloc = true };
            struct ggml_context * g = ggml_init(gp);
            struct ggml_cgraph * gf = ggml_new_graph_custom(g, 4096, false);
            struct ggml_tensor * x = ggml_new_tensor_2d(g, GGML_TYPE_F32, n_embd, T);
            struct ggml_tensor * hx = ggml_new_tensor_2d(g, GGML_TYPE_F32, n_ff, T);
            ggml_set_input(x);
            ggml_set_input(hx);
            double bytes = 0;
            for (int il = 0; il < n_layer; ++il) {
                struct ggml_tensor * out = NULL;
                struct layer * l = &L[il];
                const enum ggml_type vt = ggml_get_type_traits_cpu(type)->vec_dot_type;
                switch (op) {
                    case DENSE_GATE: out = ggml_mul_mat(g, l->gate, x); bytes += ggml_nbytes(l->gate); break;
                    case DENSE_GATE_REPACKED: out = ggml_mul_mat(g, rgate[il], x); bytes += (double) n_ff * row_bytes; break;
                    case DENSE_DOWN: out = ggml_mul_mat(g, l->down, hx); bytes += ggml_nbytes(l->down); break;
                    case PACKED_GATE: out = pi_packed_matmul(g, l->gate_p, x); bytes += ggml_nbytes(l->gate_p); break;
                    case PACKED_DOWN: out = pi_packed_matmul(g, l->down_p, hx); bytes += ggml_nbytes(l->down_p); break;
                    case SEPARATE: {
                        struct ggml_tensor * xq = pi_convert_rows(g, x, vt);
                        struct ggml_tensor * h = ggml_swiglu_split(g, pi_sparse_matvec(g, l->gate, xq, l->idx),
                                                                   pi_sparse_matvec(g, l->up, xq, l->idx));
                        out = pi_sparse_axpy(g, l->down_t, h, l->idx);
                        break;
                    }
                    case FUSED: {
                        struct ggml_tensor * xq = pi_convert_rows(g, x, vt);
                        out = pi_sparse_ffn(g, l->up, l->gate, NULL, l->down_t, xq, xq, l->idx, PI_ACT_SILU);
                        break;
                    }
                    case MATVEC:
                        out = pi_sparse_matvec(g, l->gate, pi_convert_rows(g, x, vt), l->idx);
                        break;
                    case AXPY:
                        out = pi_sparse_axpy(g, l->down_t, hx, l->idx);
                        break;
                    case AXPY_DOWN_T: {
                        struct ggml_tensor * all = l->idx;  // reused below with every row active
                        out = pi_sparse_axpy(g, l->down_t, hx, all);
                        bytes += ggml_nbytes(l->down_t);
                        break;
                    }
                }
                if (op == SEPARATE || op == FUSED || op == MATVEC || op == AXPY) {
                    int32_t n;
                    ggml_backend_tensor_get(l->idx, &n, 0, sizeof(n));
                    bytes += (op == SEPARATE || op == FUSED ? 3.0 : 1.0) * n * row_bytes;
                }
                ggml_build_forward_expand(gf, out);
            }
            ggml_gallocr_t ga = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
            ggml_gallocr_alloc_graph(ga, gf);
            float * xv = calloc((size_t) (n_ff > n_embd ? n_ff : n_embd) * T, sizeof(float));
            for (int64_t i = 0; i < n_embd * T; ++i) xv[i] = (float) ((int) (rnd() % 2001) - 1000) * 1e-3f;
            if (x->buffer) ggml_backend_tensor_set(x, xv, 0, ggml_nbytes(x));
            for (int64_t i = 0; i < n_ff * T; ++i) xv[i] = (float) ((int) (rnd() % 2001) - 1000) * 1e-3f;
            if (hx->buffer) ggml_backend_tensor_set(hx, xv, 0, ggml_nbytes(hx));
            free(xv);
            // The AXPY row is timed over every row: make the index list full for it.
            int32_t * saved = NULL;
            if (op == AXPY_DOWN_T) {
                // the whole list: count, rows, work counters, then every row's token mask
                saved = malloc(sizeof(int32_t) * (size_t) PI_INDEX_LEN(n_ff) * n_layer);
                int32_t * all = calloc((size_t) PI_INDEX_LEN(n_ff), sizeof(int32_t));
                all[0] = (int32_t) n_ff;
                for (int64_t i = 0; i < n_ff; ++i) all[1 + i] = (int32_t) i;
                for (int64_t i = 0; i < n_ff; ++i) all[n_ff + PI_INDEX_EXTRA + i] = -1;
                for (int il = 0; il < n_layer; ++il) {
                    ggml_backend_tensor_get(L[il].idx, saved + (size_t) il * PI_INDEX_LEN(n_ff), 0, ggml_nbytes(L[il].idx));
                    ggml_backend_tensor_set(L[il].idx, all, 0, ggml_nbytes(L[il].idx));
                }
                free(all);
            }
            const double dt = run(be, gf, reps);
            if (saved) {
                for (int il = 0; il < n_layer; ++il) ggml_backend_tensor_set(L[il].idx, saved + (size_t) il * PI_INDEX_LEN(n_ff), 0, ggml_nbytes(L[il].idx));
                free(saved);
            }
            printf("| %s | %d | %.3f | %.2f | %.1f |\n", names[op], T, 1e3 * dt / n_layer, bytes / dt / 1e9, T / dt);
            fflush(stdout);
            ggml_gallocr_free(ga);
            ggml_free(g);
        }
    }
    if (rbuf) ggml_backend_buffer_free(rbuf);
    ggml_free(rctx);
    ggml_backend_buffer_free(wbuf);
    ggml_free(wctx);
    ggml_backend_free(be);
    free(L);
    free(rgate);
    return 0;
}
