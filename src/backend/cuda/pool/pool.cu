// CUDA pooling and upsampling, forward and backward (Note [Pool windows], Note [Upsample source
// index] in pool_params.h: the geometry is the CPU reference's, evaluated here per thread).
// One thread per output element (forward) or per input element (backward: a gather over the
// outputs that read it, so the gradient is deterministic and needs no atomics). Half types
// compute in float; reads honour any input strides (channels-last included); results are
// contiguous NCHW. Contiguous inputs of the common cases take the fast paths of pool_fast.cu
// (Note [Pool fast paths]).
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/backend/cuda/pool/pool_fast.h"
#include "src/backend/pool_params.h"

namespace flame::backend::cuda {
namespace {

// Element strides of an [N, C, H, W] tensor; plane(b) is the offset of plane b = n*C + c.
struct Strides4 {
  int64_t n, c, h, w, channels;
  __device__ __forceinline__ int64_t plane(int64_t b) const {
    if (n == channels * c) return b * c;  // planes evenly spaced (NCHW, or any N-C-mergeable layout)
    const int64_t q = pdiv(b, channels);
    return q * n + (b - q * channels) * c;
  }
};
Strides4 strides4(const Tensor& t) {
  return {t.strides()[0], t.strides()[1], t.strides()[2], t.strides()[3], t.size(1)};
}

__device__ __forceinline__ int64_t thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t thread_count() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// I: the saved argmax type, int64 (the public indices) or int32 (internal, Note [Pool fast paths]).
template <class T, class I>
__global__ void pool2d_kernel(const T* __restrict__ x, Strides4 xs, T* __restrict__ out, I* __restrict__ idx,
                              Pool2dParams p, int64_t total) {
  using A = compute_t<T>;
  for (int64_t i = thread_index(); i < total; i += thread_count()) {
    const int64_t t = pdiv(i, p.w.out), ow = i - t * p.w.out;
    const int64_t b = pdiv(t, p.h.out), oh = t - b * p.h.out;
    const T* plane = x + xs.plane(b);
    const int64_t hs = p.h.start(oh), hl = p.h.len(oh), ws = p.w.start(ow), wl = p.w.len(ow);
    const int64_t hstep = p.h.step(), wstep = p.w.step();
    const bool is_max = p.mode == PoolMode::max;
    A acc = is_max ? lowest<A>() : A(0);
    int64_t arg = -1;
    for (int64_t jh = 0; jh < hl; ++jh) {
      const int64_t ih = hs + jh * hstep;
      if (ih < 0 || ih >= p.h.in) continue;
      for (int64_t jw = 0; jw < wl; ++jw) {
        const int64_t iw = ws + jw * wstep;
        if (iw < 0 || iw >= p.w.in) continue;
        const A v = load_as<A>(plane[ih * xs.h + iw * xs.w]);
        if (!is_max) {
          acc += v;
        } else if (arg < 0 || v > acc || v != v) {  // as PyTorch: a NaN is taken
          acc = v;
          arg = ih * p.w.in + iw;
        }
      }
    }
    if (!is_max) acc /= static_cast<A>(p.divisor(oh, ow));
    out[i] = store_as<T>(acc);
    if (idx) idx[i] = static_cast<I>(arg);
  }
}

template <class T, class I>
__global__ void pool2d_backward_kernel(T* __restrict__ gin, const T* __restrict__ gout, Strides4 gs,
                                       const I* __restrict__ idx, Pool2dParams p, int64_t total) {
  using A = compute_t<T>;
  const int64_t H = p.h.in, W = p.w.in, OH = p.h.out, OW = p.w.out;
  for (int64_t i = thread_index(); i < total; i += thread_count()) {
    const int64_t t = pdiv(i, W), iw = i - t * W;
    const int64_t b = pdiv(t, H), ih = t - b * H;
    const int64_t oh0 = p.h.first_out(ih), oh1 = p.h.last_out(ih);
    const int64_t ow0 = p.w.first_out(iw), ow1 = p.w.last_out(iw);
    const T* g = gout + gs.plane(b);
    A acc = 0;
    for (int64_t oh = oh0; oh < oh1; ++oh) {
      for (int64_t ow = ow0; ow < ow1; ++ow) {
        if (idx) {
          if (static_cast<int64_t>(idx[(b * OH + oh) * OW + ow]) == ih * W + iw) acc += load_as<A>(g[oh * gs.h + ow * gs.w]);
        } else if (p.h.covers(oh, ih) && p.w.covers(ow, iw)) {
          acc += load_as<A>(g[oh * gs.h + ow * gs.w]) / static_cast<A>(p.divisor(oh, ow));
        }
      }
    }
    gin[i] = store_as<T>(acc);
  }
}

// The two taps of output o along one dim (nearest: one tap, given twice with weight 0 the second
// time). Scalars, not arrays: a runtime-length tap loop would put the arrays in local memory.
template <class A>
struct Taps {
  int64_t i0, i1;
  A w0, w1;
};
template <class A>
__device__ __forceinline__ Taps<A> upsample_taps(const UpsampleDim& d, UpsampleMode mode, int64_t o) {
  Taps<A> t;
  if (mode == UpsampleMode::linear) {
    A l1;
    d.linear<A>(o, t.i0, t.i1, l1);
    t.w0 = A(1) - l1;
    t.w1 = l1;
  } else {
    t.i0 = t.i1 = d.nearest<A>(o, mode == UpsampleMode::nearest_exact);
    t.w0 = A(1);
    t.w1 = A(0);
  }
  return t;
}

// Weight with which output o reads input i along one dim (0 when it does not).
template <class A>
__device__ __forceinline__ A upsample_weight(const UpsampleDim& d, UpsampleMode mode, int64_t o, int64_t i) {
  if (is_filter_mode(mode)) return filter_weight<A>(d, mode, o, i);
  const Taps<A> t = upsample_taps<A>(d, mode, o);
  return (t.i0 == i ? t.w0 : A(0)) + (t.i1 == i ? t.w1 : A(0));
}

template <class T>
__global__ void upsample2d_kernel(const T* __restrict__ x, Strides4 xs, T* __restrict__ out, Upsample2dParams p,
                                  int64_t total) {
  using A = compute_t<T>;
  for (int64_t i = thread_index(); i < total; i += thread_count()) {
    const int64_t t = pdiv(i, p.w.out), ow = i - t * p.w.out;
    const int64_t b = pdiv(t, p.h.out), oh = t - b * p.h.out;
    const T* plane = x + xs.plane(b);
    if (is_filter_mode(p.mode)) {  // Note [Upsample filters]: the CPU reference's order
      A acc = 0;
      for_each_filter_tap<A>(p.h, p.mode, oh, [&](int64_t ih, A wh) {
        A row = 0;
        for_each_filter_tap<A>(p.w, p.mode, ow, [&](int64_t iw, A ww) {
          row += ww * load_as<A>(plane[ih * xs.h + iw * xs.w]);
        });
        acc += wh * row;
      });
      out[i] = store_as<T>(acc);
      continue;
    }
    const Taps<A> th = upsample_taps<A>(p.h, p.mode, oh), tw = upsample_taps<A>(p.w, p.mode, ow);
    A acc;
    if (p.mode == UpsampleMode::linear) {  // the CPU reference's order of the four terms
      acc = th.w0 * tw.w0 * load_as<A>(plane[th.i0 * xs.h + tw.i0 * xs.w]);
      acc += th.w0 * tw.w1 * load_as<A>(plane[th.i0 * xs.h + tw.i1 * xs.w]);
      acc += th.w1 * tw.w0 * load_as<A>(plane[th.i1 * xs.h + tw.i0 * xs.w]);
      acc += th.w1 * tw.w1 * load_as<A>(plane[th.i1 * xs.h + tw.i1 * xs.w]);
    } else {
      acc = load_as<A>(plane[th.i0 * xs.h + tw.i0 * xs.w]);
    }
    out[i] = store_as<T>(acc);
  }
}

template <class T>
__global__ void upsample2d_backward_kernel(T* __restrict__ gin, const T* __restrict__ gout, Strides4 gs,
                                           Upsample2dParams p, int64_t total) {
  using A = compute_t<T>;
  const int64_t H = p.h.in, W = p.w.in;
  for (int64_t i = thread_index(); i < total; i += thread_count()) {
    const int64_t t = pdiv(i, W), iw = i - t * W;
    const int64_t b = pdiv(t, H), ih = t - b * H;
    int64_t oh0, oh1, ow0, ow1;
    p.h.out_range(ih, p.mode, oh0, oh1);
    p.w.out_range(iw, p.mode, ow0, ow1);
    const T* g = gout + gs.plane(b);
    A acc = 0;
    for (int64_t oh = oh0; oh < oh1; ++oh) {
      const A wh = upsample_weight<A>(p.h, p.mode, oh, ih);
      if (wh == A(0)) continue;
      for (int64_t ow = ow0; ow < ow1; ++ow) {
        const A wv = upsample_weight<A>(p.w, p.mode, ow, iw);
        if (wv != A(0)) acc += wh * wv * load_as<A>(g[oh * gs.h + ow * gs.w]);
      }
    }
    gin[i] = store_as<T>(acc);
  }
}

constexpr int kThreads = 256;

}  // namespace

void CudaBackend::pool2d(const Tensor& out, const Tensor& indices, const Tensor& x, const Pool2dParams& p) {
  const int64_t total = out.numel();
  if (total == 0) return;
  DeviceGuard guard(device());
  if (pool2d_fast(out, indices, x, p, stream())) return;
  dispatch_floating(x.dtype(), "pool2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const unsigned int blocks = blocks_for(total, kThreads);
    if (indices.defined() && indices.dtype() == DType::i32) {
      pool2d_kernel<T, int32_t><<<blocks, kThreads, 0, stream()>>>(
          static_cast<const T*>(x.data_ptr()), strides4(x), static_cast<T*>(out.data_ptr()),
          static_cast<int32_t*>(indices.data_ptr()), p, total);
    } else {
      int64_t* ip = indices.defined() ? static_cast<int64_t*>(indices.data_ptr()) : nullptr;
      pool2d_kernel<T, int64_t><<<blocks, kThreads, 0, stream()>>>(
          static_cast<const T*>(x.data_ptr()), strides4(x), static_cast<T*>(out.data_ptr()), ip, p, total);
    }
    FLAME_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::pool2d_backward(const Tensor& grad_in, const Tensor& grad_out, const Tensor& indices,
                                  const Pool2dParams& p) {
  const int64_t total = grad_in.numel();
  if (total == 0) return;
  FLAME_CHECK(p.mode != PoolMode::max || indices.defined(), "max_pool2d_backward", "the saved indices are missing");
  DeviceGuard guard(device());
  if (pool2d_backward_fast(grad_in, grad_out, indices, p, stream())) return;
  dispatch_floating(grad_in.dtype(), "pool2d_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const unsigned int blocks = blocks_for(total, kThreads);
    T* gi = static_cast<T*>(grad_in.data_ptr());
    const T* go = static_cast<const T*>(grad_out.data_ptr());
    if (p.mode == PoolMode::max && indices.dtype() == DType::i32) {
      pool2d_backward_kernel<T, int32_t><<<blocks, kThreads, 0, stream()>>>(
          gi, go, strides4(grad_out), static_cast<const int32_t*>(indices.data_ptr()), p, total);
    } else {
      const int64_t* ip = p.mode == PoolMode::max ? static_cast<const int64_t*>(indices.data_ptr()) : nullptr;
      pool2d_backward_kernel<T, int64_t><<<blocks, kThreads, 0, stream()>>>(gi, go, strides4(grad_out), ip, p, total);
    }
    FLAME_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::upsample2d(const Tensor& out, const Tensor& x, const Upsample2dParams& p) {
  const int64_t total = out.numel();
  if (total == 0) return;
  DeviceGuard guard(device());
  if (upsample2d_nearest_fast(out, x, p, stream())) return;
  dispatch_floating(x.dtype(), "upsample2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    upsample2d_kernel<T><<<blocks_for(total, kThreads), kThreads, 0, stream()>>>(
        static_cast<const T*>(x.data_ptr()), strides4(x), static_cast<T*>(out.data_ptr()), p, total);
    FLAME_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::upsample2d_backward(const Tensor& grad_in, const Tensor& grad_out, const Upsample2dParams& p) {
  const int64_t total = grad_in.numel();
  if (total == 0) return;
  DeviceGuard guard(device());
  if (upsample2d_nearest_backward_fast(grad_in, grad_out, p, stream())) return;
  dispatch_floating(grad_in.dtype(), "upsample2d_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    upsample2d_backward_kernel<T><<<blocks_for(total, kThreads), kThreads, 0, stream()>>>(
        static_cast<T*>(grad_in.data_ptr()), static_cast<const T*>(grad_out.data_ptr()), strides4(grad_out), p,
        total);
    FLAME_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace flame::backend::cuda
