#pragma once
// 8-bit float storage types: the OCP formats PyTorch calls float8_e4m3fn and float8_e5m2 (fp8
// checkpoints of FLUX and T5 store their weights this way; Hopper's FP8 GEMMs read them). Like
// bfloat16 and float16 (half.h) they hold the bit pattern only; arithmetic converts to float.
//
// Note [Float8 formats]
//   e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits. No infinities: S.1111.111 is NaN, so the
//           largest finite value is 448 (S.1111.110). Exponent 0 is subnormal: m/8 * 2^-6.
//   e5m2:   1 sign, 5 exponent (bias 15), 2 mantissa bits, IEEE-like: exponent 31 is +-inf with
//           mantissa 0 and NaN otherwise; the largest finite value is 57344. Exponent 0 is
//           subnormal: m/4 * 2^-14.
// From float, both round to nearest, ties to even, and keep the sign of zero and of NaN (NaN
// becomes S.1111.111 in both), as PyTorch's casts do on the CPU:
//   e4m3fn saturates: anything of magnitude above 448, infinities included, becomes +-448;
//   e5m2 overflows as IEEE does: from 61440 (halfway from 57344 to 2^16) up it becomes +-inf.
// e5m2_bits(f, /*saturate=*/true) clamps to +-57344 instead (scaled quantisation, as CUDA's
// __NV_SATFINITE).
#include <cmath>
#include <cstdint>

#include "flame/half.h"
#include "flame/macros.h"

namespace flame {
namespace detail {

// float -> (sign, magnitude code) rounding shared by both formats: kE exponent bits, kM mantissa
// bits, kBias; returns the code of |f| (no sign), possibly one past the largest finite code when
// rounding carries (the caller saturates or maps it to infinity).
template <int kE, int kM, int kBias>
FLAME_INLINE uint32_t float8_magnitude_code(float a) {
  const uint32_t u = float_bits(a);
  const int fe = static_cast<int>((u >> 23) & 0xffu) - 127;
  if (fe < 1 - kBias) {  // below the smallest normal: a subnormal code m with value m * 2^(1-kBias-kM)
    const float q = a * bits_float(static_cast<uint32_t>(127 + kBias - 1 + kM) << 23);  // exact (power of 2)
    return static_cast<uint32_t>(rintf(q));  // ties to even; 2^kM is the smallest normal's code
  }
  if (fe + kBias >= (1 << kE)) return (1u << (kE + kM));  // far above the range: past every code
  constexpr int kShift = 23 - kM;
  const uint32_t mant = u & 0x7fffffu;
  uint32_t code = (static_cast<uint32_t>(fe + kBias) << kM) | (mant >> kShift);
  const uint32_t rem = mant & ((1u << kShift) - 1u), half = 1u << (kShift - 1);
  if (rem > half || (rem == half && (code & 1u))) ++code;  // a carry moves into the exponent
  return code;
}

FLAME_INLINE uint8_t float_to_e4m3fn_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7f);  // NaN
  if ((u & 0x7fffffffu) == 0x7f800000u) return static_cast<uint8_t>(sign | 0x7e);  // inf saturates
  uint32_t code = float8_magnitude_code<4, 3, 7>(bits_float(u & 0x7fffffffu));
  if (code > 0x7eu) code = 0x7eu;  // past 448 (0x7f is NaN): saturate
  return static_cast<uint8_t>(sign | code);
}

FLAME_INLINE uint8_t float_to_e5m2_bits(float f, bool saturate = false) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7f);  // NaN
  if ((u & 0x7fffffffu) == 0x7f800000u) return static_cast<uint8_t>(sign | (saturate ? 0x7b : 0x7c));
  uint32_t code = float8_magnitude_code<5, 2, 15>(bits_float(u & 0x7fffffffu));
  if (code > 0x7bu) code = saturate ? 0x7bu : 0x7cu;  // past 57344: +-inf (IEEE) or the largest finite
  return static_cast<uint8_t>(sign | code);
}

template <int kE, int kM, int kBias>
FLAME_INLINE float float8_bits_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> kM) & ((1u << kE) - 1u), m = b & ((1u << kM) - 1u);
  if (e == 0) {  // subnormal (or zero): m * 2^(1 - kBias - kM), exact in float
    const float v = static_cast<float>(m) * bits_float(static_cast<uint32_t>(127 + 1 - kBias - kM) << 23);
    return bits_float(sign | float_bits(v));
  }
  return bits_float(sign | (static_cast<uint32_t>(static_cast<int>(e) - kBias + 127) << 23) | (m << (23 - kM)));
}

FLAME_INLINE float e4m3fn_bits_to_float(uint8_t b) {
  if ((b & 0x7fu) == 0x7fu) return bits_float((static_cast<uint32_t>(b & 0x80u) << 24) | 0x7fc00000u);  // NaN
  return float8_bits_to_float<4, 3, 7>(b);
}

FLAME_INLINE float e5m2_bits_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  if ((b & 0x7cu) == 0x7cu) return bits_float(sign | ((b & 0x03u) ? 0x7fc00000u : 0x7f800000u));  // NaN / inf
  return float8_bits_to_float<5, 2, 15>(b);
}

}  // namespace detail

// One storage type per format: Codec gives the format's float -> bits and bits -> float.
template <class Codec>
struct float8 {
  uint8_t bits = 0;
  float8() = default;
  FLAME_HD explicit float8(float f) : bits(Codec::encode(f)) {}
  FLAME_HD explicit float8(double d) : float8(static_cast<float>(d)) {}
  FLAME_HD operator float() const { return Codec::decode(bits); }
  FLAME_HD static float8 from_bits(uint8_t b) {
    float8 r;
    r.bits = b;
    return r;
  }
};

namespace detail {
struct E4m3fnCodec {
  FLAME_INLINE static uint8_t encode(float f) { return float_to_e4m3fn_bits(f); }
  FLAME_INLINE static float decode(uint8_t b) { return e4m3fn_bits_to_float(b); }
};
struct E5m2Codec {
  FLAME_INLINE static uint8_t encode(float f) { return float_to_e5m2_bits(f); }
  FLAME_INLINE static float decode(uint8_t b) { return e5m2_bits_to_float(b); }
};
}  // namespace detail

using float8_e4m3fn = float8<detail::E4m3fnCodec>;
using float8_e5m2 = float8<detail::E5m2Codec>;

static_assert(sizeof(float8_e4m3fn) == 1 && sizeof(float8_e5m2) == 1, "float8 types must be 1 byte");
}  // namespace flame
