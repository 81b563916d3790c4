// SD3Transformer2DModel (models/sd3.h): presets against the published configurations and
// parameter counts, config.json, the position table, parity with diffusers on the reduced
// configurations tiny-sd3 (SD3-Medium's shape) and tiny-sd35m (SD3.5's QK norm and dual attention)
// from every stored layout (sharded diffusers folder, prefixed single file with another model's
// keys, bare fp8, prefixed fp8-scaled), a PEFT LoRA's output and adapter gradients, per-block
// gradient checkpointing, variant detection and the loaders' errors. The references are written by
// apps/diffusion/reference/models_sd3.py (diffusers 0.42, torch 2.15, f32 on the CPU).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <flame/amp.h>
#include <flame/io/safetensors.h>

#include "model_test_util.h"
#include "models/sd3.h"

namespace fm = flame_diffusion::models;
namespace nn = flame::nn;
using flame::DType;
using flame::Tensor;

namespace {

std::filesystem::path reference_dir(const std::string& name) {
  return std::filesystem::path(__FILE__).parent_path() / "data" / "models" / name;
}

// The parameter count the configuration implies, from diffusers' module tree (Note [SD3 layout]).
int64_t expected_parameters(const fm::SD3TransformerConfig& c) {
  const int64_t d = c.inner_dim(), p = c.patch_size;
  auto lin = [](int64_t in, int64_t out) { return in * out + out; };
  int64_t n = c.in_channels * d * p * p + d;                                   // pos_embed.proj
  n += lin(256, d) + lin(d, d) + lin(c.pooled_projection_dim, d) + lin(d, d);  // time_text_embed
  n += lin(c.joint_attention_dim, d);                                          // context_embedder
  const bool qk = c.qk_norm == "rms_norm";
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const bool last = i == c.num_layers - 1, dual = c.dual_attention(i);
    n += lin(d, (dual ? 9 : 6) * d) + lin(d, (last ? 2 : 6) * d);                       // norm1, norm1_context
    n += 7 * lin(d, d) + (last ? 0 : lin(d, d)) + (qk ? 4 * c.attention_head_dim : 0);  // attn
    if (dual) n += 4 * lin(d, d) + (qk ? 2 * c.attention_head_dim : 0);                 // attn2
    n += (last ? 1 : 2) * (lin(d, 4 * d) + lin(4 * d, d));                              // ff, ff_context
  }
  return n + lin(d, 2 * d) + lin(d, p * p * c.out_channels);  // norm_out, proj_out
}

struct Reference {
  flame::StateDict t;
  std::map<std::string, std::string> meta;
  const Tensor& operator[](const std::string& k) const { return t.at(k); }
};

Reference load_reference(const std::string& name) {
  const std::string path = (reference_dir(name) / "reference.safetensors").string();
  return {flame::io::load_safetensors(path, fd_test::test_device()), flame::io::load_safetensors_metadata(path)};
}

Tensor run(fm::SD3Transformer2DModel& m, const Reference& r) {
  return m.forward(r["input.hidden_states"], r["input.encoder_hidden_states"], r["input.pooled_projections"],
                   r["input.timestep"]);
}

fm::SD3LoadOptions on_device() { return {.device = fd_test::test_device()}; }

// Adds the reference's LoRA (rank/alpha from its metadata, its stored A and B weights), the
// adapters in `adapter_dtype` when given (else the model's).
void add_reference_lora(fm::SD3Transformer2DModel& m, const Reference& r,
                        std::optional<DType> adapter_dtype = std::nullopt) {
  m.add_lora({.rank = std::stoll(r.meta.at("lora_rank")), .alpha = std::stod(r.meta.at("lora_alpha"))});
  for (const auto& mod : m.modules()) {
    if (auto* lin = dynamic_cast<nn::Linear*>(mod.get()); adapter_dtype && lin && lin->has_lora()) {
      lin->lora_A()->to(*adapter_dtype);
      lin->lora_B()->to(*adapter_dtype);
    }
  }
  flame::StateDict lora;
  for (const auto& [k, t] : r.t) {
    if (k.rfind("lora.", 0) == 0) lora.insert(k.substr(5), t);
  }
  nn::load_lora_state_dict(m, lora);
}

