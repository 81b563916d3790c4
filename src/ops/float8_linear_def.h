#pragma once
// Op definition of the 8-bit float Linear (Note [Float8 Linear] in flame/nn/float8.h; Note [Invoke]
// in src/ops/invoke.h). prepare / run and the shared pieces are in src/ops/float8_linear.cpp;
// record, the gradient rule, in src/autograd/rules/float8_linear.cpp.
#include <utility>

#include "flame/nn/linear_float8.h"
#include "flame/tensor.h"
#include "src/ops/invoke.h"

namespace flame::op_detail {

struct Float8LinearArgs {
  Tensor x, q, scale, bias;
  nn::Float8Compute compute = nn::Float8Compute::dequantize;
  DType grad_dtype = DType::f8_e4m3fn;
};
struct Float8LinearDef : OpDefaults<Float8LinearArgs> {
  struct Prep {
    Tensor x2;      // x as [rows, in], contiguous
    Tensor scale;   // the weight's scale as f32 [out], contiguous
    Tensor bias;    // in x's dtype, or undefined
    Shape out_shape;
  };
  struct Result {
    Tensor out;
  };
  using Out = Tensor;
  static const char* name(const Args&) { return "linear_float8"; }
  static TensorList inputs(const Args& a) { return {a.x, a.q, a.scale, a.bias}; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.x = in[0];
    a.q = in[1];
    a.scale = in[2];
    a.bias = in[3];
    return a;
  }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
};

// The pieces the forward and the backward share (no gradient recorded by any).
// q [out, in] 8-bit (any strides; a column block is read in place) times scale (f32, [out] or one
// value) per row, in `dtype` ([out, in]).
Tensor float8_dense(const Tensor& q, const Tensor& scale, DType dtype);
// out [M, N] in `dtype` = diag(a_scale) (a b^T) diag(b_scale) + bias: a [M, K] 8-bit contiguous,
// b [N, K] 8-bit contiguous or a column block whose rows start 16 bytes apart, a_scale f32 [M],
// b_scale f32 [N]; the FP8 GEMM where the device has one, else the f32 product of the 8-bit values
// then the scales (the reference).
Tensor float8_matmul(const Tensor& a, const Tensor& a_scale, const Tensor& b, const Tensor& b_scale, const Tensor& bias,
                     DType dtype);

}  // namespace flame::op_detail
