// Pinned host memory, non-blocking copies and the pool's memory limit (docs/offload.md;
// src/backend/cuda/offload/pinned_host.cu Note [Pinned host cache], memory_pool.cu Note [Memory
// limit]). CUDA cases skip without a GPU; the CPU cases check the no-CUDA behaviour.
#include <cstring>
#include <string>
#include <vector>

#include "flame/offload.h"
#include "test_util.h"

namespace flame::test {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

std::vector<float> random_values(int64_t n, uint64_t seed) {
  Generator g(seed);
  return Tensor::uniform({n}, -3.0, 3.0, DType::f32, &g).to_vec<float>();
}

// Keeps the current stream busy for tens of milliseconds (a chain of large matmuls).
Tensor busy_stream() {
  Tensor a = Tensor::uniform({4096, 4096}, -1.0, 1.0, Device::cuda(0));
  Tensor acc = a;
  for (int i = 0; i < 16; ++i) acc = acc.matmul(a) * 1e-3;
  return acc;
}

TEST(OffloadPinned, WithoutCudaPinningRaisesAndNonBlockingCopiesFallBack) {
  if (cuda_is_available()) GTEST_SKIP() << "a CUDA device is present: the no-CUDA behaviour is not testable here";
  Tensor x = Tensor::from_vec<float>({1.5f, -2.f, 3.25f}, {3});
  EXPECT_FALSE(x.is_pinned());
  expect_error([&] { (void)x.pin_memory(); }, {"pin_memory", "CUDA"});
  expect_error([&] { (void)offload::empty_pinned({4}); }, {"offload::empty_pinned", "CUDA"});
  // A non-blocking copy between CPU tensors is an ordinary copy.
  Tensor y = Tensor::zeros({3});
  const uint64_t v0 = y.version();
  y.copy_(x, /*non_blocking=*/true);
  EXPECT_EQ(y.to_vec<float>(), x.to_vec<float>());
  EXPECT_EQ(y.version(), v0 + 1);
  EXPECT_TRUE(x.to(Device::cpu(), true).is_same(x));
}

TEST(OffloadPinned, PinMemoryCopiesValuesAndIsDifferentiable) {
  FLAME_SKIP_IF_NO_CUDA();
  const std::vector<float> v = random_values(1000, 11);
  Tensor x = Tensor::from_vec(v, {10, 100});
  Tensor p = x.pin_memory();
  EXPECT_TRUE(p.is_pinned());
  EXPECT_FALSE(x.is_pinned());
  EXPECT_TRUE(p.pin_memory().is_same(p));
  EXPECT_EQ(p.device(), Device::cpu());
  EXPECT_EQ(p.to_vec<float>(), v);
  // Views share the pinned storage.
  EXPECT_TRUE(p.slice(0, 2, 5).is_pinned());
  // Gradient flows through pin_memory unchanged.
  Tensor w = Tensor::from_vec(v, {10, 100}).requires_grad_();
  Tensor loss = (w.pin_memory() * w.pin_memory()).sum();
  Gradients g = loss.backward();
  const std::vector<float> gw = g.get(w).to_vec<float>();
  for (std::size_t i = 0; i < v.size(); ++i) ASSERT_FLOAT_EQ(gw[i], 2.f * v[i]);
  expect_error([&] { (void)Tensor::zeros({2}, Device::cuda(0)).pin_memory(); }, {"pin_memory", "CPU"});
}

TEST(OffloadPinned, FreedBlocksAreReusedBySize) {
  FLAME_SKIP_IF_NO_CUDA();
  Tensor warm = offload::empty_pinned({3 * 1024 * 1024 + 7});
  warm = Tensor();
  const offload::PinnedMemoryStats s0 = offload::pinned_memory_stats();
  void* first = nullptr;
  {
    Tensor a = offload::empty_pinned({3 * 1024 * 1024 + 7});
    first = a.data_ptr();
    const offload::PinnedMemoryStats s1 = offload::pinned_memory_stats();
    EXPECT_EQ(s1.allocated_bytes, s0.allocated_bytes + a.nbytes());
    EXPECT_EQ(s1.num_allocs, s0.num_allocs + 1);
    // A block of this class was cached by `warm`: no new cudaHostAlloc.
    EXPECT_EQ(s1.num_host_allocs, s0.num_host_allocs);
    EXPECT_LT(s1.cached_bytes, s0.cached_bytes);  // the cached block was taken
  }
  // No copy used it: free at once, and the same block comes back for the same size.
  Tensor b = offload::empty_pinned({3 * 1024 * 1024 + 6});  // another size of the same class
  EXPECT_EQ(b.data_ptr(), first);
  const offload::PinnedMemoryStats s2 = offload::pinned_memory_stats();
  EXPECT_EQ(s2.num_host_allocs, s0.num_host_allocs);
  EXPECT_EQ(s2.allocated_bytes, s0.allocated_bytes + b.nbytes());
  EXPECT_GE(s2.reserved_bytes, s2.allocated_bytes + s2.cached_bytes);
  b = Tensor();
  offload::empty_pinned_cache();
  const offload::PinnedMemoryStats s3 = offload::pinned_memory_stats();
  EXPECT_EQ(s3.cached_bytes, 0u);
  EXPECT_LT(s3.reserved_bytes, s2.reserved_bytes);  // b's block went back to the system
}

TEST(OffloadPinned, AsyncRoundTripOfRandomData) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType dt : {DType::f32, DType::bf16, DType::i64}) {
    Generator g(21);
    Tensor x = (dt == DType::i64 ? Tensor::randint(-1000, 1000, {37, 129}, DType::i64, &g)
                                 : Tensor::uniform({37, 129}, -4.0, 4.0, dt, &g));
    Tensor p = x.pin_memory();
    Tensor d = p.to(Device::cuda(0), /*non_blocking=*/true);
    EXPECT_EQ(d.device(), Device::cuda(0));
    Tensor back = (d * 2).to(Device::cpu(), /*non_blocking=*/true);
    EXPECT_TRUE(back.is_pinned());
    cuda::synchronize();  // the non-blocking download is complete only now
    EXPECT_TRUE(all_close(back, x * 2, 0, 0));
    // copy_ into existing tensors, both directions.
    Tensor d2 = Tensor::empty({37, 129}, {dt, Device::cuda(0)});
    d2.copy_(p, true);
    Tensor h2 = offload::empty_pinned({37, 129}, dt);
    const uint64_t v0 = h2.version();
    h2.copy_(d2 + 1, true);
    EXPECT_EQ(h2.version(), v0 + 1);
    cuda::synchronize();
    EXPECT_TRUE(all_close(h2, x + 1, 0, 0));
  }
  // Pairs the async path does not take still copy correctly (pageable source, a transposed view).
  Tensor x = Tensor::uniform({16, 9}, -1.0, 1.0);
  Tensor d = Tensor::empty({9, 16}, Device::cuda(0));
  d.copy_(x.pin_memory().t(), true);
  EXPECT_TRUE(all_close(d, x.t(), 0, 0));
  d.copy_(x.t(), true);
  EXPECT_TRUE(all_close(d, x.t(), 0, 0));
}

