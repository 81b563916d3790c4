#pragma once
// Note [Optimizer element math]
// The per-element updates of the fused optimizers and the EMA, shared by the CPU reference loops
// (cpu_optim.cpp) and the CUDA multi-tensor kernels (cuda/optim/), so both backends run the same
// formulas in the same order. C is the compute type: double for f64 parameters, float otherwise
// (half parameters and their f32 master weights). They follow torch.optim's single-tensor code:
//  - SGD: g (+ wd p); buf = first ? g : momentum buf + (1 - dampening) g; nesterov g + momentum buf.
//  - Adam/AdamW: m.lerp_(g, 1 - b1); v = b2 v + (1 - b2) g^2; denom = sqrt(v)/sqrt(bc2) + eps;
//    p -= lr/bc1 * m/denom (AdamW first scales p by 1 - lr wd; Adam adds wd p to g).
// Hyperparameter arithmetic (1 - b, 1 - dampening, 1 - lr wd, lr/bc1, sqrt(bc2)) is done in double
// and rounded to C once (make_hyper, and the host's per-tensor step scalars), as torch.optim does.
//  - Lion (Chen et al. 2023): p *= 1 - lr wd; p -= lr sign(b1 m + (1 - b1) g); m = b2 m + (1 - b2) g.
#include <cmath>
#include <cstdint>

#include "flame/half.h"
#include "src/backend/optim_params.h"
#include "src/opdef/scalar_math.h"
#include "src/random/philox.h"

