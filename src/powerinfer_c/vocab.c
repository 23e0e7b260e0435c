// vocab.c - tokenizer and detokenizer: libllama's vocabulary, loaded vocab-only
// from the same model file, so tokenization is exactly llama.cpp's.
#include "powerinfer-impl.h"

#include "llama.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static pthread_once_t g_backend_once = PTHREAD_ONCE_INIT;

static void backend_init_once(void) {
    llama_backend_init();
}

// libllama refuses the PWRI magic: hand it the key/value pairs (which hold the whole
// tokenizer) as a tensor-less standard GGUF in an anonymous in-memory file.
static struct llama_model * load_vocab_of_powerinfer_file(const struct powerinfer_model * model,
                                                          struct llama_model_params mp) {
    int fd = memfd_create("powerinfer-vocab", MFD_CLOEXEC);
    if (fd < 0) {
        return NULL;
    }
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    struct llama_model * m = NULL;
    // Architectures libllama does not know (bamboo) are named llama: a vocab-only load
    // reads nothing architecture-specific.
    struct gguf_context * g = gguf_init_empty();
    if (g) {
        gguf_set_kv(g, model->gguf);
        if (strcmp(model->arch_name, "bamboo") == 0) {
            gguf_set_val_str(g, "general.architecture", "llama");
        }
        // PowerInfer's converter predates tokenizer.ggml.pre and writes none, so libllama
        // would split Falcon's text with its default BPE rules (" 1234" then differs from
        // Hugging Face's tokenizer). A PWRI Falcon's BPE vocabulary is Falcon's own.
        if (model->is_powerinfer && strcmp(model->arch_name, "falcon") == 0 &&
            gguf_find_key(g, "tokenizer.ggml.pre") < 0) {
            const int64_t tm = gguf_find_key(g, "tokenizer.ggml.model");
            if (tm >= 0 && gguf_get_kv_type(g, tm) == GGUF_TYPE_STRING && strcmp(gguf_get_val_str(g, tm), "gpt2") == 0) {
                gguf_set_val_str(g, "tokenizer.ggml.pre", "falcon");
            }
        }
        if (gguf_write_to_file(g, path, true)) {
            m = llama_model_load_from_file(path, mp);
        }
        gguf_free(g);
    }
    close(fd);
    return m;
}

static int cmp_str(const void * a, const void * b) {
    return strcmp(*(const char * const *) a, *(const char * const *) b);
}

// libllama aborts (instead of failing) on some inconsistent tokenizers; check those
// properties first so a corrupt file gives an error.
static int32_t validate_tokenizer(const struct powerinfer_model * model) {
    const struct gguf_context * g = model->gguf;
    const int64_t id = gguf_find_key(g, "tokenizer.ggml.tokens");
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, id) != GGUF_TYPE_STRING) {
        return pi_fail(POWERINFER_ERR_FORMAT, "'%s' has no tokenizer (tokenizer.ggml.tokens is missing or not a string array)",
                       model->path);
    }
    const size_t n = gguf_get_arr_n(g, id);
    static const struct { const char * key; enum gguf_type type; } per_token[] = {
        { "tokenizer.ggml.scores",     GGUF_TYPE_FLOAT32 },
        { "tokenizer.ggml.token_type", GGUF_TYPE_INT32 },
    };
    for (size_t k = 0; k < sizeof(per_token) / sizeof(per_token[0]); ++k) {
        const int64_t a = gguf_find_key(g, per_token[k].key);
        if (a >= 0 && (gguf_get_kv_type(g, a) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, a) != per_token[k].type ||
                       gguf_get_arr_n(g, a) != n)) {
            return pi_fail(POWERINFER_ERR_FORMAT, "tokenizer: %s must be an array of %zu %s", per_token[k].key, n,
                           gguf_type_name(per_token[k].type));
        }
    }
    const char ** strs = malloc((n ? n : 1) * sizeof(*strs));
    if (!strs) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    for (size_t i = 0; i < n; ++i) {
        strs[i] = gguf_get_arr_str(g, id, i);
    }
    qsort(strs, n, sizeof(*strs), cmp_str);
    int32_t rc = POWERINFER_OK;
    for (size_t i = 1; i < n && rc == POWERINFER_OK; ++i) {
        if (strcmp(strs[i - 1], strs[i]) == 0) {
            rc = pi_fail(POWERINFER_ERR_FORMAT, "tokenizer: the token '%.40s' appears twice in tokenizer.ggml.tokens", strs[i]);
        }
    }
    free(strs);
    return rc;
}

