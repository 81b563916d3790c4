// CUDA kernels of the RMS QK-norm fused with the join and the rotary embedding
// (src/backend/fused/rms_norm_rotary.h; Note [RMS norm rotary] in src/ops/rms_norm_rotary.cpp).
// A row of D values is held by L = D / V lanes (V values of a 16-byte vector each: 8 bf16/f16, 4
// f32), so a warp works on 32 / L rows at once and a row's sums are shuffles within its L lanes:
// FLUX's D = 128 bf16 rows take 16 lanes, SD3.5's D = 64 take 8. Rows are (b, s, h) of the joined
// [B, S, H, D] output, the part found from s. The arithmetic is that of the separate kernels: the
// row statistic as rms_norm's (f32 sum of squares, 1 / sqrt(mean + eps)), the normalised value
// rounded to T, the rotation in f32 from it (the rotary kernel's products), rounded again; the
// backward rounds the rotation's inverse to T before rms_norm's backward, as the separate
// backward kernels' outputs are. Calls it does not take (f64, D not 1..32 vectors (a power of two;
// the half layout at least 2), more than
// kMaxParts parts, unaligned memory, more than 2^31 elements) return false: the op composes.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/backend/cuda/launch_geometry.cuh"
#include "src/backend/cuda/rotary/vectors.cuh"
#include "src/backend/fused/rms_norm_rotary.h"

namespace flame::backend::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxParts = 4;

template <class T>
struct Parts {
  const T* x[kMaxParts];
  const T* w[kMaxParts];  // null: no weight
  T* dx[kMaxParts];
  uint32_t end[kMaxParts];  // the joined position just past part p
  int count;
};

enum class Rope { none, interleaved, half };

// Value rounded through T (what a separate kernel's output holds).
template <class T>
__device__ __forceinline__ float through(float v) {
  return load_as<float>(store_as<T>(v));
}

