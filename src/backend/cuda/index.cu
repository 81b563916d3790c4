// CUDA indexing kernels: index_select, gather, scatter (and scatter_add), masked_select, sort.
// Kernels first, launchers after. Performance notes: docs/cuda-kernels.md.
//
// Note [CUDA index checks]
// Index values live on the device, so they are checked where they are read: an entry outside
// [0, size) is skipped (nothing is read or written for it) and the first one is recorded in the
// backend's DeviceErrorRecord (atomicCAS on `op` from 0), which the next synchronising call turns
// into flame::Error naming the op (Note [Deferred device errors] in cuda_backend.h). Elements a
// bad entry would have written are left as they were.
//
// Note [CUDA sort keys]
// sort runs CUB's radix sort (stable) on unsigned keys whose order is the element order: floats
// map their bits so that negative values reverse, every NaN becomes the largest key and -0.0
// becomes +0.0 (they compare equal in the CPU reference, so stability keeps their input order);
// signed integers flip the sign bit. Descending sorts ascend on the complemented keys, which keeps
// equal keys in input order (stable) and puts NaN first, as the CPU reference does. bf16/f16 sort
// on 16-bit keys (two radix passes fewer than through float). Rows of up to 2048 elements are
// sorted by one block each in shared memory (cub::BlockRadixSort, stable; padding keys are the
// largest and come after every real element since they follow them in input order). Longer rows:
// a single row uses cub::DeviceRadixSort, several cub::DeviceSegmentedRadixSort, with int32
// positions as the payload (half the bytes of i64; rows are limited to 2^31 elements). The values
// written are gathered from src by the sorted positions, so they keep their exact bits.
#include <cub/block/block_radix_sort.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>
#include <cub/device/device_select.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/launch_geometry.cuh"
#include "src/core/dispatch.h"
#include "src/opdef/scalar_math.h"

