#pragma once
// LoRA and DoRA adapters (docs/nn.md, "LoRA").
//
// An adapter lives INSIDE the layer it adapts (users hold typed shared_ptr<Linear> members, so the
// tree is never rewritten): `linear->add_lora({.rank = 8, .alpha = 16})` registers the children
// `lora_A` (in -> r) and `lora_B` (r -> out) and, for DoRA, the parameter `lora_magnitude_vector`,
// so the state-dict keys read `...q_proj.lora_A.weight` exactly as PEFT writes them. The base
// weight and bias are frozen (no gradient buffer).
//
// Layers that can carry an adapter implement LoraTarget; the tree-wide helpers below (apply_lora,
// lora_state_dict, merge_lora, ...) work through it, so a new layer kind (Conv2d) plugs in by
// implementing the interface.
#include <cstdint>
#include <string>
#include <vector>

#include "flame/nn/module.h"
#include "flame/state_dict.h"

namespace flame::nn {

struct LoraOptions {
  int64_t rank = 8;
  double alpha = 8.0;
  double dropout = 0.0;    // on the adapter's input, training mode only
  bool use_rslora = false;  // scaling alpha / sqrt(rank) instead of alpha / rank
  bool use_dora = false;    // weight-decomposed LoRA: adds lora_magnitude_vector
};

// alpha / rank, or alpha / sqrt(rank) for rsLoRA; validates the options (error names `op`).
double lora_scaling(const LoraOptions& options, const char* op = "lora");

class LoraTarget {
 public:
  virtual ~LoraTarget() = default;
  // Adds the adapter (error if one is already attached) and freezes the base parameters.
  virtual void add_lora(const LoraOptions& options) = 0;
  virtual bool has_lora() const = 0;
  // Folds the adapter into the base weight (no-grad); forward then uses the base weight alone.
  virtual void merge() = 0;
  // Restores the base weight; the adapter is active again.
  virtual void unmerge() = 0;
  virtual bool merged() const = 0;
};

// PEFT adapter files prefix every key with this (PeftModel -> LoraModel -> the user's model).
inline constexpr const char* kPeftPrefix = "base_model.model.";

// Adds an adapter to every LoraTarget in the tree whose dotted name equals one of `targets` or
// ends with "." + target (PEFT's target_modules matching). Modules that already carry an adapter,
// and the adapters' own layers, are skipped. Then, as PEFT's get_peft_model, every parameter of
// root that is not an adapter's is frozen. Returns the names adapted; raises if none matched.
std::vector<std::string> apply_lora(Module& root, const LoraOptions& options, const std::vector<std::string>& targets);
// The adapter tensors only (lora_A/lora_B weights, DoRA magnitudes), keyed as PEFT saves them:
// "base_model.model." + the module path, e.g. base_model.model.blocks.0.attn.q_proj.lora_A.weight.
StateDict lora_state_dict(Module& root);
// Loads an adapter state dict (keys with or without the PEFT prefix) into the adapters of root.
// strict: every adapter tensor of root must be present and nothing else. Copies values (identity
// kept); see Module::load_state_dict for the report.
LoadReport load_lora_state_dict(Module& root, const StateDict& dict, bool strict = true);
void merge_lora(Module& root);
void unmerge_lora(Module& root);
// Is `key` an adapter tensor's state-dict key (lora_A / lora_B / lora_magnitude_vector)?
bool is_lora_key(const std::string& key);

}  // namespace flame::nn
