#pragma once
// The generic elementwise machinery of the CUDA backend: device-side dtype conversions, the two
// kernels every elementwise family instantiates, and their launcher. The families themselves
// (copy, fill, iota, unary, binary, where) are in elementwise.cu; random.cu uses the conversions.
//
// Note [Elementwise kernels]
// An elementwise op is an Op functor `Out op(int64_t index, A a, B b, C c)` over 0 to 3 inputs
// (index is the output element's row-major index, used by iota). launch_elementwise() picks:
//  1. the vector kernel, when after coalescing the output is dense and every input is dense or a
//     single broadcast element (stride 0 everywhere), and the dense pointers are aligned. Each
//     thread loads VEC elements of every dense operand with 16-byte (or narrower, when VEC
//     elements are fewer bytes) loads, a broadcast operand is read once per thread, and VEC
//     outputs go out in one store. VEC = 16 bytes / the narrowest operand type, at most 8 unless
//     all operands are single bytes. Index math is 32-bit; tensors above 2^30 elements are cut
//     into launches of 2^30 elements (pointers advanced on the host).
//  2. the strided kernel otherwise (views, broadcasting, misaligned pointers): the output's
//     row-major index is turned into one element offset per operand by OffsetCalc, with one
//     division per coalesced dim shared by all operands; stride 0 broadcasts without copying.
//     32-bit index math when numel and every operand's largest offset fit in int32, else 64-bit.
// Coalescing first drops size-1 dims and merges neighbouring dims that are contiguous for every
// operand, so a contiguous tensor is 1-d and a transposed or row-broadcast one is 2-d.
// Grids (measured on H100, 256 MiB operands): the vector kernel gets one thread per VEC-element
// pack (its grid-stride loop only guards the 2^31 grid limit); capping it at 4 waves of resident
// blocks cost 2-20% (bf16 -> f32 conversion: 2.19 vs 2.76 TB/s). The strided kernel runs a
// grid-stride loop over at most kStridedWaves full waves, which was the better choice for
// broadcast operands (row bias add 2.19 vs 1.78 TB/s uncapped) and 25% worse for transposes.
// Arithmetic happens in the compute type of Note [Compute types] (float for bf16/f16, double for
// f64, int64 for integers and bool) with the shared functors of src/opdef/scalar_math.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/core/dispatch.h"
#include "src/opdef/scalar_math.h"

namespace flame::backend::cuda {
namespace ew {

constexpr int kThreads = 256;
constexpr int64_t kVectorChunk = int64_t{1} << 30;  // elements per vector-kernel launch
constexpr int kStridedWaves = 4;                    // grid cap of the strided kernel, in waves

// Device conversions (dconvert, half_to_float, float_to_half) live in device_utils.cuh; random.cu
// and other files name them as ew::dconvert.
using cuda::dconvert;
using cuda::float_to_half;
using cuda::half_to_float;
using cuda::is_half_v;

// ---- operands ----
struct NoArg {};

template <class T, int N>
constexpr std::size_t pack_align() {
  return sizeof(T) * N < 16 ? sizeof(T) * N : 16;
}
template <class T, int N>
struct alignas(pack_align<T, N>()) Pack {
  T v[N];
};

struct Ptrs {
  char* p[4];  // p[0] is the output, p[1..3] the inputs
};

template <class... T>
constexpr int vector_width() {
  constexpr std::size_t lo = std::min({sizeof(T)...});
  constexpr std::size_t hi = std::max({sizeof(T)...});
  constexpr int v = static_cast<int>(16 / lo);
  return (hi > 1 && v > 8) ? 8 : v;
}

// Element offsets of N operands for a row-major index. Dims are stored innermost first; the
// outermost dim needs no division (the remaining quotient is its index).
template <int N, class Index>
struct OffsetCalc {
  using U = std::make_unsigned_t<Index>;
  int ninner;  // coalesced dims minus one
  Index sizes[kMaxDims];
  Index strides[kMaxDims][N];
  Index outer[N];

