#include "models/schedulers.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include <flame/error.h>

namespace flame_diffusion::models {

using flame::DType;

namespace {

// numpy.linspace in f64: y_i = i * step + start, the last value exactly `stop`.
std::vector<double> np_linspace(double start, double stop, int64_t n) {
  std::vector<double> y(static_cast<std::size_t>(n));
  if (n == 0) return y;
  const double step = n > 1 ? (stop - start) / static_cast<double>(n - 1) : 0.0;
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<double>(i) * step + start;
  if (n > 1) y[n - 1] = stop;
  return y;
}

// PyTorch's CPU torch.linspace for f32: step in f32, the first half counted from start and the
// second from end.
std::vector<float> torch_linspace_f32(double start_d, double end_d, int64_t n) {
  const float start = static_cast<float>(start_d), end = static_cast<float>(end_d);
  const float step = n > 1 ? (end - start) / static_cast<float>(n - 1) : 0.0f;
  std::vector<float> y(static_cast<std::size_t>(n));
  const int64_t halfway = n / 2;
  for (int64_t i = 0; i < n; ++i) {
    y[i] = i < halfway ? start + step * static_cast<float>(i) : end - step * static_cast<float>(n - i - 1);
  }
  return y;
}

// Python's round (half to even), as numpy's round.
double round_half_even(double x) { return std::nearbyint(x); }

void check_steps(const std::string& who, int64_t n) {
  FLAME_CHECK(n >= 1 && n <= 1000, who.c_str(), ".set_timesteps: num_inference_steps is ", n,
              "; give a step count from 1 to 1000");
}

// The coefficient arithmetic of diffusers' 0-d f32 tensors.
float f32_sqrt(float x) { return std::sqrt(x); }

}  // namespace

// ---- configurations ----

FlowMatchConfig flux_scheduler_config() {
  FlowMatchConfig c;
  c.shift = 3.0;
  c.use_dynamic_shifting = true;
  return c;
}

FlowMatchConfig sd3_scheduler_config() {
  FlowMatchConfig c;
  c.shift = 3.0;
  return c;
}

FlowMatchConfig flow_match_config_from_json(const JsonConfig& j) {
  FlowMatchConfig c;
  c.num_train_timesteps = j.get_int("num_train_timesteps", c.num_train_timesteps);
  c.shift = j.get_double("shift", c.shift);
  c.use_dynamic_shifting = j.get_bool("use_dynamic_shifting", c.use_dynamic_shifting);
  c.base_shift = j.get_double("base_shift", c.base_shift);
  c.max_shift = j.get_double("max_shift", c.max_shift);
  c.base_image_seq_len = j.get_int("base_image_seq_len", c.base_image_seq_len);
  c.max_image_seq_len = j.get_int("max_image_seq_len", c.max_image_seq_len);
  for (const char* key : {"use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
                          "stochastic_sampling"}) {
    FLAME_CHECK(!j.get_bool(key, false), "FlowMatchEulerDiscreteScheduler", j.origin(), ": ", key,
                " = true is not supported by FLAME's scheduler (FLUX and SD3 ship false)");
  }
  FLAME_CHECK(!j.has("shift_terminal"), "FlowMatchEulerDiscreteScheduler", j.origin(),
              ": shift_terminal is not supported (FLUX and SD3 ship none)");
  const std::string shift_type = j.get_string("time_shift_type", "exponential");
  FLAME_CHECK(shift_type == "exponential", "FlowMatchEulerDiscreteScheduler", j.origin(), ": time_shift_type \"",
              shift_type, "\" is not supported (only \"exponential\")");
  FLAME_CHECK(c.num_train_timesteps >= 1 && c.shift > 0, "FlowMatchEulerDiscreteScheduler", j.origin(),
              ": num_train_timesteps ", c.num_train_timesteps, " and shift ", c.shift, " must be positive");
  return c;
}

double flux_mu(int64_t image_seq_len, const FlowMatchConfig& c) {
  const double m = (c.max_shift - c.base_shift) / static_cast<double>(c.max_image_seq_len - c.base_image_seq_len);
  const double b = c.base_shift - m * static_cast<double>(c.base_image_seq_len);
  return static_cast<double>(image_seq_len) * m + b;
}

DiscreteSchedulerConfig sdxl_scheduler_config() { return {}; }

DiscreteSchedulerConfig discrete_config_from_json(const JsonConfig& j) {
  DiscreteSchedulerConfig c;
  const std::string who = j.origin();
  c.num_train_timesteps = j.get_int("num_train_timesteps", c.num_train_timesteps);
  c.beta_start = j.get_double("beta_start", 0.0001);
  c.beta_end = j.get_double("beta_end", 0.02);
  c.beta_schedule = j.get_string("beta_schedule", "linear");
  c.prediction_type = j.get_string("prediction_type", "epsilon");
  c.timestep_spacing = j.get_string("timestep_spacing", "linspace");
  c.steps_offset = j.get_int("steps_offset", 0);
  c.use_karras_sigmas = j.get_bool("use_karras_sigmas", false);
  FLAME_CHECK(c.beta_schedule == "scaled_linear" || c.beta_schedule == "linear", "scheduler_config", who, ": beta_schedule \"",
              c.beta_schedule, "\" is not supported (\"scaled_linear\" or \"linear\")");
  FLAME_CHECK(c.prediction_type == "epsilon" || c.prediction_type == "v_prediction", "scheduler_config", who, ": prediction_type \"",
              c.prediction_type, "\" is not supported (\"epsilon\" or \"v_prediction\")");
  FLAME_CHECK(c.timestep_spacing == "leading" || c.timestep_spacing == "trailing" || c.timestep_spacing == "linspace",
              "scheduler_config", who, ": timestep_spacing \"", c.timestep_spacing, "\" is not one of leading, trailing, linspace");
  FLAME_CHECK(!j.has("trained_betas"), "scheduler_config", who, ": trained_betas is not supported");
  FLAME_CHECK(!j.get_bool("rescale_betas_zero_snr", false), "scheduler_config", who, ": rescale_betas_zero_snr is not supported");
  FLAME_CHECK(j.get_string("interpolation_type", "linear") == "linear", "scheduler_config", who,
              ": interpolation_type other than \"linear\" is not supported");
  FLAME_CHECK(c.num_train_timesteps >= 2, "scheduler_config", who, ": num_train_timesteps is ", c.num_train_timesteps);
  return c;
}

std::vector<float> alphas_cumprod(const DiscreteSchedulerConfig& c) {
  std::vector<float> betas;
  if (c.beta_schedule == "scaled_linear") {
    betas = torch_linspace_f32(std::sqrt(c.beta_start), std::sqrt(c.beta_end), c.num_train_timesteps);
    for (float& b : betas) b = b * b;
  } else {
    FLAME_CHECK(c.beta_schedule == "linear", "alphas_cumprod", "beta_schedule \"", c.beta_schedule,
                "\" is not supported (\"scaled_linear\" or \"linear\")");
    betas = torch_linspace_f32(c.beta_start, c.beta_end, c.num_train_timesteps);
  }
  std::vector<float> out(betas.size());
  double acc = 1.0;  // PyTorch's CPU cumprod accumulates f32 in f64
  for (std::size_t i = 0; i < betas.size(); ++i) {
    acc *= static_cast<double>(1.0f - betas[i]);
    out[i] = static_cast<float>(acc);
  }
  return out;
}

// ---- Scheduler ----

void Scheduler::check_step(const Tensor& model_output, const Tensor& sample) const {
  FLAME_CHECK(!timesteps_.empty(), name().c_str(), ".step: call set_timesteps before stepping");
  FLAME_CHECK(step_index_ < num_steps(), name().c_str(), ".step: all ", num_steps(),
              " steps are done; call set_timesteps to start again");
  FLAME_CHECK(model_output.sizes() == sample.sizes(), name().c_str(), ".step: model_output ", model_output.sizes(),
              " and sample ", sample.sizes(), " must have the same shape");
}

// ---- FlowMatchEulerDiscreteScheduler ----

FlowMatchEulerDiscreteScheduler::FlowMatchEulerDiscreteScheduler(FlowMatchConfig config) : config_(config) {
  const int64_t n = config_.num_train_timesteps;
  const auto shift = static_cast<float>(config_.shift);
  std::vector<float> table(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    float s = static_cast<float>(n - i) / static_cast<float>(n);
    if (!config_.use_dynamic_shifting) s = shift * s / (1.0f + (shift - 1.0f) * s);
    table[i] = s;
  }
  sigma_max_ = table.front();
  sigma_min_ = table.back();
}

void FlowMatchEulerDiscreteScheduler::set_timesteps(int64_t num_inference_steps) {
  check_steps(name(), num_inference_steps);
  FLAME_CHECK(!config_.use_dynamic_shifting, name().c_str(),
              ".set_timesteps: dynamic shifting needs mu; use set_timesteps(sigmas, mu) or set_flux_timesteps");
  const double t_train = static_cast<double>(config_.num_train_timesteps);
  std::vector<double> t = np_linspace(static_cast<double>(sigma_max_) * t_train,
                                      static_cast<double>(sigma_min_) * t_train, num_inference_steps);
  std::vector<float> sigmas(t.size());
  for (std::size_t i = 0; i < t.size(); ++i) {
    const double s = t[i] / t_train;
    sigmas[i] = static_cast<float>(config_.shift * s / (1.0 + (config_.shift - 1.0) * s));
  }
  finish(std::move(sigmas));
}

void FlowMatchEulerDiscreteScheduler::set_timesteps(const std::vector<double>& given, std::optional<double> mu) {
  check_steps(name(), static_cast<int64_t>(given.size()));
  FLAME_CHECK(!config_.use_dynamic_shifting || mu.has_value(), name().c_str(),
              ".set_timesteps: dynamic shifting is on, so mu must be given (flux_mu of the image token count)");
  std::vector<float> sigmas(given.size());
  const auto shift = static_cast<float>(config_.shift);
  const float e = config_.use_dynamic_shifting ? static_cast<float>(std::exp(*mu)) : 0.0f;
  for (std::size_t i = 0; i < given.size(); ++i) {
    const auto s = static_cast<float>(given[i]);
    FLAME_CHECK(s > 0.0f && s <= 1.0f, name().c_str(), ".set_timesteps: sigma ", given[i], " (index ", i,
                ") is outside (0, 1]");
    sigmas[i] = config_.use_dynamic_shifting ? e / (e + (1.0f / s - 1.0f)) : shift * s / (1.0f + (shift - 1.0f) * s);
  }
  finish(std::move(sigmas));
}

void FlowMatchEulerDiscreteScheduler::set_flux_timesteps(int64_t num_inference_steps, int64_t image_seq_len) {
  check_steps(name(), num_inference_steps);
  const double n = static_cast<double>(num_inference_steps);
  set_timesteps(np_linspace(1.0, 1.0 / n, num_inference_steps), flux_mu(image_seq_len, config_));
}

void FlowMatchEulerDiscreteScheduler::finish(std::vector<float> sigmas) {
  timesteps_.resize(sigmas.size());
  const auto t_train = static_cast<float>(config_.num_train_timesteps);
  for (std::size_t i = 0; i < sigmas.size(); ++i) timesteps_[i] = sigmas[i] * t_train;
  sigmas.push_back(0.0f);
  sigmas_ = std::move(sigmas);
  step_index_ = 0;
}

Tensor FlowMatchEulerDiscreteScheduler::step(const Tensor& model_output, const Tensor& sample, const Tensor&) {
  check_step(model_output, sample);
  const float dt = sigmas_[step_index_ + 1] - sigmas_[step_index_];
  Tensor prev = sample.to(DType::f32) + model_output.to(DType::f32) * dt;
  ++step_index_;
  return prev.to(model_output.dtype());
}

// ---- the discrete schedulers ----

DiscreteScheduler::DiscreteScheduler(DiscreteSchedulerConfig config) : config_(std::move(config)) {
  FLAME_CHECK(config_.prediction_type == "epsilon" || config_.prediction_type == "v_prediction", "scheduler",
              "prediction_type \"", config_.prediction_type, "\" is not supported (\"epsilon\" or \"v_prediction\")");
  FLAME_CHECK(config_.timestep_spacing == "leading" || config_.timestep_spacing == "trailing" ||
                  config_.timestep_spacing == "linspace",
              "scheduler", "timestep_spacing \"", config_.timestep_spacing,
              "\" is not one of leading, trailing, linspace");
  const std::vector<float> ac = alphas_cumprod(config_);
  train_sigmas_.resize(ac.size());
  log_train_sigmas_.resize(ac.size());
  for (std::size_t i = 0; i < ac.size(); ++i) {
    train_sigmas_[i] = f32_sqrt((1.0f - ac[i]) / ac[i]);
    log_train_sigmas_[i] = static_cast<float>(std::log(static_cast<double>(train_sigmas_[i])));
  }
}

std::vector<double> DiscreteScheduler::spaced_timesteps(int64_t n) const {
  const int64_t T = config_.num_train_timesteps;
  std::vector<double> t;
  if (config_.timestep_spacing == "linspace") {
    for (double v : np_linspace(0.0, static_cast<double>(T - 1), n)) t.push_back(static_cast<float>(v));
    std::reverse(t.begin(), t.end());
  } else if (config_.timestep_spacing == "leading") {
    const int64_t ratio = T / n;
    for (int64_t i = n - 1; i >= 0; --i) t.push_back(static_cast<double>(i * ratio + config_.steps_offset));
  } else {
    const double ratio = static_cast<double>(T) / static_cast<double>(n);
    const auto count = static_cast<int64_t>(std::ceil(static_cast<double>(T) / ratio));
    for (int64_t i = 0; i < count; ++i) t.push_back(round_half_even(static_cast<double>(T) - i * ratio) - 1.0);
  }
  return t;
}

double DiscreteScheduler::interp_sigma(double t) const {
  const auto last = static_cast<double>(train_sigmas_.size() - 1);
  if (t <= 0) return train_sigmas_.front();
  if (t >= last) return train_sigmas_.back();
  const auto j = static_cast<std::size_t>(std::floor(t));
  const double lo = train_sigmas_[j], hi = train_sigmas_[j + 1];
  if (t == static_cast<double>(j)) return lo;
  const double slope = hi - lo;  // xp spacing is 1
  return slope * (t - static_cast<double>(j)) + lo;
}

double DiscreteScheduler::sigma_to_t(double sigma) const {
  const double log_sigma = std::log(std::max(sigma, 1e-10));
  const auto n = static_cast<int64_t>(log_train_sigmas_.size());
  // The last index whose log sigma is <= log_sigma (0 when none), at most n - 2.
  int64_t low = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (log_sigma - static_cast<double>(log_train_sigmas_[i]) >= 0) low = i;
  }
  low = std::min(low, n - 2);
  const double lo = log_train_sigmas_[low], hi = log_train_sigmas_[low + 1];
  const double w = std::clamp((lo - log_sigma) / (lo - hi), 0.0, 1.0);
  return (1.0 - w) * static_cast<double>(low) + w * static_cast<double>(low + 1);
}

