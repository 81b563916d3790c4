#pragma once
// Arguments of the fused optimizer and EMA kernels (Backend::optim_step / ema_update). The
// optimizer layer (src/optim) validates tensors, creates state, and computes the per-tensor
// scalars (bias corrections) in double on the host; a backend only applies the update.
#include <cstdint>
#include <vector>

#include "flame/tensor.h"

namespace flame::backend {

enum class OptimKind : uint8_t { sgd, adam, lion };

// Hyperparameters shared by every tensor of one call (one parameter group, one dtype bucket).
struct OptimHyper {
  OptimKind kind = OptimKind::adam;
  double lr = 0;
  double weight_decay = 0;
  double beta1 = 0, beta2 = 0, eps = 0;  // adam, lion
  double momentum = 0, dampening = 0;    // sgd
  bool nesterov = false;
  bool maximize = false;
  bool amsgrad = false;
  bool decoupled_weight_decay = false;  // AdamW: p *= 1 - lr * wd before the Adam update
  bool stochastic_rounding = false;     // bf16 params written from an f32 master
  uint64_t seed = 0;                    // Philox key of the stochastic rounding
  // Capturable steps (Note [Capturable optimizers] in src/optim/fused_optimizer.cpp): when set,
  // the kernel reads lr, weight_decay, beta1, beta2, eps, momentum, dampening (in that order,
  // kDeviceHyperSize f64 values) from this array in the tensors' memory instead of the fields
  // above, so a replayed graph sees the values written since the capture.
  const double* device_hyper = nullptr;
};

constexpr int kDeviceHyperSize = 7;

// One parameter of a call. All tensors of a call share the parameter dtype, the state dtype and
// the device; every tensor of an entry has the parameter's numel and dense layout.
struct OptimTensor {
  Tensor param;   // updated in place (rounded from `master` when that is defined)
  Tensor grad;
  Tensor master;  // f32 master weights of a half parameter, or undefined
  // An f32 parameter's kept bf16/f16 copy (Note [Kept low-precision copies], src/amp/autocast.cpp),
  // or undefined: written in the same pass as the rounding of the updated parameter.
  Tensor low;
  // sgd: momentum_buffer (undefined when momentum == 0); adam: exp_avg, exp_avg_sq,
  // max_exp_avg_sq (amsgrad only); lion: exp_avg.
  Tensor state[3];
  double step_size = 0;   // adam: lr / (1 - beta1^t)
  double bias2_sqrt = 1;  // adam: sqrt(1 - beta2^t)
  bool first = false;     // sgd: the momentum buffer starts as the gradient
  // Stochastic rounding: element i of this tensor draws Philox(seed, rng_index + i, rng_offset).
  uint64_t rng_index = 0;
  uint64_t rng_offset = 0;
  // Capturable steps: the parameter's step count t (already advanced), an f64 in the tensors'
  // memory. When set, step_size, bias2_sqrt and rng_offset are computed from it by the kernel.
  const double* device_step = nullptr;
};

// Counts fused optimizer/EMA kernel launches (CUDA) and backend calls (CPU), process-wide; read by
// optim::fused_launch_count() so tests can check that a step is one launch, not one per tensor.
void optim_count_launch();
int64_t optim_launch_count();

}  // namespace flame::backend
