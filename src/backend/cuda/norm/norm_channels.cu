// CUDA group_norm and batch_norm kernels and launchers (Note [CUDA norm kernels] in
// norm_kernels.cuh); x is [N, C, S] contiguous.
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <map>
#include <type_traits>
#include <utility>

#include "src/backend/cuda/norm/norm_kernels.cuh"

namespace flame::backend::cuda::norm {
namespace {

constexpr int kChannelBlock = 512;

// ---- group_norm ----

// A block per (n, group) row of len = cg * S values; W divides S on the vector path, so a vector
// lies in one channel.
template <class T, int W>
__global__ void __launch_bounds__(kChannelBlock)
    group_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                         T* __restrict__ y, compute_t<T>* __restrict__ mean_out, compute_t<T>* __restrict__ rstd_out,
                         int64_t rows, int64_t groups, int64_t cg, int64_t S, compute_t<T> eps) {
  using A = compute_t<T>;
  __shared__ A smem[32];
  __shared__ A bc[2];
  const int64_t len = cg * S, nvec = len / W;
  const A inv_len = A(1) / static_cast<A>(len);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* p = x + row * len;
    const A shift = load_as<A>(p[0]);
    A s1 = A(0), s2 = A(0);
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      A e[W];
      load_vec<T, W>(p + v * W, e);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const A d = e[j] - shift;
        s1 += d;
        s2 += d * d;
      }
    }
    s1 = block_reduce<NormSum<A>>(s1, smem);
    s2 = block_reduce<NormSum<A>>(s2, smem);
    if (threadIdx.x == 0) {
      const A dm = s1 * inv_len;
      A var = s2 * inv_len - dm * dm;
      var = var > A(0) ? var : A(0);
      bc[0] = shift + dm;
      bc[1] = rsqrt_acc(var + eps);
      mean_out[row] = bc[0];
      rstd_out[row] = bc[1];
    }
    __syncthreads();
    const A m = bc[0], rs = bc[1];
    const int64_t c0 = (row % groups) * cg;
    T* q = y + row * len;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      const int64_t c = c0 + (v * W) / S;
      const A scale = w ? rs * load_as<A>(w[c]) : rs;
      const A off = (b ? load_as<A>(b[c]) : A(0)) - m * scale;
      A e[W];
      load_vec<T, W>(p + v * W, e);
#pragma unroll
      for (int j = 0; j < W; ++j) e[j] = e[j] * scale + off;
      store_vec<T, W>(q + v * W, e);
    }
    __syncthreads();  // bc is rewritten by the next row
  }
}

// Per row: per-channel sums of dy and dy * xhat (partials [N, C] for the parameter gradients,
// when wanted), then dx = rstd * (w_c dy - mean(w dy) - xhat * mean(w dy xhat)).
template <class T, int W>
__global__ void __launch_bounds__(kChannelBlock)
    group_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, const compute_t<T>* __restrict__ mean,
                          const compute_t<T>* __restrict__ rstd, const T* __restrict__ w, T* __restrict__ dx,
                          compute_t<T>* __restrict__ part_w, compute_t<T>* __restrict__ part_b, int64_t rows,
                          int64_t groups, int64_t cg, int64_t S) {
  using A = compute_t<T>;
  __shared__ A smem[32];
  __shared__ A bc[2];
  const int64_t len = cg * S, svec = S / W;
  const A inv_len = A(1) / static_cast<A>(len);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const A m = mean[row], rs = rstd[row];
    const int64_t n = row / groups, c0 = (row % groups) * cg, C = groups * cg;
    A sum_g = A(0), sum_gx = A(0);  // thread 0's
    for (int64_t ci = 0; ci < cg; ++ci) {
      const int64_t off = row * len + ci * S;
      A a_dy = A(0), a_dyx = A(0);
      for (int64_t v = threadIdx.x; v < svec; v += blockDim.x) {
        A xe[W], de[W];
        load_vec<T, W>(x + off + v * W, xe);
        load_vec<T, W>(dy + off + v * W, de);
#pragma unroll
        for (int j = 0; j < W; ++j) {
          a_dy += de[j];
          a_dyx += de[j] * (xe[j] - m) * rs;
        }
      }
      a_dy = block_reduce<NormSum<A>>(a_dy, smem);
      a_dyx = block_reduce<NormSum<A>>(a_dyx, smem);
      if (threadIdx.x == 0) {
        const int64_t c = c0 + ci;
        if (part_w) {
          part_w[n * C + c] = a_dyx;
          part_b[n * C + c] = a_dy;
        }
        const A wc = w ? load_as<A>(w[c]) : A(1);
        sum_g += wc * a_dy;
        sum_gx += wc * a_dyx;
      }
    }
    if (threadIdx.x == 0) {
      bc[0] = sum_g * inv_len;
      bc[1] = sum_gx * inv_len;
    }
    __syncthreads();
    const A mg = bc[0], mgx = bc[1];
    if (dx) {
      const int64_t nvec = len / W;
      for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
        const int64_t c = c0 + (v * W) / S;
        const A wc = w ? load_as<A>(w[c]) : A(1);
        A xe[W], de[W];
        load_vec<T, W>(x + row * len + v * W, xe);
        load_vec<T, W>(dy + row * len + v * W, de);
#pragma unroll
        for (int j = 0; j < W; ++j) xe[j] = rs * (wc * de[j] - mg - (xe[j] - m) * rs * mgx);
        store_vec<T, W>(dx + row * len + v * W, xe);
      }
    }
    __syncthreads();  // bc is rewritten by the next row
  }
}

