// sampling.c - token selection through libllama's sampler chain, applied to the
// core's own logits (the chain needs no llama_context for that).
#include "powerinfer-impl.h"
#include "sampling_guard.h"

#include "llama.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// The repetition penalties of libllama's penalties sampler, with the same window, counts and
// float operations, applied to the window's tokens only: libllama's apply looks every
// candidate up in a hash map, 49k lookups per sampled token for SmolLM2 and 152k for Qwen
// (0.5-1.5 ms, a third of a SmolLM2 step of 4 sequences, and the server's requests carry
// llama-cpp-python's default repeat_penalty 1.1).
struct pi_penalties {
    int32_t            last_n;   // window (> 0)
    float              repeat, freq, present;
    int32_t            n_vocab;
    powerinfer_token * ring;     // the window's tokens, oldest at head
    int32_t            head, size;
    int32_t *          count;    // [n_vocab] occurrences in the window
    powerinfer_token * distinct; // the tokens with count > 0 (unordered)
    int32_t            n_distinct;
};

struct powerinfer_sampler {
    atomic_int             n_refs;  // see struct powerinfer_model
    struct powerinfer_model * model; // held: the grammar reads its vocabulary
    struct llama_sampler * chain;
    llama_token_data *     cand;    // n_vocab candidates, reused between calls
    int32_t                n_vocab;
    bool                   greedy_only;  // the chain is the greedy sampler alone, after the logit bias and
                                         // the penalties if any
    struct powerinfer_logit_bias * bias; // the logit bias, stably sorted by token (the greedy shortcut's copy)
    int32_t                n_bias;
    struct pi_penalties *  pen;          // NULL: no penalties (owned by its sampler in the chain)
    struct powerinfer_logit_bias * special; // the greedy shortcut's scratch: biased and penalized tokens
    int32_t                special_cap;
    powerinfer_token *     pen_sorted;   // its scratch for the penalized tokens, sorted
    int32_t                pen_sorted_cap;
    bool                   has_grammar;
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

// ---- penalties ----

// llama's `logit <= 0 ? logit * repeat : logit / repeat`, then `logit -= float(count) * freq
// + float(count > 0) * present` (count > 0 here), each operation rounded alone as its build
// (plain SSE) rounds it: the volatile keeps the compiler from fusing them into an FMA.
static float penalize(const struct pi_penalties * pen, float logit, int32_t count) {
    logit = logit <= 0 ? logit * pen->repeat : logit / pen->repeat;
    volatile float f = (float) count * pen->freq;
    volatile float sub = f + pen->present;
    return logit - sub;
}

static void penalties_accept(struct llama_sampler * smpl, llama_token token) {
    struct pi_penalties * pen = smpl->ctx;
    if (token < 0 || token >= pen->n_vocab) {
        return;
    }
    if (pen->count[token]++ == 0) {
        pen->distinct[pen->n_distinct++] = token;
    }
    if (pen->size >= pen->last_n) {  // the window is full: its oldest token leaves
        const powerinfer_token old = pen->ring[pen->head];
        if (--pen->count[old] == 0) {
            for (int32_t i = 0; i < pen->n_distinct; ++i) {
                if (pen->distinct[i] == old) {
                    pen->distinct[i] = pen->distinct[--pen->n_distinct];
                    break;
                }
            }
        }
        pen->ring[pen->head] = token;
        pen->head = (pen->head + 1) % pen->last_n;
    } else {
        pen->ring[(pen->head + pen->size) % pen->last_n] = token;
        pen->size += 1;
    }
}

static void penalties_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p) {
    struct pi_penalties * pen = smpl->ctx;
    for (int32_t i = 0; i < pen->n_distinct; ++i) {
        const powerinfer_token t = pen->distinct[i];
        size_t j = (size_t) t;
        if (j >= cur_p->size || cur_p->data[j].id != t) {  // not in token order: look for it
            for (j = 0; j < cur_p->size && cur_p->data[j].id != t; ++j) {
            }
            if (j == cur_p->size) {
                continue;
            }
        }
        cur_p->data[j].logit = penalize(pen, cur_p->data[j].logit, pen->count[t]);
    }
    cur_p->sorted = false;
}

