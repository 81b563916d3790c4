// The Tensor side of pinned host memory: pin_memory, is_pinned, non-blocking copy_ and to
// (src/backend/pinned_host.h; the allocator and the copies are in src/backend/cuda/offload/pinned_host.cu).
#include <utility>

#include "flame/autograd.h"
#include "flame/offload.h"
#include "src/ops/grad_hooks.h"
#include "src/backend/pinned_host.h"
#include "src/core/tensor_impl.h"

namespace flame {
namespace {
Tensor make_pinned(const Shape& sizes, DType dtype, const char* op) {
  const std::size_t nbytes = static_cast<std::size_t>(shape_nbytes(sizes, dtype, op));
  auto storage = std::make_shared<Storage>(backend::pinned_host::allocate(nbytes, op), nbytes, Device::cpu());
  storage->pinned = true;
  return Tensor(std::make_shared<TensorImpl>(std::move(storage), sizes, contiguous_strides(sizes), 0, dtype));
}
}  // namespace

bool Tensor::is_pinned() const {
  FLAME_CHECK(defined(), "is_pinned", "undefined tensor");
  return impl()->storage->pinned;
}

Tensor Tensor::pin_memory() const {
  FLAME_CHECK(defined(), "pin_memory", "undefined tensor");
  FLAME_CHECK(device().is_cpu(), "pin_memory", "only CPU tensors can be pinned, got one on ", device().str());
  if (is_pinned()) return *this;
  Tensor dst = make_pinned(sizes(), dtype(), "pin_memory");
  if (numel() > 0) dst.copy_(detach());
  // Like torch: the pinned copy is differentiable (its gradient flows back unchanged).
  return rules::copy(dst, "pin_memory", *this);
}

Tensor& Tensor::copy_(const Tensor& src, bool non_blocking) {
  // The async path is only for plain data movement: a copy autograd records (or one that must
  // broadcast, convert or gather strided elements) takes the ordinary path.
  const bool recorded = grad_enabled() && (requires_grad() || (src.defined() && src.requires_grad()));
  if (non_blocking && defined() && src.defined() && !recorded && !shares_storage(src) &&
      backend::pinned_host::copy_async(*this, src)) {
    bump_version(*this);
    return *this;
  }
  return copy_(src);
}

Tensor Tensor::to(Device device, bool non_blocking) const {
  FLAME_CHECK(defined(), "to", "undefined tensor");
  if (!non_blocking || device == this->device()) return to(device);
  const bool h2d = this->device().is_cpu() && device.is_cuda() && is_pinned();
  const bool d2h = this->device().is_cuda() && device.is_cpu();
  if (!(h2d || d2h) || !is_contiguous()) return to(device);
  Tensor dst = d2h ? make_pinned(sizes(), dtype(), "to") : Tensor::empty(sizes(), {dtype(), device});
  const bool done = backend::pinned_host::copy_async(dst, *this);
  FLAME_CHECK(done, "to", "internal: the non-blocking copy was refused");
  return rules::copy(dst, "to_device", *this);
}

namespace offload {
Tensor empty_pinned(const Shape& shape, DType dtype) { return make_pinned(shape, dtype, "offload::empty_pinned"); }
PinnedMemoryStats pinned_memory_stats() {
  const backend::pinned_host::Stats s = backend::pinned_host::stats();
  PinnedMemoryStats out;
  out.allocated_bytes = s.allocated_bytes;
  out.reserved_bytes = s.reserved_bytes;
  out.cached_bytes = s.cached_bytes;
  out.pending_bytes = s.pending_bytes;
  out.num_allocs = s.num_allocs;
  out.num_host_allocs = s.num_host_allocs;
  return out;
}
void empty_pinned_cache() { backend::pinned_host::empty_cache(); }
}  // namespace offload

}  // namespace flame
