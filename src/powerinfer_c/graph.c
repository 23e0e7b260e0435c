// graph.c - builds the forward graph of one batch of tokens for every architecture the
// core runs (llama, qwen2, bamboo, falcon): attention over the KV cache, then the FFN in
// the model's sparse mode (dense, gate or predictor, through the neuron-aware operators
// of sparse_ops.c) and, with hybrid placement, split between the device and the CPU.
// The dense path keeps llama.cpp's op order so results agree with it.
#include "powerinfer-impl.h"
#include "packed_matmul.h"
#include "sparse_ops.h"

#include "ggml-cpu.h"

#include <math.h>
#include <string.h>

// RMSNorm followed by the learned scale.
static struct ggml_tensor * build_norm(struct ggml_context * ctx, struct ggml_tensor * x,
                                       struct ggml_tensor * w, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), w);
}

static struct ggml_tensor * build_rope(struct ggml_context * ctx, struct ggml_tensor * x, const struct pi_hparams * hp,
                                       const struct pi_graph_inputs * in) {
    return ggml_rope_ext(ctx, x, in->pos, NULL, hp->n_rot, hp->rope_type, hp->n_ctx_train,
                         hp->rope_freq_base, hp->rope_freq_scale, 0.0f, 1.0f, 32.0f, 1.0f);
}

// LayerNorm with learned scale and bias (llama.cpp's order: norm, * w, + b).
static struct ggml_tensor * build_layer_norm(struct ggml_context * ctx, struct ggml_tensor * x,
                                             struct ggml_tensor * w, struct ggml_tensor * b, float eps) {
    return ggml_add(ctx, ggml_mul(ctx, ggml_norm(ctx, x, eps), w), b);
}

static struct ggml_tensor * build_act(struct ggml_context * ctx, enum pi_ffn_act act, struct ggml_tensor * x) {
    switch (act) {
        case PI_ACT_RELU:
        case PI_ACT_DRELU: return ggml_relu(ctx, x);
        case PI_ACT_GELU: return ggml_gelu(ctx, x);
        default:          return ggml_silu(ctx, x);
    }
}

// act(gate) * up, or act(up) for non-gated FFNs; rows that are 0 in both stay 0.
static struct ggml_tensor * build_glu(struct ggml_context * ctx, enum pi_ffn_act act,
                                      struct ggml_tensor * gate, struct ggml_tensor * up) {
    if (!gate) {
        return build_act(ctx, act, up);
    }
    switch (act) {
        case PI_ACT_RELU: return ggml_reglu_split(ctx, gate, up);
        case PI_ACT_DRELU: return ggml_mul(ctx, ggml_relu(ctx, gate), ggml_relu(ctx, up));
        case PI_ACT_GELU: return ggml_geglu_split(ctx, gate, up);
        default:          return ggml_swiglu_split(ctx, gate, up);
    }
}

// The up projection's share of h = act(gate) * f(up): relu(up) for dReLU, else up.
static struct ggml_tensor * up_term(struct ggml_context * ctx, enum pi_ffn_act act, struct ggml_tensor * up) {
    return act == PI_ACT_DRELU ? ggml_relu(ctx, up) : up;
}

// ---- input mode ----------------------------------------------------------------------------

// Whether this step reads the matrices by their kept input columns (input mode): batches up
// to sparse_max_batch, never a sequence's first token (see build_ffn), never while profiling
// or calibrating (those want every value).
static bool input_step(const struct powerinfer_model * model, const struct pi_graph_params * gp) {
    return model->hp.sparse_mode == POWERINFER_SPARSE_INPUT && gp->n_tokens <= gp->sparse_max_batch &&
           gp->n_tokens <= PI_COLMAT_MAX_TOKENS && !gp->capture && !gp->first_token && gp->input_ops && !gp->inputs[0].hist;
}

// A step input mode does not take (a batch above sparse_max_batch, or one holding a
// sequence's first token) still applies its rule to every input that has a column copy:
// the entries with |x| <= tau are zeroed before ggml's dense matmul, so each token's
// result is the one the sparse product gives it up to rounding, however the prompt was cut
// into batches (a prompt cache, a slot adopting another's prefix, n_batch). Tokens at a
// sequence's position 0 keep every entry (see build_ffn). Not while profiling or
// calibrating (those want every value); not for a lone first token (nothing to zero).
static bool input_mask_step(const struct powerinfer_model * model, const struct pi_graph_params * gp) {
    return model->hp.sparse_mode == POWERINFER_SPARSE_INPUT && !input_step(model, gp) && !gp->capture && gp->input_ops &&
           !gp->inputs[0].hist && !(gp->first_token && gp->n_tokens == 1);
}

