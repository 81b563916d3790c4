// The SD3 / SD3.5 transformer's stored layouts (Note [Checkpoint files] in checkpoint.h): diffusers
// names (transformer/ folders), and the original MMDiT names of Stability's single files and
// ComfyUI checkpoints ("model.diffusion_model." or bare), as diffusers' single-file converter maps
// them (sd3.h, sd3_original_plan):
//   pos_embed, x_embedder.proj                          -> pos_embed.pos_embed, pos_embed.proj
//   t_embedder.mlp.{0,2} / y_embedder.mlp.{0,2}         -> time_text_embed.{timestep,text}_embedder.linear_{1,2}
//   context_embedder                                    -> context_embedder
//   joint_blocks.N.x_block.attn.qkv (split in 3)        -> transformer_blocks.N.attn.to_{q,k,v}
//   joint_blocks.N.context_block.attn.qkv               -> transformer_blocks.N.attn.add_{q,k,v}_proj
//   joint_blocks.N.{x,context}_block.attn.proj          -> attn.to_out.0 / attn.to_add_out
//   joint_blocks.N.x_block.attn.ln_{q,k}                -> attn.norm_{q,k}            (SD3.5)
//   joint_blocks.N.context_block.attn.ln_{q,k}          -> attn.norm_added_{q,k}      (SD3.5)
//   joint_blocks.N.x_block.attn2.{qkv,proj,ln_q,ln_k}   -> attn2.{to_q/k/v,to_out.0,norm_q,norm_k} (SD3.5-Medium)
//   joint_blocks.N.{x,context}_block.adaLN_modulation.1 -> norm1.linear / norm1_context.linear
//                                                          (the last block's context one: halves swapped)
//   joint_blocks.N.{x,context}_block.mlp.fc{1,2}        -> ff / ff_context .net.0.proj / .net.2
//   final_layer.linear, final_layer.adaLN_modulation.1  -> proj_out, norm_out.linear (halves swapped)
// The variant (SD3-Medium, SD3.5-Medium, SD3.5-Large or another shape) is read from the shapes and
// keys: depth, width, position table, ln_q (QK norm), attn2 (dual attention).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <set>

#include "models/sd3.h"

