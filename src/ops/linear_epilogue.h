#pragma once
// The fused-bias forward of F::linear (Note [Linear epilogues] in linear_epilogue.cpp).
#include <optional>

#include "flame/tensor.h"

namespace flame::detail {
// x @ weight^T + bias as one fused GEMM with its own autograd node, when the backend can run it
// (arguments already checked and autocast by F::linear); nullopt means: run the composite.
std::optional<Tensor> linear_bias_fused(const Tensor& x, const Tensor& weight, const Tensor& bias);
// F::linear under autocast with x already cast (xl) and an f32 weight that wants a gradient: one
// node whose inputs are the f32 weight and bias themselves (Note [Master-weight epilogues]);
// nullopt when that does not apply (then cast the weight and bias as usual).
std::optional<Tensor> linear_master(const Tensor& xl, const Tensor& weight, const Tensor& bias);
}  // namespace flame::detail
