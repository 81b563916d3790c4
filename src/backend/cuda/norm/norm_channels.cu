// CUDA group_norm and batch_norm kernels and launchers (Note [CUDA norm kernels] in
// norm_kernels.cuh); x is [N, C, S] contiguous.
#include <cooperative_groups.h>

#include <algorithm>
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

#include "src/backend/cuda/norm/group_cluster.cuh"
#include "src/backend/cuda/norm/group_cluster_lean.cuh"

// Clusters resident at once for a cluster kernel of kCl blocks of kBlk threads (0 when the query
// fails: then one per group).
template <int kCl = kCluster, int kBlk = kClusterBlock, class Kernel>
int64_t resident_clusters(Kernel kernel) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(kCl * 1024);
  cfg.blockDim = dim3(kBlk);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// Grid of a persistent cluster kernel over `rows` groups: the resident clusters (queried once per
// kernel and device), or one cluster per group when fewer.
template <int kCl = kCluster, int kBlk = kClusterBlock, class Kernel>
unsigned cluster_grid(Kernel kernel, int64_t rows) {
  static thread_local std::map<std::pair<const void*, int>, int64_t> cache;
  int dev = 0;
  FLAME_CUDA_CHECK(cudaGetDevice(&dev));
  auto key = std::make_pair(reinterpret_cast<const void*>(kernel), dev);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, resident_clusters<kCl, kBlk>(kernel)).first;
  const int64_t k = it->second > 0 ? std::min(rows, it->second) : rows;
  return static_cast<unsigned>(k * kCl);
}

// Vectors per thread for a group of `nvec` vectors on a cluster of `threads` threads (0: too long).
inline int cluster_vpt(int64_t nvec, int max_vpt, int64_t threads = int64_t{kCluster} * kClusterBlock) {
  for (int v = 1; v <= max_vpt; v *= 2)
    if (nvec <= static_cast<int64_t>(v) * threads) return v;
  return 0;
}

// Launches the lean cluster forward on clusters of kCl blocks of kBlk threads (up to kWant blocks
// per SM) when the group fits; false (nothing launched) otherwise.
template <class T, int W, int kCl, int kBlk, int kWant, bool kPrefetch>
bool launch_group_forward_lean(cudaStream_t st, const T* xp, const T* wp, const T* bp, T* yp, compute_t<T>* mean,
                               compute_t<T>* rstd, int64_t rows, int64_t groups, int64_t cg, int64_t S,
                               compute_t<T> eps) {
  const int vpt = cluster_vpt(cg * S / W, 32 / W, int64_t{kCl} * kBlk);
  if (vpt == 0 || rows * kCl > (int64_t{1} << 31) - 1) return false;
  bool launched = false;
  auto pick = [&](auto vpt_tag) {
    constexpr int VPT = decltype(vpt_tag)::value;
    if constexpr (VPT * W <= 32) {
      if (vpt != VPT) return;
      auto kernel = group_forward_lean_kernel<T, W, VPT, kCl, kBlk,
                                              gn_lean::forward_min_blocks(VPT, kBlk, kWant, kPrefetch), kPrefetch>;
      kernel<<<cluster_grid<kCl, kBlk>(kernel, rows), kBlk, 0, st>>>(xp, wp, bp, yp, mean, rstd, rows, groups, cg, S,
                                                                      eps);
      FLAME_CUDA_CHECK_LAUNCH();
      launched = true;
    }
  };
  pick(std::integral_constant<int, 1>{});
  pick(std::integral_constant<int, 2>{});
  pick(std::integral_constant<int, 4>{});
  pick(std::integral_constant<int, 8>{});
  return launched;
}

