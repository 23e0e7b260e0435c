// state.c - saving and restoring a context's state (cached keys/values of the
// positions in use and the last logits), for llama-cpp-python's save_state/load_state.
// A state holds one sequence's positions 0..n_pos-1 in position order: those of a
// one-sequence context (cells 0..n_pos-1), or of one sequence of a context with several
// (a ParallelLlama slot, wherever its cells are; no logits, they belong to the batcher).
#include "powerinfer-impl.h"

#include <stdlib.h>
#include <string.h>

#define PI_STATE_MAGIC   "PIST"
#define PI_STATE_VERSION 1u

struct pi_state_header {
    char     magic[4];
    uint32_t version;
    uint32_t n_layer;
    uint32_t n_embd_kv;
    uint32_t n_vocab;
    uint32_t n_embd;
    int32_t  n_pos;
    int32_t  n_outputs;
    uint32_t has_embd;
    uint64_t model_bytes;  // weights size: a cheap check that the state is for this model
};

// Positions the state of this context holds; -1 (with the error set) when the cache holds
// something else than a one-sequence prefix.
static int32_t state_n_pos(const struct powerinfer_context * ctx) {
    int32_t n_pos = 0;
    if (!pi_kv_is_prefix_of_seq0(&ctx->kv, &n_pos)) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "the KV cache holds several sequences; a state file holds only one");
        return -1;
    }
    return n_pos;
}

static size_t kv_bytes(const struct powerinfer_context * ctx, int32_t n_pos) {
    const struct pi_kv_cache * kv = &ctx->kv;
    size_t n = 0;
    for (int32_t il = 0; il < ctx->model->hp.n_layer; ++il) {
        n += (size_t) n_pos * (ggml_row_size(kv->k[il]->type, kv->k[il]->ne[0]) +
                                   ggml_row_size(kv->v[il]->type, kv->v[il]->ne[kv->v_trans ? 1 : 0]));
    }
    return n;
}


static size_t state_size(const struct powerinfer_context * ctx, int32_t n_pos, int32_t n_outputs) {
    const struct pi_hparams * hp = &ctx->model->hp;
    return sizeof(struct pi_state_header) + kv_bytes(ctx, n_pos) +
           (size_t) n_outputs * sizeof(float) * (hp->n_vocab + (ctx->embd ? hp->n_embd : 0));
}

size_t powerinfer_state_size(const struct powerinfer_context * ctx) {
    const int32_t n_pos = state_n_pos(ctx);
    return n_pos < 0 ? 0 : state_size(ctx, n_pos, ctx->n_outputs);
}

static void copy_bytes(struct ggml_tensor * t, uint8_t * buf, size_t off, size_t len, bool save) {
    if (save) ggml_backend_tensor_get(t, buf, off, len);
    else      ggml_backend_tensor_set(t, buf, off, len);
}

// Positions from i on whose cells follow each other (cells NULL: position p in cell p).
static int32_t run_len(const int32_t * cells, int32_t i, int32_t n_pos) {
    if (!cells) {
        return n_pos - i;
    }
    int32_t n = 1;
    while (i + n < n_pos && cells[i + n] == cells[i] + n) {
        ++n;
    }
    return n;
}

// Copies positions 0..n_pos-1 of one layer's K and V (position p in cell cells[p]; cells
// NULL: in cell p) between the cache and buf (save: to buf), in position order.
static size_t copy_layer(const struct pi_kv_cache * kv, int32_t n_pos, const int32_t * cells, int32_t il, uint8_t * buf,
                         bool save) {
    struct ggml_tensor * k = kv->k[il], * v = kv->v[il];
    size_t off = 0;
    for (int32_t i = 0, n; i < n_pos; i += n) {
        n = run_len(cells, i, n_pos);
        const size_t c0 = (size_t) (cells ? cells[i] : i);
        copy_bytes(k, buf + off, c0 * k->nb[1], (size_t) n * k->nb[1], save);
        off += (size_t) n * k->nb[1];
    }
    if (kv->v_trans) {
        // One row per channel; the positions' cells of each.
        const size_t es = ggml_element_size(v);
        for (int64_t ch = 0; ch < v->ne[1]; ++ch) {
            for (int32_t i = 0, n; i < n_pos; i += n) {
                n = run_len(cells, i, n_pos);
                const size_t c0 = (size_t) (cells ? cells[i] : i);
                copy_bytes(v, buf + off, ch * v->nb[1] + c0 * es, (size_t) n * es, save);
                off += (size_t) n * es;
            }
        }
    } else {
        for (int32_t i = 0, n; i < n_pos; i += n) {
            n = run_len(cells, i, n_pos);
            const size_t c0 = (size_t) (cells ? cells[i] : i);
            copy_bytes(v, buf + off, c0 * v->nb[1], (size_t) n * v->nb[1], save);
            off += (size_t) n * v->nb[1];
        }
    }
    return off;
}

