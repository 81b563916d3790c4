// unet_parity: FLAME's UNet2DConditionModel against diffusers' (apps/diffusion/reference/models_unet.py).
//
//   unet_parity check --dir DIR [--device cuda|cpu] [--checkpointing 0|1]
//       DIR as models_unet.py writes it (unet/ diffusers folder, unet_original.safetensors,
//       reference.safetensors). For each format that is there: loads the model (in the reference's
//       dtype), runs the forward on the stored inputs, adds the LoRA (stored weights, rank/alpha from
//       the metadata), runs forward + mse loss + backward, and prints max abs and max relative
//       (max |err| / max |ref|) errors for the output, the LoRA output, the loss and the adapter
//       gradients (per group: down / mid / up blocks, A and B), then one PASS or FAIL line.
//       Tolerances (relative): f32 1e-3 outputs, 1e-2 gradients; bf16 5e-2 and 1e-1.
//   unet_parity time --config sdxl [--latent 128] [--batch 1,4] [--checkpointing 0,1] [--recompute 0]
//                    [--graph 0] [--trace 0] [--adapters bf16] [--rank 16] [--steps 10] [--warmup 3] [--device cuda]
//       the bf16 LoRA training step (random weights, AdamW on the adapters, mse loss) timed with
//       CUDA events: one JSON line per (batch, checkpointing, recompute) with the median step time,
//       the peak allocated memory and MFU (step_flops: convolutions and linears 2x their forward,
//       attention 3x; of 989 TFLOP/s dense bf16).
//       --recompute 1 runs the forward under autograd::RecomputeCheap (set_recompute_cheap).
//       --fp8 none,dequantize,fp8 stores the frozen Linear weights in 8 bits (nn::quantize_float8,
//       docs/float8.md; the convolutions stay bf16); the JSON line names the mode.
//       --graph 1 captures the whole step (forward, backward, capturable AdamW) once as a CUDA graph
//       (cuda::GraphedStep) and replays it; its peak counts the graph's private pool.
//       --trace N records the kernels of N more steps (profiler::KernelTrace) and prints where the
//       GPU time goes, and where the GPU sat idle (parity_util.h print_idle_time).
//       --adapters f32 runs the trainer's precision (f32 adapters, the forward under bf16 autocast),
//       as models_unet.py --time --adapters f32 does.
//   unet_parity saved --config sdxl [--latent 32] [--batch 1] [--recompute 0,1] [--rank 16]
//                     [--dtype bf16|f32] [--adapters bf16|f32] [--device cpu]
//       what the LoRA training step keeps for its backward, measured where no GPU is needed: one
//       JSON line per recompute setting with autograd_saved_bytes of the loss, the memory the
//       forward left allocated (the memory profiler) grouped by the op that allocated it, and the
//       step's peak above the weights (forward + backward). Attention takes the fused path (on
//       the CPU its reference), whose saved tensors are those of the CUDA bf16 step. --adapters f32
//       runs the trainer's precision: f32 adapters on the bf16 model, the forward under bf16 autocast.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <flame/cuda.h>
#include <flame/cuda/graph_step.h>
#include <flame/flame.h>
#include <flame/io/safetensors.h>
#include <flame/amp.h>
#include <flame/nn.h>
#include <flame/optim.h>
#include <flame/profiler.h>

#include "models/unet2d.h"
#include "models/unet2d_convert.h"
#include "parity_util.h"

namespace fm = flame_diffusion::models;
using flame::DType;
using flame::Tensor;

