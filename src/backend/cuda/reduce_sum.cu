// CUDA reductions: sum, mean and prod (kernels in reduce_kernels.cuh, Note [CUDA reduction paths] in reduce.cu).
#include "src/backend/cuda/reduce_kernels.cuh"

namespace flame::backend::cuda {

FLAME_REDUCE_INSTANTIATE(sum)
FLAME_REDUCE_INSTANTIATE(mean)
FLAME_REDUCE_INSTANTIATE(prod)

}  // namespace flame::backend::cuda
