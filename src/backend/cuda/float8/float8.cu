// CUDA kernels of the 8-bit float Linear (src/backend/fused/float8.h): the per-row scaled cast and
// the per-row dequantisation (the math of src/backend/float8_math.h, as the CPU reference), and the
// FP8 GEMM through cuBLASLt.
//
// Note [FP8 GEMM layout]
// cuBLASLt's FP8 GEMMs on Hopper take only the "TN" form: A transposed and B not, i.e. both
// operands stored with K contiguous. In FLAME's row-major terms (Note [Row-major GEMM through
// cuBLASLt] in matmul.cu) out [M, N] = a [M, K] b [N, K]^T is D [N, M] (column-major, ld N) =
// op_T(A) B with A = b stored [K, N] (ld K) and B = a stored [K, M] (ld K): a Linear's forward
// (x [rows, in] against its weight [out, in]) has that form as it is; its input gradient
// (dy [rows, out] against the weight read as [in, out]) needs the weight transposed first, which
// the op layer does. The scales are outer vectors (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F):
// cuBLAS's A scale has one value per row of D (b_scale, [N]) and its B scale one per column
// (a_scale, [M]); D = diag(b_scale) (A^T B) diag(a_scale) + bias, the bias one value per row of D.
// Where cuBLASLt offers no outer-vector scales for a call (its heuristic finds no algorithm), the
// GEMM runs without scales into out's dtype and one pass applies out[r, c] * a_scale[r] *
// b_scale[c] + bias[c] in f32 (scale_rows_cols). Plans (layouts and the heuristic's algorithm) are
// cached per shape, dtypes and scale mode; the operation descriptor is made per call with that
// call's scale and bias pointers bound.
#include <cublasLt.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/backend/cuda/epi/lt_shared.h"
#include "src/backend/cuda/memory_pool.h"
#include "src/backend/float8_math.h"
#include "src/backend/fused/float8.h"
#include "src/core/dispatch.h"

namespace flame::backend::cuda {
namespace {
namespace fm = float8_math;

constexpr int kThreads = 256;

template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// Note [Hardware FP8 cast]
// The row casts encode with cvt.rn.satfinite (two values per instruction): round to nearest, ties
// to even, saturating at the format's largest finite value, which are the bits of the software
// rounding of float8_math's encode_scaled (the CPU reference) for every value but NaN; a NaN is set
// to the format's NaN with its sign kept, as there. v / scale stays an IEEE division on both sides.
__device__ __forceinline__ uint8_t fix_nan(uint8_t code, float v) {
  return v != v ? static_cast<uint8_t>(signbit(v) ? 0xffu : 0x7fu) : code;
}
template <bool kE4m3>
__device__ __forceinline__ uint8_t encode_hw(float v) {
  return fix_nan(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, kE4m3 ? __NV_E4M3 : __NV_E5M2), v);
}
// a, b -> their codes in the low and high byte.
template <bool kE4m3>
__device__ __forceinline__ void encode_hw2(float a, float b, uint8_t& qa, uint8_t& qb) {
  const __nv_fp8x2_storage_t r = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kE4m3 ? __NV_E4M3 : __NV_E5M2);
  qa = fix_nan(static_cast<uint8_t>(r & 0xffu), a);
  qb = fix_nan(static_cast<uint8_t>(r >> 8), b);
}
// V values divided by s into a pack of codes (V even, or 1).
template <bool kE4m3, int V>
__device__ __forceinline__ void encode_pack(const float* v, float s, uint8_t* q) {
  if constexpr (V % 2 == 0) {
#pragma unroll
    for (int i = 0; i < V; i += 2) encode_hw2<kE4m3>(v[i] / s, v[i + 1] / s, q[i], q[i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) q[i] = encode_hw<kE4m3>(v[i] / s);
  }
}

// NaN-keeping max over a block of any multiple of 32 threads (at most 1024); every thread gets the
// result. red holds 32 floats and may be reused once this returns.
__device__ float block_nan_max(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v = fm::nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float m = red[0];
  for (int w = 1; w < warps; ++w) m = fm::nan_max(m, red[w]);
  __syncthreads();
  return m;
}

// One block per row (grid-stride over rows); V elements per access (V = 1: any alignment).
template <class T, bool kE4m3, int V>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(uint8_t* __restrict__ q, float* __restrict__ scale,
                                                                 const T* __restrict__ x,
                                                                 const float* __restrict__ col, int64_t rows,
                                                                 int64_t cols) {
  __shared__ float red[32];
  const float fmax = kE4m3 ? fm::kE4m3Max : fm::kE5m2Max;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    float amax = 0.0f;
    for (int64_t c0 = static_cast<int64_t>(threadIdx.x) * V; c0 < cols; c0 += static_cast<int64_t>(kThreads) * V) {
      const Pack<T, V> p = *reinterpret_cast<const Pack<T, V>*>(xr + c0);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float v = col ? load_as<float>(p.v[i]) * col[c0 + i] : load_as<float>(p.v[i]);
        amax = fm::nan_max(amax, fabsf(v));
      }
    }
    const float s = fm::row_scale(block_nan_max(amax, red), fmax);
    if (threadIdx.x == 0) scale[r] = s;
    uint8_t* qr = q + r * cols;
    for (int64_t c0 = static_cast<int64_t>(threadIdx.x) * V; c0 < cols; c0 += static_cast<int64_t>(kThreads) * V) {
      const Pack<T, V> p = *reinterpret_cast<const Pack<T, V>*>(xr + c0);
      float v[V];
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = col ? load_as<float>(p.v[i]) * col[c0 + i] : load_as<float>(p.v[i]);
      Pack<uint8_t, V> o;
      encode_pack<kE4m3, V>(v, s, o.v);
      *reinterpret_cast<Pack<uint8_t, V>*>(qr + c0) = o;
    }
  }
}

