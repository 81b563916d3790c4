// The fine-tuning configuration table, its TOML reader and writer, and --set overrides (train_config.h).
#include "train_config.h"

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <tuple>

#include <toml++/toml.h>

#include "cli_checks.h"

namespace flame_diffusion {
namespace {

struct Limits {
  double min = -1e300, max = 1e300;  // +-1e300: unbounded
  bool min_open = false, max_open = false;
  std::vector<std::string> choices;
};

template <class T, class Ref>
ConfigKey make_key(const char* name, Ref ref, std::type_identity_t<T> def, const char* doc, Limits lim = {}) {
  ConfigKey k;
  k.key = name;
  k.default_value = ConfigValue(std::in_place_type<T>, std::move(def));
  k.doc = doc;
  k.min = lim.min;
  k.max = lim.max;
  k.min_open = lim.min_open;
  k.max_open = lim.max_open;
  k.choices = std::move(lim.choices);
  k.get = [ref](const FinetuneConfig& c) { return ConfigValue(std::in_place_type<T>, ref(const_cast<FinetuneConfig&>(c))); };
  k.set = [ref](FinetuneConfig& c, const ConfigValue& v) { ref(c) = std::get<T>(v); };
  return k;
}

// One row: the key, the member it fills, its default, its description, what it accepts.
#define FD_KEY(key, member, ...) \
  make_key<decltype(FinetuneConfig::member)>(key, [](FinetuneConfig& c) -> auto& { return c.member; }, __VA_ARGS__)

using Strings = std::vector<std::string>;
constexpr double kNoBound = 1e300;
Limits lim(double lo, double hi, bool lo_open = false, bool hi_open = false) {
  Limits l;
  l.min = lo;
  l.max = hi;
  l.min_open = lo_open;
  l.max_open = hi_open;
  return l;
}
const Limits kPositive = lim(0, kNoBound, true);
const Limits kNonNegative = lim(0, kNoBound);
const Limits kProbability = lim(0, 1);
Limits at_least(double v) { return lim(v, kNoBound); }
Limits in_range(double lo, double hi) { return lim(lo, hi); }
Limits one_of(Strings choices) {
  Limits l;
  l.choices = std::move(choices);
  return l;
}

std::vector<ConfigKey> build_table() {
  return {
      // [model]
      FD_KEY("model.family", model.family, "flux", "the base model's architecture", one_of({"flux", "sd3", "sdxl"})),
      FD_KEY("model.checkpoint", model.checkpoint, "",
             "the base model: a diffusers pipeline folder, or a single-file .safetensors checkpoint of the "
             "transformer / UNet (then model.pipeline gives the rest)"),
      FD_KEY("model.pipeline", model.pipeline, "",
             "the diffusers pipeline folder the tokenizers and the components not given come from (empty: "
             "model.checkpoint, when it is one)"),
      FD_KEY("model.vae", model.vae, "", "a VAE to use instead of the pipeline's (empty: the pipeline's)"),
      FD_KEY("model.clip_l", model.clip_l, "", "a CLIP-L text encoder file instead of the pipeline's"),
      FD_KEY("model.clip_g", model.clip_g, "", "an OpenCLIP bigG text encoder file instead of the pipeline's (SD3, SDXL)"),
      FD_KEY("model.t5", model.t5, "", "a T5-XXL encoder file instead of the pipeline's (FLUX, SD3)"),
      FD_KEY("model.prediction", model.prediction, "epsilon",
             "SDXL's training target (FLUX and SD3 are trained by flow matching)", one_of({"epsilon", "v_prediction"})),
      FD_KEY("model.fp8_base", model.fp8_base, "none",
             "the frozen base's Linear weights in 8 bits (e4m3, one scale per output row): dequantize (half "
             "of bf16's memory, the bf16 GEMMs) or fp8 (the same memory and FP8 GEMMs on GPUs of compute "
             "capability 8.9+); adapters stay f32. Not with train.method = \"full\"",
             one_of({"none", "dequantize", "fp8"})),
      // [dataset]
      FD_KEY("dataset.folders", dataset.folders, Strings{},
             "folders of images with same-name caption files; \"<N>_<name>\" folders repeat their images N times"),
      FD_KEY("dataset.folder_repeats", dataset.folder_repeats, std::vector<int64_t>{},
             "repeats per entry of dataset.folders, overriding the folder names (empty: none; 0: from the name)",
             kNonNegative),
      FD_KEY("dataset.manifest", dataset.manifest, "",
             "a JSONL file, one {\"file\": ..., \"caption\": ...} a line, paths relative to it (with or instead of folders)"),
      FD_KEY("dataset.caption_extension", dataset.caption_extension, ".txt", "the extension of the caption files"),
      FD_KEY("dataset.repeats", dataset.repeats, 1, "repeats of images no folder name or folder_repeats sets",
             at_least(1)),
      FD_KEY("dataset.recursive", dataset.recursive, true, "walk the folders' subfolders too"),
      FD_KEY("dataset.verify_images", dataset.verify_images, true,
             "decode every image while scanning, so corrupt files are skipped before training (off: headers only)"),
      FD_KEY("dataset.resolution", dataset.resolution, 1024,
             "the training resolution: buckets hold about resolution² pixels", in_range(64, 8192)),
      FD_KEY("dataset.bucketing", dataset.bucketing, true,
             "aspect-ratio buckets (off: every image is cropped to resolution x resolution)"),
      FD_KEY("dataset.bucket_step", dataset.bucket_step, 64, "bucket sides are multiples of this", in_range(8, 1024)),
      FD_KEY("dataset.bucket_min_size", dataset.bucket_min_size, 256, "the shortest bucket side", in_range(8, 8192)),
      FD_KEY("dataset.bucket_max_size", dataset.bucket_max_size, 2048, "the longest bucket side", in_range(8, 16384)),
      FD_KEY("dataset.bucket_max_aspect", dataset.bucket_max_aspect, 4.0,
             "the largest long-to-short side ratio of a bucket", in_range(1, 16)),
      FD_KEY("dataset.max_upscale", dataset.max_upscale, 1.0,
             "the most an image is enlarged to fill its bucket; smaller images get a smaller bucket",
             lim(0, 16, true)),
      FD_KEY("dataset.crop", dataset.crop, "center", "where the bucket's window is cut from the resized image",
             one_of({"center", "random"})),
      FD_KEY("dataset.flip_p", dataset.flip_p, 0.0, "probability of a horizontal flip of each item", kProbability),
      FD_KEY("dataset.caption_dropout", dataset.caption_dropout, 0.0,
             "probability of training an item with an empty caption", kProbability),
      FD_KEY("dataset.shuffle_tags", dataset.shuffle_tags, false, "shuffle the comma-separated tags of each caption"),
      FD_KEY("dataset.keep_tokens", dataset.keep_tokens, 0, "leading tags that shuffling keeps in place",
             kNonNegative),
      FD_KEY("dataset.caption_prefix", dataset.caption_prefix, "", "text put before every caption, as is"),
      FD_KEY("dataset.caption_suffix", dataset.caption_suffix, "", "text put after every caption, as is"),
      // [lora]
      FD_KEY("lora.rank", lora.rank, 16, "the adapters' rank", in_range(1, 4096)),
      FD_KEY("lora.alpha", lora.alpha, 16.0, "the adapters' alpha: their output is scaled by alpha / rank",
             kPositive),
      FD_KEY("lora.rank_pattern", lora.rank_pattern, Strings{},
             "per-module ranks, \"<module-name suffix>=<rank>\" (PEFT's rank_pattern; the module is adapted at "
             "that rank)"),
      FD_KEY("lora.alpha_pattern", lora.alpha_pattern, Strings{},
             "per-module alphas, \"<module-name suffix>=<alpha>\" (PEFT's alpha_pattern)"),
      FD_KEY("lora.lokr_factor", lora.lokr_factor, -1,
             "LoKr (train.method = \"lokr\"): how out and in split into the two Kronecker factors (-1: the most "
             "even split, as LyCORIS' factor = -1)", at_least(-1)),
      FD_KEY("lora.dropout", lora.dropout, 0.0, "dropout on the adapters' input",
             lim(0, 1, false, true)),
      FD_KEY("lora.targets", lora.targets, Strings{},
             "module-name patterns to adapt (empty: the family's attention and feed-forward projections)"),
      // [optimizer]
      FD_KEY("optimizer.type", optimizer.type, "adamw", "the optimizer (adamw8bit: 8-bit block-wise states)",
             one_of({"adamw", "adamw8bit"})),
      FD_KEY("optimizer.lr", optimizer.lr, 1e-4, "the peak learning rate", lim(0, 1, true)),
      FD_KEY("optimizer.betas", optimizer.betas, std::vector<double>{0.9, 0.999}, "AdamW's beta1 and beta2",
             lim(0, 1, false, true)),
      FD_KEY("optimizer.weight_decay", optimizer.weight_decay, 0.01, "AdamW's decoupled weight decay", kNonNegative),
      FD_KEY("optimizer.eps", optimizer.eps, 1e-8, "AdamW's epsilon", kPositive),
      FD_KEY("optimizer.grad_clip", optimizer.grad_clip, 1.0, "the gradient norm clip (0: off)", kNonNegative),
      FD_KEY("optimizer.scheduler", optimizer.scheduler, "constant", "the learning rate after the warmup",
             one_of({"constant", "linear", "cosine"})),
      FD_KEY("optimizer.warmup_steps", optimizer.warmup_steps, 0, "steps of linear warmup from 0", kNonNegative),
      FD_KEY("optimizer.offload", optimizer.offload, false,
             "keep the optimizer's state and f32 master weights in host memory and step them on the CPU "
             "(DeepSpeed's ZeRO-Offload): no optimizer memory on the GPU, a slower step. On several ranks "
             "each rank's shard, whose checkpoints resume with either setting; a one-process checkpoint "
             "resumes with the same setting"),
      // [train]
      FD_KEY("train.method", train.method, "lora",
             "what is trained: LoRA, LoKr or DoRA adapters, or every weight (full)",
             one_of({"lora", "lokr", "dora", "full"})),
      FD_KEY("train.steps", train.steps, 1000, "optimizer steps", in_range(1, 1e9)),
      FD_KEY("train.batch_size", train.batch_size, 1, "images per batch (all of one bucket)", in_range(1, 4096)),
      FD_KEY("train.grad_accum", train.grad_accum, 1, "batches accumulated per optimizer step", in_range(1, 4096)),
      FD_KEY("train.seed", train.seed, 0, "the seed of the data order, augmentation, noise and adapter init",
             kNonNegative),
      FD_KEY("train.mixed_precision", train.mixed_precision, "bf16",
             "bf16 autocast with f32 adapter weights, or f32 throughout (no)", one_of({"bf16", "no"})),
      FD_KEY("train.gradient_checkpointing", train.gradient_checkpointing, false,
             "recompute block activations in the backward pass (less memory, more time)"),
      FD_KEY("train.recompute_cheap", train.recompute_cheap, false,
             "keep recipes instead of the outputs of norms, activations and casts, and redo them in the backward "
             "(autograd::RecomputeCheap; FLUX-dev LoRA at 1024²: 4.4 GiB less for 2% more time)"),
      FD_KEY("train.activation_offload_blocks", train.activation_offload_blocks, 0,
             "FLUX and SD3: move what the first N blocks save for the backward to pinned host memory during the "
             "forward and bring it back in the backward (-1: every block; 0: off); with gradient checkpointing "
             "those blocks' inputs",
             in_range(-1, 1e6)),
      FD_KEY("train.activation_offload_min_mib", train.activation_offload_min_mib, 0.0,
             "saved tensors smaller than this stay on the GPU when activations are offloaded (0: 64 MiB without "
             "gradient checkpointing, where only the MLP pre-activations pass, else 1 MiB)",
             lim(0, 1e6)),
      FD_KEY("train.vram_budget_gib", train.vram_budget_gib, 0.0,
             "FLUX and SD3 on a CUDA device: cap the GPU memory of the run at this many GiB; trial steps "
             "then choose which blocks' frozen weights stay in host memory (block swapping) and which blocks "
             "are checkpointed, and the choice is logged (0: no cap)",
             lim(0, 1e6)),
      FD_KEY("train.timestep_sampling", train.timestep_sampling, "logit_normal",
             "flow matching's timestep density (FLUX, SD3)", one_of({"logit_normal", "uniform"})),
      FD_KEY("train.logit_mean", train.logit_mean, 0.0, "the logit-normal density's mean", in_range(-10, 10)),
      FD_KEY("train.logit_std", train.logit_std, 1.0, "the logit-normal density's standard deviation",
             lim(0, 10, true)),
      FD_KEY("train.shift", train.shift, 0.0,
             "the timestep shift (0: the family's: FLUX's resolution-dependent one, SD3's 3.0)", kNonNegative),
      FD_KEY("train.guidance", train.guidance, 1.0, "FLUX-dev's guidance input while training", kNonNegative),
      FD_KEY("train.min_snr_gamma", train.min_snr_gamma, 0.0, "SDXL's min-SNR-gamma loss weighting (0: off)",
             kNonNegative),
      FD_KEY("train.ema", train.ema, false, "keep an exponential moving average of the trained weights"),
      FD_KEY("train.ema_decay", train.ema_decay, 0.999, "the EMA's decay per step",
             lim(0, 1, false, true)),
      FD_KEY("train.dataloader_workers", train.dataloader_workers, 2, "threads decoding and resizing images",
             in_range(0, 64)),
      FD_KEY("train.log_every", train.log_every, 10, "steps between loss log lines", at_least(1)),
      FD_KEY("train.zero_stage", train.zero_stage, 0,
             "on several ranks (flame-run): 2 shards the gradients and the optimizer state over the ranks, 3 the "
             "transformer's blocks too (train.method full, FLUX and SD3); 0 chooses 3 for full fine-tuning of "
             "FLUX and SD3, else 2",
             in_range(0, 3)),
      FD_KEY("train.zero_bucket_mb", train.zero_bucket_mb, 25.0,
             "on several ranks: the MiB per ZeRO bucket (dist::ZeroOptions::bucket_cap_mb): gradients reduce "
             "and stage 3's blocks gather in pieces of about this size; more than a block's bytes (e.g. 2000 "
             "for FLUX) gives one all-gather and one reduce-scatter per block, as FSDP2 does: faster, with a "
             "block's whole gradients in flight",
             lim(0, 1e6, true)),
      // [checkpoint]
      FD_KEY("checkpoint.every", checkpoint.every, 500, "steps between checkpoints (0: only at the end)",
             kNonNegative),
      FD_KEY("checkpoint.keep", checkpoint.keep, 3, "the newest checkpoints kept (0: all)", kNonNegative),
      FD_KEY("checkpoint.lora_format", checkpoint.lora_format, "kohya",
             "LoRA file keys: kohya/ComfyUI (lora_unet_...), diffusers/PEFT (lora_A/lora_B), or both files",
             one_of({"kohya", "peft", "both"})),
      FD_KEY("checkpoint.optimizer_state", checkpoint.optimizer_state, "auto",
             "where a run under ZeRO (flame-run) keeps the optimizer state: sharded (each rank writes its own "
             "file beside the checkpoint; resumes on any number of ranks), consolidated (inside the checkpoint "
             "file; resumes in one process too, but gathers the whole state on each GPU), or auto (sharded for "
             "train.method full, else consolidated)",
             one_of({"auto", "consolidated", "sharded"})),
      FD_KEY("checkpoint.resume", checkpoint.resume, "",
             "a checkpoint folder to resume from (empty: a fresh run; \"latest\": the output folder's newest)"),
      // [sample]
      FD_KEY("sample.prompts", sample.prompts, Strings{}, "prompts of the sample images written while training"),
      FD_KEY("sample.negative_prompt", sample.negative_prompt, "",
             "the negative prompt (SD3, SDXL; FLUX: with sample.true_cfg_scale above 1)"),
      FD_KEY("sample.every", sample.every, 0, "steps between sample images (0: none)", kNonNegative),
      FD_KEY("sample.steps", sample.steps, 28, "denoising steps of each sample", in_range(1, 1000)),
      FD_KEY("sample.guidance", sample.guidance, 3.5, "guidance scale (FLUX's guidance input, CFG for SD3 and SDXL)",
             kNonNegative),
      FD_KEY("sample.true_cfg_scale", sample.true_cfg_scale, 1.0,
             "FLUX: true classifier-free guidance with sample.negative_prompt when above 1 (diffusers' "
             "true_cfg_scale; two passes per step); 1: none",
             in_range(0.0, 100.0)),
      FD_KEY("sample.seed", sample.seed, 0, "the samples' noise seed", kNonNegative),
      FD_KEY("sample.width", sample.width, 0, "sample width (0: dataset.resolution)", in_range(0, 8192)),
      FD_KEY("sample.height", sample.height, 0, "sample height (0: dataset.resolution)", in_range(0, 8192)),
      // [cache]
      FD_KEY("cache.latents", cache.latents, true, "encode the images with the VAE once and train from the cache"),
      FD_KEY("cache.text_embeddings", cache.text_embeddings, true, "encode the captions once and train from the cache"),
      FD_KEY("cache.dir", cache.dir, "", "where the caches live (empty: <output.dir>/cache)"),
      // [output]
      FD_KEY("output.dir", output.dir, "runs/finetune", "the run folder: checkpoints, samples, config.toml, logs"),
      FD_KEY("output.name", output.name, "lora",
             "the stem of the LoRA files written, or the model folder's name with train.method full"),
  };
}

// ---- text helpers ----

std::string format_double(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::general);  // shortest, %g style
  std::string s(buf, r.ptr);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // 1 -> 1.0 (inf and nan have an 'n')
  return s;
}

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (ch < 0x20 || ch == 0x7F) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04X", ch);
          out += buf;
        } else {
          out += static_cast<char>(ch);
        }
    }
  }
  return out + "\"";
}

