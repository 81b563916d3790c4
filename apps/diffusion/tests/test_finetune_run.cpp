// The fine-tuning run (finetune_run.h, issue #31) end to end on the tiny FLUX, SD3.5 and SDXL pipeline
// folders: a captioned image folder with buckets -> text and latent caches -> LoRA training with a
// checkpoint, an interruption and a resume that continues exactly -> samples -> LoRA files in both
// layouts that load back into the pipeline; and the run folder's refusals. Suite FinetuneRun.
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <map>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <flame/cuda.h>

#include <flame/flame.h>
#include <flame/io/safetensors.h>

#include "finetune_run.h"
#include "model_test_util.h"
#include "models/pipelines.h"
#include "png_image.h"
#include "train_config.h"

namespace {

namespace fs = std::filesystem;
namespace fd = flame_diffusion;
namespace fm = flame_diffusion::models;
using flame::Tensor;

fs::path pipelines_dir() { return fs::path(__FILE__).parent_path() / "data" / "models" / "pipelines-tiny"; }

// Six captioned images of three shapes (two buckets at resolution 64: square and 80x48).
fs::path make_images(const fs::path& dir) {
  const fs::path images = dir / "images" / "2_shapes";  // kohya repeats 2
  fs::create_directories(images);
  const int sizes[6][2] = {{64, 64}, {96, 96}, {120, 72}, {100, 60}, {70, 70}, {160, 96}};
  for (int i = 0; i < 6; ++i) {
    const int w = sizes[i][0], h = sizes[i][1];
    fd::Image img(w, h, 3);
    for (int y = 0; y < h; ++y) {
      for (int x = 0; x < w; ++x) {
        const bool inside = (x - w / 2) * (x - w / 2) + (y - h / 2) * (y - h / 2) < (h / 3) * (h / 3);
        uint8_t* p = img.at(x, y);
        p[0] = static_cast<uint8_t>(inside ? 200 + 9 * i : 20 * i);
        p[1] = static_cast<uint8_t>((x * 255) / w);
        p[2] = static_cast<uint8_t>((y * 255) / h);
      }
    }
    const std::string stem = "img" + std::to_string(i);
    fd::write_png((images / (stem + ".png")).string(), img);
    fd_test::write_text(images / (stem + ".txt"), i % 2 ? "a red circle, on a gradient" : "a round shape");
  }
  return dir / "images";
}

fd::FinetuneConfig tiny_config(const std::string& family, const fs::path& images, const fs::path& out) {
  fd::FinetuneConfig c;
  c.model.family = family;
  c.model.checkpoint = (pipelines_dir() / family).string();
  c.dataset.folders = {images.string()};
  c.dataset.resolution = 64;
  c.dataset.bucket_step = 16;
  c.dataset.bucket_min_size = 32;
  c.dataset.bucket_max_size = 128;
  c.dataset.flip_p = 0.5;
  c.dataset.caption_dropout = 0.25;
  c.lora.rank = 4;
  c.lora.alpha = 4;
  c.optimizer.lr = 3e-3;
  c.optimizer.warmup_steps = 1;
  c.optimizer.scheduler = "cosine";
  c.train.steps = 4;
  c.train.batch_size = 2;
  c.train.seed = 5;
  c.train.mixed_precision = "no";
  c.train.dataloader_workers = 1;
  c.train.log_every = 2;
  c.checkpoint.every = 2;
  c.checkpoint.lora_format = "both";
  c.sample.prompts = {"a red circle", "a round shape"};
  c.sample.every = 3;
  c.sample.steps = 2;
  c.sample.guidance = family == "flux" ? 3.5 : 2.0;
  c.cache.dir = (out.parent_path() / "cache").string();
  c.output.dir = out.string();
  c.output.name = "shapes";
  return c;
}

fd::FinetuneRunResult run(fd::FinetuneConfig c, int64_t stop_after = 0, bool overwrite = false) {
  return fd::run_finetune({.config = std::move(c), .device = fd_test::test_device(), .overwrite = overwrite,
                           .stop_after = stop_after, .log = [](const std::string&) {}});
}

Tensor sample(const std::string& family, const std::string& lora) {
  auto pipe = fm::load_pipeline({.path = (pipelines_dir() / family).string(), .lora = lora, .device = fd_test::test_device()});
  fm::GenerateOptions g;
  g.prompts = {"a red circle"};
  g.steps = 2;
  g.width = g.height = 64;
  g.seed = 3;
  if (family != "flux") g.guidance = 1.0;
  return fm::generate(*pipe, g);
}

// FLAME_FINETUNE_EXPORT_DIR=DIR: the LoRA files a test trained, with FLAME's images of them from
// fixed latents, for `python3 apps/diffusion/reference/pipelines.py --check-lora DIR` (diffusers'
// load_lora_weights and pipeline on the same latents).
void export_for_diffusers(const std::string& family, const std::vector<std::string>& lora_files) {
  const char* env = std::getenv("FLAME_FINETUNE_EXPORT_DIR");
  if (env == nullptr || *env == '\0') return;
  const fs::path dir = env;
  fs::create_directories(dir);
  flame::StateDict out;
  std::map<std::string, std::string> meta;
  std::string cases;
  flame::Generator gen(11);
  for (const std::string& file : lora_files) {
    const std::string layout = file.find("_diffusers") != std::string::npos ? "diffusers" : "kohya";
    const std::string name = family + "_" + layout;
    fs::copy_file(file, dir / (name + ".safetensors"), fs::copy_options::overwrite_existing);
    auto pipe = fm::load_pipeline({.path = (pipelines_dir() / family).string(), .lora = file, .device = fd_test::test_device()});
    fm::GenerateOptions g;
    g.prompts = {"a red circle on a gradient"};
    g.steps = 3;
    g.width = 24;
    g.height = 16;
    g.guidance = family == "flux" ? 3.5 : 1.0;
    g.max_sequence_length = 20;
    g.latents = Tensor::randn({1, family == "sdxl" ? 4 : 16, 8, 12}, 0.0, 1.0, {}, &gen);
    out.insert(name + ".latents", g.latents);
    out.insert(name + ".image", fm::generate(*pipe, g));
    cases += (cases.empty() ? "" : "|") + name + ":" + family + ":" + std::to_string(g.steps) + ":" +
             std::to_string(g.guidance) + ":" + g.prompts[0];
  }
  meta["cases"] = cases;
  const fs::path ref = dir / (family + "_flame_images.safetensors");
  flame::io::save_safetensors(ref.string(), out, meta);
}

double max_diff(const Tensor& a, const Tensor& b) { return (a - b).abs().max().item<double>(); }

template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(FinetuneRun, FluxCachesCheckpointResumeSamplesAndLoraFiles) {
  const fs::path dir = fd_test::fresh_temp_dir("finetune_run", "flux");
  const fs::path images = make_images(dir);

  // One uninterrupted run: caches built, 4 steps, samples at the end (with true CFG: the negative
  // prompt's embeddings come from the text cache too), both LoRA layouts.
  fd::FinetuneConfig c = tiny_config("flux", images, dir / "a");
  c.sample.negative_prompt = "blurry";
  c.sample.true_cfg_scale = 3.0;
  const fd::FinetuneRunResult a = run(c);
  ASSERT_EQ(a.losses.size(), 4u);
  for (double l : a.losses) EXPECT_TRUE(std::isfinite(l) && l > 0) << l;
  EXPECT_EQ(a.steps_done, 4);
  EXPECT_GT(a.text_encoded, 0);
  EXPECT_EQ(a.latents_encoded, 12);  // 6 images x (unflipped, flipped)
  ASSERT_EQ(a.lora_files.size(), 2u);
  EXPECT_TRUE(fs::exists(dir / "a" / "config.toml"));
  EXPECT_TRUE(fs::exists(dir / "a" / "loss.csv"));
  ASSERT_EQ(a.sample_files.size(), 2u);  // step 3 and the end
  for (const auto& f : a.sample_files) EXPECT_TRUE(fs::exists(f)) << f;
  EXPECT_EQ(fd::load_finetune_config((dir / "a" / "config.toml").string()), c);

  // The same run stopped after 2 steps and resumed: the caches are all hits, and the losses and the
  // adapters are those of the uninterrupted run.
  c.output.dir = (dir / "b").string();
  const fd::FinetuneRunResult b1 = run(c, 2);
  EXPECT_EQ(b1.steps_done, 2);
  EXPECT_TRUE(b1.lora_files.empty());
  EXPECT_EQ(b1.text_encoded, 0);
  EXPECT_EQ(b1.latents_encoded, 0);
  EXPECT_EQ(b1.latents_cached, 12);
  c.checkpoint.resume = "latest";
  const fd::FinetuneRunResult b2 = run(c);
  EXPECT_EQ(b2.first_step, 2);
  ASSERT_EQ(b2.losses.size(), 2u);
  std::vector<double> resumed = b1.losses;
  resumed.insert(resumed.end(), b2.losses.begin(), b2.losses.end());
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(resumed[i], a.losses[i], 1e-6 * std::abs(a.losses[i])) << "step " << i + 1;
  const flame::StateDict la = flame::io::load_safetensors(a.lora_files[0]);
  const flame::StateDict lb = flame::io::load_safetensors(b2.lora_files[0]);
  ASSERT_EQ(la.size(), lb.size());
  double worst = 0, largest = 0;
  for (const auto& [k, t] : la) {
    worst = std::max(worst, max_diff(t, lb.at(k)));
    largest = std::max(largest, t.abs().max().item<double>());
  }
  EXPECT_LE(worst, 1e-5 * largest);
  EXPECT_GT(largest, 0.0);

  // Both files load into the pipeline and give the same images, which the training changed.
  const Tensor kohya = sample("flux", a.lora_files[0]);
  const Tensor diffusers = sample("flux", a.lora_files[1]);
  const Tensor base = sample("flux", "");
  EXPECT_LE(max_diff(kohya, diffusers), 1e-5);
  EXPECT_GT(max_diff(kohya, base), 1e-6);
  const auto meta = flame::io::load_safetensors_metadata(a.lora_files[0]);
  EXPECT_EQ(meta.at("ss_steps"), "4");
  EXPECT_EQ(meta.at("ss_num_train_images"), "6");
  EXPECT_EQ(meta.at("lora_family"), "flux");

  export_for_diffusers("flux", a.lora_files);

  // The folder holds a run now: a fresh run into it is refused, --overwrite replaces it.
  c.checkpoint.resume = "";
  c.output.dir = (dir / "a").string();
  const std::string err = error_of([&] { run(c); });
  EXPECT_NE(err.find("already holds a run"), std::string::npos) << err;
  EXPECT_NE(err.find("checkpoint.resume"), std::string::npos) << err;
  c.train.steps = 1;
  c.sample.prompts.clear();
  // ... here with the transformer given apart from the pipeline folder (a model folder here: the tiny
  // model's single file does not say its rotary axes, which a real FLUX file does).
  c.model.pipeline = c.model.checkpoint;
  c.model.checkpoint = (pipelines_dir() / "flux" / "transformer").string();
  const fd::FinetuneRunResult o = run(c, 0, true);
  EXPECT_EQ(o.steps_done, 1);
  EXPECT_EQ(o.latents_cached, 12);
}

// SD3.5 and SDXL without caches (the encoders and the VAE stay and encode every batch), samples
// during the run, kohya and diffusers files.
TEST(FinetuneRun, SD3AndSDXLWithoutCaches) {
  for (const std::string family : {"sd3", "sdxl"}) {
    SCOPED_TRACE(family);
    const fs::path dir = fd_test::fresh_temp_dir("finetune_run", family);
    fd::FinetuneConfig c = tiny_config(family, make_images(dir), dir / "run");
    c.cache.latents = false;
    c.dataset.bucketing = false;  // the tiny SD3.5's position table covers 64 x 64 pixels
    c.dataset.max_upscale = 2.0;
    c.cache.text_embeddings = false;
    c.train.steps = 2;
    c.train.grad_accum = 2;
    c.sample.every = 1;
    c.sample.negative_prompt = "blurry";
    c.train.min_snr_gamma = family == "sdxl" ? 5.0 : 0.0;
    c.lora.rank_pattern = {"ff.net.2=2"};
    c.optimizer.type = "adamw8bit";  // the tiny adapters are under min_8bit_size: f32 states, AdamW's step
    c.lora.alpha_pattern = {"to_q=8"};
    const fd::FinetuneRunResult r = run(c);
    ASSERT_EQ(r.losses.size(), 2u);
    for (double l : r.losses) EXPECT_TRUE(std::isfinite(l) && l > 0) << l;
    EXPECT_EQ(r.sample_files.size(), 2u);  // step 1, and the end
    ASSERT_EQ(r.lora_files.size(), 2u);
    const Tensor kohya = sample(family, r.lora_files[0]);
    const Tensor diffusers = sample(family, r.lora_files[1]);
    EXPECT_LE(max_diff(kohya, diffusers), 1e-5);
    export_for_diffusers(family, r.lora_files);
    // Per-module ranks: ff.net.2 at rank 2, the rest at lora.rank 4 (diffusers layout: lora_A [r, in]).
    int ff = 0, other = 0;
    for (const auto& [k, t] : flame::io::load_safetensors(r.lora_files[1])) {
      if (k.find("lora_A") == std::string::npos) continue;
      const bool is_ff = k.find("ff.net.2.") != std::string::npos;
      EXPECT_EQ(t.size(0), is_ff ? 2 : 4) << k;
      (is_ff ? ff : other)++;
    }
    EXPECT_GT(ff, 0);
    EXPECT_GT(other, 0);
  }
}

// model.fp8_base: the frozen base in 8 bits (both modes) trains the adapters; the first loss (before
// any update) is the bf16 base's within the weights' e4m3 rounding.
// A tiny run without caches or samples, of `steps` steps.
fd::FinetuneConfig uncached_config(const std::string& family, const fs::path& images, const fs::path& out, int64_t steps) {
  fd::FinetuneConfig c = tiny_config(family, images, out);
  c.cache.latents = false;
  c.cache.text_embeddings = false;
  c.sample.every = 0;
  c.sample.prompts = {};
  c.train.steps = steps;
  return c;
}

TEST(FinetuneRun, Fp8BaseTrainsTheAdapters) {
  const fs::path dir = fd_test::fresh_temp_dir("finetune_run", "fp8");
  const fs::path images = make_images(dir);
  std::vector<double> first;
  for (const std::string mode : {"none", "dequantize", "fp8"}) {
    SCOPED_TRACE(mode);
    fd::FinetuneConfig c = uncached_config("flux", images, dir / ("run_" + mode), 2);
    c.model.fp8_base = mode;
    const fd::FinetuneRunResult r = run(c);
    ASSERT_EQ(r.losses.size(), 2u);
    for (double l : r.losses) EXPECT_TRUE(std::isfinite(l) && l > 0) << l;
    EXPECT_EQ(r.lora_files.size(), 2u);
    first.push_back(r.losses[0]);
  }
  EXPECT_NEAR(first[1], first[0], 0.05 * first[0]);
  EXPECT_NEAR(first[2], first[0], 0.05 * first[0]);
  EXPECT_NE(first[1], first[0]) << "an 8-bit base cannot give the bf16 base's loss exactly";
  fd::FinetuneConfig c = tiny_config("flux", images, dir / "run_full");
  c.train.method = "full";
  c.model.fp8_base = "fp8";
  EXPECT_NE(error_of([&] { run(c); }).find("model.fp8_base"), std::string::npos);
  // SD3 (its transformer loads into 8-bit Linears) and SDXL (its UNet is quantised after the adapters).
  for (const std::string family : {"sd3", "sdxl"}) {
    SCOPED_TRACE(family);
    fd::FinetuneConfig f = tiny_config(family, images, dir / ("run_" + family));
    f.cache.latents = false;
    f.cache.text_embeddings = false;
    f.dataset.bucketing = false;  // the tiny SD3.5's position table covers 64 x 64 pixels
    f.dataset.max_upscale = 2.0;
    f.sample.every = 0;
    f.sample.prompts = {};
    f.train.steps = 1;
    f.model.fp8_base = "dequantize";
    const fd::FinetuneRunResult r = run(f);
    ASSERT_EQ(r.losses.size(), 1u);
    EXPECT_TRUE(std::isfinite(r.losses[0]) && r.losses[0] > 0) << r.losses[0];
  }
}

// train.vram_budget_gib (models/block_budget.h): the trial steps that choose what to swap and
// checkpoint leave the run as it would be without them (the random state is put back); a budget too
// small is an error naming it; the setting needs a CUDA device and a transformer.
TEST(FinetuneRun, VramBudgetChoosesTheLayoutWithoutChangingTheRun) {
  const fs::path dir = fd_test::fresh_temp_dir("finetune_run", "budget");
  const fs::path images = make_images(dir);
  auto config = [&](const std::string& family, const std::string& name, double budget) {
    fd::FinetuneConfig c = uncached_config(family, images, dir / name, 2);
    c.train.vram_budget_gib = budget;
    return c;
  };
  if (!fd_test::test_device().is_cuda()) {
    const std::string e = error_of([&] { run(config("flux", "cpu", 4.0)); });
    EXPECT_NE(e.find("train.vram_budget_gib"), std::string::npos) << e;
    EXPECT_NE(e.find("--device cuda"), std::string::npos) << e;
    return;
  }
  const fd::FinetuneRunResult plain = run(config("flux", "plain", 0.0));
  EXPECT_TRUE(plain.memory_plan.empty());
  const fd::FinetuneRunResult fitted = run(config("flux", "fitted", 4.0));
  EXPECT_NE(fitted.memory_plan.find("VRAM budget 4.00 GiB"), std::string::npos) << fitted.memory_plan;
  EXPECT_NE(fitted.memory_plan.find("0 of 4 blocks swapped"), std::string::npos) << fitted.memory_plan;
  ASSERT_EQ(fitted.losses.size(), plain.losses.size());
  for (std::size_t i = 0; i < plain.losses.size(); ++i) EXPECT_NEAR(fitted.losses[i], plain.losses[i], 1e-5 * plain.losses[i]) << i;
  EXPECT_EQ(flame::cuda::memory_limit(fd_test::test_device().index), 0u);  // the cap ends with the run
  const std::string small = error_of([&] { run(config("flux", "small", 0.1)); });
  EXPECT_NE(small.find("the budget 0.10 GiB"), std::string::npos) << small;
  const std::string unet = error_of([&] { run(config("sdxl", "unet", 4.0)); });
  EXPECT_NE(unet.find("block swapping is for FLUX"), std::string::npos) << unet;
}

TEST(FinetuneRun, BadSettingsAreNamed) {
  const fs::path dir = fd_test::fresh_temp_dir("finetune_run", "bad");
  const fs::path images = make_images(dir);
  auto err = [&](const std::function<void(fd::FinetuneConfig&)>& change) {
    fd::FinetuneConfig c = tiny_config("flux", images, dir / "run");
    change(c);
    return error_of([&] { run(c); });
  };
  EXPECT_NE(err([](auto& c) { c.dataset.crop = "random"; }).find("dataset.crop"), std::string::npos);
  EXPECT_NE(err([](auto& c) { c.dataset.shuffle_tags = true; }).find("dataset.shuffle_tags"), std::string::npos);
  EXPECT_NE(err([](auto& c) { c.train.method = "lokr"; }).find("lora_format"), std::string::npos);  // "both"
  EXPECT_NE(err([](auto& c) {
              c.model.checkpoint = (pipelines_dir() / "flux" / "transformer" / "diffusion_pytorch_model.safetensors").string();
            }).find("model.pipeline"),
            std::string::npos);
  EXPECT_NE(err([](auto& c) { c.checkpoint.resume = "latest"; }).find("holds no checkpoint"), std::string::npos);
  EXPECT_NE(err([](auto& c) { c.model.family = "sdxl"; }).find("flux"), std::string::npos);
  EXPECT_NE(err([](auto& c) { c.lora.targets = {"no_such_module"}; }).find("lora.targets"), std::string::npos);
}

}  // namespace

