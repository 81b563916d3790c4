// Building blocks of the diffusion transformers (models/transformer_blocks.h, Note [DiT blocks]).
#include "models/transformer_blocks.h"

#include <cmath>
#include <string>

namespace flame_diffusion::models {

namespace nn = flame::nn;
namespace F = flame::nn::functional;
using flame::DType;
using flame::Shape;

// ---- conditioning embedders ----
PixArtAlphaTextProjection::PixArtAlphaTextProjection(int64_t in_features, int64_t hidden_size, TensorOptions opts) {
  linear_1 = register_module("linear_1", std::make_shared<nn::Linear>(in_features, hidden_size, true, opts));
  linear_2 = register_module("linear_2", std::make_shared<nn::Linear>(hidden_size, hidden_size, true, opts));
}

Tensor PixArtAlphaTextProjection::forward(const Tensor& x) { return linear_2->forward(linear_1->forward(x).silu()); }

CombinedTimestepTextProjEmbeddings::CombinedTimestepTextProjEmbeddings(int64_t embedding_dim,
                                                                       int64_t pooled_projection_dim, bool guidance,
                                                                       TensorOptions opts) {
  timestep_embedder =
      register_module("timestep_embedder", std::make_shared<TimestepEmbedding>(kTimeProjDim, embedding_dim, opts));
  if (guidance) {
    guidance_embedder =
        register_module("guidance_embedder", std::make_shared<TimestepEmbedding>(kTimeProjDim, embedding_dim, opts));
  }
  text_embedder = register_module(
      "text_embedder", std::make_shared<PixArtAlphaTextProjection>(pooled_projection_dim, embedding_dim, opts));
}

Tensor CombinedTimestepTextProjEmbeddings::forward(const Tensor& timestep, const Tensor& pooled,
                                                   const Tensor& guidance) {
  const nn::Module::CallScope scope(*this);
  const char* op = "CombinedTimestepTextProjEmbeddings";
  FLAME_CHECK(pooled.dim() == 2 && pooled.size(1) == text_embedder->linear_1->in_features(), op,
              "pooled projections must be [B, ", text_embedder->linear_1->in_features(), "], got ",
              flame::shape_str(pooled.sizes()));
  FLAME_CHECK(guidance.defined() == (guidance_embedder != nullptr), op,
              guidance_embedder ? "this model embeds guidance (guidance_embeds true): pass a guidance tensor [B]"
                                : "this model has no guidance embedder (guidance_embeds false): pass no guidance");
  auto project = [&](const Tensor& t) {
    return timestep_embedding(t.dim() == 0 ? t.unsqueeze(0) : t, kTimeProjDim, true, 0.0).to(pooled.dtype());
  };
  Tensor temb = timestep_embedder->forward(project(timestep));
  if (guidance_embedder) temb = temb + guidance_embedder->forward(project(guidance));
  return temb + text_embedder->forward(pooled);
}

// ---- adaptive norms ----
AdaLayerNormZero::AdaLayerNormZero(int64_t embedding_dim, bool bias, TensorOptions opts) {
  linear = register_module("linear", std::make_shared<nn::Linear>(embedding_dim, 6 * embedding_dim, bias, opts));
  norm = register_module("norm", std::make_shared<nn::LayerNorm>(embedding_dim, 1e-6, false, false, opts));
}

AdaLayerNormZeroOutput AdaLayerNormZero::forward(const Tensor& x, const Tensor& emb) {
  const nn::Module::CallScope scope(*this);
  const flame::TensorList m = linear->forward(emb.silu()).chunk(6, 1);
  return {F::layer_norm_modulate(x, m[0], m[1], 1e-6), m[2], m[3], m[4], m[5]};
}

AdaLayerNormZeroSingle::AdaLayerNormZeroSingle(int64_t embedding_dim, bool bias, TensorOptions opts) {
  linear = register_module("linear", std::make_shared<nn::Linear>(embedding_dim, 3 * embedding_dim, bias, opts));
  norm = register_module("norm", std::make_shared<nn::LayerNorm>(embedding_dim, 1e-6, false, false, opts));
}

std::pair<Tensor, Tensor> AdaLayerNormZeroSingle::forward(const Tensor& x, const Tensor& emb) {
  const nn::Module::CallScope scope(*this);
  const flame::TensorList m = linear->forward(emb.silu()).chunk(3, 1);
  return {F::layer_norm_modulate(x, m[0], m[1], 1e-6), m[2]};
}

AdaLayerNormContinuous::AdaLayerNormContinuous(int64_t embedding_dim, int64_t conditioning_embedding_dim,
                                               bool elementwise_affine, double eps, bool bias, TensorOptions opts)
    : affine_(elementwise_affine), eps_(eps) {
  linear =
      register_module("linear", std::make_shared<nn::Linear>(conditioning_embedding_dim, 2 * embedding_dim, bias, opts));
  norm = register_module("norm", std::make_shared<nn::LayerNorm>(embedding_dim, eps, elementwise_affine, bias, opts));
}

Tensor AdaLayerNormContinuous::forward(const Tensor& x, const Tensor& cond) {
  const nn::Module::CallScope scope(*this);
  // diffusers casts silu(cond) to x's dtype before the projection.
  const flame::TensorList m = linear->forward(cond.silu().to(x.dtype())).chunk(2, 1);  // scale, shift
  if (!affine_) return F::layer_norm_modulate(x, m[1], m[0], eps_);
  return norm->forward(x) * (m[0] + 1.0).unsqueeze(1) + m[1].unsqueeze(1);
}

// ---- rotary position embedding ----
RotaryEmbedding rotary_embedding_from_ids(const Tensor& ids, const std::vector<int64_t>& axes_dims, double theta,
                                          flame::Device device) {
  const char* op = "rotary_embedding_from_ids";
  FLAME_CHECK(ids.dim() == 2 && ids.size(1) == static_cast<int64_t>(axes_dims.size()), op, "ids must be [S, ",
              axes_dims.size(), "] (one column per rotary axis), got ", flame::shape_str(ids.sizes()));
  int64_t total = 0;
  for (int64_t d : axes_dims) {
    FLAME_CHECK(d > 0 && d % 2 == 0, op, "every axes_dims entry must be even and positive, got ", d);
    total += d;
  }
  const int64_t s = ids.size(0), n_axes = ids.size(1);
  const std::vector<double> pos = ids.to(flame::Device::cpu()).to(DType::f64).contiguous().to_vec<double>();
  std::vector<float> cos_v(static_cast<std::size_t>(s * total)), sin_v(cos_v.size());
  for (int64_t r = 0; r < s; ++r) {
    int64_t col = 0;
    for (int64_t a = 0; a < n_axes; ++a) {
      // diffusers reads the ids as f32 first, then multiplies by f64 frequencies.
      const double p = static_cast<double>(static_cast<float>(pos[static_cast<std::size_t>(r * n_axes + a)]));
      const int64_t d = axes_dims[static_cast<std::size_t>(a)];
      for (int64_t i = 0; i < d / 2; ++i) {
        const double freq = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(d));
        const double angle = p * freq;
        const auto at = static_cast<std::size_t>(r * total + col + 2 * i);
        cos_v[at] = cos_v[at + 1] = static_cast<float>(std::cos(angle));
        sin_v[at] = sin_v[at + 1] = static_cast<float>(std::sin(angle));
      }
      col += d;
    }
  }
  return {Tensor::from_vec(cos_v, {s, total}).to(device), Tensor::from_vec(sin_v, {s, total}).to(device)};
}

