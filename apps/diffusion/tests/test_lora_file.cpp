// LoRA files (models/lora_file.h): the tiny FLUX, SD3 and SDXL models with the adapters of
// apps/diffusion/reference/lora_files.py (diffusers 0.42 + peft 0.21, f32 on the CPU), whose outputs
// are in tests/data/models/lora/reference.safetensors; round trips through every layout; the fused
// kohya FLUX layers; alpha conversion; bad files. LoKr (Note [LoKr files]): round trips of the
// LyCORIS kohya keys, a fused FLUX LoKr split against the update added to the weights by hand,
// ComfyUI's scale rules, bad files.
//
// FLAME_LORA_EXPORT_DIR=DIR makes LoraFile.MatchesTheDiffusersReference write FLAME's files there
// for `python3 apps/diffusion/reference/lora_files.py check DIR` (diffusers' own loaders).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <set>

#include <flame/io/safetensors.h>

#include "model_test_util.h"
#include "models/flux.h"
#include "models/lora_file.h"
#include "models/sd3.h"
#include "models/unet2d.h"
#include "models/unet2d_convert.h"

namespace fm = flame_diffusion::models;
namespace nn = flame::nn;
namespace fs = std::filesystem;
using flame::DType;
using flame::Tensor;
using fm::LoraFamily;
using fm::LoraFileFormat;

namespace {

fs::path data_dir() { return fs::path(__FILE__).parent_path() / "data" / "models"; }
fs::path lora_dir() { return data_dir() / "lora"; }

const flame::StateDict& reference() {
  static const flame::StateDict r = flame::io::load_safetensors((lora_dir() / "reference.safetensors").string());
  return r;
}

// A tiny model of one family and its forward on the inputs of the family's reference file.
struct Tiny {
  std::shared_ptr<nn::Module> model;
  std::function<Tensor()> run;
};

// `file`: a single file of the model's weights instead of the tiny folder (its config.json used).
Tiny tiny(LoraFamily family, const std::string& file = "") {
  Tiny t;
  if (family == LoraFamily::kFlux) {
    const fs::path folder = data_dir() / "flux-tiny" / "transformer";
    auto m = file.empty() ? fm::load_flux(folder.string()) : fm::load_flux(file, {.config_json = (folder / "config.json").string()});
    auto in = std::make_shared<flame::StateDict>(flame::io::load_safetensors((data_dir() / "flux-tiny" / "reference.safetensors").string()));
    t.model = m;
    t.run = [m, in] {
      const auto& r = *in;
      return m->forward(r.at("input.hidden_states"), r.at("input.encoder_hidden_states"), r.at("input.pooled_projections"),
                        r.at("input.timestep"), r.at("input.img_ids"), r.at("input.txt_ids"), r.at("input.guidance"));
    };
  } else if (family == LoraFamily::kSD3) {
    const fs::path folder = data_dir() / "sd3-tiny" / "transformer";
    auto m = file.empty() ? fm::load_sd3(folder.string()) : fm::load_sd3(file, {.config_json = (folder / "config.json").string()});
    auto in = std::make_shared<flame::StateDict>(flame::io::load_safetensors((data_dir() / "sd3-tiny" / "reference.safetensors").string()));
    t.model = m;
    t.run = [m, in] {
      const auto& r = *in;
      return m->forward(r.at("input.hidden_states"), r.at("input.encoder_hidden_states"), r.at("input.pooled_projections"),
                        r.at("input.timestep"));
    };
  } else {
    const fs::path folder = data_dir() / "unet2d-tiny-xl" / "unet";
    auto m = file.empty() ? fm::load_unet(folder.string()) : fm::load_unet(file, {.config_json = (folder / "config.json").string()});
    auto in = std::make_shared<flame::StateDict>(
        flame::io::load_safetensors((data_dir() / "unet2d-tiny-xl" / "reference.safetensors").string()));
    t.model = m;
    t.run = [m, in] {
      const auto& r = *in;
      return m->forward(r.at("input.sample"), r.at("input.timestep"), r.at("input.encoder_hidden_states"),
                        {r.at("input.text_embeds"), r.at("input.time_ids")});
    };
  }
  return t;
}

// name -> (rank, scaling) of every adapter.
std::map<std::string, std::pair<int64_t, double>> adapter_shapes(nn::Module& m) {
  std::map<std::string, std::pair<int64_t, double>> out;
  for (auto& [n, mod] : m.named_modules()) {
    auto* l = dynamic_cast<nn::Linear*>(mod.get());
    if (l && l->has_lora()) out[n] = {l->lora_A()->weight().size(0), l->lora_scaling()};
  }
  return out;
}

nn::Linear& linear(nn::Module& m, const std::string& name) {
  for (auto& [n, mod] : m.named_modules()) {
    if (n == name) return dynamic_cast<nn::Linear&>(*mod);
  }
  throw std::runtime_error("no module " + name);
}

void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = fd_test::max_abs_diff(got, want);
  EXPECT_LE(err, tol * std::max(1.0, fd_test::max_abs(want))) << what << ": max abs error " << err;
}

// Adds N(0, std) noise to the adapters' tensors only.
void perturb_adapters(nn::Module& m, double std, uint64_t seed) {
  flame::NoGradGuard no_grad;
  flame::Generator gen(seed);
  for (auto& [n, p] : m.named_parameters()) {
    if (nn::is_lora_key(n)) p.add_(Tensor::randn(p.sizes(), 0.0, std, {}, &gen));
  }
}

const std::vector<LoraFamily> kFamilies = {LoraFamily::kFlux, LoraFamily::kSD3, LoraFamily::kSDXL};
const std::vector<LoraFileFormat> kFormats = {LoraFileFormat::kPeft, LoraFileFormat::kDiffusers, LoraFileFormat::kKohya};

std::string file_of(LoraFamily f, const std::string& layout) {
  return (lora_dir() / (std::string(fm::to_string(f)) + "_" + layout + ".safetensors")).string();
}

}  // namespace

// diffusers' files (and the kohya files of the reference script) give diffusers' outputs.
TEST(LoraFile, MatchesTheDiffusersReference) {
  const char* export_dir = std::getenv("FLAME_LORA_EXPORT_DIR");
  for (LoraFamily f : kFamilies) {
    const std::string fam = fm::to_string(f);
    std::vector<std::pair<std::string, std::string>> cases = {{"diffusers", "output." + fam}};
    if (f == LoraFamily::kFlux) cases.push_back({"kohya_fused", "output.flux_kohya_fused"});
    else cases.push_back({"kohya", "output." + fam});
    for (const auto& [layout, output] : cases) {
      Tiny t = tiny(f);
      const fm::LoraLoadReport rep = fm::load_lora(file_of(f, layout), *t.model, f);
      EXPECT_EQ(fm::to_string(rep.format), layout == "diffusers" ? std::string("diffusers") : std::string("kohya"));
      EXPECT_FALSE(rep.created.empty());
      EXPECT_TRUE(rep.loaded.empty());
      expect_close(t.run(), reference().at(output), 1e-5, fam + " " + layout);
      if (!export_dir) continue;
      const std::string stem = layout == "kohya_fused" ? "flux_from_fused" : fam + "_from_" + layout;
      for (LoraFileFormat fmt : kFormats) {
        fm::save_lora((fs::path(export_dir) / (stem + "_flame_" + fm::to_string(fmt) + ".safetensors")).string(), *t.model,
                      f, fmt);
      }
      const fs::path peft_dir = fs::path(export_dir) / (stem + "_flame_peft_folder");
      fs::create_directories(peft_dir);
      fm::save_lora((peft_dir / "adapter_model.safetensors").string(), *t.model, f, LoraFileFormat::kPeft);
    }
  }
}

