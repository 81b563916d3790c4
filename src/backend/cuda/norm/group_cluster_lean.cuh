// GroupNorm on clusters, the lean kernels (Notes [GroupNorm lean backward] and [GroupNorm lean
// forward]). Included by norm_channels.cu inside its anonymous namespace, after group_cluster.cuh.
//
// Note [GroupNorm lean backward]
// The cluster backward of group_cluster.cuh spills about 160 bytes per thread at its 64-register
// bound (Nsight: 4.3 M local spill requests for [32, 512, 64, 64], competing with the real loads):
// per vector it keeps two partial sums live across the unrolled loop, reduces them with a full
// warp shuffle tree each, tests channel uniformity with __all_sync, and recomputes the channel by
// a 32-bit division per vector, twice. This kernel keeps the same data layout (x and dy of a
// group packed in registers, a cluster of kCl blocks per group, persistent clusters, no
// prefetch) and changes the reductions:
//  - It runs only where every warp's vector k lies in ONE channel: S a multiple of 32 vectors and
//    the rank slices rounded up to 32 vectors (the launcher checks S; other shapes keep the
//    existing kernel). Then a warp's 2 * kVPT partial sums (sum dy and sum dy * (x - mean) per k)
//    are reduced by one transposed butterfly: each stage halves the values a lane keeps while
//    doubling the lanes summed (2 * kVPT - 1 + log2(32 / (2 * kVPT)) shuffles instead of
//    2 * kVPT * 5), after which lane j * 32 / (2 * kVPT) holds the warp's total of value j and
//    adds it to the block's per-channel accumulator in shared memory (one atomicAdd per value,
//    one per warp instead of one per lane).
//  - ONE reduction structure: the group sums that dx needs are derived from the per-channel
//    sums (sum g = sum_c w_c * sum dy_c, sum g * xhat = rstd * sum_c w_c * sum dy (x - mean)_c),
//    so there is no separate block reduction. After the cluster barrier, warp 0 of each block
//    reads the kCl blocks' accumulators of the group's channels through distributed shared
//    memory (32-bit mapa addresses: map_shared_rank's 64-bit pointers made ptxas spill), rank 0
//    writes the per-(n, c) partials, every block folds the weight and publishes mean(g),
//    mean(g * xhat) and rstd * w_c (per channel) in shared memory behind one block barrier: two
//    barriers per group (cluster, block) instead of three.
//  - The channel of a thread's vectors is computed once per kernel (it does not depend on the
//    group) by the lanes holding the sums; dx lanes fetch it by a shuffle.
//  - dx = rstd * w_c * dy + (x - mean) * (-rstd^2 * mean(g * xhat)) - rstd * mean(g): one
//    subtraction and two multiply-adds per value, with the per-group factors hoisted.
// Synchronisation: the accumulators are double-buffered by group parity. A block adds into slot
// p before the group's cluster barrier (whose arrive releases the shared-memory writes of every
// thread); the other blocks read it after that barrier and before they arrive at the next
// group's barrier, so slot p is free again once this block has passed the next group's barrier,
// where the block clears it before the block barrier that precedes the next atomics into it.
// The final cluster barrier keeps each block's shared memory alive until the others have read it.
// Every thread reaches every barrier (the group loop is uniform over the cluster).
// Measured (H100, bf16, [32, 512, 64, 64], 32 groups; one GPU run, the variants side by side):
// the backward alone 0.227 ms -> 0.155 ms (60% -> 87% of copy), forward + backward 66% -> 84%.
// Clusters of 8 blocks of 256 threads (4 per SM) and of 4 of 512 (2 per SM) were within 1% of
// each other; 8 of 512 at 3 blocks per SM (40 registers, 2 vectors per thread) and a variant in
// which every warp derived the group sums itself (no block barrier, 3 accumulator slots, 16 times
// the distributed-shared-memory reads) were slower (docs/nn-norm.md).

