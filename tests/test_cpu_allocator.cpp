// The CPU block cache (Note [CPU block cache] in src/backend/cpu/cpu_allocator.cpp): freed blocks
// are reused by rounded size, poisoned again on reuse under FLAME_POISON_ALLOC=1, bounded, and
// safe to use from several threads.
#include <cstdlib>
#include <thread>
#include <vector>

#include "test_util.h"

namespace flame::test {
namespace {

// Restores the cache limit (and empties the cache) when a test ends, passed or not.
class CacheScope {
 public:
  CacheScope() : limit_(cpu::memory_stats().cache_limit_bytes) { cpu::empty_cache(); }
  ~CacheScope() {
    cpu::set_cache_limit(limit_);
    cpu::empty_cache();
  }

 private:
  std::size_t limit_;
};

bool cache_disabled_by_env() {
  const char* env = std::getenv("FLAME_CPU_BLOCK_CACHE");
  return env != nullptr && std::string(env) == "0";
}

TEST(CpuBlockCache, ReusesAFreedBlockOfTheSameSizeClass) {
  if (cache_disabled_by_env()) GTEST_SKIP() << "FLAME_CPU_BLOCK_CACHE=0: the cache is off";
  CacheScope scope;
  cpu::set_cache_limit(std::size_t{1} << 30);
  void* first = nullptr;
  {
    Tensor a = Tensor::full({100000}, 1.5f);  // 400000 bytes
    first = a.data_ptr();
  }
  const cpu::MemoryStats freed = cpu::memory_stats();
  EXPECT_GE(freed.cached_bytes, 400000u);
  // 404000 bytes round to the same class as 400000 (409600): the freed block comes back.
  Tensor b = Tensor::empty({101000}, DType::f32);
  EXPECT_EQ(b.data_ptr(), first);
  const cpu::MemoryStats after = cpu::memory_stats();
  EXPECT_EQ(after.num_cache_hits, freed.num_cache_hits + 1);
  EXPECT_LE(after.cached_bytes + 409600u, freed.cached_bytes);  // that block left the cache
  // A request of another class does not take a cached block of this one.
  b = Tensor();
  const uint64_t hits = cpu::memory_stats().num_cache_hits;
  Tensor c = Tensor::empty({300000}, DType::f32);
  EXPECT_NE(c.data_ptr(), first);
  EXPECT_EQ(cpu::memory_stats().num_cache_hits, hits);
}

TEST(CpuBlockCache, ReusedBlocksArePoisonedLikeFreshOnes) {
  if (cache_disabled_by_env()) GTEST_SKIP() << "FLAME_CPU_BLOCK_CACHE=0: the cache is off";
  if (std::getenv("FLAME_POISON_ALLOC") == nullptr) {
    GTEST_SKIP() << "FLAME_POISON_ALLOC is not set (ctest sets it): poisoning is off in this process";
  }
  CacheScope scope;
  cpu::set_cache_limit(std::size_t{1} << 30);
  const Tensor values = Tensor::uniform({3000}, 1.0, 2.0, DType::f32);
  void* first = nullptr;
  {
    Tensor a = values.clone();  // the right answer sits in the block when it is freed
    first = a.data_ptr();
  }
  Tensor b = Tensor::empty({3000}, DType::f32);
  ASSERT_EQ(b.data_ptr(), first) << "the block was not reused";
  for (float v : b.to_vec<float>()) ASSERT_TRUE(std::isnan(v)) << "a reused block kept old values";
  Tensor bytes = Tensor::empty({12000}, DType::u8);  // every byte, not only float-sized words
  for (int v : bytes.to_vec<int>()) ASSERT_EQ(v, 0xFF);
}

TEST(CpuBlockCache, HoldsNoMoreThanItsLimit) {
  if (cache_disabled_by_env()) GTEST_SKIP() << "FLAME_CPU_BLOCK_CACHE=0: the cache is off";
  CacheScope scope;
  const std::size_t limit = std::size_t{1} << 20;  // 1 MiB
  cpu::set_cache_limit(limit);
  {
    std::vector<Tensor> live;
    for (int i = 0; i < 12; ++i) live.push_back(Tensor::empty({int64_t{40000} + 1000 * i}, DType::f32));
    live.clear();  // 12 blocks of ~160-200 KB freed: about 2 MB
  }
  cpu::MemoryStats s = cpu::memory_stats();
  EXPECT_LE(s.cached_bytes, limit);
  EXPECT_GT(s.cached_bytes, 0u);
  // A block larger than the limit is never cached.
  const std::size_t before = s.cached_bytes;
  { Tensor big = Tensor::empty({1 << 20}, DType::f32); }  // 4 MiB
  s = cpu::memory_stats();
  EXPECT_LE(s.cached_bytes, limit);
  EXPECT_LE(s.cached_bytes, before);
  // Lowering the limit frees cached blocks until they fit; 0 turns the cache off.
  cpu::set_cache_limit(200000);
  EXPECT_LE(cpu::memory_stats().cached_bytes, 200000u);
  cpu::set_cache_limit(0);
  EXPECT_EQ(cpu::memory_stats().cached_bytes, 0u);
  { Tensor t = Tensor::empty({1000}, DType::f32); }
  EXPECT_EQ(cpu::memory_stats().cached_bytes, 0u);
}

TEST(CpuBlockCache, ThreadsShareItSafely) {
  CacheScope scope;
  cpu::set_cache_limit(std::size_t{8} << 20);
  const cpu::MemoryStats before = cpu::memory_stats();
  std::vector<std::thread> threads;
  std::vector<int> bad(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t, &bad] {
      for (int i = 0; i < 300; ++i) {
        const int64_t n = 1000 + 37 * ((i * 7 + t) % 50);
        Tensor x = Tensor::full({n}, static_cast<double>(t + 1), DType::f64);
        Tensor y = x * 2.0;
        const std::vector<double> v = y.to_vec<double>();
        if (v.front() != 2.0 * (t + 1) || v.back() != 2.0 * (t + 1)) ++bad[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(bad[t], 0) << "thread " << t << " saw another thread's values";
  const cpu::MemoryStats after = cpu::memory_stats();
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_EQ(after.num_allocs - before.num_allocs, after.num_frees - before.num_frees);
  EXPECT_GT(after.num_cache_hits, before.num_cache_hits);
  EXPECT_LE(after.cached_bytes, std::size_t{8} << 20);
}

// A request no host can serve (1 PiB is beyond a 47-bit address space) raises OutOfMemoryError,
// naming the op, shape and bytes, and the process goes on.
TEST(CpuBlockCache, OutOfMemoryRaisesItsOwnType) {
  const int64_t one_pib = int64_t{1} << 50;
  try {
    (void)Tensor::empty({one_pib}, {DType::u8, Device::cpu()});
    FAIL() << "a 1 PiB tensor was allocated";
  } catch (const OutOfMemoryError& e) {
    const std::string what = e.what();
    for (const char* part : {"empty", "1125899906842624", "out of host memory"})
      EXPECT_NE(what.find(part), std::string::npos) << part << " not in: " << what;
  }
  EXPECT_EQ(Tensor::ones({4}, {DType::f32, Device::cpu()}).sum().item<float>(), 4.0f);
}

}  // namespace
}  // namespace flame::test
