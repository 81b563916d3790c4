// CPU reference kernels of the normalisation family (Note [Norm kernels] in src/ops/norm.cpp for
// the layouts). Plain loops, everything computed in double (as the CPU reductions accumulate,
// Note [CPU reduction accumulation]) and rounded once into the output dtype; statistics are
// stored in their dtype (f32, or f64 for f64 inputs) and the backward reads them back from there,
// as the CUDA backward does. Two passes over each group of values (mean, then centred squares):
// the reference never suffers the cancellation of E[x^2] - E[x]^2.
#include <algorithm>
#include <cmath>
#include <vector>

#include "src/backend/cpu/cpu_backend.h"
#include "src/opdef/scalar_math.h"

namespace flame::backend::cpu {
namespace {

// Typed element access over contiguous buffers; an undefined tensor reads as `fallback`.
template <class T>
struct Buf {
  T* p = nullptr;
  explicit Buf(const Tensor& t) : p(t.defined() ? static_cast<T*>(t.data_ptr()) : nullptr) {}
  double get(int64_t i, double fallback = 0.0) const { return p ? convert<double>(p[i]) : fallback; }
  void set(int64_t i, double v) const { p[i] = convert<T>(v); }
  explicit operator bool() const { return p != nullptr; }
};

// Statistics are f32 or f64 (stat dtype), read and written through double.
struct Stat {
  const Tensor& t;
  double get(int64_t i) const {
    return t.dtype() == DType::f64 ? static_cast<const double*>(t.data_ptr())[i]
                                   : static_cast<double>(static_cast<const float*>(t.data_ptr())[i]);
  }
  void set(int64_t i, double v) const {
    if (t.dtype() == DType::f64) static_cast<double*>(t.data_ptr())[i] = v;
    else static_cast<float*>(t.data_ptr())[i] = static_cast<float>(v);
  }
};

// Statistics of `count` values at base + elem(k): mean (0 for rms) and 1 / sqrt(var + eps).
template <class T, class Elem>
void group_stats(const Buf<T>& x, int64_t count, Elem elem, bool rms, double eps, double& mean, double& rstd) {
  double m = 0;
  if (!rms) {
    for (int64_t k = 0; k < count; ++k) m += x.get(elem(k));
    m /= static_cast<double>(count);
  }
  double v = 0;
  for (int64_t k = 0; k < count; ++k) {
    const double d = x.get(elem(k)) - m;
    v += d * d;
  }
  v /= static_cast<double>(count);
  mean = m;
  rstd = 1.0 / std::sqrt(v + eps);
}

template <class T>
void rows_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x, const Tensor& w,
                  const Tensor& b, double eps) {
  const int64_t rows = rstd.numel(), cols = x.numel() / rows;
  const Buf<T> xb(x), yb(y), wb(w), bb(b);
  const bool rms = !mean.defined();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * cols;
    double m, rs;
    group_stats(xb, cols, [&](int64_t k) { return base + k; }, rms, eps, m, rs);
    if (!rms) Stat{mean}.set(r, m);
    Stat{rstd}.set(r, rs);
    // Normalise with the stored (rounded) statistics, as the backward will see them.
    if (!rms) m = Stat{mean}.get(r);
    rs = Stat{rstd}.get(r);
    for (int64_t j = 0; j < cols; ++j)
      yb.set(base + j, (xb.get(base + j) - m) * rs * wb.get(j, 1.0) + bb.get(j, 0.0));
  }
}

template <class T>
void rows_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy, const Tensor& x,
                   const Tensor& mean, const Tensor& rstd, const Tensor& w) {
  const int64_t rows = rstd.numel(), cols = x.numel() / rows;
  const Buf<T> dxb(dx), dwb(dw), dbb(db), dyb(dy), xb(x), wb(w);
  const bool rms = !mean.defined();
  std::vector<double> sw(static_cast<std::size_t>(cols), 0.0), sb(static_cast<std::size_t>(cols), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * cols;
    const double m = rms ? 0.0 : Stat{mean}.get(r), rs = Stat{rstd}.get(r);
    double sum_g = 0, sum_gx = 0;
    for (int64_t j = 0; j < cols; ++j) {
      const double d = dyb.get(base + j), xh = (xb.get(base + j) - m) * rs, g = d * wb.get(j, 1.0);
      sum_g += g;
      sum_gx += g * xh;
      sw[j] += d * xh;
      sb[j] += d;
    }
    if (!dxb) continue;
    const double mg = rms ? 0.0 : sum_g / static_cast<double>(cols), mgx = sum_gx / static_cast<double>(cols);
    for (int64_t j = 0; j < cols; ++j) {
      const double xh = (xb.get(base + j) - m) * rs, g = dyb.get(base + j) * wb.get(j, 1.0);
      dxb.set(base + j, rs * (g - mg - xh * mgx));
    }
  }
  for (int64_t j = 0; j < cols; ++j) {
    if (dwb) dwb.set(j, sw[j]);
    if (dbb) dbb.set(j, sb[j]);
  }
}