namespace gn_lean {

// Sums each of v[0 .. N) over the warp (N a power of two, at most 32); returns the total of
// value lane / (32 / N) (exact in every lane whose lane % (32 / N) == 0, also in the others).
template <int N, class A>
__device__ __forceinline__ A warp_sum_transposed(A (&v)[N], int lane) {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "a power of two up to 32 values");
  constexpr int kHalvings = N == 1 ? 0 : N == 2 ? 1 : N == 4 ? 2 : N == 8 ? 3 : N == 16 ? 4 : 5;
#pragma unroll
  for (int s = 0; s < kHalvings; ++s) {
    const int o = 16 >> s, n = N >> s, h = n / 2;
    const bool up = (lane & o) != 0;  // keeps the upper half of the values
#pragma unroll
    for (int i = 0; i < h; ++i) {
      const A send = up ? v[i] : v[i + h];
      const A keep = up ? v[i + h] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
  }
  A r = v[0];
#pragma unroll
  for (int o = 16 >> kHalvings; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
  return r;
}

// 32-bit distributed-shared-memory access: the rank's copy of a shared-memory address, and a
// load from it (map_shared_rank's 64-bit generic pointers cost two registers each).
__device__ __forceinline__ uint32_t dsmem_map(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ float dsmem_load(uint32_t addr, float) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ double dsmem_load(uint32_t addr, double) {
  double v;
  asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(addr) : "memory");
  return v;
}

// Registers a block of kBlk threads may use for kMinBlocks blocks per SM, rounded to 8.
constexpr int reg_cap(int blk, int min_blocks) { return (65536 / (blk * min_blocks)) / 8 * 8; }

// Blocks per SM to ask for: up to `want`, while x and dy (8 registers per vector) plus about 24
// more still fit.
constexpr int min_blocks(int vpt, int blk, int want) {
  for (int b = want; b > 1; --b)
    if (reg_cap(blk, b) >= 8 * vpt + 24) return b;
  return 1;
}

// The same for the forward: x alone (4 registers per vector), twice with the next group prefetched.
constexpr int forward_min_blocks(int vpt, int blk, int want, bool prefetch) {
  for (int b = want; b > 1; --b)
    if (reg_cap(blk, b) >= 4 * vpt * (prefetch ? 2 : 1) + 24) return b;
  return 1;
}

}  // namespace gn_lean

template <class T, int W, int kVPT, int kCl, int kBlk, int kMinBlocks>
__global__ void __cluster_dims__(kCl, 1, 1) __launch_bounds__(kBlk, kMinBlocks)
    group_backward_lean_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                               const compute_t<T>* __restrict__ mean, const compute_t<T>* __restrict__ rstd,
                               const T* __restrict__ w, T* __restrict__ dx, compute_t<T>* __restrict__ part_w,
                               compute_t<T>* __restrict__ part_b, int64_t rows, int64_t groups, int64_t cg,
                               int64_t S) {
  using A = compute_t<T>;
  using R = typename RawVec<T, W>::type;
  static_assert(W > 1, "the cluster path moves 16-byte vectors");
  constexpr int kN = 2 * kVPT;      // partial sums per thread and group
  constexpr int kHold = 32 / kN;    // lanes between the holders of consecutive values
  constexpr int kStep = kBlk * W;
  namespace coop = cooperative_groups;
  coop::cluster_group cluster = coop::this_cluster();
  // Per channel of the group: sum dy (0) and sum dy * (x - mean) (1), by slot (group parity).
  constexpr int kSlots = 2;
  __shared__ A acc[kSlots][2][kClusterMaxChannels];
  __shared__ A scale[kClusterMaxChannels];  // rstd * w_c of the current group
  __shared__ A bc[2];                       // mean(g), mean(g * xhat) of the current group
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5;
  const int64_t len = cg * S;
  const int nvec = static_cast<int>(len / W), si = static_cast<int>(S);
  // Rank slices of whole warps (32 vectors) so that a warp's vector k lies in one channel.
  const int per = ((nvec + kCl - 1) / kCl + 31) / 32 * 32;
  const int v0 = rank * per < nvec ? rank * per : nvec;
  const int v1 = v0 + per < nvec ? v0 + per : nvec;
  const int toff = (v0 + tid) * W, lim = v1 - v0 - tid;
  const int nrows = static_cast<int>(rows), ncg = static_cast<int>(cg);
  const int stride = static_cast<int>(gridDim.x) / kCl;
  const A inv_len = A(1) / static_cast<A>(len);
  // The value this lane holds after the butterfly: j = lane / kHold, vector k = j / 2; its
  // channel within the group (the same for every group).
  const int hold_j = lane / kHold, hold_k = hold_j >> 1;
  const bool holder = lane % kHold == 0 && hold_k * kBlk < v1 - v0 - warp * 32;
  const int hold_c = holder ? ((v0 + warp * 32) * W + hold_k * kStep) / si : 0;
  for (int i = tid; i < kSlots * 2 * kClusterMaxChannels; i += kBlk) (&acc[0][0][0])[i] = A(0);
  __syncthreads();
  R cx[kVPT], cd[kVPT];
  int row = static_cast<int>(blockIdx.x) / kCl;
  for (int slot = 0; row < nrows; row += stride, slot = slot + 1 == kSlots ? 0 : slot + 1) {
    const T* px = x + static_cast<int64_t>(row) * len + toff;
    const T* pd = dy + static_cast<int64_t>(row) * len + toff;
#pragma unroll
    for (int k = 0; k < kVPT; ++k)
      if (k * kBlk < lim) {
        cx[k] = load_raw<T, W>(px + k * kStep);
        cd[k] = load_raw<T, W>(pd + k * kStep);
      }
    const A m = mean[row], rs = rstd[row];
    A v[kN];
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      A s_dy = A(0), s_dyx = A(0);
      if (k * kBlk < lim) {
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const A de = raw_elem<T, W, A>(cd[k], j);
          s_dy += de;
          s_dyx += de * (raw_elem<T, W, A>(cx[k], j) - m);
        }
      }
      v[2 * k] = s_dy;
      v[2 * k + 1] = s_dyx;
    }
    const A total = gn_lean::warp_sum_transposed<kN>(v, lane);
    A(&ac)[2][kClusterMaxChannels] = acc[slot];
    if (holder) atomicAdd(&ac[hold_j & 1][hold_c], total);
    const int c0 = (row % static_cast<int>(groups)) * ncg;
    // The slot before this one (the previous group's) has been read by every block once this
    // block passes this group's cluster barrier: cleared here for the group kSlots - 1 ahead.
    A(&prev)[2][kClusterMaxChannels] = acc[slot == 0 ? kSlots - 1 : slot - 1];
    // Warp 0's first weights, in flight across the barrier.
    const A w_first = warp == 0 && w != nullptr && lane < ncg ? load_as<A>(w[c0 + lane]) : A(1);
    cluster.sync();  // every block's accumulators of this group are complete
    if (warp == 0) {
      A pg = A(0), pgx = A(0);
      const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(&ac[0][0]));
      for (int ci = lane; ci < ncg; ci += 32) {
        A tb = A(0), tw = A(0);
#pragma unroll
        for (int r = 0; r < kCl; ++r) {  // the same order in every block: uniform results
          const uint32_t o = gn_lean::dsmem_map(base + ci * static_cast<uint32_t>(sizeof(A)), r);
          tb += gn_lean::dsmem_load(o, A(0));
          tw += gn_lean::dsmem_load(o + kClusterMaxChannels * static_cast<uint32_t>(sizeof(A)), A(0));
        }
        tw *= rs;  // sum dy * xhat
        const A wc = ci < 32 ? w_first : w ? load_as<A>(w[c0 + ci]) : A(1);
        pg += wc * tb;
        pgx += wc * tw;
        scale[ci] = rs * wc;
        if (part_w != nullptr && rank == 0) {
          const int pi = row * ncg + ci;  // (n, c0 + ci) of [N, C] (N * C < 2^31: the launcher)
          part_w[pi] = tw;
          part_b[pi] = tb;
        }
      }
      A two[2] = {pg, pgx};
      const A t = gn_lean::warp_sum_transposed<2>(two, lane);
      if (lane == 0) bc[0] = t * inv_len;
      if (lane == 16) bc[1] = t * inv_len;
    }
    for (int i = tid; i < ncg; i += kBlk) prev[0][i] = prev[1][i] = A(0);
    __syncthreads();  // bc, scale published; the clearing precedes the next group's atomics
    if (dx) {
      const A mg = bc[0], mgx = bc[1];
      const A bx = -rs * rs * mgx, cc = -rs * mg;
      T* out = dx + static_cast<int64_t>(row) * len + toff;
#pragma unroll
      for (int k = 0; k < kVPT; ++k) {
        const int ck = __shfl_sync(0xffffffffu, hold_c, 2 * k * kHold);  // vector k's channel
        if (k * kBlk < lim) {
          const A ak = scale[ck];
          A o[W];
#pragma unroll
          for (int j = 0; j < W; ++j)
            o[j] = ak * raw_elem<T, W, A>(cd[k], j) + ((raw_elem<T, W, A>(cx[k], j) - m) * bx + cc);
          store_vec<T, W>(out + k * kStep, o);
        }
      }
    }
    // No barrier here: warp 0 rewrites scale and bc only after the next group's cluster
    // barrier, which every thread of the block reaches after its dx.
  }
  cluster.sync();  // the other blocks have read this block's accumulators
}

