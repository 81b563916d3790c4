#pragma once
// DistributedDataParallel and DistributedSampler (docs/distributed.md; the sampler lives in
// flame/data/sampler.h).
//
//   auto model = std::make_shared<MyNet>();  model->to(dist::default_group().device());
//   dist::DistributedDataParallel ddp(model);   // broadcasts rank 0's parameters and buffers
//   Gradients grads = ddp(x).mse_loss(y).backward();   // buckets are all-reduced as they fill
//   ddp.finish_gradients(grads);                // grads now hold the average over the ranks
//   opt.step(grads);
//
// Gradient accumulation: backward into one store with BackwardOptions::accumulate_into; run the
// first micro-batches inside `auto guard = ddp.no_sync();` (no communication) and the last one
// outside it; its hooks see the accumulated gradients.
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "flame/autograd.h"
#include "flame/cuda.h"
#include "flame/data/sampler.h"
#include "flame/nn/module.h"
#include "flame/tensor.h"

namespace flame::dist {

class ProcessGroup;

struct DDPOptions {
  // Gradients are packed, in reverse registration order (roughly the order backward produces
  // them), into buckets of at most this size; a bucket is all-reduced as soon as its last
  // gradient arrives, while backward goes on.
  double bucket_cap_mb = 25.0;
  bool broadcast_buffers = true;  // at construction, with the parameters
  // CUDA: record a timing event on the compute stream at each bucket launch (the point where the
  // bucket's gradients are ready on the GPU), for overlap measurements (last_launch_events()).
  bool record_launch_events = false;
  // Reduce floating gradients in this dtype (bf16, f16 or f32) instead of their own, like PyTorch's
  // bf16_compress_hook: half the bytes on the wire (and in the buckets) for f32 gradients, at the
  // cost of rounding each gradient to the reduce dtype before the average; the averaged result is
  // written back in the gradient's dtype. Unset (default): gradients are reduced as they are.
  std::optional<DType> reduce_dtype;
};

class DistributedDataParallel {
 public:
  explicit DistributedDataParallel(std::shared_ptr<nn::Module> module, DDPOptions options = {},
                                   std::shared_ptr<ProcessGroup> group = nullptr);
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // module->forward(x); a model with another signature is called directly (the hooks do the work).
  Tensor forward(const Tensor& x);
  Tensor operator()(const Tensor& x) { return forward(x); }
  nn::Module& module() { return *module_; }
  const std::shared_ptr<nn::Module>& module_ptr() const { return module_; }

  // Waits for the reductions of the backward that just ran (launching buckets whose parameters
  // got no gradient on this rank, with zeros for them) and writes the averaged gradients into
  // `grads`. Call it after backward and before reading the gradients. Inside no_sync(), or when
  // no backward ran since the last call, it does nothing.
  void finish_gradients(Gradients& grads);

  // While alive, backward passes reduce nothing (gradient accumulation).
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  // ---- introspection (tests, benchmarks) ----
  std::size_t num_buckets() const;
  std::vector<std::size_t> bucket_bytes() const;
  // Seconds, on the host's steady clock, of each bucket launch in the last synchronised backward,
  // in launch order (what the overlap of communication with backward is measured from).
  std::vector<double> last_launch_times() const;
  // With DDPOptions::record_launch_events: the events of the last synchronised backward's bucket
  // launches, in launch order (compare with cuda::Event::elapsed_time).
  std::vector<std::shared_ptr<cuda::Event>> last_launch_events() const;
  static double now_seconds();

  struct State;

 private:
  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<State> state_;
};

// flame::data::DistributedSampler (flame/data/sampler.h), under the name it had here first.
using DistributedSampler = flame::data::DistributedSampler;

}  // namespace flame::dist
