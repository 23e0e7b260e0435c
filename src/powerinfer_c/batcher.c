// batcher.c - continuous batching: one thread computes the decodes of every sequence of a
// context as one batch per step, and samples for the sequences that run ahead.
//
// Why a thread in the core: a step of 4 sequences costs about 1.5 steps of one, but only if
// the 4 tokens are there when the step starts. When each sequence's caller sampled its own
// token (Python, one at a time under the GIL), every step waited for the slowest caller.
// A sequence that runs ahead is sampled here, right after its row is computed, and its
// token goes into the next step; its caller takes the tokens when it gets to them
// (powerinfer_batcher_next), at most `lookahead` behind.
//
// Locks: `mu` guards the batcher's state (requests, runs, handed-over tokens); `ctx_mu` is
// held while a step uses the context (and by powerinfer_batcher_lock). The thread takes
// ctx_mu before it lets go of mu after choosing a step's work, so a sequence stopped in
// between (powerinfer_batcher_stop takes ctx_mu after marking the run ended) is trimmed only
// after that step: nothing the step computes for it stays in the cache.
//
// Restarts: a request arriving just after a step began would wait for the whole step, then
// for the next one with its prompt in it: nearly two steps before its first token. In a busy
// server that is the usual case (a client sends its next request as soon as its last token
// came, when the step after that token has just begun). So a new request that finds the
// step under way for less than `restart_within` of a step's time interrupts it (ggml's abort
// callback, between two graph nodes; the decode frees the step's cells) and the step is
// computed again with the request in it. A step is interrupted once at most, so arrivals
// cannot starve the sequences already running; what it had computed is lost (n_restarts,
// restart_ms). Dense models only: a sparse model's prompt is computed in a group of its own.
//
// Prompt chunks: a prompt is computed a chunk per step, so the sequences already generating
// keep stepping while it is read (a 3300-token prompt in one step stopped every stream for
// a minute). A dense model's chunk is sized to take about prompt_slice_ms by the measured
// time per prompt token; with batch-invariant kernels a token's result does not depend on
// where a chunk ends. A sparse model's chunks are n_batch tokens, the ubatches of a lone
// decode, so each piece takes the FFN path it takes alone.
//
// Cancelling: a caller that no longer wants a sequence's work (a client gone, a server shutting
// down) marks the sequence cancelled from any thread (powerinfer_batcher_set_cancelled, which
// takes only mu): its run ends at once and its request before its next chunk, so a long
// prompt stops within one step instead of being read to its end for nobody.
//
// Lifetime: powerinfer_batcher_close ends the thread and wakes every waiting caller; every
// call after it fails without touching the context. Callers inside a call (n_inside) are
// waited for, so free() after close() frees nothing in use.
#include "powerinfer-impl.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PI_BATCHER_ERR_LEN 512

struct pi_bseq {
    pthread_cond_t cv;  // the caller waits here: a request done, tokens handed over, a run ended

    // A decode request (powerinfer_batcher_decode): its caller waits for it.
    bool                     req_pending;  // asked for, not yet computed
    bool                     req_done;
    const powerinfer_token * req_tokens;
    int32_t                  req_n, req_pos;
    int32_t                  req_off;      // its tokens computed so far (earlier chunks)
    bool                     req_all;      // every token's logits
    float *                  req_out;
    int32_t                  req_status;   // rows copied, or a negative status
    bool                     lockstep;
    bool                     cancelled;    // powerinfer_batcher_set_cancelled: no more work for it

    // A run ahead (powerinfer_batcher_generate).
    bool                        running;   // tokens may still be sampled
    struct powerinfer_sampler * smpl;
    powerinfer_token *          in;        // tokens to decode next (the prompt's rest, then the last sampled token)
    int32_t                     n_in, in_cap, in_pos;
    int32_t                     n_left;    // tokens it may still sample (< 0: no limit)
    int32_t                     pos_limit;
    powerinfer_token *          stop;      // tokens that end the run, besides end-of-generation ones
    int32_t                     n_stop, stop_cap;
    powerinfer_token *          out;       // sampled, not yet handed over: a ring of `lookahead` tokens
    int32_t                     out_head, n_out;
    int32_t                     end_status;  // why the run ended: POWERINFER_OK or a negative status

    // The chunks of its prompt computed so far: the first's and the last's middle position
    // and time per token of their steps (a prompt token's cost grows with its position).
    int32_t n_chunks, chunk_last;  // chunks measured, the last one's tokens
    double  chunk_pos[2], chunk_ms[2];

    char err[PI_BATCHER_ERR_LEN];  // the message of a failed request or run
};

// One piece of a step's work: a request, or a running sequence's next tokens.
struct pi_bitem {
    int32_t                  seq;
    bool                     is_run;
    const powerinfer_token * tokens;
    int32_t                  n, pos;
    int32_t                  n_rows;   // logits rows it gets (0: a prompt chunk before the last)
    int32_t                  row;      // its first row in the step's output
    float *                  out;      // a request's rows go here
    int32_t                  status;   // of its decode
    struct powerinfer_sampler * smpl;  // a run's sampler, taken under mu (stop() clears the run's)
    powerinfer_token         sampled;  // a run's new token, or -1
    char                     err[PI_BATCHER_ERR_LEN];  // the message of a failed status
};

// A queued edit of a sequence's cells (powerinfer_batcher_kv_keep, _kv_share).
struct pi_bedit {
    int32_t seq;
    int32_t src;  // < 0: keep seq's first n positions; else seq becomes src's first n positions
    int32_t n;
};

struct powerinfer_batcher {
    struct powerinfer_context *     ctx;
    struct powerinfer_batcher_params params;
    int32_t                         n_seq, n_vocab;
    bool                            dense;    // the whole step in one batch (no sparse path to keep)
    int32_t                         sparse_max_batch;
    int32_t                         n_batch;  // the context's: the largest prompt chunk

