// Gradient rule of the fused rotary embedding: the record member of its op definition
// (src/ops/rotary_def.h). Saves only cos and sin (as the kernel read them, [S, D] contiguous in the
// compute dtype); the backward is the kernel's inverse pass over the output's gradient
// (src/backend/fused/rotary.h).
#include "src/ops/rotary_def.h"

#include "flame/autograd.h"
#include "src/autograd/record.h"
#include "src/backend/fused/rotary.h"
#include "src/core/tensor_impl.h"
#include "src/core/memory_format.h"

namespace flame::rules {
namespace {

// args.op: x's dtype; args.dim: the layout; saved: cos, sin.
TensorList rotary_rule(const Tensor& grad, const Node& n) {
  const Tensor cos = n.saved(0), sin = n.saved(1);
  const int64_t d = cos.size(1);
  const Tensor g0 = grad.to(static_cast<DType>(n.args().op));
  // A gradient in the heads-inner layout (attention's dq / dk for q and k in it) is rotated as it lies.
  const int64_t heads = layout_detail::heads_inner(g0) ? g0.size(1) : 1;
  const Tensor g = heads > 1 ? g0 : g0.contiguous();
  Tensor dx = layout_detail::empty_like_heads(g, "rotary_embedding_backward");
  if (g.numel() == 0) return {dx};
  const Shape rows = {g.numel() / d, d};
  const Tensor dx_rows = heads > 1 ? dx.transpose(1, 2).view(rows) : dx.view(rows);
  const Tensor g_rows = heads > 1 ? g.transpose(1, 2).view(rows) : g.view(rows);
  const bool ok = backend::fused::rotary_embedding.try_run(g.device(), dx_rows, g_rows, cos, sin,
                                                           static_cast<int>(n.args().dim), /*inverse=*/true, heads);
  FLAME_CHECK(ok, "rotary_embedding", "the device ran the forward but declined its backward (gradient ", g.sizes(),
              " ", dtype_name(g.dtype()), ")");
  return {dx};
}

}  // namespace

}  // namespace flame::rules

namespace flame::op_detail {

void RotaryDef::record(Result& r, const Args& a, const Prep& p) {
  if (!r.fused || !needs_grad({p.x})) return;  // the composite recorded its own graph
  RuleArgs args;
  args.op = static_cast<int>(p.x.dtype());
  args.dim = static_cast<int>(a.layout);
  Node& n = flame::record(r.out, "RotaryEmbeddingBackward", {p.x}, &rules::rotary_rule, std::move(args));
  n.save(p.cos);
  n.save(p.sin);
}

}  // namespace flame::op_detail
