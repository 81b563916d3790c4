#include "gradcheck.h"

#include <cmath>
#include <sstream>

namespace flame::test {

GradcheckResult gradcheck(const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs, double eps,
                          double atol, double rtol) {
  GradcheckResult r;
  TensorList xs;
  for (const Tensor& t : inputs) {
    Tensor c = t.detach();
    if (is_floating(c.dtype())) c.requires_grad_(true);
    xs.push_back(c);
  }
  Tensor y = fn(xs);
  if (!y.requires_grad()) {
    r.ok = false;
    r.message = "output does not require grad (no gradient recorded)";
    return r;
  }
  Generator gen(7);
  Tensor v = Tensor::randn(y.sizes(), 0.0, 1.0, {DType::f64, y.device()}, &gen);
  BackwardOptions opts;
  opts.grad_output = v.to(y.dtype());
  Gradients grads = y.backward(opts);

  auto objective = [&](const TensorList& in) {
    NoGradGuard ng;
    Tensor out = fn(in).to(DType::f64);
    return (out * v).sum().item<double>();
  };
  std::ostringstream os;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    if (!is_floating(xs[i].dtype())) continue;
    Tensor analytic = grads.try_get(xs[i]);
    std::vector<double> an = analytic.defined() ? analytic.to_vec<double>() : std::vector<double>(xs[i].numel(), 0.0);
    // Perturb a contiguous copy; views keep the caller's layout for the forward pass.
    Tensor base = inputs[i].contiguous().clone();
    std::vector<double> vals = base.to_vec<double>();
    for (int64_t j = 0; j < base.numel(); ++j) {
      auto eval = [&](double delta) {
        std::vector<double> p = vals;
        p[j] += delta;
        TensorList in = inputs;
        in[i] = Tensor::from_vec(p, base.sizes()).to(inputs[i].dtype());
        return objective(in);
      };
      const double numeric = (eval(eps) - eval(-eps)) / (2 * eps);
      ++r.checked;
      if (std::fabs(an[j] - numeric) > atol + rtol * std::fabs(numeric)) {
        if (r.ok) os << "input " << i << " element " << j << ": analytic " << an[j] << ", numeric " << numeric;
        r.ok = false;
      }
    }
  }
  r.message = os.str();
  if (r.checked == 0) {
    // Nothing compared is not a pass: an op case whose differentiable inputs are all empty (or not
    // floating) would otherwise succeed whatever its backward does.
    r.ok = false;
    r.message = "no input element was checked (no floating input with elements)";
  }
  return r;
}

}  // namespace flame::test
