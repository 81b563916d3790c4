// The files of the FLUX.1 transformer (models/flux.h): diffusers folders and files, the BFL original
// layout (bare or under ComfyUI's "model.diffusion_model."), fp8 and fp8-scaled variants of both.
//
// Note [FLUX original layout]
// BFL's flux1-dev.safetensors names onto diffusers' (per block i):
//   img_in / txt_in                      x_embedder / context_embedder
//   time_in / guidance_in / vector_in    time_text_embed.timestep_embedder / guidance_embedder /
//     .in_layer, .out_layer                text_embedder (.linear_1, .linear_2)
//   double_blocks.i.img_mod.lin          transformer_blocks.i.norm1.linear (txt_mod: norm1_context)
//   double_blocks.i.img_attn.qkv         attn.to_q / to_k / to_v: the three equal pieces along dim 0
//   double_blocks.i.txt_attn.qkv         attn.add_q_proj / add_k_proj / add_v_proj
//   double_blocks.i.img_attn.norm.{query,key}_norm.scale   attn.norm_q / norm_k .weight
//   double_blocks.i.txt_attn.norm.{query,key}_norm.scale   attn.norm_added_q / norm_added_k .weight
//   double_blocks.i.img_attn.proj / txt_attn.proj          attn.to_out.0 / attn.to_add_out
//   double_blocks.i.img_mlp.0 / .2 (txt_mlp)                ff.net.0.proj / ff.net.2 (ff_context)
//   single_blocks.i.modulation.lin       single_transformer_blocks.i.norm.linear
//   single_blocks.i.linear1              [q, k, v, mlp] along dim 0 with mlp 4x as wide: pieces 0, 1,
//                                        2 of 7 -> attn.to_q/to_k/to_v, pieces 3..6 -> proj_mlp
//   single_blocks.i.norm.{query,key}_norm.scale             attn.norm_q / norm_k .weight
//   single_blocks.i.linear2              proj_out
//   final_layer.linear                   proj_out
//   final_layer.adaLN_modulation.1       norm_out.linear with its halves swapped (BFL: shift, scale;
//                                        diffusers: scale, shift)
// fp8-scaled files (ComfyUI): a "scaled_fp8" marker, ".scale_input" (ignored) and per weight a
// one-element ".scale_weight" that the weight is multiplied by as it is loaded, before the split.
#include <algorithm>
#include <set>
#include <string>

#include "models/flux.h"

namespace flame_diffusion::models {

namespace {


constexpr const char* kComfyPrefix = "model.diffusion_model.";

// Builds a plan whose stored keys live under `prefix`, attaching each weight's fp8 scale.
class PlanBuilder {
 public:
  PlanBuilder(const Checkpoint& ck, std::string prefix) : ck_(ck), p_(std::move(prefix)) { plan_.source_prefix = p_; }

  void copy(const std::string& target, const std::string& source) {
    KeyPlanEntry e = entry(target, source);
    if (e.sources.size() == 2) e.op = KeyPlanEntry::Op::kScale;
    plan_.entries.push_back(std::move(e));
  }
  void chunk(const std::string& target, const std::string& source, int64_t index, int64_t count, int64_t pieces = 1) {
    KeyPlanEntry e = entry(target, source);
    e.op = KeyPlanEntry::Op::kChunk;
    e.index = index;
    e.count = count;
    e.pieces = pieces;
    plan_.entries.push_back(std::move(e));
  }
  void swap_halves(const std::string& target, const std::string& source) {
    KeyPlanEntry e = entry(target, source);
    e.op = KeyPlanEntry::Op::kSwapHalves;
    plan_.entries.push_back(std::move(e));
  }
  // weight and bias
  void linear(const std::string& target, const std::string& source) {
    copy(target + ".weight", source + ".weight");
    copy(target + ".bias", source + ".bias");
  }
  void linear_chunk(const std::string& target, const std::string& source, int64_t index, int64_t count,
                    int64_t pieces = 1) {
    chunk(target + ".weight", source + ".weight", index, count, pieces);
    chunk(target + ".bias", source + ".bias", index, count, pieces);
  }
  // The fp8-scaled file's markers are known and not loaded.
  void ignore_fp8_markers() {
    for (const std::string& k : ck_.keys()) {
      if (!k.starts_with(p_)) continue;
      const std::string name = k.substr(p_.size());
      if (name == "scaled_fp8" || name.ends_with(".scale_input")) plan_.ignored.push_back(k);
    }
  }
  KeyPlan take() { return std::move(plan_); }

