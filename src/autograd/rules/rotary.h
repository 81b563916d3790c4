#pragma once
// Gradient rule of the fused rotary embedding (src/ops/rotary.cpp).
#include "flame/tensor.h"

namespace flame::rules {
// Records the node of out = rotary(x) on `out` when x needs a gradient: saves only cos and sin (as
// the kernel read them, [S, D] contiguous in the compute dtype); the backward is the kernel's
// inverse pass over the output's gradient (src/backend/fused/rotary.h).
void rotary(Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, int layout);
}  // namespace flame::rules
