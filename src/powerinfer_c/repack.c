// repack.c - weights in the CPU backend's fastest matmul layouts. Dense matmul weights
// move into the "extra" buffer types (interleaved/repacked layouts with faster kernels),
// as llama.cpp does, and the mapped pages they came from are released. Tensors read row
// by row by the sparse operators must stay in the plain mapping, so callers choose which
// tensors to offer (each at most once; a tied output is not offered: get_rows reads it);
// for batches those rows get copies of their own (pi_make_batch_weights).
#include "powerinfer-impl.h"

#include "ggml-cpu.h"

#include "kernel_levels.h"
#include "packed_matmul.h"

#include <pthread.h>
#include <sys/mman.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
            pi_release_mapped_range(model, src[j]->data, ggml_nbytes(src[j]));
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

// Allocates ctx's tensors in a buffer of type bt that the model keeps (freed by
// pi_repack_free); NULL when out of memory (ctx is then the caller's to free).
static ggml_backend_buffer_t keep_weight_buffer(struct powerinfer_model * model, struct ggml_context * ctx,
                                                ggml_backend_buffer_type_t bt) {
    ggml_backend_buffer_t buf = model->n_repack_bufs < PI_MAX_REPACK_BUFS ? ggml_backend_alloc_ctx_tensors_from_buft(ctx, bt) : NULL;
    if (!buf) {
        return NULL;
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    model->repack_ctx[model->n_repack_bufs] = ctx;
    model->repack_buf[model->n_repack_bufs] = buf;
    model->n_repack_bufs++;
    return buf;
}

void pi_repack_free(struct powerinfer_model * model) {
    for (int32_t i = 0; i < model->n_repack_bufs; ++i) {
        ggml_backend_buffer_free(model->repack_buf[i]);
        ggml_free(model->repack_ctx[i]);
    }
    model->n_repack_bufs = 0;
}

// ---- copies for batches ---------------------------------------------------------------------
//
// A batch (prompt processing) computes every neuron, which is fastest as a matmul on a
// layout made for it, while the sparse decode path reads the file's rows of ffn_up (and
// of ffn_gate in predictor mode) one neuron at a time: those get a second, repacked copy
// used by batches only. A file that stores the down projection only as ffn_down_t
// (PowerInfer's layout: row i = neuron i's output weights) gets it transposed back into
// ffn_down's layout, for a matmul instead of an AXPY per token:
//   - float types as they are (exact);
//   - quantized ones re-quantized to 8 bits along the other axis: Q8_0's step is 1/127 of
//     a block's range, so the copy stays within about 0.5% (RMS) of the file's values
//     (4 bits would add about 80% to the file's own rounding error). With AVX-512 VNNI it
//     is packed for packed_matmul.c's kernel (ggml does not repack Q8_0 on x86), else
//     plain Q8_0 for ggml's matmul; F16 when n_ff is not in whole 32-element blocks.

static enum ggml_type batch_down_type(enum ggml_type t, int64_t n_ff) {
    if (t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16) {
        return t;
    }
    return n_ff % 32 == 0 ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;
}

// Whether the batch copy of down (prompts of files without ffn_down) goes to the packed
// kernels: where they beat ggml's Q8_0 matmul, or where the model packs every dense matmul
// (pack_dense: the packed kernels' batch invariance). At the avx2 level (vpmaddubsw, no VNNI)
// ggml's is faster: a 256-token prompt of the 7B-shaped PWRI file, dense mode, 2 threads, ran
// at 17.4 tok/s packed and 19.9 through ggml, where the avx512 level's packed kernels gave
// 24.2 (docs/benchmarks.md, "The AVX2 kernel level"). The other levels
// keep them (avxvnni and NEON dotprod are not measured here).
static bool down_packed(const struct powerinfer_model * model, enum ggml_type t, int64_t n_embd, int64_t n_ff) {
    return pi_pack_available() && batch_down_type(t, n_ff) == GGML_TYPE_Q8_0 && n_embd % PI_PACK_ROWS == 0 &&
           (model->params.pack_dense || strcmp(pi_kernel_level(), "avx2") != 0);
}

// The first extra buffer type whose matmul takes a tensor like t, else NULL.
static ggml_backend_buffer_type_t repack_buft_for(const struct ggml_tensor * t) {
    ggml_backend_dev_t dev = NULL;
    ggml_backend_buffer_type_t * bufts = cpu_extra_bufts(&dev);
    for (ggml_backend_buffer_type_t * bt = bufts; bt && *bt; ++bt) {
        if (buft_supports_matmul(dev, *bt, t)) {
            return *bt;
        }
    }
    return NULL;
}

// Writes down_t [n_embd, n_ff] transposed into dst: [n_ff, n_embd] of dst->type, or
// packed (packed_matmul.h), a strip of output rows at a time. Host memory only.
static int32_t transpose_down(const struct ggml_tensor * down_t, struct ggml_tensor * dst, bool packed) {
    const int64_t n_embd = down_t->ne[0], n_ff = down_t->ne[1];
    const int64_t blck  = ggml_blck_size(down_t->type);
    const int64_t strip = blck > 32 ? blck : 32;  // whole blocks of down_t's rows, whole groups of packed rows
    const struct ggml_type_traits * tt = ggml_get_type_traits(down_t->type);
    float * blk  = malloc(sizeof(float) * (size_t) n_ff * strip);  // [n_ff][strip]: the strip of every neuron's row
    float * cols = malloc(sizeof(float) * (size_t) n_ff * strip);  // [strip][n_ff]: the copy's rows
    if (!blk || !cols) {
        free(blk); free(cols);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory transposing %s", ggml_get_name(down_t));
    }
    ggml_from_float_t from_float = dst->type == GGML_TYPE_F32 || packed ? NULL : ggml_get_type_traits_cpu(dst->type)->from_float;
    const size_t dst_rs = packed ? 0 : ggml_row_size(dst->type, n_ff);
    for (int64_t c0 = 0; c0 < n_embd; c0 += strip) {
        const int64_t w = n_embd - c0 < strip ? n_embd - c0 : strip;
        for (int64_t i = 0; i < n_ff; ++i) {
            const char * src = (const char *) down_t->data + (size_t) i * down_t->nb[1] + ggml_row_size(down_t->type, c0);
            if (down_t->type == GGML_TYPE_F32) {
                memcpy(blk + i * strip, src, sizeof(float) * (size_t) w);
            } else {
                tt->to_float(src, blk + i * strip, w);
            }
        }
        for (int64_t c = 0; c < w; ++c) {
            for (int64_t i = 0; i < n_ff; ++i) cols[c * n_ff + i] = blk[i * strip + c];
        }
        for (int64_t c = 0; c < w; c += packed ? PI_PACK_ROWS : w) {
            char * out = (char *) dst->data;
            if (packed) {
                pi_pack_q8_group_f32(cols + c * n_ff, n_ff, c0 + c, out);
            } else if (from_float) {
                for (int64_t r = 0; r < w; ++r) from_float(cols + r * n_ff, out + (size_t) (c0 + r) * dst_rs, n_ff);
            } else {
                memcpy(out + (size_t) c0 * dst_rs, cols, sizeof(float) * (size_t) w * n_ff);
            }
        }
    }
    free(blk);
    free(cols);
    return POWERINFER_OK;
}

struct transpose_job {
    struct powerinfer_model * model;
    int32_t                   ith, nth;
    int32_t                   rc;
};

// Thread ith transposes the down projection of layers ith, ith + nth, ...
static void * transpose_worker(void * arg) {
    struct transpose_job * job = arg;
    const struct powerinfer_model * model = job->model;
    for (int32_t il = job->ith; il < model->hp.n_layer && job->rc == POWERINFER_OK; il += job->nth) {
        const struct pi_layer * l = &model->layers[il];
        if (l->ffn_down_b) {
            job->rc = transpose_down(l->ffn_down_t, l->ffn_down_b, l->ffn_down_b_packed);
        }
    }
    return NULL;
}

// One buffer of buffer type bt holding a copy of each of n tensors: like[i]'s shape and
// type, or (transposed[i]) the down copy's. The copies go to slots[i]; returns the buffer.
static int32_t alloc_copies(struct powerinfer_model * model, ggml_backend_buffer_type_t bt, const struct ggml_tensor ** like,
                            const bool * transposed, struct ggml_tensor *** slots, int32_t n) {
    if (n == 0) {
        return POWERINFER_OK;
    }
    struct ggml_init_params ip = { .mem_size = (size_t) (n + 1) * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true };
    struct ggml_context * ctx = model->n_repack_bufs < PI_MAX_REPACK_BUFS ? ggml_init(ip) : NULL;
    if (!ctx) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot make the batch copies");
    }
    for (int32_t i = 0; i < n; ++i) {
        const struct ggml_tensor * s = like[i];
        struct ggml_tensor * t;
        if (!transposed[i]) {
            t = ggml_dup_tensor(ctx, s);
        } else if (down_packed(model, s->type, s->ne[0], s->ne[1])) {
            t = pi_pack_tensor(ctx, PI_PACK_Q8, s->ne[0], s->ne[1]);
        } else {
            t = ggml_new_tensor_2d(ctx, batch_down_type(s->type, s->ne[1]), s->ne[1], s->ne[0]);
        }
        ggml_format_name(t, "%s_b", ggml_get_name(s));
        *slots[i] = t;
    }
    ggml_backend_buffer_t buf = keep_weight_buffer(model, ctx, bt);
    if (!buf) {
        for (int32_t i = 0; i < n; ++i) *slots[i] = NULL;
        ggml_free(ctx);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate %s memory for the batch copies",
                       ggml_backend_buft_name(bt));
    }
    pi_log(POWERINFER_LOG_INFO, "powerinfer: batch copies: %d tensors, %.1f MiB in %s\n", n,
           ggml_backend_buffer_get_size(buf) / 1048576.0, ggml_backend_buft_name(bt));
    return POWERINFER_OK;
}

