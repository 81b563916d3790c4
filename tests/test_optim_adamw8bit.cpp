// optim::AdamW8bit and the block-wise dynamic quantisation of its state: the maps (sorted, 0 and 1
// exact, closed-form entries), quantise/dequantise error bounds per block, one step against a
// float64 reference (dequantise -> AdamW -> nearest code), 300 steps of a regression beside f32
// AdamW, small parameters equal to AdamW bit for bit, state-dict resume bit for bit, bad states
// refused. The AdamW8bitCuda cases run the same checks on CUDA (and against the CPU kernel); they
// skip without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "optim_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {

using namespace optim_ref;

std::vector<double> map_of(bool is_signed) {
  const auto& m = optim::dynamic_map(is_signed);
  return std::vector<double>(m.begin(), m.end());
}

// Nearest map entry to x by a linear scan (ties: the lower code); `ambiguous` is set when the
// second nearest is within `tol` of the nearest (a float rounding may pick either).
int nearest_ref(const std::vector<double>& map, double x, double tol, bool* ambiguous) {
  int best = 0;
  for (int j = 1; j < 256; ++j)
    if (std::abs(x - map[j]) < std::abs(x - map[best])) best = j;
  double second = 1e300;
  for (int j = 0; j < 256; ++j)
    if (j != best) second = std::min(second, std::abs(x - map[j]));
  if (ambiguous) *ambiguous = second - std::abs(x - map[best]) <= tol;
  return best;
}

// f32 data of `values` on dev.
Tensor f32(const std::vector<double>& values, const Shape& s, Device dev = Device::cpu()) {
  return Tensor::from_vec(values, s).to(DType::f32, dev);
}

Tensor param_from(const std::vector<double>& v, const Shape& s, DType dt, Device dev) {
  Tensor t = Tensor::from_vec(v, s).to(dt, dev);
  t.requires_grad_(true);
  return t;
}

std::vector<double> normal(std::size_t n, double scale, std::mt19937_64& rng) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> v(n);
  for (double& x : v) x = scale * nd(rng);
  return v;
}

TEST(AdamW8bit, DynamicMapsAreSortedWithExactZeroAndOne) {
  for (bool is_signed : {true, false}) {
    const auto m = map_of(is_signed);
    for (int j = 1; j < 256; ++j) ASSERT_LT(m[j - 1], m[j]) << "signed " << is_signed << " code " << j;
    EXPECT_EQ(m[255], 1.0);
    EXPECT_EQ(std::count(m.begin(), m.end(), 0.0), 1);
  }
  // Closed forms of the construction: the top decade holds the midpoints of 64 (signed) or 128
  // (unsigned) bins of [0.1, 1]; the lowest decade 1 or 2 bins at scale 1e-6.
  const auto s = map_of(true), u = map_of(false);
  EXPECT_FLOAT_EQ(s[0], -(0.1 + 0.9 * 63.5 / 64));
  EXPECT_FLOAT_EQ(s[254], 0.1 + 0.9 * 63.5 / 64);
  EXPECT_EQ(s[127], 0.0);
  EXPECT_FLOAT_EQ(s[128], 1e-6 * 0.55);
  EXPECT_FLOAT_EQ(s[126], -1e-6 * 0.55);
  EXPECT_EQ(u[0], 0.0);
  EXPECT_FLOAT_EQ(u[1], 1e-6 * (0.1 + 0.9 * 0.25));
  EXPECT_FLOAT_EQ(u[2], 1e-6 * (0.1 + 0.9 * 0.75));
  EXPECT_FLOAT_EQ(u[254], 0.1 + 0.9 * 127.5 / 128);
  EXPECT_EQ(std::count_if(s.begin(), s.end(), [](double x) { return x > 0.1 && x < 1.0; }), 64);
  EXPECT_EQ(std::count_if(u.begin(), u.end(), [](double x) { return x > 0.1 && x < 1.0; }), 128);
}

