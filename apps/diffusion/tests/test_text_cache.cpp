// The text-embedding cache (models/text_cache.h, Note [Text embedding cache]) with a fake encoder
// whose outputs are a known function of each caption: hits and misses, batch splitting, stale
// entries of another encoder, corrupt files (truncated, bytes flipped, size against the index),
// writers running at once, and reads to the test device.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

#include "model_test_util.h"
#include "models/text_cache.h"

namespace {

namespace fs = std::filesystem;
using flame_diffusion::models::CacheEntryState;
using flame_diffusion::models::TextCacheStats;
using flame_diffusion::models::TextEmbeddingCache;
using flame_diffusion::models::TextTensors;

constexpr int64_t kTokens = 4, kWidth = 3;

// A number that depends on every byte of the caption and its position.
double caption_code(const std::string& c) {
  uint64_t v = 7;
  for (size_t i = 0; i < c.size(); ++i) v = (v * 131 + static_cast<unsigned char>(c[i]) * (i + 1)) % 9973;
  return static_cast<double>(v);
}

// What the fake encoder gives one caption: hidden [4, 3] f32 = code/1000 + j + k/10 (+ the salt),
// pooled [3] bf16 = hidden row 0, mask [4] i64 = 1 for the first (size % 4) + 1 tokens.
struct Expected {
  std::vector<float> hidden;
  std::vector<float> pooled;
  std::vector<int64_t> mask;
};
Expected expected_for(const std::string& c, double salt = 0) {
  Expected e;
  for (int64_t j = 0; j < kTokens; ++j) {
    for (int64_t k = 0; k < kWidth; ++k) {
      e.hidden.push_back(static_cast<float>(caption_code(c) / 1000.0 + static_cast<double>(j) + 0.1 * k + salt));
    }
  }
  for (int64_t k = 0; k < kWidth; ++k) e.pooled.push_back(e.hidden[static_cast<size_t>(k)]);
  for (int64_t j = 0; j < kTokens; ++j) e.mask.push_back(j <= static_cast<int64_t>(c.size() % 4) ? 1 : 0);
  return e;
}

// The fake encoder: records the batch sizes it was called with.
struct FakeEncoder {
  double salt = 0;
  std::vector<size_t> batch_sizes;
  std::mutex mu;

  TextTensors operator()(const std::vector<std::string>& caps) {
    {
      std::lock_guard<std::mutex> lock(mu);
      batch_sizes.push_back(caps.size());
    }
    std::vector<float> hidden, pooled;
    std::vector<int64_t> mask;
    for (const std::string& c : caps) {
      Expected e = expected_for(c, salt);
      hidden.insert(hidden.end(), e.hidden.begin(), e.hidden.end());
      pooled.insert(pooled.end(), e.pooled.begin(), e.pooled.end());
      mask.insert(mask.end(), e.mask.begin(), e.mask.end());
    }
    const auto b = static_cast<int64_t>(caps.size());
    return {{"hidden", flame::Tensor::from_vec(hidden, {b, kTokens, kWidth})},
            {"pooled", flame::Tensor::from_vec(pooled, {b, kWidth}).to(flame::DType::bf16)},
            {"mask", flame::Tensor::from_vec(mask, {b, kTokens})}};
  }
  flame_diffusion::models::TextEncodeFn fn() {
    return [this](const std::vector<std::string>& caps) { return (*this)(caps); };
  }
};

void expect_entry(const TextTensors& t, const std::string& caption, double salt = 0) {
  Expected e = expected_for(caption, salt);
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t.at("hidden").sizes(), (flame::Shape{kTokens, kWidth}));
  EXPECT_EQ(t.at("hidden").to_vec<float>(), e.hidden) << caption;
  EXPECT_EQ(t.at("pooled").dtype(), flame::DType::bf16);
  std::vector<float> pooled = t.at("pooled").to_vec<float>();
  for (size_t k = 0; k < pooled.size(); ++k) EXPECT_NEAR(pooled[k], e.pooled[k], std::abs(e.pooled[k]) / 128.0);
  EXPECT_EQ(t.at("mask").to_vec<int64_t>(), e.mask) << caption;
}

std::vector<std::string> some_captions(int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back("caption number " + std::to_string(i) + (i % 3 ? " of a cat" : " \xe7\x8c\xab"));
  return out;
}

void flip_byte(const std::string& path, std::streamoff at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char c = 0;
  f.get(c);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(at);
  f.put(c);
}

