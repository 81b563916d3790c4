// Note [CPU block cache]
// Host memory for CPU tensors comes from a cache of freed blocks in front of aligned_alloc/free.
//  - Why: glibc serves blocks above its mmap threshold (128 KiB to 32 MiB, adaptive) with
//    mmap/munmap, and every munmap'd page faults again on first touch. A gradient check of a
//    9x130 @ 130x260 matmul allocates the same few sizes tens of thousands of times and spent
//    19 s in mmap/munmap; with the cache those allocations cost a lock and a map lookup.
//  - Size classes: a request is rounded up to a multiple of 64 bytes (the alignment; vector loads
//    stay aligned) and, above 4 KiB, to the next of 8 steps per power of two (waste <= 12.5%).
//    A freed block goes into the free list of its class and the next request of that class takes
//    it back; requests of another class never take it.
//  - Bound: the cache holds at most the limit (1 GiB by default; FLAME_CPU_BLOCK_CACHE=0 in the
//    environment starts with 0, i.e. every free goes to the system). A free that would go beyond
//    it releases cached blocks, largest classes first, and frees the block itself when it alone
//    is larger than the limit. flame::cpu::empty_cache() releases everything.
//  - Poisoning: under FLAME_POISON_ALLOC=1 (the test suite) every block handed out is filled with
//    0xFF bytes (NaN for floats), a reused block exactly like a fresh one, so an op that forgets to
//    write an element cannot pass by reading the right answer left by an earlier tensor.
//  - Threads: one mutex guards the free lists and the statistics; a block freed on one thread
//    and reused on another is ordered by that mutex.
//  - Lifetime: the cache is never destroyed, so tensors freed during static destruction still
//    find it.
//
// Note [Storage in its block]
// make_empty on the CPU would otherwise make three heap objects per tensor besides the data: the
// Storage (make_shared), and the control block of its shared_ptr<void> data with the deleter.
// allocate_storage instead takes one block of nbytes + kStorageHeader from the cache and builds
// the Storage's shared_ptr control block (with the Storage inside, std::allocate_shared) in the
// header; Storage::data is then a non-owning pointer to the bytes after the header. The
// allocator used for the control block hands out the header and, when the control block is
// deallocated (after the last shared_ptr and weak_ptr to the Storage are gone, i.e. after the
// Storage itself was destroyed), returns the whole block to the cache. Nothing may hold
// Storage::data beyond the Storage's life (nothing does: kernels borrow the raw pointer).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "flame/cpu.h"
#include "src/backend/cpu/cpu_backend.h"
#include "src/core/profiler_context.h"

namespace flame::backend::cpu {
namespace {

constexpr std::size_t kAlignment = 64;
constexpr std::size_t kDefaultLimit = std::size_t{1} << 30;

// The size class of a request (Note [CPU block cache]); 0 when the rounding would overflow.
std::size_t size_class(std::size_t nbytes) {
  const std::size_t n = std::max<std::size_t>(nbytes, 1);
  if (n > (std::size_t{1} << 62)) return 0;
  std::size_t r = (n + kAlignment - 1) / kAlignment * kAlignment;
  if (r <= 4096) return r;
  std::size_t pow2 = 4096;
  while (pow2 * 2 < r) pow2 *= 2;  // pow2 < r <= 2 * pow2
  const std::size_t step = pow2 / 8;
  return (r + step - 1) / step * step;
}

class BlockCache {
 public:
  BlockCache() {
    const char* env = std::getenv("FLAME_CPU_BLOCK_CACHE");
    limit_ = (env != nullptr && std::string(env) == "0") ? 0 : kDefaultLimit;
    poison_ = std::getenv("FLAME_POISON_ALLOC") != nullptr;
  }

  void* allocate(std::size_t nbytes, std::size_t& block_size) {
    const std::size_t cls = size_class(nbytes);
    FLAME_CHECK(cls != 0, "allocate", "cannot allocate ", nbytes, " bytes of host memory (size overflows)");
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(cls);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        cached_ -= cls;
        ++stats_.num_cache_hits;
      }
      note_alloc(cls);
    }
    if (p == nullptr) {
      p = std::aligned_alloc(kAlignment, cls);
      if (p == nullptr) {
        // Cached blocks may be what stands in the way: hand them back and try once more.
        empty();
        p = std::aligned_alloc(kAlignment, cls);
      }
      if (p == nullptr) {
        std::lock_guard<std::mutex> lock(mutex_);
        stats_.allocated_bytes -= cls;
        --stats_.num_allocs;
        throw OutOfMemoryError("allocate: out of host memory allocating " + std::to_string(nbytes) + " bytes");
      }
    }
    // Tests set FLAME_POISON_ALLOC=1 so that output elements a kernel forgets to write read as NaN.
    if (poison_) std::memset(p, 0xFF, cls);
    block_size = cls;
    // After the block is ours, so a trace never shows it allocated before its last free.
    if (profiler_detail::recording()) profiler_detail::on_alloc(p, cls, -1, nullptr);
    return p;
  }