// save -> load into a fresh model: the same adapters (modules, ranks, scalings) and outputs, in every
// family and layout.
TEST(LoraFile, RoundTripEveryFamilyAndFormat) {
  const fs::path dir = fd_test::fresh_temp_dir("lora_file", "round_trip");
  for (LoraFamily f : kFamilies) {
    Tiny src = tiny(f);
    fm::load_lora(file_of(f, "diffusers"), *src.model, f);
    const Tensor want = src.run();
    const auto shapes = adapter_shapes(*src.model);
    for (LoraFileFormat fmt : kFormats) {
      const std::string what = std::string(fm::to_string(f)) + " " + fm::to_string(fmt);
      const std::string path = (dir / (what + ".safetensors")).string();
      fm::save_lora(path, *src.model, f, fmt, {{"ss_steps", "20"}});
      const auto meta = flame::io::load_safetensors_metadata(path);
      EXPECT_EQ(meta.at("lora_family"), fm::to_string(f)) << what;
      EXPECT_EQ(meta.at("lora_format"), fm::to_string(fmt)) << what;
      EXPECT_EQ(meta.at("ss_steps"), "20") << what;
      EXPECT_EQ(meta.at("lora_rank"), "4") << what;
      Tiny dst = tiny(f);
      const fm::LoraLoadReport rep = fm::load_lora(path, *dst.model, f);
      EXPECT_EQ(rep.format, fmt) << what;
      EXPECT_EQ(rep.created.size(), shapes.size()) << what;
      const auto got = adapter_shapes(*dst.model);
      ASSERT_EQ(got.size(), shapes.size()) << what;
      for (const auto& [name, rs] : shapes) {
        ASSERT_TRUE(got.count(name)) << what << ": no adapter on " << name;
        EXPECT_EQ(got.at(name).first, rs.first) << what << " rank of " << name;
        EXPECT_NEAR(got.at(name).second, rs.second, 1e-12) << what << " scaling of " << name;
      }
      expect_close(dst.run(), want, 1e-6, what);
      // Loading again into the adapters just made: the values are replaced, nothing is created.
      const fm::LoraLoadReport again = fm::load_lora(path, *dst.model, f);
      EXPECT_TRUE(again.created.empty()) << what;
      EXPECT_EQ(again.loaded.size(), shapes.size()) << what;
      expect_close(dst.run(), want, 1e-6, what + " reloaded");
    }
  }
  fs::remove_all(dir);
}

// The kohya FLUX stems: names, fused layout, alpha.
TEST(LoraFile, KohyaFluxFusesQkvAndLinear1) {
  const fs::path dir = fd_test::fresh_temp_dir("lora_file", "flux_fused");
  Tiny t = tiny(LoraFamily::kFlux);
  fm::load_lora(file_of(LoraFamily::kFlux, "diffusers"), *t.model, LoraFamily::kFlux);
  const std::string path = (dir / "k.safetensors").string();
  fm::save_lora(path, *t.model, LoraFamily::kFlux, LoraFileFormat::kKohya);
  const flame::StateDict sd = flame::io::load_safetensors(path);
  const int64_t d = 16;  // tiny-flux: 2 heads x 8
  // qkv: rank 3 x 4 from to_q, to_k, to_v (alpha 8 each: scaling 2); block-diagonal up.
  const Tensor down = sd.at("lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight");
  const Tensor up = sd.at("lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight");
  EXPECT_EQ(down.sizes(), (flame::Shape{12, d}));
  EXPECT_EQ(up.sizes(), (flame::Shape{3 * d, 12}));
  EXPECT_DOUBLE_EQ(sd.at("lora_unet_double_blocks_0_img_attn_qkv.alpha").item<double>(), 24.0);
  nn::Linear& k = linear(*t.model, "transformer_blocks.0.attn.to_k");
  EXPECT_EQ(fd_test::max_abs_diff(down.narrow(0, 4, 4), k.lora_A()->weight()), 0.0);
  EXPECT_EQ(fd_test::max_abs_diff(up.narrow(0, d, d).narrow(1, 4, 4), k.lora_B()->weight()), 0.0);
  EXPECT_EQ(fd_test::max_abs(up.narrow(0, d, d).narrow(1, 0, 4)), 0.0);
  // linear1: q, k, v, proj_mlp (4d rows) with the MLP's own alpha 8 / rank 4.
  EXPECT_EQ(sd.at("lora_unet_single_blocks_1_linear1.lora_up.weight").sizes(), (flame::Shape{7 * d, 16}));
  // The whole update of every fused layer is the sum of the separate ones.
  for (const auto& [stem, parts] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"lora_unet_double_blocks_1_txt_attn_qkv", {"transformer_blocks.1.attn.add_q_proj", "transformer_blocks.1.attn.add_k_proj", "transformer_blocks.1.attn.add_v_proj"}},
           {"lora_unet_single_blocks_0_linear1", {"single_transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_k", "single_transformer_blocks.0.attn.to_v", "single_transformer_blocks.0.proj_mlp"}}}) {
    const Tensor dn = sd.at(stem + ".lora_down.weight").to(DType::f64), u = sd.at(stem + ".lora_up.weight").to(DType::f64);
    const double alpha = sd.at(stem + ".alpha").item<double>();
    const Tensor fused = u.matmul(dn) * (alpha / static_cast<double>(dn.size(0)));
    int64_t row = 0;
    for (const auto& m : parts) {
      const Tensor delta = linear(*t.model, m).lora_delta_weight().to(DType::f64);
      EXPECT_LE(fd_test::max_abs_diff(fused.narrow(0, row, delta.size(0)), delta), 1e-6) << stem << " " << m;
      row += delta.size(0);
    }
  }
  // Unfused names are kohya's.
  for (const char* k : {"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight", "lora_unet_double_blocks_0_txt_attn_proj.alpha",
                        "lora_unet_double_blocks_1_img_mlp_0.lora_up.weight", "lora_unet_double_blocks_0_img_mod_lin.alpha"}) {
    EXPECT_TRUE(sd.contains(k)) << k;
  }
  const auto meta = flame::io::load_safetensors_metadata(path);
  EXPECT_EQ(meta.at("ss_base_model_version"), "flux1");
  EXPECT_EQ(meta.at("ss_network_module"), "networks.lora");
  fs::remove_all(dir);
}

