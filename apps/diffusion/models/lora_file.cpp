// LoRA files: writing and reading the peft, diffusers and kohya layouts (models/lora_file.h,
// Note [LoRA file layouts]), and LyCORIS' kohya-style LoKr keys (Note [LoKr files]).
#include "models/lora_file.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include <flame/io/safetensors.h>
#include <nlohmann/json.hpp>

#include "models/flux.h"
#include "models/sd3.h"
#include "models/unet2d.h"
#include "models/unet2d_convert.h"

namespace flame_diffusion::models {

using flame::DType;
using flame::Shape;
using flame::StateDict;
using flame::Tensor;
using flame::nn::Linear;
using json = nlohmann::json;

namespace {

constexpr const char* kOp = "load_lora";
constexpr const char* kAdapterMetadataKey = "lora_adapter_metadata";  // diffusers' LORA_ADAPTER_METADATA_KEY

// ---- the model's layers ----
using LinearMap = std::map<std::string, Linear*>;

LinearMap linears_of(flame::nn::Module& model) {
  LinearMap out;
  for (auto& [name, m] : model.named_modules()) {
    auto* lin = dynamic_cast<Linear*>(m.get());
    if (!lin || name.empty()) continue;
    // The adapters' own layers (x.lora_A) are not targets.
    if (name.find("lora_") != std::string::npos) continue;
    out[name] = lin;
  }
  return out;
}

const char* family_title(LoraFamily f) {
  switch (f) {
    case LoraFamily::kFlux: return "FLUX";
    case LoraFamily::kSD3: return "SD3";
    case LoraFamily::kSDXL: return "SDXL";
  }
  return "?";
}

// "a FLUX", "an SD3", "an SDXL" (messages).
std::string with_article(const std::string& title) { return (title[0] == 'S' ? "an " : "a ") + title; }

// The diffusers-format prefix of the model's keys.
std::string diffusers_prefix(LoraFamily f) { return f == LoraFamily::kSDXL ? "unet." : "transformer."; }

void check_model_family(flame::nn::Module& model, LoraFamily family, const char* op) {
  bool ok = false;
  switch (family) {
    case LoraFamily::kFlux: ok = dynamic_cast<FluxTransformer2DModel*>(&model) != nullptr; break;
    case LoraFamily::kSD3: ok = dynamic_cast<SD3Transformer2DModel*>(&model) != nullptr; break;
    case LoraFamily::kSDXL: ok = dynamic_cast<UNet2DConditionModel*>(&model) != nullptr; break;
  }
  FLAME_CHECK(ok, op, "the model is a ", model.name(), ", not ", with_article(family_title(family)),
              " model (FluxTransformer2DModel, SD3Transformer2DModel or UNet2DConditionModel for flux, sd3, sdxl)");
}

std::string underscored(std::string s) {
  std::replace(s.begin(), s.end(), '.', '_');
  return s;
}

std::string shape_str(const Shape& s) {
  std::ostringstream o;
  o << "[";
  for (std::size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

// ---- kohya stems (Note [LoRA file layouts]) ----
// Rows [fused_row, fused_row + rows) of the stem's layer are rows [module_row, module_row + rows)
// of `module`.
struct Part {
  std::string module;
  int64_t fused_row = 0, rows = 0, module_row = 0;
};
struct Stem {
  std::string name;
  std::vector<Part> parts;
  int64_t out_rows = 0;
  bool write = true;  // false: a spelling read but not written
  bool fused() const { return parts.size() > 1; }
};

Stem whole(const std::string& name, const std::string& module, const LinearMap& lin, bool write = true) {
  const int64_t out = lin.at(module)->out_features();
  return {name, {{module, 0, out, 0}}, out, write};
}

std::vector<Stem> flux_stems(const LinearMap& lin) {
  std::vector<Stem> out;
  auto has = [&](const std::string& m) { return lin.count(m) > 0; };
  auto add_whole = [&](const std::string& bfl, const std::string& module) {
    if (has(module)) out.push_back(whole("lora_unet_" + bfl, module, lin));
  };
  auto add_fused = [&](const std::string& bfl, const std::vector<std::string>& modules) {
    Stem s{"lora_unet_" + bfl, {}, 0, true};
    for (const auto& m : modules) {
      if (!has(m)) return;
      const int64_t rows = lin.at(m)->out_features();
      s.parts.push_back({m, s.out_rows, rows, 0});
      s.out_rows += rows;
    }
    out.push_back(std::move(s));
  };
  for (int64_t i = 0; has("transformer_blocks." + std::to_string(i) + ".attn.to_q"); ++i) {
    const std::string d = "transformer_blocks." + std::to_string(i) + ".", b = "double_blocks_" + std::to_string(i) + "_";
    add_fused(b + "img_attn_qkv", {d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"});
    add_whole(b + "img_attn_proj", d + "attn.to_out.0");
    add_fused(b + "txt_attn_qkv", {d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"});
    add_whole(b + "txt_attn_proj", d + "attn.to_add_out");
    add_whole(b + "img_mlp_0", d + "ff.net.0.proj");
    add_whole(b + "img_mlp_2", d + "ff.net.2");
    add_whole(b + "txt_mlp_0", d + "ff_context.net.0.proj");
    add_whole(b + "txt_mlp_2", d + "ff_context.net.2");
    add_whole(b + "img_mod_lin", d + "norm1.linear");
    add_whole(b + "txt_mod_lin", d + "norm1_context.linear");
  }
  for (int64_t i = 0; has("single_transformer_blocks." + std::to_string(i) + ".attn.to_q"); ++i) {
    const std::string d = "single_transformer_blocks." + std::to_string(i) + ".", b = "single_blocks_" + std::to_string(i) + "_";
    add_fused(b + "linear1", {d + "attn.to_q", d + "attn.to_k", d + "attn.to_v", d + "proj_mlp"});
    add_whole(b + "linear2", d + "proj_out");
    add_whole(b + "modulation_lin", d + "norm.linear");
  }
  add_whole("img_in", "x_embedder");
  add_whole("txt_in", "context_embedder");
  add_whole("time_in_in_layer", "time_text_embed.timestep_embedder.linear_1");
  add_whole("time_in_out_layer", "time_text_embed.timestep_embedder.linear_2");
  add_whole("vector_in_in_layer", "time_text_embed.text_embedder.linear_1");
  add_whole("vector_in_out_layer", "time_text_embed.text_embedder.linear_2");
  add_whole("guidance_in_in_layer", "time_text_embed.guidance_embedder.linear_1");
  add_whole("guidance_in_out_layer", "time_text_embed.guidance_embedder.linear_2");
  add_whole("final_layer_linear", "proj_out");
  if (has("norm_out.linear")) {
    // BFL's final adaLN stores (shift, scale), diffusers' AdaLayerNormContinuous (scale, shift).
    const int64_t rows = lin.at("norm_out.linear")->out_features(), h = rows / 2;
    out.push_back({"lora_unet_final_layer_adaLN_modulation_1",
                   {{"norm_out.linear", 0, h, h}, {"norm_out.linear", h, h, 0}}, rows, true});
  }
  // The diffusers-named kohya spelling (lora_transformer_<module>) is read too.
  for (const auto& [name, l] : lin) out.push_back(whole("lora_transformer_" + underscored(name), name, lin, false));
  return out;
}

std::vector<Stem> stems_of(flame::nn::Module& model, LoraFamily family, const LinearMap& lin) {
  std::vector<Stem> out;
  switch (family) {
    case LoraFamily::kFlux: return flux_stems(lin);
    case LoraFamily::kSD3:
      for (const auto& [name, l] : lin) out.push_back(whole("lora_transformer_" + underscored(name), name, lin));
      return out;
    case LoraFamily::kSDXL: {
      const auto& config = dynamic_cast<UNet2DConditionModel&>(model).config();
      for (const auto& [name, l] : lin) {
        if (auto original = unet_original_name(config, name)) {
          out.push_back(whole("lora_unet_" + underscored(*original), name, lin));
        }
        // kohya's SD 1.x files (and some SDXL tools) use the diffusers path.
        out.push_back(whole("lora_unet_" + underscored(name), name, lin, false));
      }
      return out;
    }
  }
  return out;
}

// ---- one module's adapter, independent of the layout ----
struct ModuleLora {
  Tensor A, B;       // [r, in], [out, r]
  Tensor magnitude;  // DoRA [out], or undefined
  double alpha = 0;  // scaling * r
  std::string key;   // the file key it came from (messages)
  int64_t rank() const { return A.size(0); }
};

// A LoRA / DoRA adapter (has_lora() is also true for LoKr).
bool has_lora_adapter(const Linear* l) { return l->has_lora() && !l->has_lokr(); }

std::map<std::string, ModuleLora> adapters_of(const LinearMap& lin) {
  std::map<std::string, ModuleLora> out;
  for (const auto& [name, l] : lin) {
    if (!has_lora_adapter(l)) continue;
    FLAME_CHECK(!l->merged(), "save_lora", "the adapter of ", name, " is merged into its weight; unmerge_lora first");
    ModuleLora a;
    a.A = l->lora_A()->weight().detach();
    a.B = l->lora_B()->weight().detach();
    if (l->lora_options().use_dora) a.magnitude = l->lora_magnitude_vector().detach();
    a.alpha = l->lora_scaling() * static_cast<double>(a.rank());
    out[name] = a;
  }
  return out;
}

// ---- one module's LoKr adapter (Note [LoKr files]) ----
struct ModuleLokr {
  Tensor w1, w1_a, w1_b, w2, w2_a, w2_b;  // the defined ones as in nn::Linear::LokrFactors
  double scale = 1.0;
  std::string key;  // the file key it came from (messages)
  flame::nn::LokrLayout layout() const {
    flame::nn::LokrLayout l;
    l.decompose_w1 = !w1.defined();
    l.decompose_w2 = !w2.defined();
    l.a = l.decompose_w1 ? w1_a.size(0) : w1.size(0);
    l.b = l.decompose_w1 ? w1_b.size(1) : w1.size(1);
    l.c = l.decompose_w2 ? w2_a.size(0) : w2.size(0);
    l.d = l.decompose_w2 ? w2_b.size(1) : w2.size(1);
    l.rank = l.decompose_w2 ? w2_a.size(1) : l.decompose_w1 ? w1_a.size(1) : 0;
    l.scale = scale;
    return l;
  }
  // The kohya .alpha: scale * rank (LyCORIS writes the rank when both factors are whole).
  double alpha() const {
    const auto l = layout();
    return l.rank > 0 ? scale * static_cast<double>(l.rank) : 1.0;
  }
  std::vector<std::pair<const char*, const Tensor*>> tensors() const {
    std::vector<std::pair<const char*, const Tensor*>> out;
    for (const auto& [n, t] : {std::pair{"lokr_w1", &w1}, {"lokr_w1_a", &w1_a}, {"lokr_w1_b", &w1_b}, {"lokr_w2", &w2},
                               {"lokr_w2_a", &w2_a}, {"lokr_w2_b", &w2_b}}) {
      if (t->defined()) out.emplace_back(n, t);
    }
    return out;
  }
};

std::map<std::string, ModuleLokr> lokr_adapters_of(const LinearMap& lin) {
  std::map<std::string, ModuleLokr> out;
  for (const auto& [name, l] : lin) {
    if (!l->has_lokr()) continue;
    FLAME_CHECK(!l->merged(), "save_lora", "the LoKr adapter of ", name, " is merged into its weight; unmerge_lora first");
    const auto& f = l->lokr_factors();
    ModuleLokr a;
    for (auto [dst, src] : {std::pair{&a.w1, &f.w1}, {&a.w1_a, &f.w1_a}, {&a.w1_b, &f.w1_b}, {&a.w2, &f.w2},
                            {&a.w2_a, &f.w2_a}, {&a.w2_b, &f.w2_b}}) {
      if (src->defined()) *dst = src->detach();
    }
    a.scale = l->lokr_layout().scale;
    a.key = name;
    out[name] = a;
  }
  return out;
}

void write_lokr(const std::string& stem, const ModuleLokr& a, StateDict& out) {
  for (const auto& [n, t] : a.tensors()) out.insert(stem + "." + n, t->contiguous());
  out.insert(stem + ".alpha", Tensor::scalar(a.alpha(), {DType::f32}));
}

std::string number(double v) {
  std::ostringstream o;
  o.precision(17);
  o << v;
  return o.str();
}

template <class T>
T most_common(const std::vector<T>& values) {
  std::map<T, int> counts;
  for (const T& v : values) ++counts[v];
  T best = values.front();
  int n = 0;
  for (const auto& [v, c] : counts) {
    if (c > n) best = v, n = c;
  }
  return best;
}

// PEFT's LoraConfig fields for these adapters, keys prefixed by `prefix`.
json adapter_config(const std::map<std::string, ModuleLora>& adapters, const std::string& prefix) {
  std::vector<int64_t> ranks;
  std::vector<double> alphas;
  bool dora = false;
  for (const auto& [n, a] : adapters) {
    ranks.push_back(a.rank());
    alphas.push_back(a.alpha);
    dora = dora || a.magnitude.defined();
  }
  const int64_t r = most_common(ranks);
  const double alpha = most_common(alphas);
  json rank_pattern = json::object(), alpha_pattern = json::object(), targets = json::array();
  for (const auto& [n, a] : adapters) {
    targets.push_back(n);
    if (a.rank() != r) rank_pattern[n] = a.rank();
    if (a.alpha != alpha) alpha_pattern[n] = a.alpha;
  }
  json j = json::object();
  j[prefix + "r"] = r;
  j[prefix + "lora_alpha"] = alpha;
  j[prefix + "rank_pattern"] = rank_pattern;
  j[prefix + "alpha_pattern"] = alpha_pattern;
  j[prefix + "target_modules"] = targets;
  j[prefix + "use_dora"] = dora;
  j[prefix + "use_rslora"] = false;  // lora_alpha is written as scaling * r
  j[prefix + "lora_dropout"] = 0.0;
  j[prefix + "bias"] = "none";
  j[prefix + "init_lora_weights"] = true;
  return j;
}

// The kohya tensors of one stem from the adapters of its modules.
void write_kohya_stem(const Stem& s, const std::map<std::string, ModuleLora>& adapters, StateDict& out,
                      std::vector<int64_t>& ranks, std::vector<double>& alphas) {
  std::vector<std::string> modules;  // distinct adapted modules, in part order
  for (const Part& p : s.parts) {
    if (adapters.count(p.module) && std::find(modules.begin(), modules.end(), p.module) == modules.end()) {
      modules.push_back(p.module);
    }
  }
  if (modules.empty()) return;
  const ModuleLora& first = adapters.at(modules.front());
  if (!s.fused() && s.parts[0].module_row == 0) {
    out.insert(s.name + ".lora_down.weight", first.A.contiguous());
    out.insert(s.name + ".lora_up.weight", first.B.contiguous());
    out.insert(s.name + ".alpha", Tensor::scalar(first.alpha, {DType::f32}));
    if (first.magnitude.defined()) out.insert(s.name + ".dora_scale", first.magnitude.contiguous());
    ranks.push_back(first.rank());
    alphas.push_back(first.alpha);
    return;
  }
  const double scaling = first.alpha / static_cast<double>(first.rank());
  int64_t total = 0;
  std::map<std::string, int64_t> column;
  std::vector<Tensor> downs;
  for (const auto& m : modules) {
    const ModuleLora& a = adapters.at(m);
    FLAME_CHECK(!a.magnitude.defined(), "save_lora", "the DoRA adapter of ", m, " is part of the fused layer ",
                s.name, ", which the kohya layout cannot hold with DoRA; save it in the diffusers or peft layout");
    column[m] = total;
    total += a.rank();
    downs.push_back(a.A.to(DType::f32));
  }
  const Tensor down = flame::cat(downs, 0);
  Tensor up = Tensor::zeros({s.out_rows, total}, {DType::f32, first.B.device()});
  for (const Part& p : s.parts) {
    auto it = adapters.find(p.module);
    if (it == adapters.end()) continue;
    const ModuleLora& a = it->second;
    const double factor = (a.alpha / static_cast<double>(a.rank())) / scaling;
    up.narrow(0, p.fused_row, p.rows).narrow(1, column.at(p.module), a.rank())
        .copy_(a.B.to(DType::f32).narrow(0, p.module_row, p.rows) * factor);
  }
  const DType dtype = first.A.dtype();
  out.insert(s.name + ".lora_down.weight", down.to(dtype));
  out.insert(s.name + ".lora_up.weight", up.to(dtype));
  out.insert(s.name + ".alpha", Tensor::scalar(scaling * static_cast<double>(total), {DType::f32}));
  ranks.push_back(total);
  alphas.push_back(scaling * static_cast<double>(total));
}

}  // namespace

const char* to_string(LoraFamily family) {
  switch (family) {
    case LoraFamily::kFlux: return "flux";
    case LoraFamily::kSD3: return "sd3";
    case LoraFamily::kSDXL: return "sdxl";
  }
  return "?";
}

const char* to_string(LoraFileFormat format) {
  switch (format) {
    case LoraFileFormat::kPeft: return "peft";
    case LoraFileFormat::kDiffusers: return "diffusers";
    case LoraFileFormat::kKohya: return "kohya";
  }
  return "?";
}

LoraFamily lora_family_from_string(const std::string& name) {
  for (LoraFamily f : {LoraFamily::kFlux, LoraFamily::kSD3, LoraFamily::kSDXL}) {
    if (name == to_string(f)) return f;
  }
  FLAME_FAIL("lora_family_from_string", "unknown LoRA family '", name, "' (flux, sd3, sdxl)");
}

LoraFileFormat lora_format_from_string(const std::string& name) {
  for (LoraFileFormat f : {LoraFileFormat::kPeft, LoraFileFormat::kDiffusers, LoraFileFormat::kKohya}) {
    if (name == to_string(f)) return f;
  }
  FLAME_FAIL("lora_format_from_string", "unknown LoRA file format '", name, "' (peft, diffusers, kohya)");
}

std::string guess_lora_family(const std::vector<std::string>& keys) {
  auto any = [&](std::initializer_list<const char*> parts) {
    for (const auto& k : keys) {
      for (const char* p : parts) {
        if (k.find(p) != std::string::npos) return true;
      }
    }
    return false;
  };
  if (any({"double_blocks", "single_blocks", "single_transformer_blocks"})) return "flux";
  if (any({"input_blocks", "output_blocks", "middle_block", "down_blocks", "up_blocks", "mid_block"}) ||
      std::any_of(keys.begin(), keys.end(), [](const std::string& k) { return k.starts_with("unet."); })) {
    return "sdxl";
  }
  if (any({"joint_blocks", "context_block", "x_block"})) return "sd3";
  if (any({"transformer_blocks"})) return "flux-or-sd3";  // both use diffusers' joint block names
  return "";
}

void save_lora(const std::string& path, flame::nn::Module& model, LoraFamily family, LoraFileFormat format,
               const std::map<std::string, std::string>& metadata) {
  check_model_family(model, family, "save_lora");
  const LinearMap lin = linears_of(model);
  const auto adapters = adapters_of(lin);
  const auto lokr = lokr_adapters_of(lin);
  FLAME_CHECK(!adapters.empty() || !lokr.empty(), "save_lora", "the ", model.name(), " has no LoRA or LoKr adapter to save to ",
              path);
  FLAME_CHECK(lokr.empty() || format == LoraFileFormat::kKohya, "save_lora", "the LoKr adapter of ", lokr.begin()->first,
              " (and ", lokr.size() - 1, " more) can be written in the kohya layout only (LyCORIS' lora_unet_*.lokr_w1 "
              "keys, which ComfyUI and Forge load), not as ", to_string(format), " (", path, "); save with format kohya");
  StateDict dict;
  flame::io::Metadata meta = {{"format", "pt"}, {"lora_format", to_string(format)}, {"lora_family", to_string(family)}};
  std::vector<int64_t> ranks;
  std::vector<double> alphas;
  if (format == LoraFileFormat::kKohya) {
    std::set<std::string> written;
    for (const Stem& s : stems_of(model, family, lin)) {
      if (!s.write) continue;
      const std::size_t before = dict.size();
      write_kohya_stem(s, adapters, dict, ranks, alphas);
      if (dict.size() != before) {
        for (const Part& p : s.parts) written.insert(p.module);
      }
    }
    for (const auto& [m, a] : adapters) {
      FLAME_CHECK(written.count(m), "save_lora", "the adapted module ", m, " has no name in the kohya layout of ",
                  family_title(family), "; save in the diffusers or peft layout");
    }
    // Note [LoKr files]: a module's own stem, else (a fused or reordered FLUX layer) its
    // lora_transformer_ spelling.
    for (const Stem& s : stems_of(model, family, lin)) {
      if (!s.write || s.fused() || s.parts[0].module_row != 0) continue;
      auto it = lokr.find(s.parts[0].module);
      if (it == lokr.end() || written.count(it->first)) continue;
      write_lokr(s.name, it->second, dict);
      written.insert(it->first);
    }
    for (const auto& [m, a] : lokr) {
      if (!written.count(m)) {
        FLAME_CHECK(family == LoraFamily::kFlux, "save_lora", "the LoKr-adapted module ", m,
                    " has no name in the kohya layout of ", family_title(family));
        write_lokr("lora_transformer_" + underscored(m), a, dict);
      }
      const auto l = a.layout();
      ranks.push_back(l.rank);
      alphas.push_back(a.alpha());
    }
    meta["ss_network_module"] = lokr.empty() ? "networks.lora" : "lycoris.kohya";
    if (!lokr.empty()) meta["ss_network_args"] = R"({"algo": "lokr"})";
    meta["ss_network_dim"] = std::to_string(most_common(ranks));
    meta["ss_network_alpha"] = number(most_common(alphas));
    meta["ss_base_model_version"] =
        family == LoraFamily::kFlux ? "flux1" : family == LoraFamily::kSD3 ? "sd3" : "sdxl_base_v1-0";
  } else {
    const std::string prefix = format == LoraFileFormat::kPeft ? flame::nn::kPeftPrefix : diffusers_prefix(family);
    for (const auto& [m, a] : adapters) {
      dict.insert(prefix + m + ".lora_A.weight", a.A.contiguous());
      dict.insert(prefix + m + ".lora_B.weight", a.B.contiguous());
      if (a.magnitude.defined()) dict.insert(prefix + m + ".lora_magnitude_vector", a.magnitude.contiguous());
      ranks.push_back(a.rank());
      alphas.push_back(a.alpha);
    }
    const std::string config_prefix = format == LoraFileFormat::kPeft ? "" : prefix;
    meta[kAdapterMetadataKey] = adapter_config(adapters, config_prefix).dump(2);
    if (format == LoraFileFormat::kPeft && std::filesystem::path(path).filename() == "adapter_model.safetensors") {
      // PEFT's folder: PeftModel.from_pretrained reads the configuration from adapter_config.json.
      json config = adapter_config(adapters, "");
      config["peft_type"] = "LORA";
      const std::filesystem::path config_path = std::filesystem::path(path).parent_path() / "adapter_config.json";
      std::ofstream out(config_path);
      out << config.dump(2) << "\n";
      FLAME_CHECK(out.good(), "save_lora", "could not write ", config_path.string());
    }
  }
  meta["lora_rank"] = std::to_string(most_common(ranks));
  meta["lora_alpha"] = number(most_common(alphas));
  for (const auto& [k, v] : metadata) meta[k] = v;
  flame::io::save_safetensors(path, dict, meta);
}

void save_merged_checkpoint(const std::string& path, flame::nn::Module& model, std::optional<DType> dtype,
                            const std::map<std::string, std::string>& metadata) {
  const LinearMap lin = linears_of(model);
  std::vector<Linear*> merged;
  for (const auto& [n, l] : lin) {
    if (l->has_lora() && !l->merged()) merged.push_back(l);
  }
  FLAME_CHECK(!merged.empty(), "save_merged_checkpoint", "the ", model.name(), " has no unmerged LoRA adapter to merge into ",
              path);
  flame::io::Metadata meta = {{"format", "pt"}, {"lora_merged", "true"}};
  for (const auto& [k, v] : metadata) meta[k] = v;
  // Written while merged (the dict shares the weights: no copy of the model), unmerged whatever happens.
  try {
    for (Linear* l : merged) l->merge();
    StateDict out;
    for (const auto& [k, t] : model.state_dict()) {
      if (flame::nn::is_lora_key(k)) continue;
      out.insert(k, dtype && flame::is_floating(t.dtype()) ? t.to(*dtype) : t);
    }
    flame::io::save_safetensors(path, out, meta);
  } catch (...) {
    for (Linear* l : merged) {
      if (l->merged()) l->unmerge();
    }
    throw;
  }
  for (Linear* l : merged) l->unmerge();
}

// ---- reading ----
namespace {

bool is_text_encoder_key(const std::string& k) {
  return k.starts_with("lora_te") || k.starts_with("text_encoder") || k.starts_with("te1.") ||
         k.starts_with("te2.") || k.starts_with("text_encoders.");
}

bool is_unsupported_kind(const std::string& k) {
  for (const char* p : {".lokr_t2", ".hada_w1", ".hada_w2", ".oft_", ".ia3_"}) {
    if (k.find(p) != std::string::npos) return true;
  }
  return false;
}

// Alpha per module from the diffusers/PEFT adapter configuration, if the file has one.
struct AlphaSource {
  std::optional<double> alpha;  // lora_alpha
  bool rslora = false;
  std::map<std::string, double> pattern;
  std::optional<double> of(const std::string& module, int64_t rank) const {
    std::optional<double> a = alpha;
    for (const auto& [p, v] : pattern) {
      if (module == p || module.ends_with("." + p)) a = v;
    }
    if (!a) return std::nullopt;
    return rslora ? *a / std::sqrt(static_cast<double>(rank)) * static_cast<double>(rank) : *a;
  }
};

// PEFT's LoraConfig fields (keys with or without `prefix`) into `out`.
void read_adapter_config(const json& j, const std::string& prefix, AlphaSource& out) {
  auto get = [&](const std::string& k) -> const json* {
    for (const std::string& key : {prefix + k, k}) {
      if (j.is_object() && j.contains(key) && !j.at(key).is_null()) return &j.at(key);
    }
    return nullptr;
  };
  if (const json* a = get("lora_alpha"); a && a->is_number()) out.alpha = a->get<double>();
  if (const json* r = get("use_rslora"); r && r->is_boolean()) out.rslora = r->get<bool>();
  if (const json* p = get("alpha_pattern"); p && p->is_object()) {
    for (const auto& [k, v] : p->items()) {
      if (v.is_number()) out.pattern[k] = v.get<double>();
    }
  }
}

json parse_json(const std::string& text, const std::string& what) {
  try {
    return json::parse(text);
  } catch (const std::exception& e) {
    FLAME_FAIL(kOp, what, " is not JSON (", e.what(), ")");
  }
}

// Alpha: the adapter configuration in the metadata (diffusers, FLAME's peft files), else PEFT's
// adapter_config.json beside a PEFT file, else the metadata's lora_alpha / ss_network_alpha.
AlphaSource alpha_source(const flame::io::Metadata& meta, const std::string& path, const std::string& prefix) {
  AlphaSource out;
  if (auto it = meta.find(kAdapterMetadataKey); it != meta.end()) {
    read_adapter_config(parse_json(it->second, path + ": its " + kAdapterMetadataKey + " metadata"), prefix, out);
  } else if (prefix == flame::nn::kPeftPrefix) {
    const std::filesystem::path config = std::filesystem::path(path).parent_path() / "adapter_config.json";
    if (std::filesystem::exists(config)) {
      std::ifstream in(config);
      std::stringstream text;
      text << in.rdbuf();
      read_adapter_config(parse_json(text.str(), config.string()), "", out);
    }
  }
  if (!out.alpha) {
    for (const char* k : {"lora_alpha", "ss_network_alpha"}) {
      if (auto it = meta.find(k); it != meta.end()) {
        try {
          out.alpha = std::stod(it->second);
        } catch (const std::exception&) {
          FLAME_FAIL(kOp, path, ": metadata ", k, " = '", it->second, "' is not a number");
        }
        break;
      }
    }
  }
  return out;
}

// Column indices of `B` [rows, R] with a nonzero entry.
std::vector<int64_t> used_columns(const Tensor& B) {
  const std::vector<double> s = B.to(DType::f64).abs().sum({0}).to_vec<double>();
  std::vector<int64_t> out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] != 0.0) out.push_back(static_cast<int64_t>(i));
  }
  return out;
}

Tensor take(const Tensor& t, int64_t dim, const std::vector<int64_t>& index) {
  return t.index_select(dim, Tensor::from_vec(index, {static_cast<int64_t>(index.size())}, t.device()));
}

struct Reader {
  std::string path;
  LoraFamily family;
  flame::nn::Module& model;
  LinearMap lin;
  std::map<std::string, ModuleLora> incoming;
  std::map<std::string, ModuleLokr> incoming_lokr;
  std::vector<std::string> unplaced;
  std::vector<std::string> skipped;

  [[noreturn]] void fail_unplaced(const std::vector<std::string>& keys) const {
    const std::string guess = guess_lora_family(keys);
    if (guess == "flux-or-sd3" && family == LoraFamily::kSDXL) {
      FLAME_FAIL(kOp, path, " looks like a FLUX or SD3 LoRA; the model is SDXL (keys such as ", keys.front(), ")");
    }
    if (!guess.empty() && guess != "flux-or-sd3" && guess != to_string(family)) {
      FLAME_FAIL(kOp, path, " looks like ", with_article(family_title(lora_family_from_string(guess))), " LoRA; the model is ",
                 family_title(family), " (keys such as ", keys.front(), ")");
    }
    std::string list;
    for (std::size_t i = 0; i < keys.size() && i < 5; ++i) list += "\n  " + keys[i];
    FLAME_FAIL(kOp, path, ": ", keys.size(), " key(s) name no adaptable layer of the ", family_title(family), " model ",
               model.name(), ", e.g.:", list);
  }

  // Files the file's entry for `module` (a LoRA into `incoming`, a LoKr into `incoming_lokr`); an
  // entry for a module the model lacks is listed as unplaced.
  template <class Entry>
  void file(std::map<std::string, Entry>& into, const std::string& module, Entry a) {
    if (!lin.count(module)) {
      unplaced.push_back(a.key);
      return;
    }
    FLAME_CHECK(!incoming.count(module) && !incoming_lokr.count(module), kOp, path, ": two entries of the file adapt ",
                module, " (the second is ", a.key, ")");
    into[module] = std::move(a);
  }
  void add(const std::string& module, ModuleLora a) { file(incoming, module, std::move(a)); }
  void add_lokr(const std::string& module, ModuleLokr a) { file(incoming_lokr, module, std::move(a)); }

  // Note [LoKr files], reading: the factors of `stem`, found from its lokr_w1 / lokr_w1_a key `key`.
  void read_lokr(const StateDict& sd, const std::string& stem, const std::string& key, const Stem& s) {
    auto get = [&](const char* n) {
      const Tensor* t = sd.find(stem + "." + n);
      return t ? *t : Tensor();
    };
    ModuleLokr f{get("lokr_w1"), get("lokr_w1_a"), get("lokr_w1_b"), get("lokr_w2"), get("lokr_w2_a"), get("lokr_w2_b"), 1.0, key};
    auto shapes = [&] {
      std::string out;
      for (const auto& [n, t] : f.tensors()) out += std::string(out.empty() ? "" : ", ") + n + " " + shape_str(t->sizes());
      return out;
    };
    FLAME_CHECK(!sd.find(stem + ".dora_scale"), kOp, path, ": ", stem, " is a LoKr with weight decomposition (dora_scale), "
                "which is not supported");
    const bool w1_ok = f.w1.defined() ? !f.w1_a.defined() && !f.w1_b.defined() : f.w1_a.defined() && f.w1_b.defined();
    const bool w2_ok = f.w2.defined() ? !f.w2_a.defined() && !f.w2_b.defined() : f.w2_a.defined() && f.w2_b.defined();
    bool dims_ok = w1_ok && w2_ok;
    for (const auto& [n, t] : f.tensors()) dims_ok = dims_ok && t->dim() == 2;
    if (dims_ok && !f.w1.defined()) dims_ok = f.w1_a.size(1) == f.w1_b.size(0);
    if (dims_ok && !f.w2.defined()) dims_ok = f.w2_a.size(1) == f.w2_b.size(0);
    if (dims_ok && !f.w1.defined() && !f.w2.defined()) dims_ok = f.w1_a.size(1) == f.w2_a.size(1);
    FLAME_CHECK(dims_ok, kOp, path, ": ", stem, " is not a LoKr adapter FLAME reads (", shapes(), "): it needs lokr_w1 "
                "[a, b] or lokr_w1_a [a, r] and lokr_w1_b [r, b], and lokr_w2 [c, d] or lokr_w2_a [c, r] and lokr_w2_b [r, d], "
                "one rank r");
    const flame::nn::LokrLayout l = f.layout();
    const int64_t in = lin.at(s.parts[0].module)->in_features();
    FLAME_CHECK(l.a * l.c == s.out_rows && l.b * l.d == in, kOp, path, ": ", stem, " has ", shapes(),
                ", a kron product of [", l.a * l.c, ", ", l.b * l.d, "]; the model's layer is [", s.out_rows, ", ", in, "]");
    // ComfyUI's and LyCORIS' scale: alpha / r, and 1 when both factors are whole or alpha is absent.
    if (const Tensor* a = sd.find(stem + ".alpha"); a && l.rank > 0) {
      FLAME_CHECK(a->numel() == 1, kOp, path, ": ", stem, ".alpha has shape ", shape_str(a->sizes()), ", not a scalar");
      f.scale = a->item<double>() / static_cast<double>(l.rank);
    }
    if (s.parts.size() == 1 && s.parts[0].module_row == 0) {
      add_lokr(s.parts[0].module, std::move(f));
      return;
    }
    // A fused layer: module m takes the rows of w1 (w1_a) over its rows, which must be whole
    // blocks of w2's c rows (rows i c + k of kron(w1, w2) are row i of w1 with row k of w2).
    std::vector<std::string> modules;
    for (const Part& p : s.parts) {
      if (std::find(modules.begin(), modules.end(), p.module) == modules.end()) modules.push_back(p.module);
    }
    const Tensor& rows_of = f.w1.defined() ? f.w1 : f.w1_a;
    for (const auto& m : modules) {
      const int64_t out = lin.at(m)->out_features();
      Tensor w = Tensor::zeros({out / l.c, rows_of.size(1)}, {rows_of.dtype(), rows_of.device()});
      for (const Part& p : s.parts) {
        if (p.module != m) continue;
        FLAME_CHECK(p.fused_row % l.c == 0 && p.rows % l.c == 0 && p.module_row % l.c == 0 && out % l.c == 0, kOp, path,
                    ": ", stem, " is a LoKr of the fused layer (", shapes(), "); the rows [", p.fused_row, ", ",
                    p.fused_row + p.rows, ") of ", m, " are not whole blocks of w2's ", l.c,
                    " rows, so it cannot become a LoKr adapter of ", m, " alone");
        w.narrow(0, p.module_row / l.c, p.rows / l.c).copy_(rows_of.narrow(0, p.fused_row / l.c, p.rows / l.c));
      }
      ModuleLokr g = f;
      (f.w1.defined() ? g.w1 : g.w1_a) = w;
      add_lokr(m, std::move(g));
    }
  }

  const Tensor& need(const StateDict& sd, const std::string& key, const std::string& why) const {
    const Tensor* t = sd.find(key);
    FLAME_CHECK(t, kOp, path, ": ", why, " has no ", key);
    return *t;
  }

  // peft / diffusers keys under `prefix`.
  void read_peft(const StateDict& sd, const std::string& prefix, const AlphaSource& alphas) {
    for (const auto& [k, t] : sd) {
      if (is_text_encoder_key(k)) {
        skipped.push_back(k);
        continue;
      }
      if (!k.starts_with(prefix) || !k.ends_with(".lora_A.weight")) {
        if (!(k.starts_with(prefix) && (k.ends_with(".lora_B.weight") || k.ends_with(".lora_magnitude_vector")))) {
          unplaced.push_back(k);
        }
        continue;
      }
      const std::string module = k.substr(prefix.size(), k.size() - prefix.size() - 14);
      ModuleLora a;
      a.key = k;
      a.A = t;
      a.B = need(sd, prefix + module + ".lora_B.weight", k);
      if (const Tensor* m = sd.find(prefix + module + ".lora_magnitude_vector")) a.magnitude = *m;
      FLAME_CHECK(a.A.dim() == 2, kOp, path, ": ", k, " has shape ", shape_str(a.A.sizes()), ", not [rank, in]");
      a.alpha = alphas.of(module, a.rank()).value_or(static_cast<double>(a.rank()));
      add(module, std::move(a));
    }
  }

  void read_kohya(const StateDict& sd, const AlphaSource& alphas) {
    std::map<std::string, const Stem*> by_name;
    const std::vector<Stem> stems = stems_of(model, family, lin);
    for (const Stem& s : stems) by_name.emplace(s.name, &s);
    for (const auto& [k, t] : sd) {
      if (is_text_encoder_key(k)) {
        skipped.push_back(k);
        continue;
      }
      const std::size_t dot = k.find('.');
      const std::string stem = k.substr(0, dot), what = dot == std::string::npos ? "" : k.substr(dot + 1);
      if (what.starts_with("lokr_")) {
        FLAME_CHECK(sd.find(stem + ".lokr_w1") || sd.find(stem + ".lokr_w1_a"), kOp, path, ": ", k,
                    " belongs to a LoKr adapter without ", stem, ".lokr_w1 (or lokr_w1_a / lokr_w1_b)");
        if (what != "lokr_w1" && what != "lokr_w1_a") continue;  // read with the stem's w1
        auto it = by_name.find(stem);
        if (it == by_name.end()) {
          unplaced.push_back(k);
        } else {
          read_lokr(sd, stem, k, *it->second);
        }
        continue;
      }
      if (what != "lora_down.weight") {
        if (what != "lora_up.weight" && what != "alpha" && what != "dora_scale") unplaced.push_back(k);
        continue;
      }
      auto it = by_name.find(stem);
      if (it == by_name.end()) {
        unplaced.push_back(k);
        continue;
      }
      const Stem& s = *it->second;
      const Tensor down = t, up = need(sd, stem + ".lora_up.weight", k);
      FLAME_CHECK(down.dim() == 2 && up.dim() == 2 && up.size(1) == down.size(0) && up.size(0) == s.out_rows, kOp, path,
                  ": ", stem, " has lora_down ", shape_str(down.sizes()), " and lora_up ", shape_str(up.sizes()),
                  "; the model's layer wants [rank, in] and [", s.out_rows, ", rank]");
      const int64_t R = down.size(0);
      double alpha = alphas.alpha.value_or(static_cast<double>(R));
      if (const Tensor* a = sd.find(stem + ".alpha")) {
        FLAME_CHECK(a->numel() == 1, kOp, path, ": ", stem, ".alpha has shape ", shape_str(a->sizes()), ", not a scalar");
        alpha = a->item<double>();
      }
      const Tensor* dora = sd.find(stem + ".dora_scale");
      if (!s.fused() && s.parts[0].module_row == 0) {
        ModuleLora m{down, up, Tensor(), alpha, k};
        if (dora) {
          FLAME_CHECK(dora->numel() == s.out_rows && (dora->dim() == 1 || dora->size(0) == s.out_rows), kOp, path, ": ",
                      stem, ".dora_scale has shape ", shape_str(dora->sizes()), "; only per-output magnitudes [",
                      s.out_rows, "] are supported");
          m.magnitude = dora->reshape({s.out_rows});
        }
        add(s.parts[0].module, std::move(m));
        continue;
      }
      FLAME_CHECK(!dora, kOp, path, ": ", stem, " is a fused layer with DoRA, which is not supported");
      unfuse(s, down, up, alpha, k);
    }
  }

  // Note [LoRA file layouts], unfusing.
  void unfuse(const Stem& s, const Tensor& down, const Tensor& up, double alpha, const std::string& key) {
    const int64_t R = down.size(0);
    const double scaling = alpha / static_cast<double>(R);
    std::vector<std::string> modules;
    std::map<std::string, Tensor> rows;  // module -> its rows of up, in its own row order
    for (const Part& p : s.parts) {
      if (std::find(modules.begin(), modules.end(), p.module) == modules.end()) modules.push_back(p.module);
    }
    for (const auto& m : modules) {
      const int64_t out = lin.at(m)->out_features();
      Tensor b = Tensor::zeros({out, R}, {up.dtype(), up.device()});
      for (const Part& p : s.parts) {
        if (p.module == m) b.narrow(0, p.module_row, p.rows).copy_(up.narrow(0, p.fused_row, p.rows));
      }
      rows[m] = b;
    }
    // Existing adapters whose ranks sum to R: each module its own block, if the rest of up is zero.
    bool all_existing = true;
    int64_t sum = 0;
    for (const auto& m : modules) {
      Linear* l = lin.at(m);
      if (!has_lora_adapter(l)) all_existing = false;
      else sum += l->lora_A()->weight().size(0);
    }
    if (all_existing && sum == R && modules.size() > 1) {
      int64_t col = 0;
      for (const auto& m : modules) {
        const int64_t r = lin.at(m)->lora_A()->weight().size(0);
        const Tensor& b = rows.at(m);
        const double off = b.to(DType::f64).abs().sum().item<double>() -
                           b.narrow(1, col, r).to(DType::f64).abs().sum().item<double>();
        FLAME_CHECK(off == 0.0, kOp, path, ": ", key, " [", R, ", in] cannot be split into the model's adapters of ranks "
                    "summing to ", R, ": lora_up has entries of ", m, " outside its columns [", col, ", ", col + r, ")");
        add(m, {down.narrow(0, col, r), b.narrow(1, col, r), Tensor(), scaling * static_cast<double>(r), key});
        col += r;
      }
      return;
    }
    for (const auto& m : modules) {
      const Tensor& b = rows.at(m);
      Linear* l = lin.at(m);
      if (has_lora_adapter(l)) {  // rank R (checked against the adapter later)
        add(m, {down, b, Tensor(), alpha, key});
        continue;
      }
      const std::vector<int64_t> cols = used_columns(b);
      if (cols.empty()) continue;  // no update to this part: no adapter
      const int64_t r = static_cast<int64_t>(cols.size());
      if (r == R) {
        add(m, {down, b, Tensor(), alpha, key});
      } else {
        add(m, {take(down, 0, cols), take(b, 1, cols), Tensor(), scaling * static_cast<double>(r), key});
      }
    }
  }

  // Every incoming adapter against its layer; then, all checks passed, the values.
  void apply(LoraLoadReport& report) {
    for (const auto& [m, a] : incoming) {
      Linear* l = lin.at(m);
      const Shape want_a = {a.rank(), l->in_features()}, want_b = {l->out_features(), a.rank()};
      FLAME_CHECK(a.A.sizes() == want_a && a.B.sizes() == want_b, kOp, path, ": ", a.key, " gives ", m, " an adapter with A ",
                  shape_str(a.A.sizes()), " and B ", shape_str(a.B.sizes()), "; the layer (", l->in_features(), " -> ",
                  l->out_features(), ") wants ", shape_str(want_a), " and ", shape_str(want_b));
      FLAME_CHECK(std::isfinite(a.alpha) && a.alpha != 0.0, kOp, path, ": ", a.key, " has alpha ", a.alpha);
      if (a.magnitude.defined()) {
        FLAME_CHECK(a.magnitude.numel() == l->out_features(), kOp, path, ": the DoRA magnitude of ", m, " has ",
                    a.magnitude.numel(), " elements; the layer has ", l->out_features(), " outputs");
      }
      FLAME_CHECK(!l->has_lokr(), kOp, path, ": ", a.key, " is a LoRA adapter; the model's adapter on ", m,
                  " is LoKr (load into a model without adapters)");
      if (l->has_lora()) {
        const Tensor& mine = l->lora_A()->weight();
        FLAME_CHECK(mine.sizes() == a.A.sizes(), kOp, path, ": rank mismatch at ", a.key, ": the file's A is ",
                    shape_str(a.A.sizes()), ", the model's adapter on ", m, " is ", shape_str(mine.sizes()),
                    " (load into a model without adapters to take the file's rank)");
        FLAME_CHECK(a.magnitude.defined() == l->lora_options().use_dora, kOp, path, ": ", a.key,
                    a.magnitude.defined() ? " is a DoRA adapter; the model's adapter on " : " is a plain LoRA; the model's adapter on ",
                    m, a.magnitude.defined() ? " is plain LoRA" : " is DoRA");
        FLAME_CHECK(!l->merged(), kOp, path, ": the adapter of ", m, " is merged; unmerge_lora first");
      }
    }
    for (const auto& [m, f] : incoming_lokr) {
      Linear* l = lin.at(m);
      FLAME_CHECK(std::isfinite(f.scale) && f.scale != 0.0, kOp, path, ": ", f.key, " has scale ", f.scale);
      FLAME_CHECK(!has_lora_adapter(l), kOp, path, ": ", f.key, " is a LoKr adapter; the model's adapter on ", m,
                  " is LoRA (load into a model without adapters)");
      if (!l->has_lokr()) continue;
      const auto mine = l->lokr_layout(), file = f.layout();
      auto describe = [](const flame::nn::LokrLayout& x) {
        std::ostringstream o;
        o << "w1 [" << x.a << ", " << x.b << "]" << (x.decompose_w1 ? " (w1_a @ w1_b)" : "") << ", w2 [" << x.c << ", "
          << x.d << "]" << (x.decompose_w2 ? " (w2_a @ w2_b)" : "") << ", rank " << x.rank;
        return o.str();
      };
      FLAME_CHECK(mine.a == file.a && mine.b == file.b && mine.c == file.c && mine.d == file.d &&
                      mine.decompose_w1 == file.decompose_w1 && mine.decompose_w2 == file.decompose_w2 &&
                      (mine.rank == file.rank || !(file.decompose_w1 || file.decompose_w2)),
                  kOp, path, ": LoKr layout mismatch at ", f.key, ": the file's ", describe(file), "; the model's adapter on ",
                  m, ": ", describe(mine), " (load into a model without adapters to take the file's layout)");
      FLAME_CHECK(!l->merged(), kOp, path, ": the adapter of ", m, " is merged; unmerge_lora first");
    }
    bool created = false;
    flame::NoGradGuard no_grad;
    for (const auto& [m, f] : incoming_lokr) {
      Linear* l = lin.at(m);
      if (l->has_lokr()) {
        report.loaded.push_back(m);
      } else {
        l->add_lokr(f.layout());
        report.created.push_back(m);
        created = true;
      }
      // The update keeps its value under the layer's scale: w2 (or w2_b) takes the ratio.
      const double ratio = f.scale / l->lokr_layout().scale;
      const auto& mine = l->lokr_factors();
      for (auto [dst, src] : {std::pair{&mine.w1, &f.w1}, {&mine.w1_a, &f.w1_a}, {&mine.w1_b, &f.w1_b},
                              {&mine.w2, &f.w2}, {&mine.w2_a, &f.w2_a}, {&mine.w2_b, &f.w2_b}}) {
        if (!src->defined()) continue;
        const bool last = dst == (mine.w2.defined() ? &mine.w2 : &mine.w2_b);
        Tensor d = *dst;
        d.copy_((last ? src->to(DType::f64) * ratio : src->to(DType::f64)).to(d.dtype(), d.device()));
      }
    }
    for (const auto& [m, a] : incoming) {
      Linear* l = lin.at(m);
      double target_scaling;
      if (l->has_lora()) {
        target_scaling = l->lora_scaling();
        report.loaded.push_back(m);
      } else {
        l->add_lora({.rank = a.rank(), .alpha = a.alpha, .use_dora = a.magnitude.defined()});
        target_scaling = l->lora_scaling();
        report.created.push_back(m);
        created = true;
      }
      const double file_scaling = a.alpha / static_cast<double>(a.rank());
      Tensor wa = l->lora_A()->weight(), wb = l->lora_B()->weight();
      wa.copy_(a.A.to(DType::f32).to(wa.dtype(), wa.device()));
      wb.copy_((a.B.to(DType::f64) * (file_scaling / target_scaling)).to(wb.dtype(), wb.device()));
      if (a.magnitude.defined()) {
        Tensor mv = l->lora_magnitude_vector();
        mv.copy_(a.magnitude.reshape({l->out_features()}).to(mv.dtype(), mv.device()));
      }
    }
    if (created) {  // as apply_lora: only the adapters train
      for (auto& [n, p] : model.named_parameters()) {
        if (!flame::nn::is_lora_key(n) && p.requires_grad()) p.requires_grad_(false);
      }
    }
    for (const auto& [m, l] : lin) {
      if (l->has_lora() && !incoming.count(m) && !incoming_lokr.count(m)) report.untouched.push_back(m);
    }
  }
};

}  // namespace

LoraLoadReport load_lora(const std::string& path, flame::nn::Module& model, LoraFamily family) {
  check_model_family(model, family, kOp);
  const flame::io::SafetensorsFile file(path);  // raises naming the file when missing or corrupt
  LoraLoadReport report;
  report.metadata = file.metadata();
  const std::vector<std::string>& keys = file.names();
  FLAME_CHECK(!keys.empty(), kOp, path, " holds no tensors");
  for (const auto& k : keys) {
    FLAME_CHECK(!is_unsupported_kind(k), kOp, path, ": ", k,
                " is a LyCORIS LoHa / OFT / IA3 / Tucker-LoKr (lokr_t2) tensor; only LoRA, DoRA and LoKr adapters are "
                "supported");
  }
  if (auto it = report.metadata.find("lora_family"); it != report.metadata.end() && it->second != to_string(family)) {
    const std::string title = it->second == "sdxl" ? "SDXL" : it->second == "sd3" ? "SD3" : it->second == "flux" ? "FLUX" : it->second;
    FLAME_FAIL(kOp, path, " looks like ", with_article(title), " LoRA (its metadata says lora_family = ", it->second, "); the model is ", family_title(family));
  }
  auto any_starts = [&](const std::string& p) {
    return std::any_of(keys.begin(), keys.end(), [&](const std::string& k) { return k.starts_with(p); });
  };
  auto any_contains = [&](const std::string& p) {
    return std::any_of(keys.begin(), keys.end(), [&](const std::string& k) { return k.find(p) != std::string::npos; });
  };
  std::string prefix;
  if (any_starts(flame::nn::kPeftPrefix)) {
    report.format = LoraFileFormat::kPeft;
    prefix = flame::nn::kPeftPrefix;
  } else if (any_contains(".lora_down.weight") ||
             std::any_of(keys.begin(), keys.end(), [](const std::string& k) {
               return k.starts_with("lora_") && k.find(".lokr_") != std::string::npos;
             })) {
    report.format = LoraFileFormat::kKohya;
  } else if (any_contains(".lora_A.weight")) {
    report.format = LoraFileFormat::kDiffusers;
    prefix = diffusers_prefix(family);
    const std::string other = family == LoraFamily::kSDXL ? "transformer." : "unet.";
    if (!any_starts(prefix) && any_starts(other)) {
      FLAME_FAIL(kOp, path, " looks like ", family == LoraFamily::kSDXL ? "a FLUX or SD3" : "an SDXL",
                 " LoRA (its keys start with '", other, "'); the model is ", family_title(family));
    }
  } else if (!any_contains(".lokr_")) {
    std::vector<std::string> first(keys.begin(), keys.begin() + std::min<std::size_t>(keys.size(), 5));
    std::string list;
    for (const auto& k : first) list += "\n  " + k;
    FLAME_FAIL(kOp, path, " is not a LoRA file in a layout FLAME reads (PEFT base_model.model.*, diffusers *.lora_A.weight, "
               "kohya *.lora_down.weight, LyCORIS *.lokr_w1); its first keys:", list);
  }
  if (report.format != LoraFileFormat::kKohya && any_contains(".lokr_")) {
    FLAME_FAIL(kOp, path, ": LoKr adapters are read from LyCORIS' kohya-style keys (lora_unet_<layer>.lokr_w1 ...); this ",
               prefix.empty() ? "file" : to_string(report.format) + std::string(" file"), " has LoKr keys such as ",
               *std::find_if(keys.begin(), keys.end(), [](const std::string& k) { return k.find(".lokr_") != std::string::npos; }));
  }
  const StateDict sd = file.load_all();
  Reader reader{path, family, model, linears_of(model), {}, {}, {}};
  const AlphaSource alphas = alpha_source(report.metadata, path, prefix);
  if (report.format == LoraFileFormat::kKohya) {
    reader.read_kohya(sd, alphas);
  } else {
    reader.read_peft(sd, prefix, alphas);
  }
  if (!reader.unplaced.empty()) reader.fail_unplaced(reader.unplaced);
  FLAME_CHECK(!reader.incoming.empty() || !reader.incoming_lokr.empty(), kOp, path, " holds no adapter for the ", family_title(family), " model (",
              reader.skipped.size(), " text-encoder keys skipped)");
  reader.apply(report);
  report.skipped = reader.skipped;
  return report;
}

}  // namespace flame_diffusion::models