// y = x with the entries |x| <= tau zeroed (NaN kept, as the sparse product keeps it), token
// t left whole where keep[t] != 0. Threads share each token's entries.
static void input_mask_rows(struct ggml_tensor * dst, const struct ggml_tensor * x, const struct ggml_tensor * keep, int ith,
                            int nth, const struct pi_active_stat * stat) {
    const float tau = stat->threshold;
    const int64_t n = x->ne[0], j0 = n * ith / nth, j1 = n * (ith + 1) / nth;
    for (int64_t t = 0; t < x->ne[1]; ++t) {
        const float * restrict src = (const float *) ((const char *) x->data + t * x->nb[1]);
        float * restrict y = (float *) ((char *) dst->data + t * dst->nb[1]);
        if (keep && ((const float *) keep->data)[t] != 0.0f) {
            memcpy(y + j0, src + j0, (size_t) (j1 - j0) * sizeof(float));
            continue;
        }
        for (int64_t j = j0; j < j1; ++j) {
            y[j] = fabsf(src[j]) <= tau ? 0.0f : src[j];
        }
    }
}

static void input_mask_op1(struct ggml_tensor * dst, const struct ggml_tensor * x, int ith, int nth, void * ud) {
    input_mask_rows(dst, x, NULL, ith, nth, ud);
}

static void input_mask_op2(struct ggml_tensor * dst, const struct ggml_tensor * x, const struct ggml_tensor * keep, int ith,
                           int nth, void * ud) {
    input_mask_rows(dst, x, keep, ith, nth, ud);
}

// The input of input i of layer il's dense product: x, or x under input mode's rule
// (input_mask_step).
static struct ggml_tensor * input_masked(struct ggml_context * ctx, const struct powerinfer_model * model,
                                         const struct pi_graph_params * gp, struct pi_graph_inputs * in, int il, int i,
                                         struct ggml_tensor * x) {
    struct pi_input_op * op = &gp->input_ops[il * POWERINFER_INPUT_COUNT + i];
    if (!input_mask_step(model, gp) || op->cm->n_segs == 0 || x->type != GGML_TYPE_F32) {
        return x;
    }
    if (!ggml_is_contiguous(x) || x->ne[2] != 1 || x->ne[3] != 1) {
        x = ggml_cont_2d(ctx, x, x->ne[0], ggml_nelements(x) / x->ne[0]);
    }
    struct ggml_tensor * keep = NULL;  // [1, T]: 1 at a sequence's first token
    if (gp->first_token) {
        if (!in->first_tok) {  // an input only when some product uses it (else it would stay unallocated)
            in->first_tok = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, gp->n_tokens);
            ggml_set_name(in->first_tok, "inp_first_tok");
            ggml_set_input(in->first_tok);
        }
        if (x->ne[1] != gp->n_tokens && !in->first_out) {  // the last layer keeps only the output rows
            in->first_out = ggml_get_rows(ctx, in->first_tok, in->out_ids);
        }
        keep = x->ne[1] == gp->n_tokens ? in->first_tok : in->first_out;
    }
    return keep ? ggml_map_custom2(ctx, x, keep, input_mask_op2, GGML_N_TASKS_MAX, op->stat)
                : ggml_map_custom1(ctx, x, input_mask_op1, GGML_N_TASKS_MAX, op->stat);
}

// The input-sparse product of input i of layer il when this step takes it and the input
// has a column copy; NULL otherwise (the caller multiplies densely).
static struct ggml_tensor * input_sparse(struct ggml_context * ctx, const struct powerinfer_model * model,
                                         const struct pi_graph_params * gp, int il, int i, struct ggml_tensor * x) {
    struct pi_input_op * op = &gp->input_ops[il * POWERINFER_INPUT_COUNT + i];
    if (!input_step(model, gp) || op->cm->n_segs == 0 || x->ne[1] < 1) {
        return NULL;
    }
    if (!ggml_is_contiguous(x) || x->ne[2] != 1 || x->ne[3] != 1) {
        x = ggml_cont_2d(ctx, x, x->ne[0], ggml_nelements(x) / x->ne[0]);
    }
    return pi_input_sparse_matmul(ctx, op, x);
}

// Calibration (collect_activations): adds |x| of input i of layer il to its histogram.
static void input_histogram(struct ggml_context * ctx, struct ggml_cgraph * gf, const struct pi_graph_params * gp, int il, int i,
                            struct ggml_tensor * x) {
    struct pi_active_stat * st = gp->inputs ? &gp->inputs[il * POWERINFER_INPUT_COUNT + i] : NULL;
    if (st && st->hist && !gp->capture) {
        ggml_build_forward_expand(gf, pi_activation_histogram(ctx, ggml_is_contiguous(x) ? x : ggml_cont(ctx, x), st));
    }
}

// Rows [r0, r0 + n) of y [rows, T] as a contiguous [n, T] (a view for one token).
static struct ggml_tensor * rows_of(struct ggml_context * ctx, struct ggml_tensor * y, int64_t r0, int64_t n) {
    struct ggml_tensor * v = ggml_view_2d(ctx, y, n, y->ne[1], y->nb[1], (size_t) r0 * ggml_element_size(y));
    return y->ne[1] == 1 ? v : ggml_cont(ctx, v);
}

