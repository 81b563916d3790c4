#pragma once
// Finite-difference gradient checking (float64 central differences on the CPU).
//
// For y = f(x1, ..., xn) and a random upstream gradient v (same shape as y), the analytic
// vector-Jacobian product from backward() is compared with
//   d<v, f(x)> / dx_i[j]  ~=  (<v, f(x + eps e_j)> - <v, f(x - eps e_j)>) / (2 eps)
// with eps = 1e-6, and |analytic - numeric| <= atol + rtol * |numeric|, atol = 1e-5, rtol = 1e-3
// (PyTorch's gradcheck uses the same scheme and similar tolerances). A call that checks no element
// at all (every floating input empty, or none floating) fails: it would prove nothing.
#include <functional>
#include <string>

#include "test_util.h"

namespace flame::test {

struct GradcheckResult {
  bool ok = true;
  std::string message;
  int checked = 0;  // input elements compared
};

// `inputs` must be f64 CPU tensors; floating ones get requires_grad.
GradcheckResult gradcheck(const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs,
                          double eps = 1e-6, double atol = 1e-5, double rtol = 1e-3);

}  // namespace flame::test
