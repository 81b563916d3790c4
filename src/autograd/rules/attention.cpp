// Gradient rule of the fused scaled dot-product attention. The math path needs none: it is a
// composite of FLAME ops. Saved: q, k, v, the output and its f32 logsumexp stats (never the
// probabilities), so the graph holds O(L + S) per head besides an explicit mask.
#include "src/autograd/rules/attention.h"

#include <algorithm>
#include <cstdint>

#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/backend/backend.h"
#include "src/core/memory_format.h"
#include "src/core/tensor_impl.h"

namespace flame::rules {

namespace {
Tensor last_dim_dense(const Tensor& t) { return op_detail::fused_operand(t); }

TensorList sdpa_fused_rule(const Tensor& g, const Node& n) {
  const bool has_bias = n.args().count != 0;
  const Tensor q = n.saved(0), k = n.saved(1), v = n.saved(2), out = n.saved(3), stats = n.saved(4);
  const Tensor bias = has_bias ? n.saved(5) : Tensor();
  const bool causal = n.args().op != 0;
  const int64_t chunk = nn::functional::detail::sdpa_kv_chunk(q, k.size(2), causal);
  return sdpa_fused_backward(g, q, k, v, out, stats, bias, n.args().a, causal, chunk);
}
}  // namespace

TensorList sdpa_fused_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                               const Tensor& stats, const Tensor& bias, double scale, bool causal, int64_t kv_chunk) {
  auto& be = backend::backend_for(q.device());
  // dO in O's exact layout: cuDNN's backward reads the two as one layout (and a mismatch has
  // been a source of wrong gradients elsewhere); one copy of O's size when they differ.
  Tensor g = dout;
  if (g.dtype() != out.dtype() || g.strides() != out.strides()) {
    const bool heads_inner = out.stride(1) < out.stride(2);  // out is [B, L, H, Ev] memory (make_output)
    Tensor like = heads_inner ? make_empty({out.size(0), out.size(2), out.size(1), out.size(3)}, out.dtype(),
                                           out.device(), "scaled_dot_product_attention")
                                    .transpose(1, 2)
                              : make_empty(out.sizes(), out.dtype(), out.device(), "scaled_dot_product_attention");
    be.copy(like, g);
    g = like;
  }
  g = last_dim_dense(g);
  // Each gradient in its input's layout when that is the heads-inner view of a projection, so the
  // gradient reaches the projection without a transposing copy.
  Tensor dq = layout_detail::empty_like_heads(q, "scaled_dot_product_attention");
  Tensor dk = layout_detail::empty_like_heads(k, "scaled_dot_product_attention");
  Tensor dv = layout_detail::empty_like_heads(v, "scaled_dot_product_attention");
  const int64_t s_kv = k.size(2);
  if (kv_chunk <= 0 || kv_chunk >= s_kv) {
    be.sdpa_backward(dq, dk, dv, q, k, v, out, g, stats, bias, scale, causal, nullptr);
    return {dq, dk, dv};
  }
  // Note [cuDNN capture of long kv]: each chunk writes its dk, dv slice in place; its dq is a
  // partial sum, accumulated in f32.
  FLAME_CHECK(!causal, "scaled_dot_product_attention", "kv chunking does not support a causal mask");
  Tensor dq_acc;
  Tensor dq_part = make_empty(q.sizes(), q.dtype(), q.device(), "scaled_dot_product_attention");
  for (int64_t s0 = 0; s0 < s_kv; s0 += kv_chunk) {
    const int64_t len = std::min(kv_chunk, s_kv - s0);
    const Tensor bias_c = bias.defined() ? bias.narrow(3, s0, len) : Tensor();
    be.sdpa_backward(dq_part, dk.narrow(2, s0, len), dv.narrow(2, s0, len), q, k.narrow(2, s0, len),
                     v.narrow(2, s0, len), out, g, stats, bias_c, scale, causal, nullptr);
    const Tensor part = dq_part.to(DType::f32);
    dq_acc = dq_acc.defined() ? add(dq_acc, part) : part.clone();
  }
  return {dq_acc.to(q.dtype()), dk, dv};
}

}  // namespace flame::rules

namespace flame::op_detail {

// The record member of SdpaCoreDef: the node of out = fused_sdpa(q, k, v, bias) ([B, H, L, Dv]) when
// q, k or v needs a gradient. Saves q, k, v, out, stats (the f32 logsumexp rows) and bias (when
// defined): O(L + S) memory besides the bias. The rule calls Backend::sdpa_backward, over kv chunks
// when sdpa_kv_chunk() asks for it at backward time (Note [cuDNN capture of long kv]).
void SdpaCoreDef::record(Result& r, const Args& a, const Prep&) {
  Tensor& out = r.out;
  const Tensor &q = a.q, &k = a.k, &v = a.v, &bias = a.bias, &stats = r.stats;
  const double scale = a.scale;
  const bool causal = a.causal;  // false for the chunked forward (Note [cuDNN capture of long kv])
  if (!needs_grad({q, k, v})) return;
  RuleArgs args;
  args.a = scale;
  args.op = causal ? 1 : 0;
  args.count = bias.defined() ? 1 : 0;
  Node& n = flame::record(out, "ScaledDotProductFlashAttentionBackward", {q, k, v}, &rules::sdpa_fused_rule, args);
  n.save(q);
  n.save(k);
  n.save(v);
  n.save(out, /*is_output=*/true);
  n.save(stats);
  if (bias.defined()) n.save(bias);
}

}  // namespace flame::op_detail