// Note [Register-resident row cast]: the row is read once. A block of blockDim.x threads (a
// multiple of 32, at most 1024) takes one row at a time; thread t holds packs t, t + blockDim.x, ...
// (K of them at most, consecutive threads on consecutive packs: coalesced) in registers for the
// amax and then encodes them, so each element is loaded once instead of twice (the two-pass kernel
// above, kept for rows longer than 1024 K packs and for unaligned rows).
template <class T, bool kE4m3, int V, int K>
__global__ void __launch_bounds__(1024) quantize_rows_reg_kernel(uint8_t* __restrict__ q, float* __restrict__ scale,
                                                                 const T* __restrict__ x,
                                                                 const float* __restrict__ col, int64_t rows,
                                                                 int64_t cols) {
  __shared__ float red[32];
  const float fmax = kE4m3 ? fm::kE4m3Max : fm::kE5m2Max;
  const int64_t packs = cols / V;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const auto* xr = reinterpret_cast<const Pack<T, V>*>(x + r * cols);
    float v[K][V];
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t pi = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (pi < packs) {
        const Pack<T, V> p = xr[pi];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          v[k][i] = col ? load_as<float>(p.v[i]) * col[pi * V + i] : load_as<float>(p.v[i]);
          amax = fm::nan_max(amax, fabsf(v[k][i]));
        }
      }
    }
    const float s = fm::row_scale(block_nan_max(amax, red), fmax);
    if (threadIdx.x == 0) scale[r] = s;
    auto* qr = reinterpret_cast<Pack<uint8_t, V>*>(q + r * cols);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t pi = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (pi < packs) {
        Pack<uint8_t, V> o;
        encode_pack<kE4m3, V>(v[k], s, o.v);
        qr[pi] = o;
      }
    }
  }
}

// Note [Row dequantisation]
// The 8-bit weight of a Linear in dequantize mode is widened before every GEMM that reads it
// (forward and backward): the pass moves 3 bytes per element for bf16 and is bound by memory.
// Rows of at least kRowPacks packs of 16 codes (one 16-byte load, two or four 16-byte stores)
// take dequantize_rows_2d: one row per grid row, so a thread finds its scale without dividing
// and the 16 codes widen in pairs with the hardware's e4m3x2 -> f16x2 conversion (exact: every
// e4m3 value is an f16; an e5m2 code is the top byte of its f16). A NaN code gives a NaN; its
// sign is not kept (the GPU's multiplication by the scale gives the canonical NaN, in the
// element-wise kernel too), as PyTorch's CUDA ops do. Narrower rows and unaligned tensors take
// the element-wise kernel.
template <bool kE4m3>
__device__ __forceinline__ float2 decode_pair(uint16_t two) {
  float2 f;
  if constexpr (kE4m3) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
    f = __half22float2(__half2(h));
  } else {
    f.x = __half2float(__ushort_as_half(static_cast<unsigned short>((two & 0xffu) << 8)));
    f.y = __half2float(__ushort_as_half(static_cast<unsigned short>(two & 0xff00u)));
  }
  return f;
}

