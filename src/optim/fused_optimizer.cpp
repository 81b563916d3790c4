// FusedOptimizer: the machinery the optimizers of flame/optim/optimizers.h share.
//
// Note [Optimizer state]
// State follows torch.optim: per parameter (indexed over all groups in order), created at the
// parameter's first gradient, so a parameter that never had one has no state and its step stays
// 0. A step first validates every group and every gradient and only then writes, so an error
// leaves parameters and state as they were. Half parameters with master weights keep an f32
// copy ("master_param") and f32 state; the kernels update the master and write the rounded
// parameter in the same pass. load_state_dict builds the complete new state before it replaces
// anything (Stateful's contract: unchanged on error).
//
// Note [Capturable optimizers]
// A CUDA graph replays kernel arguments as they were at capture, so a step that passes lr and
// Adam's bias corrections as host scalars repeats the capture's values forever. With
// `capturable` (PyTorch's name) the optimizer instead keeps, on the parameters' device:
//  - per group an f64 [kDeviceHyperSize] tensor (lr, weight_decay, beta1, beta2, eps, momentum,
//    dampening), passed to the kernel as OptimHyper::device_hyper and read when it runs;
//  - an f64 [num_params] tensor of step counts, advanced by FLAME ops (one add per run of
//    consecutive updated parameters, usually one) before the update kernels, which read their
//    parameter's count (OptimTensor::device_step) and form the bias corrections and the
//    stochastic-rounding offset from it with the host's double formulas (optim_math::
//    step_scalars), so capturable and default steps give the same bits.
// Hyperparameters reach the device when they change: set_lr / set_momentum (schedulers) write
// the changed values with a fill on the current stream (no wait; the next replay on that stream
// sees them), an eager step() writes whatever param_groups() edits left behind, and
// sync_hyperparameters() does it on demand. During a capture a pending change raises instead (it
// would be baked into the graph). State creation (master weights, zeroed slots, SGD's first
// momentum buffer) must also happen eagerly: a captured creation would be replayed, resetting
// the state every step, so a step that needs it raises while capturing. state_dict and
// param_step read the counts back (a wait, like any read of device memory); load_state_dict
// writes them.
#include <cmath>
#include <string>
#include <unordered_set>

#include "flame/cuda.h"
#include "flame/optim/optimizers.h"
#include "src/amp/autocast.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"
#include "src/backend/fused/multi_tensor.h"

namespace flame::optim {

namespace {

bool is_half(DType dt) { return dt == DType::bf16 || dt == DType::f16; }

double* hyper_field(ParamGroup& g, const std::string& key) {
  if (key == "lr") return &g.lr;
  if (key == "weight_decay") return &g.weight_decay;
  if (key == "momentum") return &g.momentum;
  if (key == "dampening") return &g.dampening;
  if (key == "eps") return &g.eps;
  if (key == "beta2_decay") return &g.beta2_decay;
  if (key == "d") return &g.d;
  if (key == "eps1") return &g.eps1;
  return nullptr;
}

std::string state_key(std::size_t i, const std::string& name) {
  return "state." + std::to_string(i) + "." + name;
}
std::string group_key(std::size_t g, const std::string& name) {
  return "param_groups." + std::to_string(g) + "." + name;
}

// A zero tensor of `shape` for parameter p: in p's layout when it has p's shape.
Tensor zeros_for(const Tensor& p, const Shape& shape, DType dtype) {
  Tensor t = shape == p.sizes() ? make_empty_in_layout_of(p, dtype, p.device(), "optimizer state")
                                : Tensor::zeros(shape, TensorOptions(dtype, p.device()));
  t.zero_();
  return t;
}

}  // namespace

FusedOptimizer::FusedOptimizer(std::vector<ParamGroup> groups, Precision precision) : precision_(precision) {
  groups_ = std::move(groups);
  group_begin_.push_back(0);
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    for (const Tensor& p : groups_[g].params) {
      const std::size_t i = params_.size();
      FLAME_CHECK(p.defined(), "optimizer", "parameter ", i, " (group ", g, ") is undefined");
      // PyTorch: "can't optimize a non-leaf Tensor". An op's output is recomputed from its inputs
      // by every forward; an update written into it would be lost (and its gradient flows on).
      FLAME_CHECK(p.is_leaf(), "optimizer", "parameter ", i, " (group ", g, ", shape ", p.sizes(),
                  ") is not a leaf tensor: it is the output of ", p.grad_fn_name(),
                  " recorded under grad mode; optimizers take leaf tensors; call .detach().requires_grad_() "
                  "on it (or create it under NoGradGuard)");
      FLAME_CHECK(is_floating(p.dtype()), "optimizer", "parameter ", i, " has dtype ", dtype_name(p.dtype()),
                  "; optimizers update floating tensors");
      FLAME_CHECK(is_non_overlapping_and_dense(p), "optimizer", "parameter ", i, " (shape ", p.sizes(),
                  ", strides ", p.strides(), ") is not dense; optimizers update whole dense tensors");
      FLAME_CHECK(index_of_.emplace(p.impl(), i).second, "optimizer", "parameter ", i,
                  " appears more than once (some parameters appear in more than one parameter group)");
      params_.push_back(p);
    }
    group_begin_.push_back(params_.size());
  }
  state_.resize(params_.size());
  if (precision_.capturable && !params_.empty()) {
    const Device dev = params_.front().device();
    for (std::size_t i = 0; i < params_.size(); ++i)
      FLAME_CHECK(params_[i].device() == dev, "optimizer", "capturable: parameter ", i, " is on ",
                  params_[i].device().str(), ", parameter 0 on ", dev.str(),
                  "; a capturable optimizer keeps its step counts on one device");
    steps_device_ = Tensor::zeros({static_cast<int64_t>(params_.size())}, TensorOptions(DType::f64, dev));
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      hyper_device_.push_back(Tensor::zeros({backend::kDeviceHyperSize}, TensorOptions(DType::f64, dev)));
      hyper_written_.emplace_back();
    }
    write_hyperparameters(/*force=*/true);
  }
}

