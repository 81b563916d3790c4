// smooth_l1_loss, huber_loss, binary_cross_entropy_with_logits with weight / pos_weight, and
// cross_entropy with class weights, label smoothing and class-probability targets: values against
// float64 loops of PyTorch's formulas, float64 gradchecks on the CPU, and argument errors.
#include <algorithm>
#include <cmath>
#include <vector>

#include "flame/nn/functional.h"
#include "gradcheck.h"
#include "test_util.h"

namespace flame::test {
namespace {

std::vector<double> values(const Tensor& t) { return t.to(Device::cpu()).to(DType::f64).contiguous().to_vec<double>(); }

Tensor uniform(const Shape& s, uint64_t seed, double lo, double hi) {
  Generator g(seed);
  return Tensor::rand(s, {DType::f64, Device::cpu()}, &g) * (hi - lo) + lo;
}

double reduce(const std::vector<double>& v, Reduction r) {
  double s = 0;
  for (double x : v) s += x;
  return r == Reduction::mean ? s / static_cast<double>(v.size()) : s;
}

::testing::AssertionResult near_all(const Tensor& got, const std::vector<double>& want, double tol) {
  const std::vector<double> g = values(got);
  if (g.size() != want.size()) return ::testing::AssertionFailure() << g.size() << " values, want " << want.size();
  for (std::size_t i = 0; i < g.size(); ++i)
    if (!(std::fabs(g[i] - want[i]) <= tol * (1 + std::fabs(want[i]))))
      return ::testing::AssertionFailure() << "[" << i << "] got " << g[i] << ", want " << want[i];
  return ::testing::AssertionSuccess();
}

// ---- smooth_l1 / huber ----
double smooth_l1(double d, double beta) {
  const double z = std::fabs(d);
  return beta == 0 ? z : (z < beta ? 0.5 * z * z / beta : z - 0.5 * beta);
}
double huber(double d, double delta) {
  const double z = std::fabs(d);
  return z < delta ? 0.5 * z * z : delta * (z - 0.5 * delta);
}

TEST(LossWeighted, SmoothL1AndHuberMatchClosedForms) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor a = uniform({3, 7}, 1, -3, 3), b = uniform({3, 7}, 2, -3, 3);
  const std::vector<double> av = values(a), bv = values(b);
  for (DType dt : {DType::f64, DType::f32}) {
    const double tol = dt == DType::f64 ? 1e-12 : 1e-6;
    const Tensor x = a.to(dt).to(dev), y = b.to(dt).to(dev);
    for (double beta : {0.0, 0.5, 1.0, 2.5}) {
      std::vector<double> want;
      for (std::size_t i = 0; i < av.size(); ++i) want.push_back(smooth_l1(av[i] - bv[i], beta));
      EXPECT_TRUE(near_all(smooth_l1_loss(x, y, Reduction::none, beta), want, tol)) << "beta " << beta;
      EXPECT_TRUE(near_all(smooth_l1_loss(x, y, Reduction::mean, beta), {reduce(want, Reduction::mean)}, tol));
      EXPECT_TRUE(near_all(smooth_l1_loss(x, y, Reduction::sum, beta), {reduce(want, Reduction::sum)}, tol));
    }
    for (double delta : {0.3, 1.0, 2.0}) {
      std::vector<double> want;
      for (std::size_t i = 0; i < av.size(); ++i) want.push_back(huber(av[i] - bv[i], delta));
      EXPECT_TRUE(near_all(huber_loss(x, y, Reduction::none, delta), want, tol)) << "delta " << delta;
      EXPECT_TRUE(near_all(huber_loss(x, y, Reduction::mean, delta), {reduce(want, Reduction::mean)}, tol));
    }
  }
  // Hand-checked points: d = 0.5 and 3 with beta 1: 0.125 and 2.5; huber delta 2: 0.125 and 4.
  const Tensor x = Tensor::from_vec(std::vector<double>{0.5, 3.0}, {2}).to(dev), z = Tensor::zeros({2}, {DType::f64, dev});
  EXPECT_TRUE(near_all(smooth_l1_loss(x, z, Reduction::none), {0.125, 2.5}, 0));
  EXPECT_TRUE(near_all(huber_loss(x, z, Reduction::none, 2.0), {0.125, 4.0}, 0));
  // huber = beta * smooth_l1 for beta = delta.
  EXPECT_TRUE(near_all(huber_loss(a.to(dev), b.to(dev), Reduction::sum, 1.7),
                       {1.7 * values(smooth_l1_loss(a, b, Reduction::sum, 1.7))[0]}, 1e-12));
}

TEST(LossWeighted, SmoothL1AndHuberGradcheck) {
  const Tensor a = uniform({4, 5}, 3, -3, 3), b = uniform({4, 5}, 4, -3, 3);
  for (double beta : {0.0, 0.7}) {
    const GradcheckResult r =
        gradcheck([&](const TensorList& t) { return smooth_l1_loss(t[0], t[1], Reduction::mean, beta); }, {a, b});
    EXPECT_TRUE(r.ok) << "beta " << beta << ": " << r.message;
  }
  const GradcheckResult r =
      gradcheck([](const TensorList& t) { return huber_loss(t[0], t[1], Reduction::none, 1.3); }, {a, b});
  EXPECT_TRUE(r.ok) << r.message;
}

// ---- BCE with logits ----
double bce(double x, double t, double w, double pw) {
  const double log_sig = -std::log1p(std::exp(-x)), log_one_minus = -std::log1p(std::exp(x));
  return -w * (pw * t * log_sig + (1 - t) * log_one_minus);
}

TEST(LossWeighted, BceWithLogitsWeightAndPosWeight) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = uniform({2, 3, 4}, 5, -4, 4), t = uniform({2, 3, 4}, 6, 0, 1);
  const Tensor pw = uniform({4}, 7, 0.2, 3), w = uniform({3, 1}, 8, 0.1, 2);
  const std::vector<double> xv = values(x), tv = values(t), pwv = values(pw), wv = values(w);
  std::vector<double> want_pw, want_both;
  for (int64_t i = 0; i < 24; ++i) {
    const int64_t c = i % 4, row = (i / 4) % 3;
    want_pw.push_back(bce(xv[i], tv[i], 1, pwv[c]));
    want_both.push_back(bce(xv[i], tv[i], wv[row], pwv[c]));
  }
  for (DType dt : {DType::f64, DType::f32}) {
    const double tol = dt == DType::f64 ? 1e-12 : 2e-6;
    auto d = [&](const Tensor& v) { return v.to(dt).to(dev); };
    EXPECT_TRUE(near_all(binary_cross_entropy_with_logits(d(x), d(t), Reduction::none, {}, d(pw)), want_pw, tol));
    EXPECT_TRUE(near_all(binary_cross_entropy_with_logits(d(x), d(t), Reduction::none, d(w), d(pw)), want_both, tol));
    EXPECT_TRUE(near_all(binary_cross_entropy_with_logits(d(x), d(t), Reduction::mean, d(w), d(pw)),
                         {reduce(want_both, Reduction::mean)}, tol));
    // pos_weight of ones and no weight: the plain loss.
    EXPECT_TRUE(near_all(binary_cross_entropy_with_logits(d(x), d(t), Reduction::sum, {}, Tensor::ones({4}, {dt, dev})),
                         values(binary_cross_entropy_with_logits(x, t, Reduction::sum)), tol));
  }
  // Large logits stay finite: x = 60, t = 1, pos_weight 2: 2 * log1p(exp(-60)).
  const Tensor big = Tensor::from_vec(std::vector<double>{60.0, -60.0}, {2}).to(dev);
  EXPECT_TRUE(near_all(binary_cross_entropy_with_logits(big, Tensor::ones({2}, {DType::f64, dev}), Reduction::none, {},
                                                        Tensor::full({1}, 2.0, {DType::f64, dev})),
                       {2 * std::log1p(std::exp(-60.0)), 2 * 60.0 + 2 * std::log1p(std::exp(-60.0))}, 1e-12));
  const GradcheckResult r = gradcheck(
      [](const TensorList& in) {
        return binary_cross_entropy_with_logits(in[0], in[1], Reduction::mean, in[2], in[3]);
      },
      {x, t, w, pw});
  EXPECT_TRUE(r.ok) << r.message;
  expect_error([&] { binary_cross_entropy_with_logits(x, t, Reduction::mean, {}, Tensor::ones({3}, DType::f64)); },
               {"binary_cross_entropy_with_logits", "pos_weight", "[3]", "[2, 3, 4]"});
  expect_error([&] { binary_cross_entropy_with_logits(x, t, Reduction::mean, Tensor::ones({5, 1}, DType::f64)); },
               {"binary_cross_entropy_with_logits", "weight", "[5, 1]"});
}

