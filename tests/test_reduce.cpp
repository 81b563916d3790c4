// Reductions: errors (each names its op), dtype rules and special values (NaN, ties, empty
// reductions, var with correction >= N, numerically stable softmax/logsumexp). Values are checked
// against hand-computed results; the op table (cases_reduce.cpp) covers random inputs.
#include <cmath>
#include <limits>

#include "test_util.h"

namespace flame::test {
namespace {

constexpr float kNanF = std::numeric_limits<float>::quiet_NaN();
constexpr float kInfF = std::numeric_limits<float>::infinity();

Tensor vec(const std::vector<float>& v, const Shape& shape) {
  return Tensor::from_vec(v, shape, test_device());
}
Tensor vec(const std::vector<float>& v) { return vec(v, {static_cast<int64_t>(v.size())}); }

// ---- errors ----

TEST(Reduce, DimErrorsNameTheOp) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = Tensor::ones({2, 3}, test_device());
  expect_error([&] { sum(x, {2}); }, {"sum", "dim 2", "out of range"});
  expect_error([&] { mean(x, {-3}); }, {"mean", "out of range"});
  expect_error([&] { prod(x, {0, -2}); }, {"prod", "more than once"});
  expect_error([&] { amax(x, {1, 1}); }, {"amax", "more than once"});
  expect_error([&] { amin(x, {5}); }, {"amin", "out of range"});
  expect_error([&] { argmax(x, 2); }, {"argmax", "out of range"});
  expect_error([&] { argmin(x, -3); }, {"argmin", "out of range"});
  expect_error([&] { var(x, {7}); }, {"var", "out of range"});
  expect_error([&] { flame::std(x, {0, 0}); }, {"std", "more than once"});
  expect_error([&] { norm(x, 2.0, {3}); }, {"norm", "out of range"});
  expect_error([&] { logsumexp(x, {1, -1}); }, {"logsumexp", "more than once"});
  expect_error([&] { any(x, {2}); }, {"any", "out of range"});
  expect_error([&] { all(x, {-4}); }, {"all", "out of range"});
  expect_error([&] { cumsum(x, 2); }, {"cumsum", "out of range"});
  expect_error([&] { softmax(x, -3); }, {"softmax", "out of range"});
  expect_error([&] { log_softmax(x, 2); }, {"log_softmax", "out of range"});
  expect_error([&] { sum(Tensor(), {}); }, {"sum", "undefined"});
}

TEST(Reduce, ZeroDimInputDims) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor s = Tensor::scalar(2.5f, test_device());
  EXPECT_EQ(sum(s).dim(), 0);
  EXPECT_EQ(sum(s, {0}).item<float>(), 2.5f);
  EXPECT_EQ(sum(s, {-1}, true).dim(), 0);
  EXPECT_EQ(argmax(s).item<int64_t>(), 0);
  EXPECT_EQ(argmin(s, 0).item<int64_t>(), 0);
  EXPECT_EQ(softmax(s, 0).item<float>(), 1.0f);
  EXPECT_EQ(log_softmax(s, -1).item<float>(), 0.0f);
  EXPECT_EQ(cumsum(s, 0).item<float>(), 2.5f);
  EXPECT_EQ(cumsum(s, 0).dim(), 0);
  EXPECT_TRUE(std::isnan(var(s).item<float>()));  // one element, correction 1
  EXPECT_EQ(var(s, {}, 0).item<float>(), 0.0f);
  expect_error([&] { sum(s, {1}); }, {"sum", "out of range"});
  expect_error([&] { sum(s, {0, -1}); }, {"sum", "more than once"});
  expect_error([&] { cumsum(s, 1); }, {"cumsum", "out of range"});
}

TEST(Reduce, FloatingOnlyOpsRejectIntegers) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor i = Tensor::ones({2, 3}, {DType::i64, test_device()});
  const Tensor b = Tensor::ones({4}, {DType::boolean, test_device()});
  expect_error([&] { mean(i); }, {"mean", "floating", "i64"});
  expect_error([&] { mean(b, {0}); }, {"mean", "floating", "bool"});
  expect_error([&] { var(i); }, {"var", "floating"});
  expect_error([&] { flame::std(i); }, {"std", "floating"});
  expect_error([&] { norm(i); }, {"norm", "floating"});
  expect_error([&] { logsumexp(i, {0}); }, {"logsumexp", "floating"});
  expect_error([&] { softmax(i, 0); }, {"softmax", "floating"});
  expect_error([&] { log_softmax(i.to(DType::i32), 1); }, {"log_softmax", "floating", "i32"});
}

