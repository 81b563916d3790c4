#pragma once
// The fused-bias forward of F::linear (Note [Linear epilogues] in linear_epilogue.cpp).
#include <optional>

#include "flame/tensor.h"

namespace flame::detail {
// x @ weight^T + bias as one fused GEMM with its own autograd node, when the backend can run it
// (arguments already checked and autocast by F::linear); nullopt means: run the composite.
std::optional<Tensor> linear_bias_fused(const Tensor& x, const Tensor& weight, const Tensor& bias);
}  // namespace flame::detail