int32_t pi_make_batch_weights(struct powerinfer_model * model, bool repacked) {
    const int32_t n_layer = model->hp.n_layer, mode = model->hp.sparse_mode;
    const bool sparse = mode == POWERINFER_SPARSE_GATE || mode == POWERINFER_SPARSE_PREDICTOR;
    const double t0 = pi_time_ms();
    // Up to 2 row copies per layer (ffn_up, ffn_gate) per repack buffer type, and the down copies.
    const int32_t cap = 2 * n_layer;
    const struct ggml_tensor ** like = malloc(sizeof(*like) * (size_t) cap * 2);
    struct ggml_tensor *** slots = malloc(sizeof(*slots) * (size_t) cap * 2);
    bool * transposed = calloc((size_t) cap * 2, sizeof(bool));
    if (!like || !slots || !transposed) {
        free(like); free(slots); free(transposed);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    int32_t rc = POWERINFER_OK;
    // 1. Repacked copies of the rows the sparse path reads, grouped by buffer type.
    for (int32_t pass = 0; sparse && repacked && rc == POWERINFER_OK; ++pass) {
        ggml_backend_buffer_type_t bt = NULL;
        int32_t n = 0;
        for (int32_t il = 0; il < n_layer; ++il) {
            struct pi_layer * l = &model->layers[il];
            struct ggml_tensor * rows[2] = { l->ffn_up, mode == POWERINFER_SPARSE_PREDICTOR ? l->ffn_gate : NULL };
            struct ggml_tensor ** dst[2] = { &l->ffn_up_b, &l->ffn_gate_b };
            for (int k = 0; k < 2; ++k) {
                ggml_backend_buffer_type_t b = rows[k] && !*dst[k] ? repack_buft_for(rows[k]) : NULL;
                if (!b || (bt && b != bt)) continue;
                bt = b;
                like[n] = rows[k];
                slots[n] = dst[k];
                transposed[n++] = false;
            }
        }
        if (n == 0) break;
        rc = alloc_copies(model, bt, like, transposed, slots, n);
        for (int32_t i = 0; i < n && rc == POWERINFER_OK; ++i) {
            ggml_backend_tensor_set(*slots[i], like[i]->data, 0, ggml_nbytes(like[i]));  // repacks
        }
    }
    // 2. The down projection transposed back, for files without ffn_down.
    int32_t n = 0;
    for (int32_t il = 0; il < n_layer && rc == POWERINFER_OK; ++il) {
        struct pi_layer * l = &model->layers[il];
        if (!l->ffn_down && l->ffn_down_t) {
            like[n] = l->ffn_down_t;
            slots[n] = &l->ffn_down_b;
            transposed[n++] = true;
            l->ffn_down_b_packed = down_packed(model, l->ffn_down_t->type, l->ffn_down_t->ne[0], l->ffn_down_t->ne[1]);
        }
    }
    if (rc == POWERINFER_OK && n > 0 && (rc = alloc_copies(model, ggml_backend_cpu_buffer_type(), like, transposed, slots, n)) == POWERINFER_OK) {
        // Layers spread over the model's threads, each with its own staging; a thread that
        // cannot be started leaves its layers to the calling thread.
        int32_t nth = model->params.n_threads > 0 ? model->params.n_threads : (int32_t) sysconf(_SC_NPROCESSORS_ONLN);
        nth = nth < 1 ? 1 : nth > 64 ? 64 : nth > n ? n : nth;
        struct transpose_job jobs[64];
        pthread_t threads[64];
        bool running[64] = { false };
        for (int32_t i = 0; i < nth; ++i) {
            jobs[i] = (struct transpose_job) { model, i, nth, POWERINFER_OK };
            running[i] = i > 0 && pthread_create(&threads[i], NULL, transpose_worker, &jobs[i]) == 0;
        }
        for (int32_t i = 0; i < nth; ++i) {
            if (running[i]) pthread_join(threads[i], NULL);
            else transpose_worker(&jobs[i]);
            rc = rc != POWERINFER_OK ? rc : jobs[i].rc;
        }
    }
    free(like); free(slots); free(transposed);
    if (rc == POWERINFER_OK) {
        pi_log(POWERINFER_LOG_INFO, "powerinfer: batch copies made in %.0f ms\n", pi_time_ms() - t0);
    }
    return rc;
}

// ---- copies of the rows the sparse path reads ------------------------------------------------
//
// The sparse operators read scattered rows of ffn_up, ffn_down_t and (predictor mode)
// ffn_gate, one neuron's rows right after each other. They are copied out of the file's
// mapping (4 KiB pages of the page cache) into one anonymous region (2 MiB pages where the
// kernel grants them), each neuron's rows side by side, so a neuron is one contiguous read:
// the fused operator on a 7B shape, 18.6 -> 22.9 GB/s of active rows (docs/benchmarks.md).
// The tensors become strided views of the region (nb[1] = the neuron's bytes); the mapped
// pages are released, so the resident size stays the same.

int32_t pi_make_row_copies(struct powerinfer_model * model) {
    const int32_t n_layer = model->hp.n_layer, mode = model->hp.sparse_mode;
    if (mode != POWERINFER_SPARSE_GATE && mode != POWERINFER_SPARSE_PREDICTOR) {
        return POWERINFER_OK;
    }
    // Per layer, the tensors bundled (in this order within a neuron) and their row bytes.
    struct ggml_tensor ** slots[PI_MAX_LAYERS][3];
    int32_t n_slots[PI_MAX_LAYERS];
    size_t stride[PI_MAX_LAYERS];
    size_t total = 0;
    int32_t n = 0;
    for (int32_t il = 0; il < n_layer; ++il) {
        struct pi_layer * l = &model->layers[il];
        struct ggml_tensor ** s[3] = { mode == POWERINFER_SPARSE_PREDICTOR && l->ffn_gate ? &l->ffn_gate : NULL, &l->ffn_up,
                                       &l->ffn_down_t };
        n_slots[il] = 0;
        stride[il] = 0;
        for (int k = 0; k < 3; ++k) {
            if (s[k] && *s[k] && (*s[k])->buffer == model->buf_weights && (*s[k])->ne[1] == model->hp.n_ff &&
                ggml_is_contiguous(*s[k])) {
                slots[il][n_slots[il]++] = s[k];
                stride[il] += (*s[k])->nb[1];
            }
        }
        total += GGML_PAD(stride[il] * (size_t) model->hp.n_ff, 64);
        n += n_slots[il];
    }
    if (n == 0) {
        return POWERINFER_OK;
    }
    const size_t huge = 2u << 20;
    total = (total + huge - 1) / huge * huge;
    void * region = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (region == MAP_FAILED) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot map %.1f MiB for the sparse rows", total / 1048576.0);
    }
#ifdef MADV_HUGEPAGE
    madvise(region, total, MADV_HUGEPAGE);  // a hint; without it the copies still work
#endif
    struct ggml_init_params ip = { .mem_size = (size_t) (n + 1) * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true };
    struct ggml_context * ctx = ggml_init(ip);
    ggml_backend_buffer_t buf = ctx ? ggml_backend_cpu_buffer_from_ptr(region, total) : NULL;
    if (!buf) {
        if (ctx) ggml_free(ctx);
        munmap(region, total);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot make the buffer of the sparse rows");
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    char * base = region;
    for (int32_t il = 0; il < n_layer; ++il) {
        size_t off = 0;  // of the tensor's rows within a neuron's bytes
        for (int32_t k = 0; k < n_slots[il]; ++k) {
            struct ggml_tensor * src = *slots[il][k];
            struct ggml_tensor * t = ggml_new_tensor_2d(ctx, src->type, src->ne[0], src->ne[1]);
            ggml_set_name(t, ggml_get_name(src));
            t->nb[1] = stride[il];
            t->nb[2] = t->nb[3] = stride[il] * (size_t) src->ne[1];
            ggml_backend_tensor_alloc(buf, t, base + off);
            for (int64_t i = 0; i < src->ne[1]; ++i) {
                memcpy((char *) t->data + (size_t) i * t->nb[1], (const char *) src->data + (size_t) i * src->nb[1], src->nb[1]);
            }
            pi_release_mapped_range(model, src->data, ggml_nbytes(src));
            *slots[il][k] = t;
            off += src->nb[1];
        }
        base += GGML_PAD(stride[il] * (size_t) model->hp.n_ff, 64);
    }
    model->rows_ctx = ctx;
    model->rows_buf = buf;
    model->rows_addr = region;
    model->rows_size = total;
    pi_log(POWERINFER_LOG_INFO, "powerinfer: %d sparse-row tensors (%.1f MiB) copied out of the mapping, one neuron's rows together\n",
           n, total / 1048576.0);
    return POWERINFER_OK;
}

// ---- the predictor, packed ------------------------------------------------------------------
//
// Predictor mode reads fc1 and fc2 whole every token. ggml has no x86 repack for Q8_0 (a
// common predictor type) and its plain Q8_0 matmul streams at ~26 GB/s where the packed
// kernel reads ~34 (bench-sparse-ops); Q4_0 packs as well, so both go to packed copies
// (exact: the file's scales and integers) instead of ggml's repacked ones.

bool pi_predictors_packable(const struct powerinfer_model * model) {
    if (model->hp.sparse_mode != POWERINFER_SPARSE_PREDICTOR || !pi_pack_available()) {
        return false;
    }
    for (int32_t il = 0; il < model->hp.n_layer; ++il) {
        const struct pi_layer * l = &model->layers[il];
        if (!pi_pack_fits(l->fc1->type, l->fc1->ne[0], l->fc1->ne[1]) || !pi_pack_fits(l->fc2->type, l->fc2->ne[0], l->fc2->ne[1])) {
            return false;
        }
    }
    return true;
}

int32_t pi_pack_predictors(struct powerinfer_model * model) {
    if (!pi_predictors_packable(model)) {
        return POWERINFER_OK;
    }
    const int32_t n_layer = model->hp.n_layer;
    struct ggml_init_params ip = { .mem_size = (size_t) (2 * n_layer + 1) * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true };
    struct ggml_context * ctx = model->n_repack_bufs < PI_MAX_REPACK_BUFS ? ggml_init(ip) : NULL;
    if (!ctx) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot pack the predictor");
    }
    for (int32_t il = 0; il < n_layer; ++il) {
        struct pi_layer * l = &model->layers[il];
        const struct ggml_tensor * w[2] = { l->fc1, l->fc2 };
        struct ggml_tensor ** p[2] = { &l->fc1_p, &l->fc2_p };
        for (int k = 0; k < 2; ++k) {
            *p[k] = pi_pack_tensor(ctx, pi_pack_type_of(w[k]->type), w[k]->ne[1], w[k]->ne[0]);
            ggml_format_name(*p[k], "%s_p", ggml_get_name(w[k]));
        }
    }
    ggml_backend_buffer_t buf = keep_weight_buffer(model, ctx, ggml_backend_cpu_buffer_type());
    if (!buf) {
        for (int32_t il = 0; il < n_layer; ++il) model->layers[il].fc1_p = model->layers[il].fc2_p = NULL;
        ggml_free(ctx);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate memory for the packed predictor");
    }
    for (int32_t il = 0; il < n_layer; ++il) {
        const struct pi_layer * l = &model->layers[il];
        const struct ggml_tensor * w[2] = { l->fc1, l->fc2 };
        struct ggml_tensor * p[2] = { l->fc1_p, l->fc2_p };
        for (int k = 0; k < 2; ++k) {
            pi_pack_rows_exact(w[k]->type, w[k]->data, w[k]->nb[1], w[k]->ne[0], 0, w[k]->ne[1], p[k]->data);
            pi_release_mapped_range(model, w[k]->data, ggml_nbytes(w[k]));  // read again only to place it on a device
        }
    }
    pi_log(POWERINFER_LOG_INFO, "powerinfer: predictor packed (%.1f MiB)\n", ggml_backend_buffer_get_size(buf) / 1048576.0);
    return POWERINFER_OK;
}

