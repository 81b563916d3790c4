// The checkpoint format layer (models/checkpoint.h): config.json getters, opening single files,
// diffusers folders, shards, variants and pipeline subfolders, the format registry, and loading
// through a key plan (values, dtype conversion, and the errors that name what does not fit).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <unistd.h>

#include <flame/flame.h>
#include <flame/io/safetensors.h>
#include <flame/nn.h>

#include "model_test_util.h"
#include "models/checkpoint.h"

namespace fs = std::filesystem;
namespace m = flame_diffusion::models;
using flame::DType;
using flame::Tensor;

namespace {

fs::path temp_dir(const std::string& name) { return fd_test::fresh_temp_dir("flame_ckpt", name); }
using fd_test::error_of;
using fd_test::write_text;

Tensor arange_f(int64_t n, const flame::Shape& shape, double offset = 0.0) {
  return (Tensor::arange(n, {DType::f32}) + offset).reshape(shape);
}

struct Tiny : flame::nn::Module {
  std::shared_ptr<flame::nn::Linear> lin;
  std::shared_ptr<flame::nn::Conv2d> conv;
  Tiny() {
    lin = register_module("lin", std::make_shared<flame::nn::Linear>(4, 6));
    conv = register_module("conv", std::make_shared<flame::nn::Conv2d>(2, 3, 1));
  }
};

}  // namespace

TEST(ModelsJsonConfig, GettersDefaultsAndTypeErrors) {
  const auto c = m::JsonConfig::parse(
      R"({"a": 3, "f": 2.5, "whole": 4.0, "s": "x", "b": true, "l": [1, 2, 3], "d": [0.5, 1], "n": null,
          "names": ["p", "q"], "bad_list": [1, "two"]})",
      "test.json");
  EXPECT_EQ(c.get_int("a"), 3);
  EXPECT_EQ(c.get_int("whole"), 4);
  EXPECT_EQ(c.get_int("missing", 7), 7);
  EXPECT_EQ(c.get_int("n", 9), 9);  // null reads as absent (diffusers writes shift_factor: null)
  EXPECT_FALSE(c.has("n"));
  EXPECT_DOUBLE_EQ(c.get_double("f"), 2.5);
  EXPECT_DOUBLE_EQ(c.get_double("a"), 3.0);
  EXPECT_FALSE(c.get_optional_double("n").has_value());
  EXPECT_EQ(c.get_string("s"), "x");
  EXPECT_TRUE(c.get_bool("b"));
  EXPECT_EQ(c.get_ints("l"), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(c.get_doubles("d", {}), (std::vector<double>{0.5, 1.0}));
  EXPECT_EQ(c.get_strings("names", {}), (std::vector<std::string>{"p", "q"}));

  std::string e = error_of([&] { c.get_int("f"); });
  EXPECT_NE(e.find("test.json"), std::string::npos) << e;
  EXPECT_NE(e.find("\"f\""), std::string::npos) << e;
  EXPECT_NE(e.find("integer"), std::string::npos) << e;
  e = error_of([&] { c.get_ints("bad_list"); });
  EXPECT_NE(e.find("bad_list"), std::string::npos) << e;
  e = error_of([&] { c.get_string("missing"); });
  EXPECT_NE(e.find("missing"), std::string::npos) << e;
  e = error_of([&] { c.get_bool("s"); });
  EXPECT_NE(e.find("true or false"), std::string::npos) << e;
  // Outside int64's range: an error naming the key, not an undefined conversion.
  const auto big = m::JsonConfig::parse(R"({"huge": 1e300, "over": 18446744073709551615, "edge": -9.2233720368547758e18})",
                                        "big.json");
  EXPECT_NE(error_of([&] { big.get_int("huge"); }).find("\"huge\""), std::string::npos);
  EXPECT_NE(error_of([&] { big.get_int("over"); }).find("int64"), std::string::npos);
  EXPECT_EQ(big.get_int("edge"), std::numeric_limits<int64_t>::min());
  EXPECT_NE(error_of([] { m::JsonConfig::parse("{not json", "broken.json"); }).find("broken.json"), std::string::npos);
  EXPECT_NE(error_of([] { m::JsonConfig::parse("[1]", "list.json"); }).find("object"), std::string::npos);
}

