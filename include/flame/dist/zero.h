#pragma once
// ZeRO stages 1, 2 and 3: optimizer state, with stage 2 the gradients, with stage 3 the parameters
// of the given blocks, sharded across the ranks (docs/distributed.md).
//
//   dist::ZeroRedundancyOptimizer opt(
//       {optim::AdamWOptions{.lr = 1e-4}.group(model->parameters())},
//       [](std::vector<optim::ParamGroup> g) { return std::make_unique<optim::AdamW>(g, optim::AdamWOptions{}); });
//   Gradients grads = loss.backward();   // plain local gradients (no DDP wrapper needed)
//   opt.step(grads);                     // reduce-scatter (average), local step, all-gather
//
// Each parameter group is laid out flat (one dtype per group) and padded to a multiple of the
// world size; rank r owns elements [r*S, (r+1)*S) and its inner optimizer holds state only for
// that slice. The inner optimizer must be elementwise (SGD, Adam, AdamW, Lion) or AdamW8bit (its
// block-wise state moves in f32 at checkpoints, Note [ZeRO 8-bit state] in src/dist/zero.cpp);
// Adafactor's factored state is not. A parameter without a gradient on a rank contributes zeros.
// state_dict() is collective (every rank calls it) and returns the state the inner optimizer
// would have on the full parameters ("state.<i>.<slot>" in parameter shapes), so a checkpoint
// loads on any number of ranks or stages, or into the plain optimizer.
//
// Stage 2 (ZeroOptions::stage = 2; Note [ZeRO-2 buckets] in src/dist/zero.cpp): each group is cut
// into buckets of about bucket_cap_mb, each laid out and sharded as above. A parameter's gradient
// is copied into its bucket the moment the backward has it and dropped from the Gradients store;
// a complete bucket is reduce-scattered while the backward goes on (in bucket order, the same on
// every rank), so a rank holds the full gradient of a few buckets at a time and its shard of the
// rest. Several backward passes before one step accumulate (gradient accumulation needs nothing
// else). step(grads) finishes the reductions (buckets whose parameters got no gradient on this
// rank count zeros for them) and ignores `grads` for these parameters. The gradient norm over the
// shards: grad_norm() / clip_grad_norm() (collective). A gradient arriving again for a bucket
// already reduced (a parameter used twice in one backward) starts the next round of reductions:
// still the right average, as long as every rank does the same.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flame/nn/module.h"
#include "flame/optim/ema.h"
#include "flame/optim/optimizer.h"

namespace flame::dist {

class ProcessGroup;

using OptimizerFactory = std::function<std::unique_ptr<optim::Optimizer>(std::vector<optim::ParamGroup>)>;

struct ZeroOptions {
  int stage = 1;                // 1: optimizer state sharded; 2: gradients too; 3: parameters too
  // Stages 2 and 3: the size of a gradient bucket, and in stage 3 of a block's gather unit (a
  // block's parameters split into buckets of about this many MiB, each one all-gather and one
  // reduce-scatter). Above a block's bytes each block is one of each, as FSDP2's fully_shard per
  // block: FLUX-dev's full fine-tuning on 2 H200s ran 0.90x as long at 1.07x the memory with 2000
  // (docs/distributed.md).
  double bucket_cap_mb = 25.0;
  // Stage 3: the blocks whose parameters are sharded (run through run_block); parameters outside
  // them are treated as in stage 2. A block's parameters form buckets of their own.
  std::vector<std::shared_ptr<nn::Module>> blocks;
  // Stage 3: the dtype the blocks' parameters are gathered and computed in (bf16 over f32 shards,
  // as FSDP's MixedPrecision(param_dtype=bf16)); the shards, the optimizer and the gradient
  // reduction stay in the parameters' dtype. Unset: the parameters' own dtype.
  std::optional<DType> compute_dtype;
  // Stages 2 and 3: the dtype gradients are reduce-scattered in (bf16 over f32 shards: half the
  // bytes on the wire, as FSDP's MixedPrecisionPolicy(reduce_dtype=bf16)); each reduction's result
  // is added to the shard gradient in the shards' dtype. Unset: the shards' dtype.
  std::optional<DType> reduce_dtype;
  // Stage 3: start the all-gather of the next block (in backward, the previous one) while this
  // one computes, asynchronously on the group's communication; two blocks are gathered at a time.
  bool prefetch = true;
  // An exponential moving average of the trained parameters, kept as the optimizer state is: an
  // optim::EMA over this rank's shards, updated after each step (Note [ZeRO EMA] in
  // src/dist/zero.cpp). state_dict() / load_state_dict() carry it as the slot "ema" of every
  // parameter (consolidated, so it resumes on any number of ranks) and "ema.num_updates";
  // swap_in_ema() puts it into the parameters. save_sharded's files carry it too ("bucket.<b>.ema").
  std::optional<optim::EMAOptions> ema;
  // The optimizer's state on the host (ZeRO-Offload; Note [ZeRO state offload] in
  // src/dist/zero.cpp): the inner optimizer steps, on the CPU, host masters of this rank's shards
  // (pinned on a CUDA device; f32 for bf16/f16 shards), so its moments never take device memory.
  // Each step copies the shard gradients down and the updated masters back up (one host wait). A
  // shard written from outside (a loaded state dict, gather_parameters' write-back) refreshes its
  // master at the next step.
  bool offload_state = false;
};

class ZeroRedundancyOptimizer : public optim::Optimizer {
 public:
  // Broadcasts rank 0's parameter values first, so that all ranks start equal.
  ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups, OptimizerFactory factory,
                          std::shared_ptr<ProcessGroup> group = nullptr, ZeroOptions options = {});
  ~ZeroRedundancyOptimizer() override;

