#pragma once
// The rotary embedding's kernel as a fused kernel (Note [Fused kernels]): both backends have it
// (src/backend/cpu/cpu_rotary.cpp, the reference; src/backend/cuda/rotary/rotary.cu). The op is
// src/ops/rotary.cpp.
#include "src/backend/fused.h"

namespace flame::backend::fused {

// x, out: contiguous rows of D, one floating dtype; cos, sin: [S, D] contiguous, f32 (f64 when x is
// f64). Row r sits at position (r / heads) % S: heads = 1 for [N, S, D] memory, H for [B, S, H, D]
// memory (q and k as one projection gives them, seen as [B, H, S, D]). layout: 0 interleaved pairs
// (2i, 2i + 1), 1 half pairs (i, i + D/2). For each pair (a, b):
//   forward:  out[a] = x[a] c[a] - x[b] s[a],  out[b] = x[b] c[b] + x[a] s[b]
//   inverse:  out[a] = x[a] c[a] + x[b] s[b],  out[b] = x[b] c[b] - x[a] s[a]
// (the inverse is the forward's transpose: the gradient of x given the output's in x). Computed in
// the dtype of cos. Returns false, writing nothing, for a call it does not take.
// (out, x, cos, sin, layout, inverse, heads)
extern FusedKernel<bool(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int, bool, int64_t)>
    rotary_embedding;

}  // namespace flame::backend::fused
