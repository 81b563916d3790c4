// nn layers (Linear, Embedding, Dropout, Identity, Flatten/Unflatten, activations, Softmax) and
// nn::init: forward against hand-written references, float64 gradient checks, default init,
// statistics and seeding, and CPU-vs-CUDA agreement where a GPU is present.
#include <cmath>

#include "gradcheck.h"
#include "nn_test_util.h"

namespace flame::test {
namespace {

using namespace flame::nn;

Tensor randn64(const Shape& s, uint64_t seed) {
  Generator g(seed);
  return Tensor::randn(s, 0.0, 1.0, DType::f64, &g);
}

// ---- Linear ----
TEST(NnLayer, LinearForwardMatchesHandWrittenReference) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Linear lin(5, 3, true, dev);
  Generator g(1);
  const Tensor x = Tensor::randn({2, 4, 5}, 0.0, 1.0, dev, &g);
  const Tensor y = lin(x);
  ASSERT_EQ(y.sizes(), (Shape{2, 4, 3}));
  const std::vector<double> xv = x.to_vec<double>(), w = lin.weight().to_vec<double>(), b = lin.bias().to_vec<double>();
  RefTensor want({2, 4, 3}, DType::f32);
  for (int64_t r = 0; r < 8; ++r) {
    for (int64_t o = 0; o < 3; ++o) {
      double s = b[o];
      for (int64_t i = 0; i < 5; ++i) s += xv[r * 5 + i] * w[o * 5 + i];
      want.v[r * 3 + o] = s;
    }
  }
  EXPECT_TRUE(all_close(y, want, 1e-5, 1e-5));
  // 1-d input and no bias.
  Linear nb(5, 3, false, dev);
  EXPECT_FALSE(nb.bias().defined());
  EXPECT_EQ(nb.parameters().size(), 1u);
  EXPECT_TRUE(all_close(nb(x.select(0, 1).select(0, 2)), nb(x).select(0, 1).select(0, 2), 1e-6, 1e-6));
  // Empty leading dims.
  EXPECT_EQ(lin(Tensor::zeros({0, 5}, dev)).sizes(), (Shape{0, 3}));
}

TEST(NnLayer, LinearGradcheck) {
  const GradcheckResult r = gradcheck(
      [](const TensorList& in) { return functional::linear(in[0], in[1], in[2]); },
      {randn64({2, 3, 4}, 1), randn64({5, 4}, 2), randn64({5}, 3)});
  EXPECT_TRUE(r.ok) << r.message;
  const GradcheckResult nb =
      gradcheck([](const TensorList& in) { return functional::linear(in[0], in[1]); }, {randn64({4}, 4), randn64({2, 4}, 5)});
  EXPECT_TRUE(nb.ok) << nb.message;
  Linear lin(3, 2, true, DType::f64);
  EXPECT_TRUE(module_gradcheck(lin, randn64({4, 3}, 6), [&](const Tensor& x) { return lin(x); }));
}

TEST(NnLayer, LinearDefaultInitIsPyTorchs) {
  // weight and bias ~ U(-1/sqrt(in), 1/sqrt(in)): bounds hold and the spread fills them.
  Linear lin(64, 256);
  const double bound = 1.0 / 8.0;
  const std::vector<float> w = lin.weight().to_vec<float>();
  double lo = 1, hi = -1, sq = 0;
  for (float v : w) {
    lo = std::min(lo, double(v));
    hi = std::max(hi, double(v));
    sq += double(v) * v;
  }
  EXPECT_GE(lo, -bound);
  EXPECT_LE(hi, bound);
  EXPECT_LT(lo, -0.95 * bound);
  EXPECT_GT(hi, 0.95 * bound);
  EXPECT_NEAR(sq / w.size(), bound * bound / 3.0, 0.05 * bound * bound / 3.0);  // var of U(-b, b)
  const std::vector<float> b = lin.bias().to_vec<float>();
  EXPECT_LE(*std::max_element(b.begin(), b.end()), bound);
  EXPECT_GE(*std::min_element(b.begin(), b.end()), -bound);
  EXPECT_GT(*std::max_element(b.begin(), b.end()), 0.5 * bound);
  EXPECT_TRUE(lin.weight().requires_grad() && lin.weight().is_leaf());
  // Seeded: the default generator reproduces the init.
  manual_seed(77);
  Linear a(7, 3);
  manual_seed(77);
  Linear c(7, 3);
  EXPECT_EQ(a.weight().to_vec<float>(), c.weight().to_vec<float>());
  EXPECT_EQ(a.bias().to_vec<float>(), c.bias().to_vec<float>());
}

TEST(NnLayer, LinearErrorsNameShapesAndDtypes) {
  Linear lin(4, 3);
  expect_error([&] { lin(Tensor::ones({2, 5})); }, {"linear", "[2, 5]", "in_features = 4", "[3, 4]"});
  expect_error([&] { lin(Tensor::ones({2, 4}, DType::f64)); }, {"linear", "f64", "f32"});
  expect_error([&] { functional::linear(Tensor::ones({2, 4}), Tensor::ones({4})); }, {"linear", "2-d", "[4]"});
  expect_error([&] { functional::linear(Tensor::ones({2, 4}), Tensor::ones({3, 4}), Tensor::ones({4})); },
               {"linear", "bias", "[3]", "[4]"});
  expect_error([&] { Linear(-1, 2); }, {"Linear", "-1"});
  expect_error([&] { Linear(2, 2, true, DType::i64); }, {"Linear", "floating", "i64"});
}

// ---- Embedding ----
TEST(NnLayer, EmbeddingLooksUpRows) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Embedding emb(6, 3, std::nullopt, dev);
  const Tensor idx = Tensor::from_vec<int64_t>({5, 0, 2, 2, 1, 5}, {2, 3}, dev);
  const Tensor y = emb(idx);
  ASSERT_EQ(y.sizes(), (Shape{2, 3, 3}));
  const std::vector<double> w = emb.weight().to_vec<double>(), out = y.to_vec<double>();
  const int64_t rows[] = {5, 0, 2, 2, 1, 5};
  for (int i = 0; i < 6; ++i) {
    for (int d = 0; d < 3; ++d) EXPECT_EQ(out[i * 3 + d], w[rows[i] * 3 + d]);
  }
  // Default init N(0, 1).
  Embedding big(200, 50);
  const Tensor bw = big.weight();
  EXPECT_NEAR(bw.mean_all().item<double>(), 0.0, 0.03);
  EXPECT_NEAR(bw.std().item<double>(), 1.0, 0.03);
  Embedding host(6, 3);  // the index range is checked by the op on the CPU (by the kernel on CUDA)
  expect_error([&] { host(Tensor::from_vec<int64_t>({6}, {1})); }, {"embedding", "index 6"});
  expect_error([&] { Embedding(4, 2, 4); }, {"Embedding", "padding_idx 4"});
}

