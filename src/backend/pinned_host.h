#pragma once
// Internal: the pinned (page-locked) host allocator and asynchronous host<->device copies behind
// Tensor::pin_memory(), Tensor::copy_(src, non_blocking) and Tensor::to(device, non_blocking)
// (src/memory/pinned_tensor.cpp) and offload::pinned_memory_stats(). A backend service: declared
// here, implemented in src/backend/cuda/offload/pinned_host.cu (Note [Pinned host cache]); in a build
// without CUDA, src/backend/pinned_host_nocuda.cpp raises (pinned memory needs the CUDA driver).
#include <cstddef>
#include <cstdint>
#include <memory>

#include "flame/tensor.h"

namespace flame::backend::pinned_host {

// `nbytes` of pinned host memory from the caching pinned allocator. Raises flame::Error (naming
// `op`) without CUDA, without a device, or when the host has no page-locked memory left.
std::shared_ptr<void> allocate(std::size_t nbytes, const char* op);

// When dst/src are a pinned CPU tensor and a CUDA tensor (either way) of one dtype and shape, both
// contiguous, queues one cudaMemcpyAsync on the CUDA device's current stream, notes the stream on
// the pinned block (so it is reused only after the copy ran) and returns true; the host does not
// wait. Returns false (nothing done) for any other pair.
bool copy_async(const Tensor& dst, const Tensor& src);

// The cache's counters; offload::PinnedMemoryStats (flame/offload.h) says what each means.
struct Stats {
  std::size_t allocated_bytes = 0;
  std::size_t reserved_bytes = 0;
  std::size_t cached_bytes = 0;
  std::size_t pending_bytes = 0;
  uint64_t num_allocs = 0;
  uint64_t num_host_allocs = 0;
};
Stats stats();
void empty_cache();

}  // namespace flame::backend::pinned_host
