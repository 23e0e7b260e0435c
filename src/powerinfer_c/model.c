// model.c - the model object: architecture and hyper-parameters from GGUF metadata,
// weight tensors looked up by name and shape-checked, public accessors.
#include "kernel_levels.h"
#include "powerinfer-impl.h"

#include "llama.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ---- typed metadata lookup ---------------------------------------------------

static int64_t find_key(const struct powerinfer_model * model, const char * key) {
    return gguf_find_key(model->gguf, key);
}

// Reads an integer key of any integer type. Returns 1 if found, 0 if absent, <0 on a type error.
static int32_t get_int(const struct powerinfer_model * model, const char * key, int64_t * out) {
    int64_t id = find_key(model, key);
    if (id < 0) {
        return 0;
    }
    switch (gguf_get_kv_type(model->gguf, id)) {
        case GGUF_TYPE_UINT8:  *out = gguf_get_val_u8(model->gguf, id);  return 1;
        case GGUF_TYPE_INT8:   *out = gguf_get_val_i8(model->gguf, id);  return 1;
        case GGUF_TYPE_UINT16: *out = gguf_get_val_u16(model->gguf, id); return 1;
        case GGUF_TYPE_INT16:  *out = gguf_get_val_i16(model->gguf, id); return 1;
        case GGUF_TYPE_UINT32: *out = gguf_get_val_u32(model->gguf, id); return 1;
        case GGUF_TYPE_INT32:  *out = gguf_get_val_i32(model->gguf, id); return 1;
        case GGUF_TYPE_UINT64: *out = (int64_t) gguf_get_val_u64(model->gguf, id); return 1;
        case GGUF_TYPE_INT64:  *out = gguf_get_val_i64(model->gguf, id); return 1;
        default:
            return pi_fail(POWERINFER_ERR_UNSUPPORTED, "metadata key '%s' has type %s, expected an integer",
                           key, gguf_type_name(gguf_get_kv_type(model->gguf, id)));
    }
}

static int32_t get_float(const struct powerinfer_model * model, const char * key, float * out) {
    int64_t id = find_key(model, key);
    if (id < 0) {
        return 0;
    }
    switch (gguf_get_kv_type(model->gguf, id)) {
        case GGUF_TYPE_FLOAT32: *out = gguf_get_val_f32(model->gguf, id); return 1;
        case GGUF_TYPE_FLOAT64: *out = (float) gguf_get_val_f64(model->gguf, id); return 1;
        default:
            return pi_fail(POWERINFER_ERR_UNSUPPORTED, "metadata key '%s' has type %s, expected a float",
                           key, gguf_type_name(gguf_get_kv_type(model->gguf, id)));
    }
}

static const char * get_str(const struct powerinfer_model * model, const char * key) {
    int64_t id = find_key(model, key);
    if (id < 0 || gguf_get_kv_type(model->gguf, id) != GGUF_TYPE_STRING) {
        return NULL;
    }
    return gguf_get_val_str(model->gguf, id);
}

// "<arch>.<suffix>" integer hyper-parameter within [lo, hi]; def < 0 means required.
static int32_t arch_int(const struct powerinfer_model * model, const char * suffix, int64_t def,
                        int64_t lo, int64_t hi, int32_t * out) {
    char key[256];
    snprintf(key, sizeof(key), "%s.%s", model->arch_name, suffix);
    int64_t v  = def;
    int32_t rc = get_int(model, key, &v);
    if (rc < 0) {
        return rc;
    }
    if (rc == 0 && def < 0) {
        return pi_fail(POWERINFER_ERR_FORMAT, "required metadata key '%s' is missing", key);
    }
    if (v < lo || v > hi) {
        return pi_fail(POWERINFER_ERR_FORMAT, "metadata key '%s' = %" PRId64 " is out of range [%" PRId64 ", %" PRId64 "]",
                       key, v, lo, hi);
    }
    *out = (int32_t) v;
    return POWERINFER_OK;
}

static int32_t arch_float(const struct powerinfer_model * model, const char * suffix, float def, float * out) {
    char key[256];
    snprintf(key, sizeof(key), "%s.%s", model->arch_name, suffix);
    float   v  = def;
    int32_t rc = get_float(model, key, &v);
    if (rc < 0) {
        return rc;
    }
    if (!isfinite(v)) {
        return pi_fail(POWERINFER_ERR_FORMAT, "metadata key '%s' is not finite", key);
    }
    *out = v;
    return POWERINFER_OK;
}

// ---- architecture and hyper-parameters ----------------------------------------

// Our own key stating the FFN activation ("silu", "relu", "gelu"); see docs/formats.md.
#define PI_KEY_FFN_ACTIVATION "powerinfer.ffn_activation"

static const char * act_name(enum pi_ffn_act act) {
    switch (act) {
        case PI_ACT_RELU: return "relu";
        case PI_ACT_DRELU: return "drelu";
        case PI_ACT_GELU: return "gelu";
        default:          return "silu";
    }
}

// The architectures the core builds a graph for (every other runs through libllama).
static const struct {
    const char * name;
    enum pi_arch arch;
} k_archs[] = { { "llama", PI_ARCH_LLAMA }, { "qwen2", PI_ARCH_QWEN2 }, { "bamboo", PI_ARCH_BAMBOO }, { "falcon", PI_ARCH_FALCON } };

bool powerinfer_arch_supported(const char * arch) {
    for (size_t i = 0; arch && i < sizeof(k_archs) / sizeof(k_archs[0]); ++i) {
        if (strcmp(arch, k_archs[i].name) == 0) return true;
    }
    return false;
}

int32_t powerinfer_model_arch_of_file(const char * path) {
    struct gguf_init_params gp = { .no_alloc = true, .ctx = NULL };
    struct gguf_context * g = path ? gguf_init_from_file(path, gp) : NULL;
    if (!g) return pi_fail(POWERINFER_ERR_FORMAT, "%s: not a readable GGUF file", path ? path : "(null)");
    const int64_t k = gguf_find_key(g, "general.architecture");
    const int32_t r = k >= 0 && gguf_get_kv_type(g, k) == GGUF_TYPE_STRING
                          ? (powerinfer_arch_supported(gguf_get_val_str(g, k)) ? 1 : 0)
                          : pi_fail(POWERINFER_ERR_FORMAT, "%s: metadata key 'general.architecture' is missing", path);
    gguf_free(g);
    return r;
}

