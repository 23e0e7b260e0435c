// placement_plan.c - the placement decision over a list of devices, as pure functions of
// byte counts and budgets (placement_plan.h). placement.c measures and copies.
#include "placement_plan.h"

#include "powerinfer-impl.h"

#include <stdlib.h>
#include <string.h>

// ---- one device's knapsack of neuron groups -------------------------------------------
//
// Neurons of a layer are sorted by activation count and taken in groups of a fixed size
// (the device tensors' row granularity), so a layer's device set is always a prefix of
// its sorted groups and group values never increase along a layer. The objective is the
// expected activated mass on the device (sum of the chosen groups' counts) under the
// byte budget, with an optional per-layer cap on the groups (the compute-balance bound:
// the device never takes more than a set share of a layer).
//
// When every layer's group costs the same number of bytes the problem is a partition
// matroid (at most max_groups[l] from layer l, at most budget/cost in all) with a linear
// objective, so taking groups by value, best first, is optimal; ties are broken by
// (layer, group) order, which keeps every layer's choice a prefix. With unequal costs
// (layers of different types) greedy by value per byte can be beaten, so a dynamic
// programme over layers and budget units (the gcd of the costs) solves it exactly when
// the table is small enough, and greedy by value per byte is the fallback.

struct pi_group_ref {
    double  value;
    int32_t layer;
    int32_t group;
};

static int cmp_group_ref(const void * a, const void * b) {
    const struct pi_group_ref * x = a, * y = b;
    if (x->value != y->value) return x->value > y->value ? -1 : 1;
    if (x->layer != y->layer) return x->layer < y->layer ? -1 : 1;
    return x->group < y->group ? -1 : x->group > y->group;
}

static uint64_t gcd_u64(uint64_t a, uint64_t b) {
    while (b) { uint64_t t = a % b; a = b; b = t; }
    return a;
}

// Greedy by value (equal costs) or by value per byte; fills n_chosen.
static int32_t place_greedy(int32_t n_layer, int32_t n_groups, const double * values, const uint64_t * cost,
                            const int32_t * max_groups, uint64_t budget, int32_t * n_chosen) {
    struct pi_group_ref * refs = malloc(sizeof(*refs) * ((size_t) n_layer * n_groups + 1));
    if (!refs) {
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory in the placement solver");
    }
    size_t n = 0;
    for (int32_t l = 0; l < n_layer; ++l) {
        n_chosen[l] = 0;
        for (int32_t g = 0; g < max_groups[l]; ++g) {
            refs[n++] = (struct pi_group_ref) { values[(size_t) l * n_groups + g] / (double) cost[l], l, g };
        }
    }
    qsort(refs, n, sizeof(*refs), cmp_group_ref);
    uint64_t used = 0;
    for (size_t i = 0; i < n; ++i) {
        const int32_t l = refs[i].layer;
        // Keep prefixes: a group is taken only after the layer's better ones.
        if (refs[i].group != n_chosen[l] || used + cost[l] > budget) {
            continue;
        }
        used += cost[l];
        n_chosen[l]++;
    }
    free(refs);
    return POWERINFER_OK;
}

// Exact DP for unequal costs: best[l][b] = max mass from layers < l within b units.
static int32_t place_dp(int32_t n_layer, int32_t n_groups, const double * values, const uint64_t * cost,
                        const int32_t * max_groups, uint64_t units, uint64_t unit, int32_t * n_chosen) {
    const size_t W = (size_t) units + 1;
    double *  best = malloc(sizeof(double) * W * 2);
    int32_t * pick = malloc(sizeof(int32_t) * W * (size_t) n_layer);
    double *  pre  = malloc(sizeof(double) * ((size_t) n_groups + 1));
    if (!best || !pick || !pre) {
        free(best); free(pick); free(pre);
        return pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory in the placement solver");
    }
    double * cur = best, * nxt = best + W;
    for (size_t b = 0; b < W; ++b) cur[b] = 0.0;
    for (int32_t l = 0; l < n_layer; ++l) {
        const uint64_t c = cost[l] / unit;
        pre[0] = 0.0;
        for (int32_t g = 0; g < max_groups[l]; ++g) pre[g + 1] = pre[g] + values[(size_t) l * n_groups + g];
        for (size_t b = 0; b < W; ++b) {
            double  v = cur[b];
            int32_t k = 0;
            for (int32_t j = 1; j <= max_groups[l] && (uint64_t) j * c <= b; ++j) {
                const double w = cur[b - (size_t) j * c] + pre[j];
                if (w > v) { v = w; k = j; }
            }
            nxt[b] = v;
            pick[(size_t) l * W + b] = k;
        }
        double * t = cur; cur = nxt; nxt = t;
    }
    size_t b = W - 1;
    for (int32_t l = n_layer - 1; l >= 0; --l) {
        n_chosen[l] = pick[(size_t) l * W + b];
        b -= (size_t) n_chosen[l] * (cost[l] / unit);
    }
    free(best); free(pick); free(pre);
    return POWERINFER_OK;
}

