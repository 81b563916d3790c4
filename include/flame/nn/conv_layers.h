#pragma once
// Convolution modules over the functional ops of conv.h: Conv1d/2d/3d and ConvTranspose1d/2d/3d,
// with PyTorch's parameter names, shapes and default initialisation, and LoRA on Conv2d.
//
//   auto conv = std::make_shared<nn::Conv2d>(64, 128, /*kernel=*/Shape{3}, /*stride=*/Shape{1}, /*padding=*/1);
//   Tensor y = conv->forward(x);            // x [N, 64, H, W] (NCHW or channels-last)
#include <cstdint>
#include <memory>
#include <string>

#include "flame/nn/conv.h"
#include "flame/nn/lora.h"
#include "flame/nn/module.h"

namespace flame::nn {

class Linear;

// The shared part of every convolution module. A kernel/stride/padding/dilation given as one value
// applies to every spatial dim, as PyTorch's int arguments.
class ConvNd : public Module {
 public:
  std::string extra_repr() const override;
  Tensor forward(const Tensor& x) override;

  int64_t in_channels() const { return in_channels_; }
  int64_t out_channels() const { return out_channels_; }
  const Shape& kernel_size() const { return kernel_; }
  const Shape& stride() const { return stride_; }
  const Shape& dilation() const { return dilation_; }
  const functional::Padding& padding() const { return padding_; }
  int64_t groups() const { return groups_; }
  bool transposed() const { return transposed_; }
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }  // undefined without bias

 protected:
  // weight: [out, in / groups, *kernel] (conv) or [in, out / groups, *kernel] (transposed);
  // kaiming_uniform(a = sqrt(5)) and bias U(+-1/sqrt(fan_in)), PyTorch's defaults.
  ConvNd(int64_t nsp, bool transposed, int64_t in_channels, int64_t out_channels, const Shape& kernel_size,
         const Shape& stride, const functional::Padding& padding, const Shape& dilation, int64_t groups,
         bool bias, const Shape& output_padding, TensorOptions opts);
  // The convolution with explicit weight (LoRA's merged weight path calls it too).
  Tensor conv(const Tensor& x, const Tensor& weight, const Tensor& bias) const;

  int64_t nsp_;
  bool transposed_;
  int64_t in_channels_, out_channels_;
  Shape kernel_, stride_, dilation_, output_padding_;
  functional::Padding padding_;
  int64_t groups_;
  Tensor weight_, bias_;
};

class Conv1d : public ConvNd {
 public:
  Conv1d(int64_t in_channels, int64_t out_channels, const Shape& kernel_size, const Shape& stride = {1},
         const functional::Padding& padding = {0}, const Shape& dilation = {1}, int64_t groups = 1,
         bool bias = true, TensorOptions opts = {})
      : ConvNd(1, false, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, {0},
               opts) {}
  std::string name() const override { return "Conv1d"; }
};

// Conv2d carries an optional LoRA adapter as PEFT's: lora_A a Conv2d(in, r) with this layer's
// kernel, stride, padding and dilation, lora_B a 1x1 Conv2d(r, out); both without bias.
class Conv2d : public ConvNd, public LoraTarget {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, const Shape& kernel_size, const Shape& stride = {1},
         const functional::Padding& padding = {0}, const Shape& dilation = {1}, int64_t groups = 1,
         bool bias = true, TensorOptions opts = {})
      : ConvNd(2, false, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, {0},
               opts) {}
  std::string name() const override { return "Conv2d"; }
  Tensor forward(const Tensor& x) override;

  void add_lora(const LoraOptions& options) override;
  bool has_lora() const override { return lora_A_ != nullptr; }
  void merge() override;
  void unmerge() override;
  bool merged() const override { return merged_; }
  const std::shared_ptr<Conv2d>& lora_A() const { return lora_A_; }
  const std::shared_ptr<Conv2d>& lora_B() const { return lora_B_; }
  // scaling * (B composed with A) as one [out, in / groups, kh, kw] weight (recorded).
  Tensor lora_delta_weight() const;

 private:
  std::shared_ptr<Conv2d> lora_A_, lora_B_;
  std::shared_ptr<Module> lora_dropout_;
  double scaling_ = 0.0;
  bool merged_ = false;
};

class Conv3d : public ConvNd {
 public:
  Conv3d(int64_t in_channels, int64_t out_channels, const Shape& kernel_size, const Shape& stride = {1},
         const functional::Padding& padding = {0}, const Shape& dilation = {1}, int64_t groups = 1,
         bool bias = true, TensorOptions opts = {})
      : ConvNd(3, false, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, {0},
               opts) {}
  std::string name() const override { return "Conv3d"; }
};

// Transposed convolutions; argument order as PyTorch's ConvTranspose2d.
class ConvTranspose1d : public ConvNd {
 public:
  ConvTranspose1d(int64_t in_channels, int64_t out_channels, const Shape& kernel_size, const Shape& stride = {1},
                  const Shape& padding = {0}, const Shape& output_padding = {0}, int64_t groups = 1,
                  bool bias = true, const Shape& dilation = {1}, TensorOptions opts = {})
      : ConvNd(1, true, in_channels, out_channels, kernel_size, stride, functional::Padding(padding), dilation,
               groups, bias, output_padding, opts) {}
  std::string name() const override { return "ConvTranspose1d"; }
};
class ConvTranspose2d : public ConvNd {
 public:
  ConvTranspose2d(int64_t in_channels, int64_t out_channels, const Shape& kernel_size, const Shape& stride = {1},
                  const Shape& padding = {0}, const Shape& output_padding = {0}, int64_t groups = 1,
                  bool bias = true, const Shape& dilation = {1}, TensorOptions opts = {})
      : ConvNd(2, true, in_channels, out_channels, kernel_size, stride, functional::Padding(padding), dilation,
               groups, bias, output_padding, opts) {}
  std::string name() const override { return "ConvTranspose2d"; }
};
class ConvTranspose3d : public ConvNd {
 public:
  ConvTranspose3d(int64_t in_channels, int64_t out_channels, const Shape& kernel_size, const Shape& stride = {1},
                  const Shape& padding = {0}, const Shape& output_padding = {0}, int64_t groups = 1,
                  bool bias = true, const Shape& dilation = {1}, TensorOptions opts = {})
      : ConvNd(3, true, in_channels, out_channels, kernel_size, stride, functional::Padding(padding), dilation,
               groups, bias, output_padding, opts) {}
  std::string name() const override { return "ConvTranspose3d"; }
};

}  // namespace flame::nn
