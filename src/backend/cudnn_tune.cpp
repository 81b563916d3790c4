// flame::cuda's cuDNN-autotuning switch and counters (declared in flame/cuda.h). Plain atomics, so
// that they exist in a build without CUDA too, like the epilogue switches (epi_tune.cpp).
#include "src/backend/cudnn_tune.h"

#include <atomic>

#include "src/backend/tune_switch.h"

namespace flame::backend::cudnn_tune {
namespace {

TuneSwitch g_switch{"FLAME_CUDNN_AUTOTUNE", 0};  // off unless asked for (Note [cuDNN autotuning])
std::atomic<uint64_t> g_tuned{0}, g_timed{0};

}  // namespace

int level() { return g_switch.level(); }

void count_tuned(uint64_t candidates) {
  g_tuned.fetch_add(1, std::memory_order_relaxed);
  g_timed.fetch_add(candidates, std::memory_order_relaxed);
}

}  // namespace flame::backend::cudnn_tune

namespace flame::cuda {
namespace ct = backend::cudnn_tune;

void set_cudnn_autotune(bool enable) { ct::g_switch.set(enable); }
bool cudnn_autotune() { return ct::level() != 0; }

CudnnTuneStats cudnn_tune_stats() {
  CudnnTuneStats s;
  s.tuned_plans = ct::g_tuned.load(std::memory_order_relaxed);
  s.timed_candidates = ct::g_timed.load(std::memory_order_relaxed);
  return s;
}

}  // namespace flame::cuda
