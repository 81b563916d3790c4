// cuda::GraphedStep (flame/cuda/graph_step.h): warm up eagerly, capture once, replay.
//
// Note [Graphed step]
// The warm-up runs on the caller's current stream, not on a side stream: the steps it runs are
// real training steps whose results later steps read, and blocks the pool caches for the current
// stream are reused by the eager code around the replays (sampling, checkpoints); the capture
// itself runs on the graph's side stream with its private pool (Note [Graph capture]), and
// replays run on the current stream. Library plans, workspaces and JIT kernels made during the
// warm-up are keyed by shape, so the capture finds them. Errors from inside the capture are
// re-raised with the GraphedStep context; the aborted capture leaves no graph behind, and the
// next call tries again (after the user fixed the cause, e.g. in a test).
#include "flame/cuda/graph_step.h"

#include <string>

#include "flame/autograd.h"
#include "flame/device.h"
#include "flame/error.h"

namespace flame::cuda {

GraphedStep::GraphedStep(std::function<void()> step, GraphedStepOptions options)
    : step_(std::move(step)), options_(options) {
  FLAME_CHECK(static_cast<bool>(step_), "cuda::GraphedStep", "the step function is empty");
  FLAME_CHECK(options_.warmup_steps >= 0, "cuda::GraphedStep", "warmup_steps must be >= 0, got ",
              options_.warmup_steps);
}

const Graph& GraphedStep::graph() const {
  FLAME_CHECK(graph_ != nullptr && graph_->captured(), "cuda::GraphedStep::graph", "nothing captured yet (",
              calls_, " calls, ", options_.warmup_steps, " warm-up steps)");
  return *graph_;
}

void GraphedStep::reset() { graph_.reset(); }

void GraphedStep::operator()() {
  if (!options_.enabled || calls_ < options_.warmup_steps) {
    step_();
    ++calls_;
    return;
  }
  if (!captured()) {
    FLAME_CHECK(cuda_is_available(), "cuda::GraphedStep", "capturing a CUDA graph needs a CUDA device (none here, or "
                "FLAME was built without CUDA); set GraphedStepOptions::enabled = false to run the step eagerly");
    // The warm-up's activations sit in the shared pool's caches; hand them back so the graph's
    // private pool can use that memory (a one-time wait for the device).
    if (calls_ > 0) empty_cache(options_.device);
    auto graph = std::make_unique<Graph>();
    try {
      capture(*graph, step_, options_.device);
    } catch (const std::exception& e) {
      FLAME_FAIL("cuda::GraphedStep", "the step function cannot be captured into a CUDA graph (", e.what(),
                 "); a captured step may not read values to the host, synchronise, upload from the host or "
                 "change shapes; keep those outside the step");
    }
    graph_ = std::move(graph);
  }
  graph_->replay();
  ++replays_;
  ++calls_;
}

void GraphedStep::copy_input(Tensor& dst, const Tensor& src) {
  FLAME_CHECK(dst.defined() && src.defined(), "cuda::GraphedStep::copy_input", "undefined tensor");
  FLAME_CHECK(dst.sizes() == src.sizes(), "cuda::GraphedStep::copy_input", "the batch has shape ", src.sizes(),
              ", the static input ", dst.sizes(),
              "; a captured step replays the shapes it was captured with (make a new GraphedStep for another "
              "shape, or drop the last partial batch)");
  FLAME_CHECK(dst.dtype() == src.dtype(), "cuda::GraphedStep::copy_input", "the batch has dtype ",
              dtype_name(src.dtype()), ", the static input ", dtype_name(dst.dtype()));
  NoGradGuard no_grad;
  dst.copy_(src);
}

}  // namespace flame::cuda
