// User-defined ops (apply_custom) and gradient checkpointing.
//
// Note [Checkpoint captures]
// checkpoint(fn, inputs) must give gradients to everything fn reads that requires grad, not only
// to `inputs`: a block's weights are usually captured by the lambda. While fn runs its first
// (no-grad) forward, a thread-local ReadCollector is told of every tensor an op reads that
// requires grad (needs_grad reports them when grad mode is off); none of them can have been made
// inside fn, since nothing is recorded there. The checkpoint node takes them as extra inputs.
// The recompute runs fn with recording on and a backward that stops at those tensors and at the
// fresh copies of `inputs` (BackwardOptions::inputs), so a captured non-leaf is not walked twice:
// its own history gets its gradient from the outer backward. Nested checkpoints pass what they
// collected on to the enclosing collector.
#include <unordered_set>

#include "flame/ops.h"
#include "src/amp/autocast.h"
#include "src/autograd/checkpoint_scope.h"
#include "src/autograd/record.h"

namespace flame {

namespace autograd_detail {
struct ReadCollector {
  ReadCollector* parent = nullptr;
  TensorList tensors;
  std::unordered_set<const AutogradMeta*> seen;
  void add(const Tensor& t) {
    if (t.defined() && t.requires_grad() && seen.insert(t.impl()->autograd.get()).second) tensors.push_back(t);
  }
};

void collect_reads(std::initializer_list<std::reference_wrapper<const Tensor>> inputs) {
  for (const Tensor& t : inputs) t_state.collector->add(t);
}
void collect_reads(const TensorList& inputs) {
  for (const Tensor& t : inputs) t_state.collector->add(t);
}
}  // namespace autograd_detail

using autograd_detail::t_state;

Tensor apply_custom(const CustomFunction& fn, const TensorList& inputs) {
  FLAME_CHECK(fn.forward && fn.backward, fn.name.empty() ? "apply_custom" : fn.name.c_str(),
              "a custom function needs both forward and backward");
  Tensor out;
  {
    NoGradGuard no_grad;
    out = fn.forward(inputs);
  }
  FLAME_CHECK(out.defined(), fn.name.empty() ? "apply_custom" : fn.name.c_str(), "the forward of custom function ",
              fn.name.empty() ? std::string("(unnamed)") : "'" + fn.name + "'",
              " returned an undefined tensor; forward must return its output tensor");
  if (!needs_grad(inputs)) return out;
  out = out.detach();  // a fresh handle: the forward may have returned one of its inputs
  const char* name = intern_backward_name(fn.name.empty() ? "custom" : fn.name);
  std::vector<SavedTensor> saved;
  for (const Tensor& t : inputs) saved.emplace_back(t, name);
  SavedTensor saved_out(out, name);
  auto backward = fn.backward;
  record(out, name, inputs, [saved, saved_out, backward, name](const Tensor& grad) {
    TensorList ins;
    for (const SavedTensor& s : saved) ins.push_back(s.get());
    TensorList grads = backward(ins, saved_out.get(), grad);
    FLAME_CHECK(grads.size() == ins.size(), name, "custom backward returned ", grads.size(), " gradients for ",
                ins.size(), " inputs");
    return grads;
  });
  return out;
}

Tensor checkpoint(const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs, Generator* gen) {
  return autograd_detail::checkpoint_scoped(fn, inputs, gen, nullptr);
}

namespace autograd_detail {

RecomputeScope::RecomputeScope(Generator& gen, const Generator::State& state)
    : gen_(gen), previous_(gen.get_state()), depth_(t_state.backward_depth) {
  gen_.set_state(state);
  t_state.backward_depth = 0;
}

RecomputeScope::~RecomputeScope() {
  t_state.backward_depth = depth_;
  gen_.set_state(previous_);
}

Tensor checkpoint_scoped(const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs, Generator* gen,
                         const CheckpointScope& scope) {
  Generator* g = gen ? gen : &default_generator();
  const Generator::State rng_before = g->get_state();
  const amp::detail::AutocastState autocast_before = amp::detail::autocast_state();
  autograd_detail::ReadCollector reads;
  reads.parent = t_state.collector;
  Tensor out;
  {
    NoGradGuard no_grad;
    const std::shared_ptr<void> held = scope ? scope(false) : nullptr;
    t_state.collector = &reads;
    try {
      out = fn(inputs);
    } catch (...) {
      t_state.collector = reads.parent;
      throw;
    }
    t_state.collector = reads.parent;
  }
  FLAME_CHECK(out.defined(), "checkpoint", "the checkpointed function returned an undefined tensor; it must return "
              "its output");
  if (reads.parent) {
    for (const Tensor& t : reads.tensors) reads.parent->add(t);
  }
  // Node inputs: the explicit inputs, then every captured tensor (Note [Checkpoint captures]).
  TensorList edges = inputs;
  edges.insert(edges.end(), reads.tensors.begin(), reads.tensors.end());
  if (!needs_grad(edges)) return out;
  out = out.detach();
  const std::size_t n_in = inputs.size();
  std::vector<SavedTensor> saved;
  std::vector<bool> wants_grad;
  for (const Tensor& t : inputs) {
    saved.emplace_back(t, "checkpoint");
    wants_grad.push_back(t.defined() && t.requires_grad());
  }
  // Captured tensors keep their identity (they key the inner store) and their version: one
  // written in place before backward would make the recompute silently differ.
  std::vector<SavedTensor> captured;
  // They are never packed by saved-tensor hooks (Note [Saved tensor hooks]): identity matters.
  for (const Tensor& t : reads.tensors) captured.emplace_back(t, "checkpoint", /*detach=*/false, /*allow_hooks=*/false);
  record(out, "CheckpointBackward", edges,
         [fn, saved, wants_grad, captured, n_in, g, rng_before, autocast_before, scope](const Tensor& grad) {
    // Held until the inner backward below has read what the recompute saved.
    const std::shared_ptr<void> held = scope ? scope(true) : nullptr;
    // Recompute the forward with recording on and the generator where it was, then backprop.
    TensorList ins;
    TensorList stop_at;
    for (std::size_t i = 0; i < saved.size(); ++i) {
      Tensor d = saved[i].get();
      if (d.defined() && wants_grad[i]) {
        d = d.detach().requires_grad_(true);
        stop_at.push_back(d);
      }
      ins.push_back(d);
    }
    TensorList caps;
    for (const SavedTensor& c : captured) {
      caps.push_back(c.get());
      stop_at.push_back(caps.back());
    }
    Tensor y;
    {
      autograd_detail::RecomputeScope recompute(*g, rng_before);
      amp::detail::AutocastStateGuard autocast(autocast_before);  // same dtypes as the first forward
      y = fn(ins);
    }
    TensorList grads(n_in + caps.size());
    if (!y.requires_grad() || stop_at.empty()) return grads;
    BackwardOptions opts;
    opts.grad_output = grad;
    opts.inputs = stop_at;
    Gradients gs = y.backward(opts);
    for (std::size_t i = 0; i < n_in; ++i) {
      if (wants_grad[i]) grads[i] = gs.try_get(ins[i]);
    }
    for (std::size_t j = 0; j < caps.size(); ++j) grads[n_in + j] = gs.try_get(caps[j]);
    return grads;
  });
  return out;
}

}  // namespace autograd_detail

}  // namespace flame
