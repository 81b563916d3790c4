#pragma once
// The CUDA reduction kernels (Note [CUDA reduction paths] in reduce.cu) and their launcher, shared
// by the per-family files reduce_*.cu. Each family file instantiates reduce_op<Op> for its ops
// only, so the ~300 kernels compile in parallel; reduce.cu dispatches on the op.
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <type_traits>
#include <vector>

#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/backend/cuda/launch_geometry.cuh"

namespace flame::backend::cuda {

// ---------------------------------------------------------------------------------------------
// Reduction functors: identity, combine, make (element -> accumulator), finish (-> dst)
// ---------------------------------------------------------------------------------------------


template <class C>
struct ArgAcc {
  C v;
  int64_t i;
};
template <class C>
__device__ __forceinline__ ArgAcc<C> shfl_xor(ArgAcc<C> a, int m) {
  return {shfl_xor(a.v, m), shfl_xor(a.i, m)};
}

template <ReduceOp Op, class C>
struct Reducer;

template <class C>
struct SumBase {
  using Acc = C;
  static __device__ __forceinline__ Acc identity() { return C(0); }
  static __device__ __forceinline__ Acc combine(Acc a, Acc b) {
    if constexpr (std::is_integral_v<C>) return wrap_add(a, b);
    else return a + b;
  }
  static __device__ __forceinline__ Acc make(C x, int64_t) { return x; }
};
template <class C>
struct Reducer<ReduceOp::sum, C> : SumBase<C> {
  static __device__ __forceinline__ void finish(C a, int64_t, void* d, int64_t o, DType dt) { store_dyn(d, o, dt, a); }
};
template <class C>
struct Reducer<ReduceOp::mean, C> : SumBase<C> {
  static __device__ __forceinline__ void finish(C a, int64_t n, void* d, int64_t o, DType dt) {
    if constexpr (std::is_floating_point_v<C>) store_dyn(d, o, dt, a / static_cast<C>(n));  // n = 0: nan
    else store_dyn(d, o, dt, static_cast<double>(a) / static_cast<double>(n));
  }
};
template <class C>
struct Reducer<ReduceOp::prod, C> {
  using Acc = C;
  static __device__ __forceinline__ Acc identity() { return C(1); }
  static __device__ __forceinline__ Acc combine(Acc a, Acc b) {
    if constexpr (std::is_integral_v<C>) return wrap_mul(a, b);
    else return a * b;
  }
  static __device__ __forceinline__ Acc make(C x, int64_t) { return x; }
  static __device__ __forceinline__ void finish(C a, int64_t, void* d, int64_t o, DType dt) { store_dyn(d, o, dt, a); }
};
template <class C>
struct Reducer<ReduceOp::max, C> {
  using Acc = C;
  static __device__ __forceinline__ Acc identity() { return lowest<C>(); }
  static __device__ __forceinline__ Acc combine(Acc a, Acc b) {
    if (is_nan(a)) return a;
    if (is_nan(b)) return b;
    return a > b ? a : b;
  }
  static __device__ __forceinline__ Acc make(C x, int64_t) { return x; }
  static __device__ __forceinline__ void finish(C a, int64_t, void* d, int64_t o, DType dt) { store_dyn(d, o, dt, a); }
};
template <class C>
struct Reducer<ReduceOp::min, C> {
  using Acc = C;
  static __device__ __forceinline__ Acc identity() { return highest<C>(); }
  static __device__ __forceinline__ Acc combine(Acc a, Acc b) {
    if (is_nan(a)) return a;
    if (is_nan(b)) return b;
    return a < b ? a : b;
  }
  static __device__ __forceinline__ Acc make(C x, int64_t) { return x; }
  static __device__ __forceinline__ void finish(C a, int64_t, void* d, int64_t o, DType dt) { store_dyn(d, o, dt, a); }
};
// argmax / argmin: (value, logical index); identity index INT64_MAX loses every tie.
template <bool kMax, class C>
struct ArgReducer {
  using Acc = ArgAcc<C>;
  static __device__ __forceinline__ Acc identity() { return {kMax ? lowest<C>() : highest<C>(), LLONG_MAX}; }
  static __device__ __forceinline__ Acc combine(Acc a, Acc b) {
    const bool an = is_nan(a.v), bn = is_nan(b.v);
    if (an || bn) {
      if (an && bn) return a.i < b.i ? a : b;
      return an ? a : b;
    }
    if (kMax ? a.v > b.v : a.v < b.v) return a;
    if (kMax ? b.v > a.v : b.v < a.v) return b;
    return a.i < b.i ? a : b;
  }
  static __device__ __forceinline__ Acc make(C x, int64_t i) { return {x, i}; }
  static __device__ __forceinline__ void finish(Acc a, int64_t, void* d, int64_t o, DType dt) {
    store_dyn(d, o, dt, a.i == LLONG_MAX ? int64_t(0) : a.i);
  }
};
template <class C>
struct Reducer<ReduceOp::argmax, C> : ArgReducer<true, C> {};
template <class C>
struct Reducer<ReduceOp::argmin, C> : ArgReducer<false, C> {};
template <bool kAny, class C>
struct BoolReducer {
  using Acc = int;
  static __device__ __forceinline__ Acc identity() { return kAny ? 0 : 1; }
  static __device__ __forceinline__ Acc combine(Acc a, Acc b) { return kAny ? (a | b) : (a & b); }
  static __device__ __forceinline__ Acc make(C x, int64_t) { return x != C(0) ? 1 : 0; }
  static __device__ __forceinline__ void finish(Acc a, int64_t, void* d, int64_t o, DType dt) {
    store_dyn(d, o, dt, static_cast<int64_t>(a));
  }
};
template <class C>
struct Reducer<ReduceOp::any, C> : BoolReducer<true, C> {};
template <class C>
struct Reducer<ReduceOp::all, C> : BoolReducer<false, C> {};

// ---------------------------------------------------------------------------------------------
// Reduction kernels
// ---------------------------------------------------------------------------------------------


// Reduces p[0..n) (contiguous) with kG cooperating threads (index `t` among them); base_idx is the
// logical index of p[0]. Head to 16-byte alignment, 16-byte vectors (4 in flight), then the tail.
template <class T, class R, int kG>
__device__ __forceinline__ typename R::Acc reduce_span(const T* __restrict__ p, int64_t base_idx, int64_t n, int t) {
  using C = compute_t<T>;
  using Acc = typename R::Acc;
  constexpr int V = vec_width<T>();
  Acc acc = R::identity();
  int64_t head = head_to_align(p);
  if (head > n) head = n;
  if (t < head) acc = R::combine(acc, R::make(load_as<C>(p[t]), base_idx + t));
  const uint4* pv = reinterpret_cast<const uint4*>(p + head);
  const int64_t nv = (n - head) / V;
  const int64_t vbase = base_idx + head;
  int64_t v = t;
  for (; v + 3 * kG < nv; v += 4 * kG) {
    uint4 raw[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) raw[u] = __ldg(pv + v + u * kG);
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int j = 0; j < V; ++j)
        acc = R::combine(acc, R::make(load_as<C>(vec_elem<T>(raw[u], j)), vbase + (v + u * kG) * V + j));
  }
  for (; v < nv; v += kG) {
    const uint4 raw = __ldg(pv + v);
#pragma unroll
    for (int j = 0; j < V; ++j) acc = R::combine(acc, R::make(load_as<C>(vec_elem<T>(raw, j)), vbase + v * V + j));
  }
  for (int64_t i = head + nv * V + t; i < n; i += kG) acc = R::combine(acc, R::make(load_as<C>(p[i]), base_idx + i));
  return acc;
}

