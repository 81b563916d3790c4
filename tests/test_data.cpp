// flame::data (docs/data.md) and randperm: samplers, the DataLoader's batching, collate, workers,
// errors, resume, pinning and device prefetch. CUDA cases skip without a GPU.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <numeric>
#include <set>
#include <thread>

#include "flame/checkpoint.h"
#include "flame/data.h"
#include "flame/dist.h"
#include "test_dist_util.h"
#include "test_util.h"

namespace flame::test {
namespace {

namespace fdata = flame::data;

// randperm's documented algorithm, written out: Fisher-Yates from the last position down, with
// HostRng seeded by mix(seed, offset).
std::vector<int64_t> reference_perm(int64_t n, uint64_t seed, uint64_t offset) {
  std::vector<int64_t> p(static_cast<std::size_t>(n));
  std::iota(p.begin(), p.end(), int64_t{0});
  HostRng rng(HostRng::mix(seed, offset));
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[rng.below(static_cast<uint64_t>(i) + 1)]);
  return p;
}

bool is_permutation_of_range(std::vector<int64_t> v, int64_t n) {
  if (static_cast<int64_t>(v.size()) != n) return false;
  std::sort(v.begin(), v.end());
  for (int64_t i = 0; i < n; ++i)
    if (v[i] != i) return false;
  return true;
}

// Rows i of [n, 3] f32 data hold {i, 10 i, 100 i}; target i is i * i (i64).
std::shared_ptr<fdata::TensorDataset> row_dataset(int64_t n) {
  std::vector<float> d;
  std::vector<int64_t> t;
  for (int64_t i = 0; i < n; ++i) {
    d.insert(d.end(), {float(i), float(10 * i), float(100 * i)});
    t.push_back(i * i);
  }
  return std::make_shared<fdata::TensorDataset>(Tensor::from_vec(d, {n, 3}), Tensor::from_vec(t, {n}));
}

// The example indices of a row_dataset batch, read back from its data column 0.
std::vector<int64_t> indices_of(const fdata::Example& b) {
  std::vector<int64_t> out;
  for (float v : b.data.select(1, 0).contiguous().to_vec<float>()) out.push_back(static_cast<int64_t>(v));
  return out;
}

// Checks that a row_dataset batch holds exactly the rows of `indices`, in order.
void expect_rows(const fdata::Example& b, const std::vector<int64_t>& indices) {
  const int64_t n = static_cast<int64_t>(indices.size());
  ASSERT_EQ(b.data.sizes(), (Shape{n, 3}));
  ASSERT_EQ(b.target.sizes(), (Shape{n}));
  const std::vector<float> d = b.data.to_vec<float>();
  const std::vector<int64_t> t = b.target.to_vec<int64_t>();
  for (int64_t k = 0; k < n; ++k) {
    const int64_t i = indices[k];
    EXPECT_EQ(d[3 * k], float(i));
    EXPECT_EQ(d[3 * k + 1], float(10 * i));
    EXPECT_EQ(d[3 * k + 2], float(100 * i));
    EXPECT_EQ(t[k], i * i);
  }
}

// A data set whose get() sleeps a little (longer for some indices, so workers finish out of order),
// fails for `bad_index`, and counts the calls made off the calling thread.
class SlowDataset : public fdata::Dataset<> {
 public:
  SlowDataset(int64_t n, int64_t bad_index = -1) : n_(n), bad_(bad_index), owner_(std::this_thread::get_id()) {}
  int64_t size() const override { return n_; }
  fdata::Example get(int64_t i) const override {
    if (std::this_thread::get_id() != owner_) ++off_thread_;
    std::this_thread::sleep_for(std::chrono::microseconds(i % 3 == 0 ? 300 : 20));
    if (i == bad_) throw std::out_of_range("sample " + std::to_string(i) + " is corrupt");
    return {Tensor::full({2}, double(i)), Tensor::scalar(i)};
  }
  mutable std::atomic<int64_t> off_thread_{0};

 private:
  int64_t n_, bad_;
  std::thread::id owner_;
};

}  // namespace

// ---- randperm ----

