#pragma once
// Whole training steps as CUDA graphs (docs/graph-step.md):
//
//   Tensor x = Tensor::empty({B, D}, cuda), y = ...;            // static inputs
//   optim::AdamW opt(params, {.lr = 1e-3, .capturable = true});  // reads lr/step from the device
//   optim::EMA ema(params, {.decay = 0.999, .capturable = true});
//   Tensor loss_out, norm_out;                                   // static outputs
//   cuda::GraphedStep step([&] {
//     Tensor loss = model.loss(x, y);
//     Gradients g = loss.backward();
//     norm_out = clip_grad_norm(g, 1.0);                         // no host read
//     opt.step(g);
//     ema.update();
//     loss_out = loss.detach();
//   });
//   for (auto& batch : loader) {
//     cuda::GraphedStep::copy_input(x, batch.x);                 // refill in place
//     sched.step();                                              // writes lr to the device
//     step();                                                    // eager warm-up, then replays
//     if (log) print(loss_out.item<float>());
//   }
//
// The first `warmup_steps` calls run the function eagerly on the current stream (they are real
// steps: optimizer state, cuBLASLt/cuDNN plans and workspaces, JIT kernels and pool blocks come
// into being); the next call captures it into a cuda::Graph and replays it at once (a capture
// does not run the work); every later call replays. Tensors the function assigns to outer
// variables during the capture are graph-private blocks that every replay rewrites: read them
// after a call. Random draws inside the step (dropout, noise, timesteps) draw fresh numbers at
// every replay (Note [Graph-safe RNG]). A function that does something a capture cannot hold
// (reads a value to the host, synchronises, uploads from the host) raises flame::Error at the
// capture, naming GraphedStep and the offending op; the shapes are those of the capture, so a
// different batch shape must be a new GraphedStep (copy_input says so).
#include <cstdint>
#include <functional>
#include <memory>

#include "flame/cuda.h"
#include "flame/tensor.h"

namespace flame::cuda {

struct GraphedStepOptions {
  int warmup_steps = 3;  // eager calls before the capture (>= 1 for optimizers: state is made eagerly)
  int device = 0;
  // false: every call runs the function eagerly (CPU runs, --no-compile), with the same code path.
  bool enabled = true;
};

class GraphedStep {
 public:
  explicit GraphedStep(std::function<void()> step, GraphedStepOptions options = {});

  // One step: eager while warming up, then capture + replay, then replays.
  void operator()();
  bool captured() const { return graph_ != nullptr && graph_->captured(); }
  int64_t calls() const { return calls_; }
  int64_t replays() const { return replays_; }
  const GraphedStepOptions& options() const { return options_; }
  // The graph (after the capture); for random_offsets_per_replay and the like.
  const Graph& graph() const;
  // Drops the captured graph and its private memory; the next call captures again.
  void reset();

  // Copies `src` into the static input `dst` in place (any devices; an upload runs on the current
  // stream, outside the graph). Raises when the shape or dtype differs: a graph replays the shapes
  // it captured.
  static void copy_input(Tensor& dst, const Tensor& src);

 private:
  std::function<void()> step_;
  GraphedStepOptions options_;
  std::unique_ptr<Graph> graph_;
  int64_t calls_ = 0;
  int64_t replays_ = 0;
};

}  // namespace flame::cuda
