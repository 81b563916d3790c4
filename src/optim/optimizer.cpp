#include "flame/optim/optimizer.h"

#include "flame/error.h"

namespace flame::optim {

namespace {
void check_group(const Optimizer& opt, std::size_t group, const char* what) {
  FLAME_CHECK(group < opt.num_param_groups(), what, opt.name(), ": group ", group, " out of range (",
              opt.num_param_groups(), " groups)");
}

template <class Group>  // ParamGroup or const ParamGroup
auto& momentum_slot(const Optimizer& opt, Group& g, const char* what) {
  switch (opt.momentum_kind()) {
    case Optimizer::MomentumKind::momentum: return g.momentum;
    case Optimizer::MomentumKind::beta1: return g.beta1;
    case Optimizer::MomentumKind::none: break;
  }
  FLAME_FAIL(what, opt.name(), " has no momentum hyperparameter");
}
}  // namespace

double Optimizer::lr(std::size_t group) const {
  check_group(*this, group, "Optimizer::lr");
  return groups_[group].lr;
}

void Optimizer::set_lr(double lr, std::size_t group) {
  check_group(*this, group, "Optimizer::set_lr");
  const double old = groups_[group].lr;
  groups_[group].lr = lr;
  try {
    hyperparameters_changed(group);
  } catch (...) {
    groups_[group].lr = old;
    throw;
  }
}

void Optimizer::set_lr(double lr) {
  for (std::size_t g = 0; g < groups_.size(); ++g) set_lr(lr, g);
}

double Optimizer::momentum(std::size_t group) const {
  check_group(*this, group, "Optimizer::momentum");
  return momentum_slot(*this, groups_[group], "Optimizer::momentum");
}

void Optimizer::set_momentum(double value, std::size_t group) {
  check_group(*this, group, "Optimizer::set_momentum");
  double& slot = momentum_slot(*this, groups_[group], "Optimizer::set_momentum");
  const double old = slot;
  slot = value;
  try {
    hyperparameters_changed(group);
  } catch (...) {
    slot = old;
    throw;
  }
}

}  // namespace flame::optim