namespace {

// The example configurations of apps/diffusion/configs read without an error.
TEST(FinetuneRun, ExampleConfigurationsRead) {
  const fs::path dir = fs::path(__FILE__).parent_path().parent_path() / "configs";
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".toml") continue;
    SCOPED_TRACE(e.path().string());
    const fd::FinetuneConfig c = fd::load_finetune_config(e.path().string());
    EXPECT_FALSE(c.model.checkpoint.empty());
    EXPECT_FALSE(c.dataset.folders.empty());
    ++n;
  }
  EXPECT_GE(n, 3);
}

}  // namespace

namespace {

// A write that fails (here: the file-size limit, as a full disk fails it) while saving a checkpoint
// is an error naming the file; the previous checkpoint stays whole and the run resumes from it.
// A loss that stops being finite ends the run with an error naming its step, and no checkpoint holds
// weights that followed it (Note [Step pipelining]: the loss is read one step late, but every
// checkpoint waits for its step's read). An enormous LoRA alpha and learning rate without clipping
// make the first update's output overflow, so step 2's loss is not finite.
TEST(FinetuneRun, ANonFiniteLossStopsTheRunBeforeItsCheckpoint) {
  const fs::path dir = fd_test::fresh_temp_dir("finetune_run", "nonfinite");
  const fs::path images = make_images(dir);
  for (int64_t every : {1, 0}) {
    fd::FinetuneConfig c = tiny_config("flux", images, dir / ("run" + std::to_string(every)));
    c.sample.prompts.clear();
    c.lora.alpha = 4e20;  // scale 1e20: gradients stay finite (their squares too), the update does not
    c.optimizer.lr = 1;
    c.optimizer.grad_clip = 0;
    c.checkpoint.every = every;
    const std::string err = error_of([&] { run(c); });
    EXPECT_NE(err.find("the loss is"), std::string::npos) << err;
    EXPECT_NE(err.find("at step 2;"), std::string::npos) << err;
    const fs::path ckpts = c.output.dir + "/checkpoints";
    EXPECT_EQ(fs::exists(fs::path(ckpts) / "ckpt-0000000001.safetensors"), every == 1) << every;
    EXPECT_FALSE(fs::exists(fs::path(ckpts) / "ckpt-0000000002.safetensors")) << every;
    EXPECT_FALSE(fs::exists(fs::path(ckpts) / "ckpt-0000000003.safetensors")) << every;
  }
}

TEST(FinetuneRun, AFailedCheckpointWriteKeepsThePreviousOne) {
  const fs::path dir = fd_test::fresh_temp_dir("finetune_run", "full");
  fd::FinetuneConfig c = tiny_config("flux", make_images(dir), dir / "run");
  c.sample.prompts.clear();
  c.checkpoint.lora_format = "kohya";
  (void)run(c, 2);
  const fs::path first = dir / "run" / "checkpoints" / "ckpt-0000000002.safetensors";
  ASSERT_TRUE(fs::exists(first));
  const auto ckpt_size = fs::file_size(first);
  const auto config_size = fs::file_size(dir / "run" / "config.toml");
  ASSERT_LT(config_size * 2, ckpt_size);

  c.checkpoint.resume = "latest";
  std::string err;
  {
    struct rlimit old {};
    ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
    const auto previous = std::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of the signal
    struct rlimit small = old;
    small.rlim_cur = static_cast<rlim_t>(ckpt_size / 2);
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
    err = error_of([&] { run(c); });
    setrlimit(RLIMIT_FSIZE, &old);
    std::signal(SIGXFSZ, previous);
  }
  EXPECT_NE(err.find("ckpt-0000000004"), std::string::npos) << err;
  EXPECT_TRUE(fs::exists(first));
  EXPECT_EQ(fs::file_size(first), ckpt_size);
  EXPECT_FALSE(fs::exists(dir / "run" / "checkpoints" / "ckpt-0000000004.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "run" / "shapes.safetensors"));
  // With room again the run resumes from step 2 and finishes.
  const fd::FinetuneRunResult r = run(c);
  EXPECT_EQ(r.first_step, 2);
  EXPECT_EQ(r.steps_done, 4);
  EXPECT_EQ(r.lora_files.size(), 1u);
  // loss.csv holds each step once: the rows of the failed attempt's steps 3 and 4 were dropped.
  std::ifstream csv(dir / "run" / "loss.csv");
  std::string line, steps;
  while (std::getline(csv, line)) steps += line.substr(0, line.find(',')) + " ";
  EXPECT_EQ(steps, "step 1 2 3 4 ");
}

}  // namespace

namespace {

#if defined(FLAME_RUN_BIN) && defined(FLAME_DIFFUSION_BIN)
// Two ranks of `flame-diffusion finetune --config cfg_file` on the CPU with these --set options:
// their log, and whether they succeeded as `ok` says.
std::string launch_ranks(int ranks, const std::string& cfg_file, const std::string& sets, const std::string& log,
                         bool ok) {
  const std::string cmd = std::string(FLAME_RUN_BIN) + " --nproc-per-node " + std::to_string(ranks) + " " +
                          FLAME_DIFFUSION_BIN +
                          " finetune --config " + cfg_file + " --device cpu " + sets + " > " + log + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream f(log);
  std::stringstream text;
  text << f.rdbuf();
  EXPECT_EQ(rc == 0, ok) << cmd << "\n" << text.str();
  return text.str();
}
std::string launch_two_ranks(const std::string& cfg_file, const std::string& sets, const std::string& log, bool ok) {
  return launch_ranks(2, cfg_file, sets, log, ok);
}

// The settings of the two-rank runs (one image per rank and step, a constant rate whatever
// train.steps says, no samples) applied to `c`, which is written to dir/cfg/config.toml; its path.
std::string two_rank_config(fd::FinetuneConfig& c, const fs::path& dir) {
  c.sample.prompts.clear();
  c.train.batch_size = 1;
  c.optimizer.scheduler = "constant";
  c.optimizer.warmup_steps = 0;
  fs::create_directories(dir / "cfg");
  return fd::save_finetune_config(c, (dir / "cfg").string());
}

// The checkpoint of step 2 of run folder `from` resumed in one process (on the CPU) into run folder
// `to`, up to step `steps`.
fd::FinetuneRunResult resume_in_one_process(const fd::FinetuneConfig& c, const fs::path& from, const fs::path& to,
                                            int64_t steps) {
  fs::create_directories(to / "checkpoints");
  fs::copy_file(from / "checkpoints" / "ckpt-0000000002.safetensors", to / "checkpoints" / "ckpt-0000000002.safetensors");
  fd::FinetuneConfig one = c;
  one.output.dir = to.string();
  one.train.steps = steps;
  one.checkpoint.resume = "latest";
  return fd::run_finetune({.config = one, .device = flame::Device::cpu(), .overwrite = false, .stop_after = 0,
                           .log = [](const std::string&) {}});
}

std::vector<std::string> csv_rows(const fs::path& csv) {
  std::ifstream f(csv);
  std::vector<std::string> rows;
  for (std::string line; std::getline(f, line);) rows.push_back(line);
  return rows;
}

// The loss of every step in a run folder's loss.csv (step, loss, ...).
std::vector<double> run_losses(const fs::path& run) {
  std::vector<double> out;
  const auto rows = csv_rows(run / "loss.csv");
  for (std::size_t i = 1; i < rows.size(); ++i) out.push_back(std::stod(rows[i].substr(rows[i].find(',') + 1)));
  return out;
}

// Two ranks under flame-run (the tcp backend, on the CPU; Note [Distributed fine-tuning]): each
// trains on its share of every epoch with ZeRO-2, rank 0 alone writes the run's files, and a run
// stopped after 2 steps and resumed on 2 ranks ends with the adapters of the uninterrupted one.
TEST(FinetuneRun, TwoRanksTrainTheirSharesAndResumeExactly) {
  const fs::path dir = fd_test::fresh_temp_dir("finetune_run", "ranks");
  const fs::path images = make_images(dir);
  fd::FinetuneConfig c = tiny_config("flux", images, dir / "a");
  c.checkpoint.lora_format = "peft";
  const std::string cfg_file = two_rank_config(c, dir);
  const auto launch = [&](const std::string& sets, const std::string& log, bool ok = true) {
    return launch_two_ranks(cfg_file, sets, log, ok);
  };
  const std::string a = launch("--set train.steps=4", (dir / "a.log").string());
  EXPECT_NE(a.find("2 ranks"), std::string::npos) << a;
  const std::string b_out = "--set output.dir=" + (dir / "b").string();
  (void)launch(b_out + " --set train.steps=2", (dir / "b1.log").string());
  const std::string b = launch(b_out + " --set train.steps=4 --set checkpoint.resume=latest", (dir / "b2.log").string());
  EXPECT_NE(b.find("resumed from"), std::string::npos) << b;
  const auto la = csv_rows(dir / "a" / "loss.csv"), lb = csv_rows(dir / "b" / "loss.csv");
  ASSERT_EQ(la.size(), 5u);  // the header and one row per step, written by rank 0 alone
  EXPECT_EQ(la, lb);
  const flame::StateDict wa = flame::io::load_safetensors((dir / "a" / "shapes.safetensors").string());
  const flame::StateDict wb = flame::io::load_safetensors((dir / "b" / "shapes.safetensors").string());
  ASSERT_EQ(wa.keys(), wb.keys());
  ASSERT_FALSE(wa.keys().empty());
  for (const std::string& k : wa.keys())
    EXPECT_EQ(wa.at(k).to_vec<float>(), wb.at(k).to_vec<float>()) << k;
  // AdamW8bit's state sharded too (Note [ZeRO 8-bit state]): a run stopped after 2 steps and resumed
  // ends as the uninterrupted one (the tiny adapters' shards are under min_8bit_size: f32 moments,
  // so exactly).
  const std::string e8 = "--set optimizer.type=adamw8bit --set output.dir=";
  (void)launch(e8 + (dir / "e").string() + " --set train.steps=4", (dir / "e.log").string());
  (void)launch(e8 + (dir / "f").string() + " --set train.steps=2", (dir / "f1.log").string());
  const std::string f = launch(e8 + (dir / "f").string() + " --set train.steps=4 --set checkpoint.resume=latest",
                               (dir / "f2.log").string());
  EXPECT_NE(f.find("resumed from"), std::string::npos) << f;
  EXPECT_EQ(csv_rows(dir / "e" / "loss.csv"), csv_rows(dir / "f" / "loss.csv"));
  EXPECT_EQ(csv_rows(dir / "e" / "loss.csv").size(), 5u);
  // The two-rank checkpoint of step 2 goes on in one process (its optimizer state gathered whole,
  // the data position read per rank).
  const fd::FinetuneRunResult r = resume_in_one_process(c, dir / "b", dir / "c", 4);
  EXPECT_EQ(r.first_step, 2);
  EXPECT_EQ(r.steps_done, 4);
  ASSERT_EQ(r.losses.size(), 2u);
  for (double l : r.losses) EXPECT_TRUE(std::isfinite(l)) << l;
}

// Full fine-tuning of FLUX on two ranks: train.zero_stage 3 (the default there) shards the
// transformer's blocks and gathers each for its forward and recomputed backward; it trains as
// stage 2 does (same losses and weights; stage 2 in small buckets, train.zero_bucket_mb), its checkpoint gathers the weights and a resumed run ends
// where the uninterrupted one did. With train.ema the EMA of the shards (ZeroOptions::ema) gives the
// written model stage 2's EMA of the whole weights gives, checkpointed with the optimizer state.
TEST(FinetuneRun, TwoRanksFullFineTuningShardsTheBlocks) {
  for (bool ema : {false, true}) {
    SCOPED_TRACE(ema ? "train.ema" : "no EMA");
    const fs::path dir = fd_test::fresh_temp_dir("finetune_run", ema ? "zero3ema" : "zero3");
    const fs::path images = make_images(dir);
    fd::FinetuneConfig c = tiny_config("flux", images, dir / "s3");
    c.train.method = "full";
    c.checkpoint.optimizer_state = "consolidated";  // read below, and resumed in one process
    c.train.ema = ema;
    c.train.ema_decay = 0.5;
    c.optimizer.lr = 1e-3;
    const std::string cfg_file = two_rank_config(c, dir);
    const std::string s3 = launch_two_ranks(cfg_file, "--set train.steps=4", (dir / "s3.log").string(), true);
    EXPECT_NE(s3.find("ZeRO stage 3 over 2 ranks"), std::string::npos) << s3;
    // Stage 2 in buckets of 10 KiB (many per block): the same losses and weights.
    const std::string s2 = launch_two_ranks(
        cfg_file, "--set train.steps=4 --set train.zero_stage=2 --set train.zero_bucket_mb=0.01 --set output.dir=" +
                      (dir / "s2").string(),
        (dir / "s2.log").string(), true);
    EXPECT_NE(s2.find("ZeRO stage 2 over 2 ranks, buckets of 0.01 MiB"), std::string::npos) << s2;
    const std::string out = "--set output.dir=" + (dir / "r3").string();
    (void)launch_two_ranks(cfg_file, out + " --set train.steps=2", (dir / "r3a.log").string(), true);
    (void)launch_two_ranks(cfg_file, out + " --set train.steps=4 --set checkpoint.resume=latest",
                           (dir / "r3b.log").string(), true);
    if (ema) {  // the same run without the average, to tell them apart
      (void)launch_two_ranks(cfg_file, "--set train.steps=4 --set train.ema=false --set output.dir=" + (dir / "plain").string(),
                             (dir / "plain.log").string(), true);
    }
    const auto rows3 = csv_rows(dir / "s3" / "loss.csv");
    ASSERT_EQ(rows3.size(), 5u);
    EXPECT_EQ(rows3, csv_rows(dir / "r3" / "loss.csv"));
    const auto weights = [&](const std::string& run) {
      return flame::io::load_safetensors((dir / run / "shapes" / "diffusion_pytorch_model.safetensors").string());
    };
    const flame::StateDict w3 = weights("s3"), w2 = weights("s2"), wr = weights("r3");
    const flame::StateDict wp = ema ? weights("plain") : w3;
    ASSERT_EQ(w3.keys(), w2.keys());
    ASSERT_EQ(w3.keys(), wr.keys());
    const auto rows2 = csv_rows(dir / "s2" / "loss.csv");
    ASSERT_EQ(rows2.size(), rows3.size());
    for (std::size_t i = 1; i < rows3.size(); ++i) {  // step, loss, lr, grad norm
      const double l3 = std::stod(rows3[i].substr(rows3[i].find(',') + 1));
      const double l2 = std::stod(rows2[i].substr(rows2[i].find(',') + 1));
      EXPECT_NEAR(l3, l2, 1e-5 * std::abs(l2)) << rows3[i] << " vs " << rows2[i];
    }
    double from_plain = 0;
    for (const std::string& k : w3.keys()) {
      const auto a = w3.at(k).to(flame::DType::f32).to_vec<float>(), b = w2.at(k).to(flame::DType::f32).to_vec<float>();
      const auto r = wr.at(k).to(flame::DType::f32).to_vec<float>(), p = wp.at(k).to(flame::DType::f32).to_vec<float>();
      for (std::size_t i = 0; i < a.size(); ++i) {
        ASSERT_NEAR(a[i], b[i], 1e-5 + 1e-5 * std::abs(b[i])) << k << "[" << i << "]: stage 3 vs stage 2";
        ASSERT_EQ(a[i], r[i]) << k << "[" << i << "]: resumed";
        from_plain = std::max(from_plain, static_cast<double>(std::abs(a[i] - p[i])));
      }
    }
    if (ema) {
      EXPECT_GT(from_plain, 1e-4) << "the written model is not the average";
      // The checkpoint carries the average with the optimizer state, whole.
      const flame::StateDict ck =
          flame::io::load_safetensors((dir / "s3" / "checkpoints" / "ckpt-0000000004.safetensors").string());
      EXPECT_TRUE(ck.contains("optimizer.ema.num_updates"));
      EXPECT_TRUE(ck.contains("optimizer.state.0.ema"));
      // Note [EMA across modes]: a ZeRO-2 run's checkpoint of step 2 (an optim::EMA's "ema"
      // component) goes on under ZeRO-3 and ends at the uninterrupted run's average; the ZeRO-3
      // checkpoint of step 2 (the average in the optimizer's slots) resumes in one process, whose
      // optim::EMA takes it: with no step left, the model it writes is the ZeRO-2 run's average of
      // step 2. (One process trains on other batches than two ranks, so its later steps differ.)
      const std::string xdir = "--set train.zero_stage=2 --set output.dir=" + (dir / "x").string();
      (void)launch_two_ranks(cfg_file, xdir + " --set train.steps=2", (dir / "xa.log").string(), true);
      const flame::StateDict wx2 = weights("x");
      (void)launch_two_ranks(cfg_file, "--set train.steps=4 --set checkpoint.resume=latest --set output.dir=" + (dir / "x").string(),
                             (dir / "xb.log").string(), true);
      const fd::FinetuneRunResult r1 = resume_in_one_process(c, dir / "r3", dir / "one", 2);
      EXPECT_EQ(r1.first_step, 2);
      const flame::StateDict w1 = weights("one"), wx = weights("x");
      for (const std::string& k : w3.keys()) {
        const auto a = w3.at(k).to(flame::DType::f32).to_vec<float>(), x = wx.at(k).to(flame::DType::f32).to_vec<float>();
        const auto o = w1.at(k).to(flame::DType::f32).to_vec<float>(), o2 = wx2.at(k).to(flame::DType::f32).to_vec<float>();
        for (std::size_t i = 0; i < a.size(); ++i) {
          ASSERT_NEAR(x[i], a[i], 1e-5 + 1e-5 * std::abs(a[i])) << k << "[" << i << "]: ZeRO-2 checkpoint under ZeRO-3";
          ASSERT_NEAR(o[i], o2[i], 1e-5 + 1e-5 * std::abs(o2[i])) << k << "[" << i << "]: ZeRO-3 checkpoint in one process";
        }
      }
    }
  }
}

// train.recompute_cheap and train.activation_offload_blocks (FLUX; on the CPU the offloaded tensors
// are clones): the same losses as without them; SDXL refuses the offload, naming the key.
TEST(FinetuneRun, MemoryControlsTrainAsWithout) {
  const fs::path dir = fd_test::fresh_temp_dir("finetune_run", "memctl");
  const fs::path images = make_images(dir);
  fd::FinetuneConfig c = tiny_config("flux", images, dir / "plain");
  c.sample.prompts.clear();
  c.train.steps = 3;
  (void)run(c);
  const std::vector<double> plain = run_losses(dir / "plain");
  ASSERT_EQ(plain.size(), 3u);
  for (int mode : {0, 1, 2}) {
    fd::FinetuneConfig m = c;
    m.output.dir = (dir / ("m" + std::to_string(mode))).string();
    m.train.recompute_cheap = mode != 1;
    if (mode >= 1) {
      m.train.activation_offload_blocks = mode == 1 ? 2 : -1;
      m.train.activation_offload_min_mib = 1e-3;  // the tiny model's tensors are small
    }
    std::vector<std::string> log;
    (void)fd::run_finetune({.config = m, .device = fd_test::test_device(), .log = [&](const std::string& l) { log.push_back(l); }});
    bool said = mode == 0;
    double moved_mib = 0;
    for (const std::string& l : log) {
      said |= l.find("offloaded to host memory") != std::string::npos;
      const auto at = l.find(" MiB of activations offloaded per step");
      if (at != std::string::npos) moved_mib = std::stod(l.substr(l.rfind(", ", at) + 2));
    }
    EXPECT_TRUE(said) << mode;
    EXPECT_EQ(moved_mib > 0, mode != 0) << "mode " << mode << ": " << moved_mib << " MiB offloaded per step";
    const std::vector<double> got = run_losses(m.output.dir);
    ASSERT_EQ(got.size(), plain.size()) << mode;
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], plain[i]) << "mode " << mode << " step " << i + 1;
  }
  fd::FinetuneConfig x = tiny_config("sdxl", images, dir / "sdxl");
  x.train.activation_offload_blocks = 2;
  EXPECT_NE(error_of([&] { fd::validate_finetune_config(x); }).find("train.activation_offload_blocks"), std::string::npos);
}

// optimizer.offload: the optimizer's state in host memory (one process: offload::HostOptimizer; two
// ranks: ZeRO's offload_state) trains as the state on the device does: the same losses and weights,
// and a run resumed with the setting ends where the uninterrupted one did.
TEST(FinetuneRun, OptimizerOffloadTrainsAsOnTheDevice) {
  const fs::path dir = fd_test::fresh_temp_dir("finetune_run", "optoff");
  const fs::path images = make_images(dir);
  {  // one process, LoRA
    fd::FinetuneConfig c = tiny_config("flux", images, dir / "dev");
    c.sample.prompts.clear();
    (void)run(c);
    c.optimizer.offload = true;
    c.output.dir = (dir / "host").string();
    (void)run(c, 2);
    c.checkpoint.resume = "latest";
    (void)run(c);
    const auto a = run_losses(dir / "dev"), b = run_losses(dir / "host");
    ASSERT_EQ(a.size(), 4u);
    ASSERT_EQ(b.size(), a.size());
    for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-6 * std::abs(a[i])) << "step " << i + 1;
  }
  {  // two ranks, full fine-tuning under ZeRO-3
    fd::FinetuneConfig c = tiny_config("flux", images, dir / "z3dev");
    c.train.method = "full";
    c.optimizer.lr = 1e-3;
    const std::string cfg_file = two_rank_config(c, dir);
    (void)launch_two_ranks(cfg_file, "--set train.steps=3", (dir / "z3dev.log").string(), true);
    const std::string log = launch_two_ranks(
        cfg_file, "--set train.steps=3 --set optimizer.offload=true --set output.dir=" + (dir / "z3host").string(),
        (dir / "z3host.log").string(), true);
    EXPECT_NE(log.find("the optimizer state in host memory"), std::string::npos) << log;
    const auto a = run_losses(dir / "z3dev"), b = run_losses(dir / "z3host");
    ASSERT_EQ(a.size(), 3u);
    ASSERT_EQ(b.size(), a.size());
    for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-6 * std::abs(a[i])) << "step " << i + 1;
    const flame::StateDict wa = flame::io::load_safetensors((dir / "z3dev" / "shapes" / "diffusion_pytorch_model.safetensors").string());
    const flame::StateDict wb = flame::io::load_safetensors((dir / "z3host" / "shapes" / "diffusion_pytorch_model.safetensors").string());
    ASSERT_EQ(wa.keys(), wb.keys());
    for (const std::string& k : wa.keys()) EXPECT_LE(max_diff(wa.at(k), wb.at(k)), 1e-6) << k;
  }
  {  // two ranks, a bf16 model: the host masters are the f32 masters the device state would hold, and a
     // checkpoint of a run with the state on the device resumes with it offloaded and ends the same
    fd::FinetuneConfig c = tiny_config("flux", images, dir / "b16dev");
    c.train.method = "full";
    c.checkpoint.optimizer_state = "consolidated";  // the checkpoints' states are compared below
    c.train.mixed_precision = "bf16";
    c.optimizer.lr = 1e-3;
    const std::string cfg_file = two_rank_config(c, dir);
    (void)launch_two_ranks(cfg_file, "--set train.steps=4", (dir / "b16dev.log").string(), true);
    const std::string out = "--set output.dir=" + (dir / "b16mix").string();
    (void)launch_two_ranks(cfg_file, out + " --set train.steps=2", (dir / "b16mix_a.log").string(), true);
    (void)launch_two_ranks(cfg_file, out + " --set train.steps=4 --set optimizer.offload=true --set checkpoint.resume=latest",
                           (dir / "b16mix_b.log").string(), true);
    const auto a = run_losses(dir / "b16dev"), b = run_losses(dir / "b16mix");
    ASSERT_EQ(a.size(), 4u);
    ASSERT_EQ(b.size(), a.size());
    for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-5 * std::abs(a[i])) << "step " << i + 1;
    const flame::StateDict ca = flame::io::load_safetensors((dir / "b16dev" / "checkpoints" / "ckpt-0000000004.safetensors").string());
    const flame::StateDict cb = flame::io::load_safetensors((dir / "b16mix" / "checkpoints" / "ckpt-0000000004.safetensors").string());
    ASSERT_EQ(ca.keys(), cb.keys()) << "the same consolidated state with the optimizer state offloaded";
    for (const std::string& k : ca.keys()) {
      if (k.find("master_param") != std::string::npos || k.rfind("model.", 0) == 0)
        EXPECT_LE(max_diff(ca.at(k).to(flame::DType::f32), cb.at(k).to(flame::DType::f32)), 1e-6) << k;
    }
  }
}

