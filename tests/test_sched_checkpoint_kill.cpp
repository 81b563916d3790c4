// Crash safety of Checkpoint::save: a child process saves checkpoints of a large state in a loop
// and is SIGKILLed at random moments, many times; after every kill the checkpoint at the path must
// load (header, checksums) and hold exactly the values of the step it says, no older than the last
// save the child reported complete.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "flame/checkpoint.h"

namespace flame::test {
namespace {

constexpr int64_t kFloats = 1'500'000;  // 6 MB
constexpr int64_t kInts = 250'000;      // 2 MB

float float_at(int64_t step, int64_t k) {
  // Exact in f32 (< 2^24) and different at every element and step.
  return static_cast<float>((static_cast<uint64_t>(k) * 2654435761u + static_cast<uint64_t>(step) * 40503u) & 0xFFFFFu);
}
int64_t int_at(int64_t step, int64_t k) { return step * 1'000'003 + k * 7; }

// A large state whose every value is a function of the step it was filled for.
struct Blob : Stateful {
  Tensor f = Tensor::zeros({kFloats}, DType::f32);
  Tensor i = Tensor::zeros({kInts}, DType::i64);
  void fill(int64_t step) {
    float* pf = f.data<float>();
    for (int64_t k = 0; k < kFloats; ++k) pf[k] = float_at(step, k);
    int64_t* pi = i.data<int64_t>();
    for (int64_t k = 0; k < kInts; ++k) pi[k] = int_at(step, k);
  }
  // First wrong element, or -1.
  int64_t first_mismatch(int64_t step) const {
    const float* pf = f.data<float>();
    for (int64_t k = 0; k < kFloats; ++k) {
      if (pf[k] != float_at(step, k)) return k;
    }
    const int64_t* pi = i.data<int64_t>();
    for (int64_t k = 0; k < kInts; ++k) {
      if (pi[k] != int_at(step, k)) return kFloats + k;
    }
    return -1;
  }
  StateDict state_dict() const override { return StateDict{{"f", f}, {"i", i}}; }
  void load_state_dict(const StateDict& sd) override {
    const Tensor& nf = sd.at("f");
    const Tensor& ni = sd.at("i");
    FLAME_CHECK(nf.sizes() == f.sizes() && nf.dtype() == f.dtype() && ni.sizes() == i.sizes() && ni.dtype() == i.dtype(),
                "Blob::load_state_dict", "shape or dtype mismatch");
    f.copy_(nf);
    i.copy_(ni);
  }
};

struct Saver {
  Blob blob;
  Generator gen;
  Checkpoint ckpt;
  Saver() { ckpt.add("blob", blob).add_generator("g", gen); }
};

// The child: resumes from the checkpoint at `path` (if any), reports that it is ready, then saves
// step after step, reporting each step once its save returned. Uses only the CPU. With `rotate`,
// `path` is a directory: it resumes from latest_checkpoint() and saves with save_rotating().
[[noreturn]] void child_main(const std::string& path, bool rotate, int fd) {
  int64_t step = 0;
  try {
    Saver s;
    const std::optional<std::string> last =
        rotate ? latest_checkpoint(path)
               : (std::filesystem::exists(path) ? std::optional<std::string>(path) : std::nullopt);
    if (last) {
      s.ckpt.load(*last);
      step = s.ckpt.progress().step;
    }
    const int64_t ready = -1;
    if (::write(fd, &ready, sizeof ready) != sizeof ready) ::_exit(5);
    for (;;) {
      ++step;
      s.blob.fill(step);
      s.gen.set_state({static_cast<uint64_t>(step), static_cast<uint64_t>(step) * 3});
      s.ckpt.progress().step = step;
      if (rotate) {
        s.ckpt.save_rotating(path, 2);
      } else {
        s.ckpt.save(path);
      }
      if (::write(fd, &step, sizeof step) != sizeof step) ::_exit(5);
    }
  } catch (...) {
    ::_exit(step == 0 ? 3 : 4);
  }
}

bool has_temporary(const std::string& dir) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().filename().string().find(".flame-tmp.") != std::string::npos) return true;
  }
  return false;
}

