// Note [Tiled copy]
// A copy whose source and destination have their unit strides on different dims (t().contiguous(),
// permute(0, 1, 3, 2).contiguous(), a copy into a transposed view, with or without a dtype
// conversion) cannot be coalesced on both sides by the elementwise kernels: one side is read or
// written with a large stride, and only a quarter of the copy bandwidth is reached. Here the two
// dims are tiled by kTile x kTile (64 x 64; 256 threads, 16 elements each): a block reads a tile along the source's unit-stride dim into
// shared memory, then writes it along the destination's unit-stride dim, so both sides are
// coalesced. Every other dim is a batch dim, decoded per tile. The tile row has one pad element
// so that column reads of the tile avoid shared-memory bank conflicts. Used when both tiled dims
// have at least kMinSide elements (below that most of a tile would be idle); otherwise the copy
// goes to the elementwise kernels.
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
struct TileGeom {
  int64_t size_a, size_b;
  int64_t src_stride_a;  // the source's stride along A (its stride along B is 1)
  int64_t dst_stride_b;  // the destination's stride along B (its stride along A is 1)
  int64_t tiles_a, tiles_b, tiles;
  int nbatch;                    // batch dims, innermost first
  int64_t batch_sizes[kMaxDims];
  int64_t batch_src[kMaxDims];
  int64_t batch_dst[kMaxDims];
};

template <class D, class S>
__global__ void __launch_bounds__(kWarp* kTileRows)
    tiled_copy_kernel(D* __restrict__ dst, const S* __restrict__ src, const __grid_constant__ TileGeom g) {
  using Bits = bits_t<S>;  // half types have constructors, which __shared__ arrays may not
  __shared__ Bits tile[kTile][kTile + 1];  // tile[a][b]
  const Bits* src_bits = reinterpret_cast<const Bits*>(src);
  const int tx = threadIdx.x % kWarp, ty = threadIdx.x / kWarp;
  for (int64_t t = blockIdx.x; t < g.tiles; t += gridDim.x) {
    int64_t q = t;
    const int64_t a0 = (q % g.tiles_a) * kTile;
    q /= g.tiles_a;
    const int64_t b0 = (q % g.tiles_b) * kTile;
    q /= g.tiles_b;
    int64_t src_off = 0, dst_off = 0;
    for (int d = 0; d < g.nbatch; ++d) {
      const int64_t r = q % g.batch_sizes[d];
      q /= g.batch_sizes[d];
      src_off += r * g.batch_src[d];
      dst_off += r * g.batch_dst[d];
    }
    // Read along B (the source's unit stride): consecutive threads, consecutive addresses. All
    // loads of a thread are issued before any is used, to keep many bytes in flight.
#pragma unroll
    for (int r = ty; r < kTile; r += kTileRows) {
      const int64_t a = a0 + r;
#pragma unroll
      for (int c = tx; c < kTile; c += kWarp) {
        const int64_t b = b0 + c;
        if (a < g.size_a && b < g.size_b) tile[r][c] = src_bits[src_off + a * g.src_stride_a + b];
      }
    }
    __syncthreads();
    // Write along A (the destination's unit stride).
#pragma unroll
    for (int r = ty; r < kTile; r += kTileRows) {
      const int64_t b = b0 + r;
#pragma unroll
      for (int c = tx; c < kTile; c += kWarp) {
        const int64_t a = a0 + c;
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

// The tiled geometry of dst <- src, or false when the copy is not a transpose worth tiling.
bool tile_geometry(const Tensor& dst, const Tensor& src, TileGeom& out) {
  if (dst.dim() > kMaxDims || dst.numel() == 0) return false;
  const Geometry<2> g = coalesce<2>({&dst, &src});
  if (g.ndim < 2) return false;
  int a = -1, b = -1;
  for (int d = 0; d < g.ndim; ++d) {
    if (g.strides[0][d] == 1 && a < 0) a = d;
    if (g.strides[1][d] == 1 && b < 0) b = d;
  }
  if (a < 0 || b < 0 || a == b || g.sizes[a] < kMinSide || g.sizes[b] < kMinSide) return false;
  out.size_a = g.sizes[a];
  out.size_b = g.sizes[b];
  out.src_stride_a = g.strides[1][a];
  out.dst_stride_b = g.strides[0][b];
  out.tiles_a = (out.size_a + kTile - 1) / kTile;
  out.tiles_b = (out.size_b + kTile - 1) / kTile;
  out.tiles = out.tiles_a * out.tiles_b;
  out.nbatch = 0;
  for (int d = g.ndim - 1; d >= 0; --d) {  // innermost first
    if (d == a || d == b) continue;
    out.batch_sizes[out.nbatch] = g.sizes[d];
    out.batch_src[out.nbatch] = g.strides[1][d];
    out.batch_dst[out.nbatch] = g.strides[0][d];
    out.tiles *= g.sizes[d];
    ++out.nbatch;
  }
  return true;
}

template <class D, class S>
void launch_tiled(CudaBackend& be, const Tensor& dst, const Tensor& src, const TileGeom& g) {
  // Enough blocks for every SM to hold several; the grid-stride loop covers the rest.
  const int64_t cap = static_cast<int64_t>(sm_count(be.device())) * 8;
  const unsigned int blocks = static_cast<unsigned int>(std::min<int64_t>(g.tiles, cap));
  tiled_copy_kernel<D, S><<<blocks, kWarp * kTileRows, 0, be.stream()>>>(
      static_cast<D*>(dst.data_ptr()), static_cast<const S*>(src.data_ptr()), g);
  FLAME_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool tiled_copy(CudaBackend& be, const Tensor& dst, const Tensor& src) {
  TileGeom g;
  if (!tile_geometry(dst, src, g)) return false;
  DeviceGuard guard(be.device());
  if (dst.dtype() == src.dtype()) {
    dispatch_bits(dst.dtype(), "cuda copy", [&](auto tag) {
      using U = typename decltype(tag)::type;
      launch_tiled<U, U>(be, dst, src, g);
    });
    return true;
  }
  dispatch_dtype(dst.dtype(), "cuda copy", [&](auto dtag) {
    using D = typename decltype(dtag)::type;
    dispatch_dtype(src.dtype(), "cuda copy", [&](auto stag) {
      using S = typename decltype(stag)::type;
      if constexpr (!std::is_same_v<D, S>) launch_tiled<D, S>(be, dst, src, g);
    });
  });
  return true;
}

}  // namespace ew
}  // namespace flame::backend::cuda