  __device__ __forceinline__ void get(U i, Index (&off)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] = 0;
#pragma unroll
    for (int d = 0; d < kMaxDims; ++d) {
      if (d == ninner) break;
      const U s = static_cast<U>(sizes[d]);
      const U q = i / s;
      const Index r = static_cast<Index>(i - q * s);
      i = q;
#pragma unroll
      for (int k = 0; k < N; ++k) off[k] += r * strides[d][k];
    }
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] += static_cast<Index>(i) * outer[k];
  }
};

template <int NIn, class Op, class A, class B, class C>
__device__ __forceinline__ auto call_op(const Op& op, int64_t index, const A& a, const B& b, const C& c) {
  if constexpr (NIn == 0) {
    return op(index);
  } else if constexpr (NIn == 1) {
    return op(index, a);
  } else if constexpr (NIn == 2) {
    return op(index, a, b);
  } else {
    return op(index, a, b, c);
  }
}

template <class T, int VEC>
__device__ __forceinline__ void load_pack(T (&dst)[VEC], const char* base, uint32_t v, bool bcast, const T& scalar) {
  if (bcast) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) dst[j] = scalar;
  } else {
    const Pack<T, VEC> pk = reinterpret_cast<const Pack<T, VEC>*>(base)[v];
#pragma unroll
    for (int j = 0; j < VEC; ++j) dst[j] = pk.v[j];
  }
}

template <class T>
__device__ __forceinline__ T load_one(const char* base, uint32_t i, bool bcast, const T& scalar) {
  return bcast ? scalar : reinterpret_cast<const T*>(base)[i];
}

// Kernel 1 of Note [Elementwise kernels]: dense or single-element operands, VEC per thread.
// `bcast` bit k-1 set: input k is one broadcast element.
template <int VEC, int NIn, class Op, class Out, class A, class B, class C>
__global__ void __launch_bounds__(kThreads) vector_kernel(uint32_t n, int64_t base, Ptrs ptrs, uint32_t bcast, Op op) {
  const uint32_t nvec = n / VEC;
  const uint32_t step = gridDim.x * kThreads;
  const uint32_t tid = blockIdx.x * kThreads + threadIdx.x;
  const bool ba = bcast & 1u, bb = bcast & 2u, bc = bcast & 4u;
  A sa{};
  B sb{};
  C sc{};
  if constexpr (NIn >= 1) if (ba) sa = *reinterpret_cast<const A*>(ptrs.p[1]);
  if constexpr (NIn >= 2) if (bb) sb = *reinterpret_cast<const B*>(ptrs.p[2]);
  if constexpr (NIn >= 3) if (bc) sc = *reinterpret_cast<const C*>(ptrs.p[3]);
  for (uint32_t v = tid; v < nvec; v += step) {
    A a[VEC];
    B b[VEC];
    C c[VEC];
    if constexpr (NIn >= 1) load_pack<A, VEC>(a, ptrs.p[1], v, ba, sa);
    if constexpr (NIn >= 2) load_pack<B, VEC>(b, ptrs.p[2], v, bb, sb);
    if constexpr (NIn >= 3) load_pack<C, VEC>(c, ptrs.p[3], v, bc, sc);
    Pack<Out, VEC> o;
    const int64_t first = base + static_cast<int64_t>(v) * VEC;
#pragma unroll
    for (int j = 0; j < VEC; ++j) o.v[j] = call_op<NIn>(op, first + j, a[j], b[j], c[j]);
    reinterpret_cast<Pack<Out, VEC>*>(ptrs.p[0])[v] = o;
  }
  for (uint32_t i = nvec * VEC + tid; i < n; i += step) {
    A a{};
    B b{};
    C c{};
    if constexpr (NIn >= 1) a = load_one<A>(ptrs.p[1], i, ba, sa);
    if constexpr (NIn >= 2) b = load_one<B>(ptrs.p[2], i, bb, sb);
    if constexpr (NIn >= 3) c = load_one<C>(ptrs.p[3], i, bc, sc);
    reinterpret_cast<Out*>(ptrs.p[0])[i] = call_op<NIn>(op, base + i, a, b, c);
  }
}

