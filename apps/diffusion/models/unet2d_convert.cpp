// The original single-file UNet layout -> diffusers names (models/unet2d_convert.h,
// Note [UNet original layout]).
#include "models/unet2d_convert.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>

namespace flame_diffusion::models {

namespace {

struct Slot {
  int64_t block = 0;
  int64_t layer = 0;
  bool resample = false;  // the down block's downsampler slot
};

// The slots of input_blocks.1.. and output_blocks.0.. for `c`.
struct Layout {
  std::vector<Slot> input;   // input[i - 1] for input_blocks.i
  std::vector<Slot> output;  // output[i] for output_blocks.i
  std::vector<bool> up_cross;
  bool label_emb = false;  // label_emb.0.* -> add_embedding (text_time)
};

Layout layout_of(const UNet2DConditionConfig& c) {
  Layout l;
  const int64_t n = c.num_blocks();
  for (int64_t b = 0; b < n; ++b) {
    for (int64_t j = 0; j < c.layers_per_block[b]; ++j) l.input.push_back({b, j, false});
    if (b + 1 < n) l.input.push_back({b, c.layers_per_block[b], true});
  }
  for (int64_t b = 0; b < n; ++b) {
    const int64_t layers = c.layers_per_block[n - 1 - b] + 1;
    for (int64_t j = 0; j < layers; ++j) l.output.push_back({b, j, false});
    l.up_cross.push_back(c.up_block_types[b] == "CrossAttnUpBlock2D");
  }
  l.label_emb = c.addition_embed_type == "text_time";
  return l;
}


// "<digits>." at the front of s: the number and the rest, or nullopt.
std::optional<std::pair<int64_t, std::string>> take_index(const std::string& s) {
  std::size_t i = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
  if (i == 0 || i > 9 || i >= s.size() || s[i] != '.') return std::nullopt;
  return std::make_pair(std::stoll(s.substr(0, i)), s.substr(i + 1));
}

std::optional<std::string> resnet_name(const std::string& rest) {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"in_layers.0.", "norm1."},  {"in_layers.2.", "conv1."},  {"emb_layers.1.", "time_emb_proj."},
      {"out_layers.0.", "norm2."}, {"out_layers.3.", "conv2."}, {"skip_connection.", "conv_shortcut."}};
  for (const auto& [from, to] : names) {
    if (rest.starts_with(from)) return to + rest.substr(from.size());
  }
  return std::nullopt;
}

std::optional<std::string> attention_name(const std::string& rest) {
  for (const char* p : {"norm.", "proj_in.", "proj_out.", "transformer_blocks."}) {
    if (rest.starts_with(p)) return rest;
  }
  return std::nullopt;
}

