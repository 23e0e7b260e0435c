// main.c - the `main` CLI: text generation with llama.cpp's usual flags, a thin
// consumer of powerinfer.h.
#include "llama.h"
#include "powerinfer.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct cli_args {
    const char * model;
    const char * prompt;
    const char * prompt_file;
    int32_t      n_predict;
    int32_t      n_threads;
    int32_t      n_threads_batch;
    int32_t      n_ctx;
    int32_t      n_batch;
    uint32_t     seed;
    float        temp, top_p, min_p, repeat_penalty;
    int32_t      top_k, repeat_last_n;
    bool         ignore_eos;
    int32_t      flash_attn;  // 1 on, 0 off, -1 auto
    bool         verbose;
    float        vram_budget;
    int64_t      device_budgets[16];  // --vram-budget A,B,...: GiB per device, in bytes
    int32_t      n_device_budgets;
    int32_t      n_gpu_layers;
    const char * rpc_servers;
    int32_t      split_mode;
    float        tensor_split[16];
    int32_t      n_tensor_split;
    int32_t      sparse_mode;
    float        sparse_threshold;
    bool         reset_gpu_index;
    bool         emulate_device;
    // Speculative decoding (llama.cpp's -md, --draft-max, --draft-min, --draft-p-min).
    const char * model_draft;
    int32_t      draft_max, draft_min;
    float        draft_p_min;
    bool         batch_invariant;  // each token computed as alone (what -md implies)
    // llama.cpp's tensor placement (-ot, --cpu-moe, --n-cpu-moe): libllama's engine applies them
    const char * override_tensor[32];
    int32_t      n_override_tensor;
    bool         cpu_moe;
    int32_t      n_cpu_moe;
};

static void usage(FILE * out, const char * argv0) {
    fprintf(out,
        "usage: %s -m MODEL [options]\n"
        "\n"
        "Generates text from a prompt with PowerInfer-Py.\n"
        "\n"
        "options:\n"
        "  -h, --help                show this help and exit\n"
        "  -m, --model FNAME         model path (GGUF)\n"
        "  -p, --prompt PROMPT       prompt to start generation with (default: empty)\n"
        "  -f, --file FNAME          read the prompt from a file\n"
        "  -n, --n-predict N         number of tokens to predict (default: -1, until end of text or a full context)\n"
        "  -t, --threads N           threads for generation (default: all cores)\n"
        "  -tb, --threads-batch N    threads for prompt processing (default: same as --threads)\n"
        "  -c, --ctx-size N          context size in tokens (default: 4096, 0 = the model's)\n"
        "  -b, --batch-size N        prompt tokens computed per graph (default: 512)\n"
        "  -s, --seed N              RNG seed (default: -1, random; the seed used is printed)\n"
        "  --temp N                  temperature (default: 0.8; 0 = greedy)\n"
        "  --top-k N                 top-k sampling (default: 40, 0 = disabled)\n"
        "  --top-p N                 top-p sampling (default: 0.95, 1.0 = disabled)\n"
        "  --min-p N                 min-p sampling (default: 0.05, 0.0 = disabled)\n"
        "  --repeat-penalty N        penalize repeated tokens (default: 1.0 = disabled)\n"
        "  --repeat-last-n N         tokens considered by the penalty (default: 64, -1 = context size)\n"
        "  --ignore-eos              keep generating after the end-of-text token\n"
        "  -fa, --flash-attn [on|off|auto]  flash attention (alone: on; default auto: on except for\n"
        "                            dense mode on a standard GGUF, which keeps llama.cpp's graph)\n"
        "  --vram-budget N[,N...]    memory budget of each device in GiB (one for all, or one per device;\n"
        "                            default: what each reports free, less a margin; 0: nothing on a device)\n"
        "  --rpc HOST:PORT[,...]     RPC workers (`powerinfer rpc-server`) whose devices placement uses\n"
        "  -sm, --split-mode MODE    auto, hybrid, layer or none (default auto: layer for a dense model\n"
        "                            given -ngl, else PowerInfer's hybrid placement)\n"
        "  -ts, --tensor-split A,B   layer split: the devices' shares of the layers (default: their budgets)\n"
        "  --reset-gpu-index         ignore MODEL.generated.gpuidx and solve the neuron placement again\n"
        "  --emulate-device          hybrid placement with the device emulated in host memory (testing)\n"
        "  -ngl, --n-gpu-layers N    layer split: the last N layers on the devices (-1: all; default 0)\n"
        "  --sparse-mode MODE        auto, dense, gate, predictor or input (default: auto, the best the file allows)\n"
        "  --sparse-threshold N      threshold of the sparse mode: gate, predictor, input (default: from the file)\n"
        "  -md, --model-draft FNAME  draft model for speculative decoding (same vocabulary as -m)\n"
        "  --draft-max N             tokens drafted per step (default: 16; also --draft, --draft-n)\n"
        "  --draft-min N             fewer drafted tokens are not checked (default: 0; also --draft-n-min)\n"
        "  --draft-p-min P           the draft stops below this probability of its best token (default: 0.75)\n"
        "  --batch-invariant         compute each token as it is computed alone in any batch (implied by -md:\n"
        "                            the text is the same with and without a draft)\n"
        "  -ot, --override-tensor PATTERN=TYPE[,...]  llama.cpp's: weights whose names match the regular\n"
        "                            expression go to that buffer type (CPU, Vulkan0, CUDA0, ...); the model\n"
        "                            then runs on libllama (a sparsified file through the module; docs/accel.md)\n"
        "  -cmoe, --cpu-moe          keep every layer's expert weights on the CPU (libllama's engine)\n"
        "  -ncmoe, --n-cpu-moe N     keep the expert weights of the first N layers on the CPU (libllama's engine)\n"
        "  -v, --verbose             print loading details\n",
        argv0);
}