// Note [GroupNorm lean forward]
// The cluster forward (one exchange of shifted sums per group, Note [GroupNorm clusters]) with the
// backward's exchange technique: each warp reduces its two sums by the transposed butterfly
// (5 shuffles instead of 10) and writes them to its own slot of the block's shared memory (no
// atomics, no clearing: double-buffered by group parity as the backward's accumulators); after
// the cluster barrier every warp reads the kCl * kBlk / 32 warp slots of the cluster through
// 32-bit mapa addresses (a few per lane) and reduces them itself, in the same order in every warp
// (uniform, deterministic statistics). One barrier per group (the cluster's) instead of a block
// barrier, a serial warp-0 reduction and the cluster barrier. kPrefetch: the next group is loaded
// into registers while the current one is reduced; without it, fewer registers and more blocks
// per SM. Measured (H100, bf16, [32, 512, 64, 64], 32 groups): 77.6% -> 85.5% of copy with
// clusters of 8 blocks of 256 threads, 4 per SM, prefetching (the launcher's choice); 4 x 512
// with or without prefetch within 0.3% of it, 8 x 256 without prefetch at 6 blocks per SM 81.3%
// (docs/nn-norm.md).
template <class T, int W, int kVPT, int kCl, int kBlk, int kMinBlocks, bool kPrefetch>
__global__ void __cluster_dims__(kCl, 1, 1) __launch_bounds__(kBlk, kMinBlocks)
    group_forward_lean_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                              T* __restrict__ y, compute_t<T>* __restrict__ mean_out,
                              compute_t<T>* __restrict__ rstd_out, int64_t rows, int64_t groups, int64_t cg,
                              int64_t S, compute_t<T> eps) {
  using A = compute_t<T>;
  using R = typename RawVec<T, W>::type;
  static_assert(W > 1, "the cluster path moves 16-byte vectors");
  constexpr int kStep = kBlk * W;
  constexpr int kWarps = kBlk / 32;
  constexpr int kEntries = kCl * kWarps;  // warp slots per cluster
  namespace coop = cooperative_groups;
  coop::cluster_group cluster = coop::this_cluster();
  __shared__ A part[2][kWarps][2];  // per warp: sum (x - K), sum (x - K)^2, by group parity
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5;
  const int64_t len = cg * S;
  const int nvec = static_cast<int>(len / W), si = static_cast<int>(S);
  const int per = (nvec + kCl - 1) / kCl;
  const int v0 = rank * per, v1 = v0 + per < nvec ? v0 + per : nvec;
  const int toff = (v0 + tid) * W, lim = v1 - v0 - tid;
  const int nrows = static_cast<int>(rows), ngroups = static_cast<int>(groups), ncg = static_cast<int>(cg);
  const int stride = static_cast<int>(gridDim.x) / kCl;
  const A inv_len = A(1) / static_cast<A>(len);
  int row = static_cast<int>(blockIdx.x) / kCl;
  R cur[kVPT];
  T kcur = T{};
  auto load = [&](int r, R(&dst)[kVPT], T& kdst) {
    const T* p = x + static_cast<int64_t>(r) * len;
#pragma unroll
    for (int k = 0; k < kVPT; ++k)
      if (k * kBlk < lim) dst[k] = load_raw<T, W>(p + toff + k * kStep);
    kdst = p[0];
  };
  [[maybe_unused]] R nxt[kPrefetch ? kVPT : 1];
  [[maybe_unused]] T knxt = T{};
  if constexpr (kPrefetch) {
    if (row < nrows) load(row, cur, kcur);
  }
  for (int parity = 0; row < nrows; row += stride, parity ^= 1) {
    if constexpr (kPrefetch) {
      if (row + stride < nrows) load(row + stride, nxt, knxt);
    } else {
      load(row, cur, kcur);
    }
    const A K = load_as<A>(kcur);
    A s[2] = {A(0), A(0)};
#pragma unroll
    for (int k = 0; k < kVPT; ++k)
      if (k * kBlk < lim)
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const A d = raw_elem<T, W, A>(cur[k], j) - K;
          s[0] += d;
          s[1] += d * d;
        }
    {
      const A t = gn_lean::warp_sum_transposed<2>(s, lane);  // lane 0: sum d, lane 16: sum d^2
      if ((lane & 15) == 0) part[parity][warp][lane >> 4] = t;
    }
    cluster.sync();  // every warp slot of the cluster holds this group's sums
    A a[2] = {A(0), A(0)};
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(&part[parity][0][0]));
#pragma unroll
    for (int e = lane; e < kEntries; e += 32) {  // the same order in every warp: uniform results
      const uint32_t o = gn_lean::dsmem_map(base + (e % kWarps) * 2 * static_cast<uint32_t>(sizeof(A)), e / kWarps);
      a[0] += gn_lean::dsmem_load(o, A(0));
      a[1] += gn_lean::dsmem_load(o + static_cast<uint32_t>(sizeof(A)), A(0));
    }
    const A t = gn_lean::warp_sum_transposed<2>(a, lane);
    const A s1 = __shfl_sync(0xffffffffu, t, 0), s2 = __shfl_sync(0xffffffffu, t, 16);
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
    if constexpr (kPrefetch) {
#pragma unroll
      for (int k = 0; k < kVPT; ++k) cur[k] = nxt[k];
      kcur = knxt;
    }
  }
  cluster.sync();  // the other blocks have read this block's warp slots
}
