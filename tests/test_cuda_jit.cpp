// Run-time compiled kernels (flame/cuda/kernels.h): compile, caches (memory, disk, a new process),
// errors, and launches on FLAME tensors.
//
// The CudaJitCompile cases need NVRTC only (a CUDA build), not a GPU: they run on build machines
// without one. The CudaJit cases launch kernels and skip without a GPU.
//
// Note [Child process]
// The disk cache must serve a NEW process without NVRTC. The test re-runs this binary
// (/proc/self/exe) with FLAME_JIT_TEST_CHILD=<cache dir>. A global test environment, registered
// below, sees the variable when RUN_ALL_TESTS starts, does the child's work (ensure_kernel and a
// checked launch on a GPU, else precompile for sm_90), prints one line
//   FLAME_JIT_CHILD compiles=<n> disk_hits=<n> disk_rejects=<n> ok=<0|1>
// and exits before any test runs. The parent parses that line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "flame/cuda/kernels.h"
#include "flame/flame.h"
#include "test_util.h"

namespace flame::test {
namespace {

namespace fs = std::filesystem;
using cuda::CudaKernels;
using cuda::KernelCacheOptions;
using cuda::LaunchConfig;

#define FLAME_SKIP_IF_NO_NVRTC()                                                                \
  do {                                                                                          \
    if (!::flame::cuda::kernel_compiler_available())                                           \
      GTEST_SKIP() << "FLAME built without CUDA: no run-time kernel compiler";                  \
  } while (0)

// A fresh cache directory, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::path(::testing::TempDir()) / "flame_jit_XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::vector<fs::path> entries() const {
    std::vector<fs::path> out;
    for (const auto& e : fs::directory_iterator(path_)) out.push_back(e.path());
    return out;
  }

 private:
  std::string path_;
};

// A string no earlier run has compiled, so no cache can already hold the kernel.
std::string nonce() {
  static std::atomic<int> counter{0};
  std::random_device rd;
  return std::to_string(rd()) + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++);
}

constexpr const char* kAxpySource = R"(
extern "C" __global__ void axpy(float a, const float* x, const float* y, float* out, long n) {
  long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a * x[i] + y[i];
}
)";

std::vector<float> random_floats(std::size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// Launches axpy on random inputs and checks every element against a host reference.
::testing::AssertionResult run_axpy(const cuda::Kernel& k, int64_t n, uint32_t seed) {
  const auto xs = random_floats(static_cast<std::size_t>(n), seed);
  const auto ys = random_floats(static_cast<std::size_t>(n), seed + 1);
  const Tensor x = Tensor::from_vec(xs, {n}, Device::cuda(0));
  const Tensor y = Tensor::from_vec(ys, {n}, Device::cuda(0));
  Tensor out = Tensor::full({n}, std::nanf(""), Device::cuda(0));  // poison: every element must be written
  const float a = 1.75f;
  cuda::launch(k, LaunchConfig::for_elements(n), a, x, y, out, static_cast<long>(n));
  const auto got = out.to_vec<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float want = a * xs[i] + ys[i];
    if (!(std::fabs(got[i] - want) <= 1e-6f * (1.0f + std::fabs(want))))
      return ::testing::AssertionFailure() << "element " << i << ": got " << got[i] << ", want " << want;
  }
  return ::testing::AssertionSuccess();
}

// ---- Note [Child process] ----

constexpr const char* kChildEnv = "FLAME_JIT_TEST_CHILD";
constexpr const char* kChildKernelTag = "// child-process kernel v1\n";

class ChildProcessEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* dir = std::getenv(kChildEnv);
    if (!dir) return;
    run_child_and_exit(dir);
  }

 private:
  static void run_child_and_exit(const char* dir) {
    int ok = 0;
    cuda::KernelCacheStats s;
    try {
      CudaKernels kernels(KernelCacheOptions{std::string(dir)});
      const std::string source = std::string(kChildKernelTag) + kAxpySource;
      if (cuda_is_available()) {
        const cuda::Kernel k = kernels.ensure_kernel("axpy", source);
        ok = run_axpy(k, 4099, 7) ? 1 : 0;
      } else {
        kernels.precompile("axpy", source, {}, 90);
        ok = 1;
      }
      s = kernels.stats();
    } catch (const std::exception& e) {
      std::printf("FLAME_JIT_CHILD error: %s\n", e.what());
    }
    std::printf("FLAME_JIT_CHILD compiles=%llu disk_hits=%llu disk_rejects=%llu ok=%d\n",
                static_cast<unsigned long long>(s.compiles), static_cast<unsigned long long>(s.disk_hits),
                static_cast<unsigned long long>(s.disk_rejects), ok);
    std::fflush(stdout);
    std::_Exit(0);
  }
};

[[maybe_unused]] ::testing::Environment* const g_child_env =
    ::testing::AddGlobalTestEnvironment(new ChildProcessEnvironment);

struct ChildResult {
  bool found = false;
  unsigned long long compiles = 0, disk_hits = 0, disk_rejects = 0;
  int ok = 0;
  std::string output;
};

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += (c == '\'') ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

ChildResult run_child(const std::string& cache_dir) {
  ChildResult r;
  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  // The filter must match a test, or RUN_ALL_TESTS sets up no environment; the child exits first.
  // Sharding variables of the parent (a sharded run) must not drop the child's filtered test.
  const std::string cmd = "env -u GTEST_TOTAL_SHARDS -u GTEST_SHARD_INDEX -u GTEST_SHARD_STATUS_FILE " +
                          std::string(kChildEnv) + "=" + shell_quote(cache_dir) + " " + shell_quote(exe) +
                          " --gtest_filter=CudaJitConfig.ForElements 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return r;
  char buf[4096];
  while (std::fgets(buf, sizeof(buf), pipe)) r.output += buf;
  ::pclose(pipe);
  const auto pos = r.output.find("FLAME_JIT_CHILD compiles=");
  if (pos != std::string::npos) {
    r.found = std::sscanf(r.output.c_str() + pos, "FLAME_JIT_CHILD compiles=%llu disk_hits=%llu disk_rejects=%llu ok=%d",
                          &r.compiles, &r.disk_hits, &r.disk_rejects, &r.ok) == 4;
  }
  return r;
}

// Compiles the child's kernel in this process, as the child will (same key).
void populate_child_kernel(CudaKernels& kernels) {
  const std::string source = std::string(kChildKernelTag) + kAxpySource;
  if (cuda_is_available()) {
    EXPECT_TRUE(run_axpy(kernels.ensure_kernel("axpy", source), 1000, 3));
  } else {
    kernels.precompile("axpy", source, {}, 90);
  }
}

void corrupt(const fs::path& file, int how) {
  const auto size = fs::file_size(file);
  if (how == 0) {  // truncated, as by a crash mid-write without the rename
    fs::resize_file(file, size / 2);
  } else {  // one byte flipped in the binary
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(size - 17));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(static_cast<std::streamoff>(size - 17));
    f.write(&c, 1);
  }
}

}  // namespace

// ---- no GPU needed ----

TEST(CudaJitConfig, ForElements) {
  const LaunchConfig c = LaunchConfig::for_elements(1000, 128);
  EXPECT_EQ(c.grid.x, 8u);
  EXPECT_EQ(c.grid.y, 1u);
  EXPECT_EQ(c.block.x, 128u);
  EXPECT_EQ(c.shared_mem, 0u);
  EXPECT_EQ(LaunchConfig::for_elements(1024).grid.x, 4u);
  EXPECT_EQ(LaunchConfig::for_elements(1025).grid.x, 5u);
  EXPECT_EQ(LaunchConfig::for_elements(0).grid.x, 0u);
  expect_error([] { LaunchConfig::for_elements(-1); }, {"for_elements", "negative"});
  expect_error([] { LaunchConfig::for_elements(10, 2048); }, {"for_elements", "2048"});
  expect_error([] { LaunchConfig::for_elements(int64_t{1} << 45, 1); }, {"for_elements", "grid-stride"});
}

