#pragma once
// UNet2DConditionModel: the Stable Diffusion UNet (SD 1.x, SD 2.x, SDXL) as diffusers builds it,
// from one configuration struct (Note [UNet2D layout]).
//
//   auto config = unet2d_preset("sdxl");                 // or unet2d_config_from_file("unet/config.json")
//   auto unet = std::make_shared<UNet2DConditionModel>(config, TensorOptions(DType::bf16, Device::cuda()));
//   unet->load_state_dict(io::load_safetensors("unet/diffusion_pytorch_model.safetensors", Device::cuda(), DType::bf16));
//   Tensor eps = unet->forward(latents, t, text_states, {.text_embeds = pooled, .time_ids = ids});
//
// Note [UNet2D layout]
// Parameter names are diffusers' state-dict keys, in diffusers' order (conv_in, time_embedding,
// add_embedding, down_blocks, up_blocks, mid_block, conv_norm_out, conv_out: up_blocks is
// registered before mid_block, as in diffusers), so a diffusers file loads key for key; the
// original single-file layout (model.diffusion_model.input_blocks...) goes through
// unet_original_plan (unet2d_convert.cpp). The blocks:
//   ResnetBlock2D       norm1 (GroupNorm) SiLU conv1 (3x3) + time_emb_proj(SiLU(temb)), norm2 SiLU
//                       dropout conv2, + x (conv_shortcut, 1x1, when the channel count changes)
//   Transformer2DModel  norm (GroupNorm, eps 1e-6), proj_in (Linear, or 1x1 Conv2d when
//                       use_linear_projection is false), transformer_blocks, proj_out, + x
//   BasicTransformerBlock  x + attn1(norm1(x)); x + attn2(norm2(x), context); x + ff(norm3(x))
//                       (LayerNorm eps 1e-5; to_q/to_k/to_v without bias, to_out.0 with bias;
//                       ff.net.0.proj -> GEGLU (h * gelu(gate), erf gelu) -> ff.net.2)
//   down block i        resnets (+ attentions), downsamplers.0.conv (3x3, stride 2) unless last
//   mid_block           resnets.0, attentions.0, resnets.1
//   up block i          layers_per_block + 1 resnets on cat(h, skip), (+ attentions),
//                       upsamplers.0.conv after nearest x2, unless last
// Heads: diffusers' `attention_head_dim` is the head COUNT of each block (its naming quirk); the
// head dim is channels / heads (SDXL: 64 everywhere). Up blocks take the reversed per-block lists.
//
// Gradient checkpointing (set_gradient_checkpointing): each ResnetBlock2D and each
// BasicTransformerBlock runs under flame::checkpoint while grad mode is on (diffusers checkpoints
// the same units), so only block inputs are kept and each block's forward is run again in the
// backward.
//
// Cheap recompute (set_recompute_cheap): the forward runs under flame::autograd::RecomputeCheap
// (docs/recompute.md), so the tensors saved for the backward that are outputs of one cheap op are
// kept as that op's recipe and redone in the backward: in each BasicTransformerBlock the outputs of
// norm1 and norm2 (saved by the LoRA A layers of to_q/to_k/to_v) and the GEGLU's gelu(gate) (saved
// by its product), in each ResnetBlock2D the GroupNorm outputs (saved by SiLU), and conv_norm_out's.
// The gradients are the same values (the same kernels on the same inputs); off by default.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <flame/flame.h>
#include <flame/nn.h>

namespace flame_diffusion::models {

using flame::Tensor;
using flame::TensorOptions;

struct UNet2DConditionConfig {
  int64_t sample_size = 64;  // latent size the model was trained at (informational)
  int64_t in_channels = 4;
  int64_t out_channels = 4;
  bool center_input_sample = false;
  bool flip_sin_to_cos = true;
  double freq_shift = 0.0;
  // "DownBlock2D" / "CrossAttnDownBlock2D"; "UpBlock2D" / "CrossAttnUpBlock2D".
  std::vector<std::string> down_block_types;
  std::string mid_block_type = "UNetMidBlock2DCrossAttn";  // or "" (no mid block)
  std::vector<std::string> up_block_types;
  std::vector<int64_t> block_out_channels;
  // Per down block (a diffusers int is repeated); the up blocks take them reversed.
  std::vector<int64_t> layers_per_block;
  std::vector<int64_t> transformer_layers_per_block;
  std::vector<int64_t> cross_attention_dim;
  std::vector<int64_t> attention_heads;  // diffusers' attention_head_dim: heads per block
  int64_t downsample_padding = 1;
  double mid_block_scale_factor = 1.0;
  int64_t norm_num_groups = 32;
  double norm_eps = 1e-5;
  bool use_linear_projection = false;
  bool upcast_attention = false;  // accepted; SDPA accumulates in f32 whatever the dtype
  double dropout = 0.0;
  // "" or "text_time" (SDXL): time ids, each embedded to addition_time_embed_dim sinusoids, are
  // concatenated after the pooled text embedding (projection_class_embeddings_input_dim in all).
  std::string addition_embed_type;
  int64_t addition_time_embed_dim = 0;
  int64_t projection_class_embeddings_input_dim = 0;
  int64_t conv_in_kernel = 3;
  int64_t conv_out_kernel = 3;

