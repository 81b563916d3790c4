#pragma once
// Launchers of the row kernels (layer_norm, rms_norm): configuration choice per row length
// (Note [CUDA norm kernels]). Included by norm_rows.cu (f32, f64) and norm_rows_half.cu (bf16, f16).
#include <algorithm>
#include <memory>

#include "src/backend/cuda/norm/norm_kernels.cuh"
#include "src/backend/cuda/norm/norm_rows_warp.cuh"

namespace flame::backend::cuda::norm {

struct RowsFwdArgs {
  int64_t rows, cols;
  double eps;
};

template <class T, int W, int kVPT, int kTPR, bool kRms>
void launch_rows_fwd(cudaStream_t st, const T* x, const T* w, const T* b, T* y, compute_t<T>* mean,
                     compute_t<T>* rstd, RowsFwdArgs a) {
  constexpr int kBlock = rows_block<kTPR>();
  rows_forward_kernel<T, W, kVPT, kTPR, kRms><<<grid_for(a.rows, kBlock / kTPR, 1 << 20), kBlock, 0, st>>>(
      x, w, b, y, mean, rstd, a.rows, a.cols, static_cast<compute_t<T>>(a.eps));
  FLAME_CUDA_CHECK_LAUNCH();
}

// The smallest register configuration holding a row in vectors of W (at most 32 values per
// thread); false when the row is too long.
template <class T, int W, bool kRms>
bool rows_fwd_dispatch(cudaStream_t st, const T* x, const T* w, const T* b, T* y, compute_t<T>* mean,
                       compute_t<T>* rstd, RowsFwdArgs a) {
  const int64_t nv = ceil_div(a.cols, W);
#define FLAME_NORM_FWD_CASE(VPT, TPR)                                              \
  if constexpr (VPT * W <= 32) {                                                  \
    if (nv <= int64_t(VPT) * TPR) {                                               \
      launch_rows_fwd<T, W, VPT, TPR, kRms>(st, x, w, b, y, mean, rstd, a);       \
      return true;                                                                \
    }                                                                             \
  }
  FLAME_NORM_FWD_CASE(1, 32)
  FLAME_NORM_FWD_CASE(2, 32)
  FLAME_NORM_FWD_CASE(4, 32)
  FLAME_NORM_FWD_CASE(8, 32)
  FLAME_NORM_FWD_CASE(4, 128)
  FLAME_NORM_FWD_CASE(4, 256)
  FLAME_NORM_FWD_CASE(4, 512)
  FLAME_NORM_FWD_CASE(4, 1024)
  FLAME_NORM_FWD_CASE(8, 1024)
#undef FLAME_NORM_FWD_CASE
  return false;
}

template <class T, bool kRms>
void rows_forward_typed(CudaBackend& be, const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                        const Tensor& w, const Tensor& b, double eps) {
  using A = compute_t<T>;
  const RowsFwdArgs a{rstd.numel(), x.numel() / rstd.numel(), eps};
  const T *xp = cptr<T>(x), *wp = cptr<T>(w), *bp = cptr<T>(b);
  T* yp = mptr<T>(y);
  A *mp = mptr<A>(mean), *rp = mptr<A>(rstd);
  cudaStream_t st = be.stream();
  constexpr int W = vec_width<T>();
  const bool vec = W > 1 && a.cols % W == 0 && aligned16(xp) && aligned16(wp) && aligned16(bp) && aligned16(yp);
  if (vec && rows_fwd_dispatch<T, W, kRms>(st, xp, wp, bp, yp, mp, rp, a)) return;
  if (!vec && rows_fwd_dispatch<T, 1, kRms>(st, xp, wp, bp, yp, mp, rp, a)) return;
  rows_forward_long_kernel<T, kRms><<<grid_for(a.rows, 1, 1 << 20), 1024, 0, st>>>(xp, wp, bp, yp, mp, rp, a.rows,
                                                                                   a.cols, static_cast<A>(eps));
  FLAME_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_norm_rows_forward(CudaBackend& be, const Tensor& y, const Tensor& mean, const Tensor& rstd,
                              const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  if (mean.defined()) rows_forward_typed<T, false>(be, y, mean, rstd, x, w, b, eps);
  else rows_forward_typed<T, true>(be, y, mean, rstd, x, w, b, eps);
}

// ---- backward ----

struct RowsBwdPtrs {
  int64_t rows, cols;
};

// Blocks resident per SM for a kernel: every block writes one partial row, so the grid is the
// machine's width, not the row count. The occupancy is the kernel's own (its registers decide it).
template <class K>
int rows_bwd_per_sm(K kernel, int block, std::size_t max_smem) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, block, max_smem) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; fall back to a full SM's threads
    n = 2048 / block;
  }
  return std::max(n, 1);
}

