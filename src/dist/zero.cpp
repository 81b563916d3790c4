// ZeroRedundancyOptimizer: ZeRO stage 1 (flame/dist/zero.h).
//
// Note [ZeRO layout]
// Each parameter group g is one flat buffer (parameters in order, then zero padding to W*S
// elements, W = world size, S = ceil(numel / W)), and the dense parameters are moved into it
// (Tensor::set_data: same identity, storage in the buffer), so the buffer costs no memory beyond
// the parameters. Rank r owns [r*S, (r+1)*S): a leaf `shard` viewing that slice, which the inner
// optimizer (built by the factory on groups holding just that shard) updates in place. step():
// local gradients are packed into a flat gradient that lives for the step (zeros where a
// parameter has none), reduce-scattered with ReduceOp::avg into the shard's gradient, the inner
// optimizer steps the shard, and an in-place all-gather of the buffer updates every parameter.
// A parameter that is not in the buffer (not dense, or rebound by Module::to since) is copied in
// before the step and out after it. Optimizer state is the only per-rank saving: 1/W of it.
// Hyperparameters (set_lr from a scheduler) are copied into the inner groups at each step.
// state_dict() all-gathers every elementwise state slot (numel S) and cuts it back into the
// parameters' shapes under the plain optimizer's keys ("state.<i>.<slot>", "param_groups.<g>.*"),
// so the state does not depend on the world size; load_state_dict() does the reverse.
//
// Note [ZeRO-2 buckets]
// With stage 2 a group is cut into buckets (runs of consecutive parameters of about
// bucket_cap_mb) and each bucket is a layout of its own as above: its flat buffer padded to W*S_b,
// rank r owning [r*S_b, (r+1)*S_b), one shard parameter per bucket in the inner optimizer (so the
// inner optimizer's parameter b is bucket b, and its group g holds g's buckets). Each parameter
// gets a post-accumulate hook: the gradient the backward has for it is added into the bucket's
// flat gradient (zeros when the round starts) and released from the store
// (autograd_detail::release_leaf_gradient). Buckets are reduce-scattered (avg) in a fixed order,
// the last bucket first (backward produces the last parameters first), each as soon as it and the
// ones before it in that order are complete, so every rank issues the same collectives in the same
// order; the output is added into the bucket's shard gradient, which lives until step(). A round
// ends when every bucket has been reduced. A gradient arriving for a bucket already reduced in this
// round starts the next round, finishing the current one first (the buckets not complete on this
// rank count zeros for their missing parameters): so a second backward before the step
// (accumulation) needs nothing else, and since the reduction is linear the shard gradient is the
// average of the sums either way. step() finishes the round the same way. A flat gradient is
// dropped once its reduction completed (polled at each arrival, waited at the end of a round).
// With ZeroOptions::reduce_dtype the flat gradients and the reductions' outputs are in that dtype
// (the arrivals are cast on their copy in), and each output is cast to the shards' dtype as it is
// added to the shard gradient, so the sum over accumulated rounds stays in the shards' precision.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <random>

#include "flame/dist.h"
#include "flame/cuda.h"
#include "flame/io/safetensors.h"
#include "flame/offload.h"
#include "flame/optim/optimizers.h"
#include "flame/ops.h"
#include "src/amp/autocast.h"
#include "src/autograd/checkpoint_scope.h"
#include "src/autograd/grad_release.h"
#include "src/autograd/record.h"

namespace flame::dist {

struct ZeroRedundancyOptimizer::Layout {
  std::size_t group = 0;  // the parameter group it belongs to
  int64_t block = -1;     // stage 3: the block whose parameters are sharded here (Note [ZeRO-3 blocks])
  TensorList placeholders;  // stage 3: what the parameters hold outside run_block
  std::vector<Tensor> params;
  std::vector<int64_t> offsets;
  std::size_t first_index = 0;  // global parameter index of params[0]
  int64_t numel = 0;
  int64_t shard = 0;  // S
  Tensor shard_param;  // a view of flat_param: this rank's slice
  Tensor flat_param;   // W*S; the parameters' storage (Note [ZeRO layout])
  // ZeroOptions::offload_state (Note [ZeRO state offload]): the host master the inner optimizer
  // steps, and shard_param's version when the master was last copied into it.
  Tensor host_master;
  uint64_t synced_version = 0;
  bool aliased(std::size_t k) const {  // params[k] still lives in flat_param (never for stage-3 buckets)
    return block >= 0 || (params[k].data_ptr() == flat_param.narrow(0, offsets[k], params[k].numel()).data_ptr() &&
                          params[k].is_contiguous());
  }
};

namespace {

std::string state_key(std::size_t i, const std::string& name) { return "state." + std::to_string(i) + "." + name; }
std::string group_prefix(std::size_t g) { return "param_groups." + std::to_string(g) + "."; }

// Note [ZeRO 8-bit state]
// AdamW8bit keeps each moment as one code per element and one absmax per block of block_size
// elements, the blocks counted from the start of the tensor it steps: a bucket's shard here, a
// parameter in one process. Its state is therefore not elementwise across layouts, and ZeRO moves
// it in f32: wherever state leaves the inner optimizer (state_dict, save_sharded) its 8-bit moments
// are dequantised into exp_avg / exp_avg_sq, one f32 value per element (AdamW's slots), which shard
// and consolidate as any elementwise slot; wherever state arrives (load_state_dict, load_sharded)
// they are quantised again with the receiving tensor's blocks. The consolidated state is then
// AdamW8bit's own format for the whole parameters (codes and absmax per parameter of at least
// min_8bit_size elements, f32 moments below it, options.block_size and options.min_8bit_size), so
// it loads into one process's AdamW8bit, and a ZeRO optimizer loads one process's state. The shard
// files hold the f32 moments (4 bytes per element instead of about 2). A resume is therefore not
// bit-exact: each requantisation takes a block's absmax from the dequantised values, which is
// smaller by up to 0.7% when the block's largest exp_avg was negative (the signed map's most
// negative entry is -0.993), and across layouts (another rank count, one process) the blocks
// differ, so the moments move by up to one code step of their new block. In the tests the next
// step after a resume lands within 6e-4 of the uninterrupted one (lr 0.05). Between checkpoints
// nothing is converted: the inner optimizer steps its shards in 8 bits.
const optim::AdamW8bit* as_8bit(const optim::Optimizer& o) { return dynamic_cast<const optim::AdamW8bit*>(&o); }

constexpr const char* kMoments[2] = {"exp_avg", "exp_avg_sq"};
constexpr const char* kMomentCodes[2] = {"exp_avg_codes", "exp_avg_sq_codes"};
constexpr const char* kMomentAbsmax[2] = {"exp_avg_absmax", "exp_avg_sq_absmax"};
constexpr const char* kBlockSizeKey = "options.block_size";
constexpr const char* kMin8bitKey = "options.min_8bit_size";

// `sd` with each 8-bit moment ("state.<i>.exp_avg_codes" and its absmax, ...) replaced by its f32
// values ("state.<i>.exp_avg", the codes' shape); the options keys dropped.
StateDict dequantized_moments(const StateDict& sd, int64_t block_size, const char* op) {
  StateDict out;
  for (const auto& [k, t] : sd) {
    if (k == kBlockSizeKey || k == kMin8bitKey) continue;
    bool moment = false;
    for (int s = 0; s < 2 && !moment; ++s) {
      const std::string codes = std::string(".") + kMomentCodes[s];
      if (k.ends_with(std::string(".") + kMomentAbsmax[s])) {
        moment = true;  // read with its codes
      } else if (k.ends_with(codes)) {
        moment = true;
        const std::string base = k.substr(0, k.size() - codes.size());
        const Tensor* absmax = sd.find(base + "." + kMomentAbsmax[s]);
        FLAME_CHECK(absmax != nullptr, op, "the state has ", k, " but not ", base, ".", kMomentAbsmax[s]);
        out.insert(base + "." + kMoments[s],
                   optim::dequantize_blockwise(t, *absmax, /*is_signed=*/s == 0, block_size).reshape(t.sizes()));
      }
    }
    if (!moment) out.insert(k, t);
  }
  return out;
}

// `sd` with the f32 moments of each entry i that `eight_bit(i)` names ("state.<i>.exp_avg", ...)
// quantised with their own blocks, and the options keys of `block_size` and `min_8bit_size`.
StateDict quantized_moments(const StateDict& sd, int64_t block_size, int64_t min_8bit_size,
                            const std::function<bool(int64_t)>& eight_bit) {
  StateDict out;
  for (const auto& [k, t] : sd) {
    int moment = -1;
    for (int s = 0; s < 2; ++s)
      if (k.rfind("state.", 0) == 0 && k.ends_with(std::string(".") + kMoments[s])) moment = s;
    if (moment < 0) {
      out.insert(k, t);
      continue;
    }
    const std::string base = k.substr(0, k.size() - std::string(kMoments[moment]).size() - 1);
    const int64_t i = std::stoll(base.substr(std::string("state.").size()));
    if (!eight_bit(i)) {
      out.insert(k, t);
      continue;
    }
    const optim::QuantizedBlocks q = optim::quantize_blockwise(t, /*is_signed=*/moment == 0, block_size);
    out.insert(base + "." + kMomentCodes[moment], q.codes);
    out.insert(base + "." + kMomentAbsmax[moment], q.absmax);
  }
  out.insert(kBlockSizeKey, Tensor::scalar(block_size, DType::i64));
  out.insert(kMin8bitKey, Tensor::scalar(min_8bit_size, DType::i64));
  return out;
}

// The block size a state saved by AdamW8bit quantised with (its options key).
int64_t saved_block_size(const StateDict& sd, const char* op) {
  const Tensor* t = sd.find(kBlockSizeKey);
  FLAME_CHECK(t != nullptr && t->numel() == 1, op, "the state has no \"", kBlockSizeKey,
              "\": it was not saved by AdamW8bit, which this optimizer's inner optimizer is");
  return t->to(Device::cpu()).item<int64_t>();
}

// Calls fn(k, param_offset, flat_offset, length) for each parameter k overlapping [lo, hi).
template <class F>
void for_each_overlap(const ZeroRedundancyOptimizer::Layout& l, int64_t lo, int64_t hi, F&& fn) {
  for (std::size_t k = 0; k < l.params.size(); ++k) {
    const int64_t a = l.offsets[k], b = a + l.params[k].numel();
    const int64_t s = std::max(a, lo), e = std::min(b, hi);
    if (s < e) fn(k, s - a, s, e - s);
  }
}

}  // namespace

// Note [ZeRO-2 buckets]: the reduction state of stage 2.
struct ZeroRedundancyOptimizer::Reducer {
  struct Bucket {
    Tensor flat_grad;   // this round's gradients (W*S); undefined until the first arrives
    std::vector<bool> arrived;
    bool reduced = false;  // launched in this round
    bool retired = true;   // its last launch's output is in shard_grad
    Work work;
    Tensor out;         // S: the launched reduction's output
    Tensor shard_grad;  // S: the sum of this step's reductions; undefined when none
  };
  ProcessGroup* pg = nullptr;
  std::vector<Layout>* layouts = nullptr;
  std::optional<DType> reduce_dtype;  // ZeroOptions::reduce_dtype: the flat gradients' dtype
  std::vector<Bucket> buckets;
  std::vector<std::size_t> order;  // launch order: the last bucket first
  std::size_t next = 0;            // position in `order` of the next launch
  std::size_t retired_upto = 0;    // positions in `order` before this are retired
  bool active = false;             // a gradient arrived in this round

