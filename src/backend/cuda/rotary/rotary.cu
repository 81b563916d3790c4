// CUDA kernels of the rotary embedding (src/backend/fused/rotary.h); x and out in their storage
// dtype, the arithmetic in cos's (f32, or f64 for f64 x).
//  - rotary_vec_kernel (f32 tables, bf16/f16/f32 x, 16-byte aligned, D a multiple of one vector:
//    two for the half layout): one thread per 16-byte vector of x (the half layout: a vector of each
//    half, which hold the pairs), read and written once with vector accesses, the tables' values
//    read as float4s (L2-resident: one [S, D] table serves every head); 32-bit index arithmetic
//    when the sizes allow. FLUX's q and k at 1024² ([1, 4608, 24, 128] bf16, 27 MiB) took 50 us
//    with one thread per pair and two 64-bit divisions each.
//  - rotary_kernel: one thread per pair of one row, grid-stride, for every other call.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/backend/cuda/launch_geometry.cuh"
#include "src/backend/cuda/rotary/vectors.cuh"
#include "src/backend/fused/rotary.h"

namespace flame::backend::cuda {
namespace {

constexpr int kThreads = 256;

using rotary_vec::load_f32;
using rotary_vec::load_vec;
using rotary_vec::store_vec;

// One thread per unit: interleaved, kV consecutive elements (kV / 2 pairs); half, the kV elements
// from col in the first half and their partners from col + D/2. I: the index type.
template <class T, bool kHalf, bool kInverse, class I>
__global__ void rotary_vec_kernel(T* __restrict__ out, const T* __restrict__ x, const float* __restrict__ cos,
                                  const float* __restrict__ sin, I units, I units_per_row, I s_len, I heads, I d) {
  constexpr int kV = 16 / sizeof(T);
  const I half = d / 2;
  const I stride = static_cast<I>(gridDim.x) * static_cast<I>(blockDim.x);
  for (I u = static_cast<I>(blockIdx.x) * static_cast<I>(blockDim.x) + static_cast<I>(threadIdx.x); u < units;
       u += stride) {
    const I row = u / units_per_row;
    const I col = (u - row * units_per_row) * static_cast<I>(kV);
    const I s = (row / heads) % s_len;
    const I xo = row * d + col, co = s * d + col;
    float ca[kV], sa[kV], xa[kV], oa[kV];
    load_f32(ca, cos + co);
    load_f32(sa, sin + co);
    load_vec<T>(xa, x + xo);
    if constexpr (!kHalf) {
#pragma unroll
      for (int j = 0; j < kV; j += 2) {
        const float a = xa[j], b = xa[j + 1];
        if constexpr (!kInverse) {
          oa[j] = a * ca[j] - b * sa[j];
          oa[j + 1] = b * ca[j + 1] + a * sa[j + 1];
        } else {
          oa[j] = a * ca[j] + b * sa[j + 1];
          oa[j + 1] = b * ca[j + 1] - a * sa[j];
        }
      }
      store_vec<T>(out + xo, oa);
    } else {
      float cb[kV], sb[kV], xb[kV], ob[kV];
      load_f32(cb, cos + co + half);
      load_f32(sb, sin + co + half);
      load_vec<T>(xb, x + xo + half);
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        if constexpr (!kInverse) {
          oa[j] = xa[j] * ca[j] - xb[j] * sa[j];
          ob[j] = xb[j] * cb[j] + xa[j] * sb[j];
        } else {
          oa[j] = xa[j] * ca[j] + xb[j] * sb[j];
          ob[j] = xb[j] * cb[j] - xa[j] * sa[j];
        }
      }
      store_vec<T>(out + xo, oa);
      store_vec<T>(out + xo + half, ob);
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The vector kernel for the calls it takes (f32 tables; bf16, f16 or f32 x; aligned; D a multiple
// of the vector, twice that for the half layout). False: not taken, nothing launched.
bool rotary_vec(CudaBackend& be, const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, int layout,
                bool inverse, int64_t heads) {
  if (cos.dtype() != DType::f32 || sin.dtype() != DType::f32) return false;
  if (x.dtype() != DType::bf16 && x.dtype() != DType::f16 && x.dtype() != DType::f32) return false;
  const int64_t v = 16 / static_cast<int64_t>(dtype_size(x.dtype()));
  const int64_t d = x.size(-1), s_len = cos.size(0);
  const int64_t per_unit = layout == 1 ? 2 * v : v;
  if (d % per_unit != 0 || !aligned16(out.data_ptr()) || !aligned16(x.data_ptr()) || !aligned16(cos.data_ptr()) ||
      !aligned16(sin.data_ptr()))
    return false;
  const int64_t units = x.numel() / per_unit, units_per_row = d / per_unit;
  const int64_t cap = static_cast<int64_t>(sm_count(be.device())) * 8;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(cap, (units + kThreads - 1) / kThreads));
  const bool narrow = x.numel() < (int64_t{1} << 31) && cos.numel() < (int64_t{1} << 31);
  auto go = [&]<class T, bool kHalf, bool kInverse, class I>() {
    rotary_vec_kernel<T, kHalf, kInverse, I><<<blocks, kThreads, 0, be.stream()>>>(
        static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()), static_cast<const float*>(cos.data_ptr()),
        static_cast<const float*>(sin.data_ptr()), static_cast<I>(units), static_cast<I>(units_per_row),
        static_cast<I>(s_len), static_cast<I>(heads), static_cast<I>(d));
    FLAME_CUDA_CHECK_LAUNCH();
  };
  auto index = [&]<class T, bool kHalf, bool kInverse>() {
    if (narrow) go.template operator()<T, kHalf, kInverse, uint32_t>();
    else go.template operator()<T, kHalf, kInverse, uint64_t>();
  };
  auto modes = [&]<class T>() {
    if (layout == 1) {
      if (inverse) index.template operator()<T, true, true>();
      else index.template operator()<T, true, false>();
    } else {
      if (inverse) index.template operator()<T, false, true>();
      else index.template operator()<T, false, false>();
    }
  };
  if (x.dtype() == DType::bf16) modes.template operator()<bfloat16>();
  else if (x.dtype() == DType::f16) modes.template operator()<float16>();
  else modes.template operator()<float>();
  return true;
}

template <class T, class C, bool kHalf, bool kInverse>
__global__ void rotary_kernel(T* __restrict__ out, const T* __restrict__ x, const C* __restrict__ cos,
                              const C* __restrict__ sin, int64_t pairs_total, int64_t s_len, int64_t heads,
                              int64_t d) {
  const int64_t half = d / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs_total; p += stride) {
    const int64_t row = p / half, j = p - row * half;
    const int64_t s = (row / heads) % s_len;
    const int64_t a = kHalf ? j : 2 * j, b = kHalf ? j + half : 2 * j + 1;
    const int64_t xo = row * d, co = s * d;
    const C xa = load_as<C>(x[xo + a]), xb = load_as<C>(x[xo + b]);
    C oa, ob;
    if constexpr (!kInverse) {
      oa = xa * cos[co + a] - xb * sin[co + a];
      ob = xb * cos[co + b] + xa * sin[co + b];
    } else {
      oa = xa * cos[co + a] + xb * sin[co + b];
      ob = xb * cos[co + b] - xa * sin[co + a];
    }
    out[xo + a] = store_as<T>(oa);
    out[xo + b] = store_as<T>(ob);
  }
}

bool rotary_embedding_cuda(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, int layout,
                           bool inverse, int64_t heads) {
  CudaBackend& be = cuda_backend(x.device().index);
  const int64_t d = x.size(-1), s_len = cos.size(0);
  const int64_t pairs_total = x.numel() / 2;
  if (pairs_total == 0) return true;
  DeviceGuard guard(be.device());
  if (rotary_vec(be, out, x, cos, sin, layout, inverse, heads)) return true;
  const int64_t cap = static_cast<int64_t>(sm_count(be.device())) * 8;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(cap, (pairs_total + kThreads - 1) / kThreads));
  dispatch_floating(x.dtype(), "rotary_embedding", [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto go = [&]<class C, bool kHalf, bool kInverse>() {
      rotary_kernel<T, C, kHalf, kInverse><<<blocks, kThreads, 0, be.stream()>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()), static_cast<const C*>(cos.data_ptr()),
          static_cast<const C*>(sin.data_ptr()), pairs_total, s_len, heads, d);
      FLAME_CUDA_CHECK_LAUNCH();
    };
    auto pick = [&]<class C>() {
      if (layout == 1) {
        if (inverse) go.template operator()<C, true, true>();
        else go.template operator()<C, true, false>();
      } else {
        if (inverse) go.template operator()<C, false, true>();
        else go.template operator()<C, false, false>();
      }
    };
    if (cos.dtype() == DType::f64) pick.template operator()<double>();
    else pick.template operator()<float>();
  });
  return true;
}

}  // namespace

void register_rotary_kernels() { fused::rotary_embedding.define(DeviceType::cuda, &rotary_embedding_cuda); }

}  // namespace flame::backend::cuda
