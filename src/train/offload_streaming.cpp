// Weight streaming: offload::StreamedBlocks (include/flame/offload.h, docs/offload.md).
//
// Note [Weight streaming]
// Each block's parameters and buffers stay the host tensors the user registered (pinned for a
// CUDA device). To run block i on the device:
//  - Upload: under a StreamGuard of the side stream, each host tensor is copied with one
//    non-blocking copy (pinned -> device) into a fresh device tensor allocated on the side stream,
//    then an event `ready` is recorded there. acquire() makes the compute stream wait for `ready`
//    and records each copy on the compute stream (record_stream), so when the Upload is dropped
//    after the block ran, its memory returns to the pool only once the compute stream passed the
//    block (Note [Record stream]). Nothing waits on the host.
//  - Swap: the block's modules read their parameters through the host handles, so for the run the
//    handles are rebound to the device copies with Tensor::set_data (the same TensorImpl: ops record
//    the host parameters as the leaves), and rebound to the host data afterwards (also on error).
//  - Prefetch: forward acquires block i and then uploads block i+1 on the side stream while block
//    i's kernels run; after the last block it uploads the last block again for backward. Backward
//    of block i acquires it (prefetched) and uploads block i-1. Stale copies cannot be used: every
//    forward first drops the uploads left over (the host weights may have changed since).
//  - Autograd: a block's forward runs with recording off; one node per block (its edges: the
//    block input and the trainable host parameters) recomputes the block in backward with the
//    device copies bound and recording on (generator state restored, as checkpoint() does), runs
//    an inner backward for the input and the parameters, and returns the parameter gradients as
//    pinned host tensors (non-blocking copies, then one wait on an event: the only host wait of
//    a step, once per block). The node saves only the block input (a SavedTensor, so activation
//    offload applies to it).
// One thread drives a StreamedBlocks at a time.
//
// Note [Block swapping]
// offload::BlockSwap moves only the frozen tensors of the swapped blocks (the trainable adapters
// stay on the device, their gradients go to the store as usual), with the same Upload and Swap as
// above. A swapped block runs through checkpoint_scoped (src/autograd/checkpoint_scope.h): the
// scope acquires the block's upload and binds it for the first forward, and again for the
// recompute and its inner backward, which flame::checkpoint's node runs; the checkpoint machinery
// (captured adapters, generator and autocast state) is the ordinary one. Prefetch follows the
// order of use: while block i runs in forward (resident or swapped) the next swapped block after
// i is uploaded, after the last block the last swapped block is uploaded for backward, and the
// backward of swapped block j uploads the swapped block before j. At most two swapped blocks'
// copies are on the device at a time (the one running and the one prefetched).
#include <algorithm>
#include <cstdio>
#include <optional>
#include <sstream>
#include <utility>

#include "flame/cuda.h"
#include "flame/offload.h"
#include "flame/random.h"
#include "src/autograd/checkpoint_scope.h"
#include "src/autograd/record.h"
#include "src/core/tensor_impl.h"

namespace flame::offload {

namespace {
struct Upload {
  TensorList params;   // device copies, in the order of the block's host parameters
  TensorList buffers;
  cuda::Event ready;   // recorded on the side stream after the copies (CUDA only)
  bool prefetched = false;
};

// Rebinds host handles to device copies for a scope (Note [Weight streaming]).
class Swap {
 public:
  Swap(const TensorList& handles, const TensorList& data) : handles_(handles) {
    host_.reserve(handles.size());
    try {
      for (std::size_t k = 0; k < handles.size(); ++k) {
        host_.push_back(handles[k].detach());
        Tensor h = handles[k];
        h.set_data(data[k]);
      }
    } catch (...) {
      restore();
      throw;
    }
  }
  ~Swap() { restore(); }
  Swap(const Swap&) = delete;
  Swap& operator=(const Swap&) = delete;

 private:
  void restore() noexcept {
    for (std::size_t k = 0; k < host_.size(); ++k) {
      try {
        Tensor h = handles_[k];
        h.set_data(host_[k]);
      } catch (...) {  // set_data on a tensor it accepted before cannot fail
      }
    }
    host_.clear();
  }
  const TensorList& handles_;
  TensorList host_;
};

// The uploads of a stack of blocks (Note [Weight streaming]): per block, at most one upload
// started ahead of its use. A block's tensors are its params and buffers lists (BlockSwap: its
// frozen tensors as params, no buffers).
struct Uploader {
  Device device;
  bool prefetch_on = true;
  std::optional<cuda::Stream> side;
  std::vector<std::shared_ptr<Upload>> pending;
  int64_t uploads = 0;
  int64_t prefetched_uploads = 0;

