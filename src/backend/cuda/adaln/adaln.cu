// CUDA kernels of the fused adaLN ops (Note [adaLN ops] in src/ops/adaln.cpp): layer_norm +
// modulate and the gated residual of DiT-style blocks, forward and backward.
//
// Note [adaLN kernels]
// Rows of D elements (D % 4 == 0, D <= 6144) in vectors of 4; row r belongs to batch r / T, whose
// [D] modulation row (shift, scale, gate) every row of the batch reads (from L1/L2).
//  - A row belongs to a group of kW warps (Note [Row groups]): one warp up to 1536 values, two
//    up to 3072 (FLUX's 3072, SD3.5-Large's 2432), four up to 6144.
//  - forward: a group per row, the row held in registers (kC chunks of 128 kW columns), mean
//    and the centred variance from the registers (two exact passes, one read), one write of y in
//    its own dtype (bf16 under autocast: the consumer is a linear layer), mean/rstd per row.
//  - backward: a block per (batch, slice of its rows). A lane owns the same columns in every row
//    its warp visits and adds dy and dy * x-hat for them into its warp's shared-memory row (no
//    atomics, no barrier: the columns are the lane's own); after one barrier the block sums its
//    warps per column and writes the batch's dshift/dscale itself when it covers all T rows, or a
//    partial row that a second kernel sums over the slices otherwise (deterministic either way).
//    dx needs the two row sums of g = dy * (1 + scale) and g * x-hat: one warp reduction each.
//    With a base (the engine's pending gradient sum of x, Note [Accumulate base] in
//    src/autograd/backward.cpp) the final write stores base + dx, rounded once: the separate add
//    kernel and its passes over [B, T, D] are gone. base may be dx itself (the engine owns it), so
//    neither carries __restrict__ and base is read with a plain load (not the read-only path,
//    which requires data unwritten during the kernel); each element is read, then written, by the
//    one lane that owns it. Rows of up to 512 values are pipelined: the next row's x, dy and base
//    are loaded, packed as read, before the current row is reduced and written (on an H100, dit-s
//    [50176, 384] f32 with a bf16 dy and a base: 145 us -> ~93 us per call; the DiT residual
//    backward of bench/bench_accum.cpp 0.299 -> 0.245 ms).
//  - gated residual: out = x + gate * y elementwise in vectors of 4; its backward has the layout
//    of the adaLN backward with one accumulator (dgate = sum over T of dout * y) and writes
//    dy = dout * gate.
// Dtypes (x, modulation, y): (f32, bf16|f16|f32, same as the modulation) and (bf16|f16, same,
// same); anything else, misaligned pointers or longer rows decline (the op composes).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <utility>

#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/backend/fused/adaln.h"
#include "src/backend/cuda/launch_geometry.cuh"
#include "src/backend/cuda/norm/norm_kernels.cuh"
#include "src/core/tensor_impl.h"

namespace flame::backend::cuda {
namespace {

constexpr int kFwdWarps = 8;
constexpr int kBwdWarps = 4;
constexpr int kMaxCols = 6144;  // 12 chunks of 128 columns per warp, 4 warps a row
// Note [Row groups]
// Rows wider than a warp's 12 chunks of 128 columns (1536 values) take kW = 2 or 4 warps each:
// lane l of warp w of a group owns the vectors at (c * 32 kW + 32 (w % kW) + l) * 4, so each
// thread holds at most 48 values as before, and a row's sums add each warp's total from shared
// memory (group_sum; the same order for every lane, so the result does not depend on the lane).
// The block's warps form kFwdWarps / kW (forward) or kBwdWarps / kW (backward) groups; a loop
// over rows runs the same count in every warp of the block (a group without a row adds zeros),
// because the sums meet at __syncthreads. The backward's shared accumulators are per group, not
// per warp: kBwdWarps / kW groups * 2 rows * D floats are at most 48 KiB for every width (1536 with
// one warp a row, 3072 with two, 6144 with four); with the row sums' static part, the widest rows
// of one, two and four warps pass the default 48 KiB and opt in to more (allow_dynamic_smem).
static_assert((kBwdWarps / 1) * 2 * 1536 * sizeof(float) <= 48 * 1024);
static_assert((kBwdWarps / 2) * 2 * 3072 * sizeof(float) <= 48 * 1024);
static_assert((kBwdWarps / 4) * 2 * kMaxCols * sizeof(float) <= 48 * 1024);

// 4 consecutive elements <-> 4 floats (16-byte f32 or 8-byte half vectors).
template <class T>
__device__ __forceinline__ void ld4(const T* p, float (&v)[4]) {
  if constexpr (std::is_same_v<T, float>) {
    const float4 r = __ldg(reinterpret_cast<const float4*>(p));
    v[0] = r.x, v[1] = r.y, v[2] = r.z, v[3] = r.w;
  } else {
    const uint2 r = __ldg(reinterpret_cast<const uint2*>(p));
    T e[4];
    memcpy(e, &r, sizeof(r));
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = load_as<float>(e[j]);
  }
}
// 4 consecutive elements kept as loaded (16 bytes of f32, 8 of a half type) for a software
// pipeline: unpacked where used, so that a prefetched row costs few registers.
template <class T>
using Raw4 = std::conditional_t<std::is_same_v<T, float>, float4, uint2>;
template <class T, bool kReadOnly = true>
__device__ __forceinline__ Raw4<T> ldraw4(const T* p) {
  if constexpr (kReadOnly) return __ldg(reinterpret_cast<const Raw4<T>*>(p));
  else return *reinterpret_cast<const Raw4<T>*>(p);
}
template <class T>
__device__ __forceinline__ void unpack4(const Raw4<T>& r, float (&v)[4]) {
  if constexpr (std::is_same_v<T, float>) {
    v[0] = r.x, v[1] = r.y, v[2] = r.z, v[3] = r.w;
  } else {
    T e[4];
    memcpy(e, &r, sizeof(r));
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = load_as<float>(e[j]);
  }
}
template <class T>
__device__ __forceinline__ void st4(T* p, const float (&v)[4]) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    T e[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) e[j] = store_as<T>(v[j]);
    uint2 r;
    memcpy(&r, e, sizeof(r));
    *reinterpret_cast<uint2*>(p) = r;
  }
}

