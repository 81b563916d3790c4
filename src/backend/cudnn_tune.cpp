// flame::cuda's cuDNN-autotuning switch and counters (declared in flame/cuda.h). Plain atomics, so
// that they exist in a build without CUDA too, like the epilogue switches (epi_tune.cpp).
#include "src/backend/cudnn_tune.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace flame::backend::cudnn_tune {
namespace {

constexpr int kUnset = -1;
std::atomic<int> g_level{kUnset};
std::atomic<uint64_t> g_tuned{0}, g_timed{0};

int level_from_env() {
  const char* v = std::getenv("FLAME_CUDNN_AUTOTUNE");
  if (v == nullptr || *v == '\0') return 0;  // off unless asked for (Note [cuDNN autotuning])
  if (std::strcmp(v, "0") == 0 || std::strcmp(v, "off") == 0 || std::strcmp(v, "false") == 0) return 0;
  if (std::strcmp(v, "2") == 0 || std::strcmp(v, "verbose") == 0) return 2;
  return 1;
}

}  // namespace

int level() {
  int v = g_level.load(std::memory_order_relaxed);
  if (v != kUnset) return v;
  int expected = kUnset;
  g_level.compare_exchange_strong(expected, level_from_env());  // a racing setter wins
  return g_level.load(std::memory_order_relaxed);
}

void count_tuned(uint64_t candidates) {
  g_tuned.fetch_add(1, std::memory_order_relaxed);
  g_timed.fetch_add(candidates, std::memory_order_relaxed);
}

}  // namespace flame::backend::cudnn_tune

namespace flame::cuda {
namespace ct = backend::cudnn_tune;

void set_cudnn_autotune(bool enable) {
  const int cur = ct::level();  // keeps the environment's verbose level when switching on
  ct::g_level.store(enable ? (cur == 2 ? 2 : 1) : 0, std::memory_order_relaxed);
}
bool cudnn_autotune() { return ct::level() != 0; }

CudnnTuneStats cudnn_tune_stats() {
  CudnnTuneStats s;
  s.tuned_plans = ct::g_tuned.load(std::memory_order_relaxed);
  s.timed_candidates = ct::g_timed.load(std::memory_order_relaxed);
  return s;
}

}  // namespace flame::cuda
