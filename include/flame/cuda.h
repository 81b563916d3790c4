#pragma once
// CUDA runtime controls: memory-pool statistics, synchronisation, math-mode flags.
// In a build without CUDA every call except the flags raises flame::Error.
#include <cstddef>
#include <cstdint>

namespace flame::cuda {

struct MemoryStats {
  std::size_t allocated_bytes = 0;       // held by live tensors (requested sizes)
  std::size_t reserved_bytes = 0;        // held by the pool from the driver (allocated + cached)
  std::size_t cached_bytes = 0;          // part of reserved: freed blocks kept for reuse by size
  std::size_t peak_allocated_bytes = 0;  // max of allocated_bytes since the last reset
  uint64_t num_allocs = 0;               // allocations served since process start
  uint64_t num_frees = 0;
  uint64_t num_ooms = 0;                 // out-of-memory errors raised
};

MemoryStats memory_stats(int device = 0);
void reset_peak_memory_stats(int device = 0);
// Returns cached, unused memory to the driver (waits for the device first).
void empty_cache(int device = 0);
// Waits until all work queued on the device's stream has finished.
void synchronize(int device = 0);
// The one non-default stream all FLAME ops on `device` are queued on (a cudaStream_t).
void* current_stream(int device = 0);

// f32 matmuls may use TF32 tensor cores (like torch.backends.cuda.matmul.allow_tf32). Default off.
void set_allow_tf32(bool allow);
bool allow_tf32();

}  // namespace flame::cuda
