// Op benchmarks of FLAME's CUDA backend. bench/bench_torch.py measures the same things with
// PyTorch, and bench/compare.py joins the two (scripts/gpu_run.sh runs all three).
//
// Method (the device tool's METHOD.md): random inputs, never zeros; warm-up calls first (pool
// allocations, cuBLAS handles and plans stay out of the numbers); then `reps` calls queued back to
// back on FLAME's stream with a CUDA event between consecutive calls, and the median of the
// per-call event times. Memory-bound ops report GB/s counting bytes read plus bytes written, and
// that rate as a percentage of a plain device-to-device cudaMemcpyAsync (the bandwidth reference,
// measured the same way). The GEMM reports TFLOP/s (2*M*N*K flops). Host overhead
// (add_small_host) is host time per call of a small op, the median over 50 bursts of 200 calls
// with no sync inside a burst (short enough that the launch queue never fills); add_small_gpu is
// the time per call over --small-calls calls until the GPU has run them all.
//
// Output: '#' comment lines, then one JSON object per result on a line starting with "BENCH ":
//   BENCH {"name": "add", "value": 2764.1, "unit": "GB/s", "ms": 0.291, "pct_d2d": 93.4}
// A failing op prints {"name": ..., "error": "..."} and the run goes on.
//
// Usage: bench_ops [--reps N] [--warmup N] [--small-calls N] [--only name1,name2]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "bench_timing.h"
#include "flame/flame.h"
#include "flame/nn/adaln.h"
#include "flame/nn/norm.h"

namespace {

using flame::Device;
using flame::DType;
using flame::Tensor;

constexpr int64_t kBytes = 256LL << 20;            // each big tensor: 256 MiB
constexpr int kSmallBurst = 200;                   // small-op calls per timed burst
constexpr int kSmallBursts = 50;
constexpr int64_t kElems = kBytes / 4;             // f32 elements
constexpr int64_t kSquare = 8192;                  // [8192, 8192] f32 = 256 MiB
constexpr int64_t kSoftmaxCols = 4096;             // [16384, 4096] f32 = 256 MiB
constexpr int64_t kSoftmaxRows = kElems / kSoftmaxCols;
constexpr int64_t kGemm = 8192;                    // bf16 8192^3
constexpr int64_t kSmall = 1024;                   // host-overhead op size
constexpr int64_t kModRows = 1024, kModTokens = 196, kModHidden = 384;  // norm_modulate: 147 MiB bf16
// The DiT-S B256 MLP GEMMs (tokens x hidden x 4 hidden): fc1 [50176, 384] x [1536, 384]^T and fc2.
constexpr int64_t kDitTokens = 50176, kDitHidden = 384, kDitMlp = 1536;

struct Options {
  int reps = 20;
  int warmup = 3;
  int small_calls = 10000;
  std::vector<std::string> only;
  bool wants(const std::string& name) const {
    return only.empty() || std::find(only.begin(), only.end(), name) != only.end();
  }
};

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (c == '\n') {
      o += "\\n";
    } else if (static_cast<unsigned char>(c) >= 0x20) {
      o += c;
    }
  }
  return o;
}

void print_result(const std::string& name, double value, const char* unit, double ms, double pct_d2d) {
  std::printf("BENCH {\"name\": \"%s\", \"value\": %.4g, \"unit\": \"%s\", \"ms\": %.4f", name.c_str(), value, unit, ms);
  if (pct_d2d >= 0) std::printf(", \"pct_d2d\": %.1f", pct_d2d);
  std::printf("}\n");
  std::fflush(stdout);
}

void print_error(const std::string& name, const std::string& what) {
  std::printf("BENCH {\"name\": \"%s\", \"error\": \"%s\"}\n", name.c_str(), json_escape(what).c_str());
  std::fflush(stdout);
}

// Median milliseconds per call of `fn` on `stream` (see the method above; bench_timing.h).
double median_ms(cudaStream_t stream, const Options& opt, const std::function<void()>& fn) {
  return flame::bench::median_ms(stream, opt.reps, opt.warmup, fn);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_ops: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--reps") {
      o.reps = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--warmup") {
      o.warmup = std::max(0, std::atoi(next().c_str()));
    } else if (a == "--small-calls") {
      o.small_calls = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--only") {
      std::stringstream ss(next());
      for (std::string s; std::getline(ss, s, ',');) o.only.push_back(s);
    } else {
      std::fprintf(stderr, "usage: bench_ops [--reps N] [--warmup N] [--small-calls N] [--only a,b]\n");
      std::exit(2);
    }
  }
  return o;
}