const std::vector<std::string> kTiny = {"sd3-tiny", "sd3-tiny35m"};

}  // namespace

TEST(ModelsSD3, PresetsAreThePublishedConfigurations) {
  const auto m = fm::sd3_preset("sd3-medium");
  EXPECT_EQ(m.num_layers, 24);
  EXPECT_EQ(m.inner_dim(), 1536);
  EXPECT_EQ(m.pos_embed_max_size, 192);
  EXPECT_TRUE(m.qk_norm.empty());
  EXPECT_TRUE(m.dual_attention_layers.empty());
  const auto m35 = fm::sd3_preset("sd3.5-medium");
  EXPECT_EQ(m35.pos_embed_max_size, 384);
  EXPECT_EQ(m35.qk_norm, "rms_norm");
  EXPECT_EQ(m35.dual_attention_layers, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}));
  const auto l35 = fm::sd3_preset("sd3.5-large");
  EXPECT_EQ(l35.num_layers, 38);
  EXPECT_EQ(l35.inner_dim(), 2432);
  EXPECT_EQ(l35.caption_projection_dim, 2432);
  EXPECT_EQ(l35.pos_embed_max_size, 192);
  for (const auto& c : {m, m35, l35}) {
    EXPECT_EQ(c.in_channels, 16);
    EXPECT_EQ(c.joint_attention_dim, 4096);
    EXPECT_EQ(c.pooled_projection_dim, 2048);
  }
  // diffusers' SD3Transformer2DModel of each configuration (built on the meta device): parameters.
  EXPECT_EQ(expected_parameters(m), 2028328000);
  EXPECT_EQ(expected_parameters(m35), 2243171520);
  EXPECT_EQ(expected_parameters(l35), 8056627520);
  for (const char* name : {"sd3-medium", "sd3.5-medium", "sd3.5-large"})
    EXPECT_EQ(fm::sd3_family_of(fm::sd3_preset(name)), name);
  EXPECT_NE(fd_test::error_of([] { fm::sd3_preset("sd3-large"); }).find("sd3.5-large"), std::string::npos);
}

