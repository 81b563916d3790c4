// flux_parity: FLAME's FluxTransformer2DModel against diffusers' (apps/diffusion/reference/models_flux.py).
//
//   flux_parity check --dir DIR [--device cuda|cpu] [--checkpointing 0|N|-1]
//       DIR as models_flux.py writes it (transformer/ diffusers folder, flux_original.safetensors,
//       flux_comfy_fp8.safetensors and flux_fp8_scaled.safetensors when written (reduced configs, --fp8),
//       reference.safetensors). For each file that is there: loads the model in the reference's
//       dtype, runs the forward on the stored inputs and compares the output (the fp8 files against
//       diffusers on their dequantised weights); for the diffusers folder and the BFL file also adds
//       the LoRA (stored weights, rank/alpha from the metadata), runs forward + mse loss + backward
//       and compares the LoRA output, the loss and the adapter gradients (grouped: double / single
//       blocks, A and B). Prints max abs and relative (max |err| / max |ref|) errors, then PASS or
//       FAIL. Tolerances (relative): f32 1e-3 outputs, 1e-2 gradients; bf16 5e-2 and 1e-1.
//   flux_parity time --config flux-dev [--latent 128] [--text 512] [--batch 1] [--checkpointing 0,-1]
//                    [--offload 0] [--rank 16] [--steps 10] [--warmup 3] [--trace 0] [--recompute 0] [--graph 0]
//                    [--device cuda]
//       the LoRA r16 training step as diffusers + peft run it (bf16 weights, f32 adapters on
//       to_q/k/v/out.0, bf16 autocast, mse loss, AdamW on the adapters; random weights; latent 128 =
//       1024² images: 4096 image tokens, plus 512 text tokens), timed with CUDA events: one JSON line
//       per checkpointing setting (N = blocks checkpointed, -1 = all) with the median step time, the
//       peak allocated memory and MFU (step_flops: linears 2x their forward, the frozen weights get
//       no weight gradients; attention 3x) against 989 TFLOP/s and against a bf16 GEMM (8192^3)
//       measured in the same run.
//       --offload 1 moves the checkpointed blocks' inputs to pinned host memory; with
//       --offload-blocks N,... (-1: all; -2, the default: the checkpointed ones) what the first N
//       blocks save, checkpointed or not, and --offload-min-mib M (default 1) leaves saved tensors
//       under M MiB on the device, --offload-prefetch-mib P brings P MiB back ahead in the backward
//       (default 0: one tensor) (BlockStack::set_activation_offload). The JSON line adds
//       offload_blocks and offloaded_gib (what the last forward moved).
//       --trace N prints where the GPU time of N more steps goes and where the GPU sat idle
//       (profiler::KernelTrace; parity_util.h print_idle_time).
//       --recompute 0,1 runs the forward without / under autograd::RecomputeCheap (docs/recompute.md).
//       --graph 0,1 runs the step eagerly / as one CUDA graph (flame::cuda::GraphedStep).
//       --fp8 none,dequantize,fp8 stores the frozen Linear weights in 8 bits (nn::quantize_float8):
//       none keeps bf16; dequantize expands them into the bf16 GEMMs; fp8 runs FP8 GEMMs (docs/float8.md).
//       The JSON line adds the base Linear weights' bytes.
//       --budget 0,24,16 (GiB; 0: none) caps the pool and lets models::fit_vram_budget choose the
//       swapped and checkpointed blocks from trial steps (with --checkpointing -1 every block stays
//       checkpointed); the plan is printed before the JSON line, which adds budget_gib, swapped_blocks
//       and the peak reserved memory.
//   flux_parity losses --config flux-dev [--latent 128] [--text 512] [--rank 16] [--steps 50]
//                      [--fp8 none,dequantize,fp8] [--swap 0] [--optimizer adamw] [--checkpointing 0]
//                      [--lr 1e-3] [--device cuda]
//       the same step's loss at every one of --steps optimizer steps (same initial weights, adapters,
//       data and noise in every run), one JSON line per run (each --fp8 mode x --swap count x
//       --optimizer) with the losses and the largest relative difference from the first run's loss
//       at the same step. --swap N keeps N blocks' frozen weights in host memory (offload::BlockSwap,
//       spread over the stack; swapped blocks are recomputed in backward); --optimizer adamw8bit
//       steps with optim::AdamW8bit instead of AdamW.
//   flux_parity full --config flux-dev [--latent 128] [--text 512] [--steps 6] [--warmup 2] [--zero 3]
//                    [--dtype bf16] [--params f32] [--lr 1e-5] [--trace 0] [--prefetch 1] [--timeline 0]
//                    [--bucket-mb 25] [--device cuda]
//       full fine-tuning (every weight trains: f32 weights, AdamW) on each rank of a flame-run job,
//       batch 1 per rank (its own random latents and text), mse loss, random weights. --zero S on
//       several ranks: dist::ZeroRedundancyOptimizer stage S; 3 (the default) shards the 19 + 38
//       blocks' parameters, gathers each block in --dtype just before its forward and again for its
//       recomputed backward (every block is checkpointed; ZeroOptions::compute_dtype), prefetching the
//       next; the other parameters as stage 2. One process trains with plain AdamW. --dtype bf16 runs
//       under bf16 autocast (f32: none). --params bf16 runs the trainer's precision instead: a bf16
//       model (bf16 shards) with AdamW's f32 master weights. Every rank prints one JSON line: the median step time (CUDA
//       events; wall clock on the CPU), its peak allocated memory after the warm-up, the model's parameter
//       elements, and the parameters and optimizer state the rank holds (ZeRO's memory_report). --trace N: rank 0 then records N more steps (every rank runs them) and
//       prints where the GPU time goes and where the collectives ran against the compute (NCCL's
//       kernel time, the part overlapped, the part exposed). The PyTorch twin: reference/fsdp_flux.py.
//   flux_parity saved --config flux-dev-d2 [--latent 32] [--text 64] [--rank 16] [--recompute 0,1] [--device cpu]
//                     [--group op|module|op_and_module] [--json FILE]
//       what the same step keeps for its backward (any device; on the CPU in bf16 the saved tensors
//       are those of the CUDA step): one JSON line per RecomputeCheap setting with
//       autograd_saved_bytes of the loss, the memory live after the forward by the op that made it
//       (--group: and/or by module), and the step's peak above the start. --json FILE also writes
//       the profiler's whole trace of the step to FILE.json (FILE.recompute.json for --recompute 1).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <flame/amp.h>
#include <flame/cuda.h>
#include <flame/cuda/graph_step.h>
#include <flame/dist.h>
#include <flame/flame.h>
#include <flame/io/safetensors.h>
#include <flame/nn.h>
#include <flame/optim.h>
#include <flame/profiler.h>

