#pragma once
// Mixed precision (torch.amp semantics): autocast scopes and the gradient scaler.
//
//   {
//     amp::AutocastGuard autocast(DType::bf16);          // CUDA ops; DeviceType::cpu for CPU ops
//     Tensor loss = cross_entropy(model.forward(x), y);  // matmul/linear/conv/attention in bf16
//   }                                                    // loss, softmax, norms in f32
//   Gradients grads = loss.backward();                   // runs with autocast off
//
// Which op runs in which dtype, the cast cache and the GradScaler recipe with gradient clipping
// are described in docs/amp.md.
#include <cstdint>
#include <map>

#include "flame/autograd.h"
#include "flame/device.h"
#include "flame/dtype.h"
#include "flame/stateful.h"
#include "flame/tensor.h"

namespace flame::optim {
class Optimizer;
}

namespace flame::amp {

// Enables (or disables) autocast for ops on tensors of one device type, on this thread, until
// destroyed; the previous setting of that device type comes back then (guards nest). The low
// dtype is bf16 or f16. Every guard, enabled or not, counts as one nesting level: the cast cache
// is cleared when the outermost guard of the thread is destroyed.
class AutocastGuard {
 public:
  explicit AutocastGuard(DType dtype = DType::bf16, DeviceType device_type = DeviceType::cuda);
  // `AutocastGuard off(false)`: ops of that device type run in their inputs' dtypes inside; the
  // low dtype set by an enclosing guard is kept for when it is re-enabled.
  explicit AutocastGuard(bool enabled, DeviceType device_type = DeviceType::cuda);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  void enter(bool enabled, DType dtype);
  DeviceType device_type_;
  bool prev_enabled_;
  DType prev_dtype_;
};

// torch.autocast(device_type, dtype) spelled as a function: `auto g = amp::autocast(DType::bf16);`
// (C++17 guaranteed elision: the guard is built in place).
inline AutocastGuard autocast(DType dtype = DType::bf16, DeviceType device_type = DeviceType::cuda) {
  return AutocastGuard(dtype, device_type);
}

// False inside backward and inside the body of an autocast op (where nothing casts again).
bool is_autocast_enabled(DeviceType device_type = DeviceType::cuda);
DType get_autocast_dtype(DeviceType device_type = DeviceType::cuda);  // bf16 unless a guard set f16

// The cast cache of this thread (Note [Autocast cast cache] in src/amp/autocast.cpp): a weight
// (a leaf that requires grad) is cast once per outermost autocast scope. An f32 master weight
// read by Linear keeps its low-precision copy across scopes instead, rewritten by the fused
// optimizers (Note [Kept low-precision copies]).
struct AutocastCacheStats {
  uint64_t hits = 0;     // casts answered from the cache
  uint64_t misses = 0;   // casts made and stored in the cache
  std::size_t entries = 0;
  uint64_t low_copy_hits = 0;    // casts answered by a kept copy equal to its weight
  uint64_t low_copy_writes = 0;  // kept copies made or rewritten because their weight changed
};
AutocastCacheStats autocast_cache_stats();
void clear_autocast_cache();  // also resets the hit/miss counters

// ---- GradScaler (torch.amp.GradScaler) ----
// Dynamic loss scaling for f16 training. The scale and the growth tracker live on the host (one
// double, one counter); the Inf/NaN flag of each optimizer's gradients is a device tensor written
// by unscale_ without synchronising. step() reads that flag: it is the one documented host
// synchronisation of the scaler (update() reads it instead when step() was not called).
//
//   Tensor loss;
//   { amp::AutocastGuard ac(DType::f16); loss = loss_fn(model.forward(x)); }
//   Gradients grads = scaler.scale(loss).backward();
//   scaler.unscale_(opt, grads);           // optional: before clipping
//   clip_grad_norm_(grads, 1.0);
//   scaler.step(opt, grads);               // skips the step when a gradient has Inf/NaN
//   scaler.update();                       // backoff on Inf/NaN, growth after growth_interval
struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;  // disabled: scale() returns the loss, step() just steps
};

class GradScaler : public Stateful {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // loss * scale (a recorded op: its gradient carries the scale into every parameter gradient).
  Tensor scale(const Tensor& loss) const;
  // Divides, in place, every gradient in `grads` of `optimizer`'s parameters by the scale and
  // records on the device whether any is Inf/NaN (one fused pass; no host synchronisation).
  // Raises when called twice for one optimizer before update().
  void unscale_(const optim::Optimizer& optimizer, Gradients& grads);
  // Unscales first unless unscale_ was already called for this optimizer since the last update,
  // reads the Inf/NaN flag (host synchronisation) and calls optimizer.step(grads) only when every
  // gradient is finite. Returns whether the optimizer stepped.
  bool step(optim::Optimizer& optimizer, Gradients& grads);
  // Backoff (scale *= backoff_factor, tracker reset) when any optimizer stepped through since the
  // last update saw Inf/NaN; otherwise the tracker counts one clean step and the scale grows by
  // growth_factor every growth_interval clean steps. Raises when no unscale happened since the
  // last update (as PyTorch: update() belongs after step()).
  void update();
  void update(double new_scale);  // sets the scale directly (and forgets the recorded flags)

  double get_scale() const { return enabled_ ? scale_ : 1.0; }
  int64_t growth_tracker() const { return growth_tracker_; }
  bool is_enabled() const { return enabled_; }
  const GradScalerOptions& options() const { return options_; }

  // keys: "scale" (f64), "growth_factor", "backoff_factor" (f64), "growth_interval",
  // "_growth_tracker" (i64), as PyTorch's GradScaler.state_dict().
  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state) override;

 private:
  struct PerOptimizer {
    bool unscaled = false;
    bool stepped = false;
    Tensor found_inf;          // 0-d f32 on the gradients' device; undefined: no gradients
    bool found_read = false;   // found_value holds the host copy of found_inf
    bool found_value = false;
  };
  bool read_found_inf(PerOptimizer& st);
  GradScalerOptions options_;
  bool enabled_;
  double scale_;
  int64_t growth_tracker_ = 0;
  std::map<const optim::Optimizer*, PerOptimizer> per_opt_;
};

}  // namespace flame::amp