  // The bucket's flat gradient for this round: each arrival copies into its slot (one per
  // parameter and round), so only the padding is zeroed here, and launch() zeroes the slots of
  // parameters that got no gradient.
  Bucket& fresh(std::size_t b) {
    Bucket& bk = buckets[b];
    if (!bk.flat_grad.defined()) {
      const Layout& l = (*layouts)[b];
      const int64_t total = pg->size() * l.shard;
      bk.flat_grad = Tensor::empty({total}, TensorOptions(wire_dtype(l), l.shard_param.device()));
      if (total > l.numel) bk.flat_grad.narrow(0, l.numel, total - l.numel).zero_();
    }
    return bk;
  }
  DType wire_dtype(const Layout& l) const { return reduce_dtype.value_or(l.shard_param.dtype()); }
  Tensor slot(std::size_t b, std::size_t k) {
    const Layout& l = (*layouts)[b];
    return buckets[b].flat_grad.narrow(0, l.offsets[k], l.params[k].numel()).view(l.params[k].sizes());
  }
  bool complete(std::size_t b) const {
    const Bucket& bk = buckets[b];
    return std::all_of(bk.arrived.begin(), bk.arrived.end(), [](bool a) { return a; });
  }
  void launch(std::size_t b) {
    Bucket& bk = fresh(b);
    for (std::size_t k = 0; k < bk.arrived.size(); ++k) {
      if (!bk.arrived[k]) slot(b, k).zero_();  // no gradient on this rank: zeros in the average
    }
    const Layout& l = (*layouts)[b];
    bk.out = Tensor::empty({l.shard}, TensorOptions(wire_dtype(l), l.shard_param.device()));
    bk.work = pg->reduce_scatter(bk.out, bk.flat_grad, ReduceOp::avg, /*async=*/true);
    bk.reduced = true;
    bk.retired = false;
  }
  void retire(std::size_t b) {
    Bucket& bk = buckets[b];
    if (bk.retired) return;
    bk.work.wait();
    NoGradGuard no_grad;
    const Tensor out = bk.out.to((*layouts)[b].shard_param.dtype());  // from reduce_dtype
    bk.shard_grad = bk.shard_grad.defined() ? bk.shard_grad + out : out;
    bk.out = Tensor();
    bk.flat_grad = Tensor();
    bk.work = Work();
    bk.retired = true;
  }
  void launch_ready() {
    while (next < order.size() && complete(order[next])) launch(order[next++]);
  }
  // Ends the round: the rest launched in order (missing gradients count zeros), all retired.
  void finish_round() {
    if (!active) return;
    while (next < order.size()) launch(order[next++]);
    for (std::size_t b : order) retire(b);
    for (Bucket& bk : buckets) {
      std::fill(bk.arrived.begin(), bk.arrived.end(), false);
      bk.reduced = false;
    }
    next = 0;
    retired_upto = 0;
    active = false;
  }
  void on_grad(std::size_t b, std::size_t k, const Tensor& grad) {
    if (buckets[b].reduced || buckets[b].arrived[k]) finish_round();  // the next round starts
    NoGradGuard no_grad;
    active = true;
    fresh(b);
    slot(b, k).copy_(grad);  // converts to the bucket's dtype (reduce_dtype, or the shards')
    buckets[b].arrived[k] = true;
    launch_ready();
    // Drop the flat gradients of finished reductions, oldest first (they finish in launch order).
    while (retired_upto < next && buckets[order[retired_upto]].work.is_completed()) retire(order[retired_upto++]);
  }
};

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups, OptimizerFactory factory,
                                                 std::shared_ptr<ProcessGroup> group, ZeroOptions options)
    : group_(group ? std::move(group) : default_group_ptr()), options_(options) {
  const char* op = "ZeroRedundancyOptimizer";
  FLAME_CHECK(factory != nullptr, op, "no optimizer factory");
  FLAME_CHECK(!groups.empty(), op, "no parameter groups");
  FLAME_CHECK(options.stage >= 1 && options.stage <= 3, op, "stage must be 1, 2 or 3, got ", options.stage);
  FLAME_CHECK(options.stage == 3 || options.blocks.empty(), op, "ZeroOptions::blocks are for stage 3, the stage is ",
              options.stage);
  FLAME_CHECK(options.stage != 3 || !options.blocks.empty(), op,
              "stage 3 shards the parameters of ZeroOptions::blocks: give the model's blocks");
  FLAME_CHECK(!options.compute_dtype || (options.stage == 3 && is_floating(*options.compute_dtype)), op,
              "compute_dtype is stage 3's (a floating dtype), got ",
              options.compute_dtype ? dtype_name(*options.compute_dtype) : "", " with stage ", options.stage);
  FLAME_CHECK(!options.reduce_dtype || (options.stage >= 2 && is_floating(*options.reduce_dtype)), op,
              "reduce_dtype is for stages 2 and 3 (a floating dtype), got ",
              options.reduce_dtype ? dtype_name(*options.reduce_dtype) : "", " with stage ", options.stage,
              "; stage 1 reduces in the gradients' own dtype");
  // Stage 3: which block each parameter belongs to.
  std::map<const void*, int64_t> block_of;
  for (std::size_t i = 0; i < options.blocks.size(); ++i) {
    FLAME_CHECK(options.blocks[i] != nullptr, op, "block ", i, " is null");
    for (const Tensor& p : options.blocks[i]->parameters()) {
      const auto [it, fresh] = block_of.emplace(p.impl(), static_cast<int64_t>(i));
      FLAME_CHECK(fresh || it->second == static_cast<int64_t>(i), op, "a parameter (shape ", p.sizes(),
                  ") is in blocks ", it->second, " and ", i, ": a sharded parameter belongs to one block");
    }
  }
  block_layouts_.resize(options.blocks.size());
  prefetched_.resize(options.blocks.size());
  FLAME_CHECK(options.bucket_cap_mb > 0, op, "bucket_cap_mb must be positive, got ", options.bucket_cap_mb);
  ProcessGroup& pg = *group_;
  const int64_t W = pg.size();
  const Device dev = pg.device();
  std::vector<optim::ParamGroup> inner_groups;
  std::size_t index = 0;
  NoGradGuard no_grad;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const optim::ParamGroup& grp = groups[g];
    FLAME_CHECK(!grp.params.empty(), op, "parameter group ", g, " is empty");
    const DType dt = grp.params.front().dtype();
    for (const Tensor& p : grp.params) {
      FLAME_CHECK(p.defined() && p.requires_grad() && p.is_leaf(), op, "group ", g,
                  " holds a tensor that is not a leaf requiring grad");
      FLAME_CHECK(p.dtype() == dt, op, "group ", g, " mixes dtypes (", dtype_name(dt), " and ", dtype_name(p.dtype()),
                  "): give each dtype its own group");
      FLAME_CHECK(p.device() == dev, op, "a parameter of group ", g, " is on ", p.device().str(), ", the \"",
                  pg.backend(), "\" group works on ", dev.str());
      // Everyone starts from rank 0's values.
      Tensor c = p.is_contiguous() ? p.detach() : p.contiguous();
      if (c.numel() > 0) pg.broadcast(c, 0);
      if (!p.is_contiguous()) Tensor(p.detach()).copy_(c);
    }
    // The group's buckets (stage 1: the whole group): runs of consecutive parameters, cut at
    // blocks' edges in stage 3.
    const double cap = options.stage >= 2 ? options.bucket_cap_mb * 1024.0 * 1024.0 : 0.0;
    auto block_id = [&](const Tensor& p) {
      const auto it = block_of.find(p.impl());
      return it == block_of.end() ? int64_t{-1} : it->second;
    };
    std::vector<std::vector<std::size_t>> runs(1);
    double bytes = 0;
    for (std::size_t k = 0; k < grp.params.size(); ++k) {
      const double b = static_cast<double>(grp.params[k].nbytes());
      const bool new_block = !runs.back().empty() && block_id(grp.params[k]) != block_id(grp.params[runs.back().back()]);
      if (!runs.back().empty() && (new_block || (cap > 0 && bytes + b > cap))) {
        runs.emplace_back();
        bytes = 0;
      }
      runs.back().push_back(k);
      bytes += b;
    }
    optim::ParamGroup ig = grp;
    ig.params.clear();
    for (const auto& run : runs) {
      Layout l;
      l.group = g;
      l.first_index = index + run.front();
      for (std::size_t k : run) {
        l.params.push_back(grp.params[k]);
        l.offsets.push_back(l.numel);
        l.numel += grp.params[k].numel();
      }
      l.shard = std::max<int64_t>(1, (l.numel + W - 1) / W);
      const TensorOptions o(dt, dev);
      l.flat_param = Tensor::zeros({W * l.shard}, o);
      for (std::size_t k = 0; k < l.params.size(); ++k) {
        Tensor& p = l.params[k];
        Tensor slot = l.flat_param.narrow(0, l.offsets[k], p.numel()).view(p.sizes());
        slot.copy_(p);
        // A dense parameter moves into the flat buffer (identity kept): the all-gather then writes
        // the parameters themselves. Others (channels-last, ...) keep their layout and are copied.
        if (p.is_contiguous()) p.set_data(slot);
      }
      l.shard_param = Tensor::zeros({1}, o);
      l.shard_param.set_data(l.flat_param.narrow(0, pg.rank() * l.shard, l.shard));
      l.shard_param.requires_grad_(true);
      l.block = block_id(l.params.front());
      if (l.block >= 0) {  // Note [ZeRO-3 blocks]: only the shard stays; the parameters hold placeholders
        l.shard_param.set_data(l.flat_param.narrow(0, pg.rank() * l.shard, l.shard).clone());
        for (Tensor& p : l.params) {
          l.placeholders.push_back(Tensor::zeros({1}, o).expand(p.sizes()));
          p.set_data(l.placeholders.back());
        }
        l.flat_param = Tensor();
        block_layouts_[static_cast<std::size_t>(l.block)].push_back(layouts_.size());
      }
      if (options.offload_state) {  // Note [ZeRO state offload]
        const DType mdt = (dt == DType::bf16 || dt == DType::f16) ? DType::f32 : dt;
        const Tensor src = l.shard_param.detach().to(mdt);
        l.host_master = dev.is_cuda() ? offload::empty_pinned(src.sizes(), mdt) : Tensor::empty(src.sizes(), {mdt});
        l.host_master.copy_(src);
        l.host_master.requires_grad_(true);
        l.synced_version = l.shard_param.version();
        ig.params.push_back(l.host_master);
      } else {
        ig.params.push_back(l.shard_param);
      }
      layouts_.push_back(std::move(l));
    }
    index += grp.params.size();
    inner_groups.push_back(ig);
  }
  groups_ = std::move(groups);
  inner_ = factory(std::move(inner_groups));
  FLAME_CHECK(inner_ != nullptr && inner_->num_param_groups() == groups_.size(), op,
              "the factory must return an optimizer over the groups it was given");
  if (options.ema) {  // Note [ZeRO EMA]: shadow b is bucket b's shard
    TensorList shards;
    for (const Layout& l : layouts_) shards.push_back(l.shard_param);
    ema_ = std::make_unique<optim::EMA>(std::move(shards), *options.ema);
  }
  if (options.stage >= 2) {
    reducer_ = std::make_shared<Reducer>();
    reducer_->pg = group_.get();
    reducer_->layouts = &layouts_;
    reducer_->reduce_dtype = options_.reduce_dtype;
    reducer_->buckets.resize(layouts_.size());
    for (std::size_t b = layouts_.size(); b-- > 0;) reducer_->order.push_back(b);
    std::weak_ptr<Reducer> weak = reducer_;
    for (std::size_t b = 0; b < layouts_.size(); ++b) {
      reducer_->buckets[b].arrived.assign(layouts_[b].params.size(), false);
      for (std::size_t k = 0; k < layouts_[b].params.size(); ++k) {
        Tensor p = layouts_[b].params[k];
        p.register_post_accumulate_grad_hook([weak, b, k](const Tensor& grad) {
          auto r = weak.lock();
          if (!r) return;  // the optimizer is gone: the gradient stays in the store
          r->on_grad(b, k, grad);
          autograd_detail::release_leaf_gradient();
        });
      }
    }
  }
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

