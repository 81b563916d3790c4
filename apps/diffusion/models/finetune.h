#pragma once
// The training objectives of fine-tuning the real model families, as diffusers' training scripts
// compute them (Note [Fine-tuning objectives]):
//
//   FlowMatchOptions fm{.density = TimestepDensity::logit_normal, .shift = 3.0};   // SD3 / SD3.5
//   Tensor u = sample_timestep_density(fm, batch, gen);                            // [B] in [0, 1)
//   Tensor loss = sd3_flow_loss(*sd3, fm, {.latents = x0, .noise = noise, .text = states,
//                                          .pooled = pooled, .u = u});
//   opt.step(loss.backward());
//
// Note [Fine-tuning objectives]
// Flow matching (FLUX.1, SD3/SD3.5; train_dreambooth_lora_flux.py / _sd3.py):
//   u ~ the timestep density (logit_normal: sigmoid(N(logit_mean, logit_std)); mode: 1 - v -
//   mode_scale (cos^2(pi v / 2) - 1 + v) for v ~ U[0, 1); uniform), the index i = floor(u N) into
//   the training scheduler's table (FlowMatchEulerDiscreteScheduler at init: sigma_i = s(N - i) / N
//   with the static shift s(x) = shift x / (1 + (shift - 1) x), timestep_i = sigma_i N; N = 1000),
//   x_t = (1 - sigma) x0 + sigma noise, target = noise - x0, loss = mean over the batch of the mean
//   over each sample of w(sigma) (pred - target)^2 in f32, w from the SD3 loss weighting (none: 1;
//   sigma_sqrt: sigma^-2; cosmap: 2 / (pi (1 - 2 sigma + 2 sigma^2))). SD3's scheduler config has
//   shift 3.0; FLUX's shifts only at inference (dynamic shifting), so its training table is
//   unshifted (shift 1). The model sees timestep_i (SD3: 0..1000; FLUX takes timestep_i / 1000 and
//   the guidance value of FLUX-dev); FLUX's latents are packed into 2x2 patches and unpacked back.
// DDPM (SDXL, SD 1.x; train_text_to_image_lora_sdxl.py): betas scaled-linear from 0.00085 to
//   0.012 over 1000 steps, t ~ U{0..999}, x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) noise, target
//   noise (epsilon) or sqrt(abar_t) noise - sqrt(1 - abar_t) x0 (v_prediction); loss = mse, or with
//   min-SNR-gamma the per-sample mse times min(snr, gamma) / snr (epsilon) or / (snr + 1) (v),
//   snr = abar_t / (1 - abar_t), averaged over the batch.
// The latents are the VAE's scaled latents (AutoencoderKL::to_latent). The random draws (u or t,
// noise) are the caller's: the trainer draws them from its Generator, the parity test reads
// diffusers' (reference/finetune_loop.py) so that both loops run the same steps.
#include <cstdint>

#include <flame/flame.h>

#include "models/flux.h"
#include "models/sd3.h"
#include "models/unet2d.h"

namespace flame_diffusion::models {

// ---- flow matching (FLUX.1, SD3 / SD3.5) ----
enum class TimestepDensity { uniform, logit_normal, mode };
enum class FlowLossWeighting { none, sigma_sqrt, cosmap };

struct FlowMatchOptions {
  TimestepDensity density = TimestepDensity::logit_normal;
  double logit_mean = 0.0;
  double logit_std = 1.0;
  double mode_scale = 1.29;
  FlowLossWeighting weighting = FlowLossWeighting::none;
  double shift = 1.0;  // the training scheduler's static shift: SD3 / SD3.5 3.0, FLUX 1.0
  int64_t num_train_timesteps = 1000;
};

// u in [0, 1), [batch] f32 on the CPU, drawn from gen by the density of the options.
Tensor sample_timestep_density(const FlowMatchOptions& options, int64_t batch, flame::Generator& gen);

// The training scheduler's sigma and timestep (sigma x N) for each u: [B] f32 on u's device.
struct FlowMatchTimesteps {
  Tensor sigmas;
  Tensor timesteps;
};
FlowMatchTimesteps flow_match_timesteps(const FlowMatchOptions& options, const Tensor& u);

// The per-sample loss weight of the options' weighting for sigmas [B]: [B] f32.
Tensor flow_loss_weighting(FlowLossWeighting weighting, const Tensor& sigmas);

// One batch: latents and noise [B, C, H, W] (C = 16 for FLUX and SD3), text states [B, T, D],
// pooled text [B, P], u [B] (sample_timestep_density; keep it on the host: its values are read there,
// so a device u costs a wait for the device).
struct FlowBatch {
  Tensor latents, noise, text, pooled, u;
};

// The flow-matching loss (0-d f32) of a FLUX transformer (guidance: FLUX-dev's guidance input,
// ignored by a model without guidance_embeds) or an SD3 transformer on one batch.
Tensor flux_flow_loss(FluxTransformer2DModel& model, const FlowMatchOptions& options, const FlowBatch& batch,
                      double guidance = 3.5);
Tensor sd3_flow_loss(SD3Transformer2DModel& model, const FlowMatchOptions& options, const FlowBatch& batch);

// ---- DDPM (SDXL, SD 1.x / 2.x) ----
enum class Prediction { epsilon, v_prediction };

struct DdpmOptions {
  double beta_start = 0.00085;
  double beta_end = 0.012;
  int64_t num_train_timesteps = 1000;
  Prediction prediction = Prediction::epsilon;
  double snr_gamma = 0.0;  // > 0: min-SNR-gamma weighting (5.0 is the usual value)
};

// abar_t of the scaled-linear schedule: [N] f32 on the CPU.
Tensor ddpm_alphas_cumprod(const DdpmOptions& options);

// One batch: latents and noise [B, 4, H, W], text states [B, T, D], SDXL's added conditions (pooled
// text and the 6 time ids; empty for SD 1.x), timesteps [B] (integers 0..N-1, any dtype; read on the
// host, so keep them there).
struct DdpmBatch {
  Tensor latents, noise, text, timesteps;
  UNet2DAddedConditions added;
};

// The DDPM loss (0-d f32) of a UNet on one batch.
Tensor unet_ddpm_loss(UNet2DConditionModel& model, const DdpmOptions& options, const DdpmBatch& batch);

}  // namespace flame_diffusion::models
