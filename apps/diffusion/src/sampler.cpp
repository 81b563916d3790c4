#include "sampler.h"

#include <algorithm>
#include <cmath>

namespace flame_diffusion {

using flame::DType;

namespace {

// Times are f32 for the models (f64 only when the state is f64, as in the solver tests).
Tensor full_t(const Tensor& x, double t) {
  return Tensor::full({x.size(0)}, t, {x.dtype() == DType::f64 ? DType::f64 : DType::f32, x.device()});
}

void check_steps(const char* who, int64_t steps) {
  FLAME_CHECK(steps >= 1, who, "steps must be >= 1, got ", steps);
}

}  // namespace

ModelFn guided(DiffusionModel& model, const Tensor& labels, double cfg_scale) {
  FLAME_CHECK(labels.dim() == 1, "guided", "labels must be [B], got ", labels.sizes());
  FLAME_CHECK(std::isfinite(cfg_scale), "guided", "cfg scale must be finite, got ", cfg_scale);
  Tensor y = labels.to(DType::i64);
  Tensor y2 = flame::cat({y, Tensor::full(y.sizes(), model.null_class(), {DType::i64, y.device()})}, 0);
  return [&model, y2, cfg_scale](const Tensor& x, const Tensor& t) {
    Tensor out = model.forward(flame::cat({x, x}, 0), flame::cat({t, t}, 0), y2);
    flame::TensorList parts = out.chunk(2, 0);  // cond, uncond
    return parts[1] + (parts[0] - parts[1]) * cfg_scale;
  };
}

Tensor euler_solve(const ModelFn& velocity, const Tensor& x1, int64_t steps) {
  check_steps("euler_solve", steps);
  flame::NoGradGuard no_grad;
  Tensor x = x1;
  for (int64_t i = 0; i < steps; ++i) {
    const double t = 1.0 - static_cast<double>(i) / static_cast<double>(steps);
    const double t_next = 1.0 - static_cast<double>(i + 1) / static_cast<double>(steps);
    x = x + velocity(x, full_t(x, t)) * (t_next - t);
  }
  return x;
}

Tensor heun_solve(const ModelFn& velocity, const Tensor& x1, int64_t steps) {
  check_steps("heun_solve", steps);
  flame::NoGradGuard no_grad;
  Tensor x = x1;
  for (int64_t i = 0; i < steps; ++i) {
    const double t = 1.0 - static_cast<double>(i) / static_cast<double>(steps);
    const double t_next = 1.0 - static_cast<double>(i + 1) / static_cast<double>(steps);
    const double dt = t_next - t;
    Tensor d = velocity(x, full_t(x, t));
    Tensor x_pred = x + d * dt;
    // The flow's velocity is defined at t = 0 too, so the corrector runs on every step.
    Tensor d_next = velocity(x_pred, full_t(x, t_next));
    x = x + (d + d_next) * (0.5 * dt);
  }
  return x;
}

std::vector<int64_t> ddim_timesteps(int64_t T, int64_t steps) {
  FLAME_CHECK(steps >= 1 && steps <= T, "ddim_timesteps", "steps must be in [1, ", T, "], got ", steps);
  // Evenly spaced, always including the last timestep T-1 (the noisiest).
  std::vector<int64_t> ts(static_cast<std::size_t>(steps));
  for (int64_t i = 0; i < steps; ++i) {
    const double frac = steps == 1 ? 1.0 : static_cast<double>(steps - 1 - i) / static_cast<double>(steps - 1);
    ts[static_cast<std::size_t>(i)] = static_cast<int64_t>(std::llround(frac * static_cast<double>(T - 1)));
  }
  return ts;
}

Tensor ddim_solve(const ModelFn& eps_model, const DdpmSchedule& schedule, const Tensor& xT, int64_t steps, double eta,
                  flame::Generator* gen, bool clip_x0) {
  check_steps("ddim_solve", steps);
  FLAME_CHECK(eta >= 0.0, "ddim_solve", "eta must be >= 0, got ", eta);
  flame::NoGradGuard no_grad;
  const int64_t T = schedule.steps();
  const std::vector<int64_t> ts = ddim_timesteps(T, steps);
  Tensor x = xT;
  for (std::size_t i = 0; i < ts.size(); ++i) {
    const int64_t n = ts[i];
    const double ab = schedule.alphas_cumprod[static_cast<std::size_t>(n)];
    const double ab_prev = i + 1 < ts.size() ? schedule.alphas_cumprod[static_cast<std::size_t>(ts[i + 1])] : 1.0;
    Tensor eps = eps_model(x, full_t(x, static_cast<double>(n) / static_cast<double>(T)));
    Tensor x0 = (x - eps * std::sqrt(1.0 - ab)) / std::sqrt(ab);
    if (clip_x0) {
      x0 = x0.clamp(-1.0, 1.0);
      eps = (x - x0 * std::sqrt(ab)) / std::sqrt(1.0 - ab);  // keep eps consistent with the clipped x0
    }
    const double sigma = eta * std::sqrt((1.0 - ab_prev) / (1.0 - ab)) * std::sqrt(1.0 - ab / ab_prev);
    const double dir = std::sqrt(std::max(1.0 - ab_prev - sigma * sigma, 0.0));
    x = x0 * std::sqrt(ab_prev) + eps * dir;
    if (sigma > 0.0) x = x + Tensor::randn(x.sizes(), 0.0, sigma, {x.dtype(), x.device()}, gen);
  }
  return x;
}

SamplerKind parse_sampler(const std::string& name) {
  if (name == "euler") return SamplerKind::euler;
  if (name == "heun") return SamplerKind::heun;
  if (name == "ddim") return SamplerKind::ddim;
  if (name == "ddpm") return SamplerKind::ddpm;
  FLAME_FAIL("parse_sampler", "unknown sampler '", name, "' (known: euler, heun, ddim, ddpm)");
}

std::string sampler_name(SamplerKind kind) {
  switch (kind) {
    case SamplerKind::euler: return "euler";
    case SamplerKind::heun: return "heun";
    case SamplerKind::ddim: return "ddim";
    case SamplerKind::ddpm: return "ddpm";
  }
  return "?";
}

Tensor sample(DiffusionModel& model, const Objective& objective, const Tensor& labels, const SampleOptions& options) {
  FLAME_CHECK(labels.dim() == 1, "sample", "labels must be [B], got ", labels.sizes());
  flame::NoGradGuard no_grad;
  const bool training = model.is_training();
  model.eval();
  const flame::Device device = model.parameters().front().device();
  const DType dtype = model.parameters().front().dtype();
  Tensor y = labels.to(DType::i64).to(device);
  flame::Generator gen(options.seed);
  Tensor noise = Tensor::randn({y.size(0), model.in_channels(), model.image_size(), model.image_size()}, 0.0, 1.0,
                               {dtype, device}, &gen);
  ModelFn fn = guided(model, y, options.cfg_scale);
  if (options.on_model_call) {
    fn = [inner = std::move(fn), &options](const Tensor& x, const Tensor& t) {
      Tensor v = inner(x, t);
      options.on_model_call();
      return v;
    };
  }
  Tensor out;
  const auto* ddpm = dynamic_cast<const Ddpm*>(&objective);
  switch (options.sampler) {
    case SamplerKind::euler:
    case SamplerKind::heun:
      FLAME_CHECK(dynamic_cast<const RectifiedFlow*>(&objective) != nullptr, "sample", "sampler '",
                  sampler_name(options.sampler), "' needs the flow objective, not '", objective.name(), "'");
      out = options.sampler == SamplerKind::euler ? euler_solve(fn, noise, options.steps)
                                                  : heun_solve(fn, noise, options.steps);
      break;
    case SamplerKind::ddim:
    case SamplerKind::ddpm:
      FLAME_CHECK(ddpm != nullptr, "sample", "sampler '", sampler_name(options.sampler),
                  "' needs a DDPM objective, not '", objective.name(), "'");
      out = ddim_solve(fn, ddpm->schedule(), noise, options.steps,
                       options.sampler == SamplerKind::ddpm ? 1.0 : options.eta, &gen);
      break;
  }
  model.train(training);
  return out.clamp(-1.0, 1.0);
}

int64_t model_calls(const SampleOptions& options) {
  return options.sampler == SamplerKind::heun ? 2 * options.steps : options.steps;
}

}  // namespace flame_diffusion
