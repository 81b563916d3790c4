// Tensor's factories (empty, zeros, full, arange, linspace, eye, from_vec) and conversions (to,
// clone, contiguous, the host copy of to_vec/item): ops that allocate, launch a kernel and, for the
// conversions, record a gradient and report to the tracer; the Tensor class itself is core
// (src/core/tensor.cpp), which reaches no backend, rule or tracer for them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "flame/ops.h"
#include "flame/tensor.h"
#include "src/ops/grad_hooks.h"
#include "src/backend/backend.h"
#include "src/core/checked_math.h"
#include "src/core/tensor_impl.h"
#include "src/ops/trace_hooks.h"

namespace flame {

// ---- factories ----
namespace {
// Each factory passes its own name so that errors say "zeros: ..." rather than "empty: ...".
Tensor filled(const Shape& shape, Scalar value, TensorOptions opts, const char* op) {
  Tensor t = make_empty(shape, opts.dtype_or(DType::f32), opts.device, op);
  if (t.numel() > 0) backend::backend_for(t.device()).fill(t, value);
  return t;
}

// Length of integer arange [start, end) by step, exactly (no int64 overflow, no double rounding).
int64_t integer_arange_length(int64_t start, int64_t end, int64_t step) {
  const __int128 span = static_cast<__int128>(end) - start;
  const __int128 n = span == 0 ? 0 : (span - (step > 0 ? 1 : -1)) / step + 1;
  FLAME_CHECK(n <= std::numeric_limits<int64_t>::max(), "arange", "[", start, ", ", end, ") by step ", step,
              " has more elements than int64 can count");
  return static_cast<int64_t>(n);
}
}  // namespace

Tensor Tensor::empty(const Shape& shape, TensorOptions opts) {
  const DType dt = opts.dtype_or(DType::f32);
  // A bool byte other than 0 or 1 is undefined behaviour to read, so bool tensors start as false;
  // other dtypes stay uninitialised (any bit pattern is a valid value).
  if (is_bool(dt)) return filled(shape, false, opts, "empty");
  return make_empty(shape, dt, opts.device, "empty");
}
Tensor Tensor::full(const Shape& shape, Scalar value, TensorOptions opts) { return filled(shape, value, opts, "full"); }
Tensor Tensor::zeros(const Shape& shape, TensorOptions opts) { return filled(shape, 0, opts, "zeros"); }
Tensor Tensor::ones(const Shape& shape, TensorOptions opts) { return filled(shape, 1, opts, "ones"); }
Tensor Tensor::scalar(Scalar value, TensorOptions opts) {
  if (!opts.dtype) {
    opts.dtype = value.is_floating() ? DType::f32 : (value.is_bool() ? DType::boolean : DType::i64);
  }
  return filled({}, value, opts, "scalar");
}

Tensor Tensor::arange(Scalar end, TensorOptions opts) { return arange(0, end, 1, opts); }
Tensor Tensor::arange(Scalar start, Scalar end, Scalar step, TensorOptions opts) {
  const bool all_int = !start.is_floating() && !end.is_floating() && !step.is_floating();
  const DType dt = opts.dtype_or(all_int ? DType::i64 : DType::f32);
  const double s = start.to_double(), e = end.to_double(), st = step.to_double();
  FLAME_CHECK(std::isfinite(s) && std::isfinite(e) && std::isfinite(st), "arange", "start ", s, ", end ", e,
              " and step ", st, " must be finite");
  FLAME_CHECK(st != 0.0, "arange", "step must be non-zero");
  FLAME_CHECK((st > 0 && e >= s) || (st < 0 && e <= s), "arange", "upper bound ", e,
              " and lower bound ", s, " inconsistent with step sign ", st);
  int64_t n = 0;
  if (all_int) {
    n = integer_arange_length(start.to_int(), end.to_int(), step.to_int());
  } else {
    const double len = std::ceil((e - s) / st);
    FLAME_CHECK(len < 9.2e18, "arange", "[", s, ", ", e, ") by step ", st, " has too many elements (", len, ")");
    n = static_cast<int64_t>(len);
  }
  Tensor t = make_empty({std::max<int64_t>(n, 0)}, dt, opts.device, "arange");
  constexpr int64_t lim = int64_t{1} << 53;  // doubles hold every integer up to here
  auto beyond = [](int64_t v) { return v < -lim || v > lim; };
  if (all_int && !is_floating(dt) && t.numel() > 0 &&
      (beyond(start.to_int()) || beyond(end.to_int()) || beyond(step.to_int()))) {
    // Values past 2^53 are not exact in iota's doubles: start + i * step in i64 (the index count
    // itself is far below 2^53), then converted (Note [Exact integer scalars] in elementwise.cpp).
    Tensor idx = make_empty({n}, DType::i64, opts.device, "arange");
    backend::backend_for(idx.device()).iota(idx, 0.0, 1.0);
    t.copy_(idx * step + start);
    return t;
  }
  if (t.numel() > 0) backend::backend_for(t.device()).iota(t, s, st);
  return t;
}

Tensor Tensor::linspace(double start, double end, int64_t steps, TensorOptions opts) {
  FLAME_CHECK(steps >= 0, "linspace", "number of steps must be non-negative, got ", steps);
  Tensor t = make_empty({steps}, opts.dtype_or(DType::f32), opts.device, "linspace");
  if (steps == 0) return t;
  const double step = steps > 1 ? (end - start) / static_cast<double>(steps - 1) : 0.0;
  backend::backend_for(t.device()).iota(t, start, step);
  return t;
}

Tensor Tensor::eye(int64_t n, int64_t m, TensorOptions opts) {
  if (m < 0) m = n;
  FLAME_CHECK(n >= 0, "eye", "n must be non-negative, got ", n);
  shape_nbytes({n, m}, opts.dtype_or(DType::f32), "eye");
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
  Tensor t = make_empty(shape, dtype, device, "from_vec");
  if (n > 0) backend::backend_for(device).copy_from_host(t, host);
  return t;
}

// ---- conversions ----
Tensor Tensor::to(Device device) const {
  if (device == this->device()) return *this;
  if (auto* tr = compile_detail::active_tracer()) compile_detail::trace_fail(*tr, "a device transfer (to " + device.str() + ")");
  Tensor src = contiguous();
  Tensor dst = make_empty(sizes(), dtype(), device, "to");
  rules::copy(dst, "to_device", *this);
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
  Tensor dst = make_empty(sizes(), dt, device(), "to");
  if (numel() > 0) backend::backend_for(device()).copy(dst, *this);
  if (auto* tr = compile_detail::active_tracer()) compile_detail::trace_cast(*tr, dst, *this);
  return rules::copy(dst, "to_dtype", *this);
}

Tensor Tensor::to(DType dt, Device dev) const { return to(dt).to(dev); }

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor Tensor::clone() const {
  Tensor dst = make_empty(sizes(), dtype(), device(), "clone");
  if (numel() > 0) backend::backend_for(device()).copy(dst, *this);
  if (auto* tr = compile_detail::active_tracer()) compile_detail::trace_cast(*tr, dst, *this);  // a copy fuses
  return rules::copy(dst, "clone", *this);
}

Tensor Tensor::host_copy(DType dt) const {
  if (auto* tr = compile_detail::active_tracer()) compile_detail::trace_fail(*tr, "a host read (to_vec/item): values cannot be traced");
  Tensor c = to(Device::cpu()).to(dt);
  return c.contiguous();
}

}  // namespace flame
