// Note [Short-sequence attention]
// A DiT's attention is many short problems: dit-s at 28x28 has B*H = 1536 heads of 196 queries x
// 196 keys x 64 dims per layer. cuDNN's SDPA kernels tile keys and queries by 64 or 128, so 196
// pads to 256 (1.7x the score work), and its backward adds a dO.O pass and a dQ conversion pass.
// These kernels keep a whole head's keys in shared memory instead (at most 256 rows of 64) and
// tile by 16 (196 pads to 208) with warp-level tensor-core MMAs (mma.sync m16n8k16, bf16/f16 in,
// f32 accumulate):
//  - forward: one block per (batch, head); K and V staged in shared memory once; each warp takes
//    16-query tiles in turn and runs the online softmax over 64-key chunks (Q in registers, S and
//    the output accumulator in registers, P reused from the accumulator layout as the A operand of
//    P.V). Writes the output and each row's natural-log logsumexp (the backend's stats contract).
//  - backward, two kernels with no atomics: dQ (one block per head, K and V in shared memory, a
//    warp per 16-query tile recomputes P and dP for its rows; D = rowsum(dO * O) comes from the
//    fragments it already holds, and is also written out for the next kernel) and dK/dV (one block
//    per head, Q and dO in shared memory with the logsumexp and D of every query, a warp per
//    16-key tile accumulates dK and dV in registers).
//    P and dP are computed twice (once per kernel): 7 MMA passes instead of FlashAttention-2's 5,
//    traded for no dQ atomics, no conversion pass and no cross-warp reduction. Asked for
//    (Backend::sdpa_backward's column_sums), both also sum their gradient tiles per column as they
//    write them (a shared-memory add per column and tile) and a small kernel adds the heads'
//    partial sums over the batch: the bias gradient of the qkv projection, which then skips its
//    own pass over the qkv gradient (Note [Gradient row sums]).
// Shared-memory rows are 64 halves, their eight 16-byte chunks swizzled (chunk ^ row % 8):
// ldmatrix reads the same chunk of eight consecutive rows per phase, and the swizzle puts them on
// distinct banks without padding (so four blocks of 196-key heads fit on an SM, not three). Keys
// (or queries) past the sequence are zero-filled and masked out of the softmax (-inf score) or
// given an infinite logsumexp (zero probability).
// Only what the supports() check accepts comes here; everything else stays on cuDNN.
// Measured (H100, docs/nn-attention.md): correct, but slower than cuDNN's kernels (dit-s forward
// + backward 0.67 against 0.43 ms), hence off by default. They are latency-bound: at 123-217
// registers a thread and up to 66 KB of shared memory a block, 8-12 warps fit on an SM, and each
// warp's loads and its ldmatrix-MMA-exp-MMA chain stall it with little else to issue. What would
// help: cp.async/TMA staging that overlaps the next head or Q tile with the current one, and
// 64-row warpgroup MMAs.
// tools/sdpa_short_model.py (ctest model.sdpa_short) is a fragment-level NumPy model of these
// kernels checked against plain attention: change it with them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "src/backend/cuda/attention/sdpa_short.h"
#include "src/backend/cuda/common.cuh"