// ---- dense weights, packed (pack_dense) ------------------------------------------------------
//
// The packed kernel computes every batch column alone, in one order, and reuses each
// loaded weight chunk for 4 columns: a batch of several sequences' tokens (ParallelLlama,
// the server's slots) costs little more than one token and each column's result equals the
// one it gets alone. ggml's Q4_1 and K-quant matmuls on x86 compute each column with its
// own dot products (a 4-column step costs 3x one column on 2 cores), and its tiled and
// repacked kernels round a column by its neighbours (docs/parallel.md).

int32_t pi_pack_dense_weights(struct powerinfer_model * model) {
    if (!pi_pack_available()) {
        return POWERINFER_OK;  // no kernels here (the scalar path is slower than ggml's)
    }
    const int32_t n_layer = model->hp.n_layer, per_layer = 8;
    const size_t n_max = (size_t) per_layer * (size_t) n_layer + 1;
    struct ggml_tensor ** src = malloc(sizeof(*src) * n_max);
    struct ggml_tensor *** dst = malloc(sizeof(*dst) * n_max);
    if (!src || !dst) {
        free(src); free(dst);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    size_t n = 0;
#define PI_PACK_SLOT(w, p) do { if ((w) && (w)->buffer == model->buf_weights && \
        pi_pack_fits((w)->type, (w)->ne[0], (w)->ne[1]) && ggml_n_dims(w) == 2) { src[n] = (w); dst[n] = &(p); ++n; } } while (0)
    const bool dense_ffn = model->hp.sparse_mode == POWERINFER_SPARSE_DENSE;
    for (int32_t il = 0; il < n_layer; ++il) {
        struct pi_layer * l = &model->layers[il];
        PI_PACK_SLOT(l->wqkv, l->wqkv_p);
        PI_PACK_SLOT(l->wq, l->wq_p);
        PI_PACK_SLOT(l->wk, l->wk_p);
        PI_PACK_SLOT(l->wv, l->wv_p);
        PI_PACK_SLOT(l->wo, l->wo_p);
        if (dense_ffn) {  // sparse modes read the FFN's rows one neuron at a time: left as they are
            PI_PACK_SLOT(l->ffn_gate, l->ffn_gate_p);
            PI_PACK_SLOT(l->ffn_up, l->ffn_up_p);
            PI_PACK_SLOT(l->ffn_down, l->ffn_down_p);
        }
    }
    PI_PACK_SLOT(model->output, model->output_p);
