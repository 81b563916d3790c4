#pragma once
// Note [8-bit optimizer state]
// optim::AdamW8bit keeps Adam's two moments in 8 bits, block-wise quantised (Dettmers et al.,
// "8-bit Optimizers via Block-wise Quantization", 2021): a tensor's elements (in memory order) are
// cut into blocks of block_size; each block stores one f32 absmax (the largest |value| in it) and
// one uint8 code per element, an index into a 256-entry "dynamic" map of values in [-1, 1]
// (signed, for exp_avg) or [0, 1] (unsigned, for exp_avg_sq). An element's value is
// map[code] * absmax.
//
// The dynamic map (dynamic tree quantisation): after the sign bit (signed map only), the count k
// of leading zero bits selects the scale 10^-k, the first one bit is an indicator, and the bits
// after it are a linear fraction in [0.1, 1] (the midpoints of 2^bits equal bins). With 7 bits
// after the sign, k = 0..6 gives 2^(6-k) fractions per sign; the unsigned map spends the sign bit
// on one more fraction bit (2^(7-k) fractions). The codes left over hold 0 and 1, so the block's
// absmax element is stored exactly and zero stays zero. Maps are sorted ascending (codes are
// monotone in value).
//
// One step of a block (both backends, same float formulas in the same order):
//   m, v = map_s[code_m] * absmax_m, map_u[code_v] * absmax_v      (dequantise)
//   the AdamW element update (Note [Optimizer element math]) on p, g, m, v in the compute type
//   absmax_m, absmax_v = max |m|, max v over the block               (NaN propagates)
//   code = the nearest map entry to value / absmax (ties go to the lower code; 0 when absmax is 0)
// The parameter is updated from the unquantised m and v of this step, as bitsandbytes does.
#include <array>
#include <cstdint>
#include <vector>

#include "src/backend/fused.h"
#include "src/backend/optim_params.h"

namespace flame::backend {

inline constexpr int kQuantMapSize = 256;

// The two dynamic maps, built once on the host (double arithmetic rounded to f32).
struct QuantMaps {
  std::array<float, kQuantMapSize> map[2];  // [0]: signed (exp_avg), [1]: unsigned (exp_avg_sq)
};
const QuantMaps& quant_maps();

// One parameter of an 8-bit AdamW call. All entries of a call share the device, the parameter
// dtype and whether they have master weights; param, grad, master and codes share one dense layout.
struct Optim8bitTensor {
  Tensor param;      // updated in place (rounded from `master` when that is defined)
  Tensor grad;
  Tensor master;     // f32 master weights of a half parameter, or undefined
  Tensor codes[2];   // u8, one per element: exp_avg (signed map), exp_avg_sq (unsigned map)
  Tensor absmax[2];  // f32 [ceil(numel / block_size)]
  double step_size = 0;   // lr / (1 - beta1^t)
  double bias2_sqrt = 1;  // sqrt(1 - beta2^t)
  uint64_t rng_index = 0;   // stochastic rounding: element i draws Philox(seed, rng_index + i, rng_offset)
  uint64_t rng_offset = 0;
};

namespace quant8 {

// The code of the map entry nearest to x (map sorted ascending; ties to the lower code; NaN -> 0).
FLAME_INLINE uint8_t nearest_code(const float* map, float x) {
  if (!(x > map[0])) return 0;
  if (x >= map[kQuantMapSize - 1]) return static_cast<uint8_t>(kQuantMapSize - 1);
  int lo = 0, hi = kQuantMapSize - 1;  // map[lo] < x < map[hi] or map[lo] == x
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (map[mid] <= x) lo = mid;
    else hi = mid;
  }
  return static_cast<uint8_t>(x - map[lo] <= map[hi] - x ? lo : hi);
}

// The code of `value` in a block whose absmax is `absmax`.
FLAME_INLINE uint8_t quantize(const float* map, float value, float absmax) {
  return nearest_code(map, absmax > 0.0f ? value / absmax : 0.0f);
}

FLAME_INLINE float dequantize(const float* map, uint8_t code, float absmax) { return map[code] * absmax; }

// max(a, |x|) for the block absmax; a NaN stays (a NaN state shows, as it would in f32 AdamW).
FLAME_INLINE float absmax_with(float a, float x) {
  const float ax = x < 0.0f ? -x : x;
  return (ax > a || ax != ax) && a == a ? ax : a;
}

}  // namespace quant8

namespace fused {

// One 8-bit AdamW step of every tensor in `tensors` (Note [8-bit optimizer state]); hyper.kind is
// adam with decoupled weight decay (amsgrad is not supported). (hyper, block_size, tensors)
extern FusedKernel<void(const OptimHyper&, int64_t, const std::vector<Optim8bitTensor>&)> adamw8bit_step;

}  // namespace fused

}  // namespace flame::backend