namespace flame::backend::cuda::sdpa_short {

namespace {

constexpr int kD = 64;           // head dim
constexpr int kMaxSeq = 256;     // queries and keys
constexpr int kWarps = 4;        // per block; blocks per SM: 4 forward, 3 dQ, 2 dK/dV (registers)
constexpr int kThreads = kWarps * 32;
constexpr int kRow = kD;         // shared-memory row stride in halves (swizzled: Note above)
constexpr int kChunk = 64;       // keys (forward, dQ) or queries (dK/dV) per softmax step
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// A [B, H, N, 64] operand (last dim contiguous) and its element strides; read or written.
struct Operand {
  void* ptr;
  int64_t sb, sh, sr;
};

Operand operand(const Tensor& t) { return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; }

struct Params {
  Operand q, k, v, o, dout, out, dq, dk, dv;
  float* stats;        // [B, H, L] f32 logsumexp rows (forward writes, backward reads)
  int heads, L, S;
  float scale;         // softmax scale
  float scale_log2;    // scale * log2(e)
  float* colsum;       // backward, optional: [B * H, 3, 64] f32, each head's column sums of dq, dk, dv
  float* drow;         // backward: [B, H, L] f32, D = rowsum(dO * O), written by the dQ kernel
};

// One m16n8k16 tensor-core MMA (f32 accumulate) and the packing of f32 pairs into T pairs.
template <class T>
struct Mma {
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  static __device__ __forceinline__ void run(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    if constexpr (kBf16) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
  }
  using T2 = std::conditional_t<kBf16, __nv_bfloat162, __half2>;
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    T2 h;
    if constexpr (kBf16) h = __floats2bfloat162_rn(x, y); else h = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t u) {
    const T2 h = *reinterpret_cast<T2*>(&u);
    if constexpr (kBf16) return __bfloat1622float2(h); else return __half22float2(h);
  }
};

// Four 8x8 b16 matrices from shared memory; lane l gives the row address of row l % 8 of matrix
// l / 8. Without .trans lane l receives (row l/4, cols 2(l%4), 2(l%4)+1) of each matrix; with
// .trans (rows 2(l%4), 2(l%4)+1, col l/4).
__device__ __forceinline__ void ldsm4(uint32_t r[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldsm4_t(uint32_t r[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

template <class T>
__device__ __forceinline__ T* row_ptr(const Operand& t, int b, int h, int r) {
  return static_cast<T*>(t.ptr) + b * t.sb + h * t.sh + static_cast<int64_t>(r) * t.sr;
}

// Where element (row r, column col) of a staged [N, 64] operand lives in shared memory: its 16-byte
// chunk col / 8 is stored at chunk (col / 8) ^ (r % 8) of the row (Note above). `col` % 8 == 0 for
// the ldmatrix and staging addresses.
__device__ __forceinline__ int swz(int r, int col) { return r * kRow + ((((col >> 3) ^ (r & 7)) << 3) | (col & 7)); }

// Rows [0, n) of a [N, 64] operand into shared memory (swizzled rows), rows [n, rows) zeroed.
template <class T>
__device__ __forceinline__ void stage(T* sm, const Operand& t, int b, int h, int n, int rows) {
#pragma unroll 4
  for (int i = threadIdx.x; i < rows * (kD / 8); i += kThreads) {  // unrolled: loads in flight together
    const int r = i / (kD / 8), c = (i % (kD / 8)) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < n) v = *reinterpret_cast<const uint4*>(row_ptr<T>(t, b, h, r) + c);
    *reinterpret_cast<uint4*>(sm + swz(r, c)) = v;
  }
}

// Rows [0, n) of two [N, 64] operands of head (b, h), each padded to a multiple of 16 rows, one
// after the other from `sm`; returns where the second starts. The caller synchronizes.
template <class T>
__device__ __forceinline__ T* stage_two(T* sm, const Operand& x, const Operand& y, int b, int h, int n) {
  const int pad = (n + 15) / 16 * 16;
  stage<T>(sm, x, b, h, n, pad);
  stage<T>(sm + pad * kRow, y, b, h, n, pad);
  return sm + pad * kRow;
}

// The A fragments (16 rows x 64 dims, four k-steps of 16) of rows r0.. of an operand, from global
// memory; rows at or past n are zero. g = lane / 4, c = lane % 4.
template <class T>
__device__ __forceinline__ void load_a(uint32_t a[4][4], const Operand& t, int b, int h, int r0, int n, int g,
                                       int c) {
  const bool lo = r0 + g < n, hi = r0 + g + 8 < n;
  const T* p0 = lo ? row_ptr<T>(t, b, h, r0 + g) : nullptr;
  const T* p1 = hi ? row_ptr<T>(t, b, h, r0 + g + 8) : nullptr;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const int col = ks * 16 + 2 * c;
    a[ks][0] = lo ? *reinterpret_cast<const uint32_t*>(p0 + col) : 0u;
    a[ks][1] = hi ? *reinterpret_cast<const uint32_t*>(p1 + col) : 0u;
    a[ks][2] = lo ? *reinterpret_cast<const uint32_t*>(p0 + col + 8) : 0u;
    a[ks][3] = hi ? *reinterpret_cast<const uint32_t*>(p1 + col + 8) : 0u;
  }
}

// acc[8][4] (16 rows x 64 cols, C layout) += A (16 x 64 in four k-steps) . B^T where B is
// `rows`-major in shared memory: B rows n0..n0+63 are the 64 output columns, their 64 entries the
// k dim (S = Q K^T with B = K). Column tiles at or past `ncols` (a multiple of 16) are skipped.
template <class T>
__device__ __forceinline__ void mma_abt(float acc[8][4], const uint32_t a[4][4], const T* sm, int n0, int ncols,
                                        int lane) {
  const int mi = lane / 8, ri = lane % 8;
#pragma unroll
  for (int p = 0; p < 4; ++p) {  // pairs of 8-column tiles
    if (n0 + p * 16 >= ncols) break;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t r[4];
      ldsm4(r, sm + swz(n0 + p * 16 + (mi / 2) * 8 + ri, ks * 16 + (mi % 2) * 8));
      Mma<T>::run(acc[2 * p], a[ks], r[0], r[1]);
      Mma<T>::run(acc[2 * p + 1], a[ks], r[2], r[3]);
    }
  }
}

// acc[8][4] (16 rows x 64 dims) += P (16 x 64 chunk entries, C layout in p[8][4], converted to T)
// . B where B rows k0..k0+63 (the chunk) are in shared memory with the 64 dims as columns
// (O += P V with B = V). Row tiles at or past `nrows` (a multiple of 16) are skipped.
template <class T>
__device__ __forceinline__ void mma_pb(float acc[8][4], const float p[8][4], const T* sm, int k0, int nrows,
                                       int lane) {
  const int mi = lane / 8, ri = lane % 8;
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
    if (k0 + kt * 16 >= nrows) break;
    uint32_t a[4];
    a[0] = Mma<T>::pack(p[2 * kt][0], p[2 * kt][1]);
    a[1] = Mma<T>::pack(p[2 * kt][2], p[2 * kt][3]);
    a[2] = Mma<T>::pack(p[2 * kt + 1][0], p[2 * kt + 1][1]);
    a[3] = Mma<T>::pack(p[2 * kt + 1][2], p[2 * kt + 1][3]);
#pragma unroll
    for (int dp = 0; dp < 4; ++dp) {  // pairs of 8-dim tiles
      uint32_t r[4];
      ldsm4_t(r, sm + swz(k0 + kt * 16 + (mi % 2) * 8 + ri, dp * 16 + (mi / 2) * 8));
      Mma<T>::run(acc[2 * dp], a, r[0], r[1]);
      Mma<T>::run(acc[2 * dp + 1], a, r[2], r[3]);
    }
  }
}

// 2^x with the hardware approximation (ex2.approx: ~2 ulp, 2^-inf = 0), as flash kernels use for
// the softmax; exp2f without fast-math takes a slower exact path.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ void zero(float acc[8][4]) {
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
}