TEST(ModelsSD3, ConfigJsonAndModelShape) {
  for (const std::string& name : kTiny) {
    const auto dir = reference_dir(name);
    if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " absent (models_sd3.py writes it)";
    const auto c = fm::sd3_config_from_file((dir / "transformer" / "config.json").string());
    EXPECT_EQ(fm::SD3Transformer2DModel(c).num_parameters(), expected_parameters(c)) << name;
    EXPECT_EQ(c.inner_dim(), 16);
    EXPECT_EQ(c.in_channels, 4);
    if (name == "sd3-tiny35m") {
      EXPECT_EQ(c.qk_norm, "rms_norm");
      EXPECT_EQ(c.dual_attention_layers, (std::vector<int64_t>{0, 1}));
      EXPECT_EQ(c.pos_embed_max_size, 11);
    } else {
      EXPECT_TRUE(c.qk_norm.empty());
      EXPECT_TRUE(c.dual_attention_layers.empty());
    }
  }
  // diffusers' serialisation of the SD3.5-Medium config, and SD3-Medium's as diffusers 0.29 wrote
  // it (before qk_norm and dual_attention_layers existed): the presets.
  auto same = [](const fm::SD3TransformerConfig& a, const fm::SD3TransformerConfig& b) {
    return a.sample_size == b.sample_size && a.patch_size == b.patch_size && a.in_channels == b.in_channels &&
           a.num_layers == b.num_layers && a.attention_head_dim == b.attention_head_dim &&
           a.num_attention_heads == b.num_attention_heads && a.joint_attention_dim == b.joint_attention_dim &&
           a.caption_projection_dim == b.caption_projection_dim && a.pooled_projection_dim == b.pooled_projection_dim &&
           a.out_channels == b.out_channels && a.pos_embed_max_size == b.pos_embed_max_size &&
           a.dual_attention_layers == b.dual_attention_layers && a.qk_norm == b.qk_norm;
  };
  EXPECT_TRUE(same(fm::sd3_config_from_json(fm::JsonConfig::parse(R"({
    "_class_name": "SD3Transformer2DModel", "_diffusers_version": "0.42.0", "attention_head_dim": 64,
    "caption_projection_dim": 1536, "dual_attention_layers": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    "in_channels": 16, "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 24, "out_channels": 16,
    "patch_size": 2, "pooled_projection_dim": 2048, "pos_embed_max_size": 384, "qk_norm": "rms_norm",
    "sample_size": 128})",
                                                                  "sd3.5-medium.json")),
                   fm::sd3_preset("sd3.5-medium")));
  EXPECT_TRUE(same(fm::sd3_config_from_json(fm::JsonConfig::parse(R"({
    "_class_name": "SD3Transformer2DModel", "_diffusers_version": "0.29.0.dev0", "attention_head_dim": 64,
    "caption_projection_dim": 1536, "in_channels": 16, "joint_attention_dim": 4096, "num_attention_heads": 24,
    "num_layers": 24, "out_channels": 16, "patch_size": 2, "pooled_projection_dim": 2048, "pos_embed_max_size": 192,
    "sample_size": 128})",
                                                                  "sd3-medium.json")),
                   fm::sd3_preset("sd3-medium")));
  // Errors name the file and the key.
  const auto err = [](const std::string& text) {
    return fd_test::error_of([&] { fm::sd3_config_from_json(fm::JsonConfig::parse(text, "cfg.json")); });
  };
  EXPECT_NE(err(R"({"pos_embed_max_size": 8, "use_rope": true})").find("\"use_rope\""), std::string::npos);
  EXPECT_NE(err(R"({"pos_embed_max_size": 8, "caption_projection_dim": 100})").find("caption_projection_dim 100"),
            std::string::npos);
  EXPECT_NE(err(R"({"pos_embed_max_size": 8, "qk_norm": "layer_norm"})").find("qk_norm"), std::string::npos);
  EXPECT_NE(err(R"({"num_layers": 2})").find("pos_embed_max_size"), std::string::npos);
  EXPECT_NE(err(R"({"_class_name": "FluxTransformer2DModel", "pos_embed_max_size": 8})").find("FluxTransformer2DModel"),
            std::string::npos);
}

// The buffer diffusers stores (its fixed table; the reference perturbs parameters only) against
// the one FLAME computes.
TEST(ModelsSD3, PositionTableMatchesDiffusers) {
  for (const std::string& name : kTiny) {
    const auto dir = reference_dir(name);
    if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " absent";
    const auto ck = fm::Checkpoint::open(dir.string(), {.subfolder = "transformer"});
    const Tensor stored = ck.load("pos_embed.pos_embed");
    const fm::SD3Transformer2DModel m(fm::sd3_config_from_json(*ck.config()));
    ASSERT_EQ(m.pos_embed->pos_embed.sizes(), stored.sizes());
    EXPECT_LT(fd_test::max_abs_diff(m.pos_embed->pos_embed, stored), 1e-6) << name;
  }
  // Closed form at one entry: grid 4, base 2 (positions i / 2), dim 8: patch (row 3, col 1) holds
  // [sin(0.5), sin(0.5 / 100), cos(0.5), cos(0.5 / 100), sin(1.5), sin(0.015), cos(1.5), cos(0.015)].
  const Tensor t = fm::sd3_sincos_pos_embed(8, 4, 2);
  const std::vector<double> want = {std::sin(0.5), std::sin(0.005), std::cos(0.5), std::cos(0.005),
                                    std::sin(1.5), std::sin(0.015), std::cos(1.5), std::cos(0.015)};
  for (int64_t i = 0; i < 8; ++i)
    EXPECT_NEAR(t[3 * 4 + 1][i].item<double>(), want[static_cast<std::size_t>(i)], 1e-7) << i;
}