// The diffusers key of one stored key (prefix removed), or nullopt.
std::optional<std::string> diffusers_key(const std::string& k, const Layout& l) {
  static const std::vector<std::pair<std::string, std::string>> top = {
      {"input_blocks.0.0.", "conv_in."},          {"time_embed.0.", "time_embedding.linear_1."},
      {"time_embed.2.", "time_embedding.linear_2."}, {"out.0.", "conv_norm_out."},
      {"out.2.", "conv_out."}};
  for (const auto& [from, to] : top) {
    if (k.starts_with(from)) return to + k.substr(from.size());
  }
  if (l.label_emb) {
    if (k.starts_with("label_emb.0.0.")) return "add_embedding.linear_1." + k.substr(14);
    if (k.starts_with("label_emb.0.2.")) return "add_embedding.linear_2." + k.substr(14);
  }
  auto block_part = [](const std::string& s) { return take_index(s); };  // "<i>.<part>.<rest>"
  // Part 0 of an input or output block is its resnet, part 1 its attention (transformer).
  auto layer_part = [&](const std::string& blk, int64_t layer,
                        const std::pair<int64_t, std::string>& part) -> std::optional<std::string> {
    if (part.first == 0) {
      if (auto r = resnet_name(part.second)) return blk + "resnets." + std::to_string(layer) + "." + *r;
    } else if (part.first == 1) {
      if (auto a = attention_name(part.second)) return blk + "attentions." + std::to_string(layer) + "." + *a;
    }
    return std::nullopt;
  };
  if (k.starts_with("input_blocks.")) {
    auto i = take_index(k.substr(13));
    if (!i || i->first < 1 || i->first > static_cast<int64_t>(l.input.size())) return std::nullopt;
    const Slot s = l.input[i->first - 1];
    auto part = block_part(i->second);
    if (!part) return std::nullopt;
    const std::string blk = "down_blocks." + std::to_string(s.block) + ".";
    if (s.resample) {
      if (part->first == 0 && part->second.starts_with("op.")) return blk + "downsamplers.0.conv." + part->second.substr(3);
      return std::nullopt;
    }
    return layer_part(blk, s.layer, *part);
  }
  if (k.starts_with("middle_block.")) {
    auto part = take_index(k.substr(13));
    if (!part) return std::nullopt;
    if (part->first % 2 == 0) {
      auto r = resnet_name(part->second);
      if (r) return "mid_block.resnets." + std::to_string(part->first / 2) + "." + *r;
    } else {
      auto a = attention_name(part->second);
      if (a) return "mid_block.attentions." + std::to_string(part->first / 2) + "." + *a;
    }
    return std::nullopt;
  }
  if (k.starts_with("output_blocks.")) {
    auto i = take_index(k.substr(14));
    if (!i || i->first >= static_cast<int64_t>(l.output.size())) return std::nullopt;
    const Slot s = l.output[i->first];
    auto part = block_part(i->second);
    if (!part) return std::nullopt;
    const std::string blk = "up_blocks." + std::to_string(s.block) + ".";
    const bool last_in_block = i->first + 1 == static_cast<int64_t>(l.output.size()) || l.output[i->first + 1].block != s.block;
    const int64_t up_pos = l.up_cross[s.block] ? 2 : 1;
    if (last_in_block && part->first == up_pos && part->second.starts_with("conv.") &&
        s.block + 1 < static_cast<int64_t>(l.up_cross.size())) {
      return blk + "upsamplers.0.conv." + part->second.substr(5);
    }
    return layer_part(blk, s.layer, *part);
  }
  return std::nullopt;
}

bool is_projection_weight(const std::string& diffusers) {
  auto ends = [&](const std::string& suf) {
    return diffusers.size() >= suf.size() && diffusers.compare(diffusers.size() - suf.size(), suf.size(), suf) == 0;
  };
  return diffusers.find(".attentions.") != std::string::npos && (ends(".proj_in.weight") || ends(".proj_out.weight"));
}

}  // namespace