    pthread_mutex_t mu;
    pthread_cond_t  work_cv;   // the thread waits here for work
    pthread_mutex_t ctx_mu;
    pthread_t       thread;
    bool            started;   // the thread runs (until close() joins it)
    bool            started_once; // it was started: the batcher holds a reference on ctx
    bool            quit;      // closing or closed: nothing more is computed, every call fails
    bool            closed;    // powerinfer_batcher_close has returned
    int32_t         n_inside;  // callers inside a call (close() waits for them to leave)
    int32_t         n_ctx_waiters; // callers waiting for ctx_mu: the thread lets them have it first
    pthread_cond_t  left_cv;

    struct pi_bseq * seqs;     // [n_seq]
    struct pi_bedit * edits;   // queued, applied in order under ctx_mu before the next step's decodes
    int32_t          n_edits, edits_cap;
    double           step_ms;  // moving average of a step's compute time
    // The group under way (under mu), for restarts; abort is read by ggml's abort callback.
    bool             restartable;  // one computes, and a new request may still interrupt it
    double           restart_until; // until when (pi_time_ms)
    bool             no_restart;   // the step was interrupted once already
    atomic_bool      abort;
    struct powerinfer_batcher_stats stats;

    // A step's batch, reused: items, then tokens, sequence ids and logits flags.
    struct pi_bitem *  items;  // [n_seq]
    powerinfer_token * b_tok;
    int32_t *          b_seq;
    int8_t *           b_logits;
    int32_t            b_cap;
};

struct powerinfer_batcher_params powerinfer_batcher_default_params(void) {
    struct powerinfer_batcher_params p = {
        .lookahead     = 16,
        .max_gather_ms = 20.0f,
        .restart_within = 0.5f,
        .prompt_slice_ms = 250.0f,
    };
    return p;
}

static void set_err(struct pi_bseq * q, const char * msg) {
    snprintf(q->err, sizeof(q->err), "%s", msg && *msg ? msg : "unknown error");
}

// A run's work is ready for a step: tokens to decode, and room for the token it will sample.
static bool run_ready(const struct powerinfer_batcher * b, const struct pi_bseq * q) {
    return q->running && q->n_in > 0 && q->n_out < b->params.lookahead;
}

static bool has_work(const struct powerinfer_batcher * b) {
    for (int32_t s = 0; s < b->n_seq; ++s) {
        if (b->seqs[s].req_pending || run_ready(b, &b->seqs[s])) {
            return true;
        }
    }
    return false;
}

static bool any_run_ready(const struct powerinfer_batcher * b) {
    for (int32_t s = 0; s < b->n_seq; ++s) {
        if (run_ready(b, &b->seqs[s])) {
            return true;
        }
    }
    return false;
}

static int32_t lockstep_missing(const struct powerinfer_batcher * b) {
    int32_t n = 0;
    for (int32_t s = 0; s < b->n_seq; ++s) {
        n += b->seqs[s].lockstep && !b->seqs[s].req_pending;
    }
    return n;
}

// The queued edits, in order (the caller holds mu and ctx_mu).
static void apply_edits(struct powerinfer_batcher * b) {
    for (int32_t i = 0; i < b->n_edits; ++i) {
        const struct pi_bedit * e = &b->edits[i];
        if (e->src < 0) {
            powerinfer_kv_seq_rm(b->ctx, e->seq, e->n, -1);
        } else {
            powerinfer_kv_seq_rm(b->ctx, e->seq, 0, -1);
            powerinfer_kv_seq_cp(b->ctx, e->src, e->seq, 0, e->n);
        }
    }
    b->n_edits = 0;
}

static void deadline_after(struct timespec * ts, double ms) {
    clock_gettime(CLOCK_REALTIME, ts);
    const long long ns = (long long) ts->tv_nsec + (long long) (ms * 1e6);
    ts->tv_sec += (time_t) (ns / 1000000000LL);
    ts->tv_nsec = (long) (ns % 1000000000LL);
}

static int32_t grow_batch(struct powerinfer_batcher * b, int32_t n) {
    if (n <= b->b_cap) {
        return POWERINFER_OK;
    }
    int32_t cap = b->b_cap ? b->b_cap : 64;
    while (cap < n) cap *= 2;
    powerinfer_token * t = realloc(b->b_tok, (size_t) cap * sizeof(*t));
    if (t) b->b_tok = t;
    int32_t * q = realloc(b->b_seq, (size_t) cap * sizeof(*q));
    if (q) b->b_seq = q;
    int8_t * l = realloc(b->b_logits, (size_t) cap);
    if (l) b->b_logits = l;
    if (!t || !q || !l) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    b->b_cap = cap;
    return POWERINFER_OK;
}

// Tokens of q's prompt its next step takes, starting at position pos (see the file's header).
// A dense model's chunk is sized to prompt_slice_ms: a token's time is modelled as linear in
// its position (attention reads every cell before it), c(p) = c1 + slope (p - p1), from the
// first and the last chunk measured; n tokens from pos then take n c(pos + n/2). The first
// chunk is small: it measures; each next one is at most 4 times the last, so the slope is
// measured before the model's guesses matter.
static int32_t chunk_tokens(const struct powerinfer_batcher * b, const struct pi_bseq * q, int32_t pos) {
    const int32_t min_chunk = 16;  // below it a step's fixed costs dominate
    int32_t n = b->n_batch;
    if (b->dense && b->params.prompt_slice_ms > 0.0f) {
        double fit = min_chunk;
        if (q->n_chunks > 0) {
            const double p1 = q->chunk_pos[1], c1 = q->chunk_ms[1];
            const double dp = p1 - q->chunk_pos[0];
            const double slope = q->n_chunks > 1 && dp > 0.0 && c1 > q->chunk_ms[0] ? (c1 - q->chunk_ms[0]) / dp : 0.0;
            const double base = c1 + slope * (pos - p1);  // c at the chunk's first position
            const double slice = b->params.prompt_slice_ms;
            // n (base + slope n / 2) = slice
            fit = slope > 0.0 ? (sqrt(base * base + 2.0 * slope * slice) - base) / slope : slice / base;
            fit = fit < 4.0 * q->chunk_last ? fit : 4.0 * q->chunk_last;
        }
        n = fit < (double) n ? (fit > min_chunk ? (int32_t) fit : min_chunk) : n;
    }
    return n > 0 ? n : 1;
}

