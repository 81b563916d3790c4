// Zero-copy views: each returns a TensorImpl over the same Storage with new sizes/strides/offset.
#include <algorithm>
#include <functional>
#include <optional>

#include "flame/ops.h"
#include "src/core/grad_state.h"
#include "src/ops/grad_hooks.h"
#include "src/core/checked_math.h"
#include "src/ops/trace_hooks.h"
#include "src/core/tensor_impl.h"

// flame::compile replays a view taken while tracing as an eager step (the view op itself, so
// autograd sees it): Note [Tracing] in src/compile/trace.cpp.
#define FLAME_TRACE_VIEW(name, call)                                                             \
  if (auto* tracer_ = compile_detail::active_tracer()) {                                         \
    return compile_detail::trace_eager_op(*tracer_, name, {*this},                               \
                                          [=](const TensorList& in_) { return in_[0].call; });   \
  }

namespace flame {
namespace {

// Views read the input's geometry first: an undefined input is named by the view's own op.
void require_defined(const Tensor& t, const char* op) {
  FLAME_CHECK(t.defined(), op, "called on an undefined tensor");
}

// Fills in a single -1 entry from the element count; checks the total.
Shape infer_shape(const Shape& shape, int64_t numel, const char* op, const Shape& from) {
  Shape out = shape;
  int64_t known = 1, infer = -1;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      FLAME_CHECK(infer < 0, op, "only one dimension can be -1, got shape ", shape);
      infer = static_cast<int64_t>(i);
    } else {
      FLAME_CHECK(out[i] >= 0, op, "invalid shape ", shape);
      known = checked_mul(known, out[i], op, "the product of the sizes");
    }
  }
  if (infer >= 0) {
    FLAME_CHECK(known != 0 && numel % known == 0, op, "shape ", shape,
                " is invalid for input of shape ", from, " (", numel, " elements)");
    out[infer] = numel / known;
  }
  FLAME_CHECK(shape_numel(out, op) == numel, op, "shape ", shape, " is invalid for input of shape ",
              from, " (", numel, " elements)");
  return out;
}

