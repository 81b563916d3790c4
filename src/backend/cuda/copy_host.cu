// Copies between host memory and a device: CudaBackend::copy_from_host and copy_to_host.
//
// Note [Host staging]
// Both directions go through pinned staging memory owned by the device (allocated on first use,
// kept for the life of the process like the backend itself), so the DMA engine copies
// asynchronously and the user's buffer, pageable or not, is never read or written by the device.
//  - Host to device. The host bytes are memcpy'd into a 64 MiB pinned ring, in chunks of at most
//    16 MiB, and each chunk is queued with cudaMemcpyAsync on the stream followed by an event.
//    Copies are queued on the current stream (Note [Current stream]): an upload made under a
//    StreamGuard of a side stream overlaps compute on another stream, and an event recorded
//    after it orders the consumer.
//    copy_from_host returns as soon as the last chunk is queued: the caller may reuse or free its
//    buffer at once, and the host does not wait for the GPU. A region of the ring is reused only
//    after the event of the copy that read it has completed; the host waits (on that event only)
//    when the ring is full, i.e. when more than 64 MiB of uploads are still queued behind work
//    on the stream. Chunking also overlaps the host memcpy of chunk k+1 with the DMA of chunk k.
//  - Device to host. Chunks of at most 16 MiB are copied into two pinned buffers in turn; the
//    host waits for each chunk's event and memcpy's it to the user's buffer while the next chunk
//    is in flight. This is an explicit read: it waits for all earlier work on the stream, then
//    raises any deferred device error (Note [Deferred device errors]).
#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"

namespace flame::backend::cuda {

namespace {

constexpr int kMaxStagingDevices = 64;
constexpr std::size_t kRingBytes = std::size_t{64} << 20;
constexpr std::size_t kChunkBytes = std::size_t{16} << 20;

// True when the event has completed; clears the not-ready status from CUDA's last-error state.
bool event_done(cudaEvent_t ev) {
  const cudaError_t err = cudaEventQuery(ev);
  if (err == cudaSuccess) return true;
  if (err != cudaErrorNotReady) FLAME_CUDA_CHECK(err);
  (void)cudaGetLastError();
  return false;
}

// The host-to-device ring of Note [Host staging]. All members are guarded by `mutex`.
class UploadRing {
 public:
  std::mutex mutex;

  // A pinned region of `n` (<= kChunkBytes) bytes that no queued copy reads any more.
  char* reserve(std::size_t n) {
    if (base_ == nullptr) {
      FLAME_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&base_), kRingBytes, cudaHostAllocDefault));
    }
    for (;;) {
      while (!pending_.empty() && event_done(pending_.front().event)) pop_front();
      if (pending_.empty()) {
        start_ = 0;
        return base_;
      }
      const std::size_t tail = pending_.front().begin;
      if (head_ > tail) {  // in use: [tail, head)
        if (kRingBytes - head_ >= n) {
          start_ = head_;
          return base_ + start_;
        }
        if (n <= tail) {
          start_ = 0;
          return base_;
        }
      } else if (tail - head_ >= n) {  // wrapped, in use: [tail, end) and [0, head)
        start_ = head_;
        return base_ + start_;
      }
      // Full: wait for the oldest queued upload only.
      FLAME_CUDA_CHECK(cudaEventSynchronize(pending_.front().event));
      pop_front();
    }
  }

  // Records that the region last reserved, `n` bytes, is read by the copy just queued on `stream`.
  void commit(std::size_t n, cudaStream_t stream) {
    cudaEvent_t ev;
    if (free_events_.empty()) {
      FLAME_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    } else {
      ev = free_events_.back();
      free_events_.pop_back();
    }
    FLAME_CUDA_CHECK(cudaEventRecord(ev, stream));
    pending_.push_back({ev, start_, start_ + n});
    head_ = start_ + n;
  }

 private:
  struct Pending {
    cudaEvent_t event;
    std::size_t begin, end;
  };
  void pop_front() {
    free_events_.push_back(pending_.front().event);
    pending_.pop_front();
  }

  char* base_ = nullptr;
  std::size_t head_ = 0;   // one past the newest region
  std::size_t start_ = 0;  // the region handed out by the last reserve()
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
};

