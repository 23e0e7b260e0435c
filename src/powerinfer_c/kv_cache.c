// kv_cache.c - the f16 key/value cache: one K and one V tensor per layer, positions
// [0, n_pos) in use. A single sequence, so cell i holds position i.
#include "powerinfer-impl.h"

#include "ggml-cpu.h"

#include <string.h>

int32_t pi_kv_cache_init(struct pi_kv_cache * kv, const struct powerinfer_model * model, uint32_t n_ctx, bool v_trans,
                         ggml_backend_buffer_type_t buft) {
    memset(kv, 0, sizeof(*kv));
    const struct pi_hparams * hp = &model->hp;
    const int64_t n_embd_kv = (int64_t) hp->n_embd_head * hp->n_head_kv;

    struct ggml_init_params ip = {
        .mem_size   = (size_t) 2 * hp->n_layer * ggml_tensor_overhead(),
        .mem_buffer = NULL,
        .no_alloc   = true,
    };
    kv->ctx = ggml_init(ip);
    if (!kv->ctx) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate the KV cache descriptors");
    }
    for (int32_t il = 0; il < hp->n_layer; ++il) {
        kv->k[il] = ggml_new_tensor_2d(kv->ctx, GGML_TYPE_F16, n_embd_kv, n_ctx);
        kv->v[il] = v_trans ? ggml_new_tensor_2d(kv->ctx, GGML_TYPE_F16, n_ctx, n_embd_kv)
                            : ggml_new_tensor_2d(kv->ctx, GGML_TYPE_F16, n_embd_kv, n_ctx);
        ggml_format_name(kv->k[il], "cache_k_l%d", il);
        ggml_format_name(kv->v[il], "cache_v_l%d", il);
    }
    kv->buf = ggml_backend_alloc_ctx_tensors_from_buft(kv->ctx, buft ? buft : ggml_backend_cpu_buffer_type());
    if (!kv->buf) {
        ggml_free(kv->ctx);
        kv->ctx = NULL;
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate a KV cache of %u cells (%.1f MiB)", n_ctx,
                       2.0 * hp->n_layer * n_embd_kv * n_ctx * 2 / 1048576.0);
    }
    // Unwritten cells are masked out, but keep them finite: 0 * NaN would poison the V product.
    ggml_backend_buffer_clear(kv->buf, 0);
    kv->size    = n_ctx;
    kv->n_pos   = 0;
    kv->v_trans = v_trans;
    return POWERINFER_OK;
}

void pi_kv_cache_free(struct pi_kv_cache * kv) {
    if (kv->buf) {
        ggml_backend_buffer_free(kv->buf);
    }
    if (kv->ctx) {
        ggml_free(kv->ctx);
    }
    memset(kv, 0, sizeof(*kv));
}
