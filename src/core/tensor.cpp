// Tensor handle: metadata, views helpers, conversions between devices and dtypes.
#include <atomic>
#include <cstring>

#include "flame/autograd.h"
#include "flame/ops.h"
#include "src/autograd/rules/rules.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"

namespace flame {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

namespace {
// Live TensorImpls, for leak checks (live_tensor_count in flame/autograd.h).
std::atomic<int64_t> g_live_impls{0};
}  // namespace

TensorImpl::TensorImpl(std::shared_ptr<Storage> storage_, Shape sizes_, Shape strides_,
                       int64_t offset_, DType dtype_)
    : storage(std::move(storage_)),
      sizes(std::move(sizes_)),
      strides(std::move(strides_)),
      offset(offset_),
      dtype(dtype_),
      numel(shape_numel(sizes)) {
  g_live_impls.fetch_add(1, std::memory_order_relaxed);
}

TensorImpl::~TensorImpl() { g_live_impls.fetch_sub(1, std::memory_order_relaxed); }

int64_t live_tensor_count() { return g_live_impls.load(std::memory_order_relaxed); }

Shape contiguous_strides(const Shape& sizes) {
  Shape strides(sizes.size());
  int64_t s = 1;
  for (int64_t i = static_cast<int64_t>(sizes.size()) - 1; i >= 0; --i) {
    strides[i] = s;
    s *= std::max<int64_t>(sizes[i], 1);
  }
  return strides;
}

int64_t shape_numel(const Shape& sizes, const char* op) {
  int64_t n = 1;
  for (int64_t s : sizes) {
    FLAME_CHECK(s >= 0, op, "negative dimension in shape ", sizes);
    n *= s;
  }
  return n;
}

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op) {
  const int64_t lo = ndim == 0 ? -1 : -ndim, hi = ndim == 0 ? 0 : ndim - 1;
  FLAME_CHECK(dim >= lo && dim <= hi, op, "dim ", dim, " out of range for a tensor with ", ndim,
              " dims (expected in [", lo, ", ", hi, "])");
  return dim < 0 ? dim + std::max<int64_t>(ndim, 1) : dim;
}

Tensor make_view(const Tensor& t, Shape sizes, Shape strides, int64_t offset) {
  return Tensor(std::make_shared<TensorImpl>(t.impl()->storage, std::move(sizes),
                                             std::move(strides), offset, t.dtype()));
}

Tensor make_empty(const Shape& sizes, DType dtype, Device device) {
  const int64_t n = shape_numel(sizes, "empty");
  const std::size_t nbytes = static_cast<std::size_t>(n) * dtype_size(dtype);
  auto storage = std::make_shared<Storage>(backend::backend_for(device).allocate(nbytes), nbytes, device);
  return Tensor(std::make_shared<TensorImpl>(std::move(storage), sizes, contiguous_strides(sizes), 0, dtype));
}

void bump_version(const Tensor& t) { t.impl()->storage->version.fetch_add(1); }

void check_no_internal_overlap(const Tensor& t, const char* op) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    FLAME_CHECK(!(t.stride(d) == 0 && t.size(d) > 1), op,
                "cannot write in place into a tensor whose elements overlap (expanded view of shape ",
                t.sizes(), ", strides ", t.strides(), "); call contiguous() or clone() first");
  }
}

void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  FLAME_CHECK(a.device() == b.device(), op, "expected all tensors on one device, got ",
              a.device().str(), " and ", b.device().str());
}

// ---- Tensor metadata ----
Tensor::Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

#define FLAME_REQUIRE_DEFINED(op) FLAME_CHECK(impl_ != nullptr, op, "called on an undefined tensor")

