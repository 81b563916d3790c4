// The text encoders (models/clip_text.h, models/t5_encoder.h, models/text_checkpoint.h) at reduced
// configurations: transformers' parameter names, parity with transformers through the stored
// reference outputs of apps/diffusion/reference/models_text.py --reduced from every layout (f32
// and bf16; fp8 files against the model with their dequantized weights), every layout loading the
// same parameters, T5's relative position buckets, the EOS pooling rule, the causal mask, family
// selection in files holding several encoders, pipeline and sharded folders, and load errors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <string>

#include <flame/flame.h>
#include <flame/io/safetensors.h>
#include <flame/nn.h>

#include "model_test_util.h"
#include "models/text_checkpoint.h"

namespace fs = std::filesystem;
namespace m = flame_diffusion::models;
using flame::DType;
using flame::Tensor;
using fd_test::error_of;

namespace {

const fs::path kRoot = fs::path(__FILE__).parent_path() / "data" / "models";

#define SKIP_WITHOUT_REFERENCE(dir)                                                                          \
  do {                                                                                                       \
    if (!fs::exists((dir) / "reference.safetensors"))                                                        \
      GTEST_SKIP() << "reference outputs " << ((dir) / "reference.safetensors").string()                     \
                   << " not generated yet: run apps/diffusion/reference/models_text.py --reduced --out "     \
                   << kRoot.string();                                                                        \
  } while (0)

// max |a - b| / max |b|
double rel_err(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  if (a.sizes() != b.sizes()) return 1e30;
  const Tensor x = a.to(DType::f64, flame::Device::cpu()), y = b.to(DType::f64, flame::Device::cpu());
  return (x - y).abs().max().item<double>() / std::max(1e-30, y.abs().max().item<double>());
}

struct Reference {
  flame::StateDict out;
  flame::io::Metadata meta;
  std::map<std::string, std::string> files;  // file -> output prefix
};
Reference read_reference(const fs::path& dir) {
  Reference r;
  const std::string path = (dir / "reference.safetensors").string();
  r.out = flame::io::load_safetensors(path);
  r.meta = flame::io::load_safetensors_metadata(path);
  const m::JsonConfig files = m::JsonConfig::parse(r.meta.at("files"), path + " metadata \"files\"");
  for (const std::string& k : files.keys()) r.files[k] = files.get_string(k);
  return r;
}

m::TextEncoderLoadOptions options_for(const fs::path& dir, const std::string& family, DType dtype = DType::f32) {
  m::TextEncoderLoadOptions o;
  o.device = fd_test::test_device();
  o.dtype = dtype;
  o.family = family;
  o.config_json = (dir / "transformers" / "config.json").string();  // heads are not in the shapes
  return o;
}

// Every parameter of `a` equals `b`'s of the same name, bit for bit.
void expect_same_parameters(const flame::nn::Module& a, const flame::nn::Module& b) {
  const flame::StateDict sb = b.state_dict();
  for (const auto& [name, t] : a.state_dict()) {
    ASSERT_NE(sb.find(name), nullptr) << name;
    EXPECT_EQ(fd_test::max_abs_diff(t, sb.at(name)), 0.0) << name;
  }
}

void check_clip(m::ClipTextModel& clip, const Reference& ref, const std::string& prefix, double tol) {
  flame::NoGradGuard no_grad;
  const Tensor ids = ref.out.at("input_ids");
  for (const std::string tag : {"", "masked_"}) {
    SCOPED_TRACE(prefix + tag);
    m::ClipEncodeOptions eo;
    eo.output_hidden_states = true;
    if (!tag.empty()) eo.attention_mask = ref.out.at("attention_mask");
    const m::ClipTextOutput o = clip.encode(ids, eo);
    ASSERT_EQ(static_cast<int64_t>(o.hidden_states.size()), clip.config().num_hidden_layers + 1);
    EXPECT_LT(rel_err(o.last_hidden_state, ref.out.at(prefix + tag + "last_hidden_state")), tol);
    EXPECT_LT(rel_err(o.hidden_states[o.hidden_states.size() - 2], ref.out.at(prefix + tag + "penultimate")), tol);
    EXPECT_LT(rel_err(o.hidden_states[0], ref.out.at(prefix + tag + "embeddings")), tol);
    EXPECT_LT(rel_err(o.pooled, ref.out.at(prefix + tag + "pooled")), tol);
    if (clip.config().with_projection) EXPECT_LT(rel_err(o.text_embeds, ref.out.at(prefix + tag + "text_embeds")), tol);
  }
}

void check_t5(m::T5EncoderModel& t5, const Reference& ref, const std::string& prefix, double tol) {
  flame::NoGradGuard no_grad;
  const Tensor ids = ref.out.at("input_ids");
  EXPECT_LT(rel_err(t5.encode(ids, ref.out.at("attention_mask")), ref.out.at(prefix + "last_hidden_state")), tol);
  EXPECT_LT(rel_err(t5.encode(ids), ref.out.at(prefix + "unmasked_last_hidden_state")), tol);
}

m::ClipTextConfig tiny_clip() {
  m::ClipTextConfig c;
  c.vocab_size = 50;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.max_position_embeddings = 10;
  c.projection_dim = 8;
  c.family = "custom";
  return c;
}

m::T5EncoderConfig tiny_t5() {
  m::T5EncoderConfig c;
  c.vocab_size = 40;
  c.d_model = 16;
  c.d_kv = 4;
  c.d_ff = 24;
  c.num_layers = 2;
  c.num_heads = 4;
  c.family = "custom";
  return c;
}

}  // namespace

