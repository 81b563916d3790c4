// Objectives (closed forms, one SGD step lowers the loss) and samplers (shapes, determinism,
// guidance, exact endpoints on analytic fields).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "model_test_util.h"
#include "objective.h"
#include "sampler.h"

namespace fd = flame_diffusion;
using flame::DType;
using flame::Tensor;
using fd_test::test_device;

// ---------------------------------------------------------------- objectives

TEST(DiffusionFlow, TargetsMatchClosedForm) {
  flame::Generator gen(1);
  Tensor x0 = Tensor::randn({3, 1, 4, 4}, 0.0, 1.0, {}, &gen), eps = Tensor::randn({3, 1, 4, 4}, 0.0, 1.0, {}, &gen);
  Tensor t = Tensor::tensor({0.0, 0.25, 1.0});
  Tensor xt = fd::RectifiedFlow::interpolate(x0, eps, t);
  const auto xv = x0.to_vec<float>(), ev = eps.to_vec<float>(), tv = xt.to_vec<float>();
  const double ts[3] = {0.0, 0.25, 1.0};
  for (int b = 0; b < 3; ++b)
    for (int i = 0; i < 16; ++i)
      EXPECT_NEAR(tv[b * 16 + i], (1 - ts[b]) * xv[b * 16 + i] + ts[b] * ev[b * 16 + i], 1e-6);
  // t = 0 is the data, t = 1 the noise; the target is d x_t / dt = eps - x0.
  EXPECT_EQ(fd_test::max_abs_diff(xt.select(0, 0), x0.select(0, 0)), 0.0);
  EXPECT_EQ(fd_test::max_abs_diff(xt.select(0, 2), eps.select(0, 2)), 0.0);
  EXPECT_EQ(fd_test::max_abs_diff(fd::RectifiedFlow::velocity_target(x0, eps), eps - x0), 0.0);
}

TEST(DiffusionFlow, LogitNormalTimes) {
  flame::Generator gen(2);
  Tensor t = fd::RectifiedFlow::sample_t(20000, flame::Device::cpu(), &gen);
  EXPECT_GT(t.min().item<float>(), 0.0f);
  EXPECT_LT(t.max().item<float>(), 1.0f);
  // logit(t) ~ N(0, 1).
  Tensor z = (t / (1.0 - t)).log();
  EXPECT_NEAR(z.mean().item<double>(), 0.0, 0.03);
  EXPECT_NEAR(z.std().item<double>(), 1.0, 0.03);
  flame::Generator g1(3), g2(3);
  EXPECT_EQ(fd_test::max_abs_diff(fd::RectifiedFlow::sample_t(8, flame::Device::cpu(), &g1),
                                  fd::RectifiedFlow::sample_t(8, flame::Device::cpu(), &g2)),
            0.0);
}

TEST(DiffusionDdpm, SchedulesMatchClosedForms) {
  const fd::DdpmSchedule lin = fd::DdpmSchedule::make(fd::BetaSchedule::linear, 1000);
  ASSERT_EQ(lin.steps(), 1000);
  EXPECT_DOUBLE_EQ(lin.betas.front(), 1e-4);
  EXPECT_NEAR(lin.betas.back(), 0.02, 1e-15);
  EXPECT_NEAR(lin.betas[500], 1e-4 + (0.02 - 1e-4) * 500.0 / 999.0, 1e-15);
  double prod = 1.0;
  for (int i = 0; i <= 300; ++i) prod *= 1.0 - lin.betas[i];
  EXPECT_NEAR(lin.alphas_cumprod[300], prod, 1e-12);
  EXPECT_LT(lin.alphas_cumprod.back(), 1e-4);  // nearly pure noise at T-1

  const fd::DdpmSchedule cos = fd::DdpmSchedule::make(fd::BetaSchedule::cosine, 1000);
  const double pi = std::acos(-1.0);
  auto f = [&](double u) { return std::pow(std::cos((u + 0.008) / 1.008 * pi / 2), 2); };
  for (int n : {0, 10, 400, 900}) {
    // abar_n = f((n + 1) / T) / f(0) while no beta is clipped.
    EXPECT_NEAR(cos.alphas_cumprod[n], f((n + 1) / 1000.0) / f(0.0), 1e-9) << n;
  }
  EXPECT_DOUBLE_EQ(cos.betas.back(), 0.999);  // the clip
  for (double b : cos.betas) EXPECT_LE(b, 0.999);
  EXPECT_THROW(fd::parse_beta_schedule("sqrt"), flame::Error);
}

