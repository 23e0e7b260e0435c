// sampling.c - token selection through libllama's sampler chain, applied to the
// core's own logits (the chain needs no llama_context for that).
#include "powerinfer-impl.h"

#include "llama.h"

#include <math.h>
#include <stdlib.h>

struct powerinfer_sampler {
    struct llama_sampler * chain;
    llama_token_data *     cand;    // n_vocab candidates, reused between calls
    int32_t                n_vocab;
    bool                   greedy_only;  // the chain is the greedy sampler alone, after the logit bias if any
    struct powerinfer_logit_bias * bias; // the logit bias, stably sorted by token (the greedy shortcut's copy)
    int32_t                n_bias;
    struct powerinfer_sampler_params params;
};

struct powerinfer_sampler_params powerinfer_sampler_default_params(void) {
    struct powerinfer_sampler_params p = {
        .seed            = LLAMA_DEFAULT_SEED,
        .temp            = 0.8f,
        .top_k           = 40,
        .top_p           = 0.95f,
        .min_p           = 0.05f,
        .typical_p       = 1.0f,
        .min_keep        = 1,
        .mirostat        = 0,
        .mirostat_tau    = 5.0f,
        .mirostat_eta    = 0.1f,
        .grammar         = NULL,
        .grammar_root    = NULL,
        .penalty_last_n  = 64,
        .penalty_repeat  = 1.0f,
        .penalty_freq    = 0.0f,
        .penalty_present = 0.0f,
        .n_logit_bias    = 0,
        .logit_bias      = NULL,
    };
    return p;
}

static int32_t check_params(const struct powerinfer_sampler_params * p, int32_t n_vocab) {
    if (!isfinite(p->temp)) return pi_fail(POWERINFER_ERR_INVALID_ARG, "temperature must be finite");
    // Values past the useful range (top_p > 1, min_p < 0) mean "disabled", as in llama.cpp.
    if (!(isfinite(p->top_p) && p->top_p >= 0.0f))
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "top_p = %g must be in [0, 1]", p->top_p);
    if (!(isfinite(p->min_p) && p->min_p <= 1.0f))
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "min_p = %g must be in [0, 1]", p->min_p);
    if (!isfinite(p->typical_p) || p->typical_p < 0.0f)
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "typical_p = %g must be in [0, 1]", p->typical_p);
    if (!(p->penalty_repeat > 0.0f) || !isfinite(p->penalty_repeat))
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "repeat penalty = %g must be > 0", p->penalty_repeat);
    if (!isfinite(p->penalty_freq) || !isfinite(p->penalty_present))
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "frequency and presence penalties must be finite");
    if (p->min_keep < 0)
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "min_keep = %d must be >= 0", p->min_keep);
    if (p->mirostat < 0 || p->mirostat > 2)
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "mirostat = %d must be 0, 1 or 2", p->mirostat);
    if (!isfinite(p->mirostat_tau) || !isfinite(p->mirostat_eta))
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "mirostat tau and eta must be finite");
    if (p->penalty_last_n < -1)
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "penalty_last_n = %d must be >= -1", p->penalty_last_n);
    if (p->n_logit_bias < 0 || (p->n_logit_bias > 0 && !p->logit_bias))
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "n_logit_bias = %d with %s logit_bias", p->n_logit_bias,
                       p->logit_bias ? "a" : "no");
    for (int32_t i = 0; i < p->n_logit_bias; ++i) {
        if (p->logit_bias[i].token < 0 || p->logit_bias[i].token >= n_vocab)
            return pi_fail(POWERINFER_ERR_INVALID_ARG, "logit_bias names token %d, outside the vocabulary [0, %d)",
                           p->logit_bias[i].token, n_vocab);
        if (isnan(p->logit_bias[i].bias))
            return pi_fail(POWERINFER_ERR_INVALID_ARG, "the logit bias of token %d is NaN", p->logit_bias[i].token);
    }
    return POWERINFER_OK;
}

static int cmp_bias_token(const void * a, const void * b) {
    const struct powerinfer_logit_bias * x = a, * y = b;
    return (x->token > y->token) - (x->token < y->token);
}