std::string ZeroRedundancyOptimizer::name() const { return "ZeroRedundancyOptimizer(" + inner_->name() + ")"; }

std::size_t ZeroRedundancyOptimizer::num_buckets() const { return layouts_.size(); }

void ZeroRedundancyOptimizer::finish_reductions() {
  if (reducer_) timed_wait("reductions", -1, [this] { reducer_->finish_round(); });
}

// Note [ZeRO wait timeline]
// The collectives run on the group's communication stream; the compute stream waits for one only
// where it needs the result: a block's gathered parameters (gather_block), the shard gradients at
// the step (finish_reductions). An event recorded on the compute stream just before such a wait
// completes when the compute queued before it is done; one recorded just after completes when the
// collective is done too. Their difference is the time the compute stream stood waiting, the
// collective's part not hidden behind compute; their positions put the waits on the compute
// timeline. CUDA events only: on the CPU (tcp) the waits run unrecorded.
struct ZeroRedundancyOptimizer::WaitMark {
  std::string what;
  cuda::Event before{true}, after{true};
};

void ZeroRedundancyOptimizer::set_wait_timeline(bool on) {
  timeline_on_ = on;
  if (!on) wait_marks_.clear();
}

void ZeroRedundancyOptimizer::timed_wait(const char* what, int64_t block, const std::function<void()>& wait) {
  if (!timeline_on_ || !group_->device().is_cuda()) {
    wait();
    return;
  }
  auto mark = std::make_shared<WaitMark>();
  mark->what = block < 0 ? std::string(what) : "gather block " + std::to_string(block) + " (" + what + ")";
  mark->before.record();
  wait();
  mark->after.record();
  wait_marks_.push_back(std::move(mark));
}

