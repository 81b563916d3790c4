// The RMS QK-norm fused with the join of attention's streams and the rotary embedding
// (flame/nn/rotary.h).
//
// Note [RMS norm rotary]
// A joint-attention block with RMS QK-norm and RoPE (FLUX: [1, 4608, 24, 128] bf16 q and k, 27 MiB
// each, in every one of its 57 blocks) made each of q and k in four passes: rms_norm over the image
// stream's projection and over the text stream's, cat along the sequence, rotary_embedding. Here
// it is one kernel (src/backend/fused/rms_norm_rotary.h): each row of each part is read once,
// normalised, rounded to the parts' dtype where rms_norm rounds, rotated as the rotary kernel
// rotates, and written once into its place in the joined [B, S, H, D] output, which attention
// takes as its [B, H, S, D] view. The node saves the parts (what rms_norm's node saved) and the
// tables; the backward is one kernel too: the rotation's inverse pass, rounded where
// rotary_embedding's backward rounds, then rms_norm's backward, written into each part's gradient
// (no cat backward, no separate norm backward). Under RecomputeCheap the output is a recipe over
// the parts, so q and k cost one pass to redo instead of four. The values are those of the ops it
// replaces: on the CPU bit for bit (both backends' kernels round where the separate kernels round),
// on CUDA within the summation order of a row's statistics.
//
// The parts run in their own dtype (rms_norm outside autocast with a weight of that dtype, as
// diffusers' RMSNorm for a half-precision model), so the op takes no autocast policy. Where a
// weight or a table needs a gradient (full fine-tuning of the norms), or the device declines the
// call, the composite runs: rms_norm per part, cat, rotary_embedding, with autocast off, which is
// also the reference the tests hold the kernels to.
#include "flame/grad_mode.h"
#include "flame/nn/norm.h"
#include "flame/nn/rotary.h"
#include "flame/ops.h"
#include "src/backend/fused/rms_norm_rotary.h"
#include "src/ops/rms_norm_rotary_def.h"