  void step(const Gradients& grads) override;
  int stage() const { return options_.stage; }
  std::size_t num_buckets() const;  // stage 1: one per parameter group
  // Stage 2 (collective): the L2 norm of the whole averaged gradient, from the shards; and
  // clip_grad_norm scales the shards so that it is at most max_norm (returns the norm before),
  // as flame::clip_grad_norm_ does on full gradients. Finishes the pending reductions.
  double grad_norm();
  double clip_grad_norm(double max_norm);

  // Stage 3 (Note [ZeRO-3 blocks] in src/dist/zero.cpp): block i of ZeroOptions::blocks, as
  // fn(inputs). Its parameters are all-gathered just before and dropped after; while grad mode
  // is on only the inputs are kept, and the backward gathers them again, recomputes the block and
  // reduce-scatters its gradients (as flame::checkpoint, the random state restored). Every rank
  // runs the same blocks in the same order. Outside run_block a sharded parameter holds a
  // placeholder (zeros of its shape, one element of storage).
  Tensor run_block(std::size_t i, const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs);
  // Stage 3: every sharded parameter gathered, in its own dtype, while the object lives (to save or
  // read the model's weights; collective). write_back: what is written into the gathered
  // parameters meanwhile (a loaded state dict, the same on every rank) goes into this rank's shards
  // when it ends.
  class Gathered {
   public:
    ~Gathered();
    Gathered(Gathered&&) noexcept;
    Gathered(const Gathered&) = delete;
    Gathered& operator=(const Gathered&) = delete;
    Gathered& operator=(Gathered&&) = delete;

   private:
    friend class ZeroRedundancyOptimizer;
    Gathered() = default;
    std::vector<std::shared_ptr<void>> held_;
  };
  [[nodiscard]] Gathered gather_parameters(bool write_back = false);
  // With ZeroOptions::ema (collective): while the guard lives the parameters hold the averaged
  // weights (stage 3: the shards, for gather_parameters or run_block), then the trained ones again.
  class EmaSwap {
   public:
    ~EmaSwap();
    EmaSwap(EmaSwap&& o) noexcept : zero_(o.zero_) { o.zero_ = nullptr; }
    EmaSwap(const EmaSwap&) = delete;
    EmaSwap& operator=(const EmaSwap&) = delete;
    EmaSwap& operator=(EmaSwap&&) = delete;

   private:
    friend class ZeroRedundancyOptimizer;
    explicit EmaSwap(ZeroRedundancyOptimizer* zero) : zero_(zero) {}
    ZeroRedundancyOptimizer* zero_;
  };
  [[nodiscard]] EmaSwap swap_in_ema();
  // The EMA over this rank's shards (null without ZeroOptions::ema).
  const optim::EMA* ema() const { return ema_.get(); }
  std::string name() const override;
  StateDict state_dict() const override;             // collective
  void load_state_dict(const StateDict& state) override;  // any world size's consolidated state

  // Sharded checkpoints (collective; Note [ZeRO shard files] in src/dist/zero.cpp): every rank
  // writes the state of the elements it owns to dir/optimizer-rank<r>-of-<W>.safetensors, then,
  // after a barrier, rank 0 writes dir/optimizer-shards.safetensors, which makes the set complete.
  // Each file is written aside and renamed. Use a fresh directory per checkpoint.
  void save_sharded(const std::string& dir) const;
  // Loads a set saved by any number of ranks (the same parameter groups and buckets): each rank
  // reads, from every file, the elements it owns now. Raises naming the directory or file when the
  // set is incomplete, from another save, or of another layout.
  void load_sharded(const std::string& dir);

