// Linear epilogue benchmarks (FLAME side; bench/bench_epi_torch.py is the PyTorch twin, same
// names, shapes, dtypes and timing): F::linear with bias, F::linear_gelu and the DiT MLP, bf16,
// forward (no grad) and forward+backward (gradients of x, weights and biases), on the DiT-S
// shapes (M = 256*196 = 50176 tokens, 384 -> 1536 and 1536 -> 384) and a square 8192 x 4096 x 4096;
// then single pieces of the DiT-S step (piece_*: fc1 forward with GELU_AUX, the MLP's DGELU data
// gradient, the weight + bias gradients of fc1 and qkv) with FLAME-only variants of the epilogue
// autotuning (_heuristic, _bgradb, _colsum; docs/epi.md).
//
// Method (bench/bench_timing.h): random inputs; warm-up calls; `reps` calls back to back on
// FLAME's stream with a CUDA event between consecutive calls; the median per-call time. TFLOP/s
// counts the GEMMs only: 2MNK forward, 6MNK forward+backward (per layer). FLAME-only lines
// (`*_unfused`, `*_mlp_gelu`) time the same math without the fused op, or with mlp_gelu, so the
// epilogues' own gain is visible in one run.
//
// Usage: bench_epi [--reps N] [--warmup N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "bench_timing.h"
#include "flame/cuda.h"
#include "flame/flame.h"
#include "flame/nn.h"
#include "flame/nn/linear_gelu.h"