std::optional<std::string> unet_original_name(const UNet2DConditionConfig& config, const std::string& name) {
  const Layout l = layout_of(config);
  static const std::vector<std::pair<std::string, std::string>> top = {
      {"conv_in", "input_blocks.0.0"},          {"time_embedding.linear_1", "time_embed.0"},
      {"time_embedding.linear_2", "time_embed.2"}, {"add_embedding.linear_1", "label_emb.0.0"},
      {"add_embedding.linear_2", "label_emb.0.2"}, {"conv_norm_out", "out.0"},
      {"conv_out", "out.2"}};
  // `rest` after "<prefix>" is the whole name or starts with ".".
  auto after = [&](const std::string& prefix) -> std::optional<std::string> {
    if (!name.starts_with(prefix)) return std::nullopt;
    const std::string rest = name.substr(prefix.size());
    if (!rest.empty() && rest[0] != '.') return std::nullopt;
    return rest;
  };
  for (const auto& [from, to] : top) {
    if (auto rest = after(from)) return to + *rest;
  }
  static const std::vector<std::pair<std::string, std::string>> resnet = {
      {"norm1", "in_layers.0"},  {"conv1", "in_layers.2"},  {"time_emb_proj", "emb_layers.1"},
      {"norm2", "out_layers.0"}, {"conv2", "out_layers.3"}, {"conv_shortcut", "skip_connection"}};
  auto resnet_part = [&](const std::string& rest) -> std::optional<std::string> {  // rest: "norm1.weight"
    for (const auto& [from, to] : resnet) {
      if (rest == from || rest.starts_with(from + ".")) return to + rest.substr(from.size());
    }
    return std::nullopt;
  };
  // "<b>.<kind>.<j>.<rest>" of a block group.
  struct Parsed {
    int64_t block, layer;
    std::string kind, rest;
  };
  auto parse = [&](const std::string& s) -> std::optional<Parsed> {
    auto b = take_index(s);
    if (!b) return std::nullopt;
    const std::size_t dot = b->second.find('.');
    if (dot == std::string::npos) return std::nullopt;
    auto j = take_index(b->second.substr(dot + 1));
    if (!j) return std::nullopt;
    return Parsed{b->first, j->first, b->second.substr(0, dot), j->second};
  };
  auto slot_index = [](const std::vector<Slot>& slots, int64_t block, int64_t layer, bool resample) -> int64_t {
    for (std::size_t i = 0; i < slots.size(); ++i) {
      if (slots[i].block == block && slots[i].layer == layer && slots[i].resample == resample) return static_cast<int64_t>(i);
    }
    return -1;
  };
  if (name.starts_with("down_blocks.")) {
    auto p = parse(name.substr(12));
    if (!p) return std::nullopt;
    if (p->kind == "downsamplers" && p->layer == 0 && p->rest.starts_with("conv")) {
      const int64_t b = p->block;
      if (b < 0 || b >= config.num_blocks()) return std::nullopt;
      const int64_t i = slot_index(l.input, b, config.layers_per_block[b], true);
      if (i < 0) return std::nullopt;
      return "input_blocks." + std::to_string(i + 1) + ".0.op" + p->rest.substr(4);
    }
    const int64_t i = slot_index(l.input, p->block, p->layer, false);
    if (i < 0) return std::nullopt;
    const std::string blk = "input_blocks." + std::to_string(i + 1);
    if (p->kind == "resnets") {
      if (auto r = resnet_part(p->rest)) return blk + ".0." + *r;
    } else if (p->kind == "attentions") {
      if (attention_name(p->rest + ".")) return blk + ".1." + p->rest;
    }
    return std::nullopt;
  }
  if (name.starts_with("mid_block.")) {
    // "resnets.k.rest" / "attentions.0.rest": no block index in front.
    const std::string s = name.substr(10);
    for (const auto& [kind, pos] : std::vector<std::pair<std::string, int64_t>>{{"resnets.", 0}, {"attentions.", 1}}) {
      if (!s.starts_with(kind)) continue;
      auto k = take_index(s.substr(kind.size()));
      if (!k) return std::nullopt;
      const std::string blk = "middle_block." + std::to_string(2 * k->first + pos) + ".";
      if (pos == 0) {
        if (k->first > 1) return std::nullopt;
        if (auto r = resnet_part(k->second)) return blk + *r;
      } else if (k->first == 0 && attention_name(k->second + ".")) {
        return blk + k->second;
      }
      return std::nullopt;
    }
    return std::nullopt;
  }
  if (name.starts_with("up_blocks.")) {
    auto p = parse(name.substr(10));
    if (!p) return std::nullopt;
    if (p->kind == "upsamplers" && p->layer == 0 && p->rest.starts_with("conv")) {
      const int64_t b = p->block;
      if (b < 0 || b + 1 >= static_cast<int64_t>(l.up_cross.size())) return std::nullopt;
      int64_t last = -1;
      for (std::size_t i = 0; i < l.output.size(); ++i) {
        if (l.output[i].block == b) last = static_cast<int64_t>(i);
      }
      if (last < 0) return std::nullopt;
      return "output_blocks." + std::to_string(last) + (l.up_cross[b] ? ".2.conv" : ".1.conv") + p->rest.substr(4);
    }
    const int64_t i = slot_index(l.output, p->block, p->layer, false);
    if (i < 0) return std::nullopt;
    const std::string blk = "output_blocks." + std::to_string(i);
    if (p->kind == "resnets") {
      if (auto r = resnet_part(p->rest)) return blk + ".0." + *r;
    } else if (p->kind == "attentions") {
      if (attention_name(p->rest + ".")) return blk + ".1." + p->rest;
    }
    return std::nullopt;
  }
  return std::nullopt;
}

bool is_unet_original_layout(const std::vector<std::string>& keys) {
  const std::string p = std::string(kUNetOriginalPrefix) + "input_blocks.";
  return std::any_of(keys.begin(), keys.end(), [&](const std::string& k) { return k.starts_with(p); });
}