// The step's work, under mu: every pending request and every ready run (a prompt's next
// chunk), one-token pieces first (the order of the groups below).
static int32_t collect(struct powerinfer_batcher * b) {
    int32_t n = 0;
    for (int pass = 0; pass < 2; ++pass) {
        for (int32_t s = 0; s < b->n_seq; ++s) {
            struct pi_bseq * q = &b->seqs[s];
            struct pi_bitem it = { .seq = s, .sampled = -1, .status = POWERINFER_OK, .err = "" };
            if (q->req_pending && q->cancelled) {
                if (pass == 0) {  // before its next chunk: what it computed stays in the cache
                    q->req_pending = false;
                    q->req_done    = true;
                    q->req_status  = POWERINFER_ERR_ABORTED;
                    set_err(q, "cancelled");
                    pthread_cond_broadcast(&q->cv);
                }
                continue;
            }
            if (q->req_pending) {
                const int32_t left = q->req_n - q->req_off;
                const int32_t chunk = chunk_tokens(b, q, q->req_pos + q->req_off);
                it.is_run = false;
                it.tokens = q->req_tokens + q->req_off;
                it.n      = left < chunk ? left : chunk;
                it.pos    = q->req_pos + q->req_off;
                const bool last = it.n == left;
                it.n_rows = q->req_all ? it.n : last ? 1 : 0;
                it.out    = q->req_out + (size_t) (q->req_all ? q->req_off : 0) * (size_t) b->n_vocab;
            } else if (run_ready(b, q)) {
                const int32_t chunk = q->n_in > 1 ? chunk_tokens(b, q, q->in_pos) : 1;
                it.is_run = true;
                it.smpl   = pi_sampler_retain(q->smpl);  // released after the step: stop() may let go of q's
                it.tokens = q->in;
                it.n      = q->n_in < chunk ? q->n_in : chunk;
                it.pos    = q->in_pos;
                it.n_rows = it.n == q->n_in ? 1 : 0;
            } else {
                continue;
            }
            if ((it.n == 1) != (pass == 0)) {
                continue;
            }
            b->items[n++] = it;
        }
    }
    return n;
}

// Items [i0, i1) as one powerinfer_decode_batch, under ctx_mu; then the requests' rows are
// copied out and the runs sampled.
// Returns POWERINFER_ERR_ABORTED when a restart interrupted it: nothing is left of it (the
// cells are free, no row copied, nothing sampled), and the items go into the next step.
static int32_t compute_group(struct powerinfer_batcher * b, struct pi_bitem * items, int32_t n_items) {
    struct powerinfer_context * ctx = b->ctx;
    int32_t n_tok = 0;
    for (int32_t i = 0; i < n_items; ++i) {
        n_tok += items[i].n;
    }
    int32_t rc = grow_batch(b, n_tok);
    // Cells from pos on are overwritten, as by powerinfer_decode: the sequence forgets them.
    int32_t k = 0, row = 0;
    for (int32_t i = 0; i < n_items && rc == POWERINFER_OK; ++i) {
        struct pi_bitem * it = &items[i];
        const int32_t n_cached = powerinfer_kv_seq_pos_max(ctx, it->seq) + 1;
        if (it->pos > n_cached) {
            it->status = pi_fail(POWERINFER_ERR_INVALID_ARG, "position %d is past the %d cached positions of sequence %d",
                                 it->pos, n_cached, it->seq);
            snprintf(it->err, sizeof(it->err), "%s", powerinfer_last_error());
            continue;
        }
        if (it->pos < n_cached) {
            powerinfer_kv_seq_rm(ctx, it->seq, it->pos, -1);
        }
        for (int32_t j = 0; j < it->n; ++j) {
            b->b_tok[k + j]    = it->tokens[j];
            b->b_seq[k + j]    = it->seq;
            b->b_logits[k + j] = j >= it->n - it->n_rows;
        }
        it->row = row;
        row += it->n_rows;
        k += it->n;
    }
    if (rc == POWERINFER_OK && k > 0) {
        const double t0 = pi_time_ms();
        struct powerinfer_batch batch = { .n_tokens = k, .token = b->b_tok, .pos = NULL, .seq_id = b->b_seq,
                                          .logits = b->b_logits };
        rc = powerinfer_decode_batch(ctx, batch);
        const double dt = pi_time_ms() - t0;
        // The counters are read under mu (a monitoring read never waits for a step).
        pthread_mutex_lock(&b->mu);
        if (rc == POWERINFER_ERR_ABORTED) {
            b->stats.n_restarts += 1;
            b->stats.restart_ms += dt;
            pthread_mutex_unlock(&b->mu);
            return rc;
        }
        for (int32_t i = 0; i < n_items; ++i) {
            if (items[i].status != POWERINFER_OK) {
                continue;
            }
            if (items[i].n == 1) {
                b->stats.n_gen_tokens += 1;
                continue;
            }
            b->stats.n_prompt_tokens += items[i].n;
            b->stats.n_prompt_chunks += 1;
            if (rc == POWERINFER_OK) {  // what the next chunk of this prompt is sized by
                struct pi_bseq * q = &b->seqs[items[i].seq];
                q->chunk_pos[1] = items[i].pos + 0.5 * items[i].n;
                q->chunk_ms[1]  = dt / k;
                q->chunk_last   = items[i].n;
                if (q->n_chunks++ == 0) {  // the first is also the last
                    q->chunk_pos[0] = q->chunk_pos[1];
                    q->chunk_ms[0]  = q->chunk_ms[1];
                }
            }
        }
        b->step_ms = b->step_ms == 0.0 ? dt : 0.8 * b->step_ms + 0.2 * dt;
        b->stats.n_steps += 1;
        b->stats.busy_ms += dt;
        b->stats.max_step_ms = dt > b->stats.max_step_ms ? dt : b->stats.max_step_ms;
        if (k > b->stats.max_batch_tokens) b->stats.max_batch_tokens = k;
        if (rc == POWERINFER_OK) {
            b->stats.kv_cells_used = powerinfer_kv_used_cells(ctx);
            int64_t active = 0, total = 0;
            for (int32_t il = 0; il < ctx->model->hp.n_layer; ++il) {
                int64_t a = 0, t = 0;
                if (powerinfer_sparse_stats(ctx, il, &a, &t) == POWERINFER_OK) {
                    active += a;
                    total += t;
                }
            }
            b->stats.sparse_active = active;
            b->stats.sparse_total  = total;
        }
        pthread_mutex_unlock(&b->mu);
    }
    for (int32_t i = 0; i < n_items; ++i) {
        struct pi_bitem * it = &items[i];
        if (it->status != POWERINFER_OK) {
            continue;
        }
        if (rc != POWERINFER_OK) {
            it->status = rc;
            snprintf(it->err, sizeof(it->err), "%s", powerinfer_last_error());
            continue;
        }
        if (it->n_rows == 0) {
            continue;  // a prompt's chunk before its last: nothing to copy or sample yet
        }
        if (it->is_run) {
            // The sampler is the run's until powerinfer_batcher_stop returns, which waits for ctx_mu.
            it->sampled = powerinfer_sampler_sample(it->smpl, ctx, it->row);
            if (it->sampled < 0) {
                it->status = powerinfer_last_status() != POWERINFER_OK ? powerinfer_last_status() : POWERINFER_ERR_INTERNAL;
                snprintf(it->err, sizeof(it->err), "sampling failed: %s", powerinfer_last_error());
            }
        } else {
            const float * src = powerinfer_get_logits_ith(ctx, it->row);
            memcpy(it->out, src, (size_t) it->n_rows * (size_t) b->n_vocab * sizeof(float));
        }
    }
    return POWERINFER_OK;
}

