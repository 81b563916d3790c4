// Indexing ops beyond the op table: error messages, sort stability and NaN order, topk ties,
// one_hot inference, scatter with duplicate indices, masked_select with broadcast masks.
#include <cmath>
#include <limits>

#include "test_util.h"

namespace flame::test {
namespace {

constexpr float kNanF = std::numeric_limits<float>::quiet_NaN();
constexpr float kInfF = std::numeric_limits<float>::infinity();

Tensor longs(const std::vector<int64_t>& v, const Shape& s) { return Tensor::from_vec(v, s, test_device()); }
Tensor floats(const std::vector<float>& v, const Shape& s) { return Tensor::from_vec(v, s, test_device()); }
Tensor arange_f32(int64_t n, const Shape& s) {
  return Tensor::arange(n, {DType::f32, test_device()}).add_scalar(1).reshape(s);
}
bool on_cpu() { return test_device().is_cpu(); }

// Runs `fn` and reads its result, so that a deferred (CUDA) error surfaces inside expect_error.
void expect_read_error(const std::function<Tensor()>& fn, const std::vector<std::string>& parts) {
  expect_error([&] { fn().to_vec<double>(); }, parts);
}

// Same values, compared exactly (NaN equals NaN).
void expect_values(const Tensor& t, const std::vector<double>& want) {
  const std::vector<double> got = t.to_vec<double>();
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << "at " << i;
    } else {
      EXPECT_EQ(got[i], want[i]) << "at " << i;
    }
  }
}

TEST(IndexErrors, OutOfRangeNamesOpValueAndSize) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = arange_f32(15, {5, 3});
  expect_read_error([&] { return x.index_select(0, longs({1, 7}, {2})); }, {"index_select", "7", "5"});
  expect_read_error([&] { return x.index_select(1, longs({-1}, {1})); }, {"index_select", "-1", "3"});
  expect_read_error([&] { return x.gather(1, longs({0, 3}, {1, 2})); }, {"gather", "3"});
  expect_read_error([&] { return x.gather(0, longs({-2}, {1, 1})); }, {"gather", "-2", "5"});
  const Tensor src = arange_f32(3, {1, 3});
  expect_read_error([&] { return x.scatter(0, longs({0, 5, 1}, {1, 3}), src); }, {"scatter", "5"});
  expect_read_error([&] { return x.scatter_add(0, longs({0, -1, 1}, {1, 3}), src); }, {"scatter_add", "-1"});
  // Composite ops name themselves on the CPU; on CUDA the error comes from the kernel they use.
  auto parts = [](std::vector<std::string> p, const char* op) {
    if (on_cpu()) p.push_back(op);
    return p;
  };
  expect_read_error([&] { return x.take(longs({3, 25}, {2})); }, parts({"25"}, "take"));
  expect_read_error([&] { return x.take(longs({-16}, {1})); }, parts({}, "take"));
  expect_read_error([&] { return embedding(x, longs({1, 9}, {2})); }, parts({"9", "5"}, "embedding"));
  expect_read_error([&] { return one_hot(longs({1, 4}, {2}), 4); }, parts({"4"}, "one_hot"));
  expect_read_error([&] { return one_hot(longs({1, -2}, {2}), 4); }, parts({"-2"}, "one_hot"));
  // An index into a size-0 dim needs no data to be rejected.
  const Tensor empty = Tensor::zeros({0, 3}, test_device());
  expect_error([&] { empty.index_select(0, longs({0}, {1})); }, {"index_select", "size 0"});
  expect_error([&] { empty.gather(0, longs({0}, {1, 1})); }, {"gather", "size 0"});
}

TEST(IndexErrors, IndexDtype) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = arange_f32(6, {2, 3});
  const Tensor fidx = floats({0, 1}, {2});
  expect_error([&] { x.index_select(0, fidx); }, {"index_select", "f32"});
  expect_error([&] { x.gather(1, Tensor::zeros({2, 2}, {DType::boolean, test_device()})); }, {"gather", "bool"});
  expect_error([&] { x.scatter(1, Tensor::zeros({2, 2}, {DType::u8, test_device()}), x); }, {"scatter", "u8"});
  expect_error([&] { x.scatter_add(1, fidx.reshape({1, 2}), x); }, {"scatter_add", "f32"});
  expect_error([&] { x.take(fidx); }, {"take", "f32"});
  expect_error([&] { embedding(x, fidx); }, {"embedding", "f32"});
  expect_error([&] { one_hot(fidx, 3); }, {"one_hot", "f32"});
  // i32 indices are accepted everywhere.
  const Tensor i32 = longs({1, 0}, {2}).to(DType::i32);
  expect_values(x.index_select(0, i32), {4, 5, 6, 1, 2, 3});
  expect_values(one_hot(i32, 2), {0, 1, 1, 0});
}

