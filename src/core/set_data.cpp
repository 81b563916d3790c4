// Tensor::set_data: swap the data behind a handle while keeping the handle's identity.
//
// Note [Parameter identity]: nn::Module::to(device/dtype) must keep every parameter the same
// TensorImpl, because optimizers, gradient stores and user code key state by tensor identity.
// So the module converts a detached copy and installs it here, as PyTorch's `param.data = ...`.
// Only leaves that are not views may be rebound: a recorded history or a view base would go on
// describing the old storage.
#include <atomic>

#include "src/core/autocast_seam.h"
#include "src/core/tensor_impl.h"

namespace flame {

void Tensor::set_data(const Tensor& data) {
  FLAME_CHECK(defined(), "set_data", "undefined tensor");
  FLAME_CHECK(data.defined(), "set_data", "the new data is an undefined tensor");
  FLAME_CHECK(is_leaf(), "set_data", "the tensor has autograd history (", grad_fn_name(),
              "); only leaves can take new data");
  FLAME_CHECK(impl_->base == nullptr, "set_data", "the tensor (shape ", sizes(),
              ") is a view of another tensor; only tensors owning their geometry can take new data");
  FLAME_CHECK(!requires_grad() || is_floating(data.dtype()), "set_data",
              "the tensor requires grad but the new data has non-floating dtype ", dtype_name(data.dtype()));
  if (data.impl() == impl_.get()) return;
  const uint64_t old_version = version();
  TensorImpl* src = data.impl();
  impl_->storage = src->storage;
  impl_->sizes = src->sizes;
  impl_->strides = src->strides;
  impl_->offset = src->offset;
  impl_->dtype = src->dtype;
  impl_->numel = src->numel;
  // Anything that remembered (this tensor, version) must see a change, even when the new storage
  // has counted fewer writes than the old one.
  std::atomic<uint64_t>& v = impl_->storage->version;
  uint64_t cur = v.load();
  while (cur <= old_version && !v.compare_exchange_weak(cur, old_version + 1)) {
  }
  // A kept low-precision copy describes the old data; its memory goes with it (Module::to, and
  // weight streaming's device copies, which would otherwise stay on the GPU).
  amp::detail::drop_low_copy(*this);
}

}  // namespace flame
