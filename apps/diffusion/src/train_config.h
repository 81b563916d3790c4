#pragma once
// The fine-tuning configuration: a typed struct read from a TOML file (toml++) with
// `--set key=value` overrides, and saved back beside a run as config.toml.
//
//   FinetuneConfig cfg = load_finetune_config("lora.toml", {"train.steps=2000", "lora.rank=32"});
//   save_finetune_config(cfg, run_dir);                 // <run_dir>/config.toml
//   std::cout << finetune_config_help();                // every key, its default and what it does
//
// Note [Configuration table]
// Every setting is one row of one table (finetune_config_keys(), in train_config.cpp): its dotted key
// ("train.steps" is `steps` in the TOML table [train]), its default, a one-line description, what
// it accepts (a range, or a list of choices) and the struct member it fills. FinetuneConfig's
// constructor, the TOML reader, the --set parser, the writer and the help text all walk that
// table, so a key exists everywhere or nowhere. Reading is strict: an unknown key, a value of the
// wrong type or out of range is an error naming the key, the value and what is accepted (with the
// nearest known key for a misspelt one); all problems of a file are reported together. Integers are
// accepted where a number is expected (lr = 1 reads as 1.0). Relations between keys (the bucket
// limits around the resolution, one folder_repeats entry per folder) are checked after the
// overrides. Saving writes every key, with its description as a comment; reading the file back
// gives the same struct, and saving that gives the same text (floats in their shortest
// round-tripping form).
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "image_dataset.h"

namespace flame_diffusion {

struct FinetuneModelConfig {
  std::string family;      // "flux", "sd3", "sdxl"
  std::string checkpoint;  // diffusers pipeline folder or single .safetensors file of the denoiser
  std::string pipeline;    // the pipeline folder when checkpoint is a single file
  std::string vae, clip_l, clip_g, t5;
  std::string prediction;  // SDXL: "epsilon" or "v_prediction"
  std::string fp8_base;    // "none", "dequantize" or "fp8" (flame/nn/float8.h)
};

struct FinetuneLoraConfig {
  int64_t rank = 0;
  double alpha = 0.0;
  double dropout = 0.0;
  std::vector<std::string> targets;
  std::vector<std::string> rank_pattern, alpha_pattern;  // "<module suffix>=<value>"
  int64_t lokr_factor = 0;
};

struct FinetuneOptimizerConfig {
  std::string type;  // "adamw", "adamw8bit"
  double lr = 0.0;
  std::vector<double> betas;
  double weight_decay = 0.0;
  double eps = 0.0;
  double grad_clip = 0.0;
  std::string scheduler;  // "constant", "linear", "cosine"
  int64_t warmup_steps = 0;
  bool offload = false;  // the state (and masters) in host memory, stepped on the CPU
};

struct FinetuneTrainSettings {
  std::string method;  // "lora", "lokr", "dora", "full"
  int64_t steps = 0;
  int64_t batch_size = 0;
  int64_t grad_accum = 0;
  int64_t seed = 0;
  std::string mixed_precision;  // "bf16", "no"
  bool gradient_checkpointing = false;
  bool recompute_cheap = false;               // autograd::RecomputeCheap over the forward
  int64_t activation_offload_blocks = 0;      // FLUX / SD3: the first N blocks' saved tensors to the host (-1: all)
  double activation_offload_min_mib = 0.0;    // 0: 64 without gradient checkpointing, else 1
  double vram_budget_gib = 0.0;  // 0: no budget (models/block_budget.h)
  std::string timestep_sampling;  // "logit_normal", "uniform"
  double logit_mean = 0.0;
  double logit_std = 0.0;
  double shift = 0.0;
  double guidance = 0.0;
  double min_snr_gamma = 0.0;
  bool ema = false;
  double ema_decay = 0.0;
  int64_t dataloader_workers = 0;
  int64_t log_every = 0;
  int64_t zero_stage = 0;  // several ranks: 0 chooses (3 for full FLUX / SD3, else 2), or 2 or 3
  double zero_bucket_mb = 0.0;  // several ranks: dist::ZeroOptions::bucket_cap_mb
};

struct FinetuneCheckpointConfig {
  int64_t every = 0;
  int64_t keep = 0;
  std::string lora_format;  // "kohya", "peft", "both"
  // "auto", "consolidated" or "sharded": where a ZeRO run's optimizer state goes (Note [Sharded
  // optimizer checkpoints] in src/finetune_run.cpp).
  std::string optimizer_state = "auto";
  std::string resume;
};

struct FinetuneSampleConfig {
  std::vector<std::string> prompts;
  std::string negative_prompt;
  int64_t every = 0;
  int64_t steps = 0;
  double guidance = 0.0;
  double true_cfg_scale = 1.0;  // FLUX: true CFG with negative_prompt when > 1
  int64_t seed = 0;
  int64_t width = 0, height = 0;
};

struct FinetuneCacheConfig {
  bool latents = false;
  bool text_embeddings = false;
  std::string dir;
};

struct FinetuneOutputConfig {
  std::string dir;
  std::string name;
};

// Every member is set from the configuration table's defaults by the constructor (the zeros
// above are placeholders).
struct FinetuneConfig {
  FinetuneModelConfig model;
  DatasetConfig dataset;
  FinetuneLoraConfig lora;
  FinetuneOptimizerConfig optimizer;
  FinetuneTrainSettings train;
  FinetuneCheckpointConfig checkpoint;
  FinetuneSampleConfig sample;
  FinetuneCacheConfig cache;
  FinetuneOutputConfig output;

