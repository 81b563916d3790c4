// GradScaler (skip/backoff on Inf, growth, unscale before clipping, state) and bf16 autocast
// training of a small model against its f32 run.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "flame/amp.h"
#include "flame/flame.h"
#include "flame/nn.h"
#include "flame/optim/optimizer.h"
#include "test_util.h"

namespace flame::test {
namespace {

using nn::functional::layer_norm;
using nn::functional::linear;

// A plain SGD written against the Optimizer base only (the real optimizers live elsewhere).
class TestSgd : public optim::Optimizer {
 public:
  TestSgd(TensorList params, double lr) {
    optim::ParamGroup g;
    g.params = std::move(params);
    g.lr = lr;
    groups_.push_back(std::move(g));
  }
  void step(const Gradients& grads) override {
    ++steps;
    NoGradGuard ng;
    for (const optim::ParamGroup& g : groups_) {
      for (const Tensor& p : g.params) {
        if (!grads.contains(p)) continue;
        Tensor q = p;
        q.sub_(grads.get(p) * g.lr);
      }
    }
  }
  std::string name() const override { return "TestSgd"; }
  StateDict state_dict() const override { return {}; }
  void load_state_dict(const StateDict&) override {}
  int steps = 0;
};

Tensor rnd(const Shape& shape, uint64_t seed, DType dt = DType::f32, double lo = -1.0, double hi = 1.0) {
  return make_input({shape, dt, Layout::contiguous, lo, hi}, test_device(), seed);
}

Tensor param(const Shape& shape, uint64_t seed) {
  Tensor p = rnd(shape, seed);
  p.requires_grad_(true);
  return p;
}

std::vector<double> host(const Tensor& t) { return t.to(DType::f64).to(Device::cpu()).to_vec<double>(); }

TEST(AmpGradScaler, ScaleMultipliesTheLoss) {
  FLAME_SKIP_IF_NO_DEVICE();
  amp::GradScaler scaler;
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  const Tensor loss = rnd({}, 1);
  EXPECT_DOUBLE_EQ(scaler.scale(loss).item<double>(), loss.item<double>() * 65536.0);
  amp::GradScaler off(amp::GradScalerOptions{.enabled = false});
  EXPECT_EQ(off.get_scale(), 1.0);
  EXPECT_DOUBLE_EQ(off.scale(loss).item<double>(), loss.item<double>());
}

// unscale_ divides every gradient of the optimizer (f32, bf16, f16, a transposed layout) by the
// scale and leaves the flag clear; a NaN anywhere sets it.
TEST(AmpGradScaler, UnscaleValuesAndFlag) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = param({37, 5}, 2), b = param({1000}, 3), c = param({3, 7}, 4), d = param({8, 6}, 5);
  Tensor c16 = c.detach().to(DType::f16), b16 = b.detach().to(DType::bf16);
  c16.requires_grad_(true);
  b16.requires_grad_(true);
  TestSgd opt({a, b16, c16, d}, 0.1);
  amp::GradScaler scaler(amp::GradScalerOptions{.init_scale = 1024.0});
  Gradients grads;
  const Tensor ga = rnd({37, 5}, 6, DType::f32, -1000, 1000), gb = rnd({1000}, 7, DType::bf16, -1000, 1000),
               gc = rnd({3, 7}, 8, DType::f16, -1000, 1000);
  const Tensor gd = rnd({6, 8}, 9, DType::f32, -1000, 1000).t();  // a transposed (dense) layout
  grads.set(a, ga);
  grads.set(b16, gb);
  grads.set(c16, gc);
  grads.set(d, gd);
  scaler.unscale_(opt, grads);
  auto check = [&](const Tensor& p, const Tensor& g) {
    const std::vector<double> got = host(grads.get(p)), want = host(g);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i] / 1024.0) << i;  // power of 2: exact
  };
  check(a, ga);
  check(b16, gb);
  check(c16, gc);
  check(d, gd);
  // Stepping through: finite, so the optimizer steps once.
  EXPECT_TRUE(scaler.step(opt, grads));
  EXPECT_EQ(opt.steps, 1);
  scaler.update();

  // A NaN in the middle of the bf16 gradient (past the vectorised prefix on CUDA too).
  std::vector<float> v(1000, 0.5f);
  v[997] = std::numeric_limits<float>::quiet_NaN();
  const Tensor bad = Tensor::from_vec(v, {1000}).to(DType::bf16, test_device());
  grads.set(b16, bad);
  EXPECT_FALSE(scaler.step(opt, grads));
  EXPECT_EQ(opt.steps, 1);
}

