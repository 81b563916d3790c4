// Random tensors on the GPU: the same Philox stream as the CPU reference (src/random/philox.h,
// cpu_elementwise.cpp). Element i of the contiguous dst gets philox::generate(seed, i, offset),
// mapped to the distribution exactly as on the CPU, so one seed gives the same tensor on either
// device: integers bit for bit, uniform samples bit for bit (no FMA contraction below), normal
// samples to a few ulps (the device's logf/cosf differ from the host's by ulps).
// Under graph capture the seed and offset are read from device memory at run time
// (Note [Graph-safe RNG], src/backend/graph_rng.h): `state` points to a (seed, offset) pair and the
// draw uses offset state[1] + offset; eager launches pass state = nullptr.
#include "src/backend/cuda/elementwise.cuh"
#include "src/random/philox.h"

namespace flame::backend::cuda {
namespace {

// Philox is compute-bound: a grid of 4 resident waves (ew::max_blocks) measured 35% faster on H100
// than one thread per element for rand f32.
constexpr int kRandomThreads = 256;

// a + u * s rounded as two separate operations, like the CPU's (no fused multiply-add).
__device__ __forceinline__ float add_mul_rn(float a, float u, float s) { return __fadd_rn(a, __fmul_rn(u, s)); }
__device__ __forceinline__ double add_mul_rn(double a, double u, double s) { return __dadd_rn(a, __dmul_rn(u, s)); }

template <class T, RandomKind K>
__global__ void __launch_bounds__(kRandomThreads)
    random_kernel(T* dst, uint64_t n, uint64_t seed, uint64_t offset, const uint64_t* state, double a, double b) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  if (state != nullptr) {
    seed = state[0];
    offset += state[1];
  }
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * kRandomThreads;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * kRandomThreads + threadIdx.x; i < n; i += step) {
    const philox::Words w = philox::generate(seed, i, offset);
    if constexpr (K == RandomKind::integer) {
      dst[i] = ew::dconvert<T>(philox::integer(w, static_cast<int64_t>(a), static_cast<int64_t>(b)));
    } else if constexpr (K == RandomKind::uniform) {
      dst[i] = ew::dconvert<T>(add_mul_rn(static_cast<C>(a), philox::uniform01<C>(w), static_cast<C>(b - a)));
    } else {
      dst[i] = ew::dconvert<T>(add_mul_rn(static_cast<C>(a), philox::normal<C>(w), static_cast<C>(b)));
    }
  }
}

template <class T, RandomKind K>
void launch_random(CudaBackend& be, const Tensor& dst, uint64_t seed, uint64_t offset, const uint64_t* state, double a,
                   double b) {
  const int64_t n = dst.numel();
  const unsigned int blocks = blocks_for(n, kRandomThreads, ew::max_blocks(be.device()));
  random_kernel<T, K><<<blocks, kRandomThreads, 0, be.stream()>>>(static_cast<T*>(dst.data_ptr()),
                                                                   static_cast<uint64_t>(n), seed, offset, state, a, b);
  FLAME_CUDA_CHECK_LAUNCH();
}

}  // namespace

void CudaBackend::random(RandomKind kind, const Tensor& dst, uint64_t seed, uint64_t offset, double a, double b) {
  random_impl(kind, dst, seed, offset, nullptr, a, b);
}

void CudaBackend::random_from_device_state(RandomKind kind, const Tensor& dst, const uint64_t* state,
                                           uint64_t relative_offset, double a, double b) {
  FLAME_CHECK(state != nullptr, "cuda random", "no device Philox state given");
  random_impl(kind, dst, 0, relative_offset, state, a, b);
}

void CudaBackend::random_impl(RandomKind kind, const Tensor& dst, uint64_t seed, uint64_t offset,
                              const uint64_t* state, double a, double b) {
  if (dst.numel() == 0) return;
  FLAME_CHECK(dst.is_contiguous(), "cuda random", "destination must be contiguous (shape ", dst.sizes(), ")");
  DeviceGuard guard(device_);
  if (kind == RandomKind::integer) {
    dispatch_dtype(dst.dtype(), "cuda random", [&](auto tag) {
      launch_random<typename decltype(tag)::type, RandomKind::integer>(*this, dst, seed, offset, state, a, b);
    });
  } else if (kind == RandomKind::uniform) {
    dispatch_floating(dst.dtype(), "cuda random", [&](auto tag) {
      launch_random<typename decltype(tag)::type, RandomKind::uniform>(*this, dst, seed, offset, state, a, b);
    });
  } else {
    dispatch_floating(dst.dtype(), "cuda random", [&](auto tag) {
      launch_random<typename decltype(tag)::type, RandomKind::normal>(*this, dst, seed, offset, state, a, b);
    });
  }
}

}  // namespace flame::backend::cuda
