// Optimizers on the CPU: 20-step trajectories against the float64 reference of optim_test_util.h,
// skipped parameters, state-dict round trips (bit-exact resume), master weights, stochastic
// rounding, errors, and one backend call per group and step.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "optim_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {

using namespace optim_ref;

void expect_params_near(const TensorList& ps, const std::vector<Vec>& want, double rtol, double atol,
                        const std::string& what) {
  ASSERT_EQ(ps.size(), want.size());
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const auto got = ps[i].to_vec<double>();
    ASSERT_EQ(got.size(), want[i].size());
    for (std::size_t k = 0; k < got.size(); ++k)
      ASSERT_NEAR(got[k], want[i][k], atol + rtol * std::abs(want[i][k]))
          << what << ": parameter " << i << " element " << k;
  }
}

void expect_bitwise_equal(const TensorList& a, const TensorList& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto x = a[i].to_vec<double>(), y = b[i].to_vec<double>();
    ASSERT_EQ(x, y) << what << ": parameter " << i;
  }
}

class OptimCpuTrajectory : public ::testing::TestWithParam<Case> {};

TEST_P(OptimCpuTrajectory, MatchesFloat64Reference) {
  const Case& c = GetParam();
  const Problem pb = make_problem();
  const auto want = reference(c.kind, c.config, pb);
  // The reference moved every parameter: the comparison below is not vacuous.
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NE(want[i][0], pb.init[i][0]) << c.name;
  {
    const TensorList ps = make_params(pb, DType::f64, Device::cpu());
    auto opt = make_optimizer(c.kind, c.config, ps);
    run_steps(*opt, pb, ps, 0, pb.steps);
    expect_params_near(ps, want, 1e-10, 1e-12, std::string(c.name) + " f64");
  }
  {
    const TensorList ps = make_params(pb, DType::f32, Device::cpu());
    auto opt = make_optimizer(c.kind, c.config, ps);
    run_steps(*opt, pb, ps, 0, pb.steps);
    expect_params_near(ps, want, 2e-5, 2e-6, std::string(c.name) + " f32");
  }
}

TEST_P(OptimCpuTrajectory, SkipsParametersWithoutGradient) {
  const Case& c = GetParam();
  const Problem pb = make_problem();
  const TensorList ps = make_params(pb, DType::f64, Device::cpu());
  auto opt = make_optimizer(c.kind, c.config, ps);
  const Tensor p3 = ps[3];
  const uint64_t v0 = p3.version();
  opt->step(grads_at(pb, ps, 0));
  const auto after0 = p3.to_vec<double>();
  const uint64_t v1 = p3.version();
  EXPECT_GT(v1, v0) << "an update bumps the parameter's version";
  opt->step(grads_at(pb, ps, 1));  // parameter 3 has no gradient in step 1
  EXPECT_EQ(p3.to_vec<double>(), after0);
  EXPECT_EQ(p3.version(), v1);
  EXPECT_EQ(opt->param_step(3), 1);
  EXPECT_EQ(opt->param_step(0), 2);
  // Trajectory after 20 steps: parameter 3 had 13 gradients.
  run_steps(*opt, pb, ps, 2, pb.steps);
  EXPECT_EQ(opt->param_step(3), 13);
  EXPECT_EQ(opt->param_step(1), 20);
  EXPECT_TRUE(ps[3].is_same(p3)) << "parameters keep their identity";
}