  FinetuneConfig();
  // Key by key through the table.
  bool operator==(const FinetuneConfig& other) const;
};

class ConfigError : public std::runtime_error {
 public:
  explicit ConfigError(const std::string& what) : std::runtime_error(what) {}
};

using ConfigValue = std::variant<bool, int64_t, double, std::string, std::vector<std::string>, std::vector<int64_t>,
                                 std::vector<double>>;

// One row of the configuration table (Note [Configuration table]).
struct ConfigKey {
  std::string key;  // dotted: "<table>.<name>"
  ConfigValue default_value;
  std::string doc;
  // Numbers (each element of a list): [min, max], either end open when the flag says so.
  double min = -1e300, max = 1e300;
  bool min_open = false, max_open = false;
  std::vector<std::string> choices;  // strings: the accepted values (empty: any)
  std::function<ConfigValue(const FinetuneConfig&)> get;
  std::function<void(FinetuneConfig&, const ConfigValue&)> set;

  // "an integer >= 1", "one of \"flux\", \"sd3\", \"sdxl\"", "a list of numbers in [0, 1)" ...
  std::string accepted() const;
};

const std::vector<ConfigKey>& finetune_config_keys();
// The row of `key`, or null.
const ConfigKey* find_config_key(const std::string& key);
// The known key nearest `key` in edit distance when it is close enough to be a likely typo; "" otherwise.
std::string suggest_config_key(const std::string& key);

// Defaults, then the TOML file (when `path` is not empty), then the overrides in order, then the
// checks between keys. Raises ConfigError listing every problem, each naming the file or --set,
// the key, the value and what is accepted.
FinetuneConfig load_finetune_config(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from TOML text; `source` names it in errors.
FinetuneConfig parse_finetune_config(const std::string& toml_text, const std::string& source,
                               const std::vector<std::string>& overrides = {});
// Applies one "key=value" override, typed by the key: the value in TOML syntax ("2e-4", "true",
// "[1, 2]", "\"a b\""), except that a string key also takes a bare string, and a list key a bare
// single element (a bare string keeps its commas: sample.prompts=a cat, on a mat is one prompt).
// Blanks around the key and the value are dropped (quote a string to keep them). Raises ConfigError.
void apply_config_override(FinetuneConfig& config, const std::string& assignment);
// The checks between keys (the bucket limits, folder_repeats' length). Raises ConfigError.
void validate_finetune_config(const FinetuneConfig& config);

// The whole configuration as TOML, every key with its description as a comment.
std::string finetune_config_to_toml(const FinetuneConfig& config);
// Writes <dir>/config.toml (through a temporary file and a rename); returns its path.
std::string save_finetune_config(const FinetuneConfig& config, const std::string& dir);
// Every key, grouped by table: "  key = default" and its description with what it accepts.
std::string finetune_config_help();

}  // namespace flame_diffusion
