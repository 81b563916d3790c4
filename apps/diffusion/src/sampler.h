#pragma once
// Samplers. All run under NoGradGuard, draw their noise from a Generator seeded with
// SampleOptions::seed (the same seed gives the same images), and return [B, C, H, W] clamped to
// [-1, 1].
//
// Flow (RectifiedFlow, objective.h): integrate dx/dt = v(x, t) from t = 1 (noise) to t = 0 (data)
// on `steps` uniform steps: Euler (1 model call a step) or Heun (2: Euler predictor, trapezoid
// corrector). Epsilon models (Ddpm): DDIM (Song et al.) on `steps` evenly spaced timesteps;
// eta = 0 is deterministic DDIM, eta = 1 is DDPM's ancestral sampling (on all T steps it is
// exactly Ho et al.'s sampler with the posterior variance beta~).
//
// Classifier-free guidance: the conditional and null-class passes run as ONE batch (x doubled,
// y = [labels, null]); out = uncond + scale * (cond - uncond). scale 1 is the conditional model.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "embed.h"
#include "objective.h"

namespace flame_diffusion {

// A prediction function of (x [B, C, H, W], t [B] f32 in [0, 1]): velocity or epsilon.
using ModelFn = std::function<Tensor(const Tensor& x, const Tensor& t)>;

// The model with labels and guidance bound, batching the conditional and null-class passes.
ModelFn guided(DiffusionModel& model, const Tensor& labels, double cfg_scale);

// Flow ODE solvers from t = 1 to t = 0 starting at x1 (the noise); no clamping.
Tensor euler_solve(const ModelFn& velocity, const Tensor& x1, int64_t steps);
Tensor heun_solve(const ModelFn& velocity, const Tensor& x1, int64_t steps);

// DDIM / ancestral from x_T (noise) with an epsilon model; x0 predictions are clipped to
// [-1, 1] when clip_x0. eta > 0 draws fresh noise from gen.
Tensor ddim_solve(const ModelFn& eps_model, const DdpmSchedule& schedule, const Tensor& xT, int64_t steps,
                  double eta = 0.0, flame::Generator* gen = nullptr, bool clip_x0 = true);
// The DDIM timestep sequence (descending) for `steps` of a T-step schedule.
std::vector<int64_t> ddim_timesteps(int64_t T, int64_t steps);

enum class SamplerKind { euler, heun, ddim, ddpm };
SamplerKind parse_sampler(const std::string& name);  // "euler", "heun", "ddim", "ddpm"; else an error
std::string sampler_name(SamplerKind kind);

struct SampleOptions {
  SamplerKind sampler = SamplerKind::euler;
  int64_t steps = 32;
  double cfg_scale = 1.0;
  uint64_t seed = 0;
  double eta = 0.0;  // ddim only (ddpm means eta = 1)
  // Called after each model call (one batched forward; progress reports, stop checks). May throw,
  // which ends the sampling.
  std::function<void()> on_model_call = nullptr;
};

// Model calls one sample() makes: steps (euler, ddim, ddpm) or 2 x steps (heun).
int64_t model_calls(const SampleOptions& options);

// Class-conditional samples for labels [B] (i64, in [0, num_classes)) on the model's device.
// The sampler must fit the objective: euler/heun for "flow", ddim/ddpm for the DDPM objectives.
Tensor sample(DiffusionModel& model, const Objective& objective, const Tensor& labels, const SampleOptions& options);

}  // namespace flame_diffusion
