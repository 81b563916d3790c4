#pragma once
// CUDA kernels of the normalisation family (Note [CUDA norm kernels]); layouts and dtypes as in
// Note [Norm kernels] (src/ops/norm.cpp). Instantiated per dtype in norm_rows*.cu (layer_norm,
// rms_norm) and norm_channels.cu (group_norm, batch_norm) so that they compile in parallel.
//
// Note [CUDA norm kernels]
// Rows (layer_norm, rms_norm), x [rows, cols] contiguous:
//  - forward: rows that fit in registers (up to 32 values per thread, 1024 threads per row) are
//    read once with 16-byte vectors when every pointer is aligned and cols % W == 0; kTPR
//    threads per row (a warp for short rows, a block for long ones, several rows per block when
//    kTPR < 128); mean, then the centred variance, from the registers (two exact passes, one
//    read); one write of y, plus mean/rstd for the backward. Longer rows: a block per row with
//    three passes over global memory.
//  - backward: the same geometry with at most 8 values per thread (x and dy both live in
//    registers, plus the weight/bias gradient accumulators). Each thread owns fixed columns of
//    every row it visits, so it accumulates dy*xhat and dy for them in registers over all its
//    rows; a block adds its rows' accumulators in shared memory and writes one partial row;
//    a second kernel sums the partial rows per column (two stages, no global atomics).
//    Longer rows: dx by a block per row, the parameter gradients by a column kernel.
// Channels (group_norm, batch_norm), x [N, C, S] contiguous: a block per (n, group) or per
// channel. GroupNorm's statistics are one pass of shifted sums (sum of x - K and its square, K
// the group's first value: no cancellation for data whose mean is far from 0), then a second
// read (mostly from L2) writes y. Its backward reduces per channel inside the block, writes
// per-(n, c) partials and sums them over n with the same column kernel. BatchNorm: a block per
// channel, two exact passes for the statistics, an elementwise apply, and a backward block per
// channel that writes the channel's weight/bias gradient itself.
#include <cstdint>

#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/backend/cuda/launch_geometry.cuh"

namespace flame::backend::cuda::norm {

// Sum with an identity, for block_reduce.
template <class A>
struct NormSum {
  static __device__ __forceinline__ A identity() { return A(0); }
  static __device__ __forceinline__ A combine(A a, A b) { return a + b; }
};

template <class A>
__device__ __forceinline__ A rsqrt_acc(A v) {
  return A(1) / math::sqrt(v);
}

// Loads W elements at p (a 16-byte vector when W > 1) into compute precision.
template <class T, int W, class A>
__device__ __forceinline__ void load_vec(const T* p, A (&out)[W]) {
  if constexpr (W > 1) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
#pragma unroll
    for (int j = 0; j < W; ++j) out[j] = load_as<A>(vec_elem<T>(v, j));
  } else {
    out[0] = load_as<A>(p[0]);
  }
}
template <class T, int W, class A>
__device__ __forceinline__ void store_vec(T* p, const A (&in)[W]) {
  if constexpr (W > 1) {
    uint4 v;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const T e = store_as<T>(in[j]);
      memcpy(reinterpret_cast<char*>(&v) + j * sizeof(T), &e, sizeof(T));
    }
    *reinterpret_cast<uint4*>(p) = v;
  } else {
    p[0] = store_as<T>(in[0]);
  }
}

template <int kTPR>
constexpr int rows_block() {
  return kTPR < 128 ? 128 : kTPR;
}

// ---- rows forward ----
template <class T, int W, int kVPT, int kTPR, bool kRms>
__global__ void __launch_bounds__(rows_block<kTPR>())
    rows_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
                        compute_t<T>* __restrict__ mean_out, compute_t<T>* __restrict__ rstd_out, int64_t rows,
                        int64_t cols, compute_t<T> eps) {
  using A = compute_t<T>;
  constexpr int kBlock = rows_block<kTPR>();
  constexpr int kRowsPerBlock = kBlock / kTPR;
  __shared__ A smem[32];
  const int t = threadIdx.x % kTPR;
  const A inv_cols = A(1) / static_cast<A>(cols);
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; row0 < rows;
       row0 += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t row = row0 + threadIdx.x / kTPR;
    const bool valid = row < rows;  // uniform per row's threads; all threads reach the reductions
    const T* p = x + (valid ? row : 0) * cols;
    A v[kVPT][W];
    bool in[kVPT];
    A s = A(0);
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      const int64_t e = (static_cast<int64_t>(k) * kTPR + t) * W;
      in[k] = valid && e < cols;
      if (in[k]) {
        load_vec<T, W>(p + e, v[k]);
#pragma unroll
        for (int j = 0; j < W; ++j) s += v[k][j];
      }
    }
    A m = A(0);
    if constexpr (!kRms) m = row_allreduce<kTPR, SumOpF>(s, smem) * inv_cols;
    A q = A(0);
