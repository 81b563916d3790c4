#pragma once
// CPU allocator controls: block-cache statistics and release (Note [CPU block cache] in
// src/backend/cpu/cpu_allocator.cpp), and the CPU backend's thread count.
#include <cstddef>
#include <cstdint>

namespace flame::cpu {

struct MemoryStats {
  std::size_t allocated_bytes = 0;       // held by live tensors (rounded block sizes)
  std::size_t cached_bytes = 0;          // freed blocks kept for reuse, by rounded size
  std::size_t cache_limit_bytes = 0;     // the most the cache keeps (0: the cache is off)
  std::size_t peak_allocated_bytes = 0;  // max of allocated_bytes since the last reset
  uint64_t num_allocs = 0;               // allocations served since process start
  uint64_t num_cache_hits = 0;           // of those, served from the cache (no system call)
  uint64_t num_frees = 0;
};

MemoryStats memory_stats();
void reset_peak_memory_stats();
// Returns every cached block to the system.
void empty_cache();
// Sets the most the cache keeps (default 1 GiB, FLAME_CPU_BLOCK_CACHE=0 in the environment starts
// it at 0); lowering it frees cached blocks until they fit. Returns the previous limit.
std::size_t set_cache_limit(std::size_t bytes);

// The CPU backend's threads (Note [CPU threads] in src/backend/cpu/cpu_threads.cpp): convolutions,
// large elementwise ops, group norm and GEMMs spread over this many threads (the caller included).
// Default: the hardware threads, or FLAME_CPU_THREADS=n from the environment. OpenBLAS runs
// single-threaded at every count and FLAME splits the GEMMs. Where the OS refuses a thread (a
// thread limit), the pool keeps those that started, says so on stderr, and num_threads() gives
// that count. Results do not depend on the count. Call it between ops, not from inside a kernel.
void set_num_threads(int n);
int num_threads();

}  // namespace flame::cpu