// Stores acc * mul (16 rows x 64 dims, C layout) to rows r0.. (< n) of an output operand.
template <class T>
__device__ __forceinline__ void store_rows(const Operand& t, int b, int h, int r0, int n, const float acc[8][4],
                                           float mul_lo, float mul_hi, int g, int c) {
  const bool lo = r0 + g < n, hi = r0 + g + 8 < n;
  T* p0 = lo ? row_ptr<T>(t, b, h, r0 + g) : nullptr;
  T* p1 = hi ? row_ptr<T>(t, b, h, r0 + g + 8) : nullptr;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int col = j * 8 + 2 * c;
    if (lo) *reinterpret_cast<uint32_t*>(p0 + col) = Mma<T>::pack(acc[j][0] * mul_lo, acc[j][1] * mul_lo);
    if (hi) *reinterpret_cast<uint32_t*>(p1 + col) = Mma<T>::pack(acc[j][2] * mul_hi, acc[j][3] * mul_hi);
  }
}

// Adds the column sums over rows [r0, r0 + 16) (< n) of acc * mul (16 x 64, C layout) into
// sm[64]: a sum over the warp's eight row groups (shfl_xor 4, 8, 16 keep the column pair c), then
// one shared-memory add per column from lanes 0..3. For the bias gradient of a projection that
// produced q, k and v (Note [Gradient row sums] in src/autograd/node.cpp).
__device__ __forceinline__ void add_column_sums(float* sm, const float acc[8][4], float mul, int r0, int n, int g,
                                                int lane) {
  const bool lo = r0 + g < n, hi = r0 + g + 8 < n;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = (lo ? acc[j][e] : 0.f) + (hi ? acc[j][2 + e] : 0.f);
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (lane < 4) atomicAdd(sm + j * 8 + 2 * lane + e, v * mul);
    }
  }
}

