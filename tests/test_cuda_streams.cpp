// Streams, events, the current-stream guard, record_stream, side-stream uploads, pool statistics
// and poisoning (include/flame/cuda.h, src/backend/cuda/stream.cu, memory_pool.cu,
// docs/streams.md). Every case skips without a GPU; all suites are named CudaStream*.
#include <algorithm>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "flame/cuda/kernels.h"
#include "test_util.h"

namespace flame::test {
namespace {

const Device kCuda = Device::cuda(0);

bool block_cache_off() {
  const char* env = std::getenv("FLAME_CUDA_BLOCK_CACHE");
  return env != nullptr && std::string(env) == "0";
}

// Random values drawn on the CPU (a private generator) and uploaded.
Tensor random_cuda(const Shape& shape, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  Generator g(seed);
  return Tensor::uniform(shape, lo, hi, {DType::f32, Device::cpu()}, &g).to(kCuda);
}

// Enough queued GPU work (tens of milliseconds on an H100) that the stream is still busy when
// the host looks at it right after queueing: a chain of 4096^2 f32 GEMMs without TF32.
Tensor busy_work(const Tensor& a, int rounds) {
  Tensor y = a;
  for (int i = 0; i < rounds; ++i) y = y.matmul(a) * (1.0f / 4096.0f);
  return y;
}

TEST(CudaStream, CurrentStreamFollowsTheGuardPerThread) {
  FLAME_SKIP_IF_NO_CUDA();
  const cuda::Stream def = cuda::Stream::default_stream(0);
  EXPECT_EQ(cuda::Stream::current(0), def);
  EXPECT_EQ(cuda::current_stream(0), def.handle());
  const cuda::Stream side = cuda::Stream::create(0);
  EXPECT_NE(side, def);
  EXPECT_NE(side.handle(), nullptr);
  {
    cuda::StreamGuard guard(side);
    EXPECT_EQ(cuda::Stream::current(0), side);
    EXPECT_EQ(cuda::current_stream(0), side.handle());
    // The current stream is per thread: another thread still sees the default stream.
    void* seen = nullptr;
    std::thread t([&] { seen = cuda::current_stream(0); });
    t.join();
    EXPECT_EQ(seen, def.handle());
    {
      const cuda::Stream inner = cuda::Stream::create(0, -1);
      cuda::StreamGuard nested(inner);
      EXPECT_EQ(cuda::Stream::current(0), inner);
    }
    EXPECT_EQ(cuda::Stream::current(0), side);
  }
  EXPECT_EQ(cuda::Stream::current(0), def);
  cuda::set_current_stream(side);
  EXPECT_EQ(cuda::Stream::current(0), side);
  cuda::set_current_stream(def);
  EXPECT_EQ(cuda::Stream::current(0), def);
}

TEST(CudaStream, PriorityIsClampedToTheDeviceRange) {
  FLAME_SKIP_IF_NO_CUDA();
  const cuda::Stream low = cuda::Stream::create(0, 0);
  const cuda::Stream high = cuda::Stream::create(0, -100);  // clamped to the greatest priority
  EXPECT_EQ(low.priority(), 0);
  EXPECT_LT(high.priority(), 0);
  const cuda::Stream clamped = cuda::Stream::create(0, 100);
  EXPECT_EQ(clamped.priority(), 0);
}

TEST(CudaStream, OpsRunOnTheCurrentStream) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor a = random_cuda({4096, 4096}, 11);
  cuda::synchronize();
  const cuda::Stream side = cuda::Stream::create(0);
  const cuda::Stream def = cuda::Stream::default_stream(0);
  Tensor y;
  {
    cuda::StreamGuard guard(side);
    y = busy_work(a, 30);
    // Queued on `side`: it is busy, the default stream is not.
    EXPECT_FALSE(side.query());
    EXPECT_TRUE(def.query());
    side.synchronize();
    EXPECT_TRUE(side.query());
  }
  cuda::record_stream(y, def);
  EXPECT_TRUE(std::isfinite(y.sum().item<float>()));
}

TEST(CudaStream, EventsOrderWorkAcrossStreams) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor a = random_cuda({4096, 4096}, 12);
  const Tensor v = random_cuda({1000}, 13);
  const std::vector<float> v_host = v.to_vec<float>();
  cuda::synchronize();
  const cuda::Stream side = cuda::Stream::create(0);
  Tensor z;
  cuda::Event produced;
  {
    cuda::StreamGuard guard(side);
    const Tensor y = busy_work(a, 20);
    // z = v + 0 * y[0, :1000]: ready only after the long chain; poisoned (NaN) until written.
    z = v + y.narrow(0, 0, 1).reshape({4096}).narrow(0, 0, 1000) * 0.0f;
    produced.record(side);
  }
  EXPECT_FALSE(produced.query());  // the chain is still running
  // The default stream waits for the event, then reads z.
  cuda::Stream::current(0).wait(produced);
  cuda::record_stream(z, cuda::Stream::current(0));
  const std::vector<float> got = (z * 2.0f).to_vec<float>();
  ASSERT_EQ(got.size(), 1000u);
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], 2.0f * v_host[i]) << i;
  EXPECT_TRUE(produced.query());
  produced.synchronize();
}

