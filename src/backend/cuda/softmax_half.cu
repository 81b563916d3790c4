// CUDA softmax / log_softmax: bf16 and f16 kernels (Note [CUDA softmax] in softmax_kernels.cuh).
#include "src/backend/cuda/softmax_kernels.cuh"

namespace flame::backend::cuda {

template void launch_softmax<bfloat16>(CudaBackend&, const Tensor&, const Tensor&, int64_t, bool);
template void launch_softmax<float16>(CudaBackend&, const Tensor&, const Tensor&, int64_t, bool);

}  // namespace flame::backend::cuda
