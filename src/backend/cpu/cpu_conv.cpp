// CPU convolution: im2col (vol2col for 3-d) + GEMM (OpenBLAS when present, Note [CPU GEMM]),
// spread over the CPU pool (Note [CPU threads]).
//
// Note [CPU conv]
// Operands are read in the compute type (float for f32/bf16/f16, like cuDNN's float accumulation;
// double for f64), from a contiguous [N, C, D, H, W] copy unless they already are one; 1-d and 2-d
// convs are the 3-d case with leading spatial dims of size 1. For a chunk of nb images and group g,
// with L = OD*OH*OW:
//   cols [Cg*KD*KH*KW, nb*L]: cols[(c, kd, kh, kw), (i, od, oh, ow)] = x[n0 + i, g*Cg + c, id, ih, iw]
//     with id = od*stride - pad_lo + kd*dilation (0 outside the input), likewise ih, iw;
//   forward:          y[n, group g] [Kg, nb*L] = w_g [Kg, Cg*K] @ cols
//   backward-data:    cols = w_g^T @ dy[group g], then col2im adds each entry back into dx
//   backward-filter:  dw_g = sum over chunks of dy[group g] [Kg, nb*L] @ cols^T
// im2col copies, per kernel tap and output row, the valid run of output columns as one memcpy
// (stride 1) or one strided loop, and zero-fills the runs that read padding; col2im adds the same
// runs back in the same order as an element-by-element loop would. A 1x1 kernel with stride 1 and
// no padding uses x itself as cols. Images are batched so a GEMM has about kTargetCols columns
// (small late-stage feature maps would otherwise give thin GEMMs), with cols capped at
// kColsCap elements. Chunks of images are the pool's tasks; dy and y, laid out [N, K, L], are
// transposed to [K, nb*L] through per-row copies when nb > 1. The filter gradient's chunking
// depends only on the shapes, one partial per chunk summed in chunk order: the result does not
// depend on the thread count. Scratch buffers are per thread and reused across calls.
#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

#include "src/backend/cpu/cpu_backend.h"
#include "src/backend/cpu/cpu_threads.h"

#ifdef FLAME_WITH_CBLAS
#include <cblas.h>
#endif

