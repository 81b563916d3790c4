// Note [Stream-ordered pool]
// Each device has one MemoryPool: a cudaMemPool_t of its own (not the device's default pool, so
// that its statistics count FLAME's memory only) served through cudaMallocFromPoolAsync and
// cudaFreeAsync, plus a host-side block cache in front of it and a private pool per CUDA graph.
//  - Stream order. A block is allocated on the allocating thread's current stream (its "alloc
//    stream", Note [Current stream] in cuda_backend.h) and may be used by any work queued on that
//    stream after it. When freed, it is freed on its alloc stream: behind every op queued there
//    so far, so it is reused only once those ops have run. Neither call waits for the GPU, and no
//    op ever calls cudaMalloc (graph-private pools aside, below). The cudaMemPool_t hands memory
//    freed on one stream to another only once the free is known complete (its default reuse
//    policy: event dependencies, opportunistic reuse).
//  - Caching. The pool's release threshold is UINT64_MAX: memory freed to the pool stays reserved
//    by the process and is handed out again without a driver call. It goes back to the driver
//    only in empty_cache() (synchronize, then cudaMemPoolTrimTo(pool, 0)) or when an allocation
//    fails (below).
//  - Out of memory. A failed allocation clears CUDA's last-error state, waits for the pending
//    record_stream blocks, hands the block cache back to the pool, waits for the device, trims
//    the pool to zero and tries once more (like PyTorch's allocator freeing its cached blocks).
//    If that fails too (or a graph capture forbids waiting) it raises flame::Error naming the
//    requested bytes and the pool's state; the process can go on allocating.
//  - Note [Block cache]. A freed block of at most kMaxCachedBlock (16 MiB) bytes goes into a free
//    list keyed by (alloc stream, size rounded up to kGranule = 512 B) instead of to cudaFreeAsync,
//    and the next allocation of that rounded size *on the same stream* takes it back without any
//    CUDA call (a lock, a hash lookup), where cudaMallocFromPoolAsync + cudaFreeAsync take about a
//    microsecond or more of host time together (bench/host_floor.cu measures both).
//    Who may be handed a cached block (the exact-size reuse rule):
//      * only an allocation on the block's alloc stream: work queued for the new owner runs after
//        all work queued for the old one on that stream, so no event is needed;
//      * never while another stream may still use it: a block recorded on other streams
//        (cuda::record_stream, Note [Record stream]) waits in `pending_` until events recorded on
//        those streams at free time have completed, and only then enters the cache;
//      * never while a CUDA graph may still write it: blocks allocated during a capture belong to
//        the graph's private pool and never enter this cache; blocks of the shared pool freed
//        while a capture is running are retained by the graph until it is destroyed (its replays
//        may read them), then recycled as above (Note [Graph-private pool]).
//    The cache holds at most kMaxCachedTotal (1 GiB); beyond that, and for larger blocks, frees go
//    to the pool. Cached blocks count in reserved_bytes and cached_bytes, not in
//    allocated_bytes; empty_cache() and the out-of-memory path hand them back to the pool first.
//    FLAME_CUDA_BLOCK_CACHE=0 in the environment turns the cache off (the sanitizer runs of
//    scripts/gpu_run.sh do).
//  - Note [Record stream]. record_stream(base, s) notes that the block is used on stream s. At free
//    time the pool records one event on each such stream other than the alloc stream and parks
//    the block in `pending_`; allocations that miss the cache poll the events (cudaEventQuery, no
//    waiting) and move finished blocks into the cache. Like PyTorch's CUDACachingAllocator, this
//    adds no dependency between streams: the alloc stream never waits for the others.
//  - Note [Graph-private pool]. While a thread captures a cuda::Graph on this device, its
//    allocations come from the graph's GraphPool: segments cudaMalloc'd (the capture mode is
//    relaxed for that one call) and cut into ranges. A request takes the smallest free range
//    that fits (best fit), split when larger; a freed range is merged with free neighbours of
//    its segment. So memory freed during the capture (activations released in backward) serves
//    later requests of any size, as the eager pool's would: the captured work is one stream, so
//    replays run it in capture order and a range's last reader precedes its next writer. After
//    the capture the graph keeps everything: a range freed then stays in the graph's pool, not
//    in the shared cache, because replays still write it. When the graph is destroyed (after its
//    last replay finished), wholly free segments are cudaFree'd, and the others when the tensors
//    holding their last ranges are freed. A capture never calls cudaMallocFromPoolAsync or
//    cudaFreeAsync on the capturing stream (that would add allocation nodes to the graph).
//  - Note [Poisoned allocations]. With FLAME_POISON_ALLOC set (the test suite sets it), every
//    allocation is filled with 0xFF bytes (NaN in every float dtype) by a cudaMemsetAsync on its
//    stream, so a kernel that leaves an output element unwritten cannot pass because a cached
//    block already held the right answer (the CPU allocator does the same).
//  - Note [Memory limit]. cuda::set_memory_limit(bytes) caps the reserved memory of the shared
//    pool (like torch.cuda.set_per_process_memory_fraction). An allocation served from the
//    driver pool that leaves reserved_bytes above the cap is freed again and treated as a failed
//    allocation: the out-of-memory path above releases the pending, cached and trimmable memory
//    and retries once; if reserved memory is still above the cap the block is freed, the pool
//    trimmed and the out-of-memory error names the cap. Cached blocks (block cache hits) never
//    grow reserved memory, so the check costs nothing on the hot path; without a cap (0, the
//    default) nothing changes. Graph-private pools are not capped (a capture cannot wait).
//    The cap is checked after the fact against what the driver pool reserved, which grows in
//    chunks that may be larger than the request (and stays while any block in it is live).
//  - Zero bytes: a null pointer, never dereferenced; its deleter only counts the free.
//  - Statistics (flame::cuda::MemoryStats) are atomics updated at allocate and at free:
//    allocated = sum of requested sizes of live allocations, peak = its maximum since the last
//    reset, reserved = the pool's cudaMemPoolAttrReservedMemCurrent (read on demand, no sync)
//    plus the graph pools' bytes, fragmentation = reserved - allocated.
//  - Note [Peak reserved]. peak_reserved = the largest reserved_bytes seen after an allocation that
//    took memory from the driver pool since the last reset, and at the time of reading (the graph
//    pools grow during captures, when the pool's attributes may not be read: they count as they
//    are when the stats are read); the reset starts it at the current reserved bytes. It is
//    sampled, not read from cudaMemPoolAttrReservedMemHigh, because an allocation refused by the
//    memory limit briefly reserves more than the cap before it is given back, and that is not
//    memory the program held. Block cache hits never grow reserved memory, so the hot path reads
//    nothing.
// The backend that owns the pool is never destroyed (see cuda_backend.cu), so deleters of tensors
// freed during static destruction still find it; their cudaFreeAsync may then fail because the
// CUDA runtime is unloading, which is ignored (the process is exiting).
#include "src/backend/cuda/memory_pool.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>

