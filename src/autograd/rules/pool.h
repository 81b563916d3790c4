#pragma once
// Gradient rules of the pool family (pooling, upsampling, fused cross-entropy). Each records a node
// on `out` when its input needs a gradient; the backward kernels gather (no atomics).
#include <cstdint>

#include "flame/tensor.h"
#include "src/backend/backend.h"

namespace flame::rules {
// x4: the [N, C, H, W] input the kernel read; indices: the saved argmax (max pools only).
void pool2d(Tensor& out, const Tensor& x4, const Tensor& indices, const backend::Pool2dParams& p);
void upsample2d(Tensor& out, const Tensor& x4, const backend::Upsample2dParams& p);
// loss: per-row losses [N] of contiguous logits [N, V]; lse: the saved per-row logsumexp.
void cross_entropy(Tensor& loss, const Tensor& logits, const Tensor& target, const Tensor& lse, int64_t ignore_index,
                   double label_smoothing);
}  // namespace flame::rules
