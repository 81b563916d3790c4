#pragma once
// Note [Gradient hooks]
// The gradient rules of the ops that record their own node rather than going through invoke
// (Note [Invoke]): the elementwise table ops, views, joins, copies, in-place writes and the fused
// adaLN, linear-epilogue and packed-attention ops. The op layer declares each entry point here and
// src/autograd/rules defines it, as an op definition declares its `record`: the formulas (and what
// each backward saves) are written only there, and the op layer includes no autograd header
// (Note [Layers]). Each entry point records a node on its output when an input needs a gradient
// (the caller may test needs_grad first to keep an unrecorded call free of work).
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <vector>

#include "flame/ops.h"
#include "flame/tensor.h"
#include "src/core/tensor_impl.h"
#include "src/opdef/op_list.h"

namespace flame::rules {

// ---- elementwise (src/autograd/rules/elementwise.cpp) ----
// x: the input as the kernel saw it (after dtype promotion); orig: the user's input.
void unary(Tensor& out, backend::UnaryOp op, const Tensor& orig, const Tensor& x, const backend::UnaryParams& p);
void binary(Tensor& out, backend::BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& ac, const Tensor& bc);
void where(Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);

// ---- views and copies (src/autograd/rules/views.cpp) ----
// How a view's gradient goes back to its base's geometry; `base`'s sizes are the shape it returns to.
enum class ViewGrad : uint8_t {
  reshape,    // view, reshape, squeeze, unsqueeze, flatten: g reshaped to base's sizes
  identity,   // t of a tensor with fewer than 2 dims, transpose of a 0-d tensor: g itself
  transpose,  // a, b: the two dims
  permute,    // dims: the forward's permutation
  slice,      // a, b, c, d: dim, start, end, step (g placed into zeros of base's sizes)
  select,     // a, b: dim, index
  expand,     // g summed back to base's sizes
  unfold,     // a, b, c: dim, size, step (each window's gradient added back where it read)
};
struct ViewArgs {
  int64_t a = 0, b = 0, c = 0, d = 0;
  const Shape* dims = nullptr;  // permute's dims
};
// Records the node of view `v` of `base` (no tensor saved: the rule keeps shapes and dims only).
void view(Tensor& v, const char* name, ViewGrad kind, const Tensor& base, const ViewArgs& args);
// x.narrow(d, start, length) = v: a node that takes x's pending gradient sum (Note [Accumulate base]).
void narrow(Tensor& v, const Tensor& x, int64_t d, int64_t start);
// A copy of `src` into `dst` of another dtype or device, or the same (clone): the gradient goes
// back converted to src's dtype and device. `name`: "to_device", "to_dtype", "clone".
Tensor& copy(Tensor& dst, const char* name, const Tensor& src);

// ---- joins (src/autograd/rules/joins.cpp) ----
// cat: starts[i] is where input i begins along dim d of out, -1 for a skipped [0] input.
void cat(Tensor& out, const TensorList& tensors, const std::vector<int64_t>& starts, int64_t d);
void stack(Tensor& out, const TensorList& tensors, int64_t d);
Tensor& flip(Tensor& out, const Tensor& x, const Shape& dims);
// repeat: x_padded are x's sizes with leading 1s up to repeats' length.
void repeat(Tensor& out, const Tensor& x, const Shape& x_padded, const Shape& repeats);
// pad (Note [Join gradients] in src/ops/joins.cpp): left/right, the non-negative pads per dim;
// crop_lo, the elements cropped at the start of each dim; kept, the sizes after cropping.
void pad(Tensor& out, const Tensor& x, const Shape& left, const Shape& right, const Shape& crop_lo, const Shape& kept,
         PadMode mode);

// ---- in-place writes (src/autograd/rules/inplace.cpp, Note [In-place recording]) ----
// The in-place ops call, after validating their arguments:
//
//   if (rules::inplace_records(self, {src}, "add_")) {
//     Tensor old = rules::inplace_current(self).clone();
//     rules::inplace_commit(self, add(old, src), "add_");
//     return self;
//   }
//   ...plain kernel...
//
// Whether the write must be recorded (grad mode on, and the destination, its base or a source
// requires grad). Raises PyTorch's errors for a leaf that requires grad, or a view of one.
bool inplace_records(const Tensor& self, std::initializer_list<std::reference_wrapper<const Tensor>> sources,
                     const char* op);
// A differentiable handle on the destination's present value and history (through its base for a view).
Tensor inplace_current(const Tensor& self);
// Writes `result` (the destination's shape) into self and gives self (and its base) the new history.
void inplace_commit(Tensor& self, const Tensor& result, const char* op);
// Regenerates the history of a view whose base took a new history since it was made.
void regenerate_view_history(const Tensor& t);
// Called wherever an op reads a tensor's autograd state: costs one compare unless t is a stale view.
inline void refresh_view_history(const Tensor& t) {
  const TensorImpl* impl = t.impl();
  if (impl->base && impl->base->history_version != impl->base_history_seen) regenerate_view_history(t);
}

// ---- fused adaLN (src/autograd/rules/adaln.cpp, Note [adaLN ops] in src/ops/adaln.cpp) ----
// Each node's backward is one fused kernel call (src/backend/fused/adaln.h).
// layer_norm_modulate's node: x3 is x as the kernel read it ([B, T, D] contiguous), saved with
// mean, or xhat as the kernel wrote it when defined (Note [Saved x-hat]). residual: x is the h of
// a gated_residual_modulate recorded just before (Note [Fused residual backward]).
void layer_norm_modulate(Tensor& y, const Tensor& x, const Tensor& shift, const Tensor& scale, const Tensor& x3,
                         const Tensor& mean, const Tensor& rstd, const Tensor& xhat, DType out, bool residual = false);
// gated_residual's node: y3 is y as the kernel read it ([B, T, D] contiguous).
void gated_residual(Tensor& o, const Tensor& x, const Tensor& gate, const Tensor& y, const Tensor& y3, DType out);

// ---- linear epilogues (src/autograd/rules/linear_epilogue.cpp, Note [Linear epilogues]) ----
// y [..., out] = act(x [..., in] @ w^T + b) with act = gelu_tanh when pre (the value before it,
// [rows, out] contiguous) is defined, else identity. x2 is x as the [rows, in] contiguous matrix the
// GEMM read; b may be undefined. Records one node with inputs {x, w, b}. w_run is the matrix the
// GEMM read: w, or for an f32 master weight beside a half x its low-precision copy (Note
// [Master-weight epilogues]; w's and b's gradients then come out f32).
void linear_epilogue(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& x2,
                     const Tensor& pre, const Tensor& w_run);
// y [..., out] = x @ w^T + c (linear_add, Note [Residual epilogue]): one node with inputs {x, w, c};
// x2 and w_run as linear_epilogue's.
void linear_residual(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& c, const Tensor& x2,
                     const Tensor& w_run);
// y [..., out] = linear(gelu_tanh(linear(x, w1, b1)), w2, b2) (mlp_gelu): x2 as above, pre the
// first layer's pre-activation and h = gelu_tanh(pre), both [rows, hidden] contiguous.
// recompute_hidden: save pre but not h; the backward recomputes h for w2's gradient. w1_run and
// w2_run as linear_epilogue's w_run.
void mlp_gelu(Tensor& y, const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
              const Tensor& x2, const Tensor& pre, const Tensor& h, bool recompute_hidden, const Tensor& w1_run,
              const Tensor& w2_run);

// ---- packed-QKV attention (src/autograd/rules/attention_packed.cpp, Note [Packed QKV attention]) ----
// The q, k, v operands of the fused kernels as strided views of a packed qkv [B, L, 3 * H * D]
// (last dim laid out (3, H, D)): each [B, H, L, D], reading qkv in place. Made without autograd
// (the node of the packed op owns the gradient); qkv must have last-dim stride 1.
TensorList packed_qkv_views(const Tensor& qkv, int64_t num_heads);
// Records the single node of out = attention_qkv_packed(qkv) on `out` ([B, L, H * D] contiguous,
// written by Backend::sdpa_forward through its [B, H, L, D] view) when qkv needs a gradient.
// Saves qkv, out and stats (the logsumexp rows [B, H, L, 1]). The rule writes dq, dk and dv
// straight into one [B, L, 3 * H * D] gradient.
void attention_qkv_packed(Tensor& out, const Tensor& stats, const Tensor& qkv, int64_t num_heads, double scale,
                          bool causal);

}  // namespace flame::rules
