// UNet: shapes, parameter names and counts, zero output at init, gradient flow; CUDA vs CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "dit.h"
#include "model_test_util.h"
#include "unet.h"

namespace fd = flame_diffusion;
using flame::DType;
using flame::Tensor;
using fd_test::test_device;

namespace {

// The UNet's parameter count from its architecture (E = emb_dim, F = frequency width, K classes,
// C_i = base * mult_i, L levels):
//   embedders   F*E + E + E*E + E + (K + 1)*E
//   ResBlock(a -> b)   GroupNorms 2a + 2b, conv1 9ab + b, emb_proj E*b + b, conv2 9b^2 + b,
//                      skip a*b + b when a != b
//   AttnBlock(c)       GroupNorm 2c, qkv 3c^2 + 3c, proj c^2 + c
//   conv_in 9*in*C_0 + C_0; each down/upsampler 9c^2 + c; norm_out 2C_0; conv_out 9*C_0*in + in
int64_t res_params(int64_t a, int64_t b, int64_t e) {
  return 2 * a + 2 * b + (9 * a * b + b) + (e * b + b) + (9 * b * b + b) + (a != b ? a * b + b : 0);
}

int64_t unet_param_formula(const fd::UNetConfig& c) {
  const int64_t E = c.emb_dim, F = c.frequency_dim, K = c.num_classes, in = c.in_channels;
  const int64_t L = static_cast<int64_t>(c.channel_mult.size());
  std::vector<int64_t> ch;
  for (int64_t m : c.channel_mult) ch.push_back(c.base_channels * m);
  int64_t n = F * E + E + E * E + E + (K + 1) * E;
  n += 9 * in * ch[0] + ch[0];
  int64_t cur = ch[0];
  for (int64_t i = 0; i < L; ++i) {
    n += res_params(cur, ch[i], E);
    cur = ch[i];
    if (i + 1 < L) n += 9 * cur * cur + cur;
  }
  n += 2 * res_params(cur, cur, E) + (2 * cur + 3 * cur * cur + 3 * cur + cur * cur + cur);
  for (int64_t j = 0; j < L; ++j) {
    const int64_t out = ch[L - 1 - j];
    n += res_params(cur + out, out, E);
    cur = out;
    if (j + 1 < L) n += 9 * cur * cur + cur;
  }
  n += 2 * cur + 9 * cur * in + in;
  return n;
}

}  // namespace

TEST(ModelUnet, ForwardShapeOnDevice) {
  FD_SKIP_IF_NO_DEVICE();
  const flame::Device dev = test_device();
  for (const char* preset : {"unet-tiny", "unet-s"}) {
    auto model = fd::make_model(preset, 1);
    model->to(dev);
    fd_test::perturb(*model, 0.02, 3);
    flame::Generator gen(5);
    Tensor x = fd_test::rand_images(2, 1, 28, dev, &gen);
    Tensor out = model->forward(x, Tensor::rand({2}, {DType::f32, dev}, &gen), Tensor::tensor({3, 10}).to(dev));
    EXPECT_EQ(out.sizes(), (flame::Shape{2, 1, 28, 28})) << preset;
    EXPECT_GT(fd_test::max_abs(out), 1e-4) << preset;
    EXPECT_FALSE(out.isnan().any().item<bool>()) << preset;
  }
}

TEST(ModelUnet, ParameterNamesAndCount) {
  for (const char* preset : {"unet-tiny", "unet-s"}) {
    fd::UNet model(fd::unet_config(preset));
    EXPECT_EQ(model.num_parameters(), unet_param_formula(model.config())) << preset;
    const std::vector<std::string> keys = model.state_dict().keys();
    for (const char* k : {"t_embedder.mlp.0.weight", "t_embedder.mlp.2.bias", "y_embedder.embedding_table.weight",
                          "conv_in.weight", "down_blocks.0.norm1.weight", "down_blocks.0.conv1.weight",
                          "down_blocks.0.emb_proj.weight", "down_blocks.1.skip.weight", "downsamplers.0.weight",
                          "downsamplers.1.bias", "mid_block1.conv2.weight", "mid_attn.norm.weight", "mid_attn.qkv.weight",
                          "mid_attn.proj.bias", "mid_block2.norm2.bias", "up_blocks.0.skip.weight",
                          "up_blocks.2.conv1.weight", "upsamplers.0.weight", "upsamplers.1.weight", "norm_out.weight",
                          "conv_out.weight", "conv_out.bias"}) {
      EXPECT_NE(std::find(keys.begin(), keys.end(), k), keys.end()) << preset << ": no " << k;
    }
    EXPECT_EQ(std::find(keys.begin(), keys.end(), "down_blocks.0.skip.weight"), keys.end());  // 1x1 only when C changes
    EXPECT_EQ(std::find(keys.begin(), keys.end(), "downsamplers.2.weight"), keys.end());
    EXPECT_EQ(model.y_embedder->embedding_table->weight().size(0), 11);
  }
  // unet-s written out (base 64, mult 1-2-4, emb 256): the formula above gives
  EXPECT_EQ(unet_param_formula(fd::unet_config("unet-s")), 7'972'801);
}

