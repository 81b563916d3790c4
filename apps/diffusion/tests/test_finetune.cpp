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
#include <functional>
#include <map>
#include <string>

#include <flame/io/safetensors.h>
#include <flame/nn.h>
#include <flame/optim.h>

#include "model_test_util.h"
#include "models/finetune.h"
#include "models/unet2d_convert.h"

namespace fm = flame_diffusion::models;
namespace nn = flame::nn;
using flame::DType;
using flame::Tensor;

namespace {

std::filesystem::path data_dir() { return std::filesystem::path(__FILE__).parent_path() / "data" / "models"; }

struct Reference {
  flame::StateDict t;
  flame::io::Metadata meta;
  const Tensor& operator[](const std::string& k) const { return t.at(k); }
  std::string step(int i, const std::string& what) const { return "step" + std::to_string(i) + "." + what; }
};

Reference load_reference(const std::string& family) {
  const std::string path = (data_dir() / ("finetune-" + family) / "finetune_reference.safetensors").string();
  return {flame::io::load_safetensors(path, fd_test::test_device()), flame::io::load_safetensors_metadata(path)};
}

// Adds the reference's LoRA to `model`, sets the adapters to the reference's initial values and
// returns AdamW over them with the reference's learning rate (weight decay 1e-2 as the script).
std::unique_ptr<flame::optim::AdamW> init_lora(nn::Module& model, const Reference& r,
                                               const std::function<void(const nn::LoraOptions&)>& add) {
  add({.rank = std::stoll(r.meta.at("rank")), .alpha = std::stod(r.meta.at("alpha"))});
  flame::StateDict init;
  for (const auto& [k, t] : r.t) {
    if (k.rfind("init.", 0) == 0) init.insert(k.substr(5), t);
  }
  nn::load_lora_state_dict(model, init);
  flame::TensorList params;
  for (const Tensor& p : model.parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  return std::make_unique<flame::optim::AdamW>(
      params, flame::optim::AdamW::Options{.lr = std::stod(r.meta.at("lr")), .weight_decay = 1e-2});
}

// Runs the reference's steps with `loss_of(step)`, checking each loss and the final adapters.
void run_steps(nn::Module& model, flame::optim::AdamW& opt, const Reference& r,
               const std::function<Tensor(int)>& loss_of) {
  const std::vector<double> want = r["losses"].to_vec<double>();
  ASSERT_EQ(static_cast<int64_t>(want.size()), std::stoll(r.meta.at("steps")));
  for (int i = 0; i < static_cast<int>(want.size()); ++i) {
    const Tensor loss = loss_of(i);
    const double got = loss.item<double>();
    EXPECT_NEAR(got, want[static_cast<std::size_t>(i)], 1e-5 * std::abs(want[static_cast<std::size_t>(i)]))
        << "step " << i;
    opt.step(loss.backward());
  }
  const flame::StateDict final_lora = nn::lora_state_dict(model);
  int checked = 0;
  for (const auto& [k, t] : r.t) {
    if (k.rfind("final.", 0) != 0) continue;
    const Tensor& got = final_lora.at(std::string(nn::kPeftPrefix) + k.substr(6));
    const double scale = fd_test::max_abs(t), err = fd_test::max_abs_diff(got, t);
    EXPECT_LE(err, 5e-4 * scale + 1e-7) << k << ": max error " << err << " at scale " << scale;
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(final_lora.size())) << "adapters in the reference against the model's";
}

fm::FlowMatchOptions flow_options(const Reference& r) {
  fm::FlowMatchOptions o;
  const std::string s = r.meta.at("sampling"), w = r.meta.at("weighting");
  o.density = s == "logit_normal" ? fm::TimestepDensity::logit_normal
              : s == "mode"       ? fm::TimestepDensity::mode
                                  : fm::TimestepDensity::uniform;
  o.weighting = w == "sigma_sqrt" ? fm::FlowLossWeighting::sigma_sqrt
                : w == "cosmap"   ? fm::FlowLossWeighting::cosmap
                                  : fm::FlowLossWeighting::none;
  o.shift = std::stod(r.meta.at("shift"));
  return o;
}

fm::FlowBatch flow_batch(const Reference& r, int i) {
  return {.latents = r[r.step(i, "latents")],
          .noise = r[r.step(i, "noise")],
          .text = r[r.step(i, "text")],
          .pooled = r[r.step(i, "pooled")],
          .u = r[r.step(i, "u")]};
}

}  // namespace

TEST(Finetune, FluxFlowMatchingFollowsDiffusersLoop) {
  const Reference r = load_reference("flux");
  auto model = fm::load_flux((data_dir() / "flux-tiny" / "transformer").string(), {.device = fd_test::test_device()});
  model->train();
  auto opt = init_lora(*model, r, [&](const nn::LoraOptions& o) { model->add_lora(o); });
  const fm::FlowMatchOptions o = flow_options(r);
  const double guidance = std::stod(r.meta.at("guidance"));
  run_steps(*model, *opt, r, [&](int i) { return fm::flux_flow_loss(*model, o, flow_batch(r, i), guidance); });
}

TEST(Finetune, SD3FlowMatchingFollowsDiffusersLoop) {
  const Reference r = load_reference("sd3");
  auto model = fm::load_sd3((data_dir() / "sd3-tiny" / "transformer").string(), {.device = fd_test::test_device()});
  model->train();
  auto opt = init_lora(*model, r, [&](const nn::LoraOptions& o) { model->add_lora(o); });
  const fm::FlowMatchOptions o = flow_options(r);
  EXPECT_EQ(o.shift, 3.0);  // SD3's scheduler config
  run_steps(*model, *opt, r, [&](int i) { return fm::sd3_flow_loss(*model, o, flow_batch(r, i)); });
}

TEST(Finetune, SDXLDdpmMinSnrFollowsDiffusersLoop) {
  const Reference r = load_reference("sdxl");
  auto model =
      fm::load_unet((data_dir() / "unet2d-tiny-xl" / "unet").string(), {.device = fd_test::test_device()});
  model->train();
  auto opt = init_lora(*model, r, [&](const nn::LoraOptions& o) { model->add_lora(o); });
  fm::DdpmOptions o;
  o.prediction = r.meta.at("prediction") == "v_prediction" ? fm::Prediction::v_prediction : fm::Prediction::epsilon;
  o.snr_gamma = std::stod(r.meta.at("snr_gamma"));
  run_steps(*model, *opt, r, [&](int i) {
    return fm::unet_ddpm_loss(*model, o,
                              {.latents = r[r.step(i, "latents")],
                               .noise = r[r.step(i, "noise")],
                               .text = r[r.step(i, "text")],
                               .timesteps = r[r.step(i, "timesteps")],
                               .added = {.text_embeds = r[r.step(i, "pooled")], .time_ids = r[r.step(i, "time_ids")]}});
  });
}

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
