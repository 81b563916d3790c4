#pragma once
// `flame-diffusion finetune --config lora.toml`: fine-tuning FLUX.1, SD3 / SD3.5 or SDXL from a folder
// of captioned images (Note [Fine-tuning runs] in finetune_run.cpp).
//
//   FinetuneConfig cfg = load_finetune_config("lora.toml", {"train.steps=2000"});
//   FinetuneRunResult r = run_finetune({.config = cfg, .device = Device::cuda()});
//   // r.lora_files: <output.dir>/<output.name>.safetensors (kohya) and/or ..._diffusers.safetensors
//
// Run folder (output.dir): config.toml (the whole configuration), cache/ (text embeddings and
// latents, unless cache.dir says elsewhere), checkpoints/ckpt-<step>.safetensors (adapters,
// optimizer, scheduler, EMA, random generator and data position: flame::Checkpoint), samples/
// step-<N>.png, loss.csv, and the LoRA files.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <flame/flame.h>

#include "train_config.h"

namespace flame_diffusion {

struct FinetuneRunOptions {
  FinetuneConfig config;
  flame::Device device = flame::Device::cpu();
  // A run folder that already holds a run (config.toml or checkpoints/) is refused unless the
  // configuration resumes (checkpoint.resume) or this is set: then its checkpoints, samples, loss
  // log and LoRA files are removed first (the caches are kept: they validate themselves).
  bool overwrite = false;
  // Stop (with a checkpoint, as after a signal) once this many optimizer steps have run in this
  // call (0: run to train.steps). Tests use it to interrupt and resume.
  int64_t stop_after = 0;
  // Progress lines (default: standard error).
  std::function<void(const std::string&)> log;
};

struct FinetuneRunResult {
  std::string run_dir;
  int64_t first_step = 0;       // the step this call started from (0, or the resumed checkpoint's)
  int64_t steps_done = 0;       // the step reached
  std::vector<double> losses;   // the loss of each optimizer step this call ran
  std::vector<std::string> lora_files;  // written at the end (empty when stopped early)
  std::vector<std::string> sample_files;
  std::string last_checkpoint;
  // The median wall time of an optimizer step and of its wait for the prefetched batch (warm-up
  // steps left out) and, on a GPU, the peak memory allocated while training (the model, adapters,
  // optimizer state and activations): after the first two steps, and over all steps.
  double median_step_seconds = 0;
  double median_data_wait_seconds = 0;
  std::size_t peak_memory_bytes = 0;
  std::size_t peak_memory_all_bytes = 0;
  std::string memory_plan;  // train.vram_budget_gib: what was swapped and checkpointed (models::BudgetPlan)
  int64_t text_cache_hits = 0, text_encoded = 0, latents_cached = 0, latents_encoded = 0;
};

// Runs the fine-tuning the configuration describes (Note [Fine-tuning runs]). Raises
// std::runtime_error / flame::Error naming the key, file or setting on bad input; a run already in
// output.dir without resume or overwrite is an error.
FinetuneRunResult run_finetune(const FinetuneRunOptions& options);

// The module-name patterns adapted when lora.targets is empty: the family's attention and
// feed-forward projections (diffusers' names).
std::vector<std::string> default_lora_targets(const std::string& family);

}  // namespace flame_diffusion