void check_round_trip(Device dev) {
  std::mt19937_64 rng(11);
  const int64_t bs = 256, n = 5 * bs + 77;  // a partial last block
  for (bool is_signed : {true, false}) {
    std::vector<double> x = normal(static_cast<std::size_t>(n), 1.0, rng);
    for (int64_t i = 0; i < n; ++i) {
      x[i] *= std::pow(10.0, static_cast<double>(i / bs) - 3.0);  // blocks of 1e-3 .. 1e2
      if (!is_signed) x[i] = x[i] * x[i];
      if (i / bs == 2) x[i] = 0.0;  // an all-zero block
    }
    const Tensor xt = Tensor::from_vec(x, {n}).to(DType::f32, dev);
    const auto q = optim::quantize_blockwise(xt, is_signed, bs);
    ASSERT_EQ(q.codes.dtype(), DType::u8);
    ASSERT_EQ(q.absmax.sizes(), (Shape{6}));
    const Tensor back = optim::dequantize_blockwise(q.codes, q.absmax, is_signed, bs);
    const auto xf = xt.to_vec<double>(), bv = back.to_vec<double>(), am = q.absmax.to_vec<double>();
    const auto codes = q.codes.to_vec<int64_t>();
    const auto map = map_of(is_signed);
    double max_half_gap = 0;
    for (int j = 1; j < 256; ++j) max_half_gap = std::max(max_half_gap, (map[j] - map[j - 1]) / 2);
    if (is_signed) max_half_gap = std::max(max_half_gap, 1.0 + map[0]);  // -1 lies below the map
    for (int64_t b = 0; b < 6; ++b) {
      const int64_t begin = b * bs, end = std::min(n, begin + bs);
      double want_am = 0;
      for (int64_t i = begin; i < end; ++i) want_am = std::max(want_am, std::abs(xf[i]));
      ASSERT_EQ(am[b], want_am) << "block " << b;
      for (int64_t i = begin; i < end; ++i) {
        if (want_am == 0) {
          ASSERT_EQ(bv[i], 0.0) << "zero block, element " << i;
          continue;
        }
        bool amb = false;
        const int want = nearest_ref(map, xf[i] / want_am, 1e-6 * std::abs(xf[i] / want_am), &amb);
        if (!amb) ASSERT_EQ(codes[i], want) << "signed " << is_signed << " element " << i;
        ASSERT_FLOAT_EQ(bv[i], map[codes[i]] * want_am) << "element " << i;
        // The half gap plus the f32 rounding of map * absmax.
        ASSERT_LE(std::abs(bv[i] - xf[i]), (max_half_gap + 4e-7) * want_am) << "element " << i;
        if (std::abs(xf[i]) == want_am && xf[i] > 0) ASSERT_EQ(bv[i], xf[i]) << "the absmax element is exact";
      }
    }
    // Within a block, the relative error is at most that of the top decade (0.9 / 128 of absmax).
    EXPECT_LE(max_half_gap, 0.9 / 128 + 1e-7);
  }
}

TEST(AdamW8bit, QuantizeRoundTripErrorIsBoundedPerBlock) { check_round_trip(Device::cpu()); }

TEST(AdamW8bit, CodesAreMonotoneAndZeroIsZero) {
  std::vector<double> x(256);
  for (int i = 0; i < 256; ++i) x[i] = -1.0 + 2.0 * i / 255.0;
  x[100] = 0.0;
  std::sort(x.begin(), x.end());
  const auto q = optim::quantize_blockwise(Tensor::from_vec(x, {256}), true, 256);
  const auto c = q.codes.to_vec<int64_t>();
  for (int i = 1; i < 256; ++i) ASSERT_LE(c[i - 1], c[i]) << "element " << i;
  const auto back = optim::dequantize_blockwise(q.codes, q.absmax, true, 256).to_vec<double>();
  for (int i = 0; i < 256; ++i)
    if (x[i] == 0.0) EXPECT_EQ(back[i], 0.0);
  EXPECT_EQ(c.front(), 0);
  EXPECT_EQ(c.back(), 255);
  // Unsigned: increasing squares give non-decreasing codes; 0 is code 0.
  std::vector<double> y(300);
  for (int i = 0; i < 300; ++i) y[i] = std::pow(1.05, i) - 1.0;
  const auto qu = optim::quantize_blockwise(Tensor::from_vec(y, {300}), false, 512);
  const auto cu = qu.codes.to_vec<int64_t>();
  EXPECT_EQ(cu[0], 0);
  for (int i = 1; i < 300; ++i) ASSERT_LE(cu[i - 1], cu[i]) << "element " << i;
  EXPECT_THROW(optim::quantize_blockwise(Tensor::from_vec(std::vector<double>{1.0, -0.5}, {2}), false, 256),
               Error);
}

