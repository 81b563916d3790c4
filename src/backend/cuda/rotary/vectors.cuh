#pragma once
// 16-byte vector loads and stores of the rotary kernels (rotary.cu, rms_norm_rotary.cu): a row's
// values widened to f32 in registers, and the f32 tables read as float4s.
#include <cstring>

#include "src/backend/cuda/device_utils.cuh"

namespace flame::backend::cuda::rotary_vec {

// N f32 values from p (16-byte aligned, N a multiple of 4) into v.
template <int N>
__device__ __forceinline__ void load_f32(float (&v)[N], const float* __restrict__ p) {
  static_assert(N % 4 == 0);
#pragma unroll
  for (int i = 0; i < N; i += 4) {
    const float4 q = *reinterpret_cast<const float4*>(p + i);
    v[i] = q.x;
    v[i + 1] = q.y;
    v[i + 2] = q.z;
    v[i + 3] = q.w;
  }
}

// One 16-byte vector of T at p (aligned) into N f32 values.
template <class T, int N>
__device__ __forceinline__ void load_vec(float (&v)[N], const T* __restrict__ p) {
  static_assert(N * sizeof(T) == 16);
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = load_as<float>(vec_elem<T>(raw, i));
}

// N f32 values rounded to T, stored as one 16-byte vector at p (aligned).
template <class T, int N>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&v)[N]) {
  static_assert(N * sizeof(T) == 16);
  uint4 raw;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const T t = store_as<T>(v[i]);
    memcpy(reinterpret_cast<char*>(&raw) + i * sizeof(T), &t, sizeof(T));
  }
  *reinterpret_cast<uint4*>(p) = raw;
}

}  // namespace flame::backend::cuda::rotary_vec
