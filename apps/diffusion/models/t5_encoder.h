#pragma once
// The T5 v1.1 encoder (transformers' T5EncoderModel): the text encoder of SD3 and FLUX (T5-XXL),
// with transformers' parameter names (shared.weight, encoder.block.N.layer.0.SelfAttention.q.weight,
// encoder.block.N.layer.1.DenseReluDense.wi_0.weight, encoder.final_layer_norm.weight, ...).
//
//   auto t5 = models::load_t5_encoder("/models/flux/text_encoder_2", {.device = Device::cuda(),
//                                                                      .dtype = DType::bf16});
//   Tensor states = t5->encode(ids, mask);   // [B, L, d_model]
//
// Note [T5 encoder]
// ids [B, L] -> shared embedding -> num_layers blocks of
//   h = h + o(attention(layer_norm(h)))      q, k, v, o without bias; scores q k^T are NOT scaled by
//                                            1/sqrt(d_kv) (T5's initialisation folds it into q);
//                                            + the relative position bias [1, H, L, L], computed
//                                            once from block 0's relative_attention_bias table and
//                                            shared by every block; + the padding mask (finfo.min
//                                            on padded keys). One additive mask through FLAME's
//                                            SDPA with scale 1.
//   h = h + wo(gelu_tanh(wi_0(n)) * wi_1(n)),  n = layer_norm(h)   (gated-gelu, "gelu_new")
// -> final layer norm. The layer norm is T5's RMS norm: the variance is computed in f32, the
// normed values are cast back to the weight's dtype when that is f16/bf16, then multiplied by the
// weight (T5LayerNorm). Relative position buckets (bidirectional): half the buckets for keys after
// the query; within each half, distances below num_buckets/4 have their own bucket, larger ones
// share logarithmically spaced buckets up to max_distance (computed in f32 as transformers does).
//
// Dtypes. f32 and bf16 run as transformers does with the model in that dtype (bf16 has f32's range:
// nothing is clamped). f16 follows transformers' fp16 path, which T5 needs (its activations pass
// f16's range): wo is kept in f32 (_keep_in_fp32_modules) and its input cast to f32, so the residual
// stream becomes f32 after the first feed-forward; where the stream is f16 it is clamped to
// +-(65504 - 1000 if it holds an inf, else 65504) after each sub-layer.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <flame/flame.h>
#include <flame/nn.h>

#include "models/checkpoint.h"

namespace flame_diffusion::models {

struct T5EncoderConfig {
  int64_t vocab_size = 32128;
  int64_t d_model = 4096;
  int64_t d_kv = 64;
  int64_t d_ff = 10240;
  int64_t num_layers = 24;
  int64_t num_heads = 64;
  int64_t relative_attention_num_buckets = 32;
  int64_t relative_attention_max_distance = 128;
  std::string feed_forward_proj = "gated-gelu";  // the only one of T5 v1.1 (and the one FLAME runs)
  double layer_norm_epsilon = 1e-6;
  std::string family = "t5-xxl";  // "t5-xxl" or "custom"

  // "t5-xxl": google/t5-v1_1-xxl's encoder (SD3's text_encoder_3, FLUX's text_encoder_2).
  static T5EncoderConfig preset(const std::string& name);
  // A transformers config.json (T5Config). Errors name the file and key; feed_forward_proj other
  // than gated-gelu is refused.
  static T5EncoderConfig from_json(const JsonConfig& config);
  std::string to_string() const;
};

// The relative position buckets of Note [T5 encoder] for L queries and S keys: i64 [L, S].
flame::Tensor t5_relative_position_buckets(int64_t query_length, int64_t key_length, int64_t num_buckets,
                                           int64_t max_distance, flame::Device device = flame::Device::cpu());
// T5LayerNorm (Note [T5 encoder]).
flame::Tensor t5_layer_norm(const flame::Tensor& x, const flame::Tensor& weight, double eps);

// ---- the modules (names as transformers') ----
class T5Attention : public flame::nn::Module {
 public:
  T5Attention(const T5EncoderConfig& c, bool has_relative_attention_bias, flame::TensorOptions opts);
  std::string name() const override { return "T5Attention"; }
  // mask: the additive [B or 1, H, L, L] mask (bias and padding) in the attention's dtype.
  flame::Tensor attend(const flame::Tensor& x, const flame::Tensor& mask);
  // The bias [1, H, L, L] from the table (block 0 only).
  flame::Tensor position_bias(int64_t length) const;

 private:
  int64_t heads_, d_kv_, buckets_, max_distance_;
  std::shared_ptr<flame::nn::Linear> q_, k_, v_, o_;
  std::shared_ptr<flame::nn::Embedding> relative_attention_bias_;  // null except in block 0
  mutable flame::Tensor buckets_cache_;  // the last length's buckets, on the table's device
};

class T5Block : public flame::nn::Module {
 public:
  T5Block(const T5EncoderConfig& c, bool has_relative_attention_bias, flame::TensorOptions opts);
  std::string name() const override { return "T5Block"; }
  flame::Tensor run(const flame::Tensor& h, const flame::Tensor& mask);
  const std::shared_ptr<T5Attention>& attention() const { return attention_; }

 private:
  double eps_;
  std::shared_ptr<T5Attention> attention_;
  flame::Tensor attn_norm_, ff_norm_;  // layer.0.layer_norm.weight, layer.1.layer_norm.weight
  std::shared_ptr<flame::nn::Linear> wi_0_, wi_1_, wo_;
};

class T5EncoderModel : public flame::nn::Module {
 public:
  explicit T5EncoderModel(const T5EncoderConfig& config, flame::TensorOptions opts = {});
  std::string name() const override { return "T5EncoderModel"; }
  std::string extra_repr() const override { return config_.to_string(); }

  const T5EncoderConfig& config() const { return config_; }
  flame::DType dtype() const;  // the embedding's (wo is f32 in an f16 model)
  flame::Device device() const;

  // ids [B, L] (integers), attention_mask [B, L] of 1 (token) / 0 (padding) or undefined (every
  // token seen) -> the last hidden state [B, L, d_model] (Note [T5 encoder]).
  flame::Tensor encode(const flame::Tensor& input_ids, const flame::Tensor& attention_mask = {});
  flame::Tensor forward(const flame::Tensor& input_ids) override { return encode(input_ids); }

 private:
  T5EncoderConfig config_;
  std::shared_ptr<flame::nn::Embedding> shared_;
  std::vector<std::shared_ptr<T5Block>> blocks_;
  flame::Tensor final_norm_;
};

}  // namespace flame_diffusion::models
