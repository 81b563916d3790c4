#pragma once
// Building blocks of the diffusion transformers (FLUX.1, SD3/SD3.5 MMDiT), with diffusers' module
// names so their state dicts load key for key (Note [DiT blocks]).
//
// Note [DiT blocks]
// What diffusers builds, and what each module here matches:
//   timestep_embedding / TimestepEmbedding   models/unet2d.h (Timesteps / TimestepEmbedding: one
//                         sinusoidal projection, linear_1 SiLU linear_2); shared with the UNet.
//   PixArtAlphaTextProjection   linear_1, SiLU, linear_2 (the pooled-text embedder).
//   CombinedTimestepTextProjEmbeddings   time_proj (256 sinusoids, flip_sin_to_cos, shift 0; no
//                         parameters), timestep_embedder, [guidance_embedder], text_embedder:
//                         temb = timestep_embedder(proj(t)) [+ guidance_embedder(proj(g))] +
//                         text_embedder(pooled), the projections cast to pooled's dtype.
//   AdaLayerNormZero       linear(SiLU(emb)) -> shift, scale, gate (attention), shift, scale, gate
//                         (MLP), in that order; x' = LayerNorm(x, no affine, eps 1e-6) * (1 + scale)
//                         + shift.
//   AdaLayerNormZeroSingle linear -> shift, scale, gate.
//   AdaLayerNormContinuous linear(SiLU(cond)) -> SCALE, SHIFT (this order; the original MMDiT/BFL
//                         final_layer.adaLN_modulation stores shift, scale: converters swap halves).
//   JointAttention         diffusers' Attention/FluxAttention with the joint processor: to_q, to_k,
//                         to_v (+ add_q_proj, add_k_proj, add_v_proj for the context stream),
//                         optional RMS QK-norm per head (norm_q, norm_k, norm_added_q,
//                         norm_added_k, eps 1e-6, with weight), optional rotary embedding on the
//                         joint sequence, one SDPA over both streams, then to_out.0 (+ to_out.1
//                         dropout) for the image stream and to_add_out for the context stream.
//                         FLUX puts the context first in the joint sequence, SD3 the image first.
//   GeluFeedForward        diffusers' FeedForward(activation_fn="gelu-approximate"): net.0.proj,
//                         tanh GELU, net.1 dropout, net.2.
//
// Rotary embedding (FLUX's FluxPosEmbed and apply_rotary_emb with use_real_unbind_dim=-1): for each
// axis a of the position ids, freqs_i = 1 / theta^(2i / d_a) (f64), angle = pos * freqs_i, each cos
// and sin repeated twice (interleaved), the axes concatenated -> cos, sin [S, head_dim] (f32). Pairs
// (x[2i], x[2i+1]) rotate: out = x * cos + rot(x) * sin with rot(x)[2i] = -x[2i+1],
// rot(x)[2i+1] = x[2i], computed in f32 and returned in x's dtype: FLAME's fused
// nn::functional::rotary_embedding (interleaved layout), one pass over x forward and backward.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <flame/flame.h>
#include <flame/nn.h>

#include <flame/nn/linear_gelu.h>

#include "models/unet2d.h"  // timestep_embedding, TimestepEmbedding

namespace flame_diffusion::models {

// ---- conditioning embedders ----
class PixArtAlphaTextProjection : public flame::nn::Module {
 public:
  PixArtAlphaTextProjection(int64_t in_features, int64_t hidden_size, TensorOptions opts = {});
  std::string name() const override { return "PixArtAlphaTextProjection"; }
  Tensor forward(const Tensor& x) override;  // linear_2(silu(linear_1(x)))
  std::shared_ptr<flame::nn::Linear> linear_1, linear_2;
};

class CombinedTimestepTextProjEmbeddings : public flame::nn::Module {
 public:
  // guidance: add guidance_embedder (diffusers' CombinedTimestepGuidanceTextProjEmbeddings).
  CombinedTimestepTextProjEmbeddings(int64_t embedding_dim, int64_t pooled_projection_dim, bool guidance,
                                     TensorOptions opts = {});
  std::string name() const override {
    return guidance_embedder ? "CombinedTimestepGuidanceTextProjEmbeddings" : "CombinedTimestepTextProjEmbeddings";
  }
  using flame::nn::Module::forward;
  // timestep [B] (already scaled as the model wants), pooled [B, pooled_projection_dim], guidance
  // [B] (required exactly when the module has a guidance_embedder) -> [B, embedding_dim].
  Tensor forward(const Tensor& timestep, const Tensor& pooled, const Tensor& guidance = {});
  std::shared_ptr<TimestepEmbedding> timestep_embedder, guidance_embedder;  // guidance_embedder may be null
  std::shared_ptr<PixArtAlphaTextProjection> text_embedder;