TEST(CudaJitConfig, WithoutCudaEveryCallRaises) {
  if (cuda::kernel_compiler_available()) GTEST_SKIP() << "CUDA build: the no-CUDA stubs are not linked";
  expect_error([] { cuda::ensure_kernel("k", "__global__ void k() {}"); }, {"ensure_kernel", "built without CUDA"});
  expect_error([] { CudaKernels k; }, {"built without CUDA"});
}

TEST(CudaJitCompile, PrecompileCachesInMemoryAndOnDisk) {
  FLAME_SKIP_IF_NO_NVRTC();
  TempDir dir;
  const std::string source = "// " + nonce() + "\n" + kAxpySource;
  {
    CudaKernels a(KernelCacheOptions{dir.path()});
    EXPECT_FALSE(a.precompile("axpy", source, {}, 90));
    EXPECT_TRUE(a.precompile("axpy", source, {}, 90));
    const auto s = a.stats();
    EXPECT_EQ(s.compiles, 1u);
    EXPECT_EQ(s.memory_hits, 1u);
    EXPECT_EQ(s.disk_writes, 1u);
    EXPECT_EQ(s.disk_hits, 0u);
    EXPECT_EQ(dir.entries().size(), 1u);
    // Other options or another architecture are other binaries.
    EXPECT_FALSE(a.precompile("axpy", source, {"-DVARIANT=1"}, 90));
    EXPECT_FALSE(a.precompile("axpy", source, {}, 80));
    EXPECT_EQ(a.stats().compiles, 3u);
  }
  CudaKernels b(KernelCacheOptions{dir.path()});  // a new cache: the disk serves it
  EXPECT_TRUE(b.precompile("axpy", source, {}, 90));
  EXPECT_EQ(b.stats().compiles, 0u);
  EXPECT_EQ(b.stats().disk_hits, 1u);
  EXPECT_EQ(b.disk_dir(), dir.path());

  CudaKernels no_disk(KernelCacheOptions{std::string()});  // "" disables the disk cache
  EXPECT_FALSE(no_disk.precompile("axpy", source, {}, 90));
  EXPECT_EQ(no_disk.stats().disk_writes, 0u);
}

TEST(CudaJitCompile, CorruptDiskEntriesAreRebuilt) {
  FLAME_SKIP_IF_NO_NVRTC();
  TempDir dir;
  const std::string source = "// " + nonce() + "\n" + kAxpySource;
  CudaKernels(KernelCacheOptions{dir.path()}).precompile("axpy", source, {}, 90);
  ASSERT_EQ(dir.entries().size(), 1u);
  const fs::path entry = dir.entries()[0];
  for (int how = 0; how < 2; ++how) {
    corrupt(entry, how);
    CudaKernels c(KernelCacheOptions{dir.path()});
    EXPECT_FALSE(c.precompile("axpy", source, {}, 90)) << "corruption " << how;
    EXPECT_EQ(c.stats().disk_rejects, 1u) << "corruption " << how;
    EXPECT_EQ(c.stats().compiles, 1u) << "corruption " << how;
    EXPECT_EQ(c.stats().disk_writes, 1u) << "corruption " << how;
    CudaKernels d(KernelCacheOptions{dir.path()});  // the rewritten entry is good again
    EXPECT_TRUE(d.precompile("axpy", source, {}, 90));
    EXPECT_EQ(d.stats().disk_rejects, 0u);
  }
  // Garbage and an empty file under the entry's name are rejected too; no temporary files remain.
  std::ofstream(entry, std::ios::trunc) << "not a kernel";
  CudaKernels e(KernelCacheOptions{dir.path()});
  EXPECT_FALSE(e.precompile("axpy", source, {}, 90));
  EXPECT_EQ(e.stats().disk_rejects, 1u);
  EXPECT_EQ(dir.entries().size(), 1u);
}

