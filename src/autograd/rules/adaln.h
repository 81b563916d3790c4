#pragma once
// Gradient rules of the fused adaLN ops (Note [adaLN ops] in src/ops/adaln.cpp): each node's
// backward is one fused kernel call (src/backend/fused/adaln.h).
#include "flame/tensor.h"
#include "src/autograd/node.h"

namespace flame::rules {

// layer_norm_modulate's node. Saved: x as [B, T, D] and mean, or (args.need[0]) x-hat in the
// result dtype; then rstd, scale. args.op: the result dtype, args.shape: x's shape, args.need[1]:
// x is the h of a gated_residual_modulate, whose gated residual node may take prepared gradients.
TensorList adaln_rule(const Tensor& grad, const Node& n);
// gated_residual's node. Saved: gate, y as [B, T, D]; args.op: the result dtype (x's); args.shape:
// x's shape.
TensorList gated_residual_rule(const Tensor& grad, const Node& n);
}  // namespace flame::rules
