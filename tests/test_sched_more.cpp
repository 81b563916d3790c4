// The schedulers added after the first set: PolynomialLR, CosineAnnealingWarmRestarts, CyclicLR,
// ReduceLROnPlateau and MultiplicativeLR. Every sequence is checked against values written here
// from torch.optim.lr_scheduler's documented formulas (a closed form per epoch, or a hand trace),
// and every state round trip must continue identically.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <numbers>
#include <vector>

#include "flame/optim/scheduler.h"
#include "sched_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {

using optim::LRScheduler;
constexpr double kPi = std::numbers::pi;

// ---- PolynomialLR: base * (1 - min(e, T) / T)^power ----

TEST(SchedMore, PolynomialMatchesClosedForm) {
  const std::vector<double> base{0.001, 0.3};
  TestSGD opt(lr_groups(base));
  optim::PolynomialLR s(opt, 4, 1.0);
  // PyTorch's documented example (lr 0.001, total_iters 4, power 1): 0.001, 0.00075, 0.0005,
  // 0.00025, then 0 from epoch 4 on.
  const double doc[] = {0.001, 0.00075, 0.0005, 0.00025, 0.0, 0.0, 0.0};
  expect_schedule(s, opt, 6, [&](int64_t e, std::size_t g) { return doc[e] * base[g] / 0.001; });
  TestSGD opt2(lr_groups(base));
  optim::PolynomialLR sq(opt2, 5, 2.0);
  expect_schedule(sq, opt2, 9, [&](int64_t e, std::size_t g) {
    const double f = 1.0 - static_cast<double>(std::min<int64_t>(e, 5)) / 5.0;
    return base[g] * f * f;
  });
  sq.step(2);  // step(epoch): the closed form
  EXPECT_NEAR(opt2.lr(1), 0.3 * 0.36, 1e-15);
}

// ---- CosineAnnealingWarmRestarts ----

// The closed form: find epoch e's period [start, start + T_i) with T_i = T_0 T_mult^i.
double sgdr(double base, double eta_min, int64_t t0, int64_t mult, double e) {
  double start = 0, ti = static_cast<double>(t0);
  while (e >= start + ti) {
    start += ti;
    ti *= static_cast<double>(mult);
  }
  return eta_min + (base - eta_min) * (1.0 + std::cos(kPi * (e - start) / ti)) / 2.0;
}

TEST(SchedMore, WarmRestartsMatchClosedForm) {
  const std::vector<double> base{0.5, 0.02};
  for (int64_t mult : {1, 2, 3}) {
    SCOPED_TRACE(mult);
    TestSGD opt(lr_groups(base));
    optim::CosineAnnealingWarmRestarts s(opt, 3, mult, 0.01);
    expect_schedule(s, opt, 45, [&](int64_t e, std::size_t g) { return sgdr(base[g], 0.01, 3, mult, static_cast<double>(e)); });
  }
  // The restarts themselves: T_0 = 3, T_mult = 2 restarts at epochs 3, 9, 21.
  TestSGD opt(lr_groups({1.0}));
  optim::CosineAnnealingWarmRestarts s(opt, 3, 2);
  for (int e = 1; e <= 21; ++e) {
    s.step();
    if (e == 3 || e == 9 || e == 21) {
      EXPECT_EQ(opt.lr(0), 1.0) << e;
      EXPECT_EQ(s.t_cur(), 0.0) << e;
    }
  }
  EXPECT_EQ(s.t_i(), 24);
}

TEST(SchedMore, WarmRestartsStepToAnEpochAndAFraction) {
  TestSGD opt(lr_groups({0.4}));
  optim::CosineAnnealingWarmRestarts s(opt, 3, 2, 0.0);
  s.step(10);  // period [9, 21): T_cur 1 of T_i 12
  EXPECT_EQ(s.t_i(), 12);
  EXPECT_EQ(s.t_cur(), 1.0);
  EXPECT_NEAR(opt.lr(0), sgdr(0.4, 0.0, 3, 2, 10.0), 1e-15);
  s.step_at(4.5);  // PyTorch's step(epoch + i / iters): period [3, 9), T_cur 1.5 of 6
  EXPECT_EQ(s.t_i(), 6);
  EXPECT_EQ(s.t_cur(), 1.5);
  EXPECT_EQ(s.last_epoch(), 4);
  EXPECT_NEAR(opt.lr(0), 0.2 * (1.0 + std::cos(kPi * 1.5 / 6.0)), 1e-15);
  s.step();  // and on from there by one
  EXPECT_EQ(s.t_cur(), 2.5);
  TestSGD opt1(lr_groups({0.4}));
  optim::CosineAnnealingWarmRestarts s1(opt1, 4, 1);
  s1.step_at(9.25);  // T_mult 1: T_cur = 9.25 mod 4
  EXPECT_EQ(s1.t_cur(), 1.25);
  expect_error([&] { s1.step_at(-1.0); }, {"CosineAnnealingWarmRestarts::step", "non-negative epoch"});
  expect_error([&] { optim::CosineAnnealingWarmRestarts bad(opt1, 0); }, {"CosineAnnealingWarmRestarts", "T_0"});
  expect_error([&] { optim::CosineAnnealingWarmRestarts bad(opt1, 2, 0); }, {"CosineAnnealingWarmRestarts", "T_mult"});
}

