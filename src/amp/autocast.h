#pragma once
// Autocast's state and its kept low-precision copies of master weights (Note [Autocast policy] in
// src/amp/autocast.cpp). The hook every op consults, and the casts it makes, are declared in the
// op layer: src/ops/autocast_hooks.h.
#include <cstdint>

#include "flame/tensor.h"
#include "src/core/autocast_seam.h"
#include "src/ops/autocast_hooks.h"

namespace flame::amp::detail {

// Note [Kept low-precision copies] (src/amp/autocast.cpp): the bf16/f16 copy of an f32 master
// weight that linear's GEMMs read, kept across steps and rewritten by the fused optimizers.
struct LowCopy {
  Tensor copy;                       // dense, in the weight's layout, on its device
  const void* storage = nullptr;     // the weight's storage when copy was last made equal to it
  uint64_t version = 0;              // the weight's version then
};
// The kept copy of w for an optimizer to write beside w's update (undefined when w has none that
// is dense in w's layout), and the call after the in-place update and w's version bump: marks
// `written` (the copy the update wrote, or undefined) equal to w; during a CUDA graph capture it
// also registers a replay epilogue that advances w's version after every replay, as the eager
// step did, and marks `written` again.
Tensor low_copy_for_update(const Tensor& w);
void low_copy_updated(const Tensor& w, const Tensor& written);
// drop_low_copy(w), which Tensor::set_data calls, is declared in core: src/core/autocast_seam.h.

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
