// FluxTransformer2DModel (models/flux.h) and the DiT blocks (models/transformer_blocks.h): presets
// against diffusers' parameter counts, config.json, latent packing and position ids, the rotary
// table and its application, parity with diffusers on the reduced configuration tiny-flux from every
// stored layout (sharded diffusers folder, BFL original, ComfyUI prefixed fp8 with other models'
// keys, bare fp8-scaled), a PEFT LoRA's output and adapter gradients, per-block gradient
// checkpointing, and the loaders' errors. The references are written by
// apps/diffusion/reference/models_flux.py (diffusers 0.42, torch 2.15, f32 on the CPU).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <flame/io/safetensors.h>

#include "model_test_util.h"
#include "models/flux.h"

namespace fm = flame_diffusion::models;
namespace nn = flame::nn;
using flame::DType;
using flame::Tensor;

namespace {

std::filesystem::path tiny_dir() {
  return std::filesystem::path(__FILE__).parent_path() / "data" / "models" / "flux-tiny";
}

// The parameter count a configuration implies (Note [FLUX layout]).
int64_t expected_parameters(const fm::FluxTransformerConfig& c) {
  const int64_t d = c.inner_dim(), hd = c.attention_head_dim;
  auto lin = [](int64_t in, int64_t out) { return in * out + out; };
  int64_t n = lin(c.in_channels, d) + lin(c.joint_attention_dim, d);
  n += (c.guidance_embeds ? 2 : 1) * (lin(256, d) + lin(d, d)) + lin(c.pooled_projection_dim, d) + lin(d, d);
  const int64_t dbl = 2 * lin(d, 6 * d) + 8 * lin(d, d) + 4 * hd + 2 * (lin(d, 4 * d) + lin(4 * d, d));
  const int64_t sgl = lin(d, 3 * d) + 3 * lin(d, d) + 2 * hd + lin(d, 4 * d) + lin(5 * d, d);
  n += c.num_layers * dbl + c.num_single_layers * sgl;
  return n + lin(d, 2 * d) + lin(d, c.patch_size * c.patch_size * c.output_channels());
}

// max |got - want| <= atol + rtol * max |want|
void expect_close(const Tensor& got, const Tensor& want, double rtol, double atol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = fd_test::max_abs(want);
  const double err = fd_test::max_abs_diff(got, want);
  EXPECT_LE(err, atol + rtol * scale) << what << ": max error " << err << " at scale " << scale;
}

struct Reference {
  flame::StateDict t;
  std::map<std::string, std::string> meta;
  const Tensor& operator[](const std::string& k) const { return t.at(k); }
};

Reference load_reference() {
  const std::string path = (tiny_dir() / "reference.safetensors").string();
  return {flame::io::load_safetensors(path, fd_test::test_device()), flame::io::load_safetensors_metadata(path)};
}

Tensor run(fm::FluxTransformer2DModel& m, const Reference& r) {
  return m.forward(r["input.hidden_states"], r["input.encoder_hidden_states"], r["input.pooled_projections"],
                   r["input.timestep"], r["input.img_ids"], r["input.txt_ids"],
                   m.config().guidance_embeds ? r["input.guidance"] : Tensor());
}

std::shared_ptr<fm::FluxTransformer2DModel> load(const std::string& file, fm::FluxLoadOptions o = {}) {
  o.device = fd_test::test_device();
  return fm::load_flux((tiny_dir() / file).string(), o);
}

void add_reference_lora(fm::FluxTransformer2DModel& m, const Reference& r) {
  m.add_lora({.rank = std::stoll(r.meta.at("lora_rank")), .alpha = std::stod(r.meta.at("lora_alpha"))});
  flame::StateDict lora;
  for (const auto& [k, t] : r.t) {
    if (k.rfind("lora.", 0) == 0) lora.insert(k.substr(5), t);
  }
  nn::load_lora_state_dict(m, lora);
}

// Adapter gradients of mse(forward, target), by parameter name.
std::map<std::string, Tensor> lora_grads(fm::FluxTransformer2DModel& m, const Reference& r, Tensor* loss_out = nullptr) {
  const Tensor loss = flame::mse_loss(run(m, r), r["input.target"]);
  if (loss_out) *loss_out = loss;
  const flame::Gradients g = loss.backward();
  std::map<std::string, Tensor> out;
  for (const auto& [name, p] : m.named_parameters()) {
    if (p.requires_grad()) out[name] = g.get(p);
  }
  return out;
}

}  // namespace