static bool abort_requested(void * data) {
    struct powerinfer_batcher * b = data;
    return atomic_load_explicit(&b->abort, memory_order_relaxed);
}

// A new request has come (the caller holds mu): interrupt the group under way if it began
// recently enough (see the file's header).
static void maybe_restart(struct powerinfer_batcher * b) {
    if (b->restartable && pi_time_ms() < b->restart_until) {
        b->restartable = false;
        atomic_store_explicit(&b->abort, true, memory_order_relaxed);
    }
}

static bool is_stop(const struct powerinfer_batcher * b, const struct pi_bseq * q, powerinfer_token t) {
    for (int32_t i = 0; i < q->n_stop; ++i) {
        if (q->stop[i] == t) {
            return true;
        }
    }
    return powerinfer_token_is_eog(b->ctx->model, t);
}

// The results of items, under mu: requests are done, runs hand over their token and go on.
static void publish(struct powerinfer_batcher * b, const struct pi_bitem * items, int32_t n_items) {
    for (int32_t i = 0; i < n_items; ++i) {
        const struct pi_bitem * it = &items[i];
        struct pi_bseq * q = &b->seqs[it->seq];
        if (it->status != POWERINFER_OK) {
            set_err(q, it->err);
        }
        if (!it->is_run && it->status == POWERINFER_OK && q->req_off + it->n < q->req_n) {
            q->req_off += it->n;  // more chunks to come: the caller goes on waiting
            continue;
        }
        if (!it->is_run) {
            q->req_pending = false;
            q->req_done    = true;
            q->req_status  = it->status == POWERINFER_OK ? it->n_rows : it->status;
            pthread_cond_broadcast(&q->cv);
            continue;
        }
        if (!q->running) {
            continue;  // stopped meanwhile: powerinfer_batcher_stop trims what was computed
        }
        if (it->status != POWERINFER_OK) {
            q->running    = false;
            q->end_status = it->status;
            q->n_in       = 0;
            pthread_cond_broadcast(&q->cv);
            continue;
        }
        if (it->n_rows == 0) {  // a chunk of its prompt: the rest goes into the next steps
            memmove(q->in, q->in + it->n, (size_t) (q->n_in - it->n) * sizeof(*q->in));
            q->n_in -= it->n;
            q->in_pos += it->n;
            continue;
        }
        const int32_t lookahead = b->params.lookahead;
        q->out[(q->out_head + q->n_out) % lookahead] = it->sampled;
        q->n_out += 1;
        const int32_t next_pos = it->pos + it->n;
        if (q->n_left > 0) q->n_left -= 1;
        if (q->n_left == 0 || next_pos >= q->pos_limit || is_stop(b, q, it->sampled)) {
            q->running    = false;  // the last token sampled is not decoded
            q->end_status = POWERINFER_OK;
            q->n_in       = 0;
        } else {
            q->in[0]  = it->sampled;
            q->n_in   = 1;
            q->in_pos = next_pos;
        }
        pthread_cond_broadcast(&q->cv);
    }
}