// ---- cross_entropy: class weights, smoothing, probabilities ----
// float64 loop of PyTorch's weighted cross entropy for class indices over [N, C, D] scores.
struct CeRef {
  std::vector<double> none;
  double sum = 0, mean = 0;
};
CeRef ce_indices(const Tensor& logits, const std::vector<int64_t>& target, const std::vector<double>& w, double eps,
                 int64_t ignore) {
  const int64_t N = logits.size(0), C = logits.size(1), D = logits.dim() > 2 ? logits.size(2) : 1;
  const std::vector<double> x = values(logits.dim() > 2 ? logits : logits.unsqueeze(2));
  CeRef r;
  double wsum = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d) {
      const int64_t y = target[static_cast<std::size_t>(n * D + d)];
      if (y == ignore) {
        r.none.push_back(0);
        continue;
      }
      double m = -1e300, z = 0;
      for (int64_t c = 0; c < C; ++c) m = std::max(m, x[(n * C + c) * D + d]);
      for (int64_t c = 0; c < C; ++c) z += std::exp(x[(n * C + c) * D + d] - m);
      auto logp = [&](int64_t c) { return x[(n * C + c) * D + d] - m - std::log(z); };
      double smooth = 0;
      for (int64_t c = 0; c < C; ++c) smooth -= w[c] * logp(c);
      const double l = (1 - eps) * (-w[y] * logp(y)) + eps / C * smooth;
      r.none.push_back(l);
      r.sum += l;
      wsum += w[y];
    }
  r.mean = r.sum / wsum;
  return r;
}

