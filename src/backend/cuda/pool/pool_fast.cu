// Fast CUDA paths of pooling and nearest upsampling for contiguous NCHW tensors.
//
// Note [Pool fast paths]
// The generic kernels of pool.cu honour any strides, adaptive windows and every upsample mode, and
// pay for it per element: 64-bit index arithmetic (a 64-bit division is a long instruction
// sequence), a stride lookup per plane and scalar stores. The common cases get these paths:
//  - regular (not adaptive) max/avg pooling of a contiguous input whose element counts fit in 32
//    bits: the same loops and the same order of operations as the generic kernels (so the same
//    results bit for bit, NaN handling and ties included), with 32-bit indices and divisions; the
//    backward is the same gather, its candidate windows exact (avg pools have dilation 1, so every
//    candidate covers the input; max compares the saved argmax). Max pooling may save int32 argmax
//    indices (src/ops/pool.cpp does so on CUDA when the caller does not ask for the indices): half
//    the bytes of int64 written forward and read backward.
//  - nearest / nearest-exact upsampling by an integer factor (out == s * in along each dim, s_w in
//    {1, 2, 4} dividing the 16-byte vector width) whose source map is exactly o / s: the host checks
//    the map for every output row and column with the same float formula the kernels use, so the
//    path is taken only where it gives the generic result. One thread per 16-byte output vector of a
//    row: it reads 16 / s_w bytes of input and writes that vector to the s_h output rows (full-width
//    coalesced 16-byte stores). The backward thread loads the same vector from each of the s_h rows
//    and sums s_h x s_w blocks in float in the generic kernel's order (row, then column).
#include "src/backend/cuda/pool/pool_fast.h"

#include <cstring>
#include <limits>
#include <type_traits>

#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"

namespace flame::backend::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();

// One pooled dim in 32-bit arithmetic.
struct Dim32 {
  int in, out, k, s, pad, dil;
};
Dim32 dim32(const PoolDim& d) {
  return {static_cast<int>(d.in), static_cast<int>(d.out), static_cast<int>(d.kernel),
          static_cast<int>(d.stride), static_cast<int>(d.pad), static_cast<int>(d.dilation)};
}

// Pool2dParams::divisor in 32 bits (the same value).
__device__ __forceinline__ int avg_divisor(const Dim32& h, const Dim32& w, int oh, int ow, int div_override,
                                           bool count_include_pad) {
  if (div_override > 0) return div_override;
  int hs = oh * h.s - h.pad, ws = ow * w.s - w.pad;
  int he = min(hs + h.k, h.in + h.pad), we = min(ws + w.k, w.in + w.pad);
  const int pool_size = (he - hs) * (we - ws);
  if (count_include_pad) return pool_size;
  hs = max(hs, 0);
  ws = max(ws, 0);
  he = min(he, h.in);
  we = min(we, w.in);
  return (he - hs) * (we - ws);
}

template <class T, class I, bool IS_MAX>
__global__ void pool2d_fast_kernel(const T* __restrict__ x, T* __restrict__ out, I* __restrict__ idx, Dim32 h,
                                   Dim32 w, int div_override, bool count_include_pad, uint32_t total) {
  using A = compute_t<T>;
  const uint32_t step = gridDim.x * blockDim.x;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
    const uint32_t t = i / static_cast<uint32_t>(w.out);
    const int ow = static_cast<int>(i - t * static_cast<uint32_t>(w.out));
    const uint32_t b = t / static_cast<uint32_t>(h.out);
    const int oh = static_cast<int>(t - b * static_cast<uint32_t>(h.out));
    const T* plane = x + b * static_cast<uint32_t>(h.in * w.in);
    const int hs = oh * h.s - h.pad, ws = ow * w.s - w.pad;
    A acc = IS_MAX ? lowest<A>() : A(0);
    int arg = -1;
    for (int jh = 0; jh < h.k; ++jh) {
      const int ih = hs + jh * h.dil;
      if (ih < 0 || ih >= h.in) continue;
      for (int jw = 0; jw < w.k; ++jw) {
        const int iw = ws + jw * w.dil;
        if (iw < 0 || iw >= w.in) continue;
        const A v = load_as<A>(plane[ih * w.in + iw]);
        if constexpr (!IS_MAX) {
          acc += v;
        } else if (arg < 0 || v > acc || v != v) {  // as the generic kernel: a NaN is taken
          acc = v;
          arg = ih * w.in + iw;
        }
      }
    }
    if constexpr (!IS_MAX) acc /= static_cast<A>(avg_divisor(h, w, oh, ow, div_override, count_include_pad));
    out[i] = store_as<T>(acc);
    if (IS_MAX && idx) idx[i] = static_cast<I>(arg);
  }
}

