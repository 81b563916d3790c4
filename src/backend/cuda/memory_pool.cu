// Note [Stream-ordered pool]
// Each device has one MemoryPool: a cudaMemPool_t of its own (not the device's default pool, so
// that its statistics count FLAME's memory only) served through cudaMallocFromPoolAsync and
// cudaFreeAsync on the device's one stream (Note [One stream per device]).
//  - Stream order. An allocation may be used by any work queued on the stream after it; a free is
//    queued behind every op already queued, so the memory is reused only once those ops have run.
//    Neither call waits for the GPU, and no op ever calls cudaMalloc.
//  - Caching. The pool's release threshold is UINT64_MAX: memory freed to the pool stays reserved
//    by the process and is handed out again without a driver call. It goes back to the driver
//    only in empty_cache() (synchronize, then cudaMemPoolTrimTo(pool, 0)) or when an allocation
//    fails (below).
//  - Out of memory. A failed allocation clears CUDA's last-error state, hands the block cache
//    (below) back to the pool, waits for the stream, trims the pool to zero and tries once more (like PyTorch's allocator freeing its cached
//    blocks). If that fails too it raises flame::Error naming the requested bytes and the pool's
//    state; the process can go on allocating.
//  - Note [Block cache]. In front of the pool sits a host-side cache of freed blocks: a block of at
//    most kMaxCachedBlock (16 MiB) bytes, when freed, goes into a free list keyed by its size
//    rounded up to kGranule (512 B) instead of to cudaFreeAsync, and the next allocation of that
//    rounded size takes it back without any CUDA call (a lock, a hash lookup), where
//    cudaMallocFromPoolAsync + cudaFreeAsync take about a microsecond or more of host time together
//    (bench/host_floor.cu measures both).
//    Reuse is safe for the same reason as the pool's own: every op runs on the one stream, so work
//    queued with the new owner runs after all work queued with the old one. The cache holds at
//    most kMaxCachedTotal (1 GiB); beyond that, and for larger blocks, frees go to the pool.
//    Cached blocks count in reserved_bytes and cached_bytes, not in allocated_bytes; empty_cache()
//    and the out-of-memory path hand them back to the pool first. FLAME_CUDA_BLOCK_CACHE=0 in
//    the environment turns the cache off (the sanitizer runs of scripts/gpu_run.sh do).
//  - Zero bytes: a null pointer, never dereferenced; its deleter only counts the free.
//  - Statistics (flame::cuda::MemoryStats) are atomics updated at allocate and at free:
//    allocated = sum of requested sizes of live allocations, peak = its maximum since the last
//    reset, reserved = the pool's cudaMemPoolAttrReservedMemCurrent (read on demand, no sync).
// The backend that owns the pool is never destroyed (see cuda_backend.cu), so deleters of tensors
// freed during static destruction still find it; their cudaFreeAsync may then fail because the
// CUDA runtime is unloading, which is ignored (the process is exiting).
#include "src/backend/cuda/memory_pool.h"

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>

#include "src/backend/cuda/common.cuh"

namespace flame::backend::cuda {

namespace {

std::string format_bytes(std::size_t n) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace

MemoryPool::MemoryPool(int device, cudaStream_t stream) : device_(device), stream_(stream) {
  // FLAME_CUDA_BLOCK_CACHE=0 turns the block cache off: every tensor is then its own pool
  // allocation, which compute-sanitizer's memcheck tracks one by one.
  const char* env = std::getenv("FLAME_CUDA_BLOCK_CACHE");
  cache_enabled_ = !(env != nullptr && std::string(env) == "0");
  DeviceGuard guard(device);
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  FLAME_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props));
  // Note [Stream-ordered pool]: keep freed memory cached until empty_cache().
  uint64_t threshold = std::numeric_limits<uint64_t>::max();
  FLAME_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold));
}

MemoryPool::~MemoryPool() {
  // Not reached in practice (backends live until exit); best effort, never throws.
  if (pool_ != nullptr) {
    (void)cudaStreamSynchronize(stream_);
    (void)cudaMemPoolDestroy(pool_);
    (void)cudaGetLastError();
  }
}

std::shared_ptr<void> MemoryPool::allocate(std::size_t nbytes) {
  if (nbytes == 0) {
    num_allocs_.fetch_add(1, std::memory_order_relaxed);
    return std::shared_ptr<void>(nullptr, [this](void*) { num_frees_.fetch_add(1, std::memory_order_relaxed); });
  }
  const std::size_t rounded = cache_size(nbytes);
  const bool cacheable = cache_enabled_ && rounded <= kMaxCachedBlock;
  void* ptr = cacheable ? take_cached(rounded) : nullptr;
  if (ptr == nullptr) ptr = allocate_from_pool(cacheable ? rounded : nbytes);
  num_allocs_.fetch_add(1, std::memory_order_relaxed);
  const std::size_t now = allocated_.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
  std::size_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  return std::shared_ptr<void>(ptr, [this, nbytes](void* p) { release(p, nbytes); });
}

