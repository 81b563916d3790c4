#pragma once
// Counter-based random numbers (Philox-4x32-10). Element i of a random op drawn at generator
// offset o is a pure function of (seed, i, o), so the CPU and CUDA backends produce the same
// values for the same seed. Each random op advances the generator's offset by one.
#include <atomic>
#include <cstdint>

namespace flame {

class Generator {
 public:
  struct State {
    uint64_t seed = 0;
    uint64_t offset = 0;
  };
  explicit Generator(uint64_t seed = 0x5eed) : seed_(seed), offset_(0) {}
  Generator(const Generator& o) : seed_(o.seed_.load()), offset_(o.offset_.load()) {}
  Generator& operator=(const Generator& o) {
    seed_ = o.seed_.load();
    offset_ = o.offset_.load();
    return *this;
  }

  void manual_seed(uint64_t seed) {
    seed_ = seed;
    offset_ = 0;
  }
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  // Reserves `n` offsets and returns the first; thread-safe.
  uint64_t next_offset(uint64_t n = 1) { return offset_.fetch_add(n); }
  State get_state() const { return {seed_.load(), offset_.load()}; }
  void set_state(const State& s) {
    seed_ = s.seed;
    offset_ = s.offset;
  }

 private:
  std::atomic<uint64_t> seed_;
  std::atomic<uint64_t> offset_;
};

// The process-wide generator used when an op is given none.
Generator& default_generator();
void manual_seed(uint64_t seed);

}  // namespace flame
