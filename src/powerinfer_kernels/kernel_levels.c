// kernel_levels.c - calls each kernel function (kernel_variant.h) at the level chosen for
// this CPU. The table is filled once, before any model exists (a constructor); tests and
// benchmarks may switch it between computations (pi_kernel_level_set).
#include "kernel_levels.h"

#include "input_sparse.h"
#include "powerinfer.h"
#include "packed_matmul.h"
#include "powerinfer-impl.h"
#include "sparse_kernels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

// level, name, parameters, arguments; one list for the table, the per-level declarations
// and the forwarding definitions (which ignore the level).
#define PI_KERNEL_FUNCS(X, V, L)                                                                                              \
    X(L, struct ggml_tensor *, pi_attention,                                                                                  \
      (struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * kc, struct ggml_tensor * vc,                \
       struct ggml_tensor * cells, int64_t n_head_kv, float scale),                                                        \
      (ctx, q, kc, vc, cells, n_head_kv, scale))                                                                           \
    X(L, bool, pi_colmat_type_ok, (enum ggml_type type), (type))                                                              \
    X(L, size_t, pi_colmat_plan, (struct pi_colmat * cm, struct ggml_tensor * const * w, int n), (cm, w, n))                  \
    V(L, pi_colmat_bind, (struct pi_colmat * cm, void * mem), (cm, mem))                                                      \
    V(L, pi_colmat_fill, (const struct pi_colmat * cm, struct ggml_tensor * const * w, int ith, int nth), (cm, w, ith, nth))  \
    V(L, pi_colmat_row, (const struct pi_colmat * cm, int64_t r, float * w, float * a, float * b), (cm, r, w, a, b))         \
    V(L, pi_colmat_force_scalar, (bool on), (on))                                                                             \
    X(L, bool, pi_colmat_simd, (void), ())                                                                                    \
    X(L, struct ggml_tensor *, pi_input_sparse_matmul, (struct ggml_context * ctx, struct pi_input_op * op, struct ggml_tensor * x), \
      (ctx, op, x))                                                                                                        \
    X(L, size_t, pi_input_sparse_work_size, (const struct pi_colmat * cm, int64_t T, int n_threads), (cm, T, n_threads))     \
    V(L, pi_input_sparse_run, (struct pi_input_op * op, const struct ggml_tensor * x, float * y, void * work, int ith, int nth), \
      (op, x, y, work, ith, nth))                                                                                          \
    V(L, pi_prefetch, (const void * p, size_t n), (p, n))                                                                     \
    V(L, pi_rows_dot,                                                                                                         \
      (enum ggml_type type, int64_t n, const void * const * rows, int k, const void * y, float * out,                     \
       const struct pi_next_rows * next),                                                                                  \
      (type, n, rows, k, y, out, next))                                                                                    \
    V(L, pi_rows_axpy,                                                                                                        \
      (enum ggml_type type, int64_t n, const void * const * rows, const float * a, int k, float * out,                    \
       const struct pi_next_rows * next, bool init),                                                                       \
      (type, n, rows, a, k, out, next, init))                                                                              \
    X(L, bool, pi_pack_available, (void), ())                                                                                 \
    X(L, bool, pi_pack_fits, (enum ggml_type type, int64_t n_cols, int64_t n_rows), (type, n_cols, n_rows))                   \
    X(L, enum pi_pack_type, pi_pack_type_of, (enum ggml_type type), (type))                                                   \
    X(L, struct ggml_tensor *, pi_pack_tensor, (struct ggml_context * ctx, enum pi_pack_type type, int64_t n_rows, int64_t n_cols), \
      (ctx, type, n_rows, n_cols))                                                                                         \
    X(L, enum pi_pack_type, pi_pack_type, (const struct ggml_tensor * w), (w))                                               \
    X(L, int64_t, pi_pack_rows, (const struct ggml_tensor * w), (w))                                                          \
    X(L, int64_t, pi_pack_cols, (const struct ggml_tensor * w), (w))                                                          \
    V(L, pi_pack_rows_exact,                                                                                                  \
      (enum ggml_type type, const void * src, size_t row_stride, int64_t n_cols, int64_t r_begin, int64_t r_end,          \
       void * dst),                                                                                                        \
      (type, src, row_stride, n_cols, r_begin, r_end, dst))                                                                \
    V(L, pi_pack_q8_group_f32, (const float * src, int64_t n_cols, int64_t r0, void * dst), (src, n_cols, r0, dst))         \
    X(L, struct ggml_tensor *, pi_packed_matmul, (struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * x), \
      (ctx, w, x))

struct kernel_table {
#define PI_FIELD(L, ret, name, params, args) ret (*name) params;
#define PI_VFIELD(L, name, params, args)      void (*name) params;
    PI_KERNEL_FUNCS(PI_FIELD, PI_VFIELD, _)
#undef PI_FIELD
#undef PI_VFIELD
};

