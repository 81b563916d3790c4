#pragma once
// Text-to-image pipelines of FLUX.1, SD3 / SD3.5 and SDXL, following diffusers 0.42's FluxPipeline,
// StableDiffusion3Pipeline and StableDiffusionXLPipeline step for step (Note [Pipelines]).
//
//   auto pipe = load_pipeline({.path = "/models/FLUX.1-dev", .device = Device::cuda(), .dtype = DType::bf16});
//   Tensor images = generate(*pipe, {.prompts = {"a red cat"}, .steps = 28, .guidance = 3.5, .seed = 7});
//   // images [N, 3, H, W] f32 in [0, 1] on the CPU, N = prompts x images_per_prompt
//
// Note [Pipelines]
// Each family encodes the prompts as its diffusers pipeline does:
//   FLUX   CLIP-L's pooled output (CLIPTextModel, tokenizer/) and T5's last hidden state (no
//          attention mask, max_sequence_length tokens, tokenizer_2/); the guidance scale enters the
//          transformer's guidance embedding; latents [N, 16, H/8, W/8] are packed 2x2 into tokens;
//          the flow-match Euler sigmas are linspace(1, 1/steps, steps) shifted by mu =
//          flux_mu(token count). True CFG (diffusers' true_cfg_scale) with a negative prompt: a
//          second transformer pass per step on the negative prompt's embeddings (same latents,
//          timestep and guidance), out = neg + true_cfg_scale * (cond - neg).
//   SD3    CLIP-L and bigG (with projection): penultimate hidden states concatenated on the feature
//          axis and zero-padded to T5's width, then T5's states appended on the sequence axis; the
//          two pooled projections concatenated. CFG with the negative prompt ("" when none): one
//          batch [negative, positive]. Flow-match Euler with the scheduler's shift.
//   SDXL   CLIP-L (CLIPTextModel) and bigG (with projection): penultimate hidden states
//          concatenated; bigG's pooled projection and add_time_ids (H, W, 0, 0, H, W) as the UNet's
//          added conditions. CFG; without a negative prompt the negative embeddings are zeros
//          (force_zeros_for_empty_prompt of model_index.json). Samplers: Euler (the shipped
//          scheduler), Euler ancestral (noise from the seed's generator), DPM++ 2M, with or without
//          Karras sigmas (models/schedulers.h).
// CFG: out = uncond + scale * (cond - uncond), applied when scale > 1 (diffusers'
// do_classifier_free_guidance). Each prompt gives images_per_prompt images in a row; the initial
// noise [N, C, h, w] is drawn at once from a flame::Generator seeded with `seed`. The latents stay
// in the model dtype between steps (the schedulers step in f32). The VAE decodes latents / scaling
// + shift, tiled (diffusers' tiling, vae.h) when asked or when the image exceeds 2048 pixels a side;
// the image is (x / 2 + 0.5) clamped to [0, 1].
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <flame/flame.h>

#include "models/clip_text.h"
#include "models/flux.h"
#include "models/schedulers.h"
#include "models/sd3.h"
#include "models/t5_encoder.h"
#include "models/tokenizer_clip.h"
#include "models/tokenizer_t5.h"
#include "models/unet2d.h"
#include "models/vae.h"

