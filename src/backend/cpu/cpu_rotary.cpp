// CPU reference of the rotary embedding's fused kernel (src/backend/fused/rotary.h): one pass over
// the pairs of every row, in the dtype of cos (f32, or f64 for f64 x); and of the RMS QK-norm fused
// with the join and the rotation (src/backend/fused/rms_norm_rotary.h), which rounds where the
// separate CPU kernels round (rms_norm's in double with f32 statistics, cpu_norm.cpp; the rotation
// as above), so the fused op equals rms_norm, cat and rotary_embedding bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "src/backend/cpu/cpu_backend.h"
#include "src/backend/cpu/cpu_threads.h"
#include "src/backend/fused/rms_norm_rotary.h"
#include "src/backend/fused/rotary.h"
#include "src/core/dispatch.h"
#include "src/opdef/scalar_math.h"

namespace flame::backend::cpu {

namespace {

template <class T, class C>
void rotary_rows(T* out, const T* x, const C* cos, const C* sin, int64_t rows, int64_t s_len, int64_t heads, int64_t d,
                 bool half, bool inverse) {
  const int64_t pairs = d / 2;
  parallel_for(rows, std::max<int64_t>(1, 16384 / d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t s = (r / heads) % s_len;
      const C* c = cos + s * d;
      const C* sn = sin + s * d;
      const T* xr = x + r * d;
      T* o = out + r * d;
      for (int64_t j = 0; j < pairs; ++j) {
        const int64_t a = half ? j : 2 * j, b = half ? j + pairs : 2 * j + 1;
        const C xa = convert<C>(xr[a]), xb = convert<C>(xr[b]);
        if (!inverse) {
          o[a] = convert<T>(xa * c[a] - xb * sn[a]);
          o[b] = convert<T>(xb * c[b] + xa * sn[b]);
        } else {
          o[a] = convert<T>(xa * c[a] + xb * sn[b]);
          o[b] = convert<T>(xb * c[b] - xa * sn[a]);
        }
      }
    }
  });
}

bool rotary_embedding_cpu(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, int layout,
                          bool inverse, int64_t heads) {
  const int64_t d = x.size(-1), s_len = cos.size(0);
  const int64_t rows = x.numel() / d;
  dispatch_floating(x.dtype(), "rotary_embedding", [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto run = [&]<class C>() {
      rotary_rows<T, C>(static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()),
                        static_cast<const C*>(cos.data_ptr()), static_cast<const C*>(sin.data_ptr()), rows, s_len, heads, d,
                        layout == 1, inverse);
    };
    if (cos.dtype() == DType::f64) run.template operator()<double>();
    else run.template operator()<float>();
  });
  return true;
}

// ---- RMS norm + join + rotary ----

// One part's rows in the joined sequence: part p covers positions [start, start + len).
struct PartRows {
  int64_t start = 0, len = 0;
};
std::vector<PartRows> part_rows(const TensorList& parts) {
  std::vector<PartRows> r;
  int64_t s = 0;
  for (const Tensor& p : parts) {
    r.push_back({s, p.size(1)});
    s += p.size(1);
  }
  return r;
}

// The partner of element e in a row of d, and whether e is the pair's first.
inline int64_t pair_partner(int64_t e, int64_t d, bool half) {
  if (half) return e < d / 2 ? e + d / 2 : e - d / 2;
  return e % 2 == 0 ? e + 1 : e - 1;
}
inline bool pair_first(int64_t e, int64_t d, bool half) { return half ? e < d / 2 : e % 2 == 0; }

// rms_norm's statistic (cpu_norm.cpp): 1 / sqrt(mean(x^2) + eps) in double, stored as S.
template <class T, class S>
double row_rstd(const T* x, int64_t d, double eps) {
  double v = 0;
  for (int64_t j = 0; j < d; ++j) {
    const double t = convert<double>(x[j]) - 0.0;
    v += t * t;
  }
  v /= static_cast<double>(d);
  return static_cast<double>(static_cast<S>(1.0 / std::sqrt(v + eps)));
}