std::vector<double> FusedOptimizer::hyper_values(std::size_t g) const {
  const ParamGroup& p = groups_[g];
  return {p.lr, p.weight_decay, p.beta1, p.beta2, p.eps, p.momentum, p.dampening};  // OptimHyper::device_hyper order
}

namespace {
bool capturing_on(const Tensor& t) { return t.device().is_cuda() && cuda::is_capturing(t.device().index); }
}  // namespace

void FusedOptimizer::write_hyperparameters(bool force) {
  if (!precision_.capturable || hyper_device_.empty()) return;
  NoGradGuard no_grad;
  // Check every group before writing any, so a refusal changes nothing.
  std::vector<std::vector<double>> values(groups_.size());
  bool pending = false;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    values[g] = hyper_values(g);
    pending = pending || force || values[g] != hyper_written_[g];
  }
  if (!pending) return;
  FLAME_CHECK(!capturing_on(steps_device_), (name() + ".sync_hyperparameters").c_str(),
              "a hyperparameter changed while a CUDA graph is being captured; a capturable optimizer reads them "
              "from device memory at replay time: change them (set_lr, schedulers) outside the captured step");
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    for (std::size_t k = 0; k < values[g].size(); ++k) {
      if (!force && hyper_written_[g].size() == values[g].size() && hyper_written_[g][k] == values[g][k]) continue;
      hyper_device_[g].narrow(0, static_cast<int64_t>(k), 1).fill_(values[g][k]);
    }
    hyper_written_[g] = values[g];
  }
}

void FusedOptimizer::sync_hyperparameters() { write_hyperparameters(false); }

void FusedOptimizer::hyperparameters_changed(std::size_t) { write_hyperparameters(false); }

void FusedOptimizer::advance_device_steps(const std::vector<std::vector<Active>>& active) {
  // Indices ascend over the groups (params_ is in group order): add 1 per run of consecutive ones.
  std::vector<std::size_t> idx;
  for (const auto& group : active)
    for (const Active& a : group) idx.push_back(a.index);
  std::size_t run = 0;
  while (run < idx.size()) {
    std::size_t end = run + 1;
    while (end < idx.size() && idx[end] == idx[end - 1] + 1) ++end;
    steps_device_.narrow(0, static_cast<int64_t>(idx[run]), static_cast<int64_t>(end - run)).add_(1.0);
    run = end;
  }
}

void FusedOptimizer::check_groups() const {
  for (std::size_t g = 0; g < groups_.size(); ++g) validate_group(groups_[g], g);
}