TEST(TextCache, MissThenHitAndValues) {
  const fs::path dir = fd_test::fresh_temp_dir("text_cache", "hit");
  FakeEncoder enc;
  TextEmbeddingCache cache(dir.string(), "fake-encoder v1", "max_length=4");
  std::vector<std::string> caps = some_captions(10);
  caps.push_back("");  // the empty caption is a caption like any other
  EXPECT_EQ(cache.check(caps[0]), CacheEntryState::kMissing);
  TextCacheStats s = cache.build(caps, enc.fn(), 4);
  EXPECT_EQ(s.missing, 11);
  EXPECT_EQ(s.encoded, 11);
  EXPECT_EQ(s.batches, 3);
  EXPECT_EQ(s.hits, 0);
  for (const std::string& c : caps) {
    EXPECT_EQ(cache.check(c), CacheEntryState::kValid) << c;
    expect_entry(cache.get(c), c);
  }
  // A second cache object on the same folder (a later run) finds everything through the index.
  TextEmbeddingCache again(dir.string(), "fake-encoder v1", "max_length=4");
  s = again.build(caps, enc.fn(), 4);
  EXPECT_EQ(s.hits, 11);
  EXPECT_EQ(s.encoded, 0);
  EXPECT_EQ(enc.batch_sizes.size(), 3u);
  TextTensors batch = again.get_batch({caps[2], caps[5]});
  EXPECT_EQ(batch.at("hidden").sizes(), (flame::Shape{2, kTokens, kWidth}));
  EXPECT_EQ(batch.at("hidden").select(0, 1).to_vec<float>(), expected_for(caps[5]).hidden);
  // Keys depend on caption, identity and settings.
  EXPECT_NE(again.key("a"), again.key("b"));
  EXPECT_NE(again.key("a"), TextEmbeddingCache(dir.string(), "fake-encoder v1", "max_length=8").key("a"));
  EXPECT_EQ(again.key("a").size(), 32u);
  EXPECT_TRUE(cache.problems().empty());
  std::string msg = fd_test::error_of([&] { again.get("never encoded"); });
  EXPECT_NE(msg.find("is missing"), std::string::npos) << msg;
  fs::remove_all(dir);
}

TEST(TextCache, BatchSplittingKeepsRowsWithTheirCaptions) {
  const fs::path dir = fd_test::fresh_temp_dir("text_cache", "split");
  FakeEncoder enc;
  TextEmbeddingCache cache(dir.string(), "fake", "");
  std::vector<std::string> caps = some_captions(7);
  caps.insert(caps.begin() + 2, caps[5]);  // duplicates are encoded once
  caps.push_back(caps[0]);
  TextCacheStats stats;
  TextTensors all = cache.get_or_encode(caps, enc.fn(), flame::Device::cpu(), 3, &stats);
  EXPECT_EQ(stats.encoded, 7);
  EXPECT_EQ(enc.batch_sizes, (std::vector<size_t>{3, 3, 1}));
  ASSERT_EQ(all.at("mask").sizes(), (flame::Shape{9, kTokens}));
  for (size_t i = 0; i < caps.size(); ++i) {
    EXPECT_EQ(all.at("hidden").select(0, static_cast<int64_t>(i)).to_vec<float>(), expected_for(caps[i]).hidden)
        << "row " << i << " (" << caps[i] << ")";
  }
  // An encoder that drops a row is refused with the shapes named.
  FakeEncoder enc2;
  auto bad = [&](const std::vector<std::string>& c) {
    TextTensors t = enc2(c);
    t["hidden"] = t["hidden"].narrow(0, 0, t["hidden"].size(0) - 1);
    return t;
  };
  std::string msg = fd_test::error_of([&] { cache.build({"new one", "new two"}, bad, 8); });
  EXPECT_NE(msg.find("\"hidden\" has shape [1, 4, 3] for a batch of 2 captions"), std::string::npos) << msg;
  fs::remove_all(dir);
}

TEST(TextCache, StaleEntriesOfAnotherEncoder) {
  const fs::path dir = fd_test::fresh_temp_dir("text_cache", "stale");
  FakeEncoder enc_a, enc_b;
  enc_b.salt = 100;
  TextEmbeddingCache a(dir.string(), "encoder A", "s");
  TextEmbeddingCache b(dir.string(), "encoder B", "s");
  const std::string cap = "a red bicycle";
  a.build({cap, "other"}, enc_a.fn());
  // Another identity is another key: a miss, never A's tensors.
  EXPECT_EQ(b.check(cap), CacheEntryState::kMissing);
  // A file of A's under B's name (copied folders, a collision) is stale, reported and re-encoded.
  fs::create_directories(fs::path(b.path_of(cap)).parent_path());
  fs::copy_file(a.path_of(cap), b.path_of(cap));
  std::string why;
  EXPECT_EQ(b.check(cap, &why), CacheEntryState::kStale);
  EXPECT_NE(why.find("encoder \"encoder A\""), std::string::npos) << why;
  TextCacheStats s = b.build({cap}, enc_b.fn());
  EXPECT_EQ(s.stale, 1);
  EXPECT_EQ(s.encoded, 1);
  ASSERT_EQ(b.problems().size(), 1u);
  EXPECT_NE(b.problems()[0].find("stale"), std::string::npos) << b.problems()[0];
  expect_entry(b.get(cap), cap, 100);
  expect_entry(a.get(cap), cap, 0);  // A's own entry is untouched
  // B sees A's two files as foreign; removing them leaves B's.
  std::vector<std::string> foreign = b.scan_foreign();
  EXPECT_EQ(foreign.size(), 2u);
  b.scan_foreign(/*remove=*/true);
  EXPECT_EQ(a.check(cap), CacheEntryState::kMissing);
  EXPECT_EQ(b.check(cap), CacheEntryState::kValid);
  fs::remove_all(dir);
}

