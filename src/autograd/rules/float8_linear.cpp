// Gradient rule of the 8-bit float Linear: the record member of its op definition
// (src/ops/float8_linear_def.h; Note [Float8 Linear] in flame/nn/float8.h). The node saves the
// 8-bit weight and its f32 scales (the layer's own tensors) and no activation: the weight is
// frozen, so x is never needed.
//   dx = dy W: dequantize: dy against the weight rebuilt in dy's dtype; fp8: dy * s cast per row
//        to grad_dtype, one FP8 GEMM against q transposed (Note [FP8 GEMM layout]).
//   dbias = the sum of dy over the rows.
#include "src/ops/float8_linear_def.h"

#include "flame/autograd.h"
#include "flame/ops.h"
#include "src/autograd/record.h"

namespace flame::rules {
namespace {

// args.op: x's dtype; args.a: 1 for fp8 compute; args.dim: the gradient's 8-bit dtype; args.count:
// rows; saved: q, scale (f32 [out]).
TensorList float8_linear_rule(const Tensor& grad, const Node& n) {
  const auto& e = n.edges();
  const DType dt = static_cast<DType>(n.args().op);
  const Tensor q = n.saved(0), scale = n.saved(1);
  const int64_t rows = n.args().count, out = q.size(0), in = q.size(1);
  const Tensor g2 = grad.to(dt).reshape({rows, out}).contiguous();
  Tensor dx, db;
  if (e[0].meta) {
    Tensor dx2;
    if (n.args().a != 0) {
      const auto [gq, gs] = float8_quantize_rows(g2, static_cast<DType>(n.args().dim), scale);
      const Tensor qt = q.t().contiguous();  // [in, out]: K contiguous for the GEMM
      dx2 = op_detail::float8_matmul(gq, gs, qt, Tensor::ones({in}, TensorOptions(DType::f32, q.device())), Tensor(),
                                     dt);
    } else {
      dx2 = g2.matmul(op_detail::float8_dense(q, scale, dt));
    }
    dx = dx2.reshape(e[0].shape.vec());
  }
  if (e.size() > 1 && e[1].meta) db = g2.to(DType::f32).sum({0}).to(e[1].dtype);
  return {dx, db};
}

}  // namespace
}  // namespace flame::rules

namespace flame::op_detail {

void Float8LinearDef::record(Result& r, const Args& a, const Prep& p) {
  if (!needs_grad({a.x, a.bias})) return;
  RuleArgs args;
  args.op = static_cast<int>(a.x.dtype());
  args.a = a.compute == nn::Float8Compute::fp8 ? 1.0 : 0.0;
  args.dim = static_cast<int64_t>(a.grad_dtype);
  args.count = p.x2.size(0);
  Node& n = flame::record(r.out, "LinearFloat8Backward", {a.x, a.bias}, &rules::float8_linear_rule, std::move(args));
  n.save(a.q);
  n.save(p.scale);
}

}  // namespace flame::op_detail