// An injected Inf: the step is skipped (parameters unchanged), the scale backs off by half and
// the growth tracker restarts; growth_interval clean steps later the scale doubles.
TEST(AmpGradScaler, SkipsOnInfAndGrowsAfterInterval) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = param({4, 3}, 20);
  TestSgd opt({w}, 0.5);
  amp::GradScaler scaler(amp::GradScalerOptions{.init_scale = 256.0, .growth_interval = 3});
  const Tensor x = rnd({5, 3}, 21);
  auto iteration = [&](bool inject_inf) {
    const Tensor loss = linear(x, w).square().mean();
    Gradients g = scaler.scale(loss).backward();
    if (inject_inf) {
      NoGradGuard ng;
      Tensor gw = g.at(w);
      gw.copy_(masked_fill(gw, eq(Tensor::arange(12, {DType::i64, test_device()}).view({4, 3}),
                                  Tensor::scalar(int64_t{7}, {DType::i64, test_device()})),
                           std::numeric_limits<double>::infinity()));
    }
    const bool stepped = scaler.step(opt, g);
    scaler.update();
    return stepped;
  };
  EXPECT_TRUE(iteration(false));
  EXPECT_EQ(scaler.growth_tracker(), 1);
  const std::vector<double> before = host(w);
  EXPECT_FALSE(iteration(true));
  EXPECT_EQ(host(w), before);  // skipped
  EXPECT_EQ(scaler.get_scale(), 128.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  EXPECT_TRUE(iteration(false));
  EXPECT_TRUE(iteration(false));
  EXPECT_EQ(scaler.get_scale(), 128.0);
  EXPECT_EQ(scaler.growth_tracker(), 2);
  EXPECT_TRUE(iteration(false));
  EXPECT_EQ(scaler.get_scale(), 256.0);  // 3 clean steps in a row
  EXPECT_EQ(scaler.growth_tracker(), 0);
  EXPECT_EQ(opt.steps, 4);
}

// The default PyTorch configuration: 2000 clean steps double 65536.
TEST(AmpGradScaler, DefaultGrowthInterval) {
  Tensor w = Tensor::ones({2});
  w.requires_grad_(true);
  TestSgd opt({w}, 0.0);
  amp::GradScaler scaler;
  for (int i = 0; i < 1999; ++i) {
    Gradients g;
    g.set(w, Tensor::ones({2}));
    scaler.step(opt, g);
    scaler.update();
  }
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  Gradients g;
  g.set(w, Tensor::ones({2}));
  scaler.step(opt, g);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 131072.0);
}

// unscale_ before clipping: the clip sees true gradients, step() does not divide again, and the
// update equals lr * clipped true gradient (computed here in float64).
TEST(AmpGradScaler, UnscaleThenClip) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = param({6, 4}, 30);
  const std::vector<double> w0 = host(w);
  TestSgd opt({w}, 0.25);
  amp::GradScaler scaler(amp::GradScalerOptions{.init_scale = 4096.0});
  const Tensor x = rnd({8, 4}, 31);
  const Tensor loss = linear(x, w).square().sum();
  Gradients g = scaler.scale(loss).backward();
  const std::vector<double> scaled = host(g.get(w));
  scaler.unscale_(opt, g);
  expect_error([&] { scaler.unscale_(opt, g); }, {"GradScaler::unscale_", "already"});
  // The true gradient norm (float64, from the scaled values), then FLAME's clip to max norm 1.
  double sq = 0;
  for (double v : scaled) sq += (v / 4096.0) * (v / 4096.0);
  const double norm = std::sqrt(sq), max_norm = 1.0;
  ASSERT_GT(norm, max_norm);  // the clip does something
  const double clip_saw = clip_grad_norm_(g, max_norm);
  EXPECT_NEAR(clip_saw, norm, 1e-5 * norm);  // the clip saw the unscaled gradients
  EXPECT_TRUE(scaler.step(opt, g));
  const std::vector<double> w1 = host(w);
  for (std::size_t i = 0; i < w1.size(); ++i) {
    const double true_grad = scaled[i] / 4096.0 * (max_norm / norm);
    EXPECT_NEAR(w1[i], w0[i] - 0.25 * true_grad, 1e-5) << i;
  }
  expect_error([&] { scaler.step(opt, g); }, {"GradScaler::step", "already"});
  scaler.update();
  expect_error([&] { scaler.update(); }, {"GradScaler::update", "no inf checks"});
}

