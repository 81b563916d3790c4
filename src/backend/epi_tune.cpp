// flame::cuda's epilogue-autotuning switches and counters (declared in flame/cuda.h). They are
// plain atomics, so that they exist in a build without CUDA too, like allow_tf32.
#include "src/backend/epi_tune.h"

#include <atomic>

#include "src/backend/tune_switch.h"

namespace flame::backend::epi_tune {
namespace {

TuneSwitch g_switch{"FLAME_EPI_AUTOTUNE", 1};
std::atomic<int> g_bias_grad{static_cast<int>(cuda::EpilogueBiasGrad::automatic)};
std::atomic<uint64_t> g_tuned{0}, g_heuristic{0}, g_timed{0}, g_column_sum{0};

}  // namespace

int level() { return g_switch.level(); }

void count_plan(bool tuned, bool column_sum) {
  (tuned ? g_tuned : g_heuristic).fetch_add(1, std::memory_order_relaxed);
  if (column_sum) g_column_sum.fetch_add(1, std::memory_order_relaxed);
}
void count_timed(uint64_t candidates) { g_timed.fetch_add(candidates, std::memory_order_relaxed); }

}  // namespace flame::backend::epi_tune

namespace flame::cuda {
namespace et = backend::epi_tune;

void set_epilogue_autotune(bool enable) { et::g_switch.set(enable); }
bool epilogue_autotune() { return et::level() != 0; }

void set_epilogue_bias_grad(EpilogueBiasGrad mode) {
  et::g_bias_grad.store(static_cast<int>(mode), std::memory_order_relaxed);
}
EpilogueBiasGrad epilogue_bias_grad() {
  return static_cast<EpilogueBiasGrad>(et::g_bias_grad.load(std::memory_order_relaxed));
}

EpilogueTuneStats epilogue_tune_stats() {
  EpilogueTuneStats s;
  s.tuned_plans = et::g_tuned.load(std::memory_order_relaxed);
  s.heuristic_plans = et::g_heuristic.load(std::memory_order_relaxed);
  s.timed_candidates = et::g_timed.load(std::memory_order_relaxed);
  s.column_sum_plans = et::g_column_sum.load(std::memory_order_relaxed);
  return s;
}

}  // namespace flame::cuda