// ---- configuration ----
TEST(ModelsFlux, PresetsGiveDiffusersParameterCounts) {
  // Counted by diffusers 0.42 (FluxTransformer2DModel on the meta device).
  EXPECT_EQ(expected_parameters(fm::flux_preset("flux-dev")), 11901408320);
  EXPECT_EQ(expected_parameters(fm::flux_preset("flux-schnell")), 11891178560);
  EXPECT_EQ(expected_parameters(fm::flux_preset("flux-dev-d2")), 1026971200);
  EXPECT_EQ(expected_parameters(fm::flux_preset("tiny-flux")), 38256);
  fm::FluxTransformer2DModel m(fm::flux_preset("tiny-flux"));
  int64_t n = 0;
  for (const Tensor& p : m.parameters()) n += p.numel();
  EXPECT_EQ(n, 38256);
  const auto dev = fm::flux_preset("flux-dev");
  EXPECT_TRUE(dev.guidance_embeds);
  EXPECT_FALSE(fm::flux_preset("flux-schnell").guidance_embeds);
  EXPECT_EQ(dev.axes_dims_rope, (std::vector<int64_t>{16, 56, 56}));
  EXPECT_EQ(dev.inner_dim(), 3072);
  EXPECT_NE(fd_test::error_of([] { fm::flux_preset("flux-pro"); }).find("flux-schnell"), std::string::npos);
}

TEST(ModelsFlux, ParameterNamesAndShapesAreDiffusers) {
  const fm::Checkpoint ck = fm::Checkpoint::open((tiny_dir() / "transformer").string());
  fm::FluxTransformer2DModel m(fm::flux_preset("tiny-flux"));
  std::set<std::string> mine;
  for (const auto& [name, p] : m.named_parameters()) {
    mine.insert(name);
    ASSERT_TRUE(ck.contains(name)) << name << " is not in diffusers' state dict";
    EXPECT_EQ(ck.info(name).shape, p.sizes()) << name;
  }
  EXPECT_EQ(mine.size(), ck.keys().size());
}

TEST(ModelsFlux, ConfigJsonAndErrors) {
  const auto c = fm::flux_config_from_file((tiny_dir() / "transformer" / "config.json").string());
  const auto t = fm::flux_preset("tiny-flux");
  EXPECT_EQ(c.num_layers, t.num_layers);
  EXPECT_EQ(c.num_single_layers, t.num_single_layers);
  EXPECT_EQ(c.attention_head_dim, t.attention_head_dim);
  EXPECT_EQ(c.num_attention_heads, t.num_attention_heads);
  EXPECT_EQ(c.joint_attention_dim, t.joint_attention_dim);
  EXPECT_EQ(c.pooled_projection_dim, t.pooled_projection_dim);
  EXPECT_EQ(c.axes_dims_rope, t.axes_dims_rope);
  EXPECT_EQ(c.guidance_embeds, t.guidance_embeds);
  EXPECT_EQ(c.in_channels, t.in_channels);
  const std::string bad = fd_test::error_of([] {
    fm::flux_config_from_json(fm::JsonConfig::parse(R"({"attention_head_dim": 64})", "cfg.json"));
  });
  EXPECT_NE(bad.find("cfg.json"), std::string::npos) << bad;
  EXPECT_NE(bad.find("sums to 128"), std::string::npos) << bad;
  const std::string cls = fd_test::error_of([] {
    fm::flux_config_from_json(fm::JsonConfig::parse(R"({"_class_name": "SD3Transformer2DModel"})", "cfg.json"));
  });
  EXPECT_NE(cls.find("SD3Transformer2DModel"), std::string::npos) << cls;
}

