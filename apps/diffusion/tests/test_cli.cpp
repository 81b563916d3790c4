// The flame-diffusion program itself, run as a user runs it (issue #26, item 5): range checks and
// suggestions on the command line, run directories (refusal, --overwrite, --resume over damaged
// checkpoints, loss.csv cut back), SIGINT / SIGTERM, finetune checkpoints in `export` and `sample`,
// foreign files given as checkpoints, output checks before sampling, JPEG output, stdout for results
// and stderr for progress, and the CPU recipe without --model. Suites Cli*; every run is the tiny
// preset on a synthetic 80-image data set for a few steps (a second or two each), on the CPU.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <flame/checkpoint.h>
#include <flame/flame.h>
#include <flame/io/safetensors.h>

#include "data_test_util.h"

#ifndef FLAME_DIFFUSION_BIN
#define FLAME_DIFFUSION_BIN "flame-diffusion"
#endif

extern char** environ;

namespace {

namespace fs = std::filesystem;
using fd_test::ScratchDir;

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

// A running flame-diffusion with stdout and stderr going to files.
struct Proc {
  pid_t pid = -1;
  std::string out_path, err_path;
};

Proc spawn(const std::vector<std::string>& args, const std::string& io_prefix) {
  Proc p;
  p.out_path = io_prefix + ".out";
  p.err_path = io_prefix + ".err";
  std::vector<std::string> full = {FLAME_DIFFUSION_BIN};
  full.insert(full.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : full) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, p.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, p.err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const int rc = posix_spawn(&p.pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) p.pid = -1;
  return p;
}

struct Result {
  int status = -1;  // exit status, or -1 when killed by a signal
  int signal = 0;   // the signal that killed it
  std::string out, err;
};

Result wait_for(const Proc& p, double timeout_s = 120) {
  Result r;
  int st = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (true) {
    const pid_t w = ::waitpid(p.pid, &st, WNOHANG);
    if (w == p.pid) break;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_s) {
      ::kill(p.pid, SIGKILL);
      ::waitpid(p.pid, &st, 0);
      ADD_FAILURE() << "flame-diffusion did not finish in " << timeout_s << " s";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (WIFEXITED(st)) r.status = WEXITSTATUS(st);
  if (WIFSIGNALED(st)) r.signal = WTERMSIG(st);
  r.out = slurp(p.out_path);
  r.err = slurp(p.err_path);
  return r;
}

Result run(const ScratchDir& dir, const std::vector<std::string>& args) {
  static int counter = 0;
  const Proc p = spawn(args, dir.file("run" + std::to_string(counter++)));
  EXPECT_GT(p.pid, 0) << "cannot start " << FLAME_DIFFUSION_BIN;
  if (p.pid <= 0) return {};
  return wait_for(p);
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

#define EXPECT_HAS(text, part) EXPECT_TRUE(has(text, part)) << "expected \"" << (part) << "\" in:\n" << (text)
#define ASSERT_HAS(text, part) ASSERT_TRUE(has(text, part)) << "expected \"" << (part) << "\" in:\n" << (text)
#define EXPECT_HAS_NOT(text, part) EXPECT_FALSE(has(text, part)) << "unexpected \"" << (part) << "\" in:\n" << (text)

// An IDX file: magic (0, 0, 8 = unsigned bytes, ndim), big-endian dimensions, the bytes.
void write_idx(const std::string& path, const std::vector<uint32_t>& dims, const std::vector<uint8_t>& bytes) {
  std::string s = {0, 0, 8, static_cast<char>(dims.size())};
  for (uint32_t d : dims) {
    for (int k = 3; k >= 0; --k) s += static_cast<char>((d >> (8 * k)) & 0xff);
  }
  s.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  std::ofstream(path, std::ios::binary) << s;
}

// A synthetic Fashion-MNIST folder: 80 random 28x28 images, labels i % 10 (8 of each class).
std::string write_data(const ScratchDir& dir) {
  const std::string folder = dir.file("data");
  fs::create_directories(folder);
  constexpr uint32_t n = 80;
  std::mt19937 rng(7);
  std::vector<uint8_t> images(n * 28 * 28), labels(n);
  for (auto& b : images) b = static_cast<uint8_t>(rng());
  for (uint32_t i = 0; i < n; ++i) labels[i] = static_cast<uint8_t>(i % 10);
  for (const char* split : {"train", "t10k"}) {
    write_idx(folder + "/" + split + "-images-idx3-ubyte", {n, 28, 28}, images);
    write_idx(folder + "/" + split + "-labels-idx1-ubyte", {n}, labels);
  }
  return folder;
}

// The flags of a tiny CPU run (more flags after them override nothing: pass each once).
std::vector<std::string> tiny(const std::string& command, const std::string& data, const std::string& out,
                              std::vector<std::string> more) {
  std::vector<std::string> a = {command, "--data", data, "--device", "cpu", "--batch", "4", "--samples-per-class", "1",
                                "--sample-steps", "2", "--no-progress", "--out", out};
  if (command == "train") {
    a.push_back("--model");
    a.push_back("dit-tiny");
  }
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

std::vector<int64_t> csv_steps(const std::string& path) {
  std::vector<int64_t> steps;
  std::istringstream in(slurp(path));
  std::string line;
  std::getline(in, line);
  while (std::getline(in, line))
    if (!line.empty()) steps.push_back(std::stoll(line.substr(0, line.find(','))));
  return steps;
}

std::vector<int64_t> one_to(int64_t n) {
  std::vector<int64_t> v;
  for (int64_t i = 1; i <= n; ++i) v.push_back(i);
  return v;
}

std::string ckpt(const std::string& out, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof name, "checkpoints/ckpt-%010lld.safetensors", static_cast<long long>(step));
  return (fs::path(out) / name).string();
}

std::vector<std::string> listing(const std::string& folder) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(folder)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

// ---- the command line ----

TEST(CliArgs, OutOfRangeValuesAreRefusedWithTheirOwnMessages) {
  ScratchDir dir;
  const std::string some_file = dir.file("base.safetensors");
  std::ofstream(some_file) << "x";
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"train", "--steps", "0"}, "--steps must be a positive integer (got 0)"},
      {{"train", "--steps", "99999999999999999999"},
       "--steps must be a positive integer (got 99999999999999999999, which is outside the 64-bit integer range"},
      {{"train", "--steps", "1e3"}, "--steps must be a positive integer (got 1e3, which is not a whole number"},
      {{"train", "--warmup", "-3"}, "--warmup must be a non-negative integer (0: no warmup) (got -3)"},
      {{"train", "--grad-clip", "-1"}, "--grad-clip must be a non-negative number (0: no clipping) (got -1)"},
      {{"train", "--cfg", "-5"}, "--cfg must be a number from 0 to 100"},
      {{"train", "--ckpt-every", "-1"}, "--ckpt-every must be a non-negative integer (0: at the end only) (got -1)"},
      {{"train", "--log-every", "0"}, "--log-every must be a positive integer (got 0)"},
      {{"train", "--time-limit", "-1"}, "--time-limit must be a non-negative number of seconds (0: no limit) (got -1)"},
      {{"train", "--keep", "0"}, "--keep must be a positive integer (at most 2147483647) (got 0)"},
      {{"train", "--keep", "4294967296"}, "--keep must be a positive integer (at most 2147483647) (got 4294967296)"},
      {{"train", "--samples-per-class", "0"}, "--samples-per-class must be an integer from 1 to 100 (got 0)"},
      {{"train", "--lr", "nan"}, "--lr must be a positive number (at most 10) (got nan, which is not a finite number)"},
      {{"train", "--seed", "-1"}, "--seed must be a non-negative integer (got -1)"},
      {{"train", "--ema", "1"}, "--ema must be a number from 0 up to, not including, 1 (got 1)"},
      {{"finetune", "--base", some_file, "--lora-alpha", "-4"}, "--lora-alpha must be a positive number (at most 1e6) (got -4)"},
      {{"finetune", "--base", some_file, "--lora-rank", "0"}, "--lora-rank must be a positive integer (got 0)"},
      {{"sample", "--checkpoint", some_file, "--n", "0"}, "--n must be an integer from 1 to 100 (got 0)"},
      {{"sample", "--checkpoint", some_file, "--scale", "9"}, "--scale must be an integer from 1 to 8 (got 9)"},
      {{"sample", "--checkpoint", some_file, "--sample-steps", "0"}, "--sample-steps must be an integer from 1 to 1000"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args[0] + " " + c.args[c.args.size() - 2] + " " + c.args.back());
    const Result r = run(dir, c.args);
    EXPECT_EQ(r.status, 2);
    EXPECT_HAS(r.err, c.message);
    EXPECT_HAS_NOT(r.err, "not in range");  // CLI11's message
    EXPECT_HAS_NOT(r.err, "179769313486231570");
  }
}