void* MemoryPool::allocate_from_pool(std::size_t nbytes) {
  DeviceGuard guard(device_);
  void* ptr = nullptr;
  cudaError_t err = cudaMallocFromPoolAsync(&ptr, nbytes, pool_, stream_);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // an allocation failure is not sticky: clear it so later checks pass
    if (err == cudaErrorMemoryAllocation) {
      // Give the cached memory (the block cache's and the pool's) back to the driver and try once more.
      flush_cache();
      FLAME_CUDA_CHECK(cudaStreamSynchronize(stream_));
      FLAME_CUDA_CHECK(cudaMemPoolTrimTo(pool_, 0));
      err = cudaMallocFromPoolAsync(&ptr, nbytes, pool_, stream_);
      if (err != cudaSuccess) (void)cudaGetLastError();
    }
    if (err != cudaSuccess) raise_out_of_memory(nbytes, err);
  }
  return ptr;
}

void* MemoryPool::take_cached(std::size_t rounded) {
  std::lock_guard<std::mutex> lock(cache_mutex_);
  const auto it = cache_.find(rounded);
  if (it == cache_.end() || it->second.empty()) return nullptr;
  void* ptr = it->second.back();
  it->second.pop_back();
  cached_bytes_.fetch_sub(rounded, std::memory_order_relaxed);
  return ptr;
}

void MemoryPool::release(void* ptr, std::size_t nbytes) noexcept {
  num_frees_.fetch_add(1, std::memory_order_relaxed);
  allocated_.fetch_sub(nbytes, std::memory_order_relaxed);
  const std::size_t rounded = cache_size(nbytes);
  if (cache_enabled_ && rounded <= kMaxCachedBlock) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cached_bytes_.load(std::memory_order_relaxed) + rounded <= kMaxCachedTotal) {
      try {
        cache_[rounded].push_back(ptr);
        cached_bytes_.fetch_add(rounded, std::memory_order_relaxed);
        return;
      } catch (...) {  // no host memory for the list: free the block to the pool instead
      }
    }
  }
  // Stream-ordered free: the memory returns to the pool after every op queued so far has run.
  int previous = -1;
  if (cudaGetDevice(&previous) == cudaSuccess && previous != device_) (void)cudaSetDevice(device_);
  if (cudaFreeAsync(ptr, stream_) != cudaSuccess) (void)cudaGetLastError();  // e.g. runtime unloading
  if (previous >= 0 && previous != device_) (void)cudaSetDevice(previous);
}

void MemoryPool::flush_cache() {
  std::unordered_map<std::size_t, std::vector<void*>> blocks;
  {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    blocks.swap(cache_);
    cached_bytes_.store(0, std::memory_order_relaxed);
  }
  DeviceGuard guard(device_);
  for (auto& [size, list] : blocks) {
    for (void* p : list) FLAME_CUDA_CHECK(cudaFreeAsync(p, stream_));
  }
}

std::size_t MemoryPool::reserved_bytes() const {
  uint64_t reserved = 0;
  FLAME_CUDA_CHECK(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &reserved));
  return static_cast<std::size_t>(reserved);
}

::flame::cuda::MemoryStats MemoryPool::stats() const {
  ::flame::cuda::MemoryStats s;
  s.allocated_bytes = allocated_.load(std::memory_order_relaxed);
  s.reserved_bytes = reserved_bytes();
  s.cached_bytes = cached_bytes_.load(std::memory_order_relaxed);
  s.peak_allocated_bytes = peak_.load(std::memory_order_relaxed);
  s.num_allocs = num_allocs_.load(std::memory_order_relaxed);
  s.num_frees = num_frees_.load(std::memory_order_relaxed);
  s.num_ooms = num_ooms_.load(std::memory_order_relaxed);
  return s;
}

void MemoryPool::reset_peak() { peak_.store(allocated_.load(std::memory_order_relaxed), std::memory_order_relaxed); }

void MemoryPool::empty_cache() {
  flush_cache();
  DeviceGuard guard(device_);
  FLAME_CUDA_CHECK(cudaStreamSynchronize(stream_));
  FLAME_CUDA_CHECK(cudaMemPoolTrimTo(pool_, 0));
}

void MemoryPool::raise_out_of_memory(std::size_t nbytes, cudaError_t err) {
  std::ostringstream os;
  if (err == cudaErrorMemoryAllocation) {
    num_ooms_.fetch_add(1, std::memory_order_relaxed);
    os << "out of memory on cuda:" << device_ << " allocating " << nbytes << " bytes (" << format_bytes(nbytes)
       << ")";
  } else {
    os << "allocating " << nbytes << " bytes (" << format_bytes(nbytes) << ") on cuda:" << device_
       << " failed: " << cudaGetErrorName(err) << ": " << cudaGetErrorString(err);
  }
  std::size_t reserved = 0;
  uint64_t r = 0;
  if (cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &r) == cudaSuccess) reserved = r;
  os << "; the pool holds " << allocated_.load() << " bytes (" << format_bytes(allocated_.load())
     << ") allocated by live tensors and " << reserved << " bytes (" << format_bytes(reserved)
     << ") reserved" << (err == cudaErrorMemoryAllocation ? " after releasing its cache and retrying" : "");
  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    os << "; the device has " << format_bytes(free_bytes) << " free of " << format_bytes(total_bytes);
  }
  (void)cudaGetLastError();
  FLAME_FAIL("cuda allocate", os.str());
}

}  // namespace flame::backend::cuda
