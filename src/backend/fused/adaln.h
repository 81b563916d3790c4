#pragma once
// Fused adaLN pieces of DiT-style blocks (Note [adaLN ops] in src/ops/adaln.cpp), as fused kernels
// (Note [Fused kernels]): the CUDA backend has them (adaln/adaln.cu); without one, or when it
// declines the call, the op layer composes, and the composite is the reference.
// x, y, dy, dx, out, ...: [B, T, D] contiguous; shift, scale, gate: [B, D] with column stride 1
// (any row stride, e.g. chunks of one [B, k*D] projection); mean/rstd [B*T] f32 per row.
#include "src/backend/fused.h"

namespace flame::backend::fused {

// y = layer_norm(x) * (1 + scale) + shift, y's dtype may differ from x's (autocast). xhat, when
// defined (y's dtype and shape), also receives the normalised x, (x - mean) * rstd: what the
// backward reads instead of x and mean when y's dtype is narrower than x's.
// (y, mean, rstd, x, shift, scale, eps, xhat)
extern FusedKernel<bool(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        double, const Tensor&)>
    adaln_forward;

// What an adaLN backward may also do (each part undefined: not done).
struct AdalnBackwardMore {
  // dx's pending gradient sum (dx's shape and dtype, contiguous; it may be dx itself): dx = base +
  // the gradient (Note [Accumulate base] in src/autograd/backward.cpp). A kernel that declines it
  // is asked again without it and the rule composes the sum.
  Tensor base;
  // The gated residual x = x_prev + gate * branch (gate [B, D] as shift, branch [B, T, D] in gate's
  // dtype) whose complete gradient the final dx is: then also dbranch = gate * dx (branch's dtype,
  // may be undefined) and dgate = sum over T of dx * branch ([B, D] contiguous, gate's dtype). Note
  // [Fused residual backward] in src/ops/adaln.cpp.
  Tensor gate, branch, dbranch, dgate;
  // With dbranch: its column sums over every row, f32 [D] contiguous, from the f32 products before
  // dbranch's rounding (the bias gradient of the Linear that made branch: Note [Gradient row sums]
  // in src/autograd/node.cpp), or undefined. A kernel may leave it unwritten only by declining the
  // whole residual part.
  Tensor dbias;
};

// dx (x's dtype), dshift and dscale ([B, D] contiguous, the modulation's dtype; each may be
// undefined) of the forward above given dy (y's dtype). With mean undefined, x is the x-hat the
// forward wrote (y's dtype); dx still has the dtype of the forward's x (more.base's, or f32 when
// x-hat is narrower and there is no base).
// (dx, dshift, dscale, dy, x, mean, rstd, scale, more)
extern FusedKernel<bool(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&, const Tensor&, const AdalnBackwardMore&)>
    adaln_backward;

// h = x + gate * branch (x's dtype, branch: gate's), then y, mean, rstd (and xhat) of h as
// adaln_forward: a gated residual and the adaLN that reads its result, in one pass over the rows.
// (h, y, mean, rstd, x, gate, branch, shift, scale, eps, xhat)
extern FusedKernel<bool(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&, const Tensor&, const Tensor&, double, const Tensor&)>
    adaln_residual_forward;

// out = x + gate * y (gate broadcast over T). (out, x, gate, y)
extern FusedKernel<bool(const Tensor&, const Tensor&, const Tensor&, const Tensor&)> gated_residual_forward;

// dy = dout * gate (y's dtype) and dgate = sum over T of dout * y ([B, D] contiguous, gate's dtype);
// dy may be undefined. (dy, dgate, dout, y, gate)
extern FusedKernel<bool(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)>
    gated_residual_backward;

}  // namespace flame::backend::fused
