// scaled_dot_product_attention benchmark (bf16, CUDA), twin of bench_nn_attention_torch.py: the
// same names, shapes and timing. Method (bench_ops.cpp): random inputs, warm-up calls first, then
// `reps` calls back to back on FLAME's current stream with a CUDA event between consecutive calls;
// the median per-call time in ms.
//   sdpa_bf16_s4096_d128_{fwd,fwdbwd}[_causal]: B8 H16 S4096 D128
//   sdpa_bf16_s256_d64_{fwd,fwdbwd}:           B32 H16 S256 D64
//   sdpa_qkv_packed_bf16_fwdbwd: B256 L196 H6 D64 (dit-s) from qkv [B, L, 3HD] through
//     attention_qkv_packed; sdpa_qkv_select_bf16_fwdbwd: the same through the reshape/permute/
//     select composite (the twin: unbind for packed, indexing for select), so the gain shows.
//   *_short: s256_d64, dit_s196_d64 and the packed pair again with FLAME's short-sequence kernels
//     (flame::cuda::set_short_attention) instead of cuDNN; the twin measures PyTorch again.
// fwdbwd = forward + backward with a fixed upstream gradient (q, k, v require grad).
// Usage: bench_nn_attention [--reps N] [--warmup N]; FLAME_BENCH_TRACE=1 also prints the kernels of
// the timed forward+backward calls of each shape (the twin prints PyTorch's with torch.profiler).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "flame/cuda.h"
#include "bench_timing.h"
#include "flame/flame.h"
#include "flame/nn/attention.h"