// A kohya FLUX file trained on the fused layers (dense up, shared down): every part gets the shared
// A and its rows of up, and its update is the fused update's rows, computed here in f64.
TEST(LoraFile, FusedKohyaFluxSharesA) {
  Tiny t = tiny(LoraFamily::kFlux);
  const std::string path = file_of(LoraFamily::kFlux, "kohya_fused");
  const fm::LoraLoadReport rep = fm::load_lora(path, *t.model, LoraFamily::kFlux);
  const flame::StateDict sd = flame::io::load_safetensors(path);
  const std::string stem = "lora_unet_single_blocks_1_linear1";
  const Tensor down = sd.at(stem + ".lora_down.weight").to(DType::f64), up = sd.at(stem + ".lora_up.weight").to(DType::f64);
  const double alpha = sd.at(stem + ".alpha").item<double>();
  ASSERT_EQ(down.size(0), 6);
  const Tensor fused = up.matmul(down) * (alpha / 6.0);
  int64_t row = 0;
  for (const char* m : {"single_transformer_blocks.1.attn.to_q", "single_transformer_blocks.1.attn.to_k",
                        "single_transformer_blocks.1.attn.to_v", "single_transformer_blocks.1.proj_mlp"}) {
    nn::Linear& l = linear(*t.model, m);
    ASSERT_TRUE(l.has_lora()) << m;
    EXPECT_EQ(l.lora_A()->weight().size(0), 6) << m;
    EXPECT_DOUBLE_EQ(l.lora_scaling(), 0.5) << m;
    EXPECT_EQ(fd_test::max_abs_diff(l.lora_A()->weight(), down), 0.0) << m;
    const Tensor delta = l.lora_delta_weight().to(DType::f64);
    EXPECT_LE(fd_test::max_abs_diff(delta, fused.narrow(0, row, delta.size(0))), 1e-6) << m;
    row += delta.size(0);
  }
  // img_attn_proj has no .alpha: alpha = rank, scaling 1.
  EXPECT_DOUBLE_EQ(linear(*t.model, "transformer_blocks.0.attn.to_out.0").lora_scaling(), 1.0);
  // img qkv of 2 double blocks, txt qkv of block 0, linear1 of 2 single blocks (4 parts), img_attn_proj.
  EXPECT_EQ(rep.created.size(), 2u * 3u + 3u + 2u * 4u + 1u);
}

// kohya alpha into a model whose adapters have another alpha: the update is the file's.
TEST(LoraFile, KohyaAlphaBecomesTheModelsScaling) {
  const fs::path dir = fd_test::fresh_temp_dir("lora_file", "alpha");
  flame::Generator gen(7);
  const Tensor down = Tensor::randn({4, 16}, 0.0, 0.5, {}, &gen), up = Tensor::randn({16, 4}, 0.0, 0.5, {}, &gen);
  const std::string stem = "lora_transformer_transformer_blocks_0_attn_to_q";
  const std::string m = "transformer_blocks.0.attn.to_q";
  struct Case {
    std::string name;
    flame::StateDict sd;
    flame::io::Metadata meta;
    double scaling;  // of the file
  };
  const std::vector<Case> cases = {
      {"alpha 2", {{stem + ".lora_down.weight", down}, {stem + ".lora_up.weight", up}, {stem + ".alpha", Tensor::scalar(2.0)}}, {}, 0.5},
      {"1-element alpha", {{stem + ".lora_down.weight", down}, {stem + ".lora_up.weight", up}, {stem + ".alpha", Tensor::full({1}, 2.0)}}, {}, 0.5},
      {"ss_network_alpha", {{stem + ".lora_down.weight", down}, {stem + ".lora_up.weight", up}}, {{"ss_network_alpha", "2"}}, 0.5},
      {"no alpha", {{stem + ".lora_down.weight", down}, {stem + ".lora_up.weight", up}}, {}, 1.0},
  };
  for (const Case& c : cases) {
    const std::string path = (dir / (c.name + ".safetensors")).string();
    flame::io::save_safetensors(path, c.sd, c.meta);
    // Into an existing adapter of alpha 16 (scaling 4).
    Tiny t = tiny(LoraFamily::kSD3);
    linear(*t.model, m).add_lora({.rank = 4, .alpha = 16.0});
    linear(*t.model, "transformer_blocks.0.attn.to_k").add_lora({.rank = 2, .alpha = 2.0});
    const fm::LoraLoadReport rep = fm::load_lora(path, *t.model, LoraFamily::kSD3);
    ASSERT_EQ(rep.loaded, std::vector<std::string>{m}) << c.name;
    EXPECT_EQ(rep.untouched, std::vector<std::string>{"transformer_blocks.0.attn.to_k"}) << c.name;
    nn::Linear& l = linear(*t.model, m);
    EXPECT_DOUBLE_EQ(l.lora_scaling(), 4.0) << c.name;
    const Tensor expect = up.to(DType::f64).matmul(down.to(DType::f64)) * c.scaling;
    EXPECT_LE(fd_test::max_abs_diff(l.lora_delta_weight(), expect), 1e-6) << c.name;
    // Into a fresh model: the adapter takes the file's alpha.
    Tiny fresh = tiny(LoraFamily::kSD3);
    fm::load_lora(path, *fresh.model, LoraFamily::kSD3);
    EXPECT_DOUBLE_EQ(linear(*fresh.model, m).lora_scaling(), c.scaling) << c.name;
    EXPECT_LE(fd_test::max_abs_diff(linear(*fresh.model, m).lora_delta_weight(), expect), 1e-6) << c.name;
  }
  fs::remove_all(dir);
}

// PEFT's own folder: adapter_model.safetensors without metadata, alpha in adapter_config.json.
TEST(LoraFile, PeftFolderTakesAlphaFromAdapterConfig) {
  const fs::path dir = fd_test::fresh_temp_dir("lora_file", "peft_folder");
  Tiny src = tiny(LoraFamily::kSD3);
  dynamic_cast<fm::SD3Transformer2DModel&>(*src.model).add_lora({.rank = 4, .alpha = 6.0});
  perturb_adapters(*src.model, 0.3, 5);
  const Tensor want = src.run();
  const std::string path = (dir / "adapter_model.safetensors").string();
  flame::io::save_safetensors(path, nn::lora_state_dict(*src.model));
  Tiny without = tiny(LoraFamily::kSD3);
  fm::load_lora(path, *without.model, LoraFamily::kSD3);  // no alpha anywhere: alpha = rank
  EXPECT_DOUBLE_EQ(linear(*without.model, "transformer_blocks.1.attn.to_v").lora_scaling(), 1.0);
  EXPECT_GT(fd_test::max_abs_diff(without.run(), want), 1e-3);
  fd_test::write_text(dir / "adapter_config.json", R"({"r": 4, "lora_alpha": 6, "peft_type": "LORA", "use_rslora": false})");
  // FLAME's own PEFT folder writes the same file.
  const fs::path own = dir / "own";
  fs::create_directories(own);
  fm::save_lora((own / "adapter_model.safetensors").string(), *src.model, LoraFamily::kSD3, LoraFileFormat::kPeft);
  const fm::JsonConfig config = fm::JsonConfig::from_file((own / "adapter_config.json").string());
  EXPECT_EQ(config.get_int("r"), 4);
  EXPECT_DOUBLE_EQ(config.get_double("lora_alpha"), 6.0);
  EXPECT_EQ(config.get_string("peft_type"), "LORA");
  Tiny with = tiny(LoraFamily::kSD3);
  const fm::LoraLoadReport rep = fm::load_lora(path, *with.model, LoraFamily::kSD3);
  EXPECT_EQ(rep.format, LoraFileFormat::kPeft);
  EXPECT_DOUBLE_EQ(linear(*with.model, "transformer_blocks.1.attn.to_v").lora_scaling(), 1.5);
  expect_close(with.run(), want, 1e-6, "peft folder");
  fs::remove_all(dir);
}

