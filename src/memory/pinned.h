#pragma once
// Internal: the pinned (page-locked) host allocator and asynchronous host<->device copies behind
// Tensor::pin_memory(), Tensor::copy_(src, non_blocking) and Tensor::to(device, non_blocking).
// Implemented in src/backend/cuda/offload/pinned_host.cu (Note [Pinned host cache]); in a build
// without CUDA, src/memory/pinned_nocuda.cpp raises (pinned memory needs the CUDA driver).
#include <cstddef>
#include <memory>

#include "flame/offload.h"
#include "flame/tensor.h"

namespace flame::memory {

// `nbytes` of pinned host memory from the caching pinned allocator. Raises flame::Error (naming
// `op`) without CUDA, without a device, or when the host has no page-locked memory left.
std::shared_ptr<void> allocate_pinned(std::size_t nbytes, const char* op);

// When dst/src are a pinned CPU tensor and a CUDA tensor (either way) of one dtype and shape, both
// contiguous, queues one cudaMemcpyAsync on the CUDA device's current stream, notes the stream on
// the pinned block (so it is reused only after the copy ran) and returns true; the host does not
// wait. Returns false (nothing done) for any other pair.
bool copy_async(const Tensor& dst, const Tensor& src);

offload::PinnedMemoryStats pinned_stats();
void empty_pinned_cache();

}  // namespace flame::memory