TEST(ModelsSD3, OutputsMatchDiffusersFromEveryLayout) {
  FD_SKIP_IF_NO_DEVICE();
  for (const std::string& name : kTiny) {
    const auto dir = reference_dir(name);
    if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " absent";
    const Reference r = load_reference(name);
    flame::NoGradGuard no_grad;
    const std::vector<std::pair<std::string, std::string>> files = {
        {dir.string(), "output.sample"},
        {(dir / "sd3_original.safetensors").string(), "output.sample"},
        {(dir / "sd3_fp8.safetensors").string(), "output.fp8_sample"},
        {(dir / "sd3_fp8_scaled.safetensors").string(), "output.fp8_scaled_sample"}};
    for (const auto& [path, key] : files) {
      auto m = fm::load_sd3(path, on_device());
      const Tensor out = run(*m, r);
      ASSERT_EQ(out.sizes(), r[key].sizes()) << path;
      const double err = fd_test::max_abs_diff(out, r[key]);
      EXPECT_LT(err, 2e-5 * fd_test::max_abs(r[key])) << name << " " << path << " vs " << key;
      // The fp8 outputs differ from the f32 one by far more than that: each file is its own check.
      if (key != "output.sample") EXPECT_GT(fd_test::max_abs_diff(out, r["output.sample"]), 1e-3) << path;
    }
  }
}

// SD3LoadOptions::float8: the fp8 files load into 8-bit Linears with their codes (the split qkv and
// the swapped final adaLN move rows of codes) and give the same outputs as the decoded weights.
TEST(ModelsSD3, Fp8FilesLoadAsEightBitWeights) {
  FD_SKIP_IF_NO_DEVICE();
  for (const std::string& name : kTiny) {
    const auto dir = reference_dir(name);
    if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " absent";
    const Reference r = load_reference(name);
    flame::NoGradGuard no_grad;
    for (const auto& [file, key] : {std::pair<std::string, std::string>{"sd3_fp8.safetensors", "output.fp8_sample"},
                                    {"sd3_fp8_scaled.safetensors", "output.fp8_scaled_sample"}}) {
      fm::SD3LoadOptions o = on_device();
      o.float8 = flame::nn::Float8Options{};
      auto m = fm::load_sd3((dir / file).string(), o);
      int64_t linears = 0, eight = 0;
      for (const auto& [n, mod] : m->named_modules()) {
        if (auto* l = dynamic_cast<flame::nn::Linear*>(mod.get())) {
          ++linears;
          eight += l->is_float8();
        }
      }
      EXPECT_EQ(eight, linears) << name << " " << file;
      const Tensor out = run(*m, r);
      EXPECT_LT(fd_test::max_abs_diff(out, r[key]), 2e-5 * fd_test::max_abs(r[key])) << name << " " << file;
    }
  }
}

TEST(ModelsSD3, LoraOutputAndGradientsMatchPeft) {
  FD_SKIP_IF_NO_DEVICE();
  for (const std::string& name : kTiny) {
    const auto dir = reference_dir(name);
    if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " absent";
    const Reference r = load_reference(name);
    auto m = fm::load_sd3((dir / "sd3_original.safetensors").string(), on_device());
    add_reference_lora(*m, r);
    int64_t adapters = 0;
    for (const auto& [k, t] : r.t) adapters += k.rfind("grad.", 0) == 0;
    int64_t trainable = 0;
    for (const auto& [n, p] : m->named_parameters()) trainable += p.requires_grad();
    EXPECT_EQ(trainable, adapters) << name;  // attn (and SD3.5's attn2) to_q/k/v/out.0, nothing else
    const Tensor out = run(*m, r);
    EXPECT_LT(fd_test::max_abs_diff(out, r["output.lora_sample"]), 2e-5 * fd_test::max_abs(r["output.lora_sample"]));
    const Tensor loss = flame::mse_loss(out, r["input.target"]);
    EXPECT_NEAR(loss.item<double>(), r["output.loss"][0].item<double>(), 1e-5);
    const flame::Gradients g = loss.backward();
    for (const auto& [n, p] : m->named_parameters()) {
      if (!p.requires_grad()) continue;
      const Tensor& want = r["grad." + n];
      EXPECT_LT(fd_test::max_abs_diff(g.get(p), want), 1e-4 * fd_test::max_abs(want) + 1e-7) << name << " " << n;
    }
  }
}

