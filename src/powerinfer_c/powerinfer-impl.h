// powerinfer-impl.h - internal types shared by the core's source files.
// Not installed; users see only include/powerinfer.h.
#pragma once

#include "powerinfer.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "gguf.h"
#include "sparse_ops.h"
#include "input_sparse.h"
#include "attention.h"
#include "placement_plan.h"

#include <stdarg.h>
#include <stdatomic.h>

struct llama_model;
struct llama_vocab;

#define PI_MAX_LAYERS 512
#define PI_GRAPH_MAX_NODES 8192
#define PI_MAX_REPACK_BUFS 8

// ---- input mode's keys (docs/formats.md), read by the core (model.c) and the module (src/powerinfer_accel/) ----
// Thresholds, f32 [n_layer * POWERINFER_INPUT_COUNT] (llama/qwen2 files, written by sparsify).
#define PI_KEY_INPUT_THRESHOLDS "powerinfer.input_thresholds"
// The threshold of the output matrix's input, f32 (< 0 or absent: dense).
#define PI_KEY_OUTPUT_THRESHOLD "powerinfer.output_threshold"
// Any architecture: a threshold per weight tensor, by name (string array) and value (f32 array,
// the same length; < 0: dense). Expert stacks (MUL_MAT_ID) take one threshold for every expert.
#define PI_KEY_TENSOR_THRESHOLD_NAMES  "powerinfer.tensor_thresholds.names"
#define PI_KEY_TENSOR_THRESHOLD_VALUES "powerinfer.tensor_thresholds.values"

// ---- errors and logging (error.c) ----
// Records the message for powerinfer_last_error() and returns status (for `return pi_fail(...)`).
int32_t pi_fail(int32_t status, const char * fmt, ...) __attribute__((format(printf, 2, 3)));
void    pi_clear_error(void);
void    pi_log(int32_t level, const char * fmt, ...) __attribute__((format(printf, 2, 3)));
int32_t pi_log_level(void);
// Installs the core's log filter on ggml and libllama (idempotent).
void    pi_log_install(void);
double  pi_time_ms(void);

enum pi_arch {
    PI_ARCH_LLAMA,
    PI_ARCH_QWEN2,
    PI_ARCH_BAMBOO, // PowerInfer's Bamboo: llama's layout with dReLU, relu(gate) * relu(up)
    PI_ARCH_FALCON, // LayerNorm, fused QKV, attention and FFN in parallel from the same input
};


struct pi_hparams {
    int32_t n_vocab;
    int32_t n_ctx_train;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_ff;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t n_embd_head;   // key/value head size
    int32_t n_rot;
    int32_t rope_type;     // GGML_ROPE_TYPE_*
    float   rope_freq_base;
    float   rope_freq_scale;
    float   norm_rms_eps;
    enum pi_ffn_act ffn_act;
    int32_t sparse_mode;   // enum powerinfer_sparse_mode, resolved (never AUTO)
};