namespace flame::backend::optim_math {

// Scalars of one call in the compute type. Every combination of hyperparameters (1 - beta,
// 1 - dampening, 1 - lr wd) is formed in double and rounded once, as torch.optim does (its Python
// floats reach the kernels as scalars): `1 - beta2` formed in f32 from f32(0.999) is 0.00099998713,
// 1.3e-5 below f32(0.001), and so is every second moment it makes.
template <class C>
struct Hyper {
  C lr, weight_decay, beta1, beta2, eps, momentum;
  C one_minus_beta1, one_minus_beta2, one_minus_dampening;
  C decay;  // decoupled weight decay's factor 1 - lr wd (AdamW, Lion)
  bool nesterov, maximize, amsgrad, decoupled;
  OptimKind kind;
};

template <class C>
FLAME_INLINE Hyper<C> make_hyper(const OptimHyper& h) {
  Hyper<C> r;
  r.lr = static_cast<C>(h.lr);
  r.weight_decay = static_cast<C>(h.weight_decay);
  r.beta1 = static_cast<C>(h.beta1);
  r.beta2 = static_cast<C>(h.beta2);
  r.eps = static_cast<C>(h.eps);
  r.momentum = static_cast<C>(h.momentum);
  r.one_minus_beta1 = static_cast<C>(1.0 - h.beta1);
  r.one_minus_beta2 = static_cast<C>(1.0 - h.beta2);
  r.one_minus_dampening = static_cast<C>(1.0 - h.dampening);
  r.decay = static_cast<C>(1.0 - h.lr * h.weight_decay);
  r.nesterov = h.nesterov;
  r.maximize = h.maximize;
  r.amsgrad = h.amsgrad;
  r.decoupled = h.decoupled_weight_decay;
  r.kind = h.kind;
  return r;
}

// The hyperparameters a capturable call reads from memory at kernel time (OptimHyper::device_hyper;
// a host pointer on the CPU backend, a device pointer on CUDA); `h` itself when none.
FLAME_INLINE OptimHyper resolve_hyper(OptimHyper h) {
  if (h.device_hyper != nullptr) {
    const double* d = h.device_hyper;
    h.lr = d[0];
    h.weight_decay = d[1];
    h.beta1 = d[2];
    h.beta2 = d[3];
    h.eps = d[4];
    h.momentum = d[5];
    h.dampening = d[6];
  }
  return h;
}

// Per-tensor scalars of one step: Adam's bias corrections and the stochastic-rounding offset.
// With a device step they are computed here from t, with the same double formulas the optimizer
// layer uses on the host for eager steps, so captured and eager steps round alike.
struct StepScalars {
  double step_size;
  double bias2_sqrt;
  uint64_t rng_offset;
};

template <class E>  // OptimTensor on the host, the kernels' packed argument struct on CUDA
FLAME_INLINE StepScalars step_scalars(const OptimHyper& resolved, const E& e) {
  if (e.device_step == nullptr) return StepScalars{e.step_size, e.bias2_sqrt, e.rng_offset};
  const double t = *e.device_step;
  StepScalars s{0.0, 1.0, static_cast<uint64_t>(t)};
  if (resolved.kind == OptimKind::adam) {
    s.step_size = resolved.lr / (1.0 - ::pow(resolved.beta1, t));
    s.bias2_sqrt = ::sqrt(1.0 - ::pow(resolved.beta2, t));
  }
  return s;
}

// The EMA decay at update count `step`: decay, or min(decay, (1 + step) / (10 + step)) with warmup
// (optim::EMA::decay_at; shared so the device-counter path computes it the same way).
FLAME_INLINE double ema_decay(double decay, bool warmup, double step) {
  if (!warmup) return decay;
  const double w = (1.0 + step) / (10.0 + step);
  return decay < w ? decay : w;
}

// One element. p is the parameter (or its master) value, g the gradient, s0..s2 the state
// slots (see OptimTensor); all in C, updated in place.
template <class C>
FLAME_INLINE void sgd_update(const Hyper<C>& h, bool first, C& p, C g, C& buf) {
  if (h.maximize) g = -g;
  if (h.weight_decay != C(0)) g = g + h.weight_decay * p;
  if (h.momentum != C(0)) {
    buf = first ? g : h.momentum * buf + h.one_minus_dampening * g;
    g = h.nesterov ? g + h.momentum * buf : buf;
  }
  p = p - h.lr * g;
}

template <class C>
FLAME_INLINE void adam_update(const Hyper<C>& h, C step_size, C bias2_sqrt, C& p, C g, C& m, C& v, C& vmax) {
  if (h.maximize) g = -g;
  if (h.decoupled) {
    p = p * h.decay;
  } else if (h.weight_decay != C(0)) {
    g = g + h.weight_decay * p;
  }
  // torch's lerp_(g, 1 - b1): from the nearer end, so a weight near 1 (a small beta1) is exact too.
  m = h.one_minus_beta1 < C(0.5) ? m + h.one_minus_beta1 * (g - m) : g - (g - m) * (C(1) - h.one_minus_beta1);
  v = h.beta2 * v + h.one_minus_beta2 * g * g;
  C vhat = v;
  if (h.amsgrad) {
    vmax = vmax > v ? vmax : v;
    vhat = vmax;
  }
  const C denom = math::sqrt(vhat) / bias2_sqrt + h.eps;
  p = p - step_size * (m / denom);
}

template <class C>
FLAME_INLINE void lion_update(const Hyper<C>& h, C& p, C g, C& m) {
  if (h.maximize) g = -g;
  p = p * h.decay;
  const C c = h.beta1 * m + h.one_minus_beta1 * g;
  const C sign = c > C(0) ? C(1) : (c < C(0) ? C(-1) : C(0));
  p = p - h.lr * sign;
  m = h.beta2 * m + h.one_minus_beta2 * g;
}

// Rounds an f32 value to bf16 stochastically: adds 16 random bits below the kept mantissa and
// truncates, so the result is the upper neighbour with probability equal to the dropped
// fraction (unbiased). NaN and Inf round to nearest.
FLAME_INLINE bfloat16 stochastic_round_bf16(float x, uint32_t random_bits) {
  const uint32_t u = detail::float_bits(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return bfloat16(x);
  return bfloat16::from_bits(static_cast<uint16_t>((u + (random_bits & 0xffffu)) >> 16));
}

FLAME_INLINE uint32_t rounding_bits(uint64_t seed, uint64_t index, uint64_t offset) {
  return philox::generate(seed, index, offset).w[0];
}

}  // namespace flame::backend::optim_math