TEST(IndexErrors, Shapes) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = arange_f32(12, {3, 4});
  expect_error([&] { x.index_select(0, longs({0, 1, 2, 0}, {2, 2})); }, {"index_select", "[2, 2]"});
  expect_error([&] { Tensor::scalar(1.0f, test_device()).index_select(0, longs({0, 0}, {2})); },
               {"index_select", "2"});
  expect_error([&] { x.index_select(2, longs({0}, {1})); }, {"index_select", "dim 2"});
  expect_error([&] { x.gather(0, longs({0, 1}, {2})); }, {"gather", "[3, 4]", "[2]"});
  expect_error([&] { x.gather(0, longs({0, 0, 0, 0, 0}, {1, 5})); }, {"gather", "[1, 5]", "dim 1"});
  expect_error([&] { x.scatter(0, longs({0, 0, 0}, {1, 3}), arange_f32(2, {1, 2})); }, {"scatter", "src", "[1, 2]"});
  expect_error([&] { x.scatter(0, longs({0}, {1, 1}), Tensor::ones({1, 1}, {DType::f64, test_device()})); },
               {"scatter", "f64", "f32"});
  expect_error([&] { x.scatter_add(0, longs({0}, {1}), arange_f32(1, {1})); }, {"scatter_add", "dims"});
  expect_error([&] { arange_f32(4, {4}).triu(); }, {"triu", "[4]"});
  expect_error([&] { Tensor::scalar(1.0f, test_device()).tril(); }, {"tril", "[]"});
  expect_error([&] { embedding(arange_f32(8, {2, 2, 2}), longs({0}, {1})); }, {"embedding", "[2, 2, 2]"});
  expect_error([&] { x.masked_select(Tensor::ones({3, 4}, {DType::u8, test_device()})); }, {"masked_select", "u8"});
  expect_error([&] { x.masked_select(Tensor::ones({3}, {DType::boolean, test_device()})); },
               {"masked_select", "[3, 4]", "[3]"});
  expect_error([&] { x.topk(5, -1); }, {"topk", "5", "4"});
  expect_error([&] { x.topk(-1, 0); }, {"topk", "-1"});
  expect_error([&] { x.sort(2); }, {"sort", "dim 2"});
  expect_error([&] { x.argsort(-3); }, {"sort", "-3"});
  expect_error([&] { one_hot(longs({}, {0}), -1); }, {"one_hot", "empty"});
  expect_error([&] { one_hot(longs({1}, {1}), -2); }, {"one_hot", "-2"});
}

TEST(IndexErrors, DeviceMismatch) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor x = arange_f32(6, {2, 3}).to(Device::cpu());
  const Tensor gi = Tensor::zeros({1, 3}, {DType::i64, Device::cuda(0)});
  expect_error([&] { x.index_select(0, gi.reshape({3})); }, {"index_select", "cpu", "cuda:0"});
  expect_error([&] { x.gather(0, gi); }, {"gather", "cpu", "cuda:0"});
  expect_error([&] { x.scatter(0, gi.to(Device::cpu()), x.to(Device::cuda(0))); }, {"scatter", "cpu", "cuda:0"});
  expect_error([&] { x.masked_select(Tensor::ones({3}, {DType::boolean, Device::cuda(0)})); },
               {"masked_select", "cpu", "cuda:0"});
  expect_error([&] { x.take(gi); }, {"take", "cpu", "cuda:0"});
  expect_error([&] { embedding(x, gi); }, {"embedding", "cpu", "cuda:0"});
}

TEST(IndexSort, StableWithDuplicates) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = floats({3, 1, 2, 1, 3, 1, 2}, {7});
  auto [v, i] = x.sort();
  expect_values(v, {1, 1, 1, 2, 2, 3, 3});
  expect_values(i, {1, 3, 5, 2, 6, 0, 4});
  auto [vd, id] = x.sort(0, true);
  expect_values(vd, {3, 3, 2, 2, 1, 1, 1});
  expect_values(id, {0, 4, 2, 6, 1, 3, 5});
  // Integer and bool dtypes, along a non-last dim of a transposed view.
  const Tensor xi = longs({3, 1, 2, 1, 3, 1, 2, 0, 0, 0, 0, 0, 0, 0}, {2, 7}).to(DType::i32).t();  // [7, 2]
  expect_values(xi.argsort(0), {1, 0, 3, 1, 5, 2, 2, 3, 6, 4, 0, 5, 4, 6});
  const Tensor b = longs({1, 0, 1, 0}, {4}).to(DType::boolean);
  expect_values(b.argsort(), {1, 3, 0, 2});
  expect_values(b.argsort(-1, true), {0, 2, 1, 3});
  // A long row with few distinct values: equal values keep increasing indices.
  const Tensor r = Tensor::randint(0, 4, {1000}, test_device());
  for (bool desc : {false, true}) {
    auto [sv, si] = r.sort(0, desc);
    const auto vals = sv.to_vec<int64_t>(), idx = si.to_vec<int64_t>(), orig = r.to_vec<int64_t>();
    for (std::size_t k = 0; k < vals.size(); ++k) {
      ASSERT_EQ(vals[k], orig[idx[k]]);
      if (k == 0) continue;
      ASSERT_TRUE(desc ? vals[k - 1] >= vals[k] : vals[k - 1] <= vals[k]);
      if (vals[k - 1] == vals[k]) ASSERT_LT(idx[k - 1], idx[k]) << "unstable at " << k;
    }
  }
}