int32_t pi_vocab_load(struct powerinfer_model * model) {
    pthread_once(&g_backend_once, backend_init_once);
    int32_t rc = validate_tokenizer(model);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    struct llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    model->llm_vocab_model = model->is_powerinfer || strcmp(model->arch_name, "bamboo") == 0 ? load_vocab_of_powerinfer_file(model, mp)
                                                  : llama_model_load_from_file(model->path, mp);
    if (!model->llm_vocab_model) {
        return pi_fail(POWERINFER_ERR_FORMAT, "libllama could not load the vocabulary of '%s'", model->path);
    }
    model->vocab = llama_model_get_vocab(model->llm_vocab_model);
    const int32_t n_tokens = llama_vocab_n_tokens(model->vocab);
    if (model->params.vocab_only) {
        model->hp.n_vocab = n_tokens;
    } else if (n_tokens > model->hp.n_vocab) {
        return pi_fail(POWERINFER_ERR_FORMAT, "the vocabulary has %d tokens but token_embd.weight has only %d rows",
                       n_tokens, model->hp.n_vocab);
    }
    return POWERINFER_OK;
}

void pi_vocab_free(struct powerinfer_model * model) {
    if (model->llm_vocab_model) {
        llama_model_free(model->llm_vocab_model);
        model->llm_vocab_model = NULL;
        model->vocab           = NULL;
    }
}

powerinfer_token powerinfer_token_bos(const struct powerinfer_model * model) {
    return llama_vocab_bos(model->vocab);
}

powerinfer_token powerinfer_token_eos(const struct powerinfer_model * model) {
    return llama_vocab_eos(model->vocab);
}

bool powerinfer_token_is_eog(const struct powerinfer_model * model, powerinfer_token token) {
    return llama_vocab_is_eog(model->vocab, token);
}

bool powerinfer_vocab_add_bos(const struct powerinfer_model * model) {
    return llama_vocab_get_add_bos(model->vocab);
}

// A 4-byte UTF-8 form of a number past U+10FFFF: lead F4 then 90-BF, or lead F5-F7, then
// continuation bytes (s has 4 bytes).
static bool beyond_unicode(const unsigned char * s) {
    const bool lead = (s[0] == 0xF4 && s[1] >= 0x90 && s[1] <= 0xBF) ||
                      (s[0] >= 0xF5 && s[0] <= 0xF7 && (s[1] & 0xC0) == 0x80);
    return lead && (s[2] & 0xC0) == 0x80 && (s[3] & 0xC0) == 0x80;
}

int32_t powerinfer_tokenize(const struct powerinfer_model * model, const char * text, int32_t text_len,
                            powerinfer_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special) {
    if (!text || text_len < 0 || n_tokens_max < 0 || (n_tokens_max > 0 && !tokens)) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_tokenize: invalid arguments");
        return INT32_MIN;
    }
    // libllama decodes a 4-byte UTF-8 form of a number past U+10FFFF as a code point, and the
    // tokenizers that work on code points (all but SPM and UGM) then throw a C++ exception
    // through its C API, which ends the process: four bytes of text were enough. Those
    // tokenizers turn every other invalid byte into U+FFFD; they get these four the same way.
    // SPM (byte tokens) and UGM read the bytes without decoding them and get the text as is.
    char * clean = NULL;
    const enum llama_vocab_type vt = llama_vocab_type(model->vocab);
    if (vt != LLAMA_VOCAB_TYPE_SPM && vt != LLAMA_VOCAB_TYPE_UGM) {
        size_t n_bad = 0;
        for (int32_t i = 0; i + 3 < text_len; ++i) {
            n_bad += beyond_unicode((const unsigned char *) text + i);
        }
        if (n_bad > 0) {
            // each 4-byte form becomes 4 x EF BF BD (12 bytes)
            if ((size_t) text_len + 8 * n_bad > INT32_MAX || !(clean = malloc((size_t) text_len + 8 * n_bad))) {
                pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_tokenize: text too long");
                return INT32_MIN;
            }
            size_t o = 0;
            for (int32_t i = 0; i < text_len;) {
                if (i + 3 < text_len && beyond_unicode((const unsigned char *) text + i)) {
                    for (int k = 0; k < 4; ++k) {
                        memcpy(clean + o, "\xEF\xBF\xBD", 3);
                        o += 3;
                    }
                    i += 4;
                } else {
                    clean[o++] = text[i++];
                }
            }
            text = clean;
            text_len = (int32_t) o;
        }
    }
    int32_t n = llama_tokenize(model->vocab, text, text_len, tokens, n_tokens_max, add_special, parse_special);
    free(clean);
    if (n == INT32_MIN) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_tokenize: the text yields more than 2^31 tokens");
    }
    return n;
}

