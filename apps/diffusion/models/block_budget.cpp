// Block swapping and checkpointing under a VRAM budget (block_budget.h).
#include "models/block_budget.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>

namespace flame_diffusion::models {

namespace {

std::string gib(std::size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / double(1ull << 30));
  return buf;
}

}  // namespace

std::size_t optimizer_state_to_come(const flame::optim::Optimizer& optimizer, flame::Device device) {
  const auto* fused = dynamic_cast<const flame::optim::FusedOptimizer*>(&optimizer);
  return fused ? fused->pending_state_bytes(device) : 0;
}

bool is_out_of_memory(const std::exception& e) { return dynamic_cast<const flame::OutOfMemoryError*>(&e) != nullptr; }

flame::offload::BlockSwap& BlockStack::enable_block_swap(flame::Device device,
                                                         flame::offload::BlockSwapOptions options) {
  if (!swap_) swap_ = std::make_shared<flame::offload::BlockSwap>(stack_blocks(), device, options);
  return *swap_;
}

void BlockStack::disable_block_swap() {
  if (!swap_) return;
  swap_->set_swapped(std::vector<bool>(swap_->size(), false));
  swap_.reset();
}

flame::Tensor BlockStack::run_block(std::size_t i, bool checkpoint, const flame::TensorList& inputs,
                                    const std::function<flame::Tensor(const flame::TensorList&)>& fn) {
  if (runner_) return runner_(i, fn, inputs);
  if (swap_) return swap_->run(i, fn, inputs, checkpoint);
  if (!checkpoint || !flame::grad_enabled()) return fn(inputs);
  return flame::checkpoint(fn, inputs);
}

// Note [Block activation offload]
// What a block saves for its backward is mostly a few large tensors (FLUX-dev at 1024², per block:
// the MLP's pre-activation 96-108 MiB; q, k, v, the attention output and the block's input 24-27
// MiB each). Offloading them as the forward produces them (one copy per tensor on a side stream,
// PCIe at about 55 GB/s each way on an H200 host) keeps up with the forward when the bytes per
// block are about what the link moves in one block's compute: the MLP pre-activations alone
// (min_bytes 64 MiB) for FLUX-dev and SD3.5-Large. The backward brings each back on the side
// stream while the one after it is used (OffloadActivations' prefetch); the first blocks' tensors
// are the last ones the backward needs, so the stack's first blocks are the ones offloaded. The
// last offloaded tensor is used right after the forward: leave the last blocks on the device.
// Under autograd::RecomputeCheap a recipe holds its inputs on the device (not packed), so the
// tensors recipes stand for are not offloaded anyway.
void BlockStack::set_activation_offload(bool on, std::size_t min_bytes, int64_t blocks, std::size_t prefetch_bytes) {
  FLAME_CHECK(blocks >= kOffloadCheckpointed, "set_activation_offload",
              "blocks must be >= 0, -1 (all) or kOffloadCheckpointed (-2), got ", blocks);
  offload_ = on;
  offload_min_bytes_ = min_bytes;
  offload_blocks_ = blocks;
  offload_prefetch_bytes_ = prefetch_bytes;
}

BlockStack::OffloadScope::OffloadScope(BlockStack& stack) : stack_(stack) {
  stack_.offloaded_tensors_ = 0;
  stack_.offloaded_bytes_ = 0;
  const int64_t n = stack_.offload_blocks_;
  end_ = n == kOffloadCheckpointed ? stack_.checkpointed_blocks() : n;
  if (!stack_.offload_ || end_ == 0 || !flame::grad_enabled()) return;
  // The blocks' weights stay: the model holds them anyway (a frozen Linear's backward saves its weight).
  flame::TensorList keep;
  for (const flame::nn::ModulePtr& block : stack_.stack_blocks()) {
    for (const flame::Tensor& p : block->parameters()) keep.push_back(p);
    for (const flame::Tensor& b : block->buffers()) keep.push_back(b);
  }
  offload_.emplace(flame::offload::OffloadActivationsOptions{.min_bytes = stack_.offload_min_bytes_,
                                                             .prefetch_bytes = stack_.offload_prefetch_bytes_,
                                                             .keep = std::move(keep)});
}

void BlockStack::OffloadScope::finish() {
  if (!offload_) return;
  stack_.offloaded_tensors_ = offload_->packed_count();
  stack_.offloaded_bytes_ = offload_->packed_bytes();
  offload_.reset();
}

