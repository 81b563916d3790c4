// LoRA / DoRA adapters on Linear: PEFT names and init, forward against hand-written formulas,
// frozen base, gradients, merge/unmerge, apply_lora on a nested model, adapter-only state dicts.
#include <cmath>

#include "nn_test_util.h"

namespace flame::test {
namespace {

using namespace flame::nn;

struct Attn : Module {
  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;
  Attn(int64_t d, TensorOptions o) {
    q_proj = register_module("q_proj", std::make_shared<Linear>(d, d, false, o));
    k_proj = register_module("k_proj", std::make_shared<Linear>(d, d, false, o));
    v_proj = register_module("v_proj", std::make_shared<Linear>(d, d, true, o));
    o_proj = register_module("o_proj", std::make_shared<Linear>(d, d, true, o));
  }
  std::string name() const override { return "Attn"; }
  Tensor forward(const Tensor& x) override {
    return o_proj->forward(q_proj->forward(x) * k_proj->forward(x).sigmoid() + v_proj->forward(x));
  }
};

struct Model : Module {
  std::shared_ptr<ModuleList> layers;
  std::shared_ptr<Linear> lm_head;
  explicit Model(int64_t d = 6, TensorOptions o = {}) {
    layers = register_module("layers", std::make_shared<ModuleList>());
    for (int i = 0; i < 2; ++i) {
      auto block = std::make_shared<Sequential>();
      block->push_back(std::make_shared<Attn>(d, o));
      layers->push_back(block);
    }
    lm_head = register_module("lm_head", std::make_shared<Linear>(d, 3, true, o));
  }
  std::string name() const override { return "Model"; }
  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    for (const auto& l : *layers) h = h + l->forward(h);
    return lm_head->forward(h);
  }
  std::shared_ptr<Attn> attn(int i) { return layers->at<Sequential>(i)->at<Attn>(0); }
};

TEST(Lora, AdapterHasPeftNamesInitAndFrozenBase) {
  Linear lin(16, 8);
  const Tensor w = lin.weight();
  lin.add_lora({.rank = 4, .alpha = 8});
  EXPECT_TRUE(lin.has_lora());
  EXPECT_EQ(lin.state_dict().keys(), (std::vector<std::string>{"weight", "bias", "lora_A.weight", "lora_B.weight"}));
  EXPECT_EQ(lin.lora_A()->weight().sizes(), (Shape{4, 16}));
  EXPECT_EQ(lin.lora_B()->weight().sizes(), (Shape{8, 4}));
  EXPECT_EQ(lin.lora_B()->weight().to_vec<float>(), std::vector<float>(32, 0.0f));  // B starts at zero
  const std::vector<float> a = lin.lora_A()->weight().to_vec<float>();
  EXPECT_LE(*std::max_element(a.begin(), a.end()), 0.25f);  // kaiming_uniform(a = sqrt(5)): 1/sqrt(16)
  EXPECT_GT(*std::max_element(a.begin(), a.end()), 0.15f);
  EXPECT_DOUBLE_EQ(lin.lora_scaling(), 2.0);
  EXPECT_TRUE(lin.weight().is_same(w));
  EXPECT_FALSE(w.requires_grad());
  EXPECT_FALSE(lin.bias().requires_grad());
  EXPECT_EQ(lin.num_parameters(true), 4 * 16 + 8 * 4);
  // A fresh adapter leaves the output unchanged.
  Generator g(1);
  const Tensor x = Tensor::randn({3, 16}, 0.0, 1.0, {}, &g);
  EXPECT_TRUE(all_close(lin(x), functional::linear(x, lin.weight(), lin.bias()), 0, 0));
  Linear rs(16, 8);
  rs.add_lora({.rank = 4, .alpha = 8, .use_rslora = true});
  EXPECT_DOUBLE_EQ(rs.lora_scaling(), 4.0);
  expect_error([&] { lin.add_lora({}); }, {"add_lora", "already"});
  expect_error([&] { Linear(2, 2).add_lora({.rank = 0}); }, {"add_lora", "rank", "0"});
  expect_error([&] { Linear(2, 2).merge(); }, {"merge", "no adapter"});
}

TEST(Lora, ForwardMatchesFormulaAndFrozenBaseHasNoGradient) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Linear lin(5, 7, true, dev);
  lin.add_lora({.rank = 3, .alpha = 6});
  set_(lin.lora_B()->weight(), randn_like_seeded(lin.lora_B()->weight(), 2));
  Generator g(3);
  const Tensor x = Tensor::randn({2, 4, 5}, 0.0, 1.0, dev, &g);
  const Tensor y = lin(x);
  // y = x W^T + b + 2 * x A^T B^T, on the host in double.
  const Tensor W = lin.weight().to(DType::f64), b = lin.bias().to(DType::f64);
  const Tensor A = lin.lora_A()->weight().to(DType::f64), B = lin.lora_B()->weight().to(DType::f64);
  const Tensor xd = x.to(DType::f64);
  const Tensor want = xd.matmul(W.t()) + b + xd.matmul(A.t()).matmul(B.t()) * 2.0;
  EXPECT_TRUE(all_close(y, want.to(DType::f32), 1e-5, 1e-5));
  Gradients grads = y.square().sum().backward();
  EXPECT_FALSE(grads.contains(lin.weight()));
  EXPECT_FALSE(grads.contains(lin.bias()));
  ASSERT_TRUE(grads.contains(lin.lora_A()->weight()));
  ASSERT_TRUE(grads.contains(lin.lora_B()->weight()));
  EXPECT_GT(grads.get(lin.lora_A()->weight()).abs().sum().item<double>(), 0.0);
  EXPECT_EQ(grads.size(), 2u);
}

