// Gradient rules of the reductions, cumsum and softmax. `out` has the kept dims only (the keepdim
// view is recorded separately as a view); keep_shape is x's shape with reduced dims set to 1.
// Saved tensors: sum and mean none; prod, amax and amin x and y; softmax y; cumsum none.
#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/ops/grad_hooks.h"
#include "src/ops/reduce_def.h"

namespace flame::rules {
using backend::ReduceOp;

namespace {
// The dims of x that the reduction removed (size-1 dims in keep_shape that were not size 1).
Shape reduced_dims(const Shape& xs, const Shape& keep_shape) {
  Shape dims;
  for (std::size_t d = 0; d < xs.size(); ++d) {
    if (keep_shape[d] == 1 && xs[d] != 1) dims.push_back(static_cast<int64_t>(d));
  }
  return dims;
}

TensorList reduce_backward(const Tensor& g, const Node& n) {
  const RuleArgs& a = n.args();
  const Shape& xs = n.edges()[0].shape;
  const Shape& keep_shape = a.shape;
  Tensor gk = g.reshape(keep_shape);
  switch (static_cast<ReduceOp>(a.op)) {
    // An expanded view, not a copy: the consumer reads it as it is (the store makes it contiguous).
    case ReduceOp::sum: return {gk.expand(xs)};
    case ReduceOp::mean: return {(gk / static_cast<double>(a.count)).expand(xs)};
    case ReduceOp::prod: {
      // d prod / d x_i = prod of the others: y / x_i when x_i != 0; with exactly one zero in the
      // slice, the zero's gradient is the product of the non-zeros; with two or more, all zero.
      Tensor xv = n.saved(0), yk = n.saved(1).reshape(keep_shape);
      const Shape dims = reduced_dims(xs, keep_shape);
      if (dims.empty()) return {gk.expand(xs).contiguous()};
      Tensor zero = Tensor::scalar(0.0, {xv.dtype(), xv.device()});
      Tensor is_zero = xv.eq(zero);
      Tensor zeros_in_slice = sum(is_zero, dims, true);
      Tensor others = prod(where(is_zero, Tensor::scalar(1.0, {xv.dtype(), xv.device()}), xv), dims, true);
      Tensor one_zero = zeros_in_slice.eq(Tensor::scalar(1, zeros_in_slice.device()));
      Tensor at_zero = where(one_zero, others, zero);
      Tensor d = where(is_zero, at_zero.expand(xs), yk / xv);
      return {gk * d};
    }
    default: {  // max/min: shared equally by the elements that attain the extreme
      Tensor xv = n.saved(0), yk = n.saved(1).reshape(keep_shape);
      Tensor hit = xv.eq(yk).to(g.dtype());
      const Shape dims = reduced_dims(xs, keep_shape);
      Tensor cnt = dims.empty() ? hit : sum(hit, dims, true);
      return {gk * hit / cnt};
    }
  }
}

const char* reduce_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "SumBackward";
    case ReduceOp::mean: return "MeanBackward";
    case ReduceOp::prod: return "ProdBackward";
    case ReduceOp::max: return "AmaxBackward";
    case ReduceOp::min: return "AminBackward";
    default: return "ReduceBackward";
  }
}

TensorList cumsum_backward(const Tensor& g, const Node& n) {
  if (g.dim() == 0) return {g};
  // Reverse cumulative sum, sum_{j >= i} g_j, summed from the end (as PyTorch): no cancellation
  // between a large total and a large prefix.
  const int64_t dim = n.args().dim;
  return {g.flip({dim}).cumsum(dim).flip({dim})};
}

TensorList softmax_backward(const Tensor& g, const Node& n) {
  Tensor y = n.saved(0);
  const Shape dims = y.dim() == 0 ? Shape{} : Shape{n.args().dim};
  if (n.args().op == 1) return {g - y.exp() * sum(g, dims, true)};  // log_softmax
  return {y * (g - sum(g * y, dims, true))};
}
}  // namespace

}  // namespace flame::rules

namespace flame::op_detail {
using backend::ReduceOp;

// The record members of the reduction family's op definitions (src/ops/reduce_def.h).
void ReduceDef::record(Result& r, const Args& a, const Prep&) {
  Tensor& out = r.out;
  const Tensor& x = a.x;
  const ReduceOp op = a.op;
  if (!is_floating(out.dtype()) || !needs_grad({x})) return;
  RuleArgs args;
  args.op = static_cast<int>(op);
  args.shape = a.plan->keep_shape;
  args.count = a.plan->count;
  Node& n = flame::record(out, rules::reduce_name(op), {x}, &rules::reduce_backward, std::move(args));
  if (op == ReduceOp::prod || op == ReduceOp::max || op == ReduceOp::min) {
    n.save(x);
    n.save(out, /*is_output=*/true);
  }
}

void CumsumDef::record(Result& r, const Args& a, const Prep& p) {
  if (!is_floating(r.out.dtype()) || !needs_grad({a.x})) return;
  RuleArgs args;
  args.dim = p.dim;
  flame::record(r.out, "CumsumBackward", {a.x}, &rules::cumsum_backward, std::move(args));
}

void SoftmaxDef::record(Result& r, const Args& a, const Prep& p) {
  if (r.out.numel() == 0) {  // nothing to normalise: the gradient passes through
    rules::copy(r.out, a.op, a.x);
    return;
  }
  if (!needs_grad({a.x})) return;
  RuleArgs args;
  args.dim = p.dim;
  const bool log = SoftmaxDef::log(a);
  args.op = log ? 1 : 0;
  Node& n = flame::record(r.out, log ? "LogSoftmaxBackward" : "SoftmaxBackward", {a.x}, &rules::softmax_backward,
                          std::move(args));
  n.save(r.out, /*is_output=*/true);
}

}  // namespace flame::op_detail
