// CUDA softmax / log_softmax: f32 and f64 kernels and the op entry (Note [CUDA softmax] in
// softmax_kernels.cuh; bf16 and f16 in softmax_half.cu).
#include "src/backend/cuda/softmax_kernels.cuh"

namespace flame::backend::cuda {

template void launch_softmax<float>(CudaBackend&, const Tensor&, const Tensor&, int64_t, bool);
template void launch_softmax<double>(CudaBackend&, const Tensor&, const Tensor&, int64_t, bool);

void CudaBackend::softmax(const Tensor& dst, const Tensor& src, int64_t dim, bool log) {
  const char* name = log ? "log_softmax" : "softmax";
  FLAME_CHECK(dim >= 0 && dim < src.dim() && dst.sizes() == src.sizes() && dst.dtype() == src.dtype(), name,
              "bad arguments: dim ", dim, ", src ", src.sizes(), ", dst ", dst.sizes());
  DeviceGuard guard(device());
  dispatch_floating(src.dtype(), name, [&](auto tag) { launch_softmax<typename decltype(tag)::type>(*this, dst, src, dim, log); });
}

}  // namespace flame::backend::cuda