// ---- packing, ids and rotary ----
TEST(ModelsFlux, PackingAndIdsAreThePipelines) {
  FD_SKIP_IF_NO_DEVICE();
  const Reference r = load_reference();
  const Tensor latents = r["input.latents"];
  const Tensor packed = fm::pack_latents(latents);
  EXPECT_EQ(fd_test::max_abs_diff(packed, r["input.hidden_states"]), 0.0);
  EXPECT_EQ(fd_test::max_abs_diff(fm::unpack_latents(packed, latents.size(2), latents.size(3)), latents), 0.0);
  EXPECT_EQ(fd_test::max_abs_diff(fm::flux_img_ids(latents.size(2), latents.size(3)), r["input.img_ids"]), 0.0);
  EXPECT_EQ(fd_test::max_abs_diff(fm::flux_txt_ids(r["input.txt_ids"].size(0)), r["input.txt_ids"]), 0.0);
  EXPECT_NE(fd_test::error_of([] { fm::pack_latents(Tensor::zeros({1, 4, 3, 4})); }).find("even"), std::string::npos);
}

TEST(ModelsFlux, RotaryTableIsFluxPosEmbeds) {
  FD_SKIP_IF_NO_DEVICE();
  const Reference r = load_reference();
  const Tensor ids = flame::cat({r["input.txt_ids"], r["input.img_ids"]}, 0);
  const fm::RotaryEmbedding rope = fm::rotary_embedding_from_ids(ids, {2, 2, 4}, 10000.0, fd_test::test_device());
  expect_close(rope.cos, r["rope.cos"], 0.0, 1e-7, "cos");
  expect_close(rope.sin, r["rope.sin"], 0.0, 1e-7, "sin");
  // The real axes at a large position, against a float64 loop.
  const Tensor big = Tensor::from_vec(std::vector<float>{0.f, 63.f, 127.f}, {1, 3});
  const fm::RotaryEmbedding real = fm::rotary_embedding_from_ids(big, {16, 56, 56}, 10000.0, flame::Device::cpu());
  const std::vector<float> cos = real.cos.to_vec<float>(), sin = real.sin.to_vec<float>();
  ASSERT_EQ(cos.size(), 128u);
  const int64_t dims[3] = {16, 56, 56};
  const double pos[3] = {0, 63, 127};
  int64_t col = 0;
  for (int a = 0; a < 3; ++a) {
    for (int64_t j = 0; j < dims[a]; ++j) {
      const double angle = pos[a] / std::pow(10000.0, static_cast<double>(2 * (j / 2)) / dims[a]);
      EXPECT_NEAR(cos[static_cast<std::size_t>(col + j)], std::cos(angle), 1e-7) << a << " " << j;
      EXPECT_NEAR(sin[static_cast<std::size_t>(col + j)], std::sin(angle), 1e-7) << a << " " << j;
    }
    col += dims[a];
  }
}

TEST(ModelsFlux, ApplyRotaryRotatesPairs) {
  flame::Generator gen(3);
  const Tensor x = Tensor::randn({2, 3, 5, 6}, 0.0, 1.0, {DType::f32}, &gen);
  const Tensor ids = Tensor::randn({5, 2}, 0.0, 4.0, {DType::f32}, &gen);
  const fm::RotaryEmbedding rope = fm::rotary_embedding_from_ids(ids, {2, 4}, 10000.0, flame::Device::cpu());
  const Tensor y = fm::apply_rotary_emb(x, rope);
  const std::vector<float> xv = x.to_vec<float>(), yv = y.to_vec<float>(), c = rope.cos.to_vec<float>(),
                           s = rope.sin.to_vec<float>();
  // Each pair (x0, x1) at position p turns by the pair's angle: (x0 c - x1 s, x1 c + x0 s).
  for (int64_t bh = 0; bh < 6; ++bh) {
    for (int64_t p = 0; p < 5; ++p) {
      for (int64_t i = 0; i < 6; i += 2) {
        const std::size_t at = static_cast<std::size_t>((bh * 5 + p) * 6 + i), t = static_cast<std::size_t>(p * 6 + i);
        const double x0 = xv[at], x1 = xv[at + 1];
        EXPECT_NEAR(yv[at], x0 * c[t] - x1 * s[t], 1e-6);
        EXPECT_NEAR(yv[at + 1], x1 * c[t + 1] + x0 * s[t + 1], 1e-6);
      }
    }
  }
}

