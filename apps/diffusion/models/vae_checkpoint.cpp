// The VAE's stored layouts (Note [Checkpoint files] in checkpoint.h): diffusers names, and the
// original names of the LDM/SGM code base that SD 1.x/SDXL single files ("first_stage_model."),
// ComfyUI VAE files and FLUX/SD3 ae.safetensors (bare) use:
//   encoder.down.{i}.block.{j}.{norm1,conv1,norm2,conv2,nin_shortcut}  -> encoder.down_blocks.{i}.resnets.{j}.*
//   encoder.down.{i}.downsample.conv                                   -> encoder.down_blocks.{i}.downsamplers.0.conv
//   decoder.up.{b}.block.{j}.*, decoder.up.{b}.upsample.conv           -> decoder.up_blocks.{n-1-b}.* (reversed)
//   {encoder,decoder}.mid.block_{1,2}                                  -> mid_block.resnets.{0,1}
//   {encoder,decoder}.mid.attn_1.{norm,q,k,v,proj_out}                 -> mid_block.attentions.0.{group_norm,
//                                                                         to_q,to_k,to_v,to_out.0} (1x1 convs
//                                                                         [C, C, 1, 1] reshaped to Linear [C, C])
//   {encoder,decoder}.norm_out                                         -> conv_norm_out
//   conv_in, conv_out, quant_conv, post_quant_conv                     -> the same names
#include <algorithm>
#include <cctype>
#include <filesystem>
#include <map>

#include "models/vae.h"

namespace flame_diffusion::models {

using flame::Shape;

namespace {


std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> parts;
  std::size_t start = 0;
  for (std::size_t i = 0; i <= s.size(); ++i) {
    if (i == s.size() || s[i] == '.') {
      parts.push_back(s.substr(start, i - start));
      start = i + 1;
    }
  }
  return parts;
}

bool is_index(const std::string& s) {
  return !s.empty() && s.size() < 6 && std::all_of(s.begin(), s.end(), [](char c) { return std::isdigit(c); });
}

bool is_param(const std::string& s) { return s == "weight" || s == "bias"; }

// parts[at..] of a resnet: {norm1,conv1,norm2,conv2,nin_shortcut}.{weight,bias}.
std::optional<std::string> resnet_tail(const std::vector<std::string>& p, std::size_t at) {
  if (p.size() != at + 2 || !is_param(p[at + 1])) return std::nullopt;
  const std::string& m = p[at];
  if (m == "nin_shortcut") return "conv_shortcut." + p[at + 1];
  if (m == "norm1" || m == "conv1" || m == "norm2" || m == "conv2") return m + "." + p[at + 1];
  return std::nullopt;
}

// The diffusers name of an original VAE key (prefix removed), or nullopt when it is not one.
std::optional<std::string> original_to_diffusers(const std::string& key, int64_t num_up) {
  const std::vector<std::string> p = split(key);
  if (p.size() == 2 && (p[0] == "quant_conv" || p[0] == "post_quant_conv") && is_param(p[1])) return key;
  if (p.size() < 3 || (p[0] != "encoder" && p[0] != "decoder")) return std::nullopt;
  const bool enc = p[0] == "encoder";
  const std::string& part = p[1];
  if (p.size() == 3 && is_param(p[2])) {
    if (part == "conv_in" || part == "conv_out") return key;
    if (part == "norm_out") return p[0] + ".conv_norm_out." + p[2];
    return std::nullopt;
  }
  if ((enc && part == "down") || (!enc && part == "up")) {
    if (p.size() < 5 || !is_index(p[2])) return std::nullopt;
    int64_t level = std::stoll(p[2]);
    if (!enc) {
      if (level >= num_up) return std::nullopt;
      level = num_up - 1 - level;
    }
    const std::string block = p[0] + (enc ? ".down_blocks." : ".up_blocks.") + std::to_string(level);
    if (p[3] == "block" && is_index(p[4])) {
      if (auto t = resnet_tail(p, 5)) return block + ".resnets." + p[4] + "." + *t;
      return std::nullopt;
    }
    if (p[3] == (enc ? "downsample" : "upsample") && p.size() == 6 && p[4] == "conv" && is_param(p[5]))
      return block + (enc ? ".downsamplers.0.conv." : ".upsamplers.0.conv.") + p[5];
    return std::nullopt;
  }
  if (part == "mid" && p.size() >= 5) {
    const std::string mid = p[0] + ".mid_block.";
    if (p[2] == "block_1" || p[2] == "block_2") {
      if (auto t = resnet_tail(p, 3)) return mid + "resnets." + (p[2] == "block_1" ? "0." : "1.") + *t;
      return std::nullopt;
    }
    if (p[2] == "attn_1" && p.size() == 5 && is_param(p[4])) {
      static const std::map<std::string, std::string> names = {
          {"norm", "group_norm"}, {"q", "to_q"}, {"k", "to_k"}, {"v", "to_v"}, {"proj_out", "to_out.0"}};
      auto it = names.find(p[3]);
      if (it == names.end()) return std::nullopt;
      return mid + "attentions.0." + it->second + "." + p[4];
    }
  }
  return std::nullopt;
}

std::optional<std::string> detect_diffusers(const Checkpoint& ck) {
  if (ck.contains("encoder.conv_in.weight") && ck.contains("decoder.conv_in.weight") &&
      ck.has_prefix("encoder.down_blocks."))
    return std::string();
  return std::nullopt;
}

std::optional<std::string> detect_original(const Checkpoint& ck) {
  for (const char* prefix : {"first_stage_model.", "vae.", ""}) {
    const std::string p = prefix;
    if (ck.contains(p + "encoder.conv_in.weight") && ck.contains(p + "decoder.conv_in.weight") &&
        ck.has_prefix(p + "encoder.down."))
      return p;
  }
  return std::nullopt;
}

}  // namespace