std::vector<ZeroRedundancyOptimizer::WaitRecord> ZeroRedundancyOptimizer::wait_timeline() {
  std::vector<WaitRecord> out;
  if (wait_marks_.empty()) return out;
  cuda::synchronize(group_->device().index);
  const cuda::Event& origin = wait_marks_.front()->before;
  for (const auto& m : wait_marks_)
    out.push_back({m->what, origin.elapsed_time(m->before), m->before.elapsed_time(m->after)});
  wait_marks_.clear();
  return out;
}

void ZeroRedundancyOptimizer::step(const Gradients& grads) {
  ProcessGroup& pg = *group_;
  NoGradGuard no_grad;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    optim::ParamGroup hyper = groups_[g];
    hyper.params = inner_->param_groups()[g].params;
    inner_->param_groups()[g] = hyper;
  }
  std::vector<Work> works;
  if (reducer_) {  // stage 2: the shard gradients are already there (Note [ZeRO-2 buckets])
    finish_reductions();
    drop_prefetched();  // gathered before this step: stale after it
    Gradients local;
    for (std::size_t b = 0; b < layouts_.size(); ++b) {
      Layout& l = layouts_[b];
      Tensor& sg = reducer_->buckets[b].shard_grad;
      local.set(l.shard_param, sg.defined() ? std::move(sg) : Tensor::zeros({l.shard}, TensorOptions(l.shard_param.dtype(), l.shard_param.device())));
      sg = Tensor();
      for (std::size_t k = 0; k < l.params.size(); ++k)
        if (!l.aliased(k))
          l.flat_param.narrow(0, l.offsets[k], l.params[k].numel()).view(l.params[k].sizes()).copy_(l.params[k]);
    }
    step_inner(local);
  } else {
  std::vector<Tensor> shard_grads;
  for (Layout& l : layouts_) {
    // The flat gradient lives for this step only (the pool reuses it for the next forward).
    const TensorOptions o(l.flat_param.dtype(), l.flat_param.device());
    Tensor flat_grad = Tensor::empty({l.flat_param.numel()}, o);
    for (std::size_t k = 0; k < l.params.size(); ++k) {
      Tensor dst = flat_grad.narrow(0, l.offsets[k], l.params[k].numel());
      const Tensor gk = grads.try_get(l.params[k]);
      if (gk.defined()) dst.view(l.params[k].sizes()).copy_(gk);
      else dst.zero_();
      // A parameter outside the flat buffer (its layout, or rebound since) is copied in.
      if (!l.aliased(k))
        l.flat_param.narrow(0, l.offsets[k], l.params[k].numel()).view(l.params[k].sizes()).copy_(l.params[k]);
    }
    if (l.flat_param.numel() > l.numel) flat_grad.narrow(0, l.numel, l.flat_param.numel() - l.numel).zero_();
    Tensor sg = Tensor::empty({l.shard}, o);
    works.push_back(pg.reduce_scatter(sg, flat_grad, ReduceOp::avg, /*async=*/true));
    shard_grads.push_back(sg);
  }
  Gradients local;
  for (std::size_t i = 0; i < layouts_.size(); ++i) {
    works[i].wait();
    local.set(layouts_[i].shard_param, std::move(shard_grads[i]));
  }
  step_inner(local);
  }
  if (ema_) ema_->update();
  publish_replicas();
  if (options_.offload_state) {
    for (Layout& l : layouts_) l.synced_version = l.shard_param.version();
  }
}

// Note [ZeRO state offload]
// With ZeroOptions::offload_state the inner optimizer was built over host masters of the shards
// (Layout::host_master: pinned on a CUDA device, f32 for half shards), so its state lives on the
// host (DeepSpeed's ZeRO-Offload with a CPU Adam). step_inner copies each shard gradient down (cast
// to the master's dtype on the device first, then one non-blocking copy into a pinned buffer),
// waits for the device (the step's one host wait), hands the buffers to the inner optimizer, steps
// the masters on the CPU and copies them back into the shards (non-blocking; rounded to half shards
// on the device), before the replicated buckets are all-gathered. The buffers go to the inner
// optimizer's Gradients only after the wait, and moved in: Gradients::set copies a tensor the
// caller still holds, and a copy made before the wait read the buffers while the device was still
// writing them (on NCCL the steps then did not follow one process's AdamW, while the tcp backend's
// synchronous CPU copies hid it). The host writes a master only after a wait too
// (wait_for_host_copies): the last step's copies back may still read it. A master is the truth between
// steps, but a shard written from outside (a loaded state dict into the parameters,
// gather_parameters' write-back) bumps the shard's storage version: step_inner then takes into the
// master the shard's elements that differ from the master's rounding (so the weights of a
// checkpoint, its masters rounded, leave the loaded masters exact). The versions are recorded after
// the step's own writes (the copy back and the all-gather). state_dict() gives a half shard's
// master as the slot "master_param", as the inner optimizer's master weights are without offload,
// and load_state_dict() reads it back into the host master: the consolidated state is the same
// either way.
void ZeroRedundancyOptimizer::step_inner(const Gradients& shard_grads) {
  if (!options_.offload_state) {
    inner_->step(shard_grads);
    return;
  }
  NoGradGuard no_grad;
  std::vector<std::pair<Tensor, Tensor>> host;  // (master, its gradient being copied down)
  std::vector<Tensor> staged;
  for (Layout& l : layouts_) {
    if (l.shard_param.version() != l.synced_version) {
      // Written from outside: the elements that differ from the master's rounding take the shard's
      // value; the others keep the master (a resumed checkpoint's weights are its masters rounded).
      wait_for_host_copies();
      const Tensor shard = l.shard_param.detach().to(Device::cpu());
      Tensor master = l.host_master.detach();
      const Tensor outside = master.to(shard.dtype()).ne(shard);
      master.copy_(flame::where(outside, shard.to(master.dtype()), master));
      l.synced_version = l.shard_param.version();
    }
    Tensor g = shard_grads.try_get(l.shard_param);
    if (!g.defined()) continue;
    g = g.to(l.host_master.dtype());
    Tensor h = l.shard_param.device().is_cuda() ? offload::empty_pinned(g.sizes(), g.dtype()) : Tensor::empty(g.sizes(), {g.dtype()});
    h.copy_(g, /*non_blocking=*/true);
    staged.push_back(g);  // alive until the copies ran
    host.emplace_back(l.host_master, std::move(h));
  }
  wait_for_host_copies();  // the gradients are on the host, and the last copies back no longer read the masters
  staged.clear();
  Gradients grads;  // made only now: Gradients::set of a held tensor copies it (not before its copy down ran)
  for (auto& [master, h] : host) grads.set(master, std::move(h));
  host.clear();
  inner_->step(grads);
  for (Layout& l : layouts_) {  // the copy from pinned memory is asynchronous; a half shard rounds on the device
    l.shard_param.detach().copy_(l.host_master.detach().to(l.shard_param.device(), /*non_blocking=*/true));
  }
}

void ZeroRedundancyOptimizer::wait_for_host_copies() {
  if (options_.offload_state && group_->device().is_cuda()) cuda::synchronize(group_->device().index);
}

void ZeroRedundancyOptimizer::publish_replicas() {
  ProcessGroup& pg = *group_;
  NoGradGuard no_grad;
  std::vector<Work> works;
  for (Layout& l : layouts_) {  // stage-3 buckets stay sharded: run_block gathers them
    works.push_back(l.block >= 0 ? Work() : pg.all_gather(l.flat_param, l.shard_param.detach(), /*async=*/true));
  }
  for (std::size_t i = 0; i < layouts_.size(); ++i) {
    if (!works[i].defined()) continue;
    works[i].wait();
    Layout& l = layouts_[i];
    for (std::size_t k = 0; k < l.params.size(); ++k)
      if (!l.aliased(k))
        Tensor(l.params[k].detach()).copy_(l.flat_param.narrow(0, l.offsets[k], l.params[k].numel()).view(l.params[k].sizes()));
  }
}

