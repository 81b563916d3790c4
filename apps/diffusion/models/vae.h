#pragma once
// AutoencoderKL: the VAE of SD 1.x/2.x, SDXL, SD3 and FLUX.1, one implementation with diffusers'
// parameter names (a diffusers state dict loads key for key; the original single-file layouts load
// through the plans of vae_checkpoint.cpp).
//
//   auto vae = models::load_vae("/models/sdxl/vae", {.device = Device::cuda(), .dtype = DType::bf16});
//   Tensor z = vae->encode_latent(images);          // images [N, 3, H, W] in [-1, 1] -> scaled latents
//   Tensor x = vae->decode_latent(z);               // back to images
//   auto dist = vae->encode(images);                // dist.mean / dist.logvar, dist.sample(&gen), dist.mode()
//
// Note [VAE dtypes]
// Parameters and computation share one dtype (the module's). encode/decode convert their input to
// it and give results in the input's dtype. The SDXL and SD 1.x VAEs overflow in f16 (activations
// past 65504 in the decoder's last blocks): their config.json says force_upcast, and
// vae_compute_dtype(f16, config) then answers f32, so load_vae(..., dtype = f16) keeps f32 weights
// and an f16 latent decodes in f32 to an f16 image (diffusers' pipelines upcast the same way).
// bf16 has f32's range and is used as asked. Attention is FLAME's SDPA over one head of C channels
// (512 in the real VAEs); the query rows are processed in chunks so the score matrix stays small.
//
// Layout: NCHW. A channels-last input is accepted (the convolutions keep it) but every GroupNorm of
// FLAME copies a channels-last input to contiguous, so the network runs NCHW after its first norm
// (docs/nn-norm.md); channels-last brings nothing here until group norm reads it natively.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <flame/flame.h>
#include <flame/nn.h>

#include "models/checkpoint.h"

namespace flame_diffusion::models {

struct VaeConfig {
  int64_t in_channels = 3;
  int64_t out_channels = 3;
  std::vector<int64_t> block_out_channels = {128, 256, 512, 512};
  int64_t layers_per_block = 2;
  int64_t latent_channels = 4;
  int64_t norm_num_groups = 32;
  int64_t sample_size = 512;  // diffusers' tile size default (pixels)
  bool use_quant_conv = true;
  bool use_post_quant_conv = true;
  bool mid_block_add_attention = true;
  double scaling_factor = 0.18215;
  std::optional<double> shift_factor;
  bool force_upcast = true;
  std::string family = "sd";  // "sd", "sdxl", "sd3", "flux" or "custom" (messages, tools)

  // The real configurations: "sd" (SD 1.x/2.x), "sdxl", "sd3" (SD3/3.5), "flux" (FLUX.1).
  static VaeConfig preset(const std::string& name);
  // A diffusers config.json. Errors name the file and key (wrong types, block types other than
  // DownEncoderBlock2D/UpDecoderBlock2D, act_fn other than silu, latents_mean/std which these
  // families do not use).
  static VaeConfig from_json(const JsonConfig& config);
  // Which preset these values are ("custom" when none): compares the architecture and scaling.
  std::string guess_family() const;
  // 2^(levels - 1): pixels per latent pixel.
  int64_t downscale() const { return int64_t{1} << (block_out_channels.size() - 1); }
  std::string to_string() const;
};

// The dtype to run a VAE in when `requested` is asked for (Note [VAE dtypes]).
flame::DType vae_compute_dtype(flame::DType requested, const VaeConfig& config);

// The VAE's latent scaling of a configuration (AutoencoderKL::to_latent without the module: a trainer
// that caches latents releases the VAE and keeps its configuration).
flame::Tensor vae_to_latent(const VaeConfig& config, const flame::Tensor& z);

// The latent distribution encode() gives: a diagonal Gaussian, logvar clamped to [-30, 20].
struct LatentDistribution {
  flame::Tensor mean, logvar;
  flame::Tensor std() const;  // exp(logvar / 2)
  flame::Tensor mode() const { return mean; }
  // mean + std * eps, eps ~ N(0, 1) drawn from `gen` (the default generator when null).
  flame::Tensor sample(flame::Generator* gen = nullptr) const;
};

// diffusers' tiling (AutoencoderKL.enable_tiling): tiles of `sample_tile` pixels (0: the config's
// sample_size) every sample_tile * (1 - overlap) pixels; each tile's output is blended linearly
// into its upper and left neighbours over `overlap` of the output tile and cropped.
struct TileOptions {
  int64_t sample_tile = 0;
  double overlap = 0.25;
};

// The stitching of diffusers' tiled encode/decode for any tile function: `fn` maps an input tile
// of up to in_tile pixels to an output tile `out_tile / in_tile` times its size. Exposed for tests.
flame::Tensor tiled_apply(const flame::Tensor& x, int64_t in_tile, int64_t out_tile, double overlap,
                          const std::function<flame::Tensor(const flame::Tensor&)>& fn);

// ---- the modules (names as diffusers') ----
class VaeResnetBlock : public flame::nn::Module {
 public:
  VaeResnetBlock(int64_t in_channels, int64_t out_channels, int64_t groups, flame::TensorOptions opts);
  std::string name() const override { return "ResnetBlock2D"; }
  flame::Tensor forward(const flame::Tensor& x) override;