// Strides that let `new_shape` view memory laid out as (old_shape, old_strides), if any exist.
std::optional<Shape> view_strides(const Shape& old_shape, const Shape& old_strides, const Shape& new_shape) {
  const int64_t ndim_new = static_cast<int64_t>(new_shape.size());
  Shape new_strides(new_shape.size());
  if (old_shape.empty()) return Shape(new_shape.size(), 1);
  if (shape_numel(old_shape) == 0) return contiguous_strides(new_shape);
  int64_t view_d = ndim_new - 1;
  int64_t chunk_base_stride = old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t tensor_d = static_cast<int64_t>(old_shape.size()) - 1; tensor_d >= 0; --tensor_d) {
    tensor_numel *= old_shape[tensor_d];
    if (tensor_d == 0 || (old_shape[tensor_d - 1] != 1 &&
                          old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d] == 1)) {
        // A size-1 dim's large stride can make this product overflow: then no view is offered.
        const auto stride = mul_overflows(view_numel, chunk_base_stride);
        if (!stride) return std::nullopt;
        new_strides[view_d] = *stride;
        view_numel *= new_shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (tensor_d > 0) {
        chunk_base_stride = old_strides[tensor_d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return new_strides;
}


// stride x step for a dim that takes every step-th element (slice, unfold), as PyTorch. A dim of
// size <= 1 never moves by its stride: when the product (in bytes) would not fit, it keeps the
// old stride rather than one that overflows in the kernels' byte arithmetic. A longer dim has
// step < its input size, so the product stays inside the storage.
int64_t stepped_stride(int64_t stride, int64_t step, int64_t size, const char* op) {
  if (size > 1) return checked_mul(stride, step, op, "stride x step");
  const auto s = mul_overflows(stride, step);
  return s && *s <= kMaxTensorBytes / 8 && *s >= -kMaxTensorBytes / 8 ? *s : stride;
}

// A view of `base`, recorded for autograd when base needs a gradient: its rule (`kind`, `args`) is
// in src/autograd/rules/views.cpp (Note [Gradient hooks]). An unrecorded view, on the per-op host
// path, makes nothing for it.
Tensor grad_view(const Tensor& base, Shape sizes, Shape strides, int64_t offset, const char* name,
                 rules::ViewGrad kind, const rules::ViewArgs& args = {}) {
  Tensor v = make_view(base, std::move(sizes), std::move(strides), offset, name);
  if (!is_floating(v.dtype()) || !needs_grad({base})) return v;
  rules::view(v, name, kind, base, args);
  return v;
}

}  // namespace

Tensor Tensor::view(const Shape& shape) const {
  require_defined(*this, "view");
  FLAME_TRACE_VIEW("view", view(shape))
  Shape target = infer_shape(shape, numel(), "view", sizes());
  auto strides = view_strides(sizes(), this->strides(), target);
  FLAME_CHECK(strides.has_value(), "view", "shape ", target, " is not compatible with input of shape ",
              sizes(), " and strides ", this->strides(), "; use reshape() (which may copy)");
  return grad_view(*this, std::move(target), std::move(*strides), storage_offset(), "view", rules::ViewGrad::reshape);
}

Tensor Tensor::reshape(const Shape& shape) const {
  require_defined(*this, "reshape");
  FLAME_TRACE_VIEW("reshape", reshape(shape))
  Shape target = infer_shape(shape, numel(), "reshape", sizes());
  if (auto strides = view_strides(sizes(), this->strides(), target)) {
    return grad_view(*this, std::move(target), std::move(*strides), storage_offset(), "reshape", rules::ViewGrad::reshape);
  }
  return clone().view(target);
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  require_defined(*this, "transpose");
  FLAME_TRACE_VIEW("transpose", transpose(d0, d1))
  const int64_t n = dim();
  if (n == 0) {
    wrap_dim(d0, 0, "transpose");
    wrap_dim(d1, 0, "transpose");
    return grad_view(*this, sizes(), strides(), storage_offset(), "transpose", rules::ViewGrad::identity);
  }
  d0 = wrap_dim(d0, n, "transpose");
  d1 = wrap_dim(d1, n, "transpose");
  Shape sz = sizes(), st = strides();
  std::swap(sz[d0], sz[d1]);
  std::swap(st[d0], st[d1]);
  return grad_view(*this, std::move(sz), std::move(st), storage_offset(), "transpose", rules::ViewGrad::transpose, {d0, d1});
}

Tensor Tensor::t() const {
  require_defined(*this, "t");
  FLAME_CHECK(dim() <= 2, "t", "expects a tensor with <= 2 dims, got shape ", sizes());
  return dim() < 2 ? grad_view(*this, sizes(), strides(), storage_offset(), "t", rules::ViewGrad::identity) : transpose(0, 1);
}

Tensor Tensor::permute(const Shape& dims) const {
  require_defined(*this, "permute");
  FLAME_TRACE_VIEW("permute", permute(dims))
  const int64_t n = dim();
  FLAME_CHECK(static_cast<int64_t>(dims.size()) == n, "permute", "number of dims ", dims,
              " does not match tensor of shape ", sizes());
  Shape sz(n), st(n);
  std::vector<bool> seen(n, false);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t d = wrap_dim(dims[i], n, "permute");
    FLAME_CHECK(!seen[d], "permute", "repeated dim in ", dims);
    seen[d] = true;
    sz[i] = sizes()[d];
    st[i] = strides()[d];
  }
  return grad_view(*this, std::move(sz), std::move(st), storage_offset(), "permute", rules::ViewGrad::permute, {.dims = &dims});
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  require_defined(*this, "narrow");
  FLAME_TRACE_VIEW("narrow", narrow(d, start, length))
  FLAME_CHECK(dim() > 0, "narrow", "cannot narrow a 0-d tensor");
  d = wrap_dim(d, dim(), "narrow");
  const int64_t n = sizes()[d];
  if (start < 0) start += n;
  // length <= n - start, not start + length <= n: the sum can overflow.
  FLAME_CHECK(start >= 0 && start <= n && length >= 0 && length <= n - start, "narrow", "start ", start,
              " + length ", length, " exceeds dimension ", d, " of size ", n, " (shape ", sizes(), ")");
  Shape sz = sizes();
  sz[d] = length;
  Tensor v = make_view(*this, std::move(sz), strides(), storage_offset() + start * strides()[d], "narrow");
  if (!is_floating(v.dtype()) || !needs_grad({*this})) return v;
  rules::narrow(v, *this, d, start);
  return v;
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  require_defined(*this, "slice");
  FLAME_TRACE_VIEW("slice", slice(d, start, end, step))
  FLAME_CHECK(dim() > 0, "slice", "cannot slice a 0-d tensor");
  d = wrap_dim(d, dim(), "slice");
  FLAME_CHECK(step > 0, "slice", "step must be positive, got ", step);
  const int64_t n = sizes()[d];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape sz = sizes(), st = strides();
  sz[d] = ceil_div(end - start, step);
  st[d] = stepped_stride(st[d], step, sz[d], "slice");
  return grad_view(*this, std::move(sz), std::move(st), storage_offset() + start * strides()[d], "slice", rules::ViewGrad::slice, {d, start, end, step});
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  require_defined(*this, "select");
  FLAME_TRACE_VIEW("select", select(d, index))
  FLAME_CHECK(dim() > 0, "select", "cannot select from a 0-d tensor");
  d = wrap_dim(d, dim(), "select");
  const int64_t n = sizes()[d];
  FLAME_CHECK(index >= -n && index < n, "select", "index ", index, " out of range for dimension ",
              d, " of size ", n, " (shape ", sizes(), ")");
  if (index < 0) index += n;
  Shape sz = sizes(), st = strides();
  const int64_t offset = storage_offset() + index * st[d];
  sz.erase(sz.begin() + d);
  st.erase(st.begin() + d);
  return grad_view(*this, std::move(sz), std::move(st), offset, "select", rules::ViewGrad::select, {d, index});
}

