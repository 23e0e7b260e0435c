// accel_missing.c - the module's API when the build found no ggml-backend-impl.h (the
// backend interface structs, from the pinned sdist: scripts/setup.sh puts it in the cache):
// every call says so, nothing is registered.
#include "powerinfer-impl.h"

#define PI_NO_MODULE "this build of libpowerinfer has no ggml backend module (ggml-backend-impl.h was not found: run scripts/setup.sh)"

int32_t powerinfer_accel_register(void) { return pi_fail(POWERINFER_ERR_UNSUPPORTED, PI_NO_MODULE); }
bool powerinfer_accel_registered(void) { return false; }
void * powerinfer_accel_backend_reg(void) { return NULL; }
int32_t powerinfer_accel_arm(const char * path, int32_t mode) { return pi_fail(POWERINFER_ERR_UNSUPPORTED, PI_NO_MODULE); }
void powerinfer_accel_disarm(void) {}
int32_t powerinfer_accel_rule_count(void) { return 0; }
int32_t powerinfer_accel_set_max_batch(int32_t n) { return pi_fail(POWERINFER_ERR_UNSUPPORTED, PI_NO_MODULE); }
int32_t powerinfer_accel_weights(int32_t tag, struct powerinfer_accel_weight * out, int32_t cap) { return 0; }
int32_t powerinfer_accel_histogram(int32_t tag, const char * name, uint64_t * counts, int32_t n_bins, float * log10_min,
                                   float * log10_max) {
    return pi_fail(POWERINFER_ERR_UNSUPPORTED, PI_NO_MODULE);
}
void powerinfer_accel_reset_stats(int32_t tag) {}