constexpr int kRowPacks = 64;

template <class T, bool kE4m3>
__global__ void dequantize_rows_2d_kernel(T* __restrict__ out, const uint8_t* __restrict__ q, int64_t q_pitch_packs,
                                          const float* __restrict__ scale, int64_t scale_step, int64_t rows,
                                          int64_t packs_per_row) {
  constexpr int V = 16;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= packs_per_row) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float s = scale[r * scale_step];
    const int64_t i = r * packs_per_row + c;
    const uint4 p = reinterpret_cast<const uint4*>(q)[r * q_pitch_packs + c];
    const uint32_t w[4] = {p.x, p.y, p.z, p.w};
    Pack<T, V> o;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 lo = decode_pair<kE4m3>(static_cast<uint16_t>(w[k] & 0xffffu));
      const float2 hi = decode_pair<kE4m3>(static_cast<uint16_t>(w[k] >> 16));
      o.v[4 * k + 0] = store_as<T>(lo.x * s);
      o.v[4 * k + 1] = store_as<T>(lo.y * s);
      o.v[4 * k + 2] = store_as<T>(hi.x * s);
      o.v[4 * k + 3] = store_as<T>(hi.y * s);
    }
    // Pack<T, 16> is at least 32 bytes: stored as 16-byte words.
    constexpr int kWords = static_cast<int>(sizeof(Pack<T, V>) / sizeof(uint4));
    const uint4* src = reinterpret_cast<const uint4*>(&o);
    uint4* dst = reinterpret_cast<uint4*>(out) + i * kWords;
#pragma unroll
    for (int k = 0; k < kWords; ++k) dst[k] = src[k];
  }
}

// V consecutive elements of one row per thread (cols % V == 0 and the row pitch too), grid-stride.
template <class T, bool kE4m3, int V>
__global__ void dequantize_rows_kernel(T* __restrict__ out, const uint8_t* __restrict__ q, int64_t q_pitch_packs,
                                       const float* __restrict__ scale, int64_t scale_step, int64_t packs,
                                       int64_t packs_per_row) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < packs; i += step) {
    const int64_t r = i / packs_per_row;
    const float s = scale[r * scale_step];
    const int64_t qi = r * q_pitch_packs + (i - r * packs_per_row);
    const Pack<uint8_t, V> p = reinterpret_cast<const Pack<uint8_t, V>*>(q)[qi];
    Pack<T, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) o.v[k] = store_as<T>(fm::decode<kE4m3>(p.v[k]) * s);
    reinterpret_cast<Pack<T, V>*>(out)[i] = o;
  }
}

bool aligned(const void* p, std::size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// go.template operator()<kE4m3, V>() for the call's 8-bit format and width (kVec, or 1).
template <int kVec, class Go>
void pick_format_and_width(bool e4m3, bool vec, Go& go) {
  if (vec) {
    if (e4m3) go.template operator()<true, kVec>();
    else go.template operator()<false, kVec>();
  } else {
    if (e4m3) go.template operator()<true, 1>();
    else go.template operator()<false, 1>();
  }
}

bool float8_quantize_rows_cuda(const Tensor& q, const Tensor& scale, const Tensor& x, const Tensor& col) {
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  if (rows == 0) return true;
  CudaBackend& be = cuda_backend(x.device().index);
  DeviceGuard guard(be.device());
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(rows, static_cast<int64_t>(sm_count(be.device())) * 16));
  const bool e4m3 = q.dtype() == DType::f8_e4m3fn;
  const float* colp = col.defined() ? static_cast<const float*>(col.data_ptr()) : nullptr;
  dispatch_floating(x.dtype(), "float8_quantize_rows", [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / static_cast<int>(sizeof(T));
    const bool vec = cols % kVec == 0 && aligned(x.data_ptr(), 16) && aligned(q.data_ptr(), kVec);
    // Note [Register-resident row cast]: rows of up to 1024 K packs read once.
    constexpr int kPerThread = 4;
    const int64_t packs = cols / kVec;
    if (vec && packs <= 1024 * kPerThread) {
      const int threads = static_cast<int>((packs + kPerThread - 1) / kPerThread + 31) / 32 * 32;
      const unsigned grid = static_cast<unsigned>(
          std::min<int64_t>(rows, static_cast<int64_t>(sm_count(be.device())) * std::max(1, 2048 / threads)));
      auto reg = [&]<bool kE>() {
        quantize_rows_reg_kernel<T, kE, kVec, kPerThread><<<grid, threads, 0, be.stream()>>>(
            static_cast<uint8_t*>(q.data_ptr()), static_cast<float*>(scale.data_ptr()),
            static_cast<const T*>(x.data_ptr()), colp, rows, cols);
        FLAME_CUDA_CHECK_LAUNCH();
      };
      if (e4m3) reg.template operator()<true>();
      else reg.template operator()<false>();
      return;
    }
    auto go = [&]<bool kE, int V>() {
      quantize_rows_kernel<T, kE, V><<<blocks, kThreads, 0, be.stream()>>>(
          static_cast<uint8_t*>(q.data_ptr()), static_cast<float*>(scale.data_ptr()),
          static_cast<const T*>(x.data_ptr()), colp, rows, cols);
      FLAME_CUDA_CHECK_LAUNCH();
    };
    pick_format_and_width<kVec>(e4m3, vec, go);
  });
  return true;
}

