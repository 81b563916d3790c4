// CUDA reductions (sum, mean, prod, max, min, argmax, argmin, any, all), cumsum and fused
// softmax / log_softmax. Kernels first, launchers after. Performance notes: docs/cuda-kernels.md.
//
// Note [CUDA reduction paths]
// The op layer hands us src whose last reduce_ndim dims are reduced. On the host we first drop
// size-1 dims and merge dims that are contiguous with each other, separately for kept and reduced
// dims (for order-free ops the reduced dims are also sorted by stride so a permuted tensor still
// merges; argmax/argmin keep the logical order because their result is a logical index). Then:
//  (a) row path: the reduced extent is one dim of stride 1 (length >= 32). A warp (short rows) or a
//      256-thread block (long rows) reduces one row with 16-byte vector loads and shuffles;
//  (b) column path: the reduced extent is one strided dim. Threads run over outputs (consecutive
//      outputs are adjacent in memory for a contiguous tensor, so loads coalesce), a block's
//      threadIdx.y splits the reduced extent and shared memory combines the pieces. When the
//      outputs are one unit-stride dim and alignment allows, a thread owns V = min(4, 16 bytes /
//      element) adjacent outputs and loads them as one vector per reduced index;
//  (c) general path: like (b) but the reduced offset comes from StridedInfo (divisions per element).
// When there are too few outputs to fill the GPU, each output's reduced extent is split into
// `splits` chunks reduced by different blocks into a float/double/int64 partial buffer, and a
// second kernel combines them in a fixed order (deterministic, no atomics). Accumulation: float for
// f32/bf16/f16, double for f64, int64 for integers and bool (wrapping), like compute_t; the CPU
// reference accumulates floating types in double, so results agree to rounding, not bit for bit.
// argmax/argmin carry (value, index) pairs; the combine prefers NaN, then the larger (smaller)
// value, then the smaller index, which is associative and commutative, so the answer is the
// CPU's "first NaN, else first extreme" whatever order the pieces are combined in.
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/core/dispatch.h"
#include "src/ops/scalar_math.h"

namespace flame::backend::cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// Element access and small device helpers
// ---------------------------------------------------------------------------------------------

// Element -> compute type; f16 uses the hardware conversion (exact, same result as convert).
template <class C, class T>
__device__ __forceinline__ C load_as(T x) {
  if constexpr (std::is_same_v<T, float16>) return static_cast<C>(__half2float(__ushort_as_half(x.bits)));
  else return convert<C>(x);
}
// Compute type -> element (round to nearest even, as convert).
template <class T, class V>
__device__ __forceinline__ T store_as(V v) {
  if constexpr (std::is_same_v<T, float16>)
    return float16::from_bits(__half_as_ushort(__float2half_rn(static_cast<float>(v))));
  else return convert<T>(v);
}
// Stores v into element i of a tensor of runtime dtype dt (used once per output element).
template <class V>
__device__ __forceinline__ void store_dyn(void* base, int64_t i, DType dt, V v) {
  switch (dt) {
    case DType::f32: static_cast<float*>(base)[i] = store_as<float>(v); break;
    case DType::f64: static_cast<double*>(base)[i] = store_as<double>(v); break;
    case DType::bf16: static_cast<bfloat16*>(base)[i] = store_as<bfloat16>(v); break;
    case DType::f16: static_cast<float16*>(base)[i] = store_as<float16>(v); break;
    case DType::i32: static_cast<int32_t*>(base)[i] = store_as<int32_t>(v); break;
    case DType::i64: static_cast<int64_t*>(base)[i] = store_as<int64_t>(v); break;
    case DType::u8: static_cast<uint8_t*>(base)[i] = store_as<uint8_t>(v); break;
    case DType::boolean: static_cast<bool*>(base)[i] = store_as<bool>(v); break;
  }
}

