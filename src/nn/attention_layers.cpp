// MultiheadAttention (include/flame/nn/attention_layers.h).
#include "flame/nn/attention_layers.h"

#include <cmath>

#include "flame/autograd.h"
#include "flame/nn/dropout.h"
#include "flame/nn/init.h"
#include "flame/ops.h"

namespace flame::nn {

MultiheadAttention::MultiheadAttention(int64_t embed_dim, int64_t num_heads, MultiheadAttentionOptions options,
                                       TensorOptions opts)
    : embed_dim_(embed_dim), num_heads_(num_heads), options_(options) {
  const char* op = "MultiheadAttention";
  FLAME_CHECK(embed_dim > 0 && num_heads > 0 && embed_dim % num_heads == 0, op, "embed_dim=", embed_dim,
              " must be a positive multiple of num_heads=", num_heads);
  FLAME_CHECK(options.dropout >= 0.0 && options.dropout < 1.0, op, "dropout must be in [0, 1), got ",
              options.dropout);
  head_dim_ = embed_dim / num_heads;
  kdim_ = options.kdim > 0 ? options.kdim : embed_dim;
  vdim_ = options.vdim > 0 ? options.vdim : embed_dim;
  same_dims_ = kdim_ == embed_dim && vdim_ == embed_dim;
  const TensorOptions o(opts.dtype_or(DType::f32), opts.device);
  // PyTorch's _reset_parameters: xavier_uniform on the projections, zero biases.
  if (same_dims_) {
    Tensor w = Tensor::empty({3 * embed_dim, embed_dim}, o);
    init::xavier_uniform_(w);
    in_proj_weight_ = register_parameter("in_proj_weight", w);
  } else {
    Tensor wq = Tensor::empty({embed_dim, embed_dim}, o), wk = Tensor::empty({embed_dim, kdim_}, o),
           wv = Tensor::empty({embed_dim, vdim_}, o);
    init::xavier_uniform_(wq);
    init::xavier_uniform_(wk);
    init::xavier_uniform_(wv);
    q_proj_weight_ = register_parameter("q_proj_weight", wq);
    k_proj_weight_ = register_parameter("k_proj_weight", wk);
    v_proj_weight_ = register_parameter("v_proj_weight", wv);
  }
  if (options.bias) in_proj_bias_ = register_parameter("in_proj_bias", Tensor::zeros({3 * embed_dim}, o));
  out_proj_ = register_module("out_proj", std::make_shared<Linear>(embed_dim, embed_dim, options.bias, o));
  if (options.bias) {
    Tensor b = out_proj_->bias();
    init::zeros_(b);
  }
}

std::string MultiheadAttention::extra_repr() const {
  std::string s = "embed_dim=" + std::to_string(embed_dim_) + ", num_heads=" + std::to_string(num_heads_);
  if (!same_dims_) s += ", kdim=" + std::to_string(kdim_) + ", vdim=" + std::to_string(vdim_);
  if (options_.batch_first) s += ", batch_first=True";
  return s;
}

Tensor MultiheadAttention::forward(const Tensor& x) { return attention(x, x, x).first; }

namespace {
// A MultiheadAttention mask (bool: true = masked) as an additive float mask of `dtype`.
Tensor additive_mask(const Tensor& m, DType dtype) {
  if (m.dtype() == DType::boolean) {
    Tensor z = Tensor::zeros(m.sizes(), TensorOptions(dtype, m.device()));
    return z.masked_fill(m, -INFINITY);
  }
  return m.to(dtype);
}
}  // namespace

std::pair<Tensor, Tensor> MultiheadAttention::attention(const Tensor& query, const Tensor& key, const Tensor& value,
                                                        const MhaForwardOptions& fo) {
  const char* op = "MultiheadAttention";
  FLAME_CHECK(query.defined() && key.defined() && value.defined(), op, "undefined query, key or value");
  FLAME_CHECK(query.dim() == 2 || query.dim() == 3, op, "query must be [L, E] or 3-d, got ", query.sizes());
  FLAME_CHECK(key.dim() == query.dim() && value.dim() == query.dim(), op, "query ", query.sizes(), ", key ",
              key.sizes(), " and value ", value.sizes(), " must have the same number of dims");
  const bool batched = query.dim() == 3;
  // To [N, L, E].
  auto to_nle = [&](const Tensor& t) {
    if (!batched) return t.unsqueeze(0);
    return options_.batch_first ? t : t.transpose(0, 1);
  };
  Tensor q = to_nle(query), k = to_nle(key), v = to_nle(value);
  FLAME_CHECK(q.size(2) == embed_dim_ && k.size(2) == kdim_ && v.size(2) == vdim_, op, "feature sizes: query ",
              query.sizes(), " (expects ", embed_dim_, "), key ", key.sizes(), " (expects ", kdim_, "), value ",
              value.sizes(), " (expects ", vdim_, ")");
  FLAME_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == v.size(1), op,
              "batch/sequence sizes differ: query ", query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());
  const int64_t n = q.size(0), l = q.size(1), s = k.size(1), e = embed_dim_;