namespace flame_diffusion::models {

using flame::Shape;

namespace {


// The distinct N of keys "<head>N.*".
std::set<int64_t> indices(const Checkpoint& ck, const std::string& head) {
  std::set<int64_t> out;
  for (const std::string& k : ck.keys()) {
    if (!k.starts_with(head)) continue;
    std::size_t i = head.size(), j = i;
    while (j < k.size() && std::isdigit(static_cast<unsigned char>(k[j]))) ++j;
    if (j > i && j < k.size() && k[j] == '.' && j - i < 7) out.insert(std::stoll(k.substr(i, j - i)));
  }
  return out;
}

// The ".scale_weight" beside a ".weight" of an fp8-scaled file, or "".
std::string scale_of(const Checkpoint& ck, const std::string& key) {
  if (!key.ends_with(".weight")) return "";
  const std::string s = key.substr(0, key.size() - 6) + "scale_weight";
  return ck.contains(s) ? s : "";
}

void copy(const Checkpoint& ck, KeyPlan& plan, const std::string& target, const std::string& source) {
  KeyPlanEntry e;
  e.target = target;
  e.sources = {source};
  if (const std::string s = scale_of(ck, source); !s.empty()) {
    e.op = KeyPlanEntry::Op::kScale;
    e.sources.push_back(s);
  }
  plan.entries.push_back(std::move(e));
}

void swapped(const Checkpoint& ck, KeyPlan& plan, const std::string& target, const std::string& source) {
  KeyPlanEntry e;
  e.target = target;
  e.sources = {source};
  e.op = KeyPlanEntry::Op::kSwapHalves;
  if (const std::string s = scale_of(ck, source); !s.empty()) e.sources.push_back(s);
  plan.entries.push_back(std::move(e));
}

// target_{q,k,v} <- the thirds of a fused qkv weight and bias.
void split_qkv(const Checkpoint& ck, KeyPlan& plan, const std::string& qkv, const std::vector<std::string>& targets) {
  for (const char* p : {"weight", "bias"}) {
    const std::string src = qkv + "." + p;
    const std::string scale = scale_of(ck, src);
    for (int64_t j = 0; j < 3; ++j) {
      KeyPlanEntry e;
      e.target = targets[static_cast<std::size_t>(j)] + "." + p;
      e.sources = {src};
      if (!scale.empty()) e.sources.push_back(scale);
      e.op = KeyPlanEntry::Op::kChunk;
      e.dim = 0;
      e.index = j;
      e.count = 3;
      plan.entries.push_back(std::move(e));
    }
  }
}

void linear(const Checkpoint& ck, KeyPlan& plan, const std::string& target, const std::string& source) {
  for (const char* p : {".weight", ".bias"}) copy(ck, plan, target + p, source + p);
}

}  // namespace

KeyPlan sd3_original_plan(const Checkpoint& ck, const std::string& prefix) {
  KeyPlan plan;
  plan.source_prefix = prefix;
  const std::string& P = prefix;
  copy(ck, plan, "pos_embed.pos_embed", P + "pos_embed");
  linear(ck, plan, "pos_embed.proj", P + "x_embedder.proj");
  linear(ck, plan, "time_text_embed.timestep_embedder.linear_1", P + "t_embedder.mlp.0");
  linear(ck, plan, "time_text_embed.timestep_embedder.linear_2", P + "t_embedder.mlp.2");
  linear(ck, plan, "time_text_embed.text_embedder.linear_1", P + "y_embedder.mlp.0");
  linear(ck, plan, "time_text_embed.text_embedder.linear_2", P + "y_embedder.mlp.2");
  linear(ck, plan, "context_embedder", P + "context_embedder");
  linear(ck, plan, "proj_out", P + "final_layer.linear");
  for (const char* p : {".weight", ".bias"})
    swapped(ck, plan, std::string("norm_out.linear") + p, P + "final_layer.adaLN_modulation.1" + p);

  const std::set<int64_t> blocks = indices(ck, P + "joint_blocks.");
  const int64_t n = blocks.empty() ? 0 : *blocks.rbegin() + 1;
  for (int64_t i = 0; i < n; ++i) {
    const std::string t = "transformer_blocks." + std::to_string(i) + ".";
    const std::string x = P + "joint_blocks." + std::to_string(i) + ".x_block.";
    const std::string c = P + "joint_blocks." + std::to_string(i) + ".context_block.";
    const bool last = i == n - 1;
    split_qkv(ck, plan, x + "attn.qkv", {t + "attn.to_q", t + "attn.to_k", t + "attn.to_v"});
    split_qkv(ck, plan, c + "attn.qkv", {t + "attn.add_q_proj", t + "attn.add_k_proj", t + "attn.add_v_proj"});
    linear(ck, plan, t + "attn.to_out.0", x + "attn.proj");
    if (!last) linear(ck, plan, t + "attn.to_add_out", c + "attn.proj");
    if (ck.contains(x + "attn.ln_q.weight")) {
      copy(ck, plan, t + "attn.norm_q.weight", x + "attn.ln_q.weight");
      copy(ck, plan, t + "attn.norm_k.weight", x + "attn.ln_k.weight");
      copy(ck, plan, t + "attn.norm_added_q.weight", c + "attn.ln_q.weight");
      copy(ck, plan, t + "attn.norm_added_k.weight", c + "attn.ln_k.weight");
    }
    if (ck.has_prefix(x + "attn2.")) {
      split_qkv(ck, plan, x + "attn2.qkv", {t + "attn2.to_q", t + "attn2.to_k", t + "attn2.to_v"});
      linear(ck, plan, t + "attn2.to_out.0", x + "attn2.proj");
      if (ck.contains(x + "attn2.ln_q.weight")) {
        copy(ck, plan, t + "attn2.norm_q.weight", x + "attn2.ln_q.weight");
        copy(ck, plan, t + "attn2.norm_k.weight", x + "attn2.ln_k.weight");
      }
    }
    linear(ck, plan, t + "norm1.linear", x + "adaLN_modulation.1");
    for (const char* p : {".weight", ".bias"}) {
      // The last context block is an AdaLayerNormContinuous: shift, scale stored; scale, shift in diffusers.
      if (last)
        swapped(ck, plan, t + "norm1_context.linear" + p, c + "adaLN_modulation.1" + p);
      else
        copy(ck, plan, t + "norm1_context.linear" + p, c + "adaLN_modulation.1" + p);
    }
    linear(ck, plan, t + "ff.net.0.proj", x + "mlp.fc1");
    linear(ck, plan, t + "ff.net.2", x + "mlp.fc2");
    if (!last) {
      linear(ck, plan, t + "ff_context.net.0.proj", c + "mlp.fc1");
      linear(ck, plan, t + "ff_context.net.2", c + "mlp.fc2");
    }
  }
  // fp8-scaled files: the scales are consumed by their weights' entries; the markers are not loaded.
  for (const std::string& k : ck.keys()) {
    if (!k.starts_with(P)) continue;
    const std::string name = k.substr(P.size());
    if (name == "scaled_fp8" || name.ends_with(".scale_input")) plan.ignored.push_back(k);
  }
  return plan;
}

SD3TransformerConfig sd3_config_from_original(const Checkpoint& ck, const std::string& prefix) {
  const char* op = "load_sd3";
  auto shape = [&](const std::string& key) -> const Shape& {
    FLAME_CHECK(ck.contains(prefix + key), op, ck.description(), ": no ", prefix + key,
                " to read the SD3 configuration from (an SD3/SD3.5 single file has it)");
    return ck.info(prefix + key).shape;
  };
  const Shape& ctx = shape("context_embedder.weight");
  const Shape& x_emb = shape("x_embedder.proj.weight");
  const Shape& pos = shape("pos_embed");
  const Shape& y_emb = shape("y_embedder.mlp.0.weight");
  const Shape& fin = shape("final_layer.linear.weight");
  auto positive = [](const Shape& s) { return std::all_of(s.begin(), s.end(), [](int64_t d) { return d >= 1; }); };
  FLAME_CHECK(ctx.size() == 2 && x_emb.size() == 4 && pos.size() == 3 && y_emb.size() == 2 && fin.size() == 2 &&
                  positive(ctx) && positive(x_emb) && positive(pos) && positive(y_emb) && positive(fin),
              op, ck.description(), ": unexpected ranks or empty dims (the configuration is read from them) of "
              "context_embedder.weight ", flame::shape_str(ctx),
              ", x_embedder.proj.weight ", flame::shape_str(x_emb), ", pos_embed ", flame::shape_str(pos),
              ", y_embedder.mlp.0.weight ", flame::shape_str(y_emb), ", final_layer.linear.weight ",
              flame::shape_str(fin));
  SD3TransformerConfig c;
  const int64_t width = ctx[0];
  const std::set<int64_t> blocks = indices(ck, prefix + "joint_blocks.");
  FLAME_CHECK(!blocks.empty(), op, ck.description(), ": no joint_blocks under \"", prefix, "\"");
  c.num_layers = *blocks.rbegin() + 1;
  // Heads: the QK norm's size is the head size (SD3.5); without it the original MMDiT's rule,
  // heads = depth (SD3-Medium: 24 x 64).
  const std::string ln_q = prefix + "joint_blocks.0.x_block.attn.ln_q.weight";
  if (ck.contains(ln_q)) {
    c.qk_norm = "rms_norm";
    const Shape& s = ck.info(ln_q).shape;
    FLAME_CHECK(s.size() == 1 && s[0] > 0 && width % s[0] == 0, op, ck.description(), ": ", ln_q, " ",
                flame::shape_str(s), " is not a head size that divides the width ", width);
    c.attention_head_dim = s[0];
  } else {
    FLAME_CHECK(width % c.num_layers == 0, op, ck.description(), ": width ", width, " (context_embedder.weight rows) ",
                "does not split into ", c.num_layers, " heads (the MMDiT's heads = depth); give the config ",
                "(SD3LoadOptions::config or config_json)");
    c.attention_head_dim = width / c.num_layers;
  }
  c.num_attention_heads = width / c.attention_head_dim;
  c.caption_projection_dim = width;
  c.joint_attention_dim = ctx[1];
  c.in_channels = x_emb[1];
  c.patch_size = x_emb[2];
  const int64_t m = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(pos[1]))));
  FLAME_CHECK(m * m == pos[1], op, ck.description(), ": pos_embed ", flame::shape_str(pos),
              " does not hold a square table of positions");
  c.pos_embed_max_size = m;
  c.pooled_projection_dim = y_emb[1];
  FLAME_CHECK(fin[0] % (c.patch_size * c.patch_size) == 0, op, ck.description(), ": final_layer.linear.weight ",
              flame::shape_str(fin), " rows are not a multiple of patch^2 = ", c.patch_size * c.patch_size);
  c.out_channels = fin[0] / (c.patch_size * c.patch_size);
  for (int64_t i : blocks) {
    if (ck.has_prefix(prefix + "joint_blocks." + std::to_string(i) + ".x_block.attn2."))
      c.dual_attention_layers.push_back(i);
  }
  try {
    c.validate();
  } catch (const flame::Error& e) {
    FLAME_FAIL(op, ck.description(), ": the shapes give an inconsistent SD3 configuration: ", e.what());
  }
  return c;
}