// Note [Chain benchmark]
// Host cost of autograd, forward and backward: a chain of kChainOps small ops (kChainOps / 2 steps
// of y = y * c + d on 1024-element tensors). Reported per op (one launched kernel each), medians of
// kChainRounds rounds:
//   chain_fwd_nograd  forward under NoGradGuard, host time to queue the ops;
//   chain_fwd_record  forward with c and d requiring grad (every op records a node);
//   chain_bwd         (forward + backward + sync) minus (forward + sync), per forward op.
constexpr int kChainOps = 1000;
constexpr int kChainRounds = 15;

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double us_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

void bench_chain(Device gpu) {
  const Tensor x = Tensor::rand({kSmall}, gpu);
  Tensor c = Tensor::uniform({kSmall}, 0.9, 1.1, gpu), d = Tensor::uniform({kSmall}, -0.1, 0.1, gpu);
  auto forward = [&] {
    Tensor y = x;
    for (int i = 0; i < kChainOps / 2; ++i) y = y * c + d;
    return y;
  };
  std::vector<double> nograd, record, fwd_sync, fwd_bwd_sync;
  for (int r = 0; r < kChainRounds + 2; ++r) {
    const bool keep = r >= 2;  // two warm-up rounds
    {
      flame::NoGradGuard no_grad;
      flame::cuda::synchronize(0);
      const auto t0 = std::chrono::steady_clock::now();
      Tensor y = forward();
      const double us = us_since(t0);
      flame::cuda::synchronize(0);
      if (keep) nograd.push_back(us);
    }
    c.requires_grad_(true);
    d.requires_grad_(true);
    {
      flame::cuda::synchronize(0);
      const auto t0 = std::chrono::steady_clock::now();
      Tensor y = forward();
      const double us = us_since(t0);
      flame::cuda::synchronize(0);
      const double us_sync = us_since(t0);
      if (keep) {
        record.push_back(us);
        fwd_sync.push_back(us_sync);
      }
    }
    {
      flame::cuda::synchronize(0);
      const auto t0 = std::chrono::steady_clock::now();
      Tensor loss = forward().sum();
      flame::Gradients g = loss.backward();
      flame::cuda::synchronize(0);
      if (keep) fwd_bwd_sync.push_back(us_since(t0));
    }
    c.requires_grad_(false);
    d.requires_grad_(false);
  }
  const double n = kChainOps;
  const double nog = median_of(nograd) / n, rec = median_of(record) / n;
  const double bwd = (median_of(fwd_bwd_sync) - median_of(fwd_sync)) / n;
  print_result("chain_fwd_nograd", nog, "us/call", nog * 1e-3, -1);
  print_result("chain_fwd_record", rec, "us/call", rec * 1e-3, -1);
  print_result("chain_bwd", bwd, "us/call", bwd * 1e-3, -1);
}

