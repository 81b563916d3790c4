// Normalisation modules (include/flame/nn/norm_layers.h).
#include "flame/nn/norm_layers.h"

#include <sstream>

#include "flame/autograd.h"
#include "flame/ops.h"

namespace flame::nn {
namespace {

std::string shape_tuple(const Shape& s) {
  std::ostringstream o;
  o << "(";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  if (s.size() == 1) o << ",";
  o << ")";
  return o.str();
}

TensorOptions float_options(const TensorOptions& opts, const char* op) {
  const TensorOptions o(opts.dtype_or(DType::f32), opts.device);
  FLAME_CHECK(is_floating(*o.dtype), op, "parameters must be floating, got ", dtype_name(*o.dtype));
  return o;
}

}  // namespace

// ---- LayerNorm ----
LayerNorm::LayerNorm(Ints normalized_shape, double eps, bool elementwise_affine, bool bias, TensorOptions opts)
    : normalized_shape_(std::move(normalized_shape.values)), eps_(eps) {
  FLAME_CHECK(!normalized_shape_.empty(), "LayerNorm", "normalized_shape must not be empty");
  const TensorOptions o = float_options(opts, "LayerNorm");
  if (elementwise_affine) {
    weight_ = register_parameter("weight", Tensor::ones(normalized_shape_, o));
    if (bias) bias_ = register_parameter("bias", Tensor::zeros(normalized_shape_, o));
  }
}
std::string LayerNorm::extra_repr() const {
  std::ostringstream s;
  s << shape_tuple(normalized_shape_) << ", eps=" << eps_ << ", elementwise_affine=" << (weight_.defined() ? "True" : "False");
  return s.str();
}
Tensor LayerNorm::forward(const Tensor& x) { return functional::layer_norm(x, normalized_shape_, weight_, bias_, eps_); }

// ---- RMSNorm ----
RMSNorm::RMSNorm(Ints normalized_shape, std::optional<double> eps, bool elementwise_affine, TensorOptions opts)
    : normalized_shape_(std::move(normalized_shape.values)), eps_(eps) {
  FLAME_CHECK(!normalized_shape_.empty(), "RMSNorm", "normalized_shape must not be empty");
  const TensorOptions o = float_options(opts, "RMSNorm");
  if (elementwise_affine) weight_ = register_parameter("weight", Tensor::ones(normalized_shape_, o));
}
std::string RMSNorm::extra_repr() const {
  std::ostringstream s;
  s << shape_tuple(normalized_shape_) << ", eps=";
  if (eps_) s << *eps_; else s << "None";
  s << ", elementwise_affine=" << (weight_.defined() ? "True" : "False");
  return s.str();
}
Tensor RMSNorm::forward(const Tensor& x) { return functional::rms_norm(x, normalized_shape_, weight_, eps_); }

// ---- GroupNorm ----
GroupNorm::GroupNorm(int64_t num_groups, int64_t num_channels, double eps, bool affine, TensorOptions opts)
    : num_groups_(num_groups), num_channels_(num_channels), eps_(eps) {
  FLAME_CHECK(num_groups > 0 && num_channels > 0 && num_channels % num_groups == 0, "GroupNorm", "num_channels=",
              num_channels, " must be a positive multiple of num_groups=", num_groups);
  const TensorOptions o = float_options(opts, "GroupNorm");
  if (affine) {
    weight_ = register_parameter("weight", Tensor::ones({num_channels}, o));
    bias_ = register_parameter("bias", Tensor::zeros({num_channels}, o));
  }
}
std::string GroupNorm::extra_repr() const {
  std::ostringstream s;
  s << num_groups_ << ", " << num_channels_ << ", eps=" << eps_ << ", affine=" << (weight_.defined() ? "True" : "False");
  return s.str();
}
Tensor GroupNorm::forward(const Tensor& x) {
  FLAME_CHECK(x.dim() >= 2 && x.size(1) == num_channels_, "GroupNorm", "expected input [N, ", num_channels_,
              ", *], got ", x.sizes());
  return functional::group_norm(x, num_groups_, weight_, bias_, eps_);
}

// ---- BatchNorm ----
BatchNormNd::BatchNormNd(int64_t dims_lo, int64_t dims_hi, int64_t num_features, double eps,
                         std::optional<double> momentum, bool affine, bool track_running_stats, TensorOptions opts)
    : dims_lo_(dims_lo), dims_hi_(dims_hi), num_features_(num_features), eps_(eps), momentum_(momentum),
      track_running_stats_(track_running_stats) {
  FLAME_CHECK(num_features > 0, "BatchNorm", "num_features must be > 0, got ", num_features);
  const TensorOptions o = float_options(opts, "BatchNorm");
  if (affine) {
    weight_ = register_parameter("weight", Tensor::ones({num_features}, o));
    bias_ = register_parameter("bias", Tensor::zeros({num_features}, o));
  }
  if (track_running_stats) {
    running_mean_ = register_buffer("running_mean", Tensor::zeros({num_features}, o));
    running_var_ = register_buffer("running_var", Tensor::ones({num_features}, o));
    num_batches_tracked_ =
        register_buffer("num_batches_tracked", Tensor::zeros({}, TensorOptions(DType::i64, o.device)));
  }
}
std::string BatchNormNd::extra_repr() const {
  std::ostringstream s;
  s << num_features_ << ", eps=" << eps_ << ", momentum=";
  if (momentum_) s << *momentum_; else s << "None";
  s << ", affine=" << (weight_.defined() ? "True" : "False")
    << ", track_running_stats=" << (track_running_stats_ ? "True" : "False");
  return s.str();
}
Tensor BatchNormNd::forward(const Tensor& x) {
  FLAME_CHECK(x.dim() >= dims_lo_ && x.dim() <= dims_hi_ && x.size(1) == num_features_, name().c_str(),
              "expected a ", dims_lo_, (dims_lo_ == dims_hi_ ? "" : " or " + std::to_string(dims_hi_)),
              "-d input with ", num_features_, " channels in dim 1, got ", x.sizes());
  double factor = 0.0;
  const bool use_batch_stats = is_training() || !track_running_stats_;
  if (is_training() && track_running_stats_) {
    {
      NoGradGuard no_grad;
      Tensor n = num_batches_tracked_;
      n.add_(1);
    }
    // momentum unset: the cumulative moving average 1 / num_batches_tracked (reads the host).
    factor = momentum_ ? *momentum_ : 1.0 / static_cast<double>(num_batches_tracked_.item<int64_t>());
  }
  const bool update = is_training() && track_running_stats_;
  return functional::batch_norm(x, update || !use_batch_stats ? running_mean_ : Tensor(),
                                update || !use_batch_stats ? running_var_ : Tensor(), weight_, bias_,
                                use_batch_stats, factor, eps_);
}

}  // namespace flame::nn
