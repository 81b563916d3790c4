#pragma once
// The files users have: opening them, recognising their layout and loading them into a model
// through a key plan (Note [Key plans] in key_plan.h).
//
// Note [Checkpoint files]
// What a user points a tool at is one of:
//   - a diffusers model folder: config.json + diffusion_pytorch_model.safetensors (or the
//     .fp16.safetensors variant, or shards diffusion_pytorch_model-0000i-of-0000N.safetensors listed
//     by diffusion_pytorch_model.safetensors.index.json);
//   - a transformers model folder (the text encoders): config.json + model.safetensors, or shards
//     model-0000i-of-0000N.safetensors listed by model.safetensors.index.json;
//   - a diffusers pipeline folder (model_index.json, one subfolder per model: vae/, unet/,
//     text_encoder/, text_encoder_2/, text_encoder_3/ ...): the loader of a model kind looks in its
//     subfolder;
//   - one .safetensors file, in diffusers names or in an original single-file layout (SD 1.x/SDXL
//     full checkpoints with their "first_stage_model." / "model.diffusion_model." prefixes, FLUX/SD3
//     ae.safetensors and ComfyUI VAE files with bare original names; the text encoders' single
//     files of text_checkpoint.cpp).
// Checkpoint::open resolves the path to its files and indexes every key of every file from the
// headers alone (flame::io::SafetensorsFile maps the file; nothing is read yet). A model kind has
// registered formats (CheckpointFormat: a detector and a plan builder, keyed by name); the loader of
// a kind asks detect_checkpoint_format for the first that recognises the keys, builds its KeyPlan
// and calls load_checkpoint, which first checks the whole plan against the file and the module
// (every stored source present, every shape agreeing, every module parameter and persistent buffer
// covered, every stored key under the plan's prefix placed) and raises one flame::Error naming the
// file, the family it guessed, the layout and the first problems; only then are tensors read, one at
// a time, straight to the parameter's device and converted to its dtype.
//
// Formats register themselves with register_checkpoint_format from their own .cpp (a static
// registrar). flame_models is a static library: an object file nobody references is not linked, so a
// family's load function should live in the same .cpp as its registrar (then using the family links
// its formats). The VAE formats are registered by vae_checkpoint.cpp and re-registered on first use.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <flame/flame.h>
#include <flame/io/safetensors.h>
#include <flame/nn/float8.h>
#include <flame/nn/module.h>

#include "models/key_plan.h"

namespace flame_diffusion::models {

// A config.json (or any JSON object) read with typed getters. A missing key or a JSON null gives
// the fallback (or, without one, an error naming the file and the key); a value of the wrong type
// is an error naming the file, the key, the type wanted and the value found.
class JsonConfig {
 public:
  JsonConfig();  // an empty object (every getter gives its fallback)
  static JsonConfig from_file(const std::string& path);
  // `origin` names the text in messages (a path, "config string").
  static JsonConfig parse(const std::string& text, const std::string& origin);