// Steps one 8-bit parameter three times and checks each step against the float64 reference from
// the state the optimizer held before it: parameter within f32 rounding, absmax within 1e-6,
// every code equal to the nearest map entry (either neighbour where the value lies within f32
// rounding of the midpoint between two entries).
void check_one_step_reference(Device dev) {
  std::mt19937_64 rng(5);
  const Shape shape{3, 200};  // 600 elements: blocks of 256, 256, 88
  const int64_t n = 600, bs = 256;
  const double lr = 1e-2, wd = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  Tensor p = param_from(normal(n, 1.0, rng), shape, DType::f32, dev);
  optim::AdamW8bit opt({p}, {.lr = lr, .betas = {b1, b2}, .eps = eps, .weight_decay = wd, .min_8bit_size = 512});
  ASSERT_TRUE(opt.is_8bit(p));
  const auto ms = map_of(true), mu = map_of(false);
  int ambiguous = 0;
  for (int t = 1; t <= 3; ++t) {
    std::vector<double> m(n, 0.0), v(n, 0.0);
    if (t > 1) {
      const auto cm = opt.state(p, "exp_avg_codes").to_vec<int64_t>();
      const auto cv = opt.state(p, "exp_avg_sq_codes").to_vec<int64_t>();
      const auto am = opt.state(p, "exp_avg_absmax").to_vec<double>();
      const auto av = opt.state(p, "exp_avg_sq_absmax").to_vec<double>();
      for (int64_t i = 0; i < n; ++i) {
        m[i] = ms[cm[i]] * am[i / bs];
        v[i] = mu[cv[i]] * av[i / bs];
      }
    }
    std::vector<double> pv = p.to_vec<double>();
    // Gradients of a different scale per block, so the blocks' absmax differ.
    std::vector<double> g = normal(n, 1.0, rng);
    for (int64_t i = 0; i < n; ++i) g[i] *= std::pow(10.0, static_cast<double>(i / bs) - 1.0);
    Gradients gs;
    gs.set(p, Tensor::from_vec(g, shape).to(DType::f32, dev));
    opt.step(gs);
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    std::vector<double> am(3, 0.0), av(3, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      pv[i] *= 1 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      pv[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
      am[i / bs] = std::max(am[i / bs], std::abs(m[i]));
      av[i / bs] = std::max(av[i / bs], v[i]);
    }
    const auto got_p = p.to_vec<double>();
    const auto got_am = opt.state(p, "exp_avg_absmax").to_vec<double>();
    const auto got_av = opt.state(p, "exp_avg_sq_absmax").to_vec<double>();
    const auto cm = opt.state(p, "exp_avg_codes").to_vec<int64_t>();
    const auto cv = opt.state(p, "exp_avg_sq_codes").to_vec<int64_t>();
    for (int b = 0; b < 3; ++b) {
      ASSERT_NEAR(got_am[b], am[b], 1e-6 * am[b]) << "step " << t << " block " << b;
      ASSERT_NEAR(got_av[b], av[b], 1e-6 * av[b]) << "step " << t << " block " << b;
    }
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(got_p[i], pv[i], 1e-6 * std::abs(pv[i]) + 1e-7) << "step " << t << " element " << i;
      const double xm = m[i] / am[i / bs], xv = v[i] / av[i / bs];
      bool amb_m = false, amb_v = false;
      const int want_m = nearest_ref(ms, xm, 2e-6 * std::abs(xm) + 1e-12, &amb_m);
      const int want_v = nearest_ref(mu, xv, 2e-6 * std::abs(xv) + 1e-12, &amb_v);
      if (amb_m) ASSERT_LE(std::abs(cm[i] - want_m), 1) << "step " << t << " element " << i;
      else ASSERT_EQ(cm[i], want_m) << "exp_avg code, step " << t << " element " << i << " value " << xm;
      if (amb_v) ASSERT_LE(std::abs(cv[i] - want_v), 1) << "step " << t << " element " << i;
      else ASSERT_EQ(cv[i], want_v) << "exp_avg_sq code, step " << t << " element " << i << " value " << xv;
      ambiguous += (amb_m ? 1 : 0) + (amb_v ? 1 : 0);
    }
  }
  // Ties within rounding are rare: the comparison above is exact for nearly every code.
  EXPECT_LE(ambiguous, 10);
}

TEST(AdamW8bit, OneStepMatchesFloat64Reference) { check_one_step_reference(Device::cpu()); }

