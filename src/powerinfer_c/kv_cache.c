// kv_cache.c - the f16 key/value cache: one K and one V tensor per layer, and per cell the
// position it holds and the set of sequences that see it (llama.cpp's unified cache).
// A sequence's tokens may sit in any cells; attention finds them through the mask. A
// context with one sequence fills cells in order, so cell i holds position i.
#include "powerinfer-impl.h"

#include "ggml-cpu.h"

#include <stdlib.h>
#include <string.h>

int32_t pi_kv_cache_init(struct pi_kv_cache * kv, const struct powerinfer_model * model, uint32_t n_ctx, uint32_t n_seq_max,
                         bool v_trans, const ggml_backend_buffer_type_t * bufts) {
    memset(kv, 0, sizeof(*kv));
    const struct pi_hparams * hp = &model->hp;
    const int64_t n_embd_kv = (int64_t) hp->n_embd_head * hp->n_head_kv;

    kv->cell_pos = malloc((size_t) n_ctx * sizeof(int32_t));
    kv->cell_seq = calloc((size_t) n_ctx, sizeof(uint64_t));
    if (!kv->cell_pos || !kv->cell_seq) {
        pi_kv_cache_free(kv);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate the KV cache descriptors");
    }
    for (uint32_t i = 0; i < n_ctx; ++i) {
        kv->cell_pos[i] = -1;
    }
    // The places the layers live, host memory first: one context (and buffer) each.
    ggml_backend_buffer_type_t where[PI_MAX_DEVICES + 1] = { ggml_backend_cpu_buffer_type() };
    kv->n_bufs = 1;
    for (int32_t il = 0; il < hp->n_layer; ++il) {
        const ggml_backend_buffer_type_t b = bufts && bufts[il] ? bufts[il] : where[0];
        int32_t k = 0;
        while (k < kv->n_bufs && where[k] != b) ++k;
        if (k == kv->n_bufs) {
            if (kv->n_bufs == PI_MAX_DEVICES + 1) {
                pi_kv_cache_free(kv);
                return pi_fail(POWERINFER_ERR_INVALID_ARG, "the KV cache spans more than %d places", PI_MAX_DEVICES + 1);
            }
            where[kv->n_bufs++] = b;
        }
    }
    const struct ggml_init_params ip = {
        .mem_size   = (size_t) 2 * hp->n_layer * ggml_tensor_overhead(),
        .mem_buffer = NULL,
        .no_alloc   = true,
    };
    for (int32_t k = 0; k < kv->n_bufs; ++k) {
        if (!(kv->ctx[k] = ggml_init(ip))) {
            pi_kv_cache_free(kv);
            return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate the KV cache descriptors");
        }
    }
    for (int32_t il = 0; il < hp->n_layer; ++il) {
        const ggml_backend_buffer_type_t b = bufts && bufts[il] ? bufts[il] : where[0];
        int32_t k = 0;
        while (where[k] != b) ++k;
        kv->k[il] = ggml_new_tensor_2d(kv->ctx[k], GGML_TYPE_F16, n_embd_kv, n_ctx);
        kv->v[il] = v_trans ? ggml_new_tensor_2d(kv->ctx[k], GGML_TYPE_F16, n_ctx, n_embd_kv)
                            : ggml_new_tensor_2d(kv->ctx[k], GGML_TYPE_F16, n_embd_kv, n_ctx);
        ggml_format_name(kv->k[il], "cache_k_l%d", il);
        ggml_format_name(kv->v[il], "cache_v_l%d", il);
    }
    for (int32_t k = 0; k < kv->n_bufs; ++k) {
        if (!ggml_get_first_tensor(kv->ctx[k])) {
            continue;  // host memory holds no layer
        }
        kv->buf[k] = ggml_backend_alloc_ctx_tensors_from_buft(kv->ctx[k], where[k]);
        if (!kv->buf[k]) {
            pi_kv_cache_free(kv);
            return pi_fail(POWERINFER_ERR_NO_MEMORY, "cannot allocate a KV cache of %u cells (%.1f MiB) in %s", n_ctx,
                           2.0 * hp->n_layer * n_embd_kv * n_ctx * 2 / 1048576.0, ggml_backend_buft_name(where[k]));
        }
        // Unwritten cells are masked out, but keep them finite: 0 * NaN would poison the V product.
        ggml_backend_buffer_clear(kv->buf[k], 0);
    }
    kv->size      = n_ctx;
    kv->n_seq_max = n_seq_max;
    kv->v_trans   = v_trans;
    return POWERINFER_OK;
}

uint64_t pi_kv_cache_bytes(const struct pi_kv_cache * kv) {
    uint64_t n = 0;
    for (int32_t k = 0; k < kv->n_bufs; ++k) {
        n += kv->buf[k] ? ggml_backend_buffer_get_size(kv->buf[k]) : 0;
    }
    return n;
}

void pi_kv_cache_free(struct pi_kv_cache * kv) {
    for (int32_t k = 0; k < PI_MAX_DEVICES + 1; ++k) {
        if (kv->buf[k]) {
            ggml_backend_buffer_free(kv->buf[k]);
        }
        if (kv->ctx[k]) {
            ggml_free(kv->ctx[k]);
        }
    }
    free(kv->cell_pos);
    free(kv->cell_seq);
    memset(kv, 0, sizeof(*kv));
}

