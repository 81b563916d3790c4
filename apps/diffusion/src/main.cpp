// flame-diffusion: trains class-conditional diffusion models on Fashion-MNIST with FLAME.
//   flame-diffusion train --model dit-s --objective flow --steps 6000 --batch 256 --out runs/dit-s
//   flame-diffusion sample --checkpoint runs/dit-s/checkpoints/ckpt-0000006000.safetensors --out grid.png
//   flame-diffusion finetune --config lora.toml --set train.steps=2000   (FLUX, SD3.5, SDXL from captioned images)
//   flame-diffusion finetune --base CKPT --classes 7 --lora-rank 8 --steps 500 --out runs/lora
//   flame-diffusion export --checkpoint CKPT --out weights.safetensors   (PyTorch state dict)
//   flame-diffusion generate --model /models/FLUX.1-dev --prompt "a red cat" --out grid.png   (FLUX, SD3.5, SDXL)
// `flame-diffusion <command> --help` lists every flag.
#include <CLI/CLI.hpp>
#include <flame/error.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <limits>
#include <string>

#include "cli_checks.h"
#include "dit.h"
#include "embed.h"
#include "finetune_run.h"
#include "generate.h"
#include "stop_signal.h"
#include "trainer.h"

using namespace flame_diffusion;

namespace {

constexpr int64_t kMaxI64 = std::numeric_limits<int64_t>::max();
constexpr int64_t kMaxInt = std::numeric_limits<int>::max();

// Note [Exit status]: 0 done; 1 an error while running (bad data, a damaged file, divergence...); 2 a
// mistake on the command line (unknown command or flag, a value out of range); 128 + N stopped by
// signal N after saving (130 SIGINT, 143 SIGTERM).
constexpr int kUsageStatus = 2;

// At most `max_lines` lines of a message (a checkpoint's key lists can run to hundreds).
std::string capped(const std::string& text, int max_lines = 24) {
  std::size_t pos = 0;
  for (int i = 0; i < max_lines; ++i) {
    pos = text.find('\n', pos);
    if (pos == std::string::npos) return text;
    ++pos;
  }
  int rest = 0;
  for (std::size_t p = pos; p < text.size(); ++p) rest += text[p] == '\n';
  if (pos < text.size() && text.back() != '\n') ++rest;
  if (rest == 0) return text;
  return text.substr(0, pos) + "... (" + std::to_string(rest) + " more lines)";
}

void add_sampling_flags(CLI::App* cmd, SampleOptions& s, std::string& sampler) {
  cmd->add_option("--sampler", sampler, "euler or heun (flow), ddim or ddpm (ddpm objectives)")->capture_default_str();
  cmd->add_option("--sample-steps", s.steps, "solver steps per sample")->capture_default_str()
      ->check(int_in("--sample-steps", 1, 1000, "an integer from 1 to 1000 (the DDPM schedule has 1000 steps)"));
  cmd->add_option("--cfg", s.cfg_scale, "classifier-free guidance scale (1: none)")->capture_default_str()
      ->check(real_in("--cfg", 0, 100, false, false, "a number from 0 to 100 (1: no guidance, 0: the unconditional model)"));
  cmd->add_option("--sample-seed", s.seed, "seed of the sampling noise")->capture_default_str()
      ->check(int_in("--sample-seed", 0, kMaxI64, "a non-negative integer"));
}

void add_train_flags(CLI::App* cmd, TrainConfig& c, std::string& classes, std::string& exclude, std::string& sampler,
                     bool finetune) {
  if (!finetune) {
    cmd->add_option("--model", c.model, "model preset: " + model_presets())->capture_default_str();
    cmd->add_option("--objective", c.objective, "flow, ddpm-linear or ddpm-cosine")->capture_default_str();
  } else {
    cmd->add_option("--base", c.base_checkpoint, "the trained checkpoint to adapt (the Fashion-MNIST models)")
        ->check(CLI::ExistingFile);
    cmd->add_option("--lora-rank", c.lora_rank,
                    "adapter rank (at most the smaller width of the adapted layers, e.g. 96 for dit-tiny)")
        ->capture_default_str()
        ->check(int_in("--lora-rank", 1, kMaxI64, "a positive integer"));
    cmd->add_option("--lora-alpha", c.lora_alpha, "adapter alpha (scaling alpha / rank)")->capture_default_str()
        ->check(real_in("--lora-alpha", 0, 1e6, true, false, "a positive number (at most 1e6)"));
    cmd->add_option("--lora-targets", c.lora_targets, "layer names to adapt (default: the model's projections)")
        ->delimiter(',');
  }
  cmd->add_option("--steps", c.steps, "optimizer steps")->capture_default_str()
      ->check(int_in("--steps", 1, kMaxI64, "a positive integer"));
  cmd->add_option("--batch", c.batch, "images per optimizer step")->capture_default_str()
      ->check(int_in("--batch", 1, 1 << 20, "an integer from 1 to 1048576"));
  cmd->add_option("--accum", c.accum, "micro-batches per step (gradient accumulation)")->capture_default_str()
      ->check(int_in("--accum", 1, 1 << 20, "an integer from 1 to 1048576"));
  cmd->add_option("--lr", c.lr, "AdamW learning rate")->capture_default_str()
      ->check(real_in("--lr", 0, 10, true, false, "a positive number (at most 10)"));
  cmd->add_option("--weight-decay", c.weight_decay, "AdamW weight decay")->capture_default_str()
      ->check(real_in("--weight-decay", 0, 1e6, false, false, "a non-negative number"));
  cmd->add_option("--schedule", c.schedule, "constant or cosine (after --warmup linear steps)")->capture_default_str();
  cmd->add_option("--warmup", c.warmup, "linear warmup steps")->capture_default_str()
      ->check(int_in("--warmup", 0, kMaxI64, "a non-negative integer (0: no warmup)"));
  cmd->add_option("--grad-clip", c.grad_clip, "max global gradient norm (0: off)")->capture_default_str()
      ->check(real_in("--grad-clip", 0, 1e30, false, false, "a non-negative number (0: no clipping)"));
  cmd->add_option("--ema", c.ema_decay, "EMA decay of the weights sampled from")->capture_default_str()
      ->check(real_in("--ema", 0, 1, false, true, "a number from 0 up to, not including, 1"));
  cmd->add_option("--ema-warmup", c.ema_warmup, "EMA decay min(ema, (1+step)/(10+step))")->capture_default_str();
  cmd->add_option("--label-dropout", c.label_dropout, "probability of the null label (CFG training)")->capture_default_str()
      ->check(real_in("--label-dropout", 0, 1, false, false, "a probability from 0 to 1"));
  cmd->add_option("--amp", c.amp, "autocast: auto (bf16 on CUDA), bf16, f16, off")->capture_default_str();
  cmd->add_option("--data", c.data_dir, "Fashion-MNIST directory (default: the Debian package's)");
  cmd->add_option("--classes", classes, "train on these classes only, e.g. 7 or 0-4,9");
  if (!finetune) cmd->add_option("--exclude-classes", exclude, "leave these classes out, e.g. 7");
  cmd->add_option("--flip", c.flip, "random horizontal flips")->capture_default_str();
  cmd->add_option("--device", c.device, "auto, cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_option("--seed", c.seed, "seed of weights, data order and noise")->capture_default_str()
      ->check(int_in("--seed", 0, kMaxI64, "a non-negative integer"));
  cmd->add_option("--out", c.out, "run directory (checkpoints, PNGs, CSV)")->capture_default_str();
  auto* resume = cmd->add_flag("--resume", c.resume, "continue from the newest checkpoint in <out>/checkpoints that loads");
  cmd->add_flag("--overwrite", c.overwrite,
                "train into an --out that holds a run: first remove that run's files (checkpoints, loss.csv, "
                "PNGs, adapter; nothing else)")
      ->excludes(resume);
  cmd->add_option("--log-every", c.log_every, "steps between log lines")->capture_default_str()
      ->check(int_in("--log-every", 1, kMaxI64, "a positive integer"));
  cmd->add_option("--sample-every", c.sample_every, "steps between sample grids (0: at the end only)")->capture_default_str()
      ->check(int_in("--sample-every", 0, kMaxI64, "a non-negative integer (0: at the end only)"));
  cmd->add_option("--ckpt-every", c.ckpt_every, "steps between checkpoints (0: at the end only)")->capture_default_str()
      ->check(int_in("--ckpt-every", 0, kMaxI64, "a non-negative integer (0: at the end only)"));
  cmd->add_option("--keep", c.keep_checkpoints, "checkpoints kept")->capture_default_str()
      ->check(int_in("--keep", 1, kMaxInt, "a positive integer (at most 2147483647)"));
  cmd->add_option("--time-limit", c.time_limit, "stop after this many seconds (0: no limit)")->capture_default_str()
      ->check(real_in("--time-limit", 0, 1e9, false, false, "a non-negative number of seconds (0: no limit)"));
  cmd->add_option("--samples-per-class", c.samples_per_class, "columns of the sample grid")->capture_default_str()
      ->check(int_in("--samples-per-class", 1, 100, "an integer from 1 to 100"));
  cmd->add_flag("!--no-progress", c.progress_bar, "no progress bar (log lines only)");
  cmd->add_flag("--compile,!--no-compile", c.compile,
                "capture the training step in a CUDA graph and replay it (default on with CUDA; "
                "not with --accum > 1)");
  cmd->add_option("--recompute", c.recompute,
                 "DiT activations recomputed in the backward instead of saved: none, mlp (the MLP hidden "
                 "activation), mlp:N (mlp in the first N blocks only) or all (mlp and the adaLN outputs); "
                 "less memory, a little more time")
      ->check([](const std::string& s) {
        try {
          (void)parse_dit_recompute_spec(s);
          return std::string();
        } catch (const std::exception& e) {
          return std::string(e.what());
        }
      })
      ->capture_default_str();
  cmd->add_flag("--short-attention", c.short_attention,
                "FLAME's short-sequence attention kernels instead of cuDNN's (CUDA; head dim 64, up to 256 "
                "tokens; FLAME_SHORT_ATTENTION=1 does the same)");
  cmd->add_option("--classifier", c.classifier, "at the end, classify samples with this classifier (train_classifier)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--eval-per-class", c.eval_per_class, "samples per class for --classifier")->capture_default_str()
      ->check(int_in("--eval-per-class", 1, 1000000, "an integer from 1 to 1000000"));
  add_sampling_flags(cmd, c.sampling, sampler);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flame-diffusion: class-conditional diffusion models on Fashion-MNIST, trained with FLAME"};
  app.require_subcommand(1);

  TrainConfig tc;
  std::string t_classes, t_exclude, t_sampler = "euler";
  auto* train_cmd = app.add_subcommand("train", "train a model from scratch (or --resume)");
  add_train_flags(train_cmd, tc, t_classes, t_exclude, t_sampler, false);

  TrainConfig fc;
  fc.steps = 500;
  fc.lr = 1e-3;
  fc.out = "runs/lora";
  fc.sample_every = 0;
  fc.ckpt_every = 0;
  std::string f_classes, f_exclude, f_sampler = "euler";
  auto* ft_cmd = app.add_subcommand("finetune",
                                    "fine-tune FLUX.1, SD3 / SD3.5 or SDXL on captioned images (--config), or train "
                                    "LoRA adapters of a Fashion-MNIST model on a class subset (--base)");
  add_train_flags(ft_cmd, fc, f_classes, f_exclude, f_sampler, true);
  std::string ft_config;
  std::vector<std::string> ft_set;
  ft_cmd->add_option("--config", ft_config, "a fine-tuning configuration (TOML; finetune_config --keys lists every key)")
      ->check(CLI::ExistingFile);
  ft_cmd->add_option("--set", ft_set, "key=value overrides of the configuration, after the file (repeatable)");

  SampleConfig sc;
  std::string s_classes, s_sampler = "euler";
  auto* sample_cmd = app.add_subcommand("sample", "write a class grid of samples from a checkpoint");
  sample_cmd->add_option("--checkpoint", sc.checkpoint, "a train or finetune checkpoint, or an exported weights file")->required()->check(CLI::ExistingFile);
  sample_cmd->add_option("--lora", sc.lora, "an adapter file written by finetune")->check(CLI::ExistingFile);
  sample_cmd->add_option("--classes", s_classes, "classes to sample, e.g. 0-9 or 7")->capture_default_str();
  sample_cmd->add_option("--n", sc.per_class, "samples per class")->capture_default_str()
      ->check(int_in("--n", 1, 100, "an integer from 1 to 100"));
  sample_cmd->add_option("--ema", sc.use_ema, "use the EMA weights when the checkpoint has them")->capture_default_str();
  sample_cmd->add_option("--device", sc.device, "auto, cpu, cuda or cuda:N")->capture_default_str();
  sample_cmd->add_option("--scale", sc.scale, "pixel upscaling of the grid")->capture_default_str()
      ->check(int_in("--scale", 1, 8, "an integer from 1 to 8"));
  sample_cmd->add_option("--out", sc.out, "image path: .png, or .jpg / .jpeg (JPEG, quality 95)")->capture_default_str();
  sample_cmd->add_option("--classifier", sc.classifier, "report the fraction of samples classified as their class")
      ->check(CLI::ExistingFile);
  add_sampling_flags(sample_cmd, sc.sampling, s_sampler);

  ExportConfig ec;
  auto* export_cmd = app.add_subcommand("export", "write a checkpoint's weights as a plain PyTorch state dict");
  export_cmd->add_option("--checkpoint", ec.checkpoint, "a train or finetune checkpoint")->required()->check(CLI::ExistingFile);
  export_cmd->add_option("--ema", ec.use_ema, "export the EMA weights when the checkpoint has them")->capture_default_str();
  export_cmd->add_option("--out", ec.out, "safetensors path")->capture_default_str();

  GenerateConfig gc;
  auto* generate_cmd = app.add_subcommand("generate", "text-to-image with FLUX.1, SD3 / SD3.5 or SDXL into a captioned grid");
  add_generate_flags(generate_cmd, gc);

  if (const auto m = check_subcommand(app, argc, argv)) {
    std::fprintf(stderr, "flame-diffusion: error: %s\n", m->c_str());
    return kUsageStatus;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ExtrasError& e) {
    const auto m = unknown_flag_message(app, argc, argv);
    std::fprintf(stderr, "flame-diffusion: error: %s\n", m ? m->c_str() : e.what());
    return kUsageStatus;
  } catch (const CLI::ParseError& e) {
    const auto m = unknown_flag_message(app, argc, argv);  // often the cause of CLI11's complaint
    std::fprintf(stderr, "flame-diffusion: error: %s\n", m ? m->c_str() : e.what());
    return kUsageStatus;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "flame-diffusion: error: %s\n", e.what());
    return kUsageStatus;
  }
  install_stop_handlers();
  try {
    if (*train_cmd) {
      // No --model on a machine without a GPU: the CPU demo's recipe (scripts/run_demo.sh) rather
      // than dit-s at batch 256, which would take hours there; flags given keep their values.
      if (train_cmd->count("--model") == 0 && !parse_device(tc.device).is_cuda()) {
        const CpuRecipe cpu;
        tc.model = cpu.model;
        if (train_cmd->count("--batch") == 0) tc.batch = cpu.batch;
        if (train_cmd->count("--lr") == 0) tc.lr = cpu.lr;
        if (train_cmd->count("--steps") == 0) tc.steps = cpu.steps;
        if (train_cmd->count("--sample-steps") == 0) tc.sampling.steps = cpu.sample_steps;
        if (train_cmd->count("--warmup") == 0) tc.warmup = std::min(cpu.warmup, tc.steps - 1);  // a short --steps
        if (train_cmd->count("--schedule") == 0) tc.schedule = cpu.schedule;
        if (train_cmd->count("--ema") == 0) tc.ema_decay = cpu.ema_decay;
        if (train_cmd->count("--time-limit") == 0) tc.time_limit = cpu.time_limit;
        if (train_cmd->count("--sample-every") == 0) tc.sample_every = cpu.sample_every;
        if (train_cmd->count("--cfg") == 0) tc.sampling.cfg_scale = cpu.cfg_scale;
        if (train_cmd->count("--out") == 0) tc.out = "runs/" + cpu.model;
        std::fprintf(stderr,
                     "train: no --model on a machine without a GPU: the CPU recipe, %s at batch %lld, lr %g (%s), %lld "
                     "steps or %.0f s, %lld sampling steps at CFG %g, into %s (flags given override it; --model "
                     "dit-s for the GPU preset)\n",
                     tc.model.c_str(), static_cast<long long>(tc.batch), tc.lr, tc.schedule.c_str(),
                     static_cast<long long>(tc.steps), tc.time_limit, static_cast<long long>(tc.sampling.steps),
                     tc.sampling.cfg_scale, tc.out.c_str());
      }
      if (!t_classes.empty()) tc.classes = parse_classes(t_classes);
      if (!t_exclude.empty()) tc.exclude_classes = parse_classes(t_exclude);
      tc.sampling.sampler = parse_sampler(t_sampler);
      train(tc);
    } else if (*ft_cmd && (ft_cmd->count("--config") > 0 || !ft_set.empty())) {
      // The real model families: everything but the device and --overwrite is in the configuration.
      for (const CLI::Option* o : ft_cmd->get_options()) {
        const std::string n = o->get_name();
        if (o->count() > 0 && n != "--config" && n != "--set" && n != "--device" && n != "--overwrite" && n != "--help")
          throw UsageError(n + ": with --config, the configuration holds the settings (finetune_config --keys lists "
                               "them); give them in the file or with --set key=value");
      }
      FinetuneRunOptions ro;
      ro.config = load_finetune_config(ft_config, ft_set);
      ro.device = parse_device(fc.device);
      ro.overwrite = fc.overwrite;
      const FinetuneRunResult r = run_finetune(ro);
      for (const auto& f : r.lora_files) std::printf("%s\n", f.c_str());
    } else if (*ft_cmd) {
      if (fc.base_checkpoint.empty())
        throw UsageError("finetune: give --config FILE (FLUX, SD3, SDXL) or --base CHECKPOINT (a Fashion-MNIST model)");
      if (f_classes.empty()) throw std::runtime_error("finetune: --classes is required (the classes to adapt to)");
      fc.classes = parse_classes(f_classes);
      fc.sampling.sampler = parse_sampler(f_sampler);
      finetune(fc);
    } else if (*sample_cmd) {
      if (!s_classes.empty()) sc.classes = parse_classes(s_classes);
      sc.sampling.sampler = parse_sampler(s_sampler);
      sample_checkpoint(sc);
    } else if (*export_cmd) {
      export_weights(ec);
    } else if (*generate_cmd) {
      run_generate(gc, *generate_cmd);
    }
  } catch (const Interrupted& e) {
    std::fprintf(stderr, "\nflame-diffusion: %s\n", e.what());
    return e.exit_status();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "\nflame-diffusion: error: %s\n", capped(e.what()).c_str());
    return kUsageStatus;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\nflame-diffusion: error: %s\n", capped(e.what()).c_str());
    return 1;
  }
  return 0;
}
