// CPU reference of the "graph" backend block: the capturable EMA update and the sync-free
// gradient norm and clipping (Note [Device gradient clipping] in src/autograd/grad_clip_device.cpp).
// "Device memory" is host memory here, so the scalars the CUDA kernels read at kernel time are
// read directly; the arithmetic matches the CUDA kernels (double accumulation, f32 scaling of
// half and f32 tensors).
#include <cmath>

#include "src/backend/fused/multi_tensor.h"
#include "src/backend/cpu/cpu_backend.h"
#include "src/backend/optim_math.h"

namespace flame::backend::cpu {

static void ema_update_device_cpu(const TensorList& shadow, const TensorList& params, const Tensor& step,
                                  double decay, bool warmup) {
  const double n = *static_cast<const double*>(step.data_ptr());
  fused::ema_update.run(Device::cpu(), shadow, params, 1.0 - optim_math::ema_decay(decay, warmup, n));
}

static void foreach_norm_accumulate_cpu(const TensorList& tensors, double norm_type, const Tensor& acc) {
  if (tensors.empty()) return;
  const bool inf = std::isinf(norm_type);
  double total = *static_cast<const double*>(acc.data_ptr());
  dispatch_floating(tensors.front().dtype(), "foreach_norm_accumulate", [&](auto tag) {
    using T = typename decltype(tag)::type;
    for (const Tensor& t : tensors) {
      const T* p = static_cast<const T*>(t.data_ptr());
      const int64_t n = t.numel();
      for (int64_t i = 0; i < n; ++i) {
        double x;
        if constexpr (std::is_same_v<T, double>) x = std::fabs(p[i]);
        else x = std::fabs(static_cast<double>(convert<float>(p[i])));
        if (inf) {
          // NaN propagates, as torch's max does.
          if (std::isnan(x) || x > total) total = std::isnan(total) ? total : x;
        } else {
          total += norm_type == 2.0 ? x * x : (norm_type == 1.0 ? x : std::pow(x, norm_type));
        }
      }
    }
  });
  *static_cast<double*>(acc.data_ptr()) = total;
}

static void foreach_clip_scale_cpu(const TensorList& tensors, const Tensor& total_norm, double max_norm) {
  const double norm = *static_cast<const double*>(total_norm.data_ptr());
  double coef = max_norm / (norm + 1e-6);
  if (!std::isnan(coef) && coef > 1.0) coef = 1.0;
  if (coef == 1.0) return;
  for (const Tensor& t : tensors) {
    dispatch_floating(t.dtype(), "foreach_clip_scale", [&](auto tag) {
      using T = typename decltype(tag)::type;
      using C = compute_t<T>;
      const C c = static_cast<C>(coef);
      T* p = static_cast<T*>(t.data_ptr());
      const int64_t n = t.numel();
      for (int64_t i = 0; i < n; ++i) p[i] = convert<T>(convert<C>(p[i]) * c);
    });
  }
}

void register_cpu_graph_kernels() {
  fused::ema_update_device.define(DeviceType::cpu, &ema_update_device_cpu);
  fused::foreach_norm_accumulate.define(DeviceType::cpu, &foreach_norm_accumulate_cpu);
  fused::foreach_clip_scale.define(DeviceType::cpu, &foreach_clip_scale_cpu);
}

}  // namespace flame::backend::cpu
