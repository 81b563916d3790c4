#pragma once
// Shared CUDA helpers: error checks, launch arithmetic, strided indexing passed by value.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "flame/error.h"
#include "flame/tensor.h"

namespace flame::backend::cuda {

[[noreturn]] void raise_cuda_error(cudaError_t err, const char* what, const char* file, int line);
// Checks the last launch; with FLAME_CUDA_LAUNCH_BLOCKING=1 also waits for the current stream and
// names `where` if the kernel faulted (Note [Launch blocking], cuda_backend.cu).
void check_launch(const char* where, const char* file, int line);

}  // namespace flame::backend::cuda

// Checks a CUDA runtime call; raises flame::Error with the call, the error string and the place.
#define FLAME_CUDA_CHECK(call)                                                              \
  do {                                                                                      \
    cudaError_t flame_err_ = (call);                                                        \
    if (flame_err_ != cudaSuccess)                                                          \
      ::flame::backend::cuda::raise_cuda_error(flame_err_, #call, __FILE__, __LINE__);      \
  } while (0)
// After every kernel launch; names the launching function (its template arguments name the kernel).
#define FLAME_CUDA_CHECK_LAUNCH() ::flame::backend::cuda::check_launch(__PRETTY_FUNCTION__, __FILE__, __LINE__)

namespace flame::backend::cuda {

constexpr int kMaxDims = 16;

// Sizes and element strides of a tensor, by value, for kernels on views (stride 0 = broadcast).
struct StridedInfo {
  int ndim;
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];

  // Element offset of logical (row-major) index i.
  __host__ __device__ __forceinline__ int64_t offset(int64_t i) const {
    int64_t off = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t s = sizes[d];
      off += (i % s) * strides[d];
      i /= s;
    }
    return off;
  }
};

inline StridedInfo strided_info(const Tensor& t) {
  FLAME_CHECK(t.dim() <= kMaxDims, "cuda", "tensors with more than ", kMaxDims, " dims are not supported (shape ",
              t.sizes(), ")");
  StridedInfo s{};
  s.ndim = static_cast<int>(t.dim());
  for (int d = 0; d < s.ndim; ++d) {
    s.sizes[d] = t.sizes()[d];
    s.strides[d] = t.strides()[d];
  }
  return s;
}

// Multiprocessor count of `device`, read once (elementwise.cu).
int sm_count(int device);

inline unsigned int blocks_for(int64_t n, int threads, int64_t max_blocks = 65535LL * 32) {
  int64_t b = (n + threads - 1) / threads;
  if (b > max_blocks) b = max_blocks;
  return static_cast<unsigned int>(b < 1 ? 1 : b);
}

}  // namespace flame::backend::cuda

namespace flame::backend::cuda {

// Makes `device` current for the scope (kernels launch on the current device; a stream of another
// device would be rejected), restoring the previous one after. Costs one cudaGetDevice when the
// device is already current.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FLAME_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) FLAME_CUDA_CHECK(cudaSetDevice(device));
    device_ = device;
  }
  ~DeviceGuard() {
    if (previous_ != device_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  int device_ = 0;
};

}  // namespace flame::backend::cuda