template <class T>
constexpr int vec_width() {
  return sizeof(T) <= 16 ? static_cast<int>(16 / sizeof(T)) : 1;
}
// Element j of a 16-byte vector loaded as uint4.
template <class T>
__device__ __forceinline__ T vec_elem(const uint4& raw, int j) {
  T t;
  memcpy(&t, reinterpret_cast<const char*>(&raw) + j * sizeof(T), sizeof(T));
  return t;
}
// Elements from p to the next 16-byte boundary (p is aligned to sizeof(T)).
template <class T>
__device__ __forceinline__ int64_t head_to_align(const T* p) {
  return static_cast<int64_t>(((16u - (reinterpret_cast<uintptr_t>(p) & 15u)) & 15u) / sizeof(T));
}

__device__ __forceinline__ float shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ double shfl_xor(double v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ int shfl_xor(int v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ int64_t shfl_xor(int64_t v, int m) {
  return static_cast<int64_t>(__shfl_xor_sync(0xffffffffu, static_cast<long long>(v), m));
}

template <class C>
__device__ __forceinline__ bool is_nan(C v) {
  if constexpr (std::is_floating_point_v<C>) return v != v;
  else return false;
}
template <class C>
__device__ __forceinline__ C lowest() {
  if constexpr (std::is_floating_point_v<C>) return -static_cast<C>(INFINITY);
  else return LLONG_MIN;
}
template <class C>
__device__ __forceinline__ C highest() {
  if constexpr (std::is_floating_point_v<C>) return static_cast<C>(INFINITY);
  else return LLONG_MAX;
}
__device__ __forceinline__ int64_t wrap_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}
__device__ __forceinline__ int64_t wrap_mul(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
}

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

template <class R, class Acc>
__device__ __forceinline__ Acc warp_reduce(Acc a) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) a = R::combine(a, shfl_xor(a, m));
  return a;
}

// Block-wide reduction of one value per thread (1-d block, blockDim.x a multiple of 32). The
// result is valid in thread 0. `smem` holds 32 accumulators; safe to call repeatedly.
template <class R, class Acc>
__device__ __forceinline__ Acc block_reduce(Acc a, Acc* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  a = warp_reduce<R>(a);
  __syncthreads();  // smem may still be read by the previous call
  if (lane == 0) smem[warp] = a;
  __syncthreads();
  if (warp == 0) {
    a = lane < nwarps ? smem[lane] : R::identity();
    a = warp_reduce<R>(a);
  }
  return a;
}

// Offset of logical index i in a (collapsed) set of dims: i * stride when they merged into one.
struct OffsetMap {
  bool linear;
  int64_t stride;
  StridedInfo info;
  __device__ __forceinline__ int64_t operator()(int64_t i) const { return linear ? i * stride : info.offset(i); }
};

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
// Cumsum kernels (Note [CUDA cumsum])
// ---------------------------------------------------------------------------------------------
// Note [CUDA cumsum]
// Lines are the 1-d slices along dim. Each line is cut into n_chunks chunks so that enough threads
// work even for a few long lines. With more than one chunk: (1) each chunk's total goes to a
// partial buffer, (2) one thread per line turns the totals into exclusive prefixes (carries),
// (3) each chunk is scanned starting from its carry. Lines of stride 1 are scanned by a warp per
// chunk (8 consecutive elements per lane, a shuffle scan over lanes); strided lines by a thread per
// chunk, consecutive threads on adjacent lines so that loads coalesce.

constexpr int kScanItems = 8;
constexpr int kScanTile = 32 * kScanItems;

template <class A>
__device__ __forceinline__ A scan_add(A a, A b) {
  if constexpr (std::is_integral_v<A>) return wrap_add(a, b);
  else return a + b;
}

// Phase 1 for unit-stride lines: warp per (line, chunk) -> partial[line * n_chunks + c].
template <class T>
__global__ void __launch_bounds__(256) cumsum_chunk_total_warp_kernel(const T* __restrict__ src, OffsetMap lines,
                                                                      int64_t n_lines, int64_t len, int64_t n_chunks,
                                                                      int64_t chunk, compute_t<T>* partial) {
  using A = compute_t<T>;
  const int lane = threadIdx.x & 31;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5); u < n_lines * n_chunks;
       u += static_cast<int64_t>(gridDim.x) * 8) {
    const int64_t line = u / n_chunks, c = u - line * n_chunks;
    const int64_t begin = c * chunk, end = min(len, begin + chunk);
    const T* p = src + lines(line);
    A acc = A(0);
    for (int64_t i = begin + lane; i < end; i += 32) acc = scan_add(acc, load_as<A>(p[i]));
    acc = warp_reduce<Reducer<ReduceOp::sum, A>>(acc);
    if (lane == 0) partial[u] = acc;
  }
}

