// Whole training steps (forward, backward, optimizer) of the diffusion trainer's models and an
// MLP overhead probe; bench/bench_steps_torch.py is the PyTorch twin (same names, shapes, dtypes,
// settings and timing; eager and torch.compile). docs/benchmarks.md describes the cases.
//
// Note [Step benchmark method]
// A step is the trainer's step (apps/diffusion/src/trainer.cpp, run_loop) written against the
// same public API and apps/diffusion's library: label dropout (p 0.1), the rectified-flow loss
// under bf16 autocast (noise and logit-normal t drawn from a Generator), backward into a fresh
// Gradients, clip_grad_norm_(1.0), AdamW (lr 1e-4, weight decay 0), EMA (0.999 with warm-up).
// Left out, on both sides: the data loader (the batch is a static randn image tensor and random
// labels already on the device, as a captured step would have it), the loss read (loss.item())
// and the host-only LR scheduler. The MLP probe is 4 Linear(4096, 4096) with GELU between, batch
// 64, bf16 autocast over f32 parameters, mse loss, backward, AdamW: little GPU work per step, so
// its time is mostly per-op host cost.
//
// Timing: `warmup` steps, then `reps` steps queued back to back with a timing event recorded
// between consecutive steps; the median per-step time (the events never make the host wait;
// whatever the step itself synchronises, e.g. clip_grad_norm_ reading the norm, is part of it).
// On the CPU (smoke runs) the steps are timed with a steady clock. Peak memory: the memory pool's
// peak_allocated_bytes over the timed steps (reset after the warm-up; parameters, optimizer and
// EMA state are live at the reset and therefore included), torch.cuda.max_memory_allocated on
// the PyTorch side. TF32 is off on both sides (FLAME's default; bf16 autocast makes the
// matmuls and convolutions bf16 anyway).
//
// Model FLOPs (Note [Model FLOPs]): counted analytically from the model's shapes, the matmuls
// and convolutions only: training = 3 x forward (forward 2*m*n*k per matmul, backward twice
// that); attention adds 3 x 4*T^2*d per sequence and layer (QK^T and PV). MFU = FLOPs / step
// time / the bf16 GEMM rate measured in the same run (8192^3, gemm_peak_bf16).
//
// --mode graph times the trainer's --compile step: capturable AdamW and EMA, sync-free clipping and
// (DiT) the blocks' elementwise chains fused by flame::compile, the whole step captured once by
// cuda::GraphedStep and replayed (on the CPU the same step runs eagerly).
//
// Usage: bench_steps [--device cuda|cpu] [--model dit-s,unet-s,mlp] [--batch N] [--steps N]
//                    [--warmup N] [--mode eager|graph] [--amp auto|bf16|off] [--no-gemm] [--memory-report]
//                    [--recompute none,mlp,mlp:N,all] [--attention default,short]
//
// --recompute runs each DiT case once per level listed (DiTRecompute, docs/recompute.md); the
// levels other than none are named step_<model>_b<batch>_recompute_<level>.
// --attention runs each case once per choice listed: "default" leaves cuda::set_short_attention as
// it is (off unless FLAME_SHORT_ATTENTION=1), "short" turns FLAME's short-sequence attention kernels
// on for the case (docs/nn-attention.md) and adds "_short_attention" to its name.
// --memory-report runs one more step of each case under flame::profiler::MemoryProfiler and prints
// its report ("where the peak went", by op and module) as '#' lines after the case's result.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <flame/amp.h>
#include <flame/cuda.h>
#include <flame/flame.h>
#include <flame/nn.h>
#include <flame/optim/ema.h>
#include <flame/optim/optimizers.h>
#include <flame/profiler.h>
#include <flame/cuda/graph_step.h>

#include "dit.h"
#include "embed.h"
#include "objective.h"
#include "unet.h"

