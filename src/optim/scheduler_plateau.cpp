// ReduceLROnPlateau: torch.optim.lr_scheduler.ReduceLROnPlateau, driven by a metric instead of the
// epoch count. It reads and lowers the optimizer's current rates, so it has no base rates of its
// own to restore (base_lrs in its state are the rates it found at construction).
#include <algorithm>
#include <cmath>
#include <limits>

#include "flame/error.h"
#include "flame/optim/scheduler.h"

namespace flame::optim {

ReduceLROnPlateau::ReduceLROnPlateau(Optimizer& opt, Options options) : LRScheduler(opt), o_(std::move(options)) {
  const char* op = "ReduceLROnPlateau";
  FLAME_CHECK(o_.factor >= 0.0 && o_.factor < 1.0, op, "factor must be in [0, 1), got ", o_.factor);
  FLAME_CHECK(o_.patience >= 0, op, "patience must be >= 0, got ", o_.patience);
  FLAME_CHECK(o_.cooldown >= 0, op, "cooldown must be >= 0, got ", o_.cooldown);
  FLAME_CHECK(o_.threshold >= 0.0 && std::isfinite(o_.threshold), op, "threshold must be finite and >= 0, got ",
              o_.threshold);
  FLAME_CHECK(o_.eps >= 0.0, op, "eps must be >= 0, got ", o_.eps);
  FLAME_CHECK(o_.min_lr.size() == 1 || o_.min_lr.size() == groups(), op, "min_lr has ", o_.min_lr.size(),
              " values; give one, or one per parameter group (", groups(), ")");
  min_lrs_ = o_.min_lr.size() == 1 ? std::vector<double>(groups(), o_.min_lr[0]) : o_.min_lr;
  for (std::size_t g = 0; g < groups(); ++g) {
    FLAME_CHECK(min_lrs_[g] >= 0.0, op, "min_lr of group ", g, " must be >= 0, got ", min_lrs_[g]);
  }
  // PyTorch's _reset(); no construction step: the rates stay as they are.
  best_ = o_.mode == Options::Mode::min ? std::numeric_limits<double>::infinity()
                                        : -std::numeric_limits<double>::infinity();
  last_epoch_ = 0;
  last_lrs_ = current_lrs();
}

bool ReduceLROnPlateau::is_better(double a, double best) const {
  const bool rel = o_.threshold_mode == Options::ThresholdMode::rel;
  if (o_.mode == Options::Mode::min) return rel ? a < best * (1.0 - o_.threshold) : a < best - o_.threshold;
  return rel ? a > best * (o_.threshold + 1.0) : a > best + o_.threshold;
}

void ReduceLROnPlateau::step(double metric) {
  FLAME_CHECK(opt_->num_param_groups() == groups(), "ReduceLROnPlateau::step", "the optimizer has ",
              opt_->num_param_groups(), " parameter groups, the scheduler was built for ", groups());
  ++last_epoch_;
  if (is_better(metric, best_)) {  // a NaN metric is never better: a bad epoch
    best_ = metric;
    num_bad_epochs_ = 0;
  } else {
    ++num_bad_epochs_;
  }
  if (cooldown_counter_ > 0) {
    --cooldown_counter_;
    num_bad_epochs_ = 0;  // bad epochs in cooldown do not count
  }
  if (num_bad_epochs_ > o_.patience) {
    for (std::size_t g = 0; g < groups(); ++g) {
      const double old_lr = opt_->lr(g);
      const double new_lr = std::max(old_lr * o_.factor, min_lrs_[g]);
      if (old_lr - new_lr > o_.eps) opt_->set_lr(new_lr, g);
    }
    cooldown_counter_ = o_.cooldown;
    num_bad_epochs_ = 0;
  }
  last_lrs_ = current_lrs();
}

void ReduceLROnPlateau::step() {
  FLAME_FAIL("ReduceLROnPlateau::step", "the schedule follows a metric: call step(metric) once per epoch with the "
             "validation loss (mode min) or score (mode max)");
}

std::vector<double> ReduceLROnPlateau::get_lr() {
  FLAME_FAIL("ReduceLROnPlateau::step", "the schedule follows a metric and has no rate for an epoch: call "
             "step(metric)");
}

void ReduceLROnPlateau::save_extra(StateDict& out) const {
  out.insert("best", Tensor::scalar(best_, DType::f64));
  out.insert("num_bad_epochs", Tensor::scalar(num_bad_epochs_, DType::i64));
  out.insert("cooldown_counter", Tensor::scalar(cooldown_counter_, DType::i64));
  out.insert("min_lrs", Tensor::from_vec(min_lrs_, {static_cast<int64_t>(min_lrs_.size())}));
}

void ReduceLROnPlateau::check_extra(const StateDict& state, const std::string& prefix) const {
  const char* op = "ReduceLROnPlateau::load_state_dict";
  const int64_t bad = state.at(prefix + "num_bad_epochs").item<int64_t>();
  const int64_t cool = state.at(prefix + "cooldown_counter").item<int64_t>();
  FLAME_CHECK(bad >= 0 && cool >= 0, op, "keys '", prefix, "num_bad_epochs' (", bad, ") and '", prefix,
              "cooldown_counter' (", cool, ") must be >= 0");
  FLAME_CHECK(!std::isnan(state.at(prefix + "best").item<double>()), op, "key '", prefix, "best' is NaN");
}

void ReduceLROnPlateau::load_extra(const StateDict& state, const std::string& prefix) {
  best_ = state.at(prefix + "best").item<double>();
  num_bad_epochs_ = state.at(prefix + "num_bad_epochs").item<int64_t>();
  cooldown_counter_ = state.at(prefix + "cooldown_counter").item<int64_t>();
  min_lrs_ = state.at(prefix + "min_lrs").to_vec<double>();
}

}  // namespace flame::optim