TEST(ModelsText, ClipParameterNamesAreTransformers) {
  const m::ClipTextModel clip(tiny_clip());
  std::set<std::string> want = {"text_model.embeddings.token_embedding.weight",
                                "text_model.embeddings.position_embedding.weight",
                                "text_model.final_layer_norm.weight", "text_model.final_layer_norm.bias",
                                "text_projection.weight"};
  for (int i = 0; i < 2; ++i) {
    const std::string l = "text_model.encoder.layers." + std::to_string(i) + ".";
    for (const char* p : {"weight", "bias"})
      for (const char* mod : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
                              "layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2"})
        want.insert(l + mod + "." + p);
  }
  std::set<std::string> got;
  for (const auto& [name, t] : clip.state_dict()) got.insert(name);
  EXPECT_EQ(got, want);
  EXPECT_EQ(clip.state_dict().at("text_projection.weight").sizes(), (flame::Shape{8, 16}));
  // The key set of transformers' own file, where the reference exists.
  const fs::path file = kRoot / "text-tiny-clip" / "transformers" / "model.safetensors";
  if (fs::exists(file)) {
    const m::ClipTextModel ref_model(m::inspect_clip_text(m::Checkpoint::open(file.parent_path().string())).config);
    std::set<std::string> stored, mine;
    const flame::io::SafetensorsFile f(file.string());
    for (const std::string& k : f.names()) stored.insert(k);
    for (const auto& [name, t] : ref_model.state_dict()) mine.insert(name);
    EXPECT_EQ(mine, stored);
  }
}

TEST(ModelsText, T5ParameterNamesAreTransformers) {
  const m::T5EncoderModel t5(tiny_t5());
  std::set<std::string> want = {"shared.weight", "encoder.final_layer_norm.weight",
                                "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"};
  for (int i = 0; i < 2; ++i) {
    const std::string b = "encoder.block." + std::to_string(i) + ".layer.";
    for (const char* q : {"q", "k", "v", "o"}) want.insert(b + "0.SelfAttention." + q + ".weight");
    want.insert(b + "0.layer_norm.weight");
    for (const char* w : {"wi_0", "wi_1", "wo"}) want.insert(b + "1.DenseReluDense." + w + ".weight");
    want.insert(b + "1.layer_norm.weight");
  }
  std::set<std::string> got;
  for (const auto& [name, t] : t5.state_dict()) got.insert(name);
  EXPECT_EQ(got, want);
  // f16 keeps wo in f32 (transformers' _keep_in_fp32_modules), everything else in f16.
  const m::T5EncoderModel half(tiny_t5(), {DType::f16});
  for (const auto& [name, t] : half.state_dict())
    EXPECT_EQ(t.dtype(), name.find(".wo.") != std::string::npos ? DType::f32 : DType::f16) << name;
}