namespace {

// The plan for a layout; `linear`: the projection kind the model builds (reshape what differs),
// or nullopt to copy projections as stored.
KeyPlan plan_for(const Layout& l, std::optional<bool> linear, const std::vector<std::pair<std::string, flame::Shape>>& stored,
                 const std::string& prefix) {
  KeyPlan plan;
  plan.source_prefix = prefix;
  for (const auto& [key, shape] : stored) {
    if (!key.starts_with(prefix)) continue;
    auto target = diffusers_key(key.substr(prefix.size()), l);
    if (!target) continue;
    KeyPlanEntry e;
    e.target = *target;
    e.sources = {key};
    if (linear && is_projection_weight(e.target)) {
      // 1x1 conv [o, i, 1, 1] <-> linear [o, i], whichever the config builds.
      if (*linear && shape.size() == 4 && shape[2] == 1 && shape[3] == 1) {
        e.op = KeyPlanEntry::Op::kReshape;
        e.shape = {shape[0], shape[1]};
      } else if (!*linear && shape.size() == 2) {
        e.op = KeyPlanEntry::Op::kReshape;
        e.shape = {shape[0], shape[1], 1, 1};
      }
    }
    plan.entries.push_back(std::move(e));
  }
  return plan;
}

// The block layout written in the keys: a downsampler slot (input_blocks.i.0.op) ends a down
// block, an upsampler slot (output_blocks.i.{1,2}.conv) an up block; attentions at position 1.
Layout layout_from_keys(const std::vector<std::string>& keys, const std::string& prefix) {
  std::map<int64_t, bool> input_op, output_up, output_attn;
  auto slot_of = [&](const std::string& group, const std::string& k) -> std::optional<std::pair<int64_t, std::string>> {
    const std::string p = prefix + group;
    if (!k.starts_with(p)) return std::nullopt;
    return take_index(k.substr(p.size()));
  };
  bool label_emb = false;
  for (const std::string& k : keys) {
    if (k.starts_with(prefix + "label_emb.0.")) label_emb = true;
    if (auto in = slot_of("input_blocks.", k); in && in->first >= 1) {
      input_op[in->first] = input_op[in->first] || in->second.starts_with("0.op.");
    }
    if (auto out = slot_of("output_blocks.", k)) {
      const std::string& r = out->second;
      output_up[out->first] = output_up[out->first] || r.starts_with("1.conv.") || r.starts_with("2.conv.");
      output_attn[out->first] = output_attn[out->first] || (r.starts_with("1.") && !r.starts_with("1.conv."));
    }
  }
  Layout l;
  l.label_emb = label_emb;
  int64_t b = 0, j = 0;
  for (const auto& [i, op] : input_op) {
    l.input.resize(static_cast<std::size_t>(i));
    l.input[i - 1] = {b, j, op};
    if (op) {
      ++b;
      j = 0;
    } else {
      ++j;
    }
  }
  b = 0;
  j = 0;
  l.up_cross.push_back(false);
  for (const auto& [i, up] : output_up) {
    l.output.resize(static_cast<std::size_t>(i + 1));
    l.output[i] = {b, j, false};
    if (output_attn[i]) l.up_cross[b] = true;
    if (up) {
      ++b;
      j = 0;
      l.up_cross.push_back(false);
    } else {
      ++j;
    }
  }
  return l;
}

}  // namespace

KeyPlan unet_original_plan(const UNet2DConditionConfig& config,
                           const std::vector<std::pair<std::string, flame::Shape>>& stored) {
  config.validate();
  const std::string prefix = kUNetOriginalPrefix;
  const bool prefixed =
      std::any_of(stored.begin(), stored.end(), [&](const auto& kv) { return kv.first.starts_with(prefix); });
  return plan_for(layout_of(config), config.use_linear_projection, stored, prefixed ? prefix : "");
}

KeyPlan unet_original_plan(const Checkpoint& ck, const std::string& prefix) {
  std::vector<std::pair<std::string, flame::Shape>> stored;
  for (const std::string& k : ck.keys()) stored.emplace_back(k, ck.info(k).shape);
  return plan_for(layout_from_keys(ck.keys(), prefix), std::nullopt, stored, prefix);
}