// The same with a warp per channel, for groups of at least as many channels as the block has
// warps: the per-channel sums are warp shuffles, and a row costs two block reductions instead
// of two per channel.
template <class T, int W>
__global__ void __launch_bounds__(kChannelBlock)
    group_backward_warp_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                               const compute_t<T>* __restrict__ mean, const compute_t<T>* __restrict__ rstd,
                               const T* __restrict__ w, T* __restrict__ dx, compute_t<T>* __restrict__ part_w,
                               compute_t<T>* __restrict__ part_b, int64_t rows, int64_t groups, int64_t cg,
                               int64_t S) {
  using A = compute_t<T>;
  __shared__ A smem[32];
  __shared__ A bc[2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int64_t len = cg * S, svec = S / W;
  const A inv_len = A(1) / static_cast<A>(len);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const A m = mean[row], rs = rstd[row];
    const int64_t n = row / groups, c0 = (row % groups) * cg, C = groups * cg;
    A my_g = A(0), my_gx = A(0);  // lane 0's: this warp's channels
    for (int64_t ci = warp; ci < cg; ci += nwarps) {  // warp-uniform
      const int64_t off = row * len + ci * S;
      A a_dy = A(0), a_dyx = A(0);
#pragma unroll 4
      for (int64_t v = lane; v < svec; v += 32) {
        A xe[W], de[W];
        load_vec<T, W>(x + off + v * W, xe);
        load_vec<T, W>(dy + off + v * W, de);
#pragma unroll
        for (int j = 0; j < W; ++j) {
          a_dy += de[j];
          a_dyx += de[j] * (xe[j] - m) * rs;
        }
      }
      a_dy = warp_reduce<NormSum<A>>(a_dy);
      a_dyx = warp_reduce<NormSum<A>>(a_dyx);
      if (lane == 0) {
        const int64_t c = c0 + ci;
        if (part_w) {
          part_w[n * C + c] = a_dyx;
          part_b[n * C + c] = a_dy;
        }
        const A wc = w ? load_as<A>(w[c]) : A(1);
        my_g += wc * a_dy;
        my_gx += wc * a_dyx;
      }
    }
    const A sum_g = block_reduce<NormSum<A>>(my_g, smem);
    const A sum_gx = block_reduce<NormSum<A>>(my_gx, smem);
    if (threadIdx.x == 0) {
      bc[0] = sum_g * inv_len;
      bc[1] = sum_gx * inv_len;
    }
    __syncthreads();
    const A mg = bc[0], mgx = bc[1];
    if (dx) {
      const int64_t nvec = len / W;
      for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
        const int64_t c = c0 + (v * W) / S;
        const A wc = w ? load_as<A>(w[c]) : A(1);
        A xe[W], de[W];
        load_vec<T, W>(x + row * len + v * W, xe);
        load_vec<T, W>(dy + row * len + v * W, de);
#pragma unroll
        for (int j = 0; j < W; ++j) xe[j] = rs * (wc * de[j] - mg - (xe[j] - m) * rs * mgx);
        store_vec<T, W>(dx + row * len + v * W, xe);
      }
    }
    __syncthreads();  // bc is rewritten by the next row
  }
}

// ---- group_norm on a thread-block cluster (Note [GroupNorm clusters]) ----
//
// Note [GroupNorm clusters]
// A block per group must read a group twice (statistics, then the output), and with a few hundred
// groups of 128 KiB in flight the second read misses L2. Instead a cluster of kCluster blocks
// holds one group in registers (up to kVPT vectors per thread): each block sums its slice, the
// blocks exchange their partial sums through distributed shared memory (cluster.sync between the
// steps), and every value is read once and written once. Mean first, then the centred sum of
// squares from the registers (exact two passes). The backward holds x and dy the same way; its
// per-channel sums (the weight/bias gradients) go to shared-memory accumulators of the group's
// channels (a warp adds its sum once when all its lanes are in one channel), and block rank 0
// adds the cluster's accumulators into the per-(n, c) partials. Every thread of every block
// reaches every cluster.sync; the last one keeps each block's shared memory alive until the
// others have read it.
// The kernels are bound by the latency of the exchanges (block reduction + cluster barrier), not
// by memory latency: measured on an H100 ([32, 512, 64, 64] bf16, 32 groups), 8 blocks of 16
// values per thread reached 50% of copy bandwidth forward and 39% forward + backward, 4 blocks of
// 32 values per thread 73% and 59% — twice the data per exchange. The clusters are persistent and
// prefetch their next group; the backward exchanges both of its sums at once (double-buffered
// slots and accumulators by group parity, so one barrier per group suffices).
constexpr int kCluster = 4;
constexpr int kClusterBlock = 512;
constexpr int kClusterMaxChannels = 256;  // per group, for the backward's accumulators

