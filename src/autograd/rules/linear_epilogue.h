#pragma once
// Gradient rule of Linear's fused epilogue ops (Note [Linear epilogues] in
// src/ops/linear_epilogue.cpp): linear with bias run as one fused GEMM, and linear_gelu.
#include "flame/tensor.h"

namespace flame::rules {
// y [..., out] = act(x [..., in] @ w^T + b) with act = gelu_tanh when pre (the value before it,
// [rows, out] contiguous) is defined, else identity. x2 is x as the [rows, in] contiguous matrix the
// GEMM read; b may be undefined. Records one node with inputs {x, w, b}. w_run is the matrix the
// GEMM read: w, or for an f32 master weight beside a half x its low-precision copy (Note
// [Master-weight epilogues]; w's and b's gradients then come out f32).
void linear_epilogue(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& x2,
                     const Tensor& pre, const Tensor& w_run);
// y [..., out] = linear(gelu_tanh(linear(x, w1, b1)), w2, b2) (mlp_gelu): x2 as above, pre the
// first layer's pre-activation and h = gelu_tanh(pre), both [rows, hidden] contiguous.
// recompute_hidden: save pre but not h; the backward recomputes h for w2's gradient. w1_run and
// w2_run as linear_epilogue's w_run.
void mlp_gelu(Tensor& y, const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
              const Tensor& x2, const Tensor& pre, const Tensor& h, bool recompute_hidden, const Tensor& w1_run,
              const Tensor& w2_run);
}  // namespace flame::rules