namespace {

using flame::Device;
using flame::DType;
using flame::Tensor;
using flame_diffusion::DiffusionModel;
namespace optim = flame::optim;

struct Args {
  std::string device = "cuda";
  std::vector<std::string> models{"dit-s", "unet-s", "mlp"};
  int64_t batch = 0;  // 0: the model's default
  int reps = 20;
  int warmup = 3;
  std::string mode = "eager";
  std::string amp = "auto";  // auto: bf16 on CUDA (as the trainer), off on the CPU
  bool gemm = true;
  bool memory_report = false;  // one more step under the memory profiler: where each peak went
  int trace = 0;               // > 0: that many more steps under profiler::KernelTrace (CUDA): where the time went
  std::string trace_json;      // with --trace: also write the kernels as a Chrome trace (chrome://tracing, Perfetto)
  // DiT activation recompute levels, one case each (DiTRecompute); "none" keeps the case's plain
  // name (the PyTorch twin's), the others add "_recompute_<level>".
  std::vector<std::string> recompute{"none"};
  std::vector<std::string> attention{"default"};  // "default" and/or "short", one case each
};

// One case: a step to time and what to report about it. `step` is the seam a graph-capture
// helper takes (it must be re-runnable with no arguments).
struct Workload {
  std::string name;
  int64_t batch = 0;
  double flops = 0;  // model FLOPs of one step (Note [Model FLOPs])
  std::function<void()> step;
  std::vector<std::shared_ptr<void>> keep;  // model, optimizer, ... alive as long as the step
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

void print_error(const std::string& name, const std::string& what) {
  std::printf("BENCH {\"name\": \"%s\", \"error\": \"%s\", \"impl\": \"flame\"}\n", name.c_str(),
              json_escape(what).c_str());
  std::fflush(stdout);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  if (n == 0) return 0;
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Median milliseconds per call (Note [Step benchmark method]).
double time_ms(const Device& dev, int reps, int warmup, const std::function<void()>& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  if (dev.is_cuda()) {
    flame::cuda::synchronize(dev.index);
    std::vector<flame::cuda::Event> ev;
    for (int r = 0; r <= reps; ++r) ev.emplace_back(true);
    ev[0].record();
    for (int r = 0; r < reps; ++r) {
      fn();
      ev[static_cast<std::size_t>(r) + 1].record();
    }
    ev.back().synchronize();
    for (int r = 0; r < reps; ++r)
      ms.push_back(ev[static_cast<std::size_t>(r)].elapsed_time(ev[static_cast<std::size_t>(r) + 1]));
  } else {
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  return median(ms);
}

// Note [Model FLOPs]: matmul/conv FLOPs of one training step, 3 x the forward's.
double dit_flops(const flame_diffusion::DiTConfig& c, int64_t batch) {
  const double h = static_cast<double>(c.hidden), T = static_cast<double>(c.tokens()), B = static_cast<double>(batch);
  const double L = static_cast<double>(c.depth), mlp = static_cast<double>(static_cast<int64_t>(c.hidden * c.mlp_ratio));
  const double pp = static_cast<double>(c.patch_size * c.patch_size), C = static_cast<double>(c.in_channels);
  const double f = static_cast<double>(c.frequency_dim);
  // Per token: qkv, proj, fc1, fc2 of every block; patch embedding (a p x p stride-p conv); final linear.
  const double per_token = L * (3 * h * h + h * h + 2 * h * mlp) + C * pp * h + h * pp * C;
  // Per image: adaLN of every block (h -> 6h) and of the final layer (h -> 2h); timestep MLP.
  const double per_image = L * 6 * h * h + 2 * h * h + f * h + h * h;
  const double attention = L * 4 * T * T * h;  // QK^T and PV over all heads, per image
  return 3.0 * (2 * per_token * B * T + 2 * per_image * B + attention * B);
}

double unet_flops(const flame_diffusion::UNetConfig& c, int64_t batch) {
  double fwd = 0;  // per image
  auto conv = [&](double cin, double cout, double k, double out_res) { fwd += 2 * cin * cout * k * k * out_res * out_res; };
  const double emb = static_cast<double>(c.emb_dim);
  auto res_block = [&](double cin, double cout, double r) {
    conv(cin, cout, 3, r);
    conv(cout, cout, 3, r);
    if (cin != cout) conv(cin, cout, 1, r);
    fwd += 2 * emb * cout;  // emb_proj
  };
  const std::size_t levels = c.channel_mult.size();
  std::vector<double> ch, res;
  double r = static_cast<double>(c.image_size);
  for (std::size_t i = 0; i < levels; ++i) {
    ch.push_back(static_cast<double>(c.base_channels * c.channel_mult[i]));
    res.push_back(r);
    r = static_cast<double>((static_cast<int64_t>(r) + 1) / 2);  // stride-2 3x3 conv, padding 1
  }
  double cur = static_cast<double>(c.base_channels);
  conv(static_cast<double>(c.in_channels), cur, 3, res[0]);
  for (std::size_t i = 0; i < levels; ++i) {
    res_block(cur, ch[i], res[i]);
    cur = ch[i];
    if (i + 1 < levels) conv(cur, cur, 3, res[i + 1]);
  }
  const double low = res[levels - 1], n = low * low;
  res_block(cur, cur, low);
  fwd += 2 * n * (3 * cur * cur + cur * cur) + 4 * n * n * cur;  // mid attention: qkv, proj, QK^T, PV
  res_block(cur, cur, low);
  for (std::size_t j = 0; j < levels; ++j) {
    const double out = ch[levels - 1 - j];
    res_block(cur + out, out, res[levels - 1 - j]);
    cur = out;
    if (j + 1 < levels) conv(cur, cur, 3, res[levels - 2 - j]);
  }
  conv(cur, static_cast<double>(c.in_channels), 3, res[0]);
  const double f = static_cast<double>(c.frequency_dim);
  fwd += 2 * (f * emb + emb * emb);  // timestep MLP
  return 3.0 * fwd * static_cast<double>(batch);
}

constexpr int64_t kMlpWidth = 4096, kMlpLayers = 4;

double mlp_flops(int64_t batch) {
  return 3.0 * 2.0 * static_cast<double>(kMlpLayers) * kMlpWidth * kMlpWidth * static_cast<double>(batch);
}

// The trainer's step for a diffusion preset (Note [Step benchmark method]).
// graph: the trainer's --compile step (capturable AdamW and EMA, sync-free clipping), for cuda::GraphedStep.
Workload diffusion_workload(const std::string& preset, int64_t batch, const Device& dev, std::optional<DType> amp,
                            bool graph, const std::string& recompute = "none") {
  auto model = flame_diffusion::make_model(preset, 0);
  if (auto* dit = dynamic_cast<flame_diffusion::DiT*>(model.get())) dit->set_recompute(flame_diffusion::parse_dit_recompute_spec(recompute));
  model->to(dev);
  model->train();
  Workload w;
  w.batch = batch;
  w.name = "step_" + preset + "_b" + std::to_string(batch) + (recompute == "none" ? "" : "_recompute_" + recompute);
  if (preset.rfind("dit", 0) == 0) {
    w.flops = dit_flops(flame_diffusion::dit_config(preset), batch);
  } else {
    w.flops = unet_flops(flame_diffusion::unet_config(preset), batch);
  }
  auto params = std::make_shared<flame::TensorList>(model->parameters());
  auto opt = std::make_shared<optim::AdamW>(*params,
                                            optim::AdamWOptions{.lr = 1e-4, .weight_decay = 0.0, .capturable = graph});
  auto ema = std::make_shared<optim::EMA>(*params, optim::EMAOptions{.decay = 0.999, .warmup = true, .capturable = graph});
  auto gen = std::make_shared<flame::Generator>(17);
  auto objective = std::make_shared<flame_diffusion::RectifiedFlow>();
  auto counter = std::make_shared<int64_t>(0);
  flame::Generator data_gen(1);
  const int64_t s = model->image_size();
  const Tensor images = Tensor::randn({batch, model->in_channels(), s, s}, 0.0, 1.0, {DType::f32, dev}, &data_gen);
  const Tensor labels = Tensor::randint(0, model->num_classes(), {batch}, {DType::i64, dev}, &data_gen);
  DiffusionModel* m = model.get();
  w.step = [=] {
    const Tensor y = flame_diffusion::drop_labels(labels, 0.1, m->null_class(), gen.get());
    Tensor loss;
    {
      std::optional<flame::amp::AutocastGuard> ac;
      if (amp) ac.emplace(*amp, dev.is_cuda() ? flame::DeviceType::cuda : flame::DeviceType::cpu);
      loss = objective->loss(*m, images, y, gen.get());
    }
    flame::Gradients grads;
    flame::BackwardOptions bo;
    bo.accumulate_into = &grads;
    (void)loss.backward(bo);
    if (graph) {
      (void)flame::clip_grad_norm(grads, 1.0);  // the norm stays on the device
      opt->step(grads);
      ema->update();
    } else {
      (void)flame::clip_grad_norm_(grads, 1.0);
      opt->step(grads);
      ema->update((*counter)++);
    }
  };
  w.keep = {model, params, opt, ema, gen, objective, counter};
  return w;
}

// The MLP overhead probe: 4 x Linear(4096, 4096), GELU between, mse loss, AdamW.
Workload mlp_workload(int64_t batch, const Device& dev, std::optional<DType> amp, bool graph) {
  auto layers = std::make_shared<std::vector<std::shared_ptr<flame::nn::Linear>>>();
  auto params = std::make_shared<flame::TensorList>();
  for (int64_t l = 0; l < kMlpLayers; ++l) {
    layers->push_back(std::make_shared<flame::nn::Linear>(kMlpWidth, kMlpWidth, true, flame::TensorOptions{DType::f32, dev}));
    for (const Tensor& p : layers->back()->parameters()) params->push_back(p);
  }
  auto opt = std::make_shared<optim::AdamW>(*params,
                                            optim::AdamWOptions{.lr = 1e-4, .weight_decay = 0.0, .capturable = graph});
  flame::Generator data_gen(2);
  const Tensor x = Tensor::randn({batch, kMlpWidth}, 0.0, 1.0, {DType::f32, dev}, &data_gen);
  const Tensor target = Tensor::randn({batch, kMlpWidth}, 0.0, 1.0, {DType::f32, dev}, &data_gen);
  Workload w;
  w.batch = batch;
  w.name = "step_mlp4x4096_b" + std::to_string(batch);
  w.flops = mlp_flops(batch);
  w.step = [=] {
    Tensor loss;
    {
      std::optional<flame::amp::AutocastGuard> ac;
      if (amp) ac.emplace(*amp, dev.is_cuda() ? flame::DeviceType::cuda : flame::DeviceType::cpu);
      Tensor h = x;
      for (int64_t l = 0; l < kMlpLayers; ++l) {
        h = (*layers)[static_cast<std::size_t>(l)]->forward(h);
        if (l + 1 < kMlpLayers) h = flame::gelu(h);
      }
      loss = flame::mse_loss(h, target);
    }
    const flame::Gradients grads = loss.backward();
    opt->step(grads);
  };
  w.keep = {layers, params, opt};
  return w;
}

int64_t default_batch(const std::string& model) {
  if (model.rfind("dit", 0) == 0) return 256;
  if (model.rfind("unet", 0) == 0) return 128;
  return 64;
}

Args parse(int argc, char** argv) {
  Args a;
  auto usage = [] {
    std::fprintf(stderr,
                 "usage: bench_steps [--device cuda|cpu] [--model dit-s,unet-s,mlp] [--batch N] [--steps N] "
                 "[--warmup N] [--mode eager|graph] [--amp auto|bf16|off] [--no-gemm] [--memory-report] [--trace N [--trace-json FILE]] "
                 "[--recompute none,mlp,mlp:N,all] [--attention default,short]\n");
    std::exit(2);
  };
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage();
      return argv[++i];
    };
    if (s == "--device") {
      a.device = next();
    } else if (s == "--model" || s == "--models") {
      a.models.clear();
      std::stringstream ss(next());
      for (std::string m; std::getline(ss, m, ',');)
        if (!m.empty()) a.models.push_back(m);
    } else if (s == "--batch") {
      a.batch = std::atoll(next().c_str());
    } else if (s == "--steps" || s == "--reps") {
      a.reps = std::max(1, std::atoi(next().c_str()));
    } else if (s == "--warmup") {
      a.warmup = std::max(0, std::atoi(next().c_str()));
    } else if (s == "--mode") {
      a.mode = next();
      if (a.mode != "eager" && a.mode != "graph") usage();
    } else if (s == "--amp") {
      a.amp = next();
      if (a.amp != "bf16" && a.amp != "off" && a.amp != "auto") usage();
    } else if (s == "--no-gemm") {
      a.gemm = false;
    } else if (s == "--trace-json") {
      a.trace_json = next();
    } else if (s == "--trace") {
      a.trace = std::max(0, std::atoi(next().c_str()));
    } else if (s == "--memory-report") {
      a.memory_report = true;
    } else if (s == "--recompute") {
      a.recompute.clear();
      std::stringstream ss(next());
      for (std::string r; std::getline(ss, r, ',');) {
        try {
          (void)flame_diffusion::parse_dit_recompute_spec(r);
        } catch (const std::exception&) {
          usage();
        }
        a.recompute.push_back(r);
      }
      if (a.recompute.empty()) usage();
    } else if (s == "--attention") {
      a.attention.clear();
      std::stringstream ss(next());
      for (std::string r; std::getline(ss, r, ',');) {
        if (r != "default" && r != "short") usage();
        a.attention.push_back(r);
      }
      if (a.attention.empty()) usage();
    } else {
      usage();
    }
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  Device dev = Device::cpu();
  if (args.device == "cuda" || args.device.rfind("cuda:", 0) == 0) {
    if (!flame::cuda_is_available()) {
      std::printf("# bench_steps: no CUDA device; nothing to measure (--device cpu runs the CPU smoke test)\n");
      return 0;
    }
    dev = Device::cuda(args.device.size() > 5 ? std::atoi(args.device.c_str() + 5) : 0);
    flame::cuda::set_allow_tf32(false);
  } else if (args.device != "cpu") {
    std::fprintf(stderr, "bench_steps: --device %s: expected cuda, cuda:N or cpu\n", args.device.c_str());
    return 2;
  }
  // bf16 autocast as the trainer on CUDA; on the CPU (smoke runs) only when asked for.
  std::optional<DType> amp;
  if (args.amp == "bf16" || (args.amp == "auto" && dev.is_cuda())) amp = DType::bf16;
  const char* impl = args.mode == "graph" ? "flame_graph" : "flame";
  std::printf("# bench_steps: FLAME %s on %s, mode %s, autocast %s, TF32 off, reps %d, warm-up %d\n", flame::version(),
              dev.is_cuda() ? "cuda" : "cpu", args.mode.c_str(), amp ? "bf16" : "off", args.reps, args.warmup);
  std::fflush(stdout);

  // The bf16 GEMM rate MFU is measured against (8192^3, as gemm_bf16 of bench_ops).
  double peak_tflops = 0;
  if (dev.is_cuda() && args.gemm) {
    try {
      constexpr int64_t n = 8192;
      const Tensor a = Tensor::randn({n, n}, 0.0, 1.0, {DType::f32, dev}).to(DType::bf16);
      const Tensor b = Tensor::randn({n, n}, 0.0, 1.0, {DType::f32, dev}).to(DType::bf16);
      const double ms = time_ms(dev, 20, 3, [&] { (void)a.matmul(b); });
      peak_tflops = 2.0 * n * n * n / (ms * 1e-3) / 1e12;
      std::printf("BENCH {\"name\": \"gemm_peak_bf16\", \"value\": %.4g, \"unit\": \"TFLOP/s\", \"ms\": %.4f, \"impl\": \"flame\"}\n",
                  peak_tflops, ms);
      std::fflush(stdout);
    } catch (const std::exception& e) {
      print_error("gemm_peak_bf16", e.what());
    }
  }

  // One case per model and --attention choice, and for DiT models one per --recompute level.
  struct Case {
    std::string model, recompute;
    bool short_attention;
  };
  std::vector<Case> cases;
  for (const std::string& model : args.models) {
    for (const std::string& a : args.attention) {
      if (model == "mlp" && a == "short") continue;  // no attention in it
      if (model.rfind("dit", 0) == 0) {
        for (const std::string& r : args.recompute) cases.push_back({model, r, a == "short"});
      } else {
        cases.push_back({model, "none", a == "short"});
      }
    }
  }
  const bool short_attention_default = flame::cuda::short_attention();
  for (const auto& [model, recompute, short_attention] : cases) {
    const int64_t batch = args.batch > 0 ? args.batch : default_batch(model);
    const std::string suffix = short_attention ? "_short_attention" : "";
    std::string name = "step_" + model + "_b" + std::to_string(batch) +
                       (recompute == "none" ? "" : "_recompute_" + recompute) + suffix;
    flame::cuda::set_short_attention(short_attention || short_attention_default);
    try {
      const bool graph = args.mode == "graph";
      Workload w = model == "mlp" ? mlp_workload(batch, dev, amp, graph)
                                  : diffusion_workload(model, batch, dev, amp, graph, recompute);
      name = w.name + suffix;
      if (graph) {
        // The whole step as one CUDA graph (cuda::GraphedStep: eager warm-up, capture, replays).
        auto graphed = std::make_shared<flame::cuda::GraphedStep>(
            w.step, flame::cuda::GraphedStepOptions{.warmup_steps = 3, .device = dev.index, .enabled = dev.is_cuda()});
        w.keep.push_back(graphed);
        w.step = [graphed] { (*graphed)(); };
        for (int i = 0; i < 4; ++i) w.step();  // warm-up + capture before the timed warm-up below
      }
      // Warm-up outside time_ms so the peak counts the timed steps only.
      for (int i = 0; i < args.warmup; ++i) w.step();
      if (dev.is_cuda()) {
        flame::cuda::synchronize(dev.index);
        flame::cuda::reset_peak_memory_stats(dev.index);
      }
      const double ms = time_ms(dev, args.reps, 0, w.step);
      const double tflops = w.flops / (ms * 1e-3) / 1e12;
      std::printf("BENCH {\"name\": \"%s\", \"value\": %.4f, \"unit\": \"ms\", \"ms\": %.4f, \"impl\": \"%s\", "
                  "\"batch\": %lld, \"img_s\": %.1f, \"flops\": %.4g, \"tflops\": %.2f",
                  name.c_str(), ms, ms, impl, static_cast<long long>(batch), static_cast<double>(batch) / (ms * 1e-3),
                  w.flops, tflops);
      if (dev.is_cuda()) {
        // A captured step's tensors live in the graph's private pool, outside the allocated peak.
        const auto st = flame::cuda::memory_stats(dev.index);
        const double peak_mib =
            static_cast<double>(st.peak_allocated_bytes + (graph ? st.graph_pool_bytes : 0)) / (1 << 20);
        std::printf(", \"peak_mib\": %.1f", peak_mib);
      }
      if (peak_tflops > 0) std::printf(", \"mfu\": %.4f", tflops / peak_tflops);
      std::printf("}\n");
      std::fflush(stdout);
      if (args.trace > 0 && dev.is_cuda()) {
        // Diagnostics only: where the step's GPU time goes (profiler::KernelTrace, CUPTI).
        try {
          flame::profiler::KernelTrace trace;
          trace.start();
          for (int i = 0; i < args.trace; ++i) w.step();
          trace.stop();
          if (!args.trace_json.empty()) trace.save_chrome_trace(args.trace_json);
          std::istringstream table(trace.summary(40, 110));
          std::printf("# kernel trace of %d %s steps:\n", args.trace, name.c_str());
          for (std::string line; std::getline(table, line);) std::printf("#   %s\n", line.c_str());
          std::istringstream grouped([&] {
            std::ostringstream os;
            for (const auto& row : trace.by_name(40))
              if (row.percent >= 0.5)
                os << row.calls << " calls " << row.total_ms / args.trace << " ms/step " << row.percent << "% " << row.name << "\n";
            return os.str();
          }());
          std::printf("# grouped by the first 40 characters (>= 0.5%%):\n");
          for (std::string line; std::getline(grouped, line);) std::printf("#   %s\n", line.c_str());
        } catch (const std::exception& e) {
          std::printf("# kernel trace of %s failed: %s\n", name.c_str(), e.what());
        }
        std::fflush(stdout);
      }
      if (args.memory_report) {
        // Diagnostics only: a failure here must not turn the result above into an error line.
        try {
          flame::profiler::MemoryProfiler prof;
          {
            flame::profiler::MemoryProfileScope scope(prof);
            w.step();
          }
          std::istringstream report(prof.report(12));
          std::printf("# memory report of one %s step:\n", name.c_str());
          for (std::string line; std::getline(report, line);) std::printf("#   %s\n", line.c_str());
        } catch (const std::exception& e) {
          std::printf("# memory report of %s failed: %s\n", name.c_str(), e.what());
        }
        std::fflush(stdout);
      }
    } catch (const std::exception& e) {
      print_error(name, e.what());
    }
    if (dev.is_cuda()) flame::cuda::empty_cache(dev.index);
  }
  flame::cuda::set_short_attention(short_attention_default);
  return 0;
}
