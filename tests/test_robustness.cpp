// Bad input never crashes: overflowing shapes and arguments raise flame::Error naming the op;
// integer arithmetic and float -> integer conversion are defined (Note [Defined integer math]).
// Several of these cases crashed, trapped or corrupted memory before the checks existed; the
// rest are undefined behaviour that the sanitizer build (docs/testing-robustness.md) reports.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>

#include "flame/flame.h"
#include "test_util.h"

namespace flame {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
// (2^62 + 1) * 4 wraps to 4 in int64: a shape that a wrapping product takes for 4 elements.
constexpr int64_t kWrapsTo4 = (int64_t(1) << 62) + 1;

// Runs f, expects a flame::Error whose message starts with "op:" (and contains `part`, if given).
template <class F>
void expect_error(F&& f, const std::string& op, const std::string& part = "") {
  try {
    f();
    ADD_FAILURE() << "expected flame::Error from " << op;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(op + ":", 0), 0u) << "message names the wrong op: " << msg;
    if (!part.empty()) EXPECT_NE(msg.find(part), std::string::npos) << msg;
  }
}

Device dev() { return test::test_device(); }

std::mt19937_64& rng() {
  static std::mt19937_64 g(std::random_device{}());
  return g;
}
int64_t rand_int(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng()); }

// ---- shape products, strides, byte sizes ----

TEST(Robustness, FactoryShapeOverflowRaises) {
  FLAME_SKIP_IF_NO_DEVICE();
  const int64_t big = int64_t(1) << 32;
  expect_error([&] { Tensor::zeros({big, big}, dev()); }, "zeros", "[4294967296, 4294967296]");
  expect_error([&] { Tensor::ones({kWrapsTo4, 4}, dev()); }, "ones");
  expect_error([&] { Tensor::full({big, big, 3}, 1.5, dev()); }, "full");
  expect_error([&] { Tensor::empty({kMax, 2}, dev()); }, "empty");
  // The element count fits but the bytes do not (2^61 x 8 bytes).
  expect_error([&] { Tensor::zeros({int64_t(1) << 61}, {DType::f64, dev()}); }, "zeros", "bytes");
  // No elements, but the strides of the other dims overflow.
  expect_error([&] { Tensor::zeros({0, big, big}, dev()); }, "zeros");
  expect_error([&] { Tensor::randn({big, big}, 0.0, 1.0, dev()); }, "randn");
  expect_error([&] { Tensor::randint(0, 5, {big, big}, dev()); }, "randint");
  expect_error([&] { Tensor::eye(big, big, dev()); }, "eye");
}

TEST(Robustness, LinspaceAndArangeLengthsAreChecked) {
  FLAME_SKIP_IF_NO_DEVICE();
  // Old code: steps x 4 bytes wrapped, a tiny buffer was allocated and written past its end.
  expect_error([&] { Tensor::linspace(0.0, 1.0, kMax, dev()); }, "linspace");
  expect_error([&] { Tensor::arange(kMin, kMax, 1, dev()); }, "arange");
  expect_error([&] { Tensor::arange(0.0, 1e30, 1e-30, dev()); }, "arange");
  expect_error([&] { Tensor::arange(0.0, INFINITY, 1.0, dev()); }, "arange");
  // end - start + step - 1 overflowed int64 here: 3 elements, 0, step, 2 step.
  const int64_t step = kMax / 2;
  Tensor a = Tensor::arange(0, kMax, step, dev());
  ASSERT_EQ(a.numel(), 3);
  const auto v = a.to_vec<int64_t>();
  EXPECT_EQ(v[0], 0);
  EXPECT_GT(v[1], 0);
  EXPECT_GT(v[2], v[1]);
  // Exact counts for ordinary integer ranges, both directions.
  const int64_t lo = rand_int(-1000, 1000), n = rand_int(1, 50), st = rand_int(1, 7);
  EXPECT_EQ(Tensor::arange(lo, lo + n, st, dev()).numel(), (n + st - 1) / st);
  EXPECT_EQ(Tensor::arange(lo + n, lo, -st, dev()).numel(), (n + st - 1) / st);
}