TEST(CudaJitCompile, UnwritableCacheDirectoryStillCompiles) {
  FLAME_SKIP_IF_NO_NVRTC();
  TempDir dir;
  const fs::path file = fs::path(dir.path()) / "a_file";
  std::ofstream(file) << "x";
  CudaKernels c(KernelCacheOptions{(file / "sub").string()});  // a directory under a file cannot exist
  EXPECT_FALSE(c.precompile("axpy", "// " + nonce() + "\n" + kAxpySource, {}, 90));
  EXPECT_EQ(c.stats().compiles, 1u);
  EXPECT_EQ(c.stats().disk_errors, 1u);
}

TEST(CudaJitCompile, CompileErrorCarriesNameAndLog) {
  FLAME_SKIP_IF_NO_NVRTC();
  CudaKernels c(KernelCacheOptions{std::string()});
  const std::string bad = "__global__ void broken_kernel(float* p) { p[0] = undefined_thing; }";
  expect_error([&] { c.precompile("broken_kernel", bad, {}, 90); },
               {"broken_kernel", "failed to compile", "identifier \"undefined_thing\" is undefined"});
  // A name that is not in the source says so.
  expect_error([&] { c.precompile("missing", "__global__ void k(float*) {}", {}, 90); },
               {"missing", "must name a __global__ function"});
  EXPECT_EQ(c.stats().compiles, 0u);
  if (cuda_is_available()) {
    expect_error([&] { c.ensure_kernel("broken_kernel", bad); }, {"ensure_kernel", "broken_kernel", "undefined_thing"});
  }
}

TEST(CudaJitCompile, PreludeTypesAndTemplates) {
  FLAME_SKIP_IF_NO_NVRTC();
  CudaKernels c(KernelCacheOptions{std::string()});
  const std::string source = R"(
#include <flame/jit.cuh>
template <class T>
__global__ void scale(const T* x, T* y, float a, int64_t n) {
  __shared__ T staged[32];  // the prelude's types are trivial: allowed in shared memory
  (void)staged;
  for (int64_t i = flame::global_thread_index(); i < n; i += flame::global_thread_count())
    y[i] = flame::from_compute<T>(a * flame::to_compute(x[i]));
}
)";
  for (const char* name : {"scale<float>", "scale<double>", "scale<flame::bfloat16>", "scale<flame::float16>"})
    EXPECT_FALSE(c.precompile(name, source, {}, 90)) << name;
  EXPECT_EQ(c.stats().compiles, 4u);
}

