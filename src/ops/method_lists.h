#pragma once
// Note [Method lists]
// Tensor methods that only forward to the free function of the same name (or, for max/min, to
// amax/amin). src/ops/tensor_methods.cpp generates their definitions from these lists; the
// declarations stay written out in include/flame/tensor.h so a user reads the method list there.
// Adding an op that is not elementwise: declare the free function in ops.h and the method in
// tensor.h, add one row here. An elementwise op needs none of that (Note [Op table]).

// Tensor::name(const Tensor& o) const -> flame::name(x, o). (The elementwise methods come from
// the op table, flame/op_table.h.)
#define FLAME_PLAIN_MATMUL_METHODS(X) X(matmul) X(bmm)

// Tensor::name(Scalar s) const -> flame::name(x, s)
#define FLAME_PLAIN_SCALAR_METHODS(X) \
  X(add_scalar) X(sub_scalar) X(mul_scalar) X(div_scalar)

// Tensor::method(const Shape& dims, bool keepdim) const -> flame::fn(x, dims, keepdim)
#define FLAME_PLAIN_REDUCTION_METHODS(X) \
  X(sum, sum) X(mean, mean) X(prod, prod) X(max, amax) X(min, amin) X(logsumexp, logsumexp) \
  X(any, any) X(all, all)
