#pragma once
// The RMS QK-norm fused with the join of attention's streams and the rotary embedding, as fused
// kernels (Note [Fused kernels]; the op is src/ops/rms_norm_rotary.cpp, Note [RMS norm rotary]).
// Both backends have them: src/backend/cpu/cpu_rotary.cpp (the reference) and
// src/backend/cuda/rotary/rms_norm_rotary.cu.
#include "src/backend/fused.h"

namespace flame::backend::fused {

// parts: P >= 1 contiguous [B, S_p, H, D] tensors of one floating dtype T, joined along S in the
// order given (S = sum S_p); weights: P entries, each undefined or [D] contiguous in T; cos, sin:
// undefined (no rotation) or [S, D] contiguous in f32 (f64 for f64 parts); layout as the rotary
// kernel's (0 interleaved, 1 half). Row (b, s, h) of part p, with rstd = 1 / sqrt(mean(x^2) + eps)
// computed in f32 (f64 for f64), rounded to f32 as rms_norm's statistics are:
//   n = T(x * rstd * w)                     (rms_norm's output with weight w, in T)
//   y = T(rotary(n))                        (the rotary kernel's forward over the joined row s)
// Forward writes y into out ([B, S, H, D] contiguous). Backward, given g ([B, S, H, D] with D
// contiguous; any strides for B, S and H), writes each part's gradient into dparts (contiguous as
// the parts): gn = T(rotary inverse(g)), then rms_norm's backward of gn for the weight's values.
// Returns false, writing nothing, for a call the device does not take.
// (out, parts, weights, cos, sin, layout, eps)
extern FusedKernel<bool(const Tensor&, const TensorList&, const TensorList&, const Tensor&, const Tensor&, int, double)>
    rms_norm_rotary_forward;
// (dparts, g, parts, weights, cos, sin, layout, eps)
extern FusedKernel<bool(const TensorList&, const Tensor&, const TensorList&, const TensorList&, const Tensor&,
                        const Tensor&, int, double)>
    rms_norm_rotary_backward;

}  // namespace flame::backend::fused