namespace {

const char* kUsage =
    "usage:\n"
    "  unet_parity check --dir DIR [--device cuda|cpu] [--checkpointing 0|1]\n"
    "  unet_parity time  --config sdxl|sd15|sd21 [--latent 128] [--batch 1,4] [--checkpointing 0,1] [--recompute 0]\n"
    "                    [--graph 0,1] [--trace N] [--fp8 none] [--adapters bf16|f32]\n"
    "                    [--rank 16] [--steps 10] [--warmup 3] [--device cuda]\n"
    "  unet_parity saved --config sdxl|sd15|sd21 [--latent 32] [--batch 1] [--recompute 0,1] [--rank 16]\n"
    "                    [--dtype bf16|f32] [--adapters bf16|f32] [--device cpu]\n";

const std::vector<std::string> kFlags = {"dir",  "device", "checkpointing", "config", "latent", "batch", "rank",
                                          "steps", "warmup", "recompute", "dtype", "graph", "trace", "fp8", "adapters"};

using flame_diffusion::tools::int_list;
using flame_diffusion::tools::parse_device;
using flame_diffusion::tools::print_kernel_trace;
std::string get(const std::map<std::string, std::string>& f, const std::string& k, const std::string& fallback) {
  return flame_diffusion::tools::flag_or(f, k, fallback);
}

struct Err {
  double abs = 0, ref = 0;
  double rel() const { return ref > 0 ? abs / ref : abs; }
};
Err error_of(const Tensor& got, const Tensor& want) {
  const Tensor g = got.to(DType::f64, flame::Device::cpu()), w = want.to(DType::f64, flame::Device::cpu());
  if (g.sizes() != w.sizes()) throw std::runtime_error("shape mismatch between FLAME's result and the reference");
  return {(g - w).abs().max().item<double>(), w.abs().max().item<double>()};
}

bool report(const std::string& what, const Err& e, double tol) {
  const bool ok = e.rel() <= tol && e.abs == e.abs;
  std::printf("  %-4s %-44s max abs err %.3e  max|ref| %.3e  rel %.3e (tol %.0e)\n", ok ? "ok" : "FAIL", what.c_str(),
              e.abs, e.ref, e.rel(), tol);
  return ok;
}

std::string group_of(const std::string& name) {
  const std::string block = name.substr(0, name.find('.'));
  const std::string ab = name.find(".lora_A.") != std::string::npos ? "A" : "B";
  return block + " lora_" + ab;
}

int check(const std::map<std::string, std::string>& f) {
  const std::filesystem::path dir = get(f, "dir", "");
  if (dir.empty()) throw std::runtime_error(std::string("check needs --dir\n") + kUsage);
  const flame::Device device = parse_device(get(f, "device", "cuda"));
  const bool ckpt = get(f, "checkpointing", "0") == "1";
  const std::string ref_path = (dir / "reference.safetensors").string();
  const auto meta = flame::io::load_safetensors_metadata(ref_path);
  const DType dtype = meta.at("dtype") == "bfloat16" ? DType::bf16 : DType::f32;
  const bool bf16 = dtype == DType::bf16;
  const double tol_out = bf16 ? 5e-2 : 1e-3, tol_grad = bf16 ? 1e-1 : 1e-2;
  flame::cuda::set_allow_tf32(false);
  flame::cuda::set_allow_conv_tf32(false);
  const flame::StateDict ref = flame::io::load_safetensors(ref_path, device);
  auto input = [&](const std::string& k) { return ref.at("input." + k); };
  fm::UNet2DAddedConditions added;
  if (ref.contains("input.text_embeds")) added = {input("text_embeds"), input("time_ids")};
  const auto config = fm::unet2d_config_from_file((dir / "unet" / "config.json").string());
  std::printf("unet_parity check %s: config %s, %s, latent %s, device %s, LoRA rank %s alpha %s\n", dir.c_str(),
              meta.at("config").c_str(), bf16 ? "bf16" : "f32", meta.at("latent").c_str(), device.is_cuda() ? "cuda" : "cpu",
              meta.at("lora_rank").c_str(), meta.at("lora_alpha").c_str());
  bool ok = true;
  for (const std::string format : {"diffusers", "original"}) {
    const std::filesystem::path path = format == "diffusers" ? dir : dir / "unet_original.safetensors";
    if (format == "original" && !std::filesystem::exists(path)) {
      std::printf(" %s: %s absent, skipped\n", format.c_str(), path.c_str());
      continue;
    }
    fm::UNetLoadOptions opts;
    opts.device = device;
    opts.dtype = dtype;
    opts.config = config;
    auto unet = fm::load_unet(path.string(), opts);
    unet->set_gradient_checkpointing(ckpt);
    std::printf(" %s (%s):\n", format.c_str(), path.c_str());
    {
      flame::NoGradGuard no_grad;
      const Tensor out = unet->forward(input("sample"), input("timestep"), input("encoder_hidden_states"), added);
      ok &= report("output", error_of(out, ref.at("output.sample")), tol_out);
    }
    unet->add_lora({.rank = std::stoll(meta.at("lora_rank")), .alpha = std::stod(meta.at("lora_alpha"))});
    flame::StateDict lora;
    for (const auto& [k, t] : ref) {
      if (k.rfind("lora.", 0) == 0) lora.insert(k.substr(5), t);
    }
    flame::nn::load_lora_state_dict(*unet, lora);
    const Tensor out = unet->forward(input("sample"), input("timestep"), input("encoder_hidden_states"), added);
    ok &= report("LoRA output", error_of(out, ref.at("output.lora_sample")), tol_out);
    const Tensor loss = flame::mse_loss(out.to(DType::f32), input("target").to(DType::f32));
    ok &= report("loss", error_of(loss.reshape({1}), ref.at("output.loss")), tol_out);
    const flame::Gradients grads = loss.backward();
    std::map<std::string, Err> groups;
    Err all;
    int64_t n = 0;
    for (const auto& [name, p] : unet->named_parameters()) {
      if (!p.requires_grad()) continue;
      const Err e = error_of(grads.get(p), ref.at("grad." + name));
      Err& g = groups[group_of(name)];
      g.abs = std::max(g.abs, e.abs);
      g.ref = std::max(g.ref, e.ref);
      all.abs = std::max(all.abs, e.abs);
      all.ref = std::max(all.ref, e.ref);
      ++n;
    }
    for (const auto& [g, e] : groups) ok &= report("grad " + g, e, tol_grad);
    ok &= report("grad all (" + std::to_string(n) + " adapter tensors)", all, tol_grad);
  }
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

// ---- timing ----
// FLOPs (multiply-adds x 2) of the LoRA step's forward and backward, as flux_parity counts them:
// the convolutions and linears twice their forward (data gradients only: the frozen weights get
// no weight gradients), the attention products three times theirs. Recompute not counted.
double step_flops(const fm::UNet2DConditionConfig& c, int64_t b, int64_t h, int64_t w, int64_t seq) {
  double f = 0, attention = 0;
  auto conv = [&](int64_t hh, int64_t ww, int64_t in, int64_t out, int64_t k) { f += 2.0 * b * hh * ww * in * out * k * k; };
  auto resnet = [&](int64_t hh, int64_t ww, int64_t in, int64_t out) {
    conv(hh, ww, in, out, 3);
    conv(hh, ww, out, out, 3);
    if (in != out) conv(hh, ww, in, out, 1);
  };
  auto transformer = [&](int64_t hh, int64_t ww, int64_t ch, int64_t layers, int64_t cross) {
    const double n = static_cast<double>(hh) * ww;
    f += 2 * 2.0 * b * n * ch * ch;  // proj_in, proj_out
    for (int64_t l = 0; l < layers; ++l) {
      f += 2.0 * b * n * ch * ch * 4;                                        // self-attention q, k, v, out
      attention += 2 * 2.0 * b * n * n * ch;                                 // its scores and values
      f += 2.0 * b * n * ch * ch * 2 + 2 * 2.0 * b * seq * cross * ch;       // cross q, out; k, v
      attention += 2 * 2.0 * b * n * seq * ch;                               // cross scores, values
      f += 2.0 * b * n * ch * 8 * ch + 2.0 * b * n * 4 * ch * ch;            // GEGLU feed-forward
    }
  };
  const int64_t n = c.num_blocks();
  conv(h, w, c.in_channels, c.block_out_channels[0], 3);
  int64_t ch = c.block_out_channels[0], hh = h, ww = w;
  std::vector<int64_t> skips{ch};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t out = c.block_out_channels[i];
    for (int64_t j = 0; j < c.layers_per_block[i]; ++j) {
      resnet(hh, ww, j ? out : ch, out);
      if (c.down_block_types[i] == "CrossAttnDownBlock2D")
        transformer(hh, ww, out, c.transformer_layers_per_block[i], c.cross_attention_dim[i]);
      skips.push_back(out);
    }
    ch = out;
    if (i + 1 < n) {
      hh = (hh + 1) / 2;
      ww = (ww + 1) / 2;
      conv(hh, ww, out, out, 3);
      skips.push_back(out);
    }
  }
  resnet(hh, ww, ch, ch);
  transformer(hh, ww, ch, c.transformer_layers_per_block.back(), c.cross_attention_dim.back());
  resnet(hh, ww, ch, ch);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = n - 1 - i, out = c.block_out_channels[r];
    for (int64_t j = 0; j < c.layers_per_block[r] + 1; ++j) {
      const int64_t skip = skips.back();
      skips.pop_back();
      resnet(hh, ww, ch + skip, out);
      if (c.up_block_types[i] == "CrossAttnUpBlock2D")
        transformer(hh, ww, out, c.transformer_layers_per_block[r], c.cross_attention_dim[r]);
      ch = out;
    }
    if (i + 1 < n) {
      hh *= 2;
      ww *= 2;
      conv(hh, ww, out, out, 3);
    }
  }
  conv(h, w, c.block_out_channels[0], c.out_channels, 3);
  return 2 * f + 3 * attention;
}

