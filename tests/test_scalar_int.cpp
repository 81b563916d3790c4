// Integer scalars travel exactly (Note [Exact integer scalars] in src/ops/elementwise.cpp): values
// past 2^53, where a double can no longer hold every integer, reach fill, full, arange, scalar
// arithmetic, comparisons and clamp without rounding. Inputs are random int64 values; the
// expected results are computed on the host with wrapping (two's complement) arithmetic. The
// cases run on the device under test (FLAME_TEST_DEVICE=cuda: the GPU).
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "flame/flame.h"
#include "test_util.h"

namespace flame {
namespace {

constexpr int64_t kBig = (int64_t{1} << 53) + 1;  // the first integer a double cannot hold
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

int64_t wadd(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b)); }
int64_t wsub(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<uint64_t>(a) - static_cast<uint64_t>(b)); }
int64_t wmul(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b)); }

// Random int64 values of every magnitude, non-zero.
std::vector<int64_t> random_i64(std::size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> v(n);
  for (auto& x : v) {
    const int shift = static_cast<int>(rng() % 63);
    x = static_cast<int64_t>(rng() >> (shift + 1)) * ((rng() & 1) ? 1 : -1);
    if (x == 0) x = 3;
  }
  return v;
}

Tensor on_device(const std::vector<int64_t>& v) { return Tensor::from_vec(v, {static_cast<int64_t>(v.size())}, test::test_device()); }

TEST(ScalarIntFill, FullFillAndScalarKeepEveryBit) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test::test_device();
  for (int64_t v : {kBig, kMax - 1, kMax, -kBig, std::numeric_limits<int64_t>::min() + 1}) {
    EXPECT_EQ(Tensor::full({3}, v, {DType::i64, dev}).to_vec<int64_t>(), std::vector<int64_t>(3, v)) << v;
    EXPECT_EQ(Tensor::scalar(v, dev).item<int64_t>(), v) << v;
    Tensor t = Tensor::zeros({5}, {DType::i64, dev});
    t.fill_(v);
    EXPECT_EQ(t.to_vec<int64_t>(), std::vector<int64_t>(5, v)) << v;
  }
  // uint8 and bool scalars keep their values too.
  EXPECT_EQ(Tensor::full({2}, uint8_t{255}, {DType::u8, dev}).to_vec<int>(), (std::vector<int>{255, 255}));
  EXPECT_EQ(Tensor::full({2}, true, {DType::boolean, dev}).to_vec<int>(), (std::vector<int>{1, 1}));
}

TEST(ScalarIntArith, AddSubMulRsubPastTwoToThe53) {
  FLAME_SKIP_IF_NO_DEVICE();
  const std::vector<int64_t> xv = random_i64(64, 7);
  const Tensor x = on_device(xv);
  for (int64_t s : {kBig, kMax - 1, -kBig - 2}) {
    const auto add = (x + s).to_vec<int64_t>(), sub = (x - s).to_vec<int64_t>(), mul = (x * s).to_vec<int64_t>(),
               rsub = (s - x).to_vec<int64_t>(), radd = (s + x).to_vec<int64_t>();
    for (std::size_t i = 0; i < xv.size(); ++i) {
      ASSERT_EQ(add[i], wadd(xv[i], s)) << "x + " << s << " at " << i;
      ASSERT_EQ(radd[i], wadd(xv[i], s)) << s << " + x at " << i;
      ASSERT_EQ(sub[i], wsub(xv[i], s)) << "x - " << s << " at " << i;
      ASSERT_EQ(mul[i], wmul(xv[i], s)) << "x * " << s << " at " << i;
      ASSERT_EQ(rsub[i], wsub(s, xv[i])) << s << " - x at " << i;
    }
  }
}

TEST(ScalarIntArith, InPlaceScalarOpsPastTwoToThe53) {
  FLAME_SKIP_IF_NO_DEVICE();
  const std::vector<int64_t> xv = random_i64(33, 11);
  Tensor a = on_device(xv), b = on_device(xv), c = on_device(xv);
  a += kBig;
  b -= kMax - 1;
  c *= kBig;
  const auto av = a.to_vec<int64_t>(), bv = b.to_vec<int64_t>(), cv = c.to_vec<int64_t>();
  for (std::size_t i = 0; i < xv.size(); ++i) {
    ASSERT_EQ(av[i], wadd(xv[i], kBig)) << i;
    ASSERT_EQ(bv[i], wsub(xv[i], kMax - 1)) << i;
    ASSERT_EQ(cv[i], wmul(xv[i], kBig)) << i;
  }
  // On a view: only the viewed elements change.
  Tensor d = on_device(xv);
  d.narrow(0, 1, 2).add_(kBig);
  const auto dv = d.to_vec<int64_t>();
  EXPECT_EQ(dv[0], xv[0]);
  EXPECT_EQ(dv[1], wadd(xv[1], kBig));
  EXPECT_EQ(dv[2], wadd(xv[2], kBig));
  EXPECT_EQ(dv[3], xv[3]);
}