TEST(CudaStream, EventTimingMeasuresQueuedWork) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor a = random_cuda({2048, 2048}, 14);
  cuda::Event start(true), stop(true);
  start.record(cuda::Stream::current(0));
  const Tensor y = busy_work(a, 10);
  stop.record(cuda::Stream::current(0));
  stop.synchronize();
  const float ms = start.elapsed_time(stop);
  EXPECT_GT(ms, 0.0f);
  EXPECT_LT(ms, 60000.0f);
  cuda::Event untimed;
  untimed.record(cuda::Stream::current(0));
  untimed.synchronize();
  expect_error([&] { (void)start.elapsed_time(untimed); }, {"Event::elapsed_time", "enable_timing"});
  cuda::Event never;
  EXPECT_TRUE(never.query());  // nothing recorded: complete, like CUDA
}

TEST(CudaStream, RecordStreamDelaysReuseUntilTheOtherStreamIsDone) {
  FLAME_SKIP_IF_NO_CUDA();
  if (block_cache_off()) GTEST_SKIP() << "FLAME_CUDA_BLOCK_CACHE=0: reuse is up to the driver pool";
  const int64_t n = 777 * 1024 + 13;  // an unusual size: no other test caches blocks of it
  const Tensor a = random_cuda({4096, 4096}, 15);
  cuda::synchronize();
  const cuda::Stream side = cuda::Stream::create(0);

  // Control: without record_stream a block freed on its stream is reused at once.
  void* control = nullptr;
  {
    Tensor t = Tensor::empty({n}, {DType::f32, kCuda});
    control = t.data_ptr();
  }
  {
    Tensor u = Tensor::empty({n}, {DType::f32, kCuda});
    EXPECT_EQ(u.data_ptr(), control);
  }

  void* old = nullptr;
  Tensor result;
  {
    Tensor t = Tensor::full({n}, 3.0f, kCuda);
    old = t.data_ptr();
    cuda::Event ready;
    ready.record(cuda::Stream::current(0));
    {
      cuda::StreamGuard guard(side);
      side.wait(ready);
      const Tensor y = busy_work(a, 30);
      result = t + y.narrow(0, 0, 1).sum() * 0.0f;  // reads t after the long chain, on `side`
    }
    cuda::record_stream(t, side);
  }  // t freed while `side` still has to read it
  ASSERT_FALSE(side.query()) << "the side stream finished too early for this test to mean anything";
  {
    Tensor fresh = Tensor::full({n}, -1.0f, kCuda);
    EXPECT_NE(fresh.data_ptr(), old) << "a block recorded on a busy stream was handed out";
    EXPECT_GT(cuda::memory_stats().pending_stream_bytes, 0u);
    side.synchronize();
    // Once the side stream is done, the parked block is reused again (it was not leaked).
    Tensor again = Tensor::empty({n}, {DType::f32, kCuda});
    EXPECT_EQ(again.data_ptr(), old);
  }
  EXPECT_EQ(cuda::memory_stats().pending_stream_bytes, 0u);
  cuda::record_stream(result, cuda::Stream::current(0));
  const std::vector<float> r = result.to_vec<float>();
  ASSERT_EQ(r.size(), static_cast<std::size_t>(n));
  EXPECT_EQ(r.front(), 3.0f);
  EXPECT_EQ(r.back(), 3.0f);
}