// Phase 1 for strided lines: thread per (chunk, line), u = c * n_lines + line.
template <class T>
__global__ void cumsum_chunk_total_strided_kernel(const T* __restrict__ src, OffsetMap lines, int64_t stride,
                                                  int64_t n_lines, int64_t len, int64_t n_chunks, int64_t chunk,
                                                  compute_t<T>* partial) {
  using A = compute_t<T>;
  for (int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; u < n_lines * n_chunks;
       u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = u / n_lines, line = u - c * n_lines;
    const int64_t begin = c * chunk, end = min(len, begin + chunk);
    const T* p = src + lines(line);
    A acc = A(0);
    for (int64_t i = begin; i < end; ++i) acc = scan_add(acc, load_as<A>(p[i * stride]));
    partial[line * n_chunks + c] = acc;
  }
}

// Phase 2: exclusive prefix of chunk totals per line, in place.
template <class A>
__global__ void cumsum_carry_kernel(A* partial, int64_t n_lines, int64_t n_chunks) {
  for (int64_t line = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; line < n_lines;
       line += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    A run = A(0);
    for (int64_t c = 0; c < n_chunks; ++c) {
      const A t = partial[line * n_chunks + c];
      partial[line * n_chunks + c] = run;
      run = scan_add(run, t);
    }
  }
}

// Phase 3 for unit-stride lines (src and dst): warp per (line, chunk), tiles of 256 elements.
template <class T, class D>
__global__ void __launch_bounds__(256) cumsum_scan_warp_kernel(const T* __restrict__ src, OffsetMap src_lines,
                                                               D* __restrict__ dst, OffsetMap dst_lines, int64_t n_lines,
                                                               int64_t len, int64_t n_chunks, int64_t chunk,
                                                               const compute_t<T>* carries) {
  using A = compute_t<T>;
  const int lane = threadIdx.x & 31;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5); u < n_lines * n_chunks;
       u += static_cast<int64_t>(gridDim.x) * 8) {
    const int64_t line = u / n_chunks, c = u - line * n_chunks;
    const int64_t begin = c * chunk, end = min(len, begin + chunk);
    const T* p = src + src_lines(line);
    D* q = dst + dst_lines(line);
    A carry = n_chunks > 1 ? carries[u] : A(0);
    for (int64_t t0 = begin; t0 < end; t0 += kScanTile) {
      A v[kScanItems];
      const int64_t i0 = t0 + lane * kScanItems;
#pragma unroll
      for (int j = 0; j < kScanItems; ++j) v[j] = i0 + j < end ? load_as<A>(p[i0 + j]) : A(0);
#pragma unroll
      for (int j = 1; j < kScanItems; ++j) v[j] = scan_add(v[j - 1], v[j]);
      A incl = v[kScanItems - 1];  // inclusive scan of lane totals
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const A up = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl = scan_add(up, incl);
      }
      A excl = __shfl_up_sync(0xffffffffu, incl, 1);
      excl = scan_add(carry, lane == 0 ? A(0) : excl);
#pragma unroll
      for (int j = 0; j < kScanItems; ++j)
        if (i0 + j < end) q[i0 + j] = store_as<D>(scan_add(excl, v[j]));
      carry = scan_add(carry, __shfl_sync(0xffffffffu, incl, 31));
    }
  }
}