TEST(ModelUnet, ZeroOutputAtInitAndGradientFlow) {
  FD_SKIP_IF_NO_DEVICE();
  const flame::Device dev = test_device();
  fd::UNet model(fd::unet_config("unet-tiny"), 4);
  model.to(dev);
  flame::Generator gen(6);
  Tensor x = fd_test::rand_images(3, 1, 28, dev, &gen);
  Tensor t = Tensor::rand({3}, {DType::f32, dev}, &gen);
  Tensor y = fd_test::rand_labels(3, 10, dev, &gen);
  EXPECT_EQ(fd_test::max_abs(model.forward(x, t, y)), 0.0);  // conv_out starts at zero
  Tensor target = Tensor::randn({3, 1, 28, 28}, 0.0, 1.0, {DType::f32, dev}, &gen);
  auto named = model.named_parameters();
  for (int step = 0; step < 2; ++step) {
    flame::Gradients g = (model.forward(x, t, y) - target).square().mean().backward();
    for (auto& [name, p] : named) {
      Tensor gr = g.get(p);
      ASSERT_TRUE(gr.defined()) << name;
      const bool nonzero = fd_test::max_abs(gr) > 0.0;
      if (step == 0) EXPECT_EQ(nonzero, name.rfind("conv_out.", 0) == 0) << name;
      else EXPECT_TRUE(nonzero) << name << " has a zero gradient after one SGD step";
    }
    fd_test::sgd_step(model, g, 0.1);
  }
}

TEST(ModelUnet, SameSeedSameWeights) {
  fd::UNet a(fd::unet_config("unet-tiny"), 12), b(fd::unet_config("unet-tiny"), 12), c(fd::unet_config("unet-tiny"), 13);
  EXPECT_EQ(fd_test::max_abs_diff(a.mid_attn->qkv->weight(), b.mid_attn->qkv->weight()), 0.0);
  EXPECT_GT(fd_test::max_abs_diff(a.mid_attn->qkv->weight(), c.mid_attn->qkv->weight()), 0.0);
  // PyTorch's default conv init: |w| <= 1/sqrt(fan_in).
  const Tensor w = a.down_blocks[1]->conv1->weight();
  EXPECT_LE(fd_test::max_abs(w), 1.0 / std::sqrt(static_cast<double>(w.size(1) * 9)));
}

TEST(ModelUnet, BadConfigsRaise) {
  fd::UNetConfig c = fd::unet_config("unet-tiny");
  c.groups = 7;
  EXPECT_THROW(fd::UNet{c}, flame::Error);
  c = fd::unet_config("unet-tiny");
  c.image_size = 30;  // not divisible by 4 for three levels
  EXPECT_THROW(fd::UNet{c}, flame::Error);
  EXPECT_THROW(fd::unet_config("unet-xl"), flame::Error);
  auto m = fd::make_model("unet-tiny");
  EXPECT_THROW(m->forward(Tensor::zeros({1, 1, 14, 14}), Tensor::zeros({1}), Tensor::tensor({0})), flame::Error);
}

// CUDA forward against the CPU on the same weights and inputs (skips without a GPU). f32 convs may
// use TF32 on the GPU (docs/nn-conv.md), so the tolerance is relative to the output's scale.
TEST(ModelCuda, ForwardMatchesCpu) {
  if (!flame::cuda_is_available()) GTEST_SKIP() << "no CUDA device: CUDA case skipped";
  for (const char* preset : {"dit-tiny", "dit-s", "unet-tiny", "unet-s"}) {
    auto cpu = fd::make_model(preset, 21);
    fd_test::perturb(*cpu, 0.02, 22);
    auto gpu = fd::make_model(preset, 0);
    gpu->load_state_dict(cpu->state_dict());
    gpu->to(flame::Device::cuda());
    flame::Generator gen(23);
    Tensor x = fd_test::rand_images(4, 1, 28, flame::Device::cpu(), &gen);
    Tensor t = Tensor::rand({4}, {}, &gen);
    Tensor y = Tensor::tensor({0, 4, 9, 10});
    Tensor ref = cpu->forward(x, t, y);
    Tensor out = gpu->forward(x.to(flame::Device::cuda()), t.to(flame::Device::cuda()), y.to(flame::Device::cuda()));
    const double scale = fd_test::max_abs(ref);
    ASSERT_GT(scale, 1e-3) << preset;
    EXPECT_LT(fd_test::max_abs_diff(out.to(flame::Device::cpu()), ref), 5e-3 * scale) << preset;
  }
}

// A model converted to bf16 runs end to end (the timestep table follows the weights' dtype) and
// stays close to its f32 self.
TEST(ModelBf16, ForwardFollowsF32) {
  FD_SKIP_IF_NO_DEVICE();
  const flame::Device dev = test_device();
  for (const char* preset : {"dit-tiny", "unet-tiny"}) {
    auto f32 = fd::make_model(preset, 31);
    fd_test::perturb(*f32, 0.02, 32);
    auto bf16 = fd::make_model(preset, 0);
    bf16->load_state_dict(f32->state_dict());
    f32->to(dev);
    bf16->to(DType::bf16, dev);
    flame::Generator gen(33);
    Tensor x = fd_test::rand_images(2, 1, 28, dev, &gen);
    Tensor t = Tensor::rand({2}, {DType::f32, dev}, &gen);
    Tensor y = Tensor::tensor({1, 10}).to(dev);
    flame::NoGradGuard no_grad;
    Tensor ref = f32->forward(x, t, y);
    Tensor out = bf16->forward(x.to(DType::bf16), t, y);
    EXPECT_EQ(out.dtype(), DType::bf16) << preset;
    const double scale = fd_test::max_abs(ref);
    ASSERT_GT(scale, 1e-3) << preset;
    EXPECT_LT(fd_test::max_abs_diff(out.to(DType::f32), ref), 0.1 * scale) << preset;
  }
}
