// powerinfer.h - the public C API of the PowerInfer-Py core.
// This header is the whole contract between the core and its users (the `main`
// CLI, the Python cffi bindings). Conventions follow llama.h: opaque handles,
// *_default_params() returning plain structs, <object>_<verb> names, explicit
// *_free. Functions that can fail return NULL or a negative status; the reason
// is then available from powerinfer_last_error(). Nothing here calls exit() or
// abort() on bad input.
//
// The block between POWERINFER_CDEF_BEGIN and POWERINFER_CDEF_END is parsed by
// the Python bindings (cffi ABI mode): keep it free of preprocessor logic.
#ifndef POWERINFER_H
#define POWERINFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#    define POWERINFER_API __declspec(dllexport)
#else
#    define POWERINFER_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

// POWERINFER_CDEF_BEGIN

typedef int32_t powerinfer_token;

struct powerinfer_model;
struct powerinfer_context;
struct powerinfer_sampler;
struct powerinfer_batcher;

enum powerinfer_status {
    POWERINFER_OK               =  0,
    POWERINFER_ERR_IO           = -1, // file missing or unreadable
    POWERINFER_ERR_FORMAT       = -2, // not a GGUF, truncated or inconsistent file
    POWERINFER_ERR_UNSUPPORTED  = -3, // architecture, tensor type or feature not implemented
    POWERINFER_ERR_INVALID_ARG  = -4, // a parameter is out of range
    POWERINFER_ERR_CONTEXT_FULL = -5, // the tokens do not fit in n_ctx
    POWERINFER_ERR_NO_MEMORY    = -6,
    POWERINFER_ERR_INTERNAL     = -7,
    POWERINFER_ERR_ABORTED      = -8, // a computation interrupted on purpose (a batcher restarting a step, a cancel)
};

enum powerinfer_log_level {
    POWERINFER_LOG_NONE  = 0,
    POWERINFER_LOG_ERROR = 1,
    POWERINFER_LOG_WARN  = 2,
    POWERINFER_LOG_INFO  = 3,
    POWERINFER_LOG_DEBUG = 4,
};

enum powerinfer_sparse_mode {
    POWERINFER_SPARSE_AUTO      = 0, // the best valid mode for the file: predictor, else input, else gate, else dense
    POWERINFER_SPARSE_DENSE     = 1, // every FFN neuron, llama.cpp's graph
    POWERINFER_SPARSE_GATE      = 2, // dense gate; up and down only where |act(gate)| > threshold
    POWERINFER_SPARSE_PREDICTOR = 3, // gate, up and down only where the predictor's logit > threshold
    POWERINFER_SPARSE_INPUT     = 4, // every matrix reads only the columns of its input's entries with |x| > threshold
                                     // (thresholds per layer and input: powerinfer.input_thresholds, `powerinfer sparsify`)
};

// The inputs of input mode, per layer (powerinfer_input_stats, powerinfer.input_thresholds).
// The functions that take (il, input) also take (n_layer, 0): the output matrix's input, the
// final norm's output (powerinfer.output_threshold; absent or < 0: dense).
enum powerinfer_input {
    POWERINFER_INPUT_QKV  = 0, // the attention norm's output: q, k and v
    POWERINFER_INPUT_O    = 1, // the attention's output: o
    POWERINFER_INPUT_FFN  = 2, // the FFN norm's output: gate and up
    POWERINFER_INPUT_DOWN = 3, // act(gate) * up: down
    POWERINFER_INPUT_COUNT = 4,
    // When the output matrix reads only its kept columns, each token's this many largest
    // logits are then computed again from every column (docs/input-sparsity.md, "Exact top rows").
    POWERINFER_HEAD_EXACT_ROWS = 1024,
};

// How placement uses the devices (GPUs, iGPUs, RPC workers; docs/hybrid.md, docs/distributed.md).
enum powerinfer_split_mode {
    POWERINFER_SPLIT_AUTO   = 0, // layer split for a dense model given n_gpu_layers != 0, else hybrid
    POWERINFER_SPLIT_HYBRID = 1, // PowerInfer's: dense weights, KV cache, then the hottest FFN neurons, device by device
    POWERINFER_SPLIT_LAYER  = 2, // llama.cpp's -sm layer: the last n_gpu_layers layers, whole, by tensor_split
    POWERINFER_SPLIT_NONE   = 3, // nothing on the devices
};