// Writes `count` column sums of this block's head from shared memory to its slots of P.colsum
// (after the block's last add_column_sums; synchronizes first).
__device__ __forceinline__ void store_column_sums(float* out, const float* sm, int count) {
  __syncthreads();
  for (int i = threadIdx.x; i < count; i += kThreads) out[i] = sm[i];
}

// ---- forward ----

template <class T>
__global__ void __launch_bounds__(kThreads, 4) forward_kernel(Params P) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int b = blockIdx.x / P.heads, h = blockIdx.x % P.heads, spad = (P.S + 15) / 16 * 16;
  T* ks = reinterpret_cast<T*>(smem_raw);
  const T* vs = stage_two<T>(ks, P.k, P.v, b, h, P.S);
  __syncthreads();

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = lane % 4;
  const int tiles = (P.L + 15) / 16;
  for (int tile = warp; tile < tiles; tile += kWarps) {
    const int r0 = tile * 16;
    uint32_t qa[4][4];
    load_a<T>(qa, P.q, b, h, r0, P.L, g, c);
    float o[8][4];
    zero(o);
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;  // log2 domain
    for (int k0 = 0; k0 < spad; k0 += kChunk) {
      float s[8][4];
      zero(s);
      mma_abt<T>(s, qa, ks, k0, spad, lane);
      float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool valid = k0 + j * 8 + 2 * c + e < P.S;
          s[j][e] = valid ? s[j][e] * P.scale_log2 : -INFINITY;
          s[j][2 + e] = valid ? s[j][2 + e] * P.scale_log2 : -INFINITY;
          mx_lo = fmaxf(mx_lo, s[j][e]);
          mx_hi = fmaxf(mx_hi, s[j][2 + e]);
        }
      }
      const float mn_lo = fmaxf(m_lo, quad_max(mx_lo)), mn_hi = fmaxf(m_hi, quad_max(mx_hi));
      const float al_lo = fast_exp2(m_lo - mn_lo), al_hi = fast_exp2(m_hi - mn_hi);  // 0 on the first chunk
      m_lo = mn_lo;
      m_hi = mn_hi;
      float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[j][e] = fast_exp2(s[j][e] - mn_lo);
          s[j][2 + e] = fast_exp2(s[j][2 + e] - mn_hi);
          sum_lo += s[j][e];
          sum_hi += s[j][2 + e];
        }
        o[j][0] *= al_lo;
        o[j][1] *= al_lo;
        o[j][2] *= al_hi;
        o[j][3] *= al_hi;
      }
      l_lo = l_lo * al_lo + sum_lo;
      l_hi = l_hi * al_hi + sum_hi;
      mma_pb<T>(o, s, vs, k0, spad, lane);
    }
    l_lo = quad_sum(l_lo);
    l_hi = quad_sum(l_hi);
    store_rows<T>(P.out, b, h, r0, P.L, o, 1.f / l_lo, 1.f / l_hi, g, c);
    if (c == 0) {
      float* st = P.stats + (static_cast<int64_t>(b) * P.heads + h) * P.L;
      if (r0 + g < P.L) st[r0 + g] = m_lo * kLn2 + logf(l_lo);
      if (r0 + g + 8 < P.L) st[r0 + g + 8] = m_hi * kLn2 + logf(l_hi);
    }
  }
}

// ---- backward: dQ ----