template <class T, class F>
std::string join_list(const std::vector<T>& v, F fmt) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + fmt(v[i]);
  return out + "]";
}

std::string value_to_toml(const ConfigValue& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, bool>) return x ? "true" : "false";
        else if constexpr (std::is_same_v<T, int64_t>) return std::to_string(x);
        else if constexpr (std::is_same_v<T, double>) return format_double(x);
        else if constexpr (std::is_same_v<T, std::string>) return quote(x);
        else if constexpr (std::is_same_v<T, std::vector<std::string>>) return join_list(x, quote);
        else if constexpr (std::is_same_v<T, std::vector<int64_t>>)
          return join_list(x, [](int64_t i) { return std::to_string(i); });
        else return join_list(x, format_double);
      },
      v);
}

std::string node_text(const toml::node& node) {
  std::ostringstream os;
  if (node.is_string()) os << quote(*node.value<std::string>());
  else if (node.is_table()) os << "{...}";
  else node.visit([&](const auto& n) { os << n; });
  std::string s = os.str();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

const char* node_kind(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::date: return "a date";
    case toml::node_type::time: return "a time";
    case toml::node_type::date_time: return "a date-time";
    default: return "nothing";
  }
}

bool in_limits(const ConfigKey& k, double v) {
  if (std::isnan(v)) return false;
  if (k.min_open ? !(v > k.min) : !(v >= k.min)) return false;
  if (k.max_open ? !(v < k.max) : !(v <= k.max)) return false;
  return true;
}

