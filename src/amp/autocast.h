#pragma once
// The op-level autocast hook (Note [Autocast policy] in src/amp/autocast.cpp). An op on the
// autocast lists starts with
//
//   if (amp::detail::should_autocast(x)) {
//     amp::detail::AutocastOpScope scope;   // ops called from here on do not cast again
//     return op(amp::detail::cast_low(x), amp::detail::cast_low(w));   // or cast_f32
//   }
//
// The check is two thread-local integer reads when autocast is off.
#include <cstdint>

#include "flame/tensor.h"

namespace flame::amp::detail {

// Bit d set: autocast enabled for DeviceType d on this thread.
extern thread_local uint32_t t_enabled_mask;
// > 0 inside an autocast op's body and inside backward: no op casts there.
extern thread_local int32_t t_excluded;

inline bool should_autocast(const Tensor& t) {
  if (t_enabled_mask == 0 || t_excluded != 0 || !t.defined()) return false;
  return ((t_enabled_mask >> static_cast<uint32_t>(t.device().type)) & 1u) != 0;
}

// Excludes nested ops from autocast while alive (PyTorch's ExcludeDispatchKeyGuard on the
// autocast key): an op on the lists casts its inputs once, and whatever it calls runs in the
// dtypes it was given.
class AutocastOpScope {
 public:
  AutocastOpScope() { ++t_excluded; }
  ~AutocastOpScope() { --t_excluded; }
  AutocastOpScope(const AutocastOpScope&) = delete;
  AutocastOpScope& operator=(const AutocastOpScope&) = delete;
};

// Autocast off for the current thread while alive (the autograd engine runs gradient rules and
// hooks under it, as PyTorch's engine runs backward outside autocast).
using AutocastOffGuard = AutocastOpScope;

// x in the low dtype of its device type's autocast when eligible (floating, not f64, not already
// that dtype); others unchanged. Weights (leaves that require grad) go through the cast cache.
Tensor cast_low(const Tensor& x);
// bf16/f16 x in f32; others unchanged.
Tensor cast_f32(const Tensor& x);
// The low dtype of x's device type.
DType low_dtype(const Tensor& x);

// Note [Kept low-precision copies] (src/amp/autocast.cpp): the bf16/f16 copy of an f32 master
// weight that linear's GEMMs read, kept across steps and rewritten by the fused optimizers.
struct LowCopy {
  Tensor copy;                       // dense, in the weight's layout, on its device
  const void* storage = nullptr;     // the weight's storage when copy was last made equal to it
  uint64_t version = 0;              // the weight's version then
};
// The low-precision copy of master weight w (an f32 leaf that requires grad) for a node that
// records w itself: its kept copy, made or refreshed when w changed. Made without a graph.
Tensor master_low_copy(const Tensor& w);
// The kept copy of w for an optimizer to write beside w's update (undefined when w has none that
// is dense in w's layout), and the call after the in-place update and w's version bump: marks
// `written` (the copy the update wrote, or undefined) equal to w; during a CUDA graph capture it
// also registers a replay epilogue that advances w's version after every replay, as the eager
// step did, and marks `written` again.
Tensor low_copy_for_update(const Tensor& w);
void low_copy_updated(const Tensor& w, const Tensor& written);
// Forgets w's kept copy (Tensor::set_data: the data behind the handle changed).
void drop_low_copy(const Tensor& w);

// The autocast settings of this thread, captured by checkpoint() at forward time and put back
// (with exclusion lifted and one nesting level, so the cast cache is cleared after) while the
// forward is recomputed inside backward.
struct AutocastState {
  uint32_t mask = 0;
  DType dtype[2] = {DType::bf16, DType::bf16};
};
AutocastState autocast_state();
class AutocastStateGuard {
 public:
  explicit AutocastStateGuard(const AutocastState& state);
  ~AutocastStateGuard();
  AutocastStateGuard(const AutocastStateGuard&) = delete;
  AutocastStateGuard& operator=(const AutocastStateGuard&) = delete;

 private:
  AutocastState saved_;
  int32_t saved_excluded_;
};

}  // namespace flame::amp::detail