static void penalties_reset(struct llama_sampler * smpl) {
    struct pi_penalties * pen = smpl->ctx;
    for (int32_t i = 0; i < pen->n_distinct; ++i) {
        pen->count[pen->distinct[i]] = 0;
    }
    pen->n_distinct = pen->head = pen->size = 0;
}

static void pi_penalties_free(struct pi_penalties * pen) {
    if (pen) {
        free(pen->ring);
        free(pen->count);
        free(pen->distinct);
        free(pen);
    }
}

static void penalties_free(struct llama_sampler * smpl) {
    pi_penalties_free(smpl->ctx);
}

static const char * penalties_name(const struct llama_sampler * smpl) {
    (void) smpl;
    return "penalties";
}

static struct llama_sampler_i g_penalties_i = {
    .name   = penalties_name,
    .accept = penalties_accept,
    .apply  = penalties_apply,
    .reset  = penalties_reset,
    .clone  = NULL,
    .free   = penalties_free,
};

static struct pi_penalties * penalties_new(int32_t n_vocab, int32_t last_n, float repeat, float freq, float present) {
    struct pi_penalties * pen = calloc(1, sizeof(*pen));
    if (!pen) {
        return NULL;
    }
    const int32_t n_distinct_max = last_n < n_vocab ? last_n : n_vocab;
    pen->last_n   = last_n;
    pen->repeat   = repeat;
    pen->freq     = freq;
    pen->present  = present;
    pen->n_vocab  = n_vocab;
    pen->ring     = malloc((size_t) last_n * sizeof(*pen->ring));
    pen->count    = calloc((size_t) n_vocab, sizeof(*pen->count));
    pen->distinct = malloc((size_t) n_distinct_max * sizeof(*pen->distinct));
    if (!pen->ring || !pen->count || !pen->distinct) {
        pi_penalties_free(pen);
        return NULL;
    }
    return pen;
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
    atomic_init(&s->n_refs, 1);
    s->model = pi_model_retain((struct powerinfer_model *) model);
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
        char err[256] = "";
        struct llama_sampler * g = pi_llama_sampler_init_grammar(model->vocab, p.grammar,
                                                                 p.grammar_root ? p.grammar_root : "root", err, sizeof(err));
        if (!g) {
            pi_fail(POWERINFER_ERR_INVALID_ARG, "%s", err);
            powerinfer_sampler_free(s);
            return NULL;
        }
        llama_sampler_chain_add(s->chain, g);
        s->has_grammar = true;
    }
    const int32_t last_n = p.penalty_last_n == -1 ? model->hp.n_ctx_train : p.penalty_last_n;
    if (last_n > 0 && (p.penalty_repeat != 1.0f || p.penalty_freq != 0.0f || p.penalty_present != 0.0f)) {
        s->pen = penalties_new(s->n_vocab, last_n, p.penalty_repeat, p.penalty_freq, p.penalty_present);
        struct llama_sampler * ps = s->pen ? llama_sampler_init(&g_penalties_i, s->pen) : NULL;
        if (!ps) {
            pi_penalties_free(s->pen);
            s->pen = NULL;
            pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
            powerinfer_sampler_free(s);
            return NULL;
        }
        llama_sampler_chain_add(s->chain, ps);  // the chain owns and frees it
    }
    if (p.temp <= 0.0f) {
        s->greedy_only = llama_sampler_chain_n(s->chain) == (s->n_bias > 0 ? 1 : 0) + (s->pen ? 1 : 0);
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

struct powerinfer_sampler * pi_sampler_retain(struct powerinfer_sampler * s) {
    atomic_fetch_add(&s->n_refs, 1);
    return s;
}

void powerinfer_sampler_free(struct powerinfer_sampler * s) {
    if (!s || atomic_fetch_sub(&s->n_refs, 1) > 1) {
        return;  // a batcher's run still samples with it
    }
    if (s->chain) {
        llama_sampler_free(s->chain);
    }
    free(s->cand);
    free(s->bias);
    free(s->special);
    free(s->pen_sorted);
    struct powerinfer_model * model = s->model;
    free(s);
    powerinfer_model_free(model);
}

static int cmp_token_asc(const void * a, const void * b) {
    const powerinfer_token x = *(const powerinfer_token *) a, y = *(const powerinfer_token *) b;
    return (x > y) - (x < y);
}

// The greedy sampler's own rule on the biased and penalized logits: scanning in token order,
// a token replaces the best so far when its logit is larger (so the first of the largest
// wins, and a NaN never does), without filling n_vocab candidates first: that was most of a
// greedy step's sampling (150k for Qwen). Only the biased and penalized tokens differ from
// their logits: theirs get the biases added in turn, then the penalty, as the chain's
// samplers apply them. Returns -1 when the scratch cannot be had (the caller runs the chain).
static int32_t greedy_pick(struct powerinfer_sampler * s, const float * logits, int32_t n_vocab) {
    const struct pi_penalties * pen = s->pen;
    const int32_t n_pen = pen ? pen->n_distinct : 0;
    if (n_pen > 512) {
        return -1;  // a long window: filling the candidates costs less than sorting it each token
    }
    // The special tokens, ascending: the biased ones (sorted already) and the penalized ones.
    const int32_t n_special_max = s->n_bias + n_pen;
    if (n_special_max > s->special_cap) {
        struct powerinfer_logit_bias * sp = realloc(s->special, (size_t) n_special_max * sizeof(*sp));
        if (!sp) {
            return -1;
        }
        s->special     = sp;
        s->special_cap = n_special_max;
    }
    if (n_pen > s->pen_sorted_cap) {
        powerinfer_token * ps = realloc(s->pen_sorted, (size_t) n_pen * sizeof(*ps));
        if (!ps) {
            return -1;
        }
        s->pen_sorted     = ps;
        s->pen_sorted_cap = n_pen;
    }
    powerinfer_token * penalized = s->pen_sorted;
    if (n_pen > 0) {
        memcpy(penalized, pen->distinct, (size_t) n_pen * sizeof(*penalized));
    }
    if (n_pen > 1) {  // qsort's array must not be NULL, even for no elements (C11 7.22.5)
        qsort(penalized, (size_t) n_pen, sizeof(penalized[0]), cmp_token_asc);
    }
    // The special tokens' values, ascending by token, in s->special (token, value).
    int32_t n_special = 0;
    int32_t ib = 0, ip = 0;
    while (ib < s->n_bias || ip < n_pen) {
        const powerinfer_token tb = ib < s->n_bias ? s->bias[ib].token : n_vocab;
        const powerinfer_token tp = ip < n_pen ? penalized[ip] : n_vocab;
        const powerinfer_token t = tb < tp ? tb : tp;
        float v = logits[t];
        for (; ib < s->n_bias && s->bias[ib].token == t; ++ib) {
            v += s->bias[ib].bias;
        }
        if (ip < n_pen && penalized[ip] == t) {
            v = penalize(pen, v, pen->count[t]);
            ++ip;
        }
        s->special[n_special++] = (struct powerinfer_logit_bias) { .token = t, .bias = v };
    }
    int32_t best = 0;
    float   vbest = 0.0f;
    int32_t i = 0, k = 0;
    while (i < n_vocab) {
        const int32_t end = k < n_special ? s->special[k].token : n_vocab;  // next special token
        for (; i < end; ++i) {
            if (i == 0 || logits[i] > vbest) {
                vbest = logits[i];
                best  = i;
            }
        }
        if (i >= n_vocab) {
            break;
        }
        const float v = s->special[k++].bias;
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
        const int32_t best = greedy_pick(s, logits, n_vocab);
        if (best >= 0) {
            return best;
        }
    }
    for (int32_t i = 0; i < n_vocab; ++i) {
        s->cand[i] = (llama_token_data) { .id = i, .logit = logits[i], .p = 0.0f };
    }
    llama_token_data_array arr = { .data = s->cand, .size = (size_t) n_vocab, .selected = -1, .sorted = false };
    char err[256] = "";
    if (!pi_llama_sampler_apply(s->chain, &arr, err, sizeof(err))) {
        pi_fail(POWERINFER_ERR_INTERNAL, "the sampler chain failed: %s", err);
        return -1;
    }
    if (arr.selected < 0 || (size_t) arr.selected >= arr.size) {
        pi_fail(POWERINFER_ERR_INTERNAL, "the sampler chain selected no token");
        return -1;
    }
    // Every candidate excluded (-inf), yet the chain's last sampler picks one: accepting it
    // would make the grammar throw. The request asked for the impossible: say so.
    if (arr.data[arr.selected].logit == -INFINITY) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, s->has_grammar
                ? "the grammar allows no token here: no token of the vocabulary can continue it"
                : "every token has a logit of -inf: nothing can be sampled");
        return -1;
    }
    return arr.data[arr.selected].id;
}