static struct pi_state_header make_header(const struct powerinfer_context * ctx, int32_t n_pos) {
    const struct pi_hparams * hp = &ctx->model->hp;
    struct pi_state_header h = {
        .version     = PI_STATE_VERSION,
        .n_layer     = (uint32_t) hp->n_layer,
        .n_embd_kv   = (uint32_t) ctx->kv.k[0]->ne[0],
        .n_vocab     = (uint32_t) hp->n_vocab,
        .n_embd      = (uint32_t) hp->n_embd,
        .n_pos       = n_pos,
        .n_outputs   = ctx->n_outputs,
        .has_embd    = ctx->embd != NULL,
        .model_bytes = ctx->model->n_bytes,
    };
    memcpy(h.magic, PI_STATE_MAGIC, 4);
    return h;
}

size_t powerinfer_state_save(const struct powerinfer_context * ctx, uint8_t * dst, size_t dst_size) {
    const int32_t n_pos = state_n_pos(ctx);
    if (n_pos < 0) {
        return 0;
    }
    const size_t need = state_size(ctx, n_pos, ctx->n_outputs);
    if (!dst || dst_size < need) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "state buffer of %zu bytes is smaller than the %zu needed", dst_size, need);
        return 0;
    }
    struct pi_state_header h = make_header(ctx, n_pos);
    memcpy(dst, &h, sizeof(h));
    size_t off = sizeof(h);
    for (int32_t il = 0; il < ctx->model->hp.n_layer; ++il) {
        off += copy_layer(&ctx->kv, n_pos, NULL, il, dst + off, true);
    }
    const size_t n_logits = (size_t) ctx->n_outputs * ctx->model->hp.n_vocab * sizeof(float);
    memcpy(dst + off, ctx->logits, n_logits);
    off += n_logits;
    if (ctx->embd) {
        const size_t n_embd = (size_t) ctx->n_outputs * ctx->model->hp.n_embd * sizeof(float);
        memcpy(dst + off, ctx->embd, n_embd);
        off += n_embd;
    }
    return off;
}

// Reads and checks the header of src_size bytes of state data for this context: its model
// and configuration, its positions (at most this context's cells) and its size.
static int32_t read_header(const struct powerinfer_context * ctx, const uint8_t * src, size_t src_size,
                           struct pi_state_header * h) {
    if (!src || src_size < sizeof(*h)) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "state data is too short (%zu bytes)", src_size);
    }
    memcpy(h, src, sizeof(*h));
    const struct pi_state_header want = make_header(ctx, 0);
    if (memcmp(h->magic, PI_STATE_MAGIC, 4) != 0 || h->version != PI_STATE_VERSION) {
        return pi_fail(POWERINFER_ERR_FORMAT, "not a PowerInfer-Py context state (bad magic or version)");
    }
    if (h->n_layer != want.n_layer || h->n_embd_kv != want.n_embd_kv || h->n_vocab != want.n_vocab ||
        h->n_embd != want.n_embd || h->model_bytes != want.model_bytes || h->has_embd != want.has_embd) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "the state was saved from a different model or context configuration");
    }
    if (h->n_pos < 0 || (uint32_t) h->n_pos > ctx->kv.size || h->n_outputs < 0 || h->n_outputs > h->n_pos + 1) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "the state holds %d positions; this context has %u", h->n_pos, ctx->kv.size);
    }
    // Size check with the saved counts before touching anything.
    const size_t need = state_size(ctx, h->n_pos, h->n_outputs);
    if (need != src_size) {
        return pi_fail(POWERINFER_ERR_FORMAT, "state data is %zu bytes, expected %zu", src_size, need);
    }
    return POWERINFER_OK;
}

int32_t powerinfer_state_load(struct powerinfer_context * ctx, const uint8_t * src, size_t src_size) {
    pi_clear_error();
    struct pi_state_header h;
    int32_t rc = read_header(ctx, src, src_size, &h);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    rc = pi_context_reserve_outputs(ctx, h.n_outputs);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    pi_kv_set_prefix_of_seq0(&ctx->kv, h.n_pos);
    ctx->n_outputs = h.n_outputs;
    size_t off = sizeof(h);
    for (int32_t il = 0; il < ctx->model->hp.n_layer; ++il) {
        off += copy_layer(&ctx->kv, h.n_pos, NULL, il, (uint8_t *) src + off, false);  // load only reads buf
    }
    const size_t n_logits = (size_t) h.n_outputs * h.n_vocab * sizeof(float);
    memcpy(ctx->logits, src + off, n_logits);
    off += n_logits;
    if (ctx->embd) {
        memcpy(ctx->embd, src + off, (size_t) h.n_outputs * h.n_embd * sizeof(float));
    }
    return POWERINFER_OK;
}

// ---- one sequence of several ----------------------------------------------------------

