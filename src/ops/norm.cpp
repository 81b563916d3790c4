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
#include <algorithm>
#include <cmath>
#include <limits>
#include <span>

#include "flame/grad_mode.h"
#include "flame/nn/norm.h"
#include "flame/ops.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"
#include "src/ops/norm_def.h"

namespace flame::op_detail {
namespace {

DType stat_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

void check_input(const Tensor& x, const char* op) {
  FLAME_CHECK(x.defined(), op, "got an undefined input");
  FLAME_CHECK(is_floating(x.dtype()), op, "expected a floating input (f32, f64, bf16, f16), got ",
              dtype_name(x.dtype()), " (shape ", x.sizes(), ")");
}

// weight/bias: undefined, or `shape`, x's dtype and device.
// The shape is compared as a span (the norms over rows pass x's trailing dims without a copy).
void check_param(const Tensor& p, const char* what, const Tensor& x, std::span<const int64_t> shape, const char* op) {
  if (!p.defined()) return;
  FLAME_CHECK(std::ranges::equal(p.sizes(), shape), op, what, " must have shape ", Shape(shape.begin(), shape.end()),
              ", got ", p.sizes(), " (input shape ", x.sizes(), ")");
  FLAME_CHECK(p.dtype() == x.dtype(), op, what, " has dtype ", dtype_name(p.dtype()), " but the input has ",
              dtype_name(x.dtype()), " (mixed dtypes are not supported; convert the parameter)");
  FLAME_CHECK(p.device() == x.device(), op, what, " is on ", p.device().str(), " but the input is on ",
              x.device().str());
}

Tensor contiguous_or_empty(const Tensor& t) { return t.defined() ? t.contiguous() : t; }

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

}  // namespace

NormPrep NormRowsDef::prepare(const Args& a) {
  const char* op = a.op;
  const Tensor& x = a.x.get();
  check_input(x, op);
  const std::span<const int64_t> normalized(x.sizes().end() - a.dims, x.sizes().end());  // the wrapper checked it
  check_param(a.weight.get(), "weight", x, normalized, op);
  check_param(a.bias.get(), "bias", x, normalized, op);
  // No eps: torch.finfo(dtype).eps of x as the kernel gets it (f32 for a half input under autocast,
  // which has cast x by now).
  double eps = 0;
  switch (x.dtype()) {
    case DType::f64: eps = std::numeric_limits<double>::epsilon(); break;
    case DType::bf16: eps = 0.0078125; break;
    case DType::f16: eps = 0.0009765625; break;
    default: eps = std::numeric_limits<float>::epsilon(); break;
  }
  if (a.eps) eps = *a.eps;
  FLAME_CHECK(eps >= 0 && std::isfinite(eps), op, "eps must be finite and non-negative, got ", eps);
  return {x.contiguous(), contiguous_or_empty(a.weight.get()), contiguous_or_empty(a.bias.get()), eps};
}

NormResult NormRowsDef::run(const Args& a, Prep& p) {
  const Tensor& x = a.x.get();
  int64_t rows = 1;
  for (int64_t d = 0; d < x.dim() - a.dims; ++d) rows *= x.sizes()[d];
  Result r;
  r.y = make_empty(x.sizes(), x.dtype(), x.device(), a.op);
  const DType sd = stat_dtype(x.dtype());
  if (!a.rms) r.mean = make_empty({rows}, sd, x.device(), a.op);
  r.rstd = make_empty({rows}, sd, x.device(), a.op);
  if (x.numel() > 0) backend::backend_for(x.device()).norm_rows_forward(r.y, r.mean, r.rstd, p.x, p.weight, p.bias, p.eps);
  return r;
}

NormPrep GroupNormDef::prepare(const Args& a) {
  const char* op = "group_norm";
  const Tensor& x = a.x;
  check_input(x, op);
  const ChannelShape cs = channel_shape(x, op);
  FLAME_CHECK(a.groups > 0 && cs.c % a.groups == 0, op, "num_groups (", a.groups,
              ") must be positive and divide the number of channels (", cs.c, ", input shape ", x.sizes(), ")");
  check_param(a.weight, "weight", x, std::span<const int64_t>(&cs.c, 1), op);
  check_param(a.bias, "bias", x, std::span<const int64_t>(&cs.c, 1), op);
  FLAME_CHECK(a.eps >= 0 && std::isfinite(a.eps), op, "eps must be finite and non-negative, got ", a.eps);
  return {x.contiguous(), contiguous_or_empty(a.weight), contiguous_or_empty(a.bias)};
}

NormResult GroupNormDef::run(const Args& a, Prep& p) {
  const char* op = "group_norm";
  const Tensor& x = a.x;
  const int64_t n = x.sizes()[0];
  Result r;
  r.y = make_empty(x.sizes(), x.dtype(), x.device(), op);
  const DType sd = stat_dtype(x.dtype());
  r.mean = make_empty({n * a.groups}, sd, x.device(), op);
  r.rstd = make_empty({n * a.groups}, sd, x.device(), op);
  if (x.numel() > 0) {
    backend::backend_for(x.device()).group_norm_forward(r.y, r.mean, r.rstd, p.x, p.weight, p.bias, a.groups, a.eps);
  }
  return r;
}

NormPrep BatchNormDef::prepare(const Args& a) {
  const Tensor &x = a.x, &weight = a.weight, &bias = a.bias, &running_mean = a.running_mean,
               &running_var = a.running_var;
  const bool training = a.training;
  const double eps = a.eps;
  const char* op = "batch_norm";
  check_input(x, op);
  const ChannelShape cs = channel_shape(x, op);
  check_param(weight, "weight", x, std::span<const int64_t>(&cs.c, 1), op);
  check_param(bias, "bias", x, std::span<const int64_t>(&cs.c, 1), op);
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
  return {x.contiguous(), contiguous_or_empty(weight), contiguous_or_empty(bias)};
}

NormResult BatchNormDef::run(const Args& a, Prep& p) {
  const char* op = "batch_norm";
  const Tensor &x = a.x, &xc = p.x, &running_mean = a.running_mean, &running_var = a.running_var;
  const bool training = a.training;
  const double eps = a.eps, momentum = a.momentum;
  const ChannelShape cs = channel_shape(x, op);
  const int64_t count = cs.n * cs.s;
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
  Result r;
  r.mean = mean;
  r.rstd = rstd;
  r.y = make_empty(x.sizes(), x.dtype(), x.device(), op);
  if (x.numel() > 0) be.batch_norm_apply(r.y, xc, mean, rstd, p.weight, p.bias);
  return r;
}

}  // namespace flame::op_detail

