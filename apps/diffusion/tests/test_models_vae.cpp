// AutoencoderKL (models/vae.h) at reduced configurations: diffusers' parameter names and count,
// every stored layout loading to the same parameters, family guessing, load errors, tiling,
// latent scaling, sampling, f16 upcast, and parity with diffusers through stored reference outputs
// (apps/diffusion/reference/models_vae.py writes them; the test skips while they are absent).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

#include <flame/flame.h>
#include <flame/io/safetensors.h>
#include <flame/nn.h>

#include "model_test_util.h"
#include "models/vae.h"

namespace fs = std::filesystem;
namespace m = flame_diffusion::models;
using flame::DType;
using flame::Tensor;

namespace {

fs::path temp_dir(const std::string& name) { return fd_test::fresh_temp_dir("flame_vae", name); }
using fd_test::error_of;
using fd_test::write_text;

// The reduced configuration of the CPU tests: two levels of 16 and 32 channels, 8 norm groups.
m::VaeConfig tiny_config(int64_t latent = 4) {
  m::VaeConfig c = m::VaeConfig::preset(latent == 4 ? "sdxl" : "flux");
  c.block_out_channels = {16, 32};
  c.layers_per_block = 1;
  c.norm_num_groups = 8;
  c.sample_size = 32;
  return c;
}

std::string config_json(const m::VaeConfig& c) {
  std::string j = "{\"_class_name\": \"AutoencoderKL\", \"block_out_channels\": [";
  for (std::size_t i = 0; i < c.block_out_channels.size(); ++i)
    j += (i ? ", " : "") + std::to_string(c.block_out_channels[i]);
  j += "], \"down_block_types\": [\"DownEncoderBlock2D\", \"DownEncoderBlock2D\"], \"up_block_types\": "
       "[\"UpDecoderBlock2D\", \"UpDecoderBlock2D\"], \"layers_per_block\": " +
       std::to_string(c.layers_per_block) + ", \"latent_channels\": " + std::to_string(c.latent_channels) +
       ", \"norm_num_groups\": " + std::to_string(c.norm_num_groups) +
       ", \"sample_size\": " + std::to_string(c.sample_size) +
       ", \"use_quant_conv\": " + (c.use_quant_conv ? "true" : "false") +
       ", \"use_post_quant_conv\": " + (c.use_post_quant_conv ? "true" : "false") +
       ", \"scaling_factor\": " + std::to_string(c.scaling_factor) + ", \"shift_factor\": " +
       (c.shift_factor ? std::to_string(*c.shift_factor) : "null") + ", \"force_upcast\": true, \"act_fn\": \"silu\"}";
  return j;
}

// diffusers name -> the original (LDM) name, written from the layout's description independently of
// the loader's converter: up_blocks run in reverse, mid resnets are block_1/block_2, the attention's
// Linear weights are stored as 1x1 convs.
std::string to_original(const std::string& key, int64_t levels) {
  std::string k = key;
  auto replace = [&](const std::string& from, const std::string& to) {
    auto pos = k.find(from);
    if (pos != std::string::npos) k.replace(pos, from.size(), to);
  };
  const std::string up = "decoder.up_blocks.";
  if (k.rfind(up, 0) == 0) {
    const auto dot = k.find('.', up.size());
    const int64_t i = std::stoll(k.substr(up.size(), dot - up.size()));
    k = "decoder.up." + std::to_string(levels - 1 - i) + k.substr(dot);
    replace(".resnets.", ".block.");
    replace(".upsamplers.0.", ".upsample.");
  }
  replace("encoder.down_blocks.", "encoder.down.");
  replace(".resnets.", ".block.");
  replace(".downsamplers.0.", ".downsample.");
  replace("mid_block.block.0.", "mid.block_1.");
  replace("mid_block.block.1.", "mid.block_2.");
  replace("mid_block.attentions.0.group_norm.", "mid.attn_1.norm.");
  replace("mid_block.attentions.0.to_q.", "mid.attn_1.q.");
  replace("mid_block.attentions.0.to_k.", "mid.attn_1.k.");
  replace("mid_block.attentions.0.to_v.", "mid.attn_1.v.");
  replace("mid_block.attentions.0.to_out.0.", "mid.attn_1.proj_out.");
  replace("conv_shortcut", "nin_shortcut");
  replace("conv_norm_out", "norm_out");
  return k;
}

// The module's state dict in the original layout under `prefix` (attention weights as 1x1 convs
// unless `linear_attention`), plus `extra` keys of other models.
flame::StateDict original_dict(const m::AutoencoderKL& vae, const std::string& prefix, bool linear_attention = false,
                               const flame::StateDict& extra = {}) {
  flame::StateDict out;
  const int64_t levels = static_cast<int64_t>(vae.config().block_out_channels.size());
  for (const auto& [name, t] : vae.state_dict()) {
    const std::string o = to_original(name, levels);
    const bool attn_w = o.find("mid.attn_1.") != std::string::npos && o.find("norm") == std::string::npos &&
                        o.size() > 7 && o.substr(o.size() - 7) == ".weight";
    out.insert(prefix + o, (attn_w && !linear_attention) ? t.reshape({t.size(0), t.size(1), 1, 1}) : t);
  }
  for (const auto& [name, t] : extra) out.insert(name, t);
  return out;
}

std::shared_ptr<m::AutoencoderKL> random_vae(const m::VaeConfig& c, uint64_t seed) {
  flame::manual_seed(seed);
  auto vae = std::make_shared<m::AutoencoderKL>(c);
  fd_test::perturb(*vae, 0.05, seed + 1);  // norms and biases leave their 1/0 initial values
  return vae;
}

double max_param_diff(const m::AutoencoderKL& a, const m::AutoencoderKL& b) {
  const flame::StateDict sb = b.state_dict();
  double worst = 0.0;
  for (const auto& [name, t] : a.state_dict()) worst = std::max(worst, fd_test::max_abs_diff(t, sb.at(name)));
  return worst;
}

// max |a - b| / max |b|
double rel_err(const Tensor& a, const Tensor& b) {
  return fd_test::max_abs_diff(a, b) / std::max(1e-12, fd_test::max_abs(b.to(DType::f64)));
}

}  // namespace

