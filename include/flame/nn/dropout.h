#pragma once
// Dropout: zeroes elements with probability p during training and scales the rest by 1/(1-p);
// the identity in eval mode. The mask is a Philox draw (Tensor::bernoulli), so one seed gives the
// same mask on CPU and CUDA.
#include <string>

#include "flame/nn/module.h"
#include "flame/random.h"

namespace flame::nn {

namespace functional {
// p in [0, 1]; p = 0 or training = false returns x itself; p = 1 gives zeros (gradient zero).
Tensor dropout(const Tensor& x, double p = 0.5, bool training = true, Generator* gen = nullptr);
}  // namespace functional

class Dropout : public Module {
 public:
  // gen: the generator masks are drawn from (default: default_generator()); not owned.
  explicit Dropout(double p = 0.5, Generator* gen = nullptr);
  std::string name() const override { return "Dropout"; }
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override;
  double p() const { return p_; }

 private:
  double p_;
  Generator* gen_;
};

}  // namespace flame::nn