int32_t pi_model_load_hparams(struct powerinfer_model * model) {
    const char * arch = get_str(model, "general.architecture");
    if (!arch) {
        return pi_fail(POWERINFER_ERR_FORMAT, "metadata key 'general.architecture' is missing");
    }
    snprintf(model->arch_name, sizeof(model->arch_name), "%s", arch);
    size_t a = 0;
    while (a < sizeof(k_archs) / sizeof(k_archs[0]) && strcmp(arch, k_archs[a].name) != 0) ++a;
    if (a < sizeof(k_archs) / sizeof(k_archs[0])) {
        model->arch = k_archs[a].arch;
    } else {
        return pi_fail(POWERINFER_ERR_UNSUPPORTED,
                       "model architecture '%s' is not implemented by the PowerInfer-Py core (supported: llama, qwen2, bamboo, falcon)",
                       arch);
    }

    struct pi_hparams * hp = &model->hp;
    int32_t rc;
    if ((rc = arch_int(model, "context_length",           -1, 1, INT32_MAX, &hp->n_ctx_train)) ||
        (rc = arch_int(model, "embedding_length",         -1, 1, 1 << 20, &hp->n_embd)) ||
        (rc = arch_int(model, "block_count",              -1, 1, PI_MAX_LAYERS, &hp->n_layer)) ||
        (rc = arch_int(model, "feed_forward_length",      -1, 1, 1 << 24, &hp->n_ff)) ||
        (rc = arch_int(model, "attention.head_count",     -1, 1, 1 << 16, &hp->n_head))) {
        return rc;
    }
    if ((rc = arch_int(model, "attention.head_count_kv", hp->n_head, 1, hp->n_head, &hp->n_head_kv))) {
        return rc;
    }
    if (hp->n_head % hp->n_head_kv != 0) {
        return pi_fail(POWERINFER_ERR_FORMAT, "n_head (%d) is not a multiple of n_head_kv (%d)", hp->n_head, hp->n_head_kv);
    }
    if (hp->n_embd % hp->n_head != 0) {
        return pi_fail(POWERINFER_ERR_FORMAT, "n_embd (%d) is not a multiple of n_head (%d)", hp->n_embd, hp->n_head);
    }
    int32_t n_embd_head_v = 0;
    if ((rc = arch_int(model, "attention.key_length",   hp->n_embd / hp->n_head, 1, 1 << 16, &hp->n_embd_head)) ||
        (rc = arch_int(model, "attention.value_length", hp->n_embd_head, 1, 1 << 16, &n_embd_head_v)) ||
        (rc = arch_int(model, "rope.dimension_count",   hp->n_embd_head, 1, hp->n_embd_head, &hp->n_rot))) {
        return rc;
    }
    if (n_embd_head_v != hp->n_embd_head) {
        return pi_fail(POWERINFER_ERR_UNSUPPORTED, "different key (%d) and value (%d) head sizes are not supported",
                       hp->n_embd_head, n_embd_head_v);
    }
    int32_t n_expert = 0;
    if ((rc = arch_int(model, "expert_count", 0, 0, INT32_MAX, &n_expert))) {
        return rc;
    }
    if (n_expert > 0) {
        return pi_fail(POWERINFER_ERR_UNSUPPORTED, "mixture-of-experts models (%s.expert_count = %d) are not supported",
                       arch, n_expert);
    }
    if ((rc = arch_float(model, model->arch == PI_ARCH_FALCON ? "attention.layer_norm_epsilon" : "attention.layer_norm_rms_epsilon",
                         1e-5f, &hp->norm_rms_eps)) ||
        (rc = arch_float(model, "rope.freq_base", 10000.0f, &hp->rope_freq_base))) {
        return rc;
    }

    // RoPE scaling: none or linear.
    hp->rope_freq_scale = 1.0f;
    char key[256];
    snprintf(key, sizeof(key), "%s.rope.scaling.type", arch);
    const char * scaling = get_str(model, key);
    float factor = 0.0f;
    if ((rc = arch_float(model, "rope.scaling.factor", 0.0f, &factor)) ||
        (factor == 0.0f && (rc = arch_float(model, "rope.scale_linear", 0.0f, &factor)))) {
        return rc;
    }
    if (scaling && strcmp(scaling, "none") != 0 && strcmp(scaling, "linear") != 0) {
        return pi_fail(POWERINFER_ERR_UNSUPPORTED, "RoPE scaling type '%s' is not supported (none, linear)", scaling);
    }
    if ((!scaling || strcmp(scaling, "linear") == 0) && factor > 0.0f) {
        hp->rope_freq_scale = 1.0f / factor;
    }
    hp->rope_type = model->arch == PI_ARCH_QWEN2 || model->arch == PI_ARCH_FALCON ? GGML_ROPE_TYPE_NEOX : GGML_ROPE_TYPE_NORMAL;

    // FFN activation: our key if present, else the architecture's usual one.
    // PowerInfer's rule: a PWRI file of architecture llama is a ReLU model.
    // Bamboo is dReLU.
    // Falcon is GELU, and its PWRI files ReLU (PowerInfer's sparse path is ReLU-only).
    hp->ffn_act = model->arch == PI_ARCH_BAMBOO ? PI_ACT_DRELU
                : model->is_powerinfer && (model->arch == PI_ARCH_LLAMA || model->arch == PI_ARCH_FALCON) ? PI_ACT_RELU
                : model->arch == PI_ARCH_FALCON ? PI_ACT_GELU : PI_ACT_SILU;
    const char * act = get_str(model, PI_KEY_FFN_ACTIVATION);
    if (act) {
        if      (strcmp(act, "silu") == 0) hp->ffn_act = PI_ACT_SILU;
        else if (strcmp(act, "relu") == 0) hp->ffn_act = PI_ACT_RELU;
        else if (strcmp(act, "gelu") == 0) hp->ffn_act = PI_ACT_GELU;
        else if (strcmp(act, "drelu") == 0) hp->ffn_act = PI_ACT_DRELU;
        else {
            return pi_fail(POWERINFER_ERR_UNSUPPORTED, "%s = '%s' is not one of silu, relu, gelu, drelu",
                           PI_KEY_FFN_ACTIVATION, act);
        }
    }
    return POWERINFER_OK;
}

