// The column-sum kernel of the epilogue GEMMs' bias gradients.
//
// Note [Epilogue column sum]
// db = the column sums of a gradient g [rows, cols] (bf16/f16/f32), for the weight-gradient GEMM
// run without cuBLASLt's BGRADB epilogue (which runs its own reduction kernel after the GEMM,
// at well under the copy bandwidth on an H100). Two stages, no atomics, so the result is the same
// bits on every call:
//  1. a grid of column strips x row ranges, sized to one wave of resident blocks. A thread owns
//     one 16-byte pack of columns (8 bf16) and walks its block's row range with a stride of the
//     block's row lanes, four independent 16-byte loads in flight per step, accumulating in f32
//     registers; the block adds its row lanes in shared memory in a fixed order and writes one
//     f32 partial row per row range.
//  2. a block of 8 columns x 64 lanes adds the partial rows of its columns in a fixed tree and
//     rounds once to the output dtype: the norms' column_sum_narrow_kernel with one output
//     (norm/norm_kernels.cuh).
// The geometry depends only on the shape, the dtype and the device's SM count and occupancy, so
// the order of additions (and the bits) is fixed within a process.
#include <algorithm>

#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/backend/cuda/epi/column_sum.h"
#include "src/backend/cuda/launch_geometry.cuh"
#include "src/backend/cuda/norm/norm_kernels.cuh"

namespace flame::backend::cuda {
namespace {

constexpr int kThreads = 256;

// Stage 1. Block (kTX packs, kThreads / kTX row lanes); blockIdx.x: column strip, blockIdx.y:
// row range [y * rows_per_part, ...). part [gridDim.y, cols] f32.
template <class T, int kTX>
__global__ void __launch_bounds__(kThreads)
    epi_colsum_partial_kernel(const T* __restrict__ g, float* __restrict__ part, int64_t rows, int64_t cols,
                              int64_t rows_per_part) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  constexpr int kTY = kThreads / kTX;
  __shared__ float sh[kTY * V][kTX + 1];  // [lane, element of the pack][pack]; +1: no bank conflicts
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t packs = cols / V;
  const int64_t pack = static_cast<int64_t>(blockIdx.x) * kTX + tx;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_part;
  const int64_t r1 = std::min<int64_t>(rows, r0 + rows_per_part);
  float acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.0f;
  if (pack < packs) {
    const uint4* base = reinterpret_cast<const uint4*>(g) + pack;  // row r's pack at base[r * packs]
    int64_t r = r0 + ty;
    for (; r + 3 * kTY < r1; r += 4 * kTY) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = __ldg(base + (r + u * kTY) * packs);
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += load_as<float>(vec_elem<T>(v[u], j));
    }
    for (; r < r1; r += kTY) {
      const uint4 v = __ldg(base + r * packs);
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += load_as<float>(vec_elem<T>(v, j));
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) sh[ty * V + j][tx] = acc[j];
  __syncthreads();
  // Output o of the strip: element j of pack p, j = o / kTX, p = o % kTX; the row lanes in order.
  for (int o = ty * kTX + tx; o < kTX * V; o += kThreads) {
    const int j = o / kTX, p = o % kTX;
    const int64_t pk = static_cast<int64_t>(blockIdx.x) * kTX + p;
    if (pk >= packs) continue;
    float s = 0.0f;
    for (int l = 0; l < kTY; ++l) s += sh[l * V + j][p];
    part[static_cast<int64_t>(blockIdx.y) * cols + pk * V + j] = s;
  }
}

template <class T, int kTX>
void launch_column_sum(CudaBackend& be, const T* g, int64_t rows, int64_t cols, void* out, bool out_f32) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  constexpr int kTY = kThreads / kTX;
  const auto kernel = &epi_colsum_partial_kernel<T, kTX>;
  static const int per_sm = [&] {  // asked once per instantiation
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      n = 0;
    }
    return std::max(n, 1);
  }();
  const int64_t packs = cols / V;
  const int64_t strips = ceil_div(packs, kTX);
  const int64_t resident = static_cast<int64_t>(sm_count(be.device())) * per_sm;
  // One wave of blocks; at least 4 row steps of kTY rows per block (no near-empty ranges), and
  // every range the same length (within the last).
  const int64_t max_parts = std::max<int64_t>(1, ceil_div(rows, 4 * kTY));
  int64_t parts = std::clamp<int64_t>(resident / strips, 1, std::min<int64_t>(max_parts, 65535));
  const int64_t rows_per_part = ceil_div(rows, parts);
  parts = ceil_div(rows, rows_per_part);
  const cudaStream_t st = be.stream();
  std::shared_ptr<void> part = be.allocate(static_cast<std::size_t>(parts * cols) * sizeof(float));  // stream-ordered
  auto* pp = static_cast<float*>(part.get());
  kernel<<<dim3(static_cast<unsigned>(strips), static_cast<unsigned>(parts)), dim3(kTX, kTY), 0, st>>>(
      g, pp, rows, cols, rows_per_part);
  FLAME_CUDA_CHECK_LAUNCH();
  // Stage 2: the norms' second stage in its one-output form (Note [Row backward second stage]).
  const dim3 grid2(static_cast<unsigned>(ceil_div(cols, 8))), block2(8, 64);
  if (out_f32)
    norm::column_sum_narrow_kernel<float, false>
        <<<grid2, block2, 0, st>>>(pp, nullptr, static_cast<float*>(out), nullptr, parts, cols);
  else
    norm::column_sum_narrow_kernel<T, false>
        <<<grid2, block2, 0, st>>>(pp, nullptr, static_cast<T*>(out), nullptr, parts, cols);
  FLAME_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool epi_column_sum_fits(DType dt, const void* g, int64_t cols, const void* out, DType out_dt) {
  if (dt != DType::bf16 && dt != DType::f16 && dt != DType::f32) return false;
  if (out_dt != dt && out_dt != DType::f32) return false;
  const int64_t v = 16 / static_cast<int64_t>(dtype_size(dt));
  return cols >= 1 && cols % v == 0 && (reinterpret_cast<uintptr_t>(g) & 15u) == 0 && out != nullptr;
}

