#pragma once
// The 8-bit float linear as an op: y = x (q * scale)^T + bias with q an 8-bit weight, in one of two
// compute modes (Note [Float8 Linear] in flame/nn/float8.h, which has the layer-level API:
// Linear::to_float8, quantize_float8).
#include <cstdint>
#include <string>

#include "flame/device.h"
#include "flame/dtype.h"
#include "flame/tensor.h"

namespace flame::nn {

enum class Float8Compute : uint8_t {
  dequantize,  // the 8-bit weight is expanded into the ordinary GEMM (memory only)
  fp8,         // FP8 GEMMs with per-row scaled activations and gradients (memory and speed)
};

// Parses "dequantize" / "fp8" (configs, command lines); raises naming the value otherwise.
Float8Compute parse_float8_compute(const std::string& s);
const char* float8_compute_name(Float8Compute c);

// Whether Float8Compute::fp8 runs FP8 GEMMs on `device` (CUDA, compute capability 8.9 or later,
// cuBLASLt with outer-vector scales): checked once per device with a 16 x 16 x 16 GEMM. Where it is
// false, fp8 layers compute the same quantised product in f32 (correct, not faster).
bool float8_gemm_supported(Device device);
// How fp8 layers multiply on `device`: "cublaslt-outer-vector-scales" (cuBLASLt applies the row
// and column scales and the bias in its epilogue), "cublaslt-then-scale-pass" (this cuBLASLt has no
// outer-vector scales: the FP8 GEMM runs without them and one pass over the output applies them
// and the bias) or "reference" (no FP8 GEMM: the f32 product of the 8-bit values).
const char* float8_gemm_path(Device device);

namespace functional {
// y = x (q * scale)^T + bias (Note [Float8 Linear]): x [..., in] floating; q [out, in] an 8-bit
// float tensor, which may be a column block of a wider 8-bit weight (w.narrow(1, start, in), read
// in place where its rows start 16 bytes apart); scale f32 (or any floating dtype) with one value
// per output row ([out], [out, 1]) or one for all (0-d, [1]); bias [out] or undefined. Under
// autocast x and the bias are cast to the low dtype; the result has x's (cast) dtype. q and scale
// get no gradient.
Tensor linear_float8(const Tensor& x, const Tensor& q, const Tensor& scale, const Tensor& bias = Tensor(),
                     Float8Compute compute = Float8Compute::dequantize, DType grad_dtype = DType::f8_e4m3fn);
}  // namespace functional

}  // namespace flame::nn