TEST(NnLayer, EmbeddingPaddingRowGetsNoGradient) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Embedding emb(5, 2, -4, dev);  // -4 is row 1
  ASSERT_EQ(emb.padding_idx(), 1);
  EXPECT_EQ(emb.weight().select(0, 1).to_vec<float>(), std::vector<float>(2, 0.0f));  // zero-initialised
  {
    NoGradGuard ng;
    Tensor w = emb.weight();
    w.select(0, 1).fill_(3.0);  // a user-set padding row is still read
  }
  const Tensor idx = Tensor::from_vec<int64_t>({1, 3, 1, 0}, {4}, dev);
  const Tensor y = emb(idx);
  EXPECT_EQ(y.select(0, 0).to_vec<float>(), std::vector<float>(2, 3.0f));
  Gradients g = (y * y).sum().backward();
  const std::vector<double> gw = g.get(emb.weight()).to_vec<double>();
  EXPECT_EQ(gw[2], 0.0);
  EXPECT_EQ(gw[3], 0.0);  // row 1: read twice, no gradient
  const std::vector<double> w = emb.weight().to_vec<double>();
  EXPECT_DOUBLE_EQ(gw[6], 2 * w[6]);  // row 3 once: d(y^2) = 2y
  EXPECT_DOUBLE_EQ(gw[0], 2 * w[0]);
  EXPECT_EQ(gw[4], 0.0);  // row 2 never read
}