#pragma unroll
    for (int k = 0; k < kVPT; ++k)
      if (in[k])
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const A d = v[k][j] - m;
          q += d * d;
        }
    q = row_allreduce<kTPR, SumOpF>(q, smem);
    const A rs = rsqrt_acc(q * inv_cols + eps);
    if (!valid) continue;
    if (t == 0) {
      if constexpr (!kRms) mean_out[row] = m;
      rstd_out[row] = rs;
    }
    T* out = y + row * cols;
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      if (!in[k]) continue;
      const int64_t e = (static_cast<int64_t>(k) * kTPR + t) * W;
      A wv[W], bv[W];
      if (w) load_vec<T, W>(w + e, wv);
      if (b) load_vec<T, W>(b + e, bv);
      A o[W];
#pragma unroll
      for (int j = 0; j < W; ++j) {
        A r = (v[k][j] - m) * rs;
        if (w) r *= wv[j];
        if (b) r += bv[j];
        o[j] = r;
      }
      store_vec<T, W>(out + e, o);
    }
  }
}

// Rows too long for registers: a block per row, three passes over global memory.
template <class T, bool kRms>
__global__ void __launch_bounds__(1024)
    rows_forward_long_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                             T* __restrict__ y, compute_t<T>* __restrict__ mean_out,
                             compute_t<T>* __restrict__ rstd_out, int64_t rows, int64_t cols, compute_t<T> eps) {
  using A = compute_t<T>;
  __shared__ A smem[32];
  __shared__ A bcast;
  const A inv_cols = A(1) / static_cast<A>(cols);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* p = x + row * cols;
    A m = A(0);
    if constexpr (!kRms) {
      A s = A(0);
      for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) s += load_as<A>(p[i]);
      s = block_reduce<NormSum<A>>(s, smem);
      if (threadIdx.x == 0) bcast = s * inv_cols;
      __syncthreads();
      m = bcast;
    }
    A q = A(0);
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
      const A d = load_as<A>(p[i]) - m;
      q += d * d;
    }
    q = block_reduce<NormSum<A>>(q, smem);
    if (threadIdx.x == 0) {
      bcast = rsqrt_acc(q * inv_cols + eps);
      if constexpr (!kRms) mean_out[row] = m;
      rstd_out[row] = bcast;
    }
    __syncthreads();
    const A rs = bcast;
    T* out = y + row * cols;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
      A r = (load_as<A>(p[i]) - m) * rs;
      if (w) r *= load_as<A>(w[i]);
      if (b) r += load_as<A>(b[i]);
      out[i] = store_as<T>(r);
    }
    __syncthreads();  // bcast is rewritten by the next row
  }
}

