// The batch loader: determinism for a seed, per-epoch shuffles, coverage, resume, flips,
// normalisation, class filters, the prefetch thread's errors and shutdown (Notes [Loader
// determinism] and [Loader prefetch] in data.h).
#include <atomic>
#include <chrono>
#include <memory>
#include <set>

#include "data_test_util.h"

namespace fd = flame_diffusion;
using fd_test::random_dataset;
using fd_test::test_device;

namespace {

std::shared_ptr<const fd::Dataset> make_data(int64_t n, uint64_t seed = 1) {
  return std::make_shared<const fd::Dataset>(random_dataset(n, 6, 5, seed));
}

struct Seen {
  std::vector<float> images;
  std::vector<int64_t> labels;
  std::vector<int64_t> indices;
  std::vector<uint8_t> flipped;
  fd::LoaderPosition position;
};

Seen take(fd::Loader& loader) {
  fd::Batch b = loader.next();
  EXPECT_EQ(b.images.device(), loader.options().device);
  return {b.images.to_vec<float>(), b.labels.to_vec<int64_t>(), b.indices, b.flipped, b.position};
}

void expect_same(const Seen& a, const Seen& b, const std::string& what) {
  EXPECT_EQ(a.position, b.position) << what;
  EXPECT_EQ(a.indices, b.indices) << what;
  EXPECT_EQ(a.flipped, b.flipped) << what;
  EXPECT_EQ(a.labels, b.labels) << what;
  EXPECT_EQ(a.images, b.images) << what;
}

// The pixel a batch should hold for sample `index`, flipped or not: x / 127.5 - 1.
float expected_pixel(const fd::Dataset& d, int64_t index, bool flipped, int64_t r, int64_t c) {
  const int64_t col = flipped ? d.cols - 1 - c : c;
  return static_cast<float>(d.images[index * d.image_size() + r * d.cols + col]) / 127.5f - 1.0f;
}

}  // namespace

TEST(DataLoader, SameSeedSameBatchesWhateverThePrefetchDepth) {
  FD_SKIP_IF_NO_DEVICE();
  auto data = make_data(103);
  fd::LoaderOptions o;
  o.batch_size = 16;
  o.seed = 42;
  o.random_flip = true;
  o.device = test_device();
  o.prefetch = 0;
  fd::Loader a(data, o);
  o.prefetch = 3;
  fd::Loader b(data, o);
  o.device = flame::Device::cpu();
  o.prefetch = 1;
  fd::Loader c(data, o);
  for (int i = 0; i < 15; ++i) {  // more than two epochs of 6 batches
    const Seen sa = take(a), sb = take(b), sc = take(c);
    expect_same(sa, sb, "batch " + std::to_string(i));
    expect_same(sa, sc, "batch " + std::to_string(i) + " (CPU)");
  }
  EXPECT_EQ(a.position(), (fd::LoaderPosition{2, 3}));
  // Another seed gives another order.
  o.seed = 43;
  fd::Loader d(data, o);
  fd::Loader e(data, [&] { auto p = o; p.seed = 42; return p; }());
  EXPECT_NE(take(d).indices, take(e).indices);
}

