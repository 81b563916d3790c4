#pragma once
// The op layer's seam to autograd::RecomputeCheap (Note [Recompute cheap] in
// src/autograd/recompute.cpp): an op whose output is cheap to make again marks it with a recipe,
// and a node that saves the output keeps the recipe instead of the bytes. The op layer owns these
// declarations; src/autograd implements them (so no op includes autograd). invoke<Def> marks the
// outputs of definitions with `recomputable = true` (Note [Invoke]).
#include <functional>

#include "flame/tensor.h"

namespace flame::autograd_detail {

// Makes a marked output again from its recipe inputs (grad mode off, autocast excluded, marking
// off while it runs). Must return the output's shape, dtype and device.
using RecipeFn = std::function<Tensor(const TensorList& inputs)>;

// Whether an op should mark its output now: RecomputeCheap is on and grad mode is on.
bool should_mark_recomputable();
// Attaches the recipe to out's storage when out owns it whole (contiguous from offset 0);
// inputs are held as saved tensors (version-checked when the recipe runs). An input that is itself
// a marked output is replaced by its own recipe's inputs (Note [Recompute cheap], "Chains").
void mark_recomputable(const Tensor& out, const char* op, const TensorList& inputs, RecipeFn fn);
// For an op whose node does not save `inputs` and whose output has their bytes (cat, rotary's x):
// whether a recipe over them frees more than it keeps. A recipe folds an input that is a marked
// output (taking that recipe's inputs, which other nodes save anyway) and holds any other input as
// it is, which then lives until the backward; worth it when those held inputs come to less than
// half of all the inputs' bytes.
bool worth_a_recipe(const TensorList& inputs);

// Marking off for a scope (what `autograd::RecomputeCheap off(false)` does): an op that marks its
// output as one keeps the ops of its composite path from marking theirs.
class MarkingOff {
 public:
  MarkingOff();
  ~MarkingOff();
  MarkingOff(const MarkingOff&) = delete;
  MarkingOff& operator=(const MarkingOff&) = delete;

 private:
  bool previous_;
};

}  // namespace flame::autograd_detail
