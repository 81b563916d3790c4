// LoKr adapters on Linear: LyCORIS' factorization and layout, init, forward against a float64 loop
// over kron(w1, w2), gradients (finite differences and the materialised composite), merge/unmerge,
// apply_lokr on a nested model, adapter-only state dicts.
#include <cmath>

#include "flame/amp.h"
#include "flame/nn/conv_layers.h"
#include "nn_test_util.h"

namespace flame::test {
namespace {

using namespace flame::nn;

// Every LoKr factor of the layer drawn N(0, 1) (w2 / w2_b start at zero).
void randomize_lokr(const Linear& lin, uint64_t seed) {
  const auto& f = lin.lokr_factors();
  for (const Tensor& t : {f.w1, f.w1_a, f.w1_b, f.w2, f.w2_a, f.w2_b}) {
    if (t.defined()) set_(t, randn_like_seeded(t, ++seed));
  }
}

// y = x W^T + b + scale * x kron(w1, w2)^T, element by element in double on the host.
std::vector<double> reference(const Linear& lin, const Tensor& x) {
  const LokrLayout& l = lin.lokr_layout();
  const int64_t in = lin.in_features(), out = lin.out_features(), n = x.numel() / in;
  const std::vector<double> xs = x.to(DType::f64).to(Device::cpu()).contiguous().to_vec<double>();
  const std::vector<double> W = lin.weight().to(DType::f64).to(Device::cpu()).to_vec<double>();
  const std::vector<double> b = lin.bias().defined() ? lin.bias().to(DType::f64).to(Device::cpu()).to_vec<double>()
                                                     : std::vector<double>(out, 0.0);
  auto host = [](const Tensor& t) { return t.detach().to(DType::f64).to(Device::cpu()).contiguous().to_vec<double>(); };
  // w1 [a, b] and w2 [c, d], products of the decomposed factors formed by loops too.
  auto product = [&](const Tensor& full, const Tensor& pa, const Tensor& pb, int64_t rows, int64_t cols) {
    if (full.defined()) return host(full);
    const std::vector<double> A = host(pa), B = host(pb);
    std::vector<double> p(rows * cols, 0.0);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        for (int64_t r = 0; r < l.rank; ++r) p[i * cols + j] += A[i * l.rank + r] * B[r * cols + j];
    return p;
  };
  const auto& f = lin.lokr_factors();
  const std::vector<double> w1 = product(f.w1, f.w1_a, f.w1_b, l.a, l.b);
  const std::vector<double> w2 = product(f.w2, f.w2_a, f.w2_b, l.c, l.d);
  std::vector<double> y(n * out);
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = b[o];
      const int64_t i = o / l.c, k = o % l.c;
      for (int64_t col = 0; col < in; ++col) {
        const int64_t j = col / l.d, m = col % l.d;
        acc += (W[o * in + col] + l.scale * w1[i * l.b + j] * w2[k * l.d + m]) * xs[s * in + col];
      }
      y[s * out + o] = acc;
    }
  }
  return y;
}

struct Attn : Module {
  std::shared_ptr<Linear> q_proj, v_proj, o_proj;
  explicit Attn(int64_t d) {
    q_proj = register_module("q_proj", std::make_shared<Linear>(d, d, false));
    v_proj = register_module("v_proj", std::make_shared<Linear>(d, d, true));
    o_proj = register_module("o_proj", std::make_shared<Linear>(d, d, true));
  }
  std::string name() const override { return "Attn"; }
  Tensor forward(const Tensor& x) override {
    return o_proj->forward(q_proj->forward(x).tanh() + v_proj->forward(x));
  }
};

struct Model : Module {
  std::shared_ptr<ModuleList> layers;
  std::shared_ptr<Conv2d> conv;
  Model() {
    layers = register_module("layers", std::make_shared<ModuleList>());
    for (int i = 0; i < 2; ++i) layers->push_back(std::make_shared<Attn>(6));
    conv = register_module("conv", std::make_shared<Conv2d>(2, 2, 1));
  }
  std::string name() const override { return "Model"; }
  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    for (const auto& l : *layers) h = h + l->forward(h);
    return h;
  }
  std::shared_ptr<Attn> attn(int i) { return layers->at<Attn>(i); }
};