// DoRA adapters through every layout (kohya: dora_scale), and the fused FLUX layer refusing DoRA.
TEST(LoraFile, DoraRoundTrips) {
  const fs::path dir = fd_test::fresh_temp_dir("lora_file", "dora");
  Tiny src = tiny(LoraFamily::kSDXL);
  auto* unet = dynamic_cast<fm::UNet2DConditionModel*>(src.model.get());
  unet->add_lora({.rank = 2, .alpha = 3.0, .use_dora = true}, {"to_q", "to_v", "proj_in"});
  perturb_adapters(*src.model, 0.2, 11);  // B and the magnitudes away from their initial values
  const Tensor want = src.run();
  for (LoraFileFormat fmt : kFormats) {
    const std::string path = (dir / (std::string(fm::to_string(fmt)) + ".safetensors")).string();
    fm::save_lora(path, *src.model, LoraFamily::kSDXL, fmt);
    if (fmt == LoraFileFormat::kKohya) {
      EXPECT_TRUE(flame::io::load_safetensors(path).contains("lora_unet_input_blocks_3_1_proj_in.dora_scale"));
    }
    Tiny dst = tiny(LoraFamily::kSDXL);
    fm::load_lora(path, *dst.model, LoraFamily::kSDXL);
    EXPECT_TRUE(linear(*dst.model, "mid_block.attentions.0.proj_in").lora_options().use_dora) << fm::to_string(fmt);
    expect_close(dst.run(), want, 1e-6, std::string("dora ") + fm::to_string(fmt));
    fm::load_lora(path, *dst.model, LoraFamily::kSDXL);  // into the DoRA adapters it has now
    expect_close(dst.run(), want, 1e-6, std::string("dora reloaded ") + fm::to_string(fmt));
  }
  Tiny flux = tiny(LoraFamily::kFlux);
  dynamic_cast<fm::FluxTransformer2DModel&>(*flux.model).add_lora({.rank = 2, .alpha = 2.0, .use_dora = true});
  const std::string err = fd_test::error_of([&] {
    fm::save_lora((dir / "f.safetensors").string(), *flux.model, LoraFamily::kFlux, LoraFileFormat::kKohya);
  });
  EXPECT_NE(err.find("DoRA"), std::string::npos) << err;
  EXPECT_NE(err.find("img_attn_qkv"), std::string::npos) << err;
  fs::remove_all(dir);
}

// Errors name the file and the key; text-encoder keys are skipped.
TEST(LoraFile, BadFilesGiveErrorsNamingFileAndKey) {
  const fs::path dir = fd_test::fresh_temp_dir("lora_file", "bad");
  const std::string good = file_of(LoraFamily::kSD3, "kohya");
  // Truncated.
  {
    const std::string p = (dir / "truncated.safetensors").string();
    fs::copy_file(good, p);
    fs::resize_file(p, fs::file_size(p) / 2);
    Tiny t = tiny(LoraFamily::kSD3);
    const std::string err = fd_test::error_of([&] { fm::load_lora(p, *t.model, LoraFamily::kSD3); });
    EXPECT_NE(err.find("truncated.safetensors"), std::string::npos) << err;
    EXPECT_TRUE(adapter_shapes(*t.model).empty());
  }
  // Rank mismatch with existing adapters: names the key and both shapes.
  {
    Tiny t = tiny(LoraFamily::kSD3);
    dynamic_cast<fm::SD3Transformer2DModel&>(*t.model).add_lora({.rank = 3, .alpha = 3.0});
    const std::string err = fd_test::error_of([&] { fm::load_lora(good, *t.model, LoraFamily::kSD3); });
    EXPECT_NE(err.find("rank mismatch"), std::string::npos) << err;
    EXPECT_NE(err.find("sd3_kohya.safetensors"), std::string::npos) << err;
    // add_q_proj has no adapter in the model (SD3's default targets): it gets one; to_k's rank differs.
    EXPECT_NE(err.find("lora_transformer_transformer_blocks_0_attn_to_k.lora_down.weight"), std::string::npos) << err;
    EXPECT_NE(err.find("[4, 16]"), std::string::npos) << err;
    EXPECT_NE(err.find("[3, 16]"), std::string::npos) << err;
  }
  // Another family: said so, in both directions and layouts.
  {
    Tiny flux = tiny(LoraFamily::kFlux);
    std::string err = fd_test::error_of([&] { fm::load_lora(file_of(LoraFamily::kSDXL, "kohya"), *flux.model, LoraFamily::kFlux); });
    EXPECT_NE(err.find("looks like an SDXL LoRA; the model is FLUX"), std::string::npos) << err;
    err = fd_test::error_of([&] { fm::load_lora(file_of(LoraFamily::kSDXL, "diffusers"), *flux.model, LoraFamily::kFlux); });
    EXPECT_NE(err.find("looks like an SDXL LoRA"), std::string::npos) << err;
    Tiny unet = tiny(LoraFamily::kSDXL);
    err = fd_test::error_of([&] { fm::load_lora(file_of(LoraFamily::kFlux, "kohya_fused"), *unet.model, LoraFamily::kSDXL); });
    EXPECT_NE(err.find("looks like a FLUX LoRA; the model is SDXL"), std::string::npos) << err;
    EXPECT_TRUE(adapter_shapes(*flux.model).empty());
    err = fd_test::error_of([&] { fm::load_lora(good, *unet.model, LoraFamily::kSDXL); });
    EXPECT_NE(err.find("looks like a FLUX or SD3 LoRA; the model is SDXL"), std::string::npos) << err;
    // A model of another family than the one named.
    err = fd_test::error_of([&] { fm::load_lora(good, *flux.model, LoraFamily::kSD3); });
    EXPECT_NE(err.find("not an SD3 model"), std::string::npos) << err;
  }
  // Unknown keys: the first ones named; nothing loaded.
  {
    flame::StateDict sd = flame::io::load_safetensors(good);
    sd.insert("lora_transformer_no_such_layer.lora_down.weight", Tensor::ones({4, 16}));
    sd.insert("lora_transformer_no_such_layer.lora_up.weight", Tensor::ones({16, 4}));
    const std::string p = (dir / "unknown.safetensors").string();
    flame::io::save_safetensors(p, sd);
    Tiny t = tiny(LoraFamily::kSD3);
    const std::string err = fd_test::error_of([&] { fm::load_lora(p, *t.model, LoraFamily::kSD3); });
    EXPECT_NE(err.find("unknown.safetensors"), std::string::npos) << err;
    EXPECT_NE(err.find("lora_transformer_no_such_layer.lora_down.weight"), std::string::npos) << err;
    EXPECT_TRUE(adapter_shapes(*t.model).empty());
  }
  // LoHa: refused by name (LoKr files: LoraFile.Lokr*).
  {
    const std::string p = (dir / "loha.safetensors").string();
    flame::io::save_safetensors(p, {{"lora_transformer_transformer_blocks_0_attn_to_q.hada_w1_a", Tensor::ones({16, 4})}});
    Tiny t = tiny(LoraFamily::kSD3);
    const std::string err = fd_test::error_of([&] { fm::load_lora(p, *t.model, LoraFamily::kSD3); });
    EXPECT_NE(err.find("hada_w1_a"), std::string::npos) << err;
    EXPECT_NE(err.find("LoHa"), std::string::npos) << err;
  }
  // A layer's shape: lora_up of the wrong height.
  {
    const std::string p = (dir / "shape.safetensors").string();
    flame::io::save_safetensors(p, {{"lora_transformer_transformer_blocks_0_attn_to_q.lora_down.weight", Tensor::ones({4, 16})},
                                    {"lora_transformer_transformer_blocks_0_attn_to_q.lora_up.weight", Tensor::ones({15, 4})}});
    Tiny t = tiny(LoraFamily::kSD3);
    const std::string err = fd_test::error_of([&] { fm::load_lora(p, *t.model, LoraFamily::kSD3); });
    EXPECT_NE(err.find("[15, 4]"), std::string::npos) << err;
    EXPECT_NE(err.find("lora_transformer_transformer_blocks_0_attn_to_q"), std::string::npos) << err;
  }
  // Text-encoder keys are skipped and listed, the rest loads.
  {
    flame::StateDict sd = flame::io::load_safetensors(good);
    sd.insert("lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight", Tensor::ones({4, 8}));
    sd.insert("lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight", Tensor::ones({8, 4}));
    const std::string p = (dir / "te.safetensors").string();
    flame::io::save_safetensors(p, sd);
    Tiny t = tiny(LoraFamily::kSD3);
    const fm::LoraLoadReport rep = fm::load_lora(p, *t.model, LoraFamily::kSD3);
    EXPECT_EQ(rep.skipped.size(), 2u);
    expect_close(t.run(), reference().at("output.sd3"), 1e-5, "with text-encoder keys");
  }
  // Not a LoRA file at all.
  {
    Tiny t = tiny(LoraFamily::kSDXL);
    const std::string p = (data_dir() / "unet2d-tiny-xl" / "unet" / "diffusion_pytorch_model.safetensors").string();
    const std::string err = fd_test::error_of([&] { fm::load_lora(p, *t.model, LoraFamily::kSDXL); });
    EXPECT_NE(err.find("is not a LoRA file"), std::string::npos) << err;
  }
  fs::remove_all(dir);
}