  void release(void* p, std::size_t cls) {
    // Before the block can be handed out again (see allocate).
    if (profiler_detail::recording()) profiler_detail::on_free(p, cls, -1, nullptr);
    std::vector<void*> to_free;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stats_.allocated_bytes -= cls;
      ++stats_.num_frees;
      if (cls > limit_) {
        to_free.push_back(p);
      } else {
        evict_locked(limit_ - cls, to_free);
        free_[cls].push_back(p);
        cached_ += cls;
      }
    }
    for (void* q : to_free) std::free(q);
  }

  void empty() { set_limit(limit(), /*evict_all=*/true); }

  std::size_t set_limit(std::size_t bytes, bool evict_all = false) {
    std::vector<void*> to_free;
    std::size_t old;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      old = limit_;
      limit_ = bytes;
      evict_locked(evict_all ? 0 : limit_, to_free);
    }
    for (void* q : to_free) std::free(q);
    return old;
  }

  std::size_t limit() {
    std::lock_guard<std::mutex> lock(mutex_);
    return limit_;
  }

  flame::cpu::MemoryStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    flame::cpu::MemoryStats s = stats_;
    s.cached_bytes = cached_;
    s.cache_limit_bytes = limit_;
    return s;
  }

  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.peak_allocated_bytes = stats_.allocated_bytes;
  }

 private:
  void note_alloc(std::size_t cls) {
    ++stats_.num_allocs;
    stats_.allocated_bytes += cls;
    stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  }

  // Takes cached blocks out, largest classes first, until at most `keep` bytes stay cached.
  void evict_locked(std::size_t keep, std::vector<void*>& out) {
    for (auto it = free_.rbegin(); it != free_.rend() && cached_ > keep; ++it) {
      while (!it->second.empty() && cached_ > keep) {
        out.push_back(it->second.back());
        it->second.pop_back();
        cached_ -= it->first;
      }
    }
  }

  std::mutex mutex_;
  std::map<std::size_t, std::vector<void*>> free_;  // size class -> cached blocks
  std::size_t cached_ = 0;
  std::size_t limit_ = kDefaultLimit;
  bool poison_ = false;
  flame::cpu::MemoryStats stats_;
};

BlockCache& cache() {
  static BlockCache* c = new BlockCache();  // never destroyed: see the Note
  return *c;
}

}  // namespace

namespace {

// Header in front of the data: room for the control block of allocate_shared<Storage>. A multiple
// of the alignment, so the data stays 64-byte aligned.
constexpr std::size_t kStorageHeader = 128;

// Hands out the header of one block (once) and gives the whole block back to the cache when the
// control block is deallocated (Note [Storage in its block]).
template <class T>
struct HeaderAllocator {
  using value_type = T;
  void* block;
  std::size_t cls;
  HeaderAllocator(void* b, std::size_t c) : block(b), cls(c) {}
  template <class U>
  HeaderAllocator(const HeaderAllocator<U>& o) : block(o.block), cls(o.cls) {}  // NOLINT: rebinding
  T* allocate(std::size_t n) {
    // Holds for the one control block allocate_shared makes (checked at compile time below).
    if (n * sizeof(T) > kStorageHeader) throw std::bad_alloc();
    return static_cast<T*>(block);
  }
  void deallocate(T*, std::size_t) { cache().release(block, cls); }
  template <class U>
  bool operator==(const HeaderAllocator<U>& o) const { return block == o.block; }
  template <class U>
  bool operator!=(const HeaderAllocator<U>& o) const { return block != o.block; }
};

}  // namespace

std::shared_ptr<Storage> allocate_storage(std::size_t nbytes) {
  FLAME_CHECK(nbytes <= (std::size_t{1} << 62), "allocate", "cannot allocate ", nbytes,
              " bytes of host memory (size overflows)");
  std::size_t cls = 0;
  void* block = cache().allocate(nbytes + kStorageHeader, cls);
  void* data = static_cast<char*>(block) + kStorageHeader;
  try {
    // Storage::data does not own the bytes (an aliasing shared_ptr with no owner): the control
    // block in the header does.
    return std::allocate_shared<Storage>(HeaderAllocator<Storage>(block, cls),
                                         std::shared_ptr<void>(std::shared_ptr<void>(), data), nbytes,
                                         Device::cpu());
  } catch (...) {
    cache().release(block, cls);
    throw;
  }
}

std::shared_ptr<void> CpuBackend::allocate(std::size_t nbytes) {
  std::size_t cls = 0;
  void* p = cache().allocate(nbytes, cls);
  return std::shared_ptr<void>(p, [cls](void* q) { cache().release(q, cls); });
}

}  // namespace flame::backend::cpu

namespace flame::cpu {

MemoryStats memory_stats() { return backend::cpu::cache().stats(); }
void reset_peak_memory_stats() { backend::cpu::cache().reset_peak(); }
void empty_cache() { backend::cpu::cache().empty(); }
std::size_t set_cache_limit(std::size_t bytes) { return backend::cpu::cache().set_limit(bytes); }

}  // namespace flame::cpu