std::vector<double> DiscreteScheduler::karras(double sigma_min, double sigma_max, int64_t n) {
  const double rho = 7.0;
  const double min_inv = std::pow(sigma_min, 1.0 / rho), max_inv = std::pow(sigma_max, 1.0 / rho);
  std::vector<double> out;
  for (double r : np_linspace(0.0, 1.0, n)) out.push_back(std::pow(max_inv + r * (min_inv - max_inv), rho));
  return out;
}

namespace {

// Euler's and Euler-ancestral's x0 prediction at sigma (f32 tensors).
Tensor predict_x0(const std::string& prediction, const Tensor& model_output, const Tensor& sample, float sigma) {
  if (prediction == "epsilon") return sample - model_output * sigma;
  const float s2p1 = sigma * sigma + 1.0f;
  return model_output * (-sigma / f32_sqrt(s2p1)) + sample / s2p1;
}


}  // namespace

EulerDiscreteScheduler::EulerDiscreteScheduler(DiscreteSchedulerConfig config) : DiscreteScheduler(std::move(config)) {}

void EulerDiscreteScheduler::set_timesteps(int64_t n) {
  check_steps(name(), n);
  std::vector<double> t = spaced_timesteps(n);
  std::vector<double> s;
  for (double v : t) s.push_back(interp_sigma(v));
  if (config_.use_karras_sigmas) {
    s = karras(s.back(), s.front(), n);
    t.clear();
    for (double v : s) t.push_back(sigma_to_t(v));
  }
  timesteps_.assign(t.begin(), t.end());
  sigmas_.assign(s.begin(), s.end());
  sigmas_.push_back(0.0f);
  step_index_ = 0;
}

