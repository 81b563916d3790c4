// UNet2DConditionModel (models/unet2d.h): parameter names against diffusers' layout written out
// here from its facts, parameter counts of the real SD 1.5 / 2.1 / SDXL UNets, the original
// single-file plan, config.json, the timestep embedding, LoRA names, gradient checkpointing, cheap
// recompute (set_recompute_cheap: same gradients, the predicted saved bytes fewer), and
// parity with diffusers on reduced configurations (stored reference outputs; skipped, saying so,
// while the files are absent).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

#include <flame/io/safetensors.h>

#include "model_test_util.h"
#include "models/unet2d.h"
#include "models/unet2d_convert.h"

namespace fm = flame_diffusion::models;
namespace nn = flame::nn;
using flame::DType;
using flame::Shape;
using flame::Tensor;

namespace {

// ---- reduced configurations (the reference script builds the same ones) ----
// tiny-xl: SDXL's shape (DownBlock2D first, linear projections, text_time); tiny-sd: SD 1.5's
// (cross-attention first, 1x1 conv projections, no added embedding).
fm::UNet2DConditionConfig tiny_xl() {
  fm::UNet2DConditionConfig c;
  c.sample_size = 16;
  c.down_block_types = {"DownBlock2D", "CrossAttnDownBlock2D"};
  c.up_block_types = {"CrossAttnUpBlock2D", "UpBlock2D"};
  c.block_out_channels = {8, 16};
  c.layers_per_block = {1, 1};
  c.transformer_layers_per_block = {1, 2};
  c.cross_attention_dim = {12, 12};
  c.attention_heads = {2, 2};
  c.norm_num_groups = 4;
  c.use_linear_projection = true;
  c.addition_embed_type = "text_time";
  c.addition_time_embed_dim = 4;
  c.projection_class_embeddings_input_dim = 10 + 6 * 4;  // text_embeds 10 + 6 time ids
  return c;
}

fm::UNet2DConditionConfig tiny_sd() {
  fm::UNet2DConditionConfig c;
  c.sample_size = 16;
  c.down_block_types = {"CrossAttnDownBlock2D", "DownBlock2D"};
  c.up_block_types = {"UpBlock2D", "CrossAttnUpBlock2D"};
  c.block_out_channels = {8, 16};
  c.layers_per_block = {2, 2};
  c.transformer_layers_per_block = {1, 1};
  c.cross_attention_dim = {12, 12};
  c.attention_heads = {2, 2};
  c.norm_num_groups = 4;
  c.use_linear_projection = false;
  return c;
}

// ---- diffusers' state-dict keys and shapes, from its module tree (in registration order) ----
using Keys = std::vector<std::pair<std::string, Shape>>;

void add_linear(Keys& k, const std::string& p, int64_t in, int64_t out, bool bias = true) {
  k.push_back({p + ".weight", {out, in}});
  if (bias) k.push_back({p + ".bias", {out}});
}
void add_conv(Keys& k, const std::string& p, int64_t in, int64_t out, int64_t ks) {
  k.push_back({p + ".weight", {out, in, ks, ks}});
  k.push_back({p + ".bias", {out}});
}
void add_norm(Keys& k, const std::string& p, int64_t c) {
  k.push_back({p + ".weight", {c}});
  k.push_back({p + ".bias", {c}});
}
void add_resnet(Keys& k, const std::string& p, int64_t in, int64_t out, int64_t temb) {
  add_norm(k, p + ".norm1", in);
  add_conv(k, p + ".conv1", in, out, 3);
  add_linear(k, p + ".time_emb_proj", temb, out);
  add_norm(k, p + ".norm2", out);
  add_conv(k, p + ".conv2", out, out, 3);
  if (in != out) add_conv(k, p + ".conv_shortcut", in, out, 1);
}
void add_attention(Keys& k, const std::string& p, int64_t dim, int64_t kv) {
  add_linear(k, p + ".to_q", dim, dim, false);
  add_linear(k, p + ".to_k", kv, dim, false);
  add_linear(k, p + ".to_v", kv, dim, false);
  add_linear(k, p + ".to_out.0", dim, dim);
}
void add_transformer(Keys& k, const std::string& p, int64_t ch, int64_t layers, int64_t cross, bool linear) {
  add_norm(k, p + ".norm", ch);
  if (linear) add_linear(k, p + ".proj_in", ch, ch); else add_conv(k, p + ".proj_in", ch, ch, 1);
  for (int64_t l = 0; l < layers; ++l) {
    const std::string b = p + ".transformer_blocks." + std::to_string(l);
    add_norm(k, b + ".norm1", ch);
    add_attention(k, b + ".attn1", ch, ch);
    add_norm(k, b + ".norm2", ch);
    add_attention(k, b + ".attn2", ch, cross);
    add_norm(k, b + ".norm3", ch);
    add_linear(k, b + ".ff.net.0.proj", ch, ch * 8);  // GEGLU: 2 x (4 * ch)
    add_linear(k, b + ".ff.net.2", ch * 4, ch);
  }
  if (linear) add_linear(k, p + ".proj_out", ch, ch); else add_conv(k, p + ".proj_out", ch, ch, 1);
}

Keys diffusers_keys(const fm::UNet2DConditionConfig& c) {
  Keys k;
  const int64_t n = c.num_blocks(), c0 = c.block_out_channels[0], t = 4 * c0;
  add_conv(k, "conv_in", c.in_channels, c0, 3);
  add_linear(k, "time_embedding.linear_1", c0, t);
  add_linear(k, "time_embedding.linear_2", t, t);
  if (c.addition_embed_type == "text_time") {
    add_linear(k, "add_embedding.linear_1", c.projection_class_embeddings_input_dim, t);
    add_linear(k, "add_embedding.linear_2", t, t);
  }
  int64_t ch = c0;
  for (int64_t b = 0; b < n; ++b) {
    const std::string p = "down_blocks." + std::to_string(b);
    const int64_t out = c.block_out_channels[b];
    const bool cross = c.down_block_types[b] == "CrossAttnDownBlock2D";
    for (int64_t j = 0; cross && j < c.layers_per_block[b]; ++j) {
      add_transformer(k, p + ".attentions." + std::to_string(j), out, c.transformer_layers_per_block[b],
                      c.cross_attention_dim[b], c.use_linear_projection);
    }
    for (int64_t j = 0; j < c.layers_per_block[b]; ++j) {
      add_resnet(k, p + ".resnets." + std::to_string(j), j == 0 ? ch : out, out, t);
    }
    if (b + 1 < n) add_conv(k, p + ".downsamplers.0.conv", out, out, 3);
    ch = out;
  }
  for (int64_t b = 0; b < n; ++b) {
    const std::string p = "up_blocks." + std::to_string(b);
    const int64_t r = n - 1 - b;  // the down block this one mirrors
    const int64_t out = c.block_out_channels[r];
    const int64_t prev = c.block_out_channels[std::min(r + 1, n - 1)];
    const int64_t in = c.block_out_channels[std::max<int64_t>(r - 1, 0)];
    const int64_t layers = c.layers_per_block[r] + 1;
    if (c.up_block_types[b] == "CrossAttnUpBlock2D") {
      for (int64_t j = 0; j < layers; ++j) {
        add_transformer(k, p + ".attentions." + std::to_string(j), out, c.transformer_layers_per_block[r],
                        c.cross_attention_dim[r], c.use_linear_projection);
      }
    }
    for (int64_t j = 0; j < layers; ++j) {
      const int64_t skip = j == layers - 1 ? in : out;
      add_resnet(k, p + ".resnets." + std::to_string(j), (j == 0 ? prev : out) + skip, out, t);
    }
    if (b + 1 < n) add_conv(k, p + ".upsamplers.0.conv", out, out, 3);
  }
  const int64_t cl = c.block_out_channels.back();
  add_transformer(k, "mid_block.attentions.0", cl, c.transformer_layers_per_block.back(), c.cross_attention_dim.back(),
                  c.use_linear_projection);
  add_resnet(k, "mid_block.resnets.0", cl, cl, t);
  add_resnet(k, "mid_block.resnets.1", cl, cl, t);
  add_norm(k, "conv_norm_out", c0);
  add_conv(k, "conv_out", c0, c.out_channels, 3);
  return k;
}

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// ---- the original single-file names, as diffusers' convert_ldm_unet_checkpoint reads them ----
std::string ldm_resnet(const std::string& rest) {
  static const std::vector<std::pair<std::string, std::string>> m = {
      {"norm1.", "in_layers.0."}, {"conv1.", "in_layers.2."}, {"time_emb_proj.", "emb_layers.1."},
      {"norm2.", "out_layers.0."}, {"conv2.", "out_layers.3."}, {"conv_shortcut.", "skip_connection."}};
  for (const auto& [d, l] : m) {
    if (rest.rfind(d, 0) == 0) return l + rest.substr(d.size());
  }
  ADD_FAILURE() << "no resnet name for " << rest;
  return rest;
}

// "down_blocks.1.resnets.0.norm1.weight" -> "model.diffusion_model.input_blocks.4.0.in_layers.0.weight"
std::string ldm_key(const std::string& key, const fm::UNet2DConditionConfig& c) {
  const std::string pre = "model.diffusion_model.";
  static const std::vector<std::pair<std::string, std::string>> top = {
      {"conv_in.", "input_blocks.0.0."}, {"time_embedding.linear_1.", "time_embed.0."},
      {"time_embedding.linear_2.", "time_embed.2."}, {"add_embedding.linear_1.", "label_emb.0.0."},
      {"add_embedding.linear_2.", "label_emb.0.2."}, {"conv_norm_out.", "out.0."}, {"conv_out.", "out.2."}};
  for (const auto& [d, l] : top) {
    if (key.rfind(d, 0) == 0) return pre + l + key.substr(d.size());
  }
  auto split = [](const std::string& x, std::size_t count) {  // the first `count` dotted parts, then the rest
    std::vector<std::string> out;
    std::size_t s = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t d = x.find('.', s);
      out.push_back(x.substr(s, d - s));
      s = d + 1;
    }
    out.push_back(x.substr(s));
    return out;
  };
  if (key.rfind("mid_block.", 0) == 0) {  // mid_block.<kind>.<j>.<rest>
    const auto p = split(key, 3);
    const int64_t j = std::stoll(p[2]);
    if (p[1] == "resnets") return pre + "middle_block." + std::to_string(2 * j) + "." + ldm_resnet(p[3]);
    return pre + "middle_block." + std::to_string(2 * j + 1) + "." + p[3];
  }
  const auto parts = split(key, 4);  // <group>.<b>.<kind>.<j>.<rest>
  const std::string rest = parts[4];
  const int64_t b = std::stoll(parts[1]);
  const std::string kind = parts[2];
  const int64_t j = std::stoll(parts[3]);
  const int64_t n = c.num_blocks();
  if (parts[0] == "down_blocks") {
    int64_t i = 1;
    for (int64_t q = 0; q < b; ++q) i += c.layers_per_block[q] + 1;
    if (kind == "downsamplers") return pre + "input_blocks." + std::to_string(i + c.layers_per_block[b]) + ".0.op." + rest.substr(5);
    if (kind == "resnets") return pre + "input_blocks." + std::to_string(i + j) + ".0." + ldm_resnet(rest);
    return pre + "input_blocks." + std::to_string(i + j) + ".1." + rest;
  }
  int64_t i = 0;
  for (int64_t q = 0; q < b; ++q) i += c.layers_per_block[n - 1 - q] + 1;
  const int64_t layers = c.layers_per_block[n - 1 - b] + 1;
  if (kind == "upsamplers") {
    const bool cross = c.up_block_types[b] == "CrossAttnUpBlock2D";
    return pre + "output_blocks." + std::to_string(i + layers - 1) + (cross ? ".2." : ".1.") + rest;
  }
  if (kind == "resnets") return pre + "output_blocks." + std::to_string(i + j) + ".0." + ldm_resnet(rest);
  return pre + "output_blocks." + std::to_string(i + j) + ".1." + rest;
}