TEST(Lokr, FactorizationAsLycoris) {
  // Worked by hand with LyCORIS' rule (walk divisors upwards while m + n does not grow, m <= factor).
  struct Case {
    int64_t dim, factor, m, n;
  };
  const Case cases[] = {
      {128, -1, 8, 16},   // 2+64, 4+32, 8+16, then 16+8 (equal sum, accepted) -> ordered (8, 16)
      {128, 4, 4, 32},    // 4 divides 128
      {127, -1, 1, 127},  // prime
      {250, 8, 5, 50},    // 8 does not divide: 2, 5, then 10 > 8 stops
      {360, -1, 18, 20},  // ... 15+24, 18+20, 20+18 -> (18, 20)
      {360, 16, 15, 24},  // 16 does not divide: ..., 12, 15, then 18 > 16 stops
      {3072, -1, 48, 64},  // FLUX's hidden size: ..., 32+96, 48+64, 64+48
      {12, 6, 2, 6},      // 6 divides: (6, 2) ordered
      {7, 2, 1, 7},       // 2 does not divide, the next divisor 7 > 2
      {1, -1, 1, 1},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(lokr_factorization(c.dim, c.factor), (std::pair<int64_t, int64_t>{c.m, c.n})) << c.dim << ", " << c.factor;
  }
  expect_error([] { lokr_factorization(0); }, {"lokr_factorization", "dimension", "0"});
  expect_error([] { lokr_factorization(8, 0); }, {"lokr_factorization", "factor", "0"});
}

TEST(Lokr, LayoutAsLycoris) {
  // out 12 -> (3, 4), in 8 -> (2, 4): w1 [3, 2], w2 [4, 4].
  LokrLayout l = lokr_layout(12, 8, {.rank = 1, .alpha = 3});
  EXPECT_EQ((std::vector<int64_t>{l.a, l.b, l.c, l.d}), (std::vector<int64_t>{3, 2, 4, 4}));
  EXPECT_TRUE(l.decompose_w2);  // 2 * 1 < max(4, 4)
  EXPECT_FALSE(l.decompose_w1);
  EXPECT_DOUBLE_EQ(l.scale, 3.0);
  l = lokr_layout(12, 8, {.rank = 1, .alpha = 3, .decompose_both = true});
  EXPECT_TRUE(l.decompose_w1);  // 2 * 1 < max(3, 2)
  l = lokr_layout(12, 8, {.rank = 2, .alpha = 16});
  EXPECT_FALSE(l.decompose_w2);  // 2 * 2 >= 4: w2 whole, and with w1 whole the scale is 1
  EXPECT_DOUBLE_EQ(l.scale, 1.0);
  l = lokr_layout(12, 8, {.rank = 1, .alpha = 0});  // alpha 0 means alpha = rank
  EXPECT_DOUBLE_EQ(l.scale, 1.0);
  l = lokr_layout(12, 8, {.rank = 1, .full_matrix = true});
  EXPECT_FALSE(l.decompose_w2);
  l = lokr_layout(12, 8, {.rank = 1, .unbalanced_factorization = true});
  EXPECT_EQ(l.a, 4);
  EXPECT_EQ(l.c, 3);
  l = lokr_layout(18, 24, {.factor = 3, .rank = 2, .alpha = 1});  // (3, 6) and (3, 8)
  EXPECT_EQ((std::vector<int64_t>{l.a, l.b, l.c, l.d}), (std::vector<int64_t>{3, 3, 6, 8}));
  EXPECT_DOUBLE_EQ(l.scale, 0.5);
  expect_error([] { lokr_layout(4, 4, {.rank = 0}); }, {"lokr", "rank", "0"});
  expect_error([] { lokr_layout(4, 4, {.factor = 0}); }, {"lokr", "factor", "0"});
}

