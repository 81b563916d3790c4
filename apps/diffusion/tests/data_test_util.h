#pragma once
// Helpers of the Data* test suites: the device under test (FLAME_TEST_DEVICE=cuda, as FLAME's own
// tests), scratch folders, and random synthetic data sets.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <flame/flame.h>

#include "data.h"

namespace fd_test {

inline flame::Device test_device() {
  const char* e = std::getenv("FLAME_TEST_DEVICE");
  return e != nullptr && std::string(e) == "cuda" ? flame::Device::cuda(0) : flame::Device::cpu();
}

#define FD_SKIP_IF_NO_DEVICE()                                                                   \
  do {                                                                                           \
    if (::fd_test::test_device().is_cuda() && !::flame::cuda_is_available())                     \
      GTEST_SKIP() << "FLAME_TEST_DEVICE=cuda but no CUDA device is available";                  \
  } while (0)

// A fresh folder per test (tests run in parallel and shuffled), removed at the end.
class ScratchDir {
 public:
  ScratchDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            ("fd_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// n random images (rows x cols, every byte value likely) with random labels 0..9.
inline flame_diffusion::Dataset random_dataset(int64_t n, int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  flame_diffusion::Dataset d;
  d.n = n;
  d.rows = rows;
  d.cols = cols;
  d.images.resize(static_cast<std::size_t>(n * rows * cols));
  for (auto& b : d.images) b = static_cast<uint8_t>(rng());
  d.labels.resize(static_cast<std::size_t>(n));
  for (auto& l : d.labels) l = static_cast<uint8_t>(rng() % 10);
  return d;
}

}  // namespace fd_test