TEST_P(OptimCpuTrajectory, StateDictResumeIsBitExact) {
  const Case& c = GetParam();
  const Problem pb = make_problem();
  for (DType dt : {DType::f32, DType::bf16}) {
    const TensorList full = make_params(pb, dt, Device::cpu());
    auto a = make_optimizer(c.kind, c.config, full);
    run_steps(*a, pb, full, 0, pb.steps);

    const TensorList first = make_params(pb, dt, Device::cpu());
    auto b = make_optimizer(c.kind, c.config, first);
    run_steps(*b, pb, first, 0, 10);
    const StateDict sd = b->state_dict();
    EXPECT_TRUE(sd.contains("state.0.step"));
    EXPECT_EQ(sd.at("param_groups.1.lr").dtype(), DType::f64);
    EXPECT_EQ(sd.at("param_groups.1.lr").dim(), 0);
    if (dt == DType::bf16) EXPECT_TRUE(sd.contains("state.2.master_param")) << c.name;

    // A fresh model (the parameters as saved) and a fresh optimizer continue from the state.
    TensorList resumed;
    for (const Tensor& p : first) {
      Tensor q = p.detach().clone();
      q.requires_grad_(true);
      resumed.push_back(q);
    }
    auto r = make_optimizer(c.kind, c.config, resumed);
    r->set_lr(123.0);  // load restores the hyperparameters too
    r->load_state_dict(sd);
    EXPECT_EQ(r->lr(1), c.config.lr[1]);
    run_steps(*r, pb, resumed, 10, pb.steps);
    expect_bitwise_equal(resumed, full, std::string(c.name) + " " + dtype_name(dt));
    // The saved snapshot is a copy: stepping b further does not change it.
    const auto before = sd.at("state.0.step").item<int64_t>();
    run_steps(*b, pb, first, 10, 12);
    EXPECT_EQ(sd.at("state.0.step").item<int64_t>(), before);
  }
}

INSTANTIATE_TEST_SUITE_P(Optim, OptimCpuTrajectory, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

TEST(OptimCpu, OptionsDefaultsAndGroups) {
  Tensor w = Tensor::randn({4, 3});
  Tensor b = Tensor::randn({3});
  w.requires_grad_(true);
  b.requires_grad_(true);
  optim::AdamW opt({w, b}, {.lr = 1e-4, .weight_decay = 0.05});
  EXPECT_EQ(opt.num_param_groups(), 1u);
  EXPECT_EQ(opt.lr(), 1e-4);
  EXPECT_EQ(opt.param_groups()[0].weight_decay, 0.05);
  EXPECT_EQ(opt.param_groups()[0].beta2, 0.999);
  EXPECT_EQ(opt.momentum_kind(), optim::Optimizer::MomentumKind::beta1);
  opt.set_momentum(0.8, 0);
  EXPECT_EQ(opt.param_groups()[0].beta1, 0.8);
  optim::AdamWOptions o{.lr = 1e-3};
  optim::ParamGroup no_decay = o.group({b});
  no_decay.weight_decay = 0;
  Tensor w2 = Tensor::randn({2});
  w2.requires_grad_(true);
  optim::AdamW two({o.group({w2}), no_decay}, o);
  EXPECT_EQ(two.param_groups()[0].weight_decay, 0.01);  // AdamW's default
  EXPECT_EQ(two.param_groups()[1].weight_decay, 0.0);
  optim::SGD sgd({w}, {.lr = 0.1, .momentum = 0.9});
  EXPECT_EQ(sgd.momentum(), 0.9);
  optim::Lion lion({w});
  EXPECT_EQ(lion.lr(), 1e-4);
  EXPECT_EQ(lion.param_groups()[0].beta2, 0.99);
  optim::Adafactor af({w});
  EXPECT_EQ(af.lr(), 1e-2);
  EXPECT_EQ(af.param_groups()[0].eps, 1e-3);
}

TEST(OptimCpu, AdafactorFactoredStateShapes) {
  Tensor w = Tensor::randn({2, 3, 5});
  Tensor b = Tensor::randn({5});
  w.requires_grad_(true);
  b.requires_grad_(true);
  optim::Adafactor opt({w, b});
  Gradients g;
  g.set(w, Tensor::randn({2, 3, 5}));
  g.set(b, Tensor::randn({5}));
  opt.step(g);
  EXPECT_EQ(opt.state(0, "row_var").sizes(), (Shape{2, 3, 1}));
  EXPECT_EQ(opt.state(0, "col_var").sizes(), (Shape{2, 1, 5}));
  EXPECT_FALSE(opt.state(0, "variance").defined());
  EXPECT_EQ(opt.state(1, "variance").sizes(), (Shape{5}));
}

// pending_state_bytes: the state the next step creates, counted before it exists (f32 master
// weights and slots of half parameters; 8-bit slots and their absmax; nothing for parameters that
// have stepped), equal to the bytes the step then holds.
TEST(OptimCpu, PendingStateBytesCountWhatTheFirstStepCreates) {
  auto state_bytes = [](const optim::FusedOptimizer& opt, std::size_t n, const std::vector<std::string>& slots) {
    std::size_t b = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (opt.master_weights(i).defined()) b += opt.master_weights(i).nbytes();
      for (const std::string& s : slots)
        if (opt.state(i, s).defined()) b += opt.state(i, s).nbytes();
    }
    return b;
  };
  Tensor w = Tensor::randn({10, 3});
  Tensor h = Tensor::randn({5}).to(DType::bf16);
  w.requires_grad_(true);
  h.requires_grad_(true);
  optim::AdamW adamw({w, h});
  EXPECT_EQ(adamw.pending_state_bytes(), 30u * 4 * 2 + 5u * 4 * 3);  // w: two f32 moments; h: master + two
  Gradients g;
  g.set(w, Tensor::randn({10, 3}));
  adamw.step(g);  // only w steps
  EXPECT_EQ(adamw.pending_state_bytes(), 5u * 4 * 3);
  EXPECT_EQ(state_bytes(adamw, 2, {"exp_avg", "exp_avg_sq"}), 30u * 4 * 2);
  g.set(h, Tensor::randn({5}).to(DType::bf16));
  adamw.step(g);
  EXPECT_EQ(adamw.pending_state_bytes(), 0u);
  EXPECT_EQ(state_bytes(adamw, 2, {"exp_avg", "exp_avg_sq"}), 30u * 4 * 2 + 5u * 4 * 3);
  Tensor big = Tensor::randn({4096 + 10});
  big.requires_grad_(true);
  optim::AdamW8bit eight({big}, {.min_8bit_size = 4096, .block_size = 2048});
  const std::size_t pending = eight.pending_state_bytes();
  Gradients gb;
  gb.set(big, Tensor::randn({4096 + 10}));
  eight.step(gb);
  EXPECT_EQ(eight.pending_state_bytes(), 0u);
  EXPECT_EQ(pending, state_bytes(eight, 1, {"exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax", "exp_avg_sq_absmax"}));
  EXPECT_GE(pending, 2u * (4096 + 10));  // two u8 codes per value, plus the absmax
}