std::map<std::string, std::string> plan_map(const fm::KeyPlan& plan) {
  std::map<std::string, std::string> m;
  for (const auto& e : plan.entries) {
    EXPECT_EQ(e.sources.size(), 1u) << e.target;
    EXPECT_TRUE(m.emplace(e.sources.at(0), e.target).second) << "source used twice: " << e.sources[0];
  }
  return m;
}

// Every diffusers key of `c`, renamed to the original layout, comes back to itself through the plan.
void expect_plan_round_trip(const fm::UNet2DConditionConfig& c) {
  const Keys keys = diffusers_keys(c);
  Keys stored;
  for (const auto& [k, s] : keys) stored.push_back({ldm_key(k, c), s});
  stored.push_back({"first_stage_model.decoder.conv_in.weight", {4, 4, 3, 3}});  // another model's key
  const fm::KeyPlan plan = fm::unet_original_plan(c, stored);
  ASSERT_EQ(plan.entries.size(), keys.size());
  const auto m = plan_map(plan);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    auto it = m.find(stored[i].first);
    ASSERT_NE(it, m.end()) << "unplaced: " << stored[i].first;
    EXPECT_EQ(it->second, keys[i].first) << stored[i].first;
  }
  for (const auto& e : plan.entries) EXPECT_EQ(e.op, fm::KeyPlanEntry::Op::kCopy) << e.target;
}