namespace {
using flame::Device;
using flame::DType;
using flame::Tensor;
namespace F = flame::nn::functional;

using flame::bench::median_ms;

void emit(const std::string& name, double ms) {
  std::printf("BENCH {\"name\": \"%s\", \"value\": %.4g, \"unit\": \"ms\", \"ms\": %.4f}\n", name.c_str(), ms, ms);
  std::fflush(stdout);
}

void bench_shape(const std::string& base, int64_t b, int64_t h, int64_t s, int64_t d, bool causal, int reps,
                 int warmup) {
  const Device dev = Device::cuda();
  flame::Generator g(1234);
  Tensor q = Tensor::randn({b, h, s, d}, 0.0, 1.0, {DType::bf16, dev}, &g);
  Tensor k = Tensor::randn({b, h, s, d}, 0.0, 1.0, {DType::bf16, dev}, &g);
  Tensor v = Tensor::randn({b, h, s, d}, 0.0, 1.0, {DType::bf16, dev}, &g);
  const Tensor gout = Tensor::randn({b, h, s, d}, 0.0, 1.0, {DType::bf16, dev}, &g);
  const std::string suffix = causal ? "_causal" : "";
  try {
    {
      flame::NoGradGuard no_grad;
      emit(base + "_fwd" + suffix,
           median_ms(reps, warmup, [&] { (void)F::scaled_dot_product_attention(q, k, v, {}, 0.0, causal); }));
      if (std::string(F::sdpa_last_path()) != "fused")
        std::printf("# %s: ran the %s path\n", base.c_str(), F::sdpa_last_path());
    }
    q.requires_grad_();
    k.requires_grad_();
    v.requires_grad_();
    flame::BackwardOptions opt;
    opt.grad_output = gout;
    // FLAME_BENCH_TRACE: the kernels of the timed calls themselves (warm-up included), to see
    // where the forward+backward time goes and whether the GPU idles between calls.
    const bool tracing = std::getenv("FLAME_BENCH_TRACE") != nullptr;
    flame::profiler::KernelTrace trace;
    if (tracing) trace.start();
    emit(base + "_fwdbwd" + suffix, median_ms(reps, warmup, [&] {
           (void)F::scaled_dot_product_attention(q, k, v, {}, 0.0, causal).backward(opt);
         }));
    if (tracing) {
      trace.stop();
      std::printf("# kernels of the %d timed %s forward+backward calls (and %d warm-up):\n%s", reps,
                  (base + suffix).c_str(), warmup, trace.summary(12, 100).c_str());
    }
  } catch (const std::exception& e) {
    std::printf("BENCH {\"name\": \"%s\", \"error\": \"see stderr\"}\n", (base + suffix).c_str());
    std::fprintf(stderr, "bench_nn_attention: %s: %s\n", base.c_str(), e.what());
  }
}

// fwd + bwd of attention over a packed qkv [B, L, 3HD] (requires grad) to [B, L, HD].
void bench_packed(int64_t b, int64_t l, int64_t h, int64_t d, int reps, int warmup, const std::string& suffix) {
  const Device dev = Device::cuda();
  flame::Generator g(1234);
  Tensor qkv = Tensor::randn({b, l, 3 * h * d}, 0.0, 1.0, {DType::bf16, dev}, &g).requires_grad_();
  const Tensor gout = Tensor::randn({b, l, h * d}, 0.0, 1.0, {DType::bf16, dev}, &g);
  flame::BackwardOptions opt;
  opt.grad_output = gout;
  auto select_composite = [&] {
    const Tensor p = qkv.reshape({b, l, 3, h, d}).permute({2, 0, 3, 1, 4});
    const Tensor o = F::scaled_dot_product_attention(p.select(0, 0), p.select(0, 1), p.select(0, 2));
    return o.transpose(1, 2).reshape({b, l, h * d});
  };
  const std::pair<std::string, std::function<Tensor()>> cases[] = {
      {"sdpa_qkv_packed" + suffix + "_bf16_fwdbwd", [&] { return F::attention_qkv_packed(qkv, h); }},
      {"sdpa_qkv_select" + suffix + "_bf16_fwdbwd", select_composite}};
  for (const auto& [label, fn] : cases) {
    const char* name = label.c_str();
    try {
      emit(name, median_ms(reps, warmup, [&] { (void)fn().backward(opt); }));
      const std::string want = std::string(name).find("packed") != std::string::npos ? "fused_packed" : "fused";
      if (std::string(F::sdpa_last_path()) != want) std::printf("# %s: ran the %s path\n", name, F::sdpa_last_path());
    } catch (const std::exception& e) {
      std::printf("BENCH {\"name\": \"%s\", \"error\": \"see stderr\"}\n", name);
      std::fprintf(stderr, "bench_nn_attention: %s: %s\n", name, e.what());
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20, warmup = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--warmup" && i + 1 < argc) warmup = std::max(0, std::atoi(argv[++i]));
  }
  if (!flame::cuda_is_available()) {
    std::printf("# bench_nn_attention: no CUDA device\n");
    return 0;
  }
  bench_shape("sdpa_bf16_s4096_d128", 8, 16, 4096, 128, false, reps, warmup);
  bench_shape("sdpa_bf16_s4096_d128", 8, 16, 4096, 128, true, reps, warmup);
  bench_shape("sdpa_bf16_s256_d64", 32, 16, 256, 64, false, reps, warmup);
  // dit-s at B256: 6 heads of 64 over 196 tokens (an odd length, not a multiple of the tile).
  bench_shape("sdpa_bf16_dit_s196_d64", 256, 6, 196, 64, false, reps, warmup);
  bench_packed(256, 196, 6, 64, reps, warmup, "");
  // The same short problems on FLAME's short-sequence kernels (flame::cuda::set_short_attention).
  flame::cuda::set_short_attention(true);
  bench_shape("sdpa_bf16_s256_d64_short", 32, 16, 256, 64, false, reps, warmup);
  bench_shape("sdpa_bf16_dit_s196_d64_short", 256, 6, 196, 64, false, reps, warmup);
  bench_packed(256, 196, 6, 64, reps, warmup, "_short");
  const flame::cuda::ShortAttentionStats st = flame::cuda::short_attention_stats();
  if (st.forward_calls == 0 || st.backward_calls == 0) std::printf("# the short-sequence kernels did not run\n");
  return 0;
}