// Converts a TOML value to the key's type and checks its range or choices; returns the problem
// ("" when none). `where` is "<file>: " or "--set ...: ".
std::string convert(const ConfigKey& k, const toml::node& node, ConfigValue& out) {
  const std::string bad = k.key + " = " + node_text(node) + ": ";
  const std::string expected = "expected " + k.accepted() + ", got " + node_kind(node);
  auto number = [&](const toml::node& n, double& d) {
    if (n.is_integer()) d = static_cast<double>(*n.value<int64_t>());
    else if (n.is_floating_point()) d = *n.value<double>();
    else return false;
    return true;
  };
  auto range_problem = [&](double d) { return in_limits(k, d) ? std::string() : bad + "out of range: expected " + k.accepted(); };
  return std::visit(
      [&](const auto& def) -> std::string {
        using T = std::decay_t<decltype(def)>;
        if constexpr (std::is_same_v<T, bool>) {
          if (!node.is_boolean()) return bad + expected;
          out = *node.value<bool>();
        } else if constexpr (std::is_same_v<T, int64_t>) {
          if (!node.is_integer()) return bad + expected;
          const int64_t i = *node.value<int64_t>();
          if (auto p = range_problem(static_cast<double>(i)); !p.empty()) return p;
          out = i;
        } else if constexpr (std::is_same_v<T, double>) {
          double d;
          if (!number(node, d)) return bad + expected;
          if (auto p = range_problem(d); !p.empty()) return p;
          out = d;
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (!node.is_string()) return bad + expected;
          std::string s = *node.value<std::string>();
          if (!k.choices.empty() && std::find(k.choices.begin(), k.choices.end(), s) == k.choices.end()) {
            std::string near;
            size_t best = 3;
            for (const auto& c : k.choices)
              if (size_t d = edit_distance(s, c); d < best) best = d, near = c;
            return bad + "not accepted: expected " + k.accepted() + (near.empty() ? "" : " (did you mean \"" + near + "\"?)");
          }
          out = std::move(s);
        } else {
          const toml::array* arr = node.as_array();
          if (arr == nullptr) return bad + expected;
          T list;
          for (size_t i = 0; i < arr->size(); ++i) {
            const toml::node& e = *arr->get(i);
            const std::string at = k.key + "[" + std::to_string(i) + "] = " + node_text(e) + ": ";
            if constexpr (std::is_same_v<T, std::vector<std::string>>) {
              if (!e.is_string()) return at + "expected a string, got " + node_kind(e);
              list.push_back(*e.value<std::string>());
            } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
              if (!e.is_integer()) return at + "expected an integer, got " + node_kind(e);
              if (!in_limits(k, static_cast<double>(*e.value<int64_t>()))) return at + "out of range: expected " + k.accepted();
              list.push_back(*e.value<int64_t>());
            } else {
              double d;
              if (!number(e, d)) return at + "expected a number, got " + node_kind(e);
              if (!in_limits(k, d)) return at + "out of range: expected " + k.accepted();
              list.push_back(d);
            }
          }
          out = std::move(list);
        }
        return "";
      },
      k.default_value);
}