static void * run(void * arg) {
    struct powerinfer_batcher * b = arg;
    pthread_mutex_lock(&b->mu);
    for (;;) {
        while (!b->quit && !has_work(b)) {
            pthread_cond_wait(&b->work_cv, &b->mu);
        }
        if (b->quit) {
            break;
        }
        // Let the lockstep sequences ask for their next decode, for one step's time at most;
        // not while sequences running ahead are ready (they would wait for Python: a lockstep
        // request that comes late joins the next step).
        if (lockstep_missing(b) > 0 && !any_run_ready(b)) {
            double wait_ms = b->step_ms < b->params.max_gather_ms ? b->step_ms : b->params.max_gather_ms;
            struct timespec until;
            deadline_after(&until, wait_ms);
            while (!b->quit && lockstep_missing(b) > 0) {
                if (pthread_cond_timedwait(&b->work_cv, &b->mu, &until) == ETIMEDOUT) {
                    break;
                }
            }
            if (b->quit) {
                break;
            }
        }
        // A caller waiting for the context (a KV edit, a stop) gets it before this step: a
        // mutex hands itself to whoever asks first, and that would be this thread, step
        // after step.
        while (!b->quit && b->n_ctx_waiters > 0) {
            pthread_cond_wait(&b->work_cv, &b->mu);
        }
        if (b->quit) {
            break;
        }
        const int32_t n_items = collect(b);
        if (n_items == 0) {
            continue;  // what there was to do went away meanwhile (a stop)
        }
        // Take the context before letting go of mu: see the file's header.
        pthread_mutex_lock(&b->ctx_mu);
        apply_edits(b);
        // Groups: the whole step for a dense model; with a sparse model at most
        // sparse_max_batch tokens each, and a longer request or a sequence's first token alone.
        // mu is held between groups, let go while one computes.
        int32_t i = 0;
        bool interrupted = false;
        while (i < n_items) {
            int32_t j = i + 1, n_tok = b->items[i].n;
            const bool alone = !b->dense && (b->items[i].n > b->sparse_max_batch || b->items[i].pos == 0);
            while (!alone && j < n_items) {
                const struct pi_bitem * it = &b->items[j];
                if (!b->dense && (it->n > b->sparse_max_batch || it->pos == 0 || n_tok + it->n > b->sparse_max_batch)) {
                    break;
                }
                n_tok += it->n;
                ++j;
            }
            b->restartable = b->dense && !b->no_restart && b->params.restart_within > 0.0f && b->step_ms > 0.0;
            b->restart_until = pi_time_ms() + b->params.restart_within * b->step_ms;
            atomic_store_explicit(&b->abort, false, memory_order_relaxed);
            pthread_mutex_unlock(&b->mu);
            const int32_t rc = compute_group(b, b->items + i, j - i);
            pthread_mutex_lock(&b->mu);
            b->restartable = false;
            if (rc == POWERINFER_ERR_ABORTED) {
                interrupted = true;  // its items (and any after) are collected again
                break;
            }
            publish(b, b->items + i, j - i);
            i = j;
        }
        b->no_restart = interrupted;
        for (int32_t k = 0; k < n_items; ++k) {
            powerinfer_sampler_free(b->items[k].smpl);  // the step's references (NULL for requests)
        }
        pthread_mutex_unlock(&b->ctx_mu);
    }
    // Closing: nothing more will be computed.
    for (int32_t s = 0; s < b->n_seq; ++s) {
        struct pi_bseq * q = &b->seqs[s];
        if (q->req_pending) {
            q->req_pending = false;
            q->req_done    = true;
            q->req_status  = POWERINFER_ERR_INVALID_ARG;
            set_err(q, "the batcher was closed");
        }
        if (q->running) {
            q->running    = false;
            q->end_status = POWERINFER_ERR_INVALID_ARG;
            set_err(q, "the batcher was closed");
        }
        pthread_cond_broadcast(&q->cv);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

struct powerinfer_batcher * powerinfer_batcher_new(struct powerinfer_context * ctx, struct powerinfer_batcher_params params) {
    pi_clear_error();
    if (!ctx) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_batcher_new: context is NULL");
        return NULL;
    }
    if (params.lookahead < 1 || params.lookahead > 4096) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "lookahead = %d must be in [1, 4096]", params.lookahead);
        return NULL;
    }
    if (!(params.max_gather_ms >= 0.0f && params.max_gather_ms <= 10000.0f)) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "max_gather_ms = %g must be in [0, 10000]", params.max_gather_ms);
        return NULL;
    }
    if (!(params.restart_within >= 0.0f && params.restart_within <= 1.0f)) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "restart_within = %g must be in [0, 1]", params.restart_within);
        return NULL;
    }
    if (!(params.prompt_slice_ms <= 1e6f)) {  // NaN too
        pi_fail(POWERINFER_ERR_INVALID_ARG, "prompt_slice_ms = %g must be at most 1e6", params.prompt_slice_ms);
        return NULL;
    }
    struct powerinfer_batcher * b = calloc(1, sizeof(*b));
    if (!b) {
        pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
        return NULL;
    }
    b->ctx              = ctx;
    b->params           = params;
    b->n_seq            = (int32_t) ctx->kv.n_seq_max;
    b->n_vocab          = ctx->model->hp.n_vocab;
    b->dense            = ctx->model->hp.sparse_mode == POWERINFER_SPARSE_DENSE;
    b->sparse_max_batch = powerinfer_sparse_max_batch(ctx);
    b->n_batch          = powerinfer_n_batch(ctx);
    b->seqs             = calloc((size_t) b->n_seq, sizeof(*b->seqs));
    b->items            = calloc((size_t) b->n_seq, sizeof(*b->items));
    bool ok = b->seqs && b->items;
    for (int32_t s = 0; ok && s < b->n_seq; ++s) {
        b->seqs[s].out = malloc((size_t) params.lookahead * sizeof(powerinfer_token));
        ok = b->seqs[s].out != NULL;
    }
    if (!ok) {
        pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
        if (b->seqs) {
            for (int32_t s = 0; s < b->n_seq; ++s) free(b->seqs[s].out);
        }
        free(b->seqs);
        free(b->items);
        free(b);
        return NULL;
    }
    pthread_mutex_init(&b->mu, NULL);
    pthread_mutex_init(&b->ctx_mu, NULL);
    pthread_cond_init(&b->work_cv, NULL);
    pthread_cond_init(&b->left_cv, NULL);
    for (int32_t s = 0; s < b->n_seq; ++s) {
        pthread_cond_init(&b->seqs[s].cv, NULL);
    }
    if (pthread_create(&b->thread, NULL, run, b) != 0) {
        pi_fail(POWERINFER_ERR_INTERNAL, "could not start the batcher's thread");
        powerinfer_batcher_free(b);
        return NULL;
    }
    b->started = b->started_once = true;
    pi_context_retain(ctx);  // released by powerinfer_batcher_free
    pi_context_set_abort(ctx, abort_requested, b);
    return b;
}

