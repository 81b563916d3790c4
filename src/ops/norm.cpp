// Normalisation ops: layer_norm, rms_norm, group_norm, batch_norm (torch.nn.functional semantics).
//
// Note [Norm kernels]
// The op layer validates, makes x (and weight/bias) contiguous, allocates y and the statistics,
// and calls one backend kernel; the backward (src/autograd/rules/norm.cpp) is one backend call
// too. Backend contract: every tensor is contiguous and its shape is implied by the statistics:
//  - rows (layer_norm, rms_norm): rows = rstd.numel(), cols = x.numel() / rows; weight/bias hold
//    cols elements; mean is undefined for rms_norm;
//  - groups: x is [N, C, S...] with mean/rstd of N * groups elements; weight/bias [C];
//  - batch: x is [N, C, S...] with mean/rstd/var of C elements.
// Statistics are f32 for f32/bf16/f16 inputs and f64 for f64 (half inputs never accumulate in
// half); variances are biased (divided by the count), as PyTorch normalises. A non-contiguous
// input (channels-last, a transposed view) is copied once here: correct, and the kernels keep a
// single layout each.
#include <cmath>
#include <limits>

#include "flame/autograd.h"
#include "flame/nn/norm.h"
#include "flame/ops.h"
#include "src/ops/autocast_hooks.h"
#include "src/autograd/recompute.h"
#include "src/autograd/rules/norm.h"
#include "src/backend/backend.h"
#include "src/ops/trace_hooks.h"
#include "src/core/tensor_impl.h"

namespace flame::nn::functional {
namespace {

DType stat_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

void check_input(const Tensor& x, const char* op) {
  FLAME_CHECK(x.defined(), op, "got an undefined input");
  FLAME_CHECK(is_floating(x.dtype()), op, "expected a floating input (f32, f64, bf16, f16), got ",
              dtype_name(x.dtype()), " (shape ", x.sizes(), ")");
}

// weight/bias: undefined, or `shape`, x's dtype and device.
void check_param(const Tensor& p, const char* what, const Tensor& x, const Shape& shape, const char* op) {
  if (!p.defined()) return;
  FLAME_CHECK(p.sizes() == shape, op, what, " must have shape ", shape, ", got ", p.sizes(), " (input shape ",
              x.sizes(), ")");
  FLAME_CHECK(p.dtype() == x.dtype(), op, what, " has dtype ", dtype_name(p.dtype()), " but the input has ",
              dtype_name(x.dtype()), " (mixed dtypes are not supported; convert the parameter)");
  FLAME_CHECK(p.device() == x.device(), op, what, " is on ", p.device().str(), " but the input is on ",
              x.device().str());
}

Tensor contiguous_or_empty(const Tensor& t) { return t.defined() ? t.contiguous() : t; }

Tensor rows_norm(const char* op, const Tensor& x, const Shape& normalized_shape, const Tensor& weight,
                 const Tensor& bias, double eps, bool rms) {
  check_input(x, op);
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  bool match = k >= 1 && x.dim() >= k;
  for (int64_t i = 0; match && i < k; ++i) match = x.sizes()[x.dim() - k + i] == normalized_shape[i];
  FLAME_CHECK(match, op, "normalized_shape ", normalized_shape, " must be non-empty and equal the last dims of the input shape ",
              x.sizes());
  check_param(weight, "weight", x, normalized_shape, op);
  check_param(bias, "bias", x, normalized_shape, op);
  FLAME_CHECK(eps >= 0 && std::isfinite(eps), op, "eps must be finite and non-negative, got ", eps);
  int64_t rows = 1;
  for (int64_t d = 0; d < x.dim() - k; ++d) rows *= x.sizes()[d];
  const Tensor xc = x.contiguous(), wc = contiguous_or_empty(weight), bc = contiguous_or_empty(bias);
  Tensor y = make_empty(x.sizes(), x.dtype(), x.device(), op);
  const DType sd = stat_dtype(x.dtype());
  Tensor mean = rms ? Tensor() : make_empty({rows}, sd, x.device(), op);
  Tensor rstd = make_empty({rows}, sd, x.device(), op);
  if (x.numel() > 0) backend::backend_for(x.device()).norm_rows_forward(y, mean, rstd, xc, wc, bc, eps);
  rules::norm_rows(y, xc, wc, bc, mean, rstd);
  // Under autograd::RecomputeCheap a node that saves y keeps this call instead (Note [Recompute
  // cheap] in src/autograd/recompute.cpp); its inputs are what the norm node saves anyway.
  if (autograd_detail::should_mark_recomputable()) {
    autograd_detail::mark_recomputable(y, op, {xc, wc, bc}, [op, normalized_shape, eps, rms](const TensorList& in) {
      return rows_norm(op, in[0], normalized_shape, in[1], in[2], eps, rms);
    });
  }
  return y;
}

// N, C and S (the product of the trailing dims) of an [N, C, *] input.
struct ChannelShape {
  int64_t n, c, s;
};
ChannelShape channel_shape(const Tensor& x, const char* op) {
  FLAME_CHECK(x.dim() >= 2, op, "expected an input of at least 2 dims [N, C, *], got shape ", x.sizes());
  int64_t s = 1;
  for (int64_t d = 2; d < x.dim(); ++d) s *= x.sizes()[d];
  return {x.sizes()[0], x.sizes()[1], s};
}

// group_norm below its tracer and autocast steps (also the recipe of its marked output).
Tensor group_norm_impl(const Tensor& x, int64_t num_groups, const Tensor& weight, const Tensor& bias, double eps);

}  // namespace

Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight, const Tensor& bias, double eps) {
  if (auto* tr = compile_detail::active_tracer()) {  // replayed eagerly by flame::compile
    return compile_detail::trace_eager_op(*tr, "layer_norm", {x, weight, bias}, [normalized_shape, eps](const TensorList& in) {
      return layer_norm(in[0], normalized_shape, in[1], in[2], eps);
    });
  }
  if (amp::detail::should_autocast(x)) {  // Note [Autocast policy]: norms in f32
    amp::detail::AutocastOpScope scope;
    return layer_norm(amp::detail::cast_f32(x), normalized_shape, amp::detail::cast_f32(weight), amp::detail::cast_f32(bias), eps);
  }
  return rows_norm("layer_norm", x, normalized_shape, weight, bias, eps, /*rms=*/false);
}