TEST(DataLoader, EveryIndexOncePerEpochAndEpochsDiffer) {
  auto data = make_data(103);
  for (bool drop_last : {true, false}) {
    SCOPED_TRACE(drop_last ? "drop_last" : "keep last");
    fd::LoaderOptions o;
    o.batch_size = 10;
    o.seed = 5;
    o.drop_last = drop_last;
    fd::Loader loader(data, o);
    ASSERT_EQ(loader.batches_per_epoch(), drop_last ? 10 : 11);
    std::vector<std::vector<int64_t>> epochs(3);
    for (int e = 0; e < 3; ++e) {
      for (int64_t i = 0; i < loader.batches_per_epoch(); ++i) {
        const Seen s = take(loader);
        EXPECT_EQ(s.position, (fd::LoaderPosition{e, i}));
        const int64_t expected_b = (!drop_last && i == 10) ? 3 : 10;
        EXPECT_EQ(static_cast<int64_t>(s.indices.size()), expected_b);
        EXPECT_EQ(static_cast<int64_t>(s.labels.size()), expected_b);
        for (std::size_t k = 0; k < s.indices.size(); ++k) EXPECT_EQ(s.labels[k], data->labels[s.indices[k]]);
        epochs[e].insert(epochs[e].end(), s.indices.begin(), s.indices.end());
      }
      const std::set<int64_t> unique(epochs[e].begin(), epochs[e].end());
      EXPECT_EQ(unique.size(), epochs[e].size()) << "an index repeated in epoch " << e;
      EXPECT_EQ(static_cast<int64_t>(unique.size()), drop_last ? 100 : 103);
      EXPECT_GE(*unique.begin(), 0);
      EXPECT_LT(*unique.rbegin(), 103);
      std::vector<int64_t> order = loader.epoch_order(e);
      order.resize(epochs[e].size());
      EXPECT_EQ(epochs[e], order);
    }
    EXPECT_NE(epochs[0], epochs[1]);
    EXPECT_NE(epochs[1], epochs[2]);
  }
  // Without shuffling every epoch is the data-set order.
  fd::LoaderOptions o;
  o.batch_size = 50;
  o.shuffle = false;
  fd::Loader plain(data, o);
  const Seen first = take(plain);
  for (int64_t k = 0; k < 50; ++k) EXPECT_EQ(first.indices[k], k);
}

TEST(DataLoader, ResumeAtAPositionEqualsTheUninterruptedSequence) {
  FD_SKIP_IF_NO_DEVICE();
  auto data = make_data(77);
  fd::LoaderOptions o;
  o.batch_size = 8;
  o.seed = 1234;
  o.random_flip = true;
  o.device = test_device();
  fd::Loader full(data, o);
  std::vector<Seen> seq;
  for (int i = 0; i < 25; ++i) seq.push_back(take(full));  // 9 batches per epoch: 2.8 epochs
  for (int cut : {1, 9, 13, 20}) {
    SCOPED_TRACE("resumed after " + std::to_string(cut) + " batches");
    fd::Loader first(data, o);
    for (int i = 0; i < cut; ++i) (void)first.next();
    const fd::LoaderPosition saved = first.position();
    EXPECT_EQ(saved, seq[cut].position);
    fd::Loader resumed(data, o, saved);
    for (int i = cut; i < 25; ++i) expect_same(seq[i], take(resumed), "batch " + std::to_string(i));
  }
}

TEST(DataLoader, FlipsAboutHalfAndMirrorsTheRightImages) {
  FD_SKIP_IF_NO_DEVICE();
  auto data = make_data(400, 9);
  fd::LoaderOptions o;
  o.batch_size = 50;
  o.seed = 77;
  o.random_flip = true;
  o.device = test_device();
  fd::Loader loader(data, o);
  int64_t flipped = 0, total = 0;
  for (int i = 0; i < 16; ++i) {  // two epochs
    const Seen s = take(loader);
    for (std::size_t k = 0; k < s.indices.size(); ++k) {
      flipped += s.flipped[k];
      ++total;
      for (int64_t r = 0; r < data->rows; ++r) {
        for (int64_t c = 0; c < data->cols; ++c) {
          ASSERT_EQ(s.images[(k * data->rows + r) * data->cols + c], expected_pixel(*data, s.indices[k], s.flipped[k], r, c))
              << "sample " << k << " of batch " << i << " at " << r << "," << c;
        }
      }
    }
  }
  // 800 fair coin flips: 0.5 +- 0.06 is more than 3 standard deviations (0.018).
  EXPECT_NEAR(static_cast<double>(flipped) / total, 0.5, 0.06);
  // Without random_flip nothing is flipped.
  o.random_flip = false;
  fd::Loader plain(data, o);
  const Seen s = take(plain);
  for (uint8_t f : s.flipped) EXPECT_EQ(f, 0);
}

