#pragma once
// Learning-rate schedulers with torch.optim.lr_scheduler's semantics and names. A scheduler drives
// an optim::Optimizer through its base interface only (num_param_groups, lr/set_lr,
// momentum/set_momentum), so it works with every optimizer.
//
//   optim::Optimizer& opt = ...;  // any optimizer (flame/optim/optimizers.h)
//   auto sched = optim::warmup_cosine(opt, /*warmup_steps=*/100, /*total_steps=*/10000);
//   for (int step = 0; step < 10000; ++step) {
//     ... opt.step(grads);
//     sched->step();  // after the optimizer step, as in PyTorch
//   }
//
// As in PyTorch: the base learning rates are the optimizer's at construction (Note [Initial
// learning rates] in src/optim/scheduler.cpp), construction performs the first step (last_epoch
// goes from -1 to 0 and the epoch-0 rate is written into the optimizer), step() advances by one,
// get_last_lr() returns the rates last written. step() uses PyTorch's chainable (recursive) form
// of each schedule, so the rates are PyTorch's to the last bit in float64 and schedulers compose
// (ChainedScheduler multiplies their factors); step(epoch) jumps to an epoch with the closed form,
// as PyTorch's deprecated step(epoch) (SequentialLR uses it to start a child at 0).
//
// Every scheduler is Stateful: state_dict() holds "kind" (the class name as u8 bytes),
// "last_epoch" (i64), "base_lrs" and "last_lrs" (f64 [groups]) and, for a composite, each child's
// state under "schedulers.<i>.". load_state_dict checks the kind, the group count and every key
// before it changes anything, and then also writes last_lrs (and OneCycleLR's momenta) back into
// the optimizer, so a resumed run continues exactly whether or not the optimizer's own state dict
// carries its hyperparameters.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flame/optim/optimizer.h"
#include "flame/stateful.h"

namespace flame::optim {

class LRScheduler : public Stateful {
 public:
  ~LRScheduler() override;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  virtual std::string name() const = 0;
  // Advances one epoch (or iteration: whatever unit the schedule is written in).
  virtual void step();
  // Jumps to `epoch` using the closed form where the schedule has one (PyTorch's step(epoch)).
  virtual void step(int64_t epoch);

  const std::vector<double>& get_last_lr() const { return last_lrs_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  int64_t last_epoch() const { return last_epoch_; }
  Optimizer& optimizer() const { return *opt_; }

  StateDict state_dict() const override;
  void load_state_dict(const StateDict& state) override;

 protected:
  explicit LRScheduler(Optimizer& opt);
  // Called at the end of a concrete scheduler's constructor: last_epoch -1 -> 0.
  void initial_step();
  // PyTorch's get_lr(): the chainable form, reading the optimizer's current rates; last_epoch_ is
  // already advanced.
  virtual std::vector<double> get_lr() = 0;
  // PyTorch's _get_closed_form_lr(); nullopt where the schedule has none (get_lr() is used).
  virtual std::optional<std::vector<double>> closed_form_lr() const { return std::nullopt; }
  // Extra state of a concrete scheduler: written by state_dict, checked (before anything changes)
  // and then applied by load_state_dict.
  virtual void save_extra(StateDict& /*out*/) const {}
  virtual void check_extra(const StateDict& /*state*/, const std::string& /*prefix*/) const {}
  virtual void load_extra(const StateDict& /*state*/, const std::string& /*prefix*/) {}

  // Writes `lrs` into the optimizer and records them as the last rates.
  void apply(const std::vector<double>& lrs);
  std::vector<double> current_lrs() const;
  std::size_t groups() const { return base_lrs_.size(); }
  // Replaces the base rates (and the optimizer's initial rates); OneCycleLR derives its own.
  void set_initial_lrs(const std::vector<double>& lrs);

  // Composite schedulers save and load their children through these.
  void save_into(StateDict& out, const std::string& prefix) const;
  void check_state(const StateDict& state, const std::string& prefix) const;
  void load_checked(const StateDict& state, const std::string& prefix);

  Optimizer* opt_;
  std::vector<double> base_lrs_;
  std::vector<double> last_lrs_;
  int64_t last_epoch_ = -1;

  friend class SequentialLR;
  friend class ChainedScheduler;
};

using SchedulerPtr = std::shared_ptr<LRScheduler>;

// lr = base * factor until total_iters, then base.
class ConstantLR final : public LRScheduler {
 public:
  ConstantLR(Optimizer& opt, double factor = 1.0 / 3.0, int64_t total_iters = 5);
  std::string name() const override { return "ConstantLR"; }

