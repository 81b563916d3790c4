// GroupNorm on thread-block clusters (Note [GroupNorm clusters]). Included by norm_channels.cu
// inside its anonymous namespace, after norm_kernels.cuh.
//
// Note [GroupNorm clusters]
// A block per group must read a group twice (statistics, then the output), and with a few hundred
// groups of 128 KiB in flight the second read misses L2. Instead a cluster of kCluster blocks holds
// one group in registers (up to kVPT 16-byte vectors per thread) and every value is read once and
// written once. The clusters are persistent (as many as are resident, cluster k taking groups k,
// k + K, k + 2K, ...). What bounds them is the chain of exchanges per group (a block reduction, then a cluster barrier
// and reads of the other blocks' partial sums through distributed shared memory) and the bytes
// each SM keeps in flight, so:
//  - forward (group_forward_lean_kernel, Note [GroupNorm lean forward]): ONE exchange per group,
//    of shifted sums (x - K and (x - K)^2, K the group's first value, which every thread loads
//    with its slice): the mean and the variance without a second round, and the cancellation is
//    bounded by how far the group's mean lies from K in standard deviations (an actual value of
//    the group, not 0). The current group and the prefetched next one packed as loaded;
//  - backward (group_backward_lean_kernel, Note [GroupNorm lean backward], where a warp's vectors
//    lie in one channel; group_backward_cluster_kernel below otherwise): x and dy of the group packed in registers as loaded (x-hat recomputed from them),
//    both row sums (sum g, sum g * xhat) in one exchange, and NO prefetch: 64 registers, two
//    512-thread blocks per SM, one block's loads overlapping the other's exchange. Prefetching the
//    next group (into registers at one block per SM, or into shared memory by cp.async) measured
//    slower on an H100.
//  - The exchanges are double-buffered by group parity: a block writes slot[parity] before the
//    group's cluster barrier and reads every block's slot[parity] after it, and can write the same
//    slot again only two groups later, after a barrier that every block reaches once done reading.
//    The backward's per-channel sums (the weight/bias gradients) go to shared-memory accumulators
//    of the group's channels, also by parity, cleared behind a block barrier before use; block
//    rank 0 adds the cluster's accumulators into the per-(n, c) partials. Every thread of every
//    block reaches every cluster barrier; the last one keeps each block's shared memory alive
//    until the others have read it.
// Measured history and the variants that lost: docs/nn-norm.md.
#include <cooperative_groups.h>

constexpr int kCluster = 4;
constexpr int kClusterBlock = 512;
constexpr int kClusterMaxChannels = 256;  // per group, for the backward's accumulators

namespace gn_cluster {

// Cluster-wide sums of two values per thread (valid in every thread): one block reduction and one
// cluster barrier. smem: 64 words of block scratch, read by warp 0 before the cluster barrier that
// every thread passes before the next call rewrites it; slot: this block's two words for this
// group's parity.
template <int kCl, class A>
__device__ __forceinline__ void cluster_sum2(A& a, A& b, A* slot, A* smem, cooperative_groups::cluster_group& cluster) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  a = warp_reduce<NormSum<A>>(a);
  b = warp_reduce<NormSum<A>>(b);
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
  for (int r = 0; r < kCl; ++r) {  // the same order in every thread: uniform results
    const A* o = cluster.map_shared_rank(slot, r);
    ta += o[0];
    tb += o[1];
  }
  a = ta;
  b = tb;
}

}  // namespace gn_cluster

// A thread's vectors in a group (here and in group_cluster_lean.cuh): k = 0 .. kVPT-1 at element
// offset toff + k * kStep of the group (toff = (v0 + tid) * W, the same in every group), present
// while k * kBlk < lim. One 64-bit base per group plus immediate offsets keeps the address
// registers few; group indices are 32-bit (the launcher keeps rows * kCl below 2^31), so no
// 64-bit division is left in the loop.

// Two 512-thread blocks per SM (64 registers) while a thread holds at most 4 vectors of x and dy.
template <int kVPT>
constexpr int group_backward_min_blocks() {
  return kVPT <= 4 ? 2 : 1;
}