TEST(Randperm, IsAPermutationEqualToTheDocumentedDraw) {
  Generator g(123);
  const Tensor p = Tensor::randperm(1000, {}, &g);
  EXPECT_EQ(p.dtype(), DType::i64);
  EXPECT_EQ(p.sizes(), (Shape{1000}));
  const std::vector<int64_t> v = p.to_vec<int64_t>();
  EXPECT_TRUE(is_permutation_of_range(v, 1000));
  EXPECT_EQ(v, reference_perm(1000, 123, 0));
  EXPECT_EQ(g.offset(), 1u);  // one offset per call, as every random op
  // The next call draws at offset 1: another permutation.
  const std::vector<int64_t> w = randperm(1000, {}, &g).to_vec<int64_t>();
  EXPECT_EQ(w, reference_perm(1000, 123, 1));
  EXPECT_NE(v, w);
  // Not the identity (a fixed point count near 1 is expected, not 1000).
  int64_t fixed = 0;
  for (int64_t i = 0; i < 1000; ++i) fixed += v[i] == i;
  EXPECT_LT(fixed, 10);
}

TEST(Randperm, ReproducibleForASeedAndDifferentAcrossSeeds) {
  Generator a(7), b(7), c(8);
  const auto pa = Tensor::randperm(257, {}, &a).to_vec<int64_t>();
  EXPECT_EQ(pa, Tensor::randperm(257, {}, &b).to_vec<int64_t>());
  EXPECT_NE(pa, Tensor::randperm(257, {}, &c).to_vec<int64_t>());
  // The default generator, reseeded, repeats itself.
  manual_seed(99);
  const auto d1 = randperm(50).to_vec<int64_t>();
  manual_seed(99);
  EXPECT_EQ(d1, randperm(50).to_vec<int64_t>());
  // Other dtypes hold the same values.
  Generator e(7);
  const std::vector<float> pf = Tensor::randperm(257, DType::f32, &e).to_vec<float>();
  ASSERT_EQ(pf.size(), pa.size());
  for (std::size_t k = 0; k < pa.size(); ++k) EXPECT_EQ(pf[k], static_cast<float>(pa[k]));
  Generator f(7);
  const std::vector<int32_t> pi = Tensor::randperm(257, DType::i32, &f).to_vec<int32_t>();
  for (std::size_t k = 0; k < pa.size(); ++k) EXPECT_EQ(pi[k], static_cast<int32_t>(pa[k]));
}

TEST(Randperm, EmptyAndSingleAndBadArguments) {
  Generator g(1);
  const Tensor empty = Tensor::randperm(0, {}, &g);
  EXPECT_EQ(empty.sizes(), (Shape{0}));
  EXPECT_EQ(empty.dtype(), DType::i64);
  EXPECT_EQ(Tensor::randperm(1, {}, &g).to_vec<int64_t>(), (std::vector<int64_t>{0}));
  expect_error([&] { (void)Tensor::randperm(-3, {}, &g); }, {"randperm", "-3", "non-negative"});
  expect_error([&] { (void)Tensor::randperm(257, DType::u8, &g); }, {"randperm", "257", "u8"});
  EXPECT_EQ(Tensor::randperm(256, DType::u8, &g).numel(), 256);
  expect_error([&] { (void)Tensor::randperm(3, DType::boolean, &g); }, {"randperm", "bool"});
}

TEST(Randperm, CudaGivesTheCpuPermutation) {
  FLAME_SKIP_IF_NO_CUDA();
  Generator a(31), b(31);
  const Tensor gpu = Tensor::randperm(5000, Device::cuda(0), &a);
  EXPECT_TRUE(gpu.device().is_cuda());
  EXPECT_EQ(gpu.to_vec<int64_t>(), Tensor::randperm(5000, {}, &b).to_vec<int64_t>());
}

// ---- samplers ----

