#pragma once
// `flame-diffusion generate`: text-to-image with FLUX.1, SD3 / SD3.5 or SDXL (models/pipelines.h)
// into one PNG / JPEG grid with each image's prompt under it.
//
//   flame-diffusion generate --model /models/FLUX.1-dev --prompt "a red cat" --steps 28 --guidance 3.5
//       --width 1024 --height 1024 --seed 7 --batch 2 --out cats.png         (one command)
//
// Each prompt is one row of --batch images (seeds drawn from --seed). The pipeline folder gives the
// tokenizers and every component unless a single file replaces one (--transformer / --unet, --vae,
// --clip-l, --clip-g, --t5); --lora applies a LoRA file of the transformer / UNet (PEFT, diffusers
// or kohya layout); --fp8-base keeps the denoiser's Linear weights in 8 bits (docs/float8.md).
#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <flame/flame.h>

#include "png_image.h"

namespace flame_diffusion {

struct GenerateConfig {
  std::string family;  // "" : model_index.json's
  std::string model;   // the diffusers pipeline folder
  std::string transformer, unet, vae, clip_l, clip_g, t5;
  std::string lora;  // a LoRA file of the transformer / UNet
  std::vector<std::string> prompts;
  std::string negative_prompt;
  bool has_negative_prompt = false;
  int64_t steps = 0;
  double cfg = 0, guidance = 0;  // 0: the family's default
  std::string sampler;
  uint64_t seed = 0;
  int64_t width = 0, height = 0, batch = 1;
  int64_t max_sequence_length = 0;
  bool tiled_decode = false;
  std::string out = "grid.png";
  std::string device = "auto";  // auto, cpu, cuda, cuda:N
  std::string dtype = "auto";   // auto (bf16 on CUDA, f32 on the CPU), f32, bf16, f16
  std::string fp8_base = "none";  // none, dequantize or fp8: the denoiser's Linears in 8 bits
};

void add_generate_flags(CLI::App* cmd, GenerateConfig& c);
// Checks the flags that depend on each other (UsageError naming the flag), loads the pipeline,
// generates and writes the grid; progress on stderr, the written path on stdout.
void run_generate(GenerateConfig c, const CLI::App& cmd);

// Images [N, 3, H, W] in [0, 1], `cols` to a row, each with its caption under it (the built-in
// bitmap font, wrapped at word boundaries to the image width, at most 4 lines).
Image caption_grid(const flame::Tensor& images, const std::vector<std::string>& captions, int cols);

}  // namespace flame_diffusion
