// TEMPORARY link stubs for CudaBackend methods whose kernels are being written in other files of
// src/backend/cuda. Delete each stub when its real definition lands (and this file when empty).
#include "src/backend/cuda/cuda_backend.h"

namespace flame::backend::cuda {

#define FLAME_CUDA_TODO(what) FLAME_FAIL(what, "not implemented on CUDA yet")
void CudaBackend::matmul(const Tensor&, const Tensor&, const Tensor&) { FLAME_CUDA_TODO("matmul"); }
void CudaBackend::index_select(const Tensor&, const Tensor&, int64_t, const Tensor&) { FLAME_CUDA_TODO("index_select"); }
void CudaBackend::gather(const Tensor&, const Tensor&, int64_t, const Tensor&) { FLAME_CUDA_TODO("gather"); }
void CudaBackend::scatter(const Tensor&, int64_t, const Tensor&, const Tensor&, bool) { FLAME_CUDA_TODO("scatter"); }
Tensor CudaBackend::masked_select(const Tensor&, const Tensor&) { FLAME_CUDA_TODO("masked_select"); }
void CudaBackend::sort(const Tensor&, const Tensor&, const Tensor&, int64_t, bool) { FLAME_CUDA_TODO("sort"); }
#undef FLAME_CUDA_TODO

}  // namespace flame::backend::cuda
