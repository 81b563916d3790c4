#pragma once
// Stateful: what a training component (optimizer, scheduler, EMA, gradient scaler, data position)
// implements so that a checkpoint can save and restore it. Its whole state is a StateDict: tensors
// for buffers, and 0-dim tensors for scalars (steps as int64, rates as float64), as PyTorch keeps an
// optimizer's `step` as a tensor. One file format (safetensors) then holds a whole training state.
#include "flame/state_dict.h"

namespace flame {

class Stateful {
 public:
  virtual ~Stateful() = default;
  // A snapshot of the state. Tensors may share storage with live state only when the caller
  // cannot change it through them (writers copy what they keep).
  virtual StateDict state_dict() const = 0;
  // Restores a snapshot taken by state_dict() of a component built with the same configuration;
  // raises flame::Error naming the key on a missing key or a shape/dtype mismatch, and leaves the
  // component unchanged when it raises.
  virtual void load_state_dict(const StateDict& state) = 0;
};

}  // namespace flame
