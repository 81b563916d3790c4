// Modules over the layer families (conv_layers.h, norm_layers.h, pool_layers.h,
// attention_layers.h) and module serialization: PyTorch names and shapes, default init, forward
// equal to the functional op, training/eval behaviour, gradients through the modules' own
// parameters (float64, CPU), Conv2d LoRA, and state dicts through safetensors files.
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "gradcheck.h"
#include "nn_test_util.h"

namespace flame::test {
namespace {

using namespace flame::nn;
namespace F = flame::nn::functional;

Tensor randn_on(const Shape& s, uint64_t seed, TensorOptions o) {
  Generator g(seed);
  return Tensor::randn(s, 0.0, 1.0, o, &g);
}

std::vector<std::string> names_of(const Module& m) {
  std::vector<std::string> out;
  for (const auto& [n, t] : m.state_dict()) out.push_back(n);
  return out;
}

std::string temp_path(const std::string& stem) { return unique_temp_path(stem, ".safetensors"); }

// ---- convolutions ----
TEST(NnConvModule, ShapesNamesInitAndForward) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Conv2d conv(4, 6, {3}, {2}, {1}, {1}, 2, true, dev);
  EXPECT_EQ(conv.weight().sizes(), (Shape{6, 2, 3, 3}));
  EXPECT_EQ(conv.bias().sizes(), (Shape{6}));
  EXPECT_EQ(names_of(conv), (std::vector<std::string>{"weight", "bias"}));
  // kaiming_uniform(a = sqrt(5)) and the bias both lie in +-1/sqrt(fan_in), fan_in = 2 * 3 * 3.
  const double bound = 1.0 / std::sqrt(18.0);
  for (const Tensor& t : {conv.weight(), conv.bias()}) {
    const Tensor a = t.detach().abs();
    EXPECT_LE(a.max().item<double>(), bound + 1e-7);
    EXPECT_GT(a.max().item<double>(), 0.5 * bound);
  }
  const Tensor x = randn_on({2, 4, 9, 7}, 1, dev);
  const Tensor y = conv(x);
  EXPECT_TRUE(all_close(y, F::conv2d(x, conv.weight(), conv.bias(), {2}, {1}, {1}, 2), 1e-6, 1e-6));
  EXPECT_EQ(y.sizes(), (Shape{2, 6, 5, 4}));

  ConvTranspose2d tconv(4, 6, {3, 2}, {2}, {1}, {1}, 1, false, {1}, dev);
  EXPECT_EQ(tconv.weight().sizes(), (Shape{4, 6, 3, 2}));
  EXPECT_FALSE(tconv.bias().defined());
  EXPECT_TRUE(all_close(tconv(x), F::conv_transpose2d(x, tconv.weight(), {}, {2}, {1}, {1}, 1, {1}), 1e-6, 1e-6));