struct NCS {
  int64_t n, c, s;
};
NCS ncs(const Tensor& x) {
  NCS d{x.sizes()[0], x.sizes()[1], 1};
  for (int64_t i = 2; i < x.dim(); ++i) d.s *= x.sizes()[i];
  return d;
}

template <class T>
void group_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x, const Tensor& w,
                   const Tensor& b, int64_t groups, double eps) {
  const NCS d = ncs(x);
  const int64_t cg = d.c / groups, len = cg * d.s;
  const Buf<T> xb(x), yb(y), wb(w), bb(b);
  if (len == 0) return;
  // Rows (image, group) are independent: split over the pool (Note [CPU threads]).
  parallel_for(d.n * groups, std::max<int64_t>(1, kParallelGrain / len), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t base = r * len, c0 = (r % groups) * cg;
      double m, rs;
      group_stats(xb, len, [&](int64_t k) { return base + k; }, false, eps, m, rs);
      Stat{mean}.set(r, m);
      Stat{rstd}.set(r, rs);
      m = Stat{mean}.get(r);
      rs = Stat{rstd}.get(r);
      for (int64_t k = 0; k < len; ++k) {
        const int64_t c = c0 + k / d.s;
        yb.set(base + k, (xb.get(base + k) - m) * rs * wb.get(c, 1.0) + bb.get(c, 0.0));
      }
    }
  });
}

template <class T>
void group_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy, const Tensor& x,
                    const Tensor& mean, const Tensor& rstd, const Tensor& w, int64_t groups) {
  const NCS d = ncs(x);
  const int64_t cg = d.c / groups, len = cg * d.s;
  const Buf<T> dxb(dx), dwb(dw), dbb(db), dyb(dy), xb(x), wb(w);
  // Rows (image, group) run in parallel (Note [CPU threads]); each keeps its per-channel sums for
  // the weight/bias gradients in psw/psb [N, C], summed over images in order afterwards, so the
  // result does not depend on the thread count.
  const std::size_t nc = static_cast<std::size_t>(d.n * d.c);
  std::vector<double> psw(nc, 0.0), psb(nc, 0.0);
  parallel_for(d.n * groups, std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(1, len)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t base = r * len, c0 = (r % groups) * cg, n = r / groups;
      double* sw = psw.data() + n * d.c;
      double* sb = psb.data() + n * d.c;
      const double m = Stat{mean}.get(r), rs = Stat{rstd}.get(r);
      double sum_g = 0, sum_gx = 0;
      for (int64_t k = 0; k < len; ++k) {
        const int64_t c = c0 + k / d.s;
        const double dv = dyb.get(base + k), xh = (xb.get(base + k) - m) * rs, g = dv * wb.get(c, 1.0);
        sum_g += g;
        sum_gx += g * xh;
        sw[c] += dv * xh;
        sb[c] += dv;
      }
      if (!dxb) continue;
      const double mg = sum_g / static_cast<double>(len), mgx = sum_gx / static_cast<double>(len);
      for (int64_t k = 0; k < len; ++k) {
        const int64_t c = c0 + k / d.s;
        const double xh = (xb.get(base + k) - m) * rs, g = dyb.get(base + k) * wb.get(c, 1.0);
        dxb.set(base + k, rs * (g - mg - xh * mgx));
      }
    }
  });
  for (int64_t c = 0; c < d.c; ++c) {
    double sw = 0, sb = 0;
    for (int64_t n = 0; n < d.n; ++n) {
      sw += psw[static_cast<std::size_t>(n * d.c + c)];
      sb += psb[static_cast<std::size_t>(n * d.c + c)];
    }
    if (dwb) dwb.set(c, sw);
    if (dbb) dbb.set(c, sb);
  }
}

template <class T>
void batch_stats(const Tensor& mean, const Tensor& var, const Tensor& x) {
  const NCS d = ncs(x);
  const Buf<T> xb(x);
  const int64_t count = d.n * d.s;
  for (int64_t c = 0; c < d.c; ++c) {
    auto elem = [&](int64_t k) { return ((k / d.s) * d.c + c) * d.s + k % d.s; };
    double m, rs;
    group_stats(xb, count, elem, false, 0.0, m, rs);
    Stat{mean}.set(c, m);
    Stat{var}.set(c, 1.0 / (rs * rs));
  }
}

