#pragma once
// Offload: keep what a training step needs only now and then in host memory, so that a model and
// its optimizer larger than the GPU train on one GPU. See docs/offload.md.
//  - pinned host memory: Tensor::pin_memory(), offload::empty_pinned(), with asynchronous copies
//    Tensor::copy_(src, /*non_blocking=*/true) and Tensor::to(device, /*non_blocking=*/true);
//  - a cap on the CUDA pool: cuda::set_memory_limit (include/flame/cuda.h);
//  - activation offload: autograd::SavedTensorHooks (flame/saved_tensor_hooks.h),
//    offload::OffloadActivations;
//  - weight streaming: offload::StreamedBlocks (every tensor of every block, for full training);
//  - block swapping: offload::BlockSwap (the frozen tensors of some blocks, under a VRAM budget);
//  - optimizer-state offload: offload::HostOptimizer.
#include <any>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flame/nn/containers.h"
#include "flame/nn/module.h"
#include "flame/optim/optimizer.h"
#include "flame/cuda.h"
#include "flame/saved_tensor_hooks.h"
#include "flame/tensor.h"

namespace flame::offload {

// A new contiguous CPU tensor in pinned (page-locked) memory, uninitialised (0xFF bytes under
// FLAME_POISON_ALLOC). Needs a CUDA build and a device: raises flame::Error otherwise.
Tensor empty_pinned(const Shape& shape, DType dtype = DType::f32);

// ---- activation offload ----
struct OffloadActivationsOptions {
  // Saved tensors smaller than this stay where they are (a copy costs more than it saves).
  std::size_t min_bytes = 0;
  // During backward, start copying the previously saved tensor back while the current node runs.
  bool prefetch = true;
  // With prefetch: keep up to this many bytes of the tensors saved before the one being unpacked on
  // their way back (at least one tensor), so copies run further ahead of their use; 0: one tensor
  // ahead. Each prefetched tensor holds device memory from its prefetch to its use.
  std::size_t prefetch_bytes = 0;
  // Saved tensors that share storage with one of these stay where they are: a module's parameters
  // and buffers (a frozen weight saved for its input's gradient), which the module holds anyway,
  // so a copy would move bytes and free nothing.
  TensorList keep;
};

// Activation offload for saved tensors (like torch.autograd.graph.save_on_cpu(pin_memory=True)):
// while alive, tensors autograd saves for backward move to pinned host memory. A CUDA tensor is
// copied on a side stream (after the work that produced it; its device memory is released to the
// pool when that copy has run, Note [Record stream]); during backward each comes back to the
// device on the current stream, and with prefetch the one saved before it is copied on the side
// stream meanwhile (so a block's backward finds the next block's activations already there).
// CPU tensors are cloned (the logic, for tests on the CPU). Combine with checkpoint() to offload
// only the inputs of checkpointed blocks. Nothing here waits on the host. Use on one thread.
class OffloadActivations {
 public:
  explicit OffloadActivations(OffloadActivationsOptions options = {});
  ~OffloadActivations();
  OffloadActivations(const OffloadActivations&) = delete;
  OffloadActivations& operator=(const OffloadActivations&) = delete;

  int64_t packed_count() const;         // saved tensors moved to the host so far
  std::size_t packed_bytes() const;     // their bytes
  int64_t prefetched_count() const;     // of the unpacks so far, those served by a prefetch

  struct State;