const Shape& Tensor::sizes() const {
  FLAME_REQUIRE_DEFINED("sizes");
  return impl_->sizes;
}
const Shape& Tensor::strides() const {
  FLAME_REQUIRE_DEFINED("strides");
  return impl_->strides;
}
int64_t Tensor::dim() const {
  FLAME_REQUIRE_DEFINED("dim");
  return static_cast<int64_t>(impl_->sizes.size());
}
int64_t Tensor::size(int64_t d) const {
  FLAME_CHECK(dim() > 0, "size", "a 0-d tensor has no dim ", d);
  return sizes()[wrap_dim(d, dim(), "size")];
}
int64_t Tensor::stride(int64_t d) const {
  FLAME_CHECK(dim() > 0, "stride", "a 0-d tensor has no dim ", d);
  return strides()[wrap_dim(d, dim(), "stride")];
}
int64_t Tensor::numel() const {
  FLAME_REQUIRE_DEFINED("numel");
  return impl_->numel;
}
int64_t Tensor::storage_offset() const {
  FLAME_REQUIRE_DEFINED("storage_offset");
  return impl_->offset;
}
DType Tensor::dtype() const {
  FLAME_REQUIRE_DEFINED("dtype");
  return impl_->dtype;
}
Device Tensor::device() const {
  FLAME_REQUIRE_DEFINED("device");
  return impl_->storage->device;
}
std::size_t Tensor::element_size() const { return dtype_size(dtype()); }
std::size_t Tensor::nbytes() const { return static_cast<std::size_t>(numel()) * element_size(); }
bool Tensor::is_contiguous() const {
  FLAME_REQUIRE_DEFINED("is_contiguous");
  int64_t expected = 1;
  for (int64_t i = dim() - 1; i >= 0; --i) {
    if (impl_->sizes[i] == 1) continue;
    if (impl_->sizes[i] == 0) return true;
    if (impl_->strides[i] != expected) return false;
    expected *= impl_->sizes[i];
  }
  return true;
}
void* Tensor::data_ptr() const {
  FLAME_REQUIRE_DEFINED("data_ptr");
  return static_cast<char*>(impl_->storage->data.get()) + impl_->offset * static_cast<int64_t>(element_size());
}
bool Tensor::shares_storage(const Tensor& o) const {
  return defined() && o.defined() && impl_->storage == o.impl_->storage;
}
uint64_t Tensor::version() const {
  FLAME_REQUIRE_DEFINED("version");
  return impl_->storage->version.load();
}

// ---- factories ----
Tensor Tensor::empty(const Shape& shape, TensorOptions opts) {
  return make_empty(shape, opts.dtype_or(DType::f32), opts.device);
}
Tensor Tensor::full(const Shape& shape, Scalar value, TensorOptions opts) {
  Tensor t = empty(shape, opts);
  if (t.numel() > 0) backend::backend_for(t.device()).fill(t, value);
  return t;
}
Tensor Tensor::zeros(const Shape& shape, TensorOptions opts) { return full(shape, 0, opts); }
Tensor Tensor::ones(const Shape& shape, TensorOptions opts) { return full(shape, 1, opts); }
Tensor Tensor::scalar(Scalar value, TensorOptions opts) {
  if (!opts.dtype) {
    opts.dtype = value.is_floating() ? DType::f32 : (value.is_bool() ? DType::boolean : DType::i64);
  }
  return full({}, value, opts);
}

Tensor Tensor::arange(Scalar end, TensorOptions opts) { return arange(0, end, 1, opts); }
Tensor Tensor::arange(Scalar start, Scalar end, Scalar step, TensorOptions opts) {
  const bool all_int = !start.is_floating() && !end.is_floating() && !step.is_floating();
  const DType dt = opts.dtype_or(all_int ? DType::i64 : DType::f32);
  const double s = start.to_double(), e = end.to_double(), st = step.to_double();
  FLAME_CHECK(st != 0.0, "arange", "step must be non-zero");
  FLAME_CHECK((st > 0 && e >= s) || (st < 0 && e <= s), "arange", "upper bound ", e,
              " and lower bound ", s, " inconsistent with step sign ", st);
  const int64_t n = all_int ? (end.to_int() - start.to_int() + step.to_int() - (step.to_int() > 0 ? 1 : -1)) /
                                  step.to_int()
                            : static_cast<int64_t>(std::ceil((e - s) / st));
  Tensor t = make_empty({std::max<int64_t>(n, 0)}, dt, opts.device);
  if (t.numel() > 0) backend::backend_for(t.device()).iota(t, s, st);
  return t;
}

