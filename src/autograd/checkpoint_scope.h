#pragma once
// flame::checkpoint with a scope around each run of the function (internal; offload::BlockSwap).
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

namespace flame::autograd_detail {

using CheckpointScope = std::function<std::shared_ptr<void>(bool recompute)>;

Tensor checkpoint_scoped(const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs, Generator* gen,
                         const CheckpointScope& scope);

}  // namespace flame::autograd_detail
