// Gradient rules of views and copies: each maps the output gradient back to the input's geometry.
// Nothing is saved: the lambdas capture shapes and dims only. record() turns the op name into the
// grad_fn name ("narrow" -> "NarrowBackward").
#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/autograd/rules/rules.h"

namespace flame::rules {

Tensor& with_grad(Tensor& out, const char* name, const Tensor& in, std::function<Tensor(const Tensor&)> back) {
  if (!is_floating(out.dtype()) || !needs_grad({in})) return out;
  record(out, name, TensorList{in}, [back = std::move(back)](const Tensor& g) { return TensorList{back(g)}; });
  return out;
}

namespace {
// narrow's gradient: g in x's region [start, start + length) of dim d, zeros elsewhere. It takes
// x's pending gradient sum when there is one (Note [Accumulate base] in
// src/autograd/backward.cpp): the pieces of a chunk or split then add into one buffer (one region
// add each) instead of each making a zero tensor of x's shape that the engine adds up (a fill, a
// copy and an add over the whole of x per piece; a DiT block's six modulation chunks).
TensorList narrow_rule(const Tensor& g, const Node& n) {
  const RuleArgs& a = n.args();
  const int64_t d = a.dim, start = a.count, length = g.size(d);
  const Tensor& base = n.accumulate_base(0);
  if (base.defined()) {
    Tensor sum = n.accumulate_base_owned() ? base : base.clone();
    sum.narrow(d, start, length).add_(g);
    return {sum};
  }
  Tensor z = Tensor::zeros(a.shape, {g.dtype(), g.device()});
  z.narrow(d, start, length).copy_(g);
  return {z};
}
}  // namespace

void narrow(Tensor& v, const Tensor& x, int64_t d, int64_t start) {
  RuleArgs args;
  args.dim = d;
  args.count = start;
  args.shape = x.sizes();
  record(v, "NarrowBackward", {x}, narrow_rule, std::move(args)).accept_accumulate_base(0);
}

}  // namespace flame::rules