// Master weights: a bf16 run with f32 master weights is the f32 run on the same (bf16-valued)
// inputs, bit for bit on the CPU, and its parameters are the masters rounded to bf16.
TEST(OptimCpu, MasterWeightsTrackTheF32Run) {
  const Problem pb = make_problem(20, 11, /*round_bf16=*/true);
  for (const Case& c : cases()) {
    const TensorList f32 = make_params(pb, DType::f32, Device::cpu());
    auto a = make_optimizer(c.kind, c.config, f32);
    run_steps(*a, pb, f32, 0, pb.steps);
    const TensorList bf = make_params(pb, DType::bf16, Device::cpu());
    auto b = make_optimizer(c.kind, c.config, bf);
    run_steps(*b, pb, bf, 0, pb.steps);
    for (std::size_t i = 0; i < bf.size(); ++i) {
      const Tensor m = b->master_weights(i);
      ASSERT_TRUE(m.defined());
      EXPECT_EQ(m.dtype(), DType::f32);
      EXPECT_EQ(m.to_vec<float>(), f32[i].to_vec<float>()) << c.name << " parameter " << i;
      EXPECT_EQ(bf[i].to_vec<float>(), m.to(DType::bf16).to_vec<float>()) << c.name << " parameter " << i;
    }
  }
}

