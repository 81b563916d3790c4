// Gradient tools a trainer applies to a Gradients store between backward() and the optimizer.
#include <cmath>
#include <limits>
#include <vector>

#include "flame/autograd.h"
#include "flame/ops.h"

namespace flame {

namespace {
// The norm over a list of gradients (all on one device or moved to the first one's).
double norm_of(const std::vector<Tensor>& grads, double norm_type) {
  const bool inf = std::isinf(norm_type);
  Tensor total;
  for (const Tensor& grad : grads) {
    if (!grad.defined() || grad.numel() == 0) continue;
    Tensor g = grad.to(DType::f32);
    Tensor part = inf ? g.abs().max_all() : g.abs().pow(norm_type).sum_all();
    if (total.defined() && part.device() != total.device()) part = part.to(total.device());
    total = !total.defined() ? part : (inf ? total.maximum(part) : total + part);
  }
  if (!total.defined()) return 0.0;
  const double v = total.item<double>();
  return inf ? v : std::pow(v, 1.0 / norm_type);
}

std::vector<Tensor> all_grads(const Gradients& grads) {
  std::vector<Tensor> out;
  out.reserve(grads.size());
  for (const auto& e : grads.entries()) out.push_back(e.grad);
  return out;
}

// Scales the stored buffers in place (Note [Gradient ownership]: they belong to the store).
double clip_in_place(Gradients& grads, const TensorList& keys, double max_norm, double norm_type) {
  std::vector<Tensor> gs;
  for (const Tensor& k : keys) gs.push_back(grads.try_get(k));
  const double norm = norm_of(gs, norm_type);
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1.0) {
    NoGradGuard no_grad;
    for (const Tensor& k : keys) {
      if (grads.contains(k)) grads.at(k).mul_(scale);
    }
  }
  return norm;
}

TensorList all_keys(const Gradients& grads) {
  TensorList keys;
  for (const auto& e : grads.entries()) keys.push_back(e.tensor);
  return keys;
}
}  // namespace

double global_grad_norm(const Gradients& grads, double norm_type) {
  return grads.empty() ? 0.0 : norm_of(all_grads(grads), norm_type);
}

double clip_grad_norm_(Gradients& grads, double max_norm, double norm_type) {
  return clip_in_place(grads, all_keys(grads), max_norm, norm_type);
}

double clip_grad_norm_(Gradients& grads, const TensorList& params, double max_norm, double norm_type) {
  return clip_in_place(grads, params, max_norm, norm_type);
}

void clip_grad_value_(Gradients& grads, double clip_value) {
  FLAME_CHECK(clip_value >= 0, "clip_grad_value_", "clip value must be non-negative, got ", clip_value);
  NoGradGuard no_grad;
  for (const Tensor& k : all_keys(grads)) grads.at(k).clamp_(-clip_value, clip_value);
}

void normalize_grads_(Gradients& grads, double eps) {
  const double norm = global_grad_norm(grads, 2.0);
  NoGradGuard no_grad;
  for (const Tensor& k : all_keys(grads)) grads.at(k).div_(norm + eps);
}

void add_grad_noise_(Gradients& grads, double std, Generator* gen) {
  FLAME_CHECK(std >= 0, "add_grad_noise_", "std must be non-negative, got ", std);
  NoGradGuard no_grad;
  for (const Tensor& k : all_keys(grads)) {
    Tensor& g = grads.at(k);
    g.add_(Tensor::randn(g.sizes(), 0.0, std, {g.dtype(), g.device()}, gen));
  }
}

GradStats grad_stats(const Gradients& grads) {
  GradStats s;
  double sum = 0, sq = 0;
  s.min = std::numeric_limits<double>::infinity();
  s.max = -std::numeric_limits<double>::infinity();
  for (const auto& e : grads.entries()) {
    if (!e.grad.defined()) {
      s.norms.push_back(0.0);
      continue;
    }
    Tensor g = e.grad.to(DType::f64);
    const int64_t n = g.numel();
    s.numel += n;
    s.nan_count += g.isnan().sum_all().item<int64_t>();
    s.inf_count += g.isinf().sum_all().item<int64_t>();
    if (n == 0) {
      s.norms.push_back(0.0);
      continue;
    }
    // Statistics over the finite values.
    Tensor finite = g.isnan().logical_or(g.isinf()).logical_not();
    Tensor gf = where(finite, g, Tensor::scalar(0.0, {DType::f64, g.device()}));
    const double n2 = gf.square().sum_all().item<double>();
    s.norms.push_back(std::sqrt(n2));
    sq += n2;
    sum += gf.sum_all().item<double>();
    if (finite.any().item<bool>()) {
      s.min = std::min(s.min, where(finite, g, Tensor::scalar(INFINITY, {DType::f64, g.device()})).min_all().item<double>());
      s.max = std::max(s.max, where(finite, g, Tensor::scalar(-INFINITY, {DType::f64, g.device()})).max_all().item<double>());
    }
  }
  s.global_norm = std::sqrt(sq);
  const int64_t finite_n = s.numel - s.nan_count - s.inf_count;
  s.mean = finite_n > 0 ? sum / static_cast<double>(finite_n) : 0.0;
  if (finite_n == 0) s.min = s.max = 0.0;
  return s;
}

}  // namespace flame