namespace flame::backend::cpu {
namespace {

using ConvParams = Backend::ConvParams;

constexpr int64_t kTargetCols = 1024;       // GEMM columns a chunk of images aims for
constexpr int64_t kColsCap = int64_t{1} << 21;  // most elements of one cols buffer (8 MiB of f32)

// Geometry with spatial dims padded to 3 (leading size-1 dims for 1-d and 2-d).
struct Geom {
  int64_t n = 0, c = 0, k = 0, groups = 1;
  int64_t in[3] = {1, 1, 1}, ker[3] = {1, 1, 1}, out[3] = {1, 1, 1};
  int64_t stride[3] = {1, 1, 1}, pad[3] = {0, 0, 0}, dil[3] = {1, 1, 1};
  int64_t cg() const { return c / groups; }
  int64_t kg() const { return k / groups; }
  int64_t ksize() const { return ker[0] * ker[1] * ker[2]; }
  int64_t isize() const { return in[0] * in[1] * in[2]; }
  int64_t osize() const { return out[0] * out[1] * out[2]; }
  int64_t rows() const { return cg() * ksize(); }
  // A 1x1 kernel with stride 1 and no padding reads x as its own cols.
  bool direct() const {
    for (int d = 0; d < 3; ++d)
      if (ker[d] != 1 || stride[d] != 1 || pad[d] != 0 || in[d] != out[d]) return false;
    return true;
  }
};

Geom make_geom(const Tensor& x, const Tensor& w, const Tensor& y, const ConvParams& p) {
  Geom g;
  g.n = x.sizes()[0];
  g.c = x.sizes()[1];
  g.k = w.sizes()[0];
  g.groups = p.groups;
  const int64_t shift = 3 - p.nsp;
  for (int64_t i = 0; i < p.nsp; ++i) {
    g.in[shift + i] = x.sizes()[2 + i];
    g.ker[shift + i] = w.sizes()[2 + i];
    g.out[shift + i] = y.sizes()[2 + i];
    g.stride[shift + i] = p.stride[i];
    g.pad[shift + i] = p.pad_lo[i];
    g.dil[shift + i] = p.dilation[i];
  }
  return g;
}

// Images per chunk: about kTargetCols GEMM columns, cols within kColsCap, and (when `spread`)
// at least one chunk per pool thread.
int64_t images_per_chunk(const Geom& g, bool spread) {
  const int64_t L = std::max<int64_t>(1, g.osize()), rows = std::max<int64_t>(1, g.rows());
  int64_t nb = std::max<int64_t>(1, (kTargetCols + L - 1) / L);
  nb = std::min(nb, std::max<int64_t>(1, kColsCap / (rows * L)));
  if (spread) {
    const int64_t threads = pool_threads();
    nb = std::min(nb, std::max<int64_t>(1, (g.n + threads - 1) / threads));
  }
  return std::min(nb, std::max<int64_t>(1, g.n));
}

DType compute_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

// t itself when it is a contiguous compute-type tensor, else a contiguous compute-type copy.
Tensor to_compute(CpuBackend& be, const Tensor& t) {
  if (t.is_contiguous() && t.dtype() == compute_dtype(t.dtype())) return t;
  Tensor c = make_empty(t.sizes(), compute_dtype(t.dtype()), t.device(), "conv");
  be.copy(c, t);
  return c;
}

// A contiguous compute-type tensor to write a result into: `t` itself when it is one.
Tensor compute_out(const Tensor& t) {
  if (t.is_contiguous() && t.dtype() == compute_dtype(t.dtype())) return t;
  return make_empty(t.sizes(), compute_dtype(t.dtype()), t.device(), "conv");
}

template <class T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// Per-thread scratch, reused across calls (slot 0: cols, 1: transposed dy / y, 2: partials).
template <class T>
T* scratch(int slot, int64_t count) {
  thread_local std::vector<T> bufs[3];
  std::vector<T>& b = bufs[slot];
  if (static_cast<int64_t>(b.size()) < count) b.resize(static_cast<std::size_t>(count));
  return b.data();
}

// Row-major C[m, n] = op(A)[m, k] @ op(B)[k, n] + beta * C.
template <class T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
          T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
#ifdef FLAME_WITH_CBLAS
  auto fits = [](int64_t v) { return v >= 0 && v <= INT_MAX; };
  if (k > 0 && fits(m) && fits(n) && fits(k) && fits(lda) && fits(ldb) && fits(ldc)) {
    const auto tra = ta ? CblasTrans : CblasNoTrans, trb = tb ? CblasTrans : CblasNoTrans;
    if constexpr (std::is_same_v<T, float>) {
      cblas_sgemm(CblasRowMajor, tra, trb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, a,
                  static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
    } else {
      cblas_dgemm(CblasRowMajor, tra, trb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0, a,
                  static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < m; ++i) {
    T* __restrict crow = c + i * ldc;
    if (beta == T(0)) std::fill(crow, crow + n, T(0));
    else if (beta != T(1)) for (int64_t j = 0; j < n; ++j) crow[j] *= beta;
    for (int64_t p = 0; p < k; ++p) {
      const T av = ta ? a[p * lda + i] : a[i * lda + p];
      if (tb) {
        for (int64_t j = 0; j < n; ++j) crow[j] += av * b[j * ldb + p];
      } else {
        const T* __restrict brow = b + p * ldb;
        for (int64_t j = 0; j < n; ++j) crow[j] += av * brow[j];
      }
    }
  }
}

// The output columns [lo, hi) whose input index o*stride - pad + tap lies in [0, size).
struct Run {
  int64_t lo, hi;
};
Run valid_run(int64_t size, int64_t out, int64_t stride, int64_t pad, int64_t tap) {
  const int64_t a = pad - tap;         // o*stride >= a
  const int64_t b = size + pad - tap;  // o*stride < b
  int64_t lo = a <= 0 ? 0 : (a + stride - 1) / stride;
  int64_t hi = b <= 0 ? 0 : (b + stride - 1) / stride;
  hi = std::min(hi, out);
  lo = std::min(lo, hi);
  return {lo, hi};
}

// Calls f(row, od, oh, first input element, run) for every kernel tap row and every output
// row (od, oh), with the input element that output column run.lo reads; the run is empty
// (lo == hi == 0) where the whole output row reads padding.
template <class F>
void for_each_run(const Geom& g, F&& f) {
  int64_t row = 0;
  for (int64_t c = 0; c < g.cg(); ++c)
    for (int64_t kd = 0; kd < g.ker[0]; ++kd)
      for (int64_t kh = 0; kh < g.ker[1]; ++kh)
        for (int64_t kw = 0; kw < g.ker[2]; ++kw, ++row) {
          const Run rw = valid_run(g.in[2], g.out[2], g.stride[2], g.pad[2], kw * g.dil[2]);
          for (int64_t od = 0; od < g.out[0]; ++od) {
            const int64_t id = od * g.stride[0] - g.pad[0] + kd * g.dil[0];
            const bool okd = id >= 0 && id < g.in[0];
            for (int64_t oh = 0; oh < g.out[1]; ++oh) {
              const int64_t ih = oh * g.stride[1] - g.pad[1] + kh * g.dil[1];
              if (!okd || ih < 0 || ih >= g.in[1] || rw.lo == rw.hi) {
                f(row, od, oh, int64_t{-1}, Run{0, 0});
                continue;
              }
              const int64_t iw = rw.lo * g.stride[2] - g.pad[2] + kw * g.dil[2];
              f(row, od, oh, (c * g.in[0] + id) * g.in[1] * g.in[2] + ih * g.in[2] + iw, rw);
            }
          }
        }
}

// cols rows (leading dimension ld) for one image's group: xg points at its first channel.
template <class T>
void im2col(T* cols, int64_t ld, const T* xg, const Geom& g) {
  const int64_t ow = g.out[2], sw = g.stride[2];
  for_each_run(g, [&](int64_t row, int64_t od, int64_t oh, int64_t src, Run r) {
    T* d = cols + row * ld + (od * g.out[1] + oh) * ow;
    std::fill(d, d + r.lo, T(0));
    if (r.hi > r.lo) {
      const T* s = xg + src;
      if (sw == 1) {
        std::memcpy(d + r.lo, s, static_cast<std::size_t>(r.hi - r.lo) * sizeof(T));
      } else {
        for (int64_t o = r.lo; o < r.hi; ++o) d[o] = s[(o - r.lo) * sw];
      }
    }
    std::fill(d + r.hi, d + ow, T(0));
  });
}

// Adds cols (leading dimension ld) back into one image's group of dx.
template <class T>
void col2im_add(T* dxg, const T* cols, int64_t ld, const Geom& g) {
  const int64_t ow = g.out[2], sw = g.stride[2];
  for_each_run(g, [&](int64_t row, int64_t od, int64_t oh, int64_t dst, Run r) {
    if (r.hi == r.lo) return;
    const T* s = cols + row * ld + (od * g.out[1] + oh) * ow;
    T* d = dxg + dst;
    if (sw == 1) {
      for (int64_t o = r.lo; o < r.hi; ++o) d[o - r.lo] += s[o];
    } else {
      for (int64_t o = r.lo; o < r.hi; ++o) d[(o - r.lo) * sw] += s[o];
    }
  });
}

// Copies rows [k0, k0 + kg) of images [n0, n0 + nb) of t ([N, K, L]) into buf [kg, nb*L], or back.
template <class T>
void gather_rows(T* buf, const T* t, const Geom& g, int64_t n0, int64_t nb, int64_t k0, int64_t kg) {
  const int64_t L = g.osize();
  for (int64_t k = 0; k < kg; ++k)
    for (int64_t i = 0; i < nb; ++i)
      std::memcpy(buf + k * nb * L + i * L, t + ((n0 + i) * g.k + k0 + k) * L, static_cast<std::size_t>(L) * sizeof(T));
}
template <class T>
void scatter_rows(T* t, const T* buf, const Geom& g, int64_t n0, int64_t nb, int64_t k0, int64_t kg) {
  const int64_t L = g.osize();
  for (int64_t k = 0; k < kg; ++k)
    for (int64_t i = 0; i < nb; ++i)
      std::memcpy(t + ((n0 + i) * g.k + k0 + k) * L, buf + k * nb * L + i * L, static_cast<std::size_t>(L) * sizeof(T));
}

// Runs f(n0, nb) over chunks of `per` images on the pool.
template <class F>
void over_chunks(const Geom& g, int64_t per, F&& f) {
  const int64_t chunks = (g.n + per - 1) / per;
  parallel_tasks(chunks, [&](int64_t ch) { f(ch * per, std::min(per, g.n - ch * per)); });
}

template <class T>
void forward_typed(const Geom& g, T* y, const T* x, const T* w) {
  const int64_t rows = g.rows(), L = g.osize(), kg = g.kg(), cg = g.cg();
  const int64_t per = g.direct() ? 1 : images_per_chunk(g, true);
  over_chunks(g, per, [&](int64_t n0, int64_t nb) {
    for (int64_t grp = 0; grp < g.groups; ++grp) {
      const T* wg = w + grp * kg * rows;
      if (g.direct()) {  // nb == 1: y_g = w_g @ x_g
        gemm<T>(false, false, kg, L, cg, wg, cg, x + (n0 * g.c + grp * cg) * L, L, T(0),
                y + (n0 * g.k + grp * kg) * L, L);
        continue;
      }
      T* cols = scratch<T>(0, rows * nb * L);
      for (int64_t i = 0; i < nb; ++i) im2col(cols + i * L, nb * L, x + ((n0 + i) * g.c + grp * cg) * g.isize(), g);
      if (nb == 1) {
        gemm<T>(false, false, kg, L, rows, wg, rows, cols, L, T(0), y + (n0 * g.k + grp * kg) * L, L);
      } else {
        T* out = scratch<T>(1, kg * nb * L);
        gemm<T>(false, false, kg, nb * L, rows, wg, rows, cols, nb * L, T(0), out, nb * L);
        scatter_rows(y, out, g, n0, nb, grp * kg, kg);
      }
    }
  });
}

template <class T>
void backward_data_typed(const Geom& g, T* dx, const T* dy, const T* w) {
  const int64_t rows = g.rows(), L = g.osize(), kg = g.kg(), cg = g.cg(), is = g.isize();
  const int64_t per = g.direct() ? 1 : images_per_chunk(g, true);
  over_chunks(g, per, [&](int64_t n0, int64_t nb) {
    for (int64_t grp = 0; grp < g.groups; ++grp) {
      const T* wg = w + grp * kg * rows;
      if (g.direct()) {  // dx_g = w_g^T @ dy_g, every element written once
        gemm<T>(true, false, cg, L, kg, wg, cg, dy + (n0 * g.k + grp * kg) * L, L, T(0),
                dx + (n0 * g.c + grp * cg) * is, is);
        continue;
      }
      const T* dyg = dy + (n0 * g.k + grp * kg) * L;
      if (nb > 1) {
        T* t = scratch<T>(1, kg * nb * L);
        gather_rows(t, dy, g, n0, nb, grp * kg, kg);
        dyg = t;
      }
      T* cols = scratch<T>(0, rows * nb * L);
      gemm<T>(true, false, rows, nb * L, kg, wg, rows, dyg, nb * L, T(0), cols, nb * L);
      for (int64_t i = 0; i < nb; ++i) {
        T* dxg = dx + ((n0 + i) * g.c + grp * cg) * is;
        std::fill(dxg, dxg + cg * is, T(0));
        col2im_add(dxg, cols + i * L, nb * L, g);
      }
    }
  });
}

template <class T>
void backward_filter_typed(const Geom& g, T* dw, const T* x, const T* dy) {
  const int64_t rows = g.rows(), L = g.osize(), kg = g.kg(), cg = g.cg(), wsize = g.k * rows;
  const int64_t per = images_per_chunk(g, false);  // shapes only: Note [CPU conv]
  const int64_t chunks = (g.n + per - 1) / per;
  std::vector<T> partials(static_cast<std::size_t>(std::max<int64_t>(0, chunks - 1) * wsize));
  over_chunks(g, per, [&](int64_t n0, int64_t nb) {
    const int64_t ch = n0 / per;
    T* out = ch == 0 ? dw : partials.data() + (ch - 1) * wsize;
    for (int64_t grp = 0; grp < g.groups; ++grp) {
      T* dwg = out + grp * kg * rows;
      // Columns of this chunk: x_g itself (direct, nb == 1) or im2col of its images.
      const T* cols = x + (n0 * g.c + grp * cg) * g.isize();
      if (!g.direct() || nb > 1) {
        T* c = scratch<T>(0, rows * nb * L);
        if (g.direct()) {
          for (int64_t i = 0; i < nb; ++i)
            for (int64_t r = 0; r < rows; ++r)
              std::memcpy(c + r * nb * L + i * L, x + ((n0 + i) * g.c + grp * cg + r) * L,
                          static_cast<std::size_t>(L) * sizeof(T));
        } else {
          for (int64_t i = 0; i < nb; ++i) im2col(c + i * L, nb * L, x + ((n0 + i) * g.c + grp * cg) * g.isize(), g);
        }
        cols = c;
      }
      const T* dyg = dy + (n0 * g.k + grp * kg) * L;
      if (nb > 1) {
        T* t = scratch<T>(1, kg * nb * L);
        gather_rows(t, dy, g, n0, nb, grp * kg, kg);
        dyg = t;
      }
      gemm<T>(false, true, kg, rows, nb * L, dyg, nb * L, cols, nb * L, T(0), dwg, rows);
    }
  });
  for (int64_t ch = 1; ch < chunks; ++ch) {
    const T* p = partials.data() + (ch - 1) * wsize;
    for (int64_t i = 0; i < wsize; ++i) dw[i] += p[i];
  }
}

// Runs f.operator()<T>() for the compute type of dt (float or double).
template <class F>
void for_compute_type(DType dt, F&& f) {
  if (compute_dtype(dt) == DType::f64) f(double{});
  else f(float{});
}

}  // namespace

void CpuBackend::conv_forward(const Tensor& y, const Tensor& x, const Tensor& w, const ConvParams& p) {
  if (y.numel() == 0) return;
  const Geom g = make_geom(x, w, y, p);
  const Tensor xc = to_compute(*this, x), wc = to_compute(*this, w);
  const Tensor yc = compute_out(y);
  for_compute_type(xc.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (g.rows() == 0) std::fill(ptr<T>(yc), ptr<T>(yc) + yc.numel(), T(0));
    else forward_typed<T>(g, ptr<T>(yc), ptr<const T>(xc), ptr<const T>(wc));
  });
  if (!yc.is_same(y)) copy(y, yc);
}

void CpuBackend::conv_backward_data(const Tensor& dx, const Tensor& dy, const Tensor& w, const ConvParams& p) {
  if (dx.numel() == 0) return;
  const Geom g = make_geom(dx, w, dy, p);
  const Tensor dxc = compute_out(dx);
  for_compute_type(dxc.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (dy.numel() == 0 || g.kg() == 0) {
      std::fill(ptr<T>(dxc), ptr<T>(dxc) + dxc.numel(), T(0));
      return;
    }
    const Tensor dyc = to_compute(*this, dy), wc = to_compute(*this, w);
    backward_data_typed<T>(g, ptr<T>(dxc), ptr<const T>(dyc), ptr<const T>(wc));
  });
  if (!dxc.is_same(dx)) copy(dx, dxc);
}

void CpuBackend::conv_backward_filter(const Tensor& dw, const Tensor& x, const Tensor& dy, const ConvParams& p) {
  if (dw.numel() == 0) return;
  const Geom g = make_geom(x, dw, dy, p);
  const Tensor dwc = compute_out(dw);
  for_compute_type(dwc.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (g.n == 0 || g.osize() == 0) {
      std::fill(ptr<T>(dwc), ptr<T>(dwc) + dwc.numel(), T(0));
      return;
    }
    const Tensor xc = to_compute(*this, x), dyc = to_compute(*this, dy);
    backward_filter_typed<T>(g, ptr<T>(dwc), ptr<const T>(xc), ptr<const T>(dyc));
  });
  if (!dwc.is_same(dw)) copy(dw, dwc);
}

}  // namespace flame::backend::cpu