TEST(TextCache, CorruptFilesAreDetectedAndReencoded) {
  const fs::path dir = fd_test::fresh_temp_dir("text_cache", "corrupt");
  FakeEncoder enc;
  TextEmbeddingCache cache(dir.string(), "fake", "s");
  std::vector<std::string> caps = some_captions(4);
  cache.build(caps, enc.fn());
  const std::string p0 = cache.path_of(caps[0]), p1 = cache.path_of(caps[1]), p2 = cache.path_of(caps[2]),
                    p3 = cache.path_of(caps[3]);
  const auto size0 = static_cast<std::streamoff>(fs::file_size(p0));
  fs::resize_file(p0, static_cast<uintmax_t>(size0 / 2));  // truncated mid-data
  flip_byte(p1, size0 - 3);                                 // a flipped byte in the tensor data
  flip_byte(p2, 20);                                        // a flipped byte in the header
  { std::ofstream(p3, std::ios::app | std::ios::binary) << "xx"; }  // grown: not the size the index says
  std::string why;
  EXPECT_EQ(cache.check(caps[0], &why), CacheEntryState::kCorrupt) << why;
  EXPECT_EQ(cache.check(caps[1], &why), CacheEntryState::kCorrupt) << why;
  EXPECT_NE(why.find("checksum"), std::string::npos) << why;
  EXPECT_EQ(cache.check(caps[2], &why), CacheEntryState::kCorrupt) << why;
  EXPECT_EQ(cache.check(caps[3], &why), CacheEntryState::kCorrupt) << why;
  EXPECT_NE(why.find("the index says"), std::string::npos) << why;
  std::string msg = fd_test::error_of([&] { cache.get(caps[1]); });
  EXPECT_NE(msg.find("is corrupt"), std::string::npos) << msg;
  TextCacheStats s = cache.build(caps, enc.fn());
  EXPECT_EQ(s.corrupt, 4);
  EXPECT_EQ(s.encoded, 4);
  EXPECT_GE(cache.problems().size(), 4u);
  for (const std::string& c : caps) expect_entry(cache.get(c), c);
  fs::remove_all(dir);
}

TEST(TextCache, WritersAtOnceLeaveValidFilesOnly) {
  const fs::path dir = fd_test::fresh_temp_dir("text_cache", "concurrent");
  std::vector<std::string> caps = some_captions(24);
  std::vector<std::thread> threads;
  std::vector<FakeEncoder> encs(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      TextEmbeddingCache cache(dir.string(), "fake", "s");  // one object per writer, as processes
      cache.build(caps, encs[static_cast<size_t>(t)].fn(), 2 + t);
    });
  }
  for (auto& th : threads) th.join();
  TextEmbeddingCache cache(dir.string(), "fake", "s");
  for (const std::string& c : caps) {
    std::string why;
    EXPECT_EQ(cache.check(c, &why), CacheEntryState::kValid) << c << ": " << why;
    expect_entry(cache.get(c), c);
  }
  size_t temps = 0, entries = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.path().string().find(".tmp") != std::string::npos) ++temps;
    if (e.path().extension() == ".safetensors") ++entries;
  }
  EXPECT_EQ(temps, 0u);
  EXPECT_EQ(entries, caps.size());
  std::ifstream index(dir / "index.tsv");
  size_t lines = 0;
  for (std::string line; std::getline(index, line);) ++lines;
  EXPECT_EQ(lines, caps.size());
  fs::remove_all(dir);
}

TEST(TextCache, ReadsBackToTheTestDevice) {
  FD_SKIP_IF_NO_DEVICE();
  const fs::path dir = fd_test::fresh_temp_dir("text_cache", "device");
  FakeEncoder enc;
  TextEmbeddingCache cache(dir.string(), "fake", "s");
  const flame::Device dev = fd_test::test_device();
  // The encoder's outputs may live on the device; the cache stores them from the host.
  auto on_device = [&](const std::vector<std::string>& c) {
    TextTensors t = enc(c);
    for (auto& [name, v] : t) v = v.to(dev);
    return t;
  };
  std::vector<std::string> caps = some_captions(5);
  TextTensors out = cache.get_or_encode(caps, on_device, dev, 2);
  EXPECT_EQ(out.at("hidden").device(), dev);
  EXPECT_EQ(out.at("hidden").select(0, 3).to(flame::Device::cpu()).to_vec<float>(), expected_for(caps[3]).hidden);
  expect_entry(cache.get(caps[4], dev), caps[4]);
  fs::remove_all(dir);
}

}  // namespace
