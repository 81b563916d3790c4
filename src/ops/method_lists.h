#pragma once
// Note [Method lists]
// Tensor methods that only forward to the free function of the same name (or, for max/min, to
// amax/amin). src/ops/tensor_methods.cpp generates their definitions from these lists; the
// declarations stay written out in include/flame/tensor.h so a user reads the method list there.
// Adding an op: declare the free function in ops.h and the method in tensor.h, add one row here.

// Tensor::name() const -> flame::name(x)
#define FLAME_PLAIN_UNARY_METHODS(X) \
  X(neg) X(abs) X(sign) X(exp) X(log) X(log1p) \
  X(expm1) X(sqrt) X(rsqrt) X(square) X(reciprocal) X(sin) \
  X(cos) X(tanh) X(sigmoid) X(relu) X(silu) X(mish) \
  X(floor) X(ceil) X(round) X(trunc) X(isnan) X(isinf) \
  X(logical_not)

// Tensor::name(const Tensor& o) const -> flame::name(x, o)
#define FLAME_PLAIN_BINARY_METHODS(X) \
  X(add) X(sub) X(mul) X(div) X(pow) X(maximum) \
  X(minimum) X(atan2) X(fmod) X(eq) X(ne) X(lt) \
  X(le) X(gt) X(ge) X(logical_and) X(logical_or) X(matmul) \
  X(bmm)

// Tensor::name(Scalar s) const -> flame::name(x, s)
#define FLAME_PLAIN_SCALAR_METHODS(X) \
  X(add_scalar) X(sub_scalar) X(mul_scalar) X(div_scalar)

// Tensor::method(const Shape& dims, bool keepdim) const -> flame::fn(x, dims, keepdim)
#define FLAME_PLAIN_REDUCTION_METHODS(X) \
  X(sum, sum) X(mean, mean) X(prod, prod) X(max, amax) X(min, amin) X(logsumexp, logsumexp) \
  X(any, any) X(all, all)