TEST(DataSampler, SequentialAndRandomOrders) {
  fdata::SequentialSampler seq(5);
  EXPECT_EQ(seq.num_samples(), 5);
  EXPECT_EQ(seq.indices(3), (std::vector<int64_t>{0, 1, 2, 3, 4}));

  fdata::RandomSampler r(100, /*seed=*/42);
  EXPECT_EQ(r.num_samples(), 100);
  std::vector<std::vector<int64_t>> epochs;
  for (int64_t e = 0; e < 3; ++e) {
    epochs.push_back(r.indices(e));
    EXPECT_TRUE(is_permutation_of_range(epochs.back(), 100)) << "epoch " << e;
    // Epoch e is randperm at the generator state {seed, e}.
    EXPECT_EQ(epochs.back(), reference_perm(100, 42, static_cast<uint64_t>(e)));
  }
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_NE(epochs[1], epochs[2]);
  EXPECT_EQ(fdata::RandomSampler(100, 42).indices(1), epochs[1]);  // another instance, same epoch
  EXPECT_NE(fdata::RandomSampler(100, 43).indices(1), epochs[1]);
  // From a Generator: its state at construction is the base, so epoch e draws at offset base + e.
  Generator g(42);
  (void)g.next_offset(2);
  EXPECT_EQ(fdata::RandomSampler(100, g).indices(0), epochs[2]);

  // Fewer samples: a prefix of the permutation; more: whole permutations, each value equally often.
  fdata::RandomSampler few(10, 5, false, 4);
  const auto f = few.indices(0);
  const std::vector<int64_t> whole = reference_perm(10, 5, 0);
  EXPECT_EQ(f, std::vector<int64_t>(whole.begin(), whole.begin() + 4));
  fdata::RandomSampler many(10, 5, false, 30);
  const auto m = many.indices(0);
  ASSERT_EQ(m.size(), 30u);
  for (int k = 0; k < 3; ++k) EXPECT_TRUE(is_permutation_of_range({m.begin() + 10 * k, m.begin() + 10 * k + 10}, 10)) << k;
  EXPECT_EQ(many.indices(0), m);
}

TEST(DataSampler, RandomWithReplacementIsUniformAndReproducible) {
  fdata::RandomSampler r(3, 9, /*replacement=*/true, 3000);
  const auto v = r.indices(0);
  ASSERT_EQ(v.size(), 3000u);
  std::vector<int64_t> count(3, 0);
  for (int64_t i : v) {
    ASSERT_GE(i, 0);
    ASSERT_LT(i, 3);
    ++count[i];
  }
  // Binomial(3000, 1/3): sd 25.8; 4 sd is about 100.
  for (int64_t c : count) EXPECT_NEAR(static_cast<double>(c), 1000.0, 100.0);
  EXPECT_EQ(r.indices(0), v);
  EXPECT_NE(r.indices(1), v);
  expect_error([] { fdata::RandomSampler(0, 1, true, 5); }, {"RandomSampler", "empty"});
  expect_error([] { fdata::RandomSampler(-1); }, {"RandomSampler", "-1"});
}

TEST(DataSampler, DistributedSharesPartitionTheData) {
  static_assert(std::is_same_v<dist::DistributedSampler, fdata::DistributedSampler>);
  for (bool drop_last : {false, true}) {
    SCOPED_TRACE(drop_last ? "drop_last" : "padded");
    const int world = 3;
    const int64_t n = 10;
    std::multiset<int64_t> all;
    for (int r = 0; r < world; ++r) {
      fdata::DistributedSampler s(n, world, r, true, 7, drop_last);
      EXPECT_EQ(s.num_samples(), drop_last ? 3 : 4);
      const auto idx = s.indices(2);
      s.set_epoch(2);
      EXPECT_EQ(s.indices(), idx);  // torch's set_epoch spelling agrees
      EXPECT_EQ(static_cast<int64_t>(idx.size()), s.num_samples());
      all.insert(idx.begin(), idx.end());
    }
    const std::set<int64_t> distinct(all.begin(), all.end());
    if (drop_last) {
      EXPECT_EQ(all.size(), 9u);  // 9 of the 10, none twice
      EXPECT_EQ(distinct.size(), 9u);
    } else {
      EXPECT_EQ(all.size(), 12u);  // all 10, two repeated as padding
      EXPECT_EQ(distinct.size(), 10u);
    }
  }
  // Every rank shuffles the same way: rank r's list is entries r, r + world, ... of one order.
  fdata::DistributedSampler r0(12, 2, 0, true, 3), r1(12, 2, 1, true, 3);
  const auto a = r0.indices(5), b = r1.indices(5);
  std::vector<int64_t> merged;
  for (std::size_t k = 0; k < a.size(); ++k) merged.insert(merged.end(), {a[k], b[k]});
  EXPECT_TRUE(is_permutation_of_range(merged, 12));
  expect_error([] { fdata::DistributedSampler(10, 2, 2); }, {"DistributedSampler", "rank 2"});
}