// ---- CyclicLR ----

// PyTorch's formula: cycle = floor(1 + e / total), x = 1 + e / total - cycle, scale_factor =
// x / ratio while rising, (x - 1) / (ratio - 1) while falling.
double cyclic_factor(int64_t e, double up, double down) {
  const double total = up + down, ratio = up / total;
  const double cycle = std::floor(1.0 + static_cast<double>(e) / total);
  const double x = 1.0 + static_cast<double>(e) / total - cycle;
  return x <= ratio ? x / ratio : (x - 1.0) / (ratio - 1.0);
}

TEST(SchedMore, CyclicTriangularRisesAndFallsWithMomentum) {
  TestSGD opt(lr_groups({5.0, 5.0}));  // CyclicLR replaces the optimizer's rates with base_lr
  optim::CyclicLROptions o;
  o.base_lr = {0.1, 0.2};
  o.max_lr = {1.0};
  o.step_size_up = 4;
  o.step_size_down = 2;
  optim::CyclicLR s(opt, o);
  // The first cycle by hand: up over 4 steps, down over 2.
  const double f[] = {0.0, 0.25, 0.5, 0.75, 1.0, 0.5, 0.0};
  for (int e = 0; e <= 18; ++e) {
    if (e > 0) s.step();
    const double sf = f[e % 6];
    ASSERT_NEAR(sf, cyclic_factor(e, 4, 2), 1e-15);
    EXPECT_NEAR(opt.lr(0), 0.1 + 0.9 * sf, 1e-15) << e;
    EXPECT_NEAR(opt.lr(1), 0.2 + 0.8 * sf, 1e-15) << e;
    EXPECT_NEAR(opt.momentum(0), 0.9 - 0.1 * sf, 1e-15) << e;  // momentum falls as lr rises
  }
}

TEST(SchedMore, CyclicTriangular2AndExpRangeScaleTheAmplitude) {
  {
    TestSGD opt(lr_groups({1.0}));
    optim::CyclicLROptions o{.base_lr = {0.1}, .max_lr = {1.0}, .step_size_up = 3};
    o.mode = optim::CyclicLROptions::Mode::triangular2;
    o.cycle_momentum = false;
    optim::CyclicLR s(opt, o);
    expect_schedule(s, opt, 30, [](int64_t e, std::size_t) {
      const double cycle = std::floor(1.0 + static_cast<double>(e) / 6.0);
      return 0.1 + 0.9 * cyclic_factor(e, 3, 3) / std::pow(2.0, cycle - 1.0);
    });
    EXPECT_DOUBLE_EQ(opt.momentum(0), 0.9);  // untouched without cycle_momentum
  }
  {
    TestSGD opt(lr_groups({1.0}), optim::Optimizer::MomentumKind::beta1);
    optim::CyclicLROptions o{.base_lr = {0.1}, .max_lr = {1.0}, .step_size_up = 2, .step_size_down = 5};
    o.mode = optim::CyclicLROptions::Mode::exp_range;
    o.gamma = 0.9;
    optim::CyclicLR s(opt, o);
    for (int e = 0; e <= 20; ++e) {
      if (e > 0) s.step();
      const double h = cyclic_factor(e, 2, 5) * std::pow(0.9, e);
      ASSERT_NEAR(opt.lr(0), 0.1 + 0.9 * h, 1e-15) << e;
      ASSERT_NEAR(opt.momentum(0), 0.9 - 0.1 * h, 1e-15) << e;  // beta1 of an Adam-like optimizer
    }
  }
  {  // a custom scale of the iteration
    TestSGD opt(lr_groups({1.0}));
    optim::CyclicLROptions o{.base_lr = {0.0}, .max_lr = {1.0}, .step_size_up = 2};
    o.scale_fn = [](double x) { return 1.0 / (1.0 + x); };
    o.scale_mode = optim::CyclicLROptions::ScaleMode::iterations;
    optim::CyclicLR s(opt, o);
    expect_schedule(s, opt, 12, [](int64_t e, std::size_t) { return cyclic_factor(e, 2, 2) / (1.0 + e); });
  }
}

