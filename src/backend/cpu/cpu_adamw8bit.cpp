// The dynamic quantisation maps and the CPU reference of the 8-bit AdamW step (Note [8-bit
// optimizer state] in src/backend/fused/adamw8bit.h): blocks are independent, so they are spread
// over the thread pool; each block dequantises, updates, takes its new absmax and requantises.
#include <algorithm>
#include <cmath>

#include "src/backend/cpu/cpu_backend.h"
#include "src/backend/cpu/cpu_threads.h"
#include "src/backend/fused/adamw8bit.h"
#include "src/backend/optim_math.h"

namespace flame::backend {

namespace {

// Note [8-bit optimizer state]: 2^(fraction_bits - k) fractions at scale 10^-k for k = 0..6,
// mirrored for the signed map, then 0 and 1.
std::array<float, kQuantMapSize> build_dynamic_map(bool is_signed) {
  std::vector<double> values;
  const int fraction_bits = is_signed ? 6 : 7;
  double scale = 1.0;
  for (int k = 0; k <= 6; ++k) {
    const int n = 1 << (fraction_bits - k);
    for (int j = 0; j < n; ++j) {
      const double fraction = 0.1 + 0.9 * (static_cast<double>(j) + 0.5) / static_cast<double>(n);
      values.push_back(scale * fraction);
      if (is_signed) values.push_back(-scale * fraction);
    }
    scale /= 10.0;
  }
  values.push_back(0.0);
  values.push_back(1.0);
  FLAME_CHECK(values.size() == kQuantMapSize, "dynamic_map", "built ", values.size(), " entries, expected ",
              kQuantMapSize);
  std::sort(values.begin(), values.end());
  std::array<float, kQuantMapSize> map{};
  for (int i = 0; i < kQuantMapSize; ++i) map[i] = static_cast<float>(values[i]);
  return map;
}

}  // namespace

const QuantMaps& quant_maps() {
  static const QuantMaps maps{{build_dynamic_map(true), build_dynamic_map(false)}};
  return maps;
}

namespace cpu {

namespace {

// P: parameter type; C: compute type (float, double for f64 parameters).
template <class P>
void adamw8bit_tensor(const optim_math::Hyper<compute_t<P>>& h, const OptimHyper& raw, int64_t block_size,
                      const Optim8bitTensor& e) {
  using C = compute_t<P>;
  const int64_t n = e.param.numel();
  P* param = static_cast<P*>(e.param.data_ptr());
  const P* grad = static_cast<const P*>(e.grad.data_ptr());
  float* master = e.master.defined() ? static_cast<float*>(e.master.data_ptr()) : nullptr;
  uint8_t* codes[2] = {static_cast<uint8_t*>(e.codes[0].data_ptr()), static_cast<uint8_t*>(e.codes[1].data_ptr())};
  float* absmax[2] = {static_cast<float*>(e.absmax[0].data_ptr()), static_cast<float*>(e.absmax[1].data_ptr())};
  const float* map_s = quant_maps().map[0].data();
  const float* map_u = quant_maps().map[1].data();
  const C step_size = static_cast<C>(e.step_size), bias2_sqrt = static_cast<C>(e.bias2_sqrt);
  const int64_t blocks = (n + block_size - 1) / block_size;
  const int64_t grain = std::max<int64_t>(1, kParallelGrain / (block_size * 8));
  parallel_for(blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> m_new(static_cast<std::size_t>(block_size)), v_new(static_cast<std::size_t>(block_size));
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * block_size, end = std::min(n, begin + block_size);
      const float am = absmax[0][b], av = absmax[1][b];
      float new_am = 0.0f, new_av = 0.0f;
      for (int64_t i = begin; i < end; ++i) {
        C p = master ? static_cast<C>(master[i]) : convert<C>(param[i]);
        C m = static_cast<C>(quant8::dequantize(map_s, codes[0][i], am));
        C v = static_cast<C>(quant8::dequantize(map_u, codes[1][i], av));
        C unused = C(0);
        optim_math::adam_update(h, step_size, bias2_sqrt, p, convert<C>(grad[i]), m, v, unused);
        m_new[i - begin] = static_cast<float>(m);
        v_new[i - begin] = static_cast<float>(v);
        new_am = quant8::absmax_with(new_am, m_new[i - begin]);
        new_av = quant8::absmax_with(new_av, v_new[i - begin]);
        if (master) {
          master[i] = static_cast<float>(p);
          if constexpr (std::is_same_v<P, bfloat16>) {
            if (raw.stochastic_rounding) {
              const uint32_t bits =
                  optim_math::rounding_bits(raw.seed, e.rng_index + static_cast<uint64_t>(i), e.rng_offset);
              param[i] = optim_math::stochastic_round_bf16(master[i], bits);
              continue;
            }
          }
          param[i] = convert<P>(master[i]);
        } else {
          param[i] = convert<P>(p);
        }
      }
      for (int64_t i = begin; i < end; ++i) {
        codes[0][i] = quant8::quantize(map_s, m_new[i - begin], new_am);
        codes[1][i] = quant8::quantize(map_u, v_new[i - begin], new_av);
      }
      absmax[0][b] = new_am;
      absmax[1][b] = new_av;
    }
  });
}

void adamw8bit_step_cpu(const OptimHyper& hyper, int64_t block_size, const std::vector<Optim8bitTensor>& tensors) {
  if (tensors.empty()) return;
  optim_count_launch();
  dispatch_floating(tensors.front().param.dtype(), "adamw8bit_step", [&](auto ptag) {
    using P = typename decltype(ptag)::type;
    const auto h = optim_math::make_hyper<compute_t<P>>(hyper);
    for (const Optim8bitTensor& e : tensors)
      if (e.param.numel() > 0) adamw8bit_tensor<P>(h, hyper, block_size, e);
  });
}

}  // namespace

void register_cpu_adamw8bit_kernels() { fused::adamw8bit_step.define(DeviceType::cpu, &adamw8bit_step_cpu); }

}  // namespace cpu
}  // namespace flame::backend
