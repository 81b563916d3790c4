// Pinned host memory and asynchronous host<->device copies (src/backend/pinned_host.h), and the pool
// memory limit's public calls (cuda::set_memory_limit).
//
// Note [Pinned host cache]
// Page-locked host memory lets the DMA engine copy while the host goes on, so a copy between a
// pinned CPU tensor and a CUDA tensor is one cudaMemcpyAsync with no staging and no host wait.
// cudaHostAlloc/cudaFreeHost are slow (they map pages and may synchronise the device), so freed
// blocks are cached, like PyTorch's CachingHostAllocator:
//  - Size classes: a request is rounded up to 512 bytes and, above 4 KiB, to the next of 8 steps
//    per power of two (waste <= 12.5%); a free block is handed out again only for its own class.
//  - Safe reuse: each async copy notes its (device, stream) on the block it reads or writes. When
//    the block's last tensor goes, one event is recorded on each noted stream and the block waits
//    in a pending list until they have completed (polled with cudaEventQuery by later allocations,
//    never waited on); only then may an allocation take it. A block no copy used is free at once.
//    So the host never waits to free, and no queued copy reads a block that was handed out again.
//  - Host writes: as in PyTorch, writing a pinned tensor on the host while an async copy that
//    reads it is queued is the caller's race (wait on an event first); FLAME never does so itself.
//  - Limits: nothing is returned to the system except by offload::empty_pinned_cache() and when
//    cudaHostAlloc fails (then the free blocks are released and the call retried once).
//  - Poisoning: under FLAME_POISON_ALLOC every block handed out is filled with 0xFF bytes (as the
//    CPU allocator does); a pending block is never written, so no queued copy sees the poison.
//  - Blocks are portable (cudaHostAllocPortable): pinned for every device, so one pinned tensor
//    can feed copies to any GPU.
//  - Lifetime: the cache is never destroyed (tensors freed at exit still find it).
// Async copies refuse graph capture (check_not_capturing), like the staged copies: the events
// recorded at free time cannot be recorded on a capturing stream.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flame/cuda.h"
#include "src/backend/cuda/common.cuh"
#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/memory_pool.h"
#include "src/backend/pinned_host.h"
#include "src/core/tensor_impl.h"

namespace flame::backend::pinned_host {
namespace {

using backend::cuda::DeviceGuard;

std::size_t pinned_class(std::size_t nbytes) {
  const std::size_t n = std::max<std::size_t>(nbytes, 1);
  std::size_t r = (n + 511) / 512 * 512;
  if (r <= 4096) return r;
  std::size_t pow2 = 4096;
  while (pow2 * 2 < r) pow2 *= 2;
  const std::size_t step = pow2 / 8;
  return (r + step - 1) / step * step;
}

class PinnedCache {
 public:
  PinnedCache() {
    const char* poison = std::getenv("FLAME_POISON_ALLOC");
    poison_ = poison != nullptr && std::string(poison) != "0";
  }

  std::shared_ptr<void> allocate(std::size_t nbytes, const char* op) {
    const std::size_t cls = pinned_class(nbytes);
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      poll_pending();
      auto it = free_.find(cls);
      if (it != free_.end() && !it->second.empty()) {
        ptr = it->second.back();
        it->second.pop_back();
        cached_ -= cls;
      }
    }
    if (ptr == nullptr) {
      cudaError_t err = cudaHostAlloc(&ptr, cls, cudaHostAllocPortable);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        empty_cache();
        err = cudaHostAlloc(&ptr, cls, cudaHostAllocPortable);
        if (err != cudaSuccess) {
          (void)cudaGetLastError();
          std::ostringstream os;
          os << op << ": cannot allocate " << nbytes << " bytes of pinned host memory: " << cudaGetErrorName(err)
             << ": " << cudaGetErrorString(err) << " (" << reserved_ << " bytes of pinned memory held)";
          if (err == cudaErrorMemoryAllocation) throw OutOfMemoryError(os.str());
          throw Error(os.str());
        }
      }
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_[ptr] = Block{cls, {}};
      reserved_ += cls;
      ++num_host_allocs_;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      allocated_ += nbytes;
      ++num_allocs_;
    }
    if (poison_) std::memset(ptr, 0xFF, nbytes);
    return std::shared_ptr<void>(ptr, [this, nbytes](void* p) { release(p, nbytes); });
  }

  // Note [Pinned host cache]: `base` (a block start) is used by work queued on `stream`.
  void record_use(void* base, int device, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.find(base);
    FLAME_CHECK(it != blocks_.end(), "copy_", "internal: a pinned tensor's storage is not a pinned block");
    auto& uses = it->second.uses;
    const std::pair<int, cudaStream_t> use{device, stream};
    if (std::find(uses.begin(), uses.end(), use) == uses.end()) uses.push_back(use);
  }