// ---- parity with diffusers ----
TEST(ModelsFlux, MatchesDiffusersFromEveryFormat) {
  FD_SKIP_IF_NO_DEVICE();
  const Reference r = load_reference();
  const auto tiny = fm::flux_preset("tiny-flux");
  struct Case {
    std::string file, output;
    fm::FluxLoadOptions options;
    std::string format;
    bool lora;
  };
  const std::vector<Case> cases = {
      {"transformer", "output.sample", {}, "flux-diffusers", true},
      {"", "output.sample", {}, "flux-diffusers", false},  // the pipeline folder: transformer/ found
      {"flux_original.safetensors", "output.sample", {.config = tiny}, "flux-original", true},
      {"flux_comfy_fp8.safetensors", "output.fp8_sample", {.family = "tiny-flux"}, "flux-original", false},
      {"flux_fp8_scaled.safetensors", "output.fp8_scaled_sample", {.config = tiny}, "flux-original", false},
  };
  for (const Case& c : cases) {
    const std::string what = c.file.empty() ? "pipeline folder" : c.file;
    const fm::Checkpoint ck = fm::Checkpoint::open((tiny_dir() / c.file).string(), {.subfolder = "transformer"});
    const fm::FluxFileInfo info = fm::inspect_flux(ck, c.options);
    EXPECT_EQ(info.format, c.format) << what;
    EXPECT_EQ(info.fp8, c.file.find("fp8") != std::string::npos) << what;
    EXPECT_EQ(info.fp8_scaled, c.file.find("scaled") != std::string::npos) << what;
    EXPECT_EQ(info.prefix, c.file.find("comfy") != std::string::npos ? "model.diffusion_model." : "") << what;
    auto m = load(c.file, c.options);
    expect_close(run(*m, r), r[c.output], 2e-5, 1e-6, what + " output");
    if (!c.lora) continue;
    add_reference_lora(*m, r);
    Tensor loss;
    const auto grads = lora_grads(*m, r, &loss);
    expect_close(loss.reshape({1}), r["output.loss"], 1e-5, 0.0, what + " loss");
    EXPECT_EQ(grads.size(), 28u);  // 4 adapters x 2 double blocks + 3 x 2 single blocks, A and B
    for (const auto& [name, g] : grads) {
      ASSERT_TRUE(r.t.contains("grad." + name)) << "no reference gradient for " << name;
      expect_close(g, r["grad." + name], 1e-4, 1e-9, what + " grad " + name);
    }
  }
}