// Row path: kG threads per work unit (kG = 32: a warp, 8 units per block; kG = 256: the whole
// block). A unit is (row, split): row = u / splits.
template <class T, class R, int kG>
__global__ void __launch_bounds__(256) reduce_rows_kernel(const T* __restrict__ src, OffsetMap rows, int64_t n_rows,
                                                          int64_t len, int64_t splits, int64_t chunk, void* dst,
                                                          DType dt, typename R::Acc* partial) {
  static_assert(kG == 32 || kG == 256, "a row is reduced by a warp or by the block");
  constexpr int kUnitsPerBlock = 256 / kG;
  __shared__ typename R::Acc smem[32];
  const int t = threadIdx.x % kG;
  const int64_t units = n_rows * splits;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * kUnitsPerBlock + threadIdx.x / kG; u < units;
       u += static_cast<int64_t>(gridDim.x) * kUnitsPerBlock) {
    const int64_t row = u / splits, s = u - row * splits;
    const int64_t begin = s * chunk, end = min(len, begin + chunk);
    auto acc = reduce_span<T, R, kG>(src + rows(row) + begin, begin, (end > begin ? end - begin : int64_t(0)), t);
    if constexpr (kG == 32) {
      acc = warp_reduce<R>(acc);
    } else {
      acc = block_reduce<R>(acc, smem);
    }
    if (t == 0) {
      if (splits == 1) R::finish(acc, len, dst, row, dt);
      else partial[u] = acc;
    }
  }
}

