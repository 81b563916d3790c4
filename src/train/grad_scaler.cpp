// GradScaler: dynamic loss scaling (torch.amp.GradScaler semantics; see flame/amp.h). It steps an
// optimizer, so it sits with the training tools, above src/amp (Note [Layers] in docs/design.md).
//
// Note [GradScaler synchronisation]
// The scale and the growth tracker are host numbers: scale() is one mul by a scalar and update()
// is host arithmetic, neither touches the device. unscale_ queues one fused pass over all the
// gradients of an optimizer (Backend::amp_unscale) that writes a device flag found_inf. The flag
// is read, once per optimizer per iteration, by step() (or by update() when step() was skipped):
// that read is the scaler's only host synchronisation, as PyTorch's step() reads found_inf.
#include <algorithm>
#include <cmath>
#include <optional>
#include <unordered_set>
#include <utility>
#include <vector>

#include "flame/amp.h"
#include "flame/ops.h"
#include "flame/optim/optimizer.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"
#include "src/backend/fused/multi_tensor.h"

namespace flame::amp {
namespace {

void check_options(const GradScalerOptions& o) {
  FLAME_CHECK(std::isfinite(o.init_scale) && o.init_scale > 0, "GradScaler", "init_scale must be positive and finite, got ",
              o.init_scale);
  FLAME_CHECK(std::isfinite(o.growth_factor) && o.growth_factor > 1.0, "GradScaler",
              "growth_factor must be > 1, got ", o.growth_factor);
  FLAME_CHECK(o.backoff_factor > 0.0 && o.backoff_factor < 1.0, "GradScaler", "backoff_factor must be in (0, 1), got ",
              o.backoff_factor);
  FLAME_CHECK(o.growth_interval > 0, "GradScaler", "growth_interval must be positive, got ", o.growth_interval);
}

// Elements fill [data_ptr, data_ptr + numel): non-overlapping, dense, strides >= 0.
bool flat_dense(const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) != 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) return false;
    expected *= size;
  }
  return true;
}

