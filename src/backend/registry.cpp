// Maps a Device to its backend. The CUDA backend exists only in builds with FLAME_WITH_CUDA.
#include "flame/device.h"
#include "src/backend/backend.h"
#include "src/backend/cpu/cpu_backend.h"

#ifdef FLAME_WITH_CUDA
#include "src/backend/cuda/cuda_backend.h"
#endif

namespace flame::backend {

Backend& cpu_backend() {
  static cpu::CpuBackend backend;
  return backend;
}

Backend& backend_for(Device device) {
  if (device.is_cpu()) return cpu_backend();
#ifdef FLAME_WITH_CUDA
  return cuda::cuda_backend(device.index);
#else
  FLAME_FAIL("device", "tensor on ", device.str(), " requested, but FLAME was built without CUDA");
#endif
}

}  // namespace flame::backend

namespace flame {
#ifndef FLAME_WITH_CUDA
bool cuda_is_available() { return false; }
int cuda_device_count() { return 0; }
#endif
}  // namespace flame