Tensor rms_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight, std::optional<double> eps) {
  if (auto* tr = compile_detail::active_tracer()) {  // one opaque step of a flame::compile trace
    return compile_detail::trace_eager_op(*tr, "rms_norm", {x, weight}, [normalized_shape, eps](const TensorList& in) {
      return rms_norm(in[0], normalized_shape, in[1], eps);
    });
  }
  if (amp::detail::should_autocast(x)) {  // Note [Autocast policy]: norms in f32
    amp::detail::AutocastOpScope scope;
    return rms_norm(amp::detail::cast_f32(x), normalized_shape, amp::detail::cast_f32(weight), eps);
  }
  check_input(x, "rms_norm");
  double e = 0;
  if (eps) {
    e = *eps;
  } else {
    switch (x.dtype()) {  // torch.finfo(dtype).eps
      case DType::f64: e = std::numeric_limits<double>::epsilon(); break;
      case DType::bf16: e = 0.0078125; break;
      case DType::f16: e = 0.0009765625; break;
      default: e = std::numeric_limits<float>::epsilon(); break;
    }
  }
  return rows_norm("rms_norm", x, normalized_shape, weight, Tensor(), e, /*rms=*/true);
}

Tensor group_norm(const Tensor& x, int64_t num_groups, const Tensor& weight, const Tensor& bias, double eps) {
  if (auto* tr = compile_detail::active_tracer()) {  // one opaque step of a flame::compile trace
    return compile_detail::trace_eager_op(*tr, "group_norm", {x, weight, bias}, [num_groups, eps](const TensorList& in) {
      return group_norm(in[0], num_groups, in[1], in[2], eps);
    });
  }
  if (amp::detail::should_autocast(x)) {  // Note [Autocast policy]: norms in f32
    amp::detail::AutocastOpScope scope;
    return group_norm(amp::detail::cast_f32(x), num_groups, amp::detail::cast_f32(weight), amp::detail::cast_f32(bias), eps);
  }
  return group_norm_impl(x, num_groups, weight, bias, eps);
}