TEST(CudaStream, SideStreamUploadOverlapsComputeAndIsCorrect) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor a = random_cuda({4096, 4096}, 16);
  const int64_t n = 8 << 20;  // 32 MiB of f32
  std::vector<float> host(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) host[static_cast<std::size_t>(i)] = static_cast<float>((i * 2654435761u) % 1000003) * 1e-3f;
  cuda::synchronize();
  const cuda::Stream compute = cuda::Stream::current(0);
  const cuda::Stream copy = cuda::Stream::create(0);

  const Tensor y = busy_work(a, 40);  // long compute on the default stream
  cuda::Event compute_done;
  compute_done.record(compute);
  Tensor x;
  cuda::Event uploaded;
  {
    cuda::StreamGuard guard(copy);
    x = Tensor::from_vec(host, {n}, kCuda);  // pinned staging, queued on `copy`
    uploaded.record(copy);
  }
  uploaded.synchronize();
  // The upload finished while the compute queued before it is still running: they overlapped.
  EXPECT_FALSE(compute_done.query()) << "the upload waited for the compute stream";
  compute.wait(uploaded);
  cuda::record_stream(x, compute);
  const std::vector<float> back = (x * 2.0f).to_vec<float>();
  ASSERT_EQ(back.size(), host.size());
  for (std::size_t i = 0; i < host.size(); i += 4099) ASSERT_EQ(back[i], 2.0f * host[i]) << i;
  ASSERT_EQ(back.back(), 2.0f * host.back());
  EXPECT_TRUE(std::isfinite(y.narrow(0, 0, 1).sum().item<float>()));
}

TEST(CudaStream, MatmulsOnTwoThreadsAndStreamsMatchTheCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  // No global lock and one workspace per stream: concurrent GEMMs of different shapes stay right.
  auto worker = [](uint64_t seed, int64_t m, int64_t k, int64_t n, double* max_err) {
    const cuda::Stream s = cuda::Stream::create(0);
    cuda::StreamGuard guard(s);
    const Tensor a = random_cuda({m, k}, seed), b = random_cuda({k, n}, seed + 1);
    Tensor c;
    for (int i = 0; i < 20; ++i) c = a.matmul(b);
    const std::vector<float> got = c.to_vec<float>();
    const std::vector<double> want =
        a.to(DType::f64, Device::cpu()).matmul(b.to(DType::f64, Device::cpu())).to_vec<double>();
    double err = 0;
    for (std::size_t i = 0; i < got.size(); ++i) err = std::max(err, std::abs(got[i] - want[i]) / (1.0 + std::abs(want[i])));
    *max_err = err;
  };
  double e1 = 1, e2 = 1;
  std::thread t1(worker, 21, 300, 517, 129, &e1);
  std::thread t2(worker, 31, 64, 1024, 700, &e2);
  t1.join();
  t2.join();
  EXPECT_LT(e1, 1e-4);
  EXPECT_LT(e2, 1e-4);
}