// w . x through w's packed copy w_p (pack_dense, packed predictors) while w is the file's
// tensor (placement may swap in a device copy, which then computes), else ggml's matmul.
static struct ggml_tensor * packed_or_mul(struct ggml_context * ctx, const struct powerinfer_model * model, struct ggml_tensor * w,
                                          struct ggml_tensor * w_p, struct ggml_tensor * x) {
    if (!w_p || w->buffer != model->buf_weights) {
        return ggml_mul_mat(ctx, w, x);
    }
    return pi_packed_matmul(ctx, w_p, ggml_is_contiguous(x) && x->ne[2] == 1 && x->ne[3] == 1
                                          ? x : ggml_cont_2d(ctx, x, x->ne[0], ggml_nelements(x) / x->ne[0]));
}

// Down projection of h [n_ff, n_tokens]: a matmul through ffn_down, or through its batch
// copy (repack.c) for files that store only ffn_down_t; else, for single tokens of
// ReLU-family models, an AXPY over the rows of ffn_down_t with a nonzero activation. The
// AXPY wins while most of h is zero and loses when it is not (a dense-mode step reads
// every row either way, the AXPY slower per row), so each layer takes the path its
// measured nonzero share calls for (gp->down_matmul, context.c); under the matmul the
// share is still counted (the nonzero list is built and nothing reads it).
static struct ggml_tensor * build_down(struct ggml_context * ctx, struct ggml_cgraph * gf, const struct powerinfer_model * model,
                                       const struct pi_layer * l, enum pi_ffn_act act, struct ggml_tensor * h,
                                       struct pi_active_stat * stat, bool matmul) {
    if (l->ffn_down) {
        return packed_or_mul(ctx, model, l->ffn_down, l->ffn_down_p, h);
    }
    const bool axpy_wanted = h->ne[1] == 1 && pi_act_is_relu(act);
    if (l->ffn_down_b && (!axpy_wanted || matmul)) {
        if (axpy_wanted) {
            ggml_build_forward_expand(gf, pi_active_index(ctx, h, PI_ACTIVE_NONZERO, stat));
        }
        return l->ffn_down_b_packed ? pi_packed_matmul(ctx, l->ffn_down_b, h) : ggml_mul_mat(ctx, l->ffn_down_b, h);
    }
    return pi_sparse_axpy(ctx, l->ffn_down_t, h, pi_active_index(ctx, h, PI_ACTIVE_NONZERO, stat));
}

static struct ggml_tensor * build_ffn_hybrid(struct ggml_context * ctx, const struct powerinfer_model * model, int il,
                                            struct ggml_tensor * x, struct ggml_tensor * x_res, struct pi_active_stat * stat,
                                            bool sparse);
static struct ggml_tensor * build_ffn_input(struct ggml_context * ctx, const struct powerinfer_model * model,
                                            const struct pi_graph_params * gp, int il, struct ggml_tensor * x);

// logit = fc2 . relu(fc1 . x_res): the predictor's score of every neuron; [n_ff, T].
static struct ggml_tensor * predictor_logits(struct ggml_context * ctx, const struct powerinfer_model * model,
                                             const struct pi_layer * l, struct ggml_tensor * x_res) {
    return packed_or_mul(ctx, model, l->fc2, l->fc2_p, ggml_relu(ctx, packed_or_mul(ctx, model, l->fc1, l->fc1_p, x_res)));
}

// Gate mode's activity score: act(gate) itself for ReLU-family activations, else |act(gate)|.
static struct ggml_tensor * gate_score(struct ggml_context * ctx, enum pi_ffn_act act, struct ggml_tensor * a) {
    return pi_act_is_relu(act) ? a : ggml_abs(ctx, a);
}

// The FFN over the neurons in idx, through down: with the gate's activation `a` already
// computed densely (gate mode), h = a * f(up rows); else act over the gate and up rows.
static struct ggml_tensor * build_sparse_rows(struct ggml_context * ctx, const struct pi_layer * l, enum pi_ffn_act act,
                                              struct ggml_tensor * x, struct ggml_tensor * a, struct ggml_tensor * idx) {
    struct ggml_tensor * xq = pi_convert_rows(ctx, x, ggml_get_type_traits_cpu(l->ffn_up->type)->vec_dot_type);
    struct ggml_tensor * gate = a ? NULL : l->ffn_gate;
    struct ggml_tensor * xg = NULL;
    if (gate) {
        const enum ggml_type t = ggml_get_type_traits_cpu(gate->type)->vec_dot_type;
        xg = t == xq->type ? xq : pi_convert_rows(ctx, x, t);
    }
    // Batches up to PI_FFN_MAX_TOKENS take the fused operator; larger ones (hybrid
    // placement's CPU side during prompts) the separate operators.
    if (x->ne[1] <= PI_FFN_MAX_TOKENS) {
        return pi_sparse_ffn(ctx, l->ffn_up, gate, a, l->ffn_down_t, xq, xg, idx, act);
    }
    struct ggml_tensor * up = pi_sparse_matvec(ctx, l->ffn_up, xq, idx);
    struct ggml_tensor * h = a ? ggml_mul(ctx, a, up_term(ctx, act, up))
                               : build_glu(ctx, act, gate ? pi_sparse_matvec(ctx, gate, xg, idx) : NULL, up);
    return pi_sparse_axpy(ctx, l->ffn_down_t, h, idx);
}