 private:
  std::shared_ptr<State> state_;
  std::unique_ptr<autograd::SavedTensorHooks> hooks_;
};

// ---- weight streaming ----
struct StreamedBlocksOptions {
  // Start copying block i+1's weights (i-1's in backward) while block i computes.
  bool prefetch = true;
};

// Weight streaming over a stack of blocks (a ModuleList's children, a transformer's layers): the
// blocks' parameters and buffers live in host memory (pinned when `device` is CUDA) and each block
// runs on `device` with copies of them, uploaded on a side stream one block ahead, in forward and
// (in reverse order) in backward; a block's copies go back to the pool once the compute stream
// is done with them. So a model whose blocks exceed GPU memory trains.
//  - forward(x): x on `device`; the blocks run in order, as in Sequential. A block's forward runs
//    without recording; its backward re-uploads the weights and recomputes it (like
//    checkpoint(): the random generator is restored so dropout masks match), so the graph keeps
//    only each block's input (offloadable with OffloadActivations).
//  - Gradients: the parameters stay the host tensors (state dicts, optimizers and the Gradients
//    store see those), and their gradients arrive in the store as host tensors (pinned), copied
//    down once per block in backward: the host waits for each block's backward there. A CPU
//    optimizer (or one built on the host parameters) steps on them directly.
//  - Buffers are uploaded read-only: a block that updates a buffer in forward (BatchNorm running
//    statistics) does not write the update back.
//  - With a CPU `device` nothing is pinned and the copies are clones: the same logic, for tests.
class StreamedBlocks : public nn::Module {
 public:
  StreamedBlocks(std::vector<nn::ModulePtr> blocks, Device device, StreamedBlocksOptions options = {});
  // The children of a ModuleList, in order (they are then shared by both containers).
  StreamedBlocks(const nn::ModuleList& blocks, Device device, StreamedBlocksOptions options = {});
  ~StreamedBlocks() override;
  std::string name() const override { return "StreamedBlocks"; }
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override;
  std::size_t size() const;
  nn::ModulePtr block(std::size_t i) const;
  Device device() const;
  int64_t uploads() const;             // block uploads so far (forward and backward)
  int64_t prefetched_uploads() const;  // of which were started ahead of their use

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// ---- block swapping ----
struct BlockSwapOptions {
  // Upload the next swapped block (in backward: the previous one) on a side stream while the
  // blocks before it compute.
  bool prefetch = true;
};

// Where a BlockSwap keeps its blocks' frozen tensors (parameters that do not require grad, and
// buffers), and what it uploaded so far.
struct BlockSwapReport {
  std::size_t blocks = 0;
  std::size_t swapped = 0;          // blocks whose frozen tensors live in host memory
  std::size_t resident_bytes = 0;   // frozen bytes of the resident blocks (on the device)
  std::size_t swapped_bytes = 0;    // frozen bytes of the swapped blocks (pinned host memory)
  std::size_t largest_swapped = 0;  // the largest swapped block (two are on the device at a time)
  int64_t uploads = 0;              // swapped-block uploads so far (forward and backward)
  int64_t prefetched_uploads = 0;   // of which were started ahead of their use
  std::string str() const;          // one line, for logs and out-of-memory errors
};

// Block swapping (kohya's blocks_to_swap, docs/offload.md "Block swapping"): a model's blocks keep
// their trainable parameters (adapters) on the device, and the frozen tensors of the blocks chosen
// by set_swapped live in host memory (pinned for a CUDA device) and are uploaded on a side stream
// just before each use, one swapped block ahead; a block's copies go back to the pool once the
// compute stream is past it. With a frozen base model this is what lets a LoRA run fit a VRAM
// budget (plan_block_swap picks the blocks; cuda::set_memory_limit enforces the budget).
//  - The model calls run(i, fn, inputs) for each of its blocks in order (resident ones too: the
//    upload of the next swapped block starts from the blocks before it) with fn computing block i.
//  - A swapped block runs as flame::checkpoint does while grad mode is on: its forward keeps only
//    its inputs, and its backward uploads the block again, recomputes it and backpropagates, with
//    the copies bound for the whole of that (the recompute's nodes save them). A resident block
//    runs fn directly, or under flame::checkpoint when `checkpoint` is true.
//  - The frozen tensors keep their identity (set_data: state dicts and optimizers see the same
//    tensors); while block i runs they hold the device copies. Module::to on the model moves the
//    swapped tensors back to the device: call set_swapped again after it.
//  - Frozen tensors must not change between a forward and its backward (the recompute reads them).
//  - With a CPU device the host copies are the tensors themselves and the uploads are clones: the
//    same logic, for tests. One thread drives a BlockSwap at a time.
class BlockSwap {
 public:
  BlockSwap(std::vector<nn::ModulePtr> blocks, Device device, BlockSwapOptions options = {});
  ~BlockSwap();
  BlockSwap(const BlockSwap&) = delete;
  BlockSwap& operator=(const BlockSwap&) = delete;