// V elements loaded together (V adjacent outputs of the column path).
template <class T, int V>
struct alignas(sizeof(T) * V) ColVec {
  T v[V];
};

// Column / general path. threadIdx.x runs over outputs, threadIdx.y over the reduced extent,
// blockIdx.y over splits of it. `red` maps a logical reduced index to its offset. With V > 1 a
// thread owns V adjacent outputs (the kept dims are one unit-stride dim) and loads them with one
// V-element vector per reduced index.
template <class T, class R, int V>
__global__ void __launch_bounds__(256) reduce_cols_kernel(const T* __restrict__ src, OffsetMap outs, OffsetMap red,
                                                          int64_t n_out, int64_t n_red, int64_t chunk, void* dst,
                                                          DType dt, typename R::Acc* partial) {
  using C = compute_t<T>;
  using Acc = typename R::Acc;
  using Vec = ColVec<T, V>;
  __shared__ Acc smem[256 * V];
  const int64_t splits = gridDim.y, s = blockIdx.y;
  const int64_t begin = s * chunk, end = min(n_red, begin + chunk);
  const int64_t n_groups = n_out / V;
  const int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x, by = blockDim.y;
  for (int64_t o0 = static_cast<int64_t>(blockIdx.x) * bx; o0 < n_groups; o0 += static_cast<int64_t>(gridDim.x) * bx) {
    const int64_t o = o0 + tx;  // outputs o * V ... o * V + V - 1
    Acc acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = R::identity();
    if (o < n_groups) {
      const T* p = src + outs(o * V);
      int64_t r = begin + ty;
      for (; r + 3 * by < end; r += 4 * by) {  // 4 loads in flight per thread
        Vec x[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) x[u] = *reinterpret_cast<const Vec*>(p + red(r + u * by));
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int j = 0; j < V; ++j) acc[j] = R::combine(acc[j], R::make(load_as<C>(x[u].v[j]), r + u * by));
      }
      for (; r < end; r += by) {
        const Vec x = *reinterpret_cast<const Vec*>(p + red(r));
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = R::combine(acc[j], R::make(load_as<C>(x.v[j]), r));
      }
    }
    if (by > 1) {
#pragma unroll
      for (int j = 0; j < V; ++j) smem[(ty * bx + tx) * V + j] = acc[j];
      __syncthreads();
      if (ty == 0)
        for (int k = 1; k < by; ++k)
#pragma unroll
          for (int j = 0; j < V; ++j) acc[j] = R::combine(acc[j], smem[(k * bx + tx) * V + j]);
      __syncthreads();
    }
    if (ty == 0 && o < n_groups) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (splits == 1) R::finish(acc[j], n_red, dst, o * V + j, dt);
        else partial[(o * V + j) * splits + s] = acc[j];
      }
    }
  }
}