TEST(CudaJitCompile, ConcurrentRequestsCompileOnce) {
  FLAME_SKIP_IF_NO_NVRTC();
  TempDir dir;
  CudaKernels c(KernelCacheOptions{dir.path()});
  const std::string source = "// " + nonce() + "\n" + kAxpySource;
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      try {
        if (cuda_is_available()) {
          (void)c.ensure_kernel("axpy", source);
        } else {
          c.precompile("axpy", source, {}, 90);
        }
      } catch (...) {
        ++errors;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(c.stats().compiles, 1u);
  EXPECT_EQ(c.stats().memory_hits, 7u);
}

TEST(CudaJitCompile, NewProcessReusesDiskCache) {
  FLAME_SKIP_IF_NO_NVRTC();
  TempDir dir;
  {
    CudaKernels parent(KernelCacheOptions{dir.path()});
    populate_child_kernel(parent);
    ASSERT_EQ(parent.stats().compiles, 1u);
    ASSERT_EQ(parent.stats().disk_writes, 1u);
  }
  const ChildResult first = run_child(dir.path());
  ASSERT_TRUE(first.found) << "child output:\n" << first.output;
  EXPECT_EQ(first.ok, 1) << first.output;
  EXPECT_EQ(first.compiles, 0u) << "the new process invoked NVRTC:\n" << first.output;
  EXPECT_EQ(first.disk_hits, 1u) << first.output;

  // A corrupted entry: the next process rejects it, compiles, and still runs correctly.
  ASSERT_EQ(dir.entries().size(), 1u);
  corrupt(dir.entries()[0], 1);
  const ChildResult second = run_child(dir.path());
  ASSERT_TRUE(second.found) << "child output:\n" << second.output;
  EXPECT_EQ(second.ok, 1) << second.output;
  EXPECT_EQ(second.disk_rejects, 1u) << second.output;
  EXPECT_EQ(second.compiles, 1u) << second.output;
}

// ---- on a GPU ----

TEST(CudaJit, CompileAndLaunchGivesCorrectValues) {
  FLAME_SKIP_IF_NO_CUDA();
  CudaKernels c(KernelCacheOptions{std::string()});
  const cuda::Kernel k = c.ensure_kernel("axpy", kAxpySource);
  EXPECT_EQ(k.name(), "axpy");
  EXPECT_EQ(k.lowered_name(), "axpy");
  EXPECT_EQ(k.device(), 0);
  EXPECT_GE(k.arch(), 50);
  ASSERT_EQ(k.num_params(), 5);
  EXPECT_EQ(k.param_size(0), sizeof(float));
  EXPECT_EQ(k.param_size(1), sizeof(void*));
  EXPECT_GE(k.max_threads_per_block(), 256);
  for (int64_t n : {1, 255, 256, 100003}) EXPECT_TRUE(run_axpy(k, n, static_cast<uint32_t>(n))) << "n = " << n;
}

TEST(CudaJit, SecondEnsureKernelIsAMemoryHit) {
  FLAME_SKIP_IF_NO_CUDA();
  TempDir dir;
  CudaKernels c(KernelCacheOptions{dir.path()});
  const std::string source = "// " + nonce() + "\n" + kAxpySource;
  const cuda::Kernel first = c.ensure_kernel("axpy", source);
  const auto after_first = c.stats();
  EXPECT_EQ(after_first.compiles, 1u);
  EXPECT_EQ(after_first.loads, 1u);
  const cuda::Kernel second = c.ensure_kernel("axpy", source);
  EXPECT_EQ(c.stats().compiles, 1u);
  EXPECT_EQ(c.stats().loads, 1u);
  EXPECT_EQ(c.stats().memory_hits, after_first.memory_hits + 1);
  EXPECT_EQ(first.handle(), second.handle());
  // A cleared memory cache reloads from disk; old handles stay usable.
  c.clear_memory_cache();
  const cuda::Kernel third = c.ensure_kernel("axpy", source);
  EXPECT_EQ(c.stats().compiles, 1u);
  EXPECT_EQ(c.stats().disk_hits, 1u);
  EXPECT_TRUE(run_axpy(first, 777, 11));
  EXPECT_TRUE(run_axpy(third, 777, 12));
}

TEST(CudaJit, HalfTypesMatchFlameConversions) {
  FLAME_SKIP_IF_NO_CUDA();
  CudaKernels c(KernelCacheOptions{std::string()});
  const std::string source = R"(
#include <flame/jit.cuh>
template <class T>
__global__ void scale(const T* x, T* y, float a, int64_t n) {
  for (int64_t i = flame::global_thread_index(); i < n; i += flame::global_thread_count())
    y[i] = flame::from_compute<T>(a * flame::to_compute(x[i]));
}
)";
  const int64_t n = 5001;
  const float a = -0.37f;
  const auto xs = random_floats(static_cast<std::size_t>(n), 21);
  for (DType dt : {DType::bf16, DType::f16}) {
    const char* name = dt == DType::bf16 ? "scale<flame::bfloat16>" : "scale<flame::float16>";
    const cuda::Kernel k = c.ensure_kernel(name, source);
    const Tensor x = Tensor::from_vec(xs, {n}, Device::cuda(0)).to(dt);
    Tensor y = Tensor::full({n}, 7.0, TensorOptions(dt, Device::cuda(0)));
    cuda::LaunchConfig cfg;
    cfg.grid = 3;  // a grid-stride loop over n
    cfg.block = 128;
    cuda::launch(k, cfg, x, y, a, static_cast<int64_t>(n));
    // FLAME's host types round the same way: results agree bit for bit.
    const auto xh = x.to_vec<double>();
    const auto got = y.to_vec<double>();
    for (int64_t i = 0; i < n; ++i) {
      const float prod = a * static_cast<float>(xh[i]);
      const double want = dt == DType::bf16 ? static_cast<double>(static_cast<float>(bfloat16(prod)))
                                            : static_cast<double>(static_cast<float>(float16(prod)));
      ASSERT_EQ(got[i], want) << name << " element " << i;
    }
  }
}