TEST(ModelsSD3, GradientCheckpointingGivesTheSameGradients) {
  FD_SKIP_IF_NO_DEVICE();
  const std::string name = "sd3-tiny35m";
  const auto dir = reference_dir(name);
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " absent";
  const Reference r = load_reference(name);
  std::vector<std::vector<Tensor>> grads;
  // none, the first block, every block (the last is context_pre_only), every block with their
  // inputs offloaded (on the CPU: cloned, the same logic).
  for (int64_t blocks : {0, 1, -1, -2}) {
    auto m = fm::load_sd3(dir.string(), on_device());
    add_reference_lora(*m, r);
    m->set_gradient_checkpointing(blocks != 0, blocks == -2 ? -1 : blocks);
    m->set_activation_offload(blocks == -2, 0);
    EXPECT_EQ(m->checkpointed_blocks(), blocks == 0 ? 0 : blocks == 1 ? 1 : 3);
    const Tensor loss = flame::mse_loss(run(*m, r), r["input.target"]);
    if (blocks == -2) {
      // Each checkpointed block keeps its inputs x [2, 24, 16], context [2, 5, 16], temb [2, 16] (f32).
      EXPECT_EQ(m->offloaded_tensors(), 3 * 3);
      EXPECT_EQ(m->offloaded_bytes(), 3u * (2 * 24 * 16 + 2 * 5 * 16 + 2 * 16) * 4);
    } else {
      EXPECT_EQ(m->offloaded_tensors(), 0);
    }
    const flame::Gradients g = loss.backward();
    grads.emplace_back();
    for (const auto& p : m->parameters()) {
      if (p.requires_grad()) grads.back().push_back(g.get(p));
    }
  }
  for (std::size_t k = 1; k < grads.size(); ++k) {
    ASSERT_EQ(grads[k].size(), grads[0].size());
    for (std::size_t i = 0; i < grads[0].size(); ++i)
      EXPECT_LT(fd_test::max_abs_diff(grads[k][i], grads[0][i]), 1e-6) << "setting " << k << " tensor " << i;
  }
}


