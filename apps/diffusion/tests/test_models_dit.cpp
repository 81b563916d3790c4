// DiT: shapes, parameter names and counts, adaLN-Zero init, gradient flow, embeddings.
#include <gtest/gtest.h>

#include <chrono>
#include <ctime>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "dit.h"
#include "model_test_util.h"

namespace fd = flame_diffusion;
using flame::DType;
using flame::Tensor;
using fd_test::test_device;

namespace {

// The parameter count of a DiT from its architecture (hidden H, depth D, patch p, channels C,
// classes K, tokens T, frequency width F, MLP ratio 4):
//   x_embedder.proj   H*C*p*p + H
//   pos_embed         T*H
//   t_embedder        F*H + H + H*H + H
//   y_embedder        (K + 1)*H
//   each block        qkv 3H*H + 3H, proj H*H + H, fc1 4H*H + 4H, fc2 4H*H + H,
//                     adaLN 6H*H + 6H   = 18H^2 + 15H
//   final_layer       adaLN 2H*H + 2H, linear H*p*p*C + p*p*C
int64_t dit_param_formula(const fd::DiTConfig& c) {
  const int64_t H = c.hidden, p = c.patch_size, C = c.in_channels, K = c.num_classes, T = c.tokens(),
                F = c.frequency_dim, D = c.depth;
  const int64_t embed = (H * C * p * p + H) + T * H + (F * H + H + H * H + H) + (K + 1) * H;
  const int64_t block = 18 * H * H + 15 * H;
  const int64_t final_layer = (2 * H * H + 2 * H) + (H * p * p * C + p * p * C);
  return embed + D * block + final_layer;
}

std::vector<std::string> expected_dit_keys(int64_t depth) {
  // PyTorch's order: a module's own parameters (pos_embed) first, then its children.
  std::vector<std::string> k = {"pos_embed", "x_embedder.proj.weight", "x_embedder.proj.bias", "t_embedder.mlp.0.weight",
                                "t_embedder.mlp.0.bias",  "t_embedder.mlp.2.weight", "t_embedder.mlp.2.bias",
                                "y_embedder.embedding_table.weight"};
  for (int64_t i = 0; i < depth; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    for (const char* n : {"attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias", "mlp.fc1.weight",
                          "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias", "adaLN_modulation.1.weight",
                          "adaLN_modulation.1.bias"})
      k.push_back(b + n);
  }
  for (const char* n : {"final_layer.linear.weight", "final_layer.linear.bias", "final_layer.adaLN_modulation.1.weight",
                        "final_layer.adaLN_modulation.1.bias"})
    k.push_back(n);
  return k;
}

}  // namespace

TEST(ModelDit, ForwardShapeOnDevice) {
  FD_SKIP_IF_NO_DEVICE();
  const flame::Device dev = test_device();
  auto model = fd::make_model("dit-tiny", 1);
  model->to(dev);
  fd_test::perturb(*model, 0.02, 7);
  flame::Generator gen(3);
  Tensor x = fd_test::rand_images(3, 1, 28, dev, &gen);
  Tensor t = Tensor::rand({3}, {DType::f32, dev}, &gen);
  Tensor y = Tensor::tensor({0, 9, 10}).to(dev);  // 10 = null class
  Tensor out = model->forward(x, t, y);
  EXPECT_EQ(out.sizes(), (flame::Shape{3, 1, 28, 28}));
  EXPECT_EQ(out.device(), dev);
  EXPECT_EQ(out.dtype(), DType::f32);
  EXPECT_TRUE(out.isnan().logical_or(out.isinf()).any().item<bool>() == false);
  EXPECT_GT(fd_test::max_abs(out), 1e-4);  // perturbed weights: a real, non-zero output
}

TEST(ModelDit, ParameterNamesMatchTheReference) {
  for (const char* preset : {"dit-tiny", "dit-s"}) {
    fd::DiT model(fd::dit_config(preset));
    EXPECT_EQ(model.state_dict().keys(), expected_dit_keys(model.config().depth)) << preset;
    // The label table has the null class row; pos_embed is learned.
    EXPECT_EQ(model.y_embedder->embedding_table->weight().size(0), 11);
    EXPECT_TRUE(model.pos_embed.requires_grad());
    EXPECT_EQ(model.pos_embed.sizes(), (flame::Shape{1, 196, model.config().hidden}));
  }
}

