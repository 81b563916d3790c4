// Note [Tiled copy]
// A copy whose source and destination have their unit strides on different dims (t().contiguous(),
// permute(0, 1, 3, 2).contiguous(), a copy into a transposed view, with or without a dtype
// conversion) cannot be coalesced on both sides by the elementwise kernels: one side is read or
// written with a large stride, and only a quarter of the copy bandwidth is reached. Here the two
// dims are cut into 64 x 64 tiles (256 threads, 16 elements each): a block reads a tile along the
// source's unit-stride dim into shared memory, then writes it along the destination's unit-stride
// dim, so both sides are coalesced. Every other dim is a batch dim on the grid's z. The tile row
// has one pad element so that column reads of the tile avoid shared-memory bank conflicts. Index
// math is 32-bit when every offset fits. Used when both tiled dims have at least kMinSide
// elements (below that most of a tile would be idle); otherwise the copy goes to the elementwise
// kernels. Measured on H200 ([8192, 8192] f32): a grid-stride loop over tiles with 64-bit
// divisions per tile reached 65% of the device-to-device copy rate, one tile per block ~88%.
// Same-dtype copies of 2-byte types move element pairs as 32-bit words when sizes, strides and
// pointers allow (tiled_copy_pairs_kernel), and those of 1-byte types 4 x 4 squares of bytes
// (tiled_copy_quads_kernel).
#include <cstring>

#include "src/backend/cuda/elementwise.cuh"