// A base checkpoint with the LoRA merged in loads as a plain model giving the adapted output; the
// adapted model is unmerged afterwards.
TEST(LoraFile, MergedCheckpointIsTheBaseWithTheLora) {
  const fs::path dir = fd_test::fresh_temp_dir("lora_file", "merged");
  for (LoraFamily f : kFamilies) {
    const std::string fam = fm::to_string(f);
    Tiny src = tiny(f);
    fm::load_lora(file_of(f, "diffusers"), *src.model, f);
    if (f == LoraFamily::kSDXL) {  // and a DoRA adapter on a layer without one
      linear(*src.model, "down_blocks.1.attentions.0.proj_out").add_lora({.rank = 2, .alpha = 2.0, .use_dora = true});
      perturb_adapters(*src.model, 0.1, 3);
    }
    const Tensor want = src.run();
    const std::string path = (dir / (fam + ".safetensors")).string();
    fm::save_merged_checkpoint(path, *src.model, std::nullopt, {{"base_model", "tiny"}});
    const std::string q = f == LoraFamily::kSDXL ? "mid_block.attentions.0.transformer_blocks.0.attn1.to_q" : "transformer_blocks.0.attn.to_q";
    EXPECT_TRUE(linear(*src.model, q).has_lora() && !linear(*src.model, q).merged()) << fam;
    // Merge and unmerge round W + delta - delta in f32 (as PEFT's): ulps of the weights, which the
    // deep SDXL UNet with these large updates turns into a few 1e-6 of its output.
    expect_close(src.run(), want, 1e-5, fam + " after the merged save");
    const flame::io::SafetensorsFile file(path);
    EXPECT_EQ(file.metadata().at("base_model"), "tiny");
    for (const auto& k : file.names()) EXPECT_FALSE(nn::is_lora_key(k)) << fam << " " << k;
    Tiny merged = tiny(f, path);
    EXPECT_TRUE(adapter_shapes(*merged.model).empty());
    expect_close(merged.run(), want, 1e-5, fam + " merged checkpoint");
  }
  // bf16 weights on request.
  Tiny src = tiny(LoraFamily::kSD3);
  fm::load_lora(file_of(LoraFamily::kSD3, "kohya"), *src.model, LoraFamily::kSD3);
  const std::string path = (dir / "bf16.safetensors").string();
  fm::save_merged_checkpoint(path, *src.model, DType::bf16);
  EXPECT_EQ(flame::io::SafetensorsFile(path).info("transformer_blocks.0.attn.to_q.weight").dtype, "BF16");
  Tiny none = tiny(LoraFamily::kSD3);
  const std::string err = fd_test::error_of([&] { fm::save_merged_checkpoint(path, *none.model); });
  EXPECT_NE(err.find("no unmerged LoRA adapter"), std::string::npos) << err;
  fs::remove_all(dir);
}

// The original SGM names of every UNet key map back through the loader's plan to the same key.
TEST(LoraFile, UNetOriginalNamesInvertTheLoadersPlan) {
  Tiny t = tiny(LoraFamily::kSDXL);
  const auto& config = dynamic_cast<fm::UNet2DConditionModel&>(*t.model).config();
  std::vector<std::pair<std::string, flame::Shape>> stored;
  std::map<std::string, std::string> back;
  for (const auto& [k, v] : t.model->state_dict()) {
    const auto original = fm::unet_original_name(config, k);
    ASSERT_TRUE(original.has_value()) << k;
    stored.emplace_back(std::string(fm::kUNetOriginalPrefix) + *original, v.sizes());
    back[stored.back().first] = k;
  }
  const fm::KeyPlan plan = fm::unet_original_plan(config, stored);
  ASSERT_EQ(plan.entries.size(), stored.size());
  for (const auto& e : plan.entries) EXPECT_EQ(e.target, back.at(e.sources.at(0)));
  // SDXL's layout (kohya's names for it).
  const auto sdxl = fm::unet2d_preset("sdxl");
  EXPECT_EQ(fm::unet_original_name(sdxl, "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"),
            "input_blocks.4.1.transformer_blocks.0.attn1.to_q");
  EXPECT_EQ(fm::unet_original_name(sdxl, "up_blocks.0.attentions.2.proj_out"), "output_blocks.2.1.proj_out");
  EXPECT_EQ(fm::unet_original_name(sdxl, "mid_block.attentions.0.transformer_blocks.9.ff.net.2"),
            "middle_block.1.transformer_blocks.9.ff.net.2");
  EXPECT_EQ(fm::unet_original_name(sdxl, "up_blocks.1.resnets.2.time_emb_proj"), "output_blocks.5.0.emb_layers.1");
  EXPECT_EQ(fm::unet_original_name(sdxl, "down_blocks.2.downsamplers.0.conv"), std::nullopt);  // SDXL's last block has none
  EXPECT_EQ(fm::unet_original_name(sdxl, "down_blocks.1.downsamplers.0.conv"), "input_blocks.6.0.op");
  EXPECT_EQ(fm::unet_original_name(sdxl, "no_such.layer"), std::nullopt);
}

