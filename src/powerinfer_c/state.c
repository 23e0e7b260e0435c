// state.c - saving and restoring a context's state (cached keys/values of the
// positions in use and the last logits), for llama-cpp-python's save_state/load_state.
// A state holds one sequence in cells 0..n_pos-1, the layout of a one-sequence context.
#include "powerinfer-impl.h"

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

// Copies the used part of one layer's K and V between the cache and buf (save: to buf).
static size_t copy_layer(const struct pi_kv_cache * kv, int32_t n_pos, int32_t il, uint8_t * buf, bool save) {
    struct ggml_tensor * k = kv->k[il], * v = kv->v[il];
    size_t off = 0;
    const size_t k_len = (size_t) n_pos * k->nb[1];
    if (save) ggml_backend_tensor_get(k, buf, 0, k_len);
    else      ggml_backend_tensor_set(k, buf, 0, k_len);
    off += k_len;
    if (kv->v_trans) {
        // One row per channel; the first n_pos cells of each.
        const size_t len = (size_t) n_pos * ggml_element_size(v);
        for (int64_t c = 0; c < v->ne[1]; ++c) {
            if (save) ggml_backend_tensor_get(v, buf + off, c * v->nb[1], len);
            else      ggml_backend_tensor_set(v, buf + off, c * v->nb[1], len);
            off += len;
        }
    } else {
        const size_t v_len = (size_t) n_pos * v->nb[1];
        if (save) ggml_backend_tensor_get(v, buf + off, 0, v_len);
        else      ggml_backend_tensor_set(v, buf + off, 0, v_len);
        off += v_len;
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
        off += copy_layer(&ctx->kv, n_pos, il, dst + off, true);
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

int32_t powerinfer_state_load(struct powerinfer_context * ctx, const uint8_t * src, size_t src_size) {
    pi_clear_error();
    struct pi_state_header h;
    if (!src || src_size < sizeof(h)) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "state data is too short (%zu bytes)", src_size);
    }
    memcpy(&h, src, sizeof(h));
    const struct pi_state_header want = make_header(ctx, 0);
    if (memcmp(h.magic, PI_STATE_MAGIC, 4) != 0 || h.version != PI_STATE_VERSION) {
        return pi_fail(POWERINFER_ERR_FORMAT, "not a PowerInfer-Py context state (bad magic or version)");
    }
    if (h.n_layer != want.n_layer || h.n_embd_kv != want.n_embd_kv || h.n_vocab != want.n_vocab ||
        h.n_embd != want.n_embd || h.model_bytes != want.model_bytes || h.has_embd != want.has_embd) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "the state was saved from a different model or context configuration");
    }
    if (h.n_pos < 0 || (uint32_t) h.n_pos > ctx->kv.size || h.n_outputs < 0 || h.n_outputs > h.n_pos + 1) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "the state holds %d positions; this context has %u", h.n_pos, ctx->kv.size);
    }
    // Size check with the saved counts before touching anything.
    const size_t need = state_size(ctx, h.n_pos, h.n_outputs);
    if (need != src_size) {
        return pi_fail(POWERINFER_ERR_FORMAT, "state data is %zu bytes, expected %zu", src_size, need);
    }
    int32_t rc = pi_context_reserve_outputs(ctx, h.n_outputs);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    pi_kv_set_prefix_of_seq0(&ctx->kv, h.n_pos);
    ctx->n_outputs = h.n_outputs;
    size_t off = sizeof(h);
    for (int32_t il = 0; il < ctx->model->hp.n_layer; ++il) {
        off += copy_layer(&ctx->kv, h.n_pos, il, (uint8_t *) src + off, false);  // load only reads buf
    }
    const size_t n_logits = (size_t) h.n_outputs * h.n_vocab * sizeof(float);
    memcpy(ctx->logits, src + off, n_logits);
    off += n_logits;
    if (ctx->embd) {
        memcpy(ctx->embd, src + off, (size_t) h.n_outputs * h.n_embd * sizeof(float));
    }
    return POWERINFER_OK;
}
