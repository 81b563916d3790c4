#pragma once
// Pooling, upsampling and pixel-shuffle modules over the functional ops of pool.h (no parameters).
#include <cstdint>
#include <optional>
#include <string>

#include "flame/nn/args.h"
#include "flame/nn/module.h"
#include "flame/nn/pool.h"

namespace flame::nn {

class MaxPool1d : public Module {
 public:
  MaxPool1d(int64_t kernel_size, int64_t stride = 0, int64_t padding = 0, int64_t dilation = 1, bool ceil_mode = false)
      : k_(kernel_size), s_(stride), p_(padding), d_(dilation), ceil_(ceil_mode) {}
  std::string name() const override { return "MaxPool1d"; }
  FLAME_NN_ARGS_CHECK(MaxPool1d,
                      "nn::MaxPool1d(kernel_size, stride = kernel_size, padding = 0, dilation = 1, ceil_mode = false)",
                      1, int64_t, int64_t, int64_t, int64_t, bool)
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override { return functional::max_pool1d(x, k_, s_, p_, d_, ceil_); }

 private:
  int64_t k_, s_, p_, d_;
  bool ceil_;
};

class MaxPool2d : public Module {
 public:
  MaxPool2d(functional::Size2 kernel_size, functional::Size2 stride = {}, functional::Size2 padding = 0,
            functional::Size2 dilation = 1, bool ceil_mode = false)
      : k_(kernel_size), s_(stride), p_(padding), d_(dilation), ceil_(ceil_mode) {}
  std::string name() const override { return "MaxPool2d"; }
  FLAME_NN_ARGS_CHECK(MaxPool2d,
                      "nn::MaxPool2d(kernel_size, stride = kernel_size, padding = 0, dilation = 1, ceil_mode = false); "
                      "sizes: an int or a pair",
                      1, functional::Size2, functional::Size2, functional::Size2, functional::Size2, bool)
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override { return functional::max_pool2d(x, k_, s_, p_, d_, ceil_); }

 private:
  functional::Size2 k_, s_, p_, d_;
  bool ceil_;
};

class AvgPool1d : public Module {
 public:
  AvgPool1d(int64_t kernel_size, int64_t stride = 0, int64_t padding = 0, bool ceil_mode = false,
            bool count_include_pad = true)
      : k_(kernel_size), s_(stride), p_(padding), ceil_(ceil_mode), include_pad_(count_include_pad) {}
  std::string name() const override { return "AvgPool1d"; }
  FLAME_NN_ARGS_CHECK(AvgPool1d,
                      "nn::AvgPool1d(kernel_size, stride = kernel_size, padding = 0, ceil_mode = false, "
                      "count_include_pad = true)",
                      1, int64_t, int64_t, int64_t, bool, bool)
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override { return functional::avg_pool1d(x, k_, s_, p_, ceil_, include_pad_); }

 private:
  int64_t k_, s_, p_;
  bool ceil_, include_pad_;
};

class AvgPool2d : public Module {
 public:
  AvgPool2d(functional::Size2 kernel_size, functional::Size2 stride = {}, functional::Size2 padding = 0,
            bool ceil_mode = false, bool count_include_pad = true, std::optional<int64_t> divisor_override = {})
      : k_(kernel_size), s_(stride), p_(padding), ceil_(ceil_mode), include_pad_(count_include_pad),
        divisor_(divisor_override) {}
  std::string name() const override { return "AvgPool2d"; }
  FLAME_NN_ARGS_CHECK(AvgPool2d,
                      "nn::AvgPool2d(kernel_size, stride = kernel_size, padding = 0, ceil_mode = false, "
                      "count_include_pad = true, divisor_override = nullopt); sizes: an int or a pair",
                      1, functional::Size2, functional::Size2, functional::Size2, bool, bool, std::optional<int64_t>)
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override {
    return functional::avg_pool2d(x, k_, s_, p_, ceil_, include_pad_, divisor_);
  }

 private:
  functional::Size2 k_, s_, p_;
  bool ceil_, include_pad_;
  std::optional<int64_t> divisor_;
};

class AdaptiveAvgPool1d : public Module {
 public:
  explicit AdaptiveAvgPool1d(int64_t output_size) : out_(output_size) {}
  std::string name() const override { return "AdaptiveAvgPool1d"; }
  std::string extra_repr() const override { return "output_size=" + std::to_string(out_); }
  Tensor forward(const Tensor& x) override { return functional::adaptive_avg_pool1d(x, out_); }

 private:
  int64_t out_;
};

class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(functional::Size2 output_size) : out_(output_size) {}
  std::string name() const override { return "AdaptiveAvgPool2d"; }
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override { return functional::adaptive_avg_pool2d(x, out_); }

 private:
  functional::Size2 out_;
};

class AdaptiveMaxPool2d : public Module {
 public:
  explicit AdaptiveMaxPool2d(functional::Size2 output_size) : out_(output_size) {}
  std::string name() const override { return "AdaptiveMaxPool2d"; }
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override { return functional::adaptive_max_pool2d(x, out_); }

 private:
  functional::Size2 out_;
};

// nn.Upsample: interpolate with fixed options, e.g. Upsample(InterpolateOptions().with_scale(2)).
class Upsample : public Module {
 public:
  explicit Upsample(functional::InterpolateOptions options) : options_(std::move(options)) {}
  std::string name() const override { return "Upsample"; }
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override { return functional::interpolate(x, options_); }

 private:
  functional::InterpolateOptions options_;
};

class PixelShuffle : public Module {
 public:
  explicit PixelShuffle(int64_t upscale_factor) : r_(upscale_factor) {}
  std::string name() const override { return "PixelShuffle"; }
  std::string extra_repr() const override { return "upscale_factor=" + std::to_string(r_); }
  Tensor forward(const Tensor& x) override { return functional::pixel_shuffle(x, r_); }

 private:
  int64_t r_;
};

class PixelUnshuffle : public Module {
 public:
  explicit PixelUnshuffle(int64_t downscale_factor) : r_(downscale_factor) {}
  std::string name() const override { return "PixelUnshuffle"; }
  std::string extra_repr() const override { return "downscale_factor=" + std::to_string(r_); }
  Tensor forward(const Tensor& x) override { return functional::pixel_unshuffle(x, r_); }

 private:
  int64_t r_;
};

}  // namespace flame::nn