#undef PI_PACK_SLOT
    if (n == 0) {
        free(src); free(dst);
        return POWERINFER_OK;
    }
    struct ggml_init_params ip = { .mem_size = (n + 1) * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true };
    struct ggml_context * ctx = model->n_repack_bufs < PI_MAX_REPACK_BUFS ? ggml_init(ip) : NULL;
    if (!ctx) {
        free(src); free(dst);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot pack the dense weights");
    }
    for (size_t i = 0; i < n; ++i) {
        *dst[i] = pi_pack_tensor(ctx, pi_pack_type_of(src[i]->type), src[i]->ne[1], src[i]->ne[0]);
        ggml_format_name(*dst[i], "%s_p", ggml_get_name(src[i]));
    }
    ggml_backend_buffer_t buf = keep_weight_buffer(model, ctx, ggml_backend_cpu_buffer_type());
    if (!buf) {
        for (size_t i = 0; i < n; ++i) *dst[i] = NULL;
        ggml_free(ctx);
        free(src); free(dst);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate memory for the packed dense weights");
    }
    for (size_t i = 0; i < n; ++i) {
        pi_pack_rows_exact(src[i]->type, src[i]->data, src[i]->nb[1], src[i]->ne[0], 0, src[i]->ne[1], (*dst[i])->data);
        if (src[i] != model->tok_embd) {  // the embedding rows are still read (get_rows)
            pi_release_mapped_range(model, src[i]->data, ggml_nbytes(src[i]));
        }
    }
    model->n_packed_dense = (int32_t) n;
    pi_log(POWERINFER_LOG_INFO, "powerinfer: %zu dense weights packed (%.1f MiB)\n", n,
           ggml_backend_buffer_get_size(buf) / 1048576.0);
    free(src); free(dst);
    return POWERINFER_OK;
}

