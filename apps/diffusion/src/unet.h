#pragma once
// A small class-conditional UNet for 28x28 images (28 -> 14 -> 7 and back), with the DiT's
// timestep and label embedders (embed.h). Names match the PyTorch twin
// (apps/diffusion/reference/unet.py):
//
//   t_embedder.mlp.{0,2}, y_embedder.embedding_table, conv_in,
//   down_blocks.{i} (ResBlock at level i), downsamplers.{i} (stride-2 3x3 conv, i < L-1),
//   mid_block1, mid_attn, mid_block2,
//   up_blocks.{j} (ResBlock on [h, skip of level L-1-j]), upsamplers.{j} (nearest x2 + 3x3 conv),
//   norm_out, conv_out (zero-initialised: the untrained model predicts exactly zero).
//
// ResBlock: GroupNorm -> SiLU -> conv1 (3x3), + emb_proj(SiLU(c)) per channel, GroupNorm -> SiLU
// -> conv2 (3x3), + skip (1x1 conv when the channel count changes, else identity).
// AttnBlock (at the lowest resolution): GroupNorm -> qkv Linear over the h*w tokens -> SDPA with
// `heads` heads -> proj Linear, residual.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "embed.h"

namespace flame_diffusion {

struct UNetConfig {
  std::string name = "unet-s";
  int64_t image_size = 28;
  int64_t in_channels = 1;
  int64_t base_channels = 64;
  std::vector<int64_t> channel_mult{1, 2, 4};  // one level per entry; a 2x downsample between levels
  int64_t groups = 32;                         // GroupNorm groups (must divide every channel count)
  int64_t heads = 4;                           // attention heads at the lowest resolution
  int64_t emb_dim = 256;                       // timestep/label embedding width
  int64_t num_classes = 10;
  int64_t frequency_dim = 256;
  double time_scale = 1000.0;
};

// "unet-tiny" (CPU demo), "unet-s"; unknown names raise an error listing these.
UNetConfig unet_config(const std::string& name);

class ResBlock : public flame::nn::Module {
 public:
  ResBlock(int64_t in_ch, int64_t out_ch, int64_t emb_dim, int64_t groups);
  std::string name() const override { return "ResBlock"; }
  using flame::nn::Module::forward;  // the one-input form stays visible (not hidden by the overload)
  Tensor forward(const Tensor& x, const Tensor& c);  // c: [B, emb_dim]
  std::shared_ptr<flame::nn::GroupNorm> norm1, norm2;
  std::shared_ptr<flame::nn::Conv2d> conv1, conv2, skip;  // skip is null when in_ch == out_ch
  std::shared_ptr<flame::nn::Linear> emb_proj;
};

class AttnBlock : public flame::nn::Module {
 public:
  AttnBlock(int64_t channels, int64_t groups, int64_t heads);
  std::string name() const override { return "AttnBlock"; }
  Tensor forward(const Tensor& x) override;  // [B, C, H, W]
  std::shared_ptr<flame::nn::GroupNorm> norm;
  std::shared_ptr<flame::nn::Linear> qkv, proj;

 private:
  int64_t heads_;
};

class UNet : public DiffusionModel {
 public:
  // Weights drawn from a Generator seeded with `seed`: PyTorch's default Conv2d/Linear init
  // (kaiming-uniform a = sqrt(5), bias U(+-1/sqrt(fan_in))), the embedders as DiT's, conv_out zero.
  explicit UNet(const UNetConfig& config, uint64_t seed = 0);
  std::string name() const override { return "UNet"; }
  std::string extra_repr() const override;
  using DiffusionModel::forward;
  Tensor forward(const Tensor& x, const Tensor& t, const Tensor& y) override;
  int64_t in_channels() const override { return config_.in_channels; }
  int64_t image_size() const override { return config_.image_size; }
  int64_t num_classes() const override { return config_.num_classes; }
  std::string preset() const override { return config_.name; }
  const UNetConfig& config() const { return config_; }

  std::shared_ptr<TimestepEmbedder> t_embedder;
  std::shared_ptr<LabelEmbedder> y_embedder;
  std::shared_ptr<flame::nn::Conv2d> conv_in, conv_out;
  std::vector<std::shared_ptr<ResBlock>> down_blocks, up_blocks;
  std::vector<std::shared_ptr<flame::nn::Conv2d>> downsamplers, upsamplers;
  std::shared_ptr<ResBlock> mid_block1, mid_block2;
  std::shared_ptr<AttnBlock> mid_attn;
  std::shared_ptr<flame::nn::GroupNorm> norm_out;

 private:
  UNetConfig config_;
};

}  // namespace flame_diffusion