struct powerinfer_model_params {
    int32_t n_threads;      // threads used while loading and as the contexts' default; <= 0: all cores
    float   vram_budget_gib;// memory budget of each device in GiB; < 0: automatic (free memory less a margin); 0: none
    int32_t n_gpu_layers;   // layer split: layers on the devices, the last ones (< 0 or > the layers: all, and the output)
    bool    use_mmap;       // map the weights instead of reading them (default true)
    bool    use_repack;     // dense matmul weights in the CPU backend's repacked layouts, as llama.cpp (default true)
    bool    vocab_only;     // load only metadata and the vocabulary (any architecture); no context can be made
    int32_t sparse_mode;    // enum powerinfer_sparse_mode
    float   sparse_threshold; // NaN: from the file (see docs/formats.md); else overrides every layer's threshold
    bool    emulate_device; // hybrid placement with the "device" emulated by a CPU buffer (tests; also env POWERINFER_EMULATE_DEVICE=1)
    bool    reset_gpu_index;// ignore <model>.generated.gpuidx and solve the placement again
    int64_t vram_budget_bytes; // > 0: the budget in bytes, exactly (overrides vram_budget_gib)
    bool    batch_weights;  // sparse modes: copies of the FFN rows the sparse path reads, in the CPU's fastest matmul
                            // layout, and ffn_down_t transposed back, for batches (prompt processing); default true
    const char *    rpc_servers;     // "host:port,host:port": RPC workers (`powerinfer rpc-server`) whose devices placement uses
    int32_t         split_mode;      // enum powerinfer_split_mode
    const float *   tensor_split;    // layer split: the devices' relative shares of the layers (NULL: by their budgets)
    int32_t         n_tensor_split;
    const int64_t * device_budgets;  // per device, in bytes (overrides vram_budget_*; device order: GPUs, then RPC)
    int32_t         n_device_budgets;
    bool    pack_dense;     // dense matmul weights that pack exactly (Q4_0, Q4_1, Q8_0: attention, the FFN in dense
                            // mode, the output) in PowerInfer's packed AVX-512 VNNI layout: each batch column
                            // computed alone (batch-invariant), several columns for little more than one; for
                            // batches of several sequences (ParallelLlama, the server's slots). Default false:
                            // ggml's kernels, bit for bit llama.cpp's. No effect without AVX-512 VNNI.
};
// What the placement put on the devices (docs/hybrid.md), all devices together. Bytes.
struct powerinfer_placement {
    char    device[128];    // "none", the one device's ggml name and description ("CPU emulation"), or "N devices"
    int32_t n_devices;      // powerinfer_get_placement_device tells each one's share
    bool    active;         // something is on a device
    bool    emulated;
    bool    from_cache;     // the FFN sets came from <model>.generated.gpuidx
    bool    layer_split;    // llama.cpp's layer split (else PowerInfer's hybrid)
    int64_t budget;         // the devices' budgets, summed
    int64_t bytes_total;    // dense + kv + compute + ffn, never above a device's budget on that device
    int64_t bytes_dense;    // attention, predictors, norms, output
    int64_t bytes_kv;
    int64_t bytes_compute;  // ggml scheduler's compute buffer on the device
    int64_t bytes_ffn;      // compact hot rows of up/gate/down (and predictor rows)
    int32_t n_layers_attn;  // layers whose attention weights are on the device
    int64_t n_hot;          // FFN neurons on the device, all layers
    int64_t n_neurons;      // n_layer * n_ff
};

// One device's share of the placement (bytes): its budget is never exceeded.
struct powerinfer_placement_device {
    char    name[128];      // "RPC0 (127.0.0.1:50052)", "Vulkan0 (...)", "CPU emulation"
    bool    rpc;
    bool    emulated;
    int64_t budget;
    int64_t bytes_total;    // dense + kv + compute + ffn
    int64_t bytes_dense;
    int64_t bytes_kv;
    int64_t bytes_compute;
    int64_t bytes_ffn;
    int32_t n_layers_attn;  // layers whose attention is here
    int64_t n_hot;          // FFN neurons here
    int64_t memory_free;    // what the device itself reports now (0 for an emulated one)
    int64_t memory_total;
};

struct powerinfer_context_params {
    uint32_t n_ctx;           // KV cache size in tokens, rounded up to a multiple of 256 as llama.cpp does; 0: the model's training context
    uint32_t n_batch;         // largest number of tokens computed in one graph
    uint32_t seed;            // default seed for samplers created without one
    int32_t  n_threads;       // decode threads; <= 0: the model's n_threads
    int32_t  n_threads_batch; // prompt threads; <= 0: n_threads
    int32_t  flash_attn;      // 1: ggml's flash-attention op; 0: the plain attention graph (llama-cpp-python's
                              // default); < 0 (default): auto, on except for dense mode on a standard GGUF,
                              // which keeps llama.cpp's graph and its exact results
    bool     embeddings;      // also keep the final-norm hidden states of the output rows
    bool     collect_activations; // calibration: histogram |act(gate)| per layer (runs the dense FFN)
    int32_t  sparse_max_batch; // largest batch that takes the sparse FFN path (the union of the tokens' active
                               // neurons is read; each token uses its own); larger batches run dense. < 0: the
                               // measured default (docs/formats.md); at most 32
    uint32_t n_seq_max;        // sequences the KV cache can hold (powerinfer_decode_batch); 0 or 1: one, at most 64
    bool     batch_invariant;  // ggml's reference CPU kernels for K-quant matmuls (no tiling) and, with flash_attn,
                               // the core's own attention (each token over its own cells in position order): a
                               // token's result then does not depend on the rest of its batch or on where its
                               // sequence's cells sit (docs/parallel.md); default false
};

// A batch of tokens of one or more sequences, with llama_batch's meaning (one sequence
// per token: to share a prefix between sequences, decode it once and powerinfer_kv_seq_cp it).
struct powerinfer_batch {
    int32_t                  n_tokens;
    const powerinfer_token * token;   // [n_tokens]
    const int32_t *          pos;     // [n_tokens] or NULL: each sequence continues after its last cached position
    const int32_t *          seq_id;  // [n_tokens] in [0, n_seq_max) or NULL: all sequence 0
    const int8_t *           logits;  // [n_tokens] nonzero: keep this token's logits; NULL: only the last token's
};

// A bias added to one token's logit before sampling (llama_logit_bias).
struct powerinfer_logit_bias {
    powerinfer_token token;
    float            bias;
};

struct powerinfer_sampler_params {
    uint32_t seed;            // 0xFFFFFFFF: random
    float    temp;            // <= 0: greedy
    int32_t  top_k;           // <= 0: disabled
    float    top_p;           // >= 1: disabled
    float    min_p;           // <= 0: disabled
    float    typical_p;       // >= 1: disabled
    int32_t  min_keep;        // candidates the truncating samplers always keep (>= 1)
    int32_t  mirostat;        // 0: off, 1: Mirostat, 2: Mirostat 2.0 (replaces top-k/p, min-p, typical)
    float    mirostat_tau;
    float    mirostat_eta;
    const char * grammar;     // GBNF grammar constraining the output; NULL or "": none
    const char * grammar_root;// start rule; NULL: "root"
    int32_t  penalty_last_n;  // tokens considered by the penalties; 0: disabled, -1: n_ctx
    float    penalty_repeat;  // 1.0: disabled
    float    penalty_freq;    // 0.0: disabled
    float    penalty_present; // 0.0: disabled
    int32_t  n_logit_bias;    // entries of logit_bias (0: none)
    const struct powerinfer_logit_bias * logit_bias; // added to the logits before the rest of the chain
};

