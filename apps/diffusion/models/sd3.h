#pragma once
// SD3Transformer2DModel: the MMDiT of Stable Diffusion 3 / 3.5 as diffusers builds it, from one
// configuration struct (Note [SD3 layout]).
//
//   auto sd3 = models::load_sd3("/models/sd3.5-large", {.device = Device::cuda(), .dtype = DType::bf16});
//   Tensor v = sd3->forward(latents, prompt_embeds, pooled_prompt_embeds, t);   // [B, 16, H, W]
//
// Note [SD3 layout]
// Parameter names are diffusers' state-dict keys, so a diffusers transformer/ folder loads key for
// key; the SD3/SD3.5 single files (joint_blocks.N.x_block...) go through sd3_original_plan
// (sd3_checkpoint.cpp). With D = heads x head_dim (the width):
//   pos_embed           PatchEmbed: proj (Conv2d in -> D, kernel = stride = patch) and the buffer
//                       pos_embed [1, M*M, D] (M = pos_embed_max_size: a 2-d sin-cos table), of
//                       which the centred h x w window of patches is added (the "crop")
//   time_text_embed     timestep_embedder(sinusoids(t, 256, cos first)) + text_embedder(pooled):
//                       both linear_2(silu(linear_1(.)))
//   context_embedder    Linear joint_attention_dim -> D on the text tokens
//   transformer_blocks  JointTransformerBlock x num_layers: norm1 = AdaLayerNormZero (linear D ->
//                       6D: shift, scale, gate of attention; shift, scale, gate of the MLP), or
//                       SD3.5's AdaLayerNormZeroX in dual_attention_layers (9D: + shift, scale,
//                       gate of attn2, a self-attention of the image tokens alone on the same
//                       normalised input); norm1_context the same for the text stream (6D), and
//                       in the last block (context_pre_only) an AdaLayerNormContinuous (2D: scale,
//                       shift) with no text attention output, MLP or norm2_context after it.
//                       attn: joint attention over [image tokens, text tokens] (to_q/k/v on the
//                       image, add_{q,k,v}_proj on the text, to_out.0 and to_add_out back), with
//                       SD3.5's RMS norm of each head's q and k (norm_q, norm_k, norm_added_q,
//                       norm_added_k; eps 1e-6) when qk_norm is "rms_norm"; ff / ff_context:
//                       net.0.proj, gelu (tanh), net.2 (x4 width). LayerNorms: eps 1e-6, no affine.
//   norm_out, proj_out  AdaLayerNormContinuous (scale, shift), Linear D -> patch^2 x out_channels,
//                       unpatchified to [B, out, H, W]
//
// Gradient checkpointing (set_gradient_checkpointing): the chosen number of blocks, from the first,
// run under flame::checkpoint while grad mode is on (diffusers checkpoints every block), so only
// their inputs are kept and each one's forward runs again in the backward. With activation offload
// (BlockStack::set_activation_offload) those kept inputs go to pinned host memory while the forward
// runs (flame::offload::OffloadActivations over the checkpointed blocks: nothing else is saved
// there), or what the first blocks save whether checkpointed or not, and come back, prefetched one
// ahead, in the backward.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <flame/flame.h>
#include <flame/nn.h>

#include "models/block_budget.h"
#include "models/checkpoint.h"
#include "models/transformer_blocks.h"

namespace flame_diffusion::models {

using flame::Tensor;
using flame::TensorOptions;

struct SD3TransformerConfig {
  int64_t sample_size = 128;  // latent size the position table was laid out for (its base size)
  int64_t patch_size = 2;
  int64_t in_channels = 16;
  int64_t num_layers = 18;
  int64_t attention_head_dim = 64;
  int64_t num_attention_heads = 18;
  int64_t joint_attention_dim = 4096;
  int64_t caption_projection_dim = 1152;  // must equal the width (heads x head_dim)
  int64_t pooled_projection_dim = 2048;
  int64_t out_channels = 16;
  int64_t pos_embed_max_size = 96;
  std::vector<int64_t> dual_attention_layers;  // SD3.5-Medium: 0..12
  std::string qk_norm;                         // "" or "rms_norm" (SD3.5)

