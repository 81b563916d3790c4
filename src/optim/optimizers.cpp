// SGD, Adam, AdamW, Lion and Adafactor over FusedOptimizer (fused_optimizer.cpp). The first four
// update through the fused backend kernel (Note [Optimizer element math]); Adafactor is written
// with FLAME ops per parameter, following torch.optim.Adafactor's single-tensor code.
#include <algorithm>
#include <cmath>
#include <limits>

#include "flame/ops.h"
#include "flame/optim/optimizers.h"
#include "src/backend/optim_params.h"
#include "src/optim/optim_checks.h"

namespace flame::optim {

namespace {

using detail::check_betas;
using detail::check_common;
using detail::check_range;

std::vector<ParamGroup> one_group(ParamGroup g) { return std::vector<ParamGroup>{std::move(g)}; }

AdamOptions as_adam(const AdamWOptions& o) {
  return AdamOptions{o.lr,      o.betas,          o.eps,                 o.weight_decay, o.amsgrad,
                     o.maximize, o.master_weights, o.stochastic_rounding, o.seed,         o.capturable};
}

}  // namespace

// ---- options -> groups ----

ParamGroup SGDOptions::group(TensorList params) const {
  ParamGroup g;
  g.params = std::move(params);
  g.lr = lr;
  g.momentum = momentum;
  g.dampening = dampening;
  g.weight_decay = weight_decay;
  return g;
}

ParamGroup AdamOptions::group(TensorList params) const {
  ParamGroup g;
  g.params = std::move(params);
  g.lr = lr;
  g.beta1 = betas.first;
  g.beta2 = betas.second;
  g.eps = eps;
  g.weight_decay = weight_decay;
  return g;
}

ParamGroup AdamWOptions::group(TensorList params) const { return as_adam(*this).group(std::move(params)); }

ParamGroup LionOptions::group(TensorList params) const {
  ParamGroup g;
  g.params = std::move(params);
  g.lr = lr;
  g.beta1 = betas.first;
  g.beta2 = betas.second;
  g.weight_decay = weight_decay;
  return g;
}

ParamGroup AdafactorOptions::group(TensorList params) const {
  ParamGroup g;
  g.params = std::move(params);
  g.lr = lr;
  g.beta2_decay = beta2_decay;
  g.eps1 = eps.first.value_or(-1.0);
  g.eps = eps.second;
  g.d = d;
  g.weight_decay = weight_decay;
  return g;
}

// ---- SGD ----

SGD::SGD(TensorList params, Options options) : SGD(one_group(options.group(std::move(params))), options) {}

SGD::SGD(std::vector<ParamGroup> groups, Options options)
    : FusedOptimizer(std::move(groups), {options.master_weights, options.stochastic_rounding, options.seed, options.capturable}),
      options_(options) {
  check_groups();
}

void SGD::validate_group(const ParamGroup& g, std::size_t i) const {
  check_common("SGD", g, i);
  check_range(g.momentum >= 0.0, "SGD", i, "momentum (must be >= 0)", g.momentum);
  check_range(std::isfinite(g.dampening), "SGD", i, "dampening", g.dampening);
  FLAME_CHECK(!options_.nesterov || (g.momentum > 0.0 && g.dampening == 0.0), "SGD",
              "Nesterov momentum requires a momentum and zero dampening (group ", i, ": momentum ", g.momentum,
              ", dampening ", g.dampening, ")");
}

std::vector<FusedOptimizer::Slot> SGD::slots(const ParamGroup& g, const Tensor& param) const {
  if (g.momentum == 0.0) return {};
  return {Slot{"momentum_buffer", param.sizes()}};
}

std::vector<std::string> SGD::group_keys() const { return {"lr", "momentum", "dampening", "weight_decay"}; }

void SGD::update_group(std::size_t g, const std::vector<Active>& active) {
  fused_update(g, active, static_cast<int>(backend::OptimKind::sgd), false, options_.nesterov, options_.maximize,
               false);
}

// ---- Adam / AdamW ----

Adam::Adam(TensorList params, Options options) : Adam(one_group(options.group(std::move(params))), options) {}

Adam::Adam(std::vector<ParamGroup> groups, Options options) : Adam(std::move(groups), options, false) {}

Adam::Adam(std::vector<ParamGroup> groups, Options options, bool decoupled)
    : FusedOptimizer(std::move(groups), {options.master_weights, options.stochastic_rounding, options.seed, options.capturable}),
      options_(options),
      decoupled_(decoupled) {
  check_groups();
}

void Adam::validate_group(const ParamGroup& g, std::size_t i) const {
  const std::string who = decoupled_ ? "AdamW" : "Adam";
  check_common(who, g, i);
  check_betas(who, g, i);
  check_range(g.eps >= 0.0, who, i, "epsilon value (must be >= 0)", g.eps);
}

std::vector<FusedOptimizer::Slot> Adam::slots(const ParamGroup&, const Tensor& param) const {
  std::vector<Slot> s{{"exp_avg", param.sizes()}, {"exp_avg_sq", param.sizes()}};
  if (options_.amsgrad) s.push_back({"max_exp_avg_sq", param.sizes()});
  return s;
}

std::vector<std::string> Adam::group_keys() const { return {"lr", "betas", "eps", "weight_decay"}; }

void Adam::update_group(std::size_t g, const std::vector<Active>& active) {
  fused_update(g, active, static_cast<int>(backend::OptimKind::adam), options_.amsgrad, false, options_.maximize,
               decoupled_);
}

AdamW::AdamW(TensorList params, Options options)
    : Adam(one_group(options.group(std::move(params))), as_adam(options), true) {}

AdamW::AdamW(std::vector<ParamGroup> groups, Options options) : Adam(std::move(groups), as_adam(options), true) {}

// ---- Lion ----

Lion::Lion(TensorList params, Options options) : Lion(one_group(options.group(std::move(params))), options) {}

Lion::Lion(std::vector<ParamGroup> groups, Options options)
    : FusedOptimizer(std::move(groups), {options.master_weights, options.stochastic_rounding, options.seed, options.capturable}),
      options_(options) {
  check_groups();
}

void Lion::validate_group(const ParamGroup& g, std::size_t i) const {
  check_common("Lion", g, i);
  check_betas("Lion", g, i);
}

std::vector<FusedOptimizer::Slot> Lion::slots(const ParamGroup&, const Tensor& param) const {
  return {Slot{"exp_avg", param.sizes()}};
}

std::vector<std::string> Lion::group_keys() const { return {"lr", "betas", "weight_decay"}; }

void Lion::update_group(std::size_t g, const std::vector<Active>& active) {
  fused_update(g, active, static_cast<int>(backend::OptimKind::lion), false, false, options_.maximize, false);
}

// ---- Adafactor ----

Adafactor::Adafactor(TensorList params, Options options)
    : Adafactor(one_group(options.group(std::move(params))), options) {}

Adafactor::Adafactor(std::vector<ParamGroup> groups, Options options)
    : FusedOptimizer(std::move(groups), {options.master_weights, false, 0}), options_(options) {
  check_groups();
}

void Adafactor::validate_group(const ParamGroup& g, std::size_t i) const {
  check_common("Adafactor", g, i);
  check_range(g.beta2_decay <= 0.0, "Adafactor", i, "beta2_decay (must be <= 0)", g.beta2_decay);
  check_range(g.eps >= 0.0, "Adafactor", i, "epsilon2 (must be >= 0)", g.eps);
  check_range(g.eps1 >= 0.0 || g.eps1 == -1.0, "Adafactor", i, "epsilon1 (must be >= 0, or unset)", g.eps1);
  check_range(g.d >= 1.0, "Adafactor", i, "clipping threshold d (must be >= 1)", g.d);
}

std::vector<FusedOptimizer::Slot> Adafactor::slots(const ParamGroup&, const Tensor& param) const {
  if (param.dim() < 2) return {Slot{"variance", param.sizes()}};
  Shape row = param.sizes(), col = param.sizes();
  row.back() = 1;
  col[col.size() - 2] = 1;
  return {Slot{"row_var", row}, Slot{"col_var", col}};
}

std::vector<std::string> Adafactor::group_keys() const {
  return {"lr", "beta2_decay", "eps1", "eps", "d", "weight_decay"};
}

// torch.optim._adafactor._single_tensor_adafactor, step by step; `theta` is the master weights
// when the parameter has them (the math then runs in f32 and the parameter is written rounded).
void Adafactor::update_group(std::size_t gi, const std::vector<Active>& active) {
  const ParamGroup& g = groups_[gi];
  for (const Active& a : active) {
    const ParamState& st = state_[a.index];
    Tensor theta = st.master.defined() ? st.master : a.param;
    Tensor grad = a.grad.to(theta.dtype());
    if (options_.maximize) grad = grad.neg();
    double eps1 = g.eps1;
    if (eps1 < 0.0) {
      switch (theta.dtype()) {
        case DType::f64: eps1 = std::numeric_limits<double>::epsilon(); break;
        case DType::bf16: eps1 = 0.0078125; break;
        case DType::f16: eps1 = 0.0009765625; break;
        default: eps1 = static_cast<double>(std::numeric_limits<float>::epsilon()); break;
      }
    }
    const double t = static_cast<double>(st.step);
    const double one_minus_beta2 = std::pow(t, g.beta2_decay);
    const double rho = std::min(g.lr, 1.0 / std::sqrt(t));
    const double n = static_cast<double>(theta.numel());
    const double rms = theta.numel() == 0 ? 0.0 : theta.norm().item<double>() / std::sqrt(n);
    const double alpha = std::max(g.eps, rms) * rho;
    if (g.weight_decay != 0.0) theta.mul_(1.0 - g.lr * g.weight_decay);
    Tensor var_estimate;
    if (grad.dim() > 1) {
      Tensor row_var = find_slot(a.index, "row_var");
      Tensor col_var = find_slot(a.index, "col_var");
      const Tensor g2 = grad * grad;
      row_var.add_(g2.mean({-1}, true) - row_var, one_minus_beta2);
      col_var.add_(g2.mean({-2}, true) - col_var, one_minus_beta2);
      var_estimate = matmul(row_var, col_var) / row_var.mean({-2}, true).clamp(eps1, std::nullopt);
    } else {
      Tensor variance = find_slot(a.index, "variance");
      variance.add_(grad * grad - variance, one_minus_beta2);
      var_estimate = variance;
    }
    const Tensor update = var_estimate.clamp(eps1 * eps1, std::nullopt).rsqrt() * grad;
    const double update_rms = update.numel() == 0 ? 0.0 : update.norm().item<double>() / (std::sqrt(n) * g.d);
    const double denom = std::max(1.0, update_rms);
    theta.add_(update, -alpha / denom);
    if (st.master.defined()) {
      Tensor param = a.param;
      param.copy_(theta);
    }
  }
}

}  // namespace flame::optim
