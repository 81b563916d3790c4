#pragma once
// Training checkpoints: the whole training state (model, optimizer, scheduler, EMA, gradient
// scaler, random generators, step and data position) in ONE safetensors file, written atomically
// and loaded all-or-nothing. See docs/checkpoint.md.
//
//   Checkpoint ckpt;                       // default_generator() is always included ("rng.default")
//   ckpt.add("model", *model);             // nn::Module: state_dict()/load_state_dict(strict)
//   ckpt.add("optimizer", opt);            // any Stateful: optimizer, scheduler, EMA, GradScaler
//   ckpt.add("scheduler", *sched);
//   ckpt.add_generator("data", data_gen);  // more generators, "rng.data"
//   if (auto last = latest_checkpoint("runs/a")) ckpt.load(*last);  // resume
//   for (int64_t& step = ckpt.progress().step; step < total; ) {
//     ... train one step ...; ++step;
//     if (step % 1000 == 0) ckpt.save_rotating("runs/a", /*keep_last=*/3);
//   }
//
// File layout: tensor keys are "<component>.<key>" ("model.fc.weight", "optimizer.state.0.exp_avg",
// "rng.default.offset", "progress.step"); the safetensors "__metadata__" holds "format": "pt" and
// "flame.checkpoint": a JSON object with format_version, step, the components, user metadata and
// a checksum of every tensor (Note [Checkpoint format] in src/train/checkpoint.cpp).
//
// Note [Atomic checkpoints]: save() writes the whole file under a temporary name in the target's
// directory, fsyncs it, renames it over the target and fsyncs the directory. A process killed at
// any moment leaves either the previous file or the new one at the path, both complete; a crash
// leaves at most a temporary file behind (remove_stale_temporaries() removes those of dead
// processes). load() reads and checks everything (header, checksums, every component's keys,
// shapes and dtypes) before it changes any component; if a component still refuses its state, the
// components loaded before it are put back, so a failed load changes nothing.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "flame/device.h"
#include "flame/nn/module.h"
#include "flame/random.h"
#include "flame/stateful.h"

namespace flame {

// Step and named counters (epoch, data-loader position, samples seen...), saved as i64 scalars
// under "progress.": "progress.step", "progress.<counter>".
class TrainingProgress : public Stateful {
 public:
  int64_t step = 0;
  std::map<std::string, int64_t> counters;

  StateDict state_dict() const override;
  // Replaces step and every counter by the state's (counters not in the state are dropped).
  void load_state_dict(const StateDict& state) override;
};

struct CheckpointLoadOptions {
  // Every component registered must be in the file and every component of the file registered;
  // false: the missing and unexpected ones are reported in CheckpointInfo and skipped.
  bool strict = true;
  // Recompute every tensor's checksum and compare it with the one stored at save time.
  bool verify_checksums = true;
  // Where Stateful components receive their tensors (modules copy into their own tensors,
  // whatever their device). A component keeps them where it needs them.
  Device map_location = Device::cpu();
};

// What a checkpoint file says of itself (and, after load(), what the load did).
struct CheckpointInfo {
  std::string path;
  int64_t format_version = 0;
  int64_t step = 0;
  std::vector<std::string> components;  // in the file's order
  std::map<std::string, std::string> metadata;  // the user's (Checkpoint::set_metadata)
  // Filled by a non-strict load.
  std::vector<std::string> missing_components;     // registered, absent from the file
  std::vector<std::string> unexpected_components;  // in the file, not registered
  std::map<std::string, nn::LoadReport> module_reports;  // modules added with strict = false
};

// Reads the header and metadata of a checkpoint file (no tensor data); raises flame::Error naming
// the file when it is not a readable FLAME checkpoint.
CheckpointInfo read_checkpoint_info(const std::string& path);

class Checkpoint {
 public:
  Checkpoint();
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  // Registers a component once; it is referenced, not copied, and must outlive the Checkpoint.
  // Names: letters, digits, '_' and '-' (no '.'); "rng" and "progress" are the checkpoint's own.
  // A module added with strict = false loads the keys that match and reports the rest.
  Checkpoint& add(const std::string& name, nn::Module& module, bool strict = true);
  Checkpoint& add(const std::string& name, Stateful& component);
  // A generator saved as "rng.<name>.seed" and "rng.<name>.offset" (the CPU and CUDA backends
  // draw from the same counter-based generator state, so this is all a resumed run needs).
  Checkpoint& add_generator(const std::string& name, Generator& gen);
  // Leaves default_generator() out (it is in by default, as "rng.default").
  Checkpoint& exclude_default_generator();

  TrainingProgress& progress() { return progress_; }
  const TrainingProgress& progress() const { return progress_; }
  // User metadata saved in the file's JSON (strings); after load(), what the file held.
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The whole state as one dict, keys prefixed by component (what save() writes).
  StateDict state_dict() const;
  // Atomic (Note [Atomic checkpoints]). Tensors are copied to the host first, so a GPU state is
  // read once; the call returns when the file is durable.
  void save(const std::string& path) const;
  // All-or-nothing; errors name the file and the component or key.
  CheckpointInfo load(const std::string& path, const CheckpointLoadOptions& options = {});

  // Saves <dir>/<prefix>-<step, 10 digits>.safetensors (creating dir), then deletes all but the
  // newest `keep_last` checkpoints of that prefix (keep_last <= 0: keeps all) and the temporary
  // files of dead processes. Returns the path written.
  std::string save_rotating(const std::string& dir, int keep_last = 3, const std::string& prefix = "ckpt") const;

 private:
  struct Component {
    std::string name;
    nn::Module* module = nullptr;
    Stateful* stateful = nullptr;
    bool strict = true;
  };
  class RngState;
  void check_name(const std::string& name) const;
  void save_unchecked(const std::string& path) const;
  std::vector<Component> components_;
  std::vector<std::pair<std::string, Generator*>> generators_;
  bool include_default_generator_ = true;
  TrainingProgress progress_;
  std::map<std::string, std::string> metadata_;
};

// The path of <dir>/<prefix>-<step>.safetensors as save_rotating names it.
std::string checkpoint_path(const std::string& dir, int64_t step, const std::string& prefix = "ckpt");
// The newest checkpoint of `dir` (highest step) whose header reads as a FLAME checkpoint; skips
// temporary files and unreadable ones. nullopt when there is none.
std::optional<std::string> latest_checkpoint(const std::string& dir, const std::string& prefix = "ckpt");
// Deletes all but the newest `keep_last` checkpoints of `prefix` in `dir`; returns those deleted.
std::vector<std::string> keep_last_checkpoints(const std::string& dir, int keep_last,
                                               const std::string& prefix = "ckpt");
// Removes temporary files left in `dir` by saves of processes that no longer run; returns them.
std::vector<std::string> remove_stale_temporaries(const std::string& dir);

}  // namespace flame