#include "src/backend/cuda/common.cuh"
#include "src/core/profiler_context.h"

namespace flame::backend::cuda {

namespace {

constexpr int kMaxPoolDevices = 64;
// The graph pool the calling thread captures into, per device (Note [Graph-private pool]).
thread_local GraphPool* t_capture_pool[kMaxPoolDevices] = {};

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

// Runs a call that captures forbid (cudaMalloc) with this thread's capture mode relaxed.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureMode() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// Restores the device current before a deleter ran; never throws.
class QuietDeviceGuard {
 public:
  explicit QuietDeviceGuard(int device) : device_(device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) (void)cudaSetDevice(device);
  }
  ~QuietDeviceGuard() {
    if (previous_ >= 0 && previous_ != device_) (void)cudaSetDevice(previous_);
  }

 private:
  int device_;
  int previous_ = -1;
};

}  // namespace

bool thread_is_capturing(int device) {
  return device >= 0 && device < kMaxPoolDevices && t_capture_pool[device] != nullptr;
}

MemoryPool::MemoryPool(int device, cudaStream_t default_stream) : device_(device), default_stream_(default_stream) {
  // FLAME_CUDA_BLOCK_CACHE=0 turns the block cache off: every tensor is then its own pool
  // allocation, which compute-sanitizer's memcheck tracks one by one.
  const char* env = std::getenv("FLAME_CUDA_BLOCK_CACHE");
  cache_enabled_ = !(env != nullptr && std::string(env) == "0");
  const char* poison = std::getenv("FLAME_POISON_ALLOC");
  poison_ = poison != nullptr && std::string(poison) != "0";
  FLAME_CHECK(device >= 0 && device < kMaxPoolDevices, "cuda", "device index ", device, " out of range");
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
    (void)cudaDeviceSynchronize();
    for (cudaEvent_t e : free_events_) (void)cudaEventDestroy(e);
    (void)cudaMemPoolDestroy(pool_);
    (void)cudaGetLastError();
  }
}