// Linear regression Y = X W*^T + noise (512 rows), W [128, 64] (8192 elements, 8-bit state) and a
// bias [128] (f32 state), MSE loss, 300 steps of AdamW and AdamW8bit (lr 3e-3) from the same start.
// Returns both loss curves.
struct Curves {
  std::vector<double> f32, q8;
};
Curves regression_curves(Device dev) {
  std::mt19937_64 rng(21);
  const int64_t rows = 512, in = 64, out = 128;
  const Tensor x = f32(normal(rows * in, 1.0, rng), {rows, in}, dev);
  const Tensor w_true = f32(normal(out * in, 0.2, rng), {out, in}, dev);
  const Tensor y = (matmul(x, w_true.t()) + f32(normal(rows * out, 0.05, rng), {rows, out}, dev));
  const std::vector<double> w0 = normal(out * in, 0.05, rng), b0 = normal(out, 0.05, rng);
  Curves c;
  for (int which = 0; which < 2; ++which) {
    Tensor w = param_from(w0, {out, in}, DType::f32, dev), b = param_from(b0, {out}, DType::f32, dev);
    std::unique_ptr<optim::Optimizer> opt;
    if (which == 0) opt = std::make_unique<optim::AdamW>(TensorList{w, b}, optim::AdamWOptions{.lr = 3e-3});
    else opt = std::make_unique<optim::AdamW8bit>(TensorList{w, b}, optim::AdamW8bitOptions{.lr = 3e-3});
    for (int s = 0; s < 300; ++s) {
      Tensor loss = mse_loss(matmul(x, w.t()) + b, y);
      (which == 0 ? c.f32 : c.q8).push_back(loss.item<double>());
      opt->step(loss.backward());
    }
  }
  return c;
}

void check_regression(Device dev) {
  const Curves c = regression_curves(dev);
  // Both converge (the start is 2.7; the noise floor 0.0022; AdamW reaches 0.0053 in 300 steps) ...
  EXPECT_LT(c.f32.back(), 0.005 * c.f32.front());
  EXPECT_LT(c.q8.back(), 0.005 * c.q8.front());
  // ... and the 8-bit loss stays within 8% of AdamW's at every step (it runs 0-5% above it: the
  // quantised second moment of the small late gradients is coarser).
  for (std::size_t s = 0; s < c.f32.size(); ++s) ASSERT_NEAR(c.q8[s], c.f32[s], 0.08 * c.f32[s]) << "step " << s;
}

TEST(AdamW8bit, TracksAdamWOnRegression) { check_regression(Device::cpu()); }

// make_problem's parameters (7 to 30 elements) all stay below min_8bit_size: AdamW's state, AdamW's
// bits, for f32 and for bf16 with master weights.
void check_small_equal_adamw(Device dev) {
  const Problem pb = make_problem(12, 9, true);
  for (DType dt : {DType::f32, DType::bf16}) {
    const TensorList a = make_params(pb, dt, dev), b = make_params(pb, dt, dev);
    optim::AdamW ref({optim::AdamWOptions{.lr = 1e-2, .weight_decay = 0.05}.group({a[0], a[1]}),
                      optim::AdamWOptions{.lr = 3e-2, .weight_decay = 0.05}.group({a[2], a[3]})},
                     {});
    optim::AdamW8bit opt({optim::AdamW8bitOptions{.lr = 1e-2, .weight_decay = 0.05}.group({b[0], b[1]}),
                          optim::AdamW8bitOptions{.lr = 3e-2, .weight_decay = 0.05}.group({b[2], b[3]})},
                         {});
    for (int s = 0; s < pb.steps; ++s) {
      ref.step(grads_at(pb, a, s));
      opt.step(grads_at(pb, b, s));
    }
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_FALSE(opt.is_8bit(i));
      EXPECT_EQ(a[i].to_vec<double>(), b[i].to_vec<double>()) << dtype_name(dt) << " parameter " << i;
      EXPECT_EQ(ref.state(i, "exp_avg_sq").to_vec<double>(), opt.state(i, "exp_avg_sq").to_vec<double>());
      EXPECT_FALSE(opt.state(i, "exp_avg_codes").defined());
      EXPECT_EQ(opt.param_step(i), ref.param_step(i));
    }
  }
}

TEST(AdamW8bit, SmallParametersEqualAdamWExactly) { check_small_equal_adamw(Device::cpu()); }