// ---- rows backward ----
// Short rows share 512-thread blocks: the grid is the resident blocks (every block writes one
// partial row), so bigger blocks mean fewer partial rows for the second stage to sum.
template <int kTPR>
constexpr int rows_bwd_block() {
  return kTPR < 256 ? 512 : kTPR;
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w (mean(g) term dropped for rms).
// part_w/part_b (null when not wanted): [gridDim.x, cols] partial sums of dy * xhat and dy.
template <class T, int W, int kVPT, int kTPR, bool kRms>
__global__ void __launch_bounds__(rows_bwd_block<kTPR>())
    rows_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, const compute_t<T>* __restrict__ mean,
                         const compute_t<T>* __restrict__ rstd, const T* __restrict__ w, T* __restrict__ dx,
                         compute_t<T>* __restrict__ part_w, compute_t<T>* __restrict__ part_b, int64_t rows,
                         int64_t cols) {
  using A = compute_t<T>;
  constexpr int kBlock = rows_bwd_block<kTPR>();
  constexpr int kRowsPerBlock = kBlock / kTPR;
  __shared__ A smem[32];
  extern __shared__ __align__(16) unsigned char dyn_smem[];  // [2][cols] when several rows share the block
  A* acc_smem = reinterpret_cast<A*>(dyn_smem);
  const int t = threadIdx.x % kTPR;
  const bool want_params = part_w != nullptr;
  const A inv_cols = A(1) / static_cast<A>(cols);
  A aw[kVPT][W], ab[kVPT][W];
#pragma unroll
  for (int k = 0; k < kVPT; ++k)
#pragma unroll
    for (int j = 0; j < W; ++j) aw[k][j] = ab[k][j] = A(0);
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; row0 < rows;
       row0 += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t row = row0 + threadIdx.x / kTPR;
    const bool valid = row < rows;
    const int64_t r = valid ? row : 0;
    const A m = kRms ? A(0) : mean[r], rs = rstd[r];
    A xv[kVPT][W], gv[kVPT][W];
    bool in[kVPT];
    A sg = A(0), sgx = A(0);
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      const int64_t e = (static_cast<int64_t>(k) * kTPR + t) * W;
      in[k] = valid && e < cols;
      if (!in[k]) continue;
      A dv[W], wv[W];
      load_vec<T, W>(x + r * cols + e, xv[k]);
      load_vec<T, W>(dy + r * cols + e, dv);
      if (w) load_vec<T, W>(w + e, wv);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const A xh = (xv[k][j] - m) * rs;
        xv[k][j] = xh;
        aw[k][j] += dv[j] * xh;
        ab[k][j] += dv[j];
        const A g = w ? dv[j] * wv[j] : dv[j];
        gv[k][j] = g;
        sg += g;
        sgx += g * xh;
      }
    }
    if constexpr (!kRms) sg = row_allreduce<kTPR, SumOpF>(sg, smem);
    sgx = row_allreduce<kTPR, SumOpF>(sgx, smem);
    if (!valid || dx == nullptr) continue;
    const A mg = kRms ? A(0) : sg * inv_cols, mgx = sgx * inv_cols;
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      if (!in[k]) continue;
      const int64_t e = (static_cast<int64_t>(k) * kTPR + t) * W;
      A o[W];
#pragma unroll
      for (int j = 0; j < W; ++j) o[j] = rs * (gv[k][j] - mg - xv[k][j] * mgx);
      store_vec<T, W>(dx + r * cols + e, o);
    }
  }
  if (!want_params) return;
  A* pw = part_w + static_cast<int64_t>(blockIdx.x) * cols;
  A* pb = part_b + static_cast<int64_t>(blockIdx.x) * cols;
  if constexpr (kRowsPerBlock == 1) {
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      const int64_t e = (static_cast<int64_t>(k) * kTPR + t) * W;
      if (e >= cols) continue;
#pragma unroll
      for (int j = 0; j < W; ++j) {
        pw[e + j] = aw[k][j];
        pb[e + j] = ab[k][j];
      }
    }
  } else {
    // The block's row slots own the same columns: add them in shared memory (a few-way contention).
    for (int64_t i = threadIdx.x; i < 2 * cols; i += kBlock) acc_smem[i] = A(0);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      const int64_t e = (static_cast<int64_t>(k) * kTPR + t) * W;
      if (e >= cols) continue;
#pragma unroll
      for (int j = 0; j < W; ++j) {
        atomicAdd(&acc_smem[e + j], aw[k][j]);
        atomicAdd(&acc_smem[cols + e + j], ab[k][j]);
      }
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < cols; i += kBlock) {
      pw[i] = acc_smem[i];
      pb[i] = acc_smem[cols + i];
    }
  }
}