TEST(ModelsVae, ParameterNamesAndCountAreDiffusers) {
  const m::VaeConfig c = tiny_config();
  m::AutoencoderKL vae(c);
  const flame::StateDict sd = vae.state_dict();
  for (const char* name :
       {"encoder.conv_in.weight", "encoder.down_blocks.0.resnets.0.norm1.weight",
        "encoder.down_blocks.0.downsamplers.0.conv.weight", "encoder.down_blocks.1.resnets.0.conv_shortcut.weight",
        "encoder.mid_block.attentions.0.group_norm.weight", "encoder.mid_block.attentions.0.to_q.weight",
        "encoder.mid_block.attentions.0.to_out.0.bias", "encoder.mid_block.resnets.1.conv2.bias",
        "encoder.conv_norm_out.weight", "encoder.conv_out.weight", "decoder.conv_in.weight",
        "decoder.up_blocks.0.resnets.1.conv1.weight", "decoder.up_blocks.0.upsamplers.0.conv.weight",
        "decoder.up_blocks.1.resnets.0.conv_shortcut.weight", "decoder.mid_block.attentions.0.to_v.bias",
        "decoder.conv_out.bias", "quant_conv.weight", "post_quant_conv.bias"})
    EXPECT_TRUE(sd.contains(name)) << name;
  EXPECT_FALSE(sd.contains("decoder.up_blocks.1.upsamplers.0.conv.weight"));  // the last level does not resample
  EXPECT_EQ(sd.at("encoder.mid_block.attentions.0.to_q.weight").sizes(), (flame::Shape{32, 32}));
  EXPECT_EQ(sd.at("encoder.conv_out.weight").sizes(), (flame::Shape{8, 32, 3, 3}));

  // The count from the architecture: resnet(a, b), attention(c), and the two stacks.
  auto res = [](int64_t a, int64_t b) { return 2 * a + 9 * a * b + b + 2 * b + 9 * b * b + b + (a != b ? a * b + b : 0); };
  auto mid = [&](int64_t ch) { return 2 * res(ch, ch) + 2 * ch + 4 * (ch * ch + ch); };
  const auto& ch = c.block_out_channels;
  const int64_t L = c.layers_per_block, z = c.latent_channels, n = static_cast<int64_t>(ch.size());
  int64_t enc = 9 * 3 * ch[0] + ch[0], prev = ch[0];
  for (int64_t i = 0; i < n; ++i) {
    enc += res(prev, ch[i]) + (L - 1) * res(ch[i], ch[i]) + (i + 1 < n ? 9 * ch[i] * ch[i] + ch[i] : 0);
    prev = ch[i];
  }
  enc += mid(ch.back()) + 2 * ch.back() + 9 * ch.back() * 2 * z + 2 * z;
  int64_t dec = 9 * z * ch.back() + ch.back() + mid(ch.back());
  prev = ch.back();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t out = ch[n - 1 - i];
    dec += res(prev, out) + L * res(out, out) + (i + 1 < n ? 9 * out * out + out : 0);
    prev = out;
  }
  dec += 2 * ch[0] + 9 * ch[0] * 3 + 3;
  EXPECT_EQ(vae.num_parameters(), enc + dec + (4 * z * z + 2 * z) + (z * z + z));

  m::VaeConfig flux = tiny_config(16);
  m::AutoencoderKL f(flux);
  EXPECT_FALSE(f.state_dict().contains("quant_conv.weight"));
  EXPECT_FALSE(f.state_dict().contains("post_quant_conv.weight"));
}

