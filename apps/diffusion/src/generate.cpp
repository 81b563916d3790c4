#include "generate.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <sstream>

#include "cli_checks.h"
#include "models/pipelines.h"
#include "plot.h"
#include "trainer.h"

namespace flame_diffusion {

namespace fm = models;
using flame::DType;
using flame::Tensor;

namespace {

constexpr int kMaxCaptionLines = 4;

flame::DType parse_generate_dtype(const std::string& name, flame::Device device) {
  if (name == "auto") return device.is_cuda() ? DType::bf16 : DType::f32;
  if (name == "f32" || name == "float32") return DType::f32;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  if (name == "f16" || name == "float16") return DType::f16;
  throw UsageError("--dtype " + name + ": expected auto, f32, bf16 or f16");
}

// Words of `text` wrapped to lines of at most `width` characters (long words cut), at most
// kMaxCaptionLines lines, the last ending in "..." when text was left out.
std::vector<std::string> wrap(const std::string& text, std::size_t width) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  std::string word, line;
  bool cut = false;
  auto flush = [&] {
    if (lines.size() == kMaxCaptionLines) {
      cut = true;
    } else {
      lines.push_back(line);
    }
    line.clear();
  };
  while (in >> word) {
    while (word.size() > width) {
      if (!line.empty()) flush();
      line = word.substr(0, width);
      word = word.substr(width);
      flush();
    }
    if (!line.empty() && line.size() + 1 + word.size() > width) flush();
    line += (line.empty() ? "" : " ") + word;
  }
  if (!line.empty()) flush();
  if (cut && !lines.empty()) {
    std::string& last = lines.back();
    last = last.substr(0, width >= 3 ? std::min(last.size(), width - 3) : 0) + "...";
  }
  return lines;
}

}  // namespace

Image caption_grid(const Tensor& images, const std::vector<std::string>& captions, int cols) {
  FLAME_CHECK(images.dim() == 4 && images.size(1) == 3, "caption_grid", "images [N, 3, H, W] expected, got ",
              images.sizes());
  const int n = static_cast<int>(images.size(0)), h = static_cast<int>(images.size(2)),
            w = static_cast<int>(images.size(3));
  FLAME_CHECK(static_cast<int>(captions.size()) == n, "caption_grid", captions.size(), " captions for ", n, " images");
  cols = std::max(1, std::min(cols, n));
  const int rows = (n + cols - 1) / cols;
  const int scale = std::max(1, w / 256), pad = 4 * scale, line_h = 9 * scale;
  const auto chars = static_cast<std::size_t>(std::max(1, w / (6 * scale)));
  std::vector<std::vector<std::string>> lines(n);
  int max_lines = 1;
  for (int i = 0; i < n; ++i) {
    lines[i] = wrap(captions[i], chars);
    max_lines = std::max(max_lines, static_cast<int>(lines[i].size()));
  }
  const int cell_w = w + pad, cell_h = h + pad + max_lines * line_h + pad;
  Image grid(cols * cell_w + pad, rows * cell_h + pad, 3, 24);
  const std::vector<float> px = images.to(DType::f32).contiguous().to_vec<float>();
  for (int i = 0; i < n; ++i) {
    const int x0 = pad + (i % cols) * cell_w, y0 = pad + (i / cols) * cell_h;
    for (int y = 0; y < h; ++y) {
      for (int x = 0; x < w; ++x) {
        uint8_t* dst = grid.at(x0 + x, y0 + y);
        for (int c = 0; c < 3; ++c) {
          const float v = px[((static_cast<std::size_t>(i) * 3 + c) * h + y) * w + x];
          dst[c] = to_pixel(v * 2.0f - 1.0f);
        }
      }
    }
    for (std::size_t l = 0; l < lines[i].size(); ++l) {
      draw_text(grid, x0, y0 + h + pad + static_cast<int>(l) * line_h, lines[i][l], Rgb{235, 235, 235}, scale);
    }
  }
  return grid;
}