namespace {

Tensor group_norm_impl(const Tensor& x, int64_t num_groups, const Tensor& weight, const Tensor& bias, double eps) {
  const char* op = "group_norm";
  check_input(x, op);
  const ChannelShape cs = channel_shape(x, op);
  FLAME_CHECK(num_groups > 0 && cs.c % num_groups == 0, op, "num_groups (", num_groups,
              ") must be positive and divide the number of channels (", cs.c, ", input shape ", x.sizes(), ")");
  check_param(weight, "weight", x, {cs.c}, op);
  check_param(bias, "bias", x, {cs.c}, op);
  FLAME_CHECK(eps >= 0 && std::isfinite(eps), op, "eps must be finite and non-negative, got ", eps);
  const Tensor xc = x.contiguous(), wc = contiguous_or_empty(weight), bc = contiguous_or_empty(bias);
  Tensor y = make_empty(x.sizes(), x.dtype(), x.device(), op);
  const DType sd = stat_dtype(x.dtype());
  Tensor mean = make_empty({cs.n * num_groups}, sd, x.device(), op);
  Tensor rstd = make_empty({cs.n * num_groups}, sd, x.device(), op);
  if (x.numel() > 0) backend::backend_for(x.device()).group_norm_forward(y, mean, rstd, xc, wc, bc, num_groups, eps);
  rules::group_norm(y, xc, wc, bc, mean, rstd, num_groups);
  // Under autograd::RecomputeCheap a node that saves y (the SiLU after it) keeps this call instead
  // (Note [Recompute cheap] in src/autograd/recompute.cpp); the norm node saves x and weight anyway.
  if (autograd_detail::should_mark_recomputable()) {
    autograd_detail::mark_recomputable(y, op, {xc, wc, bc}, [num_groups, eps](const TensorList& in) {
      return group_norm_impl(in[0], num_groups, in[1], in[2], eps);
    });
  }
  return y;
}

}  // namespace

Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum, double eps) {
  if (amp::detail::should_autocast(x)) {  // Note [Autocast policy]: norms in f32
    amp::detail::AutocastOpScope scope;
    return batch_norm(amp::detail::cast_f32(x), running_mean, running_var, amp::detail::cast_f32(weight), amp::detail::cast_f32(bias), training, momentum, eps);
  }
  const char* op = "batch_norm";
  check_input(x, op);
  const ChannelShape cs = channel_shape(x, op);
  check_param(weight, "weight", x, {cs.c}, op);
  check_param(bias, "bias", x, {cs.c}, op);
  FLAME_CHECK(eps >= 0 && std::isfinite(eps), op, "eps must be finite and non-negative, got ", eps);
  for (const Tensor* r : {&running_mean, &running_var}) {
    const char* what = r == &running_mean ? "running_mean" : "running_var";
    if (!r->defined()) {
      FLAME_CHECK(training, op, what, " is required in evaluation mode (training = false)");
      continue;
    }
    FLAME_CHECK(r->sizes() == Shape{cs.c}, op, what, " must have shape [", cs.c, "], got ", r->sizes());
    FLAME_CHECK(is_floating(r->dtype()), op, what, " must be floating, got ", dtype_name(r->dtype()));
    FLAME_CHECK(r->device() == x.device(), op, what, " is on ", r->device().str(), " but the input is on ",
                x.device().str());
  }
  FLAME_CHECK(running_mean.defined() == running_var.defined(), op,
              "running_mean and running_var must be given together");
  const int64_t count = cs.n * cs.s;  // values per channel
  FLAME_CHECK(!training || count > 1 || x.numel() == 0, op,
              "expected more than 1 value per channel when training, got input shape ", x.sizes());
  const Tensor xc = x.contiguous(), wc = contiguous_or_empty(weight), bc = contiguous_or_empty(bias);
  auto& be = backend::backend_for(x.device());
  const DType sd = stat_dtype(x.dtype());
  Tensor mean, rstd;
  {
    NoGradGuard no_grad;  // statistics and running-stat updates are not recorded
    if (training) {
      mean = make_empty({cs.c}, sd, x.device(), op);
      Tensor var = make_empty({cs.c}, sd, x.device(), op);
      if (count > 0) {
        be.batch_norm_stats(mean, var, xc);
      } else {
        mean.fill_(std::numeric_limits<double>::quiet_NaN());  // an empty batch has no statistics
        var.fill_(std::numeric_limits<double>::quiet_NaN());
      }
      rstd = (var + eps).rsqrt();
      if (running_mean.defined() && count > 0) {
        // PyTorch: running = (1 - momentum) * running + momentum * stat, unbiased variance.
        const double unbias = count > 1 ? static_cast<double>(count) / static_cast<double>(count - 1) : 1.0;
        const Tensor rm = running_mean * (1.0 - momentum) + mean.to(running_mean.dtype()) * momentum;
        const Tensor rv = running_var * (1.0 - momentum) + var.to(running_var.dtype()) * (momentum * unbias);
        Tensor(running_mean).copy_(rm);  // a handle: writes the caller's buffer
        Tensor(running_var).copy_(rv);
      }
    } else {
      mean = running_mean.to(sd).contiguous();
      rstd = (running_var.to(sd) + eps).rsqrt().contiguous();
      if (mean.is_same(running_mean)) mean = mean.clone();  // saved for backward: not the live buffer
    }
  }
  Tensor y = make_empty(x.sizes(), x.dtype(), x.device(), op);
  if (x.numel() > 0) be.batch_norm_apply(y, xc, mean, rstd, wc, bc);
  rules::batch_norm(y, xc, wc, bc, mean, rstd, training);
  return y;
}

}  // namespace flame::nn::functional