// Runs `iters` kill/resume rounds; see the file comment.
void kill_rounds(bool rotate, int iters) {
  std::string tmpl = ::testing::TempDir() + "flame_ckpt_kill_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
  const std::string dir = tmpl;
  const std::string target = rotate ? dir + "/runs" : dir + "/ckpt.safetensors";

  // How long one save takes here: the kills are spread over a few saves.
  double save_ms = 0;
  {
    Saver s;
    s.blob.fill(1);
    const auto t0 = std::chrono::steady_clock::now();
    s.ckpt.save(dir + "/timing.safetensors");
    save_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::filesystem::remove(dir + "/timing.safetensors");
  }
  const unsigned seed = static_cast<unsigned>(std::random_device{}());
  std::mt19937 rng(seed);
  // Kill delays are uniform in [0, spread * save_ms). A loaded machine (ctest runs the shards in
  // parallel) makes a child's saves slower than the timing above, so the spread adapts: a child
  // that completed no save widens it, one killed outside a save after completing some narrows it,
  // which keeps both kinds of kill coming whatever the load.
  double spread = 3.0;
  const int kIters = iters;
  int64_t known = 0;  // newest step a child reported as saved
  int prev_kept = 0;  // rotating: the checkpoint files the previous iteration found
  int killed_mid_save = 0;
  for (int it = 0; it < kIters; ++it) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      child_main(target, rotate, fds[1]);
    }
    ::close(fds[1]);
    int64_t msg = 0;
    const bool ready = ::read(fds[0], &msg, sizeof msg) == sizeof msg && msg == -1;
    if (ready) {
      std::uniform_real_distribution<double> delay_ms(0.0, spread * save_ms);
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(delay_ms(rng)));
      ::kill(pid, SIGKILL);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    int64_t reported = known;
    while (::read(fds[0], &msg, sizeof msg) == sizeof msg) reported = std::max(reported, msg);
    ::close(fds[0]);
    ASSERT_TRUE(ready) << "iteration " << it << ": the child did not start (exit status " << status
                       << "; 3 = it could not load the previous checkpoint)";
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "iteration " << it << ": the child ended by itself (status " << status << ")";
    const std::string files = rotate ? target : dir;
    const bool mid_save = std::filesystem::exists(files) && has_temporary(files);
    if (mid_save) ++killed_mid_save;
    if (reported <= known) {
      spread = std::min(spread * 2.0, 200.0);  // no save completed in this child's life
    } else if (!mid_save) {
      spread = std::max(spread * 0.75, 1.0);
    }
    const std::optional<std::string> latest =
        rotate ? latest_checkpoint(target)
               : (std::filesystem::exists(target) ? std::optional<std::string>(target) : std::nullopt);
    if (reported == 0 && !latest) continue;  // killed before any save finished
    ASSERT_TRUE(latest.has_value()) << "iteration " << it << ": no checkpoint after step " << reported << " was saved";
    const std::string path = *latest;

    // The file at the path loads and verifies (checksums), and holds a complete state.
    Saver check;
    CheckpointInfo info;
    try {
      info = check.ckpt.load(path);
    } catch (const Error& e) {
      FAIL() << "iteration " << it << " (seed " << seed << "): the checkpoint does not load after SIGKILL: "
             << e.what();
    }
    const int64_t step = check.ckpt.progress().step;
    ASSERT_EQ(info.step, step);
    // Never older than the last save that returned; at most one newer (renamed, not yet reported).
    ASSERT_GE(step, reported) << "iteration " << it;
    ASSERT_LE(step, reported + 1) << "iteration " << it;
    ASSERT_EQ(check.blob.first_mismatch(step), -1) << "iteration " << it << ": values of another step";
    ASSERT_EQ(check.gen.seed(), static_cast<uint64_t>(step));
    ASSERT_EQ(check.gen.offset(), static_cast<uint64_t>(step) * 3);
    known = step;
    if (rotate) {
      ASSERT_EQ(path, checkpoint_path(target, step));
      int kept = 0;
      for (const auto& e : std::filesystem::directory_iterator(target)) {
        kept += e.path().filename().string().rfind("ckpt-", 0) == 0;
      }
      // Rotation keeps 2, plus the new one when a child dies between its rename and the deletion;
      // a next child that also dies there leaves one more, so the bound follows the last count
      // (a rotation that never deleted would grow by every save of a child's life).
      ASSERT_LE(kept, std::max(3, prev_kept + 1))
          << "rotation keeps 2 (one more per child killed between a save and the deletion)";
      prev_kept = kept;
    }
    remove_stale_temporaries(files);
    ASSERT_FALSE(has_temporary(files)) << "a dead child's temporary was not removed";
  }
  std::printf("[ kill test%s ] %d kills, %d during a save's write (temporary left), last step %lld, save %.1f ms, "
              "final delay spread %.3g x save, seed %u\n",
              rotate ? " (rotating)" : "", kIters, killed_mid_save, static_cast<long long>(known), save_ms, spread,
              seed);
  EXPECT_GT(known, 0) << "no save ever completed: the delays are too short to test anything";
  EXPECT_GE(killed_mid_save, kIters / 6) << "too few kills landed inside a save to test its atomicity";
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

TEST(CheckpointTestKill, PreviousCheckpointSurvivesSigkillAtRandomMoments) { kill_rounds(false, 36); }

// The same with save_rotating: latest_checkpoint() always finds a complete checkpoint, and the
// rotation never deletes the newest.
TEST(CheckpointTestKill, RotatingSavesSurviveSigkill) { kill_rounds(true, 12); }

}  // namespace
}  // namespace flame::test
