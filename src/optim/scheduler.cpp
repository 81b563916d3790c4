// LRScheduler base: initial rates, stepping, state dicts. The schedules themselves are in
// scheduler_kinds.cpp, the composites in scheduler_composite.cpp.
//
// Note [Initial learning rates]
// PyTorch keeps each group's rate before any scheduler touched it in group["initial_lr"], and
// every scheduler built on that optimizer takes it as its base rate. That is what lets
// SequentialLR(LinearLR, CosineAnnealingLR) work: LinearLR's first step has already scaled the
// optimizer's rate when the cosine is built, yet the cosine's base is the original rate. FLAME's
// ParamGroup has no such field, so the schedulers keep it in a process-wide table keyed by the
// optimizer's address, counted by the schedulers alive on it: the first one records the rates it
// finds, later ones read them (a group added since is recorded with its current rate), and the
// entry goes away with the last scheduler on that optimizer. A scheduler holds a reference to its
// optimizer and must not outlive it, so while an entry exists its address cannot be reused by
// another optimizer. (Unlike PyTorch, a scheduler built after every earlier one was destroyed
// starts from the optimizer's current rates.)
//
// Note [Scheduler state]
// state_dict() keys: "kind" (u8 bytes of name()), "last_epoch" (i64, 0-dim), "base_lrs" and
// "last_lrs" (f64 [groups]), a schedule's extra keys, and for composites "schedulers.<i>.<key>".
// load_state_dict validates the whole dict against this scheduler's own (same keys, dtypes and
// shapes, same kinds, same configuration keys) before changing anything, then restores the
// counters and writes the last rates back into the optimizer.
#include "flame/optim/scheduler.h"

#include <cstring>
#include <mutex>
#include <unordered_map>

#include "flame/error.h"

namespace flame::optim {

namespace {

struct InitialLrs {
  std::vector<double> lrs;
  int refs = 0;
};

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<const Optimizer*, InitialLrs>& registry() {
  static std::unordered_map<const Optimizer*, InitialLrs> r;
  return r;
}

std::vector<double> acquire_initial_lrs(const Optimizer& opt) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  InitialLrs& e = registry()[&opt];
  ++e.refs;
  for (std::size_t g = e.lrs.size(); g < opt.num_param_groups(); ++g) e.lrs.push_back(opt.lr(g));
  return std::vector<double>(e.lrs.begin(), e.lrs.begin() + static_cast<std::ptrdiff_t>(opt.num_param_groups()));
}

void release_initial_lrs(const Optimizer* opt) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(opt);
  if (it != registry().end() && --it->second.refs <= 0) registry().erase(it);
}

void store_initial_lrs(const Optimizer& opt, const std::vector<double>& lrs) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(&opt);
  if (it != registry().end()) it->second.lrs = lrs;
}

Tensor f64_vector(const std::vector<double>& v) {
  return Tensor::from_vec(v, {static_cast<int64_t>(v.size())});
}

Tensor kind_tensor(const std::string& name) {
  return Tensor::from_blob_copy(name.data(), DType::u8, name.size(), {static_cast<int64_t>(name.size())});
}

std::string tensor_bytes(const Tensor& t) {
  const std::vector<uint8_t> v = t.to_vec<uint8_t>();
  return std::string(v.begin(), v.end());
}

bool ends_with(const std::string& s, const char* suffix) {
  const std::size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

}  // namespace

LRScheduler::LRScheduler(Optimizer& opt) : opt_(&opt) {
  FLAME_CHECK(opt.num_param_groups() > 0, "LRScheduler", "optimizer ", opt.name(), " has no parameter groups");
  base_lrs_ = acquire_initial_lrs(opt);
  last_lrs_ = current_lrs();
}

LRScheduler::~LRScheduler() { release_initial_lrs(opt_); }

std::vector<double> LRScheduler::current_lrs() const {
  std::vector<double> out(opt_->num_param_groups());
  for (std::size_t g = 0; g < out.size(); ++g) out[g] = opt_->lr(g);
  return out;
}

void LRScheduler::set_initial_lrs(const std::vector<double>& lrs) {
  base_lrs_ = lrs;
  store_initial_lrs(*opt_, lrs);
}

void LRScheduler::apply(const std::vector<double>& lrs) {
  FLAME_CHECK(lrs.size() == opt_->num_param_groups(), name().c_str(), "the optimizer has ", opt_->num_param_groups(),
              " parameter groups, the scheduler was built for ", lrs.size());
  for (std::size_t g = 0; g < lrs.size(); ++g) opt_->set_lr(lrs[g], g);
  last_lrs_ = lrs;
}

void LRScheduler::initial_step() {
  last_epoch_ = -1;
  step();
}

