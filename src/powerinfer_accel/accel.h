// accel.h - the ggml backend module of the sparse kernels (accel.c): its registry entry, for
// the core (powerinfer_accel_register) and the loadable module (module.c).
#pragma once

#include "ggml-backend.h"
#include "powerinfer.h"

ggml_backend_reg_t pi_accel_reg(void);
