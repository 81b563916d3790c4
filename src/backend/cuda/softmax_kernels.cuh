#pragma once
// CUDA softmax / log_softmax kernels (Note [CUDA softmax]) and their launcher, instantiated per
// dtype in softmax.cu (f32, f64) and softmax_half.cu (bf16, f16) so that they compile in parallel.
//
// Note [CUDA softmax]
// Unit-stride rows that fit in registers (up to 16384 elements of 4 bytes or less): kTPR threads per
// row, each holding kVPT vectors of W elements (in compute precision; 2-byte types as loaded,
// packed, converted on use); one read, one write. The
// row max and the sum of exp(x - max) are reduced with shuffles (and shared memory when a row
// spans several warps). Longer rows: a block per row with an online (max, sum) pass and a
// writing pass (two reads). Rows along a strided dim: threadIdx.x runs over adjacent rows
// (coalesced), threadIdx.y splits each row; online (max, sum) pairs merge in shared memory, then
// a writing pass. Semantics follow the CPU reference: NaN anywhere gives a NaN row; a row of
// -inf gives NaN; +inf gives NaN (inf - inf).
#include <cstdint>

#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/backend/cuda/launch_geometry.cuh"

namespace flame::backend::cuda {

// Register-resident rows. W elements per vector (1 or 16/sizeof(T)); kVPT vectors per thread.
// Rows in vectors are whole vectors (len % W == 0), so a vector is either in the row or padding.
// 2-byte types keep their vectors packed as loaded (half the registers of float copies, so more
// rows fit on an SM at once) and convert on each of the three passes, computing exp twice.
template <class T, int W, int kTPR>
constexpr int softmax_min_blocks() {
  // Packed rows: 1024 threads per SM (at most 64 registers; 54 are used, no spills; asking for
  // 1280 threads made ptxas spill). Float copies of the same rows needed 74 (768 threads per SM).
  return (W > 1 && sizeof(T) == 2) ? 1024 / (kTPR < 128 ? 128 : kTPR) : 1;
}
template <class T, int W, int kVPT, int kTPR>
__global__ void __launch_bounds__(kTPR < 128 ? 128 : kTPR, (softmax_min_blocks<T, W, kTPR>())) softmax_rows_kernel(const T* __restrict__ src, OffsetMap src_rows,
                                                                              T* __restrict__ dst, OffsetMap dst_rows,
                                                                              int64_t n_rows, int64_t len, bool log) {
  using A = compute_t<T>;
  constexpr int kBlock = kTPR < 128 ? 128 : kTPR;
  constexpr int kRowsPerBlock = kBlock / kTPR;
  constexpr bool kPacked = W > 1 && sizeof(T) == 2;
  __shared__ A smem[32];
  const int t = threadIdx.x % kTPR;
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; row0 < n_rows;
       row0 += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t row = row0 + threadIdx.x / kTPR;
    const bool valid = row < n_rows;  // uniform per warp (kTPR >= 32) so shuffles stay full
    const T* p = src + (valid ? src_rows(row) : 0);
    uint4 raw[kPacked ? kVPT : 1];
    A x[kPacked ? 1 : kVPT][W];
    bool in[kVPT];
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      const int64_t e = (static_cast<int64_t>(k) * kTPR + t) * W;
      in[k] = valid && e < len;
      if constexpr (kPacked) {
        if (in[k]) raw[k] = __ldg(reinterpret_cast<const uint4*>(p + e));
      } else if (in[k]) {
        if constexpr (W > 1) {
          const uint4 v = __ldg(reinterpret_cast<const uint4*>(p + e));
#pragma unroll
          for (int j = 0; j < W; ++j) x[k][j] = load_as<A>(vec_elem<T>(v, j));
        } else {
          x[k][0] = load_as<A>(p[e]);
        }
      }
    }
    // Element j of vector k in compute precision (only for in[k]).
    auto value = [&](int k, int j) -> A {
      if constexpr (kPacked) {
        return load_as<A>(vec_elem<T>(raw[k], j));
      } else {
        return x[k][j];
      }
    };
    A m = -static_cast<A>(INFINITY);
#pragma unroll
    for (int k = 0; k < kVPT; ++k)
      if (in[k])
#pragma unroll
        for (int j = 0; j < W; ++j) m = nan_max(m, value(k, j));
    m = row_allreduce<kTPR, MaxOpF>(m, smem);
    A s = A(0);
#pragma unroll
    for (int k = 0; k < kVPT; ++k)
      if (in[k])  // padding would give nan when m is -inf
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const A ex = math::exp(value(k, j) - m);
          s += ex;
          if constexpr (!kPacked) {
            if (!log) x[k][j] = ex;
          }
        }
    s = row_allreduce<kTPR, SumOpF>(s, smem);
    const A scale = A(1) / s, log_s = math::log(s);
    if (!valid) continue;
    // The result for element j of vector k (x holds exp(x - m) already when unpacked and !log).
    auto result = [&](int k, int j) -> A {
      if (log) return value(k, j) - m - log_s;
      if constexpr (kPacked) {
        return math::exp(value(k, j) - m) * scale;
      } else {
        return x[k][j] * scale;
      }
    };
    T* q = dst + dst_rows(row);
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      if (!in[k]) continue;
      const int64_t e = (static_cast<int64_t>(k) * kTPR + t) * W;
      if constexpr (W > 1) {
        uint4 out;
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const T y = store_as<T>(result(k, j));
          memcpy(reinterpret_cast<char*>(&out) + j * sizeof(T), &y, sizeof(T));
        }
        *reinterpret_cast<uint4*>(q + e) = out;
      } else {
        q[e] = store_as<T>(result(k, 0));
      }
    }
  }
}