// Note [ZeRO EMA]
// ZeroOptions::ema keeps the average where the optimizer keeps its state: an optim::EMA over the
// shards (shadow b for bucket b), updated after each step, so a rank holds 1/W of it and nothing
// of a block's parameters is ever needed whole. state_dict() gathers each bucket's shadow as the
// slot "ema" of its parameters, beside the inner optimizer's slots ("state.<i>.ema" in parameter
// shape), and load_state_dict() cuts it back into this rank's range the same way, so a checkpoint
// of W ranks resumes on any other number. swap_in_ema() stores the shards, writes the shadows
// into them and republishes the replicated buckets; stage 3's blocks read the shards at their
// next gather (prefetched gathers are dropped). The guard's end restores both.
ZeroRedundancyOptimizer::EmaSwap ZeroRedundancyOptimizer::swap_in_ema() {
  FLAME_CHECK(ema_ != nullptr, "ZeroRedundancyOptimizer.swap_in_ema", "no EMA is kept: set ZeroOptions::ema");
  finish_reductions();
  drop_prefetched();
  ema_->store();
  ema_->copy_to();
  publish_replicas();
  return EmaSwap(this);
}

ZeroRedundancyOptimizer::EmaSwap::~EmaSwap() {
  if (!zero_) return;
  zero_->drop_prefetched();
  zero_->ema_->restore();
  zero_->publish_replicas();
}

StateDict ZeroRedundancyOptimizer::state_dict() const {
  const char* op = "ZeroRedundancyOptimizer.state_dict";
  ProcessGroup& pg = *group_;
  const optim::AdamW8bit* q8 = as_8bit(*inner_);  // Note [ZeRO 8-bit state]
  const StateDict inner = elementwise_inner_state(op);
  const StateDict ema_state = ema_ ? ema_->state_dict() : StateDict();
  StateDict out;
  NoGradGuard no_grad;
  if (ema_) out.insert("ema.num_updates", ema_state.at("num_updates"));
  for (std::size_t g = 0; g < layouts_.size(); ++g) {
    const Layout& l = layouts_[g];
    const Tensor* step = inner.find(state_key(g, "step"));
    if (!step) continue;
    // The slots in the inner optimizer's order.
    const std::string prefix = "state." + std::to_string(g) + ".";
    std::vector<std::pair<std::string, Tensor>> full;
    for (const auto& [k, t] : inner) {
      if (k.rfind(prefix, 0) != 0) continue;
      const std::string slot = k.substr(prefix.size());
      if (slot == "step") continue;
      FLAME_CHECK(t.numel() == l.shard, op, "state '", slot, "' of shape ", t.sizes(), " is not elementwise (",
                  inner_->name(), "): ZeRO-1 shards only elementwise optimizers (SGD, Adam, AdamW, Lion)");
      Tensor gathered = Tensor::empty({l.shard * pg.size()}, TensorOptions(t.dtype(), pg.device()));
      pg.all_gather(gathered, t.to(pg.device()).contiguous());
      full.emplace_back(slot, gathered);
    }
    if (options_.offload_state && l.host_master.dtype() != l.shard_param.dtype()) {
      // Note [ZeRO state offload]: the f32 master of a half shard, as the inner optimizer's own
      // master weights would be on the device (the same consolidated state with or without offload).
      Tensor gathered = Tensor::empty({l.shard * pg.size()}, TensorOptions(l.host_master.dtype(), pg.device()));
      pg.all_gather(gathered, l.host_master.detach().to(pg.device()).contiguous());
      full.emplace_back("master_param", gathered);
    }
    if (ema_) {  // Note [ZeRO EMA]: the bucket's shadow, as one more slot
      const Tensor shadow = ema_state.at("shadow." + std::to_string(g));
      Tensor gathered = Tensor::empty({l.shard * pg.size()}, TensorOptions(shadow.dtype(), pg.device()));
      pg.all_gather(gathered, shadow.to(pg.device()).contiguous());
      full.emplace_back("ema", gathered);
    }
    for (std::size_t k = 0; k < l.params.size(); ++k) {
      const std::size_t i = l.first_index + k;
      out.insert(state_key(i, "step"), step->clone());
      for (const auto& [slot, flat] : full)
        out.insert(state_key(i, slot), flat.narrow(0, l.offsets[k], l.params[k].numel()).view(l.params[k].sizes()).clone());
    }
  }
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const std::string prefix = group_prefix(g);
    for (const auto& [k, t] : inner) {
      if (k.rfind(prefix, 0) != 0) continue;
      if (k == prefix + "params") {
        std::vector<int64_t> idx;
        for (const Layout& l : layouts_) {
          if (l.group != g) continue;
          for (std::size_t i = 0; i < l.params.size(); ++i) idx.push_back(static_cast<int64_t>(l.first_index + i));
        }
        out.insert(k, Tensor::from_vec(idx, {static_cast<int64_t>(idx.size())}));
      } else {
        out.insert(k, t.clone());
      }
    }
  }
  if (q8) {  // each parameter's moments in its own blocks, as one process's AdamW8bit keeps them
    std::map<int64_t, int64_t> numel;
    for (const Layout& l : layouts_)
      for (std::size_t k = 0; k < l.params.size(); ++k)
        numel[static_cast<int64_t>(l.first_index + k)] = l.params[k].numel();
    const int64_t min8 = q8->options().min_8bit_size;
    return quantized_moments(out, q8->options().block_size, min8, [&](int64_t i) { return numel.at(i) >= min8; });
  }
  return out;
}

void ZeroRedundancyOptimizer::load_state_dict(const StateDict& given) {
  const char* op = "ZeroRedundancyOptimizer.load_state_dict";
  ProcessGroup& pg = *group_;
  const optim::AdamW8bit* q8 = as_8bit(*inner_);  // Note [ZeRO 8-bit state]
  const StateDict state = q8 ? dequantized_moments(given, saved_block_size(given, op), op) : given;
  StateDict inner, ema_state;
  NoGradGuard no_grad;
  for (std::size_t g = 0; g < layouts_.size(); ++g) {
    const Layout& l = layouts_[g];
    // The step and the slot names from the first parameter of the group that has state.
    const Tensor* step = nullptr;
    std::vector<std::string> slots;
    for (std::size_t k = 0; k < l.params.size() && !step; ++k) {
      const std::string prefix = "state." + std::to_string(l.first_index + k) + ".";
      step = state.find(prefix + "step");
      if (!step) continue;
      for (const auto& [key, t] : state)
        if (key.rfind(prefix, 0) == 0 && key != prefix + "step") slots.push_back(key.substr(prefix.size()));
    }
    if (!step) continue;
    inner.insert(state_key(g, "step"), step->clone());
    const int64_t lo = pg.rank() * l.shard;
    for (const std::string& slot : slots) {
      Tensor mine;
      for (std::size_t k = 0; k < l.params.size(); ++k) {
        const Tensor* t = state.find(state_key(l.first_index + k, slot));
        if (!t) continue;
        FLAME_CHECK(t->numel() == l.params[k].numel(), op, "key ", state_key(l.first_index + k, slot), " has ",
                    t->numel(), " elements, parameter ", l.first_index + k, " has ", l.params[k].numel());
        if (!mine.defined()) mine = Tensor::zeros({l.shard}, TensorOptions(t->dtype(), pg.device()));
      }
      if (!mine.defined()) continue;
      for_each_overlap(l, lo, lo + l.shard, [&](std::size_t k, int64_t poff, int64_t foff, int64_t n) {
        const Tensor* t = state.find(state_key(l.first_index + k, slot));
        if (t) mine.narrow(0, foff - lo, n).copy_(t->reshape({-1}).narrow(0, poff, n));
      });
      if (take_own_slot(g, slot, mine, ema_state)) continue;
      inner.insert(state_key(g, slot), options_.offload_state ? mine.to(Device::cpu()) : mine);
    }
  }
  load_ema(ema_state, state.find("ema.num_updates"), op);
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const std::string prefix = group_prefix(g);
    const std::vector<int64_t> buckets = buckets_of(g);  // the inner optimizer's parameters of group g
    bool any = false;
    for (const auto& [k, t] : state) {
      if (k.rfind(prefix, 0) != 0) continue;
      any = true;
      if (k == prefix + "params") inner.insert(k, Tensor::from_vec(buckets, {static_cast<int64_t>(buckets.size())}));
      else inner.insert(k, t);
    }
    FLAME_CHECK(any, op, "the state has no keys for parameter group ", g);
  }
  load_inner_state(inner);
}

