// GroupNorm cluster kernels with one exchange per group (Note [GroupNorm cluster variants]).
// Included by norm_channels.cu inside its anonymous namespace, after the cluster helpers
// (kCluster, kClusterBlock, kClusterMaxChannels, load_group_slice).
//
// Note [GroupNorm cluster variants]
// The first cluster kernels were bound by the latency of their exchange chain (a block reduction
// and a cluster barrier per sum). These cut the chain:
//  - forward, Chan: each thread reduces its own values to (count, mean, M2), warps, blocks and
//    the cluster merge those triples with Chan's formula: mean and variance from ONE block
//    reduction and ONE cluster barrier, exact as the two-pass form (no cancellation);
//  - forward, shifted: sums of x - K and (x - K)^2 with K the group's first value (every thread
//    loads it with its slice), both in one exchange; the cancellation is bounded by how far the
//    group's mean lies from K in standard deviations;
//  - backward, staged: the next group's x and dy go to shared memory by cp.async instead of a
//    second register copy, so a thread holds one group (32 registers of packed values) and two
//    512-thread blocks fit per SM: twice the exchanges in flight per SM, and twice the bytes;
//  - backward, unstaged: the same occupancy without any prefetch (the other block hides the
//    latency).
// The exchanges are double-buffered by group parity: a block writes slot[parity] before the
// group's cluster barrier and reads every block's slot[parity] after it; it can write the same
// slot again only two groups later, after a barrier that every block reaches once done reading.
#include <cooperative_groups.h>

namespace gnv {

// 16-byte asynchronous copy global -> shared (cp.async, L2 only: the data is read once).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Chan's merge of (n, m, q) with (nb, mb, qb): counts, means and centred sums of squares.
template <class A>
__device__ __forceinline__ void chan_merge(A& n, A& m, A& q, A nb, A mb, A qb) {
  const A nn = n + nb;
  if (nn > A(0)) {
    const A d = mb - m;
    const A f = nb / nn;
    m += d * f;
    q += qb + d * d * n * f;
  }
  n = nn;
}

// Cluster-wide (count, mean, M2) of one triple per thread, in every thread; one block barrier and
// one cluster barrier. smem: 96 words, slot: this block's 3 words for this group's parity.
template <int kCl, class A>
__device__ __forceinline__ void cluster_moments(A& n, A& m, A& q, A* slot, A* smem,
                                                cooperative_groups::cluster_group& cluster) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    chan_merge(n, m, q, __shfl_xor_sync(0xffffffffu, n, o), __shfl_xor_sync(0xffffffffu, m, o),
               __shfl_xor_sync(0xffffffffu, q, o));
  // smem is read by warp 0 of the previous group before that group's cluster barrier, which
  // every thread of this block has passed: no barrier needed before rewriting it.
  if (lane == 0) {
    smem[warp] = n;
    smem[32 + warp] = m;
    smem[64 + warp] = q;
  }
  __syncthreads();
  if (warp == 0) {
    n = lane < nwarps ? smem[lane] : A(0);
    m = lane < nwarps ? smem[32 + lane] : A(0);
    q = lane < nwarps ? smem[64 + lane] : A(0);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      chan_merge(n, m, q, __shfl_xor_sync(0xffffffffu, n, o), __shfl_xor_sync(0xffffffffu, m, o),
                 __shfl_xor_sync(0xffffffffu, q, o));
    if (lane == 0) {
      slot[0] = n;
      slot[1] = m;
      slot[2] = q;
    }
  }
  cluster.sync();
  n = m = q = A(0);
#pragma unroll
  for (int r = 0; r < kCl; ++r) {  // the same order in every thread: uniform results
    const A* o = cluster.map_shared_rank(slot, r);
    chan_merge(n, m, q, o[0], o[1], o[2]);
  }
}

// Cluster-wide sums of two values per thread (as cluster_sum2, without the leading barrier: the
// parity slots make it unnecessary, see above). smem: 64 words; slot: 2 words.
template <int kCl, class A>
__device__ __forceinline__ void cluster_sum2p(A& a, A& b, A* slot, A* smem,
                                              cooperative_groups::cluster_group& cluster) {
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
  for (int r = 0; r < kCl; ++r) {
    const A* o = cluster.map_shared_rank(slot, r);
    ta += o[0];
    tb += o[1];
  }
  a = ta;
  b = tb;
}

}  // namespace gnv