// Without master weights small updates are lost to bf16 rounding; with them they accumulate.
TEST(OptimCpu, MasterWeightsKeepSmallUpdates) {
  for (bool master : {false, true}) {
    Tensor p = Tensor::full({64}, 1.0, DType::bf16);
    p.requires_grad_(true);
    optim::SGD opt({p}, {.lr = 1e-3, .master_weights = master});
    for (int s = 0; s < 10; ++s) {
      Gradients g;
      g.set(p, Tensor::full({64}, 1.0, DType::bf16));
      opt.step(g);
    }
    const double v = p.to_vec<double>()[0];
    if (master) EXPECT_NEAR(v, 0.99, 0.004);  // the master is 0.99; bf16 spacing below 1 is 2^-8
    else EXPECT_EQ(v, 1.0);                  // each 1e-3 step rounds back to 1
    EXPECT_EQ(opt.master_weights(0).defined(), master);
  }
}

// Stochastic rounding to bf16 is unbiased (the mean over many elements is the f32 master) and
// deterministic for a seed.
TEST(OptimCpu, StochasticRoundingUnbiasedAndDeterministic) {
  auto run = [](uint64_t seed) {
    Tensor p = Tensor::full({1 << 16}, 1.0, DType::bf16);
    p.requires_grad_(true);
    optim::SGD opt({p}, {.lr = 1e-3, .stochastic_rounding = true, .seed = seed});
    for (int s = 0; s < 3; ++s) {
      Gradients g;
      g.set(p, Tensor::full({1 << 16}, 1.0, DType::bf16));
      opt.step(g);
    }
    return std::make_pair(p.to_vec<double>(), opt.master_weights(0).to_vec<double>());
  };
  const auto [a, master] = run(5);
  const double m = master[0];  // 1 - 3e-3 in f32: between the bf16 values 0.99609375 and 1
  ASSERT_GT(m, 0.99609375);
  ASSERT_LT(m, 1.0);
  double mean = 0;
  int ups = 0;
  for (double x : a) {
    ASSERT_TRUE(x == 0.99609375 || x == 1.0) << x;  // always a neighbour of the master
    mean += x;
    ups += x == 1.0;
  }
  mean /= static_cast<double>(a.size());
  // Round-to-nearest gives 0.99609375 (bias -9e-4); SR's mean is within a few sigma (6e-6).
  EXPECT_NEAR(mean, m, 4e-5);
  EXPECT_GT(ups, 0);
  const auto [b, master_b] = run(5);
  EXPECT_EQ(a, b);
  EXPECT_EQ(master, master_b);
  const auto [c, master_c] = run(6);
  EXPECT_NE(a, c);
}

TEST(OptimCpu, OneBackendCallPerGroupAndStep) {
  TensorList ps;
  for (int i = 0; i < 200; ++i) {
    Tensor t = Tensor::randn({1 + (i * 37) % 101});
    t.requires_grad_(true);
    ps.push_back(t);
  }
  optim::AdamW opt(ps, {.lr = 1e-3});
  Gradients g;
  for (const Tensor& p : ps) g.set(p, Tensor::randn(p.sizes()));
  opt.step(g);
  const int64_t before = optim::fused_launch_count();
  opt.step(g);
  EXPECT_EQ(optim::fused_launch_count() - before, 1);
}

TEST(OptimCpu, BadHyperparameters) {
  Tensor p = Tensor::randn({3});
  p.requires_grad_(true);
  expect_error([&] { optim::SGD({p}, {.lr = -0.1}); }, {"SGD", "learning rate", "-0.1"});
  expect_error([&] { optim::SGD({p}, {.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .nesterov = true}); },
               {"SGD", "Nesterov"});
  expect_error([&] { optim::Adam({p}, {.betas = {1.0, 0.999}}); }, {"Adam", "beta parameter at index 0"});
  expect_error([&] { optim::AdamW({p}, {.betas = {0.9, -0.1}}); }, {"AdamW", "beta parameter at index 1"});
  expect_error([&] { optim::Adam({p}, {.eps = -1e-8}); }, {"Adam", "epsilon"});
  expect_error([&] { optim::AdamW({p}, {.weight_decay = -1}); }, {"AdamW", "weight_decay"});
  expect_error([&] { optim::Lion({p}, {.betas = {0.9, 1.5}}); }, {"Lion", "beta"});
  expect_error([&] { optim::Adafactor({p}, {.d = 0.5}); }, {"Adafactor", "clipping threshold"});
  expect_error([&] { optim::Adafactor({p}, {.beta2_decay = 0.5}); }, {"Adafactor", "beta2_decay"});
  expect_error([&] { optim::SGD({p, p}, {.lr = 0.1}); }, {"more than once"});
  expect_error([&] { optim::SGD({Tensor::arange(3)}, {.lr = 0.1}); }, {"dtype i64"});
  // A hyperparameter changed through param_groups() is checked at the next step.
  optim::Adam opt({p});
  opt.set_lr(-1.0);
  Gradients g;
  g.set(p, Tensor::randn({3}));
  const auto before = p.to_vec<float>();
  expect_error([&] { opt.step(g); }, {"Adam", "learning rate"});
  EXPECT_EQ(p.to_vec<float>(), before);
}

