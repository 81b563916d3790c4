// LoRA / DoRA / LoKr on Linear, and the tree-wide adapter helpers (include/flame/nn/lora.h).
//
// Note [LoRA forward]: with s = scaling, x' = dropout(x) (training only), and the frozen W, b:
//   LoRA:  y = W x + b + (s B) A x'   (s scales B, not the output: Linear::lora_up)
//   DoRA:  m = lora_magnitude_vector, n = ||W + s B A||_row (detached, as the DoRA paper and
//          PEFT), g = m / n:
//            y = g (W x + s B A x) + b                          (no active dropout)
//            y = W x + b + (g - 1) W x' + g s B A x'            (dropout active: PEFT's form)
// merge() folds the update into W: W + s B A (LoRA) or g (W + s B A) (DoRA; g is kept to
// unmerge exactly), so merged and unmerged outputs agree in eval mode.
//
// Note [LoKr forward]: delta W = s kron(w1, w2), w1 [a, b], w2 [c, d], so row i c + k, column
// j d + l of delta W is s w1[i, j] w2[k, l]. With x viewed as X [N, b, d]:
//   y[n, i c + k] = s sum_j w1[i, j] (X[n] w2^T)[j, k],
// two batched GEMMs (N b d c + N c b a multiply-adds; w2_b then w2_a when w2 is decomposed) in place
// of forming the [out, in] product and a GEMM of N out in, and the backward gives the factors'
// gradients through the same small GEMMs (no [out, in] gradient). merge() forms the product.
#include <algorithm>
#include <cmath>
#include <functional>

#include "flame/autograd.h"
#include "flame/nn/dropout.h"
#include "flame/nn/flatten.h"
#include "flame/nn/init.h"
#include "flame/nn/linear.h"
#include "flame/ops.h"
#include "src/amp/autocast.h"

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
  const TensorOptions o = adapter_options();
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
      m = dense_weight(adapter_options().dtype_or(DType::f32)).norm(2.0, {1}).clone();
    }
    magnitude_ = register_parameter("lora_magnitude_vector", m);
  }
}

Tensor Linear::lora_delta_weight() const {
  FLAME_CHECK(lora_A_ != nullptr, "lora_delta_weight", "this Linear (", extra_repr(), ") has no LoRA adapter",
              has_lokr() ? " (it has a LoKr adapter: lokr_delta_weight)" : "");
  return lora_B_->weight().matmul(lora_A_->weight()) * scaling_;
}

// scaling * (h B^T) computed as h (scaling B)^T: the scale multiplies the [out, rank] weight instead
// of the [rows, out] result (a pass over the layer's output forward and one backward); with
// scaling 1 (alpha = rank) there is nothing to multiply.
// With a residual (the base layer's output) the sum is the GEMM's epilogue (functional::linear_add),
// where the two agree on a dtype (autocast casts both to the low one); otherwise linear + add.
Tensor Linear::lora_up(const Tensor& h, const Tensor& residual) const {
  const Tensor b = scaling_ == 1.0 ? lora_B_->weight() : lora_B_->weight() * scaling_;
  if (!residual.defined()) return functional::linear(h, b);
  if (residual.dtype() == h.dtype() || amp::detail::should_autocast(h)) return functional::linear_add(h, b, residual);
  return residual + functional::linear(h, b);
}

Tensor Linear::dora_weight_norm(const Tensor& delta) const {
  NoGradGuard no_grad;
  const Tensor w = is_float8() ? dense_weight(delta.dtype()) : weight_.detach();
  return (w + delta.detach()).norm(2.0, {1});
}

Tensor Linear::forward(const Tensor& x) {
  if (!has_lora() || merged_) return base_forward(x, bias_);
  if (has_lokr()) return base_forward(x, bias_) + lokr_forward(x);
  const bool dropping = lora_options_.dropout > 0.0 && is_training();
  const Tensor xd = dropping ? lora_dropout_->forward(x) : x;
  if (!lora_options_.use_dora) {
    const Tensor base = base_forward(x, bias_);
    return lora_up(lora_A_->forward(xd), base);  // Note [Residual epilogue]: the add in the GEMM
  }
  const Tensor adapter = lora_up(lora_A_->forward(xd));
  // Note [LoRA forward], DoRA rows.
  Tensor norm;
  {
    NoGradGuard no_grad;  // the norm is a constant for the gradient: record nothing for it
    norm = dora_weight_norm(lora_delta_weight());
  }
  const Tensor g = magnitude_ / norm;
  if (!dropping) {
    Tensor y = (base_forward(x, Tensor()) + adapter) * g;
    return bias_.defined() ? y + bias_ : y;
  }
  return base_forward(x, bias_) + base_forward(xd, Tensor()) * (g - 1.0) + adapter * g;
}

