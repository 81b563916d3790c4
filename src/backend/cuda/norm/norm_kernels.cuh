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
//    kTPR < 128); the statistics in one reduction round of shifted sums from the registers
//    (Note [Row forward statistics]); one write of y, plus mean/rstd for the backward. Longer
//    rows: a block per row with three passes over global memory (two exact rounds).
//  - backward: the same geometry with at most 8 values per thread (x and dy both live in
//    registers, plus the weight/bias gradient accumulators). Each thread owns fixed columns of
//    every row it visits, so it accumulates dy*xhat and dy for them in registers over all its
//    rows; a block adds its rows' accumulators in shared memory and writes one partial row;
//    a second kernel sums the partial rows per column (two stages, no global atomics; 8 columns
//    and 64 partial rows per block, so that the short second stage spreads over the SMs). The
//    grid gives every block the same number of row steps. The row loop is pipelined (Note [Row
//    backward pipeline]). 2-byte types with 257..1024 columns take a warp per row instead, with
//    the column accumulators in shared memory (Note [Warp row backward], norm_rows_warp.cuh).
//    Longer rows: dx by a block per row, the parameter gradients by a column kernel.
// Channels (group_norm, batch_norm), x [N, C, S] contiguous: a block per (n, group) or per
// channel. GroupNorm's statistics are one pass of shifted sums (sum of x - K and its square, K
// the group's first value: no cancellation for data whose mean is far from 0), then a second
// read (mostly from L2) writes y. Its backward reduces per channel inside the block, writes
// per-(n, c) partials and sums them over n with the same column kernel. BatchNorm: a block per
// channel, two exact passes for the statistics, an elementwise apply, and a backward block per
// channel that writes the channel's weight/bias gradient itself.
#include <cstdint>
#include <type_traits>

#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/backend/cuda/launch_geometry.cuh"

namespace flame::backend::cuda::norm {

// Launcher helpers (norm_rows_impl.cuh, norm_channels.cu): a tensor's typed data, null when it
// is not defined; whether a pointer (null: absent) allows 16-byte vectors.
template <class T>
const T* cptr(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.data_ptr()) : nullptr;
}
template <class T>
T* mptr(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data_ptr()) : nullptr;
}
inline bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

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
// Note [Row forward statistics]
// The forward is bound by how many bytes each SM has in flight; while a warp reduces, it has
// none. So a row is reduced in ONE round: layer_norm takes shifted sums s1 = sum(x - K) and
// s2 = sum((x - K)^2), K the row's first value (read by every thread, an L1 hit), shuffled
// interleaved; mean = K + s1/n, var = s2/n - (s1/n)^2 clamped at 0. The cancellation is bounded
// by how far the mean lies from K in standard deviations, which for a value of the row itself is
// small (GroupNorm's statistics do the same, Note [CUDA norm kernels]). The row stays packed as
// loaded (16-byte vectors) and is widened where used: fewer registers, more resident warps.
// Measured on an H100 ([32768, 1024] bf16): 76.7% -> 86.5% of copy bandwidth for layer_norm
// against two exact rounds from registers; two or four rows per thread in flight (more
// registers, fewer warps) and two exact rounds on packed rows were slower (docs/nn-norm.md).

// N sums at once over the kTPR threads of a row; shuffles interleaved (smem: 32 * N entries).
template <int kTPR, int N, class A>
__device__ __forceinline__ void row_allreduce_n(A (&v)[N], A* smem) {
  constexpr int width = kTPR < 32 ? kTPR : 32;
#pragma unroll
  for (int m = width / 2; m > 0; m >>= 1)
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], m);
  if constexpr (kTPR > 32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first = (threadIdx.x / kTPR) * (kTPR / 32);  // this row's first warp
    __syncthreads();  // the previous round's reads are done
    if (lane == 0)
#pragma unroll
      for (int i = 0; i < N; ++i) smem[i * 32 + warp] = v[i];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; ++i) {
      A a = smem[i * 32 + first];
#pragma unroll
      for (int w = 1; w < kTPR / 32; ++w) a += smem[i * 32 + first + w];
      v[i] = a;
    }
  }
}

