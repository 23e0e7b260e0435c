// offload.c - copies of weights on the devices: whole dense tensors (attention, predictor,
// norms, output; a layer split's dense FFN) and the compact rows of the hot FFN neurons,
// with the masks the CPU sparse operators use to skip those neurons, one set of buffers
// per device. What to copy where is placement.c's decision (placement_plan.c's plan);
// this file only copies, accounts in each device allocator's bytes, and undoes.
#include "powerinfer-impl.h"

#include <stdlib.h>
#include <string.h>

// ---- dense tensors ------------------------------------------------------------------------

int32_t pi_offload_dense(struct powerinfer_model * model, const struct pi_device * devs, struct pi_dense_item * items,
                         int32_t n_items) {
    struct pi_offload * off = &model->offload;
    for (int32_t d = 0; d < PI_MAX_DEVICES; ++d) {
        int32_t n = 0;
        for (int32_t i = 0; i < n_items; ++i) n += items[i].dev == d;
        if (n == 0) {
            continue;
        }
        struct ggml_init_params ip = { .mem_size = (size_t) (n + 1) * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true };
        if (!(off->ctx_dense[d] = ggml_init(ip))) {
            return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
        }
        struct ggml_tensor ** copies = malloc(sizeof(*copies) * (size_t) n_items);
        if (!copies) {
            return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
        }
        for (int32_t i = 0; i < n_items; ++i) {
            copies[i] = NULL;
            if (items[i].dev == d) {
                copies[i] = ggml_dup_tensor(off->ctx_dense[d], *items[i].slot);
                ggml_set_name(copies[i], ggml_get_name(*items[i].slot));
            }
        }
        off->buf_dense[d] = ggml_backend_alloc_ctx_tensors_from_buft(off->ctx_dense[d], devs[d].buft);
        if (!off->buf_dense[d]) {
            free(copies);
            return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate %s memory for the dense weights", devs[d].name);
        }
        ggml_backend_buffer_set_usage(off->buf_dense[d], GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        for (int32_t i = 0; i < n_items; ++i) {
            if (!copies[i]) {
                continue;
            }
            struct ggml_tensor * t = *items[i].slot;
            const struct ggml_tensor * o = pi_model_file_tensor(model, t);
            ggml_backend_tensor_set(copies[i], o->data, 0, ggml_nbytes(o));
            // The host copies are no longer read (the token embeddings stay, for get_rows):
            // the file's pages, and a repacked copy's pages (never touched again, so giving
            // them back is safe).
            if (t != model->tok_embd) {
                pi_release_mapped_range(model, o->data, ggml_nbytes(o));
                if (t->data != o->data) {
                    pi_release_pages(t->data, ggml_nbytes(t));  // a repacked host copy nothing reads any more
                }
            }
            *items[i].slot = copies[i];
        }
        free(copies);
    }
    return POWERINFER_OK;
}

uint64_t pi_offload_dense_bytes(const struct pi_offload * off, int32_t dev) {
    return off->buf_dense[dev] ? ggml_backend_buffer_get_size(off->buf_dense[dev]) : 0;
}

bool pi_offload_holds(const struct pi_offload * off, const struct ggml_tensor * t) {
    if (!t) {
        return false;
    }
    for (int32_t d = 0; d < PI_MAX_DEVICES; ++d) {
        if (off->buf_dense[d] && t->buffer == off->buf_dense[d]) {
            return true;
        }
    }
    return false;
}

void pi_offload_undo_dense(struct powerinfer_model * model, struct pi_dense_item * items, int32_t n_items) {
    struct pi_offload * off = &model->offload;
    for (int32_t i = 0; i < n_items; ++i) {
        // Point back at the file's tensors (repacking is not redone: plain layout is fine).
        const struct ggml_tensor * o = ggml_get_tensor(model->ctx_meta, ggml_get_name(*items[i].slot));
        if (o) *items[i].slot = (struct ggml_tensor *) o;
    }
    if (model->output && model->output != model->tok_embd && strcmp(ggml_get_name(model->output), ggml_get_name(model->tok_embd)) == 0) {
        model->output = model->tok_embd;
    }
    for (int32_t d = 0; d < PI_MAX_DEVICES; ++d) {
        if (off->buf_dense[d]) ggml_backend_buffer_free(off->buf_dense[d]);
        if (off->ctx_dense[d]) ggml_free(off->ctx_dense[d]);
        off->buf_dense[d] = NULL;
        off->ctx_dense[d] = NULL;
    }
}

// ---- hot FFN rows -------------------------------------------------------------------------

// The device copy of the down projection: float types kept, else Q8_0 (its 32-row blocks
// are the placement's group size).
static enum ggml_type down_type(enum ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16 ? t : GGML_TYPE_Q8_0;
}

uint64_t pi_offload_group_cost(const struct powerinfer_model * model, int32_t il) {
    const struct pi_layer * l = &model->layers[il];
    const int64_t n_embd = model->hp.n_embd, g = PI_OFFLOAD_GROUP;
    uint64_t c = (uint64_t) g * ggml_row_size(l->ffn_up->type, n_embd);
    if (l->ffn_gate) c += (uint64_t) g * ggml_row_size(l->ffn_gate->type, n_embd);
    c += (uint64_t) n_embd * ggml_row_size(down_type(l->ffn_down_t->type), g);
    if (model->hp.sparse_mode == POWERINFER_SPARSE_PREDICTOR) c += (uint64_t) g * ggml_row_size(l->fc2->type, l->fc2->ne[0]);
    return c;
}

uint64_t pi_offload_ffn_bytes(const struct pi_offload * off, int32_t dev) {
    return off->buf_ffn[dev] ? ggml_backend_buffer_get_size(off->buf_ffn[dev]) : 0;
}

void pi_offload_free_ffn(struct pi_offload * off, int32_t n_layer) {
    for (int32_t d = 0; d < PI_MAX_DEVICES; ++d) {
        if (off->buf_ffn[d]) ggml_backend_buffer_free(off->buf_ffn[d]);
        if (off->ctx_ffn[d]) ggml_free(off->ctx_ffn[d]);
        off->buf_ffn[d] = NULL;
        off->ctx_ffn[d] = NULL;
    }
    for (int32_t il = 0; il < n_layer; ++il) {
        struct pi_offload_layer * ol = &off->layers[il];
        free(ol->is_hot);
        memset(ol, 0, sizeof(*ol));
    }
}

// Gathers rows `ids` of a [ne0, n] tensor into dst (n_pad rows, zero padded), as bytes.
static void gather_rows(const struct ggml_tensor * src, const int32_t * ids, int32_t k, uint8_t * dst, int32_t n_pad) {
    const size_t rs = src->nb[1];
    for (int32_t j = 0; j < k; ++j) memcpy(dst + (size_t) j * rs, (const uint8_t *) src->data + (size_t) ids[j] * rs, rs);
    memset(dst + (size_t) k * rs, 0, (size_t) (n_pad - k) * rs);
}

// Fills layer il's device tensors from the file's rows of its hot neurons `ids`.
static int32_t copy_layer_rows(const struct powerinfer_model * model, int32_t il, const int32_t * ids) {
    const struct pi_offload_layer * ol = &model->offload.layers[il];
    const struct pi_layer * l = &model->layers[il];
    const int64_t n_embd = model->hp.n_embd;
    const bool pred = model->hp.sparse_mode == POWERINFER_SPARSE_PREDICTOR;
    // Staging: the largest of the row gathers, then the down block as rows and as columns.
    const size_t row_f32 = (size_t) ggml_row_size(GGML_TYPE_F32, n_embd);
    const size_t stage_rows = (size_t) ol->n_pad * (l->ffn_up->nb[1] > row_f32 ? l->ffn_up->nb[1] : row_f32);
    uint8_t * stage = malloc(stage_rows + (size_t) ol->n_pad * n_embd * sizeof(float) * 2);
    if (!stage) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory copying the FFN rows of layer %d", il);
    }
    // Rows as stored in the file: the gate (gate mode) and fc2 may sit in repacked
    // buffers, whose layout interleaves rows.
    const struct ggml_tensor * srcs[3] = { pi_model_file_tensor(model, l->ffn_up),
                                           l->ffn_gate ? pi_model_file_tensor(model, l->ffn_gate) : NULL,
                                           pred ? pi_model_file_tensor(model, l->fc2) : NULL };
    struct ggml_tensor *       dsts[3] = { ol->up, ol->gate, ol->fc2 };
    for (int k = 0; k < 3; ++k) {
        if (!dsts[k]) continue;
        if (!srcs[k]) {
            free(stage);
            return pi_fail(POWERINFER_ERR_INTERNAL, "layer %d: the file's rows of %s are not available", il, ggml_get_name(dsts[k]));
        }
        gather_rows(srcs[k], ids, ol->n_hot, stage, ol->n_pad);
        ggml_backend_tensor_set(dsts[k], stage, 0, ggml_nbytes(dsts[k]));
    }
    // Down: rows of ffn_down_t (neuron j's outputs) become column j of [n_pad, n_embd].
    float * rowsf = (float *) stage;                                   // [n_pad][n_embd]
    float * cols  = rowsf + (size_t) ol->n_pad * n_embd;               // [n_embd][n_pad]
    const struct ggml_type_traits * tt = ggml_get_type_traits(l->ffn_down_t->type);
    for (int32_t j = 0; j < ol->n_pad; ++j) {
        float * r = rowsf + (size_t) j * n_embd;
        if (j < ol->n_hot) {
            const void * src = (const uint8_t *) l->ffn_down_t->data + (size_t) ids[j] * l->ffn_down_t->nb[1];
            if (l->ffn_down_t->type == GGML_TYPE_F32) memcpy(r, src, sizeof(float) * (size_t) n_embd);
            else tt->to_float(src, r, n_embd);
        } else {
            memset(r, 0, sizeof(float) * (size_t) n_embd);
        }
    }
    for (int64_t e = 0; e < n_embd; ++e)
        for (int32_t j = 0; j < ol->n_pad; ++j) cols[(size_t) e * ol->n_pad + j] = rowsf[(size_t) j * n_embd + e];
    int32_t rc = POWERINFER_OK;
    if (ol->down->type == GGML_TYPE_F32) {
        ggml_backend_tensor_set(ol->down, cols, 0, ggml_nbytes(ol->down));
    } else {
        uint8_t * q = malloc(ggml_nbytes(ol->down));
        if (q) {
            ggml_quantize_chunk(ol->down->type, cols, q, 0, n_embd, ol->n_pad, NULL);
            ggml_backend_tensor_set(ol->down, q, 0, ggml_nbytes(ol->down));
            free(q);
        } else {
            rc = pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory copying the FFN rows of layer %d", il);
        }
    }
    free(stage);
    return rc;
}