// Frees cell i when no sequence sees it any more.
static void release_if_unused(struct pi_kv_cache * kv, uint32_t i) {
    if (kv->cell_seq[i] == 0 && kv->cell_pos[i] >= 0) {
        kv->cell_pos[i] = -1;
        kv->used--;
    }
}

static void update_hi(struct pi_kv_cache * kv) {
    while (kv->hi > 0 && kv->cell_pos[kv->hi - 1] < 0) {
        kv->hi--;
    }
}

static inline bool in_range(int32_t pos, int32_t p0, int32_t p1) {
    return pos >= p0 && (p1 < 0 || pos < p1);
}

int32_t pi_kv_seq_pos_max(const struct pi_kv_cache * kv, int32_t seq) {
    const uint64_t bit = 1ull << seq;
    int32_t max = -1;
    for (uint32_t i = 0; i < kv->hi; ++i) {
        if ((kv->cell_seq[i] & bit) && kv->cell_pos[i] > max) {
            max = kv->cell_pos[i];
        }
    }
    return max;
}

void pi_kv_seq_rm(struct pi_kv_cache * kv, int32_t seq, int32_t p0, int32_t p1) {
    const uint64_t mask = seq < 0 ? ~0ull : 1ull << seq;
    for (uint32_t i = 0; i < kv->hi; ++i) {
        if ((kv->cell_seq[i] & mask) && in_range(kv->cell_pos[i], p0, p1)) {
            kv->cell_seq[i] &= ~mask;
            release_if_unused(kv, i);
        }
    }
    update_hi(kv);
}

void pi_kv_seq_cp(struct pi_kv_cache * kv, int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    const uint64_t bit = 1ull << src;
    for (uint32_t i = 0; i < kv->hi; ++i) {
        if ((kv->cell_seq[i] & bit) && in_range(kv->cell_pos[i], p0, p1)) {
            kv->cell_seq[i] |= 1ull << dst;
        }
    }
}

void pi_kv_seq_keep(struct pi_kv_cache * kv, int32_t seq) {
    const uint64_t bit = 1ull << seq;
    for (uint32_t i = 0; i < kv->hi; ++i) {
        kv->cell_seq[i] &= bit;
        release_if_unused(kv, i);
    }
    update_hi(kv);
}

int32_t pi_kv_place(struct pi_kv_cache * kv, int32_t n, const int32_t * seq, const int32_t * pos, int32_t * cells) {
    if ((uint32_t) n > kv->size - kv->used) {
        return pi_fail(POWERINFER_ERR_CONTEXT_FULL, "KV cache full: %d new tokens, %u of %u cells free", n,
                       kv->size - kv->used, kv->size);
    }
    // Where each sequence's next cell is looked for: after the last cell it sees.
    int32_t next[PI_MAX_SEQ];
    for (uint32_t s = 0; s < kv->n_seq_max; ++s) {
        next[s] = 0;
    }
    for (uint32_t i = 0; i < kv->hi; ++i) {
        for (uint64_t m = kv->cell_seq[i]; m; m &= m - 1) {
            next[__builtin_ctzll(m)] = (int32_t) i + 1;
        }
    }
    for (int32_t k = 0; k < n; ++k) {
        const int32_t s = seq[k];
        int32_t c = next[s];
        while ((uint32_t) c < kv->size && kv->cell_pos[c] >= 0) {
            ++c;
        }
        if ((uint32_t) c == kv->size) {
            // No free cell after the sequence's last one: any free cell (attention order then
            // differs from position order, which changes only the rounding).
            for (c = 0; kv->cell_pos[c] >= 0; ++c) {
            }
        }
        cells[k] = c;
        pi_kv_cell_set(kv, c, pos[k], s);
        next[s] = c + 1;
    }
    return POWERINFER_OK;
}

void pi_kv_cell_set(struct pi_kv_cache * kv, int32_t cell, int32_t pos, int32_t seq) {
    if (kv->cell_pos[cell] < 0) {
        kv->used++;
    }
    kv->cell_pos[cell] = pos;
    kv->cell_seq[cell] = 1ull << seq;
    if ((uint32_t) cell + 1 > kv->hi) {
        kv->hi = (uint32_t) cell + 1;
    }
}

void pi_kv_cell_free(struct pi_kv_cache * kv, int32_t cell) {
    kv->cell_seq[cell] = 0;
    release_if_unused(kv, (uint32_t) cell);
    update_hi(kv);
}

bool pi_kv_is_prefix_of_seq0(const struct pi_kv_cache * kv, int32_t * n_pos) {
    // Cells [0, n) hold positions 0..n-1 of sequence 0 alone, and no other cell is used.
    const uint32_t n = kv->used;
    for (uint32_t i = 0; i < n; ++i) {
        if (kv->cell_pos[i] != (int32_t) i || kv->cell_seq[i] != 1ull) {
            return false;
        }
    }
    *n_pos = (int32_t) n;
    return kv->hi == n;
}

void pi_kv_set_prefix_of_seq0(struct pi_kv_cache * kv, int32_t n_pos) {
    pi_kv_seq_rm(kv, -1, 0, -1);
    for (int32_t i = 0; i < n_pos; ++i) {
        pi_kv_cell_set(kv, i, i, 0);
    }
}
