#pragma once
// Noise schedulers of the real model families, each following diffusers 0.42's class of the same
// name (Note [Scheduler arithmetic]):
//
//   FlowMatchEulerDiscreteScheduler  FLUX.1 (dynamic shifting, mu from the image token count) and
//                                    SD3 / SD3.5 (shift 3.0)
//   EulerDiscreteScheduler           SDXL's shipped scheduler ("euler"; "euler-karras")
//   EulerAncestralDiscreteScheduler  "euler-a": takes the step's noise as an input
//   DPMSolverMultistepScheduler      DPM++ 2M ("dpm++2m", "dpm++2m-karras"): dpmsolver++, order 2,
//                                    midpoint, first order on the first and the last step
//
//   auto s = make_scheduler("dpm++2m-karras", sdxl_scheduler_config());
//   s->set_timesteps(30);
//   Tensor x = noise * s->init_noise_sigma();
//   for (int64_t i = 0; i < s->num_steps(); ++i) {
//     Tensor eps = unet(s->scale_model_input(x), s->timesteps()[i], ...);
//     x = s->step(eps, x);            // euler-a: s->step(eps, x, randn_like(x, &gen))
//   }
//
// Note [Scheduler arithmetic]
// The tables are computed with diffusers' dtypes: betas and alphas_cumprod in f32 (the cumulative
// product accumulated in f64, as PyTorch's CPU cumprod), the spacing and Karras sigmas in f64 and
// stored as f32; each step's coefficients are f32 scalars (diffusers' 0-d f32 tensors) and the
// update runs in f32 with diffusers' order of operations, so a step matches diffusers to a few f32
// ulps. step() computes in f32 and returns model_output's dtype (as diffusers' prev_sample).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <flame/flame.h>

#include "models/checkpoint.h"

namespace flame_diffusion::models {

using flame::Tensor;

// FlowMatchEulerDiscreteScheduler's configuration (the fields FLUX and SD3 ship).
struct FlowMatchConfig {
  int64_t num_train_timesteps = 1000;
  double shift = 1.0;
  bool use_dynamic_shifting = false;
  double base_shift = 0.5;
  double max_shift = 1.15;
  int64_t base_image_seq_len = 256;
  int64_t max_image_seq_len = 4096;
};
// FLUX.1-dev / schnell's scheduler_config.json: shift 3.0 (unused: dynamic), dynamic shifting,
// base/max shift 0.5 / 1.15 over 256 / 4096 image tokens.
FlowMatchConfig flux_scheduler_config();
// SD3 / SD3.5's: shift 3.0, no dynamic shifting.
FlowMatchConfig sd3_scheduler_config();
// A diffusers scheduler_config.json of a FlowMatchEulerDiscreteScheduler; settings FLAME does not
// implement (karras/exponential/beta sigmas, invert_sigmas, shift_terminal, stochastic sampling, a
// linear time shift) raise naming the key.
FlowMatchConfig flow_match_config_from_json(const JsonConfig& json);

// diffusers' calculate_shift: mu linear in the image token count, from base_shift at
// base_image_seq_len to max_shift at max_image_seq_len.
double flux_mu(int64_t image_seq_len, const FlowMatchConfig& config);

// The configuration of the discrete (DDPM-trained) schedulers.
struct DiscreteSchedulerConfig {
  int64_t num_train_timesteps = 1000;
  double beta_start = 0.00085;
  double beta_end = 0.012;
  std::string beta_schedule = "scaled_linear";  // "scaled_linear" or "linear"
  std::string prediction_type = "epsilon";      // "epsilon" or "v_prediction"
  std::string timestep_spacing = "leading";     // "leading", "trailing" or "linspace"
  int64_t steps_offset = 1;
  bool use_karras_sigmas = false;
};
// SDXL base 1.0's scheduler_config.json (EulerDiscreteScheduler): scaled-linear betas 0.00085 ..
// 0.012 over 1000 steps, epsilon, leading spacing with steps_offset 1.
DiscreteSchedulerConfig sdxl_scheduler_config();
// A diffusers scheduler_config.json of an Euler / Euler-ancestral / DPM-solver scheduler (the
// fields above; unsupported values, e.g. rescale_betas_zero_snr or trained_betas, raise naming the
// key).
DiscreteSchedulerConfig discrete_config_from_json(const JsonConfig& json);

// The f32 alphas_cumprod table of a discrete configuration (diffusers' __init__).
std::vector<float> alphas_cumprod(const DiscreteSchedulerConfig& config);

class Scheduler {
 public:
  virtual ~Scheduler() = default;
  virtual std::string name() const = 0;  // diffusers' class name
  virtual void set_timesteps(int64_t num_inference_steps) = 0;
  // The timesteps the model is called with, one per step.
  const std::vector<float>& timesteps() const { return timesteps_; }
  // num_steps() + 1 values, the last the final sigma (0).
  const std::vector<float>& sigmas() const { return sigmas_; }
  int64_t num_steps() const { return static_cast<int64_t>(timesteps_.size()); }
  int64_t step_index() const { return step_index_; }
  // The scale of the initial noise (diffusers' init_noise_sigma).
  virtual double init_noise_sigma() const { return 1.0; }
  // The model's input at the current step (Euler: sample / sqrt(sigma^2 + 1)); the identity for
  // the others.
  virtual Tensor scale_model_input(const Tensor& sample) const { return sample; }
  // True when step() needs `noise` (the ancestral scheduler).
  virtual bool needs_noise() const { return false; }
  // One step from the current timestep to the next; advances step_index(). `noise` (same shape
  // as sample) only for needs_noise().
  virtual Tensor step(const Tensor& model_output, const Tensor& sample, const Tensor& noise = {}) = 0;