StateDict ZeroRedundancyOptimizer::elementwise_inner_state(const char* op) const {
  const optim::AdamW8bit* q8 = as_8bit(*inner_);  // Note [ZeRO 8-bit state]: 8-bit moments leave in f32
  return q8 ? dequantized_moments(inner_->state_dict(), q8->options().block_size, op) : inner_->state_dict();
}

StateDict ZeroRedundancyOptimizer::quantized_for_inner(const StateDict& inner) const {
  const optim::AdamW8bit* q8 = as_8bit(*inner_);  // Note [ZeRO 8-bit state]: in the shards' blocks
  if (!q8) return inner;
  return quantized_moments(inner, q8->options().block_size, q8->options().min_8bit_size,
                           [&](int64_t b) { return q8->is_8bit(static_cast<std::size_t>(b)); });
}

// The slots that are not the inner optimizer's: the EMA's shadow (Note [ZeRO EMA]) and, with
// offload_state, a half shard's host master (Note [ZeRO state offload]). `mine`: bucket b's
// elements of this rank. Returns whether the slot was one of them.
bool ZeroRedundancyOptimizer::take_own_slot(std::size_t b, const std::string& slot, const Tensor& mine,
                                            StateDict& ema_state) {
  if (slot == "ema") {
    if (ema_) ema_state.insert("shadow." + std::to_string(b), mine);
    return true;
  }
  if (slot == "master_param" && options_.offload_state) {
    wait_for_host_copies();  // Note [ZeRO state offload]: no copy back still reads the master
    layouts_[b].host_master.detach().copy_(mine.to(Device::cpu()).to(layouts_[b].host_master.dtype()));
    return true;
  }
  return false;
}

void ZeroRedundancyOptimizer::load_ema(StateDict shadows, const Tensor* num_updates, const char* op) {
  if (!ema_) return;
  FLAME_CHECK(num_updates != nullptr, op, "the state has no EMA (\"ema.num_updates\") but ZeroOptions::ema is set: it "
              "was saved without one");
  shadows.insert("num_updates", *num_updates);
  const StateDict current = ema_->state_dict();  // buckets without state yet keep their shadows
  for (const std::string& k : current.keys())
    if (!shadows.contains(k)) shadows.insert(k, current.at(k));
  ema_->load_state_dict(shadows);
}

void ZeroRedundancyOptimizer::load_inner_state(const StateDict& inner) {
  inner_->load_state_dict(quantized_for_inner(inner));
  for (std::size_t g = 0; g < groups_.size(); ++g) {  // the hyperparameters loaded, the parameters kept
    TensorList keep = groups_[g].params;
    groups_[g] = inner_->param_groups()[g];
    groups_[g].params = std::move(keep);
  }
}

std::vector<int64_t> ZeroRedundancyOptimizer::buckets_of(std::size_t group) const {
  std::vector<int64_t> out;
  for (std::size_t b = 0; b < layouts_.size(); ++b)
    if (layouts_[b].group == group) out.push_back(static_cast<int64_t>(b));
  return out;
}

// Note [ZeRO shard files]
// A rank's file holds, per bucket b, the inner optimizer's state of the flat elements it owns
// without the padding ("bucket.<b>.<slot>", elements [lo, hi) of the bucket, lo = r*S, hi =
// min(lo + S, numel), in the metadata), the bucket's step ("bucket.<b>.step") and the
// hyperparameters ("param_groups.<g>.*" except the parameter list). The buckets depend on the
// parameter groups and bucket_cap_mb, not on the world size, so a set saved by W ranks is read by
// any other number: each rank copies from every file the overlap of that file's range with its own.
// Every file and the index carry one save id, drawn by rank 0 and broadcast: a file left from
// another save (one that did not finish) is refused by name.
namespace {
constexpr const char* kShardFormat = "flame.zero_shards.v1";
std::string shard_file(const std::string& dir, int64_t r, int64_t w) {
  return dir + "/optimizer-rank" + std::to_string(r) + "-of-" + std::to_string(w) + ".safetensors";
}
std::string shard_index(const std::string& dir) { return dir + "/optimizer-shards.safetensors"; }
int64_t meta_int(const io::Metadata& m, const std::string& key, const std::string& file) {
  const auto it = m.find(key);
  FLAME_CHECK(it != m.end(), "ZeroRedundancyOptimizer.load_sharded", file, " has no '", key,
              "' in its metadata: not a ZeRO shard file");
  return std::stoll(it->second);
}
}  // namespace

void ZeroRedundancyOptimizer::save_sharded(const std::string& dir) const {
  ProcessGroup& pg = *group_;
  const int64_t W = pg.size(), R = pg.rank();
  NoGradGuard no_grad;
  Tensor id = Tensor::zeros({1}, TensorOptions(DType::i64, pg.device()));
  if (R == 0) id.fill_(static_cast<double>(std::random_device{}() & 0x3fffffffu));
  pg.broadcast(id, 0);
  const std::string save_id = std::to_string(id.to(Device::cpu()).item<int64_t>());
  if (R == 0) std::filesystem::create_directories(dir);
  pg.barrier();
  const StateDict inner = elementwise_inner_state("ZeroRedundancyOptimizer.save_sharded");  // f32 moments
  const StateDict ema_state = ema_ ? ema_->state_dict() : StateDict();
  StateDict out;
  io::Metadata meta{{"format", kShardFormat}, {"save_id", save_id}, {"world", std::to_string(W)},
                    {"rank", std::to_string(R)}, {"buckets", std::to_string(layouts_.size())}};
  for (std::size_t b = 0; b < layouts_.size(); ++b) {
    const Layout& l = layouts_[b];
    const int64_t lo = std::min(R * l.shard, l.numel), hi = std::min(lo + l.shard, l.numel);
    const std::string key = "bucket." + std::to_string(b) + ".";
    meta[key + "numel"] = std::to_string(l.numel);
    meta[key + "lo"] = std::to_string(lo);
    meta[key + "hi"] = std::to_string(hi);
    const std::string prefix = "state." + std::to_string(b) + ".";
    for (const auto& [k, t] : inner) {
      if (k.rfind(prefix, 0) != 0) continue;
      const std::string slot = k.substr(prefix.size());
      if (slot == "step") {
        out.insert(key + "step", t.to(Device::cpu()).clone());
        continue;
      }
      FLAME_CHECK(t.numel() == l.shard, "ZeroRedundancyOptimizer.save_sharded", "state '", slot, "' of shape ",
                  t.sizes(), " is not elementwise (", inner_->name(), ")");
      out.insert(key + slot, t.narrow(0, 0, hi - lo).to(Device::cpu()).contiguous());
    }
    // The slots of this optimizer's own (take_own_slot): the EMA's shadow, a half shard's host master.
    if (ema_) out.insert(key + "ema", ema_state.at("shadow." + std::to_string(b)).narrow(0, 0, hi - lo).to(Device::cpu()).contiguous());
    if (options_.offload_state && l.host_master.dtype() != l.shard_param.dtype())
      out.insert(key + "master_param", l.host_master.detach().narrow(0, 0, hi - lo).contiguous().clone());
  }
  if (ema_) out.insert("ema.num_updates", ema_state.at("num_updates").to(Device::cpu()).clone());
  for (const auto& [k, t] : inner) {
    if (k.rfind("param_groups.", 0) == 0 && k.size() > 7 && k.substr(k.size() - 7) != ".params")
      out.insert(k, t.to(Device::cpu()).clone());
  }
  io::save_safetensors(shard_file(dir, R, W), out, meta);
  pg.barrier();  // every shard is in place before the index says so
  if (R == 0)
    io::save_safetensors(shard_index(dir), StateDict{},
                         {{"format", kShardFormat}, {"save_id", save_id}, {"world", std::to_string(W)}});
  pg.barrier();
}