  Conv1d c1(3, 5, {3}, {1}, "same", {2}, 1, true, dev);
  EXPECT_EQ(c1(randn_on({2, 3, 11}, 2, dev)).sizes(), (Shape{2, 5, 11}));
  Conv3d c3(2, 3, {1, 3, 3}, {1}, {0, 1, 1}, {1}, 1, true, dev);
  EXPECT_EQ(c3(randn_on({1, 2, 4, 5, 6}, 3, dev)).sizes(), (Shape{1, 3, 4, 5, 6}));
  std::ostringstream s;
  s << conv;
  EXPECT_NE(s.str().find("Conv2d(4, 6, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1), groups=2)"),
            std::string::npos)
      << s.str();
  expect_error([&] { Conv2d bad(4, 6, {3}, {1}, {0}, {1}, 3); }, {"Conv", "groups=3"});
}

TEST(NnConvModule, GradientsThroughParameters) {
  Conv2d conv(2, 3, {2, 3}, {1, 2}, {1, 0}, {1}, 1, true, DType::f64);
  EXPECT_TRUE(module_gradcheck(conv, randn_on({1, 2, 4, 5}, 4, DType::f64), [&](const Tensor& x) { return conv(x); }));
  ConvTranspose2d t(2, 2, {2}, {2}, {0}, {1}, 2, true, {1}, DType::f64);
  EXPECT_TRUE(module_gradcheck(t, randn_on({1, 2, 3, 2}, 5, DType::f64), [&](const Tensor& x) { return t(x); }));
}

TEST(NnConvModule, Conv2dLoraMergedEqualsUnmergedAndSavesAdapterOnly) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Sequential seq;
  auto conv = std::make_shared<Conv2d>(3, 4, Shape{3}, Shape{1}, F::Padding{1}, Shape{1}, 1, true, dev);
  seq.push_back(conv);
  apply_lora(seq, {.rank = 2, .alpha = 4.0}, {"0"});
  ASSERT_TRUE(conv->has_lora());
  EXPECT_FALSE(conv->weight().requires_grad());
  EXPECT_EQ(conv->lora_A()->weight().sizes(), (Shape{2, 3, 3, 3}));
  EXPECT_EQ(conv->lora_B()->weight().sizes(), (Shape{4, 2, 1, 1}));
  // B starts at zero: give it values so that merging changes the weight.
  {
    NoGradGuard ng;
    Tensor b = conv->lora_B()->weight();
    b.copy_(randn_on(b.sizes(), 6, dev));
  }
  const Tensor x = randn_on({2, 3, 6, 5}, 7, dev);
  seq.eval();
  const Tensor unmerged = seq(x);
  const Tensor base = F::conv2d(x, conv->weight(), conv->bias(), {1}, {1});
  EXPECT_GT((unmerged - base).abs().max().item<double>(), 1e-3);  // the adapter contributes
  conv->merge();
  EXPECT_TRUE(all_close(seq(x), unmerged, 1e-4, 1e-4));
  conv->unmerge();
  EXPECT_TRUE(all_close(seq(x), unmerged, 1e-5, 1e-5));
  // Frozen base: no gradient buffer; the adapter trains.
  seq.train();
  Gradients g = seq(x).sum().backward();
  EXPECT_FALSE(g.contains(conv->weight()));
  EXPECT_TRUE(g.get(conv->lora_A()->weight()).defined());
  EXPECT_TRUE(g.get(conv->lora_B()->weight()).defined());
  const StateDict sd = lora_state_dict(seq);
  EXPECT_EQ(sd.keys(), (std::vector<std::string>{"base_model.model.0.lora_A.weight", "base_model.model.0.lora_B.weight"}));
  expect_error([&] { Conv2d(3, 4, Shape{3}).add_lora({.use_dora = true}); }, {"add_lora", "DoRA"});
}

// ---- normalisation ----
TEST(NnNormModule, NamesDefaultsAndForward) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  LayerNorm ln({6}, 1e-5, true, true, dev);
  EXPECT_EQ(names_of(ln), (std::vector<std::string>{"weight", "bias"}));
  {
    NoGradGuard ng;
    Tensor w = ln.weight();
    w.copy_(randn_on({6}, 8, dev));
  }
  const Tensor x = randn_on({3, 4, 6}, 9, dev);
  EXPECT_TRUE(all_close(ln(x), F::layer_norm(x, {6}, ln.weight(), ln.bias(), 1e-5), 1e-6, 1e-6));
  RMSNorm rms({6}, std::nullopt, true, dev);
  EXPECT_EQ(names_of(rms), (std::vector<std::string>{"weight"}));
  EXPECT_TRUE(all_close(rms(x), F::rms_norm(x, {6}, rms.weight()), 1e-6, 1e-6));
  GroupNorm gn(2, 4, 1e-5, true, dev);
  const Tensor xi = randn_on({2, 4, 3, 3}, 10, dev);
  EXPECT_TRUE(all_close(gn(xi), F::group_norm(xi, 2, gn.weight(), gn.bias()), 1e-6, 1e-6));
  expect_error([&] { gn(randn_on({2, 6, 3}, 11, dev)); }, {"GroupNorm", "4"});
  LayerNorm no_affine({6}, 1e-5, false);
  EXPECT_TRUE(no_affine.parameters().empty());
}

