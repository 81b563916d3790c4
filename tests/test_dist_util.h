#pragma once
// Helpers of the flame::dist tests (test_dist.cpp, test_dist_workers.cpp): starting ranks as
// processes of this binary, the launcher, environment and temporary directories.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "flame/dist.h"
#include "flame/flame.h"
#include "flame/nn.h"

namespace flame::test::dist_test {

// The backend the multi-process cases use: "nccl" when FLAME_TEST_DEVICE=cuda, else "tcp".
bool using_nccl();
// How many ranks the cases may start: 4 on tcp, the number of GPUs on nccl.
int max_ranks();
int free_port();

#define DIST_SKIP_UNLESS_RANKS(n)                                                                        \
  do {                                                                                                   \
    if (::flame::test::dist_test::max_ranks() < (n))                                                     \
      GTEST_SKIP() << "needs " << (n) << " ranks; the nccl backend has one GPU per rank and only "        \
                   << ::flame::test::dist_test::max_ranks() << " GPU(s) are visible";                    \
  } while (0)

struct RanksResult {
  std::vector<int> status;          // waitpid statuses, by rank
  std::vector<std::string> output;  // stdout + stderr, by rank
  bool all_ok() const;
  std::string report() const;
};

// Starts `world` processes of this binary running worker `worker` (test_dist_workers.cpp) with
// RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set and waits for them (killing all after
// timeout_s). kill_after > 0: once that many have exited, the rest are killed.
RanksResult run_ranks(const std::string& worker, int world, const std::map<std::string, std::string>& env,
                      double timeout_s = 60, int kill_after = 0);

struct LauncherResult {
  int status = 0;
  std::string output;  // the launcher's and its ranks' stdout + stderr
};
// Runs flame-run with `args` and this binary as the program (worker `worker`).
LauncherResult run_launcher(const std::vector<std::string>& args, const std::string& worker,
                            const std::map<std::string, std::string>& env, double timeout_s,
                            double sigterm_after_s = -1);

// Saves and restores environment variables (unset inside the scope).
struct EnvGuard {
  explicit EnvGuard(std::vector<std::string> names);
  ~EnvGuard();
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
};

struct TempDir {
  TempDir();
  ~TempDir();
  std::string path;
};

}  // namespace flame::test::dist_test