void ZeroRedundancyOptimizer::load_sharded(const std::string& dir) {
  const char* op = "ZeroRedundancyOptimizer.load_sharded";
  ProcessGroup& pg = *group_;
  const int64_t R = pg.rank();
  const std::string index = shard_index(dir);
  FLAME_CHECK(std::filesystem::exists(index), op, dir, " has no optimizer-shards.safetensors: the sharded save did ",
              "not finish, or the directory holds no sharded save (save_sharded writes the index last)");
  const io::Metadata im = io::load_safetensors_metadata(index);
  FLAME_CHECK(im.count("format") && im.at("format") == kShardFormat, op, index, " is not a ZeRO shard index");
  const std::string save_id = im.count("save_id") ? im.at("save_id") : "";
  const int64_t saved_world = meta_int(im, "world", index);
  NoGradGuard no_grad;
  // Per bucket and slot, the elements this rank owns now, filled from every file's overlap.
  std::map<std::string, Tensor> mine;
  StateDict first;
  for (int64_t f = 0; f < saved_world; ++f) {
    const std::string file = shard_file(dir, f, saved_world);
    FLAME_CHECK(std::filesystem::exists(file), op, file, " is missing: the save by ", saved_world,
                " ranks is incomplete");
    const io::Metadata m = io::load_safetensors_metadata(file);
    FLAME_CHECK(m.count("save_id") && m.at("save_id") == save_id, op, file, " is from another save than ", index,
                " (a save that did not finish wrote it): use a complete checkpoint directory");
    FLAME_CHECK(meta_int(m, "buckets", file) == static_cast<int64_t>(layouts_.size()), op, file, " holds ",
                m.at("buckets"), " buckets, this optimizer has ", layouts_.size(),
                " (other parameter groups or another bucket_cap_mb)");
    const StateDict sd = io::load_safetensors(file, Device::cpu());
    if (f == 0) first = sd;
    for (std::size_t b = 0; b < layouts_.size(); ++b) {
      const Layout& l = layouts_[b];
      const std::string key = "bucket." + std::to_string(b) + ".";
      FLAME_CHECK(meta_int(m, key + "numel", file) == l.numel, op, file, ": bucket ", b, " has ",
                  m.at(key + "numel"), " elements, here ", l.numel, " (another model or parameter order)");
      const int64_t flo = meta_int(m, key + "lo", file), fhi = meta_int(m, key + "hi", file);
      const int64_t lo = std::min(R * l.shard, l.numel), hi = std::min(lo + l.shard, l.numel);
      const int64_t s = std::max(lo, flo), e = std::min(hi, fhi);
      for (const auto& [k, t] : sd) {
        if (k.rfind(key, 0) != 0 || k == key + "step") continue;
        Tensor& dst = mine[k];
        if (!dst.defined()) dst = Tensor::zeros({l.shard}, TensorOptions(t.dtype(), Device::cpu()));
        if (s < e) dst.narrow(0, s - lo, e - s).copy_(t.narrow(0, s - flo, e - s));
      }
    }
  }
  StateDict inner, ema_state;
  for (std::size_t b = 0; b < layouts_.size(); ++b) {
    const std::string key = "bucket." + std::to_string(b) + ".";
    const Tensor* step = first.find(key + "step");
    if (!step) continue;  // no state yet for this bucket
    inner.insert(state_key(b, "step"), step->to(pg.device()));
    for (const auto& [k, t] : mine) {
      if (k.rfind(key, 0) != 0) continue;
      const std::string slot = k.substr(key.size());
      if (take_own_slot(b, slot, t.to(pg.device()), ema_state)) continue;
      inner.insert(state_key(b, slot), options_.offload_state ? t : t.to(pg.device()));
    }
  }
  load_ema(ema_state, first.find("ema.num_updates"), op);
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const std::string prefix = group_prefix(g);
    const std::vector<int64_t> buckets = buckets_of(g);
    bool any = false;
    for (const auto& [k, t] : first) {
      if (k.rfind(prefix, 0) != 0) continue;
      any = true;
      inner.insert(k, t.to(pg.device()));
    }
    FLAME_CHECK(any, op, shard_file(dir, 0, saved_world), " has no hyperparameters of parameter group ", g);
    inner.insert(prefix + "params", Tensor::from_vec(buckets, {static_cast<int64_t>(buckets.size())}));
  }
  load_inner_state(inner);
}

// Note [ZeRO-3 blocks]
// With stage 3 the buckets of a block's parameters keep only this rank's shard (its own storage,
// what the inner optimizer steps); the parameters hold a placeholder of their shape (a stride-0
// view of one zero) outside run_block, so the block costs 1/W of its bytes at rest. gather_block
// all-gathers each of the block's buckets into a fresh flat buffer and binds the parameters to
// views of it (set_data, identity kept), and rebinds the placeholders when the returned scope ends.
// run_block runs fn with the block gathered and grad off, and records one node whose edges are the
// inputs that require grad and the block's parameters. Its backward gathers the block again,
// recomputes fn with grad on (the generator and autocast state of the forward) and runs an inner
// backward to the inputs and the parameters; the parameters' gradients go through the ZeRO-2
// hooks (Note [ZeRO-2 buckets]) into their buckets and are released there, so the node returns
// gradients for the inputs only. No saved tensor holds a parameter (their versions change with
// every rebinding). With prefetch, run_block starts block i+1's all-gathers (async) once block i is
// bound, and block i's backward starts block i-1's; gather_block then waits on them instead of
// gathering. step() finishes and drops any gather still pending (it was of the shards before the
// update). Parameters outside the blocks are treated as in stage 2. With compute_dtype the
// shard is cast before the all-gather and the parameters are bound to views in that dtype; their
// gradients are cast into the buckets, which stay in the shards' dtype.
namespace {
struct GatheredBlock {
  std::vector<Tensor> fulls;
  std::vector<std::pair<Tensor, Tensor>> rebind;  // (parameter, placeholder) to restore
  ~GatheredBlock() {
    for (auto& [p, ph] : rebind) {
      try {
        p.set_data(ph);
      } catch (...) {  // set_data on a tensor it accepted before cannot fail
      }
    }
  }
};

}  // namespace

// A block's all-gathers, started ahead of their use (ZeroOptions::prefetch) or just before.
struct ZeroRedundancyOptimizer::Prefetch {
  std::vector<Tensor> fulls, sources;  // the outputs, and the inputs kept alive while in flight
  std::vector<Work> works;
  void wait() {
    for (Work& w : works) w.wait();
    works.clear();
    sources.clear();
  }
};

// Starts block i's all-gathers (async): in compute_dtype, or in the shards' own dtype.
std::shared_ptr<ZeroRedundancyOptimizer::Prefetch> ZeroRedundancyOptimizer::start_gather(std::size_t i, bool own_dtype) {
  ProcessGroup& pg = *group_;
  NoGradGuard no_grad;
  auto pf = std::make_shared<Prefetch>();
  for (std::size_t b : block_layouts_[i]) {
    const Layout& l = layouts_[b];
    // compute_dtype: the shard cast before the gather (half the bytes on the wire for bf16 over f32).
    const DType dt = !own_dtype && options_.compute_dtype ? *options_.compute_dtype : l.shard_param.dtype();
    pf->sources.push_back(l.shard_param.dtype() == dt ? l.shard_param.detach() : l.shard_param.detach().to(dt));
    pf->fulls.push_back(Tensor::empty({pg.size() * l.shard}, TensorOptions(dt, l.shard_param.device())));
    pf->works.push_back(pg.all_gather(pf->fulls.back(), pf->sources.back(), /*async=*/true));
  }
  return pf;
}

void ZeroRedundancyOptimizer::prefetch_block(std::size_t i) {
  if (!options_.prefetch || i >= block_layouts_.size() || prefetched_[i]) return;
  prefetched_[i] = start_gather(i, /*own_dtype=*/false);
}

void ZeroRedundancyOptimizer::drop_prefetched() {
  for (auto& p : prefetched_) {
    if (p) p->wait();  // every rank launched it: finish it
    p = nullptr;
  }
}