TEST(NnNormModule, BatchNormTrainEvalAndRunningStats) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  BatchNorm2d bn(3, 1e-5, 0.1, true, true, dev);
  EXPECT_EQ(names_of(bn), (std::vector<std::string>{"weight", "bias", "running_mean", "running_var",
                                                     "num_batches_tracked"}));
  EXPECT_EQ(bn.num_batches_tracked().dtype(), DType::i64);
  const Tensor x = randn_on({4, 3, 5, 5}, 12, dev) * 2.0 + 1.0;
  const Tensor y = bn(x);
  // Training: batch statistics, so every channel of y has mean ~0 and variance ~1.
  const Tensor m = y.mean({0, 2, 3});
  EXPECT_LT(m.abs().max().item<double>(), 1e-4);
  // Running stats moved 10% of the way from (0, 1) to the batch statistics (unbiased variance).
  const Tensor bm = x.mean({0, 2, 3});
  const Tensor bv = x.var({0, 2, 3}, 1);
  EXPECT_TRUE(all_close(bn.running_mean(), bm * 0.1, 1e-5, 1e-5));
  EXPECT_TRUE(all_close(bn.running_var(), bv * 0.1 + 0.9, 1e-5, 1e-5));
  EXPECT_EQ(bn.num_batches_tracked().item<int64_t>(), 1);
  // Eval: the running statistics.
  bn.eval();
  const Tensor ye = bn(x);
  const Tensor want = (x - bn.running_mean().reshape({1, 3, 1, 1})) /
                      (bn.running_var().reshape({1, 3, 1, 1}) + 1e-5).sqrt();
  EXPECT_TRUE(all_close(ye, want, 1e-5, 1e-5));
  EXPECT_EQ(bn.num_batches_tracked().item<int64_t>(), 1);
  // momentum unset: the cumulative average (after two batches, the mean of the two means).
  BatchNorm1d cum(3, 1e-5, std::nullopt, false, true, dev);
  const Tensor a = randn_on({8, 3}, 13, dev), b = randn_on({8, 3}, 14, dev) + 3.0;
  cum(a);
  cum(b);
  EXPECT_TRUE(all_close(cum.running_mean(), (a.mean({0}) + b.mean({0})) * 0.5, 1e-5, 1e-5));
  expect_error([&] { bn(randn_on({4, 3, 5}, 15, dev)); }, {"BatchNorm2d", "4-d"});
}

TEST(NnNormModule, GradientsThroughParameters) {
  LayerNorm ln({4}, 1e-5, true, true, DType::f64);
  EXPECT_TRUE(module_gradcheck(ln, randn_on({3, 4}, 16, DType::f64), [&](const Tensor& x) { return ln(x); }));
  GroupNorm gn(2, 4, 1e-5, true, DType::f64);
  EXPECT_TRUE(module_gradcheck(gn, randn_on({2, 4, 3}, 17, DType::f64), [&](const Tensor& x) { return gn(x); }));
  BatchNorm1d bn(3, 1e-5, 0.1, true, true, DType::f64);
  EXPECT_TRUE(module_gradcheck(bn, randn_on({5, 3}, 18, DType::f64), [&](const Tensor& x) { return bn(x); }));
}

// ---- pooling ----
TEST(NnPoolModule, ForwardEqualsFunctional) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = randn_on({2, 3, 9, 8}, 19, dev);
  EXPECT_TRUE(all_close(MaxPool2d(3, 2, 1)(x), F::max_pool2d(x, 3, 2, 1), 0, 0));
  EXPECT_TRUE(all_close(AvgPool2d(F::Size2(2, 3))(x), F::avg_pool2d(x, {2, 3}), 1e-6, 1e-6));
  EXPECT_TRUE(all_close(AdaptiveAvgPool2d(F::Size2(3, 5))(x), F::adaptive_avg_pool2d(x, {3, 5}), 1e-6, 1e-6));
  EXPECT_TRUE(all_close(AdaptiveMaxPool2d(2)(x), F::adaptive_max_pool2d(x, 2), 0, 0));
  const Tensor x1 = x.reshape({2, 3, 72});
  EXPECT_TRUE(all_close(MaxPool1d(4, 3)(x1), F::max_pool1d(x1, 4, 3), 0, 0));
  EXPECT_TRUE(all_close(AvgPool1d(4)(x1), F::avg_pool1d(x1, 4), 1e-6, 1e-6));
  EXPECT_TRUE(all_close(AdaptiveAvgPool1d(5)(x1), F::adaptive_avg_pool1d(x1, 5), 1e-6, 1e-6));
  Upsample up(F::InterpolateOptions().with_scale(2).with_mode("bilinear"));
  EXPECT_EQ(up(x).sizes(), (Shape{2, 3, 18, 16}));
  const Tensor ps = randn_on({2, 8, 3, 3}, 20, dev);
  EXPECT_TRUE(all_close(PixelUnshuffle(2)(PixelShuffle(2)(ps)), ps, 0, 0));
  EXPECT_TRUE(MaxPool2d(3).parameters().empty());
}

