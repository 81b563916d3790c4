// Tensor handle: metadata, views helpers, conversions between devices and dtypes.
//
// Note [Internal overlap]
// An in-place write into a tensor two of whose indices address one element would race (CUDA) or
// depend on the visiting order (CPU), so in-place ops refuse such destinations. The decision is
// exact: dims of size 1 are irrelevant, a size-0 tensor has no elements, and a stride of 0 on a
// dim of size > 1 overlaps. Otherwise, with |strides| sorted ascending, a dim whose stride exceeds
// the span (sum of |stride| * (size - 1)) of all smaller-stride dims keeps its copies of the smaller
// block disjoint, so it can be dropped. Dims are dropped from the largest stride down while that
// holds; when every dim is dropped there is no overlap. In what remains, a stride that is m times
// another with m < that dim's size is a witness of overlap (index e_i equals m * e_j): this is
// how unfold with step < size overlaps, at any size. Anything else is decided by enumerating the
// remainder's offsets (sorted, then checked for duplicates). A remainder too large to enumerate
// (more than kOverlapEnumerationLimit elements) is refused with a message saying so, not guessed.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <sstream>
#include <utility>
#include <vector>

#include "src/core/checked_math.h"
#include "src/core/tensor_impl.h"
#include "src/core/trace_seam.h"
#include "src/core/profiler_context.h"

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

// Callers pass sizes that shape_numel accepted, whose strides fit int64 (Note [Checked size
// arithmetic]).
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
  // The span (the product with size-0 dims counted as 1) bounds the contiguous strides, which
  // exist even when a size-0 dim makes the element count 0.
  int64_t n = 1, span = 1;
  bool ok = true;
  for (int64_t s : sizes) {
    FLAME_CHECK(s >= 0, op, "negative dimension in shape ", sizes);
    if (ok) {
      const auto nn = mul_overflows(n, s), ss = mul_overflows(span, std::max<int64_t>(s, 1));
      ok = nn && ss;
      if (ok) n = *nn, span = *ss;
    }
  }
  FLAME_CHECK(ok, op, "shape ", sizes, " has more elements than int64 can count");
  return n;
}

int64_t shape_nbytes(const Shape& sizes, DType dtype, const char* op) {
  const int64_t n = shape_numel(sizes, op);
  const int64_t esize = static_cast<int64_t>(dtype_size(dtype));
  FLAME_CHECK(n <= kMaxTensorBytes / esize, op, "shape ", sizes, " of dtype ", dtype_name(dtype), " needs ", n,
              " x ", esize, " bytes, more than the limit of 2^62 bytes");
  return n * esize;
}

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op) {
  const int64_t lo = ndim == 0 ? -1 : -ndim, hi = ndim == 0 ? 0 : ndim - 1;
  FLAME_CHECK(dim >= lo && dim <= hi, op, "dim ", dim, " out of range for a tensor with ", ndim,
              " dims (expected in [", lo, ", ", hi, "])");
  return dim < 0 ? dim + std::max<int64_t>(ndim, 1) : dim;
}

// Tensors have at most kMaxTensorDims dims: the kernels' index arrays (CPU and CUDA) are that
// long. Every new storage and every view is checked here, so no kernel meets a longer shape and
// the error names the public op and the shape.
namespace {
constexpr int64_t kMaxTensorDims = 16;

void check_max_dims(const Shape& sizes, const char* op) {
  FLAME_CHECK(static_cast<int64_t>(sizes.size()) <= kMaxTensorDims, op, "shape ", sizes, " has ", sizes.size(),
              " dims; tensors have at most ", kMaxTensorDims, " dims (merge some, e.g. with reshape or flatten)");
}
}  // namespace