TEST(Reduce, NoIdentityOverEmptyExtentIsAnError) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = Tensor::zeros({2, 0}, test_device());
  expect_error([&] { amax(x, {1}); }, {"amax", "size 0", "[2, 0]"});
  expect_error([&] { amin(x); }, {"amin", "size 0", "[2, 0]"});
  expect_error([&] { x.max({-1}); }, {"amax", "[2, 0]"});
  expect_error([&] { argmax(x); }, {"argmax", "size 0", "[2, 0]"});
  expect_error([&] { argmin(x, 1); }, {"argmin", "size 0", "[2, 0]"});
  expect_error([&] { norm(x, INFINITY, {1}); }, {"norm", "size 0", "[2, 0]"});
  expect_error([&] { norm(x, -INFINITY); }, {"norm", "size 0"});
  // The extent reduced over dim 0 has 2 elements: an empty result, no error.
  EXPECT_EQ(amax(x, {0}).sizes(), (Shape{0}));
  EXPECT_EQ(argmax(x, 0, true).sizes(), (Shape{1, 0}));
}

// ---- dtypes and shapes ----

TEST(Reduce, ResultDtypes) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device d = test_device();
  const Tensor i32 = Tensor::full({2, 3}, 3, {DType::i32, d});
  const Tensor bl = Tensor::ones({2, 3}, {DType::boolean, d});
  const Tensor u8 = Tensor::full({2, 3}, 200, {DType::u8, d});
  const Tensor bf = Tensor::ones({2, 3}, {DType::bf16, d});
  EXPECT_EQ(sum(i32).dtype(), DType::i64);
  EXPECT_EQ(sum(i32).item<int64_t>(), 18);
  EXPECT_EQ(sum(bl, {1}).dtype(), DType::i64);
  EXPECT_EQ(sum(u8).item<int64_t>(), 1200);  // no u8 wrap-around
  EXPECT_EQ(prod(bl).dtype(), DType::i64);
  EXPECT_EQ(prod(i32).item<int64_t>(), 729);
  EXPECT_EQ(sum(bf).dtype(), DType::bf16);
  EXPECT_EQ(mean(bf, {0}).dtype(), DType::bf16);
  EXPECT_EQ(amax(i32).dtype(), DType::i32);
  EXPECT_EQ(amin(bl).dtype(), DType::boolean);
  EXPECT_EQ(argmax(bf).dtype(), DType::i64);
  EXPECT_EQ(any(bf).dtype(), DType::boolean);
  EXPECT_EQ(all(i32, {1}).dtype(), DType::boolean);
  EXPECT_EQ(cumsum(bl, 1).dtype(), DType::i64);
  EXPECT_EQ(cumsum(u8, 0).to_vec<int64_t>(), (std::vector<int64_t>{200, 200, 200, 400, 400, 400}));
  EXPECT_EQ(cumsum(bf, 1).dtype(), DType::bf16);
  EXPECT_EQ(var(bf).dtype(), DType::bf16);
  EXPECT_EQ(norm(bf).dtype(), DType::bf16);
  EXPECT_EQ(logsumexp(bf, {1}).dtype(), DType::bf16);
  EXPECT_EQ(softmax(bf, 1).dtype(), DType::bf16);
}