TEST(DiffusionDdpm, QSampleAndModelTime) {
  fd::Ddpm ddpm(fd::BetaSchedule::cosine);
  flame::Generator gen(4);
  Tensor x0 = Tensor::randn({2, 1, 3, 3}, 0.0, 1.0, {}, &gen), eps = Tensor::randn({2, 1, 3, 3}, 0.0, 1.0, {}, &gen);
  Tensor n = Tensor::tensor({7, 999});
  Tensor xn = ddpm.q_sample(x0, eps, n);
  const auto xv = x0.to_vec<float>(), ev = eps.to_vec<float>(), nv = xn.to_vec<float>();
  const int64_t steps[2] = {7, 999};
  for (int b = 0; b < 2; ++b) {
    const double ab = ddpm.schedule().alphas_cumprod[steps[b]];
    for (int i = 0; i < 9; ++i)
      EXPECT_NEAR(nv[b * 9 + i], std::sqrt(ab) * xv[b * 9 + i] + std::sqrt(1 - ab) * ev[b * 9 + i], 1e-5);
  }
  const auto tv = ddpm.model_time(n).to_vec<float>();
  EXPECT_FLOAT_EQ(tv[0], 0.007f);
  EXPECT_FLOAT_EQ(tv[1], 0.999f);
}

TEST(DiffusionObjective, NamesAndErrors) {
  EXPECT_EQ(fd::make_objective("flow")->name(), "flow");
  EXPECT_EQ(fd::make_objective("ddpm")->name(), "ddpm-linear");
  EXPECT_EQ(fd::make_objective("ddpm-cosine")->name(), "ddpm-cosine");
  EXPECT_THROW(fd::make_objective("edm"), flame::Error);
  auto model = fd::make_model("unet-tiny");
  fd::RectifiedFlow flow;
  flame::Generator gen(1);
  EXPECT_THROW(flow.loss(*model, Tensor::zeros({2, 1, 28, 28}), Tensor::tensor({1}), &gen), flame::Error);
}

// One plain SGD step on a fixed batch (fixed noise and times) lowers the loss, for every model x
// objective pair.
TEST(DiffusionTrain, OneSgdStepLowersTheLoss) {
  FD_SKIP_IF_NO_DEVICE();
  const flame::Device dev = test_device();
  for (const char* preset : {"dit-tiny", "unet-tiny"}) {
    for (const char* obj_name : {"flow", "ddpm-linear", "ddpm-cosine"}) {
      auto model = fd::make_model(preset, 3);
      model->to(dev);
      auto objective = fd::make_objective(obj_name);
      flame::Generator gen(5);
      Tensor x0 = fd_test::rand_images(8, 1, 28, dev, &gen);
      Tensor y = fd_test::rand_labels(8, 10, dev, &gen);
      Tensor eps = Tensor::randn({8, 1, 28, 28}, 0.0, 1.0, {DType::f32, dev}, &gen);
      auto loss_fn = [&]() {
        if (auto* f = dynamic_cast<fd::RectifiedFlow*>(objective.get()))
          return f->loss_at(*model, x0, y, eps, Tensor::tensor({0.1, 0.3, 0.5, 0.7, 0.9, 0.2, 0.4, 0.6}).to(dev));
        return dynamic_cast<fd::Ddpm*>(objective.get())
            ->loss_at(*model, x0, y, eps, Tensor::tensor({5, 100, 300, 500, 700, 900, 999, 50}).to(dev));
      };
      Tensor loss = loss_fn();
      ASSERT_EQ(loss.dim(), 0);
      const double before = loss.item<double>();
      fd_test::sgd_step(*model, loss.backward(), 0.05);
      const double after = loss_fn().item<double>();
      EXPECT_LT(after, before * 0.995) << preset << " x " << obj_name << ": " << before << " -> " << after;
      // The sampled version draws from the generator and is a finite scalar with a graph.
      Tensor drawn = objective->loss(*model, x0, y, &gen);
      EXPECT_TRUE(drawn.requires_grad());
      EXPECT_TRUE(std::isfinite(drawn.item<double>()));
    }
  }
}

// ---------------------------------------------------------------- samplers