void check_view_in_storage(const Tensor& base, const Shape& sizes, const Shape& strides, int64_t offset,
                           const char* op) {
  check_max_dims(sizes, op);
  FLAME_CHECK(sizes.size() == strides.size(), op, "view sizes ", sizes, " and strides ", strides,
              " differ in length");
  // The lowest and highest element the view reaches, in elements of the storage; an empty view
  // reaches none.
  shape_numel(sizes, op);  // expanded (stride-0) views can still count too many elements
  int64_t lo = offset, hi = offset;
  bool ok = true;
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    FLAME_CHECK(sizes[d] >= 0, op, "negative dimension in view shape ", sizes);
    if (sizes[d] == 0) return;
    const auto reach = mul_overflows(sizes[d] - 1, strides[d]);
    const auto next = reach ? add_overflows(*reach < 0 ? lo : hi, *reach) : std::nullopt;
    if (!next) ok = false;
    else if (*reach < 0) lo = *next;
    else hi = *next;
  }
  const int64_t esize = static_cast<int64_t>(base.element_size());
  const int64_t capacity = static_cast<int64_t>(base.impl()->storage->nbytes) / esize;
  FLAME_CHECK(ok && lo >= 0 && hi < capacity, op, "view of shape ", sizes, ", strides ", strides,
              " and offset ", offset, " reaches outside its storage of ", capacity, " elements (base shape ",
              base.sizes(), ")");
}

Tensor make_view(const Tensor& t, Shape sizes, Shape strides, int64_t offset, const char* op) {
  check_view_in_storage(t, sizes, strides, offset, op);
  // A size-1 dim never moves by its stride, but kernels still scale every stride to bytes: one
  // too large for that (e.g. kept by a chain of views) becomes 1, so no byte stride overflows.
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 1 && (strides[d] > kMaxTensorBytes / 8 || strides[d] < -kMaxTensorBytes / 8)) strides[d] = 1;
  }
  auto impl = std::make_shared<TensorImpl>(t.impl()->storage, std::move(sizes), std::move(strides), offset,
                                           t.dtype());
  // Note [View base]: the root of the chain, so that base->base is always null.
  impl->base = t.impl()->base ? t.impl()->base : t.impl_ptr();
  impl->base_history_seen = impl->base->history_version;
  return Tensor(std::move(impl));
}

Tensor make_alias(const Tensor& t) {
  return Tensor(std::make_shared<TensorImpl>(t.impl()->storage, t.sizes(), t.strides(), t.storage_offset(),
                                             t.dtype()));
}

namespace {
std::shared_ptr<Storage> new_storage(const Shape& sizes, DType dtype, Device device, const char* op) {
  check_max_dims(sizes, op);
  const std::size_t nbytes = static_cast<std::size_t>(shape_nbytes(sizes, dtype, op));
#ifndef FLAME_WITH_CUDA
  // The cause first: no allocator failed, there is no device backend at all.
  FLAME_CHECK(device.is_cpu(), op, "this build has no CUDA support (FLAME was configured with -DFLAME_CUDA=OFF), so a ",
              dtype_name(dtype), " tensor of shape ", sizes, " cannot be placed on ", device.str(),
              "; keep it on the CPU, or use a build with CUDA");
#endif
  profiler_detail::set_current_op(op);  // Note [Allocation context] in src/profiler/memory_profiler.cpp
  try {
    std::shared_ptr<Storage> s = allocate_storage(device, nbytes);
    if (auto* tr = compile_detail::active_tracer()) compile_detail::trace_new_storage(*tr, s.get(), op);
    return s;
  } catch (const std::exception& e) {  // flame::Error or std::bad_alloc: say which op and shape
    std::ostringstream os;
    os << op << ": ";
    detail::append(os, "cannot allocate a ", dtype_name(dtype), " tensor of shape ", sizes, " (", nbytes, " bytes) on ",
                   device.str(), ": ", e.what());
    // Out of memory stays itself (a caller may catch it to try a smaller layout).
    if (dynamic_cast<const OutOfMemoryError*>(&e) != nullptr || dynamic_cast<const std::bad_alloc*>(&e) != nullptr)
      throw OutOfMemoryError(os.str());
    throw Error(os.str());
  }
}
}  // namespace

Tensor make_empty(const Shape& sizes, DType dtype, Device device, const char* op) {
  auto storage = new_storage(sizes, dtype, device, op);
  return Tensor(std::make_shared<TensorImpl>(std::move(storage), sizes, contiguous_strides(sizes), 0, dtype));
}