TEST(CliArgs, TyposGetTheNearestSubcommandOrFlag) {
  ScratchDir dir;
  Result r = run(dir, {"trian", "--steps", "3"});
  EXPECT_EQ(r.status, 2);
  EXPECT_HAS(r.err, "unknown subcommand 'trian'; did you mean 'train'?");
  EXPECT_HAS_NOT(r.err, "A subcommand is required");
  r = run(dir, {"sampel"});
  EXPECT_HAS(r.err, "did you mean 'sample'?");
  r = run(dir, {"xyzzy"});
  EXPECT_EQ(r.status, 2);
  EXPECT_HAS(r.err, "unknown subcommand 'xyzzy' (commands: train, finetune, sample, export, generate)");
  r = run(dir, {"train", "--stpes", "3"});
  EXPECT_EQ(r.status, 2);
  EXPECT_HAS(r.err, "unknown flag --stpes for train; did you mean --steps?");
  r = run(dir, {"train", "--sample-step=4"});
  EXPECT_HAS(r.err, "unknown flag --sample-step for train; did you mean --sample-steps?");
  r = run(dir, {"train", "--overwrite", "--resume"});
  EXPECT_EQ(r.status, 2);
}

// ---- runs ----

// One run checked for its outputs: a CSV row per step even with a rare --log-every, results on
// stdout and progress on stderr. Then the run directory: a second run is refused, --overwrite
// removes the old run's files (and nothing else) before training.
TEST(CliTrain, OutputsAndRunDirectory) {
  ScratchDir dir;
  const std::string data = write_data(dir), out = dir.file("run");
  Result r = run(dir, tiny("train", data, out, {"--steps", "3", "--log-every", "1000", "--ckpt-every", "1", "--keep", "5"}));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(csv_steps(out + "/loss.csv"), one_to(3));  // every step, though no log line fell due
  EXPECT_TRUE(fs::exists(out + "/loss.png"));
  // Results on stdout, progress and logs on stderr.
  EXPECT_HAS(r.out, "train done: 3 steps");
  EXPECT_HAS(r.out, "checkpoint: " + fs::absolute(ckpt(out, 3)).string());
  EXPECT_HAS(r.out, "samples:    " + fs::absolute(out + "/samples.png").string());
  EXPECT_HAS_NOT(r.out, "final samples");
  EXPECT_HAS(r.err, "final samples (10 images): 2 solver steps");
  EXPECT_HAS(r.err, "train: dit-tiny");
  EXPECT_HAS_NOT(r.err, "train done");

  std::ofstream(out + "/notes.txt") << "mine";
  std::ofstream(out + "/checkpoints/README") << "mine too";
  r = run(dir, tiny("train", data, out, {"--steps", "2"}));
  EXPECT_EQ(r.status, 2);
  EXPECT_HAS(r.err, out + " already holds a run (checkpoints/ckpt-0000000001.safetensors");
  EXPECT_HAS(r.err, "loss.csv");
  EXPECT_HAS(r.err, "pass --resume to continue it, --overwrite to remove it");
  EXPECT_EQ(csv_steps(out + "/loss.csv"), one_to(3));  // untouched

  r = run(dir, tiny("train", data, out, {"--steps", "2", "--overwrite"}));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_HAS(r.err, "--overwrite: removed 6 files of the previous run");
  EXPECT_EQ(csv_steps(out + "/loss.csv"), one_to(2));
  // Without --overwrite's removal, ckpt-3 of the old run would be the newest and a --resume would
  // continue the old run.
  EXPECT_EQ(listing(out + "/checkpoints"), (std::vector<std::string>{"README", "ckpt-0000000002.safetensors"}));
  EXPECT_EQ(slurp(out + "/notes.txt"), "mine");
}