TEST(ModelsText, ClipMatchesTransformersFromEveryLayout) {
  FD_SKIP_IF_NO_DEVICE();
  for (const char* name : {"text-tiny-clip", "text-tiny-clip-g"}) {
    const fs::path dir = kRoot / name;
    SKIP_WITHOUT_REFERENCE(dir);
    SCOPED_TRACE(name);
    const Reference ref = read_reference(dir);
    const std::string family = ref.meta.at("family");
    auto base = m::load_clip_text((dir / "transformers").string(), options_for(dir, family));
    ASSERT_TRUE(base->config().with_projection);
    for (const auto& [file, prefix] : ref.files) {
      SCOPED_TRACE(file);
      auto clip = m::load_clip_text((dir / file).string(), options_for(dir, family));
      expect_same_parameters(*clip, *base);
      check_clip(*clip, ref, prefix, 1e-4);
    }
    // bf16 (the reference ran transformers in bf16 on the CPU).
    auto bf16 = m::load_clip_text((dir / "transformers").string(), options_for(dir, family, DType::bf16));
    check_clip(*bf16, ref, "bf16_", 3e-2);
    // transformers 5 saves the model without the "text_model." level: the same folder so renamed.
    const fs::path flat = fd_test::fresh_temp_dir("flame_text", std::string("flat_") + name);
    fs::copy(dir / "transformers" / "config.json", flat / "config.json");
    flame::StateDict renamed;
    for (const auto& [key, t] : flame::io::load_safetensors((dir / "transformers" / "model.safetensors").string()))
      renamed.insert(key.rfind("text_model.", 0) == 0 ? key.substr(11) : key, t);
    ASSERT_TRUE(renamed.find("embeddings.token_embedding.weight") != nullptr);
    flame::io::save_safetensors((flat / "model.safetensors").string(), renamed);
    auto flat_clip = m::load_clip_text(flat.string(), options_for(dir, family));
    expect_same_parameters(*flat_clip, *base);
    EXPECT_EQ(m::find_text_encoders(m::open_text_encoder_checkpoint(flat.string(), "clip", {})).at(0).format,
              "clip-transformers-flat");
    fs::remove_all(flat);
  }
}

TEST(ModelsText, T5MatchesTransformersFromEveryLayout) {
  FD_SKIP_IF_NO_DEVICE();
  const fs::path dir = kRoot / "text-tiny-t5";
  SKIP_WITHOUT_REFERENCE(dir);
  const Reference ref = read_reference(dir);
  auto base = m::load_t5_encoder((dir / "transformers").string(), options_for(dir, ""));
  EXPECT_EQ(base->config().num_layers, 3);
  for (const auto& [file, prefix] : ref.files) {
    SCOPED_TRACE(file);
    auto t5 = m::load_t5_encoder((dir / file).string(), options_for(dir, ""));
    if (prefix.empty()) expect_same_parameters(*t5, *base);
    check_t5(*t5, ref, prefix, 1e-4);
    // Single files need no config.json: the architecture comes from the shapes.
    m::TextEncoderLoadOptions o = options_for(dir, "");
    o.config_json.clear();
    if (file != "transformers") {
      auto inferred = m::load_t5_encoder((dir / file).string(), o);
      EXPECT_EQ(inferred->config().d_kv, base->config().d_kv);
      EXPECT_EQ(inferred->config().num_heads, base->config().num_heads);
      check_t5(*inferred, ref, prefix, 1e-4);
    }
  }
  auto bf16 = m::load_t5_encoder((dir / "transformers").string(), options_for(dir, "", DType::bf16));
  check_t5(*bf16, ref, "bf16_", 3e-2);
}

