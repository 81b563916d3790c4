#pragma once
// Gradient rule of attention_qkv_packed's fused route (src/ops/attention_packed.cpp).
#include <cstdint>

#include "flame/tensor.h"

namespace flame::rules {

// The q, k, v operands of the fused kernels as strided views of a packed qkv [B, L, 3 * H * D]
// (last dim laid out (3, H, D)): each [B, H, L, D], reading qkv in place. Made without autograd
// (the node of the packed op owns the gradient); qkv must have last-dim stride 1.
TensorList packed_qkv_views(const Tensor& qkv, int64_t num_heads);

// Records the single node of out = attention_qkv_packed(qkv) on `out` ([B, L, H * D] contiguous,
// written by Backend::sdpa_forward through its [B, H, L, D] view) when qkv needs a gradient.
// Saves qkv, out and stats (the logsumexp rows [B, H, L, 1]). The rule writes dq, dk and dv
// straight into one [B, L, 3 * H * D] gradient (Note [Packed QKV attention]).
void attention_qkv_packed(Tensor& out, const Tensor& stats, const Tensor& qkv, int64_t num_heads, double scale,
                          bool causal);

}  // namespace flame::rules