TEST(ModelsCheckpoint, OpensFilesFoldersShardsVariantsAndPipelines) {
  const fs::path d = temp_dir("open");
  const Tensor a = arange_f(6, {2, 3}), b = arange_f(4, {4}, 10.0), c = arange_f(2, {2}, 20.0);

  // Single file.
  flame::io::save_safetensors((d / "one.safetensors").string(), flame::StateDict{{"a", a}, {"b", b}});
  m::Checkpoint one = m::Checkpoint::open((d / "one.safetensors").string());
  EXPECT_TRUE(one.is_single_file());
  EXPECT_EQ(one.config(), nullptr);
  EXPECT_EQ(one.keys(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(one.info("a").shape, (flame::Shape{2, 3}));
  EXPECT_TRUE(one.has_prefix("b"));
  EXPECT_FALSE(one.has_prefix("x"));
  EXPECT_EQ(one.load("b").to_vec<float>(), b.to_vec<float>());

  // Diffusers folder with only the fp16 variant: found, and converted back on request.
  const fs::path v = d / "variant";
  fs::create_directories(v);
  write_text(v / "config.json", R"({"_class_name": "AutoencoderKL", "latent_channels": 4})");
  flame::io::save_safetensors((v / "diffusion_pytorch_model.fp16.safetensors").string(),
                              flame::StateDict{{"a", a.to(DType::f16)}});
  m::Checkpoint var = m::Checkpoint::open(v.string());
  EXPECT_FALSE(var.is_single_file());
  ASSERT_NE(var.config(), nullptr);
  EXPECT_EQ(var.config()->get_int("latent_channels"), 4);
  EXPECT_EQ(var.info("a").dtype, "F16");
  Tensor a32 = var.load("a", flame::Device::cpu(), DType::f32);
  EXPECT_EQ(a32.dtype(), DType::f32);
  EXPECT_EQ(a32.to_vec<float>(), a.to_vec<float>());  // small integers are exact in f16
  // With both present, "" prefers the full-precision file and "fp16" the variant.
  flame::io::save_safetensors((v / "diffusion_pytorch_model.safetensors").string(), flame::StateDict{{"full", a}});
  EXPECT_TRUE(m::Checkpoint::open(v.string()).contains("full"));
  EXPECT_TRUE(m::Checkpoint::open(v.string(), {"", "fp16"}).contains("a"));

  // Sharded folder inside a pipeline folder, opened from the pipeline root with subfolder "vae".
  const fs::path pipe = d / "pipe", vae = pipe / "vae";
  fs::create_directories(vae);
  write_text(pipe / "model_index.json", R"({"_class_name": "StableDiffusionXLPipeline"})");
  write_text(vae / "config.json", R"({"latent_channels": 16})");
  flame::io::save_safetensors((vae / "diffusion_pytorch_model-00001-of-00002.safetensors").string(),
                              flame::StateDict{{"a", a}, {"b", b}});
  flame::io::save_safetensors((vae / "diffusion_pytorch_model-00002-of-00002.safetensors").string(),
                              flame::StateDict{{"c", c}});
  write_text(vae / "diffusion_pytorch_model.safetensors.index.json",
             R"({"metadata": {}, "weight_map": {"a": "diffusion_pytorch_model-00001-of-00002.safetensors",
                 "b": "diffusion_pytorch_model-00001-of-00002.safetensors",
                 "c": "diffusion_pytorch_model-00002-of-00002.safetensors"}})");
  m::Checkpoint sharded = m::Checkpoint::open(pipe.string(), {"vae", ""});
  EXPECT_EQ(sharded.files().size(), 2u);
  EXPECT_EQ(sharded.keys().size(), 3u);
  EXPECT_NE(sharded.description().find("2 shards"), std::string::npos) << sharded.description();
  EXPECT_EQ(sharded.config()->get_int("latent_channels"), 16);
  EXPECT_EQ(sharded.load("c").to_vec<float>(), c.to_vec<float>());
  EXPECT_NE(sharded.file_of("c").find("00002-of-00002"), std::string::npos);
  fs::remove_all(d);
}