// ---- tensors -----------------------------------------------------------------

// Whether the operators that read t can run its type: vectors (norms, biases) are added
// and multiplied elementwise in F32; matrices go through matmul (vec_dot), the sparse
// kernels (vec_dot, to_float) and get_rows (to_float). Anything else would reach a NULL
// function pointer or an assertion inside ggml.
static int32_t check_type(const struct ggml_tensor * t, bool vector) {
    const enum ggml_type type = t->type;
    if (vector) {
        return type == GGML_TYPE_F32 ? POWERINFER_OK
                                     : pi_fail(POWERINFER_ERR_FORMAT, "tensor '%s' has type %s; this vector must be F32",
                                               t->name, ggml_type_name(type));
    }
    const struct ggml_type_traits_cpu * cpu = ggml_get_type_traits_cpu(type);
    const bool ok = type == GGML_TYPE_F32 ||
                    (ggml_blck_size(type) > 0 && cpu->vec_dot && ggml_get_type_traits(type)->to_float &&
                     (cpu->vec_dot_type == GGML_TYPE_F32 || ggml_get_type_traits_cpu(cpu->vec_dot_type)->from_float));
    return ok ? POWERINFER_OK
              : pi_fail(POWERINFER_ERR_FORMAT, "tensor '%s' has type %s, which the CPU matrix operators do not support",
                        t->name, ggml_type_name(type));
}

// Looks a tensor up by name and checks its shape (ne0, ne1; ne1 = 0 for 1-D) and type.
static int32_t bind(const struct powerinfer_model * model, struct ggml_tensor ** out, bool required,
                    int64_t ne0, int64_t ne1, const char * fmt, ...) __attribute__((format(printf, 6, 7)));

static int32_t bind(const struct powerinfer_model * model, struct ggml_tensor ** out, bool required,
                    int64_t ne0, int64_t ne1, const char * fmt, ...) {
    char name[GGML_MAX_NAME];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof(name), fmt, ap);
    va_end(ap);

    struct ggml_tensor * t = ggml_get_tensor(model->ctx_meta, name);
    *out = t;
    if (!t) {
        return required ? pi_fail(POWERINFER_ERR_FORMAT, "tensor '%s' is missing from the model file", name)
                        : POWERINFER_OK;
    }
    const int64_t want1 = ne1 == 0 ? 1 : ne1;
    if (t->ne[0] != ne0 || t->ne[1] != want1 || t->ne[2] != 1 || t->ne[3] != 1) {
        return pi_fail(POWERINFER_ERR_FORMAT,
                       "tensor '%s' has shape [%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "], expected [%" PRId64 ", %" PRId64 "]",
                       name, t->ne[0], t->ne[1], t->ne[2], t->ne[3], ne0, want1);
    }
    return check_type(t, ne1 == 0);
}

// Predictor fc2 . relu(fc1 . x): the rank r may differ per layer, so it is read from fc1.
static int32_t bind_predictor(struct powerinfer_model * model, int32_t il) {
    struct pi_layer * l = &model->layers[il];
    char name[GGML_MAX_NAME];
    snprintf(name, sizeof(name), "blk.%d.fc1.weight", il);
    struct ggml_tensor * fc1 = ggml_get_tensor(model->ctx_meta, name);
    snprintf(name, sizeof(name), "blk.%d.fc2.weight", il);
    struct ggml_tensor * fc2 = ggml_get_tensor(model->ctx_meta, name);
    if (!fc1 && !fc2) {
        return POWERINFER_OK;
    }
    if (!fc1 || !fc2) {
        return pi_fail(POWERINFER_ERR_FORMAT, "layer %d has only one of blk.%d.fc1.weight and blk.%d.fc2.weight", il, il, il);
    }
    const int64_t r = fc1->ne[1];
    int32_t rc;
    if ((rc = bind(model, &l->fc1, true, model->hp.n_embd, r, "blk.%d.fc1.weight", il)) ||
        (rc = bind(model, &l->fc2, true, r, model->hp.n_ff, "blk.%d.fc2.weight", il))) {
        return rc;
    }
    return POWERINFER_OK;
}