// Note [Sharded optimizer checkpoints]: full fine-tuning under ZeRO-3 checkpoints its optimizer state
// as one file per rank beside the checkpoint (checkpoint.optimizer_state auto). A run stopped after 2
// steps and resumed on two ranks ends as the uninterrupted one (same losses, same bits); the same
// checkpoint resumes on three ranks; one process refuses it naming the shard files; rotation keeps
// each folder with its file.
TEST(FinetuneRun, FullFineTuningShardsItsOptimizerCheckpointAndResumesOnAnyRankCount) {
  const fs::path dir = fd_test::fresh_temp_dir("finetune_run", "shardckpt");
  const fs::path images = make_images(dir);
  fd::FinetuneConfig c = tiny_config("flux", images, dir / "a");
  c.train.method = "full";
  c.train.mixed_precision = "bf16";
  c.optimizer.lr = 1e-3;
  c.checkpoint.every = 1;
  c.checkpoint.keep = 2;
  const std::string cfg_file = two_rank_config(c, dir);
  (void)launch_two_ranks(cfg_file, "--set train.steps=4", (dir / "a.log").string(), true);
  const fs::path ck = dir / "a" / "checkpoints";
  EXPECT_TRUE(fs::exists(ck / "ckpt-0000000004.optimizer" / "optimizer-rank0-of-2.safetensors"));
  EXPECT_TRUE(fs::exists(ck / "ckpt-0000000004.optimizer" / "optimizer-rank1-of-2.safetensors"));
  EXPECT_TRUE(fs::exists(ck / "ckpt-0000000003.optimizer"));
  EXPECT_FALSE(fs::exists(ck / "ckpt-0000000002.optimizer")) << "rotated away with its file";
  const flame::StateDict file = flame::io::load_safetensors((ck / "ckpt-0000000004.safetensors").string());
  EXPECT_TRUE(file.contains("optimizer.sharded_state"));
  for (const std::string& k : file.keys()) EXPECT_EQ(k.find("exp_avg"), std::string::npos) << k << " in the file";
  const std::string b = "--set output.dir=" + (dir / "b").string();
  (void)launch_two_ranks(cfg_file, b + " --set train.steps=2", (dir / "b1.log").string(), true);
  // The step-2 checkpoint (file and folder), for the three ranks below.
  fs::create_directories(dir / "t" / "checkpoints");
  fs::copy_file(dir / "b" / "checkpoints" / "ckpt-0000000002.safetensors",
                dir / "t" / "checkpoints" / "ckpt-0000000002.safetensors");
  fs::copy(dir / "b" / "checkpoints" / "ckpt-0000000002.optimizer", dir / "t" / "checkpoints" / "ckpt-0000000002.optimizer");
  const std::string resumed = launch_two_ranks(cfg_file, b + " --set train.steps=4 --set checkpoint.resume=latest",
                                               (dir / "b2.log").string(), true);
  EXPECT_NE(resumed.find("resumed from"), std::string::npos) << resumed;
  EXPECT_EQ(csv_rows(dir / "a" / "loss.csv"), csv_rows(dir / "b" / "loss.csv"));
  const auto weights = [&](const std::string& run) {
    return flame::io::load_safetensors((dir / run / "shapes" / "diffusion_pytorch_model.safetensors").string());
  };
  const flame::StateDict wa = weights("a"), wb = weights("b");
  ASSERT_EQ(wa.keys(), wb.keys());
  for (const std::string& k : wa.keys())
    EXPECT_EQ(wa.at(k).to(flame::DType::f32).to_vec<float>(), wb.at(k).to(flame::DType::f32).to_vec<float>()) << k;
  // One process cannot take it, and says where the state is.
  const std::string err = error_of([&] { (void)resume_in_one_process(c, dir / "t", dir / "one", 3); });
  EXPECT_NE(err.find("shard files"), std::string::npos) << err;
  EXPECT_NE(err.find("ckpt-0000000002.safetensors"), std::string::npos) << err;
  // The step-2 checkpoint of two ranks on three, which save theirs consolidated (a ZeRO run reads
  // shard files whatever its own setting).
  const std::string three = launch_ranks(3, cfg_file, "--set output.dir=" + (dir / "t").string() +
                                                           " --set train.steps=3 --set checkpoint.resume=latest"
                                                           " --set checkpoint.optimizer_state=consolidated",
                                         (dir / "t.log").string(), true);
  EXPECT_NE(three.find("resumed from"), std::string::npos) << three;
  EXPECT_EQ(run_losses(dir / "t").size(), 1u) << "step 3 only: the run went on from step 2";
  EXPECT_TRUE(flame::io::load_safetensors((dir / "t" / "checkpoints" / "ckpt-0000000003.safetensors").string())
                  .contains("optimizer.state.0.exp_avg"));
  EXPECT_FALSE(fs::exists(dir / "t" / "checkpoints" / "ckpt-0000000003.optimizer"));
  // Without ZeRO the setting is refused by name.
  fd::FinetuneConfig one = c;
  one.output.dir = (dir / "single").string();
  one.checkpoint.optimizer_state = "sharded";
  EXPECT_NE(error_of([&] { (void)run(one, 1); }).find("checkpoint.optimizer_state"), std::string::npos);
}