TEST(Lora, Gradcheck) {
  Linear lin(4, 3, true, DType::f64);
  lin.add_lora({.rank = 2, .alpha = 3});
  set_(lin.lora_B()->weight(), randn_like_seeded(lin.lora_B()->weight(), 4));
  Generator g(5);
  const Tensor x = Tensor::randn({3, 4}, 0.0, 1.0, DType::f64, &g);
  EXPECT_TRUE(module_gradcheck(lin, x, [&](const Tensor& in) { return lin(in).tanh(); }));
}

TEST(Lora, AdapterDropoutActsOnTheAdapterInputOnlyInTraining) {
  Linear lin(6, 4);
  lin.add_lora({.rank = 2, .alpha = 2, .dropout = 0.5});
  set_(lin.lora_B()->weight(), randn_like_seeded(lin.lora_B()->weight(), 6));
  Generator g(7);
  const Tensor x = Tensor::uniform({5, 6}, 0.5, 1.5, {}, &g);
  manual_seed(99);
  const Tensor y = lin(x);
  manual_seed(99);
  const Tensor xd = functional::dropout(x, 0.5, true);
  const Tensor want = functional::linear(x, lin.weight(), lin.bias()) +
                      xd.matmul(lin.lora_A()->weight().t()).matmul(lin.lora_B()->weight().t());
  EXPECT_TRUE(all_close(y, want, 1e-5, 1e-6));
  EXPECT_FALSE(all_close(xd, x, 1e-3, 1e-3));  // the mask really dropped something
  lin.eval();
  const Tensor plain = functional::linear(x, lin.weight(), lin.bias()) +
                       x.matmul(lin.lora_A()->weight().t()).matmul(lin.lora_B()->weight().t());
  EXPECT_TRUE(all_close(lin(x), plain, 1e-5, 1e-6));
}

TEST(Lora, MergedOutputEqualsUnmerged) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (bool dora : {false, true}) {
    Linear lin(9, 5, true, dev);
    lin.add_lora({.rank = 3, .alpha = 5, .dropout = 0.1, .use_dora = dora});
    set_(lin.lora_B()->weight(), randn_like_seeded(lin.lora_B()->weight(), 8, 0.3));
    if (dora) set_(lin.lora_magnitude_vector(), lin.lora_magnitude_vector() * 1.5);
    lin.eval();
    Generator g(9);
    const Tensor x = Tensor::randn({4, 9}, 0.0, 1.0, dev, &g);
    const Tensor w0 = lin.weight().clone();
    const Tensor unmerged = lin(x);
    lin.merge();
    EXPECT_TRUE(lin.merged());
    EXPECT_FALSE(all_close(lin.weight(), w0, 1e-3, 1e-3)) << "merge did not change the weight";
    EXPECT_TRUE(all_close(functional::linear(x, lin.weight(), lin.bias()), unmerged, 1e-5, 1e-5)) << dora;
    EXPECT_TRUE(all_close(lin(x), unmerged, 1e-5, 1e-5)) << dora;
    expect_error([&] { lin.merge(); }, {"merge", "already"});
    lin.unmerge();
    EXPECT_TRUE(all_close(lin.weight(), w0, 1e-5, 1e-6)) << dora;
    EXPECT_TRUE(all_close(lin(x), unmerged, 1e-5, 1e-5)) << dora;
    expect_error([&] { lin.unmerge(); }, {"unmerge", "not merged"});
  }
}

