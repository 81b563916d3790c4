// A fused kernel compiled at run time: out = silu(a) * b * scale in one pass over memory, instead
// of three FLAME ops (silu, mul, mul) and two intermediate tensors. Checked against those FLAME
// ops for f32 and bf16. Run it twice: the second run loads the binary from the disk cache
// ($FLAME_KERNEL_CACHE, else ~/.cache/flame/kernels) and prints compiles=0.
//
// On a machine without a GPU (or a FLAME built without CUDA) it says so and exits 0.
#include <cmath>
#include <cstdio>

#include "flame/cuda/kernels.h"
#include "flame/flame.h"

namespace {

// One template for every element type; <flame/jit.cuh> brings flame::bfloat16 / flame::float16
// (FLAME's bf16 / f16 layouts), int64_t and the compute-type helpers.
constexpr const char* kSiluMulSource = R"(
#include <flame/jit.cuh>

template <class T>
__global__ void silu_mul(const T* a, const T* b, T* out, float scale, int64_t n) {
  for (int64_t i = flame::global_thread_index(); i < n; i += flame::global_thread_count()) {
    const float x = flame::to_compute(a[i]);
    const float y = flame::to_compute(b[i]);
    out[i] = flame::from_compute<T>(x / (1.0f + expf(-x)) * y * scale);
  }
}
)";

bool run(flame::DType dtype, const char* kernel_name, double tolerance) {
  using namespace flame;
  const int64_t n = 1 << 20;
  const float scale = 0.5f;
  const Device gpu = Device::cuda(0);
  const Tensor a = Tensor::randn({n}, 0.0, 2.0, gpu).to(dtype);
  const Tensor b = Tensor::randn({n}, 0.0, 1.0, gpu).to(dtype);
  Tensor out = Tensor::empty({n}, TensorOptions(dtype, gpu));

  const cuda::Kernel k = cuda::ensure_kernel(kernel_name, kSiluMulSource);
  cuda::launch(k, cuda::LaunchConfig::for_elements(n), a, b, out, scale, n);

  // The same math with FLAME ops (f32 throughout), queued on the same stream after the kernel.
  const Tensor want = (a.to(DType::f32).silu() * b.to(DType::f32)) * scale;
  const double max_err = (out.to(DType::f32) - want).abs().max_all().item<double>();
  const double max_ref = want.abs().max_all().item<double>();
  const auto head = out.narrow(0, 0, 4).to_vec<float>();
  std::printf("%-26s n=%lld  out[:4] = [%.4f, %.4f, %.4f, %.4f]  max |out - flame ops| = %.3g (%s)\n",
              kernel_name, static_cast<long long>(n), head[0], head[1], head[2], head[3], max_err,
              max_err <= tolerance * max_ref ? "ok" : "MISMATCH");
  return max_err <= tolerance * max_ref;
}

}  // namespace

int main() {
  if (!flame::cuda_is_available()) {
    std::printf("custom_kernel: no CUDA device (or FLAME was built without CUDA); nothing to run\n");
    return 0;
  }
  bool ok = true;
  try {
    ok &= run(flame::DType::f32, "silu_mul<float>", 1e-5);
    ok &= run(flame::DType::bf16, "silu_mul<flame::bfloat16>", 1e-2);
  } catch (const flame::Error& e) {
    std::printf("custom_kernel: %s\n", e.what());
    return 1;
  }
  const auto s = flame::cuda::CudaKernels::global().stats();
  std::printf("kernel cache (%s): compiles=%llu disk_hits=%llu memory_hits=%llu\n",
              flame::cuda::CudaKernels::global().disk_dir().c_str(), static_cast<unsigned long long>(s.compiles),
              static_cast<unsigned long long>(s.disk_hits), static_cast<unsigned long long>(s.memory_hits));
  return ok ? 0 : 1;
}
