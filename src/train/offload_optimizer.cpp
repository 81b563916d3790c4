// Optimizer-state offload: offload::HostOptimizer (include/flame/offload.h, docs/offload.md).
//
// Note [Host optimizer]
// The inner optimizer only ever sees host tensors: the masters (pinned, f32 for half parameters)
// and a host Gradients store keyed by them. Per step:
//  1. each device gradient is copied (non-blocking) into a fresh pinned buffer on the current
//     stream; one event per device is recorded and waited for: the host wait of the step;
//  2. the masters may be rewritten only after the previous step's uploads read them: the event
//     recorded after those uploads is waited for too (normally long complete);
//  3. the inner optimizer steps on the CPU (gradients converted to the master dtype first);
//  4. every updated master is copied to its parameter with a non-blocking copy (a converting copy
//     for a parameter of another dtype), and an event is recorded after them.
// Parameter groups: the wrapper's groups are the inner optimizer's, with each master replaced by
// its device parameter; before each step the wrapper's hyperparameters are copied into the inner
// groups (a scheduler drives the wrapper through the base interface only).
#include <set>
#include <utility>

#include "flame/autograd.h"
#include "flame/offload.h"

namespace flame::offload {

namespace {
DType master_dtype(DType dt) { return (dt == DType::f16 || dt == DType::bf16) ? DType::f32 : dt; }

std::size_t index_of(const TensorList& list, const Tensor& t) {
  for (std::size_t k = 0; k < list.size(); ++k) {
    if (list[k].is_same(t)) return k;
  }
  return list.size();
}

// Waits for the work queued so far on the current stream of each device.
void wait_for(const std::set<int>& devices) {
  for (int d : devices) {
    cuda::Event e;
    e.record(cuda::Stream::current(d));
    e.synchronize();
  }
}
}  // namespace

HostOptimizer::HostOptimizer(TensorList params, InnerOptimizerFactory make_inner) : params_(std::move(params)) {
  FLAME_CHECK(static_cast<bool>(make_inner), "offload::HostOptimizer", "needs a factory for the inner optimizer");
  NoGradGuard no_grad;
  for (std::size_t k = 0; k < params_.size(); ++k) {
    const Tensor& p = params_[k];
    FLAME_CHECK(p.defined(), "offload::HostOptimizer", "parameter ", k, " is undefined");
    FLAME_CHECK(index_of(params_, p) == k, "offload::HostOptimizer", "parameter ", k, " (shape ", p.sizes(),
                ") is listed twice");
    Tensor host = p.detach().to(Device::cpu()).to(master_dtype(p.dtype()));
    if (host.is_same(p) || host.shares_storage(p)) host = host.clone();
    if (p.device().is_cuda()) host = host.pin_memory();
    host = host.contiguous().detach();
    if (is_floating(host.dtype())) host.requires_grad_(true);  // a key of the host Gradients store
    masters_.push_back(host);
  }
  inner_ = make_inner(masters_);
  FLAME_CHECK(inner_ != nullptr, "offload::HostOptimizer", "the factory returned no optimizer");
  for (const optim::ParamGroup& g : inner_->param_groups()) {
    optim::ParamGroup mine = g;
    mine.params.clear();
    for (const Tensor& m : g.params) {
      const std::size_t k = index_of(masters_, m);
      FLAME_CHECK(k < masters_.size(), "offload::HostOptimizer", "the inner optimizer ", inner_->name(),
                  " holds a tensor (shape ", m.sizes(), ") that is not one of the masters it was given");
      mine.params.push_back(params_[k]);
    }
    groups_.push_back(std::move(mine));
  }
}

std::string HostOptimizer::name() const { return "HostOptimizer(" + inner_->name() + ")"; }

optim::Optimizer::MomentumKind HostOptimizer::momentum_kind() const { return inner_->momentum_kind(); }

void HostOptimizer::sync_hyperparameters() {
  auto& inner_groups = inner_->param_groups();
  FLAME_CHECK(inner_groups.size() == groups_.size(), "offload::HostOptimizer", "the inner optimizer has ",
              inner_groups.size(), " parameter groups, the wrapper ", groups_.size(),
              " (add groups to the wrapper only through its constructor)");
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    optim::ParamGroup& in = inner_groups[g];
    const optim::ParamGroup& mine = groups_[g];
    in.lr = mine.lr;
    in.weight_decay = mine.weight_decay;
    in.momentum = mine.momentum;
    in.beta1 = mine.beta1;
    in.beta2 = mine.beta2;
    in.eps = mine.eps;
  }
}

