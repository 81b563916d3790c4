// Benchmarks of the pool family on the GPU: fused cross-entropy forward+backward on vocabulary-sized
// bf16 logits, and max/avg pooling and nearest/bilinear upsampling forward and forward+backward on
// bf16 [32, 256, 64, 64]. bench/bench_nn_pool_torch.py measures the same with PyTorch.
//
// Method (as bench_ops.cpp): random inputs; warm-up calls; `reps` calls queued back to back on
// FLAME's stream with a CUDA event between consecutive calls; the median per-call time in ms.
// A fwd+bwd call is the forward plus backward() with a random output gradient (CE: the scalar mean).
//
// Output: one line per result, BENCH {"name": ..., "value": ms, "unit": "ms", "ms": ms}.
// Usage: bench_nn_pool [--reps N] [--warmup N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench_timing.h"
#include "flame/flame.h"
#include "flame/nn/pool.h"

namespace {
using flame::Device;
using flame::DType;
using flame::Tensor;
namespace F = flame::nn::functional;

int g_reps = 20, g_warmup = 3;

double median_ms(const std::function<void()>& fn) { return flame::bench::median_ms(g_reps, g_warmup, fn); }

void emit(const std::string& name, const std::function<void()>& fn) {
  try {
    const double ms = median_ms(fn);
    std::printf("BENCH {\"name\": \"%s\", \"value\": %.4g, \"unit\": \"ms\", \"ms\": %.4f}\n", name.c_str(), ms, ms);
  } catch (const std::exception& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '"', '\'');
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    std::printf("BENCH {\"name\": \"%s\", \"error\": \"%s\"}\n", name.c_str(), msg.c_str());
  }
  std::fflush(stdout);
}

void bench_cross_entropy(int64_t n, int64_t v) {
  const Device dev = Device::cuda();
  Tensor x = Tensor::randn({n, v}, {DType::bf16, dev}).requires_grad_();
  const Tensor t = Tensor::randint(0, v, {n}, {DType::i64, dev});
  const std::string shape = std::to_string(n) + "x" + std::to_string(v);
  emit("cross_entropy_bf16_fwd_" + shape, [&] {
    flame::NoGradGuard ng;
    (void)flame::cross_entropy(x, t);
  });
  emit("cross_entropy_bf16_fwdbwd_" + shape, [&] { (void)flame::cross_entropy(x, t).backward(); });
}

void bench_layer(const std::string& name, const std::function<Tensor(const Tensor&)>& f) {
  const Device dev = Device::cuda();
  Tensor x = Tensor::randn({32, 256, 64, 64}, {DType::bf16, dev}).requires_grad_();
  Tensor gout;
  {
    flame::NoGradGuard ng;
    gout = Tensor::randn(f(x).sizes(), {DType::bf16, dev});
  }
  emit(name + "_bf16_fwd", [&] {
    flame::NoGradGuard ng;
    (void)f(x);
  });
  emit(name + "_bf16_fwdbwd", [&] {
    flame::BackwardOptions o;
    o.grad_output = gout;
    (void)f(x).backward(o);
  });
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--reps") == 0) g_reps = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--warmup") == 0) g_warmup = std::atoi(argv[i + 1]);
  }
  if (!flame::cuda_is_available()) {
    std::printf("# bench_nn_pool: no CUDA device\n");
    return 0;
  }
  std::printf("# bench_nn_pool: FLAME pool family, median of %d calls after %d warm-up\n", g_reps, g_warmup);
  bench_cross_entropy(8192, 32000);
  bench_cross_entropy(4096, 128256);
  bench_layer("max_pool2d_3x3s2p1", [](const Tensor& x) { return F::max_pool2d(x, 3, 2, 1); });
  bench_layer("avg_pool2d_3x3s2p1", [](const Tensor& x) { return F::avg_pool2d(x, 3, 2, 1); });
  bench_layer("upsample_nearest_2x", [](const Tensor& x) { return F::interpolate(x, F::InterpolateOptions().with_scale(2)); });
  bench_layer("upsample_bilinear_2x", [](const Tensor& x) {
    return F::interpolate(x, F::InterpolateOptions().with_scale(2).with_mode("bilinear"));
  });
  return 0;
}