namespace {

fd::SampleOptions opts(fd::SamplerKind kind, int64_t steps, double cfg, uint64_t seed) {
  fd::SampleOptions o;
  o.sampler = kind;
  o.steps = steps;
  o.cfg_scale = cfg;
  o.seed = seed;
  return o;
}

}  // namespace

TEST(DiffusionSampler, ShapesRangeAndDeterminism) {
  FD_SKIP_IF_NO_DEVICE();
  const flame::Device dev = test_device();
  struct Case {
    const char* preset;
    const char* objective;
    fd::SamplerKind kind;
  };
  for (const Case& c : {Case{"dit-tiny", "flow", fd::SamplerKind::euler}, Case{"dit-tiny", "flow", fd::SamplerKind::heun},
                        Case{"unet-tiny", "ddpm-cosine", fd::SamplerKind::ddim},
                        Case{"unet-tiny", "ddpm-linear", fd::SamplerKind::ddpm}}) {
    auto model = fd::make_model(c.preset, 1);
    model->to(dev);
    fd_test::perturb(*model, 0.05, 2);
    auto objective = fd::make_objective(c.objective);
    Tensor labels = Tensor::tensor({0, 3, 7}).to(dev);
    Tensor a = fd::sample(*model, *objective, labels, opts(c.kind, 3, 2.0, 11));
    Tensor b = fd::sample(*model, *objective, labels, opts(c.kind, 3, 2.0, 11));
    Tensor other = fd::sample(*model, *objective, labels, opts(c.kind, 3, 2.0, 12));
    const std::string name = std::string(c.preset) + "/" + fd::sampler_name(c.kind);
    EXPECT_EQ(a.sizes(), (flame::Shape{3, 1, 28, 28})) << name;
    EXPECT_EQ(a.device(), dev) << name;
    EXPECT_FALSE(a.requires_grad()) << name;
    EXPECT_LE(fd_test::max_abs(a), 1.0) << name;
    EXPECT_EQ(fd_test::max_abs_diff(a, b), 0.0) << name << ": same seed, different samples";
    EXPECT_GT(fd_test::max_abs_diff(a, other), 1e-3) << name << ": another seed, same samples";
    EXPECT_TRUE(model->is_training()) << name << ": training mode not restored";
  }
}

TEST(DiffusionSampler, MismatchedSamplerAndObjectiveRaise) {
  auto model = fd::make_model("unet-tiny");
  Tensor labels = Tensor::tensor({1});
  EXPECT_THROW(fd::sample(*model, fd::RectifiedFlow(), labels, opts(fd::SamplerKind::ddim, 2, 1.0, 0)), flame::Error);
  EXPECT_THROW(fd::sample(*model, fd::Ddpm(), labels, opts(fd::SamplerKind::euler, 2, 1.0, 0)), flame::Error);
  EXPECT_THROW(fd::sample(*model, fd::RectifiedFlow(), labels, opts(fd::SamplerKind::euler, 0, 1.0, 0)), flame::Error);
  EXPECT_THROW(fd::parse_sampler("dpm++"), flame::Error);
  EXPECT_EQ(fd::parse_sampler("heun"), fd::SamplerKind::heun);
}

TEST(DiffusionSampler, GuidanceScaleOneIsTheConditionalModel) {
  FD_SKIP_IF_NO_DEVICE();
  const flame::Device dev = test_device();
  auto model = fd::make_model("dit-tiny", 4);
  model->to(dev);
  fd_test::perturb(*model, 0.05, 5);  // the label path must matter
  flame::NoGradGuard no_grad;
  flame::Generator gen(6);
  Tensor x = Tensor::randn({3, 1, 28, 28}, 0.0, 1.0, {DType::f32, dev}, &gen);
  Tensor t = Tensor::rand({3}, {DType::f32, dev}, &gen);
  Tensor y = Tensor::tensor({2, 5, 8}).to(dev);
  Tensor cond = model->forward(x, t, y);
  Tensor uncond = model->forward(x, t, Tensor::full({3}, 10, {DType::i64, dev}));
  const double scale = fd_test::max_abs(cond);
  ASSERT_GT(fd_test::max_abs_diff(cond, uncond), 1e-3 * scale);  // guidance has something to do
  EXPECT_LT(fd_test::max_abs_diff(fd::guided(*model, y, 1.0)(x, t), cond), 1e-4 * scale);
  Tensor g3 = fd::guided(*model, y, 3.0)(x, t);
  EXPECT_LT(fd_test::max_abs_diff(g3, uncond + (cond - uncond) * 3.0), 1e-4 * scale);
  EXPECT_GT(fd_test::max_abs_diff(g3, cond), 1e-3 * scale);
}