TEST(NnLayer, EmbeddingGradcheck) {
  const Tensor idx = Tensor::from_vec<int64_t>({3, 0, 3, 2, 1}, {5});
  const GradcheckResult r =
      gradcheck([&](const TensorList& in) { return functional::embedding(idx, in[0]); }, {randn64({4, 3}, 8)});
  EXPECT_TRUE(r.ok) << r.message;
  // Without padding: the padding row is read but, by design, not differentiated.
  Embedding emb(4, 3, std::nullopt, DType::f64);
  EXPECT_TRUE(module_gradcheck(emb, idx, [&](const Tensor& i) { return emb(i).square(); }));
}

// ---- Dropout ----
TEST(NnLayer, DropoutMasksScalesAndIsSeeded) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Generator gen(9);
  const Tensor x = Tensor::uniform({100, 100}, 1.0, 2.0, dev, &gen);
  Generator g1(42), g2(42);
  Dropout drop(0.3, &g1);
  const Tensor y = drop(x);
  const std::vector<float> xv = x.to_vec<float>(), yv = y.to_vec<float>();
  int64_t zeros = 0;
  for (std::size_t i = 0; i < xv.size(); ++i) {
    if (yv[i] == 0.0f) {
      ++zeros;
    } else {
      EXPECT_NEAR(yv[i], xv[i] / 0.7f, 1e-5f);
    }
  }
  EXPECT_NEAR(double(zeros) / xv.size(), 0.3, 0.02);
  // Same seed, same mask; the next call draws a new one.
  EXPECT_EQ(functional::dropout(x, 0.3, true, &g2).to_vec<float>(), yv);
  EXPECT_NE(drop(x).to_vec<float>(), yv);
  // Gradient: the same mask and scale.
  Tensor xr = x.detach().requires_grad_();
  Generator g3(42);
  Gradients g = functional::dropout(xr, 0.3, true, &g3).sum().backward();
  const std::vector<float> gx = g.get(xr).to_vec<float>();
  for (std::size_t i = 0; i < xv.size(); i += 97) EXPECT_NEAR(gx[i], yv[i] == 0.0f ? 0.0f : 1.0f / 0.7f, 1e-5f);
}

TEST(NnLayer, DropoutEdgeCasesAndEval) {
  const Tensor x = randn64({3, 4}, 10).to(DType::f32);
  Dropout d(0.5);
  d.eval();
  EXPECT_TRUE(d(x).is_same(x));
  EXPECT_TRUE(functional::dropout(x, 0.0).is_same(x));
  Tensor xr = x.detach().requires_grad_();
  const Tensor all = functional::dropout(xr, 1.0);
  EXPECT_EQ(all.to_vec<float>(), std::vector<float>(12, 0.0f));
  Gradients g = all.sum().backward();
  EXPECT_EQ(g.get(xr).to_vec<float>(), std::vector<float>(12, 0.0f));
  expect_error([&] { Dropout(1.5); }, {"Dropout", "1.5"});
  expect_error([&] { functional::dropout(x, -0.1); }, {"dropout", "-0.1"});
  expect_error([&] { functional::dropout(Tensor::ones({2}, DType::i64), 0.5); }, {"dropout", "i64"});
}

