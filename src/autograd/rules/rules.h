#pragma once
// Entry points of the gradient rules, called by the op layer right after an op computed its
// result. Each records a node on `out` when needs_grad(inputs). The formulas live only here.
#include <functional>
#include <vector>

#include "flame/tensor.h"
#include "src/backend/backend.h"

namespace flame::rules {
// x: the input as the kernel saw it (after dtype promotion); orig: the user's input.
void unary(Tensor& out, backend::UnaryOp op, const Tensor& orig, const Tensor& x, const backend::UnaryParams& p);
void binary(Tensor& out, backend::BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& ac, const Tensor& bc);
void where(Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);
}  // namespace flame::rules

namespace flame::rules {
// Records a node for a view or copy of `in` whose gradient is back(g) (back captures no tensors).
Tensor& with_grad(Tensor& out, const char* name, const Tensor& in, std::function<Tensor(const Tensor&)> back);
// x.narrow(d, start, length) = v: a node that takes x's pending gradient sum (Note [Accumulate base]).
void narrow(Tensor& v, const Tensor& x, int64_t d, int64_t start);
}  // namespace flame::rules

namespace flame::rules {
// cat: starts[i] is where input i begins along dim d of out, -1 for a skipped [0] input.
void cat(Tensor& out, const TensorList& tensors, const std::vector<int64_t>& starts, int64_t d);
void stack(Tensor& out, const TensorList& tensors, int64_t d);
}  // namespace flame::rules