// x: normed FFN input [n_embd, n_tokens], x_res: the residual stream before ffn_norm
// (the predictor's input). Returns [n_embd, n_tokens].
static struct ggml_tensor * build_ffn(struct ggml_context * ctx, struct ggml_cgraph * gf, const struct powerinfer_model * model,
                                      int il, struct ggml_tensor * x, struct ggml_tensor * x_res, struct pi_active_stat * stat,
                                      const struct pi_graph_params * gp, struct pi_graph_inputs * in) {
    const struct pi_layer * l = &model->layers[il];
    const enum pi_ffn_act act = model->hp.ffn_act;
    const int32_t mode = model->hp.sparse_mode;
    // A sequence's first token takes every neuron: there the model builds the outsized
    // residual values its later tokens' attention leans on (the attention sink), through
    // neurons that fire almost only there, so a predictor trained on ordinary positions
    // misses them and the whole sequence derails (ReLU-SmolLM2: a passage whose first
    // token was a tab lost 3.9 nats per token in predictor mode). One dense step per sequence.
    // The batch decides, not x's rows: the last layer of a dense batch keeps only its output
    // rows, which would otherwise go sparse (and count as a sparse step) alone.
    const bool sparse = mode != POWERINFER_SPARSE_DENSE && gp->n_tokens <= gp->sparse_max_batch && !stat->hist && !gp->capture &&
                        !gp->first_token;

    if (model->offload.layers[il].n_hot > 0 && !stat->hist && !gp->capture) {
        return build_ffn_hybrid(ctx, model, il, x, x_res, stat, sparse);
    }
    if (input_step(model, gp)) {
        return build_ffn_input(ctx, model, gp, il, x);
    }

    if (sparse && mode == POWERINFER_SPARSE_GATE) {
        // Dense gate; neuron i is active when |act(gate_i)| > tau (ReLU: act > tau).
        struct ggml_tensor * a = build_act(ctx, act, ggml_mul_mat(ctx, l->ffn_gate, x));
        return build_sparse_rows(ctx, l, act, x, a, pi_active_index(ctx, gate_score(ctx, act, a), PI_ACTIVE_ABOVE, stat));
    }
    if (sparse && mode == POWERINFER_SPARSE_PREDICTOR) {
        // logit = fc2 . relu(fc1 . x_res); neuron i is active when logit_i >= tau (PowerInfer's rule).
        struct ggml_tensor * logit = predictor_logits(ctx, model, l, x_res);
        return build_sparse_rows(ctx, l, act, x, NULL, pi_active_index(ctx, logit, PI_ACTIVE_AT_LEAST, stat));
    }
    input_histogram(ctx, gf, gp, il, POWERINFER_INPUT_FFN, x);
    x = input_masked(ctx, model, gp, in, il, POWERINFER_INPUT_FFN, x);
    // Every neuron: through the batch copies where the sparse path keeps the file's rows.
    const bool down_mm = gp->down_matmul && gp->down_matmul[il];
    struct ggml_tensor * up   = l->ffn_up_b ? ggml_mul_mat(ctx, l->ffn_up_b, x) : packed_or_mul(ctx, model, l->ffn_up, l->ffn_up_p, x);
    struct ggml_tensor * gate = !l->ffn_gate ? NULL : l->ffn_gate_b ? ggml_mul_mat(ctx, l->ffn_gate_b, x)
                                                                     : packed_or_mul(ctx, model, l->ffn_gate, l->ffn_gate_p, x);
    if (gp->capture) {
        // Profiling: keep x_res and act(gate) (act(up) without a gate) for the host.
        struct ggml_tensor * a = build_act(ctx, act, gate ? gate : up);
        ggml_set_output(x_res);
        ggml_set_output(a);
        in->cap_x[il]   = x_res;
        in->cap_act[il] = a;
        return build_down(ctx, gf, model, l, act, gate ? ggml_mul(ctx, a, up_term(ctx, act, up)) : a, stat, down_mm);
    }
    struct ggml_tensor * h;
    if (stat->hist && gate) {
        // Calibration: record |act(gate)| (the gate-mode criterion), then act * up.
        struct ggml_tensor * a = build_act(ctx, act, gate);
        ggml_build_forward_expand(gf, pi_activation_histogram(ctx, a, stat));
        h = ggml_mul(ctx, a, up_term(ctx, act, up));
    } else {
        h = build_glu(ctx, act, gate, up);
    }
    input_histogram(ctx, gf, gp, il, POWERINFER_INPUT_DOWN, h);
    return build_down(ctx, gf, model, l, act, input_masked(ctx, model, gp, in, il, POWERINFER_INPUT_DOWN, h), stat, down_mm);
}

