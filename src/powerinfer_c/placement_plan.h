// placement_plan.h - the placement decision as pure functions of byte counts and budgets:
// which device holds each layer's weights, KV cache and hot FFN neurons. No ggml calls and
// no model: placement.c measures the sizes on each device, asks the plan, then copies
// (offload.c). tests/c/test_placement_plan.c checks these functions alone.
#pragma once

#include <stdbool.h>
#include <stdint.h>

#define PI_MAX_DEVICES     16
#define PI_PLAN_MAX_LAYERS 512
#define PI_PLAN_HOST       (-1)  // a class that stays in host memory (the CPU computes it)

enum pi_plan_mode {
    // PowerInfer's order, device after device: attention layer by layer, the predictors,
    // ffn_norm, the output; the KV cache; then the hottest FFN neurons of each layer on the
    // device holding that layer's attention. The CPU computes the other neurons.
    PI_PLAN_HYBRID = 0,
    // llama.cpp's layer split: the last n_gpu_layers layers, whole (weights and KV cache),
    // divided between the devices in contiguous ranges by their shares; the output too when
    // n_gpu_layers exceeds the layers.
    PI_PLAN_LAYERS = 1,
};

// Bytes of one layer's classes on one device, in that device's allocator's sizes.
struct pi_plan_layer_bytes {
    uint64_t attn;      // attention weights, biases and norms
    uint64_t pred;      // the predictor (predictor mode)
    uint64_t ffn_norm;
    uint64_t ffn;       // layer split: the layer's whole FFN
    uint64_t kv;        // the layer's KV cache
    uint64_t group;     // hybrid: one group of hot neurons' rows (0: the layer takes none)
};

// pi_plan_device.output of a device that never takes the LM head (an RPC worker: it would
// send n_vocab logits back every token where the hidden state is n_embd floats). The output
// then stays on the host without stopping the dense classes.
#define PI_PLAN_NO_OUTPUT UINT64_MAX

struct pi_plan_device {
    uint64_t budget;    // bytes the device may hold, all classes and its compute buffers
    uint64_t reserve;   // of which kept for its compute buffers
    double   share;     // layer split: its relative share of the layers (<= 0 on every device: by budget)
    uint64_t output;    // the output norm and matrix; PI_PLAN_NO_OUTPUT: never on this device
    const struct pi_plan_layer_bytes * layers;  // [n_layer]
};

struct pi_plan_input {
    enum pi_plan_mode mode;
    int32_t n_dev;        // 1 .. PI_MAX_DEVICES
    int32_t n_layer;      // 1 .. PI_PLAN_MAX_LAYERS
    int32_t n_gpu_layers; // layer split: layers on the devices (< 0: all and the output; > n_layer: also the output)
    struct pi_plan_device dev[PI_MAX_DEVICES];
};

struct pi_plan {
    // Device of each class (PI_PLAN_HOST: host memory).
    int8_t   attn[PI_PLAN_MAX_LAYERS], pred[PI_PLAN_MAX_LAYERS], ffn_norm[PI_PLAN_MAX_LAYERS];
    int8_t   ffn[PI_PLAN_MAX_LAYERS];  // layer split: the whole FFN; hybrid: where the layer's hot rows may go
    int8_t   kv[PI_PLAN_MAX_LAYERS];
    int8_t   output;
    bool     dense_all;                // hybrid: every dense class is on a device
    uint64_t used[PI_MAX_DEVICES];     // bytes planned on each device, without its compute buffers
};

// Decides the weights and the KV cache (and a layer split's whole layers). Returns
// POWERINFER_OK, or an error for inputs out of range. Nothing fits: every class on the host.
int32_t pi_plan_solve(const struct pi_plan_input * in, struct pi_plan * plan);

// Hybrid FFN neurons: the layers' hot groups, given each device's capacity for them
// (capacity[d] bytes): values[il * n_groups + g] is the activation mass of group g of layer
// il (non-increasing in g), and a group of layer il costs in->dev[plan->ffn[il]].layers[il].group
// bytes. Fills n_chosen[il] (a prefix of each layer's groups) maximizing the mass on every
// device, within its capacity.
int32_t pi_plan_ffn(const struct pi_plan_input * in, const struct pi_plan * plan, int32_t n_groups, const double * values,
                    const uint64_t * capacity, int32_t * n_chosen);

// The knapsack of one device (powerinfer_place_groups, public): n_layer layers of n_groups
// groups; a prefix of each layer's groups maximizing the mass within budget.
int32_t pi_plan_groups(int32_t n_layer, int32_t n_groups, const double * values, const uint64_t * cost,
                       const int32_t * max_groups, uint64_t budget, int32_t * n_chosen);
