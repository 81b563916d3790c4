#pragma once
// Device building blocks shared by the CUDA kernel families (reductions, cumsum, softmax, and the
// kernels that come next): element conversions to and from the compute type, 16-byte vector
// packs, warp shuffles, warp/block reductions over a combine functor, row all-reductions, and the
// online-softmax (max, sum) state and its merge.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "src/backend/cuda/common.cuh"
#include "src/core/dispatch.h"
#include "src/opdef/scalar_math.h"

namespace flame::backend::cuda {

// ---- element conversions and vector packs ----

// Device conversions, bit-identical to flame::convert with hardware rounding: the one place a
// CUDA kernel rounds to bf16/f16 (elementwise, copies, random, reductions, softmax).
template <class T>
inline constexpr bool is_half_v = std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;

__device__ __forceinline__ float half_to_float(bfloat16 v) {
  return __uint_as_float(static_cast<uint32_t>(v.bits) << 16);
}
__device__ __forceinline__ float half_to_float(float16 v) { return __half2float(__ushort_as_half(v.bits)); }

template <class H>
__device__ __forceinline__ H float_to_half(float f) {
  if constexpr (std::is_same_v<H, bfloat16>) {
    return bfloat16::from_bits(__bfloat16_as_ushort(__float2bfloat16_rn(f)));
  } else {
    return float16::from_bits(__half_as_ushort(__float2half_rn(f)));
  }
}

// The 8-bit float storage types (Note [Float8 dtypes]): through float, with the formats' own
// rounding (flame/float8.h's encoder, the CPU reference's).
template <class T>
inline constexpr bool is_float8_v = std::is_same_v<T, float8_e4m3fn> || std::is_same_v<T, float8_e5m2>;

// As flame::convert: half and 8-bit float types go through float, bool is v != 0, the rest
// static_cast.
template <class To, class From>
__device__ __forceinline__ To dconvert(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (is_float8_v<From>) {
    return dconvert<To>(static_cast<float>(v));
  } else if constexpr (is_float8_v<To>) {
    return To(dconvert<float>(v));
  } else if constexpr (is_half_v<From>) {
    return dconvert<To>(half_to_float(v));
  } else if constexpr (std::is_same_v<To, bool>) {
    return v != From(0);
  } else if constexpr (is_half_v<To>) {
    return float_to_half<To>(static_cast<float>(v));
  } else if constexpr (std::is_integral_v<To> && std::is_floating_point_v<From>) {
    // Saturating, NaN -> 0 (Note [Defined integer math]): the hardware conversion turns NaN into
    // the integer minimum and narrow types may wrap.
    return ::flame::convert<To>(v);
  } else {
    return static_cast<To>(v);
  }
}

// Element -> compute type and compute type -> element (the reduction kernels' names for dconvert).
template <class C, class T>
__device__ __forceinline__ C load_as(T x) {
  return dconvert<C>(x);
}
template <class T, class V>
__device__ __forceinline__ T store_as(V v) {
  return dconvert<T>(v);
}
// Stores v into element i of a tensor of runtime dtype dt (used once per output element).
template <class V>
__device__ __forceinline__ void store_dyn(void* base, int64_t i, DType dt, V v) {
  switch (dt) {
    case DType::f32: static_cast<float*>(base)[i] = store_as<float>(v); break;
    case DType::f64: static_cast<double*>(base)[i] = store_as<double>(v); break;
    case DType::bf16: static_cast<bfloat16*>(base)[i] = store_as<bfloat16>(v); break;
    case DType::f16: static_cast<float16*>(base)[i] = store_as<float16>(v); break;
    case DType::i32: static_cast<int32_t*>(base)[i] = store_as<int32_t>(v); break;
    case DType::i64: static_cast<int64_t*>(base)[i] = store_as<int64_t>(v); break;
    case DType::u8: static_cast<uint8_t*>(base)[i] = store_as<uint8_t>(v); break;
    case DType::boolean: static_cast<bool*>(base)[i] = store_as<bool>(v); break;
    default: break;  // 8-bit floats: no kernel stores them through here (Note [Float8 dtypes])
  }
}

template <class T>
constexpr int vec_width() {
  return sizeof(T) <= 16 ? static_cast<int>(16 / sizeof(T)) : 1;
}
// Element j of a 16-byte vector loaded as uint4.
template <class T>
__device__ __forceinline__ T vec_elem(const uint4& raw, int j) {
  T t;
  memcpy(&t, reinterpret_cast<const char*>(&raw) + j * sizeof(T), sizeof(T));
  return t;
}
// Elements from p to the next 16-byte boundary (p is aligned to sizeof(T)).
template <class T>
__device__ __forceinline__ int64_t head_to_align(const T* p) {
  return static_cast<int64_t>(((16u - (reinterpret_cast<uintptr_t>(p) & 15u)) & 15u) / sizeof(T));
}

__device__ __forceinline__ float shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ double shfl_xor(double v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ int shfl_xor(int v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ int64_t shfl_xor(int64_t v, int m) {
  return static_cast<int64_t>(__shfl_xor_sync(0xffffffffu, static_cast<long long>(v), m));
}

template <class C>
__device__ __forceinline__ bool is_nan(C v) {
  if constexpr (std::is_floating_point_v<C>) return v != v;
  else return false;
}
template <class C>
__device__ __forceinline__ C lowest() {
  if constexpr (std::is_floating_point_v<C>) return -static_cast<C>(INFINITY);
  else return LLONG_MIN;
}
template <class C>
__device__ __forceinline__ C highest() {
  if constexpr (std::is_floating_point_v<C>) return static_cast<C>(INFINITY);
  else return LLONG_MAX;
}
__device__ __forceinline__ int64_t wrap_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}
__device__ __forceinline__ int64_t wrap_mul(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
}

// ---- warp and block reductions; R has Acc, identity() and combine(a, b) ----

template <class R, class Acc>
__device__ __forceinline__ Acc warp_reduce(Acc a) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) a = R::combine(a, shfl_xor(a, m));
  return a;
}

