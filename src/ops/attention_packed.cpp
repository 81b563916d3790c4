// attention_qkv_packed: attention over a fused [B, L, 3 * H * D] projection as one op.
//
// Note [Packed QKV attention]
// A transformer block projects x to qkv [B, L, 3 * H * D] (last dim laid out (3, H, D), as a fused
// Linear(dim, 3 * dim) and timm/DiT have it) and runs
//   qkv.reshape(B, L, 3, H, D).permute(2, 0, 3, 1, 4) -> select q, k, v -> SDPA -> transpose(1, 2)
//   -> reshape(B, L, H * D)
// The forward of that composite is copy-free, its backward is not: the fused SDPA backward returns
// dq, dk, dv as fresh tensors, each select's backward scatters its slice into zeros of the whole
// [3, B, H, L, D], the engine adds the three, and the reshape's backward copies the permuted sum to
// contiguous. The fused route here is ONE node: the forward hands the kernels q, k, v as strided
// views of qkv and writes the output in [B, L, H, D] memory (the result is its [B, L, H * D]
// view), and the backward allocates the qkv gradient once and passes its three strided
// [B, H, L, D] views as dq, dk, dv (Backend::sdpa_backward takes any strides with last-dim stride
// 1; cuDNN's plan cache keys on them). sdpa_last_path() reports "fused_packed".
// The route is taken exactly where scaled_dot_product_attention would take its plain fused path
// for those q, k, v (the shared predicate detail::sdpa_fused_unsupported) and no cuDNN trap route
// is needed (a kv-chunked capture; no mask means no padded route); the SdpaBackend choice applies
// as there (fused forced also runs this route on the CPU reference, which is how the CPU suite
// gradchecks it). Everything else runs the composite above, which is the reference.
#include <cmath>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>

#include "flame/grad_mode.h"
#include "flame/nn/attention.h"
#include "flame/ops.h"
#include "src/ops/autocast_hooks.h"
#include "src/core/grad_state.h"
#include "src/ops/attention_def.h"
#include "src/ops/grad_hooks.h"
#include "src/backend/backend.h"
#include "src/ops/trace_hooks.h"
#include "src/core/tensor_impl.h"