namespace flame_diffusion::models {

// "flux", "sd3", "sdxl".
std::vector<std::string> pipeline_families();

struct PipelineLoadOptions {
  // A diffusers pipeline folder (model_index.json, scheduler/, tokenizer*/, text_encoder*/, vae/,
  // transformer/ or unet/). The tokenizers always come from it.
  std::string path;
  // "flux", "sd3" or "sdxl"; "" reads model_index.json's _class_name.
  std::string family;
  // Single files (or model folders) that replace the folder's components, where the loaders read
  // them: the transformer / UNet (FLUX, SD3 / SD3.5 and SDXL single files, ComfyUI layouts), the VAE,
  // and the text encoders (CLIP-L, bigG, T5 single files). Empty: the folder's.
  std::string denoiser, vae, text_encoder, text_encoder_2, text_encoder_3;
  // A LoRA file of the denoiser in any layout models/lora_file.h reads (PEFT, diffusers, kohya),
  // applied at its own alpha (text-encoder keys are skipped and reported).
  std::string lora;
  flame::Device device = flame::Device::cpu();
  flame::DType dtype = flame::DType::f32;
  // FLUX and SD3: load the transformer's Linears as frozen 8-bit weights (FluxLoadOptions::float8;
  // staged in host memory, so the GPU never holds the full-precision transformer). SDXL's UNet
  // loads as usual (quantise it after loading).
  std::optional<flame::nn::Float8Options> denoiser_float8;
};

// The loaded components of one family (the others null).
struct Pipeline {
  std::string family, path;
  flame::Device device = flame::Device::cpu();
  flame::DType dtype = flame::DType::f32;
  std::shared_ptr<FluxTransformer2DModel> flux;
  std::shared_ptr<SD3Transformer2DModel> sd3;
  std::shared_ptr<UNet2DConditionModel> unet;
  std::shared_ptr<AutoencoderKL> vae;
  // FLUX: clip_l (no projection) + t5. SD3: clip_l, clip_g (with projection) + t5 (null when the
  // folder has no text_encoder_3: its states are zeros, as diffusers). SDXL: clip_l + clip_g.
  std::shared_ptr<ClipTextModel> clip_l, clip_g;
  std::shared_ptr<T5EncoderModel> t5;
  std::optional<ClipTokenizer> tokenizer_l, tokenizer_g;
  std::optional<T5Tokenizer> tokenizer_t5;
  std::optional<FlowMatchConfig> flow_config;          // FLUX, SD3
  std::optional<DiscreteSchedulerConfig> discrete_config;  // SDXL
  bool force_zeros_for_empty_prompt = true;                // SDXL
  std::vector<std::string> lora_skipped;                   // keys of the LoRA file not loaded
};

// Loads a pipeline; errors name the folder or file and the missing piece.
std::shared_ptr<Pipeline> load_pipeline(const PipelineLoadOptions& options);

// A batch of texts as the family's denoiser takes them (Note [Pipelines]): FLUX T5 states
// [B, T, 4096] and CLIP-L's pooled output; SD3 the joint states [B, 77 + T, joint_dim] and both
// pooled projections; SDXL both CLIPs' penultimate states [B, 77, 2048] and bigG's projection.
struct PromptEmbeddings {
  flame::Tensor states, pooled;
};

// Encodes `texts` with the pipeline's text encoders (T5 to max_sequence_length tokens: 1 to 512).
// Raises when the encoders were released (a trainer that cached its embeddings).
PromptEmbeddings encode_prompts(Pipeline& pipe, const std::vector<std::string>& texts, int64_t max_sequence_length);

struct GenerateOptions {
  std::vector<std::string> prompts;
  // SD3 / SDXL: CFG's negative prompt. FLUX: true CFG's, which needs true_cfg_scale > 1.
  std::optional<std::string> negative_prompt;
  int64_t steps = 0;                            // 0: 28 (FLUX-dev, SD3), 4 (FLUX-schnell), 30 (SDXL)
  // FLUX: the guidance embedding's value (0: 3.5). SD3 / SDXL: the CFG scale (0: 7.0 / 5.0).
  double guidance = 0;
  // FLUX only: true classifier-free guidance when > 1 (needs negative_prompt; twice the transformer
  // passes), as FluxPipeline's true_cfg_scale; 1: none.
  double true_cfg_scale = 1.0;
  // FLUX / SD3: "" or "euler" (flow-match Euler). SDXL: "" (euler), euler, euler-karras, euler-a,
  // dpm++2m, dpm++2m-karras.
  std::string sampler;
  uint64_t seed = 0;
  int64_t width = 0, height = 0;  // 0: 1024; multiples of 16
  int64_t images_per_prompt = 1;
  int64_t max_sequence_length = 0;  // T5 tokens; 0: 512 (FLUX-dev), 256 (FLUX-schnell, SD3)
  bool tiled_decode = false;
  // The initial latents [N, C, H/f, W/f] (unpacked, for FLUX too) instead of the seed's noise (tests,
  // reproducing another run).
  flame::Tensor latents;
  // Encodes prompts (and the negative prompt) instead of the pipeline's text encoders, e.g. from an
  // embedding cache while the encoders are not in memory; must return what encode_prompts would.
  std::function<PromptEmbeddings(const std::vector<std::string>&)> encode;
  // Called after each denoising step with (step, steps).
  std::function<void(int64_t, int64_t)> on_step;
};

// The defaults filled in and every setting checked (errors name the setting and the value).
GenerateOptions resolve_generate_options(const Pipeline& pipe, GenerateOptions options);

// Images [N, 3, H, W] f32 in [0, 1] on the CPU.
flame::Tensor generate(Pipeline& pipe, const GenerateOptions& options);

}  // namespace flame_diffusion::models
