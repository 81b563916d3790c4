// The Gradients store and the autograd methods of Tensor. Recording and nodes: node.cpp; the
// backward pass: backward.cpp.
#include <algorithm>

#include "flame/ops.h"
#include "src/autograd/record.h"

namespace flame {

// ---- Gradients ----
namespace {
const AutogradMeta* key_of(const Tensor& t, const char* op) {
  FLAME_CHECK(t.defined(), op, "undefined tensor");
  return t.impl()->autograd.get();
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

void Gradients::set(const Tensor& t, const Tensor& grad) {
  const AutogradMeta* k = key_of(t, "Gradients::set");
  FLAME_CHECK(k != nullptr, "Gradients::set", "the tensor does not take part in autograd (call requires_grad_())");
  FLAME_CHECK(grad.defined() && grad.sizes() == t.sizes() && grad.device() == t.device(), "Gradients::set",
              "gradient of shape ", grad.defined() ? grad.sizes() : Shape{}, " on ",
              grad.defined() ? grad.device().str() : "?", " does not match the tensor's shape ", t.sizes(), " on ",
              t.device().str());
  auto it = index_.find(k);
  if (it == index_.end()) {
    index_[k] = entries_.size();
    entries_.push_back({t, grad});
  } else {
    entries_[it->second].grad = grad;
  }
}

void Gradients::accumulate(const Tensor& t, const Tensor& grad) {
  Tensor existing = get(t);
  set(t, existing.defined() ? existing + grad.to(existing.dtype()) : grad);
}

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

bool Tensor::is_leaf() const { return !(defined() && impl_->autograd && impl_->autograd->grad_fn); }

Tensor Tensor::detach() const {
  FLAME_CHECK(defined(), "detach", "undefined tensor");
  return make_view(*this, sizes(), strides(), storage_offset());
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