  int64_t time_embed_dim() const { return block_out_channels.at(0) * 4; }
  int64_t num_blocks() const { return static_cast<int64_t>(block_out_channels.size()); }
  // Raises flame::Error naming the field and the values when the configuration is inconsistent
  // (list lengths, channels not divisible by groups or heads, unknown block types).
  void validate() const;
};

// "sdxl" (SDXL base 1.0), "sd15" (SD 1.5), "sd21" (SD 2.1); other names raise listing these.
UNet2DConditionConfig unet2d_preset(const std::string& name);
// A diffusers config.json (UNet2DConditionModel). Keys that change the architecture to something
// this implementation does not build (class embeddings, encoder_hid_proj, scale_shift time norm,
// fourier time embedding, ...) raise an error naming the key and its value; `source` names the
// file in messages.
UNet2DConditionConfig unet2d_config_from_json(const std::string& json_text, const std::string& source = "config.json");
UNet2DConditionConfig unet2d_config_from_file(const std::string& path);

// Sinusoidal embedding of timesteps [N] (any numeric dtype) -> [N, dim] f32, as diffusers'
// get_timestep_embedding: exponent_i = -ln(10000) * i / (dim / 2 - freq_shift), emb = t * exp(.),
// [sin, cos] (or [cos, sin] when flip_sin_to_cos), zero-padded when dim is odd.
Tensor timestep_embedding(const Tensor& timesteps, int64_t dim, bool flip_sin_to_cos, double freq_shift);

class TimestepEmbedding : public flame::nn::Module {
 public:
  TimestepEmbedding(int64_t in_channels, int64_t time_embed_dim, TensorOptions opts = {});
  std::string name() const override { return "TimestepEmbedding"; }
  Tensor forward(const Tensor& x) override;  // linear_2(silu(linear_1(x)))
  std::shared_ptr<flame::nn::Linear> linear_1, linear_2;
};

class ResnetBlock2D : public flame::nn::Module {
 public:
  ResnetBlock2D(int64_t in_channels, int64_t out_channels, int64_t temb_channels, int64_t groups, double eps,
                double dropout, double output_scale_factor, TensorOptions opts = {});
  std::string name() const override { return "ResnetBlock2D"; }
  using flame::nn::Module::forward;
  Tensor forward(const Tensor& x, const Tensor& temb);  // x [B, in, H, W], temb [B, temb_channels]
  std::shared_ptr<flame::nn::GroupNorm> norm1, norm2;
  std::shared_ptr<flame::nn::Conv2d> conv1, conv2, conv_shortcut;  // conv_shortcut null when in == out
  std::shared_ptr<flame::nn::Linear> time_emb_proj;
  std::shared_ptr<flame::nn::Dropout> dropout;

 private:
  double output_scale_factor_;
};

// diffusers' Attention with its default processor: to_q/to_k/to_v (no bias), SDPA over heads,
// to_out.0 (bias) and to_out.1 (dropout).
class Attention : public flame::nn::Module {
 public:
  // cross_attention_dim 0: self-attention (keys and values from the query input).
  Attention(int64_t query_dim, int64_t cross_attention_dim, int64_t heads, int64_t dim_head, double dropout,
            TensorOptions opts = {});
  std::string name() const override { return "Attention"; }
  using flame::nn::Module::forward;
  // x [B, L, query_dim]; context [B, S, cross_attention_dim] (undefined: self-attention).
  Tensor forward(const Tensor& x, const Tensor& context);
  int64_t heads() const { return heads_; }
  std::shared_ptr<flame::nn::Linear> to_q, to_k, to_v;
  std::shared_ptr<flame::nn::ModuleList> to_out;  // [Linear, Dropout]

