#pragma once
// A GEMM that adds its product to a given matrix in its epilogue (cuBLASLt's beta = 1), as a fused
// kernel (Note [Fused kernels]): the CUDA backend has it (src/backend/cuda/matmul.cu); elsewhere, or
// when it declines, the caller composes matmul and add, which is also the reference. Used where a
// gradient sum would otherwise take a pass of its own (Note [Accumulated input gradients] in
// src/autograd/rules/linalg.cpp).
#include "src/backend/fused.h"

namespace flame::backend::fused {

// dst [M, N] = c [M, N] + a [M, K] @ b [K, N], one floating dtype; dst and c contiguous (c may be
// dst itself: accumulated in place); a and b any strides the GEMM reads (transposed views too). In
// f32 for bf16/f16 (the product and the add rounded once). (dst, a, b, c)
extern FusedKernel<bool(const Tensor&, const Tensor&, const Tensor&, const Tensor&)> matmul_add;

}  // namespace flame::backend::fused
