#pragma once
// Scaled dot-product attention, as torch.nn.functional.scaled_dot_product_attention.
// docs/nn-attention.md describes the two paths, their limits and the cuDNN routes.
//
//   out = softmax(q k^T * scale + mask) v        (dropout on the probabilities when dropout_p > 0)
//
// q [..., L, E], k [..., S, E], v [..., S, Ev] -> out [..., L, Ev]; the leading dims ([B, H] in
// PyTorch's layout) broadcast. attn_mask (optional) broadcasts to [..., L, S]: a bool mask says
// which keys a query may attend (true = attend, as PyTorch), a floating mask (q's dtype) is added
// to the scores. is_causal masks key j > query i (top-left aligned, as PyTorch) and may not be
// combined with attn_mask. scale defaults to 1/sqrt(E). A query row with every key masked gives 0
// (PyTorch's math path since 2.5) on the math path.
#include <cstdint>
#include <optional>

#include "flame/random.h"
#include "flame/tensor.h"

namespace flame::nn::functional {

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask = {},
                                    double dropout_p = 0.0, bool is_causal = false,
                                    std::optional<double> scale = std::nullopt, Generator* gen = nullptr);

// Which implementation scaled_dot_product_attention may use (like torch.nn.attention.sdpa_kernel).
//  automatic: the fused path where it applies (CUDA, bf16/f16, head dims it supports, dropout 0,
//             a mask that needs no gradient), else the math path;
//  math:      the composite of FLAME ops (every device and dtype; memory O(L*S));
//  fused:     the fused (flash-class, memory O(L+S)) path or an error saying why it does not apply.
//             On the CPU this runs the reference of the fused kernels' contract (tests use it).
enum class SdpaBackend : uint8_t { automatic, math, fused };

// Makes `backend` the choice of this thread for the scope, then restores the previous one.
class SdpaBackendGuard {
 public:
  explicit SdpaBackendGuard(SdpaBackend backend);
  ~SdpaBackendGuard();
  SdpaBackendGuard(const SdpaBackendGuard&) = delete;
  SdpaBackendGuard& operator=(const SdpaBackendGuard&) = delete;

 private:
  SdpaBackend previous_;
};
SdpaBackend sdpa_backend();

// What the last scaled_dot_product_attention call of this thread ran (tests and debugging):
// "math", "fused", "fused_padded" (Note [cuDNN masked backward at seq % 128 == 64] in
// src/ops/attention.cpp) or "fused_chunked" (Note [cuDNN capture of long kv]).
const char* sdpa_last_path();

namespace detail {
// Test hooks: take the cuDNN trap routes on any device (normally they are taken only where cuDNN
// needs them; docs/nn-attention.md). pad_to_128: with a mask and a gradient wanted, pad L and S
// up to multiples of 128. kv_chunk > 0: run non-causal calls over kv chunks of that many keys.
struct SdpaRouteOverride {
  bool pad_to_128 = false;
  int64_t kv_chunk = 0;
};
class SdpaRouteGuard {
 public:
  explicit SdpaRouteGuard(SdpaRouteOverride routes);
  ~SdpaRouteGuard();
  SdpaRouteGuard(const SdpaRouteGuard&) = delete;
  SdpaRouteGuard& operator=(const SdpaRouteGuard&) = delete;

 private:
  SdpaRouteOverride previous_;
};
}  // namespace detail

// Attention over a packed projection, as one op (docs/nn-attention.md, "Packed QKV"): qkv is
// [B, L, 3 * H * D] with its last dim laid out (3, H, D), what a fused Linear(dim, 3 * dim) gives
// and timm/DiT reshape; the result is [B, L, H * D], ready for the output projection. The math is
//   p = qkv.reshape({B, L, 3, H, D}).permute({2, 0, 3, 1, 4});
//   scaled_dot_product_attention(p.select(0, 0), p.select(0, 1), p.select(0, 2), {}, 0.0, is_causal,
//                                scale).transpose(1, 2).reshape({B, L, H * D});
// Where the fused path applies (sdpa_last_path() then says "fused_packed"), q/k/v are read in
// place and the backward writes dq, dk, dv into one qkv gradient: no zero fills, slice copies or
// sums. scale defaults to 1/sqrt(D); autocast casts qkv as scaled_dot_product_attention does.
Tensor attention_qkv_packed(const Tensor& qkv, int64_t num_heads, bool is_causal = false,
                            std::optional<double> scale = std::nullopt);

}  // namespace flame::nn::functional