TEST(OffloadPinned, BlockReadByAQueuedCopyIsNotReusedUntilTheCopyRan) {
  FLAME_SKIP_IF_NO_CUDA();
  const int64_t n = 1 << 20;
  const std::vector<float> v = random_values(n, 5);
  Tensor busy = busy_stream();  // the upload below waits behind tens of milliseconds of matmuls
  Tensor a = Tensor::from_vec(v, {n}).pin_memory();
  void* a_ptr = a.data_ptr();
  Tensor d = Tensor::empty({n}, Device::cuda(0));
  d.copy_(a, true);
  a = Tensor();  // freed while the copy is queued: the block must wait
  EXPECT_GE(offload::pinned_memory_stats().pending_bytes, static_cast<std::size_t>(n) * 4);
  Tensor b = offload::empty_pinned({n});
  EXPECT_NE(b.data_ptr(), a_ptr);
  std::memset(b.data_ptr(), 0, b.nbytes());  // would corrupt the upload if b had a's block
  const std::vector<float> got = d.to_vec<float>();  // waits for the stream
  EXPECT_EQ(got, v);
  // Once the copy ran, the block is free again for its size.
  Tensor c = offload::empty_pinned({n});
  EXPECT_EQ(offload::pinned_memory_stats().pending_bytes, 0u);
  EXPECT_EQ(c.data_ptr(), a_ptr);
  (void)busy;
}

TEST(OffloadPinned, CopiesOnASideStreamAreOrderedByEvents) {
  FLAME_SKIP_IF_NO_CUDA();
  const int64_t n = 512 * 1024;
  const std::vector<float> v = random_values(n, 8);
  Tensor host = Tensor::from_vec(v, {n}).pin_memory();
  cuda::Stream side = cuda::Stream::create(0);
  cuda::Stream compute = cuda::Stream::current(0);
  Tensor busy = busy_stream();  // compute is busy; the upload overlaps it on the side stream
  Tensor d;
  cuda::Event uploaded;
  {
    cuda::StreamGuard g(side);
    d = host.to(Device::cuda(0), true);
    uploaded.record(side);
  }
  compute.wait(uploaded);
  cuda::record_stream(d, compute);
  Tensor y = d * 3 + 1;  // on compute, after the upload
  // Download on the side stream once compute produced y.
  cuda::Event produced;
  produced.record(compute);
  Tensor out;
  cuda::Event downloaded;
  {
    cuda::StreamGuard g(side);
    side.wait(produced);
    out = y.to(Device::cpu(), true);
    cuda::record_stream(y, side);
    downloaded.record(side);
  }
  downloaded.synchronize();
  const std::vector<float> got = out.to_vec<float>();
  ASSERT_EQ(got.size(), v.size());
  for (std::size_t i = 0; i < v.size(); ++i) ASSERT_FLOAT_EQ(got[i], v[i] * 3.f + 1.f) << i;
  (void)busy;
}