void Linear::merge() {
  FLAME_CHECK(has_lora(), "merge", "this Linear (", extra_repr(), ") has no adapter");
  FLAME_CHECK(!merged_, "merge", "the adapter is already merged");
  FLAME_CHECK(!is_float8(), "merge", "this Linear (", extra_repr(), ") keeps its weight in 8 bits: merging would ",
              "requantise it; merge into the full-precision base (load it without quantize_float8), then quantise");
  NoGradGuard no_grad;
  const Tensor delta = has_lokr() ? lokr_delta_weight().to(weight_.dtype()) : lora_delta_weight();
  Tensor w = weight_;
  if (!has_lokr() && lora_options_.use_dora) {
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
  const Tensor delta = has_lokr() ? lokr_delta_weight().to(weight_.dtype()) : lora_delta_weight();
  Tensor w = weight_;
  if (!has_lokr() && lora_options_.use_dora) {
    // The factor follows the weight if the module was converted while merged.
    w.copy_(weight_.detach() / dora_factor_.to(weight_.dtype(), weight_.device()) - delta);
    dora_factor_ = Tensor();
  } else {
    w.sub_(delta);
  }
  merged_ = false;
}

// ---- LoKr ----
std::pair<int64_t, int64_t> lokr_factorization(int64_t dimension, int64_t factor) {
  FLAME_CHECK(dimension > 0, "lokr_factorization", "dimension must be > 0, got ", dimension);
  FLAME_CHECK(factor == -1 || factor > 0, "lokr_factorization", "factor must be -1 or > 0, got ", factor);
  if (factor > 0 && dimension % factor == 0) {
    const int64_t m = factor, n = dimension / factor;
    return m > n ? std::pair{n, m} : std::pair{m, n};
  }
  const int64_t limit = factor < 0 ? dimension : factor;
  // Walk the divisors upwards while m + n does not grow and m stays within the limit.
  int64_t m = 1, n = dimension;
  while (m < n) {
    int64_t next = m + 1;
    while (dimension % next != 0) ++next;
    const int64_t next_n = dimension / next;
    if (next + next_n > m + n || next > limit) break;
    m = next;
    n = next_n;
  }
  return m > n ? std::pair{n, m} : std::pair{m, n};
}

LokrLayout lokr_layout(int64_t out_features, int64_t in_features, const LokrOptions& o, const char* op) {
  FLAME_CHECK(o.rank > 0, op, "rank must be > 0, got ", o.rank);
  FLAME_CHECK(o.factor == -1 || o.factor > 0, op, "factor must be -1 (most even split) or > 0, got ", o.factor);
  FLAME_CHECK(std::isfinite(o.alpha), op, "alpha must be finite, got ", o.alpha);
  FLAME_CHECK(out_features > 0 && in_features > 0, op, "the layer [", out_features, ", ", in_features,
              "] has no weights to adapt");
  auto [out_small, out_large] = lokr_factorization(out_features, o.factor);
  const auto [in_small, in_large] = lokr_factorization(in_features, o.factor);
  if (o.unbalanced_factorization) std::swap(out_small, out_large);
  LokrLayout l;
  l.a = out_small;
  l.c = out_large;
  l.b = in_small;
  l.d = in_large;
  l.rank = o.rank;
  l.decompose_w1 = o.decompose_both && !o.full_matrix && 2 * o.rank < std::max(l.a, l.b);
  l.decompose_w2 = !o.full_matrix && 2 * o.rank < std::max(l.c, l.d);
  const double alpha = o.alpha == 0.0 ? static_cast<double>(o.rank) : o.alpha;
  l.scale = (l.decompose_w1 || l.decompose_w2) ? alpha / static_cast<double>(o.rank) : 1.0;
  return l;
}

void LoraTarget::add_lokr(const LokrOptions&) {
  const auto* m = dynamic_cast<const Module*>(this);
  FLAME_FAIL("add_lokr", "LoKr adapters are supported on Linear layers only, not on ", m ? m->name() : "this layer",
             m ? " (" + m->extra_repr() + ")" : "");
}

void Linear::add_lokr(const LokrOptions& options) {
  add_lokr(nn::lokr_layout(out_features_, in_features_, options, "add_lokr"));
}

void Linear::add_lokr(const LokrLayout& l) {
  FLAME_CHECK(!has_lora(), "add_lokr", "this Linear (", extra_repr(), ") already has an adapter");
  FLAME_CHECK(l.a > 0 && l.b > 0 && l.c > 0 && l.d > 0 && l.a * l.c == out_features_ && l.b * l.d == in_features_,
              "add_lokr", "w1 [", l.a, ", ", l.b, "] and w2 [", l.c, ", ", l.d, "] do not factor this Linear (",
              extra_repr(), "): a * c must be ", out_features_, " and b * d ", in_features_);
  FLAME_CHECK(!(l.decompose_w1 || l.decompose_w2) || l.rank > 0, "add_lokr", "a decomposed factor needs rank > 0, got ",
              l.rank);
  FLAME_CHECK(std::isfinite(l.scale), "add_lokr", "scale must be finite, got ", l.scale);
  const TensorOptions o = adapter_options();
  const double a5 = std::sqrt(5.0);
  auto param = [&](const char* name, const Shape& shape, bool zero) {
    Tensor t = Tensor::empty(shape, o);
    if (zero) init::zeros_(t);
    else init::kaiming_uniform_(t, a5);
    return register_parameter(name, t);
  };
  if (l.decompose_w1) {
    lokr_.w1_a = param("lokr_w1_a", {l.a, l.rank}, false);
    lokr_.w1_b = param("lokr_w1_b", {l.rank, l.b}, false);
  } else {
    lokr_.w1 = param("lokr_w1", {l.a, l.b}, false);
  }
  if (l.decompose_w2) {
    lokr_.w2_a = param("lokr_w2_a", {l.c, l.rank}, false);
    lokr_.w2_b = param("lokr_w2_b", {l.rank, l.d}, true);
  } else {
    lokr_.w2 = param("lokr_w2", {l.c, l.d}, true);
  }
  weight_.requires_grad_(false);
  if (bias_.defined()) bias_.requires_grad_(false);
  lokr_layout_ = l;
}

Tensor Linear::lokr_w1() const {
  FLAME_CHECK(has_lokr(), "lokr_w1", "this Linear (", extra_repr(), ") has no LoKr adapter");
  return lokr_layout_.decompose_w1 ? lokr_.w1_a.matmul(lokr_.w1_b) : lokr_.w1;
}

Tensor Linear::lokr_w2() const {
  FLAME_CHECK(has_lokr(), "lokr_w2", "this Linear (", extra_repr(), ") has no LoKr adapter");
  return lokr_layout_.decompose_w2 ? lokr_.w2_a.matmul(lokr_.w2_b) : lokr_.w2;
}

Tensor Linear::lokr_delta_weight() const {
  const LokrLayout& l = lokr_layout_;
  const Tensor w1 = lokr_w1(), w2 = lokr_w2();
  // kron(w1, w2) as a broadcast product [a, c, b, d] -> [a c, b d].
  return (w1.reshape({l.a, 1, l.b, 1}) * w2.reshape({1, l.c, 1, l.d})).reshape({l.a * l.c, l.b * l.d}) * l.scale;
}

Tensor Linear::lokr_forward(const Tensor& x) const {
  // Note [LoKr forward]
  const LokrLayout& l = lokr_layout_;
  Shape out_shape = x.sizes();
  const int64_t n = in_features_ == 0 ? 0 : x.numel() / in_features_;
  out_shape.back() = out_features_;
  Tensor h = x.reshape({n, l.b, l.d});
  h = l.decompose_w2 ? h.matmul(lokr_.w2_b.t()).matmul(lokr_.w2_a.t()) : h.matmul(lokr_.w2.t());  // [N, b, c]
  const Tensor w1 = lokr_w1() * l.scale;                                                          // [a, b], scaled
  return h.transpose(1, 2).matmul(w1.t()).transpose(1, 2).reshape(out_shape);                     // [N, c, a] -> [..., out]
}

// ---- tree-wide helpers ----
bool is_lora_key(const std::string& key) {
  auto has = [&key](const char* part) { return key.find(part) != std::string::npos; };
  auto ends = [&key](const std::string& suffix) {
    return key.size() >= suffix.size() && key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (key.rfind("lora_A.", 0) == 0 || has(".lora_A.") || key.rfind("lora_B.", 0) == 0 || has(".lora_B.") ||
      key == "lora_magnitude_vector" || ends(".lora_magnitude_vector")) {
    return true;
  }
  for (const char* p : {"lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b"}) {
    if (key == p || ends(std::string(".") + p)) return true;
  }
  return false;
}

void adapters_to(Module& root, DType dtype) {
  for (auto& [n, p] : root.named_parameters()) {
    if (is_lora_key(n) && p.dtype() != dtype) {
      NoGradGuard no_grad;
      p.set_data(p.to(dtype));
    }
  }
}

bool matches_target(const std::string& name, const std::string& target) {
  if (name == target) return true;
  return name.size() > target.size() && name.compare(name.size() - target.size(), target.size(), target) == 0 &&
         name[name.size() - target.size() - 1] == '.';
}

namespace {
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

namespace {
// apply_lora / apply_lokr: the matching, the adapter added by `add`, then the freezing.
// `check` sees every chosen module before any is changed.
std::vector<std::string> apply_adapter(Module& root, const std::vector<std::string>& targets, const char* op,
                                       const std::function<void(LoraTarget&)>& add,
                                       const std::function<void(const std::string&, LoraTarget&)>& check = {}) {
  FLAME_CHECK(!targets.empty(), op, "no target module names given");
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
    FLAME_FAIL(op, "no adaptable module (Linear) of ", root.name(), " matches the targets ", list);
  }
  if (check) {
    for (auto& [n, t] : chosen) check(n, *t);
  }
  std::vector<std::string> names;
  for (auto& [n, t] : chosen) {
    add(*t);
    names.push_back(n);
  }
  // As PEFT's get_peft_model: only the adapters train.
  for (auto& [n, p] : root.named_parameters()) {
    if (!is_lora_key(n) && p.requires_grad()) p.requires_grad_(false);
  }
  return names;
}
}  // namespace

std::vector<std::string> apply_lora(Module& root, const LoraOptions& options, const std::vector<std::string>& targets) {
  lora_scaling(options, "apply_lora");
  return apply_adapter(root, targets, "apply_lora", [&](LoraTarget& t) { t.add_lora(options); });
}

std::vector<std::string> apply_lokr(Module& root, const LokrOptions& options, const std::vector<std::string>& targets) {
  (void)lokr_layout(4, 4, options, "apply_lokr");  // the options' own checks, before any layer changes
  return apply_adapter(root, targets, "apply_lokr", [&](LoraTarget& t) { t.add_lokr(options); },
                       [&](const std::string& name, LoraTarget& t) {
                         auto* m = dynamic_cast<Module*>(&t);
                         FLAME_CHECK(dynamic_cast<Linear*>(&t), "apply_lokr", "the target ", name, " is a ",
                                     m ? m->name() : "layer", "; LoKr adapters are supported on Linear layers only "
                                     "(narrow the targets; nothing was changed)");
                       });
}

Float8Report quantize_float8(Module& root, const Float8Options& options,
                             const std::function<bool(const std::string&, const Linear&)>& filter) {
  std::vector<std::pair<std::string, Linear*>> chosen;  // collected first: conversion adds buffers
  for (auto& [n, m] : root.named_modules()) {
    auto* l = dynamic_cast<Linear*>(m.get());
    if (!l || l->is_float8() || inside_adapter(n) || l->weight().requires_grad()) continue;
    if (filter && !filter(n, *l)) continue;
    chosen.emplace_back(n, l);
  }
  Float8Report report;
  for (auto& [n, l] : chosen) {
    report.bytes_before += static_cast<int64_t>(l->weight().nbytes());
    l->to_float8(options);
    report.bytes_after += static_cast<int64_t>(l->weight().nbytes() + l->weight_scale().nbytes());
    ++report.layers;
  }
  return report;
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