// ---- input mode's column copies ---------------------------------------------------------------
//
// Input mode reads each matrix by columns (input_sparse.h): per layer, q/k/v (or the fused
// qkv), o, gate with up, and down each get an exact column-major copy, made here from the
// file's blocks, in one anonymous region (2 MiB pages where granted). The file's tensors
// stay for batches (prompts), which run dense. A group with a type that has no column
// form (F16, IQ types, ...) keeps running dense.

// The matrices of input k (pi_input_index) in the order their rows are stacked; returns how many.
static int input_matrices(const struct powerinfer_model * model, int32_t k, struct ggml_tensor ** w) {
    if (k >= model->hp.n_layer * POWERINFER_INPUT_COUNT) {  // the output matrix
        w[0] = model->output;
        return model->output ? 1 : 0;
    }
    const struct pi_layer * l = &model->layers[k / POWERINFER_INPUT_COUNT];
    switch (k % POWERINFER_INPUT_COUNT) {
        case POWERINFER_INPUT_QKV:
            if (l->wqkv) { w[0] = l->wqkv; return 1; }
            w[0] = l->wq; w[1] = l->wk; w[2] = l->wv;
            return 3;
        case POWERINFER_INPUT_O:
            w[0] = l->wo;
            return 1;
        case POWERINFER_INPUT_FFN:
            if (!l->ffn_gate) { w[0] = l->ffn_up; return 1; }
            w[0] = l->ffn_gate; w[1] = l->ffn_up;
            return 2;
        default:
            w[0] = l->ffn_down;
            return l->ffn_down ? 1 : 0;
    }
}

