#pragma once
// One module per activation op of FLAME (ops.h), plus Softmax/LogSoftmax over a dim. Each is a
// thin wrapper: the op carries the kernels and the gradient.
#include <cstdint>
#include <string>

#include "flame/nn/module.h"
#include "flame/ops.h"

namespace flame::nn {

#define FLAME_NN_PLAIN_ACTIVATION(Name, fn)                             \
  class Name : public Module {                                          \
   public:                                                              \
    std::string name() const override { return #Name; }                 \
    Tensor forward(const Tensor& x) override { return x.fn(); }         \
  };
FLAME_NN_PLAIN_ACTIVATION(ReLU, relu)
FLAME_NN_PLAIN_ACTIVATION(SiLU, silu)
FLAME_NN_PLAIN_ACTIVATION(Sigmoid, sigmoid)
FLAME_NN_PLAIN_ACTIVATION(Tanh, tanh)
FLAME_NN_PLAIN_ACTIVATION(Mish, mish)
#undef FLAME_NN_PLAIN_ACTIVATION

// Activations that exist as free functions only (as in PyTorch, no Tensor method).
#define FLAME_NN_FREE_ACTIVATION(Name, fn)                              \
  class Name : public Module {                                          \
   public:                                                              \
    std::string name() const override { return #Name; }                 \
    Tensor forward(const Tensor& x) override { return flame::fn(x); }   \
  };
FLAME_NN_FREE_ACTIVATION(Hardswish, hardswish)
FLAME_NN_FREE_ACTIVATION(Hardsigmoid, hardsigmoid)
#undef FLAME_NN_FREE_ACTIVATION

class GELU : public Module {
 public:
  // approximate: "none" (erf) or "tanh", as torch.nn.GELU.
  explicit GELU(std::string approximate = "none");
  std::string name() const override { return "GELU"; }
  std::string extra_repr() const override { return "approximate='" + approximate_ + "'"; }
  Tensor forward(const Tensor& x) override { return x.gelu(approximate_ == "tanh"); }

 private:
  std::string approximate_;
};

class LeakyReLU : public Module {
 public:
  explicit LeakyReLU(double negative_slope = 0.01) : slope_(negative_slope) {}
  std::string name() const override { return "LeakyReLU"; }
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override { return x.leaky_relu(slope_); }

 private:
  double slope_;
};

class ELU : public Module {
 public:
  explicit ELU(double alpha = 1.0) : alpha_(alpha) {}
  std::string name() const override { return "ELU"; }
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override { return x.elu(alpha_); }

 private:
  double alpha_;
};

class Softplus : public Module {
 public:
  explicit Softplus(double beta = 1.0, double threshold = 20.0) : beta_(beta), threshold_(threshold) {}
  std::string name() const override { return "Softplus"; }
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override { return x.softplus(beta_, threshold_); }

 private:
  double beta_, threshold_;
};

class Softmax : public Module {
 public:
  explicit Softmax(int64_t dim) : dim_(dim) {}
  std::string name() const override { return "Softmax"; }
  std::string extra_repr() const override { return "dim=" + std::to_string(dim_); }
  Tensor forward(const Tensor& x) override { return x.softmax(dim_); }

 private:
  int64_t dim_;
};

class LogSoftmax : public Module {
 public:
  explicit LogSoftmax(int64_t dim) : dim_(dim) {}
  std::string name() const override { return "LogSoftmax"; }
  std::string extra_repr() const override { return "dim=" + std::to_string(dim_); }
  Tensor forward(const Tensor& x) override { return x.log_softmax(dim_); }

 private:
  int64_t dim_;
};

namespace detail {
// Python's repr of a float (1.0, 0.01, 1e-05), for summaries that read like PyTorch's.
std::string py_float(double v);
}  // namespace detail

}  // namespace flame::nn
