#pragma once
// The per-element math of the 8-bit float row kernels (src/backend/fused/float8.h), shared by the
// CPU reference (cpu_float8.cpp) and the CUDA kernels (cuda/float8/float8.cu) so that both give the
// same bits: everything in f32, the division IEEE-rounded on both.
#include <cstdint>

#include "flame/float8.h"
#include "flame/macros.h"

namespace flame::backend::float8_math {

// max that keeps a NaN once seen (std::max and fmaxf drop it).
FLAME_INLINE float nan_max(float m, float a) { return (a > m || a != a) ? a : m; }

// The row's scale from its amax (NaN and inf stay; an all-zero row gets 1).
FLAME_INLINE float row_scale(float amax, float fmax) { return amax == 0.0f ? 1.0f : amax / fmax; }

// v / scale as the format's bits, saturating at its largest finite value (NaN stays NaN).
template <bool kE4m3>
FLAME_INLINE uint8_t encode_scaled(float v, float scale) {
  const float s = v / scale;
  if constexpr (kE4m3) {
    return detail::float_to_e4m3fn_bits(s);  // saturates
  } else {
    return detail::float_to_e5m2_bits(s, /*saturate=*/true);
  }
}

template <bool kE4m3>
FLAME_INLINE float decode(uint8_t b) {
  if constexpr (kE4m3) {
    return detail::e4m3fn_bits_to_float(b);
  } else {
    return detail::e5m2_bits_to_float(b);
  }
}

inline constexpr float kE4m3Max = 448.0f, kE5m2Max = 57344.0f;

}  // namespace flame::backend::float8_math
