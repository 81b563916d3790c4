#pragma once
// The stream-ordered device memory pool of one CUDA device. See Note [Stream-ordered pool] in
// memory_pool.cu and docs/memory-pool.md.
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "flame/cuda.h"

namespace flame::backend::cuda {

// The private pool of one cuda::Graph (Note [Graph-private pool] in memory_pool.cu). Shared by the
// graph and by the deleters of the blocks it handed out; all fields are guarded by `mutex`.
struct GraphPool {
  struct Retained {  // a block of the shared pool freed during the capture
    void* ptr;
    std::size_t nbytes;
    cudaStream_t stream;
  };
  // A piece of a segment (one cudaMalloc): handed out, or free. Free neighbours are merged.
  struct Range {
    std::size_t size;
    char* segment;
    bool free;
  };
  std::mutex mutex;
  bool graph_alive = true;
  std::map<char*, Range> ranges;                   // every range of every segment, by address
  std::multimap<std::size_t, char*> free_by_size;  // the free ranges, for best fit
  std::unordered_map<char*, std::size_t> segments; // segment base -> bytes cudaMalloc'd
  std::size_t reserved = 0;                        // bytes cudaMalloc'd
  std::vector<Retained> retained;

  // Marks the range at p free and merges it with free neighbours of its segment; returns the
  // merged range's address.
  char* release_range(char* p);
};

// True while the calling thread captures a cuda::Graph on `device`.
bool thread_is_capturing(int device);

class MemoryPool {
 public:
  // Creates the pool of `device`; `default_stream` is the backend's own stream.
  MemoryPool(int device, cudaStream_t default_stream);
  ~MemoryPool();
  MemoryPool(const MemoryPool&) = delete;
  MemoryPool& operator=(const MemoryPool&) = delete;

  // `nbytes` of device memory, usable by work queued on `stream` from now on. The deleter
  // returns it to the pool in the order of `stream` (Note [Stream-ordered pool]). Zero bytes gives
  // a null pointer that is never dereferenced. Raises flame::Error on out of memory. While the
  // calling thread captures a graph, the block comes from the graph's private pool.
  std::shared_ptr<void> allocate(std::size_t nbytes, cudaStream_t stream);

  // Note [Record stream]: the block at `base` is used by work on `stream`.
  void record_stream(void* base, cudaStream_t stream);

  ::flame::cuda::MemoryStats stats() const;
  void reset_peak();
  // Returns every cached, unused byte to the driver; waits for the device first.
  void empty_cache();

  // Graph capture (Note [Graph-private pool]): between begin and end, allocations of the calling
  // thread on this device come from `pool`, and shared blocks freed on any thread are retained.
  void begin_capture(const std::shared_ptr<GraphPool>& pool);
  void end_capture(const std::shared_ptr<GraphPool>& pool);
  // The graph is gone (its replays have finished): frees its unused private blocks and returns
  // the blocks it retained to the shared pool.
  void release_graph_pool(const std::shared_ptr<GraphPool>& pool);
  bool capture_active() const { return captures_active_.load(std::memory_order_acquire) > 0; }

  // Note [Block cache]: freed blocks of at most kMaxCachedBlock bytes are kept, keyed by their
  // stream and their size rounded up to kGranule, while the cache holds at most kMaxCachedTotal.
  static constexpr std::size_t kGranule = 512;
  static constexpr std::size_t kMaxCachedBlock = std::size_t{16} << 20;
  static constexpr std::size_t kMaxCachedTotal = std::size_t{1} << 30;
  // The size a block of `nbytes` is cached under: rounded up so that nearby sizes share blocks.
  static constexpr std::size_t cache_size(std::size_t nbytes) { return (nbytes + kGranule - 1) / kGranule * kGranule; }

  cudaMemPool_t handle() const { return pool_; }
  int device() const { return device_; }

  // Note [Memory limit] (memory_pool.cu): reserved memory may not grow above `bytes` (0: no limit).
  void set_limit(std::size_t bytes) { limit_.store(bytes, std::memory_order_relaxed); }
  std::size_t limit() const { return limit_.load(std::memory_order_relaxed); }