// The two device-to-host buffers of Note [Host staging].
struct DownloadBuffers {
  std::mutex mutex;
  char* buf[2] = {nullptr, nullptr};
  cudaEvent_t done[2] = {nullptr, nullptr};

  void ensure() {
    if (buf[0] != nullptr) return;
    for (int k = 0; k < 2; ++k) {
      FLAME_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&buf[k]), kChunkBytes, cudaHostAllocDefault));
      FLAME_CUDA_CHECK(cudaEventCreateWithFlags(&done[k], cudaEventDisableTiming));
    }
  }
};

struct Staging {
  UploadRing up;
  DownloadBuffers down;
};

// Per device, created on first use and never freed (like the backend, Note [Backends live forever]).
Staging& staging(int device) {
  static std::array<std::atomic<Staging*>, kMaxStagingDevices> all{};
  static std::mutex create_mutex;
  FLAME_CHECK(device >= 0 && device < kMaxStagingDevices, "cuda", "device index ", device, " out of range");
  Staging* s = all[device].load(std::memory_order_acquire);
  if (s != nullptr) return *s;
  std::lock_guard<std::mutex> lock(create_mutex);
  s = all[device].load(std::memory_order_acquire);
  if (s == nullptr) {
    s = new Staging();
    all[device].store(s, std::memory_order_release);
  }
  return *s;
}

}  // namespace

void CudaBackend::copy_from_host(const Tensor& dst, const void* host) {
  const std::size_t n = dst.nbytes();
  if (n == 0) return;
  FLAME_CHECK(dst.is_contiguous(), "copy_from_host", "destination must be contiguous (shape ", dst.sizes(), ")");
  DeviceGuard guard(device_);
  const cudaStream_t st = stream();
  // A captured copy would re-read the staging ring at every replay, long after it was reused.
  check_not_capturing(st, "copy_from_host", "copy host memory to the device");
  UploadRing& ring = staging(device_).up;
  std::lock_guard<std::mutex> lock(ring.mutex);
  char* d = static_cast<char*>(dst.data_ptr());
  const char* h = static_cast<const char*>(host);
  for (std::size_t off = 0; off < n; off += kChunkBytes) {
    const std::size_t len = std::min(kChunkBytes, n - off);
    char* pinned = ring.reserve(len);
    std::memcpy(pinned, h + off, len);
    FLAME_CUDA_CHECK(cudaMemcpyAsync(d + off, pinned, len, cudaMemcpyHostToDevice, st));
    ring.commit(len, st);
  }
}

void CudaBackend::copy_to_host(void* host, const Tensor& src) {
  const std::size_t n = src.nbytes();
  const cudaStream_t st = stream();
  check_not_capturing(st, "copy_to_host", "read a tensor to the host (to_vec, item, printing, to(cpu))");
  if (n > 0) {
    FLAME_CHECK(src.is_contiguous(), "copy_to_host", "source must be contiguous (shape ", src.sizes(), ")");
    DeviceGuard guard(device_);
    DownloadBuffers& down = staging(device_).down;
    std::lock_guard<std::mutex> lock(down.mutex);
    down.ensure();
    const char* s = static_cast<const char*>(src.data_ptr());
    char* h = static_cast<char*>(host);
    const std::size_t chunks = (n + kChunkBytes - 1) / kChunkBytes;
    auto enqueue = [&](std::size_t c) {
      const std::size_t off = c * kChunkBytes, len = std::min(kChunkBytes, n - off);
      FLAME_CUDA_CHECK(cudaMemcpyAsync(down.buf[c % 2], s + off, len, cudaMemcpyDeviceToHost, st));
      FLAME_CUDA_CHECK(cudaEventRecord(down.done[c % 2], st));
    };
    enqueue(0);
    if (chunks > 1) enqueue(1);
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t off = c * kChunkBytes, len = std::min(kChunkBytes, n - off);
      FLAME_CUDA_CHECK(cudaEventSynchronize(down.done[c % 2]));
      std::memcpy(h + off, down.buf[c % 2], len);
      if (c + 2 < chunks) enqueue(c + 2);
    }
  }
  raise_deferred_error();
}

}  // namespace flame::backend::cuda
