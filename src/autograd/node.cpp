// Graph nodes, saved tensors, recording and grad mode. See Note [Node saved tensors] and
// Note [Graph release] in node.h.
#include <atomic>
#include <cctype>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "flame/ops.h"
#include "src/autograd/anomaly.h"
#include "src/autograd/recompute.h"
#include "src/autograd/record.h"
#include "src/core/tensor_impl.h"
#include "src/ops/grad_hooks.h"
#include "src/core/profiler_context.h"

namespace flame {

// ---- grad mode (thread-local) ----
namespace autograd_detail {
thread_local ThreadState t_state;
}  // namespace autograd_detail
using autograd_detail::t_state;

bool grad_enabled() { return t_state.grad_enabled; }
NoGradGuard::NoGradGuard() : prev_(t_state.grad_enabled) { t_state.grad_enabled = false; }
NoGradGuard::~NoGradGuard() { t_state.grad_enabled = prev_; }
EnableGradGuard::EnableGradGuard() : prev_(t_state.grad_enabled) { t_state.grad_enabled = true; }
EnableGradGuard::~EnableGradGuard() { t_state.grad_enabled = prev_; }

// ---- Node ----
void Node::add_edge(const Tensor& t) {
  Edge& e = edges_.emplace_back();
  if (!t.defined()) return;
  rules::refresh_view_history(t);  // a view whose base was written in place (Note [In-place recording])
  e.shape = t.sizes();
  e.dtype = t.dtype();
  e.device = t.device();
  const auto& meta = t.impl()->autograd;
  if (meta && meta->requires_grad) {
    e.meta = meta;
    if (!meta->grad_fn) e.leaf = t;
  }
}

namespace {
// Creation order of nodes (Note [Backward order] in backward.cpp): process-wide, so that nodes
// recorded on different threads still order by when they were made.
std::atomic<uint64_t> g_next_seq{1};
}  // namespace

Node::Node(const char* name, const TensorList& inputs, BackwardFn fn)
    : seq(g_next_seq.fetch_add(1, std::memory_order_relaxed)), name_(name), fn_(std::move(fn)) {
  edges_.reserve(inputs.size());
  for (const Tensor& t : inputs) add_edge(t);
}

Node::Node(const char* name, std::initializer_list<std::reference_wrapper<const Tensor>> inputs, RuleFn rule,
           RuleArgs args)
    : seq(g_next_seq.fetch_add(1, std::memory_order_relaxed)), name_(name), rule_(rule), args_(std::move(args)) {
  edges_.reserve(inputs.size());
  for (const Tensor& t : inputs) add_edge(t);
}

Node::Node(const char* name, const TensorList& inputs, RuleFn rule, RuleArgs args)
    : seq(g_next_seq.fetch_add(1, std::memory_order_relaxed)), name_(name), rule_(rule), args_(std::move(args)) {
  edges_.reserve(inputs.size());
  for (const Tensor& t : inputs) add_edge(t);
}

// Note [Graph release]: unlink the chain iteratively instead of one destructor frame per op.
Node::~Node() {
  std::vector<std::shared_ptr<AutogradMeta>> stack;
  auto take_edges = [&stack](SmallVec<Edge, 2>& edges) {
    for (Edge& e : edges) {
      if (e.meta && e.meta.use_count() == 1) stack.push_back(std::move(e.meta));
    }
  };
  take_edges(edges_);
  while (!stack.empty()) {
    std::shared_ptr<AutogradMeta> m = std::move(stack.back());
    stack.pop_back();
    if (m->grad_fn && m->grad_fn.use_count() == 1) {
      std::shared_ptr<Node> n = std::move(m->grad_fn);
      take_edges(n->edges_);
      // n is destroyed here with its edges already moved out: no recursion.
    }
  }
}

TensorList Node::apply(const Tensor& grad) {
  FLAME_CHECK(!released_, "backward", "trying to backward through the graph a second time (op ", name_,
              "): its saved tensors were freed; pass retain_graph = true to the first backward");
  return rule_ ? rule_(grad, *this) : fn_(grad);
}

void Node::release() {
  fn_ = nullptr;
  saved_.clear();
  released_ = true;
}

namespace {
std::atomic<uint64_t> g_prepared{0}, g_prepared_taken{0};
}  // namespace

namespace autograd_detail {
PreparedCounts prepared_counts() {
  return {g_prepared.load(std::memory_order_relaxed), g_prepared_taken.load(std::memory_order_relaxed)};
}
}  // namespace autograd_detail

// Note [Gradient row sums]: the attached sums of this thread, keyed by the gradient's memory
// (storage, offset, element count) and version; the storage is held weakly, so an entry whose
// gradient is gone is dropped at the next attach. Few entries are ever live (one per fused
// residual backward whose consumer has not run yet).
namespace {
struct RowSums {
  std::weak_ptr<Storage> storage;
  const Storage* key = nullptr;
  int64_t offset = 0, numel = 0;
  uint64_t version = 0;
  Tensor sums;
};
thread_local std::vector<RowSums> t_row_sums;
std::atomic<uint64_t> g_row_sums_attached{0}, g_row_sums_taken{0};
}  // namespace

namespace autograd_detail {
void attach_row_sums(const Tensor& grad, Tensor sums) {
  if (!grad.defined() || grad.dim() == 0 || !grad.is_contiguous() || sums.numel() != grad.size(-1)) return;
  auto& v = t_row_sums;
  std::erase_if(v, [](const RowSums& r) { return r.storage.expired(); });
  const auto& st = grad.impl()->storage;
  std::erase_if(v, [&](const RowSums& r) { return r.key == st.get(); });
  if (v.size() >= 64) v.erase(v.begin());
  v.push_back({st, st.get(), grad.storage_offset(), grad.numel(), grad.version(), std::move(sums)});
  g_row_sums_attached.fetch_add(1, std::memory_order_relaxed);
}

Tensor take_row_sums(const Tensor& grad) {
  auto& v = t_row_sums;
  if (v.empty() || !grad.defined()) return Tensor();
  const Storage* key = grad.impl()->storage.get();
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (it->key != key) continue;
    // Contiguous with the same last dim: every element sits in the same column as when attached
    // (a view that moved the last dim, e.g. a transpose of a square tensor, does not match).
    const bool same = !it->storage.expired() && it->offset == grad.storage_offset() && it->numel == grad.numel() &&
                      it->version == grad.version() && grad.dim() > 0 && grad.is_contiguous() &&
                      it->sums.numel() == grad.size(-1);
    if (!same) continue;  // another view of that memory: the entry waits for its own consumer
    Tensor out = std::move(it->sums);
    v.erase(it);
    g_row_sums_taken.fetch_add(1, std::memory_order_relaxed);
    return out;
  }
  return Tensor();
}

RowSumCounts row_sum_counts() {
  return {g_row_sums_attached.load(std::memory_order_relaxed), g_row_sums_taken.load(std::memory_order_relaxed)};
}
}  // namespace autograd_detail

