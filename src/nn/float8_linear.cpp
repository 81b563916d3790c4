// Linear's 8-bit float weight (Note [Float8 Linear] in flame/nn/float8.h): quantisation in place,
// the forward's choice between the ordinary and the 8-bit linear, the dense weight for DoRA.
#include "flame/grad_mode.h"
#include "flame/nn/float8.h"
#include "flame/nn/linear.h"
#include "flame/ops.h"

namespace flame::nn {

void Linear::to_float8(const Float8Options& options) {
  const char* op = "Linear::to_float8";
  FLAME_CHECK(flame::is_float8(options.dtype), op, "dtype must be f8_e4m3fn or f8_e5m2, got ",
              dtype_name(options.dtype));
  FLAME_CHECK(flame::is_float8(options.grad_dtype), op, "grad_dtype must be f8_e4m3fn or f8_e5m2, got ",
              dtype_name(options.grad_dtype));
  if (is_float8()) {
    FLAME_CHECK(options.dtype == weight_.dtype(), op, "this Linear (", extra_repr(), ") already stores its weight as ",
                dtype_name(weight_.dtype()), "; it cannot be requantised to ", dtype_name(options.dtype));
    float8_ = options;
    return;
  }
  FLAME_CHECK(!weight_.requires_grad(), op, "the weight of this Linear (", extra_repr(),
              ") requires a gradient; an 8-bit weight is frozen: freeze it first (requires_grad_(false), or attach "
              "an adapter with apply_lora)");
  FLAME_CHECK(!merged_, op, "this Linear (", extra_repr(), ") has its adapter merged; unmerge it first");
  FLAME_CHECK(is_floating(weight_.dtype()), op, "the weight must be floating, got ", dtype_name(weight_.dtype()));
  NoGradGuard no_grad;
  const Tensor s = float8_scale(weight_.detach(), options.dtype, 0);  // [out, 1]
  set_float8_weight(flame::to_float8(weight_.detach(), options.dtype, s), s, options);
}

void Linear::set_float8_weight(const Tensor& q, const Tensor& scale, const Float8Options& options) {
  const char* op = "Linear::set_float8_weight";
  FLAME_CHECK(q.defined() && flame::is_float8(q.dtype()) && q.dim() == 2 && q.size(0) == out_features_ &&
                  q.size(1) == in_features_,
              op, "expected an 8-bit weight [", out_features_, ", ", in_features_, "] for this Linear (", extra_repr(),
              "), got ", q.defined() ? dtype_name(q.dtype()) : "undefined", " ",
              q.defined() ? shape_str(q.sizes()) : "");
  FLAME_CHECK(scale.defined() && is_floating(scale.dtype()) && (scale.numel() == 1 || scale.numel() == out_features_),
              op, "scale must be floating with ", out_features_, " values or one, got ",
              scale.defined() ? shape_str(scale.sizes()) : "undefined");
  FLAME_CHECK(flame::is_float8(options.grad_dtype), op, "grad_dtype must be f8_e4m3fn or f8_e5m2, got ",
              dtype_name(options.grad_dtype));
  FLAME_CHECK(!merged_, op, "this Linear (", extra_repr(), ") has its adapter merged; unmerge it first");
  Tensor w = weight_;
  w.requires_grad_(false);
  NoGradGuard no_grad;
  weight_.set_data(q.detach().to(weight_.device()).contiguous());
  // An owning copy: the buffer must not alias the caller's tensor, and a view could not take new
  // data (set_data: Module::to, block swapping).
  const Tensor s = scale.detach().to(DType::f32).to(weight_.device()).reshape({-1}).expand({out_features_}).contiguous().clone();
  if (is_float8()) {
    weight_scale_.set_data(s);
  } else {
    weight_scale_ = register_buffer("weight_scale", s);
  }
  float8_ = options;
  float8_.dtype = q.dtype();
}

Tensor Linear::dense_weight(DType dtype) const {
  NoGradGuard no_grad;
  if (!is_float8()) return weight_.detach().to(dtype);
  return from_float8(weight_, weight_scale_.reshape({out_features_, 1}), dtype);
}

Tensor Linear::base_forward(const Tensor& x, const Tensor& bias) const {
  if (!is_float8()) return functional::linear(x, weight_, bias);
  return functional::linear_float8(x, weight_, weight_scale_, bias, float8_.compute, float8_.grad_dtype);
}

TensorOptions Linear::adapter_options() const {
  return TensorOptions(is_float8() ? DType::f32 : weight_.dtype(), weight_.device());
}

}  // namespace flame::nn