double EulerDiscreteScheduler::init_noise_sigma() const {
  const std::vector<float>& sigmas = sigmas_.empty() ? train_sigmas_ : sigmas_;
  const float max_sigma = *std::max_element(sigmas.begin(), sigmas.end());
  if (config_.timestep_spacing == "linspace" || config_.timestep_spacing == "trailing") return max_sigma;
  return f32_sqrt(max_sigma * max_sigma + 1.0f);
}

Tensor EulerDiscreteScheduler::scale_model_input(const Tensor& sample) const {
  FLAME_CHECK(step_index_ < num_steps(), name().c_str(), ".scale_model_input: call set_timesteps first (or steps are done)");
  const float sigma = sigmas_[step_index_];
  return sample / f32_sqrt(sigma * sigma + 1.0f);
}

Tensor EulerDiscreteScheduler::step(const Tensor& model_output, const Tensor& sample_in, const Tensor&) {
  check_step(model_output, sample_in);
  const Tensor sample = sample_in.to(DType::f32), out = model_output.to(DType::f32);
  const float sigma = sigmas_[step_index_];  // s_churn 0: sigma_hat = sigma
  const Tensor x0 = predict_x0(config_.prediction_type, out, sample, sigma);
  const Tensor derivative = (sample - x0) / sigma;
  const float dt = sigmas_[step_index_ + 1] - sigma;
  ++step_index_;
  return (sample + derivative * dt).to(model_output.dtype());
}

