// Maps a Device to its backend. The CUDA backend exists only in builds with FLAME_WITH_CUDA.
#include <atomic>

#include "flame/cuda.h"
#include "flame/device.h"
#include "src/backend/backend.h"
#include "src/backend/cpu/cpu_backend.h"
#include "src/core/tensor_impl.h"

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
std::shared_ptr<Storage> allocate_storage(Device device, std::size_t nbytes) {
  // On the CPU the Storage lives in its data block (Note [Storage in its block]).
  if (device.is_cpu()) return backend::cpu::allocate_storage(nbytes);
  return std::make_shared<Storage>(backend::backend_for(device).allocate(nbytes), nbytes, device);
}

#ifndef FLAME_WITH_CUDA
bool cuda_is_available() { return false; }
int cuda_device_count() { return 0; }
namespace cuda {
#define FLAME_NO_CUDA(what) FLAME_FAIL(what, "FLAME was built without CUDA")
MemoryStats memory_stats(int) { FLAME_NO_CUDA("cuda::memory_stats"); }
void reset_peak_memory_stats(int) { FLAME_NO_CUDA("cuda::reset_peak_memory_stats"); }
void empty_cache(int) { FLAME_NO_CUDA("cuda::empty_cache"); }
void synchronize(int) { FLAME_NO_CUDA("cuda::synchronize"); }
void* current_stream(int) { FLAME_NO_CUDA("cuda::current_stream"); }
#undef FLAME_NO_CUDA
}  // namespace cuda
#endif

namespace cuda {
namespace {
std::atomic<bool> g_allow_tf32{false};
std::atomic<bool> g_allow_conv_tf32{true};  // PyTorch's torch.backends.cudnn.allow_tf32 default
}
void set_allow_tf32(bool allow) { g_allow_tf32 = allow; }
bool allow_tf32() { return g_allow_tf32; }
void set_allow_conv_tf32(bool allow) { g_allow_conv_tf32 = allow; }
bool allow_conv_tf32() { return g_allow_conv_tf32; }
}  // namespace cuda
}  // namespace flame
