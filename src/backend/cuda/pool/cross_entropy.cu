// CUDA fused cross-entropy (Note [Fused cross-entropy] in src/ops/cross_entropy.cpp): one block per
// row of contiguous logits [N, V]. Forward: one read of the row (16-byte vectors when aligned) with
// an online max / sum of exp and the sum of the logits, merged across the block; it writes only
// the row's loss and logsumexp. Backward: one read and one write of the row, the gradient stored
// in the logits' dtype. Half logits compute in float, f64 in double. A target outside [0, V) (and
// not ignore_index) is recorded as a deferred device error (Note [Deferred device errors]) and
// gives a NaN loss.
#include <cstring>

#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"

namespace flame::backend::cuda {
namespace {

template <class A>
__device__ __forceinline__ MaxSum<A> ms_shfl_xor(MaxSum<A> v, int m) {
  return {__shfl_xor_sync(0xffffffffu, v.m, m), __shfl_xor_sync(0xffffffffu, v.s, m)};
}

// Loads element j of a row through 16-byte vectors when `vec`, else one by one; calls f(value).
template <class T, class A, class F>
__device__ __forceinline__ void for_row(const T* __restrict__ row, int64_t V, bool vec, F&& f) {
  constexpr int W = vec_width<T>();
  if (vec) {
    const uint4* rv = reinterpret_cast<const uint4*>(row);
    for (int64_t v = threadIdx.x; v < V / W; v += blockDim.x) {
      const uint4 raw = rv[v];
#pragma unroll
      for (int j = 0; j < W; ++j) f(v * W + j, load_as<A>(vec_elem<T>(raw, j)));
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) f(j, load_as<A>(row[j]));
  }
}

template <class T>
__global__ void cross_entropy_kernel(const T* __restrict__ x, const int64_t* __restrict__ target,
                                     compute_t<T>* __restrict__ loss, compute_t<T>* __restrict__ lse, int64_t N,
                                     int64_t V, int64_t ignore_index, double eps, bool vec, DeviceErrorRecord* rec) {
  using A = compute_t<T>;
  __shared__ A sm_m[32], sm_s[32], sm_x[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const T* row = x + r * V;
    MaxSum<A> ms{lowest<A>(), A(0)};
    A sx = 0;
    for_row<T, A>(row, V, vec, [&](int64_t, A v) {
      ms = ms_add(ms, v);
      sx += v;
    });
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
      ms = ms_merge(ms, ms_shfl_xor(ms, m));
      sx += __shfl_xor_sync(0xffffffffu, sx, m);
    }
    __syncthreads();  // the shared slots may still be read for the previous row
    if (lane == 0) {
      sm_m[warp] = ms.m;
      sm_s[warp] = ms.s;
      sm_x[warp] = sx;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      MaxSum<A> all{sm_m[0], sm_s[0]};
      A sum_x = sm_x[0];
      for (int w = 1; w < nwarps; ++w) {
        all = ms_merge(all, MaxSum<A>{sm_m[w], sm_s[w]});
        sum_x += sm_x[w];
      }
      const A l = all.m == lowest<A>() ? lowest<A>() : all.m + math::log(all.s);
      lse[r] = l;
      const int64_t t = target[r];
      A out = 0;
      if (t != ignore_index) {
        if (t < 0 || t >= V) {
          if (atomicCAS(&rec->op, 0, static_cast<int32_t>(kErrGather)) == 0) {
            rec->dim = 1;
            rec->value = t;
            rec->limit = V;
          }
          out = static_cast<A>(NAN);
        } else {
          const A nll = l - load_as<A>(row[t]);
          out = eps > 0 ? static_cast<A>(1.0 - eps) * nll + static_cast<A>(eps) * (l - sum_x / static_cast<A>(V)) : nll;
        }
      }
      loss[r] = out;
    }
  }
}

template <class T>
__global__ void cross_entropy_backward_kernel(T* __restrict__ gx, const compute_t<T>* __restrict__ grad_loss,
                                              const T* __restrict__ x, const int64_t* __restrict__ target,
                                              const compute_t<T>* __restrict__ lse, int64_t N, int64_t V,
                                              int64_t ignore_index, double eps, bool vec) {
  using A = compute_t<T>;
  constexpr int W = vec_width<T>();
  const A off = static_cast<A>(eps) / static_cast<A>(V), on = static_cast<A>(1.0 - eps);
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const int64_t t = target[r];
    const bool ignored = t == ignore_index;
    const A g = ignored ? A(0) : grad_loss[r];
    const A l = lse[r];
    const T* row = x + r * V;
    T* out = gx + r * V;
    auto grad = [&](int64_t j, A v) -> A {
      return ignored ? A(0) : (math::exp(v - l) - off - (j == t ? on : A(0))) * g;
    };
    if (vec) {
      const uint4* rv = reinterpret_cast<const uint4*>(row);
      uint4* ov = reinterpret_cast<uint4*>(out);
      for (int64_t v = threadIdx.x; v < V / W; v += blockDim.x) {
        const uint4 raw = rv[v];
        uint4 res;
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const T e = store_as<T>(grad(v * W + j, load_as<A>(vec_elem<T>(raw, j))));
          memcpy(reinterpret_cast<char*>(&res) + j * sizeof(T), &e, sizeof(T));
        }
        ov[v] = res;
      }
    } else {
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) out[j] = store_as<T>(grad(j, load_as<A>(row[j])));
    }
  }
}

