// nn::Module: registration, traversal, modes, conversion and state dicts.
//
// Note [Module traversal order]: PyTorch's order everywhere. A module lists its own parameters
// (then buffers) in registration order, then recurses into its children in registration order.
// A tensor or module reachable twice (tied weights, a shared block) is listed once, under the
// first name it was reached by, in parameters()/named_modules() (PyTorch's remove_duplicate);
// state_dict() lists every name, as PyTorch does, so tied weights appear under each key.
#include "flame/nn/module.h"

#include <algorithm>
#include <sstream>
#include <unordered_set>
#include <vector>

#include "flame/autograd.h"
#include "src/autograd/record.h"
#include "src/core/profiler_context.h"

namespace flame::nn {

namespace {
std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}
std::string describe(const Shape& s, DType t) { return shape_str(s) + " " + dtype_name(t); }
}  // namespace

std::string LoadReport::to_string() const {
  std::ostringstream os;
  for (const auto& k : missing_keys) os << "missing key '" << k << "'\n";
  for (const auto& k : unexpected_keys) os << "unexpected key '" << k << "'\n";
  for (const auto& m : mismatched) {
    os << "mismatch for '" << m.name << "': the module holds " << describe(m.expected_shape, m.expected_dtype)
       << ", the state dict has " << describe(m.got_shape, m.got_dtype) << "\n";
  }
  return os.str();
}

Tensor Module::forward(const Tensor&) {
  FLAME_FAIL("forward", "module ", name(), " does not implement forward(const Tensor&); call its own methods");
}

// ---- registration ----
void Module::check_new_name(const std::string& n, const char* op) const {
  FLAME_CHECK(!n.empty(), op, "empty name in module ", name());
  FLAME_CHECK(n.find('.') == std::string::npos, op, "name '", n, "' in module ", name(),
              " contains '.', which separates path components");
  auto taken = [&n](const auto& v) {
    return std::any_of(v.begin(), v.end(), [&n](const auto& s) { return s.name == n; });
  };
  const bool child = std::any_of(children_.begin(), children_.end(), [&n](const auto& c) { return c.first == n; });
  FLAME_CHECK(!taken(params_) && !taken(buffers_) && !child, op, "module ", name(), " already has a member named '",
              n, "'");
}

Tensor Module::register_parameter(const std::string& n, Tensor t, bool requires_grad) {
  if (!t.defined()) return t;
  check_new_name(n, "register_parameter");
  FLAME_CHECK(t.is_leaf(), "register_parameter", "parameter '", n, "' of ", name(),
              " comes from an op (", t.grad_fn_name(), "); parameters must be leaves: pass a detached tensor");
  if (is_floating(t.dtype())) t.requires_grad_(requires_grad);
  params_.push_back({n, t, true});
  return t;
}

Tensor Module::register_buffer(const std::string& n, Tensor t, bool persistent) {
  if (!t.defined()) return t;
  check_new_name(n, "register_buffer");
  FLAME_CHECK(!t.requires_grad(), "register_buffer", "buffer '", n, "' of ", name(),
              " requires grad; buffers are state, not parameters (use register_parameter)");
  buffers_.push_back({n, t, persistent});
  return t;
}

void Module::register_module_impl(const std::string& n, ModulePtr module) {
  check_new_name(n, "register_module");
  FLAME_CHECK(module != nullptr, "register_module", "child '", n, "' of ", name(), " is null");
  FLAME_CHECK(module.get() != this, "register_module", "module ", name(), " cannot be its own child ('", n, "')");
  if (module->parent_ == nullptr && module->registered_name_.empty()) {
    module->registered_name_ = n;
    module->parent_ = this;
  }
  children_.emplace_back(n, std::move(module));
}

Module::~Module() {
  for (auto& slot : children_) {
    if (slot.second && slot.second->parent_ == this) slot.second->parent_ = nullptr;
  }
}

std::string Module::path() const {
  std::vector<const std::string*> names;
  for (const Module* m = this; m->parent_ != nullptr; m = m->parent_) names.push_back(&m->registered_name_);
  std::string out;
  for (auto it = names.rbegin(); it != names.rend(); ++it) {
    if (!out.empty()) out += '.';
    out += **it;
  }
  return out;
}

Module::CallScope::CallScope(const Module& module) {
  // Note [Allocation context] in src/profiler/memory_profiler.cpp: the path is only made while
  // someone reads it (one load and one thread-local flag test otherwise).
  const bool wanted = profiler_detail::recording() || autograd_detail::t_state.anomaly;
  if (wanted && module.parent_ != nullptr) ctx_ = profiler_detail::push_module(profiler_detail::intern(module.path()));
}

