#pragma once
// In-place writes under autograd (Note [In-place recording] in inplace.cpp). The in-place ops call,
// after validating their arguments:
//
//   if (rules::inplace_records(self, {src}, "add_")) {
//     Tensor old = rules::inplace_current(self).clone();
//     rules::inplace_commit(self, add(old, src), "add_");
//     return self;
//   }
//   ...plain kernel...
#include <functional>
#include <initializer_list>

#include "flame/tensor.h"
#include "src/core/tensor_impl.h"

namespace flame::rules {
// Whether the write must be recorded (grad mode on, and the destination, its base or a source
// requires grad). Raises PyTorch's errors for a leaf that requires grad, or a view of one.
bool inplace_records(const Tensor& self, std::initializer_list<std::reference_wrapper<const Tensor>> sources,
                     const char* op);
// A differentiable handle on the destination's present value and history (through its base for a view).
Tensor inplace_current(const Tensor& self);
// Writes `result` (the destination's shape) into self and gives self (and its base) the new history.
void inplace_commit(Tensor& self, const Tensor& result, const char* op);
// Regenerates the history of a view whose base took a new history since it was made.
void regenerate_view_history(const Tensor& t);
// Called wherever an op reads a tensor's autograd state: costs one compare unless t is a stale view.
inline void refresh_view_history(const Tensor& t) {
  const TensorImpl* impl = t.impl();
  if (impl->base && impl->base->history_version != impl->base_history_seen) regenerate_view_history(t);
}
}  // namespace flame::rules