// Cluster-wide sum of one value per thread (valid in every thread). `slot` is this block's
// shared word for the exchange, `smem` the block_reduce scratch.
template <class A>
__device__ __forceinline__ A cluster_sum(A v, A* slot, A* smem, cooperative_groups::cluster_group& cluster) {
  v = block_reduce<NormSum<A>>(v, smem);
  if (threadIdx.x == 0) *slot = v;
  cluster.sync();
  A total = A(0);
#pragma unroll
  for (int r = 0; r < kCluster; ++r) total += *cluster.map_shared_rank(slot, r);
  return total;
}

// Cluster-wide sums of two values per thread in one exchange (valid in every thread). `slot`:
// this block's two words, `smem`: 64 words of block scratch.
template <class A>
__device__ __forceinline__ void cluster_sum2(A& a, A& b, A* slot, A* smem, cooperative_groups::cluster_group& cluster) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  a = warp_reduce<NormSum<A>>(a);
  b = warp_reduce<NormSum<A>>(b);
  __syncthreads();  // smem may still be read by the previous call
  if (lane == 0) {
    smem[warp] = a;
    smem[32 + warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    a = warp_reduce<NormSum<A>>(lane < nwarps ? smem[lane] : A(0));
    b = warp_reduce<NormSum<A>>(lane < nwarps ? smem[32 + lane] : A(0));
    if (lane == 0) {
      slot[0] = a;
      slot[1] = b;
    }
  }
  cluster.sync();
  A ta = A(0), tb = A(0);
#pragma unroll
  for (int r = 0; r < kCluster; ++r) {
    const A* o = cluster.map_shared_rank(slot, r);
    ta += o[0];
    tb += o[1];
  }
  a = ta;
  b = tb;
}

// The clusters are persistent (Note [GroupNorm clusters]): cluster k handles groups k, k + K,
// k + 2K, ... (K clusters resident), and the raw vectors of its next group are loaded before the
// current one is reduced, so their memory latency overlaps the exchanges.
template <class T, int W, int kVPT>
__device__ __forceinline__ void load_group_slice(const T* p, int v0, int v1,
                                                 typename RawVec<T, W>::type (&r)[kVPT]) {
#pragma unroll
  for (int k = 0; k < kVPT; ++k) {
    const int vi = v0 + k * kClusterBlock + static_cast<int>(threadIdx.x);
    if (vi < v1) r[k] = load_raw<T, W>(p + vi * W);
  }
}

template <class T, int W, int kVPT>
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kClusterBlock, 2)
    group_forward_cluster_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                                 T* __restrict__ y, compute_t<T>* __restrict__ mean_out,
                                 compute_t<T>* __restrict__ rstd_out, int64_t rows, int64_t groups, int64_t cg,
                                 int64_t S, compute_t<T> eps) {
  using A = compute_t<T>;
  using R = typename RawVec<T, W>::type;
  namespace coop = cooperative_groups;
  coop::cluster_group cluster = coop::this_cluster();
  __shared__ A smem[32];
  __shared__ A slots[2];
  const int rank = static_cast<int>(cluster.block_rank());
  // A group held by a cluster has at most kCluster * kClusterBlock * kVPT vectors: 32-bit indices.
  const int64_t len = cg * S;
  const int nvec = static_cast<int>(len / W), si = static_cast<int>(S);
  const int per = (nvec + kCluster - 1) / kCluster;
  const int v0 = rank * per, v1 = v0 + per < nvec ? v0 + per : nvec;
  const int64_t stride = gridDim.x / kCluster;
  const A inv_len = A(1) / static_cast<A>(len);
  int64_t row = blockIdx.x / kCluster;
  R cur[kVPT], nxt[kVPT];
  if (row < rows) load_group_slice<T, W, kVPT>(x + row * len, v0, v1, cur);
  for (; row < rows; row += stride) {
    if (row + stride < rows) load_group_slice<T, W, kVPT>(x + (row + stride) * len, v0, v1, nxt);
    A s = A(0);
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      const int vi = v0 + k * kClusterBlock + static_cast<int>(threadIdx.x);
      if (vi < v1)
#pragma unroll
        for (int j = 0; j < W; ++j) s += raw_elem<T, W, A>(cur[k], j);
    }
    // The slots are rewritten only after the next exchange's barrier, which every block reaches
    // after reading them: two cluster barriers per group.
    const A m = cluster_sum(s, &slots[0], smem, cluster) * inv_len;
    A q = A(0);
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      const int vi = v0 + k * kClusterBlock + static_cast<int>(threadIdx.x);
      if (vi < v1)
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const A d = raw_elem<T, W, A>(cur[k], j) - m;
          q += d * d;
        }
    }
    const A rs = rsqrt_acc(cluster_sum(q, &slots[1], smem, cluster) * inv_len + eps);
    if (rank == 0 && threadIdx.x == 0) {
      mean_out[row] = m;
      rstd_out[row] = rs;
    }
    const int64_t c0 = (row % groups) * cg;
    T* out = y + row * len;
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      const int vi = v0 + k * kClusterBlock + static_cast<int>(threadIdx.x);
      if (vi < v1) {
        const int64_t c = c0 + (vi * W) / si;
        const A scale = w ? rs * load_as<A>(w[c]) : rs;
        const A off = (b ? load_as<A>(b[c]) : A(0)) - m * scale;
        A o[W];
#pragma unroll
        for (int j = 0; j < W; ++j) o[j] = raw_elem<T, W, A>(cur[k], j) * scale + off;
        store_vec<T, W>(out + vi * W, o);
      }
    }
