#pragma once
// What FLAME's autotuners share (the epilogue GEMMs, epi/epi_plan.cpp; the cuDNN plans,
// cudnn_autotune.h): whether the calling thread's work is being captured, when nothing may be
// timed, and the CUDA events of a timing.
#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/memory_pool.h"

namespace flame::backend::cuda {

// Whether the calling thread's work on be's stream is being captured into a graph (FLAME's own,
// or the caller's capture of a stream it handed to FLAME).
inline bool capturing_now(const CudaBackend& be) {
  if (thread_is_capturing(be.device())) return true;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  FLAME_CUDA_CHECK(cudaStreamIsCapturing(be.stream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

// The CUDA events of a timing, destroyed on every way out; creation failures raise.
class TimingEvents {
 public:
  explicit TimingEvents(std::size_t n) : ev_(n, nullptr) {
    for (cudaEvent_t& e : ev_) {
      const cudaError_t err = cudaEventCreate(&e);
      if (err != cudaSuccess) {
        e = nullptr;
        release();
        raise_cuda_error(err, "cudaEventCreate", __FILE__, __LINE__);
      }
    }
  }
  ~TimingEvents() { release(); }
  TimingEvents(const TimingEvents&) = delete;
  TimingEvents& operator=(const TimingEvents&) = delete;
  cudaEvent_t operator[](std::size_t i) const { return ev_[i]; }

 private:
  void release() {
    for (cudaEvent_t& e : ev_)
      if (e != nullptr) (void)cudaEventDestroy(e);
    ev_.assign(ev_.size(), nullptr);
  }
  std::vector<cudaEvent_t> ev_;
};

}  // namespace flame::backend::cuda