Tensor apply_rotary_emb(const Tensor& x, const RotaryEmbedding& rope) {
  FLAME_CHECK(x.dim() == 4 && rope.defined() && rope.cos.dim() == 2 && rope.cos.size(0) == x.size(2) &&
                  rope.cos.size(1) == x.size(3),
              "apply_rotary_emb", "x must be [B, H, S, D] with cos/sin [S, D]; got x ", flame::shape_str(x.sizes()),
              " and cos ", rope.defined() ? flame::shape_str(rope.cos.sizes()) : std::string("(none)"),
              " (the position ids must cover the joint sequence: text tokens + image tokens)");
  // FLAME's fused rotary op: one pass over x, and a backward that saves only cos and sin.
  return F::rotary_embedding(x, rope.cos, rope.sin, F::RotaryLayout::interleaved);
}

// ---- joint attention ----
JointAttention::JointAttention(const JointAttentionOptions& o, TensorOptions opts) : options_(o) {
  FLAME_CHECK(o.query_dim > 0 && o.heads > 0 && o.dim_head > 0, "JointAttention",
              "query_dim, heads and dim_head must be positive, got ", o.query_dim, ", ", o.heads, ", ", o.dim_head);
  const int64_t inner = o.heads * o.dim_head;
  if (o.qk_norm) {
    norm_q = register_module("norm_q", std::make_shared<nn::RMSNorm>(o.dim_head, o.eps, true, opts));
    norm_k = register_module("norm_k", std::make_shared<nn::RMSNorm>(o.dim_head, o.eps, true, opts));
  }
  to_q = register_module("to_q", std::make_shared<nn::Linear>(o.query_dim, inner, o.bias, opts));
  to_k = register_module("to_k", std::make_shared<nn::Linear>(o.query_dim, inner, o.bias, opts));
  to_v = register_module("to_v", std::make_shared<nn::Linear>(o.query_dim, inner, o.bias, opts));
  if (!o.pre_only) {
    to_out = register_module("to_out", std::make_shared<nn::ModuleList>());
    to_out->push_back(std::make_shared<nn::Linear>(inner, o.query_dim, o.out_bias, opts));
    to_out->push_back(std::make_shared<nn::Dropout>(0.0));
  }
  if (o.added_kv_proj_dim > 0) {
    if (o.qk_norm) {
      norm_added_q = register_module("norm_added_q", std::make_shared<nn::RMSNorm>(o.dim_head, o.eps, true, opts));
      norm_added_k = register_module("norm_added_k", std::make_shared<nn::RMSNorm>(o.dim_head, o.eps, true, opts));
    }
    add_q_proj = register_module("add_q_proj", std::make_shared<nn::Linear>(o.added_kv_proj_dim, inner, o.bias, opts));
    add_k_proj = register_module("add_k_proj", std::make_shared<nn::Linear>(o.added_kv_proj_dim, inner, o.bias, opts));
    add_v_proj = register_module("add_v_proj", std::make_shared<nn::Linear>(o.added_kv_proj_dim, inner, o.bias, opts));
    if (!o.context_pre_only) {
      to_add_out = register_module("to_add_out", std::make_shared<nn::Linear>(inner, o.query_dim, o.out_bias, opts));
    }
  }
}