TEST(Robustness, AllocationFailureNamesOpAndShape) {
  FLAME_SKIP_IF_NO_DEVICE();
  // 2^58 floats = 2^60 bytes: under the size limit, beyond any machine's memory.
  const int64_t n = int64_t(1) << 58;
  expect_error([&] { Tensor::ones({n}, dev()); }, "ones", "[288230376151711744]");
}

// ---- view and join argument arithmetic ----

TEST(Robustness, ReshapeAndUnflattenRejectWrappingProducts) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = Tensor::randn({4}, 0.0, 1.0, dev());
  // The product (2^62 + 1) * 4 wraps to 4 = numel: old code accepted a view far past the storage.
  expect_error([&] { x.reshape({kWrapsTo4, 4}); }, "reshape");
  expect_error([&] { x.view({kWrapsTo4, 4}); }, "view");
  expect_error([&] { x.unflatten(0, {kWrapsTo4, 4}); }, "unflatten");
  expect_error([&] { x.reshape({-1, kWrapsTo4, 4}); }, "reshape");
  // 2^32 x 2^32 wraps to 0 = numel of an empty tensor.
  Tensor e = Tensor::zeros({0}, dev());
  expect_error([&] { e.reshape({int64_t(1) << 32, int64_t(1) << 32}); }, "reshape");
}

TEST(Robustness, NarrowSliceUnfoldLargeArguments) {
  FLAME_SKIP_IF_NO_DEVICE();
  const int64_t n = rand_int(5, 12);
  Tensor x = Tensor::arange(0, 3 * n, 1, dev()).reshape({3, n});
  // start + length overflowed and passed the bounds check.
  expect_error([&] { x.narrow(1, 2, kMax); }, "narrow");
  expect_error([&] { x.narrow(1, kMax, 2); }, "narrow");
  // A huge step selects one element; its stride x step (x element size) overflowed.
  const int64_t start = rand_int(0, n - 1);
  Tensor s = x.slice(1, start, n, kMax);
  ASSERT_EQ(s.sizes(), (Shape{3, 1}));
  EXPECT_EQ(s.contiguous().to_vec<int64_t>(), (std::vector<int64_t>{start, n + start, 2 * n + start}));
  Tensor s2 = x.slice(0, 1, 3, int64_t(1) << 61);
  ASSERT_EQ(s2.sizes(), (Shape{1, n}));
  EXPECT_LE(s2.stride(0), kMax / 8);  // byte strides must not overflow in the kernels
  EXPECT_EQ(x.slice(0, 0, 1, 5).stride(0), 5 * n);  // PyTorch's stride x step where it fits
  EXPECT_EQ(s2.sum().item<int64_t>(), n * n + n * (n - 1) / 2);
  // Ordinary steps are unchanged: every step-th element.
  Tensor s3 = x.slice(1, 1, n, 3);
  EXPECT_EQ(s3.size(1), (n - 1 + 2) / 3);
  EXPECT_EQ(s3.stride(1), 3);
  EXPECT_EQ(s3.select(0, 2).contiguous().to_vec<int64_t>()[1], 2 * n + 4);
  // unfold with a huge step: one window, correct values.
  Tensor u = x.unfold(1, 2, kMax);
  ASSERT_EQ(u.sizes(), (Shape{3, 1, 2}));
  EXPECT_EQ(u.contiguous().to_vec<int64_t>(), (std::vector<int64_t>{0, 1, n, n + 1, 2 * n, 2 * n + 1}));
}

