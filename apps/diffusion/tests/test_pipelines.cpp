// models/pipelines.h against diffusers 0.42 (issue #31, item 5): the tiny FLUX, SD3.5 and SDXL
// pipeline folders of apps/diffusion/reference/pipelines.py (random components in the families'
// layouts, bf16 weights run in f32 on the CPU) with the same prompts, initial latents, steps and
// guidance give diffusers' output images (FLUX: guidance embedding, and true CFG with a negative
// prompt; SD3.5: CFG with a negative prompt; SDXL: Euler with a negative prompt, DPM++ 2M Karras
// with zeroed negative embeddings).
// Suite Pipelines.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <flame/flame.h>
#include <flame/io/safetensors.h>

#include "model_test_util.h"
#include "models/pipelines.h"

namespace {

namespace fm = flame_diffusion::models;
using flame::Tensor;

std::filesystem::path data_dir() {
  return std::filesystem::path(__FILE__).parent_path() / "data" / "models" / "pipelines-tiny";
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string item;
  std::istringstream in(s);
  while (std::getline(in, item, sep)) out.push_back(item);
  return out;
}

struct Reference {
  flame::StateDict t;
  std::map<std::string, std::string> meta;
};

const Reference& reference() {
  static const Reference r = [] {
    const std::string path = (data_dir() / "reference.safetensors").string();
    return Reference{flame::io::load_safetensors(path), flame::io::load_safetensors_metadata(path)};
  }();
  return r;
}

std::shared_ptr<fm::Pipeline> load(const std::string& family, const std::string& lora = "") {
  static std::map<std::string, std::shared_ptr<fm::Pipeline>> cache;
  auto& p = cache[family + "+" + lora];
  if (!p) {
    fm::PipelineLoadOptions o{.path = (data_dir() / family).string(), .device = fd_test::test_device()};
    if (!lora.empty()) o.lora = (data_dir() / "lora" / lora).string();
    p = fm::load_pipeline(o);
  }
  return p;
}

// Runs one reference case ("<case>:<family>:<sampler>:<steps>:<guidance>:<negative>:<lora>:<true_cfg>")
// through FLAME; without_lora: the same run with no LoRA.
Tensor run_case(const std::string& spec, std::string* name, bool without_lora = false) {
  const std::vector<std::string> f = split(spec, ':');
  EXPECT_EQ(f.size(), 8u) << spec;
  const Reference& r = reference();
  *name = f[0];
  const std::string family = f[1];
  const std::string lora = f[6];
  std::shared_ptr<fm::Pipeline> pipe = load(family, lora == "-" || without_lora ? "" : lora);
  EXPECT_EQ(pipe->family, family);
  fm::GenerateOptions o;
  o.prompts = split(r.meta.at("prompts"), '|');
  o.height = std::stoll(r.meta.at("height"));
  o.width = std::stoll(r.meta.at("width"));
  o.max_sequence_length = std::stoll(r.meta.at("max_sequence_length"));
  o.sampler = f[2] == "flow-euler" ? "euler" : f[2];
  o.steps = std::stoll(f[3]);
  o.guidance = std::stod(f[4]);
  if (f[5] != "-") o.negative_prompt = f[5];
  o.true_cfg_scale = std::stod(f[7]);
  Tensor latents = r.t.at(f[0] + ".latents");
  if (family == "flux") latents = fm::unpack_latents(latents, o.height / 2, o.width / 2);
  o.latents = latents;
  return fm::generate(*pipe, o);
}

// Every case's image within 2e-5 (absolute, on [0, 1]) of diffusers'.
TEST(Pipelines, TinyFluxSD35AndSdxlMatchDiffusers) {
  FD_SKIP_IF_NO_DEVICE();
  const fd_test::ConvTf32Off full_f32;  // SDXL's VAE and UNet convolutions on CUDA
  const Reference& r = reference();
  const std::vector<std::string> cases = split(r.meta.at("cases"), '|');
  ASSERT_EQ(cases.size(), 7u);
  for (const std::string& spec : cases) {
    if (split(spec, ':').at(6) != "-") continue;  // the LoRA cases: their own test
    std::string name;
    const Tensor image = run_case(spec, &name);
    const Tensor want = r.t.at(name + ".image");
    ASSERT_EQ(image.sizes(), want.sizes()) << name;
    const double err = fd_test::max_abs_diff(image, want);
    std::printf("  %-16s image %s: max |FLAME - diffusers| %.2e\n", name.c_str(),
                flame::shape_str(image.sizes()).c_str(), err);
    EXPECT_LE(err, 2e-5) << name;
    EXPECT_GT(fd_test::max_abs(image - image.mean()), 0.05) << name << ": a flat image";
  }
}

// diffusers' save_lora_weights files (diffusers layout) loaded into FLUX's transformer and SDXL's
// UNet give diffusers' images after load_lora_weights, within 2e-5; without the LoRA they differ.
TEST(Pipelines, DiffusersLoraFilesGiveDiffusersImages) {
  FD_SKIP_IF_NO_DEVICE();
  const fd_test::ConvTf32Off full_f32;
  const Reference& r = reference();
  int n = 0;
  for (const std::string& spec : split(r.meta.at("cases"), '|')) {
    if (split(spec, ':').at(6) == "-") continue;
    ++n;
    std::string name;
    const Tensor image = run_case(spec, &name);
    const Tensor want = r.t.at(name + ".image");
    const double err = fd_test::max_abs_diff(image, want);
    std::printf("  %-16s max |FLAME - diffusers| %.2e\n", name.c_str(), err);
    EXPECT_LE(err, 2e-5) << name;
    EXPECT_GT(fd_test::max_abs_diff(run_case(spec, &name, true), want), 1e-3) << name << ": the LoRA changed nothing";
  }
  EXPECT_EQ(n, 2);
}

// FLUX's true CFG (diffusers' true_cfg_scale with a negative prompt; its image is checked against
// diffusers' above) moves the image away from the plain run on the same latents.
TEST(Pipelines, FluxTrueCfgChangesTheImage) {
  FD_SKIP_IF_NO_DEVICE();
  std::string spec;
  for (const std::string& c : split(reference().meta.at("cases"), '|')) {
    if (c.rfind("flux_true_cfg:", 0) == 0) spec = c;
  }
  ASSERT_FALSE(spec.empty()) << "no flux_true_cfg case in the reference";
  std::vector<std::string> f = split(spec, ':');
  ASSERT_EQ(f.size(), 8u);
  ASSERT_NE(f[5], "-");
  ASSERT_GT(std::stod(f[7]), 1.0);
  std::string name;
  const Tensor guided = run_case(spec, &name);
  f[5] = "-";
  f[7] = "1";
  std::string plain_spec = f[0];
  for (std::size_t i = 1; i < f.size(); ++i) plain_spec += ":" + f[i];
  const Tensor plain = run_case(plain_spec, &name);
  EXPECT_GT(fd_test::max_abs_diff(guided, plain), 1e-3);
}

// The seed fixes the noise: the same seed gives the same images, another seed others; each
// prompt gives images_per_prompt images in a row.
TEST(Pipelines, SeedAndImagesPerPrompt) {
  FD_SKIP_IF_NO_DEVICE();
  std::shared_ptr<fm::Pipeline> pipe = load("sdxl");
  fm::GenerateOptions o;
  o.prompts = {"a red cat", "the moon"};
  o.width = 16;
  o.height = 8;
  o.steps = 2;
  o.seed = 5;
  o.images_per_prompt = 2;
  int calls = 0;
  o.on_step = [&](int64_t step, int64_t steps) {
    ++calls;
    EXPECT_EQ(steps, 2);
    EXPECT_EQ(step, calls);
  };
  const Tensor a = fm::generate(*pipe, o);
  EXPECT_EQ(calls, 2);
  ASSERT_EQ(a.sizes(), (flame::Shape{4, 3, 8, 16}));
  o.on_step = nullptr;
  const Tensor b = fm::generate(*pipe, o);
  EXPECT_EQ(fd_test::max_abs_diff(a, b), 0.0);
  o.seed = 6;
  const Tensor c = fm::generate(*pipe, o);
  EXPECT_GT(fd_test::max_abs_diff(a, c), 1e-3);
  // Euler ancestral draws its step noise from the same generator: reproducible too.
  o.sampler = "euler-a";
  EXPECT_EQ(fd_test::max_abs_diff(fm::generate(*pipe, o), fm::generate(*pipe, o)), 0.0);
  // A tiled decode of latents within one tile stride (the tiny VAE's 16-pixel tiles step by 12)
  // is the plain decode; past it the tiles are blended, as diffusers' tiling.
  o.sampler = "euler";
  o.width = 8;
  const Tensor plain = fm::generate(*pipe, o);
  o.tiled_decode = true;
  EXPECT_LE(fd_test::max_abs_diff(fm::generate(*pipe, o), plain), 1e-6);
  o.width = 16;
  EXPECT_GT(fd_test::max_abs_diff(fm::generate(*pipe, o), c), 1e-3);
}

// Components given apart from the pipeline folder (here the model folders themselves, as the CLI's
// --unet / --vae / --clip-l / --clip-g pass them) replace the folder's: the same images.
TEST(Pipelines, ComponentsGivenApartReplaceTheFolders) {
  FD_SKIP_IF_NO_DEVICE();
  const std::string sdxl = (data_dir() / "sdxl").string();
  fm::PipelineLoadOptions lo{.path = sdxl, .device = fd_test::test_device()};
  lo.denoiser = sdxl + "/unet";
  lo.vae = sdxl + "/vae";
  lo.text_encoder = sdxl + "/text_encoder";
  lo.text_encoder_2 = sdxl + "/text_encoder_2";
  auto apart = fm::load_pipeline(lo);
  fm::GenerateOptions o;
  o.prompts = {"a red cat"};
  o.width = 16;
  o.height = 16;
  o.steps = 2;
  o.seed = 3;
  EXPECT_EQ(fd_test::max_abs_diff(fm::generate(*apart, o), fm::generate(*load("sdxl"), o)), 0.0);
}

TEST(Pipelines, BadInputNamesTheSetting) {
  FD_SKIP_IF_NO_DEVICE();
  std::shared_ptr<fm::Pipeline> flux = load("flux");
  fm::GenerateOptions o;
  o.prompts = {"a cat"};
  o.width = 16;
  o.height = 16;
  o.negative_prompt = "dark";  // FLUX: only with true CFG
  EXPECT_NE(fd_test::error_of([&] { fm::generate(*flux, o); }).find("true_cfg_scale > 1"), std::string::npos);
  o.negative_prompt.reset();
  o.true_cfg_scale = 4;
  EXPECT_NE(fd_test::error_of([&] { fm::generate(*flux, o); }).find("needs a negative prompt"), std::string::npos);
  o.true_cfg_scale = 1;
  o.width = 18;
  EXPECT_NE(fd_test::error_of([&] { fm::generate(*flux, o); }).find("multiples of 4"), std::string::npos);
  o.width = 16;
  o.sampler = "dpm++2m";
  EXPECT_NE(fd_test::error_of([&] { fm::generate(*flux, o); }).find("flow-match Euler"), std::string::npos);
  std::shared_ptr<fm::Pipeline> sdxl = load("sdxl");
  o.sampler = "ddim";
  EXPECT_NE(fd_test::error_of([&] { fm::generate(*sdxl, o); }).find("dpm++2m-karras"), std::string::npos);
  o.sampler = "";
  o.latents = Tensor::zeros({1, 4, 4, 4});
  EXPECT_NE(fd_test::error_of([&] { fm::generate(*sdxl, o); }).find("latents of shape"), std::string::npos);
  o.latents = Tensor();
  o.prompts.clear();
  EXPECT_NE(fd_test::error_of([&] { fm::generate(*sdxl, o); }).find("no prompt"), std::string::npos);
  EXPECT_NE(fd_test::error_of([&] { fm::load_pipeline({.path = "/nonexistent/folder"}); }).find("/nonexistent/folder"),
            std::string::npos);
  const auto dir = fd_test::fresh_temp_dir("pipelines", "no_vae");
  fd_test::write_text(dir / "model_index.json", R"({"_class_name": "FluxPipeline"})");
  const std::string err = fd_test::error_of([&] { fm::load_pipeline({.path = dir.string()}); });
  EXPECT_NE(err.find("has no vae/ folder (or give the component with --vae)"), std::string::npos) << err;
  fd_test::write_text(dir / "model_index.json", R"({"_class_name": "KandinskyPipeline"})");
  EXPECT_NE(fd_test::error_of([&] { fm::load_pipeline({.path = dir.string()}); }).find("KandinskyPipeline"),
            std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