template <class T, class C, class S>
void norm_rotary_rows(const Tensor& out, const Tensor& g, const TensorList& dparts, const TensorList& parts,
                      const TensorList& weights, const C* cos, const C* sin, bool half, double eps) {
  const bool backward = g.defined();
  const Tensor& shape_of = backward ? g : out;
  const int64_t b_len = shape_of.size(0), s_len = shape_of.size(1), h_len = shape_of.size(2), d = shape_of.size(3);
  const std::vector<PartRows> pr = part_rows(parts);
  const int64_t rows = b_len * s_len * h_len;
  parallel_for(rows, std::max<int64_t>(1, 16384 / d), [&](int64_t r0, int64_t r1) {
    std::vector<T> n(static_cast<std::size_t>(d));
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t h = r % h_len, s = (r / h_len) % s_len, b = r / (h_len * s_len);
      std::size_t p = 0;
      while (s >= pr[p].start + pr[p].len) ++p;
      const int64_t at = ((b * pr[p].len + (s - pr[p].start)) * h_len + h) * d;
      const T* x = static_cast<const T*>(parts[p].data_ptr()) + at;
      const T* w = weights[p].defined() ? static_cast<const T*>(weights[p].data_ptr()) : nullptr;
      const double rs = row_rstd<T, S>(x, d, eps);
      auto wv = [&](int64_t j) { return w ? convert<double>(w[j]) : 1.0; };
      const C* c = cos ? cos + s * d : nullptr;
      const C* sn = sin ? sin + s * d : nullptr;
      if (!backward) {
        // rms_norm's output in T, then the rotation of the joined row.
        for (int64_t j = 0; j < d; ++j) n[j] = convert<T>((convert<double>(x[j]) - 0.0) * rs * wv(j) + 0.0);
        T* o = static_cast<T*>(out.data_ptr()) + r * d;
        for (int64_t e = 0; e < d; ++e) {
          if (!c) {
            o[e] = n[e];
            continue;
          }
          const int64_t q = pair_partner(e, d, half);
          const C a = convert<C>(n[e]), bq = convert<C>(n[q]);
          o[e] = pair_first(e, d, half) ? convert<T>(a * c[e] - bq * sn[e]) : convert<T>(a * c[e] + bq * sn[e]);
        }
        continue;
      }
      // The gradient of the rotation (its inverse pass, in T), then rms_norm's backward of it.
      const T* gr = static_cast<const T*>(g.data_ptr()) + b * g.stride(0) + s * g.stride(1) + h * g.stride(2);
      for (int64_t e = 0; e < d; ++e) {
        if (!c) {
          n[e] = gr[e];
          continue;
        }
        const int64_t q = pair_partner(e, d, half);
        const C a = convert<C>(gr[e]), bq = convert<C>(gr[q]);
        n[e] = pair_first(e, d, half) ? convert<T>(a * c[e] + bq * sn[q]) : convert<T>(a * c[e] - bq * sn[q]);
      }
      double sum_gx = 0;
      for (int64_t j = 0; j < d; ++j) {
        const double xh = (convert<double>(x[j]) - 0.0) * rs;
        sum_gx += convert<double>(n[j]) * wv(j) * xh;
      }
      const double mgx = sum_gx / static_cast<double>(d);
      T* dx = static_cast<T*>(dparts[p].data_ptr()) + at;
      for (int64_t j = 0; j < d; ++j) {
        const double xh = (convert<double>(x[j]) - 0.0) * rs, gw = convert<double>(n[j]) * wv(j);
        dx[j] = convert<T>(rs * (gw - 0.0 - xh * mgx));
      }
    }
  });
}

void norm_rotary_cpu(const Tensor& out, const Tensor& g, const TensorList& dparts, const TensorList& parts,
                     const TensorList& weights, const Tensor& cos, const Tensor& sin, int layout, double eps) {
  dispatch_floating(parts[0].dtype(), "rms_norm_rotary", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, double>) {
      norm_rotary_rows<T, double, double>(out, g, dparts, parts, weights,
                                          cos.defined() ? static_cast<const double*>(cos.data_ptr()) : nullptr,
                                          sin.defined() ? static_cast<const double*>(sin.data_ptr()) : nullptr,
                                          layout == 1, eps);
    } else {
      norm_rotary_rows<T, float, float>(out, g, dparts, parts, weights,
                                        cos.defined() ? static_cast<const float*>(cos.data_ptr()) : nullptr,
                                        sin.defined() ? static_cast<const float*>(sin.data_ptr()) : nullptr,
                                        layout == 1, eps);
    }
  });
}

bool rms_norm_rotary_forward_cpu(const Tensor& out, const TensorList& parts, const TensorList& weights,
                                 const Tensor& cos, const Tensor& sin, int layout, double eps) {
  norm_rotary_cpu(out, Tensor(), {}, parts, weights, cos, sin, layout, eps);
  return true;
}

bool rms_norm_rotary_backward_cpu(const TensorList& dparts, const Tensor& g, const TensorList& parts,
                                  const TensorList& weights, const Tensor& cos, const Tensor& sin, int layout,
                                  double eps) {
  norm_rotary_cpu(Tensor(), g, dparts, parts, weights, cos, sin, layout, eps);
  return true;
}

}  // namespace

void register_cpu_rotary_kernels() {
  fused::rotary_embedding.define(DeviceType::cpu, &rotary_embedding_cpu);
  fused::rms_norm_rotary_forward.define(DeviceType::cpu, &rms_norm_rotary_forward_cpu);
  fused::rms_norm_rotary_backward.define(DeviceType::cpu, &rms_norm_rotary_backward_cpu);
}

}  // namespace flame::backend::cpu
