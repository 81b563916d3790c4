// The schedules. Each get_lr() is PyTorch's chainable form (torch/optim/lr_scheduler.py), written
// with the same operations in the same order so the float64 results are PyTorch's bit for bit;
// closed_form_lr() is PyTorch's _get_closed_form_lr() where it has one.
#include <algorithm>
#include <cmath>
#include <numbers>

#include "flame/error.h"
#include "flame/optim/scheduler.h"

namespace flame::optim {

namespace {
constexpr double kPi = std::numbers::pi;

// Python's a % b for b > 0 (never negative).
int64_t py_mod(int64_t a, int64_t b) {
  const int64_t r = a % b;
  return r < 0 ? r + b : r;
}
// Python's a // b for b > 0 (rounds toward minus infinity).
int64_t py_floordiv(int64_t a, int64_t b) { return (a - py_mod(a, b)) / b; }
}  // namespace

// ---- ConstantLR ----

ConstantLR::ConstantLR(Optimizer& opt, double factor, int64_t total_iters)
    : LRScheduler(opt), factor_(factor), total_iters_(total_iters) {
  // PyTorch accepts factor 0 and then divides by it at total_iters.
  FLAME_CHECK(factor > 0.0 && factor <= 1.0, "ConstantLR", "factor must be in (0, 1], got ", factor);
  FLAME_CHECK(total_iters >= 0, "ConstantLR", "total_iters must be >= 0, got ", total_iters);
  initial_step();
}

std::vector<double> ConstantLR::get_lr() {
  std::vector<double> lrs = current_lrs();
  if (last_epoch_ == 0) {
    for (double& lr : lrs) lr = lr * factor_;
  } else if (last_epoch_ == total_iters_) {
    for (double& lr : lrs) lr = lr * (1.0 / factor_);
  }
  return lrs;
}

std::optional<std::vector<double>> ConstantLR::closed_form_lr() const {
  std::vector<double> lrs(groups());
  const double after = last_epoch_ >= total_iters_ ? 1.0 : 0.0;
  for (std::size_t g = 0; g < lrs.size(); ++g) lrs[g] = base_lrs_[g] * (factor_ + after * (1.0 - factor_));
  return lrs;
}

// ---- LinearLR ----

LinearLR::LinearLR(Optimizer& opt, double start_factor, double end_factor, int64_t total_iters)
    : LRScheduler(opt), start_factor_(start_factor), end_factor_(end_factor), total_iters_(total_iters) {
  FLAME_CHECK(start_factor > 0.0 && start_factor <= 1.0, "LinearLR", "start_factor must be in (0, 1], got ",
              start_factor);
  FLAME_CHECK(end_factor >= 0.0 && end_factor <= 1.0, "LinearLR", "end_factor must be in [0, 1], got ", end_factor);
  FLAME_CHECK(total_iters > 0, "LinearLR", "total_iters must be > 0, got ", total_iters);
  initial_step();
}

std::vector<double> LinearLR::get_lr() {
  std::vector<double> lrs = current_lrs();
  if (last_epoch_ == 0) {
    for (double& lr : lrs) lr = lr * start_factor_;
  } else if (last_epoch_ <= total_iters_) {
    const double diff = end_factor_ - start_factor_;
    const double f = 1.0 + diff / (static_cast<double>(total_iters_) * start_factor_ +
                                   static_cast<double>(last_epoch_ - 1) * diff);
    for (double& lr : lrs) lr = lr * f;
  }
  return lrs;
}

std::optional<std::vector<double>> LinearLR::closed_form_lr() const {
  std::vector<double> lrs(groups());
  const double t = static_cast<double>(std::min(total_iters_, last_epoch_));
  for (std::size_t g = 0; g < lrs.size(); ++g) {
    lrs[g] = base_lrs_[g] * (start_factor_ + (end_factor_ - start_factor_) * t / static_cast<double>(total_iters_));
  }
  return lrs;
}

// ---- CosineAnnealingLR ----

CosineAnnealingLR::CosineAnnealingLR(Optimizer& opt, int64_t T_max, double eta_min)
    : LRScheduler(opt), t_max_(T_max), eta_min_(eta_min) {
  FLAME_CHECK(T_max > 0, "CosineAnnealingLR", "T_max must be > 0, got ", T_max);
  initial_step();
}

std::vector<double> CosineAnnealingLR::get_lr() {
  std::vector<double> lrs = current_lrs();
  const double t = static_cast<double>(t_max_);
  const double e = static_cast<double>(last_epoch_);
  if (last_epoch_ == 0) return lrs;
  if (py_mod(last_epoch_ - 1 - t_max_, 2 * t_max_) == 0) {
    // Leaving the floor: the ratio form would divide by 1 + cos(pi) = 0.
    for (std::size_t g = 0; g < lrs.size(); ++g) {
      lrs[g] = lrs[g] + (base_lrs_[g] - eta_min_) * (1.0 - std::cos(kPi / t)) / 2.0;
    }
    return lrs;
  }
  const double ratio = (1.0 + std::cos(kPi * e / t)) / (1.0 + std::cos(kPi * (e - 1.0) / t));
  for (double& lr : lrs) lr = ratio * (lr - eta_min_) + eta_min_;
  return lrs;
}

std::optional<std::vector<double>> CosineAnnealingLR::closed_form_lr() const {
  std::vector<double> lrs(groups());
  const double c = 1.0 + std::cos(kPi * static_cast<double>(last_epoch_) / static_cast<double>(t_max_));
  for (std::size_t g = 0; g < lrs.size(); ++g) lrs[g] = eta_min_ + (base_lrs_[g] - eta_min_) * c / 2.0;
  return lrs;
}

// ---- StepLR ----

StepLR::StepLR(Optimizer& opt, int64_t step_size, double gamma) : LRScheduler(opt), step_size_(step_size), gamma_(gamma) {
  FLAME_CHECK(step_size > 0, "StepLR", "step_size must be > 0, got ", step_size);
  initial_step();
}

std::vector<double> StepLR::get_lr() {
  std::vector<double> lrs = current_lrs();
  if (last_epoch_ != 0 && py_mod(last_epoch_, step_size_) == 0) {
    for (double& lr : lrs) lr = lr * gamma_;
  }
  return lrs;
}

std::optional<std::vector<double>> StepLR::closed_form_lr() const {
  std::vector<double> lrs(groups());
  const double k = static_cast<double>(py_floordiv(last_epoch_, step_size_));
  for (std::size_t g = 0; g < lrs.size(); ++g) lrs[g] = base_lrs_[g] * std::pow(gamma_, k);
  return lrs;
}

// ---- MultiStepLR ----

MultiStepLR::MultiStepLR(Optimizer& opt, std::vector<int64_t> milestones, double gamma)
    : LRScheduler(opt), milestones_(std::move(milestones)), gamma_(gamma) {
  std::sort(milestones_.begin(), milestones_.end());
  initial_step();
}

std::vector<double> MultiStepLR::get_lr() {
  std::vector<double> lrs = current_lrs();
  const auto n = std::count(milestones_.begin(), milestones_.end(), last_epoch_);
  if (n > 0) {
    const double f = std::pow(gamma_, static_cast<double>(n));
    for (double& lr : lrs) lr = lr * f;
  }
  return lrs;
}

std::optional<std::vector<double>> MultiStepLR::closed_form_lr() const {
  std::vector<double> lrs(groups());
  const auto k = std::upper_bound(milestones_.begin(), milestones_.end(), last_epoch_) - milestones_.begin();
  for (std::size_t g = 0; g < lrs.size(); ++g) lrs[g] = base_lrs_[g] * std::pow(gamma_, static_cast<double>(k));
  return lrs;
}

// ---- ExponentialLR ----

ExponentialLR::ExponentialLR(Optimizer& opt, double gamma) : LRScheduler(opt), gamma_(gamma) { initial_step(); }

std::vector<double> ExponentialLR::get_lr() {
  std::vector<double> lrs = current_lrs();
  if (last_epoch_ != 0) {
    for (double& lr : lrs) lr = lr * gamma_;
  }
  return lrs;
}

std::optional<std::vector<double>> ExponentialLR::closed_form_lr() const {
  std::vector<double> lrs(groups());
  for (std::size_t g = 0; g < lrs.size(); ++g) {
    lrs[g] = base_lrs_[g] * std::pow(gamma_, static_cast<double>(last_epoch_));
  }
  return lrs;
}

// ---- LambdaLR ----

LambdaLR::LambdaLR(Optimizer& opt, Lambda lr_lambda) : LRScheduler(opt) {
  FLAME_CHECK(static_cast<bool>(lr_lambda), "LambdaLR", "lr_lambda is empty");
  lambdas_.assign(groups(), lr_lambda);
  initial_step();
}

LambdaLR::LambdaLR(Optimizer& opt, std::vector<Lambda> lr_lambdas) : LRScheduler(opt), lambdas_(std::move(lr_lambdas)) {
  FLAME_CHECK(lambdas_.size() == groups(), "LambdaLR", "expected ", groups(), " lr_lambdas (one per parameter group), got ",
              lambdas_.size());
  for (std::size_t g = 0; g < lambdas_.size(); ++g) {
    FLAME_CHECK(static_cast<bool>(lambdas_[g]), "LambdaLR", "lr_lambdas[", g, "] is empty");
  }
  initial_step();
}

std::vector<double> LambdaLR::get_lr() {
  std::vector<double> lrs(groups());
  for (std::size_t g = 0; g < lrs.size(); ++g) lrs[g] = base_lrs_[g] * lambdas_[g](last_epoch_);
  return lrs;
}

// ---- MultiplicativeLR ----

MultiplicativeLR::MultiplicativeLR(Optimizer& opt, Lambda lr_lambda) : LRScheduler(opt) {
  FLAME_CHECK(static_cast<bool>(lr_lambda), "MultiplicativeLR", "lr_lambda is empty");
  lambdas_.assign(groups(), lr_lambda);
  initial_step();
}

MultiplicativeLR::MultiplicativeLR(Optimizer& opt, std::vector<Lambda> lr_lambdas)
    : LRScheduler(opt), lambdas_(std::move(lr_lambdas)) {
  FLAME_CHECK(lambdas_.size() == groups(), "MultiplicativeLR", "expected ", groups(),
              " lr_lambdas (one per parameter group), got ", lambdas_.size());
  for (std::size_t g = 0; g < lambdas_.size(); ++g) {
    FLAME_CHECK(static_cast<bool>(lambdas_[g]), "MultiplicativeLR", "lr_lambdas[", g, "] is empty");
  }
  initial_step();
}

std::vector<double> MultiplicativeLR::get_lr() {
  std::vector<double> lrs = current_lrs();
  if (last_epoch_ > 0) {
    for (std::size_t g = 0; g < lrs.size(); ++g) lrs[g] = lrs[g] * lambdas_[g](last_epoch_);
  }
  return lrs;
}

// ---- PolynomialLR ----

PolynomialLR::PolynomialLR(Optimizer& opt, int64_t total_iters, double power)
    : LRScheduler(opt), total_iters_(total_iters), power_(power) {
  // PyTorch divides by total_iters without a check (0 raises ZeroDivisionError at the first step).
  FLAME_CHECK(total_iters > 0, "PolynomialLR", "total_iters must be > 0, got ", total_iters);
  FLAME_CHECK(std::isfinite(power), "PolynomialLR", "power must be finite, got ", power);
  initial_step();
}

std::vector<double> PolynomialLR::get_lr() {
  std::vector<double> lrs = current_lrs();
  if (last_epoch_ == 0 || last_epoch_ > total_iters_) return lrs;
  const double t = static_cast<double>(total_iters_);
  const double decay = std::pow((1.0 - static_cast<double>(last_epoch_) / t) /
                                    (1.0 - static_cast<double>(last_epoch_ - 1) / t),
                                power_);
  for (double& lr : lrs) lr = lr * decay;
  return lrs;
}

std::optional<std::vector<double>> PolynomialLR::closed_form_lr() const {
  std::vector<double> lrs(groups());
  const double t = static_cast<double>(total_iters_);
  const double e = static_cast<double>(std::min(total_iters_, last_epoch_));
  for (std::size_t g = 0; g < lrs.size(); ++g) lrs[g] = base_lrs_[g] * std::pow(1.0 - e / t, power_);
  return lrs;
}

// ---- OneCycleLR ----

OneCycleLR::OneCycleLR(Optimizer& opt, OneCycleOptions options) : LRScheduler(opt), o_(std::move(options)) {
  const char* op = "OneCycleLR";
  if (o_.total_steps != 0) {
    FLAME_CHECK(o_.total_steps > 0, op, "total_steps must be > 0, got ", o_.total_steps);
    total_steps_ = o_.total_steps;
  } else {
    FLAME_CHECK(o_.epochs > 0 && o_.steps_per_epoch > 0, op,
                "give total_steps, or epochs and steps_per_epoch (both > 0); got epochs ", o_.epochs,
                ", steps_per_epoch ", o_.steps_per_epoch);
    total_steps_ = o_.epochs * o_.steps_per_epoch;
  }
  FLAME_CHECK(o_.pct_start >= 0.0 && o_.pct_start <= 1.0, op, "pct_start must be in [0, 1], got ", o_.pct_start);
  FLAME_CHECK(o_.div_factor > 0.0 && o_.final_div_factor > 0.0, op, "div_factor (", o_.div_factor,
              ") and final_div_factor (", o_.final_div_factor, ") must be > 0");
  FLAME_CHECK(o_.max_lr.size() == 1 || o_.max_lr.size() == groups(), op, "max_lr has ", o_.max_lr.size(),
              " values; give one, or one per parameter group (", groups(), ")");
  const double total = static_cast<double>(total_steps_);
  if (o_.three_phase) {
    phases_ = {{o_.pct_start * total - 1.0, 0, 1, true, false},
               {2.0 * o_.pct_start * total - 2.0, 1, 0, false, true},
               {total - 1.0, 0, 2, true, true}};
  } else {
    phases_ = {{o_.pct_start * total - 1.0, 0, 1, true, false}, {total - 1.0, 1, 2, false, true}};
  }
  // A phase of zero length would divide 0 by 0 (PyTorch raises ZeroDivisionError there).
  double start = 0.0;
  for (std::size_t i = 0; i < phases_.size(); ++i) {
    FLAME_CHECK(phases_[i].end_step != start, op, "phase ", i, " of the schedule has zero length (total_steps ",
                total_steps_, ", pct_start ", o_.pct_start, ")");
    start = phases_[i].end_step;
  }
  if (o_.cycle_momentum) {
    FLAME_CHECK(opt.has_momentum(), op, "cycle_momentum needs an optimizer with a momentum or beta1; ", opt.name(),
                " has none (pass cycle_momentum = false)");
    for (std::size_t g = 0; g < groups(); ++g) opt.set_momentum(o_.max_momentum, g);
  }
  std::vector<double> initial(groups());
  max_lr_.resize(groups());
  min_lr_.resize(groups());
  for (std::size_t g = 0; g < groups(); ++g) {
    max_lr_[g] = o_.max_lr.size() == 1 ? o_.max_lr[0] : o_.max_lr[g];
    initial[g] = max_lr_[g] / o_.div_factor;
    min_lr_[g] = initial[g] / o_.final_div_factor;
  }
  initial_lr_ = initial;
  set_initial_lrs(initial);
  initial_step();
}

double OneCycleLR::anneal(double start, double end, double pct) const {
  if (o_.anneal_strategy == OneCycleOptions::Anneal::cos) {
    const double cos_out = std::cos(kPi * pct) + 1.0;
    return end + (start - end) / 2.0 * cos_out;
  }
  return (end - start) * pct + start;
}

std::vector<double> OneCycleLR::get_lr() {
  FLAME_CHECK(last_epoch_ <= total_steps_, "OneCycleLR::step", "tried to step ", last_epoch_,
              " times; the schedule has total_steps ", total_steps_);
  const double step_num = static_cast<double>(last_epoch_);
  std::vector<double> lrs(groups()), momenta(groups());
  for (std::size_t g = 0; g < groups(); ++g) {
    const double lr_of[3] = {initial_lr_[g], max_lr_[g], min_lr_[g]};
    double start_step = 0.0;
    for (std::size_t i = 0; i < phases_.size(); ++i) {
      const Phase& p = phases_[i];
      if (step_num <= p.end_step || i + 1 == phases_.size()) {
        const double pct = (step_num - start_step) / (p.end_step - start_step);
        lrs[g] = anneal(lr_of[p.start_lr], lr_of[p.end_lr], pct);
        if (o_.cycle_momentum) {
          momenta[g] = anneal(p.start_momentum_max ? o_.max_momentum : o_.base_momentum,
                              p.end_momentum_max ? o_.max_momentum : o_.base_momentum, pct);
        }
        break;
      }
      start_step = p.end_step;
    }
  }
  if (o_.cycle_momentum) {
    for (std::size_t g = 0; g < groups(); ++g) opt_->set_momentum(momenta[g], g);
    last_momenta_ = momenta;
  }
  return lrs;
}

void OneCycleLR::save_extra(StateDict& out) const {
  out.insert("total_steps", Tensor::scalar(total_steps_, DType::i64));
  if (o_.cycle_momentum) out.insert("last_momenta", Tensor::from_vec(last_momenta_, {static_cast<int64_t>(groups())}));
}

void OneCycleLR::check_extra(const StateDict& state, const std::string& prefix) const {
  const int64_t total = state.at(prefix + "total_steps").item<int64_t>();
  FLAME_CHECK(total == total_steps_, "OneCycleLR::load_state_dict", "key '", prefix, "total_steps' is ", total,
              ", this scheduler was built with ", total_steps_);
  const int64_t epoch = state.at(prefix + "last_epoch").item<int64_t>();
  FLAME_CHECK(epoch <= total_steps_, "OneCycleLR::load_state_dict", "key '", prefix, "last_epoch' is ", epoch,
              ", past total_steps ", total_steps_);
}

void OneCycleLR::load_extra(const StateDict& state, const std::string& prefix) {
  if (!o_.cycle_momentum) return;
  last_momenta_ = state.at(prefix + "last_momenta").to_vec<double>();
  for (std::size_t g = 0; g < groups(); ++g) opt_->set_momentum(last_momenta_[g], g);
}

}  // namespace flame::optim