// The second stage: part [grid, cols] x 2 -> dw, db, as a programmatic dependent launch of the
// kernel that wrote the partial rows (Note [Row backward second stage]).
template <class T>
void launch_column_sums(cudaStream_t st, const compute_t<T>* pw, const compute_t<T>* pb, T* dw, T* db, int64_t parts,
                        int64_t cols) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid_for(cols, 8));
  cfg.blockDim = dim3(8, 64);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  FLAME_CUDA_CHECK(cudaLaunchKernelEx(&cfg, column_sum_narrow_kernel<T>, pw, pb, dw, db, parts, cols));
}

// The backward's grid and partial rows: every block writes one partial row, so the grid is the
// resident blocks (per_sm per SM), with every block the same number of row steps (within one: no
// last step run by a few blocks alone); part holds [grid, cols] x 2 partial sums when wanted.
template <class A>
struct RowsBwdGrid {
  int64_t grid = 1;
  std::shared_ptr<void> part;  // stream-ordered: freed after the kernels that use it have run
  A* pw = nullptr;
  A* pb = nullptr;
  RowsBwdGrid(CudaBackend& be, int64_t rows, int64_t rows_per_block, int per_sm, int64_t cols, bool params) {
    const int64_t resident = static_cast<int64_t>(sm_count(be.device())) * per_sm;
    const int64_t blocks = ceil_div(rows, rows_per_block);
    const int64_t steps = ceil_div(blocks, std::max<int64_t>(1, resident));
    grid = std::max<int64_t>(1, ceil_div(blocks, steps));
    if (params) {
      part = be.allocate(2 * static_cast<std::size_t>(grid * cols) * sizeof(A));
      pw = static_cast<A*>(part.get());
      pb = pw + grid * cols;
    }
  }
};

template <class T, int W, int kVPT, int kTPR, bool kRms>
void launch_rows_bwd(CudaBackend& be, const T* dy, const T* x, const compute_t<T>* mean, const compute_t<T>* rstd,
                     const T* w, T* dx, T* dw, T* db, int64_t rows, int64_t cols) {
  using A = compute_t<T>;
  constexpr int kBlock = rows_bwd_block<kTPR>();
  constexpr int kRowsPerBlock = kBlock / kTPR;
  const auto kernel = &rows_backward_kernel<T, W, kVPT, kTPR, kRms>;
  cudaStream_t st = be.stream();
  const bool params = dw != nullptr || db != nullptr;
  const std::size_t max_smem = kRowsPerBlock > 1 ? 2 * static_cast<std::size_t>(kVPT * kTPR * W) * sizeof(A) : 0;
  // Asked once per configuration, with the largest shared memory it may use.
  static const int per_sm = rows_bwd_per_sm(kernel, kBlock, max_smem);
  const RowsBwdGrid<A> g(be, rows, kRowsPerBlock, per_sm, cols, params);
  const std::size_t smem = (params && kRowsPerBlock > 1) ? 2 * static_cast<std::size_t>(cols) * sizeof(A) : 0;
  kernel<<<static_cast<unsigned>(g.grid), kBlock, smem, st>>>(dy, x, mean, rstd, w, dx, g.pw, g.pb, rows, cols);
  FLAME_CUDA_CHECK_LAUNCH();
  if (params) launch_column_sums<T>(st, g.pw, g.pb, dw, db, g.grid, cols);
}

// Note [Warp row backward]: a warp per row, 2-byte types, kVPT 16-byte vectors per lane.
template <class T, int kVPT, bool kRms>
void launch_rows_bwd_warp(CudaBackend& be, const T* dy, const T* x, const float* mean, const float* rstd, const T* w,
                          T* dx, T* dw, T* db, int64_t rows, int64_t cols) {
  const auto kernel = &rows_backward_warp_kernel<T, kVPT, kRms>;
  constexpr int kBlock = kWarpBwdWarps * 32;
  const std::size_t smem = warp_bwd_smem<kVPT>();
  cudaStream_t st = be.stream();
  static const int per_sm = [&] {
    FLAME_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    return rows_bwd_per_sm(kernel, kBlock, smem);
  }();
  const bool params = dw != nullptr || db != nullptr;
  const RowsBwdGrid<float> g(be, rows, kWarpBwdWarps, per_sm, cols, params);
  kernel<<<static_cast<unsigned>(g.grid), kBlock, params ? smem : 0, st>>>(dy, x, mean, rstd, w, dx, g.pw, g.pb, rows,
                                                                            cols);
  FLAME_CUDA_CHECK_LAUNCH();
  if (params) launch_column_sums<T>(st, g.pw, g.pb, dw, db, g.grid, cols);
}

