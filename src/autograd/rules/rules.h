#pragma once
// Entry points of the gradient rules, called by the op layer right after an op computed its
// result. Each records a node on `out` when needs_grad(inputs). The formulas live only here.
#include "flame/tensor.h"
#include "src/backend/backend.h"

namespace flame::rules {
// x: the input as the kernel saw it (after dtype promotion); orig: the user's input.
void unary(Tensor& out, backend::UnaryOp op, const Tensor& orig, const Tensor& x, const backend::UnaryParams& p);
void binary(Tensor& out, backend::BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& ac, const Tensor& bc);
void where(Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);
}  // namespace flame::rules