// Outputs whose window may hold input i along one dim: [first, last) (PoolDim::first_out/last_out).
__device__ __forceinline__ void out_range(const Dim32& d, int i, int& first, int& last) {
  const int lo = i + d.pad - (d.k - 1) * d.dil;
  first = lo <= 0 ? 0 : (lo + d.s - 1) / d.s;
  last = min((i + d.pad) / d.s + 1, d.out);
}

template <class T, class I, bool IS_MAX>
__global__ void pool2d_backward_fast_kernel(T* __restrict__ gin, const T* __restrict__ gout,
                                            const I* __restrict__ idx, Dim32 h, Dim32 w, int div_override,
                                            bool count_include_pad, uint32_t total) {
  using A = compute_t<T>;
  const uint32_t step = gridDim.x * blockDim.x;
  const uint32_t oplane = static_cast<uint32_t>(h.out * w.out);
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
    const uint32_t t = i / static_cast<uint32_t>(w.in);
    const int iw = static_cast<int>(i - t * static_cast<uint32_t>(w.in));
    const uint32_t b = t / static_cast<uint32_t>(h.in);
    const int ih = static_cast<int>(t - b * static_cast<uint32_t>(h.in));
    int oh0, oh1, ow0, ow1;
    out_range(h, ih, oh0, oh1);
    out_range(w, iw, ow0, ow1);
    const uint32_t base = b * oplane;
    const int me = ih * w.in + iw;
    A acc = 0;
    for (int oh = oh0; oh < oh1; ++oh) {
      for (int ow = ow0; ow < ow1; ++ow) {
        const uint32_t o = base + static_cast<uint32_t>(oh * w.out + ow);
        if constexpr (IS_MAX) {
          if (static_cast<int64_t>(idx[o]) == me) acc += load_as<A>(gout[o]);
        } else {
          // dilation 1: every candidate window covers input (ih, iw)
          acc += load_as<A>(gout[o]) / static_cast<A>(avg_divisor(h, w, oh, ow, div_override, count_include_pad));
        }
      }
    }
    gin[i] = store_as<T>(acc);
  }
}

bool pool_fits(const Pool2dParams& p, int64_t in_numel, int64_t out_numel) {
  if (p.h.adaptive || p.w.adaptive) return false;
  if (p.mode == PoolMode::avg && (p.h.dilation != 1 || p.w.dilation != 1)) return false;
  if (in_numel > kMax32 || out_numel > kMax32 || p.divisor_override > kMax32) return false;
  // Window arithmetic (o*s - pad + k*dil, i + pad) stays far inside int when each term is small.
  for (const PoolDim* d : {&p.h, &p.w}) {
    if (d->kernel * d->dilation + d->stride * d->out + d->in + d->pad > (int64_t{1} << 30)) return false;
  }
  return true;
}

// Integer upsample factor of one dim when its nearest map is exactly o / s, else 0.
int64_t nearest_factor(const UpsampleDim& d, bool exact) {
  if (d.out % d.in != 0) return 0;
  const int64_t s = d.out / d.in;
  for (int64_t o = 0; o < d.out; ++o) {
    if (d.nearest<float>(o, exact) != o / s) return 0;
  }
  return s;
}

template <class T, int SW>
__global__ void upsample_nearest_fast_kernel(const T* __restrict__ x, T* __restrict__ out, uint32_t W, uint32_t vecs,
                                             int sh, int64_t total) {
  constexpr int E = 16 / static_cast<int>(sizeof(T));  // elements of a 16-byte vector
  constexpr int EI = E / SW;                            // input elements it repeats
  const int64_t OW = static_cast<int64_t>(W) * SW;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += step) {
    const int64_t row = pdiv(t, vecs), u = t - row * vecs;
    const T* src = x + row * W + u * EI;
    T in[EI];
#pragma unroll
    for (int j = 0; j < EI; ++j) in[j] = src[j];
    T v[E];
#pragma unroll
    for (int j = 0; j < E; ++j) v[j] = in[j / SW];
    uint4 packed;
    memcpy(&packed, v, sizeof(packed));
    T* dst = out + row * sh * OW + u * E;
    for (int r = 0; r < sh; ++r) *reinterpret_cast<uint4*>(dst + r * OW) = packed;
  }
}