struct cols_job {
    struct powerinfer_model * model;
    int ith, nth;
};

static void * cols_worker(void * arg) {
    struct cols_job * job = arg;
    struct powerinfer_model * model = job->model;
    for (int32_t k = 0; k < pi_n_inputs(model); ++k) {
        struct ggml_tensor * w[PI_COLMAT_MAX_SEGS];
        struct pi_colmat * cm = pi_input_cm(model, k);
        if (cm->n_segs > 0 && input_matrices(model, k, w) > 0) {
            pi_colmat_fill(cm, w, job->ith, job->nth);
        }
    }
    return NULL;
}

// POWERINFER_INPUT_SCALAR=1: input mode keeps the scalar column product where it is slower
// than dense (the pipeline's quality probes need the sparse arithmetic, not its speed).
static bool input_scalar_wanted(void) {
    const char * v = getenv("POWERINFER_INPUT_SCALAR");
    return v && *v && strcmp(v, "0") != 0;
}

int32_t pi_make_input_copies(struct powerinfer_model * model) {
    if (model->hp.sparse_mode != POWERINFER_SPARSE_INPUT) {
        return POWERINFER_OK;
    }
    const double t0 = pi_time_ms();
    if (!pi_colmat_simd() && !input_scalar_wanted()) {
        // the scalar column product reads the kept bytes far slower than ggml's dense matmul
        // reads them all: a sparse mode must never make a model slower than its dense mode
        pi_log(POWERINFER_LOG_WARN, "powerinfer: input mode: the sparse kernels run at level '%s' on this CPU, which has no "
               "SIMD column product (slower than dense); every matrix runs dense (POWERINFER_INPUT_SCALAR=1 keeps "
               "the sparse product, for measurements)\n", pi_kernel_level());
        for (int32_t k = 0; k < pi_n_inputs(model); ++k) memset(pi_input_cm(model, k), 0, sizeof(struct pi_colmat));
        return POWERINFER_OK;
    }
    size_t total = 0;
    int32_t n_copies = 0, n_dense = 0;
    for (int32_t k = 0; k < pi_n_inputs(model); ++k) {
        struct ggml_tensor * w[PI_COLMAT_MAX_SEGS];
        struct pi_colmat * cm = pi_input_cm(model, k);
        const int n = input_matrices(model, k, w);
        bool mapped = n > 0 && !(pi_input_tau(model, k) < 0.0f);  // a negative threshold: this input runs dense
        for (int i = 0; i < n; ++i) mapped &= w[i] && w[i]->buffer == model->buf_weights;
        const size_t bytes = mapped ? pi_colmat_plan(cm, w, n) : 0;
        if (bytes == 0) {
            memset(cm, 0, sizeof(*cm));
            n_dense += k < model->hp.n_layer * POWERINFER_INPUT_COUNT;  // the output matrix is dense by default
            continue;
        }
        cm->q = (const uint8_t *) (uintptr_t) total;  // an offset until the region exists
        total += (bytes + 4095) & ~(size_t) 4095;
        ++n_copies;
    }
    if (n_copies == 0) {
        pi_log(POWERINFER_LOG_WARN, "powerinfer: input mode: no matrix has a column form; everything runs dense\n");
        return POWERINFER_OK;
    }
    const size_t huge = 2u << 20;
    total = (total + huge - 1) / huge * huge;
    void * region = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (region == MAP_FAILED) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot map %.1f MiB for the column copies of input mode", total / 1048576.0);
    }