bool float8_dequantize_rows_cuda(const Tensor& out, const Tensor& q, const Tensor& scale) {
  const int64_t cols = q.size(-1), n = q.numel();
  if (n == 0) return true;
  CudaBackend& be = cuda_backend(q.device().index);
  DeviceGuard guard(be.device());
  const int64_t step = scale.numel() == 1 ? 0 : 1;
  const int64_t pitch = q.is_contiguous() ? cols : q.stride(0);  // a 2-d q's rows may be strided
  const bool e4m3 = q.dtype() == DType::f8_e4m3fn;
  dispatch_floating(out.dtype(), "float8_dequantize_rows", [&](auto tag) {
    using T = typename decltype(tag)::type;
    // Note [Row dequantisation]
    if (cols % 16 == 0 && pitch % 16 == 0 && cols / 16 >= kRowPacks && aligned(q.data_ptr(), 16) &&
        aligned(out.data_ptr(), 16)) {
      const int64_t ppr = cols / 16, rows = n / cols;
      const int threads = static_cast<int>(std::min<int64_t>(256, (ppr + 31) / 32 * 32));
      const dim3 grid(static_cast<unsigned>((ppr + threads - 1) / threads),
                      static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
      auto go2 = [&]<bool kE>() {
        dequantize_rows_2d_kernel<T, kE><<<grid, threads, 0, be.stream()>>>(
            static_cast<T*>(out.data_ptr()), static_cast<const uint8_t*>(q.data_ptr()), pitch / 16,
            static_cast<const float*>(scale.data_ptr()), step, rows, ppr);
        FLAME_CUDA_CHECK_LAUNCH();
      };
      if (e4m3) go2.template operator()<true>();
      else go2.template operator()<false>();
      return;
    }
    constexpr int kVec = 8;
    const bool vec = cols % kVec == 0 && pitch % kVec == 0 && aligned(q.data_ptr(), kVec) &&
                     aligned(out.data_ptr(), kVec * sizeof(T));
    auto go = [&]<bool kE, int V>() {
      const int64_t packs = n / V;
      dequantize_rows_kernel<T, kE, V><<<blocks_for(packs, kThreads), kThreads, 0, be.stream()>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const uint8_t*>(q.data_ptr()), pitch / V,
          static_cast<const float*>(scale.data_ptr()), step, packs, cols / V);
      FLAME_CUDA_CHECK_LAUNCH();
    };
    pick_format_and_width<kVec>(e4m3, vec, go);
  });
  return true;
}

// ---------------------------------------------------------------------------------------------
// FP8 GEMM (Note [FP8 GEMM layout])
// ---------------------------------------------------------------------------------------------