// ---- formats and loading ----
namespace {

std::optional<std::string> detect_diffusers(const Checkpoint& ck) {
  if (ck.contains("conv_in.weight") && ck.contains("time_embedding.linear_1.weight") && ck.has_prefix("down_blocks.") &&
      ck.has_prefix("up_blocks."))
    return std::string();
  return std::nullopt;
}

std::optional<std::string> detect_original(const Checkpoint& ck) {
  for (const char* prefix : {kUNetOriginalPrefix, ""}) {
    const std::string p = prefix;
    if (ck.contains(p + "input_blocks.0.0.weight") && ck.has_prefix(p + "output_blocks.") &&
        ck.contains(p + "time_embed.0.weight"))
      return p;
  }
  return std::nullopt;
}

std::string guess_family(const Checkpoint& ck, const std::string& prefix, const std::string& format) {
  if (ck.has_prefix(prefix + (format == "unet-original" ? "label_emb.0." : "add_embedding."))) return "sdxl";
  for (const std::string& k : ck.keys()) {
    const std::string suffix = "attn2.to_k.weight";
    if (!k.starts_with(prefix) || k.size() < suffix.size() || k.compare(k.size() - suffix.size(), suffix.size(), suffix))
      continue;
    const flame::Shape& s = ck.info(k).shape;
    if (s.size() == 2 && s[1] == 768) return "sd15";
    if (s.size() == 2 && s[1] == 1024) return "sd21";
    FLAME_CHECK(false, "load_unet", ck.description(), ": cross-attention width ", s.size() == 2 ? s[1] : 0, " (", k,
                ") is none of SD 1.x (768), SD 2.x (1024), SDXL (2048 with label_emb); give the config "
                "(UNetLoadOptions::config or config_json)");
  }
  FLAME_CHECK(false, "load_unet", ck.description(), ": no cross-attention key (*attn2.to_k.weight) to guess the "
              "family from; give the config (UNetLoadOptions::config or config_json)");
  return "";
}

}  // namespace

void register_unet_formats() {
  register_checkpoint_format({"unet-diffusers", "unet", detect_diffusers,
                              [](const Checkpoint& ck, const std::string& prefix) { return identity_plan(ck, prefix); },
                              10});
  register_checkpoint_format(
      {"unet-original", "unet", detect_original,
       [](const Checkpoint& ck, const std::string& prefix) { return unet_original_plan(ck, prefix); }, 5});
}

namespace {
const bool unet_formats_registered = (register_unet_formats(), true);
}  // namespace

UNetFileInfo inspect_unet(const Checkpoint& ck, const UNetLoadOptions& options) {
  register_unet_formats();
  UNetFileInfo info;
  info.description = ck.description();
  const DetectedFormat det = detect_checkpoint_format(ck, "unet");
  info.format = det.format;
  info.prefix = det.prefix;
  if (options.config) {
    info.config = *options.config;
    info.family = "config";
  } else if (!options.config_json.empty()) {
    info.config = unet2d_config_from_file(options.config_json);
    info.family = "config";
  } else if (ck.config()) {
    info.config = unet2d_config_from_file(ck.config()->origin());
    info.family = "config";
  } else {
    info.family = options.family.empty() ? guess_family(ck, det.prefix, det.format) : options.family;
    info.config = unet2d_preset(info.family);
  }
  info.config.validate();
  return info;
}

std::shared_ptr<UNet2DConditionModel> load_unet(const Checkpoint& ck, const UNetLoadOptions& options) {
  const UNetFileInfo info = inspect_unet(ck, options);
  auto unet = std::make_shared<UNet2DConditionModel>(info.config, flame::TensorOptions{options.dtype, options.device});
  KeyPlan plan = checkpoint_format(info.format).plan(ck, info.prefix);
  if (info.format == "unet-original") {
    // Projections stored as the other kind (1x1 conv / linear) than the config builds are reshaped.
    std::vector<std::pair<std::string, flame::Shape>> stored;
    for (const std::string& k : ck.keys()) stored.emplace_back(k, ck.info(k).shape);
    plan = plan_for(layout_from_keys(ck.keys(), info.prefix), info.config.use_linear_projection, stored, info.prefix);
  }
  load_checkpoint(*unet, ck, plan, {info.family + "-unet", info.format, options.allow_unplaced});
  return unet;
}

std::shared_ptr<UNet2DConditionModel> load_unet(const std::string& path, const UNetLoadOptions& options) {
  Checkpoint::OpenOptions open;
  open.subfolder = "unet";
  open.variant = options.variant;
  return load_unet(Checkpoint::open(path, open), options);
}

}  // namespace flame_diffusion::models