// -s -1 (the default): a seed from the OS's entropy, never 0xFFFFFFFF (libllama's "random"),
// so the run's seed is known and printed, and `-s SEED` repeats it.
static uint32_t random_seed(void) {
    uint32_t seed = 0;
    FILE * f = fopen("/dev/urandom", "rb");
    if (!f || fread(&seed, sizeof(seed), 1, f) != 1) {
        seed = (uint32_t) time(NULL) ^ (uint32_t) clock() * 2654435761u;
    }
    if (f) fclose(f);
    return seed == 0xFFFFFFFFu ? 0u : seed;
}

static int fail(const char * fmt, ...) __attribute__((format(printf, 1, 2)));

static int fail(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "error: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    return 1;
}

static bool parse_int(const char * s, long lo, long hi, int32_t * out) {
    char * end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        return false;
    }
    *out = (int32_t) v;
    return true;
}

static bool parse_float(const char * s, float * out) {
    char * end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end || !isfinite(v)) {
        return false;
    }
    *out = v;
    return true;
}

// "A,B,C" (or llama.cpp's "A/B/C") of finite floats >= 0 into out[0..max); false if malformed.
static bool parse_floats(const char * s, float * out, int32_t max, int32_t * n) {
    char buf[512];
    if (strlen(s) >= sizeof(buf)) {
        return false;
    }
    strcpy(buf, s);
    *n = 0;
    char * save = NULL;
    for (char * tok = strtok_r(buf, ",/", &save); tok; tok = strtok_r(NULL, ",/", &save)) {
        if (*n == max || !parse_float(tok, &out[*n]) || out[*n] < 0.0f) {
            return false;
        }
        ++*n;
    }
    return *n > 0;
}

// Returns 0 on success, 1 on a bad argument, -1 when help was printed.
static int parse_args(int argc, char ** argv, struct cli_args * a) {
    for (int i = 1; i < argc; ++i) {
        const char * arg = argv[i];
#define IS(x) (strcmp(arg, x) == 0)
#define NEXT() (i + 1 < argc ? argv[++i] : NULL)
        if (IS("-h") || IS("--help")) {
            usage(stdout, argv[0]);
            return -1;
        }
        if (IS("--ignore-eos"))                { a->ignore_eos = true; continue; }
        if (IS("-fa") || IS("--flash-attn")) {
            // -fa alone: on; or -fa on|off|auto, as llama.cpp
            const char * v = i + 1 < argc ? argv[i + 1] : NULL;
            a->flash_attn = 1;
            if (v && (!strcmp(v, "on") || !strcmp(v, "off") || !strcmp(v, "auto"))) {
                a->flash_attn = !strcmp(v, "on") ? 1 : !strcmp(v, "off") ? 0 : -1;
                ++i;
            }
            continue;
        }
        if (IS("-v") || IS("--verbose"))       { a->verbose = true; continue; }
        if (IS("--reset-gpu-index"))           { a->reset_gpu_index = true; continue; }
        if (IS("--emulate-device"))            { a->emulate_device = true; continue; }
        if (IS("--batch-invariant"))           { a->batch_invariant = true; continue; }
        if (IS("-cmoe") || IS("--cpu-moe"))    { a->cpu_moe = true; continue; }
        const bool takes_value =
            IS("-m") || IS("--model") || IS("-p") || IS("--prompt") || IS("-f") || IS("--file") ||
            IS("-n") || IS("--n-predict") || IS("-t") || IS("--threads") || IS("-tb") || IS("--threads-batch") ||
            IS("-c") || IS("--ctx-size") || IS("-b") || IS("--batch-size") || IS("-s") || IS("--seed") ||
            IS("--temp") || IS("--top-k") || IS("--top-p") || IS("--min-p") || IS("--repeat-penalty") ||
            IS("--repeat-last-n") || IS("--vram-budget") || IS("-ngl") || IS("--n-gpu-layers") || IS("--gpu-layers") ||
            IS("--sparse-mode") || IS("--sparse-threshold") || IS("--rpc") || IS("-sm") || IS("--split-mode") ||
            IS("-ts") || IS("--tensor-split") || IS("-md") || IS("--model-draft") || IS("--draft-max") ||
            IS("--draft") || IS("--draft-n") || IS("--draft-min") || IS("--draft-n-min") || IS("--draft-p-min") ||
            IS("-ot") || IS("--override-tensor") || IS("-ncmoe") || IS("--n-cpu-moe");
        if (!takes_value) {
            return fail("unknown argument '%s' (see --help)", arg);
        }
        const char * val = NEXT();
        if (!val) {
            return fail("argument '%s' needs a value", arg);
        }
        bool ok = true;
        if      (IS("-m") || IS("--model"))           a->model = val;
        else if (IS("-p") || IS("--prompt"))          a->prompt = val;
        else if (IS("-f") || IS("--file"))            a->prompt_file = val;
        else if (IS("-n") || IS("--n-predict"))       ok = parse_int(val, -1, INT32_MAX, &a->n_predict);
        else if (IS("-t") || IS("--threads"))         ok = parse_int(val, 1, 1024, &a->n_threads);
        else if (IS("-tb") || IS("--threads-batch"))  ok = parse_int(val, 1, 1024, &a->n_threads_batch);
        else if (IS("-c") || IS("--ctx-size"))        ok = parse_int(val, 0, 1 << 22, &a->n_ctx);
        else if (IS("-b") || IS("--batch-size"))      ok = parse_int(val, 1, 1 << 16, &a->n_batch);
        else if (IS("-s") || IS("--seed")) {
            // -1: random; else any seed main prints (a uint32 below 0xFFFFFFFF, libllama's "random").
            char * end;
            errno = 0;
            const long long s = strtoll(val, &end, 10);
            ok = !errno && end != val && !*end && s >= -1 && s < 0xFFFFFFFFLL;
            a->seed = s < 0 ? 0xFFFFFFFFu : (uint32_t) s;
        }
        else if (IS("--temp"))                        ok = parse_float(val, &a->temp);
        else if (IS("--top-k"))                       ok = parse_int(val, 0, INT32_MAX, &a->top_k);
        else if (IS("--top-p"))                       ok = parse_float(val, &a->top_p) && a->top_p >= 0.0f && a->top_p <= 1.0f;
        else if (IS("--min-p"))                       ok = parse_float(val, &a->min_p) && a->min_p >= 0.0f && a->min_p <= 1.0f;
        else if (IS("--repeat-penalty"))              ok = parse_float(val, &a->repeat_penalty) && a->repeat_penalty > 0.0f;
        else if (IS("--repeat-last-n"))               ok = parse_int(val, -1, INT32_MAX, &a->repeat_last_n);
        else if (IS("--vram-budget")) {
            float gib[16];
            int32_t n = 0;
            ok = parse_floats(val, gib, 16, &n);
            a->vram_budget = ok ? gib[0] : a->vram_budget;
            a->n_device_budgets = ok && n > 1 ? n : 0;
            for (int32_t k = 0; ok && n > 1 && k < n; ++k) a->device_budgets[k] = (int64_t) ((double) gib[k] * 1073741824.0);
        }
        else if (IS("--rpc"))                         a->rpc_servers = val;
        else if (IS("-ts") || IS("--tensor-split"))   ok = parse_floats(val, a->tensor_split, 16, &a->n_tensor_split);
        else if (IS("-sm") || IS("--split-mode")) {
            static const char * const names[] = { "auto", "hybrid", "layer", "none" };
            ok = false;
            for (int32_t m = 0; m < 4; ++m) {
                if (strcmp(val, names[m]) == 0) {
                    a->split_mode = POWERINFER_SPLIT_AUTO + m;
                    ok = true;
                }
            }
            if (!ok && strcmp(val, "row") == 0) {
                return fail("--split-mode row (tensor parallelism) is not supported; use layer or hybrid");
            }
        }
        else if (IS("--sparse-threshold"))            ok = parse_float(val, &a->sparse_threshold);
        else if (IS("-ncmoe") || IS("--n-cpu-moe"))   ok = parse_int(val, 0, 1 << 16, &a->n_cpu_moe);
        else if (IS("-ot") || IS("--override-tensor")) {
            if (a->n_override_tensor == (int32_t) (sizeof(a->override_tensor) / sizeof(a->override_tensor[0]))) {
                return fail("too many %s options (at most 32; one takes a comma-separated list)", arg);
            }
            a->override_tensor[a->n_override_tensor++] = val;
        }
        else if (IS("-md") || IS("--model-draft"))    a->model_draft = val;
        else if (IS("--draft-max") || IS("--draft") || IS("--draft-n")) ok = parse_int(val, 1, 1 << 16, &a->draft_max);
        else if (IS("--draft-min") || IS("--draft-n-min")) ok = parse_int(val, 0, 1 << 16, &a->draft_min);
        else if (IS("--draft-p-min"))  ok = parse_float(val, &a->draft_p_min) && a->draft_p_min >= 0.0f && a->draft_p_min <= 1.0f;
        else if (IS("--sparse-mode")) {
            ok = false;
            for (int32_t m = POWERINFER_SPARSE_AUTO; m <= POWERINFER_SPARSE_INPUT; ++m) {
                if (strcmp(val, powerinfer_sparse_mode_name(m)) == 0) {
                    a->sparse_mode = m;
                    ok = true;
                }
            }
        }
        else                                          ok = parse_int(val, -1, INT32_MAX, &a->n_gpu_layers);
        if (!ok) {
            return fail("invalid value '%s' for %s", val, arg);
        }
#undef IS
#undef NEXT
    }
    if (!a->model) {
        return fail("no model given: use -m MODEL.gguf (see --help)");
    }
    if (a->prompt && a->prompt_file) {
        return fail("use either -p or -f, not both");
    }
    if (a->draft_min > a->draft_max) {
        return fail("--draft-min (%d) must not exceed --draft-max (%d)", a->draft_min, a->draft_max);
    }
    return 0;
}

