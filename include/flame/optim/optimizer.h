#pragma once
// Optimizer base: parameter groups with per-group hyperparameters, step(Gradients), state as a
// StateDict (flame/stateful.h). The optimizers themselves (SGD, Adam, AdamW, Lion, Adafactor) are
// in flame/optim/optimizers.h; docs/optim.md describes them. Learning-rate schedulers (flame/optim/scheduler.h) drive an
// optimizer only through num_param_groups(), lr()/set_lr() and momentum()/set_momentum().
#include <cstddef>
#include <string>
#include <vector>

#include "flame/autograd.h"
#include "flame/stateful.h"
#include "flame/tensor.h"

namespace flame::optim {

// One group of parameters and its hyperparameters (PyTorch's param_groups entries). Fields an
// optimizer does not use are ignored by it.
struct ParamGroup {
  TensorList params;
  double lr = 1e-3;
  double weight_decay = 0.0;
  double momentum = 0.0;  // SGD
  double beta1 = 0.9;     // Adam, AdamW, Lion (betas[0]); Adafactor's optional first moment
  double beta2 = 0.999;   // Adam, AdamW, Lion (betas[1])
  double eps = 1e-8;       // Adam family; Adafactor's eps2 (the floor of the parameter RMS)
  // Fields added for the optimizers of flame/optim/optimizers.h (appended, so designated
  // initialisers of the fields above keep working).
  double dampening = 0.0;     // SGD
  double beta2_decay = -0.8;  // Adafactor
  double d = 1.0;             // Adafactor: clipping threshold of the update RMS
  double eps1 = -1.0;         // Adafactor: floor of the second moment; < 0: the dtype's epsilon
};

class Optimizer : public Stateful {
 public:
  ~Optimizer() override = default;

  // Updates every parameter that has a gradient in `grads`; parameters without one are skipped
  // (their state does not advance).
  virtual void step(const Gradients& grads) = 0;
  virtual std::string name() const = 0;

  std::size_t num_param_groups() const { return groups_.size(); }
  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  double lr(std::size_t group = 0) const;
  void set_lr(double lr, std::size_t group);
  void set_lr(double lr);  // every group
  // The momentum-like hyperparameter a cyclic schedule varies: SGD's momentum, the Adam family's
  // beta1 (PyTorch's OneCycleLR cycle_momentum); none for an optimizer without one.
  enum class MomentumKind { none, momentum, beta1 };
  virtual MomentumKind momentum_kind() const { return MomentumKind::none; }
  bool has_momentum() const { return momentum_kind() != MomentumKind::none; }
  double momentum(std::size_t group = 0) const;
  void set_momentum(double value, std::size_t group);

 protected:
  // Called after set_lr / set_momentum changed group `group` (capturable optimizers copy the new
  // value to the device); if it throws, the old value is put back.
  virtual void hyperparameters_changed(std::size_t group) { (void)group; }

  std::vector<ParamGroup> groups_;
};

}  // namespace flame::optim
