#pragma once
// Geometry of the pooling and upsampling kernels, shared by the CPU reference and the CUDA kernels
// so that both compute the same windows and source coordinates bit for bit.
//
// Note [Pool windows]
// Every pooling op works on the H x W planes of [N, C, H, W] (1-d ops use H = 1). Along one dim, output o
// reads the inputs start(o) + j*dilation, j < len(o), that fall inside [0, in):
//  - regular (max/avg pool): start = o*stride - pad, len = kernel;
//  - adaptive: start = floor(o*in/out), len = ceil((o+1)*in/out) - start (PyTorch's formula).
// Backward is a gather (deterministic, no atomics): input i sums the gradients of the outputs whose
// window may hold it, first_out(i) <= o < last_out(i), each checked exactly (avg: i inside the
// window; max: the saved argmax equals i).
//
// Note [Upsample source index]
// As PyTorch's upsample kernels: nearest indices in float (legacy 'nearest' copies when out == in
// and halves when out == 2*in, as PyTorch's CPU kernel), linear coordinates in the accumulate type
// A (float for f32/bf16/f16, double for f64); `scale` is 1/scale_factor when the user gave a scale
// factor (and did not ask to recompute it), else in/out; align_corners uses (in-1)/(out-1).
// Backward gathers over a slightly widened range of outputs and re-evaluates the forward map to
// pick exact hits.
//
// Note [Upsample filters]
// The modes with more than two taps per dim, as PyTorch's kernels:
//  - cubic (bicubic): source coordinate as linear's but not clamped at 0, i0 = floor(src),
//    t = src - i0, taps i0-1 .. i0+2 clamped into [0, in) (a clamped index may repeat), weights
//    of Keys' cubic convolution with A = -0.75;
//  - linear_aa / cubic_aa (antialias=true): output o reads the inputs of the window
//    [trunc(center - support + 1/2), trunc(center + support + 1/2)) clipped to [0, in), center =
//    scale * (o + 1/2), support = r * max(scale, 1) (r = 1 triangle, 2 cubic with A = -0.5), each
//    weighted filter((i - center + 1/2) / max(scale, 1)) and the window normalised to sum 1. A
//    downscale therefore averages over the inputs the output covers instead of skipping them.
// The two dims are separable: the kernels sum over the h taps the w-interpolated rows.
#include <cstdint>

#include "flame/macros.h"

namespace flame::backend {

// a / b for a >= 0, b > 0 in 32-bit arithmetic when both fit: 64-bit division is a long
// instruction sequence on the GPU, and the kernels divide for every element.
FLAME_INLINE int64_t pdiv(int64_t a, int64_t b) {
  if (a >= 0 && a <= 0x7fffffff && b <= 0x7fffffff) {
    return static_cast<int64_t>(static_cast<uint32_t>(a) / static_cast<uint32_t>(b));
  }
  return a / b;
}

struct PoolDim {
  int64_t in = 1, out = 1, kernel = 1, stride = 1, pad = 0, dilation = 1;
  bool adaptive = false;

  FLAME_INLINE int64_t start(int64_t o) const { return adaptive ? pdiv(o * in, out) : o * stride - pad; }
  FLAME_INLINE int64_t len(int64_t o) const {
    return adaptive ? pdiv((o + 1) * in + out - 1, out) - pdiv(o * in, out) : kernel;
  }
  FLAME_INLINE int64_t step() const { return adaptive ? 1 : dilation; }
  // Outputs whose window may contain input i: [first_out, last_out).
  FLAME_INLINE int64_t first_out(int64_t i) const {
    if (adaptive) return pdiv(i * out, in);
    const int64_t lo = i + pad - (kernel - 1) * dilation;
    return lo <= 0 ? 0 : pdiv(lo + stride - 1, stride);
  }
  FLAME_INLINE int64_t last_out(int64_t i) const {
    const int64_t hi = adaptive ? pdiv((i + 1) * out + in - 1, in) : pdiv(i + pad, stride) + 1;
    return hi < out ? hi : out;
  }
  // Whether input i is one of output o's taps (inside [0, in) is the caller's).
  FLAME_INLINE bool covers(int64_t o, int64_t i) const {
    const int64_t d = i - start(o);
    if (d < 0) return false;
    const int64_t q = pdiv(d, step());
    return q * step() == d && q < len(o);
  }
};

enum class PoolMode : uint8_t { max, avg };

struct Pool2dParams {
  PoolDim h, w;
  PoolMode mode = PoolMode::max;
  bool count_include_pad = true;
  int64_t divisor_override = 0;  // 0: none