// Threads per row: enough 16-byte loads in flight for long rows, few idle threads for short ones.
int threads_for(int64_t V, int W) {
  const int64_t vectors = (V + W - 1) / W;
  if (vectors >= 2048) return 512;
  if (vectors >= 512) return 256;
  return 128;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void CudaBackend::cross_entropy(const Tensor& loss, const Tensor& lse, const Tensor& logits, const Tensor& target,
                                int64_t ignore_index, double label_smoothing) {
  const int64_t N = logits.size(0), V = logits.size(1);
  if (N == 0) return;
  DeviceGuard guard(device());
  dispatch_floating(logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = compute_t<T>;
    constexpr int W = vec_width<T>();
    const bool vec = V % W == 0 && aligned16(logits.data_ptr());
    const int threads = threads_for(V, W);
    const unsigned blocks = static_cast<unsigned>(N < (1 << 20) ? N : (1 << 20));
    cross_entropy_kernel<T><<<blocks, threads, 0, stream()>>>(
        static_cast<const T*>(logits.data_ptr()), static_cast<const int64_t*>(target.data_ptr()),
        static_cast<A*>(loss.data_ptr()), static_cast<A*>(lse.data_ptr()), N, V, ignore_index, label_smoothing, vec,
        error_record());
    FLAME_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::cross_entropy_backward(const Tensor& grad_logits, const Tensor& grad_loss, const Tensor& logits,
                                         const Tensor& target, const Tensor& lse, int64_t ignore_index,
                                         double label_smoothing) {
  const int64_t N = logits.size(0), V = logits.size(1);
  if (N == 0) return;
  DeviceGuard guard(device());
  dispatch_floating(logits.dtype(), "cross_entropy_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = compute_t<T>;
    constexpr int W = vec_width<T>();
    const bool vec = V % W == 0 && aligned16(logits.data_ptr()) && aligned16(grad_logits.data_ptr());
    const int threads = threads_for(V, W);
    const unsigned blocks = static_cast<unsigned>(N < (1 << 20) ? N : (1 << 20));
    cross_entropy_backward_kernel<T><<<blocks, threads, 0, stream()>>>(
        static_cast<T*>(grad_logits.data_ptr()), static_cast<const A*>(grad_loss.data_ptr()),
        static_cast<const T*>(logits.data_ptr()), static_cast<const int64_t*>(target.data_ptr()),
        static_cast<const A*>(lse.data_ptr()), N, V, ignore_index, label_smoothing, vec);
    FLAME_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace flame::backend::cuda