Tensor randn(const Shape& s, uint64_t seed, double std = 1.0) {
  flame::Generator g(seed);
  return Tensor::randn(s, 0.0, std, {DType::f32, flame::Device::cpu()}, &g);
}

struct Inputs {
  Tensor sample, timestep, context;
  fm::UNet2DAddedConditions added;
};

Inputs make_inputs(const fm::UNet2DConditionConfig& c, int64_t b, int64_t h, int64_t w, uint64_t seed) {
  Inputs in;
  in.sample = randn({b, c.in_channels, h, w}, seed);
  in.timestep = Tensor::from_vec(std::vector<float>{981.0f, 17.0f, 500.0f, 3.0f}, {4}).slice(0, 0, b).contiguous();
  in.context = randn({b, 7, c.cross_attention_dim[0]}, seed + 1);
  if (c.addition_embed_type == "text_time") {
    const int64_t ids = 6;
    in.added.text_embeds = randn({b, c.projection_class_embeddings_input_dim - ids * c.addition_time_embed_dim}, seed + 2);
    std::vector<float> v;
    for (int64_t i = 0; i < b * ids; ++i) v.push_back(static_cast<float>((i * 37) % 64));
    in.added.time_ids = Tensor::from_vec(v, {b, ids});
  }
  return in;
}

Tensor run(fm::UNet2DConditionModel& m, const Inputs& in) {
  return m.forward(in.sample, in.timestep, in.context, in.added);
}

std::filesystem::path reference_dir(const std::string& name) {
  return std::filesystem::path(__FILE__).parent_path() / "data" / "models" / ("unet2d-" + name);
}

// max |a - b| <= atol + rtol * max |b|
void expect_close(const Tensor& got, const Tensor& want, double rtol, double atol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = fd_test::max_abs(want);
  const double err = fd_test::max_abs_diff(got, want);
  EXPECT_LE(err, atol + rtol * scale) << what << ": max err " << err << ", max |want| " << scale;
}

}  // namespace

TEST(UNet2D, ParameterNamesAndShapesAreDiffusers) {
  for (const auto& c : {tiny_xl(), tiny_sd()}) {
    fm::UNet2DConditionModel m(c);
    const Keys want = diffusers_keys(c);
    const auto sd = m.state_dict();
    ASSERT_EQ(sd.size(), want.size());
    std::size_t i = 0;
    for (const auto& [name, t] : sd) {
      EXPECT_EQ(name, want[i].first) << "position " << i;
      EXPECT_EQ(t.sizes(), want[i].second) << name;
      ++i;
    }
  }
}

// The key lists above against the real models' published parameter counts.
TEST(UNet2D, KeyListsGiveTheRealModelsParameterCounts) {
  auto total = [](const Keys& k) {
    int64_t n = 0;
    for (const auto& kv : k) n += numel(kv.second);
    return n;
  };
  EXPECT_EQ(total(diffusers_keys(fm::unet2d_preset("sdxl"))), 2567463684);
  EXPECT_EQ(total(diffusers_keys(fm::unet2d_preset("sd15"))), 859520964);
  EXPECT_EQ(total(diffusers_keys(fm::unet2d_preset("sd21"))), 865910724);
  EXPECT_EQ(diffusers_keys(fm::unet2d_preset("sdxl")).size(), 1680u);
  EXPECT_EQ(fm::UNet2DConditionModel(tiny_xl()).num_parameters(), total(diffusers_keys(tiny_xl())));
}

