// Gradient rule of the RMS QK-norm fused with the join and the rotary embedding: the record member
// of its op definition (src/ops/rms_norm_rotary_def.h; Note [RMS norm rotary] in
// src/ops/rms_norm_rotary.cpp). Saves the parts (the norm's inputs), the weights and the tables;
// the backward is one kernel over the output's gradient, writing each part's gradient.
#include "src/ops/rms_norm_rotary_def.h"

#include "flame/autograd.h"
#include "src/autograd/record.h"
#include "src/backend/fused/rms_norm_rotary.h"

namespace flame::rules {
namespace {

// args.count: the parts P; args.a: eps; args.dim: the layout; args.op: 1 when rotated.
// saved: the P parts, the P weights, cos, sin.
TensorList rms_norm_rotary_rule(const Tensor& grad, const Node& n) {
  const auto count = static_cast<std::size_t>(n.args().count);
  TensorList parts, weights;
  for (std::size_t i = 0; i < count; ++i) parts.push_back(n.saved(i));
  for (std::size_t i = 0; i < count; ++i) weights.push_back(n.saved(count + i));
  const Tensor cos = n.args().op ? n.saved(2 * count) : Tensor(), sin = n.args().op ? n.saved(2 * count + 1) : Tensor();
  // [B, H, S, D] -> [B, S, H, D]: attention's dq / dk for a heads-inner q or k is already that memory.
  Tensor g = grad.to(parts.front().dtype()).transpose(1, 2);
  if (g.stride(3) != 1) g = g.contiguous();
  TensorList dparts;
  for (const Tensor& x : parts) dparts.push_back(Tensor::empty(x.sizes(), {x.dtype(), x.device()}));
  if (g.numel() == 0) return dparts;
  bool ok = backend::fused::rms_norm_rotary_backward.try_run(g.device(), dparts, g, parts, weights, cos, sin,
                                                             static_cast<int>(n.args().dim), n.args().a);
  if (!ok && !g.is_contiguous()) {  // a layout the kernel does not take: the contiguous gradient
    g = g.contiguous();
    ok = backend::fused::rms_norm_rotary_backward.try_run(g.device(), dparts, g, parts, weights, cos, sin,
                                                          static_cast<int>(n.args().dim), n.args().a);
  }
  FLAME_CHECK(ok, "rms_norm_rotary", "the device ran the forward but declined its backward (gradient ", grad.sizes(),
              " ", dtype_name(grad.dtype()), ")");
  return dparts;
}

}  // namespace
}  // namespace flame::rules

namespace flame::op_detail {

void RmsNormRotaryDef::record(Result& r, const Args& a, const Prep& p) {
  if (!r.fused || !needs_grad(p.parts)) return;  // the composite recorded its own graph
  RuleArgs args;
  args.count = static_cast<int64_t>(p.parts.size());
  args.a = a.eps;
  args.dim = static_cast<int64_t>(a.layout);
  args.op = p.cos.defined() ? 1 : 0;
  Node& n = flame::record(r.out, "RmsNormRotaryBackward", p.parts, &rules::rms_norm_rotary_rule, std::move(args));
  for (const Tensor& x : p.parts) n.save(x);
  for (const Tensor& w : p.weights) n.save(w);
  if (p.cos.defined()) {
    n.save(p.cos);
    n.save(p.sin);
  }
}

}  // namespace flame::op_detail