 protected:
  std::vector<double> get_lr() override;
  std::optional<std::vector<double>> closed_form_lr() const override;

 private:
  double factor_;
  int64_t total_iters_;
};

// lr = base * (start + (end - start) * min(epoch, total_iters) / total_iters): linear warmup.
class LinearLR final : public LRScheduler {
 public:
  LinearLR(Optimizer& opt, double start_factor = 1.0 / 3.0, double end_factor = 1.0, int64_t total_iters = 5);
  std::string name() const override { return "LinearLR"; }

 protected:
  std::vector<double> get_lr() override;
  std::optional<std::vector<double>> closed_form_lr() const override;

 private:
  double start_factor_, end_factor_;
  int64_t total_iters_;
};

// lr = eta_min + (base - eta_min) * (1 + cos(pi * epoch / T_max)) / 2 (and on, periodically, past
// T_max, as PyTorch's recursive form does).
class CosineAnnealingLR final : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& opt, int64_t T_max, double eta_min = 0.0);
  std::string name() const override { return "CosineAnnealingLR"; }

 protected:
  std::vector<double> get_lr() override;
  std::optional<std::vector<double>> closed_form_lr() const override;

 private:
  int64_t t_max_;
  double eta_min_;
};

// lr = base * gamma^(epoch / step_size) (integer division).
class StepLR final : public LRScheduler {
 public:
  StepLR(Optimizer& opt, int64_t step_size, double gamma = 0.1);
  std::string name() const override { return "StepLR"; }

 protected:
  std::vector<double> get_lr() override;
  std::optional<std::vector<double>> closed_form_lr() const override;

 private:
  int64_t step_size_;
  double gamma_;
};

// lr = base * gamma^(number of milestones <= epoch); a repeated milestone counts twice.
class MultiStepLR final : public LRScheduler {
 public:
  MultiStepLR(Optimizer& opt, std::vector<int64_t> milestones, double gamma = 0.1);
  std::string name() const override { return "MultiStepLR"; }

 protected:
  std::vector<double> get_lr() override;
  std::optional<std::vector<double>> closed_form_lr() const override;

 private:
  std::vector<int64_t> milestones_;  // sorted
  double gamma_;
};

// lr = base * gamma^epoch.
class ExponentialLR final : public LRScheduler {
 public:
  ExponentialLR(Optimizer& opt, double gamma);
  std::string name() const override { return "ExponentialLR"; }

 protected:
  std::vector<double> get_lr() override;
  std::optional<std::vector<double>> closed_form_lr() const override;

 private:
  double gamma_;
};

// lr = base * lambda(epoch): one function for every group, or one per group.
class LambdaLR final : public LRScheduler {
 public:
  using Lambda = std::function<double(int64_t epoch)>;
  LambdaLR(Optimizer& opt, Lambda lr_lambda);
  LambdaLR(Optimizer& opt, std::vector<Lambda> lr_lambdas);
  std::string name() const override { return "LambdaLR"; }

 protected:
  std::vector<double> get_lr() override;

 private:
  std::vector<Lambda> lambdas_;
};

// lr *= lambda(epoch) at every step after the first (PyTorch's MultiplicativeLR): one function for
// every group, or one per group. No closed form: step(epoch) multiplies once by lambda(epoch).
class MultiplicativeLR final : public LRScheduler {
 public:
  using Lambda = std::function<double(int64_t epoch)>;
  MultiplicativeLR(Optimizer& opt, Lambda lr_lambda);
  MultiplicativeLR(Optimizer& opt, std::vector<Lambda> lr_lambdas);
  std::string name() const override { return "MultiplicativeLR"; }

 protected:
  std::vector<double> get_lr() override;

 private:
  std::vector<Lambda> lambdas_;
};

// lr = base * (1 - min(epoch, total_iters) / total_iters)^power: polynomial decay to 0 at
// total_iters, constant after.
class PolynomialLR final : public LRScheduler {
 public:
  PolynomialLR(Optimizer& opt, int64_t total_iters = 5, double power = 1.0);
  std::string name() const override { return "PolynomialLR"; }

 protected:
  std::vector<double> get_lr() override;
  std::optional<std::vector<double>> closed_form_lr() const override;

 private:
  int64_t total_iters_;
  double power_;
};