struct pi_layer {
    struct ggml_tensor * attn_norm, * attn_norm_b;     // (bias: LayerNorm architectures)
    struct ggml_tensor * attn_norm_2, * attn_norm_2_b; // falcon-40B: a second norm for attention
    struct ggml_tensor * wqkv;                         // fused q/k/v (falcon); then wq/wk/wv are NULL
    struct ggml_tensor * wq, * wk, * wv, * wo;
    struct ggml_tensor * bq, * bk, * bv;   // optional (qwen2)
    struct ggml_tensor * ffn_norm;
    struct ggml_tensor * ffn_gate;         // optional: absent for non-gated FFNs
    struct ggml_tensor * ffn_up;
    struct ggml_tensor * ffn_down;         // optional when ffn_down_t is present
    struct ggml_tensor * ffn_down_t;       // [n_embd, n_ff]: row i = neuron i's output weights
    struct ggml_tensor * fc1, * fc2;       // predictor: [n_embd, r], [r, n_ff]
    // Dense matmul weights packed for packed_matmul.c (pack_dense, repack.c), NULL when not packed.
    struct ggml_tensor * wqkv_p, * wq_p, * wk_p, * wv_p, * wo_p, * ffn_gate_p, * ffn_up_p, * ffn_down_p;
    struct ggml_tensor * fc1_p, * fc2_p;   // the predictor packed for packed_matmul.c (repack.c); used while
                                           // fc1/fc2 are the file's, NULL when not packed
    // Batch copies (repack.c), used by batches larger than the sparse path takes; NULL
    // when the tensors above serve batches as they are.
    struct ggml_tensor * ffn_gate_b, * ffn_up_b; // repacked copies of rows the sparse path reads
    struct ggml_tensor * ffn_down_b;       // [n_ff, n_embd]: ffn_down_t transposed (files without ffn_down)
    bool                 ffn_down_b_packed; // ffn_down_b is packed for packed_matmul.c (else a ggml type)
    float                sparse_tau;       // activation threshold (gate or predictor mode)
    // Input mode: per input (enum powerinfer_input) its threshold and the column copy of the
    // matrices that read it (repack.c); a copy with n_segs == 0 runs dense.
    float                in_tau[POWERINFER_INPUT_COUNT];
    struct pi_colmat     in_cm[POWERINFER_INPUT_COUNT];
};

// ---- device.c ----
// A device placement may put weights, KV cache and hot rows on: a GPU or iGPU backend's
// device, a device an RPC worker serves, or a CPU buffer standing in for one (emulated).
struct pi_device {
    bool                       emulated;  // a CPU buffer (tests, machines without a GPU)
    bool                       rpc;       // served by an RPC worker (ggml-rpc)
    char                       name[128]; // "Vulkan0 (...)", "RPC0 (127.0.0.1:50052)", "CPU emulation"
    char                       endpoint[128]; // an RPC worker's "host:port"; "" otherwise
    ggml_backend_dev_t         dev;       // NULL when emulated
    ggml_backend_t             backend;   // NULL when emulated
    ggml_backend_buffer_type_t buft;      // where its tensors live
};

// The devices placement may use, in order: n_emulated emulated ones (and nothing else), or
// every GPU/iGPU in ggml's registry, then the devices of the RPC workers in rpc_servers
// ("host:port,host:port"). Returns how many were opened into devs[0..max), or a negative
// status (an RPC worker that cannot be reached, RPC missing from this ggml build).
int32_t  pi_devices_open(struct pi_device * devs, int32_t max, int32_t n_emulated, const char * rpc_servers);
void     pi_device_free(struct pi_device * dev);
// What the device reports (the host's memory for emulated devices).
void     pi_device_memory(const struct pi_device * dev, uint64_t * free_b, uint64_t * total_b);
// Bytes a tensor of this shape takes in the device's buffer (alignment included).
uint64_t pi_device_alloc_size(const struct pi_device * dev, const struct ggml_tensor * t);
// An RPC device whose worker stopped answering (ggml-rpc with our patch; false otherwise).
bool     pi_device_failed(const struct pi_device * dev);
// Shuts down this process's connections to a failed RPC device's worker (ggml-rpc's: it
// uses a failed one no more), so that a later load makes its handshake anew, with its deadline.
void     pi_device_disconnect(const struct pi_device * dev);

// ---- offload.c ----
#define PI_OFFLOAD_GROUP 32  // device rows are placed in groups of this many neurons (Q8_0 block of the down copy)

// FFN neurons of one layer on a device: compact copies of their rows, and the mask the CPU
// side uses to skip them.
struct pi_offload_layer {
    int32_t              n_hot;   // neurons on the device
    int32_t              n_pad;   // compact rows (n_hot rounded up to PI_OFFLOAD_GROUP; padding rows are 0)
    int8_t               dev;     // the device holding them
    uint8_t *            is_hot;  // [n_ff], 1 = on the device (PowerInfer's gpu_idx); NULL when n_hot == 0
    struct ggml_tensor * up, * gate; // [n_embd, n_pad], the weights' own type
    struct ggml_tensor * down;    // [n_pad, n_embd]: columns of the down projection (float types kept, else Q8_0)
    struct ggml_tensor * fc2;     // [r, n_pad] predictor rows of the hot neurons (predictor mode)
};