Tensor Tensor::linspace(double start, double end, int64_t steps, TensorOptions opts) {
  FLAME_CHECK(steps >= 0, "linspace", "number of steps must be non-negative, got ", steps);
  Tensor t = make_empty({steps}, opts.dtype_or(DType::f32), opts.device);
  if (steps == 0) return t;
  const double step = steps > 1 ? (end - start) / static_cast<double>(steps - 1) : 0.0;
  backend::backend_for(t.device()).iota(t, start, step);
  return t;
}

Tensor Tensor::eye(int64_t n, int64_t m, TensorOptions opts) {
  if (m < 0) m = n;
  FLAME_CHECK(n >= 0, "eye", "n must be non-negative, got ", n);
  const Device dev = opts.device;
  Tensor rows = Tensor::arange(n, dev).unsqueeze(1);
  Tensor cols = Tensor::arange(m, dev).unsqueeze(0);
  return rows.eq(cols).to(opts.dtype_or(DType::f32));
}

Tensor Tensor::from_vec(const std::vector<bool>& values, const Shape& shape, Device device) {
  std::vector<uint8_t> bytes(values.begin(), values.end());
  return from_blob_copy(bytes.data(), DType::boolean, bytes.size(), shape, device);
}

Tensor Tensor::from_blob_copy(const void* host, DType dtype, std::size_t count, const Shape& shape,
                              Device device) {
  const int64_t n = shape_numel(shape, "from_vec");
  FLAME_CHECK(static_cast<int64_t>(count) == n, "from_vec", "got ", count,
              " values for shape ", shape, " (", n, " elements)");
  Tensor t = make_empty(shape, dtype, device);
  if (n > 0) backend::backend_for(device).copy_from_host(t, host);
  return t;
}

// ---- conversions ----
Tensor Tensor::to(Device device) const {
  if (device == this->device()) return *this;
  Tensor src = contiguous();
  Tensor dst = make_empty(sizes(), dtype(), device);
  const Device from = this->device();
  rules::with_grad(dst, "to_device", *this, [from](const Tensor& g) { return g.to(from); });
  if (numel() == 0) return dst;
  if (src.device().is_cpu()) {
    backend::backend_for(device).copy_from_host(dst, src.data_ptr());
  } else if (device.is_cpu()) {
    backend::backend_for(src.device()).copy_to_host(dst.data_ptr(), src);
  } else {  // device to device: through the host (peer copies are a later optimisation)
    Tensor host = src.to(Device::cpu());
    backend::backend_for(device).copy_from_host(dst, host.data_ptr());
  }
  return dst;
}

Tensor Tensor::to(DType dt) const {
  if (dt == dtype()) return *this;
  Tensor dst = make_empty(sizes(), dt, device());
  if (numel() > 0) backend::backend_for(device()).copy(dst, *this);
  const DType from = dtype();
  return rules::with_grad(dst, "to_dtype", *this, [from](const Tensor& g) { return g.to(from); });
}

Tensor Tensor::to(DType dt, Device dev) const { return to(dt).to(dev); }

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor Tensor::clone() const {
  Tensor dst = make_empty(sizes(), dtype(), device());
  if (numel() > 0) backend::backend_for(device()).copy(dst, *this);
  return rules::with_grad(dst, "clone", *this, [](const Tensor& g) { return g; });
}

Tensor Tensor::host_copy(DType dt) const {
  Tensor c = to(Device::cpu()).to(dt);
  return c.contiguous();
}

}  // namespace flame
