#pragma once
// FluxTransformer2DModel: the FLUX.1 transformer (dev, schnell) as diffusers builds it, from one
// configuration struct (Note [FLUX layout]); its files are in flux_checkpoint.cpp.
//
//   auto config = flux_preset("flux-dev");             // or flux_config_from_file("transformer/config.json")
//   auto flux = load_flux("FLUX.1-dev", {.device = Device::cuda(), .dtype = DType::bf16});
//   Tensor x = pack_latents(latents);                  // [B, 16, H, W] -> [B, HW/4, 64]
//   Tensor v = flux->forward(x, t5_states, clip_pooled, t, flux_img_ids(H, W), flux_txt_ids(512), guidance);
//   Tensor out = unpack_latents(v, H, W);              // [B, 16, H, W]
//
// Note [FLUX layout]
// Parameter names are diffusers' state-dict keys (models/transformer_blocks.h, Note [DiT blocks]):
//   x_embedder (Linear in_channels -> D), context_embedder (joint_attention_dim -> D),
//   time_text_embed (timestep_embedder, guidance_embedder when guidance_embeds, text_embedder),
//   transformer_blocks.i (double stream): norm1 / norm1_context (AdaLayerNormZero), attn
//     (JointAttention with RMS QK-norm, context first), norm2 / norm2_context (LayerNorm, no affine,
//     eps 1e-6), ff / ff_context (gelu-tanh FeedForward): per stream
//       x = x + gate_msa * attn;  x = x + gate_mlp * ff(norm2(x) * (1 + scale_mlp) + shift_mlp)
//   single_transformer_blocks.i: norm (AdaLayerNormZeroSingle), proj_mlp (D -> 4D), attn (to_q,
//     to_k, to_v, norm_q, norm_k; no to_out), proj_out (5D -> D) on cat(attn, gelu_tanh(proj_mlp)),
//     over the joint sequence [text, image]: x = x + gate * proj_out(...)
//   norm_out (AdaLayerNormContinuous, no affine, eps 1e-6; scale then shift), proj_out (D -> p^2 *
//     out_channels).
// forward multiplies timestep and guidance by 1000 after casting them to the embedded image
// tokens' dtype (as diffusers). The rotary table (FluxPosEmbed over cat(txt_ids, img_ids)) is
// computed once per forward on the CPU in f64 and applied by FLAME ops (a fused rotary kernel is
// framework work). The single blocks keep one joint [text, image] stream (diffusers concatenates and
// splits in each block: the same values).
//
// LoRA: add_lora with PEFT's target_modules matching; the default {"to_q", "to_k", "to_v",
// "to_out.0"} adapts the four projections of every double block's attention and to_q/to_k/to_v of
// every single block (whose attention has no to_out), which is what PEFT does with those targets.
//
// Gradient checkpointing: set_gradient_checkpointing(n) runs the first n blocks (double blocks
// first, then single) under flame::checkpoint while grad mode is on: only each block's inputs are
// kept and its forward runs again in the backward (BlockStack::set_activation_offload moves those
// inputs to host memory, or what the first blocks save whether checkpointed or not). n = kAllFluxBlocks (or any n >= the block count)
// checkpoints every block, as diffusers' enable_gradient_checkpointing; 0 turns it off.
//
// Block swapping and VRAM budgets: the model is a BlockStack (block_budget.h) over the 19 + 38
// blocks in that order; enable_block_swap / fit_vram_budget keep the swapped blocks' frozen weights
// in host memory.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <flame/flame.h>
#include <flame/nn.h>

#include "models/block_budget.h"
#include "models/checkpoint.h"
#include "models/transformer_blocks.h"

namespace flame_diffusion::models {

struct FluxTransformerConfig {
  int64_t patch_size = 1;
  int64_t in_channels = 64;
  int64_t out_channels = 0;  // 0: in_channels
  int64_t num_layers = 19;
  int64_t num_single_layers = 38;
  int64_t attention_head_dim = 128;
  int64_t num_attention_heads = 24;
  int64_t joint_attention_dim = 4096;
  int64_t pooled_projection_dim = 768;
  bool guidance_embeds = false;
  std::vector<int64_t> axes_dims_rope = {16, 56, 56};
  double rope_theta = 10000.0;  // diffusers fixes it; kept here for the table