// The model's weights on the devices, one set of buffers per device.
struct pi_offload {
    struct ggml_context *   ctx_dense[PI_MAX_DEVICES];  // copies of attention/predictor/norm/output (and, split by
    ggml_backend_buffer_t   buf_dense[PI_MAX_DEVICES];  // layers, dense FFN) weights
    struct ggml_context *   ctx_ffn[PI_MAX_DEVICES];    // compact hot rows
    ggml_backend_buffer_t   buf_ffn[PI_MAX_DEVICES];
    struct pi_offload_layer layers[PI_MAX_LAYERS];
};

// What a dense item is, for the plan (placement_plan.h's classes).
enum pi_item_class { PI_ITEM_ATTN, PI_ITEM_PRED, PI_ITEM_FFN_NORM, PI_ITEM_OUTPUT, PI_ITEM_FFN };

// A model tensor pointer to redirect to a device copy.
struct pi_dense_item {
    struct ggml_tensor ** slot;
    int32_t               layer;  // -1: the output classes
    enum pi_item_class    cls;
    int8_t                dev;    // the plan's device, PI_PLAN_HOST: stays
};

// Copies the items' tensors to their devices and points the model at the copies.
int32_t  pi_offload_dense(struct powerinfer_model * model, const struct pi_device * devs, struct pi_dense_item * items,
                          int32_t n_items);
// Points the items back at the file's tensors and frees the dense copies.
void     pi_offload_undo_dense(struct powerinfer_model * model, struct pi_dense_item * items, int32_t n_items);
uint64_t pi_offload_dense_bytes(const struct pi_offload * off, int32_t dev);
bool     pi_offload_holds(const struct pi_offload * off, const struct ggml_tensor * t); // t is a dense device copy
// Device bytes of one group of PI_OFFLOAD_GROUP neurons of layer il (before alignment).
uint64_t pi_offload_group_cost(const struct powerinfer_model * model, int32_t il);
// Copies the rows of the neurons in is_hot[il] ([n_ff] 0/1 per layer) into compact tensors
// on device layer_dev[il].
int32_t  pi_offload_ffn(struct powerinfer_model * model, const struct pi_device * devs, uint8_t * const * is_hot,
                        const int8_t * layer_dev);
uint64_t pi_offload_ffn_bytes(const struct pi_offload * off, int32_t dev);
void     pi_offload_free_ffn(struct pi_offload * off, int32_t n_layer);
void     pi_offload_free(struct powerinfer_model * model);

// ---- placement.c ----
// One device's share of the placement (bytes).
struct pi_placement_device {
    struct pi_device dev;
    uint64_t         budget;
    uint64_t         bytes_dense, bytes_kv, bytes_compute, bytes_ffn;
    uint64_t         bytes_contexts; // compute buffers of the model's later contexts
    int32_t          n_layers_attn;  // layers whose attention weights are here
    int64_t          n_hot;          // FFN neurons here
};

// The decision and its accounting, made for the model's first context.
struct pi_placement {
    bool    decided;     // placement was attempted (by the model's first context)
    bool    active;      // something is on a device: contexts run through a scheduler
    bool    from_cache;  // the FFN sets came from the gpuidx file
    bool    first_alive; // the deciding context (bytes_kv, bytes_compute) still exists
    bool    failed;      // an RPC worker stopped answering: the model computes nothing more
    int32_t mode;        // enum pi_plan_mode
    int8_t  kv_dev[PI_MAX_LAYERS];  // where the plan put each layer's KV cache (later contexts follow it)
    int32_t n_dev;
    struct pi_placement_device devs[PI_MAX_DEVICES];
};

