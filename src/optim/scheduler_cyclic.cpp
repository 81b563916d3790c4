// Restarting and cyclic schedules: CosineAnnealingWarmRestarts and CyclicLR, written as
// torch/optim/lr_scheduler.py computes them (the same double operations in the same order).
#include <cmath>
#include <numbers>

#include "flame/error.h"
#include "flame/optim/scheduler.h"

namespace flame::optim {

namespace {
constexpr double kPi = std::numbers::pi;

// One value for every group, or one per group (PyTorch's _format_param).
std::vector<double> per_group(const char* op, const char* what, const std::vector<double>& v, std::size_t groups) {
  FLAME_CHECK(v.size() == 1 || v.size() == groups, op, what, " has ", v.size(),
              " values; give one, or one per parameter group (", groups, ")");
  return v.size() == 1 ? std::vector<double>(groups, v[0]) : v;
}

Tensor f64_vector(const std::vector<double>& v) { return Tensor::from_vec(v, {static_cast<int64_t>(v.size())}); }

void check_config(const StateDict& state, const std::string& prefix, const char* op, const char* key, double want) {
  const double got = state.at(prefix + key).item<double>();
  FLAME_CHECK(got == want, op, "key '", prefix, key, "' is ", got, ", this scheduler was built with ", want);
}
}  // namespace

// ---- CosineAnnealingWarmRestarts ----

CosineAnnealingWarmRestarts::CosineAnnealingWarmRestarts(Optimizer& opt, int64_t T_0, int64_t T_mult, double eta_min)
    : LRScheduler(opt), t_0_(T_0), t_mult_(T_mult), eta_min_(eta_min), t_i_(T_0) {
  FLAME_CHECK(T_0 > 0, "CosineAnnealingWarmRestarts", "expected a positive T_0, got ", T_0);
  FLAME_CHECK(T_mult >= 1, "CosineAnnealingWarmRestarts", "expected T_mult >= 1, got ", T_mult);
  FLAME_CHECK(std::isfinite(eta_min), "CosineAnnealingWarmRestarts", "eta_min must be finite, got ", eta_min);
  initial_step();
}

std::vector<double> CosineAnnealingWarmRestarts::get_lr() {
  std::vector<double> lrs(groups());
  for (std::size_t g = 0; g < lrs.size(); ++g) {
    lrs[g] = eta_min_ + (base_lrs_[g] - eta_min_) * (1.0 + std::cos(kPi * t_cur_ / static_cast<double>(t_i_))) / 2.0;
  }
  return lrs;
}

void CosineAnnealingWarmRestarts::step() {
  if (last_epoch_ < 0) {  // the construction step: epoch 0
    step_at(0.0);
    return;
  }
  const int64_t saved_i = t_i_;
  const double saved_cur = t_cur_;
  t_cur_ += 1.0;
  if (t_cur_ >= static_cast<double>(t_i_)) {
    t_cur_ -= static_cast<double>(t_i_);
    t_i_ *= t_mult_;
  }
  ++last_epoch_;
  try {
    apply(get_lr());
  } catch (...) {
    --last_epoch_;
    t_i_ = saved_i;
    t_cur_ = saved_cur;
    throw;
  }
}

void CosineAnnealingWarmRestarts::step(int64_t epoch) {
  FLAME_CHECK(epoch >= 0, "CosineAnnealingWarmRestarts::step", "epoch ", epoch, " is negative");
  step_at(static_cast<double>(epoch));
}

void CosineAnnealingWarmRestarts::step_at(double epoch) {
  FLAME_CHECK(epoch >= 0.0 && std::isfinite(epoch), "CosineAnnealingWarmRestarts::step", "expected a non-negative epoch, got ",
              epoch);
  const int64_t saved_i = t_i_, saved_epoch = last_epoch_;
  const double saved_cur = t_cur_;
  const double t0 = static_cast<double>(t_0_);
  if (epoch >= t0) {
    if (t_mult_ == 1) {
      t_cur_ = std::fmod(epoch, t0);  // Python's %: both operands are non-negative here
    } else {
      const double m = static_cast<double>(t_mult_);
      const auto n = static_cast<int64_t>(std::log(epoch / t0 * (m - 1.0) + 1.0) / std::log(m));
      int64_t mult_n = 1;  // T_mult^n, an integer as in Python
      for (int64_t k = 0; k < n; ++k) mult_n *= t_mult_;
      t_cur_ = epoch - static_cast<double>(t_0_ * (mult_n - 1)) / static_cast<double>(t_mult_ - 1);
      t_i_ = t_0_ * mult_n;
    }
  } else {
    t_i_ = t_0_;
    t_cur_ = epoch;
  }
  last_epoch_ = static_cast<int64_t>(std::floor(epoch));
  try {
    apply(get_lr());
  } catch (...) {
    last_epoch_ = saved_epoch;
    t_i_ = saved_i;
    t_cur_ = saved_cur;
    throw;
  }
}

void CosineAnnealingWarmRestarts::save_extra(StateDict& out) const {
  out.insert("T_0", Tensor::scalar(t_0_, DType::i64));
  out.insert("T_mult", Tensor::scalar(t_mult_, DType::i64));
  out.insert("T_i", Tensor::scalar(t_i_, DType::i64));
  out.insert("T_cur", Tensor::scalar(t_cur_, DType::f64));
}

void CosineAnnealingWarmRestarts::check_extra(const StateDict& state, const std::string& prefix) const {
  const char* op = "CosineAnnealingWarmRestarts::load_state_dict";
  check_config(state, prefix, op, "T_0", static_cast<double>(t_0_));
  check_config(state, prefix, op, "T_mult", static_cast<double>(t_mult_));
  const int64_t t_i = state.at(prefix + "T_i").item<int64_t>();
  const double t_cur = state.at(prefix + "T_cur").item<double>();
  FLAME_CHECK(t_i >= t_0_ && t_cur >= 0.0 && t_cur < static_cast<double>(t_i), op, "keys '", prefix, "T_i' (", t_i,
              ") and '", prefix, "T_cur' (", t_cur, ") do not describe a point of a period (T_0 ", t_0_, ")");
}

void CosineAnnealingWarmRestarts::load_extra(const StateDict& state, const std::string& prefix) {
  t_i_ = state.at(prefix + "T_i").item<int64_t>();
  t_cur_ = state.at(prefix + "T_cur").item<double>();
}

// ---- CyclicLR ----

CyclicLR::CyclicLR(Optimizer& opt, CyclicLROptions options) : LRScheduler(opt), o_(std::move(options)) {
  const char* op = "CyclicLR";
  const std::vector<double> base = per_group(op, "base_lr", o_.base_lr, groups());
  max_lrs_ = per_group(op, "max_lr", o_.max_lr, groups());
  const double down = o_.step_size_down.value_or(o_.step_size_up);
  FLAME_CHECK(o_.step_size_up > 0.0 && std::isfinite(o_.step_size_up) && down > 0.0 && std::isfinite(down), op,
              "step_size_up (", o_.step_size_up, ") and step_size_down (", down, ") must be positive");
  total_size_ = o_.step_size_up + down;
  step_ratio_ = o_.step_size_up / total_size_;
  if (o_.cycle_momentum) {
    FLAME_CHECK(opt.has_momentum(), op, "cycle_momentum needs an optimizer with a momentum or beta1; ", opt.name(),
                " has none (pass cycle_momentum = false)");
    base_momenta_ = per_group(op, "base_momentum", o_.base_momentum, groups());
    max_momenta_ = per_group(op, "max_momentum", o_.max_momentum, groups());
    for (std::size_t g = 0; g < groups(); ++g) opt.set_momentum(max_momenta_[g], g);
  }
  // As PyTorch: the optimizer's rates become base_lr, which is also the schedule's base.
  apply(base);
  set_initial_lrs(base);
  initial_step();
}

double CyclicLR::scale(double x) const {
  if (o_.scale_fn) return o_.scale_fn(x);
  switch (o_.mode) {
    case CyclicLROptions::Mode::triangular: return 1.0;
    case CyclicLROptions::Mode::triangular2: return 1.0 / std::pow(2.0, x - 1.0);
    case CyclicLROptions::Mode::exp_range: return std::pow(o_.gamma, x);
  }
  return 1.0;
}

std::vector<double> CyclicLR::get_lr() {
  const double e = static_cast<double>(last_epoch_);
  const double cycle = std::floor(1.0 + e / total_size_);
  const double x = 1.0 + e / total_size_ - cycle;
  const double scale_factor = x <= step_ratio_ ? x / step_ratio_ : (x - 1.0) / (step_ratio_ - 1.0);
  // triangular and triangular2 scale by the cycle number, exp_range by the iteration.
  const bool by_cycle = o_.scale_fn ? o_.scale_mode == CyclicLROptions::ScaleMode::cycle
                                    : o_.mode != CyclicLROptions::Mode::exp_range;
  const double s = scale(by_cycle ? cycle : e);
  std::vector<double> lrs(groups());
  for (std::size_t g = 0; g < lrs.size(); ++g) {
    const double base_height = (max_lrs_[g] - base_lrs_[g]) * scale_factor;
    lrs[g] = base_lrs_[g] + base_height * s;
  }
  if (o_.cycle_momentum) {
    std::vector<double> momenta(groups());
    for (std::size_t g = 0; g < momenta.size(); ++g) {
      const double base_height = (max_momenta_[g] - base_momenta_[g]) * scale_factor;
      momenta[g] = max_momenta_[g] - base_height * s;
    }
    for (std::size_t g = 0; g < momenta.size(); ++g) opt_->set_momentum(momenta[g], g);
    last_momenta_ = momenta;
  }
  return lrs;
}

void CyclicLR::save_extra(StateDict& out) const {
  out.insert("total_size", Tensor::scalar(total_size_, DType::f64));
  out.insert("step_ratio", Tensor::scalar(step_ratio_, DType::f64));
  if (o_.cycle_momentum) out.insert("last_momenta", f64_vector(last_momenta_));
}

void CyclicLR::check_extra(const StateDict& state, const std::string& prefix) const {
  check_config(state, prefix, "CyclicLR::load_state_dict", "total_size", total_size_);
  check_config(state, prefix, "CyclicLR::load_state_dict", "step_ratio", step_ratio_);
}

void CyclicLR::load_extra(const StateDict& state, const std::string& prefix) {
  if (!o_.cycle_momentum) return;
  last_momenta_ = state.at(prefix + "last_momenta").to_vec<double>();
  for (std::size_t g = 0; g < groups(); ++g) opt_->set_momentum(last_momenta_[g], g);
}

}  // namespace flame::optim
