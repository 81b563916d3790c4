// CPU reference kernels of the pool family: pooling (Note [Pool windows]), upsampling (Note
// [Upsample source index]) and the fused cross-entropy. Plain loops over [B, H, W] planes with the
// geometry of pool_params.h, shared with the CUDA kernels; half types compute in float, f64 in double.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "src/backend/cpu/cpu_backend.h"
#include "src/opdef/scalar_math.h"

namespace flame::backend::cpu {
namespace {

// Element strides of an [N, C, H, W] tensor; plane(b) is the offset of plane b = n*C + c.
struct Strides3 {
  int64_t n, c, h, w, channels;
  int64_t plane(int64_t b) const { return (b / channels) * n + (b % channels) * c; }
};
Strides3 strides3(const Tensor& t) {
  return {t.strides()[0], t.strides()[1], t.strides()[2], t.strides()[3], t.size(1)};
}

template <class T>
void pool2d_typed(const Tensor& out, const Tensor& indices, const Tensor& x, const Pool2dParams& p) {
  using A = compute_t<T>;
  const int64_t B = x.size(0) * x.size(1), OH = p.h.out, OW = p.w.out;
  const Strides3 xs = strides3(x);
  const T* xp = x.data<T>();
  T* op = out.data<T>();
  int64_t* ip = indices.defined() ? indices.data<int64_t>() : nullptr;
  for (int64_t b = 0; b < B; ++b) {
    const T* plane = xp + xs.plane(b);
    for (int64_t oh = 0; oh < OH; ++oh) {
      for (int64_t ow = 0; ow < OW; ++ow) {
        const int64_t hs = p.h.start(oh), hl = p.h.len(oh), ws = p.w.start(ow), wl = p.w.len(ow);
        A acc = p.mode == PoolMode::max ? -std::numeric_limits<A>::infinity() : A(0);
        int64_t arg = -1;
        for (int64_t jh = 0; jh < hl; ++jh) {
          const int64_t ih = hs + jh * p.h.step();
          if (ih < 0 || ih >= p.h.in) continue;
          for (int64_t jw = 0; jw < wl; ++jw) {
            const int64_t iw = ws + jw * p.w.step();
            if (iw < 0 || iw >= p.w.in) continue;
            const A v = convert<A>(plane[ih * xs.h + iw * xs.w]);
            if (p.mode == PoolMode::avg) {
              acc += v;
            } else if (arg < 0 || v > acc || std::isnan(v)) {
              // As PyTorch: a NaN is taken (nothing compares greater than it afterwards).
              acc = v;
              arg = ih * p.w.in + iw;
            }
          }
        }
        const int64_t o = (b * OH + oh) * OW + ow;
        if (p.mode == PoolMode::avg) acc /= static_cast<A>(p.divisor(oh, ow));
        op[o] = convert<T>(acc);
        if (ip) ip[o] = arg;
      }
    }
  }
}

template <class T>
void pool2d_backward_typed(const Tensor& grad_in, const Tensor& grad_out, const Tensor& indices, const Pool2dParams& p) {
  using A = compute_t<T>;
  const int64_t B = grad_in.size(0) * grad_in.size(1), H = p.h.in, W = p.w.in, OW = p.w.out, OH = p.h.out;
  const Strides3 gs = strides3(grad_out);
  const T* gp = grad_out.data<T>();
  const int64_t* ip = p.mode == PoolMode::max ? indices.data<int64_t>() : nullptr;
  T* dp = grad_in.data<T>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t ih = 0; ih < H; ++ih) {
      const int64_t oh0 = p.h.first_out(ih), oh1 = p.h.last_out(ih);
      for (int64_t iw = 0; iw < W; ++iw) {
        const int64_t ow0 = p.w.first_out(iw), ow1 = p.w.last_out(iw);
        A acc = 0;
        for (int64_t oh = oh0; oh < oh1; ++oh) {
          for (int64_t ow = ow0; ow < ow1; ++ow) {
            const A g = convert<A>(gp[gs.plane(b) + oh * gs.h + ow * gs.w]);
            if (p.mode == PoolMode::max) {
              if (ip[(b * OH + oh) * OW + ow] == ih * W + iw) acc += g;
            } else if (p.h.covers(oh, ih) && p.w.covers(ow, iw)) {
              acc += g / static_cast<A>(p.divisor(oh, ow));
            }
          }
        }
        dp[(b * H + ih) * W + iw] = convert<T>(acc);
      }
    }
  }
}

