#pragma once
// Transformers under a VRAM budget: block swapping and gradient checkpointing chosen from
// measurements (docs: apps/diffusion/README.md "Fitting a VRAM budget").
//
// BlockStack is the part of FLUX's and SD3's transformers that runs their stack of blocks: each
// block runs plain, under flame::checkpoint (the first checkpointed_blocks() of them), or, once
// enable_block_swap() made a flame::offload::BlockSwap over the stack, with its frozen weights
// swapped to pinned host memory when the swap says so (swapped blocks are always recomputed in
// backward).
//
// fit_vram_budget(stack, device, budget, ...) caps the device's pool at the budget
// (flame::cuda::set_memory_limit) and chooses what to swap and what to checkpoint from trial steps
// (forward and backward of the caller's step, no optimizer update):
//  1. every block swapped and checkpointed: the step's peak above what stays resident is the room
//     the activations need (the two swapped blocks' copies in flight counted apart);
//  2. the blocks' frozen bytes that fit beside that stay resident (plan_block_swap: the fewest
//     swapped blocks, spread over the stack);
//  3. when nothing is swapped and checkpointing was not asked for, blocks are taken out of
//     checkpointing from the last one while their measured activations fit (a trial with the last
//     half out gives the bytes per block, a trial checks that estimate, then halving between what
//     fits and what does not; at most 10 trial steps in all); the choice is then confirmed by two
//     more steps in a row (the pool fragments further after the first steps), a failure taking
//     one block (after three failures a quarter of those out of checkpointing) back in until two
//     steps pass.
// The trials run under a cap below the budget (Note [Budget headroom] in block_budget.cpp): by
// held_bytes, what the training steps hold that a trial does not (the optimizer state its first
// update creates: FusedOptimizer::pending_state_bytes), and by max(budget / 64, 512 MiB) for the
// pool's fragmentation to grow later. One that runs out of memory there counts as "does not fit";
// the training steps then run under the budget itself. A budget too small even with every block
// swapped raises an error naming the budget and the measured sizes.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <flame/flame.h>
#include <flame/nn.h>
#include <flame/offload.h>
#include <flame/optim.h>

namespace flame_diffusion::models {

class BlockStack {
 public:
  virtual ~BlockStack() = default;
  // The blocks in the order the forward runs them.
  virtual std::vector<flame::nn::ModulePtr> stack_blocks() const = 0;
  // Checkpoint the first n blocks (-1: all, 0: none) while grad mode is on.
  virtual void set_checkpointed_blocks(int64_t n) = 0;
  virtual int64_t checkpointed_blocks() const = 0;

  // Creates the swap over stack_blocks() on `device` (every block resident) or returns the one
  // there is. Call once adapters and 8-bit weights are in place and the model is on the device:
  // the swap moves the frozen tensors it finds then.
  flame::offload::BlockSwap& enable_block_swap(flame::Device device, flame::offload::BlockSwapOptions options = {});
  // Every block back to the device, the swap dropped.
  void disable_block_swap();
  flame::offload::BlockSwap* block_swap() const { return swap_.get(); }
  // A function every block runs through instead of the swap or checkpointing (ZeRO-3's run_block:
  // the block's sharded parameters gathered for it, and recomputed in backward); null: none.
  using BlockRunner = std::function<flame::Tensor(std::size_t, const std::function<flame::Tensor(const flame::TensorList&)>&,
                                                  const flame::TensorList&)>;
  void set_block_runner(BlockRunner runner) { runner_ = std::move(runner); }

  // Activation offload (flame::offload::OffloadActivations, Note [Block activation offload] in
  // block_budget.cpp): while grad mode is on, the tensors that the first `blocks` blocks save for
  // their backward move to pinned host memory as the forward runs and come back, prefetched one
  // ahead, in the backward; saved tensors under min_bytes stay on the device.
  //  - kOffloadCheckpointed (the default): the checkpointed blocks, whose inputs are all they keep.
  //  - n >= 0: the first n blocks, checkpointed or not; -1: all. Over blocks that are not
  //    checkpointed, a min_bytes that only their largest saved tensors pass (FLUX-dev's and SD3's
  //    MLP pre-activations: 76-108 MiB per block at 1024²) moves the most bytes for the fewest
  //    copies, and leaves what autograd::RecomputeCheap's recipes hold alone.
  // prefetch_bytes: OffloadActivationsOptions::prefetch_bytes (how far ahead the backward brings
  // the offloaded tensors back; 0: one tensor).
  static constexpr int64_t kOffloadCheckpointed = -2;
  void set_activation_offload(bool on, std::size_t min_bytes = std::size_t{1} << 20,
                              int64_t blocks = kOffloadCheckpointed, std::size_t prefetch_bytes = 0);
  bool activation_offload() const { return offload_; }
  int64_t activation_offload_blocks() const { return offload_blocks_; }
  // What the last forward offloaded: saved tensors and their bytes.
  int64_t offloaded_tensors() const { return offloaded_tensors_; }
  std::size_t offloaded_bytes() const { return offloaded_bytes_; }

