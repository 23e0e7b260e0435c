// gguf_reader.h - reader of GGUF-layout headers for files gguf.h refuses (PWRI magic).
#pragma once

#include "powerinfer-impl.h"

struct pi_tensor_info {
    char           name[GGML_MAX_NAME];
    enum ggml_type type;
    int64_t        ne[GGML_MAX_DIMS];
    uint64_t       offset;   // relative to the data section
    uint64_t       nbytes;
};

struct pi_gguf_file {
    struct gguf_context *   gguf;        // the key/value pairs (no tensors)
    struct pi_tensor_info * tensors;
    int64_t                 n_tensors;
    uint64_t                data_offset; // start of the data section in the file
};

// Parses the header at data[0, size) (the magic is not checked). On error returns a
// negative status with powerinfer_last_error() set, and `out` holds nothing.
int32_t pi_gguf_read(const char * path, const uint8_t * data, uint64_t size, struct pi_gguf_file * out);
void    pi_gguf_file_free(struct pi_gguf_file * f);