struct powerinfer_batcher_params {
    int32_t lookahead;      // tokens a sequence running ahead may have sampled and not yet handed over (>= 1)
    float   max_gather_ms;  // longest a step waits for the lockstep sequences' decodes (also at most the last step's duration)
    float   restart_within; // a new request (a run's start, a decode of several tokens) that finds a step under way
                            // for less than this share of the average step's time interrupts it, and the step is
                            // computed again with the request in it (once per step; 0: never). Dense models only.
    float   prompt_slice_ms;// a prompt is computed in chunks, one per step, between the other sequences' decode
                            // steps: a dense model's chunk takes about this long (measured tokens per ms), at most
                            // n_batch tokens; a sparse model's chunks are n_batch tokens (a lone decode's ubatches,
                            // so it takes the FFN path it takes alone). <= 0: n_batch tokens.
};

struct powerinfer_batcher_stats {
    int64_t n_steps;          // powerinfer_decode_batch calls
    int64_t n_prompt_tokens;  // tokens of requests of more than one token
    int64_t n_gen_tokens;     // tokens of one-token requests (generation steps)
    int32_t max_batch_tokens; // largest batch computed
    double  busy_ms;          // time spent computing steps
    int64_t n_restarts;       // steps interrupted for a new request and computed again (restart_within)
    double  restart_ms;       // time the interrupted steps had computed, thrown away
    int64_t n_prompt_chunks;  // chunks of prompts computed (a prompt longer than a chunk takes several steps)
    double  max_step_ms;      // the longest step computed
    int32_t kv_cells_used;    // KV cells in use after the last step (shared cells count once)
    int64_t sparse_active;    // FFN neurons the sparse steps computed, all layers (powerinfer_sparse_stats summed)
    int64_t sparse_total;     // FFN neurons those steps considered
};

struct powerinfer_timings {
    double  t_load_ms;
    double  t_prompt_ms;  // time in decode calls of more than one token
    int32_t n_prompt;
    double  t_eval_ms;    // time in decode calls of one token
    int32_t n_eval;
};

// ---- errors and logging ----------------------------------------------------
// Message of the last failed call on this thread ("" if none).
POWERINFER_API const char * powerinfer_last_error(void);
// Status (enum powerinfer_status) of the last failed call on this thread (POWERINFER_OK if none).
POWERINFER_API int32_t powerinfer_last_status(void);
// Messages from the core, ggml and libllama at or above this level go to stderr (each
// call installs the core's filter as ggml's and libllama's log callback again).
POWERINFER_API void powerinfer_log_set_level(int32_t level);
POWERINFER_API const char * powerinfer_version(void);
POWERINFER_API const char * powerinfer_system_info(void);
// The ISA level the sparse kernels run at ("avx512", "avxvnni", "avx2", "dotprod", "scalar"):
// the best this CPU executes, chosen when the library loads, or the one the environment
// variable POWERINFER_KERNELS names if this CPU runs it.
POWERINFER_API const char * powerinfer_kernel_level(void);
// The levels this library has and this CPU runs, best first, comma-separated.
POWERINFER_API const char * powerinfer_kernel_levels(void);
// Switches the kernels to `level` for models loaded afterwards (tests, benchmarks); false when
// this library lacks it or this CPU cannot run it. Call while nothing is computing.
POWERINFER_API bool powerinfer_set_kernel_level(const char * level);

// ---- model -----------------------------------------------------------------
POWERINFER_API struct powerinfer_model_params powerinfer_model_default_params(void);
// Loads a GGUF model; NULL on error. Weights are mmapped, not copied.
POWERINFER_API struct powerinfer_model * powerinfer_model_load(const char * path, struct powerinfer_model_params params);
// Models, contexts and samplers are reference counted: *_free releases the caller's
// reference. A context and a sampler hold their model, a batcher its context and the
// sampler of each sequence it runs, so no order of frees frees memory still in use.
// A second owner of the same model (returns model): free it once more.
POWERINFER_API struct powerinfer_model * powerinfer_model_retain(struct powerinfer_model * model);
POWERINFER_API void powerinfer_model_free(struct powerinfer_model * model);