// Taps of output o along one dim: up to two (index, weight) pairs.
template <class A>
int upsample_taps(const UpsampleDim& d, UpsampleMode mode, int64_t o, int64_t* idx, A* wt) {
  if (mode == UpsampleMode::linear) {
    A l1;
    d.linear<A>(o, idx[0], idx[1], l1);
    wt[0] = A(1) - l1;
    wt[1] = l1;
    return 2;
  }
  idx[0] = d.nearest<A>(o, mode == UpsampleMode::nearest_exact);
  wt[0] = A(1);
  return 1;
}

// The filter taps of every output along one dim (Note [Upsample filters]), in for_each_filter_tap's
// order: output o reads idx[k] with weight w[k] for k in [begin(o), end(o)).
template <class A>
struct TapTable {
  std::vector<int64_t> offset, idx;
  std::vector<A> w;
  TapTable(const UpsampleDim& d, UpsampleMode mode) : offset(static_cast<std::size_t>(d.out) + 1, 0) {
    for (int64_t o = 0; o < d.out; ++o) {
      for_each_filter_tap<A>(d, mode, o, [&](int64_t i, A wt) {
        idx.push_back(i);
        w.push_back(wt);
      });
      offset[static_cast<std::size_t>(o) + 1] = static_cast<int64_t>(idx.size());
    }
  }
  std::size_t begin(int64_t o) const { return static_cast<std::size_t>(offset[static_cast<std::size_t>(o)]); }
  std::size_t end(int64_t o) const { return static_cast<std::size_t>(offset[static_cast<std::size_t>(o) + 1]); }
};

template <class T>
void upsample2d_typed(const Tensor& out, const Tensor& x, const Upsample2dParams& p) {
  using A = compute_t<T>;
  const int64_t B = x.size(0) * x.size(1), OH = p.h.out, OW = p.w.out;
  const Strides3 xs = strides3(x);
  const T* xp = x.data<T>();
  T* op = out.data<T>();
  if (is_filter_mode(p.mode)) {
    // Note [Upsample filters], separably: each input row interpolated along w once (rows[ih][ow]),
    // then the h taps summed over those rows. The same sums in the same order as the CUDA kernel,
    // which interpolates the rows per output; here a large downscale costs H*OW + OH*OW windows
    // instead of OH*OW*(h window) (a photo shrunk 4x: about 10x less work).
    const TapTable<A> th(p.h, p.mode), tw(p.w, p.mode);
    const int64_t H = p.h.in;
    std::vector<A> rows(static_cast<std::size_t>(H * OW));
    for (int64_t b = 0; b < B; ++b) {
      const T* plane = xp + xs.plane(b);
      for (int64_t ih = 0; ih < H; ++ih)
        for (int64_t ow = 0; ow < OW; ++ow) {
          A row = 0;
          for (std::size_t k = tw.begin(ow); k < tw.end(ow); ++k) row += tw.w[k] * convert<A>(plane[ih * xs.h + tw.idx[k] * xs.w]);
          rows[static_cast<std::size_t>(ih * OW + ow)] = row;
        }
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          A acc = 0;
          for (std::size_t k = th.begin(oh); k < th.end(oh); ++k) acc += th.w[k] * rows[static_cast<std::size_t>(th.idx[k] * OW + ow)];
          op[(b * OH + oh) * OW + ow] = convert<T>(acc);
        }
    }
    return;
  }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t oh = 0; oh < OH; ++oh) {
      int64_t hi[2];
      A hw[2];
      const int nh = upsample_taps<A>(p.h, p.mode, oh, hi, hw);
      for (int64_t ow = 0; ow < OW; ++ow) {
        int64_t wi[2];
        A ww[2];
        const int nw = upsample_taps<A>(p.w, p.mode, ow, wi, ww);
        A acc = 0;
        for (int a = 0; a < nh; ++a)
          for (int c = 0; c < nw; ++c) acc += hw[a] * ww[c] * convert<A>(xp[xs.plane(b) + hi[a] * xs.h + wi[c] * xs.w]);
        op[(b * OH + oh) * OW + ow] = convert<T>(acc);
      }
    }
  }
}