void MemoryPool::count_alloc(std::size_t nbytes) {
  num_allocs_.fetch_add(1, std::memory_order_relaxed);
  const std::size_t now = allocated_.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
  std::size_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void MemoryPool::poison(void* ptr, std::size_t nbytes, cudaStream_t stream) {
  // Note [Poisoned allocations]: 0xFF bytes are NaN in f16, bf16, f32 and f64.
  if (poison_) FLAME_CUDA_CHECK(cudaMemsetAsync(ptr, 0xFF, nbytes, stream));
}

std::shared_ptr<void> MemoryPool::allocate(std::size_t nbytes, cudaStream_t stream) {
  if (nbytes == 0) {
    num_allocs_.fetch_add(1, std::memory_order_relaxed);
    return std::shared_ptr<void>(nullptr, [this](void*) { num_frees_.fetch_add(1, std::memory_order_relaxed); });
  }
  if (GraphPool* gp = t_capture_pool[device_]) {
    std::shared_ptr<GraphPool> owner;
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      for (const auto& p : capture_pools_) {
        if (p.get() == gp) owner = p;
      }
    }
    if (owner) return allocate_private(*gp, owner, nbytes, stream);
  }
  const std::size_t rounded = cache_size(nbytes);
  const bool cacheable = cache_enabled_ && rounded <= kMaxCachedBlock;
  void* ptr = cacheable ? take_cached(stream, rounded) : nullptr;
  if (ptr == nullptr && pending_bytes_.load(std::memory_order_relaxed) > 0) {
    process_pending(false);
    if (cacheable) ptr = take_cached(stream, rounded);
  }
  if (ptr == nullptr) ptr = allocate_from_pool(cacheable ? rounded : nbytes, stream);
  count_alloc(nbytes);
  if (profiler_detail::recording()) profiler_detail::on_alloc(ptr, nbytes, device_, stream);
  poison(ptr, nbytes, stream);
  return std::shared_ptr<void>(ptr, [this, nbytes, stream](void* p) { release(p, nbytes, stream); });
}

char* GraphPool::release_range(char* p) {
  auto it = ranges.find(p);
  it->second.free = true;
  // Merge with the next range of the same segment.
  auto next = std::next(it);
  if (next != ranges.end() && next->second.free && next->second.segment == it->second.segment) {
    auto [b, e] = free_by_size.equal_range(next->second.size);
    for (auto f = b; f != e; ++f)
      if (f->second == next->first) {
        free_by_size.erase(f);
        break;
      }
    it->second.size += next->second.size;
    ranges.erase(next);
  }
  // And with the previous one.
  if (it != ranges.begin()) {
    auto prev = std::prev(it);
    if (prev->second.free && prev->second.segment == it->second.segment) {
      auto [b, e] = free_by_size.equal_range(prev->second.size);
      for (auto f = b; f != e; ++f)
        if (f->second == prev->first) {
          free_by_size.erase(f);
          break;
        }
      prev->second.size += it->second.size;
      ranges.erase(it);
      it = prev;
    }
  }
  free_by_size.emplace(it->second.size, it->first);
  return it->first;
}