TEST(ModelDit, ParameterCountMatchesFormula) {
  for (const char* preset : {"dit-tiny", "dit-s", "dit-b"}) {
    fd::DiT model(fd::dit_config(preset));
    EXPECT_EQ(model.num_parameters(), dit_param_formula(model.config())) << preset;
  }
  // dit-s written out: H = 384, 12 blocks, 28x28x1, patch 2, 10 classes.
  EXPECT_EQ(dit_param_formula(fd::dit_config("dit-s")), 32'544'772);
}

TEST(ModelDit, AdaLnZeroInitGivesExactlyZeroOutput) {
  FD_SKIP_IF_NO_DEVICE();
  const flame::Device dev = test_device();
  auto model = fd::make_model("dit-tiny", 5);
  model->to(dev);
  flame::Generator gen(11);
  Tensor x = fd_test::rand_images(4, 1, 28, dev, &gen);
  Tensor out = model->forward(x, Tensor::rand({4}, {DType::f32, dev}, &gen), fd_test::rand_labels(4, 10, dev, &gen));
  EXPECT_EQ(fd_test::max_abs(out), 0.0);
}

TEST(ModelDit, InitFollowsTheReference) {
  fd::DiT model(fd::dit_config("dit-tiny"), 9);
  const int64_t H = model.config().hidden;
  // Zero-initialised: every adaLN modulation and the final linear.
  for (auto& b : model.blocks) {
    EXPECT_EQ(fd_test::max_abs(b->ada_linear->weight()), 0.0);
    EXPECT_EQ(fd_test::max_abs(b->ada_linear->bias()), 0.0);
  }
  EXPECT_EQ(fd_test::max_abs(model.final_layer->linear->weight()), 0.0);
  EXPECT_EQ(fd_test::max_abs(model.final_layer->ada_linear->weight()), 0.0);
  // Xavier-uniform Linear weights: within the bound, std close to bound / sqrt(3); zero biases.
  const Tensor w = model.blocks[0]->mlp->fc1->weight();
  const double bound = std::sqrt(6.0 / static_cast<double>(H + 4 * H));
  EXPECT_LE(fd_test::max_abs(w), bound);
  EXPECT_NEAR(w.std().item<double>(), bound / std::sqrt(3.0), 0.05 * bound);
  EXPECT_EQ(fd_test::max_abs(model.blocks[0]->mlp->fc1->bias()), 0.0);
  // Patch embedding as a [H, C*p*p] matrix.
  const double pbound = std::sqrt(6.0 / static_cast<double>(4 + H));
  EXPECT_LE(fd_test::max_abs(model.x_embedder->proj->weight()), pbound);
  EXPECT_GT(fd_test::max_abs(model.x_embedder->proj->weight()), 0.8 * pbound);
  // N(0, 0.02) label table and timestep MLP weights.
  EXPECT_NEAR(model.y_embedder->embedding_table->weight().std().item<double>(), 0.02, 0.004);
  EXPECT_NEAR(model.t_embedder->fc1->weight().std().item<double>(), 0.02, 0.002);
  // pos_embed starts at the sin-cos table.
  EXPECT_EQ(fd_test::max_abs_diff(model.pos_embed.squeeze(0), fd::sincos_2d_pos_embed(H, 14)), 0.0);
  // The same seed gives the same weights; another seed different ones.
  fd::DiT same(fd::dit_config("dit-tiny"), 9), other(fd::dit_config("dit-tiny"), 10);
  EXPECT_EQ(fd_test::max_abs_diff(same.blocks[1]->attn->qkv->weight(), model.blocks[1]->attn->qkv->weight()), 0.0);
  EXPECT_GT(fd_test::max_abs_diff(other.blocks[1]->attn->qkv->weight(), model.blocks[1]->attn->qkv->weight()), 0.0);
}

