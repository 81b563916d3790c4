// Gradient rule of matmul (torch.matmul semantics, which covers bmm): for C = A B,
// dA = dC B^T and dB = A^T dC, with 1-d operands unsqueezed and broadcast batch dims summed away.
#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/autograd/rules/rules.h"

namespace flame::rules {

void matmul(Tensor& out, const Tensor& a, const Tensor& b) {
  if (!is_floating(out.dtype()) || !needs_grad({a, b})) return;
  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  SavedTensor sa(need_b ? a : Tensor(), "matmul"), sb(need_a ? b : Tensor(), "matmul");
  const Shape as = a.sizes(), bs = b.sizes();
  record(out, "matmul", {a, b}, [=](const Tensor& g) {
    const bool a_vec = as.size() == 1, b_vec = bs.size() == 1;
    Tensor g2 = g;
    if (a_vec && b_vec) g2 = g.reshape({1, 1});
    else if (a_vec) g2 = g.unsqueeze(-2);
    else if (b_vec) g2 = g.unsqueeze(-1);
    Tensor ga, gb;
    if (need_a) {
      Tensor b2 = b_vec ? sb.get().unsqueeze(-1) : sb.get();
      Shape a2s = as;
      if (a_vec) a2s.insert(a2s.begin(), 1);
      ga = sum_to(matmul(g2, b2.transpose(-1, -2)), a2s).reshape(as);
    }
    if (need_b) {
      Tensor a2 = a_vec ? sa.get().unsqueeze(0) : sa.get();
      Shape b2s = bs;
      if (b_vec) b2s.push_back(1);
      gb = sum_to(matmul(a2.transpose(-1, -2), g2), b2s).reshape(bs);
    }
    return TensorList{ga, gb};
  });
}

}  // namespace flame::rules
