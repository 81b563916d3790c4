#pragma once
// Normalisation modules over the functional ops of norm.h, with PyTorch's parameter and buffer
// names (weight, bias, running_mean, running_var, num_batches_tracked) and defaults.
#include <cstdint>
#include <optional>
#include <string>

#include "flame/nn/args.h"
#include "flame/nn/module.h"
#include "flame/nn/norm.h"

namespace flame::nn {

class LayerNorm : public Module {
 public:
  // elementwise_affine: weight (ones) and, when bias, bias (zeros) of normalized_shape (an int
  // for the last dim, or a list: LayerNorm(64), LayerNorm({8, 8})).
  LayerNorm(Ints normalized_shape, double eps = 1e-5, bool elementwise_affine = true, bool bias = true,
            TensorOptions opts = {});
  std::string name() const override { return "LayerNorm"; }
  FLAME_NN_ARGS_CHECK(LayerNorm,
                      "nn::LayerNorm(normalized_shape (an int or a list), eps = 1e-5, elementwise_affine = true, "
                      "bias = true, opts = {})",
                      1, Ints, double, bool, bool, TensorOptions)
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override;
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }

 private:
  Shape normalized_shape_;
  double eps_;
  Tensor weight_, bias_;
};

class RMSNorm : public Module {
 public:
  // eps unset: the input dtype's epsilon, as PyTorch.
  RMSNorm(Ints normalized_shape, std::optional<double> eps = std::nullopt, bool elementwise_affine = true,
          TensorOptions opts = {});
  std::string name() const override { return "RMSNorm"; }
  FLAME_NN_ARGS_CHECK(RMSNorm,
                      "nn::RMSNorm(normalized_shape (an int or a list), eps = nullopt, elementwise_affine = true, "
                      "opts = {})",
                      1, Ints, std::optional<double>, bool, TensorOptions)
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override;
  const Tensor& weight() const { return weight_; }

 private:
  Shape normalized_shape_;
  std::optional<double> eps_;
  Tensor weight_;
};

class GroupNorm : public Module {
 public:
  GroupNorm(int64_t num_groups, int64_t num_channels, double eps = 1e-5, bool affine = true, TensorOptions opts = {});
  std::string name() const override { return "GroupNorm"; }
  FLAME_NN_ARGS_CHECK(GroupNorm, "nn::GroupNorm(num_groups, num_channels, eps = 1e-5, affine = true, opts = {})", 2,
                      int64_t, int64_t, double, bool, TensorOptions)
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override;
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }

 private:
  int64_t num_groups_, num_channels_;
  double eps_;
  Tensor weight_, bias_;
};

// BatchNorm1d ([N, C] or [N, C, L]) and BatchNorm2d ([N, C, H, W]). Training mode normalises with
// the batch statistics and updates running_mean/running_var (unbiased) with `momentum`, or with a
// cumulative average when momentum is unset; eval mode uses the running statistics (unless
// track_running_stats is false, then batch statistics always).
class BatchNormNd : public Module {
 public:
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override;
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }
  const Tensor& running_mean() const { return running_mean_; }
  const Tensor& running_var() const { return running_var_; }
  const Tensor& num_batches_tracked() const { return num_batches_tracked_; }

 protected:
  BatchNormNd(int64_t dims_lo, int64_t dims_hi, int64_t num_features, double eps, std::optional<double> momentum,
              bool affine, bool track_running_stats, TensorOptions opts);

 private:
  int64_t dims_lo_, dims_hi_;
  int64_t num_features_;
  double eps_;
  std::optional<double> momentum_;
  bool track_running_stats_;
  Tensor weight_, bias_, running_mean_, running_var_, num_batches_tracked_;
};

class BatchNorm1d : public BatchNormNd {
 public:
  BatchNorm1d(int64_t num_features, double eps = 1e-5, std::optional<double> momentum = 0.1, bool affine = true,
              bool track_running_stats = true, TensorOptions opts = {})
      : BatchNormNd(2, 3, num_features, eps, momentum, affine, track_running_stats, opts) {}
  std::string name() const override { return "BatchNorm1d"; }
};

class BatchNorm2d : public BatchNormNd {
 public:
  BatchNorm2d(int64_t num_features, double eps = 1e-5, std::optional<double> momentum = 0.1, bool affine = true,
              bool track_running_stats = true, TensorOptions opts = {})
      : BatchNormNd(4, 4, num_features, eps, momentum, affine, track_running_stats, opts) {}
  std::string name() const override { return "BatchNorm2d"; }
};

}  // namespace flame::nn
