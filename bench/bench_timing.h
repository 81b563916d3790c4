#pragma once
// Timing shared by the CUDA benchmarks (bench/bench_nn_*.cpp): the method every PyTorch twin
// repeats in bench/bench_timing.py. Warm-up calls, then `reps` calls queued back to back on the
// stream with an event recorded between consecutive calls; the result is the median per-call time
// in milliseconds (no host synchronisation inside the timed region). FLAME_BENCH_DUMP=1 also prints
// every call's time in order to stderr.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "flame/cuda.h"

// Exits with the failing call named: a benchmark has nothing sensible to do after a CUDA error.
#define BENCH_CUDA_CHECK(call)                                                                 \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s: %s failed: %s\n", __FILE__, #call, cudaGetErrorString(e_));   \
      std::exit(2);                                                                            \
    }                                                                                          \
  } while (0)

namespace flame::bench {

// --reps N and --warmup N of a bench program (defaults 20 and 3; other arguments are ignored).
struct RepsArgs {
  int reps = 20;
  int warmup = 3;
};
inline RepsArgs parse_reps(int argc, char** argv) {
  RepsArgs r;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--reps") r.reps = std::max(1, std::atoi(argv[i + 1]));
    else if (a == "--warmup") r.warmup = std::max(0, std::atoi(argv[i + 1]));
  }
  return r;
}


inline double median_ms(cudaStream_t stream, int reps, int warmup, const std::function<void()>& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  BENCH_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<cudaEvent_t> ev(static_cast<std::size_t>(reps) + 1);
  for (auto& e : ev) BENCH_CUDA_CHECK(cudaEventCreate(&e));
  BENCH_CUDA_CHECK(cudaEventRecord(ev[0], stream));
  for (int r = 0; r < reps; ++r) {
    fn();
    BENCH_CUDA_CHECK(cudaEventRecord(ev[static_cast<std::size_t>(r) + 1], stream));
  }
  BENCH_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    float t = 0;
    BENCH_CUDA_CHECK(cudaEventElapsedTime(&t, ev[static_cast<std::size_t>(r)], ev[static_cast<std::size_t>(r) + 1]));
    ms.push_back(t);
  }
  for (auto& e : ev) BENCH_CUDA_CHECK(cudaEventDestroy(e));
  if (const char* dump = std::getenv("FLAME_BENCH_DUMP"); dump != nullptr && *dump != '\0') {  // every call, in order
    std::fprintf(stderr, "# per-call ms:");
    for (double t : ms) std::fprintf(stderr, " %.4f", t);
    std::fprintf(stderr, "\n");
  }
  std::sort(ms.begin(), ms.end());
  const std::size_t n = ms.size();
  return n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
}

// One BENCH line with a rate (GB/s, TFLOP/s) and the time it came from (the twins' emit_rate).
inline void emit_rate(const std::string& name, double value, const char* unit, double ms) {
  std::printf("BENCH {\"name\": \"%s\", \"value\": %.4g, \"unit\": \"%s\", \"ms\": %.4f}\n", name.c_str(), value,
              unit, ms);
  std::fflush(stdout);
}

// On the current FLAME stream.
inline double median_ms(int reps, int warmup, const std::function<void()>& fn) {
  return median_ms(static_cast<cudaStream_t>(flame::cuda::current_stream()), reps, warmup, fn);
}

}  // namespace flame::bench
