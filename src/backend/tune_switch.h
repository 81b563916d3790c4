#pragma once
// An autotuning switch with three levels (0 off, 1 on, 2 on and verbose) read from an environment
// variable at first use unless set in code first; plain atomics, so it exists in every build. Used
// by the epilogue GEMM autotuning (epi_tune.cpp) and the cuDNN plan autotuning (cudnn_tune.cpp).
#include <atomic>
#include <cstdlib>
#include <cstring>

namespace flame::backend {

class TuneSwitch {
 public:
  // `env`: the variable ("0"/"off"/"false": 0, "2"/"verbose": 2, anything else: 1); unset or
  // empty gives `default_level`.
  constexpr TuneSwitch(const char* env, int default_level) : env_(env), default_(default_level) {}

  int level() {
    int v = level_.load(std::memory_order_relaxed);
    if (v != kUnset) return v;
    int expected = kUnset;
    level_.compare_exchange_strong(expected, from_env());  // a racing set() wins
    return level_.load(std::memory_order_relaxed);
  }
  // On keeps the environment's verbose level.
  void set(bool enable) {
    const int cur = level();
    level_.store(enable ? (cur == 2 ? 2 : 1) : 0, std::memory_order_relaxed);
  }

 private:
  static constexpr int kUnset = -1;
  int from_env() const {
    const char* v = std::getenv(env_);
    if (v == nullptr || *v == '\0') return default_;
    if (std::strcmp(v, "0") == 0 || std::strcmp(v, "off") == 0 || std::strcmp(v, "false") == 0) return 0;
    if (std::strcmp(v, "2") == 0 || std::strcmp(v, "verbose") == 0) return 2;
    return 1;
  }
  const char* env_;
  int default_;
  std::atomic<int> level_{kUnset};
};

}  // namespace flame::backend