std::pair<Tensor, Tensor> JointAttention::forward(const Tensor& x, const Tensor& context, const RotaryEmbedding& rope) {
  const nn::Module::CallScope scope(*this);
  const JointAttentionOptions& o = options_;
  const char* op = "JointAttention";
  FLAME_CHECK(x.dim() == 3 && x.size(2) == o.query_dim, op, "expected x [B, L, ", o.query_dim, "], got ",
              flame::shape_str(x.sizes()));
  const bool joint = context.defined();
  FLAME_CHECK(!joint || add_q_proj, op, "a context was given but the attention has no context projections");
  FLAME_CHECK(!joint || (context.dim() == 3 && context.size(0) == x.size(0) && context.size(2) == o.added_kv_proj_dim),
              op, "expected context [", x.size(0), ", T, ", o.added_kv_proj_dim, "], got ",
              flame::shape_str(context.sizes()));
  const int64_t b = x.size(0), l = x.size(1), t = joint ? context.size(1) : 0;
  // Each stream's projections as [B, len, H, D] views, joined along the sequence (text first for
  // FLUX, after the image for SD3) for attention's [B, H, S, D] view: the rotary kernel and SDPA take
  // that layout as it is, SDPA's output comes in q's layout, so merging the heads back is a view.
  auto split = [&](const Tensor& p, int64_t len) { return p.view({b, len, o.heads, o.dim_head}); };
  const Tensor pq = split(to_q->forward(x), l), pk = split(to_k->forward(x), l), pv = split(to_v->forward(x), l);
  Tensor cq, ck, cv;
  if (joint) {
    cq = split(add_q_proj->forward(context), t);
    ck = split(add_k_proj->forward(context), t);
    cv = split(add_v_proj->forward(context), t);
  }
  auto streams = [&](const Tensor& img, const Tensor& ctx) -> flame::TensorList {
    if (!joint) return {img};
    return o.context_first ? flame::TensorList{ctx, img} : flame::TensorList{img, ctx};
  };
  auto weight = [](const std::shared_ptr<nn::RMSNorm>& n) { return n ? n->weight() : Tensor(); };
  const flame::TensorList wq = streams(weight(norm_q), weight(norm_added_q)), wk = streams(weight(norm_k), weight(norm_added_k));
  // RMS QK-norm, join and rotation as one op (Note [RMS norm rotary]) where the norms' weights have
  // the projections' dtype: diffusers' RMSNorm then gives that dtype, and so does the fused op (q
  // and k stay bf16 in a bf16 model under autocast, the kernel computing in f32). Otherwise (an f32
  // model under autocast: the norm computes and returns f32, as diffusers' does) the ops one by one.
  bool fuse = o.qk_norm;
  for (const Tensor& w : wq) fuse = fuse && (!w.defined() || w.dtype() == pq.dtype());
  for (const Tensor& w : wk) fuse = fuse && (!w.defined() || w.dtype() == pk.dtype());
  auto join = [&](const Tensor& img, const Tensor& ctx) {
    const flame::TensorList s = streams(img, ctx);
    return (s.size() == 1 ? s[0] : flame::cat(s, 1)).transpose(1, 2);
  };
  Tensor q, k;
  if (fuse) {
    q = F::rms_norm_rotary(streams(pq, cq), wq, o.eps, rope.cos, rope.sin, F::RotaryLayout::interleaved);
    k = F::rms_norm_rotary(streams(pk, ck), wk, o.eps, rope.cos, rope.sin, F::RotaryLayout::interleaved);
  } else {
    auto normed = [&](const Tensor& h, const std::shared_ptr<nn::RMSNorm>& norm) {
      if (!h.defined() || !norm) return h;
      return norm->forward(h);
    };
    q = join(normed(pq, norm_q), normed(cq, norm_added_q));
    k = join(normed(pk, norm_k), normed(ck, norm_added_k));
    if (rope.defined()) {
      q = apply_rotary_emb(q, rope);
      k = apply_rotary_emb(k, rope);
    }
  }
  const Tensor v = join(pv, cv);
  Tensor a = F::scaled_dot_product_attention(q, k, v);  // [B, H, S, D]
  a = a.transpose(1, 2).reshape({b, t + l, o.heads * o.dim_head});
  Tensor img = a, ctx;
  if (joint) {
    img = o.context_first ? a.narrow(1, t, l) : a.narrow(1, 0, l);
    ctx = o.context_first ? a.narrow(1, 0, t) : a.narrow(1, l, t);
  }
  if (to_out) img = (*to_out)[1]->forward((*to_out)[0]->forward(img));
  if (joint && to_add_out) {
    ctx = to_add_out->forward(ctx);
  } else {
    ctx = Tensor();
  }
  return {img, ctx};
}