Module::CallScope::~CallScope() { profiler_detail::pop_module(static_cast<profiler_detail::ThreadContext*>(ctx_)); }

Tensor Module::operator()(const Tensor& x) {
  const CallScope scope(*this);
  return forward(x);
}

// ---- traversal ----
void Module::collect_named(std::vector<std::pair<std::string, Tensor>>& out, const std::string& prefix,
                           bool params, bool recurse, std::vector<const void*>& seen) const {
  for (const auto& s : params ? params_ : buffers_) {
    const void* id = s.tensor.impl();
    if (std::find(seen.begin(), seen.end(), id) != seen.end()) continue;
    seen.push_back(id);
    out.emplace_back(join(prefix, s.name), s.tensor);
  }
  if (!recurse) return;
  for (const auto& [n, c] : children_) {
    if (std::find(seen.begin(), seen.end(), static_cast<const void*>(c.get())) != seen.end()) continue;
    seen.push_back(c.get());  // modules and tensors share the set: distinct objects, distinct addresses
    c->collect_named(out, join(prefix, n), params, true, seen);
  }
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters(bool recurse) const {
  std::vector<std::pair<std::string, Tensor>> out;
  std::vector<const void*> seen;
  collect_named(out, "", true, recurse, seen);
  return out;
}

TensorList Module::parameters(bool recurse) const {
  TensorList out;
  for (auto& [n, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, Tensor>> Module::named_buffers(bool recurse) const {
  std::vector<std::pair<std::string, Tensor>> out;
  std::vector<const void*> seen;
  collect_named(out, "", false, recurse, seen);
  return out;
}

TensorList Module::buffers(bool recurse) const {
  TensorList out;
  for (auto& [n, t] : named_buffers(recurse)) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, ModulePtr>> Module::named_children() const { return children_; }

std::vector<ModulePtr> Module::children() const {
  std::vector<ModulePtr> out;
  for (const auto& [n, c] : children_) out.push_back(c);
  return out;
}

void Module::collect_modules(std::vector<std::pair<std::string, ModulePtr>>& out, const std::string& prefix,
                             std::vector<const Module*>& seen) {
  for (const auto& [n, c] : children_) {
    if (std::find(seen.begin(), seen.end(), c.get()) != seen.end()) continue;
    seen.push_back(c.get());
    out.emplace_back(join(prefix, n), c);
    c->collect_modules(out, join(prefix, n), seen);
  }
}

std::vector<std::pair<std::string, ModulePtr>> Module::named_modules() {
  // A module built on the stack has no shared owner; it is listed with a non-owning handle.
  ModulePtr self = weak_from_this().lock();
  if (!self) self = ModulePtr(this, [](Module*) {});
  std::vector<std::pair<std::string, ModulePtr>> out{{"", self}};
  std::vector<const Module*> seen{this};
  collect_modules(out, "", seen);
  return out;
}

std::vector<ModulePtr> Module::modules() {
  std::vector<ModulePtr> out;
  for (auto& [n, m] : named_modules()) out.push_back(m);
  return out;
}

Tensor Module::parameter(const std::string& n) const {
  for (const auto& s : params_) {
    if (s.name == n) return s.tensor;
  }
  FLAME_FAIL("parameter", "module ", name(), " has no parameter named '", n, "'");
}

Tensor Module::buffer(const std::string& n) const {
  for (const auto& s : buffers_) {
    if (s.name == n) return s.tensor;
  }
  FLAME_FAIL("buffer", "module ", name(), " has no buffer named '", n, "'");
}

ModulePtr Module::child(const std::string& n) const {
  for (const auto& [cn, c] : children_) {
    if (cn == n) return c;
  }
  FLAME_FAIL("child", "module ", name(), " has no child named '", n, "'");
}

ModulePtr Module::submodule(const std::string& path) {
  ModulePtr cur = weak_from_this().lock();
  if (!cur) cur = ModulePtr(this, [](Module*) {});
  if (path.empty()) return cur;
  std::size_t start = 0;
  while (start <= path.size()) {
    const std::size_t dot = std::min(path.find('.', start), path.size());
    const std::string part = path.substr(start, dot - start);
    ModulePtr next;
    for (const auto& [cn, c] : cur->children_) {
      if (cn == part) next = c;
    }
    FLAME_CHECK(next != nullptr, "submodule", "no module at '", path, "': ", cur->name(), " at '",
                path.substr(0, start == 0 ? 0 : start - 1), "' has no child '", part, "'");
    cur = next;
    start = dot + 1;
  }
  return cur;
}

Module& Module::apply(const std::function<void(Module&)>& fn) {
  for (auto& [n, c] : children_) c->apply(fn);
  fn(*this);
  return *this;
}

// ---- modes ----
Module& Module::train(bool on) {
  training_ = on;
  on_train(on);
  for (auto& [n, c] : children_) c->train(on);
  return *this;
}

Module& Module::requires_grad_(bool on) {
  for (Tensor& p : parameters()) {
    if (is_floating(p.dtype())) p.requires_grad_(on);
  }
  return *this;
}

int64_t Module::num_parameters(bool trainable_only) const {
  int64_t n = 0;
  for (const Tensor& p : parameters()) {
    if (!trainable_only || p.requires_grad()) n += p.numel();
  }
  return n;
}

// ---- conversion ----
void Module::convert(std::optional<DType> dtype, std::optional<Device> device) {
  std::vector<Tensor> all = parameters();
  for (Tensor& b : buffers()) all.push_back(b);
  // Convert everything first, then install: a failure (out of memory) leaves the module unchanged.
  std::vector<Tensor> converted;
  converted.reserve(all.size());
  {
    NoGradGuard no_grad;
    for (const Tensor& t : all) {
      Tensor d = t.detach();
      if (dtype && is_floating(d.dtype())) d = d.to(*dtype);
      if (device) d = d.to(*device);
      // to() returns the same storage when nothing changes: keep it (no copy, no version bump).
      converted.push_back(d.shares_storage(t) && d.dtype() == t.dtype() ? Tensor() : d);
    }
  }
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (converted[i].defined()) all[i].set_data(converted[i]);
  }
}

Module& Module::to(Device device) {
  convert(std::nullopt, device);
  return *this;
}
Module& Module::to(DType dtype) {
  convert(dtype, std::nullopt);
  return *this;
}
Module& Module::to(DType dtype, Device device) {
  convert(dtype, device);
  return *this;
}

// ---- state dicts ----
void Module::collect_state(std::vector<std::pair<std::string, Tensor>>& out, const std::string& prefix) const {
  for (const auto& s : params_) out.emplace_back(join(prefix, s.name), s.tensor);
  for (const auto& s : buffers_) {
    if (s.persistent) out.emplace_back(join(prefix, s.name), s.tensor);
  }
  for (const auto& [n, c] : children_) c->collect_state(out, join(prefix, n));
}

StateDict Module::state_dict() const {
  std::vector<std::pair<std::string, Tensor>> live;
  collect_state(live, "");
  StateDict out;
  for (auto& [k, t] : live) out.insert(k, t.detach());
  return out;
}

LoadReport Module::load_state_dict(const StateDict& dict, bool strict) {
  std::vector<std::pair<std::string, Tensor>> targets;  // the live tensors, by key
  collect_state(targets, "");
  LoadReport report;
  std::vector<std::pair<Tensor, Tensor>> copies;  // (destination, source)
  for (const auto& [k, dst] : targets) {
    const Tensor* src = dict.find(k);
    if (!src) {
      report.missing_keys.push_back(k);
      continue;
    }
    if (!src->defined() || src->sizes() != dst.sizes() || src->dtype() != dst.dtype()) {
      report.mismatched.push_back({k, dst.sizes(), dst.dtype(), src->defined() ? src->sizes() : Shape{},
                                   src->defined() ? src->dtype() : dst.dtype()});
      continue;
    }
    copies.emplace_back(dst, *src);
  }
  std::unordered_set<std::string> known;
  for (const auto& [k, t] : targets) known.insert(k);
  for (const auto& [k, t] : dict) {
    if (!known.count(k)) report.unexpected_keys.push_back(k);
  }
  if (strict && !report.ok()) {
    FLAME_FAIL("load_state_dict", "cannot load into ", name(), " (nothing was changed):\n", report.to_string());
  }
  NoGradGuard no_grad;
  for (auto& [dst, src] : copies) {
    Tensor d = dst;
    d.copy_(src.detach());
  }
  return report;
}

// ---- printing ----
void Module::print(std::ostream& os, int indent) const {
  const std::string extra = extra_repr();
  os << name() << "(";
  if (children_.empty()) {
    os << extra << ")";
    return;
  }
  const std::string pad(static_cast<std::size_t>(indent + 2), ' ');
  os << "\n";
  if (!extra.empty()) os << pad << extra << "\n";
  for (const auto& [n, c] : children_) {
    os << pad << "(" << n << "): ";
    c->print(os, indent + 2);
    os << "\n";
  }
  os << std::string(static_cast<std::size_t>(indent), ' ') << ")";
}

std::string Module::to_string() const {
  std::ostringstream os;
  print(os, 0);
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Module& m) { return os << m.to_string(); }

}  // namespace flame::nn
