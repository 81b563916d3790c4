#pragma once
// The op-level autocast hook (Note [Autocast policy] in src/amp/autocast.cpp): what an op consults
// and the casts it makes. The op layer owns these declarations; src/amp implements them and keeps
// the state (src/amp/autocast.h), so no op includes amp. An op on the autocast lists starts with
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

// The low-precision copy of master weight w (an f32 leaf that requires grad) for a node that
// records w itself: its kept copy, made or refreshed when w changed. Made without a graph.
Tensor master_low_copy(const Tensor& w);

}  // namespace flame::amp::detail