#define PI_DP_MAX_CELLS 50000000ull

int32_t pi_plan_groups(int32_t n_layer, int32_t n_groups, const double * values, const uint64_t * cost,
                       const int32_t * max_groups, uint64_t budget, int32_t * n_chosen) {
    if (n_layer <= 0 || n_groups < 0 || !values || !cost || !max_groups || !n_chosen) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "powerinfer_place_groups: invalid arguments");
    }
    bool equal = true;
    uint64_t unit = 0;
    for (int32_t l = 0; l < n_layer; ++l) {
        if (cost[l] == 0 || max_groups[l] < 0 || max_groups[l] > n_groups) {
            return pi_fail(POWERINFER_ERR_INVALID_ARG, "layer %d: group cost must be > 0 and max_groups in [0, %d]", l, n_groups);
        }
        for (int32_t g = 1; g < max_groups[l]; ++g) {
            if (values[(size_t) l * n_groups + g] > values[(size_t) l * n_groups + g - 1]) {
                return pi_fail(POWERINFER_ERR_INVALID_ARG, "layer %d: group values must not increase", l);
            }
        }
        equal &= cost[l] == cost[0];
        unit = gcd_u64(unit, cost[l]);
    }
    if (equal) {
        return place_greedy(n_layer, n_groups, values, cost, max_groups, budget, n_chosen);
    }
    const uint64_t units = budget / unit;
    if ((units + 1) * (uint64_t) n_layer <= PI_DP_MAX_CELLS) {
        return place_dp(n_layer, n_groups, values, cost, max_groups, units, unit, n_chosen);
    }
    pi_log(POWERINFER_LOG_WARN, "powerinfer: placement: unequal layer costs and a large budget; greedy by value per byte\n");
    return place_greedy(n_layer, n_groups, values, cost, max_groups, budget, n_chosen);
}

// ---- the plan ---------------------------------------------------------------------------

static int32_t check_input(const struct pi_plan_input * in) {
    if (!in || in->n_dev < 1 || in->n_dev > PI_MAX_DEVICES || in->n_layer < 1 || in->n_layer > PI_PLAN_MAX_LAYERS) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "placement plan: %d devices and %d layers are out of range",
                       in ? in->n_dev : 0, in ? in->n_layer : 0);
    }
    for (int32_t d = 0; d < in->n_dev; ++d) {
        if (!in->dev[d].layers) {
            return pi_fail(POWERINFER_ERR_INVALID_ARG, "placement plan: device %d has no layer sizes", d);
        }
    }
    return POWERINFER_OK;
}

// Whether `bytes` more fit on device d next to what is planned and its compute reserve.
static bool fits(const struct pi_plan_input * in, const struct pi_plan * p, int32_t d, uint64_t bytes) {
    const struct pi_plan_device * dv = &in->dev[d];
    return dv->reserve <= dv->budget && p->used[d] + bytes <= dv->budget - dv->reserve;
}

// The dense classes in PowerInfer's order; a class that fits on no device from the current
// one on stops them (the next device takes over only once the current one is full).
enum pi_class { PI_CLASS_ATTN, PI_CLASS_PRED, PI_CLASS_FFN_NORM, PI_CLASS_OUTPUT };

static uint64_t class_bytes(const struct pi_plan_input * in, int32_t d, enum pi_class c, int32_t il) {
    const struct pi_plan_layer_bytes * lb = &in->dev[d].layers[il < 0 ? 0 : il];
    switch (c) {
        case PI_CLASS_ATTN:     return lb->attn;
        case PI_CLASS_PRED:     return lb->pred;
        case PI_CLASS_FFN_NORM: return lb->ffn_norm;
        case PI_CLASS_OUTPUT:   return in->dev[d].output;
    }
    return 0;
}