#include "distributed.h"
#include "models/flux.h"
#include "parity_util.h"

namespace fm = flame_diffusion::models;
using flame::DType;
using flame::Tensor;

namespace {

const char* kUsage =
    "usage:\n"
    "  flux_parity check --dir DIR [--device cuda|cpu] [--checkpointing 0|N|-1]\n"
    "  flux_parity time  --config flux-dev|flux-schnell|flux-dev-d2 [--latent 128] [--text 512] [--batch 1]\n"
    "                    [--checkpointing 0,-1] [--offload 0] [--rank 16] [--steps 10] [--warmup 3] [--trace 0]\n"
    "                    [--recompute 0] [--graph 0] [--fp8 none] [--budget 0] [--offload-blocks -2]\n"
    "                    [--offload-min-mib 1] [--offload-prefetch-mib 0] [--device cuda]\n"
    "  flux_parity losses --config flux-dev [--latent 128] [--text 512] [--rank 16] [--steps 50]\n"
    "                     [--fp8 none,dequantize,fp8] [--swap 0] [--optimizer adamw] [--checkpointing 0] [--lr 1e-3]\n"
    "                     [--device cuda]\n"
    "  flux_parity full --config flux-dev [--latent 128] [--text 512] [--steps 6] [--warmup 2] [--zero 3]\n"
    "                   [--dtype bf16] [--params f32] [--lr 1e-5] [--trace 0] [--prefetch 1] [--timeline 0]\n"
    "                   [--bucket-mb 25] [--device cuda]   (under flame-run: one line per rank)\n"
    "  flux_parity saved --config flux-dev-d2 [--latent 32] [--text 64] [--rank 16] [--recompute 0,1] [--device cpu]\n"
    "                    [--group op|module|op_and_module] [--json FILE]\n";

using flame_diffusion::tools::flag_or;
using flame_diffusion::tools::fp8_modes;
using flame_diffusion::tools::int_list;
using flame_diffusion::tools::parse_device;
using flame_diffusion::tools::print_kernel_trace;

const std::vector<std::string> kFlags = {"dir",   "device", "checkpointing", "config", "latent", "text",
                                         "batch", "rank",   "steps",         "warmup", "trace",  "offload", "recompute",
                                         "group", "json",  "graph", "fp8", "lr", "budget", "swap", "optimizer",
                                         "offload-blocks", "offload-min-mib", "offload-prefetch-mib", "zero", "dtype",
                                         "params", "prefetch", "timeline", "bucket-mb"};

bool report(const std::string& what, const flame_diffusion::tools::ParityError& e, double tol) {
  const bool ok = e.rel <= tol && e.abs == e.abs;
  std::printf("  %-4s %-46s max abs err %.3e  rel %.3e (tol %.0e)\n", ok ? "ok" : "FAIL", what.c_str(), e.abs, e.rel,
              tol);
  return ok;
}

std::string group_of(const std::string& name) {
  const std::string block = name.rfind("single_", 0) == 0 ? "single blocks" : "double blocks";
  return block + (name.find(".lora_A.") != std::string::npos ? " lora_A" : " lora_B");
}

int check(const std::map<std::string, std::string>& f) {
  using flame_diffusion::tools::parity_error;
  const std::filesystem::path dir = flag_or(f, "dir", "");
  if (dir.empty()) throw std::runtime_error(std::string("check needs --dir\n") + kUsage);
  const flame::Device device = parse_device(flag_or(f, "device", "cuda"));
  const int64_t ckpt = int_list("checkpointing", flag_or(f, "checkpointing", "0")).at(0);
  const std::string ref_path = (dir / "reference.safetensors").string();
  const auto meta = flame::io::load_safetensors_metadata(ref_path);
  const DType dtype = meta.at("dtype") == "bfloat16" ? DType::bf16 : DType::f32;
  const bool bf16 = dtype == DType::bf16;
  const double tol_out = bf16 ? 5e-2 : 1e-3, tol_grad = bf16 ? 1e-1 : 1e-2;
  flame::cuda::set_allow_tf32(false);
  const flame::StateDict ref = flame::io::load_safetensors(ref_path, device);
  auto input = [&](const std::string& k) { return ref.at("input." + k); };
  const auto config = fm::flux_config_from_file((dir / "transformer" / "config.json").string());
  std::printf("flux_parity check %s: config %s, %s, latent %sx%s, text %s, device %s, LoRA rank %s alpha %s\n",
              dir.c_str(), meta.at("config").c_str(), bf16 ? "bf16" : "f32", meta.at("height").c_str(),
              meta.at("width").c_str(), meta.at("text").c_str(), device.is_cuda() ? "cuda" : "cpu",
              meta.at("lora_rank").c_str(), meta.at("lora_alpha").c_str());
  struct File {
    std::string name, output;
    bool lora;
  };
  const std::vector<File> files = {{"transformer", "output.sample", true},
                                   {"flux_original.safetensors", "output.sample", true},
                                   {"flux_comfy_fp8.safetensors", "output.fp8_sample", false},
                                   {"flux_fp8_scaled.safetensors", "output.fp8_scaled_sample", false}};
  bool ok = true;
  for (const File& file : files) {
    const std::filesystem::path path = dir / file.name;
    if (!std::filesystem::exists(path) || !ref.contains(file.output)) {
      std::printf(" %s: absent, skipped\n", file.name.c_str());
      continue;
    }
    fm::FluxLoadOptions opts;
    opts.device = device;
    opts.dtype = dtype;
    opts.config = config;
    auto model = fm::load_flux(path.string(), opts);
    model->set_gradient_checkpointing(ckpt);
    auto forward = [&] {
      return model->forward(input("hidden_states"), input("encoder_hidden_states"), input("pooled_projections"),
                            input("timestep"), input("img_ids"), input("txt_ids"),
                            config.guidance_embeds ? input("guidance") : Tensor());
    };
    std::printf(" %s:\n", path.c_str());
    {
      flame::NoGradGuard no_grad;
      ok &= report("output", parity_error(forward(), ref.at(file.output), "flux_parity"), tol_out);
    }
    if (!file.lora) continue;
    model->add_lora({.rank = std::stoll(meta.at("lora_rank")), .alpha = std::stod(meta.at("lora_alpha"))});
    flame::StateDict lora;
    for (const auto& [k, t] : ref) {
      if (k.rfind("lora.", 0) == 0) lora.insert(k.substr(5), t);
    }
    flame::nn::load_lora_state_dict(*model, lora);
    const Tensor out = forward();
    ok &= report("LoRA output", parity_error(out, ref.at("output.lora_sample"), "flux_parity"), tol_out);
    const Tensor loss = flame::mse_loss(out.to(DType::f32), input("target").to(DType::f32));
    ok &= report("loss", parity_error(loss.reshape({1}), ref.at("output.loss"), "flux_parity"), tol_out);
    const flame::Gradients grads = loss.backward();
    std::map<std::string, std::pair<double, double>> groups;  // max abs err, max |ref|
    int64_t n = 0;
    for (const auto& [name, p] : model->named_parameters()) {
      if (!p.requires_grad()) continue;
      const Tensor want = ref.at("grad." + name);
      const auto e = parity_error(grads.get(p), want, "flux_parity");
      auto& g = groups[group_of(name)];
      g.first = std::max(g.first, e.abs);
      g.second = std::max(g.second, want.to(DType::f64).abs().max().item<double>());
      ++n;
    }
    for (const auto& [g, e] : groups) {
      ok &= report("grad " + g, {e.first, e.first / std::max(e.second, 1e-30)}, tol_grad);
    }
    std::printf("  (%lld adapter tensors)\n", static_cast<long long>(n));
  }
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

// ---- timing ----
// FLOPs (multiply-adds x 2) of the LoRA step's forward and backward: the linears twice their forward
// (data gradients only: the frozen weights get no weight gradients; the rank-r adapters are
// negligible), the attention products three times theirs (dS = dO V^T, dQ, dK, dV). Recompute under
// checkpointing is not counted (MFU counts model FLOPs).
double step_flops(const fm::FluxTransformerConfig& c, int64_t b, int64_t latent, int64_t text) {
  const double d = static_cast<double>(c.inner_dim());
  const double l = static_cast<double>(latent / 2) * static_cast<double>(latent / 2), s = static_cast<double>(text);
  const double n = l + s;
  double linear = 2 * l * c.in_channels * d + 2 * s * c.joint_attention_dim * d + 2 * l * d * c.output_channels();
  linear += c.num_layers * (2 * 4 * n * d * d + 2 * 8 * n * d * d);      // q k v + out of both streams; ff
  linear += c.num_single_layers * (2 * 3 * n * d * d + 2 * 4 * n * d * d + 2 * 5 * n * d * d);  // qkv, mlp, out
  const double attention = (c.num_layers + c.num_single_layers) * 2 * 2 * n * n * d;
  return (2 * linear + 3 * attention) * static_cast<double>(b);
}

double gemm_tflops(flame::Device device) {
  const flame::TensorOptions o(DType::bf16, device);
  flame::Generator gen(1);
  const Tensor a = Tensor::randn({8192, 8192}, 0.0, 1.0, o, &gen), b = Tensor::randn({8192, 8192}, 0.0, 1.0, o, &gen);
  const double ms = flame_diffusion::tools::median_ms([&] { (void)flame::matmul(a, b); }, true);
  return 2.0 * 8192.0 * 8192.0 * 8192.0 / (ms / 1e3) / 1e12;
}

// The LoRA r16 training step of `time` and `saved`, as diffusers + peft run it: bf16 weights, f32
// adapters on to_q/k/v/out.0, bf16 autocast, mse loss, AdamW on the adapters; random weights.
struct LoraStep {
  std::shared_ptr<fm::FluxTransformerConfig> config;
  std::shared_ptr<fm::FluxTransformer2DModel> model;
  std::unique_ptr<flame::optim::Optimizer> opt;
  Tensor x, target, ctx, pooled, t, g, img_ids, txt_ids;
  flame::Device device;
  bool recompute = false;

  LoraStep(const fm::FluxTransformerConfig& c, flame::Device dev, int64_t batch, int64_t latent, int64_t text,
           int64_t rank, int64_t checkpointing, bool offload, bool recompute_cheap, bool capturable = false)
      : config(std::make_shared<fm::FluxTransformerConfig>(c)), device(dev), recompute(recompute_cheap) {
    const flame::TensorOptions o(DType::bf16, device);
    model = std::make_shared<fm::FluxTransformer2DModel>(c, o);
    model->add_lora({.rank = rank, .alpha = static_cast<double>(rank)});
    model->set_gradient_checkpointing(checkpointing);
    model->set_activation_offload(offload);
    model->train();
    for (const auto& m : model->modules()) {  // f32 adapters on bf16 weights, as diffusers + peft
      if (auto* lin = dynamic_cast<flame::nn::Linear*>(m.get()); lin && lin->has_lora()) {
        lin->lora_A()->to(DType::f32);
        lin->lora_B()->to(DType::f32);
      }
    }
    flame::TensorList params;
    for (const Tensor& p : model->parameters()) {
      if (p.requires_grad()) params.push_back(p);
    }
    opt = std::make_unique<flame::optim::AdamW>(params,
                                                flame::optim::AdamW::Options{.lr = 1e-4, .capturable = capturable});
    flame::Generator gen(0);
    const int64_t tokens = (latent / 2) * (latent / 2);
    x = Tensor::randn({batch, tokens, c.in_channels}, 0.0, 1.0, o, &gen);
    target = Tensor::randn({batch, tokens, c.output_channels()}, 0.0, 1.0, o, &gen);
    ctx = Tensor::randn({batch, text, c.joint_attention_dim}, 0.0, 1.0, o, &gen);
    pooled = Tensor::randn({batch, c.pooled_projection_dim}, 0.0, 1.0, o, &gen);
    t = Tensor::full({batch}, 0.5, {DType::f32, device});
    g = c.guidance_embeds ? Tensor::full({batch}, 3.5, {DType::f32, device}) : Tensor();
    img_ids = fm::flux_img_ids(latent, latent, device);
    txt_ids = fm::flux_txt_ids(text, device);
  }
  // Forward and loss (the graph is kept for backward()).
  Tensor loss() const {
    Tensor out;
    {
      flame::amp::AutocastGuard autocast(DType::bf16, device.type);
      flame::autograd::RecomputeCheap cheap(recompute);  // Note [Recompute cheap]
      out = model->forward(x, ctx, pooled, t, img_ids, txt_ids, g);
    }
    return flame::mse_loss(out.to(DType::f32), target.to(DType::f32));
  }
  void step() const { opt->step(loss().backward()); }
  // --fp8: every frozen Linear (the whole base; the adapters train) to 8 bits; returns the base
  // Linear weights' bytes after.
  int64_t quantize(const std::string& mode) const {
    if (mode != "none") (void)flame::nn::quantize_float8(*model, {.compute = flame::nn::parse_float8_compute(mode)});
    return flame_diffusion::tools::base_linear_bytes(*model);
  }
};

int time_steps(const std::map<std::string, std::string>& f) {
  const std::string name = flag_or(f, "config", "flux-dev");
  const auto config = fm::flux_preset(name);
  const flame::Device device = parse_device(flag_or(f, "device", "cuda"));
  if (!device.is_cuda()) throw std::runtime_error("time needs --device cuda (CUDA events)");
  const int64_t latent = int_list("latent", flag_or(f, "latent", "128")).at(0);
  const int64_t text = int_list("text", flag_or(f, "text", "512")).at(0);
  const int64_t batch = int_list("batch", flag_or(f, "batch", "1")).at(0);
  const int64_t rank = int_list("rank", flag_or(f, "rank", "16")).at(0);
  const int64_t steps = int_list("steps", flag_or(f, "steps", "10")).at(0);
  const int64_t warmup = int_list("warmup", flag_or(f, "warmup", "3")).at(0);
  const int64_t trace_steps = int_list("trace", flag_or(f, "trace", "0")).at(0);
  const bool offload = int_list("offload", flag_or(f, "offload", "0")).at(0) != 0;
  const int64_t offload_min_mib = int_list("offload-min-mib", flag_or(f, "offload-min-mib", "1")).at(0);
  const int64_t offload_prefetch_mib = int_list("offload-prefetch-mib", flag_or(f, "offload-prefetch-mib", "0")).at(0);
  if (latent % 2 != 0) throw std::runtime_error("--latent must be even");
  const double gemm = gemm_tflops(device);
  std::printf("# bf16 GEMM 8192^3 on this GPU: %.1f TFLOP/s\n", gemm);
  for (int64_t budget_gib : int_list("budget", flag_or(f, "budget", "0"))) {
  for (const std::string& fp8 : fp8_modes(f, "none")) {
  for (int64_t ckpt : int_list("checkpointing", flag_or(f, "checkpointing", "0,-1"))) {
    for (int64_t recompute : int_list("recompute", flag_or(f, "recompute", "0"))) {
    for (int64_t offload_blocks : int_list("offload-blocks", flag_or(f, "offload-blocks", "-2"))) {
    for (int64_t graph : int_list("graph", flag_or(f, "graph", "0"))) {
      flame::cuda::set_memory_limit(0, device.index);
      flame::cuda::empty_cache();
      const LoraStep ls(config, device, batch, latent, text, rank, ckpt, false, recompute != 0, graph != 0);
      ls.model->set_activation_offload(offload, static_cast<std::size_t>(offload_min_mib) << 20, offload_blocks,
                                         static_cast<std::size_t>(offload_prefetch_mib) << 20);
      const int64_t base_bytes = ls.quantize(fp8);
      std::size_t swapped_blocks = 0;
      if (budget_gib > 0) {
        const fm::BudgetPlan plan = fm::fit_vram_budget(*ls.model, device, static_cast<std::size_t>(budget_gib) << 30,
                                                        ckpt < 0, [&] { (void)ls.loss().backward(); },
                                                        fm::optimizer_state_to_come(*ls.opt, device));
        std::printf("# %s\n", plan.str().c_str());
        swapped_blocks = plan.swap.swapped;
      }
      flame::cuda::synchronize(device.index);
      flame::cuda::empty_cache(device.index);
      std::size_t reserved_peak = 0;
      // --graph 1: the whole step (forward, backward, AdamW) as one CUDA graph after one eager step
      // (flame::cuda::GraphedStep, docs/graph-step.md); the warm-up steps cover the capture.
      flame::cuda::GraphedStep graphed([&] { ls.step(); },
                                       {.warmup_steps = 1, .device = device.index, .enabled = graph != 0});
      auto step = [&] {
        graphed();
        reserved_peak = std::max(reserved_peak, flame::cuda::memory_stats(device.index).reserved_bytes);
      };
      const flame_diffusion::tools::StepTimes times = flame_diffusion::tools::time_cuda_steps(step, warmup, steps);
      const double median = times.median_ms, peak = times.peak_gib;
      const double flops = step_flops(config, batch, latent, text);
      const double rate = flops / (median / 1e3) / 1e12;
      std::printf("{\"impl\": \"flame\", \"work\": \"%s_lora_r%lld_step\", \"latent\": %lld, \"text\": %lld, "
                  "\"batch\": %lld, \"checkpointed_blocks\": %lld, \"recompute_cheap\": %s, \"cuda_graph\": %s, \"graph_pool_gib\": %.3f, "
                  "\"offload_blocks\": %lld, \"offloaded_gib\": %.3f, "
                  "\"median_ms\": %.2f, \"peak_gib\": %.3f, \"tflop_per_step\": %.2f, \"mfu_vs_989\": %.3f, "
                  "\"mfu_vs_gemm\": %.3f, \"fp8\": \"%s\", \"base_linear_gib\": %.3f, \"budget_gib\": %lld, "
                  "\"swapped_blocks\": %zu, \"reserved_peak_gib\": %.3f}\n",
                  name.c_str(), static_cast<long long>(rank), static_cast<long long>(latent),
                  static_cast<long long>(text), static_cast<long long>(batch),
                  static_cast<long long>(ls.model->gradient_checkpointing_blocks()), recompute ? "true" : "false",
                  graphed.captured() ? "true" : "false",
                  static_cast<double>(flame::cuda::memory_stats().graph_pool_bytes) / (1u << 30),
                  static_cast<long long>(offload ? offload_blocks : 0),
                  static_cast<double>(ls.model->offloaded_bytes()) / (1u << 30), median, peak, flops / 1e12,
                  rate / 989.0, rate / gemm, fp8.c_str(), static_cast<double>(base_bytes) / (1u << 30),
                  static_cast<long long>(budget_gib), swapped_blocks, static_cast<double>(reserved_peak) / (1u << 30));
      std::fflush(stdout);
      if (trace_steps > 0) print_kernel_trace(step, trace_steps);
    }
    }
    }
  }
  }
  }
  flame::cuda::set_memory_limit(0, device.index);
  return 0;
}

// The loss at every step of each --fp8 mode from the same start (seeded weights, adapters and data).
int losses(const std::map<std::string, std::string>& f) {
  const std::string name = flag_or(f, "config", "flux-dev");
  const auto config = fm::flux_preset(name);
  const flame::Device device = parse_device(flag_or(f, "device", "cuda"));
  const int64_t latent = int_list("latent", flag_or(f, "latent", "128")).at(0);
  const int64_t text = int_list("text", flag_or(f, "text", "512")).at(0);
  const int64_t rank = int_list("rank", flag_or(f, "rank", "16")).at(0);
  const int64_t steps = int_list("steps", flag_or(f, "steps", "50")).at(0);
  const int64_t ckpt = int_list("checkpointing", flag_or(f, "checkpointing", "0")).at(0);
  if (latent % 2 != 0) throw std::runtime_error("--latent must be even");
  if (steps < 1) throw std::runtime_error("--steps must be at least 1");
  const double lr = std::stod(flag_or(f, "lr", "1e-3"));
  std::vector<std::string> optimizers;
  for (const std::string& o : flame_diffusion::tools::split_list(flag_or(f, "optimizer", "adamw"))) {
    if (o != "adamw" && o != "adamw8bit") throw std::runtime_error("--optimizer: adamw or adamw8bit, got " + o);
    optimizers.push_back(o);
  }
  std::vector<double> base;
  for (const std::string& fp8 : fp8_modes(f, "none,dequantize,fp8")) {
  for (int64_t swapped : int_list("swap", flag_or(f, "swap", "0"))) {
  for (const std::string& optimizer : optimizers) {
    if (device.is_cuda()) flame::cuda::empty_cache();
    flame::manual_seed(1234);  // the same weights and adapters in every mode
    LoraStep ls(config, device, 1, latent, text, rank, ckpt, false, false);
    (void)ls.quantize(fp8);
    if (swapped > 0) {  // --swap N: N blocks' frozen weights in host memory, spread over the stack
      auto& sw = ls.model->enable_block_swap(device);
      sw.set_swapped(flame::offload::spread_blocks(sw.size(), static_cast<std::size_t>(swapped)));
    }
    if (optimizer == "adamw8bit") {
      flame::TensorList params;
      for (const Tensor& p : ls.model->parameters()) {
        if (p.requires_grad()) params.push_back(p);
      }
      ls.opt = std::make_unique<flame::optim::AdamW8bit>(params);
    }
    ls.opt->set_lr(lr);
    std::vector<double> l;
    for (int64_t i = 0; i < steps; ++i) {
      const Tensor loss = ls.loss();
      l.push_back(loss.item<double>());
      ls.opt->step(loss.backward());
    }
    double worst = 0.0;
    if (base.empty()) base = l;  // the first run is the baseline
    else if (base.size() == l.size())
      for (std::size_t i = 0; i < l.size(); ++i) worst = std::max(worst, std::abs(l[i] - base[i]) / std::abs(base[i]));
    std::string list;
    for (double v : l) list += (list.empty() ? "" : ", ") + std::to_string(v);
    std::printf("{\"work\": \"%s_lora_r%lld_losses\", \"fp8\": \"%s\", \"swapped_blocks\": %lld, \"optimizer\": \"%s\", "
                "\"steps\": %lld, \"max_rel_diff_vs_first\": %.5f, \"first\": %.6f, \"last\": %.6f, \"losses\": [%s]}\n",
                name.c_str(), static_cast<long long>(rank), fp8.c_str(), static_cast<long long>(swapped),
                optimizer.c_str(), static_cast<long long>(steps), worst, l.front(), l.back(), list.c_str());
    std::fflush(stdout);
  }
  }
  }
  return 0;
}

// ---- saved activations (any device; the CPU gives the CUDA bf16 step's saved tensors) ----
// What the step keeps for its backward: autograd_saved_bytes of the loss and the memory live after
// the forward by the op that made it (profiler::MemoryProfiler), per RecomputeCheap setting.
int saved(const std::map<std::string, std::string>& f) {
  const std::string name = flag_or(f, "config", "flux-dev-d2");
  const auto config = fm::flux_preset(name);
  const flame::Device device = parse_device(flag_or(f, "device", "cpu"));
  const int64_t latent = int_list("latent", flag_or(f, "latent", "32")).at(0);
  const int64_t text = int_list("text", flag_or(f, "text", "64")).at(0);
  const int64_t rank = int_list("rank", flag_or(f, "rank", "16")).at(0);
  if (latent % 2 != 0) throw std::runtime_error("--latent must be even");
  const std::string group = flag_or(f, "group", "op");
  flame::profiler::GroupBy by = flame::profiler::GroupBy::op;
  if (group == "module") by = flame::profiler::GroupBy::module;
  else if (group == "op_and_module") by = flame::profiler::GroupBy::op_and_module;
  else if (group != "op") throw std::runtime_error("--group must be op, module or op_and_module, not '" + group + "'");
  // The fused attention saves what the CUDA step saves (outputs and row statistics, no weights).
  flame::nn::functional::SdpaBackendGuard fused(flame::nn::functional::SdpaBackend::fused);
  for (int64_t recompute : int_list("recompute", flag_or(f, "recompute", "0,1"))) {
    const LoraStep ls(config, device, 1, latent, text, rank, 0, false, recompute != 0);
    flame::profiler::MemoryProfiler prof;
    std::size_t saved_bytes = 0, forward_bytes = 0, peak = 0;
    std::vector<flame::profiler::MemoryGroup> groups;
    {
      flame::profiler::MemoryProfileScope scope(prof);
      const Tensor loss = ls.loss();
      saved_bytes = flame::autograd_saved_bytes(loss);
      for (const auto& s : prof.summary()) {
        if (s.device == device) forward_bytes = s.end_bytes - s.start_bytes;
      }
      groups = prof.live_groups(device, by);
      (void)loss.backward();
    }
    for (const auto& s : prof.summary()) {
      if (s.device == device) peak = s.peak_bytes - s.start_bytes;
    }
    if (f.count("json")) {  // the whole trace (docs/profiling.md), one file per --recompute value
      const std::string path = f.at("json") + (recompute ? ".recompute.json" : ".json");
      prof.save_json(path);
      std::fprintf(stderr, "flux_parity saved: memory profile in %s\n", path.c_str());
    }
    std::string by_group;
    for (const auto& g : groups) {
      if (g.phase == "before") continue;  // held since before the forward (weights, inputs)
      const std::string key = by == flame::profiler::GroupBy::op       ? g.op
                              : by == flame::profiler::GroupBy::module ? g.module
                                                                       : g.op + " @ " + g.module;
      by_group += (by_group.empty() ? "" : ", ") + std::string("\"") + key + "\": " + std::to_string(g.bytes);
    }
    std::printf("{\"impl\": \"flame\", \"work\": \"%s_lora_r%lld_saved\", \"latent\": %lld, \"text\": %lld, "
                "\"recompute_cheap\": %s, \"saved_bytes\": %zu, \"forward_live_bytes\": %zu, "
                "\"step_peak_above_start_bytes\": %zu, \"forward_live_by_%s\": {%s}}\n",
                name.c_str(), static_cast<long long>(rank), static_cast<long long>(latent),
                static_cast<long long>(text), recompute ? "true" : "false", saved_bytes, forward_bytes, peak,
                group.c_str(), by_group.c_str());
    std::fflush(stdout);
  }
  return 0;
}

// ZeRO's wait timeline of one step (Note [ZeRO wait timeline]): where the compute stream stood
// waiting for a collective, against the step's span from CUDA events on the same stream.
void print_wait_timeline(const std::vector<flame::dist::ZeroRedundancyOptimizer::WaitRecord>& waits, double step_ms) {
  double total = 0, fwd = 0, bwd = 0, red = 0;
  for (const auto& w : waits) {
    total += w.waited_ms;
    if (w.what.find("forward") != std::string::npos) fwd += w.waited_ms;
    else if (w.what.find("backward") != std::string::npos) bwd += w.waited_ms;
    else red += w.waited_ms;
  }
  std::printf("# collectives waited for: %zu waits, %.2f ms of the %.2f ms step exposed (gathers: forward %.2f ms, "
              "backward %.2f ms; reductions at the step %.2f ms)\n",
              waits.size(), total, step_ms, fwd, bwd, red);
  if (waits.empty()) return;
  const auto& first = waits.front();
  const auto& last = waits.back();
  std::printf("# first: %s at %.2f ms, waited %.3f ms; last: %s at %.2f ms, waited %.3f ms\n", first.what.c_str(),
              first.at_ms, first.waited_ms, last.what.c_str(), last.at_ms, last.waited_ms);
  std::vector<flame::dist::ZeroRedundancyOptimizer::WaitRecord> by = waits;
  std::sort(by.begin(), by.end(), [](const auto& a, const auto& b) { return a.waited_ms > b.waited_ms; });
  for (std::size_t i = 0; i < by.size() && i < 5; ++i)
    std::printf("#   %8.3f ms  %s at %.2f ms\n", by[i].waited_ms, by[i].what.c_str(), by[i].at_ms);
  std::fflush(stdout);
}

// ---- full fine-tuning on the ranks of a flame-run job (#33's comparison with FSDP2) ----
int full(const std::map<std::string, std::string>& f) {
  const std::string name = flag_or(f, "config", "flux-dev");
  const auto config = fm::flux_preset(name);
  const int64_t latent = int_list("latent", flag_or(f, "latent", "128")).at(0);
  const int64_t text = int_list("text", flag_or(f, "text", "512")).at(0);
  const int64_t steps = int_list("steps", flag_or(f, "steps", "6")).at(0);
  const int64_t warmup = int_list("warmup", flag_or(f, "warmup", "2")).at(0);
  const int64_t zero = int_list("zero", flag_or(f, "zero", "3")).at(0);
  const int64_t trace_steps = int_list("trace", flag_or(f, "trace", "0")).at(0);
  const std::string dtype_flag = flag_or(f, "dtype", "bf16");
  const double lr = std::stod(flag_or(f, "lr", "1e-5"));
  // --prefetch 0: each block's all-gather starts only when the block runs (no overlap with the
  // previous block's compute): the step time with it off shows what the prefetch hides.
  const bool prefetch = int_list("prefetch", flag_or(f, "prefetch", "1")).at(0) != 0;
  // --timeline 1: one more step with ZeRO's wait timeline on (Note [ZeRO wait timeline]): where the
  // compute stream waited for the collectives, from CUDA events on that stream.
  const bool timeline = int_list("timeline", flag_or(f, "timeline", "0")).at(0) != 0;
  // --bucket-mb: ZeroOptions::bucket_cap_mb (stage 3: a block's parameters form buckets of their own
  // of at most this size, each one all-gather and one reduce-scatter; 2000 makes one per block, as
  // FSDP2's fully_shard per block does).
  const double bucket_mb = std::stod(flag_or(f, "bucket-mb", "25"));
  if (!(bucket_mb > 0)) throw std::runtime_error("--bucket-mb must be positive");
  if (latent % 2 != 0 || latent <= 0 || text <= 0) throw std::runtime_error("--latent must be even and positive, --text positive");
  if (zero < 0 || zero > 3) throw std::runtime_error("--zero must be 0, 1, 2 or 3, got " + std::to_string(zero));
  if (dtype_flag != "bf16" && dtype_flag != "f32") throw std::runtime_error("--dtype must be bf16 or f32, got " + dtype_flag);
  if (steps <= 0 || warmup < 0) throw std::runtime_error("--steps must be positive and --warmup not negative");
  const bool low = dtype_flag == "bf16";
  // --params bf16: the trainer's full fine-tuning (a bf16 model, bf16 shards, AdamW's f32 master
  // weights of them); f32 (the default): f32 shards gathered in bf16, FSDP2's MixedPrecisionPolicy.
  const std::string params_flag = flag_or(f, "params", "f32");
  if (params_flag != "f32" && params_flag != "bf16") throw std::runtime_error("--params must be f32 or bf16, got " + params_flag);
  if (params_flag == "bf16" && !low) throw std::runtime_error("--params bf16 needs --dtype bf16");
  const DType param_dtype = params_flag == "bf16" ? DType::bf16 : DType::f32;
  const flame::Device device = flame_diffusion::init_distributed(parse_device(flag_or(f, "device", "cuda")));
  const int world = flame_diffusion::dist_world(), rank = flame_diffusion::dist_rank();
  const int64_t stage = world > 1 ? zero : 0;
  if (trace_steps > 0 && !device.is_cuda()) throw std::runtime_error("--trace needs --device cuda");

  const flame::TensorOptions o(DType::f32, device);
  auto model = std::make_shared<fm::FluxTransformer2DModel>(config, flame::TensorOptions(param_dtype, device));
  model->train();
  const flame::TensorList params = model->parameters();
  int64_t elements = 0;
  for (const Tensor& p : params) elements += p.numel();
  const flame::optim::AdamWOptions adamw{.lr = lr};
  std::unique_ptr<flame::optim::Optimizer> opt;
  flame::dist::ZeroRedundancyOptimizer* sharded = nullptr;
  if (stage > 0) {
    flame::dist::ZeroOptions zo;
    zo.stage = static_cast<int>(stage);
    zo.prefetch = prefetch;
    zo.bucket_cap_mb = bucket_mb;
    if (stage == 3) {
      zo.blocks = model->stack_blocks();
      if (low && param_dtype == DType::f32) zo.compute_dtype = DType::bf16;
    }
    auto z = std::make_unique<flame::dist::ZeroRedundancyOptimizer>(
        std::vector<flame::optim::ParamGroup>{adamw.group(params)},
        [&](std::vector<flame::optim::ParamGroup> groups) -> std::unique_ptr<flame::optim::Optimizer> {
          return std::make_unique<flame::optim::AdamW>(std::move(groups), adamw);
        },
        nullptr, zo);
    sharded = z.get();
    opt = std::move(z);
    if (stage == 3) {
      model->set_block_runner([sharded](std::size_t i, const std::function<Tensor(const flame::TensorList&)>& fn,
                                        const flame::TensorList& in) { return sharded->run_block(i, fn, in); });
    }
  } else {
    opt = std::make_unique<flame::optim::AdamW>(std::vector<flame::optim::ParamGroup>{adamw.group(params)}, adamw);
  }

  flame::Generator gen(1000 + static_cast<uint64_t>(rank));
  const int64_t tokens = (latent / 2) * (latent / 2);
  const Tensor x = Tensor::randn({1, tokens, config.in_channels}, 0.0, 1.0, o, &gen);
  const Tensor target = Tensor::randn({1, tokens, config.output_channels()}, 0.0, 1.0, o, &gen);
  const Tensor ctx = Tensor::randn({1, text, config.joint_attention_dim}, 0.0, 1.0, o, &gen);
  const Tensor pooled = Tensor::randn({1, config.pooled_projection_dim}, 0.0, 1.0, o, &gen);
  const Tensor t = Tensor::full({1}, 0.5, o);
  const Tensor g = config.guidance_embeds ? Tensor::full({1}, 3.5, o) : Tensor();
  const Tensor img_ids = fm::flux_img_ids(latent, latent, device), txt_ids = fm::flux_txt_ids(text, device);
  auto step = [&] {
    Tensor out;
    {
      flame::amp::AutocastGuard autocast(low, device.type);
      out = model->forward(x, ctx, pooled, t, img_ids, txt_ids, g);
    }
    opt->step(flame::mse_loss(out.to(DType::f32), target).backward());
  };
  double median = 0, peak_gib = 0;
  if (device.is_cuda()) {
    const flame_diffusion::tools::StepTimes times =
        flame_diffusion::tools::time_cuda_steps(step, warmup, steps, device.index);
    median = times.median_ms;
    peak_gib = times.peak_gib;
  } else {
    for (int64_t i = 0; i < warmup; ++i) step();
    std::vector<double> ms;
    for (int64_t i = 0; i < steps; ++i) {
      const auto a = std::chrono::steady_clock::now();
      step();
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
    }
    std::sort(ms.begin(), ms.end());
    median = ms[ms.size() / 2];
  }
  // What the optimizer holds on this rank (ZeRO's accounting; one process: the whole model's).
  const double element_bytes = static_cast<double>(flame::dtype_size(param_dtype));
  double param_gib = static_cast<double>(elements) * element_bytes / (1u << 30);
  double state_gib = static_cast<double>(elements) * (param_dtype == DType::f32 ? 8.0 : 12.0) / (1u << 30);  // moments (+ masters)
  if (sharded) {
    const auto mem = sharded->memory_report();
    param_gib = static_cast<double>(mem.parameter_bytes) / (1u << 30);
    state_gib = static_cast<double>(mem.state_bytes) / (1u << 30);
  }
  std::printf("{\"impl\": \"flame\", \"work\": \"%s_full_step\", \"rank\": %d, \"world\": %d, \"zero_stage\": %lld, "
              "\"dtype\": \"%s\", \"params\": \"%s\", \"prefetch\": %s, \"bucket_mb\": %g, \"latent\": %lld, \"text\": %lld, \"median_ms\": %.2f, "
              "\"peak_gib\": %.3f, "
              "\"parameters\": %lld, \"parameters_held_gib\": %.3f, \"optimizer_state_gib\": %.3f, \"device\": \"%s\"}\n",
              name.c_str(), rank, world, static_cast<long long>(stage), dtype_flag.c_str(), params_flag.c_str(),
              prefetch ? "true" : "false", bucket_mb, static_cast<long long>(latent),
              static_cast<long long>(text), median, peak_gib, static_cast<long long>(elements), param_gib, state_gib,
              device.str().c_str());
  std::fflush(stdout);
  if (timeline && sharded && device.is_cuda()) {
    flame::cuda::Event a(true), b(true);
    sharded->set_wait_timeline(true);
    a.record();
    step();
    b.record();
    const auto waits = sharded->wait_timeline();
    sharded->set_wait_timeline(false);
    b.synchronize();
    if (rank == 0) print_wait_timeline(waits, a.elapsed_time(b));
  }
  if (trace_steps > 0) {
    if (rank == 0) {
      print_kernel_trace(step, trace_steps);
    } else {
      for (int64_t i = 0; i < trace_steps; ++i) step();
    }
  }
  flame_diffusion::dist_barrier();
  flame_diffusion::finish_distributed();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return flame_diffusion::tools::run_tool(argc, argv, "flux_parity", kUsage, kFlags,
                                          {{"check", check}, {"time", time_steps}, {"saved", saved}, {"losses", losses}, {"full", full}});
}