TEST(CliResume, SkipsDamagedCheckpointsNamingThemAndCutsTheLog) {
  ScratchDir dir;
  const std::string data = write_data(dir), out = dir.file("run");
  Result r = run(dir, tiny("train", data, out, {"--steps", "3", "--ckpt-every", "1"}));
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_EQ(csv_steps(out + "/loss.csv"), one_to(3));

  // Another preset: one line that says so, before any key list.
  r = run(dir, {"train", "--data", data, "--device", "cpu", "--model", "unet-tiny", "--batch", "4", "--out", out, "--resume"});
  EXPECT_EQ(r.status, 2);
  EXPECT_HAS(r.err, ckpt(out, 3) + " holds dit-tiny; the run is unet-tiny (--model): resume it with --model dit-tiny");
  EXPECT_HAS_NOT(r.err, "unexpected");

  // The newest checkpoint damaged in its data (the header reads, the checksum does not match).
  {
    std::string bytes = slurp(ckpt(out, 3));
    bytes[bytes.size() - 5] = static_cast<char>(bytes[bytes.size() - 5] ^ 0x5a);
    std::ofstream(ckpt(out, 3), std::ios::binary | std::ios::trunc) << bytes;
  }
  r = run(dir, tiny("train", data, out, {"--steps", "4", "--resume"}));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_HAS(r.err, "--resume: skipped " + ckpt(out, 3) + ": ");
  EXPECT_HAS(r.err, "resumed from " + ckpt(out, 2) + " (step 2)");
  EXPECT_HAS(r.err, "--resume: removed 1 rows after step 2");
  EXPECT_EQ(csv_steps(out + "/loss.csv"), one_to(4));  // row 3 of the first run cut, then 3 and 4 again

  // Every checkpoint unreadable: the run stops, naming each, and starts nothing.
  for (const auto& e : fs::directory_iterator(out + "/checkpoints")) fs::resize_file(e.path(), 100);
  r = run(dir, tiny("train", data, out, {"--steps", "5", "--resume"}));
  EXPECT_EQ(r.status, 1);
  EXPECT_HAS(r.err, "--resume: none of the 3 checkpoints in " + out + "/checkpoints loads:");
  for (int s : {2, 3, 4}) EXPECT_HAS(r.err, "\n  " + fs::path(ckpt(out, s)).filename().string() + ": ");
  EXPECT_HAS_NOT(r.err, "starting from step 0");
  EXPECT_EQ(csv_steps(out + "/loss.csv"), one_to(4));
}

