// Autocast: thread-local scopes, the op policy hook, the cast cache.
//
// Note [Autocast policy]
// Autocast is decided per op, at the op function (src/ops/*.cpp, nn::functional::linear), never
// inside modules, so functional calls get it too. Three classes, after PyTorch's CUDA lists:
//  - low precision (the guard's bf16/f16): matmul, bmm, linear, conv1d/2d/3d,
//    conv_transpose1d/2d/3d, scaled_dot_product_attention. Every floating input except f64 is
//    cast to the low dtype (a float attention mask too; bool masks are left alone).
//  - f32: exp, expm1, log, log1p, reciprocal, rsqrt, pow, softplus, logsumexp, norm, softmax,
//    log_softmax, sum, prod, cumsum, the losses (mse, l1, nll, cross_entropy,
//    binary_cross_entropy_with_logits) and the norms (layer_norm, group_norm, rms_norm,
//    batch_norm). bf16/f16 inputs are cast up, so the result is f32 (PyTorch's fp32 and
//    fp32_set_opt_dtype lists). cross_entropy over [N, C] keeps its fused kernel, which already
//    computes in float from half logits, and returns the f32 loss without the cast-up copy.
//    Norms follow PyTorch (f32 out) rather than running FLAME's half-IO kernels: their
//    statistics are float either way, but FLAME's norm kernels take weight/bias in the input's
//    dtype, so a bf16 input with f32 affine parameters would need the parameters cast down (less
//    precise affine, and batch_norm's running statistics could no longer be updated in place).
//    In a pre-norm transformer the residual stream is f32 anyway, so this costs nothing there.
//  - everything else runs in its inputs' dtypes under the usual promotion (add of a bf16 and an
//    f32 tensor is f32, as in PyTorch).
// An op on the lists runs its body under AutocastOpScope: whatever it calls (cross_entropy's
// log_softmax, the attention math path's matmul and softmax) sees the dtypes it was given and
// does not cast again. f64 tensors are never cast (PyTorch's eligibility rule).
//
// Note [Autocast cast cache]
// A weight used by several ops in one forward pass (or a tied embedding) is cast once: a cast of
// a leaf that requires grad (f32 -> low dtype) is kept in a thread-local cache until the
// outermost AutocastGuard of the thread is destroyed. The cast is a recorded op, so gradients
// flow back to the f32 leaf and arrive in f32. An entry is reused only while it is still valid:
// same storage version (an in-place update of the weight inside the scope makes a new cast),
// same grad mode (a cast made under no-grad has no graph), and its node not yet released by a
// backward (a second forward inside one scope after backward, e.g. gradient accumulation, gets a
// fresh cast). Casts of anything else (activations, buffers, frozen weights) are not cached.
// Autocast is off in backward (the engine runs rules and hooks under AutocastOffGuard);
// checkpoint() recomputes its forward under the autocast state it first ran with.
//
// Note [Kept low-precision copies]
// The scope cache still casts every weight once per step, ~130 small kernels in a DiT step. A
// master weight (an f32 leaf that requires grad, read by linear's master path: Note
// [Master-weight epilogues] in src/ops/linear_epilogue.cpp) instead keeps its bf16/f16 copy
// across steps (AutogradMeta::low_copy), and the fused optimizers write it in the same pass that
// updates the weight (OptimTensor::low), so the next forward casts nothing. The copy records the
// weight's storage and version when it was made equal to the weight:
//  - master_low_copy: equal -> returned as is; the weight changed since (an in-place edit, a
//    load, an optimizer without a fused kernel) -> rewritten in place first; none yet -> made,
//    except during a CUDA graph capture (its memory would be graph-private), which then takes the
//    scope cache's cast. Rewriting in place bumps the copy's version, so a graph saved before
//    that raises in backward rather than reading the new values.
//  - a fused optimizer step passes the copy to its kernel, then marks it equal after bumping the
//    weight's version (low_copy_for_update / low_copy_updated); the copy's own version is bumped
//    too.
//  - a captured graph that reads a kept copy replays no cast, so a replay must find it equal to
//    the weight: the capture registers a replay prologue per copy (random_detail::GraphRng) that
//    rewrites it first when the weight's host-side version moved since (eager edits between
//    replays). Inside the graph, its own optimizer keeps the two equal.
//  - a replay updates weights without running the host code that bumps their versions, so a
//    captured optimizer step registers a replay epilogue per weight that does (and marks the copy
//    its kernel wrote): a copy made after the capture, which the graph does not write, is then
//    seen as stale by the next eager forward instead of being read.
//  - one mutex guards the copies' bookkeeping (threads may share weights); the kernels that write
//    and read a copy are ordered as the weight's own are (the caller's streams).
//  - a no-grad cast of such a weight (evaluation under autocast) uses the copy when it is equal,
//    and the scope cache otherwise; only the master path makes or rewrites copies.
// The copy is the same rounding of the same f32 values as the cast it replaces, so results are
// bit-identical. It costs half the weight's bytes for the weight's lifetime (the scope cache held
// the same bytes through every forward and backward).
#include "src/amp/autocast.h"

