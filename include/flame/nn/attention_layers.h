#pragma once
// MultiheadAttention over scaled_dot_product_attention (attention.h), with PyTorch's parameter
// names (in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias; q/k/v_proj_weight when
// kdim/vdim differ from embed_dim) and initialisation, so PyTorch state dicts load unchanged.
//
// Masks follow nn.MultiheadAttention, which is the OPPOSITE of the functional op for booleans:
// a bool attn_mask or key_padding_mask marks with true the keys a query may NOT attend; a floating
// mask is added to the scores.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "flame/nn/attention.h"
#include "flame/nn/linear.h"
#include "flame/nn/module.h"

namespace flame::nn {

struct MultiheadAttentionOptions {
  double dropout = 0.0;      // on the attention probabilities, training mode only
  bool bias = true;          // in_proj_bias and out_proj.bias
  int64_t kdim = 0;          // 0: embed_dim
  int64_t vdim = 0;          // 0: embed_dim
  bool batch_first = false;  // PyTorch's default: inputs are [L, N, E]
};

struct MhaForwardOptions {
  Tensor key_padding_mask;       // [N, S] (or [S] unbatched): true / -inf marks padding keys
  Tensor attn_mask;              // [L, S] or [N * num_heads, L, S]
  bool need_weights = false;     // also return the attention weights (runs the math path)
  bool average_attn_weights = true;
  bool is_causal = false;        // a causal mask (no attn_mask needed)
};

class MultiheadAttention : public Module {
 public:
  MultiheadAttention(int64_t embed_dim, int64_t num_heads, MultiheadAttentionOptions options = {},
                     TensorOptions opts = {});
  std::string name() const override { return "MultiheadAttention"; }
  std::string extra_repr() const override;

  // Self-attention: forward(x) = attention(x, x, x).first.
  Tensor forward(const Tensor& x) override;
  // (output, weights); weights is undefined unless need_weights. Shapes as PyTorch:
  // query [L, N, E] (batch_first: [N, L, E]) or unbatched [L, E]; output like query;
  // weights [N, L, S] (averaged) or [N, num_heads, L, S].
  std::pair<Tensor, Tensor> attention(const Tensor& query, const Tensor& key, const Tensor& value,
                                      const MhaForwardOptions& options = {});

  int64_t embed_dim() const { return embed_dim_; }
  int64_t num_heads() const { return num_heads_; }
  const std::shared_ptr<Linear>& out_proj() const { return out_proj_; }

 private:
  int64_t embed_dim_, num_heads_, head_dim_, kdim_, vdim_;
  MultiheadAttentionOptions options_;
  bool same_dims_;
  Tensor in_proj_weight_, q_proj_weight_, k_proj_weight_, v_proj_weight_, in_proj_bias_;
  std::shared_ptr<Linear> out_proj_;
};

}  // namespace flame::nn
