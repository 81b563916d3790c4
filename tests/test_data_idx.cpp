// The IDX reader (flame/data/idx.h, Note [IDX validation]): round trips of plain and gzip'd
// files, a table of corrupt files, and the tensor form.
#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "flame/data/idx.h"
#include "test_dist_util.h"

namespace fd = flame::data;

namespace {

// A fresh folder per test, removed at the end.
struct ScratchDir {
  flame::test::dist_test::TempDir dir;
  std::string file(const std::string& name) const { return dir.path + "/" + name; }
};

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

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

TEST(DataIdx, LoadIdxGivesAU8TensorOfTheFileDimensions) {
  ScratchDir dir;
  const std::vector<uint8_t> bytes = random_bytes(2 * 3 * 4, 5);
  write_bytes(dir.file("t.gz"), fd::gzip(fd::encode_idx({2, 3, 4}, bytes)));
  const flame::Tensor t = fd::load_idx(dir.file("t.gz"), 3);
  EXPECT_EQ(t.dtype(), flame::DType::u8);
  EXPECT_EQ(t.sizes(), (flame::Shape{2, 3, 4}));
  EXPECT_EQ(t.to_vec<uint8_t>(), bytes);
  // Element [1, 2, 3] is byte 1 * 12 + 2 * 4 + 3 of the data (row-major).
  EXPECT_EQ(t.select(0, 1).select(0, 2).select(0, 3).item<uint8_t>(), bytes[23]);
  EXPECT_THROW(fd::load_idx(dir.file("t.gz"), 1), fd::IdxError);
}
