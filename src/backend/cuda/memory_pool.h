#pragma once
// The stream-ordered device memory pool of one CUDA device. See Note [Stream-ordered pool] in
// memory_pool.cu and docs/memory-pool.md.
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "flame/cuda.h"

namespace flame::backend::cuda {

class MemoryPool {
 public:
  // Creates the pool of `device`; allocations and frees are ordered on `stream`.
  MemoryPool(int device, cudaStream_t stream);
  ~MemoryPool();
  MemoryPool(const MemoryPool&) = delete;
  MemoryPool& operator=(const MemoryPool&) = delete;

  // `nbytes` of device memory, usable by work queued on the stream from now on. The deleter
  // returns it to the pool in stream order (Note [Stream-ordered pool]). Zero bytes gives a null
  // pointer that is never dereferenced. Raises flame::Error on out of memory.
  std::shared_ptr<void> allocate(std::size_t nbytes);

  ::flame::cuda::MemoryStats stats() const;
  void reset_peak();
  // Returns every cached, unused byte to the driver; waits for the stream first.
  void empty_cache();

  // Note [Block cache]: freed blocks of at most kMaxCachedBlock bytes are kept, keyed by their
  // size rounded up to kGranule, while the cache holds at most kMaxCachedTotal bytes.
  static constexpr std::size_t kGranule = 512;
  static constexpr std::size_t kMaxCachedBlock = std::size_t{16} << 20;
  static constexpr std::size_t kMaxCachedTotal = std::size_t{1} << 30;
  // The size a block of `nbytes` is cached under: rounded up so that nearby sizes share blocks.
  static constexpr std::size_t cache_size(std::size_t nbytes) { return (nbytes + kGranule - 1) / kGranule * kGranule; }

  cudaMemPool_t handle() const { return pool_; }
  int device() const { return device_; }

 private:
  void release(void* ptr, std::size_t nbytes) noexcept;
  // A block from the cache (nullptr when none of that size is cached).
  void* take_cached(std::size_t rounded);
  // Hands every cached block back to the pool (stream-ordered); the host does not wait.
  void flush_cache();
  // cudaMallocFromPoolAsync, and on failure the out-of-memory path of Note [Stream-ordered pool].
  void* allocate_from_pool(std::size_t nbytes);
  std::size_t reserved_bytes() const;
  [[noreturn]] void raise_out_of_memory(std::size_t nbytes, cudaError_t err);

  int device_;
  cudaStream_t stream_;
  cudaMemPool_t pool_ = nullptr;
  std::atomic<std::size_t> allocated_{0};
  std::atomic<std::size_t> peak_{0};
  std::atomic<uint64_t> num_allocs_{0};
  std::atomic<uint64_t> num_frees_{0};
  std::atomic<uint64_t> num_ooms_{0};
  bool cache_enabled_ = true;
  std::mutex cache_mutex_;
  std::unordered_map<std::size_t, std::vector<void*>> cache_;  // rounded size -> free blocks
  std::atomic<std::size_t> cached_bytes_{0};
};

}  // namespace flame::backend::cuda