// FluxLoadOptions::float8: an fp8 file's weights keep their codes (rows split out of the fused qkv
// and linear1, the final adaLN's halves swapped) with the file's scale; the model in 8 bits gives
// the output diffusers gives on the dequantised weights. A bf16/f32 file is quantised as it loads.
TEST(ModelsFlux, Fp8FilesLoadAsEightBitWeights) {
  FD_SKIP_IF_NO_DEVICE();
  const Reference r = load_reference();
  const auto tiny = fm::flux_preset("tiny-flux");
  struct Case {
    std::string file, output;
    fm::FluxLoadOptions options;
  };
  const std::vector<Case> cases = {
      {"flux_comfy_fp8.safetensors", "output.fp8_sample", {.family = "tiny-flux"}},
      {"flux_fp8_scaled.safetensors", "output.fp8_scaled_sample", {.config = tiny}},
  };
  for (Case c : cases) {
    SCOPED_TRACE(c.file);
    c.options.float8 = flame::nn::Float8Options{};
    auto m = load(c.file, c.options);
    int64_t linears = 0;
    for (const auto& [name, mod] : m->named_modules()) {
      if (auto* l = dynamic_cast<nn::Linear*>(mod.get())) {
        ++linears;
        EXPECT_TRUE(l->is_float8()) << name;
        EXPECT_FALSE(l->weight().requires_grad()) << name;
      }
    }
    EXPECT_GT(linears, 20);
    expect_close(run(*m, r), r[c.output], 2e-5, 1e-6, c.file + " output");
    // The codes are the file's: to_q is the first third of the stored fused qkv's rows.
    const fm::Checkpoint ck = fm::Checkpoint::open((tiny_dir() / c.file).string(), {});
    std::string qkv;
    for (const std::string& k : ck.keys())
      if (k.ends_with("double_blocks.0.img_attn.qkv.weight")) qkv = k;
    ASSERT_FALSE(qkv.empty());
    const Tensor stored = ck.load(qkv, flame::Device::cpu(), DType::f32);
    const auto& to_q = *std::dynamic_pointer_cast<nn::Linear>(m->submodule("transformer_blocks.0.attn.to_q"));
    const int64_t d = to_q.out_features();
    EXPECT_EQ(to_q.weight().dtype(), DType::f8_e4m3fn);
    EXPECT_EQ(to_q.weight().to(DType::f32).to(flame::Device::cpu()).contiguous().to_vec<float>(),
              stored.narrow(0, 0, d).contiguous().to_vec<float>());
    // LoRA on the 8-bit base: adapters train, in f32.
    m->add_lora({.rank = 2, .alpha = 2.0});
    const Tensor y = run(*m, r);
    const flame::Gradients g = y.pow(2.0).mean().backward();
    EXPECT_TRUE(g.contains(std::dynamic_pointer_cast<nn::Linear>(m->submodule("transformer_blocks.0.attn.to_q"))
                               ->lora_A()
                               ->weight()));
  }
  // A full-precision file quantised as it loads: close to the f32 model's output.
  auto m = load("flux_original.safetensors", {.config = tiny, .float8 = flame::nn::Float8Options{}});
  const Tensor y = run(*m, r), ref = r["output.sample"];
  EXPECT_LT(((y - ref).pow(2.0).sum() / ref.pow(2.0).sum()).sqrt().item<double>(), 0.08);
}

TEST(ModelsFlux, LoraTargetsArePefts) {
  fm::FluxTransformer2DModel m(fm::flux_preset("tiny-flux"));
  const auto adapted = m.add_lora({.rank = 2, .alpha = 2.0});
  const std::set<std::string> got(adapted.begin(), adapted.end());
  std::set<std::string> want;
  for (int i = 0; i < 2; ++i) {
    for (const char* t : {"to_q", "to_k", "to_v", "to_out.0"}) {
      want.insert("transformer_blocks." + std::to_string(i) + ".attn." + t);
    }
    for (const char* t : {"to_q", "to_k", "to_v"}) {
      want.insert("single_transformer_blocks." + std::to_string(i) + ".attn." + t);
    }
  }
  EXPECT_EQ(got, want);
  int64_t trainable = 0;
  for (const auto& [name, p] : m.named_parameters()) {
    if (!p.requires_grad()) continue;
    ++trainable;
    EXPECT_TRUE(nn::is_lora_key(name)) << name;
  }
  EXPECT_EQ(trainable, 28);
}