TEST(DataLoader, NormalisesToMinusOneToOne) {
  FD_SKIP_IF_NO_DEVICE();
  fd::Dataset d = random_dataset(20, 4, 4, 3);
  d.images[0] = 0;
  d.images[1] = 255;
  d.images[2] = 128;
  auto data = std::make_shared<const fd::Dataset>(d);
  fd::LoaderOptions o;
  o.batch_size = 20;
  o.shuffle = false;
  o.device = test_device();
  fd::Loader loader(data, o);
  fd::Batch b = loader.next();
  EXPECT_EQ(b.images.dtype(), flame::DType::f32);
  EXPECT_EQ(b.labels.dtype(), flame::DType::i64);
  EXPECT_EQ(b.images.sizes(), (flame::Shape{20, 1, 4, 4}));
  EXPECT_EQ(b.labels.sizes(), (flame::Shape{20}));
  const std::vector<float> v = b.images.to_vec<float>();
  EXPECT_EQ(v[0], -1.0f);
  EXPECT_EQ(v[1], 1.0f);
  EXPECT_NEAR(v[2], 128 / 127.5 - 1, 1e-7);
  for (std::size_t i = 0; i < v.size(); ++i) {
    ASSERT_GE(v[i], -1.0f);
    ASSERT_LE(v[i], 1.0f);
    ASSERT_NEAR(v[i], d.images[i] / 127.5 - 1, 1e-6) << i;
  }
}

TEST(DataLoader, ClassFiltersSelectAndHoldOut) {
  const fd::Dataset d = random_dataset(500, 3, 3, 21);
  const std::vector<int64_t> counts = d.class_counts();
  const fd::Dataset sevens = d.select_classes({7});
  EXPECT_EQ(sevens.n, counts[7]);
  for (uint8_t l : sevens.labels) EXPECT_EQ(l, 7);
  const fd::Dataset rest = d.exclude_classes({7});
  EXPECT_EQ(rest.n, d.n - counts[7]);
  for (uint8_t l : rest.labels) EXPECT_NE(l, 7);
  // The images travel with their labels, in order.
  int64_t j = 0;
  for (int64_t i = 0; i < d.n; ++i) {
    if (d.labels[i] != 7) continue;
    EXPECT_TRUE(std::equal(d.images.begin() + i * 9, d.images.begin() + i * 9 + 9, sevens.images.begin() + j * 9));
    ++j;
  }
  const fd::Dataset two = d.select_classes({2, 5});
  EXPECT_EQ(two.n, counts[2] + counts[5]);
  EXPECT_THROW(d.select_classes({10}), std::runtime_error);
}

