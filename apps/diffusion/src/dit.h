#pragma once
// DiT (Peebles & Xie, "Scalable Diffusion Models with Transformers"), class-conditional with
// adaLN-Zero, sized for 28x28 Fashion-MNIST. Parameter names are the reference implementation's
// (facebookresearch/DiT models.py), so state dicts move to and from the PyTorch twin
// (apps/diffusion/reference/dit.py) without a mapping.
//
// Differences from the reference, on purpose: pos_embed is a LEARNED parameter (initialised with
// the 2-D sin-cos table, then trained; the reference freezes it), the output has in_channels
// channels (no learned sigma), and t is continuous in [0, 1] (Note [Time convention], embed.h).
#include <cstdint>
#include <memory>
#include <string>

#include "embed.h"

namespace flame_diffusion {

// What the training forward leaves for the backward to recompute instead of saving
// (docs/recompute.md): none; mlp: each MLP keeps its pre-activation only and the backward redoes
// gelu (F::mlp_gelu's recompute_hidden); all: mlp, and the adaLN outputs (the inputs of qkv, the
// MLP and the final linear) are rerun from what their own nodes save (autograd::RecomputeCheap).
// The same values and gradients up to the rounding of the recomputed gelu in low precision.
enum class DiTRecompute { none, mlp, all };
// "none", "mlp", "all"; anything else raises an error listing these.
DiTRecompute parse_dit_recompute(const std::string& name);
const char* dit_recompute_name(DiTRecompute r);
// A level and, for mlp, how many blocks use it (the first N; -1: all): "mlp:8" recomputes the
// MLP hidden activation in blocks 0-7 only, a dial between none and mlp (each block that
// recomputes saves its [tokens, mlp_hidden] activation and pays one gelu pass over it).
struct DiTRecomputeSpec {
  DiTRecompute level = DiTRecompute::none;
  int64_t mlp_blocks = -1;
};
// "none", "mlp", "mlp:N" (N >= 0), "all"; anything else raises an error listing these.
DiTRecomputeSpec parse_dit_recompute_spec(const std::string& spec);
std::string dit_recompute_spec_name(const DiTRecomputeSpec& spec);

struct DiTConfig {
  std::string name = "dit-s";
  int64_t input_size = 28;
  int64_t patch_size = 2;
  int64_t in_channels = 1;
  int64_t hidden = 384;
  int64_t depth = 12;
  int64_t heads = 6;
  double mlp_ratio = 4.0;
  int64_t num_classes = 10;
  int64_t frequency_dim = 256;
  double time_scale = 1000.0;  // the embedding sees t * time_scale
  DiTRecompute recompute = DiTRecompute::none;  // a training-memory setting, not saved with weights
  int64_t recompute_mlp_blocks = -1;             // with mlp: the first N blocks only (-1: every block)
  int64_t grid() const { return input_size / patch_size; }
  int64_t tokens() const { return grid() * grid(); }
};

// "dit-tiny" (CPU demo), "dit-s", "dit-b"; unknown names raise an error listing these.
DiTConfig dit_config(const std::string& name);

// LayerNorm(no affine, eps 1e-6) is applied functionally; modulate(x, shift, scale) =
// x * (1 + scale) + shift with shift/scale broadcast over tokens.
// timm's PatchEmbed: Conv2d(in, hidden, patch, stride patch) named `proj`, flattened to tokens
// (computed as one GEMM over the gathered patches: dit.cpp).
class PatchEmbed : public flame::nn::Module {
 public:
  PatchEmbed(int64_t in_channels, int64_t hidden, int64_t patch_size);
  std::string name() const override { return "PatchEmbed"; }
  Tensor forward(const Tensor& x) override;  // [B, C, H, W] -> [B, (H/p)*(W/p), hidden]
  std::shared_ptr<flame::nn::Conv2d> proj;
};

class DiTAttention : public flame::nn::Module {
 public:
  DiTAttention(int64_t hidden, int64_t heads);
  std::string name() const override { return "Attention"; }
  Tensor forward(const Tensor& x) override;  // [B, T, hidden]
  std::shared_ptr<flame::nn::Linear> qkv, proj;

