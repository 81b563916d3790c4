#pragma once
// Internal pieces of flame::checkpoint that block swapping (offload::BlockSwap), weight streaming
// and ZeRO-3's blocks reuse: the recompute scope, and checkpoint with a scope around each run.
//
// checkpoint_scoped(fn, inputs, gen, scope) is checkpoint(fn, inputs, gen), except that scope(false)
// is called before the first (no-grad) run of fn and the object it returns is released right after
// it, and scope(true) is called before the recompute in backward and what it returns is held until
// the recompute's own backward has run. Block swapping binds a block's frozen weights to device
// copies for exactly those spans: the recompute's nodes save the weights, and read them in the
// inner backward, so the binding must outlive both.
#include <functional>
#include <memory>

#include "flame/autograd.h"
#include "flame/grad_mode.h"
#include "flame/random.h"

namespace flame::autograd_detail {

// The recompute of a checkpointed forward inside a backward (flame::checkpoint, weight streaming,
// ZeRO-3 blocks): while alive, grad mode is on, the thread's backward depth is 0 (the recompute is
// a forward pass: its nodes are real) and `gen` is at `state`, the state of the first forward (so
// dropout masks match); on exit, also by an exception, the depth and the generator's state are put
// back where they were.
class RecomputeScope {
 public:
  RecomputeScope(Generator& gen, const Generator::State& state);
  ~RecomputeScope();
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;

 private:
  Generator& gen_;
  Generator::State previous_;
  int depth_;
  EnableGradGuard enable_;
};

using CheckpointScope = std::function<std::shared_ptr<void>(bool recompute)>;

Tensor checkpoint_scoped(const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs, Generator* gen,
                         const CheckpointScope& scope);

}  // namespace flame::autograd_detail
