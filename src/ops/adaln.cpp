// The fused adaLN ops of flame/nn/adaln.h: layer_norm_modulate and gated_residual.
//
// Note [adaLN ops]
// A DiT block modulates its normalised input per sample, y = LN(x) * (1 + scale) + shift, and adds
// each branch back through a per-sample gate, x + gate * branch (shift, scale, gate: [B, D] chunks
// of one projection of the conditioning). As ordinary ops that is a norm, a broadcast multiply, a
// broadcast add and (under autocast) a cast forward; backward the same in reverse plus a column
// reduction over the tokens for each modulation tensor, every one a pass over [B, T, D].
//  - Who decides: the fused kernels (src/backend/fused/adaln.h, Note [Fused kernels]) answer
//    false, writing nothing, when the device has no kernel for the call; the op then runs the
//    composite below. Their gradient rules are in src/autograd/rules/adaln.cpp.
//    The CPU backend always declines, so the composite is the reference the CUDA kernels are tested
//    against and f64 gradchecks run through it.
//  - Fused, each op is one node: layer_norm_modulate saves x, its per-row mean/rstd and scale (not
//    the output); gated_residual saves gate, and y only when the gate wants a gradient (Note [Gated
//    residual saves] in src/autograd/rules/adaln.cpp). Their backward is one kernel each that also
//    sums the modulation gradients over the tokens (Note [adaLN kernels] in
//    src/backend/cuda/adaln/adaln.cu).
//  - autograd::RecomputeCheap: layer_norm_modulate marks its output recomputable (below).
//  - x's gradient takes the engine's pending sum (Note [Accumulate base] in
//    src/autograd/backward.cpp): in a DiT block x also feeds the gated residual, whose
//    pass-through gradient arrives first; the backward kernel writes that sum + dx in one pass
//    instead of dx and a separate add. A base the kernel declines is added here (the same sum).
//  - Autocast: layer_norm_modulate normalises in f32 (as layer_norm) and returns the autocast dtype,
//    fused or composed, so both paths give the same dtype; gated_residual has no policy (the
//    promotion of its inputs, as the composite's add and multiply). An x already in the autocast
//    dtype (a bf16 residual stream, as FLUX's and SD3's) goes to the kernel as it is: the kernel
//    normalises in f32 whatever it reads, so the f32 copy the composite normalises would only add
//    a pass and a buffer of twice x's bytes; the composite still makes that copy (f32_composite).
#include "flame/nn/adaln.h"

#include <cmath>

#include "flame/grad_mode.h"
#include "flame/nn/norm.h"
#include "flame/ops.h"
#include "src/ops/autocast_hooks.h"
#include "src/ops/recompute_hooks.h"
#include "src/backend/backend.h"
#include "src/backend/fused/adaln.h"
#include "src/ops/trace_hooks.h"
#include "src/core/tensor_impl.h"
#include "src/core/grad_state.h"
#include "src/ops/grad_hooks.h"

