#pragma once
// Exponential moving average of weights (the EMA diffusion samplers evaluate with):
//
//   optim::EMA ema(model.parameters(), {.decay = 0.9999, .warmup = true});
//   for (int64_t step = 0; ...; ++step) { opt.step(grads); ema.update(step); }
//   { auto swapped = ema.swap_in(); sample(model); }  // EMA weights in the model inside the scope
//
// update(step): shadow += (1 - d) * (param - shadow) with d = decay, or with warmup
// d = min(decay, (1 + step) / (10 + step)). On CUDA one fused multi-tensor kernel launch per
// (device, dtype) bucket (Note [Multi-tensor apply]). Half parameters get f32 shadow weights.
// See docs/optim.md.
#include <cstdint>

#include "flame/stateful.h"
#include "flame/tensor.h"

namespace flame::optim {

struct EMAOptions {
  double decay = 0.9999;
  bool warmup = false;
  // Capturable (docs/graph-step.md): the update count lives in device memory and update() reads
  // it there when the kernel runs, so an update captured into a CUDA graph uses the right decay at
  // every replay. All parameters must be on one device.
  bool capturable = false;
};

class EMA : public Stateful {
 public:
  explicit EMA(TensorList params, EMAOptions options = {});

  // The decay update(step) uses.
  double decay_at(int64_t step) const;
  // Moves the shadow weights toward the parameters with decay_at(step) and counts one update.
  // Capturable: raises while a graph is being captured (the step would be baked in: use update()).
  void update(int64_t step);
  // The same with step = the number of updates so far (capturable: read on the device, so it can
  // be captured).
  void update();
  // Capturable: read back from the device (waits for it).
  int64_t num_updates() const;

  // Evaluation with the averaged weights: store() keeps a copy of the parameters, copy_to()
  // writes the shadow weights into them (rounded to their dtype), restore() puts the stored
  // values back (error without a store()). swap_in() does store + copy_to and restores when the
  // returned guard goes out of scope.
  void store();
  void copy_to() const;
  void restore();
  class SwapGuard {
   public:
    explicit SwapGuard(EMA& ema) : ema_(&ema) {
      ema.store();
      ema.copy_to();
    }
    ~SwapGuard() {
      if (ema_) ema_->restore();
    }
    SwapGuard(SwapGuard&& o) noexcept : ema_(o.ema_) { o.ema_ = nullptr; }
    SwapGuard(const SwapGuard&) = delete;
    SwapGuard& operator=(const SwapGuard&) = delete;
    SwapGuard& operator=(SwapGuard&&) = delete;

   private:
    EMA* ema_;
  };
  [[nodiscard]] SwapGuard swap_in() { return SwapGuard(*this); }

  const TensorList& shadow() const { return shadow_; }
  const TensorList& params() const { return params_; }
  const EMAOptions& options() const { return options_; }

  // "shadow.<i>" (the shadow weights, f32 for half parameters) and "num_updates" (int64, 0-d).
  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state) override;

 private:
  EMAOptions options_;
  TensorList params_;
  TensorList shadow_;
  TensorList backup_;
  int64_t num_updates_ = 0;
  Tensor counter_;  // capturable: the update count (0-d f64 on the parameters' device)
  void update_on_device();
};

}  // namespace flame::optim
