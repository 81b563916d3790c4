// f32 optimizer steps rounded as torch.optim rounds them: hyperparameter arithmetic (1 - beta,
// 1 - dampening, 1 - lr wd) in double, rounded to f32 once, then the element math in f32. The
// reference below is PyTorch's single-tensor code (torch/optim/adam.py, sgd.py) written out with
// every f32 rounding where PyTorch's kernels make it. Forming 1 - beta2 in f32 from f32(0.999)
// gives 0.00099998713: every second moment 1.29e-5 low, which these tolerances reject.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "flame/flame.h"
#include "flame/optim/optimizers.h"
#include "test_util.h"

namespace flame::test {
namespace {

using Floats = std::vector<float>;

Floats draw(std::size_t n, uint64_t seed, double scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, scale);
  Floats v(n);
  for (float& x : v) x = static_cast<float>(nd(rng));
  return v;
}

Tensor f32_param(const Floats& v) {
  return Tensor::from_vec(v, {static_cast<int64_t>(v.size())}).to(test_device()).requires_grad_(true);
}

Floats values_of(const Tensor& t) { return t.to(Device::cpu()).to_vec<float>(); }

// |got - want| <= rtol |want| + atol for every element; reports the worst one.
void expect_close(const Floats& got, const Floats& want, double rtol, double atol, const char* what, int step) {
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]) / (rtol * std::abs(want[i]) + atol);
    if (err > worst) worst = err, at = i;
  }
  EXPECT_LE(worst, 1.0) << what << " after step " << step << ": element " << at << " is " << got[at] << ", want "
                        << want[at] << " (" << worst << " x the tolerance)";
}

// The absolute tolerance of a value that may cancel. The model rounds every product and sum; the
// CUDA kernels contract a multiply-add into one fma (nvcc's default, as in PyTorch's CUDA kernels),
// which differs by an ulp of the terms, not of the result: where the terms cancel (a momentum
// buffer near 0) that is many ulps of the result. So on CUDA the bound is relative to the tensor's
// largest value; on the CPU (no contraction) it stays `atol`.
double cancel_atol(const Floats& want, double rtol, double atol) {
  if (!test_device().is_cuda()) return atol;
  double largest = 0;
  for (float w : want) largest = std::max(largest, static_cast<double>(std::abs(w)));
  return std::max(atol, rtol * largest);
}

// torch.optim.Adam/AdamW, _single_tensor_adam, one f32 tensor.
struct AdamModel {
  double lr, beta1, beta2, eps, wd;
  bool decoupled;
  Floats p, m, v;
  int t = 0;

  void step(const Floats& grad) {
    ++t;
    const float w1 = static_cast<float>(1.0 - beta1), w2 = static_cast<float>(1.0 - beta2);
    const float b2 = static_cast<float>(beta2), wdf = static_cast<float>(wd), epsf = static_cast<float>(eps);
    const float decay = static_cast<float>(1.0 - lr * wd);  // param.mul_(1 - lr * weight_decay)
    const double bc1 = 1.0 - std::pow(beta1, t), bc2 = 1.0 - std::pow(beta2, t);
    const float step_size = static_cast<float>(lr / bc1);
    const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    for (std::size_t i = 0; i < p.size(); ++i) {
      float g = grad[i];
      if (decoupled) {
        p[i] = p[i] * decay;
      } else if (wd != 0) {
        g = g + wdf * p[i];  // grad.add(param, alpha=weight_decay)
      }
      m[i] = m[i] + w1 * (g - m[i]);  // exp_avg.lerp_(grad, 1 - beta1), weight < 0.5
      v[i] = v[i] * b2;               // exp_avg_sq.mul_(beta2)
      v[i] = v[i] + w2 * g * g;       //   .addcmul_(grad, grad, value=1 - beta2)
      const float denom = std::sqrt(v[i]) / bc2_sqrt + epsf;
      p[i] = p[i] - step_size * (m[i] / denom);  // param.addcdiv_(exp_avg, denom, value=-step_size)
    }
  }
};

void run_adam_case(bool decoupled, double wd) {
  constexpr std::size_t n = 257;
  const Floats init = draw(n, 11, 1.0);
  Tensor p = f32_param(init);
  AdamModel ref{1e-3, 0.9, 0.999, 1e-8, wd, decoupled, init, Floats(n, 0.f), Floats(n, 0.f)};
  std::unique_ptr<optim::FusedOptimizer> opt;
  if (decoupled) {
    opt = std::make_unique<optim::AdamW>(TensorList{p}, optim::AdamWOptions{.weight_decay = wd});
  } else {
    opt = std::make_unique<optim::Adam>(TensorList{p}, optim::AdamOptions{.weight_decay = wd});
  }
  for (int step = 1; step <= 5; ++step) {
    const Floats g = draw(n, 100 + step, 0.5);
    Gradients grads;
    grads.set(p, Tensor::from_vec(g, {static_cast<int64_t>(n)}).to(test_device()));
    opt->step(grads);
    ref.step(g);
    // exp_avg_sq has no cancelling terms: a few f32 ulps everywhere; the f32 1 - beta2 is 1.29e-5 off.
    expect_close(values_of(opt->state(p, "exp_avg_sq")), ref.v, 5e-7, 0, "exp_avg_sq", step);
    expect_close(values_of(opt->state(p, "exp_avg")), ref.m, 5e-7, cancel_atol(ref.m, 5e-7, 1e-12), "exp_avg", step);
    expect_close(values_of(p), ref.p, 5e-7, cancel_atol(ref.p, 5e-7, 1e-9), "param", step);
  }
}

