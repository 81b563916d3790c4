// Gradient accumulation fused into the adaLN backward (Note [Accumulate base] in
// src/autograd/backward.cpp); bench/bench_accum_torch.py is the PyTorch twin (same names, shapes,
// dtypes and timing).
//
// The DiT block's residual pattern at dit-s B256 under bf16 autocast: x f32 [256, 196, 384] (as
// x = x0 * 1.25, a non-leaf vertex), the modulation a bf16 [256, 3 * 384] tensor in chunks,
//   h = gated_residual(x, gate, layer_norm_modulate(x, shift, scale)).
// x feeds both ops, so its gradient is a sum of two. Timed: the backward alone on a retained graph
// (median of `reps` back-to-back calls, CUDA events between them). accum_dit_residual_bwd is the
// default (the adaLN kernel adds the pending sum); accum_dit_residual_bwd_unfused turns the fusion
// off (the engine's separate add; FLAME only, the twin has no such switch). GB/s counts the bytes
// the backward must move per element, a floor shared by both sides: the gated residual reads dh
// (f32) and y (bf16) and writes dy (bf16), 8; the adaLN backward reads dy, x (f32) and the pending
// sum dh (f32) and writes dx (f32), 14; x0's gradient reads and writes f32, 8: 30 bytes.
//
// Usage: bench_accum [--reps N] [--warmup N]
#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "bench_timing.h"
#include "flame/amp.h"
#include "flame/flame.h"
#include "flame/nn.h"

// The engine's switch (declared in src/autograd/record.h; libflame exports it).
namespace flame::autograd_detail {
bool set_accumulate_base_enabled(bool on);
}

namespace {

using flame::BackwardOptions;
using flame::Device;
using flame::DType;
using flame::Tensor;
namespace F = flame::nn::functional;

void emit(const std::string& name, double gbps, double ms) { flame::bench::emit_rate(name, gbps, "GB/s", ms); }

}  // namespace

int main(int argc, char** argv) {
  const flame::bench::RepsArgs args = flame::bench::parse_reps(argc, argv);
  if (!flame::cuda_is_available()) {
    std::printf("# bench_accum: no CUDA device; nothing to measure\n");
    return 0;
  }
  const Device gpu = Device::cuda(0);
  auto stream = static_cast<cudaStream_t>(flame::cuda::current_stream(0));
  std::printf("# bench_accum: reps %d, warm-up %d\n", args.reps, args.warmup);
  const int64_t b = 256, t = 196, d = 384;
  const Tensor x0 = Tensor::randn({b, t, d}, 0.5, 2.0, gpu).requires_grad_();
  const Tensor m = (Tensor::randn({b, 3 * d}, 0.0, 0.5, gpu)).to(DType::bf16).requires_grad_();
  const Tensor dh = Tensor::randn({b, t, d}, 0.0, 1.0, gpu);
  Tensor h;
  {
    flame::amp::AutocastGuard autocast(DType::bf16);
    const Tensor x = x0 * 1.25;
    const Tensor y = F::layer_norm_modulate(x, m.narrow(1, 0, d), m.narrow(1, d, d), 1e-6);
    h = F::gated_residual(x, m.narrow(1, 2 * d, d), y);
  }
  BackwardOptions o;
  o.grad_output = dh;
  o.retain_graph = true;
  const double bytes = 30.0 * static_cast<double>(b * t * d);
  for (bool fused : {true, false}) {
    const bool prev = flame::autograd_detail::set_accumulate_base_enabled(fused);
    const double ms = flame::bench::median_ms(stream, args.reps, args.warmup, [&] { (void)h.backward(o); });
    flame::autograd_detail::set_accumulate_base_enabled(prev);
    emit(fused ? "accum_dit_residual_bwd" : "accum_dit_residual_bwd_unfused", bytes / (ms * 1e-3) / 1e9, ms);
  }
  return 0;
}