// The training step's random inputs (SDXL's added conditions for an image 8x the latent).
constexpr int64_t kTextTokens = 77;
struct StepInputs {
  Tensor x, target, t, ctx;
  fm::UNet2DAddedConditions added;
  Tensor forward(fm::UNet2DConditionModel& unet) const { return unet.forward(x, t, ctx, added); }
};
StepInputs step_inputs(const fm::UNet2DConditionConfig& config, int64_t batch, int64_t latent,
                       const flame::TensorOptions& o) {
  flame::Generator gen(0);
  StepInputs in;
  in.x = Tensor::randn({batch, config.in_channels, latent, latent}, 0.0, 1.0, o, &gen);
  in.target = Tensor::randn({batch, config.out_channels, latent, latent}, 0.0, 1.0, o, &gen);
  in.t = Tensor::full({batch}, 500.0, {DType::f32, o.device});
  in.ctx = Tensor::randn({batch, kTextTokens, config.cross_attention_dim[0]}, 0.0, 1.0, o, &gen);
  if (config.addition_embed_type == "text_time") {
    in.added.text_embeds = Tensor::randn(
        {batch, config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim}, 0.0, 1.0, o, &gen);
    in.added.time_ids = Tensor::full({batch, 6}, static_cast<double>(8 * latent), {DType::f32, o.device});
  }
  return in;
}