namespace flame::nn::functional {
namespace {

// normalized_shape must equal the last dims of x (defined); returns how many.
int64_t normalized_dims(const char* op, const Tensor& x, const Shape& normalized_shape) {
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  bool match = k >= 1 && x.dim() >= k;
  for (int64_t i = 0; match && i < k; ++i) match = x.sizes()[x.dim() - k + i] == normalized_shape[i];
  FLAME_CHECK(match, op, "normalized_shape ", normalized_shape, " must be non-empty and equal the last dims of the input shape ",
              x.sizes());
  return k;
}

}  // namespace

Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight, const Tensor& bias, double eps) {
  FLAME_CHECK(x.defined(), "layer_norm", "got an undefined input");
  return op_detail::invoke<op_detail::NormRowsDef>(
      {"layer_norm", x, weight, bias, normalized_dims("layer_norm", x, normalized_shape), eps, /*rms=*/false});
}

Tensor rms_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight, std::optional<double> eps) {
  FLAME_CHECK(x.defined(), "rms_norm", "got an undefined input");
  return op_detail::invoke<op_detail::NormRowsDef>(
      {"rms_norm", x, weight, Tensor(), normalized_dims("rms_norm", x, normalized_shape), eps, /*rms=*/true});
}

Tensor group_norm(const Tensor& x, int64_t num_groups, const Tensor& weight, const Tensor& bias, double eps) {
  return op_detail::invoke<op_detail::GroupNormDef>({x, weight, bias, num_groups, eps});
}

Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum, double eps) {
  return op_detail::invoke<op_detail::BatchNormDef>({x, weight, bias, running_mean, running_var, training, momentum, eps});
}

}  // namespace flame::nn::functional