// Weight with which output o reads input i along one dim (0 when it does not).
template <class A>
A upsample_weight(const UpsampleDim& d, UpsampleMode mode, int64_t o, int64_t i) {
  int64_t idx[2];
  A wt[2];
  const int n = upsample_taps<A>(d, mode, o, idx, wt);
  A w = 0;
  for (int k = 0; k < n; ++k)
    if (idx[k] == i) w += wt[k];
  return w;
}

template <class T>
void upsample2d_backward_typed(const Tensor& grad_in, const Tensor& grad_out, const Upsample2dParams& p) {
  using A = compute_t<T>;
  const int64_t B = grad_in.size(0) * grad_in.size(1), H = p.h.in, W = p.w.in;
  const Strides3 gs = strides3(grad_out);
  const T* gp = grad_out.data<T>();
  T* dp = grad_in.data<T>();
  if (is_filter_mode(p.mode)) {
    // The transpose of the separable forward: spread each output's gradient over its w taps
    // (per output row), then each of those rows over the h taps. Sequential, so deterministic.
    const TapTable<A> th(p.h, p.mode), tw(p.w, p.mode);
    const int64_t OH = p.h.out, OW = p.w.out;
    std::vector<A> gw(static_cast<std::size_t>(OH * W)), gi(static_cast<std::size_t>(H * W));
    for (int64_t b = 0; b < B; ++b) {
      std::fill(gw.begin(), gw.end(), A(0));
      std::fill(gi.begin(), gi.end(), A(0));
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          const A g = convert<A>(gp[gs.plane(b) + oh * gs.h + ow * gs.w]);
          for (std::size_t k = tw.begin(ow); k < tw.end(ow); ++k)
            gw[static_cast<std::size_t>(oh * W + tw.idx[k])] += tw.w[k] * g;
        }
      for (int64_t oh = 0; oh < OH; ++oh)
        for (std::size_t k = th.begin(oh); k < th.end(oh); ++k) {
          A* dst = gi.data() + th.idx[k] * W;
          const A* src = gw.data() + oh * W;
          for (int64_t iw = 0; iw < W; ++iw) dst[iw] += th.w[k] * src[iw];
        }
      for (int64_t i = 0; i < H * W; ++i) dp[b * H * W + i] = convert<T>(gi[static_cast<std::size_t>(i)]);
    }
    return;
  }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t ih = 0; ih < H; ++ih) {
      int64_t oh0, oh1;
      p.h.out_range(ih, p.mode, oh0, oh1);
      for (int64_t iw = 0; iw < W; ++iw) {
        int64_t ow0, ow1;
        p.w.out_range(iw, p.mode, ow0, ow1);
        A acc = 0;
        for (int64_t oh = oh0; oh < oh1; ++oh) {
          const A wh = upsample_weight<A>(p.h, p.mode, oh, ih);
          if (wh == A(0)) continue;
          for (int64_t ow = ow0; ow < ow1; ++ow) {
            const A wv = upsample_weight<A>(p.w, p.mode, ow, iw);
            if (wv != A(0)) acc += wh * wv * convert<A>(gp[gs.plane(b) + oh * gs.h + ow * gs.w]);
          }
        }
        dp[(b * H + ih) * W + iw] = convert<T>(acc);
      }
    }
  }
}