  static constexpr int64_t kTimeProjDim = 256;
};

// ---- adaptive norms ----
struct AdaLayerNormZeroOutput {
  Tensor x;  // the modulated norm of the input, for the attention
  Tensor gate_msa, shift_mlp, scale_mlp, gate_mlp;  // [B, dim] each
};

class AdaLayerNormZero : public flame::nn::Module {
 public:
  AdaLayerNormZero(int64_t embedding_dim, bool bias = true, TensorOptions opts = {});
  std::string name() const override { return "AdaLayerNormZero"; }
  using flame::nn::Module::forward;
  // x [B, L, dim], emb [B, dim] (SiLU is applied here).
  AdaLayerNormZeroOutput forward(const Tensor& x, const Tensor& emb);
  std::shared_ptr<flame::nn::Linear> linear;
  std::shared_ptr<flame::nn::LayerNorm> norm;  // no affine parameters, eps 1e-6
};

class AdaLayerNormZeroSingle : public flame::nn::Module {
 public:
  AdaLayerNormZeroSingle(int64_t embedding_dim, bool bias = true, TensorOptions opts = {});
  std::string name() const override { return "AdaLayerNormZeroSingle"; }
  using flame::nn::Module::forward;
  // {modulated norm of x, gate_msa [B, dim]}.
  std::pair<Tensor, Tensor> forward(const Tensor& x, const Tensor& emb);
  std::shared_ptr<flame::nn::Linear> linear;
  std::shared_ptr<flame::nn::LayerNorm> norm;
};

class AdaLayerNormContinuous : public flame::nn::Module {
 public:
  // The LayerNorm (eps) has weight/bias only when elementwise_affine (FLUX and SD3: false).
  AdaLayerNormContinuous(int64_t embedding_dim, int64_t conditioning_embedding_dim, bool elementwise_affine,
                         double eps, bool bias = true, TensorOptions opts = {});
  std::string name() const override { return "AdaLayerNormContinuous"; }
  using flame::nn::Module::forward;
  // x [B, L, dim], cond [B, conditioning_dim]: norm(x) * (1 + scale) + shift, [scale, shift] =
  // linear(silu(cond)).chunk(2).
  Tensor forward(const Tensor& x, const Tensor& cond);
  std::shared_ptr<flame::nn::Linear> linear;
  std::shared_ptr<flame::nn::LayerNorm> norm;

 private:
  bool affine_;
  double eps_;
};

// ---- rotary position embedding ----
struct RotaryEmbedding {
  Tensor cos, sin;  // [S, head_dim] f32, on the device of the attention inputs
  bool defined() const { return cos.defined(); }
};

// FluxPosEmbed: ids [S, n_axes] (any numeric dtype, any device) -> cos/sin [S, sum(axes_dims)] on
// `device`. Each axes_dims entry must be even; the table is computed in f64 on the CPU.
RotaryEmbedding rotary_embedding_from_ids(const Tensor& ids, const std::vector<int64_t>& axes_dims, double theta,
                                          flame::Device device);

// x [B, H, S, D] with rope cos/sin [S, D] (Note [DiT blocks], "Rotary embedding") -> x's shape and
// dtype.
Tensor apply_rotary_emb(const Tensor& x, const RotaryEmbedding& rope);

// ---- joint attention ----
struct JointAttentionOptions {
  int64_t query_dim = 0;
  int64_t heads = 0;
  int64_t dim_head = 0;
  int64_t added_kv_proj_dim = 0;  // 0: no context stream (add_*_proj, to_add_out, norm_added_* absent)
  bool qk_norm = true;            // RMSNorm(dim_head, eps) on q and k of each stream
  double eps = 1e-6;
  bool bias = true;           // to_q/to_k/to_v (and add_*_proj) biases
  bool out_bias = true;       // to_out.0 and to_add_out biases
  bool pre_only = false;      // no to_out (FLUX single blocks): the attention output is returned as is
  bool context_pre_only = false;  // no to_add_out (SD3's last block): the context output is not computed
  bool context_first = true;  // joint sequence order: [context, image] (FLUX) or [image, context] (SD3)
};

class JointAttention : public flame::nn::Module {
 public:
  explicit JointAttention(const JointAttentionOptions& options, TensorOptions opts = {});
  std::string name() const override { return "JointAttention"; }
  using flame::nn::Module::forward;
  // x [B, L, query_dim]; context [B, T, added_kv_proj_dim] or undefined (self-attention over x);
  // rope over the joint sequence (context_first order; S = T + L) or undefined.
  // Returns {image-stream output [B, L, out], context-stream output [B, T, query_dim] or undefined
  // (no context, or context_pre_only)}; out = query_dim (heads * dim_head when pre_only).
  std::pair<Tensor, Tensor> forward(const Tensor& x, const Tensor& context, const RotaryEmbedding& rope = {});
  const JointAttentionOptions& options() const { return options_; }

  std::shared_ptr<flame::nn::Linear> to_q, to_k, to_v, add_q_proj, add_k_proj, add_v_proj, to_add_out;
  std::shared_ptr<flame::nn::RMSNorm> norm_q, norm_k, norm_added_q, norm_added_k;  // null without qk_norm
  std::shared_ptr<flame::nn::ModuleList> to_out;  // [Linear, Dropout]; null when pre_only

 private:
  JointAttentionOptions options_;
};

// ---- feed-forward ----
// diffusers' GELU activation module: proj (Linear) then tanh-approximated GELU.
class GeluTanhProjection : public flame::nn::Module {
 public:
  GeluTanhProjection(int64_t dim_in, int64_t dim_out, TensorOptions opts = {});
  std::string name() const override { return "GELU"; }
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<flame::nn::Linear> proj;
};

class GeluFeedForward : public flame::nn::Module {
 public:
  // inner = dim * mult; out = dim_out (0: dim).
  GeluFeedForward(int64_t dim, int64_t dim_out = 0, int64_t mult = 4, double dropout = 0.0, TensorOptions opts = {});
  std::string name() const override { return "FeedForward"; }
  // net.2(dropout(gelu_tanh(net.0.proj(x)))); one fused mlp_gelu op when neither linear carries an
  // unmerged adapter and dropout is off.
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<flame::nn::ModuleList> net;  // [GeluTanhProjection, Dropout, Linear]
};

}  // namespace flame_diffusion::models