void powerinfer_batcher_close(struct powerinfer_batcher * b) {
    if (!b) {
        return;
    }
    pthread_mutex_lock(&b->mu);
    if (b->closed) {
        pthread_mutex_unlock(&b->mu);
        return;
    }
    const bool first = !b->quit;
    b->quit = true;
    pthread_cond_broadcast(&b->work_cv);
    pthread_mutex_unlock(&b->mu);
    if (first && b->started) {
        pthread_join(b->thread, NULL);  // the step under way ends first: its samplers are free after this
        b->started = false;
        pi_context_set_abort(b->ctx, NULL, NULL);
    }
    // Callers still inside a call have been woken with an error: let them leave.
    pthread_mutex_lock(&b->mu);
    for (int32_t s = 0; s < b->n_seq; ++s) {
        pthread_cond_broadcast(&b->seqs[s].cv);
    }
    while (b->n_inside > 0) {
        pthread_cond_wait(&b->left_cv, &b->mu);
    }
    for (int32_t s = 0; s < b->n_seq; ++s) {
        powerinfer_sampler_free(b->seqs[s].smpl);  // nothing samples any more
        b->seqs[s].smpl = NULL;
    }
    b->closed = true;
    pthread_mutex_unlock(&b->mu);
}

void powerinfer_batcher_free(struct powerinfer_batcher * b) {
    if (!b) {
        return;
    }
    powerinfer_batcher_close(b);
    for (int32_t s = 0; s < b->n_seq; ++s) {
        pthread_cond_destroy(&b->seqs[s].cv);
        free(b->seqs[s].out);
        free(b->seqs[s].in);
        free(b->seqs[s].stop);
    }
    pthread_cond_destroy(&b->work_cv);
    pthread_cond_destroy(&b->left_cv);
    pthread_mutex_destroy(&b->mu);
    pthread_mutex_destroy(&b->ctx_mu);
    free(b->seqs);
    free(b->items);
    free(b->edits);
    free(b->b_tok);
    free(b->b_seq);
    free(b->b_logits);
    if (b->started_once) {
        powerinfer_context_free(b->ctx);  // the batcher's reference
    }
    free(b);
}

static int32_t check_seq(const struct powerinfer_batcher * b, int32_t seq, const char * what) {
    if (!b) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "%s: batcher is NULL", what);
    }
    if (seq < 0 || seq >= b->n_seq) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "%s: sequence %d is outside [0, %d)", what, seq, b->n_seq);
    }
    return POWERINFER_OK;
}

static int32_t check_tokens(const struct powerinfer_batcher * b, const powerinfer_token * tokens, int32_t n, int32_t pos,
                            const char * what) {
    if (!tokens || n <= 0) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "%s: no tokens given", what);
    }
    if (pos < 0) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "%s: position %d is negative", what, pos);
    }
    for (int32_t i = 0; i < n; ++i) {
        if (tokens[i] < 0 || tokens[i] >= b->n_vocab) {
            return pi_fail(POWERINFER_ERR_INVALID_ARG, "%s: token %d = %d is outside the vocabulary [0, %d)", what, i,
                           tokens[i], b->n_vocab);
        }
    }
    return POWERINFER_OK;
}

static bool busy(const struct pi_bseq * q) {
    return q->req_pending || q->running;
}

// A caller leaves a call (under mu): the last one out lets a closing batcher go on.
static void leave(struct powerinfer_batcher * b) {
    b->n_inside -= 1;
    if (b->quit) pthread_cond_broadcast(&b->left_cv);
}

int32_t powerinfer_batcher_decode(struct powerinfer_batcher * b, int32_t seq, const powerinfer_token * tokens,
                                  int32_t n_tokens, int32_t pos, bool logits_all, float * logits, int32_t n_rows_max) {
    pi_clear_error();
    int32_t rc = check_seq(b, seq, "powerinfer_batcher_decode");
    if (rc == POWERINFER_OK) rc = check_tokens(b, tokens, n_tokens, pos, "powerinfer_batcher_decode");
    if (rc != POWERINFER_OK) {
        return rc;
    }
    const int32_t n_rows = logits_all ? n_tokens : 1;
    if (!logits || n_rows_max < n_rows) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_batcher_decode: room for %d logits rows, %d needed",
                       logits ? n_rows_max : 0, n_rows);
    }
    pthread_mutex_lock(&b->mu);
    struct pi_bseq * q = &b->seqs[seq];
    if (b->quit || busy(q)) {
        pthread_mutex_unlock(&b->mu);
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_batcher_decode: %s", b->quit ? "the batcher was closed"
                       : "the sequence is decoding or running ahead already");
    }
    if (q->cancelled) {
        pthread_mutex_unlock(&b->mu);
        return pi_fail(POWERINFER_ERR_ABORTED, "powerinfer_batcher_decode: sequence %d is cancelled", seq);
    }
    q->req_pending  = true;
    q->req_done     = false;
    q->req_tokens   = tokens;
    q->req_n        = n_tokens;
    q->req_pos      = pos;
    q->req_all      = logits_all;
    q->req_out      = logits;
    q->req_off      = 0;
    q->n_chunks     = 0;
    if (n_tokens > 1) {
        maybe_restart(b);
    }
    pthread_cond_signal(&b->work_cv);
    b->n_inside += 1;
    while (!q->req_done) {
        pthread_cond_wait(&q->cv, &b->mu);
    }
    rc = q->req_status;
    q->req_done = false;
    if (rc < 0) {
        pi_fail(rc, "%s", q->err);
    }
    leave(b);
    pthread_mutex_unlock(&b->mu);
    return rc;
}