Tensor make_empty(Shape&& sizes, DType dtype, Device device, const char* op) {
  auto storage = new_storage(sizes, dtype, device, op);
  Shape strides = contiguous_strides(sizes);
  return Tensor(std::make_shared<TensorImpl>(std::move(storage), std::move(sizes), std::move(strides), 0, dtype));
}

bool is_non_overlapping_and_dense(const Shape& sizes, const Shape& strides) {
  if (sizes.size() != strides.size()) return false;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with size > 1
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return true;
    if (sizes[d] != 1) dims.emplace_back(strides[d], sizes[d]);
  }
  // Equal strides on two dims of size > 1 overlap, whatever the order the sort leaves them in.
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) return false;
    if (__builtin_mul_overflow(expected, size, &expected)) return false;
  }
  return true;
}

bool is_non_overlapping_and_dense(const Tensor& t) {
  FLAME_CHECK(t.defined(), "is_non_overlapping_and_dense", "called on an undefined tensor");
  return is_non_overlapping_and_dense(t.sizes(), t.strides());
}

bool same_dense_layout(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || a.sizes() != b.sizes()) return false;
  if (!is_non_overlapping_and_dense(a) || !is_non_overlapping_and_dense(b)) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.sizes()[d] != 1 && a.strides()[d] != b.strides()[d]) return false;
  }
  return true;
}

Tensor make_empty_strided(const Shape& sizes, const Shape& strides, DType dtype, Device device, const char* op) {
  FLAME_CHECK(is_non_overlapping_and_dense(sizes, strides), op, "strides ", strides,
              " are not a non-overlapping dense layout of shape ", sizes);
  // Dense: the elements fill exactly numel() slots starting at offset 0, so the storage of a
  // contiguous tensor of this shape holds them.
  auto storage = new_storage(sizes, dtype, device, op);
  return Tensor(std::make_shared<TensorImpl>(std::move(storage), sizes, strides, 0, dtype));
}

Tensor make_empty_in_layout_of(const Tensor& t, DType dtype, Device device, const char* op) {
  FLAME_CHECK(t.defined(), op, "called on an undefined tensor");
  if (!t.is_contiguous() && is_non_overlapping_and_dense(t)) {
    return make_empty_strided(t.sizes(), t.strides(), dtype, device, op);
  }
  return make_empty(t.sizes(), dtype, device, op);
}

void bump_version(const Tensor& t) {
  if (auto* tr = compile_detail::active_tracer()) compile_detail::trace_fail(*tr, "an in-place write (a replay would skip it)");
  t.impl()->storage->version.fetch_add(1);
}

namespace {
constexpr int64_t kOverlapEnumerationLimit = int64_t{1} << 22;

enum class Overlap { no, yes, too_large };

// Note [Internal overlap].
Overlap internal_overlap(const Shape& sizes, const Shape& strides) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (|stride|, size) of dims with size > 1
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return Overlap::no;
    if (sizes[d] == 1) continue;
    if (strides[d] == 0) return Overlap::yes;
    dims.emplace_back(std::llabs(strides[d]), sizes[d]);
  }
  std::sort(dims.begin(), dims.end());
  // Span of the first k dims (in element units; overflow-safe: a span past int64 cannot be
  // exceeded by any stride, so it ends the peeling).
  auto span_below = [&](std::size_t k) {
    int64_t span = 0;
    for (std::size_t i = 0; i < k; ++i) {
      int64_t term = 0;
      if (__builtin_mul_overflow(dims[i].first, dims[i].second - 1, &term) ||
          __builtin_add_overflow(span, term, &span)) {
        return std::numeric_limits<int64_t>::max();
      }
    }
    return span;
  };
  std::size_t keep = dims.size();
  while (keep > 0 && dims[keep - 1].first > span_below(keep - 1)) --keep;
  if (keep == 0) return Overlap::no;
  for (std::size_t i = 0; i < keep; ++i) {
    for (std::size_t j = 0; j < keep; ++j) {
      if (i != j && dims[i].first % dims[j].first == 0 && dims[i].first / dims[j].first < dims[j].second) {
        return Overlap::yes;
      }
    }
  }
  int64_t count = 1;
  for (std::size_t i = 0; i < keep; ++i) {
    if (__builtin_mul_overflow(count, dims[i].second, &count) || count > kOverlapEnumerationLimit) {
      return Overlap::too_large;
    }
  }
  std::vector<int64_t> offsets = {0};
  offsets.reserve(static_cast<std::size_t>(count));
  for (std::size_t i = 0; i < keep; ++i) {
    const std::size_t n = offsets.size();
    for (int64_t k = 1; k < dims[i].second; ++k) {
      for (std::size_t j = 0; j < n; ++j) offsets.push_back(offsets[j] + k * dims[i].first);
    }
  }
  std::sort(offsets.begin(), offsets.end());
  return std::adjacent_find(offsets.begin(), offsets.end()) != offsets.end() ? Overlap::yes : Overlap::no;
}
}  // namespace