std::string BudgetPlan::str() const {
  std::ostringstream os;
  os << "VRAM budget " << gib(budget) << ": " << swap.str() << "; " << checkpointed << " of " << blocks
     << " blocks checkpointed; measured: " << gib(resident_bytes) << " resident besides the blocks, "
     << gib(activation_bytes) << " of activations with every block checkpointed, last trial step's peak "
     << gib(peak_bytes) << " allocated, " << gib(peak_reserved_bytes) << " reserved (" << trials
     << " trial steps under a cap of " << gib(budget - headroom_bytes) << ": " << gib(held_bytes)
     << " kept for the optimizer state the first update creates, the rest for the pool's fragmentation)";
  return os.str();
}

BudgetPlan fit_vram_budget(BlockStack& stack, flame::Device device, std::size_t budget, bool keep_checkpointing,
                           const std::function<void()>& trial_step, std::size_t held_bytes) {
  const char* op = "fit_vram_budget";
  if (!device.is_cuda()) throw std::runtime_error(std::string(op) + ": a VRAM budget needs a CUDA device, got " + device.str());
  const int dev = device.index;
  BudgetPlan plan;
  plan.budget = budget;
  plan.held_bytes = held_bytes;
  flame::offload::BlockSwap& swap = stack.enable_block_swap(device);
  const std::size_t n = swap.size();
  plan.blocks = static_cast<int64_t>(n);
  const std::vector<std::size_t> sizes = swap.frozen_bytes();
  const std::size_t largest = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
  // Note [Budget headroom]: the trials run under a cap below the budget by what the training steps
  // hold that a trial does not (held_bytes: the optimizer state the first update creates) and by
  // room for the pool's fragmentation to grow after the trials (a choice that passed its trials
  // and two more steps ran out of memory later, 14.74 GiB live in 15.91 GiB reserved under a
  // 16 GiB cap; with 1/64 of the budget kept, FLUX-dev's fp8 LoRA step on an H200 reserved
  // 0.35 GiB more in its timed steps than in its last trial at 16 GiB, 0.14 GiB of it the optimizer
  // state, and 0.06 GiB more at 24 GiB): the growth follows the step's allocations, not the budget,
  // so at least 512 MiB is kept. The training steps then run under the budget itself.
  plan.headroom_bytes = std::max<std::size_t>(budget / 64, std::size_t{512} << 20) + held_bytes;
  // The trials' peaks are allocated bytes; the cap limits reserved ones: the estimates below keep
  // a margin for the pool's rounding and fragmentation (a trial itself fits when it completes).
  const std::size_t margin = std::max<std::size_t>(budget / 40, std::size_t{256} << 20);
  FLAME_CHECK(budget > plan.headroom_bytes + margin, op, "the budget ", gib(budget), " is too small to train in (",
              gib(held_bytes), " of optimizer state and ", gib(plan.headroom_bytes - held_bytes),
              " of headroom for the pool are kept out of it)");
  const std::size_t trial_cap = budget - plan.headroom_bytes;
  const std::size_t usable = trial_cap - margin;
  flame::cuda::set_memory_limit(trial_cap, dev);

  // One trial step: its peak, or nothing when it ran out of memory under the cap.
  auto trial = [&]() -> std::optional<std::size_t> {
    ++plan.trials;
    flame::cuda::synchronize(dev);
    flame::cuda::reset_peak_memory_stats(dev);
    try {
      trial_step();
      flame::cuda::synchronize(dev);
    } catch (const std::exception& e) {
      if (!is_out_of_memory(e)) throw;
      flame::cuda::synchronize(dev);
      flame::cuda::empty_cache(dev);
      return std::nullopt;
    }
    const flame::cuda::MemoryStats stats = flame::cuda::memory_stats(dev);
    plan.peak_bytes = stats.peak_allocated_bytes;
    plan.peak_reserved_bytes = stats.peak_reserved_bytes;
    return stats.peak_allocated_bytes;
  };
  auto fits = [&](const std::optional<std::size_t>& peak) { return peak.has_value(); };
  // Step 2's swap plans are estimates from allocated bytes: they keep the margin too.
  auto within = [&](const std::optional<std::size_t>& peak) { return peak.value_or(SIZE_MAX) <= usable; };

  // 1. Everything swapped and checkpointed: what the step needs besides the resident weights.
  stack.set_checkpointed_blocks(-1);
  swap.set_swapped(std::vector<bool>(n, true));
  flame::cuda::synchronize(dev);
  flame::cuda::empty_cache(dev);
  plan.resident_bytes = flame::cuda::memory_stats(dev).allocated_bytes;
  const std::optional<std::size_t> p1 = trial();
  auto too_small = [&](const std::string& why) {
    std::ostringstream os;
    os << op << ": the budget " << gib(budget) << " (" << gib(plan.headroom_bytes) << " kept out of it for the optimizer "
       << "state and the pool) does not fit "
       << "this step: " << why << ". Resident besides the blocks: " << gib(plan.resident_bytes) << "; the largest of the "
       << n << " blocks has " << gib(largest) << " of frozen weights. Raise the budget, store the base in 8 bits "
       << "(model.fp8_base), or lower the resolution or batch";
    return std::runtime_error(os.str());
  };
  if (!p1) throw too_small("the step ran out of memory with every block swapped and checkpointed");
  const std::size_t in_flight = std::min<std::size_t>(n, 2) * largest;
  plan.activation_bytes = *p1 > plan.resident_bytes + in_flight ? *p1 - plan.resident_bytes - in_flight : 0;

  // 2. As many blocks resident as fit; verified by a trial, the capacity lowered by any excess.
  //    Every block swapped was measured in step 1.
  const std::size_t used = plan.resident_bytes + plan.activation_bytes;
  std::size_t capacity = usable > used ? usable - used : 0;
  std::optional<std::size_t> peak;
  for (int attempt = 0; attempt < 4; ++attempt) {
    std::vector<bool> swapped(n, true);
    try {
      swapped = flame::offload::plan_block_swap(sizes, capacity);
    } catch (const flame::Error&) {  // not even two blocks' room: every block swapped
    }
    if (std::all_of(swapped.begin(), swapped.end(), [](bool b) { return b; })) break;
    try {
      swap.set_swapped(swapped);
      peak = trial();
    } catch (const std::exception& e) {
      if (!is_out_of_memory(e)) throw;
      peak = std::nullopt;
    }
    if (within(peak)) break;
    const std::size_t excess = peak ? *peak - usable : capacity / 8 + largest;
    capacity = capacity > excess ? capacity - excess : 0;
  }
  if (!within(peak)) {
    swap.set_swapped(std::vector<bool>(n, true));
    peak = p1;
  }
  plan.checkpointed = static_cast<int64_t>(n);

  // 3. Nothing swapped and checkpointing not asked for: take blocks out of it from the end while
  //    their activations fit. The blocks out of checkpointing that fit (lo) and that do not (hi)
  //    close in: the estimate from the last half's bytes per block first, then halving.
  const bool any_swapped = swap.report().swapped > 0;
  if (!any_swapped && !keep_checkpointing && n > 1) {
    const auto N = static_cast<int64_t>(n);
    const std::size_t p_all = peak.value_or(0);  // set: step 2 ended with a trial that fitted
    std::size_t best_peak = p_all;
    int64_t lo = 0, hi = N + 1;  // blocks out: lo fits, hi does not (N + 1: not known)
    auto try_out = [&](int64_t out) {
      stack.set_checkpointed_blocks(N - out);
      const std::optional<std::size_t> p = trial();
      if (fits(p)) {
        lo = out, best_peak = *p;
      } else {
        hi = out;
      }
      return p;
    };
    const int64_t half = N / 2;
    const std::optional<std::size_t> p_half = try_out(half);
    if (p_half && lo == half && *p_half > p_all && usable > p_all) {
      const double per_block = static_cast<double>(*p_half - p_all) / static_cast<double>(half);
      const auto est = static_cast<int64_t>(static_cast<double>(usable - p_all) / per_block);
      if (est > lo) (void)try_out(std::min(est, N));
    }
    while (hi - lo > 1 && plan.trials < 10) (void)try_out(hi > N ? N : (lo + hi) / 2);
    // 4. The choice confirmed over two more steps in a row: the pool fragments further after the
    //    first steps (a choice that fitted once ran out of memory two steps later, a trial's peak
    //    1.3 GiB under a 24 GiB cap). A failure takes blocks back into checkpointing, one at a time
    //    for the first three failures (each block costs its recomputation in every step: FLUX-dev's
    //    fp8 step at 24 GiB took 375 ms with 34 blocks checkpointed where 26 took 359 ms), then a
    //    quarter of those out at a time, until two steps pass.
    for (int failures = 0; lo > 0; ++failures) {
      stack.set_checkpointed_blocks(N - lo);
      std::optional<std::size_t> p = trial();
      if (fits(p)) p = trial();
      if (fits(p)) {
        best_peak = std::max(best_peak, *p);
        break;
      }
      lo -= failures < 3 ? 1 : std::max<int64_t>(1, lo / 4);
      best_peak = p_all;
    }
    const int64_t best = N - lo;
    stack.set_checkpointed_blocks(best);
    plan.checkpointed = best;
    plan.peak_bytes = best_peak;
  } else {
    stack.set_checkpointed_blocks(-1);
  }
  plan.swap = swap.report();
  if (!any_swapped) stack.disable_block_swap();  // nothing to swap: the plain path
  flame::cuda::set_memory_limit(budget, dev);  // the training steps: the whole budget
  return plan;
}

}  // namespace flame_diffusion::models
