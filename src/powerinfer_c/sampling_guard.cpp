// sampling_guard.cpp - the C++ side of sampling.c: libllama's sampler calls inside try/catch,
// so that an exception becomes an error return instead of std::terminate (sampling_guard.h).
#include "sampling_guard.h"

#include <cstdio>
#include <exception>

namespace {

void describe(const std::exception * e, char * err, size_t n_err) {
    if (err && n_err > 0) {
        std::snprintf(err, n_err, "%s", e ? e->what() : "unknown C++ exception");
    }
}

}  // namespace

extern "C" bool pi_llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p, char * err, size_t n_err) {
    try {
        llama_sampler_apply(smpl, cur_p);
        return true;
    } catch (const std::exception & e) {
        describe(&e, err, n_err);
    } catch (...) {
        describe(nullptr, err, n_err);
    }
    return false;
}

extern "C" bool pi_llama_sampler_accept(struct llama_sampler * smpl, llama_token token, char * err, size_t n_err) {
    try {
        llama_sampler_accept(smpl, token);
        return true;
    } catch (const std::exception & e) {
        describe(&e, err, n_err);
    } catch (...) {
        describe(nullptr, err, n_err);
    }
    return false;
}

extern "C" struct llama_sampler * pi_llama_sampler_init_grammar(const struct llama_vocab * vocab, const char * text,
                                                                const char * root, char * err, size_t n_err) {
    try {
        struct llama_sampler * g = llama_sampler_init_grammar(vocab, text, root);
        if (!g) {
            std::snprintf(err, n_err, "the grammar could not be parsed (see the log for the position)");
        }
        return g;
    } catch (const std::exception & e) {
        describe(&e, err, n_err);
    } catch (...) {
        describe(nullptr, err, n_err);
    }
    return nullptr;
}