  Tensor bq, bk, bv;
  if (in_proj_bias_.defined()) {
    bq = in_proj_bias_.narrow(0, 0, e);
    bk = in_proj_bias_.narrow(0, e, e);
    bv = in_proj_bias_.narrow(0, 2 * e, e);
  }
  Tensor qp, kp, vp;
  if (same_dims_) {
    const bool self = query.is_same(key) && key.is_same(value);
    if (self) {
      Tensor qkv = functional::linear(q, in_proj_weight_, in_proj_bias_);  // [N, L, 3E]
      qp = qkv.narrow(2, 0, e);
      kp = qkv.narrow(2, e, e);
      vp = qkv.narrow(2, 2 * e, e);
    } else {
      qp = functional::linear(q, in_proj_weight_.narrow(0, 0, e), bq);
      kp = functional::linear(k, in_proj_weight_.narrow(0, e, e), bk);
      vp = functional::linear(v, in_proj_weight_.narrow(0, 2 * e, e), bv);
    }
  } else {
    qp = functional::linear(q, q_proj_weight_, bq);
    kp = functional::linear(k, k_proj_weight_, bk);
    vp = functional::linear(v, v_proj_weight_, bv);
  }
  // [N, L, E] -> [N, H, L, Dh]
  auto heads = [&](const Tensor& t, int64_t len) { return t.reshape({n, len, num_heads_, head_dim_}).transpose(1, 2); };
  Tensor qh = heads(qp, l), kh = heads(kp, s), vh = heads(vp, s);

  // Masks combine into one additive mask broadcastable to [N, H, L, S].
  Tensor mask;
  if (fo.attn_mask.defined()) {
    const Tensor& am = fo.attn_mask;
    FLAME_CHECK((am.dim() == 2 && am.size(0) == l && am.size(1) == s) ||
                    (am.dim() == 3 && am.size(0) == n * num_heads_ && am.size(1) == l && am.size(2) == s),
                op, "attn_mask must be [", l, ", ", s, "] or [", n * num_heads_, ", ", l, ", ", s, "], got ",
                am.sizes());
    mask = additive_mask(am, qh.dtype());
    if (mask.dim() == 3) mask = mask.reshape({n, num_heads_, l, s});
  }
  if (fo.key_padding_mask.defined()) {
    const Tensor& kpm = fo.key_padding_mask;
    FLAME_CHECK((batched && kpm.dim() == 2 && kpm.size(0) == n && kpm.size(1) == s) ||
                    (!batched && kpm.dim() == 1 && kpm.size(0) == s),
                op, "key_padding_mask must be [", n, ", ", s, "] (or [", s, "] unbatched), got ", kpm.sizes());
    Tensor pm = additive_mask(kpm, qh.dtype()).reshape({n, 1, 1, s});
    mask = mask.defined() ? mask + pm : pm;
  }
  const double p = is_training() ? options_.dropout : 0.0;
  bool causal = fo.is_causal;
  // SDPA takes either a mask or is_causal, and the explicit-weights path takes masks only: there
  // the causal part becomes an additive mask too.
  if (causal && (mask.defined() || fo.need_weights)) {
    Tensor tri = Tensor::ones({l, s}, TensorOptions(DType::boolean, q.device())).triu(1);
    Tensor causal_mask = additive_mask(tri, qh.dtype());
    mask = mask.defined() ? mask + causal_mask : causal_mask;
    causal = false;
  }

  Tensor weights;
  Tensor attn;
  if (fo.need_weights) {
    // The probabilities are wanted, so compute them explicitly (PyTorch does the same).
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
    Tensor scores = qh.matmul(kh.transpose(-2, -1)) * scale;
    if (mask.defined()) scores = scores + mask;
    Tensor probs = scores.softmax(-1);
    weights = fo.average_attn_weights ? probs.mean(1) : probs;
    if (p > 0.0) probs = functional::dropout(probs, p, true);
    attn = probs.matmul(vh);
  } else {
    attn = functional::scaled_dot_product_attention(qh, kh, vh, mask, p, causal);
  }
  Tensor out = out_proj_->forward(attn.transpose(1, 2).reshape({n, l, e}));  // [N, L, E]
  if (!batched) {
    out = out.squeeze(0);
    if (weights.defined()) weights = weights.squeeze(0);
  } else if (!options_.batch_first) {
    out = out.transpose(0, 1);
  }
  return {out, weights};
}

}  // namespace flame::nn