int32_t pi_model_bind_tensors(struct powerinfer_model * model) {
    struct pi_hparams * hp = &model->hp;
    struct ggml_tensor * tok = ggml_get_tensor(model->ctx_meta, "token_embd.weight");
    if (!tok) {
        return pi_fail(POWERINFER_ERR_FORMAT, "tensor 'token_embd.weight' is missing from the model file");
    }
    hp->n_vocab = (int32_t) tok->ne[1];

    const int64_t n_embd   = hp->n_embd;
    const int64_t n_vocab  = hp->n_vocab;
    const int64_t n_q      = (int64_t) hp->n_embd_head * hp->n_head;
    const int64_t n_kv     = (int64_t) hp->n_embd_head * hp->n_head_kv;
    const int64_t n_ff     = hp->n_ff;
    int32_t rc;

    const bool falcon = model->arch == PI_ARCH_FALCON;
    if ((rc = bind(model, &model->tok_embd, true, n_embd, n_vocab, "token_embd.weight")) ||
        (rc = bind(model, &model->output_norm, true, n_embd, 0, "output_norm.weight")) ||
        (rc = bind(model, &model->output_norm_b, falcon, n_embd, 0, "output_norm.bias")) ||
        (rc = bind(model, &model->output, false, n_embd, n_vocab, "output.weight"))) {
        return rc;
    }
    if (!model->output) {
        model->output = model->tok_embd; // tied embeddings
    }

    for (int32_t il = 0; il < hp->n_layer; ++il) {
        struct pi_layer * l = &model->layers[il];
        if (falcon) {
            if ((rc = bind(model, &l->attn_norm_b,   true,  n_embd, 0, "blk.%d.attn_norm.bias", il)) ||
                (rc = bind(model, &l->attn_norm_2,   false, n_embd, 0, "blk.%d.attn_norm_2.weight", il)) ||
                (rc = bind(model, &l->attn_norm_2_b, !!l->attn_norm_2, n_embd, 0, "blk.%d.attn_norm_2.bias", il)) ||
                (rc = bind(model, &l->wqkv, true, n_embd, n_q + 2 * n_kv, "blk.%d.attn_qkv.weight", il))) {
                return rc;
            }
        }
        if ((rc = bind(model, &l->attn_norm, true,  n_embd, 0,      "blk.%d.attn_norm.weight", il)) ||
            (rc = bind(model, &l->wq,        !falcon, n_embd, n_q,  "blk.%d.attn_q.weight", il)) ||
            (rc = bind(model, &l->wk,        !falcon, n_embd, n_kv, "blk.%d.attn_k.weight", il)) ||
            (rc = bind(model, &l->wv,        !falcon, n_embd, n_kv, "blk.%d.attn_v.weight", il)) ||
            (rc = bind(model, &l->wo,        true,  n_q,    n_embd, "blk.%d.attn_output.weight", il)) ||
            (rc = bind(model, &l->bq,        false, n_q,    0,      "blk.%d.attn_q.bias", il)) ||
            (rc = bind(model, &l->bk,        false, n_kv,   0,      "blk.%d.attn_k.bias", il)) ||
            (rc = bind(model, &l->bv,        false, n_kv,   0,      "blk.%d.attn_v.bias", il)) ||
            (rc = bind(model, &l->ffn_norm,  !falcon, n_embd, 0,    "blk.%d.ffn_norm.weight", il)) ||
            (rc = bind(model, &l->ffn_gate,  false, n_embd, n_ff,   "blk.%d.ffn_gate.weight", il)) ||
            (rc = bind(model, &l->ffn_up,    true,  n_embd, n_ff,   "blk.%d.ffn_up.weight", il)) ||
            (rc = bind(model, &l->ffn_down,  false, n_ff,   n_embd, "blk.%d.ffn_down.weight", il)) ||
            (rc = bind(model, &l->ffn_down_t, false, n_embd, n_ff,  "blk.%d.ffn_down_t.weight", il))) {
            return rc;
        }
        if (!l->ffn_down && !l->ffn_down_t) {
            return pi_fail(POWERINFER_ERR_FORMAT, "layer %d has neither blk.%d.ffn_down.weight nor blk.%d.ffn_down_t.weight",
                           il, il, il);
        }
        if (l->ffn_down_t && l->ffn_down_t->ne[0] % ggml_blck_size(l->ffn_down_t->type) != 0) {
            return pi_fail(POWERINFER_ERR_FORMAT, "blk.%d.ffn_down_t.weight rows are not whole %s blocks",
                           il, ggml_type_name(l->ffn_down_t->type));
        }
        if ((rc = bind_predictor(model, il)) != POWERINFER_OK) {
            return rc;
        }
        if (model->arch == PI_ARCH_QWEN2 && !(l->bq && l->bk && l->bv)) {
            return pi_fail(POWERINFER_ERR_FORMAT, "qwen2 layer %d lacks its q/k/v biases", il);
        }
    }
    return POWERINFER_OK;
}

// ---- sparse mode and thresholds ------------------------------------------------------

// Our keys (docs/formats.md): per-layer gate-mode thresholds, written by the calibration tool.
#define PI_KEY_GATE_THRESHOLDS "powerinfer.gate_thresholds"
// PowerInfer's key: the predictor threshold, overridden by the environment variable.
#define PI_KEY_SPARSE_THRESHOLD "powerinfer.sparse_threshold"
#define PI_ENV_SPARSE_THRESHOLD "LLAMA_SPARSE_PRED_THRESHOLD"
// Ours: per-layer predictor thresholds (written by train-predictor), over the global one.
#define PI_KEY_SPARSE_THRESHOLDS "powerinfer.sparse_thresholds"

const char * powerinfer_sparse_mode_name(int32_t mode) {
    switch (mode) {
        case POWERINFER_SPARSE_AUTO:      return "auto";
        case POWERINFER_SPARSE_DENSE:     return "dense";
        case POWERINFER_SPARSE_GATE:      return "gate";
        case POWERINFER_SPARSE_PREDICTOR: return "predictor";
        case POWERINFER_SPARSE_INPUT:     return "input";
        default:                          return "unknown";
    }
}