namespace flame::backend::cuda {
namespace {

__device__ __forceinline__ void record_index_error(DeviceErrorRecord* rec, int32_t op, int32_t dim, int64_t value,
                                                   int64_t limit) {
  if (atomicCAS(&rec->op, 0, op) == 0) {
    rec->dim = dim;
    rec->value = value;
    rec->limit = limit;
  }
}

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_threads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// ---------------------------------------------------------------------------------------------
// index_select / gather / scatter
// ---------------------------------------------------------------------------------------------

// Element-wise gather: dst[dmap(o)] = src[smap(o) + idx * step] with idx = index[o / inner % n_idx]
// (index_select: inner = elements after dim, n_idx = index length; gather: inner = 1,
// n_idx = numel, so idx = index[o]).
template <class T>
__global__ void gather_elements_kernel(const T* __restrict__ src, OffsetMap smap, int64_t step, T* __restrict__ dst,
                                       OffsetMap dmap, const int64_t* __restrict__ index, int64_t n, int64_t inner,
                                       int64_t n_idx, int64_t limit, int32_t dim, int32_t op, DeviceErrorRecord* rec) {
  for (int64_t o = global_thread(); o < n; o += grid_threads()) {
    const int64_t j = inner == 1 && n_idx == n ? o : (o / inner) % n_idx;
    const int64_t i = index[j];
    if (i < 0 || i >= limit) {
      record_index_error(rec, op, dim, i, limit);
      continue;
    }
    dst[dmap(o)] = src[smap(o) + i * step];
  }
}

// index_select on contiguous src and dst: a warp copies one row of `row_len` vectors V.
// Row r of dst is (outer, j) = (r / n_idx, r % n_idx) and comes from src row outer * size + index[j].
template <class V>
__global__ void __launch_bounds__(256) select_rows_kernel(const V* __restrict__ src, V* __restrict__ dst,
                                                          const int64_t* __restrict__ index, int64_t n_rows,
                                                          int64_t n_idx, int64_t row_len, int64_t limit, int32_t dim,
                                                          DeviceErrorRecord* rec) {
  const int lane = threadIdx.x & 31;
  for (int64_t r = global_thread() >> 5; r < n_rows; r += grid_threads() >> 5) {
    const int64_t outer = r / n_idx, j = r - outer * n_idx;
    const int64_t i = index[j];
    if (i < 0 || i >= limit) {
      if (lane == 0) record_index_error(rec, kErrIndexSelect, dim, i, limit);
      continue;
    }
    const V* s = src + (outer * limit + i) * row_len;
    V* d = dst + r * row_len;
    for (int64_t c = lane; c < row_len; c += 32) d[c] = s[c];
  }
}

// Atomic dst += v for every dtype (Note [CUDA scatter_add atomics]).
// Note [CUDA scatter_add atomics]
// f32, f64, i32 and i64 (as unsigned long long, same bits under two's complement) use the native
// atomicAdd; f16 and bf16 use sm_90's native half atomics (each add rounds, like the CPU's
// element-by-element loop); u8 adds with a compare-and-swap loop on its aligned 32-bit word and
// bool ORs into its word (sum != 0). Those word accesses touch the up to 3 neighbouring bytes of
// the same aligned word, which lie inside the pool's 512-byte-granular blocks.
template <class T>
__device__ __forceinline__ void atomic_accumulate(T* p, T v) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    atomicAdd(p, v);
  } else if constexpr (std::is_same_v<T, int32_t>) {
    atomicAdd(p, v);
  } else if constexpr (std::is_same_v<T, int64_t>) {
    atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
  } else if constexpr (std::is_same_v<T, float16>) {
    atomicAdd(reinterpret_cast<__half*>(p), __ushort_as_half(v.bits));
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    atomicAdd(reinterpret_cast<__nv_bfloat16*>(p), __ushort_as_bfloat16(v.bits));
  } else {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
    unsigned int* word = reinterpret_cast<unsigned int*>(addr & ~uintptr_t(3));
    const unsigned int shift = static_cast<unsigned int>(addr & 3u) * 8u;
    if constexpr (std::is_same_v<T, bool>) {
      if (v) atomicOr(word, 1u << shift);
    } else {
      unsigned int old = *word, assumed;
      do {
        assumed = old;
        const unsigned int byte = ((assumed >> shift) + static_cast<unsigned int>(v)) & 0xffu;
        old = atomicCAS(word, assumed, (assumed & ~(0xffu << shift)) | (byte << shift));
      } while (assumed != old);
    }
  }
}

// dst[dmap(o) + idx * step] = (or +=) src[smap(o)] with idx = index[o], for every index element o.
template <class T, bool kAccumulate>
__global__ void scatter_kernel(T* dst, OffsetMap dmap, int64_t step, const T* __restrict__ src, OffsetMap smap,
                               const int64_t* __restrict__ index, int64_t n, int64_t limit, int32_t dim,
                               DeviceErrorRecord* rec) {
  for (int64_t o = global_thread(); o < n; o += grid_threads()) {
    const int64_t i = index[o];
    if (i < 0 || i >= limit) {
      record_index_error(rec, kAccumulate ? kErrScatterAdd : kErrScatter, dim, i, limit);
      continue;
    }
    T* d = dst + dmap(o) + i * step;
    if constexpr (kAccumulate) atomic_accumulate(d, src[smap(o)]);
    else *d = src[smap(o)];
  }
}

// ---------------------------------------------------------------------------------------------
// masked_select and sort helpers
// ---------------------------------------------------------------------------------------------

// Counts true bytes of a bool mask into *count (16-byte loads when aligned).
__global__ void __launch_bounds__(256) count_true_kernel(const uint8_t* __restrict__ mask, int64_t n, bool aligned,
                                                         unsigned long long* count) {
  unsigned int local = 0;
  int64_t body = 0;
  if (aligned) {
    body = n / 16;
    const uint4* v = reinterpret_cast<const uint4*>(mask);
    for (int64_t i = global_thread(); i < body; i += grid_threads()) {
      const uint4 w = __ldg(v + i);
      local += __popc(__vsetne4(w.x, 0u)) + __popc(__vsetne4(w.y, 0u)) + __popc(__vsetne4(w.z, 0u)) +
               __popc(__vsetne4(w.w, 0u));  // one bit per non-zero byte
    }
    body *= 16;
  }
  unsigned long long total = local;
  for (int64_t i = body + global_thread(); i < n; i += grid_threads()) total += mask[i] != 0;
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) total += __shfl_xor_sync(0xffffffffu, total, m);
  if ((threadIdx.x & 31) == 0 && total) atomicAdd(count, total);
}