// A training step of a 4-layer MLP (1024 wide, ReLU, batch 64, MSE), forward + backward + SGD on
// every weight and bias, synchronised each step; the median over steps.
void bench_mlp_step(Device gpu) {
  constexpr int64_t kWidth = 1024, kBatch = 64, kLayers = 4;
  constexpr int kSteps = 50, kWarm = 5;
  std::vector<Tensor> ws, bs;
  for (int64_t l = 0; l < kLayers; ++l) {
    ws.push_back(Tensor::uniform({kWidth, kWidth}, -0.03, 0.03, gpu).requires_grad_());
    bs.push_back(Tensor::uniform({kWidth}, -0.03, 0.03, gpu).requires_grad_());
  }
  const Tensor x = Tensor::randn({kBatch, kWidth}, 0.0, 1.0, gpu);
  const Tensor target = Tensor::randn({kBatch, kWidth}, 0.0, 1.0, gpu);
  std::vector<double> us;
  for (int s = 0; s < kSteps + kWarm; ++s) {
    flame::cuda::synchronize(0);
    const auto t0 = std::chrono::steady_clock::now();
    Tensor h = x;
    for (int64_t l = 0; l < kLayers; ++l) {
      h = h.matmul(ws[l].t()) + bs[l];
      if (l + 1 < kLayers) h = h.relu();
    }
    flame::Gradients g = flame::mse_loss(h, target).backward();
    {
      flame::NoGradGuard no_grad;
      for (int64_t l = 0; l < kLayers; ++l) {
        ws[l].add_(g.get(ws[l]), -1e-3);
        bs[l].add_(g.get(bs[l]), -1e-3);
      }
    }
    flame::cuda::synchronize(0);
    if (s >= kWarm) us.push_back(us_since(t0));
  }
  const double med = median_of(us);
  print_result("mlp_step", med, "us/call", med * 1e-3, -1);
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  if (!flame::cuda_is_available()) {
    std::printf("# bench_ops: no CUDA device; nothing to measure\n");
    return 0;
  }
  const Device gpu = Device::cuda(0);
  auto stream = static_cast<cudaStream_t>(flame::cuda::current_stream(0));
  cudaDeviceProp prop{};
  BENCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# bench_ops: FLAME %s on %s (%d SMs), reps %d, warm-up %d\n", flame::version(), prop.name,
              prop.multiProcessorCount, opt.reps, opt.warmup);

  // The bandwidth reference: a device-to-device copy of 256 MiB on FLAME's stream.
  double d2d_gbps = -1;
  {
    const Tensor src = Tensor::rand({kElems}, gpu);
    Tensor dst = Tensor::empty({kElems}, gpu);
    const double ms = median_ms(stream, opt, [&] {
      BENCH_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), kBytes, cudaMemcpyDeviceToDevice, stream));
    });
    d2d_gbps = 2.0 * kBytes / (ms * 1e-3) / 1e9;
    print_result("d2d_copy", d2d_gbps, "GB/s", ms, 100.0);
  }

  struct MemOp {
    const char* name;
    double bytes;  // read + written
    std::function<std::function<void()>()> setup;  // makes inputs, returns the timed call
  };
  const double S = static_cast<double>(kBytes);
  const std::vector<MemOp> mem_ops = {
      {"add", 3 * S,
       [&] {
         Tensor x = Tensor::rand({kElems}, gpu), y = Tensor::rand({kElems}, gpu);
         return std::function<void()>([x, y] { (void)(x + y); });
       }},
      {"mul", 3 * S,
       [&] {
         Tensor x = Tensor::rand({kElems}, gpu), y = Tensor::rand({kElems}, gpu);
         return std::function<void()>([x, y] { (void)(x * y); });
       }},
      {"gelu", 2 * S,
       [&] {
         Tensor x = Tensor::randn({kElems}, 0.0, 1.0, gpu);
         return std::function<void()>([x] { (void)x.gelu(); });
       }},
      {"copy", 2 * S,
       [&] {
         Tensor x = Tensor::rand({kElems}, gpu);
         return std::function<void()>([x] { (void)x.clone(); });
       }},
      {"transpose_contiguous", 2 * S,
       [&] {
         Tensor x = Tensor::rand({kSquare, kSquare}, gpu);
         return std::function<void()>([x] { (void)x.t().contiguous(); });
       }},
      {"transpose_bf16", 2 * S,
       [&] {
         Tensor x = Tensor::rand({2 * kSquare, kSquare}, gpu).to(DType::bf16);
         return std::function<void()>([x] { (void)x.t().contiguous(); });
       }},
      {"transpose_fp8", 2 * S,  // the FP8 Linear's weight in its backward (Note [FP8 GEMM layout])
       [&] {
         Tensor x = Tensor::rand({4 * kSquare, kSquare}, gpu).to(DType::f8_e4m3fn);
         return std::function<void()>([x] { (void)x.t().contiguous(); });
       }},
      // The dequantize-mode Linear's weight before each GEMM (Note [Row dequantisation]): e4m3
      // codes with one f32 scale per row to bf16; 1 byte read and 2 written per element.
      {"dequantize_fp8", 3 * S,
       [&] {
         Tensor q = Tensor::rand({4 * kSquare, kSquare}, gpu).to(DType::f8_e4m3fn);
         Tensor s = Tensor::rand({4 * kSquare, 1}, gpu);
         return std::function<void()>([q, s] { (void)flame::from_float8(q, s, DType::bf16); });
       }},
      {"sum", S,
       [&] {
         Tensor x = Tensor::rand({kElems}, gpu);
         return std::function<void()>([x] { (void)x.sum(); });
       }},
      {"sum_columns", S,
       [&] {
         Tensor x = Tensor::rand({kSoftmaxRows, kSoftmaxCols}, gpu);
         return std::function<void()>([x] { (void)x.sum({0}); });
       }},
      {"softmax", 2 * S,
       [&] {
         Tensor x = Tensor::randn({kSoftmaxRows, kSoftmaxCols}, 0.0, 1.0, gpu);
         return std::function<void()>([x] { (void)x.softmax(-1); });
       }},
      {"softmax_bf16", 2 * S,
       [&] {
         Tensor x = Tensor::randn({kSoftmaxRows, 2 * kSoftmaxCols}, 0.0, 1.0, gpu).to(DType::bf16);
         return std::function<void()>([x] { (void)x.softmax(-1); });
       }},
      // Chains torch.compile fuses into one kernel (bench/suite.py also times the compiled twin):
      // the bytes are what one fused kernel must move (read x, write y).
      {"ew_chain", 2 * S,
       [&] {
         Tensor x = Tensor::randn({kElems}, 0.0, 1.0, gpu);
         return std::function<void()>([x] { (void)((x * 0.5 + 1.0).relu() * x); });
       }},
      // DiT's norm + modulate: layer_norm(x) * (1 + scale) + shift, scale/shift [B, D] broadcast
      // over tokens: FLAME's fused op (flame/nn/adaln.h), PyTorch's three ops (or torch.compile).
      {"norm_modulate_bf16", 2.0 * kModRows * kModTokens * kModHidden * 2,
       [&] {
         Tensor x = Tensor::randn({kModRows, kModTokens, kModHidden}, 0.0, 1.0, gpu).to(DType::bf16);
         Tensor scale = Tensor::randn({kModRows, kModHidden}, 0.0, 0.1, gpu).to(DType::bf16);
         Tensor shift = Tensor::randn({kModRows, kModHidden}, 0.0, 0.1, gpu).to(DType::bf16);
         return std::function<void()>([x, scale, shift] {
           (void)flame::nn::functional::layer_norm_modulate(x, shift, scale, 1e-6);
         });
       }},
  };
  for (const MemOp& op : mem_ops) {
    if (!opt.wants(op.name)) continue;
    try {
      const auto call = op.setup();
      const double ms = median_ms(stream, opt, call);
      const double gbps = op.bytes / (ms * 1e-3) / 1e9;
      print_result(op.name, gbps, "GB/s", ms, 100.0 * gbps / d2d_gbps);
    } catch (const std::exception& e) {
      print_error(op.name, e.what());
    }
  }

  if (opt.wants("gemm_bf16")) {
    try {
      const Tensor a = Tensor::randn({kGemm, kGemm}, 0.0, 1.0, gpu).to(DType::bf16);
      const Tensor b = Tensor::randn({kGemm, kGemm}, 0.0, 1.0, gpu).to(DType::bf16);
      const double ms = median_ms(stream, opt, [&] { (void)a.matmul(b); });
      const double tflops = 2.0 * kGemm * kGemm * kGemm / (ms * 1e-3) / 1e12;
      print_result("gemm_bf16", tflops, "TFLOP/s", ms, -1);
    } catch (const std::exception& e) {
      print_error("gemm_bf16", e.what());
    }
  }

  // As nn::Linear runs them: x [M, K] times W^T with W [N, K].
  for (const auto& [name, m, n, k] : {std::tuple<const char*, int64_t, int64_t, int64_t>{"gemm_dit_fc1_bf16", kDitTokens, kDitMlp, kDitHidden},
                                      std::tuple<const char*, int64_t, int64_t, int64_t>{"gemm_dit_fc2_bf16", kDitTokens, kDitHidden, kDitMlp}}) {
    if (!opt.wants(name)) continue;
    try {
      const Tensor x = Tensor::randn({m, k}, 0.0, 1.0, gpu).to(DType::bf16);
      const Tensor w = Tensor::randn({n, k}, 0.0, 0.05, gpu).to(DType::bf16);
      const double ms = median_ms(stream, opt, [&] { (void)x.matmul(w.t()); });
      print_result(name, 2.0 * static_cast<double>(m) * n * k / (ms * 1e-3) / 1e12, "TFLOP/s", ms, -1);
    } catch (const std::exception& e) {
      print_error(name, e.what());
    }
  }

  if (opt.wants("add_small_host")) {
    try {
      const Tensor a = Tensor::rand({kSmall}, gpu), b = Tensor::rand({kSmall}, gpu);
      for (int i = 0; i < 200; ++i) (void)(a + b);
      flame::cuda::synchronize(0);
      // Host cost: bursts short enough that CUDA's launch queue never fills (a full queue makes
      // the host wait for the GPU), the median over bursts.
      std::vector<double> burst_us;
      for (int r = 0; r < kSmallBursts; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < kSmallBurst; ++i) (void)(a + b);
        const auto t1 = std::chrono::steady_clock::now();
        flame::cuda::synchronize(0);
        burst_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / kSmallBurst);
      }
      std::sort(burst_us.begin(), burst_us.end());
      const double us = burst_us[burst_us.size() / 2];
      print_result("add_small_host", us, "us/call", us * 1e-3, -1);
      // Many calls until the GPU has run them all: the rate of small ops, host or GPU bound.
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < opt.small_calls; ++i) (void)(a + b);
      flame::cuda::synchronize(0);
      const auto t2 = std::chrono::steady_clock::now();
      const double us_gpu = std::chrono::duration<double, std::micro>(t2 - t0).count() / opt.small_calls;
      print_result("add_small_gpu", us_gpu, "us/call", us_gpu * 1e-3, -1);
    } catch (const std::exception& e) {
      print_error("add_small_host", e.what());
    }
  }
  if (opt.wants("chain")) {
    try {
      bench_chain(gpu);
    } catch (const std::exception& e) {
      print_error("chain", e.what());
    }
  }
  if (opt.wants("mlp_step")) {
    try {
      bench_mlp_step(gpu);
    } catch (const std::exception& e) {
      print_error("mlp_step", e.what());
    }
  }
  BENCH_CUDA_CHECK(cudaDeviceSynchronize());
  return 0;
}
