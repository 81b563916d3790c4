#pragma once
// ZeRO stage 1: optimizer state sharded across the ranks (docs/distributed.md).
//
//   dist::ZeroRedundancyOptimizer opt(
//       {optim::AdamWOptions{.lr = 1e-4}.group(model->parameters())},
//       [](std::vector<optim::ParamGroup> g) { return std::make_unique<optim::AdamW>(g, optim::AdamWOptions{}); });
//   Gradients grads = loss.backward();   // plain local gradients (no DDP wrapper needed)
//   opt.step(grads);                     // reduce-scatter (average), local step, all-gather
//
// Each parameter group is laid out flat (one dtype per group) and padded to a multiple of the
// world size; rank r owns elements [r*S, (r+1)*S) and its inner optimizer holds state only for
// that slice. The inner optimizer must be elementwise (SGD, Adam, AdamW, Lion); Adafactor's
// factored state is not. A parameter without a gradient on a rank contributes zeros.
// state_dict() is collective (every rank calls it) and returns the state the inner optimizer
// would have on the full parameters ("state.<i>.<slot>" in parameter shapes), so a checkpoint
// loads on any number of ranks, or into the plain optimizer.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flame/optim/optimizer.h"

namespace flame::dist {

class ProcessGroup;

using OptimizerFactory = std::function<std::unique_ptr<optim::Optimizer>(std::vector<optim::ParamGroup>)>;

class ZeroRedundancyOptimizer : public optim::Optimizer {
 public:
  // Broadcasts rank 0's parameter values first, so that all ranks start equal.
  ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups, OptimizerFactory factory,
                          std::shared_ptr<ProcessGroup> group = nullptr);
  ~ZeroRedundancyOptimizer() override;

  void step(const Gradients& grads) override;
  std::string name() const override;
  StateDict state_dict() const override;             // collective
  void load_state_dict(const StateDict& state) override;  // any world size's consolidated state

  struct MemoryReport {
    int64_t param_numel = 0;        // over all groups
    int64_t shard_numel = 0;        // this rank's slice (padded)
    std::size_t state_bytes = 0;    // optimizer state held by this rank
    std::size_t full_state_bytes_estimate = 0;  // what an unsharded optimizer would hold
  };
  MemoryReport memory_report() const;
  optim::Optimizer& local_optimizer() { return *inner_; }

  struct Layout;

 private:
  std::shared_ptr<ProcessGroup> group_;
  std::unique_ptr<optim::Optimizer> inner_;
  std::vector<Layout> layouts_;  // one per group
};

}  // namespace flame::dist