// Long rows: dx only, a block per row (the parameter gradients come from rows_param_grad_kernel).
template <class T, bool kRms>
__global__ void __launch_bounds__(1024)
    rows_backward_long_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                              const compute_t<T>* __restrict__ mean, const compute_t<T>* __restrict__ rstd,
                              const T* __restrict__ w, T* __restrict__ dx, int64_t rows, int64_t cols) {
  using A = compute_t<T>;
  __shared__ A smem[32];
  __shared__ A bc[2];
  const A inv_cols = A(1) / static_cast<A>(cols);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const A m = kRms ? A(0) : mean[row], rs = rstd[row];
    const T* xp = x + row * cols;
    const T* dp = dy + row * cols;
    A sg = A(0), sgx = A(0);
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
      const A g = w ? load_as<A>(dp[i]) * load_as<A>(w[i]) : load_as<A>(dp[i]);
      sg += g;
      sgx += g * (load_as<A>(xp[i]) - m) * rs;
    }
    sg = block_reduce<NormSum<A>>(sg, smem);
    if (threadIdx.x == 0) bc[0] = sg;
    sgx = block_reduce<NormSum<A>>(sgx, smem);
    if (threadIdx.x == 0) bc[1] = sgx;
    __syncthreads();
    const A mg = kRms ? A(0) : bc[0] * inv_cols, mgx = bc[1] * inv_cols;
    T* out = dx + row * cols;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
      const A g = w ? load_as<A>(dp[i]) * load_as<A>(w[i]) : load_as<A>(dp[i]);
      const A xh = (load_as<A>(xp[i]) - m) * rs;
      out[i] = store_as<T>(rs * (g - mg - xh * mgx));
    }
    __syncthreads();  // bc is rewritten by the next row
  }
}

// Partial parameter gradients by columns: block (32, 8) covers 32 columns and a chunk of rows;
// part_[w|b][blockIdx.y, col] = sums over the chunk of dy * xhat and dy.
template <class T, bool kRms>
__global__ void __launch_bounds__(256)
    rows_param_grad_kernel(const T* __restrict__ dy, const T* __restrict__ x, const compute_t<T>* __restrict__ mean,
                           const compute_t<T>* __restrict__ rstd, compute_t<T>* __restrict__ part_w,
                           compute_t<T>* __restrict__ part_b, int64_t rows, int64_t cols, int64_t rows_per_chunk) {
  using A = compute_t<T>;
  __shared__ A sw[8][33], sb[8][33];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  A aw = A(0), ab = A(0);
  if (col < cols) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      const A d = load_as<A>(dy[r * cols + col]);
      const A m = kRms ? A(0) : mean[r];
      aw += d * (load_as<A>(x[r * cols + col]) - m) * rstd[r];
      ab += d;
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    for (int i = 1; i < 8; ++i) {
      aw += sw[i][threadIdx.x];
      ab += sb[i][threadIdx.x];
    }
    part_w[static_cast<int64_t>(blockIdx.y) * cols + col] = aw;
    part_b[static_cast<int64_t>(blockIdx.y) * cols + col] = ab;
  }
}

// Second stage: out[col] = sum over p of part[p, col] (out may be null: not wanted).
template <class T>
__global__ void __launch_bounds__(512)
    column_sum_kernel(const compute_t<T>* __restrict__ part_w, const compute_t<T>* __restrict__ part_b,
                      T* __restrict__ out_w, T* __restrict__ out_b, int64_t parts, int64_t cols) {
  using A = compute_t<T>;
  __shared__ A sw[16][33], sb[16][33];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  A aw = A(0), ab = A(0);
  if (col < cols) {
    for (int64_t p = threadIdx.y; p < parts; p += 16) {
      aw += part_w[p * cols + col];
      ab += part_b[p * cols + col];
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    for (int i = 1; i < 16; ++i) {
      aw += sw[i][threadIdx.x];
      ab += sb[i][threadIdx.x];
    }
    if (out_w) out_w[col] = store_as<T>(aw);
    if (out_b) out_b[col] = store_as<T>(ab);
  }
}

template <class T>
void launch_norm_rows_forward(CudaBackend& be, const Tensor& y, const Tensor& mean, const Tensor& rstd,
                              const Tensor& x, const Tensor& w, const Tensor& b, double eps);
template <class T>
void launch_norm_rows_backward(CudaBackend& be, const Tensor& dx, const Tensor& dw, const Tensor& db,
                               const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                               const Tensor& w);

}  // namespace flame::backend::cuda::norm
