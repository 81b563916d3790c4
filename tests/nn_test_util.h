#pragma once
// Helpers for the nn tests: a finite-difference gradient check through a module's own parameters.
#include <cmath>
#include <functional>
#include <sstream>
#include <string>

#include "flame/nn.h"
#include "test_util.h"

namespace flame::test {

// N(0, std^2) values of t's shape, dtype and device, drawn from `seed`.
inline Tensor randn_like_seeded(const Tensor& t, uint64_t seed, double std = 1.0) {
  Generator g(seed);
  return Tensor::randn(t.sizes(), 0.0, std, TensorOptions(t.dtype(), t.device()), &g);
}

// Copies v into the parameter t under no-grad (identity kept).
inline void set_(const Tensor& t, const Tensor& v) {
  NoGradGuard ng;
  Tensor d = t;
  d.copy_(v);
}

// Normal f64 values N(0, stddev^2) drawn on the CPU from `seed`: every device gets the same inputs.
inline Tensor randn_f64(const Shape& s, uint64_t seed, double stddev = 1.0) {
  Generator g(seed);
  return Tensor::randn(s, 0.0, stddev, DType::f64, &g);
}

// |got - want| <= tol * (|want| + max(max|want|, floor)) element by element, both read as double.
// A gradient that cancels to almost nothing (two values per group, a row of one) is compared at
// the scale of the terms it is made of (floor 1: inputs and weights are O(1)).
inline ::testing::AssertionResult close_scaled(const Tensor& got, const Tensor& want, double tol, double floor = 0.0) {
  if (got.defined() != want.defined())
    return ::testing::AssertionFailure() << (got.defined() ? "unexpected result" : "missing result");
  if (!got.defined()) return ::testing::AssertionSuccess();
  if (got.sizes() != want.sizes())
    return ::testing::AssertionFailure() << "shape " << ::testing::PrintToString(got.sizes()) << " vs "
                                         << ::testing::PrintToString(want.sizes());
  const std::vector<double> g = got.to_vec<double>(), w = want.to_vec<double>();
  double scale = floor;
  for (double v : w) scale = std::max(scale, std::fabs(v));
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (!(std::fabs(g[i] - w[i]) <= tol * (std::fabs(w[i]) + scale)))
      return ::testing::AssertionFailure() << "element " << i << ": got " << g[i] << ", want " << w[i] << " (scale "
                                           << scale << ", tol " << tol << ")";
  }
  return ::testing::AssertionSuccess();
}

// An attention output and the gradients of q, k and v for the upstream gradient `gout`.
struct AttentionGrads {
  Tensor out, dq, dk, dv;
};
inline AttentionGrads attention_grads(const Tensor& out, const Tensor& gout, const Tensor& q, const Tensor& k,
                                      const Tensor& v) {
  BackwardOptions opt;
  opt.grad_output = gout;
  const Gradients g = out.backward(opt);
  return {out, q.grad(g), k.grad(g), v.grad(g)};
}

// max |got - want| <= tol * max(1, max |want|), on the CPU in f64.
inline ::testing::AssertionResult close_rel(const Tensor& got, const Tensor& want, double tol) {
  if (got.sizes() != want.sizes())
    return ::testing::AssertionFailure() << "shape " << ::testing::PrintToString(got.sizes()) << " vs "
                                         << ::testing::PrintToString(want.sizes());
  const std::vector<double> a = got.to(DType::f64).to(Device::cpu()).contiguous().to_vec<double>();
  const std::vector<double> b = want.to(DType::f64).to(Device::cpu()).contiguous().to_vec<double>();
  double worst = 0, scale = 1;
  std::size_t at = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, std::abs(b[i]));
    const double d = std::isnan(a[i]) != std::isnan(b[i]) ? INFINITY : std::abs(a[i] - b[i]);
    if (d > worst || std::isnan(d)) {
      worst = std::isnan(d) ? INFINITY : d;
      at = i;
    }
  }
  if (worst <= tol * scale) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max abs diff " << worst << " at flat " << at << " (got " << a[at]
                                       << ", want " << b[at] << "), allowed " << tol * scale;
}

// Checks d<v, f(x)>/d(theta) from backward() against central differences, for x (when it is
// floating and requires grad) and every trainable parameter of `m` (all f64 on the CPU). The
// parameters are perturbed in place, so the module's own forward is what is checked.
inline ::testing::AssertionResult module_gradcheck(nn::Module& m, const Tensor& x,
                                                   const std::function<Tensor(const Tensor&)>& fwd,
                                                   double eps = 1e-6, double atol = 1e-5, double rtol = 1e-3) {
  Tensor xin = x.detach();
  if (is_floating(xin.dtype())) xin.requires_grad_(true);
  Tensor y = fwd(xin);
  Generator gen(11);
  Tensor v = Tensor::randn(y.sizes(), 0.0, 1.0, {DType::f64, y.device()}, &gen);
  BackwardOptions bo;
  bo.grad_output = v.to(y.dtype());
  Gradients grads = y.backward(bo);
  auto objective = [&] {
    NoGradGuard ng;
    return (fwd(xin).to(DType::f64) * v).sum().item<double>();
  };
  TensorList targets;
  std::vector<std::string> names;
  if (is_floating(xin.dtype())) {
    targets.push_back(xin);
    names.push_back("input");
  }
  for (auto& [n, p] : m.named_parameters()) {
    if (!p.requires_grad()) continue;
    targets.push_back(p);
    names.push_back(n);
  }
  int checked = 0;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    Tensor t = targets[i];
    Tensor g = grads.try_get(t);
    std::vector<double> an = g.defined() ? g.to_vec<double>() : std::vector<double>(t.numel(), 0.0);
    std::vector<double> vals = t.to_vec<double>();
    for (int64_t j = 0; j < t.numel(); ++j) {
      auto eval = [&](double delta) {
        std::vector<double> p = vals;
        p[j] += delta;
        {
          NoGradGuard ng;
          t.copy_(Tensor::from_vec(p, t.sizes()).to(t.dtype()));
        }
        return objective();
      };
      const double numeric = (eval(eps) - eval(-eps)) / (2 * eps);
      {
        NoGradGuard ng;
        t.copy_(Tensor::from_vec(vals, t.sizes()).to(t.dtype()));
      }
      ++checked;
      if (std::fabs(an[j] - numeric) > atol + rtol * std::fabs(numeric)) {
        std::ostringstream os;
        os << names[i] << " element " << j << ": analytic " << an[j] << ", numeric " << numeric;
        return ::testing::AssertionFailure() << os.str();
      }
    }
  }
  if (checked == 0) return ::testing::AssertionFailure() << "nothing was checked";
  return ::testing::AssertionSuccess() << checked << " elements checked";
}

}  // namespace flame::test
