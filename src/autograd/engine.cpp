// The autograd engine: recording, the Gradients store, and backward in reverse topological order.
#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/autograd/rules/inplace.h"

namespace flame {

// ---- grad mode (thread-local) ----
namespace {
thread_local bool t_grad_enabled = true;
}
bool grad_enabled() { return t_grad_enabled; }
NoGradGuard::NoGradGuard() : prev_(t_grad_enabled) { t_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { t_grad_enabled = prev_; }
EnableGradGuard::EnableGradGuard() : prev_(t_grad_enabled) { t_grad_enabled = true; }
EnableGradGuard::~EnableGradGuard() { t_grad_enabled = prev_; }

// ---- Node ----
Node::Node(std::string name, const TensorList& inputs, BackwardFn fn) : name_(std::move(name)), fn_(std::move(fn)) {
  edges_.reserve(inputs.size());
  for (const Tensor& t : inputs) {
    Edge e;
    if (t.defined()) {
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
    edges_.push_back(std::move(e));
  }
}

TensorList Node::apply(const Tensor& grad) {
  FLAME_CHECK(!released_, "backward", "trying to backward through the graph a second time (op ", name_,
              "): its saved tensors were freed; pass retain_graph = true to the first backward");
  return fn_(grad);
}

void Node::release() {
  fn_ = nullptr;
  released_ = true;
}

// ---- recording ----
bool needs_grad(const TensorList& inputs) {
  if (!t_grad_enabled) return false;
  for (const Tensor& t : inputs) {
    if (t.requires_grad()) return true;  // (refreshes a view whose base was written in place)
  }
  return false;
}

void record(Tensor& out, const char* name, const TensorList& inputs, Node::BackwardFn fn) {
  auto meta = std::make_shared<AutogradMeta>();
  meta->requires_grad = true;
  meta->grad_fn = std::make_shared<Node>(name, inputs, std::move(fn));
  out.impl()->autograd = std::move(meta);
}

SavedTensor::SavedTensor(const Tensor& t, const char* op) : op_(op) {
  if (!t.defined()) return;
  tensor_ = t.detach();
  version_ = t.version();
}

Tensor SavedTensor::get() const {
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

// ---- Gradients ----
// Note [Gradient ownership]
// Every entry's buffer belongs to the store alone: a plain contiguous tensor with no autograd
// state, whose storage no other tensor handle, view or store entry reaches. Buffers come in two
// ways: adopted, when the gradient was handed over as an rvalue and exclusively_held() says
// nothing else can reach it (the usual case in backward: a rule's fresh result, e.g. a matmul's
// weight gradient, costs no copy), or copied otherwise (a gradient that is also another input's,
// a view of the caller's grad_output, a tensor a hook keeps, anything passed as const&).
// Accumulation adds in place while the entry is exclusively held, else into a fresh buffer, so a
// handle the caller took from get() is never changed behind its back by a later backward.
namespace {
const AutogradMeta* key_of(const Tensor& t, const char* op) {
  FLAME_CHECK(t.defined(), op, "undefined tensor");
  return t.impl()->autograd.get();
}

// `g` is the only way to reach its bytes, and it spans them as a plain contiguous tensor. A view
// whose base nothing else holds (a rule's final reshape of its fresh result) counts as well.
bool exclusively_held(const Tensor& g) {
  const std::shared_ptr<TensorImpl>& impl = g.impl_ptr();
  if (impl.use_count() != 1 || impl->autograd) return false;
  if (impl->base && (impl->base.use_count() != 1 || impl->base->autograd)) return false;
  const long holders = impl->base ? 2 : 1;  // this handle's impl, and its base's
  return impl->storage.use_count() == holders && impl->offset == 0 && g.is_contiguous() &&
         g.nbytes() == impl->storage->nbytes;
}

// A buffer for the store: `grad` itself when it may be adopted (re-wrapped without its view base),
// else a fresh contiguous copy.
Tensor owned_buffer(Tensor grad, bool adoptable) {
  if (adoptable && exclusively_held(grad)) return grad.impl()->base ? make_alias(grad) : grad;
  NoGradGuard no_grad;
  Tensor copy = make_empty(grad.sizes(), grad.dtype(), grad.device());
  copy.copy_(grad);
  return copy;
}
}  // namespace

Tensor Gradients::get(const Tensor& t) const {
  const AutogradMeta* k = key_of(t, "Gradients::get");
  if (!k) return {};
  auto it = index_.find(k);
  return it == index_.end() ? Tensor() : entries_[it->second].grad;
}

Tensor& Gradients::at(const Tensor& t) {
  const AutogradMeta* k = key_of(t, "Gradients::at");
  auto it = k ? index_.find(k) : index_.end();
  FLAME_CHECK(it != index_.end(), "Gradients::at", "no gradient for the tensor of shape ", t.sizes());
  return entries_[it->second].grad;
}

bool Gradients::contains(const Tensor& t) const {
  const AutogradMeta* k = key_of(t, "Gradients::contains");
  return k && index_.count(k);
}

void Gradients::insert_or_replace(const Tensor& t, Tensor grad, bool adoptable, const char* op) {
  const AutogradMeta* k = key_of(t, op);
  FLAME_CHECK(k != nullptr, op, "the tensor does not take part in autograd (call requires_grad_())");
  FLAME_CHECK(grad.defined() && grad.sizes() == t.sizes() && grad.device() == t.device(), op,
              "gradient of shape ", grad.defined() ? grad.sizes() : Shape{}, " on ",
              grad.defined() ? grad.device().str() : "?", " does not match the tensor's shape ", t.sizes(), " on ",
              t.device().str());
  Tensor owned = owned_buffer(std::move(grad), adoptable);
  auto it = index_.find(k);
  if (it == index_.end()) {
    index_[k] = entries_.size();
    entries_.push_back({t, std::move(owned)});
  } else {
    entries_[it->second].grad = std::move(owned);
  }
}

void Gradients::set(const Tensor& t, const Tensor& grad) { insert_or_replace(t, grad, false, "Gradients::set"); }
void Gradients::set(const Tensor& t, Tensor&& grad) { insert_or_replace(t, std::move(grad), true, "Gradients::set"); }

void Gradients::add_into(const Tensor& t, Tensor grad, bool adoptable) {
  const AutogradMeta* k = key_of(t, "Gradients::accumulate");
  auto it = k ? index_.find(k) : index_.end();
  if (it == index_.end()) {
    insert_or_replace(t, std::move(grad), adoptable, "Gradients::accumulate");
    return;
  }
  Tensor& existing = entries_[it->second].grad;
  FLAME_CHECK(grad.defined() && grad.sizes() == existing.sizes() && grad.device() == existing.device(),
              "Gradients::accumulate", "gradient of shape ", grad.defined() ? grad.sizes() : Shape{}, " on ",
              grad.defined() ? grad.device().str() : "?", " does not match the stored gradient's shape ",
              existing.sizes(), " on ", existing.device().str());
  NoGradGuard no_grad;
  const Tensor addend = grad.dtype() == existing.dtype() ? grad : grad.to(existing.dtype());
  if (exclusively_held(existing)) {
    existing.add_(addend);
  } else {
    existing = existing + addend;  // a fresh buffer: whoever holds the old one keeps its values
  }
}

void Gradients::accumulate(const Tensor& t, const Tensor& grad) { add_into(t, grad, false); }
void Gradients::accumulate(const Tensor& t, Tensor&& grad) { add_into(t, std::move(grad), true); }

void Gradients::erase(const Tensor& t) {
  const AutogradMeta* k = key_of(t, "Gradients::erase");
  auto it = k ? index_.find(k) : index_.end();
  if (it == index_.end()) return;
  const std::size_t pos = it->second;
  entries_.erase(entries_.begin() + static_cast<int64_t>(pos));
  index_.erase(it);
  for (auto& [key, i] : index_) {
    if (i > pos) --i;
  }
}

void Gradients::clear() {
  index_.clear();
  entries_.clear();
}

// ---- Tensor autograd methods ----
bool Tensor::requires_grad() const {
  if (defined()) rules::refresh_view_history(*this);  // Note [In-place recording]
  return defined() && impl_->autograd && impl_->autograd->requires_grad;
}

Tensor& Tensor::requires_grad_(bool on) {
  FLAME_CHECK(defined(), "requires_grad_", "undefined tensor");
  FLAME_CHECK(is_leaf(), "requires_grad_", "can only change requires_grad of leaf tensors (this one comes from ",
              grad_fn_name(), ")");
  if (on) {
    FLAME_CHECK(is_floating(dtype()), "requires_grad_", "only floating tensors can require gradients, got ",
                dtype_name(dtype()));
    if (!impl_->autograd) impl_->autograd = std::make_shared<AutogradMeta>();
    impl_->autograd->requires_grad = true;
  } else if (impl_->autograd) {
    impl_->autograd->requires_grad = false;
  }
  return *this;
}

bool Tensor::is_leaf() const {
  if (defined()) rules::refresh_view_history(*this);
  return !(defined() && impl_->autograd && impl_->autograd->grad_fn);
}

Tensor Tensor::detach() const {
  FLAME_CHECK(defined(), "detach", "undefined tensor");
  return make_alias(*this);  // not a view for autograd: writes through it are never recorded
}

std::string Tensor::grad_fn_name() const {
  return is_leaf() ? std::string() : impl_->autograd->grad_fn->name();
}

void Tensor::register_hook(std::function<Tensor(const Tensor&)> hook) {
  FLAME_CHECK(requires_grad(), "register_hook", "the tensor does not require grad (shape ", sizes(), ")");
  impl_->autograd->hooks.push_back(std::move(hook));
}

Tensor Tensor::grad(const Gradients& grads) const { return grads.get(*this); }

Gradients Tensor::backward() const { return backward(BackwardOptions{}); }

// Note [Backward order]
// Vertices are AutogradMeta (one per tensor taking part). A vertex is processed once every consumer
// of it in the reachable graph has delivered its contribution (dependency counts), so gradients of
// tensors used more than once are summed before hooks run or they reach the store or their node.
Gradients Tensor::backward(const BackwardOptions& options) const {
  FLAME_CHECK(requires_grad(), "backward", "the tensor (shape ", sizes(),
              ") does not require grad and has no grad_fn");
  Tensor seed = options.grad_output;
  if (seed.defined()) {
    FLAME_CHECK(seed.sizes() == sizes() && seed.device() == device(), "backward", "grad_output of shape ",
                seed.sizes(), " on ", seed.device().str(), " does not match the output's shape ", sizes(), " on ",
                device().str());
  } else {
    FLAME_CHECK(numel() == 1, "backward", "grad can be implicitly created only for scalar outputs (shape ",
                sizes(), "); pass BackwardOptions::grad_output");
    seed = ones_like(*this);
  }

  // Discover the reachable graph and count consumers of each vertex.
  AutogradMeta* root = impl_->autograd.get();
  std::unordered_map<AutogradMeta*, int> deps;
  std::vector<AutogradMeta*> stack = {root};
  std::unordered_set<AutogradMeta*> seen = {root};
  while (!stack.empty()) {
    AutogradMeta* m = stack.back();
    stack.pop_back();
    if (!m->grad_fn) continue;
    FLAME_CHECK(!m->grad_fn->released(), "backward", "trying to backward through the graph a second time (op ",
                m->grad_fn->name(), "): pass retain_graph = true to the first backward");
    for (const Node::Edge& e : m->grad_fn->edges()) {
      if (!e.meta) continue;
      ++deps[e.meta.get()];
      if (seen.insert(e.meta.get()).second) stack.push_back(e.meta.get());
    }
  }

  Gradients local;
  Gradients& store = options.accumulate_into ? *options.accumulate_into : local;
  std::unordered_map<AutogradMeta*, Tensor> pending = {{root, seed}};
  std::unordered_map<AutogradMeta*, Tensor> leaf_handle;  // vertex -> leaf tensor (store key)
  if (!root->grad_fn) leaf_handle[root] = *this;
  std::vector<AutogradMeta*> ready = {root};
  NoGradGuard no_grad;  // gradient rules are not recorded (no higher-order gradients)

  // A vertex whose consumers all delivered nothing still passes "nothing" on, so that the
  // dependency counts of its inputs reach zero and their other contributions are not lost.
  auto deliver = [&](AutogradMeta* target, const Tensor& gi, const Node::Edge& e) {
    if (gi.defined()) {
      if (e.leaf.defined()) leaf_handle.emplace(target, e.leaf);
      auto it = pending.find(target);
      if (it == pending.end() || !it->second.defined()) pending[target] = gi;
      else it->second = it->second + gi;
    } else {
      pending.try_emplace(target);
    }
    if (--deps[target] == 0) ready.push_back(target);
  };

  while (!ready.empty()) {
    AutogradMeta* m = ready.back();
    ready.pop_back();
    Tensor g = std::move(pending[m]);
    pending.erase(m);
    if (!g.defined()) {
      if (m->grad_fn) {
        for (const Node::Edge& e : m->grad_fn->edges()) {
          if (e.meta) deliver(e.meta.get(), Tensor(), e);
        }
        if (!options.retain_graph) m->grad_fn->release();
      }
      continue;
    }
    for (const GradHook& hook : m->hooks) {
      Tensor replaced = hook(g);
      if (replaced.defined()) {
        FLAME_CHECK(replaced.sizes() == g.sizes(), "backward", "a hook returned a gradient of shape ",
                    replaced.sizes(), " for a tensor of shape ", g.sizes());
        g = replaced;
      }
    }
    if (!m->grad_fn) {
      // Stored gradients are plain contiguous tensors a trainer may edit in place.
      store.accumulate(leaf_handle.at(m), std::move(g));  // Note [Gradient ownership]
      continue;
    }
    Node& node = *m->grad_fn;
    TensorList grads = node.apply(g);
    FLAME_CHECK(grads.size() == node.edges().size(), "backward", "gradient rule of ", node.name(), " returned ",
                grads.size(), " gradients for ", node.edges().size(), " inputs");
    for (std::size_t i = 0; i < grads.size(); ++i) {
      const Node::Edge& e = node.edges()[i];
      if (!e.meta) continue;
      Tensor gi = grads[i];
      if (gi.defined()) {
        FLAME_CHECK(gi.sizes() == e.shape, "backward", "gradient rule of ", node.name(), " produced shape ",
                    gi.sizes(), " for input ", i, " of shape ", e.shape);
        if (gi.dtype() != e.dtype) gi = gi.to(e.dtype);
      }
      deliver(e.meta.get(), gi, e);
    }
    if (!options.retain_graph) node.release();
  }
  if (options.accumulate_into) return Gradients();
  return local;
}

}  // namespace flame