// ---- LoKr (Note [LoKr files]) ----
namespace {

// name -> layout of every LoKr adapter.
std::map<std::string, nn::LokrLayout> lokr_layouts(nn::Module& m) {
  std::map<std::string, nn::LokrLayout> out;
  for (auto& [n, mod] : m.named_modules()) {
    auto* l = dynamic_cast<nn::Linear*>(mod.get());
    if (l && l->has_lokr()) out[n] = l->lokr_layout();
  }
  return out;
}

std::vector<std::string> lokr_targets(LoraFamily f) {
  switch (f) {
    case LoraFamily::kFlux:  // fused (to_q, to_k, add_v_proj, proj_mlp), reordered (norm_out) and whole layers
      return {"to_q", "to_k", "add_v_proj", "to_out.0", "proj_mlp", "ff.net.0.proj", "norm1.linear", "norm_out.linear"};
    case LoraFamily::kSD3: return {"to_q", "add_k_proj", "to_out.0", "ff.net.2"};
    case LoraFamily::kSDXL: return {"to_q", "to_v", "to_out.0", "ff.net.2"};
  }
  return {};
}

// scale * kron(w1, w2) by loops in f64 ([a c, b d]).
Tensor kron_f64(const Tensor& w1, const Tensor& w2, double scale) {
  const int64_t a = w1.size(0), b = w1.size(1), c = w2.size(0), d = w2.size(1);
  const std::vector<double> x = w1.to(DType::f64).contiguous().to_vec<double>(), y = w2.to(DType::f64).contiguous().to_vec<double>();
  std::vector<double> out(a * c * b * d);
  for (int64_t i = 0; i < a; ++i)
    for (int64_t k = 0; k < c; ++k)
      for (int64_t j = 0; j < b; ++j)
        for (int64_t l = 0; l < d; ++l) out[(i * c + k) * (b * d) + j * d + l] = scale * x[i * b + j] * y[k * d + l];
  return Tensor::from_vec(out, {a * c, b * d});
}

void add_to_weight(nn::Module& m, const std::string& name, const Tensor& delta, int64_t row = 0) {
  flame::NoGradGuard no_grad;
  Tensor w = linear(m, name).weight();
  Tensor rows = w.narrow(0, row, delta.size(0));
  rows.add_(delta.to(w.dtype()));
}

}  // namespace

// apply_lokr -> kohya file -> a fresh model: the same adapters (layouts, scales) and outputs, in every
// family, with decomposed and whole factors; fused FLUX modules go under lora_transformer_ stems.
TEST(LoraFile, LokrRoundTripsThroughKohyaKeys) {
  const fs::path dir = fd_test::fresh_temp_dir("lora_file", "lokr_round_trip");
  const std::vector<nn::LokrOptions> options = {{.rank = 1, .alpha = 3, .decompose_both = true},
                                                {.factor = 2, .rank = 4, .alpha = 2}};
  uint64_t seed = 70;
  for (LoraFamily f : kFamilies) {
    for (std::size_t oi = 0; oi < options.size(); ++oi) {
      const std::string what = std::string(fm::to_string(f)) + " options " + std::to_string(oi);
      Tiny src = tiny(f);
      const Tensor plain = src.run();
      const auto adapted = nn::apply_lokr(*src.model, options[oi], lokr_targets(f));
      perturb_adapters(*src.model, 0.3, ++seed);  // w2 / w2_b start at zero
      const Tensor want = src.run();
      EXPECT_GT(fd_test::max_abs_diff(want, plain), 1e-3) << what << ": the adapters change nothing";
      const auto layouts = lokr_layouts(*src.model);
      ASSERT_EQ(layouts.size(), adapted.size()) << what;
      const std::string path = (dir / (what + ".safetensors")).string();
      fm::save_lora(path, *src.model, f, LoraFileFormat::kKohya, {{"ss_steps", "5"}});
      const flame::StateDict sd = flame::io::load_safetensors(path);
      const auto meta = flame::io::load_safetensors_metadata(path);
      EXPECT_EQ(meta.at("ss_network_module"), "lycoris.kohya") << what;
      EXPECT_EQ(meta.at("ss_steps"), "5") << what;
      for (const auto& k : sd.keys()) {
        EXPECT_TRUE(k.starts_with(f == LoraFamily::kSDXL ? "lora_unet_" : f == LoraFamily::kSD3 ? "lora_transformer_" : "lora_"))
            << what << " " << k;
        EXPECT_EQ(k.find("lora_down"), std::string::npos) << k;
      }
      if (f == LoraFamily::kFlux && oi == 0) {
        // 16 x 16 -> w1 [4, 4] = w1_a [4, 1] @ w1_b [1, 4], w2 = w2_a [4, 1] @ w2_b [1, 4]; alpha = 3 * 1.
        EXPECT_EQ(sd.at("lora_unet_double_blocks_0_img_attn_proj.lokr_w1_a").sizes(), (flame::Shape{4, 1}));
        EXPECT_EQ(sd.at("lora_unet_double_blocks_1_img_attn_proj.lokr_w2_b").sizes(), (flame::Shape{1, 4}));
        EXPECT_DOUBLE_EQ(sd.at("lora_unet_double_blocks_0_img_mod_lin.alpha").item<double>(), 3.0);
        EXPECT_TRUE(sd.contains("lora_transformer_transformer_blocks_0_attn_to_q.lokr_w1_a"));
        EXPECT_TRUE(sd.contains("lora_transformer_transformer_blocks_1_attn_add_v_proj.lokr_w2_a"));
        EXPECT_TRUE(sd.contains("lora_transformer_single_transformer_blocks_0_proj_mlp.lokr_w1_b"));
        EXPECT_TRUE(sd.contains("lora_transformer_norm_out_linear.lokr_w2_b"));
        for (const auto& k : sd.keys()) EXPECT_EQ(k.find("qkv"), std::string::npos) << k;
        const nn::Linear& proj = linear(*src.model, "transformer_blocks.0.attn.to_out.0");
        EXPECT_EQ(fd_test::max_abs_diff(sd.at("lora_unet_double_blocks_0_img_attn_proj.lokr_w2_a"), proj.lokr_factors().w2_a), 0.0);
      }
      if (f == LoraFamily::kSDXL) {
        const std::vector<std::string> keys = sd.keys();
        EXPECT_TRUE(std::any_of(keys.begin(), keys.end(), [](const std::string& k) {
          return k.starts_with("lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q.lokr_w1");
        }));
      }
      Tiny dst = tiny(f);
      const fm::LoraLoadReport rep = fm::load_lora(path, *dst.model, f);
      EXPECT_EQ(rep.format, LoraFileFormat::kKohya) << what;
      EXPECT_EQ(rep.created.size(), layouts.size()) << what;
      const auto got = lokr_layouts(*dst.model);
      ASSERT_EQ(got.size(), layouts.size()) << what;
      for (const auto& [name, l] : layouts) {
        ASSERT_TRUE(got.count(name)) << what << ": no LoKr adapter on " << name;
        const nn::LokrLayout& g = got.at(name);
        EXPECT_EQ((std::vector<int64_t>{g.a, g.b, g.c, g.d}), (std::vector<int64_t>{l.a, l.b, l.c, l.d})) << what << " " << name;
        EXPECT_EQ(g.decompose_w1, l.decompose_w1) << what << " " << name;
        EXPECT_EQ(g.decompose_w2, l.decompose_w2) << what << " " << name;
        if (l.decompose_w1 || l.decompose_w2) EXPECT_EQ(g.rank, l.rank) << what << " " << name;
        EXPECT_NEAR(g.scale, l.scale, 1e-12) << what << " scale of " << name;
      }
      for (auto& [n, p] : dst.model->named_parameters()) EXPECT_EQ(p.requires_grad(), nn::is_lora_key(n)) << what << " " << n;
      expect_close(dst.run(), want, 1e-6, what);
      // Into the adapters just made: replaced in place.
      const fm::LoraLoadReport again = fm::load_lora(path, *dst.model, f);
      EXPECT_TRUE(again.created.empty()) << what;
      EXPECT_EQ(again.loaded.size(), layouts.size()) << what;
      expect_close(dst.run(), want, 1e-6, what + " reloaded");
    }
  }
  fs::remove_all(dir);
}