TEST(ModelDit, GradientReachesEveryParameter) {
  FD_SKIP_IF_NO_DEVICE();
  const flame::Device dev = test_device();
  fd::DiT model(fd::dit_config("dit-tiny"), 2);
  model.to(dev);
  flame::Generator gen(4);
  Tensor x = fd_test::rand_images(4, 1, 28, dev, &gen);
  Tensor t = Tensor::rand({4}, {DType::f32, dev}, &gen);
  Tensor y = fd_test::rand_labels(4, 10, dev, &gen);
  Tensor target = Tensor::randn({4, 1, 28, 28}, 0.0, 1.0, {DType::f32, dev}, &gen);
  auto named = model.named_parameters();
  for (int step = 0; step < 3; ++step) {
    flame::Gradients g = (model.forward(x, t, y) - target).square().mean().backward();
    for (auto& [name, p] : named) {
      Tensor gr = g.get(p);
      ASSERT_TRUE(gr.defined()) << name;
      const bool nonzero = fd_test::max_abs(gr) > 0.0;
      // adaLN-Zero: at the first step only the final linear sees a gradient (everything else is
      // behind a zero weight or a zero gate); the modulations open up on the next steps.
      if (step == 0) {
        EXPECT_EQ(nonzero, name.rfind("final_layer.linear.", 0) == 0) << name;
      } else if (step == 2) {
        EXPECT_TRUE(nonzero) << name << " has a zero gradient after two SGD steps";
      }
    }
    fd_test::sgd_step(model, g, 0.1);
  }
  // Every zero-initialised tensor has left zero.
  for (auto& b : model.blocks) EXPECT_GT(fd_test::max_abs(b->ada_linear->weight()), 0.0);
  EXPECT_GT(fd_test::max_abs(model.final_layer->linear->weight()), 0.0);
}

TEST(ModelDit, TimestepEmbeddingClosedForm) {
  Tensor t = Tensor::tensor({0.0, 1.0, 250.5, 999.0});
  Tensor e = fd::timestep_embedding(t, 256);
  ASSERT_EQ(e.sizes(), (flame::Shape{4, 256}));
  const std::vector<float> v = e.to_vec<float>();
  const double tv[4] = {0.0, 1.0, 250.5, 999.0};
  for (int b = 0; b < 4; ++b) {
    for (int i : {0, 1, 17, 127}) {
      const double f = std::exp(-std::log(10000.0) * i / 128.0);
      EXPECT_NEAR(v[b * 256 + i], std::cos(tv[b] * f), 2e-4) << b << "," << i;
      EXPECT_NEAR(v[b * 256 + 128 + i], std::sin(tv[b] * f), 2e-4) << b << "," << i;
    }
  }
  EXPECT_EQ(fd::timestep_embedding(t, 7).size(1), 7);  // odd width: a zero column appended
  EXPECT_EQ(fd::timestep_embedding(t, 7).select(1, 6).abs().max().item<float>(), 0.0f);
}

TEST(ModelDit, SinCosTableClosedForm) {
  const int64_t dim = 16, g = 5;
  Tensor table = fd::sincos_2d_pos_embed(dim, g);
  ASSERT_EQ(table.sizes(), (flame::Shape{25, 16}));
  const std::vector<float> v = table.to_vec<float>();
  for (int64_t r = 0; r < g; ++r) {
    for (int64_t c = 0; c < g; ++c) {
      const float* row = v.data() + (r * g + c) * dim;
      for (int64_t k = 0; k < 4; ++k) {
        const double w = std::pow(10000.0, -static_cast<double>(k) / 4.0);
        EXPECT_NEAR(row[k], std::sin(c * w), 1e-6);       // column coordinate first
        EXPECT_NEAR(row[4 + k], std::cos(c * w), 1e-6);
        EXPECT_NEAR(row[8 + k], std::sin(r * w), 1e-6);   // then the row
        EXPECT_NEAR(row[12 + k], std::cos(r * w), 1e-6);
      }
    }
  }
  EXPECT_THROW(fd::sincos_2d_pos_embed(10, 3), flame::Error);
}