std::shared_ptr<void> MemoryPool::allocate_private(GraphPool& gp, const std::shared_ptr<GraphPool>& owner,
                                                   std::size_t nbytes, cudaStream_t stream) {
  const std::size_t rounded = cache_size(nbytes);
  char* ptr = nullptr;
  {
    std::lock_guard<std::mutex> lock(gp.mutex);
    auto fit = gp.free_by_size.lower_bound(rounded);
    if (fit != gp.free_by_size.end()) {
      ptr = fit->second;
      const std::size_t size = fit->first;
      gp.free_by_size.erase(fit);
      GraphPool::Range& r = gp.ranges.at(ptr);
      r.free = false;
      if (size > rounded) {  // split: the rest stays free
        r.size = rounded;
        gp.ranges.emplace(ptr + rounded, GraphPool::Range{size - rounded, r.segment, true});
        gp.free_by_size.emplace(size - rounded, ptr + rounded);
      }
    }
  }
  if (ptr == nullptr) {
    DeviceGuard guard(device_);
    void* raw = nullptr;
    {
      RelaxedCaptureMode relaxed;  // cudaMalloc is not stream work: legal during capture in relaxed mode
      const cudaError_t err = cudaMalloc(&raw, rounded);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        raise_out_of_memory(rounded, err);
      }
    }
    ptr = static_cast<char*>(raw);
    std::lock_guard<std::mutex> lock(gp.mutex);
    gp.ranges.emplace(ptr, GraphPool::Range{rounded, ptr, false});
    gp.segments.emplace(ptr, rounded);
    gp.reserved += rounded;
    graph_reserved_.fetch_add(rounded, std::memory_order_relaxed);
  }
  count_alloc(nbytes);
  if (profiler_detail::recording()) profiler_detail::on_alloc(ptr, nbytes, device_, stream);
  poison(ptr, nbytes, stream);  // captured: every replay re-poisons
  return std::shared_ptr<void>(ptr, [this, owner, nbytes, stream](void* p) {
    if (profiler_detail::recording()) profiler_detail::on_free(p, nbytes, device_, stream);
    num_frees_.fetch_add(1, std::memory_order_relaxed);
    allocated_.fetch_sub(nbytes, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(owner->mutex);
    try {
      char* merged = owner->release_range(static_cast<char*>(p));
      if (owner->graph_alive) return;
      // The graph is gone: a segment that is now wholly free goes back to the driver.
      const GraphPool::Range r = owner->ranges.at(merged);
      const auto seg = owner->segments.find(r.segment);
      if (merged != r.segment || seg == owner->segments.end() || r.size != seg->second) return;
      auto [b, e] = owner->free_by_size.equal_range(r.size);
      for (auto f = b; f != e; ++f)
        if (f->second == merged) {
          owner->free_by_size.erase(f);
          break;
        }
      owner->ranges.erase(merged);
      owner->segments.erase(seg);
      QuietDeviceGuard guard(device_);
      if (cudaFree(merged) != cudaSuccess) (void)cudaGetLastError();
      owner->reserved -= r.size;
      graph_reserved_.fetch_sub(r.size, std::memory_order_relaxed);
    } catch (...) {  // no host memory for the bookkeeping: the range is lost to the graph until exit
    }
  });
}

void* MemoryPool::allocate_from_pool(std::size_t nbytes, cudaStream_t stream) {
  DeviceGuard guard(device_);
  void* ptr = nullptr;
  cudaError_t err = cudaMallocFromPoolAsync(&ptr, nbytes, pool_, stream);
  if (err == cudaSuccess && over_limit()) {  // Note [Memory limit]: as if the driver had refused
    give_back_over_limit(ptr, stream);
    ptr = nullptr;
    err = cudaErrorMemoryAllocation;
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // an allocation failure is not sticky: clear it so later checks pass
    // Waiting for the device would break a capture running on some thread: no retry then.
    if (err == cudaErrorMemoryAllocation && !capture_active()) {
      // Give the cached memory (pending, the block cache's and the pool's) back and try once more.
      process_pending(true);
      flush_cache();
      FLAME_CUDA_CHECK(cudaDeviceSynchronize());
      FLAME_CUDA_CHECK(cudaMemPoolTrimTo(pool_, 0));
      err = cudaMallocFromPoolAsync(&ptr, nbytes, pool_, stream);
      if (err != cudaSuccess) (void)cudaGetLastError();
      if (err == cudaSuccess && over_limit()) {
        give_back_over_limit(ptr, stream);
        ptr = nullptr;
        err = cudaErrorMemoryAllocation;
      }
    }
    if (err != cudaSuccess) raise_out_of_memory(nbytes, err);
  }
  note_reserved();
  return ptr;
}