  int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  int64_t output_channels() const { return out_channels > 0 ? out_channels : in_channels; }
  // Raises flame::Error naming the field and values when inconsistent (the rope axes must sum to
  // attention_head_dim, each even; positive sizes).
  void validate() const;
};

// "flux-dev" (guidance_embeds), "flux-schnell", "flux-dev-d2" (flux-dev's widths, 2 double + 2
// single blocks: fast GPU parity), "tiny-flux" (2 double + 2 single blocks, 2 heads x 8, rope axes
// (2, 2, 4), in_channels 16, joint_attention_dim 24, pooled 12, guidance: the CPU references).
// Other names raise listing these.
FluxTransformerConfig flux_preset(const std::string& name);
std::vector<std::string> flux_preset_names();
// A diffusers config.json (FluxTransformer2DModel); unknown architecture-changing values raise.
FluxTransformerConfig flux_config_from_json(const JsonConfig& json);
FluxTransformerConfig flux_config_from_file(const std::string& path);

// [B, C, H, W] (H, W even) -> [B, (H/2)(W/2), 4C], each 2x2 patch flattened channel-major (c, dy,
// dx), patches in row-major order: diffusers' FluxPipeline._pack_latents.
Tensor pack_latents(const Tensor& latents);
// The inverse: [B, (H/2)(W/2), 4C] -> [B, C, H, W] for the latent height and width H, W.
Tensor unpack_latents(const Tensor& packed, int64_t height, int64_t width);
// Position ids of the packed image tokens for latents H x W (even): [(H/2)(W/2), 3] f32 rows
// (0, row, col) (FluxPipeline._prepare_latent_image_ids).
Tensor flux_img_ids(int64_t height, int64_t width, flame::Device device = flame::Device::cpu());
// Text position ids: zeros [T, 3] f32.
Tensor flux_txt_ids(int64_t length, flame::Device device = flame::Device::cpu());

class FluxTransformerBlock : public flame::nn::Module {
 public:
  FluxTransformerBlock(int64_t dim, int64_t heads, int64_t head_dim, TensorOptions opts = {});
  std::string name() const override { return "FluxTransformerBlock"; }
  using flame::nn::Module::forward;
  // {encoder_hidden_states, hidden_states} after the block.
  std::pair<Tensor, Tensor> forward(const Tensor& hidden, const Tensor& encoder, const Tensor& temb,
                                    const RotaryEmbedding& rope);
  std::shared_ptr<AdaLayerNormZero> norm1, norm1_context;
  std::shared_ptr<JointAttention> attn;
  std::shared_ptr<flame::nn::LayerNorm> norm2, norm2_context;
  std::shared_ptr<GeluFeedForward> ff, ff_context;
};

class FluxSingleTransformerBlock : public flame::nn::Module {
 public:
  FluxSingleTransformerBlock(int64_t dim, int64_t heads, int64_t head_dim, TensorOptions opts = {});
  std::string name() const override { return "FluxSingleTransformerBlock"; }
  using flame::nn::Module::forward;
  // x: the joint [text, image] stream [B, T + N, dim] -> the same shape.
  Tensor forward(const Tensor& x, const Tensor& temb, const RotaryEmbedding& rope);
  std::shared_ptr<AdaLayerNormZeroSingle> norm;
  std::shared_ptr<flame::nn::Linear> proj_mlp, proj_out;
  std::shared_ptr<JointAttention> attn;
};

inline constexpr int64_t kAllFluxBlocks = -1;

class FluxTransformer2DModel : public flame::nn::Module, public BlockStack {
 public:
  // Weights drawn as PyTorch's defaults for each layer, in opts' dtype and device. Validates the
  // config.
  explicit FluxTransformer2DModel(const FluxTransformerConfig& config, TensorOptions opts = {});
  std::string name() const override { return "FluxTransformer2DModel"; }
  std::string extra_repr() const override;
  using flame::nn::Module::forward;
  // hidden_states [B, N, in_channels] (packed latents), encoder_hidden_states [B, T,
  // joint_attention_dim], pooled_projections [B, pooled_projection_dim], timestep [B] (in [0, 1]:
  // scaled by 1000 inside), img_ids [N, 3], txt_ids [T, 3] ([1, N, 3] / [1, T, 3] accepted),
  // guidance [B] (required exactly when guidance_embeds) -> [B, N, patch^2 * out_channels] in the
  // dtype of the embedded tokens.
  Tensor forward(const Tensor& hidden_states, const Tensor& encoder_hidden_states, const Tensor& pooled_projections,
                 const Tensor& timestep, const Tensor& img_ids, const Tensor& txt_ids, const Tensor& guidance = {});

  // Checkpoints the first `num_blocks` blocks (Note [FLUX layout]); kAllFluxBlocks: every block.
  void set_gradient_checkpointing(int64_t num_blocks);
  int64_t gradient_checkpointing_blocks() const { return checkpoint_blocks_; }
  int64_t num_blocks() const { return config_.num_layers + config_.num_single_layers; }
  // BlockStack: the double blocks, then the single ones.
  std::vector<flame::nn::ModulePtr> stack_blocks() const override;
  void set_checkpointed_blocks(int64_t n) override { set_gradient_checkpointing(n); }
  int64_t checkpointed_blocks() const override { return checkpoint_blocks_; }
  // Activation offload: BlockStack::set_activation_offload (over the stack's first blocks).