EulerAncestralDiscreteScheduler::EulerAncestralDiscreteScheduler(DiscreteSchedulerConfig config)
    : EulerDiscreteScheduler(std::move(config)) {
  FLAME_CHECK(!config_.use_karras_sigmas, name().c_str(), ": Karras sigmas are not part of diffusers' Euler-ancestral");
}

void EulerAncestralDiscreteScheduler::set_timesteps(int64_t n) {
  check_steps(name(), n);
  std::vector<double> t = spaced_timesteps(n);
  timesteps_.assign(t.begin(), t.end());
  sigmas_.clear();
  for (float v : timesteps_) sigmas_.push_back(static_cast<float>(interp_sigma(v)));
  sigmas_.push_back(0.0f);
  step_index_ = 0;
}

Tensor EulerAncestralDiscreteScheduler::step(const Tensor& model_output, const Tensor& sample_in, const Tensor& noise) {
  check_step(model_output, sample_in);
  FLAME_CHECK(noise.defined() && noise.sizes() == sample_in.sizes(), name().c_str(),
              ".step: the ancestral step needs noise of the sample's shape ", sample_in.sizes(), "; got ",
              noise.defined() ? noise.sizes() : flame::Shape{});
  const Tensor sample = sample_in.to(DType::f32), out = model_output.to(DType::f32);
  const float sigma = sigmas_[step_index_], sigma_to = sigmas_[step_index_ + 1];
  const Tensor x0 = predict_x0(config_.prediction_type, out, sample, sigma);
  const float sigma_up = f32_sqrt(sigma_to * sigma_to * (sigma * sigma - sigma_to * sigma_to) / (sigma * sigma));
  const float sigma_down = f32_sqrt(sigma_to * sigma_to - sigma_up * sigma_up);
  const Tensor derivative = (sample - x0) / sigma;
  Tensor prev = sample + derivative * (sigma_down - sigma);
  prev = prev + noise.to(model_output.dtype()).to(DType::f32) * sigma_up;
  ++step_index_;
  return prev.to(model_output.dtype());
}

