// The Gradients store and the autograd methods of Tensor. Recording and nodes: node.cpp; the
// backward pass: backward.cpp.
#include <algorithm>

#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/autograd/rules/inplace.h"

namespace flame {

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

}  // namespace flame
