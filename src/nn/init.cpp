// nn::init (include/flame/nn/init.h).
//
// Note [Init draws]: values are drawn with the Philox factories (Tensor::uniform/randn) in f32
// (f64 for f64 tensors) on the tensor's device and then copied in, so one seed gives the same
// numbers on every device and the draw for a half tensor is the rounded f32 draw, as PyTorch.
#include "flame/nn/init.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "flame/autograd.h"
#include "flame/ops.h"

namespace flame::nn::init {

namespace {
void check_floating(const Tensor& t, const char* op) {
  FLAME_CHECK(t.defined(), op, "undefined tensor");
  FLAME_CHECK(is_floating(t.dtype()), op, "needs a floating tensor, got ", dtype_name(t.dtype()), " of shape ",
              t.sizes());
}
TensorOptions draw_options(const Tensor& t) {
  return TensorOptions(t.dtype() == DType::f64 ? DType::f64 : DType::f32, t.device());
}
// Writes `values` into t without recording (t may be a leaf that requires grad).
Tensor& assign(Tensor& t, const Tensor& values) {
  NoGradGuard no_grad;
  Tensor target = t;
  target.copy_(values);
  return t;
}
// Inverse error function: a rational first guess, then Newton steps on erf (std::erf is exact to
// an ulp, so two steps give double precision).
double erfinv(double y) {
  if (y <= -1.0) return -INFINITY;
  if (y >= 1.0) return INFINITY;
  const double w = -std::log((1.0 - y) * (1.0 + y));
  double x;
  if (w < 5.0) {
    const double v = w - 2.5;
    double p = 2.81022636e-08;
    p = 3.43273939e-07 + p * v;
    p = -3.5233877e-06 + p * v;
    p = -4.39150654e-06 + p * v;
    p = 0.00021858087 + p * v;
    p = -0.00125372503 + p * v;
    p = -0.00417768164 + p * v;
    p = 0.246640727 + p * v;
    p = 1.50140941 + p * v;
    x = p * y;
  } else {
    const double v = std::sqrt(w) - 3.0;
    double p = -0.000200214257;
    p = 0.000100950558 + p * v;
    p = 0.00134934322 + p * v;
    p = -0.00367342844 + p * v;
    p = 0.00573950773 + p * v;
    p = -0.0076224613 + p * v;
    p = 0.00943887047 + p * v;
    p = 1.00167406 + p * v;
    p = 2.83297682 + p * v;
    x = p * y;
  }
  const double two_over_sqrt_pi = 1.1283791670955126;
  for (int i = 0; i < 2; ++i) x -= (std::erf(x) - y) / (two_over_sqrt_pi * std::exp(-x * x));
  return x;
}
double norm_cdf(double x) { return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))); }
int64_t fan(const Tensor& t, FanMode mode) {
  auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(t);
  return mode == FanMode::fan_in ? fan_in : fan_out;
}
}  // namespace

double calculate_gain(Nonlinearity nl, std::optional<double> param) {
  switch (nl) {
    case Nonlinearity::linear:
    case Nonlinearity::conv1d:
    case Nonlinearity::conv2d:
    case Nonlinearity::conv3d:
    case Nonlinearity::sigmoid:
      return 1.0;
    case Nonlinearity::tanh:
      return 5.0 / 3.0;
    case Nonlinearity::relu:
      return std::sqrt(2.0);
    case Nonlinearity::leaky_relu: {
      const double slope = param.value_or(0.01);
      return std::sqrt(2.0 / (1.0 + slope * slope));
    }
    case Nonlinearity::selu:
      return 3.0 / 4.0;
  }
  FLAME_FAIL("calculate_gain", "unknown nonlinearity ", static_cast<int>(nl));
}

std::pair<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& t) {
  FLAME_CHECK(t.defined(), "calculate_fan_in_and_fan_out", "undefined tensor");
  FLAME_CHECK(t.dim() >= 2, "calculate_fan_in_and_fan_out",
              "fan in and fan out need a tensor of at least 2 dims, got shape ", t.sizes());
  int64_t receptive = 1;
  for (int64_t d = 2; d < t.dim(); ++d) receptive *= t.size(d);
  return {t.size(1) * receptive, t.size(0) * receptive};
}

