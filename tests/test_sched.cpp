// Learning-rate schedulers: every schedule at chosen steps against its closed form (written here
// from PyTorch's documented formulas), PyTorch's recursive forms reproduced bit for bit, momentum
// cycling, composition, and state round trips that continue identically.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <numbers>
#include <random>
#include <vector>

#include "flame/optim/scheduler.h"
#include "sched_test_util.h"

namespace flame::test {
namespace {

using optim::LRScheduler;
using optim::SchedulerPtr;
constexpr double kPi = std::numbers::pi;

std::vector<double> random_lrs(uint64_t seed, std::size_t n = 3) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> d(0.01, 1.0);
  std::vector<double> v(n);
  for (double& x : v) x = d(rng);
  return v;
}

TEST(SchedTest, ConstantLRMatchesClosedForm) {
  const auto base = random_lrs(1);
  TestSGD opt(lr_groups(base));
  optim::ConstantLR s(opt, 0.37, 6);
  expect_schedule(s, opt, 20, [&](int64_t e, std::size_t g) { return base[g] * (e < 6 ? 0.37 : 1.0); });
}

TEST(SchedTest, LinearLRMatchesClosedFormAndPyTorchRecursion) {
  const auto base = random_lrs(2);
  TestSGD opt(lr_groups(base));
  const double sf = 0.013, ef = 0.9;
  const int64_t T = 37;
  optim::LinearLR s(opt, sf, ef, T);
  // PyTorch's recursive form, written out here: the optimizer must hold exactly these doubles.
  std::vector<double> py = base;
  for (double& v : py) v = v * sf;
  for (int64_t e = 0; e <= 60; ++e) {
    if (e > 0) {
      s.step();
      if (e <= T) {
        for (double& v : py) v = v * (1.0 + (ef - sf) / (T * sf + (e - 1) * (ef - sf)));
      }
    }
    for (std::size_t g = 0; g < base.size(); ++g) {
      ASSERT_EQ(opt.lr(g), py[g]) << "epoch " << e;
      const double closed = base[g] * (sf + (ef - sf) * std::min<double>(e, T) / T);
      ASSERT_NEAR(opt.lr(g), closed, 1e-12 * closed) << "epoch " << e;
    }
  }
}

TEST(SchedTest, CosineAnnealingMatchesClosedFormPastTMax) {
  const auto base = random_lrs(3);
  TestSGD opt(lr_groups(base));
  const int64_t T = 25;
  const double eta = 0.004;
  optim::CosineAnnealingLR s(opt, T, eta);
  // Beyond T_max the recursive form keeps following the (periodic) cosine, as in PyTorch.
  expect_schedule(s, opt, 3 * T + 4, [&](int64_t e, std::size_t g) {
    return eta + (base[g] - eta) * (1.0 + std::cos(kPi * e / T)) / 2.0;
  }, 1e-9);
}

TEST(SchedTest, CosineAnnealingBitExactWithPyTorchRecursion) {
  const auto base = random_lrs(4);
  TestSGD opt(lr_groups(base));
  const int64_t T = 10;
  const double eta = 0.001;
  optim::CosineAnnealingLR s(opt, T, eta);
  std::vector<double> py = base;
  for (int64_t e = 1; e <= 45; ++e) {
    s.step();
    for (std::size_t g = 0; g < py.size(); ++g) {
      if (((e - 1 - T) % (2 * T) + 2 * T) % (2 * T) == 0) {
        py[g] = py[g] + (base[g] - eta) * (1 - std::cos(kPi / T)) / 2;
      } else {
        py[g] = (1 + std::cos(kPi * e / T)) / (1 + std::cos(kPi * (e - 1) / T)) * (py[g] - eta) + eta;
      }
      ASSERT_EQ(opt.lr(g), py[g]) << "epoch " << e;
    }
  }
  // At T_max the rate sits on the floor.
  s.step(T);
  for (std::size_t g = 0; g < base.size(); ++g) EXPECT_NEAR(opt.lr(g), eta, 1e-15);
}

TEST(SchedTest, StepMultiStepExponentialMatchClosedForms) {
  const auto base = random_lrs(5);
  {
    TestSGD opt(lr_groups(base));
    optim::StepLR s(opt, 7, 0.3);
    expect_schedule(s, opt, 40, [&](int64_t e, std::size_t g) { return base[g] * std::pow(0.3, e / 7); });
  }
  {
    TestSGD opt(lr_groups(base));
    optim::MultiStepLR s(opt, {30, 5, 12, 12}, 0.5);  // unsorted, 12 twice: counts twice
    expect_schedule(s, opt, 40, [&](int64_t e, std::size_t g) {
      const int k = (e >= 5) + 2 * (e >= 12) + (e >= 30);
      return base[g] * std::pow(0.5, k);
    });
  }
  {
    TestSGD opt(lr_groups(base));
    optim::ExponentialLR s(opt, 0.93);
    expect_schedule(s, opt, 50, [&](int64_t e, std::size_t g) { return base[g] * std::pow(0.93, e); }, 1e-13);
  }
}

TEST(SchedTest, LambdaLRPerGroup) {
  const auto base = random_lrs(6, 2);
  TestSGD opt(lr_groups(base));
  std::vector<optim::LambdaLR::Lambda> fs = {[](int64_t e) { return 1.0 / (1.0 + e); },
                                             [](int64_t e) { return std::sqrt(e + 2.0); }};
  optim::LambdaLR s(opt, fs);
  expect_schedule(s, opt, 15, [&](int64_t e, std::size_t g) { return base[g] * fs[g](e); }, 0.0);
  EXPECT_THROW(optim::LambdaLR(opt, std::vector<optim::LambdaLR::Lambda>{fs[0]}), Error);
}

TEST(SchedTest, StepEpochUsesClosedForm) {
  const auto base = random_lrs(7);
  TestSGD opt(lr_groups(base));
  optim::CosineAnnealingLR s(opt, 40, 0.01);
  s.step(17);
  EXPECT_EQ(s.last_epoch(), 17);
  for (std::size_t g = 0; g < base.size(); ++g) {
    EXPECT_NEAR(opt.lr(g), 0.01 + (base[g] - 0.01) * (1 + std::cos(kPi * 17 / 40)) / 2, 1e-15);
  }
  EXPECT_THROW(s.step(-1), Error);
  EXPECT_EQ(s.last_epoch(), 17);
}

// The 1cycle policy, written from its definition (Smith & Topin; PyTorch's OneCycleLR docs).
struct OneCycleRef {
  double max_lr, div = 25.0, final_div = 1e4, pct = 0.3, base_m = 0.85, max_m = 0.95;
  int64_t total;
  bool cos = true, three = false;
  static double anneal(bool cos, double a, double b, double p) {
    return cos ? b + (a - b) / 2.0 * (std::cos(kPi * p) + 1.0) : (b - a) * p + a;
  }
  std::pair<double, double> at(int64_t t) const {
    const double init = max_lr / div, min = init / final_div;
    struct Seg {
      double end, lr0, lr1, m0, m1;
    };
    std::vector<Seg> segs;
    if (three) {
      segs = {{pct * total - 1, init, max_lr, max_m, base_m},
              {2 * pct * total - 2, max_lr, init, base_m, max_m},
              {total - 1.0, init, min, max_m, max_m}};
    } else {
      segs = {{pct * total - 1, init, max_lr, max_m, base_m}, {total - 1.0, max_lr, min, base_m, max_m}};
    }
    double start = 0;
    for (std::size_t i = 0; i < segs.size(); ++i) {
      if (t <= segs[i].end || i + 1 == segs.size()) {
        const double p = (t - start) / (segs[i].end - start);
        return {anneal(cos, segs[i].lr0, segs[i].lr1, p), anneal(cos, segs[i].m0, segs[i].m1, p)};
      }
      start = segs[i].end;
    }
    return {0, 0};
  }
};

TEST(SchedTest, OneCycleTwoAndThreePhaseWithMomentum) {
  for (bool three : {false, true}) {
    for (bool cos : {true, false}) {
      for (auto kind : {optim::Optimizer::MomentumKind::momentum, optim::Optimizer::MomentumKind::beta1}) {
        TestSGD opt(lr_groups({0.5, 0.5}), kind);
        optim::OneCycleOptions o;
        o.max_lr = {0.8, 0.2};
        o.total_steps = 50;
        o.three_phase = three;
        o.anneal_strategy = cos ? optim::OneCycleOptions::Anneal::cos : optim::OneCycleOptions::Anneal::linear;
        optim::OneCycleLR s(opt, o);
        for (int64_t t = 0; t <= 50; ++t) {
          if (t > 0) s.step();
          for (std::size_t g = 0; g < 2; ++g) {
            OneCycleRef ref{g == 0 ? 0.8 : 0.2};
            ref.total = 50;
            ref.cos = cos;
            ref.three = three;
            const auto [lr, m] = ref.at(t);
            ASSERT_NEAR(opt.lr(g), lr, 1e-14) << "three " << three << " cos " << cos << " t " << t;
            ASSERT_NEAR(opt.momentum(g), m, 1e-14) << "t " << t;
            const double mom = kind == optim::Optimizer::MomentumKind::beta1 ? opt.param_groups()[g].beta1
                                                                            : opt.param_groups()[g].momentum;
            ASSERT_EQ(mom, opt.momentum(g));
          }
        }
        // Anchors that need no formula: start, peak (pct * total - 1 = 14), end.
        if (!three) {
          TestSGD o2(lr_groups({1.0}));
          optim::OneCycleOptions oo;
          oo.max_lr = {0.8};
          oo.total_steps = 50;
          optim::OneCycleLR s2(o2, oo);
          EXPECT_DOUBLE_EQ(o2.lr(), 0.8 / 25);
          for (int i = 0; i < 14; ++i) s2.step();
          EXPECT_DOUBLE_EQ(o2.lr(), 0.8);
          EXPECT_DOUBLE_EQ(o2.momentum(), 0.85);
          for (int i = 14; i < 49; ++i) s2.step();
          EXPECT_NEAR(o2.lr(), 0.8 / 25 / 1e4, 1e-18);
        }
        // Past total_steps: refused, and nothing changes.
        const double lr_before = opt.lr(0), m_before = opt.momentum(0);
        EXPECT_THROW(s.step(), Error);
        EXPECT_EQ(s.last_epoch(), 50);
        EXPECT_EQ(opt.lr(0), lr_before);
        EXPECT_EQ(opt.momentum(0), m_before);
      }
    }
  }
}

TEST(SchedTest, OneCycleValidates) {
  TestSGD plain(lr_groups({0.1}), optim::Optimizer::MomentumKind::none);
  optim::OneCycleOptions o;
  o.max_lr = {1.0};
  o.total_steps = 10;
  EXPECT_THROW(optim::OneCycleLR(plain, o), Error);  // cycle_momentum without a momentum
  o.cycle_momentum = false;
  optim::OneCycleLR ok(plain, o);
  EXPECT_NEAR(plain.lr(), 1.0 / 25, 1e-15);
  o.total_steps = 0;
  EXPECT_THROW(optim::OneCycleLR(plain, o), Error);
  o.epochs = 3;
  o.steps_per_epoch = 4;
  optim::OneCycleLR by_epochs(plain, o);
  EXPECT_EQ(by_epochs.total_steps(), 12);
  o.pct_start = 1.5;
  EXPECT_THROW(optim::OneCycleLR(plain, o), Error);
  o.pct_start = 0.1;
  o.total_steps = 10;  // pct_start * total_steps - 1 = 0: a zero-length first phase
  EXPECT_THROW(optim::OneCycleLR(plain, o), Error);
}

TEST(SchedTest, WarmupCosineMatchesClosedForm) {
  const auto base = random_lrs(8);
  TestSGD opt(lr_groups(base));
  const int64_t W = 12, T = 60;
  const double eta = 0.002, sf = 0.05;
  auto s = optim::warmup_cosine(opt, W, T, eta, sf);
  EXPECT_EQ(s->name(), "SequentialLR");
  expect_schedule(*s, opt, T + 5, [&](int64_t e, std::size_t g) {
    if (e < W) return base[g] * (sf + (1.0 - sf) * e / W);
    return eta + (base[g] - eta) * (1.0 + std::cos(kPi * (e - W) / (T - W))) / 2.0;
  }, 1e-10);
}

TEST(SchedTest, SequentialOfThreeUsesInitialRates) {
  const auto base = random_lrs(9, 2);
  TestSGD opt(lr_groups(base));
  // Each child is built after the previous one moved the optimizer's rate; all take the initial
  // rate as their base (Note [Initial learning rates]).
  auto a = std::make_shared<optim::ConstantLR>(opt, 0.25, 100);
  auto b = std::make_shared<optim::ExponentialLR>(opt, 0.9);
  auto c = std::make_shared<optim::StepLR>(opt, 3, 0.5);
  EXPECT_EQ(b->base_lrs(), base);
  EXPECT_EQ(c->base_lrs(), base);
  optim::SequentialLR s(opt, {a, b, c}, {5, 11});
  expect_schedule(s, opt, 25, [&](int64_t e, std::size_t g) {
    if (e < 5) return base[g] * 0.25;
    if (e < 11) return base[g] * std::pow(0.9, e - 5);
    return base[g] * std::pow(0.5, (e - 11) / 3);
  }, 1e-13);
  EXPECT_THROW(optim::SequentialLR(opt, {a, b}, {5, 6}), Error);  // milestone count
  EXPECT_THROW(optim::SequentialLR(opt, {a, b, c}, {6, 5}), Error);  // not increasing
  TestSGD other(lr_groups(base));
  auto d = std::make_shared<optim::ExponentialLR>(other, 0.9);
  EXPECT_THROW(optim::SequentialLR(opt, {a, d}, {5}), Error);  // another optimizer
}

TEST(SchedTest, ChainedMultipliesFactors) {
  const auto base = random_lrs(10);
  TestSGD opt(lr_groups(base));
  auto a = std::make_shared<optim::ConstantLR>(opt, 0.1, 2);
  auto b = std::make_shared<optim::ExponentialLR>(opt, 0.9);
  auto c = std::make_shared<optim::MultiStepLR>(opt, std::vector<int64_t>{4, 7}, 0.3);
  optim::ChainedScheduler s({a, b, c});
  expect_schedule(s, opt, 12, [&](int64_t e, std::size_t g) {
    return base[g] * (e < 2 ? 0.1 : 1.0) * std::pow(0.9, e) * std::pow(0.3, (e >= 4) + (e >= 7));
  }, 1e-13);
}

// Builds a fresh optimizer + scheduler of each kind (the factories), runs k steps, saves, builds
// fresh objects, loads, and checks both continue identically (bit for bit) for m more steps.
struct Built {
  std::unique_ptr<TestSGD> opt;
  SchedulerPtr sched;
};
using Factory = std::function<Built()>;

std::vector<std::pair<const char*, Factory>> factories() {
  const auto base = random_lrs(11);
  auto make_opt = [base] { return std::make_unique<TestSGD>(lr_groups(base)); };
  std::vector<std::pair<const char*, Factory>> f;
  f.emplace_back("ConstantLR", [=] {
    Built b{make_opt(), nullptr};
    b.sched = std::make_shared<optim::ConstantLR>(*b.opt, 0.3, 9);
    return b;
  });
  f.emplace_back("LinearLR", [=] {
    Built b{make_opt(), nullptr};
    b.sched = std::make_shared<optim::LinearLR>(*b.opt, 0.1, 0.7, 13);
    return b;
  });
  f.emplace_back("CosineAnnealingLR", [=] {
    Built b{make_opt(), nullptr};
    b.sched = std::make_shared<optim::CosineAnnealingLR>(*b.opt, 11, 0.003);
    return b;
  });
  f.emplace_back("StepLR", [=] {
    Built b{make_opt(), nullptr};
    b.sched = std::make_shared<optim::StepLR>(*b.opt, 4, 0.7);
    return b;
  });
  f.emplace_back("MultiStepLR", [=] {
    Built b{make_opt(), nullptr};
    b.sched = std::make_shared<optim::MultiStepLR>(*b.opt, std::vector<int64_t>{3, 9, 16}, 0.4);
    return b;
  });
  f.emplace_back("ExponentialLR", [=] {
    Built b{make_opt(), nullptr};
    b.sched = std::make_shared<optim::ExponentialLR>(*b.opt, 0.95);
    return b;
  });
  f.emplace_back("LambdaLR", [=] {
    Built b{make_opt(), nullptr};
    b.sched = std::make_shared<optim::LambdaLR>(*b.opt, [](int64_t e) { return 1.0 / std::sqrt(1.0 + e); });
    return b;
  });
  f.emplace_back("OneCycleLR", [=] {
    Built b{make_opt(), nullptr};
    optim::OneCycleOptions o;
    o.max_lr = {0.9};
    o.total_steps = 40;
    o.three_phase = true;
    b.sched = std::make_shared<optim::OneCycleLR>(*b.opt, o);
    return b;
  });
  f.emplace_back("warmup_cosine", [=] {
    Built b{make_opt(), nullptr};
    b.sched = optim::warmup_cosine(*b.opt, 6, 30, 0.001, 0.01);
    return b;
  });
  f.emplace_back("ChainedScheduler", [=] {
    Built b{make_opt(), nullptr};
    auto x = std::make_shared<optim::LinearLR>(*b.opt, 0.2, 1.0, 5);
    auto y = std::make_shared<optim::CosineAnnealingLR>(*b.opt, 17, 0.0);
    b.sched = std::make_shared<optim::ChainedScheduler>(std::vector<SchedulerPtr>{x, y});
    return b;
  });
  return f;
}

TEST(SchedTest, StateRoundTripContinuesIdentically) {
  for (auto& [name, make] : factories()) {
    for (int k : {0, 3, 7, 14}) {
      Built a = make();
      for (int i = 0; i < k; ++i) a.sched->step();
      const StateDict sd = a.sched->state_dict();
      EXPECT_EQ(sd.at("last_epoch").item<int64_t>(), a.sched->last_epoch()) << name;
      EXPECT_EQ(sd.at("last_epoch").dtype(), DType::i64);
      EXPECT_EQ(sd.at("base_lrs").dtype(), DType::f64);
      Built b = make();  // a fresh pair: as a resumed process builds them
      // The resumed optimizer's momentum comes from its own state, as in a real resume.
      b.opt->load_state_dict(a.opt->state_dict());
      b.opt->set_lr(123.0);  // the scheduler's load puts the rates back
      b.sched->load_state_dict(sd);
      EXPECT_EQ(b.sched->last_epoch(), k) << name;
      EXPECT_EQ(b.sched->get_last_lr(), a.sched->get_last_lr()) << name;
      for (int i = 0; i < 20; ++i) {
        for (std::size_t g = 0; g < 3; ++g) {
          ASSERT_EQ(b.opt->lr(g), a.opt->lr(g)) << name << " k " << k << " step " << i;
          ASSERT_EQ(b.opt->momentum(g), a.opt->momentum(g)) << name << " k " << k << " step " << i;
        }
        a.sched->step();
        b.sched->step();
      }
    }
  }
}

TEST(SchedTest, LoadValidatesAndLeavesUnchanged) {
  const auto base = random_lrs(12);
  TestSGD opt(lr_groups(base));
  auto s = optim::warmup_cosine(opt, 4, 20);
  for (int i = 0; i < 6; ++i) s->step();
  const StateDict good = s->state_dict();
  const int64_t epoch = s->last_epoch();
  const std::vector<double> lrs = s->get_last_lr();

  auto expect_refused = [&](const StateDict& bad, const char* needle) {
    try {
      s->load_state_dict(bad);
      ADD_FAILURE() << "accepted a bad state (" << needle << ")";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(s->last_epoch(), epoch);
    EXPECT_EQ(s->get_last_lr(), lrs);
    for (std::size_t g = 0; g < base.size(); ++g) EXPECT_EQ(opt.lr(g), lrs[g]);
  };
  {  // another scheduler's state
    TestSGD o2(lr_groups(base));
    optim::CosineAnnealingLR c(o2, 20);
    expect_refused(c.state_dict(), "missing key");
  }
  {  // a child of another kind at the same place
    TestSGD o2(lr_groups(base));
    auto w = std::make_shared<optim::LinearLR>(o2, 0.001, 1.0, 4);
    auto e = std::make_shared<optim::ExponentialLR>(o2, 0.9);
    optim::SequentialLR q(o2, {w, e}, {4});
    expect_refused(q.state_dict(), "ExponentialLR");
  }
  {  // group count
    TestSGD o2(lr_groups({0.1, 0.2}));
    auto s2 = optim::warmup_cosine(o2, 4, 20);
    expect_refused(s2->state_dict(), "base_lrs");
  }
  {  // configuration
    TestSGD o2(lr_groups(base));
    auto s2 = optim::warmup_cosine(o2, 5, 20);
    expect_refused(s2->state_dict(), "milestones");
  }
  StateDict missing = good;
  missing.erase("schedulers.1.last_lrs");
  expect_refused(missing, "schedulers.1.last_lrs");
  StateDict extra = good;
  extra.insert("surprise", Tensor::scalar(1.0, DType::f64));
  expect_refused(extra, "unexpected key 'surprise'");
  StateDict wrong_dtype = good;
  wrong_dtype.set("last_epoch", Tensor::scalar(3.0, DType::f32));
  expect_refused(wrong_dtype, "last_epoch");
  StateDict negative = good;
  negative.set("schedulers.0.last_epoch", Tensor::scalar(int64_t{-4}, DType::i64));
  expect_refused(negative, "schedulers.0.last_epoch");
  // And the good one still loads.
  s->load_state_dict(good);
  EXPECT_EQ(s->last_epoch(), epoch);
}

TEST(SchedTest, RejectsBadArguments) {
  TestSGD opt(lr_groups({0.1}));
  EXPECT_THROW(optim::ConstantLR(opt, 0.0), Error);
  EXPECT_THROW(optim::ConstantLR(opt, 1.5), Error);
  EXPECT_THROW(optim::LinearLR(opt, 0.0), Error);
  EXPECT_THROW(optim::LinearLR(opt, 0.5, 1.0, 0), Error);
  EXPECT_THROW(optim::CosineAnnealingLR(opt, 0), Error);
  EXPECT_THROW(optim::StepLR(opt, 0), Error);
  EXPECT_THROW(optim::warmup_cosine(opt, 10, 10), Error);
  EXPECT_THROW(optim::ChainedScheduler({}), Error);
  TestSGD none(std::vector<optim::ParamGroup>{});
  EXPECT_THROW(optim::ExponentialLR(none, 0.9), Error);
}

}  // namespace
}  // namespace flame::test