KeyPlan vae_original_plan(const Checkpoint& ck, const std::string& prefix) {
  KeyPlan plan;
  plan.source_prefix = prefix;
  // The decoder's levels are stored in reverse order (up.0 is the last to run).
  int64_t num_up = 0;
  const std::string up = prefix + "decoder.up.";
  for (const std::string& k : ck.keys()) {
    if (!k.starts_with(up)) continue;
    const std::string idx = split(k.substr(up.size()))[0];
    if (is_index(idx)) num_up = std::max<int64_t>(num_up, std::stoll(idx) + 1);
  }
  for (const std::string& k : ck.keys()) {
    if (!k.starts_with(prefix)) continue;
    auto target = original_to_diffusers(k.substr(prefix.size()), num_up);
    if (!target) continue;  // reported as unplaced by the check
    KeyPlanEntry e;
    e.target = *target;
    e.sources = {k};
    const bool attn_linear = target->find(".attentions.0.to_") != std::string::npos &&
                             target->compare(target->size() - 7, 7, ".weight") == 0;
    const Shape& s = ck.info(k).shape;
    if (attn_linear && s.size() > 2) {  // a 1x1 conv (or 1-d conv) weight [C, C, 1(, 1)] -> Linear [C, C]
      e.op = KeyPlanEntry::Op::kReshape;
      e.shape = {s[0], s[1]};
    }
    plan.entries.push_back(std::move(e));
  }
  return plan;
}

void register_vae_formats() {
  register_checkpoint_format({"vae-diffusers", "vae", detect_diffusers,
                              [](const Checkpoint& ck, const std::string& prefix) { return identity_plan(ck, prefix); },
                              10});
  register_checkpoint_format({"vae-original", "vae", detect_original, vae_original_plan, 5});
}