void MemoryPool::note_reserved() {
  if (capture_active()) return;  // the pool's attributes may not be read while a stream captures
  const std::size_t now = reserved_bytes();
  std::size_t peak = peak_reserved_.load(std::memory_order_relaxed);
  while (now > peak && !peak_reserved_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

bool MemoryPool::over_limit() const {
  const std::size_t cap = limit();
  return cap != 0 && reserved_bytes() > cap;
}

void MemoryPool::give_back_over_limit(void* ptr, cudaStream_t stream) {
  FLAME_CUDA_CHECK(cudaFreeAsync(ptr, stream));
  if (capture_active()) return;  // cannot wait: the memory stays reserved until the next trim
  FLAME_CUDA_CHECK(cudaStreamSynchronize(stream));
  FLAME_CUDA_CHECK(cudaMemPoolTrimTo(pool_, 0));
}

void* MemoryPool::take_cached(cudaStream_t stream, std::size_t rounded) {
  std::lock_guard<std::mutex> lock(cache_mutex_);
  const auto it = cache_.find(CacheKey{stream, rounded});
  if (it == cache_.end() || it->second.empty()) return nullptr;
  void* ptr = it->second.back();
  it->second.pop_back();
  cached_bytes_.fetch_sub(rounded, std::memory_order_relaxed);
  return ptr;
}

void MemoryPool::record_stream(void* base, cudaStream_t stream) {
  if (base == nullptr) return;
  std::lock_guard<std::mutex> lock(cache_mutex_);
  auto& streams = recorded_[base];
  if (std::find(streams.begin(), streams.end(), stream) == streams.end()) streams.push_back(stream);
  any_recorded_.store(true, std::memory_order_release);
}

void MemoryPool::release(void* ptr, std::size_t nbytes, cudaStream_t stream) noexcept {
  // Before the block can be reused (a trace never shows it allocated before its last free).
  if (profiler_detail::recording()) profiler_detail::on_free(ptr, nbytes, device_, stream);
  num_frees_.fetch_add(1, std::memory_order_relaxed);
  allocated_.fetch_sub(nbytes, std::memory_order_relaxed);
  recycle(ptr, nbytes, stream);
}

void MemoryPool::recycle(void* ptr, std::size_t nbytes, cudaStream_t stream) noexcept {
  std::vector<cudaStream_t> streams;
  if (any_recorded_.load(std::memory_order_acquire) || captures_active_.load(std::memory_order_acquire) > 0) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    auto it = recorded_.find(ptr);
    if (it != recorded_.end()) {
      streams = std::move(it->second);
      recorded_.erase(it);
      if (recorded_.empty()) any_recorded_.store(false, std::memory_order_release);
    }
    if (!capture_pools_.empty()) {
      // Note [Graph-private pool]: a running capture may have recorded reads of this block.
      GraphPool* mine = t_capture_pool[device_];
      std::shared_ptr<GraphPool> gp = capture_pools_.front();
      for (const auto& p : capture_pools_) {
        if (p.get() == mine) gp = p;
      }
      try {
        std::lock_guard<std::mutex> glock(gp->mutex);
        gp->retained.push_back({ptr, nbytes, stream});
        // The recorded streams still matter after the graph: keep them with the block.
        if (!streams.empty()) {
          recorded_[ptr] = std::move(streams);
          any_recorded_.store(true, std::memory_order_release);
        }
        return;
      } catch (...) {  // no host memory: fall through and free it (best effort)
      }
    }
    streams.erase(std::remove(streams.begin(), streams.end(), stream), streams.end());
    if (!streams.empty()) {
      // Note [Record stream]: one event per other stream, recorded now, polled later.
      QuietDeviceGuard guard(device_);
      try {
        Pending p{ptr, nbytes, stream, {}};
        for (cudaStream_t s : streams) {
          cudaEvent_t ev = nullptr;
          if (!free_events_.empty()) {
            ev = free_events_.back();
            free_events_.pop_back();
          } else if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
            (void)cudaGetLastError();
            continue;  // cannot track this stream: wait for it instead below
          }
          if (cudaEventRecord(ev, s) != cudaSuccess) {
            (void)cudaGetLastError();
            free_events_.push_back(ev);
            continue;
          }
          p.events.push_back(ev);
        }
        pending_bytes_.fetch_add(cache_size(nbytes), std::memory_order_relaxed);
        pending_.push_back(std::move(p));
        return;
      } catch (...) {
      }
    }
  }
  cache_or_free(ptr, nbytes, stream);
}