TEST(Robustness, RepeatCatPadOverflowRaises) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = Tensor::randn({4}, 0.0, 1.0, dev());
  // 4 x (2^62 + 1) wrapped to 4: the old code allocated 4 elements and wrote 2^64 + 4.
  expect_error([&] { x.repeat({kWrapsTo4}); }, "repeat");
  expect_error([&] { x.repeat({kMax, 2}); }, "repeat");
  Tensor huge = Tensor::zeros({1}, dev()).expand({kMax / 2 + 1});
  expect_error([&] { cat({huge, huge}); }, "cat");
  expect_error([&] { pad(x, {kMax, kMax}); }, "pad");
  expect_error([&] { pad(x, {kMin, 0}); }, "pad");
  expect_error([&] { pad(x, {-3, -3}); }, "pad");
  // Ordinary padding still works.
  Tensor p = pad(x, {1, 2}, PadMode::constant, 7.0);
  ASSERT_EQ(p.numel(), 7);
  const auto v = p.to_vec<float>(), xv = x.to_vec<float>();
  EXPECT_EQ(v[0], 7.0f);
  EXPECT_EQ(v[1], xv[0]);
  EXPECT_EQ(v[6], 7.0f);
}

TEST(Robustness, SplitChunkArgumentsNeverEscapeAsStdExceptions) {
  FLAME_SKIP_IF_NO_DEVICE();
  const int64_t n = rand_int(3, 20);
  Tensor x = Tensor::arange(0, n, 1, dev());
  // chunk(huge) overflowed n + chunks - 1 into a negative split size ("split: split_size must be
  // non-negative"); PyTorch gives n pieces of one element.
  TensorList c = x.chunk(kMax);
  ASSERT_EQ(static_cast<int64_t>(c.size()), n);
  EXPECT_EQ(c[n - 1].item<int64_t>(), n - 1);
  TensorList s = x.split(kMax);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].numel(), n);
  // The sizes' sum wrapped to n.
  expect_error([&] { x.split_with_sizes({kMax, kMax, n + 2}); }, "split_with_sizes");
  // Huge piece counts: std::length_error / std::bad_alloc escaped before.
  Tensor e = Tensor::zeros({0}, dev());
  expect_error([&] { e.chunk(int64_t(1) << 40); }, "chunk");
  Tensor wide = Tensor::zeros({1}, dev()).expand({int64_t(1) << 40});
  expect_error([&] { wide.split(1); }, "split");
  expect_error([&] { wide.chunk(int64_t(1) << 40); }, "split");
}

TEST(Robustness, ExpandedViewsCountingTooManyElementsRaise) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor one = Tensor::ones({1, 1}, dev());
  expect_error([&] { one.expand({int64_t(1) << 32, int64_t(1) << 32}); }, "expand");
  // A broadcast whose result cannot be counted.
  Tensor a = Tensor::ones({1}, dev()).expand({int64_t(1) << 40}).unsqueeze(1);
  Tensor b = Tensor::ones({1}, dev()).expand({int64_t(1) << 40}).unsqueeze(0);
  expect_error([&] { a + b; }, "add");
}

// ---- randint ----

TEST(Robustness, RandintBoundsAreExact) {
  FLAME_SKIP_IF_NO_DEVICE();
  // Two bounds that meet as doubles gave a range of 0 and a division by zero (SIGFPE).
  const int64_t big = int64_t(1) << 60;
  expect_error([&] { Tensor::randint(big, big + 1, {4}, dev()); }, "randint", "2^53");
  expect_error([&] { Tensor::randint(kMin, kMax, {4}, dev()); }, "randint");
  expect_error([&] { Tensor::randint(0, 300, {4}, {DType::u8, dev()}); }, "randint", "u8");
  expect_error([&] { Tensor::randint(5, 5, {4}, dev()); }, "randint", "empty range");
  // The widest allowed range, and a one-value range at its edge, stay inside their bounds.
  const int64_t lim = int64_t(1) << 53;
  const auto w = Tensor::randint(-lim, lim, {1000}, dev()).to_vec<int64_t>();
  bool negative = false, positive = false;
  for (int64_t v : w) {
    ASSERT_GE(v, -lim);
    ASSERT_LT(v, lim);
    negative = negative || v < 0;
    positive = positive || v > 0;
  }
  EXPECT_TRUE(negative && positive);
  for (int64_t v : Tensor::randint(lim - 1, lim, {16}, dev()).to_vec<int64_t>()) EXPECT_EQ(v, lim - 1);
  const int64_t lo = rand_int(-100, 100);
  for (int64_t v : Tensor::randint(lo, lo + 3, {64}, {DType::i32, dev()}).to_vec<int64_t>()) {
    EXPECT_GE(v, lo);
    EXPECT_LT(v, lo + 3);
  }
}

