// repack.c - moves dense matmul weights into the CPU backend's "extra" buffer types
// (interleaved/repacked layouts with faster matmul kernels), as llama.cpp does, and
// releases the mapped pages they came from. Tensors read row by row by the sparse
// operators must stay in the plain mapping, so callers choose which tensors to offer;
// each tensor may be offered once (a tied output is not offered: get_rows reads it).
#include "powerinfer-impl.h"

#include "ggml-cpu.h"

#include <stdlib.h>
#include <string.h>

// The CPU device's extra buffer types, NULL-terminated (NULL if there are none).
static ggml_backend_buffer_type_t * cpu_extra_bufts(ggml_backend_dev_t * dev_out) {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev) {
        return NULL;
    }
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    ggml_backend_dev_get_extra_bufts_t get =
        (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    *dev_out = dev;
    return get ? get(dev) : NULL;
}

// Would a matmul with weight w, stored in buft, run on the CPU device? Asked the way
// llama.cpp asks: a throw-away op whose weight sits in an empty buffer of that type.
static bool buft_supports_matmul(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft, const struct ggml_tensor * w) {
    struct ggml_init_params ip = { .mem_size = 4 * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true };
    struct ggml_context * ctx = ggml_init(ip);
    if (!ctx) {
        return false;
    }
    struct ggml_tensor * wc = ggml_new_tensor(ctx, w->type, GGML_MAX_DIMS, w->ne);
    struct ggml_tensor * b  = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, w->ne[0], 512, w->ne[2], w->ne[3]);
    struct ggml_tensor * op = ggml_mul_mat(ctx, wc, b);
    ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(buft, 0);
    bool ok = false;
    if (dummy) {
        wc->buffer = dummy;
        ok = ggml_backend_dev_supports_op(dev, op);
        ggml_backend_buffer_free(dummy);
    }
    ggml_free(ctx);
    return ok;
}

int32_t pi_repack_weights(struct powerinfer_model * model, struct ggml_tensor ** weights[], int32_t n_weights) {
    ggml_backend_dev_t dev = NULL;
    ggml_backend_buffer_type_t * bufts = cpu_extra_bufts(&dev);
    if (!bufts || !*bufts || n_weights == 0) {
        return POWERINFER_OK;
    }
    struct ggml_init_params ip = {
        .mem_size   = (size_t) (n_weights + 1) * ggml_tensor_overhead(),
        .mem_buffer = NULL,
        .no_alloc   = true,
    };
    for (ggml_backend_buffer_type_t * bt = bufts; *bt; ++bt) {
        // One context and one buffer per buffer type, holding the copies that go there.
        struct ggml_context * ctx = ggml_init(ip);
        if (!ctx) {
            return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
        }
        struct ggml_tensor ** src  = malloc(sizeof(*src) * (size_t) n_weights);
        struct ggml_tensor ** dst  = malloc(sizeof(*dst) * (size_t) n_weights);
        int32_t *             slot = malloc(sizeof(*slot) * (size_t) n_weights);
        if (!src || !dst || !slot) {
            free(src); free(dst); free(slot);
            ggml_free(ctx);
            return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
        }
        int32_t n = 0;
        for (int32_t i = 0; i < n_weights; ++i) {
            struct ggml_tensor * w = *weights[i];
            if (!w || w->buffer != model->buf_weights || !buft_supports_matmul(dev, *bt, w)) {
                continue;
            }
            src[n]  = w;
            dst[n]  = ggml_dup_tensor(ctx, w);
            slot[n] = i;
            ggml_set_name(dst[n], ggml_get_name(w));
            ++n;
        }
        ggml_backend_buffer_t buf = n > 0 ? ggml_backend_alloc_ctx_tensors_from_buft(ctx, *bt) : NULL;
        if (!buf || model->n_repack_bufs >= PI_MAX_REPACK_BUFS) {
            free(src); free(dst); free(slot);
            if (buf) ggml_backend_buffer_free(buf);
            ggml_free(ctx);
            if (n == 0) {
                continue;
            }
            return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate a %s buffer for repacked weights",
                           ggml_backend_buft_name(*bt));
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        size_t bytes = 0;
        for (int32_t j = 0; j < n; ++j) {
            ggml_backend_tensor_set(dst[j], src[j]->data, 0, ggml_nbytes(src[j]));  // repacks
            pi_release_mapped_range(src[j]->data, ggml_nbytes(src[j]));
            *weights[slot[j]] = dst[j];
            bytes += ggml_nbytes(src[j]);
        }
        free(src); free(dst); free(slot);
        model->repack_ctx[model->n_repack_bufs] = ctx;
        model->repack_buf[model->n_repack_bufs] = buf;
        model->n_repack_bufs++;
        pi_log(POWERINFER_LOG_INFO, "powerinfer: %d weight tensors (%.1f MiB) repacked into %s\n",
               n, bytes / 1048576.0, ggml_backend_buft_name(*bt));
    }
    return POWERINFER_OK;
}

void pi_repack_free(struct powerinfer_model * model) {
    for (int32_t i = 0; i < model->n_repack_bufs; ++i) {
        ggml_backend_buffer_free(model->repack_buf[i]);
        ggml_free(model->repack_ctx[i]);
    }
    model->n_repack_bufs = 0;
}