// Chain order follows llama-cpp-python: grammar, penalties, then greedy, or Mirostat,
// or top-k -> typical -> top-p -> min-p -> temperature -> random draw.
struct powerinfer_sampler * powerinfer_sampler_new(const struct powerinfer_model * model, struct powerinfer_sampler_params p) {
    pi_clear_error();
    if (!model) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_sampler_new: model is NULL");
        return NULL;
    }
    if (check_params(&p, model->hp.n_vocab) != POWERINFER_OK) {
        return NULL;
    }
    struct powerinfer_sampler * s = calloc(1, sizeof(*s));
    if (!s) {
        pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
        return NULL;
    }
    s->n_vocab = model->hp.n_vocab;
    s->params  = p;
    s->cand    = malloc((size_t) s->n_vocab * sizeof(llama_token_data));
    struct llama_sampler_chain_params cp = llama_sampler_chain_default_params();
    cp.no_perf = true;
    s->chain = llama_sampler_chain_init(cp);
    if (p.n_logit_bias > 0) {
        s->n_bias = p.n_logit_bias;
        s->bias   = malloc((size_t) p.n_logit_bias * sizeof(*s->bias));
        if (s->bias) {
            // Entries of one token stay in their order (insertion sort is stable): each is
            // added in turn, as llama's logit-bias sampler does.
            for (int32_t i = 0; i < s->n_bias; ++i) {
                int32_t j = i;
                while (j > 0 && cmp_bias_token(&s->bias[j - 1], &p.logit_bias[i]) > 0) {
                    s->bias[j] = s->bias[j - 1];
                    --j;
                }
                s->bias[j] = p.logit_bias[i];
            }
        }
    }
    s->params.n_logit_bias = 0;  // the caller's array is not kept
    s->params.logit_bias   = NULL;
    if (!s->cand || !s->chain || (p.n_logit_bias > 0 && !s->bias)) {
        pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
        powerinfer_sampler_free(s);
        return NULL;
    }
    // First, as the Python logits processors it replaces ran before the chain.
    if (s->n_bias > 0) {
        llama_sampler_chain_add(s->chain, llama_sampler_init_logit_bias(s->n_vocab, p.n_logit_bias,
                                                                        (const llama_logit_bias *) p.logit_bias));
    }
    if (p.grammar && *p.grammar) {
        struct llama_sampler * g = llama_sampler_init_grammar(model->vocab, p.grammar,
                                                              p.grammar_root ? p.grammar_root : "root");
        if (!g) {
            pi_fail(POWERINFER_ERR_INVALID_ARG, "the grammar could not be parsed (see the log for the position)");
            powerinfer_sampler_free(s);
            return NULL;
        }
        llama_sampler_chain_add(s->chain, g);
    }
    const int32_t last_n = p.penalty_last_n == -1 ? model->hp.n_ctx_train : p.penalty_last_n;
    if (last_n != 0 && (p.penalty_repeat != 1.0f || p.penalty_freq != 0.0f || p.penalty_present != 0.0f)) {
        llama_sampler_chain_add(s->chain, llama_sampler_init_penalties(s->n_vocab, last_n, p.penalty_repeat,
                                                                       p.penalty_freq, p.penalty_present));
    }
    if (p.temp <= 0.0f) {
        s->greedy_only = llama_sampler_chain_n(s->chain) == (s->n_bias > 0 ? 1 : 0);
        llama_sampler_chain_add(s->chain, llama_sampler_init_greedy());
    } else if (p.mirostat == 1) {
        llama_sampler_chain_add(s->chain, llama_sampler_init_temp(p.temp));
        llama_sampler_chain_add(s->chain, llama_sampler_init_mirostat(s->n_vocab, p.seed, p.mirostat_tau, p.mirostat_eta, 100));
    } else if (p.mirostat == 2) {
        llama_sampler_chain_add(s->chain, llama_sampler_init_temp(p.temp));
        llama_sampler_chain_add(s->chain, llama_sampler_init_mirostat_v2(p.seed, p.mirostat_tau, p.mirostat_eta));
    } else {
        const size_t min_keep = p.min_keep > 0 ? (size_t) p.min_keep : 1;
        if (p.top_k > 0)      llama_sampler_chain_add(s->chain, llama_sampler_init_top_k(p.top_k));
        if (p.typical_p < 1)  llama_sampler_chain_add(s->chain, llama_sampler_init_typical(p.typical_p, min_keep));
        if (p.top_p < 1)      llama_sampler_chain_add(s->chain, llama_sampler_init_top_p(p.top_p, min_keep));
        if (p.min_p > 0)      llama_sampler_chain_add(s->chain, llama_sampler_init_min_p(p.min_p, min_keep));
        llama_sampler_chain_add(s->chain, llama_sampler_init_temp(p.temp));
        llama_sampler_chain_add(s->chain, llama_sampler_init_dist(p.seed));
    }
    return s;
}