// Full fine-tuning of SD3 on two ranks: ZeRO-3 over its joint blocks (train.zero_stage 3, the
// default for full SD3) trains as stage 2 does, with the same losses and written weights.
TEST(FinetuneRun, TwoRanksFullFineTuningOfSD3ShardsItsBlocks) {
  const fs::path dir = fd_test::fresh_temp_dir("finetune_run", "sd3zero3");
  const fs::path images = make_images(dir);
  fd::FinetuneConfig c = uncached_config("sd3", images, dir / "s3", 3);
  c.dataset.bucketing = false;  // the tiny SD3.5's position table covers 64 x 64 pixels
  c.dataset.max_upscale = 2.0;
  c.train.method = "full";
  c.checkpoint.optimizer_state = "consolidated";
  c.optimizer.lr = 1e-3;
  const std::string cfg_file = two_rank_config(c, dir);
  const std::string s3 = launch_two_ranks(cfg_file, "", (dir / "s3.log").string(), true);
  EXPECT_NE(s3.find("ZeRO stage 3 over 2 ranks"), std::string::npos) << s3;
  (void)launch_two_ranks(cfg_file, "--set train.zero_stage=2 --set output.dir=" + (dir / "s2").string(),
                         (dir / "s2.log").string(), true);
  const auto l3 = run_losses(dir / "s3"), l2 = run_losses(dir / "s2");
  ASSERT_EQ(l3.size(), 3u);
  ASSERT_EQ(l2.size(), l3.size());
  for (std::size_t i = 0; i < l3.size(); ++i) EXPECT_NEAR(l3[i], l2[i], 1e-5 * std::abs(l2[i])) << "step " << i + 1;
  const auto weights = [&](const std::string& run) {
    return flame::io::load_safetensors((dir / run / "shapes" / "diffusion_pytorch_model.safetensors").string());
  };
  const flame::StateDict w3 = weights("s3"), w2 = weights("s2");
  ASSERT_EQ(w3.keys(), w2.keys());
  const flame::StateDict base =
      flame::io::load_safetensors((pipelines_dir() / "sd3" / "transformer" / "diffusion_pytorch_model.safetensors").string());
  double moved = 0;
  for (const std::string& k : w3.keys()) {
    EXPECT_LE(max_diff(w3.at(k), w2.at(k)), 1e-5) << k << ": stage 3 vs stage 2";
    if (base.contains(k)) moved = std::max(moved, max_diff(w3.at(k).to(flame::DType::f32), base.at(k).to(flame::DType::f32)));
  }
  EXPECT_GT(moved, 1e-4) << "the transformer's weights did not train";
}

