// CPU reference convolution: im2col (vol2col for 3-d) + GEMM through CpuBackend::matmul (OpenBLAS
// when present, Note [CPU GEMM]).
//
// Note [CPU conv]
// Every operand is first copied into a contiguous [N, C, D, H, W] buffer of the compute type
// (float for f32/bf16/f16, like cuDNN's float accumulation; double for f64); 1-d and 2-d convs
// are the 3-d case with leading spatial dims of size 1. For one image n and one group g:
//   cols [Cg*KD*KH*KW, OD*OH*OW]: cols[(c, kd, kh, kw), (od, oh, ow)] = x[n, g*Cg + c, id, ih, iw]
//     with id = od*stride - pad_lo + kd*dilation (0 outside the input), likewise ih, iw;
//   forward:          y[n, group g] [Kg, L]  = w_g [Kg, Cg*K] @ cols
//   backward-data:    cols = w_g^T @ dy[n, group g], then col2im adds each column entry back
//   backward-filter:  dw_g += dy[n, group g] @ cols^T
// The result is converted into the destination (any dtype, contiguous or channels-last) by copy.
#include <algorithm>
#include <vector>

#include "src/backend/cpu/cpu_backend.h"

namespace flame::backend::cpu {
namespace {

using ConvParams = Backend::ConvParams;

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

DType compute_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

// A contiguous compute-type copy of t.
Tensor to_compute(CpuBackend& be, const Tensor& t) {
  Tensor c = make_empty(t.sizes(), compute_dtype(t.dtype()), t.device(), "conv");
  be.copy(c, t);
  return c;
}

// A [1, rows, cols] matrix view of `t`'s storage at element `offset` with row stride rs, col stride cs.
Tensor mat(const Tensor& t, int64_t offset, int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  return make_view(t, {1, rows, cols}, {0, rs, cs}, offset, "conv");
}

// For every (row of cols, output position) the input position it reads, or -1 for padding.
template <class F>
void for_each_col(const Geom& g, F&& f) {
  int64_t row = 0;
  for (int64_t c = 0; c < g.cg(); ++c)
    for (int64_t kd = 0; kd < g.ker[0]; ++kd)
      for (int64_t kh = 0; kh < g.ker[1]; ++kh)
        for (int64_t kw = 0; kw < g.ker[2]; ++kw, ++row) {
          int64_t col = 0;
          for (int64_t od = 0; od < g.out[0]; ++od) {
            const int64_t id = od * g.stride[0] - g.pad[0] + kd * g.dil[0];
            const bool okd = id >= 0 && id < g.in[0];
            for (int64_t oh = 0; oh < g.out[1]; ++oh) {
              const int64_t ih = oh * g.stride[1] - g.pad[1] + kh * g.dil[1];
              const bool okh = okd && ih >= 0 && ih < g.in[1];
              for (int64_t ow = 0; ow < g.out[2]; ++ow, ++col) {
                const int64_t iw = ow * g.stride[2] - g.pad[2] + kw * g.dil[2];
                const bool ok = okh && iw >= 0 && iw < g.in[2];
                f(row, col, ok ? (c * g.in[0] + id) * g.in[1] * g.in[2] + ih * g.in[2] + iw : int64_t{-1});
              }
            }
          }
        }
}

// cols [Cg*K, L] from the channels of group `grp` of image `n` of x (contiguous compute type).
template <class T>
void im2col(T* cols, const T* x, const Geom& g, int64_t n, int64_t grp) {
  const T* xg = x + (n * g.c + grp * g.cg()) * g.isize();
  const int64_t L = g.osize();
  for_each_col(g, [&](int64_t row, int64_t col, int64_t src) { cols[row * L + col] = src >= 0 ? xg[src] : T(0); });
}

template <class T>
void col2im_add(T* dx, const T* cols, const Geom& g, int64_t n, int64_t grp) {
  T* dxg = dx + (n * g.c + grp * g.cg()) * g.isize();
  const int64_t L = g.osize();
  for_each_col(g, [&](int64_t row, int64_t col, int64_t dst) {
    if (dst >= 0) dxg[dst] += cols[row * L + col];
  });
}

template <class T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

}  // namespace

void CpuBackend::conv_forward(const Tensor& y, const Tensor& x, const Tensor& w, const ConvParams& p) {
  const Geom g = make_geom(x, w, y, p);
  const Tensor xc = to_compute(*this, x), wc = to_compute(*this, w);
  Tensor yc = make_empty(y.sizes(), xc.dtype(), y.device(), "conv");
  const int64_t rows = g.cg() * g.ksize(), L = g.osize(), kg = g.kg();
  Tensor cols = make_empty({1, rows, L}, xc.dtype(), y.device(), "conv");
  dispatch_dtype(xc.dtype(), "conv", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      for (int64_t n = 0; n < g.n; ++n) {
        for (int64_t grp = 0; grp < g.groups; ++grp) {
          im2col(ptr<T>(cols), ptr<const T>(xc), g, n, grp);
          const Tensor wg = mat(wc, grp * kg * rows, kg, rows, rows, 1);
          const Tensor yg = mat(yc, (n * g.k + grp * kg) * L, kg, L, L, 1);
          matmul(yg, wg, cols);
        }
      }
    }
  });
  copy(y, yc);
}