TEST(IndexSort, NanOrdering) {
  FLAME_SKIP_IF_NO_DEVICE();
  const double nan = std::nan(""), inf = INFINITY;
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    const Tensor x = floats({kNanF, 1, -kInfF, kInfF, kNanF, 0}, {6}).to(dt);
    auto [v, i] = x.sort();
    expect_values(v, {-inf, 0, 1, inf, nan, nan});
    expect_values(i, {2, 5, 1, 3, 0, 4});
    auto [vd, id] = x.sort(-1, true);
    expect_values(vd, {nan, nan, inf, 1, 0, -inf});
    expect_values(id, {0, 4, 3, 1, 5, 2});
    // topk: NaN is the largest value.
    auto [tv, ti] = x.topk(3);
    expect_values(tv, {nan, nan, inf});
    expect_values(ti, {0, 4, 3});
    auto [sv, si] = x.topk(2, 0, false);
    expect_values(sv, {-inf, 0});
    expect_values(si, {2, 5});
  }
}

TEST(IndexSort, ZeroDimAndEmpty) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor s = Tensor::scalar(2.5f, test_device());
  for (int64_t dim : {0, -1}) {
    auto [v, i] = s.sort(dim);
    EXPECT_EQ(v.dim(), 0);
    EXPECT_EQ(i.dtype(), DType::i64);
    EXPECT_EQ(v.item<float>(), 2.5f);
    EXPECT_EQ(i.item<int64_t>(), 0);
    auto [tv, ti] = s.topk(1, dim);
    EXPECT_EQ(tv.item<float>(), 2.5f);
    EXPECT_EQ(ti.item<int64_t>(), 0);
  }
  expect_error([&] { s.sort(1); }, {"sort"});
  expect_error([&] { s.topk(2); }, {"topk", "2"});
  auto [ev, ei] = Tensor::zeros({3, 0}, test_device()).sort(0);
  EXPECT_EQ(ev.sizes(), (Shape{3, 0}));
  EXPECT_EQ(ei.sizes(), (Shape{3, 0}));
}

TEST(IndexTopk, TiesTakeLowerIndexFirst) {
  FLAME_SKIP_IF_NO_DEVICE();
  auto [v, i] = floats({1, 3, 3, 2, 3}, {5}).topk(2);
  expect_values(v, {3, 3});
  expect_values(i, {1, 2});
  auto [sv, si] = longs({2, 1, 1, 5, 1}, {5}).topk(2, 0, false);
  expect_values(sv, {1, 1});
  expect_values(si, {1, 2});
  EXPECT_EQ(sv.dtype(), DType::i64);
  // Along dim 0 of a 2-d tensor; results are contiguous.
  auto [cv, ci] = floats({1, 5, 4, 5, 4, 0}, {3, 2}).topk(2, 0);
  EXPECT_TRUE(cv.is_contiguous());
  expect_values(cv, {4, 5, 4, 5});
  expect_values(ci, {1, 0, 2, 1});
}

TEST(IndexOneHot, InfersClasses) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor h = one_hot(longs({0, 3, 1}, {3}));
  EXPECT_EQ(h.sizes(), (Shape{3, 4}));
  EXPECT_EQ(h.dtype(), DType::i64);
  expect_values(h, {1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0});
  const Tensor h2 = one_hot(longs({2, 0}, {2, 1}), 5);
  EXPECT_EQ(h2.sizes(), (Shape{2, 1, 5}));
  expect_values(h2, {0, 0, 1, 0, 0, 1, 0, 0, 0, 0});
  const Tensor h3 = one_hot(longs({0, 0}, {2}));
  EXPECT_EQ(h3.sizes(), (Shape{2, 1}));
  EXPECT_EQ(one_hot(longs({}, {0}), 0).sizes(), (Shape{0, 0}));
  EXPECT_EQ(one_hot(longs({}, {0, 2}), 3).sizes(), (Shape{0, 2, 3}));
}