#pragma unroll
    for (int k = 0; k < kVPT; ++k) cur[k] = nxt[k];
  }
  cluster.sync();  // the other blocks have read this block's slots
}

template <class T, int W, int kVPT>
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kClusterBlock)
    group_backward_cluster_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                  const compute_t<T>* __restrict__ mean, const compute_t<T>* __restrict__ rstd,
                                  const T* __restrict__ w, T* __restrict__ dx, compute_t<T>* __restrict__ part_w,
                                  compute_t<T>* __restrict__ part_b, int64_t rows, int64_t groups, int64_t cg,
                                  int64_t S) {
  using A = compute_t<T>;
  using R = typename RawVec<T, W>::type;
  namespace coop = cooperative_groups;
  coop::cluster_group cluster = coop::this_cluster();
  __shared__ A smem[64];
  __shared__ A slots[2][2];  // by group parity: one exchange per group (see acc)
  // Per channel of the group: sums of dy * xhat and dy, double-buffered by group parity so that a
  // block clears one buffer while rank 0 may still read the other (two barriers per group).
  __shared__ A acc[2][2][kClusterMaxChannels];
  const int rank = static_cast<int>(cluster.block_rank());
  const int lane = threadIdx.x & 31;
  // A group held by a cluster has at most kCluster * kClusterBlock * kVPT vectors: 32-bit indices.
  const int64_t len = cg * S;
  const int nvec = static_cast<int>(len / W), si = static_cast<int>(S);
  const int per = (nvec + kCluster - 1) / kCluster;
  const int v0 = rank * per, v1 = v0 + per < nvec ? v0 + per : nvec;
  const int64_t C = groups * cg;
  const int64_t stride = gridDim.x / kCluster;
  const A inv_len = A(1) / static_cast<A>(len);
  const bool params = part_w != nullptr;
  int64_t row = blockIdx.x / kCluster;
  R cx[kVPT], cd[kVPT], nx[kVPT], nd[kVPT];
  if (row < rows) {
    load_group_slice<T, W, kVPT>(x + row * len, v0, v1, cx);
    load_group_slice<T, W, kVPT>(dy + row * len, v0, v1, cd);
  }
  for (int parity = 0; row < rows; row += stride, parity ^= 1) {
    if (row + stride < rows) {
      load_group_slice<T, W, kVPT>(x + (row + stride) * len, v0, v1, nx);
      load_group_slice<T, W, kVPT>(dy + (row + stride) * len, v0, v1, nd);
    }
    const int64_t n = row / groups, c0 = (row % groups) * cg;
    const A m = mean[row], rs = rstd[row];
    A(&ac)[2][kClusterMaxChannels] = acc[parity];
    if (params) {
      for (int64_t i = threadIdx.x; i < 2 * cg; i += kClusterBlock) ac[i / cg][i % cg] = A(0);
      __syncthreads();
    }
    A sg = A(0), sgx = A(0);
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      const int vi = v0 + k * kClusterBlock + static_cast<int>(threadIdx.x);
      const bool in = vi < v1;
      const int ci = in ? (vi * W) / si : -1;  // the group's channel of this vector
      A a_dy = A(0), a_dyx = A(0);
      if (in) {
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const A de = raw_elem<T, W, A>(cd[k], j);
          a_dy += de;
          a_dyx += de * ((raw_elem<T, W, A>(cx[k], j) - m) * rs);
        }
        const A wc = w ? load_as<A>(w[c0 + ci]) : A(1);
        sg += wc * a_dy;
        sgx += wc * a_dyx;
      }
      if (params) {
        // Whole warps in one channel add once; otherwise each lane adds its own.
        const int c_first = __shfl_sync(0xffffffffu, ci, 0);
        if (__all_sync(0xffffffffu, ci == c_first)) {
          a_dy = warp_reduce<NormSum<A>>(a_dy);
          a_dyx = warp_reduce<NormSum<A>>(a_dyx);
          if (lane == 0 && ci >= 0) {
            atomicAdd(&ac[0][ci], a_dyx);
            atomicAdd(&ac[1][ci], a_dy);
          }
        } else if (ci >= 0) {
          atomicAdd(&ac[0][ci], a_dyx);
          atomicAdd(&ac[1][ci], a_dy);
        }
      }
    }
    cluster_sum2(sg, sgx, slots[parity], smem, cluster);  // its cluster.sync also orders acc
    const A mg = sg * inv_len, mgx = sgx * inv_len;
    if (params && rank == 0) {
      for (int64_t ci = threadIdx.x; ci < cg; ci += kClusterBlock) {
        A tw = A(0), tb = A(0);
        for (int r = 0; r < kCluster; ++r) {
          tw += cluster.map_shared_rank(&ac[0][0], r)[ci];
          tb += cluster.map_shared_rank(&ac[1][0], r)[ci];
        }
        part_w[n * C + c0 + ci] = tw;
        part_b[n * C + c0 + ci] = tb;
      }
    }
    if (dx) {
#pragma unroll
      for (int k = 0; k < kVPT; ++k) {
        const int vi = v0 + k * kClusterBlock + static_cast<int>(threadIdx.x);
        if (vi < v1) {
          const A wc = w ? load_as<A>(w[c0 + (vi * W) / si]) : A(1);
          A o[W];
#pragma unroll
          for (int j = 0; j < W; ++j) {
            const A xh = (raw_elem<T, W, A>(cx[k], j) - m) * rs;
            o[j] = rs * (raw_elem<T, W, A>(cd[k], j) * wc - mg - xh * mgx);
          }
          store_vec<T, W>(dx + row * len + vi * W, o);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      cx[k] = nx[k];
      cd[k] = nd[k];
    }
  }
  cluster.sync();  // the other blocks have read this block's slots and accumulators
}