TEST(LossWeighted, CrossEntropyClassWeights) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor logits2 = uniform({6, 5}, 9, -3, 3), logits3 = uniform({3, 5, 4}, 10, -3, 3);
  const Tensor w = uniform({5}, 11, 0.2, 2.5);
  const std::vector<double> wv = values(w);
  const std::vector<int64_t> t2 = {0, 4, -100, 2, 2, 1};
  const std::vector<int64_t> t3 = {0, 1, 2, 3, 4, -100, 0, 1, 3, 3, 2, -100};
  for (DType dt : {DType::f64, DType::f32}) {
    const double tol = dt == DType::f64 ? 1e-12 : 3e-6;
    for (double eps : {0.0, 0.2}) {
      for (const auto& [logits, tv] : {std::pair{logits2, t2}, std::pair{logits3, t3}}) {
        Shape ts(logits.sizes());
        ts.erase(ts.begin() + 1);
        const Tensor target = Tensor::from_vec<int64_t>(tv, ts, dev);
        const Tensor x = logits.to(dt).to(dev), wd = w.to(dt).to(dev);
        const CeRef ref = ce_indices(logits, tv, wv, eps, -100);
        EXPECT_TRUE(near_all(cross_entropy(x, target, Reduction::none, -100, eps, wd), ref.none, tol)) << eps;
        EXPECT_TRUE(near_all(cross_entropy(x, target, Reduction::sum, -100, eps, wd), {ref.sum}, tol)) << eps;
        EXPECT_TRUE(near_all(cross_entropy(x, target, Reduction::mean, -100, eps, wd), {ref.mean}, tol)) << eps;
      }
    }
  }
  // Uniform weights give the unweighted loss (the mean's divisor is then c * count).
  const Tensor target = Tensor::from_vec<int64_t>(t2, {6}, dev);
  EXPECT_TRUE(near_all(cross_entropy(logits2.to(dev), target, Reduction::mean, -100, 0.1, Tensor::full({5}, 3.0, {DType::f64, dev})),
                       values(cross_entropy(logits2.to(dev), target, Reduction::mean, -100, 0.1)), 1e-12));
  const Tensor tc = Tensor::from_vec<int64_t>(t3, {3, 4});
  const GradcheckResult r = gradcheck(
      [&](const TensorList& in) { return cross_entropy(in[0], tc, Reduction::mean, -100, 0.15, in[1]); },
      {logits3, w});
  EXPECT_TRUE(r.ok) << r.message;
  expect_error([&] { cross_entropy(logits2, Tensor::from_vec<int64_t>(t2, {6}), Reduction::mean, -100, 0.0,
                                   Tensor::ones({4}, DType::f64)); },
               {"cross_entropy", "weight", "5", "[4]"});
}