// Kernel 2 of Note [Elementwise kernels]: any strides (views, broadcasting).
template <int NIn, class Index, class Op, class Out, class A, class B, class C>
__global__ void __launch_bounds__(kThreads)
    strided_kernel(Index n, Ptrs ptrs, const __grid_constant__ OffsetCalc<NIn + 1, Index> calc, Op op) {
  using U = std::make_unsigned_t<Index>;
  const U step = static_cast<U>(gridDim.x) * kThreads;
  for (U i = static_cast<U>(blockIdx.x) * kThreads + threadIdx.x; i < static_cast<U>(n); i += step) {
    Index off[NIn + 1];
    calc.get(i, off);
    A a{};
    B b{};
    C c{};
    if constexpr (NIn >= 1) a = reinterpret_cast<const A*>(ptrs.p[1])[off[1]];
    if constexpr (NIn >= 2) b = reinterpret_cast<const B*>(ptrs.p[2])[off[2]];
    if constexpr (NIn >= 3) c = reinterpret_cast<const C*>(ptrs.p[3])[off[3]];
    reinterpret_cast<Out*>(ptrs.p[0])[off[0]] = call_op<NIn>(op, static_cast<int64_t>(i), a, b, c);
  }
}

// ---- launcher ----

// Copies src into dst through shared-memory tiles when the two have their unit strides on
// different dims (a transpose); returns false, doing nothing, otherwise (copy_tiled.cu).
bool tiled_copy(CudaBackend& be, const Tensor& dst, const Tensor& src);

// Grid cap of the strided kernel: kStridedWaves full waves of kThreads-thread blocks.
unsigned int max_blocks(int device);

// The coalesced geometry of N operands over the output's shape (Note [Elementwise kernels]).
template <int N>
struct Geometry {
  int ndim = 0;
  int64_t sizes[kMaxDims];
  int64_t strides[N][kMaxDims];
};

template <int N>
Geometry<N> coalesce(const std::array<const Tensor*, N>& ts) {
  const Tensor& out = *ts[0];
  FLAME_CHECK(out.dim() <= kMaxDims, "cuda elementwise", "tensors with more than ", kMaxDims,
              " dims are not supported (shape ", out.sizes(), ")");
  Geometry<N> g;
  for (int64_t d = 0; d < out.dim(); ++d) {
    const int64_t s = out.sizes()[d];
    if (s == 1) continue;
    if (g.ndim > 0) {
      const int prev = g.ndim - 1;
      bool mergeable = true;
      for (int k = 0; k < N; ++k) mergeable &= g.strides[k][prev] == ts[k]->strides()[d] * s;
      if (mergeable) {
        g.sizes[prev] *= s;
        for (int k = 0; k < N; ++k) g.strides[k][prev] = ts[k]->strides()[d];
        continue;
      }
    }
    g.sizes[g.ndim] = s;
    for (int k = 0; k < N; ++k) g.strides[k][g.ndim] = ts[k]->strides()[d];
    ++g.ndim;
  }
  if (g.ndim == 0) {  // a single element
    g.ndim = 1;
    g.sizes[0] = 1;
    for (int k = 0; k < N; ++k) g.strides[k][0] = 1;
  }
  return g;
}

template <int N, class Index>
OffsetCalc<N, Index> make_offset_calc(const Geometry<N>& g) {
  OffsetCalc<N, Index> c{};
  c.ninner = g.ndim - 1;
  for (int j = 0; j < g.ndim - 1; ++j) {
    const int d = g.ndim - 1 - j;  // innermost first
    c.sizes[j] = static_cast<Index>(g.sizes[d]);
    for (int k = 0; k < N; ++k) c.strides[j][k] = static_cast<Index>(g.strides[k][d]);
  }
  for (int k = 0; k < N; ++k) c.outer[k] = static_cast<Index>(g.strides[k][0]);
  return c;
}