#include "src/backend/cuda/norm/group_cluster_variants.cuh"

// Clusters resident at once for a cluster kernel (0 when the query fails: then one per group).
template <class Kernel>
int64_t resident_clusters(Kernel kernel, int smem_bytes, int cluster, int block) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(cluster * 1024);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = static_cast<std::size_t>(smem_bytes);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// Grid of a persistent cluster kernel over `rows` groups: the resident clusters (queried once per
// kernel and device), or one cluster per group when fewer.
// A kernel with more than 48 KiB of dynamic shared memory is allowed it first (once per device).
template <class Kernel>
unsigned cluster_grid(Kernel kernel, int64_t rows, int smem_bytes = 0, int cluster = kCluster,
                      int block = kClusterBlock) {
  static thread_local std::map<std::pair<const void*, int>, int64_t> cache;
  int dev = 0;
  FLAME_CUDA_CHECK(cudaGetDevice(&dev));
  auto key = std::make_pair(reinterpret_cast<const void*>(kernel), dev);
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (smem_bytes > 48 * 1024)
      FLAME_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    it = cache.emplace(key, resident_clusters(kernel, smem_bytes, cluster, block)).first;
  }
  const int64_t k = it->second > 0 ? std::min(rows, it->second) : rows;
  return static_cast<unsigned>(k * cluster);
}

// Vectors per thread for a group of `nvec` vectors on a cluster (0: too long).
inline int cluster_vpt(int64_t nvec, int max_vpt) {
  for (int v = 1; v <= max_vpt; v *= 2)
    if (nvec <= static_cast<int64_t>(v) * kCluster * kClusterBlock) return v;
  return 0;
}

// ---- batch_norm ----

// Element k of channel c's N * S values.
__device__ __forceinline__ int64_t bn_index(int64_t k, int64_t c, int64_t C, int64_t S) {
  const int64_t n = k / S;
  return (n * C + c) * S + (k - n * S);
}

template <class T>
__global__ void __launch_bounds__(kChannelBlock)
    batch_stats_kernel(const T* __restrict__ x, compute_t<T>* __restrict__ mean_out,
                       compute_t<T>* __restrict__ var_out, int64_t N, int64_t C, int64_t S) {
  using A = compute_t<T>;
  __shared__ A smem[32];
  __shared__ A bc;
  const int64_t count = N * S;
  const A inv = A(1) / static_cast<A>(count);
  for (int64_t c = blockIdx.x; c < C; c += gridDim.x) {
    A s = A(0);
    for (int64_t k = threadIdx.x; k < count; k += blockDim.x) s += load_as<A>(x[bn_index(k, c, C, S)]);
    s = block_reduce<NormSum<A>>(s, smem);
    if (threadIdx.x == 0) bc = s * inv;
    __syncthreads();
    const A m = bc;
    A q = A(0);
    for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
      const A d = load_as<A>(x[bn_index(k, c, C, S)]) - m;
      q += d * d;
    }
    q = block_reduce<NormSum<A>>(q, smem);
    if (threadIdx.x == 0) {
      mean_out[c] = m;
      var_out[c] = q * inv;
    }
    __syncthreads();  // bc is rewritten by the next channel
  }
}