Tensor Tensor::expand(const Shape& shape) const {
  require_defined(*this, "expand");
  const int64_t n = dim(), m = static_cast<int64_t>(shape.size());
  FLAME_CHECK(m >= n, "expand", "target shape ", shape, " has fewer dims than the tensor's shape ", sizes());
  Shape sz(m), st(m);
  for (int64_t i = m - 1; i >= 0; --i) {
    const int64_t j = i - (m - n);
    const int64_t want = shape[i];
    if (j >= 0) {
      const int64_t have = sizes()[j];
      if (want == -1 || want == have) {
        sz[i] = have;
        st[i] = strides()[j];
      } else {
        FLAME_CHECK(have == 1 && want >= 0, "expand", "cannot expand shape ", sizes(), " to ", shape,
                    " (dim ", j, " has size ", have, ", only size-1 dims can be expanded)");
        sz[i] = want;
        st[i] = 0;
      }
    } else {
      FLAME_CHECK(want >= 0, "expand", "-1 is not allowed for new leading dims in ", shape);
      sz[i] = want;
      st[i] = 0;
    }
  }
  return grad_view(*this, std::move(sz), std::move(st), storage_offset(), "expand", rules::ViewGrad::expand);
}

Tensor Tensor::squeeze() const {
  require_defined(*this, "squeeze");
  Shape sz, st;
  for (int64_t i = 0; i < dim(); ++i) {
    if (sizes()[i] != 1) {
      sz.push_back(sizes()[i]);
      st.push_back(strides()[i]);
    }
  }
  return grad_view(*this, std::move(sz), std::move(st), storage_offset(), "squeeze", rules::ViewGrad::reshape);
}

Tensor Tensor::squeeze(int64_t d) const {
  require_defined(*this, "squeeze");
  FLAME_TRACE_VIEW("squeeze", squeeze(d))
  if (dim() == 0) {
    wrap_dim(d, 0, "squeeze");
    return grad_view(*this, sizes(), strides(), storage_offset(), "squeeze", rules::ViewGrad::reshape);
  }
  d = wrap_dim(d, dim(), "squeeze");
  if (sizes()[d] != 1) return grad_view(*this, sizes(), strides(), storage_offset(), "squeeze", rules::ViewGrad::reshape);
  Shape sz = sizes(), st = strides();
  sz.erase(sz.begin() + d);
  st.erase(st.begin() + d);
  return grad_view(*this, std::move(sz), std::move(st), storage_offset(), "squeeze", rules::ViewGrad::reshape);
}

