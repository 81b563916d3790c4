#pragma once
// The memory layout the rotary kernel takes without a copy besides contiguous [..., S, D]
// (Note [Rotary embedding] in src/ops/rotary.cpp).
#include "flame/tensor.h"

namespace flame::nn::functional {
// x is [B, H, S, D] over contiguous [B, S, H, D] memory (the heads-transposed view of a projection).
bool heads_inner(const Tensor& x);
}  // namespace flame::nn::functional