// ---- defined integer math ----

std::vector<int64_t> vals(const Tensor& t) { return t.to_vec<int64_t>(); }
Tensor i64(const std::vector<int64_t>& v) { return Tensor::from_vec(v, {static_cast<int64_t>(v.size())}, dev()); }
int64_t wrap(uint64_t v) { return static_cast<int64_t>(v); }

TEST(Robustness, IntegerArithmeticWraps) {
  FLAME_SKIP_IF_NO_DEVICE();
  const int64_t r = rand_int(1, 1000);
  Tensor a = i64({kMax, kMin, r, kMin});
  Tensor b = i64({r, -r, kMax, kMin});
  auto expect = [&](const Tensor& got, auto f) {
    const auto av = vals(a), bv = vals(b), gv = vals(got);
    for (std::size_t i = 0; i < av.size(); ++i) {
      EXPECT_EQ(gv[i], wrap(f(static_cast<uint64_t>(av[i]), static_cast<uint64_t>(bv[i])))) << "element " << i;
    }
  };
  expect(a + b, [](uint64_t x, uint64_t y) { return x + y; });
  expect(a - b, [](uint64_t x, uint64_t y) { return x - y; });
  expect(a * b, [](uint64_t x, uint64_t y) { return x * y; });
  expect(-a, [](uint64_t x, uint64_t) { return uint64_t(0) - x; });
  expect(a.square(), [](uint64_t x, uint64_t) { return x * x; });
  expect(a.abs(), [](uint64_t x, uint64_t) { return static_cast<int64_t>(x) < 0 ? uint64_t(0) - x : x; });
  // Scalars: INT64_MAX as a double is 2^63, whose cast to int64 was undefined (gave INT64_MIN).
  expect(a.add_scalar(kMax), [](uint64_t x, uint64_t) { return x + static_cast<uint64_t>(kMax); });
  expect(a.mul_scalar(kMax), [](uint64_t x, uint64_t) { return x * static_cast<uint64_t>(kMax); });
  expect(a.sub_scalar(kMin), [](uint64_t x, uint64_t) { return x - static_cast<uint64_t>(kMin); });
  Tensor c = a.clone();
  c.sub_(kMin);
  expect(c, [](uint64_t x, uint64_t) { return x - static_cast<uint64_t>(kMin); });
  // Powers wrap like repeated multiplication.
  Tensor base = i64({3, -r, 7});
  uint64_t p3 = 1, pr = 1, p7 = 1;
  for (int i = 0; i < 45; ++i) p3 *= 3, pr *= static_cast<uint64_t>(-r), p7 *= 7;
  EXPECT_EQ(vals(base.pow(45)), (std::vector<int64_t>{wrap(p3), wrap(pr), wrap(p7)}));
  EXPECT_EQ(vals(base.pow(i64({45, 45, 45}))), (std::vector<int64_t>{wrap(p3), wrap(pr), wrap(p7)}));
}

TEST(Robustness, IntegerFmodNeverTraps) {
  FLAME_SKIP_IF_NO_DEVICE();
  // INT64_MIN % -1 raises SIGFPE on x86; PyTorch's result is 0.
  const int64_t r = rand_int(2, 1000);
  Tensor a = i64({kMin, kMin, 7 * r + 3, -7 * r - 3, r});
  Tensor b = i64({-1, 0, 7, 7, -1});
  EXPECT_EQ(vals(fmod(a, b)), (std::vector<int64_t>{0, 0, 3, -3, 0}));
}