bool Node::completes_input(std::size_t i) const {
  if (i >= edges_.size()) return false;
  const Edge& e = edges_[i];
  if (!e.meta || e.slot >= 0 || !e.meta->grad_fn) return false;  // no gradient, a leaf or a stop
  const Scratch& c = e.meta->grad_fn->scratch;
  return c.run == scratch.run && c.deps == 1 && !c.pending.defined();
}

void Node::prepare(TensorList grads, const Tensor& for_grad) const {
  scratch.prepared = std::move(grads);
  scratch.prepared_for = for_grad;
  scratch.prepared_version = for_grad.version();
  g_prepared.fetch_add(1, std::memory_order_relaxed);
}

TensorList Node::take_prepared(const Tensor& grad) const {
  TensorList out = std::move(scratch.prepared);
  scratch.prepared = TensorList();
  const bool valid = !out.empty() && grad.defined() && scratch.prepared_for.defined() &&
                     grad.impl() == scratch.prepared_for.impl() && grad.version() == scratch.prepared_version;
  scratch.prepared_for = Tensor();
  if (valid) g_prepared_taken.fetch_add(1, std::memory_order_relaxed);
  return valid ? out : TensorList();
}

std::size_t Node::save(const Tensor& t, bool is_output) {
  // Inputs are held as they are: their history was complete before this node existed, so it
  // cannot lead back here. The node's own output is held detached, or it would own itself
  // (Note [Node saved tensors]).
  saved_.emplace_back() = SavedTensor(t, name_, /*detach=*/is_output);
  return saved_.size() - 1;
}

// ---- grad_fn names ----
namespace {
// "index_select" -> "IndexSelectBackward" (PyTorch's grad_fn spelling, without the overload digit).
std::string pascal_backward(const char* op) {
  std::string s;
  bool up = true;
  for (const char* c = op; *c; ++c) {
    if (*c == '_' || *c == '/' || *c == ' ') {
      up = true;
      continue;
    }
    s += up ? static_cast<char>(std::toupper(static_cast<unsigned char>(*c))) : *c;
    up = false;
  }
  return s + "Backward";
}
}  // namespace

const char* backward_name(const char* op) {
  const std::size_t len = std::strlen(op);
  if (len >= 8 && std::strcmp(op + len - 8, "Backward") == 0) return op;
  // The common view ops map to literals without a lock; other names are made once and kept.
  static const char* const table[][2] = {
      {"view", "ViewBackward"},       {"reshape", "ReshapeBackward"},     {"transpose", "TransposeBackward"},
      {"t", "TBackward"},             {"permute", "PermuteBackward"},     {"narrow", "NarrowBackward"},
      {"slice", "SliceBackward"},     {"select", "SelectBackward"},       {"expand", "ExpandBackward"},
      {"squeeze", "SqueezeBackward"}, {"unsqueeze", "UnsqueezeBackward"}, {"unfold", "UnfoldBackward"},
  };
  for (const auto& row : table) {
    if (std::strcmp(row[0], op) == 0) return row[1];
  }
  return intern_backward_name(op);
}