TEST(Lora, DoraForwardMatchesFormula) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Linear lin(6, 4, true, TensorOptions(DType::f64, dev));
  lin.add_lora({.rank = 2, .alpha = 4, .use_dora = true});
  // PEFT's key and its init: m = ||W||_row.
  EXPECT_EQ(lin.state_dict().keys(),
            (std::vector<std::string>{"weight", "bias", "lora_magnitude_vector", "lora_A.weight", "lora_B.weight"}));
  const Tensor W = lin.weight().to(Device::cpu()), b = lin.bias().to(Device::cpu());
  EXPECT_TRUE(all_close(lin.lora_magnitude_vector().to(Device::cpu()), W.square().sum(1).sqrt(), 1e-12, 1e-12));
  set_(lin.lora_B()->weight(), randn_like_seeded(lin.lora_B()->weight(), 10));
  set_(lin.lora_magnitude_vector(), randn_like_seeded(lin.lora_magnitude_vector(), 11).abs() + 0.5);
  Generator g(12);
  const Tensor x = Tensor::randn({3, 6}, 0.0, 1.0, DType::f64, &g);
  // y = m / ||W + s B A||_row * (W + s B A) x + b
  const Tensor A = lin.lora_A()->weight().to(Device::cpu()), B = lin.lora_B()->weight().to(Device::cpu());
  const Tensor m = lin.lora_magnitude_vector().to(Device::cpu());
  const Tensor V = W + B.matmul(A) * 2.0;
  const Tensor Wd = V * (m / V.square().sum(1).sqrt()).unsqueeze(1);
  const Tensor want = x.matmul(Wd.t()) + b;
  EXPECT_TRUE(all_close(lin(x.to(dev)).to(Device::cpu()), want, 1e-10, 1e-12));
  // Gradients reach m, A and B, not the base.
  Gradients grads = lin(x.to(dev)).sum().backward();
  EXPECT_TRUE(grads.contains(lin.lora_magnitude_vector()));
  EXPECT_TRUE(grads.contains(lin.lora_A()->weight()));
  EXPECT_FALSE(grads.contains(lin.weight()));
}

TEST(Lora, DoraGradcheckThroughInputAndMagnitude) {
  // The norm is detached (DoRA paper, PEFT), so finite differences agree with backward for the
  // input and the magnitude; A and B are checked against the same formula with the norm constant.
  Linear lin(4, 3, true, DType::f64);
  lin.add_lora({.rank = 2, .alpha = 2, .use_dora = true});
  set_(lin.lora_B()->weight(), randn_like_seeded(lin.lora_B()->weight(), 13));
  lin.lora_A()->requires_grad_(false);
  lin.lora_B()->requires_grad_(false);
  Generator g(14);
  const Tensor x = Tensor::randn({2, 4}, 0.0, 1.0, DType::f64, &g);
  EXPECT_TRUE(module_gradcheck(lin, x, [&](const Tensor& in) { return lin(in).square(); }));
  lin.requires_grad_(true);
  Tensor(lin.weight()).requires_grad_(false);
  Tensor(lin.bias()).requires_grad_(false);
  Gradients grads = lin(x).square().sum().backward();
  const Tensor A = lin.lora_A()->weight().detach().requires_grad_(), B = lin.lora_B()->weight().detach().requires_grad_();
  const Tensor W = lin.weight().detach();
  Tensor n;
  {
    NoGradGuard ng;
    n = (W + B.matmul(A)).square().sum(1).sqrt();
  }
  const Tensor V = W + B.matmul(A);
  const Tensor ref = x.matmul((V * (lin.lora_magnitude_vector().detach() / n).unsqueeze(1)).t()) + lin.bias();
  Gradients rg = ref.square().sum().backward();
  EXPECT_TRUE(all_close(grads.get(lin.lora_A()->weight()), rg.get(A), 1e-10, 1e-12));
  EXPECT_TRUE(all_close(grads.get(lin.lora_B()->weight()), rg.get(B), 1e-10, 1e-12));
}