// A thread's vectors in a group: k = 0 .. kVPT-1 at element offset toff + k * kStep of the
// group (toff = (v0 + tid) * W, the same in every group), present while k * kClusterBlock < lim.
// One 64-bit base per group plus immediate offsets keeps the address registers few.

// Forward with one exchange per group: kChan selects Chan's merge, otherwise shifted sums.
template <class T, int W, int kVPT, bool kChan, int kCl = kCluster, int kBlk = kClusterBlock>
__global__ void __cluster_dims__(kCl, 1, 1) __launch_bounds__(kBlk, 1024 / kBlk)
    group_forward_cluster1_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                                  T* __restrict__ y, compute_t<T>* __restrict__ mean_out,
                                  compute_t<T>* __restrict__ rstd_out, int64_t rows, int64_t groups, int64_t cg,
                                  int64_t S, compute_t<T> eps) {
  using A = compute_t<T>;
  using R = typename RawVec<T, W>::type;
  constexpr int kStep = kBlk * W;
  namespace coop = cooperative_groups;
  coop::cluster_group cluster = coop::this_cluster();
  __shared__ A smem[96];
  __shared__ A slots[2][3];
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = static_cast<int>(threadIdx.x);
  // A group held by a cluster has at most kCl * kBlk * kVPT vectors: 32-bit indices.
  const int64_t len = cg * S;
  const int nvec = static_cast<int>(len / W), si = static_cast<int>(S);
  const int per = (nvec + kCl - 1) / kCl;
  const int v0 = rank * per, v1 = v0 + per < nvec ? v0 + per : nvec;
  const int toff = (v0 + tid) * W, lim = v1 - v0 - tid;
  // 32-bit group indices (the launcher keeps rows * kCl below 2^31): no 64-bit divisions.
  const int nrows = static_cast<int>(rows), ngroups = static_cast<int>(groups), ncg = static_cast<int>(cg);
  const int stride = static_cast<int>(gridDim.x) / kCl;
  const A inv_len = A(1) / static_cast<A>(len);
  int row = static_cast<int>(blockIdx.x) / kCl;
  R cur[kVPT], nxt[kVPT];
  T kcur = T{}, knxt = T{};  // the shift (shifted sums only)
  auto load = [&](int r, R(&dst)[kVPT], T& kdst) {
    const T* p = x + static_cast<int64_t>(r) * len;
#pragma unroll
    for (int k = 0; k < kVPT; ++k)
      if (k * kBlk < lim) dst[k] = load_raw<T, W>(p + toff + k * kStep);
    if constexpr (!kChan) kdst = p[0];
  };
  if (row < nrows) load(row, cur, kcur);
  for (int parity = 0; row < nrows; row += stride, parity ^= 1) {
    if (row + stride < nrows) load(row + stride, nxt, knxt);
    A m, var;
    if constexpr (kChan) {
      A s = A(0);
      int cnt = 0;
#pragma unroll
      for (int k = 0; k < kVPT; ++k)
        if (k * kBlk < lim) {
          cnt += W;
#pragma unroll
          for (int j = 0; j < W; ++j) s += raw_elem<T, W, A>(cur[k], j);
        }
      A n = static_cast<A>(cnt);
      m = cnt > 0 ? s / n : A(0);
      A q = A(0);
#pragma unroll
      for (int k = 0; k < kVPT; ++k)
        if (k * kBlk < lim)
#pragma unroll
          for (int j = 0; j < W; ++j) {
            const A d = raw_elem<T, W, A>(cur[k], j) - m;
            q += d * d;
          }
      gnv::cluster_moments<kCl>(n, m, q, slots[parity], smem, cluster);
      var = q * inv_len;
    } else {
      const A K = load_as<A>(kcur);
      A s1 = A(0), s2 = A(0);
#pragma unroll
      for (int k = 0; k < kVPT; ++k)
        if (k * kBlk < lim)
#pragma unroll
          for (int j = 0; j < W; ++j) {
            const A d = raw_elem<T, W, A>(cur[k], j) - K;
            s1 += d;
            s2 += d * d;
          }
      gnv::cluster_sum2p<kCl>(s1, s2, slots[parity], smem, cluster);
      const A dm = s1 * inv_len;
      m = K + dm;
      var = s2 * inv_len - dm * dm;
      var = var > A(0) ? var : A(0);
    }
    const A rs = rsqrt_acc(var + eps);
    if (rank == 0 && tid == 0) {
      mean_out[row] = m;
      rstd_out[row] = rs;
    }
    const int c0 = (row % ngroups) * ncg;
    T* out = y + static_cast<int64_t>(row) * len + toff;
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      if (k * kBlk < lim) {
        const int c = c0 + (toff + k * kStep) / si;
        const A scale = w ? rs * load_as<A>(w[c]) : rs;
        const A off = (b ? load_as<A>(b[c]) : A(0)) - m * scale;
        A o[W];
#pragma unroll
        for (int j = 0; j < W; ++j) o[j] = raw_elem<T, W, A>(cur[k], j) * scale + off;
        store_vec<T, W>(out + k * kStep, o);
      }
    }
#pragma unroll
    for (int k = 0; k < kVPT; ++k) cur[k] = nxt[k];
    kcur = knxt;
  }
  cluster.sync();  // the other blocks have read this block's slots
}

