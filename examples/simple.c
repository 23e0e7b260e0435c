// simple.c - the smallest program on the public C API (powerinfer.h only): load a model,
// tokenize a prompt, decode it, then sample and print N tokens greedily.
//
//     build/bin/simple -m MODEL.gguf [-p PROMPT] [-n N]
#include "powerinfer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char ** argv) {
    const char * model_path = NULL;
    const char * prompt     = "Once upon a time";
    int          n_predict  = 32;
    for (int i = 1; i < argc; ++i) {
        if (strcmp(argv[i], "-m") == 0 && i + 1 < argc) {
            model_path = argv[++i];
        } else if (strcmp(argv[i], "-p") == 0 && i + 1 < argc) {
            prompt = argv[++i];
        } else if (strcmp(argv[i], "-n") == 0 && i + 1 < argc) {
            n_predict = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: %s -m MODEL.gguf [-p PROMPT] [-n N]\n", argv[0]);
            return 2;
        }
    }
    if (!model_path || n_predict < 0) {
        fprintf(stderr, "usage: %s -m MODEL.gguf [-p PROMPT] [-n N]\n", argv[0]);
        return 2;
    }
    powerinfer_log_set_level(POWERINFER_LOG_ERROR);

    // 1. The model: weights are mapped, the sparse mode is chosen from the file.
    struct powerinfer_model * model = powerinfer_model_load(model_path, powerinfer_model_default_params());
    if (!model) {
        fprintf(stderr, "error: %s\n", powerinfer_last_error());
        return 1;
    }
    // 2. A context: the KV cache and compute buffers for prompt + generated tokens.
    struct powerinfer_context_params cparams = powerinfer_context_default_params();
    cparams.n_ctx = 512;
    struct powerinfer_context * ctx = powerinfer_context_new(model, cparams);
    // 3. A sampler chain; temp 0 is greedy.
    struct powerinfer_sampler_params sparams = powerinfer_sampler_default_params();
    sparams.temp = 0.0f;
    struct powerinfer_sampler * smpl = ctx ? powerinfer_sampler_new(model, sparams) : NULL;
    int rc = 1;
    powerinfer_token * tokens = NULL;
    if (!ctx || !smpl) {
        fprintf(stderr, "error: %s\n", powerinfer_last_error());
        goto done;
    }

    // 4. Tokens of the prompt (a first call with no buffer returns the count, negated).
    const int32_t len = (int32_t) strlen(prompt);
    const bool add_bos = powerinfer_vocab_add_bos(model);
    const int32_t n_prompt = -powerinfer_tokenize(model, prompt, len, NULL, 0, add_bos, true);
    tokens = malloc(sizeof(powerinfer_token) * (size_t) (n_prompt > 0 ? n_prompt : 1));
    if (n_prompt <= 0 || !tokens || powerinfer_tokenize(model, prompt, len, tokens, n_prompt, add_bos, true) != n_prompt) {
        fprintf(stderr, "error: cannot tokenize the prompt: %s\n", powerinfer_last_error());
        goto done;
    }
    if (n_prompt + n_predict > (int32_t) powerinfer_n_ctx(ctx)) {
        fprintf(stderr, "error: %d prompt + %d new tokens do not fit in n_ctx = %u\n", n_prompt, n_predict,
                powerinfer_n_ctx(ctx));
        goto done;
    }

    // 5. Decode the prompt in one call, then one token at a time.
    printf("%s", prompt);
    if (powerinfer_decode(ctx, tokens, n_prompt, 0, false) != POWERINFER_OK) {
        fprintf(stderr, "\nerror: %s\n", powerinfer_last_error());
        goto done;
    }
    int32_t pos = n_prompt;
    for (int i = 0; i < n_predict; ++i) {
        powerinfer_token tok = powerinfer_sampler_sample(smpl, ctx, -1);
        if (tok < 0 || powerinfer_token_is_eog(model, tok)) {
            break;
        }
        char piece[256];
        const int32_t n = powerinfer_token_to_piece(model, tok, piece, (int32_t) sizeof(piece), false);
        if (n > 0) {
            fwrite(piece, 1, (size_t) n, stdout);
            fflush(stdout);
        }
        if (powerinfer_decode(ctx, &tok, 1, pos++, false) != POWERINFER_OK) {
            fprintf(stderr, "\nerror: %s\n", powerinfer_last_error());
            goto done;
        }
    }
    printf("\n");
    rc = 0;

done:
    free(tokens);
    powerinfer_sampler_free(smpl);
    powerinfer_context_free(ctx);
    powerinfer_model_free(model);
    return rc;
}