TEST(ModelsText, T5RelativePositionBucketsMatchTransformers) {
  // Closed forms of the bidirectional rule with 32 buckets, max distance 128: |d| < 8 has bucket |d|
  // (+16 for keys after the query); |d| >= 128 the last bucket of its half.
  const Tensor b = m::t5_relative_position_buckets(1, 300, 32, 128);
  const std::vector<int64_t> v = b.to_vec<int64_t>();
  for (int d = 0; d < 8; ++d) EXPECT_EQ(v[d], d == 0 ? 0 : 16 + d) << d;
  for (int d = 128; d < 300; ++d) EXPECT_EQ(v[d], 31) << d;
  for (int d = 8; d < 128; ++d) {  // log-spaced: 8 + floor(log(d / 8) / log(16) * 8), in double far from ties
    const double f = std::log(d / 8.0) / std::log(16.0) * 8.0;
    if (std::abs(f - std::round(f)) > 1e-4) EXPECT_EQ(v[d], 16 + 8 + static_cast<int64_t>(f)) << d;
  }
  const Tensor neg = m::t5_relative_position_buckets(300, 1, 32, 128);  // key 0, queries 0..299: d = -i
  const std::vector<int64_t> n = neg.to_vec<int64_t>();
  for (int i = 0; i < 300; ++i) EXPECT_EQ(n[i], i == 0 ? 0 : v[i] - 16) << i;
  // transformers' own table of distances -511..511 (f32 logs, ties included).
  const fs::path dir = kRoot / "text-tiny-t5";
  SKIP_WITHOUT_REFERENCE(dir);
  const std::vector<int64_t> want = read_reference(dir).out.at("buckets").to_vec<int64_t>();
  ASSERT_EQ(want.size(), 1023u);
  const Tensor full = m::t5_relative_position_buckets(512, 512, 32, 128);
  const std::vector<int64_t> last_row = full.select(0, 511).to_vec<int64_t>();  // d = -511..0
  const std::vector<int64_t> first_row = full.select(0, 0).to_vec<int64_t>();   // d = 0..511
  for (int i = 0; i < 512; ++i) {
    EXPECT_EQ(last_row[i], want[i]) << "distance " << i - 511;
    EXPECT_EQ(first_row[i], want[511 + i]) << "distance " << i;
  }
}

TEST(ModelsText, T5LayerNormAgainstFloat64) {
  flame::Generator gen(3);
  const Tensor x = Tensor::randn({3, 16}, 0.0, 20.0, {DType::f32}, &gen);
  const Tensor w = Tensor::uniform({16}, 0.5, 1.5, {DType::f32}, &gen);
  const std::vector<double> xv = x.to(DType::f64).to_vec<double>(), wv = w.to(DType::f64).to_vec<double>();
  std::vector<double> want(xv.size());
  for (int r = 0; r < 3; ++r) {
    double ss = 0;
    for (int i = 0; i < 16; ++i) ss += xv[r * 16 + i] * xv[r * 16 + i];
    const double inv = 1.0 / std::sqrt(ss / 16 + 1e-6);
    for (int i = 0; i < 16; ++i) want[r * 16 + i] = wv[i] * xv[r * 16 + i] * inv;
  }
  const Tensor want_t = Tensor::from_vec(want, {3, 16});
  EXPECT_LT(rel_err(m::t5_layer_norm(x, w, 1e-6), want_t), 1e-6);
  // bf16 weight: the normed values are rounded to bf16 before the multiply; the output is bf16.
  const Tensor y = m::t5_layer_norm(x.to(DType::bf16), w.to(DType::bf16), 1e-6);
  EXPECT_EQ(y.dtype(), DType::bf16);
  EXPECT_LT(rel_err(y, want_t), 2e-2);
}

