// Gradient rules of cat and stack: each input receives its slice of the output's gradient (a view
// of it: no copy, nothing saved).
#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/autograd/rules/rules.h"

namespace flame::rules {

// starts[i]: where input i begins along dim d of out; -1 for a skipped [0] input.
void cat(Tensor& out, const TensorList& tensors, const std::vector<int64_t>& starts, int64_t d) {
  if (!is_floating(out.dtype()) || !needs_grad(tensors)) return;
  Shape lens;
  for (std::size_t i = 0; i < tensors.size(); ++i) lens.push_back(starts[i] < 0 ? 0 : tensors[i].sizes()[d]);
  record(out, "CatBackward", tensors, [starts, lens, d](const Tensor& g) {
    TensorList grads;
    grads.reserve(starts.size());
    for (std::size_t i = 0; i < starts.size(); ++i) {
      // A skipped [0] input gets an empty (defined) gradient, so that what produced it still
      // runs its rule and passes zeros on.
      grads.push_back(starts[i] < 0 ? Tensor::zeros({0}, {g.dtype(), g.device()})
                                    : g.narrow(d, starts[i], lens[i]));
    }
    return grads;
  });
}

void stack(Tensor& out, const TensorList& tensors, int64_t d) {
  if (!is_floating(out.dtype()) || !needs_grad(tensors)) return;
  const std::size_t count = tensors.size();
  record(out, "StackBackward", tensors, [d, count](const Tensor& g) {
    TensorList grads;
    grads.reserve(count);
    for (std::size_t i = 0; i < count; ++i) grads.push_back(g.select(d, static_cast<int64_t>(i)));
    return grads;
  });
}

}  // namespace flame::rules