template <class T>
__global__ void batch_apply_kernel(const T* __restrict__ x, const compute_t<T>* __restrict__ mean,
                                   const compute_t<T>* __restrict__ rstd, const T* __restrict__ w,
                                   const T* __restrict__ b, T* __restrict__ y, int64_t numel, int64_t C, int64_t S) {
  using A = compute_t<T>;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = (i / S) % C;
    A r = (load_as<A>(x[i]) - mean[c]) * rstd[c];
    if (w) r *= load_as<A>(w[c]);
    if (b) r += load_as<A>(b[c]);
    y[i] = store_as<T>(r);
  }
}

// A block per channel: the channel's weight/bias gradients directly (no partials), then dx.
template <class T>
__global__ void __launch_bounds__(kChannelBlock)
    batch_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, const compute_t<T>* __restrict__ mean,
                          const compute_t<T>* __restrict__ rstd, const T* __restrict__ w, T* __restrict__ dx,
                          T* __restrict__ dw, T* __restrict__ db, int64_t N, int64_t C, int64_t S, bool training) {
  using A = compute_t<T>;
  __shared__ A smem[32];
  __shared__ A bc[2];
  const int64_t count = N * S;
  const A inv = A(1) / static_cast<A>(count);
  for (int64_t c = blockIdx.x; c < C; c += gridDim.x) {
    const A m = mean[c], rs = rstd[c];
    A sd = A(0), sdx = A(0);
    for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
      const int64_t i = bn_index(k, c, C, S);
      const A d = load_as<A>(dy[i]);
      sd += d;
      sdx += d * (load_as<A>(x[i]) - m) * rs;
    }
    sd = block_reduce<NormSum<A>>(sd, smem);
    sdx = block_reduce<NormSum<A>>(sdx, smem);
    if (threadIdx.x == 0) {
      if (dw) dw[c] = store_as<T>(sdx);
      if (db) db[c] = store_as<T>(sd);
      bc[0] = training ? sd * inv : A(0);
      bc[1] = training ? sdx * inv : A(0);
    }
    __syncthreads();
    if (dx) {
      const A md = bc[0], mdx = bc[1];
      const A scale = (w ? load_as<A>(w[c]) : A(1)) * rs;
      for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
        const int64_t i = bn_index(k, c, C, S);
        const A xh = (load_as<A>(x[i]) - m) * rs;
        dx[i] = store_as<T>(scale * (load_as<A>(dy[i]) - md - xh * mdx));
      }
    }
    __syncthreads();
  }
}

template <class T>
const T* cptr(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.data_ptr()) : nullptr;
}
template <class T>
T* mptr(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data_ptr()) : nullptr;
}
bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

struct NCS {
  int64_t n, c, s;
};
NCS ncs(const Tensor& x) {
  NCS d{x.sizes()[0], x.sizes()[1], 1};
  for (int64_t i = 2; i < x.dim(); ++i) d.s *= x.sizes()[i];
  return d;
}

unsigned int channel_grid(int64_t units) { return grid_for(units, 1, 1 << 20); }

// Tuning hook, temporary while the cluster variants (Note [GroupNorm cluster variants]) are
// measured: FLAME_GN_VARIANT holds "f<k>" and/or "b<k>" (e.g. "f1b3") and picks the forward and
// backward cluster kernels; read at every call so that a benchmark can switch between runs.
// f0: two exchanges; f1: one, Chan's merge; f2: one, shifted sums; f3: f2 staged two groups ahead
// by cp.async; f4: f2 on clusters of 8 blocks of 256 threads. b0: registers prefetch (first
// version); b1: + statistics prefetched; b2: no prefetch, 2 blocks/SM; b3: staged by cp.async,
// 2 blocks/SM; b4: b1 on clusters of 8 blocks of 256 threads (2 blocks/SM); b5: the next two
// groups staged by cp.async (two stages, 1 block/SM; up to 4 vectors per thread, else b0).
struct GnVariant {
  int fwd = 2, bwd = 5;  // the default: one exchange of shifted sums; two stages (b1 past 4 vectors)
};
GnVariant gn_variant() {
  GnVariant v;
  if (const char* s = std::getenv("FLAME_GN_VARIANT")) {
    for (const char* p = s; p[0] != '\0'; ++p) {
      if (p[1] < '0' || p[1] > '9') continue;
      if (p[0] == 'f') v.fwd = p[1] - '0' <= 4 ? p[1] - '0' : 0;
      if (p[0] == 'b') v.bwd = p[1] - '0' <= 5 ? p[1] - '0' : 0;
    }
  }
  return v;
}

