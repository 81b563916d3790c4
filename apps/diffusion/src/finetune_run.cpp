// Note [Fine-tuning runs]
// run_finetune, in order:
// 1. The run folder: config.toml is written (after the checks of the configuration); a folder that
//    holds a run is refused unless checkpoint.resume is set or the caller overwrites.
// 2. The pipeline (models/pipelines.h) of model.checkpoint, a diffusers pipeline folder (it brings
//    the tokenizers and text encoders), in bf16 when train.mixed_precision is bf16, else f32;
//    model.vae replaces its VAE. The family must be model.family.
// 3. The data set (image_dataset.h): folders / manifest, buckets, transforms.
// 4. Caches (models/text_cache.h, the same validated per-key safetensors store for both):
//    - text: every caption the run can draw (the transformed captions: with caption dropout the
//      empty caption too; tag shuffling makes captions without end and is refused with the cache)
//      and the sample prompts, encoded once by encode_prompts; keyed by (caption, pipeline files'
//      sizes and mtimes, dtype, T5 length);
//    - latents: each image's VAE distribution (mean, logvar) at its bucket's crop, unflipped and,
//      when dataset.flip_p > 0, flipped; keyed by (file, size, mtime, bucket, crop, flip) and the
//      VAE's files, so a changed image or VAE is encoded again. A random crop makes every draw a new
//      window and is refused with the cache (as kohya's trainers do).
//    With both caches the text encoders are released before training (and the VAE when no samples
//    are asked for); without one, the encoders / VAE stay and encode each batch.
// 5. The denoiser: LoRA, DoRA or LoKr adapters in f32 on lora.targets (default_lora_targets), or every
//    weight trainable (train.method full); gradient checkpointing of every block.
// 6. AdamW (torch.optim.AdamW's update) or AdamW8bit (8-bit block-wise moments), the warmup + constant / linear / cosine
//    learning rate, gradient clipping, EMA of the trained weights.
// 7. Each optimizer step: train.grad_accum batches of one bucket each; a batch's latents are drawn
//    from the cached distribution (diffusers' latent_dist.sample()) or encoded, the noise and the
//    timesteps from one flame::Generator seeded by train.seed; the objectives of models/finetune.h:
//    flow matching for FLUX / SD3 (logit-normal or uniform u; FLUX's resolution-dependent shift
//    exp(flux_mu(tokens)) when train.shift is 0, SD3's 3.0; FLUX-dev's guidance input), DDPM for
//    SDXL (epsilon / v, min-SNR-gamma; time ids from each item's original size, crop and bucket).
//    bf16 autocast when mixed_precision is bf16. Batches are drawn and read from the caches one
//    ahead on a helper thread, and each step's loss comes back while the next one runs (Note [Step
//    pipelining]), so the GPU does not wait for the host between steps.
// 8. Every checkpoint.every steps a flame::Checkpoint (atomic; the newest checkpoint.keep kept);
//    every sample.every steps a grid of the sample prompts (captions under the images); a stop
//    signal or stop_after ends the run after a checkpoint. checkpoint.resume ("latest" or a file)
//    restores all of it, so a resumed run continues exactly where the stopped one was.
// 9. At the end: the LoRA file(s) (kohya and / or diffusers layout, models/lora_file.h; the EMA
//    weights when train.ema is on) with metadata (base model, family, rank, alpha, resolution, steps,
//    images), or for method full a diffusers model folder <output.name>/ (weights and config.json).
//
// Note [Distributed fine-tuning]
// Under flame-run (or torchrun / srun: WORLD_SIZE > 1) every rank runs run_finetune on its GPU
// (cuda:LOCAL_RANK; the tcp backend on the CPU):
//  - rank 0 alone checks and writes the run folder (config.toml, loss.csv, checkpoints, samples, the
//    LoRA files) and logs; the others wait for its checks at a barrier;
//  - the caches are filled together: each rank encodes every world-th key, then all check the whole
//    set;
//  - each rank trains on its share of every epoch (BucketBatchSampler: batches rank, rank + world,
//    ... of the epoch's list, with its own augmentation draws) and draws its noise and timesteps
//    from a generator seeded by (seed, rank, step), so train.batch_size is per rank and a resumed
//    run draws what the stopped one would have;
//  - optim::AdamW runs inside dist::ZeroRedundancyOptimizer stage 2: gradients are averaged over
//    the ranks (reduce-scattered while the backward runs) and they and the optimizer state are
//    sharded; rank 0's initial weights are broadcast; clipping takes the norm over the shards.
//    train.zero_stage 3 (chosen for full fine-tuning of FLUX and SD3) shards the transformer's
//    blocks too: each block runs through ZeRO's run_block (BlockStack::set_block_runner), gathered
//    for its forward and again for its recomputed backward; checkpoints, samples and the final
//    model gather the weights on every rank (collective), and a resumed checkpoint loads through
//    gathered parameters written back into the shards;
//  - each step all-reduces the loss (logged as the ranks' mean) with a stop flag, so a signal to any
//    rank stops all of them after the same step with a checkpoint;
//  - a checkpoint gathers the optimizer state on every rank (collective) and rank 0 writes it, so a
//    run resumes on any number of ranks.
//  - with a bf16 model the shards are bf16 and AdamW keeps f32 master weights of them (optim's
//    master_weights), sharded with its moments: bf16 compute over f32 master shards, as FSDP's
//    MixedPrecisionPolicy(param_dtype=bf16); checkpoints gather the masters too.
//  - train.ema with stage 3: the EMA of the shards (ZeroOptions::ema, Note [ZeRO EMA] in
//    src/dist/zero.cpp), checkpointed with the optimizer state; the written model is the average.
//  - optimizer.type = "adamw8bit": each rank's shards keep 8-bit moments; checkpoints hold them
//    per parameter, as one process's AdamW8bit (Note [ZeRO 8-bit state] in src/dist/zero.cpp).
// Not yet: train.vram_budget_gib's search (refused with several ranks), SDXL's UNet with stage 3.
#include "finetune_run.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>

#include <flame/amp.h>
#include <flame/checkpoint.h>
#include <flame/cuda.h>
#include <flame/dist.h>
#include <flame/io/safetensors.h>
#include <flame/nn.h>
#include <flame/offload.h>
#include <flame/optim.h>

#include "cli_checks.h"
#include "distributed.h"
#include "generate.h"
#include "image_dataset.h"
#include "models/finetune.h"
#include "models/lora_file.h"
#include "models/pipelines.h"
#include "models/text_cache.h"
#include "stop_signal.h"