// Ordered unsigned keys of the element's width (Note [CUDA sort keys]).
template <class T>
using sort_key_t = std::conditional_t<
    sizeof(T) == 8, uint64_t,
    std::conditional_t<sizeof(T) == 4, uint32_t, std::conditional_t<sizeof(T) == 2, uint16_t, uint8_t>>>;

template <class U, U kSign, U kExpMask>
__device__ __forceinline__ U float_key(U u) {
  if ((u & static_cast<U>(~kSign)) > kExpMask) return static_cast<U>(~U(0));  // NaN: largest
  if (u == kSign) u = 0;                                                          // -0.0 as +0.0
  return (u & kSign) ? static_cast<U>(~u) : static_cast<U>(u | kSign);
}
template <class T>
__device__ __forceinline__ sort_key_t<T> sort_key(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return float_key<uint32_t, 0x80000000u, 0x7f800000u>(__float_as_uint(x));
  } else if constexpr (std::is_same_v<T, double>) {
    return float_key<uint64_t, 0x8000000000000000ull, 0x7ff0000000000000ull>(
        static_cast<uint64_t>(__double_as_longlong(x)));
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    return float_key<uint16_t, uint16_t(0x8000), uint16_t(0x7f80)>(x.bits);
  } else if constexpr (std::is_same_v<T, float16>) {
    return float_key<uint16_t, uint16_t(0x8000), uint16_t(0x7c00)>(x.bits);
  } else if constexpr (std::is_same_v<T, int32_t>) {
    return static_cast<uint32_t>(x) ^ 0x80000000u;
  } else if constexpr (std::is_same_v<T, int64_t>) {
    return static_cast<uint64_t>(x) ^ 0x8000000000000000ull;
  } else {
    return static_cast<uint8_t>(x);  // u8, bool
  }
}
// Rows of up to kThreads * kItems elements, one block per row, sorted in shared memory.
template <class T, int kThreads, int kItems>
__global__ void __launch_bounds__(kThreads) sort_rows_block_kernel(const T* __restrict__ src, OffsetMap srows,
                                                                   int64_t sstride, T* __restrict__ values,
                                                                   OffsetMap vrows, int64_t vstride,
                                                                   int64_t* __restrict__ indices, OffsetMap irows,
                                                                   int64_t istride, int64_t n_rows, int len,
                                                                   bool descending) {
  using K = sort_key_t<T>;
  using Sort = cub::BlockRadixSort<K, kThreads, kItems, int>;
  __shared__ typename Sort::TempStorage temp;
  for (int64_t row = blockIdx.x; row < n_rows; row += gridDim.x) {
    const T* p = src + srows(row);
    K keys[kItems];
    int pos[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {  // blocked arrangement: thread t holds t*kItems .. +kItems-1
      const int j = threadIdx.x * kItems + i;
      const K k = j < len ? sort_key(p[j * sstride]) : K(0);
      keys[i] = j < len ? (descending ? static_cast<K>(~k) : k) : static_cast<K>(~K(0));
      pos[i] = j;
    }
    Sort(temp).SortBlockedToStriped(keys, pos);
    T* v = values + vrows(row);
    int64_t* ix = indices + irows(row);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {  // striped: item i of thread t is output i*kThreads + t
      const int j = i * kThreads + threadIdx.x;
      if (j < len) {
        v[j * vstride] = p[static_cast<int64_t>(pos[i]) * sstride];
        ix[j * istride] = pos[i];
      }
    }
    __syncthreads();  // temp storage is reused by the next row
  }
}

// keys[e] = key of src row e / len, element e % len (complemented for descending); idx[e] = e % len.
template <class T>
__global__ void sort_prepare_kernel(const T* __restrict__ src, OffsetMap rows, int64_t stride, int64_t n, int64_t len,
                                    bool descending, sort_key_t<T>* __restrict__ keys, int* __restrict__ idx) {
  using K = sort_key_t<T>;
  for (int64_t e = global_thread(); e < n; e += grid_threads()) {
    const int64_t r = e / len, j = e - r * len;
    const K k = sort_key(src[rows(r) + j * stride]);
    keys[e] = descending ? static_cast<K>(~k) : k;
    idx[e] = static_cast<int>(j);
  }
}

// values[row, j] = src[row, order[e]], indices[row, j] = order[e] for e = row * len + j.
template <class T>
__global__ void sort_finish_kernel(const T* __restrict__ src, OffsetMap srows, int64_t sstride, T* __restrict__ values,
                                   OffsetMap vrows, int64_t vstride, int64_t* __restrict__ indices, OffsetMap irows,
                                   int64_t istride, const int* __restrict__ order, int64_t n, int64_t len) {
  for (int64_t e = global_thread(); e < n; e += grid_threads()) {
    const int64_t r = e / len, j = e - r * len;
    const int64_t i = order[e];
    values[vrows(r) + j * vstride] = src[srows(r) + i * sstride];
    indices[irows(r) + j * istride] = i;
  }
}

__global__ void segment_offsets_kernel(int* offsets, int64_t n_rows, int64_t len) {
  for (int64_t r = global_thread(); r <= n_rows; r += grid_threads()) offsets[r] = static_cast<int>(r * len);
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------

// Drops size-1 dims and merges dims contiguous with each other (launch_geometry.cuh).
OffsetMap make_map(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  return make_offset_map(collapse(sizes.data(), strides.data(), static_cast<int64_t>(sizes.size())));
}
// The map of `sizes` walked with t's strides, t's stride along `zero_dim` (if >= 0) set to 0.
OffsetMap walk_map(const Shape& sizes, const Tensor& t, int64_t zero_dim = -1) {
  std::vector<int64_t> strides(t.strides().begin(), t.strides().end());
  if (zero_dim >= 0) strides[zero_dim] = 0;
  return make_map(std::vector<int64_t>(sizes.begin(), sizes.end()), strides);
}
// The map of the rows along `dim` (all other dims).
OffsetMap rows_map(const Tensor& t, int64_t dim) {
  std::vector<int64_t> s, st;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d == dim) continue;
    s.push_back(t.sizes()[d]);
    st.push_back(t.strides()[d]);
  }
  return make_map(s, st);
}