template <class T>
void group_forward_typed(CudaBackend& be, const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                         const Tensor& w, const Tensor& b, int64_t groups, double eps) {
  using A = compute_t<T>;
  const NCS d = ncs(x);
  const int64_t rows = d.n * groups, cg = d.c / groups;
  const T *xp = cptr<T>(x), *wp = cptr<T>(w), *bp = cptr<T>(b);
  T* yp = mptr<T>(y);
  constexpr int W = vec_width<T>();
  const bool vec = W > 1 && d.s % W == 0 && aligned16(xp) && aligned16(yp);
  cudaStream_t st = be.stream();
  // Note [GroupNorm clusters]: a group in the registers of a cluster when it fits (32 values per thread).
  const int vpt = vec ? cluster_vpt(d.c / groups * d.s / W, 32 / W) : 0;
  if (vpt > 0 && rows * kCluster <= (int64_t{1} << 31) - 1) {
    bool launched = false;
    auto pick = [&](auto vpt_tag) {
      constexpr int VPT = decltype(vpt_tag)::value;
      if constexpr (VPT * W <= 32) {
        if (vpt != VPT) return;
        const int fv = gn_variant().fwd;
        auto kernel = fv == 1   ? group_forward_cluster1_kernel<T, W, VPT, true>
                      : fv == 2 ? group_forward_cluster1_kernel<T, W, VPT, false>
                      : fv == 3 ? group_forward_staged_kernel<T, W, VPT>
                      : fv == 4 ? group_forward_cluster1_kernel<T, W, VPT, false, 8, 256>
                                : group_forward_cluster_kernel<T, W, VPT>;
        const int smem = fv == 3 ? gn_fwd_stage_bytes<VPT>() : 0;
        const int cl = fv == 4 ? 8 : kCluster, blk = fv == 4 ? 256 : kClusterBlock;
        kernel<<<cluster_grid(kernel, rows, smem, cl, blk), blk, smem, st>>>(
            xp, wp, bp, yp, mptr<A>(mean), mptr<A>(rstd), rows, groups, cg, d.s, static_cast<A>(eps));
        FLAME_CUDA_CHECK_LAUNCH();
        launched = true;
      }
    };
    pick(std::integral_constant<int, 1>{});
    pick(std::integral_constant<int, 2>{});
    pick(std::integral_constant<int, 4>{});
    pick(std::integral_constant<int, 8>{});
    if (launched) return;
  }
  if (vec) {
    group_forward_kernel<T, W><<<channel_grid(rows), kChannelBlock, 0, st>>>(
        xp, wp, bp, yp, mptr<A>(mean), mptr<A>(rstd), rows, groups, cg, d.s, static_cast<A>(eps));
  } else {
    group_forward_kernel<T, 1><<<channel_grid(rows), kChannelBlock, 0, st>>>(
        xp, wp, bp, yp, mptr<A>(mean), mptr<A>(rstd), rows, groups, cg, d.s, static_cast<A>(eps));
  }
  FLAME_CUDA_CHECK_LAUNCH();
}