// A first SIGINT (or SIGTERM) finishes the step, saves a checkpoint, says where, and exits with
// 128 + the signal; the checkpoint loads and --resume continues from it.
TEST(CliSignal, SigintSavesACheckpointAndResumeContinues) {
  ScratchDir dir;
  const std::string data = write_data(dir), out = dir.file("run");
  const Proc p = spawn(tiny("train", data, out, {"--steps", "100000", "--log-every", "1"}), dir.file("sigint"));
  ASSERT_GT(p.pid, 0);
  const auto t0 = std::chrono::steady_clock::now();
  while (!has(slurp(p.err_path), "] 1/100000") &&
         std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 60)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(::kill(p.pid, SIGINT), 0);
  const Result r = wait_for(p);
  ASSERT_EQ(r.status, 130) << r.err;
  const std::string key = "SIGINT at step ";
  ASSERT_HAS(r.err, key);
  const int64_t step = std::stoll(r.err.substr(r.err.find(key) + key.size()));
  ASSERT_GE(step, 1);
  const std::string saved = fs::absolute(ckpt(out, step)).string();
  EXPECT_HAS(r.err, "SIGINT at step " + std::to_string(step) + " of 100000: saved checkpoint " + saved);
  EXPECT_HAS(r.out, "checkpoint: " + saved);
  EXPECT_EQ(flame::read_checkpoint_info(saved).step, step);
  EXPECT_EQ(csv_steps(out + "/loss.csv"), one_to(step));

  const Result resumed = run(dir, tiny("train", data, out, {"--steps", std::to_string(step + 2), "--resume"}));
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  EXPECT_HAS(resumed.err, "resumed from " + ckpt(out, step) + " (step " + std::to_string(step) + ")");
  EXPECT_EQ(csv_steps(out + "/loss.csv"), one_to(step + 2));
}

