#pragma once
// Convolutions with torch.nn.functional's arguments: conv1d/2d/3d and conv_transpose1d/2d/3d.
// docs/nn-conv.md describes layouts (NCHW and channels-last), dtypes and the CUDA (cuDNN) path.
//
//   using namespace flame::nn::functional;
//   Tensor y = conv2d(x, w, b, /*stride=*/{2}, /*padding=*/{1});     // x [N, C, H, W], w [K, C/g, R, S]
//   Tensor z = conv2d(x, w, {}, {1}, "same", /*dilation=*/{2});
//   Tensor u = conv_transpose2d(x, w, b, {2}, {1}, /*output_padding=*/{1});  // w [C, K/g, R, S]
//   Tensor v = conv2d(x, w, b, 2, 1);                                 // ints, as torch's F.conv2d
//
// stride, dilation, padding and output_padding take one value for every spatial dim (2 or {2}) or
// one per dim ({2, 1}); see nn::Ints (args.h). An input without the batch dim ([C, H, W]) gives an
// output without it.
#include <cstdint>
#include <initializer_list>
#include <string>

#include "flame/nn/args.h"
#include "flame/tensor.h"

namespace flame::nn::functional {

// Padding of a convolution: explicit sizes ({1}, {1, 2}, 1) or torch's strings "same"
// (output size = input size; stride must be 1) and "valid" (no padding).
struct Padding {
  enum class Mode : uint8_t { explicit_sizes, same, valid };
  Mode mode = Mode::explicit_sizes;
  Shape sizes{0};

  Padding() = default;
  Padding(std::initializer_list<int64_t> s) : sizes(s) {}
  Padding(const Shape& s) : sizes(s) {}          // NOLINT: implicit like torch's int tuple
  Padding(int64_t s) : sizes{s} {}               // NOLINT
  Padding(int s) : sizes{static_cast<int64_t>(s)} {}  // NOLINT
  Padding(const char* s);                        // NOLINT: "same" or "valid"
  Padding(const std::string& s) : Padding(s.c_str()) {}  // NOLINT
};

Tensor conv1d(const Tensor& input, const Tensor& weight, const Tensor& bias = {}, const Ints& stride = {1},
              const Padding& padding = {0}, const Ints& dilation = {1}, int64_t groups = 1);
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias = {}, const Ints& stride = {1},
              const Padding& padding = {0}, const Ints& dilation = {1}, int64_t groups = 1);
Tensor conv3d(const Tensor& input, const Tensor& weight, const Tensor& bias = {}, const Ints& stride = {1},
              const Padding& padding = {0}, const Ints& dilation = {1}, int64_t groups = 1);

// Transposed convolution (the gradient of conv with respect to its input); argument order as torch.
// output_padding (< stride or < dilation) adds rows at the far end of each spatial dim.
Tensor conv_transpose1d(const Tensor& input, const Tensor& weight, const Tensor& bias = {}, const Ints& stride = {1},
                        const Ints& padding = {0}, const Ints& output_padding = {0}, int64_t groups = 1,
                        const Ints& dilation = {1});
Tensor conv_transpose2d(const Tensor& input, const Tensor& weight, const Tensor& bias = {}, const Ints& stride = {1},
                        const Ints& padding = {0}, const Ints& output_padding = {0}, int64_t groups = 1,
                        const Ints& dilation = {1});
Tensor conv_transpose3d(const Tensor& input, const Tensor& weight, const Tensor& bias = {}, const Ints& stride = {1},
                        const Ints& padding = {0}, const Ints& output_padding = {0}, int64_t groups = 1,
                        const Ints& dilation = {1});

// Memory-format helpers. A 4-d/5-d tensor is channels-last when its strides are those of the
// contiguous [N, *spatial, C] tensor permuted to [N, C, *spatial] (PyTorch's channels_last and
// channels_last_3d). Convolutions give their output the input's format, as PyTorch does.
bool is_channels_last(const Tensor& t);
// A channels-last copy of t (t itself when it already is one); 4-d or 5-d.
Tensor to_channels_last(const Tensor& t);

}  // namespace flame::nn::functional