TEST(ModelsFlux, GradientCheckpointingAndOffloadGiveTheSameGradients) {
  FD_SKIP_IF_NO_DEVICE();
  const Reference r = load_reference();
  auto m = load("transformer");
  add_reference_lora(*m, r);
  const auto plain = lora_grads(*m, r);
  for (int64_t n : {int64_t{1}, int64_t{3}, fm::kAllFluxBlocks}) {
    m->set_gradient_checkpointing(n);
    EXPECT_EQ(m->gradient_checkpointing_blocks(), n < 0 ? 4 : n);
    const auto ck = lora_grads(*m, r);
    for (const auto& [name, g] : plain) {
      EXPECT_GT(fd_test::max_abs(g), 0.0) << name;
      EXPECT_LE(fd_test::max_abs_diff(ck.at(name), g), 1e-6 * fd_test::max_abs(g) + 1e-12) << n << " " << name;
    }
  }
  // The checkpointed blocks' inputs offloaded (on the CPU: cloned through the same hooks).
  m->set_gradient_checkpointing(3);
  m->set_activation_offload(true, 0);
  const auto off = lora_grads(*m, r);
  EXPECT_GT(m->offloaded_bytes(), 0u);
  for (const auto& [name, g] : plain) {
    EXPECT_LE(fd_test::max_abs_diff(off.at(name), g), 1e-6 * fd_test::max_abs(g) + 1e-12) << "offload " << name;
  }
  // What the first blocks save, not checkpointed (BlockStack::set_activation_offload's block count):
  // the same gradients; more blocks move more bytes, and a min_bytes above every saved tensor none.
  m->set_gradient_checkpointing(0);
  std::size_t offloaded_two = 0;
  for (int64_t blocks : {int64_t{2}, int64_t{-1}}) {
    m->set_activation_offload(true, 0, blocks);
    const auto eager_off = lora_grads(*m, r);
    for (const auto& [name, g] : plain) {
      EXPECT_LE(fd_test::max_abs_diff(eager_off.at(name), g), 1e-6 * fd_test::max_abs(g) + 1e-12)
          << "offload of " << blocks << " blocks " << name;
    }
    EXPECT_GT(m->offloaded_bytes(), offloaded_two) << blocks;
    offloaded_two = m->offloaded_bytes();
  }
  m->set_activation_offload(true, std::size_t{1} << 40, -1);
  (void)lora_grads(*m, r);
  EXPECT_EQ(m->offloaded_tensors(), 0);
  EXPECT_NE(fd_test::error_of([&] { m->set_activation_offload(true, 0, -3); }).find("set_activation_offload"),
            std::string::npos);
  m->set_activation_offload(false);
  EXPECT_EQ(m->gradient_checkpointing_blocks(), 0);
  EXPECT_FALSE(fd_test::error_of([&] { m->set_gradient_checkpointing(-2); }).empty());
}

// Block swapping (models/block_budget.h): swapped blocks run with their frozen weights uploaded from
// host memory and recomputed in backward; the output and adapter gradients are those of the plain
// model, with resident blocks checkpointed or not, with 8-bit weights, and without grad.
TEST(ModelsFlux, BlockSwapGivesThePlainModelsOutputAndGradients) {
  FD_SKIP_IF_NO_DEVICE();
  const Reference r = load_reference();
  auto m = load("transformer");
  add_reference_lora(*m, r);
  Tensor plain_loss;
  const auto plain = lora_grads(*m, r, &plain_loss);
  Tensor plain_out;
  {
    flame::NoGradGuard ng;
    plain_out = run(*m, r);
  }
  ASSERT_EQ(m->stack_blocks().size(), 4u);  // 2 double + 2 single blocks
  flame::offload::BlockSwap& swap = m->enable_block_swap(fd_test::test_device());
  EXPECT_EQ(&swap, &m->enable_block_swap(fd_test::test_device()));
  for (const auto& [swapped, ckpt] : std::vector<std::pair<std::vector<bool>, int64_t>>{
           {{false, true, false, true}, 0}, {{true, true, true, true}, 0}, {{true, false, false, true}, 2}}) {
    swap.set_swapped(swapped);
    m->set_checkpointed_blocks(ckpt);
    Tensor loss;
    const auto g = lora_grads(*m, r, &loss);
    EXPECT_LE(fd_test::max_abs_diff(loss, plain_loss), 1e-6 * fd_test::max_abs(plain_loss));
    for (const auto& [name, want] : plain) {
      EXPECT_LE(fd_test::max_abs_diff(g.at(name), want), 1e-6 * fd_test::max_abs(want) + 1e-12) << name;
    }
    flame::NoGradGuard ng;
    EXPECT_LE(fd_test::max_abs_diff(run(*m, r), plain_out), 1e-6 * fd_test::max_abs(plain_out));
  }
  EXPECT_EQ(swap.report().swapped, 2u);
  EXPECT_GT(swap.report().uploads, 0);
  const std::size_t f32_bytes = swap.frozen_bytes(0);
  // The 8-bit base swaps its codes and scales.
  m->disable_block_swap();
  EXPECT_EQ(m->block_swap(), nullptr);
  (void)flame::nn::quantize_float8(*m);
  Tensor q_loss;
  const auto q_plain = lora_grads(*m, r, &q_loss);
  m->enable_block_swap(fd_test::test_device()).set_swapped({true, false, true, false});
  EXPECT_LT(m->block_swap()->frozen_bytes(0), f32_bytes / 2);
  Tensor q_swapped_loss;
  const auto q_swapped = lora_grads(*m, r, &q_swapped_loss);
  EXPECT_LE(fd_test::max_abs_diff(q_swapped_loss, q_loss), 1e-6 * fd_test::max_abs(q_loss));
  for (const auto& [name, want] : q_plain) {
    EXPECT_LE(fd_test::max_abs_diff(q_swapped.at(name), want), 1e-6 * fd_test::max_abs(want) + 1e-12) << name;
  }
}