// What placement needs from the context it places for; context.c implements it, so
// placement never calls into the context's file.
struct pi_placement_host {
    void *   self;
    uint64_t compute_estimate; // bytes of the context's CPU-only compute buffer
    // Re-creates the KV cache with layer il's tensors in bufts[il] (NULL: host memory; bufts
    // NULL: all in host memory). Contents are not kept (placement comes before any decode).
    int32_t (*move_kv)(void * self, const ggml_backend_buffer_type_t * bufts);
    // Bytes of layer il's KV cache tensors in buft (alignment included).
    uint64_t (*kv_layer_bytes)(void * self, int32_t il, ggml_backend_buffer_type_t buft);
    // Re-creates the scheduler over what is placed now; device_bytes[d] gets device d's
    // share of the compute buffers of the context's largest graph.
    int32_t (*measure_compute)(void * self, uint64_t * device_bytes);
    void    (*drop_scheduler)(void * self);
};

// Decides and performs the placement (once per model; a no-op without a budget or a device).
int32_t pi_placement_decide(struct powerinfer_model * model, const struct pi_placement_host * host);
// A later context of a placed model: measures its compute buffers' device shares into
// device_bytes[n_dev] and fails (nothing counted) when they do not fit in what the budgets leave.
int32_t pi_placement_admit(struct powerinfer_model * model, const struct pi_placement_host * host, uint64_t * device_bytes);
// A context goes away: its device bytes no longer count (first: it was the deciding one).
void    pi_placement_release(struct powerinfer_model * model, bool first, const uint64_t * device_bytes);
void    pi_placement_free(struct powerinfer_model * model);
// After a graph that used the devices: POWERINFER_OK, or POWERINFER_ERR_IO naming the RPC
// worker that stopped answering (the model is marked failed: later decodes fail at once).
int32_t pi_placement_check(struct powerinfer_model * model);
// Per-neuron activation counts of layer il (set by powerinfer_model_set_act_counts, else
// the file's blk.N.ffn_act_count) into out[n_ff]; false when there are none.
bool    pi_model_act_counts(const struct powerinfer_model * model, int32_t il, float * out);

// ---- gpuidx.c ----
int32_t pi_gpuidx_write(const struct powerinfer_model * model, const char * path, uint64_t capacity,
                        const uint8_t * const * is_hot);
int32_t pi_gpuidx_read(const struct powerinfer_model * model, const char * path, uint64_t * capacity, uint8_t ** is_hot);

// A read-only mapping of the whole model file.
struct pi_mapping {
    void *   addr;
    uint64_t size;
};

// Lifetime: the model, a context and a sampler are reference counted. *_free releases the
// caller's reference; a context holds one on its model, a sampler on its model (the
// grammar reads its vocabulary), a batcher on its context and on the sampler of each
// sequence it runs. So no order of frees (a garbage collector's is arbitrary) frees memory
// still in use.
struct powerinfer_model {
    atomic_int           n_refs;
    char *               path;
    enum pi_arch         arch;
    char                 arch_name[64];
    struct pi_hparams    hp;
    struct powerinfer_model_params params;  // its pointers point at the model's own copies:
    char *               rpc_servers;       //   of rpc_servers,
    float *              tensor_split;      //   tensor_split
    int64_t *            device_budgets;    //   and device_budgets

    bool                  is_powerinfer; // PWRI magic
    struct gguf_context * gguf;     // metadata (no tensor data)
    struct ggml_context * ctx_meta; // tensor descriptors, data points into the mapping
    struct pi_mapping     map;
    ggml_backend_buffer_t buf_weights;
    // weights moved into the CPU backend's repacked buffer types (repack.c)
    struct ggml_context * repack_ctx[PI_MAX_REPACK_BUFS];
    ggml_backend_buffer_t repack_buf[PI_MAX_REPACK_BUFS];
    int32_t               n_repack_bufs;
    int32_t               n_packed_dense; // weights pi_pack_dense_weights packed
    // the rows the sparse path reads, copied out of the mapping (repack.c)
    struct ggml_context * rows_ctx;
    ggml_backend_buffer_t rows_buf;
    void *                rows_addr;
    size_t                rows_size;
    // input mode's column copies (repack.c)
    void *                cols_addr;
    size_t                cols_size;
    uint64_t              n_bytes;
    uint64_t              n_params;