template <class T, int SW>
__global__ void upsample_nearest_backward_fast_kernel(T* __restrict__ gin, const T* __restrict__ gout, uint32_t W,
                                                      uint32_t vecs, int sh, int64_t total) {
  using A = compute_t<T>;
  constexpr int E = 16 / static_cast<int>(sizeof(T));
  constexpr int EI = E / SW;
  const int64_t OW = static_cast<int64_t>(W) * SW;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += step) {
    const int64_t row = pdiv(t, vecs), u = t - row * vecs;
    const T* src = gout + row * sh * OW + u * E;
    A acc[EI];
#pragma unroll
    for (int j = 0; j < EI; ++j) acc[j] = A(0);
    for (int r = 0; r < sh; ++r) {
      const uint4 raw = *reinterpret_cast<const uint4*>(src + r * OW);
      T g[E];
      memcpy(g, &raw, sizeof(raw));
#pragma unroll
      for (int j = 0; j < E; ++j) acc[j / SW] += load_as<A>(g[j]);
    }
    T* dst = gin + row * W + u * EI;
#pragma unroll
    for (int j = 0; j < EI; ++j) dst[j] = store_as<T>(acc[j]);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The shared preconditions of the nearest fast paths; sets sh, sw, vecs (16-byte vectors per output row).
bool nearest_plan(const Upsample2dParams& p, DType dt, int64_t& sh, int64_t& sw, int64_t& vecs) {
  if (p.mode != UpsampleMode::nearest && p.mode != UpsampleMode::nearest_exact) return false;
  const bool exact = p.mode == UpsampleMode::nearest_exact;
  sh = nearest_factor(p.h, exact);
  sw = nearest_factor(p.w, exact);
  if (sh == 0 || sw == 0 || !(sw == 1 || sw == 2 || sw == 4)) return false;
  const int64_t e = 16 / static_cast<int64_t>(dtype_size(dt));
  if (e % sw != 0 || p.w.out % e != 0 || p.w.in > kMax32) return false;
  vecs = p.w.out / e;
  return sh <= kMax32;
}

template <class F>
bool dispatch_sw(int64_t sw, F&& f) {
  switch (sw) {
    case 1: f(std::integral_constant<int, 1>{}); return true;
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    default: return false;
  }
}

}  // namespace

bool pool2d_fast(const Tensor& out, const Tensor& indices, const Tensor& x, const Pool2dParams& p,
                 cudaStream_t stream) {
  if (!x.is_contiguous() || !pool_fits(p, x.numel(), out.numel())) return false;
  const uint32_t total = static_cast<uint32_t>(out.numel());
  const Dim32 h = dim32(p.h), w = dim32(p.w);
  const int dov = static_cast<int>(p.divisor_override);
  dispatch_floating(x.dtype(), "pool2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xp = static_cast<const T*>(x.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    const unsigned int blocks = blocks_for(total, kThreads);
    if (p.mode == PoolMode::avg) {
      pool2d_fast_kernel<T, int32_t, false><<<blocks, kThreads, 0, stream>>>(xp, op, nullptr, h, w, dov,
                                                                              p.count_include_pad, total);
    } else if (indices.defined() && indices.dtype() == DType::i64) {
      pool2d_fast_kernel<T, int64_t, true><<<blocks, kThreads, 0, stream>>>(
          xp, op, static_cast<int64_t*>(indices.data_ptr()), h, w, dov, p.count_include_pad, total);
    } else {
      int32_t* ip = indices.defined() ? static_cast<int32_t*>(indices.data_ptr()) : nullptr;
      pool2d_fast_kernel<T, int32_t, true><<<blocks, kThreads, 0, stream>>>(xp, op, ip, h, w, dov,
                                                                             p.count_include_pad, total);
    }
    FLAME_CUDA_CHECK_LAUNCH();
  });
  return true;
}