void MemoryPool::cache_or_free(void* ptr, std::size_t nbytes, cudaStream_t stream) noexcept {
  const std::size_t rounded = cache_size(nbytes);
  if (cache_enabled_ && rounded <= kMaxCachedBlock) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cached_bytes_.load(std::memory_order_relaxed) + rounded <= kMaxCachedTotal) {
      try {
        cache_[CacheKey{stream, rounded}].push_back(ptr);
        cached_bytes_.fetch_add(rounded, std::memory_order_relaxed);
        return;
      } catch (...) {  // no host memory for the list: free the block to the pool instead
      }
    }
  }
  // Stream-ordered free: the memory returns to the pool after every op queued so far has run.
  QuietDeviceGuard guard(device_);
  if (cudaFreeAsync(ptr, stream) != cudaSuccess) (void)cudaGetLastError();  // e.g. runtime unloading
}

void MemoryPool::process_pending(bool wait) {
  std::vector<Pending> done;
  {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    DeviceGuard guard(device_);
    for (std::size_t i = 0; i < pending_.size();) {
      bool finished = true;
      for (cudaEvent_t ev : pending_[i].events) {
        const cudaError_t err = wait ? cudaEventSynchronize(ev) : cudaEventQuery(ev);
        if (err == cudaErrorNotReady) {
          (void)cudaGetLastError();
          finished = false;
          break;
        }
        if (err != cudaSuccess) FLAME_CUDA_CHECK(err);
      }
      if (finished) {
        for (cudaEvent_t ev : pending_[i].events) free_events_.push_back(ev);
        pending_bytes_.fetch_sub(cache_size(pending_[i].nbytes), std::memory_order_relaxed);
        done.push_back(std::move(pending_[i]));
        pending_[i] = std::move(pending_.back());
        pending_.pop_back();
      } else {
        ++i;
      }
    }
  }
  for (const Pending& p : done) cache_or_free(p.ptr, p.nbytes, p.stream);
}

void MemoryPool::flush_cache() {
  std::unordered_map<CacheKey, std::vector<void*>, CacheKeyHash> blocks;
  {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    blocks.swap(cache_);
    cached_bytes_.store(0, std::memory_order_relaxed);
  }
  DeviceGuard guard(device_);
  for (auto& [key, list] : blocks) {
    for (void* p : list) FLAME_CUDA_CHECK(cudaFreeAsync(p, key.stream));
  }
}

void MemoryPool::begin_capture(const std::shared_ptr<GraphPool>& pool) {
  FLAME_CHECK(t_capture_pool[device_] == nullptr, "cuda::Graph::capture_begin",
              "this thread is already capturing a graph on cuda:", device_);
  std::lock_guard<std::mutex> lock(cache_mutex_);
  capture_pools_.push_back(pool);
  captures_active_.fetch_add(1, std::memory_order_acq_rel);
  t_capture_pool[device_] = pool.get();
}

void MemoryPool::end_capture(const std::shared_ptr<GraphPool>& pool) {
  std::lock_guard<std::mutex> lock(cache_mutex_);
  const auto it = std::find(capture_pools_.begin(), capture_pools_.end(), pool);
  if (it == capture_pools_.end()) return;
  capture_pools_.erase(it);
  captures_active_.fetch_sub(1, std::memory_order_acq_rel);
  if (t_capture_pool[device_] == pool.get()) t_capture_pool[device_] = nullptr;
}