// v rounded to T and widened back (what a load of v stored as T would give).
template <class T>
__device__ __forceinline__ void ld4_cast(const float (&v)[4], float (&r)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) r[j] = load_as<float>(store_as<T>(v[j]));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// The sum of v over the kW warps of the calling warp's group (Note [Row groups]); red holds one
// float per warp of the block. Every thread of the block calls it (it meets at __syncthreads when
// kW > 1); a caller reusing red for the next sum must pass another barrier first.
template <int kW>
__device__ __forceinline__ float group_sum(float v, float* red) {
  v = warp_sum(v);
  if constexpr (kW == 1) {
    return v;
  } else {
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    const int first = warp - warp % kW;
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < kW; ++w) t += red[first + w];
    return t;
  }
}

// This thread's position in its group's row: the vector at chunk c is (c * 32 kW + gl) * 4.
template <int kW>
__device__ __forceinline__ int group_lane() {
  return ((threadIdx.x >> 5) % kW) * 32 + (threadIdx.x & 31);
}

// ---- layer_norm + modulate ----
// kRes: the row is h = x + gate * branch (written to h), the gated residual before this adaLN.
template <class X, class M, class O, int kC, int kW, bool kRes = false>
__global__ void __launch_bounds__(kFwdWarps * 32)
    adaln_forward_kernel(const X* __restrict__ x, const M* __restrict__ shift, const M* __restrict__ scale,
                         int64_t ld, O* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd,
                         int64_t rows, int64_t T, int D, float eps, const M* __restrict__ gate, int64_t ld_gate,
                         const M* __restrict__ branch, X* __restrict__ h, O* __restrict__ xhat) {
  constexpr int kGroups = kFwdWarps / kW;
  __shared__ float red[2][kFwdWarps];  // the row sums of each warp (kW > 1): mean, variance
  const int gl = group_lane<kW>(), group = (threadIdx.x >> 5) / kW;
  const float inv_d = 1.f / static_cast<float>(D);
  // The same trip count in every warp of the block (Note [Row groups]).
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kGroups; first < rows;
       first += static_cast<int64_t>(gridDim.x) * kGroups) {
    const int64_t row = first + group;
    const bool live = row < rows;
    if constexpr (kW == 1) {
      if (!live) break;
    }
    const int cols = live ? D : 0;  // a group without a row adds zeros to the sums
    const X* xr = x + row * D;
    float v[kC][4];
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const int e = (c * 32 * kW + gl) * 4;
      if (e < cols) {
        ld4(xr + e, v[c]);
        if constexpr (kRes) {
          float gv[4], bv[4];
          ld4(gate + (row / T) * ld_gate + e, gv);
          ld4(branch + row * D + e, bv);
#pragma unroll
          for (int j = 0; j < 4; ++j) v[c][j] = v[c][j] + gv[j] * bv[j];  // as gated_residual_forward_kernel
          st4(h + row * D + e, v[c]);
          if constexpr (!std::is_same_v<X, float>) {  // the row as stored, so that y is LN(h)
            float r[4];
            ld4_cast<X>(v[c], r);
#pragma unroll
            for (int j = 0; j < 4; ++j) v[c][j] = r[j];
          }
        }
        s += (v[c][0] + v[c][1]) + (v[c][2] + v[c][3]);
      }
    }
    const float m = group_sum<kW>(s, red[0]) * inv_d;
    float q = 0.f;
#pragma unroll
    for (int c = 0; c < kC; ++c)
      if ((c * 32 * kW + gl) * 4 < cols)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float d = v[c][j] - m;
          q += d * d;
        }
    const float rs = 1.f / sqrtf(group_sum<kW>(q, red[1]) * inv_d + eps);
    if (!live) continue;
    const int64_t b = row / T;
    const M* sh = shift + b * ld;
    const M* sc = scale + b * ld;
    O* yr = y + row * D;
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const int e = (c * 32 * kW + gl) * 4;
      if (e < D) {
        float a[4], o[4], t[4], xh[4];
        ld4(sc + e, a);
        ld4(sh + e, t);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          xh[j] = (v[c][j] - m) * rs;
          o[j] = xh[j] * (1.f + a[j]) + t[j];
        }
        st4(yr + e, o);
        if (xhat) st4(xhat + row * D + e, xh);
      }
    }
    if (gl == 0) {
      mean[row] = m;
      rstd[row] = rs;
    }
  }
}

// Per-slice column sums -> [B, D] in the modulation's dtype: part is [B, S, K, D], out_k [B, D]
// (null: not wanted). A block takes 32 columns of one batch row (blockIdx.y, striding by gridDim.y):
// its kSumRows warps read the slices' rows coalesced, a warp one row's 32 columns at a time, and
// their partial sums meet in shared memory. (One thread per column summing all S slices left most
// SMs idle: B * D / 256 blocks, 10 for SD3.5-Large's width.)
constexpr int kSumRows = 16;
template <class M, int K>
__global__ void slice_sum_kernel(const float* __restrict__ part, M* __restrict__ out0, M* __restrict__ out1,
                                 M* __restrict__ out2, int64_t B, int S, int D) {
  __shared__ float red[K][kSumRows][33];
  const int d = static_cast<int>(blockIdx.x) * 32 + static_cast<int>(threadIdx.x);
  M* out[3] = {out0, out1, out2};
  for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
    float acc[K] = {};
    if (d < D) {
      for (int s = static_cast<int>(threadIdx.y); s < S; s += kSumRows)
#pragma unroll
        for (int k = 0; k < K; ++k) acc[k] += part[((b * S + s) * K + k) * D + d];
    }
#pragma unroll
    for (int k = 0; k < K; ++k) red[k][threadIdx.y][threadIdx.x] = acc[k];
    __syncthreads();
    if (threadIdx.y == 0 && d < D) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        float t = 0.0f;
#pragma unroll
        for (int r = 0; r < kSumRows; ++r) t += red[k][r][threadIdx.x];
        if (out[k]) out[k][b * D + d] = store_as<M>(t);
      }
    }
    __syncthreads();
  }
}

