#pragma once
// flame::nn::init: in-place parameter initialisation as torch.nn.init. Every function writes under
// no-grad (the tensor may require grad), returns the tensor, and draws from `gen` (default:
// default_generator()), so a seeded generator reproduces the values bit-exactly, on CPU and CUDA
// alike (Philox; see random.h).
#include <cstdint>
#include <optional>
#include <utility>

#include "flame/random.h"
#include "flame/tensor.h"

namespace flame::nn::init {

enum class Nonlinearity : uint8_t { linear, conv1d, conv2d, conv3d, sigmoid, tanh, relu, leaky_relu, selu };
enum class FanMode : uint8_t { fan_in, fan_out };

// The recommended gain for a nonlinearity (torch.nn.init.calculate_gain); `param` is leaky_relu's
// negative slope (default 0.01).
double calculate_gain(Nonlinearity nonlinearity, std::optional<double> param = std::nullopt);
// (fan_in, fan_out) of a weight of >= 2 dims: size(1) and size(0) times the receptive field.
std::pair<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& t);

Tensor& uniform_(Tensor& t, double a = 0.0, double b = 1.0, Generator* gen = nullptr);
Tensor& normal_(Tensor& t, double mean = 0.0, double std = 1.0, Generator* gen = nullptr);
// N(mean, std^2) restricted to [a, b] (inverse-CDF sampling, as PyTorch).
Tensor& trunc_normal_(Tensor& t, double mean = 0.0, double std = 1.0, double a = -2.0, double b = 2.0,
                      Generator* gen = nullptr);
Tensor& constant_(Tensor& t, Scalar value);
Tensor& zeros_(Tensor& t);
Tensor& ones_(Tensor& t);
// The identity in a 2-d tensor (ones on the main diagonal).
Tensor& eye_(Tensor& t);
Tensor& xavier_uniform_(Tensor& t, double gain = 1.0, Generator* gen = nullptr);
Tensor& xavier_normal_(Tensor& t, double gain = 1.0, Generator* gen = nullptr);
// a: leaky_relu's negative slope (nonlinearity leaky_relu); PyTorch's defaults.
Tensor& kaiming_uniform_(Tensor& t, double a = 0.0, FanMode mode = FanMode::fan_in,
                         Nonlinearity nonlinearity = Nonlinearity::leaky_relu, Generator* gen = nullptr);
Tensor& kaiming_normal_(Tensor& t, double a = 0.0, FanMode mode = FanMode::fan_in,
                        Nonlinearity nonlinearity = Nonlinearity::leaky_relu, Generator* gen = nullptr);

}  // namespace flame::nn::init
