#pragma once
// Training objectives. Each gives loss(model, x0, y, gen): a scalar with its autograd graph.
//
// Rectified flow (Liu et al.; Esser et al. for the logit-normal t): straight paths
//   x_t = (1 - t) * x0 + t * eps,   t = 0 data, t = 1 noise,
// the model predicts the velocity v = dx_t/dt = eps - x0; t ~ logit-normal(0, 1), i.e.
// sigmoid(N(0, 1)); loss = mean((v_pred - v)^2). Samplers integrate from t = 1 to t = 0.
//
// DDPM (Ho et al.) epsilon prediction with T = 1000 steps and a linear (1e-4 .. 0.02) or cosine
// (Nichol & Dhariwal, s = 0.008, beta <= 0.999) beta schedule:
//   x_n = sqrt(abar_n) * x0 + sqrt(1 - abar_n) * eps,   n ~ U{0, .., T-1},
// the model sees t = n / T (Note [Time convention], embed.h); loss = mean((eps_pred - eps)^2).
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "embed.h"

namespace flame_diffusion {

class Objective {
 public:
  virtual ~Objective() = default;
  virtual std::string name() const = 0;
  // x0: [B, C, H, W] data in [-1, 1]; y: [B] labels (already label-dropped by the caller).
  // Noise and times are drawn from gen.
  virtual Tensor loss(DiffusionModel& model, const Tensor& x0, const Tensor& y, flame::Generator* gen) const = 0;
};

class RectifiedFlow : public Objective {
 public:
  std::string name() const override { return "flow"; }
  Tensor loss(DiffusionModel& model, const Tensor& x0, const Tensor& y, flame::Generator* gen) const override;
  // The same loss with given noise and times (tests, reproducible evaluation).
  Tensor loss_at(DiffusionModel& model, const Tensor& x0, const Tensor& y, const Tensor& eps, const Tensor& t) const;
  // x_t for t: [B] (broadcast over C, H, W).
  static Tensor interpolate(const Tensor& x0, const Tensor& eps, const Tensor& t);
  static Tensor velocity_target(const Tensor& x0, const Tensor& eps) { return eps - x0; }
  // t = sigmoid(z), z ~ N(mean, std): [n] f32 on `device`.
  static Tensor sample_t(int64_t n, flame::Device device, flame::Generator* gen, double mean = 0.0, double std = 1.0);
};

enum class BetaSchedule { linear, cosine };
BetaSchedule parse_beta_schedule(const std::string& name);  // "linear" / "cosine"; else an error

// Host-side tables of a DDPM noise schedule (double precision).
struct DdpmSchedule {
  BetaSchedule kind = BetaSchedule::linear;
  std::vector<double> betas;           // [T]
  std::vector<double> alphas_cumprod;  // [T]: abar_n = prod_{i <= n} (1 - beta_i)
  int64_t steps() const { return static_cast<int64_t>(betas.size()); }
  static DdpmSchedule make(BetaSchedule kind, int64_t steps = 1000);
};

class Ddpm : public Objective {
 public:
  explicit Ddpm(BetaSchedule kind = BetaSchedule::linear, int64_t steps = 1000)
      : schedule_(DdpmSchedule::make(kind, steps)) {}
  std::string name() const override {
    return schedule_.kind == BetaSchedule::linear ? "ddpm-linear" : "ddpm-cosine";
  }
  Tensor loss(DiffusionModel& model, const Tensor& x0, const Tensor& y, flame::Generator* gen) const override;
  // The loss with given noise and integer timesteps n: [B] i64 in [0, T).
  Tensor loss_at(DiffusionModel& model, const Tensor& x0, const Tensor& y, const Tensor& eps, const Tensor& n) const;
  // x_n = sqrt(abar_n) x0 + sqrt(1 - abar_n) eps.
  Tensor q_sample(const Tensor& x0, const Tensor& eps, const Tensor& n) const;
  // The model's time input for timesteps n: n / T as f32.
  Tensor model_time(const Tensor& n) const;
  const DdpmSchedule& schedule() const { return schedule_; }

 private:
  // abar (or another per-step table) gathered at n, shaped [B, 1, 1, 1] on n's device.
  Tensor gather(const std::vector<double>& table, const Tensor& n, flame::DType dtype) const;
  DdpmSchedule schedule_;
  // alphas_cumprod per (device type, device index, dtype), uploaded once: an upload per step would
  // wait on pinned staging and cannot be captured into a CUDA graph (--compile).
  struct TableCache {
    std::mutex mutex;
    std::map<std::tuple<int, int, int>, Tensor> tables;
  };
  std::shared_ptr<TableCache> table_cache_ = std::make_shared<TableCache>();
};

// "flow", "ddpm" (= ddpm-linear), "ddpm-linear", "ddpm-cosine"; unknown names raise an error.
std::unique_ptr<Objective> make_objective(const std::string& name);

}  // namespace flame_diffusion
