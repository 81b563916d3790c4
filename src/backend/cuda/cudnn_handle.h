#pragma once
// Note [cuDNN handle under capture]
// cudnnCreate allocates device memory, which a thread-local CUDA graph capture forbids (the
// capture fails with cuDNN's "device allocation failed"). A thread whose first cuDNN call happens
// inside a capture therefore creates its handle in relaxed capture mode, as the memory pool takes
// its segments (Note [Graph-private pool]); the allocation is not stream work, so the capture is
// unaffected. Should cuDNN still fail there, the error says what to do instead of cuDNN's code.
#include <cuda_runtime.h>
#include <cudnn.h>

#include <string>

#include "flame/cuda.h"
#include "flame/error.h"

namespace flame::backend::cuda {

// Creates a cuDNN handle on `device` (the current device is restored); `op` names the caller in errors.
inline cudnnHandle_t create_cudnn_handle(int device, const char* op) {
  int prev = 0;
  (void)cudaGetDevice(&prev);
  (void)cudaSetDevice(device);
  const bool capturing = flame::cuda::is_capturing(device);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  (void)cudaThreadExchangeStreamCaptureMode(&mode);  // `mode` now holds the thread's own mode
  cudnnHandle_t h = nullptr;
  const cudnnStatus_t st = cudnnCreate(&h);
  (void)cudaThreadExchangeStreamCaptureMode(&mode);  // restored
  (void)cudaSetDevice(prev);
  if (st != CUDNN_STATUS_SUCCESS)
    FLAME_FAIL(op, "cudnnCreate failed on cuda:", device, ": ", cudnnGetErrorString(st),
               capturing ? " (this thread is capturing a CUDA graph: run one cuDNN operation, a convolution or "
                           "fused attention, on this thread before capturing)"
                         : "");
  return h;
}

}  // namespace flame::backend::cuda
