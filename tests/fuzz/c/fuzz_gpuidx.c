// fuzz_gpuidx.c - libFuzzer target: the gpuidx placement-cache parser (gpuidx.c, which
// reads through gguf_reader.c) on any bytes. Built by scripts/fuzz_c.sh with ASan and UBSan.
// The first two bytes choose the model the file is checked against (1-4 layers of
// 1-256 neurons, with or without the model file's identity); the rest is the file. The
// device sets are exactly n_ff bytes per layer, so a write past them is caught, and on
// success they must hold only 0 and 1.
#include "gpuidx.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size < 2) {
        return 0;
    }
    const int32_t n_layer = 1 + (data[0] & 3);
    const int32_t n_ff    = 1 + data[1];
    const bool    with_id = (data[0] & 4) != 0;
    const uint64_t model_id[2] = { 123456, 789 };
    uint8_t * is_hot[4] = { 0 };
    for (int32_t il = 0; il < n_layer; ++il) {
        is_hot[il] = malloc((size_t) n_ff);
        if (!is_hot[il]) abort();
    }
    // The file proper, in a buffer of its own size (ASan sees reads past its end).
    const size_t n = size - 2;
    uint8_t * file = malloc(n ? n : 1);
    if (!file) abort();
    memcpy(file, data + 2, n);
    uint64_t capacity = 0;
    if (pi_gpuidx_parse("fuzz.gpuidx", file, n, n_layer, n_ff, with_id ? model_id : NULL, &capacity, is_hot) ==
        POWERINFER_OK) {
        for (int32_t il = 0; il < n_layer; ++il) {
            for (int32_t i = 0; i < n_ff; ++i) {
                if (is_hot[il][i] > 1) {
                    fprintf(stderr, "fuzz_gpuidx: is_hot[%d][%d] = %d\n", il, i, is_hot[il][i]);
                    abort();
                }
            }
        }
    }
    free(file);
    for (int32_t il = 0; il < n_layer; ++il) {
        free(is_hot[il]);
    }
    return 0;
}