TEST(ModelsText, ClipEosPositionsFollowTransformersRule) {
  const Tensor ids = Tensor::from_vec(std::vector<int64_t>{9, 5, 7, 3, 7, 7, 9, 3, 0, 0}, {2, 5});
  // Legacy id 2: argmax of the ids (first maximum).
  EXPECT_EQ(m::clip_eos_positions(ids, 2).to_vec<int64_t>(), (std::vector<int64_t>{0, 1}));
  // Any other id: the first position holding it.
  EXPECT_EQ(m::clip_eos_positions(ids, 7).to_vec<int64_t>(), (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(m::clip_eos_positions(ids, 3).to_vec<int64_t>(), (std::vector<int64_t>{3, 2}));
}

TEST(ModelsText, ClipIsCausalAndPaddingOnlyHidesLaterKeys) {
  FD_SKIP_IF_NO_DEVICE();
  flame::manual_seed(5);
  m::ClipTextModel clip(tiny_clip(), {DType::f32, fd_test::test_device()});
  fd_test::perturb(clip, 0.05, 6);
  flame::NoGradGuard no_grad;
  const Tensor a = Tensor::from_vec(std::vector<int64_t>{48, 3, 4, 5, 49, 49, 49, 49}, {1, 8});
  const Tensor b = Tensor::from_vec(std::vector<int64_t>{48, 3, 4, 5, 49, 7, 8, 9}, {1, 8});
  const Tensor ha = clip.encode(a).last_hidden_state, hb = clip.encode(b).last_hidden_state;
  // Positions 0..4 see only themselves and earlier tokens: later tokens change nothing there.
  EXPECT_EQ(fd_test::max_abs_diff(ha.narrow(1, 0, 5), hb.narrow(1, 0, 5)), 0.0);
  EXPECT_GT(fd_test::max_abs_diff(ha.narrow(1, 5, 3), hb.narrow(1, 5, 3)), 1e-3);
  // A right-padding mask hides only keys every valid query already ignores.
  m::ClipEncodeOptions eo;
  eo.attention_mask = Tensor::from_vec(std::vector<int64_t>{1, 1, 1, 1, 1, 0, 0, 0}, {1, 8});
  const m::ClipTextOutput masked = clip.encode(b, eo);
  EXPECT_LT(fd_test::max_abs_diff(masked.last_hidden_state.narrow(1, 0, 5), hb.narrow(1, 0, 5)), 1e-5);
  EXPECT_LT(fd_test::max_abs_diff(masked.pooled, ha.select(1, 4)), 1e-5);  // legacy rule: id 49 at 4
}

TEST(ModelsText, CombinedFilesArePickedByFamily) {
  const fs::path dir = kRoot / "text-tiny-clip";
  SKIP_WITHOUT_REFERENCE(dir);
  const m::Checkpoint ck = m::Checkpoint::open((dir / "sdxl.safetensors").string());
  const std::vector<m::TextEncoderEntry> found = m::find_text_encoders(ck);
  ASSERT_EQ(found.size(), 2u);
  EXPECT_EQ(found[0].prefix, "conditioner.embedders.0.transformer.");
  EXPECT_EQ(found[0].family, "clip-l");
  EXPECT_EQ(found[1].prefix, "conditioner.embedders.1.model.");
  EXPECT_EQ(found[1].format, "clip-openclip");
  EXPECT_EQ(found[1].family, "clip-g");
  const std::string err = error_of([&] { m::load_clip_text(ck, {}); });
  for (const char* part : {"sdxl.safetensors", "holds 2 CLIP text encoders", "conditioner.embedders.0.transformer.",
                           "conditioner.embedders.1.model.", "family"})
    EXPECT_NE(err.find(part), std::string::npos) << part << " in: " << err;
  // Each family loads the parameters of its own transformers folder.
  auto l = m::load_clip_text(ck, options_for(dir, "clip-l"));
  expect_same_parameters(*l, *m::load_clip_text((dir / "transformers").string(), options_for(dir, "clip-l")));
  const fs::path gdir = kRoot / "text-tiny-clip-g";
  auto g = m::load_clip_text(ck, options_for(gdir, "clip-g"));
  EXPECT_TRUE(g->config().with_projection);
  expect_same_parameters(*g, *m::load_clip_text((gdir / "transformers").string(), options_for(gdir, "clip-g")));
  // SD3's file holds three encoders: T5 loads from it too, CLIP needs the family.
  const m::Checkpoint sd3 = m::Checkpoint::open((kRoot / "text-tiny-t5" / "sd3.safetensors").string());
  EXPECT_EQ(m::find_text_encoders(sd3).size(), 3u);
  EXPECT_EQ(m::inspect_t5_encoder(sd3).entry.prefix, "text_encoders.t5xxl.transformer.");
  EXPECT_EQ(m::inspect_clip_text(sd3, "clip-g").entry.prefix, "text_encoders.clip_g.transformer.");
}

TEST(ModelsText, PipelineAndShardedFolders) {
  const fs::path l = kRoot / "text-tiny-clip", g = kRoot / "text-tiny-clip-g", t = kRoot / "text-tiny-t5";
  SKIP_WITHOUT_REFERENCE(t);
  SKIP_WITHOUT_REFERENCE(l);
  SKIP_WITHOUT_REFERENCE(g);
  const fs::path pipe = fd_test::fresh_temp_dir("flame_text", "pipeline");
  fd_test::write_text(pipe / "model_index.json", "{\"_class_name\": \"StableDiffusion3Pipeline\"}");
  fs::copy(l / "transformers", pipe / "text_encoder", fs::copy_options::recursive);
  fs::copy(g / "transformers", pipe / "text_encoder_2", fs::copy_options::recursive);
  // The T5 folder sharded by hand: two shards and transformers' index.
  fs::create_directories(pipe / "text_encoder_3");
  fs::copy(t / "transformers" / "config.json", pipe / "text_encoder_3" / "config.json");
  const flame::StateDict all = flame::io::load_safetensors((t / "transformers" / "model.safetensors").string());
  flame::StateDict a, b;
  std::string index = "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {";
  int i = 0;
  for (const auto& [name, tensor] : all) {
    const bool first = i % 2 == 0;
    (first ? a : b).insert(name, tensor);
    index += std::string(i++ ? ", " : "") + "\"" + name + "\": \"model-0000" + (first ? "1" : "2") +
             "-of-00002.safetensors\"";
  }
  index += "}}";
  flame::io::save_safetensors((pipe / "text_encoder_3" / "model-00001-of-00002.safetensors").string(), a);
  flame::io::save_safetensors((pipe / "text_encoder_3" / "model-00002-of-00002.safetensors").string(), b);
  fd_test::write_text(pipe / "text_encoder_3" / "model.safetensors.index.json", index);

  m::TextEncoderLoadOptions o;
  auto clip_l = m::load_clip_text(pipe.string(), o);
  EXPECT_EQ(clip_l->config().hidden_size, 32);
  o.family = "clip-g";
  auto clip_g = m::load_clip_text(pipe.string(), o);
  EXPECT_EQ(clip_g->config().hidden_size, 40);
  auto t5 = m::load_t5_encoder(pipe.string(), {});
  const m::Checkpoint ck = m::open_text_encoder_checkpoint(pipe.string(), "t5", {});
  EXPECT_EQ(ck.files().size(), 2u);
  expect_same_parameters(*t5, *m::load_t5_encoder((t / "transformers").string(), {}));
  fs::remove_all(pipe);
}

TEST(ModelsText, LoadErrorsNameFileFamilyAndKeys) {
  const fs::path dir = kRoot / "text-tiny-clip", t5dir = kRoot / "text-tiny-t5";
  SKIP_WITHOUT_REFERENCE(dir);
  SKIP_WITHOUT_REFERENCE(t5dir);
  const fs::path tmp = fd_test::fresh_temp_dir("flame_text", "errors");
  // A T5 file where a CLIP is asked for: the message says what the file holds.
  const std::string t5file = (t5dir / "t5xxl.safetensors").string();
  std::string err = error_of([&] { m::load_clip_text(t5file, {}); });
  for (const char* part : {"t5xxl.safetensors", "holds no CLIP text encoder", "encoder.", "load_t5_encoder"})
    EXPECT_NE(err.find(part), std::string::npos) << part << " in: " << err;
  // A file of another model: its first keys.
  const std::string other = (tmp / "vae.safetensors").string();
  flame::io::save_safetensors(other, flame::StateDict{{"encoder.conv_in.weight", Tensor::zeros({4, 3, 3, 3})}});
  err = error_of([&] { m::load_t5_encoder(other, {}); });
  for (const char* part : {"vae.safetensors", "holds no T5 encoder", "encoder.conv_in.weight", "another model"})
    EXPECT_NE(err.find(part), std::string::npos) << part << " in: " << err;
  // A missing key and a wrong shape: named per key with the file and the family.
  flame::StateDict sd = flame::io::load_safetensors((dir / "clip_l.safetensors").string());
  flame::StateDict broken;
  for (const auto& [name, t] : sd) {
    if (name == "text_model.encoder.layers.1.mlp.fc2.bias") continue;
    broken.insert(name, name == "text_model.encoder.layers.0.self_attn.q_proj.weight" ? Tensor::zeros({32, 31}) : t);
  }
  const std::string bad = (tmp / "clip_l_broken.safetensors").string();
  flame::io::save_safetensors(bad, broken);
  err = error_of([&] { m::load_clip_text(bad, options_for(dir, "clip-l")); });
  for (const char* part : {"clip_l_broken.safetensors", "clip-l", "clip-transformers",
                           "text_model.encoder.layers.1.mlp.fc2.bias", "text_model.encoder.layers.0.self_attn.q_proj.weight",
                           "[32, 31]"})
    EXPECT_NE(err.find(part), std::string::npos) << part << " in: " << err;
  // A stored key the model has no place for.
  flame::StateDict extra = sd;
  extra.insert("text_model.encoder.layers.9.mlp.fc1.weight", Tensor::zeros({2, 2}));
  const std::string more = (tmp / "clip_l_extra.safetensors").string();
  flame::io::save_safetensors(more, extra);
  err = error_of([&] { m::load_clip_text(more, options_for(dir, "clip-l")); });
  EXPECT_NE(err.find("text_model.encoder.layers.9.mlp.fc1.weight"), std::string::npos) << err;
  m::TextEncoderLoadOptions lenient = options_for(dir, "clip-l");
  lenient.allow_unplaced = true;
  EXPECT_NO_THROW(m::load_clip_text(more, lenient));
  fs::remove_all(tmp);
}

TEST(ModelsText, ConfigJsonErrorsNameFileAndKey) {
  const fs::path tmp = fd_test::fresh_temp_dir("flame_text", "config");
  fd_test::write_text(tmp / "clip.json", "{\"hidden_size\": 32, \"num_attention_heads\": 4, \"hidden_act\": \"relu\"}");
  std::string err = error_of([&] { m::ClipTextConfig::from_json(m::JsonConfig::from_file((tmp / "clip.json").string())); });
  for (const char* part : {"clip.json", "hidden_act", "relu"}) EXPECT_NE(err.find(part), std::string::npos) << err;
  fd_test::write_text(tmp / "t5.json", "{\"feed_forward_proj\": \"relu\"}");
  err = error_of([&] { m::T5EncoderConfig::from_json(m::JsonConfig::from_file((tmp / "t5.json").string())); });
  for (const char* part : {"t5.json", "feed_forward_proj", "relu", "gated-gelu"})
    EXPECT_NE(err.find(part), std::string::npos) << err;
  const m::ClipTextConfig g = m::ClipTextConfig::preset("clip-g");
  EXPECT_EQ(g.hidden_size, 1280);
  EXPECT_EQ(g.num_attention_heads, 20);
  EXPECT_EQ(g.hidden_act, "gelu");
  const m::T5EncoderConfig x = m::T5EncoderConfig::preset("t5-xxl");
  EXPECT_EQ(x.d_model * 1 + x.d_ff + x.num_layers + x.num_heads, 4096 + 10240 + 24 + 64);
  fs::remove_all(tmp);
}