// Input mode's FFN: gate and up (one product, their rows stacked) and down, each reading
// the columns of its kept inputs; a matrix without a column copy runs dense.
static struct ggml_tensor * build_ffn_input(struct ggml_context * ctx, const struct powerinfer_model * model,
                                            const struct pi_graph_params * gp, int il, struct ggml_tensor * x) {
    const struct pi_layer * l = &model->layers[il];
    const enum pi_ffn_act act = model->hp.ffn_act;
    const int64_t n_ff = model->hp.n_ff;
    struct ggml_tensor * gu = input_sparse(ctx, model, gp, il, POWERINFER_INPUT_FFN, x);
    struct ggml_tensor * h;
    if (gu && l->ffn_gate && act != PI_ACT_DRELU) {
        // gate's rows, then up's, per token: ggml's fused GLU takes the halves of each row
        h = act == PI_ACT_RELU ? ggml_reglu(ctx, gu) : act == PI_ACT_GELU ? ggml_geglu(ctx, gu) : ggml_swiglu(ctx, gu);
    } else if (gu) {
        h = build_glu(ctx, act, l->ffn_gate ? rows_of(ctx, gu, 0, n_ff) : NULL, l->ffn_gate ? rows_of(ctx, gu, n_ff, n_ff) : gu);
    } else {
        struct ggml_tensor * up   = packed_or_mul(ctx, model, l->ffn_up, l->ffn_up_p, x);
        struct ggml_tensor * gate = l->ffn_gate ? packed_or_mul(ctx, model, l->ffn_gate, l->ffn_gate_p, x) : NULL;
        h = build_glu(ctx, act, gate, up);
    }
    struct ggml_tensor * down = input_sparse(ctx, model, gp, il, POWERINFER_INPUT_DOWN, h);
    return down ? down : packed_or_mul(ctx, model, l->ffn_down, l->ffn_down_p, h);
}

// Hybrid FFN (placement.c, offload.c): the device computes its compact hot rows densely through down,
// the CPU runs the sparse operators on the other neurons, and the two [n_embd, T]
// partial outputs are added. The device applies the same activity test as the CPU
// (predictor logit or |act(gate)| above tau) when the batch is small enough to be
// sparse, so the result does not depend on where a neuron lives.
static struct ggml_tensor * build_ffn_hybrid(struct ggml_context * ctx, const struct powerinfer_model * model, int il,
                                            struct ggml_tensor * x, struct ggml_tensor * x_res, struct pi_active_stat * stat,
                                            bool sparse) {
    const struct pi_layer *       l  = &model->layers[il];
    const struct pi_offload_layer * ol = &model->offload.layers[il];
    const enum pi_ffn_act act  = model->hp.ffn_act;
    const bool            pred = model->hp.sparse_mode == POWERINFER_SPARSE_PREDICTOR;
    const int64_t         n_ff = model->hp.n_ff;
    const float           tau  = stat->threshold;

    struct ggml_tensor * pre = pred ? ggml_relu(ctx, packed_or_mul(ctx, model, l->fc1, l->fc1_p, x_res)) : NULL;  // [r, T]

    // Device side.
    struct ggml_tensor * out_dev = NULL;
    {
        struct ggml_tensor * up = ggml_mul_mat(ctx, ol->up, x);                            // [n_pad, T]
        struct ggml_tensor * a  = ol->gate ? build_act(ctx, act, ggml_mul_mat(ctx, ol->gate, x)) : NULL;
        struct ggml_tensor * h  = a ? ggml_mul(ctx, a, up_term(ctx, act, up)) : build_act(ctx, act, up);
        if (sparse) {
            // 1 where the neuron is active, else 0: gate mode step(score - tau) (score > tau),
            // predictor mode 1 - step(tau - logit) (logit >= tau), as on the CPU side.
            struct ggml_tensor * on;
            if (pred) {
                struct ggml_tensor * below = ggml_step(ctx, ggml_scale_bias(ctx, ggml_mul_mat(ctx, ol->fc2, pre), -1.0f, tau));
                on = ggml_scale_bias(ctx, below, -1.0f, 1.0f);
            } else {
                on = ggml_step(ctx, ggml_scale_bias(ctx, gate_score(ctx, act, a), 1.0f, -tau));
            }
            h = ggml_mul(ctx, h, on);
        }
        out_dev = ggml_mul_mat(ctx, ol->down, h);                                          // [n_embd, T]
    }
    if (ol->n_hot == n_ff) {
        return out_dev;
    }

    // CPU side: the sparse operators over the neurons the device does not hold.
    struct ggml_tensor * idx, * a = NULL;
    if (!pred) {
        a = build_act(ctx, act, ggml_mul_mat(ctx, l->ffn_gate, x));  // dense gate (gate mode)
    }
    if (!sparse) {
        idx = pi_cold_index(ctx, a ? a : x, n_ff, stat);
    } else if (pred) {
        idx = pi_active_index(ctx, packed_or_mul(ctx, model, l->fc2, l->fc2_p, pre), PI_ACTIVE_AT_LEAST, stat);
    } else {
        idx = pi_active_index(ctx, gate_score(ctx, act, a), PI_ACTIVE_ABOVE, stat);
    }
    return ggml_add(ctx, build_sparse_rows(ctx, l, act, x, a, idx), out_dev);
}