// Combines each output's `splits` partials (one warp per output) and writes dst.
template <class R>
__global__ void __launch_bounds__(256) reduce_finish_kernel(const typename R::Acc* __restrict__ partial, int64_t n_out,
                                                            int64_t splits, int64_t n_red, void* dst, DType dt) {
  const int lane = threadIdx.x & 31;
  for (int64_t o = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5); o < n_out;
       o += static_cast<int64_t>(gridDim.x) * 8) {
    auto acc = R::identity();
    for (int64_t s = lane; s < splits; s += 32) acc = R::combine(acc, partial[o * splits + s]);
    acc = warp_reduce<R>(acc);
    if (lane == 0) R::finish(acc, n_red, dst, o, dt);
  }
}

// ---------------------------------------------------------------------------------------------
// Launcher
// ---------------------------------------------------------------------------------------------

template <class T, class R>
void launch_reduce(CudaBackend& be, const Tensor& dst, const Tensor& src, int64_t reduce_ndim) {
  using Acc = typename R::Acc;
  constexpr bool kOrderFree = !std::is_same_v<Acc, ArgAcc<compute_t<T>>>;
  const int64_t keep = src.dim() - reduce_ndim;
  const Dims kept = collapse(src.sizes().data(), src.strides().data(), keep);
  // Reduced dims: order-free ops sort them by decreasing |stride| first (stable) so permuted
  // layouts merge; arg ops keep logical order (their result is a logical index).
  std::vector<int64_t> rs(src.sizes().begin() + keep, src.sizes().end());
  std::vector<int64_t> rt(src.strides().begin() + keep, src.strides().end());
  if (kOrderFree) {
    std::vector<int> order(rs.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return std::llabs(rt[a]) > std::llabs(rt[b]); });
    std::vector<int64_t> s2, t2;
    for (int i : order) {
      s2.push_back(rs[i]);
      t2.push_back(rt[i]);
    }
    rs.swap(s2);
    rt.swap(t2);
  }
  const Dims red = collapse(rs.data(), rt.data(), static_cast<int64_t>(rs.size()));
  const int64_t n_out = dst.numel();
  int64_t n_red = 1;
  for (int64_t s : rs) n_red *= s;
  if (n_out == 0) return;
  const OffsetMap outs = make_offset_map(kept), redm = make_offset_map(red);
  const T* sp = static_cast<const T*>(src.data_ptr());
  void* dp = dst.data_ptr();
  const DType dt = dst.dtype();
  cudaStream_t st = be.stream();
  const int64_t sms = sm_count(be.device());
  const int64_t target_blocks = 4 * sms;  // 256-thread blocks: 8 fit on an SM; 4 per SM is plenty

  if (n_red >= 32 && red.sizes.size() == 1 && red.strides[0] == 1) {
    // (a) row path
    // Rows up to 2048 elements: a warp each. Longer: a block each, and when there are fewer
    // rows than target_blocks, rows are split into chunks of at least 8192 elements.
    int64_t splits = 1;
    if (n_red > 2048 && n_out < target_blocks && n_red >= 16384)
      splits = std::min(ceil_div(target_blocks, n_out), ceil_div(n_red, int64_t(8192)));
    int64_t chunk = ceil_div(n_red, splits);
    chunk = ceil_div(chunk, 64) * 64;  // keeps chunk starts 16-byte aligned relative to the row
    splits = ceil_div(n_red, chunk);
    std::shared_ptr<void> part;
    Acc* pp = nullptr;
    if (splits > 1) {
      part = be.allocate(static_cast<std::size_t>(n_out * splits) * sizeof(Acc));
      pp = static_cast<Acc*>(part.get());
    }
    const int64_t units = n_out * splits;
    if (n_red <= 2048 && splits == 1) {
      reduce_rows_kernel<T, R, 32><<<grid_for(units, 8, 1 << 20), 256, 0, st>>>(sp, outs, n_out, n_red, splits, chunk, dp, dt, pp);
    } else {
      reduce_rows_kernel<T, R, 256><<<grid_for(units, 1, 1 << 20), 256, 0, st>>>(sp, outs, n_out, n_red, splits, chunk, dp, dt, pp);
    }
    FLAME_CUDA_CHECK_LAUNCH();
    if (splits > 1) {
      reduce_finish_kernel<R><<<grid_for(n_out, 8, 1 << 20), 256, 0, st>>>(pp, n_out, splits, n_red, dp, dt);
      FLAME_CUDA_CHECK_LAUNCH();
    }
    return;
  }

  // (b)/(c) column and general paths. Vector loads when the kept dims are one unit-stride dim
  // (outputs adjacent in memory) and every reduced step keeps V-element alignment.
  constexpr int kV = std::min<int>(4, static_cast<int>(16 / sizeof(T)));
  bool vec = kV > 1 && kept.sizes.size() == 1 && kept.strides[0] == 1 && n_out % kV == 0 &&
             reinterpret_cast<uintptr_t>(sp) % (kV * sizeof(T)) == 0;
  for (int64_t st_r : red.strides) vec = vec && st_r % kV == 0;
  const int V = vec ? kV : 1;
  const int bx = n_red <= 16 ? 256 : 32, by = 256 / bx;
  const int64_t blocks_x = std::min<int64_t>(ceil_div(n_out / V, bx), 1 << 20);
  // Fill every SM (8 blocks of 256 threads) to keep enough bytes in flight.
  int64_t splits = 1;
  if (blocks_x < 2 * target_blocks && n_red >= 2048) {
    splits = std::min({ceil_div(2 * target_blocks, blocks_x), ceil_div(n_red, int64_t(512)), int64_t(65535)});
  }
  const int64_t chunk = ceil_div(std::max<int64_t>(n_red, 1), splits);
  splits = std::max<int64_t>(1, ceil_div(n_red, chunk));
  std::shared_ptr<void> part;
  Acc* pp = nullptr;
  if (splits > 1) {
    part = be.allocate(static_cast<std::size_t>(n_out * splits) * sizeof(Acc));
    pp = static_cast<Acc*>(part.get());
  }
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(splits));
  const dim3 block(bx, by);
  if (vec) {
    reduce_cols_kernel<T, R, kV><<<grid, block, 0, st>>>(sp, outs, redm, n_out, n_red, chunk, dp, dt, pp);
  } else {
    reduce_cols_kernel<T, R, 1><<<grid, block, 0, st>>>(sp, outs, redm, n_out, n_red, chunk, dp, dt, pp);
  }
  FLAME_CUDA_CHECK_LAUNCH();
  if (splits > 1) {
    reduce_finish_kernel<R><<<grid_for(n_out, 8, 1 << 20), 256, 0, st>>>(pp, n_out, splits, n_red, dp, dt);
    FLAME_CUDA_CHECK_LAUNCH();
  }
}