// The table names in the order of the table ("model", "dataset", ...).
std::vector<std::string> table_names() {
  std::vector<std::string> names;
  for (const auto& k : finetune_config_keys()) {
    const std::string t = k.key.substr(0, k.key.find('.'));
    if (std::find(names.begin(), names.end(), t) == names.end()) names.push_back(t);
  }
  return names;
}

std::string unknown_key_problem(const std::string& key) {
  std::string msg = "unknown key \"" + key + "\"";
  if (std::string near = suggest_config_key(key); !near.empty()) return msg + " (did you mean \"" + near + "\"?)";
  const std::string table = key.substr(0, key.find('.'));
  const auto tables = table_names();
  if (key.find('.') != std::string::npos && std::find(tables.begin(), tables.end(), table) != tables.end()) {
    std::string keys;
    for (const auto& k : finetune_config_keys())
      if (k.key.starts_with(table + ".")) keys += (keys.empty() ? "" : ", ") + k.key.substr(table.size() + 1);
    return msg + " (the keys of [" + table + "] are: " + keys + ")";
  }
  for (const auto& t : tables)
    if (edit_distance(table, t) <= 2) return msg + " (did you mean [" + t + "]?)";
  std::string all;
  for (const auto& t : tables) all += (all.empty() ? "[" : ", [") + t + "]";
  return msg + " (the tables are " + all + "; `finetune_config --keys` lists every key)";
}