TEST(OffloadMemoryLimit, RaisesAboveTheCapAndAFreedCacheLetsTheNextAllocationSucceed) {
  FLAME_SKIP_IF_NO_CUDA();
  cuda::synchronize();
  cuda::empty_cache();
  // Earlier cases of the same process may leave memory reserved but free (the pool trims only
  // chunks with no live block, and a graph's private pool goes when its last tensor does), and
  // such memory can serve requests or leave the reserve while this case runs. So the case does not
  // predict which request the cap refuses; it asserts that reserved memory never passes the cap,
  // and that a refusal comes before the requests could exceed the cap: at most cap / 40 MiB + 1.
  // Small requests (fill_'s scalar below) come from the driver pool's chunks: a live small tensor
  // keeps one reserved before the cap is set, so they never need a new chunk under it.
  Tensor scalars = Tensor::empty({64}, {DType::i64, Device::cuda(0)});
  scalars.fill_(1);
  cuda::synchronize();
  const cuda::MemoryStats before = cuda::memory_stats();
  const std::size_t base = before.reserved_bytes;
  const std::size_t cap = base + 100 * kMiB;
  cuda::set_memory_limit(cap);
  cuda::reset_peak_memory_stats();
  EXPECT_EQ(cuda::memory_limit(), cap);
  struct Reset {
    ~Reset() { cuda::set_memory_limit(0); }
  } reset;
  auto mib = [](std::size_t m) { return Tensor::empty({static_cast<int64_t>(m * kMiB)}, {DType::u8, Device::cuda(0)}); };
  std::vector<Tensor> held;
  held.push_back(mib(40));
  held.push_back(mib(40));
  EXPECT_LE(cuda::memory_stats().reserved_bytes, cap);
  const uint64_t ooms = cuda::memory_stats().num_ooms;
  const std::size_t max_more = cap / (40 * kMiB) + 1;
  bool raised = false;
  for (std::size_t i = 0; i < max_more && !raised; ++i) {
    try {
      held.push_back(mib(40));
      EXPECT_LE(cuda::memory_stats().reserved_bytes, cap) << "request " << i + 3 << " grew past the cap";
    } catch (const Error& e) {
      raised = true;
      for (const std::string& part : {std::string("out of memory"), std::string("41943040 bytes"),
                                      std::string("memory limit"), std::to_string(cap)})
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << "missing '" << part << "' in: " << e.what();
    }
  }
  EXPECT_TRUE(raised) << "no 40 MiB request was refused under a cap of " << cap << " bytes (" << held.size()
                      << " held; reserved " << base << " bytes before the test)";
  EXPECT_EQ(cuda::memory_stats().num_ooms, ooms + 1);
  EXPECT_LE(cuda::memory_stats().reserved_bytes, cap);
  // The refused request reserved past the cap for a moment: the peak leaves that out.
  EXPECT_LE(cuda::memory_stats().peak_reserved_bytes, cap);
  held.erase(held.begin());
  Tensor c = mib(40);  // the freed tensor's memory went back to the pool: reused without growing past the cap
  c.fill_(7);
  EXPECT_LE(cuda::memory_stats().reserved_bytes, cap);
  held.clear();
  c = Tensor();
  // Cached small blocks (the block cache, <= 16 MiB each) are released when the cap needs them.
  std::vector<Tensor> small;
  for (int i = 0; i < 6; ++i) small.push_back(mib(12));
  small.clear();
  EXPECT_GT(cuda::memory_stats().cached_bytes, 0u);
  Tensor big = mib(90);
  big.fill_(1);
  EXPECT_LE(cuda::memory_stats().reserved_bytes, cap);
  EXPECT_EQ(big.sum().item<int64_t>(), static_cast<int64_t>(90 * kMiB));
  // Without the cap the same request succeeds at once.
  cuda::set_memory_limit(0);
  Tensor more = mib(40);
  EXPECT_EQ(cuda::memory_limit(), 0u);
}

}  // namespace
}  // namespace flame::test