 private:
  int64_t heads_, dim_head_, kv_dim_;
};

// proj: Linear(dim_in, 2 * dim_out); out = h * gelu(gate) with [h, gate] = proj(x).chunk(2, -1).
class GEGLU : public flame::nn::Module {
 public:
  GEGLU(int64_t dim_in, int64_t dim_out, TensorOptions opts = {});
  std::string name() const override { return "GEGLU"; }
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<flame::nn::Linear> proj;
};

class FeedForward : public flame::nn::Module {
 public:
  FeedForward(int64_t dim, int64_t mult, double dropout, TensorOptions opts = {});
  std::string name() const override { return "FeedForward"; }
  Tensor forward(const Tensor& x) override;  // net.2(net.1(net.0(x)))
  std::shared_ptr<flame::nn::ModuleList> net;  // [GEGLU, Dropout, Linear]
};

class BasicTransformerBlock : public flame::nn::Module {
 public:
  BasicTransformerBlock(int64_t dim, int64_t heads, int64_t dim_head, int64_t cross_attention_dim, double dropout,
                        TensorOptions opts = {});
  std::string name() const override { return "BasicTransformerBlock"; }
  using flame::nn::Module::forward;
  Tensor forward(const Tensor& x, const Tensor& context);  // x [B, L, dim]
  std::shared_ptr<flame::nn::LayerNorm> norm1, norm2, norm3;
  std::shared_ptr<Attention> attn1, attn2;
  std::shared_ptr<FeedForward> ff;
};

class Transformer2DModel : public flame::nn::Module {
 public:
  Transformer2DModel(int64_t heads, int64_t dim_head, int64_t in_channels, int64_t num_layers,
                     int64_t cross_attention_dim, int64_t groups, bool use_linear_projection, double dropout,
                     TensorOptions opts = {});
  std::string name() const override { return "Transformer2DModel"; }
  using flame::nn::Module::forward;
  // x [B, C, H, W], context [B, S, cross_attention_dim] -> [B, C, H, W].
  Tensor forward(const Tensor& x, const Tensor& context);
  void set_gradient_checkpointing(bool on) { checkpointing_ = on; }
  std::shared_ptr<flame::nn::GroupNorm> norm;
  std::shared_ptr<flame::nn::Module> proj_in, proj_out;  // Linear or 1x1 Conv2d
  std::shared_ptr<flame::nn::ModuleList> transformer_blocks;

 private:
  bool linear_projection_;
  bool checkpointing_ = false;
};

class Downsample2D : public flame::nn::Module {
 public:
  Downsample2D(int64_t channels, int64_t padding, TensorOptions opts = {});
  std::string name() const override { return "Downsample2D"; }
  Tensor forward(const Tensor& x) override;  // conv (3x3, stride 2)
  std::shared_ptr<flame::nn::Conv2d> conv;

 private:
  int64_t padding_;
};

class Upsample2D : public flame::nn::Module {
 public:
  Upsample2D(int64_t channels, TensorOptions opts = {});
  std::string name() const override { return "Upsample2D"; }
  Tensor forward(const Tensor& x) override;  // conv(nearest x2)
  // Nearest to `size` ([H, W]) instead of x2 (the UNet passes it for latents that are not a
  // multiple of its total down factor).
  Tensor forward(const Tensor& x, const flame::Shape& size);
  std::shared_ptr<flame::nn::Conv2d> conv;
};

// DownBlock2D / CrossAttnDownBlock2D (name() says which).
class UNetDownBlock : public flame::nn::Module {
 public:
  UNetDownBlock(const UNet2DConditionConfig& c, int64_t index, int64_t in_channels, TensorOptions opts);
  std::string name() const override { return cross_ ? "CrossAttnDownBlock2D" : "DownBlock2D"; }
  using flame::nn::Module::forward;
  // Appends each resnet's (or resnet + attention's) output and the downsampler's to `skips`.
  Tensor forward(const Tensor& x, const Tensor& temb, const Tensor& context, std::vector<Tensor>& skips);
  void set_gradient_checkpointing(bool on);
  bool has_cross_attention() const { return cross_; }
  std::shared_ptr<flame::nn::ModuleList> resnets, attentions, downsamplers;  // attentions/downsamplers may be null

 private:
  bool cross_;
  bool checkpointing_ = false;
};

class UNetMidBlock2DCrossAttn : public flame::nn::Module {
 public:
  UNetMidBlock2DCrossAttn(const UNet2DConditionConfig& c, TensorOptions opts);
  std::string name() const override { return "UNetMidBlock2DCrossAttn"; }
  using flame::nn::Module::forward;
  Tensor forward(const Tensor& x, const Tensor& temb, const Tensor& context);
  void set_gradient_checkpointing(bool on);
  std::shared_ptr<flame::nn::ModuleList> attentions, resnets;