  Stats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    poll_pending();
    Stats s;
    s.allocated_bytes = allocated_;
    s.reserved_bytes = reserved_;
    s.cached_bytes = cached_;
    s.pending_bytes = pending_bytes_;
    s.num_allocs = num_allocs_;
    s.num_host_allocs = num_host_allocs_;
    return s;
  }

  void empty_cache() {
    std::vector<std::pair<void*, std::size_t>> to_free;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      poll_pending();
      for (auto& [cls, list] : free_) {
        for (void* p : list) to_free.emplace_back(p, cls);
      }
      free_.clear();
      cached_ = 0;
      for (const auto& [p, cls] : to_free) {
        blocks_.erase(p);
        reserved_ -= cls;
      }
    }
    for (const auto& [p, cls] : to_free) {
      if (cudaFreeHost(p) != cudaSuccess) (void)cudaGetLastError();
    }
  }

 private:
  struct Block {
    std::size_t size;                                // its class
    std::vector<std::pair<int, cudaStream_t>> uses;  // streams of copies since it was handed out
  };
  struct Pending {
    void* ptr;
    std::size_t size;
    std::vector<std::pair<int, cudaEvent_t>> events;
  };

  void release(void* p, std::size_t nbytes) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    allocated_ -= nbytes;
    auto it = blocks_.find(p);
    if (it == blocks_.end()) return;  // cannot happen; never free a block we do not know
    Block& b = it->second;
    try {
      Pending pend{p, b.size, {}};
      for (const auto& [device, stream] : b.uses) {
        cudaEvent_t ev = take_event(device);
        if (ev == nullptr) continue;
        int previous = -1;
        if (cudaGetDevice(&previous) == cudaSuccess && previous != device) (void)cudaSetDevice(device);
        if (cudaEventRecord(ev, stream) != cudaSuccess) {
          (void)cudaGetLastError();  // e.g. the runtime is unloading: nothing will read the block
          events_[device].push_back(ev);
        } else {
          pend.events.emplace_back(device, ev);
        }
        if (previous >= 0 && previous != device) (void)cudaSetDevice(previous);
      }
      b.uses.clear();
      if (pend.events.empty()) {
        free_[b.size].push_back(p);
        cached_ += b.size;
      } else {
        pending_bytes_ += b.size;
        pending_.push_back(std::move(pend));
      }
    } catch (...) {  // no host memory for the lists: the block stays allocated (lost until exit)
    }
  }

  cudaEvent_t take_event(int device) {
    auto& pool = events_[device];
    if (!pool.empty()) {
      cudaEvent_t ev = pool.back();
      pool.pop_back();
      return ev;
    }
    int previous = -1;
    if (cudaGetDevice(&previous) == cudaSuccess && previous != device) (void)cudaSetDevice(device);
    cudaEvent_t ev = nullptr;
    if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
      (void)cudaGetLastError();
      ev = nullptr;
    }
    if (previous >= 0 && previous != device) (void)cudaSetDevice(previous);
    return ev;
  }

  // Moves pending blocks whose copies have all completed to the free lists (mutex_ held).
  void poll_pending() {
    for (std::size_t i = 0; i < pending_.size();) {
      Pending& p = pending_[i];
      bool done = true;
      for (const auto& [device, ev] : p.events) {
        const cudaError_t err = cudaEventQuery(ev);
        if (err == cudaErrorNotReady) {
          (void)cudaGetLastError();
          done = false;
          break;
        }
        if (err != cudaSuccess) (void)cudaGetLastError();  // a failed device: the copy will not run
      }
      if (!done) {
        ++i;
        continue;
      }
      for (const auto& [device, ev] : p.events) events_[device].push_back(ev);
      free_[p.size].push_back(p.ptr);
      cached_ += p.size;
      pending_bytes_ -= p.size;
      pending_[i] = std::move(pending_.back());
      pending_.pop_back();
    }
  }

  std::mutex mutex_;
  bool poison_ = false;
  std::unordered_map<void*, Block> blocks_;  // every block obtained from cudaHostAlloc, by address
  std::unordered_map<std::size_t, std::vector<void*>> free_;
  std::vector<Pending> pending_;
  std::unordered_map<int, std::vector<cudaEvent_t>> events_;  // unused events by device
  std::size_t allocated_ = 0, reserved_ = 0, cached_ = 0, pending_bytes_ = 0;
  uint64_t num_allocs_ = 0, num_host_allocs_ = 0;
};

PinnedCache& cache() {
  static PinnedCache* c = new PinnedCache();  // never destroyed (Note [Pinned host cache])
  return *c;
}

}  // namespace

std::shared_ptr<void> allocate(std::size_t nbytes, const char* op) {
  FLAME_CHECK(cuda_is_available(), op, "pinned host memory needs a CUDA device, and none is available");
  return cache().allocate(nbytes, op);
}

bool copy_async(const Tensor& dst, const Tensor& src) {
  const bool h2d = src.device().is_cpu() && dst.device().is_cuda();
  const bool d2h = src.device().is_cuda() && dst.device().is_cpu();
  if (!h2d && !d2h) return false;
  const Tensor& host = h2d ? src : dst;
  const Tensor& dev = h2d ? dst : src;
  if (!host.is_pinned() || src.dtype() != dst.dtype() || src.sizes() != dst.sizes() || !src.is_contiguous() ||
      !dst.is_contiguous()) {
    return false;
  }
  const std::size_t n = dst.nbytes();
  if (n == 0) return true;
  auto& backend = backend::cuda::cuda_backend(dev.device().index);
  DeviceGuard guard(backend.device());
  const cudaStream_t st = backend.stream();
  backend::cuda::check_not_capturing(st, h2d ? "copy_" : "to", "copy between pinned host memory and the device");
  FLAME_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), n,
                                   h2d ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, st));
  cache().record_use(host.impl()->storage->data.get(), backend.device(), st);
  return true;
}

Stats stats() { return cache().stats(); }
void empty_cache() { cache().empty_cache(); }

}  // namespace flame::backend::pinned_host

namespace flame::cuda {
void set_memory_limit(std::size_t bytes, int device) { backend::cuda::cuda_backend(device).pool().set_limit(bytes); }
std::size_t memory_limit(int device) { return backend::cuda::cuda_backend(device).pool().limit(); }
}  // namespace flame::cuda