// dx/dt = a x from t = 1 to 0 has x(0) = x(1) e^{-a}. Euler gives x (1 - a/N)^N (first order),
// Heun x (1 - a/N + a^2/(2N^2))^N (second order).
TEST(DiffusionSampler, SolversConvergeOnALinearField) {
  const double a = 1.3;
  flame::Generator gen(7);
  Tensor x1 = Tensor::randn({2, 1, 2, 2}, 0.0, 1.0, {DType::f64}, &gen);
  fd::ModelFn field = [a](const Tensor& x, const Tensor&) { return x * a; };
  Tensor exact = x1 * std::exp(-a);
  for (int64_t n : {10, 1000}) {
    const double scale = fd_test::max_abs(x1);
    const double e_euler = fd_test::max_abs_diff(fd::euler_solve(field, x1, n), exact) / scale;
    const double e_heun = fd_test::max_abs_diff(fd::heun_solve(field, x1, n), exact) / scale;
    const double euler_pred = std::abs(std::pow(1 - a / n, n) - std::exp(-a));
    const double heun_pred = std::abs(std::pow(1 - a / n + a * a / (2.0 * n * n), n) - std::exp(-a));
    EXPECT_NEAR(e_euler, euler_pred, 1e-9 + 1e-6 * euler_pred) << n;
    EXPECT_NEAR(e_heun, heun_pred, 1e-9 + 1e-3 * heun_pred) << n;
  }
  EXPECT_LT(fd_test::max_abs_diff(fd::euler_solve(field, x1, 1000), exact), 5e-4);
  EXPECT_LT(fd_test::max_abs_diff(fd::heun_solve(field, x1, 1000), exact), 1e-6);
}

// The rectified-flow velocity field of a single data point x* is v(x, t) = (x - x*) / t: its
// paths are straight, so Euler lands exactly on x* from any noise with any step count.
TEST(DiffusionSampler, EulerReachesTheDataPointOfAStraightField) {
  flame::Generator gen(8);
  Tensor target = Tensor::uniform({2, 1, 4, 4}, -1.0, 1.0, {DType::f64}, &gen);
  Tensor noise = Tensor::randn({2, 1, 4, 4}, 0.0, 1.0, {DType::f64}, &gen);
  fd::ModelFn field = [&](const Tensor& x, const Tensor& t) {
    return (x - target) / t.to(DType::f64).reshape({-1, 1, 1, 1});
  };
  for (int64_t n : {1, 7, 200}) {
    EXPECT_LT(fd_test::max_abs_diff(fd::euler_solve(field, noise, n), target), 1e-12) << n;
  }
}

// With the exact epsilon of a single data point x* (eps(x, n) = (x - sqrt(abar_n) x*) /
// sqrt(1 - abar_n)), deterministic DDIM lands on x*.
TEST(DiffusionSampler, DdimReachesTheDataPointWithExactEpsilon) {
  const fd::DdpmSchedule sched = fd::DdpmSchedule::make(fd::BetaSchedule::cosine, 1000);
  flame::Generator gen(9);
  Tensor target = Tensor::uniform({2, 1, 4, 4}, -0.9, 0.9, {DType::f64}, &gen);
  Tensor noise = Tensor::randn({2, 1, 4, 4}, 0.0, 1.0, {DType::f64}, &gen);
  fd::ModelFn eps = [&](const Tensor& x, const Tensor& t) {
    const int64_t n = std::llround(t.to_vec<double>()[0] * 1000.0);
    const double ab = sched.alphas_cumprod[static_cast<std::size_t>(n)];
    return (x - target * std::sqrt(ab)) / std::sqrt(1.0 - ab);
  };
  for (int64_t steps : {5, 50}) {
    EXPECT_LT(fd_test::max_abs_diff(fd::ddim_solve(eps, sched, noise, steps, 0.0, nullptr, false), target), 1e-9)
        << steps;
  }
  const std::vector<int64_t> ts = fd::ddim_timesteps(1000, 5);
  EXPECT_EQ(ts, (std::vector<int64_t>{999, 749, 500, 250, 0}));
}