TEST(Robustness, ScatterAddIntegerWraps) {
  FLAME_SKIP_IF_NO_DEVICE();
  const int64_t r = rand_int(1, 1000);
  Tensor x = i64({kMax, kMin});
  Tensor index = i64({0, 1, 0});
  Tensor src = i64({r, -r, 1});
  EXPECT_EQ(vals(scatter_add(x, 0, index, src)), (std::vector<int64_t>{wrap(static_cast<uint64_t>(kMax) + r + 1),
                                                                       wrap(static_cast<uint64_t>(kMin) - r)}));
}

TEST(Robustness, FloatToIntegerConversionSaturates) {
  FLAME_SKIP_IF_NO_DEVICE();
  const float f = static_cast<float>(rand_int(1, 1000)) + 0.75f;
  Tensor x = Tensor::from_vec<float>({NAN, INFINITY, -INFINITY, 1e30f, -1e30f, f, -f}, {7}, dev());
  const int64_t t = static_cast<int64_t>(f);
  EXPECT_EQ(x.to(DType::i64).to_vec<int64_t>(), (std::vector<int64_t>{0, kMax, kMin, kMax, kMin, t, -t}));
  const int64_t i32max = std::numeric_limits<int32_t>::max(), i32min = std::numeric_limits<int32_t>::min();
  EXPECT_EQ(x.to(DType::i32).to_vec<int64_t>(), (std::vector<int64_t>{0, i32max, i32min, i32max, i32min, t, -t}));
  const auto u8 = x.to(DType::u8).to_vec<int64_t>();
  EXPECT_EQ(u8[0], 0);
  EXPECT_EQ(u8[1], 255);
  EXPECT_EQ(u8[2], 0);
  EXPECT_EQ(u8[6], 0);
}

TEST(Robustness, OneHotInferredClassCountDoesNotOverflow) {
  FLAME_SKIP_IF_NO_DEVICE();
  // max + 1 overflowed int64 (undefined; found by the fuzzer under UBSan).
  expect_error([&] { one_hot(i64({1, kMax})); }, "one_hot");
  const int64_t c = rand_int(1, 9);
  EXPECT_EQ(one_hot(i64({0, c})).sizes(), (Shape{2, c + 1}));
}

// ---- messages name the op ----

TEST(Robustness, MessagesNameTheOp) {
  FLAME_SKIP_IF_NO_DEVICE();
  expect_error([&] { Tensor::zeros({2, -1}, dev()); }, "zeros", "[2, -1]");
  expect_error([&] { Tensor::ones({-3}, dev()); }, "ones");
  expect_error([&] { Tensor::full({-3}, 2, dev()); }, "full");
  expect_error([&] { Tensor::rand({-3}, dev()); }, "rand");  // not "uniform": the public name
  Tensor x = Tensor::arange(0, 4, 1, dev());
  expect_error([&] { x.sub_(1.5); }, "sub_");
  expect_error([&] { x.add_(1.5); }, "add_");
  expect_error([&] { x.mul_(1.5); }, "mul_");
}

TEST(Robustness, EmptyBoolTensorsHoldValidBools) {
  FLAME_SKIP_IF_NO_DEVICE();
  // Uninitialised bytes other than 0/1 were read as bool (undefined; under FLAME_POISON_ALLOC they
  // read as true). A bool empty() starts false.
  const int64_t n = rand_int(1, 300);
  Tensor e = Tensor::empty({n}, {DType::boolean, dev()});
  EXPECT_EQ(e.to(DType::i64).sum().item<int64_t>(), 0);
  EXPECT_EQ(empty_like(e).to(DType::i64).sum().item<int64_t>(), 0);
}

TEST(Robustness, PrintsInt64Extremes) {
  Tensor x = Tensor::from_vec<int64_t>({kMax, kMin}, {2});
  const std::string s = x.to_string();
  EXPECT_NE(s.find("9223372036854775807"), std::string::npos) << s;
  EXPECT_NE(s.find("-9223372036854775808"), std::string::npos) << s;
}

}  // namespace
}  // namespace flame