#include <mutex>
#include <unordered_map>

#include "flame/amp.h"
#include "flame/autograd.h"
#include "src/autograd/node.h"
#include "src/autograd/recompute.h"
#include "src/autograd/record.h"
#include "src/core/tensor_impl.h"
#include "src/backend/graph_rng.h"

namespace flame::amp {
namespace detail {

thread_local uint32_t t_enabled_mask = 0;
thread_local int32_t t_excluded = 0;

namespace {

constexpr int kDeviceTypes = 2;  // cpu, cuda

struct CacheKey {
  const TensorImpl* impl;
  DType dtype;
  bool operator==(const CacheKey& o) const { return impl == o.impl && dtype == o.dtype; }
};
struct CacheKeyHash {
  std::size_t operator()(const CacheKey& k) const {
    return std::hash<const void*>()(k.impl) ^ (static_cast<std::size_t>(k.dtype) * 0x9e3779b97f4a7c15ull);
  }
};
struct CacheEntry {
  Tensor source;  // keeps the key's TensorImpl alive, so its address is not reused meanwhile
  Tensor cast;
  uint64_t version = 0;
  bool grad_mode = false;
};

struct ThreadState {
  DType dtype[kDeviceTypes] = {DType::bf16, DType::bf16};
  int nesting = 0;
  std::unordered_map<CacheKey, CacheEntry, CacheKeyHash> cache;
  uint64_t hits = 0, misses = 0;
  uint64_t low_copy_hits = 0, low_copy_writes = 0;
};

ThreadState& state() {
  thread_local ThreadState s;
  return s;
}

bool eligible(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

bool node_released(const Tensor& t) {
  const auto& meta = t.impl()->autograd;
  return meta && meta->grad_fn && meta->grad_fn->released();
}

const void* storage_of(const Tensor& x) { return x.impl()->storage.get(); }

// Guards every AutogradMeta::low_copy and LowCopy (threads may share weights).
std::mutex& low_copy_mutex() {
  static std::mutex m;
  return m;
}

// x's kept copy when it has one of dtype `to` in x's layout (equal to x or not).
LowCopy* kept_copy(const Tensor& x, DType to) {
  const auto& meta = x.impl()->autograd;
  LowCopy* k = meta ? meta->low_copy.get() : nullptr;
  if (k == nullptr || k->copy.dtype() != to || k->copy.device() != x.device() || k->copy.sizes() != x.sizes() ||
      k->copy.strides() != x.strides())
    return nullptr;
  return k;
}

bool equal_to(const LowCopy& k, const Tensor& x) { return k.storage == storage_of(x) && k.version == x.version(); }

// Makes k equal to x (in place: a captured graph may read k's memory).
void rewrite(LowCopy& k, const Tensor& x) {
  NoGradGuard no_grad;
  k.copy.copy_(x);
  k.storage = storage_of(x);
  k.version = x.version();
}

// The graph capturing on this thread for x's device, or nullptr.
random_detail::GraphRng* capturing_graph(const Tensor& x) {
  random_detail::GraphRng* g = random_detail::current_graph_rng();
  return g != nullptr && x.device().is_cuda() && g->device() == x.device().index ? g : nullptr;
}

Tensor cached_cast(const Tensor& x, DType to) {
  ThreadState& s = state();
  const bool cacheable = s.nesting > 0 && x.dtype() == DType::f32 && x.requires_grad() && x.is_leaf();
  if (!cacheable) return x.to(to);
  const bool grad_mode = grad_enabled();
  if (!grad_mode && capturing_graph(x) == nullptr) {
    std::lock_guard<std::mutex> lock(low_copy_mutex());
    if (LowCopy* k = kept_copy(x, to); k != nullptr && equal_to(*k, x)) {
      ++s.low_copy_hits;
      (void)needs_grad({x});
      return k->copy;
    }
  }
  const CacheKey key{x.impl(), to};
  auto it = s.cache.find(key);
  if (it != s.cache.end()) {
    CacheEntry& e = it->second;
    if (e.version == x.version() && e.grad_mode == grad_mode && !node_released(e.cast)) {
      ++s.hits;
      // A hit reads x as the cast would: a checkpointed function's first (no-grad) forward must
      // still report it (Note [Checkpoint captures] in functions.cpp).
      (void)needs_grad({x});
      return e.cast;
    }
  }
  Tensor cast = x.to(to);
  ++s.misses;
  s.cache.insert_or_assign(key, CacheEntry{x, cast, x.version(), grad_mode});
  return cast;
}

}  // namespace

DType low_dtype(const Tensor& x) { return state().dtype[static_cast<int>(x.device().type)]; }

Tensor master_low_copy(const Tensor& w) {
  if (!w.defined() || w.dtype() != DType::f32 || !w.requires_grad() || !w.is_leaf() ||
      !is_non_overlapping_and_dense(w))
    return cast_low(w);
  const DType to = low_dtype(w);
  ThreadState& s = state();
  (void)needs_grad({w});  // a checkpoint's collector sees the read whichever way it goes
  random_detail::GraphRng* graph = capturing_graph(w);
  {
    std::lock_guard<std::mutex> lock(low_copy_mutex());
    auto& meta = w.impl()->autograd;
    LowCopy* k = kept_copy(w, to);
    if (k == nullptr && graph == nullptr) {
      NoGradGuard no_grad;
      auto made = std::make_shared<LowCopy>();
      made->copy = make_empty_in_layout_of(w, to, w.device(), "autocast");
      rewrite(*made, w);
      meta->low_copy = made;
      ++s.low_copy_writes;
      return made->copy;
    }
    if (k != nullptr) {
      if (equal_to(*k, w)) {
        ++s.low_copy_hits;
      } else {
        rewrite(*k, w);
        ++s.low_copy_writes;
      }
      if (graph != nullptr) {
        graph->add_replay_hook(random_detail::GraphRng::When::before, k, [w, keep = meta->low_copy] {
          std::lock_guard<std::mutex> hook_lock(low_copy_mutex());
          if (!equal_to(*keep, w)) rewrite(*keep, w);
        });
      }
      return k->copy;
    }
  }
  return cast_low(w);  // capturing, and no kept copy yet: the scope cache's cast, inside the graph
}

Tensor low_copy_for_update(const Tensor& w) {
  if (!w.defined() || w.dtype() != DType::f32 || !w.impl()->autograd) return Tensor();
  std::lock_guard<std::mutex> lock(low_copy_mutex());
  const LowCopy* k = w.impl()->autograd->low_copy.get();
  if (k == nullptr || kept_copy(w, k->copy.dtype()) != k || k->storage != storage_of(w)) return Tensor();
  return k->copy;
}

void drop_low_copy(const Tensor& w) {
  if (!w.defined() || !w.impl()->autograd) return;
  std::shared_ptr<LowCopy> gone;  // released after the lock
  std::lock_guard<std::mutex> lock(low_copy_mutex());
  gone = std::move(w.impl()->autograd->low_copy);
}

namespace {
// Marks w's kept copy equal to w when it is `written` (the copy an update wrote beside w).
void mark_written(const Tensor& w, const Tensor& written) {
  if (!written.defined()) return;
  std::lock_guard<std::mutex> lock(low_copy_mutex());
  const auto& meta = w.impl()->autograd;
  LowCopy* k = meta ? meta->low_copy.get() : nullptr;
  if (k == nullptr || k->copy.impl() != written.impl()) return;
  k->storage = storage_of(w);
  k->version = w.version();
  bump_version(k->copy);
}
}  // namespace

void low_copy_updated(const Tensor& w, const Tensor& written) {
  mark_written(w, written);
  random_detail::GraphRng* graph = capturing_graph(w);
  if (graph == nullptr) return;
  // Each replay updates w again without this host code: advance w's version as the eager step
  // did (so kept copies, and graphs that saved w, see the change), and mark the copy the captured
  // kernel writes, when that is still w's copy.
  graph->add_replay_hook(random_detail::GraphRng::When::after, w.impl(), [w, written] {
    bump_version(w);
    mark_written(w, written);
  });
}

Tensor cast_low(const Tensor& x) {
  if (!x.defined() || !eligible(x.dtype())) return x;
  const DType to = low_dtype(x);
  if (x.dtype() == to) return x;
  return cached_cast(x, to);
}

Tensor cast_f32(const Tensor& x) {
  if (!x.defined() || (x.dtype() != DType::bf16 && x.dtype() != DType::f16)) return x;
  Tensor y = x.to(DType::f32);
  // Under autograd::RecomputeCheap the f32 copy a norm computes on (and its node saves) is kept as
  // the bf16/f16 input and cast again in the backward: exact, and half the bytes (Note [Recompute
  // cheap], "Chains", in src/autograd/recompute.cpp).
  if (autograd_detail::should_mark_recomputable()) {
    autograd_detail::mark_recomputable(y, "autocast", {x}, [](const TensorList& in) { return in[0].to(DType::f32); });
  }
  return y;
}

AutocastState autocast_state() {
  const ThreadState& s = state();
  return AutocastState{t_enabled_mask, {s.dtype[0], s.dtype[1]}};
}

AutocastStateGuard::AutocastStateGuard(const AutocastState& st)
    : saved_(autocast_state()), saved_excluded_(t_excluded) {
  ThreadState& s = state();
  ++s.nesting;
  t_enabled_mask = st.mask;
  t_excluded = 0;
  for (int d = 0; d < kDeviceTypes; ++d) s.dtype[d] = st.dtype[d];
}

AutocastStateGuard::~AutocastStateGuard() {
  ThreadState& s = state();
  t_enabled_mask = saved_.mask;
  t_excluded = saved_excluded_;
  for (int d = 0; d < kDeviceTypes; ++d) s.dtype[d] = saved_.dtype[d];
  if (--s.nesting == 0) clear_autocast_cache();
}

}  // namespace detail

using detail::state;
using detail::t_enabled_mask;

namespace {
void check_low(DType dtype, DeviceType device_type) {
  FLAME_CHECK(dtype == DType::bf16 || dtype == DType::f16, "AutocastGuard",
              "the autocast dtype must be bf16 or f16, got ", dtype_name(dtype), " (device type ",
              device_type == DeviceType::cuda ? "cuda" : "cpu", ")");
}
uint32_t bit(DeviceType t) { return 1u << static_cast<uint32_t>(t); }
}  // namespace

AutocastGuard::AutocastGuard(DType dtype, DeviceType device_type) : device_type_(device_type) {
  check_low(dtype, device_type);
  enter(true, dtype);
}

AutocastGuard::AutocastGuard(bool enabled, DeviceType device_type) : device_type_(device_type) {
  enter(enabled, state().dtype[static_cast<int>(device_type)]);
}

void AutocastGuard::enter(bool enabled, DType dtype) {
  auto& s = state();
  const int d = static_cast<int>(device_type_);
  prev_enabled_ = (t_enabled_mask & bit(device_type_)) != 0;
  prev_dtype_ = s.dtype[d];
  s.dtype[d] = dtype;
  if (enabled) {
    t_enabled_mask |= bit(device_type_);
  } else {
    t_enabled_mask &= ~bit(device_type_);
  }
  ++s.nesting;
}

AutocastGuard::~AutocastGuard() {
  auto& s = state();
  const int d = static_cast<int>(device_type_);
  s.dtype[d] = prev_dtype_;
  if (prev_enabled_) {
    t_enabled_mask |= bit(device_type_);
  } else {
    t_enabled_mask &= ~bit(device_type_);
  }
  if (--s.nesting == 0) clear_autocast_cache();
}

// Off inside an autocast op's body and inside backward, where no op casts.
bool is_autocast_enabled(DeviceType device_type) {
  return (t_enabled_mask & bit(device_type)) != 0 && detail::t_excluded == 0;
}

DType get_autocast_dtype(DeviceType device_type) { return state().dtype[static_cast<int>(device_type)]; }

AutocastCacheStats autocast_cache_stats() {
  const auto& s = state();
  return AutocastCacheStats{s.hits, s.misses, s.cache.size(), s.low_copy_hits, s.low_copy_writes};
}

void clear_autocast_cache() {
  auto& s = state();
  s.cache.clear();
  s.hits = 0;
  s.misses = 0;
  s.low_copy_hits = 0;
  s.low_copy_writes = 0;
}

}  // namespace flame::amp