TEST(ModelsFlux, Bf16ForwardFollowsF32) {
  FD_SKIP_IF_NO_DEVICE();
  const Reference r = load_reference();
  auto m = load("transformer", {.dtype = DType::bf16});
  const Tensor out = m->forward(r["input.hidden_states"].to(DType::bf16), r["input.encoder_hidden_states"].to(DType::bf16),
                                r["input.pooled_projections"].to(DType::bf16), r["input.timestep"], r["input.img_ids"],
                                r["input.txt_ids"], r["input.guidance"]);
  EXPECT_EQ(out.dtype(), DType::bf16);
  // The f32 model on the bf16-rounded times (the model casts them to its dtype before the x1000, as
  // diffusers does): what is left is bf16's rounding of weights and activations. diffusers' own bf16
  // run of this model is 0.084 off its f32 one (max |out| 1.77, 4.7%): allow 6%.
  auto f32 = load("transformer");
  const Tensor want = f32->forward(r["input.hidden_states"], r["input.encoder_hidden_states"],
                                   r["input.pooled_projections"], r["input.timestep"].to(DType::bf16).to(DType::f32),
                                   r["input.img_ids"], r["input.txt_ids"],
                                   r["input.guidance"].to(DType::bf16).to(DType::f32));
  expect_close(out.to(DType::f32), want, 6e-2, 0.0, "bf16 output");
}

// The rotary tables are computed once for ids that stay the same tensors (no host read per step,
// which a CUDA graph capture could not hold), and again after an in-place edit of the ids.
TEST(ModelsFlux, RotaryTablesFollowTheIds) {
  FD_SKIP_IF_NO_DEVICE();
  const Reference r = load_reference();
  auto m = load("transformer");
  auto run = [&](const Tensor& img_ids) {
    flame::NoGradGuard no_grad;
    return m->forward(r["input.hidden_states"], r["input.encoder_hidden_states"], r["input.pooled_projections"],
                      r["input.timestep"], img_ids, r["input.txt_ids"], r["input.guidance"]);
  };
  Tensor ids = r["input.img_ids"].clone();
  const Tensor a = run(ids), b = run(ids);
  EXPECT_EQ(fd_test::max_abs_diff(a, b), 0.0);
  ids.mul_(2.0);  // the same tensor, new positions
  const Tensor c = run(ids), d = run(ids.clone());
  EXPECT_EQ(fd_test::max_abs_diff(c, d), 0.0) << "the edited ids give what fresh ids give";
  EXPECT_GT(fd_test::max_abs_diff(a, c), 1e-4) << "the positions changed the output";
}

