// gpuidx.h - the parser of gpuidx.c on its own (the reader's core, over bytes already in
// memory), so tests and fuzzers can drive it without a model or a file.
#pragma once

#include "powerinfer-impl.h"

// Parses a gpuidx file held in data[0, size) for a model of n_layer layers of n_ff
// neurons; is_hot[il] (n_ff bytes each) receives the device sets and *capacity the
// file's split.vram_capacity. model_id (size, mtime in ns), when not NULL, must match
// the file's powerinfer.gpuidx.model_size / model_mtime_ns if it has them. `path` only
// names the file in messages.
int32_t pi_gpuidx_parse(const char * path, const uint8_t * data, uint64_t size, int32_t n_layer, int32_t n_ff,
                        const uint64_t * model_id, uint64_t * capacity, uint8_t ** is_hot);