Tensor contiguous_copy(CudaBackend& be, const Tensor& t) {
  Tensor c = Tensor::empty(t.sizes(), {t.dtype(), Device::cuda(be.device())});
  be.copy(c, t);
  return c;
}

void check_index(const Tensor& index, const char* op) {
  FLAME_CHECK(index.dtype() == DType::i64 && index.is_contiguous(), op, "the CUDA kernel expects a contiguous i64 index");
}

template <class T>
void sort_typed(CudaBackend& be, const Tensor& values, const Tensor& indices, const Tensor& src, int64_t dim,
                bool descending) {
  using K = sort_key_t<T>;
  const int64_t len = src.sizes()[dim], n = src.numel();
  if (n == 0) return;
  const int64_t n_rows = n / len;
  FLAME_CHECK(len <= INT_MAX, "sort", "rows longer than 2^31 - 1 elements are not supported (", len, ")");
  cudaStream_t st = be.stream();
  const OffsetMap srows = rows_map(src, dim);
  const T* sp = static_cast<const T*>(src.data_ptr());
  if (len <= 2048) {
    T* vp = static_cast<T*>(values.data_ptr());
    int64_t* ip = static_cast<int64_t*>(indices.data_ptr());
    const OffsetMap vrows = rows_map(values, dim), irows = rows_map(indices, dim);
    const int64_t ss = src.strides()[dim], vs = values.strides()[dim], is = indices.strides()[dim];
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(n_rows, 1 << 20));
    if (len <= 512)
      sort_rows_block_kernel<T, 128, 4><<<grid, 128, 0, st>>>(sp, srows, ss, vp, vrows, vs, ip, irows, is, n_rows,
                                                              static_cast<int>(len), descending);
    else
      sort_rows_block_kernel<T, 256, 8><<<grid, 256, 0, st>>>(sp, srows, ss, vp, vrows, vs, ip, irows, is, n_rows,
                                                              static_cast<int>(len), descending);
    FLAME_CUDA_CHECK_LAUNCH();
    return;
  }
  auto keys_buf = be.allocate(static_cast<std::size_t>(n) * sizeof(K) * 2);
  auto idx_buf = be.allocate(static_cast<std::size_t>(n) * sizeof(int) * 2);
  K* keys_in = static_cast<K*>(keys_buf.get());
  K* keys_out = keys_in + n;
  int* idx_in = static_cast<int*>(idx_buf.get());
  int* idx_out = idx_in + n;
  sort_prepare_kernel<T><<<grid_for(n, 256), 256, 0, st>>>(sp, srows, src.strides()[dim], n, len, descending, keys_in,
                                                          idx_in);
  FLAME_CUDA_CHECK_LAUNCH();
  constexpr int kBits = static_cast<int>(sizeof(K) * 8);
  if (n_rows == 1) {
    const int items = static_cast<int>(n);
    std::size_t temp_bytes = 0;
    FLAME_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_out, idx_in, idx_out, items, 0,
                                                     kBits, st));
    auto temp = be.allocate(std::max<std::size_t>(temp_bytes, 1));
    FLAME_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.get(), temp_bytes, keys_in, keys_out, idx_in, idx_out, items,
                                                     0, kBits, st));
  } else {
    // Segmented sort counts items in int: batches of rows with at most INT_MAX elements.
    const int64_t rows_per_batch = std::max<int64_t>(1, INT_MAX / len);
    auto off_buf = be.allocate(static_cast<std::size_t>(std::min(rows_per_batch, n_rows) + 1) * sizeof(int));
    int* offsets = static_cast<int*>(off_buf.get());
    for (int64_t r0 = 0; r0 < n_rows; r0 += rows_per_batch) {
      const int64_t rows = std::min(rows_per_batch, n_rows - r0), items = rows * len, base = r0 * len;
      segment_offsets_kernel<<<grid_for(rows + 1, 256), 256, 0, st>>>(offsets, rows, len);
      FLAME_CUDA_CHECK_LAUNCH();
      std::size_t temp_bytes = 0;
      FLAME_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairs(
          nullptr, temp_bytes, keys_in + base, keys_out + base, idx_in + base, idx_out + base, static_cast<int>(items),
          static_cast<int>(rows), offsets, offsets + 1, 0, kBits, st));
      auto temp = be.allocate(std::max<std::size_t>(temp_bytes, 1));
      FLAME_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairs(
          temp.get(), temp_bytes, keys_in + base, keys_out + base, idx_in + base, idx_out + base, static_cast<int>(items),
          static_cast<int>(rows), offsets, offsets + 1, 0, kBits, st));
    }
  }
  sort_finish_kernel<T><<<grid_for(n, 256), 256, 0, st>>>(
      static_cast<const T*>(src.data_ptr()), srows, src.strides()[dim], static_cast<T*>(values.data_ptr()),
      rows_map(values, dim), values.strides()[dim], static_cast<int64_t*>(indices.data_ptr()), rows_map(indices, dim),
      indices.strides()[dim], idx_out, n, len);
  FLAME_CUDA_CHECK_LAUNCH();
}

}  // namespace