template <class T>
void group_backward_typed(CudaBackend& be, const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy,
                          const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& w, int64_t groups) {
  using A = compute_t<T>;
  const NCS d = ncs(x);
  const int64_t rows = d.n * groups, cg = d.c / groups;
  const T *dyp = cptr<T>(dy), *xp = cptr<T>(x), *wp = cptr<T>(w);
  T *dxp = mptr<T>(dx), *dwp = mptr<T>(dw), *dbp = mptr<T>(db);
  const bool params = dwp || dbp;
  std::shared_ptr<void> part;
  A *pw = nullptr, *pb = nullptr;
  if (params) {
    part = be.allocate(2 * static_cast<std::size_t>(d.n * d.c) * sizeof(A));
    pw = static_cast<A*>(part.get());
    pb = pw + d.n * d.c;
  }
  constexpr int W = vec_width<T>();
  const bool vec = W > 1 && d.s % W == 0 && aligned16(xp) && aligned16(dyp) && aligned16(dxp);
  cudaStream_t st = be.stream();
  // Note [GroupNorm clusters]: x and dy of a group in the registers of a cluster (32 values per thread).
  const int vpt = vec && cg <= kClusterMaxChannels ? cluster_vpt(cg * d.s / W, 32 / W) : 0;
  if (vpt > 0 && rows * kCluster <= (int64_t{1} << 31) - 1) {
    bool launched = false;
    auto pick = [&](auto vpt_tag) {
      constexpr int VPT = decltype(vpt_tag)::value;
      if constexpr (VPT * W <= 32) {
        if (vpt != VPT) return;
        const int bv = gn_variant().bwd;
        auto kernel = bv == 1   ? group_backward_cluster1_kernel<T, W, VPT, kBwdRegs>
                      : bv == 2 ? group_backward_cluster1_kernel<T, W, VPT, kBwdUnstaged>
                      : bv == 3 ? group_backward_cluster1_kernel<T, W, VPT, kBwdStaged>
                      : bv == 4 ? group_backward_cluster1_kernel<T, W, VPT, kBwdRegs, 8, 256>
                      : bv == 5 && VPT <= 4 ? group_backward_cluster1_kernel<T, W, VPT, kBwdStaged2>
                      : bv == 5             ? group_backward_cluster1_kernel<T, W, VPT, kBwdRegs>
                                : group_backward_cluster_kernel<T, W, VPT>;
        const int smem = bv == 3                ? gn_bwd_stage_bytes<VPT, kBwdStaged>()
                         : bv == 5 && VPT <= 4 ? gn_bwd_stage_bytes<VPT, kBwdStaged2>()
                                                : 0;
        const int cl = bv == 4 ? 8 : kCluster, blk = bv == 4 ? 256 : kClusterBlock;
        kernel<<<cluster_grid(kernel, rows, smem, cl, blk), blk, smem, st>>>(dyp, xp, cptr<A>(mean), cptr<A>(rstd), wp,
                                                                            dxp, pw, pb, rows, groups, cg, d.s);
        FLAME_CUDA_CHECK_LAUNCH();
        launched = true;
      }
    };
    pick(std::integral_constant<int, 1>{});
    pick(std::integral_constant<int, 2>{});
    pick(std::integral_constant<int, 4>{});
    pick(std::integral_constant<int, 8>{});
    if (launched) {
      if (params) {
        column_sum_kernel<T><<<grid_for(d.c, 32), dim3(32, 16), 0, st>>>(pw, pb, dwp, dbp, d.n, d.c);
        FLAME_CUDA_CHECK_LAUNCH();
      }
      return;
    }
  }
  const bool by_warp = cg >= kChannelBlock / 32;
#define FLAME_GN_BWD(KERNEL, VW)                                                        \
  KERNEL<T, VW><<<channel_grid(rows), kChannelBlock, 0, st>>>(dyp, xp, cptr<A>(mean), cptr<A>(rstd), wp, dxp, pw, \
                                                              pb, rows, groups, cg, d.s)
  if (vec && by_warp) {
    FLAME_GN_BWD(group_backward_warp_kernel, W);
  } else if (vec) {
    FLAME_GN_BWD(group_backward_kernel, W);
  } else if (by_warp) {
    FLAME_GN_BWD(group_backward_warp_kernel, 1);
  } else {
    FLAME_GN_BWD(group_backward_kernel, 1);
  }
#undef FLAME_GN_BWD
  FLAME_CUDA_CHECK_LAUNCH();
  if (params) {
    column_sum_kernel<T><<<grid_for(d.c, 32), dim3(32, 16), 0, st>>>(pw, pb, dwp, dbp, d.n, d.c);
    FLAME_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace
}  // namespace flame::backend::cuda::norm

namespace flame::backend::cuda {
using namespace norm;

void CudaBackend::group_norm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                                     const Tensor& weight, const Tensor& bias, int64_t groups, double eps) {
  if (x.numel() == 0) return;
  DeviceGuard guard(device());
  dispatch_floating(x.dtype(), "group_norm", [&](auto tag) {
    group_forward_typed<typename decltype(tag)::type>(*this, y, mean, rstd, x, weight, bias, groups, eps);
  });
}

void CudaBackend::group_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                                      const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& weight,
                                      int64_t groups) {
  if (x.numel() == 0) return;
  DeviceGuard guard(device());
  dispatch_floating(x.dtype(), "group_norm_backward", [&](auto tag) {
    group_backward_typed<typename decltype(tag)::type>(*this, dx, dweight, dbias, dy, x, mean, rstd, weight, groups);
  });
}

void CudaBackend::batch_norm_stats(const Tensor& mean, const Tensor& var, const Tensor& x) {
  if (x.numel() == 0) return;
  DeviceGuard guard(device());
  const NCS d = ncs(x);
  dispatch_floating(x.dtype(), "batch_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = compute_t<T>;
    batch_stats_kernel<T><<<channel_grid(d.c), kChannelBlock, 0, stream()>>>(cptr<T>(x), mptr<A>(mean), mptr<A>(var),
                                                                             d.n, d.c, d.s);
    FLAME_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::batch_norm_apply(const Tensor& y, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                                   const Tensor& weight, const Tensor& bias) {
  if (x.numel() == 0) return;
  DeviceGuard guard(device());
  const NCS d = ncs(x);
  dispatch_floating(x.dtype(), "batch_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = compute_t<T>;
    batch_apply_kernel<T><<<blocks_for(x.numel(), 256), 256, 0, stream()>>>(
        cptr<T>(x), cptr<A>(mean), cptr<A>(rstd), cptr<T>(weight), cptr<T>(bias), mptr<T>(y), x.numel(), d.c, d.s);
    FLAME_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::batch_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                                      const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& weight,
                                      bool training) {
  if (x.numel() == 0) return;
  DeviceGuard guard(device());
  const NCS d = ncs(x);
  dispatch_floating(x.dtype(), "batch_norm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = compute_t<T>;
    batch_backward_kernel<T><<<channel_grid(d.c), kChannelBlock, 0, stream()>>>(
        cptr<T>(dy), cptr<T>(x), cptr<A>(mean), cptr<A>(rstd), cptr<T>(weight), mptr<T>(dx), mptr<T>(dweight),
        mptr<T>(dbias), d.n, d.c, d.s, training);
    FLAME_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace flame::backend::cuda