// Compute capability >= 8.9 (Ada, Hopper and later run FP8 tensor-core GEMMs), read once per device.
bool has_fp8_gemm(int device) {
  static std::array<std::atomic<int>, 64> state{};  // 0 unknown, 1 yes, 2 no
  if (device < 0 || device >= 64) return false;
  int s = state[device].load(std::memory_order_acquire);
  if (s == 0) {
    int major = 0, minor = 0;
    FLAME_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    FLAME_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    s = (major > 8 || (major == 8 && minor >= 9)) ? 1 : 2;
    state[device].store(s, std::memory_order_release);
  }
  return s == 1;
}

// out[r, c] = out[r, c] * rs[r] * cs[c] (+ bias[c]) in f32, in place: the scales of a GEMM that
// ran without them. V elements of one row per thread (N % V == 0), grid-stride.
template <class T, int V>
__global__ void scale_rows_cols_kernel(T* __restrict__ out, const float* __restrict__ rs, const float* __restrict__ cs,
                                       const T* __restrict__ bias, int64_t packs, int64_t packs_per_row) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < packs; i += step) {
    const int64_t r = i / packs_per_row, c0 = (i - r * packs_per_row) * V;
    const float s = rs[r];
    Pack<T, V> p = reinterpret_cast<Pack<T, V>*>(out)[i];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float v = load_as<float>(p.v[k]) * s * cs[c0 + k];
      if (bias) v += load_as<float>(bias[c0 + k]);
      p.v[k] = store_as<T>(v);
    }
    reinterpret_cast<Pack<T, V>*>(out)[i] = p;
  }
}

void scale_rows_cols(CudaBackend& be, const Tensor& out, const Tensor& rs, const Tensor& cs, const Tensor& bias) {
  const int64_t M = out.size(0), N = out.size(1);
  dispatch_floating(out.dtype(), "float8_gemm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto go = [&]<int V>() {
      const int64_t packs = M * N / V;
      scale_rows_cols_kernel<T, V><<<blocks_for(packs, kThreads), kThreads, 0, be.stream()>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const float*>(rs.data_ptr()),
          static_cast<const float*>(cs.data_ptr()), bias.defined() ? static_cast<const T*>(bias.data_ptr()) : nullptr,
          packs, N / V);
      FLAME_CUDA_CHECK_LAUNCH();
    };
    constexpr int kVec = 16 / static_cast<int>(sizeof(T));
    if (N % kVec == 0 && aligned(out.data_ptr(), 16)) go.template operator()<kVec>();
    else go.template operator()<1>();
  });
}

// Which way the last FP8 GEMM of each device ran: 0 none yet, 1 outer-vector scales, 2 scaled after.
std::array<std::atomic<int>, 64>& gemm_paths() {
  static std::array<std::atomic<int>, 64> paths{};
  return paths;
}
void record_path(int device, int path) {
  if (device >= 0 && device < 64) gemm_paths()[device].store(path, std::memory_order_relaxed);
}

cudaDataType_t lt_type(DType t) {
  switch (t) {
    case DType::f8_e4m3fn: return CUDA_R_8F_E4M3;
    case DType::f8_e5m2: return CUDA_R_8F_E5M2;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

struct Fp8Key {
  int device;
  int a_dtype, b_dtype, out_dtype;
  bool bias;
  bool outer_vec;  // the scales as cuBLASLt outer vectors; false: no scales (applied after)
  int64_t m, n, k;
  int64_t ldb;  // b's row stride (K, or more for a column block of a wider weight)
  uint32_t align_a, align_b, align_c;
  bool operator==(const Fp8Key& o) const { return std::memcmp(this, &o, sizeof(Fp8Key)) == 0; }
};
struct Fp8Plan {
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::size_t workspace = 0;
  bool ok = false;  // false: cuBLASLt has no algorithm for this key (the call declines)
};

uint32_t alignment(const void* p) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(p) | 256u;
  return static_cast<uint32_t>(bits & (~bits + 1));
}

// A descriptor for key with the scale modes, the epilogue and the given pointers bound (null ones
// unset); null when cuBLASLt refuses one of the settings.
cublasLtMatmulDesc_t make_fp8_desc(const Fp8Key& key, const void* a_scale, const void* b_scale, const void* bias) {
  cublasLtMatmulDesc_t op = nullptr;
  if (lt_gemm_desc(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F, /*ta=*/true, /*tb=*/false) != CUBLAS_STATUS_SUCCESS)
    return nullptr;
  const int32_t vec = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  const cublasLtEpilogue_t epi = key.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  const cudaDataType_t bias_type = lt_type(static_cast<DType>(key.out_dtype));
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  if (key.outer_vec) {
    st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &vec, sizeof(vec));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vec, sizeof(vec));
  }
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
  if (st == CUBLAS_STATUS_SUCCESS && key.bias)
    st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type));
  // cuBLAS's A is FLAME's b (Note [FP8 GEMM layout]).
  if (st == CUBLAS_STATUS_SUCCESS && key.outer_vec && b_scale != nullptr)
    st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b_scale, sizeof(b_scale));
  if (st == CUBLAS_STATUS_SUCCESS && key.outer_vec && a_scale != nullptr)
    st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_scale, sizeof(a_scale));
  if (st == CUBLAS_STATUS_SUCCESS && bias != nullptr)
    st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
  if (st != CUBLAS_STATUS_SUCCESS) {
    cublasLtMatmulDescDestroy(op);
    return nullptr;
  }
  return op;
}

