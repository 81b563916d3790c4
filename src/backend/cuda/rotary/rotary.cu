// CUDA kernel of the rotary embedding (src/backend/fused/rotary.h): one thread per pair of one
// row, grid-stride; x and out in their storage dtype, the arithmetic in cos's (f32, or f64 for f64
// x). Each pair reads its two x values and the two cos/sin values of its position once.
#include <algorithm>

#include "src/backend/cuda/cuda_backend.h"
#include "src/backend/cuda/device_utils.cuh"
#include "src/backend/cuda/launch_geometry.cuh"
#include "src/backend/fused/rotary.h"

namespace flame::backend::cuda {
namespace {

constexpr int kThreads = 256;

template <class T, class C, bool kHalf, bool kInverse>
__global__ void rotary_kernel(T* __restrict__ out, const T* __restrict__ x, const C* __restrict__ cos,
                              const C* __restrict__ sin, int64_t pairs_total, int64_t s_len, int64_t heads,
                              int64_t d) {
  const int64_t half = d / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs_total; p += stride) {
    const int64_t row = p / half, j = p - row * half;
    const int64_t s = (row / heads) % s_len;
    const int64_t a = kHalf ? j : 2 * j, b = kHalf ? j + half : 2 * j + 1;
    const int64_t xo = row * d, co = s * d;
    const C xa = load_as<C>(x[xo + a]), xb = load_as<C>(x[xo + b]);
    C oa, ob;
    if constexpr (!kInverse) {
      oa = xa * cos[co + a] - xb * sin[co + a];
      ob = xb * cos[co + b] + xa * sin[co + b];
    } else {
      oa = xa * cos[co + a] + xb * sin[co + b];
      ob = xb * cos[co + b] - xa * sin[co + a];
    }
    out[xo + a] = store_as<T>(oa);
    out[xo + b] = store_as<T>(ob);
  }
}

bool rotary_embedding_cuda(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin, int layout,
                           bool inverse, int64_t heads) {
  CudaBackend& be = cuda_backend(x.device().index);
  const int64_t d = x.size(-1), s_len = cos.size(0);
  const int64_t pairs_total = x.numel() / 2;
  if (pairs_total == 0) return true;
  DeviceGuard guard(be.device());
  const int64_t cap = static_cast<int64_t>(sm_count(be.device())) * 8;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(cap, (pairs_total + kThreads - 1) / kThreads));
  dispatch_floating(x.dtype(), "rotary_embedding", [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto go = [&]<class C, bool kHalf, bool kInverse>() {
      rotary_kernel<T, C, kHalf, kInverse><<<blocks, kThreads, 0, be.stream()>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()), static_cast<const C*>(cos.data_ptr()),
          static_cast<const C*>(sin.data_ptr()), pairs_total, s_len, heads, d);
      FLAME_CUDA_CHECK_LAUNCH();
    };
    auto pick = [&]<class C>() {
      if (layout == 1) {
        if (inverse) go.template operator()<C, true, true>();
        else go.template operator()<C, true, false>();
      } else {
        if (inverse) go.template operator()<C, false, true>();
        else go.template operator()<C, false, false>();
      }
    };
    if (cos.dtype() == DType::f64) pick.template operator()<double>();
    else pick.template operator()<float>();
  });
  return true;
}

}  // namespace

void register_rotary_kernels() { fused::rotary_embedding.define(DeviceType::cuda, &rotary_embedding_cuda); }

}  // namespace flame::backend::cuda