// A bf16 parameter with f32 master weights follows the f32 parameter of the same values bit for
// bit (master, codes, absmax), and the bf16 parameter is its master rounded.
TEST(AdamW8bit, HalfParametersStepTheirMasterWeights) {
  std::mt19937_64 rng(3);
  std::vector<double> init = normal(5000, 1.0, rng);
  for (double& x : init) x = static_cast<double>(static_cast<float>(bfloat16(static_cast<float>(x))));
  Tensor ph = param_from(init, {5000}, DType::bf16, Device::cpu());
  Tensor pf = param_from(init, {5000}, DType::f32, Device::cpu());
  optim::AdamW8bit oh({ph}, {.lr = 1e-2}), of({pf}, {.lr = 1e-2});
  for (int s = 0; s < 4; ++s) {
    std::vector<double> g = normal(5000, 0.3, rng);
    for (double& x : g) x = static_cast<double>(static_cast<float>(bfloat16(static_cast<float>(x))));
    Gradients gh, gf;
    gh.set(ph, Tensor::from_vec(g, {5000}).to(DType::bf16));
    gf.set(pf, Tensor::from_vec(g, {5000}).to(DType::f32));
    oh.step(gh);
    of.step(gf);
  }
  const Tensor master = oh.master_weights(ph);
  ASSERT_TRUE(master.defined());
  EXPECT_EQ(master.to_vec<double>(), pf.to_vec<double>());
  EXPECT_EQ(ph.to_vec<double>(), master.to(DType::bf16).to_vec<double>());
  for (const char* slot : {"exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax", "exp_avg_sq_absmax"})
    EXPECT_EQ(oh.state(ph, slot).to_vec<double>(), of.state(pf, slot).to_vec<double>()) << slot;
}

TEST(AdamW8bit, StateIsTwoBytesPerElementPlusAbsmax) {
  Tensor p = param_from(std::vector<double>(64 * 100, 0.5), {64, 100}, DType::f32, Device::cpu());
  optim::AdamW8bit opt({p});
  Gradients gs;
  gs.set(p, Tensor::full({64, 100}, 0.25));
  opt.step(gs);
  int64_t bytes = 0;
  for (const char* slot : {"exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax", "exp_avg_sq_absmax"}) {
    const Tensor t = opt.state(p, slot);
    bytes += t.numel() * static_cast<int64_t>(dtype_size(t.dtype()));
  }
  EXPECT_EQ(opt.state(p, "exp_avg_codes").sizes(), (Shape{64, 100}));
  EXPECT_EQ(opt.state(p, "exp_avg_absmax").sizes(), (Shape{25}));
  EXPECT_EQ(bytes, 2 * 6400 + 2 * 25 * 4);  // 2.03 bytes per element; AdamW keeps 8
  EXPECT_FALSE(opt.state(p, "exp_avg").defined());
}

// Two parameters (6400 elements, 8-bit; 50, f32) step 3 times; a second optimizer on copies loads
// the state dict and both step 4 more times: identical bits.
void check_resume(Device dev) {
  std::mt19937_64 rng(17);
  const std::vector<double> w0 = normal(6400, 1.0, rng), b0 = normal(50, 1.0, rng);
  std::vector<std::vector<double>> grads;
  for (int s = 0; s < 7; ++s) {
    grads.push_back(normal(6400, 0.5, rng));
    grads.push_back(normal(50, 0.5, rng));
  }
  auto step = [&](optim::AdamW8bit& o, const Tensor& w, const Tensor& b, int s) {
    Gradients gs;
    gs.set(w, f32(grads[2 * s], {64, 100}, dev));
    gs.set(b, f32(grads[2 * s + 1], {50}, dev));
    o.step(gs);
  };
  const optim::AdamW8bitOptions o{.lr = 5e-3, .weight_decay = 0.02};
  Tensor w = param_from(w0, {64, 100}, DType::f32, dev), b = param_from(b0, {50}, DType::f32, dev);
  optim::AdamW8bit a({w, b}, o);
  for (int s = 0; s < 3; ++s) step(a, w, b, s);
  const StateDict sd = a.state_dict();
  EXPECT_EQ(sd.find("state.0.exp_avg_codes")->dtype(), DType::u8);
  EXPECT_EQ(sd.find("state.0.exp_avg_sq_absmax")->sizes(), (Shape{25}));
  EXPECT_EQ(sd.find("state.1.exp_avg")->dtype(), DType::f32);
  EXPECT_EQ(sd.find("state.0.step")->item<int64_t>(), 3);
  EXPECT_EQ(sd.find("options.block_size")->item<int64_t>(), 256);
  Tensor w2 = param_from(w.to_vec<double>(), {64, 100}, DType::f32, dev);
  Tensor b2 = param_from(b.to_vec<double>(), {50}, DType::f32, dev);
  optim::AdamW8bit r({w2, b2}, o);
  r.load_state_dict(sd);
  for (int s = 3; s < 7; ++s) {
    step(a, w, b, s);
    step(r, w2, b2, s);
  }
  EXPECT_EQ(w.to_vec<double>(), w2.to_vec<double>());
  EXPECT_EQ(b.to_vec<double>(), b2.to_vec<double>());
  for (const char* slot : {"exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax", "exp_avg_sq_absmax"})
    EXPECT_EQ(a.state(0, slot).to_vec<double>(), r.state(0, slot).to_vec<double>()) << slot;
  EXPECT_EQ(r.param_step(0), 7);
}