namespace flame::nn::functional {
namespace {

// [B, D] -> [B, 1, ..., 1, D] broadcasting against x [B, ..., D].
Tensor per_sample(const Tensor& m, const Tensor& x) {
  Shape s(static_cast<std::size_t>(x.dim()), 1);
  s.front() = m.size(0);
  s.back() = m.size(1);
  return m.reshape(s);
}

void check_modulation(const char* op, const char* what, const Tensor& m, const Tensor& x) {
  FLAME_CHECK(m.defined(), op, what, " is undefined");
  FLAME_CHECK(is_floating(m.dtype()), op, what, " must be floating, got ", dtype_name(m.dtype()));
  FLAME_CHECK(m.dim() == 2 && m.size(0) == x.size(0) && m.size(1) == x.size(-1), op, what, " must have shape [",
              x.size(0), ", ", x.size(-1), "] (batch, features of the input shape ", x.sizes(), "), got ",
              m.sizes());
  FLAME_CHECK(m.device() == x.device(), op, what, " is on ", m.device().str(), " but the input is on ",
              x.device().str());
}

void check_rows_input(const char* op, const Tensor& x) {
  FLAME_CHECK(x.defined(), op, "got an undefined input");
  FLAME_CHECK(is_floating(x.dtype()), op, "expected a floating input, got ", dtype_name(x.dtype()), " (shape ",
              x.sizes(), ")");
  FLAME_CHECK(x.dim() >= 2, op, "expected an input of at least 2 dims [B, ..., D], got shape ", x.sizes());
}

// [B, T, D] of an input [B, ..., D].
Shape btd(const Tensor& x) {
  const int64_t b = x.size(0), d = x.size(-1);
  return {b, (b == 0 || d == 0) ? 0 : x.numel() / (b * d), d};
}

// Note [Saved x-hat]: where the result dtype is narrower than x's (an f32 residual stream under
// bf16 autocast), the fused forward also writes x-hat = (x - mean) * rstd in the result dtype and
// the node saves that instead of x and mean: half the bytes, and x itself (the residual stream)
// is no longer held by the graph. The backward then reads x-hat rounded to the result dtype
// (relative error 2^-9 in bf16, the precision of the linear layer's saved input y beside it)
// where it would recompute it in f32. Allocated only when a gradient is wanted (`wanted`: the
// node will be recorded). Under RecomputeCheap the output's recipe redoes it from x-hat, shift and
// scale (one elementwise pass), not from x, which it would otherwise keep alive: the one recipe
// that is not the forward bit for bit (Note [Recompute cheap]): its values come from x-hat
// rounded to the result dtype, within one rounding of the forward's.
Tensor xhat_buffer(bool wanted, const Tensor& x, const Shape& s3, DType out) {
  if (!wanted || dtype_size(out) >= dtype_size(x.dtype()) || !is_floating(out)) return Tensor();
  return make_empty(s3, out, x.device(), "layer_norm_modulate");
}

void check_gated_residual(const char* op, const Tensor& x, const Tensor& gate, const Tensor& y) {
  check_rows_input(op, x);
  check_modulation(op, "gate", gate, x);
  FLAME_CHECK(y.defined() && y.sizes() == x.sizes(), op, "y must have the input's shape ", x.sizes(), ", got ",
              y.defined() ? y.sizes() : Shape{});
  FLAME_CHECK(is_floating(y.dtype()) && y.device() == x.device(), op, "y must be floating and on ", x.device().str(),
              ", got ", dtype_name(y.dtype()), " on ", y.device().str());
}

void check_modulate(const char* op, const Tensor& x, const Tensor& shift, const Tensor& scale, double eps) {
  check_modulation(op, "shift", shift, x);
  check_modulation(op, "scale", scale, x);
  FLAME_CHECK(eps >= 0 && std::isfinite(eps), op, "eps must be finite and non-negative, got ", eps);
}

// xhat_out: receives the x-hat the node saved (Note [Saved x-hat]), when it saved one.
// f32_composite: the composite normalises x cast to f32 (autocast with a half x, Note [adaLN ops]).
Tensor layer_norm_modulate_impl(const Tensor& x, const Tensor& shift, const Tensor& scale, double eps, DType out,
                                bool f32_composite, Tensor* xhat_out = nullptr) {
  const int64_t d = x.size(-1);
  if (x.numel() > 0 && !x.device().is_cpu()) {
    Tensor y, x3, mean, rstd;
    bool fused = false;
    {
      NoGradGuard no_grad;
      x3 = x.contiguous().view(btd(x));
      const int64_t rows = x3.size(0) * x3.size(1);
      y = make_empty(x.sizes(), out, x.device(), "layer_norm_modulate");
      mean = make_empty({rows}, DType::f32, x.device(), "layer_norm_modulate");
      rstd = make_empty({rows}, DType::f32, x.device(), "layer_norm_modulate");
    }
    const Tensor xhat = xhat_buffer(needs_grad({x, shift, scale}), x, x3.sizes(), out);
    {
      NoGradGuard no_grad;
      fused = backend::fused::adaln_forward.try_run(x.device(), y.view(x3.sizes()), mean, rstd, x3, shift, scale, eps,
                                                    xhat);
    }
    if (fused) {
      rules::layer_norm_modulate(y, x, shift, scale, x3, mean, rstd, xhat, out);
      if (xhat_out) *xhat_out = xhat;
      return y;
    }
  }
  const Tensor xn = f32_composite ? amp::detail::cast_f32(x) : x;
  Tensor y = layer_norm(xn, {d}, {}, {}, eps) * (per_sample(scale, xn) + 1.0) + per_sample(shift, xn);
  return y.dtype() == out ? y : y.to(out);
}

// xhat: what the node saved instead of x (Note [Saved x-hat]), undefined when it saved x.
void mark_adaln_output(Tensor& y, const Tensor& x, const Tensor& shift, const Tensor& scale, double eps, DType out,
                       bool f32_composite, const Tensor& xhat) {
  if (!autograd_detail::should_mark_recomputable()) return;
  if (xhat.defined()) {
    const Shape ys = y.sizes();
    autograd_detail::mark_recomputable(y, "layer_norm_modulate", {xhat, shift, scale}, [ys, out](const TensorList& in) {
      const Tensor xh = in[0].to(DType::f32);
      const Tensor r = xh * (per_sample(in[2], xh).to(DType::f32) + 1.0) + per_sample(in[1], xh).to(DType::f32);
      return r.to(out).view(ys);
    });
    return;
  }
  autograd_detail::mark_recomputable(y, "layer_norm_modulate", {x, shift, scale},
                                     [eps, out, f32_composite](const TensorList& in) {
                                       return layer_norm_modulate_impl(in[0], in[1], in[2], eps, out, f32_composite);
                                     });
}

// Under autograd::RecomputeCheap the output carries a recipe (Note [Recompute cheap] in
// src/autograd/recompute.cpp): the same impl on the same inputs, so a linear layer that saves it
// for its weight gradient holds the recipe, whose inputs this op's node saves anyway.
// The op is marked as one: the ops of its composite path do not mark their own outputs.
Tensor layer_norm_modulate_marked(const Tensor& x, const Tensor& shift, const Tensor& scale, double eps, DType out,
                                  bool f32_composite = false) {
  Tensor y, xhat;
  {
    autograd_detail::MarkingOff whole_op;
    y = layer_norm_modulate_impl(x, shift, scale, eps, out, f32_composite, &xhat);
  }
  mark_adaln_output(y, x, shift, scale, eps, out, f32_composite, xhat);
  return y;
}

}  // namespace

Tensor layer_norm_modulate(const Tensor& x, const Tensor& shift, const Tensor& scale, double eps) {
  if (auto* tr = compile_detail::active_tracer()) {  // replayed eagerly by flame::compile
    return compile_detail::trace_eager_op(*tr, "layer_norm_modulate", {x, shift, scale}, [eps](const TensorList& in) {
      return layer_norm_modulate(in[0], in[1], in[2], eps);
    });
  }
  const char* op = "layer_norm_modulate";
  check_rows_input(op, x);
  check_modulate(op, x, shift, scale, eps);
  if (amp::detail::should_autocast(x)) {  // Note [adaLN ops]: f32 statistics, the autocast dtype out
    const DType low = amp::detail::low_dtype(x);
    amp::detail::AutocastOpScope scope;
    if (x.dtype() == low) return layer_norm_modulate_marked(x, shift, scale, eps, low, /*f32_composite=*/true);
    return layer_norm_modulate_marked(amp::detail::cast_f32(x), shift, scale, eps, low);
  }
  return layer_norm_modulate_marked(x, shift, scale, eps,
                                    promote_types(promote_types(x.dtype(), shift.dtype()), scale.dtype()));
}

Tensor gated_residual(const Tensor& x, const Tensor& gate, const Tensor& y) {
  if (auto* tr = compile_detail::active_tracer()) {
    return compile_detail::trace_eager_op(*tr, "gated_residual", {x, gate, y},
                                          [](const TensorList& in) { return gated_residual(in[0], in[1], in[2]); });
  }
  const char* op = "gated_residual";
  check_gated_residual(op, x, gate, y);
  const DType out = promote_types(promote_types(x.dtype(), gate.dtype()), y.dtype());
  if (x.numel() > 0 && !x.device().is_cpu() && out == x.dtype()) {
    Tensor o, y3;
    bool fused = false;
    {
      NoGradGuard no_grad;
      const Shape s3 = btd(x);
      y3 = y.contiguous().view(s3);
      o = make_empty(x.sizes(), out, x.device(), op);
      fused = backend::fused::gated_residual_forward.try_run(x.device(), o.view(s3), x.contiguous().view(s3), gate, y3);
    }
    if (fused) {
      rules::gated_residual(o, x, gate, y, y3, out);
      return o;
    }
  }
  return x + per_sample(gate, x) * y;
}

std::pair<Tensor, Tensor> gated_residual_modulate(const Tensor& x, const Tensor& gate, const Tensor& branch,
                                                  const Tensor& shift, const Tensor& scale, double eps) {
  auto composed = [&] {
    Tensor h = gated_residual(x, gate, branch);
    Tensor y = layer_norm_modulate(h, shift, scale, eps);
    return std::pair<Tensor, Tensor>{std::move(h), std::move(y)};
  };
  if (compile_detail::active_tracer()) return composed();  // traced as its two ops
  const char* op = "gated_residual_modulate";
  check_gated_residual(op, x, gate, branch);
  check_modulate(op, x, shift, scale, eps);
  const DType hdt = promote_types(promote_types(x.dtype(), gate.dtype()), branch.dtype());
  const bool autocast = amp::detail::should_autocast(x);
  // The fused kernel covers h in x's dtype and, under autocast, an f32 h or one in the autocast
  // dtype (layer_norm_modulate normalises either in f32): otherwise the two ops run one after the
  // other.
  if (x.numel() == 0 || x.device().is_cpu() || hdt != x.dtype() ||
      (autocast && x.dtype() != DType::f32 && x.dtype() != amp::detail::low_dtype(x)))
    return composed();
  const DType out = autocast ? amp::detail::low_dtype(x)
                             : promote_types(promote_types(x.dtype(), shift.dtype()), scale.dtype());
  Tensor h, y, b3, h3, mean, rstd;
  bool fused = false;
  const Shape s3 = btd(x);
  const Tensor xhat = xhat_buffer(needs_grad({x, gate, branch, shift, scale}), x, s3, out);  // Note [Saved x-hat]
  {
    NoGradGuard no_grad;
    b3 = branch.contiguous().view(s3);
    h = make_empty(x.sizes(), hdt, x.device(), op);
    h3 = h.view(s3);
    y = make_empty(x.sizes(), out, x.device(), op);
    mean = make_empty({s3[0] * s3[1]}, DType::f32, x.device(), op);
    rstd = make_empty({s3[0] * s3[1]}, DType::f32, x.device(), op);
    fused = backend::fused::adaln_residual_forward.try_run(x.device(), h3, y.view(s3), mean, rstd,
                                                           x.contiguous().view(s3), gate, b3, shift, scale, eps, xhat);
  }
  if (!fused) return composed();
  // The graph of the two ops: h's node, then y's reading h.
  rules::gated_residual(h, x, gate, branch, b3, hdt);
  rules::layer_norm_modulate(y, h, shift, scale, h3, mean, rstd, xhat, out, /*residual=*/true);
  mark_adaln_output(y, h, shift, scale, eps, out, /*f32_composite=*/autocast && h.dtype() != DType::f32, xhat);
  return {h, y};
}

}  // namespace flame::nn::functional
