#pragma once
// Fused pieces of adaptive-LayerNorm (adaLN) blocks, as DiT-style diffusion transformers use them
// (docs/nn-norm.md, "adaLN"). Each is one op and one autograd node on CUDA, where a kernel reads
// its inputs once and writes the modulation gradients itself (summed over the tokens, no separate
// reduction); elsewhere, and for shapes or dtypes the kernels do not cover, the same math runs as
// ordinary ops (which is also the CPU reference).
#include <utility>

#include "flame/tensor.h"

namespace flame::nn::functional {

// layer_norm(x, [D], no affine, eps) * (1 + scale) + shift, with shift and scale [B, D]
// broadcast over x's middle dims: x [B, ..., D] -> x's shape. shift and scale may be strided
// views (the chunks of one [B, k*D] modulation projection). Result dtype: the promotion of the
// three; under autocast the normalisation runs in f32 and the result has the autocast dtype (its
// consumer is a linear layer, which would cast it anyway).
Tensor layer_norm_modulate(const Tensor& x, const Tensor& shift, const Tensor& scale, double eps = 1e-5);

// x + gate * y with gate [B, D] broadcast over the middle dims of x and y ([B, ..., D], one
// shape). Result dtype: the promotion of the three (f32 for an f32 residual stream with bf16
// branches under autocast).
Tensor gated_residual(const Tensor& x, const Tensor& gate, const Tensor& y);

// {h, y} with h = gated_residual(x, gate, branch) and y = layer_norm_modulate(h, shift, scale, eps):
// a block's residual update and the modulated norm of the next branch, which reads it. The same
// values, dtypes and autograd graph as the two calls (two nodes); on CUDA one kernel computes both
// and reads the residual stream once (x f32, or x's half type without autocast).
std::pair<Tensor, Tensor> gated_residual_modulate(const Tensor& x, const Tensor& gate, const Tensor& branch,
                                                  const Tensor& shift, const Tensor& scale, double eps = 1e-5);

}  // namespace flame::nn::functional
