#pragma once
// Note [Fused kernels]
// The Backend interface (backend.h) holds the kernel families every device implements: copies,
// elementwise, reductions, GEMM, convolution, attention, norms, pools, ... A fused kernel that
// serves one model pattern or one training step (a Linear's GEMM epilogues, the adaLN modulation of
// DiT blocks, the optimizers' and GradScaler's multi-tensor updates, the sync-free gradient
// clipping) is not part of it: it is a FusedKernel of its own, declared with its contract in a header of
// src/backend/fused/, implemented in the files of the backends that have it, and registered by
// them when their backend is first set up (`define`, from the backend's registration function).
// The op layer calls a kernel that may decline with `try_run`: false when the device has no
// implementation or the implementation declines the call (dtypes, layouts or sizes it does not
// take), and the op then composes ordinary ops, which are also the reference. A kernel every
// backend has (the optimizers' multi-tensor steps: both backends implement them) is called with
// `run`, which raises naming the kernel where there is none. A new fused kernel therefore adds
// its header, its kernels and one registration line; the Backend interface does not grow.
#include <array>
#include <type_traits>
#include <utility>

#include "flame/device.h"
#include "src/backend/backend.h"

namespace flame::backend {

template <class Sig>
class FusedKernel;

template <class R, class... Args>
class FusedKernel<R(Args...)> {
 public:
  using Fn = R (*)(Args...);
  constexpr explicit FusedKernel(const char* name) : name_(name) {}
  FusedKernel(const FusedKernel&) = delete;
  FusedKernel& operator=(const FusedKernel&) = delete;

  // The implementation for devices of `type` (a backend's registration function calls it once).
  void define(DeviceType type, Fn fn) { fns_[slot(type)] = fn; }
  // The implementation for `device`, or null. Its backend is set up first: that registers it.
  Fn find(Device device) const {
    (void)backend_for(device);
    return fns_[slot(device.type)];
  }
  // A kernel that may decline (bool): runs it on `device`; false (nothing written) when there is
  // none or it declines, and the caller composes.
  template <class... A>
  bool try_run(Device device, A&&... args) const
    requires std::is_same_v<R, bool>
  {
    const Fn fn = find(device);
    return fn != nullptr && fn(std::forward<A>(args)...);
  }
  // A kernel every backend that runs the op has: an error naming it and the device when absent.
  template <class... A>
  R run(Device device, A&&... args) const {
    const Fn fn = find(device);
    FLAME_CHECK(fn != nullptr, name_, "no kernel for ", device.str(), " in this build");
    return fn(std::forward<A>(args)...);
  }
  const char* name() const { return name_; }

 private:
  static constexpr std::size_t slot(DeviceType type) { return type == DeviceType::cuda ? 1 : 0; }
  const char* name_;
  std::array<Fn, 2> fns_{};
};

}  // namespace flame::backend