 protected:
  void check_step(const Tensor& model_output, const Tensor& sample) const;
  std::vector<float> timesteps_, sigmas_;
  int64_t step_index_ = 0;
};

class FlowMatchEulerDiscreteScheduler : public Scheduler {
 public:
  explicit FlowMatchEulerDiscreteScheduler(FlowMatchConfig config = {});
  std::string name() const override { return "FlowMatchEulerDiscreteScheduler"; }
  // Evenly spaced from sigma_max to sigma_min of the shifted training table (SD3's pipeline).
  // With dynamic shifting this needs mu: use the overload.
  void set_timesteps(int64_t num_inference_steps) override;
  // Given sigmas (FLUX's pipeline passes linspace(1, 1/N, N)), shifted by mu when dynamic
  // shifting is on (mu required then), else by `shift`.
  void set_timesteps(const std::vector<double>& sigmas, std::optional<double> mu);
  // FLUX's pipeline: sigmas linspace(1, 1/N, N) and mu = flux_mu(image_seq_len).
  void set_flux_timesteps(int64_t num_inference_steps, int64_t image_seq_len);
  Tensor step(const Tensor& model_output, const Tensor& sample, const Tensor& noise = {}) override;
  const FlowMatchConfig& config() const { return config_; }

 private:
  void finish(std::vector<float> sigmas);
  FlowMatchConfig config_;
  float sigma_min_, sigma_max_;
};

// Shared by the three discrete schedulers: betas, alphas_cumprod and the training sigma table.
class DiscreteScheduler : public Scheduler {
 public:
  const DiscreteSchedulerConfig& config() const { return config_; }

 protected:
  explicit DiscreteScheduler(DiscreteSchedulerConfig config);
  // The spacing's timesteps for N steps (diffusers' EulerDiscrete / EulerAncestral rule).
  std::vector<double> spaced_timesteps(int64_t n) const;
  // np.interp of the training sigmas at fractional timesteps.
  double interp_sigma(double t) const;
  // diffusers' _sigma_to_t over log of the f32 training sigmas.
  double sigma_to_t(double sigma) const;
  // diffusers' _convert_to_karras (rho 7) between the two given sigmas.
  static std::vector<double> karras(double sigma_min, double sigma_max, int64_t n);
  DiscreteSchedulerConfig config_;
  std::vector<float> train_sigmas_;      // ((1 - ac) / ac) ** 0.5, ascending in t
  std::vector<float> log_train_sigmas_;  // f32 logs
};

class EulerDiscreteScheduler : public DiscreteScheduler {
 public:
  explicit EulerDiscreteScheduler(DiscreteSchedulerConfig config = sdxl_scheduler_config());
  std::string name() const override { return "EulerDiscreteScheduler"; }
  void set_timesteps(int64_t num_inference_steps) override;
  double init_noise_sigma() const override;
  Tensor scale_model_input(const Tensor& sample) const override;
  Tensor step(const Tensor& model_output, const Tensor& sample, const Tensor& noise = {}) override;
};

// Euler's initial noise scale and model input; its own spacing (no Karras sigmas) and step.
class EulerAncestralDiscreteScheduler : public EulerDiscreteScheduler {
 public:
  explicit EulerAncestralDiscreteScheduler(DiscreteSchedulerConfig config = sdxl_scheduler_config());
  std::string name() const override { return "EulerAncestralDiscreteScheduler"; }
  void set_timesteps(int64_t num_inference_steps) override;
  bool needs_noise() const override { return true; }
  Tensor step(const Tensor& model_output, const Tensor& sample, const Tensor& noise = {}) override;
};

class DPMSolverMultistepScheduler : public DiscreteScheduler {
 public:
  explicit DPMSolverMultistepScheduler(DiscreteSchedulerConfig config = sdxl_scheduler_config());
  std::string name() const override { return "DPMSolverMultistepScheduler"; }
  void set_timesteps(int64_t num_inference_steps) override;
  Tensor step(const Tensor& model_output, const Tensor& sample, const Tensor& noise = {}) override;

 private:
  Tensor convert_model_output(const Tensor& model_output, const Tensor& sample) const;
  Tensor previous_x0_;  // the last step's data prediction (f32)
  int64_t lower_order_nums_ = 0;
};

// "euler", "euler-karras", "euler-a", "dpm++2m", "dpm++2m-karras" over a discrete configuration
// (the Karras variants set use_karras_sigmas); other names raise listing these.
std::unique_ptr<Scheduler> make_discrete_scheduler(const std::string& sampler, DiscreteSchedulerConfig config);
std::vector<std::string> discrete_sampler_names();

}  // namespace flame_diffusion::models
