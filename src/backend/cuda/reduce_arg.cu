// CUDA reductions: argmax and argmin (kernels in reduce_kernels.cuh, Note [CUDA reduction paths] in reduce.cu).
#include "src/backend/cuda/reduce_kernels.cuh"

namespace flame::backend::cuda {

FLAME_REDUCE_INSTANTIATE(argmax)
FLAME_REDUCE_INSTANTIATE(argmin)

}  // namespace flame::backend::cuda