// llama_sampler_accept, its exceptions caught (the grammar's when it cannot take the token).
static int32_t accept_token(struct powerinfer_sampler * s, powerinfer_token token) {
    char err[256] = "";
    if (!pi_llama_sampler_accept(s->chain, token, err, sizeof(err))) {
        return pi_fail(s->has_grammar ? POWERINFER_ERR_INVALID_ARG : POWERINFER_ERR_INTERNAL,
                       "token %d cannot be accepted: %s", token, err);
    }
    return POWERINFER_OK;
}

powerinfer_token powerinfer_sampler_sample(struct powerinfer_sampler * s, struct powerinfer_context * ctx, int32_t i) {
    const float * logits = ctx ? powerinfer_get_logits_ith(ctx, i) : NULL;
    if (!logits) {
        if (!ctx) pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_sampler_sample: context is NULL");
        return -1;
    }
    powerinfer_token tok = powerinfer_sampler_sample_logits(s, logits, ctx->model->hp.n_vocab);
    if (tok >= 0 && accept_token(s, tok) != POWERINFER_OK) {
        return -1;
    }
    return tok;
}

int32_t powerinfer_sampler_accept(struct powerinfer_sampler * s, powerinfer_token token) {
    if (!s || token < 0 || token >= s->n_vocab) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_sampler_accept: token %d is outside the vocabulary [0, %d)",
                       token, s ? s->n_vocab : 0);
    }
    return accept_token(s, token);
}

