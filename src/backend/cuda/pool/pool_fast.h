#pragma once
// Fast paths of the CUDA pool family for contiguous NCHW tensors (Note [Pool fast paths] in
// pool_fast.cu). Each returns false, having launched nothing, when its preconditions do not hold;
// the caller then runs the generic kernels of pool.cu.
#include <cuda_runtime.h>

#include "flame/tensor.h"
#include "src/backend/pool_params.h"

namespace flame::backend::cuda {

bool pool2d_fast(const Tensor& out, const Tensor& indices, const Tensor& x, const Pool2dParams& p,
                 cudaStream_t stream);
bool pool2d_backward_fast(const Tensor& grad_in, const Tensor& grad_out, const Tensor& indices,
                          const Pool2dParams& p, cudaStream_t stream);
bool upsample2d_nearest_fast(const Tensor& out, const Tensor& x, const Upsample2dParams& p, cudaStream_t stream);
bool upsample2d_nearest_backward_fast(const Tensor& grad_in, const Tensor& grad_out, const Upsample2dParams& p,
                                      cudaStream_t stream);

}  // namespace flame::backend::cuda
