#include "objective.h"

#include <algorithm>
#include <cmath>

namespace flame_diffusion {

using flame::DType;

namespace {

Tensor per_sample(const Tensor& v, const Tensor& like) {  // [B] -> [B, 1, 1, 1] in like's dtype
  return v.to(like.dtype()).reshape({v.size(0), 1, 1, 1});
}

void check_batch(const char* who, const Tensor& x0, const Tensor& y) {
  FLAME_CHECK(x0.dim() == 4, who, "x0 must be [B, C, H, W], got ", x0.sizes());
  FLAME_CHECK(y.dim() == 1 && y.size(0) == x0.size(0), who, "y must be [", x0.size(0), "], got ", y.sizes());
}

}  // namespace

Tensor RectifiedFlow::interpolate(const Tensor& x0, const Tensor& eps, const Tensor& t) {
  Tensor tt = per_sample(t, x0);
  return x0 * (1.0 - tt) + eps * tt;
}

Tensor RectifiedFlow::sample_t(int64_t n, flame::Device device, flame::Generator* gen, double mean, double std) {
  return Tensor::randn({n}, mean, std, {DType::f32, device}, gen).sigmoid();
}

Tensor RectifiedFlow::loss_at(DiffusionModel& model, const Tensor& x0, const Tensor& y, const Tensor& eps,
                              const Tensor& t) const {
  check_batch("RectifiedFlow::loss", x0, y);
  FLAME_CHECK(eps.sizes() == x0.sizes(), "RectifiedFlow::loss", "noise ", eps.sizes(), " must match x0 ", x0.sizes());
  Tensor v = model.forward(interpolate(x0, eps, t), t, y);
  return (v - velocity_target(x0, eps)).square().mean();
}

Tensor RectifiedFlow::loss(DiffusionModel& model, const Tensor& x0, const Tensor& y, flame::Generator* gen) const {
  Tensor eps = Tensor::randn(x0.sizes(), 0.0, 1.0, {x0.dtype(), x0.device()}, gen);
  return loss_at(model, x0, y, eps, sample_t(x0.size(0), x0.device(), gen));
}

BetaSchedule parse_beta_schedule(const std::string& name) {
  if (name == "linear") return BetaSchedule::linear;
  if (name == "cosine") return BetaSchedule::cosine;
  FLAME_FAIL("parse_beta_schedule", "unknown beta schedule '", name, "' (known: linear, cosine)");
}

DdpmSchedule DdpmSchedule::make(BetaSchedule kind, int64_t steps) {
  FLAME_CHECK(steps >= 2, "DdpmSchedule", "steps must be >= 2, got ", steps);
  DdpmSchedule s;
  s.kind = kind;
  s.betas.resize(static_cast<std::size_t>(steps));
  if (kind == BetaSchedule::linear) {
    // Ho et al.'s 1e-4 .. 0.02 for T = 1000, rescaled by 1000 / T for other lengths (as
    // improved-diffusion does) so the total noise stays comparable.
    const double scale = 1000.0 / static_cast<double>(steps);
    const double lo = scale * 1e-4, hi = scale * 0.02;
    for (int64_t i = 0; i < steps; ++i)
      s.betas[static_cast<std::size_t>(i)] = lo + (hi - lo) * static_cast<double>(i) / static_cast<double>(steps - 1);
  } else {
    const double pi = std::acos(-1.0), off = 0.008;
    auto abar = [&](double u) { return std::pow(std::cos((u + off) / (1.0 + off) * pi / 2.0), 2.0); };
    for (int64_t i = 0; i < steps; ++i) {
      const double t1 = static_cast<double>(i) / static_cast<double>(steps);
      const double t2 = static_cast<double>(i + 1) / static_cast<double>(steps);
      s.betas[static_cast<std::size_t>(i)] = std::min(1.0 - abar(t2) / abar(t1), 0.999);
    }
  }
  s.alphas_cumprod.resize(s.betas.size());
  double prod = 1.0;
  for (std::size_t i = 0; i < s.betas.size(); ++i) {
    prod *= 1.0 - s.betas[i];
    s.alphas_cumprod[i] = prod;
  }
  return s;
}

Tensor Ddpm::gather(const std::vector<double>& table, const Tensor& n, DType dtype) const {
  // The one table gathered from is alphas_cumprod (q_sample); cached per device and dtype.
  Tensor tab;
  {
    std::lock_guard<std::mutex> lock(table_cache_->mutex);
    const auto key = std::make_tuple(static_cast<int>(n.device().type), n.device().index, static_cast<int>(dtype));
    auto it = table_cache_->tables.find(key);
    if (it == table_cache_->tables.end())
      it = table_cache_->tables
               .emplace(key, Tensor::from_vec(table, {static_cast<int64_t>(table.size())}, n.device()).to(dtype))
               .first;
    tab = it->second;
  }
  return tab.index_select(0, n.to(DType::i64)).reshape({n.size(0), 1, 1, 1});
}

Tensor Ddpm::q_sample(const Tensor& x0, const Tensor& eps, const Tensor& n) const {
  Tensor abar = gather(schedule_.alphas_cumprod, n, x0.dtype());
  return x0 * abar.sqrt() + eps * (1.0 - abar).sqrt();
}

Tensor Ddpm::model_time(const Tensor& n) const {
  return n.to(DType::f32) / static_cast<double>(schedule_.steps());
}

Tensor Ddpm::loss_at(DiffusionModel& model, const Tensor& x0, const Tensor& y, const Tensor& eps,
                     const Tensor& n) const {
  check_batch("Ddpm::loss", x0, y);
  FLAME_CHECK(eps.sizes() == x0.sizes(), "Ddpm::loss", "noise ", eps.sizes(), " must match x0 ", x0.sizes());
  FLAME_CHECK(n.dim() == 1 && n.size(0) == x0.size(0), "Ddpm::loss", "timesteps must be [", x0.size(0), "], got ",
              n.sizes());
  Tensor pred = model.forward(q_sample(x0, eps, n), model_time(n), y);
  return (pred - eps).square().mean();
}

Tensor Ddpm::loss(DiffusionModel& model, const Tensor& x0, const Tensor& y, flame::Generator* gen) const {
  Tensor eps = Tensor::randn(x0.sizes(), 0.0, 1.0, {x0.dtype(), x0.device()}, gen);
  Tensor n = Tensor::randint(0, schedule_.steps(), {x0.size(0)}, {DType::i64, x0.device()}, gen);
  return loss_at(model, x0, y, eps, n);
}

std::unique_ptr<Objective> make_objective(const std::string& name) {
  if (name == "flow") return std::make_unique<RectifiedFlow>();
  if (name == "ddpm" || name == "ddpm-linear") return std::make_unique<Ddpm>(BetaSchedule::linear);
  if (name == "ddpm-cosine") return std::make_unique<Ddpm>(BetaSchedule::cosine);
  FLAME_FAIL("make_objective", "unknown objective '", name, "' (known: flow, ddpm, ddpm-linear, ddpm-cosine)");
}

}  // namespace flame_diffusion
