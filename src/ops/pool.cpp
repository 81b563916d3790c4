// Pooling, interpolation and pixel shuffle (include/flame/nn/pool.h): validation, output shapes
// (PyTorch's formulas), then one backend kernel over an [N, C, H, W] view; 1-d ops run as 2-d ops
// on [N, C, 1, L] and inputs without a batch dim get one. Pooling and interpolation are op
// definitions (src/ops/pool_def.h) run through invoke (Note [Invoke]); their gradient rules are in
// src/autograd/rules/pool.cpp.
#include "flame/nn/pool.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "flame/ops.h"
#include "src/backend/backend.h"
#include "src/core/grad_state.h"
#include "src/core/tensor_impl.h"
#include "src/ops/pool_def.h"

namespace flame::op_detail {
namespace {
using backend::PoolDim;
using backend::PoolMode;
using backend::Pool2dParams;
using backend::UpsampleDim;
using backend::UpsampleMode;
using backend::Upsample2dParams;
using nn::functional::InterpolateOptions;
using nn::functional::Size2;

// x as [N, C, H, W] (a view): 1-d inputs get H = 1, unbatched inputs N = 1.
Tensor as_4d(const Tensor& x, int spatial, const char* op) {
  FLAME_CHECK(x.defined(), op, "got an undefined tensor");
  FLAME_CHECK(is_floating(x.dtype()), op, "expected a floating input, got ", dtype_name(x.dtype()), " (shape ",
              x.sizes(), ")");
  const int64_t d = x.dim();
  FLAME_CHECK(d == spatial + 1 || d == spatial + 2, op, "expected a ", spatial + 1, "-d (unbatched) or ", spatial + 2,
              "-d (batched) input, got shape ", x.sizes());
  Tensor t = d == spatial + 1 ? x.unsqueeze(0) : x;
  if (spatial == 1) t = t.unsqueeze(2);
  for (int64_t k = 2; k < 4; ++k)
    FLAME_CHECK(t.size(k) > 0, op, "expected non-empty spatial dims, got input shape ", x.sizes());
  return t;
}

// Result shaped back as the input was given (drops the added dims).
Tensor from_4d(const Tensor& y, const Tensor& x, int spatial) {
  Tensor t = spatial == 1 ? y.squeeze(2) : y;
  return x.dim() == spatial + 1 ? t.squeeze(0) : t;
}

int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

PoolDim regular_dim(const char* op, const char* axis, int64_t in, int64_t k, int64_t s, int64_t pad, int64_t dil,
                    bool ceil_mode, const Shape& xs) {
  FLAME_CHECK(k > 0 && s > 0 && dil > 0 && pad >= 0, op, "expected kernel_size, stride, dilation > 0 and padding >= 0, got ",
              "kernel ", k, ", stride ", s, ", padding ", pad, ", dilation ", dil, " along ", axis);
  FLAME_CHECK(pad <= ((k - 1) * dil + 1) / 2, op, "padding ", pad, " should be at most half of the effective kernel size ",
              (k - 1) * dil + 1, " along ", axis);
  int64_t out = floor_div(in + 2 * pad - dil * (k - 1) - 1 + (ceil_mode ? s - 1 : 0), s) + 1;
  if (ceil_mode && (out - 1) * s >= in + pad) --out;  // the last window must start inside the input or left padding
  FLAME_CHECK(out > 0, op, "input of shape ", xs, " is too small for kernel ", k, ", padding ", pad, ", dilation ", dil,
              " along ", axis, " (output size ", out, ")");
  PoolDim d;
  d.in = in;
  d.out = out;
  d.kernel = k;
  d.stride = s;
  d.pad = pad;
  d.dilation = dil;
  return d;
}

PoolDim adaptive_dim(const char* op, int64_t in, int64_t out, const Shape& xs) {
  FLAME_CHECK(out > 0, op, "output size must be positive, got ", out, " for input shape ", xs);
  PoolDim d;
  d.in = in;
  d.out = out;
  d.adaptive = true;
  return d;
}

}  // namespace

Pool2dDef::Prep Pool2dDef::prepare(const Args& a) {
  const char* op = a.op;
  const Tensor& x = a.x;
  Prep r;
  r.x4 = as_4d(x, a.spatial, op);
  Pool2dParams& p = r.p;
  p.mode = a.mode;
  const char* w_axis = a.spatial == 1 ? "length" : "width";
  if (a.adaptive) {
    p.h = adaptive_dim(op, r.x4.size(2), a.out.h, x.sizes());
    p.w = adaptive_dim(op, r.x4.size(3), a.out.w, x.sizes());
    return r;
  }
  Size2 s = a.s;
  if (s.h == 0 && s.w == 0) s = a.k;
  if (a.mode == PoolMode::max) {
    p.h = regular_dim(op, "height", r.x4.size(2), a.k.h, s.h, a.pad.h, a.dil.h, a.ceil_mode, x.sizes());
    p.w = regular_dim(op, w_axis, r.x4.size(3), a.k.w, s.w, a.pad.w, a.dil.w, a.ceil_mode, x.sizes());
    return r;
  }
  p.count_include_pad = a.count_include_pad;
  if (a.divisor_override) {
    FLAME_CHECK(*a.divisor_override > 0, op, "divisor_override must be positive, got ", *a.divisor_override);
    p.divisor_override = *a.divisor_override;
  }
  // Average pools have no dilation; their padding limit is half the kernel.
  p.h = regular_dim(op, "height", r.x4.size(2), a.k.h, s.h, a.pad.h, 1, a.ceil_mode, x.sizes());
  p.w = regular_dim(op, w_axis, r.x4.size(3), a.k.w, s.w, a.pad.w, 1, a.ceil_mode, x.sizes());
  return r;
}

Pool2dDef::Result Pool2dDef::run(const Args& a, Prep& pr) {
  const Tensor& x = a.x;
  const Tensor& x4 = pr.x4;
  const Pool2dParams& p = pr.p;
  const Shape out_shape{x4.size(0), x4.size(1), p.h.out, p.w.out};
  Result r;
  r.out = make_empty(out_shape, x.dtype(), x.device());
  if (p.mode == PoolMode::max && (a.want_indices || needs_grad({x}))) {
    // Indices kept only for the backward may be int32 on CUDA (half the bytes written and read
    // again; Note [Pool fast paths] in src/backend/cuda/pool/pool_fast.cu); the public ones are int64.
    const bool compact = !a.want_indices && x.device().is_cuda() &&
                         x4.size(2) * x4.size(3) <= std::numeric_limits<int32_t>::max();
    r.indices = make_empty(out_shape, compact ? DType::i32 : DType::i64, x.device());
  }
  if (r.out.numel() > 0) backend::backend_for(x.device()).pool2d(r.out, r.indices, x4, p);
  return r;
}

Pool2dDef::Out Pool2dDef::finish(Result&& r, const Args& a, const Prep&) {
  Tensor y = from_4d(r.out, a.x, a.spatial);
  return {y, r.indices.defined() && a.want_indices ? from_4d(r.indices, a.x, a.spatial) : Tensor()};
}

// Note [Interpolate dims]
// As torch.nn.functional.interpolate: a 3-d input is [N, C, L] (batched 1-d: nearest,
// nearest-exact, linear), a 4-d input [N, C, H, W] (nearest, nearest-exact, bilinear, bicubic;
// antialias for bilinear and bicubic). 1-d runs as 2-d with H = 1 (size 1 -> 1 is the identity
// in every mode). There is no unbatched form: PyTorch has none either.
Upsample2dDef::Prep Upsample2dDef::prepare(const Args& a) {
  const Tensor& x = a.x;
  const InterpolateOptions& o = a.o;
  const char* op = "interpolate";
  FLAME_CHECK(x.defined(), op, "got an undefined tensor");
  FLAME_CHECK(x.dim() == 3 || x.dim() == 4, op, "expected a 3-d [N, C, L] (1-d interpolation) or 4-d [N, C, H, W] ",
              "(2-d interpolation) input, as PyTorch, got shape ", x.sizes(),
              x.dim() == 2 ? " (add the batch dim: x.unsqueeze(0))" : "");
  Prep r;
  const bool one_d = r.one_d = x.dim() == 3;
  const Tensor x4 = r.x4 = one_d ? as_4d(x, 1, op) : as_4d(x, 2, op);
  Upsample2dParams& p = r.p;
  const std::string& m = o.mode;
  if (m == "nearest") {
    p.mode = UpsampleMode::nearest;
  } else if (m == "nearest-exact") {
    p.mode = UpsampleMode::nearest_exact;
  } else if (m == "linear" || m == "bilinear" || m == "bicubic") {
    const char* wants = m == "linear" ? "a 3-d [N, C, L]" : "a 4-d [N, C, H, W]";
    FLAME_CHECK((m == "linear") == one_d, op, "mode ", m, " needs ", wants, " input, got shape ", x.sizes(),
                one_d ? " (for a 3-d input use mode linear)" : " (for a 4-d input use bilinear or bicubic)");
    p.mode = m == "bicubic" ? UpsampleMode::cubic : UpsampleMode::linear;
  } else {
    FLAME_FAIL(op, "unsupported mode '", m, "' (expected nearest, nearest-exact, linear (3-d), bilinear or bicubic ",
               "(4-d))");
  }
  const bool interpolating = p.mode == UpsampleMode::linear || p.mode == UpsampleMode::cubic;
  FLAME_CHECK(!o.align_corners || interpolating, op,
              "align_corners is only valid for modes linear, bilinear and bicubic, got mode ", m);
  FLAME_CHECK(!o.antialias || (!one_d && interpolating), op,
              "antialias is only valid for modes bilinear and bicubic on a 4-d input, got mode ", m, " and shape ",
              x.sizes());
  if (o.antialias) p.mode = p.mode == UpsampleMode::cubic ? UpsampleMode::cubic_aa : UpsampleMode::linear_aa;
  FLAME_CHECK(o.size.has_value() != o.scale_factor.has_value(), op,
              "expected exactly one of size and scale_factor");
  if (one_d) {
    FLAME_CHECK(!o.size || o.size->h == o.size->w, op, "a 3-d input [N, C, L] is resized along L only: give size as ",
                "one integer, got (", o.size ? o.size->h : 0, ", ", o.size ? o.size->w : 0, ")");
    FLAME_CHECK(!o.scale_factor || o.scale_factor->first == o.scale_factor->second, op,
                "a 3-d input [N, C, L] is resized along L only: give scale_factor as one number, got (",
                o.scale_factor ? o.scale_factor->first : 0.0, ", ", o.scale_factor ? o.scale_factor->second : 0.0, ")");
  }
  const bool align = o.align_corners.value_or(false);
  const bool recompute = o.recompute_scale_factor.value_or(false);
  FLAME_CHECK(!(recompute && o.size), op, "recompute_scale_factor needs scale_factor, not size");
  auto make_dim = [&](int64_t in, int64_t size, std::optional<double> sf) {
    UpsampleDim d;
    d.in = in;
    if (sf) {
      FLAME_CHECK(std::isfinite(*sf) && *sf > 0, op, "scale_factor must be positive and finite, got ", *sf);
      size = static_cast<int64_t>(std::floor(static_cast<double>(in) * *sf));
    }
    FLAME_CHECK(size > 0, op, "output size must be positive, got ", size, " for input shape ", x.sizes());
    d.out = size;
    d.align_corners = align;
    if (interpolating && align) {
      d.scale = size > 1 ? static_cast<double>(in - 1) / static_cast<double>(size - 1) : 0.0;
    } else {
      d.scale = sf && !recompute ? 1.0 / *sf : static_cast<double>(in) / static_cast<double>(size);
    }
    return d;
  };
  const auto sf = o.scale_factor;
  if (one_d) {
    p.h = make_dim(1, 1, std::nullopt);  // identity: 1 -> 1
  } else {
    p.h = make_dim(x4.size(2), o.size ? o.size->h : 0, sf ? std::optional<double>(sf->first) : std::nullopt);
  }
  p.w = make_dim(x4.size(3), o.size ? o.size->w : 0, sf ? std::optional<double>(sf->second) : std::nullopt);
  return r;
}

Upsample2dDef::Result Upsample2dDef::run(const Args& a, Prep& pr) {
  const Tensor& x4 = pr.x4;
  Result r;
  r.out = make_empty({x4.size(0), x4.size(1), pr.p.h.out, pr.p.w.out}, a.x.dtype(), a.x.device());
  if (r.out.numel() > 0) backend::backend_for(a.x.device()).upsample2d(r.out, x4, pr.p);
  return r;
}

Upsample2dDef::Out Upsample2dDef::finish(Result&& r, const Args&, const Prep& pr) {
  return pr.one_d ? r.out.squeeze(2) : std::move(r.out);
}

}  // namespace flame::op_detail

