#pragma once
// Run-time compiled CUDA kernels (NVRTC). Compile a kernel's CUDA C++ source for the GPU in hand,
// cache the binary in memory and on disk, and launch it on FLAME tensors on FLAME's stream:
//
//   auto k = flame::cuda::ensure_kernel("axpy", R"(
//     extern "C" __global__ void axpy(float a, const float* x, float* y, long n) {
//       long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
//       if (i < n) y[i] = a * x[i] + y[i];
//     })");
//   flame::cuda::launch(k, flame::cuda::LaunchConfig::for_elements(n), 2.0f, x, y, n);
//
// What the kernel sees: a Tensor argument becomes the device address of its first element
// (Tensor::data_ptr(), storage offset included) as one pointer parameter; its elements are laid
// out by its strides (pass t.contiguous() for the dense row-major layout). Element types:
// f32 float, f64 double, bf16 flame::bfloat16, f16 flame::float16 (both from <flame/jit.cuh>,
// bit-compatible with __nv_bfloat16 / __half), i32 int, i64 long (int64_t), u8 unsigned char,
// boolean bool. Scalars are passed by value and must have exactly the size of the kernel's
// parameter (2.0 is a double: pass 2.0f to a float parameter). See docs/custom-kernels.md.
//
// In a build without CUDA every call raises flame::Error ("built without CUDA").
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "flame/error.h"
#include "flame/tensor.h"

namespace flame::cuda {

struct Dim3 {
  uint32_t x = 1, y = 1, z = 1;
  constexpr Dim3() = default;
  constexpr Dim3(uint32_t x_, uint32_t y_ = 1, uint32_t z_ = 1) : x(x_), y(y_), z(z_) {}  // NOLINT
};

struct LaunchConfig {
  Dim3 grid;
  Dim3 block{256};
  uint32_t shared_mem = 0;  // dynamic shared memory per block, bytes (above 48 KiB is allowed)

  // One thread per element: `block` threads per block, ceil(n / block) blocks. n == 0 gives an
  // empty grid, and launching an empty grid does nothing. Raises when the grid would exceed
  // 2^31 - 1 blocks (use a grid-stride loop and a fixed grid then).
  static LaunchConfig for_elements(int64_t n, uint32_t block = 256) {
    FLAME_CHECK(n >= 0, "LaunchConfig::for_elements", "negative element count ", n);
    FLAME_CHECK(block >= 1 && block <= 1024, "LaunchConfig::for_elements", "block size ", block,
                " is not in [1, 1024]");
    const int64_t blocks = (n + block - 1) / block;
    FLAME_CHECK(blocks <= 0x7fffffffLL, "LaunchConfig::for_elements", n, " elements need ", blocks,
                " blocks of ", block, ", more than the grid limit 2^31 - 1; use a grid-stride loop");
    LaunchConfig c;
    c.grid = Dim3(static_cast<uint32_t>(blocks));
    c.block = Dim3(block);
    return c;
  }
};

namespace detail {
struct LoadedKernel;  // src/backend/cuda/jit.cpp
}

// A kernel loaded for one device. A cheap, shared handle: copy it, keep it (e.g. in a static) and
// launch it from any thread. It stays valid after the cache that made it is cleared or destroyed.
class Kernel {
 public:
  Kernel() = default;
  explicit Kernel(std::shared_ptr<const detail::LoadedKernel> impl) : impl_(std::move(impl)) {}
  bool defined() const { return impl_ != nullptr; }
  const std::string& name() const;          // as given to ensure_kernel (a name expression)
  const std::string& lowered_name() const;  // the symbol in the binary (mangled for C++ names)
  int device() const;                       // CUDA device index it was loaded for
  int arch() const;                         // compiled for sm_<arch>, e.g. 90
  int num_params() const;
  std::size_t param_size(int index) const;  // bytes of parameter `index` (from 0)
  int max_threads_per_block() const;
  int num_regs() const;
  std::size_t static_shared_bytes() const;
  void* handle() const;  // the cudaKernel_t, for direct use with the CUDA runtime
  const detail::LoadedKernel* impl() const { return impl_.get(); }

