// sd3_parity: FLAME's SD3Transformer2DModel against diffusers' (apps/diffusion/reference/models_sd3.py).
//
//   sd3_parity check --dir DIR [--device cuda|cpu] [--checkpointing 0|-1|N]
//       DIR as models_sd3.py writes it (transformer/ diffusers folder, sd3_original.safetensors,
//       the fp8 files of reduced configs, reference.safetensors). For each layout that is there:
//       loads the model (in the reference's dtype), runs the forward on the stored inputs, adds the
//       LoRA (stored weights, rank/alpha from the metadata), runs forward + mse loss + backward, and
//       prints max abs and max relative (max |err| / max |ref|) errors for the output, the LoRA
//       output, the loss and the adapter gradients (per group: attn / attn2, A and B), then one
//       PASS or FAIL line. Tolerances (relative): f32 1e-3 outputs, 1e-2 gradients; bf16 5e-2 and
//       1e-1. --checkpointing N checkpoints the first N blocks (-1: all) during the LoRA pass.
//   sd3_parity time --config sd3.5-large [--latent 128] [--text 333] [--batch 1] [--checkpointing 0,-1]
//                   [--offload 0] [--rank 16] [--steps 10] [--warmup 3] [--trace 0] [--recompute 0]
//                   [--device cuda]
//       the LoRA training step as the issue measures it: bf16 weights, f32 adapters (rank r on
//       to_q/k/v/out.0), bf16 autocast, mse loss, AdamW on the adapters; random weights; image
//       (latent/2)^2 tokens + `text` tokens (SD3 pipelines: 77 CLIP + 256 T5 = 333, or 154).
//       One JSON line per checkpointing setting (0: none, -1: every block, N: the first N) with the
//       median step time (CUDA events), the peak allocated memory, the step's FLOPs (step_flops:
//       linears 2x their forward, the frozen weights get no weight gradients; attention 3x)
//       and MFU against 989 TFLOP/s and against a bf16 GEMM (8192^3) measured in the same run.
//       --offload 1 moves the checkpointed blocks' inputs to pinned host memory (set_activation_offload);
//       --offload-blocks N,..., --offload-min-mib M and --offload-prefetch-mib P as flux_parity's (what
//       the first N blocks save, checkpointed or not; saved tensors under M MiB stay; P MiB ahead).
//       --trace N records the kernels of N more steps (profiler::KernelTrace): GPU time by kernel, and
//       where the GPU sat idle (parity_util.h print_idle_time).
//       --recompute 0,1 runs the forward without / under autograd::RecomputeCheap (docs/recompute.md).
//       --graph 0,1 runs the step eagerly / as one CUDA graph (flame::cuda::GraphedStep).
//       --fp8 none,dequantize,fp8 stores the frozen Linear weights in 8 bits (nn::quantize_float8,
//       docs/float8.md); the JSON line adds the mode and the base Linear weights' bytes.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <flame/amp.h>
#include <flame/cuda.h>
#include <flame/cuda/graph_step.h>
#include <flame/flame.h>
#include <flame/io/safetensors.h>
#include <flame/nn.h>
#include <flame/optim.h>
#include <flame/profiler.h>
#include <flame/recompute.h>

#include "models/sd3.h"
#include "parity_util.h"

namespace fm = flame_diffusion::models;
using flame::DType;
using flame::Tensor;
using flame_diffusion::tools::int_list;
using flame_diffusion::tools::parity_error;
using flame_diffusion::tools::ParityError;
using flame_diffusion::tools::parse_device;
using flame_diffusion::tools::print_kernel_trace;

