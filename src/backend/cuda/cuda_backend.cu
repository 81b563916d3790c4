// The CUDA device registry, backend lifetime, the current stream, synchronisation, deferred
// errors, launch checks and the public flame::cuda:: memory controls. Streams and events:
// stream.cu; graphs: graph.cu.
//
// Note [Backends live forever]
// A CudaBackend is created on first use of its device and deliberately never destroyed: tensors
// may be freed during static destruction (globals, function statics of a user's program), and
// their deleters call into the backend's pool. Destroying the backend at exit would turn those
// frees into use-after-free; leaking it is harmless because the process is ending.
//
// Note [Launch blocking]
// Kernels fault asynchronously: without help, an illegal address shows up at the next
// synchronising call, far from its cause. With FLAME_CUDA_LAUNCH_BLOCKING=1 (read once),
// check_launch (FLAME_CUDA_CHECK_LAUNCH, after every launch) also waits for the current stream and
// raises flame::Error naming the launching function: __PRETTY_FUNCTION__ of the launcher, whose
// template arguments name the kernel instance, plus file and line. matmul.cu does the same after
// each cuBLASLt GEMM and graph.cu after each replay. A stream being captured is not waited for.
#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unistd.h>

#include "flame/cuda.h"
#include "flame/device.h"
#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/memory_pool.h"

namespace flame::backend::cuda {

namespace {

constexpr int kMaxDevices = 64;

int device_count_uncached() {
  // Without the driver's control node there is no NVIDIA GPU; skipping the runtime's own probe
  // saves its start-up cost (hundreds of ms) in every process on GPU-less machines.
  if (access("/dev/nvidiactl", F_OK) != 0) return 0;
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: report none, leave no error behind
    return 0;
  }
  return n < kMaxDevices ? n : kMaxDevices;
}

int device_count() {
  static const int count = device_count_uncached();
  return count;
}

std::array<std::atomic<CudaBackend*>, kMaxDevices> g_backends{};

// Note [Current stream]: per thread, per device; nullptr means the backend's default stream.
thread_local cudaStream_t t_current_stream[kMaxDevices] = {};
std::mutex g_create_mutex;

// Per device: a pinned host copy of the DeviceErrorRecord and the mutex that guards it.
struct HostRecord {
  DeviceErrorRecord* pinned = nullptr;
  std::mutex mutex;
};
std::array<HostRecord, kMaxDevices> g_host_records;

const char* error_op_name(int32_t op) {
  switch (op) {
    case kErrIndexSelect: return "index_select";
    case kErrGather: return "gather";
    case kErrScatter: return "scatter";
    case kErrTake: return "take";
    case kErrScatterAdd: return "scatter_add";
    default: return "cuda kernel";
  }
}

}  // namespace

cudaStream_t current_stream_override(int device) {
  return device >= 0 && device < kMaxDevices ? t_current_stream[device] : nullptr;
}

void set_current_stream_override(int device, cudaStream_t stream) {
  FLAME_CHECK(device >= 0 && device < kMaxDevices, "cuda::set_current_stream", "device index ", device, " out of range");
  t_current_stream[device] = stream;
}

void check_not_capturing(cudaStream_t stream, const char* op, const char* what) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &status);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return;  // an unusable stream is reported by the call that follows
  }
  FLAME_CHECK(status == cudaStreamCaptureStatusNone, op, "cannot ", what,
              " while a CUDA graph is being captured on this stream (it would wait for the GPU or read host memory; "
              "move it out of the captured region)");
}

bool launch_blocking() {
  static const bool on = [] {
    const char* env = std::getenv("FLAME_CUDA_LAUNCH_BLOCKING");
    return env != nullptr && std::string(env) != "0";
  }();
  return on;
}

void check_launch(const char* where, const char* file, int line) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess && launch_blocking()) {
    // Note [Launch blocking]: wait here so a fault is reported at the launch that caused it. A
    // capturing stream cannot be waited for (the kernel has not run): skip it.
    int device = 0;
    if (cudaGetDevice(&device) == cudaSuccess) {
      cudaStream_t s = current_stream_override(device);
      if (s == nullptr) {
        CudaBackend* b = device < kMaxDevices ? g_backends[device].load(std::memory_order_acquire) : nullptr;
        if (b != nullptr) s = b->default_stream();
      }
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      if (s != nullptr && cudaStreamIsCapturing(s, &status) == cudaSuccess && status == cudaStreamCaptureStatusNone) {
        err = cudaStreamSynchronize(s);
      }
    }
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    FLAME_FAIL("cuda", "kernel launched by ", where, " failed: ", cudaGetErrorName(err), ": ",
               cudaGetErrorString(err), " (", file, ":", line, ")",
               launch_blocking() ? "" : "; set FLAME_CUDA_LAUNCH_BLOCKING=1 to find the faulting kernel");
  }
}

