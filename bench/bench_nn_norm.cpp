// Normalisation benchmarks (FLAME side; bench/bench_nn_norm_torch.py is the PyTorch twin, same
// names, shapes, dtypes and timing).
//
// Method (as bench/bench_ops.cpp): random inputs; warm-up calls; `reps` calls back to back on
// FLAME's stream with a CUDA event between consecutive calls; the median per-call time. GB/s
// counts the bytes the op must move: forward reads x (and the affine parameters) and writes y;
// forward+backward adds reading x and dy and writing dx (and the parameter gradients).
// pct_d2d is that rate over a 256 MiB device-to-device copy timed the same way
// (norm_d2d_copy). Every line also carries ms. group_norm_bf16_bwd times the backward alone (a
// retained graph; bytes: x, dy, dx and the parameters twice).
//
// Usage: bench_nn_norm [--reps N] [--warmup N]; FLAME_BENCH_TRACE=1 also prints the kernels of
// 10 forward+backward calls of each case.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench_timing.h"
#include "flame/flame.h"
#include "flame/nn/norm.h"
#include "flame/profiler.h"

namespace {

using flame::BackwardOptions;
using flame::Device;
using flame::DType;
using flame::Tensor;
namespace F = flame::nn::functional;

using flame::bench::median_ms;

void emit(const std::string& name, double gbps, double ms, double d2d) {
  std::printf("BENCH {\"name\": \"%s\", \"value\": %.4g, \"unit\": \"GB/s\", \"ms\": %.4f, \"pct_d2d\": %.1f}\n",
              name.c_str(), gbps, ms, 100.0 * gbps / d2d);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const flame::bench::RepsArgs args = flame::bench::parse_reps(argc, argv);
  const int reps = args.reps, warmup = args.warmup;
  if (!flame::cuda_is_available()) {
    std::printf("# bench_nn_norm: no CUDA device; nothing to measure\n");
    return 0;
  }
  const Device gpu = Device::cuda(0);
  auto stream = static_cast<cudaStream_t>(flame::cuda::current_stream(0));
  std::printf("# bench_nn_norm: reps %d, warm-up %d\n", reps, warmup);

  double d2d = 0;
  {
    const int64_t bytes = 256LL << 20;
    const Tensor src = Tensor::rand({bytes / 4}, gpu), dst = Tensor::empty({bytes / 4}, gpu);
    const double ms = median_ms(stream, reps, warmup, [&] {
      BENCH_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), bytes, cudaMemcpyDeviceToDevice, stream));
    });
    d2d = 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
    std::printf("BENCH {\"name\": \"norm_d2d_copy\", \"value\": %.4g, \"unit\": \"GB/s\", \"ms\": %.4f, \"pct_d2d\": 100.0}\n",
                d2d, ms);
  }

  const flame::TensorOptions bf16{DType::bf16, gpu};
  // bytes: x-sized tensors moved (fwd: x, y; fwd+bwd: + x, dy, dx), parameters as given.
  auto run = [&](const std::string& name, const flame::Shape& shape, int64_t params, bool bias,
                 const std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>& op,
                 bool bwd_alone = false) {
    try {
      const Tensor x0 = Tensor::randn(shape, 0.5, 2.0, bf16);
      const Tensor w = Tensor::randn({params}, 1.0, 0.2, bf16).requires_grad_();
      const Tensor b = bias ? Tensor::randn({params}, 0.0, 0.2, bf16).requires_grad_() : Tensor();
      const Tensor dy = Tensor::randn(shape, 0.0, 1.0, bf16);
      const double xb = static_cast<double>(x0.nbytes());
      const double pb = static_cast<double>(params) * 2.0 * (bias ? 2 : 1);
      {
        flame::NoGradGuard no_grad;
        const double ms = median_ms(stream, reps, warmup, [&] { (void)op(x0, w, b); });
        emit(name + "_fwd", (2 * xb + pb) / (ms * 1e-3) / 1e9, ms, d2d);
      }
      Tensor x = x0.detach().requires_grad_();
      BackwardOptions o;
      o.grad_output = dy;
      const double ms = median_ms(stream, reps, warmup, [&] {
        Tensor y = op(x, w, b);
        (void)y.backward(o);
      });
      emit(name + "_fwdbwd", (5 * xb + 3 * pb) / (ms * 1e-3) / 1e9, ms, d2d);
      if (std::getenv("FLAME_BENCH_TRACE") != nullptr) {  // where the forward+backward time goes
        flame::profiler::KernelTrace trace;
        trace.start();
        for (int i = 0; i < 10; ++i) {
          Tensor y = op(x, w, b);
          (void)y.backward(o);
        }
        trace.stop();
        std::printf("# kernels of 10 %s forward+backward calls:\n%s", name.c_str(), trace.summary(12, 100).c_str());
      }
      if (bwd_alone) {  // the backward alone, on a retained graph
        const Tensor y = op(x, w, b);
        BackwardOptions r = o;
        r.retain_graph = true;
        const double bms = median_ms(stream, reps, warmup, [&] { (void)y.backward(r); });
        emit(name + "_bwd", (3 * xb + 2 * pb) / (bms * 1e-3) / 1e9, bms, d2d);
      }
    } catch (const std::exception& e) {
      std::printf("BENCH {\"name\": \"%s_fwd\", \"error\": \"failed\"}\n# %s\n", name.c_str(), e.what());
    }
  };
  run("layer_norm_bf16", {32768, 1024}, 1024, true,
      [](const Tensor& x, const Tensor& w, const Tensor& b) { return F::layer_norm(x, {1024}, w, b); });
  run("rms_norm_bf16", {32768, 1024}, 1024, false,
      [](const Tensor& x, const Tensor& w, const Tensor&) { return F::rms_norm(x, {1024}, w, 1e-6); });
  run("group_norm_bf16", {32, 512, 64, 64}, 512, true,
      [](const Tensor& x, const Tensor& w, const Tensor& b) { return F::group_norm(x, 32, w, b); },
      /*bwd_alone=*/true);
  return 0;
}