DPMSolverMultistepScheduler::DPMSolverMultistepScheduler(DiscreteSchedulerConfig config)
    : DiscreteScheduler(std::move(config)) {}

void DPMSolverMultistepScheduler::set_timesteps(int64_t n) {
  check_steps(name(), n);
  const int64_t T = config_.num_train_timesteps;  // lambda_min_clipped = -inf: nothing clipped
  std::vector<double> t;
  if (config_.timestep_spacing == "linspace") {
    std::vector<double> v = np_linspace(0.0, static_cast<double>(T - 1), n + 1);
    for (int64_t i = n; i >= 1; --i) t.push_back(round_half_even(v[i]));
  } else if (config_.timestep_spacing == "leading") {
    const int64_t ratio = T / (n + 1);
    for (int64_t i = n; i >= 1; --i) t.push_back(static_cast<double>(i * ratio + config_.steps_offset));
  } else {
    const double ratio = static_cast<double>(T) / static_cast<double>(n);
    const auto count = static_cast<int64_t>(std::ceil(static_cast<double>(T) / ratio));
    for (int64_t i = 0; i < count; ++i) t.push_back(round_half_even(static_cast<double>(T) - i * ratio) - 1.0);
  }
  std::vector<double> s;
  if (config_.use_karras_sigmas) {
    s = karras(train_sigmas_.front(), train_sigmas_.back(), n);
    t.clear();
    for (double v : s) t.push_back(round_half_even(sigma_to_t(v)));
  } else {
    for (double v : t) s.push_back(interp_sigma(v));
  }
  timesteps_.assign(t.begin(), t.end());
  sigmas_.assign(s.begin(), s.end());
  sigmas_.push_back(0.0f);
  step_index_ = 0;
  lower_order_nums_ = 0;
  previous_x0_ = Tensor();
}