  int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  bool dual_attention(int64_t layer) const;
  // Raises flame::Error naming the field and the values when the configuration is inconsistent.
  void validate() const;
};

// "sd3-medium", "sd3.5-medium", "sd3.5-large" (the published diffusers configs); others raise,
// listing these.
SD3TransformerConfig sd3_preset(const std::string& name);
// A diffusers transformer/config.json (SD3Transformer2DModel). `source` names it in messages.
SD3TransformerConfig sd3_config_from_json(const JsonConfig& json);
SD3TransformerConfig sd3_config_from_file(const std::string& path);

// diffusers' get_2d_sincos_pos_embed(dim, grid, base_size) as f32 [grid * grid, dim]: for the
// patch at (row, col), the first dim/2 values encode col * base_size / grid, the rest row *
// base_size / grid, each as [sin(p w_i), cos(p w_i)] with w_i = 10000^(-i / (dim / 4)), computed in
// f64 as diffusers does.
Tensor sd3_sincos_pos_embed(int64_t dim, int64_t grid, int64_t base_size);

class SD3PatchEmbed : public flame::nn::Module {
 public:
  SD3PatchEmbed(const SD3TransformerConfig& c, TensorOptions opts = {});
  std::string name() const override { return "PatchEmbed"; }
  // latent [B, in, H, W] -> [B, (H/p) * (W/p), D] + the centred crop of the position table.
  Tensor forward(const Tensor& latent) override;
  std::shared_ptr<flame::nn::Conv2d> proj;
  Tensor pos_embed;  // [1, M * M, D]

 private:
  int64_t patch_, max_size_;
};

// SD3.5's SD35AdaLayerNormZeroX (norm1 of a dual-attention block): linear(SiLU(emb)) -> 9 chunks,
// AdaLayerNormZero's six then shift, scale, gate of attn2, whose input is the same LayerNorm of x
// modulated by its own shift and scale.
struct AdaLayerNormZeroXOutput {
  AdaLayerNormZeroOutput base;
  Tensor x2, gate_msa2;  // attn2's modulated input [B, L, dim] and gate [B, dim]
};
class SD35AdaLayerNormZeroX : public flame::nn::Module {
 public:
  SD35AdaLayerNormZeroX(int64_t embedding_dim, TensorOptions opts = {});
  std::string name() const override { return "SD35AdaLayerNormZeroX"; }
  using flame::nn::Module::forward;
  AdaLayerNormZeroXOutput forward(const Tensor& x, const Tensor& emb);
  std::shared_ptr<flame::nn::Linear> linear;
};

// diffusers' JointTransformerBlock, built from the shared DiT pieces (transformer_blocks.h).
class SD3JointTransformerBlock : public flame::nn::Module {
 public:
  SD3JointTransformerBlock(int64_t dim, int64_t heads, int64_t head_dim, bool context_pre_only, bool qk_norm,
                           bool dual_attention, TensorOptions opts = {});
  std::string name() const override { return "JointTransformerBlock"; }
  using flame::nn::Module::forward;
  // x [B, L, D], context [B, S, D], temb [B, D] -> {x, context} (context undefined when
  // context_pre_only).
  std::pair<Tensor, Tensor> forward(const Tensor& x, const Tensor& context, const Tensor& temb);
  bool context_pre_only() const { return context_pre_only_; }
  // "norm1": AdaLayerNormZero, or SD35AdaLayerNormZeroX in a dual-attention block (the other null).
  std::shared_ptr<AdaLayerNormZero> norm1;
  std::shared_ptr<SD35AdaLayerNormZeroX> norm1_dual;
  // "norm1_context": AdaLayerNormZero, or AdaLayerNormContinuous when context_pre_only (the other null).
  std::shared_ptr<AdaLayerNormZero> norm1_context;
  std::shared_ptr<AdaLayerNormContinuous> norm1_context_final;
  std::shared_ptr<JointAttention> attn, attn2;      // attn2 null unless dual attention
  std::shared_ptr<GeluFeedForward> ff, ff_context;  // ff_context null when context_pre_only

 private:
  bool context_pre_only_;
};

// Block swapping and VRAM budgets: a BlockStack (block_budget.h) over transformer_blocks.
class SD3Transformer2DModel : public flame::nn::Module, public BlockStack {
 public:
  // Weights drawn as PyTorch's defaults for each layer, the position table as diffusers computes
  // it, in opts' dtype and device. Validates the config.
  explicit SD3Transformer2DModel(const SD3TransformerConfig& config, TensorOptions opts = {});
  std::string name() const override { return "SD3Transformer2DModel"; }
  std::string extra_repr() const override;
  using flame::nn::Module::forward;
  // hidden_states [B, in_channels, H, W] (H, W multiples of the patch, H/p and W/p at most
  // pos_embed_max_size); encoder_hidden_states [B, S, joint_attention_dim]; pooled_projections
  // [B, pooled_projection_dim]; timestep [B], [1] or 0-d (any numeric dtype; SD3 uses sigma x
  // 1000) -> [B, out_channels, H, W] in hidden_states' dtype.
  Tensor forward(const Tensor& hidden_states, const Tensor& encoder_hidden_states, const Tensor& pooled_projections,
                 const Tensor& timestep);

