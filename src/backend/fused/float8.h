#pragma once
// The 8-bit float kernels of the Float8 Linear (Note [Float8 Linear] in flame/nn/float8.h) as fused
// kernels (Note [Fused kernels]). The row casts are in both backends (src/backend/cpu/cpu_float8.cpp,
// the reference; src/backend/cuda/float8/float8.cu) and give the same bits; the FP8 GEMM is CUDA's
// (cuBLASLt), whose reference is the op layer's f32 product of the dequantised operands
// (src/ops/float8_linear.cpp).
#include "src/backend/fused.h"

namespace flame::backend::fused {

// Per-row scaled cast: x [R, C] contiguous (f32, f64, bf16 or f16), col f32 [C] contiguous or
// undefined (a per-column factor applied first), q [R, C] contiguous of an 8-bit dtype, scale f32
// [R] contiguous. In f32, with v = x[r, c] * col[c] (x[r, c] without col):
//   amax_r = max_c |v| (NaN when a v is NaN),  scale[r] = amax_r == 0 ? 1 : amax_r / float8_max,
//   q[r, c] = v / scale[r] rounded to nearest even, saturating at +-float8_max (NaN stays NaN).
// (q, scale, x, col)
extern FusedKernel<bool(const Tensor&, const Tensor&, const Tensor&, const Tensor&)> float8_quantize_rows;

// out [R, C] contiguous floating = float(q[r, c]) * scale[r] in f32, rounded to out's dtype; q
// 8-bit, either contiguous (any rank, C its last size) or 2-d [R, C] with unit column stride and
// any row stride (a column block of a wider weight, read in place); scale f32 contiguous with R
// values, or 1 value for every row.
// (out, q, scale)
extern FusedKernel<bool(const Tensor&, const Tensor&, const Tensor&)> float8_dequantize_rows;

// out [M, N] contiguous (bf16, f16 or f32) = diag(a_scale) (a b^T) diag(b_scale) + bias, the
// product of the 8-bit values accumulated in f32: a [M, K] contiguous and b [N, K] with unit column
// stride and a row stride that is a multiple of 16 (contiguous, or a column block of a wider
// weight), both 8-bit (not both e5m2); a_scale f32 [M], b_scale f32 [N], bias [N] in out's dtype
// or undefined. Declines (false, nothing written) where the device or cuBLASLt cannot run it
// (compute capability below 8.9, K not a multiple of 16, no algorithm).
// (out, a, a_scale, b, b_scale, bias)
extern FusedKernel<bool(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&)>
    float8_gemm;

// How float8_gemm last ran on device `index`: 0 not yet, 1 with cuBLASLt's outer-vector scales
// (and its bias epilogue), 2 as a GEMM without scales followed by one pass applying them and the
// bias (where cuBLASLt offers no outer-vector scales). (device index)
extern FusedKernel<int(int)> float8_gemm_path;

}  // namespace flame::backend::fused
