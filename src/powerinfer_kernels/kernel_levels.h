// kernel_levels.h - which build of the kernels runs (kernel_variant.h): chosen once from the
// CPU's features at load, the best this CPU executes, or the level POWERINFER_KERNELS names
// (scalar, avx2, avxvnni, avx512; on aarch64 scalar, dotprod) when the CPU can run it.
#pragma once

#include <stdbool.h>

// The level the kernels run at ("avx512", "avx2", "scalar", ...).
const char * pi_kernel_level(void);
// Levels built into this library and runnable on this CPU, best first, comma-separated.
const char * pi_kernel_levels_runnable(void);
// Switches to `name`; false (and nothing changes) when it is not built or this CPU cannot run
// it. Call between computations: a graph being computed keeps running the level it started on
// only if no kernel of it is in flight.
bool pi_kernel_level_set(const char * name);
// Whether the input-sparse product has a SIMD kernel at this level. Without one the column
// product is slower than ggml's dense matmul, and input mode runs dense (repack.c).
bool pi_colmat_simd(void);