TEST(Lokr, AdapterNamesInitAndFrozenBase) {
  Linear lin(8, 12);
  const Tensor w = lin.weight();
  lin.add_lokr({.rank = 1, .alpha = 3, .decompose_both = true});
  EXPECT_TRUE(lin.has_lora());
  EXPECT_TRUE(lin.has_lokr());
  EXPECT_EQ(lin.lora_A(), nullptr);
  EXPECT_EQ(lin.state_dict().keys(),
            (std::vector<std::string>{"weight", "bias", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b"}));
  const auto& f = lin.lokr_factors();
  EXPECT_EQ(f.w1_a.sizes(), (Shape{3, 1}));
  EXPECT_EQ(f.w1_b.sizes(), (Shape{1, 2}));
  EXPECT_EQ(f.w2_a.sizes(), (Shape{4, 1}));
  EXPECT_EQ(f.w2_b.sizes(), (Shape{1, 4}));
  EXPECT_EQ(f.w2_b.to_vec<float>(), std::vector<float>(4, 0.0f));  // delta W starts at zero
  // kaiming_uniform(a = sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in)); w1_b has fan_in 1.
  const std::vector<float> wb = f.w1_b.to_vec<float>();
  EXPECT_TRUE(std::all_of(wb.begin(), wb.end(), [](float v) { return std::fabs(v) <= 1.0f; }));
  EXPECT_GT(f.w1_b.abs().sum().item<double>(), 0.0);
  EXPECT_TRUE(lin.weight().is_same(w));
  EXPECT_FALSE(w.requires_grad());
  EXPECT_FALSE(lin.bias().requires_grad());
  EXPECT_EQ(lin.num_parameters(true), 3 + 2 + 4 + 4);
  Generator g(1);
  const Tensor x = Tensor::randn({3, 8}, 0.0, 1.0, {}, &g);
  EXPECT_TRUE(all_close(lin(x), functional::linear(x, lin.weight(), lin.bias()), 0, 0));
  expect_error([&] { lin.add_lokr(LokrOptions{}); }, {"add_lokr", "already"});
  expect_error([&] { lin.add_lora({}); }, {"add_lora", "already"});
  expect_error([&] { lin.lora_delta_weight(); }, {"lora_delta_weight", "LoKr"});
  expect_error([&] { Linear(8, 12).add_lokr(LokrLayout{.a = 3, .b = 2, .c = 3, .d = 4}); },
               {"add_lokr", "w1 [3, 2]", "w2 [3, 4]", "12"});
  expect_error([&] { Conv2d(2, 2, 1).add_lokr(LokrOptions{}); }, {"add_lokr", "Linear layers only", "Conv2d"});
}

TEST(Lokr, ForwardMatchesFloat64Loop) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  struct Config {
    int64_t in, out;
    LokrOptions options;
  };
  const Config configs[] = {
      {8, 12, {.rank = 1, .alpha = 3, .decompose_both = true}},  // w1 and w2 decomposed
      {24, 18, {.factor = 3, .rank = 2, .alpha = 1}},           // w1 [3, 3], w2 [6, 2] @ [2, 8]
      {10, 6, {.rank = 4, .alpha = 7}},                         // both whole (scale 1)
  };
  uint64_t seed = 100;
  for (const Config& c : configs) {
    Linear lin(c.in, c.out, true, TensorOptions(DType::f64, dev));
    lin.add_lokr(c.options);
    randomize_lokr(lin, seed += 10);
    Generator g(seed);
    const Tensor x = Tensor::randn({2, 3, c.in}, 0.0, 1.0, TensorOptions(DType::f64, dev), &g);
    const Tensor y = lin(x);
    EXPECT_EQ(y.sizes(), (Shape{2, 3, c.out}));
    const Tensor want = Tensor::from_vec(reference(lin, x), {2, 3, c.out});
    EXPECT_TRUE(all_close(y.to(Device::cpu()), want, 1e-12, 1e-12)) << c.in << " -> " << c.out;
    // The materialised update is the same kron product.
    const Tensor delta = lin.lokr_delta_weight().to(Device::cpu());
    const Tensor composite = x.to(Device::cpu()).matmul((lin.weight().to(Device::cpu()) + delta).t()) +
                             lin.bias().to(Device::cpu());
    EXPECT_TRUE(all_close(composite, want, 1e-12, 1e-12));
  }
}

TEST(Lokr, GradcheckAndCompositeGradients) {
  for (bool both : {false, true}) {
    Linear lin(8, 12, true, DType::f64);
    lin.add_lokr({.rank = 1, .alpha = 2, .decompose_both = both});
    randomize_lokr(lin, 200);
    Generator g(201);
    const Tensor x = Tensor::randn({2, 3, 8}, 0.0, 1.0, DType::f64, &g);
    EXPECT_TRUE(module_gradcheck(lin, x, [&](const Tensor& in) { return lin(in).tanh(); })) << both;
    // The factored forward and the materialised W + scale kron(w1, w2) give the same gradients.
    Gradients fast = lin(x).tanh().square().sum().backward();
    Gradients slow = functional::linear(x, lin.weight() + lin.lokr_delta_weight(), lin.bias()).tanh().square().sum().backward();
    EXPECT_FALSE(fast.contains(lin.weight()));
    int checked = 0;
    for (auto& [n, p] : lin.named_parameters()) {
      if (!is_lora_key(n)) continue;
      ASSERT_TRUE(fast.contains(p)) << n;
      EXPECT_GT(fast.get(p).abs().sum().item<double>(), 0.0) << n;
      EXPECT_TRUE(all_close(fast.get(p), slow.get(p), 1e-10, 1e-12)) << n;
      ++checked;
    }
    EXPECT_EQ(checked, both ? 4 : 3);
  }
}

TEST(Lokr, MergedOutputEqualsUnmerged) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Linear lin(24, 18, true, dev);
  lin.add_lokr({.factor = 3, .rank = 2, .alpha = 1});
  randomize_lokr(lin, 300);
  Generator g(301);
  const Tensor x = Tensor::randn({4, 24}, 0.0, 1.0, dev, &g);
  const Tensor w0 = lin.weight().clone();
  const Tensor unmerged = lin(x);
  lin.merge();
  EXPECT_TRUE(lin.merged());
  EXPECT_TRUE(all_close(lin.weight(), w0 + lin.lokr_delta_weight(), 1e-6, 1e-6)) << "merge is not W + delta";
  EXPECT_FALSE(all_close(lin.weight(), w0, 1e-3, 1e-3));
  EXPECT_TRUE(all_close(lin(x), unmerged, 1e-4, 1e-5));
  expect_error([&] { lin.merge(); }, {"merge", "already"});
  lin.unmerge();
  EXPECT_TRUE(all_close(lin.weight(), w0, 1e-5, 1e-6));
  EXPECT_TRUE(all_close(lin(x), unmerged, 1e-5, 1e-5));
  expect_error([&] { lin.unmerge(); }, {"unmerge", "not merged"});
}

TEST(Lokr, ApplyLokrAndAdapterStateDictRoundTrip) {
  Model a, b;
  ASSERT_TRUE(b.load_state_dict(a.state_dict()).ok());  // same base
  expect_error([&] { apply_lokr(a, {}, {"conv", "q_proj"}); }, {"apply_lokr", "conv", "Conv2d", "nothing was changed"});
  EXPECT_FALSE(a.attn(0)->q_proj->has_lora());
  const LokrOptions options{.rank = 1, .alpha = 2};
  const auto adapted = apply_lokr(a, options, {"q_proj", "v_proj"});
  EXPECT_EQ(adapted, (std::vector<std::string>{"layers.0.q_proj", "layers.0.v_proj", "layers.1.q_proj", "layers.1.v_proj"}));
  apply_lokr(b, options, {"q_proj", "v_proj"});
  for (auto& [n, p] : a.named_parameters()) EXPECT_EQ(p.requires_grad(), is_lora_key(n)) << n;
  // Adapted layers are skipped by a later apply_lora; the rest take LoRA.
  EXPECT_EQ(apply_lora(a, {.rank = 2}, {"q_proj", "o_proj"}), (std::vector<std::string>{"layers.0.o_proj", "layers.1.o_proj"}));
  apply_lora(b, {.rank = 2}, {"o_proj"});
  expect_error([&] { apply_lokr(a, {}, {"k_proj"}); }, {"apply_lokr", "k_proj"});
  uint64_t seed = 400;
  for (auto& [n, p] : a.named_parameters()) {
    if (is_lora_key(n)) set_(p, randn_like_seeded(p, ++seed));
  }
  const StateDict sd = lora_state_dict(a);
  // d = 6 -> (2, 3): w1 [2, 2], w2 = w2_a [3, 1] @ w2_b [1, 3]; plus the LoRA tensors of o_proj.
  EXPECT_EQ(sd.size(), 4u * 3u + 2u * 2u);
  EXPECT_EQ(sd.at("base_model.model.layers.0.q_proj.lokr_w1").sizes(), (Shape{2, 2}));
  EXPECT_EQ(sd.at("base_model.model.layers.1.v_proj.lokr_w2_a").sizes(), (Shape{3, 1}));
  EXPECT_EQ(sd.at("base_model.model.layers.1.v_proj.lokr_w2_b").sizes(), (Shape{1, 3}));
  for (const auto& k : sd.keys()) EXPECT_TRUE(is_lora_key(k)) << k;
  EXPECT_FALSE(is_lora_key("layers.0.q_proj.weight"));
  EXPECT_FALSE(is_lora_key("layers.0.q_proj.lokr_w3"));
  Generator g(410);
  const Tensor x = Tensor::randn({3, 6}, 0.0, 1.0, {}, &g);
  EXPECT_FALSE(all_close(b(x), a(x), 1e-4, 1e-4));
  const Tensor handle = b.attn(0)->q_proj->lokr_factors().w1;
  LoadReport r = load_lora_state_dict(b, sd);
  EXPECT_TRUE(r.ok()) << r.to_string();
  EXPECT_TRUE(handle.is_same(b.attn(0)->q_proj->lokr_factors().w1));
  EXPECT_TRUE(all_close(b(x), a(x), 1e-6, 1e-6));
  StateDict bad = sd;
  bad.erase("base_model.model.layers.1.v_proj.lokr_w2_b");
  expect_error([&] { load_lora_state_dict(b, bad); },
               {"load_lora_state_dict", "missing key 'base_model.model.layers.1.v_proj.lokr_w2_b'"});
  // merge_lora folds LoKr and LoRA alike.
  const Tensor before = b(x);
  merge_lora(b);
  EXPECT_TRUE(b.attn(1)->v_proj->merged());
  EXPECT_TRUE(all_close(b(x), before, 1e-5, 1e-5));
  unmerge_lora(b);
  EXPECT_TRUE(all_close(b(x), before, 1e-5, 1e-5));
  // f64 adapters under the f32 base, the same tensors.
  const Tensor w2_a = b.attn(0)->q_proj->lokr_factors().w2_a;
  adapters_to(b, DType::f64);
  EXPECT_EQ(w2_a.dtype(), DType::f64);
  EXPECT_TRUE(w2_a.is_same(b.attn(0)->q_proj->lokr_factors().w2_a));
  EXPECT_EQ(b.attn(0)->o_proj->lora_A()->weight().dtype(), DType::f64);
  EXPECT_EQ(b.attn(0)->q_proj->weight().dtype(), DType::f32);
}

TEST(Lokr, F32AdapterUnderBf16BaseWithAutocast) {
  // The training setup: bf16 weights, f32 LoKr factors (adapters_to), CPU autocast to bf16.
  Linear ref(24, 18);
  ref.add_lokr({.factor = 3, .rank = 2, .alpha = 1});
  randomize_lokr(ref, 600);
  Linear lin(24, 18);
  lin.add_lokr({.factor = 3, .rank = 2, .alpha = 1});
  ASSERT_TRUE(lin.load_state_dict(ref.state_dict()).ok());
  lin.to(DType::bf16);
  adapters_to(lin, DType::f32);
  EXPECT_EQ(lin.weight().dtype(), DType::bf16);
  EXPECT_EQ(lin.lokr_factors().w2_a.dtype(), DType::f32);
  Generator g(601);
  const Tensor x = Tensor::randn({4, 24}, 0.0, 1.0, {}, &g);
  Tensor y;
  {
    amp::AutocastGuard autocast(DType::bf16, DeviceType::cpu);
    y = lin(x.to(DType::bf16));
  }
  EXPECT_EQ(y.dtype(), DType::bf16);
  EXPECT_TRUE(all_close(y.to(DType::f32), ref(x), 5e-2, 5e-2));
  Gradients grads = y.to(DType::f32).square().sum().backward();
  EXPECT_EQ(grads.get(lin.lokr_factors().w2_b).dtype(), DType::f32);
  EXPECT_FALSE(grads.contains(lin.weight()));
  Gradients want = ref(x).square().sum().backward();
  EXPECT_TRUE(close_rel(grads.get(lin.lokr_factors().w1), want.get(ref.lokr_factors().w1), 5e-2));
}

TEST(LokrCuda, MatchesCpuForwardAndGradients) {
  FLAME_SKIP_IF_NO_CUDA();
  for (bool both : {false, true}) {
    Linear cpu(24, 18), gpu(24, 18);
    cpu.add_lokr({.factor = 3, .rank = 1, .alpha = 2, .decompose_both = both});
    gpu.add_lokr({.factor = 3, .rank = 1, .alpha = 2, .decompose_both = both});
    randomize_lokr(cpu, 500);
    gpu.to(Device::cuda());
    ASSERT_TRUE(gpu.load_state_dict(cpu.state_dict()).ok());
    Generator g(501);
    const Tensor x = Tensor::randn({2, 5, 24}, 0.0, 1.0, {}, &g);
    const Tensor yc = cpu(x), yg = gpu(x.to(Device::cuda()));
    EXPECT_TRUE(all_close(yg.to(Device::cpu()), yc, 1e-4, 1e-5)) << both;
    Gradients gc = yc.square().sum().backward(), gg = yg.square().sum().backward();
    const auto pc = cpu.named_parameters(), pg = gpu.named_parameters();
    for (std::size_t i = 0; i < pc.size(); ++i) {
      EXPECT_EQ(gc.contains(pc[i].second), gg.contains(pg[i].second)) << pc[i].first;
      if (!gc.contains(pc[i].second)) continue;
      EXPECT_TRUE(all_close(gg.get(pg[i].second).to(Device::cpu()), gc.get(pc[i].second), 1e-3, 1e-4)) << pc[i].first;
    }
    gpu.merge();
    EXPECT_TRUE(all_close(gpu(x.to(Device::cuda())).to(Device::cpu()), yc, 1e-4, 1e-4)) << both;
  }
}

}  // namespace
}  // namespace flame::test