namespace {

struct AlphaSigma {
  float alpha, sigma, lambda;
};

AlphaSigma alpha_sigma(float sigma) {
  const float alpha = 1.0f / f32_sqrt(sigma * sigma + 1.0f);
  const float sigma_t = sigma * alpha;
  return {alpha, sigma_t, std::log(alpha) - std::log(sigma_t)};
}

}  // namespace

Tensor DPMSolverMultistepScheduler::convert_model_output(const Tensor& out, const Tensor& sample) const {
  const AlphaSigma a = alpha_sigma(sigmas_[step_index_]);
  if (config_.prediction_type == "epsilon") return (sample - out * a.sigma) / a.alpha;
  return sample * a.alpha - out * a.sigma;
}

Tensor DPMSolverMultistepScheduler::step(const Tensor& model_output, const Tensor& sample_in, const Tensor&) {
  check_step(model_output, sample_in);
  const Tensor sample = sample_in.to(DType::f32);
  const Tensor x0 = convert_model_output(model_output.to(DType::f32), sample);
  // final_sigmas_type "zero": the last step is first order.
  const bool last = step_index_ == num_steps() - 1;
  const AlphaSigma t = alpha_sigma(sigmas_[step_index_ + 1]);
  const AlphaSigma s0 = alpha_sigma(sigmas_[step_index_]);
  const float h = t.lambda - s0.lambda;
  const float c = t.alpha * (std::exp(-h) - 1.0f);
  Tensor prev;
  if (lower_order_nums_ < 1 || last) {
    prev = sample * (t.sigma / s0.sigma) - x0 * c;
  } else {
    const AlphaSigma s1 = alpha_sigma(sigmas_[step_index_ - 1]);
    const float h0 = s0.lambda - s1.lambda;
    const float r0 = h0 / h;
    const Tensor d1 = (x0 - previous_x0_) * (1.0f / r0);
    prev = sample * (t.sigma / s0.sigma) - x0 * c - d1 * (0.5f * c);
  }
  previous_x0_ = x0;
  if (lower_order_nums_ < 2) ++lower_order_nums_;
  ++step_index_;
  return prev.to(model_output.dtype());
}

std::vector<std::string> discrete_sampler_names() {
  return {"euler", "euler-karras", "euler-a", "dpm++2m", "dpm++2m-karras"};
}

std::unique_ptr<Scheduler> make_discrete_scheduler(const std::string& sampler, DiscreteSchedulerConfig config) {
  if (sampler == "euler" || sampler == "euler-karras") {
    config.use_karras_sigmas = sampler == "euler-karras";
    return std::make_unique<EulerDiscreteScheduler>(std::move(config));
  }
  if (sampler == "euler-a") {
    config.use_karras_sigmas = false;
    return std::make_unique<EulerAncestralDiscreteScheduler>(std::move(config));
  }
  if (sampler == "dpm++2m" || sampler == "dpm++2m-karras") {
    config.use_karras_sigmas = sampler == "dpm++2m-karras";
    return std::make_unique<DPMSolverMultistepScheduler>(std::move(config));
  }
  std::string names;
  for (const std::string& n : discrete_sampler_names()) names += (names.empty() ? "" : ", ") + n;
  FLAME_FAIL("make_discrete_scheduler", "unknown sampler \"", sampler, "\"; the SDXL samplers are ", names);
}

}  // namespace flame_diffusion::models