TEST(LossWeighted, CrossEntropyProbabilityTargets) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor logits = uniform({3, 4, 2}, 12, -3, 3);
  const Tensor probs = softmax(uniform({3, 4, 2}, 13, -2, 2), 1);
  const Tensor w = uniform({4}, 14, 0.3, 2);
  const std::vector<double> x = values(logits), p = values(probs), wv = values(w);
  for (double eps : {0.0, 0.25}) {
    for (bool weighted : {false, true}) {
      std::vector<double> want;
      for (int64_t n = 0; n < 3; ++n)
        for (int64_t d = 0; d < 2; ++d) {
          double m = -1e300, z = 0, l = 0;
          for (int64_t c = 0; c < 4; ++c) m = std::max(m, x[(n * 4 + c) * 2 + d]);
          for (int64_t c = 0; c < 4; ++c) z += std::exp(x[(n * 4 + c) * 2 + d] - m);
          for (int64_t c = 0; c < 4; ++c) {
            const double t = p[(n * 4 + c) * 2 + d] * (1 - eps) + eps / 4;
            l -= (weighted ? wv[c] : 1.0) * t * (x[(n * 4 + c) * 2 + d] - m - std::log(z));
          }
          want.push_back(l);
        }
      for (DType dt : {DType::f64, DType::f32}) {
        const double tol = dt == DType::f64 ? 1e-12 : 3e-6;
        const Tensor wd = weighted ? w.to(dt).to(dev) : Tensor();
        const Tensor xd = logits.to(dt).to(dev), pd = probs.to(dt).to(dev);
        EXPECT_TRUE(near_all(cross_entropy(xd, pd, Reduction::none, -100, eps, wd), want, tol));
        // The mean is over the 6 elements, weighted or not (PyTorch's rule for probabilities).
        EXPECT_TRUE(near_all(cross_entropy(xd, pd, Reduction::mean, -100, eps, wd), {reduce(want, Reduction::mean)}, tol));
      }
    }
  }
  // One-hot probabilities give the class-index loss.
  const std::vector<int64_t> idx = {1, 3, 0, 2};
  const Tensor l2 = uniform({4, 5}, 15, -2, 2);
  std::vector<double> oh(20, 0.0);
  for (int i = 0; i < 4; ++i) oh[static_cast<std::size_t>(i * 5 + idx[i])] = 1.0;
  const Tensor onehot = Tensor::from_vec(oh, {4, 5});
  EXPECT_TRUE(near_all(cross_entropy(l2.to(dev), onehot.to(dev)),
                       values(cross_entropy(l2, Tensor::from_vec<int64_t>(idx, {4}))), 1e-12));
  const GradcheckResult r = gradcheck(
      [](const TensorList& in) { return cross_entropy(in[0], in[1], Reduction::mean, -100, 0.1, in[2]); },
      {logits, probs, w});
  EXPECT_TRUE(r.ok) << r.message;
  expect_error([&] { cross_entropy(logits, probs.narrow(2, 0, 1)); }, {"cross_entropy", "probabilities", "[3, 4, 2]", "[3, 4, 1]"});
  expect_error([&] { cross_entropy(logits, probs, Reduction::mean, 1); }, {"cross_entropy", "ignore_index", "1"});
}

// The new ops are F:: spellings too (torch.nn.functional's names), the same functions.
TEST(LossWeighted, FunctionalNamespaceSpellings) {
  using Loss = Tensor (*)(const Tensor&, const Tensor&, Reduction, double);
  using Unary = Tensor (*)(const Tensor&);
  EXPECT_EQ(static_cast<Loss>(&F::smooth_l1_loss), static_cast<Loss>(&flame::smooth_l1_loss));
  EXPECT_EQ(static_cast<Loss>(&F::huber_loss), static_cast<Loss>(&flame::huber_loss));
  EXPECT_EQ(static_cast<Unary>(&F::hardswish), static_cast<Unary>(&flame::hardswish));
  EXPECT_EQ(static_cast<Unary>(&F::hardsigmoid), static_cast<Unary>(&flame::hardsigmoid));
}

}  // namespace
}  // namespace flame::test
