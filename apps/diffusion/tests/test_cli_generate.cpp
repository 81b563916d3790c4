// `flame-diffusion generate` run as a user runs it (issue #31, item 5) on the tiny FLUX, SD3.5 and
// SDXL pipeline folders of tests/data/models/pipelines-tiny: the grid it writes holds the
// library's images (models::generate with the same settings) with their captions, and command-line
// mistakes are refused naming the flag. Suite CliGenerate; each run takes well under a second on
// the CPU.
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>

#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <flame/flame.h>

#include "generate.h"
#include "image_decode.h"
#include "model_test_util.h"
#include "models/pipelines.h"
#include "png_image.h"

#ifndef FLAME_DIFFUSION_BIN
#define FLAME_DIFFUSION_BIN "flame-diffusion"
#endif

extern char** environ;

namespace {

namespace fs = std::filesystem;
namespace fm = flame_diffusion::models;

fs::path pipelines_dir() { return fs::path(__FILE__).parent_path() / "data" / "models" / "pipelines-tiny"; }

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

struct Result {
  int status = -1;
  std::string out, err;
};

// Runs flame-diffusion `command` with `args` (on the CPU), capturing stdout and stderr.
Result run_cli(const fs::path& dir, const std::string& command, const std::vector<std::string>& args) {
  std::vector<std::string> full = {FLAME_DIFFUSION_BIN, command, "--device", "cpu"};
  full.insert(full.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : full) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string out = (dir / "stdout").string(), err = (dir / "stderr").string();
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  Result r;
  if (rc != 0) return r;
  int st = 0;
  ::waitpid(pid, &st, 0);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

Result generate(const fs::path& dir, const std::vector<std::string>& args) { return run_cli(dir, "generate", args); }

TEST(CliGenerate, WritesTheCaptionedGridOfTheLibraryImages) {
  const fs::path dir = fd_test::fresh_temp_dir("cli_generate", "sdxl");
  const std::string png = (dir / "grid.png").string();
  const Result r = generate(dir, {"--model", (pipelines_dir() / "sdxl").string(), "--prompt", "a red cat",
                                  "--prompt", "the moon over the sea", "--negative-prompt", "dark", "--steps", "2",
                                  "--width", "24", "--height", "16", "--batch", "2", "--seed", "9", "--sampler",
                                  "dpm++2m-karras", "--cfg", "6", "--out", png});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, png + "\n");
  EXPECT_NE(r.err.find("step 2/2"), std::string::npos) << r.err;

  auto pipe = fm::load_pipeline({.path = (pipelines_dir() / "sdxl").string()});
  fm::GenerateOptions o;
  o.prompts = {"a red cat", "the moon over the sea"};
  o.negative_prompt = "dark";
  o.steps = 2;
  o.width = 24;
  o.height = 16;
  o.images_per_prompt = 2;
  o.seed = 9;
  o.sampler = "dpm++2m-karras";
  o.guidance = 6;
  const flame::Tensor images = fm::generate(*pipe, o);
  const flame_diffusion::Image want = flame_diffusion::caption_grid(
      images, {"a red cat", "a red cat", "the moon over the sea", "the moon over the sea"}, 2);
  const flame_diffusion::Image got = flame_diffusion::decode_image(png);
  ASSERT_EQ(got.width, want.width);
  ASSERT_EQ(got.height, want.height);
  ASSERT_EQ(got.channels, 3);
  EXPECT_EQ(got.pixels, want.pixels);
  fs::remove_all(dir);
}

// FLUX's true CFG: --cfg above 1 with --negative-prompt is GenerateOptions::true_cfg_scale, and
// --guidance stays the guidance embedding.
TEST(CliGenerate, FluxTrueCfgIsTheLibrarysTrueCfg) {
  const fs::path dir = fd_test::fresh_temp_dir("cli_generate", "flux_true_cfg");
  const std::string png = (dir / "grid.png").string();
  const Result r = generate(dir, {"--model", (pipelines_dir() / "flux").string(), "--prompt", "a red cat",
                                  "--negative-prompt", "dark", "--cfg", "4", "--guidance", "3", "--steps", "2",
                                  "--width", "16", "--height", "16", "--max-sequence-length", "12", "--seed", "5",
                                  "--out", png});
  ASSERT_EQ(r.status, 0) << r.err;
  auto pipe = fm::load_pipeline({.path = (pipelines_dir() / "flux").string()});
  fm::GenerateOptions o;
  o.prompts = {"a red cat"};
  o.negative_prompt = "dark";
  o.true_cfg_scale = 4;
  o.guidance = 3;
  o.steps = 2;
  o.width = 16;
  o.height = 16;
  o.max_sequence_length = 12;
  o.seed = 5;
  const flame_diffusion::Image want = flame_diffusion::caption_grid(fm::generate(*pipe, o), {"a red cat"}, 1);
  const flame_diffusion::Image got = flame_diffusion::decode_image(png);
  ASSERT_EQ(got.width, want.width);
  ASSERT_EQ(got.height, want.height);
  EXPECT_EQ(got.pixels, want.pixels);
  o.negative_prompt.reset();  // without true CFG the image is another
  o.true_cfg_scale = 1;
  EXPECT_NE(flame_diffusion::caption_grid(fm::generate(*pipe, o), {"a red cat"}, 1).pixels, got.pixels);
  fs::remove_all(dir);
}

TEST(CliGenerate, FluxSD35AndSdxlLoraRun) {
  const fs::path dir = fd_test::fresh_temp_dir("cli_generate", "flux_sd3");
  for (const char* family : {"flux", "sd3"}) {
    const std::string out = (dir / (std::string(family) + ".png")).string();
    const Result r = generate(dir, {"--model", (pipelines_dir() / family).string(), "--prompt", "a cat", "--steps",
                                    "2", "--width", "16", "--height", "16", "--guidance", "3", "--max-sequence-length",
                                    "12", "--out", out});
    ASSERT_EQ(r.status, 0) << family << ": " << r.err;
    const flame_diffusion::Image img = flame_diffusion::decode_image(out);
    EXPECT_EQ(img.width, 16 + 4 + 4) << family;
  }
  // --fp8-base: the denoiser in 8 bits (FLUX loads so; SDXL's UNet is quantised after loading),
  // with a LoRA on top for SDXL.
  for (const char* family : {"flux", "sdxl"}) {
    const Result r = generate(dir, {"--model", (pipelines_dir() / family).string(), "--prompt", "a cat", "--steps",
                                    "2", "--width", "16", "--height", "16", "--fp8-base", "dequantize", "--out",
                                    (dir / (std::string(family) + "_fp8.png")).string()});
    EXPECT_EQ(r.status, 0) << family << ": " << r.err;
  }
  // A LoRA file (diffusers' save_lora_weights) on SDXL's UNet.
  const Result r = generate(dir, {"--model", (pipelines_dir() / "sdxl").string(), "--lora",
                                  (pipelines_dir() / "lora" / "sdxl.safetensors").string(), "--prompt", "a cat",
                                  "--steps", "2", "--width", "16", "--height", "16", "--out",
                                  (dir / "lora.png").string()});
  EXPECT_EQ(r.status, 0) << r.err;
  fs::remove_all(dir);
}

TEST(CliGenerate, MistakesNameTheFlag) {
  const fs::path dir = fd_test::fresh_temp_dir("cli_generate", "errors");
  const std::string flux = (pipelines_dir() / "flux").string(), sdxl = (pipelines_dir() / "sdxl").string();
  const std::string out = (dir / "g.png").string();
  struct Case {
    std::vector<std::string> args;
    std::string wanted;
  };
  const std::vector<Case> cases = {
      {{"--model", flux, "--prompt", "x", "--cfg", "3", "--out", out}, "needs --negative-prompt"},
      {{"--model", flux, "--prompt", "x", "--negative-prompt", "y", "--out", out}, "give --cfg above 1"},
      {{"--model", flux, "--prompt", "x", "--negative-prompt", "y", "--cfg", "1", "--out", out}, "--negative-prompt"},
      {{"--model", (dir / "missing").string(), "--prompt", "x"}, "--model"},
      {{"--model", sdxl, "--prompt", "x", "--vae", (dir / "vae.safetensors").string()}, "--vae"},
      {{"--model", sdxl, "--prompt", "x", "--sampler", "ddim", "--out", out}, "dpm++2m-karras"},
      {{"--model", sdxl, "--prompt", "x", "--width", "17", "--height", "16", "--out", out}, "width 17"},
      {{"--model", sdxl, "--prompt", "x", "--out", (dir / "g.gif").string()}, "--out"},
      {{"--model", sdxl, "--prompt", "x", "--steps", "0"}, "--steps"},
      {{"--model", sdxl, "--prompt", "x", "--lora", (dir / "none.safetensors").string()}, "--lora"},
      {{"--model", sdxl, "--prompt", "x", "--dtype", "f8", "--out", out}, "--dtype"},
      {{"--model", sdxl, "--prompt", "x", "--transformer", sdxl, "--out", out}, "--transformer"},
      {{"--model", sdxl, "--prompt", "x", "--fp8-base", "int4", "--out", out}, "--fp8-base"},
  };
  for (const Case& c : cases) {
    const Result r = generate(dir, c.args);
    EXPECT_EQ(r.status, 2) << c.wanted << ": " << r.err;
    EXPECT_NE(r.err.find(c.wanted), std::string::npos) << r.err;
  }
  EXPECT_FALSE(fs::exists(out));
  fs::remove_all(dir);
}

}  // namespace