void MemoryPool::release_graph_pool(const std::shared_ptr<GraphPool>& pool) {
  std::vector<GraphPool::Retained> retained;
  {
    std::lock_guard<std::mutex> lock(pool->mutex);
    if (!pool->graph_alive) return;
    pool->graph_alive = false;
    QuietDeviceGuard guard(device_);
    // Segments that are one free range (free neighbours are always merged) go back now; the
    // others when the tensors holding their ranges are freed (allocate_private's deleter).
    for (auto seg = pool->segments.begin(); seg != pool->segments.end();) {
      const auto r = pool->ranges.find(seg->first);
      if (r == pool->ranges.end() || !r->second.free || r->second.size != seg->second) {
        ++seg;
        continue;
      }
      auto [b, e] = pool->free_by_size.equal_range(r->second.size);
      for (auto f = b; f != e; ++f)
        if (f->second == seg->first) {
          pool->free_by_size.erase(f);
          break;
        }
      pool->ranges.erase(r);
      if (cudaFree(seg->first) != cudaSuccess) (void)cudaGetLastError();
      pool->reserved -= seg->second;
      graph_reserved_.fetch_sub(seg->second, std::memory_order_relaxed);
      seg = pool->segments.erase(seg);
    }
    retained.swap(pool->retained);
  }
  for (const auto& r : retained) recycle(r.ptr, r.nbytes, r.stream);
}

std::size_t MemoryPool::reserved_bytes() const {
  uint64_t reserved = 0;
  FLAME_CUDA_CHECK(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &reserved));
  return static_cast<std::size_t>(reserved) + graph_reserved_.load(std::memory_order_relaxed);
}

::flame::cuda::MemoryStats MemoryPool::stats() const {
  ::flame::cuda::MemoryStats s;
  s.allocated_bytes = allocated_.load(std::memory_order_relaxed);
  s.reserved_bytes = reserved_bytes();
  s.cached_bytes = cached_bytes_.load(std::memory_order_relaxed);
  s.peak_allocated_bytes = peak_.load(std::memory_order_relaxed);
  s.peak_reserved_bytes = std::max(peak_reserved_.load(std::memory_order_relaxed), s.reserved_bytes);
  s.fragmentation_bytes = s.reserved_bytes > s.allocated_bytes ? s.reserved_bytes - s.allocated_bytes : 0;
  s.graph_pool_bytes = graph_reserved_.load(std::memory_order_relaxed);
  s.pending_stream_bytes = pending_bytes_.load(std::memory_order_relaxed);
  s.num_allocs = num_allocs_.load(std::memory_order_relaxed);
  s.num_frees = num_frees_.load(std::memory_order_relaxed);
  s.num_ooms = num_ooms_.load(std::memory_order_relaxed);
  return s;
}

void MemoryPool::reset_peak() {
  peak_.store(allocated_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  peak_reserved_.store(reserved_bytes(), std::memory_order_relaxed);
}

void MemoryPool::empty_cache() {
  FLAME_CHECK(!capture_active(), "cuda::empty_cache",
              "cannot empty the cache while a CUDA graph is being captured on cuda:", device_);
  DeviceGuard guard(device_);
  process_pending(true);
  flush_cache();
  FLAME_CUDA_CHECK(cudaDeviceSynchronize());
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
  reserved += graph_reserved_.load();
  os << "; the pool holds " << allocated_.load() << " bytes (" << format_bytes(allocated_.load())
     << ") allocated by live tensors and " << reserved << " bytes (" << format_bytes(reserved) << ") reserved"
     << (err == cudaErrorMemoryAllocation && !capture_active() ? " after releasing its cache and retrying" : "");
  if (capture_active()) os << " (a CUDA graph capture is running: the cache was not released)";
  if (limit() != 0) {
    os << "; the memory limit (cuda::set_memory_limit) is " << limit() << " bytes (" << format_bytes(limit()) << ")";
  }
  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    os << "; the device has " << format_bytes(free_bytes) << " free of " << format_bytes(total_bytes);
  }
  (void)cudaGetLastError();
  if (err == cudaErrorMemoryAllocation) throw OutOfMemoryError("cuda allocate: " + os.str());
  FLAME_FAIL("cuda allocate", os.str());
}

}  // namespace flame::backend::cuda