POWERINFER_API const char * powerinfer_model_arch(const struct powerinfer_model * model);
// Whether the core builds a graph for this architecture ("llama", "qwen2", "bamboo", "falcon");
// the others run on libllama (the fallback engine), sparse through the module (docs/accel.md).
POWERINFER_API bool powerinfer_arch_supported(const char * arch);
// 1 when the core builds the file's architecture, 0 when it does not (libllama runs it), or a
// negative status for a file that is not a readable GGUF.
POWERINFER_API int32_t powerinfer_model_arch_of_file(const char * path);
POWERINFER_API int32_t powerinfer_model_n_vocab(const struct powerinfer_model * model);
POWERINFER_API int32_t powerinfer_model_n_ctx_train(const struct powerinfer_model * model);
POWERINFER_API int32_t powerinfer_model_n_embd(const struct powerinfer_model * model);
POWERINFER_API int32_t powerinfer_model_n_layer(const struct powerinfer_model * model);
POWERINFER_API int32_t powerinfer_model_n_head(const struct powerinfer_model * model);
POWERINFER_API int32_t powerinfer_model_n_ff(const struct powerinfer_model * model);
POWERINFER_API uint64_t powerinfer_model_size(const struct powerinfer_model * model);   // bytes of weights
POWERINFER_API uint64_t powerinfer_model_n_params(const struct powerinfer_model * model);
// Bytes of the named weight tensor in the file, or -1 if there is none.
POWERINFER_API int64_t powerinfer_model_tensor_nbytes(const struct powerinfer_model * model, const char * name);
// The sparse mode the model runs in (AUTO resolved), and its name.
POWERINFER_API int32_t powerinfer_model_sparse_mode(const struct powerinfer_model * model);
// Dense matmul weights computed by the packed kernels (pack_dense); 0 when none.
POWERINFER_API int32_t powerinfer_model_n_packed(const struct powerinfer_model * model);
POWERINFER_API const char * powerinfer_sparse_mode_name(int32_t mode);
// The activation threshold of layer il in gate or predictor mode.
POWERINFER_API float powerinfer_model_sparse_threshold(const struct powerinfer_model * model, int32_t il);
// Input mode: the threshold of input `input` (enum powerinfer_input) of layer il (< 0: it runs
// dense), and whether its matrices run input-sparse (false: dense, by its threshold or a type
// with no column form).
POWERINFER_API float powerinfer_model_input_threshold(const struct powerinfer_model * model, int32_t il, int32_t input);
POWERINFER_API bool  powerinfer_model_input_sparse(const struct powerinfer_model * model, int32_t il, int32_t input);
// Name of the FFN activation in use ("silu", "relu", "gelu").
POWERINFER_API const char * powerinfer_model_ffn_activation(const struct powerinfer_model * model);

// GGUF metadata, rendered as strings (arrays as "[n items]", llama.cpp style).
// Each returns the length of the full string, or -1 if absent; writes at most buf_size bytes, NUL-terminated.
POWERINFER_API int32_t powerinfer_model_meta_count(const struct powerinfer_model * model);
POWERINFER_API int32_t powerinfer_model_meta_key_by_index(const struct powerinfer_model * model, int32_t i, char * buf, size_t buf_size);
POWERINFER_API int32_t powerinfer_model_meta_val_str_by_index(const struct powerinfer_model * model, int32_t i, char * buf, size_t buf_size);
POWERINFER_API int32_t powerinfer_model_meta_val_str(const struct powerinfer_model * model, const char * key, char * buf, size_t buf_size);

// ---- vocabulary (libllama's tokenizer, loaded vocab-only from the same file) ----
// The three text functions return INT32_MIN on invalid arguments (e.g. a token id out of range).
POWERINFER_API powerinfer_token powerinfer_token_bos(const struct powerinfer_model * model); // -1 if none
POWERINFER_API powerinfer_token powerinfer_token_eos(const struct powerinfer_model * model); // -1 if none
POWERINFER_API bool powerinfer_token_is_eog(const struct powerinfer_model * model, powerinfer_token token);
POWERINFER_API bool powerinfer_vocab_add_bos(const struct powerinfer_model * model);
// Returns the number of tokens, or -(needed size) if n_tokens_max is too small.
POWERINFER_API int32_t powerinfer_tokenize(const struct powerinfer_model * model, const char * text, int32_t text_len,
                                           powerinfer_token * tokens, int32_t n_tokens_max,
                                           bool add_special, bool parse_special);
// Returns the number of bytes written, or -(needed size) if buf is too small.
POWERINFER_API int32_t powerinfer_token_to_piece(const struct powerinfer_model * model, powerinfer_token token,
                                                 char * buf, int32_t buf_size, bool special);
POWERINFER_API int32_t powerinfer_detokenize(const struct powerinfer_model * model, const powerinfer_token * tokens,
                                             int32_t n_tokens, char * text, int32_t text_len_max,
                                             bool remove_special, bool unparse_special);
// POWERINFER_OK if `draft` proposes tokens in `target`'s vocabulary (speculative decoding's
// draft model: llama.cpp's rule): the same vocabulary type, BOS and EOS, sizes within 128 of each
// other (padding) and the same text for every token id from 5 on that both have. Else
// INVALID_ARG, with the first difference in the error message.
POWERINFER_API int32_t powerinfer_vocab_compatible(const struct powerinfer_model * target, const struct powerinfer_model * draft);

// ---- context ---------------------------------------------------------------
POWERINFER_API struct powerinfer_context_params powerinfer_context_default_params(void);
POWERINFER_API struct powerinfer_context * powerinfer_context_new(struct powerinfer_model * model, struct powerinfer_context_params params);
POWERINFER_API void powerinfer_context_free(struct powerinfer_context * ctx);
POWERINFER_API uint32_t powerinfer_n_ctx(const struct powerinfer_context * ctx);
POWERINFER_API uint32_t powerinfer_n_batch(const struct powerinfer_context * ctx);
POWERINFER_API void powerinfer_set_n_threads(struct powerinfer_context * ctx, int32_t n_threads, int32_t n_threads_batch);

// Computes n_tokens tokens at positions pos, pos+1, ... (pos <= powerinfer_kv_pos(ctx);
// cache cells from pos on are overwritten). Long inputs are split into n_batch chunks.
// Logits are kept for every token if logits_all, else for the last one only.
// Returns POWERINFER_OK or a negative status; on error the cache is left at pos.
POWERINFER_API int32_t powerinfer_decode(struct powerinfer_context * ctx, const powerinfer_token * tokens,
                                         int32_t n_tokens, int32_t pos, bool logits_all);
// Number of rows of logits from the last decode, and a pointer to row i (-1: last row); NULL if out of range.
POWERINFER_API int32_t powerinfer_n_outputs(const struct powerinfer_context * ctx);
POWERINFER_API float * powerinfer_get_logits_ith(struct powerinfer_context * ctx, int32_t i);
// Hidden state after the final norm, n_embd floats, for output row i (-1: last row);
// NULL unless the context was created with embeddings = true.
POWERINFER_API float * powerinfer_get_embeddings_ith(struct powerinfer_context * ctx, int32_t i);

