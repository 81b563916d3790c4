// CUDA reductions: any and all (kernels in reduce_kernels.cuh, Note [CUDA reduction paths] in reduce.cu).
#include "src/backend/cuda/reduce_kernels.cuh"

namespace flame::backend::cuda {

FLAME_REDUCE_INSTANTIATE(any)
FLAME_REDUCE_INSTANTIATE(all)

}  // namespace flame::backend::cuda