Tensor& uniform_(Tensor& t, double a, double b, Generator* gen) {
  check_floating(t, "uniform_");
  FLAME_CHECK(a <= b, "uniform_", "needs a <= b, got a=", a, ", b=", b);
  return assign(t, Tensor::uniform(t.sizes(), a, b, draw_options(t), gen));
}

Tensor& normal_(Tensor& t, double mean, double std, Generator* gen) {
  check_floating(t, "normal_");
  FLAME_CHECK(std >= 0, "normal_", "needs std >= 0, got ", std);
  return assign(t, Tensor::randn(t.sizes(), mean, std, draw_options(t), gen));
}

Tensor& trunc_normal_(Tensor& t, double mean, double std, double a, double b, Generator* gen) {
  check_floating(t, "trunc_normal_");
  FLAME_CHECK(std > 0 && a < b, "trunc_normal_", "needs std > 0 and a < b, got std=", std, ", a=", a, ", b=", b);
  // Uniform in [2 cdf(a) - 1, 2 cdf(b) - 1], then the inverse CDF, as PyTorch; done on the host in
  // double (init is not on a hot path) from a Philox draw, so it is seeded and device independent.
  const double lo = 2.0 * norm_cdf((a - mean) / std) - 1.0;
  const double hi = 2.0 * norm_cdf((b - mean) / std) - 1.0;
  std::vector<double> u = Tensor::uniform(t.sizes(), lo, hi, DType::f64, gen).to_vec<double>();
  for (double& v : u) v = std::min(std::max(mean + std * std::sqrt(2.0) * erfinv(v), a), b);
  return assign(t, Tensor::from_vec(u, t.sizes(), t.device()));
}

Tensor& constant_(Tensor& t, Scalar value) {
  FLAME_CHECK(t.defined(), "constant_", "undefined tensor");
  NoGradGuard no_grad;
  Tensor target = t;
  target.fill_(value);
  return t;
}
Tensor& zeros_(Tensor& t) { return constant_(t, 0); }
Tensor& ones_(Tensor& t) { return constant_(t, 1); }

Tensor& eye_(Tensor& t) {
  FLAME_CHECK(t.defined() && t.dim() == 2, "eye_", "needs a 2-d tensor, got shape ",
              t.defined() ? t.sizes() : Shape{});
  return assign(t, Tensor::eye(t.size(0), t.size(1), TensorOptions(t.dtype(), t.device())));
}

Tensor& xavier_uniform_(Tensor& t, double gain, Generator* gen) {
  check_floating(t, "xavier_uniform_");
  auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(t);
  const double std = gain * std::sqrt(2.0 / static_cast<double>(fan_in + fan_out));
  const double bound = std::sqrt(3.0) * std;
  return uniform_(t, -bound, bound, gen);
}

Tensor& xavier_normal_(Tensor& t, double gain, Generator* gen) {
  check_floating(t, "xavier_normal_");
  auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(t);
  return normal_(t, 0.0, gain * std::sqrt(2.0 / static_cast<double>(fan_in + fan_out)), gen);
}

Tensor& kaiming_uniform_(Tensor& t, double a, FanMode mode, Nonlinearity nl, Generator* gen) {
  check_floating(t, "kaiming_uniform_");
  const int64_t f = fan(t, mode);
  FLAME_CHECK(f > 0, "kaiming_uniform_", "zero fan for a tensor of shape ", t.sizes());
  const double std = calculate_gain(nl, a) / std::sqrt(static_cast<double>(f));
  const double bound = std::sqrt(3.0) * std;
  return uniform_(t, -bound, bound, gen);
}

Tensor& kaiming_normal_(Tensor& t, double a, FanMode mode, Nonlinearity nl, Generator* gen) {
  check_floating(t, "kaiming_normal_");
  const int64_t f = fan(t, mode);
  FLAME_CHECK(f > 0, "kaiming_normal_", "zero fan for a tensor of shape ", t.sizes());
  return normal_(t, 0.0, calculate_gain(nl, a) / std::sqrt(static_cast<double>(f)), gen);
}

}  // namespace flame::nn::init