namespace flame::op_detail {
namespace {
using nn::functional::RotaryLayout;

constexpr const char* kOp = "rms_norm_rotary";

// The same math as ordinary ops (Note [RMS norm rotary]).
Tensor composite(const RmsNormRotaryArgs& a) {
  const Tensor& x0 = a.parts.front();
  const amp::detail::AutocastOffGuard no_autocast;  // the parts in their own dtype
  const int64_t d = x0.size(3);
  TensorList normed;
  normed.reserve(a.parts.size());
  for (std::size_t i = 0; i < a.parts.size(); ++i)
    normed.push_back(nn::functional::rms_norm(a.parts[i], {d}, a.weights[i], a.eps));
  Tensor joined = normed.size() == 1 ? normed[0] : cat(normed, 1);
  Tensor q = joined.transpose(1, 2);
  if (a.cos.defined()) q = nn::functional::rotary_embedding(q, a.cos, a.sin, a.layout);
  return q;
}

void validate(const RmsNormRotaryArgs& a) {
  FLAME_CHECK(!a.parts.empty(), kOp, "give at least one part (q or k of one stream, [B, S, H, D])");
  FLAME_CHECK(a.weights.size() == a.parts.size(), kOp, "give one weight per part (undefined for none): ",
              a.parts.size(), " parts, ", a.weights.size(), " weights");
  const Tensor& x0 = a.parts.front();
  for (std::size_t i = 0; i < a.parts.size(); ++i) {
    const Tensor& x = a.parts[i];
    FLAME_CHECK(x.defined(), kOp, "part ", i, " is undefined");
    FLAME_CHECK(x.dim() == 4, kOp, "each part must be [B, S, H, D] (a projection seen as heads), got part ", i,
                " of shape ", x.sizes());
    FLAME_CHECK(is_floating(x.dtype()), kOp, "parts must be floating, got part ", i, " ", dtype_name(x.dtype()));
    FLAME_CHECK(x.dtype() == x0.dtype() && x.device() == x0.device(), kOp, "parts must share a dtype and device: part ",
                i, " is ", dtype_name(x.dtype()), " on ", x.device().str(), ", part 0 ", dtype_name(x0.dtype()), " on ",
                x0.device().str());
    FLAME_CHECK(x.size(0) == x0.size(0) && x.size(2) == x0.size(2) && x.size(3) == x0.size(3), kOp,
                "parts join along S and must agree in B, H and D: part ", i, " is ", x.sizes(), ", part 0 ", x0.sizes());
    const Tensor& w = a.weights[i];
    if (!w.defined()) continue;
    FLAME_CHECK(w.dim() == 1 && w.size(0) == x0.size(3), kOp, "weight ", i, " must be [D] = [", x0.size(3), "], got ",
                w.sizes());
    FLAME_CHECK(w.dtype() == x0.dtype() && w.device() == x0.device(), kOp, "weight ", i,
                " must have the parts' dtype and device (", dtype_name(x0.dtype()), " on ", x0.device().str(), "), got ",
                dtype_name(w.dtype()), " on ", w.device().str(), "; cast the norm's weight or use rms_norm");
  }
  FLAME_CHECK(a.cos.defined() == a.sin.defined(), kOp, "give both cos and sin, or neither (no rotation)");
  if (!a.cos.defined()) return;
  int64_t s = 0;
  for (const Tensor& x : a.parts) s += x.size(1);
  const int64_t d = x0.size(3);
  FLAME_CHECK(d % 2 == 0, kOp, "D must be even to rotate (pairs rotate together), got parts of shape ", x0.sizes());
  for (const Tensor* t : {&a.cos, &a.sin}) {
    const char* what = t == &a.cos ? "cos" : "sin";
    FLAME_CHECK(is_floating(t->dtype()) && t->device() == x0.device(), kOp, what, " must be floating on ",
                x0.device().str(), ", got ", dtype_name(t->dtype()), " on ", t->device().str());
    bool ok = t->dim() >= 2 && t->size(-2) == s && t->size(-1) == d;
    for (int64_t i = 0; ok && i + 2 < t->dim(); ++i) ok = t->size(i) == 1;
    FLAME_CHECK(ok, kOp, what, " must be [S, D] = [", s, ", ", d, "] over the joined sequence (the parts' S summed), got ",
                t->sizes());
  }
}

}  // namespace

RmsNormRotaryDef::Prep RmsNormRotaryDef::prepare(const Args& a) {
  validate(a);
  Prep p;
  bool wants = a.cos.defined() && (a.cos.requires_grad() || a.sin.requires_grad());
  for (const Tensor& w : a.weights) wants = wants || (w.defined() && w.requires_grad());
  p.composite = grad_enabled() && wants;
  if (p.composite) return p;
  for (const Tensor& x : a.parts) p.parts.push_back(x.contiguous());
  for (const Tensor& w : a.weights) p.weights.push_back(w.defined() ? w.detach().contiguous() : w);
  if (a.cos.defined()) {
    const DType c = a.parts.front().dtype() == DType::f64 ? DType::f64 : DType::f32;
    int64_t s = 0;
    for (const Tensor& x : a.parts) s += x.size(1);
    const int64_t d = a.parts.front().size(3);
    p.cos = a.cos.detach().to(c).reshape({s, d}).contiguous();
    p.sin = a.sin.detach().to(c).reshape({s, d}).contiguous();
  }
  return p;
}

RmsNormRotaryDef::Result RmsNormRotaryDef::run(const Args& a, Prep& p) {
  Result r;
  if (p.composite) {
    r.out = composite(a);
    return r;
  }
  const Tensor& x0 = p.parts.front();
  int64_t s = 0;
  for (const Tensor& x : p.parts) s += x.size(1);
  const Tensor mem = Tensor::empty({x0.size(0), s, x0.size(2), x0.size(3)}, {x0.dtype(), x0.device()});
  r.fused = mem.numel() == 0 ||
            backend::fused::rms_norm_rotary_forward.try_run(x0.device(), mem, p.parts, p.weights, p.cos, p.sin,
                                                            static_cast<int>(a.layout), a.eps);
  r.out = r.fused ? mem.transpose(1, 2) : composite(a);
  return r;
}

}  // namespace flame::op_detail

namespace flame::nn::functional {

Tensor rms_norm_rotary(const TensorList& parts, const TensorList& weights, double eps, const Tensor& cos,
                       const Tensor& sin, RotaryLayout layout) {
  op_detail::RmsNormRotaryArgs a{parts, weights, cos, sin, eps, layout};
  if (a.weights.empty()) a.weights.resize(a.parts.size());
  return op_detail::invoke<op_detail::RmsNormRotaryDef>(a);
}

}  // namespace flame::nn::functional