TEST(DataLoader, WorkerErrorsAreRaisedByNext) {
  auto data = make_data(64);
  fd::LoaderOptions o;
  o.batch_size = 8;
  o.prefetch = 2;
  o.host_transform = [](flame::Tensor&, flame::Tensor&, fd::LoaderPosition p) {
    if (p.batch == 3) throw std::runtime_error("transform failed at batch 3");
  };
  fd::Loader loader(data, o);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(loader.next().position.batch, i);
  try {
    (void)loader.next();
    ADD_FAILURE() << "the worker's error was not raised";
  } catch (const flame::data::LoaderError& e) {
    // flame::data's message names the batch; the transform's own exception is nested in it.
    const std::string msg = e.what();
    EXPECT_NE(msg.find("batch 3 of epoch 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("transform failed at batch 3"), std::string::npos) << msg;
    try {
      std::rethrow_if_nested(e);
      ADD_FAILURE() << "no nested exception";
    } catch (const std::runtime_error& inner) {
      EXPECT_STREQ(inner.what(), "transform failed at batch 3");
    }
  }
  EXPECT_THROW((void)loader.next(), std::runtime_error);  // and stays raised
}

TEST(DataLoader, DestructorStopsABlockedWorker) {
  auto data = make_data(64);
  fd::LoaderOptions o;
  o.batch_size = 4;
  o.prefetch = 2;
  std::atomic<int> built{0};
  o.host_transform = [&](flame::Tensor&, flame::Tensor&, fd::LoaderPosition) { ++built; };
  const auto start = std::chrono::steady_clock::now();
  {
    fd::Loader loader(data, o);
    (void)loader.next();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the worker fills the queue and waits
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
  // The queue is bounded: one taken plus at most `prefetch` ready plus one being built.
  EXPECT_LE(built.load(), 4);
  EXPECT_GE(built.load(), 1);
}

TEST(DataLoader, BadOptionsAreRefused) {
  auto data = make_data(10);
  fd::LoaderOptions o;
  o.batch_size = 0;
  EXPECT_THROW((fd::Loader{data, o}), std::runtime_error);
  o.batch_size = 16;  // more than the data set, with drop_last: no batch at all
  try {
    fd::Loader l(data, o);
    ADD_FAILURE() << "accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("10 samples gives no batch of 16"), std::string::npos) << e.what();
  }
  o.batch_size = 4;
  EXPECT_THROW((fd::Loader{data, o, fd::LoaderPosition{0, 2}}), std::runtime_error);  // 2 batches per epoch
  EXPECT_THROW((fd::Loader{data, o, fd::LoaderPosition{-1, 0}}), std::runtime_error);
  EXPECT_THROW((fd::Loader{nullptr, o}), std::runtime_error);
}

// A real-data smoke run: the first batch of Fashion-MNIST through the prefetching loader.
TEST(DataLoader, FashionMnistBatchesOnTheTestDevice) {
  FD_SKIP_IF_NO_DEVICE();
  std::string dir;
  try {
    dir = fd::find_data_dir();
  } catch (const std::exception& e) {
    GTEST_SKIP() << "Fashion-MNIST not installed: " << e.what();
  }
  auto test = std::make_shared<const fd::Dataset>(fd::Dataset::load(dir, fd::Split::test));
  fd::LoaderOptions o;
  o.batch_size = 256;
  o.seed = 3;
  o.random_flip = true;
  o.device = test_device();
  fd::Loader loader(test, o);
  EXPECT_EQ(loader.batches_per_epoch(), 39);
  for (int i = 0; i < 3; ++i) {
    fd::Batch b = loader.next();
    EXPECT_EQ(b.images.sizes(), (flame::Shape{256, 1, 28, 28}));
    // Computed on the device: mean in [-1, 1] near the data set's (0.286 * 2 - 1), labels in 0..9.
    const double mean = b.images.mean().item<double>();
    EXPECT_NEAR(mean, 0.286 * 2 - 1, 0.08);
    EXPECT_GE(b.labels.min().item<int64_t>(), 0);
    EXPECT_LE(b.labels.max().item<int64_t>(), 9);
  }
}

// On CUDA the batch is uploaded on the loader's side stream; the caller's current stream (here a
// stream of the test's own) waits for it, so work queued there sees the uploaded values.
TEST(DataLoader, CudaBatchesAreReadyOnTheCallersStream) {
  if (!flame::cuda_is_available()) GTEST_SKIP() << "no CUDA device: CUDA case skipped";
  auto data = make_data(512, 4);
  fd::LoaderOptions o;
  o.batch_size = 64;
  o.seed = 8;
  o.random_flip = true;
  o.prefetch = 4;
  fd::Loader host(data, o);
  o.device = flame::Device::cuda(0);
  fd::Loader gpu(data, o);
  const flame::cuda::Stream compute = flame::cuda::Stream::create(0);
  flame::cuda::StreamGuard guard(compute);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let the worker run ahead
  for (int i = 0; i < 16; ++i) {
    fd::Batch g = gpu.next();
    fd::Batch h = host.next();
    ASSERT_TRUE(g.images.device().is_cuda());
    // Queued on `compute`, read back from it.
    const flame::Tensor doubled = g.images * 2.0;
    const std::vector<float> got = doubled.to_vec<float>();
    const std::vector<float> want = h.images.to_vec<float>();
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t k = 0; k < got.size(); ++k) ASSERT_EQ(got[k], want[k] * 2.0f) << "batch " << i << " element " << k;
    EXPECT_EQ(g.labels.to_vec<int64_t>(), h.labels.to_vec<int64_t>());
  }
}
