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

// A small sequential host generator (xoshiro256** seeded through splitmix64) whose output is the
// same on every platform and standard library: what randperm and the data samplers shuffle with,
// and what host-side augmentation can draw from (seeded with flame::data::BatchInfo::seed).
class HostRng {
 public:
  explicit HostRng(uint64_t seed) {
    for (uint64_t& w : s_) w = seed = splitmix64(seed);
  }
  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  // Uniform in [0, n) for n > 0, without modulo bias (the top partial range is redrawn).
  uint64_t below(uint64_t n) {
    const uint64_t limit = ~uint64_t{0} - (~uint64_t{0} % n);
    uint64_t x;
    do {
      x = next();
    } while (x >= limit);
    return x % n;
  }
  static uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  }
  // Two seeds into one well-mixed seed (order matters): e.g. (seed, epoch).
  static uint64_t mix(uint64_t a, uint64_t b) { return splitmix64(a ^ splitmix64(b + 0x632be59bd9b4e019ULL)); }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

// The process-wide generator used when an op is given none.
Generator& default_generator();
void manual_seed(uint64_t seed);

}  // namespace flame