template <class T>
void batch_apply(const Tensor& y, const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& w,
                 const Tensor& b) {
  const NCS d = ncs(x);
  const Buf<T> xb(x), yb(y), wb(w), bb(b);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const int64_t c = (i / d.s) % d.c;
    yb.set(i, (xb.get(i) - Stat{mean}.get(c)) * Stat{rstd}.get(c) * wb.get(c, 1.0) + bb.get(c, 0.0));
  }
}

template <class T>
void batch_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy, const Tensor& x,
                    const Tensor& mean, const Tensor& rstd, const Tensor& w, bool training) {
  const NCS d = ncs(x);
  const Buf<T> dxb(dx), dwb(dw), dbb(db), dyb(dy), xb(x), wb(w);
  const int64_t count = d.n * d.s;
  for (int64_t c = 0; c < d.c; ++c) {
    auto elem = [&](int64_t k) { return ((k / d.s) * d.c + c) * d.s + k % d.s; };
    const double m = Stat{mean}.get(c), rs = Stat{rstd}.get(c), wc = wb.get(c, 1.0);
    double sum_dy = 0, sum_dyx = 0;
    for (int64_t k = 0; k < count; ++k) {
      const int64_t i = elem(k);
      sum_dy += dyb.get(i);
      sum_dyx += dyb.get(i) * (xb.get(i) - m) * rs;
    }
    if (dwb) dwb.set(c, sum_dyx);
    if (dbb) dbb.set(c, sum_dy);
    if (!dxb) continue;
    const double md = training ? sum_dy / static_cast<double>(count) : 0.0;
    const double mdx = training ? sum_dyx / static_cast<double>(count) : 0.0;
    for (int64_t k = 0; k < count; ++k) {
      const int64_t i = elem(k);
      const double xh = (xb.get(i) - m) * rs;
      dxb.set(i, wc * rs * (dyb.get(i) - md - xh * mdx));
    }
  }
}

}  // namespace

void CpuBackend::norm_rows_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                                   const Tensor& weight, const Tensor& bias, double eps) {
  if (rstd.numel() == 0 || x.numel() == 0) return;
  dispatch_floating(x.dtype(), "norm_rows_forward",
                    [&](auto tag) { rows_forward<typename decltype(tag)::type>(y, mean, rstd, x, weight, bias, eps); });
}

void CpuBackend::norm_rows_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                                    const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& weight) {
  if (rstd.numel() == 0 || x.numel() == 0) return;
  dispatch_floating(x.dtype(), "norm_rows_backward", [&](auto tag) {
    rows_backward<typename decltype(tag)::type>(dx, dweight, dbias, dy, x, mean, rstd, weight);
  });
}

void CpuBackend::group_norm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                                    const Tensor& weight, const Tensor& bias, int64_t groups, double eps) {
  if (x.numel() == 0) return;
  dispatch_floating(x.dtype(), "group_norm_forward", [&](auto tag) {
    group_forward<typename decltype(tag)::type>(y, mean, rstd, x, weight, bias, groups, eps);
  });
}

void CpuBackend::group_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                                     const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& weight,
                                     int64_t groups) {
  if (x.numel() == 0) return;
  dispatch_floating(x.dtype(), "group_norm_backward", [&](auto tag) {
    group_backward<typename decltype(tag)::type>(dx, dweight, dbias, dy, x, mean, rstd, weight, groups);
  });
}

void CpuBackend::batch_norm_stats(const Tensor& mean, const Tensor& var, const Tensor& x) {
  if (x.numel() == 0) return;
  dispatch_floating(x.dtype(), "batch_norm_stats",
                    [&](auto tag) { batch_stats<typename decltype(tag)::type>(mean, var, x); });
}

void CpuBackend::batch_norm_apply(const Tensor& y, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                                  const Tensor& weight, const Tensor& bias) {
  if (x.numel() == 0) return;
  dispatch_floating(x.dtype(), "batch_norm_apply",
                    [&](auto tag) { batch_apply<typename decltype(tag)::type>(y, x, mean, rstd, weight, bias); });
}

void CpuBackend::batch_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                                     const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& weight,
                                     bool training) {
  if (x.numel() == 0) return;
  dispatch_floating(x.dtype(), "batch_norm_backward", [&](auto tag) {
    batch_backward<typename decltype(tag)::type>(dx, dweight, dbias, dy, x, mean, rstd, weight, training);
  });
}

}  // namespace flame::backend::cpu