void CpuBackend::conv_backward_data(const Tensor& dx, const Tensor& dy, const Tensor& w, const ConvParams& p) {
  const Geom g = make_geom(dx, w, dy, p);
  const Tensor dyc = to_compute(*this, dy), wc = to_compute(*this, w);
  Tensor dxc = make_empty(dx.sizes(), dyc.dtype(), dx.device(), "conv");
  fill(dxc, Scalar(0.0));
  const int64_t rows = g.cg() * g.ksize(), L = g.osize(), kg = g.kg();
  Tensor cols = make_empty({1, rows, L}, dyc.dtype(), dx.device(), "conv");
  dispatch_dtype(dyc.dtype(), "conv", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      for (int64_t n = 0; n < g.n; ++n) {
        for (int64_t grp = 0; grp < g.groups; ++grp) {
          const Tensor wgt = mat(wc, grp * kg * rows, rows, kg, 1, rows);  // w_g^T
          const Tensor dyg = mat(dyc, (n * g.k + grp * kg) * L, kg, L, L, 1);
          matmul(cols, wgt, dyg);
          col2im_add(ptr<T>(dxc), ptr<const T>(cols), g, n, grp);
        }
      }
    }
  });
  copy(dx, dxc);
}

void CpuBackend::conv_backward_filter(const Tensor& dw, const Tensor& x, const Tensor& dy, const ConvParams& p) {
  const Geom g = make_geom(x, dw, dy, p);
  const Tensor xc = to_compute(*this, x), dyc = to_compute(*this, dy);
  Tensor dwc = make_empty(dw.sizes(), xc.dtype(), dw.device(), "conv");
  fill(dwc, Scalar(0.0));
  const int64_t rows = g.cg() * g.ksize(), L = g.osize(), kg = g.kg();
  Tensor cols = make_empty({1, rows, L}, xc.dtype(), dw.device(), "conv");
  Tensor part = make_empty({1, kg, rows}, xc.dtype(), dw.device(), "conv");
  dispatch_dtype(xc.dtype(), "conv", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      const Tensor colst = mat(cols, 0, L, rows, 1, L);  // cols^T
      for (int64_t n = 0; n < g.n; ++n) {
        for (int64_t grp = 0; grp < g.groups; ++grp) {
          im2col(ptr<T>(cols), ptr<const T>(xc), g, n, grp);
          const Tensor dyg = mat(dyc, (n * g.k + grp * kg) * L, kg, L, L, 1);
          matmul(part, dyg, colst);
          T* acc = ptr<T>(dwc) + grp * kg * rows;
          const T* src = ptr<const T>(part);
          for (int64_t i = 0; i < kg * rows; ++i) acc[i] += src[i];
        }
      }
    }
  });
  copy(dw, dwc);
}

}  // namespace flame::backend::cpu