// A LoKr of BFL's fused qkv (and the reordered final adaLN) splits into the modules exactly: the
// output equals a plain model whose q, k, v weights got the rows of scale * kron(w1, w2), by loops.
TEST(LoraFile, LokrOfAFusedFluxLayerSplitsExactly) {
  const fs::path dir = fd_test::fresh_temp_dir("lora_file", "lokr_fused");
  flame::Generator g(80);
  auto rnd = [&](flame::Shape s) { return Tensor::randn(s, 0.0, 0.3, {}, &g); };
  // qkv [48, 16] = kron([6, 4], [8, 4]): every 16-row module is 2 rows of w1. alpha 2, rank 1: scale 2.
  const Tensor w1 = rnd({6, 4}), w2_a = rnd({8, 1}), w2_b = rnd({1, 4});
  // final_layer_adaLN_modulation_1 [32, 16] = kron([4, 4], [8, 4]), both whole: scale 1 whatever alpha.
  const Tensor n1 = rnd({4, 4}), n2 = rnd({8, 4});
  const std::string qkv = "lora_unet_double_blocks_0_img_attn_qkv", ada = "lora_unet_final_layer_adaLN_modulation_1";
  const std::string path = (dir / "fused.safetensors").string();
  flame::io::save_safetensors(path, {{qkv + ".lokr_w1", w1}, {qkv + ".lokr_w2_a", w2_a}, {qkv + ".lokr_w2_b", w2_b},
                                     {qkv + ".alpha", Tensor::scalar(2.0, {DType::f32})}, {ada + ".lokr_w1", n1},
                                     {ada + ".lokr_w2", n2}, {ada + ".alpha", Tensor::scalar(5.0, {DType::f32})}});
  Tiny ref = tiny(LoraFamily::kFlux);
  const Tensor dq = kron_f64(w1, w2_a.matmul(w2_b), 2.0), dn = kron_f64(n1, n2, 1.0);
  const char* parts[] = {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v"};
  for (int p = 0; p < 3; ++p) add_to_weight(*ref.model, parts[p], dq.narrow(0, 16 * p, 16));
  // BFL's (shift, scale) rows are diffusers' (scale, shift).
  add_to_weight(*ref.model, "norm_out.linear", dn.narrow(0, 16, 16), 0);
  add_to_weight(*ref.model, "norm_out.linear", dn.narrow(0, 0, 16), 16);
  Tiny t = tiny(LoraFamily::kFlux);
  const fm::LoraLoadReport rep = fm::load_lora(path, *t.model, LoraFamily::kFlux);
  EXPECT_EQ(rep.created.size(), 4u);
  for (int p = 0; p < 3; ++p) {
    const nn::Linear& l = linear(*t.model, parts[p]);
    ASSERT_TRUE(l.has_lokr()) << parts[p];
    EXPECT_EQ(l.lokr_layout().a, 2);
    EXPECT_EQ(l.lokr_layout().c, 8);
    EXPECT_DOUBLE_EQ(l.lokr_layout().scale, 2.0);
    EXPECT_EQ(fd_test::max_abs_diff(l.lokr_factors().w1, w1.narrow(0, 2 * p, 2)), 0.0) << parts[p];
  }
  EXPECT_DOUBLE_EQ(linear(*t.model, "norm_out.linear").lokr_layout().scale, 1.0);
  expect_close(t.run(), ref.run(), 1e-5, "fused LoKr");
  // linear1 [112, 16] = kron([8, 4], [14, 4]): q's 16 rows are not whole blocks of 14: refused, nothing changed.
  const std::string l1 = "lora_unet_single_blocks_0_linear1", bad = (dir / "linear1.safetensors").string();
  flame::io::save_safetensors(bad, {{l1 + ".lokr_w1", rnd({8, 4})}, {l1 + ".lokr_w2", rnd({14, 4})}});
  Tiny u = tiny(LoraFamily::kFlux);
  const std::string err = fd_test::error_of([&] { fm::load_lora(bad, *u.model, LoraFamily::kFlux); });
  for (const char* part : {"linear1.safetensors", l1.c_str(), "not whole blocks of w2's 14 rows", "single_transformer_blocks.0.attn.to_q"}) {
    EXPECT_NE(err.find(part), std::string::npos) << part << " not in: " << err;
  }
  EXPECT_TRUE(lokr_layouts(*u.model).empty());
  fs::remove_all(dir);
}

// ComfyUI's scale: alpha / r, 1 without .alpha or with whole factors; a model's existing LoKr keeps
// its scale and takes the file's update.
TEST(LoraFile, LokrScaleFollowsComfyAndExistingAdapters) {
  const fs::path dir = fd_test::fresh_temp_dir("lora_file", "lokr_scale");
  flame::Generator g(90);
  auto rnd = [&](flame::Shape s) { return Tensor::randn(s, 0.0, 0.5, {}, &g); };
  const std::string q = "transformer_blocks.0.attn.to_q", stem = "lora_transformer_transformer_blocks_0_attn_to_q";
  const Tensor w1 = rnd({4, 4}), w2 = rnd({4, 4}), w2_a = rnd({4, 1}), w2_b = rnd({1, 4});
  struct Case {
    std::string name;
    flame::StateDict sd;
    double scale;
  };
  std::vector<Case> cases;
  cases.push_back({"whole", {}, 1.0});
  cases.back().sd.insert(stem + ".lokr_w1", w1);
  cases.back().sd.insert(stem + ".lokr_w2", w2);
  cases.back().sd.insert(stem + ".alpha", Tensor::scalar(7.0, {DType::f32}));
  cases.push_back({"no_alpha", {}, 1.0});
  cases.back().sd.insert(stem + ".lokr_w1", w1);
  cases.back().sd.insert(stem + ".lokr_w2_a", w2_a);
  cases.back().sd.insert(stem + ".lokr_w2_b", w2_b);
  cases.push_back({"alpha", cases.back().sd, 3.0});
  cases.back().sd.insert(stem + ".alpha", Tensor::scalar(3.0, {DType::f32}));
  for (const Case& c : cases) {
    const std::string path = (dir / (c.name + ".safetensors")).string();
    flame::io::save_safetensors(path, c.sd);
    Tiny t = tiny(LoraFamily::kSD3);
    fm::load_lora(path, *t.model, LoraFamily::kSD3);
    const nn::Linear& l = linear(*t.model, q);
    ASSERT_TRUE(l.has_lokr()) << c.name;
    EXPECT_DOUBLE_EQ(l.lokr_layout().scale, c.scale) << c.name;
    const Tensor want = kron_f64(w1, c.sd.contains(stem + ".lokr_w2") ? w2 : w2_a.matmul(w2_b), c.scale);
    EXPECT_LE(fd_test::max_abs_diff(l.lokr_delta_weight(), want), 1e-6) << c.name;
    if (c.name != "alpha") continue;
    // An existing adapter of alpha 5: its scale stays, the update is the file's.
    Tiny e = tiny(LoraFamily::kSD3);
    nn::apply_lokr(*e.model, {.rank = 1, .alpha = 5}, {"to_q"});
    const fm::LoraLoadReport rep = fm::load_lora(path, *e.model, LoraFamily::kSD3);
    EXPECT_EQ(rep.loaded, (std::vector<std::string>{q}));
    EXPECT_EQ(rep.untouched, (std::vector<std::string>{"transformer_blocks.1.attn.to_q"}));
    EXPECT_DOUBLE_EQ(linear(*e.model, q).lokr_layout().scale, 5.0);
    EXPECT_LE(fd_test::max_abs_diff(linear(*e.model, q).lokr_delta_weight(), want), 1e-6);
  }
  fs::remove_all(dir);
}

TEST(LoraFile, LokrBadFilesAndModels) {
  const fs::path dir = fd_test::fresh_temp_dir("lora_file", "lokr_bad");
  const std::string stem = "lora_transformer_transformer_blocks_0_attn_to_q";
  auto write = [&](const std::string& name, const std::vector<std::pair<std::string, Tensor>>& tensors) {
    flame::StateDict sd;
    for (const auto& [k, v] : tensors) sd.insert(k, v);
    const std::string p = (dir / name).string();
    flame::io::save_safetensors(p, sd);
    return p;
  };
  // Each file into a fresh SD3 model: the error names the file and what is wrong; nothing is adapted.
  const std::vector<std::pair<std::string, std::vector<std::string>>> files = {
      {write("no_w2.safetensors", {{stem + ".lokr_w1", Tensor::ones({4, 4})}}), {stem, "lokr_w2 [c, d]"}},
      {write("shape.safetensors", {{stem + ".lokr_w1", Tensor::ones({4, 4})}, {stem + ".lokr_w2", Tensor::ones({4, 3})}}),
       {stem, "[16, 12]", "[16, 16]"}},
      {write("ranks.safetensors", {{stem + ".lokr_w1_a", Tensor::ones({4, 2})}, {stem + ".lokr_w1_b", Tensor::ones({2, 4})},
                                   {stem + ".lokr_w2_a", Tensor::ones({4, 1})}, {stem + ".lokr_w2_b", Tensor::ones({1, 4})}}),
       {stem, "one rank"}},
      {write("orphan.safetensors", {{stem + ".lokr_w2", Tensor::ones({4, 4})}}), {stem + ".lokr_w2", "without"}},
      {write("tucker.safetensors", {{stem + ".lokr_w1", Tensor::ones({4, 4})}, {stem + ".lokr_t2", Tensor::ones({1, 1, 3, 3})}}),
       {"lokr_t2", "Tucker"}},
      {write("dora.safetensors", {{stem + ".lokr_w1", Tensor::ones({4, 4})}, {stem + ".lokr_w2", Tensor::ones({4, 4})},
                                  {stem + ".dora_scale", Tensor::ones({16})}}),
       {stem, "dora_scale"}},
      {write("peft.safetensors", {{"base_model.model.transformer_blocks.0.attn.to_q.lokr_w1", Tensor::ones({4, 4})}}),
       {"peft", "kohya-style", "to_q.lokr_w1"}},
      {write("flux.safetensors", {{"lora_unet_double_blocks_0_img_attn_proj.lokr_w1", Tensor::ones({4, 4})},
                                  {"lora_unet_double_blocks_0_img_attn_proj.lokr_w2", Tensor::ones({4, 4})}}),
       {"looks like a FLUX LoRA"}},
  };
  for (const auto& [path, parts] : files) {
    Tiny t = tiny(LoraFamily::kSD3);
    const std::string err = fd_test::error_of([&] { fm::load_lora(path, *t.model, LoraFamily::kSD3); });
    EXPECT_NE(err.find(fs::path(path).filename().string()), std::string::npos) << err;
    for (const auto& p : parts) EXPECT_NE(err.find(p), std::string::npos) << p << " not in: " << err;
    EXPECT_TRUE(lokr_layouts(*t.model).empty()) << path;
  }
  // Against the model's adapters: another LoKr layout, LoRA vs LoKr both ways.
  const std::string good = write("good.safetensors", {{stem + ".lokr_w1", Tensor::ones({4, 4})}, {stem + ".lokr_w2", Tensor::ones({4, 4})}});
  {
    Tiny t = tiny(LoraFamily::kSD3);
    nn::apply_lokr(*t.model, {.rank = 1}, {"to_q"});
    const Tensor before = linear(*t.model, "transformer_blocks.0.attn.to_q").lokr_factors().w1.clone();
    std::string err = fd_test::error_of([&] { fm::load_lora(good, *t.model, LoraFamily::kSD3); });
    EXPECT_NE(err.find("LoKr layout mismatch"), std::string::npos) << err;
    EXPECT_NE(err.find("w2 [4, 4] (w2_a @ w2_b), rank 1"), std::string::npos) << err;
    EXPECT_EQ(fd_test::max_abs_diff(linear(*t.model, "transformer_blocks.0.attn.to_q").lokr_factors().w1, before), 0.0);
    err = fd_test::error_of([&] { fm::load_lora(file_of(LoraFamily::kSD3, "kohya"), *t.model, LoraFamily::kSD3); });
    EXPECT_NE(err.find("is a LoRA adapter; the model's adapter on transformer_blocks."), std::string::npos) << err;
    EXPECT_NE(err.find("is LoKr"), std::string::npos) << err;
  }
  {
    Tiny t = tiny(LoraFamily::kSD3);
    nn::apply_lora(*t.model, {.rank = 2}, {"to_q"});
    const std::string err = fd_test::error_of([&] { fm::load_lora(good, *t.model, LoraFamily::kSD3); });
    EXPECT_NE(err.find("is a LoKr adapter; the model's adapter on transformer_blocks.0.attn.to_q is LoRA"), std::string::npos) << err;
  }
  // Writing: LoKr adapters only in the kohya layout.
  {
    Tiny t = tiny(LoraFamily::kSD3);
    nn::apply_lokr(*t.model, {.rank = 1}, {"to_q"});
    for (LoraFileFormat fmt : {LoraFileFormat::kPeft, LoraFileFormat::kDiffusers}) {
      const std::string err = fd_test::error_of([&] { fm::save_lora((dir / "w.safetensors").string(), *t.model, LoraFamily::kSD3, fmt); });
      for (const char* p : {"save_lora", "LoKr adapter of transformer_blocks.0.attn.to_q", "kohya layout only", "w.safetensors"}) {
        EXPECT_NE(err.find(p), std::string::npos) << p << " not in: " << err;
      }
    }
    EXPECT_FALSE(fs::exists(dir / "w.safetensors"));
  }
  fs::remove_all(dir);
}

// A base checkpoint with LoKr adapters merged in is the adapted model.
TEST(LoraFile, LokrMergedCheckpoint) {
  const fs::path dir = fd_test::fresh_temp_dir("lora_file", "lokr_merged");
  Tiny src = tiny(LoraFamily::kSD3);
  nn::apply_lokr(*src.model, {.rank = 1, .alpha = 2}, lokr_targets(LoraFamily::kSD3));
  perturb_adapters(*src.model, 0.3, 95);
  const Tensor want = src.run();
  const std::string path = (dir / "merged.safetensors").string();
  fm::save_merged_checkpoint(path, *src.model);
  const flame::io::SafetensorsFile file(path);
  for (const auto& k : file.names()) EXPECT_FALSE(nn::is_lora_key(k)) << k;
  EXPECT_FALSE(linear(*src.model, "transformer_blocks.0.attn.to_q").merged());
  Tiny merged = tiny(LoraFamily::kSD3, path);
  EXPECT_TRUE(lokr_layouts(*merged.model).empty());
  expect_close(merged.run(), want, 1e-5, "LoKr merged checkpoint");
  fs::remove_all(dir);
}
