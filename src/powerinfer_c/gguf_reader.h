// gguf_reader.h - reader of GGUF-layout headers for files gguf.h refuses (PWRI magic).
#pragma once

#include "powerinfer-impl.h"

// Plausibility caps on the header's counts. Each key/value pair goes through gguf.h's
// setters, which look keys up linearly (and libllama's vocabulary load copies them the
// same way), so a count far above any real file's (tens) would cost quadratic time.
#define PI_GGUF_MAX_KV      16384
#define PI_GGUF_MAX_TENSORS 65536

// Flags of pi_gguf_read_ex.
enum {
    // Integer tensor types under the codes of PowerInfer's ggml (late 2023), where I8, I16
    // and I32 were 16, 17 and 18 (now IQ2_XXS, IQ2_XS, IQ3_XXS). PowerInfer's gpuidx files
    // use them; the current codes (24, 25, 26) are read too.
    PI_GGUF_LEGACY_INT_TYPES = 1 << 0,
    // Tensors with an empty dimension (ne = 0): PowerInfer writes an empty gpu_bucket for a
    // layer with no neuron on the device. Model files must not have them.
    PI_GGUF_ALLOW_EMPTY      = 1 << 1,
};

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

// Parses the header at data[0, size) (the magic is not checked). Every tensor's data,
// [data_offset + offset, + nbytes), is checked to lie inside data[0, size). On error
// returns a negative status with powerinfer_last_error() set, and `out` holds nothing.
int32_t pi_gguf_read(const char * path, const uint8_t * data, uint64_t size, struct pi_gguf_file * out);
int32_t pi_gguf_read_ex(const char * path, const uint8_t * data, uint64_t size, uint32_t flags, struct pi_gguf_file * out);
void    pi_gguf_file_free(struct pi_gguf_file * f);