#ifdef MADV_HUGEPAGE
    madvise(region, total, MADV_HUGEPAGE);
#endif
    model->cols_addr = region;
    model->cols_size = total;
    for (int32_t k = 0; k < pi_n_inputs(model); ++k) {
        struct pi_colmat * cm = pi_input_cm(model, k);
        if (cm->n_segs > 0) pi_colmat_bind(cm, (uint8_t *) region + (uintptr_t) cm->q);
    }
    int32_t nth = model->params.n_threads > 0 ? model->params.n_threads : (int32_t) sysconf(_SC_NPROCESSORS_ONLN);
    nth = nth < 1 ? 1 : nth > 64 ? 64 : nth;
    struct cols_job jobs[64];
    pthread_t threads[64];
    bool running[64] = { false };
    for (int32_t i = 0; i < nth; ++i) {
        jobs[i] = (struct cols_job) { model, i, nth };
        running[i] = i > 0 && pthread_create(&threads[i], NULL, cols_worker, &jobs[i]) == 0;
    }
    cols_worker(&jobs[0]);
    for (int32_t i = 1; i < nth; ++i) {
        if (running[i]) pthread_join(threads[i], NULL);
        else cols_worker(&jobs[i]);
    }
    pi_log(POWERINFER_LOG_INFO, "powerinfer: input mode: %d column copies (%.1f MiB) made in %.0f ms%s\n", n_copies,
           total / 1048576.0, pi_time_ms() - t0, n_dense ? "; some inputs run dense (no column form)" : "");
    return POWERINFER_OK;
}

void pi_free_row_copies(struct powerinfer_model * model) {
    if (model->rows_buf) ggml_backend_buffer_free(model->rows_buf);
    if (model->rows_ctx) ggml_free(model->rows_ctx);
    if (model->rows_addr) munmap(model->rows_addr, model->rows_size);
    if (model->cols_addr) munmap(model->cols_addr, model->cols_size);
    model->rows_buf = NULL;
    model->rows_ctx = NULL;
    model->rows_addr = NULL;
    model->cols_addr = NULL;
}