// The operands of the fused gated-residual part of a backward (Note [Fused residual backward] in
// src/ops/adaln.cpp); null pointers where there is none.
template <class M>
struct ResBwd {
  const M* gate = nullptr;
  int64_t ld_gate = 0;
  const M* branch = nullptr;
  M* dbranch = nullptr;
  M* dgate = nullptr;
  float* bias_rows = nullptr;  // kBias: [B * slices, D], each block's column sums of gate * dh
};

// kHat: xin is x-hat in O (saved by the forward; no mean) instead of x in X.
// kRes: the final dx (dh of the gated residual h = x_prev + gate * branch whose result x is) also
// gives dbranch = gate * dh and a third accumulator, dgate = sum over T of dh * branch.
// kBias (with kRes): a fourth, the block's column sums of gate * dh in f32 (before dbranch's
// rounding), written as one row of res.bias_rows per block for a column sum over the rows.
// kW: warps a row (Note [Row groups]); the groups of a block take the slice's rows in turn.
template <class X, class M, class O, int kC, int kW, bool kHat, bool kRes, bool kBias = false>
__global__ void __launch_bounds__(kBwdWarps * 32)
    adaln_backward_kernel(const O* __restrict__ dy, const std::conditional_t<kHat, O, X>* __restrict__ xin,
                          const float* __restrict__ mean, const float* __restrict__ rstd, const M* __restrict__ scale,
                          int64_t ld, X* dx, const X* base, float* __restrict__ part, M* __restrict__ dshift,
                          M* __restrict__ dscale, int64_t T, int D, int64_t rows_per_slice, ResBwd<M> res) {
  using XI = std::conditional_t<kHat, O, X>;
  static_assert(kRes || !kBias);
  static_assert(kW == 1 || !kRes, "the fused residual part is for rows of one warp");
  constexpr int K = kRes ? (kBias ? 4 : 3) : 2;
  constexpr int kGate = kRes ? 2 : 0;  // dgate's accumulator (the bias sums follow it)
  constexpr int kGroups = kBwdWarps / kW;
  extern __shared__ float acc[];  // [kGroups][K][D]
  __shared__ float red[2][kBwdWarps][2];  // the row sums of each warp (kW > 1), by row parity
  const int gl = group_lane<kW>(), group = (threadIdx.x >> 5) / kW;
  const int64_t b = blockIdx.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * rows_per_slice;
  const int64_t t1 = t0 + rows_per_slice < T ? t0 + rows_per_slice : T;
  float* mine = acc + static_cast<int64_t>(group) * K * D;
  const M* sc = scale + b * ld;
  float a1[kC][4];  // 1 + scale of this lane's columns
  float gv[kRes ? kC : 1][4];  // the gate of this lane's columns (kRes)
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    const int e = (c * 32 * kW + gl) * 4;
    if (e < D) {
      ld4(sc + e, a1[c]);
      if constexpr (kRes) ld4(res.gate + b * res.ld_gate + e, gv[c]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        a1[c][j] += 1.f;
#pragma unroll
        for (int k = 0; k < K; ++k) mine[k * D + e + j] = 0.f;
      }
    }
  }
  const float inv_d = 1.f / static_cast<float>(D);
  // A pipeline of depth 2 (as Note [Row backward pipeline] in norm_kernels.cuh): the next row's
  // x, dy and base are in flight while this row is reduced and written. Rows of more than 512
  // values (kC 12) would not fit two stages in registers: they load each row at its start.
  constexpr bool kPipe = kC <= 4 && kW == 1;
  Raw4<XI> nx[kC] = {};
  Raw4<X> nb[kC] = {};
  Raw4<O> nd[kC] = {};
  Raw4<M> nr[kRes ? kC : 1] = {};
  float nm = 0.f, nrs = 0.f;
  auto fetch = [&](int64_t t) {
    if (t >= t1) return;
    const int64_t row = b * T + t;
    if constexpr (!kHat) nm = mean[row];
    nrs = rstd[row];
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const int e = (c * 32 * kW + gl) * 4;
      if (e < D) {
        nx[c] = ldraw4(xin + row * D + e);
        nd[c] = ldraw4(dy + row * D + e);
        if (base) nb[c] = ldraw4<X, false>(base + row * D + e);  // may be dx itself: no read-only path
        if constexpr (kRes) nr[c] = ldraw4(res.branch + row * D + e);
      }
    }
  };
  // x-hat of 4 loaded values.
  auto hat = [&](const Raw4<XI>& r, float m, float rs, float (&xh)[4]) {
    unpack4<XI>(r, xh);
    if constexpr (!kHat) {
#pragma unroll
      for (int j = 0; j < 4; ++j) xh[j] = (xh[j] - m) * rs;
    }
  };
  if constexpr (kPipe) fetch(t0 + group);
  // The same trip count in every warp of the block (Note [Row groups]); one warp a row stops at
  // the slice's end.
  int parity = 0;
  for (int64_t first = t0; first < t1; first += kGroups, parity ^= 1) {
    const int64_t t = first + group;
    const bool live = t < t1;
    if constexpr (kW == 1) {
      if (!live) break;
    }
    const int cols = live ? D : 0;  // a group without a row adds zeros to the sums
    const int64_t row = b * T + t;
    if constexpr (!kPipe) fetch(t);
    Raw4<XI> cx[kC];
    Raw4<X> cb[kC];
    Raw4<O> cd[kC];
    Raw4<M> cr[kRes ? kC : 1];
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      cx[c] = nx[c];
      cd[c] = nd[c];
      cb[c] = nb[c];
      if constexpr (kRes) cr[c] = nr[c];
    }
    const float m = nm, rs = nrs;
    if constexpr (kPipe) fetch(t + kGroups);
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const int e = (c * 32 * kW + gl) * 4;
      if (e < cols) {
        float xh[4], dv[4];
        hat(cx[c], m, rs, xh);
        unpack4<O>(cd[c], dv);
        float4 ash = *reinterpret_cast<float4*>(mine + e);
        float4 asc = *reinterpret_cast<float4*>(mine + D + e);
        float* pash = &ash.x;
        float* pasc = &asc.x;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float g = dv[j] * a1[c][j];
          s1 += g;
          s2 += g * xh[j];
          pash[j] += dv[j];
          pasc[j] += dv[j] * xh[j];
        }
        *reinterpret_cast<float4*>(mine + e) = ash;
        *reinterpret_cast<float4*>(mine + D + e) = asc;
      }
    }
    if (dx) {
      float mg, mgx;
      if constexpr (kW == 1) {
        mg = warp_sum(s1) * inv_d;
        mgx = warp_sum(s2) * inv_d;
      } else {  // both sums through one barrier; the parity keeps the next row's off these slots
        s1 = warp_sum(s1);
        s2 = warp_sum(s2);
        const int warp = threadIdx.x >> 5;
        if ((threadIdx.x & 31) == 0) red[parity][warp][0] = s1, red[parity][warp][1] = s2;
        __syncthreads();
        const int w0 = warp - warp % kW;
        mg = 0.f, mgx = 0.f;
#pragma unroll
        for (int w = 0; w < kW; ++w) mg += red[parity][w0 + w][0], mgx += red[parity][w0 + w][1];
        mg *= inv_d;
        mgx *= inv_d;
      }
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        const int e = (c * 32 * kW + gl) * 4;
        if (e < cols) {
          float xh[4], dv[4], o[4];
          hat(cx[c], m, rs, xh);
          unpack4<O>(cd[c], dv);
#pragma unroll
          for (int j = 0; j < 4; ++j) o[j] = rs * (dv[j] * a1[c][j] - mg - xh[j] * mgx);
          if (base) {
            float bv[4];
            unpack4<X>(cb[c], bv);
#pragma unroll
            for (int j = 0; j < 4; ++j) o[j] += bv[j];
          }
          st4(dx + row * D + e, o);
          if constexpr (kRes) {  // from dh as stored, as the unfused gated residual backward reads it
            float dh[4], br[4], db[4];
            if constexpr (std::is_same_v<X, float>) {
#pragma unroll
              for (int j = 0; j < 4; ++j) dh[j] = o[j];
            } else {
              ld4_cast<X>(o, dh);
            }
            unpack4<M>(cr[c], br);
            float4 ag = *reinterpret_cast<float4*>(mine + kGate * D + e);
            float* pag = &ag.x;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              pag[j] += dh[j] * br[j];
              db[j] = dh[j] * gv[c][j];
            }
            *reinterpret_cast<float4*>(mine + kGate * D + e) = ag;
            if constexpr (kBias) {
              float4 ab = *reinterpret_cast<float4*>(mine + (kGate + 1) * D + e);
              ab.x += db[0], ab.y += db[1], ab.z += db[2], ab.w += db[3];
              *reinterpret_cast<float4*>(mine + (kGate + 1) * D + e) = ab;
            }
            if (res.dbranch) st4(res.dbranch + row * D + e, db);
          }
        }
      }
    }
  }
  __syncthreads();
  // The modulation sums (K0 of them) go through part / the outputs; the bias sums to bias_rows.
  constexpr int K0 = kRes ? 3 : 2;
  const bool whole = gridDim.y == 1;
  float* pp = whole ? nullptr : part + (b * gridDim.y + blockIdx.y) * K0 * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float s[K] = {};
