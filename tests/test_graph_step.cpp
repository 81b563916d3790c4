// Capturable optimizers and EMA, sync-free gradient clipping (Note [Capturable optimizers],
// Note [Device gradient clipping]). Suites GraphStep*: these cases run on the device under test
// (the CPU by default, FLAME_TEST_DEVICE=cuda for the GPU); the CUDA-graph cases of
// cuda::GraphedStep are in test_graph_step_cuda.cpp.
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "flame/cuda/graph_step.h"
#include "flame/optim/ema.h"
#include "flame/optim/optimizers.h"
#include "flame/optim/scheduler.h"
#include "test_util.h"

namespace flame::test {
namespace {

TensorList make_params(const std::vector<Shape>& shapes, DType dt, Device dev, uint64_t seed) {
  TensorList out;
  Generator g(seed);
  for (const Shape& s : shapes)
    out.push_back(Tensor::uniform(s, -1.0, 1.0, {DType::f32, Device::cpu()}, &g).to(dt).to(dev).requires_grad_(true));
  return out;
}

TensorList clones(const TensorList& ps) {
  TensorList out;
  for (const Tensor& p : ps) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// Gradients for `params` drawn from `seed` (the same values for two parameter sets of equal shapes).
Gradients make_grads(const TensorList& params, uint64_t seed, double scale = 1.0) {
  Gradients g;
  Generator gen(seed);
  for (const Tensor& p : params) {
    Tensor v = Tensor::uniform(p.sizes(), -scale, scale, {DType::f32, Device::cpu()}, &gen).to(p.dtype()).to(p.device());
    g.set(p, std::move(v));
  }
  return g;
}

const std::vector<Shape> kShapes = {{7}, {5, 3}, {33, 17}, {4, 2, 3}};

// Runs `steps` steps of two optimizers built by `make(params, capturable)` on equal parameters
// and gradients, with a learning rate (and, where the optimizer has one, a momentum) changed
// between steps through the scheduler interface, and asserts the results are bit-identical.
template <class Make>
void expect_capturable_matches_default(Make make, DType dt, int steps, const char* name) {
  const Device dev = test_device();
  TensorList a = make_params(kShapes, dt, dev, 11);
  TensorList b = clones(a);
  auto eager = make(a, false);
  auto capt = make(b, true);
  ASSERT_TRUE(capt->capturable());
  ASSERT_FALSE(eager->capturable());
  for (int t = 0; t < steps; ++t) {
    const double lr = 1e-2 * (1.0 + 0.37 * t);
    eager->set_lr(lr);
    capt->set_lr(lr);
    if (eager->has_momentum()) {
      const double m = 0.85 + 0.01 * t;
      eager->set_momentum(m, 0);
      capt->set_momentum(m, 0);
    }
    // Parameter 3 skips every other step: per-parameter step counts must diverge correctly.
    Gradients ga = make_grads(a, 100 + t), gb = make_grads(b, 100 + t);
    if (t % 2 == 1) {
      ga.erase(a[3]);
      gb.erase(b[3]);
    }
    eager->step(ga);
    capt->step(gb);
  }
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(same_bits(a[i], b[i], std::string(name) + " param " + std::to_string(i)));
    EXPECT_EQ(eager->param_step(i), capt->param_step(i)) << name << " step of param " << i;
    for (const char* slot : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"}) {
      const Tensor sa = eager->state(i, slot), sb = capt->state(i, slot);
      ASSERT_EQ(sa.defined(), sb.defined()) << name << " " << slot;
      if (sa.defined()) {
        EXPECT_TRUE(same_bits(sa, sb, std::string(name) + " " + slot + " " + std::to_string(i)));
      }
    }
    if (eager->master_weights(i).defined()) {
      EXPECT_TRUE(same_bits(eager->master_weights(i), capt->master_weights(i), std::string(name) + " master"));
    }
  }
}

TEST(GraphStepOptim, CapturableAdamWMatchesDefaultBitForBit) {
  FLAME_SKIP_IF_NO_DEVICE();
  expect_capturable_matches_default(
      [](const TensorList& p, bool cap) {
        return std::make_unique<optim::AdamW>(p, optim::AdamWOptions{.lr = 1e-2, .weight_decay = 0.05, .capturable = cap});
      },
      DType::f32, 6, "AdamW");
}

TEST(GraphStepOptim, CapturableAdamAmsgradMatchesDefaultBitForBit) {
  FLAME_SKIP_IF_NO_DEVICE();
  expect_capturable_matches_default(
      [](const TensorList& p, bool cap) {
        return std::make_unique<optim::Adam>(
            p, optim::AdamOptions{.lr = 1e-2, .betas = {0.8, 0.99}, .weight_decay = 0.01, .amsgrad = true, .capturable = cap});
      },
      DType::f32, 5, "Adam");
}

TEST(GraphStepOptim, CapturableSgdNesterovMatchesDefaultBitForBit) {
  FLAME_SKIP_IF_NO_DEVICE();
  expect_capturable_matches_default(
      [](const TensorList& p, bool cap) {
        return std::make_unique<optim::SGD>(
            p, optim::SGDOptions{.lr = 1e-2, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true, .capturable = cap});
      },
      DType::f32, 5, "SGD");
}

TEST(GraphStepOptim, CapturableLionMatchesDefaultBitForBit) {
  FLAME_SKIP_IF_NO_DEVICE();
  expect_capturable_matches_default(
      [](const TensorList& p, bool cap) {
        return std::make_unique<optim::Lion>(p, optim::LionOptions{.lr = 1e-3, .weight_decay = 0.1, .capturable = cap});
      },
      DType::f32, 5, "Lion");
}

TEST(GraphStepOptim, CapturableBf16StochasticRoundingMatchesDefault) {
  FLAME_SKIP_IF_NO_DEVICE();
  // The rounding bits are keyed by the step count, which a capturable step reads on the device.
  expect_capturable_matches_default(
      [](const TensorList& p, bool cap) {
        return std::make_unique<optim::AdamW>(
            p, optim::AdamWOptions{.lr = 1e-2, .stochastic_rounding = true, .seed = 5, .capturable = cap});
      },
      DType::bf16, 4, "AdamW-bf16");
}

TEST(GraphStepOptim, CapturableStateDictRoundTripsIntoDefaultOptimizer) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  TensorList a = make_params(kShapes, DType::f32, dev, 3);
  TensorList b = clones(a);
  optim::AdamW capt(a, {.lr = 3e-3, .capturable = true});
  for (int t = 0; t < 3; ++t) capt.step(make_grads(a, 40 + t));
  const StateDict sd = capt.state_dict();
  ASSERT_NE(sd.find("state.0.step"), nullptr);
  EXPECT_EQ(sd.find("state.0.step")->item<int64_t>(), 3);
  // Into a default optimizer: the same next step as the capturable one.
  {
    NoGradGuard ng;
    for (std::size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
  }
  optim::AdamW plain(b, {.lr = 3e-3});
  plain.load_state_dict(sd);
  // And back into a fresh capturable one (its device step counts are written).
  TensorList c = clones(a);
  optim::AdamW capt2(c, {.lr = 3e-3, .capturable = true});
  capt2.load_state_dict(sd);
  EXPECT_EQ(capt2.param_step(2), 3);
  capt.step(make_grads(a, 90));
  plain.step(make_grads(b, 90));
  capt2.step(make_grads(c, 90));
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(same_bits(a[i], b[i], "capturable vs default after load " + std::to_string(i)));
    EXPECT_TRUE(same_bits(a[i], c[i], "capturable vs capturable after load " + std::to_string(i)));
  }
}

TEST(GraphStepOptim, SchedulerWritesLearningRateToTheDevice) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  TensorList a = make_params(kShapes, DType::f32, dev, 5);
  TensorList b = clones(a);
  optim::SGD eager(a, {.lr = 0.1});
  optim::SGD capt(b, {.lr = 0.1, .capturable = true});
  optim::StepLR se(eager, 1, 0.5), sc(capt, 1, 0.5);
  for (int t = 0; t < 4; ++t) {
    eager.step(make_grads(a, 7 + t));
    capt.step(make_grads(b, 7 + t));
    se.step();
    sc.step();
  }
  EXPECT_DOUBLE_EQ(capt.lr(), 0.1 * std::pow(0.5, 4));
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(same_bits(a[i], b[i], "StepLR " + std::to_string(i)));
}