 private:
  struct CacheKey {
    cudaStream_t stream;
    std::size_t size;
    bool operator==(const CacheKey& o) const { return stream == o.stream && size == o.size; }
  };
  struct CacheKeyHash {
    std::size_t operator()(const CacheKey& k) const {
      return std::hash<const void*>()(k.stream) * 31u + std::hash<std::size_t>()(k.size);
    }
  };
  struct Pending {  // a freed block waiting for the streams it was recorded on
    void* ptr;
    std::size_t nbytes;
    cudaStream_t stream;
    std::vector<cudaEvent_t> events;
  };

  // The deleter's path: counts the free, then recycle().
  void release(void* ptr, std::size_t nbytes, cudaStream_t stream) noexcept;
  // Puts a block no tensor uses back: retained by a capturing graph, pending on recorded
  // streams, cached, or freed to the pool on `stream`.
  void recycle(void* ptr, std::size_t nbytes, cudaStream_t stream) noexcept;
  // Cache it or free it to the pool (no capture, no recorded streams).
  void cache_or_free(void* ptr, std::size_t nbytes, cudaStream_t stream) noexcept;
  std::shared_ptr<void> allocate_private(GraphPool& gp, const std::shared_ptr<GraphPool>& owner, std::size_t nbytes,
                                         cudaStream_t stream);
  // A block from the cache (nullptr when none of that stream and size is cached).
  void* take_cached(cudaStream_t stream, std::size_t rounded);
  // Moves pending blocks whose streams are done into the cache; `wait` waits for all of them.
  void process_pending(bool wait);
  // Hands every cached block back to the pool (stream-ordered); the host does not wait.
  void flush_cache();
  // cudaMallocFromPoolAsync, and on failure the out-of-memory path of Note [Stream-ordered pool].
  void* allocate_from_pool(std::size_t nbytes, cudaStream_t stream);
  void count_alloc(std::size_t nbytes);
  void poison(void* ptr, std::size_t nbytes, cudaStream_t stream);
  std::size_t reserved_bytes() const;
  void note_reserved();  // Note [Peak reserved]
  [[noreturn]] void raise_out_of_memory(std::size_t nbytes, cudaError_t err);

  int device_;
  cudaStream_t default_stream_;
  cudaMemPool_t pool_ = nullptr;
  std::atomic<std::size_t> allocated_{0};
  std::atomic<std::size_t> peak_{0};
  std::atomic<std::size_t> peak_reserved_{0};  // Note [Peak reserved]
  std::atomic<uint64_t> num_allocs_{0};
  std::atomic<uint64_t> num_frees_{0};
  std::atomic<uint64_t> num_ooms_{0};
  bool cache_enabled_ = true;
  bool poison_ = false;
  mutable std::mutex cache_mutex_;  // guards cache_, recorded_, pending_, free_events_, capture_pools_
  std::unordered_map<CacheKey, std::vector<void*>, CacheKeyHash> cache_;
  std::atomic<std::size_t> cached_bytes_{0};
  std::unordered_map<void*, std::vector<cudaStream_t>> recorded_;
  std::atomic<bool> any_recorded_{false};
  std::vector<Pending> pending_;
  std::atomic<std::size_t> pending_bytes_{0};
  std::vector<cudaEvent_t> free_events_;
  std::vector<std::shared_ptr<GraphPool>> capture_pools_;  // graphs capturing now
  std::atomic<int> captures_active_{0};
  std::atomic<std::size_t> graph_reserved_{0};
  // Note [Memory limit]
  std::atomic<std::size_t> limit_{0};
  // True when a limit is set and the pool's reserved memory is above it.
  bool over_limit() const;
  // Frees a block that took the pool above its limit, waits for that free and trims the pool.
  void give_back_over_limit(void* ptr, cudaStream_t stream);
};

}  // namespace flame::backend::cuda