// Launches the lean cluster backward on clusters of kCl blocks of kBlk threads (up to kWant blocks
// per SM) when the group fits; false (nothing launched) otherwise.
template <class T, int W, int kCl, int kBlk, int kWant>
bool launch_group_backward_lean(cudaStream_t st, const T* dyp, const T* xp, const compute_t<T>* mean,
                                const compute_t<T>* rstd, const T* wp, T* dxp, compute_t<T>* pw,
                                compute_t<T>* pb, int64_t rows, int64_t groups, int64_t cg, int64_t S) {
  const int vpt = cluster_vpt(cg * S / W, 32 / W, int64_t{kCl} * kBlk);
  // 32-bit group indices (rows * kCl) and partial indices (rows * cg = N * C).
  if (vpt == 0 || rows * kCl > (int64_t{1} << 31) - 1 || rows * cg > (int64_t{1} << 31) - 1) return false;
  bool launched = false;
  auto pick = [&](auto vpt_tag) {
    constexpr int VPT = decltype(vpt_tag)::value;
    if constexpr (VPT * W <= 32) {
      if (vpt != VPT) return;
      auto kernel = group_backward_lean_kernel<T, W, VPT, kCl, kBlk, gn_lean::min_blocks(VPT, kBlk, kWant)>;
      kernel<<<cluster_grid<kCl, kBlk>(kernel, rows), kBlk, 0, st>>>(dyp, xp, mean, rstd, wp, dxp, pw, pb, rows,
                                                                      groups, cg, S);
      FLAME_CUDA_CHECK_LAUNCH();
      launched = true;
    }
  };
  pick(std::integral_constant<int, 1>{});
  pick(std::integral_constant<int, 2>{});
  pick(std::integral_constant<int, 4>{});
  pick(std::integral_constant<int, 8>{});
  return launched;
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

struct NCS {
  int64_t n, c, s;
};
NCS ncs(const Tensor& x) {
  NCS d{x.sizes()[0], x.sizes()[1], 1};
  for (int64_t i = 2; i < x.dim(); ++i) d.s *= x.sizes()[i];
  return d;
}

unsigned int channel_grid(int64_t units) { return grid_for(units, 1, 1 << 20); }

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
  // Note [GroupNorm lean forward]: a group in the registers of a cluster of 8 blocks of 256
  // threads when it fits (32 values per thread).
  if (vec && launch_group_forward_lean<T, W, 8, 256, 4, true>(st, xp, wp, bp, yp, mptr<A>(mean), mptr<A>(rstd), rows,
                                                              groups, cg, d.s, static_cast<A>(eps))) {
    return;
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
  // Note [GroupNorm lean backward]: clusters of 8 blocks of 256 threads, where every warp's vector
  // lies in one channel; other shapes take the kernels below.
  if (vec && cg <= kClusterMaxChannels && (d.s / W) % 32 == 0) {
    const bool launched = launch_group_backward_lean<T, W, 8, 256, 4>(st, dyp, xp, cptr<A>(mean), cptr<A>(rstd), wp,
                                                                      dxp, pw, pb, rows, groups, cg, d.s);
    if (launched) {
      if (params) {
        column_sum_kernel<T><<<grid_for(d.c, 32), dim3(32, 16), 0, st>>>(pw, pb, dwp, dbp, d.n, d.c);
        FLAME_CUDA_CHECK_LAUNCH();
      }
      return;
    }
  }
  // Note [GroupNorm clusters]: x and dy of a group in the registers of a cluster (32 values per thread).
  const int vpt = vec && cg <= kClusterMaxChannels ? cluster_vpt(cg * d.s / W, 32 / W) : 0;
  if (vpt > 0 && rows * kCluster <= (int64_t{1} << 31) - 1) {
    bool launched = false;
    auto pick = [&](auto vpt_tag) {
      constexpr int VPT = decltype(vpt_tag)::value;
      if constexpr (VPT * W <= 32) {
        if (vpt != VPT) return;
        auto kernel = group_backward_cluster_kernel<T, W, VPT>;
        kernel<<<cluster_grid(kernel, rows), kClusterBlock, 0, st>>>(dyp, xp, cptr<A>(mean), cptr<A>(rstd), wp, dxp,
                                                                     pw, pb, rows, groups, cg, d.s);
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