// ---- attention ----
TEST(NnMultiheadAttention, NamesAndInitAsPyTorch) {
  MultiheadAttention mha(8, 2);
  EXPECT_EQ(names_of(mha),
            (std::vector<std::string>{"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}));
  EXPECT_EQ(mha.parameter("in_proj_weight").sizes(), (Shape{24, 8}));
  EXPECT_EQ(mha.parameter("in_proj_bias").abs().max().item<double>(), 0.0);
  EXPECT_EQ(mha.out_proj()->bias().abs().max().item<double>(), 0.0);
  // xavier_uniform bound sqrt(6 / (fan_in + fan_out)) = sqrt(6 / 32).
  EXPECT_LE(mha.parameter("in_proj_weight").abs().max().item<double>(), std::sqrt(6.0 / 32.0) + 1e-7);
  MultiheadAttention kv(8, 2, {.kdim = 5, .vdim = 3});
  EXPECT_EQ(names_of(kv), (std::vector<std::string>{"q_proj_weight", "k_proj_weight", "v_proj_weight",
                                                   "in_proj_bias", "out_proj.weight", "out_proj.bias"}));
  expect_error([] { MultiheadAttention(10, 3); }, {"MultiheadAttention", "num_heads=3"});
}

// The module against attention written out with plain ops: projections, per-head softmax, output.
Tensor mha_reference(MultiheadAttention& m, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& add_mask) {
  const int64_t e = m.embed_dim(), h = m.num_heads(), d = e / h;
  const Tensor w = m.parameter("in_proj_weight"), b = m.parameter("in_proj_bias");
  auto proj = [&](const Tensor& x, int64_t i) {
    return x.matmul(w.narrow(0, i * e, e).t()) + b.narrow(0, i * e, e);
  };
  const Tensor qp = proj(q, 0), kp = proj(k, 1), vp = proj(v, 2);  // [N, L, E] (batch_first)
  const int64_t n = q.size(0), l = q.size(1), s = k.size(1);
  auto heads = [&](const Tensor& t, int64_t len) { return t.reshape({n, len, h, d}).transpose(1, 2); };
  Tensor scores = heads(qp, l).matmul(heads(kp, s).transpose(-2, -1)) / std::sqrt(static_cast<double>(d));
  if (add_mask.defined()) scores = scores + add_mask;
  const Tensor o = scores.softmax(-1).matmul(heads(vp, s)).transpose(1, 2).reshape({n, l, e});
  return o.matmul(m.out_proj()->weight().t()) + m.out_proj()->bias();
}

TEST(NnMultiheadAttention, ForwardMatchesReferenceWithMasks) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  MultiheadAttention mha(8, 2, {.batch_first = true}, dev);
  {
    NoGradGuard ng;
    Tensor b = mha.parameter("in_proj_bias");
    b.copy_(randn_on(b.sizes(), 21, dev) * 0.1);
  }
  const Tensor q = randn_on({2, 5, 8}, 22, dev), k = randn_on({2, 7, 8}, 23, dev), v = randn_on({2, 7, 8}, 24, dev);
  EXPECT_TRUE(all_close(mha.attention(q, k, v).first, mha_reference(mha, q, k, v, {}), 1e-5, 1e-5));
  // Bool masks mark keys that may NOT be attended (nn.MultiheadAttention's convention).
  std::vector<bool> pad(14, false);
  pad[6] = pad[13] = true;  // the last key of each batch row is padding
  const Tensor kpm = Tensor::from_vec(pad, {2, 7}).to(dev);
  Tensor add = Tensor::zeros({2, 1, 1, 7}, dev).masked_fill(kpm.reshape({2, 1, 1, 7}), -INFINITY);
  MhaForwardOptions fo;
  fo.key_padding_mask = kpm;
  EXPECT_TRUE(all_close(mha.attention(q, k, v, fo).first, mha_reference(mha, q, k, v, add), 1e-5, 1e-5));
  // need_weights takes the explicit path and must agree; weights average over heads, rows sum to 1.
  fo.need_weights = true;
  auto [out_w, weights] = mha.attention(q, k, v, fo);
  EXPECT_TRUE(all_close(out_w, mha_reference(mha, q, k, v, add), 1e-5, 1e-5));
  EXPECT_EQ(weights.sizes(), (Shape{2, 5, 7}));
  EXPECT_TRUE(all_close(weights.sum({-1}), Tensor::ones({2, 5}, dev), 1e-5, 1e-5));
  EXPECT_LT(weights.narrow(2, 6, 1).abs().max().item<double>(), 1e-7);
  // Causal self-attention equals an explicit upper-triangular -inf mask.
  const Tensor x = randn_on({2, 5, 8}, 25, dev);
  MhaForwardOptions causal;
  causal.is_causal = true;
  const Tensor tri = Tensor::ones({5, 5}, TensorOptions(DType::boolean, dev)).triu(1);
  const Tensor tri_add = Tensor::zeros({5, 5}, dev).masked_fill(tri, -INFINITY);
  EXPECT_TRUE(all_close(mha.attention(x, x, x, causal).first, mha_reference(mha, x, x, x, tri_add), 1e-5, 1e-5));
  // Sequence-first layout (PyTorch's default) gives the same numbers transposed.
  MultiheadAttention seq_first(8, 2, {}, dev);
  seq_first.load_state_dict(mha.state_dict());
  EXPECT_TRUE(all_close(seq_first(x.transpose(0, 1)).transpose(0, 1), mha(x), 1e-5, 1e-5));
}

TEST(NnMultiheadAttention, GradientsThroughParameters) {
  MultiheadAttention mha(4, 2, {.batch_first = true}, DType::f64);
  EXPECT_TRUE(module_gradcheck(mha, randn_on({2, 3, 4}, 26, DType::f64), [&](const Tensor& x) { return mha(x); }));
}

// ---- serialization ----
TEST(NnSerialization, StateDictAndLoraThroughSafetensorsFiles) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  auto make = [&] {
    auto s = std::make_shared<Sequential>();
    s->push_back(std::make_shared<Conv2d>(3, 4, Shape{3}, Shape{1}, F::Padding{1}, Shape{1}, 1, true, dev));
    s->push_back(std::make_shared<BatchNorm2d>(4, 1e-5, 0.1, true, true, dev));
    s->push_back(std::make_shared<Linear>(5, 2, true, dev));
    return s;
  };
  auto a = make(), b = make();
  (*a)[1]->forward(randn_on({2, 4, 3, 3}, 27, dev));  // running stats move away from their init
  const std::string path = temp_path("flame_nn_state");
  save_state_dict(*a, path, {{"format", "pt"}});
  EXPECT_EQ(io::load_safetensors_metadata(path).at("format"), "pt");
  const LoadReport r = load_state_dict(*b, path);
  EXPECT_TRUE(r.ok()) << r.to_string();
  for (const auto& [n, t] : a->state_dict()) EXPECT_TRUE(all_close(b->state_dict().at(n), t, 0, 0)) << n;
  std::filesystem::remove(path);

  apply_lora(*a, {.rank = 2, .alpha = 2.0}, {"0", "2"});
  apply_lora(*b, {.rank = 2, .alpha = 2.0}, {"0", "2"});
  const std::string lpath = temp_path("flame_nn_lora");
  save_lora(*a, lpath);
  const StateDict file = io::load_safetensors(lpath);
  EXPECT_EQ(file.size(), 4u);
  EXPECT_TRUE(file.contains("base_model.model.2.lora_B.weight"));
  EXPECT_TRUE(load_lora(*b, lpath).ok());
  EXPECT_TRUE(all_close(b->state_dict().at("0.lora_A.weight"), a->state_dict().at("0.lora_A.weight"), 0, 0));
  std::filesystem::remove(lpath);
}

}  // namespace
}  // namespace flame::test
