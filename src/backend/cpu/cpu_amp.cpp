// CPU reference of the GradScaler's fused unscale (Backend::amp_unscale): one pass per tensor,
// half types computed in float (as the CUDA kernel), f64 in double.
#include <cmath>
#include <type_traits>

#include "src/backend/fused/multi_tensor.h"
#include "src/backend/cpu/cpu_backend.h"
#include "src/core/dispatch.h"

namespace flame::backend::cpu {

static void amp_unscale_cpu(const TensorList& grads, double inv_scale, const Tensor& found_inf) {
  bool found = false;
  for (const Tensor& g : grads) {
    const int64_t n = g.numel();
    if (n == 0) continue;
    dispatch_floating(g.dtype(), "amp_unscale", [&](auto tag) {
      using T = typename decltype(tag)::type;
      using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
      const A inv = static_cast<A>(inv_scale);
      T* p = static_cast<T*>(g.data_ptr());
      bool bad = false;
      for (int64_t i = 0; i < n; ++i) {
        const A v = static_cast<A>(p[i]);
        bad |= !std::isfinite(v);
        p[i] = static_cast<T>(v * inv);
      }
      found |= bad;
    });
  }
  if (found) *static_cast<float*>(found_inf.data_ptr()) = 1.0f;
}

void register_cpu_amp_kernels() {
  fused::amp_unscale.define(DeviceType::cpu, &amp_unscale_cpu);
}

}  // namespace flame::backend::cpu