// Phase 3 for strided lines: thread per (chunk, line).
template <class T, class D>
__global__ void cumsum_scan_strided_kernel(const T* __restrict__ src, OffsetMap src_lines, int64_t src_stride,
                                           D* __restrict__ dst, OffsetMap dst_lines, int64_t dst_stride,
                                           int64_t n_lines, int64_t len, int64_t n_chunks, int64_t chunk,
                                           const compute_t<T>* carries) {
  using A = compute_t<T>;
  for (int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; u < n_lines * n_chunks;
       u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = u / n_lines, line = u - c * n_lines;
    const int64_t begin = c * chunk, end = min(len, begin + chunk);
    const T* p = src + src_lines(line);
    D* q = dst + dst_lines(line);
    A acc = n_chunks > 1 ? carries[line * n_chunks + c] : A(0);
    for (int64_t i = begin; i < end; ++i) {
      acc = scan_add(acc, load_as<A>(p[i * src_stride]));
      q[i * dst_stride] = store_as<D>(acc);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Softmax kernels (Note [CUDA softmax])
// ---------------------------------------------------------------------------------------------
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

// Online softmax state: running max m and sum of exp(x - m).
template <class A>
struct MaxSum {
  A m, s;
};
template <class A>
__device__ __forceinline__ MaxSum<A> ms_merge(MaxSum<A> a, MaxSum<A> b) {
  const A m = (a.m != a.m || b.m != b.m) ? (a.m != a.m ? a.m : b.m) : (a.m > b.m ? a.m : b.m);
  if (m == -static_cast<A>(INFINITY)) return {m, A(0)};  // both empty or all -inf so far
  return {m, a.s * math::exp(a.m - m) + b.s * math::exp(b.m - m)};
}
// One element, one exp: a new max rescales the sum. (x - x) is nan for x = +inf, so an infinite
// element poisons the sum as exp(inf - inf) does in the CPU reference; -inf adds nothing.
template <class A>
__device__ __forceinline__ MaxSum<A> ms_add(MaxSum<A> a, A x) {
  if (x > a.m) {
    a.s = a.s * math::exp(a.m - x) + (A(1) + (x - x));
    a.m = x;
  } else if (x != -static_cast<A>(INFINITY)) {
    a.s += math::exp(x - a.m);  // nan x gives a nan sum
  }
  return a;
}

template <class A>
__device__ __forceinline__ A nan_max(A a, A b) {
  if (a != a) return a;
  if (b != b) return b;
  return a > b ? a : b;
}

struct MaxOpF {
  template <class A>
  static __device__ __forceinline__ A combine(A a, A b) { return nan_max(a, b); }
};
struct SumOpF {
  template <class A>
  static __device__ __forceinline__ A combine(A a, A b) { return a + b; }
};

// Reduction over the kTPR threads of a row (kTPR <= 32: shuffles; else shared memory; one row per
// block then). `smem` has 32 entries.
template <int kTPR, class Op, class A>
__device__ __forceinline__ A row_allreduce(A v, A* smem) {
  constexpr int width = kTPR < 32 ? kTPR : 32;
#pragma unroll
  for (int m = width / 2; m > 0; m >>= 1) v = Op::combine(v, __shfl_xor_sync(0xffffffffu, v, m));
  if constexpr (kTPR > 32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int first = (threadIdx.x / kTPR) * (kTPR / 32);  // this row's first warp
    __syncthreads();
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    v = smem[first];
    for (int w = 1; w < kTPR / 32; ++w) v = Op::combine(v, smem[first + w]);
  }
  return v;
}

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

// ---------------------------------------------------------------------------------------------
// Host-side geometry
// ---------------------------------------------------------------------------------------------

int sm_count(int device) {
  static int counts[64] = {};
  if (device < 0 || device >= 64) return 132;
  if (counts[device] == 0) {
    int n = 0;
    FLAME_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    counts[device] = n > 0 ? n : 1;
  }
  return counts[device];
}

// Drops size-1 dims and merges dims contiguous with each other (row-major logical order kept).
struct Dims {
  std::vector<int64_t> sizes, strides;
};
Dims collapse(const int64_t* sizes, const int64_t* strides, int64_t n) {
  Dims out;
  for (int64_t d = 0; d < n; ++d) {
    if (sizes[d] == 1) continue;
    if (!out.sizes.empty() && out.strides.back() == strides[d] * sizes[d]) {
      out.sizes.back() *= sizes[d];
      out.strides.back() = strides[d];
    } else {
      out.sizes.push_back(sizes[d]);
      out.strides.push_back(strides[d]);
    }
  }
  return out;
}

OffsetMap make_offset_map(const Dims& d) {
  FLAME_CHECK(d.sizes.size() <= static_cast<std::size_t>(kMaxDims), "cuda", "too many dims");
  OffsetMap m{};
  m.linear = d.sizes.size() <= 1;
  m.stride = d.sizes.empty() ? 0 : d.strides[0];
  m.info.ndim = static_cast<int>(d.sizes.size());
  for (std::size_t i = 0; i < d.sizes.size(); ++i) {
    m.info.sizes[i] = d.sizes[i];
    m.info.strides[i] = d.strides[i];
  }
  return m;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
unsigned int grid_for(int64_t units, int64_t per_block, int64_t cap = INT32_MAX) {
  return static_cast<unsigned int>(std::clamp<int64_t>(ceil_div(units, per_block), 1, cap));
}

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

template <ReduceOp Op>
void reduce_op(CudaBackend& be, const Tensor& dst, const Tensor& src, int64_t reduce_ndim) {
  dispatch_dtype(src.dtype(), "reduce", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_reduce<T, Reducer<Op, compute_t<T>>>(be, dst, src, reduce_ndim);
  });
}

// Lines along `dim`: the map of the other dims (dim removed).
OffsetMap line_map(const Tensor& t, int64_t dim) {
  std::vector<int64_t> s, st;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d == dim) continue;
    s.push_back(t.sizes()[d]);
    st.push_back(t.strides()[d]);
  }
  return make_offset_map(collapse(s.data(), st.data(), static_cast<int64_t>(s.size())));
}

template <class T, class D>
void launch_cumsum(CudaBackend& be, const Tensor& dst, const Tensor& src, int64_t dim) {
  using A = compute_t<T>;
  const int64_t len = src.sizes()[dim];
  const int64_t n_lines = len == 0 ? 0 : src.numel() / len;
  if (n_lines == 0 || len == 0) return;
  const OffsetMap sl = line_map(src, dim), dl = line_map(dst, dim);
  const int64_t ss = src.strides()[dim], ds = dst.strides()[dim];
  const T* sp = static_cast<const T*>(src.data_ptr());
  D* dp = static_cast<D*>(dst.data_ptr());
  cudaStream_t st = be.stream();
  const int64_t sms = sm_count(be.device());
  const bool unit = (ss == 1 && ds == 1) || len == 1;
  int64_t n_chunks = 1, chunk = len;
  if (unit) {
    const int64_t target_warps = sms * 64;
    if (n_lines < target_warps && len > 4 * kScanTile)
      n_chunks = std::min(ceil_div(target_warps, n_lines), ceil_div(len, 4 * kScanTile));
    chunk = ceil_div(ceil_div(len, n_chunks), kScanTile) * kScanTile;
  } else {
    const int64_t target_threads = sms * 2048;
    if (n_lines < target_threads && len > 64) n_chunks = std::min(ceil_div(target_threads, n_lines), ceil_div(len, 64));
    chunk = ceil_div(len, n_chunks);
  }
  n_chunks = ceil_div(len, chunk);
  std::shared_ptr<void> part;
  A* pp = nullptr;
  const int64_t units = n_lines * n_chunks;
  if (n_chunks > 1) {
    part = be.allocate(static_cast<std::size_t>(units) * sizeof(A));
    pp = static_cast<A*>(part.get());
    if (unit)
      cumsum_chunk_total_warp_kernel<T><<<grid_for(units, 8, 1 << 20), 256, 0, st>>>(sp, sl, n_lines, len, n_chunks, chunk, pp);
    else
      cumsum_chunk_total_strided_kernel<T><<<grid_for(units, 256, 1 << 20), 256, 0, st>>>(sp, sl, ss, n_lines, len, n_chunks,
                                                                                         chunk, pp);
    FLAME_CUDA_CHECK_LAUNCH();
    cumsum_carry_kernel<A><<<grid_for(n_lines, 256, 1 << 20), 256, 0, st>>>(pp, n_lines, n_chunks);
    FLAME_CUDA_CHECK_LAUNCH();
  }
  if (unit)
    cumsum_scan_warp_kernel<T, D><<<grid_for(units, 8, 1 << 20), 256, 0, st>>>(sp, sl, dp, dl, n_lines, len, n_chunks, chunk, pp);
  else
    cumsum_scan_strided_kernel<T, D><<<grid_for(units, 256, 1 << 20), 256, 0, st>>>(sp, sl, ss, dp, dl, ds, n_lines, len,
                                                                                   n_chunks, chunk, pp);
  FLAME_CUDA_CHECK_LAUNCH();
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

}  // namespace

void CudaBackend::reduce(ReduceOp op, const Tensor& dst, const Tensor& src, int64_t reduce_ndim) {
  FLAME_CHECK(reduce_ndim >= 0 && reduce_ndim <= src.dim(), "reduce", "reduce_ndim ", reduce_ndim,
              " out of range for a source of shape ", src.sizes());
  FLAME_CHECK(dst.is_contiguous(), "reduce", "the CUDA kernel expects a contiguous destination");
  DeviceGuard guard(device());
  switch (op) {
    case ReduceOp::sum: return reduce_op<ReduceOp::sum>(*this, dst, src, reduce_ndim);
    case ReduceOp::mean: return reduce_op<ReduceOp::mean>(*this, dst, src, reduce_ndim);
    case ReduceOp::prod: return reduce_op<ReduceOp::prod>(*this, dst, src, reduce_ndim);
    case ReduceOp::max: return reduce_op<ReduceOp::max>(*this, dst, src, reduce_ndim);
    case ReduceOp::min: return reduce_op<ReduceOp::min>(*this, dst, src, reduce_ndim);
    case ReduceOp::argmax: return reduce_op<ReduceOp::argmax>(*this, dst, src, reduce_ndim);
    case ReduceOp::argmin: return reduce_op<ReduceOp::argmin>(*this, dst, src, reduce_ndim);
    case ReduceOp::any: return reduce_op<ReduceOp::any>(*this, dst, src, reduce_ndim);
    case ReduceOp::all: return reduce_op<ReduceOp::all>(*this, dst, src, reduce_ndim);
  }
}

void CudaBackend::cumsum(const Tensor& dst, const Tensor& src, int64_t dim) {
  FLAME_CHECK(dim >= 0 && dim < src.dim() && dst.sizes() == src.sizes(), "cumsum", "bad arguments: dim ", dim,
              ", src ", src.sizes(), ", dst ", dst.sizes());
  DeviceGuard guard(device());
  dispatch_dtype(src.dtype(), "cumsum", [&](auto stag) {
    using T = typename decltype(stag)::type;
    // dst is src's dtype or i64 (integer and bool sources); anything else goes through i64/same.
    if (dst.dtype() == src.dtype()) launch_cumsum<T, T>(*this, dst, src, dim);
    else if (dst.dtype() == DType::i64) launch_cumsum<T, int64_t>(*this, dst, src, dim);
    else if (dst.dtype() == DType::f32) launch_cumsum<T, float>(*this, dst, src, dim);
    else FLAME_FAIL("cumsum", "unsupported result dtype ", dtype_name(dst.dtype()), " for a ", dtype_name(src.dtype()),
                    " source");
  });
}

void CudaBackend::softmax(const Tensor& dst, const Tensor& src, int64_t dim, bool log) {
  const char* name = log ? "log_softmax" : "softmax";
  FLAME_CHECK(dim >= 0 && dim < src.dim() && dst.sizes() == src.sizes() && dst.dtype() == src.dtype(), name,
              "bad arguments: dim ", dim, ", src ", src.sizes(), ", dst ", dst.sizes());
  DeviceGuard guard(device());
  dispatch_floating(src.dtype(), name, [&](auto tag) { launch_softmax<typename decltype(tag)::type>(*this, dst, src, dim, log); });
}

}  // namespace flame::backend::cuda