#pragma unroll
    for (int w = 0; w < kGroups; ++w)
#pragma unroll
      for (int k = 0; k < K; ++k) s[k] += acc[(w * K + k) * D + d];
    if (!whole) {
#pragma unroll
      for (int k = 0; k < K0; ++k) pp[k * D + d] = s[k];
    } else {
      if (dshift) dshift[b * D + d] = store_as<M>(s[0]);
      if (dscale) dscale[b * D + d] = store_as<M>(s[1]);
      if constexpr (kRes) res.dgate[b * D + d] = store_as<M>(s[kGate]);
    }
    if constexpr (kBias) res.bias_rows[(b * gridDim.y + blockIdx.y) * D + d] = s[kGate + 1];
  }
}

// ---- gated residual ----
template <class X, class M>
__global__ void gated_residual_forward_kernel(const X* __restrict__ x, const M* __restrict__ gate, int64_t ld,
                                              const M* __restrict__ y, X* __restrict__ out, int64_t n4, int64_t T,
                                              int D) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i * 4, row = e / D;
    const int col = static_cast<int>(e - row * D);
    float xv[4], gv[4], yv[4], o[4];
    ld4(x + e, xv);
    ld4(gate + (row / T) * ld + col, gv);
    ld4(y + e, yv);
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] = xv[j] + gv[j] * yv[j];
    st4(out + e, o);
  }
}

