// Fused optimizer and EMA benchmarks (FLAME side; bench/bench_train_optim_torch.py is the PyTorch
// twin: same names, tensor sizes, dtypes and timing).
//
// 100M parameters in 200 tensors of mixed sizes (optim_sizes below; the twin builds the same
// list). Each line times one optimizer step (or one EMA update) over all of them: warm-up
// steps, then `reps` steps back to back on FLAME's stream with a CUDA event between consecutive
// steps; the median. GB/s counts the bytes a step must move per parameter: AdamW f32 reads
// p, g, m, v and writes p, m, v (28 B); SGD with momentum reads p, g, buf and writes p, buf
// (20 B); AdamW on bf16 parameters with f32 master weights reads g (bf16), master, m, v and
// writes master, m, v and p (bf16): 2 + 12 + 12 + 2 = 28 B; the EMA reads shadow and param and
// writes shadow (12 B).
// pct_d2d is that rate over a 256 MiB device-to-device copy timed the same way (optim_d2d_copy).
//
// Usage: bench_train_optim [--reps N] [--warmup N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench_timing.h"
#include "flame/flame.h"
#include "flame/optim/ema.h"
#include "flame/optim/optimizers.h"

namespace {

using flame::Device;
using flame::DType;
using flame::Gradients;
using flame::Tensor;
using flame::TensorList;
using flame::bench::median_ms;

constexpr int64_t kTotal = 100'000'000;
constexpr int kTensors = 200;

// Every 4th tensor is small (a bias or norm weight: 1024 + 7 i elements); the other 150 share the
// rest in proportion 1 : 2 : 3 : 4 : 5 (i mod 5), the last one taking the remainder.
std::vector<int64_t> optim_sizes() {
  std::vector<int64_t> n(kTensors, 0);
  int64_t small = 0, weight_sum = 0;
  for (int i = 0; i < kTensors; ++i) {
    if (i % 4 == 3) {
      n[i] = 1024 + 7 * i;
      small += n[i];
    } else {
      weight_sum += 1 + i % 5;
    }
  }
  const int64_t rest = kTotal - small;
  int64_t used = 0;
  int last = -1;
  for (int i = 0; i < kTensors; ++i) {
    if (i % 4 == 3) continue;
    n[i] = rest * (1 + i % 5) / weight_sum;
    used += n[i];
    last = i;
  }
  n[last] += rest - used;
  return n;
}

void emit(const std::string& name, double bytes_per_step, double ms, double d2d) {
  const double gbps = bytes_per_step / (ms * 1e-3) / 1e9;
  std::printf("BENCH {\"name\": \"%s\", \"value\": %.4g, \"unit\": \"GB/s\", \"ms\": %.4f, \"pct_d2d\": %.1f}\n",
              name.c_str(), gbps, ms, 100.0 * gbps / d2d);
  std::fflush(stdout);
}

struct Model {
  TensorList params;
  Gradients grads;
};

Model make_model(DType dtype, Device dev) {
  Model m;
  for (int64_t n : optim_sizes()) {
    Tensor p = Tensor::randn({n}, flame::TensorOptions(DType::f32, dev)).mul_(0.02).to(dtype);
    p.requires_grad_(true);
    m.grads.set(p, Tensor::randn({n}, flame::TensorOptions(DType::f32, dev)).mul_(1e-3).to(dtype));
    m.params.push_back(p);
  }
  return m;
}

// Note [PyTorch check]: the same 20 steps as the twin's check_against_torch (float64 on the GPU,
// inputs from a formula, a parameter without a gradient every third step, two groups); both print
// "# check <name> sum=... absmax=..." so a run shows whether FLAME and torch.optim agree.
void check_against_torch(Device dev) {
  const std::vector<flame::Shape> shapes = {{7}, {5, 3}, {2, 3, 5}, {3, 4}};
  auto values = [](const flame::Shape& s, double phase, double freq) {
    int64_t n = 1;
    for (int64_t d : s) n *= d;
    std::vector<double> v(static_cast<std::size_t>(n));
    for (int64_t k = 0; k < n; ++k) v[static_cast<std::size_t>(k)] = std::sin(freq * static_cast<double>(k) + phase);
    return v;
  };
  auto run = [&](const std::string& name, auto make) {
    TensorList ps;
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      Tensor p = Tensor::from_vec(values(shapes[i], static_cast<double>(i), 0.37), shapes[i], dev);
      p.requires_grad_(true);
      ps.push_back(p);
    }
    std::vector<flame::optim::ParamGroup> groups(2);
    groups[0].params = {ps[0], ps[1]};
    groups[1].params = {ps[2], ps[3]};
    auto opt = make(groups);
    for (int t = 0; t < 20; ++t) {
      Gradients g;
      for (std::size_t i = 0; i < ps.size(); ++i) {
        if (i == 3 && t % 3 == 1) continue;
        g.set(ps[i], Tensor::from_vec(values(shapes[i], 1.0 + static_cast<double>(i), 0.11 * (t + 1)), shapes[i], dev)
                         .mul_(0.5));
      }
      opt->step(g);
    }
    double sum = 0, absmax = 0;
    for (const Tensor& p : ps)
      for (double x : p.to_vec<double>()) {
        sum += x;
        absmax = std::max(absmax, std::abs(x));
      }
    std::printf("# check %s sum=%.12e absmax=%.12e\n", name.c_str(), sum, absmax);
  };
  namespace O = flame::optim;
  run("adamw", [](std::vector<O::ParamGroup> g) {
    O::AdamWOptions o{.lr = 1e-2, .weight_decay = 0.1};
    g[0] = o.group(g[0].params);
    g[1] = o.group(g[1].params);
    g[1].lr = 3e-2;
    g[1].weight_decay = 0.01;
    return std::make_unique<O::AdamW>(g, o);
  });
  run("adam_amsgrad", [](std::vector<O::ParamGroup> g) {
    O::AdamOptions o{.lr = 1e-2, .weight_decay = 0.01, .amsgrad = true};
    g[0] = o.group(g[0].params);
    g[1] = o.group(g[1].params);
    g[1].beta1 = 0.8;
    g[1].beta2 = 0.99;
    return std::make_unique<O::Adam>(g, o);
  });
  run("sgd_nesterov", [](std::vector<O::ParamGroup> g) {
    O::SGDOptions o{.lr = 1e-2, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true};
    g[0] = o.group(g[0].params);
    g[1] = o.group(g[1].params);
    g[1].momentum = 0.5;
    return std::make_unique<O::SGD>(g, o);
  });
  run("adafactor", [](std::vector<O::ParamGroup> g) {
    O::AdafactorOptions o{.lr = 1e-2, .weight_decay = 0.01};
    g[0] = o.group(g[0].params);
    g[1] = o.group(g[1].params);
    g[1].lr = 0.5;
    return std::make_unique<O::Adafactor>(g, o);
  });
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const flame::bench::RepsArgs args = flame::bench::parse_reps(argc, argv);
  const int reps = args.reps, warmup = args.warmup;
  if (!flame::cuda_is_available()) {
    std::printf("# bench_train_optim: no CUDA device; nothing to measure\n");
    return 0;
  }
  const Device gpu = Device::cuda(0);
  auto stream = static_cast<cudaStream_t>(flame::cuda::current_stream(0));
  std::printf("# bench_train_optim: %lld parameters in %d tensors, reps %d, warm-up %d\n",
              static_cast<long long>(kTotal), kTensors, reps, warmup);

