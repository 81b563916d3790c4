// CUDA reductions: amax and amin (kernels in reduce_kernels.cuh, Note [CUDA reduction paths] in reduce.cu).
#include "src/backend/cuda/reduce_kernels.cuh"

namespace flame::backend::cuda {

FLAME_REDUCE_INSTANTIATE(max)
FLAME_REDUCE_INSTANTIATE(min)

}  // namespace flame::backend::cuda