// kW: warps a row (Note [Row groups]; no row sums here, so each group runs its own rows).
template <class X, class M, int kC, int kW>
__global__ void __launch_bounds__(kBwdWarps * 32)
    gated_residual_backward_kernel(const X* __restrict__ dout, const M* __restrict__ y, const M* __restrict__ gate,
                                   int64_t ld, M* __restrict__ dy, float* __restrict__ part, M* __restrict__ dgate,
                                   int64_t T, int D, int64_t rows_per_slice) {
  constexpr int kGroups = kBwdWarps / kW;
  extern __shared__ float acc[];  // [kGroups][D]
  const int gl = group_lane<kW>(), group = (threadIdx.x >> 5) / kW;
  const int64_t b = blockIdx.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * rows_per_slice;
  const int64_t t1 = t0 + rows_per_slice < T ? t0 + rows_per_slice : T;
  float* mine = acc + static_cast<int64_t>(group) * D;
  const M* gr = gate + b * ld;
  float gv[kC][4];
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    const int e = (c * 32 * kW + gl) * 4;
    if (e < D) {
      ld4(gr + e, gv[c]);
#pragma unroll
      for (int j = 0; j < 4; ++j) mine[e + j] = 0.f;
    }
  }
  for (int64_t t = t0 + group; t < t1; t += kGroups) {
    const int64_t off = (b * T + t) * D;
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const int e = (c * 32 * kW + gl) * 4;
      if (e < D) {
        float dv[4], yv[4], o[4];
        ld4(dout + off + e, dv);
        ld4(y + off + e, yv);
        float4 a = *reinterpret_cast<float4*>(mine + e);
        float* pa = &a.x;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          pa[j] += dv[j] * yv[j];
          o[j] = dv[j] * gv[c][j];
        }
        *reinterpret_cast<float4*>(mine + e) = a;
        if (dy) st4(dy + off + e, o);
      }
    }
  }
  __syncthreads();
  const bool whole = gridDim.y == 1;
  float* pp = whole ? nullptr : part + (b * gridDim.y + blockIdx.y) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kGroups; ++w) s += acc[w * D + d];
    if (whole) dgate[b * D + d] = store_as<M>(s);
    else pp[d] = s;
  }
}

// ---- launch helpers ----

bool aligned(const void* p, std::size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Warps a row for rows of D values (Note [Row groups]; with_chunks picks the same).
int warps_per_row(int64_t D) { return D <= 1536 ? 1 : D <= 3072 ? 2 : 4; }

// A kernel whose dynamic shared memory and static part together pass the default 48 KiB must opt
// in, once per device (Note [Row groups]: the backward of rows of 3072 or 6144 values takes 48 KiB
// of accumulators beside its row sums). The caller holds a DeviceGuard for `device`.
void allow_dynamic_smem(const void* kernel, int device) {
  constexpr int kCap = 64 * 1024;
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(mu);
  if (done.count({kernel, device})) return;
  FLAME_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kCap));
  done.insert({kernel, device});
}

// [B, D] with unit column stride, a row stride that keeps every row 4-element aligned.
bool mod_ok(const Tensor& m, int64_t B, int64_t D) {
  return m.defined() && m.dim() == 2 && m.size(0) == B && m.size(1) == D && m.stride(1) == 1 &&
         (B == 1 || m.stride(0) % 4 == 0) && aligned(m.data_ptr(), 4 * dtype_size(m.dtype()));
}
bool rows_ok(const Tensor& t, int64_t D) {
  return t.defined() && t.is_contiguous() && t.dim() == 3 && t.size(2) == D &&
         aligned(t.data_ptr(), 4 * dtype_size(t.dtype()));
}
// The shape family every kernel here handles.
bool geometry_ok(const Tensor& x) {
  if (x.dim() != 3 || x.numel() == 0) return false;
  const int64_t D = x.size(2);
  return D % 4 == 0 && D <= kMaxCols && x.size(1) < (int64_t{1} << 31);
}

// Calls f.template operator()<X, M>() for the supported (x, modulation) dtype pairs.
template <class F>
bool dispatch_pair(DType xd, DType md, F&& f) {
  if (xd == DType::f32) {
    switch (md) {
      case DType::f32: f.template operator()<float, float>(); return true;
      case DType::bf16: f.template operator()<float, bfloat16>(); return true;
      case DType::f16: f.template operator()<float, float16>(); return true;
      default: return false;
    }
  }
  if (xd != md) return false;
  if (xd == DType::bf16) {
    f.template operator()<bfloat16, bfloat16>();
    return true;
  }
  if (xd == DType::f16) {
    f.template operator()<float16, float16>();
    return true;
  }
  return false;
}

// Slices of T per batch so that about four blocks per SM run; rows per slice.
int64_t rows_per_slice(int device, int64_t B, int64_t T) {
  const int64_t want = 4 * static_cast<int64_t>(sm_count(device));
  int64_t slices = std::max<int64_t>(1, (want + B - 1) / B);
  slices = std::min<int64_t>(slices, (T + kBwdWarps - 1) / kBwdWarps);
  slices = std::max<int64_t>(slices, 1);
  return (T + slices - 1) / slices;
}

