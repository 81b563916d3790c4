#pragma once
// The training loop of flame-diffusion: train (a class-conditional diffusion model on
// Fashion-MNIST), finetune (LoRA adapters on a class subset, from a trained checkpoint) and sample
// (a class grid from a checkpoint). Built on FLAME's public API only: nn modules, AdamW, a learning
// rate schedule, EMA, bf16 autocast, gradient clipping and accumulation, atomic checkpoints.
#include <cstdint>
#include <string>
#include <vector>

#include "sampler.h"

namespace flame_diffusion {

struct TrainConfig {
  // Model and objective.
  std::string model = "dit-s";     // make_model preset
  std::string objective = "flow";  // make_objective: flow, ddpm-linear, ddpm-cosine
  // Optimisation.
  int64_t steps = 6000;
  int64_t batch = 256;  // per optimizer step: batch = micro-batch * accum
  int64_t accum = 1;    // gradient accumulation: micro-batches per step
  double lr = 1e-4;
  double weight_decay = 0.0;
  std::string schedule = "constant";  // constant or cosine (both after `warmup` linear steps)
  int64_t warmup = 0;
  double grad_clip = 1.0;  // max global L2 norm; <= 0: no clipping
  double ema_decay = 0.999;
  bool ema_warmup = true;  // decay min(ema_decay, (1 + step) / (10 + step))
  double label_dropout = 0.1;
  std::string amp = "auto";  // auto (bf16 on CUDA, off on CPU), bf16, f16, off
  // Data.
  std::string data_dir;               // empty: the usual places (find_data_dir)
  std::vector<int> classes;           // train only on these classes (empty: all)
  std::vector<int> exclude_classes;   // leave these classes out
  bool flip = true;
  // Runtime.
  std::string device = "auto";  // auto, cpu, cuda, cuda:N
  uint64_t seed = 0;
  std::string out = "runs/dit-s";
  // Note [Run directories] (run_dir.h): a run into an `out` that holds a run needs resume or overwrite.
  bool resume = false;     // continue from the newest checkpoint in <out>/checkpoints that loads
  bool overwrite = false;  // remove the previous run's files (only those the trainer writes) first
  int64_t log_every = 50;
  int64_t sample_every = 1000;  // 0: only at the end
  int64_t ckpt_every = 1000;    // 0: only at the end
  int keep_checkpoints = 3;
  double time_limit = 0;  // seconds; > 0 stops the run early (then samples and saves)
  bool progress_bar = true;
  // Capture the training step in a CUDA graph (CUDA only; not with accum > 1, which steps eagerly).
  bool compile = true;
  // DiT activation recompute (DiTRecomputeSpec): none, mlp, mlp:N or all. Less memory held between the
  // forward and the backward for a little more backward time (docs/recompute.md).
  std::string recompute = "none";
  // FLAME's short-sequence attention kernels instead of cuDNN's (flame::cuda::set_short_attention,
  // docs/nn-attention.md); the process-wide switch is turned on for the run.
  bool short_attention = false;
  // Sampling of the grids written during and after training.
  SampleOptions sampling{.sampler = SamplerKind::euler, .steps = 32, .cfg_scale = 2.0, .seed = 1234};
  int64_t samples_per_class = 10;
  // Evaluation at the end (optional): a classifier file (train_classifier) classifies
  // eval_per_class samples of every class; the run reports the fraction recognised as their class.
  std::string classifier;
  int64_t eval_per_class = 100;
  // Fine-tuning (finetune): the base checkpoint and the adapter.
  std::string base_checkpoint;
  int64_t lora_rank = 8;
  double lora_alpha = 8.0;
  std::vector<std::string> lora_targets;  // empty: the model family's defaults
};

// What `train` runs without --model on a machine without a GPU: the CPU demo's recipe
// (scripts/run_demo.sh); flags given on the command line keep their values.
// Chosen by measurement on 2 cores (apps/diffusion/README.md, "The CPU demo"): ~1100 steps in
// the 510 s limit, and the app classifier recognises ~79% of the grid's samples.
struct CpuRecipe {
  std::string model = "unet-tiny";
  int64_t batch = 32;
  double lr = 2e-3;
  int64_t warmup = 50;
  std::string schedule = "cosine";
  double ema_decay = 0.995;
  int64_t steps = 1200;
  double time_limit = 510;
  int64_t sample_every = 0;
  int64_t sample_steps = 16;
  double cfg_scale = 3.0;
};

// What a run did (also printed at its end).
struct TrainResult {
  int64_t steps_done = 0;
  double final_loss = 0;  // mean over the last log window
  double seconds = 0;
  double images_per_second = 0;
  int64_t peak_gpu_bytes = 0;
  int64_t graph_replays = 0;  // --compile: replays of the captured step (0: every step ran eagerly)
  std::string last_checkpoint, samples_png, loss_png, csv;
  double class_fraction = -1;  // with a classifier: samples recognised as their class (else -1)
};

// Progress and logs go to stderr; the results (the final paths, the recognised fraction) to stdout.
// A SIGINT / SIGTERM (stop_signal.h) ends the run after the current step with a checkpoint and
// raises Interrupted.
TrainResult train(const TrainConfig& config);
// LoRA fine-tuning: loads config.base_checkpoint (its EMA weights), adds adapters, trains them on
// config.classes, saves <out>/lora.safetensors and sample grids with the adapter applied.
TrainResult finetune(const TrainConfig& config);

struct SampleConfig {
  std::string checkpoint;    // a train or finetune checkpoint, or a plain weights file (export)
  std::string lora;          // optional adapter file (finetune's lora.safetensors)
  std::vector<int> classes;  // empty: all
  int64_t per_class = 10;
  SampleOptions sampling{.sampler = SamplerKind::euler, .steps = 32, .cfg_scale = 2.0, .seed = 1234};
  bool use_ema = true;
  std::string device = "auto";
  std::string out = "grid.png";  // .png, or .jpg / .jpeg (JPEG); its folder must exist
  int scale = 2;
  std::string classifier;  // optional: report the fraction of the grid recognised as its class
};
void sample_checkpoint(const SampleConfig& config);

// Writes a checkpoint's model weights (EMA by default) as a plain safetensors state dict with
// PyTorch's names and {"format": "pt", "model": preset, "objective": ...} metadata: the twin in
// reference/ loads it with load_state_dict(strict=True); sample/finetune accept such files too.
struct ExportConfig {
  std::string checkpoint;
  std::string out = "weights.safetensors";
  bool use_ema = true;
};
void export_weights(const ExportConfig& config);

// "auto" -> cuda:0 when a GPU is present, else cpu; "cpu", "cuda", "cuda:N".
flame::Device parse_device(const std::string& name);
// "0-9", "3", "1,4,7", "0-2,5" -> sorted unique class ids; errors name the text.
std::vector<int> parse_classes(const std::string& text, int num_classes = 10);

}  // namespace flame_diffusion