// The levels' functions (defined in the pi-kernels-<level> objects) and their tables.
#define PI_DECL(L, ret, name, params, args)  ret name##_##L params;
#define PI_VDECL(L, name, params, args)      void name##_##L params;
#define PI_INIT(L, ret, name, params, args)  .name = name##_##L,
#define PI_VINIT(L, name, params, args)      .name = name##_##L,
#define PI_DECLARE_LEVEL(L)                                                                 \
    PI_KERNEL_FUNCS(PI_DECL, PI_VDECL, L)                                                   \
    static const struct kernel_table table_##L = { PI_KERNEL_FUNCS(PI_INIT, PI_VINIT, L) };

#if defined(PI_HAVE_LEVEL_SCALAR)
PI_DECLARE_LEVEL(scalar)
#endif
#if defined(PI_HAVE_LEVEL_AVX2)
PI_DECLARE_LEVEL(avx2)
#endif
#if defined(PI_HAVE_LEVEL_AVXVNNI)
PI_DECLARE_LEVEL(avxvnni)
#endif
#if defined(PI_HAVE_LEVEL_AVX512)
PI_DECLARE_LEVEL(avx512)
#endif
#if defined(PI_HAVE_LEVEL_DOTPROD)
PI_DECLARE_LEVEL(dotprod)
#endif

struct level {
    const char *                name;
    const struct kernel_table * table;
    bool (*runs)(void);
};

#if defined(__x86_64__) || defined(_M_X64)
// libgcc's checks include the OS's support of the registers' state (XSAVE).
static bool cpu_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("bmi2");
}
static bool cpu_avxvnni(void) { return cpu_avx2() && __builtin_cpu_supports("avxvnni"); }
static bool cpu_avx512(void) {
    return cpu_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512vnni");
}
#endif
#if defined(__aarch64__)
static bool cpu_dotprod(void) {
#if defined(__linux__)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__APPLE__)
    return true;  // every Apple M chip has it
#else
    return false;
#endif
}
#endif
static bool cpu_any(void) { return true; }

// Best first.
static const struct level levels[] = {
#if defined(PI_HAVE_LEVEL_AVX512)
    { "avx512", &table_avx512, cpu_avx512 },
#endif
#if defined(PI_HAVE_LEVEL_AVXVNNI)
    { "avxvnni", &table_avxvnni, cpu_avxvnni },
#endif
#if defined(PI_HAVE_LEVEL_AVX2)
    { "avx2", &table_avx2, cpu_avx2 },
#endif
#if defined(PI_HAVE_LEVEL_DOTPROD)
    { "dotprod", &table_dotprod, cpu_dotprod },
#endif
    { "scalar", &table_scalar, cpu_any },
};
#define N_LEVELS ((int) (sizeof(levels) / sizeof(levels[0])))

static const struct level * g_level = &levels[N_LEVELS - 1];

static const struct level * find_level(const char * name) {
    for (int i = 0; i < N_LEVELS; ++i) {
        if (strcmp(levels[i].name, name) == 0) return &levels[i];
    }
    return NULL;
}

__attribute__((constructor)) static void choose_level(void) {
    for (int i = 0; i < N_LEVELS; ++i) {
        if (levels[i].runs()) {
            g_level = &levels[i];
            break;
        }
    }
    const char * want = getenv("POWERINFER_KERNELS");
    if (want && *want && strcmp(want, "auto") != 0) {
        const struct level * l = find_level(want);
        if (l && l->runs()) {
            g_level = l;
        } else {
            fprintf(stderr, "powerinfer: POWERINFER_KERNELS=%s: %s; using %s (runnable here: %s)\n", want,
                    l ? "this CPU cannot run that level" : "no such kernel level", g_level->name,
                    pi_kernel_levels_runnable());
        }
    }
}

const char * pi_kernel_level(void) { return g_level->name; }

const char * pi_kernel_levels_runnable(void) {
    static char buf[128];
    buf[0] = '\0';
    for (int i = 0; i < N_LEVELS; ++i) {
        if (!levels[i].runs()) continue;
        if (buf[0]) strncat(buf, ",", sizeof(buf) - strlen(buf) - 1);
        strncat(buf, levels[i].name, sizeof(buf) - strlen(buf) - 1);
    }
    return buf;
}

bool pi_kernel_level_set(const char * name) {
    const struct level * l = name ? find_level(name) : NULL;
    if (!l || !l->runs()) return false;
    __atomic_store_n(&g_level, l, __ATOMIC_RELEASE);
    return true;
}

POWERINFER_API const char * powerinfer_kernel_level(void) { return pi_kernel_level(); }
POWERINFER_API const char * powerinfer_kernel_levels(void) { return pi_kernel_levels_runnable(); }
POWERINFER_API bool powerinfer_set_kernel_level(const char * level) { return pi_kernel_level_set(level); }

// The forwarding definitions: each public kernel name calls the chosen level's.
#define PI_FWD(L, ret, name, params, args)  ret name params { return g_level->table->name args; }
#define PI_VFWD(L, name, params, args)      void name params { g_level->table->name args; }
PI_KERNEL_FUNCS(PI_FWD, PI_VFWD, _)
