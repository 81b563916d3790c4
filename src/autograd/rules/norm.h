#pragma once
// Gradient rules of the normalisation family (layer_norm, rms_norm, group_norm, batch_norm). Each
// records one node whose backward is one fused backend call (Note [Norm kernels] in
// src/ops/norm.cpp). x is the contiguous input the kernel read; weight/bias may be undefined.
#include "flame/tensor.h"

namespace flame::rules {
// mean undefined: rms_norm. Statistics are per row (rstd.numel() rows).
void norm_rows(Tensor& y, const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& mean,
               const Tensor& rstd);
void group_norm(Tensor& y, const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& mean,
                const Tensor& rstd, int64_t groups);
// training: mean/rstd are the batch's own statistics (they depend on x).
void batch_norm(Tensor& y, const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& mean,
                const Tensor& rstd, bool training);
}  // namespace flame::rules