TEST(NnLayerCuda, DropoutSameMaskOnCpuAndCuda) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor x = randn64({37, 53}, 11).to(DType::f32);
  Generator gc(123), gg(123);
  const Tensor cpu = functional::dropout(x, 0.4, true, &gc);
  const Tensor gpu = functional::dropout(x.to(Device::cuda()), 0.4, true, &gg);
  EXPECT_TRUE(all_close(gpu.to(Device::cpu()), cpu, 1e-6, 0));
  const std::vector<float> a = cpu.to_vec<float>(), b = gpu.to_vec<float>();
  for (std::size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i] == 0.0f, b[i] == 0.0f) << i;
}

TEST(NnLayerCuda, LayersMatchCpuForwardAndGradients) {
  FLAME_SKIP_IF_NO_CUDA();
  Generator g(21);
  auto cpu = std::make_shared<Sequential>(std::initializer_list<ModulePtr>{
      std::make_shared<Linear>(6, 8), std::make_shared<GELU>(), std::make_shared<Flatten>(0, -1),
      std::make_shared<Unflatten>(0, Shape{4, 8}), std::make_shared<Linear>(8, 3), std::make_shared<LogSoftmax>(-1)});
  auto gpu = std::make_shared<Sequential>(std::initializer_list<ModulePtr>{
      std::make_shared<Linear>(6, 8), std::make_shared<GELU>(), std::make_shared<Flatten>(0, -1),
      std::make_shared<Unflatten>(0, Shape{4, 8}), std::make_shared<Linear>(8, 3), std::make_shared<LogSoftmax>(-1)});
  gpu->to(Device::cuda());
  ASSERT_TRUE(gpu->load_state_dict(cpu->state_dict()).ok());
  const Tensor x = Tensor::randn({4, 6}, 0.0, 1.0, {}, &g);
  const Tensor yc = (*cpu)(x), yg = (*gpu)(x.to(Device::cuda()));
  EXPECT_TRUE(all_close(yg.to(Device::cpu()), yc, 1e-4, 1e-5));
  Gradients gc = yc.square().sum().backward(), gg = yg.square().sum().backward();
  const auto pc = cpu->named_parameters(), pg = gpu->named_parameters();
  for (std::size_t i = 0; i < pc.size(); ++i) {
    EXPECT_TRUE(all_close(gg.get(pg[i].second).to(Device::cpu()), gc.get(pc[i].second), 1e-4, 1e-5)) << pc[i].first;
  }
  Embedding ec(9, 4, 2), eg(9, 4, 2, Device::cuda());
  ASSERT_TRUE(eg.load_state_dict(ec.state_dict()).ok());
  const Tensor idx = Tensor::from_vec<int64_t>({2, 8, 2, 0}, {2, 2});
  const Tensor oc = ec(idx), og = eg(idx.to(Device::cuda()));
  EXPECT_TRUE(all_close(og.to(Device::cpu()), oc, 0, 0));
  Gradients ggc = oc.square().sum().backward(), ggg = og.square().sum().backward();
  EXPECT_TRUE(all_close(ggg.get(eg.weight()).to(Device::cpu()), ggc.get(ec.weight()), 1e-6, 1e-6));
  EXPECT_EQ(ggg.get(eg.weight()).select(0, 2).to_vec<float>(), std::vector<float>(4, 0.0f));
}

// ---- Identity, Flatten, Unflatten ----
TEST(NnLayer, IdentityFlattenUnflatten) {
  const Tensor x = randn64({2, 3, 4, 5}, 12);
  Identity id;
  EXPECT_TRUE(id(x).is_same(x));
  Flatten f;
  EXPECT_EQ(f(x).sizes(), (Shape{2, 60}));
  EXPECT_TRUE(all_close(f(x), x.reshape({2, 60}), 0, 0));
  EXPECT_EQ(Flatten(1, 2)(x).sizes(), (Shape{2, 12, 5}));
  Unflatten u(1, {3, 20});
  EXPECT_EQ(u(f(x)).sizes(), (Shape{2, 3, 20}));
  EXPECT_TRUE(all_close(u(f(x)), x.reshape({2, 3, 20}), 0, 0));
  EXPECT_EQ(f.to_string(), "Flatten(start_dim=1, end_dim=-1)");
  EXPECT_EQ(u.to_string(), "Unflatten(dim=1, unflattened_size=(3, 20))");
  Unflatten u2(1, {3, 10});
  const GradcheckResult r =
      gradcheck([&](const TensorList& in) { return u2(f(in[0])).square(); }, {randn64({2, 3, 2, 5}, 13)});
  EXPECT_TRUE(r.ok) << r.message;
  expect_error([&] { u(Tensor::ones({2, 7})); }, {"unflatten"});
}