// SGDR (Loshchilov & Hutter): lr = eta_min + (base - eta_min) * (1 + cos(pi * T_cur / T_i)) / 2,
// where T_cur counts epochs since the last restart and the i-th period is T_i = T_0 * T_mult^i.
// step() advances T_cur by one (restarting at T_i); step(epoch) and step_at(epoch) (a fractional
// epoch, PyTorch's step(epoch + i / iters)) find the period of `epoch` in closed form.
class CosineAnnealingWarmRestarts final : public LRScheduler {
 public:
  CosineAnnealingWarmRestarts(Optimizer& opt, int64_t T_0, int64_t T_mult = 1, double eta_min = 0.0);
  std::string name() const override { return "CosineAnnealingWarmRestarts"; }
  void step() override;
  void step(int64_t epoch) override;
  void step_at(double epoch);
  double t_cur() const { return t_cur_; }
  int64_t t_i() const { return t_i_; }

 protected:
  std::vector<double> get_lr() override;
  void save_extra(StateDict& out) const override;
  void check_extra(const StateDict& state, const std::string& prefix) const override;
  void load_extra(const StateDict& state, const std::string& prefix) override;

 private:
  int64_t t_0_, t_mult_;
  double eta_min_;
  int64_t t_i_;
  double t_cur_ = -1.0;
};

// The cyclical learning rate policy (Smith, 2017) between base_lr and max_lr, stepped per batch:
// a cycle is step_size_up steps up then step_size_down (default: step_size_up) steps down. Modes:
// triangular (constant amplitude), triangular2 (amplitude halved each cycle), exp_range
// (amplitude scaled by gamma^iteration), or a custom scale_fn of the cycle number (scale_mode
// cycle) or iteration (scale_mode iterations). With cycle_momentum the optimizer's momentum (SGD)
// or beta1 (Adam family) moves the opposite way between max_momentum and base_momentum. As
// PyTorch, the base rates are base_lr, not the optimizer's: construction writes them.
struct CyclicLROptions {
  std::vector<double> base_lr;  // one value for every group, or one per group
  std::vector<double> max_lr;   // the same
  double step_size_up = 2000;
  std::optional<double> step_size_down;  // unset: step_size_up
  enum class Mode { triangular, triangular2, exp_range } mode = Mode::triangular;
  double gamma = 1.0;  // exp_range
  std::function<double(double)> scale_fn;  // replaces the mode's when set
  enum class ScaleMode { cycle, iterations } scale_mode = ScaleMode::cycle;  // for scale_fn
  bool cycle_momentum = true;
  std::vector<double> base_momentum{0.8};  // one value for every group, or one per group
  std::vector<double> max_momentum{0.9};
};

class CyclicLR final : public LRScheduler {
 public:
  CyclicLR(Optimizer& opt, CyclicLROptions options);
  std::string name() const override { return "CyclicLR"; }

 protected:
  std::vector<double> get_lr() override;
  void save_extra(StateDict& out) const override;
  void check_extra(const StateDict& state, const std::string& prefix) const override;
  void load_extra(const StateDict& state, const std::string& prefix) override;

 private:
  double scale(double cycle) const;
  CyclicLROptions o_;
  double total_size_, step_ratio_;
  std::vector<double> max_lrs_, base_momenta_, max_momenta_;
  std::vector<double> last_momenta_;  // what cycle_momentum last wrote, restored on load
};

// Lowers the rate when a metric stops improving (PyTorch's ReduceLROnPlateau): step(metric) once
// per epoch; after more than `patience` epochs without an improvement (mode min: metric below
// best * (1 - threshold) for threshold_mode rel, best - threshold for abs; mode max mirrored),
// every group's lr becomes max(lr * factor, min_lr), unless that changes it by eps or less; then
// `cooldown` epochs pass before bad epochs count again. It reads the optimizer's current rates
// (it composes with nothing: step() and step(epoch) raise). Construction changes no rate.
struct ReduceLROnPlateauOptions {
  enum class Mode { min, max } mode = Mode::min;
  double factor = 0.1;
  int64_t patience = 10;
  double threshold = 1e-4;
  enum class ThresholdMode { rel, abs } threshold_mode = ThresholdMode::rel;
  int64_t cooldown = 0;
  std::vector<double> min_lr{0.0};  // one value for every group, or one per group
  double eps = 1e-8;
};

class ReduceLROnPlateau final : public LRScheduler {
 public:
  using Options = ReduceLROnPlateauOptions;
  explicit ReduceLROnPlateau(Optimizer& opt, Options options = {});
  std::string name() const override { return "ReduceLROnPlateau"; }
  void step(double metric);
  void step() override;  // raises: the schedule needs the metric
  double best() const { return best_; }
  int64_t num_bad_epochs() const { return num_bad_epochs_; }
  int64_t cooldown_counter() const { return cooldown_counter_; }
  bool in_cooldown() const { return cooldown_counter_ > 0; }