static int8_t * class_slot(struct pi_plan * p, enum pi_class c, int32_t il) {
    switch (c) {
        case PI_CLASS_ATTN:     return &p->attn[il];
        case PI_CLASS_PRED:     return &p->pred[il];
        case PI_CLASS_FFN_NORM: return &p->ffn_norm[il];
        case PI_CLASS_OUTPUT:   return &p->output;
    }
    return NULL;
}

static void solve_hybrid(const struct pi_plan_input * in, struct pi_plan * p) {
    const int32_t n_layer = in->n_layer;
    int32_t d = 0;
    bool stopped = false;
    const enum pi_class order[4] = { PI_CLASS_ATTN, PI_CLASS_PRED, PI_CLASS_FFN_NORM, PI_CLASS_OUTPUT };
    for (int k = 0; k < 4 && !stopped; ++k) {
        const int32_t n = order[k] == PI_CLASS_OUTPUT ? 1 : n_layer;
        for (int32_t il = 0; il < n && !stopped; ++il) {
            if (order[k] != PI_CLASS_OUTPUT && class_bytes(in, 0, order[k], il) == 0) {
                continue;  // the model has no such tensors (no predictor, falcon's ffn_norm)
            }
            if (order[k] == PI_CLASS_OUTPUT) {
                // Devices that never take the output are passed over; when no device from
                // the current one on would take it, it stays home and nothing stops.
                bool any = false;
                for (int32_t dd = d; dd < in->n_dev; ++dd) any |= in->dev[dd].output != PI_PLAN_NO_OUTPUT;
                if (!any) {
                    break;
                }
                while (d < in->n_dev && (in->dev[d].output == PI_PLAN_NO_OUTPUT || !fits(in, p, d, in->dev[d].output))) {
                    ++d;
                }
            } else {
                while (d < in->n_dev && !fits(in, p, d, class_bytes(in, d, order[k], il))) {
                    ++d;
                }
            }
            if (d == in->n_dev) {
                stopped = true;
                break;
            }
            *class_slot(p, order[k], il) = (int8_t) d;
            p->used[d] += class_bytes(in, d, order[k], il);
        }
    }
    p->dense_all = !stopped;
    for (int32_t il = 0; il < n_layer; ++il) {
        p->ffn[il] = p->dense_all ? p->attn[il] : PI_PLAN_HOST;  // hot rows sit with their attention
    }
    if (!p->dense_all) {
        return;  // the KV cache and the FFN rows only once every dense class is placed
    }
    // Each device's layers' KV caches, all of them or none.
    for (int32_t dd = 0; dd < in->n_dev; ++dd) {
        uint64_t kv = 0;
        for (int32_t il = 0; il < n_layer; ++il) {
            if (p->attn[il] == dd) kv += in->dev[dd].layers[il].kv;
        }
        if (kv > 0 && fits(in, p, dd, kv)) {
            for (int32_t il = 0; il < n_layer; ++il) {
                if (p->attn[il] == dd) p->kv[il] = (int8_t) dd;
            }
            p->used[dd] += kv;
        }
    }
}

static uint64_t layer_total(const struct pi_plan_input * in, int32_t d, int32_t il) {
    const struct pi_plan_layer_bytes * lb = &in->dev[d].layers[il];
    return lb->attn + lb->pred + lb->ffn_norm + lb->ffn + lb->kv;
}