// Reads an optional f32[n_layer] array of thresholds (finite; >= 0 unless allow_negative)
// into the layers. Absent: leaves them as they are.
static int32_t read_layer_thresholds(struct powerinfer_model * model, const char * key, bool allow_negative) {
    const struct pi_hparams * hp = &model->hp;
    const int64_t id = find_key(model, key);
    if (id < 0) {
        return POWERINFER_OK;
    }
    if (gguf_get_kv_type(model->gguf, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(model->gguf, id) != GGUF_TYPE_FLOAT32 ||
        gguf_get_arr_n(model->gguf, id) != (size_t) hp->n_layer) {
        return pi_fail(POWERINFER_ERR_FORMAT, "%s must be an array of %d float32", key, hp->n_layer);
    }
    const float * v = gguf_get_arr_data(model->gguf, id);
    for (int32_t il = 0; il < hp->n_layer; ++il) {
        if (!isfinite(v[il]) || (!allow_negative && v[il] < 0.0f)) {
            return pi_fail(POWERINFER_ERR_FORMAT, "%s[%d] = %g is not a valid threshold", key, il, v[il]);
        }
        model->layers[il].sparse_tau = v[il];
    }
    return POWERINFER_OK;
}

// Predictor mode, lowest to highest precedence: powerinfer.sparse_threshold, our
// per-layer powerinfer.sparse_thresholds, the environment variable, the parameter.
// Gate mode: powerinfer.gate_thresholds, then the parameter.
// Input mode: powerinfer.input_thresholds (finite, >= 0), then the parameter (every input).
static int32_t resolve_input_thresholds(struct powerinfer_model * model) {
    const struct pi_hparams * hp = &model->hp;
    const int64_t id = find_key(model, PI_KEY_INPUT_THRESHOLDS);
    const int64_t n = (int64_t) hp->n_layer * POWERINFER_INPUT_COUNT;
    if (id >= 0) {
        if (gguf_get_kv_type(model->gguf, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(model->gguf, id) != GGUF_TYPE_FLOAT32 ||
            (int64_t) gguf_get_arr_n(model->gguf, id) != n) {
            return pi_fail(POWERINFER_ERR_FORMAT, "%s must be an array of %" PRId64 " float32 (%d per layer)",
                           PI_KEY_INPUT_THRESHOLDS, n, POWERINFER_INPUT_COUNT);
        }
        const float * v = gguf_get_arr_data(model->gguf, id);
        for (int64_t k = 0; k < n; ++k) {
            if (!isfinite(v[k])) {  // < 0: this input runs dense (sparsify's choice below its break-even)
                return pi_fail(POWERINFER_ERR_FORMAT, "%s[%" PRId64 "] = %g is not a valid threshold", PI_KEY_INPUT_THRESHOLDS, k, v[k]);
            }
            model->layers[k / POWERINFER_INPUT_COUNT].in_tau[k % POWERINFER_INPUT_COUNT] = v[k];
        }
    }
    model->head_tau = -1.0f;  // the output matrix: dense unless the file or the parameter says otherwise
    const int64_t ih = find_key(model, PI_KEY_OUTPUT_THRESHOLD);
    if (ih >= 0) {
        if (gguf_get_kv_type(model->gguf, ih) != GGUF_TYPE_FLOAT32 || !isfinite(gguf_get_val_f32(model->gguf, ih))) {
            return pi_fail(POWERINFER_ERR_FORMAT, "%s must be a finite float32", PI_KEY_OUTPUT_THRESHOLD);
        }
        model->head_tau = gguf_get_val_f32(model->gguf, ih);
    }
    if (!isnan(model->params.sparse_threshold)) {
        if (!(model->params.sparse_threshold >= 0.0f) || isinf(model->params.sparse_threshold)) {
            return pi_fail(POWERINFER_ERR_INVALID_ARG, "input mode's threshold must be finite and >= 0, got %g",
                           model->params.sparse_threshold);
        }
        for (int32_t il = 0; il < hp->n_layer; ++il) {
            for (int i = 0; i < POWERINFER_INPUT_COUNT; ++i) model->layers[il].in_tau[i] = model->params.sparse_threshold;
        }
        model->head_tau = model->params.sparse_threshold;
    }
    return POWERINFER_OK;
}

static int32_t resolve_thresholds(struct powerinfer_model * model) {
    const struct pi_hparams * hp = &model->hp;
    if (hp->sparse_mode == POWERINFER_SPARSE_INPUT) {
        return resolve_input_thresholds(model);
    }
    float tau = 0.0f;
    int32_t rc;
    const bool pred = hp->sparse_mode == POWERINFER_SPARSE_PREDICTOR;
    if (pred && (rc = get_float(model, PI_KEY_SPARSE_THRESHOLD, &tau)) < 0) {
        return rc;
    }
    for (int32_t il = 0; il < hp->n_layer; ++il) model->layers[il].sparse_tau = tau;
    rc = pred ? read_layer_thresholds(model, PI_KEY_SPARSE_THRESHOLDS, true)
              : read_layer_thresholds(model, PI_KEY_GATE_THRESHOLDS, false);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    const char * env = pred ? getenv(PI_ENV_SPARSE_THRESHOLD) : NULL;
    if (env && *env) {
        char * end;
        float v = strtof(env, &end);
        if (*end || !isfinite(v)) {
            return pi_fail(POWERINFER_ERR_INVALID_ARG, "%s='%s' is not a number", PI_ENV_SPARSE_THRESHOLD, env);
        }
        for (int32_t il = 0; il < hp->n_layer; ++il) model->layers[il].sparse_tau = v;
    }
    if (!isnan(model->params.sparse_threshold)) {
        for (int32_t il = 0; il < hp->n_layer; ++il) model->layers[il].sparse_tau = model->params.sparse_threshold;
    }
    return POWERINFER_OK;
}

// Picks the sparse mode (AUTO: predictor, else gate, else dense) and checks that the
// file has what the mode needs.
static int32_t resolve_sparse_mode(struct powerinfer_model * model) {
    struct pi_hparams * hp = &model->hp;
    bool down_t = true, pred = true, gate = true;
    for (int32_t il = 0; il < hp->n_layer; ++il) {
        down_t &= model->layers[il].ffn_down_t != NULL;
        pred   &= model->layers[il].fc1 != NULL;
        gate   &= model->layers[il].ffn_gate != NULL;
    }
    const int32_t want = model->params.sparse_mode;
    const bool gate_ok = down_t && gate && (pi_act_is_relu(hp->ffn_act) || find_key(model, PI_KEY_GATE_THRESHOLDS) >= 0 ||
                                            want == POWERINFER_SPARSE_GATE);
    // Input mode needs the standard layout (ffn_down, not only ffn_down_t) and thresholds.
    bool down = true;
    for (int32_t il = 0; il < hp->n_layer; ++il) down &= model->layers[il].ffn_down != NULL;
    const bool input_ok = down && (find_key(model, PI_KEY_INPUT_THRESHOLDS) >= 0 || !isnan(model->params.sparse_threshold));
    switch (want) {
        case POWERINFER_SPARSE_AUTO:
            hp->sparse_mode = pred && down_t                                       ? POWERINFER_SPARSE_PREDICTOR
                            : down && find_key(model, PI_KEY_INPUT_THRESHOLDS) >= 0 ? POWERINFER_SPARSE_INPUT
                            : gate_ok                                              ? POWERINFER_SPARSE_GATE
                                                                                   : POWERINFER_SPARSE_DENSE;
            break;
        case POWERINFER_SPARSE_INPUT:
            if (!input_ok) {
                return pi_fail(POWERINFER_ERR_INVALID_ARG, "input mode needs %s", !down
                               ? "ffn_down in every layer (a standard GGUF, not a PowerInfer file)"
                               : "thresholds: " PI_KEY_INPUT_THRESHOLDS " in the file (powerinfer sparsify) or a sparse_threshold");
            }
            hp->sparse_mode = want;
            break;
        case POWERINFER_SPARSE_DENSE:
            hp->sparse_mode = want;
            break;
        case POWERINFER_SPARSE_GATE:
            if (!gate_ok) {
                return pi_fail(POWERINFER_ERR_INVALID_ARG, "gate mode needs %s in every layer; this file lacks %s",
                               "ffn_gate and ffn_down_t", !gate ? "ffn_gate (non-gated FFN)" : "ffn_down_t (convert it first)");
            }
            hp->sparse_mode = want;
            break;
        case POWERINFER_SPARSE_PREDICTOR:
            if (!pred || !down_t) {
                return pi_fail(POWERINFER_ERR_INVALID_ARG, "predictor mode needs blk.N.fc1/fc2 and ffn_down_t in every layer; "
                               "this file lacks %s", !pred ? "predictors" : "ffn_down_t");
            }
            hp->sparse_mode = want;
            break;
        default:
            return pi_fail(POWERINFER_ERR_INVALID_ARG, "unknown sparse mode %d", want);
    }
    return resolve_thresholds(model);
}

int32_t powerinfer_model_sparse_mode(const struct powerinfer_model * model) { return model->hp.sparse_mode; }

int32_t powerinfer_model_n_packed(const struct powerinfer_model * model) { return model->n_packed_dense; }

int64_t powerinfer_model_tensor_nbytes(const struct powerinfer_model * model, const char * name) {
    const struct ggml_tensor * t = name && model->ctx_meta ? ggml_get_tensor(model->ctx_meta, name) : NULL;
    return t ? (int64_t) ggml_nbytes(t) : -1;
}

float powerinfer_model_sparse_threshold(const struct powerinfer_model * model, int32_t il) {
    return il >= 0 && il < model->hp.n_layer ? model->layers[il].sparse_tau : NAN;
}

float powerinfer_model_input_threshold(const struct powerinfer_model * model, int32_t il, int32_t input) {
    const int32_t k = pi_input_index(model, il, input);
    return k >= 0 ? pi_input_tau(model, k) : NAN;
}

bool powerinfer_model_input_sparse(const struct powerinfer_model * model, int32_t il, int32_t input) {
    const int32_t k = pi_input_index(model, il, input);
    return model->hp.sparse_mode == POWERINFER_SPARSE_INPUT && k >= 0 &&
           pi_input_cm(model, k)->n_segs > 0;
}

// Input mode: whether t, a matrix of input k, stays in the plain layout. A matrix with a
// column copy runs dense only in prompts (and a sequence's first token), where on x86
// ggml-cpu's tiled matmul takes its K-quants, but only from the plain layout (it leaves a
// weight with an extra to the repacked kernels). Measured (docs/input-sparsity.md, "Prompts
// and the repacked layouts"): as fast as the repacked kernels with AVX2, 1.2-1.5x faster with
// AVX-512. Other types, and other CPUs (no tiled kernels), keep the repacked layouts.
static bool input_stays_plain(const struct powerinfer_model * model, int32_t il, int32_t input, const struct ggml_tensor * t) {
#if defined(__x86_64__)
    const int32_t k = pi_input_index(model, il, input);
    return t && model->hp.sparse_mode == POWERINFER_SPARSE_INPUT && k >= 0 && pi_input_cm(model, k)->n_segs > 0 &&
           (t->type == GGML_TYPE_Q4_K || t->type == GGML_TYPE_Q5_K || t->type == GGML_TYPE_Q6_K);
#else
    (void) model; (void) il; (void) input; (void) t;
    return false;
#endif
}

// Dense matmul weights go to the repacked layouts where the CPU backend has one.
static int32_t repack_dense_weights(struct powerinfer_model * model) {
    const int32_t per_layer = 10;
    const bool packed_pred = pi_predictors_packable(model);  // packed instead (pi_pack_predictors)
    struct ggml_tensor *** w = malloc(sizeof(*w) * ((size_t) per_layer * model->hp.n_layer + 1));
    if (!w) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    int32_t n = 0;
#define PI_REPACK_SLOT(t, packed) do { if (!(packed)) w[n++] = &(t); } while (0)  // packed (pack_dense): not here
#define PI_REPACK_INPUT(t, packed, input) do { if (!input_stays_plain(model, il, input, t)) PI_REPACK_SLOT(t, packed); } while (0)
    for (int32_t il = 0; il < model->hp.n_layer; ++il) {
        struct pi_layer * l = &model->layers[il];
        PI_REPACK_INPUT(l->wqkv, l->wqkv_p, POWERINFER_INPUT_QKV);
        PI_REPACK_INPUT(l->wq, l->wq_p, POWERINFER_INPUT_QKV);
        PI_REPACK_INPUT(l->wk, l->wk_p, POWERINFER_INPUT_QKV);
        PI_REPACK_INPUT(l->wv, l->wv_p, POWERINFER_INPUT_QKV);
        PI_REPACK_INPUT(l->wo, l->wo_p, POWERINFER_INPUT_O);
        if (l->fc1 && !packed_pred) { w[n++] = &l->fc1; w[n++] = &l->fc2; }
        // Rows the sparse operators read one by one stay in the plain mapping.
        const int32_t mode = model->hp.sparse_mode;
        if (l->ffn_gate && mode != POWERINFER_SPARSE_PREDICTOR) PI_REPACK_INPUT(l->ffn_gate, l->ffn_gate_p, POWERINFER_INPUT_FFN);
        // (up reads gate's input: in input mode it stays plain exactly when gate does; until
        // 2026-12-08 it was repacked in dense mode only, and a layer whose FFN input runs dense
        // computed up through ggml's row dot products, not its repacked gemv)
        if (mode == POWERINFER_SPARSE_DENSE || mode == POWERINFER_SPARSE_INPUT) {
            PI_REPACK_INPUT(l->ffn_up, l->ffn_up_p, POWERINFER_INPUT_FFN);
        }
        if (l->ffn_down) PI_REPACK_INPUT(l->ffn_down, l->ffn_down_p, POWERINFER_INPUT_DOWN);
    }
    if (model->output != model->tok_embd && !input_stays_plain(model, model->hp.n_layer, 0, model->output)) {
        PI_REPACK_SLOT(model->output, model->output_p);
    }
#undef PI_REPACK_INPUT
#undef PI_REPACK_SLOT
    int32_t rc = pi_repack_weights(model, w, n);
    free(w);
    return rc;
}

// ---- public API ----------------------------------------------------------------

struct powerinfer_model_params powerinfer_model_default_params(void) {
    struct powerinfer_model_params p = {
        .n_threads       = 0,
        .vram_budget_gib = -1.0f,
        .n_gpu_layers    = 0,
        .use_mmap        = true,
        .use_repack      = true,
        .vocab_only      = false,
        .sparse_mode     = POWERINFER_SPARSE_AUTO,
        .sparse_threshold = NAN,
        .emulate_device  = false,
        .reset_gpu_index = false,
        .vram_budget_bytes = 0,
        .batch_weights   = true,
        .pack_dense      = false,
        .rpc_servers     = NULL,
        .split_mode      = POWERINFER_SPLIT_AUTO,
        .tensor_split    = NULL,
        .n_tensor_split  = 0,
        .device_budgets  = NULL,
        .n_device_budgets = 0,
    };
    return p;
}

// The placement parameters, checked, into the model's own copies (placement happens at the
// first context, after the caller's arrays may be gone).
static int32_t copy_placement_params(struct powerinfer_model * model) {
    struct powerinfer_model_params * p = &model->params;
    if (p->split_mode < POWERINFER_SPLIT_AUTO || p->split_mode > POWERINFER_SPLIT_NONE) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "split_mode = %d is not a powerinfer_split_mode", p->split_mode);
    }
    if (p->n_tensor_split < 0 || p->n_tensor_split > PI_MAX_DEVICES || (p->n_tensor_split > 0 && !p->tensor_split)) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "tensor_split: %d values (at most %d devices)", p->n_tensor_split,
                       PI_MAX_DEVICES);
    }
    if (p->n_device_budgets < 0 || p->n_device_budgets > PI_MAX_DEVICES || (p->n_device_budgets > 0 && !p->device_budgets)) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "device budgets: %d values (at most %d devices)", p->n_device_budgets,
                       PI_MAX_DEVICES);
    }
    for (int32_t i = 0; i < p->n_tensor_split; ++i) {
        if (!(p->tensor_split[i] >= 0.0f) || isinf(p->tensor_split[i])) {
            return pi_fail(POWERINFER_ERR_INVALID_ARG, "tensor_split[%d] = %g must be a finite share >= 0", i, p->tensor_split[i]);
        }
    }
    for (int32_t i = 0; i < p->n_device_budgets; ++i) {
        if (p->device_budgets[i] < 0) {
            return pi_fail(POWERINFER_ERR_INVALID_ARG, "the budget of device %d is negative", i);
        }
    }
    if (p->rpc_servers && !(model->rpc_servers = strdup(p->rpc_servers))) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
    }
    if (p->n_tensor_split > 0) {
        if (!(model->tensor_split = malloc(sizeof(float) * (size_t) p->n_tensor_split))) {
            return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
        }
        memcpy(model->tensor_split, p->tensor_split, sizeof(float) * (size_t) p->n_tensor_split);
    }
    if (p->n_device_budgets > 0) {
        if (!(model->device_budgets = malloc(sizeof(int64_t) * (size_t) p->n_device_budgets))) {
            return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
        }
        memcpy(model->device_budgets, p->device_budgets, sizeof(int64_t) * (size_t) p->n_device_budgets);
    }
    p->rpc_servers    = model->rpc_servers;
    p->tensor_split   = model->tensor_split;
    p->device_budgets = model->device_budgets;
    return POWERINFER_OK;
}

