#pragma once
// Selective recompute of cheap saved tensors (docs/recompute.md).
//
//   {
//     autograd::RecomputeCheap recompute;   // this thread, while alive
//     loss = model.forward(x) ...;          // cheap ops mark their outputs
//   }
//   loss.backward();                        // nodes that saved a marked output recompute it
//
// While a RecomputeCheap guard is alive (and enabled) on the thread, ops that are cheap to redo
// (F::layer_norm_modulate, F::layer_norm, F::rms_norm, F::group_norm, and the activations gelu,
// silu, mish, softplus, leaky_relu, elu, hardswish, hardsigmoid, and autocast's bf16/f16 -> f32
// casts of a norm's input) attach a recipe to their output
// when it requires grad: the op's inputs, held as saved
// tensors, and the call that made it. A node that later saves that output for its backward (a
// linear layer's input, kept for the weight gradient) keeps the recipe instead of the tensor, so
// the output's memory is freed as soon as the forward is done with it, and the backward reruns
// the op (grad off, the same kernels: the same values) when the rule reads it. The recipe's
// inputs are usually saved by the op's own node anyway, so holding them costs nothing more.
// An in-place write to the output or to any of the recipe's inputs after the save makes the
// backward raise, as for any saved tensor. The recipe only launches ordinary ops, so the backward
// can be captured into a CUDA graph as before.
namespace flame::autograd {

class RecomputeCheap {
 public:
  // `RecomputeCheap off(false)` turns marking off inside an enabled scope.
  explicit RecomputeCheap(bool enabled = true);
  ~RecomputeCheap();
  RecomputeCheap(const RecomputeCheap&) = delete;
  RecomputeCheap& operator=(const RecomputeCheap&) = delete;

 private:
  bool previous_;
};

// Whether ops on this thread mark their outputs recomputable now.
bool recompute_cheap_enabled();

}  // namespace flame::autograd
