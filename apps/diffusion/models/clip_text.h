#pragma once
// CLIP's text transformer: transformers' CLIPTextModel and CLIPTextModelWithProjection, one
// implementation for CLIP-L (SD 1.x, SDXL, SD3, FLUX) and OpenCLIP bigG (SDXL, SD3), with
// transformers' parameter names (a transformers folder loads key for key; the single-file layouts
// load through the plans of text_checkpoint.cpp).
//
//   auto clip = models::load_clip_text("/models/sdxl", {.device = Device::cuda(), .dtype = DType::bf16,
//                                                       .family = "clip-g"});
//   models::ClipTextOutput o = clip->encode(ids, {.output_hidden_states = true});
//   Tensor context = o.hidden_states[o.hidden_states.size() - 2];   // SDXL: the penultimate layer
//   Tensor pooled = o.text_embeds;                                      // projected EOS state
//
// Note [CLIP text encoder]
// ids [B, L] (integers, L <= max_position_embeddings) -> token + position embeddings -> layers of
// pre-norm self-attention (causal mask: token i sees tokens 0..i; with an attention mask [B, L] of
// 1/0 the padded keys are hidden too) and an MLP (fc1, quick_gelu = x * sigmoid(1.702 x) for CLIP-L,
// exact gelu for bigG, fc2) -> final layer norm. Outputs, as transformers counts them:
//   hidden_states[0] the embeddings, hidden_states[i] the output of layer i (un-normed), so
//     hidden_states[-2] is the penultimate layer SDXL conditions on;
//   last_hidden_state = final_layer_norm(hidden_states[-1]);
//   pooled = last_hidden_state at the EOS position of each row: argmax over the row of
//     (ids == eos_token_id), or, for configs with the legacy eos_token_id 2 (the released SD/SDXL
//     files), argmax of the ids themselves (the EOS id 49407 is the vocabulary's largest);
//   text_embeds = text_projection(pooled) (a Linear without bias) when the model has one.
// Attention is FLAME's SDPA (is_causal without a padding mask; a bool [B, 1, L, L] mask with one).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <flame/flame.h>
#include <flame/nn.h>

#include "models/checkpoint.h"

namespace flame_diffusion::models {

struct ClipTextConfig {
  int64_t vocab_size = 49408;
  int64_t hidden_size = 768;
  int64_t intermediate_size = 3072;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t max_position_embeddings = 77;
  std::string hidden_act = "quick_gelu";  // "quick_gelu" or "gelu" (exact)
  double layer_norm_eps = 1e-5;
  int64_t projection_dim = 768;
  bool with_projection = true;  // CLIPTextModelWithProjection (text_projection.weight)
  int64_t eos_token_id = 2;     // 2: the legacy rule (argmax of the ids); see Note [CLIP text encoder]
  std::string family = "clip-l";  // "clip-l", "clip-g" or "custom" (messages, tools)

  // "clip-l" (768 wide, 12 layers, 12 heads, quick_gelu, projection 768) and "clip-g" (OpenCLIP
  // bigG: 1280 wide, 32 layers, 20 heads, intermediate 5120, gelu, projection 1280).
  static ClipTextConfig preset(const std::string& name);
  // A transformers config.json of a text encoder (CLIPTextConfig: text_encoder/config.json).
  // Errors name the file and key; hidden_act other than quick_gelu/gelu is refused.
  static ClipTextConfig from_json(const JsonConfig& config);
  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  std::string to_string() const;
};

struct ClipTextOutput {
  flame::Tensor last_hidden_state;           // [B, L, D], after the final layer norm
  std::vector<flame::Tensor> hidden_states;  // num_hidden_layers + 1 of [B, L, D] when asked
  flame::Tensor pooled;                      // [B, D]
  flame::Tensor text_embeds;                 // [B, projection_dim]; undefined without projection
};

struct ClipEncodeOptions {
  // [B, L] of 1 (token) and 0 (padding), any integer or bool dtype; undefined: every token is seen
  // (CLIP-L as SD uses it: padded with EOS and no mask).
  flame::Tensor attention_mask;
  bool output_hidden_states = false;
};

// ---- the modules (names as transformers') ----
class ClipAttention : public flame::nn::Module {
 public:
  ClipAttention(const ClipTextConfig& c, flame::TensorOptions opts);
  std::string name() const override { return "CLIPAttention"; }
  // mask: undefined (causal only) or a bool [B, 1, L, L] (true = attend).
  flame::Tensor attend(const flame::Tensor& x, const flame::Tensor& mask);

 private:
  int64_t heads_, head_dim_;
  std::shared_ptr<flame::nn::Linear> q_proj_, k_proj_, v_proj_, out_proj_;
};

class ClipMlp : public flame::nn::Module {
 public:
  ClipMlp(const ClipTextConfig& c, flame::TensorOptions opts);
  std::string name() const override { return "CLIPMLP"; }
  flame::Tensor forward(const flame::Tensor& x) override;

 private:
  bool quick_gelu_;
  std::shared_ptr<flame::nn::Linear> fc1_, fc2_;
};

class ClipEncoderLayer : public flame::nn::Module {
 public:
  ClipEncoderLayer(const ClipTextConfig& c, flame::TensorOptions opts);
  std::string name() const override { return "CLIPEncoderLayer"; }
  flame::Tensor run(const flame::Tensor& x, const flame::Tensor& mask);

 private:
  std::shared_ptr<ClipAttention> self_attn_;
  std::shared_ptr<flame::nn::LayerNorm> layer_norm1_, layer_norm2_;
  std::shared_ptr<ClipMlp> mlp_;
};

// text_model.*: embeddings, encoder.layers, final_layer_norm.
class ClipTextTransformer : public flame::nn::Module {
 public:
  ClipTextTransformer(const ClipTextConfig& c, flame::TensorOptions opts);
  std::string name() const override { return "CLIPTextTransformer"; }
  ClipTextOutput run(const flame::Tensor& input_ids, const ClipEncodeOptions& options);

 private:
  ClipTextConfig config_;
  std::shared_ptr<flame::nn::Module> embeddings_;
  std::shared_ptr<flame::nn::Embedding> token_embedding_, position_embedding_;
  std::vector<std::shared_ptr<ClipEncoderLayer>> layers_;
  std::shared_ptr<flame::nn::LayerNorm> final_layer_norm_;
};

class ClipTextModel : public flame::nn::Module {
 public:
  explicit ClipTextModel(const ClipTextConfig& config, flame::TensorOptions opts = {});
  std::string name() const override {
    return config_.with_projection ? "CLIPTextModelWithProjection" : "CLIPTextModel";
  }
  std::string extra_repr() const override { return config_.to_string(); }

  const ClipTextConfig& config() const { return config_; }
  flame::DType dtype() const;
  flame::Device device() const;

  // Note [CLIP text encoder]. ids are moved to the model's device.
  ClipTextOutput encode(const flame::Tensor& input_ids, const ClipEncodeOptions& options = {});
  // last_hidden_state of encode(ids).
  flame::Tensor forward(const flame::Tensor& input_ids) override;

 private:
  ClipTextConfig config_;
  std::shared_ptr<ClipTextTransformer> text_model_;
  std::shared_ptr<flame::nn::Linear> text_projection_;  // null without projection
};

// The pooling rule of Note [CLIP text encoder]: the EOS position of each row of ids [B, L] (i64 [B]).
flame::Tensor clip_eos_positions(const flame::Tensor& input_ids, int64_t eos_token_id);

}  // namespace flame_diffusion::models
