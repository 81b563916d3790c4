// The CUDA runtime's own host costs on this machine, the floor under FLAME's per-op overhead
// (bench_ops' add_small_host): an empty kernel launch (host cost, median over bursts of 200, and
// the rate over many launches), and a stream-ordered pool allocation + free.
// Output: "BENCH {json}" lines as bench_ops prints them (bench/compare.py joins them).
//
// Usage: host_floor [--calls N]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#define FLOOR_CHECK(call)                                                                \
  do {                                                                                   \
    cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "host_floor: %s failed: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(2);                                                                      \
    }                                                                                    \
  } while (0)

__global__ void empty_kernel(float* p, int n) {
  if (n < 0) p[threadIdx.x] = 0.0f;  // never true: keeps the parameters live
}

using Clock = std::chrono::steady_clock;
constexpr int kBurst = 200;
constexpr int kBursts = 50;

double us_per(Clock::time_point t0, Clock::time_point t1, int n) {
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / n;
}

void print(const char* name, double us) {
  std::printf("BENCH {\"name\": \"%s\", \"value\": %.4g, \"unit\": \"us/call\", \"ms\": %.6f}\n", name, us, us * 1e-3);
}

}  // namespace

int main(int argc, char** argv) {
  int calls = 10000;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--calls") == 0 && i + 1 < argc) {
      calls = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: host_floor [--calls N]\n");
      return 2;
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("# host_floor: no CUDA device; nothing to measure\n");
    return 0;
  }
  cudaStream_t stream;
  FLOOR_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = 0;
  cudaMemPool_t pool;
  FLOOR_CHECK(cudaMemPoolCreate(&pool, &props));
  uint64_t threshold = std::numeric_limits<uint64_t>::max();
  FLOOR_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  float* buf = nullptr;
  FLOOR_CHECK(cudaMalloc(&buf, 4096));

  for (int i = 0; i < 200; ++i) empty_kernel<<<4, 256, 0, stream>>>(buf, 1024);
  FLOOR_CHECK(cudaStreamSynchronize(stream));
  // Host cost per launch: the median over bursts short enough that the launch queue never fills.
  std::vector<double> bursts;
  for (int r = 0; r < kBursts; ++r) {
    const auto b0 = Clock::now();
    for (int i = 0; i < kBurst; ++i) empty_kernel<<<4, 256, 0, stream>>>(buf, 1024);
    const auto b1 = Clock::now();
    FLOOR_CHECK(cudaStreamSynchronize(stream));
    bursts.push_back(us_per(b0, b1, kBurst));
  }
  std::sort(bursts.begin(), bursts.end());
  print("launch_empty_host", bursts[bursts.size() / 2]);
  // Many launches until the GPU has run them all: the rate at which the GPU retires tiny kernels.
  auto t0 = Clock::now();
  for (int i = 0; i < calls; ++i) empty_kernel<<<4, 256, 0, stream>>>(buf, 1024);
  FLOOR_CHECK(cudaGetLastError());
  FLOOR_CHECK(cudaStreamSynchronize(stream));
  auto t2 = Clock::now();
  print("launch_empty_gpu", us_per(t0, t2, calls));

  for (int i = 0; i < 200; ++i) {
    void* p = nullptr;
    FLOOR_CHECK(cudaMallocFromPoolAsync(&p, 4096, pool, stream));
    FLOOR_CHECK(cudaFreeAsync(p, stream));
  }
  t0 = Clock::now();
  for (int i = 0; i < calls; ++i) {
    void* p = nullptr;
    FLOOR_CHECK(cudaMallocFromPoolAsync(&p, 4096, pool, stream));
    FLOOR_CHECK(cudaFreeAsync(p, stream));
  }
  const auto t1 = Clock::now();
  print("pool_alloc_free_host", us_per(t0, t1, calls));
  FLOOR_CHECK(cudaStreamSynchronize(stream));
  FLOOR_CHECK(cudaFree(buf));
  FLOOR_CHECK(cudaMemPoolDestroy(pool));
  FLOOR_CHECK(cudaStreamDestroy(stream));
  return 0;
}