    struct ggml_tensor * tok_embd;
    struct ggml_tensor * output_norm;
    struct ggml_tensor * output_norm_b;
    struct ggml_tensor * output;    // == tok_embd when the output is tied
    struct ggml_tensor * output_p;  // output packed (pack_dense), NULL when not
    // Input mode's output matrix (the LM head): its threshold (< 0: dense) and column copy,
    // as a layer's inputs (pi_input_index: the input after the last layer's).
    float                head_tau;
    struct pi_colmat     head_cm;
    struct pi_layer      layers[PI_MAX_LAYERS];

    struct pi_placement  placement;
    struct pi_offload    offload;    // what placement copied to the device
    float *              act_counts; // [n_layer][n_ff] set through powerinfer_model_set_act_counts, else NULL

    // vocabulary (libllama, vocab-only)
    struct llama_model *       llm_vocab_model;
    const struct llama_vocab * vocab;

    double t_load_ms;
};

// Input mode's inputs, flat: layer il's input i at il * POWERINFER_INPUT_COUNT + i, then the
// output matrix's at n_layer * POWERINFER_INPUT_COUNT. The API names that one (n_layer, 0).
static inline int32_t pi_n_inputs(const struct powerinfer_model * model) {
    return model->hp.n_layer * POWERINFER_INPUT_COUNT + 1;
}
// The flat index of input `input` of layer il, or -1 when there is none.
static inline int32_t pi_input_index(const struct powerinfer_model * model, int32_t il, int32_t input) {
    if (il >= 0 && il < model->hp.n_layer && input >= 0 && input < POWERINFER_INPUT_COUNT) {
        return il * POWERINFER_INPUT_COUNT + input;
    }
    return il == model->hp.n_layer && input == 0 ? il * POWERINFER_INPUT_COUNT : -1;
}
// (like strchr: the copy is the model's, writable while the model is being loaded)
static inline struct pi_colmat * pi_input_cm(const struct powerinfer_model * model, int32_t k) {
    struct powerinfer_model * m = (struct powerinfer_model *) model;
    return k < m->hp.n_layer * POWERINFER_INPUT_COUNT ? &m->layers[k / POWERINFER_INPUT_COUNT].in_cm[k % POWERINFER_INPUT_COUNT]
                                                      : &m->head_cm;
}
static inline float pi_input_tau(const struct powerinfer_model * model, int32_t k) {
    return k < model->hp.n_layer * POWERINFER_INPUT_COUNT ? model->layers[k / POWERINFER_INPUT_COUNT].in_tau[k % POWERINFER_INPUT_COUNT]
                                                          : model->head_tau;
}

// ---- model_loader.c ----
// Validates the file, parses GGUF metadata and maps tensor data. Fills path, gguf,
// ctx_meta, map, buf_weights, n_bytes, n_params.
int32_t pi_model_load_file(struct powerinfer_model * model, const char * path);
void    pi_model_unload_file(struct powerinfer_model * model);
// The tensor as stored in the file (mapped), when t has the same name, type and shape;
// NULL otherwise. Repacked, row-copied and device copies keep their original here.
const struct ggml_tensor * pi_model_file_tensor(const struct powerinfer_model * model, const struct ggml_tensor * t);
// Drops the pages of the model file's mapping lying wholly inside [addr, addr + size) from
// the resident set (they are read again from the file if touched); a range outside the
// mapping is left alone.
void    pi_release_mapped_range(const struct powerinfer_model * model, const void * addr, size_t size);
// Drops the pages wholly inside [addr, addr + size), whatever they are: anonymous memory
// reads back as zeros, so only for memory that is never read again.
void    pi_release_pages(const void * addr, size_t size);

// ---- model.c ----
int32_t pi_model_load_hparams(struct powerinfer_model * model);
int32_t pi_model_bind_tensors(struct powerinfer_model * model);

