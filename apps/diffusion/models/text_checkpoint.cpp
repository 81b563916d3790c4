// The text encoders' stored layouts and loaders (Note [Text encoder files] in text_checkpoint.h).
#include "models/text_checkpoint.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <map>
#include <optional>

namespace flame_diffusion::models {

namespace fs = std::filesystem;
using flame::Shape;

namespace {


const std::vector<std::string> kClipTransformersPrefixes = {
    "", "conditioner.embedders.0.transformer.", "text_encoders.clip_l.transformer.",
    "text_encoders.clip_g.transformer.", "cond_stage_model.transformer."};
const std::vector<std::string> kOpenClipPrefixes = {"conditioner.embedders.1.model.", "conditioner.embedders.0.model.",
                                                    "cond_stage_model.model.", ""};
const std::vector<std::string> kT5Prefixes = {"", "text_encoders.t5xxl.transformer."};

std::string join(const std::vector<std::string>& v, const std::string& sep = ", ") {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

// The count N of "<head>N." keys: 1 + the largest index.
int64_t count_indexed(const Checkpoint& ck, const std::string& head) {
  int64_t n = 0;
  for (const std::string& k : ck.keys()) {
    if (!k.starts_with(head)) continue;
    const std::size_t dot = k.find('.', head.size());
    const std::string idx = k.substr(head.size(), dot == std::string::npos ? std::string::npos : dot - head.size());
    if (idx.empty() || idx.size() > 5 || !std::all_of(idx.begin(), idx.end(), [](char c) { return std::isdigit(c); }))
      continue;
    n = std::max<int64_t>(n, std::stoll(idx) + 1);
  }
  return n;
}

void ignore_if_present(const Checkpoint& ck, KeyPlan& plan, const std::string& key) {
  if (ck.contains(key)) plan.ignored.push_back(key);
}

void add(KeyPlan& plan, const std::string& target, const std::string& source,
         KeyPlanEntry::Op op = KeyPlanEntry::Op::kCopy) {
  KeyPlanEntry e;
  e.target = target;
  e.sources = {source};
  e.op = op;
  plan.entries.push_back(std::move(e));
}

std::optional<std::string> first_prefix(const Checkpoint& ck, const std::vector<std::string>& prefixes,
                                        const std::vector<std::string>& probes) {
  for (const std::string& p : prefixes) {
    bool all = true;
    for (const std::string& k : probes) all = all && ck.contains(p + k);
    if (all) return p;
  }
  return std::nullopt;
}

const std::vector<std::string> kClipProbe = {"text_model.embeddings.token_embedding.weight",
                                             "text_model.encoder.layers.0.self_attn.q_proj.weight"};
// transformers 5 saves CLIPTextModel(WithProjection) without the "text_model." level.
const std::vector<std::string> kClipFlatProbe = {"embeddings.token_embedding.weight",
                                                 "encoder.layers.0.self_attn.q_proj.weight"};
const std::vector<std::string> kOpenClipProbe = {"token_embedding.weight", "positional_embedding",
                                                 "transformer.resblocks.0.attn.in_proj_weight"};
const std::vector<std::string> kT5Probe = {"encoder.block.0.layer.0.SelfAttention.q.weight",
                                           "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"};

}  // namespace

// ---------------------------------------------------------------- plans

KeyPlan clip_transformers_plan(const Checkpoint& ck, const std::string& prefix) {
  KeyPlan plan = identity_plan(ck, prefix);
  plan.entries.erase(std::remove_if(plan.entries.begin(), plan.entries.end(),
                                    [](const KeyPlanEntry& e) {
                                      return e.target == "text_model.embeddings.position_ids" ||
                                             e.target == "logit_scale";
                                    }),
                     plan.entries.end());
  ignore_if_present(ck, plan, prefix + "text_model.embeddings.position_ids");
  ignore_if_present(ck, plan, prefix + "logit_scale");
  return plan;
}

KeyPlan clip_flat_plan(const Checkpoint& ck, const std::string& prefix) {
  KeyPlan plan;
  plan.source_prefix = prefix;
  for (const std::string& k : ck.keys()) {
    if (k.rfind(prefix, 0) != 0) continue;
    const std::string name = k.substr(prefix.size());
    if (name == "embeddings.position_ids" || name == "logit_scale") {
      ignore_if_present(ck, plan, k);
    } else if (name.rfind("embeddings.", 0) == 0 || name.rfind("encoder.", 0) == 0 ||
               name.rfind("final_layer_norm.", 0) == 0) {
      add(plan, "text_model." + name, k);
    } else if (name == "text_projection.weight") {
      add(plan, name, k);
    }
  }
  return plan;
}

KeyPlan clip_openclip_plan(const Checkpoint& ck, const std::string& prefix) {
  KeyPlan plan;
  plan.source_prefix = prefix;
  const std::string tm = "text_model.";
  add(plan, tm + "embeddings.token_embedding.weight", prefix + "token_embedding.weight");
  add(plan, tm + "embeddings.position_embedding.weight", prefix + "positional_embedding");
  for (const char* p : {"weight", "bias"})
    add(plan, tm + "final_layer_norm." + p, prefix + "ln_final." + p);
  if (ck.contains(prefix + "text_projection"))
    add(plan, "text_projection.weight", prefix + "text_projection", KeyPlanEntry::Op::kTranspose);
  const int64_t layers = count_indexed(ck, prefix + "transformer.resblocks.");
  for (int64_t i = 0; i < layers; ++i) {
    const std::string src = prefix + "transformer.resblocks." + std::to_string(i) + ".";
    const std::string dst = tm + "encoder.layers." + std::to_string(i) + ".";
    for (const char* p : {"weight", "bias"}) {
      const std::string ps = p;
      add(plan, dst + "layer_norm1." + ps, src + "ln_1." + ps);
      add(plan, dst + "layer_norm2." + ps, src + "ln_2." + ps);
      add(plan, dst + "self_attn.out_proj." + ps, src + "attn.out_proj." + ps);
      add(plan, dst + "mlp.fc1." + ps, src + "mlp.c_fc." + ps);
      add(plan, dst + "mlp.fc2." + ps, src + "mlp.c_proj." + ps);
      const char* qkv[] = {"q_proj", "k_proj", "v_proj"};
      for (int64_t j = 0; j < 3; ++j) {
        KeyPlanEntry e;
        e.target = dst + "self_attn." + qkv[j] + "." + ps;
        e.sources = {src + "attn.in_proj_" + ps};
        e.op = KeyPlanEntry::Op::kChunk;
        e.dim = 0;
        e.index = j;
        e.count = 3;
        plan.entries.push_back(std::move(e));
      }
    }
  }
  ignore_if_present(ck, plan, prefix + "logit_scale");
  ignore_if_present(ck, plan, prefix + "attn_mask");
  return plan;
}

KeyPlan t5_transformers_plan(const Checkpoint& ck, const std::string& prefix) {
  KeyPlan plan;
  plan.source_prefix = prefix;
  const bool has_shared = ck.contains(prefix + "shared.weight");
  for (const std::string& k : ck.keys()) {
    if (!k.starts_with(prefix)) continue;
    const std::string name = k.substr(prefix.size());
    if (name == "scaled_fp8" || name.ends_with(".scale_input")) {
      plan.ignored.push_back(k);
      continue;
    }
    if (name.ends_with(".scale_weight")) continue;  // consumed by its weight's entry
    if (name == "encoder.embed_tokens.weight") {
      if (has_shared) plan.ignored.push_back(k);  // the tied copy
      else add(plan, "shared.weight", k);
      continue;
    }
    const std::string scale = name.ends_with(".weight") ? k.substr(0, k.size() - 7) + ".scale_weight" : "";
    if (!scale.empty() && ck.contains(scale)) {
      KeyPlanEntry e;
      e.target = name;
      e.sources = {k, scale};
      e.op = KeyPlanEntry::Op::kScale;
      plan.entries.push_back(std::move(e));
    } else {
      add(plan, name, k);
    }
  }
  return plan;
}

void register_text_formats() {
  register_checkpoint_format(
      {"clip-transformers", "clip",
       [](const Checkpoint& ck) { return first_prefix(ck, kClipTransformersPrefixes, kClipProbe); },
       clip_transformers_plan, 10});
  register_checkpoint_format({"clip-transformers-flat", "clip",
                              [](const Checkpoint& ck) { return first_prefix(ck, {""}, kClipFlatProbe); },
                              clip_flat_plan, 8});
  register_checkpoint_format({"clip-openclip", "clip",
                              [](const Checkpoint& ck) { return first_prefix(ck, kOpenClipPrefixes, kOpenClipProbe); },
                              clip_openclip_plan, 5});
  register_checkpoint_format({"t5-transformers", "t5",
                              [](const Checkpoint& ck) { return first_prefix(ck, kT5Prefixes, kT5Probe); },
                              t5_transformers_plan, 10});
}

namespace {
const bool text_formats_registered = (register_text_formats(), true);

std::string clip_family_of(const std::string& format, const std::string& prefix, int64_t width) {
  if (prefix.find("clip_l") != std::string::npos || prefix == "conditioner.embedders.0.transformer." ||
      prefix == "cond_stage_model.transformer.")
    return "clip-l";
  if (prefix.find("clip_g") != std::string::npos || prefix == "conditioner.embedders.1.model." ||
      prefix == "conditioner.embedders.0.model.")
    return "clip-g";
  if (width == 768) return "clip-l";
  if (width == 1280) return "clip-g";
  (void)format;
  return "custom";
}

}  // namespace

std::vector<TextEncoderEntry> find_text_encoders(const Checkpoint& ck) {
  register_text_formats();
  std::vector<TextEncoderEntry> out;
  auto width = [&](const std::string& key) -> int64_t {
    const Shape& s = ck.info(key).shape;
    return s.size() == 2 ? s[1] : -1;
  };
  for (const std::string& p : kClipTransformersPrefixes) {
    if (!ck.contains(p + kClipProbe[0]) || !ck.contains(p + kClipProbe[1])) continue;
    out.push_back({"clip-transformers", p, clip_family_of("clip-transformers", p, width(p + kClipProbe[0])), "clip"});
  }
  if (first_prefix(ck, {""}, kClipFlatProbe))
    out.push_back({"clip-transformers-flat", "", clip_family_of("clip-transformers-flat", "", width(kClipFlatProbe[0])),
                   "clip"});
  for (const std::string& p : kOpenClipPrefixes) {
    bool all = true;
    for (const std::string& k : kOpenClipProbe) all = all && ck.contains(p + k);
    if (!all) continue;
    out.push_back({"clip-openclip", p, clip_family_of("clip-openclip", p, width(p + kOpenClipProbe[0])), "clip"});
  }
  for (const std::string& p : kT5Prefixes) {
    if (!ck.contains(p + kT5Probe[0]) || !ck.contains(p + kT5Probe[1])) continue;
    const int64_t d = width(p + kT5Probe[0]);
    out.push_back({"t5-transformers", p, d == 4096 ? "t5-xxl" : "custom", "t5"});
  }
  return out;
}

namespace {

// The one entry of `kind` the caller means, or an error naming the file and what it holds.
TextEncoderEntry pick_entry(const Checkpoint& ck, const std::string& kind, const std::string& family) {
  const std::vector<TextEncoderEntry> all = find_text_encoders(ck);
  std::vector<TextEncoderEntry> of_kind, chosen;
  for (const auto& e : all)
    if (e.kind == kind) of_kind.push_back(e);
  const std::string what = kind == "clip" ? "CLIP text encoder" : "T5 encoder";
  if (of_kind.empty()) {
    std::vector<std::string> first;
    for (std::size_t i = 0; i < ck.keys().size() && i < 6; ++i) first.push_back(ck.keys()[i]);
    std::string other;
    for (const auto& e : all) other += (other.empty() ? "" : ", ") + e.family + " (" + e.format + ", prefix \"" + e.prefix + "\")";
    FLAME_FAIL("checkpoint", ck.description(), " holds no ", what, " in a layout FLAME knows (tried: ",
               kind == "clip" ? "clip-transformers, clip-transformers-flat, clip-openclip" : "t5-transformers", "); its first keys: ",
               first.empty() ? std::string("(none: the file is empty)") : join(first),
               other.empty() ? std::string(". Is it a checkpoint of another model?")
                             : ". It holds " + other + ": load that with " +
                                   (kind == "clip" ? "load_t5_encoder" : "load_clip_text"));
  }
  if (of_kind.size() == 1) return of_kind[0];
  for (const auto& e : of_kind)
    if (!family.empty() && e.family == family) chosen.push_back(e);
  if (chosen.size() == 1) return chosen[0];
  std::vector<std::string> list;
  for (const auto& e : of_kind) list.push_back(e.family + " (" + e.format + ", prefix \"" + e.prefix + "\")");
  FLAME_FAIL("checkpoint", ck.description(), " holds ", of_kind.size(), " ", what, "s: ", join(list),
             family.empty() ? std::string(": pick one with family (clip-l or clip-g)")
                            : "; none or several of them are family \"" + family + "\"");
}

// The shape of `name`, which the configuration is read from: it must have `rank` dims, all >= 1.
const Shape& shape_of(const std::map<std::string, Shape>& shapes, const std::string& name, const std::string& where,
                      std::size_t rank = 2) {
  auto it = shapes.find(name);
  FLAME_CHECK(it != shapes.end(), "load_text_encoder", where, " has no tensor for ", name);
  const Shape& s = it->second;
  FLAME_CHECK(s.size() == rank && std::all_of(s.begin(), s.end(), [](int64_t d) { return d >= 1; }),
              "load_text_encoder", where, ": ", name, " has shape ", flame::shape_str(s), ", expected ", rank,
              " dims of at least 1 (the configuration is read from it): a damaged or foreign file");
  return s;
}

std::map<std::string, Shape> target_shapes(const Checkpoint& ck, const KeyPlan& plan) {
  std::map<std::string, Shape> shapes;
  for (auto& [name, s] : planned_shapes(ck, plan)) shapes[name] = s;
  return shapes;
}

// With allow_unplaced, entries whose target the model lacks are dropped, so their stored keys
// count as unplaced (tolerated) instead of as a mismatch.
KeyPlan fit_plan(KeyPlan plan, const flame::nn::Module& model, bool allow_unplaced) {
  if (!allow_unplaced) return plan;
  const flame::StateDict sd = model.state_dict();
  plan.entries.erase(std::remove_if(plan.entries.begin(), plan.entries.end(),
                                    [&](const KeyPlanEntry& e) { return sd.find(e.target) == nullptr; }),
                     plan.entries.end());
  return plan;
}

std::optional<JsonConfig> config_of(const Checkpoint& ck, const std::string& config_json) {
  if (!config_json.empty()) return JsonConfig::from_file(config_json);
  if (ck.config()) return *ck.config();
  return std::nullopt;
}

}  // namespace

ClipFileInfo inspect_clip_text(const Checkpoint& ck, const std::string& family, const std::string& config_json) {
  ClipFileInfo info;
  info.description = ck.description();
  info.entry = pick_entry(ck, "clip", family);
  const KeyPlan plan = checkpoint_format(info.entry.format).plan(ck, info.entry.prefix);
  const std::map<std::string, Shape> shapes = target_shapes(ck, plan);
  const bool has_projection = shapes.count("text_projection.weight") != 0;
  if (auto json = config_of(ck, config_json)) {
    info.config = ClipTextConfig::from_json(*json);
  } else {
    const std::string fam = !family.empty() ? family : info.entry.family;
    info.config = ClipTextConfig::preset(fam == "clip-g" ? "clip-g" : "clip-l");
    const int64_t preset_width = info.config.hidden_size, preset_heads = info.config.num_attention_heads;
    const Shape& tok = shape_of(shapes, "text_model.embeddings.token_embedding.weight", ck.description());
    info.config.vocab_size = tok.at(0);
    info.config.hidden_size = tok.at(1);
    info.config.max_position_embeddings =
        shape_of(shapes, "text_model.embeddings.position_embedding.weight", ck.description()).at(0);
    info.config.num_hidden_layers = 0;
    while (shapes.count("text_model.encoder.layers." + std::to_string(info.config.num_hidden_layers) +
                        ".mlp.fc1.weight"))
      ++info.config.num_hidden_layers;
    info.config.intermediate_size = shape_of(shapes, "text_model.encoder.layers.0.mlp.fc1.weight", ck.description()).at(0);
    info.config.num_attention_heads =
        info.config.hidden_size == preset_width ? preset_heads : std::max<int64_t>(1, info.config.hidden_size / 64);
    if (fam != "clip-l" && fam != "clip-g") info.config.family = "custom";
  }
  info.config.with_projection = has_projection;
  if (has_projection) info.config.projection_dim = shapes.at("text_projection.weight").at(0);
  return info;
}

T5FileInfo inspect_t5_encoder(const Checkpoint& ck, const std::string& config_json) {
  T5FileInfo info;
  info.description = ck.description();
  info.entry = pick_entry(ck, "t5", "");
  info.fp8_scaled = ck.contains(info.entry.prefix + "scaled_fp8");
  if (auto json = config_of(ck, config_json)) {
    info.config = T5EncoderConfig::from_json(*json);
    return info;
  }
  const KeyPlan plan = t5_transformers_plan(ck, info.entry.prefix);
  const std::map<std::string, Shape> shapes = target_shapes(ck, plan);
  T5EncoderConfig& c = info.config;
  const Shape& emb = shape_of(shapes, "shared.weight", ck.description());
  c.vocab_size = emb.at(0);
  c.d_model = emb.at(1);
  const Shape& table =
      shape_of(shapes, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", ck.description());
  FLAME_CHECK(table.at(0) >= 4, "load_text_encoder", ck.description(),
              ": encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight has shape ",
              flame::shape_str(table), ": T5's relative position buckets need at least 4 rows");
  c.relative_attention_num_buckets = table.at(0);
  c.num_heads = table.at(1);
  c.d_kv = shape_of(shapes, "encoder.block.0.layer.0.SelfAttention.q.weight", ck.description()).at(0) / c.num_heads;
  c.d_ff = shape_of(shapes, "encoder.block.0.layer.1.DenseReluDense.wi_0.weight", ck.description()).at(0);
  c.num_layers = 0;
  while (shapes.count("encoder.block." + std::to_string(c.num_layers) + ".layer.0.SelfAttention.q.weight")) ++c.num_layers;
  const T5EncoderConfig xxl;
  c.family = (c.d_model == xxl.d_model && c.num_layers == xxl.num_layers && c.d_ff == xxl.d_ff) ? "t5-xxl" : "custom";
  return info;
}

Checkpoint open_text_encoder_checkpoint(const std::string& path, const std::string& kind,
                                        const TextEncoderLoadOptions& options) {
  Checkpoint::OpenOptions open;
  open.variant = options.variant;
  open.subfolder = options.subfolder;
  const fs::path p(path);
  if (open.subfolder.empty() && fs::is_directory(p) && !fs::exists(p / "config.json")) {
    // A pipeline folder: the family's subfolder (T5: SD3's text_encoder_3, else FLUX's text_encoder_2).
    std::vector<std::string> subs;
    if (kind == "t5") subs = {"text_encoder_3", "text_encoder_2"};
    else if (options.family == "clip-g") subs = {"text_encoder_2"};
    else subs = {"text_encoder"};
    for (const std::string& s : subs) {
      const fs::path cfg = p / s / "config.json";
      if (!fs::is_regular_file(cfg)) continue;
      const JsonConfig j = JsonConfig::from_file(cfg.string());
      const bool is_t5 = j.has("d_kv");
      if (is_t5 == (kind == "t5")) {
        open.subfolder = s;
        break;
      }
    }
  }
  return Checkpoint::open(path, open);
}

std::shared_ptr<ClipTextModel> load_clip_text(const Checkpoint& ck, const TextEncoderLoadOptions& options) {
  const ClipFileInfo info = inspect_clip_text(ck, options.family, options.config_json);
  auto model = std::make_shared<ClipTextModel>(info.config, flame::TensorOptions{options.dtype, options.device});
  const KeyPlan plan = fit_plan(checkpoint_format(info.entry.format).plan(ck, info.entry.prefix), *model,
                                options.allow_unplaced);
  const std::string family = !options.family.empty() ? options.family
                             : info.entry.family == "custom" ? "clip" : info.entry.family;
  load_checkpoint(*model, ck, plan, {family, info.entry.format, options.allow_unplaced});
  model->eval();
  model->requires_grad_(false);
  return model;
}

std::shared_ptr<ClipTextModel> load_clip_text(const std::string& path, const TextEncoderLoadOptions& options) {
  return load_clip_text(open_text_encoder_checkpoint(path, "clip", options), options);
}

std::shared_ptr<T5EncoderModel> load_t5_encoder(const Checkpoint& ck, const TextEncoderLoadOptions& options) {
  const T5FileInfo info = inspect_t5_encoder(ck, options.config_json);
  auto model = std::make_shared<T5EncoderModel>(info.config, flame::TensorOptions{options.dtype, options.device});
  const KeyPlan plan = fit_plan(t5_transformers_plan(ck, info.entry.prefix), *model, options.allow_unplaced);
  load_checkpoint(*model, ck, plan,
                  {!options.family.empty() ? options.family : info.entry.family == "custom" ? "t5" : info.entry.family,
                   info.fp8_scaled ? "t5-transformers (fp8 scaled)" : info.entry.format, options.allow_unplaced});
  model->eval();
  model->requires_grad_(false);
  return model;
}

std::shared_ptr<T5EncoderModel> load_t5_encoder(const std::string& path, const TextEncoderLoadOptions& options) {
  return load_t5_encoder(open_text_encoder_checkpoint(path, "t5", options), options);
}

}  // namespace flame_diffusion::models