TEST(Lora, ApplyLoraOnNestedModelAndAdapterStateDict) {
  Model model;
  const std::vector<std::string> adapted = apply_lora(model, {.rank = 2, .alpha = 4}, {"q_proj", "v_proj"});
  EXPECT_EQ(adapted, (std::vector<std::string>{"layers.0.0.q_proj", "layers.0.0.v_proj", "layers.1.0.q_proj",
                                               "layers.1.0.v_proj"}));
  EXPECT_TRUE(model.attn(1)->q_proj->has_lora());
  EXPECT_FALSE(model.attn(1)->k_proj->has_lora());
  EXPECT_FALSE(model.lm_head->has_lora());
  // Only adapters train.
  for (auto& [n, p] : model.named_parameters()) EXPECT_EQ(p.requires_grad(), is_lora_key(n)) << n;
  // Applying again with an overlapping list adapts only the new matches (never the adapters).
  EXPECT_EQ(apply_lora(model, {.rank = 2, .alpha = 4}, {"q_proj", "o_proj"}),
            (std::vector<std::string>{"layers.0.0.o_proj", "layers.1.0.o_proj"}));
  expect_error([&] { apply_lora(model, {}, {"gate_proj"}); }, {"apply_lora", "gate_proj"});
  expect_error([&] { apply_lora(model, {}, {"lora_A"}); }, {"apply_lora", "lora_A"});

  const StateDict sd = lora_state_dict(model);
  EXPECT_EQ(sd.size(), 12u);
  EXPECT_EQ(sd.keys()[0], "base_model.model.layers.0.0.q_proj.lora_A.weight");
  EXPECT_EQ(sd.keys()[1], "base_model.model.layers.0.0.q_proj.lora_B.weight");
  for (const auto& k : sd.keys()) EXPECT_TRUE(is_lora_key(k)) << k;
  EXPECT_TRUE(sd.contains("base_model.model.layers.1.0.o_proj.lora_B.weight"));
  EXPECT_FALSE(sd.contains("base_model.model.layers.1.0.o_proj.weight"));
}

TEST(Lora, AdapterStateDictLoadsIntoAnotherModel) {
  Model a, b;
  ASSERT_TRUE(b.load_state_dict(a.state_dict()).ok());  // same base
  apply_lora(a, {.rank = 2, .alpha = 2, .use_dora = true}, {"q_proj", "v_proj"});
  apply_lora(b, {.rank = 2, .alpha = 2, .use_dora = true}, {"q_proj", "v_proj"});
  uint64_t seed = 20;
  for (auto& [n, p] : a.named_parameters()) {
    if (is_lora_key(n)) set_(p, randn_like_seeded(p, ++seed));
  }
  const StateDict sd = lora_state_dict(a);
  EXPECT_TRUE(sd.contains("base_model.model.layers.0.0.q_proj.lora_magnitude_vector"));
  Generator g(30);
  const Tensor x = Tensor::randn({3, 6}, 0.0, 1.0, {}, &g);
  EXPECT_FALSE(all_close(b(x), a(x), 1e-4, 1e-4));
  const Tensor handle = b.attn(0)->q_proj->lora_A()->weight();
  LoadReport r = load_lora_state_dict(b, sd);
  EXPECT_TRUE(r.ok()) << r.to_string();
  EXPECT_TRUE(handle.is_same(b.attn(0)->q_proj->lora_A()->weight()));
  EXPECT_TRUE(all_close(b(x), a(x), 1e-6, 1e-6));

  // Strict: a missing and an unexpected adapter key are both reported, nothing changes.
  StateDict bad = sd;
  bad.erase("base_model.model.layers.1.0.v_proj.lora_B.weight");
  bad.insert("base_model.model.layers.1.0.k_proj.lora_A.weight", Tensor::ones({2, 6}));
  bad.set("base_model.model.layers.0.0.q_proj.lora_A.weight", Tensor::ones({3, 6}));
  const std::vector<float> before = handle.to_vec<float>();
  expect_error([&] { load_lora_state_dict(b, bad); },
               {"load_lora_state_dict", "missing key 'base_model.model.layers.1.0.v_proj.lora_B.weight'",
                "unexpected key 'base_model.model.layers.1.0.k_proj.lora_A.weight'", "[3, 6] f32"});
  EXPECT_EQ(handle.to_vec<float>(), before);
  LoadReport nr = load_lora_state_dict(b, bad, false);
  EXPECT_EQ(nr.missing_keys.size(), 1u);
  EXPECT_EQ(nr.unexpected_keys.size(), 1u);
  EXPECT_EQ(nr.mismatched.size(), 1u);
  // Merging the whole tree keeps the outputs.
  b.eval();
  const Tensor before_merge = b(x);
  merge_lora(b);
  EXPECT_TRUE(b.attn(1)->v_proj->merged());
  EXPECT_TRUE(all_close(b(x), before_merge, 1e-5, 1e-5));
  unmerge_lora(b);
  EXPECT_FALSE(b.attn(1)->v_proj->merged());
  EXPECT_TRUE(all_close(b(x), before_merge, 1e-5, 1e-5));
}