namespace flame::nn::functional {

namespace {
constexpr const char* kOp = "attention_qkv_packed";

std::string describe(const Tensor& t) {
  std::ostringstream os;
  flame::detail::append(os, t.sizes(), " ", dtype_name(t.dtype()), " on ", t.device());
  return os.str();
}

void validate(const Tensor& qkv, int64_t num_heads, std::optional<double> scale) {
  FLAME_CHECK(qkv.defined(), kOp, "qkv must be a defined tensor");
  FLAME_CHECK(qkv.dim() == 3, kOp, "qkv must have 3 dims [B, L, 3 * num_heads * head_dim], got ", describe(qkv));
  FLAME_CHECK(num_heads >= 1, kOp, "num_heads must be at least 1, got ", num_heads, " (qkv ", describe(qkv), ")");
  FLAME_CHECK(qkv.size(2) % (3 * num_heads) == 0, kOp, "the last dim of qkv (", qkv.size(2),
              ") must be divisible by 3 * num_heads = ", 3 * num_heads, ", got qkv ", describe(qkv));
  FLAME_CHECK(is_floating(qkv.dtype()), kOp, "qkv must have a floating dtype, got ", describe(qkv));
  FLAME_CHECK(!scale || std::isfinite(*scale), kOp, "scale must be finite, got ", scale.value_or(0.0));
}

// The reference: reshape/permute/select, scaled_dot_product_attention, merge heads.
Tensor composite(const Tensor& qkv, int64_t num_heads, bool causal, std::optional<double> scale) {
  const int64_t b = qkv.size(0), l = qkv.size(1), hd = qkv.size(2) / (3 * num_heads);
  const Tensor p = qkv.reshape({b, l, 3, num_heads, hd}).permute({2, 0, 3, 1, 4});
  const Tensor o = scaled_dot_product_attention(p.select(0, 0), p.select(0, 1), p.select(0, 2), {}, 0.0, causal, scale);
  return o.transpose(1, 2).reshape({b, l, num_heads * hd});
}

// Note [Packed QKV attention]: the fused forward and its one node.
// qkv4: packed_qkv_views(qkv_in), reused when the kernels can read qkv_in in place.
Tensor packed_fused(const Tensor& qkv_in, const TensorList& qkv4_in, int64_t num_heads, bool causal, double scale) {
  // Kernels read qkv in place when its layout allows (last-dim stride 1, strides multiples of 8,
  // 16-byte aligned start); otherwise one autograd-aware contiguous copy.
  const Tensor qkv = op_detail::fused_operand(qkv_in);
  const int64_t b = qkv.size(0), l = qkv.size(1), hd = qkv.size(2) / (3 * num_heads);
  const TensorList qkv4 = qkv.impl() == qkv_in.impl() ? qkv4_in : rules::packed_qkv_views(qkv, num_heads);
  auto& be = backend::backend_for(qkv.device());
  Tensor out = make_empty({b, l, num_heads * hd}, qkv.dtype(), qkv.device(), kOp);
  const DType stats_dt = qkv.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const Tensor stats = make_empty({b, num_heads, l, 1}, stats_dt, qkv.device(), kOp);
  {
    NoGradGuard no_grad;
    const Tensor out4 = out.view({b, l, num_heads, hd}).transpose(1, 2);
    be.sdpa_forward(out4, stats, qkv4[0], qkv4[1], qkv4[2], Tensor(), scale, causal);
  }
  rules::attention_qkv_packed(out, stats, qkv, num_heads, scale, causal);
  detail::set_sdpa_last_path("fused_packed");
  return out;
}

}  // namespace

Tensor attention_qkv_packed(const Tensor& qkv, int64_t num_heads, bool is_causal, std::optional<double> scale) {
  if (auto* tr = compile_detail::active_tracer()) {  // replayed eagerly by flame::compile
    return compile_detail::trace_eager_op(*tr, "attention_qkv_packed", {qkv},
                                          [num_heads, is_causal, scale](const TensorList& in) {
                                            return attention_qkv_packed(in[0], num_heads, is_causal, scale);
                                          });
  }
  if (amp::detail::should_autocast(qkv)) {  // Note [Autocast policy]: as scaled_dot_product_attention
    amp::detail::AutocastOpScope scope;
    return attention_qkv_packed(amp::detail::cast_low(qkv), num_heads, is_causal, scale);
  }
  validate(qkv, num_heads, scale);
  const SdpaBackend choice = sdpa_backend();
  Tensor x = qkv;
  if (choice != SdpaBackend::math) {
    if (x.stride(2) != 1) x = x.contiguous();  // the kernels need a dense last dim
    const TensorList qkv4 = rules::packed_qkv_views(x, num_heads);
    const char* why = detail::sdpa_fused_unsupported(qkv4[0], qkv4[1], qkv4[2], Tensor(), 0.0);
    FLAME_CHECK(why == nullptr || choice != SdpaBackend::fused, kOp, "the fused path was requested but cannot run: ",
                why ? why : "", " (qkv ", describe(qkv), ", num_heads ", num_heads, ")");
    // Note [cuDNN capture of long kv]: that route lives in scaled_dot_product_attention.
    const bool trap = detail::sdpa_kv_chunk(qkv4[0], qkv.size(1), is_causal) > 0;
    const bool take_fused = why == nullptr && !trap && (choice == SdpaBackend::fused || qkv.device().is_cuda());
    if (take_fused) {
      const double sc = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(qkv4[0].size(3)));
      if (choice == SdpaBackend::fused) return packed_fused(x, qkv4, num_heads, is_causal, sc);
      // automatic: a configuration this cuDNN rejects when the forward plan is built runs the
      // composite (which then makes the same choice as scaled_dot_product_attention).
      try {
        return packed_fused(x, qkv4, num_heads, is_causal, sc);
      } catch (const Error&) {
      }
    }
  }
  return composite(x, num_heads, is_causal, scale);
}

}  // namespace flame::nn::functional
