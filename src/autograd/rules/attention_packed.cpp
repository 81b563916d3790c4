// Gradient rule of attention_qkv_packed's fused route: one node whose backward hands the fused
// SDPA backward three strided views of ONE gradient buffer as dq, dk and dv (Note [Packed QKV
// attention] in src/ops/attention_packed.cpp). No zero fill, no slice copies, no sum of three
// full-size gradients: the buffer the kernel writes is the gradient of qkv.
#include <cstdint>

#include "flame/autograd.h"
#include "src/autograd/record.h"
#include "src/autograd/rules/attention.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"
#include "src/ops/grad_hooks.h"

namespace flame::rules {

namespace {
constexpr const char* kOp = "attention_qkv_packed";

// [B, L, 3 * H * D] -> (the [B, H, L, D] view of part `which` of the (3, H, D) last dim).
Tensor part_view(const Tensor& packed5, int64_t which) { return packed5.select(2, which).transpose(1, 2); }

// [B, L, H * D] -> its [B, H, L, D] view (heads inner to rows in memory, as the forward's out).
Tensor heads_view(const Tensor& t, int64_t num_heads) {
  return t.view({t.size(0), t.size(1), num_heads, t.size(2) / num_heads}).transpose(1, 2);
}

TensorList attention_qkv_packed_rule(const Tensor& g, const Node& n) {
  const Tensor qkv = n.saved(0), out = n.saved(1), stats = n.saved(2);
  const int64_t heads = n.args().count;
  const double scale = n.args().a;
  const bool causal = n.args().op != 0;
  auto& be = backend::backend_for(qkv.device());
  NoGradGuard no_grad;  // the views below are plumbing for the kernel, not graph
  // dO in O's exact layout (as sdpa_fused_backward): cuDNN reads the two as one layout. The
  // upstream gradient of a [B, L, H * D] result is almost always contiguous already (the output
  // projection's dX); anything else (another dtype, strides, a misaligned start) costs one copy.
  Tensor go = g;
  if (go.dtype() != out.dtype() || go.strides() != out.strides() ||
      reinterpret_cast<std::uintptr_t>(go.data_ptr()) % 16 != 0) {
    go = make_empty(out.sizes(), out.dtype(), out.device(), kOp);
    be.copy(go, g);
  }
  const TensorList qkv4 = packed_qkv_views(qkv, heads);
  const Tensor out4 = heads_view(out, heads), g4 = heads_view(go, heads);
  Tensor dqkv = make_empty(qkv.sizes(), qkv.dtype(), qkv.device(), kOp);
  const Tensor d5 = dqkv.view({qkv.size(0), qkv.size(1), 3, heads, qkv.size(2) / (3 * heads)});
  const Tensor dq4 = part_view(d5, 0), dk4 = part_view(d5, 1), dv4 = part_view(d5, 2);
  // Note [cuDNN capture of long kv]: a backward captured into a CUDA graph may need kv chunks
  // even when the forward did not (it ran eagerly); the chunked rule returns fresh dq, dk, dv.
  const int64_t chunk = nn::functional::detail::sdpa_kv_chunk(qkv4[0], qkv.size(1), causal);
  if (chunk > 0) {
    const TensorList d =
        sdpa_fused_backward(g4, qkv4[0], qkv4[1], qkv4[2], out4, stats, Tensor(), scale, causal, chunk);
    be.copy(dq4, d[0]);
    be.copy(dk4, d[1]);
    be.copy(dv4, d[2]);
  } else {
    // A backend that sums dq, dk and dv per column as it writes them hands the sums on to the
    // projection that made qkv (its bias gradient; Note [Gradient row sums]).
    Tensor sums;
    be.sdpa_backward(dq4, dk4, dv4, qkv4[0], qkv4[1], qkv4[2], out4, g4, stats, Tensor(), scale, causal, &sums);
    if (sums.defined()) autograd_detail::attach_row_sums(dqkv, sums);
  }
  return {dqkv};
}
}  // namespace

TensorList packed_qkv_views(const Tensor& qkv, int64_t num_heads) {
  NoGradGuard no_grad;
  const Tensor p5 = qkv.view({qkv.size(0), qkv.size(1), 3, num_heads, qkv.size(2) / (3 * num_heads)});
  return {part_view(p5, 0), part_view(p5, 1), part_view(p5, 2)};
}

void attention_qkv_packed(Tensor& out, const Tensor& stats, const Tensor& qkv, int64_t num_heads, double scale,
                          bool causal) {
  if (!needs_grad({qkv})) return;
  RuleArgs args;
  args.a = scale;
  args.op = causal ? 1 : 0;
  args.count = num_heads;
  Node& n = record(out, "AttentionQkvPackedBackward", {qkv}, &attention_qkv_packed_rule, args);
  n.save(qkv);
  n.save(out, /*is_output=*/true);
  n.save(stats);
}

}  // namespace flame::rules