TEST(ModelDit, UnpatchifyInvertsPatchify) {
  fd::DiT model(fd::dit_config("dit-tiny"));
  flame::Generator gen(8);
  Tensor img = Tensor::randn({2, 1, 28, 28}, 0.0, 1.0, {}, &gen);
  // Patchify by hand: token (i, j) holds rows 2i..2i+1, cols 2j..2j+1, channel fastest.
  Tensor tokens = img.reshape({2, 1, 14, 2, 14, 2}).permute({0, 2, 4, 3, 5, 1}).reshape({2, 196, 4});
  EXPECT_EQ(fd_test::max_abs_diff(model.unpatchify(tokens), img), 0.0);
  // And token 15 = (row 1, col 1) is the pixel block at rows 2..3, cols 2..3.
  const std::vector<float> tk = tokens.select(1, 15).to_vec<float>();
  const std::vector<float> im = img.to_vec<float>();
  EXPECT_EQ(tk[0], im[2 * 28 + 2]);
  EXPECT_EQ(tk[1], im[2 * 28 + 3]);
  EXPECT_EQ(tk[2], im[3 * 28 + 2]);
  EXPECT_EQ(tk[3], im[3 * 28 + 3]);
}

// DiT::forward fuses each residual update with the norm that reads it
// (F::gated_residual_modulate): the result is that of the blocks' own forwards in turn.
TEST(ModelDit, ForwardEqualsBlockByBlock) {
  fd::DiT model(fd::dit_config("dit-tiny"));
  model.to(DType::f64);
  flame::Generator gen(12);
  const Tensor x = Tensor::randn({2, 1, 28, 28}, 0.0, 1.0, {DType::f64}, &gen);
  const Tensor t = Tensor::rand({2}, {DType::f64}, &gen), y = Tensor::tensor({3, 7});
  // Non-zero modulations (the init zeroes them, which would hide the gates and shifts).
  flame::NoGradGuard no_grad;
  auto randomise = [&](const Tensor& w) { Tensor(w).copy_(Tensor::randn(w.sizes(), 0.0, 0.05, {DType::f64}, &gen)); };
  for (auto& blk : model.blocks) randomise(blk->ada_linear->weight());
  randomise(model.final_layer->ada_linear->weight());
  randomise(model.final_layer->linear->weight());  // zero at init, which would hide everything before it
  const Tensor got = model.forward(x, t, y);
  Tensor h = model.x_embedder->forward(x) + model.pos_embed;
  const Tensor c = model.t_embedder->forward(t.to(DType::f32) * model.config().time_scale) + model.y_embedder->forward(y);
  for (auto& blk : model.blocks) h = blk->forward(h, c);
  const Tensor want = model.unpatchify(model.final_layer->forward(h, c));
  EXPECT_LT(fd_test::max_abs_diff(got, want), 1e-12);
}

// PatchEmbed computes its convolution (kernel = stride = patch) as a GEMM over gathered patches:
// the same tokens and the same gradients as F::conv2d flattened to tokens, in f64.
TEST(ModelDit, PatchEmbedEqualsItsConvolution) {
  namespace F = flame::nn::functional;
  flame::manual_seed(5);
  fd::PatchEmbed pe(3, 16, 2);
  pe.to(DType::f64);
  flame::Generator gen(9);
  const Tensor x = Tensor::randn({2, 3, 8, 6}, 0.0, 1.0, {DType::f64}, &gen).requires_grad_(true);
  const Tensor dy = Tensor::randn({2, 12, 16}, 0.0, 1.0, {DType::f64}, &gen);
  const Tensor w = pe.proj->weight(), b = pe.proj->bias();
  const Tensor got = pe.forward(x);
  const Tensor want = F::conv2d(x, w, b, {2, 2}).flatten(2).transpose(1, 2);
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_LT(fd_test::max_abs_diff(got, want), 1e-12);
  flame::BackwardOptions o;
  o.grad_output = dy;
  flame::Gradients g1 = got.backward(o), g2 = want.backward(o);
  for (const Tensor& t : {x, w, b}) EXPECT_LT(fd_test::max_abs_diff(g1.get(t), g2.get(t)), 1e-12);
  EXPECT_THROW(pe.forward(Tensor::zeros({2, 3, 7, 6}, {DType::f64})), flame::Error);  // not whole patches
}