namespace {

// `flame-diffusion finetune --config` as a user runs it: a TOML file and --set overrides, the LoRA
// path on stdout, the refusal of a second run into the folder, flags that belong in the
// configuration refused with status 2, --overwrite, and the LoRA used by `generate`.
TEST(CliFinetune, ConfigRunRefusalsAndTheLoraInGenerate) {
  const fs::path dir = fd_test::fresh_temp_dir("cli_finetune", "flux");
  const fs::path images = dir / "images";
  fs::create_directories(images);
  for (int i = 0; i < 3; ++i) {
    flame_diffusion::Image img(64 + 16 * i, 64, 3, static_cast<uint8_t>(60 * i));
    flame_diffusion::write_png((images / ("p" + std::to_string(i) + ".png")).string(), img);
    std::ofstream(images / ("p" + std::to_string(i) + ".txt")) << "a plain colour " << i;
  }
  const fs::path config = dir / "lora.toml";
  std::ofstream(config) << "[model]\nfamily = \"flux\"\ncheckpoint = \"" << (pipelines_dir() / "flux").string()
                        << "\"\n[dataset]\nfolders = [\"" << images.string()
                        << "\"]\nresolution = 64\nbucket_step = 16\nbucket_min_size = 32\n"
                           "[lora]\nrank = 4\n[train]\nmixed_precision = \"no\"\n[output]\ndir = \""
                        << (dir / "run").string() << "\"\nname = \"plain\"\n";
  const std::vector<std::string> args = {"--config", config.string(), "--set", "train.steps=2", "--set",
                                         "checkpoint.lora_format=both"};
  Result r = run_cli(dir, "finetune", args);
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string kohya = (dir / "run" / "plain.safetensors").string();
  EXPECT_EQ(r.out, kohya + "\n" + (dir / "run" / "plain_diffusers.safetensors").string() + "\n");
  EXPECT_NE(r.err.find("step 2/2"), std::string::npos) << r.err;

  r = run_cli(dir, "finetune", args);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("already holds a run"), std::string::npos) << r.err;

  std::vector<std::string> with_flag = args;
  with_flag.insert(with_flag.end(), {"--steps", "3"});
  r = run_cli(dir, "finetune", with_flag);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--steps: with --config"), std::string::npos) << r.err;

  r = run_cli(dir, "finetune", {"--config", config.string(), "--set", "train.stepz=2"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("train.steps"), std::string::npos) << r.err;  // did you mean

  std::vector<std::string> again = args;
  again.push_back("--overwrite");
  r = run_cli(dir, "finetune", again);
  EXPECT_EQ(r.status, 0) << r.err;

  r = generate(dir, {"--model", (pipelines_dir() / "flux").string(), "--lora", kohya, "--prompt", "a plain colour",
                     "--steps", "2", "--width", "32", "--height", "32", "--out", (dir / "g.png").string()});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::exists(dir / "g.png"));
}

}  // namespace