TEST(Lora, HalfPrecisionBaseAndConversionWhileMerged) {
  // A bf16 model: the adapter takes the base's dtype, and its output follows the f32 reference.
  Linear lin(8, 4);
  lin.add_lora({.rank = 2, .alpha = 2, .use_dora = true});
  set_(lin.lora_B()->weight(), randn_like_seeded(lin.lora_B()->weight(), 60, 0.5));
  lin.eval();
  Generator g(61);
  const Tensor x = Tensor::randn({3, 8}, 0.0, 1.0, {}, &g);
  const Tensor ref = lin(x);
  lin.merge();
  lin.to(DType::bf16);  // converting a merged DoRA layer, then unmerging, must still work
  EXPECT_EQ(lin.lora_A()->weight().dtype(), DType::bf16);
  EXPECT_EQ(lin.lora_magnitude_vector().dtype(), DType::bf16);
  EXPECT_TRUE(all_close(lin(x.to(DType::bf16)).to(DType::f32), ref, 3e-2, 3e-2));
  lin.unmerge();
  EXPECT_TRUE(all_close(lin(x.to(DType::bf16)).to(DType::f32), ref, 3e-2, 3e-2));
  Gradients grads = lin(x.to(DType::bf16)).sum().backward();
  EXPECT_EQ(grads.get(lin.lora_B()->weight()).dtype(), DType::bf16);
  EXPECT_FALSE(grads.contains(lin.weight()));
}

TEST(LoraCuda, AdapterMatchesCpuForwardAndGradients) {
  FLAME_SKIP_IF_NO_CUDA();
  for (bool dora : {false, true}) {
    Model cpu, gpu;
    apply_lora(cpu, {.rank = 2, .alpha = 4, .use_dora = dora}, {"q_proj", "o_proj"});
    apply_lora(gpu, {.rank = 2, .alpha = 4, .use_dora = dora}, {"q_proj", "o_proj"});
    uint64_t seed = 40;
    for (auto& [n, p] : cpu.named_parameters()) {
      if (is_lora_key(n)) set_(p, randn_like_seeded(p, ++seed));
    }
    gpu.to(Device::cuda());
    ASSERT_TRUE(gpu.load_state_dict(cpu.state_dict()).ok());
    Generator g(50);
    const Tensor x = Tensor::randn({4, 6}, 0.0, 1.0, {}, &g);
    const Tensor yc = cpu(x), yg = gpu(x.to(Device::cuda()));
    EXPECT_TRUE(all_close(yg.to(Device::cpu()), yc, 1e-4, 1e-5));
    Gradients gc = yc.square().sum().backward(), gg = yg.square().sum().backward();
    EXPECT_EQ(gc.size(), gg.size());
    const auto pc = cpu.named_parameters(), pg = gpu.named_parameters();
    for (std::size_t i = 0; i < pc.size(); ++i) {
      EXPECT_EQ(gc.contains(pc[i].second), gg.contains(pg[i].second)) << pc[i].first;
      if (!gc.contains(pc[i].second)) continue;
      EXPECT_TRUE(all_close(gg.get(pg[i].second).to(Device::cpu()), gc.get(pc[i].second), 1e-3, 1e-4)) << pc[i].first;
    }
    gpu.eval();
    cpu.eval();
    merge_lora(gpu);
    EXPECT_TRUE(all_close(gpu(x.to(Device::cuda())).to(Device::cpu()), cpu(x), 1e-4, 1e-5)) << dora;
  }
}

}  // namespace
}  // namespace flame::test
