#pragma once
// Linear layers fused with their GELU (tanh) activation, for Transformer MLPs. Each is one op and
// one autograd node; on CUDA the bias, the activation and their gradients run inside the GEMMs
// (cuBLASLt epilogues) where the layout allows, and as ordinary ops otherwise (docs/epi.md).
#include "flame/tensor.h"

namespace flame::nn::functional {
// gelu(x W^T + b, approximate="tanh"): x [..., in], weight [out, in], bias [out] (or undefined)
// -> [..., out]. Same dtype rules and autocast policy as linear.
Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());
// linear(gelu(linear(x, w1, b1), approximate="tanh"), w2, b2): x [..., in], w1 [hidden, in],
// b1 [hidden], w2 [out, hidden], b2 [out] (biases may be undefined) -> [..., out]. Its backward
// applies gelu' in the epilogue of the second layer's data-gradient GEMM.
Tensor mlp_gelu(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2);
}  // namespace flame::nn::functional