// The grid of a backward kernel, dim3(B, count) blocks of kBwdWarps warps, with K accumulators
// of D floats per group of warps (Note [Row groups]) in shared memory; with more than one slice per batch, the [B, count, K, D]
// partial rows that slice_sum_kernel adds (stream-ordered: freed after the kernels queued while
// this lives have run).
struct BwdSlices {
  int64_t per;  // rows per slice
  int count;
  std::size_t smem;
  std::shared_ptr<void> part;
  // K: the accumulators that go through the partial rows; k_smem: all of them (K, or K + 1 with
  // the bias sums, which take their own rows).
  BwdSlices(CudaBackend& be, int64_t B, int64_t T, int64_t D, int K, int k_smem = 0)
      : per(rows_per_slice(be.device(), B, T)),
        count(static_cast<int>((T + per - 1) / per)),
        smem(static_cast<std::size_t>(kBwdWarps / warps_per_row(D)) * std::max(K, k_smem) * D * sizeof(float)) {
    if (count > 1) part = be.allocate(static_cast<std::size_t>(B) * count * K * D * sizeof(float));
  }
  dim3 grid(int64_t B) const { return dim3(static_cast<unsigned>(B), static_cast<unsigned>(count)); }
  float* partial() const { return static_cast<float*>(part.get()); }
};

// The second stage when a batch's rows took several slices: out_k [B, D] = the slices' sums.
template <class M, int K>
void launch_slice_sum(cudaStream_t st, const BwdSlices& sl, M* out0, M* out1, M* out2, int64_t B, int64_t D) {
  if (sl.count <= 1) return;
  const dim3 grid(static_cast<unsigned>((D + 31) / 32), static_cast<unsigned>(std::min<int64_t>(B, 65535)));
  slice_sum_kernel<M, K><<<grid, dim3(32, kSumRows), 0, st>>>(sl.partial(), out0, out1, out2, B, sl.count,
                                                              static_cast<int>(D));
  FLAME_CUDA_CHECK_LAUNCH();
}

// Calls f(std::integral_constant<int, kC>{}, std::integral_constant<int, kW>{}) with the chunks of
// 128 kW columns a lane holds and the warps a row (Note [Row groups]): 4 chunks for rows of up to
// 512 values (the pipelined backward fits), else 12, with one warp a row up to 1536 values, two
// up to 3072 and four up to kMaxCols.
template <class F>
void with_chunks(int64_t D, F&& f) {
  using std::integral_constant;
  if (D <= 512) f(integral_constant<int, 4>{}, integral_constant<int, 1>{});
  else if (D <= 1536) f(integral_constant<int, 12>{}, integral_constant<int, 1>{});
  else if (D <= 3072) f(integral_constant<int, 12>{}, integral_constant<int, 2>{});
  else f(integral_constant<int, 12>{}, integral_constant<int, 4>{});
}

// The operands of adaln_residual_forward that adaln_forward lacks (all null there).
struct ResidualArgs {
  const void* gate = nullptr;
  int64_t ld_gate = 0;
  const void* branch = nullptr;
  void* h = nullptr;
};

// What adaln_forward and adaln_residual_forward both require of their shared operands.
bool forward_ok(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x, const Tensor& shift,
                const Tensor& scale, const Tensor& xhat) {
  if (!geometry_ok(x) || !rows_ok(x, x.size(2)) || !rows_ok(y, x.size(2))) return false;
  const int64_t B = x.size(0), D = x.size(2);
  if (!mod_ok(shift, B, D) || !mod_ok(scale, B, D) || shift.dtype() != scale.dtype() ||
      shift.stride(0) != scale.stride(0) || y.dtype() != (x.dtype() == DType::f32 ? scale.dtype() : x.dtype()))
    return false;
  if (xhat.defined() && (!rows_ok(xhat, D) || xhat.dtype() != y.dtype() || xhat.sizes() != y.sizes())) return false;
  return mean.is_contiguous() && rstd.is_contiguous() && mean.dtype() == DType::f32 && rstd.dtype() == DType::f32;
}

// Queues adaln_forward_kernel on be's stream: a warp per row (Note [adaLN kernels]); kRes adds
// the gated residual before the norm (r's operands).
template <bool kRes>
bool launch_forward(CudaBackend& be, const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                    const Tensor& shift, const Tensor& scale, double eps, const ResidualArgs& r,
                    const Tensor& xhat) {
  const int64_t T = x.size(1), D = x.size(2), rows = x.size(0) * T;
  DeviceGuard guard(be.device());
  cudaStream_t st = be.stream();
  const int64_t ld = scale.stride(0);
  return dispatch_pair(x.dtype(), scale.dtype(), [&]<class X, class M>() {
    using O = std::conditional_t<std::is_same_v<X, float>, M, X>;
    with_chunks(D, [&](auto chunks, auto warps) {
      constexpr int kC = decltype(chunks)::value, kW = decltype(warps)::value;
      adaln_forward_kernel<X, M, O, kC, kW, kRes><<<grid_for(rows, kFwdWarps / kW), kFwdWarps * 32, 0, st>>>(
          static_cast<const X*>(x.data_ptr()), static_cast<const M*>(shift.data_ptr()),
          static_cast<const M*>(scale.data_ptr()), ld, static_cast<O*>(y.data_ptr()),
          static_cast<float*>(mean.data_ptr()), static_cast<float*>(rstd.data_ptr()), rows, T, static_cast<int>(D),
          static_cast<float>(eps), static_cast<const M*>(r.gate), r.ld_gate, static_cast<const M*>(r.branch),
          static_cast<X*>(r.h), xhat.defined() ? static_cast<O*>(xhat.data_ptr()) : nullptr);
      FLAME_CUDA_CHECK_LAUNCH();
    });
  });
}

// Whether the fused gated-residual part of a backward fits: rows of up to 512 values (the
// pipelined kernel; three accumulator rows per warp), operands in the modulation's dtype.
bool residual_more_ok(const fused::AdalnBackwardMore& more, const Tensor& scale, int64_t B, int64_t T, int64_t D) {
  const Tensor& gate = more.gate;
  if (!mod_ok(gate, B, D) || gate.dtype() != scale.dtype() || D > 512) return false;
  if (!rows_ok(more.branch, D) || more.branch.dtype() != gate.dtype() || more.branch.size(0) != B ||
      more.branch.size(1) != T)
    return false;
  const Tensor& db = more.dbranch;
  if (db.defined() && (!rows_ok(db, D) || db.dtype() != gate.dtype() || db.sizes() != more.branch.sizes()))
    return false;
  const Tensor& dg = more.dgate;
  return dg.defined() && dg.is_contiguous() && dg.dtype() == gate.dtype() && dg.numel() == B * D;
}

}  // namespace

