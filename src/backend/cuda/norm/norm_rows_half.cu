// CUDA layer_norm / rms_norm kernels for bf16 and f16 (statistics in f32; Note [CUDA norm
// kernels] in norm_kernels.cuh).
#include "src/backend/cuda/norm/norm_rows_impl.cuh"

namespace flame::backend::cuda::norm {
template void launch_norm_rows_forward<bfloat16>(CudaBackend&, const Tensor&, const Tensor&, const Tensor&,
                                                 const Tensor&, const Tensor&, const Tensor&, double);
template void launch_norm_rows_forward<float16>(CudaBackend&, const Tensor&, const Tensor&, const Tensor&,
                                                const Tensor&, const Tensor&, const Tensor&, double);
template void launch_norm_rows_backward<bfloat16>(CudaBackend&, const Tensor&, const Tensor&, const Tensor&,
                                                  const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                  const Tensor&);
template void launch_norm_rows_backward<float16>(CudaBackend&, const Tensor&, const Tensor&, const Tensor&,
                                                 const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                 const Tensor&);
}  // namespace flame::backend::cuda::norm