  double d2d = 0;
  {
    const int64_t bytes = 256LL << 20;
    const Tensor src = Tensor::rand({bytes / 4}, gpu), dst = Tensor::empty({bytes / 4}, gpu);
    const double ms = median_ms(stream, reps, warmup, [&] {
      BENCH_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), bytes, cudaMemcpyDeviceToDevice, stream));
    });
    d2d = 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
    std::printf("BENCH {\"name\": \"optim_d2d_copy\", \"value\": %.4g, \"unit\": \"GB/s\", \"ms\": %.4f, \"pct_d2d\": 100.0}\n",
                d2d, ms);
  }
  check_against_torch(gpu);
  const double n = static_cast<double>(kTotal);
  auto run = [&](const std::string& name, double bytes, const std::function<void()>& fn) {
    try {
      const double ms = median_ms(stream, reps, warmup, fn);
      emit(name, bytes, ms, d2d);
    } catch (const std::exception& e) {
      std::printf("BENCH {\"name\": \"%s\", \"error\": \"failed\"}\n# %s\n", name.c_str(), e.what());
    }
  };
  {
    Model m = make_model(DType::f32, gpu);
    flame::optim::AdamW opt(m.params, {.lr = 1e-4, .weight_decay = 0.01});
    run("optim_adamw_f32_100m", 28 * n, [&] { opt.step(m.grads); });
  }
  flame::cuda::empty_cache();
  {
    Model m = make_model(DType::f32, gpu);
    flame::optim::SGD opt(m.params, {.lr = 1e-3, .momentum = 0.9});
    run("optim_sgd_momentum_f32_100m", 20 * n, [&] { opt.step(m.grads); });
  }
  flame::cuda::empty_cache();
  {
    Model m = make_model(DType::bf16, gpu);
    flame::optim::AdamW opt(m.params, {.lr = 1e-4, .weight_decay = 0.01, .master_weights = true});
    run("optim_adamw_bf16_master_100m", 28 * n, [&] { opt.step(m.grads); });
  }
  flame::cuda::empty_cache();
  {
    Model m = make_model(DType::f32, gpu);
    flame::optim::EMA ema(m.params, {.decay = 0.9999});
    run("optim_ema_f32_100m", 12 * n, [&] { ema.update(); });
  }
  return 0;
}