void LRScheduler::step() {
  FLAME_CHECK(opt_->num_param_groups() == groups(), (name() + "::step").c_str(), "the optimizer has ", opt_->num_param_groups(),
              " parameter groups, the scheduler was built for ", groups());
  ++last_epoch_;
  std::vector<double> lrs;
  try {
    lrs = get_lr();
  } catch (...) {
    --last_epoch_;  // a refused step leaves the scheduler as it was
    throw;
  }
  apply(lrs);
}

void LRScheduler::step(int64_t epoch) {
  FLAME_CHECK(epoch >= 0, (name() + "::step").c_str(), "epoch ", epoch, " is negative");
  FLAME_CHECK(opt_->num_param_groups() == groups(), (name() + "::step").c_str(), "the optimizer has ", opt_->num_param_groups(),
              " parameter groups, the scheduler was built for ", groups());
  const int64_t saved = last_epoch_;
  last_epoch_ = epoch;
  std::vector<double> lrs;
  try {
    std::optional<std::vector<double>> closed = closed_form_lr();
    lrs = closed ? std::move(*closed) : get_lr();
  } catch (...) {
    last_epoch_ = saved;
    throw;
  }
  apply(lrs);
}

// ---- state ----

void LRScheduler::save_into(StateDict& out, const std::string& prefix) const {
  out.insert(prefix + "kind", kind_tensor(name()));
  out.insert(prefix + "last_epoch", Tensor::scalar(last_epoch_, DType::i64));
  out.insert(prefix + "base_lrs", f64_vector(base_lrs_));
  out.insert(prefix + "last_lrs", f64_vector(last_lrs_));
  StateDict extra;
  save_extra(extra);
  for (const auto& [k, t] : extra) out.insert(prefix + k, t);
}

StateDict LRScheduler::state_dict() const {
  StateDict out;
  save_into(out, "");
  return out;
}

void LRScheduler::check_state(const StateDict& state, const std::string& prefix) const {
  const std::string op = name() + "::load_state_dict";
  const Tensor& kind = state.at(prefix + "kind");
  const std::string got = kind.dtype() == DType::u8 && kind.dim() == 1 ? tensor_bytes(kind) : std::string("?");
  FLAME_CHECK(got == name(), op.c_str(), "key '", prefix, "kind' says the state is of a ", got, ", not of a ", name());
  const Tensor& epoch = state.at(prefix + "last_epoch");
  FLAME_CHECK(epoch.dtype() == DType::i64 && epoch.dim() == 0, op.c_str(), "key '", prefix,
              "last_epoch' must be a 0-dim i64 tensor, got ", dtype_name(epoch.dtype()), " ", epoch.sizes());
  // -1: a SequentialLR child that has not started yet.
  FLAME_CHECK(epoch.item<int64_t>() >= -1, op.c_str(), "key '", prefix, "last_epoch' is ", epoch.item<int64_t>());
  for (const char* key : {"base_lrs", "last_lrs"}) {
    const Tensor& t = state.at(prefix + key);
    FLAME_CHECK(t.dtype() == DType::f64 && t.sizes() == Shape{static_cast<int64_t>(groups())}, op.c_str(), "key '", prefix,
                key, "' is ", dtype_name(t.dtype()), " ", t.sizes(), ", expected f64 [", groups(),
                "] (the optimizer has ", groups(), " parameter groups)");
  }
  check_extra(state, prefix);
}

void LRScheduler::load_checked(const StateDict& state, const std::string& prefix) {
  last_epoch_ = state.at(prefix + "last_epoch").item<int64_t>();
  base_lrs_ = state.at(prefix + "base_lrs").to_vec<double>();
  const std::vector<double> last = state.at(prefix + "last_lrs").to_vec<double>();
  load_extra(state, prefix);
  apply(last);
}

void LRScheduler::load_state_dict(const StateDict& state) {
  const std::string op = name() + "::load_state_dict";
  FLAME_CHECK(opt_->num_param_groups() == groups(), op.c_str(), "the optimizer has ", opt_->num_param_groups(),
              " parameter groups, the scheduler was built for ", groups());
  // The same keys as this scheduler's own state, with the same dtypes and shapes, except where a
  // length depends on nothing configured (the kind of a child, checked by its name below).
  const StateDict mine = state_dict();
  for (const auto& [k, t] : mine) {
    const Tensor* got = state.find(k);
    FLAME_CHECK(got != nullptr && got->defined(), op.c_str(), "missing key '", k, "'");
    if (ends_with(k, "kind")) continue;
    FLAME_CHECK(got->dtype() == t.dtype() && got->sizes() == t.sizes(), op.c_str(), "key '", k, "' is ",
                dtype_name(got->dtype()), " ", got->sizes(), ", expected ", dtype_name(t.dtype()), " ", t.sizes());
  }
  for (const auto& [k, t] : state) {
    FLAME_CHECK(mine.contains(k), op.c_str(), "unexpected key '", k, "'");
  }
  check_state(state, "");
  load_checked(state, "");
}

}  // namespace flame::optim
