// flame::cuda's short-sequence attention switch and counters (declared in flame/cuda.h). Plain
// atomics, so that they exist in a build without CUDA too, like the autotuning switches.
#include "src/backend/short_attention.h"

#include <atomic>

#include "src/backend/tune_switch.h"

namespace flame::backend::short_attention {
namespace {

TuneSwitch g_switch{"FLAME_SHORT_ATTENTION", 0};  // off unless asked for
std::atomic<uint64_t> g_forward{0}, g_backward{0};

}  // namespace

bool enabled() { return g_switch.level() != 0; }

void count(bool forward) { (forward ? g_forward : g_backward).fetch_add(1, std::memory_order_relaxed); }

}  // namespace flame::backend::short_attention

namespace flame::cuda {
namespace sa = backend::short_attention;

void set_short_attention(bool enable) { sa::g_switch.set(enable); }
bool short_attention() { return sa::enabled(); }

ShortAttentionStats short_attention_stats() {
  ShortAttentionStats s;
  s.forward_calls = sa::g_forward.load(std::memory_order_relaxed);
  s.backward_calls = sa::g_backward.load(std::memory_order_relaxed);
  return s;
}

}  // namespace flame::cuda