TEST(GraphStepOptim, CapturableNeedsOneDevice) {
  if (!cuda_is_available()) GTEST_SKIP() << "needs a CUDA device to place a parameter elsewhere";
  TensorList ps = {Tensor::ones({3}), Tensor::ones({3}, {DType::f32, Device::cuda(0)})};
  EXPECT_THROW(optim::AdamW(ps, {.capturable = true}), Error);
}

TEST(GraphStepEma, CapturableMatchesDefaultWithWarmup) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  TensorList a = make_params(kShapes, DType::f32, dev, 8);
  TensorList b = clones(a);
  optim::EMA ea(a, {.decay = 0.99, .warmup = true});
  optim::EMA eb(b, {.decay = 0.99, .warmup = true, .capturable = true});
  for (int t = 0; t < 5; ++t) {
    NoGradGuard ng;
    for (std::size_t i = 0; i < a.size(); ++i) {
      Tensor d = Tensor::uniform(a[i].sizes(), -0.1, 0.1, {DType::f32, Device::cpu()}).to(dev);
      a[i].add_(d);
      b[i].add_(d);
    }
    if (t == 2) {
      ea.update(10);  // an explicit step: its decay, and one more update counted
      eb.update(10);
    } else {
      ea.update();
      eb.update();
    }
  }
  EXPECT_EQ(eb.num_updates(), ea.num_updates());
  EXPECT_EQ(eb.num_updates(), 5);
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(same_bits(ea.shadow()[i], eb.shadow()[i], "EMA shadow"));
  const StateDict sd = eb.state_dict();
  EXPECT_EQ(sd.find("num_updates")->item<int64_t>(), 5);
  optim::EMA ec(clones(a), {.decay = 0.99, .warmup = true, .capturable = true});
  ec.load_state_dict(sd);
  EXPECT_EQ(ec.num_updates(), 5);
}