// --adapters f32: the trainer's precision (diffusers' scripts): f32 adapters on the bf16 model, the
// forward under bf16 autocast. bf16 (the default): everything bf16, no autocast. True for f32.
bool f32_adapters_flag(const std::map<std::string, std::string>& f) {
  const std::string a = get(f, "adapters", "bf16");
  if (a != "bf16" && a != "f32") throw std::runtime_error("--adapters must be bf16 or f32, got '" + a + "'");
  return a == "f32";
}

int time_steps(const std::map<std::string, std::string>& f) {
  const std::string name = get(f, "config", "sdxl");
  const auto config = fm::unet2d_preset(name);
  const flame::Device device = parse_device(get(f, "device", "cuda"));
  if (!device.is_cuda()) throw std::runtime_error("time needs --device cuda (CUDA events)");
  const int64_t latent = int_list("latent", get(f, "latent", "128")).at(0);
  const int64_t rank = int_list("rank", get(f, "rank", "16")).at(0);
  const int64_t steps = int_list("steps", get(f, "steps", "10")).at(0);
  const int64_t warmup = int_list("warmup", get(f, "warmup", "3")).at(0);
  const int64_t seq = kTextTokens;
  const flame::TensorOptions o(DType::bf16, device);
  const std::vector<int64_t> recomputes = int_list("recompute", get(f, "recompute", "0"));
  const std::vector<int64_t> graphs = int_list("graph", get(f, "graph", "0"));
  const int64_t trace_steps = int_list("trace", get(f, "trace", "0")).at(0);
  const bool f32_adapters = f32_adapters_flag(f);
  for (const std::string& fp8 : flame_diffusion::tools::fp8_modes(f, "none")) {
  for (int64_t batch : int_list("batch", get(f, "batch", "1,4"))) {
    for (int64_t ckpt : int_list("checkpointing", get(f, "checkpointing", "0,1"))) {
      for (int64_t recompute : recomputes) {
        for (int64_t graph : graphs) {
          flame::cuda::empty_cache();
          auto unet = std::make_shared<fm::UNet2DConditionModel>(config, o);
          unet->add_lora({.rank = rank, .alpha = static_cast<double>(rank)});
          if (f32_adapters) flame::nn::adapters_to(*unet, DType::f32);
          if (fp8 != "none")  // the frozen Linears in 8 bits (docs/float8.md); convolutions stay bf16
            (void)flame::nn::quantize_float8(*unet, {.compute = flame::nn::parse_float8_compute(fp8)});
          unet->set_gradient_checkpointing(ckpt != 0);
          unet->set_recompute_cheap(recompute != 0);
          unet->train();
          flame::TensorList params;
          for (const Tensor& p : unet->parameters()) {
            if (p.requires_grad()) params.push_back(p);
          }
          flame::optim::AdamW opt(params, {.lr = 1e-4, .capturable = graph != 0});
          const StepInputs in = step_inputs(config, batch, latent, o);
          auto eager_step = [&] {
            Tensor out;
            {
              flame::amp::AutocastGuard autocast(f32_adapters, device.type);
              out = in.forward(*unet);
            }
            const Tensor loss = flame::mse_loss(out.to(DType::f32), in.target.to(DType::f32));
            const flame::Gradients g = loss.backward();
            opt.step(g);
          };
          // The whole step as one CUDA graph: eager warm-up steps, one capture, then replays.
          flame::cuda::GraphedStep graphed(eager_step,
                                           {.warmup_steps = 3, .device = device.index, .enabled = graph != 0});
          auto step = [&] { graphed(); };
          if (graph != 0) {
            try {
              for (int i = 0; i < 4; ++i) step();  // warm-up + capture before the timed warm-up below
            } catch (const std::exception& e) {
              std::printf("{\"impl\": \"flame\", \"batch\": %lld, \"checkpointing\": %s, \"cuda_graph\": true, "
                          "\"error\": \"capture failed\"}\n# %s\n",
                          static_cast<long long>(batch), ckpt ? "true" : "false", e.what());
              continue;
            }
          }
          for (int64_t i = 0; i < warmup; ++i) step();
          flame::cuda::synchronize();
          flame::cuda::reset_peak_memory_stats();
          std::vector<double> ms;
          for (int64_t i = 0; i < steps; ++i) {
            flame::cuda::Event a(true), b(true);
            a.record();
            step();
            b.record();
            b.synchronize();
            ms.push_back(a.elapsed_time(b));
          }
          std::sort(ms.begin(), ms.end());
          const double median = ms[ms.size() / 2];
          // A captured step's tensors live in the graph's private pool, outside the allocated peak.
          const auto stats = flame::cuda::memory_stats();
          const double peak =
              static_cast<double>(stats.peak_allocated_bytes + (graph != 0 ? stats.graph_pool_bytes : 0)) / (1u << 30);
          const double flops = step_flops(config, batch, latent, latent, seq);
          std::printf("{\"impl\": \"flame\", \"work\": \"%s_unet_lora_r%lld_step\", \"latent\": %lld, \"batch\": %lld, "
                      "\"checkpointing\": %s, \"recompute_cheap\": %s, \"cuda_graph\": %s, \"median_ms\": %.2f, "
                      "\"peak_gib\": %.3f, \"tflop_per_step\": %.2f, \"mfu_vs_989\": %.3f, \"fp8\": \"%s\", "
                      "\"adapters\": \"%s\"}\n",
                      name.c_str(), static_cast<long long>(rank), static_cast<long long>(latent),
                      static_cast<long long>(batch), ckpt ? "true" : "false", recompute ? "true" : "false",
                      graph ? "true" : "false", median, peak, flops / 1e12, flops / (median / 1e3) / 989e12,
                      fp8.c_str(), f32_adapters ? "f32" : "bf16");
          std::fflush(stdout);
          if (trace_steps > 0) print_kernel_trace(step, trace_steps);
        }
      }
    }
  }
  }
  return 0;
}