  std::size_t size() const;
  Device device() const;
  // Bytes of block i's frozen tensors: what swapping it moves off the device.
  std::size_t frozen_bytes(std::size_t i) const;
  std::vector<std::size_t> frozen_bytes() const;
  // One flag per block: true moves its frozen tensors to host memory, false to the device
  // (synchronous copies). Pending uploads are dropped.
  void set_swapped(const std::vector<bool>& swapped);
  bool swapped(std::size_t i) const;
  Tensor run(std::size_t i, const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs,
             bool checkpoint = false);
  BlockSwapReport report() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// Which blocks to swap so that the frozen bytes on the device, `block_bytes` of the resident blocks
// plus two swapped blocks' copies in flight, fit `capacity`: the fewest swapped blocks, spread
// evenly over the order (each upload then overlaps the resident blocks before it). Raises
// flame::Error naming the capacity and the block sizes when swapping every block does not fit.
std::vector<bool> plan_block_swap(const std::vector<std::size_t>& block_bytes, std::size_t capacity);
// k of n blocks spread evenly (the middle one of each of k equal runs of the order): the choice
// plan_block_swap makes for k, for a swap of a chosen size.
std::vector<bool> spread_blocks(std::size_t n, std::size_t k);

// ---- optimizer-state offload ----
// Optimizer state in host memory, updated on the CPU (like DeepSpeed's ZeRO-Offload CPU Adam):
// the wrapper keeps a master copy of every device parameter in pinned host memory (f32 for
// floating parameters of lower precision, else the parameter's dtype) and an inner optimizer,
// built by `make_inner` over those masters, whose state (moments...) therefore lives on the host.
// step(grads): the gradients of the device parameters are copied to pinned host buffers with
// non-blocking copies, the host waits for them (the one host wait of a step), the inner optimizer
// steps on the masters on the CPU, and the updated masters are copied back to the parameters with
// non-blocking copies (a master is rewritten by the next step only after those copies ran).
// Hyperparameters: the wrapper's param_groups mirror the inner optimizer's (same groups, with the
// device parameters); lr/momentum set on the wrapper (schedulers) reach the inner one at each step.
// Works with CPU parameters too (the logic, for tests): the masters are then plain host copies.
using InnerOptimizerFactory = std::function<std::unique_ptr<optim::Optimizer>(const TensorList& masters)>;
class HostOptimizer : public optim::Optimizer {
 public:
  HostOptimizer(TensorList params, InnerOptimizerFactory make_inner);
  void step(const Gradients& grads) override;
  std::string name() const override;
  MomentumKind momentum_kind() const override;
  // inner.* (the inner optimizer's state, keyed by master index) and master.<k> (the masters).
  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state) override;

  optim::Optimizer& inner() { return *inner_; }
  const TensorList& masters() const { return masters_; }
  const TensorList& params() const { return params_; }

 private:
  void sync_hyperparameters();
  TensorList params_;
  TensorList masters_;
  std::unique_ptr<optim::Optimizer> inner_;
  std::unique_ptr<cuda::Event> uploaded_;  // after the last H2D copies of the masters
};

// The caching pinned host allocator (Note [Pinned host cache]).
struct PinnedMemoryStats {
  std::size_t allocated_bytes = 0;  // held by live pinned tensors (requested sizes)
  std::size_t reserved_bytes = 0;   // page-locked bytes obtained with cudaHostAlloc (in use or cached)
  std::size_t cached_bytes = 0;     // part of reserved: free blocks kept for reuse
  std::size_t pending_bytes = 0;    // freed blocks waiting for the copies that use them
  uint64_t num_allocs = 0;          // pinned allocations served
  uint64_t num_host_allocs = 0;     // of which cudaHostAlloc calls (the rest reused a cached block)
};
PinnedMemoryStats pinned_memory_stats();
// Frees the cached pinned blocks (cudaFreeHost); blocks still used by queued copies stay.
void empty_pinned_cache();

}  // namespace flame::offload