int32_t pi_offload_ffn(struct powerinfer_model * model, const struct pi_device * devs, uint8_t * const * is_hot,
                       const int8_t * layer_dev) {
    struct pi_offload * off = &model->offload;
    const int32_t n_layer = model->hp.n_layer, n_ff = model->hp.n_ff;
    const int64_t n_embd = model->hp.n_embd;
    const bool pred = model->hp.sparse_mode == POWERINFER_SPARSE_PREDICTOR;
    int32_t ** ids = calloc((size_t) n_layer, sizeof(int32_t *));
    int32_t rc = POWERINFER_OK;
    if (!ids) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    int32_t n_on[PI_MAX_DEVICES] = { 0 };  // layers with rows on each device
    for (int32_t il = 0; il < n_layer; ++il) {
        struct pi_offload_layer * ol = &off->layers[il];
        for (int32_t i = 0; i < n_ff; ++i) ol->n_hot += is_hot[il][i];
        if (ol->n_hot > 0 && (layer_dev[il] < 0 || layer_dev[il] >= PI_MAX_DEVICES)) {
            rc = pi_fail(POWERINFER_ERR_INTERNAL, "layer %d: hot neurons without a device", il);
            goto done;
        }
        if (ol->n_hot > 0) n_on[layer_dev[il]]++;
    }
    for (int32_t d = 0; d < PI_MAX_DEVICES; ++d) {
        if (n_on[d] == 0) {
            continue;
        }
        struct ggml_init_params ip = { .mem_size = (size_t) (4 * n_on[d] + 1) * ggml_tensor_overhead(), .mem_buffer = NULL,
                                       .no_alloc = true };
        if (!(off->ctx_ffn[d] = ggml_init(ip))) {
            rc = pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
            goto done;
        }
    }
    for (int32_t il = 0; il < n_layer; ++il) {
        struct pi_offload_layer * ol = &off->layers[il];
        const struct pi_layer * l = &model->layers[il];
        if (ol->n_hot == 0) {
            continue;
        }
        struct ggml_context * c = off->ctx_ffn[layer_dev[il]];
        ol->dev = layer_dev[il];
        ol->is_hot = malloc((size_t) n_ff);
        ids[il] = malloc(sizeof(int32_t) * (size_t) ol->n_hot);
        if (!ol->is_hot || !ids[il]) {
            rc = pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
            goto done;
        }
        memcpy(ol->is_hot, is_hot[il], (size_t) n_ff);
        ol->n_pad = (ol->n_hot + PI_OFFLOAD_GROUP - 1) / PI_OFFLOAD_GROUP * PI_OFFLOAD_GROUP;
        for (int32_t i = 0, j = 0; i < n_ff; ++i) if (ol->is_hot[i]) ids[il][j++] = i;
        ol->up = ggml_new_tensor_2d(c, l->ffn_up->type, n_embd, ol->n_pad);
        ggml_format_name(ol->up, "blk.%d.ffn_up_dev", il);
        if (l->ffn_gate) {
            ol->gate = ggml_new_tensor_2d(c, l->ffn_gate->type, n_embd, ol->n_pad);
            ggml_format_name(ol->gate, "blk.%d.ffn_gate_dev", il);
        }
        ol->down = ggml_new_tensor_2d(c, down_type(l->ffn_down_t->type), ol->n_pad, n_embd);
        ggml_format_name(ol->down, "blk.%d.ffn_down_dev", il);
        if (pred) {
            ol->fc2 = ggml_new_tensor_2d(c, l->fc2->type, l->fc2->ne[0], ol->n_pad);
            ggml_format_name(ol->fc2, "blk.%d.fc2_dev", il);
        }
    }
    for (int32_t d = 0; d < PI_MAX_DEVICES; ++d) {
        if (!off->ctx_ffn[d]) {
            continue;
        }
        off->buf_ffn[d] = ggml_backend_alloc_ctx_tensors_from_buft(off->ctx_ffn[d], devs[d].buft);
        if (!off->buf_ffn[d]) {
            rc = pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate %s memory for the FFN rows", devs[d].name);
            goto done;
        }
        ggml_backend_buffer_set_usage(off->buf_ffn[d], GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }
    for (int32_t il = 0; il < n_layer && rc == POWERINFER_OK; ++il) {
        const struct pi_layer * l = &model->layers[il];
        if (off->layers[il].n_hot == 0) {
            continue;
        }
        rc = copy_layer_rows(model, il, ids[il]);
        // The host rows of these neurons are not read again (the CPU skips them).
        // (Only the file's pages: rows copied into memory for the CPU side stay.)
        pi_release_mapped_range(model, l->ffn_up->data, ggml_nbytes(l->ffn_up));
        pi_release_mapped_range(model, l->ffn_down_t->data, ggml_nbytes(l->ffn_down_t));
        if (l->ffn_gate && pred) {
            pi_release_mapped_range(model, l->ffn_gate->data, ggml_nbytes(l->ffn_gate));
        }
    }
done:
    for (int32_t il = 0; il < n_layer; ++il) free(ids[il]);
    free(ids);
    return rc;
}

void pi_offload_free(struct powerinfer_model * model) {
    struct pi_offload * off = &model->offload;
    pi_offload_free_ffn(off, model->hp.n_layer);
    for (int32_t d = 0; d < PI_MAX_DEVICES; ++d) {
        if (off->buf_dense[d]) ggml_backend_buffer_free(off->buf_dense[d]);
        if (off->ctx_dense[d]) ggml_free(off->ctx_dense[d]);
    }
    memset(off, 0, sizeof(*off));
}