bool pool2d_backward_fast(const Tensor& grad_in, const Tensor& grad_out, const Tensor& indices,
                          const Pool2dParams& p, cudaStream_t stream) {
  if (!grad_out.is_contiguous() || !pool_fits(p, grad_in.numel(), grad_out.numel())) return false;
  const uint32_t total = static_cast<uint32_t>(grad_in.numel());
  const Dim32 h = dim32(p.h), w = dim32(p.w);
  const int dov = static_cast<int>(p.divisor_override);
  dispatch_floating(grad_in.dtype(), "pool2d_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* gi = static_cast<T*>(grad_in.data_ptr());
    const T* go = static_cast<const T*>(grad_out.data_ptr());
    const unsigned int blocks = blocks_for(total, kThreads);
    if (p.mode == PoolMode::avg) {
      pool2d_backward_fast_kernel<T, int32_t, false><<<blocks, kThreads, 0, stream>>>(
          gi, go, nullptr, h, w, dov, p.count_include_pad, total);
    } else if (indices.dtype() == DType::i64) {
      pool2d_backward_fast_kernel<T, int64_t, true><<<blocks, kThreads, 0, stream>>>(
          gi, go, static_cast<const int64_t*>(indices.data_ptr()), h, w, dov, p.count_include_pad, total);
    } else {
      pool2d_backward_fast_kernel<T, int32_t, true><<<blocks, kThreads, 0, stream>>>(
          gi, go, static_cast<const int32_t*>(indices.data_ptr()), h, w, dov, p.count_include_pad, total);
    }
    FLAME_CUDA_CHECK_LAUNCH();
  });
  return true;
}

bool upsample2d_nearest_fast(const Tensor& out, const Tensor& x, const Upsample2dParams& p, cudaStream_t stream) {
  int64_t sh = 0, sw = 0, vecs = 0;
  if (!x.is_contiguous() || !out.is_contiguous() || !aligned16(out.data_ptr())) return false;
  if (!nearest_plan(p, x.dtype(), sh, sw, vecs)) return false;
  const int64_t total = x.size(0) * x.size(1) * p.h.in * vecs;
  bool launched = false;
  dispatch_floating(x.dtype(), "upsample2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launched = dispatch_sw(sw, [&](auto swc) {
      constexpr int SW = decltype(swc)::value;
      if constexpr ((16 / sizeof(T)) % SW == 0) {
        upsample_nearest_fast_kernel<T, SW><<<blocks_for(total, kThreads), kThreads, 0, stream>>>(
            static_cast<const T*>(x.data_ptr()), static_cast<T*>(out.data_ptr()), static_cast<uint32_t>(p.w.in),
            static_cast<uint32_t>(vecs), static_cast<int>(sh), total);
        FLAME_CUDA_CHECK_LAUNCH();
      }
    });
  });
  return launched;
}

bool upsample2d_nearest_backward_fast(const Tensor& grad_in, const Tensor& grad_out, const Upsample2dParams& p,
                                      cudaStream_t stream) {
  int64_t sh = 0, sw = 0, vecs = 0;
  if (!grad_out.is_contiguous() || !grad_in.is_contiguous() || !aligned16(grad_out.data_ptr())) return false;
  if (!nearest_plan(p, grad_in.dtype(), sh, sw, vecs)) return false;
  const int64_t total = grad_in.size(0) * grad_in.size(1) * p.h.in * vecs;
  bool launched = false;
  dispatch_floating(grad_in.dtype(), "upsample2d_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launched = dispatch_sw(sw, [&](auto swc) {
      constexpr int SW = decltype(swc)::value;
      if constexpr ((16 / sizeof(T)) % SW == 0) {
        upsample_nearest_backward_fast_kernel<T, SW><<<blocks_for(total, kThreads), kThreads, 0, stream>>>(
            static_cast<T*>(grad_in.data_ptr()), static_cast<const T*>(grad_out.data_ptr()),
            static_cast<uint32_t>(p.w.in), static_cast<uint32_t>(vecs), static_cast<int>(sh), total);
        FLAME_CUDA_CHECK_LAUNCH();
      }
    });
  });
  return launched;
}

}  // namespace flame::backend::cuda