 private:
  std::shared_ptr<const detail::LoadedKernel> impl_;
};

// Counters of one CudaKernels cache (since its creation).
struct KernelCacheStats {
  uint64_t compiles = 0;      // NVRTC compilations
  uint64_t memory_hits = 0;   // ensure_kernel answered from memory (nothing compiled or read)
  uint64_t disk_hits = 0;     // binaries read from the disk cache instead of compiling
  uint64_t disk_writes = 0;   // binaries written to the disk cache
  uint64_t disk_rejects = 0;  // disk entries that were unreadable, corrupt or mismatched: rebuilt
  uint64_t disk_errors = 0;   // disk cache I/O failures (the kernel still works; not cached)
  uint64_t loads = 0;         // binaries loaded into the CUDA runtime
};

// $FLAME_KERNEL_CACHE when set ("off" or "" disables the disk cache: returns ""), else
// $XDG_CACHE_HOME/flame/kernels, else $HOME/.cache/flame/kernels ("" when none is set).
std::string default_kernel_cache_dir();

struct KernelCacheOptions {
  // Directory of the on-disk cache ("" disables it); default_kernel_cache_dir() when unset.
  std::optional<std::string> disk_dir;
};

// A cache of compiled kernels. Most code uses the process-wide one through ensure_kernel(); a
// separate instance has its own memory cache and statistics (tests, a private cache directory).
// Thread-safe: concurrent ensure_kernel calls for one kernel compile it once.
class CudaKernels {
 public:
  explicit CudaKernels(KernelCacheOptions options = {});
  ~CudaKernels();
  CudaKernels(const CudaKernels&) = delete;
  CudaKernels& operator=(const CudaKernels&) = delete;

  // The process-wide cache (disk directory from default_kernel_cache_dir()); never destroyed.
  static CudaKernels& global();

  // Returns kernel `name` of `source`, compiled for `device`'s architecture and loaded there.
  // `name` is the kernel's name expression: an extern "C" name, a C++ name ("ns::f") or a template
  // instance ("scale<float>"). NVRTC gets --std=c++17 -default-device -arch=sm_<cc> (each unless
  // `options` sets it), then `options`. The result is cached by name, source, options, architecture
  // and NVRTC version; a compile error raises flame::Error with the name and NVRTC's full log.
  Kernel ensure_kernel(const std::string& name, const std::string& source,
                       const std::vector<std::string>& options = {}, int device = 0);

  // Compiles for sm_<arch> into the caches without loading anything: needs NVRTC, not a GPU (warm
  // a cache directory ahead of a run). Returns true when the binary was already cached.
  bool precompile(const std::string& name, const std::string& source,
                  const std::vector<std::string>& options, int arch);

  KernelCacheStats stats() const;
  const std::string& disk_dir() const;
  // Forgets the in-memory entries (handles already returned stay valid); the disk cache stays.
  void clear_memory_cache();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// CudaKernels::global().ensure_kernel(...).
Kernel ensure_kernel(const std::string& name, const std::string& source,
                     const std::vector<std::string>& options = {}, int device = 0);

// True in builds with CUDA (NVRTC is linked); a GPU is still needed to load and launch.
bool kernel_compiler_available();
// The CUDA toolkit's include directory when one is found ($CUDA_HOME, $CUDA_PATH,
// /usr/local/cuda), else "". Pass "-I" + it to use <cuda_fp16.h>, <cuda_bf16.h> in a kernel.
std::string cuda_include_dir();

namespace detail {
// One launch argument: a tensor (passed as its data pointer) or the bytes of a scalar.
struct KernelArg {
  const Tensor* tensor = nullptr;
  const void* value = nullptr;
  std::size_t size = 0;
};

template <class T>
KernelArg kernel_arg(const T& v) {
  if constexpr (std::is_same_v<T, Tensor>) {
    return KernelArg{&v, nullptr, sizeof(void*)};
  } else {
    static_assert(!std::is_array_v<T>, "launch: arrays cannot be kernel arguments; pass a pointer");
    static_assert(std::is_trivially_copyable_v<T>,
                  "launch: an argument must be a flame::Tensor or a trivially copyable value");
    return KernelArg{nullptr, &v, sizeof(T)};
  }
}

void launch_args(const Kernel& kernel, const LaunchConfig& config, const KernelArg* args,
                 std::size_t count);
}  // namespace detail

// Queues `kernel` on the current stream of the kernel's device (Note [Current stream]), so it
// is ordered after every FLAME op queued there before and before every one queued after; it does not
// wait for the GPU. Tensor arguments must be CUDA tensors on the kernel's device; the argument
// count and every argument's size must match the kernel's parameters. Errors name the argument
// (counted from 0). Launch-configuration errors raise flame::Error; errors inside the kernel
// surface at the next synchronising call, like any asynchronous CUDA error.
template <class... Args>
void launch(const Kernel& kernel, const LaunchConfig& config, const Args&... args) {
  const detail::KernelArg list[sizeof...(Args) + 1] = {detail::kernel_arg(args)..., detail::KernelArg{}};
  detail::launch_args(kernel, config, list, sizeof...(Args));
}

}  // namespace flame::cuda
