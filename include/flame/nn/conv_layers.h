#pragma once
// Convolution modules over the functional ops of conv.h: Conv1d/2d/3d and ConvTranspose1d/2d/3d,
// with PyTorch's parameter names, shapes and default initialisation, and LoRA on Conv2d.
//
//   auto conv = std::make_shared<nn::Conv2d>(64, 128, /*kernel=*/3, /*stride=*/1, /*padding=*/1);
//   auto wide = std::make_shared<nn::Conv2d>(64, 128, /*kernel=*/{3, 1}, /*stride=*/2, "valid");
//   Tensor y = conv->forward(x);            // x [N, 64, H, W] (NCHW or channels-last)
//
// kernel_size, stride, dilation (and padding, output_padding) take an int or a per-dim list, as
// PyTorch's int-or-tuple arguments (nn::Ints); arguments that fit no constructor fail to compile
// with a message naming the layer's signature (FLAME_NN_ARGS_CHECK, args.h).
#include <cstdint>
#include <memory>
#include <string>

#include "flame/nn/args.h"
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
  // Never runs: lets the FLAME_NN_ARGS_CHECK constructors of the layers below compile down to
  // their one static_assert message.
  ConvNd() = default;
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
  Conv1d(int64_t in_channels, int64_t out_channels, const Ints& kernel_size, const Ints& stride = 1,
         const functional::Padding& padding = 0, const Ints& dilation = 1, int64_t groups = 1,
         bool bias = true, TensorOptions opts = {})
      : ConvNd(1, false, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, {0},
               opts) {}
  std::string name() const override { return "Conv1d"; }
  FLAME_NN_ARGS_CHECK(Conv1d,
                      "nn::Conv1d(in_channels, out_channels, kernel_size, stride = 1, padding = 0, dilation = 1, "
                      "groups = 1, bias = true, opts = {}); kernel_size, stride, dilation: an int or a list",
                      3, int64_t, int64_t, const Ints&, const Ints&, const functional::Padding&, const Ints&,
                      int64_t, bool, TensorOptions)
};

// Conv2d carries an optional LoRA adapter as PEFT's: lora_A a Conv2d(in, r) with this layer's
// kernel, stride, padding and dilation, lora_B a 1x1 Conv2d(r, out); both without bias.
class Conv2d : public ConvNd, public LoraTarget {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, const Ints& kernel_size, const Ints& stride = 1,
         const functional::Padding& padding = 0, const Ints& dilation = 1, int64_t groups = 1,
         bool bias = true, TensorOptions opts = {})
      : ConvNd(2, false, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, {0},
               opts) {}
  std::string name() const override { return "Conv2d"; }
  FLAME_NN_ARGS_CHECK(Conv2d,
                      "nn::Conv2d(in_channels, out_channels, kernel_size, stride = 1, padding = 0, dilation = 1, "
                      "groups = 1, bias = true, opts = {}); kernel_size, stride, dilation: an int or a list",
                      3, int64_t, int64_t, const Ints&, const Ints&, const functional::Padding&, const Ints&,
                      int64_t, bool, TensorOptions)
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
  Conv3d(int64_t in_channels, int64_t out_channels, const Ints& kernel_size, const Ints& stride = 1,
         const functional::Padding& padding = 0, const Ints& dilation = 1, int64_t groups = 1,
         bool bias = true, TensorOptions opts = {})
      : ConvNd(3, false, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, {0},
               opts) {}
  std::string name() const override { return "Conv3d"; }
  FLAME_NN_ARGS_CHECK(Conv3d,
                      "nn::Conv3d(in_channels, out_channels, kernel_size, stride = 1, padding = 0, dilation = 1, "
                      "groups = 1, bias = true, opts = {}); kernel_size, stride, dilation: an int or a list",
                      3, int64_t, int64_t, const Ints&, const Ints&, const functional::Padding&, const Ints&,
                      int64_t, bool, TensorOptions)
};

// Transposed convolutions; argument order as PyTorch's ConvTranspose2d.
class ConvTranspose1d : public ConvNd {
 public:
  ConvTranspose1d(int64_t in_channels, int64_t out_channels, const Ints& kernel_size, const Ints& stride = 1,
                  const Ints& padding = 0, const Ints& output_padding = 0, int64_t groups = 1,
                  bool bias = true, const Ints& dilation = 1, TensorOptions opts = {})
      : ConvNd(1, true, in_channels, out_channels, kernel_size, stride, functional::Padding(padding.values),
               dilation, groups, bias, output_padding, opts) {}
  std::string name() const override { return "ConvTranspose1d"; }
  FLAME_NN_ARGS_CHECK(ConvTranspose1d,
                      "nn::ConvTranspose1d(in_channels, out_channels, kernel_size, stride = 1, padding = 0, "
                      "output_padding = 0, groups = 1, bias = true, dilation = 1, opts = {}); sizes: an int or a list",
                      3, int64_t, int64_t, const Ints&, const Ints&, const Ints&, const Ints&, int64_t, bool,
                      const Ints&, TensorOptions)
};
class ConvTranspose2d : public ConvNd {
 public:
  ConvTranspose2d(int64_t in_channels, int64_t out_channels, const Ints& kernel_size, const Ints& stride = 1,
                  const Ints& padding = 0, const Ints& output_padding = 0, int64_t groups = 1,
                  bool bias = true, const Ints& dilation = 1, TensorOptions opts = {})
      : ConvNd(2, true, in_channels, out_channels, kernel_size, stride, functional::Padding(padding.values),
               dilation, groups, bias, output_padding, opts) {}
  std::string name() const override { return "ConvTranspose2d"; }
  FLAME_NN_ARGS_CHECK(ConvTranspose2d,
                      "nn::ConvTranspose2d(in_channels, out_channels, kernel_size, stride = 1, padding = 0, "
                      "output_padding = 0, groups = 1, bias = true, dilation = 1, opts = {}); sizes: an int or a list",
                      3, int64_t, int64_t, const Ints&, const Ints&, const Ints&, const Ints&, int64_t, bool,
                      const Ints&, TensorOptions)
};
class ConvTranspose3d : public ConvNd {
 public:
  ConvTranspose3d(int64_t in_channels, int64_t out_channels, const Ints& kernel_size, const Ints& stride = 1,
                  const Ints& padding = 0, const Ints& output_padding = 0, int64_t groups = 1,
                  bool bias = true, const Ints& dilation = 1, TensorOptions opts = {})
      : ConvNd(3, true, in_channels, out_channels, kernel_size, stride, functional::Padding(padding.values),
               dilation, groups, bias, output_padding, opts) {}
  std::string name() const override { return "ConvTranspose3d"; }
  FLAME_NN_ARGS_CHECK(ConvTranspose3d,
                      "nn::ConvTranspose3d(in_channels, out_channels, kernel_size, stride = 1, padding = 0, "
                      "output_padding = 0, groups = 1, bias = true, dilation = 1, opts = {}); sizes: an int or a list",
                      3, int64_t, int64_t, const Ints&, const Ints&, const Ints&, const Ints&, int64_t, bool,
                      const Ints&, TensorOptions)
};

}  // namespace flame::nn