bool FusedOptimizer::uses_master(const Tensor& param) const {
  return precision_.master_weights && is_half(param.dtype());
}

DType FusedOptimizer::state_dtype(const Tensor& param) const {
  return uses_master(param) ? DType::f32 : param.dtype();
}

std::size_t FusedOptimizer::pending_state_bytes(std::optional<Device> on) const {
  std::size_t bytes = 0;
  for (std::size_t g = 0; g < groups_.size(); ++g)
    for (std::size_t i = group_begin_[g]; i < group_begin_[g + 1]; ++i) {
      const Tensor& p = params_[i];
      const ParamState& st = state_[i];
      if (on && p.device() != *on) continue;
      if (uses_master(p) && !st.master.defined()) bytes += static_cast<std::size_t>(p.numel()) * dtype_size(DType::f32);
      if (!st.slots.empty()) continue;
      for (const Slot& s : slots(groups_[g], p))
        bytes += static_cast<std::size_t>(shape_numel(s.shape)) * dtype_size(s.dtype.value_or(state_dtype(p)));
    }
  return bytes;
}

std::size_t FusedOptimizer::param_index(const Tensor& param, const char* what) const {
  const std::string op = name() + "." + what;
  FLAME_CHECK(param.defined(), op.c_str(), "got an undefined tensor instead of a parameter");
  const auto it = index_of_.find(param.impl());
  if (it != index_of_.end()) return it->second;
  // Not one of the handed-over tensors: say whether it is another handle on one of them.
  for (std::size_t i = 0; i < params_.size(); ++i) {
    FLAME_CHECK(!param.shares_storage(params_[i]), op.c_str(), "the tensor of shape ", param.sizes(),
                " is not a parameter of this optimizer, but shares the storage of parameter ", i, " (shape ",
                params_[i].sizes(), "): pass the tensor handed to the optimizer, not a view, copy or detach() of it");
  }
  FLAME_FAIL(op.c_str(), "the tensor of shape ", param.sizes(), " (", dtype_name(param.dtype()), ", ",
             param.device().str(), ") is not a parameter of this optimizer (", params_.size(),
             " parameters); pass one of the tensors handed to it");
}

int64_t FusedOptimizer::param_step(std::size_t index) const {
  FLAME_CHECK(index < params_.size(), (name() + ".param_step").c_str(), "index ", index, " out of range (", params_.size(),
              " parameters)");
  if (precision_.capturable)
    return static_cast<int64_t>(steps_device_.narrow(0, static_cast<int64_t>(index), 1).item<double>());
  return state_[index].step;
}

Tensor FusedOptimizer::find_slot(std::size_t index, const std::string& slot) const {
  for (const auto& [n, t] : state_[index].slots)
    if (n == slot) return t;
  return Tensor();
}

Tensor FusedOptimizer::state(std::size_t index, const std::string& slot) const {
  FLAME_CHECK(index < params_.size(), (name() + ".state").c_str(), "index ", index, " out of range (", params_.size(),
              " parameters)");
  return find_slot(index, slot);
}

Tensor FusedOptimizer::master_weights(std::size_t index) const {
  FLAME_CHECK(index < params_.size(), (name() + ".master_weights").c_str(), "index ", index, " out of range (",
              params_.size(), " parameters)");
  return state_[index].master;
}