TEST(CudaStream, StatisticsReportFragmentation) {
  FLAME_SKIP_IF_NO_CUDA();
  Tensor keep = Tensor::empty({1 << 20}, {DType::f32, kCuda});
  { Tensor freed = Tensor::empty({3 << 18}, {DType::f32, kCuda}); }
  const cuda::MemoryStats s = cuda::memory_stats();
  EXPECT_EQ(s.fragmentation_bytes, s.reserved_bytes - s.allocated_bytes);
  EXPECT_GE(s.reserved_bytes, s.allocated_bytes + s.cached_bytes);
  EXPECT_GE(s.fragmentation_bytes, s.cached_bytes);
  if (!block_cache_off()) {
    EXPECT_GE(s.cached_bytes, std::size_t{3} << 20);  // the freed 3 MiB block is cached
  }
}

TEST(CudaStream, PoisonedAllocationsHideNoStaleValues) {
  FLAME_SKIP_IF_NO_CUDA();
  const char* env = std::getenv("FLAME_POISON_ALLOC");
  if (env == nullptr || std::string(env) == "0") GTEST_SKIP() << "run with FLAME_POISON_ALLOC=1 (ctest sets it)";
  if (block_cache_off()) GTEST_SKIP() << "FLAME_CUDA_BLOCK_CACHE=0";
  const int64_t n = 5 * 1024 + 3;
  void* p = nullptr;
  {
    Tensor right = Tensor::full({n}, 42.0f, kCuda);  // a block that holds "the right answer"
    p = right.data_ptr();
    (void)right.to_vec<float>();
  }
  Tensor reused = Tensor::empty({n}, {DType::f32, kCuda});
  ASSERT_EQ(reused.data_ptr(), p);  // the cached block came back...
  const std::vector<float> v = reused.to_vec<float>();
  for (float x : v) ASSERT_TRUE(std::isnan(x)) << "...but it still held the old values";
}

TEST(CudaStream, SynchronizeAndQueryOfAStream) {
  FLAME_SKIP_IF_NO_CUDA();
  const cuda::Stream s = cuda::Stream::create(0);
  EXPECT_TRUE(s.query());
  Tensor t;
  {
    cuda::StreamGuard guard(s);
    t = Tensor::full({1 << 20}, 1.5f, kCuda) * 2.0f;
  }
  s.synchronize();
  EXPECT_TRUE(s.query());
  cuda::record_stream(t, cuda::Stream::current(0));
  EXPECT_EQ(t.to_vec<float>()[777], 3.0f);
  // Wrapping a handle gives the same stream.
  EXPECT_EQ(cuda::Stream::from_handle(s.handle(), 0), s);
  expect_error([&] { cuda::record_stream(Tensor::ones({2}), s); }, {"record_stream", "CUDA tensor"});
}

// FLAME_CUDA_LAUNCH_BLOCKING=1: a kernel that faults is named by the error of its own launch. The
// fault destroys the CUDA context, so it runs in a child process (death-test style threadsafe
// re-runs this binary); the child exits 0 only if the launch itself raised with the kernel's name.
TEST(CudaStreamLaunchBlocking, AFaultingKernelIsNamedAtItsLaunch) {
  FLAME_SKIP_IF_NO_CUDA();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto child = [] {
    setenv("FLAME_CUDA_LAUNCH_BLOCKING", "1", 1);  // before anything reads it in this process
    try {
      const cuda::Kernel k = cuda::ensure_kernel("flame_fault_probe", R"(
extern "C" __global__ void flame_fault_probe(long long address) { *reinterpret_cast<volatile int*>(address) = 1; }
)");
      cuda::launch(k, cuda::LaunchConfig{cuda::Dim3(1), cuda::Dim3(1), 0}, static_cast<int64_t>(16));
    } catch (const Error& e) {
      const std::string msg = e.what();
      const bool named = msg.find("flame_fault_probe") != std::string::npos &&
                         msg.find("failed while running") != std::string::npos;
      std::fprintf(stderr, "%s\n", msg.c_str());
      std::exit(named ? 0 : 3);
    }
    std::exit(2);  // the launch returned although the kernel faulted
  };
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "") << "the faulting launch was not named";
}

}  // namespace
}  // namespace flame::test
