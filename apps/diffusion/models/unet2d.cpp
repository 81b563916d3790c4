// UNet2DConditionModel (models/unet2d.h, Note [UNet2D layout]): config, presets, config.json,
// the blocks and the model.
#include "models/unet2d.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <fstream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

namespace flame_diffusion::models {

namespace nn = flame::nn;
namespace F = flame::nn::functional;
using flame::DType;
using flame::Shape;

namespace {

std::string join(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

bool is_cross_down(const std::string& t) { return t == "CrossAttnDownBlock2D"; }
bool is_cross_up(const std::string& t) { return t == "CrossAttnUpBlock2D"; }

template <class T>
std::vector<T> reversed(std::vector<T> v) {
  std::reverse(v.begin(), v.end());
  return v;
}

// Runs block(x) under flame::checkpoint when `on` and grad mode is on, else directly. `fn` must
// capture what it reads by value: the backward calls it again after the forward has returned.
Tensor maybe_checkpoint(bool on, const Tensor& x, const std::function<Tensor(const Tensor&)>& fn) {
  if (!on || !flame::grad_enabled()) return fn(x);
  return flame::checkpoint([fn](const flame::TensorList& in) { return fn(in[0]); }, {x});
}

}  // namespace

// ---- config ----
void UNet2DConditionConfig::validate() const {
  const char* op = "UNet2DConditionConfig";
  const std::size_t n = block_out_channels.size();
  FLAME_CHECK(n >= 1, op, "block_out_channels is empty");
  auto check_len = [&](std::size_t got, const char* field) {
    FLAME_CHECK(got == n, op, field, " has ", got, " entries but block_out_channels ", join(block_out_channels),
                " has ", n, " (one per down block)");
  };
  check_len(down_block_types.size(), "down_block_types");
  check_len(up_block_types.size(), "up_block_types");
  check_len(layers_per_block.size(), "layers_per_block");
  check_len(transformer_layers_per_block.size(), "transformer_layers_per_block");
  check_len(cross_attention_dim.size(), "cross_attention_dim");
  check_len(attention_heads.size(), "attention_head_dim (heads per block)");
  FLAME_CHECK(norm_num_groups > 0, op, "norm_num_groups must be > 0, got ", norm_num_groups);
  FLAME_CHECK(in_channels > 0 && out_channels > 0, op, "in_channels and out_channels must be > 0, got ", in_channels,
              " and ", out_channels);
  for (std::size_t i = 0; i < n; ++i) {
    const std::string& d = down_block_types[i];
    const std::string& u = up_block_types[i];
    FLAME_CHECK(d == "DownBlock2D" || d == "CrossAttnDownBlock2D", op, "down_block_types[", i, "] is \"", d,
                "\"; this UNet builds DownBlock2D and CrossAttnDownBlock2D");
    FLAME_CHECK(u == "UpBlock2D" || u == "CrossAttnUpBlock2D", op, "up_block_types[", i, "] is \"", u,
                "\"; this UNet builds UpBlock2D and CrossAttnUpBlock2D");
    const int64_t ch = block_out_channels[i];
    FLAME_CHECK(ch > 0 && ch % norm_num_groups == 0, op, "block_out_channels[", i, "] = ", ch,
                " is not a positive multiple of norm_num_groups ", norm_num_groups);
    FLAME_CHECK(layers_per_block[i] >= 1, op, "layers_per_block[", i, "] must be >= 1, got ", layers_per_block[i]);
    FLAME_CHECK(transformer_layers_per_block[i] >= 1, op, "transformer_layers_per_block[", i, "] must be >= 1, got ",
                transformer_layers_per_block[i]);
    FLAME_CHECK(attention_heads[i] >= 1 && ch % attention_heads[i] == 0, op, "block ", i, ": ", ch,
                " channels do not split into attention_head_dim (heads) = ", attention_heads[i], " heads");
    FLAME_CHECK(cross_attention_dim[i] >= 1, op, "cross_attention_dim[", i, "] must be >= 1, got ",
                cross_attention_dim[i]);
  }
  FLAME_CHECK(mid_block_type.empty() || mid_block_type == "UNetMidBlock2DCrossAttn", op, "mid_block_type is \"",
              mid_block_type, "\"; this UNet builds UNetMidBlock2DCrossAttn or none (\"\")");
  FLAME_CHECK(addition_embed_type.empty() || addition_embed_type == "text_time", op, "addition_embed_type is \"",
              addition_embed_type, "\"; this UNet builds \"text_time\" (SDXL) or none");
  if (addition_embed_type == "text_time") {
    FLAME_CHECK(addition_time_embed_dim > 0 && projection_class_embeddings_input_dim > 0, op,
                "addition_embed_type \"text_time\" needs addition_time_embed_dim and "
                "projection_class_embeddings_input_dim > 0, got ",
                addition_time_embed_dim, " and ", projection_class_embeddings_input_dim);
  }
  FLAME_CHECK(conv_in_kernel % 2 == 1 && conv_out_kernel % 2 == 1, op, "conv_in_kernel and conv_out_kernel must be odd, got ",
              conv_in_kernel, " and ", conv_out_kernel);
  FLAME_CHECK(downsample_padding >= 0 && downsample_padding <= 1, op, "downsample_padding must be 0 or 1, got ",
              downsample_padding);
  FLAME_CHECK(dropout >= 0.0 && dropout < 1.0, op, "dropout must be in [0, 1), got ", dropout);
}

UNet2DConditionConfig unet2d_preset(const std::string& name) {
  UNet2DConditionConfig c;
  if (name == "sdxl") {
    c.sample_size = 128;
    c.down_block_types = {"DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"};
    c.up_block_types = {"CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"};
    c.block_out_channels = {320, 640, 1280};
    c.layers_per_block = {2, 2, 2};
    c.transformer_layers_per_block = {1, 2, 10};
    c.cross_attention_dim = {2048, 2048, 2048};
    c.attention_heads = {5, 10, 20};
    c.use_linear_projection = true;
    c.addition_embed_type = "text_time";
    c.addition_time_embed_dim = 256;
    c.projection_class_embeddings_input_dim = 2816;
  } else if (name == "sd15" || name == "sd21") {
    const bool v2 = name == "sd21";
    c.sample_size = v2 ? 96 : 64;
    c.down_block_types = {"CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"};
    c.up_block_types = {"UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"};
    c.block_out_channels = {320, 640, 1280, 1280};
    c.layers_per_block = {2, 2, 2, 2};
    c.transformer_layers_per_block = {1, 1, 1, 1};
    const int64_t cross = v2 ? 1024 : 768;
    c.cross_attention_dim = {cross, cross, cross, cross};
    c.attention_heads = v2 ? std::vector<int64_t>{5, 10, 20, 20} : std::vector<int64_t>{8, 8, 8, 8};
    c.use_linear_projection = v2;
    c.upcast_attention = v2;
  } else {
    FLAME_CHECK(false, "unet2d_preset", "unknown preset \"", name, "\"; presets: sdxl, sd15, sd21");
  }
  c.validate();
  return c;
}

namespace {

using json = nlohmann::json;

// An int, or a list of ints with one entry per down block, as diffusers allows.
std::vector<int64_t> per_block(const json& v, std::size_t n, const std::string& key, const std::string& source) {
  if (v.is_number_integer()) return std::vector<int64_t>(n, v.get<int64_t>());
  FLAME_CHECK(v.is_array(), "unet2d_config", source, ": \"", key, "\" must be an int or a list of ints, got ", v.dump());
  std::vector<int64_t> out;
  for (const json& e : v) {
    FLAME_CHECK(e.is_number_integer(), "unet2d_config", source, ": \"", key,
                "\" must be an int or a list of ints (nested per-layer lists are not supported), got ", v.dump());
    out.push_back(e.get<int64_t>());
  }
  return out;
}

}  // namespace

UNet2DConditionConfig unet2d_config_from_json(const std::string& json_text, const std::string& source) {
  const char* op = "unet2d_config";
  json j;
  try {
    j = json::parse(json_text);
  } catch (const std::exception& e) {
    FLAME_CHECK(false, op, source, ": not valid JSON (", e.what(), ")");
  }
  FLAME_CHECK(j.is_object(), op, source, ": expected a JSON object (a diffusers UNet2DConditionModel config.json)");
  if (j.contains("_class_name")) {
    FLAME_CHECK(j["_class_name"] == "UNet2DConditionModel", op, source, ": _class_name is ", j["_class_name"].dump(),
                ", expected \"UNet2DConditionModel\"");
  }
  // Keys that select parts of diffusers' UNet this implementation does not build: each must
  // hold its default.
  const std::vector<std::pair<std::string, json>> defaults_only = {
      {"act_fn", "silu"},
      {"class_embed_type", nullptr},
      {"num_class_embeds", nullptr},
      {"class_embeddings_concat", false},
      {"encoder_hid_dim", nullptr},
      {"encoder_hid_dim_type", nullptr},
      {"time_embedding_type", "positional"},
      {"time_embedding_dim", nullptr},
      {"time_embedding_act_fn", nullptr},
      {"timestep_post_act", nullptr},
      {"time_cond_proj_dim", nullptr},
      {"resnet_time_scale_shift", "default"},
      {"resnet_skip_time_act", false},
      {"resnet_out_scale_factor", 1.0},
      {"only_cross_attention", false},
      {"dual_cross_attention", false},
      {"attention_type", "default"},
      {"cross_attention_norm", nullptr},
      {"num_attention_heads", nullptr},
      {"reverse_transformer_layers_per_block", nullptr},
  };
  const std::vector<std::string> used = {
      "sample_size", "in_channels", "out_channels", "center_input_sample", "flip_sin_to_cos", "freq_shift",
      "down_block_types", "mid_block_type", "up_block_types", "block_out_channels", "layers_per_block",
      "downsample_padding", "mid_block_scale_factor", "dropout", "norm_num_groups", "norm_eps",
      "cross_attention_dim", "transformer_layers_per_block", "attention_head_dim", "use_linear_projection",
      "upcast_attention", "addition_embed_type", "addition_time_embed_dim", "projection_class_embeddings_input_dim",
      "conv_in_kernel", "conv_out_kernel",
      // no effect on this architecture: used by addition_embed_type "text" / mid cross-attn variants only
      "addition_embed_type_num_heads", "mid_block_only_cross_attention"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    if (!key.empty() && key[0] == '_') continue;  // _class_name, _diffusers_version, _name_or_path
    auto d = std::find_if(defaults_only.begin(), defaults_only.end(), [&](const auto& p) { return p.first == key; });
    if (d != defaults_only.end()) {
      FLAME_CHECK(it.value() == d->second, op, source, ": \"", key, "\" is ", it.value().dump(),
                  "; this UNet builds only ", d->second.dump(), " (SD 1.x / 2.x / SDXL)");
      continue;
    }
    FLAME_CHECK(std::find(used.begin(), used.end(), key) != used.end(), op, source, ": unknown key \"", key,
                "\" (not a UNet2DConditionModel option this implementation knows)");
  }
  if (j.contains("mid_block_only_cross_attention")) {
    const json& v = j["mid_block_only_cross_attention"];
    FLAME_CHECK(v.is_null() || v == false, op, source, ": \"mid_block_only_cross_attention\" is ", v.dump(),
                "; this UNet builds only null/false");
  }

  UNet2DConditionConfig c;
  auto get = [&](const char* key, auto fallback) {
    using T = decltype(fallback);
    if (!j.contains(key) || j[key].is_null()) return fallback;
    try {
      return j[key].get<T>();
    } catch (const std::exception&) {
      FLAME_CHECK(false, op, source, ": \"", key, "\" has the wrong type: ", j[key].dump());
    }
    return fallback;
  };
  c.sample_size = j.contains("sample_size") && j["sample_size"].is_array() ? j["sample_size"][0].get<int64_t>()
                                                                            : get("sample_size", c.sample_size);
  c.in_channels = get("in_channels", c.in_channels);
  c.out_channels = get("out_channels", c.out_channels);
  c.center_input_sample = get("center_input_sample", c.center_input_sample);
  c.flip_sin_to_cos = get("flip_sin_to_cos", c.flip_sin_to_cos);
  c.freq_shift = get("freq_shift", c.freq_shift);
  // diffusers' defaults (SD 1.x) where a key is absent.
  c.down_block_types = get("down_block_types", std::vector<std::string>{"CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                                                        "CrossAttnDownBlock2D", "DownBlock2D"});
  c.up_block_types = get("up_block_types", std::vector<std::string>{"UpBlock2D", "CrossAttnUpBlock2D",
                                                                    "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"});
  c.mid_block_type = (j.contains("mid_block_type") && j["mid_block_type"].is_null())
                         ? std::string()
                         : get("mid_block_type", std::string("UNetMidBlock2DCrossAttn"));
  c.block_out_channels = get("block_out_channels", std::vector<int64_t>{320, 640, 1280, 1280});
  const std::size_t n = c.block_out_channels.size();
  auto list = [&](const char* key, json fallback) {
    return per_block(j.contains(key) && !j[key].is_null() ? j[key] : fallback, n, key, source);
  };
  c.layers_per_block = list("layers_per_block", 2);
  c.transformer_layers_per_block = list("transformer_layers_per_block", 1);
  c.cross_attention_dim = list("cross_attention_dim", 1280);
  c.attention_heads = list("attention_head_dim", 8);
  c.downsample_padding = get("downsample_padding", c.downsample_padding);
  c.mid_block_scale_factor = get("mid_block_scale_factor", c.mid_block_scale_factor);
  c.dropout = get("dropout", c.dropout);
  c.norm_num_groups = get("norm_num_groups", c.norm_num_groups);
  c.norm_eps = get("norm_eps", c.norm_eps);
  c.use_linear_projection = get("use_linear_projection", c.use_linear_projection);
  c.upcast_attention = get("upcast_attention", c.upcast_attention);
  c.addition_embed_type = get("addition_embed_type", std::string());
  c.addition_time_embed_dim = get("addition_time_embed_dim", int64_t{0});
  c.projection_class_embeddings_input_dim = get("projection_class_embeddings_input_dim", int64_t{0});
  c.conv_in_kernel = get("conv_in_kernel", c.conv_in_kernel);
  c.conv_out_kernel = get("conv_out_kernel", c.conv_out_kernel);
  try {
    c.validate();
  } catch (const flame::Error& e) {
    FLAME_CHECK(false, op, source, ": ", e.what());
  }
  return c;
}

UNet2DConditionConfig unet2d_config_from_file(const std::string& path) {
  std::ifstream f(path);
  FLAME_CHECK(f.good(), "unet2d_config_from_file", "cannot open ", path,
              " (a diffusers UNet config.json: the unet/ folder of a diffusers model)");
  std::stringstream ss;
  ss << f.rdbuf();
  return unet2d_config_from_json(ss.str(), path);
}

// ---- embeddings ----
Tensor timestep_embedding(const Tensor& timesteps, int64_t dim, bool flip_sin_to_cos, double freq_shift) {
  FLAME_CHECK(timesteps.dim() == 1, "timestep_embedding", "timesteps must be 1-d [N], got ", timesteps.dim(), "-d");
  FLAME_CHECK(dim >= 2, "timestep_embedding", "dim must be >= 2, got ", dim);
  const int64_t half = dim / 2;
  // f32 throughout, in diffusers' order of operations, so the frequencies round as theirs.
  const TensorOptions o(DType::f32, timesteps.device());
  Tensor exponent = Tensor::arange(int64_t{0}, half, int64_t{1}, o) * (-std::log(10000.0));
  exponent = exponent / (static_cast<double>(half) - freq_shift);
  const Tensor args = timesteps.to(DType::f32).unsqueeze(1) * exponent.exp().unsqueeze(0);
  Tensor emb = flip_sin_to_cos ? flame::cat({args.cos(), args.sin()}, -1) : flame::cat({args.sin(), args.cos()}, -1);
  if (dim % 2 == 1) emb = flame::pad(emb, {0, 1});
  return emb;
}

TimestepEmbedding::TimestepEmbedding(int64_t in_channels, int64_t time_embed_dim, TensorOptions opts) {
  linear_1 = register_module("linear_1", std::make_shared<nn::Linear>(in_channels, time_embed_dim, true, opts));
  linear_2 = register_module("linear_2", std::make_shared<nn::Linear>(time_embed_dim, time_embed_dim, true, opts));
}

Tensor TimestepEmbedding::forward(const Tensor& x) { return linear_2->forward(linear_1->forward(x).silu()); }

// ---- ResnetBlock2D ----
ResnetBlock2D::ResnetBlock2D(int64_t in_channels, int64_t out_channels, int64_t temb_channels, int64_t groups,
                             double eps, double dropout_p, double output_scale_factor, TensorOptions opts)
    : output_scale_factor_(output_scale_factor) {
  norm1 = register_module("norm1", std::make_shared<nn::GroupNorm>(groups, in_channels, eps, true, opts));
  conv1 = register_module("conv1", std::make_shared<nn::Conv2d>(in_channels, out_channels, 3, 1, 1, 1, 1, true, opts));
  time_emb_proj = register_module("time_emb_proj", std::make_shared<nn::Linear>(temb_channels, out_channels, true, opts));
  norm2 = register_module("norm2", std::make_shared<nn::GroupNorm>(groups, out_channels, eps, true, opts));
  dropout = register_module("dropout", std::make_shared<nn::Dropout>(dropout_p));
  conv2 = register_module("conv2", std::make_shared<nn::Conv2d>(out_channels, out_channels, 3, 1, 1, 1, 1, true, opts));
  if (in_channels != out_channels) {
    conv_shortcut = register_module("conv_shortcut",
                                    std::make_shared<nn::Conv2d>(in_channels, out_channels, 1, 1, 0, 1, 1, true, opts));
  }
}

Tensor ResnetBlock2D::forward(const Tensor& x, const Tensor& temb) {
  const nn::Module::CallScope scope(*this);
  // One statement per step: a temporary of a longer expression lives until the expression ends, a
  // full activation more at the peak of inference.
  Tensor h = norm1->forward(x);
  h = h.silu();
  h = conv1->forward(h);
  const Tensor t = time_emb_proj->forward(temb.silu());
  h = h + t.unsqueeze(-1).unsqueeze(-1);
  h = norm2->forward(h);
  h = h.silu();
  h = dropout->forward(h);
  h = conv2->forward(h);
  Tensor out = (conv_shortcut ? conv_shortcut->forward(x) : x) + h;
  return output_scale_factor_ == 1.0 ? out : out / output_scale_factor_;
}

// ---- attention ----
Attention::Attention(int64_t query_dim, int64_t cross_attention_dim, int64_t heads, int64_t dim_head, double dropout_p,
                     TensorOptions opts)
    : heads_(heads), dim_head_(dim_head), kv_dim_(cross_attention_dim > 0 ? cross_attention_dim : query_dim) {
  const int64_t inner = heads * dim_head;
  to_q = register_module("to_q", std::make_shared<nn::Linear>(query_dim, inner, false, opts));
  to_k = register_module("to_k", std::make_shared<nn::Linear>(kv_dim_, inner, false, opts));
  to_v = register_module("to_v", std::make_shared<nn::Linear>(kv_dim_, inner, false, opts));
  to_out = register_module("to_out", std::make_shared<nn::ModuleList>());
  to_out->push_back(std::make_shared<nn::Linear>(inner, query_dim, true, opts));
  to_out->push_back(std::make_shared<nn::Dropout>(dropout_p));
}

Tensor Attention::forward(const Tensor& x, const Tensor& context) {
  const nn::Module::CallScope scope(*this);
  const Tensor& ctx = context.defined() ? context : x;
  FLAME_CHECK(x.dim() == 3 && ctx.dim() == 3 && ctx.size(0) == x.size(0) && ctx.size(2) == kv_dim_, "Attention",
              "expected x [B, L, ", to_q->in_features(), "] and context [B, S, ", kv_dim_, "], got x ",
              join(x.sizes()), " and context ", join(ctx.sizes()),
              " (encoder_hidden_states' last dim must equal the config's cross_attention_dim)");
  const int64_t b = x.size(0), l = x.size(1), s = ctx.size(1);
  auto heads = [&](const Tensor& t, int64_t len) { return t.view({b, len, heads_, dim_head_}).transpose(1, 2); };
  const Tensor q = heads(to_q->forward(x), l);
  const Tensor k = heads(to_k->forward(ctx), s);
  const Tensor v = heads(to_v->forward(ctx), s);
  Tensor o = F::scaled_dot_product_attention(q, k, v);  // [B, H, L, D]
  o = o.transpose(1, 2).reshape({b, l, heads_ * dim_head_});
  o = (*to_out)[0]->forward(o);
  return (*to_out)[1]->forward(o);
}

GEGLU::GEGLU(int64_t dim_in, int64_t dim_out, TensorOptions opts) {
  proj = register_module("proj", std::make_shared<nn::Linear>(dim_in, dim_out * 2, true, opts));
}

Tensor GEGLU::forward(const Tensor& x) {
  const flame::TensorList parts = proj->forward(x).chunk(2, -1);
  return parts[0] * parts[1].gelu(false);
}

FeedForward::FeedForward(int64_t dim, int64_t mult, double dropout_p, TensorOptions opts) {
  net = register_module("net", std::make_shared<nn::ModuleList>());
  net->push_back(std::make_shared<GEGLU>(dim, dim * mult, opts));
  net->push_back(std::make_shared<nn::Dropout>(dropout_p));
  net->push_back(std::make_shared<nn::Linear>(dim * mult, dim, true, opts));
}

Tensor FeedForward::forward(const Tensor& x) {
  Tensor h = x;
  for (const auto& m : *net) h = m->forward(h);
  return h;
}

BasicTransformerBlock::BasicTransformerBlock(int64_t dim, int64_t heads, int64_t dim_head, int64_t cross_attention_dim,
                                             double dropout_p, TensorOptions opts) {
  norm1 = register_module("norm1", std::make_shared<nn::LayerNorm>(dim, 1e-5, true, true, opts));
  attn1 = register_module("attn1", std::make_shared<Attention>(dim, 0, heads, dim_head, dropout_p, opts));
  norm2 = register_module("norm2", std::make_shared<nn::LayerNorm>(dim, 1e-5, true, true, opts));
  attn2 = register_module("attn2", std::make_shared<Attention>(dim, cross_attention_dim, heads, dim_head, dropout_p, opts));
  norm3 = register_module("norm3", std::make_shared<nn::LayerNorm>(dim, 1e-5, true, true, opts));
  ff = register_module("ff", std::make_shared<FeedForward>(dim, 4, dropout_p, opts));
}

Tensor BasicTransformerBlock::forward(const Tensor& x, const Tensor& context) {
  const nn::Module::CallScope scope(*this);
  Tensor h = x + attn1->forward(norm1->forward(x), Tensor());
  h = h + attn2->forward(norm2->forward(h), context);
  return h + ff->forward(norm3->forward(h));
}

Transformer2DModel::Transformer2DModel(int64_t heads, int64_t dim_head, int64_t in_channels, int64_t num_layers,
                                       int64_t cross_attention_dim, int64_t groups, bool use_linear_projection,
                                       double dropout_p, TensorOptions opts)
    : linear_projection_(use_linear_projection) {
  const int64_t inner = heads * dim_head;
  norm = register_module("norm", std::make_shared<nn::GroupNorm>(groups, in_channels, 1e-6, true, opts));
  if (use_linear_projection) {
    proj_in = register_module("proj_in", std::make_shared<nn::Linear>(in_channels, inner, true, opts));
  } else {
    proj_in = register_module("proj_in", std::make_shared<nn::Conv2d>(in_channels, inner, 1, 1, 0, 1, 1, true, opts));
  }
  transformer_blocks = register_module("transformer_blocks", std::make_shared<nn::ModuleList>());
  for (int64_t i = 0; i < num_layers; ++i) {
    transformer_blocks->push_back(
        std::make_shared<BasicTransformerBlock>(inner, heads, dim_head, cross_attention_dim, dropout_p, opts));
  }
  if (use_linear_projection) {
    proj_out = register_module("proj_out", std::make_shared<nn::Linear>(inner, in_channels, true, opts));
  } else {
    proj_out = register_module("proj_out", std::make_shared<nn::Conv2d>(inner, in_channels, 1, 1, 0, 1, 1, true, opts));
  }
}

Tensor Transformer2DModel::forward(const Tensor& x, const Tensor& context) {
  const nn::Module::CallScope scope(*this);
  FLAME_CHECK(x.dim() == 4, "Transformer2DModel", "expected x [B, C, H, W], got ", x.dim(), "-d");
  const int64_t b = x.size(0), h = x.size(2), w = x.size(3);
  Tensor t = norm->forward(x);
  if (!linear_projection_) t = proj_in->forward(t);
  const int64_t inner = t.size(1);
  t = t.permute({0, 2, 3, 1}).reshape({b, h * w, inner});
  if (linear_projection_) t = proj_in->forward(t);
  for (const auto& m : *transformer_blocks) {
    auto block = std::static_pointer_cast<BasicTransformerBlock>(m);
    t = maybe_checkpoint(checkpointing_, t, [block, context](const Tensor& in) { return block->forward(in, context); });
  }
  if (linear_projection_) t = proj_out->forward(t);
  t = t.reshape({b, h, w, t.size(-1)}).permute({0, 3, 1, 2}).contiguous();
  if (!linear_projection_) t = proj_out->forward(t);
  return t + x;
}

// ---- resampling ----
Downsample2D::Downsample2D(int64_t channels, int64_t padding, TensorOptions opts) : padding_(padding) {
  conv = register_module("conv", std::make_shared<nn::Conv2d>(channels, channels, 3, 2, padding, 1, 1, true, opts));
}

Tensor Downsample2D::forward(const Tensor& x) {
  // padding 0: diffusers pads one row/column at the far end first (the original LDM's asymmetric pad).
  if (padding_ == 0) return conv->forward(flame::pad(x, {0, 1, 0, 1}));
  return conv->forward(x);
}

Upsample2D::Upsample2D(int64_t channels, TensorOptions opts) {
  conv = register_module("conv", std::make_shared<nn::Conv2d>(channels, channels, 3, 1, 1, 1, 1, true, opts));
}

Tensor Upsample2D::forward(const Tensor& x) {
  return conv->forward(F::interpolate(x, F::InterpolateOptions().with_scale(2.0)));
}

Tensor Upsample2D::forward(const Tensor& x, const Shape& size) {
  if (size.empty()) return forward(x);
  FLAME_CHECK(size.size() == 2, "Upsample2D", "size must be [H, W], got ", size.size(), " values");
  return conv->forward(F::interpolate(x, F::InterpolateOptions().with_size(F::Size2(size[0], size[1]))));
}

// ---- blocks ----
namespace {
std::shared_ptr<ResnetBlock2D> make_resnet(const UNet2DConditionConfig& c, int64_t in, int64_t out, double scale,
                                           TensorOptions opts) {
  return std::make_shared<ResnetBlock2D>(in, out, c.time_embed_dim(), c.norm_num_groups, c.norm_eps, c.dropout, scale,
                                         opts);
}
std::shared_ptr<Transformer2DModel> make_transformer(const UNet2DConditionConfig& c, int64_t channels, int64_t heads,
                                                     int64_t layers, int64_t cross, TensorOptions opts) {
  return std::make_shared<Transformer2DModel>(heads, channels / heads, channels, layers, cross, c.norm_num_groups,
                                              c.use_linear_projection, c.dropout, opts);
}
Tensor run_resnet(bool ckpt, const flame::nn::ModulePtr& m, const Tensor& x, const Tensor& temb) {
  auto r = std::static_pointer_cast<ResnetBlock2D>(m);
  return maybe_checkpoint(ckpt, x, [r, temb](const Tensor& in) { return r->forward(in, temb); });
}
Tensor run_attention(const flame::nn::ModulePtr& m, const Tensor& x, const Tensor& context) {
  return std::static_pointer_cast<Transformer2DModel>(m)->forward(x, context);
}
void set_attention_checkpointing(const std::shared_ptr<flame::nn::ModuleList>& list, bool on) {
  if (!list) return;
  for (const auto& m : *list) std::static_pointer_cast<Transformer2DModel>(m)->set_gradient_checkpointing(on);
}
}  // namespace

UNetDownBlock::UNetDownBlock(const UNet2DConditionConfig& c, int64_t index, int64_t in_channels, TensorOptions opts)
    : cross_(is_cross_down(c.down_block_types.at(index))) {
  const int64_t out = c.block_out_channels[index];
  // diffusers registers attentions before resnets (the state dict's order).
  if (cross_) attentions = register_module("attentions", std::make_shared<nn::ModuleList>());
  resnets = register_module("resnets", std::make_shared<nn::ModuleList>());
  for (int64_t i = 0; i < c.layers_per_block[index]; ++i) {
    resnets->push_back(make_resnet(c, i == 0 ? in_channels : out, out, 1.0, opts));
    if (cross_) {
      attentions->push_back(make_transformer(c, out, c.attention_heads[index], c.transformer_layers_per_block[index],
                                             c.cross_attention_dim[index], opts));
    }
  }
  if (index + 1 < c.num_blocks()) {
    downsamplers = register_module("downsamplers", std::make_shared<nn::ModuleList>());
    downsamplers->push_back(std::make_shared<Downsample2D>(out, c.downsample_padding, opts));
  }
}

Tensor UNetDownBlock::forward(const Tensor& x, const Tensor& temb, const Tensor& context, std::vector<Tensor>& skips) {
  const nn::Module::CallScope scope(*this);
  Tensor h = x;
  for (std::size_t i = 0; i < resnets->size(); ++i) {
    h = run_resnet(checkpointing_, (*resnets)[i], h, temb);
    if (cross_) h = run_attention((*attentions)[i], h, context);
    skips.push_back(h);
  }
  if (downsamplers) {
    h = (*downsamplers)[0]->forward(h);
    skips.push_back(h);
  }
  return h;
}

void UNetDownBlock::set_gradient_checkpointing(bool on) {
  checkpointing_ = on;
  set_attention_checkpointing(attentions, on);
}

UNetMidBlock2DCrossAttn::UNetMidBlock2DCrossAttn(const UNet2DConditionConfig& c, TensorOptions opts) {
  const int64_t ch = c.block_out_channels.back();
  attentions = register_module("attentions", std::make_shared<nn::ModuleList>());
  resnets = register_module("resnets", std::make_shared<nn::ModuleList>());
  resnets->push_back(make_resnet(c, ch, ch, c.mid_block_scale_factor, opts));
  attentions->push_back(make_transformer(c, ch, c.attention_heads.back(), c.transformer_layers_per_block.back(),
                                         c.cross_attention_dim.back(), opts));
  resnets->push_back(make_resnet(c, ch, ch, c.mid_block_scale_factor, opts));
}

Tensor UNetMidBlock2DCrossAttn::forward(const Tensor& x, const Tensor& temb, const Tensor& context) {
  const nn::Module::CallScope scope(*this);
  Tensor h = run_resnet(checkpointing_, (*resnets)[0], x, temb);
  for (std::size_t i = 0; i < attentions->size(); ++i) {
    h = run_attention((*attentions)[i], h, context);
    h = run_resnet(checkpointing_, (*resnets)[i + 1], h, temb);
  }
  return h;
}

void UNetMidBlock2DCrossAttn::set_gradient_checkpointing(bool on) {
  checkpointing_ = on;
  set_attention_checkpointing(attentions, on);
}

UNetUpBlock::UNetUpBlock(const UNet2DConditionConfig& c, int64_t index, TensorOptions opts)
    : cross_(is_cross_up(c.up_block_types.at(index))) {
  const int64_t n = c.num_blocks();
  const auto channels = reversed(c.block_out_channels);
  const int64_t out = channels[index];
  const int64_t prev = channels[std::max<int64_t>(index - 1, 0)];
  const int64_t in = channels[std::min(index + 1, n - 1)];
  const int64_t layers = reversed(c.layers_per_block)[index] + 1;
  if (cross_) attentions = register_module("attentions", std::make_shared<nn::ModuleList>());
  resnets = register_module("resnets", std::make_shared<nn::ModuleList>());
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t skip = i == layers - 1 ? in : out;
    const int64_t res_in = i == 0 ? prev : out;
    resnets->push_back(make_resnet(c, res_in + skip, out, 1.0, opts));
    if (cross_) {
      attentions->push_back(make_transformer(c, out, reversed(c.attention_heads)[index],
                                             reversed(c.transformer_layers_per_block)[index],
                                             reversed(c.cross_attention_dim)[index], opts));
    }
  }
  if (index + 1 < n) {
    upsamplers = register_module("upsamplers", std::make_shared<nn::ModuleList>());
    upsamplers->push_back(std::make_shared<Upsample2D>(out, opts));
  }
}

Tensor UNetUpBlock::forward(const Tensor& x, const Tensor& temb, const Tensor& context, std::vector<Tensor>& skips,
                            const Shape& upsample_size) {
  const nn::Module::CallScope scope(*this);
  Tensor h = x;
  for (std::size_t i = 0; i < resnets->size(); ++i) {
    FLAME_CHECK(!skips.empty(), "UNetUpBlock", "no skip connection left for resnet ", i);
    h = flame::cat({h, skips.back()}, 1);
    skips.pop_back();
    h = run_resnet(checkpointing_, (*resnets)[i], h, temb);
    if (cross_) h = run_attention((*attentions)[i], h, context);
  }
  if (upsamplers) h = std::static_pointer_cast<Upsample2D>((*upsamplers)[0])->forward(h, upsample_size);
  return h;
}

void UNetUpBlock::set_gradient_checkpointing(bool on) {
  checkpointing_ = on;
  set_attention_checkpointing(attentions, on);
}

// ---- the model ----
UNet2DConditionModel::UNet2DConditionModel(const UNet2DConditionConfig& config, TensorOptions opts) : config_(config) {
  config_.validate();
  const auto& c = config_;
  const int64_t c0 = c.block_out_channels[0];
  conv_in = register_module("conv_in", std::make_shared<nn::Conv2d>(c.in_channels, c0, c.conv_in_kernel, 1,
                                                                     (c.conv_in_kernel - 1) / 2, 1, 1, true, opts));
  time_embedding = register_module("time_embedding", std::make_shared<TimestepEmbedding>(c0, c.time_embed_dim(), opts));
  if (c.addition_embed_type == "text_time") {
    add_embedding = register_module(
        "add_embedding", std::make_shared<TimestepEmbedding>(c.projection_class_embeddings_input_dim, c.time_embed_dim(), opts));
  }
  // Note [UNet2D layout]: up_blocks is registered before mid_block, as diffusers does.
  down_blocks = register_module("down_blocks", std::make_shared<nn::ModuleList>());
  up_blocks = register_module("up_blocks", std::make_shared<nn::ModuleList>());
  int64_t channels = c0;
  for (int64_t i = 0; i < c.num_blocks(); ++i) {
    down_blocks->push_back(std::make_shared<UNetDownBlock>(c, i, channels, opts));
    channels = c.block_out_channels[i];
  }
  if (!c.mid_block_type.empty()) {
    mid_block = register_module("mid_block", std::make_shared<UNetMidBlock2DCrossAttn>(c, opts));
  }
  for (int64_t i = 0; i < c.num_blocks(); ++i) up_blocks->push_back(std::make_shared<UNetUpBlock>(c, i, opts));
  conv_norm_out = register_module("conv_norm_out", std::make_shared<nn::GroupNorm>(c.norm_num_groups, c0, c.norm_eps, true, opts));
  conv_out = register_module("conv_out", std::make_shared<nn::Conv2d>(c0, c.out_channels, c.conv_out_kernel, 1,
                                                                       (c.conv_out_kernel - 1) / 2, 1, 1, true, opts));
}

std::string UNet2DConditionModel::extra_repr() const {
  std::string s = "block_out_channels=" + join(config_.block_out_channels) +
                  ", cross_attention_dim=" + std::to_string(config_.cross_attention_dim[0]) +
                  ", heads=" + join(config_.attention_heads) +
                  ", transformer_layers=" + join(config_.transformer_layers_per_block);
  if (!config_.addition_embed_type.empty()) s += ", addition_embed_type=" + config_.addition_embed_type;
  return s;
}

void UNet2DConditionModel::set_gradient_checkpointing(bool on) {
  checkpointing_ = on;
  for (const auto& m : *down_blocks) std::static_pointer_cast<UNetDownBlock>(m)->set_gradient_checkpointing(on);
  if (mid_block) mid_block->set_gradient_checkpointing(on);
  for (const auto& m : *up_blocks) std::static_pointer_cast<UNetUpBlock>(m)->set_gradient_checkpointing(on);
}

std::vector<std::string> UNet2DConditionModel::add_lora(const flame::nn::LoraOptions& options,
                                                        const std::vector<std::string>& targets) {
  return flame::nn::apply_lora(*this, options, targets);
}

Tensor UNet2DConditionModel::time_and_added_embedding(const Tensor& sample, const Tensor& timestep,
                                                      const UNet2DAddedConditions& added) {
  const char* op = "UNet2DConditionModel";
  const int64_t b = sample.size(0);
  FLAME_CHECK(timestep.defined(), op, "timestep is undefined");
  Tensor t = timestep.dim() == 0 ? timestep.reshape({1}) : timestep;
  FLAME_CHECK(t.dim() == 1 && (t.size(0) == b || t.size(0) == 1), op, "timestep must be [B] (B = ", b,
              "), [1] or 0-d, got ", t.dim(), "-d with ", t.dim() ? t.size(0) : 0, " entries");
  if (t.size(0) != b) t = t.expand({b});
  const auto& c = config_;
  const Tensor t_emb = timestep_embedding(t.to(sample.device()), c.block_out_channels[0], c.flip_sin_to_cos, c.freq_shift);
  Tensor emb = time_embedding->forward(t_emb.to(sample.dtype()));
  if (!add_embedding) return emb;
  FLAME_CHECK(added.text_embeds.defined() && added.time_ids.defined(), op,
              "addition_embed_type \"text_time\" needs added conditions text_embeds [B, P] and time_ids [B, N]");
  const Tensor& te = added.text_embeds;
  const Tensor& ids = added.time_ids;
  FLAME_CHECK(te.dim() == 2 && ids.dim() == 2 && te.size(0) == b && ids.size(0) == b &&
                  te.size(1) + ids.size(1) * c.addition_time_embed_dim == c.projection_class_embeddings_input_dim,
              op, "text_embeds [", b, ", P] and time_ids [", b, ", N] must give P + N * ", c.addition_time_embed_dim,
              " = projection_class_embeddings_input_dim ", c.projection_class_embeddings_input_dim, "; got text_embeds ",
              te.dim(), "-d ", te.dim() == 2 ? te.size(1) : 0, " wide and time_ids ", ids.dim(), "-d ",
              ids.dim() == 2 ? ids.size(1) : 0, " wide (batch ", te.dim() ? te.size(0) : 0, ")");
  const Tensor time_embeds =
      timestep_embedding(ids.flatten(), c.addition_time_embed_dim, c.flip_sin_to_cos, c.freq_shift)
          .reshape({b, ids.size(1) * c.addition_time_embed_dim});
  const Tensor add = flame::cat({te.to(DType::f32), time_embeds.to(te.device())}, -1).to(emb.dtype());
  return emb + add_embedding->forward(add);
}

Tensor UNet2DConditionModel::forward(const Tensor& sample, const Tensor& timestep, const Tensor& encoder_hidden_states,
                                     const UNet2DAddedConditions& added) {
  const char* op = "UNet2DConditionModel";
  const auto& c = config_;
  FLAME_CHECK(sample.dim() == 4 && sample.size(1) == c.in_channels, op, "sample must be [B, ", c.in_channels,
              ", H, W], got ", sample.dim(), "-d with ", sample.dim() > 1 ? sample.size(1) : 0, " channels");
  FLAME_CHECK(encoder_hidden_states.defined() && encoder_hidden_states.dim() == 3 &&
                  encoder_hidden_states.size(0) == sample.size(0),
              op, "encoder_hidden_states must be [B, S, D] with B = ", sample.size(0));
  std::optional<flame::autograd::RecomputeCheap> recompute;  // Note [UNet2D layout], "Cheap recompute"
  if (recompute_cheap_) recompute.emplace();
  Tensor x = c.center_input_sample ? sample * 2.0 - 1.0 : sample;
  const Tensor emb = time_and_added_embedding(sample, timestep, added);

  Tensor h = conv_in->forward(x);
  std::vector<Tensor> skips{h};
  for (const auto& m : *down_blocks) {
    h = std::static_pointer_cast<UNetDownBlock>(m)->forward(h, emb, encoder_hidden_states, skips);
  }
  if (mid_block) h = mid_block->forward(h, emb, encoder_hidden_states);

  // Latents that are not a multiple of the total down factor: each upsampler goes to the size of
  // the skip it meets next, as diffusers' forward_upsample_size.
  const int64_t factor = int64_t{1} << (c.num_blocks() - 1);
  const bool forward_size = sample.size(2) % factor != 0 || sample.size(3) % factor != 0;
  for (std::size_t i = 0; i < up_blocks->size(); ++i) {
    auto block = std::static_pointer_cast<UNetUpBlock>((*up_blocks)[i]);
    Shape size;
    const std::size_t used = static_cast<std::size_t>(block->num_resnets());
    if (forward_size && i + 1 < up_blocks->size() && skips.size() > used) {
      const Tensor& next = skips[skips.size() - used - 1];
      size = {next.size(2), next.size(3)};
    }
    h = block->forward(h, emb, encoder_hidden_states, skips, size);
  }
  h = conv_norm_out->forward(h).silu();
  return conv_out->forward(h);
}

}  // namespace flame_diffusion::models