void FusedOptimizer::step(const Gradients& grads) {
  const std::string op = name() + ".step";
  check_groups();
  NoGradGuard no_grad;
  // Pass 1: find and check every gradient before anything is written.
  std::vector<std::vector<Active>> active(groups_.size());
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    for (std::size_t i = group_begin_[g]; i < group_begin_[g + 1]; ++i) {
      const Tensor& p = params_[i];
      Tensor grad = grads.try_get(p);
      if (!grad.defined()) continue;
      FLAME_CHECK(grad.device() == p.device(), op.c_str(), "gradient of parameter ", i, " is on ",
                  grad.device().str(), ", the parameter on ", p.device().str());
      FLAME_CHECK(grad.sizes() == p.sizes(), op.c_str(), "gradient of parameter ", i, " has shape ", grad.sizes(),
                  ", the parameter ", p.sizes());
      FLAME_CHECK(grad.dtype() == p.dtype(), op.c_str(), "gradient of parameter ", i, " has dtype ",
                  dtype_name(grad.dtype()), ", the parameter ", dtype_name(p.dtype()));
      FLAME_CHECK(!grad.shares_storage(p), op.c_str(), "gradient of parameter ", i, " shares the parameter's storage");
      if (!same_dense_layout(p, grad)) {
        Tensor laid_out = make_empty_in_layout_of(p, p.dtype(), p.device(), "optimizer gradient");
        laid_out.copy_(grad);
        grad = laid_out;
      }
      active[g].push_back(Active{i, p, std::move(grad), false});
    }
  }
  if (precision_.capturable && !params_.empty()) {
    if (capturing_on(steps_device_)) {
      // Note [Capturable optimizers]: state creation cannot be replayed.
      for (std::size_t g = 0; g < groups_.size(); ++g)
        for (const Active& a : active[g]) {
          const ParamState& st = state_[a.index];
          const bool needs_master = uses_master(a.param) && !st.master.defined();
          const bool needs_slots = st.slots.empty() && !slots(groups_[g], a.param).empty();
          FLAME_CHECK(!needs_master && !needs_slots, op.c_str(), "parameter ", a.index,
                      " has no optimizer state yet and a CUDA graph is being captured; run one step eagerly "
                      "before capturing (creating the state inside the graph would reset it at every replay)");
        }
    }
    write_hyperparameters(false);
    advance_device_steps(active);
  }
  // Pass 2: create missing state, advance the step counters, update.
  low_written_.assign(params_.size(), Tensor());
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    if (active[g].empty()) continue;
    for (Active& a : active[g]) {
      ParamState& st = state_[a.index];
      if (uses_master(a.param) && !st.master.defined()) {
        st.master = make_empty_in_layout_of(a.param, DType::f32, a.param.device(), "master weights");
        st.master.copy_(a.param);
      }
      // Slots appear only at a parameter's first step, or when a hyperparameter asks for one
      // later (SGD's momentum turned on): a parameter with slots has all of them.
      if (!st.slots.empty()) {
        ++st.step;
        continue;
      }
      for (const Slot& s : slots(groups_[g], a.param))
        if (!find_slot(a.index, s.name).defined()) {
          st.slots.emplace_back(s.name, zeros_for(a.param, s.shape, s.dtype.value_or(state_dtype(a.param))));
          a.fresh_state = true;
        }
      ++st.step;
    }
    update_group(g, active[g]);
    for (const Active& a : active[g]) bump_version(a.param);
  }
  // Kept low-precision copies the kernels wrote are equal to their weights again; a captured step
  // also advances every updated weight's version after each replay (Note [Kept low-precision
  // copies] in src/amp/autocast.cpp).
  for (std::size_t g = 0; g < groups_.size(); ++g)
    for (const Active& a : active[g]) amp::detail::low_copy_updated(a.param, low_written_[a.index]);
  low_written_.clear();
}