TEST(ModelDit, BadInputsRaiseClearErrors) {
  auto model = fd::make_model("dit-tiny");
  Tensor x = Tensor::zeros({2, 1, 28, 28}), t = Tensor::zeros({2}), y = Tensor::tensor({1, 2});
  EXPECT_NO_THROW(model->forward(x, t, y));
  EXPECT_THROW(model->forward(Tensor::zeros({2, 3, 28, 28}), t, y), flame::Error);
  EXPECT_THROW(model->forward(Tensor::zeros({2, 1, 32, 32}), t, y), flame::Error);
  EXPECT_THROW(model->forward(x, Tensor::zeros({3}), y), flame::Error);
  EXPECT_THROW(model->forward(x, t, Tensor::tensor({1, 11})), flame::Error);  // past the null class
  EXPECT_THROW(model->forward(x, t, Tensor::tensor({-1, 0})), flame::Error);
  EXPECT_THROW(model->forward(x, t, Tensor::zeros({2})), flame::Error);       // float labels
  try {
    fd::make_model("dit-xl");
    FAIL() << "no error";
  } catch (const flame::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dit-tiny"), std::string::npos) << e.what();
  }
}

TEST(ModelDit, DropLabelsUsesTheNullClass) {
  flame::Generator gen(1);
  Tensor y = Tensor::randint(0, 10, {4000}, {}, &gen);
  flame::Generator g1(42), g2(42);
  Tensor a = fd::drop_labels(y, 0.1, 10, &g1), b = fd::drop_labels(y, 0.1, 10, &g2);
  EXPECT_EQ(fd_test::max_abs_diff(a, b), 0.0);  // same seed, same mask
  const std::vector<int64_t> av = a.to_vec<int64_t>(), yv = y.to_vec<int64_t>();
  int64_t dropped = 0;
  for (std::size_t i = 0; i < av.size(); ++i) {
    if (av[i] == 10) ++dropped;
    else EXPECT_EQ(av[i], yv[i]);
  }
  EXPECT_NEAR(static_cast<double>(dropped) / 4000.0, 0.1, 0.02);
  EXPECT_EQ(fd_test::max_abs_diff(fd::drop_labels(y, 0.0, 10, &g1), y), 0.0);
  EXPECT_EQ(fd::drop_labels(y, 1.0, 10, &g1).min().item<int64_t>(), 10);
}

// Step time of the tiny presets on this machine's CPU (the CPU demo's budget); prints, asserts a
// generous ceiling so a pathological slowdown shows.
TEST(ModelDit, TinyTrainStepTimeOnCpu) {
  if (test_device().is_cuda()) GTEST_SKIP() << "CPU timing only";
  for (const char* preset : {"dit-tiny", "unet-tiny"}) {
    auto model = fd::make_model(preset, 1);
    flame::Generator gen(2);
    const int64_t batch = 32;
    Tensor x = fd_test::rand_images(batch, 1, 28, flame::Device::cpu(), &gen);
    Tensor t = Tensor::rand({batch}, {}, &gen), y = fd_test::rand_labels(batch, 10, flame::Device::cpu(), &gen);
    Tensor target = Tensor::randn({batch, 1, 28, 28}, 0.0, 1.0, {}, &gen);
    // Wall time depends on the machine's load; the process CPU time (all threads) is what an
    // unloaded machine would spend.
    double best = 1e9, best_cpu = 1e9;
    for (int i = 0; i < 3; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      const std::clock_t c0 = std::clock();
      flame::Gradients g = (model->forward(x, t, y) - target).square().mean().backward();
      fd_test::sgd_step(*model, g, 1e-3);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      best_cpu = std::min(best_cpu, static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC);
    }
    std::printf("%s: %lld parameters, train step (batch %lld, CPU): wall %.3f s, CPU time %.3f s\n", preset,
                static_cast<long long>(model->num_parameters()), static_cast<long long>(batch), best, best_cpu);
    EXPECT_LT(best, 60.0) << preset;
  }
}
