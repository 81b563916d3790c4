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

}  // namespace flame::nn::functional