TEST(CudaJit, TensorArgumentIsItsFirstElement) {
  FLAME_SKIP_IF_NO_CUDA();
  CudaKernels c(KernelCacheOptions{std::string()});
  const cuda::Kernel k = c.ensure_kernel("axpy", kAxpySource);
  // Views pass data_ptr(): the address of their first element, storage offset included.
  const auto base = random_floats(64, 5);
  const Tensor all = Tensor::from_vec(base, {64}, Device::cuda(0));
  const Tensor x = all.narrow(0, 10, 20);
  const Tensor y = all.narrow(0, 40, 20);
  Tensor out = Tensor::full({20}, std::nanf(""), Device::cuda(0));
  cuda::launch(k, LaunchConfig::for_elements(20, 32), 2.0f, x, y, out, 20L);
  const auto got = out.to_vec<float>();
  for (int i = 0; i < 20; ++i) EXPECT_FLOAT_EQ(got[i], 2.0f * base[10 + i] + base[40 + i]) << i;
  // The kernel is ordered with FLAME ops on the same stream: use the result without a sync.
  const Tensor sum = (out * 2.0f).sum();
  double want = 0;
  for (int i = 0; i < 20; ++i) want += 2.0 * (2.0 * base[10 + i] + base[40 + i]);
  EXPECT_NEAR(sum.item<double>(), want, 1e-4 * (1 + std::fabs(want)));
}

TEST(CudaJit, BadArgumentsRaise) {
  FLAME_SKIP_IF_NO_CUDA();
  CudaKernels c(KernelCacheOptions{std::string()});
  const cuda::Kernel k = c.ensure_kernel("axpy", kAxpySource);
  const Tensor g = Tensor::ones({8}, Device::cuda(0));
  Tensor out = Tensor::zeros({8}, Device::cuda(0));
  const Tensor cpu = Tensor::ones({8});
  const auto cfg = LaunchConfig::for_elements(8);
  expect_error([&] { cuda::launch(k, cfg, 1.0f, cpu, g, out, 8L); }, {"launch", "axpy", "argument 1", "cpu"});
  expect_error([&] { cuda::launch(k, cfg, 1.0f, g, g, Tensor(), 8L); }, {"argument 3", "undefined"});
  expect_error([&] { cuda::launch(k, cfg, 1.0, g, g, out, 8L); }, {"argument 0", "8 bytes", "4"});
  expect_error([&] { cuda::launch(k, cfg, 1.0f, g, g, out, 8); }, {"argument 4", "4 bytes", "8"});
  expect_error([&] { cuda::launch(k, cfg, 1.0f, g, g, out); }, {"takes 5 parameters", "4 arguments"});
  LaunchConfig too_big = cfg;
  too_big.block = 2048;
  expect_error([&] { cuda::launch(k, too_big, 1.0f, g, g, out, 8L); }, {"launch", "2048 threads"});
  expect_error([&] { cuda::launch(cuda::Kernel(), cfg); }, {"launch", "empty kernel handle"});
  expect_error([&] { c.ensure_kernel("axpy", kAxpySource, {}, cuda_device_count()); }, {"ensure_kernel", "does not exist"});
  if (cuda_device_count() >= 2) {
    const Tensor other = Tensor::ones({8}, Device::cuda(1));
    expect_error([&] { cuda::launch(k, cfg, 1.0f, g, other, out, 8L); }, {"argument 2", "cuda:1", "cuda:0"});
  }
  // Nothing above was queued: out is untouched, and a later FLAME op sees no stale CUDA error.
  EXPECT_EQ(out.sum().item<double>(), 0.0);
  // An empty grid launches nothing.
  cuda::launch(k, LaunchConfig::for_elements(0), 1.0f, g, g, out, 0L);
  EXPECT_EQ(out.sum().item<double>(), 0.0);
}

