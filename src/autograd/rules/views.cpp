// Gradient rules of views and copies: each maps the output gradient back to the input's geometry.
// Nothing is saved: the lambdas capture shapes and dims only. record() turns the op name into the
// grad_fn name ("narrow" -> "NarrowBackward").
#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/autograd/rules/rules.h"

namespace flame::rules {

Tensor& with_grad(Tensor& out, const char* name, const Tensor& in, std::function<Tensor(const Tensor&)> back) {
  if (!is_floating(out.dtype()) || !needs_grad({in})) return out;
  record(out, name, TensorList{in}, [back = std::move(back)](const Tensor& g) { return TensorList{back(g)}; });
  return out;
}

}  // namespace flame::rules
