// Composite schedulers (SequentialLR, ChainedScheduler) and the warmup-then-cosine convenience.
// Children's states live under "schedulers.<i>." (Note [Scheduler state] in scheduler.cpp).
#include <algorithm>
#include <string>

#include "flame/error.h"
#include "flame/optim/scheduler.h"

namespace flame::optim {

namespace {
std::string child_prefix(const std::string& prefix, std::size_t i) {
  return prefix + "schedulers." + std::to_string(i) + ".";
}

Tensor i64_vector(const std::vector<int64_t>& v) { return Tensor::from_vec(v, {static_cast<int64_t>(v.size())}); }

bool is_composite(const LRScheduler& s) {
  return dynamic_cast<const SequentialLR*>(&s) != nullptr || dynamic_cast<const ChainedScheduler*>(&s) != nullptr;
}

Optimizer& first_optimizer(const std::vector<SchedulerPtr>& s) {
  FLAME_CHECK(!s.empty() && s[0] != nullptr, "ChainedScheduler", "expects at least one scheduler");
  return s[0]->optimizer();
}
}  // namespace

// ---- SequentialLR ----

SequentialLR::SequentialLR(Optimizer& opt, std::vector<SchedulerPtr> schedulers, std::vector<int64_t> milestones)
    : LRScheduler(opt), schedulers_(std::move(schedulers)), milestones_(std::move(milestones)) {
  const char* op = "SequentialLR";
  FLAME_CHECK(!schedulers_.empty(), op, "expects at least one scheduler");
  for (std::size_t i = 0; i < schedulers_.size(); ++i) {
    FLAME_CHECK(schedulers_[i] != nullptr, op, "scheduler ", i, " is null");
    FLAME_CHECK(&schedulers_[i]->optimizer() == &opt, op, "scheduler ", i, " (", schedulers_[i]->name(),
                ") drives another optimizer; all must drive the one given");
    // PyTorch's restart of a nested composite is ill-defined; chain inside, not sequence inside.
    FLAME_CHECK(!is_composite(*schedulers_[i]), op, "scheduler ", i, " is a ", schedulers_[i]->name(),
                "; SequentialLR takes plain schedulers");
  }
  FLAME_CHECK(milestones_.size() + 1 == schedulers_.size(), op, "expects ", schedulers_.size() - 1,
              " milestones for ", schedulers_.size(), " schedulers, got ", milestones_.size());
  for (std::size_t i = 0; i < milestones_.size(); ++i) {
    FLAME_CHECK(milestones_[i] > 0 && (i == 0 || milestones_[i] > milestones_[i - 1]), op,
                "milestones must be positive and increasing; got ", milestones_[i], " at position ", i);
  }
  // As PyTorch: back to the initial rates, undo each child's construction step, and run only the
  // first child's initial step.
  apply(base_lrs_);
  for (auto& s : schedulers_) s->last_epoch_ -= 1;
  schedulers_[0]->initial_step();
  last_epoch_ = 0;
  last_lrs_ = schedulers_[0]->get_last_lr();
}

void SequentialLR::step() {
  ++last_epoch_;
  const auto idx =
      static_cast<std::size_t>(std::upper_bound(milestones_.begin(), milestones_.end(), last_epoch_) - milestones_.begin());
  LRScheduler& s = *schedulers_[idx];
  try {
    if (idx > 0 && milestones_[idx - 1] == last_epoch_) {
      s.step(0);
    } else {
      s.step();
    }
  } catch (...) {
    --last_epoch_;
    throw;
  }
  last_lrs_ = s.get_last_lr();
}

void SequentialLR::step(int64_t /*epoch*/) {
  FLAME_FAIL("SequentialLR::step(epoch)", "a SequentialLR steps one epoch at a time; call step()");
}

std::vector<double> SequentialLR::get_lr() { return current_lrs(); }

void SequentialLR::save_extra(StateDict& out) const {
  out.insert("milestones", i64_vector(milestones_));
  for (std::size_t i = 0; i < schedulers_.size(); ++i) schedulers_[i]->save_into(out, child_prefix("", i));
}

void SequentialLR::check_extra(const StateDict& state, const std::string& prefix) const {
  const std::vector<int64_t> got = state.at(prefix + "milestones").to_vec<int64_t>();
  FLAME_CHECK(got == milestones_, "SequentialLR::load_state_dict", "key '", prefix,
              "milestones' differs from this scheduler's milestones");
  for (std::size_t i = 0; i < schedulers_.size(); ++i) schedulers_[i]->check_state(state, child_prefix(prefix, i));
}

void SequentialLR::load_extra(const StateDict& state, const std::string& prefix) {
  for (std::size_t i = 0; i < schedulers_.size(); ++i) schedulers_[i]->load_checked(state, child_prefix(prefix, i));
}

// ---- ChainedScheduler ----

ChainedScheduler::ChainedScheduler(std::vector<SchedulerPtr> schedulers)
    : LRScheduler(first_optimizer(schedulers)), schedulers_(std::move(schedulers)) {
  for (std::size_t i = 0; i < schedulers_.size(); ++i) {
    FLAME_CHECK(schedulers_[i] != nullptr, "ChainedScheduler", "scheduler ", i, " is null");
    FLAME_CHECK(&schedulers_[i]->optimizer() == opt_, "ChainedScheduler", "scheduler ", i, " (",
                schedulers_[i]->name(), ") drives another optimizer; all must drive the same one");
  }
  last_epoch_ = 0;
  last_lrs_ = current_lrs();
}

void ChainedScheduler::step() {
  // Not transactional across children (as PyTorch): a child that refuses its step stops the chain
  // after the earlier children stepped.
  for (auto& s : schedulers_) s->step();
  ++last_epoch_;
  last_lrs_ = current_lrs();
}

void ChainedScheduler::step(int64_t /*epoch*/) {
  FLAME_FAIL("ChainedScheduler::step(epoch)", "a ChainedScheduler steps one epoch at a time; call step()");
}

std::vector<double> ChainedScheduler::get_lr() { return current_lrs(); }

void ChainedScheduler::save_extra(StateDict& out) const {
  for (std::size_t i = 0; i < schedulers_.size(); ++i) schedulers_[i]->save_into(out, child_prefix("", i));
}

void ChainedScheduler::check_extra(const StateDict& state, const std::string& prefix) const {
  for (std::size_t i = 0; i < schedulers_.size(); ++i) schedulers_[i]->check_state(state, child_prefix(prefix, i));
}

void ChainedScheduler::load_extra(const StateDict& state, const std::string& prefix) {
  for (std::size_t i = 0; i < schedulers_.size(); ++i) schedulers_[i]->load_checked(state, child_prefix(prefix, i));
}

// ---- warmup then cosine ----

SchedulerPtr warmup_cosine(Optimizer& opt, int64_t warmup_steps, int64_t total_steps, double eta_min,
                           double warmup_start_factor) {
  FLAME_CHECK(warmup_steps >= 0 && total_steps > warmup_steps, "warmup_cosine", "need 0 <= warmup_steps (",
              warmup_steps, ") < total_steps (", total_steps, ")");
  if (warmup_steps == 0) return std::make_shared<CosineAnnealingLR>(opt, total_steps, eta_min);
  auto warmup = std::make_shared<LinearLR>(opt, warmup_start_factor, 1.0, warmup_steps);
  auto cosine = std::make_shared<CosineAnnealingLR>(opt, total_steps - warmup_steps, eta_min);
  return std::make_shared<SequentialLR>(opt, std::vector<SchedulerPtr>{warmup, cosine},
                                        std::vector<int64_t>{warmup_steps});
}

}  // namespace flame::optim