TEST(ModelsVae, EveryLayoutLoadsTheSameParameters) {
  const fs::path d = temp_dir("layouts");
  const m::VaeConfig c = tiny_config();
  auto vae = random_vae(c, 11);
  // A diffusers folder inside a pipeline folder (stored bf16-free, f32).
  fs::create_directories(d / "pipe" / "vae");
  write_text(d / "pipe" / "model_index.json", "{}");
  write_text(d / "pipe" / "vae" / "config.json", config_json(c));
  flame::io::save_safetensors((d / "pipe" / "vae" / "diffusion_pytorch_model.safetensors").string(), vae->state_dict());
  // A full SDXL-style single file (VAE under first_stage_model., other models beside it), a
  // ComfyUI-style bare file with 2-d attention weights, and a "vae."-prefixed one.
  const flame::StateDict others{{"model.diffusion_model.input_blocks.0.0.weight", Tensor::ones({4, 4, 3, 3})},
                                {"conditioner.embedders.0.transformer.x", Tensor::ones({2})}};
  flame::io::save_safetensors((d / "full.safetensors").string(), original_dict(*vae, "first_stage_model.", false, others));
  flame::io::save_safetensors((d / "comfy.safetensors").string(), original_dict(*vae, "", true));
  flame::io::save_safetensors((d / "vae_prefixed.safetensors").string(), original_dict(*vae, "vae."));
  const std::string cfg = (d / "pipe" / "vae" / "config.json").string();

  struct Case {
    std::string path, format, prefix;
    bool needs_config;
  };
  for (const Case& k : {Case{(d / "pipe").string(), "vae-diffusers", "", false},
                        Case{(d / "pipe" / "vae").string(), "vae-diffusers", "", false},
                        Case{(d / "pipe" / "vae" / "diffusion_pytorch_model.safetensors").string(), "vae-diffusers", "",
                             true},
                        Case{(d / "full.safetensors").string(), "vae-original", "first_stage_model.", true},
                        Case{(d / "comfy.safetensors").string(), "vae-original", "", true},
                        Case{(d / "vae_prefixed.safetensors").string(), "vae-original", "vae.", true}}) {
    SCOPED_TRACE(k.path);
    m::VaeLoadOptions o;
    if (k.needs_config) o.config_json = cfg;  // norm_num_groups 8 is not in the shapes
    auto loaded = m::load_vae(k.path, o);
    EXPECT_EQ(max_param_diff(*vae, *loaded), 0.0);
    EXPECT_FALSE(loaded->parameters().front().requires_grad());  // loaded frozen
    const m::VaeFileInfo info = m::inspect_vae(m::Checkpoint::open(k.path, {"vae", ""}), "", o.config_json);
    EXPECT_EQ(info.format, k.format);
    EXPECT_EQ(info.prefix, k.prefix);
    EXPECT_EQ(info.config.norm_num_groups, 8);
    EXPECT_DOUBLE_EQ(info.config.scaling_factor, 0.13025);
  }
  // bf16 storage converts on load.
  flame::StateDict half;
  for (const auto& [name, t] : vae->state_dict()) half.insert(name, t.to(DType::bf16));
  flame::io::save_safetensors((d / "half.safetensors").string(), half);
  m::VaeLoadOptions o;
  o.config_json = cfg;
  auto from_half = m::load_vae((d / "half.safetensors").string(), o);
  EXPECT_EQ(from_half->dtype(), DType::f32);
  EXPECT_GT(max_param_diff(*vae, *from_half), 0.0);
  EXPECT_LT(max_param_diff(*vae, *from_half), 2e-2);  // bf16 rounding of values below ~2.5
  fs::remove_all(d);
}

