// The fine-tuning objectives (models/finetune.h) against diffusers' training loops step by step:
// reference/finetune_loop.py trains a PEFT LoRA (r 4, alpha 8, on to_q/k/v/out.0, B seeded) of the
// tiny FLUX, SD3 and SDXL models for 5 AdamW steps on random latents and text states and saves
// every step's inputs and random draws (u or t, noise), the loss of every step and the adapters
// after the last. FLAME runs the same steps from the same files: the losses and the final adapters
// must agree within f32 rounding: relative 1e-5 for the losses (measured: at most 2.4e-7 absolute on
// losses of about 2), 5e-4 of each adapter's largest value for the adapters (measured: 9e-5 at
// worst, an SDXL lora_B whose gradient is near zero, where Adam's normalised step amplifies
// rounding; 3e-6 for every other adapter).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>

#include <flame/io/safetensors.h>
#include <flame/nn.h>
#include <flame/optim.h>

#include "model_test_util.h"
#include "../tools/finetune_replay.h"
#include "models/finetune.h"
#include "models/unet2d_convert.h"

namespace fm = flame_diffusion::models;
namespace nn = flame::nn;
using flame::DType;
using flame::Tensor;

namespace {

std::filesystem::path data_dir() { return std::filesystem::path(__FILE__).parent_path() / "data" / "models"; }

flame_diffusion::tools::FinetuneReference load_reference(const std::string& family) {
  const std::string path = (data_dir() / ("finetune-" + family) / "finetune_reference.safetensors").string();
  return flame_diffusion::tools::load_finetune_reference(path, fd_test::test_device());
}

// Replays the reference's steps on the model in `model_dir`, checking each loss and the final adapters.
void expect_replay_matches(const std::string& family, const std::string& model_dir) {
  const fd_test::ConvTf32Off full_f32;  // SDXL's UNet convolutions on CUDA
  const auto r = load_reference(family);
  const auto run = flame_diffusion::tools::replay_finetune(r, (data_dir() / model_dir).string(), fd_test::test_device());
  const std::vector<double> want = r.t.at("losses").to_vec<double>();
  ASSERT_EQ(run.losses.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(run.losses[i], want[i], 1e-5 * std::abs(want[i])) << "step " << i;
  int checked = 0;
  for (const auto& [k, t] : r.t) {
    if (k.rfind("final.", 0) != 0) continue;
    const Tensor& got = run.adapters.at(k.substr(6));
    const double scale = fd_test::max_abs(t), err = fd_test::max_abs_diff(got, t);
    EXPECT_LE(err, 5e-4 * scale + 1e-7) << k << ": max error " << err << " at scale " << scale;
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(run.adapters.size())) << "adapters in the reference against the model's";
  EXPECT_GT(checked, 0);
}

}  // namespace

TEST(Finetune, FluxFlowMatchingFollowsDiffusersLoop) { expect_replay_matches("flux", "flux-tiny/transformer"); }

// The same loop in the scripts' mixed precision (bf16 weights and autocast, f32 adapters): every
// loss within 1e-3 relative (measured 6.4e-5 at worst) and the adapters' update within 15% of the
// reference's (measured 4.4%; PyTorch's own bf16 loop ends 34% of the update away from its f32 one).
TEST(Finetune, FluxBf16AutocastFollowsDiffusersLoop) {
  const auto r = load_reference("flux-bf16");
  ASSERT_TRUE(r.bf16());
  const auto run = flame_diffusion::tools::replay_finetune(r, (data_dir() / "flux-tiny/transformer").string(),
                                                           fd_test::test_device());
  const std::vector<double> want = r.t.at("losses").to_vec<double>();
  ASSERT_EQ(run.losses.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(run.losses[i], want[i], 1e-3 * std::abs(want[i])) << "step " << i;
  double diff2 = 0, update2 = 0;
  for (const auto& [k, t] : r.t) {
    if (k.rfind("final.", 0) != 0) continue;
    const Tensor ref = t.to(DType::f64), got = run.adapters.at(k.substr(6)).to(DType::f64);
    diff2 += (got - ref).pow(2.0).sum().item<double>();
    update2 += (ref - run.initial.at(k.substr(6)).to(DType::f64)).pow(2.0).sum().item<double>();
  }
  ASSERT_GT(update2, 0.0);
  EXPECT_LE(std::sqrt(diff2 / update2), 0.15);
}

TEST(Finetune, SD3FlowMatchingFollowsDiffusersLoop) {
  EXPECT_EQ(flame_diffusion::tools::finetune_flow_options(load_reference("sd3")).shift, 3.0);  // SD3's scheduler
  expect_replay_matches("sd3", "sd3-tiny/transformer");
}

TEST(Finetune, SDXLDdpmMinSnrFollowsDiffusersLoop) { expect_replay_matches("sdxl", "unet2d-tiny-xl/unet"); }

// The flow-matching pieces on their own: the training table of FlowMatchEulerDiscreteScheduler
// (sigma_i = s((N - i) / N), timestep = sigma N), the SD3 loss weightings, and the densities.
TEST(Finetune, FlowMatchTimestepsAndWeightings) {
  fm::FlowMatchOptions o;
  o.shift = 3.0;
  const Tensor u = Tensor::from_vec(std::vector<float>{0.0f, 0.5f, 0.9995f}, {3});
  const fm::FlowMatchTimesteps t = fm::flow_match_timesteps(o, u);
  const std::vector<float> s = t.sigmas.to_vec<float>(), ts = t.timesteps.to_vec<float>();
  auto shifted = [](double x) { return 3.0 * x / (1.0 + 2.0 * x); };
  EXPECT_NEAR(s[0], 1.0, 1e-7);                     // index 0: sigma 1
  EXPECT_NEAR(s[1], shifted(500.0 / 1000.0), 1e-7);  // index 500: (1000 - 500) / 1000 shifted
  EXPECT_NEAR(s[2], shifted(1.0 / 1000.0), 1e-7);    // index 999: the smallest sigma
  for (int i = 0; i < 3; ++i) EXPECT_FLOAT_EQ(ts[i], s[i] * 1000.0f);
  const std::vector<float> cosmap = fm::flow_loss_weighting(fm::FlowLossWeighting::cosmap, t.sigmas).to_vec<float>();
  const std::vector<float> sq = fm::flow_loss_weighting(fm::FlowLossWeighting::sigma_sqrt, t.sigmas).to_vec<float>();
  for (int i = 0; i < 3; ++i) {
    const double x = s[i];
    EXPECT_NEAR(cosmap[i], 2.0 / (M_PI * (1.0 - 2.0 * x + 2.0 * x * x)), 1e-5 * cosmap[i]);
    EXPECT_NEAR(sq[i], 1.0 / (x * x), 1e-5 * sq[i]);
  }
  EXPECT_NE(fd_test::error_of([&] { fm::flow_match_timesteps(o, Tensor::full({1}, 1.0)); }).find("outside [0, 1)"),
            std::string::npos);
  flame::Generator gen(3);
  for (auto d : {fm::TimestepDensity::logit_normal, fm::TimestepDensity::mode, fm::TimestepDensity::uniform}) {
    o.density = d;
    const std::vector<float> v = fm::sample_timestep_density(o, 4096, gen).to_vec<float>();
    double mean = 0;
    for (float x : v) {
      ASSERT_GE(x, 0.0f);
      ASSERT_LT(x, 1.0f);
      mean += x / v.size();
    }
    EXPECT_NEAR(mean, 0.5, 0.03) << static_cast<int>(d);  // all three are symmetric about 1/2
  }
}

// abar of the scaled-linear schedule: the closed form at both ends and the DDPM loss's input checks.
TEST(Finetune, DdpmScheduleAndBadInput) {
  const std::vector<float> abar = fm::ddpm_alphas_cumprod({}).to_vec<float>();
  ASSERT_EQ(abar.size(), 1000u);
  EXPECT_NEAR(abar[0], 1.0 - 0.00085, 1e-7);
  double acc = 1.0;
  for (int i = 0; i < 1000; ++i) {
    const double r = std::sqrt(0.00085) + (std::sqrt(0.012) - std::sqrt(0.00085)) * i / 999.0;
    acc *= 1.0 - r * r;
  }
  EXPECT_NEAR(abar[999], acc, 1e-5 * acc);  // f32 betas, rounded one by one
  auto model = fm::load_unet((data_dir() / "unet2d-tiny-xl" / "unet").string(), {.device = fd_test::test_device()});
  std::string e = fd_test::error_of([&] {
    (void)fm::unet_ddpm_loss(*model, {}, {.latents = Tensor::zeros({2, 4, 8, 8}), .noise = Tensor::zeros({2, 4, 8, 9})});
  });
  EXPECT_NE(e.find("noise must have the latents' shape"), std::string::npos) << e;
  e = fd_test::error_of([&] {
    (void)fm::unet_ddpm_loss(*model, {},
                             {.latents = Tensor::zeros({2, 4, 8, 8}),
                              .noise = Tensor::zeros({2, 4, 8, 8}),
                              .timesteps = Tensor::from_vec(std::vector<float>{3.0f, 1000.0f}, {2})});
  });
  EXPECT_NE(e.find("timesteps[1] = 1000 is not an integer in [0, 1000)"), std::string::npos) << e;
}