// ---- errors ----
TEST(ModelsFlux, ForwardErrorsNameTheInput) {
  const Reference r = load_reference();
  auto m = load("transformer");
  const std::string no_guidance = fd_test::error_of([&] {
    m->forward(r["input.hidden_states"], r["input.encoder_hidden_states"], r["input.pooled_projections"],
               r["input.timestep"], r["input.img_ids"], r["input.txt_ids"]);
  });
  EXPECT_NE(no_guidance.find("guidance"), std::string::npos) << no_guidance;
  const std::string ids = fd_test::error_of([&] {
    m->forward(r["input.hidden_states"], r["input.encoder_hidden_states"], r["input.pooled_projections"],
               r["input.timestep"], fm::flux_img_ids(4, 4), r["input.txt_ids"], r["input.guidance"]);
  });
  EXPECT_NE(ids.find("img_ids"), std::string::npos) << ids;
  const std::string width = fd_test::error_of([&] {
    m->forward(r["input.hidden_states"], Tensor::zeros({2, 5, 7}), r["input.pooled_projections"], r["input.timestep"],
               r["input.img_ids"], r["input.txt_ids"], r["input.guidance"]);
  });
  EXPECT_NE(width.find("encoder_hidden_states"), std::string::npos) << width;
}

TEST(ModelsFlux, LoaderErrorsNameFileFamilyAndKeys) {
  const auto tmp = fd_test::fresh_temp_dir("flux", "errors");
  const flame::StateDict original = flame::io::load_safetensors((tiny_dir() / "flux_original.safetensors").string());
  const auto tiny = fm::flux_preset("tiny-flux");
  // A missing key: named, with the file and the family.
  {
    flame::StateDict d;
    for (const auto& [k, t] : original) {
      if (k != "double_blocks.1.txt_attn.qkv.bias") d.insert(k, t);
    }
    const std::string path = (tmp / "missing.safetensors").string();
    flame::io::save_safetensors(path, d);
    const std::string e = fd_test::error_of([&] { fm::load_flux(path, {.config = tiny}); });
    EXPECT_NE(e.find("double_blocks.1.txt_attn.qkv.bias"), std::string::npos) << e;
    EXPECT_NE(e.find("missing.safetensors"), std::string::npos) << e;
    EXPECT_NE(e.find("flux-original"), std::string::npos) << e;
  }
  // A wrong shape (a config of another width): the key and both shapes.
  {
    fm::FluxTransformerConfig wide = tiny;
    wide.joint_attention_dim = 32;
    const std::string e =
        fd_test::error_of([&] { fm::load_flux((tiny_dir() / "flux_original.safetensors").string(), {.config = wide}); });
    EXPECT_NE(e.find("txt_in.weight"), std::string::npos) << e;
    EXPECT_NE(e.find("[16, 32]"), std::string::npos) << e;
    EXPECT_NE(e.find("[16, 24]"), std::string::npos) << e;
  }
  // An unplaced stored key.
  {
    flame::StateDict d;
    for (const auto& [k, t] : original) d.insert(k, t);
    d.insert("double_blocks.0.img_attn.extra.weight", Tensor::zeros({2}));
    const std::string path = (tmp / "extra.safetensors").string();
    flame::io::save_safetensors(path, d);
    const std::string e = fd_test::error_of([&] { fm::load_flux(path, {.config = tiny}); });
    EXPECT_NE(e.find("double_blocks.0.img_attn.extra.weight"), std::string::npos) << e;
    EXPECT_NO_THROW(fm::load_flux(path, {.config = tiny, .allow_unplaced = true}));
  }
  // Another family's file (a UNet): the formats tried and the keys seen.
  {
    flame::StateDict d;
    d.insert("conv_in.weight", Tensor::zeros({4, 4, 3, 3}));
    d.insert("time_embedding.linear_1.weight", Tensor::zeros({8, 4}));
    const std::string path = (tmp / "unet.safetensors").string();
    flame::io::save_safetensors(path, d);
    const std::string e = fd_test::error_of([&] { fm::load_flux(path); });
    EXPECT_NE(e.find("flux-original"), std::string::npos) << e;
    EXPECT_NE(e.find("conv_in.weight"), std::string::npos) << e;
  }
  // A single file of an unknown head dim: the config is asked for.
  {
    const std::string e = fd_test::error_of([&] { fm::load_flux((tiny_dir() / "flux_original.safetensors").string()); });
    EXPECT_NE(e.find("give the config"), std::string::npos) << e;
  }
  std::filesystem::remove_all(tmp);
}