// Dynamic shared memory of the staged forward: two groups ahead.
template <int kVPT>
constexpr int gn_fwd_stage_bytes() {
  return 2 * kVPT * kClusterBlock * 16;
}

// Forward, shifted sums with one exchange, the next TWO groups staged in shared memory by
// cp.async (registers hold only the current group): twice the bytes in flight per SM.
template <class T, int W, int kVPT>
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kClusterBlock, 2)
    group_forward_staged_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                                T* __restrict__ y, compute_t<T>* __restrict__ mean_out,
                                compute_t<T>* __restrict__ rstd_out, int64_t rows, int64_t groups, int64_t cg,
                                int64_t S, compute_t<T> eps) {
  using A = compute_t<T>;
  using R = typename RawVec<T, W>::type;
  static_assert(W > 1, "the cluster path moves 16-byte vectors");
  constexpr int kStep = kClusterBlock * W;
  namespace coop = cooperative_groups;
  coop::cluster_group cluster = coop::this_cluster();
  __shared__ A smem[64];
  __shared__ A slots[2][2];
  extern __shared__ uint4 fstage[];  // [2 stages][kVPT][kClusterBlock]
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t len = cg * S;
  const int nvec = static_cast<int>(len / W), si = static_cast<int>(S);
  const int per = (nvec + kCluster - 1) / kCluster;
  const int v0 = rank * per, v1 = v0 + per < nvec ? v0 + per : nvec;
  const int toff = (v0 + tid) * W, lim = v1 - v0 - tid;
  const int nrows = static_cast<int>(rows), ngroups = static_cast<int>(groups), ncg = static_cast<int>(cg);
  const int stride = static_cast<int>(gridDim.x) / kCluster;
  const A inv_len = A(1) / static_cast<A>(len);
  uint4* my_stage = fstage + tid;
  // Copies group r into stage st (an empty commit group past the end keeps the counting uniform).
  auto issue = [&](int r, int st) {
    if (r < nrows) {
      const T* p = x + static_cast<int64_t>(r) * len + toff;
#pragma unroll
      for (int k = 0; k < kVPT; ++k)
        if (k * kClusterBlock < lim) gnv::cp_async16(my_stage + (st * kVPT + k) * kClusterBlock, p + k * kStep);
    }
    gnv::cp_async_commit();
  };
  int row = static_cast<int>(blockIdx.x) / kCluster;
  issue(row, 0);
  issue(row + stride, 1);
  T knxt = row < nrows ? x[static_cast<int64_t>(row) * len] : T{};
  for (int parity = 0; row < nrows; row += stride, parity ^= 1) {
    const A K = load_as<A>(knxt);
    if (row + stride < nrows) knxt = x[static_cast<int64_t>(row + stride) * len];
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");  // this group's copies (own: no barrier)
    R cur[kVPT];
#pragma unroll
    for (int k = 0; k < kVPT; ++k)
      if (k * kClusterBlock < lim) cur[k] = my_stage[(parity * kVPT + k) * kClusterBlock];
    A s1 = A(0), s2 = A(0);
#pragma unroll
    for (int k = 0; k < kVPT; ++k)
      if (k * kClusterBlock < lim)
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const A d = raw_elem<T, W, A>(cur[k], j) - K;
          s1 += d;
          s2 += d * d;
        }
    issue(row + 2 * stride, parity);  // the stage was read above (its values are in use)
    gnv::cluster_sum2p<kCluster>(s1, s2, slots[parity], smem, cluster);
    const A dm = s1 * inv_len;
    const A m = K + dm;
    A var = s2 * inv_len - dm * dm;
    var = var > A(0) ? var : A(0);
    const A rs = rsqrt_acc(var + eps);
    if (rank == 0 && tid == 0) {
      mean_out[row] = m;
      rstd_out[row] = rs;
    }
    const int c0 = (row % ngroups) * ncg;
    T* out = y + static_cast<int64_t>(row) * len + toff;
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      if (k * kClusterBlock < lim) {
        const int c = c0 + (toff + k * kStep) / si;
        const A scale = w ? rs * load_as<A>(w[c]) : rs;
        const A off = (b ? load_as<A>(b[c]) : A(0)) - m * scale;
        A o[W];
#pragma unroll
        for (int j = 0; j < W; ++j) o[j] = raw_elem<T, W, A>(cur[k], j) * scale + off;
        store_vec<T, W>(out + k * kStep, o);
      }
    }
  }
  gnv::cp_async_wait_all();  // no copy may land after the block has exited
  cluster.sync();            // the other blocks have read this block's slots
}