TEST(SchedMore, CyclicValidates) {
  TestSGD opt(lr_groups({1.0, 2.0}));
  expect_error([&] { optim::CyclicLR s(opt, {.base_lr = {0.1, 0.2, 0.3}, .max_lr = {1.0}}); },
               {"CyclicLR", "base_lr has 3 values", "2"});
  expect_error([&] { optim::CyclicLR s(opt, {.base_lr = {0.1}, .max_lr = {1.0}, .step_size_up = 0}); },
               {"CyclicLR", "step_size_up"});
  TestSGD plain(lr_groups({1.0}), optim::Optimizer::MomentumKind::none);
  expect_error([&] { optim::CyclicLR s(plain, {.base_lr = {0.1}, .max_lr = {1.0}}); },
               {"CyclicLR", "cycle_momentum"});
}

// ---- ReduceLROnPlateau ----

TEST(SchedMore, PlateauReducesAfterPatienceWithCooldownAndFloor) {
  TestSGD opt(lr_groups({0.1, 0.1}));
  optim::ReduceLROnPlateauOptions o;
  o.factor = 0.5;
  o.patience = 2;
  o.threshold = 0.1;
  o.cooldown = 1;
  o.min_lr = {0.02, 0.0};
  optim::ReduceLROnPlateau s(opt, o);
  EXPECT_EQ(opt.lr(0), 0.1);  // construction changes nothing
  EXPECT_EQ(s.last_epoch(), 0);
  // A hand trace of PyTorch's step(): best improves only below best * (1 - 0.1).
  const double metric[] = {1.0, 0.95, 0.95, 0.95, 0.95, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5};
  const double lr0[] = {0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.05, 0.025, 0.025,
                        0.025, 0.025, 0.02, 0.02, 0.02, 0.02, 0.02};
  const double lr1[] = {0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.05, 0.025, 0.025,
                        0.025, 0.025, 0.0125, 0.0125, 0.0125, 0.0125, 0.00625};
  for (int i = 0; i < 17; ++i) {
    s.step(metric[i]);
    EXPECT_EQ(s.last_epoch(), i + 1);
    EXPECT_DOUBLE_EQ(opt.lr(0), lr0[i]) << "epoch " << i + 1;
    EXPECT_DOUBLE_EQ(opt.lr(1), lr1[i]) << "epoch " << i + 1;
    EXPECT_EQ(s.get_last_lr()[0], opt.lr(0));
  }
  EXPECT_EQ(s.best(), 0.5);
  expect_error([&] { s.step(); }, {"ReduceLROnPlateau::step", "step(metric)"});
  expect_error([&] { static_cast<LRScheduler&>(s).step(int64_t{3}); }, {"ReduceLROnPlateau::step", "step(metric)"});
}

TEST(SchedMore, PlateauMaxAbsModeNaNAndEps) {
  TestSGD opt(lr_groups({1.0}));
  optim::ReduceLROnPlateauOptions o;
  o.mode = optim::ReduceLROnPlateauOptions::Mode::max;
  o.threshold_mode = optim::ReduceLROnPlateauOptions::ThresholdMode::abs;
  o.threshold = 0.5;
  o.patience = 0;
  o.factor = 0.1;
  o.eps = 0.05;
  optim::ReduceLROnPlateau s(opt, o);
  s.step(1.0);  // better than -inf
  EXPECT_EQ(opt.lr(0), 1.0);
  s.step(1.4);  // not above 1.0 + 0.5: one bad epoch > patience 0
  EXPECT_DOUBLE_EQ(opt.lr(0), 0.1);
  s.step(2.0);  // above 1.5: better
  EXPECT_DOUBLE_EQ(opt.lr(0), 0.1);
  EXPECT_EQ(s.best(), 2.0);
  s.step(std::numeric_limits<double>::quiet_NaN());  // never better: a bad epoch
  EXPECT_DOUBLE_EQ(opt.lr(0), 0.1 * 0.1);
  s.step(0.0);  // 0.01 -> 0.001 changes by 0.009 <= eps 0.05: kept
  EXPECT_DOUBLE_EQ(opt.lr(0), 0.01);
  expect_error([&] { optim::ReduceLROnPlateau bad(opt, {.factor = 1.0}); }, {"ReduceLROnPlateau", "factor"});
  expect_error([&] { optim::ReduceLROnPlateau bad(opt, {.min_lr = {0.1, 0.2}}); }, {"ReduceLROnPlateau", "min_lr"});
}