  void init(Device d, bool prefetch, std::size_t blocks) {
    device = d;
    prefetch_on = prefetch;
    pending.assign(blocks, nullptr);
  }
  // Starts copying the tensors to the device (on the side stream for CUDA; clones on the CPU).
  std::shared_ptr<Upload> upload(const TensorList& params, const TensorList& buffers) {
    auto u = std::make_shared<Upload>();
    NoGradGuard no_grad;
    auto copy = [&](const Tensor& t) { return device.is_cpu() ? t.detach().clone() : t.detach().to(device, true); };
    std::optional<cuda::StreamGuard> guard;
    if (device.is_cuda()) {
      if (!side) side = cuda::Stream::create(device.index);
      guard.emplace(*side);
    }
    for (const Tensor& p : params) u->params.push_back(copy(p));
    for (const Tensor& t : buffers) u->buffers.push_back(copy(t));
    if (device.is_cuda()) u->ready.record(*side);
    ++uploads;
    return u;
  }
  void prefetch(std::size_t i, const TensorList& params, const TensorList& buffers) {
    if (!prefetch_on || pending[i]) return;
    pending[i] = upload(params, buffers);
    pending[i]->prefetched = true;
    ++prefetched_uploads;
  }
  // Block i's device copies, ready for work queued on the current stream from now on.
  std::shared_ptr<Upload> acquire(std::size_t i, const TensorList& params, const TensorList& buffers) {
    std::shared_ptr<Upload> u = std::move(pending[i]);
    pending[i] = nullptr;
    if (!u) u = upload(params, buffers);
    if (device.is_cuda()) {
      const cuda::Stream compute = cuda::Stream::current(device.index);
      compute.wait(u->ready);
      for (const Tensor& t : u->params) cuda::record_stream(t, compute);
      for (const Tensor& t : u->buffers) cuda::record_stream(t, compute);
    }
    return u;
  }
  void drop() {
    for (auto& p : pending) p = nullptr;
  }
};
}  // namespace

struct StreamedBlocks::State {
  struct Block {
    nn::ModulePtr module;
    TensorList params;
    TensorList buffers;
  };
  std::vector<Block> blocks;
  Device device;
  StreamedBlocksOptions options;
  Uploader up;

  void prefetch(std::size_t i) {
    if (i < blocks.size()) up.prefetch(i, blocks[i].params, blocks[i].buffers);
  }
  std::shared_ptr<Upload> acquire(std::size_t i) { return up.acquire(i, blocks[i].params, blocks[i].buffers); }

  Tensor run(std::size_t i, const Upload& u, const Tensor& x) {
    const Block& b = blocks[i];
    Swap sp(b.params, u.params);
    Swap sb(b.buffers, u.buffers);
    return b.module->forward(x);
  }

  // The backward of block i (Note [Weight streaming]): gradients for x (when wanted) and for
  // each trainable parameter, in the node's edge order.
  TensorList backward(std::size_t i, const Tensor& x, bool x_grad, const std::vector<std::size_t>& trainable,
                      const Generator::State& rng, const Tensor& grad) {
    std::shared_ptr<Upload> u = acquire(i);
    if (i > 0) prefetch(i - 1);
    const Block& b = blocks[i];
    TensorList grads;
    TensorList device_grads;
    Tensor xin;
    {
      autograd_detail::RecomputeScope recompute(default_generator(), rng);
      Swap sp(b.params, u->params);
      Swap sb(b.buffers, u->buffers);
      xin = x_grad ? x.detach().requires_grad_(true) : x.detach();
      Tensor y = b.module->forward(xin);
      BackwardOptions opts;
      opts.grad_output = grad;
      if (x_grad) opts.inputs.push_back(xin);
      for (std::size_t k : trainable) opts.inputs.push_back(b.params[k]);
      if (y.requires_grad()) {
        Gradients gs = y.backward(opts);
        if (x_grad) grads.push_back(gs.try_get(xin));
        for (std::size_t k : trainable) device_grads.push_back(gs.try_get(b.params[k]));
      } else {
        if (x_grad) grads.push_back(Tensor());
        device_grads.resize(trainable.size());
      }
    }
    // Parameter gradients to the host (the parameters' device): pinned copies, one wait.
    NoGradGuard no_grad;
    for (Tensor& dg : device_grads) {
      grads.push_back(dg.defined() ? (device.is_cpu() ? dg : dg.to(Device::cpu(), /*non_blocking=*/true)) : Tensor());
    }
    if (device.is_cuda()) {
      cuda::Event copied;
      copied.record(cuda::Stream::current(device.index));
      copied.synchronize();
    }
    return grads;
  }
};

StreamedBlocks::StreamedBlocks(std::vector<nn::ModulePtr> blocks, Device device, StreamedBlocksOptions options)
    : state_(std::make_shared<State>()) {
  state_->device = device;
  state_->options = options;
  state_->up.init(device, options.prefetch, blocks.size());
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    FLAME_CHECK(blocks[i] != nullptr, "offload::StreamedBlocks", "block ", i, " is null");
    register_module(std::to_string(i), blocks[i]);
    State::Block b{blocks[i], blocks[i]->parameters(), blocks[i]->buffers()};
    // Host residence: every tensor of a block moves to the CPU (pinned for a CUDA device), keeping
    // its identity (set_data), so optimizers and state dicts see the same tensors as before.
    NoGradGuard no_grad;
    for (TensorList* list : {&b.params, &b.buffers}) {
      for (Tensor& t : *list) {
        Tensor host = t.detach().to(Device::cpu());
        if (device.is_cuda() && !host.is_pinned()) host = host.pin_memory();
        if (!host.shares_storage(t)) t.set_data(host.detach());
      }
    }
    state_->blocks.push_back(std::move(b));
  }
}