template <class T, int W, int kVPT, int kCl = kCluster, int kBlk = kClusterBlock>
__global__ void __cluster_dims__(kCl, 1, 1) __launch_bounds__(kBlk, group_backward_min_blocks<kVPT>())
    group_backward_cluster_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                  const compute_t<T>* __restrict__ mean, const compute_t<T>* __restrict__ rstd,
                                  const T* __restrict__ w, T* __restrict__ dx, compute_t<T>* __restrict__ part_w,
                                  compute_t<T>* __restrict__ part_b, int64_t rows, int64_t groups, int64_t cg,
                                  int64_t S) {
  using A = compute_t<T>;
  using R = typename RawVec<T, W>::type;
  static_assert(W > 1, "the cluster path moves 16-byte vectors");
  constexpr int kStep = kBlk * W;
  namespace coop = cooperative_groups;
  coop::cluster_group cluster = coop::this_cluster();
  __shared__ A smem[64];
  __shared__ A slots[2][2];
  // Per channel of the group: sums of dy * xhat and dy, double-buffered by group parity.
  __shared__ A acc[2][2][kClusterMaxChannels];
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int64_t len = cg * S;
  const int nvec = static_cast<int>(len / W), si = static_cast<int>(S);
  const int per = (nvec + kCl - 1) / kCl;
  const int v0 = rank * per, v1 = v0 + per < nvec ? v0 + per : nvec;
  const int toff = (v0 + tid) * W, lim = v1 - v0 - tid;
  const int nrows = static_cast<int>(rows), ngroups = static_cast<int>(groups), ncg = static_cast<int>(cg);
  const int stride = static_cast<int>(gridDim.x) / kCl;
  const A inv_len = A(1) / static_cast<A>(len);
  const bool params = part_w != nullptr;
  R cx[kVPT], cd[kVPT];
  int row = static_cast<int>(blockIdx.x) / kCl;
  A nm = row < nrows ? mean[row] : A(0), nrs = row < nrows ? rstd[row] : A(0);
  for (int parity = 0; row < nrows; row += stride, parity ^= 1) {
    // No prefetch: the SM's other block hides this latency (a register or shared-memory prefetch
    // of the next group measured slower, docs/nn-norm.md).
    const T* px = x + static_cast<int64_t>(row) * len + toff;
    const T* pd = dy + static_cast<int64_t>(row) * len + toff;
#pragma unroll
    for (int k = 0; k < kVPT; ++k)
      if (k * kBlk < lim) {
        cx[k] = load_raw<T, W>(px + k * kStep);
        cd[k] = load_raw<T, W>(pd + k * kStep);
      }
    const A m = nm, rs = nrs;
    if (row + stride < nrows) {  // the next group's statistics, in flight meanwhile
      nm = mean[row + stride];
      nrs = rstd[row + stride];
    }
    const int c0 = (row % ngroups) * ncg;
    A(&ac)[2][kClusterMaxChannels] = acc[parity];
    if (params) {
      for (int i = tid; i < kClusterMaxChannels; i += kBlk) ac[0][i] = ac[1][i] = A(0);
      __syncthreads();
    }
    A sg = A(0), sgx = A(0);
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      const bool in = k * kBlk < lim;
      const int ci = in ? (toff + k * kStep) / si : -1;  // the group's channel of this vector
      A a_dy = A(0), a_dyx = A(0);
      if (in) {
        const A wc = w ? load_as<A>(w[c0 + ci]) : A(1);
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const A de = raw_elem<T, W, A>(cd[k], j);
          a_dy += de;
          a_dyx += de * ((raw_elem<T, W, A>(cx[k], j) - m) * rs);
        }
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
    gn_cluster::cluster_sum2<kCl>(sg, sgx, slots[parity], smem, cluster);  // its cluster.sync orders acc
    const A mg = sg * inv_len, mgx = sgx * inv_len;
    if (params && rank == 0) {
      const int64_t pbase = static_cast<int64_t>(row / ngroups) * ngroups * ncg + c0;
      for (int ci = tid; ci < ncg; ci += kBlk) {
        A tw = A(0), tb = A(0);
        for (int r = 0; r < kCl; ++r) {
          tw += cluster.map_shared_rank(&ac[0][0], r)[ci];
          tb += cluster.map_shared_rank(&ac[1][0], r)[ci];
        }
        part_w[pbase + ci] = tw;
        part_b[pbase + ci] = tb;
      }
    }
    if (dx) {
      T* out = dx + static_cast<int64_t>(row) * len + toff;
#pragma unroll
      for (int k = 0; k < kVPT; ++k) {
        if (k * kBlk < lim) {
          const A wc = w ? load_as<A>(w[c0 + (toff + k * kStep) / si]) : A(1);
          A o[W];
#pragma unroll
          for (int j = 0; j < W; ++j) {
            const A xh = (raw_elem<T, W, A>(cx[k], j) - m) * rs;
            o[j] = rs * (raw_elem<T, W, A>(cd[k], j) * wc - mg - xh * mgx);
          }
          store_vec<T, W>(out + k * kStep, o);
        }
      }
    }
  }
  cluster.sync();  // the other blocks have read this block's slots and accumulators
}
