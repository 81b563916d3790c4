#pragma once
// Identity, Flatten and Unflatten (shape-only modules, as torch.nn).
#include <cstdint>
#include <string>

#include "flame/nn/module.h"

namespace flame::nn {

class Identity : public Module {
 public:
  std::string name() const override { return "Identity"; }
  Tensor forward(const Tensor& x) override { return x; }
};

class Flatten : public Module {
 public:
  // PyTorch's defaults keep the batch dim: [N, ...] -> [N, prod(...)].
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1) : start_dim_(start_dim), end_dim_(end_dim) {}
  std::string name() const override { return "Flatten"; }
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override;

 private:
  int64_t start_dim_, end_dim_;
};

class Unflatten : public Module {
 public:
  Unflatten(int64_t dim, Shape sizes) : dim_(dim), sizes_(std::move(sizes)) {}
  std::string name() const override { return "Unflatten"; }
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override;

 private:
  int64_t dim_;
  Shape sizes_;
};

}  // namespace flame::nn