// *buf holds at least n tokens (false: out of memory, *buf unchanged).
static bool grow_tokens(powerinfer_token ** buf, int32_t * cap, int32_t n) {
    if (*cap >= n) {
        return true;
    }
    powerinfer_token * p = realloc(*buf, (size_t) n * sizeof(*p));
    if (!p) {
        return false;
    }
    *buf = p;
    *cap = n;
    return true;
}

int32_t powerinfer_batcher_generate(struct powerinfer_batcher * b, int32_t seq, const powerinfer_token * tokens,
                                    int32_t n_tokens, int32_t pos, struct powerinfer_sampler * smpl,
                                    int32_t n_predict, int32_t pos_limit,
                                    const powerinfer_token * stop_tokens, int32_t n_stop_tokens) {
    pi_clear_error();
    int32_t rc = check_seq(b, seq, "powerinfer_batcher_generate");
    if (rc == POWERINFER_OK) rc = check_tokens(b, tokens, n_tokens, pos, "powerinfer_batcher_generate");
    if (rc == POWERINFER_OK && n_stop_tokens > 0) rc = check_tokens(b, stop_tokens, n_stop_tokens, 0, "powerinfer_batcher_generate (stop tokens)");
    if (rc == POWERINFER_OK && n_stop_tokens < 0) rc = pi_fail(POWERINFER_ERR_INVALID_ARG, "n_stop_tokens = %d", n_stop_tokens);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    if (!smpl) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_batcher_generate: sampler is NULL");
    }
    if (pos + n_tokens > pos_limit) {
        return pi_fail(POWERINFER_ERR_CONTEXT_FULL, "powerinfer_batcher_generate: %d tokens at position %d pass the "
                       "position limit %d", n_tokens, pos, pos_limit);
    }
    pthread_mutex_lock(&b->mu);
    struct pi_bseq * q = &b->seqs[seq];
    if (b->quit || busy(q) || q->n_out > 0) {
        pthread_mutex_unlock(&b->mu);
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_batcher_generate: %s", b->quit ? "the batcher was closed"
                       : "the sequence is decoding or running ahead already (stop it first)");
    }
    if (q->cancelled) {
        pthread_mutex_unlock(&b->mu);
        return pi_fail(POWERINFER_ERR_ABORTED, "powerinfer_batcher_generate: sequence %d is cancelled", seq);
    }
    if (!grow_tokens(&q->in, &q->in_cap, n_tokens) || !grow_tokens(&q->stop, &q->stop_cap, n_stop_tokens)) {
        pthread_mutex_unlock(&b->mu);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    if (n_stop_tokens > 0) {
        memcpy(q->stop, stop_tokens, (size_t) n_stop_tokens * sizeof(*stop_tokens));
    }
    q->n_stop = n_stop_tokens;
    memcpy(q->in, tokens, (size_t) n_tokens * sizeof(*tokens));
    q->n_in       = n_tokens;
    q->in_pos     = pos;
    q->n_chunks   = 0;
    powerinfer_sampler_free(q->smpl);  // the last run's, if stop() was not called
    q->smpl       = pi_sampler_retain(smpl);
    q->n_left     = n_predict > 0 ? n_predict : -1;
    q->pos_limit  = pos_limit;
    q->out_head   = 0;
    q->n_out      = 0;
    q->end_status = POWERINFER_OK;
    q->running    = true;
    maybe_restart(b);
    pthread_cond_signal(&b->work_cv);
    pthread_mutex_unlock(&b->mu);
    return POWERINFER_OK;
}

int32_t powerinfer_batcher_next(struct powerinfer_batcher * b, int32_t seq, powerinfer_token * tokens, int32_t n_max) {
    pi_clear_error();
    int32_t rc = check_seq(b, seq, "powerinfer_batcher_next");
    if (rc != POWERINFER_OK) {
        return rc;
    }
    if (!tokens || n_max < 1) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_batcher_next: no room for tokens");
    }
    pthread_mutex_lock(&b->mu);
    struct pi_bseq * q = &b->seqs[seq];
    b->n_inside += 1;
    while (q->n_out == 0 && q->running) {
        pthread_cond_wait(&q->cv, &b->mu);
    }
    if (q->n_out > 0) {
        const bool was_full = q->n_out >= b->params.lookahead;
        const int32_t lookahead = b->params.lookahead;
        int32_t n = q->n_out < n_max ? q->n_out : n_max;
        for (int32_t i = 0; i < n; ++i) {
            tokens[i] = q->out[(q->out_head + i) % lookahead];
        }
        q->out_head = (q->out_head + n) % lookahead;
        q->n_out -= n;
        if (was_full && q->running) {
            pthread_cond_signal(&b->work_cv);  // it may run ahead again
        }
        rc = n;
    } else {
        rc = q->end_status;
        if (rc < 0) {
            pi_fail(rc, "%s", q->err);
        }
    }
    leave(b);
    pthread_mutex_unlock(&b->mu);
    return rc;
}