void FusedOptimizer::fused_update(std::size_t g, const std::vector<Active>& active, int kind, bool amsgrad,
                                  bool nesterov, bool maximize, bool decoupled) {
  const ParamGroup& grp = groups_[g];
  backend::OptimHyper h;
  h.kind = static_cast<backend::OptimKind>(kind);
  h.lr = grp.lr;
  h.weight_decay = grp.weight_decay;
  h.beta1 = grp.beta1;
  h.beta2 = grp.beta2;
  h.eps = grp.eps;
  h.momentum = grp.momentum;
  h.dampening = grp.dampening;
  h.nesterov = nesterov;
  h.maximize = maximize;
  h.amsgrad = amsgrad;
  h.decoupled_weight_decay = decoupled;
  h.stochastic_rounding = precision_.stochastic_rounding;
  h.seed = precision_.seed;
  if (precision_.capturable) h.device_hyper = static_cast<const double*>(hyper_device_[g].data_ptr());
  // One backend call per (device, dtype) bucket, in first-seen order.
  struct Bucket {
    Device device;
    DType dtype;
    std::vector<backend::OptimTensor> tensors;
  };
  std::vector<Bucket> buckets;
  for (const Active& a : active) {
    const ParamState& st = state_[a.index];
    backend::OptimTensor e;
    e.param = a.param;
    e.grad = a.grad;
    e.master = st.master;
    if (!e.master.defined()) {
      e.low = amp::detail::low_copy_for_update(a.param);
      low_written_[a.index] = e.low;
    }
    const double t = static_cast<double>(st.step);
    switch (h.kind) {
      case backend::OptimKind::sgd:
        if (grp.momentum != 0.0) {
          e.state[0] = find_slot(a.index, "momentum_buffer");
          // The buffer starts as the gradient (torch: buf = grad.clone() on the first use).
          e.first = a.fresh_state;
        }
        break;
      case backend::OptimKind::adam:
        e.state[0] = find_slot(a.index, "exp_avg");
        e.state[1] = find_slot(a.index, "exp_avg_sq");
        if (amsgrad) e.state[2] = find_slot(a.index, "max_exp_avg_sq");
        e.step_size = grp.lr / (1.0 - std::pow(grp.beta1, t));
        e.bias2_sqrt = std::sqrt(1.0 - std::pow(grp.beta2, t));
        break;
      case backend::OptimKind::lion: e.state[0] = find_slot(a.index, "exp_avg"); break;
    }
    e.rng_index = static_cast<uint64_t>(a.index) << 40;
    e.rng_offset = static_cast<uint64_t>(st.step);
    if (precision_.capturable) e.device_step = static_cast<const double*>(steps_device_.data_ptr()) + a.index;
    Bucket* b = nullptr;
    for (Bucket& x : buckets)
      if (x.device == a.param.device() && x.dtype == a.param.dtype()) b = &x;
    if (b == nullptr) b = &buckets.emplace_back(Bucket{a.param.device(), a.param.dtype(), {}});
    b->tensors.push_back(std::move(e));
  }
  for (const Bucket& b : buckets) backend::fused::optim_step.run(b.device, h, b.tensors);
}

StateDict FusedOptimizer::state_dict() const {
  StateDict sd;
  std::vector<double> device_steps;
  if (precision_.capturable && !params_.empty()) device_steps = steps_device_.to_vec<double>();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const ParamState& st = state_[i];
    const int64_t step = precision_.capturable ? static_cast<int64_t>(device_steps[i]) : st.step;
    if (step == 0 && st.slots.empty()) continue;
    sd.insert(state_key(i, "step"), Tensor::scalar(step, DType::i64));
    for (const auto& [n, t] : st.slots) sd.insert(state_key(i, n), t.clone());
    if (st.master.defined()) sd.insert(state_key(i, "master_param"), st.master.clone());
  }
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    std::vector<int64_t> idx;
    for (std::size_t i = group_begin_[g]; i < group_begin_[g + 1]; ++i) idx.push_back(static_cast<int64_t>(i));
    sd.insert(group_key(g, "params"), Tensor::from_vec(idx, {static_cast<int64_t>(idx.size())}));
    ParamGroup grp = groups_[g];
    for (const std::string& k : group_keys()) {
      if (k == "betas") {
        sd.insert(group_key(g, k), Tensor::from_vec(std::vector<double>{grp.beta1, grp.beta2}, {2}));
      } else {
        sd.insert(group_key(g, k), Tensor::scalar(*hyper_field(grp, k), DType::f64));
      }
    }
  }
  return sd;
}

