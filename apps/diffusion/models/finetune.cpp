#include "models/finetune.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>
#include <vector>

namespace flame_diffusion::models {

using flame::DType;
using flame::Shape;

namespace {

const flame::TensorOptions kCpuF32(DType::f32, flame::Device::cpu());

void check_latents(const char* op, const Tensor& latents, const Tensor& noise) {
  FLAME_CHECK(latents.defined() && latents.dim() == 4, op, "latents must be [B, C, H, W], got ",
              latents.defined() ? flame::shape_str(latents.sizes()) : std::string("an undefined tensor"));
  FLAME_CHECK(noise.defined() && noise.sizes() == latents.sizes(), op, "noise must have the latents' shape ",
              flame::shape_str(latents.sizes()), ", got ",
              noise.defined() ? flame::shape_str(noise.sizes()) : std::string("an undefined tensor"));
}

void check_per_sample(const char* op, const char* what, const Tensor& t, int64_t batch) {
  FLAME_CHECK(t.defined() && t.dim() == 1 && t.size(0) == batch, op, what, " must be [", batch,
              "] (one per sample), got ", t.defined() ? flame::shape_str(t.sizes()) : std::string("an undefined tensor"));
}

// mean over the batch of the per-sample mean of w (pred - target)^2, in f32; w [B] or undefined.
Tensor weighted_mse(const Tensor& pred, const Tensor& target, const Tensor& w) {
  const int64_t b = pred.size(0);
  Tensor d = pred.to(DType::f32) - target.to(DType::f32);
  d = d * d;
  if (w.defined()) d = w.to(DType::f32).to(d.device()).reshape({b, 1, 1, 1}) * d;
  return d.reshape({b, -1}).mean({1}).mean();
}

// x_t = (1 - sigma) x0 + sigma noise, sigma [B] in the latents' dtype (as get_sigmas).
Tensor flow_noisy(const Tensor& x0, const Tensor& noise, const Tensor& sigmas) {
  const Tensor s = sigmas.to(x0.dtype()).to(x0.device()).reshape({x0.size(0), 1, 1, 1});
  return (1.0 - s) * x0 + s * noise;
}

}  // namespace

// ---- flow matching ----

Tensor sample_timestep_density(const FlowMatchOptions& o, int64_t batch, flame::Generator& gen) {
  const char* op = "sample_timestep_density";
  FLAME_CHECK(batch > 0, op, "batch must be positive, got ", batch);
  switch (o.density) {
    case TimestepDensity::logit_normal:
      FLAME_CHECK(o.logit_std > 0 && std::isfinite(o.logit_mean), op, "logit_std must be positive, got ", o.logit_std);
      return Tensor::randn({batch}, o.logit_mean, o.logit_std, kCpuF32, &gen).sigmoid();
    case TimestepDensity::mode: {
      const Tensor v = Tensor::rand({batch}, kCpuF32, &gen);
      const Tensor c = (v * (std::numbers::pi / 2)).cos();
      return 1.0 - v - o.mode_scale * (c * c - 1.0 + v);
    }
    case TimestepDensity::uniform:
      return Tensor::rand({batch}, kCpuF32, &gen);
  }
  FLAME_FAIL(op, "unknown density");
}

FlowMatchTimesteps flow_match_timesteps(const FlowMatchOptions& o, const Tensor& u) {
  const char* op = "flow_match_timesteps";
  FLAME_CHECK(u.defined() && u.dim() == 1, op, "u must be [B], got ",
              u.defined() ? flame::shape_str(u.sizes()) : std::string("an undefined tensor"));
  FLAME_CHECK(o.num_train_timesteps > 0, op, "num_train_timesteps must be positive, got ", o.num_train_timesteps);
  FLAME_CHECK(o.shift > 0 && std::isfinite(o.shift), op, "shift must be positive, got ", o.shift);
  const float n = static_cast<float>(o.num_train_timesteps), shift = static_cast<float>(o.shift);
  const std::vector<float> us = u.to_vec<float>();
  std::vector<float> sig(us.size()), ts(us.size());
  for (std::size_t i = 0; i < us.size(); ++i) {
    FLAME_CHECK(us[i] >= 0.0f && us[i] < 1.0f, op, "u[", i, "] = ", us[i], " is outside [0, 1)");
    // The table of FlowMatchEulerDiscreteScheduler at init, in its f32 arithmetic.
    const auto index = static_cast<int64_t>(us[i] * n);
    const float s = static_cast<float>(o.num_train_timesteps - index) / n;
    sig[i] = shift * s / (1.0f + (shift - 1.0f) * s);
    ts[i] = sig[i] * n;
  }
  const auto b = static_cast<int64_t>(us.size());
  return {Tensor::from_vec(sig, {b}).to(u.device()), Tensor::from_vec(ts, {b}).to(u.device())};
}

Tensor flow_loss_weighting(FlowLossWeighting weighting, const Tensor& sigmas) {
  const Tensor s = sigmas.to(DType::f32);
  switch (weighting) {
    case FlowLossWeighting::none:
      return Tensor::ones(s.sizes(), {DType::f32, s.device()});
    case FlowLossWeighting::sigma_sqrt:
      return s.pow(-2.0);
    case FlowLossWeighting::cosmap:
      return 2.0 / (std::numbers::pi * (1.0 - 2.0 * s + 2.0 * s.pow(2.0)));
  }
  FLAME_FAIL("flow_loss_weighting", "unknown weighting");
}

namespace {
// The schedule's values (made where u is: a host u costs no device read) moved to the latents' device.
FlowMatchTimesteps on_device(FlowMatchTimesteps t, flame::Device dev) {
  return {t.sigmas.to(dev), t.timesteps.to(dev)};
}
}  // namespace

Tensor flux_flow_loss(FluxTransformer2DModel& model, const FlowMatchOptions& o, const FlowBatch& batch,
                      double guidance) {
  const char* op = "flux_flow_loss";
  check_latents(op, batch.latents, batch.noise);
  const int64_t b = batch.latents.size(0), h = batch.latents.size(2), w = batch.latents.size(3);
  check_per_sample(op, "u", batch.u, b);
  FLAME_CHECK(batch.text.defined() && batch.text.dim() == 3 && batch.text.size(0) == b, op,
              "text must be [", b, ", T, D] (T5 states), got ",
              batch.text.defined() ? flame::shape_str(batch.text.sizes()) : std::string("an undefined tensor"));
  const flame::Device dev = batch.latents.device();
  const FlowMatchTimesteps t = on_device(flow_match_timesteps(o, batch.u), dev);
  const Tensor noisy = flow_noisy(batch.latents, batch.noise, t.sigmas);
  const Tensor g =
      model.config().guidance_embeds ? Tensor::full({b}, guidance, flame::TensorOptions(DType::f32, dev)) : Tensor();
  // Host ids: the rotary table is made on the host, so device ids would be read back (a sync).
  const flame::Device cpu = flame::Device::cpu();
  const Tensor packed = model.forward(pack_latents(noisy), batch.text, batch.pooled, t.timesteps / 1000.0,
                                      flux_img_ids(h, w, cpu), flux_txt_ids(batch.text.size(1), cpu), g);
  const Tensor pred = unpack_latents(packed, h, w);
  const Tensor wgt = o.weighting == FlowLossWeighting::none ? Tensor() : flow_loss_weighting(o.weighting, t.sigmas);
  return weighted_mse(pred, batch.noise - batch.latents, wgt);
}

Tensor sd3_flow_loss(SD3Transformer2DModel& model, const FlowMatchOptions& o, const FlowBatch& batch) {
  const char* op = "sd3_flow_loss";
  check_latents(op, batch.latents, batch.noise);
  const int64_t b = batch.latents.size(0);
  check_per_sample(op, "u", batch.u, b);
  const FlowMatchTimesteps t = on_device(flow_match_timesteps(o, batch.u), batch.latents.device());
  const Tensor noisy = flow_noisy(batch.latents, batch.noise, t.sigmas);
  const Tensor pred = model.forward(noisy, batch.text, batch.pooled, t.timesteps);
  const Tensor wgt = o.weighting == FlowLossWeighting::none ? Tensor() : flow_loss_weighting(o.weighting, t.sigmas);
  return weighted_mse(pred, batch.noise - batch.latents, wgt);
}

// ---- DDPM ----

Tensor ddpm_alphas_cumprod(const DdpmOptions& o) {
  const char* op = "ddpm_alphas_cumprod";
  FLAME_CHECK(o.num_train_timesteps > 1, op, "num_train_timesteps must be at least 2, got ", o.num_train_timesteps);
  FLAME_CHECK(o.beta_start > 0 && o.beta_end < 1 && o.beta_start <= o.beta_end, op,
              "expected 0 < beta_start <= beta_end < 1, got ", o.beta_start, " and ", o.beta_end);
  const int64_t n = o.num_train_timesteps;
  const double a = std::sqrt(o.beta_start), z = std::sqrt(o.beta_end);
  std::vector<float> out(static_cast<std::size_t>(n));
  double acc = 1.0;
  for (int64_t i = 0; i < n; ++i) {  // scaled_linear: linspace of the square roots, squared (f32 betas)
    const auto r = static_cast<float>(a + (z - a) * static_cast<double>(i) / static_cast<double>(n - 1));
    const float beta = r * r;
    acc *= static_cast<double>(1.0f - beta);
    out[static_cast<std::size_t>(i)] = static_cast<float>(acc);
  }
  return Tensor::from_vec(out, {n});
}

Tensor unet_ddpm_loss(UNet2DConditionModel& model, const DdpmOptions& o, const DdpmBatch& batch) {
  const char* op = "unet_ddpm_loss";
  check_latents(op, batch.latents, batch.noise);
  const int64_t b = batch.latents.size(0);
  check_per_sample(op, "timesteps", batch.timesteps, b);
  const Tensor abar = ddpm_alphas_cumprod(o);
  const std::vector<float> tv = batch.timesteps.to_vec<float>();
  std::vector<float> sa(tv.size()), s1(tv.size()), snr(tv.size());
  for (std::size_t i = 0; i < tv.size(); ++i) {
    const auto t = static_cast<int64_t>(tv[i]);
    FLAME_CHECK(static_cast<float>(t) == tv[i] && t >= 0 && t < o.num_train_timesteps, op, "timesteps[", i, "] = ",
                tv[i], " is not an integer in [0, ", o.num_train_timesteps, ")");
    const float ab = abar.data<float>()[t];
    sa[i] = std::sqrt(ab);
    s1[i] = std::sqrt(1.0f - ab);
    const float r = sa[i] / s1[i];  // compute_snr: (sqrt(abar) / sqrt(1 - abar))^2
    snr[i] = r * r;
  }
  const flame::Device dev = batch.latents.device();
  const DType dt = batch.latents.dtype();
  const Tensor sqrt_a = Tensor::from_vec(sa, {b, 1, 1, 1}).to(dt).to(dev);
  const Tensor sqrt_1ma = Tensor::from_vec(s1, {b, 1, 1, 1}).to(dt).to(dev);
  const Tensor noisy = sqrt_a * batch.latents + sqrt_1ma * batch.noise;
  const Tensor target =
      o.prediction == Prediction::epsilon ? batch.noise : sqrt_a * batch.noise - sqrt_1ma * batch.latents;
  const Tensor pred = model.forward(noisy, batch.timesteps.to(dev), batch.text, batch.added);
  if (o.snr_gamma <= 0) {
    const Tensor d = pred.to(DType::f32) - target.to(DType::f32);
    return (d * d).mean();
  }
  std::vector<float> w(snr.size());
  for (std::size_t i = 0; i < snr.size(); ++i) {
    const float m = std::min(snr[i], static_cast<float>(o.snr_gamma));
    w[i] = o.prediction == Prediction::epsilon ? m / snr[i] : m / (snr[i] + 1.0f);
  }
  return weighted_mse(pred, target, Tensor::from_vec(w, {b}));
}

}  // namespace flame_diffusion::models