bool has_internal_overlap(const Shape& sizes, const Shape& strides) {
  return internal_overlap(sizes, strides) != Overlap::no;
}

void check_no_internal_overlap(const Tensor& t, const char* op) {
  if (t.is_contiguous()) return;  // the common destination: decided without building the dim list
  const Overlap o = internal_overlap(t.sizes(), t.strides());
  FLAME_CHECK(o != Overlap::yes, op, "cannot write in place into a tensor whose elements overlap (shape ", t.sizes(),
              ", strides ", t.strides(), ": an expanded or overlapping-window view); call clone() first");
  FLAME_CHECK(o != Overlap::too_large, op, "cannot prove that the elements of the destination (shape ", t.sizes(),
              ", strides ", t.strides(), ") do not overlap (more than ", kOverlapEnumerationLimit,
              " offsets to compare); call clone() first");
}

void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  FLAME_CHECK(a.device() == b.device(), op, "expected all tensors on one device, got ",
              a.device().str(), " and ", b.device().str());
}

// ---- Tensor metadata ----
Tensor::Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

Tensor& Tensor::operator=(const Tensor& src) && {
  FLAME_CHECK(defined(), "operator=", "assigning to an undefined temporary tensor");
  return copy_(src);
}
Tensor& Tensor::operator=(Scalar value) && {
  FLAME_CHECK(defined(), "operator=", "assigning to an undefined temporary tensor");
  return fill_(value);
}

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
  // An empty view may carry any offset (make_view checks only views that reach an element).
  if (impl_->numel == 0) return impl_->storage->data.get();
  return static_cast<char*>(impl_->storage->data.get()) + impl_->offset * static_cast<int64_t>(element_size());
}
bool Tensor::shares_storage(const Tensor& o) const {
  return defined() && o.defined() && impl_->storage == o.impl_->storage;
}
uint64_t Tensor::version() const {
  FLAME_REQUIRE_DEFINED("version");
  return impl_->storage->version.load();
}

Tensor Tensor::from_blob(void* data, const Shape& shape, DType dtype, Device device) {
  const int64_t nbytes = shape_nbytes(shape, dtype, "from_blob");
  FLAME_CHECK(data != nullptr || nbytes == 0, "from_blob", "null data pointer for shape ", shape, " of dtype ",
              dtype_name(dtype));
  FLAME_CHECK(reinterpret_cast<std::uintptr_t>(data) % dtype_size(dtype) == 0, "from_blob", "data pointer ", data,
              " is not aligned to the ", dtype_size(dtype), "-byte elements of dtype ", dtype_name(dtype));
  // A no-op deleter: the caller owns the memory (see tensor.h).
  auto storage = std::make_shared<Storage>(std::shared_ptr<void>(data, [](void*) {}),
                                           static_cast<std::size_t>(nbytes), device);
  return Tensor(std::make_shared<TensorImpl>(std::move(storage), shape, contiguous_strides(shape), 0, dtype));
}

Tensor Tensor::from_blob(void* data, const Shape& shape, TensorOptions opts) {
  return from_blob(data, shape, opts.dtype_or(DType::f32), opts.device);
}

}  // namespace flame