// At most 8 values per thread (x, dy and two accumulators per value stay in registers).
template <class T, int W, bool kRms>
bool rows_bwd_dispatch(CudaBackend& be, const T* dy, const T* x, const compute_t<T>* mean, const compute_t<T>* rstd,
                       const T* w, T* dx, T* dw, T* db, int64_t rows, int64_t cols) {
  constexpr int VPT = W >= 8 ? 1 : 8 / W;
  const int64_t nv = ceil_div(cols, W);
  if constexpr (sizeof(T) == 2 && W == 8) {  // Note [Warp row backward]
    if (cols > 256 && cols <= 512) {
      launch_rows_bwd_warp<T, 2, kRms>(be, dy, x, mean, rstd, w, dx, dw, db, rows, cols);
      return true;
    }
    if (cols > 512 && cols <= 1024) {
      launch_rows_bwd_warp<T, 4, kRms>(be, dy, x, mean, rstd, w, dx, dw, db, rows, cols);
      return true;
    }
  }
#define FLAME_NORM_BWD_CASE(TPR)                                                               \
  if (nv <= int64_t(VPT) * TPR) {                                                             \
    launch_rows_bwd<T, W, VPT, TPR, kRms>(be, dy, x, mean, rstd, w, dx, dw, db, rows, cols);  \
    return true;                                                                              \
  }
  FLAME_NORM_BWD_CASE(32)
  FLAME_NORM_BWD_CASE(64)
  FLAME_NORM_BWD_CASE(128)
  FLAME_NORM_BWD_CASE(256)
  FLAME_NORM_BWD_CASE(512)
  FLAME_NORM_BWD_CASE(1024)
#undef FLAME_NORM_BWD_CASE
  return false;
}

template <class T, bool kRms>
void rows_backward_typed(CudaBackend& be, const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy,
                         const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& w) {
  using A = compute_t<T>;
  const int64_t rows = rstd.numel(), cols = x.numel() / rows;
  const T *dyp = cptr<T>(dy), *xp = cptr<T>(x), *wp = cptr<T>(w);
  const A *mp = cptr<A>(mean), *rp = cptr<A>(rstd);
  T *dxp = mptr<T>(dx), *dwp = mptr<T>(dw), *dbp = mptr<T>(db);
  constexpr int W = vec_width<T>();
  const bool vec = W > 1 && cols % W == 0 && aligned16(dyp) && aligned16(xp) && aligned16(wp) && aligned16(dxp);
  if (vec && rows_bwd_dispatch<T, W, kRms>(be, dyp, xp, mp, rp, wp, dxp, dwp, dbp, rows, cols)) return;
  if (!vec && rows_bwd_dispatch<T, 1, kRms>(be, dyp, xp, mp, rp, wp, dxp, dwp, dbp, rows, cols)) return;
  cudaStream_t st = be.stream();
  if (dxp) {
    rows_backward_long_kernel<T, kRms><<<grid_for(rows, 1, 1 << 20), 1024, 0, st>>>(dyp, xp, mp, rp, wp, dxp, rows,
                                                                                    cols);
    FLAME_CUDA_CHECK_LAUNCH();
  }
  if (dwp || dbp) {
    const int64_t chunks = std::min<int64_t>(ceil_div(rows, 64), 256);
    const int64_t per_chunk = ceil_div(rows, chunks);
    std::shared_ptr<void> part = be.allocate(2 * static_cast<std::size_t>(chunks * cols) * sizeof(A));
    A* pw = static_cast<A*>(part.get());
    A* pb = pw + chunks * cols;
    rows_param_grad_kernel<T, kRms><<<dim3(grid_for(cols, 32), static_cast<unsigned>(chunks)), dim3(32, 8), 0, st>>>(
        dyp, xp, mp, rp, pw, pb, rows, cols, per_chunk);
    FLAME_CUDA_CHECK_LAUNCH();
    column_sum_kernel<T><<<grid_for(cols, 32), dim3(32, 16), 0, st>>>(pw, pb, dwp, dbp, chunks, cols);
    FLAME_CUDA_CHECK_LAUNCH();
  }
}

template <class T>
void launch_norm_rows_backward(CudaBackend& be, const Tensor& dx, const Tensor& dw, const Tensor& db,
                               const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                               const Tensor& w) {
  if (mean.defined()) rows_backward_typed<T, false>(be, dx, dw, db, dy, x, mean, rstd, w);
  else rows_backward_typed<T, true>(be, dx, dw, db, dy, x, mean, rstd, w);
}

}  // namespace flame::backend::cuda::norm
