// ZeroRedundancyOptimizer: ZeRO stage 1 (flame/dist/zero.h).
//
// Note [ZeRO layout]
// Each parameter group g is one flat buffer (parameters in order, then zero padding to W*S
// elements, W = world size, S = ceil(numel / W)), and the dense parameters are moved into it
// (Tensor::set_data: same identity, storage in the buffer), so the buffer costs no memory beyond
// the parameters. Rank r owns [r*S, (r+1)*S): a leaf `shard` viewing that slice, which the inner
// optimizer (built by the factory on groups holding just that shard) updates in place. step():
// local gradients are packed into a flat gradient that lives for the step (zeros where a
// parameter has none), reduce-scattered with ReduceOp::avg into the shard's gradient, the inner
// optimizer steps the shard, and an in-place all-gather of the buffer updates every parameter.
// A parameter that is not in the buffer (not dense, or rebound by Module::to since) is copied in
// before the step and out after it. Optimizer state is the only per-rank saving: 1/W of it.
// Hyperparameters (set_lr from a scheduler) are copied into the inner groups at each step.
// state_dict() all-gathers every elementwise state slot (numel S) and cuts it back into the
// parameters' shapes under the plain optimizer's keys ("state.<i>.<slot>", "param_groups.<g>.*"),
// so the state does not depend on the world size; load_state_dict() does the reverse.
#include <algorithm>
#include <map>

#include "flame/dist.h"