// ---- repack.c ----
// Offers the pointed-to mapped weights to the CPU backend's repacked buffer types;
// moved tensors are replaced in place (each pointer offered at most once).
int32_t pi_repack_weights(struct powerinfer_model * model, struct ggml_tensor ** weights[], int32_t n_weights);
// Copies for batches of the FFN rows the sparse path reads from the mapping (ffn_up_b,
// ffn_gate_b, repacked; only with `repacked`) and ffn_down_t transposed back (ffn_down_b);
// see repack.c.
int32_t pi_make_batch_weights(struct powerinfer_model * model, bool repacked);
// Moves the rows the sparse path reads (ffn_up, ffn_down_t, ffn_gate in predictor mode) out
// of the file's mapping into one anonymous region; see repack.c.
int32_t pi_make_row_copies(struct powerinfer_model * model);
// Input mode: the column copies of every layer's matrices (layers[].in_cm); see repack.c.
int32_t pi_make_input_copies(struct powerinfer_model * model);
// Whether the predictor of this model gets packed (pi_pack_predictors), and packs it.
bool    pi_predictors_packable(const struct powerinfer_model * model);
int32_t pi_pack_predictors(struct powerinfer_model * model);
// pack_dense: packed copies (packed_matmul.h) of the dense matmul weights that pack exactly
// (attention, the FFN in dense mode, the output), which the graph then multiplies with.
int32_t pi_pack_dense_weights(struct powerinfer_model * model);
void    pi_free_row_copies(struct powerinfer_model * model);
void    pi_repack_free(struct powerinfer_model * model);

// ---- vocab.c ----
int32_t pi_vocab_load(struct powerinfer_model * model);
void    pi_vocab_free(struct powerinfer_model * model);

// ---- kv_cache.c ----
#define PI_MAX_SEQ 64  // sequences of one context (a cell's sequence set is a 64-bit mask)

struct pi_kv_cache {
    // The layers' tensors, one context and buffer per place they live (host memory first,
    // then each device holding layers): [0, n_bufs).
    struct ggml_context * ctx[PI_MAX_DEVICES + 1];
    ggml_backend_buffer_t buf[PI_MAX_DEVICES + 1];
    int32_t               n_bufs;
    struct ggml_tensor *  k[PI_MAX_LAYERS]; // [n_embd_k_gqa, n_ctx] f16, one row per cell
    struct ggml_tensor *  v[PI_MAX_LAYERS]; // [n_ctx, n_embd_v_gqa] f16 (transposed: one row per channel)
                                            // or [n_embd_v_gqa, n_ctx] with flash attention
    int32_t *             cell_pos;         // [size] position held by each cell; -1: free
    uint64_t *            cell_seq;         // [size] bit s set: sequence s sees the cell
    uint32_t              size;             // cells
    uint32_t              used;             // cells holding a position
    uint32_t              hi;               // one past the last used cell (attention spans [0, hi), padded)
    uint32_t              n_seq_max;
    bool                  v_trans;
};

// bufts[il]: where layer il's K and V live (NULL entry, or bufts NULL: host memory).
int32_t pi_kv_cache_init(struct pi_kv_cache * kv, const struct powerinfer_model * model, uint32_t n_ctx, uint32_t n_seq_max,
                         bool v_trans, const ggml_backend_buffer_type_t * bufts);
