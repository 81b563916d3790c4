// FluxTransformer2DModel (models/flux.h, Note [FLUX layout]): config, presets, config.json, latent
// packing, the blocks and the model.
#include "models/flux.h"

#include <optional>
#include <sstream>

#include <flame/offload.h>

namespace flame_diffusion::models {

namespace nn = flame::nn;
namespace F = flame::nn::functional;
using flame::DType;

// ---- config ----
void FluxTransformerConfig::validate() const {
  const char* op = "FluxTransformerConfig";
  FLAME_CHECK(patch_size >= 1 && in_channels >= 1 && out_channels >= 0 && num_layers >= 0 && num_single_layers >= 0 &&
                  attention_head_dim >= 1 && num_attention_heads >= 1 && joint_attention_dim >= 1 &&
                  pooled_projection_dim >= 1,
              op, "sizes must be positive (patch_size ", patch_size, ", in_channels ", in_channels,
              ", attention_head_dim ", attention_head_dim, ", num_attention_heads ", num_attention_heads,
              ", joint_attention_dim ", joint_attention_dim, ", pooled_projection_dim ", pooled_projection_dim,
              ") and depths non-negative (num_layers ", num_layers, ", num_single_layers ", num_single_layers, ")");
  int64_t sum = 0;
  for (int64_t d : axes_dims_rope) {
    FLAME_CHECK(d > 0 && d % 2 == 0, op, "axes_dims_rope ", flame::shape_str(axes_dims_rope),
                " must hold positive even sizes");
    sum += d;
  }
  FLAME_CHECK(sum == attention_head_dim, op, "axes_dims_rope ", flame::shape_str(axes_dims_rope), " sums to ", sum,
              " but attention_head_dim is ", attention_head_dim, " (the rotary embedding covers each head)");
}

std::vector<std::string> flux_preset_names() { return {"flux-dev", "flux-dev-d2", "flux-schnell", "tiny-flux"}; }

FluxTransformerConfig flux_preset(const std::string& name) {
  FluxTransformerConfig c;
  if (name == "flux-dev") {
    c.guidance_embeds = true;
  } else if (name == "flux-schnell") {
    c.guidance_embeds = false;
  } else if (name == "flux-dev-d2") {
    c.guidance_embeds = true;
    c.num_layers = 2;
    c.num_single_layers = 2;
  } else if (name == "tiny-flux") {
    c.in_channels = 16;
    c.num_layers = 2;
    c.num_single_layers = 2;
    c.attention_head_dim = 8;
    c.num_attention_heads = 2;
    c.joint_attention_dim = 24;
    c.pooled_projection_dim = 12;
    c.guidance_embeds = true;
    c.axes_dims_rope = {2, 2, 4};
  } else {
    std::string names;
    for (const std::string& n : flux_preset_names()) names += (names.empty() ? "" : ", ") + n;
    FLAME_CHECK(false, "flux_preset", "unknown FLUX preset '", name, "'; known: ", names);
  }
  c.validate();
  return c;
}

FluxTransformerConfig flux_config_from_json(const JsonConfig& j) {
  const std::string cls = j.get_string("_class_name", "FluxTransformer2DModel");
  FLAME_CHECK(cls == "FluxTransformer2DModel", "flux_config_from_json", j.origin(), ": _class_name is '", cls,
              "', not FluxTransformer2DModel (is this the transformer/ folder of a FLUX.1 pipeline?)");
  FluxTransformerConfig c;
  c.patch_size = j.get_int("patch_size", c.patch_size);
  c.in_channels = j.get_int("in_channels", c.in_channels);
  c.out_channels = j.get_int("out_channels", 0);
  c.num_layers = j.get_int("num_layers", c.num_layers);
  c.num_single_layers = j.get_int("num_single_layers", c.num_single_layers);
  c.attention_head_dim = j.get_int("attention_head_dim", c.attention_head_dim);
  c.num_attention_heads = j.get_int("num_attention_heads", c.num_attention_heads);
  c.joint_attention_dim = j.get_int("joint_attention_dim", c.joint_attention_dim);
  c.pooled_projection_dim = j.get_int("pooled_projection_dim", c.pooled_projection_dim);
  c.guidance_embeds = j.get_bool("guidance_embeds", c.guidance_embeds);
  c.axes_dims_rope = j.get_ints("axes_dims_rope", c.axes_dims_rope);
  try {
    c.validate();
  } catch (const flame::Error& e) {
    FLAME_CHECK(false, "flux_config_from_json", j.origin(), ": ", e.what());
  }
  return c;
}

FluxTransformerConfig flux_config_from_file(const std::string& path) {
  return flux_config_from_json(JsonConfig::from_file(path));
}

// ---- latents and ids ----
Tensor pack_latents(const Tensor& latents) {
  FLAME_CHECK(latents.dim() == 4 && latents.size(2) % 2 == 0 && latents.size(3) % 2 == 0, "pack_latents",
              "latents must be [B, C, H, W] with H and W even, got ", flame::shape_str(latents.sizes()));
  const int64_t b = latents.size(0), c = latents.size(1), h = latents.size(2) / 2, w = latents.size(3) / 2;
  return latents.reshape({b, c, h, 2, w, 2}).permute({0, 2, 4, 1, 3, 5}).reshape({b, h * w, c * 4});
}

Tensor unpack_latents(const Tensor& packed, int64_t height, int64_t width) {
  FLAME_CHECK(height % 2 == 0 && width % 2 == 0 && packed.dim() == 3 &&
                  packed.size(1) == (height / 2) * (width / 2) && packed.size(2) % 4 == 0,
              "unpack_latents", "packed tokens [B, (H/2)(W/2), 4C] for latents ", height, "x", width,
              " (even) expected, got ", flame::shape_str(packed.sizes()));
  const int64_t b = packed.size(0), c = packed.size(2) / 4, h = height / 2, w = width / 2;
  return packed.reshape({b, h, w, c, 2, 2}).permute({0, 3, 1, 4, 2, 5}).reshape({b, c, height, width});
}

Tensor flux_img_ids(int64_t height, int64_t width, flame::Device device) {
  FLAME_CHECK(height > 0 && width > 0 && height % 2 == 0 && width % 2 == 0, "flux_img_ids",
              "latent height and width must be positive and even, got ", height, "x", width);
  const int64_t h = height / 2, w = width / 2;
  std::vector<float> ids(static_cast<std::size_t>(h * w * 3), 0.0f);
  for (int64_t r = 0; r < h; ++r) {
    for (int64_t c = 0; c < w; ++c) {
      ids[static_cast<std::size_t>((r * w + c) * 3 + 1)] = static_cast<float>(r);
      ids[static_cast<std::size_t>((r * w + c) * 3 + 2)] = static_cast<float>(c);
    }
  }
  return Tensor::from_vec(ids, {h * w, 3}).to(device);
}

Tensor flux_txt_ids(int64_t length, flame::Device device) {
  return Tensor::zeros({length, 3}, TensorOptions(DType::f32, device));
}

// ---- blocks ----
namespace {
JointAttentionOptions flux_attention(int64_t dim, int64_t heads, int64_t head_dim, bool joint) {
  JointAttentionOptions o;
  o.query_dim = dim;
  o.heads = heads;
  o.dim_head = head_dim;
  o.added_kv_proj_dim = joint ? dim : 0;
  o.qk_norm = true;
  o.eps = 1e-6;
  o.pre_only = !joint;
  o.context_first = true;
  return o;
}

// gelu_tanh(linear(x)) as one fused op unless the layer carries an unmerged adapter or an 8-bit
// weight.
Tensor linear_gelu_tanh(const nn::Linear& l, const Tensor& x) {
  if ((!l.has_lora() || l.merged()) && !l.is_float8()) return F::linear_gelu(x, l.weight(), l.bias());
  return const_cast<nn::Linear&>(l).forward(x).gelu(true);
}

// The single block's proj_out over cat(a, mlp) along the features, as two GEMMs over the weight's
// column blocks (read in place, an 8-bit weight's too): no [rows, 5 dim] copy forward, and
// backward each input's gradient comes from its own GEMM instead of as a strided piece of one
// [rows, 5 dim] gradient that the attention and the MLP would copy. A layer with an unmerged
// adapter takes the cat.
Tensor proj_of_joined(nn::Linear& l, const Tensor& a, const Tensor& mlp) {
  if (l.has_lora() && !l.merged()) return l.forward(flame::cat({a, mlp}, 2));
  const int64_t d = a.size(-1);
  const Tensor& w = l.weight();
  if (l.is_float8()) {  // one scale per output row: both column blocks keep the layer's scales
    const nn::Float8Options& o = l.float8_options();
    const auto part = [&](const Tensor& x, int64_t start, int64_t n, const Tensor& bias) {
      return F::linear_float8(x, w.narrow(1, start, n), l.weight_scale(), bias, o.compute, o.grad_dtype);
    };
    return part(mlp, d, w.size(1) - d, l.bias()) + part(a, 0, d, Tensor());
  }
  return F::linear(mlp, w.narrow(1, d, w.size(1) - d), l.bias()) + F::linear(a, w.narrow(1, 0, d));
}
}  // namespace

FluxTransformerBlock::FluxTransformerBlock(int64_t dim, int64_t heads, int64_t head_dim, TensorOptions opts) {
  norm1 = register_module("norm1", std::make_shared<AdaLayerNormZero>(dim, true, opts));
  norm1_context = register_module("norm1_context", std::make_shared<AdaLayerNormZero>(dim, true, opts));
  attn = register_module("attn", std::make_shared<JointAttention>(flux_attention(dim, heads, head_dim, true), opts));
  norm2 = register_module("norm2", std::make_shared<nn::LayerNorm>(dim, 1e-6, false, false, opts));
  ff = register_module("ff", std::make_shared<GeluFeedForward>(dim, dim, 4, 0.0, opts));
  norm2_context = register_module("norm2_context", std::make_shared<nn::LayerNorm>(dim, 1e-6, false, false, opts));
  ff_context = register_module("ff_context", std::make_shared<GeluFeedForward>(dim, dim, 4, 0.0, opts));
}

std::pair<Tensor, Tensor> FluxTransformerBlock::forward(const Tensor& hidden, const Tensor& encoder, const Tensor& temb,
                                                        const RotaryEmbedding& rope) {
  const nn::Module::CallScope scope(*this);
  const AdaLayerNormZeroOutput n = norm1->forward(hidden, temb);
  const AdaLayerNormZeroOutput c = norm1_context->forward(encoder, temb);
  const auto [a, ca] = attn->forward(n.x, c.x, rope);
  // x + gate_msa * attn, then the modulated norm2 of it for the MLP (one fused pass on CUDA).
  auto [h, nh] = F::gated_residual_modulate(hidden, n.gate_msa, a, n.shift_mlp, n.scale_mlp, 1e-6);
  h = F::gated_residual(h, n.gate_mlp, ff->forward(nh));
  auto [e, ne] = F::gated_residual_modulate(encoder, c.gate_msa, ca, c.shift_mlp, c.scale_mlp, 1e-6);
  e = F::gated_residual(e, c.gate_mlp, ff_context->forward(ne));
  return {e, h};
}

FluxSingleTransformerBlock::FluxSingleTransformerBlock(int64_t dim, int64_t heads, int64_t head_dim,
                                                       TensorOptions opts) {
  norm = register_module("norm", std::make_shared<AdaLayerNormZeroSingle>(dim, true, opts));
  proj_mlp = register_module("proj_mlp", std::make_shared<nn::Linear>(dim, 4 * dim, true, opts));
  proj_out = register_module("proj_out", std::make_shared<nn::Linear>(5 * dim, dim, true, opts));
  attn = register_module("attn", std::make_shared<JointAttention>(flux_attention(dim, heads, head_dim, false), opts));
}

Tensor FluxSingleTransformerBlock::forward(const Tensor& x, const Tensor& temb, const RotaryEmbedding& rope) {
  const nn::Module::CallScope scope(*this);
  const auto [nx, gate] = norm->forward(x, temb);
  const Tensor mlp = linear_gelu_tanh(*proj_mlp, nx);
  const Tensor a = attn->forward(nx, Tensor(), rope).first;
  return F::gated_residual(x, gate, proj_of_joined(*proj_out, a, mlp));
}

// ---- model ----
FluxTransformer2DModel::FluxTransformer2DModel(const FluxTransformerConfig& config, TensorOptions opts)
    : config_(config) {
  config_.validate();
  const FluxTransformerConfig& c = config_;
  const int64_t d = c.inner_dim();
  time_text_embed = register_module("time_text_embed", std::make_shared<CombinedTimestepTextProjEmbeddings>(
                                                           d, c.pooled_projection_dim, c.guidance_embeds, opts));
  context_embedder = register_module("context_embedder", std::make_shared<nn::Linear>(c.joint_attention_dim, d, true, opts));
  x_embedder = register_module("x_embedder", std::make_shared<nn::Linear>(c.in_channels, d, true, opts));
  transformer_blocks = register_module("transformer_blocks", std::make_shared<nn::ModuleList>());
  for (int64_t i = 0; i < c.num_layers; ++i) {
    transformer_blocks->push_back(
        std::make_shared<FluxTransformerBlock>(d, c.num_attention_heads, c.attention_head_dim, opts));
  }
  single_transformer_blocks = register_module("single_transformer_blocks", std::make_shared<nn::ModuleList>());
  for (int64_t i = 0; i < c.num_single_layers; ++i) {
    single_transformer_blocks->push_back(
        std::make_shared<FluxSingleTransformerBlock>(d, c.num_attention_heads, c.attention_head_dim, opts));
  }
  norm_out = register_module("norm_out", std::make_shared<AdaLayerNormContinuous>(d, d, false, 1e-6, true, opts));
  proj_out = register_module(
      "proj_out", std::make_shared<nn::Linear>(d, c.patch_size * c.patch_size * c.output_channels(), true, opts));
}

std::string FluxTransformer2DModel::extra_repr() const {
  const FluxTransformerConfig& c = config_;
  std::ostringstream os;
  os << "double=" << c.num_layers << ", single=" << c.num_single_layers << ", heads=" << c.num_attention_heads << "x"
     << c.attention_head_dim << ", in=" << c.in_channels << ", joint=" << c.joint_attention_dim
     << ", pooled=" << c.pooled_projection_dim << ", guidance=" << (c.guidance_embeds ? "true" : "false")
     << ", rope=" << flame::shape_str(c.axes_dims_rope);
  return os.str();
}

void FluxTransformer2DModel::set_gradient_checkpointing(int64_t num_blocks) {
  FLAME_CHECK(num_blocks >= kAllFluxBlocks, "FluxTransformer2DModel::set_gradient_checkpointing",
              "num_blocks must be >= 0 (or kAllFluxBlocks = -1 for every block), got ", num_blocks);
  checkpoint_blocks_ = num_blocks < 0 ? this->num_blocks() : std::min(num_blocks, this->num_blocks());
}

std::vector<flame::nn::ModulePtr> FluxTransformer2DModel::stack_blocks() const {
  std::vector<flame::nn::ModulePtr> out;
  for (const auto& m : *transformer_blocks) out.push_back(m);
  for (const auto& m : *single_transformer_blocks) out.push_back(m);
  return out;
}

std::vector<std::string> FluxTransformer2DModel::add_lora(const nn::LoraOptions& options,
                                                          const std::vector<std::string>& targets) {
  return nn::apply_lora(*this, options, targets);
}

namespace {
Tensor ids_2d(const Tensor& ids, const char* name) {
  if (ids.dim() == 3 && ids.size(0) == 1) return ids.select(0, 0);  // diffusers accepts (and warns about) a batch dim
  FLAME_CHECK(ids.dim() == 2 && ids.size(1) == 3, "FluxTransformer2DModel", name, " must be [len, 3], got ",
              flame::shape_str(ids.sizes()));
  return ids;
}

Tensor per_batch(const Tensor& t, int64_t b, const char* name) {
  const Tensor v = t.dim() == 0 ? t.unsqueeze(0) : t;
  FLAME_CHECK(v.dim() == 1 && (v.size(0) == b || v.size(0) == 1), "FluxTransformer2DModel", name,
              " must be [B] (B = ", b, ") or one value, got ", flame::shape_str(t.sizes()));
  return v.size(0) == b ? v : v.expand({b});
}
}  // namespace

RotaryEmbedding FluxTransformer2DModel::rotary_for(const Tensor& txt_ids, const Tensor& img_ids,
                                                   flame::Device device) {
  RotaryCache& k = rotary_cache_;
  if (k.rope.defined() && k.txt_ids.is_same(txt_ids) && k.img_ids.is_same(img_ids) &&
      k.txt_version == txt_ids.version() && k.img_version == img_ids.version() && k.rope.cos.device() == device)
    return k.rope;
  // Ids on the host cost no device read (a training loop's fresh ids tensors each step); equal ids
  // reuse the table, whose cos / sin take milliseconds of host time at 4608 tokens.
  const Tensor txt = ids_2d(txt_ids, "txt_ids"), img = ids_2d(img_ids, "img_ids");
  const Tensor ids =
      flame::cat({txt.to(flame::Device::cpu()).to(DType::f32), img.to(flame::Device::cpu()).to(DType::f32)}, 0)
          .contiguous();
  const bool same_ids = k.rope.defined() && k.rope.cos.device() == device && k.host_ids.sizes() == ids.sizes() &&
                        std::memcmp(k.host_ids.data_ptr(), ids.data_ptr(), ids.nbytes()) == 0;
  if (!same_ids) {
    k.rope = rotary_embedding_from_ids(ids, config_.axes_dims_rope, config_.rope_theta, device);
    k.host_ids = ids;
  }
  k.txt_ids = txt_ids;
  k.img_ids = img_ids;
  k.txt_version = txt_ids.version();
  k.img_version = img_ids.version();
  return k.rope;
}

Tensor FluxTransformer2DModel::forward(const Tensor& hidden_states, const Tensor& encoder_hidden_states,
                                       const Tensor& pooled_projections, const Tensor& timestep, const Tensor& img_ids,
                                       const Tensor& txt_ids, const Tensor& guidance) {
  const char* op = "FluxTransformer2DModel";
  const FluxTransformerConfig& c = config_;
  FLAME_CHECK(hidden_states.dim() == 3 && hidden_states.size(2) == c.in_channels, op, "hidden_states must be [B, N, ",
              c.in_channels, "] (packed latents: pack_latents), got ", flame::shape_str(hidden_states.sizes()));
  const int64_t b = hidden_states.size(0), n = hidden_states.size(1);
  FLAME_CHECK(encoder_hidden_states.dim() == 3 && encoder_hidden_states.size(0) == b &&
                  encoder_hidden_states.size(2) == c.joint_attention_dim,
              op, "encoder_hidden_states must be [", b, ", T, ", c.joint_attention_dim, "] (T5 states), got ",
              flame::shape_str(encoder_hidden_states.sizes()));
  FLAME_CHECK(pooled_projections.dim() == 2 && pooled_projections.size(0) == b, op, "pooled_projections must be [",
              b, ", ", c.pooled_projection_dim, "], got ", flame::shape_str(pooled_projections.sizes()));
  const int64_t t_len = encoder_hidden_states.size(1);
  const Tensor txt = ids_2d(txt_ids, "txt_ids"), img = ids_2d(img_ids, "img_ids");
  FLAME_CHECK(txt.size(0) == t_len && img.size(0) == n, op, "txt_ids ", flame::shape_str(txt.sizes()), " and img_ids ",
              flame::shape_str(img.sizes()), " must have one row per text token (", t_len, ") and image token (", n,
              ")");

  Tensor h = x_embedder->forward(hidden_states);
  const DType dt = h.dtype();
  const Tensor t = per_batch(timestep, b, "timestep").to(dt) * 1000.0;
  const Tensor g = guidance.defined() ? per_batch(guidance, b, "guidance").to(dt) * 1000.0 : Tensor();
  const Tensor temb = time_text_embed->forward(t, pooled_projections, g);
  Tensor e = context_embedder->forward(encoder_hidden_states);
  const RotaryEmbedding rope = rotary_for(txt_ids, img_ids, h.device());

  OffloadScope offload(*this);  // the first blocks' saved tensors, when set_activation_offload asks
  int64_t index = 0;
  for (const auto& m : *transformer_blocks) {
    const auto block = std::static_pointer_cast<FluxTransformerBlock>(m);
    offload.at(index);
    const bool ckpt = index < checkpoint_blocks_ && flame::grad_enabled();
    if (ckpt || blocks_routed()) {
      // One output per block call: the two streams travel concatenated along the sequence.
      const Tensor both = run_block(static_cast<std::size_t>(index), ckpt, {h, e, temb},
                                    [block, rope](const flame::TensorList& in) {
                                      const auto [e2, h2] = block->forward(in[0], in[1], in[2], rope);
                                      return flame::cat({e2, h2}, 1);
                                    });
      e = both.narrow(1, 0, t_len);
      h = both.narrow(1, t_len, n);
    } else {
      std::tie(e, h) = block->forward(h, e, temb, rope);
    }
    ++index;
  }
  Tensor x = flame::cat({e, h}, 1);
  for (const auto& m : *single_transformer_blocks) {
    const auto block = std::static_pointer_cast<FluxSingleTransformerBlock>(m);
    offload.at(index);
    x = run_block(static_cast<std::size_t>(index), index < checkpoint_blocks_, {x, temb},
                  [block, rope](const flame::TensorList& in) { return block->forward(in[0], in[1], rope); });
    ++index;
  }
  offload.finish();
  h = x.narrow(1, t_len, n);
  return proj_out->forward(norm_out->forward(h, temb));
}

}  // namespace flame_diffusion::models