  // Divisor of avg output (oh, ow), as PyTorch's avg_pool2d.
  FLAME_INLINE int64_t divisor(int64_t oh, int64_t ow) const {
    if (divisor_override > 0) return divisor_override;
    if (h.adaptive) return h.len(oh) * w.len(ow);
    int64_t hs = h.start(oh), ws = w.start(ow);
    int64_t he = hs + h.kernel, we = ws + w.kernel;
    if (he > h.in + h.pad) he = h.in + h.pad;
    if (we > w.in + w.pad) we = w.in + w.pad;
    const int64_t pool_size = (he - hs) * (we - ws);
    if (count_include_pad) return pool_size;
    if (hs < 0) hs = 0;
    if (ws < 0) ws = 0;
    if (he > h.in) he = h.in;
    if (we > w.in) we = w.in;
    return (he - hs) * (we - ws);
  }
};

enum class UpsampleMode : uint8_t { nearest, nearest_exact, linear, cubic, linear_aa, cubic_aa };

// Modes read through for_each_filter_tap (Note [Upsample filters]).
FLAME_INLINE bool is_filter_mode(UpsampleMode m) {
  return m == UpsampleMode::cubic || m == UpsampleMode::linear_aa || m == UpsampleMode::cubic_aa;
}

// Keys' cubic convolution kernel for |x| <= 1 and 1 < |x| < 2.
template <class A>
FLAME_INLINE A cubic_near(A x, A a) {
  return ((a + A(2)) * x - (a + A(3))) * x * x + A(1);
}
template <class A>
FLAME_INLINE A cubic_far(A x, A a) {
  return ((a * x - A(5) * a) * x + A(8) * a) * x - A(4) * a;
}
// The antialiasing filters: triangle (bilinear) or cubic with A = -0.5 (bicubic), support 1 / 2.
template <class A>
FLAME_INLINE A aa_filter(A x, bool cubic) {
  if (x < A(0)) x = -x;
  if (!cubic) return x < A(1) ? A(1) - x : A(0);
  if (x < A(1)) return cubic_near(x, A(-0.5));
  return x < A(2) ? cubic_far(x, A(-0.5)) : A(0);
}

struct UpsampleDim {
  int64_t in = 1, out = 1;
  double scale = 1.0;  // see Note [Upsample source index]
  bool align_corners = false;

