// User-defined ops (apply_custom) and gradient checkpointing.
#include "flame/ops.h"
#include "src/autograd/record.h"

namespace flame {

Tensor apply_custom(const CustomFunction& fn, const TensorList& inputs) {
  FLAME_CHECK(fn.forward && fn.backward, fn.name.empty() ? "apply_custom" : fn.name.c_str(),
              "a custom function needs both forward and backward");
  Tensor out;
  {
    NoGradGuard no_grad;
    out = fn.forward(inputs);
  }
  if (!needs_grad(inputs)) return out;
  out = out.detach();  // a fresh handle: the forward may have returned one of its inputs
  std::vector<SavedTensor> saved;
  for (const Tensor& t : inputs) saved.emplace_back(t, fn.name.c_str());
  SavedTensor saved_out(out, fn.name.c_str());
  auto backward = fn.backward;
  const std::string name = fn.name;
  record(out, name.c_str(), inputs, [saved, saved_out, backward, name](const Tensor& grad) {
    TensorList ins;
    for (const SavedTensor& s : saved) ins.push_back(s.get());
    TensorList grads = backward(ins, saved_out.get(), grad);
    FLAME_CHECK(grads.size() == ins.size(), name.c_str(), "custom backward returned ", grads.size(),
                " gradients for ", ins.size(), " inputs");
    return grads;
  });
  return out;
}

Tensor checkpoint(const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs, Generator* gen) {
  Generator* g = gen ? gen : &default_generator();
  const Generator::State rng_before = g->get_state();
  Tensor out;
  {
    NoGradGuard no_grad;
    out = fn(inputs);
  }
  if (!needs_grad(inputs)) return out;
  out = out.detach();
  std::vector<SavedTensor> saved;
  std::vector<bool> wants_grad;
  for (const Tensor& t : inputs) {
    saved.emplace_back(t, "checkpoint");
    wants_grad.push_back(t.defined() && t.requires_grad());
  }
  record(out, "checkpoint", inputs, [fn, saved, wants_grad, g, rng_before](const Tensor& grad) {
    // Recompute the forward with recording on and the generator where it was, then backprop.
    TensorList ins;
    for (std::size_t i = 0; i < saved.size(); ++i) {
      Tensor d = saved[i].get();
      if (d.defined() && wants_grad[i]) d = d.detach().requires_grad_(true);
      ins.push_back(d);
    }
    const Generator::State rng_now = g->get_state();
    g->set_state(rng_before);
    Tensor y;
    {
      EnableGradGuard enable;
      y = fn(ins);
    }
    g->set_state(rng_now);
    TensorList grads(ins.size());
    if (!y.requires_grad()) return grads;
    BackwardOptions opts;
    opts.grad_output = grad;
    Gradients gs = y.backward(opts);
    for (std::size_t i = 0; i < ins.size(); ++i) {
      if (wants_grad[i]) grads[i] = gs.get(ins[i]);
    }
    return grads;
  });
  return out;
}

}  // namespace flame
