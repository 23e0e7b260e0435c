// sparse_ops.h - neuron-aware CPU operators (ggml custom ops) for the sparse FFN.
// Shapes follow ggml: ne[0] is the fastest dimension. n_ff neurons, T tokens.
#pragma once

#include "ggml.h"

#include <stdbool.h>

// The FFN activation: for gated FFNs it applies to the gate, h = act(gate) * up.
enum pi_ffn_act {
    PI_ACT_SILU,
    PI_ACT_RELU,
    PI_ACT_GELU,
    PI_ACT_DRELU, // relu(gate) * relu(up) (Bamboo, TurboSparse)
};

// ReLU-family activations: a neuron whose activation is 0 contributes nothing.
static inline bool pi_act_is_relu(enum pi_ffn_act act) { return act == PI_ACT_RELU || act == PI_ACT_DRELU; }

// Histogram of activation magnitudes: PI_HIST_BINS log-spaced bins over
// [10^PI_HIST_LOG10_MIN, 10^PI_HIST_LOG10_MAX); bin 0 also takes everything below.
#define PI_HIST_BINS      480
#define PI_HIST_LOG10_MIN (-8.0f)
#define PI_HIST_LOG10_MAX (4.0f)

// Threshold and counters of one layer's sparse FFN; must outlive the graph.
struct pi_active_stat {
    float      threshold;
    int64_t    n_active;  // summed over runs
    int64_t    n_total;   // neurons considered, summed over runs
    uint64_t * hist;      // PI_HIST_BINS counts of |act(gate)|, when collecting (else NULL)
    const uint8_t * skip; // [n_ff] neurons computed elsewhere (hybrid placement: on the device), or NULL
    int64_t    nz_active; // PI_ACTIVE_NONZERO lists (a dense FFN's down projection): nonzero activations,
    int64_t    nz_total;  // and activations considered, summed over runs
};

// Adds |x| of every element of x (F32) to stat->hist. Returns a tensor to expand into
// the graph; nothing reads it.
// Thread ith of nth adds its share of x's entries (F32 [n, T], rows contiguous) to hist
// (PI_HIST_BINS counts of |x|, log-spaced; atomics: the counts do not depend on the split).
void pi_histogram_add(const struct ggml_tensor * x, uint64_t * hist, int ith, int nth);

struct ggml_tensor * pi_activation_histogram(struct ggml_context * ctx, struct ggml_tensor * x, struct pi_active_stat * stat);

// An active list: I32 [PI_INDEX_LEN(n_ff)]. Element 0 is the number of active neurons n,
// elements 1..n their ids in ascending order; the next two are counters with which the
// fused operator's threads share out its work (the list's makers zero them); from element
// n_ff + PI_INDEX_EXTRA on, entry k is the token mask of the k-th active neuron: bit t set
// when the neuron is active for token t (a batch reads the union of its tokens' rows, and
// each token uses only its own neurons, so its result is the one it gets alone).
#define PI_INDEX_EXTRA 3
#define PI_INDEX_LEN(n_ff) (2 * (n_ff) + PI_INDEX_EXTRA)
#define PI_INDEX_MAX_TOKENS 32  // tokens a mask holds; larger batches use the union for every token

// The token masks of an active list.
static inline const int32_t * pi_index_masks(const int32_t * idx, int64_t n_ff) { return idx + n_ff + PI_INDEX_EXTRA; }

// When a neuron's score makes it active (tau: stat->threshold).
enum pi_active_rule {
    PI_ACTIVE_ABOVE,    // score > tau: gate mode (|act(gate)|, or act(gate) for ReLU)
    PI_ACTIVE_AT_LEAST, // score >= tau: predictor mode (PowerInfer skips a neuron iff logit < tau)
    PI_ACTIVE_NONZERO,  // score != 0, tau and stat->skip ignored: the exact AXPY of a dense FFN
};

// score: F32 [n_ff, T]. Result: an active list (above) of the neurons whose score passes
// `rule` for any token (the union over the batch), with each token's own in the masks,
// leaving out neurons with stat->skip[i] set. Each run adds to stat's counters (skipped neurons included),
// but for PI_ACTIVE_NONZERO: a dense step's AXPY is no sparse step.
struct ggml_tensor * pi_active_index(struct ggml_context * ctx, struct ggml_tensor * score, enum pi_active_rule rule,
                                     struct pi_active_stat * stat);

// Every neuron not in stat->skip, as a list like pi_active_index's (hybrid placement, for
// batches above the sparse crossover). ref only orders the op in the graph.
struct ggml_tensor * pi_cold_index(struct ggml_context * ctx, struct ggml_tensor * ref, int64_t n_ff, struct pi_active_stat * stat);

// x: F32 [n, T] -> [n, T] of `type` (the weights' vec_dot type); x itself if type is F32.
struct ggml_tensor * pi_convert_rows(struct ggml_context * ctx, struct ggml_tensor * x, enum ggml_type type);

// w: [n_embd, n_ff] any type (row i = neuron i's input weights), xq: [n_embd, T] of
// w's vec_dot type, idx: from pi_active_index. Result: F32 [n_ff, T], row i = w_i . x_t
// for active i, 0 for the others.
struct ggml_tensor * pi_sparse_matvec(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * xq,
                                      struct ggml_tensor * idx);

// wt: [n_embd, n_ff] any type (ffn_down_t: row i = neuron i's output weights),
// h: F32 [n_ff, T], idx as above. Result: F32 [n_embd, T] = sum over active i of
// h[i, t] * wt_i (rows with h[i, t] == 0 are skipped).
struct ggml_tensor * pi_sparse_axpy(struct ggml_context * ctx, struct ggml_tensor * wt, struct ggml_tensor * h,
                                    struct ggml_tensor * idx);

// The largest batch pi_sparse_ffn takes (its partial sums grow with the batch).
#define PI_FFN_MAX_TOKENS 8

// The FFN of the active neurons, fused: for each active neuron i (idx as above) and
// token t it is active for, h = act(gate_i . x_t) * f(up_i . x_t) (f = relu for dReLU, identity else),
// or a[i, t] * f(up_i . x_t) when the activation a (F32 [n_ff, T], gate mode) is given,
// or act(up_i . x_t) without a gate; the result F32 [n_embd, T] = sum over active i of
// h[i, t] * down_t_i. up, gate: [n_embd, n_ff] (gate NULL when a is given or the FFN
// has none), down_t: [n_embd, n_ff] (row i = neuron i's output weights), xq: [n_embd, T]
// of up's vec_dot type, xg: of gate's (may be xq). Each neuron's rows are read once.
struct ggml_tensor * pi_sparse_ffn(struct ggml_context * ctx, struct ggml_tensor * up, struct ggml_tensor * gate,
                                   struct ggml_tensor * a, struct ggml_tensor * down_t, struct ggml_tensor * xq,
                                   struct ggml_tensor * xg, struct ggml_tensor * idx, enum pi_ffn_act act);

// Input mode's output matrix: logits: F32 [n_vocab, T], computed from the kept columns of
// w ([n_embd, n_vocab], the output matrix); x: F32 [n_embd, T], the whole input. Each token's
// `k` largest logits (NaN never among them; ties to the lower row) are replaced, in place, by
// w_i . x over every column (x converted to w's vec_dot type, as ggml's dense product does).
// Each token uses only its own rows, so its result is the one it gets alone.
struct ggml_tensor * pi_head_exact_top(struct ggml_context * ctx, struct ggml_tensor * logits, struct ggml_tensor * w,
                                       struct ggml_tensor * x, int32_t k);
