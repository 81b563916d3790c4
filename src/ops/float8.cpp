// The scaled 8-bit float casts of flame/ops.h (Note [Float8 dtypes] in flame/dtype.h): ordinary ops
// in f32 around the casts to and from the 8-bit dtypes, which the backends' copy kernels do.
#include <cmath>
#include <limits>

#include "flame/grad_mode.h"
#include "flame/ops.h"
#include "src/backend/fused/float8.h"
#include "src/core/tensor_impl.h"

namespace flame {
namespace {

void check_float8(const char* op, DType f8) {
  FLAME_CHECK(is_float8(f8), op, "expected an 8-bit float dtype (f8_e4m3fn or f8_e5m2), got ", dtype_name(f8));
}

void check_scale(const char* op, const Tensor& scale, const Tensor& x) {
  FLAME_CHECK(scale.defined() && is_floating(scale.dtype()), op, "scale must be a floating tensor, got ",
              scale.defined() ? dtype_name(scale.dtype()) : "an undefined tensor");
  FLAME_CHECK(scale.device() == x.device(), op, "scale is on ", scale.device().str(), " but the tensor is on ",
              x.device().str());
  FLAME_CHECK(scale.dim() <= x.dim(), op, "scale of shape ", scale.sizes(), " does not broadcast against ",
              x.sizes());
  for (int64_t i = 1; i <= scale.dim(); ++i) {
    const int64_t s = scale.size(-i), d = x.size(-i);
    FLAME_CHECK(s == 1 || s == d, op, "scale of shape ", scale.sizes(), " does not broadcast against ", x.sizes(),
                " (one per tensor: 0-d; one per channel: size 1 in the other dims)");
  }
}

}  // namespace

double float8_max(DType f8) {
  check_float8("float8_max", f8);
  return f8 == DType::f8_e4m3fn ? 448.0 : 57344.0;
}

Tensor float8_scale(const Tensor& x, DType f8, std::optional<int64_t> dim) {
  const char* op = "float8_scale";
  check_float8(op, f8);
  FLAME_CHECK(x.defined() && is_floating(x.dtype()), op, "expected a floating tensor, got ",
              x.defined() ? dtype_name(x.dtype()) : "an undefined tensor");
  NoGradGuard no_grad;
  const Tensor a = x.to(DType::f32).abs();
  Tensor amax;
  if (dim) {
    FLAME_CHECK(x.dim() >= 1 && *dim >= -x.dim() && *dim < x.dim(), op, "dim ", *dim, " is out of range for shape ",
                x.sizes());
    const int64_t d = *dim < 0 ? *dim + x.dim() : *dim;
    Shape others;
    for (int64_t i = 0; i < x.dim(); ++i)
      if (i != d) others.push_back(i);
    amax = others.empty() ? a : a.max(others, /*keepdim=*/true);
  } else {
    amax = a.max();
  }
  return where(amax == 0.0, ones_like(amax), amax / float8_max(f8));  // NaN and inf stay
}

Tensor to_float8(const Tensor& x, DType f8, const Tensor& scale) {
  const char* op = "to_float8";
  check_float8(op, f8);
  FLAME_CHECK(x.defined() && is_floating(x.dtype()), op, "expected a floating tensor, got ",
              x.defined() ? dtype_name(x.dtype()) : "an undefined tensor");
  check_scale(op, scale, x);
  NoGradGuard no_grad;
  const double m = float8_max(f8);
  return (x.to(DType::f32) / scale.to(DType::f32)).clamp(-m, m).to(f8);
}

Tensor from_float8(const Tensor& q, const Tensor& scale, DType out) {
  const char* op = "from_float8";
  FLAME_CHECK(q.defined() && is_float8(q.dtype()), op, "expected an 8-bit float tensor, got ",
              q.defined() ? dtype_name(q.dtype()) : "an undefined tensor");
  FLAME_CHECK(is_floating(out), op, "out must be a floating dtype, got ", dtype_name(out));
  check_scale(op, scale, q);
  NoGradGuard no_grad;
  // One scale, or one per row of a matrix: the fused pass (the same f32 math, one rounding to out).
  const bool per_row = q.dim() == 2 && scale.dim() == 2 && scale.size(0) == q.size(0) && scale.size(1) == 1;
  if (q.dim() >= 1 && (scale.numel() == 1 || per_row)) {
    Tensor y = make_empty(q.sizes(), out, q.device(), op);
    if (backend::fused::float8_dequantize_rows.try_run(q.device(), y, q.contiguous(),
                                                       scale.detach().to(DType::f32).contiguous()))
      return y;
  }
  const Tensor y = q.to(DType::f32) * scale.to(DType::f32);
  return y.dtype() == out ? y : y.to(out);
}

}  // namespace flame