namespace {

const char* kUsage =
    "usage:\n"
    "  sd3_parity check --dir DIR [--device cuda|cpu] [--checkpointing 0|-1|N]\n"
    "  sd3_parity time  --config sd3-medium|sd3.5-medium|sd3.5-large [--latent 128] [--text 333] [--batch 1]\n"
    "                   [--checkpointing 0,-1] [--offload 0] [--rank 16] [--steps 10] [--warmup 3] [--trace 0] "
    "[--recompute 0] [--graph 0] [--fp8 none]\n"
    "                   [--offload-blocks -2] [--offload-min-mib 1] [--offload-prefetch-mib 0] [--device cuda]\n";

const std::vector<std::string> kFlags = {"dir",   "device", "checkpointing", "config", "latent", "text",
                                         "batch", "rank",   "steps",         "warmup", "trace",  "offload", "recompute",
                                         "graph", "fp8", "offload-blocks", "offload-min-mib", "offload-prefetch-mib"};

std::string get(const std::map<std::string, std::string>& f, const std::string& k, const std::string& fallback) {
  return flame_diffusion::tools::flag_or(f, k, fallback);
}

bool report(const std::string& what, const ParityError& e, double tol) {
  const bool ok = e.rel <= tol && e.abs == e.abs;
  std::printf("  %-4s %-44s max abs err %.3e  rel %.3e (tol %.0e)\n", ok ? "ok" : "FAIL", what.c_str(), e.abs, e.rel,
              tol);
  return ok;
}

// "attn lora_A", "attn2 lora_B", ...
std::string group_of(const std::string& name) {
  const std::string attn = name.find(".attn2.") != std::string::npos ? "attn2" : "attn";
  return attn + (name.find(".lora_A.") != std::string::npos ? " lora_A" : " lora_B");
}

int check(const std::map<std::string, std::string>& f) {
  const std::filesystem::path dir = get(f, "dir", "");
  if (dir.empty()) throw std::runtime_error(std::string("check needs --dir\n") + kUsage);
  const flame::Device device = parse_device(get(f, "device", "cuda"));
  const int64_t ckpt = int_list("checkpointing", get(f, "checkpointing", "0")).at(0);
  const std::string ref_path = (dir / "reference.safetensors").string();
  const auto meta = flame::io::load_safetensors_metadata(ref_path);
  const DType dtype = meta.at("dtype") == "bfloat16" ? DType::bf16 : DType::f32;
  const bool bf16 = dtype == DType::bf16;
  const double tol_out = bf16 ? 5e-2 : 1e-3, tol_grad = bf16 ? 1e-1 : 1e-2;
  if (device.is_cuda()) {
    flame::cuda::set_allow_tf32(false);
    flame::cuda::set_allow_conv_tf32(false);
  }
  const flame::StateDict ref = flame::io::load_safetensors(ref_path, device);
  auto input = [&](const std::string& k) { return ref.at("input." + k); };
  std::printf("sd3_parity check %s: config %s, %s, latent %sx%s, %s text tokens, device %s, LoRA rank %s alpha %s\n",
              dir.c_str(), meta.at("config").c_str(), bf16 ? "bf16" : "f32", meta.at("height").c_str(),
              meta.at("width").c_str(), meta.at("text").c_str(), device.is_cuda() ? "cuda" : "cpu",
              meta.at("lora_rank").c_str(), meta.at("lora_alpha").c_str());
  struct Layout {
    std::string name, path, output;
  };
  const std::vector<Layout> layouts = {
      {"diffusers", dir.string(), "output.sample"},
      {"original", (dir / "sd3_original.safetensors").string(), "output.sample"},
      {"fp8", (dir / "sd3_fp8.safetensors").string(), "output.fp8_sample"},
      {"fp8-scaled", (dir / "sd3_fp8_scaled.safetensors").string(), "output.fp8_scaled_sample"}};
  bool ok = true;
  for (const Layout& l : layouts) {
    if (l.name != "diffusers" && !std::filesystem::exists(l.path)) {
      std::printf(" %s: %s absent, skipped\n", l.name.c_str(), l.path.c_str());
      continue;
    }
    auto model = fm::load_sd3(l.path, {.device = device, .dtype = dtype});
    std::printf(" %s (%s):\n", l.name.c_str(), l.path.c_str());
    auto forward = [&] {
      return model->forward(input("hidden_states"), input("encoder_hidden_states"), input("pooled_projections"),
                            input("timestep"));
    };
    {
      flame::NoGradGuard no_grad;
      ok &= report("output", parity_error(forward(), ref.at(l.output), "sd3_parity"), tol_out);
    }
    if (l.output != "output.sample") continue;  // the LoRA pass once per weight set
    model->add_lora({.rank = std::stoll(meta.at("lora_rank")), .alpha = std::stod(meta.at("lora_alpha"))});
    model->set_gradient_checkpointing(ckpt != 0, ckpt);
    flame::StateDict lora;
    for (const auto& [k, t] : ref) {
      if (k.rfind("lora.", 0) == 0) lora.insert(k.substr(5), t);
    }
    flame::nn::load_lora_state_dict(*model, lora);
    const Tensor out = forward();
    ok &= report("LoRA output", parity_error(out, ref.at("output.lora_sample"), "sd3_parity"), tol_out);
    const Tensor loss = flame::mse_loss(out.to(DType::f32), input("target").to(DType::f32));
    ok &= report("loss", parity_error(loss.reshape({1}), ref.at("output.loss"), "sd3_parity"), tol_out);
    const flame::Gradients grads = loss.backward();
    std::map<std::string, ParityError> groups;
    std::map<std::string, double> group_ref;
    int64_t n = 0;
    for (const auto& [name, p] : model->named_parameters()) {
      if (!p.requires_grad()) continue;
      const Tensor& want = ref.at("grad." + name);
      const ParityError e = parity_error(grads.get(p), want, "sd3_parity");
      const double mref = want.abs().max().item<double>();
      for (const std::string g : {group_of(name), std::string("all")}) {
        groups[g].abs = std::max(groups[g].abs, e.abs);
        group_ref[g] = std::max(group_ref[g], mref);
      }
      ++n;
    }
    for (auto& [g, e] : groups) {
      e.rel = e.abs / std::max(1e-30, group_ref[g]);
      ok &= report("grad " + (g == "all" ? "all (" + std::to_string(n) + " adapter tensors)" : g), e, tol_grad);
    }
  }
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

// ---- timing ----
// FLOPs (multiply-adds x 2) of the LoRA step's forward and backward, as flux_parity counts them:
// the linears (and the patch embedding) twice their forward (data gradients only: the frozen
// weights get no weight gradients; the rank-r adapters are negligible), the attention products
// three times theirs (forward, then dS = dO V^T and dQ, dK, dV). Recompute under checkpointing is
// not counted (MFU counts model FLOPs).
double step_flops(const fm::SD3TransformerConfig& c, int64_t b, int64_t latent, int64_t text) {
  const double d = static_cast<double>(c.inner_dim()), p = static_cast<double>(c.patch_size);
  const double l = static_cast<double>(latent / c.patch_size) * static_cast<double>(latent / c.patch_size);
  const double s = static_cast<double>(text), n = l + s;
  double linear = 2 * l * c.in_channels * p * p * d + 2 * s * c.joint_attention_dim * d + 2 * l * d * p * p * c.out_channels;
  double attention = 0;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const bool last = i == c.num_layers - 1;
    linear += 2 * 3 * n * d * d + 2 * (last ? l : n) * d * d;  // q, k, v of both streams; to_out (+ to_add_out)
    attention += 2 * 2 * n * n * d;                             // scores and values over the joint sequence
    linear += 2 * 8 * (last ? l : n) * d * d;                   // ff (+ ff_context): d -> 4d -> d
    if (c.dual_attention(i)) {
      linear += 2 * 4 * l * d * d;
      attention += 2 * 2 * l * l * d;
    }
  }
  return (2 * linear + 3 * attention) * static_cast<double>(b);
}

// bf16 GEMM throughput of this GPU now (TFLOP/s): 8192^3, median of 10.
double gemm_tflops(flame::Device device) {
  const flame::TensorOptions o(DType::bf16, device);
  flame::Generator gen(1);
  const Tensor a = Tensor::randn({8192, 8192}, 0.0, 1.0, o, &gen), b = Tensor::randn({8192, 8192}, 0.0, 1.0, o, &gen);
  const double ms = flame_diffusion::tools::median_ms([&] { (void)flame::matmul(a, b); }, true);
  return 2.0 * 8192.0 * 8192.0 * 8192.0 / (ms / 1e3) / 1e12;
}

int time_steps(const std::map<std::string, std::string>& f) {
  const std::string name = get(f, "config", "sd3.5-large");
  const auto config = fm::sd3_preset(name);
  const flame::Device device = parse_device(get(f, "device", "cuda"));
  if (!device.is_cuda()) throw std::runtime_error("time needs --device cuda (CUDA events)");
  const int64_t latent = int_list("latent", get(f, "latent", "128")).at(0);
  const int64_t text = int_list("text", get(f, "text", "333")).at(0);
  const int64_t batch = int_list("batch", get(f, "batch", "1")).at(0);
  const int64_t rank = int_list("rank", get(f, "rank", "16")).at(0);
  const int64_t steps = int_list("steps", get(f, "steps", "10")).at(0);
  const int64_t warmup = int_list("warmup", get(f, "warmup", "3")).at(0);
  const int64_t trace_steps = int_list("trace", get(f, "trace", "0")).at(0);
  const bool offload = int_list("offload", get(f, "offload", "0")).at(0) != 0;
  const int64_t offload_min_mib = int_list("offload-min-mib", get(f, "offload-min-mib", "1")).at(0);
  const int64_t offload_prefetch_mib = int_list("offload-prefetch-mib", get(f, "offload-prefetch-mib", "0")).at(0);
  const std::vector<std::string> fp8s = flame_diffusion::tools::fp8_modes(f, "none");  // checked before any work
  const double gemm = gemm_tflops(device);
  std::printf("# bf16 GEMM 8192^3 on this GPU: %.1f TFLOP/s\n", gemm);
  const flame::TensorOptions o(DType::bf16, device);
  // (checkpointing, RecomputeCheap, CUDA graph, --fp8 mode, offloaded blocks)
  std::vector<std::tuple<int64_t, bool, bool, std::string, int64_t>> settings;
  for (const std::string& fp8 : fp8s)
    for (int64_t ckpt : int_list("checkpointing", get(f, "checkpointing", "0,-1")))
      for (int64_t r : int_list("recompute", get(f, "recompute", "0")))
        for (int64_t ob : int_list("offload-blocks", get(f, "offload-blocks", "-2")))
          for (int64_t g : int_list("graph", get(f, "graph", "0"))) settings.emplace_back(ckpt, r != 0, g != 0, fp8, ob);
  for (const auto& [ckpt, recompute, graph, fp8, offload_blocks] : settings) {
    flame::cuda::empty_cache();
    auto model = std::make_shared<fm::SD3Transformer2DModel>(config, o);
    model->add_lora({.rank = rank, .alpha = static_cast<double>(rank)});
    if (fp8 != "none") (void)flame::nn::quantize_float8(*model, {.compute = flame::nn::parse_float8_compute(fp8)});
    const int64_t base_bytes = flame_diffusion::tools::base_linear_bytes(*model);
    model->set_gradient_checkpointing(ckpt != 0, ckpt);
    model->set_activation_offload(offload, static_cast<std::size_t>(offload_min_mib) << 20, offload_blocks,
                                         static_cast<std::size_t>(offload_prefetch_mib) << 20);
    model->train();
    flame::TensorList params;
    for (const auto& m : model->modules()) {  // f32 adapters on bf16 weights, as diffusers + peft
      if (auto* lin = dynamic_cast<flame::nn::Linear*>(m.get()); lin && lin->has_lora()) {
        lin->lora_A()->to(DType::f32);
        lin->lora_B()->to(DType::f32);
      }
    }
    for (const Tensor& p : model->parameters()) {
      if (p.requires_grad()) params.push_back(p);
    }
    flame::optim::AdamW opt(params, {.lr = 1e-4, .capturable = graph});
    flame::Generator gen(0);
    const Tensor x = Tensor::randn({batch, config.in_channels, latent, latent}, 0.0, 1.0, o, &gen);
    const Tensor target = Tensor::randn({batch, config.out_channels, latent, latent}, 0.0, 1.0, o, &gen);
    const Tensor ctx = Tensor::randn({batch, text, config.joint_attention_dim}, 0.0, 1.0, o, &gen);
    const Tensor pooled = Tensor::randn({batch, config.pooled_projection_dim}, 0.0, 1.0, o, &gen);
    const Tensor t = Tensor::full({batch}, 500.0, {DType::f32, device});
    auto eager_step = [&] {
      Tensor out;
      {
        flame::amp::AutocastGuard autocast(DType::bf16);
        flame::autograd::RecomputeCheap cheap(recompute);  // Note [Recompute cheap]
        out = model->forward(x, ctx, pooled, t);
      }
      const Tensor loss = flame::mse_loss(out.to(DType::f32), target.to(DType::f32));
      opt.step(loss.backward());
    };
    // --graph 1: the step as one CUDA graph after one eager step (docs/graph-step.md).
    flame::cuda::GraphedStep graphed(eager_step, {.warmup_steps = 1, .device = device.index, .enabled = graph});
    auto step = [&] { graphed(); };
    const flame_diffusion::tools::StepTimes timed = flame_diffusion::tools::time_cuda_steps(step, warmup, steps);
    const double median = timed.median_ms, peak = timed.peak_gib;
    const double flops = step_flops(config, batch, latent, text);
    const double rate = flops / (median / 1e3) / 1e12;
    std::printf(
        "{\"impl\": \"flame\", \"work\": \"%s_lora_r%lld_step\", \"latent\": %lld, \"text\": %lld, "
        "\"batch\": %lld, \"checkpointed_blocks\": %lld, \"recompute_cheap\": %s, \"cuda_graph\": %s, \"graph_pool_gib\": %.3f, "
        "\"offload_blocks\": %lld, \"offloaded_gib\": %.3f, "
        "\"median_ms\": %.2f, "
        "\"peak_gib\": %.3f, \"tflop_per_step\": %.2f, \"mfu_vs_989\": %.3f, \"mfu_vs_gemm\": %.3f, \"fp8\": \"%s\", "
        "\"base_linear_gib\": %.3f}\n",
        name.c_str(), static_cast<long long>(rank), static_cast<long long>(latent), static_cast<long long>(text),
        static_cast<long long>(batch), static_cast<long long>(model->checkpointed_blocks()),
        recompute ? "true" : "false", graphed.captured() ? "true" : "false",
                  static_cast<double>(flame::cuda::memory_stats().graph_pool_bytes) / (1u << 30),
        static_cast<long long>(offload ? offload_blocks : 0),
        static_cast<double>(model->offloaded_bytes()) / (1u << 30), median, peak, flops / 1e12, rate / 989.0,
        rate / gemm, fp8.c_str(), static_cast<double>(base_bytes) / (1u << 30));
    std::fflush(stdout);
    if (trace_steps > 0) print_kernel_trace(step, trace_steps);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return flame_diffusion::tools::run_tool(argc, argv, "sd3_parity", kUsage, kFlags,
                                          {{"check", check}, {"time", time_steps}});
}