// The heuristic is asked with the first call's scale and bias pointers bound: cuBLASLt refuses a
// vector scale mode whose pointer is unset (it then finds no algorithm), so a plan made without them
// always took the scale pass. The algorithm does not depend on the pointers' values (their
// alignment is that of any pool allocation).
const Fp8Plan& fp8_plan(const Fp8Key& key, const void* a_scale, const void* b_scale, const void* bias) {
  static std::shared_mutex mu;
  static auto* cache = new std::unordered_map<Fp8Key, Fp8Plan, LtKeyHash<Fp8Key>>();  // never destroyed
  {
    std::shared_lock<std::shared_mutex> lock(mu);
    const auto it = cache->find(key);
    if (it != cache->end()) return it->second;
  }
  Fp8Plan plan;
  // D [N, M] = op_T(A) B: A = b stored [K, N] (ld ldb), B = a stored [K, M] (ld K), C = D (ld N).
  bool made = lt_make_layout(&plan.la, lt_type(static_cast<DType>(key.b_dtype)), key.k, key.n, key.ldb, 1, 0) ==
              CUBLAS_STATUS_SUCCESS;
  made = made && lt_make_layout(&plan.lb, lt_type(static_cast<DType>(key.a_dtype)), key.k, key.m, key.k, 1, 0) ==
                     CUBLAS_STATUS_SUCCESS;
  made = made && lt_make_layout(&plan.lc, lt_type(static_cast<DType>(key.out_dtype)), key.n, key.m, key.n, 1, 0) ==
                     CUBLAS_STATUS_SUCCESS;
  cublasLtMatmulDesc_t op = made ? make_fp8_desc(key, a_scale, b_scale, key.bias ? bias : nullptr) : nullptr;
  if (op != nullptr) {
    cublasLtMatmulPreference_t pref = nullptr;
    if (cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS) {
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      if (lt_set_preference(pref, kLtWorkspaceBytes, key.align_a, key.align_b, key.align_c) == CUBLAS_STATUS_SUCCESS &&
          cublasLtMatmulAlgoGetHeuristic(shared_lt_handle(key.device), op, plan.la, plan.lb, plan.lc, plan.lc, pref, 1,
                                         &result, &found) == CUBLAS_STATUS_SUCCESS &&
          found > 0) {
        plan.algo = result.algo;
        plan.workspace = result.workspaceSize;
        plan.ok = true;
      }
      cublasLtMatmulPreferenceDestroy(pref);
    }
    cublasLtMatmulDescDestroy(op);
  }
  if (!plan.ok) lt_destroy_layouts(plan.la, plan.lb, plan.lc);  // remembered as declined
  std::unique_lock<std::shared_mutex> lock(mu);
  const auto [it, inserted] = cache->emplace(key, plan);
  if (!inserted && plan.ok) lt_destroy_layouts(plan.la, plan.lb, plan.lc);
  return it->second;
}