template <class T>
__global__ void __launch_bounds__(kThreads, 3) backward_dq_kernel(Params P) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int b = blockIdx.x / P.heads, h = blockIdx.x % P.heads, spad = (P.S + 15) / 16 * 16;
  T* ks = reinterpret_cast<T*>(smem_raw);
  const T* vs = stage_two<T>(ks, P.k, P.v, b, h, P.S);
  float* sums = reinterpret_cast<float*>(ks + 2 * spad * kRow);  // dq's column sums (P.colsum)
  if (P.colsum != nullptr && threadIdx.x < kD) sums[threadIdx.x] = 0.f;
  __syncthreads();

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = lane % 4;
  const int tiles = (P.L + 15) / 16;
  const float* st = P.stats + (static_cast<int64_t>(b) * P.heads + h) * P.L;
  for (int tile = warp; tile < tiles; tile += kWarps) {
    const int r0 = tile * 16;
    uint32_t qa[4][4], da[4][4], oa[4][4];
    load_a<T>(qa, P.q, b, h, r0, P.L, g, c);
    load_a<T>(da, P.dout, b, h, r0, P.L, g, c);
    load_a<T>(oa, P.o, b, h, r0, P.L, g, c);
    // D = rowsum(dO * O) for rows g and g + 8, from the fragments each lane holds.
    float d_lo = 0.f, d_hi = 0.f;
#pragma unroll
    for (int ks2 = 0; ks2 < 4; ++ks2) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 x = Mma<T>::unpack(da[ks2][i]), y = Mma<T>::unpack(oa[ks2][i]);
        const float d = x.x * y.x + x.y * y.y;
        if (i % 2 == 0) d_lo += d; else d_hi += d;
      }
    }
    d_lo = quad_sum(d_lo);
    d_hi = quad_sum(d_hi);
    if (c == 0) {  // for the dK/dV kernel, which runs next on the stream
      float* dr = P.drow + (static_cast<int64_t>(b) * P.heads + h) * P.L;
      if (r0 + g < P.L) dr[r0 + g] = d_lo;
      if (r0 + g + 8 < P.L) dr[r0 + g + 8] = d_hi;
    }
    const float lse_lo = r0 + g < P.L ? st[r0 + g] * kLog2e : INFINITY;
    const float lse_hi = r0 + g + 8 < P.L ? st[r0 + g + 8] * kLog2e : INFINITY;
    float dq[8][4];
    zero(dq);
    for (int k0 = 0; k0 < spad; k0 += kChunk) {
      float s[8][4], dp[8][4];
      zero(s);
      zero(dp);
      mma_abt<T>(s, qa, ks, k0, spad, lane);
      mma_abt<T>(dp, da, vs, k0, spad, lane);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool valid = k0 + j * 8 + 2 * c + e < P.S;
          const float p_lo = valid ? fast_exp2(s[j][e] * P.scale_log2 - lse_lo) : 0.f;
          const float p_hi = valid ? fast_exp2(s[j][2 + e] * P.scale_log2 - lse_hi) : 0.f;
          s[j][e] = p_lo * (dp[j][e] - d_lo);  // dS
          s[j][2 + e] = p_hi * (dp[j][2 + e] - d_hi);
        }
      }
      mma_pb<T>(dq, s, ks, k0, spad, lane);
    }
    store_rows<T>(P.dq, b, h, r0, P.L, dq, P.scale, P.scale, g, c);
    if (P.colsum != nullptr) add_column_sums(sums, dq, P.scale, r0, P.L, g, lane);
  }
  if (P.colsum != nullptr) store_column_sums(P.colsum + static_cast<int64_t>(blockIdx.x) * 3 * kD, sums, kD);
}

// ---- backward: dK and dV ----

