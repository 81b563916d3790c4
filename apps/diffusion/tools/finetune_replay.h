#pragma once
// Replays a diffusers + PEFT LoRA training loop (reference/finetune_loop.py) with FLAME's
// objectives (models/finetune.h): the same model file, initial adapters, inputs and random draws,
// AdamW as the script (torch defaults, weight decay 1e-2), bf16 autocast with f32 adapters when
// the reference trained in bf16. Used by finetune_parity and Finetune.* (diffusion_tests).
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <flame/amp.h>
#include <flame/flame.h>
#include <flame/io/safetensors.h>
#include <flame/nn.h>
#include <flame/optim.h>

#include "models/finetune.h"
#include "models/unet2d_convert.h"

namespace flame_diffusion::tools {

struct FinetuneReference {
  flame::StateDict t;
  flame::io::Metadata meta;
  const flame::Tensor& at(int step, const std::string& what) const {
    return t.at("step" + std::to_string(step) + "." + what);
  }
  std::string family() const { return meta.at("family"); }
  bool bf16() const { return meta.count("dtype") && meta.at("dtype") == "bf16"; }
};

inline FinetuneReference load_finetune_reference(const std::string& path, flame::Device device) {
  return {flame::io::load_safetensors(path, device), flame::io::load_safetensors_metadata(path)};
}

struct FinetuneReplay {
  std::vector<double> losses;   // FLAME's loss at every step
  flame::StateDict initial;     // the adapters before the first step (PEFT names, no prefix)
  flame::StateDict adapters;    // after the last step (PEFT names, no prefix)
};

inline models::FlowMatchOptions finetune_flow_options(const FinetuneReference& r) {
  namespace fm = models;
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

// Runs every step of `r` on the model in `model_dir` (a diffusers folder or any file its loader
// reads) on `device`.
inline FinetuneReplay replay_finetune(const FinetuneReference& r, const std::string& model_dir, flame::Device device) {
  namespace fm = models;
  namespace nn = flame::nn;
  using flame::DType;
  using flame::Tensor;
  const std::string family = r.family();
  const DType wdt = r.bf16() ? DType::bf16 : DType::f32;
  const nn::LoraOptions lora{.rank = std::stoll(r.meta.at("rank")), .alpha = std::stod(r.meta.at("alpha"))};
  std::shared_ptr<fm::FluxTransformer2DModel> flux;
  std::shared_ptr<fm::SD3Transformer2DModel> sd3;
  std::shared_ptr<fm::UNet2DConditionModel> unet;
  nn::Module* model = nullptr;
  if (family == "flux") {
    flux = fm::load_flux(model_dir, {.device = device, .dtype = wdt});
    flux->add_lora(lora);
    model = flux.get();
  } else if (family == "sd3") {
    sd3 = fm::load_sd3(model_dir, {.device = device, .dtype = wdt});
    sd3->add_lora(lora);
    model = sd3.get();
  } else if (family == "sdxl") {
    unet = fm::load_unet(model_dir, {.device = device, .dtype = wdt});
    unet->add_lora(lora);
    model = unet.get();
  } else {
    FLAME_FAIL("replay_finetune", "the reference's family '", family, "' is not flux, sd3 or sdxl");
  }
  model->train();
  FinetuneReplay out;
  for (const auto& [k, t] : r.t) {
    if (k.rfind("init.", 0) == 0) out.initial.insert(k.substr(5), t.to(DType::f32));
  }
  for (const auto& m : model->modules()) {  // f32 adapters, as the script's
    if (auto* lin = dynamic_cast<nn::Linear*>(m.get()); lin && lin->has_lora()) {
      lin->lora_A()->to(DType::f32);
      lin->lora_B()->to(DType::f32);
    }
  }
  nn::load_lora_state_dict(*model, out.initial);
  flame::TensorList params;
  for (const Tensor& p : model->parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  flame::optim::AdamW opt(params, {.lr = std::stod(r.meta.at("lr")), .weight_decay = 1e-2});
  const fm::FlowMatchOptions flow = family == "sdxl" ? fm::FlowMatchOptions{} : finetune_flow_options(r);
  fm::DdpmOptions ddpm;
  if (family == "sdxl") {
    ddpm.prediction = r.meta.at("prediction") == "v_prediction" ? fm::Prediction::v_prediction : fm::Prediction::epsilon;
    ddpm.snr_gamma = std::stod(r.meta.at("snr_gamma"));
  }
  const int64_t steps = std::stoll(r.meta.at("steps"));
  auto in = [&](int i, const char* what) { return r.at(i, what).to(wdt); };
  for (int i = 0; i < steps; ++i) {
    Tensor loss;
    {
      std::optional<flame::amp::AutocastGuard> autocast;
      if (r.bf16()) autocast.emplace(DType::bf16, device.type);
      if (family == "sdxl") {
        loss = fm::unet_ddpm_loss(*unet, ddpm,
                                  {.latents = in(i, "latents"),
                                   .noise = in(i, "noise"),
                                   .text = in(i, "text"),
                                   .timesteps = r.at(i, "timesteps"),
                                   .added = {.text_embeds = in(i, "pooled"), .time_ids = in(i, "time_ids")}});
      } else {
        const fm::FlowBatch b{.latents = in(i, "latents"),
                              .noise = in(i, "noise"),
                              .text = in(i, "text"),
                              .pooled = in(i, "pooled"),
                              .u = r.at(i, "u")};
        loss = family == "flux" ? fm::flux_flow_loss(*flux, flow, b, std::stod(r.meta.at("guidance")))
                                : fm::sd3_flow_loss(*sd3, flow, b);
      }
    }
    out.losses.push_back(loss.item<double>());
    opt.step(loss.backward());
  }
  for (const auto& [k, t] : nn::lora_state_dict(*model)) {
    out.adapters.insert(k.rfind(nn::kPeftPrefix, 0) == 0 ? k.substr(std::string(nn::kPeftPrefix).size()) : k, t);
  }
  return out;
}

}  // namespace flame_diffusion::tools
