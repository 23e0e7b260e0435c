// fuzz_gguf.c - libFuzzer target: the PWRI/GGUF header reader (gguf_reader.c) on any bytes.
// Built by scripts/fuzz_c.sh (CMake option POWERINFER_FUZZ, clang) with ASan and UBSan.
// Each input is read as a model file and as a gpuidx file (old integer codes, empty
// tensors); on success every promise of the reader is checked: each tensor's data lies
// inside the input (its first and last bytes are read, so ASan sees any overrun), its
// size matches its shape and type, names are unique, and the metadata can be walked.
#include "gguf_reader.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void check(bool ok, const char * what) {
    if (!ok) {
        fprintf(stderr, "fuzz_gguf: broken promise: %s\n", what);
        abort();
    }
}

static volatile uint8_t g_sink;

static void walk(const struct pi_gguf_file * f, const uint8_t * data, size_t size) {
    check(f->data_offset <= size || f->n_tensors == 0, "data section starts inside the file");
    for (int64_t i = 0; i < f->n_tensors; ++i) {
        const struct pi_tensor_info * ti = &f->tensors[i];
        check(ti->offset <= size - f->data_offset && ti->nbytes <= size - f->data_offset - ti->offset,
              "tensor data inside the file");
        check(strlen(ti->name) > 0 && strlen(ti->name) < GGML_MAX_NAME, "tensor name length");
        int64_t nelem = 1;
        for (int d = 0; d < GGML_MAX_DIMS; ++d) {
            check(ti->ne[d] >= 0, "non-negative dimensions");
            nelem *= ti->ne[d];  // the reader checked that this cannot overflow
        }
        const uint64_t want = nelem == 0 ? 0 : (uint64_t) nelem / ggml_blck_size(ti->type) * ggml_type_size(ti->type);
        check(ti->nbytes == want, "nbytes matches shape and type");
        if (ti->nbytes > 0) {
            const uint8_t * p = data + f->data_offset + ti->offset;
            g_sink ^= p[0] ^ p[ti->nbytes - 1];
        }
        for (int64_t j = 0; j < i && j < 64; ++j) {
            check(strcmp(f->tensors[j].name, ti->name) != 0, "unique tensor names");
        }
    }
    const int64_t n_kv = gguf_get_n_kv(f->gguf);
    for (int64_t i = 0; i < n_kv; ++i) {
        const char * key = gguf_get_key(f->gguf, i);
        check(key && *key, "non-empty key");
        const enum gguf_type t = gguf_get_kv_type(f->gguf, i);
        if (t == GGUF_TYPE_STRING) {
            g_sink ^= (uint8_t) gguf_get_val_str(f->gguf, i)[0];
        } else if (t == GGUF_TYPE_ARRAY) {
            const size_t n = gguf_get_arr_n(f->gguf, i);
            if (n > 0 && gguf_get_arr_type(f->gguf, i) == GGUF_TYPE_STRING) {
                g_sink ^= (uint8_t) gguf_get_arr_str(f->gguf, i, n - 1)[0];
            }
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    static const uint32_t modes[] = { 0, PI_GGUF_LEGACY_INT_TYPES | PI_GGUF_ALLOW_EMPTY };
    for (size_t m = 0; m < sizeof(modes) / sizeof(modes[0]); ++m) {
        struct pi_gguf_file f;
        if (pi_gguf_read_ex("fuzz", data, size, modes[m], &f) == POWERINFER_OK) {
            walk(&f, data, size);
            pi_gguf_file_free(&f);
        } else {
            check(f.gguf == NULL && f.tensors == NULL, "nothing held after an error");
            check(powerinfer_last_error()[0] != '\0', "an error message");
        }
    }
    return 0;
}
