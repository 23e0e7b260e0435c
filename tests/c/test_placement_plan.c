// test_placement_plan.c - the placement plan (placement_plan.c) on its own: reads a plan's
// input from stdin, prints the plan (tests/test_placement_plan.py checks it against a
// reference of the rules and a brute force of the FFN knapsack).
//
// stdin (whitespace-separated numbers):
//   mode n_dev n_layer n_gpu_layers
//   per device: budget reserve share output
//   per device, per layer: attn pred ffn_norm ffn kv group
//   n_groups, then n_layer * n_groups group values, then n_dev capacities
// stdout: one line per field: "attn d0 d1 ...", "pred ...", "ffn_norm ...", "ffn ...", "kv ...",
//   "output d", "dense_all 0|1", "used u0 u1 ...", "chosen c0 c1 ..." (or "error <message>").
#include "placement_plan.h"

#include "powerinfer-impl.h"

#include <stdio.h>
#include <stdlib.h>

static void print_row(const char * name, const int8_t * v, int32_t n) {
    printf("%s", name);
    for (int32_t i = 0; i < n; ++i) printf(" %d", v[i]);
    printf("\n");
}

int main(void) {
    static struct pi_plan_input in;
    static struct pi_plan plan;
    static struct pi_plan_layer_bytes layers[PI_MAX_DEVICES][PI_PLAN_MAX_LAYERS];
    int mode = 0;
    if (scanf("%d %d %d %d", &mode, &in.n_dev, &in.n_layer, &in.n_gpu_layers) != 4 || in.n_dev < 1 ||
        in.n_dev > PI_MAX_DEVICES || in.n_layer < 1 || in.n_layer > PI_PLAN_MAX_LAYERS) {
        printf("error bad header\n");
        return 1;
    }
    in.mode = (enum pi_plan_mode) mode;
    for (int32_t d = 0; d < in.n_dev; ++d) {
        unsigned long long budget, reserve, output;
        double share;
        if (scanf("%llu %llu %lf %llu", &budget, &reserve, &share, &output) != 4) {
            printf("error bad device\n");
            return 1;
        }
        in.dev[d] = (struct pi_plan_device) { budget, reserve, share, output, layers[d] };
    }
    for (int32_t d = 0; d < in.n_dev; ++d) {
        for (int32_t il = 0; il < in.n_layer; ++il) {
            unsigned long long v[6];
            if (scanf("%llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5]) != 6) {
                printf("error bad layer\n");
                return 1;
            }
            layers[d][il] = (struct pi_plan_layer_bytes) { v[0], v[1], v[2], v[3], v[4], v[5] };
        }
    }
    int32_t n_groups = 0;
    if (scanf("%d", &n_groups) != 1 || n_groups < 0) {
        printf("error bad groups\n");
        return 1;
    }
    double * values = malloc(sizeof(double) * ((size_t) in.n_layer * n_groups + 1));
    uint64_t capacity[PI_MAX_DEVICES];
    int32_t chosen[PI_PLAN_MAX_LAYERS];
    for (size_t i = 0; i < (size_t) in.n_layer * n_groups; ++i) {
        if (scanf("%lf", &values[i]) != 1) {
            printf("error bad values\n");
            return 1;
        }
    }
    for (int32_t d = 0; d < in.n_dev; ++d) {
        unsigned long long c;
        if (scanf("%llu", &c) != 1) {
            printf("error bad capacity\n");
            return 1;
        }
        capacity[d] = c;
    }
    if (pi_plan_solve(&in, &plan) != POWERINFER_OK) {
        printf("error %s\n", powerinfer_last_error());
        return 0;
    }
    print_row("attn", plan.attn, in.n_layer);
    print_row("pred", plan.pred, in.n_layer);
    print_row("ffn_norm", plan.ffn_norm, in.n_layer);
    print_row("ffn", plan.ffn, in.n_layer);
    print_row("kv", plan.kv, in.n_layer);
    printf("output %d\ndense_all %d\nused", plan.output, plan.dense_all ? 1 : 0);
    for (int32_t d = 0; d < in.n_dev; ++d) printf(" %llu", (unsigned long long) plan.used[d]);
    printf("\n");
    if (n_groups > 0) {
        if (pi_plan_ffn(&in, &plan, n_groups, values, capacity, chosen) != POWERINFER_OK) {
            printf("error %s\n", powerinfer_last_error());
            return 0;
        }
        printf("chosen");
        for (int32_t il = 0; il < in.n_layer; ++il) printf(" %d", chosen[il]);
        printf("\n");
    }
    free(values);
    return 0;
}