void powerinfer_sampler_reset(struct powerinfer_sampler * s) {
    if (s) {
        llama_sampler_reset(s->chain);
    }
}

int32_t powerinfer_sampler_probs(struct powerinfer_sampler * s, const float * logits, int32_t n_vocab, float * probs) {
    pi_clear_error();
    if (!s || !logits || !probs || n_vocab != s->n_vocab) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_sampler_probs: expected %d logits and room for as many "
                       "probabilities", s ? s->n_vocab : 0);
    }
    if (s->params.mirostat != 0 && s->params.temp > 0.0f) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_sampler_probs: a Mirostat sampler has no fixed distribution");
    }
    memset(probs, 0, (size_t) n_vocab * sizeof(float));
    if (s->params.temp <= 0.0f) {
        const powerinfer_token tok = powerinfer_sampler_sample_logits(s, logits, n_vocab);
        if (tok < 0) {
            return POWERINFER_ERR_INVALID_ARG;
        }
        probs[tok] = 1.0f;
        return POWERINFER_OK;
    }
    for (int32_t i = 0; i < n_vocab; ++i) {
        s->cand[i] = (llama_token_data) { .id = i, .logit = logits[i], .p = 0.0f };
    }
    llama_token_data_array arr = { .data = s->cand, .size = (size_t) n_vocab, .selected = -1, .sorted = false };
    // Every sampler of the chain but its last, the draw (dist), which is a softmax and a draw.
    const int32_t n = llama_sampler_chain_n(s->chain);
    char err[256] = "";
    for (int32_t k = 0; k + 1 < n; ++k) {
        if (!pi_llama_sampler_apply(llama_sampler_chain_get(s->chain, k), &arr, err, sizeof(err))) {
            return pi_fail(POWERINFER_ERR_INTERNAL, "the sampler chain failed: %s", err);
        }
    }
    float max = -INFINITY;
    for (size_t i = 0; i < arr.size; ++i) {
        max = arr.data[i].logit > max ? arr.data[i].logit : max;
    }
    if (max == -INFINITY) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, s->has_grammar
                       ? "the grammar allows no token here: no token of the vocabulary can continue it"
                       : "every token has a logit of -inf: nothing can be sampled");
    }
    double sum = 0.0;
    for (size_t i = 0; i < arr.size; ++i) {
        sum += expf(arr.data[i].logit - max);
    }
    for (size_t i = 0; i < arr.size; ++i) {
        probs[arr.data[i].id] = (float) (expf(arr.data[i].logit - max) / sum);
    }
    return POWERINFER_OK;
}
