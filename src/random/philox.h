#pragma once
// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3") and the mapping
// from its words to uniform, normal and integer samples. Shared by the CPU and CUDA backends so
// that element i at generator offset o has the same value on both (see random.h).
#include <cstdint>

#include "flame/macros.h"
#include "src/opdef/scalar_math.h"

namespace flame::philox {

struct Words {
  uint32_t w[4];
};

FLAME_INLINE Words generate(uint64_t seed, uint64_t index, uint64_t offset) {
  uint32_t c0 = static_cast<uint32_t>(index), c1 = static_cast<uint32_t>(index >> 32);
  uint32_t c2 = static_cast<uint32_t>(offset), c3 = static_cast<uint32_t>(offset >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Words{{c0, c1, c2, c3}};
}

// Uniform in [0, 1): 24 bits for float, 53 bits for double.
template <class C>
FLAME_INLINE C uniform01(const Words& r) {
  if constexpr (std::is_same_v<C, double>) {
    const uint64_t bits = (static_cast<uint64_t>(r.w[0]) << 32 | r.w[1]) >> 11;
    return static_cast<double>(bits) * (1.0 / 9007199254740992.0);
  } else {
    return static_cast<float>(r.w[0] >> 8) * (1.0f / 16777216.0f);
  }
}

// Standard normal by Box-Muller; u1 lies in (0, 1] so the log is finite.
template <class C>
FLAME_INLINE C normal(const Words& r) {
  C u1, u2;
  if constexpr (std::is_same_v<C, double>) {
    u1 = (static_cast<double>((static_cast<uint64_t>(r.w[0]) << 32 | r.w[1]) >> 11) + 1.0) *
         (1.0 / 9007199254740992.0);
    u2 = static_cast<double>((static_cast<uint64_t>(r.w[2]) << 32 | r.w[3]) >> 11) *
         (1.0 / 9007199254740992.0);
  } else {
    u1 = (static_cast<float>(r.w[0] >> 8) + 1.0f) * (1.0f / 16777216.0f);
    u2 = static_cast<float>(r.w[1] >> 8) * (1.0f / 16777216.0f);
  }
  const C two_pi = static_cast<C>(6.283185307179586476925);
  return math::sqrt(C(-2) * math::log(u1)) * math::cos(two_pi * u2);
}

// Integer in [low, high) (high > low); modulo bias is below 2^-32 for ranges under 2^32.
// Unsigned arithmetic: high - low may exceed INT64_MAX (randint checks that high > low).
FLAME_INLINE int64_t integer(const Words& r, int64_t low, int64_t high) {
  const uint64_t range = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);
  const uint64_t bits = static_cast<uint64_t>(r.w[0]) << 32 | r.w[1];
  return static_cast<int64_t>(static_cast<uint64_t>(low) + bits % range);
}

}  // namespace flame::philox