 private:
  std::shared_ptr<flame::nn::GroupNorm> norm1_, norm2_;
  std::shared_ptr<flame::nn::Conv2d> conv1_, conv2_, conv_shortcut_;
};

// The mid block's self-attention: GroupNorm, one head over all channels, residual.
class VaeAttention : public flame::nn::Module {
 public:
  VaeAttention(int64_t channels, int64_t groups, flame::TensorOptions opts);
  std::string name() const override { return "Attention"; }
  flame::Tensor forward(const flame::Tensor& x) override;

 private:
  int64_t channels_;
  std::shared_ptr<flame::nn::GroupNorm> group_norm_;
  std::shared_ptr<flame::nn::Linear> to_q_, to_k_, to_v_, to_out_;
};

class VaeMidBlock : public flame::nn::Module {
 public:
  VaeMidBlock(int64_t channels, int64_t groups, bool add_attention, flame::TensorOptions opts);
  std::string name() const override { return "UNetMidBlock2D"; }
  flame::Tensor forward(const flame::Tensor& x) override;

 private:
  std::shared_ptr<VaeAttention> attention_;  // null without attention
  std::shared_ptr<VaeResnetBlock> resnet0_, resnet1_;
};

// DownEncoderBlock2D (down) or UpDecoderBlock2D (!down): resnets, then a stride-2 conv after a
// (0, 1, 0, 1) zero pad, or a nearest 2x upsample and a 3x3 conv.
class VaeSampleBlock : public flame::nn::Module {
 public:
  VaeSampleBlock(bool down, int64_t in_channels, int64_t out_channels, int64_t layers, int64_t groups, bool resample,
                 flame::TensorOptions opts);
  std::string name() const override { return down_ ? "DownEncoderBlock2D" : "UpDecoderBlock2D"; }
  flame::Tensor forward(const flame::Tensor& x) override;

 private:
  bool down_;
  std::vector<std::shared_ptr<VaeResnetBlock>> resnets_;
  std::shared_ptr<flame::nn::Conv2d> resample_conv_;  // null on the last level
};

class VaeEncoder : public flame::nn::Module {
 public:
  VaeEncoder(const VaeConfig& c, flame::TensorOptions opts);
  std::string name() const override { return "Encoder"; }
  flame::Tensor forward(const flame::Tensor& x) override;  // [N, in, H, W] -> [N, 2 * latent, H/f, W/f]

 private:
  std::shared_ptr<flame::nn::Conv2d> conv_in_, conv_out_;
  std::vector<std::shared_ptr<VaeSampleBlock>> down_;
  std::shared_ptr<VaeMidBlock> mid_;
  std::shared_ptr<flame::nn::GroupNorm> norm_out_;
};

class VaeDecoder : public flame::nn::Module {
 public:
  VaeDecoder(const VaeConfig& c, flame::TensorOptions opts);
  std::string name() const override { return "Decoder"; }
  flame::Tensor forward(const flame::Tensor& z) override;

 private:
  std::shared_ptr<flame::nn::Conv2d> conv_in_, conv_out_;
  std::vector<std::shared_ptr<VaeSampleBlock>> up_;
  std::shared_ptr<VaeMidBlock> mid_;
  std::shared_ptr<flame::nn::GroupNorm> norm_out_;
};

class AutoencoderKL : public flame::nn::Module {
 public:
  explicit AutoencoderKL(const VaeConfig& config, flame::TensorOptions opts = {});
  std::string name() const override { return "AutoencoderKL"; }
  std::string extra_repr() const override;