// ---- activations ----
struct ActCase {
  std::string repr;
  std::shared_ptr<Module> module;
  std::function<double(double)> ref;
};

std::vector<ActCase> activation_cases() {
  const double pi = 3.14159265358979323846;
  auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  return {
      {"ReLU()", std::make_shared<ReLU>(), [](double v) { return v > 0 ? v : 0.0; }},
      {"SiLU()", std::make_shared<SiLU>(), [=](double v) { return v * sig(v); }},
      {"Sigmoid()", std::make_shared<Sigmoid>(), sig},
      {"Tanh()", std::make_shared<Tanh>(), [](double v) { return std::tanh(v); }},
      {"Mish()", std::make_shared<Mish>(), [](double v) { return v * std::tanh(std::log1p(std::exp(v))); }},
      {"GELU(approximate='none')", std::make_shared<GELU>(),
       [](double v) { return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0))); }},
      {"GELU(approximate='tanh')", std::make_shared<GELU>("tanh"),
       [=](double v) { return 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / pi) * (v + 0.044715 * v * v * v))); }},
      {"LeakyReLU(negative_slope=0.2)", std::make_shared<LeakyReLU>(0.2), [](double v) { return v > 0 ? v : 0.2 * v; }},
      {"ELU(alpha=1.5)", std::make_shared<ELU>(1.5), [](double v) { return v > 0 ? v : 1.5 * std::expm1(v); }},
      {"Softplus(beta=2.0, threshold=20.0)", std::make_shared<Softplus>(2.0),
       [](double v) { return 2.0 * v > 20.0 ? v : std::log1p(std::exp(2.0 * v)) / 2.0; }},
      {"Hardswish()", std::make_shared<Hardswish>(),
       [](double v) { return v <= -3 ? 0.0 : (v >= 3 ? v : v * (v + 3) / 6); }},
      {"Hardsigmoid()", std::make_shared<Hardsigmoid>(),
       [](double v) { return v <= -3 ? 0.0 : (v >= 3 ? 1.0 : v / 6 + 0.5); }},
  };
}

TEST(NnLayer, ActivationModulesMatchFormulasAndGradcheck) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x64 = randn64({3, 7}, 14) * 2.0;
  const Tensor x = x64.to(test_device());
  const std::vector<double> xv = x64.to_vec<double>();
  for (const ActCase& c : activation_cases()) {
    EXPECT_EQ(c.module->to_string(), c.repr);
    RefTensor want({3, 7}, DType::f64);
    for (std::size_t i = 0; i < xv.size(); ++i) want.v[i] = c.ref(xv[i]);
    EXPECT_TRUE(all_close((*c.module)(x), want, 1e-9, 1e-12)) << c.repr;
    const GradcheckResult r = gradcheck([&](const TensorList& in) { return (*c.module)(in[0]); }, {x64});
    EXPECT_TRUE(r.ok) << c.repr << ": " << r.message;
  }
  expect_error([] { GELU("exact"); }, {"GELU", "exact"});
}