// dst = src with dim replaced by index (1-d, i64, contiguous) entries.
void CudaBackend::index_select(const Tensor& dst, const Tensor& src, int64_t dim, const Tensor& index) {
  check_index(index, "index_select");
  const int64_t n = dst.numel(), n_idx = index.numel(), limit = src.sizes()[dim];
  if (n == 0) return;
  DeviceGuard guard(device());
  int64_t inner = 1;
  for (int64_t d = dim + 1; d < dst.dim(); ++d) inner *= dst.sizes()[d];
  const std::size_t es = src.element_size();
  const int64_t* ip = static_cast<const int64_t*>(index.data_ptr());
  cudaStream_t st = stream();
  if (src.is_contiguous() && dst.is_contiguous() && inner * static_cast<int64_t>(es) >= 64) {
    // Row copies; 16-byte vectors when rows and both bases allow.
    const int64_t n_rows = n / inner;
    const bool vec = (inner * es) % 16 == 0 && reinterpret_cast<uintptr_t>(src.data_ptr()) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(dst.data_ptr()) % 16 == 0;
    if (vec) {
      select_rows_kernel<uint4><<<grid_for(n_rows * 32, 256), 256, 0, st>>>(
          static_cast<const uint4*>(src.data_ptr()), static_cast<uint4*>(dst.data_ptr()), ip, n_rows, n_idx,
          static_cast<int64_t>(inner * es / 16), limit, static_cast<int32_t>(dim), error_record());
    } else {
      dispatch_by_size(es, "index_select", [&](auto tag) {
        using T = typename decltype(tag)::type;
        select_rows_kernel<T><<<grid_for(n_rows * 32, 256), 256, 0, st>>>(
            static_cast<const T*>(src.data_ptr()), static_cast<T*>(dst.data_ptr()), ip, n_rows, n_idx, inner, limit,
            static_cast<int32_t>(dim), error_record());
      });
    }
    FLAME_CUDA_CHECK_LAUNCH();
    return;
  }
  const OffsetMap smap = walk_map(dst.sizes(), src, dim), dmap = walk_map(dst.sizes(), dst);
  dispatch_by_size(es, "index_select", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gather_elements_kernel<T><<<grid_for(n, 256), 256, 0, st>>>(
        static_cast<const T*>(src.data_ptr()), smap, src.strides()[dim], static_cast<T*>(dst.data_ptr()), dmap, ip, n,
        inner, n_idx, limit, static_cast<int32_t>(dim), kErrIndexSelect, error_record());
  });
  FLAME_CUDA_CHECK_LAUNCH();
}

