// Gradient rules of the fused adaLN ops (declared in src/ops/grad_hooks.h): each node's backward
// is one fused kernel call (src/backend/fused/adaln.h).
#include "flame/autograd.h"
#include "src/autograd/record.h"
#include "src/ops/grad_hooks.h"
#include "src/backend/fused/adaln.h"
#include "src/core/tensor_impl.h"

namespace flame::rules {
namespace {

TensorList gated_residual_rule(const Tensor& grad, const Node& n);

// Note [Fused residual backward]
// In gated_residual_modulate's graph the residual h = x + gate * branch feeds this block's adaLN
// (y's node) and the next residual (a pass-through of its gradient). The adaLN node runs last of
// the two (the next block's nodes were recorded later), and its kernel already writes h's complete
// gradient dh = pending + its own (Note [Accumulate base]). When that is the last contribution
// h's vertex awaits (Node::completes_input), the same kernel also computes what h's node, the
// gated residual, needs: dbranch = gate * dh and dgate = sum over T of dh * branch, and hands
// them over (Note [Prepared gradients] in src/autograd/backward.cpp). That saves the gated
// residual's own pass over dh and branch (on an H100, dit-s: 62 us per call). The prepared
// gradients are used only if h's gradient is still the tensor the kernel wrote; a hook that
// replaces or edits it makes the gated residual compute as before, from the edited gradient.
// The kernel also sums dbranch's columns (in f32, before dbranch is rounded) and attaches them to
// dbranch (Note [Gradient row sums] in src/autograd/node.cpp): the Linear that made the branch
// (the attention's proj, the MLP's fc2) takes its bias gradient from them instead of summing
// dbranch again (on an H100, dit-s: two column sums of [50176, 384] per block, ~20 us each).

// Saved: x as [B, T, D] and mean, or (args.need[0]) x-hat in the result dtype; then rstd, scale.
// args.op: the result dtype, args.shape: x's shape, args.need[1]: x is the h of a
// gated_residual_modulate, whose gated residual node may take prepared gradients.
TensorList adaln_rule(const Tensor& grad, const Node& n) {
  const auto& e = n.edges();
  const bool hat = n.args().need[0];
  const Tensor x3 = n.saved(0);
  const Tensor mean = hat ? Tensor() : n.saved(1);
  const Tensor rstd = n.saved(hat ? 1 : 2), scale = n.saved(hat ? 2 : 3);
  const DType xdt = hat ? DType::f32 : x3.dtype();  // x-hat is saved only for an f32 x
  const Device dev = x3.device();
  const Shape& xs = n.args().shape;
  Tensor dshift = e[1].meta ? make_empty({scale.size(0), scale.size(1)}, scale.dtype(), dev) : Tensor();
  Tensor dscale = e[2].meta ? make_empty({scale.size(0), scale.size(1)}, scale.dtype(), dev) : Tensor();
  const Tensor dy = grad.to(static_cast<DType>(n.args().op)).contiguous().view(x3.sizes());
  // Note [Fused residual backward]: h's node, when it wants gate or branch gradients from the
  // complete dh this backward writes.
  Node* partner = nullptr;
  if (n.args().need[1] && e[0].meta && n.completes_input(0)) {
    Node* p = e[0].meta->grad_fn.get();
    // The partner saved its branch (its gate wants a gradient, Note [Gated residual saves]).
    if (p && p->rule() == gated_residual_rule && !p->released() && p->args().need[0] &&
        (p->edges()[1].meta || p->edges()[2].meta))
      partner = p;
  }
  backend::fused::AdalnBackwardMore more;
  Tensor dbranch;
  if (partner) {
    const Tensor gate = partner->saved(0), br = partner->saved(1);
    more.gate = gate;
    more.branch = br;
    more.dgate = make_empty({gate.size(0), gate.size(1)}, gate.dtype(), dev);
    if (partner->edges()[2].meta) {
      dbranch = make_empty(partner->args().shape, br.dtype(), dev);
      more.dbranch = dbranch.view(br.sizes());
      // Note [Gradient row sums]: dbranch's column sums, the bias gradient of the Linear that
      // made the branch, from the same kernel.
      more.dbias = make_empty({br.size(-1)}, DType::f32, dev);
    }
  }
  auto drop_partner = [&] {
    more.gate = more.branch = more.dbranch = more.dgate = more.dbias = Tensor();
    partner = nullptr;
  };
  // Runs the kernel into dx (undefined: x wants no gradient) with `more`; when the backend declines
  // the fused residual part, again without it.
  auto run = [&](const Tensor& dx) {
    const Tensor d3 = dx.defined() ? dx.view(x3.sizes()) : dx;
    if (backend::fused::adaln_backward.try_run(dev, d3, dshift, dscale, dy, x3, mean, rstd, scale, more)) return true;
    if (!partner) return false;
    drop_partner();
    return backend::fused::adaln_backward.try_run(dev, d3, dshift, dscale, dy, x3, mean, rstd, scale, more);
  };
  // Hands the gated residual's gradients to its node, for the dh returned.
  auto hand_over = [&](const Tensor& dx) {
    if (!partner) return;
    partner->prepare({partner->edges()[1].meta ? more.dgate : Tensor(), dbranch}, dx);
    if (dbranch.defined() && more.dbias.defined()) autograd_detail::attach_row_sums(dbranch, more.dbias);
  };
  // Note [Accumulate base]: x's pending gradient sum, read by the kernel's final write of dx.
  const Tensor& base = n.accumulate_base(0);
  if (e[0].meta && base.defined() && base.is_contiguous() && base.dtype() == xdt) {
    // Written in place when this backward owns the sum, into a fresh buffer otherwise.
    const Tensor dx = n.accumulate_base_owned() ? base : make_empty(xs, xdt, dev);
    more.base = base.view(x3.sizes());
    if (run(dx)) {
      hand_over(dx);
      return {dx, dshift, dscale};
    }
    more.base = Tensor();
  }
  if (base.defined()) drop_partner();  // the sum is composed below: the kernel's dx is not dh
  Tensor dx = e[0].meta ? make_empty(xs, xdt, dev) : Tensor();
  const bool ok = run(dx);
  if (ok) hand_over(dx);
  FLAME_CHECK(ok, "layer_norm_modulate", "the backend ran the forward but declined its backward (x ", xs, " ",
              dtype_name(xdt), ", scale ", dtype_name(scale.dtype()), ")");
  if (dx.defined() && base.defined()) dx = base + dx;  // the kernel declined the base: the same sum
  return {dx, dshift, dscale};
}

// Note [Gated residual saves]
// out = x + gate * y: dgate needs y, dy needs gate. The node saves gate (a [B, D] row) always and
// y (as big as x) only when gate wants a gradient: in LoRA training the adaLN projections that
// make the gates are frozen, and the branches (the attention's and the MLP's outputs) are then not
// kept for the backward at all (FLUX-dev: about 2 GiB of a step's saved tensors). Without y, dy is
// dout * gate as ordinary ops (one pass, as the kernel's).
// Saved: gate, then (args.need[0]) y as [B, T, D]; args.op: the result dtype (x's); args.shape:
// x's shape.
TensorList gated_residual_rule(const Tensor& grad, const Node& n) {
  const auto& e = n.edges();
  // Note [Fused residual backward]: computed by the adaLN backward that read this h.
  TensorList prepared = n.take_prepared(grad);
  if (!prepared.empty()) return {e[0].meta ? grad : Tensor(), std::move(prepared[0]), std::move(prepared[1])};
  const Tensor gate = n.saved(0);
  const Shape& xs = n.args().shape;
  const Tensor dout = grad.to(static_cast<DType>(n.args().op)).contiguous();
  if (!n.args().need[0]) {  // gate wants no gradient: y was not saved
    if (!e[2].meta) return {e[0].meta ? dout : Tensor(), Tensor(), Tensor()};
    Shape per(xs.size(), 1);
    per.front() = gate.size(0);
    per.back() = gate.size(1);
    Tensor dy = dout * gate.reshape(per);
    if (dy.dtype() != e[2].dtype) dy = dy.to(e[2].dtype);
    return {e[0].meta ? dout : Tensor(), Tensor(), dy};
  }
  const Tensor y3 = n.saved(1);
  Tensor dy = e[2].meta ? make_empty(xs, y3.dtype(), y3.device()) : Tensor();
  Tensor dgate;
  if (e[1].meta || e[2].meta) {
    dgate = make_empty({gate.size(0), gate.size(1)}, gate.dtype(), gate.device());
    const bool ok = backend::fused::gated_residual_backward.try_run(
        y3.device(), dy.defined() ? dy.view(y3.sizes()) : dy, dgate, dout.view(y3.sizes()), y3, gate);
    FLAME_CHECK(ok, "gated_residual", "the backend ran the forward but declined its backward (y ", xs, " ",
                dtype_name(y3.dtype()), ", gate ", dtype_name(gate.dtype()), ")");
  }
  return {e[0].meta ? dout : Tensor(), e[1].meta ? dgate : Tensor(), dy};
}

}  // namespace

void layer_norm_modulate(Tensor& y, const Tensor& x, const Tensor& shift, const Tensor& scale, const Tensor& x3,
                         const Tensor& mean, const Tensor& rstd, const Tensor& xhat, DType out, bool residual) {
  if (!needs_grad({x, shift, scale})) return;
  RuleArgs args;
  args.op = static_cast<int>(out);
  args.shape = x.sizes();
  args.need[0] = xhat.defined();
  args.need[1] = residual;
  Node& n = record(y, "LayerNormModulateBackward", {x, shift, scale}, adaln_rule, std::move(args));
  n.accept_accumulate_base(0);
  if (xhat.defined()) {
    n.save(xhat);
  } else {
    n.save(x3);
    n.save(mean);
  }
  n.save(rstd);
  n.save(scale);
}

void gated_residual(Tensor& o, const Tensor& x, const Tensor& gate, const Tensor& y, const Tensor& y3, DType out) {
  if (!needs_grad({x, gate, y})) return;
  RuleArgs args;
  args.op = static_cast<int>(out);
  args.shape = x.sizes();
  args.need[0] = needs_grad({gate});  // Note [Gated residual saves]
  const bool save_y = args.need[0];
  Node& n = record(o, "GatedResidualBackward", {x, gate, y}, gated_residual_rule, std::move(args));
  n.save(gate);
  if (save_y) n.save(y3);
}

}  // namespace flame::rules