TEST(OptimCpu, GradientMismatchesAreNamed) {
  Tensor p = Tensor::randn({4, 3});
  Tensor q = Tensor::randn({5});
  p.requires_grad_(true);
  q.requires_grad_(true);
  optim::Adam opt({q, p});
  Gradients g;
  g.set(q, Tensor::randn({5}));
  g.set(p, Tensor::randn({4, 3}));
  g.at(p) = Tensor::randn({3, 4});
  const auto q0 = q.to_vec<float>();
  expect_error([&] { opt.step(g); }, {"Adam.step", "parameter 1", "[3, 4]", "[4, 3]"});
  EXPECT_EQ(q.to_vec<float>(), q0) << "a failed step writes nothing";
  EXPECT_EQ(opt.param_step(0), 0);
  g.at(p) = Tensor::randn({4, 3}, DType::f64);
  expect_error([&] { opt.step(g); }, {"Adam.step", "dtype f64"});
}

TEST(OptimCpu, LoadStateDictValidatesAndLeavesStateUnchanged) {
  const Problem pb = make_problem();
  const Case c = cases()[3];  // adam
  const TensorList ps = make_params(pb, DType::f32, Device::cpu());
  auto opt = make_optimizer(c.kind, c.config, ps);
  run_steps(*opt, pb, ps, 0, 3);
  const StateDict good = opt->state_dict();
  auto snapshot = [&] {
    std::vector<std::vector<double>> v;
    for (const auto& [k, t] : opt->state_dict()) v.push_back(t.to_vec<double>());
    return v;
  };
  const auto before = snapshot();
  auto broken = [&](const std::string& key, const Tensor& t) {
    StateDict sd;
    for (const auto& [k, v] : good) sd.insert(k, k == key ? t : v);
    return sd;
  };
  expect_error([&] { opt->load_state_dict(broken("state.1.exp_avg", Tensor::zeros({3, 5}))); },
               {"Adam.load_state_dict", "state.1.exp_avg", "[3, 5]", "[5, 3]"});
  expect_error([&] { opt->load_state_dict(broken("state.2.exp_avg_sq", Tensor::zeros({2, 3, 5}, DType::f64))); },
               {"state.2.exp_avg_sq", "dtype f64"});
  expect_error([&] { opt->load_state_dict(broken("param_groups.0.betas", Tensor::from_vec(std::vector<double>{0.9, 1.2}, {2}))); },
               {"beta parameter at index 1"});
  StateDict missing;
  for (const auto& [k, v] : good)
    if (k != "state.0.exp_avg") missing.insert(k, v);
  expect_error([&] { opt->load_state_dict(missing); }, {"missing key", "state.0.exp_avg"});
  // A state saved by an optimizer with another parameter count.
  TensorList three(ps.begin(), ps.begin() + 3);
  optim::Adam small(three);
  expect_error([&] { small.load_state_dict(good); }, {"param_groups.0.params", "lists 2 parameters"});
  EXPECT_EQ(snapshot(), before);
  // And the valid one loads.
  opt->load_state_dict(good);
  EXPECT_EQ(snapshot(), before);
}

}  // namespace
}  // namespace flame::test