TEST(AdamW8bit, StateDictRoundTripResumesBitIdentically) { check_resume(Device::cpu()); }

TEST(AdamW8bit, LoadStateDictRejectsWrongState) {
  std::mt19937_64 rng(2);
  Tensor w = param_from(normal(6400, 1.0, rng), {64, 100}, DType::f32, Device::cpu());
  Gradients gs;
  gs.set(w, f32(normal(6400, 1.0, rng), {64, 100}));
  optim::AdamW8bit opt({w});
  opt.step(gs);
  const StateDict good = opt.state_dict();
  const auto codes_before = opt.state(0, "exp_avg_codes").to_vec<int64_t>();
  auto expect_refused = [&](const StateDict& sd, const std::string& needle) {
    try {
      opt.load_state_dict(sd);
      ADD_FAILURE() << "accepted a state that should fail with \"" << needle << "\"";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(opt.state(0, "exp_avg_codes").to_vec<int64_t>(), codes_before) << "state changed by a refused load";
  };
  // Another block size.
  {
    Tensor w2 = param_from(normal(6400, 1.0, rng), {64, 100}, DType::f32, Device::cpu());
    optim::AdamW8bit o2({w2}, {.block_size = 128});
    Gradients g2;
    g2.set(w2, f32(normal(6400, 1.0, rng), {64, 100}));
    o2.step(g2);
    expect_refused(o2.state_dict(), "saved with block_size 128");
  }
  // f32 state for a parameter this optimizer keeps in 8 bits (saved with a larger min_8bit_size).
  {
    Tensor w2 = param_from(normal(6400, 1.0, rng), {64, 100}, DType::f32, Device::cpu());
    optim::AdamW8bit o2({w2}, {.min_8bit_size = 10000});
    Gradients g2;
    g2.set(w2, f32(normal(6400, 1.0, rng), {64, 100}));
    o2.step(g2);
    expect_refused(o2.state_dict(), "keeps 8-bit state here (min_8bit_size 4096)");
  }
  // AdamW's state dict.
  {
    Tensor w2 = param_from(normal(6400, 1.0, rng), {64, 100}, DType::f32, Device::cpu());
    optim::AdamW o2({w2});
    Gradients g2;
    g2.set(w2, f32(normal(6400, 1.0, rng), {64, 100}));
    o2.step(g2);
    expect_refused(o2.state_dict(), "missing key \"options.block_size\"");
  }
  // Codes of another shape, of another dtype; absmax of another length.
  auto with = [&](const std::string& key, const Tensor& t) {
    StateDict sd;
    for (const auto& [k, v] : good) sd.insert(k, k == key ? t : v);
    return sd;
  };
  expect_refused(with("state.0.exp_avg_codes", Tensor::zeros({6400}, TensorOptions(DType::u8))),
                 "state.0.exp_avg_codes has shape [6400], parameter 0 needs [64, 100]");
  expect_refused(with("state.0.exp_avg_sq_codes", Tensor::zeros({64, 100})), "has dtype f32");
  expect_refused(with("state.0.exp_avg_absmax", Tensor::zeros({50})), "state.0.exp_avg_absmax has shape [50]");
  // The good state loads.
  EXPECT_NO_THROW(opt.load_state_dict(good));
}

TEST(AdamW8bit, OptionsAreValidated) {
  Tensor w = param_from(std::vector<double>(10, 1.0), {10}, DType::f32, Device::cpu());
  EXPECT_THROW(optim::AdamW8bit({w}, {.block_size = 100}), Error);
  EXPECT_THROW(optim::AdamW8bit({w}, {.block_size = 8192}), Error);
  EXPECT_THROW(optim::AdamW8bit({w}, {.min_8bit_size = -1}), Error);
  EXPECT_THROW(optim::AdamW8bit({w}, {.lr = -1.0}), Error);
  EXPECT_THROW(optim::AdamW8bit({w}, {.betas = {0.9, 1.0}}), Error);
}

TEST(AdamW8bit, OneBackendCallPerKindPerStep) {
  std::mt19937_64 rng(8);
  TensorList ps;
  Gradients gs;
  for (int i = 0; i < 5; ++i) {
    ps.push_back(param_from(normal(4096 + 100 * i, 1.0, rng), {4096 + 100 * i}, DType::f32, Device::cpu()));
    gs.set(ps.back(), f32(normal(4096 + 100 * i, 1.0, rng), {4096 + 100 * i}));
  }
  optim::AdamW8bit q8(ps);
  int64_t before = optim::fused_launch_count();
  q8.step(gs);
  EXPECT_EQ(optim::fused_launch_count() - before, 1);
  Tensor small = param_from(std::vector<double>(30, 1.0), {30}, DType::f32, Device::cpu());
  gs.set(small, Tensor::full({30}, 0.5));
  TensorList mixed = ps;
  mixed.push_back(small);
  optim::AdamW8bit both(mixed);
  before = optim::fused_launch_count();
  both.step(gs);
  EXPECT_EQ(optim::fused_launch_count() - before, 2);  // the 8-bit kernel and AdamW's
}

// ---- CUDA ----

TEST(AdamW8bitCuda, QuantizeRoundTripErrorIsBoundedPerBlock) {
  FLAME_SKIP_IF_NO_CUDA();
  check_round_trip(Device::cuda(0));
}

TEST(AdamW8bitCuda, OneStepMatchesFloat64Reference) {
  FLAME_SKIP_IF_NO_CUDA();
  check_one_step_reference(Device::cuda(0));
}

TEST(AdamW8bitCuda, TracksAdamWOnRegression) {
  FLAME_SKIP_IF_NO_CUDA();
  check_regression(Device::cuda(0));
}

TEST(AdamW8bitCuda, SmallParametersEqualAdamWExactly) {
  FLAME_SKIP_IF_NO_CUDA();
  check_small_equal_adamw(Device::cuda(0));
}

TEST(AdamW8bitCuda, StateDictRoundTripResumesBitIdentically) {
  FLAME_SKIP_IF_NO_CUDA();
  check_resume(Device::cuda(0));
}

// The CUDA kernel against the CPU kernel over 5 steps, for every parameter dtype (bf16/f16 with and
// without master weights), 230 tensors (two launches) of odd sizes including partial blocks: the
// parameters agree to the compute type's rounding, the absmax to 1e-5, the codes exactly or by one
// where the value sits on a rounding boundary (at most 0.1% of them); a parameter whose state took
// the neighbouring code may differ by a fraction of lr (at most 0.1% of the parameters).
TEST(AdamW8bitCuda, StepMatchesCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  struct C {
    DType dt;
    bool master;
    double rtol;
  };
  for (const C c : {C{DType::f32, true, 1e-5}, C{DType::f64, true, 1e-12}, C{DType::bf16, true, 1e-2},
                    C{DType::bf16, false, 2e-2}, C{DType::f16, false, 4e-3}}) {
    std::mt19937_64 rng(31);
    std::vector<std::vector<double>> init, grads;
    std::vector<int64_t> sizes;
    for (int i = 0; i < 230; ++i) {
      sizes.push_back(i == 0 ? 70001 : 300 + 37 * i);
      init.push_back(normal(static_cast<std::size_t>(sizes.back()), 1.0, rng));
    }
    TensorList pc, pg;
    for (int i = 0; i < 230; ++i) {
      pc.push_back(param_from(init[i], {sizes[i]}, c.dt, Device::cpu()));
      pg.push_back(param_from(init[i], {sizes[i]}, c.dt, Device::cuda(0)));
    }
    const optim::AdamW8bitOptions o{.lr = 1e-2, .min_8bit_size = 0, .master_weights = c.master};
    optim::AdamW8bit oc(pc, o), og(pg, o);
    int64_t launches = 0;
    for (int s = 0; s < 5; ++s) {
      Gradients gc, gg;
      for (int i = 0; i < 230; ++i) {
        const Tensor g = Tensor::from_vec(normal(static_cast<std::size_t>(sizes[i]), 1.0, rng), {sizes[i]});
        gc.set(pc[i], g.to(c.dt));
        gg.set(pg[i], g.to(c.dt, Device::cuda(0)));
      }
      oc.step(gc);
      const int64_t before = optim::fused_launch_count();
      og.step(gg);
      launches = optim::fused_launch_count() - before;
    }
    EXPECT_EQ(launches, 2) << "230 tensors in launches of 200";
    int64_t off_by_one = 0, total = 0, params_off = 0, params = 0;
    double worst_off = 0.0;
    for (int i = 0; i < 230; ++i) {
      const std::string what = std::string(dtype_name(c.dt)) + (c.master ? " master" : "") + " tensor " +
                               std::to_string(i);
      const auto a = pc[i].to_vec<double>(), b = pg[i].to_vec<double>();
      for (std::size_t k = 0; k < a.size(); ++k) {
        const double d = std::abs(b[k] - a[k]);
        if (d <= c.rtol * (std::abs(a[k]) + 1e-2)) continue;
        // A state code one apart dequantises to the neighbouring map value, which moves that
        // element's later updates by a fraction of lr: bounded by half of 5 steps of lr.
        ASSERT_LE(d, 0.5 * 5 * o.lr) << what << " element " << k << ": " << b[k] << " on CUDA, " << a[k] << " on the CPU";
        ++params_off;
        worst_off = std::max(worst_off, d);
      }
      params += static_cast<int64_t>(a.size());
      for (const char* slot : {"exp_avg_absmax", "exp_avg_sq_absmax"}) {
        const auto x = oc.state(i, slot).to_vec<double>(), y = og.state(i, slot).to_vec<double>();
        for (std::size_t k = 0; k < x.size(); ++k) ASSERT_NEAR(y[k], x[k], 1e-5 * x[k]) << what << " " << slot;
      }
      for (const char* slot : {"exp_avg_codes", "exp_avg_sq_codes"}) {
        const auto x = oc.state(i, slot).to_vec<int64_t>(), y = og.state(i, slot).to_vec<int64_t>();
        for (std::size_t k = 0; k < x.size(); ++k) {
          ASSERT_LE(std::abs(x[k] - y[k]), 1) << what << " " << slot << " element " << k;
          off_by_one += x[k] != y[k] ? 1 : 0;
        }
        total += static_cast<int64_t>(x.size());
      }
    }
    std::printf("# AdamW8bit %s%s: %lld of %lld codes one apart; %lld of %lld parameters beyond rtol %.0e (worst %.2e)\n",
                dtype_name(c.dt), c.master ? " master" : "", static_cast<long long>(off_by_one),
                static_cast<long long>(total), static_cast<long long>(params_off), static_cast<long long>(params),
                c.rtol, worst_off);
    EXPECT_LE(off_by_one, total / 1000) << dtype_name(c.dt);
    EXPECT_LE(params_off, params / 1000) << dtype_name(c.dt) << ": parameters beyond the compute type's rounding";
  }
}

// A state saved on CUDA loads into a CPU optimizer (and back), and the CPU copy continues like the
// CUDA one within f32 rounding.
TEST(AdamW8bitCuda, StateMovesBetweenDevices) {
  FLAME_SKIP_IF_NO_CUDA();
  std::mt19937_64 rng(4);
  const std::vector<double> w0 = normal(9000, 1.0, rng);
  Tensor wg = param_from(w0, {9000}, DType::f32, Device::cuda(0));
  optim::AdamW8bit og({wg});
  const std::vector<double> g0 = normal(9000, 1.0, rng), g1 = normal(9000, 1.0, rng);
  Gradients gs;
  gs.set(wg, f32(g0, {9000}, Device::cuda(0)));
  og.step(gs);
  Tensor wc = param_from(wg.to_vec<double>(), {9000}, DType::f32, Device::cpu());
  optim::AdamW8bit oc({wc});
  oc.load_state_dict(og.state_dict());
  EXPECT_EQ(oc.state(0, "exp_avg_codes").to_vec<int64_t>(), og.state(0, "exp_avg_codes").to_vec<int64_t>());
  Gradients gg, gc;
  gg.set(wg, f32(g1, {9000}, Device::cuda(0)));
  gc.set(wc, f32(g1, {9000}));
  og.step(gg);
  oc.step(gc);
  const auto a = wg.to_vec<double>(), b = wc.to_vec<double>();
  for (std::size_t k = 0; k < a.size(); ++k) ASSERT_NEAR(a[k], b[k], 1e-5 * std::abs(a[k]) + 1e-6) << k;
}

}  // namespace
}  // namespace flame::test