 protected:
  std::vector<double> get_lr() override;  // raises (step(epoch) through the base class)
  void save_extra(StateDict& out) const override;
  void check_extra(const StateDict& state, const std::string& prefix) const override;
  void load_extra(const StateDict& state, const std::string& prefix) override;

 private:
  bool is_better(double a, double best) const;
  Options o_;
  std::vector<double> min_lrs_;
  double best_;
  int64_t num_bad_epochs_ = 0;
  int64_t cooldown_counter_ = 0;
};

// The 1cycle policy (Smith & Topin): from max_lr/div_factor up to max_lr over pct_start of the
// steps, then down to initial/final_div_factor (three_phase: back to the initial rate first, then
// down). With cycle_momentum the optimizer's momentum (SGD) or beta1 (Adam family) moves the
// opposite way between max_momentum and base_momentum. Stepping past total_steps raises.
struct OneCycleOptions {
  std::vector<double> max_lr;  // one value for every group, or one per group
  int64_t total_steps = 0;     // or epochs * steps_per_epoch when total_steps is 0
  int64_t epochs = 0;
  int64_t steps_per_epoch = 0;
  double pct_start = 0.3;
  enum class Anneal { cos, linear } anneal_strategy = Anneal::cos;
  bool cycle_momentum = true;
  double base_momentum = 0.85;  // one value for every group
  double max_momentum = 0.95;
  double div_factor = 25.0;
  double final_div_factor = 1e4;
  bool three_phase = false;
};

class OneCycleLR final : public LRScheduler {
 public:
  OneCycleLR(Optimizer& opt, OneCycleOptions options);
  std::string name() const override { return "OneCycleLR"; }
  int64_t total_steps() const { return total_steps_; }

 protected:
  std::vector<double> get_lr() override;
  void save_extra(StateDict& out) const override;
  void check_extra(const StateDict& state, const std::string& prefix) const override;
  void load_extra(const StateDict& state, const std::string& prefix) override;

 private:
  struct Phase {
    double end_step;
    int start_lr, end_lr;  // 0 initial, 1 max, 2 min
    bool start_momentum_max, end_momentum_max;
  };
  double anneal(double start, double end, double pct) const;
  OneCycleOptions o_;
  int64_t total_steps_;
  std::vector<Phase> phases_;
  std::vector<double> initial_lr_, max_lr_, min_lr_;
  std::vector<double> last_momenta_;  // what cycle_momentum last wrote, restored on load
};

// Runs `schedulers` one after another: scheduler i+1 takes over at milestones[i] (restarting at
// its epoch 0). All must drive the same optimizer.
class SequentialLR final : public LRScheduler {
 public:
  SequentialLR(Optimizer& opt, std::vector<SchedulerPtr> schedulers, std::vector<int64_t> milestones);
  std::string name() const override { return "SequentialLR"; }
  void step() override;
  void step(int64_t epoch) override;
  const std::vector<SchedulerPtr>& schedulers() const { return schedulers_; }

 protected:
  std::vector<double> get_lr() override;
  void save_extra(StateDict& out) const override;
  void check_extra(const StateDict& state, const std::string& prefix) const override;
  void load_extra(const StateDict& state, const std::string& prefix) override;

 private:
  std::vector<SchedulerPtr> schedulers_;
  std::vector<int64_t> milestones_;
};

// Steps every scheduler in order on each step(): their chainable factors multiply.
class ChainedScheduler final : public LRScheduler {
 public:
  explicit ChainedScheduler(std::vector<SchedulerPtr> schedulers);
  std::string name() const override { return "ChainedScheduler"; }
  void step() override;
  void step(int64_t epoch) override;
  const std::vector<SchedulerPtr>& schedulers() const { return schedulers_; }

 protected:
  std::vector<double> get_lr() override;
  void save_extra(StateDict& out) const override;
  void check_extra(const StateDict& state, const std::string& prefix) const override;
  void load_extra(const StateDict& state, const std::string& prefix) override;

 private:
  std::vector<SchedulerPtr> schedulers_;
};

// Linear warmup from warmup_start_factor * base over warmup_steps, then cosine annealing to
// eta_min at total_steps: SequentialLR(LinearLR, CosineAnnealingLR, milestone warmup_steps).
// warmup_steps = 0 gives the cosine alone.
SchedulerPtr warmup_cosine(Optimizer& opt, int64_t warmup_steps, int64_t total_steps, double eta_min = 0.0,
                           double warmup_start_factor = 1e-3);

}  // namespace flame::optim
