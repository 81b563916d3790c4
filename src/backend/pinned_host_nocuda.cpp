// Pinned host memory and the pool's memory limit in a build without CUDA: page-locked memory is
// a CUDA driver service, so pin_memory(), offload::empty_pinned() and cuda::set_memory_limit raise
// flame::Error (a silent pageable "pinned" tensor would hide the missing overlap). Non-blocking
// copies fall back to ordinary ones. Builds with CUDA use src/backend/cuda/offload/pinned_host.cu.
// (The seam: src/backend/pinned_host.h.)
#ifndef FLAME_WITH_CUDA

#include "flame/cuda.h"
#include "flame/error.h"
#include "src/backend/pinned_host.h"

namespace flame::backend::pinned_host {
std::shared_ptr<void> allocate(std::size_t, const char* op) {
  FLAME_FAIL(op, "pinned host memory needs CUDA, and FLAME was built without CUDA");
}
bool copy_async(const Tensor&, const Tensor&) { return false; }
Stats stats() { return {}; }
void empty_cache() {}
}  // namespace flame::backend::pinned_host

namespace flame::cuda {
void set_memory_limit(std::size_t, int) { FLAME_FAIL("cuda::set_memory_limit", "FLAME was built without CUDA"); }
std::size_t memory_limit(int) { FLAME_FAIL("cuda::memory_limit", "FLAME was built without CUDA"); }
}  // namespace flame::cuda

#endif  // FLAME_WITH_CUDA