// Writes this batch's K and V into the cache and attends over cells [0, n_kv).
// q, k, v: [n_embd_head, n_head(_kv), n_tokens]; result: [n_embd_head*n_head, n_tokens]
static struct ggml_tensor * build_attn(struct ggml_context * ctx, struct ggml_cgraph * gf,
                                       const struct pi_hparams * hp, const struct pi_kv_cache * kv, int il,
                                       const struct pi_graph_params * gp, const struct pi_graph_inputs * in,
                                       struct ggml_tensor * q, struct ggml_tensor * k, struct ggml_tensor * v) {
    const int64_t n_tokens  = gp->n_tokens;
    const int64_t head      = hp->n_embd_head;
    const int64_t n_embd_kv = head * hp->n_head_kv;
    struct ggml_tensor * kc = kv->k[il];
    struct ggml_tensor * vc = kv->v[il];

    // Store, through row indices rather than position offsets so the graph does not
    // depend on the position (and can be reused). The stores are expanded into the graph
    // first so they run before the reads below.
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, kc, ggml_reshape_2d(ctx, k, n_embd_kv, n_tokens), in->k_idxs));
    if (kv->v_trans) {
        // Transposed V: every element is its own row; v_idxs holds channel * size + cell.
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, ggml_reshape_2d(ctx, vc, 1, ggml_nelements(vc)),
                                                    ggml_reshape_2d(ctx, v, 1, n_embd_kv * n_tokens), in->v_idxs));
    } else {
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, vc, ggml_reshape_2d(ctx, v, n_embd_kv, n_tokens), in->k_idxs));
    }
    struct ggml_tensor * kq_mask = in->kq_mask;

    const float kq_scale = 1.0f / sqrtf((float) head);
    if (gp->pi_attn) {
        return ggml_reshape_2d(ctx, pi_attention(ctx, q, kc, vc, in->kv_cells, hp->n_head_kv, kq_scale),
                               head * hp->n_head, n_tokens);
    }
    struct ggml_tensor * qp = ggml_permute(ctx, q, 0, 2, 1, 3);  // [head, n_tokens, n_head]
    struct ggml_tensor * kk = ggml_view_3d(ctx, kc, head, gp->n_kv, hp->n_head_kv,
                                           kc->nb[1], ggml_row_size(kc->type, head), 0);
    struct ggml_tensor * cur;
    if (gp->flash_attn) {
        struct ggml_tensor * vv = ggml_view_3d(ctx, vc, head, gp->n_kv, hp->n_head_kv,
                                               vc->nb[1], ggml_row_size(vc->type, head), 0);
        cur = ggml_flash_attn_ext(ctx, qp, kk, vv, kq_mask, kq_scale, 0.0f, 0.0f);
        ggml_prec_set_acc(cur, GGML_PREC_F32);
        cur = ggml_reshape_2d(ctx, cur, head * hp->n_head, n_tokens);
    } else {
        struct ggml_tensor * kq = ggml_mul_mat(ctx, kk, qp);  // [n_kv, n_tokens, n_head]
        ggml_prec_set_acc(kq, GGML_PREC_F32);
        kq = ggml_soft_max_ext(ctx, kq, kq_mask, kq_scale, 0.0f);
        struct ggml_tensor * vv = ggml_view_3d(ctx, vc, gp->n_kv, head, hp->n_head_kv,
                                               vc->nb[1], vc->nb[1] * head, 0);
        struct ggml_tensor * kqv = ggml_mul_mat(ctx, vv, kq);  // [head, n_tokens, n_head]
        cur = ggml_permute(ctx, kqv, 0, 2, 1, 3);                // [head, n_head, n_tokens]
        cur = ggml_cont_2d(ctx, cur, head * hp->n_head, n_tokens);
    }
    return cur;
}

// The attention's output projection: input-sparse in input mode, else dense.
static struct ggml_tensor * build_wo(struct ggml_context * ctx, struct ggml_cgraph * gf, const struct powerinfer_model * model,
                                     const struct pi_graph_params * gp, struct pi_graph_inputs * in, int il,
                                     struct ggml_tensor * attn) {
    const struct pi_layer * l = &model->layers[il];
    input_histogram(ctx, gf, gp, il, POWERINFER_INPUT_O, attn);
    struct ggml_tensor * o = input_sparse(ctx, model, gp, il, POWERINFER_INPUT_O, attn);
    return o ? o : packed_or_mul(ctx, model, l->wo, l->wo_p, input_masked(ctx, model, gp, in, il, POWERINFER_INPUT_O, attn));
}