// dst (index's shape) = src[..., index[...], ...] along dim.
void CudaBackend::gather(const Tensor& dst, const Tensor& src, int64_t dim, const Tensor& index) {
  check_index(index, "gather");
  const int64_t n = dst.numel(), limit = src.sizes()[dim];
  if (n == 0) return;
  FLAME_CHECK(index.numel() == n, "gather", "index and result sizes differ");
  DeviceGuard guard(device());
  const OffsetMap smap = walk_map(dst.sizes(), src, dim), dmap = walk_map(dst.sizes(), dst);
  dispatch_by_size(src.element_size(), "gather", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gather_elements_kernel<T><<<grid_for(n, 256), 256, 0, stream()>>>(
        static_cast<const T*>(src.data_ptr()), smap, src.strides()[dim], static_cast<T*>(dst.data_ptr()), dmap,
        static_cast<const int64_t*>(index.data_ptr()), n, 1, n, limit, static_cast<int32_t>(dim), kErrGather,
        error_record());
  });
  FLAME_CUDA_CHECK_LAUNCH();
}

// dst[..., index[p], ...] = src[p] (accumulate: +=) for every position p of index.
void CudaBackend::scatter(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src, bool accumulate) {
  const char* op = accumulate ? "scatter_add" : "scatter";
  check_index(index, op);
  FLAME_CHECK(src.dtype() == dst.dtype(), op, "source dtype ", dtype_name(src.dtype()), " differs from ",
              dtype_name(dst.dtype()));
  const int64_t n = index.numel(), limit = dst.sizes()[dim];
  if (n == 0) return;
  DeviceGuard guard(device());
  const OffsetMap dmap = walk_map(index.sizes(), dst, dim), smap = walk_map(index.sizes(), src);
  const int64_t* ip = static_cast<const int64_t*>(index.data_ptr());
  const int64_t step = dst.strides()[dim];
  const auto d32 = static_cast<int32_t>(dim);
  if (accumulate) {
    dispatch_dtype(dst.dtype(), op, [&](auto tag) {
      using T = typename decltype(tag)::type;
      scatter_kernel<T, true><<<grid_for(n, 256), 256, 0, stream()>>>(static_cast<T*>(dst.data_ptr()), dmap, step,
                                                                      static_cast<const T*>(src.data_ptr()), smap, ip,
                                                                      n, limit, d32, error_record());
    });
  } else {
    dispatch_by_size(dst.element_size(), op, [&](auto tag) {
      using T = typename decltype(tag)::type;
      scatter_kernel<T, false><<<grid_for(n, 256), 256, 0, stream()>>>(static_cast<T*>(dst.data_ptr()), dmap, step,
                                                                       static_cast<const T*>(src.data_ptr()), smap, ip,
                                                                       n, limit, d32, error_record());
    });
  }
  FLAME_CUDA_CHECK_LAUNCH();
}