// Walks a parsed TOML table into `config`, collecting problems.
void read_table(const toml::table& table, const std::string& prefix, FinetuneConfig& config, std::vector<std::string>& problems) {
  for (const auto& [name, node] : table) {
    const std::string key = prefix.empty() ? std::string(name.str()) : prefix + "." + std::string(name.str());
    const ConfigKey* k = find_config_key(key);
    if (k == nullptr) {
      const auto tables = table_names();
      if (prefix.empty() && std::find(tables.begin(), tables.end(), key) != tables.end()) {
        if (const toml::table* sub = node.as_table()) {
          read_table(*sub, key, config, problems);
        } else {
          problems.push_back(key + " = " + node_text(node) + ": " + key + " is a table of settings ([" + key +
                             "]), not a value");
        }
        continue;
      }
      problems.push_back(unknown_key_problem(key));
      continue;
    }
    ConfigValue v;
    if (std::string p = convert(*k, node, v); !p.empty()) {
      problems.push_back(p);
      continue;
    }
    k->set(config, v);
  }
}

[[noreturn]] void raise_problems(const std::string& source, const std::vector<std::string>& problems) {
  std::string msg = source + ": " + (problems.size() == 1 ? "" : std::to_string(problems.size()) + " problems:");
  for (const auto& p : problems) msg += (problems.size() == 1 ? "" : "\n  ") + p;
  throw ConfigError(msg);
}