namespace {
std::vector<nn::ModulePtr> children_of(const nn::ModuleList& list) {
  std::vector<nn::ModulePtr> out;
  for (std::size_t i = 0; i < list.size(); ++i) out.push_back(list[i]);
  return out;
}
}  // namespace

StreamedBlocks::StreamedBlocks(const nn::ModuleList& blocks, Device device, StreamedBlocksOptions options)
    : StreamedBlocks(children_of(blocks), device, options) {}

StreamedBlocks::~StreamedBlocks() = default;

std::string StreamedBlocks::extra_repr() const {
  std::ostringstream os;
  os << "blocks=" << state_->blocks.size() << ", device=" << state_->device.str()
     << ", prefetch=" << (state_->options.prefetch ? "true" : "false");
  return os.str();
}

std::size_t StreamedBlocks::size() const { return state_->blocks.size(); }
nn::ModulePtr StreamedBlocks::block(std::size_t i) const {
  FLAME_CHECK(i < state_->blocks.size(), "offload::StreamedBlocks", "block ", i, " out of range (",
              state_->blocks.size(), " blocks)");
  return state_->blocks[i].module;
}
Device StreamedBlocks::device() const { return state_->device; }
int64_t StreamedBlocks::uploads() const { return state_->up.uploads; }
int64_t StreamedBlocks::prefetched_uploads() const { return state_->up.prefetched_uploads; }

Tensor StreamedBlocks::forward(const Tensor& x) {
  FLAME_CHECK(x.defined(), "offload::StreamedBlocks", "undefined input");
  State& s = *state_;
  FLAME_CHECK(x.device() == s.device, "offload::StreamedBlocks", "the input is on ", x.device().str(),
              " but the blocks run on ", s.device.str());
  s.up.drop();  // drop stale uploads: the host weights may have changed
  Tensor h = x;
  const std::size_t n = s.blocks.size();
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<std::size_t> trainable;
    for (std::size_t k = 0; k < s.blocks[i].params.size(); ++k) {
      if (s.blocks[i].params[k].requires_grad()) trainable.push_back(k);
    }
    const bool x_grad = h.requires_grad();
    const bool record = grad_enabled() && (x_grad || !trainable.empty());
    const Generator::State rng = default_generator().get_state();
    std::shared_ptr<Upload> u = s.acquire(i);
    s.prefetch(i + 1);
    Tensor out;
    {
      NoGradGuard no_grad;
      out = s.run(i, *u, h).detach();
    }
    u.reset();  // the copies go back to the pool once the compute stream is past this block
    if (record) {
      TensorList edges;
      if (x_grad) edges.push_back(h);
      for (std::size_t k : trainable) edges.push_back(s.blocks[i].params[k]);
      SavedTensor saved_x(h, "StreamedBlock");
      std::shared_ptr<State> state = state_;
      flame::record(out, "StreamedBlock", edges, [state, i, saved_x, x_grad, trainable, rng](const Tensor& g) {
        return state->backward(i, saved_x.get(), x_grad, trainable, rng, g);
      });
    }
    h = out;
  }
  if (grad_enabled() && h.requires_grad() && n > 0) s.prefetch(n - 1);  // backward starts there
  return h;
}