// ---- saved activations (CPU) ----
int saved(const std::map<std::string, std::string>& f) {
  const std::string name = get(f, "config", "sdxl");
  const auto config = fm::unet2d_preset(name);
  const flame::Device device = parse_device(get(f, "device", "cpu"));
  const int64_t latent = int_list("latent", get(f, "latent", "32")).at(0);
  const int64_t batch = int_list("batch", get(f, "batch", "1")).at(0);
  const int64_t rank = int_list("rank", get(f, "rank", "16")).at(0);
  const std::string dt = get(f, "dtype", "bf16");
  if (dt != "bf16" && dt != "f32") throw std::runtime_error("--dtype must be bf16 or f32, got '" + dt + "'");
  const DType dtype = dt == "bf16" ? DType::bf16 : DType::f32;
  const flame::TensorOptions o(dtype, device);
  const bool f32_adapters = f32_adapters_flag(f);
  const std::string adapters = f32_adapters ? "f32" : "bf16";
  if (f32_adapters && dtype != DType::bf16) throw std::runtime_error("--adapters f32 needs --dtype bf16 (the model)");
  auto unet = std::make_shared<fm::UNet2DConditionModel>(config, o);
  unet->add_lora({.rank = rank, .alpha = static_cast<double>(rank)});
  if (f32_adapters) flame::nn::adapters_to(*unet, DType::f32);
  unet->train();
  std::size_t weight_bytes = 0;
  for (const Tensor& p : unet->parameters()) weight_bytes += static_cast<std::size_t>(p.numel()) * flame::dtype_size(p.dtype());
  const StepInputs in = step_inputs(config, batch, latent, o);
  flame::nn::functional::SdpaBackendGuard fused(flame::nn::functional::SdpaBackend::fused);
  for (int64_t recompute : int_list("recompute", get(f, "recompute", "0,1"))) {
    unet->set_recompute_cheap(recompute != 0);
    flame::profiler::MemoryProfiler prof;
    std::size_t saved_bytes = 0, forward_bytes = 0;
    std::vector<flame::profiler::MemoryGroup> groups;
    {
      flame::profiler::MemoryProfileScope scope(prof);
      Tensor out;
      {
        flame::amp::AutocastGuard autocast(f32_adapters, device.type);
        out = in.forward(*unet);
      }
      const Tensor loss = flame::mse_loss(out.to(DType::f32), in.target.to(DType::f32));
      saved_bytes = flame::autograd_saved_bytes(loss);
      for (const auto& s : prof.summary()) {
        if (s.device == device) forward_bytes = s.end_bytes - s.start_bytes;
      }
      groups = prof.live_groups(device, flame::profiler::GroupBy::op);
      (void)loss.backward();
    }
    std::size_t peak = 0;
    for (const auto& s : prof.summary()) {
      if (s.device == device) peak = s.peak_bytes - s.start_bytes;
    }
    std::string by_op;
    for (const auto& g : groups) {
      if (g.phase == "before") continue;  // held since before the forward (the weights)
      by_op += (by_op.empty() ? "" : ", ") + std::string("\"") + g.op + "\": " + std::to_string(g.bytes);
    }
    std::printf("{\"impl\": \"flame\", \"work\": \"%s_unet_lora_r%lld_saved\", \"dtype\": \"%s\", \"adapters\": \"%s\", \"latent\": %lld, "
                "\"batch\": %lld, \"recompute_cheap\": %s, \"weight_bytes\": %zu, \"saved_bytes\": %zu, "
                "\"forward_live_bytes\": %zu, \"step_peak_above_start_bytes\": %zu, \"forward_live_by_op\": {%s}}\n",
                name.c_str(), static_cast<long long>(rank), dt.c_str(), adapters.c_str(), static_cast<long long>(latent),
                static_cast<long long>(batch), recompute ? "true" : "false", weight_bytes, saved_bytes, forward_bytes,
                peak, by_op.c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return flame_diffusion::tools::run_tool(argc, argv, "unet_parity", kUsage, kFlags,
                                          {{"check", check}, {"time", time_steps}, {"saved", saved}});
}