const char* intern_backward_name(const std::string& op) {
  static std::mutex mu;
  static std::unordered_set<std::string> interned;
  const std::size_t len = op.size();
  std::string name = len >= 8 && op.compare(len - 8, 8, "Backward") == 0 ? op : pascal_backward(op.c_str());
  std::lock_guard<std::mutex> lock(mu);
  return interned.insert(std::move(name)).first->c_str();
}

// ---- recording ----
bool needs_grad(const TensorList& inputs) {
  if (!t_state.grad_enabled) {
    if (t_state.collector) autograd_detail::collect_reads(inputs);
    return false;
  }
  for (const Tensor& t : inputs) {
    if (t.requires_grad()) return true;
  }
  return false;
}

namespace {
// A node recorded while gradient rules run (a custom backward or hook that re-enabled grad mode):
// backward would only see part of the second-order graph, so using it raises instead.
TensorList no_higher_order(const Tensor&, const Node& n) {
  FLAME_FAIL("backward", "higher-order gradients are not supported: ", n.name(),
              " was recorded while a backward pass ran (a gradient cannot be differentiated again)");
}

Node& attach(Tensor& out, std::shared_ptr<Node> node) {
  auto meta = std::make_shared<AutogradMeta>();
  meta->requires_grad = true;
  meta->grad_fn = std::move(node);
  Node& n = *meta->grad_fn;
  out.impl()->autograd = std::move(meta);
  // Note [Anomaly mode] (anomaly.cpp): the one flag test the normal path pays.
  if (t_state.anomaly || profiler_detail::recording()) [[unlikely]] anomaly_detail::on_record(out, n);
  return n;
}
}  // namespace

Node& record(Tensor& out, const char* name, std::initializer_list<std::reference_wrapper<const Tensor>> inputs,
             Node::RuleFn rule, RuleArgs args) {
  if (t_state.backward_depth > 0) {
    return attach(out, std::make_shared<Node>(name, inputs, &no_higher_order, RuleArgs{}));
  }
  return attach(out, std::make_shared<Node>(name, inputs, rule, std::move(args)));
}

Node& record(Tensor& out, const char* name, const TensorList& inputs, Node::RuleFn rule, RuleArgs args) {
  if (t_state.backward_depth > 0) {
    return attach(out, std::make_shared<Node>(name, inputs, &no_higher_order, RuleArgs{}));
  }
  return attach(out, std::make_shared<Node>(name, inputs, rule, std::move(args)));
}

Node& record(Tensor& out, const char* op, const TensorList& inputs, Node::BackwardFn fn) {
  const char* name = backward_name(op);
  if (t_state.backward_depth > 0) {
    const std::string n = name;
    auto raise = [n](const Tensor&) -> TensorList {
      FLAME_FAIL("backward", "higher-order gradients are not supported: ", n,
                  " was recorded while a backward pass ran (a gradient cannot be differentiated again)");
    };
    return attach(out, std::make_shared<Node>(name, inputs, raise));
  }
  return attach(out, std::make_shared<Node>(name, inputs, std::move(fn)));
}

SavedTensor::SavedTensor(const Tensor& t, const char* op, bool detach, bool allow_hooks) : op_(op) {
  if (!t.defined()) return;
  version_ = t.version();
  // Note [Recompute cheap] (recompute.cpp): one pointer test when the storage has no recipe. As
  // for hooks, a tensor kept for its identity or a leaf that requires grad is held as it is.
  const Storage* st = t.impl()->storage.get();
  if (st && st->recipe && allow_hooks && !(t.is_leaf() && t.requires_grad())) [[unlikely]] {
    recomputed_ = autograd_detail::recompute_saved(t);
    if (recomputed_) return;
  }
  // Note [Saved tensor hooks]: one thread-local read when no hooks are active.
  if (allow_hooks && autograd_detail::saved_hooks_active() && !(t.is_leaf() && t.requires_grad())) {
    packed_ = autograd_detail::pack_saved(t);
    return;
  }
  tensor_ = detach ? t.detach() : t;
}

Tensor SavedTensor::get() const {
  if (recomputed_) [[unlikely]] return autograd_detail::unpack_recomputed(*recomputed_, version_, op_);
  if (packed_) return autograd_detail::unpack_saved(*packed_, version_, op_);
  if (tensor_.defined()) {
    FLAME_CHECK(tensor_.version() == version_, "backward",
                "a tensor saved for the gradient of ", op_, " (shape ", tensor_.sizes(),
                ") was modified by an in-place op: its version is ", tensor_.version(), ", expected ", version_);
  }
  return tensor_;
}

Tensor sum_to(const Tensor& grad, const Shape& shape) {
  if (grad.sizes() == shape) return grad;
  const int64_t lead = grad.dim() - static_cast<int64_t>(shape.size());
  Shape dims;
  for (int64_t d = 0; d < grad.dim(); ++d) {
    if (d < lead || (shape[d - lead] == 1 && grad.size(d) != 1)) dims.push_back(d);
  }
  Tensor g = dims.empty() ? grad : sum(grad, dims, true);
  return g.reshape(shape);
}

}  // namespace flame