// Sum over the l lanes of a row (l a power of two; the row's lanes are aligned within the warp).
__device__ __forceinline__ float row_sum(float v, int l) {
  for (int o = l / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <class T, Rope kRope, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    norm_rotary_kernel(Parts<T> parts, T* __restrict__ out, const T* __restrict__ g, uint32_t g_sb, uint32_t g_ss,
                       uint32_t g_sh, const float* __restrict__ cos, const float* __restrict__ sin, uint32_t rows,
                       uint32_t s_len, uint32_t h_len, int lanes, float eps) {
  constexpr int V = 16 / sizeof(T);
  const uint32_t d = static_cast<uint32_t>(lanes) * V;
  const float inv_d = 1.0f / static_cast<float>(d);
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int sub = lane % lanes;  // this lane's vector of the row
  const uint32_t col = static_cast<uint32_t>(sub) * V;
  const uint32_t per_pass = gridDim.x * (kThreads / static_cast<uint32_t>(lanes));
  // Warp-uniform trip count: every lane reaches the shuffles.
  for (uint32_t r0 = (blockIdx.x * kThreads + (threadIdx.x & ~31u)) / static_cast<uint32_t>(lanes); r0 < rows;
       r0 += per_pass) {
    const uint32_t row = r0 + static_cast<uint32_t>(lane / lanes);
    const bool valid = row < rows;
    const uint32_t rr = valid ? row : rows - 1;
    const uint32_t h = rr % h_len, t = rr / h_len, s = t % s_len, b = t / s_len;
    int p = 0;
    while (p + 1 < parts.count && s >= parts.end[p]) ++p;
    const uint32_t start = p == 0 ? 0u : parts.end[p - 1], len = parts.end[p] - start;
    const uint32_t at = ((b * len + (s - start)) * h_len + h) * d + col;
    float x[V], w[V];
    rotary_vec::load_vec<T>(x, parts.x[p] + at);
    if (parts.w[p] != nullptr) rotary_vec::load_vec<T>(w, parts.w[p] + col);
    else
#pragma unroll
      for (int j = 0; j < V; ++j) w[j] = 1.0f;
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) ss += x[j] * x[j];
    const float rs = 1.0f / sqrtf(row_sum(ss, lanes) * inv_d + eps);
    float c[V], sn[V];
    if constexpr (kRope != Rope::none) {
      rotary_vec::load_f32(c, cos + s * d + col);
      rotary_vec::load_f32(sn, sin + s * d + col);
    }
    if constexpr (!kBackward) {
      float n[V], o[V];
#pragma unroll
      for (int j = 0; j < V; ++j) n[j] = through<T>(x[j] * rs * w[j]);
      if constexpr (kRope == Rope::none) {
#pragma unroll
        for (int j = 0; j < V; ++j) o[j] = n[j];
      } else if constexpr (kRope == Rope::interleaved) {
#pragma unroll
        for (int j = 0; j < V; j += 2) {
          o[j] = n[j] * c[j] - n[j + 1] * sn[j];
          o[j + 1] = n[j + 1] * c[j + 1] + n[j] * sn[j + 1];
        }
      } else {
        const bool first = sub < lanes / 2;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float q = __shfl_xor_sync(0xffffffffu, n[j], lanes / 2);
          o[j] = first ? n[j] * c[j] - q * sn[j] : n[j] * c[j] + q * sn[j];
        }
      }
      if (valid) rotary_vec::store_vec<T>(out + static_cast<uint64_t>(rr) * d + col, o);
    } else {
      float gr[V], gn[V];
      rotary_vec::load_vec<T>(gr, g + b * g_sb + s * g_ss + h * g_sh + col);
      if constexpr (kRope == Rope::none) {
#pragma unroll
        for (int j = 0; j < V; ++j) gn[j] = gr[j];
      } else if constexpr (kRope == Rope::interleaved) {
#pragma unroll
        for (int j = 0; j < V; j += 2) {
          gn[j] = through<T>(gr[j] * c[j] + gr[j + 1] * sn[j + 1]);
          gn[j + 1] = through<T>(gr[j + 1] * c[j + 1] - gr[j] * sn[j]);
        }
      } else {
        const bool first = sub < lanes / 2;
        float sp[V];  // the partners' sin
        rotary_vec::load_f32(sp, sin + s * d + static_cast<uint32_t>(sub ^ (lanes / 2)) * V);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float q = __shfl_xor_sync(0xffffffffu, gr[j], lanes / 2);
          gn[j] = through<T>(first ? gr[j] * c[j] + q * sp[j] : gr[j] * c[j] - q * sp[j]);
        }
      }
      float sgx = 0.f;
#pragma unroll
      for (int j = 0; j < V; ++j) sgx += gn[j] * w[j] * (x[j] * rs);
      const float mgx = row_sum(sgx, lanes) * inv_d;
      float dx[V];
#pragma unroll
      for (int j = 0; j < V; ++j) dx[j] = rs * (gn[j] * w[j] - (x[j] * rs) * mgx);
      if (valid) rotary_vec::store_vec<T>(parts.dx[p] + at, dx);
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// out (forward) or g and dparts (backward); false: not taken, nothing launched.
bool norm_rotary_cuda(const Tensor& out, const Tensor& g, const TensorList& dparts, const TensorList& parts,
                      const TensorList& weights, const Tensor& cos, const Tensor& sin, int layout, double eps) {
  const Tensor& x0 = parts.front();
  const DType dt = x0.dtype();
  if (dt != DType::bf16 && dt != DType::f16 && dt != DType::f32) return false;
  if (parts.size() > static_cast<std::size_t>(kMaxParts)) return false;
  const bool backward = g.defined();
  const Tensor& shape_of = backward ? g : out;
  const int64_t v = 16 / static_cast<int64_t>(dtype_size(dt));
  const int64_t b_len = shape_of.size(0), s_len = shape_of.size(1), h_len = shape_of.size(2), d = shape_of.size(3);
  const int64_t lanes = d / v;
  if (d % v != 0 || lanes < 1 || lanes > 32 || (lanes & (lanes - 1)) != 0) return false;
  if (cos.defined() && layout == 1 && lanes < 2) return false;  // the half layout's partners sit in another lane
  const bool rope = cos.defined();
  if (rope && (cos.dtype() != DType::f32 || sin.dtype() != DType::f32 || !aligned16(cos.data_ptr()) ||
               !aligned16(sin.data_ptr())))
    return false;
  const int64_t rows = b_len * s_len * h_len;
  if (rows * d >= (int64_t{1} << 31)) return false;
  auto fill = [&]<class T>(Parts<T>& pa) -> bool {
    uint32_t end = 0;
    pa.count = static_cast<int>(parts.size());
    for (std::size_t i = 0; i < parts.size(); ++i) {
      pa.x[i] = static_cast<const T*>(parts[i].data_ptr());
      pa.w[i] = weights[i].defined() ? static_cast<const T*>(weights[i].data_ptr()) : nullptr;
      pa.dx[i] = backward ? static_cast<T*>(dparts[i].data_ptr()) : nullptr;
      end += static_cast<uint32_t>(parts[i].size(1));
      pa.end[i] = end;
      if (!aligned16(pa.x[i]) || !aligned16(pa.w[i]) || !aligned16(pa.dx[i])) return false;
    }
    return true;
  };
  if (backward) {
    if (!aligned16(g.data_ptr()) || g.stride(3) != 1 || g.stride(0) % v != 0 || g.stride(1) % v != 0 ||
        g.stride(2) % v != 0)
      return false;
    int64_t span = 1;
    for (int i = 0; i < 4; ++i) span += (g.size(i) - 1) * g.stride(i);
    if (span >= (int64_t{1} << 31)) return false;
  } else if (!aligned16(out.data_ptr())) {
    return false;
  }
  CudaBackend& be = cuda_backend(x0.device().index);
  DeviceGuard guard(be.device());
  const int64_t rows_per_block = kThreads / lanes;
  const int64_t cap = static_cast<int64_t>(sm_count(be.device())) * 8;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(cap, (rows + rows_per_block - 1) / rows_per_block));
  const Rope mode = !rope ? Rope::none : layout == 1 ? Rope::half : Rope::interleaved;
  auto launch = [&]<class T>() -> bool {
    Parts<T> pa{};
    if (!fill.template operator()<T>(pa)) return false;
    auto go = [&]<Rope kRope, bool kBackward>() {
      norm_rotary_kernel<T, kRope, kBackward><<<blocks, kThreads, 0, be.stream()>>>(
          pa, backward ? nullptr : static_cast<T*>(out.data_ptr()),
          backward ? static_cast<const T*>(g.data_ptr()) : nullptr, backward ? static_cast<uint32_t>(g.stride(0)) : 0u,
          backward ? static_cast<uint32_t>(g.stride(1)) : 0u, backward ? static_cast<uint32_t>(g.stride(2)) : 0u,
          rope ? static_cast<const float*>(cos.data_ptr()) : nullptr,
          rope ? static_cast<const float*>(sin.data_ptr()) : nullptr, static_cast<uint32_t>(rows),
          static_cast<uint32_t>(s_len), static_cast<uint32_t>(h_len), static_cast<int>(lanes), static_cast<float>(eps));
      FLAME_CUDA_CHECK_LAUNCH();
    };
    auto pick = [&]<bool kBackward>() {
      if (mode == Rope::none) go.template operator()<Rope::none, kBackward>();
      else if (mode == Rope::half) go.template operator()<Rope::half, kBackward>();
      else go.template operator()<Rope::interleaved, kBackward>();
    };
    if (backward) pick.template operator()<true>();
    else pick.template operator()<false>();
    return true;
  };
  if (rows == 0) return true;
  if (dt == DType::bf16) return launch.template operator()<bfloat16>();
  if (dt == DType::f16) return launch.template operator()<float16>();
  return launch.template operator()<float>();
}

bool rms_norm_rotary_forward_cuda(const Tensor& out, const TensorList& parts, const TensorList& weights,
                                  const Tensor& cos, const Tensor& sin, int layout, double eps) {
  return norm_rotary_cuda(out, Tensor(), {}, parts, weights, cos, sin, layout, eps);
}

bool rms_norm_rotary_backward_cuda(const TensorList& dparts, const Tensor& g, const TensorList& parts,
                                   const TensorList& weights, const Tensor& cos, const Tensor& sin, int layout,
                                   double eps) {
  return norm_rotary_cuda(Tensor(), g, dparts, parts, weights, cos, sin, layout, eps);
}

}  // namespace

void register_rms_norm_rotary_kernels() {
  fused::rms_norm_rotary_forward.define(DeviceType::cuda, &rms_norm_rotary_forward_cuda);
  fused::rms_norm_rotary_backward.define(DeviceType::cuda, &rms_norm_rotary_backward_cuda);
}

}  // namespace flame::backend::cuda
