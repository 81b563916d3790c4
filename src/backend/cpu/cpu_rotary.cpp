// CPU reference of the rotary embedding's fused kernel (src/backend/fused/rotary.h): one pass over
// the pairs of every row, in the dtype of cos (f32, or f64 for f64 x).
#include <algorithm>
#include <cstdint>

#include "src/backend/cpu/cpu_backend.h"
#include "src/backend/cpu/cpu_threads.h"
#include "src/backend/fused/rotary.h"
#include "src/core/dispatch.h"
#include "src/opdef/scalar_math.h"

namespace flame::backend::cpu {

namespace {

template <class T, class C>
void rotary_rows(T* out, const T* x, const C* cos, const C* sin, int64_t rows, int64_t s_len, int64_t heads, int64_t d,
                 bool half, bool inverse) {
  const int64_t pairs = d / 2;
  parallel_for(rows, std::max<int64_t>(1, 16384 / d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t s = (r / heads) % s_len;
      const C* c = cos + s * d;
      const C* sn = sin + s * d;
      const T* xr = x + r * d;
      T* o = out + r * d;
      for (int64_t j = 0; j < pairs; ++j) {
        const int64_t a = half ? j : 2 * j, b = half ? j + pairs : 2 * j + 1;
        const C xa = convert<C>(xr[a]), xb = convert<C>(xr[b]);
        if (!inverse) {
          o[a] = convert<T>(xa * c[a] - xb * sn[a]);
          o[b] = convert<T>(xb * c[b] + xa * sn[b]);
        } else {
          o[a] = convert<T>(xa * c[a] + xb * sn[b]);
          o[b] = convert<T>(xb * c[b] - xa * sn[a]);
        }
      }
    }
  });
}

bool rotary_embedding_cpu(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, int layout,
                          bool inverse, int64_t heads) {
  const int64_t d = x.size(-1), s_len = cos.size(0);
  const int64_t rows = x.numel() / d;
  dispatch_floating(x.dtype(), "rotary_embedding", [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto run = [&]<class C>() {
      rotary_rows<T, C>(static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()),
                        static_cast<const C*>(cos.data_ptr()), static_cast<const C*>(sin.data_ptr()), rows, s_len, heads, d,
                        layout == 1, inverse);
    };
    if (cos.dtype() == DType::f64) run.template operator()<double>();
    else run.template operator()<float>();
  });
  return true;
}

}  // namespace

void register_cpu_rotary_kernels() { fused::rotary_embedding.define(DeviceType::cpu, &rotary_embedding_cpu); }

}  // namespace flame::backend::cpu