template <class T>
__global__ void __launch_bounds__(kThreads, 2) backward_dkv_kernel(Params P) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int b = blockIdx.x / P.heads, h = blockIdx.x % P.heads, lpad = (P.L + 15) / 16 * 16;
  T* qs = reinterpret_cast<T*>(smem_raw);
  T* dos = stage_two<T>(qs, P.q, P.dout, b, h, P.L);
  float* lse = reinterpret_cast<float*>(dos + lpad * kRow);  // log2 domain; +inf past L
  float* dd = lse + lpad;                                      // D = rowsum(dO * O); 0 past L
  float* sums = dd + lpad;  // dk's then dv's column sums (P.colsum)
  if (P.colsum != nullptr && threadIdx.x < 2 * kD) sums[threadIdx.x] = 0.f;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = lane % 4;
  const float* st = P.stats + (static_cast<int64_t>(b) * P.heads + h) * P.L;
  const float* dr = P.drow + (static_cast<int64_t>(b) * P.heads + h) * P.L;  // the dQ kernel's D
  for (int r = threadIdx.x; r < lpad; r += kThreads) {
    lse[r] = r < P.L ? st[r] * kLog2e : INFINITY;
    dd[r] = r < P.L ? dr[r] : 0.f;
  }
  __syncthreads();

  const int tiles = (P.S + 15) / 16;
  for (int tile = warp; tile < tiles; tile += kWarps) {
    const int r0 = tile * 16;  // this warp's 16 keys
    uint32_t ka[4][4], va[4][4];
    load_a<T>(ka, P.k, b, h, r0, P.S, g, c);
    load_a<T>(va, P.v, b, h, r0, P.S, g, c);
    float dk[8][4], dv[8][4];
    zero(dk);
    zero(dv);
    for (int q0 = 0; q0 < lpad; q0 += kChunk) {
      float s[8][4], dp[8][4];  // transposed: rows are keys, columns queries
      zero(s);
      zero(dp);
      mma_abt<T>(s, ka, qs, q0, lpad, lane);
      mma_abt<T>(dp, va, dos, q0, lpad, lane);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = q0 + j * 8 + 2 * c + e;
          const float lq = col < lpad ? lse[col] : INFINITY;
          const float dcol = col < lpad ? dd[col] : 0.f;
          const float p_lo = fast_exp2(s[j][e] * P.scale_log2 - lq);
          const float p_hi = fast_exp2(s[j][2 + e] * P.scale_log2 - lq);
          s[j][e] = p_lo;
          s[j][2 + e] = p_hi;
          dp[j][e] = p_lo * (dp[j][e] - dcol);  // dS^T
          dp[j][2 + e] = p_hi * (dp[j][2 + e] - dcol);
        }
      }
      mma_pb<T>(dv, s, dos, q0, lpad, lane);
      mma_pb<T>(dk, dp, qs, q0, lpad, lane);
    }
    store_rows<T>(P.dk, b, h, r0, P.S, dk, P.scale, P.scale, g, c);
    store_rows<T>(P.dv, b, h, r0, P.S, dv, 1.f, 1.f, g, c);
    if (P.colsum != nullptr) {
      add_column_sums(sums, dk, P.scale, r0, P.S, g, lane);
      add_column_sums(sums + kD, dv, 1.f, r0, P.S, g, lane);
    }
  }
  if (P.colsum != nullptr) store_column_sums(P.colsum + static_cast<int64_t>(blockIdx.x) * 3 * kD + kD, sums, 2 * kD);
}

bool aligned(const Tensor& t) {
  if (t.dim() != 4 || t.stride(3) != 1 || t.size(3) != kD) return false;
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) return false;
  return true;
}

Params params(const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  Params p{};
  p.q = operand(q);
  p.k = operand(k);
  p.v = operand(v);
  p.heads = static_cast<int>(q.size(1));
  p.L = static_cast<int>(q.size(2));
  p.S = static_cast<int>(k.size(2));
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  return p;
}

// Two staged operands, the dK/dV kernel's logsumexp and D rows, and the column sums.
int smem_bytes(int rows, bool with_stats) {
  const int pad = (rows + 15) / 16 * 16;
  return 2 * pad * kRow * 2 + (with_stats ? 2 * pad * static_cast<int>(sizeof(float)) : 0) +
         2 * kD * static_cast<int>(sizeof(float));
}

// out[w * H * 64 + h * 64 + d] = sum over batches b of partial[((b * H + h) * 3 + w) * 64 + d]:
// the column sums of dq (w = 0), dk and dv over all rows, in the (3, H, D) order of a qkv
// projection's output columns.
__global__ void reduce_column_sums(const float* partial, float* out, int batch, int heads) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 3 * heads * kD) return;
  const int w = i / (heads * kD), h = (i / kD) % heads, d = i % kD;
  float acc = 0.f;