TEST(SchedMore, PlateauStateRoundTripContinuesIdentically) {
  optim::ReduceLROnPlateauOptions o{.factor = 0.5, .patience = 1, .cooldown = 2};
  TestSGD a_opt(lr_groups({0.3, 0.2}));
  optim::ReduceLROnPlateau a(a_opt, o);
  const double metric[] = {1.0, 0.9, 0.99, 0.98, 0.97, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 0.4, 0.41, 0.42};
  for (int i = 0; i < 5; ++i) a.step(metric[i]);
  const StateDict sd = a.state_dict();
  TestSGD b_opt(lr_groups({0.3, 0.2}));
  optim::ReduceLROnPlateau b(b_opt, o);
  b.load_state_dict(sd);
  EXPECT_EQ(b.best(), a.best());
  EXPECT_EQ(b.num_bad_epochs(), a.num_bad_epochs());
  EXPECT_EQ(b.cooldown_counter(), a.cooldown_counter());
  for (int i = 5; i < 14; ++i) {
    a.step(metric[i]);
    b.step(metric[i]);
    ASSERT_EQ(a_opt.lr(0), b_opt.lr(0)) << i;
    ASSERT_EQ(a_opt.lr(1), b_opt.lr(1)) << i;
  }
  EXPECT_LT(a_opt.lr(0), 0.3);  // it did reduce on the way
}

// ---- MultiplicativeLR ----

TEST(SchedMore, MultiplicativeMultipliesFromEpochOne) {
  TestSGD opt(lr_groups({0.5, 0.25}));
  optim::MultiplicativeLR s(opt, {[](int64_t) { return 0.95; }, [](int64_t e) { return e % 2 == 0 ? 0.5 : 1.0; }});
  expect_schedule(s, opt, 12, [](int64_t e, std::size_t g) {
    return g == 0 ? 0.5 * std::pow(0.95, static_cast<double>(e)) : 0.25 * std::pow(0.5, static_cast<double>(e / 2));
  });
}

// ---- state round trips of the epoch schedules ----

TEST(SchedMore, StateRoundTripsContinueIdentically) {
  struct Case {
    const char* name;
    std::function<std::unique_ptr<LRScheduler>(optim::Optimizer&)> make;
  };
  const std::vector<Case> cases{
      {"PolynomialLR", [](optim::Optimizer& o) { return std::make_unique<optim::PolynomialLR>(o, 9, 1.7); }},
      {"CosineAnnealingWarmRestarts",
       [](optim::Optimizer& o) { return std::make_unique<optim::CosineAnnealingWarmRestarts>(o, 2, 3, 1e-3); }},
      {"CyclicLR",
       [](optim::Optimizer& o) {
         optim::CyclicLROptions c{.base_lr = {0.01}, .max_lr = {0.1, 0.2, 0.3}, .step_size_up = 3, .step_size_down = 4};
         c.mode = optim::CyclicLROptions::Mode::triangular2;
         return std::make_unique<optim::CyclicLR>(o, c);
       }},
      {"MultiplicativeLR",
       [](optim::Optimizer& o) { return std::make_unique<optim::MultiplicativeLR>(o, [](int64_t e) { return 1.0 - 0.01 * e; }); }},
  };
  for (const Case& c : cases) {
    for (int k : {0, 4, 11}) {
      TestSGD a_opt(lr_groups({0.3, 0.2, 0.1}));
      auto a = c.make(a_opt);
      for (int i = 0; i < k; ++i) a->step();
      const StateDict sd = a->state_dict();
      TestSGD b_opt(lr_groups({0.3, 0.2, 0.1}));
      auto b = c.make(b_opt);
      b_opt.load_state_dict(a_opt.state_dict());
      b_opt.set_lr(123.0);  // the scheduler's load puts the rates back
      b->load_state_dict(sd);
      EXPECT_EQ(b->last_epoch(), k) << c.name;
      for (int i = 0; i < 15; ++i) {
        for (std::size_t g = 0; g < 3; ++g) {
          ASSERT_EQ(b_opt.lr(g), a_opt.lr(g)) << c.name << " k " << k << " step " << i;
          ASSERT_EQ(b_opt.momentum(g), a_opt.momentum(g)) << c.name << " k " << k << " step " << i;
        }
        a->step();
        b->step();
      }
    }
  }
  // A state of another configuration is refused, and nothing changes.
  TestSGD opt(lr_groups({0.3}));
  optim::CosineAnnealingWarmRestarts s3(opt, 3);
  TestSGD opt5(lr_groups({0.3}));
  optim::CosineAnnealingWarmRestarts s5(opt5, 5);
  s5.step();
  expect_error([&] { s3.load_state_dict(s5.state_dict()); }, {"CosineAnnealingWarmRestarts::load_state_dict", "T_0"});
  EXPECT_EQ(s3.last_epoch(), 0);
}

}  // namespace
}  // namespace flame::test