TEST(ModelsCheckpoint, BadPathsAndDamagedFilesRaiseNamingThem) {
  const fs::path d = temp_dir("bad");
  std::string e = error_of([&] { m::Checkpoint::open((d / "nope.safetensors").string()); });
  EXPECT_NE(e.find("nope.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("does not exist"), std::string::npos) << e;

  fs::create_directories(d / "empty");
  e = error_of([&] { m::Checkpoint::open((d / "empty").string(), {"vae", ""}); });
  EXPECT_NE(e.find("diffusion_pytorch_model.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("subfolder"), std::string::npos) << e;

  write_text(d / "model.ckpt", "pickle");
  e = error_of([&] { m::Checkpoint::open((d / "model.ckpt").string()); });
  EXPECT_NE(e.find("not a .safetensors"), std::string::npos) << e;

  // Truncated: the header promises more data than the file holds.
  const fs::path cut = d / "cut.safetensors";
  flame::io::save_safetensors(cut.string(), flame::StateDict{{"w", Tensor::ones({64, 64})}});
  fs::resize_file(cut, fs::file_size(cut) / 2);
  e = error_of([&] { m::Checkpoint::open(cut.string()); });
  EXPECT_NE(e.find("cut.safetensors"), std::string::npos) << e;

  write_text(d / "garbage.safetensors", std::string("\x08\x00\x00\x00\x00\x00\x00\x00{bad:!!}", 16));
  e = error_of([&] { m::Checkpoint::open((d / "garbage.safetensors").string()); });
  EXPECT_NE(e.find("garbage.safetensors"), std::string::npos) << e;

  // A shard index naming a file that is not there (an interrupted download).
  fs::create_directories(d / "half");
  write_text(d / "half" / "diffusion_pytorch_model.safetensors.index.json",
             R"({"weight_map": {"a": "diffusion_pytorch_model-00001-of-00002.safetensors"}})");
  e = error_of([&] { m::Checkpoint::open((d / "half").string()); });
  EXPECT_NE(e.find("00001-of-00002"), std::string::npos) << e;
  fs::remove_all(d);
}

TEST(ModelsCheckpoint, RegistryDetectsByPriorityAndNamesWhatItTried) {
  const fs::path d = temp_dir("registry");
  flame::io::save_safetensors((d / "f.safetensors").string(),
                              flame::StateDict{{"net.marker", Tensor::ones({1})}, {"other", Tensor::ones({1})}});
  m::Checkpoint ck = m::Checkpoint::open((d / "f.safetensors").string());
  auto plan_fn = [](const m::Checkpoint& c, const std::string& p) { return m::identity_plan(c, p); };
  m::register_checkpoint_format({"test-low", "test-kind",
                                 [](const m::Checkpoint&) { return std::optional<std::string>(""); }, plan_fn, 1});
  m::register_checkpoint_format({"test-high", "test-kind",
                                 [](const m::Checkpoint& c) {
                                   return c.contains("net.marker") ? std::optional<std::string>("net.") : std::nullopt;
                                 },
                                 plan_fn, 2});
  const m::DetectedFormat det = m::detect_checkpoint_format(ck, "test-kind");
  EXPECT_EQ(det.format, "test-high");
  EXPECT_EQ(det.prefix, "net.");
  const m::KeyPlan plan = m::checkpoint_format(det.format).plan(ck, det.prefix);
  ASSERT_EQ(plan.entries.size(), 1u);
  EXPECT_EQ(plan.entries[0].target, "marker");
  EXPECT_EQ(plan.source_prefix, "net.");
  const auto names = m::checkpoint_format_names("test-kind");
  EXPECT_EQ(names, (std::vector<std::string>{"test-high", "test-low"}));

  std::string e = error_of([&] { m::detect_checkpoint_format(ck, "no-such-kind"); });
  EXPECT_NE(e.find("f.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("no-such-kind"), std::string::npos) << e;
  EXPECT_NE(e.find("net.marker"), std::string::npos) << e;  // the file's first keys
  e = error_of([] { m::checkpoint_format("no-such-format"); });
  EXPECT_NE(e.find("test-high"), std::string::npos) << e;  // lists what is registered
  fs::remove_all(d);
}

TEST(ModelsCheckpoint, PlanOpsLoadValuesConvertedToTheModuleDtype) {
  const fs::path d = temp_dir("ops");
  // lin.weight [6, 4] from two halves [3, 4] concatenated; lin.bias [6] the second chunk of a
  // fused [12]; conv.weight [3, 2, 1, 1] from a stored [3, 2] reshaped; conv.bias copied, stored f16.
  const Tensor top = arange_f(12, {3, 4}), bottom = arange_f(12, {3, 4}, 100.0);
  const Tensor fused = arange_f(12, {12}, -6.0), conv2d = arange_f(6, {3, 2}, 0.5);
  const Tensor cbias = Tensor::tensor<float>({0.25f, -1.5f, 3.0f});
  flame::io::save_safetensors((d / "p.safetensors").string(),
                              flame::StateDict{{"m.top", top},
                                               {"m.bottom", bottom},
                                               {"m.fused", fused},
                                               {"m.cw", conv2d},
                                               {"m.cb", cbias.to(DType::f16)},
                                               {"unrelated.x", Tensor::ones({2})}});
  m::Checkpoint ck = m::Checkpoint::open((d / "p.safetensors").string());
  m::KeyPlan plan;
  plan.source_prefix = "m.";
  using Op = m::KeyPlanEntry::Op;
  plan.entries.push_back({"lin.weight", {"m.top", "m.bottom"}, Op::kConcat, {}, 0, 0, 1});
  plan.entries.push_back({"lin.bias", {"m.fused"}, Op::kChunk, {}, 0, 1, 2});
  plan.entries.push_back({"conv.weight", {"m.cw"}, Op::kReshape, {3, 2, 1, 1}, 0, 0, 1});
  plan.entries.push_back({"conv.bias", {"m.cb"}, Op::kCopy, {}, 0, 0, 1});
  Tiny tiny;
  tiny.to(DType::f64);
  EXPECT_TRUE(m::check_checkpoint(tiny, ck, plan).empty());
  m::load_checkpoint(tiny, ck, plan);
  EXPECT_EQ(tiny.lin->weight().dtype(), DType::f64);
  const auto w = tiny.lin->weight().to_vec<double>();
  for (int i = 0; i < 12; ++i) {
    EXPECT_EQ(w[i], i);
    EXPECT_EQ(w[12 + i], 100.0 + i);
  }
  const auto bias = tiny.lin->bias().to_vec<double>();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(bias[i], i);  // -6 + (6 + i)
  const auto cw = tiny.conv->weight().to_vec<double>();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(cw[i], 0.5 + i);
  EXPECT_EQ(tiny.conv->bias().to_vec<double>(), (std::vector<double>{0.25, -1.5, 3.0}));  // exact in f16
  EXPECT_TRUE(tiny.lin->weight().requires_grad());  // loading keeps the parameter a leaf
  fs::remove_all(d);
}

TEST(ModelsCheckpoint, ErrorsNameMissingUnplacedAndShapeMismatchesAndChangeNothing) {
  const fs::path d = temp_dir("errors");
  flame::io::save_safetensors((d / "e.safetensors").string(),
                              flame::StateDict{{"lin.weight", Tensor::ones({6, 5})},  // model: [6, 4]
                                               {"lin.bias", Tensor::ones({6})},
                                               {"conv.weight", Tensor::ones({3, 2, 1, 1})},
                                               {"extra.stuff", Tensor::ones({2})}});
  m::Checkpoint ck = m::Checkpoint::open((d / "e.safetensors").string());
  Tiny tiny;
  const auto before = tiny.lin->bias().to_vec<float>();
  const m::KeyPlan plan = m::identity_plan(ck);
  const auto problems = m::check_checkpoint(tiny, ck, plan);
  EXPECT_EQ(problems.size(), 3u);
  const std::string e = error_of([&] { m::load_checkpoint(tiny, ck, plan, {"tiny-family", "tiny-layout"}); });
  EXPECT_NE(e.find("e.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("tiny-family"), std::string::npos) << e;
  EXPECT_NE(e.find("tiny-layout"), std::string::npos) << e;
  EXPECT_NE(e.find("lin.weight expects [6, 4], stored lin.weight gives [6, 5]"), std::string::npos) << e;
  EXPECT_NE(e.find("missing: the model's conv.bias [3]"), std::string::npos) << e;
  EXPECT_NE(e.find("unplaced: stored extra.stuff"), std::string::npos) << e;
  EXPECT_EQ(tiny.lin->bias().to_vec<float>(), before);  // nothing was written

  // A plan source the file lacks, and a reshape whose element count is wrong.
  m::KeyPlan bad;
  bad.entries.push_back({"lin.bias", {"gone"}, m::KeyPlanEntry::Op::kCopy, {}, 0, 0, 1});
  bad.entries.push_back({"conv.weight", {"conv.weight"}, m::KeyPlanEntry::Op::kReshape, {3, 3}, 0, 0, 1});
  const auto p2 = m::check_checkpoint(tiny, ck, bad, /*allow_unplaced=*/true);
  ASSERT_GE(p2.size(), 2u);
  EXPECT_NE(p2[0].find("needs stored key gone"), std::string::npos) << p2[0];
  EXPECT_NE(p2[1].find("element counts differ"), std::string::npos) << p2[1];
  fs::remove_all(d);
}