void powerinfer_sampler_free(struct powerinfer_sampler * s) {
    if (!s) {
        return;
    }
    if (s->chain) {
        llama_sampler_free(s->chain);
    }
    free(s->cand);
    free(s->bias);
    free(s);
}

// The greedy sampler's own rule on the biased logits: scanning in token order, a token
// replaces the best so far when its logit is larger (so the first of the largest wins, and
// a NaN never does), without filling n_vocab candidates first: that was most of a greedy
// step's sampling (150k for Qwen). The biased tokens' logits get their biases added in
// turn, as the logit-bias sampler adds them.
static int32_t greedy_pick(const struct powerinfer_sampler * s, const float * logits, int32_t n_vocab) {
    int32_t best = 0;
    float   vbest = 0.0f;
    int32_t i = 0, k = 0;
    while (i < n_vocab) {
        const int32_t end = k < s->n_bias ? s->bias[k].token : n_vocab;  // next biased token
        for (; i < end; ++i) {
            if (i == 0 || logits[i] > vbest) {
                vbest = logits[i];
                best  = i;
            }
        }
        if (i >= n_vocab) {
            break;
        }
        float v = logits[i];
        for (; k < s->n_bias && s->bias[k].token == i; ++k) {
            v += s->bias[k].bias;
        }
        if (i == 0 || v > vbest) {
            vbest = v;
            best  = i;
        }
        ++i;
    }
    return best;
}

powerinfer_token powerinfer_sampler_sample_logits(struct powerinfer_sampler * s, const float * logits, int32_t n_vocab) {
    if (!s || !logits || n_vocab != s->n_vocab) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_sampler_sample_logits: expected %d logits", s ? s->n_vocab : 0);
        return -1;
    }
    if (s->greedy_only) {
        return greedy_pick(s, logits, n_vocab);
    }
    for (int32_t i = 0; i < n_vocab; ++i) {
        s->cand[i] = (llama_token_data) { .id = i, .logit = logits[i], .p = 0.0f };
    }
    llama_token_data_array arr = { .data = s->cand, .size = (size_t) n_vocab, .selected = -1, .sorted = false };
    llama_sampler_apply(s->chain, &arr);
    if (arr.selected < 0 || (size_t) arr.selected >= arr.size) {
        pi_fail(POWERINFER_ERR_INTERNAL, "the sampler chain selected no token");
        return -1;
    }
    return arr.data[arr.selected].id;
}

powerinfer_token powerinfer_sampler_sample(struct powerinfer_sampler * s, struct powerinfer_context * ctx, int32_t i) {
    const float * logits = ctx ? powerinfer_get_logits_ith(ctx, i) : NULL;
    if (!logits) {
        if (!ctx) pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_sampler_sample: context is NULL");
        return -1;
    }
    powerinfer_token tok = powerinfer_sampler_sample_logits(s, logits, ctx->model->hp.n_vocab);
    if (tok >= 0) {
        llama_sampler_accept(s->chain, tok);
    }
    return tok;
}

void powerinfer_sampler_accept(struct powerinfer_sampler * s, powerinfer_token token) {
    if (s && token >= 0 && token < s->n_vocab) {
        llama_sampler_accept(s->chain, token);
    }
}

void powerinfer_sampler_reset(struct powerinfer_sampler * s) {
    if (s) {
        llama_sampler_reset(s->chain);
    }
}
