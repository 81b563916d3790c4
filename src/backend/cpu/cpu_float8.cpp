// CPU reference of the 8-bit float row kernels (src/backend/fused/float8.h): the per-element math
// of src/backend/float8_math.h, one row per task.
#include <algorithm>
#include <cstdint>

#include "src/backend/cpu/cpu_backend.h"
#include "src/backend/cpu/cpu_threads.h"
#include "src/backend/float8_math.h"
#include "src/backend/fused/float8.h"
#include "src/core/dispatch.h"
#include "src/opdef/scalar_math.h"

namespace flame::backend::cpu {

namespace {
namespace fm = float8_math;

template <class T, bool kE4m3>
void quantize_rows(uint8_t* q, float* scale, const T* x, const float* col, int64_t rows, int64_t cols) {
  const float fmax = kE4m3 ? fm::kE4m3Max : fm::kE5m2Max;
  parallel_for(rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * cols;
      float amax = 0.0f;
      for (int64_t c = 0; c < cols; ++c) {
        const float v = col ? convert<float>(xr[c]) * col[c] : convert<float>(xr[c]);
        amax = fm::nan_max(amax, v < 0.0f ? -v : v);
      }
      const float s = fm::row_scale(amax, fmax);
      scale[r] = s;
      uint8_t* qr = q + r * cols;
      for (int64_t c = 0; c < cols; ++c) {
        const float v = col ? convert<float>(xr[c]) * col[c] : convert<float>(xr[c]);
        qr[c] = fm::encode_scaled<kE4m3>(v, s);
      }
    }
  });
}

bool float8_quantize_rows_cpu(const Tensor& q, const Tensor& scale, const Tensor& x, const Tensor& col) {
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  const bool e4m3 = q.dtype() == DType::f8_e4m3fn;
  const float* colp = col.defined() ? static_cast<const float*>(col.data_ptr()) : nullptr;
  dispatch_floating(x.dtype(), "float8_quantize_rows", [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto* qp = static_cast<uint8_t*>(q.data_ptr());
    auto* sp = static_cast<float*>(scale.data_ptr());
    const auto* xp = static_cast<const T*>(x.data_ptr());
    if (e4m3) quantize_rows<T, true>(qp, sp, xp, colp, rows, cols);
    else quantize_rows<T, false>(qp, sp, xp, colp, rows, cols);
  });
  return true;
}

template <class T, bool kE4m3>
void dequantize_rows(T* out, const uint8_t* q, int64_t pitch, const float* scale, int64_t scale_step, int64_t rows,
                     int64_t cols) {
  parallel_for(rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float s = scale[r * scale_step];
      for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = convert<T>(fm::decode<kE4m3>(q[r * pitch + c]) * s);
    }
  });
}

bool float8_dequantize_rows_cpu(const Tensor& out, const Tensor& q, const Tensor& scale) {
  const int64_t cols = q.size(-1), rows = cols == 0 ? 0 : q.numel() / cols;
  const int64_t step = scale.numel() == 1 ? 0 : 1;
  const int64_t pitch = q.is_contiguous() ? cols : q.stride(0);  // a 2-d q's rows may be strided
  const bool e4m3 = q.dtype() == DType::f8_e4m3fn;
  dispatch_floating(out.dtype(), "float8_dequantize_rows", [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto* op = static_cast<T*>(out.data_ptr());
    const auto* qp = static_cast<const uint8_t*>(q.data_ptr());
    const auto* sp = static_cast<const float*>(scale.data_ptr());
    if (e4m3) dequantize_rows<T, true>(op, qp, pitch, sp, step, rows, cols);
    else dequantize_rows<T, false>(op, qp, pitch, sp, step, rows, cols);
  });
  return true;
}

}  // namespace

void register_cpu_float8_kernels() {
  fused::float8_quantize_rows.define(DeviceType::cpu, &float8_quantize_rows_cpu);
  fused::float8_dequantize_rows.define(DeviceType::cpu, &float8_dequantize_rows_cpu);
}

}  // namespace flame::backend::cpu