  // Per-block gradient checkpointing of the first `blocks` blocks (-1: all, as diffusers'
  // enable_gradient_checkpointing; 0 or on = false: none).
  void set_gradient_checkpointing(bool on, int64_t blocks = -1);
  int64_t checkpointed_blocks() const override { return checkpointed_; }
  // BlockStack
  std::vector<flame::nn::ModulePtr> stack_blocks() const override;
  void set_checkpointed_blocks(int64_t n) override { set_gradient_checkpointing(n != 0, n); }
  // Activation offload: BlockStack::set_activation_offload (over the stack's first blocks).

  // Rank-r LoRA on every attention projection named in `targets` (PEFT's target_modules matching
  // on diffusers' names: to_q, to_k, to_v, to_out.0 of attn and of SD3.5's attn2, not the text
  // stream's add_*_proj / to_add_out): nn::apply_lora, which freezes everything else.
  std::vector<std::string> add_lora(const flame::nn::LoraOptions& options,
                                    const std::vector<std::string>& targets = lora_default_targets());
  static std::vector<std::string> lora_default_targets() { return {"to_q", "to_k", "to_v", "to_out.0"}; }

  const SD3TransformerConfig& config() const { return config_; }

  std::shared_ptr<SD3PatchEmbed> pos_embed;
  std::shared_ptr<CombinedTimestepTextProjEmbeddings> time_text_embed;
  std::shared_ptr<flame::nn::Linear> context_embedder;
  std::shared_ptr<flame::nn::ModuleList> transformer_blocks;
  std::shared_ptr<AdaLayerNormContinuous> norm_out;
  std::shared_ptr<flame::nn::Linear> proj_out;

 private:
  SD3TransformerConfig config_;
  int64_t checkpointed_ = 0;
};

// ---- files (sd3_checkpoint.cpp) ----
// The prefix of the transformer in SD3/SD3.5 single files and ComfyUI checkpoints.
inline constexpr const char* kSD3OriginalPrefix = "model.diffusion_model.";

// The plan of the original MMDiT layout (joint_blocks.N.{x_block,context_block}.*, x_embedder,
// pos_embed, t_embedder, y_embedder, context_embedder, final_layer) under `prefix`, from the key
// names alone: qkv split in three, ln_q/ln_k to norm_q/norm_k (norm_added_* for the context
// block), the final layer's and the last context block's adaLN_modulation halves swapped; fp8
// "scale_weight"s applied, "scaled_fp8"/"scale_input" markers ignored.
KeyPlan sd3_original_plan(const Checkpoint& ck, const std::string& prefix);
// The configuration a single file holds, from its shapes: depth (joint_blocks), width
// (context_embedder), heads (the QK norm's size is the head size; without one, heads = depth as
// in the original MMDiT), position table size, patch and
// channels, qk_norm (ln_q keys), dual attention layers (attn2 keys).
SD3TransformerConfig sd3_config_from_original(const Checkpoint& ck, const std::string& prefix);
// "sd3-medium", "sd3.5-medium", "sd3.5-large" when `c` is one of the presets' architectures, else
// "custom".
std::string sd3_family_of(const SD3TransformerConfig& c);

struct SD3LoadOptions {
  flame::Device device = flame::Device::cpu();
  flame::DType dtype = flame::DType::f32;
  // The architecture: `config` when set, else `config_json` (a path), else the diffusers folder's
  // config.json, else (a single file) read from the file's shapes.
  std::optional<SD3TransformerConfig> config;
  std::string config_json;
  std::string variant;          // diffusers folders: "fp16" prefers the .fp16 weights
  bool allow_unplaced = false;  // tolerate stored transformer keys that map to no parameter
  // Load every Linear as a frozen 8-bit weight (LoadCheckpointOptions::float8): fp8 files keep
  // their codes, other files are quantised as they load. For LoRA training on an 8-bit base.
  std::optional<flame::nn::Float8Options> float8;
};

struct SD3FileInfo {
  std::string description;  // Checkpoint::description()
  std::string format;       // "sd3-diffusers" or "sd3-original"
  std::string prefix;       // stored-key prefix ("model.diffusion_model.", "")
  std::string family;       // sd3_family_of(config)
  bool fp8 = false;         // some transformer tensor is stored F8_E4M3 / F8_E5M2
  SD3TransformerConfig config;
};
SD3FileInfo inspect_sd3(const Checkpoint& ck, const SD3LoadOptions& options = {});
// A folder (diffusers model folder, or pipeline folder: transformer/) or a .safetensors file.
std::shared_ptr<SD3Transformer2DModel> load_sd3(const std::string& path, const SD3LoadOptions& options = {});
std::shared_ptr<SD3Transformer2DModel> load_sd3(const Checkpoint& ck, const SD3LoadOptions& options = {});
// Makes sure the SD3 formats are registered (load_sd3 calls it).
void register_sd3_formats();

}  // namespace flame_diffusion::models