 private:
  int64_t heads_;
};

class DiTMlp : public flame::nn::Module {
 public:
  DiTMlp(int64_t hidden, int64_t mlp_hidden);
  std::string name() const override { return "Mlp"; }
  Tensor forward(const Tensor& x) override;  // fc1 -> GELU(tanh) -> fc2
  std::shared_ptr<flame::nn::Linear> fc1, fc2;
  bool recompute_hidden = false;  // F::mlp_gelu's option (DiTRecompute::mlp); unused with LoRA adapters
};

class DiTBlock : public flame::nn::Module {
 public:
  DiTBlock(int64_t hidden, int64_t heads, double mlp_ratio);
  std::string name() const override { return "DiTBlock"; }
  using flame::nn::Module::forward;  // the one-input form stays visible (not hidden by the overload)
  Tensor forward(const Tensor& x, const Tensor& c);
  // adaLN_modulation(c) as its six [B, hidden] chunks: shift, scale, gate of the attention branch,
  // then of the MLP branch. DiT::forward walks the blocks through these pieces so that each
  // residual update is fused with the norm that reads it (F::gated_residual_modulate).
  flame::TensorList modulation(const Tensor& c);
  std::shared_ptr<DiTAttention> attn;
  std::shared_ptr<DiTMlp> mlp;
  std::shared_ptr<flame::nn::Linear> ada_linear;  // adaLN_modulation.1: hidden -> 6 hidden
};

class DiTFinalLayer : public flame::nn::Module {
 public:
  DiTFinalLayer(int64_t hidden, int64_t patch_size, int64_t out_channels);
  std::string name() const override { return "FinalLayer"; }
  using flame::nn::Module::forward;  // the one-input form stays visible (not hidden by the overload)
  Tensor forward(const Tensor& x, const Tensor& c);  // [B, T, p*p*out]
  flame::TensorList modulation(const Tensor& c);     // shift, scale: [B, hidden] each
  std::shared_ptr<flame::nn::Linear> linear;
  std::shared_ptr<flame::nn::Linear> ada_linear;  // adaLN_modulation.1: hidden -> 2 hidden
};

class DiT : public DiffusionModel {
 public:
  // Weights are drawn from a Generator seeded with `seed` (the same seed gives the same model on
  // any device); init as the reference's initialize_weights (see dit.cpp).
  explicit DiT(const DiTConfig& config, uint64_t seed = 0);
  std::string name() const override { return "DiT"; }
  std::string extra_repr() const override;
  using DiffusionModel::forward;
  Tensor forward(const Tensor& x, const Tensor& t, const Tensor& y) override;
  int64_t in_channels() const override { return config_.in_channels; }
  int64_t image_size() const override { return config_.input_size; }
  int64_t num_classes() const override { return config_.num_classes; }
  std::string preset() const override { return config_.name; }
  const DiTConfig& config() const { return config_; }
  // Changes what the next training forwards save (DiTConfig::recompute); weights are unchanged.
  // mlp_blocks (level mlp only): the first N blocks recompute, the others save (-1: all; N must
  // not exceed depth).
  void set_recompute(DiTRecompute r, int64_t mlp_blocks = -1);
  void set_recompute(const DiTRecomputeSpec& spec) { set_recompute(spec.level, spec.mlp_blocks); }
  DiTRecompute recompute() const { return config_.recompute; }
  DiTRecomputeSpec recompute_spec() const { return {config_.recompute, config_.recompute_mlp_blocks}; }

  // [B, T, p*p*C] -> [B, C, H, W] (token (i, j) holds the p x p patch at rows i*p.., cols j*p..,
  // channel fastest, as the reference's einsum "nhwpqc->nchpwq").
  Tensor unpatchify(const Tensor& tokens) const;

  std::shared_ptr<PatchEmbed> x_embedder;
  Tensor pos_embed;                           // [1, T, hidden], learned
  std::shared_ptr<TimestepEmbedder> t_embedder;
  std::shared_ptr<LabelEmbedder> y_embedder;
  std::vector<std::shared_ptr<DiTBlock>> blocks;
  std::shared_ptr<DiTFinalLayer> final_layer;

 private:
  void initialize_weights(flame::Generator* gen);
  DiTConfig config_;
};

}  // namespace flame_diffusion