void FusedOptimizer::load_state_dict(const StateDict& sd) {
  const std::string op = name() + ".load_state_dict";
  const char* o = op.c_str();
  std::unordered_set<std::string> used;
  auto need = [&](const std::string& key) -> const Tensor& {
    const Tensor* t = sd.find(key);
    FLAME_CHECK(t != nullptr, o, "missing key \"", key, "\"");
    used.insert(key);
    return *t;
  };
  auto scalar_f64 = [&](const std::string& key) {
    const Tensor& t = need(key);
    FLAME_CHECK(t.numel() == 1 && is_floating(t.dtype()), o, key, " must be a floating scalar, got shape ",
                t.sizes(), " dtype ", dtype_name(t.dtype()));
    return t.item<double>();
  };

  std::vector<ParamGroup> groups = groups_;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const Tensor& idx = need(group_key(g, "params"));
    const std::size_t count = group_begin_[g + 1] - group_begin_[g];
    FLAME_CHECK(idx.dim() == 1 && static_cast<std::size_t>(idx.numel()) == count, o, group_key(g, "params"),
                " lists ", idx.numel(), " parameters; group ", g, " of this optimizer has ", count);
    const std::vector<int64_t> v = idx.to_vec<int64_t>();
    for (std::size_t k = 0; k < count; ++k)
      FLAME_CHECK(v[k] == static_cast<int64_t>(group_begin_[g] + k), o, group_key(g, "params"), "[", k, "] is ",
                  v[k], ", expected ", group_begin_[g] + k);
    for (const std::string& k : group_keys()) {
      if (k == "betas") {
        const Tensor& b = need(group_key(g, k));
        FLAME_CHECK(b.numel() == 2 && is_floating(b.dtype()), o, group_key(g, k), " must hold 2 floating values, got shape ",
                    b.sizes());
        const auto bv = b.to_vec<double>();
        groups[g].beta1 = bv[0];
        groups[g].beta2 = bv[1];
      } else {
        *hyper_field(groups[g], k) = scalar_f64(group_key(g, k));
      }
    }
    validate_group(groups[g], g);
  }
  FLAME_CHECK(!sd.contains(group_key(groups.size(), "params")), o, "the state has more than ", groups.size(),
              " parameter groups");

  std::vector<ParamState> state(params_.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (std::size_t i = group_begin_[g]; i < group_begin_[g + 1]; ++i) {
      const Tensor& p = params_[i];
      const std::string sk = state_key(i, "step");
      if (!sd.contains(sk)) continue;  // no state yet (keys left over are reported below)
      const Tensor& st = need(sk);
      FLAME_CHECK(st.numel() == 1 && !is_floating(st.dtype()) && st.dtype() != DType::boolean, o, sk,
                  " must be an integer scalar, got shape ", st.sizes(), " dtype ", dtype_name(st.dtype()));
      state[i].step = st.item<int64_t>();
      FLAME_CHECK(state[i].step >= 0, o, sk, " is negative (", state[i].step, ")");
      for (const Slot& s : slots(groups[g], p)) {
        const DType sdt = s.dtype.value_or(state_dtype(p));
        const std::string key = state_key(i, s.name);
        const Tensor& t = need(key);
        FLAME_CHECK(t.sizes() == s.shape, o, key, " has shape ", t.sizes(), ", parameter ", i, " needs ", s.shape);
        FLAME_CHECK(t.dtype() == sdt, o, key, " has dtype ", dtype_name(t.dtype()), ", parameter ", i, " (",
                    dtype_name(p.dtype()), ") keeps ", dtype_name(sdt), " state");
        Tensor like = s.shape == p.sizes() ? make_empty_in_layout_of(p, sdt, p.device(), "load_state_dict")
                                           : Tensor::empty(s.shape, TensorOptions(sdt, p.device()));
        like.copy_(t);
        state[i].slots.emplace_back(s.name, like);
      }
      if (uses_master(p)) {
        const std::string key = state_key(i, "master_param");
        const Tensor& t = need(key);
        FLAME_CHECK(t.sizes() == p.sizes() && t.dtype() == DType::f32, o, key, " has shape ", t.sizes(), " dtype ",
                    dtype_name(t.dtype()), ", parameter ", i, " needs f32 master weights of shape ", p.sizes());
        Tensor m = make_empty_in_layout_of(p, DType::f32, p.device(), "load_state_dict");
        m.copy_(t);
        state[i].master = m;
      }
    }
  }
  for (const auto& [k, t] : sd) {
    (void)t;
    FLAME_CHECK(used.count(k) != 0, o, "unexpected key \"", k, "\" (", params_.size(), " parameters in ",
                groups_.size(), " groups; the state was saved by another optimizer or configuration)");
  }
  // Commit: hyperparameters (parameters stay), then state.
  for (std::size_t g = 0; g < groups.size(); ++g) {
    groups[g].params = std::move(groups_[g].params);
    groups_[g] = std::move(groups[g]);
  }
  if (precision_.capturable && !params_.empty()) {
    std::vector<double> steps(state.size());
    for (std::size_t i = 0; i < state.size(); ++i) steps[i] = static_cast<double>(state[i].step);
    steps_device_.copy_(Tensor::from_vec(steps, {static_cast<int64_t>(steps.size())}));
  }
  state_ = std::move(state);
  write_hyperparameters(/*force=*/true);
}

int64_t fused_launch_count() { return backend::optim_launch_count(); }

}  // namespace flame::optim
