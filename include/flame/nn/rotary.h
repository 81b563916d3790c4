#pragma once
// Rotary position embedding (RoPE), fused: one pass over x forward and one over the gradient
// backward, saving only cos and sin. See docs/nn-attention.md, "Rotary position embedding".
#include <cstdint>

#include "flame/tensor.h"

namespace flame::nn::functional {

// Which elements rotate together.
enum class RotaryLayout : uint8_t {
  interleaved,  // pairs (2i, 2i + 1): FLUX, diffusers' apply_rotary_emb(use_real_unbind_dim=-1)
  half,         // pairs (i, i + D/2): rotate_half (GPT-NeoX, Llama, use_real_unbind_dim=-2)
};

// out = x * cos + rotate(x) * sin, where rotate maps each pair (a, b) to (-b, a):
//   out[a] = x[a] cos[a] - x[b] sin[a],  out[b] = x[b] cos[b] + x[a] sin[b].
// x: [..., S, D] floating with D even (e.g. q or k as [B, H, S, D]); cos, sin: [S, D] (or with
// leading dims of size 1), floating, on x's device. Computed in f32 (f64 for f64 x) from x as
// stored, the result in x's dtype: diffusers' (x.float() * cos + x_rotated.float() * sin).to(x.dtype).
// The gradient flows to x (and, through the composite, to cos and sin when they require one).
Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin,
                        RotaryLayout layout = RotaryLayout::interleaved);

// q or k of an attention with RMS QK-norm and rotary embedding (FLUX's, SD3.5's without the
// rotation), in one pass: each part (one stream's projection seen as heads, [B, S_p, H, D]) is
// RMS-normalised per head with its weight, the parts are joined along the sequence in the order
// given, and the joined rows are rotated by cos and sin ([S, D] over the joined S = sum S_p; both
// undefined: no rotation). Returns [B, H, S, D], the heads-transposed view of a [B, S, H, D]
// tensor, which scaled_dot_product_attention takes without a copy. The values are those of
//   rotary_embedding(cat({rms_norm(part_p, {D}, weight_p, eps) ...}, 1).transpose(1, 2), cos, sin, layout)
// run outside autocast (the parts in their own dtype, as diffusers' RMSNorm in a bf16 model):
// rounded to the parts' dtype after the norm and after the rotation. weights: one per part, each
// [D] in the parts' dtype or undefined (no scale); an empty list means none. The gradient flows to
// the parts through one fused backward; weights or tables that require a gradient take the
// composite, so they get theirs too. See docs/nn-attention.md, "RMS QK-norm with rotary".
Tensor rms_norm_rotary(const TensorList& parts, const TensorList& weights, double eps, const Tensor& cos = {},
                       const Tensor& sin = {}, RotaryLayout layout = RotaryLayout::interleaved);

}  // namespace flame::nn::functional
