// attention.h - the batch-invariant attention over the f16 KV cache (attention.c), one of the
// kernels built per ISA level (kernel_variant.h).
#pragma once

#include "ggml.h"

#include <stdint.h>

// Attention of q [d, n_head, n_tokens] over the f16 caches kc, vc [d * n_head_kv, size]:
// each token over its own cells (cells: I32 [1 + n_kv, n_tokens], count then cell ids in
// position order), fp32 throughout; the result [d, n_head, n_tokens] does not depend on the
// rest of the batch or on where the cells sit (attention.c).
struct ggml_tensor * pi_attention(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * kc,
                                  struct ggml_tensor * vc, struct ggml_tensor * cells, int64_t n_head_kv, float scale);
