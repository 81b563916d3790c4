#pragma once
// Note [Optimizer element math]
// The per-element updates of the fused optimizers and the EMA, shared by the CPU reference loops
// (cpu_optim.cpp) and the CUDA multi-tensor kernels (cuda/optim/), so both backends run the same
// formulas in the same order. C is the compute type: double for f64 parameters, float otherwise
// (half parameters and their f32 master weights). They follow torch.optim's single-tensor code:
//  - SGD: g (+ wd p); buf = first ? g : momentum buf + (1 - dampening) g; nesterov g + momentum buf.
//  - Adam/AdamW: m.lerp_(g, 1 - b1); v = b2 v + (1 - b2) g^2; denom = sqrt(v)/sqrt(bc2) + eps;
//    p -= lr/bc1 * m/denom (AdamW first scales p by 1 - lr wd; Adam adds wd p to g).
//  - Lion (Chen et al. 2023): p *= 1 - lr wd; p -= lr sign(b1 m + (1 - b1) g); m = b2 m + (1 - b2) g.
#include <cstdint>

#include "flame/half.h"
#include "src/backend/optim_params.h"
#include "src/ops/scalar_math.h"
#include "src/random/philox.h"

namespace flame::backend::optim_math {

// Scalars of one call in the compute type.
template <class C>
struct Hyper {
  C lr, weight_decay, beta1, beta2, eps, momentum, dampening;
  bool nesterov, maximize, amsgrad, decoupled;
  OptimKind kind;
};

template <class C>
inline Hyper<C> make_hyper(const OptimHyper& h) {
  return Hyper<C>{static_cast<C>(h.lr),       static_cast<C>(h.weight_decay), static_cast<C>(h.beta1),
                  static_cast<C>(h.beta2),    static_cast<C>(h.eps),          static_cast<C>(h.momentum),
                  static_cast<C>(h.dampening), h.nesterov,                     h.maximize,
                  h.amsgrad,                  h.decoupled_weight_decay,       h.kind};
}

// One element. p is the parameter (or its master) value, g the gradient, s0..s2 the state
// slots (see OptimTensor); all in C, updated in place.
template <class C>
FLAME_INLINE void sgd_update(const Hyper<C>& h, bool first, C& p, C g, C& buf) {
  if (h.maximize) g = -g;
  if (h.weight_decay != C(0)) g = g + h.weight_decay * p;
  if (h.momentum != C(0)) {
    buf = first ? g : h.momentum * buf + (C(1) - h.dampening) * g;
    g = h.nesterov ? g + h.momentum * buf : buf;
  }
  p = p - h.lr * g;
}

template <class C>
FLAME_INLINE void adam_update(const Hyper<C>& h, C step_size, C bias2_sqrt, C& p, C g, C& m, C& v, C& vmax) {
  if (h.maximize) g = -g;
  if (h.decoupled) {
    p = p * (C(1) - h.lr * h.weight_decay);
  } else if (h.weight_decay != C(0)) {
    g = g + h.weight_decay * p;
  }
  m = m + (C(1) - h.beta1) * (g - m);
  v = h.beta2 * v + (C(1) - h.beta2) * g * g;
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
  p = p * (C(1) - h.lr * h.weight_decay);
  const C c = h.beta1 * m + (C(1) - h.beta1) * g;
  const C sign = c > C(0) ? C(1) : (c < C(0) ? C(-1) : C(0));
  p = p - h.lr * sign;
  m = h.beta2 * m + (C(1) - h.beta2) * g;
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
