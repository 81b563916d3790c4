#pragma once
// bf16 and f16 storage types. They hold the bit pattern only; arithmetic is done by converting to
// float (see Note [Compute types] in dtype.h). Conversions round to nearest even and keep NaN/Inf,
// so the CPU reference and CUDA kernels agree bit for bit.
#include <cstdint>
#include <cstring>

#include "flame/macros.h"

namespace flame {
namespace detail {
FLAME_INLINE uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}
FLAME_INLINE float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}
FLAME_INLINE uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
FLAME_INLINE float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

FLAME_INLINE uint16_t float_to_f16_bits(float value) {
  uint32_t f = float_bits(value);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  uint32_t o;
  if (f >= (143u << 23)) {  // >= 65536 (or Inf/NaN): overflow to Inf, NaN stays NaN
    o = (f > (255u << 23)) ? 0x7e00u : 0x7c00u;
  } else if (f < (113u << 23)) {  // below the smallest normal half: round into a subnormal
    const uint32_t magic = 126u << 23;  // 0.5f
    o = float_bits(bits_float(f) + bits_float(magic)) - magic;
  } else {
    const uint32_t mant_odd = (f >> 13) & 1u;
    f += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu;
    f += mant_odd;
    o = f >> 13;
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}
FLAME_INLINE float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return bits_float(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
  if (em >= 0x0400u) return bits_float(sign | ((em << 13) + (112u << 23)));
  const float sub = static_cast<float>(em) * 5.9604644775390625e-8f;  // em * 2^-24
  return bits_float(sign | float_bits(sub));
}
}  // namespace detail

struct bfloat16 {
  uint16_t bits = 0;
  bfloat16() = default;
  FLAME_HD explicit bfloat16(float f) : bits(detail::float_to_bf16_bits(f)) {}
  FLAME_HD explicit bfloat16(double d) : bfloat16(static_cast<float>(d)) {}
  FLAME_HD operator float() const { return detail::bf16_bits_to_float(bits); }
  FLAME_HD static bfloat16 from_bits(uint16_t b) {
    bfloat16 r;
    r.bits = b;
    return r;
  }
};

struct float16 {
  uint16_t bits = 0;
  float16() = default;
  FLAME_HD explicit float16(float f) : bits(detail::float_to_f16_bits(f)) {}
  FLAME_HD explicit float16(double d) : float16(static_cast<float>(d)) {}
  FLAME_HD operator float() const { return detail::f16_bits_to_float(bits); }
  FLAME_HD static float16 from_bits(uint16_t b) {
    float16 r;
    r.bits = b;
    return r;
  }
};

static_assert(sizeof(bfloat16) == 2 && sizeof(float16) == 2, "half types must be 2 bytes");
}  // namespace flame