// ---- feed-forward ----
GeluTanhProjection::GeluTanhProjection(int64_t dim_in, int64_t dim_out, TensorOptions opts) {
  proj = register_module("proj", std::make_shared<nn::Linear>(dim_in, dim_out, true, opts));
}

Tensor GeluTanhProjection::forward(const Tensor& x) {
  const nn::Module::CallScope scope(*this);
  if ((!proj->has_lora() || proj->merged()) && !proj->is_float8())
    return F::linear_gelu(x, proj->weight(), proj->bias());
  return proj->forward(x).gelu(true);
}

GeluFeedForward::GeluFeedForward(int64_t dim, int64_t dim_out, int64_t mult, double dropout, TensorOptions opts) {
  const int64_t inner = dim * mult;
  net = register_module("net", std::make_shared<nn::ModuleList>());
  net->push_back(std::make_shared<GeluTanhProjection>(dim, inner, opts));
  net->push_back(std::make_shared<nn::Dropout>(dropout));
  net->push_back(std::make_shared<nn::Linear>(inner, dim_out > 0 ? dim_out : dim, true, opts));
}

Tensor GeluFeedForward::forward(const Tensor& x) {
  const nn::Module::CallScope scope(*this);
  const auto& proj = std::static_pointer_cast<GeluTanhProjection>((*net)[0])->proj;
  const auto& out = std::static_pointer_cast<nn::Linear>((*net)[2]);
  const bool plain = (!proj->has_lora() || proj->merged()) && (!out->has_lora() || out->merged()) &&
                     !proj->is_float8() && !out->is_float8();
  const bool no_dropout = !is_training() || std::static_pointer_cast<nn::Dropout>((*net)[1])->p() == 0.0;
  if (plain && no_dropout) return F::mlp_gelu(x, proj->weight(), proj->bias(), out->weight(), out->bias());
  Tensor h = x;
  for (const auto& m : *net) h = m->forward(h);
  return h;
}

}  // namespace flame_diffusion::models