std::shared_ptr<void> ZeroRedundancyOptimizer::gather_block(std::size_t i, bool own_dtype, const char* phase) {
  FLAME_CHECK(i < block_layouts_.size(), "ZeroRedundancyOptimizer.run_block", "block ", i, " out of range (",
              block_layouts_.size(), " blocks with sharded parameters; stage ", options_.stage, ")");
  std::shared_ptr<Prefetch> pf;
  if (!own_dtype && prefetched_[i]) {
    pf = std::move(prefetched_[i]);
    prefetched_[i] = nullptr;
  } else {
    pf = start_gather(i, own_dtype);
  }
  timed_wait(phase, static_cast<int64_t>(i), [&] { pf->wait(); });
  NoGradGuard no_grad;
  auto held = std::make_shared<GatheredBlock>();
  for (std::size_t j = 0; j < block_layouts_[i].size(); ++j) {
    Layout& l = layouts_[block_layouts_[i][j]];
    const Tensor& full = pf->fulls[j];
    for (std::size_t k = 0; k < l.params.size(); ++k) {
      Tensor p = l.params[k];
      p.set_data(full.narrow(0, l.offsets[k], p.numel()).view(p.sizes()));
      held->rebind.emplace_back(p, l.placeholders[k]);
    }
    held->fulls.push_back(full);
  }
  return held;
}

Tensor ZeroRedundancyOptimizer::run_block(std::size_t i, const std::function<Tensor(const TensorList&)>& fn,
                                          const TensorList& inputs) {
  const char* op = "ZeroRedundancyOptimizer.run_block";
  FLAME_CHECK(options_.stage == 3, op, "blocks are sharded only with stage 3 (this optimizer has stage ",
              options_.stage, ")");
  if (!grad_enabled()) {
    const std::shared_ptr<void> g = gather_block(i);
    prefetch_block(i + 1);
    return fn(inputs);
  }
  Generator& gen = default_generator();
  const Generator::State rng_before = gen.get_state();
  const amp::detail::AutocastState autocast_before = amp::detail::autocast_state();
  Tensor out;
  {
    NoGradGuard no_grad;
    const std::shared_ptr<void> g = gather_block(i);
    prefetch_block(i + 1);  // the next block's gather runs while this one computes
    out = fn(inputs);
  }
  FLAME_CHECK(out.defined(), op, "block ", i, " returned an undefined tensor");
  out = out.detach();
  TensorList edges;
  std::vector<SavedTensor> saved;
  std::vector<bool> wants;
  for (const Tensor& t : inputs) {
    saved.emplace_back(t, "ZeroBlock");
    wants.push_back(t.defined() && t.requires_grad());
    if (wants.back()) edges.push_back(t);
  }
  TensorList params;
  for (std::size_t b : block_layouts_[i])
    for (const Tensor& p : layouts_[b].params) params.push_back(p);
  edges.insert(edges.end(), params.begin(), params.end());
  const std::size_t n_params = params.size();
  record(out, "ZeroBlockBackward", edges,
         [this, i, fn, saved, wants, n_params, rng_before, autocast_before](const Tensor& grad) {
           const std::shared_ptr<void> g = gather_block(i, /*own_dtype=*/false, "backward");
           if (i > 0) prefetch_block(i - 1);  // backward walks the blocks in reverse
           TensorList ins, stop_at;
           for (std::size_t k = 0; k < saved.size(); ++k) {
             Tensor d = saved[k].get();
             if (d.defined() && wants[k]) {
               d = d.detach().requires_grad_(true);
               stop_at.push_back(d);
             }
             ins.push_back(d);
           }
           TensorList block_params;
           for (std::size_t b : block_layouts_[i])
             for (const Tensor& p : layouts_[b].params) block_params.push_back(p);
           Tensor y;
           {
             autograd_detail::RecomputeScope recompute(default_generator(), rng_before);
             amp::detail::AutocastStateGuard autocast(autocast_before);
             y = fn(ins);
           }
           TensorList grads;
           Gradients gs;
           if (y.requires_grad()) {
             BackwardOptions opts;
             opts.grad_output = grad;
             opts.inputs = stop_at;
             opts.inputs.insert(opts.inputs.end(), block_params.begin(), block_params.end());
             gs = y.backward(opts);  // the parameters' gradients leave through their hooks
           }
           for (const Tensor& d : stop_at) grads.push_back(gs.try_get(d));
           grads.resize(grads.size() + n_params);
           return grads;
         });
  return out;
}

ZeroRedundancyOptimizer::Gathered::~Gathered() = default;
ZeroRedundancyOptimizer::Gathered::Gathered(Gathered&&) noexcept = default;

ZeroRedundancyOptimizer::Gathered ZeroRedundancyOptimizer::gather_parameters(bool write_back) {
  // A gather prefetched for the next run_block holds the shards as they were: after a write-back it
  // would bind stale values (every rank has the same ones pending).
  if (write_back) drop_prefetched();
  Gathered g;
  std::vector<std::shared_ptr<void>> blocks;
  for (std::size_t i = 0; i < block_layouts_.size(); ++i) blocks.push_back(gather_block(i, /*own_dtype=*/true));
  if (write_back) {
    // Released first (it holds the blocks until it is done): each shard takes its slice of the
    // gathered buffer, which the writes went into through the parameters' views.
    g.held_.push_back(std::shared_ptr<void>(nullptr, [this, blocks](void*) {
      try {
        NoGradGuard no_grad;
        const int64_t r = group_->rank();
        for (std::size_t i = 0; i < blocks.size(); ++i) {
          const auto* gb = static_cast<const GatheredBlock*>(blocks[i].get());
          for (std::size_t j = 0; j < block_layouts_[i].size(); ++j) {
            Layout& l = layouts_[block_layouts_[i][j]];
            l.shard_param.copy_(gb->fulls[j].narrow(0, r * l.shard, l.shard));
          }
        }
      } catch (...) {  // a copy between tensors of one shape and dtype on one device does not fail
      }
    }));
  }
  for (auto& b : blocks) g.held_.push_back(std::move(b));
  return g;
}

double ZeroRedundancyOptimizer::grad_norm() {
  const char* op = "ZeroRedundancyOptimizer.grad_norm";
  FLAME_CHECK(reducer_ != nullptr, op, "the gradients are sharded only with stage 2; with stage 1 take the norm "
              "of the local gradients' average (flame::clip_grad_norm_ after DistributedDataParallel)");
  finish_reductions();
  NoGradGuard no_grad;
  Tensor sq = Tensor::zeros({1}, TensorOptions(DType::f32, group_->device()));
  for (const auto& bk : reducer_->buckets) {
    if (bk.shard_grad.defined()) sq = sq + bk.shard_grad.to(DType::f32).pow(2.0).sum().reshape({1});
  }
  group_->all_reduce(sq, ReduceOp::sum);  // the padding is zero: the shards add up to the whole
  return std::sqrt(sq.to(Device::cpu()).item<double>());
}

double ZeroRedundancyOptimizer::clip_grad_norm(double max_norm) {
  const double norm = grad_norm();
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1.0) {
    NoGradGuard no_grad;
    for (auto& bk : reducer_->buckets) {
      if (bk.shard_grad.defined()) bk.shard_grad.mul_(scale);
    }
  }
  return norm;
}

ZeroRedundancyOptimizer::MemoryReport ZeroRedundancyOptimizer::memory_report() const {
  MemoryReport r;
  if (reducer_) {
    for (const auto& bk : reducer_->buckets) r.gradient_bytes += bk.shard_grad.defined() ? bk.shard_grad.nbytes() : 0;
  }
  for (const Layout& l : layouts_) r.parameter_bytes += l.block >= 0 ? l.shard_param.nbytes() : l.flat_param.nbytes();
  const StateDict inner = inner_->state_dict();
  for (std::size_t g = 0; g < layouts_.size(); ++g) {
    r.param_numel += layouts_[g].numel;
    r.shard_numel += layouts_[g].shard;
  }
  for (const Layout& l : layouts_) r.host_bytes += l.host_master.defined() ? l.host_master.nbytes() : 0;
  for (const auto& [k, t] : inner) {
    if (k.rfind("state.", 0) != 0) continue;
    if (t.device().is_cpu() && options_.offload_state) {
      r.host_bytes += t.nbytes();
      continue;
    }
    r.state_bytes += t.nbytes();
    bool sharded = false;
    for (const Layout& l : layouts_) sharded = sharded || t.numel() == l.shard;
    r.full_state_bytes_estimate += sharded ? t.nbytes() * static_cast<std::size_t>(group_->size()) : t.nbytes();
  }
  return r;
}

}  // namespace flame::dist
