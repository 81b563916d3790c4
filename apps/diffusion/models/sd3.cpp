// SD3Transformer2DModel (models/sd3.h, Note [SD3 layout]): config, presets, config.json, the
// embeddings, the joint blocks and the model.
#include "models/sd3.h"

#include <algorithm>
#include <cmath>

#include <flame/nn/adaln.h>
#include <flame/offload.h>

namespace flame_diffusion::models {

namespace nn = flame::nn;
namespace F = flame::nn::functional;
using flame::DType;
using flame::Shape;

namespace {

// diffusers' LayerNorms of the MMDiT (norm1/norm2, the adaptive norms): eps 1e-6, no affine.
constexpr double kNormEps = 1e-6;

std::string join(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

}  // namespace

// ---- config ----
bool SD3TransformerConfig::dual_attention(int64_t layer) const {
  return std::find(dual_attention_layers.begin(), dual_attention_layers.end(), layer) != dual_attention_layers.end();
}

void SD3TransformerConfig::validate() const {
  const char* op = "SD3TransformerConfig";
  FLAME_CHECK(patch_size >= 1 && in_channels >= 1 && out_channels >= 1, op,
              "patch_size, in_channels and out_channels must be >= 1, got ", patch_size, ", ", in_channels, ", ",
              out_channels);
  FLAME_CHECK(num_layers >= 1, op, "num_layers must be >= 1, got ", num_layers);
  FLAME_CHECK(attention_head_dim >= 1 && num_attention_heads >= 1, op,
              "attention_head_dim and num_attention_heads must be >= 1, got ", attention_head_dim, " and ",
              num_attention_heads);
  FLAME_CHECK(inner_dim() % 4 == 0, op, "the width num_attention_heads x attention_head_dim = ", inner_dim(),
              " must be a multiple of 4 (the 2-d sin-cos position table)");
  FLAME_CHECK(caption_projection_dim == inner_dim(), op, "caption_projection_dim ", caption_projection_dim,
              " must equal the width num_attention_heads x attention_head_dim = ", num_attention_heads, " x ",
              attention_head_dim, " = ", inner_dim(), " (the joint blocks add the streams)");
  FLAME_CHECK(joint_attention_dim >= 1 && pooled_projection_dim >= 1, op,
              "joint_attention_dim and pooled_projection_dim must be >= 1, got ", joint_attention_dim, " and ",
              pooled_projection_dim);
  FLAME_CHECK(pos_embed_max_size >= 1, op, "pos_embed_max_size must be >= 1 (SD3 crops its position table), got ",
              pos_embed_max_size);
  FLAME_CHECK(sample_size >= patch_size, op, "sample_size ", sample_size, " must be >= patch_size ", patch_size);
  FLAME_CHECK(qk_norm.empty() || qk_norm == "rms_norm", op, "qk_norm is \"", qk_norm,
              "\"; SD3/SD3.5 use none (\"\") or \"rms_norm\"");
  for (int64_t l : dual_attention_layers) {
    FLAME_CHECK(l >= 0 && l < num_layers, op, "dual_attention_layers ", join(dual_attention_layers), " holds ", l,
                ", not a block index in [0, ", num_layers, ")");
  }
}

SD3TransformerConfig sd3_preset(const std::string& name) {
  SD3TransformerConfig c;
  c.sample_size = 128;
  c.patch_size = 2;
  c.in_channels = 16;
  c.out_channels = 16;
  c.attention_head_dim = 64;
  c.joint_attention_dim = 4096;
  c.pooled_projection_dim = 2048;
  if (name == "sd3-medium") {
    c.num_layers = 24;
    c.num_attention_heads = 24;
    c.pos_embed_max_size = 192;
  } else if (name == "sd3.5-medium") {
    c.num_layers = 24;
    c.num_attention_heads = 24;
    c.pos_embed_max_size = 384;
    c.qk_norm = "rms_norm";
    for (int64_t i = 0; i <= 12; ++i) c.dual_attention_layers.push_back(i);
  } else if (name == "sd3.5-large") {
    c.num_layers = 38;
    c.num_attention_heads = 38;
    c.pos_embed_max_size = 192;
    c.qk_norm = "rms_norm";
  } else {
    FLAME_FAIL("sd3_preset", "unknown preset \"", name, "\"; presets: sd3-medium, sd3.5-medium, sd3.5-large");
  }
  c.caption_projection_dim = c.inner_dim();
  c.validate();
  return c;
}

SD3TransformerConfig sd3_config_from_json(const JsonConfig& j) {
  const char* op = "sd3_config";
  static const std::vector<std::string> known = {"sample_size",
                                                 "patch_size",
                                                 "in_channels",
                                                 "num_layers",
                                                 "attention_head_dim",
                                                 "num_attention_heads",
                                                 "joint_attention_dim",
                                                 "caption_projection_dim",
                                                 "pooled_projection_dim",
                                                 "out_channels",
                                                 "pos_embed_max_size",
                                                 "dual_attention_layers",
                                                 "qk_norm"};
  for (const std::string& key : j.keys()) {
    if (!key.empty() && key[0] == '_') continue;  // _class_name, _diffusers_version, _name_or_path
    FLAME_CHECK(std::find(known.begin(), known.end(), key) != known.end(), op, j.origin(), ": unknown key \"", key,
                "\" (not an SD3Transformer2DModel option this implementation knows)");
  }
  if (j.has("_class_name")) {
    const std::string cls = j.get_string("_class_name");
    FLAME_CHECK(cls == "SD3Transformer2DModel", op, j.origin(), ": _class_name is \"", cls,
                "\", expected \"SD3Transformer2DModel\"");
  }
  SD3TransformerConfig c;  // diffusers' defaults where a key is absent
  c.sample_size = j.get_int("sample_size", c.sample_size);
  c.patch_size = j.get_int("patch_size", c.patch_size);
  c.in_channels = j.get_int("in_channels", c.in_channels);
  c.num_layers = j.get_int("num_layers", c.num_layers);
  c.attention_head_dim = j.get_int("attention_head_dim", c.attention_head_dim);
  c.num_attention_heads = j.get_int("num_attention_heads", c.num_attention_heads);
  c.joint_attention_dim = j.get_int("joint_attention_dim", c.joint_attention_dim);
  c.caption_projection_dim = j.get_int("caption_projection_dim", c.caption_projection_dim);
  c.pooled_projection_dim = j.get_int("pooled_projection_dim", c.pooled_projection_dim);
  c.out_channels = j.get_int("out_channels", c.in_channels);
  FLAME_CHECK(j.has("pos_embed_max_size"), op, j.origin(),
              ": pos_embed_max_size is missing or null; SD3 models crop a fixed position table (192 or 384)");
  c.pos_embed_max_size = j.get_int("pos_embed_max_size");
  c.dual_attention_layers = j.get_ints("dual_attention_layers", {});
  c.qk_norm = j.get_string("qk_norm", "");
  try {
    c.validate();
  } catch (const flame::Error& e) {
    FLAME_FAIL(op, j.origin(), ": ", e.what());
  }
  return c;
}

SD3TransformerConfig sd3_config_from_file(const std::string& path) {
  return sd3_config_from_json(JsonConfig::from_file(path));
}

// ---- embeddings ----
Tensor sd3_sincos_pos_embed(int64_t dim, int64_t grid, int64_t base_size) {
  FLAME_CHECK(dim % 4 == 0 && grid >= 1 && base_size >= 1, "sd3_sincos_pos_embed",
              "dim must be a multiple of 4 and grid, base_size >= 1; got dim ", dim, ", grid ", grid, ", base_size ",
              base_size);
  // Positions in f32 as diffusers' arange(grid) / (grid / base_size); frequencies and sin/cos in f64.
  const Tensor pos = (Tensor::arange(int64_t{0}, grid, int64_t{1}, {DType::f32}) /
                      (static_cast<double>(grid) / static_cast<double>(base_size)))
                         .to(DType::f64);
  const int64_t quarter = dim / 4;
  const Tensor omega =
      (Tensor::arange(int64_t{0}, quarter, int64_t{1}, {DType::f64}) / static_cast<double>(quarter) * std::log(10000.0))
          .neg()
          .exp();
  const Tensor arg = flame::outer(pos, omega);                 // [grid, dim/4]
  const Tensor axis = flame::cat({arg.sin(), arg.cos()}, -1);  // [grid, dim/2]: one axis
  // Patch (row, col): [axis(col), axis(row)].
  const Tensor by_col = axis.unsqueeze(0).expand({grid, grid, dim / 2});
  const Tensor by_row = axis.unsqueeze(1).expand({grid, grid, dim / 2});
  return flame::cat({by_col, by_row}, -1).reshape({grid * grid, dim}).to(DType::f32);
}

SD3PatchEmbed::SD3PatchEmbed(const SD3TransformerConfig& c, TensorOptions opts)
    : patch_(c.patch_size), max_size_(c.pos_embed_max_size) {
  const int64_t d = c.inner_dim();
  proj = register_module(
      "proj", std::make_shared<nn::Conv2d>(c.in_channels, d, c.patch_size, c.patch_size, 0, 1, 1, true, opts));
  const Tensor table = sd3_sincos_pos_embed(d, c.pos_embed_max_size, c.sample_size / c.patch_size);
  // Owning (clone): a view could not be moved by Module::to (set_data), as the staged 8-bit load does.
  pos_embed = register_buffer("pos_embed", table.unsqueeze(0).to(opts.dtype_or(DType::f32), opts.device).clone());
}

Tensor SD3PatchEmbed::forward(const Tensor& latent) {
  const char* op = "SD3Transformer2DModel";
  const int64_t b = latent.size(0), hh = latent.size(2), ww = latent.size(3);
  FLAME_CHECK(hh % patch_ == 0 && ww % patch_ == 0, op, "latent height and width ", hh, " x ", ww,
              " must be multiples of the patch size ", patch_);
  const int64_t h = hh / patch_, w = ww / patch_;
  FLAME_CHECK(h <= max_size_ && w <= max_size_, op, "latent ", hh, " x ", ww, " is ", h, " x ", w,
              " patches; the position table holds at most ", max_size_, " x ", max_size_,
              " (pos_embed_max_size): use a smaller image");
  Tensor x = proj->forward(latent);  // [B, D, h, w]
  x = x.flatten(2).transpose(1, 2);  // [B, h*w, D]
  const int64_t d = x.size(2);
  const int64_t top = (max_size_ - h) / 2, left = (max_size_ - w) / 2;
  const Tensor crop =
      pos_embed.view({1, max_size_, max_size_, d}).narrow(1, top, h).narrow(2, left, w).reshape({1, h * w, d});
  (void)b;
  return (x + crop).to(latent.dtype());
}

// ---- the joint block ----
SD35AdaLayerNormZeroX::SD35AdaLayerNormZeroX(int64_t embedding_dim, TensorOptions opts) {
  linear = register_module("linear", std::make_shared<nn::Linear>(embedding_dim, 9 * embedding_dim, true, opts));
}

AdaLayerNormZeroXOutput SD35AdaLayerNormZeroX::forward(const Tensor& x, const Tensor& emb) {
  const nn::Module::CallScope scope(*this);
  // shift, scale, gate (attention); shift, scale, gate (MLP); shift, scale, gate (attn2).
  const flame::TensorList m = linear->forward(emb.silu()).chunk(9, 1);
  return {{F::layer_norm_modulate(x, m[0], m[1], kNormEps), m[2], m[3], m[4], m[5]},
          F::layer_norm_modulate(x, m[6], m[7], kNormEps),
          m[8]};
}

SD3JointTransformerBlock::SD3JointTransformerBlock(int64_t dim, int64_t heads, int64_t head_dim, bool context_pre_only,
                                                   bool qk_norm, bool dual_attention, TensorOptions opts)
    : context_pre_only_(context_pre_only) {
  if (dual_attention) {
    norm1_dual = register_module("norm1", std::make_shared<SD35AdaLayerNormZeroX>(dim, opts));
  } else {
    norm1 = register_module("norm1", std::make_shared<AdaLayerNormZero>(dim, true, opts));
  }
  if (context_pre_only) {
    norm1_context_final = register_module(
        "norm1_context", std::make_shared<AdaLayerNormContinuous>(dim, dim, false, kNormEps, true, opts));
  } else {
    norm1_context = register_module("norm1_context", std::make_shared<AdaLayerNormZero>(dim, true, opts));
  }
  JointAttentionOptions a;
  a.query_dim = dim;
  a.heads = heads;
  a.dim_head = head_dim;
  a.added_kv_proj_dim = dim;
  a.qk_norm = qk_norm;
  a.eps = kNormEps;
  a.context_pre_only = context_pre_only;
  a.context_first = false;  // SD3: [image tokens, text tokens]
  attn = register_module("attn", std::make_shared<JointAttention>(a, opts));
  if (dual_attention) {
    JointAttentionOptions self = a;  // a self-attention of the image tokens alone
    self.added_kv_proj_dim = 0;
    self.context_pre_only = false;
    attn2 = register_module("attn2", std::make_shared<JointAttention>(self, opts));
  }
  ff = register_module("ff", std::make_shared<GeluFeedForward>(dim, 0, 4, 0.0, opts));
  if (!context_pre_only)
    ff_context = register_module("ff_context", std::make_shared<GeluFeedForward>(dim, 0, 4, 0.0, opts));
}

std::pair<Tensor, Tensor> SD3JointTransformerBlock::forward(const Tensor& x, const Tensor& context,
                                                            const Tensor& temb) {
  const nn::Module::CallScope scope(*this);
  AdaLayerNormZeroXOutput n;
  if (norm1_dual) {
    n = norm1_dual->forward(x, temb);
  } else {
    n.base = norm1->forward(x, temb);
  }
  const AdaLayerNormZeroOutput& m = n.base;
  AdaLayerNormZeroOutput c;
  if (context_pre_only_) {
    c.x = norm1_context_final->forward(context, temb);
  } else {
    c = norm1_context->forward(context, temb);
  }
  const auto [attn_out, ctx_attn_out] = attn->forward(m.x, c.x);
  Tensor h, norm_h;
  if (attn2) {
    h = F::gated_residual(x, m.gate_msa, attn_out);
    std::tie(h, norm_h) = F::gated_residual_modulate(h, n.gate_msa2, attn2->forward(n.x2, Tensor()).first, m.shift_mlp,
                                                     m.scale_mlp, kNormEps);
  } else {
    std::tie(h, norm_h) = F::gated_residual_modulate(x, m.gate_msa, attn_out, m.shift_mlp, m.scale_mlp, kNormEps);
  }
  h = F::gated_residual(h, m.gate_mlp, ff->forward(norm_h));
  if (context_pre_only_) return {h, Tensor()};
  auto [ctx, norm_c] =
      F::gated_residual_modulate(context, c.gate_msa, ctx_attn_out, c.shift_mlp, c.scale_mlp, kNormEps);
  ctx = F::gated_residual(ctx, c.gate_mlp, ff_context->forward(norm_c));
  return {h, ctx};
}

// ---- the model ----
SD3Transformer2DModel::SD3Transformer2DModel(const SD3TransformerConfig& config, TensorOptions opts) : config_(config) {
  config_.validate();
  const auto& c = config_;
  const int64_t d = c.inner_dim();
  pos_embed = register_module("pos_embed", std::make_shared<SD3PatchEmbed>(c, opts));
  time_text_embed = register_module(
      "time_text_embed", std::make_shared<CombinedTimestepTextProjEmbeddings>(d, c.pooled_projection_dim, false, opts));
  context_embedder = register_module(
      "context_embedder", std::make_shared<nn::Linear>(c.joint_attention_dim, c.caption_projection_dim, true, opts));
  transformer_blocks = register_module("transformer_blocks", std::make_shared<nn::ModuleList>());
  for (int64_t i = 0; i < c.num_layers; ++i) {
    transformer_blocks->push_back(std::make_shared<SD3JointTransformerBlock>(
        d, c.num_attention_heads, c.attention_head_dim, i == c.num_layers - 1, c.qk_norm == "rms_norm",
        c.dual_attention(i), opts));
  }
  norm_out = register_module("norm_out", std::make_shared<AdaLayerNormContinuous>(d, d, false, kNormEps, true, opts));
  proj_out = register_module("proj_out",
                             std::make_shared<nn::Linear>(d, c.patch_size * c.patch_size * c.out_channels, true, opts));
}

std::string SD3Transformer2DModel::extra_repr() const {
  const auto& c = config_;
  std::string s = "layers=" + std::to_string(c.num_layers) + ", heads=" + std::to_string(c.num_attention_heads) + "x" +
                  std::to_string(c.attention_head_dim) + ", pos_embed_max_size=" + std::to_string(c.pos_embed_max_size);
  if (!c.qk_norm.empty()) s += ", qk_norm=" + c.qk_norm;
  if (!c.dual_attention_layers.empty()) s += ", dual_attention_layers=" + join(c.dual_attention_layers);
  return s;
}

void SD3Transformer2DModel::set_gradient_checkpointing(bool on, int64_t blocks) {
  FLAME_CHECK(blocks >= -1, "SD3Transformer2DModel::set_gradient_checkpointing",
              "blocks must be -1 (all) or >= 0, got ", blocks);
  const int64_t n = config_.num_layers;
  checkpointed_ = !on ? 0 : blocks < 0 ? n : std::min(blocks, n);
}

std::vector<flame::nn::ModulePtr> SD3Transformer2DModel::stack_blocks() const {
  std::vector<flame::nn::ModulePtr> out;
  for (const auto& m : *transformer_blocks) out.push_back(m);
  return out;
}

std::vector<std::string> SD3Transformer2DModel::add_lora(const flame::nn::LoraOptions& options,
                                                         const std::vector<std::string>& targets) {
  return flame::nn::apply_lora(*this, options, targets);
}

Tensor SD3Transformer2DModel::forward(const Tensor& hidden_states, const Tensor& encoder_hidden_states,
                                      const Tensor& pooled_projections, const Tensor& timestep) {
  const char* op = "SD3Transformer2DModel";
  const auto& c = config_;
  FLAME_CHECK(hidden_states.defined() && hidden_states.dim() == 4 && hidden_states.size(1) == c.in_channels, op,
              "hidden_states must be [B, ", c.in_channels, ", H, W], got ",
              hidden_states.defined() ? flame::shape_str(hidden_states.sizes()) : std::string("undefined"));
  const int64_t b = hidden_states.size(0);
  FLAME_CHECK(
      encoder_hidden_states.defined() && encoder_hidden_states.dim() == 3 && encoder_hidden_states.size(0) == b &&
          encoder_hidden_states.size(2) == c.joint_attention_dim,
      op, "encoder_hidden_states must be [", b, ", S, ", c.joint_attention_dim, "] (joint_attention_dim), got ",
      encoder_hidden_states.defined() ? flame::shape_str(encoder_hidden_states.sizes()) : std::string("undefined"));
  FLAME_CHECK(pooled_projections.defined() && pooled_projections.dim() == 2 && pooled_projections.size(0) == b &&
                  pooled_projections.size(1) == c.pooled_projection_dim,
              op, "pooled_projections must be [", b, ", ", c.pooled_projection_dim, "] (pooled_projection_dim), got ",
              pooled_projections.defined() ? flame::shape_str(pooled_projections.sizes()) : std::string("undefined"));
  FLAME_CHECK(timestep.defined(), op, "timestep is undefined");
  Tensor t = timestep.dim() == 0 ? timestep.reshape({1}) : timestep;
  FLAME_CHECK(t.dim() == 1 && (t.size(0) == b || t.size(0) == 1), op, "timestep must be [B] (B = ", b,
              "), [1] or 0-d, got ", flame::shape_str(timestep.sizes()));
  if (t.size(0) != b) t = t.expand({b});

  const int64_t hh = hidden_states.size(2), ww = hidden_states.size(3);
  Tensor x = pos_embed->forward(hidden_states);
  const Tensor temb = time_text_embed->forward(t.to(hidden_states.device()), pooled_projections);
  Tensor ctx = context_embedder->forward(encoder_hidden_states);
  const int64_t l = x.size(1);
  OffloadScope offload(*this);  // the first blocks' saved tensors, when set_activation_offload asks
  for (int64_t i = 0; i < c.num_layers; ++i) {
    offload.at(i);
    auto block = std::static_pointer_cast<SD3JointTransformerBlock>((*transformer_blocks)[static_cast<std::size_t>(i)]);
    const bool ckpt = i < checkpointed_ && flame::grad_enabled();
    if (ckpt || blocks_routed()) {
      // One output per block call: the streams travel concatenated along the sequence.
      const Tensor out = run_block(static_cast<std::size_t>(i), ckpt, {x, ctx, temb}, [block](const flame::TensorList& in) {
        auto [a, s] = block->forward(in[0], in[1], in[2]);
        return s.defined() ? flame::cat({a, s}, 1) : a;
      });
      ctx = block->context_pre_only() ? Tensor() : out.narrow(1, l, out.size(1) - l);
      x = block->context_pre_only() ? out : out.narrow(1, 0, l);
    } else {
      std::tie(x, ctx) = block->forward(x, ctx, temb);
    }
  }
  offload.finish();
  x = proj_out->forward(norm_out->forward(x, temb));
  const int64_t p = c.patch_size, h = hh / p, w = ww / p;
  x = x.reshape({b, h, w, p, p, c.out_channels}).permute({0, 5, 1, 3, 2, 4});
  return x.reshape({b, c.out_channels, hh, ww});
}

}  // namespace flame_diffusion::models