// Number of positions held in the KV cache (of sequence 0).
POWERINFER_API int32_t powerinfer_kv_pos(const struct powerinfer_context * ctx);
// Keeps the first n_keep positions of the KV cache (of sequence 0; prompt-prefix reuse).
POWERINFER_API int32_t powerinfer_kv_truncate(struct powerinfer_context * ctx, int32_t n_keep);

// ---- several sequences (continuous batching) -----------------------------------
// Computes a batch mixing tokens of several sequences (created with n_seq_max > 1). Each
// sequence's tokens in the batch must have consecutive positions that continue its cached
// ones (the first = powerinfer_kv_seq_pos_max + 1); a token attends to the cached and batch
// tokens of its own sequence at positions up to its own. Logits rows are those of the
// flagged tokens, in batch order (powerinfer_get_logits_ith). Batches above n_batch are
// split. Returns POWERINFER_OK or a negative status; on error no token of the batch stays
// in the cache.
POWERINFER_API int32_t powerinfer_decode_batch(struct powerinfer_context * ctx, struct powerinfer_batch batch);
// Largest position of sequence seq in the cache, -1 if none (or seq out of range).
POWERINFER_API int32_t powerinfer_kv_seq_pos_max(const struct powerinfer_context * ctx, int32_t seq);
// Sequence seq (-1: all) forgets its positions in [p0, p1) (p1 < 0: to the end).
POWERINFER_API int32_t powerinfer_kv_seq_rm(struct powerinfer_context * ctx, int32_t seq, int32_t p0, int32_t p1);
// Sequence dst also sees src's positions in [p0, p1) (cells are shared, not copied).
POWERINFER_API int32_t powerinfer_kv_seq_cp(struct powerinfer_context * ctx, int32_t src, int32_t dst, int32_t p0, int32_t p1);
// Every sequence but seq is forgotten.
POWERINFER_API int32_t powerinfer_kv_seq_keep(struct powerinfer_context * ctx, int32_t seq);
// Cells of the KV cache in use (shared cells count once).
POWERINFER_API int32_t powerinfer_kv_used_cells(const struct powerinfer_context * ctx);
// The largest batch that takes the sparse FFN path in this context (sparse_max_batch resolved).
POWERINFER_API int32_t powerinfer_sparse_max_batch(const struct powerinfer_context * ctx);

// ---- threads -----------------------------------------------------------------------------
// ggml's CPU backend runs a graph on an OpenMP team (libgomp). libgomp keeps a pool of worker
// threads for every thread that has started a team, and once it manages more threads than
// there are CPUs its barriers sleep instead of spinning: a graph then runs 2-3x slower. So a
// thread that computed once and will not compute again for a while (a request's worker, the
// caller of a one-off decode before batching moves to another thread) should hand its
// pool back. Frees the calling thread's pool (omp_pause_resource_all, soft); its next
// compute makes a new one. Returns 1 if a pool was handed back or none existed, 0 when the
// loaded ggml has no OpenMP runtime (nothing to do).
POWERINFER_API int32_t powerinfer_release_threads(void);

// ---- continuous batching (batcher.c) ------------------------------------------------------
// A batcher owns a thread that computes every decode of a context made with n_seq_max > 1:
// what several sequences ask for, from several threads, becomes one powerinfer_decode_batch
// per step. A sequence either waits for each decode and samples itself
// (powerinfer_batcher_decode), or runs ahead (powerinfer_batcher_generate): the batcher
// samples each next token with the caller's sampler and decodes it in its next step, up to
// `lookahead` tokens ahead of what the caller has taken (powerinfer_batcher_next), so a step
// never waits for the callers. With a sparse model a step holds at most sparse_max_batch
// tokens; longer requests and a sequence's first token are computed alone (each request
// takes the FFN path it takes alone). While a batcher exists, decode only through it, and
// touch the context otherwise (KV edits, counters) only between powerinfer_batcher_lock and
// powerinfer_batcher_unlock.
POWERINFER_API struct powerinfer_batcher_params powerinfer_batcher_default_params(void);
POWERINFER_API struct powerinfer_batcher * powerinfer_batcher_new(struct powerinfer_context * ctx, struct powerinfer_batcher_params params);
// Stops the batcher: the step under way ends, the thread is joined (nothing uses a sequence's
// sampler or the context after it returns), calls waiting in the batcher return
// POWERINFER_ERR_INVALID_ARG ("closed") and it waits for them to leave. Every later call but
// powerinfer_batcher_free fails the same way. Idempotent; the context is not freed, and
// must outlive the batcher's close.
POWERINFER_API void powerinfer_batcher_close(struct powerinfer_batcher * b);
// Closes the batcher (if not closed) and frees it. No call may be in progress or follow.
POWERINFER_API void powerinfer_batcher_free(struct powerinfer_batcher * b);
// Computes n_tokens tokens of sequence seq at positions pos, pos+1, ... (its cells from pos
// on are overwritten; pos must not be past its cached positions) in the next step and waits
// for it. Copies the logits of every token (logits_all) or of the last one into `logits`
// (room for n_rows_max rows of n_vocab floats). Returns the rows copied or a negative status.
POWERINFER_API int32_t powerinfer_batcher_decode(struct powerinfer_batcher * b, int32_t seq, const powerinfer_token * tokens,
                                                 int32_t n_tokens, int32_t pos, bool logits_all,
                                                 float * logits, int32_t n_rows_max);