// Full fine-tuning of a bf16 FLUX on two ranks (ZeRO-3): the optimizer keeps f32 master weights of
// its bf16 shards (optim's master_weights), sharded with its moments, and the checkpoint gathers
// them. Each weight is its master rounded to bf16, and updates under half a bf16 step accumulate in
// the master instead of being lost.
TEST(FinetuneRun, TwoRanksFullFineTuningOfBf16KeepsF32MasterShards) {
  const fs::path dir = fd_test::fresh_temp_dir("finetune_run", "master");
  const fs::path images = make_images(dir);
  fd::FinetuneConfig c = tiny_config("flux", images, dir / "run");
  c.train.method = "full";
  c.checkpoint.optimizer_state = "consolidated";  // the masters are read from the checkpoint file
  c.train.mixed_precision = "bf16";
  c.optimizer.lr = 1e-4;
  c.optimizer.grad_clip = 0;
  c.checkpoint.every = 3;
  const std::string cfg_file = two_rank_config(c, dir);
  const std::string log = launch_two_ranks(cfg_file, "--set train.steps=3", (dir / "run.log").string(), true);
  EXPECT_NE(log.find("ZeRO stage 3 over 2 ranks"), std::string::npos) << log;
  const flame::StateDict base =
      flame::io::load_safetensors((pipelines_dir() / "flux" / "transformer" / "diffusion_pytorch_model.safetensors").string());
  const flame::StateDict ck =
      flame::io::load_safetensors((dir / "run" / "checkpoints" / "ckpt-0000000003.safetensors").string());
  const flame::StateDict written =
      flame::io::load_safetensors((dir / "run" / "shapes" / "diffusion_pytorch_model.safetensors").string());
  // The optimizer's parameters are the model's, in order (state i: the i-th of model.parameters()).
  std::vector<std::string> names;
  for (const std::string& k : ck.keys()) {
    if (k.rfind("model.", 0) == 0) names.push_back(k.substr(6));
  }
  ASSERT_EQ(names.size(), written.keys().size());
  int64_t kept_in_master = 0, masters = 0;
  for (std::size_t p = 0; p < names.size(); ++p) {
    const std::string m = "optimizer.state." + std::to_string(p) + ".master_param";
    if (!ck.contains(m)) continue;  // a parameter with no gradient yet has no state
    ++masters;
    const Tensor weight = ck.at("model." + names[p]);
    ASSERT_EQ(weight.dtype(), flame::DType::bf16) << names[p];
    ASSERT_EQ(ck.at(m).dtype(), flame::DType::f32) << m;
    ASSERT_EQ(ck.at(m).sizes(), weight.sizes()) << m << ": gathered whole";
    const auto master = ck.at(m).to_vec<float>();
    const auto w = weight.to(flame::DType::f32).to_vec<float>();
    const auto rounded = ck.at(m).to(flame::DType::bf16).to(flame::DType::f32).to_vec<float>();
    const auto b = base.at(names[p]).to(flame::DType::bf16).to(flame::DType::f32).to_vec<float>();
    for (std::size_t i = 0; i < w.size(); ++i) {
      ASSERT_EQ(w[i], rounded[i]) << names[p] << "[" << i << "]: the weight is its master rounded";
      kept_in_master += w[i] == b[i] && master[i] != b[i];
    }
  }
  EXPECT_GT(masters, static_cast<int64_t>(names.size()) / 2);
  EXPECT_GT(kept_in_master, 0) << "no update under half a bf16 step was kept in the master weights";
}
#endif