namespace flame::dist {

struct ZeroRedundancyOptimizer::Layout {
  std::vector<Tensor> params;
  std::vector<int64_t> offsets;
  std::size_t first_index = 0;  // global parameter index of params[0]
  int64_t numel = 0;
  int64_t shard = 0;  // S
  Tensor shard_param;  // a view of flat_param: this rank's slice
  Tensor flat_param;   // W*S; the parameters' storage (Note [ZeRO layout])
  bool aliased(std::size_t k) const {  // params[k] still lives in flat_param
    return params[k].data_ptr() == flat_param.narrow(0, offsets[k], params[k].numel()).data_ptr() &&
           params[k].is_contiguous();
  }
};

namespace {

std::string state_key(std::size_t i, const std::string& name) { return "state." + std::to_string(i) + "." + name; }
std::string group_prefix(std::size_t g) { return "param_groups." + std::to_string(g) + "."; }

// Calls fn(k, param_offset, flat_offset, length) for each parameter k overlapping [lo, hi).
template <class F>
void for_each_overlap(const ZeroRedundancyOptimizer::Layout& l, int64_t lo, int64_t hi, F&& fn) {
  for (std::size_t k = 0; k < l.params.size(); ++k) {
    const int64_t a = l.offsets[k], b = a + l.params[k].numel();
    const int64_t s = std::max(a, lo), e = std::min(b, hi);
    if (s < e) fn(k, s - a, s, e - s);
  }
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups, OptimizerFactory factory,
                                                 std::shared_ptr<ProcessGroup> group)
    : group_(group ? std::move(group) : default_group_ptr()) {
  const char* op = "ZeroRedundancyOptimizer";
  FLAME_CHECK(factory != nullptr, op, "no optimizer factory");
  FLAME_CHECK(!groups.empty(), op, "no parameter groups");
  ProcessGroup& pg = *group_;
  const int64_t W = pg.size();
  const Device dev = pg.device();
  std::vector<optim::ParamGroup> inner_groups;
  std::size_t index = 0;
  NoGradGuard no_grad;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const optim::ParamGroup& grp = groups[g];
    FLAME_CHECK(!grp.params.empty(), op, "parameter group ", g, " is empty");
    Layout l;
    l.first_index = index;
    const DType dt = grp.params.front().dtype();
    for (const Tensor& p : grp.params) {
      FLAME_CHECK(p.defined() && p.requires_grad() && p.is_leaf(), op, "group ", g,
                  " holds a tensor that is not a leaf requiring grad");
      FLAME_CHECK(p.dtype() == dt, op, "group ", g, " mixes dtypes (", dtype_name(dt), " and ", dtype_name(p.dtype()),
                  "): give each dtype its own group");
      FLAME_CHECK(p.device() == dev, op, "a parameter of group ", g, " is on ", p.device().str(), ", the \"",
                  pg.backend(), "\" group works on ", dev.str());
      // Everyone starts from rank 0's values.
      Tensor c = p.is_contiguous() ? p.detach() : p.contiguous();
      if (c.numel() > 0) pg.broadcast(c, 0);
      if (!p.is_contiguous()) Tensor(p.detach()).copy_(c);
      l.params.push_back(p);
      l.offsets.push_back(l.numel);
      l.numel += p.numel();
      ++index;
    }
    l.shard = std::max<int64_t>(1, (l.numel + W - 1) / W);
    const TensorOptions o(dt, dev);
    l.flat_param = Tensor::zeros({W * l.shard}, o);
    for (std::size_t k = 0; k < l.params.size(); ++k) {
      Tensor& p = l.params[k];
      Tensor slot = l.flat_param.narrow(0, l.offsets[k], p.numel()).view(p.sizes());
      slot.copy_(p);
      // A dense parameter moves into the flat buffer (identity kept): the all-gather then writes
      // the parameters themselves. Others (channels-last, ...) keep their layout and are copied.
      if (p.is_contiguous()) p.set_data(slot);
    }
    l.shard_param = Tensor::zeros({1}, o);
    l.shard_param.set_data(l.flat_param.narrow(0, pg.rank() * l.shard, l.shard));
    l.shard_param.requires_grad_(true);
    optim::ParamGroup ig = grp;
    ig.params = {l.shard_param};
    inner_groups.push_back(ig);
    layouts_.push_back(std::move(l));
  }
  groups_ = std::move(groups);
  inner_ = factory(std::move(inner_groups));
  FLAME_CHECK(inner_ != nullptr && inner_->num_param_groups() == groups_.size(), op,
              "the factory must return an optimizer over the groups it was given");
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

std::string ZeroRedundancyOptimizer::name() const { return "ZeroRedundancyOptimizer(" + inner_->name() + ")"; }

void ZeroRedundancyOptimizer::step(const Gradients& grads) {
  ProcessGroup& pg = *group_;
  NoGradGuard no_grad;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    optim::ParamGroup hyper = groups_[g];
    hyper.params = inner_->param_groups()[g].params;
    inner_->param_groups()[g] = hyper;
  }
  std::vector<Work> works;
  std::vector<Tensor> shard_grads;
  for (Layout& l : layouts_) {
    // The flat gradient lives for this step only (the pool reuses it for the next forward).
    const TensorOptions o(l.flat_param.dtype(), l.flat_param.device());
    Tensor flat_grad = Tensor::empty({l.flat_param.numel()}, o);
    for (std::size_t k = 0; k < l.params.size(); ++k) {
      Tensor dst = flat_grad.narrow(0, l.offsets[k], l.params[k].numel());
      const Tensor gk = grads.try_get(l.params[k]);
      if (gk.defined()) dst.view(l.params[k].sizes()).copy_(gk);
      else dst.zero_();
      // A parameter outside the flat buffer (its layout, or rebound since) is copied in.
      if (!l.aliased(k))
        l.flat_param.narrow(0, l.offsets[k], l.params[k].numel()).view(l.params[k].sizes()).copy_(l.params[k]);
    }
    if (l.flat_param.numel() > l.numel) flat_grad.narrow(0, l.numel, l.flat_param.numel() - l.numel).zero_();
    Tensor sg = Tensor::empty({l.shard}, o);
    works.push_back(pg.reduce_scatter(sg, flat_grad, ReduceOp::avg, /*async=*/true));
    shard_grads.push_back(sg);
  }
  Gradients local;
  for (std::size_t i = 0; i < layouts_.size(); ++i) {
    works[i].wait();
    local.set(layouts_[i].shard_param, std::move(shard_grads[i]));
  }
  inner_->step(local);
  works.clear();
  for (Layout& l : layouts_) works.push_back(pg.all_gather(l.flat_param, l.shard_param.detach(), /*async=*/true));
  for (std::size_t i = 0; i < layouts_.size(); ++i) {
    works[i].wait();
    Layout& l = layouts_[i];
    for (std::size_t k = 0; k < l.params.size(); ++k)
      if (!l.aliased(k))
        Tensor(l.params[k].detach()).copy_(l.flat_param.narrow(0, l.offsets[k], l.params[k].numel()).view(l.params[k].sizes()));
  }
}

StateDict ZeroRedundancyOptimizer::state_dict() const {
  const char* op = "ZeroRedundancyOptimizer.state_dict";
  ProcessGroup& pg = *group_;
  const StateDict inner = inner_->state_dict();
  StateDict out;
  NoGradGuard no_grad;
  for (std::size_t g = 0; g < layouts_.size(); ++g) {
    const Layout& l = layouts_[g];
    const Tensor* step = inner.find(state_key(g, "step"));
    if (!step) continue;
    // The slots in the inner optimizer's order.
    const std::string prefix = "state." + std::to_string(g) + ".";
    std::vector<std::pair<std::string, Tensor>> full;
    for (const auto& [k, t] : inner) {
      if (k.rfind(prefix, 0) != 0) continue;
      const std::string slot = k.substr(prefix.size());
      if (slot == "step") continue;
      FLAME_CHECK(t.numel() == l.shard, op, "state '", slot, "' of shape ", t.sizes(), " is not elementwise (",
                  inner_->name(), "): ZeRO-1 shards only elementwise optimizers (SGD, Adam, AdamW, Lion)");
      Tensor gathered = Tensor::empty({l.shard * pg.size()}, TensorOptions(t.dtype(), pg.device()));
      pg.all_gather(gathered, t.to(pg.device()).contiguous());
      full.emplace_back(slot, gathered);
    }
    for (std::size_t k = 0; k < l.params.size(); ++k) {
      const std::size_t i = l.first_index + k;
      out.insert(state_key(i, "step"), step->clone());
      for (const auto& [slot, flat] : full)
        out.insert(state_key(i, slot), flat.narrow(0, l.offsets[k], l.params[k].numel()).view(l.params[k].sizes()).clone());
    }
  }
  for (std::size_t g = 0; g < layouts_.size(); ++g) {
    const Layout& l = layouts_[g];
    const std::string prefix = group_prefix(g);
    for (const auto& [k, t] : inner) {
      if (k.rfind(prefix, 0) != 0) continue;
      if (k == prefix + "params") {
        std::vector<int64_t> idx;
        for (std::size_t i = 0; i < l.params.size(); ++i) idx.push_back(static_cast<int64_t>(l.first_index + i));
        out.insert(k, Tensor::from_vec(idx, {static_cast<int64_t>(idx.size())}));
      } else {
        out.insert(k, t.clone());
      }
    }
  }
  return out;
}

void ZeroRedundancyOptimizer::load_state_dict(const StateDict& state) {
  const char* op = "ZeroRedundancyOptimizer.load_state_dict";
  ProcessGroup& pg = *group_;
  StateDict inner;
  NoGradGuard no_grad;
  for (std::size_t g = 0; g < layouts_.size(); ++g) {
    const Layout& l = layouts_[g];
    // The step and the slot names from the first parameter of the group that has state.
    const Tensor* step = nullptr;
    std::vector<std::string> slots;
    for (std::size_t k = 0; k < l.params.size() && !step; ++k) {
      const std::string prefix = "state." + std::to_string(l.first_index + k) + ".";
      step = state.find(prefix + "step");
      if (!step) continue;
      for (const auto& [key, t] : state)
        if (key.rfind(prefix, 0) == 0 && key != prefix + "step") slots.push_back(key.substr(prefix.size()));
    }
    if (!step) continue;
    inner.insert(state_key(g, "step"), step->clone());
    const int64_t lo = pg.rank() * l.shard;
    for (const std::string& slot : slots) {
      Tensor mine;
      for (std::size_t k = 0; k < l.params.size(); ++k) {
        const Tensor* t = state.find(state_key(l.first_index + k, slot));
        if (!t) continue;
        FLAME_CHECK(t->numel() == l.params[k].numel(), op, "key ", state_key(l.first_index + k, slot), " has ",
                    t->numel(), " elements, parameter ", l.first_index + k, " has ", l.params[k].numel());
        if (!mine.defined()) mine = Tensor::zeros({l.shard}, TensorOptions(t->dtype(), pg.device()));
      }
      if (!mine.defined()) continue;
      for_each_overlap(l, lo, lo + l.shard, [&](std::size_t k, int64_t poff, int64_t foff, int64_t n) {
        const Tensor* t = state.find(state_key(l.first_index + k, slot));
        if (t) mine.narrow(0, foff - lo, n).copy_(t->reshape({-1}).narrow(0, poff, n));
      });
      inner.insert(state_key(g, slot), mine);
    }
  }
  for (std::size_t g = 0; g < layouts_.size(); ++g) {
    const std::string prefix = group_prefix(g);
    bool any = false;
    for (const auto& [k, t] : state) {
      if (k.rfind(prefix, 0) != 0) continue;
      any = true;
      if (k == prefix + "params") inner.insert(k, Tensor::from_vec(std::vector<int64_t>{static_cast<int64_t>(g)}, {1}));
      else inner.insert(k, t);
    }
    FLAME_CHECK(any, op, "the state has no keys for parameter group ", g);
  }
  inner_->load_state_dict(inner);
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    TensorList keep = groups_[g].params;
    groups_[g] = inner_->param_groups()[g];
    groups_[g].params = std::move(keep);
  }
}

ZeroRedundancyOptimizer::MemoryReport ZeroRedundancyOptimizer::memory_report() const {
  MemoryReport r;
  const StateDict inner = inner_->state_dict();
  for (std::size_t g = 0; g < layouts_.size(); ++g) {
    r.param_numel += layouts_[g].numel;
    r.shard_numel += layouts_[g].shard;
  }
  for (const auto& [k, t] : inner) {
    if (k.rfind("state.", 0) != 0) continue;
    r.state_bytes += t.nbytes();
    bool sharded = false;
    for (const Layout& l : layouts_) sharded = sharded || t.numel() == l.shard;
    r.full_state_bytes_estimate += sharded ? t.nbytes() * static_cast<std::size_t>(group_->size()) : t.nbytes();
  }
  return r;
}

}  // namespace flame::dist