// ---- DataLoader ----

TEST(DataLoader, SequentialBatchesAndDropLast) {
  auto ds = row_dataset(10);
  for (bool drop_last : {false, true}) {
    SCOPED_TRACE(drop_last ? "drop_last" : "keep last");
    fdata::DataLoader loader(ds, {.batch_size = 4, .drop_last = drop_last});
    EXPECT_EQ(loader.size(), drop_last ? 2 : 3);
    expect_rows(loader.next(), {0, 1, 2, 3});
    expect_rows(loader.next(), {4, 5, 6, 7});
    if (!drop_last) expect_rows(loader.next(), {8, 9});
    EXPECT_EQ(loader.state(), (fdata::LoaderState{1, 0, 0}));
    expect_rows(loader.next(), {0, 1, 2, 3});  // next() goes on into the next epoch
  }
  // Batch size larger than the data set: one short batch, or none with drop_last.
  fdata::DataLoader big(ds, {.batch_size = 16});
  EXPECT_EQ(big.size(), 1);
  expect_rows(big.next(), {0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  fdata::DataLoader none(ds, {.batch_size = 16, .drop_last = true});
  EXPECT_EQ(none.size(), 0);
  EXPECT_TRUE(none.begin() == none.end());
  expect_error([&] { (void)none.next(); }, {"DataLoader", "no batch", "10 samples", "batch_size 16"});
}

TEST(DataLoader, RangeForRunsOneEpochAndShuffledEpochsDiffer) {
  auto ds = row_dataset(23);
  fdata::DataLoader loader(ds, {.batch_size = 5, .shuffle = true, .seed = 11});
  std::vector<std::vector<int64_t>> epochs(2);
  for (int e = 0; e < 2; ++e) {
    int64_t batches = 0;
    for (auto& batch : loader) {
      const auto idx = indices_of(batch);
      expect_rows(batch, idx);
      EXPECT_EQ(idx, loader.batch_info(e, batches).indices);
      epochs[e].insert(epochs[e].end(), idx.begin(), idx.end());
      ++batches;
    }
    EXPECT_EQ(batches, 5);
    EXPECT_EQ(epochs[e], reference_perm(23, 11, static_cast<uint64_t>(e)));  // RandomSampler(seed)'s order
  }
  EXPECT_NE(epochs[0], epochs[1]);
  // Started mid-epoch, a loop runs the rest of that epoch.
  loader.load_state({3, 2, 11});
  int64_t rest = 0;
  for (auto& batch : loader) {
    EXPECT_EQ(indices_of(batch), loader.batch_info(3, 2 + rest).indices);
    ++rest;
  }
  EXPECT_EQ(rest, 3);
  EXPECT_EQ(loader.state(), (fdata::LoaderState{4, 0, 11}));
}

TEST(DataLoader, CollateStacksEveryFieldAndNamesAMismatch) {
  // Tensor examples, vector examples and map examples: each field stacked along a new dim 0.
  struct Pairs : fdata::Dataset<std::vector<Tensor>> {
    int64_t size() const override { return 4; }
    std::vector<Tensor> get(int64_t i) const override {
      return {Tensor::full({2, 2}, double(i)), Tensor::scalar(int64_t{7 * i})};
    }
  };
  fdata::DataLoader<std::vector<Tensor>> pairs(std::make_shared<Pairs>(), {.batch_size = 3});
  const std::vector<Tensor> b = pairs.next();
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].sizes(), (Shape{3, 2, 2}));
  EXPECT_EQ(b[0].to_vec<float>(), (std::vector<float>{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2}));
  EXPECT_EQ(b[1].to_vec<int64_t>(), (std::vector<int64_t>{0, 7, 14}));

  struct Named : fdata::Dataset<std::map<std::string, Tensor>> {
    int64_t size() const override { return 3; }
    std::map<std::string, Tensor> get(int64_t i) const override {
      return {{"x", Tensor::full({1}, double(i) + 0.5)}, {"y", Tensor::scalar(i)}};
    }
  };
  fdata::DataLoader<std::map<std::string, Tensor>> named(std::make_shared<Named>(), {.batch_size = 3});
  auto m = named.next();
  EXPECT_EQ(m.at("x").to_vec<float>(), (std::vector<float>{0.5f, 1.5f, 2.5f}));
  EXPECT_EQ(m.at("y").to_vec<int64_t>(), (std::vector<int64_t>{0, 1, 2}));

  // A data set without targets gives batches without one.
  fdata::DataLoader unlabelled(std::make_shared<fdata::TensorDataset>(Tensor::arange(6.0).reshape({3, 2})),
                               {.batch_size = 2});
  const fdata::Example u = unlabelled.next();
  EXPECT_FALSE(u.target.defined());
  EXPECT_EQ(u.data.to_vec<float>(), (std::vector<float>{0, 1, 2, 3}));

  // Examples of different shapes cannot be stacked: the error names the batch and both shapes.
  struct Ragged : fdata::Dataset<> {
    int64_t size() const override { return 4; }
    fdata::Example get(int64_t i) const override { return {Tensor::zeros({i + 1}), Tensor::scalar(i)}; }
  };
  fdata::DataLoader ragged(std::shared_ptr<const fdata::Dataset<>>(std::make_shared<Ragged>()), {.batch_size = 2});
  expect_error([&] { (void)ragged.next(); },
               {"DataLoader", "batch 0 of epoch 0", "collate", "data 1 of the batch is [2]", "data 0 is [1]"});
}