TEST(CudaJit, LargeDynamicSharedMemory) {
  FLAME_SKIP_IF_NO_CUDA();
  CudaKernels c(KernelCacheOptions{std::string()});
  // Each block stages 96 KiB in shared memory (above the 48 KiB default limit) and reads it back
  // from another thread's slots.
  const cuda::Kernel k = c.ensure_kernel("stage", R"(
extern "C" __global__ void stage(const float* x, float* out, int per_thread) {
  extern __shared__ float buf[];
  const int t = threadIdx.x;
  const float v = x[blockIdx.x * blockDim.x + t];
  for (int j = 0; j < per_thread; ++j) buf[t * per_thread + j] = v + j;
  __syncthreads();
  const int u = (t + 1) % blockDim.x;
  float s = 0.f;
  for (int j = 0; j < per_thread; ++j) s += buf[u * per_thread + j];
  out[blockIdx.x * blockDim.x + t] = s;
})");
  const int blocks = 4, threads = 256, per_thread = 96;  // 256 * 96 * 4 B = 96 KiB
  const auto xs = random_floats(static_cast<std::size_t>(blocks * threads), 9);
  const Tensor x = Tensor::from_vec(xs, {blocks * threads}, Device::cuda(0));
  Tensor out = Tensor::full({blocks * threads}, std::nanf(""), Device::cuda(0));
  LaunchConfig cfg;
  cfg.grid = blocks;
  cfg.block = threads;
  cfg.shared_mem = static_cast<uint32_t>(threads * per_thread * sizeof(float));
  cuda::launch(k, cfg, x, out, per_thread);
  const auto got = out.to_vec<float>();
  for (int b = 0; b < blocks; ++b) {
    for (int t = 0; t < threads; ++t) {
      const float v = xs[b * threads + (t + 1) % threads];
      float want = 0.f;
      for (int j = 0; j < per_thread; ++j) want += v + j;
      ASSERT_NEAR(got[b * threads + t], want, 1e-3f * (1 + std::fabs(want))) << b << "," << t;
    }
  }
}

TEST(CudaJit, GlobalCacheAndFreeFunction) {
  FLAME_SKIP_IF_NO_CUDA();
  // A fixed source: the global cache may write it to the user's cache directory (once).
  const std::string source = std::string("// global-cache test\n") + kAxpySource;
  const cuda::Kernel k1 = cuda::ensure_kernel("axpy", source);
  const auto mid = CudaKernels::global().stats();
  const cuda::Kernel k2 = cuda::ensure_kernel("axpy", source);
  const auto after = CudaKernels::global().stats();
  EXPECT_EQ(after.compiles, mid.compiles);
  EXPECT_EQ(after.disk_hits, mid.disk_hits);
  EXPECT_EQ(after.memory_hits, mid.memory_hits + 1);
  EXPECT_EQ(k1.handle(), k2.handle());
  EXPECT_TRUE(run_axpy(k1, 513, 1));
}

}  // namespace flame::test