// Backward modes (Note [GroupNorm cluster variants]).
enum GnBwdMode : int {
  kBwdRegs = 1,      // next group prefetched into registers, with its mean, rstd
  kBwdUnstaged = 2,  // no prefetch, two blocks per SM
  kBwdStaged = 3,    // next group staged in shared memory by cp.async, two blocks per SM
  kBwdStaged2 = 4,   // next two groups staged (two stages), one block per SM, registers: the current
};

template <int kVPT, int kMode, int kBlk>
constexpr int gn_bwd_min_blocks() {
  return ((kMode == kBwdUnstaged || kMode == kBwdStaged) && kVPT <= 4 ? 2 : 1) * (kClusterBlock / kBlk);
}

// Dynamic shared memory of a staged backward: x and dy of the next group (two stages: of the
// next two groups).
template <int kVPT, int kMode>
constexpr int gn_bwd_stage_bytes() {
  return kMode == kBwdStaged ? 2 * kVPT * kClusterBlock * 16 : kMode == kBwdStaged2 ? 4 * kVPT * kClusterBlock * 16 : 0;
}

template <class T, int W, int kVPT, int kMode, int kCl = kCluster, int kBlk = kClusterBlock>
__global__ void __cluster_dims__(kCl, 1, 1) __launch_bounds__(kBlk, (gn_bwd_min_blocks<kVPT, kMode, kBlk>()))
    group_backward_cluster1_kernel(const T* __restrict__ dy, const T* __restrict__ x,
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
  extern __shared__ uint4 stage[];  // staged: [2][kVPT][kBlk], x then dy
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
  constexpr int kNext = kMode == kBwdRegs ? kVPT : 1;
  R cx[kVPT], cd[kVPT], nx[kNext], nd[kNext];
  A nm = A(0), nrs = A(0), nm2 = A(0), nrs2 = A(0);  // statistics of the next (two) groups
  uint4* my_stage = stage + tid;
  // Starts loading group r (its statistics; its values unless unstaged). Two stages: into stage
  // st, with an empty commit group past the end so that the counting stays uniform.
  auto fetch2 = [&](int r, int st) {
    if (r < nrows) {
      nm2 = mean[r];
      nrs2 = rstd[r];
      const T* px = x + static_cast<int64_t>(r) * len + toff;
      const T* pd = dy + static_cast<int64_t>(r) * len + toff;
#pragma unroll
      for (int k = 0; k < kVPT; ++k)
        if (k * kBlk < lim) {
          gnv::cp_async16(my_stage + (st * 2 * kVPT + k) * kBlk, px + k * kStep);
          gnv::cp_async16(my_stage + (st * 2 * kVPT + kVPT + k) * kBlk, pd + k * kStep);
        }
    }
    gnv::cp_async_commit();
  };
  auto fetch = [&](int r) {
    nm = mean[r];
    nrs = rstd[r];
    const T* px = x + static_cast<int64_t>(r) * len + toff;
    const T* pd = dy + static_cast<int64_t>(r) * len + toff;
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      if (k * kBlk < lim) {
        if constexpr (kMode == kBwdRegs) {
          nx[k] = load_raw<T, W>(px + k * kStep);
          nd[k] = load_raw<T, W>(pd + k * kStep);
        } else if constexpr (kMode == kBwdStaged) {
          gnv::cp_async16(my_stage + k * kBlk, px + k * kStep);
          gnv::cp_async16(my_stage + (kVPT + k) * kBlk, pd + k * kStep);
        }
      }
    }
    if constexpr (kMode == kBwdStaged) gnv::cp_async_commit();
  };
  int row = static_cast<int>(blockIdx.x) / kCl;
  if constexpr (kMode == kBwdStaged2) {
    fetch2(row, 0);
    nm = nm2;
    nrs = nrs2;
    fetch2(row + stride, 1);
  } else if (row < nrows) {
    fetch(row);
  }
  for (int parity = 0; row < nrows; row += stride, parity ^= 1) {
    const bool more = row + stride < nrows;
    if constexpr (kMode == kBwdStaged2) {
      asm volatile("cp.async.wait_group 1;\n" ::: "memory");  // this group's own copies
#pragma unroll
      for (int k = 0; k < kVPT; ++k)
        if (k * kBlk < lim) {
          cx[k] = my_stage[(parity * 2 * kVPT + k) * kBlk];
          cd[k] = my_stage[(parity * 2 * kVPT + kVPT + k) * kBlk];
        }
    } else if constexpr (kMode == kBwdRegs) {
#pragma unroll
      for (int k = 0; k < kVPT; ++k) {
        cx[k] = nx[k];
        cd[k] = nd[k];
      }
    } else if constexpr (kMode == kBwdUnstaged) {
      const T* px = x + static_cast<int64_t>(row) * len + toff;
      const T* pd = dy + static_cast<int64_t>(row) * len + toff;
#pragma unroll
      for (int k = 0; k < kVPT; ++k)
        if (k * kBlk < lim) {
          cx[k] = load_raw<T, W>(px + k * kStep);
          cd[k] = load_raw<T, W>(pd + k * kStep);
        }
    } else {
      gnv::cp_async_wait_all();  // this thread's own copies: no barrier needed
#pragma unroll
      for (int k = 0; k < kVPT; ++k)
        if (k * kBlk < lim) {
          cx[k] = my_stage[k * kBlk];
          cd[k] = my_stage[(kVPT + k) * kBlk];
        }
    }
    const A m = nm, rs = nrs;
    if constexpr (kMode == kBwdStaged2) {
      nm = nm2;
      nrs = nrs2;
    }
    // Staged: the next copies overwrite the stage only after this group's values were used (below).
    if (kMode != kBwdStaged && kMode != kBwdStaged2 && more) fetch(row + stride);
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
    if (kMode == kBwdStaged && more) fetch(row + stride);
    if constexpr (kMode == kBwdStaged2) fetch2(row + 2 * stride, parity);
    gnv::cluster_sum2p<kCl>(sg, sgx, slots[parity], smem, cluster);  // its cluster.sync also orders acc
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
  if constexpr (kMode == kBwdStaged2) gnv::cp_async_wait_all();  // no copy lands after exit
  cluster.sync();  // the other blocks have read this block's slots and accumulators
}