double scalar_of(const StateDict& s, const char* key, bool integral) {
  const Tensor& t = s.at(key);
  FLAME_CHECK(t.dim() == 0, "GradScaler::load_state_dict", "'", key, "' must be a 0-d tensor, got shape ", t.sizes());
  FLAME_CHECK(integral ? is_integral(t.dtype()) : is_floating(t.dtype()), "GradScaler::load_state_dict", "'", key,
              "' must be ", integral ? "an integer" : "a floating", " tensor, got ", dtype_name(t.dtype()));
  return integral ? static_cast<double>(t.to(DType::i64).item<int64_t>()) : t.to(DType::f64).item<double>();
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(options), enabled_(options.enabled) {
  check_options(options_);
  scale_ = options_.init_scale;
}

Tensor GradScaler::scale(const Tensor& loss) const {
  if (!enabled_) return loss;
  FLAME_CHECK(loss.defined() && is_floating(loss.dtype()), "GradScaler::scale", "expected a floating loss, got ",
              loss.defined() ? dtype_name(loss.dtype()) : "an undefined tensor");
  return mul_scalar(loss, scale_);
}

void GradScaler::unscale_(const optim::Optimizer& optimizer, Gradients& grads) {
  if (!enabled_) return;
  PerOptimizer& st = per_opt_[&optimizer];
  FLAME_CHECK(!st.unscaled, "GradScaler::unscale_",
              "unscale_() has already been called on this optimizer since the last update()");
  FLAME_CHECK(!st.stepped, "GradScaler::unscale_", "unscale_() is being called after step()");
  // The gradients of the optimizer's parameters, each once.
  TensorList flat, strided;
  std::unordered_set<const void*> seen;
  std::optional<Device> device;
  for (const optim::ParamGroup& group : optimizer.param_groups()) {
    for (const Tensor& p : group.params) {
      if (!p.defined() || !grads.contains(p)) continue;
      const Tensor g = grads.get(p);
      if (!seen.insert(g.impl()).second) continue;
      FLAME_CHECK(is_floating(g.dtype()), "GradScaler::unscale_", "gradients must be floating, got ",
                  dtype_name(g.dtype()), " (shape ", g.sizes(), ")");
      if (!device) device = g.device();
      FLAME_CHECK(g.device() == *device, "GradScaler::unscale_", "the gradients of one optimizer must be on one device, got ",
                  device->str(), " and ", g.device().str(), " (shape ", g.sizes(), ")");
      (flat_dense(g) ? flat : strided).push_back(g);
    }
  }
  st.unscaled = true;
  if (!device) return;  // no gradients: nothing to check, found_inf stays undefined
  NoGradGuard no_grad;
  st.found_inf = Tensor::zeros({}, {DType::f32, *device});
  st.found_read = false;
  const double inv_scale = 1.0 / scale_;  // a power of two in the default configuration: exact
  // Gradients in an overlapping or sparse layout go through a dense copy (rare: the store keeps
  // gradients dense).
  TensorList copies;
  for (const Tensor& g : strided) copies.push_back(g.contiguous());
  flat.insert(flat.end(), copies.begin(), copies.end());
  backend::fused::amp_unscale.run(*device, flat, inv_scale, st.found_inf);
  for (std::size_t i = 0; i < strided.size(); ++i) {
    Tensor g = strided[i];
    g.copy_(copies[i]);
  }
  for (const Tensor& g : flat) bump_version(g);
}

bool GradScaler::read_found_inf(PerOptimizer& st) {
  if (!st.found_inf.defined()) return false;
  if (!st.found_read) {
    st.found_value = st.found_inf.item<float>() != 0.0f;  // Note [GradScaler synchronisation]
    st.found_read = true;
  }
  return st.found_value;
}

bool GradScaler::step(optim::Optimizer& optimizer, Gradients& grads) {
  if (!enabled_) {
    optimizer.step(grads);
    return true;
  }
  {
    const PerOptimizer& st = per_opt_[&optimizer];
    FLAME_CHECK(!st.stepped, "GradScaler::step", "step() has already been called on this optimizer since the last update()");
    if (!st.unscaled) unscale_(optimizer, grads);
  }
  PerOptimizer& st = per_opt_[&optimizer];
  const bool skip = read_found_inf(st);
  st.stepped = true;
  if (!skip) optimizer.step(grads);
  return !skip;
}

void GradScaler::update() {
  if (!enabled_) return;
  bool any = false, found = false;
  for (auto& [opt, st] : per_opt_) {
    if (!st.unscaled) continue;
    any = true;
    found = read_found_inf(st) || found;
  }
  FLAME_CHECK(any, "GradScaler::update", "no inf checks were recorded since the last update(): call step() (or unscale_()) first");
  if (found) {
    scale_ *= options_.backoff_factor;
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval) {
    const double grown = scale_ * options_.growth_factor;
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  }
  per_opt_.clear();
}

void GradScaler::update(double new_scale) {
  if (!enabled_) return;
  FLAME_CHECK(std::isfinite(new_scale) && new_scale > 0, "GradScaler::update", "new_scale must be positive and finite, got ",
              new_scale);
  scale_ = new_scale;
  per_opt_.clear();
}

StateDict GradScaler::state_dict() const {
  StateDict s;
  if (!enabled_) return s;  // as PyTorch: a disabled scaler has no state
  s.insert("scale", Tensor::scalar(scale_, {DType::f64}));
  s.insert("growth_factor", Tensor::scalar(options_.growth_factor, {DType::f64}));
  s.insert("backoff_factor", Tensor::scalar(options_.backoff_factor, {DType::f64}));
  s.insert("growth_interval", Tensor::scalar(options_.growth_interval, {DType::i64}));
  s.insert("_growth_tracker", Tensor::scalar(growth_tracker_, {DType::i64}));
  return s;
}

void GradScaler::load_state_dict(const StateDict& state) {
  if (!enabled_) return;
  FLAME_CHECK(!state.empty(), "GradScaler::load_state_dict", "the state is empty: it was saved by a disabled GradScaler");
  // Everything is read and checked before anything changes.
  GradScalerOptions o = options_;
  const double scale = scalar_of(state, "scale", false);
  o.growth_factor = scalar_of(state, "growth_factor", false);
  o.backoff_factor = scalar_of(state, "backoff_factor", false);
  o.growth_interval = static_cast<int64_t>(scalar_of(state, "growth_interval", true));
  const auto tracker = static_cast<int64_t>(scalar_of(state, "_growth_tracker", true));
  FLAME_CHECK(std::isfinite(scale) && scale > 0, "GradScaler::load_state_dict", "'scale' must be positive and finite, got ",
              scale);
  FLAME_CHECK(tracker >= 0 && tracker < o.growth_interval, "GradScaler::load_state_dict", "'_growth_tracker' ",
              tracker, " is outside [0, growth_interval = ", o.growth_interval, ")");
  check_options(o);
  options_ = o;
  scale_ = scale;
  growth_tracker_ = tracker;
  per_opt_.clear();
}

}  // namespace flame::amp