// Starts sequence seq running ahead: tokens (n_tokens >= 1) are decoded at positions pos...,
// then a token is sampled with smpl from the last row and handed over, and decoded in the
// next step, and so on, until n_predict tokens were sampled (<= 0: no limit), an
// end-of-generation token or one of stop_tokens was sampled, the next decode would be at
// position pos_limit or beyond, powerinfer_batcher_stop, or an error. The last token
// sampled is never decoded. smpl is the batcher's until powerinfer_batcher_stop returns.
POWERINFER_API int32_t powerinfer_batcher_generate(struct powerinfer_batcher * b, int32_t seq, const powerinfer_token * tokens,
                                                   int32_t n_tokens, int32_t pos, struct powerinfer_sampler * smpl,
                                                   int32_t n_predict, int32_t pos_limit,
                                                   const powerinfer_token * stop_tokens, int32_t n_stop_tokens);
// Waits for sequence seq's next sampled tokens and copies up to n_max of them. Returns their
// number; 0 once the run has ended and every token was taken; a negative status if an error
// ended it (after its tokens were taken).
POWERINFER_API int32_t powerinfer_batcher_next(struct powerinfer_batcher * b, int32_t seq, powerinfer_token * tokens, int32_t n_max);
// Ends sequence seq's run, if any, and waits until no step computes or samples for it; then
// the sequence keeps its first n_keep positions (n_keep < 0: all it has).
POWERINFER_API int32_t powerinfer_batcher_stop(struct powerinfer_batcher * b, int32_t seq, int32_t n_keep);
// Marks sequence seq cancelled (on) or not (off), from any thread, without waiting for a step:
// while cancelled, its run ends at once (powerinfer_batcher_next hands over the tokens already
// sampled, then returns POWERINFER_ERR_ABORTED), a pending decode returns POWERINFER_ERR_ABORTED
// before its next chunk (the chunks computed stay in its cells), and new decodes and runs of it
// fail the same way. A long prompt thus stops within one step of a cancel. Off again before the
// sequence's next work.
POWERINFER_API int32_t powerinfer_batcher_set_cancelled(struct powerinfer_batcher * b, int32_t seq, bool on);
// A lockstep sequence decodes one step after another through powerinfer_batcher_decode: a
// step waits for each of them to ask (max_gather_ms at most) before it starts, unless
// sequences running ahead are ready to step.
POWERINFER_API int32_t powerinfer_batcher_set_lockstep(struct powerinfer_batcher * b, int32_t seq, bool on);
// Queue an edit of a sequence's cells, applied in the order queued before the next step's
// decodes (or before powerinfer_batcher_lock returns), so the caller never waits for a step:
// keep sequence seq's first n_keep positions; or make sequence dst the first n positions of
// sequence src (shared cells; what dst had is forgotten).
POWERINFER_API int32_t powerinfer_batcher_kv_keep(struct powerinfer_batcher * b, int32_t seq, int32_t n_keep);
POWERINFER_API int32_t powerinfer_batcher_kv_share(struct powerinfer_batcher * b, int32_t dst, int32_t src, int32_t n);
// Exclusive use of the context between two steps (queued edits applied).
// POWERINFER_OK with the context locked (between two steps, queued edits applied), or an
// error (closed) without it.
POWERINFER_API int32_t powerinfer_batcher_lock(struct powerinfer_batcher * b);
POWERINFER_API void powerinfer_batcher_unlock(struct powerinfer_batcher * b);
// The counters, as of the last step: never waits for a step (a monitoring read).
POWERINFER_API struct powerinfer_batcher_stats powerinfer_batcher_get_stats(struct powerinfer_batcher * b);

// Context state (cached positions, their keys/values, the last logits) as bytes.
// powerinfer_state_size is exact for the current state; save returns the bytes written
// (0 if dst_size is too small); load returns POWERINFER_OK or a negative status and
// refuses state from another model or a smaller context.
POWERINFER_API size_t  powerinfer_state_size(const struct powerinfer_context * ctx);
POWERINFER_API size_t  powerinfer_state_save(const struct powerinfer_context * ctx, uint8_t * dst, size_t dst_size);
POWERINFER_API int32_t powerinfer_state_load(struct powerinfer_context * ctx, const uint8_t * src, size_t src_size);
// The same for sequence seq of a context with several (a ParallelLlama slot, between two
// steps of its batcher): its positions 0..n-1, wherever their cells are, without logits.
// Load replaces what the sequence held, into free cells (CONTEXT_FULL, nothing changed, if
// too few are free), and takes a one-sequence context's state too (its logits left out).
POWERINFER_API size_t  powerinfer_state_seq_size(const struct powerinfer_context * ctx, int32_t seq);
POWERINFER_API size_t  powerinfer_state_seq_save(const struct powerinfer_context * ctx, int32_t seq, uint8_t * dst,
                                                 size_t dst_size);
POWERINFER_API int32_t powerinfer_state_seq_load(struct powerinfer_context * ctx, int32_t seq, const uint8_t * src,
                                                 size_t src_size);

// Active FFN neurons of layer il summed over the sparse steps since the last reset
// (n_total: neurons considered). Steps through ggml's dense matmul are not counted. In
// input mode: the kept entries of the layer's four inputs, summed.
POWERINFER_API int32_t powerinfer_sparse_stats(const struct powerinfer_context * ctx, int32_t il,
                                               int64_t * n_active, int64_t * n_total);
// Input mode: kept entries of input `input` of layer il over the sparse steps since the
// last reset, per token (n_total: entries considered).
POWERINFER_API int32_t powerinfer_input_stats(const struct powerinfer_context * ctx, int32_t il, int32_t input,
                                              int64_t * n_kept, int64_t * n_total);