  // Rank-r LoRA on every module named in `targets` (PEFT's matching, diffusers' names):
  // nn::apply_lora, which freezes everything else. Returns the modules adapted.
  std::vector<std::string> add_lora(const flame::nn::LoraOptions& options,
                                    const std::vector<std::string>& targets = lora_default_targets());
  static std::vector<std::string> lora_default_targets() { return {"to_q", "to_k", "to_v", "to_out.0"}; }

  const FluxTransformerConfig& config() const { return config_; }

  std::shared_ptr<CombinedTimestepTextProjEmbeddings> time_text_embed;
  std::shared_ptr<flame::nn::Linear> context_embedder, x_embedder, proj_out;
  std::shared_ptr<flame::nn::ModuleList> transformer_blocks, single_transformer_blocks;
  std::shared_ptr<AdaLayerNormContinuous> norm_out;

 private:
  // The rotary tables of the last forward's ids: computed on the host (Note [DiT blocks]), which
  // reads the ids back, so a step that repeats them (training at one resolution, a sampling loop,
  // a step captured into a CUDA graph) reuses them while the ids are the same tensors, unwritten.
  RotaryEmbedding rotary_for(const Tensor& txt_ids, const Tensor& img_ids, flame::Device device);

  FluxTransformerConfig config_;
  int64_t checkpoint_blocks_ = 0;
  struct RotaryCache {
    Tensor txt_ids, img_ids;  // held: the identity is the tensor, not a reused address
    uint64_t txt_version = 0, img_version = 0;
    Tensor host_ids;  // the [T + N, 3] f32 ids the table was made from (new tensors of equal ids reuse it)
    RotaryEmbedding rope;
  } rotary_cache_;
};

// ---- files (flux_checkpoint.cpp) ----
// Formats of kind "flux": "flux-diffusers" (diffusers names, bare), "flux-original" (BFL names:
// double_blocks.N.img_attn.qkv, single_blocks.N.linear1, final_layer.adaLN_modulation.1 ... bare,
// or under ComfyUI's "model.diffusion_model."). Either may store F8_E4M3 weights (read upcast);
// an fp8-scaled file (a "scaled_fp8" marker, per-weight ".scale_weight") is dequantised as loaded.

// The BFL layout onto diffusers names for the blocks present in the stored keys under `prefix`.
KeyPlan flux_original_plan(const Checkpoint& ck, const std::string& prefix);

struct FluxLoadOptions {
  flame::Device device = flame::Device::cpu();
  flame::DType dtype = flame::DType::f32;
  // The architecture: `config` when set, else `config_json` (a path), else the diffusers folder's
  // config.json, else the preset `family`, else read from the stored shapes (depths, widths,
  // guidance; the rope axes are FLUX.1's (16, 56, 56) for head dim 128, otherwise an error asks for
  // a config).
  std::optional<FluxTransformerConfig> config;
  std::string config_json;
  std::string family;
  std::string variant;          // diffusers folders: "fp16" prefers the .fp16 weights
  bool allow_unplaced = false;  // tolerate stored keys that map to no parameter
  // Load every Linear as a frozen 8-bit weight (LoadCheckpointOptions::float8): fp8 files keep
  // their codes, other files are quantised as they load. For LoRA training on an 8-bit base.
  std::optional<flame::nn::Float8Options> float8;
};

struct FluxFileInfo {
  std::string description;  // Checkpoint::description()
  std::string format;       // "flux-diffusers" or "flux-original"
  std::string prefix;       // stored-key prefix ("model.diffusion_model.", "")
  std::string family;       // "flux-dev" / "flux-schnell" when the shapes match them, else "flux"
  bool fp8 = false;         // some weight is stored F8_E4M3 / F8_E5M2
  bool fp8_scaled = false;  // the "scaled_fp8" marker is present
  FluxTransformerConfig config;
};
FluxFileInfo inspect_flux(const Checkpoint& ck, const FluxLoadOptions& options = {});
// A diffusers folder (or pipeline folder: transformer/) or a .safetensors file.
std::shared_ptr<FluxTransformer2DModel> load_flux(const std::string& path, const FluxLoadOptions& options = {});
std::shared_ptr<FluxTransformer2DModel> load_flux(const Checkpoint& ck, const FluxLoadOptions& options = {});
void register_flux_formats();

}  // namespace flame_diffusion::models