namespace flame_diffusion {

namespace fs = std::filesystem;
namespace fm = models;
namespace nn = flame::nn;
namespace optim = flame::optim;
using flame::Device;
using flame::DType;
using flame::Tensor;

std::vector<std::string> default_lora_targets(const std::string& family) {
  if (family == "sdxl") return {"to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"};
  // FLUX and SD3 / SD3.5: the image and text streams' attention and feed-forward.
  return {"to_q",          "to_k",     "to_v",     "to_out.0",         "add_q_proj",           "add_k_proj",
          "add_v_proj",    "to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"};
}

namespace {

// Sizes and modification times of a file, or of every file under a folder (sorted): what the caches
// key their sources by.
std::string fingerprint(const std::string& path) {
  std::ostringstream s;
  auto one = [&](const fs::path& p) {
    std::error_code ec;
    const auto size = fs::file_size(p, ec);
    const auto mtime = fs::last_write_time(p, ec).time_since_epoch().count();
    s << p.lexically_normal().string() << ':' << size << ':' << mtime << ';';
  };
  if (fs::is_directory(path)) {
    std::vector<fs::path> files;
    for (const auto& e : fs::recursive_directory_iterator(path)) {
      if (e.is_regular_file()) files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    for (const auto& f : files) one(f);
  } else {
    one(path);
  }
  return s.str();
}

// The text encoders' files, as the text cache's identity: the pipeline's text_encoder* and
// tokenizer* folders and the files given instead.
std::string text_encoder_fingerprint(const FinetuneConfig& c, const std::string& pipeline) {
  std::string s;
  for (const char* sub : {"text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3"}) {
    const fs::path p = fs::path(pipeline) / sub;
    if (fs::exists(p)) s += fingerprint(p.string());
  }
  for (const std::string& f : {c.model.clip_l, c.model.clip_g, c.model.t5}) {
    if (!f.empty()) s += fingerprint(f);
  }
  return s;
}

// What a run leaves in its folder once it trained (a run that failed before its first step leaves
// only config.toml and the cache, and may simply be run again); --overwrite removes these and
// config.toml, never the cache.
std::vector<fs::path> run_outputs(const fs::path& dir, const std::string& name) {
  std::vector<fs::path> out;
  for (const char* p : {"checkpoints", "samples", "loss.csv"}) {
    if (fs::exists(dir / p)) out.push_back(dir / p);
  }
  for (const std::string& f : {name + ".safetensors", name + "_diffusers.safetensors"}) {
    if (fs::exists(dir / f)) out.push_back(dir / f);
  }
  return out;
}

// The trained tensors of the model as a checkpoint component: the adapters (LoRA / DoRA) by their
// PEFT names.
class AdapterState final : public flame::Stateful {
 public:
  explicit AdapterState(nn::Module& model) : model_(model) {}
  flame::StateDict state_dict() const override { return nn::lora_state_dict(model_); }
  void load_state_dict(const flame::StateDict& state) override { nn::load_lora_state_dict(model_, state, true); }

 private:
  nn::Module& model_;
};

// Note [EMA across modes]
// train.ema keeps its average in one of two places: an optim::EMA over the trained tensors (one
// process, or ZeRO-2), saved as the checkpoint's "ema" component; or, under ZeRO-3, the EMA of the
// shards inside the optimizer (ZeroOptions::ema), saved as the slots "state.<i>.ema" and
// "ema.num_updates" of the consolidated optimizer state. A checkpoint resumes in either mode: the
// optimizer's component moves the average between the two forms as it loads. Under ZeRO-3 the
// "ema" component is registered before the optimizer (empty when saved) so that an optim::EMA's
// state reaches the optimizer's slots; with an optim::EMA, the optimizer's slots are taken into it
// and the file's empty "ema" component is skipped. Both EMAs are over the optimizer's parameters
// in the same order (shadow i = the optimizer's parameter i).
class EmaSection final : public flame::Stateful {
 public:
  explicit EmaSection(optim::EMA* ema) : ema_(ema) {}
  flame::StateDict state_dict() const override { return ema_ ? ema_->state_dict() : flame::StateDict(); }
  void load_state_dict(const flame::StateDict& state) override {
    if (!ema_) {
      captured_ = state;  // ZeRO-3: for the optimizer's slots
      return;
    }
    if (state.empty() && taken_from_optimizer_) return;  // a ZeRO-3 checkpoint held it in the optimizer
    ema_->load_state_dict(state);
  }
  optim::EMA* ema() const { return ema_; }
  const flame::StateDict& captured() const { return captured_; }
  void set_taken_from_optimizer() { taken_from_optimizer_ = true; }
  bool taken_from_optimizer() const { return taken_from_optimizer_; }

 private:
  optim::EMA* ema_;
  flame::StateDict captured_;
  bool taken_from_optimizer_ = false;
};

// Note [Sharded optimizer checkpoints]
// checkpoint.optimizer_state = sharded (auto: for train.method full under ZeRO) keeps the
// optimizer's state out of the checkpoint file: a consolidated state is gathered whole on every GPU
// (FLUX-dev's f32 masters and moments are 143 GB) before rank 0 writes it. Instead every rank writes
// the state of its own shard with ZeroRedundancyOptimizer::save_sharded into the folder beside the
// file (ckpt-<step>.optimizer/: one file per rank, each written aside and renamed, and an index that
// rank 0 writes last), and only then does rank 0 write the checkpoint file, whose "optimizer"
// component holds the marker "sharded_state" instead: a checkpoint file exists only once its shards
// are complete. Resuming reads the file, then load_sharded reads the folder on any number of ranks
// (each takes the elements it owns now). The weights stay in the file ("model", gathered as before).
// Rotation removes a folder with its file. A sharded checkpoint resumes in any ZeRO run (whatever
// its own setting) but not in one process, which says so; a consolidated one resumes anywhere.
constexpr std::string_view kCheckpointSuffix = ".safetensors", kShardFolderSuffix = ".optimizer";
// ckpt-<step>.safetensors <-> ckpt-<step>.optimizer
std::string swap_suffix(std::string path, std::string_view from, std::string_view to) {
  if (path.ends_with(from)) path.resize(path.size() - from.size());
  return path.append(to);
}
std::string shard_folder_of(const std::string& checkpoint_file) {
  return swap_suffix(checkpoint_file, kCheckpointSuffix, kShardFolderSuffix);
}

class OptimizerSection final : public flame::Stateful {
 public:
  // sharded: save the marker (the state goes to shard files); zero: this run can read shard files.
  OptimizerSection(optim::Optimizer& opt, EmaSection& ema, bool shard_ema, std::size_t params, bool sharded, bool zero)
      : opt_(opt), ema_(ema), shard_ema_(shard_ema), params_(params), sharded_(sharded), zero_(zero) {}
  flame::StateDict state_dict() const override {
    if (!sharded_) return opt_.state_dict();
    flame::StateDict marker;
    marker.insert("sharded_state", Tensor::ones({1}, flame::TensorOptions(flame::DType::i64, flame::Device::cpu())));
    return marker;
  }
  // Whether the last state loaded was a sharded checkpoint's marker (its state is in the folder).
  bool loaded_marker() const { return loaded_marker_; }
  void load_state_dict(const flame::StateDict& given) override {
    loaded_marker_ = given.contains("sharded_state");
    if (loaded_marker_) {
      if (!zero_)
        FLAME_FAIL("finetune", "its optimizer state is in shard files (the folder beside it, written by each rank); "
                   "resume it under flame-run with ZeRO (train.zero_stage 2 or 3, any number of ranks)");
      return;
    }
    auto slot = [](std::size_t i) { return "state." + std::to_string(i) + ".ema"; };
    flame::StateDict state;
    const Tensor* zero_updates = given.find("ema.num_updates");
    if (ema_.ema() && zero_updates) {  // the shards' EMA of a ZeRO-3 checkpoint -> optim::EMA
      flame::StateDict e;
      for (std::size_t i = 0; i < params_; ++i) {
        const Tensor* t = given.find(slot(i));
        if (!t) throw std::runtime_error("the checkpoint's optimizer state has ema.num_updates but no " + slot(i));
        e.insert("shadow." + std::to_string(i), *t);
      }
      e.insert("num_updates", *zero_updates);
      ema_.ema()->load_state_dict(e);
      ema_.set_taken_from_optimizer();
      for (const auto& [k, t] : given)
        if (k != "ema.num_updates" && !k.ends_with(".ema")) state.insert(k, t);
    } else if (shard_ema_ && !zero_updates && !ema_.captured().empty()) {  // optim::EMA -> the shards' slots
      state = given;
      const flame::StateDict& e = ema_.captured();
      for (std::size_t i = 0; i < params_; ++i) {
        const Tensor* t = e.find("shadow." + std::to_string(i));
        if (!t) throw std::runtime_error("the checkpoint's ema component has no shadow." + std::to_string(i));
        state.insert(slot(i), *t);
      }
      state.insert("ema.num_updates", e.at("num_updates"));
    } else {
      state = given;
    }
    opt_.load_state_dict(state);
  }

 private:
  optim::Optimizer& opt_;
  EmaSection& ema_;
  bool shard_ema_;
  std::size_t params_;
  bool sharded_;
  bool zero_;
  bool loaded_marker_ = false;
};

struct Denoiser {
  std::shared_ptr<fm::FluxTransformer2DModel> flux;
  std::shared_ptr<fm::SD3Transformer2DModel> sd3;
  std::shared_ptr<fm::UNet2DConditionModel> unet;
  nn::Module& module() const {
    if (flux) return *flux;
    if (sd3) return *sd3;
    return *unet;
  }
};

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

// One batch as the step takes it: the loader's batch and, from the caches, its text embeddings and
// latent distributions in host memory (pinned when training on a GPU, so the upload does not wait).
struct StepBatch {
  flame::data::LoaderState position;  // the loader's position before this batch (where a resume starts)
  ImageBatch batch;
  fm::TextTensors text, latents;  // empty without the cache
};

// Note [Step pipelining]: the next batch is drawn and read from the caches on a worker thread while
// the GPU runs the current step, so neither the loader nor the cache files (read and checksummed)
// show up in the step time. `count` batches are drawn in all, one ahead of the step; only the worker
// uses the loader once it runs.
class BatchPrefetcher {
 public:
  using Prepare = std::function<StepBatch(flame::data::LoaderState, ImageBatch)>;
  BatchPrefetcher(ImageLoader& loader, Prepare prepare, int64_t count)
      : loader_(loader), prepare_(std::move(prepare)), count_(count), after_taken_(loader.position()) {
    worker_ = std::thread([this] { run(); });
  }
  BatchPrefetcher(const BatchPrefetcher&) = delete;
  BatchPrefetcher& operator=(const BatchPrefetcher&) = delete;
  ~BatchPrefetcher() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  // The next batch (waiting for the worker; its errors are raised here).
  StepBatch take() {
    std::unique_lock<std::mutex> lock(mu_);
    if (taken_ >= count_) throw std::logic_error("finetune: more batches taken than the run draws");
    cv_.wait(lock, [&] { return ready_.has_value() || error_ != nullptr; });
    if (!ready_) std::rethrow_exception(error_);
    StepBatch b = std::move(ready_->batch);
    after_taken_ = ready_->after;
    ready_.reset();
    ++taken_;
    lock.unlock();
    cv_.notify_all();
    return b;
  }
  // Where the loader stands for the next batch the step will take (a checkpoint's resume point).
  flame::data::LoaderState position() const {
    std::lock_guard<std::mutex> lock(mu_);
    return ready_ ? ready_->batch.position : after_taken_;
  }

 private:
  struct Slot {
    StepBatch batch;
    flame::data::LoaderState after;  // the loader's position after this batch
  };
  void run() {
    for (int64_t i = 0; i < count_; ++i) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !ready_.has_value(); });
        if (stop_) return;
      }
      try {
        const flame::data::LoaderState at = loader_.position();
        StepBatch b = prepare_(at, loader_.next());
        const flame::data::LoaderState after = loader_.position();
        std::lock_guard<std::mutex> lock(mu_);
        ready_ = Slot{std::move(b), after};
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        error_ = std::current_exception();
      }
      cv_.notify_all();
      if (error_ != nullptr) return;  // written by this thread only
    }
  }
  ImageLoader& loader_;
  Prepare prepare_;
  const int64_t count_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Slot> ready_;
  std::exception_ptr error_;
  flame::data::LoaderState after_taken_;
  int64_t taken_ = 0;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace

FinetuneRunResult run_finetune(const FinetuneRunOptions& options) {
  const FinetuneConfig& cfg = options.config;
  validate_finetune_config(cfg);
  // Note [Distributed fine-tuning]: under flame-run (WORLD_SIZE > 1) every rank runs this; the
  // group's timeout covers the slowest rank's share of the caches.
  const bool distributed = launched_distributed();
  const Device device = distributed ? init_distributed(options.device, std::chrono::seconds(1800)) : options.device;
  const int rank = dist_rank(), world = dist_world();
  const bool lead = rank == 0;
  auto log = options.log ? options.log : [](const std::string& m) { std::fprintf(stderr, "%s\n", m.c_str()); };
  const auto say = [&](const std::string& m) {
    if (lead) log("finetune: " + m);
  };
  FinetuneRunResult result;

  // ---- 1. the run folder ----
  const fs::path run = cfg.output.dir;
  result.run_dir = run.string();
  if (cfg.model.checkpoint.empty())
    throw std::runtime_error("model.checkpoint is empty: give the base model (a diffusers pipeline folder, or a "
                             "single file with model.pipeline)");
  if (cfg.dataset.folders.empty() && cfg.dataset.manifest.empty())
    throw std::runtime_error("dataset.folders and dataset.manifest are both empty: give the training images");
  const std::string& method = cfg.train.method;
  const bool lokr = method == "lokr";
  if (lokr && cfg.checkpoint.lora_format != "kohya")
    throw std::runtime_error("train.method = \"lokr\" with checkpoint.lora_format = \"" + cfg.checkpoint.lora_format +
                             "\": LoKr files exist in the kohya / LyCORIS layout only; set lora_format = \"kohya\"");
  const bool full = method == "full";
  const bool resume = !cfg.checkpoint.resume.empty();
  const fs::path ckpt_dir = run / "checkpoints";
  std::optional<std::string> resume_file;
  if (resume) {
    if (cfg.checkpoint.resume == "latest") {
      resume_file = flame::latest_checkpoint(ckpt_dir.string());
      if (!resume_file)
        throw std::runtime_error("checkpoint.resume = \"latest\": " + ckpt_dir.string() +
                                 " holds no checkpoint to resume from");
    } else {
      resume_file = cfg.checkpoint.resume;
      if (!fs::is_regular_file(*resume_file))
        throw std::runtime_error("checkpoint.resume = \"" + cfg.checkpoint.resume +
                                 "\": no such checkpoint file (give a ckpt-<step>.safetensors or \"latest\")");
    }
  } else if (const auto existing = lead ? run_outputs(run, cfg.output.name) : std::vector<fs::path>{};
             !existing.empty()) {
    if (!options.overwrite) {
      throw std::runtime_error("output.dir " + run.string() + " already holds a run (" + existing.front().string() +
                               "); set checkpoint.resume = \"latest\" to continue it, pass --overwrite to replace "
                               "it, or choose another output.dir");
    }
    for (const auto& p : existing) fs::remove_all(p);
    fs::remove(run / "config.toml");
    say("--overwrite: removed the previous run's files in " + run.string() + " (the cache is kept)");
  }
  if (lead) {
    fs::create_directories(run);
    save_finetune_config(cfg, run.string());
  }
  if (distributed) {
    // The lead's refusal reaches the others as its failure (flame-run stops them); they wait here.
    dist_barrier();
    say(std::to_string(world) + " ranks, rank 0 on " + device.str() + "; each trains on its share of every epoch");
  }

  // ---- 2. the pipeline ----
  const DType dtype = cfg.train.mixed_precision == "bf16" ? DType::bf16 : DType::f32;
  fm::PipelineLoadOptions lo;
  const bool single_file = !fs::is_directory(cfg.model.checkpoint);
  if (single_file && cfg.model.pipeline.empty())
    throw std::runtime_error("model.checkpoint " + cfg.model.checkpoint + " is a single file: set model.pipeline to "
                             "the family's diffusers pipeline folder (its tokenizers, and the text encoders and VAE "
                             "unless model.clip_l / clip_g / t5 / vae give files)");
  lo.path = cfg.model.pipeline.empty() ? cfg.model.checkpoint : cfg.model.pipeline;
  if (single_file || !cfg.model.pipeline.empty()) lo.denoiser = cfg.model.checkpoint;
  lo.family = cfg.model.family;
  lo.vae = cfg.model.vae;
  lo.text_encoder = cfg.model.clip_l;
  lo.text_encoder_2 = cfg.model.clip_g;  // PipelineLoadOptions: text_encoder_2 is bigG, text_encoder_3 T5
  lo.text_encoder_3 = cfg.model.t5;
  lo.device = device;
  lo.dtype = dtype;
  // model.fp8_base: FLUX's and SD3's transformer load straight into 8-bit Linears (an fp8 file's
  // codes kept; the GPU never holds the full-precision transformer); SDXL's UNet is quantised after
  // the adapters are attached (step 5).
  if (cfg.model.fp8_base != "none" && !full && cfg.model.family != "sdxl")
    lo.denoiser_float8 = nn::Float8Options{.compute = nn::parse_float8_compute(cfg.model.fp8_base)};
  say("loading " + cfg.model.family + " from " + lo.path + " on " + device.str());
  const std::shared_ptr<fm::Pipeline> pipe = fm::load_pipeline(lo);
  const std::string family = pipe->family;
  Denoiser den{pipe->flux, pipe->sd3, pipe->unet};
  // The VAE may be released once the latents are cached (step 4): keep its configuration, and reach
  // the module through pipe->vae only while it is there.
  const fm::VaeConfig vae_config = pipe->vae->config();
  const bool schnell = den.flux && !den.flux->config().guidance_embeds;
  const int64_t max_seq = family == "flux" && !schnell ? 512 : 256;

  // ---- 3. the data set ----
  auto dataset = std::make_shared<const ImageDataset>(ImageDataset::scan(cfg.dataset, log));
  const auto& records = dataset->records();
  {
    const auto counts = dataset->bucket_counts();
    const auto used = std::count_if(counts.begin(), counts.end(), [](int64_t n) { return n > 0; });
    say(std::to_string(records.size()) + " images in " + std::to_string(used) + " buckets");
  }
  {
    const int64_t m = vae_config.downscale() * (family == "flux" ? 2 : family == "sd3" ? den.sd3->config().patch_size : 1);
    for (const Bucket& b : dataset->buckets()) {
      const std::string size = std::to_string(b.width) + "x" + std::to_string(b.height);
      if (b.width % m != 0 || b.height % m != 0)
        throw std::runtime_error("dataset: bucket " + size + " is not a multiple of " + std::to_string(m) +
                                 " pixels, which " + family + " needs; set dataset.bucket_step to a multiple of " +
                                 std::to_string(m));
      // SD3's position table covers pos_embed_max_size patches a side.
      const int64_t most = den.sd3 ? den.sd3->config().pos_embed_max_size * m : 0;
      if (den.sd3 && std::max(b.width, b.height) > most)
        throw std::runtime_error("dataset: bucket " + size + " is larger than the " + std::to_string(most) +
                                 " pixels a side SD3's position table covers; lower dataset.bucket_max_size or "
                                 "dataset.resolution");
    }
  }

  // ---- 4. caches ----
  const std::string cache_dir = cfg.cache.dir.empty() ? (run / "cache").string() : cfg.cache.dir;
  const std::string dt = dtype == DType::bf16 ? "bf16" : "f32";
  std::optional<fm::TextEmbeddingCache> text_cache;
  std::optional<fm::TextEmbeddingCache> latent_cache;
  // Several ranks fill a cache together: each encodes its share of the keys, and once all have
  // written, the whole set is checked (all hits). The stats are this rank's share.
  auto build_cache = [&](fm::TextEmbeddingCache& cache, const std::vector<std::string>& keys,
                         const fm::TextEncodeFn& encode, int64_t batch) {
    if (!distributed) return cache.build(keys, encode, batch);
    std::vector<std::string> mine;
    for (size_t i = static_cast<size_t>(rank); i < keys.size(); i += static_cast<size_t>(world)) mine.push_back(keys[i]);
    const fm::TextCacheStats own = cache.build(mine, encode, batch);
    dist_barrier();
    (void)cache.build(keys, encode, batch);
    return own;
  };
  auto encode_text = [&](const std::vector<std::string>& texts) {
    fm::PromptEmbeddings e = fm::encode_prompts(*pipe, texts, max_seq);
    return fm::TextTensors{{"states", e.states}, {"pooled", e.pooled}};
  };
  std::vector<std::string> sample_texts = cfg.sample.prompts;
  if (family != "flux" && cfg.sample.true_cfg_scale != 1.0) {
    throw std::runtime_error("sample.true_cfg_scale = " + std::to_string(cfg.sample.true_cfg_scale) +
                             ": true CFG is FLUX's; " + family + " samples use sample.guidance as their CFG scale");
  }
  const bool flux_true_cfg = family == "flux" && cfg.sample.true_cfg_scale > 1.0;
  const bool negative = !cfg.sample.prompts.empty() &&
                        (flux_true_cfg || (family != "flux" && cfg.sample.guidance > 1.0 &&
                                           (!cfg.sample.negative_prompt.empty() || family == "sd3")));
  if (negative) sample_texts.push_back(cfg.sample.negative_prompt);
  if (cfg.cache.text_embeddings) {
    if (cfg.dataset.shuffle_tags)
      throw std::runtime_error("cache.text_embeddings with dataset.shuffle_tags: every shuffle is a new caption "
                               "the cache cannot hold; turn one of them off");
    text_cache.emplace((fs::path(cache_dir) / "text").string(),
                       family + " text encoders " + text_encoder_fingerprint(cfg, lo.path),
                       "dtype=" + dt + " max_sequence_length=" + std::to_string(max_seq));
    std::set<std::string> captions(sample_texts.begin(), sample_texts.end());
    DatasetConfig kept = cfg.dataset;  // each caption as an item has it when not dropped
    kept.caption_dropout = 0;
    for (const auto& r : records) captions.insert(transform_caption(r.caption, kept, 0));
    if (cfg.dataset.caption_dropout > 0) captions.insert("");
    const std::vector<std::string> all(captions.begin(), captions.end());
    const fm::TextCacheStats st = build_cache(*text_cache, all, encode_text, std::max<int64_t>(cfg.train.batch_size, 8));
    result.text_cache_hits = st.hits;
    result.text_encoded = st.encoded;
    say("text cache " + text_cache->dir() + ": " + std::to_string(st.hits) + " cached, " +
        std::to_string(st.encoded) + " encoded");
    for (const auto& p : text_cache->problems()) say("text cache: re-encoded " + p);
  }
  // A latent cache entry's key: the source file as it is now and the window taken from it.
  auto latent_key = [&](const ImageItem& it, bool flipped) {
    return fingerprint(it.path) + " bucket " + std::to_string(it.bucket.width) + "x" +
           std::to_string(it.bucket.height) + " crop " + std::to_string(it.crop.x) + "," + std::to_string(it.crop.y) +
           " of " + std::to_string(it.crop.resized_width) + "x" + std::to_string(it.crop.resized_height) +
           (flipped ? " flipped" : "");
  };
  if (cfg.cache.latents) {
    if (cfg.dataset.crop == "random")
      throw std::runtime_error("cache.latents with dataset.crop = \"random\": every draw is a new window the cache "
                               "cannot hold; use crop = \"center\" or turn cache.latents off");
    latent_cache.emplace((fs::path(cache_dir) / "latents").string(),
                         "vae " + fingerprint(cfg.model.vae.empty() ? (fs::path(lo.path) / "vae").string() : cfg.model.vae),
                         "dtype=" + dt + " distribution");
    std::vector<bool> flips{false};
    if (cfg.dataset.flip_p > 0) flips.push_back(true);
    std::vector<std::string> keys;
    std::map<std::string, std::pair<int64_t, bool>> source;
    for (int64_t i = 0; i < static_cast<int64_t>(records.size()); ++i) {
      const ImageItem it = dataset->describe(i, 0);
      for (bool f : flips) {
        keys.push_back(latent_key(it, f));
        source[keys.back()] = {i, f};
      }
    }
    auto encode_images = [&](const std::vector<std::string>& batch) {
      flame::NoGradGuard ng;
      std::vector<Tensor> means, logvars;
      for (const auto& k : batch) {  // one image at a time: the keys of a call may span buckets
        const auto [i, f] = source.at(k);
        const ImageItem it = dataset->item(i, 0, f);
        const fm::LatentDistribution d = pipe->vae->encode(it.image.unsqueeze(0).to(device));
        means.push_back(d.mean.to(Device::cpu()));
        logvars.push_back(d.logvar.to(Device::cpu()));
      }
      const bool same = std::all_of(means.begin(), means.end(), [&](const Tensor& t) { return t.sizes() == means[0].sizes(); });
      FLAME_CHECK(same, "finetune", "latent cache: images of one encoder call differ in size");
      return fm::TextTensors{{"mean", flame::cat(means, 0)}, {"logvar", flame::cat(logvars, 0)}};
    };
    // One encoder call per image (the cache's batches mix buckets).
    const fm::TextCacheStats st = build_cache(*latent_cache, keys, encode_images, 1);
    result.latents_cached = st.hits;
    result.latents_encoded = st.encoded;
    say("latent cache " + latent_cache->dir() + ": " + std::to_string(st.hits) + " cached, " +
        std::to_string(st.encoded) + " encoded");
    for (const auto& p : latent_cache->problems()) say("latent cache: re-encoded " + p);
  }
  if (text_cache) {
    pipe->clip_l.reset();
    pipe->clip_g.reset();
    pipe->t5.reset();
    say("text encoders released");
  }
  const bool sampling = cfg.sample.every > 0 && !cfg.sample.prompts.empty();
  if (latent_cache && !sampling) {
    pipe->vae.reset();
    say("VAE released");
  }

  // ---- 5. the denoiser ----
  nn::Module& model = den.module();
  const fm::LoraFamily lfam = fm::lora_family_from_string(family);
  if (!full) {
    const nn::LoraOptions lora{.rank = cfg.lora.rank,
                               .alpha = cfg.lora.alpha,
                               .dropout = cfg.lora.dropout,
                               .use_dora = method == "dora"};
    const std::vector<std::string> targets = cfg.lora.targets.empty() ? default_lora_targets(family) : cfg.lora.targets;
    flame::manual_seed(static_cast<uint64_t>(cfg.train.seed));  // the adapters' initialisation
    // PEFT's target_modules, rank_pattern and alpha_pattern: each targeted Linear gets the rank and
    // alpha of the first pattern naming it (a suffix of its dotted name), else lora.rank / alpha.
    const auto& names = nn::matches_target;
    auto split = [](const std::string& entry) {
      const auto eq = entry.rfind('=');
      return std::pair{entry.substr(0, eq), std::stod(entry.substr(eq + 1))};
    };
    std::map<std::pair<int64_t, double>, std::vector<std::string>> groups;
    std::map<std::string, int64_t> pattern_uses;
    for (const auto& [n, m] : model.named_modules()) {
      if (!dynamic_cast<nn::Linear*>(m.get())) continue;
      if (std::none_of(targets.begin(), targets.end(), [&](const std::string& t) { return names(n, t); })) continue;
      int64_t r = lora.rank;
      double a = lora.alpha;
      for (const auto& e : cfg.lora.rank_pattern) {
        if (const auto [p, v] = split(e); names(n, p)) {
          r = static_cast<int64_t>(v);
          ++pattern_uses[e];
          break;
        }
      }
      for (const auto& e : cfg.lora.alpha_pattern) {
        if (const auto [p, v] = split(e); names(n, p)) {
          a = v;
          ++pattern_uses[e];
          break;
        }
      }
      groups[{r, a}].push_back(n);
    }
    for (const auto* list : {&cfg.lora.rank_pattern, &cfg.lora.alpha_pattern}) {
      for (const auto& e : *list) {
        if (pattern_uses[e] == 0) say("warning: lora pattern \"" + e + "\" names no adapted module");
      }
    }
    std::vector<std::string> adapted;
    try {
      for (const auto& [ra, group] : groups) {
        std::vector<std::string> added;
        if (lokr) {
          added = nn::apply_lokr(model, {.factor = cfg.lora.lokr_factor, .rank = ra.first, .alpha = ra.second}, group);
        } else {
          nn::LoraOptions o = lora;
          o.rank = ra.first;
          o.alpha = ra.second;
          added = den.flux ? den.flux->add_lora(o, group) : den.sd3 ? den.sd3->add_lora(o, group) : den.unet->add_lora(o, group);
        }
        adapted.insert(adapted.end(), added.begin(), added.end());
      }
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string("lora.targets / lora.rank: ") + e.what());
    }
    if (adapted.empty()) throw std::runtime_error("lora.targets matched no module of the " + family + " model");
    nn::adapters_to(model, DType::f32);  // f32 adapters (LoRA, DoRA or LoKr) under bf16 weights
    say(std::to_string(adapted.size()) + " modules adapted (" + method + ", rank " + std::to_string(cfg.lora.rank) + ")");
  }
  if (cfg.model.fp8_base != "none") {  // the frozen base in 8 bits (adapters attached and f32 already)
    if (full) throw std::runtime_error("model.fp8_base = \"" + cfg.model.fp8_base +
                                       "\" needs a frozen base; train.method = \"full\" trains every weight");
    (void)nn::quantize_float8(model, {.compute = nn::parse_float8_compute(cfg.model.fp8_base)});  // SDXL's UNet
    int64_t layers = 0, bytes = 0;
    for (const auto& [n, m] : model.named_modules()) {
      const auto* l = dynamic_cast<const nn::Linear*>(m.get());
      if (!l || !l->is_float8()) continue;
      ++layers;
      bytes += static_cast<int64_t>(l->weight().nbytes() + l->weight_scale().nbytes());
    }
    say(std::to_string(layers) + " base Linear layers in 8 bits (" + cfg.model.fp8_base + "), " +
        std::to_string(bytes >> 20) + " MiB");
  }
  if (cfg.train.gradient_checkpointing) {
    if (den.flux) den.flux->set_gradient_checkpointing(fm::kAllFluxBlocks);
    if (den.sd3) den.sd3->set_gradient_checkpointing(true);
    if (den.unet) den.unet->set_gradient_checkpointing(true);
  }
  fm::BlockStack* block_stack = den.flux ? static_cast<fm::BlockStack*>(den.flux.get())
                                         : den.sd3 ? static_cast<fm::BlockStack*>(den.sd3.get()) : nullptr;
  if (cfg.train.activation_offload_blocks != 0 && block_stack) {  // FLUX / SD3 (the config refuses SDXL)
    const double mib = cfg.train.activation_offload_min_mib > 0 ? cfg.train.activation_offload_min_mib
                       : cfg.train.gradient_checkpointing    ? 1.0
                                                              : 64.0;
    const auto min_bytes = static_cast<std::size_t>(mib * 1024 * 1024);
    block_stack->set_activation_offload(true, min_bytes, cfg.train.activation_offload_blocks);
    say("activations of " + (cfg.train.activation_offload_blocks < 0 ? std::string("every block") :
        "the first " + std::to_string(cfg.train.activation_offload_blocks) + " blocks") +
        " offloaded to host memory (saved tensors of " + std::to_string(static_cast<int64_t>(mib)) + " MiB and more)");
  }
  model.train();
  flame::TensorList params;
  for (Tensor p : model.parameters()) {
    if (full) p.requires_grad_(true);
    if (p.requires_grad()) params.push_back(p);
  }
  int64_t n_params = 0;
  for (const Tensor& p : params) n_params += p.numel();
  say(std::to_string(n_params) + " trained parameters");

  // ---- 6. optimizer, schedule, EMA ----
  const auto& oc = cfg.optimizer;
  const optim::AdamWOptions adamw{.lr = oc.lr, .betas = {oc.betas.at(0), oc.betas.at(1)}, .eps = oc.eps,
                                  .weight_decay = oc.weight_decay};
  const optim::AdamW8bitOptions adamw8{.lr = oc.lr, .betas = {oc.betas.at(0), oc.betas.at(1)}, .eps = oc.eps,
                                       .weight_decay = oc.weight_decay};
  const bool eight_bit = oc.type == "adamw8bit";  // 8-bit block-wise moments (bitsandbytes' AdamW8bit)
  const auto make_optimizer = [&](std::vector<optim::ParamGroup> groups) -> std::unique_ptr<optim::Optimizer> {
    if (eight_bit) return std::make_unique<optim::AdamW8bit>(std::move(groups), adamw8);
    return std::make_unique<optim::AdamW>(std::move(groups), adamw);
  };
  std::vector<optim::ParamGroup> groups{eight_bit ? adamw8.group(params) : adamw.group(params)};
  std::unique_ptr<optim::Optimizer> opt;
  flame::dist::ZeroRedundancyOptimizer* zero = nullptr;
  // train.zero_stage: 3 shards the transformer's blocks too (full fine-tuning of FLUX / SD3).
  const int64_t zero_stage = !distributed               ? 0
                             : cfg.train.zero_stage != 0 ? cfg.train.zero_stage
                             : (full && block_stack)     ? 3
                                                         : 2;
  if (zero_stage == 3 && !block_stack)
    throw std::runtime_error("train.zero_stage = 3 shards FLUX's and SD3's transformer blocks; the " + family +
                             " UNet trains with train.zero_stage = 2");
  if (distributed) {
    // Note [Distributed fine-tuning]: ZeRO-2 averages the gradients over the ranks while the
    // backward runs and shards them and the optimizer state; rank 0's initial weights are broadcast.
    flame::dist::ZeroOptions zo;
    zo.stage = static_cast<int>(zero_stage);
    zo.bucket_cap_mb = cfg.train.zero_bucket_mb;
    if (zero_stage == 3) zo.blocks = block_stack->stack_blocks();
    // Stage 3: the EMA of the shards, kept and checkpointed with the optimizer state.
    if (zero_stage == 3 && cfg.train.ema) zo.ema = optim::EMAOptions{.decay = cfg.train.ema_decay};
    zo.offload_state = oc.offload;  // the shards' state and masters on the host
    auto z = std::make_unique<flame::dist::ZeroRedundancyOptimizer>(std::move(groups), make_optimizer, nullptr, zo);
    zero = z.get();
    opt = std::move(z);
    if (zero_stage == 3) {  // every block runs gathered (and is recomputed in backward)
      block_stack->set_block_runner([zero](std::size_t i, const std::function<Tensor(const flame::TensorList&)>& fn,
                                           const flame::TensorList& in) { return zero->run_block(i, fn, in); });
    }
    std::ostringstream buckets;
    buckets << cfg.train.zero_bucket_mb;
    say("ZeRO stage " + std::to_string(zero_stage) + " over " + std::to_string(world) + " ranks, buckets of " +
        buckets.str() + " MiB" + (oc.offload ? ", the optimizer state in host memory" : ""));
  } else if (oc.offload) {
    // optimizer.offload: masters and state in (pinned) host memory, stepped on the CPU.
    opt = std::make_unique<flame::offload::HostOptimizer>(params, [&](const flame::TensorList& masters) {
      return make_optimizer({eight_bit ? adamw8.group(masters) : adamw.group(masters)});
    });
    say("the optimizer's state and master weights in host memory, stepped on the CPU");
  } else {
    opt = make_optimizer(std::move(groups));
  }
  const int64_t total = cfg.train.steps, warm = oc.warmup_steps;
  const std::string sched_kind = oc.scheduler;
  auto sched = std::make_shared<optim::LambdaLR>(*opt, [total, warm, sched_kind](int64_t s) {
    if (warm > 0 && s < warm) return static_cast<double>(s + 1) / static_cast<double>(warm);
    const double p = total > warm ? static_cast<double>(s - warm) / static_cast<double>(total - warm) : 1.0;
    if (sched_kind == "linear") return std::max(0.0, 1.0 - p);
    if (sched_kind == "cosine") return 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, p)));
    return 1.0;
  });
  std::optional<optim::EMA> ema;
  if (cfg.train.ema && zero_stage != 3) ema.emplace(params, optim::EMAOptions{.decay = cfg.train.ema_decay});
  flame::Generator gen(static_cast<uint64_t>(cfg.train.seed) * 7919 + 23);

  AdapterState adapters(model);
  flame::Checkpoint ckpt;
  if (full) {
    ckpt.add("model", model);
  } else {
    ckpt.add("adapters", adapters);
  }
  // Note [EMA across modes]
  const bool shard_ema = zero_stage == 3 && cfg.train.ema;
  EmaSection ema_section(ema ? &*ema : nullptr);
  // Note [Sharded optimizer checkpoints]
  const std::string& state_mode = cfg.checkpoint.optimizer_state;
  if (state_mode == "sharded" && !zero)
    throw std::runtime_error("checkpoint.optimizer_state = \"sharded\" needs ZeRO: run on several ranks under "
                             "flame-run (train.zero_stage 2 or 3), or use \"consolidated\" or \"auto\"");
  const bool sharded_state = zero && (state_mode == "sharded" || (state_mode == "auto" && full));
  OptimizerSection optimizer_section(*opt, ema_section, shard_ema, params.size(), sharded_state, zero != nullptr);
  if (shard_ema) ckpt.add("ema", ema_section);
  ckpt.add("optimizer", optimizer_section);
  ckpt.add("scheduler", *sched);
  if (ema) ckpt.add("ema", ema_section);
  ckpt.add_generator("train", gen);
  ckpt.set_metadata("family", family);
  ckpt.set_metadata("base_model", cfg.model.checkpoint);
  ckpt.set_metadata("method", method);
  flame::data::LoaderState start;
  start.seed = static_cast<uint64_t>(cfg.train.seed);
  if (resume_file) {
    {
      // Stage 3: the weights load into the gathered parameters and go back into the shards.
      std::optional<flame::dist::ZeroRedundancyOptimizer::Gathered> whole;
      if (zero_stage == 3) whole.emplace(zero->gather_parameters(/*write_back=*/true));
      // Note [EMA across modes]: a checkpoint of the other mode has no "ema" component, or an empty one.
      const flame::CheckpointInfo info =
          ckpt.load(*resume_file, {.strict = !cfg.train.ema, .map_location = device});
      std::string odd;
      for (const std::string& n : info.missing_components)
        if (n != "ema" || !(shard_ema || ema_section.taken_from_optimizer())) odd += " missing: " + n + ";";
      for (const std::string& n : info.unexpected_components) odd += " not registered: " + n + ";";
      if (!odd.empty())
        throw std::runtime_error("checkpoint " + *resume_file + " does not hold this run's components:" + odd);
    }
    if (optimizer_section.loaded_marker()) zero->load_sharded(shard_folder_of(*resume_file));  // collective
    // The checkpoint counts the epoch's batches over all ranks (batch k of each of W ranks: k * W of
    // the epoch's list); this run's ranks go on from there, each at its share of it.
    start.epoch = ckpt.progress().counters["epoch"];
    start.batch = ckpt.progress().counters["batch"] / world;
    const int64_t per_rank = BucketBatchSampler(*dataset, cfg.train.batch_size, start.seed, true, world, rank).num_samples() /
                             cfg.train.batch_size;
    if (start.batch >= per_rank) {  // the epoch's list was used up: the next one
      ++start.epoch;
      start.batch = 0;
    }
    say("resumed from " + *resume_file + " at step " + std::to_string(ckpt.progress().step));
  }
  int64_t& step = ckpt.progress().step;
  result.first_step = step;

  // ---- 7. the loop ----
  const ImageLoaderOptions loader_options{.batch_size = cfg.train.batch_size,
                                          .seed = static_cast<uint64_t>(cfg.train.seed),
                                          .num_workers = static_cast<int>(cfg.train.dataloader_workers),
                                          .device = Device::cpu(),
                                          .num_replicas = world,
                                          .rank = rank,
                                          .decode = !latent_cache};
  ImageLoader loader(dataset, loader_options, start);
  fm::FlowMatchOptions flow;
  flow.density = cfg.train.timestep_sampling == "uniform" ? fm::TimestepDensity::uniform : fm::TimestepDensity::logit_normal;
  flow.logit_mean = cfg.train.logit_mean;
  flow.logit_std = cfg.train.logit_std;
  fm::DdpmOptions ddpm;
  ddpm.prediction = cfg.model.prediction == "v_prediction" ? fm::Prediction::v_prediction : fm::Prediction::epsilon;
  ddpm.snr_gamma = cfg.train.min_snr_gamma;

  // The caches' tensors of a batch, read on the prefetcher's thread (pinned for an asynchronous upload).
  const bool pin = device.is_cuda();
  auto prepare = [&](flame::data::LoaderState at, ImageBatch b) {
    StepBatch s{.position = at, .batch = std::move(b), .text = {}, .latents = {}};
    auto host = [&](fm::TextTensors t) {
      if (pin)
        for (auto& [name, v] : t) v = v.pin_memory();
      return t;
    };
    if (text_cache) {
      std::vector<std::string> caps;
      for (const auto& it : s.batch.items) caps.push_back(it.caption);
      s.text = host(text_cache->get_batch(caps, Device::cpu()));
    }
    if (latent_cache) {
      std::vector<std::string> keys;
      for (const auto& it : s.batch.items) keys.push_back(latent_key(it, it.flipped));
      s.latents = host(latent_cache->get_batch(keys, Device::cpu()));
    }
    return s;
  };
  auto upload = [&](const Tensor& t) { return t.to(device, /*non_blocking=*/true); };
  auto batch_text = [&](const StepBatch& s) {
    if (text_cache) return fm::TextTensors{{"states", upload(s.text.at("states"))}, {"pooled", upload(s.text.at("pooled"))}};
    std::vector<std::string> caps;
    for (const auto& it : s.batch.items) caps.push_back(it.caption);
    flame::NoGradGuard ng;
    return encode_text(caps);
  };
  auto batch_latents = [&](const StepBatch& s) {
    flame::NoGradGuard ng;
    fm::LatentDistribution d;
    if (latent_cache) {
      d = {upload(s.latents.at("mean")), upload(s.latents.at("logvar"))};
    } else {
      d = pipe->vae->encode(s.batch.images.to(device));  // kept: no latent cache
    }
    const Tensor z = d.mean + d.std() * Tensor::randn(d.mean.sizes(), 0.0, 1.0, {DType::f32, device}, &gen).to(d.mean.dtype());

    return fm::vae_to_latent(vae_config, z).to(dtype);
  };
  auto batch_loss = [&](const StepBatch& s) {
    const ImageBatch& b = s.batch;
    const Tensor x0 = batch_latents(s);
    const fm::TextTensors text = batch_text(s);
    const Tensor states = text.at("states").to(dtype), pooled = text.at("pooled").to(dtype);

    const int64_t n = x0.size(0);
    const Tensor noise = Tensor::randn(x0.sizes(), 0.0, 1.0, {DType::f32, device}, &gen).to(dtype);
    std::optional<flame::amp::AutocastGuard> ac;
    if (dtype == DType::bf16) ac.emplace(DType::bf16, device.type);
    // train.recompute_cheap: norms', activations' and casts' outputs redone in the backward
    // (Note [Recompute cheap] in src/autograd/recompute.cpp); the loss's backward runs after this scope.
    const flame::autograd::RecomputeCheap cheap(cfg.train.recompute_cheap);
    if (den.unet) {
      std::vector<float> ids;
      for (const auto& it : b.items) {
        ids.insert(ids.end(), {static_cast<float>(it.original_height), static_cast<float>(it.original_width),
                               static_cast<float>(it.crop.y), static_cast<float>(it.crop.x),
                               static_cast<float>(it.bucket.height), static_cast<float>(it.bucket.width)});
      }
      const Tensor t = Tensor::randint(0, ddpm.num_train_timesteps, {n}, {DType::i64, Device::cpu()}, &gen);
      return fm::unet_ddpm_loss(*den.unet, ddpm,
                                {.latents = x0,
                                 .noise = noise,
                                 .text = states,
                                 .timesteps = t,  // on the host (read there)
                                 .added = {.text_embeds = pooled, .time_ids = Tensor::from_vec(ids, {n, 6}).to(device).to(dtype)}});
    }
    fm::FlowMatchOptions o = flow;
    o.shift = cfg.train.shift > 0 ? cfg.train.shift : 1.0;
    if (cfg.train.shift == 0 && den.sd3) o.shift = 3.0;
    if (cfg.train.shift == 0 && den.flux)
      o.shift = std::exp(fm::flux_mu(x0.size(2) / 2 * (x0.size(3) / 2), *pipe->flow_config));
    const fm::FlowBatch fb{.latents = x0, .noise = noise, .text = states, .pooled = pooled,
                           .u = fm::sample_timestep_density(o, n, gen)};  // on the host (read there)
    return den.flux ? fm::flux_flow_loss(*den.flux, o, fb, cfg.train.guidance) : fm::sd3_flow_loss(*den.sd3, o, fb);
  };

  // Samples: the sample prompts through the pipeline with this model (eval mode: no adapter dropout).
  const fs::path samples_dir = run / "samples";
  auto write_samples = [&](int64_t at) {
    if (cfg.sample.prompts.empty()) return;
    flame::NoGradGuard ng;
    model.eval();
    fm::GenerateOptions g;
    g.prompts = cfg.sample.prompts;
    if ((family != "flux" && !cfg.sample.negative_prompt.empty()) || flux_true_cfg) {
      g.negative_prompt = cfg.sample.negative_prompt;
    }
    if (flux_true_cfg) g.true_cfg_scale = cfg.sample.true_cfg_scale;
    g.steps = cfg.sample.steps;
    g.guidance = cfg.sample.guidance;
    g.seed = static_cast<uint64_t>(cfg.sample.seed);
    g.width = cfg.sample.width > 0 ? cfg.sample.width : cfg.dataset.resolution;
    g.height = cfg.sample.height > 0 ? cfg.sample.height : cfg.dataset.resolution;
    g.max_sequence_length = max_seq;
    if (text_cache) {
      g.encode = [&](const std::vector<std::string>& texts) {
        const fm::TextTensors t = text_cache->get_batch(texts, device);
        return fm::PromptEmbeddings{t.at("states").to(dtype), t.at("pooled").to(dtype)};
      };
    }
    const Tensor images = fm::generate(*pipe, g);  // stage 3: on every rank (its blocks gather)
    if (!lead) {
      model.train();
      return;
    }
    fs::create_directories(samples_dir);
    char name[64];
    std::snprintf(name, sizeof name, "step-%07lld.png", static_cast<long long>(at));
    const std::string path = (samples_dir / name).string();
    write_png(path, caption_grid(images, cfg.sample.prompts, static_cast<int>(std::min<size_t>(4, cfg.sample.prompts.size()))));
    result.sample_files.push_back(path);
    say("samples: " + path);
    model.train();
  };

  // train.vram_budget_gib (models/block_budget.h): the pool capped, and which blocks are swapped and
  // checkpointed chosen from trial steps on the first batch (forward and backward; the gradients
  // dropped, the random state put back, so the run trains as it would without them).
  std::optional<fm::BudgetPlan> budget_plan;
  struct ResetLimit {
    Device device;
    ~ResetLimit() {
      if (device.is_cuda()) flame::cuda::set_memory_limit(0, device.index);
    }
  } reset_limit{cfg.train.vram_budget_gib > 0 ? device : Device::cpu()};
  if (cfg.train.vram_budget_gib > 0) {
    if (!den.flux && !den.sd3)
      throw std::runtime_error("train.vram_budget_gib: block swapping is for FLUX's and SD3's transformers, not the " +
                               family + " UNet (model.fp8_base and train.gradient_checkpointing lower its memory)");
    if (!device.is_cuda())
      throw std::runtime_error("train.vram_budget_gib caps GPU memory and needs --device cuda, got " + device.str());
    if (distributed)  // its trial steps would run ZeRO's gradient reductions a different number of times per rank
      throw std::runtime_error("train.vram_budget_gib on " + std::to_string(world) + " ranks: the budget search runs "
                               "on one GPU only for now; set the layout with train.gradient_checkpointing and "
                               "model.fp8_base instead");
    ImageLoader probe(dataset, loader_options, start);
    const StepBatch first = prepare(probe.position(), probe.next());
    const flame::Generator::State gen_state = gen.get_state();
    const flame::Generator::State default_state = flame::default_generator().get_state();
    auto trial = [&] {
      (void)batch_loss(first).backward();
      gen.set_state(gen_state);
      flame::default_generator().set_state(default_state);
    };
    fm::BlockStack& stack = den.flux ? static_cast<fm::BlockStack&>(*den.flux) : static_cast<fm::BlockStack&>(*den.sd3);
    // The optimizer state its first update creates on the GPU is kept out of the trials' room.
    budget_plan = fm::fit_vram_budget(stack, device,
                                      static_cast<std::size_t>(cfg.train.vram_budget_gib * double(1ull << 30)),
                                      cfg.train.gradient_checkpointing, trial, fm::optimizer_state_to_come(*opt, device));
    result.memory_plan = budget_plan->str();
    say(result.memory_plan);
  }

  // loss.csv: a resumed run keeps the rows up to its checkpoint's step (later ones were trained again).
  std::string kept = "step,loss,lr,grad_norm\n";
  if (resume_file) {
    std::ifstream in(run / "loss.csv");
    std::string line;
    for (bool header = true; std::getline(in, line); header = false) {
      if (header) continue;
      const auto at = parse_int64(line.substr(0, line.find(',')));
      if (at && *at <= step) kept += line + "\n";  // a malformed line is dropped
    }
  }
  std::ofstream csv;  // rank 0's (the others' writes go nowhere)
  if (lead) csv.open(run / "loss.csv", std::ios::trunc);
  csv << kept;
  const int keep = cfg.checkpoint.keep > 0 ? static_cast<int>(cfg.checkpoint.keep) : 1 << 30;
  BatchPrefetcher batches(loader, prepare, (total - step) * cfg.train.grad_accum);
  auto save_checkpoint = [&] {
    const std::string file = flame::checkpoint_path(ckpt_dir.string(), step);
    if (sharded_state) {  // Note [Sharded optimizer checkpoints]: every rank's shard first (collective)
      const std::string folder = shard_folder_of(file);
      if (lead) fs::remove_all(folder);  // a folder of an unfinished save of this step
      flame_diffusion::dist_barrier();
      zero->save_sharded(folder);
    }
    std::optional<flame::dist::ZeroRedundancyOptimizer::Gathered> whole;  // stage 3: the weights (collective)
    if (zero_stage == 3) whole.emplace(zero->gather_parameters());
    const flame::data::LoaderState pos = batches.position();
    ckpt.progress().counters["epoch"] = pos.epoch;
    ckpt.progress().counters["batch"] = pos.batch * world;  // over all ranks (read back per rank on resume)
    if (!lead) {
      // A consolidated optimizer state_dict gathers the shards (a collective the lead's save runs
      // too); the adapters are the same on every rank, and so is the data position (every rank has
      // drawn as many batches). Only the lead writes.
      if (!sharded_state) (void)opt->state_dict();
      result.last_checkpoint = file;
      return;
    }
    result.last_checkpoint = ckpt.save_rotating(ckpt_dir.string(), keep);
    if (sharded_state) {  // rotation dropped older files: their shard folders go with them
      std::vector<fs::path> orphans;
      for (const auto& e : fs::directory_iterator(ckpt_dir)) {
        const std::string p = e.path().string();
        if (e.is_directory() && p.ends_with(kShardFolderSuffix) &&
            !fs::exists(swap_suffix(p, kShardFolderSuffix, kCheckpointSuffix)))
          orphans.push_back(e.path());
      }
      for (const fs::path& p : orphans) fs::remove_all(p);
    }
    say("checkpoint " + result.last_checkpoint + (sharded_state ? " (optimizer state in " + shard_folder_of(file) + ")" : ""));
  };
  say("training " + std::to_string(total - step) + " steps of " + std::to_string(cfg.train.batch_size) + " x " +
      std::to_string(cfg.train.grad_accum) + " images");
  auto t_last = std::chrono::steady_clock::now();
  int64_t ran = 0;
  if (device.is_cuda()) {
    flame::cuda::synchronize(device.index);
    flame::cuda::reset_peak_memory_stats(device.index);
  }
  std::size_t warmup_peak = 0;  // the peak of the first two steps (kept apart, like their time)
  // Note [Step pipelining]: a step's loss and gradient norm come back to the host while the next step
  // runs (an asynchronous copy, read after the next step's backward is queued), so the GPU never
  // waits for the host between steps. The loss is checked when read: a non-finite one stops the run
  // one update late, and every checkpoint and sample waits for its step's read first, so no
  // checkpoint holds weights that followed a non-finite loss.
  struct Pending {
    int64_t step = 0;
    double lr = 0;
    Tensor values;  // [loss, grad norm], f32, on the host once `copied` completes
    std::optional<flame::cuda::Event> copied;
  };
  std::optional<Pending> pending;
  auto finish_pending = [&] {
    if (!pending) return;
    const Pending p = std::move(*pending);
    pending.reset();
    if (p.copied) p.copied->synchronize();
    const std::vector<float> read = p.values.to_vec<float>();
    const double loss_sum = read[0], gnorm = read[1];
    if (!std::isfinite(loss_sum))
      throw std::runtime_error("the loss is " + fmt("%g", loss_sum) + " at step " + std::to_string(p.step) +
                               "; lower optimizer.lr or check the data (the last checkpoint is intact)");
    result.losses.push_back(loss_sum);
    csv << p.step << ',' << loss_sum << ',' << p.lr << ',' << gnorm << '\n';
    if (p.step % cfg.train.log_every == 0 || p.step == total) {
      const auto now = std::chrono::steady_clock::now();
      const double secs = std::chrono::duration<double>(now - t_last).count();
      t_last = now;
      csv.flush();
      say("step " + std::to_string(p.step) + "/" + std::to_string(total) + " loss " + fmt("%.5f", loss_sum) + " lr " +
          fmt("%.3g", p.lr) + " grad norm " + fmt("%.3g", gnorm) + " " +
          fmt("%.2f", secs / static_cast<double>(std::min(cfg.train.log_every, ran))) + " s/step");
    }
  };
  // Host time per step by phase (for the summary: where a step's wall time goes on the host).
  std::vector<double> step_seconds, wait_seconds, launch_seconds, gpu_wait_seconds, opt_seconds;
  const auto since = [](std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  const uint64_t rank_seed = flame::HostRng::mix(static_cast<uint64_t>(cfg.train.seed) * 7919 + 23, 0x72616e6bull + rank);
  while (step < total) {
    const auto t_step = std::chrono::steady_clock::now();
    // Several ranks: each draws its own noise and timesteps, seeded by (seed, rank, step), so a
    // resumed run draws what the stopped one would have on any rank.
    if (distributed) gen.manual_seed(flame::HostRng::mix(rank_seed, static_cast<uint64_t>(step)));
    flame::Gradients grads;
    Tensor loss_total;  // on the device
    double waited = 0;
    try {
      for (int64_t m = 0; m < cfg.train.grad_accum; ++m) {
        const auto t_wait = std::chrono::steady_clock::now();
        const StepBatch b = batches.take();
        waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - t_wait).count();
        Tensor loss = batch_loss(b);
        if (cfg.train.grad_accum > 1) loss = loss * (1.0 / static_cast<double>(cfg.train.grad_accum));
        flame::BackwardOptions bo;
        bo.accumulate_into = &grads;
        (void)loss.backward(bo);
        const Tensor l = loss.detach().to(DType::f32);
        loss_total = loss_total.defined() ? loss_total + l : l;
      }
    } catch (const std::exception& e) {
      if (!budget_plan || !fm::is_out_of_memory(e)) throw;
      throw std::runtime_error(std::string(e.what()) + "\nat step " + std::to_string(step + 1) + " under " +
                               budget_plan->str() + " (a batch larger than the first one's needs more: raise "
                               "train.vram_budget_gib, turn on train.gradient_checkpointing or store the base in 8 bits)");
    }
    Pending now;
    bool stop_everywhere = false;
    if (zero != nullptr) {
      // The norm of the averaged gradient from the shards (collective, read on the host), then the
      // ranks' mean loss and whether any rank was asked to stop (one all-reduce): every rank logs
      // the same values and stops after the same step.
      const double gnorm = oc.grad_clip > 0 ? zero->clip_grad_norm(oc.grad_clip) : zero->grad_norm();
      Tensor red = flame::stack({loss_total.reshape({}), Tensor::full({}, stop_signal() != 0 ? 1.0 : 0.0,
                                                                      flame::TensorOptions(DType::f32, device))});
      (void)flame::dist::default_group().all_reduce(red, flame::dist::ReduceOp::sum);
      const std::vector<float> r = red.to_vec<float>();
      now.values = Tensor::from_vec(std::vector<float>{r[0] / static_cast<float>(world), static_cast<float>(gnorm)}, {2});
      stop_everywhere = r[1] > 0;
    } else {
      const Tensor norm = oc.grad_clip > 0 ? flame::clip_grad_norm(grads, oc.grad_clip) : flame::grad_norm(grads);
      now.values = flame::stack({loss_total.reshape({}), norm.to(DType::f32).reshape({})}).to(Device::cpu(), true);
      if (device.is_cuda()) {
        now.copied.emplace();
        now.copied->record();
      }
    }
    launch_seconds.push_back(since(t_step) - waited);
    const auto t_read = std::chrono::steady_clock::now();
    finish_pending();  // the previous step's, copied while this one ran
    gpu_wait_seconds.push_back(since(t_read));
    const auto t_opt = std::chrono::steady_clock::now();
    now.lr = opt->lr();
    opt->step(grads);
    sched->step();
    if (ema) ema->update(step);
    opt_seconds.push_back(since(t_opt));
    ++step;
    ++ran;
    now.step = step;
    pending = std::move(now);
    step_seconds.push_back(since(t_step));
    wait_seconds.push_back(waited);
    if (ran == 2 && device.is_cuda()) {
      warmup_peak = flame::cuda::memory_stats(device.index).peak_allocated_bytes;
      flame::cuda::reset_peak_memory_stats(device.index);
    }
    const bool stopping =
        (distributed ? stop_everywhere : stop_signal() != 0) || (options.stop_after > 0 && ran >= options.stop_after);
    const bool saving = (cfg.checkpoint.every > 0 && step % cfg.checkpoint.every == 0) || step == total || stopping;
    const bool sample_now = sampling && step % cfg.sample.every == 0 && step < total;
    if (saving || sample_now || step == total) finish_pending();
    if (saving) save_checkpoint();
    if (sample_now && (lead || zero_stage == 3)) write_samples(step);
    if (stopping && step < total) {
      result.steps_done = step;
      if (stop_signal() != 0) throw_if_stopped("training", "resume with checkpoint.resume = \"latest\"");
      say("stopped after " + std::to_string(ran) + " steps; resume with checkpoint.resume = \"latest\"");
      return result;
    }
  }
  finish_pending();
  result.steps_done = step;
  // The steps' wall time (with the loss read one step late, the GPU's time once the queue is full),
  // the first two left out as warm-up when there are more; on a GPU the peak memory of the steps
  // after those two, and the peak of all of them when the first two went higher (the first
  // convolutions of a shape choose their algorithms then).
  if (!step_seconds.empty()) {
    const auto median = [&](const std::vector<double>& all) {
      std::vector<double> t(all.begin() + (all.size() > 4 ? 2 : 0), all.end());
      std::nth_element(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(t.size() / 2), t.end());
      return t[t.size() / 2];
    };
    result.median_step_seconds = median(step_seconds);
    result.median_data_wait_seconds = median(wait_seconds);
    std::string mem;
    if (device.is_cuda()) {
      const std::size_t after = flame::cuda::memory_stats(device.index).peak_allocated_bytes;
      result.peak_memory_bytes = ran > 2 ? after : std::max(after, warmup_peak);
      result.peak_memory_all_bytes = std::max(after, warmup_peak);
      mem = ", peak memory " + fmt("%.2f", result.peak_memory_bytes / 1073741824.0) + " GiB";
      if (result.peak_memory_all_bytes > result.peak_memory_bytes)
        mem += " (" + fmt("%.2f", result.peak_memory_all_bytes / 1073741824.0) + " GiB in the first two steps)";
    }
    if (cfg.train.activation_offload_blocks != 0 && block_stack)
      mem += ", " + fmt("%.3f", static_cast<double>(block_stack->offloaded_bytes()) / 1048576.0) +
             " MiB of activations offloaded per step";
    say("median step " + fmt("%.1f", result.median_step_seconds * 1e3) + " ms over " +
        std::to_string(step_seconds.size() > 4 ? step_seconds.size() - 2 : step_seconds.size()) + " steps" + mem +
        "; on the host (medians): waiting for data " + fmt("%.2f", result.median_data_wait_seconds * 1e3) +
        " ms, forward and backward queued in " + fmt("%.1f", median(launch_seconds) * 1e3) +
        " ms, waiting for the previous step " + fmt("%.1f", median(gpu_wait_seconds) * 1e3) + " ms, optimizer " +
        fmt("%.1f", median(opt_seconds) * 1e3) + " ms");
    if (distributed && device.is_cuda())  // every rank its own GPU's peak (flame-run shows each rank's lines)
      log("finetune: rank " + std::to_string(rank) + " of " + std::to_string(world) + " on " + device.str() +
          ": peak memory " + fmt("%.2f", result.peak_memory_all_bytes / 1073741824.0) + " GiB");
  }
  if (sampling && (lead || zero_stage == 3)) write_samples(step);

  // ---- 9. the result ----
  if (ema) {
    ema->store();
    ema->copy_to();
  }
  std::map<std::string, std::string> meta{{"ss_base_model", cfg.model.checkpoint},
                                          {"flame_family", family},
                                          {"ss_resolution", std::to_string(cfg.dataset.resolution)},
                                          {"ss_steps", std::to_string(step)},
                                          {"ss_num_train_images", std::to_string(records.size())},
                                          {"flame_method", method}};
  // Stage 3 with train.ema: the averaged shards (collective) before the gather.
  std::optional<flame::dist::ZeroRedundancyOptimizer::EmaSwap> ema_of_shards;
  if (zero_stage == 3 && cfg.train.ema) ema_of_shards.emplace(zero->swap_in_ema());
  std::optional<flame::dist::ZeroRedundancyOptimizer::Gathered> whole;  // stage 3: the weights (collective)
  if (zero_stage == 3) whole.emplace(zero->gather_parameters());
  if (!lead) {
    // the lead writes the files (the weights are the same on every rank)
  } else if (full) {
    // A diffusers model folder (what from_pretrained and the loaders read): the weights under
    // diffusers' names and the base model's config.json when the pipeline folder has one.
    const fs::path folder = run / cfg.output.name;
    fs::create_directories(folder);
    const fs::path config = fs::path(lo.path) / (family == "sdxl" ? "unet" : "transformer") / "config.json";
    if (lo.denoiser.empty() && fs::exists(config))
      fs::copy_file(config, folder / "config.json", fs::copy_options::overwrite_existing);
    const std::string path = (folder / "diffusion_pytorch_model.safetensors").string();
    flame::io::save_safetensors(path, model.state_dict(), {{"format", "pt"}, {"flame_family", family}});
    result.lora_files.push_back(folder.string());
  } else {
    const std::string& f = cfg.checkpoint.lora_format;
    if (f == "kohya" || f == "both") {
      const std::string path = (run / (cfg.output.name + ".safetensors")).string();
      fm::save_lora(path, model, lfam, fm::LoraFileFormat::kKohya, meta);
      result.lora_files.push_back(path);
    }
    if (f == "peft" || f == "both") {
      const std::string path =
          (run / (cfg.output.name + (f == "both" ? "_diffusers" : "") + ".safetensors")).string();
      fm::save_lora(path, model, lfam, fm::LoraFileFormat::kDiffusers, meta);
      result.lora_files.push_back(path);
    }
  }
  if (ema) ema->restore();
  for (const auto& p : result.lora_files) say("wrote " + p);
  whole.reset();
  ema_of_shards.reset();
  if (distributed) finish_distributed();  // the others wait until the lead has written the files
  return result;
}

}  // namespace flame_diffusion