TEST(NnLayer, SoftmaxModules) {
  const Tensor x = randn64({4, 5}, 15);
  Softmax sm(1);
  LogSoftmax lsm(-1);
  EXPECT_EQ(sm.to_string(), "Softmax(dim=1)");
  const Tensor e = x.exp();
  EXPECT_TRUE(all_close(sm(x), e / e.sum(1, true), 1e-12, 1e-12));
  EXPECT_TRUE(all_close(lsm(x), (e / e.sum(1, true)).log(), 1e-12, 1e-12));
  EXPECT_TRUE(all_close(Softmax(0)(x).sum(0), Tensor::ones({5}, DType::f64), 1e-12, 1e-12));
  const GradcheckResult r = gradcheck([&](const TensorList& in) { return lsm(in[0]) * sm(in[0]); }, {x});
  EXPECT_TRUE(r.ok) << r.message;
}

// ---- init ----
struct Moments {
  double mean = 0, var = 0, lo = 1e300, hi = -1e300;
};
Moments moments(const Tensor& t) {
  Moments m;
  const std::vector<double> v = t.to_vec<double>();
  for (double x : v) {
    m.mean += x;
    m.lo = std::min(m.lo, x);
    m.hi = std::max(m.hi, x);
  }
  m.mean /= v.size();
  for (double x : v) m.var += (x - m.mean) * (x - m.mean);
  m.var /= v.size();
  return m;
}

TEST(NnInit, GainsAndFans) {
  using init::Nonlinearity;
  EXPECT_EQ(init::calculate_gain(Nonlinearity::linear), 1.0);
  EXPECT_EQ(init::calculate_gain(Nonlinearity::sigmoid), 1.0);
  EXPECT_DOUBLE_EQ(init::calculate_gain(Nonlinearity::tanh), 5.0 / 3.0);
  EXPECT_DOUBLE_EQ(init::calculate_gain(Nonlinearity::relu), std::sqrt(2.0));
  EXPECT_DOUBLE_EQ(init::calculate_gain(Nonlinearity::leaky_relu), std::sqrt(2.0 / (1.0 + 1e-4)));
  EXPECT_DOUBLE_EQ(init::calculate_gain(Nonlinearity::leaky_relu, std::sqrt(5.0)), std::sqrt(1.0 / 3.0));
  EXPECT_DOUBLE_EQ(init::calculate_gain(Nonlinearity::selu), 0.75);
  auto [fi, fo] = init::calculate_fan_in_and_fan_out(Tensor::empty({16, 8, 3, 3}));
  EXPECT_EQ(fi, 72);
  EXPECT_EQ(fo, 144);
  expect_error([] { init::calculate_fan_in_and_fan_out(Tensor::empty({5})); }, {"calculate_fan_in_and_fan_out", "[5]"});
}