std::string sd3_family_of(const SD3TransformerConfig& c) {
  for (const char* name : {"sd3-medium", "sd3.5-medium", "sd3.5-large"}) {
    const SD3TransformerConfig p = sd3_preset(name);
    if (p.num_layers == c.num_layers && p.num_attention_heads == c.num_attention_heads &&
        p.attention_head_dim == c.attention_head_dim && p.pos_embed_max_size == c.pos_embed_max_size &&
        p.qk_norm == c.qk_norm && p.dual_attention_layers == c.dual_attention_layers &&
        p.in_channels == c.in_channels && p.joint_attention_dim == c.joint_attention_dim &&
        p.pooled_projection_dim == c.pooled_projection_dim && p.patch_size == c.patch_size)
      return name;
  }
  return "custom";
}

// ---- formats and loading ----
namespace {

std::optional<std::string> detect_diffusers(const Checkpoint& ck) {
  if (ck.contains("pos_embed.proj.weight") && ck.contains("time_text_embed.timestep_embedder.linear_1.weight") &&
      ck.has_prefix("transformer_blocks.") && ck.contains("context_embedder.weight"))
    return std::string();
  return std::nullopt;
}

std::optional<std::string> detect_original(const Checkpoint& ck) {
  for (const char* prefix : {kSD3OriginalPrefix, ""}) {
    const std::string p = prefix;
    if (ck.contains(p + "x_embedder.proj.weight") && ck.contains(p + "pos_embed") &&
        ck.has_prefix(p + "joint_blocks.0.x_block."))
      return p;
  }
  return std::nullopt;
}

}  // namespace