bool float8_gemm_cuda(const Tensor& out, const Tensor& a, const Tensor& a_scale, const Tensor& b,
                      const Tensor& b_scale, const Tensor& bias) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  const int device = out.device().index;
  if (!has_fp8_gemm(device)) return false;
  if (a.dtype() == DType::f8_e5m2 && b.dtype() == DType::f8_e5m2) return false;  // no e5m2 x e5m2 GEMM
  if (out.dtype() != DType::bf16 && out.dtype() != DType::f16 && out.dtype() != DType::f32) return false;
  if (K % 16 != 0 || M > INT32_MAX || N > INT32_MAX || K > INT32_MAX) return false;
  const int64_t ldb = b.is_contiguous() ? K : b.stride(0);
  if ((!b.is_contiguous() && b.stride(1) != 1) || ldb % 16 != 0 || ldb > INT32_MAX) return false;
  if (M == 0 || N == 0) return true;
  CudaBackend& be = cuda_backend(device);
  DeviceGuard guard(device);
  Fp8Key key;
  std::memset(&key, 0, sizeof(key));  // padding takes part in hashing and comparison
  key.device = device;
  key.a_dtype = static_cast<int>(a.dtype());
  key.b_dtype = static_cast<int>(b.dtype());
  key.out_dtype = static_cast<int>(out.dtype());
  key.bias = bias.defined();
  key.m = M;
  key.n = N;
  key.k = K;
  key.ldb = ldb;
  key.align_a = alignment(b.data_ptr());  // cuBLAS's A
  key.align_b = alignment(a.data_ptr());
  key.align_c = alignment(out.data_ptr());
  key.outer_vec = true;
  const void* bias_ptr = bias.defined() ? bias.data_ptr() : nullptr;
  const Fp8Plan* found = &fp8_plan(key, a_scale.data_ptr(), b_scale.data_ptr(), bias_ptr);
  if (!found->ok) {  // Note [FP8 GEMM layout]: no outer-vector scales here; scale in a second pass
    key.outer_vec = false;
    key.bias = false;
    found = &fp8_plan(key, nullptr, nullptr, nullptr);
    if (!found->ok) return false;
  }
  const Fp8Plan& plan = *found;
  const cudaStream_t stream = be.stream();
  std::shared_ptr<void> captured_workspace;
  void* workspace = nullptr;
  if (plan.workspace > 0) {
    if (thread_is_capturing(device)) {  // Note [Matmul workspace]
      captured_workspace = be.allocate(plan.workspace);
      workspace = captured_workspace.get();
    } else {
      std::size_t have = 0;
      workspace = shared_lt_workspace(device, stream, &have);
      if (have < plan.workspace) return false;
    }
  }
  cublasLtMatmulDesc_t op = make_fp8_desc(key, a_scale.data_ptr(), b_scale.data_ptr(),
                                          key.bias ? bias.data_ptr() : nullptr);
  if (op == nullptr) return false;
  const float one = 1.0f, zero = 0.0f;
  const cublasStatus_t st = cublasLtMatmul(shared_lt_handle(device), op, &one, b.data_ptr(), plan.la, a.data_ptr(),
                                           plan.lb, &zero, out.data_ptr(), plan.lc, out.data_ptr(), plan.lc, &plan.algo,
                                           workspace, plan.workspace, stream);
  cublasLtMatmulDescDestroy(op);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) return false;  // refused before launching: nothing written
  FLAME_CHECK(st == CUBLAS_STATUS_SUCCESS, "float8_gemm", "cuBLASLt FP8 GEMM m=", N, " n=", M, " k=", K,
              " failed: ", cublasLtGetStatusName(st), " (", cublasLtGetStatusString(st), ")");
  if (!key.outer_vec) scale_rows_cols(be, out, a_scale, b_scale, bias);
  record_path(device, key.outer_vec ? 1 : 2);
  if (launch_blocking())
    lt_sync_if_blocking(stream, "float8_gemm",
                        "cuBLASLt FP8 GEMM m=" + std::to_string(N) + " n=" + std::to_string(M) + " k=" + std::to_string(K));
  return true;
}

int float8_gemm_path_cuda(int device) {
  return device >= 0 && device < 64 ? gemm_paths()[device].load(std::memory_order_relaxed) : 0;
}

}  // namespace

void register_float8_kernels() {
  fused::float8_quantize_rows.define(DeviceType::cuda, &float8_quantize_rows_cuda);
  fused::float8_dequantize_rows.define(DeviceType::cuda, &float8_dequantize_rows_cuda);
  fused::float8_gemm.define(DeviceType::cuda, &float8_gemm_cuda);
  fused::float8_gemm_path.define(DeviceType::cuda, &float8_gemm_path_cuda);
}

}  // namespace flame::backend::cuda
