// CUDA fused unscale of the GradScaler (Backend::amp_unscale): one launch handles up to
// kMaxTensors gradients of one dtype. blockIdx.y picks the tensor, blocks along x stride over its
// elements (16-byte vectors when the pointer and size allow), each element is read once, checked
// for Inf/NaN and written back times inv_scale. A block that saw a non-finite value sets
// *found_inf = 1 (every writer stores the same value, so no atomics); the flag stays on the
// device: the scaler reads it in step(), the documented synchronisation point.
#include <algorithm>
#include <vector>

#include "src/backend/fused/multi_tensor.h"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"

namespace flame::backend::cuda {
namespace {

constexpr int kMaxTensors = 64;  // 64 * 16 bytes of pointers and sizes: well inside 4 KB of arguments
constexpr int kThreads = 256;

template <class T>
struct UnscaleArgs {
  T* ptr[kMaxTensors];
  int64_t n[kMaxTensors];
};

// Inf - Inf and NaN - NaN are NaN; finite - itself is 0.
template <class A>
__device__ __forceinline__ bool not_finite(A v) {
  return !(v - v == A(0));
}

template <class T>
__global__ void amp_unscale_kernel(UnscaleArgs<T> args, compute_t<T> inv, float* __restrict__ found_inf) {
  using A = compute_t<T>;
  T* __restrict__ p = args.ptr[blockIdx.y];
  const int64_t n = args.n[blockIdx.y];
  constexpr int W = 16 / sizeof(T);
  bool bad = false;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail = 0;
  if (reinterpret_cast<uintptr_t>(p) % 16 == 0) {
    uint4* pv = reinterpret_cast<uint4*>(p);
    const int64_t nv = n / W;
    for (int64_t i = first; i < nv; i += stride) {
      uint4 raw = pv[i];
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const A v = load_as<A>(e[j]);
        bad |= not_finite(v);
        e[j] = store_as<T>(v * inv);
      }
      pv[i] = raw;
    }
    tail = nv * W;
  }
  for (int64_t i = tail + first; i < n; i += stride) {
    const A v = load_as<A>(p[i]);
    bad |= not_finite(v);
    p[i] = store_as<T>(v * inv);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
}

}  // namespace

static void amp_unscale_cuda(const TensorList& grads, double inv_scale, const Tensor& found_inf) {
  CudaBackend& be = cuda_backend(found_inf.device().index);
  DeviceGuard guard(be.device());
  float* found = static_cast<float*>(found_inf.data_ptr());
  const int64_t max_blocks_x = std::max<int64_t>(1, 4 * sm_count(be.device()));
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    std::vector<const Tensor*> list;
    for (const Tensor& g : grads) {
      if (g.dtype() == dt && g.numel() > 0) list.push_back(&g);
    }
    if (list.empty()) continue;
    dispatch_floating(dt, "amp_unscale", [&](auto tag) {
      using T = typename decltype(tag)::type;
      using A = compute_t<T>;
      for (std::size_t begin = 0; begin < list.size(); begin += kMaxTensors) {
        const std::size_t count = std::min<std::size_t>(kMaxTensors, list.size() - begin);
        UnscaleArgs<T> args{};
        int64_t largest = 0;
        for (std::size_t i = 0; i < count; ++i) {
          const Tensor& g = *list[begin + i];
          args.ptr[i] = static_cast<T*>(g.data_ptr());
          args.n[i] = g.numel();
          largest = std::max(largest, g.numel());
        }
        // Enough blocks for the largest tensor at one 16-byte vector per thread, capped: the
        // blocks of smaller tensors past their end return at once.
        const int64_t per_block = static_cast<int64_t>(kThreads) * (16 / static_cast<int64_t>(sizeof(T)));
        const int64_t bx = std::min(max_blocks_x, (largest + per_block - 1) / per_block);
        const dim3 grid(static_cast<unsigned>(bx), static_cast<unsigned>(count));
        amp_unscale_kernel<T><<<grid, kThreads, 0, be.stream()>>>(args, static_cast<A>(inv_scale), found);
        FLAME_CUDA_CHECK_LAUNCH();
      }
    });
  }
}

void register_amp_kernels() {
  fused::amp_unscale.define(DeviceType::cuda, &amp_unscale_cuda);
}

}  // namespace flame::backend::cuda
