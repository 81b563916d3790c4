// Elementwise families of the CUDA backend: copy (with dtype conversion), fill, iota and where
// here; unary in elementwise_unary*.cu and binary in elementwise_binary.cu (split so that the
// ~1300 kernel instantiations compile in parallel). Each is an Op functor run by the generic kernels of elementwise.cuh
// (Note [Elementwise kernels]); the math is the shared functors of src/opdef/scalar_math.h, picked
// through the op lists of src/opdef/op_list.h, so results match the CPU reference
// (src/backend/cpu/cpu_elementwise.cpp) element for element up to float rounding.
#include <cstring>

#include "src/backend/cuda/elementwise.cuh"

namespace flame::backend::cuda {

int sm_count(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  if (device < 0 || device >= 64) device = 0;
  int v = cache[device].load(std::memory_order_relaxed);
  if (v == 0) {
    FLAME_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device));
    cache[device].store(v, std::memory_order_relaxed);
  }
  return v;
}

namespace ew {

unsigned int max_blocks(int device) {
  constexpr int kBlocksPerSm = 2048 / kThreads;  // resident blocks per SM at full occupancy
  return static_cast<unsigned int>(sm_count(device) * kBlocksPerSm * kStridedWaves);
}

namespace {

// ---- Op functors (see Note [Elementwise kernels] for the calling convention) ----

template <class D, class S>
struct CopyOp {
  __device__ __forceinline__ D operator()(int64_t, S x) const { return dconvert<D>(x); }
};

template <class T>
struct FillOp {
  T value;
  __device__ __forceinline__ T operator()(int64_t) const { return value; }
};

template <class T>
struct IotaOp {
  double start, step;
  // No FMA contraction: start + i*step rounds exactly as on the CPU.
  __device__ __forceinline__ T operator()(int64_t i) const {
    return dconvert<T>(__dadd_rn(start, __dmul_rn(static_cast<double>(i), step)));
  }
};

template <class T>
struct WhereOp {
  __device__ __forceinline__ T operator()(int64_t, bool c, T a, T b) const { return c ? a : b; }
};

}  // namespace
}  // namespace ew

using namespace ew;

void CudaBackend::copy(const Tensor& dst, const Tensor& src) {
  FLAME_CHECK(dst.sizes() == src.sizes(), "cuda copy", "shapes ", dst.sizes(), " and ", src.sizes(), " differ");
  if (tiled_copy(*this, dst, src)) return;  // transposes: Note [Tiled copy] in copy_tiled.cu
  if (dst.dtype() == src.dtype()) {
    dispatch_by_size(dtype_size(dst.dtype()), "cuda copy", [&](auto tag) {
      using U = typename decltype(tag)::type;
      launch_elementwise<1, U, U, NoArg, NoArg>(*this, dst, {&src}, CopyOp<U, U>{});
    });
    return;
  }
  dispatch_storage_dtype(dst.dtype(), "cuda copy", [&](auto dtag) {
    using D = typename decltype(dtag)::type;
    dispatch_storage_dtype(src.dtype(), "cuda copy", [&](auto stag) {
      using S = typename decltype(stag)::type;
      if constexpr (!std::is_same_v<D, S>) {
        launch_elementwise<1, D, S, NoArg, NoArg>(*this, dst, {&src}, CopyOp<D, S>{});
      }
    });
  });
}

void CudaBackend::fill(const Tensor& dst, Scalar value) {
  dispatch_storage_dtype(dst.dtype(), "cuda fill", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using U = bits_t<T>;
    T v;
    if constexpr (std::is_integral_v<T>) {
      v = convert<T>(value.to_int());
    } else {
      v = convert<T>(value.to_double());
    }
    U bits;
    std::memcpy(&bits, &v, sizeof(U));
    launch_elementwise<0, U, NoArg, NoArg, NoArg>(*this, dst, {}, FillOp<U>{bits});
  });
}

void CudaBackend::iota(const Tensor& dst, double start, double step) {
  dispatch_dtype(dst.dtype(), "cuda iota", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_elementwise<0, T, NoArg, NoArg, NoArg>(*this, dst, {}, IotaOp<T>{start, step});
  });
}

void CudaBackend::where(const Tensor& dst, const Tensor& cond, const Tensor& a, const Tensor& b) {
  FLAME_CHECK(cond.dtype() == DType::boolean, "cuda where", "condition must be bool, got ", dtype_name(cond.dtype()));
  FLAME_CHECK(a.dtype() == dst.dtype() && b.dtype() == dst.dtype(), "cuda where", "operands must have the output's dtype ",
              dtype_name(dst.dtype()), ", got ", dtype_name(a.dtype()), " and ", dtype_name(b.dtype()));
  dispatch_by_size(dtype_size(dst.dtype()), "cuda where", [&](auto tag) {
    using U = typename decltype(tag)::type;
    launch_elementwise<3, U, bool, U, U>(*this, dst, {&cond, &a, &b}, WhereOp<U>{});
  });
}

}  // namespace flame::backend::cuda