// The cells of positions 0..n-1 of sequence seq into *cells (malloc'd; NULL when n is 0),
// n its positions: each must be held by exactly one cell the sequence sees (a slot's are).
// Returns n, or a negative status with the error set.
static int32_t seq_cells(const struct powerinfer_context * ctx, int32_t seq, int32_t ** cells) {
    const struct pi_kv_cache * kv = &ctx->kv;
    *cells = NULL;
    if (seq < 0 || (uint32_t) seq >= kv->n_seq_max) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "sequence %d is out of range [0, %u)", seq, kv->n_seq_max);
    }
    const int32_t n_pos = pi_kv_seq_pos_max(kv, seq) + 1;
    if (n_pos == 0) {
        return 0;
    }
    int32_t * c = malloc((size_t) n_pos * sizeof(int32_t));
    if (!c) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate %d cell indices", n_pos);
    }
    for (int32_t p = 0; p < n_pos; ++p) {
        c[p] = -1;
    }
    const uint64_t bit = 1ull << seq;
    for (uint32_t i = 0; i < kv->hi; ++i) {
        if (kv->cell_seq[i] & bit) {
            const int32_t p = kv->cell_pos[i];
            if (c[p] >= 0) {
                free(c);
                return pi_fail(POWERINFER_ERR_INVALID_ARG, "sequence %d holds position %d twice", seq, p);
            }
            c[p] = (int32_t) i;
        }
    }
    for (int32_t p = 0; p < n_pos; ++p) {
        if (c[p] < 0) {
            free(c);
            return pi_fail(POWERINFER_ERR_INVALID_ARG, "sequence %d lacks position %d of its %d", seq, p, n_pos);
        }
    }
    *cells = c;
    return n_pos;
}

size_t powerinfer_state_seq_size(const struct powerinfer_context * ctx, int32_t seq) {
    int32_t * cells = NULL;
    const int32_t n_pos = seq_cells(ctx, seq, &cells);
    free(cells);
    return n_pos < 0 ? 0 : state_size(ctx, n_pos, 0);
}

size_t powerinfer_state_seq_save(const struct powerinfer_context * ctx, int32_t seq, uint8_t * dst, size_t dst_size) {
    int32_t * cells = NULL;
    const int32_t n_pos = seq_cells(ctx, seq, &cells);
    if (n_pos < 0) {
        return 0;
    }
    const size_t need = state_size(ctx, n_pos, 0);
    if (!dst || dst_size < need) {
        free(cells);
        pi_fail(POWERINFER_ERR_INVALID_ARG, "state buffer of %zu bytes is smaller than the %zu needed", dst_size, need);
        return 0;
    }
    struct pi_state_header h = make_header(ctx, n_pos);
    h.n_outputs = 0;
    memcpy(dst, &h, sizeof(h));
    size_t off = sizeof(h);
    for (int32_t il = 0; il < ctx->model->hp.n_layer; ++il) {
        off += copy_layer(&ctx->kv, n_pos, cells, il, dst + off, true);
    }
    free(cells);
    return off;
}

int32_t powerinfer_state_seq_load(struct powerinfer_context * ctx, int32_t seq, const uint8_t * src, size_t src_size) {
    pi_clear_error();
    struct pi_kv_cache * kv = &ctx->kv;
    if (seq < 0 || (uint32_t) seq >= kv->n_seq_max) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "sequence %d is out of range [0, %u)", seq, kv->n_seq_max);
    }
    struct pi_state_header h;
    int32_t rc = read_header(ctx, src, src_size, &h);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    // Room: the free cells and those only this sequence sees (it forgets them first).
    const uint64_t bit = 1ull << seq;
    uint32_t room = kv->size - kv->used;
    for (uint32_t i = 0; i < kv->hi; ++i) {
        room += kv->cell_seq[i] == bit;
    }
    if ((uint32_t) h.n_pos > room) {
        return pi_fail(POWERINFER_ERR_CONTEXT_FULL, "the state holds %d positions; %u cells are free", h.n_pos, room);
    }
    int32_t * buf = h.n_pos ? malloc((size_t) h.n_pos * 3 * sizeof(int32_t)) : NULL;
    if (h.n_pos && !buf) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate %d cell indices", h.n_pos);
    }
    pi_kv_seq_rm(kv, seq, 0, -1);
    if (h.n_pos) {
        int32_t * seqs = buf, * pos = buf + h.n_pos, * cells = buf + 2 * h.n_pos;
        for (int32_t p = 0; p < h.n_pos; ++p) {
            seqs[p] = seq;
            pos[p]  = p;
        }
        rc = pi_kv_place(kv, h.n_pos, seqs, pos, cells);  // cannot fail: there is room
        if (rc == POWERINFER_OK) {
            size_t off = sizeof(h);
            for (int32_t il = 0; il < ctx->model->hp.n_layer; ++il) {
                off += copy_layer(kv, h.n_pos, cells, il, (uint8_t *) src + off, false);
            }
        }
        free(buf);
    }
    return rc;  // the logits rows of a Llama's state, if any, are not the sequence's: left out
}