TEST(NnInit, DistributionsHaveTheirMomentsAndBounds) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Generator gen(31);
  Tensor t = Tensor::empty({256, 512}, dev);  // fan_in 512, fan_out 256
  init::uniform_(t, -0.5, 1.5, &gen);
  Moments m = moments(t);
  EXPECT_GE(m.lo, -0.5);
  EXPECT_LE(m.hi, 1.5);
  EXPECT_NEAR(m.mean, 0.5, 0.01);
  EXPECT_NEAR(m.var, 4.0 / 12.0, 0.01);
  init::normal_(t, 2.0, 0.5, &gen);
  m = moments(t);
  EXPECT_NEAR(m.mean, 2.0, 0.01);
  EXPECT_NEAR(m.var, 0.25, 0.01);
  init::trunc_normal_(t, 0.0, 1.0, -1.0, 2.0, &gen);
  m = moments(t);
  EXPECT_GE(m.lo, -1.0);
  EXPECT_LE(m.hi, 2.0);
  EXPECT_LT(m.lo, -0.99);
  // Mean of N(0,1) truncated to [-1, 2]: (phi(-1) - phi(2)) / (Phi(2) - Phi(-1)).
  const double phi_m1 = std::exp(-0.5) / std::sqrt(2 * M_PI), phi_2 = std::exp(-2.0) / std::sqrt(2 * M_PI);
  const double z = 0.5 * (std::erf(2 / std::sqrt(2.0)) - std::erf(-1 / std::sqrt(2.0)));
  EXPECT_NEAR(m.mean, (phi_m1 - phi_2) / z, 0.01);
  init::xavier_uniform_(t, 2.0, &gen);
  m = moments(t);
  const double xb = 2.0 * std::sqrt(6.0 / (512 + 256));
  EXPECT_GE(m.lo, -xb);
  EXPECT_LE(m.hi, xb);
  EXPECT_NEAR(m.var, xb * xb / 3.0, 0.03 * xb * xb / 3.0);
  init::xavier_normal_(t, 1.0, &gen);
  EXPECT_NEAR(moments(t).var, 2.0 / (512 + 256), 0.03 * 2.0 / (512 + 256));
  init::kaiming_uniform_(t, 0.0, init::FanMode::fan_in, init::Nonlinearity::relu, &gen);
  m = moments(t);
  const double kb = std::sqrt(6.0 / 512);
  EXPECT_LE(m.hi, kb);
  EXPECT_NEAR(m.var, 2.0 / 512, 0.03 * 2.0 / 512);
  init::kaiming_normal_(t, 0.0, init::FanMode::fan_out, init::Nonlinearity::relu, &gen);
  EXPECT_NEAR(moments(t).var, 2.0 / 256, 0.03 * 2.0 / 256);
  init::constant_(t, 0.25);
  m = moments(t);
  EXPECT_EQ(m.lo, 0.25);
  EXPECT_EQ(m.hi, 0.25);
  init::ones_(t);
  EXPECT_EQ(moments(t).lo, 1.0);
  init::zeros_(t);
  EXPECT_EQ(moments(t).hi, 0.0);
  Tensor e = Tensor::empty({3, 4}, dev);
  init::eye_(e);
  EXPECT_TRUE(all_close(e.to(Device::cpu()), Tensor::eye(3, 4), 0, 0));
}

TEST(NnInit, SeedReproducesBitExactlyAndWritesUnderNoGrad) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    Tensor a = Tensor::empty({33, 17}, TensorOptions(dt, dev)).requires_grad_();
    Tensor b = Tensor::empty({33, 17}, TensorOptions(dt, dev)).requires_grad_();
    Generator g1(5), g2(5);
    init::kaiming_uniform_(a, std::sqrt(5.0), init::FanMode::fan_in, init::Nonlinearity::leaky_relu, &g1);
    init::kaiming_uniform_(b, std::sqrt(5.0), init::FanMode::fan_in, init::Nonlinearity::leaky_relu, &g2);
    EXPECT_EQ(a.to_vec<double>(), b.to_vec<double>()) << dtype_name(dt);
    init::trunc_normal_(a, 0.0, 0.02, -0.04, 0.04, &g1);
    init::trunc_normal_(b, 0.0, 0.02, -0.04, 0.04, &g2);
    EXPECT_EQ(a.to_vec<double>(), b.to_vec<double>()) << dtype_name(dt);
    EXPECT_TRUE(a.is_leaf());  // written without recording
    EXPECT_TRUE(a.requires_grad());
  }
  // The same seed gives the same values on the CPU as on the device under test.
  Tensor c = Tensor::empty({9, 9}), d = Tensor::empty({9, 9}, dev);
  Generator g3(8), g4(8);
  init::normal_(c, 0.0, 1.0, &g3);
  init::normal_(d, 0.0, 1.0, &g4);
  EXPECT_TRUE(all_close(d.to(Device::cpu()), c, 1e-6, 1e-6));
  Tensor i = Tensor::empty({4}, DType::i64);
  expect_error([&] { init::normal_(i); }, {"normal_", "i64"});
  expect_error([&] { init::kaiming_uniform_(i); }, {"kaiming_uniform_", "i64"});
  Tensor f = Tensor::empty({4, 4});
  expect_error([&] { init::uniform_(f, 1.0, 0.0); }, {"uniform_"});
  expect_error([&] { init::trunc_normal_(f, 0.0, 1.0, 1.0, -1.0); }, {"trunc_normal_"});
}

}  // namespace
}  // namespace flame::test