TEST(AmpGradScaler, StateDictRoundTripAndBadLoads) {
  amp::GradScaler a(amp::GradScalerOptions{.init_scale = 512.0, .growth_interval = 5});
  Tensor w = Tensor::ones({2});
  w.requires_grad_(true);
  TestSgd opt({w}, 0.0);
  for (int i = 0; i < 3; ++i) {
    Gradients g;
    g.set(w, Tensor::ones({2}));
    a.step(opt, g);
    a.update();
  }
  const StateDict s = a.state_dict();
  EXPECT_EQ(s.at("scale").dtype(), DType::f64);
  EXPECT_EQ(s.at("_growth_tracker").dtype(), DType::i64);
  amp::GradScaler b;
  b.load_state_dict(s);
  EXPECT_EQ(b.get_scale(), 512.0);
  EXPECT_EQ(b.growth_tracker(), 3);
  EXPECT_EQ(b.options().growth_interval, 5);
  // A bad state leaves the scaler unchanged.
  StateDict bad = s;
  bad.set("_growth_tracker", Tensor::scalar(int64_t{9}, {DType::i64}));
  expect_error([&] { b.load_state_dict(bad); }, {"GradScaler::load_state_dict", "_growth_tracker"});
  StateDict missing;
  missing.insert("scale", Tensor::scalar(2.0, {DType::f64}));
  expect_error([&] { b.load_state_dict(missing); }, {"growth_factor"});
  EXPECT_EQ(b.get_scale(), 512.0);
  EXPECT_EQ(b.growth_tracker(), 3);
  expect_error([] { amp::GradScaler(amp::GradScalerOptions{.growth_factor = 0.9}); }, {"GradScaler", "growth_factor"});
}

// f16 autocast training with the scaler: an overflowing first scale is backed off until steps
// go through, and the loss decreases.
TEST(AmpGradScaler, F16TrainingWithOverflowingScale) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w1 = param({16, 8}, 40), w2 = param({1, 16}, 41);
  TestSgd opt({w1, w2}, 0.05);
  // 2^40 overflows the f16 gradients: about 25 backoffs before steps go through.
  amp::GradScaler scaler(amp::GradScalerOptions{.init_scale = 1099511627776.0});
  const Tensor x = rnd({32, 8}, 42), y = rnd({32, 1}, 43);
  double first = 0, last = 0;
  int skipped = 0;
  for (int it = 0; it < 120; ++it) {
    Tensor loss;
    {
      amp::AutocastGuard ac(DType::f16, test_device().type);
      loss = mse_loss(linear(linear(x, w1).relu(), w2), y);
    }
    Gradients g = scaler.scale(loss).backward();
    if (!scaler.step(opt, g)) ++skipped;
    scaler.update();
    if (it == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  EXPECT_GT(skipped, 10);
  EXPECT_LT(skipped, 60);
  EXPECT_LT(scaler.get_scale(), 65536.0);
  EXPECT_LT(last, 0.8 * first) << skipped << " skipped, scale " << scaler.get_scale();
}

// bf16 autocast training of a small pre-norm MLP block reaches the f32 run's loss. Same data,
// same initial weights; the tolerance: bf16 keeps 8 bits of mantissa (relative rounding 2^-9),
// the f32 master weights take every update exactly, so the two trajectories stay close; we
// require the final losses within 5% of each other and both well below the start.
double train(bool autocast, Device dev, int steps) {
  Generator gen(1234);
  auto init = [&](const Shape& s, double scale) {
    Tensor t = (Tensor::randn(s, {DType::f32}, &gen) * scale).to(dev);
    t.requires_grad_(true);
    return t;
  };
  Tensor w_in = init({32, 16}, 0.25), w_h = init({32, 32}, 0.18), w_out = init({4, 32}, 0.18);
  Tensor b_h = init({32}, 0.05), g_ln = Tensor::ones({32}, {DType::f32, dev}).requires_grad_(true);
  TestSgd opt({w_in, w_h, w_out, b_h, g_ln}, 0.1);
  const Tensor x = (Tensor::randn({64, 16}, {DType::f32}, &gen)).to(dev);
  const Tensor target = Tensor::randint(0, 4, {64}, {DType::i64}, &gen).to(dev);
  double loss_v = 0;
  for (int it = 0; it < steps; ++it) {
    Tensor loss;
    {
      amp::AutocastGuard ac(autocast ? DType::bf16 : DType::bf16, dev.type);
      amp::AutocastGuard on(autocast, dev.type);
      const Tensor h = linear(x, w_in);
      const Tensor r = h + linear(layer_norm(h, {32}, g_ln).gelu(), w_h, b_h);
      loss = cross_entropy(linear(r, w_out), target);
    }
    EXPECT_EQ(loss.dtype(), DType::f32);
    const Gradients g = loss.backward();
    opt.step(g);
    loss_v = loss.item<double>();
  }
  return loss_v;
}

TEST(AmpTraining, Bf16ReachesTheF32Loss) {
  FLAME_SKIP_IF_NO_DEVICE();
  const int steps = 300;
  const double initial = train(false, test_device(), 1);
  const double f32 = train(false, test_device(), steps);
  const double bf16 = train(true, test_device(), steps);
  EXPECT_LT(f32, 0.5 * initial);
  EXPECT_LT(bf16, 0.5 * initial);
  EXPECT_NEAR(bf16, f32, 0.05 * f32 + 0.01) << "initial " << initial;
}

TEST(AmpTraining, CudaMatchesCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  const double cpu = train(true, Device::cpu(), 100);
  const double gpu = train(true, Device::cuda(0), 100);
  EXPECT_NEAR(gpu, cpu, 0.05 * cpu + 0.01);
}

}  // namespace
}  // namespace flame::test