namespace flame::backend::cuda {
namespace ew {
namespace {

constexpr int kTile = 64;
constexpr int kWarp = 32;
constexpr int kTileRows = 8;  // threads per block: kWarp x kTileRows, each moving kTile^2/256 elements
constexpr int64_t kMinSide = 16;

// Dims (after coalescing) of a tiled copy: A is the destination's unit-stride dim, B the source's.
template <class Index>
struct TileGeom {
  Index size_a, size_b;
  Index src_stride_a;  // the source's stride along A (its stride along B is 1)
  Index dst_stride_b;  // the destination's stride along B (its stride along A is 1)
  int64_t batch;       // product of the batch dims
  int nbatch;          // batch dims, innermost first
  int64_t batch_sizes[kMaxDims];
  Index batch_src[kMaxDims];
  Index batch_dst[kMaxDims];
};

// Element offsets of batch index z in the source and the destination.
template <class Index>
__device__ __forceinline__ void batch_offsets(const TileGeom<Index>& g, int64_t z, Index& src_off, Index& dst_off) {
  if (g.nbatch == 1) {  // no division for the common case
    src_off = static_cast<Index>(z) * g.batch_src[0];
    dst_off = static_cast<Index>(z) * g.batch_dst[0];
    return;
  }
  src_off = dst_off = 0;
  for (int d = 0; d < g.nbatch; ++d) {
    const int64_t r = z % g.batch_sizes[d];
    z /= g.batch_sizes[d];
    src_off += static_cast<Index>(r) * g.batch_src[d];
    dst_off += static_cast<Index>(r) * g.batch_dst[d];
  }
}

// One 64 x 64 tile per block and grid step: blockIdx.x runs over tiles along A, blockIdx.y
// along B, blockIdx.z over the batch, so no division is needed to find a tile (64-bit divisions
// per tile cost a quarter of the bandwidth), and the batch offset needs them only when more than
// one batch dim is left after coalescing.
template <class D, class S, class Index>
__global__ void __launch_bounds__(kWarp* kTileRows)
    tiled_copy_kernel(D* __restrict__ dst, const S* __restrict__ src, const __grid_constant__ TileGeom<Index> g) {
  using Bits = bits_t<S>;  // half types have constructors, which __shared__ arrays may not
  __shared__ Bits tile[kTile][kTile + 1];  // tile[a][b]
  const Bits* __restrict__ src_bits = reinterpret_cast<const Bits*>(src);
  const int tx = threadIdx.x % kWarp, ty = threadIdx.x / kWarp;
  const Index a0 = static_cast<Index>(blockIdx.x) * kTile;
  for (int64_t z = blockIdx.z; z < g.batch; z += gridDim.z) {
    Index src_off, dst_off;
    batch_offsets(g, z, src_off, dst_off);
    for (Index b0 = static_cast<Index>(blockIdx.y) * kTile; b0 < g.size_b; b0 += static_cast<Index>(gridDim.y) * kTile) {
      // Read along B (the source's unit stride): consecutive threads, consecutive addresses.
#pragma unroll
      for (int r = ty; r < kTile; r += kTileRows) {
        const Index a = a0 + r;
#pragma unroll
        for (int c = tx; c < kTile; c += kWarp) {
          const Index b = b0 + c;
          if (a < g.size_a && b < g.size_b) tile[r][c] = src_bits[src_off + a * g.src_stride_a + b];
        }
      }
      __syncthreads();
      // Write along A (the destination's unit stride).
#pragma unroll
      for (int r = ty; r < kTile; r += kTileRows) {
        const Index b = b0 + r;
#pragma unroll
        for (int c = tx; c < kTile; c += kWarp) {
          const Index a = a0 + c;
          if (a < g.size_a && b < g.size_b) {
            S v;
            memcpy(&v, &tile[c][r], sizeof(S));
            dst[dst_off + b * g.dst_stride_b + a] = dconvert<D>(v);
          }
        }
      }
      __syncthreads();  // the tile is rewritten by the next iteration
    }
  }
}

// The same for 2-byte elements copied as they are, moved in pairs: a thread reads two
// neighbours along B and writes two neighbours along A as one 32-bit word each, half the memory
// instructions. Measured on H200 ([16384, 8192] bf16): 64% of the copy rate element by element,
// 67% in pairs; the 2-byte tiles hold half the bytes of f32 ones (88%), so fewer bytes are in
// flight per SM. Needs even sizes along A and B, even strides and 4-byte aligned pointers
// (words_fit).
template <class Index>
__global__ void __launch_bounds__(kWarp* kTileRows)
    tiled_copy_pairs_kernel(uint16_t* __restrict__ dst, const uint16_t* __restrict__ src,
                            const __grid_constant__ TileGeom<Index> g) {
  constexpr int kPitch = kTile + 2;  // even, so that a row's pairs stay 4-byte aligned
  __shared__ uint16_t tile[kTile][kPitch];  // tile[a][b]
  const int tx = threadIdx.x % kWarp, ty = threadIdx.x / kWarp;
  const Index a0 = static_cast<Index>(blockIdx.x) * kTile;
  const uint32_t* __restrict__ src32 = reinterpret_cast<const uint32_t*>(src);
  uint32_t* __restrict__ dst32 = reinterpret_cast<uint32_t*>(dst);
  for (int64_t z = blockIdx.z; z < g.batch; z += gridDim.z) {
    Index src_off, dst_off;
    batch_offsets(g, z, src_off, dst_off);
    for (Index b0 = static_cast<Index>(blockIdx.y) * kTile; b0 < g.size_b; b0 += static_cast<Index>(gridDim.y) * kTile) {
      const Index b_pair = b0 + 2 * tx;  // this thread's pair along B: b_pair, b_pair + 1
#pragma unroll
      for (int r = ty; r < kTile; r += kTileRows) {
        const Index a = a0 + r;
        if (a < g.size_a && b_pair < g.size_b) {
          *reinterpret_cast<uint32_t*>(&tile[r][2 * tx]) = src32[(src_off + a * g.src_stride_a + b_pair) >> 1];
        }
      }
      __syncthreads();
      const Index a_pair = a0 + 2 * tx;  // this thread's pair along A
#pragma unroll
      for (int r = ty; r < kTile; r += kTileRows) {
        const Index b = b0 + r;
        if (a_pair < g.size_a && b < g.size_b) {
          const uint32_t lo = tile[2 * tx][r], hi = tile[2 * tx + 1][r];
          dst32[(dst_off + b * g.dst_stride_b + a_pair) >> 1] = lo | (hi << 16);
        }
      }
      __syncthreads();
    }
  }
}

// The same for 1-byte elements copied as they are (the FP8 weights' transposes, Note [FP8 GEMM
// layout]), moved as 32-bit words: the tile is read along B four bytes at a time into one shared
// tile, each thread turns one 4 x 4 square of bytes around in registers (four words in, four
// byte permutes, four words out) into a second tile laid out along A, and that one is written
// four bytes at a time. Element by element, a 1-byte tile moves a quarter of the bytes of an f32
// one per instruction. Needs sizes along A and B that are multiples of 4, every other stride a
// multiple of 4 and 4-byte aligned pointers (words_fit). The input tile's pitch (20 words) puts the
// two tile rows a warp reads per square on different banks; the output tile's (17) leaves its
// writes at most two-way conflicted.
template <class Index>
__global__ void __launch_bounds__(kWarp* kTileRows)
    tiled_copy_quads_kernel(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src,
                            const __grid_constant__ TileGeom<Index> g) {
  constexpr int kWords = kTile / 4;        // words per tile row
  constexpr int kRows = kWarp * kTileRows / kWords;  // tile rows one pass of the block covers
  static_assert(kRows * 4 == kTile, "one 4 x 4 square per thread");
  __shared__ uint32_t in[kTile][kWords + 4];   // in[a][word along B]
  __shared__ uint32_t out[kTile][kWords + 1];  // out[b][word along A]
  const int col = static_cast<int>(threadIdx.x) % kWords, row = static_cast<int>(threadIdx.x) / kWords;
  const Index a0 = static_cast<Index>(blockIdx.x) * kTile;
  const uint32_t* __restrict__ src32 = reinterpret_cast<const uint32_t*>(src);
  uint32_t* __restrict__ dst32 = reinterpret_cast<uint32_t*>(dst);
  for (int64_t z = blockIdx.z; z < g.batch; z += gridDim.z) {
    Index src_off, dst_off;
    batch_offsets(g, z, src_off, dst_off);
    for (Index b0 = static_cast<Index>(blockIdx.y) * kTile; b0 < g.size_b; b0 += static_cast<Index>(gridDim.y) * kTile) {
      const Index b_word = b0 + 4 * col;
#pragma unroll
      for (int r = row; r < kTile; r += kRows) {
        const Index a = a0 + r;
        if (a < g.size_a && b_word < g.size_b) in[r][col] = src32[(src_off + a * g.src_stride_a + b_word) >> 2];
      }
      __syncthreads();
      {  // the square of tile rows 4 row .. 4 row + 3 (along A) and bytes 4 col .. 4 col + 3 (along B)
        const uint32_t w0 = in[4 * row][col], w1 = in[4 * row + 1][col], w2 = in[4 * row + 2][col],
                       w3 = in[4 * row + 3][col];
        const uint32_t t0 = __byte_perm(w0, w1, 0x5140), t1 = __byte_perm(w0, w1, 0x7362);  // byte c of w0, w1
        const uint32_t t2 = __byte_perm(w2, w3, 0x5140), t3 = __byte_perm(w2, w3, 0x7362);  // byte c of w2, w3
        out[4 * col][row] = __byte_perm(t0, t2, 0x5410);
        out[4 * col + 1][row] = __byte_perm(t0, t2, 0x7632);
        out[4 * col + 2][row] = __byte_perm(t1, t3, 0x5410);
        out[4 * col + 3][row] = __byte_perm(t1, t3, 0x7632);
      }
      __syncthreads();
      const Index a_word = a0 + 4 * col;
#pragma unroll
      for (int r = row; r < kTile; r += kRows) {
        const Index b = b0 + r;
        if (a_word < g.size_a && b < g.size_b) dst32[(dst_off + b * g.dst_stride_b + a_word) >> 2] = out[r][col];
      }
      __syncthreads();  // both tiles are rewritten by the next iteration
    }
  }
}

// Where the tiled dims A and B are in the coalesced geometry of dst <- src, or false when the
// copy is not a transpose worth tiling.
bool find_tiled_dims(const Geometry<2>& g, int& a, int& b) {
  if (g.ndim < 2) return false;
  a = b = -1;
  for (int d = 0; d < g.ndim; ++d) {
    if (g.strides[0][d] == 1 && a < 0) a = d;
    if (g.strides[1][d] == 1 && b < 0) b = d;
  }
  return a >= 0 && b >= 0 && a != b && g.sizes[a] >= kMinSide && g.sizes[b] >= kMinSide;
}

template <class Index>
TileGeom<Index> tile_geometry(const Geometry<2>& g, int a, int b) {
  TileGeom<Index> out{};
  out.size_a = static_cast<Index>(g.sizes[a]);
  out.size_b = static_cast<Index>(g.sizes[b]);
  out.src_stride_a = static_cast<Index>(g.strides[1][a]);
  out.dst_stride_b = static_cast<Index>(g.strides[0][b]);
  out.batch = 1;
  for (int d = g.ndim - 1; d >= 0; --d) {  // innermost first
    if (d == a || d == b) continue;
    out.batch_sizes[out.nbatch] = g.sizes[d];
    out.batch_src[out.nbatch] = static_cast<Index>(g.strides[1][d]);
    out.batch_dst[out.nbatch] = static_cast<Index>(g.strides[0][d]);
    out.batch *= g.sizes[d];
    ++out.nbatch;
  }
  return out;
}

// Whether a same-dtype copy of 1- or 2-byte elements can move 32-bit words of n = 4 / size
// elements (pairs, or 4 x 4 squares of bytes): sizes along A and B multiples of n, every stride but
// the unit ones a multiple of n (so each word starts 4-byte aligned) and both pointers 4-byte
// aligned.
bool words_fit(const Tensor& dst, const Tensor& src, const Geometry<2>& geo, int a, int b, int64_t n) {
  if (geo.sizes[a] % n != 0 || geo.sizes[b] % n != 0) return false;
  if (reinterpret_cast<uintptr_t>(dst.data_ptr()) % 4 != 0 || reinterpret_cast<uintptr_t>(src.data_ptr()) % 4 != 0)
    return false;
  for (int d = 0; d < geo.ndim; ++d) {
    if (d != a && geo.strides[0][d] % n != 0) return false;
    if (d != b && geo.strides[1][d] % n != 0) return false;
  }
  return true;
}

// One of the word kernels above, with 32-bit index math where every offset fits.
template <class U>
void launch_words(CudaBackend& be, dim3 grid, U* d, const U* s, const Geometry<2>& geo, int64_t numel, int a, int b,
                  void (*k32)(U*, const U*, const TileGeom<int32_t>), void (*k64)(U*, const U*, const TileGeom<int64_t>)) {
  if (fits_int32<2>(geo, numel)) {
    k32<<<grid, kWarp * kTileRows, 0, be.stream()>>>(d, s, tile_geometry<int32_t>(geo, a, b));
  } else {
    k64<<<grid, kWarp * kTileRows, 0, be.stream()>>>(d, s, tile_geometry<int64_t>(geo, a, b));
  }
  FLAME_CUDA_CHECK_LAUNCH();
}

template <class D, class S>
void launch_tiled(CudaBackend& be, const Tensor& dst, const Tensor& src, const Geometry<2>& geo, int a, int b) {
  const int64_t tiles_a = (geo.sizes[a] + kTile - 1) / kTile;
  const int64_t tiles_b = (geo.sizes[b] + kTile - 1) / kTile;
  int64_t batch = 1;
  for (int d = 0; d < geo.ndim; ++d) batch *= (d == a || d == b) ? 1 : geo.sizes[d];
  const dim3 grid(static_cast<unsigned>(tiles_a), static_cast<unsigned>(std::min<int64_t>(tiles_b, 65535)),
                  static_cast<unsigned>(std::min<int64_t>(batch, 65535)));
  D* d = static_cast<D*>(dst.data_ptr());
  const S* s = static_cast<const S*>(src.data_ptr());
  if constexpr (std::is_same_v<D, S> && (std::is_same_v<D, uint16_t> || std::is_same_v<D, uint8_t>)) {
    if (words_fit(dst, src, geo, a, b, 4 / static_cast<int64_t>(sizeof(D)))) {
      if constexpr (sizeof(D) == 2) {
        launch_words<D>(be, grid, d, s, geo, dst.numel(), a, b, tiled_copy_pairs_kernel<int32_t>,
                        tiled_copy_pairs_kernel<int64_t>);
      } else {
        launch_words<D>(be, grid, d, s, geo, dst.numel(), a, b, tiled_copy_quads_kernel<int32_t>,
                        tiled_copy_quads_kernel<int64_t>);
      }
      return;
    }
  }
  if (fits_int32<2>(geo, dst.numel())) {
    tiled_copy_kernel<D, S, int32_t><<<grid, kWarp * kTileRows, 0, be.stream()>>>(d, s, tile_geometry<int32_t>(geo, a, b));
  } else {
    tiled_copy_kernel<D, S, int64_t><<<grid, kWarp * kTileRows, 0, be.stream()>>>(d, s, tile_geometry<int64_t>(geo, a, b));
  }
  FLAME_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool tiled_copy(CudaBackend& be, const Tensor& dst, const Tensor& src) {
  if (dst.dim() > kMaxDims || dst.numel() == 0) return false;
  // Fast exit for the common copy whose two sides both have unit stride on the innermost dim of
  // more than one element: that dim would be both A and B, so there is nothing to tile, and the
  // elementwise launcher coalesces the geometry itself.
  for (int64_t d = dst.dim() - 1; d >= 0; --d) {
    if (dst.sizes()[d] == 1) continue;
    if (dst.strides()[d] == 1 && src.strides()[d] == 1) return false;
    break;
  }
  const Geometry<2> geo = coalesce<2>({&dst, &src});
  int a = 0, b = 0;
  if (!find_tiled_dims(geo, a, b)) return false;
  // tiles along A go on the grid's x (up to 2^31 - 1); more than that many elements along one
  // dim (2^37) is left to the elementwise kernels.
  if ((geo.sizes[a] + kTile - 1) / kTile > INT32_MAX) return false;
  DeviceGuard guard(be.device());
  if (dst.dtype() == src.dtype()) {
    dispatch_by_size(dtype_size(dst.dtype()), "cuda copy", [&](auto tag) {
      using U = typename decltype(tag)::type;
      launch_tiled<U, U>(be, dst, src, geo, a, b);
    });
    return true;
  }
  // Casts to or from 8-bit floats take the elementwise kernels (Note [Float8 dtypes]).
  if (is_float8(dst.dtype()) || is_float8(src.dtype())) return false;
  dispatch_dtype(dst.dtype(), "cuda copy", [&](auto dtag) {
    using D = typename decltype(dtag)::type;
    dispatch_dtype(src.dtype(), "cuda copy", [&](auto stag) {
      using S = typename decltype(stag)::type;
      if constexpr (!std::is_same_v<D, S>) launch_tiled<D, S>(be, dst, src, geo, a, b);
    });
  });
  return true;
}

}  // namespace ew
}  // namespace flame::backend::cuda