TEST(CliSignal, SigtermExitsWith143AfterSaving) {
  ScratchDir dir;
  const std::string data = write_data(dir), out = dir.file("run");
  const Proc p = spawn(tiny("train", data, out, {"--steps", "100000", "--log-every", "1"}), dir.file("sigterm"));
  ASSERT_GT(p.pid, 0);
  const auto t0 = std::chrono::steady_clock::now();
  while (!has(slurp(p.err_path), "] 1/100000") &&
         std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 60)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(::kill(p.pid, SIGTERM), 0);
  const Result r = wait_for(p);
  EXPECT_EQ(r.status, 143) << r.err;
  EXPECT_HAS(r.err, "SIGTERM at step ");
  EXPECT_HAS(r.err, ": saved checkpoint ");
}

// `export` and `sample` take a finetune checkpoint: the adapter is merged into the weights.
TEST(CliFinetune, ExportAndSampleMergeTheAdapter) {
  ScratchDir dir;
  const std::string data = write_data(dir), base = dir.file("base"), lora = dir.file("lora");
  Result r = run(dir, tiny("train", data, base, {"--steps", "2"}));
  ASSERT_EQ(r.status, 0) << r.err;
  r = run(dir, tiny("finetune", data, lora, {"--base", ckpt(base, 2), "--classes", "3", "--lora-rank", "100000", "--steps", "2"}));
  EXPECT_EQ(r.status, 2);
  EXPECT_HAS(r.err, "--lora-rank 100000 is larger than the adapted layers allow: dit-tiny's ");
  EXPECT_HAS(r.err, "has rank at most 96");
  r = run(dir, tiny("finetune", data, lora, {"--base", ckpt(base, 2), "--classes", "3", "--lora-rank", "2", "--steps", "2"}));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_HAS(r.out, "adapter:    " + fs::absolute(lora + "/lora.safetensors").string());
  const std::string tuned = ckpt(lora, 2);

  // Raw weights: each adapted weight is W + (alpha / rank) B A, checked in double; no adapter keys.
  const std::string exported = dir.file("merged.safetensors");
  r = run(dir, {"export", "--checkpoint", tuned, "--ema", "false", "--out", exported});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_HAS(r.out, "LoRA adapter merged");
  const flame::StateDict w = flame::io::load_safetensors(exported), c = flame::io::load_safetensors(tuned);
  int adapted = 0;
  double moved = 0;
  for (const auto& [name, t] : w.items()) {
    EXPECT_EQ(name.find("lora_"), std::string::npos) << name;
    ASSERT_TRUE(c.contains("model." + name)) << name;
    const std::string layer = name.substr(0, name.size() - std::string(".weight").size());
    const flame::Tensor* a = c.find("model." + layer + ".lora_A.weight");
    if (a == nullptr || name.size() < 7 || name.substr(name.size() - 7) != ".weight") {
      EXPECT_EQ(t.to_vec<float>(), c.at("model." + name).to_vec<float>()) << name;
      continue;
    }
    ++adapted;
    const flame::Tensor& b = c.at("model." + layer + ".lora_B.weight");
    const int64_t out_f = t.size(0), in_f = t.size(1), rank = a->size(0);
    ASSERT_EQ(rank, 2);
    const auto W = c.at("model." + name).to_vec<double>(), A = a->to_vec<double>(), B = b.to_vec<double>();
    const auto M = t.to_vec<double>();
    const double scale = 8.0 / 2.0;  // finetune's default alpha 8, rank 2
    for (int64_t o = 0; o < out_f; ++o) {
      for (int64_t i = 0; i < in_f; ++i) {
        double ba = 0;
        for (int64_t k = 0; k < rank; ++k) ba += B[o * rank + k] * A[k * in_f + i];
        const double want = W[o * in_f + i] + scale * ba;
        ASSERT_NEAR(M[o * in_f + i], want, 1e-5 + 1e-5 * std::abs(want)) << name << " [" << o << ", " << i << "]";
        moved = std::max(moved, std::abs(scale * ba));
      }
    }
  }
  EXPECT_EQ(adapted, 16);  // 4 blocks x attn.qkv, attn.proj, mlp.fc1, mlp.fc2
  EXPECT_GT(moved, 1e-5);  // the adapter trained, so the merge changed the weights

  r = run(dir, {"export", "--checkpoint", tuned, "--out", dir.file("ema.safetensors")});
  EXPECT_EQ(r.status, 0) << r.err;
  r = run(dir, {"sample", "--checkpoint", tuned, "--device", "cpu", "--classes", "3", "--n", "2", "--sample-steps", "2",
                "--out", dir.file("tuned.png")});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::exists(dir.file("tuned.png")));
  EXPECT_HAS(r.out, "wrote " + fs::absolute(dir.file("tuned.png")).string());
  r = run(dir, {"sample", "--checkpoint", tuned, "--lora", lora + "/lora.safetensors", "--device", "cpu", "--out",
                dir.file("twice.png")});
  EXPECT_EQ(r.status, 2);
  EXPECT_HAS(r.err, "is a finetune checkpoint, whose adapter is already applied");
}