template <int N>
bool fits_int32(const Geometry<N>& g, int64_t n) {
  constexpr int64_t kMax = INT32_MAX;
  if (n > kMax) return false;
  for (int k = 0; k < N; ++k) {
    int64_t reach = 0;
    for (int d = 0; d < g.ndim; ++d) {
      const int64_t s = g.strides[k][d] < 0 ? -g.strides[k][d] : g.strides[k][d];
      reach += (g.sizes[d] - 1) * s;
      if (reach > kMax) return false;
    }
  }
  return true;
}

template <class T>
constexpr std::size_t elem_size() {
  return std::is_same_v<T, NoArg> ? 0 : sizeof(T);
}

// Runs `op` over every element of `dst` (Note [Elementwise kernels]). `ins` are the NIn inputs,
// already broadcast to dst's shape, of element types A, B, C.
template <int NIn, class Out, class A, class B, class C, class Op>
void launch_elementwise(CudaBackend& be, const Tensor& dst, std::array<const Tensor*, NIn> ins, const Op& op) {
  constexpr int N = NIn + 1;
  const int64_t n = dst.numel();
  if (n == 0) return;
  DeviceGuard guard(be.device());
  std::array<const Tensor*, N> ts{};
  ts[0] = &dst;
  for (int k = 0; k < NIn; ++k) ts[k + 1] = ins[k];
  const Geometry<N> g = coalesce<N>(ts);
  Ptrs ptrs{};
  for (int k = 0; k < N; ++k) ptrs.p[k] = static_cast<char*>(ts[k]->data_ptr());
  constexpr std::size_t esize[4] = {sizeof(Out), elem_size<A>(), elem_size<B>(), elem_size<C>()};
  const cudaStream_t stream = be.stream();

  if (g.ndim == 1 && g.strides[0][0] == 1) {
    constexpr int VEC = NIn == 0 ? vector_width<Out>()
                        : NIn == 1 ? vector_width<Out, A>()
                        : NIn == 2 ? vector_width<Out, A, B>()
                                   : vector_width<Out, A, B, C>();
    bool ok = true;
    uint32_t bcast = 0;
    for (int k = 0; k < N; ++k) {
      const int64_t s = g.strides[k][0];
      if (s == 0 && k > 0) {
        bcast |= 1u << (k - 1);
      } else if (s == 1) {
        const std::size_t align = std::min<std::size_t>(16, esize[k] * VEC);
        ok &= reinterpret_cast<uintptr_t>(ptrs.p[k]) % align == 0;
      } else {
        ok = false;
      }
    }
    if (ok) {
      for (int64_t start = 0; start < n; start += kVectorChunk) {
        const int64_t len = std::min(kVectorChunk, n - start);
        Ptrs chunk = ptrs;
        for (int k = 0; k < N; ++k) {
          if (k == 0 || !(bcast & (1u << (k - 1)))) chunk.p[k] += start * static_cast<int64_t>(esize[k]);
        }
        const int64_t work = std::max<int64_t>(len / VEC, 1);
        const unsigned int blocks = blocks_for(work, kThreads, int64_t{1} << 30);
        vector_kernel<VEC, NIn, Op, Out, A, B, C>
            <<<blocks, kThreads, 0, stream>>>(static_cast<uint32_t>(len), start, chunk, bcast, op);
        FLAME_CUDA_CHECK_LAUNCH();
      }
      return;
    }
  }

  const unsigned int blocks = blocks_for(n, kThreads, max_blocks(be.device()));
  if (fits_int32<N>(g, n)) {
    strided_kernel<NIn, int32_t, Op, Out, A, B, C>
        <<<blocks, kThreads, 0, stream>>>(static_cast<int32_t>(n), ptrs, make_offset_calc<N, int32_t>(g), op);
  } else {
    strided_kernel<NIn, int64_t, Op, Out, A, B, C>
        <<<blocks, kThreads, 0, stream>>>(n, ptrs, make_offset_calc<N, int64_t>(g), op);
  }
  FLAME_CUDA_CHECK_LAUNCH();
}