// ---- clipping ----

Gradients mixed_grads(const TensorList& params, uint64_t seed, double scale) { return make_grads(params, seed, scale); }

void expect_device_clip_matches_host(DType dt, double norm_type, double max_norm) {
  const Device dev = test_device();
  TensorList ps = make_params(kShapes, dt, dev, 21);
  Gradients g1 = mixed_grads(ps, 5, 2.0), g2 = mixed_grads(ps, 5, 2.0);
  const double host = clip_grad_norm_(g1, max_norm, norm_type);
  const Tensor dnorm = clip_grad_norm(g2, max_norm, norm_type);
  EXPECT_EQ(dnorm.dim(), 0);
  EXPECT_EQ(dnorm.device(), dev);
  EXPECT_EQ(dnorm.dtype(), DType::f32);
  const double d = dnorm.item<double>();
  EXPECT_NEAR(d, host, 1e-5 * host) << "norm_type " << norm_type;
  EXPECT_GT(d, 0.0);
  const double tol = dt == DType::f32 ? 1e-6 : 1e-2;
  for (const Tensor& p : ps) {
    const std::vector<double> x = g1.get(p).to_vec<double>(), y = g2.get(p).to_vec<double>();
    for (std::size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(y[i], x[i], tol * (std::abs(x[i]) + 1e-3)) << i;
  }
}

TEST(GraphStepClip, DeviceNormAndScaleMatchHostVersionL2) {
  FLAME_SKIP_IF_NO_DEVICE();
  expect_device_clip_matches_host(DType::f32, 2.0, 1.0);
}

TEST(GraphStepClip, DeviceNormAndScaleMatchHostVersionOtherNorms) {
  FLAME_SKIP_IF_NO_DEVICE();
  expect_device_clip_matches_host(DType::f32, 1.0, 3.0);
  expect_device_clip_matches_host(DType::f32, 3.0, 0.5);
  expect_device_clip_matches_host(DType::f32, std::numeric_limits<double>::infinity(), 0.25);
}

TEST(GraphStepClip, DeviceClipOfBf16Gradients) {
  FLAME_SKIP_IF_NO_DEVICE();
  expect_device_clip_matches_host(DType::bf16, 2.0, 1.0);
}

TEST(GraphStepClip, BelowMaxNormLeavesGradientsBitIdentical) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  TensorList ps = make_params(kShapes, DType::f32, dev, 2);
  Gradients g = make_grads(ps, 9), ref = make_grads(ps, 9);
  const Tensor n = clip_grad_norm(g, 1e6);
  EXPECT_NEAR(n.item<double>(), global_grad_norm(ref), 1e-4);
  for (const Tensor& p : ps) EXPECT_TRUE(same_bits(g.get(p), ref.get(p), "unclipped"));
}