// ctx_mu for a caller, ahead of the thread's next step (it waits while n_ctx_waiters > 0),
// counted in n_inside until ctx_release. The queued edits are applied first, so the caller
// sees them. Fails (nothing held) once the batcher is closing.
static int32_t ctx_acquire(struct powerinfer_batcher * b, const char * what) {
    pthread_mutex_lock(&b->mu);
    if (b->quit) {
        pthread_mutex_unlock(&b->mu);
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "%s: the batcher was closed", what);
    }
    b->n_inside += 1;
    b->n_ctx_waiters += 1;
    pthread_mutex_unlock(&b->mu);
    pthread_mutex_lock(&b->ctx_mu);
    pthread_mutex_lock(&b->mu);
    b->n_ctx_waiters -= 1;
    apply_edits(b);
    pthread_cond_broadcast(&b->work_cv);
    pthread_mutex_unlock(&b->mu);
    return POWERINFER_OK;
}

static void ctx_release(struct powerinfer_batcher * b) {
    pthread_mutex_unlock(&b->ctx_mu);
    pthread_mutex_lock(&b->mu);
    leave(b);
    pthread_mutex_unlock(&b->mu);
}

static int32_t queue_edit(struct powerinfer_batcher * b, int32_t seq, int32_t src, int32_t n, const char * what) {
    pi_clear_error();
    int32_t rc = check_seq(b, seq, what);
    if (rc == POWERINFER_OK && src >= 0) rc = check_seq(b, src, what);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    if (n < 0) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "%s: %d positions", what, n);
    }
    pthread_mutex_lock(&b->mu);
    if (b->quit) {
        pthread_mutex_unlock(&b->mu);
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "%s: the batcher was closed", what);
    }
    if (b->n_edits == b->edits_cap) {
        const int32_t cap = b->edits_cap ? 2 * b->edits_cap : 16;
        struct pi_bedit * e = realloc(b->edits, (size_t) cap * sizeof(*e));
        if (!e) {
            pthread_mutex_unlock(&b->mu);
            return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
        }
        b->edits     = e;
        b->edits_cap = cap;
    }
    b->edits[b->n_edits++] = (struct pi_bedit) { .seq = seq, .src = src, .n = n };
    pthread_mutex_unlock(&b->mu);
    return POWERINFER_OK;
}

int32_t powerinfer_batcher_kv_keep(struct powerinfer_batcher * b, int32_t seq, int32_t n_keep) {
    return queue_edit(b, seq, -1, n_keep, "powerinfer_batcher_kv_keep");
}

int32_t powerinfer_batcher_kv_share(struct powerinfer_batcher * b, int32_t dst, int32_t src, int32_t n) {
    if (b && dst == src) {
        return powerinfer_batcher_kv_keep(b, dst, n);
    }
    return queue_edit(b, dst, src, n, "powerinfer_batcher_kv_share");
}

int32_t powerinfer_batcher_stop(struct powerinfer_batcher * b, int32_t seq, int32_t n_keep) {
    pi_clear_error();
    int32_t rc = check_seq(b, seq, "powerinfer_batcher_stop");
    if (rc != POWERINFER_OK) {
        return rc;
    }
    pthread_mutex_lock(&b->mu);
    struct pi_bseq * q = &b->seqs[seq];
    q->running  = false;
    q->n_in     = 0;
    q->n_out    = 0;
    q->out_head = 0;
    powerinfer_sampler_free(q->smpl);  // a step that took it holds its own reference
    q->smpl     = NULL;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&b->mu);
    // A step that took the sequence's tokens before the stop ends before ctx_mu is free.
    // Closed: the thread has ended, nothing uses the sampler, and the cache is not ours to trim.
    if ((rc = ctx_acquire(b, "powerinfer_batcher_stop")) != POWERINFER_OK) {
        return rc;
    }
    if (n_keep >= 0) {
        rc = powerinfer_kv_seq_rm(b->ctx, seq, n_keep, -1);
    }
    ctx_release(b);
    return rc;
}

int32_t powerinfer_batcher_set_cancelled(struct powerinfer_batcher * b, int32_t seq, bool on) {
    pi_clear_error();
    int32_t rc = check_seq(b, seq, "powerinfer_batcher_set_cancelled");
    if (rc != POWERINFER_OK) {
        return rc;
    }
    pthread_mutex_lock(&b->mu);
    struct pi_bseq * q = &b->seqs[seq];
    q->cancelled = on;
    if (on && q->running) {
        // Ends like an error: the tokens sampled are still handed over, then the status. The
        // step computing for it (if any) finishes; publish() drops what it sampled.
        q->running    = false;
        q->n_in       = 0;
        q->end_status = POWERINFER_ERR_ABORTED;
        set_err(q, "cancelled");
        pthread_cond_broadcast(&q->cv);
    }
    if (on && q->req_pending) {
        pthread_cond_signal(&b->work_cv);  // collect() answers it before its next chunk
    }
    pthread_mutex_unlock(&b->mu);
    return POWERINFER_OK;
}

int32_t powerinfer_batcher_set_lockstep(struct powerinfer_batcher * b, int32_t seq, bool on) {
    pi_clear_error();
    int32_t rc = check_seq(b, seq, "powerinfer_batcher_set_lockstep");
    if (rc != POWERINFER_OK) {
        return rc;
    }
    pthread_mutex_lock(&b->mu);
    b->seqs[seq].lockstep = on;
    pthread_cond_signal(&b->work_cv);  // a step may be waiting for it
    pthread_mutex_unlock(&b->mu);
    return POWERINFER_OK;
}

int32_t powerinfer_batcher_lock(struct powerinfer_batcher * b) {
    pi_clear_error();
    if (!b) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_batcher_lock: batcher is NULL");
    }
    return ctx_acquire(b, "powerinfer_batcher_lock");
}

void powerinfer_batcher_unlock(struct powerinfer_batcher * b) {
    if (b) ctx_release(b);
}

struct powerinfer_batcher_stats powerinfer_batcher_get_stats(struct powerinfer_batcher * b) {
    struct powerinfer_batcher_stats st = { 0 };
    if (b) {
        pthread_mutex_lock(&b->mu);  // the thread updates them under mu, between steps' computations
        st = b->stats;
        pthread_mutex_unlock(&b->mu);
    }
    return st;
}
