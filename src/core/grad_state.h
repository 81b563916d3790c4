#pragma once
// The per-thread autograd state every op reads (grad mode, the checkpoint read collector, anomaly
// mode) and needs_grad, which ops and the op-invoke path test before recording. Core owns the
// declarations so that the op layer reaches them without including autograd; src/autograd
// defines t_state, needs_grad(TensorList) and collect_reads (node.cpp, functions.cpp), as it
// defines what recording means.
#include <cstdint>
#include <functional>
#include <initializer_list>

#include "flame/tensor.h"

namespace flame {

namespace autograd_detail {
struct ReadCollector;  // functions.cpp: what a checkpointed function reads (Note [Checkpoint captures])
// Per-thread autograd state, read inline on every op (recording must cost nothing when off).
struct ThreadState {
  bool grad_enabled = true;
  ReadCollector* collector = nullptr;  // set while a checkpointed function runs its first forward
  int backward_depth = 0;              // > 0 while gradient rules run (no higher-order gradients)
  // Anomaly mode (flame/anomaly.h, Note [Anomaly mode] in anomaly.cpp).
  bool anomaly = false;          // check backward gradients (and forward outputs when below is set)
  bool anomaly_forward = false;  // check the outputs of recorded ops
  uint64_t anomaly_seq = 0;      // recorded ops since anomaly mode was turned on
};
extern thread_local ThreadState t_state;
// Tells the active collector that an op read these tensors (the ones requiring grad are kept).
void collect_reads(std::initializer_list<std::reference_wrapper<const Tensor>> inputs);
void collect_reads(const TensorList& inputs);
}  // namespace autograd_detail

// Grad mode is on and at least one input requires a gradient.
bool needs_grad(const TensorList& inputs);
// The same for a braced list of tensors, without building a TensorList (ops call this on every
// invocation, so it must cost nothing when no gradient is wanted).
inline bool needs_grad(std::initializer_list<std::reference_wrapper<const Tensor>> inputs) {
  const autograd_detail::ThreadState& st = autograd_detail::t_state;
  if (!st.grad_enabled) {
    if (st.collector) autograd_detail::collect_reads(inputs);
    return false;
  }
  for (const Tensor& t : inputs) {
    if (t.requires_grad()) return true;
  }
  return false;
}

}  // namespace flame