struct powerinfer_model * powerinfer_model_load(const char * path, struct powerinfer_model_params params) {
    pi_clear_error();
    pi_log_install();
    if (!path || !*path) {
        pi_fail(POWERINFER_ERR_INVALID_ARG, "model path is empty");
        return NULL;
    }
    const double t0 = pi_time_ms();
    static atomic_flag level_logged = ATOMIC_FLAG_INIT;
    if (!atomic_flag_test_and_set(&level_logged)) {
        pi_log(POWERINFER_LOG_INFO, "powerinfer: sparse kernels: %s\n", pi_kernel_level());
    }
    struct powerinfer_model * model = calloc(1, sizeof(*model));
    if (model) {
        atomic_init(&model->n_refs, 1);
    }
    if (!model) {
        pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
        return NULL;
    }
    model->params = params;  // copy_placement_params points its arrays at the model's copies
    model->path   = strdup(path);
    bool ok = model->path && copy_placement_params(model) == POWERINFER_OK && pi_model_load_file(model, path) == POWERINFER_OK;
    if (ok && params.vocab_only) {
        const char * arch = get_str(model, "general.architecture");
        snprintf(model->arch_name, sizeof(model->arch_name), "%s", arch ? arch : "");
    } else {
        ok = ok && pi_model_load_hparams(model) == POWERINFER_OK && pi_model_bind_tensors(model) == POWERINFER_OK &&
             resolve_sparse_mode(model) == POWERINFER_OK;
        // Packed first: what it takes stays out of ggml's repacked layouts.
        ok = ok && (!params.pack_dense || pi_pack_dense_weights(model) == POWERINFER_OK);
        // From the mapped blocks, before repacking releases their pages.
        ok = ok && pi_make_input_copies(model) == POWERINFER_OK;
        ok = ok && (!params.use_repack || repack_dense_weights(model) == POWERINFER_OK);
        ok = ok && (!params.batch_weights || pi_make_batch_weights(model, params.use_repack) == POWERINFER_OK);
        ok = ok && pi_make_row_copies(model) == POWERINFER_OK && pi_pack_predictors(model) == POWERINFER_OK;
    }
    ok = ok && pi_vocab_load(model) == POWERINFER_OK;
    if (!ok) {
        if (!model->path) pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory");
        powerinfer_model_free(model);
        return NULL;
    }
    model->t_load_ms = pi_time_ms() - t0;
    pi_log(POWERINFER_LOG_INFO, "powerinfer: loaded %s (%s, %d layers, n_embd %d, n_ff %d, %.1f MiB, %s FFN, %s mode) in %.1f ms\n",
           path, model->arch_name, model->hp.n_layer, model->hp.n_embd, model->hp.n_ff,
           model->n_bytes / 1048576.0, act_name(model->hp.ffn_act),
           powerinfer_sparse_mode_name(model->hp.sparse_mode), model->t_load_ms);
    return model;
}

