// The Gradients store and the autograd methods of Tensor. Recording and nodes: node.cpp; the
// backward pass: backward.cpp.
#include <algorithm>

#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/ops/grad_hooks.h"

namespace flame {

// ---- Gradients ----
// Note [Gradient ownership]
// Every entry's buffer belongs to the store alone: a non-overlapping dense tensor with no autograd
// state, whose storage no other tensor handle, view or store entry reaches, and which spans that
// storage exactly. Buffers come in two ways: adopted, when the gradient was handed over as an
// rvalue, exclusively_held() says nothing else can reach it and it already has the entry's layout
// (the usual case in backward: a rule's fresh result, e.g. a matmul's weight gradient or a
// channels-last conv's weight gradient, costs no copy), or copied otherwise (a gradient that is
// also another input's, a view of the caller's grad_output, a tensor a hook keeps, anything
// passed as const&, a gradient in another layout).
// Accumulation adds in place while the entry is exclusively held, else into a fresh buffer, so a
// handle the caller took from get() is never changed behind its back by a later backward.
//
// Note [Gradient layout]
// As PyTorch's AccumulateGrad: a tensor that is non-overlapping and dense (its strides a
// permutation of a contiguous layout's, e.g. channels-last NCHW or a transposed matrix) gets its
// gradient in its own strides; any other tensor (a view with gaps, an expanded one) gets a
// contiguous gradient. An incoming gradient in the wanted layout is adopted as it is (when
// exclusively held), one in another layout is copied into a fresh buffer in the wanted layout.
// So an optimizer's elementwise update of a channels-last weight walks both in one order, and a
// channels-last conv's weight gradient from cuDNN is stored without a transposing copy. The
// in-place accumulation keeps whatever layout the entry has (a buffer assigned through at() is
// the caller's choice); the out-of-place one builds the sum in the tensor's layout.
namespace {
const AutogradMeta* key_of(const Tensor& t, const char* op) {
  FLAME_CHECK(t.defined(), op, "undefined tensor");
  return t.impl()->autograd.get();
}

// `g` is the only way to reach its bytes, and it spans them as a non-overlapping dense tensor. A
// view whose base nothing else holds (a rule's final reshape of its fresh result) counts as well.
bool exclusively_held(const Tensor& g) {
  const std::shared_ptr<TensorImpl>& impl = g.impl_ptr();
  if (impl.use_count() != 1 || impl->autograd) return false;
  if (impl->base && (impl->base.use_count() != 1 || impl->base->autograd)) return false;
  const long holders = impl->base ? 2 : 1;  // this handle's impl, and its base's
  return impl->storage.use_count() == holders && impl->offset == 0 && is_non_overlapping_and_dense(g) &&
         g.nbytes() == impl->storage->nbytes;
}

// True when g is laid out as the store keeps t's gradient (Note [Gradient layout]).
bool in_gradient_layout(const Tensor& g, const Tensor& t) {
  if (!t.is_contiguous() && is_non_overlapping_and_dense(t)) return same_dense_layout(g, t);
  return g.is_contiguous();
}

// A buffer for t's entry: `grad` itself when it may be adopted (re-wrapped without its view base),
// else a fresh copy in t's gradient layout.
Tensor owned_buffer(const Tensor& t, Tensor grad, bool adoptable) {
  if (adoptable && exclusively_held(grad) && in_gradient_layout(grad, t)) {
    return grad.impl()->base ? make_alias(grad) : grad;
  }
  NoGradGuard no_grad;
  Tensor copy = make_empty_in_layout_of(t, grad.dtype(), grad.device(), "Gradients");
  copy.copy_(grad);
  return copy;
}
}  // namespace

Tensor Gradients::try_get(const Tensor& t) const {
  const AutogradMeta* k = key_of(t, "Gradients::try_get");
  if (!k) return {};
  auto it = index_.find(k);
  return it == index_.end() ? Tensor() : entries_[it->second].grad;
}

Tensor Gradients::get(const Tensor& t) const {
  key_of(t, "Gradients::get");
  Tensor g = try_get(t);
  if (!g.defined()) {
    const char* why = !t.requires_grad()
                          ? "it does not require grad (call requires_grad_() before the forward pass)"
                          : "it took no part in the backward that filled this store, or its entry was erased";
    FLAME_FAIL("Gradients::get", "no gradient for the ", dtype_name(t.dtype()), " tensor of shape ", t.sizes(),
               " on ", t.device().str(), ": ", why, ". Test with contains(t), or use get_or_zeros(t) for zeros "
               "or try_get(t) for an undefined tensor when there is none (", size(), " entries in the store)");
  }
  return g;
}

Tensor Gradients::get_or_zeros(const Tensor& t) const {
  key_of(t, "Gradients::get_or_zeros");
  Tensor g = try_get(t);
  return g.defined() ? g : zeros_like(t);
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
  if (k == nullptr) {
    // A tensor with no autograd state has no identity to key the entry by: give it one, which a
    // leaf can hold without effect (requires_grad stays false, as after requires_grad_(false)). A
    // view's state is rebuilt by in-place writes to its base (Note [In-place recording]), which
    // would orphan the entry.
    FLAME_CHECK(t.impl()->base == nullptr, op, "the tensor of shape ", t.sizes(),
                " is a view without autograd state; set the gradient of the tensor it views, or call "
                "requires_grad_() on it first");
    t.impl()->autograd = std::make_shared<AutogradMeta>();
    k = t.impl()->autograd.get();
  }
  FLAME_CHECK(grad.defined() && grad.sizes() == t.sizes() && grad.device() == t.device(), op,
              "gradient of shape ", grad.defined() ? grad.sizes() : Shape{}, " on ",
              grad.defined() ? grad.device().str() : "?", " does not match the tensor's shape ", t.sizes(), " on ",
              t.device().str());
  Tensor owned = owned_buffer(t, std::move(grad), adoptable);
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
    // A fresh buffer in t's layout: whoever holds the old one keeps its values.
    Tensor sum = make_empty_in_layout_of(t, existing.dtype(), existing.device(), "Gradients::accumulate");
    sum.copy_(existing);
    sum.add_(addend);
    existing = std::move(sum);
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

void Tensor::register_post_accumulate_grad_hook(std::function<void(const Tensor&)> hook) {
  FLAME_CHECK(requires_grad() && is_leaf(), "register_post_accumulate_grad_hook",
              "the tensor must be a leaf that requires grad (shape ", sizes(), ")");
  impl_->autograd->post_accumulate_hooks.push_back(std::move(hook));
}

Tensor Tensor::grad(const Gradients& grads) const { return grads.get(*this); }

}  // namespace flame
