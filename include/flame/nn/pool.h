#pragma once
// Pooling, upsampling and pixel shuffle, as torch.nn.functional spells them (docs/nn-pool.md).
// Inputs are [N, C, L] / [C, L] (1-d ops) or [N, C, H, W] / [C, H, W] (2-d ops), any strides
// (channels-last included); results are contiguous NCHW in the input's floating dtype. Every op
// is differentiable on the CPU and CUDA (bf16/f16 compute in float).
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "flame/tensor.h"

namespace flame::nn::functional {

// A per-dim pair (height, width) that a single integer fills: `3` or `{3, 2}`. Size2{} (0, 0) as a
// stride means "the kernel size", as PyTorch's stride=None.
struct Size2 {
  int64_t h = 0, w = 0;
  Size2() = default;
  Size2(int64_t v) : h(v), w(v) {}  // NOLINT(google-explicit-constructor): F.max_pool2d(x, 3)
  Size2(int64_t h_, int64_t w_) : h(h_), w(w_) {}
  Size2(const Shape& s) : h(s.empty() ? 0 : s[0]), w(s.size() == 2 ? s[1] : h) {  // NOLINT: Shape{3, 2}
    FLAME_CHECK(s.size() == 1 || s.size() == 2, "Size2", "expected 1 or 2 values (height, width), got ", s);
  }
};

// ---- max pooling (indices: i64, flat position h*W + w of each max in its input plane) ----
Tensor max_pool1d(const Tensor& x, int64_t kernel_size, int64_t stride = 0, int64_t padding = 0,
                  int64_t dilation = 1, bool ceil_mode = false);
std::pair<Tensor, Tensor> max_pool1d_with_indices(const Tensor& x, int64_t kernel_size, int64_t stride = 0,
                                                  int64_t padding = 0, int64_t dilation = 1, bool ceil_mode = false);
Tensor max_pool2d(const Tensor& x, Size2 kernel_size, Size2 stride = {}, Size2 padding = 0, Size2 dilation = 1,
                  bool ceil_mode = false);
std::pair<Tensor, Tensor> max_pool2d_with_indices(const Tensor& x, Size2 kernel_size, Size2 stride = {},
                                                  Size2 padding = 0, Size2 dilation = 1, bool ceil_mode = false);

// ---- average pooling ----
Tensor avg_pool1d(const Tensor& x, int64_t kernel_size, int64_t stride = 0, int64_t padding = 0,
                  bool ceil_mode = false, bool count_include_pad = true);
Tensor avg_pool2d(const Tensor& x, Size2 kernel_size, Size2 stride = {}, Size2 padding = 0, bool ceil_mode = false,
                  bool count_include_pad = true, std::optional<int64_t> divisor_override = std::nullopt);

// ---- adaptive pooling (windows [floor(o*in/out), ceil((o+1)*in/out)), any output size) ----
Tensor adaptive_avg_pool1d(const Tensor& x, int64_t output_size);
Tensor adaptive_avg_pool2d(const Tensor& x, Size2 output_size);
Tensor adaptive_max_pool1d(const Tensor& x, int64_t output_size);
Tensor adaptive_max_pool2d(const Tensor& x, Size2 output_size);
std::pair<Tensor, Tensor> adaptive_max_pool2d_with_indices(const Tensor& x, Size2 output_size);

// ---- interpolation, as torch.nn.functional.interpolate: a 3-d input is [N, C, L] (1-d: nearest,
// nearest-exact, linear), a 4-d input [N, C, H, W] (2-d: nearest, nearest-exact, bilinear, bicubic).
// For 1-d give size / scale_factor as one number. ----
struct InterpolateOptions {
  std::optional<Size2> size;                      // exactly one of size / scale_factor
  std::optional<std::pair<double, double>> scale_factor;
  std::string mode = "nearest";                   // "nearest", "nearest-exact", "linear", "bilinear", "bicubic"
  std::optional<bool> align_corners;              // linear, bilinear and bicubic only (default false)
  std::optional<bool> recompute_scale_factor;     // true: the kernels use in/out, not 1/scale
  // bilinear / bicubic: when downsampling, filter over every input the output covers (the support
  // grows with the factor, as PIL and torch's antialias=True), instead of reading 2 or 4 taps.
  bool antialias = false;

  InterpolateOptions& with_size(Size2 s) { size = s; return *this; }
  InterpolateOptions& with_scale(double s) { scale_factor = std::make_pair(s, s); return *this; }
  InterpolateOptions& with_scale(double sh, double sw) { scale_factor = std::make_pair(sh, sw); return *this; }
  InterpolateOptions& with_mode(std::string m) { mode = std::move(m); return *this; }
  InterpolateOptions& with_align_corners(bool a) { align_corners = a; return *this; }
  InterpolateOptions& with_recompute_scale_factor(bool r) { recompute_scale_factor = r; return *this; }
  InterpolateOptions& with_antialias(bool a) { antialias = a; return *this; }
};
Tensor interpolate(const Tensor& x, const InterpolateOptions& options);
// nn.Upsample's functional form: interpolate with the same options.
inline Tensor upsample(const Tensor& x, const InterpolateOptions& options) { return interpolate(x, options); }

// ---- pixel shuffle: [*, C*r*r, H, W] <-> [*, C, H*r, W*r] (composites of view and permute) ----
Tensor pixel_shuffle(const Tensor& x, int64_t upscale_factor);
Tensor pixel_unshuffle(const Tensor& x, int64_t downscale_factor);

}  // namespace flame::nn::functional