#pragma unroll 8
  for (int b = 0; b < batch; ++b) acc += partial[((static_cast<int64_t>(b) * heads + h) * 3 + w) * kD + d];
  out[i] = acc;
}

// Above 48 KB a kernel needs its dynamic shared-memory limit raised, once per device (not per
// call: the first call may be inside a graph capture). Raised to the largest size any call uses.
template <auto Kernel>
void launch(const Params& p, int grid, int smem, cudaStream_t stream) {
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> raised[kMaxDevices];  // per kernel (a template argument)
  int device = 0;
  FLAME_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= kMaxDevices || !raised[device].load(std::memory_order_acquire)) {
    FLAME_CUDA_CHECK(
        cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes(kMaxSeq, true)));
    if (device < kMaxDevices) raised[device].store(true, std::memory_order_release);
  }
  Kernel<<<grid, kThreads, smem, stream>>>(p);
  FLAME_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool supports(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias, bool causal,
              std::initializer_list<const Tensor*> more) {
  if (bias.defined() || causal) return false;
  if (q.dtype() != DType::bf16 && q.dtype() != DType::f16) return false;
  if (!aligned(q) || !aligned(k) || !aligned(v)) return false;
  if (q.size(2) > kMaxSeq || k.size(2) > kMaxSeq || q.size(2) < 1 || k.size(2) < 1) return false;
  if (q.size(0) * q.size(1) > int64_t{1} << 30) return false;
  for (const Tensor* t : more)
    if (!aligned(*t)) return false;
  return true;
}

void forward(const Tensor& out, const Tensor& stats, const Tensor& q, const Tensor& k, const Tensor& v, double scale,
             void* stream) {
  Params p = params(q, k, v, scale);
  p.out = operand(out);
  p.stats = static_cast<float*>(stats.data_ptr());
  const int grid = static_cast<int>(q.size(0) * q.size(1));
  const int smem = smem_bytes(p.S, false);
  auto s = static_cast<cudaStream_t>(stream);
  if (q.dtype() == DType::bf16)
    launch<forward_kernel<__nv_bfloat16>>(p, grid, smem, s);
  else
    launch<forward_kernel<__half>>(p, grid, smem, s);
}

void backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& q, const Tensor& k, const Tensor& v,
              const Tensor& out, const Tensor& dout, const Tensor& stats, double scale, void* stream,
              Tensor* column_sums) {
  Params p = params(q, k, v, scale);
  p.o = operand(out);
  p.dout = operand(dout);
  p.dq = operand(dq);
  p.dk = operand(dk);
  p.dv = operand(dv);
  p.stats = static_cast<float*>(stats.data_ptr());
  const int grid = static_cast<int>(q.size(0) * q.size(1));
  auto s = static_cast<cudaStream_t>(stream);
  const Tensor drow = Tensor::empty({q.size(0) * q.size(1) * q.size(2)}, {DType::f32, q.device()});
  p.drow = static_cast<float*>(drow.data_ptr());
  Tensor partial;
  if (column_sums != nullptr) {
    partial = Tensor::empty({q.size(0) * q.size(1) * 3 * kD}, {DType::f32, q.device()});
    p.colsum = static_cast<float*>(partial.data_ptr());
  }
  if (q.dtype() == DType::bf16) {
    launch<backward_dq_kernel<__nv_bfloat16>>(p, grid, smem_bytes(p.S, false), s);
    launch<backward_dkv_kernel<__nv_bfloat16>>(p, grid, smem_bytes(p.L, true), s);
  } else {
    launch<backward_dq_kernel<__half>>(p, grid, smem_bytes(p.S, false), s);
    launch<backward_dkv_kernel<__half>>(p, grid, smem_bytes(p.L, true), s);
  }
  if (column_sums != nullptr) {
    *column_sums = Tensor::empty({3 * p.heads * kD}, {DType::f32, q.device()});
    const int n = 3 * p.heads * kD;
    reduce_column_sums<<<(n + kThreads - 1) / kThreads, kThreads, 0, s>>>(
        p.colsum, static_cast<float*>(column_sums->data_ptr()), static_cast<int>(q.size(0)), p.heads);
    FLAME_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace flame::backend::cuda::sdpa_short