void finish(FinetuneConfig& config, const std::vector<std::string>& overrides) {
  for (const auto& o : overrides) apply_config_override(config, o);
  validate_finetune_config(config);
}

}  // namespace

const std::vector<ConfigKey>& finetune_config_keys() {
  static const std::vector<ConfigKey> keys = build_table();
  return keys;
}

const ConfigKey* find_config_key(const std::string& key) {
  static const std::map<std::string, const ConfigKey*> index = [] {
    std::map<std::string, const ConfigKey*> m;
    for (const auto& k : finetune_config_keys()) m[k.key] = &k;
    return m;
  }();
  auto it = index.find(key);
  return it == index.end() ? nullptr : it->second;
}

std::string suggest_config_key(const std::string& key) {
  std::string best;
  size_t best_d = std::max<size_t>(2, key.size() / 5) + 1;
  const std::string leaf = key.substr(key.rfind('.') + 1);
  for (const auto& k : finetune_config_keys()) {
    size_t d = edit_distance(key, k.key);
    // The right name in the wrong table ("train.lr" for "optimizer.lr") is a near miss too.
    if (k.key.substr(k.key.rfind('.') + 1) == leaf) d = std::min<size_t>(d, 1);
    if (d < best_d) best_d = d, best = k.key;
  }
  return best;
}

