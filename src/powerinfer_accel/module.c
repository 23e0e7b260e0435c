// module.c - libggml-powerinfer.so: the module ggml's loader opens (ggml_backend_load(path),
// or GGML_BACKEND_PATH in programs that call ggml_backend_load_all, as llama.cpp's tools do).
// Its entry point returns the registry entry of the core's module (accel.c), so the library
// that holds the kernels is the one libpowerinfer that Python uses too. Which weights it takes
// comes from the file named by POWERINFER_SPARSE_MODEL (the sparsified GGUF the program loads).
#include "accel.h"

#include <stdio.h>
#include <stdlib.h>

#if defined(_WIN32)
#define PI_MODULE_EXPORT __declspec(dllexport)
#else
#define PI_MODULE_EXPORT __attribute__((visibility("default")))
#endif

PI_MODULE_EXPORT ggml_backend_reg_t ggml_backend_init(void) {
    const char * path = getenv("POWERINFER_SPARSE_MODEL");
    if (path && *path) {
        if (powerinfer_accel_arm(path, POWERINFER_ACCEL_SPARSE) < 0) {
            fprintf(stderr, "powerinfer: POWERINFER_SPARSE_MODEL=%s: %s\n", path, powerinfer_last_error());
        }
    }
    return (ggml_backend_reg_t) powerinfer_accel_backend_reg();
}