namespace {
const bool vae_formats_registered = (register_vae_formats(), true);

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string guess_family_from_keys(const Checkpoint& ck, const std::string& prefix, int64_t latent_channels) {
  if (latent_channels == 16) return prefix == "first_stage_model." ? "sd3" : "flux";
  FLAME_CHECK(latent_channels == 4, "load_vae", ck.description(), " holds a VAE with ", latent_channels,
              " latent channels, which is none of sd/sdxl (4) or sd3/flux (16): give its config.json");
  if (ck.has_prefix("conditioner.embedders.")) return "sdxl";
  if (ck.has_prefix("cond_stage_model.")) return "sd";
  const std::string name = lower(std::filesystem::path(ck.path()).filename().string());
  return name.find("xl") != std::string::npos ? "sdxl" : "sd";
}

// The architecture a plan's target shapes imply, on top of `c` (scaling and norm groups kept).
void fill_architecture(VaeConfig& c, const std::map<std::string, Shape>& shapes, const std::string& where) {
  auto shape = [&](const std::string& name) -> const Shape& {
    auto it = shapes.find(name);
    FLAME_CHECK(it != shapes.end(), "load_vae", where, " has no VAE tensor for ", name);
    return it->second;
  };
  c.in_channels = shape("encoder.conv_in.weight").at(1);
  c.out_channels = shape("decoder.conv_out.weight").at(0);
  c.latent_channels = shape("decoder.conv_in.weight").at(1);
  c.block_out_channels.clear();
  for (int i = 0; shapes.count("encoder.down_blocks." + std::to_string(i) + ".resnets.0.conv1.weight"); ++i)
    c.block_out_channels.push_back(shapes.at("encoder.down_blocks." + std::to_string(i) + ".resnets.0.conv1.weight")[0]);
  FLAME_CHECK(!c.block_out_channels.empty(), "load_vae", where, " has no encoder.down_blocks.0 resnets");
  c.layers_per_block = 0;
  while (shapes.count("encoder.down_blocks.0.resnets." + std::to_string(c.layers_per_block) + ".conv1.weight"))
    ++c.layers_per_block;
  c.use_quant_conv = shapes.count("quant_conv.weight") != 0;
  c.use_post_quant_conv = shapes.count("post_quant_conv.weight") != 0;
  c.mid_block_add_attention = shapes.count("encoder.mid_block.attentions.0.to_q.weight") != 0;
}

}  // namespace

VaeFileInfo inspect_vae(const Checkpoint& ck, const std::string& family, const std::string& config_json) {
  register_vae_formats();
  VaeFileInfo info;
  info.description = ck.description();
  const DetectedFormat det = detect_checkpoint_format(ck, "vae");
  info.format = det.format;
  info.prefix = det.prefix;
  const KeyPlan plan = checkpoint_format(det.format).plan(ck, det.prefix);
  std::map<std::string, Shape> shapes;
  for (auto& [name, s] : planned_shapes(ck, plan)) shapes[name] = s;

  std::optional<JsonConfig> json;
  if (!config_json.empty()) json = JsonConfig::from_file(config_json);
  else if (ck.config()) json = *ck.config();
  if (json) {
    info.config = VaeConfig::from_json(*json);
    info.family = info.config.family;
    return info;
  }
  const auto cin = shapes.find("decoder.conv_in.weight");
  FLAME_CHECK(cin != shapes.end() && cin->second.size() == 4, "load_vae", ck.description(),
              " has no decoder.conv_in weight [C, latent, 3, 3] (layout ", det.format, ")");
  info.family = family.empty() ? guess_family_from_keys(ck, det.prefix, cin->second[1]) : family;
  info.config = VaeConfig::preset(info.family);
  fill_architecture(info.config, shapes, ck.description());
  return info;
}

std::shared_ptr<AutoencoderKL> load_vae(const Checkpoint& ck, const VaeLoadOptions& options) {
  const VaeFileInfo info = inspect_vae(ck, options.family, options.config_json);
  for (int64_t ch : info.config.block_out_channels)
    FLAME_CHECK(ch % info.config.norm_num_groups == 0, "load_vae", ck.description(), " has block_out_channels ",
                flame::shape_str(info.config.block_out_channels), ", which the ", info.family, " preset's ",
                info.config.norm_num_groups, " norm groups do not divide: give the model's config.json (config_json)");
  const flame::DType dtype = vae_compute_dtype(options.dtype, info.config);
  auto vae = std::make_shared<AutoencoderKL>(info.config, flame::TensorOptions{dtype, options.device});
  const KeyPlan plan = checkpoint_format(info.format).plan(ck, info.prefix);
  load_checkpoint(*vae, ck, plan, {info.family + "-vae", info.format, options.allow_unplaced});
  vae->eval();
  vae->requires_grad_(false);
  return vae;
}

std::shared_ptr<AutoencoderKL> load_vae(const std::string& path, const VaeLoadOptions& options) {
  Checkpoint::OpenOptions open;
  open.subfolder = "vae";
  open.variant = options.variant;
  return load_vae(Checkpoint::open(path, open), options);
}

}  // namespace flame_diffusion::models