static bool adaln_forward_cuda(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                               const Tensor& shift, const Tensor& scale, double eps, const Tensor& xhat) {
  CudaBackend& be = cuda_backend(x.device().index);
  if (!forward_ok(y, mean, rstd, x, shift, scale, xhat)) return false;
  return launch_forward<false>(be, y, mean, rstd, x, shift, scale, eps, ResidualArgs{}, xhat);
}

static bool adaln_residual_forward_cuda(const Tensor& h, const Tensor& y, const Tensor& mean, const Tensor& rstd,
                                        const Tensor& x, const Tensor& gate, const Tensor& branch, const Tensor& shift,
                                        const Tensor& scale, double eps, const Tensor& xhat) {
  CudaBackend& be = cuda_backend(x.device().index);
  if (!forward_ok(y, mean, rstd, x, shift, scale, xhat) || !rows_ok(h, x.size(2)) || !rows_ok(branch, x.size(2)))
    return false;
  if (!mod_ok(gate, x.size(0), x.size(2)) || gate.dtype() != scale.dtype() || branch.dtype() != scale.dtype() ||
      h.dtype() != x.dtype())
    return false;
  return launch_forward<true>(be, y, mean, rstd, x, shift, scale, eps,
                              ResidualArgs{gate.data_ptr(), gate.stride(0), branch.data_ptr(), h.data_ptr()}, xhat);
}

static bool adaln_backward_cuda(const Tensor& dx, const Tensor& dshift, const Tensor& dscale, const Tensor& dy,
                                const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& scale,
                                const fused::AdalnBackwardMore& more) {
  CudaBackend& be = cuda_backend(x.device().index);
  if (!geometry_ok(x) || !rows_ok(x, x.size(2)) || !rows_ok(dy, x.size(2))) return false;
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  const bool hat = !mean.defined();  // x is x-hat in dy's dtype, the forward's x was f32
  const DType xd = hat ? DType::f32 : x.dtype();
  if (!mod_ok(scale, B, D) || dy.dtype() != (xd == DType::f32 ? scale.dtype() : xd)) return false;
  if (hat && (x.dtype() != dy.dtype() || dy.dtype() == DType::f32)) return false;
  if (dx.defined() && (!rows_ok(dx, D) || dx.dtype() != xd)) return false;
  const Tensor& base = more.base;
  // The base is read in dx's final write: it needs dx and dx's layout (it may be dx itself).
  if (base.defined() && (!dx.defined() || !rows_ok(base, D) || base.dtype() != dx.dtype() ||
                         base.sizes() != dx.sizes() || base.device() != dx.device()))
    return false;
  // base is dx itself or apart from it: a partial overlap would read elements other lanes wrote.
  if (base.defined() && base.data_ptr() != dx.data_ptr() && base.impl()->storage == dx.impl()->storage) return false;
  for (const Tensor* t : {&dshift, &dscale})
    if (t->defined() && (!t->is_contiguous() || t->dtype() != scale.dtype() || t->numel() != B * D)) return false;
  const bool res = more.gate.defined();
  if (res && (!dx.defined() || !residual_more_ok(more, scale, B, T, D))) return false;
  const Tensor& dbias = more.dbias;
  const bool bias = res && dbias.defined();
  if (bias && (!more.dbranch.defined() || dbias.dtype() != DType::f32 || !dbias.is_contiguous() || dbias.numel() != D ||
               dbias.device() != dx.device()))
    return false;
  DeviceGuard guard(be.device());
  cudaStream_t st = be.stream();
  const BwdSlices sl(be, B, T, D, res ? 3 : 2, bias ? 4 : 0);
  // kBias: one row of bias sums per block, then their column sum into dbias (stream-ordered).
  std::shared_ptr<void> bias_rows = bias ? be.allocate(static_cast<std::size_t>(B) * sl.count * D * sizeof(float)) : nullptr;
  const int64_t ld = scale.stride(0);
  return dispatch_pair(xd, scale.dtype(), [&]<class X, class M>() {
    using O = std::conditional_t<std::is_same_v<X, float>, M, X>;
    M* dsh = dshift.defined() ? static_cast<M*>(dshift.data_ptr()) : nullptr;
    M* dsc = dscale.defined() ? static_cast<M*>(dscale.data_ptr()) : nullptr;
    ResBwd<M> rb;
    if (res) {
      rb.gate = static_cast<const M*>(more.gate.data_ptr());
      rb.ld_gate = more.gate.stride(0);
      rb.branch = static_cast<const M*>(more.branch.data_ptr());
      rb.dbranch = more.dbranch.defined() ? static_cast<M*>(more.dbranch.data_ptr()) : nullptr;
      rb.dgate = static_cast<M*>(more.dgate.data_ptr());
      rb.bias_rows = static_cast<float*>(bias_rows.get());
    }
    auto go = [&]<int kC, int kW, bool kHat, bool kRes, bool kBias = false>() {
      using XI = std::conditional_t<kHat, O, X>;
      const auto kernel = &adaln_backward_kernel<X, M, O, kC, kW, kHat, kRes, kBias>;
      allow_dynamic_smem(reinterpret_cast<const void*>(kernel), be.device());  // 1536 values a warp: 48 KiB too
      kernel<<<sl.grid(B), kBwdWarps * 32, sl.smem, st>>>(
          static_cast<const O*>(dy.data_ptr()), static_cast<const XI*>(x.data_ptr()),
          hat ? nullptr : static_cast<const float*>(mean.data_ptr()), static_cast<const float*>(rstd.data_ptr()),
          static_cast<const M*>(scale.data_ptr()), ld, dx.defined() ? static_cast<X*>(dx.data_ptr()) : nullptr,
          base.defined() ? static_cast<const X*>(base.data_ptr()) : nullptr, sl.partial(), dsh, dsc, T,
          static_cast<int>(D), sl.per, rb);
      FLAME_CUDA_CHECK_LAUNCH();
    };
    // Rows of up to 512 values take the pipelined kernel and may have the residual part
    // (residual_more_ok); x-hat is saved only where it is narrower than x (f32 x, a half
    // modulation: no other pair reaches here with it).
    auto pick = [&]<bool kHat>() {
      if (D > 3072) go.template operator()<12, 4, kHat, false>();
      else if (D > 1536) go.template operator()<12, 2, kHat, false>();
      else if (D > 512) go.template operator()<12, 1, kHat, false>();
      else if (bias) go.template operator()<4, 1, kHat, true, true>();
      else if (res) go.template operator()<4, 1, kHat, true>();
      else go.template operator()<4, 1, kHat, false>();
    };
    if (!hat) pick.template operator()<false>();
    else if constexpr (std::is_same_v<X, float> && !std::is_same_v<M, float>) pick.template operator()<true>();
    if (res) launch_slice_sum<M, 3>(st, sl, dsh, dsc, rb.dgate, B, D);
    else launch_slice_sum<M, 2>(st, sl, dsh, dsc, nullptr, B, D);
    if (bias) {  // the norms' second stage over the B * slices rows (Note [Row backward second stage])
      const dim3 grid2(static_cast<unsigned>((D + 7) / 8)), block2(8, 64);
      norm::column_sum_narrow_kernel<float, false><<<grid2, block2, 0, st>>>(
          rb.bias_rows, nullptr, static_cast<float*>(dbias.data_ptr()), nullptr, B * sl.count, D);
      FLAME_CUDA_CHECK_LAUNCH();
    }
  });
}