static void solve_layers(const struct pi_plan_input * in, struct pi_plan * p) {
    const int32_t n_layer = in->n_layer, n_dev = in->n_dev;
    const int32_t ngl = in->n_gpu_layers;
    const int32_t n_off = ngl < 0 || ngl > n_layer ? n_layer : ngl;
    const bool output = ngl < 0 || ngl > n_layer;
    const int32_t i0 = n_layer - n_off;
    // Shares: the given ones, else the budgets. Layer i0 + j goes to the first device whose
    // cumulative share passes (j + 0.5) / n_off (contiguous ranges, as llama.cpp splits).
    double share[PI_MAX_DEVICES], total = 0.0;
    bool given = false;
    for (int32_t d = 0; d < n_dev; ++d) given |= in->dev[d].share > 0.0;
    for (int32_t d = 0; d < n_dev; ++d) {
        share[d] = given ? (in->dev[d].share > 0.0 ? in->dev[d].share : 0.0) : (double) in->dev[d].budget;
        total += share[d];
    }
    int32_t d = 0, floor = 0;  // floor: the device of the last layer placed (ranges stay in device order)
    double cum = total > 0.0 ? share[0] / total : 1.0;
    for (int32_t j = 0; j < n_off && total > 0.0; ++j) {
        const int32_t il = i0 + j;
        while (d < n_dev - 1 && (j + 0.5) / n_off > cum) {
            cum += share[++d] / total;
        }
        // The planned device, or when it is full the next one with room; else the host.
        int32_t t = d > floor ? d : floor;
        while (t < n_dev && (share[t] <= 0.0 || !fits(in, p, t, layer_total(in, t, il)))) {
            ++t;
        }
        if (t == n_dev) {
            continue;
        }
        p->attn[il] = p->pred[il] = p->ffn_norm[il] = p->ffn[il] = p->kv[il] = (int8_t) t;
        p->used[t] += layer_total(in, t, il);
        floor = t;
    }
    // The output with the last layer, if asked and it fits there.
    const int8_t last = p->attn[n_layer - 1];
    if (output && last != PI_PLAN_HOST && in->dev[last].output != PI_PLAN_NO_OUTPUT && fits(in, p, last, in->dev[last].output)) {
        p->output = last;
        p->used[last] += in->dev[last].output;
    }
    p->dense_all = false;
}

int32_t pi_plan_solve(const struct pi_plan_input * in, struct pi_plan * p) {
    int32_t rc = check_input(in);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    memset(p, 0, sizeof(*p));
    memset(p->attn, PI_PLAN_HOST, sizeof(p->attn));
    memset(p->pred, PI_PLAN_HOST, sizeof(p->pred));
    memset(p->ffn_norm, PI_PLAN_HOST, sizeof(p->ffn_norm));
    memset(p->ffn, PI_PLAN_HOST, sizeof(p->ffn));
    memset(p->kv, PI_PLAN_HOST, sizeof(p->kv));
    p->output = PI_PLAN_HOST;
    if (in->mode == PI_PLAN_LAYERS) {
        solve_layers(in, p);
    } else {
        solve_hybrid(in, p);
    }
    return POWERINFER_OK;
}

int32_t pi_plan_ffn(const struct pi_plan_input * in, const struct pi_plan * p, int32_t n_groups, const double * values,
                    const uint64_t * capacity, int32_t * n_chosen) {
    int32_t rc = check_input(in);
    if (rc != POWERINFER_OK) {
        return rc;
    }
    if (n_groups < 0 || !values || !capacity || !n_chosen) {
        return pi_fail(POWERINFER_ERR_INVALID_ARG, "placement plan: invalid FFN arguments");
    }
    const int32_t n_layer = in->n_layer;
    int32_t * layers = malloc(sizeof(int32_t) * (size_t) n_layer);
    int32_t * maxg   = malloc(sizeof(int32_t) * (size_t) n_layer);
    int32_t * chosen = malloc(sizeof(int32_t) * (size_t) n_layer);
    uint64_t * cost  = malloc(sizeof(uint64_t) * (size_t) n_layer);
    double *  vals   = malloc(sizeof(double) * ((size_t) n_layer * n_groups + 1));
    if (!layers || !maxg || !chosen || !cost || !vals) {
        rc = pi_fail(POWERINFER_ERR_NO_MEMORY, "out of memory in the placement solver");
        goto done;
    }
    for (int32_t il = 0; il < n_layer; ++il) n_chosen[il] = 0;
    // One knapsack per device, over the layers whose rows go there.
    for (int32_t d = 0; d < in->n_dev && rc == POWERINFER_OK; ++d) {
        int32_t n = 0;
        for (int32_t il = 0; il < n_layer; ++il) {
            const uint64_t c = in->dev[d].layers[il].group;
            if (p->ffn[il] != d || c == 0) {
                continue;
            }
            layers[n] = il;
            cost[n]   = c;
            maxg[n]   = n_groups;
            memcpy(vals + (size_t) n * n_groups, values + (size_t) il * n_groups, sizeof(double) * (size_t) n_groups);
            ++n;
        }
        if (n == 0) {
            continue;
        }
        rc = pi_plan_groups(n, n_groups, vals, cost, maxg, capacity[d], chosen);
        for (int32_t k = 0; k < n && rc == POWERINFER_OK; ++k) {
            n_chosen[layers[k]] = chosen[k];
        }
    }
done:
    free(layers); free(maxg); free(chosen); free(cost); free(vals);
    return rc;
}