namespace flame::nn::functional {
namespace {
using backend::PoolMode;
using op_detail::Pool2dDef;

std::pair<Tensor, Tensor> max_pool(const char* op, int spatial, const Tensor& x, Size2 k, Size2 s, Size2 pad, Size2 dil,
                                   bool ceil_mode, bool want_indices) {
  return op_detail::invoke<Pool2dDef>({.op = op, .spatial = spatial, .x = x, .mode = PoolMode::max, .k = k, .s = s,
                                       .pad = pad, .dil = dil, .ceil_mode = ceil_mode, .want_indices = want_indices});
}

Tensor avg_pool(const char* op, int spatial, const Tensor& x, Size2 k, Size2 s, Size2 pad, bool ceil_mode,
                bool count_include_pad, std::optional<int64_t> divisor_override) {
  return op_detail::invoke<Pool2dDef>({.op = op, .spatial = spatial, .x = x, .mode = PoolMode::avg, .k = k, .s = s,
                                       .pad = pad, .ceil_mode = ceil_mode, .count_include_pad = count_include_pad,
                                       .divisor_override = divisor_override})
      .first;
}

std::pair<Tensor, Tensor> adaptive_pool(const char* op, int spatial, PoolMode mode, const Tensor& x, Size2 out,
                                        bool want_indices) {
  return op_detail::invoke<Pool2dDef>(
      {.op = op, .spatial = spatial, .x = x, .mode = mode, .adaptive = true, .out = out, .want_indices = want_indices});
}

}  // namespace

Tensor max_pool1d(const Tensor& x, int64_t k, int64_t s, int64_t pad, int64_t dil, bool ceil_mode) {
  return max_pool("max_pool1d", 1, x, {1, k}, {1, s == 0 ? k : s}, {0, pad}, {1, dil}, ceil_mode, false).first;
}
std::pair<Tensor, Tensor> max_pool1d_with_indices(const Tensor& x, int64_t k, int64_t s, int64_t pad, int64_t dil,
                                                  bool ceil_mode) {
  return max_pool("max_pool1d", 1, x, {1, k}, {1, s == 0 ? k : s}, {0, pad}, {1, dil}, ceil_mode, true);
}
Tensor max_pool2d(const Tensor& x, Size2 k, Size2 s, Size2 pad, Size2 dil, bool ceil_mode) {
  return max_pool("max_pool2d", 2, x, k, s, pad, dil, ceil_mode, false).first;
}
std::pair<Tensor, Tensor> max_pool2d_with_indices(const Tensor& x, Size2 k, Size2 s, Size2 pad, Size2 dil,
                                                  bool ceil_mode) {
  return max_pool("max_pool2d", 2, x, k, s, pad, dil, ceil_mode, true);
}

Tensor avg_pool1d(const Tensor& x, int64_t k, int64_t s, int64_t pad, bool ceil_mode, bool count_include_pad) {
  return avg_pool("avg_pool1d", 1, x, {1, k}, {1, s == 0 ? k : s}, {0, pad}, ceil_mode, count_include_pad,
                  std::nullopt);
}
Tensor avg_pool2d(const Tensor& x, Size2 k, Size2 s, Size2 pad, bool ceil_mode, bool count_include_pad,
                  std::optional<int64_t> divisor_override) {
  return avg_pool("avg_pool2d", 2, x, k, s, pad, ceil_mode, count_include_pad, divisor_override);
}

Tensor adaptive_avg_pool1d(const Tensor& x, int64_t out) {
  return adaptive_pool("adaptive_avg_pool1d", 1, PoolMode::avg, x, {1, out}, false).first;
}
Tensor adaptive_avg_pool2d(const Tensor& x, Size2 out) {
  return adaptive_pool("adaptive_avg_pool2d", 2, PoolMode::avg, x, out, false).first;
}
Tensor adaptive_max_pool1d(const Tensor& x, int64_t out) {
  return adaptive_pool("adaptive_max_pool1d", 1, PoolMode::max, x, {1, out}, false).first;
}
Tensor adaptive_max_pool2d(const Tensor& x, Size2 out) {
  return adaptive_pool("adaptive_max_pool2d", 2, PoolMode::max, x, out, false).first;
}
std::pair<Tensor, Tensor> adaptive_max_pool2d_with_indices(const Tensor& x, Size2 out) {
  return adaptive_pool("adaptive_max_pool2d", 2, PoolMode::max, x, out, true);
}

Tensor interpolate(const Tensor& x, const InterpolateOptions& o) {
  return op_detail::invoke<op_detail::Upsample2dDef>({x, o});
}

Tensor pixel_shuffle(const Tensor& x, int64_t r) {
  FLAME_CHECK(x.defined() && x.dim() >= 3, "pixel_shuffle", "expected an input of at least 3 dims, got shape ",
              x.defined() ? x.sizes() : Shape{});
  FLAME_CHECK(r > 0, "pixel_shuffle", "upscale_factor must be positive, got ", r);
  const int64_t d = x.dim(), c = x.size(d - 3), h = x.size(d - 2), w = x.size(d - 1);
  FLAME_CHECK(c % (r * r) == 0, "pixel_shuffle", "channels ", c, " of input shape ", x.sizes(),
              " are not divisible by upscale_factor^2 = ", r * r);
  Shape lead(x.sizes().begin(), x.sizes().end() - 3);
  Shape split = lead, perm, out = lead;
  for (int64_t v : {c / (r * r), r, r, h, w}) split.push_back(v);
  const int64_t b = static_cast<int64_t>(lead.size());
  for (int64_t i = 0; i < b; ++i) perm.push_back(i);
  for (int64_t i : {0, 3, 1, 4, 2}) perm.push_back(b + i);  // [C, H, r, W, r]
  for (int64_t v : {c / (r * r), h * r, w * r}) out.push_back(v);
  return x.reshape(split).permute(perm).reshape(out);
}

Tensor pixel_unshuffle(const Tensor& x, int64_t r) {
  FLAME_CHECK(x.defined() && x.dim() >= 3, "pixel_unshuffle", "expected an input of at least 3 dims, got shape ",
              x.defined() ? x.sizes() : Shape{});
  FLAME_CHECK(r > 0, "pixel_unshuffle", "downscale_factor must be positive, got ", r);
  const int64_t d = x.dim(), c = x.size(d - 3), h = x.size(d - 2), w = x.size(d - 1);
  FLAME_CHECK(h % r == 0 && w % r == 0, "pixel_unshuffle", "height and width of input shape ", x.sizes(),
              " are not divisible by downscale_factor ", r);
  Shape lead(x.sizes().begin(), x.sizes().end() - 3);
  Shape split = lead, perm, out = lead;
  for (int64_t v : {c, h / r, r, w / r, r}) split.push_back(v);
  const int64_t b = static_cast<int64_t>(lead.size());
  for (int64_t i = 0; i < b; ++i) perm.push_back(i);
  for (int64_t i : {0, 2, 4, 1, 3}) perm.push_back(b + i);  // [C, r, r, H, W]
  for (int64_t v : {c * r * r, h / r, w / r}) out.push_back(v);
  return x.reshape(split).permute(perm).reshape(out);
}

}  // namespace flame::nn::functional