TEST(ModelsVae, FamilyAndArchitectureFromKeysAlone) {
  const fs::path d = temp_dir("family");
  auto sdxl_like = random_vae(tiny_config(4), 3);
  auto flux_like = random_vae(tiny_config(16), 4);
  flame::io::save_safetensors((d / "ae.safetensors").string(), original_dict(*flux_like, ""));
  flame::io::save_safetensors((d / "sd3.safetensors").string(), original_dict(*flux_like, "first_stage_model."));
  flame::io::save_safetensors((d / "my_xl_vae.safetensors").string(), original_dict(*sdxl_like, ""));
  flame::io::save_safetensors((d / "vae.safetensors").string(), original_dict(*sdxl_like, ""));
  flame::io::save_safetensors((d / "v1.safetensors").string(),
                              original_dict(*sdxl_like, "first_stage_model.", false,
                                            {{"cond_stage_model.transformer.x", Tensor::ones({1})}}));
  auto guess = [&](const std::string& file, const std::string& family = "") {
    return m::inspect_vae(m::Checkpoint::open((d / file).string()), family);
  };
  const m::VaeFileInfo ae = guess("ae.safetensors");
  EXPECT_EQ(ae.family, "flux");
  EXPECT_DOUBLE_EQ(ae.config.scaling_factor, 0.3611);
  EXPECT_DOUBLE_EQ(*ae.config.shift_factor, 0.1159);
  EXPECT_EQ(ae.config.latent_channels, 16);
  EXPECT_FALSE(ae.config.use_quant_conv);
  EXPECT_EQ(ae.config.block_out_channels, (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(ae.config.layers_per_block, 1);
  EXPECT_EQ(guess("sd3.safetensors").family, "sd3");
  EXPECT_DOUBLE_EQ(*guess("sd3.safetensors").config.shift_factor, 0.0609);
  EXPECT_EQ(guess("my_xl_vae.safetensors").family, "sdxl");
  const m::VaeFileInfo sd = guess("vae.safetensors");
  EXPECT_EQ(sd.family, "sd");
  EXPECT_DOUBLE_EQ(sd.config.scaling_factor, 0.18215);
  EXPECT_TRUE(sd.config.use_quant_conv && sd.config.use_post_quant_conv && sd.config.mid_block_add_attention);
  EXPECT_EQ(guess("v1.safetensors").family, "sd");
  EXPECT_EQ(guess("vae.safetensors", "sdxl").family, "sdxl");  // the caller's word wins
  const std::string e = error_of([&] { guess("vae.safetensors", "sdxxl"); });
  EXPECT_NE(e.find("sdxxl"), std::string::npos) << e;
  EXPECT_NE(e.find("flux"), std::string::npos) << e;  // lists the known families
  fs::remove_all(d);
}

TEST(ModelsVae, LoadErrorsNameFileFamilyAndKeys) {
  const fs::path d = temp_dir("errors");
  // 32 norm groups, so that the architecture from the shapes alone builds (no config.json).
  m::VaeConfig c = tiny_config();
  c.block_out_channels = {32, 64};
  c.norm_num_groups = 32;
  auto vae = random_vae(c, 5);
  m::VaeLoadOptions o;

  flame::StateDict sd = original_dict(*vae, "first_stage_model.", false,
                                      {{"conditioner.embedders.0.x", Tensor::ones({1})}});
  sd.erase("first_stage_model.decoder.mid.attn_1.q.weight");
  sd.set("first_stage_model.encoder.mid.block_1.conv1.weight", Tensor::ones({64, 64, 1, 1}));
  sd.insert("first_stage_model.encoder.mystery.weight", Tensor::ones({3}));
  flame::io::save_safetensors((d / "broken_xl.safetensors").string(), sd);
  std::string e = error_of([&] { m::load_vae((d / "broken_xl.safetensors").string(), o); });
  EXPECT_NE(e.find("broken_xl.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("sdxl-vae"), std::string::npos) << e;
  EXPECT_NE(e.find("vae-original"), std::string::npos) << e;
  EXPECT_NE(e.find("missing: the model's decoder.mid_block.attentions.0.to_q.weight [64, 64]"), std::string::npos)
      << e;
  EXPECT_NE(e.find("shape: encoder.mid_block.resnets.0.conv1.weight expects [64, 64, 3, 3], stored "
                   "first_stage_model.encoder.mid.block_1.conv1.weight gives [64, 64, 1, 1]"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("unplaced: stored first_stage_model.encoder.mystery.weight"), std::string::npos) << e;

  flame::io::save_safetensors((d / "unet_only.safetensors").string(),
                              flame::StateDict{{"model.diffusion_model.out.2.weight", Tensor::ones({4})}});
  e = error_of([&] { m::load_vae((d / "unet_only.safetensors").string()); });
  EXPECT_NE(e.find("unet_only.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("holds no vae"), std::string::npos) << e;
  EXPECT_NE(e.find("model.diffusion_model.out.2.weight"), std::string::npos) << e;

  flame::io::save_safetensors((d / "cut.safetensors").string(), original_dict(*vae, ""));
  fs::resize_file(d / "cut.safetensors", fs::file_size(d / "cut.safetensors") - 100);
  e = error_of([&] { m::load_vae((d / "cut.safetensors").string(), o); });
  EXPECT_NE(e.find("cut.safetensors"), std::string::npos) << e;

  write_text(d / "bad_config.json", R"({"block_out_channels": [16, 32], "layers_per_block": "one"})");
  e = error_of([&] { m::VaeConfig::from_json(m::JsonConfig::from_file((d / "bad_config.json").string())); });
  EXPECT_NE(e.find("bad_config.json"), std::string::npos) << e;
  EXPECT_NE(e.find("layers_per_block"), std::string::npos) << e;
  fs::remove_all(d);
}

TEST(ModelsVae, TiledApplyStitchesAsDiffusers) {
  flame::Generator gen(21);
  // A pointwise tile function: the stitched result is the function of the whole input.
  const Tensor x = Tensor::randn({1, 2, 40, 37}, 0.0, 1.0, {DType::f32}, &gen);
  auto affine = [](const Tensor& t) { return t * 2.0 + 1.0; };
  EXPECT_LT(fd_test::max_abs_diff(m::tiled_apply(x, 16, 16, 0.25, affine), affine(x)), 1e-5);
  // A 2x nearest upsampling tile function (as a decoder's geometry): 8-pixel tiles -> 16.
  const Tensor z = Tensor::randn({2, 3, 20, 28}, 0.0, 1.0, {DType::f32}, &gen);
  auto up = [](const Tensor& t) {
    return flame::F::interpolate(t, flame::F::InterpolateOptions().with_scale(2.0)) * 3.0;
  };
  const Tensor tiled = m::tiled_apply(z, 8, 16, 0.25, up);
  ASSERT_EQ(tiled.sizes(), (flame::Shape{2, 3, 40, 56}));
  EXPECT_LT(fd_test::max_abs_diff(tiled, up(z)), 1e-5);
  // The blend itself: two tiles across 24 columns (tile 16, stride 12, blend 4, keep 12); tile k is
  // the constant k, so the seam ramps 0, 1/4, 1/2, 3/4 into the second tile.
  int calls = 0;
  auto constant = [&](const Tensor& t) { return Tensor::full(t.sizes(), static_cast<double>(calls++)); };
  const Tensor seam = m::tiled_apply(Tensor::zeros({1, 1, 4, 24}), 16, 16, 0.25, constant);
  ASSERT_EQ(seam.sizes(), (flame::Shape{1, 1, 4, 24}));
  const auto row = seam.select(2, 0).flatten().to_vec<float>();
  for (int j = 0; j < 24; ++j) {
    const float want = j < 12 ? 0.0f : (j < 16 ? (j - 12) / 4.0f : 1.0f);
    EXPECT_FLOAT_EQ(row[j], want) << "column " << j;
  }
}

TEST(ModelsVae, TilingEqualsUntiledWhereOneTileCoversAndRunsWhereItDoesNot) {
  auto vae = random_vae(tiny_config(), 7);
  flame::NoGradGuard no_grad;
  flame::Generator gen(8);
  const Tensor img = Tensor::uniform({1, 3, 32, 32}, -1.0, 1.0, {DType::f32}, &gen);
  const Tensor lat = Tensor::randn({1, 4, 16, 16}, 0.0, 1.0, {DType::f32}, &gen);
  const m::LatentDistribution full = vae->encode(img);
  const Tensor full_dec = vae->decode(lat);
  // As diffusers: with tiling on, an input no larger than a tile takes the untiled path (the tiled
  // one would still cut a 32-pixel image at stride 24 into a second, 8-pixel tile).
  vae->enable_tiling({32, 0.25});
  EXPECT_EQ(fd_test::max_abs_diff(full.mean, vae->encode(img).mean), 0.0);
  EXPECT_EQ(fd_test::max_abs_diff(full_dec, vae->decode(lat)), 0.0);
  EXPECT_GT(fd_test::max_abs_diff(full.mean, vae->tiled_encode(img, {32, 0.25}).mean), 0.0);
  // Larger than a tile: encode/decode go through the tiles; shapes as untiled.
  const Tensor big = Tensor::uniform({1, 3, 64, 48}, -1.0, 1.0, {DType::f32}, &gen);
  const m::LatentDistribution t = vae->encode(big);
  EXPECT_EQ(t.mean.sizes(), (flame::Shape{1, 4, 32, 24}));
  const m::LatentDistribution direct = vae->tiled_encode(big, {32, 0.25});
  EXPECT_EQ(fd_test::max_abs_diff(t.mean, direct.mean), 0.0);
  EXPECT_EQ(vae->decode(t.mean).sizes(), (flame::Shape{1, 3, 64, 48}));
  EXPECT_EQ(fd_test::max_abs_diff(vae->decode(t.mean), vae->tiled_decode(t.mean, {32, 0.25})), 0.0);
}

TEST(ModelsVae, LatentScalingShiftAndSampling) {
  auto vae = random_vae(tiny_config(16), 9);  // FLUX's scaling and shift
  flame::NoGradGuard no_grad;
  flame::Generator gen(10);
  const Tensor z = Tensor::randn({2, 16, 4, 4}, 0.0, 1.0, {DType::f32}, &gen);
  const Tensor s = vae->to_latent(z);
  EXPECT_LT(fd_test::max_abs_diff(s, (z.to(DType::f64) - 0.1159) * 0.3611), 1e-6);
  EXPECT_LT(fd_test::max_abs_diff(vae->from_latent(s), z), 1e-6);

  const Tensor img = Tensor::uniform({2, 3, 16, 16}, -1.0, 1.0, {DType::f32}, &gen);
  const m::LatentDistribution dist = vae->encode(img);
  EXPECT_EQ(dist.mean.sizes(), (flame::Shape{2, 16, 8, 8}));
  EXPECT_EQ(fd_test::max_abs_diff(dist.mode(), dist.mean), 0.0);
  EXPECT_LE(dist.logvar.max().item<double>(), 20.0);
  // sample = mean + exp(logvar / 2) * eps with eps the generator's next normals.
  flame::Generator g1(77), g2(77);
  const Tensor eps = Tensor::randn(dist.mean.sizes(), 0.0, 1.0, {DType::f32}, &g2);
  const Tensor sample = dist.sample(&g1);
  const Tensor want = dist.mean.to(DType::f64) + (dist.logvar.to(DType::f64) * 0.5).exp() * eps.to(DType::f64);
  EXPECT_LT(fd_test::max_abs_diff(sample, want), 1e-5);
  EXPECT_GT(fd_test::max_abs_diff(sample, dist.mean), 1e-3);
  // encode_latent: the scaled mode without a generator.
  EXPECT_LT(fd_test::max_abs_diff(vae->encode_latent(img), vae->to_latent(dist.mean)), 1e-6);
}

TEST(ModelsVae, ChannelsLastInputGivesTheSameResult) {
  auto vae = random_vae(tiny_config(), 14);
  flame::NoGradGuard no_grad;
  flame::Generator gen(15);
  const Tensor img = Tensor::uniform({2, 3, 16, 16}, -1.0, 1.0, {DType::f32}, &gen);
  const Tensor cl = flame::F::to_channels_last(img);
  ASSERT_TRUE(flame::F::is_channels_last(cl));
  EXPECT_LT(fd_test::max_abs_diff(vae->encode(cl).mean, vae->encode(img).mean), 1e-5);
  const Tensor lat = Tensor::randn({2, 4, 8, 8}, 0.0, 1.0, {DType::f32}, &gen);
  EXPECT_LT(fd_test::max_abs_diff(vae->decode(flame::F::to_channels_last(lat)), vae->decode(lat)), 1e-5);
}

// The mid attention splits its queries into chunks once L * L passes 2^24 scores: at L = 65^2 = 4225
// it runs two chunks, which must equal a softmax over all keys written out with matmuls.
TEST(ModelsVae, ChunkedAttentionEqualsOneSoftmax) {
  FD_SKIP_IF_NO_DEVICE();
  const flame::Device dev = fd_test::test_device();
  m::VaeAttention attn(8, 4, {DType::f32, dev});
  fd_test::perturb(attn, 0.1, 18);
  flame::NoGradGuard no_grad;
  flame::Generator gen(19);
  const int64_t S = 65, L = S * S;
  const Tensor x = Tensor::randn({1, 8, S, S}, 0.0, 1.0, {DType::f32}, &gen).to(dev);
  const flame::StateDict w = attn.state_dict();
  const Tensor h = flame::F::group_norm(x, 4, w.at("group_norm.weight"), w.at("group_norm.bias"), 1e-6)
                       .reshape({1, 8, L})
                       .transpose(1, 2);
  auto lin = [&](const std::string& n, const Tensor& t) {
    return flame::F::linear(t, w.at(n + ".weight"), w.at(n + ".bias"));
  };
  const Tensor q = lin("to_q", h), k = lin("to_k", h), v = lin("to_v", h);
  flame::TensorList rows;  // blocks of 1000 query rows keep this reference's score matrix small
  for (int64_t r = 0; r < L; r += 1000) {
    const Tensor qr = q.narrow(1, r, std::min<int64_t>(1000, L - r));
    rows.push_back((qr.matmul(k.transpose(1, 2)) * (1.0 / std::sqrt(8.0))).softmax(-1).matmul(v));
  }
  const Tensor want = lin("to_out.0", flame::cat(rows, 1)).transpose(1, 2).reshape({1, 8, S, S}) + x;
  EXPECT_LT(rel_err(attn.forward(x), want), 1e-5);
}

TEST(ModelsVae, F16AsksForF32WhereTheConfigForcesUpcast) {
  EXPECT_EQ(m::vae_compute_dtype(DType::f16, m::VaeConfig::preset("sdxl")), DType::f32);
  EXPECT_EQ(m::vae_compute_dtype(DType::bf16, m::VaeConfig::preset("sdxl")), DType::bf16);
  m::VaeConfig fixed = m::VaeConfig::preset("sdxl");
  fixed.force_upcast = false;  // e.g. madebyollin/sdxl-vae-fp16-fix
  EXPECT_EQ(m::vae_compute_dtype(DType::f16, fixed), DType::f16);

  const fs::path d = temp_dir("upcast");
  const m::VaeConfig c = tiny_config();
  auto vae = random_vae(c, 12);
  write_text(d / "config.json", config_json(c));
  flame::io::save_safetensors((d / "diffusion_pytorch_model.safetensors").string(), vae->state_dict());
  m::VaeLoadOptions o;
  o.dtype = DType::f16;
  auto loaded = m::load_vae(d.string(), o);
  EXPECT_EQ(loaded->dtype(), DType::f32);
  flame::NoGradGuard no_grad;
  flame::Generator gen(13);
  const Tensor lat = Tensor::randn({1, 4, 8, 8}, 0.0, 1.0, {DType::f32}, &gen);
  const Tensor out16 = loaded->decode(lat.to(DType::f16));
  EXPECT_EQ(out16.dtype(), DType::f16);
  EXPECT_LT(rel_err(out16, vae->decode(lat.to(DType::f16).to(DType::f32))), 2e-3);
  fs::remove_all(d);
}

// The GPU path (cuDNN convolutions, pad, interpolate, SDPA) against the CPU, f32 without TF32 and bf16.
TEST(ModelsVaeCuda, MatchesCpu) {
  if (!flame::cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  const fd_test::ConvTf32Off full_f32;
  auto vae = random_vae(tiny_config(), 16);
  flame::NoGradGuard no_grad;
  flame::Generator gen(17);
  const Tensor img = Tensor::uniform({2, 3, 32, 24}, -1.0, 1.0, {DType::f32}, &gen);
  const Tensor lat = Tensor::randn({2, 4, 16, 12}, 0.0, 1.0, {DType::f32}, &gen);
  const Tensor mean_cpu = vae->encode(img).mean, dec_cpu = vae->decode(lat);
  const Tensor tiled_cpu = vae->tiled_decode(lat, {16, 0.25});
  vae->to(flame::Device::cuda(0));
  const Tensor img_g = img.to(flame::Device::cuda(0)), lat_g = lat.to(flame::Device::cuda(0));
  EXPECT_LT(rel_err(vae->encode(img_g).mean, mean_cpu), 1e-4);
  EXPECT_LT(rel_err(vae->decode(lat_g), dec_cpu), 1e-4);
  EXPECT_LT(rel_err(vae->tiled_decode(lat_g, {16, 0.25}), tiled_cpu), 1e-4);
  vae->to(DType::bf16);
  EXPECT_LT(rel_err(vae->decode(lat_g.to(DType::bf16)), dec_cpu), 5e-2);
  EXPECT_EQ(vae->decode(lat_g.to(DType::bf16)).dtype(), DType::bf16);

}

// Parity with diffusers through the reference files of models_vae.py --reduced (see
// apps/diffusion/README.md, "Models and checkpoint files").
TEST(ModelsVae, MatchesDiffusersReferenceOutputs) {
  const fs::path root = fs::path(__FILE__).parent_path() / "data" / "models";
  for (const char* name : {"vae_tiny", "vae_tiny16"}) {
    const fs::path dir = root / name;
    if (!fs::exists(dir / "reference.safetensors"))
      GTEST_SKIP() << "reference outputs " << (dir / "reference.safetensors").string()
                   << " not generated yet: run apps/diffusion/reference/models_vae.py --reduced --out " << root.string();
    SCOPED_TRACE(name);
    const flame::StateDict ref = flame::io::load_safetensors((dir / "reference.safetensors").string());
    const flame::io::Metadata meta = flame::io::load_safetensors_metadata((dir / "reference.safetensors").string());
    const int64_t tile = std::stoll(meta.at("tile_sample_size"));
    m::VaeLoadOptions o;
    o.config_json = (dir / "diffusers" / "config.json").string();
    for (const std::string& path : {(dir / "diffusers").string(), (dir / meta.at("single_file")).string()}) {
      SCOPED_TRACE(path);
      auto vae = m::load_vae(path, o);
      flame::NoGradGuard no_grad;
      const m::LatentDistribution dist = vae->encode(ref.at("image"));
      EXPECT_LT(rel_err(dist.mean, ref.at("mean")), 1e-4);
      EXPECT_LT(rel_err(dist.logvar, ref.at("logvar")), 1e-4);
      EXPECT_LT(rel_err(vae->decode(ref.at("latent")), ref.at("decoded")), 1e-4);
      const m::LatentDistribution tiled = vae->tiled_encode(ref.at("tiled_image"), {tile, 0.25});
      EXPECT_LT(rel_err(tiled.mean, ref.at("tiled_mean")), 1e-4);
      EXPECT_LT(rel_err(vae->tiled_decode(ref.at("tiled_latent"), {tile, 0.25}), ref.at("tiled_decoded")), 1e-4);
    }
  }
}