void register_sd3_formats() {
  register_checkpoint_format({"sd3-diffusers", "sd3", detect_diffusers,
                              [](const Checkpoint& ck, const std::string& prefix) { return identity_plan(ck, prefix); },
                              10});
  register_checkpoint_format({"sd3-original", "sd3", detect_original, sd3_original_plan, 5});
}

namespace {
const bool sd3_formats_registered = (register_sd3_formats(), true);
}  // namespace

SD3FileInfo inspect_sd3(const Checkpoint& ck, const SD3LoadOptions& options) {
  register_sd3_formats();
  SD3FileInfo info;
  info.description = ck.description();
  const DetectedFormat det = detect_checkpoint_format(ck, "sd3");
  info.format = det.format;
  info.prefix = det.prefix;
  if (options.config) {
    info.config = *options.config;
  } else if (!options.config_json.empty()) {
    info.config = sd3_config_from_file(options.config_json);
  } else if (ck.config()) {
    info.config = sd3_config_from_json(*ck.config());
  } else if (info.format == "sd3-original") {
    info.config = sd3_config_from_original(ck, det.prefix);
  } else {
    FLAME_FAIL("load_sd3", ck.description(),
               ": diffusers SD3 names without a config.json beside them; give the "
               "config (SD3LoadOptions::config, config_json, or a preset: sd3_preset(\"sd3.5-large\"))");
  }
  info.config.validate();
  info.family = sd3_family_of(info.config);
  for (const std::string& k : ck.keys()) {
    if (!k.starts_with(det.prefix)) continue;
    const std::string& dt = ck.info(k).dtype;
    if (dt == "F8_E4M3" || dt == "F8_E5M2") {
      info.fp8 = true;
      break;
    }
  }
  return info;
}

std::shared_ptr<SD3Transformer2DModel> load_sd3(const Checkpoint& ck, const SD3LoadOptions& options) {
  const SD3FileInfo info = inspect_sd3(ck, options);
  // An 8-bit load onto a GPU builds and reads the model in host memory, moving each Linear to the
  // GPU as it is quantised: the GPU never holds the full-precision model.
  const bool staged = options.float8 && !options.device.is_cpu();
  auto model = std::make_shared<SD3Transformer2DModel>(
      info.config, flame::TensorOptions{options.dtype, staged ? flame::Device::cpu() : options.device});
  const KeyPlan plan = checkpoint_format(info.format).plan(ck, info.prefix);
  std::string layout = info.format;
  if (info.fp8) layout += ck.has_prefix(info.prefix + "scaled_fp8") ? " (fp8 scaled)" : " (fp8)";
  load_checkpoint(*model, ck, plan,
                  {info.family, layout, options.allow_unplaced, options.float8,
                   staged ? std::optional<flame::Device>(options.device) : std::nullopt});
  if (staged) model->to(options.device);
  return model;
}

std::shared_ptr<SD3Transformer2DModel> load_sd3(const std::string& path, const SD3LoadOptions& options) {
  Checkpoint::OpenOptions open;
  open.subfolder = "transformer";
  open.variant = options.variant;
  return load_sd3(Checkpoint::open(path, open), options);
}

}  // namespace flame_diffusion::models