namespace {

using flame::BackwardOptions;
using flame::Device;
using flame::DType;
using flame::Tensor;
namespace F = flame::nn::functional;

using flame::bench::median_ms;

void emit(const std::string& name, double flops, double ms) {
  std::printf("BENCH {\"name\": \"%s\", \"value\": %.4g, \"unit\": \"TFLOP/s\", \"ms\": %.4f}\n", name.c_str(),
              flops / (ms * 1e-3) / 1e12, ms);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const flame::bench::RepsArgs args = flame::bench::parse_reps(argc, argv);
  const int reps = args.reps, warmup = args.warmup;
  if (!flame::cuda_is_available()) {
    std::printf("# bench_epi: no CUDA device; nothing to measure\n");
    return 0;
  }
  const Device gpu = Device::cuda(0);
  auto stream = static_cast<cudaStream_t>(flame::cuda::current_stream(0));
  std::printf("# bench_epi: reps %d, warm-up %d, bf16\n", reps, warmup);
  const flame::TensorOptions bf16{DType::bf16, gpu};

  // One layer: x [M, K], w [N, K], b [N].
  using LayerOp = std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>;
  auto layer = [&](const std::string& name, int64_t M, int64_t K, int64_t N, const LayerOp& op) {
    try {
      const Tensor x0 = Tensor::randn({M, K}, 0.0, 1.0, bf16);
      const Tensor w = (Tensor::randn({N, K}, 0.0, 1.0, bf16) * (1.0 / std::sqrt(double(K)))).requires_grad_();
      const Tensor b = Tensor::randn({N}, 0.0, 0.1, bf16).requires_grad_();
      const Tensor dy = Tensor::randn({M, N}, 0.0, 1.0, bf16);
      const double flops = 2.0 * double(M) * double(N) * double(K);
      {
        flame::NoGradGuard no_grad;
        emit(name + "_fwd", flops, median_ms(stream, reps, warmup, [&] { (void)op(x0, w, b); }));
      }
      const Tensor x = x0.detach().requires_grad_();
      BackwardOptions o;
      o.grad_output = dy;
      emit(name + "_fwdbwd", 3 * flops, median_ms(stream, reps, warmup, [&] { (void)op(x, w, b).backward(o); }));
    } catch (const std::exception& e) {
      std::printf("BENCH {\"name\": \"%s_fwd\", \"error\": \"failed\"}\n# %s\n", name.c_str(), e.what());
    }
  };
  struct Shape3 {
    const char* tag;
    int64_t M, K, N;
  };
  for (const Shape3& s : {Shape3{"dit_fc1", 50176, 384, 1536}, Shape3{"dit_fc2", 50176, 1536, 384},
                          Shape3{"sq4096", 8192, 4096, 4096}}) {
    const std::string t = s.tag;
    layer("linear_bias_" + t, s.M, s.K, s.N,
          [](const Tensor& x, const Tensor& w, const Tensor& b) { return F::linear(x, w, b); });
    layer("linear_bias_" + t + "_unfused", s.M, s.K, s.N,
          [](const Tensor& x, const Tensor& w, const Tensor& b) { return F::linear(x, w) + b; });
    layer("linear_gelu_" + t, s.M, s.K, s.N,
          [](const Tensor& x, const Tensor& w, const Tensor& b) { return F::linear_gelu(x, w, b); });
    layer("linear_gelu_" + t + "_unfused", s.M, s.K, s.N,
          [](const Tensor& x, const Tensor& w, const Tensor& b) { return (F::linear(x, w) + b).gelu(true); });
  }

  // The DiT-S MLP: fc2(gelu(fc1(x))), 384 -> 1536 -> 384 on 50176 tokens.
  auto mlp = [&](const std::string& name, int use) {
    try {
      const int64_t M = 50176, D = 384, H = 1536;
      const Tensor x0 = Tensor::randn({M, D}, 0.0, 1.0, bf16);
      const Tensor w1 = (Tensor::randn({H, D}, 0.0, 1.0, bf16) * (1.0 / std::sqrt(double(D)))).requires_grad_();
      const Tensor b1 = Tensor::randn({H}, 0.0, 0.1, bf16).requires_grad_();
      const Tensor w2 = (Tensor::randn({D, H}, 0.0, 1.0, bf16) * (1.0 / std::sqrt(double(H)))).requires_grad_();
      const Tensor b2 = Tensor::randn({D}, 0.0, 0.1, bf16).requires_grad_();
      const Tensor dy = Tensor::randn({M, D}, 0.0, 1.0, bf16);
      auto op = [&](const Tensor& x) {
        if (use == 0) return F::linear(F::linear_gelu(x, w1, b1), w2, b2);
        if (use == 1) return F::mlp_gelu(x, w1, b1, w2, b2);
        return F::linear(F::linear(x, w1, b1).gelu(true), w2, b2);
      };
      const double flops = 2.0 * 2.0 * double(M) * double(D) * double(H);
      {
        flame::NoGradGuard no_grad;
        emit(name + "_fwd", flops, median_ms(stream, reps, warmup, [&] { (void)op(x0); }));
      }
      const Tensor x = x0.detach().requires_grad_();
      BackwardOptions o;
      o.grad_output = dy;
      emit(name + "_fwdbwd", 3 * flops, median_ms(stream, reps, warmup, [&] { (void)op(x).backward(o); }));
    } catch (const std::exception& e) {
      std::printf("BENCH {\"name\": \"%s_fwd\", \"error\": \"failed\"}\n# %s\n", name.c_str(), e.what());
    }
  };
  mlp("dit_mlp", 0);
  mlp("dit_mlp_mlp_gelu", 1);
  mlp("dit_mlp_unfused", 2);

  // ---- pieces of the DiT-S MLP / attention step, one epilogue GEMM each (Note [Epilogue
  // autotuning] in src/backend/cuda/epi/linear_epilogue.cu). The unsuffixed line runs the default
  // (autotuned, bias gradient by whichever kind times faster) and has a PyTorch twin; FLAME-only
  // suffixes: _heuristic (autotuning off: cuBLASLt's first algorithm, BGRADB), _bgradb and
  // _colsum (tuned, the bias-gradient kind forced). Backward pieces run backward() alone on a
  // retained graph.
  struct Variant {
    const char* suffix;
    bool autotune;
    flame::cuda::EpilogueBiasGrad bias_grad;
  };
  using BG = flame::cuda::EpilogueBiasGrad;
  const std::vector<Variant> fwd_variants{{"", true, BG::automatic}, {"_heuristic", false, BG::automatic}};
  const std::vector<Variant> bgrad_variants{{"", true, BG::automatic},
                                            {"_heuristic", false, BG::automatic},
                                            {"_bgradb", true, BG::epilogue},
                                            {"_colsum", true, BG::column_sum}};
  const bool autotune0 = flame::cuda::epilogue_autotune();
  const BG bias_grad0 = flame::cuda::epilogue_bias_grad();
  auto with_variant = [&](const Variant& v, const std::function<void()>& fn) {
    flame::cuda::set_epilogue_autotune(v.autotune);
    flame::cuda::set_epilogue_bias_grad(v.bias_grad);
    try {
      fn();
    } catch (...) {
      flame::cuda::set_epilogue_autotune(autotune0);
      flame::cuda::set_epilogue_bias_grad(bias_grad0);
      throw;
    }
    flame::cuda::set_epilogue_autotune(autotune0);
    flame::cuda::set_epilogue_bias_grad(bias_grad0);
  };
  const int64_t M = 50176, D = 384, H = 1536;
  // fc1 forward with the pre-activation saved for the backward (GELU_AUX_BIAS): x [M, D] ->
  // [M, H], weights requiring gradients (so the op records and saves pre), forward only.
  try {
    const Tensor x = Tensor::randn({M, D}, 0.0, 1.0, bf16);
    const Tensor w = (Tensor::randn({H, D}, 0.0, 1.0, bf16) * (1.0 / std::sqrt(double(D)))).requires_grad_();
    const Tensor b = Tensor::randn({H}, 0.0, 0.1, bf16).requires_grad_();
    const double flops = 2.0 * double(M) * double(D) * double(H);
    for (const Variant& v : fwd_variants)
      with_variant(v, [&] {
        emit(std::string("piece_fc1_gelu_aux_fwd") + v.suffix, flops,
             median_ms(stream, reps, warmup, [&] { (void)F::linear_gelu(x, w, b); }));
      });
  } catch (const std::exception& e) {
    std::printf("BENCH {\"name\": \"piece_fc1_gelu_aux_fwd\", \"error\": \"failed\"}\n# %s\n", e.what());
  }
  // The MLP's data gradient: dh = (dy W2) * gelu'(pre) (the DGELU GEMM), then dx = dh W1 (a plain
  // GEMM): mlp_gelu with only x requiring a gradient, backward only. matmul_dx_plain times the
  // second GEMM alone, so the DGELU GEMM's share is the difference.
  try {
    const Tensor x = Tensor::randn({M, D}, 0.0, 1.0, bf16).requires_grad_();
    const Tensor w1 = Tensor::randn({H, D}, 0.0, 1.0, bf16) * (1.0 / std::sqrt(double(D)));
    const Tensor b1 = Tensor::randn({H}, 0.0, 0.1, bf16);
    const Tensor w2 = Tensor::randn({D, H}, 0.0, 1.0, bf16) * (1.0 / std::sqrt(double(H)));
    const Tensor b2 = Tensor::randn({D}, 0.0, 0.1, bf16);
    const Tensor dy = Tensor::randn({M, D}, 0.0, 1.0, bf16);
    const double flops = 2.0 * 2.0 * double(M) * double(D) * double(H);
    for (const Variant& v : fwd_variants)
      with_variant(v, [&] {
        const Tensor y = F::mlp_gelu(x, w1, b1, w2, b2);
        BackwardOptions o;
        o.grad_output = dy;
        o.retain_graph = true;
        emit(std::string("piece_mlp_dgelu_dx_bwd") + v.suffix, flops,
             median_ms(stream, reps, warmup, [&] { (void)y.backward(o); }));
      });
    const Tensor dh = Tensor::randn({M, H}, 0.0, 1.0, bf16);
    emit("piece_matmul_dx_plain", flops / 2, median_ms(stream, reps, warmup, [&] { (void)dh.matmul(w1); }));
  } catch (const std::exception& e) {
    std::printf("BENCH {\"name\": \"piece_mlp_dgelu_dx_bwd\", \"error\": \"failed\"}\n# %s\n", e.what());
  }
  // Weight and bias gradients of fc1 (dy [M, 1536]) and qkv (dy [M, 1152]), input [M, 384]: linear
  // with only the weight and bias requiring gradients, backward only (the BGRADB GEMM, or the plain
  // GEMM + column sum).
  for (const auto& [tag, N] : {std::pair<const char*, int64_t>{"fc1", H}, std::pair<const char*, int64_t>{"qkv", 1152}}) {
    const std::string name = std::string("piece_") + tag + "_wgrad_bgrad";
    try {
      const Tensor x = Tensor::randn({M, D}, 0.0, 1.0, bf16);
      const Tensor w = (Tensor::randn({N, D}, 0.0, 1.0, bf16) * (1.0 / std::sqrt(double(D)))).requires_grad_();
      const Tensor b = Tensor::randn({N}, 0.0, 0.1, bf16).requires_grad_();
      const Tensor dy = Tensor::randn({M, N}, 0.0, 1.0, bf16);
      const double flops = 2.0 * double(M) * double(D) * double(N);
      for (const Variant& v : bgrad_variants)
        with_variant(v, [&] {
          const Tensor y = F::linear(x, w, b);
          BackwardOptions o;
          o.grad_output = dy;
          o.retain_graph = true;
          emit(name + v.suffix, flops, median_ms(stream, reps, warmup, [&] { (void)y.backward(o); }));
        });
      // FLAME's generic sum(0) of the same gradient (bytes read per second), for scale.
      const double ms = median_ms(stream, reps, warmup, [&] { (void)dy.sum({0}); });
      std::printf("BENCH {\"name\": \"%s_sum0_only\", \"value\": %.4g, \"unit\": \"GB/s\", \"ms\": %.4f}\n",
                  name.c_str(), double(M) * double(N) * 2.0 / (ms * 1e-3) / 1e9, ms);
    } catch (const std::exception& e) {
      std::printf("BENCH {\"name\": \"%s\", \"error\": \"failed\"}\n# %s\n", name.c_str(), e.what());
    }
  }
  return 0;
}