// Input mode: sets the threshold of input `input` of layer il for this context's later
// steps (|x| > tau kept; 0 keeps every nonzero entry). Only an input that has its column
// copy (a threshold >= 0 in the file) can change; finite tau >= 0. For measuring a
// model's sensitivity without writing files (powerinfer sparsify).
POWERINFER_API int32_t powerinfer_set_input_threshold(struct powerinfer_context * ctx, int32_t il, int32_t input, float tau);
// The path a single token's dense down projection takes in layer il on a file that stores
// it transposed (ffn_down_t, PowerInfer's files): 0 the AXPY over the rows of nonzero
// activations, 1 the matmul over the batch copy (chosen by the measured nonzero share, or
// by POWERINFER_DOWN_PATH=axpy|matmul); *share: that share's moving average, -1 before it
// is measured. Returns -1 with an error for a layer out of range.
POWERINFER_API int32_t powerinfer_down_path(const struct powerinfer_context * ctx, int32_t il, float * share);
POWERINFER_API struct powerinfer_timings powerinfer_get_timings(const struct powerinfer_context * ctx);
POWERINFER_API void powerinfer_reset_timings(struct powerinfer_context * ctx); // also resets the sparse stats

// ---- hybrid placement --------------------------------------------------------
// Per-neuron activation counts ([n_layer][n_ff], e.g. from PowerInfer's activation_{i}.pt)
// for the placement, instead of the model's blk.N.ffn_act_count. Before the first context.
POWERINFER_API int32_t powerinfer_model_set_act_counts(struct powerinfer_model * model, const float * counts,
                                                       int32_t n_layer, int32_t n_ff);
// ---- RPC worker (rpc_worker.c; docs/distributed.md) -------------------------------------
// Serves this host's CPU as a ggml-rpc device on host:port until the process ends (returns
// only on an error: a port in use, RPC missing from ggml). mem_bytes > 0 caps what clients
// may allocate there, and is what the worker reports as its memory; n_threads <= 0: 1.
// The protocol is unauthenticated: serve loopback or a trusted network only.
POWERINFER_API int32_t powerinfer_rpc_serve(const char * host, int32_t port, int64_t mem_bytes, int32_t n_threads);
// Whether this build can cap a worker's memory (it was built with ggml-backend-impl.h).
POWERINFER_API bool    powerinfer_rpc_can_cap_memory(void);

// Whether the model can no longer compute: an RPC worker holding part of it stopped answering
// (decodes fail with POWERINFER_ERR_IO naming it; load the model again once it is back).
POWERINFER_API bool powerinfer_model_failed(const struct powerinfer_model * model);

// GPUs and integrated GPUs in the installed ggml's backend registry (RPC workers not counted):
// 0 means hybrid placement has no local device (emulate_device, or rpc_servers, give it one).
POWERINFER_API int32_t powerinfer_gpu_count(void);
// A device's buffer type by its ggml name ("CPU", "Vulkan0", "CUDA0", ...), as llama.cpp's
// --override-tensor names them: the default buffer type of each device in ggml's registry
// (modules on GGML_BACKEND_PATH loaded first). NULL when no device has one by that name.
// For libllama's llama_model_tensor_buft_override (docs/accel.md#placement).
POWERINFER_API void * powerinfer_buffer_type_by_name(const char * name);
// The names powerinfer_buffer_type_by_name knows, comma-separated, into out (cap bytes,
// NUL-terminated, cut at cap); returns the length the whole list needs.
POWERINFER_API int32_t powerinfer_buffer_type_names(char * out, int32_t cap);
POWERINFER_API int32_t powerinfer_get_placement(const struct powerinfer_context * ctx, struct powerinfer_placement * out);
// Device i's share (0 <= i < n_devices of powerinfer_get_placement).
POWERINFER_API int32_t powerinfer_get_placement_device(const struct powerinfer_context * ctx, int32_t i,
                                                       struct powerinfer_placement_device * out);
// Ids of layer il's neurons on the device (ascending); returns their number (ids may be NULL).
POWERINFER_API int32_t powerinfer_layer_hot_neurons(const struct powerinfer_context * ctx, int32_t il, int32_t * ids, int32_t n_max);

// ---- profiling, calibration and test entry points ---------------------------
// Used by the offline tools (powerinfer profile, calibrate) and the tests; a program
// that only runs models needs none of them.

// Histogram of |act(gate)| of layer il since the context was made (collect_activations):
// n_bins log-spaced bins over [10^log10_min, 10^log10_max), the first also counting
// smaller values. Returns the core's bin count; fills counts only if n_bins equals it.
POWERINFER_API int32_t powerinfer_activation_histogram(const struct powerinfer_context * ctx, int32_t il, uint64_t * counts,
                                                       int32_t n_bins, float * log10_min, float * log10_max);

// Histogram of |x| of input `input` (enum powerinfer_input) of layer il, as
// powerinfer_activation_histogram (collect_activations; dense steps).
POWERINFER_API int32_t powerinfer_input_histogram(const struct powerinfer_context * ctx, int32_t il, int32_t input,
                                                  uint64_t * counts, int32_t n_bins, float * log10_min, float * log10_max);

// Profiling: while enabled, decodes run the dense FFN and keep, for every layer, the
// FFN input and activation of the last chunk computed (a chunk is at most n_batch tokens).
POWERINFER_API int32_t powerinfer_set_ffn_capture(struct powerinfer_context * ctx, bool enable);
// Returns the number of tokens T of the last chunk (or a negative status) and points
// x_res at T x n_embd floats (token-major: the residual stream before ffn_norm, the
// predictor's input) and act at T x n_ff floats (act(gate); act(up) for FFNs without a
// gate). Valid until the next decode.
POWERINFER_API int32_t powerinfer_get_ffn_capture(struct powerinfer_context * ctx, int32_t il,
                                                  const float ** x_res, const float ** act);

// The placement solver: n_layer layers of n_groups groups; values[l * n_groups + g] is the
// activation mass of group g of layer l (non-increasing in g), cost[l] the device bytes of
// one group of layer l, max_groups[l] the per-layer cap (compute-balance bound, <= n_groups).
// Fills n_chosen[l] (a prefix of each layer's groups) maximizing the mass within budget.
POWERINFER_API int32_t powerinfer_place_groups(int32_t n_layer, int32_t n_groups, const double * values, const uint64_t * cost,
                                               const int32_t * max_groups, uint64_t budget, int32_t * n_chosen);
