#pragma once
// Note [Accumulated input gradients]
// A Linear's input often has several gradient contributions: q, k and v projections read one
// normalised x, and a LoRA adapter's A reads the input its frozen base layer reads. The engine
// would sum them with one pass over x per contribution (Note [Accumulate base] in
// src/autograd/backward.cpp). The GEMM rules that make an input gradient (linear and its fused
// epilogues, 2-d matmul) accept the pending sum instead and hand it to the GEMM as its C matrix:
// dx = base + d @ w in the epilogue (fused::matmul_add, cuBLASLt's beta = 1), written into the base
// when the pass owns it. Where the backend has no such GEMM (the CPU) or declines, the same sum is
// composed: base + d @ w, as the engine would have added it.
#include "flame/ops.h"
#include "src/autograd/node.h"
#include "src/backend/fused/matmul_add.h"

namespace flame::rules {

// Input i's gradient d2 [rows, N] @ w2 [N, K], shaped `shape` (rows * K elements), plus the pending
// sum the engine handed for it, if any.
inline Tensor accumulated_input_grad(const Node& n, std::size_t i, const Tensor& d2, const Tensor& w2,
                                     const Shape& shape) {
  const Tensor& base = n.accumulate_base(i);
  if (!base.defined()) return d2.matmul(w2).reshape(shape);
  const int64_t rows = d2.size(0), cols = w2.size(1);
  if (base.is_contiguous() && base.numel() == rows * cols && base.dtype() == d2.dtype() &&
      w2.dtype() == d2.dtype()) {
    const Tensor c = base.view({rows, cols});
    const bool owned = n.accumulate_base_owned();
    const Tensor dst = owned ? c : Tensor::empty({rows, cols}, {c.dtype(), c.device()});
    if (backend::fused::matmul_add.try_run(d2.device(), dst, d2, w2, c)) return owned ? base : dst.view(shape);
  }
  return base + d2.matmul(w2).reshape(shape);
}

}  // namespace flame::rules