// ---- block swapping (Note [Block swapping]) ----

struct BlockSwap::State {
  struct Block {
    nn::ModulePtr module;
    TensorList frozen;  // parameters that do not require grad, then buffers
    std::size_t bytes = 0;
    bool swapped = false;
  };
  // A swapped block bound to its device copies for a scope.
  struct Bound {
    std::shared_ptr<Upload> upload;
    Swap swap;
    Bound(std::shared_ptr<Upload> u, const TensorList& handles) : upload(std::move(u)), swap(handles, upload->params) {}
  };
  std::vector<Block> blocks;
  Device device;
  BlockSwapOptions options;
  Uploader up;

  void prefetch(std::optional<std::size_t> i) {
    if (i) up.prefetch(*i, blocks[*i].frozen, {});
  }
  std::shared_ptr<Upload> acquire(std::size_t i) { return up.acquire(i, blocks[i].frozen, {}); }
  std::optional<std::size_t> next_swapped(std::size_t from) const {
    for (std::size_t j = from; j < blocks.size(); ++j) {
      if (blocks[j].swapped) return j;
    }
    return std::nullopt;
  }
  std::optional<std::size_t> previous_swapped(std::size_t before) const {
    for (std::size_t j = before; j-- > 0;) {
      if (blocks[j].swapped) return j;
    }
    return std::nullopt;
  }
  // Block i bound to its device copies; the next upload in the direction of use is started.
  std::shared_ptr<void> enter(std::size_t i, bool backward) {
    auto u = acquire(i);
    prefetch(backward ? previous_swapped(i) : next_swapped(i + 1));
    return std::make_shared<Bound>(std::move(u), blocks[i].frozen);
  }
  void check_index(std::size_t i) const {
    FLAME_CHECK(i < blocks.size(), "offload::BlockSwap", "block ", i, " out of range (", blocks.size(), " blocks)");
  }
};

BlockSwap::BlockSwap(std::vector<nn::ModulePtr> blocks, Device device, BlockSwapOptions options)
    : state_(std::make_shared<State>()) {
  state_->device = device;
  state_->options = options;
  state_->up.init(device, options.prefetch, blocks.size());
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    FLAME_CHECK(blocks[i] != nullptr, "offload::BlockSwap", "block ", i, " is null");
    State::Block b;
    b.module = blocks[i];
    for (const Tensor& p : blocks[i]->parameters()) {
      if (!p.requires_grad()) b.frozen.push_back(p);
    }
    for (const Tensor& t : blocks[i]->buffers()) b.frozen.push_back(t);
    for (const Tensor& t : b.frozen) {
      FLAME_CHECK(t.impl()->base == nullptr, "offload::BlockSwap", "block ", i, " has a frozen tensor (shape ",
                  t.sizes(), ") that is a view of another tensor; swapping rebinds each tensor's data, so it must "
                  "own its storage (register a contiguous copy)");
      FLAME_CHECK(t.device() == device, "offload::BlockSwap", "block ", i, " has a frozen tensor (shape ",
                  t.sizes(), ") on ", t.device().str(), "; move the blocks to ", device.str(), " first");
      b.bytes += t.nbytes();
    }
    state_->blocks.push_back(std::move(b));
  }
}

BlockSwap::~BlockSwap() = default;

std::size_t BlockSwap::size() const { return state_->blocks.size(); }
Device BlockSwap::device() const { return state_->device; }

std::size_t BlockSwap::frozen_bytes(std::size_t i) const {
  state_->check_index(i);
  return state_->blocks[i].bytes;
}

std::vector<std::size_t> BlockSwap::frozen_bytes() const {
  std::vector<std::size_t> out;
  for (const auto& b : state_->blocks) out.push_back(b.bytes);
  return out;
}

bool BlockSwap::swapped(std::size_t i) const {
  state_->check_index(i);
  return state_->blocks[i].swapped;
}