// Bytes of the cache in all its buffers.
uint64_t pi_kv_cache_bytes(const struct pi_kv_cache * kv);
void    pi_kv_cache_free(struct pi_kv_cache * kv);
// Largest position of sequence seq in the cache, -1 if it has none.
int32_t pi_kv_seq_pos_max(const struct pi_kv_cache * kv, int32_t seq);
// Sequence seq (< 0: every sequence) stops seeing its positions in [p0, p1) (p1 < 0: no end);
// cells no sequence sees are freed.
void    pi_kv_seq_rm(struct pi_kv_cache * kv, int32_t seq, int32_t p0, int32_t p1);
// dst also sees src's positions in [p0, p1): the cells are shared, nothing is copied.
void    pi_kv_seq_cp(struct pi_kv_cache * kv, int32_t src, int32_t dst, int32_t p0, int32_t p1);
// Every sequence but seq forgets everything.
void    pi_kv_seq_keep(struct pi_kv_cache * kv, int32_t seq);
// Puts n tokens (sequence seq[k], position pos[k]) into free cells, each after the last
// cell its sequence sees when there is room (so a sequence's cells stay in position order,
// which keeps flash attention's sums in the order of a sequence computed alone), and
// writes the cells to `cells`; CONTEXT_FULL (nothing placed) if fewer than n cells are free.
int32_t pi_kv_place(struct pi_kv_cache * kv, int32_t n, const int32_t * seq, const int32_t * pos, int32_t * cells);
// Cell `cell` holds position pos of sequence seq (alone); pi_kv_cell_free undoes it.
void    pi_kv_cell_set(struct pi_kv_cache * kv, int32_t cell, int32_t pos, int32_t seq);
void    pi_kv_cell_free(struct pi_kv_cache * kv, int32_t cell);
// Whether the cache holds exactly positions 0..n-1 of sequence 0 in cells 0..n-1 (the
// layout of a one-sequence context, which state files store); *n_pos gets n.
bool    pi_kv_is_prefix_of_seq0(const struct pi_kv_cache * kv, int32_t * n_pos);
// Empties the cache, then marks cells 0..n_pos-1 as positions 0..n_pos-1 of sequence 0.
void    pi_kv_set_prefix_of_seq0(struct pi_kv_cache * kv, int32_t n_pos);

// ---- graph.c ----
struct pi_graph_inputs {
    struct ggml_tensor * tokens;   // I32 [n_tokens]
    struct ggml_tensor * pos;      // I32 [n_tokens]
    struct ggml_tensor * kq_mask;  // F32/F16 [n_kv, n_tokens]; NULL with invariant attention
    struct ggml_tensor * kv_cells; // I32 [1 + n_kv, n_tokens], invariant attention only: each token's count of
                                   // visible cells, then those cells in position order
    struct ggml_tensor * out_ids;  // I32 [n_outputs], NULL when every row is an output
    struct ggml_tensor * first_tok; // F32 [1, n_tokens]: 1 at a sequence's position 0, when input mode's rule
                                    // applies to a dense step holding one (graph.c, input_mask_step), else NULL
    struct ggml_tensor * first_out; // its output rows (the last layer's), made when needed
    struct ggml_tensor * k_idxs;   // I64 [n_tokens]: cache cell of each token
    struct ggml_tensor * v_idxs;   // I64 [n_embd_kv * n_tokens] (transposed V: one index per element), else NULL
    struct ggml_tensor * logits;   // F32 [n_vocab, n_outputs]
    struct ggml_tensor * embd;     // F32 [n_embd, n_outputs], final-norm hidden states
    // FFN capture (profiling), per layer, when pi_graph_params.capture: filled by the builder
    struct ggml_tensor ** cap_x;   // [n_layer] F32 [n_embd, n_tokens]: residual stream before ffn_norm
    struct ggml_tensor ** cap_act; // [n_layer] F32 [n_ff, n_tokens]: act(gate), or act(up) without a gate
};

struct pi_graph_params {
    int32_t n_tokens;
    int32_t n_kv;       // cache cells attended (>= pos0 + n_tokens, padded; extra cells masked)
    int32_t n_outputs;  // rows with logits: 1..n_tokens
    bool    flash_attn;
    bool    pi_attn;     // pi_attention (attention.c) instead of ggml's flash attention (CPU cache)
    int32_t sparse_max_batch;       // batches up to this size take the sparse FFN path
    struct pi_active_stat * sparse; // per layer: thresholds and active-neuron counters
    struct pi_active_stat * inputs; // per layer and input: input mode's thresholds and counters (and calibration histograms)
    struct pi_input_op * input_ops; // per layer and input: input mode's column copies with those counters
    bool    capture;    // keep every layer's FFN input and activation (dense FFN path)
    bool    first_token; // the chunk holds a sequence's position 0: every FFN neuron (see build_ffn)
    const uint8_t * down_matmul;  // [n_layer] or NULL: single-token dense down through the matmul (build_down)
};