int32_t powerinfer_token_to_piece(const struct powerinfer_model * model, powerinfer_token token,
                                  char * buf, int32_t buf_size, bool special) {
    if (token < 0 || token >= llama_vocab_n_tokens(model->vocab)) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "token id %d is out of range [0, %d)", token,
                llama_vocab_n_tokens(model->vocab));
        return INT32_MIN;
    }
    return llama_token_to_piece(model->vocab, token, buf, buf_size, 0, special);
}

int32_t powerinfer_detokenize(const struct powerinfer_model * model, const powerinfer_token * tokens,
                              int32_t n_tokens, char * text, int32_t text_len_max,
                              bool remove_special, bool unparse_special) {
    const int32_t n_vocab = llama_vocab_n_tokens(model->vocab);
    for (int32_t i = 0; i < n_tokens; ++i) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            pi_fail(POWERINFER_ERR_INVALID_ARG, "token id %d is out of range [0, %d)", tokens[i], n_vocab);
            return INT32_MIN;
        }
    }
    return llama_detokenize(model->vocab, tokens, n_tokens, text, text_len_max, remove_special, unparse_special);
}

// llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE and SPEC_VOCAB_CHECK_START_TOKEN_ID: the sizes of
// one family's vocabularies differ by the padding of their embedding matrices, and their first
// control tokens harmlessly.
#define PI_VOCAB_MAX_SIZE_DIFFERENCE 128
#define PI_VOCAB_CHECK_START         5

int32_t powerinfer_vocab_compatible(const struct powerinfer_model * target, const struct powerinfer_model * draft) {
    pi_clear_error();
    if (!target || !draft || !target->vocab || !draft->vocab) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_vocab_compatible: a model without a vocabulary");
    }
    const struct llama_vocab * t = target->vocab, * d = draft->vocab;
    if (llama_vocab_type(t) != llama_vocab_type(d)) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "the vocabularies are of different types (%d and %d)",
                       (int) llama_vocab_type(t), (int) llama_vocab_type(d));
    }
    const int32_t n_t = llama_vocab_n_tokens(t), n_d = llama_vocab_n_tokens(d);
    if (abs(n_t - n_d) > PI_VOCAB_MAX_SIZE_DIFFERENCE) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "the vocabularies have %d and %d tokens", n_t, n_d);
    }
    if (llama_vocab_bos(t) != llama_vocab_bos(d) || llama_vocab_eos(t) != llama_vocab_eos(d)) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "BOS/EOS are %d/%d in the target and %d/%d in the draft",
                       llama_vocab_bos(t), llama_vocab_eos(t), llama_vocab_bos(d), llama_vocab_eos(d));
    }
    const int32_t n = n_t < n_d ? n_t : n_d;
    for (int32_t id = PI_VOCAB_CHECK_START; id < n; ++id) {
        const char * a = llama_vocab_get_text(t, id), * b = llama_vocab_get_text(d, id);
        if (strcmp(a ? a : "", b ? b : "") != 0) {
            return pi_fail(POWERINFER_ERR_INVALID_ARG, "token %d is '%.40s' in the target and '%.40s' in the draft", id,
                           a ? a : "", b ? b : "");
        }
    }
    return POWERINFER_OK;
}
