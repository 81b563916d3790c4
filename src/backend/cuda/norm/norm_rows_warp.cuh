#pragma once
// The warp-per-row backward of layer_norm / rms_norm for 2-byte types and rows of 257..1024
// values (Note [Warp row backward]). Included by norm_rows_impl.cuh.
//
// Note [Warp row backward]
// With a row spread over 128 threads (rows_backward_kernel), every row step ends in a block
// barrier and a cross-warp exchange for its two sums; on an H100 ([32768, 1024] bf16) the barrier
// and the shuffle/shared-memory waits were the largest stall reasons and the kernel moved 81% of
// the copy bandwidth. Here a warp owns a row: each lane holds kVPT 16-byte vectors of x and dy
// (32 values at 1024 columns), the two row sums are warp shuffles, and no barrier is taken
// until the end. The per-column accumulators of the weight and bias gradients (64 floats per
// lane at 1024 columns) would not fit in registers beside a software pipeline, so they live in
// shared memory, one private slice per warp (float4 per lane, lane-contiguous: no bank
// conflicts), read-modify-written once per row. The next row's x and dy are loaded before the
// current row is reduced (a pipeline of depth 2, Note [Row backward pipeline]). At the end the
// block's warps add their slices in a fixed order into one partial row; the partial rows are
// summed by column_sum_narrow_kernel as for rows_backward_kernel. No atomics: the result is
// deterministic.
#include "src/backend/cuda/norm/norm_kernels.cuh"

namespace flame::backend::cuda::norm {

constexpr int kWarpBwdWarps = 8;  // warps (rows in flight) per block

// Shared memory of one block: [warps][2][kVPT * 32 * 8] floats (dy * xhat, then dy).
template <int kVPT>
constexpr std::size_t warp_bwd_smem() {
  return static_cast<std::size_t>(kWarpBwdWarps) * 2 * kVPT * 32 * 8 * sizeof(float);
}

template <class T, int kVPT, bool kRms>
__global__ void __launch_bounds__(kWarpBwdWarps * 32, 2)
    rows_backward_warp_kernel(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
                              const float* __restrict__ rstd, const T* __restrict__ w, T* __restrict__ dx,
                              float* __restrict__ part_w, float* __restrict__ part_b, int64_t rows, int64_t cols) {
  static_assert(sizeof(T) == 2, "2-byte types: 8 values per 16-byte vector");
  constexpr int W = 8;
  constexpr int kSlice = kVPT * 32 * W;  // floats per accumulator per warp
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool want_params = part_w != nullptr;
  // This warp's accumulators: float4 q of vector k of lane l at (k * 2 + q) * 32 + l.
  float4* acc_w = reinterpret_cast<float4*>(dyn_smem) + static_cast<std::size_t>(warp) * 2 * (kSlice / 4);
  float4* acc_b = acc_w + kSlice / 4;
  const float inv_cols = 1.0f / static_cast<float>(cols);
  bool in_cols[kVPT];
  uint4 wraw[kVPT];
#pragma unroll
  for (int k = 0; k < kVPT; ++k) {
    const int64_t e = (static_cast<int64_t>(k) * 32 + lane) * W;
    in_cols[k] = e < cols;
    wraw[k] = (w != nullptr && in_cols[k]) ? __ldg(reinterpret_cast<const uint4*>(w + e)) : uint4{};
  }
  if (want_params) {
    for (int i = lane; i < 2 * (kSlice / 4); i += 32) acc_w[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    __syncwarp();
  }
  auto wval = [&](int k, int j) -> float { return w != nullptr ? load_as<float>(vec_elem<T>(wraw[k], j)) : 1.0f; };

  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpBwdWarps;
  uint4 nx[kVPT] = {}, nd[kVPT] = {};
  float nm = 0.f, nrs = 0.f;
  auto fetch = [&](int64_t row) {
    fetch_row<T, W, kVPT, 32, kRms>(x, dy, mean, rstd, row, rows, cols, lane, in_cols, nx, nd, nm, nrs);
  };
  int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpBwdWarps + warp;
  fetch(row);
  for (; row < rows; row += stride) {  // warp-uniform
    uint4 cx[kVPT], cd[kVPT];
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      cx[k] = nx[k];
      cd[k] = nd[k];
    }
    const float m = nm, rs = nrs;
    fetch(row + stride);  // in flight while this row is reduced
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      if (!in_cols[k]) continue;
      float dw[W], db[W];
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const float d = load_as<float>(vec_elem<T>(cd[k], j));
        const float xh = (load_as<float>(vec_elem<T>(cx[k], j)) - m) * rs;
        dw[j] = d * xh;
        db[j] = d;
        const float g = d * wval(k, j);
        sg += g;
        sgx += g * xh;
      }
      if (want_params) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          float4& aw = acc_w[(k * 2 + q) * 32 + lane];
          float4& ab = acc_b[(k * 2 + q) * 32 + lane];
          float4 a = aw, b = ab;
          a.x += dw[q * 4 + 0], a.y += dw[q * 4 + 1], a.z += dw[q * 4 + 2], a.w += dw[q * 4 + 3];
          b.x += db[q * 4 + 0], b.y += db[q * 4 + 1], b.z += db[q * 4 + 2], b.w += db[q * 4 + 3];
          aw = a;
          ab = b;
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      if constexpr (!kRms) sg += __shfl_xor_sync(0xffffffffu, sg, o);
      sgx += __shfl_xor_sync(0xffffffffu, sgx, o);
    }
    if (dx == nullptr) continue;
    const float mg = kRms ? 0.f : sg * inv_cols, mgx = sgx * inv_cols;
#pragma unroll
    for (int k = 0; k < kVPT; ++k) {
      if (!in_cols[k]) continue;
      float o[W];
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const float xh = (load_as<float>(vec_elem<T>(cx[k], j)) - m) * rs;
        o[j] = rs * (load_as<float>(vec_elem<T>(cd[k], j)) * wval(k, j) - mg - xh * mgx);
      }
      store_vec<T, W>(dx + row * cols + (static_cast<int64_t>(k) * 32 + lane) * W, o);
    }
  }
  if (!want_params) return;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");  // Note [Row backward second stage]
#endif
  __syncthreads();
  // The block's partial row: the warps' slices added in warp order (deterministic).
  const float* base = reinterpret_cast<const float*>(dyn_smem);
  float* pw = part_w + static_cast<int64_t>(blockIdx.x) * cols;
  float* pb = part_b + static_cast<int64_t>(blockIdx.x) * cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    // Column c = (k * 32 + l) * 8 + q * 4 + r sits at float ((k * 2 + q) * 32 + l) * 4 + r of a slice.
    const int64_t v = c / W, r8 = c % W;
    const int64_t k = v / 32, l = v % 32, q = r8 / 4, r = r8 % 4;
    const int64_t at = ((k * 2 + q) * 32 + l) * 4 + r;
    float sw = 0.f, sb = 0.f;
#pragma unroll
    for (int i = 0; i < kWarpBwdWarps; ++i) {
      sw += base[static_cast<int64_t>(i) * 2 * kSlice + at];
      sb += base[static_cast<int64_t>(i) * 2 * kSlice + kSlice + at];
    }
    pw[c] = sw;
    pb[c] = sb;
  }
}

}  // namespace flame::backend::cuda::norm