struct ggml_cgraph * pi_build_graph(struct ggml_context * ctx, const struct powerinfer_model * model,
                                    const struct pi_kv_cache * kv, const struct pi_graph_params * gp,
                                    struct pi_graph_inputs * in);

struct powerinfer_context {
    atomic_int                       n_refs;
    struct powerinfer_model *        model;
    struct powerinfer_context_params params;
    struct pi_kv_cache               kv;

    ggml_backend_t     backend;
    ggml_gallocr_t     galloc;
    void *             graph_buf;      // memory for graph-building ggml contexts
    size_t             graph_buf_size;

    int32_t *          ubatch_buf;     // [4][n_batch]: a chunk's positions, sequences, cells and output rows
    float *            scratch;        // host staging for the attention mask
    size_t             scratch_size;
    float *            logits;         // [n_outputs, n_vocab]
    float *            embd;           // [n_outputs, n_embd] when params.embeddings
    int32_t            n_outputs;
    int32_t            logits_capacity; // rows

    struct powerinfer_timings timings;
    struct pi_active_stat *   sparse;          // per layer
    struct pi_active_stat *   inputs;          // input mode: per layer and input ([il * POWERINFER_INPUT_COUNT + i])
    struct pi_input_op *      input_ops;       // the same index: the layer's column copy and those counters

    // FFN capture for the profiler (powerinfer_set_ffn_capture): host copies of the
    // last chunk's per-layer tensors.
    struct {
        bool                  enabled;
        int32_t               n_tokens;
        float *               x;      // [n_layer][n_batch][n_embd]
        float *               act;    // [n_layer][n_batch][n_ff]
        struct ggml_tensor ** tx;     // [n_layer] graph tensors of the last build
        struct ggml_tensor ** tact;
    } capture;

    // Hybrid placement: the scheduler over [device, CPU] (or [CPU] when emulated).
    ggml_backend_sched_t sched;
    bool                 placed_first;  // this context decided the placement (its KV cache may be on the device)
    uint64_t             device_bytes[PI_MAX_DEVICES];  // a later context's compute buffers on each device, counted in its budget

    // The last graph built; reused while the shapes stay the same (single-token decode
    // steps within one 256-cell span of the cache), which skips building and allocating.
    struct {
        bool                   valid;
        int32_t                n_tokens, n_kv, n_outputs;
        bool                   first_token;
        uint8_t                down_matmul[PI_MAX_LAYERS];
        struct ggml_cgraph *   gf;
        struct pi_graph_inputs in;
    } last;

    // The dense down projection of a single token on a file with ffn_down_t (a PowerInfer
    // file) and its batch copy: the AXPY over the nonzero rows of h, or the matmul over the
    // copy, per layer, by the measured share of nonzero activations (graph.c build_down).
    struct {
        float    share[PI_MAX_LAYERS];      // moving average of the nonzero share; < 0: not measured
        int64_t  seen_active[PI_MAX_LAYERS], seen_total[PI_MAX_LAYERS];  // the counters already averaged
        uint8_t  matmul[PI_MAX_LAYERS];     // the choice for the next single-token graph
        int8_t   forced;                    // POWERINFER_DOWN_PATH: 0 by the share, 1 the AXPY, 2 the matmul
    } down;
};

// Makes room for `rows` rows of logits (and embeddings, when enabled).
int32_t pi_context_reserve_outputs(struct powerinfer_context * ctx, int32_t rows);

// fn(data), asked between the graph's nodes on the CPU, interrupts the computation when it
// returns true: the decode then fails with POWERINFER_ERR_ABORTED and the batch's cells are
// free again (fn NULL: never).
void pi_context_set_abort(struct powerinfer_context * ctx, bool (*fn)(void * data), void * data);

// Reference counting (see struct powerinfer_model): retain returns its argument.
struct powerinfer_model *   pi_model_retain(struct powerinfer_model * model);
struct powerinfer_context * pi_context_retain(struct powerinfer_context * ctx);
struct powerinfer_sampler * pi_sampler_retain(struct powerinfer_sampler * smpl);