// ---- the unary and binary families (Op functors and dtype dispatch) ----

template <class F, class T, class O>
struct UnaryFn {
  UnaryParams p;
  __device__ __forceinline__ O operator()(int64_t, T x) const {
    using Cmp = compute_t<T>;
    return dconvert<O>(F{}(dconvert<Cmp>(x), p));
  }
};

template <class F, class T, class O>
struct BinaryFn {
  __device__ __forceinline__ O operator()(int64_t, T a, T b) const {
    using Cmp = compute_t<T>;
    return dconvert<O>(F{}(dconvert<Cmp>(a), dconvert<Cmp>(b)));
  }
};

// Result dtype by op kind (Note [Op list]): predicates give bool, the others the input dtype.
template <OpKind K, class T>
using result_t = std::conditional_t<K == OpKind::predicate, bool, T>;

template <class F, OpKind K>
void unary_typed(CudaBackend& be, const Tensor& dst, const Tensor& src, const UnaryParams& p) {
  auto body = [&](auto tag) {
    using T = typename decltype(tag)::type;
    using O = result_t<K, T>;
    FLAME_CHECK(dst.dtype() == dtype_of_v<O>, "cuda unary", "output dtype ", dtype_name(dst.dtype()),
                " does not match the op's result dtype ", dtype_name(dtype_of_v<O>));
    launch_elementwise<1, O, T, NoArg, NoArg>(be, dst, {&src}, UnaryFn<F, T, O>{p});
  };
  // The op layer converts integer inputs of floating ops to f32, so those see floating types only.
  if constexpr (K == OpKind::floating) {
    dispatch_floating(src.dtype(), "cuda unary", body);
  } else {
    dispatch_dtype(src.dtype(), "cuda unary", body);
  }
}

template <class F, OpKind K>
void binary_typed(CudaBackend& be, const Tensor& dst, const Tensor& a, const Tensor& b) {
  FLAME_CHECK(a.dtype() == b.dtype(), "cuda binary", "operands must have one dtype, got ", dtype_name(a.dtype()),
              " and ", dtype_name(b.dtype()));
  auto body = [&](auto tag) {
    using T = typename decltype(tag)::type;
    using O = result_t<K, T>;
    FLAME_CHECK(dst.dtype() == dtype_of_v<O>, "cuda binary", "output dtype ", dtype_name(dst.dtype()),
                " does not match the op's result dtype ", dtype_name(dtype_of_v<O>));
    launch_elementwise<2, O, T, T, NoArg>(be, dst, {&a, &b}, BinaryFn<F, T, O>{});
  };
  if constexpr (K == OpKind::floating) {
    dispatch_floating(a.dtype(), "cuda binary", body);
  } else {
    dispatch_dtype(a.dtype(), "cuda binary", body);
  }
}

// The unary ops of kind `floating` (elementwise_unary_float.cu; compiled apart to split the build).
void unary_floating(CudaBackend& be, UnaryOp op, const Tensor& dst, const Tensor& src, const UnaryParams& p);

// The unsigned integer type of each element size: kernels that only move bits (same-dtype copy,
// fill, where) are instantiated once per size instead of once per dtype.
template <std::size_t S>
struct bits_of;
template <> struct bits_of<1> { using type = uint8_t; };
template <> struct bits_of<2> { using type = uint16_t; };
template <> struct bits_of<4> { using type = uint32_t; };
template <> struct bits_of<8> { using type = uint64_t; };
template <class T>
using bits_t = typename bits_of<sizeof(T)>::type;

}  // namespace ew
}  // namespace flame::backend::cuda