TEST(Reduce, KeepdimShapes) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = Tensor::randn({2, 3, 4}, 0.0, 1.0, test_device());
  EXPECT_EQ(sum(x, {1}, true).sizes(), (Shape{2, 1, 4}));
  EXPECT_EQ(sum(x, {1}).sizes(), (Shape{2, 4}));
  EXPECT_EQ(mean(x, {-1, 0}, true).sizes(), (Shape{1, 3, 1}));
  EXPECT_EQ(amax(x, {}, true).sizes(), (Shape{1, 1, 1}));
  EXPECT_EQ(amax(x).sizes(), (Shape{}));
  EXPECT_EQ(argmax(x, std::nullopt, true).sizes(), (Shape{1, 1, 1}));
  EXPECT_EQ(argmin(x, -2, true).sizes(), (Shape{2, 1, 4}));
  EXPECT_EQ(var(x, {0, 2}, 1, true).sizes(), (Shape{1, 3, 1}));
  EXPECT_EQ(logsumexp(x, {2}, true).sizes(), (Shape{2, 3, 1}));
  EXPECT_EQ(logsumexp(x, {2}).sizes(), (Shape{2, 3}));
  EXPECT_EQ(norm(x, 2.0, {1}, true).sizes(), (Shape{2, 1, 4}));
  EXPECT_EQ(any(x, {0, 1, 2}).sizes(), (Shape{}));
}

TEST(Reduce, KnownValues) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = vec({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(sum(x, {0}).to_vec<float>(), (std::vector<float>{5, 7, 9}));
  EXPECT_EQ(sum(x, {1}).to_vec<float>(), (std::vector<float>{6, 15}));
  EXPECT_EQ(mean(x, {1}).to_vec<float>(), (std::vector<float>{2, 5}));
  EXPECT_EQ(prod(x, {1}).to_vec<float>(), (std::vector<float>{6, 120}));
  EXPECT_EQ(amax(x, {0}).to_vec<float>(), (std::vector<float>{4, 5, 6}));
  EXPECT_EQ(argmin(x, 1).to_vec<int64_t>(), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(argmax(x).item<int64_t>(), 5);
  EXPECT_FLOAT_EQ(var(x, {1}).to_vec<float>()[1], 1.0f);
  EXPECT_FLOAT_EQ(flame::std(x, {1}, 0).to_vec<float>()[0], std::sqrt(2.0f / 3.0f));
  EXPECT_EQ(cumsum(x, 1).to_vec<float>(), (std::vector<float>{1, 3, 6, 4, 9, 15}));
  EXPECT_EQ(cumsum(x, 0).to_vec<float>(), (std::vector<float>{1, 2, 3, 5, 7, 9}));
  // Transposed (non-contiguous) input: argmax over the flattened logical order.
  const Tensor t = x.t();  // [[1, 4], [2, 5], [3, 6]]
  EXPECT_EQ(argmax(t).item<int64_t>(), 5);
  EXPECT_EQ(argmax(t, 1).to_vec<int64_t>(), (std::vector<int64_t>{1, 1, 1}));
  EXPECT_EQ(cumsum(t, 0).to_vec<float>(), (std::vector<float>{1, 4, 3, 9, 6, 15}));
}

TEST(Reduce, NormOrders) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = vec({0, 3, -4});
  EXPECT_FLOAT_EQ(norm(x).item<float>(), 5.0f);
  EXPECT_FLOAT_EQ(norm(x, 1.0).item<float>(), 7.0f);
  EXPECT_FLOAT_EQ(norm(x, INFINITY).item<float>(), 4.0f);
  EXPECT_FLOAT_EQ(norm(x, -INFINITY).item<float>(), 0.0f);
  EXPECT_FLOAT_EQ(norm(x, 0.0).item<float>(), 2.0f);
  EXPECT_NEAR(norm(x, 3.0).item<float>(), std::cbrt(91.0f), 1e-5);
  EXPECT_FLOAT_EQ(norm(x, -1.0).item<float>(), 0.0f);  // 1/(1/0 + ...) = 0, as PyTorch
  EXPECT_FLOAT_EQ(norm(Tensor::zeros({0}, test_device())).item<float>(), 0.0f);
}

// ---- special values ----

TEST(Reduce, MaxMinPropagateNan) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = vec({1, kNanF, 3, -2, 0, 5}, {2, 3});
  EXPECT_TRUE(std::isnan(amax(x).item<float>()));
  EXPECT_TRUE(std::isnan(amin(x).item<float>()));
  const auto rows = amax(x, {1}).to_vec<float>();
  EXPECT_TRUE(std::isnan(rows[0]));
  EXPECT_EQ(rows[1], 5.0f);
  const auto cols = amin(x, {0}).to_vec<float>();
  EXPECT_EQ(cols[0], -2.0f);
  EXPECT_TRUE(std::isnan(cols[1]));
  EXPECT_EQ(cols[2], 3.0f);
  // A NaN after the maximum still wins.
  EXPECT_TRUE(std::isnan(amax(vec({9, 1, kNanF})).item<float>()));
  EXPECT_TRUE(std::isnan(norm(vec({1, kNanF}), INFINITY).item<float>()));
  EXPECT_TRUE(std::isnan(amax(vec({kNanF, 1}).to(DType::bf16)).item<float>()));
}

