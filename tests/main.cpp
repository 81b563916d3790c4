// Note [Test device]: FLAME_TEST_DEVICE picks the device the suite runs on ("cpu", the default,
// or "cuda"). Asking for CUDA on a machine where no GPU is found is a failed run, not thousands
// of skipped cases that pass: main() exits non-zero before running anything. CUDA-only cases of
// a CPU run still skip, each with a message.
//
// Note [Per-case seeds]: every case starts with the default generator seeded from its own name,
// so a case draws the same numbers whatever ran before it (the shuffled run, a shard, a filter):
// no case depends on another's draws. FLAME_TEST_SEED=<n> mixes n into every case's seed, to
// run the suite under other draws and find a case whose assertions hold only for some.
//
// FLAME_TEST_SUMMARY_DIR=<dir> makes the process write <dir>/<pid>.txt when it ends: how many
// cases ran, passed, failed and skipped, and the names of the skipped ones. scripts/gpu_run.sh
// adds these up over the shards to check that the CUDA run ran every case it should have.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "test_util.h"

namespace {

class SummaryWriter : public ::testing::EmptyTestEventListener {
 public:
  explicit SummaryWriter(std::string dir) : dir_(std::move(dir)) {}

  void OnTestProgramEnd(const ::testing::UnitTest& unit) override {
    const std::string path = dir_ + "/" + std::to_string(static_cast<long>(::getpid())) + ".txt";
    std::ofstream out(path);
    const char* total = std::getenv("GTEST_TOTAL_SHARDS");
    const char* index = std::getenv("GTEST_SHARD_INDEX");
    out << "shard " << (index ? index : "-") << " of " << (total ? total : "-") << "\n";
    out << "ran " << unit.test_to_run_count() << "\n";
    out << "passed " << unit.successful_test_count() << "\n";
    out << "failed " << unit.failed_test_count() << "\n";
    out << "skipped " << unit.skipped_test_count() << "\n";
    for (int s = 0; s < unit.total_test_suite_count(); ++s) {
      const ::testing::TestSuite* suite = unit.GetTestSuite(s);
      for (int t = 0; t < suite->total_test_count(); ++t) {
        const ::testing::TestInfo* info = suite->GetTestInfo(t);
        if (info->should_run() && info->result()->Skipped()) {
          out << "skipped-case " << suite->name() << "." << info->name() << "\n";
        }
      }
    }
  }

 private:
  std::string dir_;
};

// Note [Per-case seeds].
class PerCaseSeed : public ::testing::EmptyTestEventListener {
 public:
  explicit PerCaseSeed(uint64_t mix) : mix_(mix) {}
  void OnTestStart(const ::testing::TestInfo& info) override {
    uint64_t h = 1469598103934665603ull;  // FNV-1a of "Suite.Case"
    for (const char* p : {info.test_suite_name(), ".", info.name()})
      for (; *p != '\0'; ++p) h = (h ^ static_cast<unsigned char>(*p)) * 1099511628211ull;
    flame::manual_seed(h ^ (mix_ * 0x9e3779b97f4a7c15ull));
  }

 private:
  uint64_t mix_;
};

bool listing_only() { return ::testing::GTEST_FLAG(list_tests); }

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const char* requested = std::getenv("FLAME_TEST_DEVICE");
  if (requested != nullptr && *requested != '\0' && std::string(requested) != "cpu" &&
      std::string(requested) != "cuda") {
    std::fprintf(stderr, "FLAME tests: FLAME_TEST_DEVICE='%s' is not a device (use cpu or cuda)\n", requested);
    return 2;
  }
  const flame::Device device = flame::test::test_device();
  if (device.is_cuda() && !listing_only() && !flame::cuda_is_available()) {
    std::fprintf(stderr,
                 "FLAME tests: FLAME_TEST_DEVICE=cuda but no CUDA device is available (%s); "
                 "refusing to run the suite with every CUDA case skipped\n",
#ifdef FLAME_TESTS_BUILT_WITH_CUDA
                 "no GPU found or the driver failed to start"
#else
                 "the library was built without CUDA: configure with -DFLAME_CUDA=ON"
#endif
    );
    return 1;
  }
  const char* seed = std::getenv("FLAME_TEST_SEED");
  const uint64_t mix = seed != nullptr && *seed != '\0' ? std::strtoull(seed, nullptr, 10) : 0;
  ::testing::UnitTest::GetInstance()->listeners().Append(new PerCaseSeed(mix));
  if (mix != 0) std::printf("FLAME tests: FLAME_TEST_SEED=%llu\n", static_cast<unsigned long long>(mix));
  if (const char* dir = std::getenv("FLAME_TEST_SUMMARY_DIR"); dir != nullptr && *dir != '\0') {
    ::testing::UnitTest::GetInstance()->listeners().Append(new SummaryWriter(dir));
  }
  std::printf("FLAME tests on %s\n", device.str().c_str());
  return RUN_ALL_TESTS();
}