struct ggml_cgraph * pi_build_graph(struct ggml_context * ctx, const struct powerinfer_model * model,
                                    const struct pi_kv_cache * kv, const struct pi_graph_params * gp,
                                    struct pi_graph_inputs * in) {
    const struct pi_hparams * hp = &model->hp;
    const int64_t n_tokens = gp->n_tokens;
    const int64_t head     = hp->n_embd_head;

    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, PI_GRAPH_MAX_NODES, false);

    in->tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_tokens);
    ggml_set_name(in->tokens, "inp_tokens");
    ggml_set_input(in->tokens);
    in->pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_tokens);
    ggml_set_name(in->pos, "inp_pos");
    ggml_set_input(in->pos);
    in->kq_mask = in->kv_cells = NULL;
    if (gp->pi_attn) {
        in->kv_cells = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1 + gp->n_kv, n_tokens);
        ggml_set_name(in->kv_cells, "inp_kv_cells");
        ggml_set_input(in->kv_cells);
    } else {
        in->kq_mask = ggml_new_tensor_2d(ctx, gp->flash_attn ? GGML_TYPE_F16 : GGML_TYPE_F32, gp->n_kv, n_tokens);
        ggml_set_name(in->kq_mask, "inp_kq_mask");
        ggml_set_input(in->kq_mask);
    }
    in->k_idxs = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens);
    ggml_set_name(in->k_idxs, "inp_k_idxs");
    ggml_set_input(in->k_idxs);
    in->v_idxs = NULL;
    if (kv->v_trans) {
        in->v_idxs = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, (int64_t) hp->n_embd_head * hp->n_head_kv * n_tokens);
        ggml_set_name(in->v_idxs, "inp_v_idxs");
        ggml_set_input(in->v_idxs);
    }
    in->first_tok = in->first_out = NULL;  // made by the first input_masked that needs them
    in->out_ids = NULL;
    if (gp->n_outputs < n_tokens) {
        in->out_ids = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, gp->n_outputs);
        ggml_set_name(in->out_ids, "inp_out_ids");
        ggml_set_input(in->out_ids);
    }

    struct ggml_tensor * inpL = ggml_get_rows(ctx, model->tok_embd, in->tokens);  // [n_embd, n_tokens]
    // Calibrating input mode's output matrix wants every row's final norm: the rows are
    // selected after it, not before the last FFN.
    const bool head_hist = gp->inputs && gp->inputs[pi_input_index(model, hp->n_layer, 0)].hist && !gp->capture;
    const bool select_early = in->out_ids && !gp->capture && !head_hist;

    for (int il = 0; il < hp->n_layer && model->arch == PI_ARCH_FALCON; ++il) {
        // Falcon: attention and FFN both read LayerNorm(x); x + attn + ffn.
        const struct pi_layer * l = &model->layers[il];
        const float eps = hp->norm_rms_eps;
        struct ggml_tensor * attn_norm = build_layer_norm(ctx, inpL, l->attn_norm, l->attn_norm_b, eps);
        struct ggml_tensor * cur = l->attn_norm_2 ? build_layer_norm(ctx, inpL, l->attn_norm_2, l->attn_norm_2_b, eps)
                                                  : attn_norm;
        const int64_t n_q = head * hp->n_head, n_kv = head * hp->n_head_kv;
        input_histogram(ctx, gf, gp, il, POWERINFER_INPUT_QKV, cur);
        struct ggml_tensor * qkv = input_sparse(ctx, model, gp, il, POWERINFER_INPUT_QKV, cur);
        qkv = qkv ? qkv : packed_or_mul(ctx, model, l->wqkv, l->wqkv_p, input_masked(ctx, model, gp, in, il, POWERINFER_INPUT_QKV, cur));
        const size_t es = ggml_element_size(qkv);
        struct ggml_tensor * q = ggml_view_3d(ctx, qkv, head, hp->n_head, n_tokens, es * head, qkv->nb[1], 0);
        struct ggml_tensor * k = ggml_view_3d(ctx, qkv, head, hp->n_head_kv, n_tokens, es * head, qkv->nb[1], es * n_q);
        struct ggml_tensor * v = ggml_cont(ctx, ggml_view_3d(ctx, qkv, head, hp->n_head_kv, n_tokens, es * head, qkv->nb[1],
                                                             es * (n_q + n_kv)));
        q = build_rope(ctx, q, hp, in);
        k = build_rope(ctx, k, hp, in);
        cur = build_attn(ctx, gf, hp, kv, il, gp, in, q, k, v);
        cur = build_wo(ctx, gf, model, gp, in, il, cur);
        if (il == hp->n_layer - 1 && select_early) {
            cur       = ggml_get_rows(ctx, cur, in->out_ids);
            inpL      = ggml_get_rows(ctx, inpL, in->out_ids);
            attn_norm = ggml_get_rows(ctx, attn_norm, in->out_ids);
        }
        // The predictor reads the layer input (the residual stream the FFN's norm sees).
        struct ggml_tensor * ffn = build_ffn(ctx, gf, model, il, attn_norm, inpL, &gp->sparse[il], gp, in);
        inpL = ggml_add(ctx, ggml_add(ctx, ffn, cur), inpL);
    }

    for (int il = 0; il < hp->n_layer && model->arch != PI_ARCH_FALCON; ++il) {
        const struct pi_layer * l = &model->layers[il];
        struct ggml_tensor * inpSA = inpL;

        struct ggml_tensor * cur = build_norm(ctx, inpL, l->attn_norm, hp->norm_rms_eps);

        input_histogram(ctx, gf, gp, il, POWERINFER_INPUT_QKV, cur);
        struct ggml_tensor * qkv = input_sparse(ctx, model, gp, il, POWERINFER_INPUT_QKV, cur);
        const int64_t n_q = head * hp->n_head, n_kv = head * hp->n_head_kv;
        struct ggml_tensor * xm = qkv ? NULL : input_masked(ctx, model, gp, in, il, POWERINFER_INPUT_QKV, cur);
        struct ggml_tensor * q = qkv ? rows_of(ctx, qkv, 0, n_q) : packed_or_mul(ctx, model, l->wq, l->wq_p, xm);
        struct ggml_tensor * k = qkv ? rows_of(ctx, qkv, n_q, n_kv) : packed_or_mul(ctx, model, l->wk, l->wk_p, xm);
        struct ggml_tensor * v = qkv ? rows_of(ctx, qkv, n_q + n_kv, n_kv) : packed_or_mul(ctx, model, l->wv, l->wv_p, xm);
        if (l->bq) q = ggml_add(ctx, q, l->bq);
        if (l->bk) k = ggml_add(ctx, k, l->bk);
        if (l->bv) v = ggml_add(ctx, v, l->bv);
        q = ggml_reshape_3d(ctx, q, head, hp->n_head, n_tokens);
        k = ggml_reshape_3d(ctx, k, head, hp->n_head_kv, n_tokens);
        v = ggml_reshape_3d(ctx, v, head, hp->n_head_kv, n_tokens);

        q = build_rope(ctx, q, hp, in);
        k = build_rope(ctx, k, hp, in);

        cur = build_attn(ctx, gf, hp, kv, il, gp, in, q, k, v);
        cur = build_wo(ctx, gf, model, gp, in, il, cur);

        if (il == hp->n_layer - 1 && select_early) {
            // Only the output rows need the last FFN and the LM head.
            cur   = ggml_get_rows(ctx, cur, in->out_ids);
            inpSA = ggml_get_rows(ctx, inpSA, in->out_ids);
        }
        struct ggml_tensor * ffn_inp = ggml_add(ctx, cur, inpSA);

        cur = build_norm(ctx, ffn_inp, l->ffn_norm, hp->norm_rms_eps);
        cur = build_ffn(ctx, gf, model, il, cur, ffn_inp, &gp->sparse[il], gp, in);
        inpL = ggml_add(ctx, cur, ffn_inp);
    }

    if (gp->capture && in->out_ids) {
        // Capturing keeps every row through the last FFN; select the outputs here instead.
        inpL = ggml_get_rows(ctx, inpL, in->out_ids);
    }
    struct ggml_tensor * cur = model->output_norm_b
        ? build_layer_norm(ctx, inpL, model->output_norm, model->output_norm_b, hp->norm_rms_eps)
        : build_norm(ctx, inpL, model->output_norm, hp->norm_rms_eps);
    if (head_hist) {
        input_histogram(ctx, gf, gp, hp->n_layer, 0, cur);
        if (in->out_ids) cur = ggml_get_rows(ctx, cur, in->out_ids);
    }
    in->embd = cur;
    ggml_set_name(in->embd, "result_norm");
    ggml_set_output(in->embd);
    in->logits = input_sparse(ctx, model, gp, hp->n_layer, 0, cur);  // [n_vocab, n_outputs]
    struct ggml_tensor * head_x = in->logits ? NULL : input_masked(ctx, model, gp, in, hp->n_layer, 0, cur);
    if (head_x && head_x != cur) {
        // input mode's rule on a dense step: its exact top rows too, as the sparse step has them
        in->logits = packed_or_mul(ctx, model, model->output, model->output_p, head_x);
    }
    if (in->logits && ggml_backend_buffer_is_host(model->output->buffer)) {
        // the likeliest tokens' logits from every column (docs/input-sparsity.md, "Exact top rows")
        in->logits = pi_head_exact_top(ctx, in->logits, model->output, cur, POWERINFER_HEAD_EXACT_ROWS);
    }
    in->logits = in->logits ? in->logits : packed_or_mul(ctx, model, model->output, model->output_p, cur);
    ggml_set_name(in->logits, "result_output");
    ggml_set_output(in->logits);
    ggml_build_forward_expand(gf, in->logits);
    return gf;
}