 private:
  KeyPlanEntry entry(const std::string& target, const std::string& source) const {
    KeyPlanEntry e;
    e.target = target;
    e.sources = {p_ + source};
    if (source.ends_with(".weight")) {
      const std::string scale = p_ + source.substr(0, source.size() - 7) + ".scale_weight";
      if (ck_.contains(scale)) e.sources.push_back(scale);
    }
    return e;
  }

  const Checkpoint& ck_;
  std::string p_;
  KeyPlan plan_;
};

// 1 + the largest block index of stored keys "<prefix><group>.<i>.", or 0.
// The number of blocks under `prefix` ("double_blocks."): every index from 0 up to the largest must
// be present, so a stray or corrupt key cannot make the model that many blocks deep.
int64_t block_count(const Checkpoint& ck, const std::string& prefix) {
  std::set<int64_t> seen;
  for (const std::string& k : ck.keys()) {
    if (!k.starts_with(prefix)) continue;
    const std::size_t dot = k.find('.', prefix.size());
    if (dot == std::string::npos) continue;
    try {
      seen.insert(std::stoll(k.substr(prefix.size(), dot - prefix.size())));
    } catch (const std::exception&) {
    }
  }
  if (seen.empty()) return 0;
  const int64_t n = *seen.rbegin() + 1;
  FLAME_CHECK(*seen.begin() == 0 && static_cast<int64_t>(seen.size()) == n, "load_flux", ck.description(), ": ",
              prefix, "* keys name ", seen.size(), " blocks with indices from ", *seen.begin(), " to ", n - 1,
              "; the blocks must be numbered 0, 1, ... without gaps (is the file complete?)");
  return n;
}

KeyPlan flux_diffusers_plan(const Checkpoint& ck, const std::string& prefix) {
  PlanBuilder b(ck, prefix);
  for (const std::string& k : ck.keys()) {
    if (!k.starts_with(prefix)) continue;
    const std::string name = k.substr(prefix.size());
    if (name == "scaled_fp8" || name.ends_with(".scale_input") || name.ends_with(".scale_weight")) continue;
    b.copy(name, name);
  }
  b.ignore_fp8_markers();
  return b.take();
}

std::optional<std::string> detect_diffusers(const Checkpoint& ck) {
  if (ck.contains("x_embedder.weight") && ck.contains("context_embedder.weight") &&
      ck.contains("time_text_embed.timestep_embedder.linear_1.weight") &&
      (ck.has_prefix("single_transformer_blocks.") || ck.has_prefix("transformer_blocks.")) &&
      !ck.contains("pos_embed.proj.weight"))
    return std::string();
  return std::nullopt;
}

std::optional<std::string> detect_original(const Checkpoint& ck) {
  for (const char* prefix : {kComfyPrefix, ""}) {
    const std::string p = prefix;
    if (ck.contains(p + "img_in.weight") && ck.contains(p + "txt_in.weight") &&
        ck.contains(p + "final_layer.linear.weight") &&
        (ck.has_prefix(p + "double_blocks.") || ck.has_prefix(p + "single_blocks.")))
      return p;
  }
  return std::nullopt;
}

// The architecture read from the stored shapes (single files carry no config).
FluxTransformerConfig config_from_shapes(const Checkpoint& ck, const std::string& format, const std::string& p) {
  const bool bfl = format == "flux-original";
  // The configuration is read from these shapes: each must be a matrix (or a vector) of sizes >= 1.
  auto shape = [&](const std::string& name) -> const flame::Shape& {
    const flame::Shape& s = ck.info(p + name).shape;
    const std::size_t rank = name.ends_with("_norm.scale") || name.ends_with("norm_q.weight") ? 1 : 2;
    FLAME_CHECK(s.size() == rank && std::all_of(s.begin(), s.end(), [](int64_t d) { return d >= 1; }), "load_flux",
                ck.description(), ": ", p + name, " has shape ", flame::shape_str(s), ", expected ", rank,
                " dims of at least 1 (the configuration is read from it): a damaged or foreign file");
    return s;
  };
  FluxTransformerConfig c;
  const flame::Shape& x_in = shape(bfl ? "img_in.weight" : "x_embedder.weight");
  c.in_channels = x_in.at(1);
  const int64_t inner = x_in.at(0);
  c.joint_attention_dim = shape(bfl ? "txt_in.weight" : "context_embedder.weight").at(1);
  c.pooled_projection_dim = shape(bfl ? "vector_in.in_layer.weight" : "time_text_embed.text_embedder.linear_1.weight").at(1);
  c.guidance_embeds = ck.contains(p + (bfl ? "guidance_in.in_layer.weight" : "time_text_embed.guidance_embedder.linear_1.weight"));
  c.num_layers = block_count(ck, p + (bfl ? "double_blocks." : "transformer_blocks."));
  c.num_single_layers = block_count(ck, p + (bfl ? "single_blocks." : "single_transformer_blocks."));
  std::string qnorm;
  if (c.num_layers > 0) {
    qnorm = bfl ? "double_blocks.0.img_attn.norm.query_norm.scale" : "transformer_blocks.0.attn.norm_q.weight";
  } else {
    qnorm = bfl ? "single_blocks.0.norm.query_norm.scale" : "single_transformer_blocks.0.attn.norm_q.weight";
  }
  c.attention_head_dim = shape(qnorm).at(0);
  FLAME_CHECK(inner % c.attention_head_dim == 0, "load_flux", ck.description(), ": width ", inner,
              " is not a multiple of the head dim ", c.attention_head_dim, " (", p + qnorm, ")");
  c.num_attention_heads = inner / c.attention_head_dim;
  const int64_t out = shape(bfl ? "final_layer.linear.weight" : "proj_out.weight").at(0);
  c.out_channels = out == c.in_channels ? 0 : out;
  FLAME_CHECK(c.attention_head_dim == 128, "load_flux", ck.description(), ": head dim ", c.attention_head_dim,
              " is not FLUX.1's 128, so the rotary axes cannot be assumed (16, 56, 56); give the config "
              "(FluxLoadOptions::config, config_json or family)");
  c.validate();
  return c;
}

std::string guess_family(const FluxTransformerConfig& c) {
  const FluxTransformerConfig dev = flux_preset("flux-dev");
  if (c.inner_dim() == dev.inner_dim() && c.num_layers == dev.num_layers &&
      c.num_single_layers == dev.num_single_layers && c.in_channels == dev.in_channels &&
      c.joint_attention_dim == dev.joint_attention_dim && c.pooled_projection_dim == dev.pooled_projection_dim)
    return c.guidance_embeds ? "flux-dev" : "flux-schnell";
  return "flux";
}

}  // namespace

KeyPlan flux_original_plan(const Checkpoint& ck, const std::string& prefix) {
  PlanBuilder b(ck, prefix);
  b.linear("x_embedder", "img_in");
  b.linear("context_embedder", "txt_in");
  b.linear("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer");
  b.linear("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer");
  if (ck.contains(prefix + "guidance_in.in_layer.weight")) {
    b.linear("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer");
    b.linear("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer");
  }
  b.linear("time_text_embed.text_embedder.linear_1", "vector_in.in_layer");
  b.linear("time_text_embed.text_embedder.linear_2", "vector_in.out_layer");
  const int64_t n_double = block_count(ck, prefix + "double_blocks.");
  for (int64_t i = 0; i < n_double; ++i) {
    const std::string t = "transformer_blocks." + std::to_string(i) + ".";
    const std::string s = "double_blocks." + std::to_string(i) + ".";
    b.linear(t + "norm1.linear", s + "img_mod.lin");
    b.linear(t + "norm1_context.linear", s + "txt_mod.lin");
    const char* img[3] = {"attn.to_q", "attn.to_k", "attn.to_v"};
    const char* txt[3] = {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"};
    for (int64_t j = 0; j < 3; ++j) {
      b.linear_chunk(t + img[j], s + "img_attn.qkv", j, 3);
      b.linear_chunk(t + txt[j], s + "txt_attn.qkv", j, 3);
    }
    b.copy(t + "attn.norm_q.weight", s + "img_attn.norm.query_norm.scale");
    b.copy(t + "attn.norm_k.weight", s + "img_attn.norm.key_norm.scale");
    b.copy(t + "attn.norm_added_q.weight", s + "txt_attn.norm.query_norm.scale");
    b.copy(t + "attn.norm_added_k.weight", s + "txt_attn.norm.key_norm.scale");
    b.linear(t + "attn.to_out.0", s + "img_attn.proj");
    b.linear(t + "attn.to_add_out", s + "txt_attn.proj");
    b.linear(t + "ff.net.0.proj", s + "img_mlp.0");
    b.linear(t + "ff.net.2", s + "img_mlp.2");
    b.linear(t + "ff_context.net.0.proj", s + "txt_mlp.0");
    b.linear(t + "ff_context.net.2", s + "txt_mlp.2");
  }
  const int64_t n_single = block_count(ck, prefix + "single_blocks.");
  for (int64_t i = 0; i < n_single; ++i) {
    const std::string t = "single_transformer_blocks." + std::to_string(i) + ".";
    const std::string s = "single_blocks." + std::to_string(i) + ".";
    b.linear(t + "norm.linear", s + "modulation.lin");
    b.linear_chunk(t + "attn.to_q", s + "linear1", 0, 7);
    b.linear_chunk(t + "attn.to_k", s + "linear1", 1, 7);
    b.linear_chunk(t + "attn.to_v", s + "linear1", 2, 7);
    b.linear_chunk(t + "proj_mlp", s + "linear1", 3, 7, 4);
    b.copy(t + "attn.norm_q.weight", s + "norm.query_norm.scale");
    b.copy(t + "attn.norm_k.weight", s + "norm.key_norm.scale");
    b.linear(t + "proj_out", s + "linear2");
  }
  b.linear("proj_out", "final_layer.linear");
  b.swap_halves("norm_out.linear.weight", "final_layer.adaLN_modulation.1.weight");
  b.swap_halves("norm_out.linear.bias", "final_layer.adaLN_modulation.1.bias");
  b.ignore_fp8_markers();
  return b.take();
}

void register_flux_formats() {
  register_checkpoint_format({"flux-diffusers", "flux", detect_diffusers, flux_diffusers_plan, 10});
  register_checkpoint_format({"flux-original", "flux", detect_original, flux_original_plan, 5});
}

namespace {
const bool flux_formats_registered = (register_flux_formats(), true);
}  // namespace

FluxFileInfo inspect_flux(const Checkpoint& ck, const FluxLoadOptions& options) {
  register_flux_formats();
  FluxFileInfo info;
  info.description = ck.description();
  const DetectedFormat det = detect_checkpoint_format(ck, "flux");
  info.format = det.format;
  info.prefix = det.prefix;
  for (const std::string& k : ck.keys()) {
    if (k.starts_with(det.prefix) && ck.info(k).dtype.starts_with("F8_")) info.fp8 = true;
  }
  info.fp8_scaled = ck.contains(det.prefix + "scaled_fp8");
  if (options.config) {
    info.config = *options.config;
  } else if (!options.config_json.empty()) {
    info.config = flux_config_from_file(options.config_json);
  } else if (ck.config()) {
    info.config = flux_config_from_json(*ck.config());
  } else if (!options.family.empty()) {
    info.config = flux_preset(options.family);
  } else {
    info.config = config_from_shapes(ck, det.format, det.prefix);
  }
  info.config.validate();
  info.family = options.family.empty() ? guess_family(info.config) : options.family;
  return info;
}

std::shared_ptr<FluxTransformer2DModel> load_flux(const Checkpoint& ck, const FluxLoadOptions& options) {
  const FluxFileInfo info = inspect_flux(ck, options);
  // An 8-bit load onto a GPU builds and reads the model in host memory, moving each Linear to the
  // GPU as it is quantised: the GPU never holds the full-precision model.
  const bool staged = options.float8 && !options.device.is_cpu();
  auto model = std::make_shared<FluxTransformer2DModel>(
      info.config, flame::TensorOptions{options.dtype, staged ? flame::Device::cpu() : options.device});
  const KeyPlan plan = checkpoint_format(info.format).plan(ck, info.prefix);
  load_checkpoint(*model, ck, plan,
                  {info.family + "-transformer", info.format, options.allow_unplaced, options.float8,
                   staged ? std::optional<flame::Device>(options.device) : std::nullopt});
  if (staged) model->to(options.device);
  return model;
}

std::shared_ptr<FluxTransformer2DModel> load_flux(const std::string& path, const FluxLoadOptions& options) {
  Checkpoint::OpenOptions open;
  open.subfolder = "transformer";
  open.variant = options.variant;
  return load_flux(Checkpoint::open(path, open), options);
}

}  // namespace flame_diffusion::models