std::string ConfigKey::accepted() const {
  auto num = [](double v) {
    std::string s = format_double(v);
    return s.ends_with(".0") ? s.substr(0, s.size() - 2) : s;
  };
  auto bounds = [&](const std::string& what) {
    const bool lo = min > -1e300, hi = max < 1e300;
    if (lo && hi)
      return what + " in " + (min_open ? "(" : "[") + num(min) + ", " + num(max) + (max_open ? ")" : "]");
    if (lo) return what + (min_open ? " > " : " >= ") + num(min);
    if (hi) return what + (max_open ? " < " : " <= ") + num(max);
    return what;
  };
  return std::visit(
      [&](const auto& def) -> std::string {
        using T = std::decay_t<decltype(def)>;
        if constexpr (std::is_same_v<T, bool>) return "true or false";
        else if constexpr (std::is_same_v<T, int64_t>) return bounds("an integer");
        else if constexpr (std::is_same_v<T, double>) return bounds("a number");
        else if constexpr (std::is_same_v<T, std::string>) {
          if (choices.empty()) return "a string";
          std::string s = "one of ";
          for (size_t i = 0; i < choices.size(); ++i) s += (i ? ", " : "") + quote(choices[i]);
          return s;
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) return "a list of strings";
        else if constexpr (std::is_same_v<T, std::vector<int64_t>>) return bounds("a list of integers");
        else return bounds("a list of numbers");
      },
      default_value);
}

FinetuneConfig::FinetuneConfig() {
  for (const auto& k : finetune_config_keys()) k.set(*this, k.default_value);
}

bool FinetuneConfig::operator==(const FinetuneConfig& other) const {
  for (const auto& k : finetune_config_keys())
    if (k.get(*this) != k.get(other)) return false;
  return true;
}

DatasetConfig default_dataset_config() { return FinetuneConfig().dataset; }

void apply_config_override(FinetuneConfig& config, const std::string& assignment) {
  const std::string where = "--set " + assignment;
  const size_t eq = assignment.find('=');
  if (eq == std::string::npos)
    throw ConfigError(where + ": expected key=value (e.g. --set train.steps=2000)");
  auto trim = [](std::string s) {
    s.erase(0, s.find_first_not_of(" \t"));
    s.erase(s.find_last_not_of(" \t") + 1);
    return s;
  };
  const std::string key = trim(assignment.substr(0, eq));
  const std::string text = trim(assignment.substr(eq + 1));
  const ConfigKey* k = find_config_key(key);
  if (k == nullptr) throw ConfigError(where + ": " + unknown_key_problem(key));
  const bool is_string = std::holds_alternative<std::string>(k->default_value);
  const bool is_string_list = std::holds_alternative<std::vector<std::string>>(k->default_value);
  const bool is_list = is_string_list || std::holds_alternative<std::vector<int64_t>>(k->default_value) ||
                       std::holds_alternative<std::vector<double>>(k->default_value);
  ConfigValue v;
  if (is_string && !text.starts_with("\"") && !text.starts_with("'")) {
    // A bare string is taken as it is; convert() still checks the choices.
    toml::value<std::string> node(text);
    if (std::string p = convert(*k, node, v); !p.empty()) throw ConfigError(where + ": " + p);
  } else if (is_string_list && !text.starts_with("[")) {
    toml::array node;
    node.push_back(text);
    if (std::string p = convert(*k, node, v); !p.empty()) throw ConfigError(where + ": " + p);
  } else {
    const std::string doc = "v = " + (is_list && !text.starts_with("[") ? "[" + text + "]" : text);
    toml::table parsed;
    try {
      parsed = toml::parse(doc);
    } catch (const toml::parse_error& e) {
      throw ConfigError(where + ": " + key + " = " + text + ": not a value (expected " + k->accepted() + "; " +
                        std::string(e.description()) + ")");
    }
    if (std::string p = convert(*k, *parsed.get("v"), v); !p.empty()) throw ConfigError(where + ": " + p);
  }
  k->set(config, v);
}

