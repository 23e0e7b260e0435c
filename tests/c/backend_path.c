// backend_path.c - what llama.cpp's own tools (llama-cli, llama-server: common/arg.cpp) do at
// start-up, and nothing of ours: ggml_backend_load_all(), which loads the module named by
// GGML_BACKEND_PATH, then a model through libllama and a few greedy tokens. tests/test_accel.py
// runs it with GGML_BACKEND_PATH=libggml-powerinfer.so and POWERINFER_SPARSE_MODEL=the file.
// Prints the devices ggml has, then the tokens.
#include "ggml-backend.h"
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char ** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODEL N_TOKENS\n", argv[0]);
        return 2;
    }
    ggml_backend_load_all();
    llama_backend_init();
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) printf("device %s\n", ggml_backend_dev_name(ggml_backend_dev_get(i)));
    struct llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) return 1;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 128;
    cp.n_threads = cp.n_threads_batch = 2;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return 1;
    llama_token prompt[4] = { 1, 504, 3458, 282 };
    if (llama_decode(ctx, llama_batch_get_one(prompt, 4)) != 0) return 1;
    const int n = atoi(argv[2]);
    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    printf("tokens");
    for (int i = 0; i < n; ++i) {
        const float * logits = llama_get_logits_ith(ctx, -1);
        llama_token best = 0;
        for (llama_token t = 1; t < llama_vocab_n_tokens(vocab); ++t) best = logits[t] > logits[best] ? t : best;
        printf(" %d", best);
        if (llama_decode(ctx, llama_batch_get_one(&best, 1)) != 0) return 1;
    }
    printf("\n");
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