TEST(UNet2D, PresetsAndConfigJson) {
  // SDXL base 1.0's unet/config.json.
  const std::string sdxl_json = R"({
    "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.19.0.dev0", "act_fn": "silu",
    "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64, "addition_time_embed_dim": 256,
    "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280], "center_input_sample": false,
    "class_embed_type": null, "class_embeddings_concat": false, "conv_in_kernel": 3, "conv_out_kernel": 3,
    "cross_attention_dim": 2048, "cross_attention_norm": null,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "downsample_padding": 1, "dual_cross_attention": false, "encoder_hid_dim": null, "encoder_hid_dim_type": null,
    "flip_sin_to_cos": true, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2,
    "mid_block_only_cross_attention": null, "mid_block_scale_factor": 1, "mid_block_type": "UNetMidBlock2DCrossAttn",
    "norm_eps": 1e-05, "norm_num_groups": 32, "num_attention_heads": null, "num_class_embeds": null,
    "only_cross_attention": false, "out_channels": 4, "projection_class_embeddings_input_dim": 2816,
    "resnet_out_scale_factor": 1.0, "resnet_skip_time_act": false, "resnet_time_scale_shift": "default",
    "sample_size": 128, "time_cond_proj_dim": null, "time_embedding_act_fn": null, "time_embedding_dim": null,
    "time_embedding_type": "positional", "timestep_post_act": null, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "upcast_attention": false,
    "use_linear_projection": true})";
  const auto a = fm::unet2d_config_from_json(sdxl_json);
  const auto b = fm::unet2d_preset("sdxl");
  EXPECT_EQ(a.block_out_channels, b.block_out_channels);
  EXPECT_EQ(a.attention_heads, b.attention_heads);
  EXPECT_EQ(a.transformer_layers_per_block, b.transformer_layers_per_block);
  EXPECT_EQ(a.cross_attention_dim, b.cross_attention_dim);
  EXPECT_EQ(a.layers_per_block, b.layers_per_block);
  EXPECT_EQ(a.down_block_types, b.down_block_types);
  EXPECT_EQ(a.up_block_types, b.up_block_types);
  EXPECT_EQ(a.use_linear_projection, b.use_linear_projection);
  EXPECT_EQ(a.addition_embed_type, "text_time");
  EXPECT_EQ(a.projection_class_embeddings_input_dim, 2816);
  EXPECT_EQ(a.sample_size, 128);
  // SD 1.5's config leaves out use_linear_projection and gives one head count.
  const auto sd15 = fm::unet2d_config_from_json(
      R"({"attention_head_dim": 8, "block_out_channels": [320, 640, 1280, 1280], "cross_attention_dim": 768,
          "layers_per_block": 2, "sample_size": 64})");
  const auto p15 = fm::unet2d_preset("sd15");
  EXPECT_EQ(sd15.attention_heads, p15.attention_heads);
  EXPECT_EQ(sd15.down_block_types, p15.down_block_types);
  EXPECT_FALSE(sd15.use_linear_projection);
  EXPECT_EQ(sd15.cross_attention_dim, (std::vector<int64_t>{768, 768, 768, 768}));
  // What this UNet does not build is refused by name.
  auto message = [](const std::string& json) {
    try {
      fm::unet2d_config_from_json(json, "x/config.json");
    } catch (const flame::Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(message(R"({"class_embed_type": "timestep"})").find("class_embed_type"), std::string::npos);
  EXPECT_NE(message(R"({"resnet_time_scale_shift": "scale_shift"})").find("x/config.json"), std::string::npos);
  EXPECT_NE(message(R"({"made_up_option": 3})").find("made_up_option"), std::string::npos);
  EXPECT_NE(message(R"({"attention_head_dim": [8, 8]})").find("attention_head_dim"), std::string::npos);
  EXPECT_NE(message(R"({"down_block_types": ["AttnDownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D"]})")
                .find("AttnDownBlock2D"),
            std::string::npos);
  EXPECT_THROW(fm::unet2d_preset("sd3"), flame::Error);
}

TEST(UNet2D, TimestepEmbeddingClosedForm) {
  const std::vector<double> ts = {0.0, 1.0, 17.0, 999.0};
  for (bool flip : {true, false}) {
    for (int64_t dim : {8, 9}) {
      const Tensor e = fm::timestep_embedding(Tensor::from_vec(std::vector<float>(ts.begin(), ts.end()), {4}), dim, flip, 1.0);
      ASSERT_EQ(e.sizes(), (Shape{4, dim}));
      const auto v = e.to_vec<float>();
      const int64_t half = dim / 2;
      for (int64_t r = 0; r < 4; ++r) {
        for (int64_t i = 0; i < half; ++i) {
          const double f = std::exp(-std::log(10000.0) * static_cast<double>(i) / (static_cast<double>(half) - 1.0));
          const double s = std::sin(ts[r] * f), co = std::cos(ts[r] * f);
          EXPECT_NEAR(v[r * dim + i], flip ? co : s, 2e-4 * (1.0 + std::abs(ts[r]) * f)) << r << " " << i;
          EXPECT_NEAR(v[r * dim + half + i], flip ? s : co, 2e-4 * (1.0 + std::abs(ts[r]) * f)) << r << " " << i;
        }
        if (dim % 2) EXPECT_EQ(v[r * dim + dim - 1], 0.0f);
      }
    }
  }
}

TEST(UNet2D, ForwardShapesAndErrors) {
  const auto c = tiny_xl();
  fm::UNet2DConditionModel m(c);
  const Inputs in = make_inputs(c, 2, 16, 16, 1);
  const Tensor y = run(m, in);
  EXPECT_EQ(y.sizes(), (Shape{2, 4, 16, 16}));
  EXPECT_EQ(y.dtype(), DType::f32);
  // A latent that is not a multiple of the down factor: the upsampler goes to the skip's size.
  const Inputs odd = make_inputs(c, 2, 9, 11, 2);
  EXPECT_EQ(run(m, odd).sizes(), (Shape{2, 4, 9, 11}));
  // One timestep for the batch equals the same timestep repeated.
  Inputs one = in;
  one.timestep = Tensor::from_vec(std::vector<float>{981.0f}, {1});
  Inputs rep = in;
  rep.timestep = Tensor::from_vec(std::vector<float>{981.0f, 981.0f}, {2});
  EXPECT_EQ(fd_test::max_abs_diff(run(m, one), run(m, rep)), 0.0);
  // The added conditions are used: other time ids change the output.
  Inputs ids = in;
  ids.added.time_ids = in.added.time_ids + 1.0;
  EXPECT_GT(fd_test::max_abs_diff(run(m, ids), y), 1e-6);

  Inputs missing = in;
  missing.added = {};
  EXPECT_THROW(run(m, missing), flame::Error);
  Inputs bad_ctx = in;
  bad_ctx.context = randn({2, 7, 5}, 3);
  try {
    run(m, bad_ctx);
    ADD_FAILURE() << "no error for a context of the wrong width";
  } catch (const flame::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cross_attention_dim"), std::string::npos) << e.what();
  }
  Inputs bad_sample = in;
  bad_sample.sample = randn({2, 3, 16, 16}, 4);
  EXPECT_THROW(run(m, bad_sample), flame::Error);
}

TEST(UNet2D, Bf16ForwardFollowsF32) {
  const auto c = tiny_sd();
  fm::UNet2DConditionModel m(c);
  fd_test::perturb(m, 0.02, 5);
  const Inputs in = make_inputs(c, 2, 16, 16, 6);
  const Tensor y32 = run(m, in);
  m.to(DType::bf16);
  Inputs in16 = in;
  in16.sample = in.sample.to(DType::bf16);
  in16.context = in.context.to(DType::bf16);
  const Tensor y16 = run(m, in16);
  EXPECT_EQ(y16.dtype(), DType::bf16);
  expect_close(y16, y32, 0.05, 0.0, "bf16 vs f32");
}

TEST(UNet2D, OriginalPlanMapsEveryKey) {
  expect_plan_round_trip(tiny_xl());
  expect_plan_round_trip(tiny_sd());
  expect_plan_round_trip(fm::unet2d_preset("sdxl"));
  expect_plan_round_trip(fm::unet2d_preset("sd15"));
  expect_plan_round_trip(fm::unet2d_preset("sd21"));
  // Known names of the real files.
  const auto xl = fm::unet2d_preset("sdxl");
  const auto m = plan_map(fm::unet_original_plan(
      xl, {{"model.diffusion_model.input_blocks.4.1.transformer_blocks.1.attn2.to_k.weight", {640, 2048}},
           {"model.diffusion_model.input_blocks.3.0.op.weight", {320, 320, 3, 3}},
           {"model.diffusion_model.output_blocks.2.2.conv.weight", {1280, 1280, 3, 3}},
           {"model.diffusion_model.output_blocks.5.2.conv.bias", {640}},
           {"model.diffusion_model.output_blocks.8.0.skip_connection.weight", {320, 640, 1, 1}},
           {"model.diffusion_model.middle_block.1.transformer_blocks.9.ff.net.2.weight", {1280, 5120}},
           {"model.diffusion_model.middle_block.2.emb_layers.1.bias", {1280}},
           {"model.diffusion_model.label_emb.0.0.weight", {1280, 2816}},
           {"model.diffusion_model.out.2.weight", {4, 320, 3, 3}},
           {"model.diffusion_model.input_blocks.7.1.proj_in.weight", {1280, 1280, 1, 1}},  // a conv-stored projection
           {"model_ema.decay", {}},
           {"conditioner.embedders.0.transformer.text_model.final_layer_norm.weight", {768}}}));
  EXPECT_EQ(m.size(), 10u);
  EXPECT_EQ(m.at("model.diffusion_model.input_blocks.4.1.transformer_blocks.1.attn2.to_k.weight"),
            "down_blocks.1.attentions.0.transformer_blocks.1.attn2.to_k.weight");
  EXPECT_EQ(m.at("model.diffusion_model.input_blocks.3.0.op.weight"), "down_blocks.0.downsamplers.0.conv.weight");
  EXPECT_EQ(m.at("model.diffusion_model.output_blocks.2.2.conv.weight"), "up_blocks.0.upsamplers.0.conv.weight");
  EXPECT_EQ(m.at("model.diffusion_model.output_blocks.5.2.conv.bias"), "up_blocks.1.upsamplers.0.conv.bias");
  EXPECT_EQ(m.at("model.diffusion_model.output_blocks.8.0.skip_connection.weight"),
            "up_blocks.2.resnets.2.conv_shortcut.weight");
  EXPECT_EQ(m.at("model.diffusion_model.middle_block.1.transformer_blocks.9.ff.net.2.weight"),
            "mid_block.attentions.0.transformer_blocks.9.ff.net.2.weight");
  EXPECT_EQ(m.at("model.diffusion_model.middle_block.2.emb_layers.1.bias"), "mid_block.resnets.1.time_emb_proj.bias");
  EXPECT_EQ(m.at("model.diffusion_model.label_emb.0.0.weight"), "add_embedding.linear_1.weight");
  EXPECT_EQ(m.at("model.diffusion_model.out.2.weight"), "conv_out.weight");
  const auto plan = fm::unet_original_plan(xl, {{"model.diffusion_model.input_blocks.7.1.proj_in.weight", {1280, 1280, 1, 1}}});
  ASSERT_EQ(plan.entries.size(), 1u);
  EXPECT_EQ(plan.entries[0].target, "down_blocks.2.attentions.0.proj_in.weight");
  EXPECT_EQ(plan.entries[0].op, fm::KeyPlanEntry::Op::kReshape);
  EXPECT_EQ(plan.entries[0].shape, (Shape{1280, 1280}));
  // SD 1.5: up block 0 has no attention, so its upsampler sits at position 1.
  const auto m15 = plan_map(fm::unet_original_plan(
      fm::unet2d_preset("sd15"), {{"model.diffusion_model.output_blocks.2.1.conv.weight", {1280, 1280, 3, 3}},
                                  {"model.diffusion_model.output_blocks.5.2.conv.weight", {1280, 1280, 3, 3}},
                                  {"model.diffusion_model.input_blocks.11.0.in_layers.2.weight", {1280, 1280, 3, 3}}}));
  EXPECT_EQ(m15.at("model.diffusion_model.output_blocks.2.1.conv.weight"), "up_blocks.0.upsamplers.0.conv.weight");
  EXPECT_EQ(m15.at("model.diffusion_model.output_blocks.5.2.conv.weight"), "up_blocks.1.upsamplers.0.conv.weight");
  EXPECT_EQ(m15.at("model.diffusion_model.input_blocks.11.0.in_layers.2.weight"), "down_blocks.3.resnets.1.conv1.weight");
  EXPECT_TRUE(fm::is_unet_original_layout({"model.diffusion_model.input_blocks.0.0.weight"}));
  EXPECT_FALSE(fm::is_unet_original_layout({"down_blocks.0.resnets.0.conv1.weight"}));
}

// Through the format registry: the layout read from the keys, detection, the loader's checks.
TEST(UNet2D, OriginalFileLoadsAsTheDiffusersOne) {
  const auto dir = std::filesystem::temp_directory_path() / ("unet2d_original_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "model.safetensors").string();
  const std::string diffusers_path = (dir / "diffusion_pytorch_model.safetensors").string();
  for (const auto& c : {tiny_xl(), tiny_sd()}) {
    fm::UNet2DConditionModel a(c);
    fd_test::perturb(a, 0.02, 7);
    flame::StateDict original;
    for (const auto& [k, t] : a.state_dict()) original.insert(ldm_key(k, c), t);
    original.insert("first_stage_model.decoder.conv_in.bias", Tensor::zeros({4}));  // another model of the file
    flame::io::save_safetensors(path, original);
    flame::io::save_safetensors(diffusers_path, a.state_dict());
    const fm::UNetFileInfo info = fm::inspect_unet(fm::Checkpoint::open(path), {.config = c});
    EXPECT_EQ(info.format, "unet-original");
    EXPECT_EQ(info.prefix, "model.diffusion_model.");
    EXPECT_EQ(fm::inspect_unet(fm::Checkpoint::open(diffusers_path), {.config = c}).format, "unet-diffusers");
    const Inputs in = make_inputs(c, 2, 16, 16, 8);
    const Tensor want = run(a, in);
    for (const std::string& file : {path, diffusers_path}) {
      auto b = fm::load_unet(file, {.config = c});
      EXPECT_EQ(fd_test::max_abs_diff(run(*b, in), want), 0.0) << file;
    }
    // A key the config has no place for is named.
    original.insert("model.diffusion_model.input_blocks.9.0.in_layers.0.weight", Tensor::zeros({8}));
    flame::io::save_safetensors(path, original);
    try {
      fm::load_unet(path, {.config = c});
      ADD_FAILURE() << "no error for an unplaced key";
    } catch (const flame::Error& e) {
      EXPECT_NE(std::string(e.what()).find("input_blocks.9.0.in_layers.0.weight"), std::string::npos) << e.what();
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(UNet2D, LoraNamesArePefts) {
  const auto c = tiny_xl();
  fm::UNet2DConditionModel m(c);
  const auto adapted = m.add_lora({.rank = 4, .alpha = 8.0});
  // Transformer blocks: down block 1: 1 attention x 2 layers, mid: 2 layers, up block 0: 2 attentions x 2 layers.
  const int64_t blocks = 2 + 2 + 4;
  EXPECT_EQ(static_cast<int64_t>(adapted.size()), blocks * 2 * 4);
  std::set<std::string> trainable;
  for (const auto& [name, p] : m.named_parameters()) {
    if (p.requires_grad()) trainable.insert(name);
  }
  std::set<std::string> want;
  for (const auto& [k, s] : diffusers_keys(c)) {
    for (const char* t : {".to_q.weight", ".to_k.weight", ".to_v.weight", ".to_out.0.weight"}) {
      const std::string suf = t;
      if (k.size() > suf.size() && k.compare(k.size() - suf.size(), suf.size(), suf) == 0) {
        const std::string mod = k.substr(0, k.size() - 7);  // drop ".weight"
        want.insert(mod + ".lora_A.weight");
        want.insert(mod + ".lora_B.weight");
      }
    }
  }
  EXPECT_EQ(trainable, want);
  const auto lsd = nn::lora_state_dict(m);
  EXPECT_EQ(lsd.size(), want.size());
  EXPECT_TRUE(lsd.contains("base_model.model.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.lora_A.weight"));
  EXPECT_EQ(lsd.at("base_model.model.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.lora_A.weight").sizes(),
            (Shape{4, 12}));
  EXPECT_EQ(lsd.at("base_model.model.mid_block.attentions.0.transformer_blocks.1.attn1.to_out.0.lora_B.weight").sizes(),
            (Shape{16, 4}));
}

namespace {
// Gradients of mse(model(x), target) for every parameter that requires one, by name.
std::map<std::string, Tensor> grads_of(fm::UNet2DConditionModel& m, const Inputs& in, const Tensor& target) {
  const Tensor loss = flame::mse_loss(run(m, in), target);
  const flame::Gradients g = loss.backward();
  std::map<std::string, Tensor> out;
  for (const auto& [name, p] : m.named_parameters()) {
    if (p.requires_grad()) out[name] = g.get(p);
  }
  return out;
}
}  // namespace

TEST(UNet2D, GradientCheckpointingGivesTheSameGradients) {
  for (bool lora : {true, false}) {
    const auto c = tiny_xl();
    fm::UNet2DConditionModel m(c);
    fd_test::perturb(m, 0.02, 9);
    if (lora) {
      m.add_lora({.rank = 2, .alpha = 4.0});
      fd_test::perturb(m, 0.05, 10);  // moves lora_B away from 0 (PEFT's init) so A gets a gradient
    }
    const Inputs in = make_inputs(c, 2, 16, 16, 11);
    const Tensor target = randn({2, 4, 16, 16}, 12);
    const auto plain = grads_of(m, in, target);
    const std::size_t saved_plain = flame::autograd_saved_bytes(run(m, in));
    m.set_gradient_checkpointing(true);
    EXPECT_TRUE(m.gradient_checkpointing());
    const auto ckpt = grads_of(m, in, target);
    // The blocks keep their inputs only. (Sums may run in another order: equal to f32 rounding.)
    EXPECT_LT(flame::autograd_saved_bytes(run(m, in)), saved_plain / 2) << (lora ? "lora" : "full");
    ASSERT_EQ(plain.size(), ckpt.size());
    for (const auto& [name, g] : plain) {
      ASSERT_TRUE(ckpt.count(name)) << name;
      const double scale = fd_test::max_abs(g);
      EXPECT_GT(scale, 0.0) << name;
      EXPECT_LE(fd_test::max_abs_diff(ckpt.at(name), g), 2e-5 * scale + 1e-12) << name << (lora ? " (lora)" : "");
    }
  }
}

// set_recompute_cheap: the forward under autograd::RecomputeCheap. tiny-xl at batch 2, 16x16, f32:
// what goes from the saved tensors, derived from the model's layout (Note [UNet2D layout]). Per
// BasicTransformerBlock (N tokens, C channels): norm1's and norm2's outputs (N x C each, saved by
// the LoRA A layers) and the GEGLU's gelu(gate) (N x 4C), less the two LayerNorm biases the recipes
// hold; per ResnetBlock2D: the GroupNorm outputs norm1 (N x in) and norm2 (N x out) that SiLU saves,
// less their biases; conv_norm_out's output, less its bias. Ops before the first LoRA layer record
// nothing (no input needs a gradient), so they mark nothing: down block 0, down block 1's resnet,
// and norm1 of the first transformer block, whose output its LoRA A layers save as it is.
TEST(UNet2D, RecomputeCheapGivesTheSameGradientsWithFewerSavedBytes) {
  const auto c = tiny_xl();
  fm::UNet2DConditionModel m(c);
  fd_test::perturb(m, 0.02, 21);
  m.add_lora({.rank = 2, .alpha = 4.0});
  fd_test::perturb(m, 0.05, 22);
  const Inputs in = make_inputs(c, 2, 16, 16, 23);
  const Tensor target = randn({2, 4, 16, 16}, 24);
  EXPECT_FALSE(m.recompute_cheap());
  const auto plain = grads_of(m, in, target);
  const std::size_t saved_plain = flame::autograd_saved_bytes(run(m, in));
  m.set_recompute_cheap(true);
  EXPECT_TRUE(m.recompute_cheap());
  const auto cheap = grads_of(m, in, target);
  const std::size_t saved_cheap = flame::autograd_saved_bytes(run(m, in));
  EXPECT_FALSE(flame::autograd::recompute_cheap_enabled());  // the forward restored the thread's setting

  const int64_t f = 4;  // f32
  auto block = [&](int64_t n, int64_t ch, bool first) { return f * ((first ? 0 : n * ch - ch) + n * ch - ch + n * 4 * ch); };
  auto resnet = [&](int64_t n, int64_t cin, int64_t cout) { return f * (n * cin - cin + n * cout - cout); };
  const int64_t n8 = 2 * 8 * 8, n16 = 2 * 16 * 16;
  const int64_t predicted = block(n8, 16, true) + block(n8, 16, false)                      // down block 1
                            + resnet(n8, 16, 16) + 2 * block(n8, 16, false) + resnet(n8, 16, 16)  // mid block
                            + resnet(n8, 16 + 16, 16) + 2 * block(n8, 16, false)             // up block 0
                            + resnet(n8, 16 + 8, 16) + 2 * block(n8, 16, false)              //   (cat with skips)
                            + resnet(n16, 16 + 8, 8) + resnet(n16, 8 + 8, 8)                 // up block 1
                            + f * (n16 * 8 - 8);                                             // conv_norm_out
  EXPECT_EQ(predicted, 592096);
  EXPECT_EQ(static_cast<int64_t>(saved_plain - saved_cheap), predicted);

  // The same kernels on the same inputs: the LoRA gradients are the same values.
  ASSERT_EQ(plain.size(), cheap.size());
  for (const auto& [name, g] : plain) {
    ASSERT_TRUE(cheap.count(name)) << name;
    EXPECT_GT(fd_test::max_abs(g), 0.0) << name;
    EXPECT_EQ(fd_test::max_abs_diff(cheap.at(name), g), 0.0) << name;
  }
  // With per-block checkpointing as well (the recompute of a checkpointed block marks nothing).
  m.set_gradient_checkpointing(true);
  const auto both = grads_of(m, in, target);
  for (const auto& [name, g] : plain) {
    EXPECT_LE(fd_test::max_abs_diff(both.at(name), g), 2e-5 * fd_test::max_abs(g) + 1e-12) << name;
  }
}

// ---- parity with diffusers (reference/models_unet.py) ----
namespace {
void reference_parity(const std::string& name, const fm::UNet2DConditionConfig& config,
                      const std::filesystem::path& dir) {
  const auto ref_path = dir / "reference.safetensors";
  if (!std::filesystem::exists(ref_path)) {
    GTEST_SKIP() << "no diffusers reference at " << dir.string()
                 << " (make it with: python3 apps/diffusion/reference/models_unet.py --config " << name << " --out "
                 << dir.string() << ")";
  }
  const auto c = fm::unet2d_config_from_file((dir / "unet" / "config.json").string());
  EXPECT_EQ(c.block_out_channels, config.block_out_channels);
  EXPECT_EQ(c.attention_heads, config.attention_heads);
  EXPECT_EQ(c.down_block_types, config.down_block_types);
  const flame::StateDict ref = flame::io::load_safetensors(ref_path.string());
  Inputs in;
  in.sample = ref.at("input.sample");
  in.timestep = ref.at("input.timestep");
  in.context = ref.at("input.encoder_hidden_states");
  if (ref.contains("input.text_embeds")) {
    in.added.text_embeds = ref.at("input.text_embeds");
    in.added.time_ids = ref.at("input.time_ids");
  }
  const auto meta = flame::io::load_safetensors_metadata(ref_path.string());
  const int64_t rank = std::stoll(meta.at("lora_rank"));
  const double alpha = std::stod(meta.at("lora_alpha"));
  for (const std::string format : {"diffusers", "original"}) {
    const auto original = dir / "unet_original.safetensors";
    if (format == "original" && !std::filesystem::exists(original)) {
      std::cout << "[   NOTE   ] " << name << ": no " << original.string() << "; the original layout is not compared\n";
      continue;
    }
    auto unet = format == "diffusers" ? fm::load_unet(dir.string()) : fm::load_unet(original.string(), {.config = c});
    fm::UNet2DConditionModel& m = *unet;
    expect_close(run(m, in), ref.at("output.sample"), 2e-5, 1e-6, name + " " + format + " output");
    m.add_lora({.rank = rank, .alpha = alpha});
    flame::StateDict lora;
    for (const auto& [k, t] : ref) {
      if (k.rfind("lora.", 0) == 0) lora.insert(k.substr(5), t);
    }
    nn::load_lora_state_dict(m, lora);
    const Tensor out = run(m, in);
    expect_close(out, ref.at("output.lora_sample"), 2e-5, 1e-6, name + " " + format + " LoRA output");
    const Tensor loss = flame::mse_loss(out, ref.at("input.target"));
    expect_close(loss.reshape({1}), ref.at("output.loss").reshape({1}), 1e-5, 0.0, name + " loss");
    const flame::Gradients g = loss.backward();
    int64_t checked = 0;
    for (const auto& [pname, p] : m.named_parameters()) {
      if (!p.requires_grad()) continue;
      ASSERT_TRUE(ref.contains("grad." + pname)) << "no reference gradient for " << pname;
      expect_close(g.get(p), ref.at("grad." + pname), 1e-4, 1e-9, name + " " + format + " grad " + pname);
      ++checked;
    }
    EXPECT_EQ(checked, static_cast<int64_t>(lora.size()));
  }
}
}  // namespace

TEST(UNet2D, MatchesDiffusersTinyXl) { reference_parity("tiny-xl", tiny_xl(), reference_dir("tiny-xl")); }
TEST(UNet2D, MatchesDiffusersTinySd) { reference_parity("tiny-sd", tiny_sd(), reference_dir("tiny-sd")); }

// The reference folder's format (what models_unet.py writes), made here from FLAME's own model:
// the parity path above reads it back with zero error.
TEST(UNet2D, ReferenceFolderFormatRoundTrip) {
  const auto c = tiny_xl();
  const auto dir = std::filesystem::temp_directory_path() / ("unet2d_ref_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "unet");
  {
    std::ofstream(dir / "unet" / "config.json") << R"({"_class_name": "UNet2DConditionModel", "sample_size": 16,
      "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"], "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
      "block_out_channels": [8, 16], "layers_per_block": 1, "transformer_layers_per_block": [1, 2],
      "cross_attention_dim": 12, "attention_head_dim": [2, 2], "norm_num_groups": 4, "use_linear_projection": true,
      "addition_embed_type": "text_time", "addition_time_embed_dim": 4, "projection_class_embeddings_input_dim": 34})";
  }
  fm::UNet2DConditionModel m(c);
  fd_test::perturb(m, 0.02, 21);
  flame::StateDict original;
  for (const auto& [k, t] : m.state_dict()) original.insert(ldm_key(k, c), t);
  flame::io::save_safetensors((dir / "unet" / "diffusion_pytorch_model.safetensors").string(), m.state_dict());
  flame::io::save_safetensors((dir / "unet_original.safetensors").string(), original);
  const Inputs in = make_inputs(c, 2, 16, 16, 22);
  const Tensor target = randn({2, 4, 16, 16}, 23);
  flame::StateDict ref{{"input.sample", in.sample}, {"input.timestep", in.timestep},
                       {"input.encoder_hidden_states", in.context}, {"input.text_embeds", in.added.text_embeds},
                       {"input.time_ids", in.added.time_ids}, {"input.target", target}};
  ref.insert("output.sample", run(m, in));
  m.add_lora({.rank = 4, .alpha = 8.0});
  {
    flame::NoGradGuard no_grad;
    for (auto& [k, t] : m.named_parameters()) {
      if (k.find(".lora_B.") != std::string::npos) t.copy_(randn(t.sizes(), 24, 0.05));
    }
  }
  const Tensor out = run(m, in);
  const Tensor loss = flame::mse_loss(out, target);
  const flame::Gradients g = loss.backward();
  ref.insert("output.lora_sample", out.detach());
  ref.insert("output.loss", loss.detach().reshape({1}));
  for (const auto& [k, t] : m.named_parameters()) {
    if (!t.requires_grad()) continue;
    ref.insert("lora." + k, t.detach());
    ref.insert("grad." + k, g.get(t));
  }
  flame::io::save_safetensors((dir / "reference.safetensors").string(), ref,
                              {{"lora_rank", "4"}, {"lora_alpha", "8.0"}, {"dtype", "float32"}, {"config", "tiny-xl"}});
  reference_parity("tiny-xl", c, dir);
  std::filesystem::remove_all(dir);
}
