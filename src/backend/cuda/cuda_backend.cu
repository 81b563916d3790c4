// The CUDA device registry, backend lifetime, synchronisation, deferred errors and the public
// flame::cuda:: controls.
//
// Note [Backends live forever]
// A CudaBackend is created on first use of its device and deliberately never destroyed: tensors
// may be freed during static destruction (globals, function statics of a user's program), and
// their deleters call into the backend's pool. Destroying the backend at exit would turn those
// frees into use-after-free; leaking it is harmless because the process is ending.
#include <array>
#include <atomic>
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
}

CudaBackend::~CudaBackend() {
  // Not reached in practice (Note [Backends live forever]); best effort, never throws.
  (void)cudaStreamSynchronize(stream_);
  pool_.reset();
  if (error_record_ != nullptr) (void)cudaFree(error_record_);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  (void)cudaGetLastError();
}

std::shared_ptr<void> CudaBackend::allocate(std::size_t nbytes) { return pool_->allocate(nbytes); }

void CudaBackend::raise_deferred_error() {
  DeviceGuard guard(device_);
  HostRecord& h = g_host_records[device_];
  DeviceErrorRecord rec;
  {
    std::lock_guard<std::mutex> lock(h.mutex);
    // Queued behind all earlier work, so waiting for it also waits for the stream.
    FLAME_CUDA_CHECK(cudaMemcpyAsync(h.pinned, error_record_, sizeof(DeviceErrorRecord), cudaMemcpyDeviceToHost, stream_));
    FLAME_CUDA_CHECK(cudaStreamSynchronize(stream_));
    rec = *h.pinned;
    if (rec.op == kErrNone) return;
    FLAME_CUDA_CHECK(cudaMemsetAsync(error_record_, 0, sizeof(DeviceErrorRecord), stream_));
  }
  FLAME_FAIL(error_op_name(rec.op), "index ", rec.value, " is out of bounds for dim ", rec.dim, " with size ",
             rec.limit);
}

void CudaBackend::synchronize() {
  // raise_deferred_error waits for the stream (its record read is queued last), then checks.
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
void synchronize(int device) { backend::cuda::cuda_backend(device).synchronize(); }
void* current_stream(int device) { return static_cast<void*>(backend::cuda::cuda_backend(device).stream()); }

}  // namespace cuda
}  // namespace flame
