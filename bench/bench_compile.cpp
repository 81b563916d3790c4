// flame::compile benchmarks (FLAME side; bench/bench_compile_torch.py is the PyTorch twin with the
// same names, shapes, dtypes and timing, for PyTorch eager and torch.compile).
//
// The elementwise chains of the DiT, bf16, tokens N = 256 * 196, width D = 384:
//   modulate        x * (1 + scale) + shift   x [256, 196, 384], scale/shift [256, 1, 384]
//   gated_residual  x + gate * y              x, y [256, 196, 384], gate [256, 1, 384]
//   bias_gelu_tanh  gelu_tanh(x + b)          x [50176, 384], b [384]
//   silu_mul        silu(a) * b               a, b [50176, 384]
// each forward ("fwd") and forward + backward ("fwdbwd", all inputs require grad, a given output
// gradient). Variants: FLAME eager ("eager") and flame::compile ("compiled"); the twin prints
// "torch_eager" and "torch_compile". GB/s counts the bytes the chain must move at the least:
// forward reads every input once and writes the output; backward reads the inputs and the output
// gradient again and writes every input's gradient. Method: bench/bench_timing.h (CUDA events
// between back-to-back calls, warm-up excluded (it includes the trace and the NVRTC compile),
// median). "ratio" lines: compiled time over eager time.
//
// Usage: bench_compile [--reps N] [--warmup N]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench_timing.h"
#include "flame/compile.h"
#include "flame/flame.h"

namespace {

using flame::Device;
using flame::DType;
using flame::Shape;
using flame::Tensor;
using flame::TensorList;
using flame::bench::median_ms;

void emit(const std::string& name, double gbps, double ms) { flame::bench::emit_rate(name, gbps, "GB/s", ms); }

struct Case {
  std::string name;
  std::vector<Shape> shapes;
  Shape out;
  std::function<TensorList(const TensorList&)> fn;
};

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  const flame::bench::RepsArgs args = flame::bench::parse_reps(argc, argv);
  const int reps = args.reps, warmup = args.warmup;
  if (!flame::cuda_is_available()) {
    std::printf("# bench_compile: no CUDA device; nothing to measure\n");
    return 0;
  }
  const Device gpu = Device::cuda(0);
  std::printf("# bench_compile: reps %d, warm-up %d, bf16\n", reps, warmup);
  const int64_t B = 256, T = 196, D = 384, N = B * T;
  const std::vector<Case> cases = {
      {"modulate", {{B, T, D}, {B, 1, D}, {B, 1, D}}, {B, T, D},
       [](const TensorList& in) -> TensorList { return {in[0] * in[1].add_scalar(1.0) + in[2]}; }},
      {"gated_residual", {{B, T, D}, {B, 1, D}, {B, T, D}}, {B, T, D},
       [](const TensorList& in) -> TensorList { return {in[0] + in[1] * in[2]}; }},
      {"bias_gelu_tanh", {{N, D}, {D}}, {N, D},
       [](const TensorList& in) -> TensorList { return {flame::gelu(in[0] + in[1], true)}; }},
      {"silu_mul", {{N, D}, {N, D}}, {N, D},
       [](const TensorList& in) -> TensorList { return {in[0].silu() * in[1]}; }},
  };
  for (const Case& c : cases) {
    TensorList in;
    int64_t in_bytes = 0;
    for (const Shape& s : c.shapes) {
      in.push_back(Tensor::randn(s, flame::TensorOptions(DType::bf16, gpu)));
      in_bytes += numel(s) * 2;
    }
    const int64_t out_bytes = numel(c.out) * 2;
    const Tensor dy = Tensor::randn(c.out, flame::TensorOptions(DType::bf16, gpu));
    const double fwd_bytes = static_cast<double>(in_bytes + out_bytes);
    const double bwd_bytes = fwd_bytes + static_cast<double>(in_bytes + out_bytes + in_bytes);
    flame::CompileOptions opt;
    opt.name = c.name;
    flame::CompiledFunction compiled = flame::compile(c.fn, opt);
    TensorList grad_in = in;
    for (Tensor& t : grad_in) {
      t = t.detach();
      t.requires_grad_(true);
    }
    double ms_eager[2] = {0, 0}, ms_comp[2] = {0, 0};
    for (int mode = 0; mode < 2; ++mode) {  // 0: forward, 1: forward + backward
      const char* m = mode == 0 ? "fwd" : "fwdbwd";
      const double bytes = mode == 0 ? fwd_bytes : bwd_bytes;
      for (int variant = 0; variant < 2; ++variant) {
        auto run = [&] {
          if (mode == 0) {
            flame::NoGradGuard ng;
            if (variant == 0) c.fn(in);
            else compiled(in);
          } else {
            const Tensor y = variant == 0 ? c.fn(grad_in)[0] : compiled(grad_in)[0];
            flame::BackwardOptions bo;
            bo.grad_output = dy;
            const flame::Gradients g = y.backward(bo);
            (void)g;
          }
        };
        const double ms = median_ms(reps, warmup + 2, run);
        (variant == 0 ? ms_eager : ms_comp)[mode] = ms;
        emit("compile_" + c.name + "_" + m + "_" + (variant == 0 ? "eager" : "compiled"), bytes / (ms * 1e-3) / 1e9,
             ms);
      }
      if (!compiled.fallback_reason().empty()) {
        std::printf("# %s: compiled fell back: %s\n", c.name.c_str(), compiled.fallback_reason().c_str());
      }
      std::printf("# ratio %s_%s compiled/eager time %.3f (fused kernels %lld)\n", c.name.c_str(), m,
                  ms_comp[mode] / ms_eager[mode], static_cast<long long>(compiled.stats().fused_kernels));
    }
  }
  return 0;
}