struct powerinfer_model * pi_model_retain(struct powerinfer_model * model) {
    atomic_fetch_add(&model->n_refs, 1);
    return model;
}

struct powerinfer_model * powerinfer_model_retain(struct powerinfer_model * model) {
    return model ? pi_model_retain(model) : NULL;
}

void powerinfer_model_free(struct powerinfer_model * model) {
    if (!model || atomic_fetch_sub(&model->n_refs, 1) > 1) {
        return;  // its contexts and samplers still hold it
    }
    pi_vocab_free(model);
    pi_placement_free(model);
    free(model->act_counts);
    pi_repack_free(model);
    pi_free_row_copies(model);
    pi_model_unload_file(model);
    free(model->path);
    free(model->rpc_servers);
    free(model->tensor_split);
    free(model->device_budgets);
    free(model);
}

const char * powerinfer_model_arch(const struct powerinfer_model * model) { return model->arch_name; }
int32_t powerinfer_model_n_vocab(const struct powerinfer_model * model)    { return model->hp.n_vocab; }
int32_t powerinfer_model_n_ctx_train(const struct powerinfer_model * model) { return model->hp.n_ctx_train; }
int32_t powerinfer_model_n_embd(const struct powerinfer_model * model)     { return model->hp.n_embd; }
int32_t powerinfer_model_n_layer(const struct powerinfer_model * model)    { return model->hp.n_layer; }
int32_t powerinfer_model_n_head(const struct powerinfer_model * model)     { return model->hp.n_head; }
int32_t powerinfer_model_n_ff(const struct powerinfer_model * model)       { return model->hp.n_ff; }
uint64_t powerinfer_model_size(const struct powerinfer_model * model)      { return model->n_bytes; }
uint64_t powerinfer_model_n_params(const struct powerinfer_model * model)  { return model->n_params; }
const char * powerinfer_model_ffn_activation(const struct powerinfer_model * model) { return act_name(model->hp.ffn_act); }

