#pragma once
// The training step's multi-tensor kernels as fused kernels (Note [Fused kernels]): one update of
// many tensors per call (one launch on CUDA, whatever their number). Both backends implement them
// (src/backend/cpu/cpu_optim.cpp, cpu_graph.cpp, cpu_amp.cpp: the reference; src/backend/cuda/
// optim/multi_tensor.cu, graph/foreach_norm.cu, amp/amp_unscale.cu), so callers use `run`.
#include <vector>

#include "src/backend/fused.h"
#include "src/backend/optim_params.h"

namespace flame::backend::fused {

// One fused update of every tensor in `tensors` (src/backend/optim_params.h; Note [Optimizer
// element math]). (hyper, tensors)
extern FusedKernel<void(const OptimHyper&, const std::vector<OptimTensor>&)> optim_step;

// shadow[k] += weight * (params[k] - shadow[k]) for every k (torch._foreach_lerp_); shadow and
// params pair up by index with equal numel and dense layout; all shadows share one dtype, all
// params one dtype. (shadow, params, weight)
extern FusedKernel<void(const TensorList&, const TensorList&, double)> ema_update;

// Capturable EMA (Note [Capturable optimizers], src/optim/fused_optimizer.cpp): ema_update with
// weight = 1 - decay_at(n), n read at kernel time from `step` (0-d f64 on the tensors' device).
// (shadow, params, step, decay, warmup)
extern FusedKernel<void(const TensorList&, const TensorList&, const Tensor&, double, bool)> ema_update_device;

// Sync-free gradient norm (Note [Device gradient clipping], src/autograd/grad_clip_device.cpp).
// `tensors` share one floating dtype, lie on one device and are dense; `acc` is a 0-d f64 on that
// device. Adds sum_k sum_i |t_k[i]|^p to acc (for p = inf: acc = max(acc, max |t_k[i]|)), in one
// multi-tensor pass (plus one single-block pass to fold the partial sums) on CUDA, in a fixed
// order, so the result does not vary between runs. (tensors, norm_type, acc)
extern FusedKernel<void(const TensorList&, double, const Tensor&)> foreach_norm_accumulate;

// Multiplies every tensor in place by min(1, max_norm / (norm + 1e-6)), norm = total_norm (0-d f64
// on the tensors' device) read at kernel time; NaN coefficients propagate (torch.clamp). Tensors
// as above; a coefficient of exactly 1 leaves them unwritten. (tensors, total_norm, max_norm)
extern FusedKernel<void(const TensorList&, const Tensor&, double)> foreach_clip_scale;

// GradScaler's fused unscale (src/train/grad_scaler.cpp): each tensor of `grads` (floating, on one
// device, non-overlapping and dense with non-negative strides, so its elements fill [data_ptr,
// data_ptr + numel)) is multiplied in place by inv_scale (in float; double for f64), and found_inf
// (0-d f32) is set to 1 when any element read is Inf or NaN, else left as it is. One pass over all
// the tensors; no host synchronisation. (grads, inv_scale, found_inf)
extern FusedKernel<void(const TensorList&, double, const Tensor&)> amp_unscale;

}  // namespace flame::backend::fused