TEST(Reduce, ArgmaxArgminFirstNanAndTies) {
  FLAME_SKIP_IF_NO_DEVICE();
  EXPECT_EQ(argmax(vec({1, kNanF, 5, kNanF})).item<int64_t>(), 1);
  EXPECT_EQ(argmin(vec({1, 0, kNanF, kNanF})).item<int64_t>(), 2);
  EXPECT_EQ(argmax(vec({3, 1, 3, 2})).item<int64_t>(), 0);
  EXPECT_EQ(argmin(vec({2, 1, 4, 1})).item<int64_t>(), 1);
  EXPECT_EQ(argmax(vec({-kInfF, -kInfF})).item<int64_t>(), 0);
  const Tensor m = vec({7, 7, 2, 2, 9, 9}, {3, 2});
  EXPECT_EQ(argmax(m, 1).to_vec<int64_t>(), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(argmin(m, 0).to_vec<int64_t>(), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(argmax(m).item<int64_t>(), 4);
  const Tensor ints = Tensor::from_vec(std::vector<int64_t>{4, 9, 9, 1, 1}, {5}, test_device());
  EXPECT_EQ(argmax(ints).item<int64_t>(), 1);
  EXPECT_EQ(argmin(ints).item<int64_t>(), 3);
}

TEST(Reduce, EmptyReductionsGiveIdentities) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device d = test_device();
  const Tensor e = Tensor::zeros({0}, d);
  EXPECT_EQ(sum(e).item<float>(), 0.0f);
  EXPECT_EQ(prod(e).item<float>(), 1.0f);
  EXPECT_FALSE(any(e).item<bool>());
  EXPECT_TRUE(all(e).item<bool>());
  EXPECT_TRUE(std::isnan(mean(e).item<float>()));
  EXPECT_TRUE(std::isnan(var(e).item<float>()));
  EXPECT_EQ(logsumexp(e, {0}).item<float>(), -kInfF);
  EXPECT_EQ(sum(Tensor::zeros({0}, {DType::i32, d})).item<int64_t>(), 0);
  EXPECT_EQ(prod(Tensor::zeros({0}, {DType::boolean, d})).item<int64_t>(), 1);
  // A [2, 0, 3] tensor reduced over its empty dim: one identity per kept element.
  const Tensor z = Tensor::zeros({2, 0, 3}, d);
  EXPECT_EQ(sum(z, {1}).sizes(), (Shape{2, 3}));
  EXPECT_EQ(sum(z, {1}).to_vec<float>(), std::vector<float>(6, 0.0f));
  EXPECT_EQ(prod(z, {1}, true).sizes(), (Shape{2, 1, 3}));
  EXPECT_EQ(prod(z, {1}).to_vec<float>(), std::vector<float>(6, 1.0f));
  EXPECT_EQ(all(z, {0, 1}).to_vec<bool>(), std::vector<bool>(3, true));
  for (float v : mean(z, {1}).to_vec<float>()) EXPECT_TRUE(std::isnan(v));
  for (float v : logsumexp(z, {1}).to_vec<float>()) EXPECT_EQ(v, -kInfF);
  EXPECT_EQ(sum(z, {2}).sizes(), (Shape{2, 0}));
  EXPECT_EQ(cumsum(z, 1).sizes(), (Shape{2, 0, 3}));
  EXPECT_EQ(softmax(z, 2).sizes(), (Shape{2, 0, 3}));
}

TEST(Reduce, VarWithCorrectionAtLeastN) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = vec({1, 2});
  EXPECT_FLOAT_EQ(var(x, {}, 0).item<float>(), 0.25f);
  EXPECT_FLOAT_EQ(var(x).item<float>(), 0.5f);
  EXPECT_EQ(var(x, {}, 2).item<float>(), kInfF);  // 0.5 / max(0, 2 - 2)
  EXPECT_EQ(var(x, {}, 3).item<float>(), kInfF);
  EXPECT_EQ(flame::std(x, {}, 5).item<float>(), kInfF);
  EXPECT_TRUE(std::isnan(var(vec({4})).item<float>()));  // 0 / 0
  EXPECT_TRUE(std::isnan(flame::std(vec({4, 4}), {}, 2).item<float>()));
  // Per row: [3, 3] has zero spread (nan), [1, 5] does not (inf).
  const auto rows = var(vec({3, 3, 1, 5}, {2, 2}), {1}, 2).to_vec<float>();
  EXPECT_TRUE(std::isnan(rows[0]));
  EXPECT_EQ(rows[1], kInfF);
  // A negative correction enlarges the divisor.
  EXPECT_FLOAT_EQ(var(x, {}, -2).item<float>(), 0.125f);
}