// Block-wide reduction of one value per thread (1-d block, blockDim.x a multiple of 32). The
// result is valid in thread 0. `smem` holds 32 accumulators; safe to call repeatedly.
template <class R, class Acc>
__device__ __forceinline__ Acc block_reduce(Acc a, Acc* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  a = warp_reduce<R>(a);
  __syncthreads();  // smem may still be read by the previous call
  if (lane == 0) smem[warp] = a;
  __syncthreads();
  if (warp == 0) {
    a = lane < nwarps ? smem[lane] : R::identity();
    a = warp_reduce<R>(a);
  }
  return a;
}

// ---- row all-reductions and the online softmax state ----

// Online softmax state: running max m and sum of exp(x - m).
template <class A>
struct MaxSum {
  A m, s;
};
template <class A>
__device__ __forceinline__ MaxSum<A> ms_merge(MaxSum<A> a, MaxSum<A> b) {
  const A m = (a.m != a.m || b.m != b.m) ? (a.m != a.m ? a.m : b.m) : (a.m > b.m ? a.m : b.m);
  if (m == -static_cast<A>(INFINITY)) return {m, A(0)};  // both empty or all -inf so far
  return {m, a.s * math::exp(a.m - m) + b.s * math::exp(b.m - m)};
}
// One element, one exp: a new max rescales the sum. (x - x) is nan for x = +inf, so an infinite
// element poisons the sum as exp(inf - inf) does in the CPU reference; -inf adds nothing.
template <class A>
__device__ __forceinline__ MaxSum<A> ms_add(MaxSum<A> a, A x) {
  if (x > a.m) {
    a.s = a.s * math::exp(a.m - x) + (A(1) + (x - x));
    a.m = x;
  } else if (x != -static_cast<A>(INFINITY)) {
    a.s += math::exp(x - a.m);  // nan x gives a nan sum
  }
  return a;
}

template <class A>
__device__ __forceinline__ A nan_max(A a, A b) {
  if (a != a) return a;
  if (b != b) return b;
  return a > b ? a : b;
}

struct MaxOpF {
  template <class A>
  static __device__ __forceinline__ A combine(A a, A b) { return nan_max(a, b); }
};
struct SumOpF {
  template <class A>
  static __device__ __forceinline__ A combine(A a, A b) { return a + b; }
};

// Reduction over the kTPR threads of a row (kTPR <= 32: shuffles; else shared memory; one row per
// block then). `smem` has 32 entries.
template <int kTPR, class Op, class A>
__device__ __forceinline__ A row_allreduce(A v, A* smem) {
  constexpr int width = kTPR < 32 ? kTPR : 32;
#pragma unroll
  for (int m = width / 2; m > 0; m >>= 1) v = Op::combine(v, __shfl_xor_sync(0xffffffffu, v, m));
  if constexpr (kTPR > 32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first = (threadIdx.x / kTPR) * (kTPR / 32);  // this row's first warp
    __syncthreads();
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    v = smem[first];
    for (int w = 1; w < kTPR / 32; ++w) v = Op::combine(v, smem[first + w]);
  }
  return v;
}


}  // namespace flame::backend::cuda