template <class T, int W, int kVPT, int kTPR, bool kRms>
__global__ void __launch_bounds__(rows_block<kTPR>())
    rows_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
                        compute_t<T>* __restrict__ mean_out, compute_t<T>* __restrict__ rstd_out, int64_t rows,
                        int64_t cols, compute_t<T> eps) {
  using A = compute_t<T>;
  using Raw = std::conditional_t<(W > 1), uint4, T>;
  constexpr int kBlock = rows_block<kTPR>();
  constexpr int kRowsPerBlock = kBlock / kTPR;
  constexpr int kN = kRms ? 1 : 2;  // rms_norm: sum(x^2); layer_norm: sum(x - K), sum((x - K)^2)
  __shared__ A smem[32 * kN];
  const int t = threadIdx.x % kTPR;
  const A inv_cols = A(1) / static_cast<A>(cols);
  auto elem = [](const Raw& r, int j) -> A {
    if constexpr (W > 1) return load_as<A>(vec_elem<T>(r, j));
    else return load_as<A>(r);
  };
  bool in[kVPT];
#pragma unroll
  for (int k = 0; k < kVPT; ++k) in[k] = (static_cast<int64_t>(k) * kTPR + t) * W < cols;
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; row0 < rows;
       row0 += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t row = row0 + threadIdx.x / kTPR;
    const bool valid = row < rows;  // uniform per row's threads; all threads reach the reductions
    const T* p = x + (valid ? row : 0) * cols;
    const A shift = kRms ? A(0) : load_as<A>(p[0]);
    Raw v[kVPT];
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      if (valid && in[k]) {
        const T* q = p + (static_cast<int64_t>(k) * kTPR + t) * W;
        if constexpr (W > 1) v[k] = __ldg(reinterpret_cast<const uint4*>(q));
        else v[k] = q[0];
      }
    }
    A s[kN];
#pragma unroll
    for (int i = 0; i < kN; ++i) s[i] = A(0);
#pragma unroll
    for (int k = 0; k < kVPT; ++k)
      if (valid && in[k])
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const A d = elem(v[k], j) - shift;
          s[kN - 1] += d * d;
          if constexpr (!kRms) s[0] += d;
        }
    row_allreduce_n<kTPR>(s, smem);
    A m = A(0), var = s[kN - 1] * inv_cols;
    if constexpr (!kRms) {
      const A d = s[0] * inv_cols;
      m = shift + d;
      var -= d * d;
      var = var > A(0) ? var : A(0);
    }
    const A rs = rsqrt_acc(var + eps);
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
        A r = (elem(v[k], j) - m) * rs;
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
// 2-byte types in 16-byte vectors keep x and dy packed (Note [Row backward pipeline]): 64
// registers hold them without spilling (ptxas -v), so two 512-thread blocks stay resident per SM.
// Wider types and the scalar fallback (8 separate values per thread) need more and get no bound.
template <class T, int W, int kTPR>
constexpr int rows_bwd_min_blocks() {
  return sizeof(T) == 2 && W > 1 && rows_bwd_block<kTPR>() == 512 ? 2 : 1;
}

// Note [Row backward pipeline]
// The backward is bound by how many bytes each SM has in flight. Every row step needs a
// row-wide reduction (sum g, sum g * xhat), which, for rows wider than a warp, is a block
// barrier: without care no load is outstanding while a block waits there. So each thread
//  - keeps its row's x and dy packed as loaded (16-byte vectors: 8 registers per vector pair),
//    and issues the loads of its NEXT row before reducing the current one (a software pipeline
//    of depth 2), so the barrier wait overlaps the next row's memory latency;
//  - reduces both sums in one round (one barrier pair instead of two);
//  - loads its weights once (a thread owns fixed columns of every row it visits);
//  - recomputes xhat and g from the packed values after the reduction (cheap arithmetic instead
//    of 16 more live registers).
template <class T, int W>
struct RawVec {
  using type = std::conditional_t<(W > 1), uint4, T>;
};
template <class T, int W>
__device__ __forceinline__ typename RawVec<T, W>::type load_raw(const T* p) {
  if constexpr (W > 1) return __ldg(reinterpret_cast<const uint4*>(p));
  else return p[0];
}
template <class T, int W, class A>
__device__ __forceinline__ A raw_elem(const typename RawVec<T, W>::type& v, int j) {
  if constexpr (W > 1) return load_as<A>(vec_elem<T>(v, j));
  else return load_as<A>(v);
}