  const VaeConfig& config() const { return config_; }
  flame::DType dtype() const;
  flame::Device device() const;

  // images [N, in, H, W] (H, W multiples of downscale()) -> the latent distribution. Tiled when
  // tiling is on and the image is larger than a tile.
  LatentDistribution encode(const flame::Tensor& images);
  // raw latents [N, latent, h, w] -> images [N, out, h * f, w * f]. Tiled as encode.
  flame::Tensor decode(const flame::Tensor& latents);
  // (z - shift) * scale and z / scale + shift: what the diffusion model sees and back.
  flame::Tensor to_latent(const flame::Tensor& z) const;
  flame::Tensor from_latent(const flame::Tensor& z) const;
  // to_latent(encode(images).sample(gen)), or of the mode when gen is null.
  flame::Tensor encode_latent(const flame::Tensor& images, flame::Generator* gen = nullptr);
  flame::Tensor decode_latent(const flame::Tensor& latents) { return decode(from_latent(latents)); }

  void enable_tiling(TileOptions options = {}) { tiling_ = options; }
  void disable_tiling() { tiling_.reset(); }
  LatentDistribution tiled_encode(const flame::Tensor& images, TileOptions options = {});
  flame::Tensor tiled_decode(const flame::Tensor& latents, TileOptions options = {});

  const std::shared_ptr<VaeEncoder>& encoder() const { return encoder_; }
  const std::shared_ptr<VaeDecoder>& decoder() const { return decoder_; }

 private:
  flame::Tensor encode_moments(const flame::Tensor& x);  // encoder + quant_conv, no tiling
  flame::Tensor decode_raw(const flame::Tensor& z);      // post_quant_conv + decoder, no tiling
  int64_t sample_tile(const TileOptions& o) const;

  VaeConfig config_;
  std::shared_ptr<VaeEncoder> encoder_;
  std::shared_ptr<VaeDecoder> decoder_;
  std::shared_ptr<flame::nn::Conv2d> quant_conv_, post_quant_conv_;
  std::optional<TileOptions> tiling_;
};

// ---- loading (vae_checkpoint.cpp) ----
struct VaeLoadOptions {
  flame::Device device = flame::Device::cpu();
  flame::DType dtype = flame::DType::f32;  // see Note [VAE dtypes] for f16
  // "" guesses from config.json or the keys; "sd", "sdxl", "sd3", "flux" pick the preset whose
  // scaling/shift a single file without config.json gets (its architecture comes from the shapes).
  std::string family;
  // A config.json to build the model from when the checkpoint has none (a single file whose
  // norm_num_groups or scaling is not its family's).
  std::string config_json;
  std::string variant;            // diffusers folders: "fp16" prefers the .fp16 weights
  bool allow_unplaced = false;    // tolerate stored VAE keys that map to no parameter
};

// What a file holds, from its headers alone.
struct VaeFileInfo {
  std::string description;  // Checkpoint::description()
  std::string format;       // "vae-diffusers" or "vae-original"
  std::string prefix;       // stored-key prefix ("first_stage_model.", "vae.", "")
  std::string family;       // guessed (or given) family
  VaeConfig config;
};
// `family` and `config_json` as in VaeLoadOptions. A config (config.json of the folder, or
// config_json) gives the architecture and scaling; without one the architecture comes from the
// shapes and the scaling/shift from the family: given, or guessed from the keys (16 latent channels:
// "sd3" under first_stage_model., else "flux" (ae.safetensors); 4: "sdxl" when the file holds SDXL's
// conditioner.* keys or its name contains "xl", else "sd").
VaeFileInfo inspect_vae(const Checkpoint& ck, const std::string& family = "", const std::string& config_json = "");
// A folder (diffusers model or pipeline folder, which uses vae/) or a .safetensors file.
std::shared_ptr<AutoencoderKL> load_vae(const std::string& path, const VaeLoadOptions& options = {});
std::shared_ptr<AutoencoderKL> load_vae(const Checkpoint& ck, const VaeLoadOptions& options = {});
// The plan of the original layout (encoder.down.0.block.0.conv1.weight ...) under `prefix`.
KeyPlan vae_original_plan(const Checkpoint& ck, const std::string& prefix);
// Makes sure the VAE formats are registered (load_vae calls it; tests that detect formats too).
void register_vae_formats();

}  // namespace flame_diffusion::models
