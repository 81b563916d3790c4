#pragma once
// The fused cross-entropy rows behind flame::cross_entropy (Note [Fused cross-entropy] in
// cross_entropy.cpp).
#include <cstdint>

#include "flame/tensor.h"

namespace flame::detail {
// Per-row losses [N] of logits [N, V] and i64 targets [N], in f32 (f64 for f64 logits): 0 where
// ignored, (1 - eps) * (lse - x[t]) + eps * (lse - mean(x)) elsewhere. Differentiable in logits.
Tensor cross_entropy_rows(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing);
}  // namespace flame::detail