// Block swapping (models/block_budget.h): the same gradients with blocks swapped, the last one
// (context_pre_only) among them.
TEST(ModelsSD3, BlockSwapGivesTheSameGradients) {
  FD_SKIP_IF_NO_DEVICE();
  const std::string name = "sd3-tiny35m";
  const auto dir = reference_dir(name);
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " absent";
  const Reference r = load_reference(name);
  auto m = fm::load_sd3(dir.string(), on_device());
  add_reference_lora(*m, r);
  const auto grads = [&] {
    const flame::Gradients g = flame::mse_loss(run(*m, r), r["input.target"]).backward();
    std::vector<Tensor> out;
    for (const auto& p : m->parameters()) {
      if (p.requires_grad()) out.push_back(g.get(p));
    }
    return out;
  };
  const std::vector<Tensor> plain = grads();
  ASSERT_EQ(m->stack_blocks().size(), 3u);
  m->enable_block_swap(fd_test::test_device()).set_swapped({true, false, true});
  const std::vector<Tensor> swapped = grads();
  ASSERT_EQ(swapped.size(), plain.size());
  for (std::size_t i = 0; i < plain.size(); ++i)
    EXPECT_LT(fd_test::max_abs_diff(swapped[i], plain[i]), 1e-6) << "tensor " << i;
  EXPECT_EQ(m->block_swap()->report().uploads, 4);  // blocks 0 and 2, forward and backward
}
TEST(ModelsSD3, DetectsLayoutAndVariantFromKeys) {
  for (const std::string& name : kTiny) {
    const auto dir = reference_dir(name);
    if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " absent";
    const auto want = fm::sd3_config_from_file((dir / "transformer" / "config.json").string());
    struct Case {
      std::string file, format, prefix;
      bool fp8;
    };
    for (const Case& c : {Case{"", "sd3-diffusers", "", false},
                          Case{"sd3_original.safetensors", "sd3-original", "model.diffusion_model.", false},
                          Case{"sd3_fp8.safetensors", "sd3-original", "", true},
                          Case{"sd3_fp8_scaled.safetensors", "sd3-original", "model.diffusion_model.", true}}) {
      const auto ck = fm::Checkpoint::open((dir / c.file).string(), {.subfolder = "transformer"});
      const fm::SD3FileInfo info = fm::inspect_sd3(ck);
      EXPECT_EQ(info.format, c.format) << c.file;
      EXPECT_EQ(info.prefix, c.prefix) << c.file;
      EXPECT_EQ(info.fp8, c.fp8) << c.file;
      EXPECT_EQ(info.family, "custom");
      // The configuration read from a single file's shapes is the config.json's (sample_size aside,
      // which only lays out the position table the file carries).
      EXPECT_EQ(info.config.num_layers, want.num_layers) << c.file;
      EXPECT_EQ(info.config.num_attention_heads * info.config.attention_head_dim, want.inner_dim()) << c.file;
      EXPECT_EQ(info.config.pos_embed_max_size, want.pos_embed_max_size) << c.file;
      EXPECT_EQ(info.config.qk_norm, want.qk_norm) << c.file;
      EXPECT_EQ(info.config.dual_attention_layers, want.dual_attention_layers) << c.file;
      EXPECT_EQ(info.config.in_channels, want.in_channels) << c.file;
      EXPECT_EQ(info.config.out_channels, want.out_channels) << c.file;
      EXPECT_EQ(info.config.joint_attention_dim, want.joint_attention_dim) << c.file;
      EXPECT_EQ(info.config.pooled_projection_dim, want.pooled_projection_dim) << c.file;
    }
  }
}