// train.method full (a diffusers model folder that the pipeline loads in place of its UNet), LoKr and
// DoRA adapters, and the EMA of the trained weights written at the end.
TEST(FinetuneRun, FullLokrDoraAndEma) {
  const fs::path dir = fd_test::fresh_temp_dir("finetune_run", "methods");
  const fs::path images = make_images(dir);
  fd::FinetuneConfig c = tiny_config("sdxl", images, dir / "full");
  c.sample.prompts.clear();
  c.train.steps = 2;
  c.train.method = "full";
  c.optimizer.lr = 1e-2;
  const fd::FinetuneRunResult full = run(c);
  ASSERT_EQ(full.lora_files.size(), 1u);
  EXPECT_TRUE(fs::exists(fs::path(full.lora_files[0]) / "config.json"));
  auto tuned = fm::load_pipeline({.path = (pipelines_dir() / "sdxl").string(), .denoiser = full.lora_files[0],
                                  .device = fd_test::test_device()});
  fm::GenerateOptions g;
  g.prompts = {"a red circle"};
  g.steps = 2;
  g.width = g.height = 64;
  g.guidance = 1.0;
  g.seed = 3;
  EXPECT_GT(max_diff(fm::generate(*tuned, g), sample("sdxl", "")), 1e-5);

  // LoKr: a LyCORIS kohya file that loads back into the pipeline and changes its images.
  {
    fd::FinetuneConfig k = tiny_config("sdxl", images, dir / "lokr");
    k.sample.prompts.clear();
    k.train.steps = 2;
    k.train.method = "lokr";
    k.lora.rank = 2;
    k.checkpoint.lora_format = "kohya";
    const fd::FinetuneRunResult r = run(k);
    ASSERT_EQ(r.lora_files.size(), 1u);
    bool lokr_keys = false;
    for (const auto& [key, t] : flame::io::load_safetensors(r.lora_files[0])) lokr_keys |= key.find(".lokr_w") != std::string::npos;
    EXPECT_TRUE(lokr_keys);
    EXPECT_GT(max_diff(sample("sdxl", r.lora_files[0]), sample("sdxl", "")), 1e-6);
  }

  // DoRA with EMA: the file holds the EMA of the adapters, which moves slower than the adapters.
  for (const bool ema : {false, true}) {
    fd::FinetuneConfig d = tiny_config("sdxl", images, dir / (ema ? "dora_ema" : "dora"));
    d.sample.prompts.clear();
    d.train.steps = 3;
    d.train.method = "dora";
    d.train.ema = ema;
    d.train.ema_decay = 0.5;
    d.checkpoint.lora_format = "peft";
    const fd::FinetuneRunResult r = run(d);
    ASSERT_EQ(r.lora_files.size(), 1u);
    const flame::StateDict sd = flame::io::load_safetensors(r.lora_files[0]);
    bool magnitude = false;
    for (const auto& [k, t] : sd) magnitude |= k.find("lora_magnitude_vector") != std::string::npos;
    EXPECT_TRUE(magnitude);
  }
  const flame::StateDict plain = flame::io::load_safetensors((dir / "dora" / "shapes.safetensors").string());
  const flame::StateDict averaged = flame::io::load_safetensors((dir / "dora_ema" / "shapes.safetensors").string());
  double moved = 0;
  for (const auto& [k, t] : plain) moved = std::max(moved, max_diff(t, averaged.at(k)));
  EXPECT_GT(moved, 0.0);  // same run, same steps: only the EMA differs
}

}  // namespace
