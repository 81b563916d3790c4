// Convolution benchmarks of FLAME's CUDA backend (cuDNN through cudnn-frontend). Its PyTorch twin
// is bench/bench_nn_conv_torch.py: same shapes, dtypes, layouts and timing; scripts/gpu_run.sh
// runs both and joins the lines by name.
//
// Cases: a 3x3 conv, pad 1, bf16, N=32, 256 -> 256 channels, 64x64, no bias.
//   conv3x3_bf16_fwd        forward only (no graph recorded), NCHW
//   conv3x3_bf16_fwdbwd     forward + backward (input and weight gradients), NCHW
//   conv3x3_bf16_cl_fwd     the same two in channels-last
//   conv3x3_bf16_cl_fwdbwd
//   conv3x3_bf16_cl_fwdbwd_contig_grads  the same FLAME run; the twin also makes its returned
//                           gradients contiguous, which FLAME's gradient store does for every
//                           leaf (backward.cpp), so the line isolates the conv kernels' share
// Method (as bench_ops): random inputs; warm-up calls (plans, handles and pool blocks stay out of
// the numbers); then `reps` calls queued back to back with a CUDA event between consecutive calls
// on FLAME's stream; the median per-call time in ms.
//
// Usage: bench_nn_conv [--reps N] [--warmup N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench_timing.h"
#include "flame/flame.h"
#include "flame/nn/conv.h"

namespace {

using flame::Device;
using flame::DType;
using flame::Tensor;
namespace F = flame::nn::functional;

struct Options {
  int reps = 20;
  int warmup = 3;
};

double median_ms(cudaStream_t stream, const Options& opt, const std::function<void()>& fn) {
  return flame::bench::median_ms(stream, opt.reps, opt.warmup, fn);
}

void print_result(const std::string& name, double ms) {
  std::printf("BENCH {\"name\": \"%s\", \"value\": %.4g, \"unit\": \"ms\", \"ms\": %.4f}\n", name.c_str(), ms, ms);
  std::fflush(stdout);
}

void print_error(const std::string& name, const std::string& what) {
  std::string s;
  for (char c : what) {
    if (c == '"' || c == '\\') s += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) s += c;
  }
  std::printf("BENCH {\"name\": \"%s\", \"error\": \"%s\"}\n", name.c_str(), s.c_str());
  std::fflush(stdout);
}

void run_case(const std::string& name, const Options& opt, const std::function<void()>& fn) {
  try {
    const auto stream = static_cast<cudaStream_t>(flame::cuda::current_stream(0));
    print_result(name, median_ms(stream, opt, fn));
  } catch (const std::exception& e) {
    print_error(name, e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--reps" || a == "--warmup") && i + 1 < argc) {
      (a == "--reps" ? opt.reps : opt.warmup) = std::max(a == "--reps" ? 1 : 0, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: bench_nn_conv [--reps N] [--warmup N]\n");
      return 2;
    }
  }
  if (!flame::cuda_is_available()) {
    std::printf("# bench_nn_conv: no CUDA device\n");
    return 0;
  }
  const Device gpu = Device::cuda(0);
  constexpr int64_t kN = 32, kC = 256, kHW = 64;
  std::printf("# conv3x3 bf16 N%lld C%lld->%lld %lldx%lld pad 1, median of %d calls\n", static_cast<long long>(kN),
              static_cast<long long>(kC), static_cast<long long>(kC), static_cast<long long>(kHW),
              static_cast<long long>(kHW), opt.reps);
  for (bool cl : {false, true}) {
    Tensor x = Tensor::randn({kN, kC, kHW, kHW}, 0.0, 1.0, {DType::bf16, gpu});
    Tensor w = Tensor::randn({kC, kC, 3, 3}, 0.0, 0.02, {DType::bf16, gpu});
    Tensor gy = Tensor::randn({kN, kC, kHW, kHW}, 0.0, 1.0, {DType::bf16, gpu});
    if (cl) {
      x = F::to_channels_last(x);
      w = F::to_channels_last(w);
      gy = F::to_channels_last(gy);
    }
    const std::string prefix = cl ? "conv3x3_bf16_cl_" : "conv3x3_bf16_";
    run_case(prefix + "fwd", opt, [&] {
      flame::NoGradGuard no_grad;
      Tensor y = F::conv2d(x, w, {}, {1}, {1});
    });
    x.requires_grad_(true);
    w.requires_grad_(true);
    const auto fwdbwd = [&] {
      Tensor y = F::conv2d(x, w, {}, {1}, {1});
      flame::BackwardOptions o;
      o.grad_output = gy;
      flame::Gradients g = y.backward(o);
    };
    run_case(prefix + "fwdbwd", opt, fwdbwd);
    if (cl) run_case(prefix + "fwdbwd_contig_grads", opt, fwdbwd);
  }
  return 0;
}