// Sync point: the result's size depends on the mask, so the count is read back to the host
// (Note [Current stream]); deferred index errors are raised here too.
Tensor CudaBackend::masked_select(const Tensor& src, const Tensor& mask) {
  FLAME_CHECK(mask.dtype() == DType::boolean && mask.sizes() == src.sizes(), "masked_select",
              "the CUDA kernel expects a bool mask of the source's shape");
  DeviceGuard guard(device());
  const int64_t n = src.numel();
  const Tensor s = src.is_contiguous() ? src : contiguous_copy(*this, src);
  const Tensor m = mask.is_contiguous() ? mask : contiguous_copy(*this, mask);
  cudaStream_t st = stream();
  check_not_capturing(st, "masked_select", "read the selected count to the host");
  auto scratch = allocate(2 * sizeof(unsigned long long));
  auto* count_dev = static_cast<unsigned long long*>(scratch.get());
  unsigned long long count = 0;
  if (n > 0) {
    FLAME_CUDA_CHECK(cudaMemsetAsync(count_dev, 0, sizeof(unsigned long long), st));
    const auto* mp = static_cast<const uint8_t*>(m.data_ptr());
    count_true_kernel<<<std::min<unsigned>(grid_for(n / 16 + 1, 256), 2048), 256, 0, st>>>(
        mp, n, reinterpret_cast<uintptr_t>(mp) % 16 == 0, count_dev);
    FLAME_CUDA_CHECK_LAUNCH();
    FLAME_CUDA_CHECK(cudaMemcpyAsync(&count, count_dev, sizeof(count), cudaMemcpyDeviceToHost, st));
    FLAME_CUDA_CHECK(cudaStreamSynchronize(st));
  }
  raise_deferred_error();
  Tensor out = Tensor::empty({static_cast<int64_t>(count)}, {src.dtype(), Device::cuda(device())});
  if (count == 0) return out;
  dispatch_by_size(src.element_size(), "masked_select", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* in = static_cast<const T*>(s.data_ptr());
    const bool* flags = static_cast<const bool*>(m.data_ptr());
    T* o = static_cast<T*>(out.data_ptr());
    auto* num = reinterpret_cast<int64_t*>(count_dev + 1);
    std::size_t temp_bytes = 0;
    FLAME_CUDA_CHECK(cub::DeviceSelect::Flagged(nullptr, temp_bytes, in, flags, o, num, n, st));
    auto temp = allocate(std::max<std::size_t>(temp_bytes, 1));
    FLAME_CUDA_CHECK(cub::DeviceSelect::Flagged(temp.get(), temp_bytes, in, flags, o, num, n, st));
  });
  return out;
}

// Stable sort along dim (Note [CUDA sort keys]); values keep src's dtype, indices are i64.
void CudaBackend::sort(const Tensor& values, const Tensor& indices, const Tensor& src, int64_t dim, bool descending) {
  FLAME_CHECK(values.dtype() == src.dtype() && indices.dtype() == DType::i64 && values.sizes() == src.sizes() &&
                  indices.sizes() == src.sizes(),
              "sort", "bad arguments for a source of shape ", src.sizes());
  if (src.numel() == 0) return;
  DeviceGuard guard(device());
  dispatch_dtype(src.dtype(), "sort", [&](auto tag) {
    sort_typed<typename decltype(tag)::type>(*this, values, indices, src, dim, descending);
  });
}

}  // namespace flame::backend::cuda