// ---- sampling (libllama's sampler chain) -----------------------------------
POWERINFER_API struct powerinfer_sampler_params powerinfer_sampler_default_params(void);
POWERINFER_API struct powerinfer_sampler * powerinfer_sampler_new(const struct powerinfer_model * model, struct powerinfer_sampler_params params);
POWERINFER_API void powerinfer_sampler_free(struct powerinfer_sampler * smpl);
// Samples from logits row i of the last decode (-1: last row) and records the token
// for the penalties and the grammar. Returns the token, or -1 on error: INVALID_ARG when
// nothing can be sampled (the grammar allows no token here, every logit is -inf).
POWERINFER_API powerinfer_token powerinfer_sampler_sample(struct powerinfer_sampler * smpl, struct powerinfer_context * ctx, int32_t i);
// Samples from caller-provided logits (n_vocab floats); does not record the token.
POWERINFER_API powerinfer_token powerinfer_sampler_sample_logits(struct powerinfer_sampler * smpl, const float * logits, int32_t n_vocab);
// Records a token (prompt or generated) in the penalty history and the grammar's state.
// INVALID_ARG for a token outside the vocabulary or one the grammar cannot take.
POWERINFER_API int32_t powerinfer_sampler_accept(struct powerinfer_sampler * smpl, powerinfer_token token);
POWERINFER_API void powerinfer_sampler_reset(struct powerinfer_sampler * smpl);
// The distribution the sampler would draw its next token from, given logits (n_vocab floats):
// every step of the chain but the draw (logit bias, grammar, penalties, top-k/typical/top-p/
// min-p, temperature), then a softmax over the candidates left; probs[n_vocab] gets it (0 for
// the tokens removed). A greedy chain gives its pick's one-hot. Records nothing. Speculative
// decoding's acceptance rule reads it (docs/speculative.md). INVALID_ARG for a Mirostat chain
// (its draw adapts to what it drew) and when nothing can be sampled.
POWERINFER_API int32_t powerinfer_sampler_probs(struct powerinfer_sampler * smpl, const float * logits, int32_t n_vocab,
                                                float * probs);

// ---- the ggml backend module: input sparsity inside libllama (docs/accel.md) ----
// Any architecture libllama runs (llama-cpp-python's engine, or llama.cpp's tools) gets
// input mode from a device of type ACCEL whose buffers hold the weights a sparsified GGUF
// gives thresholds. Register it before the first model, arm it with the file, load the
// model with libllama, disarm.
enum powerinfer_accel_mode {
    POWERINFER_ACCEL_OFF         = 0, // (disarmed) the module takes no weight
    POWERINFER_ACCEL_SPARSE      = 1, // the file's thresholds: input-sparse products for batches up to the max
    POWERINFER_ACCEL_PASSTHROUGH = 2, // the same weights, computed by ggml (measures the module's own cost)
    POWERINFER_ACCEL_CALIBRATE   = 3, // every matmul weight with a column form, dense, histograms of |x| (no file)
};
struct powerinfer_accel_weight {
    char     name[64];
    bool     sparse;     // runs the input-sparse product (else ggml computes it here)
    bool     calibrated; // CALIBRATE: its input's histogram is counted
    float    threshold;
    int32_t  n_mats;     // 1, or the experts of a MUL_MAT_ID stack
    int32_t  type;       // ggml type
    int64_t  n_in, n_out;
    uint64_t bytes;      // of the weight (its column copies as many again)
    int64_t  n_active;   // kept input entries, summed over the runs
    int64_t  n_total;    // entries considered
    int32_t  group_size; // matrices sharing this one's input and column copy (q/k/v, gate/up; counters shared), 1 alone
};
// Registers the module's device with ggml's registry (the libggml.so.0 libllama uses); idempotent.
POWERINFER_API int32_t powerinfer_accel_register(void);
POWERINFER_API bool powerinfer_accel_registered(void);
// The module's ggml_backend_reg_t (for libggml-powerinfer.so's ggml_backend_init, and for
// programs that register it themselves with ggml_backend_register); NULL without the module.
POWERINFER_API void * powerinfer_accel_backend_reg(void);
// Arms the module for the next model libllama loads: mode SPARSE and PASSTHROUGH read the
// thresholds of path (powerinfer.tensor_thresholds.*, or input mode's per-layer keys);
// CALIBRATE takes no file (path may be NULL). Returns a tag (> 0) that the weights placed
// while armed carry, or a negative status.
POWERINFER_API int32_t powerinfer_accel_arm(const char * path, int32_t mode);
POWERINFER_API void powerinfer_accel_disarm(void);
// Tensor names the armed file gives thresholds.
POWERINFER_API int32_t powerinfer_accel_rule_count(void);
// The largest batch the product runs (0 to 32; larger batches run ggml's matmul). Default 32.
POWERINFER_API int32_t powerinfer_accel_set_max_batch(int32_t n);
// The weights placed under tag: fills out[0..cap) and returns how many there are.
POWERINFER_API int32_t powerinfer_accel_weights(int32_t tag, struct powerinfer_accel_weight * out, int32_t cap);
// CALIBRATE: the histogram of |x| at weight `name`'s input (n_bins counts; as powerinfer_input_histogram).
POWERINFER_API int32_t powerinfer_accel_histogram(int32_t tag, const char * name, uint64_t * counts, int32_t n_bins,
                                                  float * log10_min, float * log10_max);
POWERINFER_API void powerinfer_accel_reset_stats(int32_t tag);

// POWERINFER_CDEF_END

#ifdef __cplusplus
}
#endif

#endif // POWERINFER_H