TEST(IndexScatter, DuplicatesAndFunctional) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = Tensor::zeros({3}, test_device());
  const uint64_t version = x.version();
  const Tensor index = longs({0, 0, 0, 2}, {4});
  const Tensor src = floats({1, 2, 3, 4}, {4});
  const auto got = x.scatter(0, index, src).to_vec<float>();
  if (on_cpu()) {
    EXPECT_EQ(got[0], 3.0f);  // last write wins on the CPU (Note [Scatter duplicates])
  } else {
    EXPECT_TRUE(got[0] == 1.0f || got[0] == 2.0f || got[0] == 3.0f) << got[0];
  }
  EXPECT_EQ(got[1], 0.0f);
  EXPECT_EQ(got[2], 4.0f);
  expect_values(x.scatter_add(0, index, src), {6, 0, 4});
  // Functional: the input is neither changed nor marked as written.
  expect_values(x, {0, 0, 0});
  EXPECT_EQ(x.version(), version);
  // 2-d: the destination row comes from the index, the column from the position.
  const Tensor y = Tensor::zeros({2, 3}, {DType::i64, test_device()});
  const Tensor r = y.scatter_add(0, longs({1, 0, 1, 1, 1, 0}, {2, 3}), longs({1, 2, 3, 4, 5, 6}, {2, 3}));
  expect_values(r, {0, 2, 6, 5, 5, 3});
}

TEST(IndexMaskedSelect, BroadcastMask) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = arange_f32(6, {2, 3});
  const Tensor row = Tensor::from_vec(std::vector<bool>{true, false, true}, {3}, test_device());
  expect_values(x.masked_select(row), {1, 3, 4, 6});
  const Tensor col = Tensor::from_vec(std::vector<bool>{true, false}, {2, 1}, test_device());
  expect_values(x.masked_select(col), {1, 2, 3});
  // The input broadcasts too: [3] against a [2, 3] mask.
  const Tensor m = Tensor::from_vec(std::vector<bool>{true, false, true, false, true, false}, {2, 3}, test_device());
  expect_values(arange_f32(3, {3}).masked_select(m), {1, 3, 2});
  // Row-major order of the (transposed) input's logical layout.
  expect_values(x.t().masked_select(Tensor::ones({3, 2}, {DType::boolean, test_device()})), {1, 4, 2, 5, 3, 6});
  const Tensor none = x.masked_select(Tensor::zeros({2, 3}, {DType::boolean, test_device()}));
  EXPECT_EQ(none.sizes(), (Shape{0}));
  EXPECT_EQ(none.dtype(), DType::f32);
}

TEST(IndexTake, NegativeIndicesWrap) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = arange_f32(6, {2, 3});
  const Tensor t = x.take(longs({-1, 0, -6, 5}, {2, 2}));
  EXPECT_EQ(t.sizes(), (Shape{2, 2}));
  expect_values(t, {6, 1, 1, 6});
  expect_values(x.t().take(longs({1, -1}, {2})), {4, 6});
}

TEST(IndexSelect, StridedIndexAndValues) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = arange_f32(12, {3, 4});
  const Tensor index = longs({2, 9, 0, 9, 2}, {5}).to(DType::i32).slice(0, 0, 5, 2);  // [2, 0, 2]
  expect_values(x.index_select(0, index), {9, 10, 11, 12, 1, 2, 3, 4, 9, 10, 11, 12});
  expect_values(x.index_select(-1, index), {3, 1, 3, 7, 5, 7, 11, 9, 11});
  expect_values(x.gather(1, longs({3, 0, 1, 1, 2, 2}, {3, 2})), {4, 1, 6, 6, 11, 11});
}

TEST(IndexTriangle, Values) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = arange_f32(9, {3, 3});
  expect_values(x.triu(), {1, 2, 3, 0, 5, 6, 0, 0, 9});
  expect_values(x.tril(), {1, 0, 0, 4, 5, 0, 7, 8, 9});
  expect_values(x.triu(1), {0, 2, 3, 0, 0, 6, 0, 0, 0});
  expect_values(x.tril(-1), {0, 0, 0, 4, 0, 0, 7, 8, 0});
  const Tensor b = Tensor::ones({2, 2}, {DType::boolean, test_device()}).triu();
  EXPECT_EQ(b.dtype(), DType::boolean);
  expect_values(b, {1, 1, 0, 1});
}

TEST(IndexEmbedding, LooksUpRows) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor w = arange_f32(8, {4, 2});
  const Tensor e = embedding(w, longs({3, 0, 3}, {1, 3}));
  EXPECT_EQ(e.sizes(), (Shape{1, 3, 2}));
  expect_values(e, {7, 8, 1, 2, 7, 8});
  EXPECT_EQ(embedding(w, longs({1}, {})).sizes(), (Shape{2}));
}

}  // namespace
}  // namespace flame::test