TEST(DataLoader, CustomExampleAndBatchTypesWithACollate) {
  struct Word {
    std::string text;
    int64_t label;
  };
  struct Words : fdata::Dataset<Word> {
    int64_t size() const override { return 5; }
    Word get(int64_t i) const override { return {std::string(static_cast<std::size_t>(i + 1), 'a'), i % 2}; }
  };
  struct Lengths {
    Tensor lengths, labels;
  };
  fdata::DataLoader<Word, Lengths> loader(
      std::make_shared<Words>(), {.batch_size = 2, .num_workers = 2},
      [](std::vector<Word> words) {
        std::vector<int64_t> len, lab;
        for (const Word& w : words) len.push_back(static_cast<int64_t>(w.text.size())), lab.push_back(w.label);
        const int64_t n = static_cast<int64_t>(words.size());
        return Lengths{Tensor::from_vec(len, {n}), Tensor::from_vec(lab, {n})};
      });
  EXPECT_EQ(loader.next().lengths.to_vec<int64_t>(), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(loader.next().labels.to_vec<int64_t>(), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(loader.next().lengths.to_vec<int64_t>(), (std::vector<int64_t>{5}));
  // Without a collate there is nothing to stack a Word with; without for_each_tensor no device.
  expect_error([] { fdata::DataLoader<Word, Lengths>(std::make_shared<Words>(), {}); },
               {"DataLoader", "collate function"});
  expect_error([] { fdata::DataLoader<Word, Lengths>(std::make_shared<Words>(), {.pin_memory = true}); },
               {"DataLoader", "for_each_tensor"});
}

TEST(DataLoader, WorkersPreserveTheOrderOfTheSingleThreadedLoader) {
  auto ds = std::make_shared<SlowDataset>(37);
  const fdata::DataLoaderOptions base{.batch_size = 4, .shuffle = true, .seed = 5};
  fdata::DataLoader inline_loader(ds, base);
  std::vector<std::vector<float>> want;
  for (int i = 0; i < 25; ++i) want.push_back(inline_loader.next().data.to_vec<float>());  // 2.5 epochs
  EXPECT_EQ(ds->off_thread_.load(), 0);
  for (int workers : {1, 3}) {
    for (int prefetch : {1, 4}) {
      SCOPED_TRACE(std::to_string(workers) + " workers, prefetch " + std::to_string(prefetch));
      auto o = base;
      o.num_workers = workers;
      o.prefetch_factor = prefetch;
      fdata::DataLoader loader(ds, o);
      for (int i = 0; i < 25; ++i) ASSERT_EQ(loader.next().data.to_vec<float>(), want[i]) << "batch " << i;
    }
  }
  EXPECT_GT(ds->off_thread_.load(), 0);  // the workers did the get() calls
}

TEST(DataLoader, ErrorsAreRaisedInOrderNamingTheBatchAndIndex) {
  for (int workers : {0, 2}) {
    SCOPED_TRACE(std::to_string(workers) + " workers");
    auto ds = std::make_shared<SlowDataset>(20, /*bad_index=*/13);
    fdata::DataLoader loader(ds, {.batch_size = 4, .num_workers = workers});
    for (int i = 0; i < 3; ++i) EXPECT_EQ(indices_of(loader.next()).front(), 4 * i);  // the batches before it
    try {
      (void)loader.next();
      ADD_FAILURE() << "the failing get was not raised";
    } catch (const fdata::LoaderError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("get(13)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("batch 3 of epoch 0 (indices 12, 13, 14, 15)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("sample 13 is corrupt"), std::string::npos) << msg;
      // The original exception is nested, with its type.
      EXPECT_THROW(std::rethrow_if_nested(e), std::out_of_range);
    }
    // The loader stays failed, at the failing batch, until its state is loaded again.
    EXPECT_THROW((void)loader.next(), fdata::LoaderError);
    EXPECT_EQ(loader.state(), (fdata::LoaderState{0, 3, 0}));
    loader.load_state({0, 4, 0});
    EXPECT_EQ(indices_of(loader.next()).front(), 16);
  }
  // A transform's exception names the batch too.
  fdata::DataLoader<> t(row_dataset(8), {.batch_size = 2, .num_workers = 1}, {},
                        [](fdata::Example&, const fdata::BatchInfo& info) {
                          if (info.batch == 2) throw std::runtime_error("augmentation failed");
                        });
  (void)t.next();
  (void)t.next();
  expect_error([&] { (void)t.next(); }, {"DataLoader", "batch 2 of epoch 0", "augmentation failed"});
}

TEST(DataLoader, ResumingFromAStateGivesTheUninterruptedBatches) {
  auto ds = row_dataset(29);
  std::vector<fdata::BatchInfo> seen_infos;
  auto transform = [](fdata::Example& b, const fdata::BatchInfo& info) {
    // A seeded augmentation: add a per-batch random offset drawn from info.seed.
    HostRng rng(info.seed);
    b.data.add_(static_cast<double>(rng.below(1000)));
  };
  const fdata::DataLoaderOptions o{.batch_size = 4, .shuffle = true, .seed = 77, .num_workers = 2};
  fdata::DataLoader<> full(ds, o, {}, transform);
  std::vector<std::vector<float>> seq;
  for (int i = 0; i < 20; ++i) seq.push_back(full.next().data.to_vec<float>());  // 8 per epoch: 2.5 epochs
  for (int cut : {1, 7, 8, 13}) {
    SCOPED_TRACE("resumed after " + std::to_string(cut) + " batches");
    fdata::DataLoader<> first(ds, o, {}, transform);
    for (int i = 0; i < cut; ++i) (void)first.next();
    const StateDict saved = first.state_dict();  // what a checkpoint stores
    EXPECT_EQ(saved.at("epoch").item<int64_t>(), cut / 8);
    EXPECT_EQ(saved.at("batch").item<int64_t>(), cut % 8);
    // Another process: constructed with another seed and no workers; the state brings the seed.
    auto other = o;
    other.seed = 1;
    other.num_workers = 0;
    fdata::DataLoader<> resumed(ds, other, {}, transform);
    resumed.load_state_dict(saved);
    EXPECT_EQ(resumed.state().seed, 77u);
    for (int i = cut; i < 20; ++i) ASSERT_EQ(resumed.next().data.to_vec<float>(), seq[i]) << "batch " << i;
  }
  // BatchInfo::seed is the documented mix of (seed, epoch, batch).
  fdata::DataLoader<> probe(ds, o);
  EXPECT_EQ(probe.batch_info(2, 3).seed, HostRng::mix(HostRng::mix(77, 2), 3 + 0x5eed));
  // A state that does not fit this loader is refused.
  expect_error([&] { probe.load_state({0, 8, 77}); }, {"DataLoader", "batch 8", "8 batches"});
  StateDict bad;
  bad.insert("epoch", Tensor::scalar(int64_t{0}));
  expect_error([&] { probe.load_state_dict(bad); }, {"DataLoader", "\"batch\"", "missing"});
}

// docs/checkpoint.md's loop: the loader registered in a Checkpoint, saved to a file and loaded into
// a fresh loader, continues with the batches of the uninterrupted one.
TEST(DataLoader, ACheckpointFileCarriesThePosition) {
  auto ds = row_dataset(50);
  const fdata::DataLoaderOptions o{.batch_size = 8, .shuffle = true, .seed = 21, .num_workers = 1};
  fdata::DataLoader run(ds, o);
  for (int i = 0; i < 9; ++i) (void)run.next();  // 7 batches per epoch (the last of 2): epoch 1, batch 2
  dist_test::TempDir dir;
  const std::string path = dir.path + "/ckpt.safetensors";
  Checkpoint save;
  save.add("loader", run);
  save.save(path);
  fdata::DataLoader fresh(ds, o);
  Checkpoint load;
  load.add("loader", fresh);
  (void)load.load(path);
  EXPECT_EQ(fresh.state(), (fdata::LoaderState{1, 2, 21}));
  for (int i = 0; i < 8; ++i) ASSERT_EQ(indices_of(fresh.next()), indices_of(run.next())) << "batch " << i;
}

TEST(DataLoader, DestructorStopsBlockedWorkersQuickly) {
  auto ds = std::make_shared<SlowDataset>(400);
  const auto start = std::chrono::steady_clock::now();
  {
    fdata::DataLoader loader(ds, {.batch_size = 8, .num_workers = 3, .prefetch_factor = 2});
    (void)loader.next();
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
}

TEST(DataLoader, BadOptionsAreRefused) {
  auto ds = row_dataset(10);
  expect_error([&] { fdata::DataLoader l(ds, {.batch_size = 0}); }, {"DataLoader", "batch_size", "0"});
  expect_error([&] { fdata::DataLoader l(ds, {.num_workers = -1}); }, {"DataLoader", "num_workers", "-1"});
  expect_error([&] { fdata::DataLoader l(ds, {.prefetch_factor = 0}); }, {"DataLoader", "prefetch_factor"});
  expect_error([&] { fdata::DataLoader<> l(nullptr); }, {"DataLoader", "no data set"});
  if (!cuda_is_available()) {
    expect_error([&] { fdata::DataLoader l(ds, {.device = Device::cuda(0)}); }, {"DataLoader", "cuda:0", "no CUDA"});
  }
  // A sampler that hands out an index outside the data set.
  struct Wild : fdata::Sampler {
    int64_t num_samples() const override { return 2; }
    std::vector<int64_t> indices(int64_t) const override { return {0, 10}; }
  };
  fdata::DataLoader wild(ds, {.batch_size = 2, .sampler = std::make_shared<Wild>()});
  expect_error([&] { (void)wild.next(); }, {"DataLoader", "index 10", "10 examples"});
  expect_error([] { fdata::TensorDataset(Tensor::zeros({3, 2}), Tensor::zeros({4})); },
               {"TensorDataset", "[3, 2]", "[4]"});
}

TEST(DataLoader, DistributedSamplerGivesEachRankItsShare) {
  auto ds = row_dataset(10);
  std::set<int64_t> seen;
  for (int r = 0; r < 2; ++r) {
    auto s = std::make_shared<fdata::DistributedSampler>(10, 2, r, true, 4);
    fdata::DataLoader loader(ds, {.batch_size = 5, .sampler = s});
    ASSERT_EQ(loader.size(), 1);
    const auto idx = indices_of(loader.next());
    EXPECT_EQ(idx, s->indices(0));
    seen.insert(idx.begin(), idx.end());
    EXPECT_EQ(indices_of(loader.next()), s->indices(1));  // the loader's epoch, no set_epoch needed
  }
  EXPECT_EQ(seen.size(), 10u);
}

TEST(DataLoader, PinMemoryWithoutCudaIsIgnored) {
  if (cuda_is_available()) GTEST_SKIP() << "a CUDA device is present: the no-CUDA behaviour is not testable here";
  fdata::DataLoader loader(row_dataset(6), {.batch_size = 3, .pin_memory = true});
  const fdata::Example b = loader.next();
  EXPECT_FALSE(b.data.is_pinned());
  expect_rows(b, {0, 1, 2});
}

TEST(DataLoader, PinMemoryGivesPinnedBatches) {
  FLAME_SKIP_IF_NO_CUDA();
  struct Words : fdata::Dataset<Tensor> {
    int64_t size() const override { return 4; }
    Tensor get(int64_t i) const override { return Tensor::full({3}, double(i)); }
  };
  for (int workers : {0, 2}) {
    fdata::DataLoader loader(row_dataset(6), {.batch_size = 3, .num_workers = workers, .pin_memory = true});
    const fdata::Example b = loader.next();
    EXPECT_TRUE(b.data.is_pinned());
    EXPECT_TRUE(b.target.is_pinned());
    expect_rows(b, {0, 1, 2});
    // A custom collate's result is pinned after the collate.
    fdata::DataLoader<Tensor> custom(std::make_shared<Words>(), {.batch_size = 2, .num_workers = workers, .pin_memory = true},
                                     [](std::vector<Tensor> v) { return stack(v, 0); });
    const Tensor c = custom.next();
    EXPECT_TRUE(c.is_pinned());
    EXPECT_EQ(c.to_vec<float>(), (std::vector<float>{0, 0, 0, 1, 1, 1}));
  }
}

// On CUDA each batch is uploaded on the loader's side stream; the caller's current stream (a stream
// of the test's own) waits for it, so work queued there sees the uploaded values.
TEST(DataLoader, CudaPrefetchIsReadyOnTheCallersStream) {
  FLAME_SKIP_IF_NO_CUDA();
  // 512 rows of 4096 floats: uploads long enough to race a stream that did not wait.
  Generator g(3);
  const Tensor x = Tensor::uniform({512, 4096}, -1.0, 1.0, DType::f32, &g);
  auto ds = std::make_shared<fdata::TensorDataset>(x, Tensor::arange(int64_t{512}));
  const fdata::DataLoaderOptions o{.batch_size = 64, .shuffle = true, .seed = 8, .num_workers = 2,
                                   .prefetch_factor = 3};
  fdata::DataLoader host(ds, o);
  auto od = o;
  od.device = Device::cuda(0);
  fdata::DataLoader gpu(ds, od);
  const cuda::Stream compute = cuda::Stream::create(0);
  cuda::StreamGuard guard(compute);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  for (int i = 0; i < 16; ++i) {  // two epochs
    const fdata::Example gb = gpu.next();
    const fdata::Example hb = host.next();
    ASSERT_TRUE(gb.data.device().is_cuda());
    ASSERT_TRUE(gb.target.device().is_cuda());
    const std::vector<float> got = (gb.data * 2.0).to_vec<float>();
    const std::vector<float> want = hb.data.to_vec<float>();
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t k = 0; k < got.size(); ++k) ASSERT_EQ(got[k], want[k] * 2.0f) << "batch " << i << " element " << k;
    EXPECT_EQ(gb.target.to_vec<int64_t>(), hb.target.to_vec<int64_t>());
  }
}

}  // namespace flame::test