TEST(ScalarIntArith, AlphaAndNarrowIntegerDtypes) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test::test_device();
  const std::vector<int64_t> xv = random_i64(16, 3), yv = random_i64(16, 4);
  const auto r = add(on_device(xv), on_device(yv), kBig).to_vec<int64_t>();
  for (std::size_t i = 0; i < xv.size(); ++i) ASSERT_EQ(r[i], wadd(xv[i], wmul(yv[i], kBig))) << i;
  // u8 wraps modulo 256: 250 + (2^53 + 1) is 251 (a double would have added 2^53, i.e. 0).
  const Tensor u = Tensor::full({4}, uint8_t{250}, {DType::u8, dev});
  EXPECT_EQ((u + kBig).to_vec<int>(), std::vector<int>(4, 251));
  EXPECT_EQ((u + kBig).dtype(), DType::u8);
  const Tensor i32 = Tensor::full({2}, int32_t{-7}, {DType::i32, dev});
  EXPECT_EQ((i32 * kBig).to_vec<int64_t>(), std::vector<int64_t>(2, static_cast<int32_t>(wmul(-7, kBig))));
  // A bool tensor with an integer scalar computes in i64.
  const Tensor bt = Tensor::full({2}, true, {DType::boolean, dev});
  EXPECT_EQ((bt + kBig).to_vec<int64_t>(), std::vector<int64_t>(2, kBig + 1));
}

TEST(ScalarIntCompare, ComparisonsDistinguishNeighboursOfTwoToThe53) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor t = on_device({kBig - 1, kBig, kBig + 1});
  EXPECT_EQ((t == kBig).to_vec<int>(), (std::vector<int>{0, 1, 0}));
  EXPECT_EQ((t < kBig).to_vec<int>(), (std::vector<int>{1, 0, 0}));
  EXPECT_EQ((t >= kBig).to_vec<int>(), (std::vector<int>{0, 1, 1}));
  const Tensor m = on_device({kMax - 2, kMax - 1, kMax});
  EXPECT_EQ((m != kMax - 1).to_vec<int>(), (std::vector<int>{1, 0, 1}));
  EXPECT_EQ((kMax - 1 > m).to_vec<int>(), (std::vector<int>{1, 0, 0}));
}

TEST(ScalarIntClamp, BoundsPastTwoToThe53AreExact) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor t = on_device({kBig - 2, kBig - 1, kBig, kBig + 1, kMax});
  EXPECT_EQ(t.clamp(kBig, std::nullopt).to_vec<int64_t>(),
            (std::vector<int64_t>{kBig, kBig, kBig, kBig + 1, kMax}));
  EXPECT_EQ(t.clamp(std::nullopt, kBig).to_vec<int64_t>(),
            (std::vector<int64_t>{kBig - 2, kBig - 1, kBig, kBig, kBig}));
  EXPECT_EQ(t.clamp(kBig - 1, kMax - 1).to_vec<int64_t>(),
            (std::vector<int64_t>{kBig - 1, kBig - 1, kBig, kBig + 1, kMax - 1}));
  Tensor u = t.clone();
  u.clamp_(std::nullopt, kBig);
  EXPECT_EQ(u.to_vec<int64_t>(), (std::vector<int64_t>{kBig - 2, kBig - 1, kBig, kBig, kBig}));
  EXPECT_EQ(t.clamp(kBig, std::nullopt).dtype(), DType::i64);
}

TEST(ScalarIntPow, OddExponentPastTwoToThe53KeepsItsParity) {
  FLAME_SKIP_IF_NO_DEVICE();
  // (-1)^(2^53 + 1) is -1; a double exponent rounds to 2^53 (even) and gives 1. 2^(2^53+1)
  // wraps to 0, 3^e is odd.
  const Tensor t = on_device({-1, 1, 2, 0});
  const auto r = t.pow(kBig).to_vec<int64_t>();
  EXPECT_EQ(r[0], -1);
  EXPECT_EQ(r[1], 1);
  EXPECT_EQ(r[2], 0);
  EXPECT_EQ(r[3], 0);
}

TEST(ScalarIntArange, ValuesPastTwoToThe53AreExact) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test::test_device();
  std::vector<int64_t> want;
  for (int64_t i = 0; i < 7; ++i) want.push_back(kBig - 3 + i);
  EXPECT_EQ(Tensor::arange(kBig - 3, kBig + 4, 1, dev).to_vec<int64_t>(), want);
  want.clear();
  for (int64_t i = 0; i < 4; ++i) want.push_back(kMax - 10 + 3 * i);  // kMax-10 .. kMax-1 by 3
  EXPECT_EQ(Tensor::arange(kMax - 10, kMax, 3, dev).to_vec<int64_t>(), want);
  want.clear();
  for (int64_t v = -kBig; v > -kBig - 6; --v) want.push_back(v);
  EXPECT_EQ(Tensor::arange(-kBig, -kBig - 6, -1, dev).to_vec<int64_t>(), want);
  // A step past 2^53.
  const int64_t step = (int64_t{1} << 61) + 1;
  EXPECT_EQ(Tensor::arange(0, kMax, step, dev).to_vec<int64_t>(),
            (std::vector<int64_t>{0, step, 2 * step, 3 * step}));
  // Small ranges keep working (and stay on the one-kernel path).
  EXPECT_EQ(Tensor::arange(5, dev).to_vec<int64_t>(), (std::vector<int64_t>{0, 1, 2, 3, 4}));
}

TEST(ScalarIntMaskedFill, FillsTheExactValue) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor t = on_device({1, 2, 3});
  const Tensor mask = Tensor::from_vec(std::vector<bool>{true, false, true}, {3}, test::test_device());
  EXPECT_EQ(t.masked_fill(mask, kMax - 1).to_vec<int64_t>(), (std::vector<int64_t>{kMax - 1, 2, kMax - 1}));
}

}  // namespace
}  // namespace flame
