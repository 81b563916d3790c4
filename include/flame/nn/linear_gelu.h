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
// recompute_hidden: the node keeps the hidden pre-activation only, not the activation h =
// gelu(pre) as well, and its backward recomputes h (one elementwise pass, a temporary freed right
// after the second layer's weight-gradient GEMM): [..., hidden] fewer bytes held per call until
// the backward, for one extra read of pre and write of h there (docs/recompute.md).
Tensor mlp_gelu(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
                bool recompute_hidden = false);
}  // namespace flame::nn::functional