// The pipeline's next stage: row's statistics and this thread's packed x and dy (vector k at
// column (k * kTPR + t) * W, where in_cols[k]); nothing past the last row. Shared by
// rows_backward_kernel and rows_backward_warp_kernel (kTPR = 32, t = lane).
template <class T, int W, int kVPT, int kTPR, bool kRms, class A>
__device__ __forceinline__ void fetch_row(const T* x, const T* dy, const A* mean, const A* rstd, int64_t row,
                                          int64_t rows, int64_t cols, int t, const bool (&in_cols)[kVPT],
                                          typename RawVec<T, W>::type (&nx)[kVPT],
                                          typename RawVec<T, W>::type (&nd)[kVPT], A& nm, A& nrs) {
  if (row >= rows) return;
  if constexpr (!kRms) nm = mean[row];
  nrs = rstd[row];
#pragma unroll
  for (int k = 0; k < kVPT; ++k)
    if (in_cols[k]) {
      const int64_t e = row * cols + (static_cast<int64_t>(k) * kTPR + t) * W;
      nx[k] = load_raw<T, W>(x + e);
      nd[k] = load_raw<T, W>(dy + e);
    }
}

// Both row sums in one round: a and b over the kTPR threads of a row (smem: 64 entries).
template <int kTPR, class A>
__device__ __forceinline__ void row_allreduce2(A& a, A& b, A* smem) {
  constexpr int width = kTPR < 32 ? kTPR : 32;
#pragma unroll
  for (int m = width / 2; m > 0; m >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, m);
    b += __shfl_xor_sync(0xffffffffu, b, m);
  }
  if constexpr (kTPR > 32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first = (threadIdx.x / kTPR) * (kTPR / 32);  // this row's first warp
    __syncthreads();  // the previous round's reads are done
    if (lane == 0) {
      smem[warp] = a;
      smem[32 + warp] = b;
    }
    __syncthreads();
    a = smem[first];
    b = smem[32 + first];
#pragma unroll
    for (int w = 1; w < kTPR / 32; ++w) {
      a += smem[first + w];
      b += smem[32 + first + w];
    }
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w (mean(g) term dropped for rms).
// part_w/part_b (null when not wanted): [gridDim.x, cols] partial sums of dy * xhat and dy.
template <class T, int W, int kVPT, int kTPR, bool kRms>
__global__ void __launch_bounds__(rows_bwd_block<kTPR>(), (rows_bwd_min_blocks<T, W, kTPR>()))
    rows_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, const compute_t<T>* __restrict__ mean,
                         const compute_t<T>* __restrict__ rstd, const T* __restrict__ w, T* __restrict__ dx,
                         compute_t<T>* __restrict__ part_w, compute_t<T>* __restrict__ part_b, int64_t rows,
                         int64_t cols) {
  using A = compute_t<T>;
  using Raw = typename RawVec<T, W>::type;
  constexpr int kBlock = rows_bwd_block<kTPR>();
  constexpr int kRowsPerBlock = kBlock / kTPR;
  __shared__ A smem[64];
  extern __shared__ __align__(16) unsigned char dyn_smem[];  // [2][cols] when several rows share the block
  A* acc_smem = reinterpret_cast<A*>(dyn_smem);
  const int t = threadIdx.x % kTPR;
  const int slot = threadIdx.x / kTPR;
  const bool want_params = part_w != nullptr;
  const A inv_cols = A(1) / static_cast<A>(cols);
  A aw[kVPT][W], ab[kVPT][W], wv[kVPT][W];
  bool in_cols[kVPT];
#pragma unroll
  for (int k = 0; k < kVPT; ++k) {
    const int64_t e = (static_cast<int64_t>(k) * kTPR + t) * W;
    in_cols[k] = e < cols;
    if (w && in_cols[k]) load_vec<T, W>(w + e, wv[k]);
#pragma unroll
    for (int j = 0; j < W; ++j) {
      aw[k][j] = ab[k][j] = A(0);
      if (!(w && in_cols[k])) wv[k][j] = A(1);
    }
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  // Stage of the pipeline: packed x, dy and the row's statistics of the row about to be used.
  Raw nx[kVPT] = {}, nd[kVPT] = {};
  A nm = A(0), nrs = A(0);
  auto fetch = [&](int64_t row) {
    fetch_row<T, W, kVPT, kTPR, kRms>(x, dy, mean, rstd, row, rows, cols, t, in_cols, nx, nd, nm, nrs);
  };
  int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  fetch(row0 + slot);
  for (; row0 < rows; row0 += stride) {
    const int64_t row = row0 + slot;
    const bool valid = row < rows;
    Raw cx[kVPT], cd[kVPT];
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      cx[k] = nx[k];
      cd[k] = nd[k];
    }
    const A m = nm, rs = nrs;
    fetch(row + stride);  // in flight while this row is reduced
    A sg = A(0), sgx = A(0);
    if (valid) {
#pragma unroll
      for (int k = 0; k < kVPT; ++k) {
        if (!in_cols[k]) continue;
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const A d = raw_elem<T, W, A>(cd[k], j);
          const A xh = (raw_elem<T, W, A>(cx[k], j) - m) * rs;
          aw[k][j] += d * xh;
          ab[k][j] += d;
          const A g = d * wv[k][j];
          sg += g;
          sgx += g * xh;
        }
      }
    }
    if constexpr (kRms) sgx = row_allreduce<kTPR, SumOpF>(sgx, smem);
    else row_allreduce2<kTPR>(sg, sgx, smem);
    if (!valid || dx == nullptr) continue;
    const A mg = kRms ? A(0) : sg * inv_cols, mgx = sgx * inv_cols;
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      if (!in_cols[k]) continue;
      const int64_t e = (static_cast<int64_t>(k) * kTPR + t) * W;
      A o[W];
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const A xh = (raw_elem<T, W, A>(cx[k], j) - m) * rs;
        o[j] = rs * (raw_elem<T, W, A>(cd[k], j) * wv[k][j] - mg - xh * mgx);
      }
      store_vec<T, W>(dx + row * cols + e, o);
    }
  }
  if (!want_params) return;
  // The column sums may be scheduled now (Note [Row backward second stage]); they wait for
  // every block's partial row below.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
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