// `sample --out` is checked before sampling; .jpg writes JPEG; a PNG given as a checkpoint is named.
TEST(CliSample, OutputChecksJpegAndForeignCheckpoints) {
  ScratchDir dir;
  const std::string data = write_data(dir), out = dir.file("run");
  Result r = run(dir, tiny("train", data, out, {"--steps", "1"}));
  ASSERT_EQ(r.status, 0) << r.err;
  const std::vector<std::string> s = {"sample", "--checkpoint", ckpt(out, 1), "--device", "cpu", "--n", "1", "--sample-steps", "2", "--out"};
  auto with = [&](const std::string& path) {
    std::vector<std::string> a = s;
    a.push_back(path);
    return a;
  };
  r = run(dir, with(dir.file("missing/grid.png")));
  EXPECT_EQ(r.status, 1);
  EXPECT_HAS(r.err, "--out " + dir.file("missing/grid.png") + ": the folder " + dir.file("missing") + " does not exist");
  EXPECT_HAS_NOT(r.err, "sampling");  // refused before any model call
  r = run(dir, {"export", "--checkpoint", ckpt(out, 1), "--out", dir.file("missing/w.safetensors")});
  EXPECT_EQ(r.status, 1);
  EXPECT_HAS(r.err, "the folder " + dir.file("missing") + " does not exist");
  r = run(dir, with(dir.file("grid.bmp")));
  EXPECT_EQ(r.status, 1);
  EXPECT_HAS(r.err, "unsupported image type '.bmp'; write .png, .jpg or .jpeg");

  r = run(dir, with(dir.file("grid.JPG")));
#ifdef FLAME_DIFFUSION_HAVE_JPEG
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string jpg = slurp(dir.file("grid.JPG"));
  ASSERT_GE(jpg.size(), 4u);
  EXPECT_EQ(jpg.substr(0, 3), std::string("\xff\xd8\xff"));            // JPEG start of image
  EXPECT_EQ(jpg.substr(jpg.size() - 2), std::string("\xff\xd9"));      // end of image
#else
  EXPECT_EQ(r.status, 1);  // a build without libjpeg refuses .jpg before sampling
  EXPECT_HAS(r.err, "this build writes no JPEG");
#endif

  for (const char* cmd : {"sample", "export"}) {
    r = run(dir, {cmd, "--checkpoint", out + "/samples.png", "--out", dir.file(std::string(cmd) + "_x.png")});
    EXPECT_EQ(r.status, 1) << cmd;
    EXPECT_HAS(r.err, out + "/samples.png' is not a safetensors file (starts with bytes 89 50 4E 47 0D 0A 1A 0A ...: a PNG image)");
    EXPECT_HAS_NOT(r.err, "header length");
  }
}

TEST(CliTrain, NoModelOnTheCpuTrainsTheCpuRecipe) {
  if (flame::cuda_is_available()) GTEST_SKIP() << "a GPU machine keeps dit-s as the default";
  ScratchDir dir;
  const std::string data = write_data(dir), out = dir.file("run");
  const Result r = run(dir, {"train", "--data", data, "--batch", "4", "--steps", "1", "--samples-per-class", "1",
                             "--sample-steps", "2", "--no-progress", "--out", out});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_HAS(r.err, "train: no --model on a machine without a GPU: the CPU recipe, unet-tiny at batch 4, lr 0.002 "
                    "(cosine), 1 steps or 510 s, 2 sampling steps at CFG 3");
  EXPECT_EQ(flame::read_checkpoint_info(ckpt(out, 1)).metadata.at("model"), "unet-tiny");
}

}  // namespace
