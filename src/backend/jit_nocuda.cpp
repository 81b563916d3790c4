// The run-time kernel API (include/flame/cuda/kernels.h) in a build without CUDA: every call that
// needs NVRTC or a GPU raises flame::Error. Builds with CUDA use src/backend/cuda/jit.cpp instead.
#ifndef FLAME_WITH_CUDA

#include "flame/cuda/kernels.h"

namespace flame::cuda {

namespace detail {
struct LoadedKernel {};
}  // namespace detail

#define FLAME_NO_CUDA(what) FLAME_FAIL(what, "FLAME was built without CUDA")

struct CudaKernels::Impl {};

std::string default_kernel_cache_dir() { FLAME_NO_CUDA("default_kernel_cache_dir"); }
CudaKernels::CudaKernels(KernelCacheOptions) { FLAME_NO_CUDA("CudaKernels"); }
CudaKernels::~CudaKernels() = default;
CudaKernels& CudaKernels::global() { FLAME_NO_CUDA("CudaKernels::global"); }
Kernel CudaKernels::ensure_kernel(const std::string&, const std::string&, const std::vector<std::string>&, int) {
  FLAME_NO_CUDA("ensure_kernel");
}
bool CudaKernels::precompile(const std::string&, const std::string&, const std::vector<std::string>&, int) {
  FLAME_NO_CUDA("precompile");
}
KernelCacheStats CudaKernels::stats() const { FLAME_NO_CUDA("CudaKernels::stats"); }
const std::string& CudaKernels::disk_dir() const { FLAME_NO_CUDA("CudaKernels::disk_dir"); }
void CudaKernels::clear_memory_cache() { FLAME_NO_CUDA("CudaKernels::clear_memory_cache"); }

Kernel ensure_kernel(const std::string&, const std::string&, const std::vector<std::string>&, int) {
  FLAME_NO_CUDA("ensure_kernel");
}
bool kernel_compiler_available() { return false; }
std::string cuda_include_dir() { return {}; }

// No Kernel can be made without CUDA, so every accessor sees an empty handle.
const std::string& Kernel::name() const { FLAME_NO_CUDA("Kernel::name"); }
const std::string& Kernel::lowered_name() const { FLAME_NO_CUDA("Kernel::lowered_name"); }
int Kernel::device() const { FLAME_NO_CUDA("Kernel::device"); }
int Kernel::arch() const { FLAME_NO_CUDA("Kernel::arch"); }
int Kernel::num_params() const { FLAME_NO_CUDA("Kernel::num_params"); }
std::size_t Kernel::param_size(int) const { FLAME_NO_CUDA("Kernel::param_size"); }
int Kernel::max_threads_per_block() const { FLAME_NO_CUDA("Kernel::max_threads_per_block"); }
int Kernel::num_regs() const { FLAME_NO_CUDA("Kernel::num_regs"); }
std::size_t Kernel::static_shared_bytes() const { FLAME_NO_CUDA("Kernel::static_shared_bytes"); }
void* Kernel::handle() const { FLAME_NO_CUDA("Kernel::handle"); }

namespace detail {
void launch_args(const Kernel&, const LaunchConfig&, const KernelArg*, std::size_t) { FLAME_NO_CUDA("launch"); }
}  // namespace detail

#undef FLAME_NO_CUDA

}  // namespace flame::cuda

#endif  // FLAME_WITH_CUDA
