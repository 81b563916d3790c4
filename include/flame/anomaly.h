#pragma once
// Anomaly mode: find the first op that produced a NaN or an Inf (torch.autograd.detect_anomaly).
// See docs/profiling.md.
//
//   {
//     flame::DetectAnomalyGuard guard;     // this thread only, nestable
//     Tensor loss = model(x).mean();      // a recorded op whose output holds NaN/Inf raises here
//     Gradients g = loss.backward();      // a gradient rule returning NaN/Inf raises here
//   }
//
// While on, every recorded op (one with an input that requires grad) checks its floating output
// right after it ran, and backward checks every gradient a node's rule returns. The first
// offender raises flame::Error naming the op, its position (the index of the recorded op since
// anomaly mode was turned on on this thread: "op #7"), its input and output shapes and dtypes, the
// module path it ran in (when called through nn::Module::operator()) and, for a backward anomaly,
// the forward op that created the node with its index. Ops run with no input requiring grad (no
// node recorded) are not checked; check_finite() checks any tensor by hand.
//
// Cost: every check reads a flag back to the host, so on CUDA each checked op synchronises with
// the GPU. It is a debugging mode; off (the default) it costs one thread-local flag test per
// recorded op and per backward node.
#include <string>

#include "flame/tensor.h"

namespace flame {

class DetectAnomalyGuard {
 public:
  // check_forward = false checks gradients only (as PyTorch, whose forward checks nothing): use it
  // when the forward legitimately makes infinities, e.g. an attention mask filled with -inf.
  // check_backward = false checks forward outputs only. Nodes are numbered either way.
  explicit DetectAnomalyGuard(bool check_forward = true, bool check_backward = true);
  ~DetectAnomalyGuard();
  DetectAnomalyGuard(const DetectAnomalyGuard&) = delete;
  DetectAnomalyGuard& operator=(const DetectAnomalyGuard&) = delete;

 private:
  bool prev_on_;
  bool prev_forward_;
  bool prev_backward_;
};

// torch.autograd.set_detect_anomaly: turns anomaly mode on or off on this thread (the guard is the
// scoped form). Turning it on from off restarts the op count.
void set_detect_anomaly(bool on, bool check_forward = true, bool check_backward = true);
bool is_anomaly_enabled();
bool is_anomaly_check_forward_enabled();
bool is_anomaly_check_backward_enabled();

// Raises flame::Error("<what>: ... NaN/Inf ...") when a floating tensor holds a NaN or an Inf
// (synchronises on CUDA); integer and empty tensors pass.
void check_finite(const Tensor& t, const std::string& what);

}  // namespace flame