static bool gated_residual_forward_cuda(const Tensor& out, const Tensor& x, const Tensor& gate, const Tensor& y) {
  CudaBackend& be = cuda_backend(x.device().index);
  if (!geometry_ok(x) || !rows_ok(x, x.size(2)) || !rows_ok(y, x.size(2)) || !rows_ok(out, x.size(2))) return false;
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  if (!mod_ok(gate, B, D) || y.dtype() != gate.dtype() || out.dtype() != x.dtype()) return false;
  DeviceGuard guard(be.device());
  cudaStream_t st = be.stream();
  const int64_t n4 = x.numel() / 4;
  return dispatch_pair(x.dtype(), gate.dtype(), [&]<class X, class M>() {
    gated_residual_forward_kernel<X, M><<<grid_for(n4, 256), 256, 0, st>>>(
        static_cast<const X*>(x.data_ptr()), static_cast<const M*>(gate.data_ptr()), gate.stride(0),
        static_cast<const M*>(y.data_ptr()), static_cast<X*>(out.data_ptr()), n4, T, static_cast<int>(D));
    FLAME_CUDA_CHECK_LAUNCH();
  });
}

static bool gated_residual_backward_cuda(const Tensor& dy, const Tensor& dgate, const Tensor& dout, const Tensor& y,
                                         const Tensor& gate) {
  CudaBackend& be = cuda_backend(dout.device().index);
  if (!geometry_ok(dout) || !rows_ok(dout, dout.size(2)) || !rows_ok(y, dout.size(2))) return false;
  const int64_t B = dout.size(0), T = dout.size(1), D = dout.size(2);
  if (!mod_ok(gate, B, D) || y.dtype() != gate.dtype()) return false;
  if (dy.defined() && (!rows_ok(dy, D) || dy.dtype() != y.dtype())) return false;
  if (!dgate.defined() || !dgate.is_contiguous() || dgate.dtype() != gate.dtype() || dgate.numel() != B * D)
    return false;
  DeviceGuard guard(be.device());
  cudaStream_t st = be.stream();
  const BwdSlices sl(be, B, T, D, 1);
  return dispatch_pair(dout.dtype(), gate.dtype(), [&]<class X, class M>() {
    M* dg = static_cast<M*>(dgate.data_ptr());
    with_chunks(D, [&](auto chunks, auto warps) {
      constexpr int kC = decltype(chunks)::value, kW = decltype(warps)::value;
      gated_residual_backward_kernel<X, M, kC, kW><<<sl.grid(B), kBwdWarps * 32, sl.smem, st>>>(
          static_cast<const X*>(dout.data_ptr()), static_cast<const M*>(y.data_ptr()),
          static_cast<const M*>(gate.data_ptr()), gate.stride(0), dy.defined() ? static_cast<M*>(dy.data_ptr()) : nullptr,
          sl.partial(), dg, T, static_cast<int>(D), sl.per);
      FLAME_CUDA_CHECK_LAUNCH();
    });
    launch_slice_sum<M, 1>(st, sl, dg, nullptr, nullptr, B, D);
  });
}

void register_adaln_kernels() {
  fused::adaln_forward.define(DeviceType::cuda, &adaln_forward_cuda);
  fused::adaln_residual_forward.define(DeviceType::cuda, &adaln_residual_forward_cuda);
  fused::adaln_backward.define(DeviceType::cuda, &adaln_backward_cuda);
  fused::gated_residual_forward.define(DeviceType::cuda, &gated_residual_forward_cuda);
  fused::gated_residual_backward.define(DeviceType::cuda, &gated_residual_backward_cuda);
}

}  // namespace flame::backend::cuda