void raise_cuda_error(cudaError_t err, const char* what, const char* file, int line) {
  // Clear the last-error state so that a recoverable error does not resurface at the next launch
  // check (sticky errors stay: the context is unusable after them).
  (void)cudaGetLastError();
  FLAME_FAIL("cuda", what, " failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err), " (", file, ":",
             line, ")");
}

CudaBackend& cuda_backend(int index) {
  const int count = device_count();
  FLAME_CHECK(index >= 0 && index < count, "cuda", "device cuda:", index, " requested, but ",
              count == 0 ? std::string("no CUDA device is available")
                         : std::to_string(count) + " CUDA device(s) are visible");
  CudaBackend* b = g_backends[index].load(std::memory_order_acquire);
  if (b != nullptr) return *b;
  std::lock_guard<std::mutex> lock(g_create_mutex);
  b = g_backends[index].load(std::memory_order_acquire);
  if (b == nullptr) {
    b = new CudaBackend(index);  // Note [Backends live forever]: never deleted
    g_backends[index].store(b, std::memory_order_release);
  }
  return *b;
}

CudaBackend::CudaBackend(int device) : device_(device) {
  DeviceGuard guard(device);
  // Non-blocking: the stream never synchronises with the legacy default stream.
  FLAME_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  pool_ = std::make_unique<MemoryPool>(device, stream_);
  // One small allocation for the life of the backend: not worth the pool.
  FLAME_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&error_record_), sizeof(DeviceErrorRecord)));
  FLAME_CUDA_CHECK(cudaMemsetAsync(error_record_, 0, sizeof(DeviceErrorRecord), stream_));
  HostRecord& h = g_host_records[device];
  if (h.pinned == nullptr) {
    FLAME_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&h.pinned), sizeof(DeviceErrorRecord), cudaHostAllocDefault));
  }
  FLAME_CUDA_CHECK(cudaStreamSynchronize(stream_));
  register_epilogue_kernels();  // Note [Fused kernels]
  register_adaln_kernels();
  register_optim_kernels();
  register_adamw8bit_kernels();
  register_foreach_kernels();
  register_amp_kernels();
  register_rotary_kernels();
  register_rms_norm_rotary_kernels();
  register_matmul_add_kernel();
  register_float8_kernels();
}

CudaBackend::~CudaBackend() {
  // Not reached in practice (Note [Backends live forever]); best effort, never throws.
  (void)cudaStreamSynchronize(stream_);
  pool_.reset();
  if (error_record_ != nullptr) (void)cudaFree(error_record_);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  (void)cudaGetLastError();
}

std::shared_ptr<void> CudaBackend::allocate(std::size_t nbytes) { return pool_->allocate(nbytes, stream()); }

void CudaBackend::raise_deferred_error() {
  DeviceGuard guard(device_);
  HostRecord& h = g_host_records[device_];
  DeviceErrorRecord rec;
  const cudaStream_t st = stream();
  check_not_capturing(st, "synchronize", "wait for the GPU");
  {
    std::lock_guard<std::mutex> lock(h.mutex);
    // Queued behind all earlier work, so waiting for it also waits for the stream.
    FLAME_CUDA_CHECK(cudaMemcpyAsync(h.pinned, error_record_, sizeof(DeviceErrorRecord), cudaMemcpyDeviceToHost, st));
    FLAME_CUDA_CHECK(cudaStreamSynchronize(st));
    rec = *h.pinned;
    if (rec.op == kErrNone) return;
    FLAME_CUDA_CHECK(cudaMemsetAsync(error_record_, 0, sizeof(DeviceErrorRecord), st));
  }
  FLAME_FAIL(error_op_name(rec.op), "index ", rec.value, " is out of bounds for dim ", rec.dim, " with size ",
             rec.limit);
}

void CudaBackend::synchronize() {
  // raise_deferred_error waits for the current stream (its record read is queued last), then checks.
  raise_deferred_error();
}

void CudaBackend::synchronize_device() {
  DeviceGuard guard(device_);
  check_not_capturing(stream(), "cuda::synchronize", "synchronize the device");
  FLAME_CHECK(!pool_->capture_active(), "cuda::synchronize",
              "cannot synchronize the device while a CUDA graph is being captured on cuda:", device_);
  FLAME_CUDA_CHECK(cudaDeviceSynchronize());
  raise_deferred_error();
}

}  // namespace flame::backend::cuda

namespace flame {

int cuda_device_count() { return backend::cuda::device_count(); }
bool cuda_is_available() { return backend::cuda::device_count() > 0; }

namespace cuda {

MemoryStats memory_stats(int device) { return backend::cuda::cuda_backend(device).pool().stats(); }
void reset_peak_memory_stats(int device) { backend::cuda::cuda_backend(device).pool().reset_peak(); }
void empty_cache(int device) { backend::cuda::cuda_backend(device).pool().empty_cache(); }
void synchronize(int device) { backend::cuda::cuda_backend(device).synchronize_device(); }
void* current_stream(int device) { return static_cast<void*>(backend::cuda::cuda_backend(device).stream()); }

}  // namespace cuda
}  // namespace flame
