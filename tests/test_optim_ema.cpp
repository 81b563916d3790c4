// EMA of weights: warmup decay and the update against closed forms and a float64 loop, swap in
// and out for evaluation, f32 shadows of bf16 parameters, state dict. On the test device.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "flame/flame.h"
#include "flame/optim/ema.h"
#include "test_util.h"

namespace flame::test {
namespace {

TEST(OptimEma, WarmupDecayClosedForm) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  optim::EMA warm({Tensor::randn({3}, dev)}, {.decay = 0.99, .warmup = true});
  optim::EMA flat({Tensor::randn({3}, dev)}, {.decay = 0.99});
  for (int64_t s : {0, 1, 5, 50, 89, 90, 1000}) {
    EXPECT_DOUBLE_EQ(warm.decay_at(s), std::min(0.99, (1.0 + s) / (10.0 + s))) << s;
    EXPECT_EQ(flat.decay_at(s), 0.99);
  }
  EXPECT_DOUBLE_EQ(warm.decay_at(0), 0.1);
}

// Parameters held at a constant p1 after the EMA starts at p0: shadow = p1 + (p0 - p1) prod d_t.
TEST(OptimEma, ConstantTargetClosedForm) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor p = Tensor::randn({5, 7}, TensorOptions(DType::f64, dev));
  const auto p0 = p.to_vec<double>();
  optim::EMA ema({p}, {.decay = 0.995, .warmup = true});
  Tensor p1 = Tensor::randn({5, 7}, TensorOptions(DType::f64, dev));
  p.copy_(p1);
  const auto target = p1.to_vec<double>();
  double prod = 1.0;
  for (int64_t s = 0; s < 40; ++s) {
    ema.update(s);
    prod *= std::min(0.995, (1.0 + s) / (10.0 + s));
  }
  EXPECT_EQ(ema.num_updates(), 40);
  const auto got = ema.shadow()[0].to_vec<double>();
  for (std::size_t k = 0; k < got.size(); ++k)
    EXPECT_NEAR(got[k], target[k] + (p0[k] - target[k]) * prod, 1e-12);
}

// A moving target and bf16 parameters: the f32 shadow follows the float64 recurrence on the
// parameters' (bf16) values.
TEST(OptimEma, Bf16ParamsF32ShadowTracksFloat64) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor p = Tensor::randn({257}, TensorOptions(DType::bf16, dev));
  optim::EMA ema({p}, {.decay = 0.9, .warmup = false});
  EXPECT_EQ(ema.shadow()[0].dtype(), DType::f32);
  std::vector<double> ref = p.to_vec<double>();
  for (int s = 0; s < 30; ++s) {
    p.copy_(Tensor::randn({257}, TensorOptions(DType::bf16, dev)));
    const auto pv = p.to_vec<double>();
    for (std::size_t k = 0; k < ref.size(); ++k) ref[k] = ref[k] + 0.1 * (pv[k] - ref[k]);
    ema.update();
  }
  const auto got = ema.shadow()[0].to_vec<double>();
  for (std::size_t k = 0; k < got.size(); ++k) EXPECT_NEAR(got[k], ref[k], 1e-5 * (1 + std::abs(ref[k])));
}

TEST(OptimEma, SwapInAndRestore) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor w = Tensor::randn({4, 3}, dev);
  w.requires_grad_(true);  // parameters are leaves that require grad: the EMA writes under no-grad
  optim::EMA ema({w}, {.decay = 0.5});
  {
    NoGradGuard ng;
    w.copy_(Tensor::randn({4, 3}, dev));
  }
  ema.update();
  const auto trained = w.to_vec<float>();
  const auto averaged = ema.shadow()[0].to_vec<float>();
  ASSERT_NE(trained, averaged);
  {
    auto swapped = ema.swap_in();
    EXPECT_EQ(w.to_vec<float>(), averaged);
  }
  EXPECT_EQ(w.to_vec<float>(), trained);
  ema.store();
  ema.copy_to();
  EXPECT_EQ(w.to_vec<float>(), averaged);
  ema.restore();
  EXPECT_EQ(w.to_vec<float>(), trained);
  expect_error([&] { ema.restore(); }, {"EMA.restore", "store()"});
}

TEST(OptimEma, StateDictRoundTripAndErrors) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor a = Tensor::randn({6}, dev), b = Tensor::randn({2, 2}, TensorOptions(DType::bf16, dev));
  optim::EMA ema({a, b}, {.decay = 0.9, .warmup = true});
  for (int s = 0; s < 3; ++s) {
    a.copy_(Tensor::randn({6}, dev));
    ema.update();
  }
  const StateDict sd = ema.state_dict();
  EXPECT_EQ(sd.at("num_updates").item<int64_t>(), 3);
  EXPECT_EQ(sd.at("shadow.1").dtype(), DType::f32);
  optim::EMA other({a, b}, {.decay = 0.9, .warmup = true});
  other.load_state_dict(sd);
  EXPECT_EQ(other.num_updates(), 3);
  EXPECT_EQ(other.shadow()[0].to_vec<float>(), ema.shadow()[0].to_vec<float>());
  a.copy_(Tensor::randn({6}, dev));
  ema.update();
  other.update();
  EXPECT_EQ(other.shadow()[0].to_vec<float>(), ema.shadow()[0].to_vec<float>());
  // Wrong shape: named, and nothing changes.
  StateDict bad;
  bad.insert("shadow.0", Tensor::zeros({5}));
  bad.insert("shadow.1", sd.at("shadow.1"));
  bad.insert("num_updates", sd.at("num_updates"));
  const auto before = other.shadow()[1].to_vec<float>();
  expect_error([&] { other.load_state_dict(bad); }, {"EMA.load_state_dict", "shadow.0", "[5]", "[6]"});
  EXPECT_EQ(other.num_updates(), 4);
  EXPECT_EQ(other.shadow()[1].to_vec<float>(), before);
}

}  // namespace
}  // namespace flame::test