void BlockSwap::set_swapped(const std::vector<bool>& swapped) {
  State& s = *state_;
  FLAME_CHECK(swapped.size() == s.blocks.size(), "offload::BlockSwap::set_swapped", "got ", swapped.size(),
              " flags for ", s.blocks.size(), " blocks");
  s.up.drop();
  NoGradGuard no_grad;
  for (std::size_t i = 0; i < s.blocks.size(); ++i) {
    State::Block& b = s.blocks[i];
    if (s.device.is_cuda()) {  // on a CPU device the host copies are the tensors themselves
      // All of a block's copies first: an allocation that fails (out of memory under a budget)
      // leaves this block as it was and the ones before it moved, each consistent with its flag.
      const Device to = swapped[i] ? Device::cpu() : s.device;
      TensorList data;
      for (const Tensor& t : b.frozen) {
        if (t.device() == to) {
          data.push_back(Tensor());
        } else {
          data.push_back(swapped[i] ? t.detach().to(Device::cpu()).pin_memory() : t.detach().to(s.device));
        }
      }
      for (std::size_t k = 0; k < b.frozen.size(); ++k) {
        if (data[k].defined()) b.frozen[k].set_data(data[k]);
      }
    }
    b.swapped = swapped[i];
  }
}

Tensor BlockSwap::run(std::size_t i, const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs,
                      bool checkpoint) {
  State& s = *state_;
  s.check_index(i);
  if (i == 0) {
    s.up.drop();  // a new forward: drop uploads a forward without backward left
  }
  Tensor out;
  if (!s.blocks[i].swapped) {
    s.prefetch(s.next_swapped(i + 1));  // overlaps this block
    out = checkpoint && grad_enabled() ? flame::checkpoint(fn, inputs) : fn(inputs);
  } else if (!grad_enabled()) {
    const std::shared_ptr<void> bound = s.enter(i, false);
    out = fn(inputs);
  } else {
    std::shared_ptr<State> state = state_;
    out = autograd_detail::checkpoint_scoped(fn, inputs, nullptr,
                                             [state, i](bool backward) { return state->enter(i, backward); });
  }
  if (i + 1 == s.blocks.size() && grad_enabled()) s.prefetch(s.previous_swapped(s.blocks.size()));  // backward
  return out;
}

BlockSwapReport BlockSwap::report() const {
  BlockSwapReport r;
  r.blocks = state_->blocks.size();
  for (const auto& b : state_->blocks) {
    if (b.swapped) {
      ++r.swapped;
      r.swapped_bytes += b.bytes;
      r.largest_swapped = std::max(r.largest_swapped, b.bytes);
    } else {
      r.resident_bytes += b.bytes;
    }
  }
  r.uploads = state_->up.uploads;
  r.prefetched_uploads = state_->up.prefetched_uploads;
  return r;
}

namespace {
std::string mib(std::size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}
}  // namespace

std::string BlockSwapReport::str() const {
  std::ostringstream os;
  os << swapped << " of " << blocks << " blocks swapped (" << mib(swapped_bytes) << " of frozen weights in host memory, "
     << mib(resident_bytes) << " resident on the device";
  if (swapped > 0) os << ", largest swapped block " << mib(largest_swapped);
  os << ")";
  if (uploads > 0) os << ", " << uploads << " uploads (" << prefetched_uploads << " prefetched)";
  return os.str();
}

std::vector<bool> spread_blocks(std::size_t n, std::size_t k) {
  FLAME_CHECK(k <= n, "offload::spread_blocks", "cannot choose ", k, " of ", n, " blocks");
  std::vector<bool> out(n, false);
  for (std::size_t j = 0; j < k; ++j) out[std::min(n - 1, (2 * j + 1) * n / (2 * k))] = true;
  return out;
}

std::vector<bool> plan_block_swap(const std::vector<std::size_t>& block_bytes, std::size_t capacity) {
  const std::size_t n = block_bytes.size();
  std::size_t total = 0;
  for (std::size_t b : block_bytes) total += b;
  for (std::size_t k = 0; k <= n; ++k) {
    const std::vector<bool> swap = spread_blocks(n, k);
    std::size_t swapped = 0, largest = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (!swap[i]) continue;
      swapped += block_bytes[i];
      largest = std::max(largest, block_bytes[i]);
    }
    const std::size_t in_flight = largest * std::min<std::size_t>(k, 2);
    if (total - swapped + in_flight <= capacity) return swap;
  }
  std::size_t largest = 0;
  for (std::size_t b : block_bytes) largest = std::max(largest, b);
  FLAME_FAIL("offload::plan_block_swap", "the blocks do not fit ", mib(capacity), " even with all ", n,
             " swapped: two blocks' frozen tensors (the largest is ", mib(largest),
             ") must be on the device at a time; raise the budget or make the blocks smaller (8-bit weights, "
             "docs/float8.md)");
}

}  // namespace flame::offload