TEST(GraphStepClip, MixedDtypesAndParamSubsetAndF64Result) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  TensorList ps = make_params({{9}, {4, 4}}, DType::f32, dev, 4);
  TensorList hs = make_params({{6, 5}}, DType::bf16, dev, 6);
  TensorList ds = make_params({{11}}, DType::f64, dev, 7);
  TensorList all = ps;
  all.push_back(hs[0]);
  all.push_back(ds[0]);
  Gradients g1 = make_grads(all, 3, 3.0), g2 = make_grads(all, 3, 3.0);
  const double host = clip_grad_norm_(g1, 0.5);
  const Tensor dn = clip_grad_norm(g2, 0.5);
  EXPECT_EQ(dn.dtype(), DType::f64);  // an f64 gradient makes the norm f64
  EXPECT_NEAR(dn.item<double>(), host, 1e-5 * host);
  for (const Tensor& p : all) {
    const auto x = g1.get(p).to_vec<double>(), y = g2.get(p).to_vec<double>();
    for (std::size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(y[i], x[i], 1e-2 * (std::abs(x[i]) + 1e-3));
  }
  // A subset: only those gradients are measured and scaled.
  Gradients g3 = make_grads(all, 8, 3.0), g4 = make_grads(all, 8, 3.0);
  const double host_sub = clip_grad_norm_(g3, ps, 0.5);
  const Tensor dsub = clip_grad_norm(g4, ps, 0.5);
  EXPECT_NEAR(dsub.item<double>(), host_sub, 1e-5 * host_sub);
  EXPECT_TRUE(same_bits(g4.get(all[3]), g3.get(all[3]), "gradient outside the subset"));
  // grad_norm measures without scaling.
  Gradients g5 = make_grads(all, 8, 3.0);
  EXPECT_NEAR(grad_norm(g5).item<double>(), global_grad_norm(g5), 1e-5 * global_grad_norm(g5));
}