// ---- metadata as strings -----------------------------------------------------------
// Arrays are left out, as in libllama's llama_model_meta_* functions.

static int64_t meta_kv_index(const struct powerinfer_model * model, int32_t i) {
    if (i < 0) {
        return -1;
    }
    const int64_t n = gguf_get_n_kv(model->gguf);
    for (int64_t id = 0, seen = 0; id < n; ++id) {
        if (gguf_get_kv_type(model->gguf, id) == GGUF_TYPE_ARRAY) {
            continue;
        }
        if (seen++ == i) {
            return id;
        }
    }
    return -1;
}

static int32_t put_str(const char * s, char * buf, size_t buf_size) {
    if (buf && buf_size > 0) {
        snprintf(buf, buf_size, "%s", s);
    }
    size_t len = strlen(s);
    return len > INT32_MAX ? INT32_MAX : (int32_t) len;
}

static int32_t kv_to_str(const struct powerinfer_model * model, int64_t id, char * buf, size_t buf_size) {
    const struct gguf_context * g = model->gguf;
    char tmp[64];
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_STRING:  return put_str(gguf_get_val_str(g, id), buf, buf_size);
        case GGUF_TYPE_UINT8:   snprintf(tmp, sizeof(tmp), "%u", gguf_get_val_u8(g, id)); break;
        case GGUF_TYPE_INT8:    snprintf(tmp, sizeof(tmp), "%d", gguf_get_val_i8(g, id)); break;
        case GGUF_TYPE_UINT16:  snprintf(tmp, sizeof(tmp), "%u", gguf_get_val_u16(g, id)); break;
        case GGUF_TYPE_INT16:   snprintf(tmp, sizeof(tmp), "%d", gguf_get_val_i16(g, id)); break;
        case GGUF_TYPE_UINT32:  snprintf(tmp, sizeof(tmp), "%u", gguf_get_val_u32(g, id)); break;
        case GGUF_TYPE_INT32:   snprintf(tmp, sizeof(tmp), "%d", gguf_get_val_i32(g, id)); break;
        case GGUF_TYPE_UINT64:  snprintf(tmp, sizeof(tmp), "%" PRIu64, gguf_get_val_u64(g, id)); break;
        case GGUF_TYPE_INT64:   snprintf(tmp, sizeof(tmp), "%" PRId64, gguf_get_val_i64(g, id)); break;
        case GGUF_TYPE_FLOAT32: snprintf(tmp, sizeof(tmp), "%f", gguf_get_val_f32(g, id)); break;
        case GGUF_TYPE_FLOAT64: snprintf(tmp, sizeof(tmp), "%f", gguf_get_val_f64(g, id)); break;
        case GGUF_TYPE_BOOL:    snprintf(tmp, sizeof(tmp), "%s", gguf_get_val_bool(g, id) ? "true" : "false"); break;
        default:                snprintf(tmp, sizeof(tmp), "[%zu items]", gguf_get_arr_n(g, id)); break;
    }
    return put_str(tmp, buf, buf_size);
}

int32_t powerinfer_model_meta_count(const struct powerinfer_model * model) {
    int32_t n = 0;
    const int64_t n_kv = gguf_get_n_kv(model->gguf);
    for (int64_t id = 0; id < n_kv; ++id) {
        n += gguf_get_kv_type(model->gguf, id) != GGUF_TYPE_ARRAY;
    }
    return n;
}

int32_t powerinfer_model_meta_key_by_index(const struct powerinfer_model * model, int32_t i, char * buf, size_t buf_size) {
    int64_t id = meta_kv_index(model, i);
    if (id < 0) {
        if (buf && buf_size) buf[0] = '\0';
        return -1;
    }
    return put_str(gguf_get_key(model->gguf, id), buf, buf_size);
}

int32_t powerinfer_model_meta_val_str_by_index(const struct powerinfer_model * model, int32_t i, char * buf, size_t buf_size) {
    int64_t id = meta_kv_index(model, i);
    if (id < 0) {
        if (buf && buf_size) buf[0] = '\0';
        return -1;
    }
    return kv_to_str(model, id, buf, buf_size);
}

int32_t powerinfer_model_meta_val_str(const struct powerinfer_model * model, const char * key, char * buf, size_t buf_size) {
    int64_t id = key ? gguf_find_key(model->gguf, key) : -1;
    if (id < 0 || gguf_get_kv_type(model->gguf, id) == GGUF_TYPE_ARRAY) {
        if (buf && buf_size) buf[0] = '\0';
        return -1;
    }
    return kv_to_str(model, id, buf, buf_size);
}