template <class T>
void cross_entropy_typed(const Tensor& loss, const Tensor& lse, const Tensor& logits, const Tensor& target,
                         int64_t ignore_index, double eps) {
  using A = compute_t<T>;
  const int64_t N = logits.size(0), V = logits.size(1);
  const T* xp = logits.data<T>();
  const int64_t* tp = target.data<int64_t>();
  A* lp = loss.data<A>();
  A* sp = lse.data<A>();
  for (int64_t r = 0; r < N; ++r) {
    const T* row = xp + r * V;
    A m = -std::numeric_limits<A>::infinity(), sum_x = 0;
    for (int64_t j = 0; j < V; ++j) {
      const A v = convert<A>(row[j]);
      if (v > m || std::isnan(v)) m = v;
      sum_x += v;
    }
    const A shift = std::isinf(m) ? A(0) : m;
    A s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(convert<A>(row[j]) - shift);
    const A l = std::log(s) + shift;
    sp[r] = l;
    const int64_t t = tp[r];
    if (t == ignore_index) {
      lp[r] = 0;
      continue;
    }
    FLAME_CHECK(t >= 0 && t < V, "cross_entropy", "target ", t, " is out of range for ", V, " classes (logits shape ",
                logits.sizes(), ", ignore_index ", ignore_index, ")");
    const A nll = l - convert<A>(row[t]);
    lp[r] = eps > 0 ? static_cast<A>(1 - eps) * nll + static_cast<A>(eps) * (l - sum_x / static_cast<A>(V)) : nll;
  }
}

template <class T>
void cross_entropy_backward_typed(const Tensor& grad_logits, const Tensor& grad_loss, const Tensor& logits,
                                  const Tensor& target, const Tensor& lse, int64_t ignore_index, double eps) {
  using A = compute_t<T>;
  const int64_t N = logits.size(0), V = logits.size(1);
  const T* xp = logits.data<T>();
  const int64_t* tp = target.data<int64_t>();
  const A* gp = grad_loss.data<A>();
  const A* sp = lse.data<A>();
  T* dp = grad_logits.data<T>();
  const A off = static_cast<A>(eps) / static_cast<A>(V), on = static_cast<A>(1 - eps);
  for (int64_t r = 0; r < N; ++r) {
    const int64_t t = tp[r];
    const bool ignored = t == ignore_index;
    const A g = ignored ? A(0) : gp[r];
    for (int64_t j = 0; j < V; ++j) {
      const A prob = std::exp(convert<A>(xp[r * V + j]) - sp[r]);
      dp[r * V + j] = convert<T>(ignored ? A(0) : (prob - off - (j == t ? on : A(0))) * g);
    }
  }
}

}  // namespace

void CpuBackend::pool2d(const Tensor& out, const Tensor& indices, const Tensor& x, const Pool2dParams& p) {
  dispatch_floating(x.dtype(), "pool2d", [&](auto tag) { pool2d_typed<typename decltype(tag)::type>(out, indices, x, p); });
}

void CpuBackend::pool2d_backward(const Tensor& grad_in, const Tensor& grad_out, const Tensor& indices,
                                 const Pool2dParams& p) {
  dispatch_floating(grad_in.dtype(), "pool2d_backward", [&](auto tag) {
    pool2d_backward_typed<typename decltype(tag)::type>(grad_in, grad_out, indices, p);
  });
}

void CpuBackend::upsample2d(const Tensor& out, const Tensor& x, const Upsample2dParams& p) {
  dispatch_floating(x.dtype(), "upsample2d", [&](auto tag) { upsample2d_typed<typename decltype(tag)::type>(out, x, p); });
}

void CpuBackend::upsample2d_backward(const Tensor& grad_in, const Tensor& grad_out, const Upsample2dParams& p) {
  dispatch_floating(grad_in.dtype(), "upsample2d_backward", [&](auto tag) {
    upsample2d_backward_typed<typename decltype(tag)::type>(grad_in, grad_out, p);
  });
}

void CpuBackend::cross_entropy(const Tensor& loss, const Tensor& lse, const Tensor& logits, const Tensor& target,
                               int64_t ignore_index, double label_smoothing) {
  dispatch_floating(logits.dtype(), "cross_entropy", [&](auto tag) {
    cross_entropy_typed<typename decltype(tag)::type>(loss, lse, logits, target, ignore_index, label_smoothing);
  });
}

void CpuBackend::cross_entropy_backward(const Tensor& grad_logits, const Tensor& grad_loss, const Tensor& logits,
                                        const Tensor& target, const Tensor& lse, int64_t ignore_index,
                                        double label_smoothing) {
  dispatch_floating(logits.dtype(), "cross_entropy_backward", [&](auto tag) {
    cross_entropy_backward_typed<typename decltype(tag)::type>(grad_logits, grad_loss, logits, target, lse,
                                                               ignore_index, label_smoothing);
  });
}

}  // namespace flame::backend::cpu