TEST(GraphStepClip, NonFiniteNormsFollowTorchWithoutError) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  TensorList ps = make_params({{8}, {3, 3}}, DType::f32, dev, 12);
  {
    Gradients g = make_grads(ps, 1);
    std::vector<float> v = g.get(ps[0]).to_vec<float>();
    v[2] = std::numeric_limits<float>::quiet_NaN();
    g.set(ps[0], Tensor::from_vec(v, {8}).to(dev));
    const Tensor n = clip_grad_norm(g, 1.0);
    EXPECT_TRUE(std::isnan(n.item<double>()));
    for (const Tensor& p : ps)
      for (float x : g.get(p).to_vec<float>()) EXPECT_TRUE(std::isnan(x));  // scaled by a NaN coefficient
  }
  {
    Gradients g = make_grads(ps, 2);
    std::vector<float> v = g.get(ps[0]).to_vec<float>();
    v[5] = std::numeric_limits<float>::infinity();
    g.set(ps[0], Tensor::from_vec(v, {8}).to(dev));
    const Tensor n = clip_grad_norm(g, 1.0);
    EXPECT_TRUE(std::isinf(n.item<double>()));
    const auto a = g.get(ps[0]).to_vec<float>();
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (i == 5) {
        EXPECT_TRUE(std::isnan(a[i]));  // inf * 0
      } else {
        EXPECT_EQ(a[i], 0.0f);
      }
    }
    for (float x : g.get(ps[1]).to_vec<float>()) EXPECT_EQ(x, 0.0f);
  }
}

TEST(GraphStepClip, BadArgumentsRaiseAndLeaveGradientsUnchanged) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  TensorList ps = make_params({{8}}, DType::f32, dev, 13);
  Gradients g = make_grads(ps, 4, 10.0), ref = make_grads(ps, 4, 10.0);
  EXPECT_THROW(clip_grad_norm(g, 1.0, 0.0), Error);
  EXPECT_THROW(clip_grad_norm(g, 1.0, -2.0), Error);
  EXPECT_THROW(clip_grad_norm(g, std::nan("")), Error);
  EXPECT_TRUE(same_bits(g.get(ps[0]), ref.get(ps[0]), "after errors"));
  Gradients empty;
  EXPECT_EQ(clip_grad_norm(empty, 1.0).item<double>(), 0.0);
}

// ---- GraphedStep without a graph ----

TEST(GraphStepHelper, DisabledStepRunsEagerlyEveryCall) {
  int runs = 0;
  cuda::GraphedStep step([&] { ++runs; }, {.warmup_steps = 1, .enabled = false});
  for (int i = 0; i < 4; ++i) step();
  EXPECT_EQ(runs, 4);
  EXPECT_EQ(step.calls(), 4);
  EXPECT_FALSE(step.captured());
  EXPECT_THROW((void)step.graph(), Error);
}

TEST(GraphStepHelper, CopyInputChecksShapeAndDtype) {
  Tensor dst = Tensor::zeros({2, 3});
  Tensor ok = Tensor::ones({2, 3});
  cuda::GraphedStep::copy_input(dst, ok);
  EXPECT_EQ(dst.to_vec<float>()[4], 1.0f);
  Tensor wrong_shape = Tensor::ones({3, 3});
  Tensor wrong_dtype = Tensor::ones({2, 3}, {DType::f64, Device::cpu()});
  EXPECT_THROW(cuda::GraphedStep::copy_input(dst, wrong_shape), Error);
  EXPECT_THROW(cuda::GraphedStep::copy_input(dst, wrong_dtype), Error);
  EXPECT_THROW(cuda::GraphedStep([] {}, {.warmup_steps = -1}), Error);
}

// Runs only without a GPU (listed in ALLOW_SKIP of scripts/gpu_run.sh); GraphStepCuda* covers
// the capture on a GPU.
TEST(GraphStepHelper, WithoutCudaCaptureRaises) {
  if (cuda_is_available()) GTEST_SKIP() << "a CUDA device is present: the capture is covered by GraphStepCuda*";
  // Without CUDA a capture cannot happen: the warm-up calls run, the capture raises clearly.
  int runs = 0;
  cuda::GraphedStep step([&] { ++runs; }, {.warmup_steps = 1});
  step();
  EXPECT_EQ(runs, 1);
  try {
    step();
    ADD_FAILURE() << "a capture without CUDA did not raise";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("enabled = false"), std::string::npos) << e.what();
  }
  EXPECT_EQ(runs, 1);
}

}  // namespace
}  // namespace flame::test
