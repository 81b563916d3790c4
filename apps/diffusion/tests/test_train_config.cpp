// TrainConfig*: the fine-tuning configuration table, its TOML reading and writing, --set overrides
// and every kind of error.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "data_test_util.h"
#include "train_config.h"

namespace fd = flame_diffusion;

namespace {

// The ConfigError text of parsing `toml` with `overrides`; "" when it parsed.
std::string error_of(const std::string& toml, const std::vector<std::string>& overrides = {}) {
  try {
    fd::parse_finetune_config(toml, "run.toml", overrides);
  } catch (const fd::ConfigError& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_HAS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << "in: " << (text)

}  // namespace

TEST(TrainConfigTable, DefaultsDocsAndHelp) {
  const fd::FinetuneConfig c;
  EXPECT_EQ(c.model.family, "flux");
  EXPECT_EQ(c.train.steps, 1000);
  EXPECT_EQ(c.train.method, "lora");
  EXPECT_EQ(c.dataset.resolution, 1024);
  EXPECT_EQ(c.dataset.caption_extension, ".txt");
  EXPECT_TRUE(c.dataset.recursive);
  EXPECT_EQ(c.optimizer.betas, (std::vector<double>{0.9, 0.999}));
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-4);
  EXPECT_EQ(c.lora.rank, 16);
  EXPECT_EQ(c.output.dir, "runs/finetune");
  const fd::DatasetConfig d = fd::default_dataset_config();
  EXPECT_EQ(d.bucket_step, 64);
  EXPECT_EQ(d.crop, "center");
  EXPECT_DOUBLE_EQ(d.max_upscale, 1.0);

  const std::string help = fd::finetune_config_help();
  std::set<std::string> keys;
  for (const auto& k : fd::finetune_config_keys()) {
    EXPECT_TRUE(keys.insert(k.key).second) << "duplicate key " << k.key;
    EXPECT_FALSE(k.doc.empty()) << k.key;
    EXPECT_EQ(k.key.find('.'), k.key.rfind('.')) << k.key << ": one table level";
    EXPECT_EQ(k.get(c), k.default_value) << k.key << ": the constructor applies the table's default";
    EXPECT_HAS(help, "  " + k.key + " = ");
    EXPECT_HAS(help, k.doc);
    EXPECT_EQ(fd::find_config_key(k.key), &k);
  }
  EXPECT_GT(keys.size(), 50u);
  EXPECT_HAS(help, "  train.steps = 1000\n");
  EXPECT_HAS(help, "  optimizer.betas = [0.9, 0.999]\n");
  EXPECT_HAS(help, "one of \"flux\", \"sd3\", \"sdxl\"");
  EXPECT_HAS(help, "optimizer.lr = 0.0001\n      the peak learning rate; a number in (0, 1]");
  EXPECT_EQ(fd::find_config_key("train.nope"), nullptr);
}

TEST(TrainConfigToml, ReadsEveryType) {
  const fd::FinetuneConfig c = fd::parse_finetune_config(R"(
[model]
family = "sdxl"
checkpoint = "/models/sd_xl_base_1.0.safetensors"
[dataset]
folders = ["/data/a", "/data/b"]
folder_repeats = [2, 0]
flip_p = 1          # an integer where a number is expected
shuffle_tags = true
keep_tokens = 1
resolution = 768
[optimizer]
lr = 2e-4
betas = [0.9, 0.99]
)",
                                                         "run.toml");
  EXPECT_EQ(c.model.family, "sdxl");
  EXPECT_EQ(c.model.checkpoint, "/models/sd_xl_base_1.0.safetensors");
  EXPECT_EQ(c.dataset.folders, (std::vector<std::string>{"/data/a", "/data/b"}));
  EXPECT_EQ(c.dataset.folder_repeats, (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(c.dataset.flip_p, 1.0);
  EXPECT_TRUE(c.dataset.shuffle_tags);
  EXPECT_EQ(c.dataset.keep_tokens, 1);
  EXPECT_EQ(c.dataset.resolution, 768);
  EXPECT_EQ(c.optimizer.lr, 2e-4);
  EXPECT_EQ(c.optimizer.betas, (std::vector<double>{0.9, 0.99}));
  // "train.steps" under [optimizer] is optimizer.train.steps: not a key.
  EXPECT_HAS(error_of("[optimizer]\ntrain.steps = 250\n"), "unknown key \"optimizer.train\"");
  EXPECT_EQ(fd::parse_finetune_config("train.steps = 250\n", "x").train.steps, 250);
  EXPECT_EQ(c.train.steps, 1000);  // untouched keys keep their defaults
}

TEST(TrainConfigToml, SavesAndReadsBackExactly) {
  fd::FinetuneConfig c;
  c.optimizer.lr = 0.1;  // not exact in binary: the shortest round-tripping text is "0.1"
  c.optimizer.eps = 1.0 / 3.0 * 1e-7;
  c.optimizer.betas = {0.9, 0.9999999999999999};
  c.dataset.max_upscale = 2.0;
  c.train.logit_mean = -0.5;
  c.sample.prompts = {"a \"quoted\" cat, on a mat", "tab\there\nnew line \\ back", "ünïcödé 猫", ""};
  c.dataset.caption_prefix = "sks, ";
  c.dataset.folders = {"/d/1_x", "rel/2_y"};
  c.dataset.folder_repeats = {0, 7};
  c.train.seed = 9007199254740993;  // above 2^53: kept as an integer
  c.lora.targets = {"to_q", "to_k"};
  const std::string text = fd::finetune_config_to_toml(c);
  EXPECT_HAS(text, "lr = 0.1\n");
  EXPECT_HAS(text, "max_upscale = 2.0\n");
  EXPECT_HAS(text, "seed = 9007199254740993\n");
  EXPECT_HAS(text, "# the peak learning rate; a number in (0, 1]\n");
  const fd::FinetuneConfig back = fd::parse_finetune_config(text, "saved");
  EXPECT_TRUE(back == c);
  EXPECT_EQ(back.sample.prompts, c.sample.prompts);
  EXPECT_EQ(back.optimizer.eps, c.optimizer.eps);
  EXPECT_EQ(back.optimizer.betas, c.optimizer.betas);
  EXPECT_EQ(back.train.seed, c.train.seed);
  EXPECT_EQ(fd::finetune_config_to_toml(back), text);
  fd::FinetuneConfig other = back;
  other.optimizer.betas[1] = 0.999;
  EXPECT_FALSE(other == c);

  fd_test::ScratchDir dir;
  const std::string path = fd::save_finetune_config(c, dir.file(""));
  EXPECT_TRUE(path.ends_with("config.toml"));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  EXPECT_TRUE(fd::load_finetune_config(path) == c);
  EXPECT_THROW(fd::save_finetune_config(c, dir.file("no/such/dir")), fd::ConfigError);
}

TEST(TrainConfigErrors, LoraPatternsNeedModuleEqualsValue) {
  using namespace flame_diffusion;
  for (const char* bad : {"lora.rank_pattern=[\"to_q\"]", "lora.rank_pattern=[\"to_q=1.5\"]",
                          "lora.rank_pattern=[\"=4\"]", "lora.alpha_pattern=[\"to_q=-1\"]"}) {
    SCOPED_TRACE(bad);
    try {
      (void)parse_finetune_config("", "run.toml", {bad});
      ADD_FAILURE() << "accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string(bad).substr(0, 17)), std::string::npos) << e.what();
    }
  }
  const FinetuneConfig c = parse_finetune_config("", "run.toml", {"lora.rank_pattern=[\"ff.net.2=8\"]",
                                                                  "lora.alpha_pattern=[\"to_q=4.5\"]"});
  EXPECT_EQ(c.lora.rank_pattern, std::vector<std::string>{"ff.net.2=8"});
  EXPECT_EQ(c.lora.alpha_pattern, std::vector<std::string>{"to_q=4.5"});
}

TEST(TrainConfigErrors, UnknownKeysNameTheKeyAndTheNearestOne) {
  EXPECT_HAS(error_of("[train]\nstpes = 10\n"), "run.toml: unknown key \"train.stpes\" (did you mean \"train.steps\"?)");
  EXPECT_HAS(error_of("[train]\nlr = 1e-3\n"), "unknown key \"train.lr\" (did you mean \"optimizer.lr\"?)");
  EXPECT_HAS(error_of("[trian]\nsteps = 10\n"), "unknown key \"trian\" (did you mean [train]?)");
  EXPECT_HAS(error_of("[lora]\nflavour = 1\n"), "unknown key \"lora.flavour\" (the keys of [lora] are: rank, alpha, rank_pattern, alpha_pattern, lokr_factor, dropout, targets)");
  EXPECT_HAS(error_of("verbose = true\n"), "unknown key \"verbose\" (the tables are [model], [dataset]");
  EXPECT_HAS(error_of("[dataset.extra]\nx = 1\n"), "unknown key \"dataset.extra\"");
}

TEST(TrainConfigErrors, WrongTypesNameKeyValueAndExpectation) {
  EXPECT_HAS(error_of("[train]\nsteps = \"many\"\n"),
             "train.steps = \"many\": expected an integer in [1, 1e+09], got a string");
  EXPECT_HAS(error_of("[train]\nsteps = 10.5\n"), "train.steps = 10.5: expected an integer in [1, 1e+09], got a float");
  EXPECT_HAS(error_of("[optimizer]\nlr = \"fast\"\n"), "optimizer.lr = \"fast\": expected a number in (0, 1], got a string");
  EXPECT_HAS(error_of("[dataset]\nfolders = \"/data\"\n"), "dataset.folders = \"/data\": expected a list of strings, got a string");
  EXPECT_HAS(error_of("[dataset]\nfolders = [\"/a\", 3]\n"), "dataset.folders[1] = 3: expected a string, got an integer");
  EXPECT_HAS(error_of("[optimizer]\nbetas = [0.9, \"x\"]\n"), "optimizer.betas[1] = \"x\": expected a number, got a string");
  EXPECT_HAS(error_of("[dataset]\nfolder_repeats = [1.5]\n"), "dataset.folder_repeats[0] = 1.5: expected an integer, got a float");
  EXPECT_HAS(error_of("[dataset]\nrecursive = 1\n"), "dataset.recursive = 1: expected true or false, got an integer");
  EXPECT_HAS(error_of("[model]\nfamily = 3\n"), "model.family = 3: expected one of \"flux\", \"sd3\", \"sdxl\", got an integer");
  EXPECT_HAS(error_of("train = 5\n"), "train = 5: train is a table of settings ([train]), not a value");
  EXPECT_HAS(error_of("[train.steps]\nx = 1\n"), "train.steps = {...}: expected an integer in [1, 1e+09], got a table");
}

TEST(TrainConfigErrors, OutOfRangeAndChoices) {
  EXPECT_HAS(error_of("[optimizer]\nlr = 0\n"), "optimizer.lr = 0: out of range: expected a number in (0, 1]");
  EXPECT_HAS(error_of("[optimizer]\nlr = nan\n"), "optimizer.lr = nan: out of range");
  EXPECT_HAS(error_of("[dataset]\nflip_p = 1.5\n"), "dataset.flip_p = 1.5: out of range: expected a number in [0, 1]");
  EXPECT_HAS(error_of("[lora]\nrank = 0\n"), "lora.rank = 0: out of range: expected an integer in [1, 4096]");
  EXPECT_HAS(error_of("[lora]\ndropout = 1.0\n"), "lora.dropout = 1.0: out of range: expected a number in [0, 1)");
  EXPECT_HAS(error_of("[optimizer]\nbetas = [0.9, 1.0]\n"), "optimizer.betas[1] = 1.0: out of range: expected a list of numbers in [0, 1)");
  EXPECT_HAS(error_of("[dataset]\nfolder_repeats = [-1]\n"), "dataset.folder_repeats[0] = -1: out of range: expected a list of integers >= 0");
  EXPECT_HAS(error_of("[model]\nfamily = \"flix\"\n"),
             "model.family = \"flix\": not accepted: expected one of \"flux\", \"sd3\", \"sdxl\" (did you mean \"flux\"?)");
  EXPECT_HAS(error_of("[train]\nmethod = \"qlora\"\n"), "train.method = \"qlora\": not accepted: expected one of \"lora\", \"lokr\", \"dora\", \"full\"");
}

TEST(TrainConfigErrors, EveryProblemOfAFileTogether) {
  const std::string e = error_of("[train]\nstpes = 1\nbatch_size = 0\n[model]\nfamily = \"x\"\n");
  EXPECT_HAS(e, "run.toml: 3 problems:");
  EXPECT_HAS(e, "\n  unknown key \"train.stpes\"");
  EXPECT_HAS(e, "\n  train.batch_size = 0: out of range");
  EXPECT_HAS(e, "\n  model.family = \"x\": not accepted");
}

TEST(TrainConfigErrors, SyntaxErrorsMissingFilesAndCrossKeyChecks) {
  EXPECT_HAS(error_of("[train]\nsteps = [\n"), "run.toml:");
  EXPECT_HAS(error_of("[train]\nsteps = [\n"), "not valid TOML");
  EXPECT_HAS(error_of("[train]\nsteps = 1\nsteps = 2\n"), "not valid TOML");  // a key twice
  try {
    fd::load_finetune_config("/nonexistent/run.toml");
    FAIL();
  } catch (const fd::ConfigError& e) {
    EXPECT_HAS(e.what(), "/nonexistent/run.toml: cannot open");
  }
  EXPECT_HAS(error_of("[dataset]\nresolution = 1000\n"),
             "dataset.resolution = 1000 is not a multiple of dataset.bucket_step = 64");
  EXPECT_HAS(error_of("[dataset]\nresolution = 4096\n"), "need bucket_step <= bucket_min_size <= resolution <= bucket_max_size");
  EXPECT_HAS(error_of("[dataset]\nfolders = [\"a\", \"b\"]\nfolder_repeats = [3]\n"),
             "dataset.folder_repeats has 1 entries for 2 dataset.folders");
  EXPECT_HAS(error_of("[optimizer]\nbetas = [0.9, 0.99, 0.5]\n"), "optimizer.betas = [0.9, 0.99, 0.5]: expected two numbers");
  EXPECT_HAS(error_of("[sample]\nwidth = 1000\n"), "sample.width = 1000: must be a multiple of 16");
  // The checks between keys run after the overrides, so an override can repair a file.
  EXPECT_EQ(error_of("[dataset]\nresolution = 1000\n", {"dataset.resolution=960"}), "");
}

TEST(TrainConfigOverrides, TypedParsingAndOrder) {
  const fd::FinetuneConfig c = fd::parse_finetune_config(
      "[train]\nsteps = 100\n[dataset]\nfolders = [\"/x\"]\n", "run.toml",
      {"train.steps=5", "train.steps = 7", "optimizer.lr=2e-4", "dataset.flip_p=1", "dataset.shuffle_tags=true",
       "model.family=sdxl", "model.checkpoint=\"/m/quoted path.safetensors\"", "model.vae=/m/vae with spaces",
       "sample.prompts=a cat, on a mat", "lora.targets=[\"to_q\", \"to_v\"]", "dataset.folder_repeats=3",
       "optimizer.betas=[0.8, 0.95]", "dataset.caption_prefix=sks ", "output.dir="});
  EXPECT_EQ(c.train.steps, 7);  // later overrides win
  EXPECT_EQ(c.optimizer.lr, 2e-4);
  EXPECT_EQ(c.dataset.flip_p, 1.0);
  EXPECT_TRUE(c.dataset.shuffle_tags);
  EXPECT_EQ(c.model.family, "sdxl");
  EXPECT_EQ(c.model.checkpoint, "/m/quoted path.safetensors");
  EXPECT_EQ(c.model.vae, "/m/vae with spaces");
  EXPECT_EQ(c.sample.prompts, (std::vector<std::string>{"a cat, on a mat"}));  // a bare value: one element
  EXPECT_EQ(c.lora.targets, (std::vector<std::string>{"to_q", "to_v"}));
  EXPECT_EQ(c.dataset.folder_repeats, (std::vector<int64_t>{3}));
  EXPECT_EQ(c.dataset.folders, (std::vector<std::string>{"/x"}));  // from the file
  EXPECT_EQ(c.optimizer.betas, (std::vector<double>{0.8, 0.95}));
  EXPECT_EQ(c.dataset.caption_prefix, "sks");  // surrounding blanks are trimmed; quote to keep them
  EXPECT_EQ(c.output.dir, "");
  fd::FinetuneConfig q;
  fd::apply_config_override(q, "dataset.caption_prefix=\"sks \"");
  EXPECT_EQ(q.dataset.caption_prefix, "sks ");
}

TEST(TrainConfigOverrides, ErrorsNameTheAssignment) {
  auto err = [](const std::string& assignment) {
    fd::FinetuneConfig c;
    try {
      fd::apply_config_override(c, assignment);
    } catch (const fd::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_HAS(err("train.steps"), "--set train.steps: expected key=value (e.g. --set train.steps=2000)");
  EXPECT_HAS(err("train.stps=3"), "--set train.stps=3: unknown key \"train.stps\" (did you mean \"train.steps\"?)");
  EXPECT_HAS(err("train.steps=abc"), "--set train.steps=abc: train.steps = abc: not a value (expected an integer in [1, 1e+09]");
  EXPECT_HAS(err("train.steps=1.5"), "train.steps = 1.5: expected an integer in [1, 1e+09], got a float");
  EXPECT_HAS(err("train.steps=0"), "train.steps = 0: out of range");
  EXPECT_HAS(err("model.family=flix"), "model.family = \"flix\": not accepted: expected one of \"flux\", \"sd3\", \"sdxl\" (did you mean \"flux\"?)");
  EXPECT_HAS(err("dataset.flip_p=2"), "dataset.flip_p = 2: out of range: expected a number in [0, 1]");
  EXPECT_HAS(err("dataset.shuffle_tags=yes"), "dataset.shuffle_tags = yes: not a value (expected true or false");
  EXPECT_HAS(err("dataset.recursive=1"), "dataset.recursive = 1: expected true or false, got an integer");
  EXPECT_HAS(err("optimizer.betas=[0.9, 2]"), "optimizer.betas[1] = 2: out of range");
  EXPECT_HAS(err("dataset.folders=[1]"), "dataset.folders[0] = 1: expected a string, got an integer");
  EXPECT_HAS(err("=3"), "unknown key \"\"");
  // load_finetune_config without a file applies the overrides to the defaults and checks them.
  EXPECT_EQ(fd::load_finetune_config("", {"lora.rank=4"}).lora.rank, 4);
  EXPECT_THROW(fd::load_finetune_config("", {"dataset.resolution=100"}), fd::ConfigError);
}