// The second stage with 8 columns and 64 partial rows per block (4x the blocks of
// column_sum_kernel, a quarter of the loop per thread); 32-byte column segments stay whole sectors.
// kPair = false sums part_w into out_w (not null) alone, part_b and out_b unused: the epilogue
// GEMMs' bias gradient (Note [Epilogue column sum] in epi/column_sum.cu) is that one-output form.
//
// Note [Row backward second stage]
// On sm_90 this kernel is launched as a programmatic dependent launch of the row backward
// (cudaLaunchAttributeProgrammaticStreamSerialization): the row backward signals
// griddepcontrol.launch_dependents once its rows are done, so this grid's launch overlaps the
// first grid's tail, and griddepcontrol.wait here blocks until the first grid has completed and
// its writes are visible. The result and its order of additions are the same as a plain launch;
// in a plain launch (the epilogue's) the wait has no prerequisite grid and returns at once.
template <class T, bool kPair = true>
__global__ void __launch_bounds__(512)
    column_sum_narrow_kernel(const compute_t<T>* __restrict__ part_w, const compute_t<T>* __restrict__ part_b,
                             T* __restrict__ out_w, T* __restrict__ out_b, int64_t parts, int64_t cols) {
  using A = compute_t<T>;
  __shared__ A sw[64][9], sb[kPair ? 64 : 1][9];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent of the row backward (Note [Row backward second stage]):
  // wait until that grid has finished and its partial rows are visible.
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 8 + threadIdx.x;
  A aw = A(0), ab = A(0);
  if (col < cols) {
    for (int64_t p = threadIdx.y; p < parts; p += 64) {
      aw += part_w[p * cols + col];
      if constexpr (kPair) ab += part_b[p * cols + col];
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  if constexpr (kPair) sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  // A fixed tree over the 64 partial sums (deterministic).
  for (int h = 32; h > 0; h >>= 1) {
    if (threadIdx.y < h) {
      sw[threadIdx.y][threadIdx.x] += sw[threadIdx.y + h][threadIdx.x];
      if constexpr (kPair) sb[threadIdx.y][threadIdx.x] += sb[threadIdx.y + h][threadIdx.x];
    }
    __syncthreads();
  }
  if (threadIdx.y == 0 && col < cols) {
    if constexpr (kPair) {
      if (out_w) out_w[col] = store_as<T>(sw[0][threadIdx.x]);
      if (out_b) out_b[col] = store_as<T>(sb[0][threadIdx.x]);
    } else {
      out_w[col] = store_as<T>(sw[0][threadIdx.x]);
    }
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