TEST(Reduce, VarIsAccurateForLargeOffsets) {
  FLAME_SKIP_IF_NO_DEVICE();
  // Two-pass (mean first) variance keeps precision when values share a large offset.
  const Tensor x = vec({1e4f + 1, 1e4f + 2, 1e4f + 3, 1e4f + 4});
  EXPECT_NEAR(var(x).item<float>(), 5.0f / 3.0f, 1e-4);
}

TEST(Reduce, SoftmaxIsStableForLargeInputs) {
  FLAME_SKIP_IF_NO_DEVICE();
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    // Large values (1000 overflows exp in every dtype) in rows of 1000 elements.
    const double big = dt == DType::f16 ? 6e4 : 1000.0;
    const Tensor x = Tensor::uniform({3, 1000}, big - 5, big, {DType::f64, test_device()}).to(dt);
    const Tensor s = softmax(x, 1);
    const auto rows = sum(s.to(DType::f64), {1}).to_vec<double>();
    for (double r : rows) EXPECT_NEAR(r, 1.0, dt == DType::f32 || dt == DType::f64 ? 1e-5 : 2e-2);
    for (double v : s.to_vec<double>()) {
      EXPECT_TRUE(std::isfinite(v));
      EXPECT_GE(v, 0.0);
    }
    for (double v : log_softmax(x, 1).to_vec<double>()) {
      EXPECT_TRUE(std::isfinite(v));
      EXPECT_LE(v, 0.0);
    }
    // Along dim 0 of the transpose: the same rows.
    const auto cols = sum(softmax(x.t(), 0).to(DType::f64), {0}).to_vec<double>();
    for (double r : cols) EXPECT_NEAR(r, 1.0, dt == DType::f32 || dt == DType::f64 ? 1e-5 : 2e-2);
  }
  const auto s = softmax(vec({1000, 1000, -1000}), 0).to_vec<float>();
  EXPECT_FLOAT_EQ(s[0], 0.5f);
  EXPECT_FLOAT_EQ(s[1], 0.5f);
  EXPECT_EQ(s[2], 0.0f);
  const auto ls = log_softmax(vec({1000, 1000}), 0).to_vec<float>();
  EXPECT_FLOAT_EQ(ls[0], -std::log(2.0f));
}

TEST(Reduce, SoftmaxInfinities) {
  FLAME_SKIP_IF_NO_DEVICE();
  const auto s = softmax(vec({-kInfF, 0, -kInfF}), 0).to_vec<float>();
  EXPECT_EQ(s, (std::vector<float>{0, 1, 0}));
  const auto ls = log_softmax(vec({-kInfF, 0}), 0).to_vec<float>();
  EXPECT_EQ(ls[0], -kInfF);
  EXPECT_EQ(ls[1], 0.0f);
  // A row of only -inf has no distribution: nan, as PyTorch.
  for (float v : softmax(vec({-kInfF, -kInfF}), 0).to_vec<float>()) EXPECT_TRUE(std::isnan(v));
  for (float v : softmax(vec({1, kNanF}), 0).to_vec<float>()) EXPECT_TRUE(std::isnan(v));
}

