#pragma once
// What op functions use to take part in autograd.
//
//   Tensor y = ...compute...;
//   if (needs_grad({x})) {
//     SavedTensor sy(y);
//     record(y, "exp", {x}, [sy](const Tensor& g) { return TensorList{g * sy.get()}; });
//   }
//
// Rules capture SavedTensors, never plain Tensors: a SavedTensor holds a detached handle (no
// reference cycle through the output's node) and the storage version at save time, and get()
// raises when the tensor was modified in place afterwards.
#include <functional>
#include <initializer_list>

#include "flame/autograd.h"
#include "src/autograd/node.h"

namespace flame {

// Grad mode is on and at least one input requires a gradient.
bool needs_grad(const TensorList& inputs);
// The same for a braced list of tensors, without building a TensorList (ops call this on every
// invocation, so it must cost nothing when no gradient is wanted).
inline bool needs_grad(std::initializer_list<std::reference_wrapper<const Tensor>> inputs) {
  if (!grad_enabled()) return false;
  for (const Tensor& t : inputs) {
    if (t.requires_grad()) return true;
  }
  return false;
}
// Attaches a node computing the inputs' gradients to `out` (which becomes a non-leaf).
void record(Tensor& out, const char* name, const TensorList& inputs, Node::BackwardFn fn);

class SavedTensor {
 public:
  SavedTensor() = default;
  explicit SavedTensor(const Tensor& t, const char* op = "");
  Tensor get() const;  // raises if the storage was written in place since it was saved
  bool defined() const { return tensor_.defined(); }

 private:
  Tensor tensor_;
  uint64_t version_ = 0;
  const char* op_ = "";
};

// Sums `grad` down to `shape` (undoing broadcasting).
Tensor sum_to(const Tensor& grad, const Shape& shape);

}  // namespace flame
