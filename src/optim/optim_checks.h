#pragma once
// Hyperparameter checks shared by the optimizers of flame/optim/optimizers.h (torch.optim's
// messages: "Invalid learning rate", "Invalid beta parameter at index 0", ...).
#include <cmath>
#include <string>

#include "flame/error.h"
#include "flame/optim/optimizer.h"

namespace flame::optim::detail {

inline void check_range(bool ok, const std::string& who, std::size_t group, const char* what, double v) {
  FLAME_CHECK(ok, who.c_str(), "invalid ", what, " ", v, " in parameter group ", group);
}

inline void check_common(const std::string& who, const ParamGroup& g, std::size_t i) {
  check_range(g.lr >= 0.0 && std::isfinite(g.lr), who, i, "learning rate (must be >= 0)", g.lr);
  check_range(g.weight_decay >= 0.0 && std::isfinite(g.weight_decay), who, i, "weight_decay (must be >= 0)",
              g.weight_decay);
}

inline void check_betas(const std::string& who, const ParamGroup& g, std::size_t i) {
  check_range(g.beta1 >= 0.0 && g.beta1 < 1.0, who, i, "beta parameter at index 0 (must be in [0, 1))", g.beta1);
  check_range(g.beta2 >= 0.0 && g.beta2 < 1.0, who, i, "beta parameter at index 1 (must be in [0, 1))", g.beta2);
}

}  // namespace flame::optim::detail