  // Nearest source index in float for every dtype, as PyTorch (its nearest kernels take float
  // scales), so that f64 inputs pick the same pixels.
  template <class A>
  FLAME_INLINE int64_t nearest(int64_t o, bool exact) const {
    if (!exact && out == in) return o;
    if (!exact && out == 2 * in) return o >> 1;
    const float s = static_cast<float>(scale);
    const float src = exact ? (static_cast<float>(o) + 0.5f) * s : static_cast<float>(o) * s;
    int64_t i = static_cast<int64_t>(src);  // src >= 0: truncation is floor
    return i < in - 1 ? i : in - 1;
  }
  // Linear taps: i0, i1 = i0 + (i0 < in-1), weight of i1 (lambda1).
  template <class A>
  FLAME_INLINE void linear(int64_t o, int64_t& i0, int64_t& i1, A& l1) const {
    const A s = static_cast<A>(scale);
    A src = align_corners ? static_cast<A>(o) * s : (static_cast<A>(o) + A(0.5)) * s - A(0.5);
    if (src < A(0)) src = A(0);
    i0 = static_cast<int64_t>(src);
    if (i0 > in - 1) i0 = in - 1;
    i1 = i0 + (i0 < in - 1 ? 1 : 0);
    l1 = src - static_cast<A>(i0);
  }
  // Bicubic taps of output o (Note [Upsample filters]): clamped indices and their weights.
  template <class A>
  FLAME_INLINE void cubic_taps(int64_t o, int64_t* idx, A* wt) const {
    const A s = static_cast<A>(scale);
    const A src = align_corners ? static_cast<A>(o) * s : (static_cast<A>(o) + A(0.5)) * s - A(0.5);
    int64_t i0 = static_cast<int64_t>(src);
    if (static_cast<A>(i0) > src) --i0;  // floor for negative src
    const A t = src - static_cast<A>(i0), a = A(-0.75);
    wt[0] = cubic_far(t + A(1), a);
    wt[1] = cubic_near(t, a);
    wt[2] = cubic_near(A(1) - t, a);
    wt[3] = cubic_far(A(2) - t, a);
    for (int k = 0; k < 4; ++k) {
      const int64_t j = i0 - 1 + k;
      idx[k] = j < 0 ? 0 : (j > in - 1 ? in - 1 : j);
    }
  }
  // Antialiasing window of output o (Note [Upsample filters]): inputs [first, first + count).
  template <class A>
  FLAME_INLINE void aa_window(int64_t o, bool cubic, int64_t& first, int64_t& count, A& center, A& inv) const {
    const A s = static_cast<A>(scale), r = cubic ? A(2) : A(1);
    const A support = s >= A(1) ? r * s : r;
    center = s * (static_cast<A>(o) + A(0.5));
    inv = s >= A(1) ? A(1) / s : A(1);
    int64_t lo = static_cast<int64_t>(center - support + A(0.5));
    int64_t hi = static_cast<int64_t>(center + support + A(0.5));
    lo = lo < 0 ? 0 : lo;
    hi = hi > in ? in : hi;
    first = lo;
    count = hi > lo ? hi - lo : 0;
  }
  // Outputs that may read input i, [first_out, last_out): the exact range of the real-valued map
  // widened by one on each side (float rounding); the caller re-checks each with the forward map.
  FLAME_INLINE void out_range(int64_t i, UpsampleMode mode, int64_t& first, int64_t& last) const {
    if (is_filter_mode(mode)) {
      filter_out_range(i, mode, first, last);
      return;
    }
    if (mode == UpsampleMode::nearest && (out == in || out == 2 * in)) {  // the exact maps of nearest()
      first = out == in ? i : 2 * i;
      last = out == in ? i + 1 : 2 * i + 2;
      return;
    }
    if (scale <= 0.0) {  // align_corners with out == 1: everything reads input 0
      first = 0;
      last = i == 0 ? out : 0;
      return;
    }
    const double di = static_cast<double>(i), inv = 1.0 / scale;
    double lo, hi;  // real-valued o with src(o) in the range that reads i
    if (mode == UpsampleMode::nearest) {
      lo = di * inv;
      hi = (di + 1.0) * inv;
    } else if (mode == UpsampleMode::nearest_exact) {
      lo = di * inv - 0.5;
      hi = (di + 1.0) * inv - 0.5;
    } else if (align_corners) {
      lo = (di - 1.0) * inv;
      hi = (di + 1.0) * inv;
    } else {
      lo = (di - 0.5) * inv - 0.5;
      hi = (di + 1.5) * inv - 0.5;
    }
    lo -= 1.0;
    hi += 1.0;
    first = lo <= 0.0 ? 0 : static_cast<int64_t>(lo);
    // The last input also takes every output clamped onto it.
    last = (i == in - 1 || hi >= static_cast<double>(out)) ? out : static_cast<int64_t>(hi) + 1;
  }
  // out_range of the filter modes: bicubic reads i from outputs with floor(src) in [i-2, i+1] (the
  // border inputs also from every output clamped onto them); antialias from outputs whose center
  // lies within support (+1 for the window's rounding) of i + 1/2.
  FLAME_INLINE void filter_out_range(int64_t i, UpsampleMode mode, int64_t& first, int64_t& last) const {
    if (scale <= 0.0) {  // align_corners with out == 1: every output reads the same inputs
      first = 0;
      last = out;
      return;
    }
    const double di = static_cast<double>(i), inv = 1.0 / scale;
    double lo, hi;
    if (mode == UpsampleMode::cubic) {
      lo = align_corners ? (di - 2.0) * inv : (di - 1.5) * inv - 0.5;
      hi = align_corners ? (di + 2.0) * inv : (di + 2.5) * inv - 0.5;
    } else {
      const double support = (mode == UpsampleMode::cubic_aa ? 2.0 : 1.0) * (scale >= 1.0 ? scale : 1.0);
      lo = (di + 0.5 - support - 1.0) * inv - 0.5;
      hi = (di + 0.5 + support + 1.0) * inv - 0.5;
    }
    lo -= 1.0;
    hi += 1.0;
    first = (lo <= 0.0 || (mode == UpsampleMode::cubic && i == 0)) ? 0 : static_cast<int64_t>(lo);
    last = ((mode == UpsampleMode::cubic && i == in - 1) || hi >= static_cast<double>(out))
               ? out
               : static_cast<int64_t>(hi) + 1;
  }
};

// Calls f(i, weight) for each input tap of output o along d in a filter mode (Note [Upsample
// filters]); bicubic may name a clamped index more than once.
template <class A, class F>
FLAME_INLINE void for_each_filter_tap(const UpsampleDim& d, UpsampleMode mode, int64_t o, F&& f) {
  if (mode == UpsampleMode::cubic) {
    int64_t idx[4];
    A wt[4];
    d.cubic_taps<A>(o, idx, wt);
    for (int k = 0; k < 4; ++k) f(idx[k], wt[k]);
    return;
  }
  const bool cubic = mode == UpsampleMode::cubic_aa;
  int64_t first, count;
  A center, inv;
  d.aa_window<A>(o, cubic, first, count, center, inv);
  A total = 0;
  for (int64_t j = 0; j < count; ++j) total += aa_filter<A>((static_cast<A>(first + j) - center + A(0.5)) * inv, cubic);
  for (int64_t j = 0; j < count; ++j) {
    const A w = aa_filter<A>((static_cast<A>(first + j) - center + A(0.5)) * inv, cubic);
    f(first + j, total != A(0) ? w / total : w);
  }
}

// Weight with which output o reads input i along d in a filter mode (0 when it does not).
template <class A>
FLAME_INLINE A filter_weight(const UpsampleDim& d, UpsampleMode mode, int64_t o, int64_t i) {
  A w = 0;
  for_each_filter_tap<A>(d, mode, o, [&](int64_t k, A wk) {
    if (k == i) w += wk;
  });
  return w;
}

struct Upsample2dParams {
  UpsampleDim h, w;
  UpsampleMode mode = UpsampleMode::nearest;
};

}  // namespace flame::backend