 private:
  bool checkpointing_ = false;
};

// UpBlock2D / CrossAttnUpBlock2D.
class UNetUpBlock : public flame::nn::Module {
 public:
  // index: position among the up blocks (0 = lowest resolution).
  UNetUpBlock(const UNet2DConditionConfig& c, int64_t index, TensorOptions opts);
  std::string name() const override { return cross_ ? "CrossAttnUpBlock2D" : "UpBlock2D"; }
  using flame::nn::Module::forward;
  // Pops one skip per resnet from the back of `skips`. upsample_size: [H, W] for the upsampler,
  // or empty for x2.
  Tensor forward(const Tensor& x, const Tensor& temb, const Tensor& context, std::vector<Tensor>& skips,
                 const flame::Shape& upsample_size);
  void set_gradient_checkpointing(bool on);
  bool has_cross_attention() const { return cross_; }
  int64_t num_resnets() const { return static_cast<int64_t>(resnets->size()); }
  std::shared_ptr<flame::nn::ModuleList> attentions, resnets, upsamplers;

 private:
  bool cross_;
  bool checkpointing_ = false;
};

// The added conditions of forward (diffusers' added_cond_kwargs); used when the config's
// addition_embed_type is "text_time".
struct UNet2DAddedConditions {
  Tensor text_embeds;  // [B, projection_class_embeddings_input_dim - N * addition_time_embed_dim]
  Tensor time_ids;     // [B, N] (SDXL: N = 6: original size, crop top-left, target size)
};

class UNet2DConditionModel : public flame::nn::Module {
 public:
  // Weights drawn as PyTorch's defaults for each layer (diffusers adds no init of its own), in
  // opts' dtype and device. Validates the config.
  explicit UNet2DConditionModel(const UNet2DConditionConfig& config, TensorOptions opts = {});
  std::string name() const override { return "UNet2DConditionModel"; }
  std::string extra_repr() const override;
  using flame::nn::Module::forward;
  // sample [B, in_channels, H, W]; timestep [B], [1] or 0-d (any numeric dtype, broadcast to B);
  // encoder_hidden_states [B, S, cross_attention_dim] -> noise prediction [B, out_channels, H, W]
  // in sample's dtype.
  Tensor forward(const Tensor& sample, const Tensor& timestep, const Tensor& encoder_hidden_states,
                 const UNet2DAddedConditions& added = {});

  // Per-block gradient checkpointing (diffusers' enable_gradient_checkpointing), for every block.
  void set_gradient_checkpointing(bool on);
  bool gradient_checkpointing() const { return checkpointing_; }

  // Forward under autograd::RecomputeCheap (Note [UNet2D layout], "Cheap recompute"). Off: the
  // forward leaves the thread's setting as the caller has it.
  void set_recompute_cheap(bool on) { recompute_cheap_ = on; }
  bool recompute_cheap() const { return recompute_cheap_; }

  // Rank-r LoRA on every attention projection named in `targets` (PEFT's target_modules
  // matching, diffusers' names): nn::apply_lora, which freezes everything else. Returns the
  // modules adapted. The adapters' state dict in PEFT's naming: nn::lora_state_dict(*unet).
  std::vector<std::string> add_lora(const flame::nn::LoraOptions& options,
                                    const std::vector<std::string>& targets = lora_default_targets());
  static std::vector<std::string> lora_default_targets() { return {"to_q", "to_k", "to_v", "to_out.0"}; }

  const UNet2DConditionConfig& config() const { return config_; }

  std::shared_ptr<flame::nn::Conv2d> conv_in, conv_out;
  std::shared_ptr<TimestepEmbedding> time_embedding, add_embedding;  // add_embedding: text_time only
  std::shared_ptr<flame::nn::ModuleList> down_blocks, up_blocks;
  std::shared_ptr<UNetMidBlock2DCrossAttn> mid_block;  // null when mid_block_type is ""
  std::shared_ptr<flame::nn::GroupNorm> conv_norm_out;

 private:
  Tensor time_and_added_embedding(const Tensor& sample, const Tensor& timestep, const UNet2DAddedConditions& added);

  UNet2DConditionConfig config_;
  bool checkpointing_ = false;
  bool recompute_cheap_ = false;
};

}  // namespace flame_diffusion::models
