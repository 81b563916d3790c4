#pragma once
// Normalisation layers, functional form (torch.nn.functional spelling and defaults). The modules
// (LayerNorm, RMSNorm, GroupNorm, BatchNorm1d/2d) are built on these. See docs/nn-norm.md.
//
// dtypes: f32, f64, bf16, f16. weight and bias (when given) have the input's dtype and device;
// bf16/f16 inputs compute their statistics in f32 and return the input's dtype. Every op has one
// fused backward giving the input, weight and bias gradients that are needed.
#include <optional>

#include "flame/tensor.h"

namespace flame::nn::functional {

// Normalises over the last normalized_shape.size() dims of x (which must equal normalized_shape):
// y = (x - mean) / sqrt(var + eps) * weight + bias, var biased. weight/bias have normalized_shape.
Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight = {}, const Tensor& bias = {},
                  double eps = 1e-5);

// y = x / sqrt(mean(x^2) + eps) * weight over the last dims. eps unset: the machine epsilon of x's
// dtype (torch.finfo(x.dtype).eps), as PyTorch.
Tensor rms_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight = {},
                std::optional<double> eps = std::nullopt);

// x is [N, C, *]; C is split into num_groups groups of C / num_groups channels, each normalised
// over its channels and the trailing dims; weight/bias are [C].
Tensor group_norm(const Tensor& x, int64_t num_groups, const Tensor& weight = {}, const Tensor& bias = {},
                  double eps = 1e-5);

// x is [N, C, *] (BatchNorm1d: [N, C] or [N, C, L]; BatchNorm2d: [N, C, H, W]); statistics per
// channel over N and the trailing dims. training: the batch's statistics normalise, and
// running_mean/running_var (when given, [C]) are updated in place without recording:
// running = (1 - momentum) * running + momentum * batch stat, with the unbiased batch variance.
// Eval (training = false): running_mean and running_var normalise; both are required.
Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight = {},
                  const Tensor& bias = {}, bool training = false, double momentum = 0.1, double eps = 1e-5);

}  // namespace flame::nn::functional
