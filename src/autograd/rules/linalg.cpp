// Gradient rule of matmul (torch.matmul semantics, which covers bmm): for C = A B,
// dA = dC B^T and dB = A^T dC, with 1-d operands unsqueezed and broadcast batch dims summed away.
// Saved: B only when A needs a gradient, A only when B does.
#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/autograd/rules/input_grad.h"
#include "src/ops/linalg_def.h"

namespace flame::rules {

namespace {
TensorList matmul_backward(const Tensor& g, const Node& n) {
  const bool need_a = n.args().need[0], need_b = n.args().need[1];
  const Shape& as = n.edges()[0].shape;
  const Shape& bs = n.edges()[1].shape;
  std::size_t slot = 0;
  Tensor sa = need_b ? n.saved(slot++) : Tensor();
  Tensor sb = need_a ? n.saved(slot++) : Tensor();
  const bool a_vec = as.size() == 1, b_vec = bs.size() == 1;
  Tensor g2 = g;
  if (a_vec && b_vec) g2 = g.reshape({1, 1});
  else if (a_vec) g2 = g.unsqueeze(-2);
  else if (b_vec) g2 = g.unsqueeze(-1);
  Tensor ga, gb;
  if (need_a && !a_vec && bs.size() == 2) {
    // A [..., M, K] @ B [K, N]: one GEMM over the rows, with A's other gradient contributions added
    // in its epilogue (Note [Accumulated input gradients]).
    int64_t rows = 1;
    for (std::size_t i = 0; i + 1 < as.size(); ++i) rows *= as[i];
    ga = accumulated_input_grad(n, 0, g2.reshape({rows, bs[1]}), sb.transpose(0, 1), as);
  } else if (need_a) {
    Tensor b2 = b_vec ? sb.unsqueeze(-1) : sb;
    Shape a2s = as;
    if (a_vec) a2s.insert(a2s.begin(), 1);
    ga = sum_to(matmul(g2, b2.transpose(-1, -2)), a2s).reshape(as);
  }
  if (need_b) {
    Tensor a2 = a_vec ? sa.unsqueeze(0) : sa;
    Shape b2s = bs;
    if (b_vec) b2s.push_back(1);
    gb = sum_to(matmul(a2.transpose(-1, -2), g2), b2s).reshape(bs);
  }
  return {ga, gb};
}
}  // namespace

}  // namespace flame::rules

namespace flame::op_detail {

// The record member of matmul's op definition (src/ops/linalg_def.h).
void MatmulDef::record(Result& r, const Args& x, const Prep&) {
  Tensor& out = r.out;
  const Tensor &a = x.a, &b = x.b;
  if (!is_floating(out.dtype()) || !needs_grad({a, b})) return;
  RuleArgs args;
  args.need[0] = a.requires_grad();
  args.need[1] = b.requires_grad();
  const char* name = a.dim() == 2 && b.dim() == 2 ? "MmBackward" : a.dim() == 3 && b.dim() == 3 ? "BmmBackward" : "MatmulBackward";
  Node& n = flame::record(out, name, {a, b}, &rules::matmul_backward, args);
  if (args.need[1]) n.save(a);
  if (args.need[0]) n.save(b);
  if (args.need[0] && a.dim() >= 2 && b.dim() == 2) n.accept_accumulate_base(0);  // Note [Accumulated input gradients]
}

}  // namespace flame::op_detail