// The whole file, or NULL with errno set: a read that fails (a directory opens, then reads
// EISDIR) is an error, never the empty prompt of what was read until then.
static char * read_file(const char * path) {
    FILE * f = fopen(path, "rb");
    if (!f) {
        return NULL;
    }
    size_t cap = 4096, len = 0;
    char * buf = malloc(cap);
    size_t n;
    while (buf && (n = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += n;
        if (cap - len <= 1) {
            char * nb = realloc(buf, cap * 2);
            if (!nb) { free(buf); buf = NULL; break; }
            buf = nb;
            cap *= 2;
        }
    }
    const int err = !buf ? ENOMEM : ferror(f) ? (errno ? errno : EIO) : 0;
    fclose(f);
    if (err) {
        free(buf);
        errno = err;
        return NULL;
    }
    buf[len] = '\0';
    return buf;
}

// The share of FFN neurons the sparse steps computed, overall and per layer (the
// timings' counters: steps since the prompt, through the sparse operators only).
static void print_sparse_activity(const struct powerinfer_model * model, const struct powerinfer_context * ctx) {
    const int32_t n_layer = powerinfer_model_n_layer(model);
    int64_t sum_a = 0, sum_t = 0;
    char per_layer[2048];
    size_t len = 0;
    per_layer[0] = '\0';
    for (int32_t il = 0; il < n_layer; ++il) {
        int64_t a = 0, t = 0;
        if (powerinfer_sparse_stats(ctx, il, &a, &t) != POWERINFER_OK || t == 0) {
            continue;
        }
        sum_a += a;
        sum_t += t;
        if (len + 8 < sizeof(per_layer)) {
            len += (size_t) snprintf(per_layer + len, sizeof(per_layer) - len, " %.0f", 100.0 * a / t);
        }
    }
    if (sum_t == 0) {
        return;  // dense mode, or no sparse step ran
    }
    if (powerinfer_model_sparse_mode(model) == POWERINFER_SPARSE_INPUT) {
        fprintf(stderr, "sparse input = %.1f%% of matrix inputs kept (per layer, %%:%s)\n", 100.0 * sum_a / sum_t, per_layer);
        return;
    }
    fprintf(stderr, "sparse FFN  = %.1f%% of neurons active (per layer, %%:%s)\n", 100.0 * sum_a / sum_t, per_layer);
}

// ---- speculative decoding (-md) -------------------------------------------------------------
// The draft model's sequence, kept in step with the text: held[0..n_held) is what its cache
// holds. It proposes its most probable token while that token's probability is at least p_min
// (llama.cpp's --draft-p-min); the target checks the proposals in one decode of all of them.
struct draft_state {
    struct powerinfer_model *   model;
    struct powerinfer_context * ctx;
    powerinfer_token *          held;  // [n_ctx]
    int32_t                     n_held, n_ctx, n_vocab;
    int64_t                     n_steps, n_drafted, n_accepted, n_generated;  // the verify steps' counters
};

// Up to n_max proposals to follow ids[0..n_ids); returns their number, or -1 on error.
static int32_t draft_propose(struct draft_state * d, const powerinfer_token * ids, int32_t n_ids, int32_t n_max,
                             float p_min, powerinfer_token * out) {
    // Keep the common prefix, and decode at least the last token: its logits give the first proposal.
    int32_t keep = 0;
    while (keep < d->n_held && keep < n_ids - 1 && d->held[keep] == ids[keep]) ++keep;
    if (powerinfer_decode(d->ctx, ids + keep, n_ids - keep, keep, false) != POWERINFER_OK) {
        return -1;
    }
    memcpy(d->held + keep, ids + keep, (size_t) (n_ids - keep) * sizeof(powerinfer_token));
    d->n_held = n_ids;
    int32_t n = 0;
    while (n < n_max && d->n_held < d->n_ctx) {
        const float * logits = powerinfer_get_logits_ith(d->ctx, -1);
        int32_t best = 0;  // the greedy sampler's pick: the first maximum
        for (int32_t i = 1; i < d->n_vocab; ++i) {
            if (logits[i] > logits[best]) best = i;
        }
        double sum = 0.0;
        for (int32_t i = 0; i < d->n_vocab; ++i) {
            sum += exp((double) logits[i] - (double) logits[best]);
        }
        if (1.0 / sum < (double) p_min) {
            break;
        }
        out[n++] = best;
        if (n == n_max) {
            break;
        }
        if (powerinfer_decode(d->ctx, &out[n - 1], 1, d->n_held, false) != POWERINFER_OK) {
            return -1;
        }
        d->held[d->n_held++] = best;
    }
    return n;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void print_piece(const struct powerinfer_model * model, powerinfer_token tok) {
    char buf[256];
    int32_t n = powerinfer_token_to_piece(model, tok, buf, sizeof(buf), false);
    if (n > 0) {
        fwrite(buf, 1, (size_t) n, stdout);
        fflush(stdout);
    }
}

// ---- llama.cpp's tensor placement overrides, for libllama (its common/arg.cpp meanings) ----
// -ot PATTERN=TYPE,...: the first pattern found in a weight's name picks its buffer type;
// --cpu-moe, --n-cpu-moe N: the expert stacks of every layer, or of layers 0..N-1, to the CPU.
#define FFN_EXPS_REGEX "\\.ffn_(up|down|gate|gate_up)_(ch|)exps"

struct tensor_overrides {
    struct llama_model_tensor_buft_override * items;  // NULL-terminated
    char ** strings;                                  // the patterns, owned
    int32_t n;
};

static void tensor_overrides_free(struct tensor_overrides * ov) {
    for (int32_t i = 0; i < ov->n; ++i) free(ov->strings[i]);
    free(ov->strings);
    free(ov->items);
    memset(ov, 0, sizeof(*ov));
}

static bool tensor_overrides_add(struct tensor_overrides * ov, const char * pattern, size_t len, const char * type) {
    void * buft = powerinfer_buffer_type_by_name(type);
    if (!buft) {
        char names[1024];
        powerinfer_buffer_type_names(names, (int32_t) sizeof(names));
        fprintf(stderr, "error: -ot: unknown buffer type '%s'; available: %s\n", type, names);
        return false;
    }
    if (len == 0) {
        fprintf(stderr, "error: -ot: an empty pattern (for buffer type '%s')\n", type);
        return false;
    }
    char * pat = malloc(len + 1);
    struct llama_model_tensor_buft_override * items = realloc(ov->items, (size_t) (ov->n + 2) * sizeof(*items));
    char ** strings = items ? realloc(ov->strings, (size_t) (ov->n + 1) * sizeof(*strings)) : NULL;
    if (items) ov->items = items;
    if (strings) ov->strings = strings;
    if (!pat || !items || !strings) {
        free(pat);
        fprintf(stderr, "error: out of memory\n");
        return false;
    }
    memcpy(pat, pattern, len);
    pat[len] = '\0';
    ov->strings[ov->n] = pat;
    ov->items[ov->n] = (struct llama_model_tensor_buft_override) { .pattern = pat, .buft = buft };
    ov->n++;
    ov->items[ov->n] = (struct llama_model_tensor_buft_override) { .pattern = NULL, .buft = NULL };
    return true;
}

static bool tensor_overrides_make(struct tensor_overrides * ov, const struct cli_args * a) {
    memset(ov, 0, sizeof(*ov));
    for (int32_t k = 0; k < a->n_override_tensor; ++k) {
        for (const char * item = a->override_tensor[k]; item;) {
            const char * comma = strchr(item, ',');
            const size_t len = comma ? (size_t) (comma - item) : strlen(item);
            const char * eq = memchr(item, '=', len);
            if (!eq) {
                fprintf(stderr, "error: -ot: '%.*s' is not PATTERN=BUFFER_TYPE\n", (int) len, item);
                tensor_overrides_free(ov);
                return false;
            }
            char type[128];
            snprintf(type, sizeof(type), "%.*s", (int) (item + len - eq - 1), eq + 1);
            if (!tensor_overrides_add(ov, item, (size_t) (eq - item), type)) {
                tensor_overrides_free(ov);
                return false;
            }
            item = comma ? comma + 1 : NULL;
        }
    }
    char pat[128];
    if (a->cpu_moe && !tensor_overrides_add(ov, FFN_EXPS_REGEX, strlen(FFN_EXPS_REGEX), "CPU")) {
        tensor_overrides_free(ov);
        return false;
    }
    for (int32_t i = 0; i < a->n_cpu_moe; ++i) {
        const int len = snprintf(pat, sizeof(pat), "blk\\.%d" FFN_EXPS_REGEX, i);
        if (!tensor_overrides_add(ov, pat, (size_t) len, "CPU")) {
            tensor_overrides_free(ov);
            return false;
        }
    }
    return true;
}

// ---- an architecture the core does not build: libllama's engine, sparse through the module ----
// (docs/accel.md). The same flags mean the same; those of the core's own features (the
// VRAM budget, its placement, RPC, drafts) are refused before anything loads.
static int run_on_libllama(const struct cli_args * a, const char * prompt) {
    if (a->vram_budget > 0.0f || a->rpc_servers || a->model_draft) {
        fprintf(stderr, "error: %s runs on libllama's engine (%s): --vram-budget, --rpc and -md need the core's\n",
                a->model, a->n_override_tensor > 0 ? "-ot asks for libllama's placement" : "an architecture the core does not build");
        return 1;
    }
    const bool sparse = a->sparse_mode == POWERINFER_SPARSE_AUTO || a->sparse_mode == POWERINFER_SPARSE_INPUT;
    if (!sparse && a->sparse_mode != POWERINFER_SPARSE_DENSE) {
        fprintf(stderr, "error: %s runs on libllama's engine, in input or dense mode only\n", a->model);
        return 1;
    }
    llama_backend_init();
    int32_t tag = 0;
    if (sparse) {
        if (powerinfer_accel_register() < 0 || (tag = powerinfer_accel_arm(a->model, POWERINFER_ACCEL_SPARSE)) < 0) {
            fprintf(stderr, "error: %s\n", powerinfer_last_error());
            return 1;
        }
    }
    const double t0 = now_ms();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = a->n_gpu_layers;  // libllama's default is every layer; ours, as llama.cpp's -ngl, 0
    struct tensor_overrides ov;
    if (!tensor_overrides_make(&ov, a)) {
        powerinfer_accel_disarm();
        return 1;
    }
    mp.tensor_buft_overrides = ov.n > 0 ? ov.items : NULL;
    struct llama_model * model = llama_model_load_from_file(a->model, mp);
    powerinfer_accel_disarm();
    if (!model) {
        tensor_overrides_free(&ov);
        fprintf(stderr, "error: libllama could not load %s either\n", a->model);
        return 1;
    }
    const double t_load = now_ms() - t0;
    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) a->n_ctx;
    cp.n_batch = cp.n_ubatch = (uint32_t) a->n_batch;
    cp.n_threads = a->n_threads > 0 ? a->n_threads : cp.n_threads;
    cp.n_threads_batch = a->n_threads_batch > 0 ? a->n_threads_batch : cp.n_threads;
    if (a->flash_attn >= 0) cp.flash_attn_type = a->flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    int status = 1;
    llama_token * tokens = NULL;
    struct llama_sampler * smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
    if (!ctx) {
        fprintf(stderr, "error: libllama could not make a context for %s\n", a->model);
        goto done;
    }
    if (a->repeat_penalty != 1.0f) {
        llama_sampler_chain_add(smpl, llama_sampler_init_penalties(llama_vocab_n_tokens(vocab), a->repeat_last_n,
                                                                   a->repeat_penalty, 0.0f, 0.0f));
    }
    if (a->temp <= 0.0f) {
        llama_sampler_chain_add(smpl, llama_sampler_init_greedy());
    } else {
        llama_sampler_chain_add(smpl, llama_sampler_init_top_k(a->top_k));
        llama_sampler_chain_add(smpl, llama_sampler_init_top_p(a->top_p, 1));
        llama_sampler_chain_add(smpl, llama_sampler_init_min_p(a->min_p, 1));
        llama_sampler_chain_add(smpl, llama_sampler_init_temp(a->temp));
        llama_sampler_chain_add(smpl, llama_sampler_init_dist(a->seed));
    }
    const int32_t plen = (int32_t) strlen(prompt);
    const int32_t n_prompt = -llama_tokenize(vocab, prompt, plen, NULL, 0, true, true);
    const int32_t n_ctx = (int32_t) llama_n_ctx(ctx);
    if (n_prompt <= 0 || n_prompt >= n_ctx) {
        fprintf(stderr, "error: the prompt is %d tokens long, which does not fit in the context of %d tokens (use -c)\n",
                n_prompt, n_ctx);
        goto done;
    }
    tokens = malloc(sizeof(llama_token) * (size_t) n_prompt);
    if (!tokens || llama_tokenize(vocab, prompt, plen, tokens, n_prompt, true, true) != n_prompt) {
        fprintf(stderr, "error: tokenization failed\n");
        goto done;
    }
    printf("%s", prompt);
    fflush(stdout);
    const double t1 = now_ms();
    if (llama_decode(ctx, llama_batch_get_one(tokens, n_prompt)) != 0) {
        fprintf(stderr, "\nerror: prompt evaluation failed\n");
        goto done;
    }
    const double t_prompt = now_ms() - t1;
    int32_t n_gen = 0, pos = n_prompt;
    const double t2 = now_ms();
    while (a->n_predict < 0 || n_gen < a->n_predict) {
        llama_token tok = llama_sampler_sample(smpl, ctx, -1);
        if (llama_vocab_is_eog(vocab, tok) && !a->ignore_eos) break;
        char piece[256];
        const int32_t n = llama_token_to_piece(vocab, tok, piece, sizeof(piece), 0, true);
        if (n > 0) fwrite(piece, 1, (size_t) n, stdout);
        fflush(stdout);
        ++n_gen;
        if (pos + 1 >= n_ctx) {
            fprintf(stderr, "\n[context of %d tokens is full]\n", n_ctx);
            break;
        }
        if (llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) {
            fprintf(stderr, "\nerror: decode failed\n");
            goto done;
        }
        ++pos;
    }
    const double t_gen = now_ms() - t2;
    printf("\n");
    int32_t n_sparse = 0;
    int64_t kept = 0, total = 0;
    const int32_t n_w = tag > 0 ? powerinfer_accel_weights(tag, NULL, 0) : 0;
    struct powerinfer_accel_weight * ws = n_w > 0 ? calloc((size_t) n_w, sizeof(*ws)) : NULL;
    if (ws) {
        powerinfer_accel_weights(tag, ws, n_w);
        for (int32_t i = 0; i < n_w; ++i) {
            if (!ws[i].sparse) continue;
            ++n_sparse;
            kept += ws[i].n_active;
            total += ws[i].n_total;
        }
        free(ws);
    }
    fprintf(stderr, "\n");
    fprintf(stderr, "seed        = %u\n", a->seed);
    fprintf(stderr, "engine      = libllama (%s)\n", a->n_override_tensor > 0 ? "-ot: libllama places the weights" : "this architecture is not built by the core");
    if (n_sparse > 0) {
        fprintf(stderr, "sparse mode = input (the module: %d weights, %.1f%% of their input entries kept)\n", n_sparse,
                total ? 100.0 * (double) kept / (double) total : 0.0);
    } else {
        fprintf(stderr, "sparse mode = dense\n");
    }
    fprintf(stderr, "kernels     = %s (this CPU runs: %s)\n", powerinfer_kernel_level(), powerinfer_kernel_levels());
    fprintf(stderr, "load time   = %10.2f ms\n", t_load);
    fprintf(stderr, "prompt eval = %10.2f ms / %5d tokens (%8.2f tokens per second)\n", t_prompt, n_prompt,
            t_prompt > 0 ? 1e3 * n_prompt / t_prompt : 0.0);
    fprintf(stderr, "generation  = %10.2f ms / %5d tokens (%8.2f tokens per second)\n", t_gen, n_gen,
            t_gen > 0 ? 1e3 * n_gen / t_gen : 0.0);
    status = 0;
done:
    free(tokens);
    llama_sampler_free(smpl);
    if (ctx) llama_free(ctx);
    llama_model_free(model);
    tensor_overrides_free(&ov);
    return status;
}

int main(int argc, char ** argv) {
    struct powerinfer_sampler_params sp = powerinfer_sampler_default_params();
    struct cli_args a = {
        .n_predict = -1, .n_ctx = 4096, .n_batch = 512, .seed = 0xFFFFFFFFu,
        .temp = sp.temp, .top_p = sp.top_p, .min_p = sp.min_p, .repeat_penalty = 1.0f,
        .top_k = sp.top_k, .repeat_last_n = 64, .vram_budget = -1.0f, .n_gpu_layers = 0,
        .sparse_mode = POWERINFER_SPARSE_AUTO, .sparse_threshold = NAN, .flash_attn = -1,
        .draft_max = 16, .draft_min = 0, .draft_p_min = 0.75f,
    };
    int rc = parse_args(argc, argv, &a);
    if (rc != 0) {
        return rc < 0 ? 0 : 1;
    }
    powerinfer_log_set_level(a.verbose ? POWERINFER_LOG_INFO : POWERINFER_LOG_ERROR);
    if (a.seed == 0xFFFFFFFFu) {
        a.seed = random_seed();
    }

    char * prompt = NULL;
    if (a.prompt_file) {
        prompt = read_file(a.prompt_file);
        if (!prompt) {
            fprintf(stderr, "error: cannot read prompt file '%s': %s\n", a.prompt_file, strerror(errno));
            return 1;
        }
    } else {
        prompt = strdup(a.prompt ? a.prompt : "");
    }

    struct powerinfer_model_params mp = powerinfer_model_default_params();
    mp.n_threads       = a.n_threads;
    mp.vram_budget_gib = a.vram_budget;
    mp.n_gpu_layers    = a.n_gpu_layers;
    mp.sparse_mode     = a.sparse_mode;
    mp.sparse_threshold = a.sparse_threshold;
    mp.reset_gpu_index = a.reset_gpu_index;
    if (a.vram_budget > 0.0f) {
        mp.vram_budget_bytes = (int64_t) ((double) a.vram_budget * 1073741824.0);
    }
    mp.emulate_device  = a.emulate_device;
    mp.rpc_servers     = a.rpc_servers;
    mp.split_mode      = a.split_mode;
    mp.tensor_split    = a.n_tensor_split ? a.tensor_split : NULL;
    mp.n_tensor_split  = a.n_tensor_split;
    mp.device_budgets  = a.n_device_budgets ? a.device_budgets : NULL;
    mp.n_device_budgets = a.n_device_budgets;
    // A draft's check decodes several tokens at once: with kernels that compute each batch column
    // alone (packed weights, no repacked ones, the slots' attention) they come out as they would
    // one at a time, so the text does not depend on the draft (docs/speculative.md).
    const bool invariant = a.batch_invariant || a.model_draft;
    if (invariant) {
        mp.pack_dense = true;
        mp.use_repack = false;
    }
    if (a.rpc_servers) {
        // A worker that goes away must end the generation with a message, not this process:
        // writing to its closed socket would raise SIGPIPE.
        signal(SIGPIPE, SIG_IGN);
    }
    // an architecture the core does not build, or llama.cpp's placement asked for (-ot); --cpu-moe
    // and --n-cpu-moe alone leave the core's architectures, which have no experts, on the core
    if (a.n_override_tensor > 0 || powerinfer_model_arch_of_file(a.model) == 0) {
        rc = run_on_libllama(&a, prompt);
        free(prompt);
        return rc;
    }
    struct powerinfer_model * model = powerinfer_model_load(a.model, mp);
    if (!model) {
        fprintf(stderr, "error: failed to load model: %s\n", powerinfer_last_error());
        free(prompt);
        return 1;
    }

    struct powerinfer_context_params cp = powerinfer_context_default_params();
    cp.n_ctx           = (uint32_t) a.n_ctx;
    if (cp.n_ctx == 0 || cp.n_ctx > (uint32_t) powerinfer_model_n_ctx_train(model)) {
        cp.n_ctx = (uint32_t) powerinfer_model_n_ctx_train(model);
    }
    cp.n_batch         = (uint32_t) a.n_batch;
    cp.seed            = a.seed;
    cp.n_threads       = a.n_threads;
    cp.n_threads_batch = a.n_threads_batch;
    cp.flash_attn      = invariant ? 1 : a.flash_attn;
    cp.batch_invariant = invariant;
    struct powerinfer_context * ctx = powerinfer_context_new(model, cp);
    if (!ctx) {
        fprintf(stderr, "error: failed to create context: %s\n", powerinfer_last_error());
        powerinfer_model_free(model);
        free(prompt);
        return 1;
    }
    struct draft_state draft = { 0 };
    if (a.model_draft) {
        struct powerinfer_model_params dmp = powerinfer_model_default_params();
        dmp.n_threads = a.n_threads;
        draft.model = powerinfer_model_load(a.model_draft, dmp);
        const char * why = !draft.model ? "failed to load the draft model" : NULL;
        if (!why && powerinfer_vocab_compatible(model, draft.model) != POWERINFER_OK) {
            why = "the draft model does not share the target's vocabulary";
        }
        if (!why) {
            struct powerinfer_context_params dcp = cp;
            dcp.flash_attn = a.flash_attn;
            dcp.batch_invariant = false;  // proposals need no exactness
            draft.ctx = powerinfer_context_new(draft.model, dcp);
            why = !draft.ctx ? "failed to create the draft model's context" : NULL;
        }
        draft.n_ctx = (int32_t) powerinfer_n_ctx(ctx);
        draft.n_vocab = draft.model ? powerinfer_model_n_vocab(draft.model) : 0;
        draft.held = why ? NULL : malloc((size_t) draft.n_ctx * sizeof(powerinfer_token));
        if (!why && !draft.held) why = "out of memory";
        if (why) {
            fprintf(stderr, "error: %s (%s): %s\n", why, a.model_draft, powerinfer_last_error());
            powerinfer_context_free(draft.ctx);
            powerinfer_model_free(draft.model);
            powerinfer_context_free(ctx);
            powerinfer_model_free(model);
            free(prompt);
            return 1;
        }
    }

    sp.seed            = a.seed;
    sp.temp            = a.temp;
    sp.top_k           = a.top_k;
    sp.top_p           = a.top_p;
    sp.min_p           = a.min_p;
    sp.penalty_repeat  = a.repeat_penalty;
    sp.penalty_last_n  = a.repeat_last_n;
    struct powerinfer_sampler * smpl = powerinfer_sampler_new(model, sp);
    if (!smpl) {
        fprintf(stderr, "error: invalid sampling parameters: %s\n", powerinfer_last_error());
        powerinfer_context_free(ctx);
        powerinfer_model_free(model);
        free(prompt);
        return 1;
    }

    int status = 1;
    const int32_t n_ctx = (int32_t) powerinfer_n_ctx(ctx);
    const size_t plen = strlen(prompt);
    powerinfer_token * tokens = NULL, * ids = NULL, * batch = NULL;
    int32_t n_prompt = 0;
    if (plen > INT32_MAX) {
        fprintf(stderr, "error: the prompt is too long\n");
        goto done;
    }
    n_prompt = -powerinfer_tokenize(model, prompt, (int32_t) plen, NULL, 0, powerinfer_vocab_add_bos(model), true);
    if (n_prompt < 0) n_prompt = -n_prompt; // an empty prompt returns 0 or the BOS count
    tokens = malloc(((size_t) n_prompt + 1) * sizeof(powerinfer_token));
    if (!tokens) {
        fprintf(stderr, "error: out of memory\n");
        goto done;
    }
    n_prompt = powerinfer_tokenize(model, prompt, (int32_t) plen, tokens, n_prompt + 1, powerinfer_vocab_add_bos(model), true);
    if (n_prompt < 0) {
        fprintf(stderr, "error: tokenization failed: %s\n", powerinfer_last_error());
        goto done;
    }
    if (n_prompt == 0) {
        // Nothing to condition on: start from BOS (or EOS if the vocabulary has no BOS), as llama.cpp does.
        powerinfer_token start = powerinfer_token_bos(model) >= 0 ? powerinfer_token_bos(model) : powerinfer_token_eos(model);
        if (start < 0) {
            fprintf(stderr, "error: empty prompt and the vocabulary has no BOS/EOS token to start from\n");
            goto done;
        }
        tokens[n_prompt++] = start;
    }
    if (n_prompt >= n_ctx) {
        fprintf(stderr, "error: the prompt is %d tokens long, which does not fit in the context of %d tokens (use -c)\n",
                n_prompt, n_ctx);
        goto done;
    }

    fputs(prompt, stdout);
    fflush(stdout);
    for (int32_t i = 0; i < n_prompt; ++i) {
        powerinfer_sampler_accept(smpl, tokens[i]);
    }
    if (powerinfer_decode(ctx, tokens, n_prompt, 0, false) != POWERINFER_OK) {
        fprintf(stderr, "\nerror: prompt evaluation failed: %s\n", powerinfer_last_error());
        goto done;
    }
    if (draft.ctx) {  // the draft reads the prompt too, before generation is timed
        if (powerinfer_decode(draft.ctx, tokens, n_prompt, 0, false) != POWERINFER_OK) {
            fprintf(stderr, "\nerror: the draft model failed: %s\n", powerinfer_last_error());
            goto done;
        }
        memcpy(draft.held, tokens, (size_t) n_prompt * sizeof(powerinfer_token));
        draft.n_held = n_prompt;
    }
    // ids: the prompt and the generated tokens; batch: a token and its drafts.
    ids = malloc(((size_t) n_ctx + 1) * sizeof(powerinfer_token));
    batch = malloc(((size_t) a.draft_max + 1) * sizeof(powerinfer_token));
    if (!ids || !batch) {
        fprintf(stderr, "\nerror: out of memory\n");
        goto done;
    }
    memcpy(ids, tokens, (size_t) n_prompt * sizeof(powerinfer_token));
    const double t_gen0 = now_ms();
    int32_t pos = n_prompt;  // the positions the target holds
    // A sparse target checks at most sparse_max_batch tokens at once: a larger batch takes the
    // dense FFN over the batch copies, which rounds differently from the one-token steps.
    const int32_t draft_batch_max = powerinfer_model_sparse_mode(model) != POWERINFER_SPARSE_DENSE
                                        ? powerinfer_sparse_max_batch(ctx) : INT32_MAX;
    int32_t n_gen = 0;
    powerinfer_token tok = powerinfer_sampler_sample(smpl, ctx, -1);  // sampled, not decoded yet
    while (tok >= 0) {
        if ((a.n_predict >= 0 && n_gen >= a.n_predict) || (!a.ignore_eos && powerinfer_token_is_eog(model, tok))) {
            break;
        }
        print_piece(model, tok);
        ids[pos] = tok;
        ++n_gen;
        if (pos >= n_ctx) {
            fprintf(stderr, "\n[context of %d tokens is full]\n", n_ctx);
            break;
        }
        int32_t n_draft = 0;
        int32_t room = a.draft_max < n_ctx - pos - 1 ? a.draft_max : n_ctx - pos - 1;
        room = room < draft_batch_max - 1 ? room : draft_batch_max - 1;
        if (draft.ctx && room >= (a.draft_min > 1 ? a.draft_min : 1)) {
            n_draft = draft_propose(&draft, ids, pos + 1, room, a.draft_p_min, batch + 1);
            if (n_draft < 0) {
                fprintf(stderr, "\nerror: the draft model failed: %s\n", powerinfer_last_error());
                goto done;
            }
            n_draft = n_draft >= a.draft_min ? n_draft : 0;
        }
        batch[0] = tok;
        if (powerinfer_decode(ctx, batch, 1 + n_draft, pos, n_draft > 0) != POWERINFER_OK) {
            fprintf(stderr, "\nerror: decode failed: %s\n", powerinfer_last_error());
            goto done;
        }
        if (n_draft == 0) {
            ++pos;
            tok = powerinfer_sampler_sample(smpl, ctx, -1);
            continue;
        }
        // Row i holds the logits after batch[i]: drawing from them and comparing with the draft
        // batch[i + 1] is the acceptance rule for a point-mass proposal.
        draft.n_steps += 1;
        draft.n_drafted += n_draft;
        bool stop = false;
        int32_t i = 0;
        powerinfer_token next = -1;
        for (;; ++i) {
            next = powerinfer_sampler_sample(smpl, ctx, i);
            if (next < 0 || i == n_draft || next != batch[i + 1]) {
                break;
            }
            draft.n_accepted += 1;
            draft.n_generated += 1;
            if ((a.n_predict >= 0 && n_gen >= a.n_predict) || (!a.ignore_eos && powerinfer_token_is_eog(model, next))) {
                stop = true;
                break;
            }
            print_piece(model, next);
            ids[pos + i + 1] = next;
            ++n_gen;
        }
        if (stop) {
            break;
        }
        draft.n_generated += 1;
        pos += i + 1;  // the token and the drafts it kept; the rest of the cache is dropped
        if (powerinfer_kv_truncate(ctx, pos) != POWERINFER_OK) {
            fprintf(stderr, "\nerror: %s\n", powerinfer_last_error());
            goto done;
        }
        tok = next;
    }
    if (tok < 0) {
        fprintf(stderr, "\nerror: sampling failed: %s\n", powerinfer_last_error());
        goto done;
    }
    const double t_gen = now_ms() - t_gen0;
    printf("\n");
    fflush(stdout);
    status = 0;

    struct powerinfer_timings t = powerinfer_get_timings(ctx);
    fprintf(stderr, "\n");
    fprintf(stderr, "seed        = %u\n", a.seed);
    fprintf(stderr, "sparse mode = %s\n", powerinfer_sparse_mode_name(powerinfer_model_sparse_mode(model)));
    fprintf(stderr, "kernels     = %s (this CPU runs: %s)\n", powerinfer_kernel_level(), powerinfer_kernel_levels());
    fprintf(stderr, "load time   = %10.2f ms\n", t.t_load_ms);
    fprintf(stderr, "prompt eval = %10.2f ms / %5d tokens (%8.2f ms per token, %8.2f tokens per second)\n",
            t.t_prompt_ms, t.n_prompt, t.n_prompt ? t.t_prompt_ms / t.n_prompt : 0.0,
            t.t_prompt_ms > 0 ? 1e3 * t.n_prompt / t.t_prompt_ms : 0.0);
    fprintf(stderr, "eval        = %10.2f ms / %5d tokens (%8.2f ms per token, %8.2f tokens per second)\n",
            t.t_eval_ms, t.n_eval, t.n_eval ? t.t_eval_ms / t.n_eval : 0.0,
            t.t_eval_ms > 0 ? 1e3 * t.n_eval / t.t_eval_ms : 0.0);
    print_sparse_activity(model, ctx);
    if (draft.ctx) {
        fprintf(stderr, "speculative = %lld verify steps, %lld tokens drafted, %lld accepted (%.1f%%), %.2f tokens per step\n",
                (long long) draft.n_steps, (long long) draft.n_drafted, (long long) draft.n_accepted,
                draft.n_drafted ? 100.0 * draft.n_accepted / draft.n_drafted : 0.0,
                draft.n_steps ? (double) draft.n_generated / draft.n_steps : 0.0);
    }
    fprintf(stderr, "generation  = %10.2f ms / %5d tokens (%8.2f tokens per second)\n", t_gen, n_gen,
            t_gen > 0 ? 1e3 * n_gen / t_gen : 0.0);

done:
    free(ids);
    free(batch);
    free(draft.held);
    powerinfer_context_free(draft.ctx);
    powerinfer_model_free(draft.model);
    free(tokens);
    powerinfer_sampler_free(smpl);
    powerinfer_context_free(ctx);
    powerinfer_model_free(model);
    free(prompt);
    return status;
}