// Long unit-stride rows: a 1024-thread block per row, online (max, sum), then a writing pass.
template <class T>
__global__ void __launch_bounds__(1024) softmax_long_rows_kernel(const T* __restrict__ src, OffsetMap src_rows,
                                                                 T* __restrict__ dst, OffsetMap dst_rows,
                                                                 int64_t n_rows, int64_t len, bool log) {
  using A = compute_t<T>;
  __shared__ MaxSum<A> smem[32];
  for (int64_t row = blockIdx.x; row < n_rows; row += gridDim.x) {
    const T* p = src + src_rows(row);
    MaxSum<A> ms{-static_cast<A>(INFINITY), A(0)};
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) ms = ms_add(ms, load_as<A>(p[i]));
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
      MaxSum<A> o{__shfl_xor_sync(0xffffffffu, ms.m, m), __shfl_xor_sync(0xffffffffu, ms.s, m)};
      ms = ms_merge(ms, o);
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = ms;
    __syncthreads();
    ms = smem[0];
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) ms = ms_merge(ms, smem[w]);
    const A scale = A(1) / ms.s, log_s = math::log(ms.s);
    T* q = dst + dst_rows(row);
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      const A x = load_as<A>(p[i]);
      q[i] = store_as<T>(log ? x - ms.m - log_s : math::exp(x - ms.m) * scale);
    }
  }
}

// Rows along a strided dim: block (32, 8); x over rows, y splits each row.
template <class T>
__global__ void __launch_bounds__(256) softmax_strided_kernel(const T* __restrict__ src, OffsetMap src_rows,
                                                              int64_t src_stride, T* __restrict__ dst,
                                                              OffsetMap dst_rows, int64_t dst_stride, int64_t n_rows,
                                                              int64_t len, bool log) {
  using A = compute_t<T>;
  __shared__ MaxSum<A> smem[8][32];
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * 32; r0 < n_rows; r0 += static_cast<int64_t>(gridDim.x) * 32) {
    const int64_t row = r0 + tx;
    const bool valid = row < n_rows;
    const T* p = src + (valid ? src_rows(row) : 0);
    MaxSum<A> ms{-static_cast<A>(INFINITY), A(0)};
    if (valid)
      for (int64_t i = ty; i < len; i += 8) ms = ms_add(ms, load_as<A>(p[i * src_stride]));
    smem[ty][tx] = ms;
    __syncthreads();
    ms = smem[0][tx];
    for (int k = 1; k < 8; ++k) ms = ms_merge(ms, smem[k][tx]);
    __syncthreads();
    if (!valid) continue;
    const A scale = A(1) / ms.s, log_s = math::log(ms.s);
    T* q = dst + dst_rows(row);
    for (int64_t i = ty; i < len; i += 8) {
      const A x = load_as<A>(p[i * src_stride]);
      q[i * dst_stride] = store_as<T>(log ? x - ms.m - log_s : math::exp(x - ms.m) * scale);
    }
  }
}

template <class T, int W, int kVPT, int kTPR>
void launch_softmax_rows(cudaStream_t st, const T* sp, OffsetMap sr, T* dp, OffsetMap dr, int64_t n_rows, int64_t len,
                         bool log) {
  constexpr int kBlock = kTPR < 128 ? 128 : kTPR;
  softmax_rows_kernel<T, W, kVPT, kTPR><<<grid_for(n_rows, kBlock / kTPR, 1 << 20), kBlock, 0, st>>>(sp, sr, dp, dr, n_rows,
                                                                                                   len, log);
  FLAME_CUDA_CHECK_LAUNCH();
}

