// Fashion-MNIST loading: label checks, the data-folder lookup and the real files (when
// dataset-fashion-mnist is installed). The IDX reader itself is flame::data's (tests/test_data_idx.cpp).
#include <cstdlib>
#include <random>

#include "data_test_util.h"
#include <flame/data/idx.h>

namespace fd = flame_diffusion;
namespace fdata = flame::data;
using fd_test::ScratchDir;
using fd_test::write_bytes;

namespace {

std::vector<uint8_t> random_bytes(std::size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

}  // namespace

TEST(DataIdx, ImageLabelMismatchAndBadLabelsAreRefused) {
  const std::vector<uint8_t> img = random_bytes(4 * 2 * 2, 3);
  auto images = [&] { return fdata::IdxArray{{4, 2, 2}, img}; };
  try {
    fd::Dataset::from_idx(images(), fdata::IdxArray{{3}, {1, 2, 3}}, "pair");
    ADD_FAILURE() << "a count mismatch was accepted";
  } catch (const fdata::IdxError& e) {
    EXPECT_NE(std::string(e.what()).find("4 images but 3 labels"), std::string::npos) << e.what();
  }
  try {
    fd::Dataset::from_idx(images(), fdata::IdxArray{{4}, {1, 2, 10, 3}}, "pair");
    ADD_FAILURE() << "label 10 was accepted";
  } catch (const fdata::IdxError& e) {
    EXPECT_NE(std::string(e.what()).find("label 10 at index 2"), std::string::npos) << e.what();
  }
  const fd::Dataset d = fd::Dataset::from_idx(images(), fdata::IdxArray{{4}, {1, 2, 9, 3}}, "pair");
  EXPECT_EQ(d.n, 4);
  EXPECT_EQ(d.rows, 2);
  EXPECT_EQ(d.images, img);
}

TEST(DataIdx, DataDirLookupHonoursFlagAndEnvironment) {
  ScratchDir dir;
  const std::string folder = dir.file("fm");
  std::filesystem::create_directories(folder);
  EXPECT_THROW(fd::find_data_dir(folder), std::runtime_error);  // named, but empty
  write_bytes(folder + "/train-images-idx3-ubyte.gz", fdata::gzip(fdata::encode_idx({1, 2, 2}, {1, 2, 3, 4})));
  EXPECT_EQ(fd::find_data_dir(folder), folder);
  ::setenv("FLAME_FASHION_MNIST", folder.c_str(), 1);
  EXPECT_EQ(fd::find_data_dir(), folder);
  ::setenv("FLAME_FASHION_MNIST", dir.file("nowhere").c_str(), 1);
  try {
    fd::find_data_dir();
    ADD_FAILURE() << "a variable naming a folder without the files was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("FLAME_FASHION_MNIST=" + dir.file("nowhere")), std::string::npos) << e.what();
  }
  ::unsetenv("FLAME_FASHION_MNIST");
}

// The Debian package's files: 60000 + 10000 images of 28 x 28, 6000 / 1000 per class.
TEST(DataIdx, RealFashionMnistFiles) {
  std::string dir;
  try {
    dir = fd::find_data_dir();
  } catch (const std::exception& e) {
    GTEST_SKIP() << "Fashion-MNIST not installed (scripts/setup_deps.sh installs dataset-fashion-mnist): " << e.what();
  }
  const fd::Dataset train = fd::Dataset::load(dir, fd::Split::train);
  const fd::Dataset test = fd::Dataset::load(dir, fd::Split::test);
  EXPECT_EQ(train.n, 60000);
  EXPECT_EQ(test.n, 10000);
  for (const fd::Dataset* d : {&train, &test}) {
    EXPECT_EQ(d->rows, 28);
    EXPECT_EQ(d->cols, 28);
    ASSERT_EQ(d->images.size(), static_cast<std::size_t>(d->n * 784));
    for (int64_t c : d->class_counts()) EXPECT_EQ(c, d->n / 10);
  }
  // The training set's first image is an ankle boot; the mean pixel is 0.286 * 255 (the
  // data set's published mean, 72.94).
  EXPECT_EQ(train.labels[0], 9);
  double sum = 0;
  for (uint8_t p : train.images) sum += p;
  EXPECT_NEAR(sum / static_cast<double>(train.images.size()), 72.94, 0.1);
  // Border pixels are mostly background, the centre mostly not: the rows are not scrambled.
  int64_t corner = 0, centre = 0;
  for (int64_t i = 0; i < train.n; ++i) {
    corner += train.images[i * 784] > 0;
    centre += train.images[i * 784 + 14 * 28 + 14] > 0;
  }
  EXPECT_LT(corner, train.n / 20);
  EXPECT_GT(centre, train.n / 2);

  // A plain (gunzipped) copy reads the same.
  ScratchDir scratch;
  std::ifstream in(dir + "/t10k-labels-idx1-ubyte.gz", std::ios::binary);
  ASSERT_TRUE(in.good()) << "expected gzip'd files in " << dir;
  std::vector<uint8_t> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  write_bytes(scratch.file("labels"), fdata::gunzip(raw.data(), raw.size(), "labels"));
  EXPECT_EQ(fdata::read_idx(scratch.file("labels"), 1).data, test.labels);
}
