// sampling_guard.h - libllama's sampler calls that can throw, with the exception caught
// (sampling_guard.cpp). libllama's C API lets C++ exceptions out (the grammar sampler throws
// when it accepts a token its grammar cannot take); one that reaches our C frames ends the
// process through std::terminate. Each returns false with the exception's text in err.
#pragma once

#include "llama.h"

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

bool pi_llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p, char * err, size_t n_err);
bool pi_llama_sampler_accept(struct llama_sampler * smpl, llama_token token, char * err, size_t n_err);
// NULL with err set when the grammar cannot be parsed (libllama returns NULL) or throws.
struct llama_sampler * pi_llama_sampler_init_grammar(const struct llama_vocab * vocab, const char * text, const char * root,
                                                     char * err, size_t n_err);

#ifdef __cplusplus
}
#endif
