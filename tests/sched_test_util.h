#pragma once
// Test-local optimizers for the scheduler and checkpoint tests: they derive from optim::Optimizer
// and use only its base interface, so these suites do not depend on the real optimizers.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "flame/autograd.h"
#include "flame/optim/optimizer.h"
#include "flame/optim/scheduler.h"
#include "flame/tensor.h"

namespace flame::test {

// SGD with momentum (PyTorch's update: buf = m * buf + g, p -= lr * buf) and a "state.<i>.
// momentum_buffer" entry per parameter that has taken a step; the groups' lr and momentum are in
// the state too, as in PyTorch's param_groups.
class TestSGD : public optim::Optimizer {
 public:
  TestSGD(std::vector<optim::ParamGroup> groups, MomentumKind kind = MomentumKind::momentum) : kind_(kind) {
    groups_ = std::move(groups);
    for (auto& g : groups_) {
      for (auto& p : g.params) {
        params_.push_back(p);
        bufs_.emplace_back();
      }
    }
  }
  std::string name() const override { return "TestSGD"; }
  MomentumKind momentum_kind() const override { return kind_; }

  void step(const Gradients& grads) override {
    NoGradGuard ng;
    std::size_t i = 0;
    for (auto& g : groups_) {
      const double m = kind_ == MomentumKind::beta1 ? g.beta1 : g.momentum;
      for (auto& p : g.params) {
        Tensor grad = grads.try_get(p);
        if (grad.defined()) {
          if (!bufs_[i].defined()) {
            bufs_[i] = grad.clone();
          } else {
            bufs_[i].mul_(m).add_(grad);
          }
          p.sub_(bufs_[i].mul_scalar(g.lr));
        }
        ++i;
      }
    }
  }

  StateDict state_dict() const override {
    StateDict sd;
    for (std::size_t i = 0; i < bufs_.size(); ++i) {
      if (bufs_[i].defined()) sd.insert("state." + std::to_string(i) + ".momentum_buffer", bufs_[i].clone());
    }
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      sd.insert("param_groups." + std::to_string(g) + ".lr", Tensor::scalar(groups_[g].lr, DType::f64));
      sd.insert("param_groups." + std::to_string(g) + ".momentum",
                Tensor::scalar(kind_ == MomentumKind::beta1 ? groups_[g].beta1 : groups_[g].momentum, DType::f64));
    }
    return sd;
  }

  void load_state_dict(const StateDict& sd) override {
    // Validate everything first: the object stays unchanged on error.
    std::vector<Tensor> bufs(bufs_.size());
    for (const auto& [k, t] : sd) {
      if (k.rfind("state.", 0) == 0) {
        const std::size_t i = std::stoul(k.substr(6));
        FLAME_CHECK(i < params_.size() && t.sizes() == params_[i].sizes(), "TestSGD::load_state_dict", "bad key '", k,
                    "'");
        bufs[i] = t.to(params_[i].device()).clone();
      } else {
        FLAME_CHECK(k.rfind("param_groups.", 0) == 0, "TestSGD::load_state_dict", "unexpected key '", k, "'");
      }
    }
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      (void)sd.at("param_groups." + std::to_string(g) + ".lr");
      (void)sd.at("param_groups." + std::to_string(g) + ".momentum");
    }
    bufs_ = std::move(bufs);
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      groups_[g].lr = sd.at("param_groups." + std::to_string(g) + ".lr").item<double>();
      const double m = sd.at("param_groups." + std::to_string(g) + ".momentum").item<double>();
      (kind_ == MomentumKind::beta1 ? groups_[g].beta1 : groups_[g].momentum) = m;
    }
  }

 private:
  MomentumKind kind_;
  TensorList params_;
  std::vector<Tensor> bufs_;
};

// An optimizer with groups and nothing else: what a scheduler test needs.
inline std::vector<optim::ParamGroup> lr_groups(const std::vector<double>& lrs) {
  std::vector<optim::ParamGroup> gs;
  for (double lr : lrs) {
    optim::ParamGroup g;
    g.lr = lr;
    g.momentum = 0.9;
    gs.push_back(g);
  }
  return gs;
}

// Steps `s` to every epoch up to `last` and checks the optimizer's rates (and get_last_lr) against
// `want(epoch, group)` at every epoch.
inline void expect_schedule(optim::LRScheduler& s, const optim::Optimizer& opt, int64_t last,
                            const std::function<double(int64_t, std::size_t)>& want, double rtol = 1e-12) {
  for (int64_t e = 0; e <= last; ++e) {
    if (e > 0) s.step();
    ASSERT_EQ(s.last_epoch(), e);
    for (std::size_t g = 0; g < opt.num_param_groups(); ++g) {
      const double w = want(e, g);
      ASSERT_NEAR(opt.lr(g), w, rtol * std::abs(w) + 1e-300) << s.name() << " epoch " << e << " group " << g;
      ASSERT_EQ(s.get_last_lr()[g], opt.lr(g));
    }
  }
}

}  // namespace flame::test