  struct MemoryReport {
    int64_t param_numel = 0;        // over all groups
    int64_t shard_numel = 0;        // this rank's slice (padded)
    std::size_t state_bytes = 0;    // optimizer state held by this rank
    std::size_t full_state_bytes_estimate = 0;  // what an unsharded optimizer would hold
    std::size_t gradient_bytes = 0;  // stage 2: the gradient shards held between backward and step
    std::size_t parameter_bytes = 0;  // the trained parameters held by this rank (stage 3: shards)
    std::size_t host_bytes = 0;       // offload_state: the host masters and the state on the host
  };
  MemoryReport memory_report() const;

  // Where the compute stream waited for this optimizer's collectives (Note [ZeRO wait timeline] in
  // src/dist/zero.cpp; CUDA devices: elsewhere nothing is recorded). While on, every wait of the
  // compute stream for a block's all-gather (stage 3) and for the step's last reductions (stages
  // 2 and 3) is bracketed by two CUDA events on that stream. wait_timeline() waits for the device
  // and returns them, the first record's start as 0, then forgets them.
  struct WaitRecord {
    std::string what;        // "gather block 3 (forward)", "gather block 3 (backward)", "reductions"
    double at_ms = 0;        // when the compute stream reached the wait
    double waited_ms = 0;    // how long it stood there: the collective's exposed time
  };
  void set_wait_timeline(bool on);
  std::vector<WaitRecord> wait_timeline();
  optim::Optimizer& local_optimizer() { return *inner_; }

  struct Layout;
  struct Reducer;
  struct Prefetch;  // stage 3: a block's all-gathers in flight

 private:
  void finish_reductions();
  std::shared_ptr<void> gather_block(std::size_t i, bool own_dtype = false, const char* phase = "forward");
  // wait() with the compute stream's position before and after it recorded while the wait
  // timeline is on, as `what`, or as block's gather in phase `what` when block >= 0 (the label is
  // made only while recording).
  void timed_wait(const char* what, int64_t block, const std::function<void()>& wait);
  void prefetch_block(std::size_t i);
  std::shared_ptr<Prefetch> start_gather(std::size_t i, bool own_dtype);
  void drop_prefetched();
  // All-gathers the shards of the buckets outside stage 3's blocks into their parameters (after a
  // step, or after the shards were written).
  void publish_replicas();
  // The inner optimizer's step on the shard gradients (keyed by the shards), through the host
  // masters with ZeroOptions::offload_state.
  void step_inner(const Gradients& shard_grads);
  // offload_state on a CUDA device: waits for the device, so the gradients copied down have arrived
  // and no copy back still reads a host master that the host is about to write (a no-op otherwise).
  void wait_for_host_copies();
  bool take_own_slot(std::size_t bucket, const std::string& slot, const Tensor& mine, StateDict& ema_state);
  void load_ema(StateDict shadows, const Tensor* num_updates, const char* op);
  void load_inner_state(const StateDict& inner);
  // The inner optimizer's state with an 8-bit optimizer's f32 moments quantised in the shards'
  // blocks (Note [ZeRO 8-bit state] in src/dist/zero.cpp); unchanged for any other optimizer.
  StateDict quantized_for_inner(const StateDict& inner) const;
  // The inner optimizer's state with an 8-bit optimizer's moments dequantised to f32 (elementwise
  // slots that shard and consolidate); the state itself for any other optimizer. `op` names errors.
  StateDict elementwise_inner_state(const char* op) const;
  std::vector<int64_t> buckets_of(std::size_t group) const;  // the inner optimizer's parameters of a group
  std::shared_ptr<ProcessGroup> group_;
  ZeroOptions options_;
  std::unique_ptr<optim::Optimizer> inner_;
  std::vector<Layout> layouts_;  // one per bucket (stage 1: one per group), in group order
  std::shared_ptr<Reducer> reducer_;  // stages 2 and 3
  std::vector<std::vector<std::size_t>> block_layouts_;  // stage 3: block i's buckets
  std::vector<std::shared_ptr<Prefetch>> prefetched_;     // stage 3: block i's gather in flight
  std::unique_ptr<optim::EMA> ema_;                       // ZeroOptions::ema: over the shards, by bucket
  struct WaitMark;
  bool timeline_on_ = false;
  std::vector<std::shared_ptr<WaitMark>> wait_marks_;     // the wait timeline's records since the last read
};

}  // namespace flame::dist
