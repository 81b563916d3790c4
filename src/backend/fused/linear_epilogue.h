#pragma once
// Fused cuBLASLt epilogues of Linear (Note [Linear epilogues] in src/ops/linear_epilogue.cpp), as
// fused kernels (Note [Fused kernels]): the CUDA backend has them (epi/linear_epilogue.cu); without
// one, or when it declines the dtypes, layouts or sizes, the op layer runs the unfused composite,
// which is also the reference. Every tensor is contiguous and of one dtype, except the
// master-weight gradients (Note [Master-weight epilogues] in src/ops/linear_epilogue.cpp): beside
// bf16/f16 dy and x, the wgrad's dw and dbias may be f32.
#include "src/backend/fused.h"

namespace flame::backend::fused {

// y [M, N] = act(x [M, K] @ w [N, K]^T + bias [N]); bias may be undefined; act is gelu_tanh when
// `gelu`, and pre (when defined) receives the value before it.
// (y, pre, x, w, bias, gelu)
extern FusedKernel<bool(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool)>
    linear_bias_act;
// dw [N, K] = dy [M, N]^T @ x [M, K] and dbias [N] (when defined) = the column sums of dy, in one
// GEMM. (dw, dbias, dy, x)
extern FusedKernel<bool(const Tensor&, const Tensor&, const Tensor&, const Tensor&)> linear_wgrad_bgrad;
// dpre [M, N] = (dy [M, P] @ w [P, N]) * gelu_tanh'(pre [M, N]) and dbias [N] (when defined) = the
// column sums of dpre, in one GEMM. (dpre, dbias, dy, w, pre)
extern FusedKernel<bool(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)>
    linear_dgelu_bgrad;
// dpre = dy * gelu_tanh'(pre), elementwise over same-shape tensors. (dpre, dy, pre)
extern FusedKernel<bool(const Tensor&, const Tensor&, const Tensor&)> gelu_tanh_backward;

}  // namespace flame::backend::fused