TEST(Reduce, LogsumexpStability) {
  FLAME_SKIP_IF_NO_DEVICE();
  EXPECT_NEAR(logsumexp(vec({1000, 1000}), {0}).item<float>(), 1000.0f + std::log(2.0f), 1e-3);
  EXPECT_NEAR(logsumexp(vec({-1000, -1000}), {0}).item<float>(), -1000.0f + std::log(2.0f), 1e-3);
  EXPECT_EQ(logsumexp(vec({-kInfF, -kInfF}), {0}).item<float>(), -kInfF);
  EXPECT_EQ(logsumexp(vec({1, kInfF}), {0}).item<float>(), kInfF);
  EXPECT_NEAR(logsumexp(vec({-kInfF, 0}), {0}).item<float>(), 0.0f, 1e-6);
  EXPECT_TRUE(std::isnan(logsumexp(vec({1, kNanF}), {0}).item<float>()));
  const auto rows = logsumexp(vec({-kInfF, -kInfF, 0, 0}, {2, 2}), {1}).to_vec<float>();
  EXPECT_EQ(rows[0], -kInfF);
  EXPECT_NEAR(rows[1], std::log(2.0f), 1e-6);
  // bf16 inputs compute in f32: no overflow for values near bf16's exp limit.
  EXPECT_NEAR(logsumexp(vec({500, 500}).to(DType::bf16), {0}).item<float>(), 500.0f, 4.0f);
}

TEST(Reduce, AnyAllOnFloatsAndNan) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = vec({0, 0, 0.5f, kNanF, 0, -1}, {3, 2});
  EXPECT_EQ(any(x, {1}).to_vec<bool>(), (std::vector<bool>{false, true, true}));
  EXPECT_EQ(all(x, {1}).to_vec<bool>(), (std::vector<bool>{false, true, false}));
  EXPECT_TRUE(any(x).item<bool>());
  EXPECT_FALSE(all(x).item<bool>());
}

TEST(Reduce, HalfMeanDividesBeforeRounding) {
  FLAME_SKIP_IF_NO_DEVICE();
  // The f16 sum of 100 x 1000 overflows (65504 is f16's max), the f16 mean does not: the kernel
  // divides in its accumulation type and rounds once.
  const Tensor x = Tensor::full({100}, 1000.0, {DType::f16, test_device()});
  EXPECT_EQ(mean(x).item<float>(), 1000.0f);
  EXPECT_EQ(sum(x).item<float>(), kInfF);
  EXPECT_NEAR(var(x).item<float>(), 0.0f, 1e-3);
  // 30000^2 overflows f16 but the norm, 30000 * sqrt(3), does not.
  EXPECT_NEAR(norm(Tensor::full({3}, 30000.0, {DType::f16, test_device()})).item<float>(), 51961.5f, 32.0f);
  // bf16: 4096 ones and one 2 sum to 4098, which rounds to 4096 in bf16.
  std::vector<float> v(4097, 1.0f);
  v.back() = 2.0f;
  const Tensor b = vec(v).to(DType::bf16);
  EXPECT_EQ(sum(b).item<float>(), 4096.0f);
  EXPECT_EQ(mean(b).item<float>(), 1.0f);
}

TEST(Reduce, IntegerSumsDoNotLosePrecision) {
  FLAME_SKIP_IF_NO_DEVICE();
  const int64_t big = (int64_t{1} << 53) + 1;  // not representable in double
  const Tensor x = Tensor::from_vec(std::vector<int64_t>{big, 1, -1}, {3}, test_device());
  EXPECT_EQ(sum(x).item<int64_t>(), big);
  EXPECT_EQ(cumsum(x, 0).to_vec<int64_t>(), (std::vector<int64_t>{big, big + 1, big}));
  EXPECT_EQ(amax(x).item<int64_t>(), big);
}

}  // namespace
}  // namespace flame::test