TEST(ModelsSD3, LoaderErrorsNameTheProblem) {
  const auto dir = reference_dir("sd3-tiny35m");
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " absent";
  const auto tmp = fd_test::fresh_temp_dir("sd3", "errors");
  flame::StateDict sd = flame::io::load_safetensors((dir / "sd3_original.safetensors").string());
  // A block key missing: named, with the key it would have given.
  {
    flame::StateDict cut;
    for (const auto& [k, t] : sd) {
      if (k != "model.diffusion_model.joint_blocks.1.x_block.attn2.proj.weight") cut.insert(k, t);
    }
    const std::string path = (tmp / "cut.safetensors").string();
    flame::io::save_safetensors(path, cut);
    const std::string e = fd_test::error_of([&] { fm::load_sd3(path); });
    EXPECT_NE(e.find("joint_blocks.1.x_block.attn2.proj.weight"), std::string::npos) << e;
    EXPECT_NE(e.find("transformer_blocks.1.attn2.to_out.0.weight"), std::string::npos) << e;
  }
  // A transformer key no parameter takes: unplaced, named.
  {
    flame::StateDict extra = sd;
    extra.insert("model.diffusion_model.joint_blocks.0.x_block.attn.extra.weight", Tensor::zeros({2}));
    const std::string path = (tmp / "extra.safetensors").string();
    flame::io::save_safetensors(path, extra);
    const std::string e = fd_test::error_of([&] { fm::load_sd3(path); });
    EXPECT_NE(e.find("unplaced"), std::string::npos) << e;
    EXPECT_NE(e.find("attn.extra.weight"), std::string::npos) << e;
    EXPECT_NO_THROW(fm::load_sd3(path, {.allow_unplaced = true}));
  }
  // A given config that does not fit the file: shape errors per key.
  {
    fm::SD3TransformerConfig c = fm::sd3_config_from_file((dir / "transformer" / "config.json").string());
    c.dual_attention_layers = {0};
    const std::string e =
        fd_test::error_of([&] { fm::load_sd3((dir / "sd3_original.safetensors").string(), {.config = c}); });
    EXPECT_NE(e.find("unplaced: stored model.diffusion_model.joint_blocks.1.x_block.attn2"), std::string::npos) << e;
  }
  // Not an SD3 file: the formats tried and the file's keys.
  {
    flame::StateDict other;
    other.insert("double_blocks.0.img_attn.qkv.weight", Tensor::zeros({6, 2}));
    const std::string path = (tmp / "flux.safetensors").string();
    flame::io::save_safetensors(path, other);
    const std::string e = fd_test::error_of([&] { fm::load_sd3(path); });
    EXPECT_NE(e.find("sd3-original"), std::string::npos) << e;
    EXPECT_NE(e.find("double_blocks.0.img_attn.qkv.weight"), std::string::npos) << e;
  }
  // Inputs the model cannot take.
  {
    auto m = fm::load_sd3(dir.string());
    const Reference r = load_reference("sd3-tiny35m");
    const Tensor ctx = r["input.encoder_hidden_states"].to(flame::Device::cpu());
    const Tensor pooled = r["input.pooled_projections"].to(flame::Device::cpu());
    const Tensor t = r["input.timestep"].to(flame::Device::cpu());
    flame::NoGradGuard no_grad;
    auto err = [&](const Tensor& x, const Tensor& c) {
      return fd_test::error_of([&] { m->forward(x, c, pooled, t); });
    };
    EXPECT_NE(err(Tensor::zeros({2, 4, 7, 8}), ctx).find("multiples of the patch size 2"), std::string::npos);
    EXPECT_NE(err(Tensor::zeros({2, 4, 24, 8}), ctx).find("at most 11 x 11"), std::string::npos);
    EXPECT_NE(err(Tensor::zeros({2, 4, 8, 8}), Tensor::zeros({2, 5, 13})).find("joint_attention_dim"),
              std::string::npos);
  }
  std::filesystem::remove_all(tmp);
}

// The timed step's setting (sd3_parity time): bf16 weights, f32 adapters, bf16 autocast; the output
// and the adapters' gradients within bf16 tolerance of diffusers' f32 ones, the gradients in f32.
TEST(ModelsSD3, Bf16AutocastWithF32AdaptersTracksF32) {
  FD_SKIP_IF_NO_DEVICE();
  const std::string name = "sd3-tiny35m";
  const auto dir = reference_dir(name);
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " absent";
  const Reference r = load_reference(name);
  const flame::Device dev = fd_test::test_device();
  auto m = fm::load_sd3(dir.string(), {.device = dev, .dtype = DType::bf16});
  add_reference_lora(*m, r, DType::f32);
  m->set_gradient_checkpointing(true);
  Tensor out;
  {
    flame::amp::AutocastGuard autocast(DType::bf16, dev.is_cuda() ? flame::DeviceType::cuda : flame::DeviceType::cpu);
    out = m->forward(r["input.hidden_states"].to(DType::bf16), r["input.encoder_hidden_states"].to(DType::bf16),
                     r["input.pooled_projections"].to(DType::bf16), r["input.timestep"]);
  }
  EXPECT_EQ(out.dtype(), DType::bf16);
  EXPECT_LT(fd_test::max_abs_diff(out, r["output.lora_sample"]), 5e-2 * fd_test::max_abs(r["output.lora_sample"]));
  const Tensor loss = flame::mse_loss(out.to(DType::f32), r["input.target"]);
  const flame::Gradients g = loss.backward();
  double err = 0, ref = 0;
  for (const auto& [n, p] : m->named_parameters()) {
    if (!p.requires_grad()) continue;
    EXPECT_EQ(g.get(p).dtype(), DType::f32) << n;
    err = std::max(err, fd_test::max_abs_diff(g.get(p), r["grad." + n]));
    ref = std::max(ref, fd_test::max_abs(r["grad." + n]));
  }
  EXPECT_LT(err, 1e-1 * ref);
}