// Reduces src into dst with op Op over src's dtype. mean takes floating sources only (the op
// layer rejects others), so only those are instantiated.
template <ReduceOp Op>
void reduce_op(CudaBackend& be, const Tensor& dst, const Tensor& src, int64_t reduce_ndim) {
  auto body = [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_reduce<T, Reducer<Op, compute_t<T>>>(be, dst, src, reduce_ndim);
  };
  if constexpr (Op == ReduceOp::mean) {
    dispatch_floating(src.dtype(), "mean", body);
  } else {
    dispatch_dtype(src.dtype(), "reduce", body);
  }
}

// Instantiated once each, in the family files.
#define FLAME_REDUCE_EXTERN(OP) \
  extern template void reduce_op<ReduceOp::OP>(CudaBackend&, const Tensor&, const Tensor&, int64_t);
FLAME_REDUCE_EXTERN(sum)
FLAME_REDUCE_EXTERN(mean)
FLAME_REDUCE_EXTERN(prod)
FLAME_REDUCE_EXTERN(max)
FLAME_REDUCE_EXTERN(min)
FLAME_REDUCE_EXTERN(argmax)
FLAME_REDUCE_EXTERN(argmin)
FLAME_REDUCE_EXTERN(any)
FLAME_REDUCE_EXTERN(all)
#undef FLAME_REDUCE_EXTERN
#define FLAME_REDUCE_INSTANTIATE(OP) \
  template void reduce_op<ReduceOp::OP>(CudaBackend&, const Tensor&, const Tensor&, int64_t);

}  // namespace flame::backend::cuda
