#pragma once
// Internal entry points of the elementwise op layer, for composite ops in other files.
#include "flame/tensor.h"
#include "src/backend/backend.h"

namespace flame {
Tensor unary_op(backend::UnaryOp op, const Tensor& x, const backend::UnaryParams& p);
Tensor scalar_op(backend::UnaryOp op, const Tensor& x, Scalar s);
Tensor binary_op(backend::BinaryOp op, const Tensor& a, const Tensor& b);
}  // namespace flame