void add_generate_flags(CLI::App* cmd, GenerateConfig& c) {
  cmd->add_option("--model", c.model,
                  "diffusers pipeline folder (model_index.json, scheduler/, tokenizer*/, text_encoder*/, vae/, "
                  "transformer/ or unet/)")
      ->required();
  cmd->add_option("--family", c.family, "flux, sd3 or sdxl (default: model_index.json's pipeline class)");
  cmd->add_option("--transformer", c.transformer, "FLUX / SD3 transformer single file replacing the folder's");
  cmd->add_option("--unet", c.unet, "SDXL UNet single file replacing the folder's");
  cmd->add_option("--vae", c.vae, "VAE single file replacing the folder's");
  cmd->add_option("--clip-l", c.clip_l, "CLIP-L single file replacing text_encoder/");
  cmd->add_option("--clip-g", c.clip_g, "CLIP bigG single file replacing text_encoder_2/ (SD3, SDXL)");
  cmd->add_option("--t5", c.t5, "T5-XXL single file replacing the folder's T5 (FLUX, SD3)");
  cmd->add_option("--lora", c.lora, "LoRA file of the transformer / UNet (PEFT, diffusers or kohya layout)");
  cmd->add_option("--prompt", c.prompts, "a prompt (repeat for more; each is one row of the grid)")->required();
  cmd->add_option("--negative-prompt", c.negative_prompt,
                  "what to steer away from (SD3, SDXL; FLUX: with --cfg above 1, true CFG)");
  cmd->add_option("--steps", c.steps, "denoising steps (default 28 FLUX / SD3, 30 SDXL)")
      ->check(int_in("--steps", 1, 1000, "an integer from 1 to 1000"));
  cmd->add_option("--cfg", c.cfg,
                  "classifier-free guidance scale of SD3 / SDXL (default 7 / 5; 1: none); FLUX: true CFG "
                  "with --negative-prompt (diffusers' true_cfg_scale, e.g. 4; two passes per step)")
      ->check(real_in("--cfg", 0, 100, false, false, "a number from 0 to 100"));
  cmd->add_option("--guidance", c.guidance, "FLUX's guidance (default 3.5); for SD3 / SDXL the same as --cfg")
      ->check(real_in("--guidance", 0, 100, false, false, "a number from 0 to 100"));
  cmd->add_option("--sampler", c.sampler,
                  "SDXL: euler (default), euler-karras, euler-a, dpm++2m, dpm++2m-karras; FLUX / SD3: euler");
  cmd->add_option("--seed", c.seed, "seed of the initial noise")->capture_default_str()
      ->check(int_in("--seed", 0, std::numeric_limits<int64_t>::max(), "a non-negative integer"));
  cmd->add_option("--width", c.width, "image width in pixels (default 1024)")
      ->check(int_in("--width", 8, 16384, "an integer from 8 to 16384"));
  cmd->add_option("--height", c.height, "image height in pixels (default 1024)")
      ->check(int_in("--height", 8, 16384, "an integer from 8 to 16384"));
  cmd->add_option("--batch", c.batch, "images per prompt")->capture_default_str()
      ->check(int_in("--batch", 1, 64, "an integer from 1 to 64"));
  cmd->add_option("--max-sequence-length", c.max_sequence_length, "T5 tokens (default 512 FLUX, 256 SD3)")
      ->check(int_in("--max-sequence-length", 1, 512, "an integer from 1 to 512"));
  cmd->add_flag("--tiled-decode", c.tiled_decode, "decode with the VAE in tiles (automatic past 2048 pixels)");
  cmd->add_option("--out", c.out, "the grid: .png, or .jpg / .jpeg")->capture_default_str();
  cmd->add_option("--device", c.device, "auto, cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_option("--dtype", c.dtype, "auto (bf16 on CUDA, f32 on the CPU), f32, bf16 or f16")->capture_default_str();
  cmd->add_option("--fp8-base", c.fp8_base,
                  "the denoiser's Linear weights in 8 bits (e4m3, a scale per row): dequantize (half of bf16's "
                  "memory) or fp8 (also FP8 GEMMs on GPUs of compute capability 8.9+); none keeps them")
      ->capture_default_str();
}

void run_generate(GenerateConfig c, const CLI::App& cmd) {
  namespace fs = std::filesystem;
  c.has_negative_prompt = cmd.count("--negative-prompt") > 0;
  if (!fs::is_directory(c.model)) {
    throw UsageError("--model " + c.model + ": not a folder (a diffusers pipeline folder with model_index.json, "
                     "tokenizer/, text_encoder/, vae/ ...)");
  }
  for (const auto& [flag, path] : {std::pair<const char*, const std::string*>{"--transformer", &c.transformer},
                                   {"--unet", &c.unet}, {"--vae", &c.vae}, {"--clip-l", &c.clip_l},
                                   {"--clip-g", &c.clip_g}, {"--t5", &c.t5}, {"--lora", &c.lora}}) {
    if (!path->empty() && !fs::exists(*path)) throw UsageError(std::string(flag) + " " + *path + ": no such file");
  }
  try {
    check_output_image_path(c.out, "--out");
  } catch (const std::exception& e) {
    throw UsageError(e.what());
  }
  const flame::Device device = parse_device(c.device);
  fm::PipelineLoadOptions lo;
  lo.path = c.model;
  lo.family = c.family;
  lo.device = device;
  lo.dtype = parse_generate_dtype(c.dtype, device);
  lo.vae = c.vae;
  lo.text_encoder = c.clip_l;
  lo.text_encoder_2 = c.clip_g;
  lo.text_encoder_3 = c.t5;
  lo.lora = c.lora;
  if (c.fp8_base != "none") {
    if (c.fp8_base != "dequantize" && c.fp8_base != "fp8")
      throw UsageError("--fp8-base " + c.fp8_base + ": expected none, dequantize or fp8");
    lo.denoiser_float8 = flame::nn::Float8Options{.compute = flame::nn::parse_float8_compute(c.fp8_base)};
  }
  if (!c.family.empty()) {
    const auto fams = fm::pipeline_families();
    if (std::find(fams.begin(), fams.end(), c.family) == fams.end()) {
      throw UsageError("--family " + c.family + ": expected flux, sd3 or sdxl");
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::fprintf(stderr, "generate: loading %s on %s\n", c.model.c_str(), c.device.c_str());
  // The family decides which of --transformer / --unet applies; a mismatch is named after loading.
  const bool unet_given = !c.unet.empty(), transformer_given = !c.transformer.empty();
  if (unet_given && transformer_given) throw UsageError("--unet and --transformer: give the one of the family");
  lo.denoiser = unet_given ? c.unet : c.transformer;
  const std::shared_ptr<fm::Pipeline> pipe = fm::load_pipeline(lo);
  if (unet_given && pipe->family != "sdxl") throw UsageError("--unet: the " + pipe->family + " pipeline has a transformer; use --transformer");
  if (transformer_given && pipe->family == "sdxl") throw UsageError("--transformer: SDXL has a UNet; use --unet");
  if (lo.denoiser_float8 && pipe->unet) {  // FLUX and SD3 loaded in 8 bits; SDXL's UNet is quantised here
    pipe->unet->requires_grad_(false);
    (void)flame::nn::quantize_float8(*pipe->unet, *lo.denoiser_float8);
  }
  if (pipe->family != "flux" && cmd.count("--cfg") && cmd.count("--guidance") && c.cfg != c.guidance) {
    throw UsageError("--cfg " + std::to_string(c.cfg) + " and --guidance " + std::to_string(c.guidance) +
                     " disagree; give one (for " + pipe->family + " both are the CFG scale)");
  }
  // FLUX: --guidance is the guidance embedding; --cfg > 1 with a negative prompt is true CFG.
  const bool flux_cfg = pipe->family == "flux" && cmd.count("--cfg") && c.cfg > 1.0;
  if (pipe->family == "flux" && flux_cfg != c.has_negative_prompt) {
    throw UsageError(flux_cfg ? "--cfg " + std::to_string(c.cfg) +
                                    ": FLUX's true classifier-free guidance needs --negative-prompt (\"\" is one); "
                                    "--guidance sets its guidance embedding"
                              : std::string("--negative-prompt: FLUX uses a negative prompt only for true "
                                            "classifier-free guidance; give --cfg above 1 (e.g. 4) as well"));
  }
  if (!pipe->lora_skipped.empty()) {
    std::fprintf(stderr, "generate: %zu key(s) of %s not loaded (text encoder adapters), e.g. %s\n",
                 pipe->lora_skipped.size(), c.lora.c_str(), pipe->lora_skipped.front().c_str());
  }
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  fm::GenerateOptions o;
  o.prompts = c.prompts;
  if (c.has_negative_prompt) o.negative_prompt = c.negative_prompt;
  o.steps = c.steps;
  if (pipe->family == "flux") {
    o.guidance = c.guidance;
    if (flux_cfg) o.true_cfg_scale = c.cfg;
  } else {
    o.guidance = cmd.count("--cfg") ? c.cfg : c.guidance;
  }
  o.sampler = c.sampler;
  o.seed = c.seed;
  o.width = c.width;
  o.height = c.height;
  o.images_per_prompt = c.batch;
  o.max_sequence_length = c.max_sequence_length;
  o.tiled_decode = c.tiled_decode;
  try {
    o = fm::resolve_generate_options(*pipe, o);
  } catch (const flame::Error& e) {
    throw UsageError(e.what());  // a setting out of range for this family: a command-line mistake
  }
  std::fprintf(stderr, "generate: %s, %zu prompt(s) x %lld, %lldx%lld, %lld steps (%s), guidance %g, seed %llu (loaded in %.1f s)\n",
               pipe->family.c_str(), o.prompts.size(), static_cast<long long>(o.images_per_prompt),
               static_cast<long long>(o.width), static_cast<long long>(o.height), static_cast<long long>(o.steps),
               o.sampler.c_str(), o.guidance, static_cast<unsigned long long>(o.seed), load_s);
  const auto t1 = std::chrono::steady_clock::now();
  o.on_step = [&](int64_t step, int64_t steps) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    std::fprintf(stderr, "\rgenerate: step %lld/%lld (%.1f s)", static_cast<long long>(step),
                 static_cast<long long>(steps), s);
    if (step == steps) std::fprintf(stderr, "\n");
  };
  const Tensor images = fm::generate(*pipe, o);
  std::vector<std::string> captions;
  for (const std::string& p : o.prompts) {
    for (int64_t i = 0; i < o.images_per_prompt; ++i) captions.push_back(p);
  }
  write_image(c.out, caption_grid(images, captions, static_cast<int>(o.images_per_prompt)));
  std::printf("%s\n", c.out.c_str());
}

}  // namespace flame_diffusion
