// CUDA cumsum (Note [CUDA cumsum]). Kernels first, launchers after.
#include <algorithm>
#include <memory>
#include <type_traits>

#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/backend/cuda/launch_geometry.cuh"

namespace flame::backend::cuda {
namespace {

// Sum of two partials: the add of the reductions (wrapping for integers).
template <class A>
struct SumOp {
  using Acc = A;
  static __device__ __forceinline__ A identity() { return A(0); }
  static __device__ __forceinline__ A combine(A a, A b) {
    if constexpr (std::is_integral_v<A>) return wrap_add(a, b);
    else return a + b;
  }
};

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
    acc = warp_reduce<SumOp<A>>(acc);
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

}  // namespace

void CudaBackend::cumsum(const Tensor& dst, const Tensor& src, int64_t dim) {
  FLAME_CHECK(dim >= 0 && dim < src.dim() && dst.sizes() == src.sizes(), "cumsum", "bad arguments: dim ", dim,
              ", src ", src.sizes(), ", dst ", dst.sizes());
  DeviceGuard guard(device());
  // The op layer gives floating sources their own dtype and integer/bool sources i64 (Note
  // [Reduce dtypes] in src/ops/reduce.cpp); only those pairs are instantiated.
  dispatch_dtype(src.dtype(), "cumsum", [&](auto stag) {
    using T = typename decltype(stag)::type;
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      if (dst.dtype() == src.dtype()) return launch_cumsum<T, T>(*this, dst, src, dim);
    } else {
      if (dst.dtype() == DType::i64) return launch_cumsum<T, int64_t>(*this, dst, src, dim);
    }
    FLAME_FAIL("cumsum", "unsupported result dtype ", dtype_name(dst.dtype()), " for a ", dtype_name(src.dtype()),
               " source");
  });
}

}  // namespace flame::backend::cuda