 protected:
  // Whether blocks must go through run_block even when not checkpointed (a swap or a runner).
  bool blocks_routed() const { return swap_ != nullptr || runner_ != nullptr; }
  // Block i of the stack: through the runner or the swap when there is one, else checkpointed or plain.
  flame::Tensor run_block(std::size_t i, bool checkpoint, const flame::TensorList& inputs,
                          const std::function<flame::Tensor(const flame::TensorList&)>& fn);

  // The forward's activation offload: made before block 0 (it starts when the settings ask for
  // it and grad mode is on), at(i) before block i (it ends at the last offloaded block), and
  // finish() after the stack (the destructor too); the counts go to offloaded_tensors/bytes.
  class OffloadScope {
   public:
    explicit OffloadScope(BlockStack& stack);
    ~OffloadScope() { finish(); }
    OffloadScope(const OffloadScope&) = delete;
    OffloadScope& operator=(const OffloadScope&) = delete;
    void at(int64_t index) {
      if (index == end_) finish();
    }
    void finish();

   private:
    BlockStack& stack_;
    std::optional<flame::offload::OffloadActivations> offload_;
    int64_t end_ = 0;
  };

 private:
  std::shared_ptr<flame::offload::BlockSwap> swap_;
  BlockRunner runner_;
  bool offload_ = false;
  std::size_t offload_min_bytes_ = std::size_t{1} << 20;
  int64_t offload_blocks_ = kOffloadCheckpointed;
  std::size_t offload_prefetch_bytes_ = 0;
  int64_t offloaded_tensors_ = 0;
  std::size_t offloaded_bytes_ = 0;
};

struct BudgetPlan {
  std::size_t budget = 0;            // bytes (the pool cap)
  int64_t blocks = 0;
  int64_t checkpointed = 0;          // blocks recomputed in backward (swapped ones included)
  flame::offload::BlockSwapReport swap;
  std::size_t resident_bytes = 0;    // allocated before the trial steps with every block swapped
  std::size_t activation_bytes = 0;  // the all-checkpointed step's peak above that, copies in flight apart
  std::size_t peak_bytes = 0;        // the last trial step's peak (allocated)
  std::size_t peak_reserved_bytes = 0;  // ... and the pool's reserved peak in it
  std::size_t held_bytes = 0;        // what the training steps hold besides a trial's (fit_vram_budget's held_bytes)
  std::size_t headroom_bytes = 0;    // kept out of the trials' cap: held_bytes and room for fragmentation
  int trials = 0;
  std::string str() const;           // one paragraph for the run log
};

// See the header comment. `trial_step` runs one forward and backward of the training step (its
// gradients dropped; the caller restores random state it cares about). `keep_checkpointing`: the
// user asked for checkpointing of every block, so step 3 is skipped. Leaves the cap set at the budget.
BudgetPlan fit_vram_budget(BlockStack& stack, flame::Device device, std::size_t budget, bool keep_checkpointing,
                           const std::function<void()>& trial_step, std::size_t held_bytes = 0);

// What fit_vram_budget's held_bytes should be for `optimizer` on `device`: the state its first
// update will create there (FusedOptimizer::pending_state_bytes), 0 for an optimizer that cannot say.
std::size_t optimizer_state_to_come(const flame::optim::Optimizer& optimizer, flame::Device device);

// Whether e is an out-of-memory error (flame::OutOfMemoryError: the CUDA pool's, also under its limit).
bool is_out_of_memory(const std::exception& e);

}  // namespace flame_diffusion::models