Tensor Tensor::unsqueeze(int64_t d) const {
  require_defined(*this, "unsqueeze");
  FLAME_TRACE_VIEW("unsqueeze", unsqueeze(d))
  d = wrap_dim(d, dim() + 1, "unsqueeze");
  Shape sz = sizes(), st = strides();
  const int64_t new_stride = d < dim() ? mul_overflows(sizes()[d], strides()[d]).value_or(1) : 1;
  sz.insert(sz.begin() + d, 1);
  st.insert(st.begin() + d, new_stride);
  return grad_view(*this, std::move(sz), std::move(st), storage_offset(), "unsqueeze", rules::ViewGrad::reshape);
}

Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim) const {
  require_defined(*this, "flatten");
  FLAME_TRACE_VIEW("flatten", flatten(start_dim, end_dim))
  if (dim() == 0) return reshape({1});
  start_dim = wrap_dim(start_dim, dim(), "flatten");
  end_dim = wrap_dim(end_dim, dim(), "flatten");
  FLAME_CHECK(start_dim <= end_dim, "flatten", "start_dim ", start_dim, " must not exceed end_dim ", end_dim);
  Shape sz(sizes().begin(), sizes().begin() + start_dim);
  int64_t n = 1;
  for (int64_t i = start_dim; i <= end_dim; ++i) n = checked_mul(n, sizes()[i], "flatten", "the flattened size");
  sz.push_back(n);
  sz.insert(sz.end(), sizes().begin() + end_dim + 1, sizes().end());
  return reshape(sz);
}

Tensor Tensor::unflatten(int64_t d, const Shape& parts) const {
  require_defined(*this, "unflatten");
  FLAME_TRACE_VIEW("unflatten", unflatten(d, parts))
  FLAME_CHECK(dim() > 0, "unflatten", "cannot unflatten a 0-d tensor");
  d = wrap_dim(d, dim(), "unflatten");
  FLAME_CHECK(!parts.empty(), "unflatten", "sizes must be non-empty");
  // The sizes must multiply up to dim d alone (a check on the total would pass whenever another
  // dim is 0); a single -1 is inferred from dim d.
  const int64_t n = sizes()[d];
  Shape p = parts;
  int64_t known = 1, infer = -1;
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (p[i] == -1) {
      FLAME_CHECK(infer < 0, "unflatten", "only one size can be -1, got ", parts);
      infer = static_cast<int64_t>(i);
    } else {
      FLAME_CHECK(p[i] >= 0, "unflatten", "invalid sizes ", parts);
      known = checked_mul(known, p[i], "unflatten", "the product of the sizes");
    }
  }
  if (infer >= 0 && known != 0 && n % known == 0) p[infer] = n / known;
  FLAME_CHECK((infer < 0 || p[infer] != -1) && shape_numel(p, "unflatten") == n, "unflatten", "sizes ", parts,
              " don't multiply up to the size ", n, " of dim ", d, " (input shape ", sizes(), ")");
  Shape sz(sizes().begin(), sizes().begin() + d);
  sz.insert(sz.end(), p.begin(), p.end());
  sz.insert(sz.end(), sizes().begin() + d + 1, sizes().end());
  return view(sz);
}

Tensor Tensor::unfold(int64_t d, int64_t size, int64_t step) const {
  require_defined(*this, "unfold");
  d = wrap_dim(d, dim(), "unfold");  // a 0-d tensor takes dim 0 or -1 and unfolds as size 1
  const int64_t n = dim() == 0 ? 1 : sizes()[d];
  FLAME_CHECK(size >= 0 && size <= n, "unfold", "size ", size, " must be in [0, ", n, "] for dim ", d,
              " of the input of shape ", sizes());
  FLAME_CHECK(step > 0, "unfold", "step must be positive, got ", step);
  Shape sz = sizes(), st = strides();
  if (dim() == 0) return grad_view(*this, {size}, {1}, storage_offset(), "unfold", rules::ViewGrad::unfold, {d, size, step});
  sz[d] = (n - size) / step + 1;
  const int64_t base = st[d];
  st[d] = stepped_stride(base, step, sz[d], "unfold");
  sz.push_back(size);
  st.push_back(base);
  return grad_view(*this, std::move(sz), std::move(st), storage_offset(), "unfold", rules::ViewGrad::unfold, {d, size, step});
}

}  // namespace flame