// Picks the smallest register-resident configuration that holds a row of `len` elements in
// vectors of W; returns false when none does.
template <class T, int W>
bool softmax_rows_dispatch(cudaStream_t st, const T* sp, OffsetMap sr, T* dp, OffsetMap dr, int64_t n_rows, int64_t len,
                           bool log) {
  const int64_t nv = ceil_div(len, W);  // vectors per row
  // At most 32 values per thread and 512 threads per row (1024-thread blocks get 64 registers
  // and spilled); a row of up to 16384 f32/bf16 elements stays in registers.
#define FLAME_SOFTMAX_CASE(VPT, TPR)                                                   \
  if constexpr (VPT * W <= 32) {                                                      \
    if (nv <= int64_t(VPT) * TPR) {                                                   \
      launch_softmax_rows<T, W, VPT, TPR>(st, sp, sr, dp, dr, n_rows, len, log);      \
      return true;                                                                    \
    }                                                                                 \
  }
  // Warps (no block barriers) while a lane's share fits: f32 [N, 1024] rose from 85% to 94% of
  // copy bandwidth with (8, 32). Blocks of fewer vectors per thread (2 x 256) were measured slower
  // for bf16 [N, 4096] (60% against 70% with 4 x 128), so they are not offered.
  FLAME_SOFTMAX_CASE(1, 32)
  FLAME_SOFTMAX_CASE(2, 32)
  FLAME_SOFTMAX_CASE(4, 32)
  FLAME_SOFTMAX_CASE(8, 32)
  FLAME_SOFTMAX_CASE(4, 128)
  FLAME_SOFTMAX_CASE(4, 256)
  FLAME_SOFTMAX_CASE(4, 512)
  FLAME_SOFTMAX_CASE(8, 512)
#undef FLAME_SOFTMAX_CASE
  return false;
}

template <class T>
void launch_softmax(CudaBackend& be, const Tensor& dst, const Tensor& src, int64_t dim, bool log) {
  const int64_t len = src.sizes()[dim];
  const int64_t n_rows = len == 0 ? 0 : src.numel() / len;
  if (n_rows == 0) return;
  const OffsetMap sr = line_map(src, dim), dr = line_map(dst, dim);
  const int64_t ss = src.strides()[dim], ds = dst.strides()[dim];
  const T* sp = static_cast<const T*>(src.data_ptr());
  T* dp = static_cast<T*>(dst.data_ptr());
  cudaStream_t st = be.stream();
  if ((ss == 1 && ds == 1) || len == 1) {
    constexpr int W = vec_width<T>();
    // Vectors need every row start 16-byte aligned in src and dst and whole vectors per row.
    auto aligned = [&](const Tensor& t, const OffsetMap& m) {
      if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
      for (int d = 0; d < m.info.ndim; ++d)
        if ((m.info.strides[d] * static_cast<int64_t>(sizeof(T))) % 16 != 0) return false;
      return true;
    };
    const bool vec = len % W == 0 && aligned(src, sr) && aligned(dst, dr) && len > 1;
    if (vec && softmax_rows_dispatch<T, W>(st, sp, sr, dp, dr, n_rows, len, log)) return;
    if (!vec && softmax_rows_dispatch<T, 1>(st, sp, sr, dp, dr, n_rows, len, log)) return;
    softmax_long_rows_kernel<T><<<grid_for(n_rows, 1, 1 << 20), 1024, 0, st>>>(sp, sr, dp, dr, n_rows, len, log);
    FLAME_CUDA_CHECK_LAUNCH();
    return;
  }
  softmax_strided_kernel<T><<<grid_for(n_rows, 32, 1 << 20), dim3(32, 8), 0, st>>>(sp, sr, ss, dp, dr, ds, n_rows, len,
                                                                                   log);
  FLAME_CUDA_CHECK_LAUNCH();
}

extern template void launch_softmax<float>(CudaBackend&, const Tensor&, const Tensor&, int64_t, bool);
extern template void launch_softmax<double>(CudaBackend&, const Tensor&, const Tensor&, int64_t, bool);
extern template void launch_softmax<bfloat16>(CudaBackend&, const Tensor&, const Tensor&, int64_t, bool);
extern template void launch_softmax<float16>(CudaBackend&, const Tensor&, const Tensor&, int64_t, bool);

}  // namespace flame::backend::cuda
