// CUDA layer_norm / rms_norm: f32 and f64 kernels and the backend entries (Note [CUDA norm
// kernels] in norm_kernels.cuh; bf16 and f16 in norm_rows_half.cu).
#include "src/backend/cuda/norm/norm_rows_impl.cuh"

namespace flame::backend::cuda {
namespace norm {
// Compiled in norm_rows_half.cu.
extern template void launch_norm_rows_forward<bfloat16>(CudaBackend&, const Tensor&, const Tensor&, const Tensor&,
                                                        const Tensor&, const Tensor&, const Tensor&, double);
extern template void launch_norm_rows_forward<float16>(CudaBackend&, const Tensor&, const Tensor&, const Tensor&,
                                                       const Tensor&, const Tensor&, const Tensor&, double);
extern template void launch_norm_rows_backward<bfloat16>(CudaBackend&, const Tensor&, const Tensor&, const Tensor&,
                                                         const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                         const Tensor&);
extern template void launch_norm_rows_backward<float16>(CudaBackend&, const Tensor&, const Tensor&, const Tensor&,
                                                        const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                        const Tensor&);
template void launch_norm_rows_forward<float>(CudaBackend&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                              const Tensor&, const Tensor&, double);
template void launch_norm_rows_forward<double>(CudaBackend&, const Tensor&, const Tensor&, const Tensor&,
                                               const Tensor&, const Tensor&, const Tensor&, double);
template void launch_norm_rows_backward<float>(CudaBackend&, const Tensor&, const Tensor&, const Tensor&,
                                               const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                               const Tensor&);
template void launch_norm_rows_backward<double>(CudaBackend&, const Tensor&, const Tensor&, const Tensor&,
                                                const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                const Tensor&);
}  // namespace norm

void CudaBackend::norm_rows_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                                    const Tensor& weight, const Tensor& bias, double eps) {
  if (rstd.numel() == 0 || x.numel() == 0) return;
  DeviceGuard guard(device());
  dispatch_floating(x.dtype(), "norm_rows_forward", [&](auto tag) {
    norm::launch_norm_rows_forward<typename decltype(tag)::type>(*this, y, mean, rstd, x, weight, bias, eps);
  });
}

void CudaBackend::norm_rows_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                                     const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& weight) {
  if (rstd.numel() == 0 || x.numel() == 0) return;
  DeviceGuard guard(device());
  dispatch_floating(x.dtype(), "norm_rows_backward", [&](auto tag) {
    norm::launch_norm_rows_backward<typename decltype(tag)::type>(*this, dx, dweight, dbias, dy, x, mean, rstd,
                                                                  weight);
  });
}

}  // namespace flame::backend::cuda
