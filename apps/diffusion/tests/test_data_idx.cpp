// IDX reader and Fashion-MNIST loading: the real files (when dataset-fashion-mnist is installed)
// and a table of corrupt files (Note [IDX validation] in idx.h).
#include <cstdlib>
#include <random>

#include "data_test_util.h"
#include "idx.h"

namespace fd = flame_diffusion;
using fd_test::ScratchDir;
using fd_test::write_bytes;

namespace {

std::vector<uint8_t> random_bytes(std::size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

void set_be32(std::vector<uint8_t>& f, std::size_t at, uint32_t v) {
  for (int k = 0; k < 4; ++k) f[at + k] = static_cast<uint8_t>(v >> (24 - 8 * k));
}

// Expects read_idx(path) to raise IdxError whose message names the file and contains `what`.
void expect_idx_error(const std::string& path, const std::string& what, int ndim = -1) {
  try {
    fd::read_idx(path, ndim);
    ADD_FAILURE() << path << ": accepted, expected an error containing '" << what << "'";
  } catch (const fd::IdxError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << "message does not name the file: " << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << "expected '" << what << "' in: " << msg;
  }
}

}  // namespace

TEST(DataIdx, RoundTripPlainAndGzipOfRandomArrays) {
  ScratchDir dir;
  std::mt19937_64 rng(11);
  for (int t = 0; t < 6; ++t) {
    std::vector<int64_t> dims;
    const int nd = 1 + t % 4;
    std::size_t numel = 1;
    for (int d = 0; d < nd; ++d) {
      dims.push_back(1 + static_cast<int64_t>(rng() % 9));
      numel *= static_cast<std::size_t>(dims.back());
    }
    const std::vector<uint8_t> data = random_bytes(numel, 100 + t);
    const std::vector<uint8_t> file = fd::encode_idx(dims, data);
    ASSERT_EQ(file.size(), 4 + 4 * dims.size() + numel);
    write_bytes(dir.file("a.idx"), file);
    write_bytes(dir.file("a.idx.gz"), fd::gzip(file));
    for (const char* name : {"a.idx", "a.idx.gz"}) {
      const fd::IdxArray a = fd::read_idx(dir.file(name), nd);
      EXPECT_EQ(a.dims, dims) << name;
      EXPECT_EQ(a.data, data) << name;
      EXPECT_EQ(a.numel(), static_cast<int64_t>(numel));
    }
  }
}

// The corrupt-file table: each entry builds a file from a valid one and names the error expected.
TEST(DataIdx, CorruptFilesRaiseClearErrors) {
  ScratchDir dir;
  const std::vector<int64_t> dims = {5, 4, 3};
  const std::vector<uint8_t> good = fd::encode_idx(dims, random_bytes(60, 7));
  struct Case {
    std::string name;
    std::vector<uint8_t> bytes;
    std::string what;
    int ndim = -1;
  };
  std::vector<Case> cases;
  auto with = [&](auto edit) {
    std::vector<uint8_t> f = good;
    edit(f);
    return f;
  };
  cases.push_back({"empty", {}, "too short for the 4-byte magic"});
  cases.push_back({"bad_magic", with([](auto& f) { f[0] = 0x01; }), "bad magic 0x01"});
  cases.push_back({"float_type", with([](auto& f) { f[2] = 0x0D; }), "type code 0x0D (float32) is not supported"});
  cases.push_back({"zero_dims", with([](auto& f) { f[3] = 0; }), "dimension count 0"});
  cases.push_back({"five_dims", with([](auto& f) { f[3] = 5; }), "dimension count 5"});
  cases.push_back({"wrong_ndim", good, "has 3 dimensions, expected 1 (labels)", 1});
  cases.push_back({"zero_dim", with([](auto& f) { set_be32(f, 8, 0); }), "dimension 1 is 0"});
  cases.push_back({"huge_dim", with([](auto& f) { set_be32(f, 4, 0xFFFFFFFFu); }), "dimension 0 is 4294967295"});
  cases.push_back({"overflow", with([](auto& f) {
                     set_be32(f, 4, 0x7FFFFFFFu);
                     set_be32(f, 8, 0x7FFFFFFFu);
                     set_be32(f, 12, 0x7FFFFFFFu);
                   }),
                   "more than 1073741824 elements"});
  cases.push_back({"short_header", std::vector<uint8_t>(good.begin(), good.begin() + 10), "truncated header"});
  cases.push_back({"truncated", std::vector<uint8_t>(good.begin(), good.end() - 1),
                   "truncated data: the header promises 60 bytes (dimensions 5 4 3), the file has 59"});
  cases.push_back({"trailing", with([](auto& f) { f.insert(f.end(), {1, 2, 3}); }), "3 extra bytes after the 60 bytes"});
  const std::vector<uint8_t> z = fd::gzip(good);
  cases.push_back({"gz_truncated", std::vector<uint8_t>(z.begin(), z.end() - 9), "truncated gzip stream"});
  cases.push_back({"gz_trailing", [&] {
                     auto f = z;
                     f.push_back(0);
                     return f;
                   }(),
                   "1 bytes after the end of the gzip stream"});
  cases.push_back({"gz_corrupt", [&] {
                     auto f = z;
                     f[f.size() - 6] ^= 0xff;  // the CRC-32 of the trailer
                     return f;
                   }(),
                   "corrupt gzip stream"});
  cases.push_back({"gz_of_bad", fd::gzip(std::vector<uint8_t>(good.begin(), good.end() - 2)), "truncated data"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = dir.file(c.name);
    write_bytes(path, c.bytes);
    expect_idx_error(path, c.what, c.ndim);
  }
  expect_idx_error(dir.file("missing"), "cannot open");
  // The good file itself passes, so the table's errors come from the edits.
  write_bytes(dir.file("good"), good);
  EXPECT_EQ(fd::read_idx(dir.file("good"), 3).dims, dims);
}

TEST(DataIdx, ImageLabelMismatchAndBadLabelsAreRefused) {
  const std::vector<uint8_t> img = random_bytes(4 * 2 * 2, 3);
  auto images = [&] { return fd::IdxArray{{4, 2, 2}, img}; };
  try {
    fd::Dataset::from_idx(images(), fd::IdxArray{{3}, {1, 2, 3}}, "pair");
    ADD_FAILURE() << "a count mismatch was accepted";
  } catch (const fd::IdxError& e) {
    EXPECT_NE(std::string(e.what()).find("4 images but 3 labels"), std::string::npos) << e.what();
  }
  try {
    fd::Dataset::from_idx(images(), fd::IdxArray{{4}, {1, 2, 10, 3}}, "pair");
    ADD_FAILURE() << "label 10 was accepted";
  } catch (const fd::IdxError& e) {
    EXPECT_NE(std::string(e.what()).find("label 10 at index 2"), std::string::npos) << e.what();
  }
  const fd::Dataset d = fd::Dataset::from_idx(images(), fd::IdxArray{{4}, {1, 2, 9, 3}}, "pair");
  EXPECT_EQ(d.n, 4);
  EXPECT_EQ(d.rows, 2);
  EXPECT_EQ(d.images, img);
}

TEST(DataIdx, DataDirLookupHonoursFlagAndEnvironment) {
  ScratchDir dir;
  const std::string folder = dir.file("fm");
  std::filesystem::create_directories(folder);
  EXPECT_THROW(fd::find_data_dir(folder), std::runtime_error);  // named, but empty
  write_bytes(folder + "/train-images-idx3-ubyte.gz", fd::gzip(fd::encode_idx({1, 2, 2}, {1, 2, 3, 4})));
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
  write_bytes(scratch.file("labels"), fd::gunzip(raw.data(), raw.size(), "labels"));
  EXPECT_EQ(fd::read_idx(scratch.file("labels"), 1).data, test.labels);
}
