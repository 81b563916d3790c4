// The 8-bit float storage types (flame/float8.h, Note [Float8 formats]):
//  - Float8.DecodesEveryCode: all 256 codes of both formats against the formula (f8_reference:
//    sign, exponent, mantissa; subnormals, NaN, e5m2's infinities).
//  - Float8.EncodesAsTheNearestCode: float -> code against a brute-force reference (the nearest
//    of the 256 values in f64, ties to the even code; e4m3fn saturating, e5m2 overflowing to inf)
//    over every code's value, every midpoint between neighbours and one float step either side,
//    and log-uniform random values from 2^-20 to 2^20.
//  - Float8.MatchesPyTorchCasts: values whose codes PyTorch 2.11's CPU casts gave
//    (torch.tensor(x).to(torch.float8_e4m3fn / float8_e5m2)).
//  - Float8.SaturatingE5m2 and the round trip decode(encode(decode(c))) == c.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "flame/float8.h"
#include "test_util.h"

namespace flame::test {
namespace {

struct Format {
  const char* name;
  int ebits, mbits;
  bool e4m3;
};
constexpr Format kE4M3{"e4m3fn", 4, 3, true};
constexpr Format kE5M2{"e5m2", 5, 2, false};

// The value of code b (f8_reference, test_util.h: written from the formats' definition).
double reference_value(const Format& f, uint8_t b) { return f8_reference(b, f.ebits, f.mbits); }

float decode(const Format& f, uint8_t b) {
  return f.e4m3 ? static_cast<float>(float8_e4m3fn::from_bits(b)) : static_cast<float>(float8_e5m2::from_bits(b));
}
uint8_t encode(const Format& f, float x) { return f.e4m3 ? float8_e4m3fn(x).bits : float8_e5m2(x).bits; }

// The code of x by search: NaN keeps its sign; e4m3fn saturates to +-448; e5m2 treats +-inf as the
// value 2^16 for rounding (IEEE overflow: from the midpoint 61440 up).
uint8_t reference_code(const Format& f, float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return sign | 0x7f;
  const double a = std::fabs(static_cast<double>(x));
  if (f.e4m3 && a >= 448.0) return sign | 0x7e;
  if (!f.e4m3 && a >= 65536.0) return sign | 0x7c;
  const int last = f.e4m3 ? 0x7e : 0x7c;
  int best = 0;
  double best_d = HUGE_VAL;
  for (int c = 0; c <= last; ++c) {
    const double v = (!f.e4m3 && c == 0x7c) ? 65536.0 : reference_value(f, static_cast<uint8_t>(c));
    const double d = std::fabs(v - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

TEST(Float8, DecodesEveryCode) {
  for (const Format& f : {kE4M3, kE5M2}) {
    for (int c = 0; c < 256; ++c) {
      const double want = reference_value(f, static_cast<uint8_t>(c));
      const float got = decode(f, static_cast<uint8_t>(c));
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << f.name << " code " << c;
        EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << f.name << " code " << c;
      } else {
        EXPECT_EQ(static_cast<double>(got), want) << f.name << " code " << c;
        EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << f.name << " code " << c << " (the sign of zero)";
      }
    }
  }
  EXPECT_EQ(static_cast<float>(float8_e4m3fn::from_bits(0x7e)), 448.0f);
  EXPECT_EQ(static_cast<float>(float8_e4m3fn::from_bits(0x01)), std::ldexp(1.0f, -9));
  EXPECT_EQ(static_cast<float>(float8_e5m2::from_bits(0x7b)), 57344.0f);
  EXPECT_EQ(static_cast<float>(float8_e5m2::from_bits(0x01)), std::ldexp(1.0f, -16));
  EXPECT_TRUE(std::isinf(static_cast<float>(float8_e5m2::from_bits(0xfc))));
}

TEST(Float8, EncodesAsTheNearestCode) {
  for (const Format& f : {kE4M3, kE5M2}) {
    std::vector<float> xs = {0.0f, -0.0f, HUGE_VALF, -HUGE_VALF, std::numeric_limits<float>::quiet_NaN(),
                             -std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min(),
                             std::numeric_limits<float>::max(), 1e30f, -1e30f};
    const int last = f.e4m3 ? 0x7e : 0x7b;
    for (int c = 0; c <= last; ++c) {
      const float v = decode(f, static_cast<uint8_t>(c));
      const float next = c < last ? decode(f, static_cast<uint8_t>(c + 1)) : v * 1.25f;  // past the top
      const float mid = static_cast<float>((static_cast<double>(v) + next) / 2.0);      // exact in float
      for (float x : {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, HUGE_VALF)}) {
        xs.push_back(x);
        xs.push_back(-x);
      }
    }
    std::mt19937 gen(8);
    std::uniform_real_distribution<double> exponent(-20.0, 20.0);
    for (int i = 0; i < 20000; ++i) {
      const float x = static_cast<float>(std::exp2(exponent(gen)));
      xs.push_back(i % 2 ? x : -x);
    }
    int wrong = 0;
    for (float x : xs) {
      const uint8_t want = reference_code(f, x), got = encode(f, x);
      if (got != want && ++wrong <= 10) ADD_FAILURE() << f.name << " of " << x << ": code " << int(got) << ", want " << int(want);
    }
    EXPECT_EQ(wrong, 0) << f.name << " (" << xs.size() << " values)";
  }
}

TEST(Float8, MatchesPyTorchCasts) {
  struct Fact {
    float x;
    uint8_t e4m3, e5m2;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<Fact> facts = {
      {448.0f, 0x7e, 0x5f},    {463.99f, 0x7e, 0x5f},      {464.0f, 0x7e, 0x5f},   {479.0f, 0x7e, 0x5f},
      {480.0f, 0x7e, 0x60},    {1e6f, 0x7e, 0x7c},         {HUGE_VALF, 0x7e, 0x7c}, {-HUGE_VALF, 0xfe, 0xfc},
      {nan, 0x7f, 0x7f},       {-nan, 0xff, 0xff},         {-0.0f, 0x80, 0x80},    {-464.0f, 0xfe, 0xdf},
      {57344.0f, 0x7e, 0x7b},  {61439.0f, 0x7e, 0x7b},     {61440.0f, 0x7e, 0x7c}, {65536.0f, 0x7e, 0x7c},
      {0.001953125f, 0x01, 0x18}, {0.0009765625f, 0x00, 0x14}, {0.00146484375f, 0x01, 0x16},
      {240.0f, 0x77, 0x5c},    {232.0f, 0x76, 0x5b},       {248.0f, 0x78, 0x5c},
  };
  for (const Fact& t : facts) {
    EXPECT_EQ(float8_e4m3fn(t.x).bits, t.e4m3) << "e4m3fn of " << t.x;
    EXPECT_EQ(float8_e5m2(t.x).bits, t.e5m2) << "e5m2 of " << t.x;
  }
}

TEST(Float8, SaturatingE5m2AndRoundTrips) {
  EXPECT_EQ(detail::float_to_e5m2_bits(1e6f, /*saturate=*/true), 0x7b);
  EXPECT_EQ(detail::float_to_e5m2_bits(-HUGE_VALF, /*saturate=*/true), 0xfb);
  EXPECT_EQ(detail::float_to_e5m2_bits(61440.0f, /*saturate=*/true), 0x7b);
  EXPECT_EQ(detail::float_to_e5m2_bits(100.0f, /*saturate=*/true), float8_e5m2(100.0f).bits);
  EXPECT_EQ(detail::float_to_e5m2_bits(std::numeric_limits<float>::quiet_NaN(), true), 0x7f);
  for (int c = 0; c < 256; ++c) {
    const auto b = static_cast<uint8_t>(c);
    if ((c & 0x7f) != 0x7f) EXPECT_EQ(float8_e4m3fn(static_cast<float>(float8_e4m3fn::from_bits(b))).bits, b) << c;
    if ((c & 0x7c) != 0x7c || (c & 0x03) == 0)
      EXPECT_EQ(float8_e5m2(static_cast<float>(float8_e5m2::from_bits(b))).bits, b) << c;
  }
}

}  // namespace
}  // namespace flame::test
