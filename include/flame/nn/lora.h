#pragma once
// LoRA, DoRA and LoKr adapters (docs/nn.md, "LoRA" and "LoKr").
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
//
// LoKr (LyCORIS' Kronecker-product adapter, PEFT's LoKrConfig): `linear->add_lokr({.rank = 8})` or
// apply_lokr. The update is delta W = scale * kron(w1, w2), w1 [a, b] (or w1_a @ w1_b), w2 [c, d] (or
// w2_a @ w2_b), out = a * c, in = b * d; its parameters sit on the layer itself, so the keys read
// `...q_proj.lokr_w1`, `...q_proj.lokr_w2_a` as LyCORIS and PEFT name them. A layer holds one
// adapter, LoRA or LoKr; has_lora() says whether it holds either.
#include <cstdint>
#include <string>
#include <utility>
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

struct LokrOptions {
  int64_t factor = -1;  // split of out / in into two factors (lokr_factorization); -1: the most even
  int64_t rank = 8;     // of w2 = w2_a @ w2_b (and w1 with decompose_both); w2 is stored whole when
                        // 2 * rank >= max(c, d), as LyCORIS
  double alpha = 8.0;   // scale = alpha / rank; 0 means alpha = rank (LyCORIS); 1 when w1 and w2 are whole
  bool decompose_both = false;  // w1 = w1_a @ w1_b too (when 2 * rank < max(a, b), as LyCORIS)
  bool full_matrix = false;     // w1 and w2 whole whatever the rank (LyCORIS' full_matrix)
  bool unbalanced_factorization = false;  // out's larger factor goes to w1 (LyCORIS' option)
};

// The factor shapes and scale of one LoKr adapter: w1 [a, b], w2 [c, d]; out = a * c, in = b * d.
struct LokrLayout {
  int64_t a = 0, b = 0, c = 0, d = 0;
  int64_t rank = 0;  // inner size of the decomposed factors
  bool decompose_w1 = false, decompose_w2 = false;
  double scale = 1.0;
};

// LyCORIS' factorization(): dimension = m * n, m <= n. A positive factor dividing dimension gives
// (factor, dimension / factor) (ordered); otherwise the most even split with m <= factor (any m for
// factor -1), e.g. (128, -1) -> (8, 16), (360, 8) -> (8, 45), (127, -1) -> (1, 127).
std::pair<int64_t, int64_t> lokr_factorization(int64_t dimension, int64_t factor = -1);
// The layout LyCORIS gives a Linear [out, in] for these options; validates them (error names `op`).
LokrLayout lokr_layout(int64_t out_features, int64_t in_features, const LokrOptions& options, const char* op = "lokr");

class LoraTarget {
 public:
  virtual ~LoraTarget() = default;
  // Adds the adapter (error if one is already attached) and freezes the base parameters.
  virtual void add_lora(const LoraOptions& options) = 0;
  // Adds a LoKr adapter the same way; layers that cannot carry one raise (the default).
  virtual void add_lokr(const LokrOptions& options);
  // Whether an adapter (LoRA, DoRA or LoKr) is attached.
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
// PEFT's target_modules rule used by apply_lora / apply_lokr: `name` equals `target` or ends with
// "." + target.
bool matches_target(const std::string& name, const std::string& target);
// The same with LoKr adapters (matching, skipping and freezing as apply_lora).
std::vector<std::string> apply_lokr(Module& root, const LokrOptions& options, const std::vector<std::string>& targets);
// The adapter tensors only (lora_A/lora_B weights, DoRA magnitudes, LoKr factors), keyed as PEFT saves them:
// "base_model.model." + the module path, e.g. base_model.model.blocks.0.attn.q_proj.lora_A.weight.
StateDict lora_state_dict(Module& root);
// Loads an adapter state dict (keys with or without the PEFT prefix) into the adapters of root.
// strict: every adapter tensor of root must be present and nothing else. Copies values (identity
// kept); see Module::load_state_dict for the report.
LoadReport load_lora_state_dict(Module& root, const StateDict& dict, bool strict = true);
void merge_lora(Module& root);
void unmerge_lora(Module& root);
// Is `key` an adapter tensor's state-dict key (lora_A / lora_B / lora_magnitude_vector, lokr_w1,
// lokr_w1_a, lokr_w1_b, lokr_w2, lokr_w2_a, lokr_w2_b)?
bool is_lora_key(const std::string& key);
// Converts every adapter tensor of root to `dtype` in place (identity kept, Tensor::set_data), the
// base weights untouched: f32 adapters under a bf16 model.
void adapters_to(Module& root, DType dtype);

}  // namespace flame::nn