void validate_finetune_config(const FinetuneConfig& c) {
  try {
    check_dataset_config(c.dataset, false);
  } catch (const std::runtime_error& e) {
    throw ConfigError(std::string("configuration: ") + e.what());
  }
  for (const auto& [key, list, integer] :
       {std::tuple{"lora.rank_pattern", &c.lora.rank_pattern, true}, std::tuple{"lora.alpha_pattern", &c.lora.alpha_pattern, false}}) {
    for (const std::string& entry : *list) {
      const auto eq = entry.rfind('=');
      const auto value = eq == std::string::npos ? std::nullopt : parse_finite(entry.substr(eq + 1));
      const bool ok = eq != std::string::npos && eq > 0 && value && *value > 0 &&
                      (!integer || (*value == std::floor(*value) && *value <= 4096));
      if (!ok)
        throw ConfigError(std::string("configuration: ") + key + " entry \"" + entry + "\": expected \"<module>=<" +
                          (integer ? "rank>\" with a rank from 1 to 4096" : "alpha>\" with a positive alpha") +
                          ", e.g. \"to_q=" + (integer ? "32" : "16") + "\"");
    }
  }
  if (c.train.activation_offload_blocks != 0 && c.model.family == "sdxl")
    throw ConfigError("configuration: train.activation_offload_blocks is for FLUX's and SD3's transformer blocks, not "
                      "SDXL's UNet; use train.gradient_checkpointing or train.recompute_cheap there");
  if (c.train.zero_stage == 1)
    throw ConfigError("configuration: train.zero_stage = 1: use 2 (gradients and optimizer state sharded), 3 "
                      "(the blocks too) or 0 (chosen)");
  if (c.train.zero_stage == 3 && c.train.method != "full")
    throw ConfigError("configuration: train.zero_stage = 3 shards the model's weights, which train.method = \"" +
                      c.train.method + "\" does not train; use 2 or 0");
  if (c.optimizer.betas.size() != 2)
    throw ConfigError("configuration: optimizer.betas = " + value_to_toml(c.optimizer.betas) +
                      ": expected two numbers, [beta1, beta2]");
  for (const auto& [key, v] : {std::pair{"sample.width", c.sample.width}, std::pair{"sample.height", c.sample.height}})
    if (v % 16 != 0)
      throw ConfigError(std::string("configuration: ") + key + " = " + std::to_string(v) +
                        ": must be a multiple of 16 (the VAE's 8 times the 2x2 patches), or 0");
}

FinetuneConfig parse_finetune_config(const std::string& text, const std::string& source, const std::vector<std::string>& overrides) {
  toml::table table;
  try {
    table = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    const auto& at = e.source().begin;
    throw ConfigError(source + ":" + std::to_string(at.line) + ":" + std::to_string(at.column) +
                      ": not valid TOML: " + std::string(e.description()));
  }
  FinetuneConfig config;
  std::vector<std::string> problems;
  read_table(table, "", config, problems);
  if (!problems.empty()) raise_problems(source, problems);
  finish(config, overrides);
  return config;
}

FinetuneConfig load_finetune_config(const std::string& path, const std::vector<std::string>& overrides) {
  if (path.empty()) {
    FinetuneConfig config;
    finish(config, overrides);
    return config;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path + ": cannot open the configuration file");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_finetune_config(ss.str(), path, overrides);
}

std::string finetune_config_to_toml(const FinetuneConfig& config) {
  std::string out = "# flame-diffusion fine-tuning configuration: every key, with its description.\n";
  for (const auto& table : table_names()) {
    out += "\n[" + table + "]\n";
    for (const auto& k : finetune_config_keys()) {
      if (!k.key.starts_with(table + ".")) continue;
      out += "# " + k.doc + "; " + k.accepted() + "\n";
      out += k.key.substr(table.size() + 1) + " = " + value_to_toml(k.get(config)) + "\n";
    }
  }
  return out;
}

std::string save_finetune_config(const FinetuneConfig& config, const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path path = fs::path(dir) / "config.toml";
  const fs::path tmp = fs::path(dir) / "config.toml.tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << finetune_config_to_toml(config);
    out.flush();
    if (!out) throw ConfigError(tmp.string() + ": cannot write the configuration (" + std::strerror(errno) + ")");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) throw ConfigError(path.string() + ": cannot write the configuration (" + ec.message() + ")");
  return path.string();
}

std::string finetune_config_help() {
  std::string out;
  for (const auto& table : table_names()) {
    out += "[" + table + "]\n";
    for (const auto& k : finetune_config_keys()) {
      if (!k.key.starts_with(table + ".")) continue;
      out += "  " + k.key + " = " + value_to_toml(k.default_value) + "\n      " + k.doc + "; " + k.accepted() + "\n";
    }
  }
  return out;
}

}  // namespace flame_diffusion