TEST(OptimNumerics, AdamF32RoundsLikePyTorch) {
  FLAME_SKIP_IF_NO_DEVICE();
  run_adam_case(false, 0.0);
}
TEST(OptimNumerics, AdamF32WithL2RoundsLikePyTorch) {
  FLAME_SKIP_IF_NO_DEVICE();
  run_adam_case(false, 0.05);
}
TEST(OptimNumerics, AdamWF32RoundsLikePyTorch) {
  FLAME_SKIP_IF_NO_DEVICE();
  run_adam_case(true, 0.01);
}

// torch.optim.SGD with momentum and dampening: buf.mul_(momentum).add_(grad, alpha=1 - dampening).
// A dampening near 1 makes f32's 1 - f32(0.99) = 0.0099999905 (9.3e-7 off); a small momentum lets
// the dampened term dominate the buffer, so the error shows.
TEST(OptimNumerics, SgdDampenedMomentumRoundsLikePyTorch) {
  FLAME_SKIP_IF_NO_DEVICE();
  constexpr std::size_t n = 129;
  const double lr = 0.1, momentum = 0.002, dampening = 0.99;
  Floats p_ref = draw(n, 21, 1.0), buf(n, 0.f);
  Tensor p = f32_param(p_ref);
  optim::SGD opt(TensorList{p}, {.lr = lr, .momentum = momentum, .dampening = dampening});
  const float mf = static_cast<float>(momentum), w = static_cast<float>(1.0 - dampening), lrf = static_cast<float>(lr);
  for (int step = 1; step <= 4; ++step) {
    const Floats g = draw(n, 200 + step, 1.0);
    Gradients grads;
    grads.set(p, Tensor::from_vec(g, {static_cast<int64_t>(n)}).to(test_device()));
    opt.step(grads);
    for (std::size_t i = 0; i < n; ++i) {
      buf[i] = step == 1 ? g[i] : buf[i] * mf + w * g[i];
      p_ref[i] = p_ref[i] - lrf * buf[i];
    }
    expect_close(values_of(opt.state(p, "momentum_buffer")), buf, 2.5e-7, cancel_atol(buf, 2.5e-7, 1e-12),
                 "momentum_buffer", step);
    expect_close(values_of(p), p_ref, 2.5e-7, cancel_atol(p_ref, 2.5e-7, 1e-9), "param", step);
  }
}

// Lion (Chen et al. 2023): m = b2 m + (1 - b2) g. After the first step m = (1 - b2) g exactly
// rounded, which f32's 1 - f32(0.99) misses by 9.3e-7.
TEST(OptimNumerics, LionF32FormsOneMinusBetaInDouble) {
  FLAME_SKIP_IF_NO_DEVICE();
  constexpr std::size_t n = 65;
  const Floats init = draw(n, 31, 1.0), g = draw(n, 32, 1.0);
  Tensor p = f32_param(init);
  optim::Lion opt(TensorList{p}, {.lr = 1e-4, .betas = {0.9, 0.99}});
  Gradients grads;
  grads.set(p, Tensor::from_vec(g, {static_cast<int64_t>(n)}).to(test_device()));
  opt.step(grads);
  Floats want(n);
  for (std::size_t i = 0; i < n; ++i) want[i] = static_cast<float>(1.0 - 0.99) * g[i];
  expect_close(values_of(opt.state(p, "exp_avg")), want, 2.5e-7, 0, "exp_avg", 1);
}

// The f32 model above, checked once against plain float64 Adam: the reference itself is Adam.
TEST(OptimNumerics, F32ModelTracksFloat64Adam) {
  constexpr std::size_t n = 33;
  const Floats init = draw(n, 41, 1.0);
  AdamModel ref{1e-2, 0.9, 0.999, 1e-8, 0.0, false, init, Floats(n, 0.f), Floats(n, 0.f)};
  std::vector<double> p(init.begin(), init.end()), m(n, 0.0), v(n, 0.0);
  for (int t = 1; t <= 10; ++t) {
    const Floats g = draw(n, 300 + t, 1.0);
    ref.step(g);
    for (std::size_t i = 0; i < n; ++i) {
      m[i] = 0.9 * m[i] + 0.1 * g[i];
      v[i] = 0.999 * v[i] + 0.001 * static_cast<double>(g[i]) * g[i];
      const double mhat = m[i] / (1 - std::pow(0.9, t)), vhat = v[i] / (1 - std::pow(0.999, t));
      p[i] -= 1e-2 * mhat / (std::sqrt(vhat) + 1e-8);
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    EXPECT_NEAR(ref.v[i], v[i], 1e-6 * v[i]) << i;
    EXPECT_NEAR(ref.p[i], p[i], 1e-5) << i;
  }
}

}  // namespace
}  // namespace flame::test
