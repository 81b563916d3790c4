// Rotary position embedding (flame/nn/rotary.h).
//
// Note [Rotary embedding]
// q and k of a DiT with RoPE (FLUX: [B, 24, 4608, 128] each, every block) get
// out = x * cos + rotate(x) * sin, rotate mapping each pair (a, b) to (-b, a). As ordinary ops that
// is a cast to f32, a stack of the rotated pairs, two products, a sum and a cast back: six passes
// over x forward, and a backward that saves x in f32 and the rotated copy. Here it is one fused
// kernel (src/backend/fused/rotary.h: both backends have it) that reads x once and writes the
// result once, and a node that saves only cos and sin ([S, D], shared by every head and batch
// element); the backward is the kernel's inverse pass over the gradient. Where cos or sin need a
// gradient (a learned table), the composite runs instead, so autograd differentiates it as written.
// The composite is also the reference the tests hold the kernels to. q and k that arrive as the
// [B, H, S, D] view of a projection's [B, S, H, D] (heads_inner) are rotated in place of that memory
// and come out in the same layout, which attention takes without a copy; the backward does the
// same for a gradient in that layout.
#include "flame/nn/rotary.h"

#include "flame/grad_mode.h"
#include "flame/ops.h"
#include "src/backend/fused/rotary.h"
#include "src/core/memory_format.h"
#include "src/core/tensor_impl.h"
#include "src/ops/rotary_def.h"

namespace flame::op_detail {
namespace {
using nn::functional::RotaryLayout;

constexpr const char* kOp = "rotary_embedding";

// The same math as ordinary ops (Note [Rotary embedding]).
Tensor composite(const Tensor& x, const Tensor& cos, const Tensor& sin, RotaryLayout layout, DType c) {
  const int64_t d = x.size(-1);
  const Tensor xf = x.to(c);
  Tensor rotated;
  if (layout == RotaryLayout::interleaved) {
    const Tensor pairs = xf.unflatten(-1, {d / 2, 2});
    rotated = stack({neg(pairs.select(-1, 1)), pairs.select(-1, 0)}, -1).flatten(-2);
  } else {
    rotated = cat({neg(xf.narrow(-1, d / 2, d / 2)), xf.narrow(-1, 0, d / 2)}, -1);
  }
  return (xf * cos.to(c) + rotated * sin.to(c)).to(x.dtype());
}

void validate(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  FLAME_CHECK(x.defined() && cos.defined() && sin.defined(), kOp, "x, cos and sin must be defined");
  FLAME_CHECK(is_floating(x.dtype()), kOp, "x must be floating, got ", dtype_name(x.dtype()), " (shape ", x.sizes(),
              ")");
  FLAME_CHECK(x.dim() >= 2, kOp, "x must be [..., S, D], got shape ", x.sizes());
  const int64_t s = x.size(-2), d = x.size(-1);
  FLAME_CHECK(d % 2 == 0, kOp, "the last dim of x must be even (pairs rotate together), got shape ", x.sizes());
  for (const Tensor* t : {&cos, &sin}) {
    const char* what = t == &cos ? "cos" : "sin";
    FLAME_CHECK(is_floating(t->dtype()), kOp, what, " must be floating, got ", dtype_name(t->dtype()));
    FLAME_CHECK(t->device() == x.device(), kOp, what, " is on ", t->device().str(), " but x is on ",
                x.device().str());
    bool ok = t->dim() >= 2 && t->size(-2) == s && t->size(-1) == d;
    for (int64_t i = 0; ok && i + 2 < t->dim(); ++i) ok = t->size(i) == 1;
    FLAME_CHECK(ok, kOp, what, " must be [S, D] = [", s, ", ", d, "] (leading dims of size 1 allowed) for x of shape ",
                x.sizes(), ", got ", t->sizes());
  }
}

}  // namespace

RotaryDef::Prep RotaryDef::prepare(const Args& a) {
  const Tensor &x = a.x, &cos = a.cos, &sin = a.sin;
  validate(x, cos, sin);
  Prep p;
  p.compute = x.dtype() == DType::f64 ? DType::f64 : DType::f32;
  p.composite = grad_enabled() && (cos.requires_grad() || sin.requires_grad());
  if (p.composite) return p;
  const int64_t s = x.size(-2), d = x.size(-1);
  p.cos = cos.detach().to(p.compute).reshape({s, d}).contiguous();
  p.sin = sin.detach().to(p.compute).reshape({s, d}).contiguous();
  // q or k split from one projection: [B, H, S, D] over [B, S, H, D] memory. The kernel runs on that
  // memory and the output keeps the layout (attention takes it as it is), so nothing is copied.
  p.heads = layout_detail::heads_inner(x) ? x.size(1) : 1;
  p.x = p.heads > 1 ? x : x.contiguous();
  return p;
}

RotaryDef::Result RotaryDef::run(const Args& a, Prep& p) {
  Result r;
  if (p.composite) {
    r.out = composite(a.x, a.cos, a.sin, a.layout, p.compute);
    return r;
  }
  const int64_t d = a.x.size(-1);
  r.out = layout_detail::empty_like_heads(p.x, "rotary_embedding");
  r.fused = true;
  if (r.out.numel() > 0) {
    const Shape rows = {a.x.numel() / d, d};
    const Tensor out_rows = p.heads > 1 ? r.out.transpose(1, 2).view(rows) : r.out.view(rows);
    const Tensor x_rows = p.heads > 1 ? p.x.transpose(1, 2).view(rows) : p.x.view(rows);
    r.fused = backend::fused::rotary_embedding.try_run(a.x.device(), out_rows, x_rows, p.cos, p.sin,
                                                       static_cast<int>(a.layout), /*inverse=*/false, p.heads);
    if (!r.fused) r.out = composite(a.x, a.cos, a.sin, a.layout, p.compute);
  }
  return r;
}

}  // namespace flame::op_detail

namespace flame::nn::functional {

Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin, RotaryLayout layout) {
  return op_detail::invoke<op_detail::RotaryDef>({x, cos, sin, layout});
}

}  // namespace flame::nn::functional
