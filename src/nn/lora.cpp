// LoRA / DoRA on Linear, and the tree-wide adapter helpers (include/flame/nn/lora.h).
//
// Note [LoRA forward]: with s = scaling, x' = dropout(x) (training only), and the frozen W, b:
//   LoRA:  y = W x + b + s B A x'
//   DoRA:  m = lora_magnitude_vector, n = ||W + s B A||_row (detached, as the DoRA paper and
//          PEFT), g = m / n:
//            y = g (W x + s B A x) + b                          (no active dropout)
//            y = W x + b + (g - 1) W x' + g s B A x'            (dropout active: PEFT's form)
// merge() folds the update into W: W + s B A (LoRA) or g (W + s B A) (DoRA; g is kept to
// unmerge exactly), so merged and unmerged outputs agree in eval mode.
#include <cmath>

#include "flame/autograd.h"
#include "flame/nn/dropout.h"
#include "flame/nn/flatten.h"
#include "flame/nn/init.h"
#include "flame/nn/linear.h"
#include "flame/ops.h"

namespace flame::nn {

double lora_scaling(const LoraOptions& o, const char* op) {
  FLAME_CHECK(o.rank > 0, op, "rank must be > 0, got ", o.rank);
  FLAME_CHECK(std::isfinite(o.alpha), op, "alpha must be finite, got ", o.alpha);
  FLAME_CHECK(o.dropout >= 0.0 && o.dropout < 1.0, op, "dropout must be in [0, 1), got ", o.dropout);
  const double r = static_cast<double>(o.rank);
  return o.use_rslora ? o.alpha / std::sqrt(r) : o.alpha / r;
}

// ---- Linear's adapter ----
void Linear::add_lora(const LoraOptions& options) {
  FLAME_CHECK(!has_lora(), "add_lora", "this Linear (", extra_repr(), ") already has an adapter");
  scaling_ = nn::lora_scaling(options, "add_lora");
  const TensorOptions o(weight_.dtype(), weight_.device());
  // PEFT's init: A as a Linear (kaiming_uniform a = sqrt(5)), B zeros, so the adapter starts at 0.
  lora_A_ = register_module("lora_A", std::make_shared<Linear>(in_features_, options.rank, false, o));
  lora_B_ = register_module("lora_B", std::make_shared<Linear>(options.rank, out_features_, false, o));
  {
    Tensor b = lora_B_->weight();
    init::zeros_(b);
  }
  if (options.dropout > 0.0) {
    lora_dropout_ = register_module("lora_dropout", std::make_shared<Dropout>(options.dropout));
  } else {
    lora_dropout_ = register_module("lora_dropout", std::make_shared<Identity>());
  }
  for (Module* m : {static_cast<Module*>(lora_A_.get()), static_cast<Module*>(lora_B_.get()), lora_dropout_.get()}) {
    m->train(is_training());
  }
  weight_.requires_grad_(false);
  if (bias_.defined()) bias_.requires_grad_(false);
  lora_options_ = options;
  if (options.use_dora) {
    // m starts as the row norms of W (B = 0), so DoRA starts at the base output.
    Tensor m;
    {
      NoGradGuard no_grad;
      m = weight_.detach().norm(2.0, {1}).clone();
    }
    magnitude_ = register_parameter("lora_magnitude_vector", m);
  }
}

Tensor Linear::lora_delta_weight() const {
  FLAME_CHECK(has_lora(), "lora_delta_weight", "this Linear has no adapter");
  return lora_B_->weight().matmul(lora_A_->weight()) * scaling_;
}

Tensor Linear::dora_weight_norm(const Tensor& delta) const {
  NoGradGuard no_grad;
  return (weight_.detach() + delta.detach()).norm(2.0, {1});
}

Tensor Linear::forward(const Tensor& x) {
  if (!has_lora() || merged_) return functional::linear(x, weight_, bias_);
  const bool dropping = lora_options_.dropout > 0.0 && is_training();
  const Tensor xd = dropping ? lora_dropout_->forward(x) : x;
  const Tensor adapter = lora_B_->forward(lora_A_->forward(xd)) * scaling_;
  if (!lora_options_.use_dora) return functional::linear(x, weight_, bias_) + adapter;
  // Note [LoRA forward], DoRA rows.
  Tensor norm;
  {
    NoGradGuard no_grad;  // the norm is a constant for the gradient: record nothing for it
    norm = dora_weight_norm(lora_delta_weight());
  }
  const Tensor g = magnitude_ / norm;
  if (!dropping) {
    Tensor y = (functional::linear(x, weight_) + adapter) * g;
    return bias_.defined() ? y + bias_ : y;
  }
  return functional::linear(x, weight_, bias_) + functional::linear(xd, weight_) * (g - 1.0) + adapter * g;
}

void Linear::merge() {
  FLAME_CHECK(has_lora(), "merge", "this Linear (", extra_repr(), ") has no adapter");
  FLAME_CHECK(!merged_, "merge", "the adapter is already merged");
  NoGradGuard no_grad;
  const Tensor delta = lora_delta_weight();
  Tensor w = weight_;
  if (lora_options_.use_dora) {
    dora_factor_ = (magnitude_.detach() / dora_weight_norm(delta)).unsqueeze(1);
    w.copy_((weight_.detach() + delta) * dora_factor_);
  } else {
    w.add_(delta);
  }
  merged_ = true;
}

void Linear::unmerge() {
  FLAME_CHECK(has_lora(), "unmerge", "this Linear (", extra_repr(), ") has no adapter");
  FLAME_CHECK(merged_, "unmerge", "the adapter is not merged");
  NoGradGuard no_grad;
  const Tensor delta = lora_delta_weight();
  Tensor w = weight_;
  if (lora_options_.use_dora) {
    // The factor follows the weight if the module was converted while merged.
    w.copy_(weight_.detach() / dora_factor_.to(weight_.dtype(), weight_.device()) - delta);
    dora_factor_ = Tensor();
  } else {
    w.sub_(delta);
  }
  merged_ = false;
}

// ---- tree-wide helpers ----
bool is_lora_key(const std::string& key) {
  auto has = [&key](const char* part) { return key.find(part) != std::string::npos; };
  auto ends = [&key](const std::string& suffix) {
    return key.size() >= suffix.size() && key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return (key.rfind("lora_A.", 0) == 0 || has(".lora_A.") || key.rfind("lora_B.", 0) == 0 || has(".lora_B.") ||
          key == "lora_magnitude_vector" || ends(".lora_magnitude_vector"));
}

namespace {
bool matches_target(const std::string& name, const std::string& target) {
  if (name == target) return true;
  return name.size() > target.size() && name.compare(name.size() - target.size(), target.size(), target) == 0 &&
         name[name.size() - target.size() - 1] == '.';
}
// A module inside an adapter (lora_A, lora_B, ...) is never itself a target.
bool inside_adapter(const std::string& name) {
  std::size_t start = 0;
  while (start <= name.size()) {
    const std::size_t dot = std::min(name.find('.', start), name.size());
    if (dot - start >= 5 && name.compare(start, 5, "lora_") == 0) return true;
    start = dot + 1;
  }
  return false;
}
std::vector<LoraTarget*> adapted(Module& root) {
  std::vector<LoraTarget*> out;
  for (auto& [n, m] : root.named_modules()) {
    auto* t = dynamic_cast<LoraTarget*>(m.get());
    if (t && t->has_lora()) out.push_back(t);
  }
  return out;
}
}  // namespace

std::vector<std::string> apply_lora(Module& root, const LoraOptions& options, const std::vector<std::string>& targets) {
  lora_scaling(options, "apply_lora");
  FLAME_CHECK(!targets.empty(), "apply_lora", "no target module names given");
  std::vector<std::pair<std::string, LoraTarget*>> chosen;  // collected first: adding children
  for (auto& [n, m] : root.named_modules()) {               // while walking would revisit them
    auto* t = dynamic_cast<LoraTarget*>(m.get());
    if (!t || t->has_lora() || inside_adapter(n)) continue;
    for (const auto& target : targets) {
      if (matches_target(n, target)) {
        chosen.emplace_back(n, t);
        break;
      }
    }
  }
  if (chosen.empty()) {
    std::string list;
    for (const auto& t : targets) list += (list.empty() ? "'" : ", '") + t + "'";
    FLAME_FAIL("apply_lora", "no adaptable module (Linear) of ", root.name(), " matches the targets ", list);
  }
  std::vector<std::string> names;
  for (auto& [n, t] : chosen) {
    t->add_lora(options);
    names.push_back(n);
  }
  // As PEFT's get_peft_model: only the adapters train.
  for (auto& [n, p] : root.named_parameters()) {
    if (!is_lora_key(n) && p.requires_grad()) p.requires_grad_(false);
  }
  return names;
}

StateDict lora_state_dict(Module& root) {
  StateDict out;
  for (const auto& [k, t] : root.state_dict()) {
    if (is_lora_key(k)) out.insert(kPeftPrefix + k, t);
  }
  return out;
}

LoadReport load_lora_state_dict(Module& root, const StateDict& dict, bool strict) {
  // Validate against the adapter keys only, then load through Module::load_state_dict non-strictly
  // (its other keys are the frozen base, reported missing there by design).
  const std::string prefix = kPeftPrefix;
  StateDict stripped;
  for (const auto& [k, t] : dict) {
    stripped.insert(k.rfind(prefix, 0) == 0 ? k.substr(prefix.size()) : k, t);
  }
  LoadReport full = root.load_state_dict(StateDict(), false);  // collects the expected keys; loads nothing
  LoadReport report;
  std::vector<std::string> adapter_keys;
  for (const auto& k : full.missing_keys) {
    if (is_lora_key(k)) adapter_keys.push_back(k);
  }
  StateDict wanted;
  for (const auto& k : adapter_keys) {
    if (const Tensor* t = stripped.find(k)) {
      wanted.insert(k, *t);
    } else {
      report.missing_keys.push_back(prefix + k);
    }
  }
  for (const auto& [k, t] : stripped) {
    if (!wanted.contains(k)) report.unexpected_keys.push_back(prefix + k);
  }
  // Shapes and dtypes: a strict dry run on the subset tells us the mismatches without loading.
  StateDict current = root.state_dict();
  for (const auto& [k, t] : wanted) {
    const Tensor& mine = current.at(k);
    if (mine.sizes() != t.sizes() || mine.dtype() != t.dtype()) {
      report.mismatched.push_back({prefix + k, mine.sizes(), mine.dtype(), t.sizes(), t.dtype()});
    }
  }
  if (strict && !report.ok()) {
    FLAME_FAIL("load_lora_state_dict", "cannot load the adapter into ", root.name(), " (nothing was changed):\n",
               report.to_string());
  }
  StateDict loadable;
  for (const auto& [k, t] : wanted) {
    const Tensor& mine = current.at(k);
    if (mine.sizes() == t.sizes() && mine.dtype() == t.dtype()) loadable.insert(k, t);
  }
  (void)root.load_state_dict(loadable, false);
  return report;
}

void merge_lora(Module& root) {
  for (LoraTarget* t : adapted(root)) {
    if (!t->merged()) t->merge();
  }
}

void unmerge_lora(Module& root) {
  for (LoraTarget* t : adapted(root)) {
    if (t->merged()) t->unmerge();
  }
}

}  // namespace flame::nn