void epi_column_sum(CudaBackend& be, DType dt, const void* g, int64_t rows, int64_t cols, void* out, DType out_dt) {
  FLAME_CHECK(epi_column_sum_fits(dt, g, cols, out, out_dt), "linear", "epilogue column sum: unsupported dtype/layout (",
              dtype_name(dt), " into ", dtype_name(out_dt), ", cols ", cols, ")");
  const bool out_f32 = out_dt != dt;
  if (rows <= 0 || cols <= 0) return;
  auto run = [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = 16 / static_cast<int>(sizeof(T));
    const int64_t packs = cols / V;
    const auto* gp = static_cast<const T*>(g);
    // The widest strip (32 packs = 512 contiguous bytes of a row) that divides the row's packs,
    // so that no lanes idle (384 bf16 columns: 48 packs, strips of 16); else the widest that fits.
    const int tx = packs % 32 == 0 ? 32 : packs % 16 == 0 ? 16 : packs % 8 == 0 ? 8 : packs > 16 ? 32 : packs > 8 ? 16 : 8;
    if (tx == 32) launch_column_sum<T, 32>(be, gp, rows, cols, out, out_f32);
    else if (tx == 16) launch_column_sum<T, 16>(be, gp, rows, cols, out, out_f32);
    else launch_column_sum<T, 8>(be, gp, rows, cols, out, out_f32);
  };
  switch (dt) {
    case DType::bf16: run(type_tag<bfloat16>{}); break;
    case DType::f16: run(type_tag<float16>{}); break;
    default: run(type_tag<float>{}); break;
  }
}

}  // namespace flame::backend::cuda
