// Gradient rules of the reductions, cumsum and softmax. `out` has the kept dims only (the keepdim
// view is recorded separately as a view); keep_shape is x's shape with reduced dims set to 1.
#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/autograd/rules/rules.h"

namespace flame::rules {
using backend::ReduceOp;

void reduce(Tensor& out, ReduceOp op, const Tensor& x, const Shape& keep_shape, int64_t count) {
  if (!is_floating(out.dtype()) || !needs_grad({x})) return;
  const Shape xs = x.sizes();
  SavedTensor sx, sy;
  if (op == ReduceOp::prod || op == ReduceOp::max || op == ReduceOp::min) {
    sx = SavedTensor(x, "reduce");
    sy = SavedTensor(out, "reduce");
  }
  const char* name = op == ReduceOp::sum ? "sum" : op == ReduceOp::mean ? "mean" : op == ReduceOp::prod ? "prod" : "amax/amin";
  record(out, name, {x}, [=](const Tensor& g) {
    Tensor gk = g.reshape(keep_shape);
    switch (op) {
      case ReduceOp::sum: return TensorList{gk.expand(xs).contiguous()};
      case ReduceOp::mean: return TensorList{(gk / static_cast<double>(count)).expand(xs).contiguous()};
      case ReduceOp::prod: {
        // d prod / d x_i = prod of the others: y / x_i when x_i != 0; with exactly one zero in the
        // slice, the zero's gradient is the product of the non-zeros; with two or more, all zero.
        Tensor xv = sx.get(), yk = sy.get().reshape(keep_shape);
        Shape dims;
        for (std::size_t d = 0; d < xs.size(); ++d) {
          if (keep_shape[d] == 1 && xs[d] != 1) dims.push_back(static_cast<int64_t>(d));
        }
        if (dims.empty()) return TensorList{gk.expand(xs).contiguous()};
        Tensor zero = Tensor::scalar(0.0, {xv.dtype(), xv.device()});
        Tensor is_zero = xv.eq(zero);
        Tensor zeros_in_slice = sum(is_zero, dims, true);
        Tensor others = prod(where(is_zero, Tensor::scalar(1.0, {xv.dtype(), xv.device()}), xv), dims, true);
        Tensor one_zero = zeros_in_slice.eq(Tensor::scalar(1, zeros_in_slice.device()));
        Tensor at_zero = where(one_zero, others, zero);
        Tensor d = where(is_zero, at_zero.expand(xs), yk / xv);
        return TensorList{gk * d};
      }
      default: {  // max/min: shared equally by the elements that attain the extreme
        Tensor xv = sx.get(), yk = sy.get().reshape(keep_shape);
        Tensor hit = xv.eq(yk).to(g.dtype());
        Shape dims;
        for (std::size_t d = 0; d < xs.size(); ++d) {
          if (keep_shape[d] == 1 && xs[d] != 1) dims.push_back(static_cast<int64_t>(d));
        }
        Tensor n = dims.empty() ? hit : sum(hit, dims, true);
        return TensorList{gk * hit / n};
      }
    }
  });
}

void cumsum(Tensor& out, const Tensor& x, int64_t dim) {
  if (!is_floating(out.dtype()) || !needs_grad({x})) return;
  record(out, "cumsum", {x}, [dim](const Tensor& g) {
    if (g.dim() == 0) return TensorList{g};
    // Reverse cumulative sum: sum_{j >= i} g_j = total - cumsum(g)_i + g_i.
    return TensorList{sum(g, {dim}, true) - g.cumsum(dim) + g};
  });
}

void softmax(Tensor& out, const Tensor& x, int64_t dim, bool log) {
  if (!needs_grad({x})) return;
  SavedTensor sy(out, log ? "log_softmax" : "softmax");
  record(out, log ? "log_softmax" : "softmax", {x}, [sy, dim, log](const Tensor& g) {
    Tensor y = sy.get();
    const Shape dims = y.dim() == 0 ? Shape{} : Shape{dim};
    if (log) return TensorList{g - y.exp() * sum(g, dims, true)};
    return TensorList{y * (g - sum(g * y, dims, true))};
  });
}

}  // namespace flame::rules