  const std::string& origin() const;
  bool has(const std::string& key) const;  // present and not null
  std::vector<std::string> keys() const;

  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  double get_double(const std::string& key) const;  // integers are accepted
  double get_double(const std::string& key, double fallback) const;
  std::optional<double> get_optional_double(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  bool get_bool(const std::string& key, bool fallback) const;
  std::string get_string(const std::string& key) const;
  std::string get_string(const std::string& key, const std::string& fallback) const;
  std::vector<int64_t> get_ints(const std::string& key) const;
  std::vector<int64_t> get_ints(const std::string& key, const std::vector<int64_t>& fallback) const;
  std::vector<double> get_doubles(const std::string& key, const std::vector<double>& fallback) const;
  std::vector<std::string> get_strings(const std::string& key, const std::vector<std::string>& fallback) const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

// An opened checkpoint: one or more safetensors files and, for a diffusers folder, its config.json.
class Checkpoint {
 public:
  struct OpenOptions {
    // For a pipeline folder: the model's subfolder ("vae", "unet"). Also tried when `path` is a
    // model folder's parent that has this subfolder.
    std::string subfolder;
    // "" prefers diffusion_pytorch_model.safetensors and falls back to the .fp16 file; "fp16" the
    // other way round.
    std::string variant;
  };
  // Raises flame::Error naming the path and what was looked for when nothing loadable is there,
  // and the file when a file is truncated or its header is corrupt.
  static Checkpoint open(const std::string& path, const OpenOptions& options);
  static Checkpoint open(const std::string& path) { return open(path, OpenOptions{}); }

  // The resolved file (single file) or folder, for messages.
  const std::string& path() const;
  // "single file /x/ae.safetensors", "diffusers folder /x/vae (2 shards)".
  std::string description() const;
  bool is_single_file() const;
  const std::vector<std::string>& files() const;
  // config.json of a diffusers folder; nullptr for a single file.
  const JsonConfig* config() const;

  // Every tensor name of every file, in file order.
  const std::vector<std::string>& keys() const;
  bool contains(std::string_view key) const;
  bool has_prefix(std::string_view prefix) const;  // some key starts with it
  // Raise flame::Error naming the key and the checkpoint when absent.
  const flame::io::TensorInfo& info(std::string_view key) const;
  const std::string& file_of(std::string_view key) const;
  // One tensor on `device`, converted to `dtype` (integer tensors keep theirs when dtype is a
  // floating type and the stored one is not, as Module::to).
  flame::Tensor load(std::string_view key, flame::Device device = flame::Device::cpu(),
                     std::optional<flame::DType> dtype = std::nullopt) const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

// ---- formats (Note [Checkpoint files]) ----
struct CheckpointFormat {
  std::string name;  // "vae-diffusers", "vae-original", "sdxl-unet"
  std::string kind;  // the model kind it loads: "vae", "unet", ...
  // The stored-key prefix under which `ck` holds this layout ("first_stage_model.", "" for bare
  // names), or nullopt when it does not.
  std::function<std::optional<std::string>(const Checkpoint& ck)> detect;
  // The plan (diffusers names <- stored keys under `prefix`), from key names and shapes only.
  std::function<KeyPlan(const Checkpoint& ck, const std::string& prefix)> plan;
  int priority = 0;  // formats of a kind are tried highest first, then by name
};

// Adds `format` (replacing one of the same name). Returns true, so a .cpp can register from a
// namespace-scope initializer: `const bool registered = register_checkpoint_format({...});`.
bool register_checkpoint_format(CheckpointFormat format);
// Raises flame::Error listing the registered names when `name` is unknown.
CheckpointFormat checkpoint_format(const std::string& name);
// Registered names (of one kind when `kind` is not empty), sorted.
std::vector<std::string> checkpoint_format_names(const std::string& kind = "");

struct DetectedFormat {
  std::string format;  // registered name
  std::string prefix;  // stored-key prefix
};
// The first registered format of `kind` that recognises `ck`. Raises flame::Error naming the
// checkpoint, the kind, the formats tried and the file's first keys when none does.
DetectedFormat detect_checkpoint_format(const Checkpoint& ck, const std::string& kind);

// The plan of a file that already uses the model's names: every stored key under `prefix` copied
// to the same name without the prefix.
KeyPlan identity_plan(const Checkpoint& ck, const std::string& prefix = "");

// What a plan's targets look like when applied to `ck` (target name -> shape): for inferring a
// model's configuration from a single file. Raises as load_checkpoint for sources that are absent
// or whose shapes do not fit the op.
std::vector<std::pair<std::string, flame::Shape>> planned_shapes(const Checkpoint& ck, const KeyPlan& plan);

struct LoadCheckpointOptions {
  std::string family;  // the family the caller guessed ("sdxl-vae"), for messages
  std::string format;  // the layout name, for messages
  // Stored keys under the plan's prefix that no entry consumes are an error unless set.
  bool allow_unplaced = false;
  // Every Linear of the module ends up with a frozen 8-bit weight (flame/nn/float8.h): a weight
  // stored F8_E4M3 / F8_E5M2 keeps the file's codes (its scale_weight, or 1, per row; the plan's row
  // splits and half swaps move rows of codes), any other is quantised after loading.
  std::optional<flame::nn::Float8Options> float8;
  // With float8: a device each Linear is moved to before it is quantised (a module staged in host
  // memory then never holds more than one full-precision weight on that device at a time).
  std::optional<flame::Device> float8_device;
};
// Every problem that load_checkpoint would raise, one line each (empty when the plan fits).
std::vector<std::string> check_checkpoint(const flame::nn::Module& module, const Checkpoint& ck, const KeyPlan& plan,
                                          bool allow_unplaced = false);
// Checks (check_checkpoint; one flame::Error naming the checkpoint, family, format and the first
// problems) and then copies every planned tensor into the module's parameter or persistent buffer
// of that name: loaded one at a time to its device, converted to its dtype. No gradient recorded.
void load_checkpoint(flame::nn::Module& module, const Checkpoint& ck, const KeyPlan& plan,
                     const LoadCheckpointOptions& options = {});

}  // namespace flame_diffusion::models