void HostOptimizer::step(const Gradients& grads) {
  sync_hyperparameters();
  std::vector<std::pair<std::size_t, Tensor>> host_grads;
  std::set<int> devices;
  {
    NoGradGuard no_grad;
    for (std::size_t k = 0; k < params_.size(); ++k) {
      Tensor g = grads.try_get(params_[k]);
      if (!g.defined()) continue;
      if (g.device().is_cuda()) {
        Tensor src = g.contiguous();
        Tensor host = empty_pinned(src.sizes(), src.dtype());
        host.copy_(src, /*non_blocking=*/true);
        devices.insert(g.device().index);
        host_grads.emplace_back(k, std::move(host));
      } else {
        host_grads.emplace_back(k, g);
      }
    }
  }
  wait_for(devices);                      // (1) the gradients are on the host now
  if (uploaded_) uploaded_->synchronize();  // (2) the last uploads no longer read the masters
  Gradients host_store;
  for (auto& [k, g] : host_grads) {
    Tensor gm = g.dtype() == masters_[k].dtype() ? g : g.to(masters_[k].dtype());
    host_store.set(masters_[k], std::move(gm));
  }
  host_grads.clear();
  inner_->step(host_store);  // (3)
  // (4) the updated masters go back; parameters without a gradient were not changed.
  NoGradGuard no_grad;
  std::set<int> upload_devices;
  for (const auto& e : host_store.entries()) {
    const std::size_t k = index_of(masters_, e.tensor);
    if (k >= masters_.size()) continue;
    params_[k].copy_(masters_[k], /*non_blocking=*/true);
    if (params_[k].device().is_cuda()) upload_devices.insert(params_[k].device().index);
  }
  if (!upload_devices.empty()) {
    // One event suffices for one device (the usual case); several devices wait for each other's.
    if (!uploaded_) uploaded_ = std::make_unique<cuda::Event>();
    if (upload_devices.size() > 1) wait_for(upload_devices);
    uploaded_->record(cuda::Stream::current(*upload_devices.begin()));
  }
}

StateDict HostOptimizer::state_dict() const {
  StateDict out;
  for (const auto& [key, t] : inner_->state_dict()) out.insert("inner." + key, t);
  for (std::size_t k = 0; k < masters_.size(); ++k) out.insert("master." + std::to_string(k), masters_[k].detach());
  return out;
}

void HostOptimizer::load_state_dict(const StateDict& state) {
  // Validate everything first, so that a failed load changes nothing.
  StateDict inner_state;
  for (const auto& [key, t] : state) {
    if (key.rfind("inner.", 0) == 0) {
      inner_state.insert(key.substr(6), t);
    } else {
      FLAME_CHECK(key.rfind("master.", 0) == 0, "offload::HostOptimizer::load_state_dict", "unexpected key '",
                  key, "'");
    }
  }
  for (std::size_t k = 0; k < masters_.size(); ++k) {
    const std::string key = "master." + std::to_string(k);
    const Tensor& t = state.at(key);
    FLAME_CHECK(t.sizes() == masters_[k].sizes() && t.dtype() == masters_[k].dtype(),
                "offload::HostOptimizer::load_state_dict", "'", key, "' has shape ", t.sizes(), " and dtype ",
                dtype_name(t.dtype()), ", expected ", masters_[k].sizes(), " and ", dtype_name(masters_[k].dtype()));
  }
  FLAME_CHECK(state.size() == inner_state.size() + masters_.size(), "offload::HostOptimizer::load_state_dict",
              "expected ", masters_.size(), " master entries, got ", state.size() - inner_state.size());
  inner_->load_state_dict(inner_state);  // raises (unchanged) on its own mismatches
  if (uploaded_) uploaded_->synchronize();
  NoGradGuard no_grad;
  for (std::size_t k = 0; k < masters_.size(); ++k) {
    masters_[k].copy_(state.at("master." + std::to_string(k)));
    params_[k].copy_(masters_[k]);
  }
}

}  // namespace flame::offload
