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
#include <sstream>
#include <vector>

#include "flame/float8.h"
#include "flame/flame.h"
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

// ---- tensors of the 8-bit dtypes (Note [Float8 dtypes] in flame/dtype.h) ----

const Format& format_of(DType f8) { return f8 == DType::f8_e4m3fn ? kE4M3 : kE5M2; }

// Values that reach every code and every rounding case: each code's value, the midpoints between
// neighbours (ties), just above and below them, out-of-range magnitudes, infinities, NaN, zeros of
// both signs, subnormals and random normals at several scales.
std::vector<float> probe_values(const Format& f) {
  std::vector<float> v;
  for (int c = 0; c < 256; ++c) {
    const float x = decode(f, static_cast<uint8_t>(c));
    if (std::isnan(x)) continue;
    v.push_back(x);
    const float next = decode(f, static_cast<uint8_t>(c + 1 < 256 ? c + 1 : c));
    if (!std::isnan(next) && std::isfinite(next) && std::isfinite(x) && (c & 0x7f) != 0x7f) {
      const float mid = 0.5f * (x + next);
      v.insert(v.end(), {mid, std::nextafter(mid, HUGE_VALF), std::nextafter(mid, -HUGE_VALF)});
    }
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  v.insert(v.end(), {0.0f, -0.0f, 1e-12f, -1e-12f, 449.0f, 464.0f, 1e6f, -1e6f, 61439.0f, 61440.0f, HUGE_VALF,
                     -HUGE_VALF, nan, -nan});
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (float scale : {1e-3f, 1.0f, 100.0f, 1e4f})
    for (int i = 0; i < 200; ++i) v.push_back(n(rng) * scale);
  return v;
}

// What a code decodes to, compared bit for bit (NaN: any NaN of the same sign, or any NaN where a
// CUDA conversion through f16 or bf16 took part: the GPU's half conversions give the canonical
// NaN, as PyTorch's CUDA casts do; the 8-bit codecs themselves keep the sign on both devices).
void expect_same_value(float got, float want, const std::string& what, bool nan_sign = true) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got) && (!nan_sign || std::signbit(got) == std::signbit(want))) << what << ": " << got;
  } else {
    EXPECT_EQ(detail::float_bits(got), detail::float_bits(want)) << what << ": " << got << " vs " << want;
  }
}

// Two tensors of the same values, element by element (compared as f32).
bool same_values(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to(DType::f32).to(Device::cpu()).contiguous().to_vec<float>();
  const std::vector<float> y = b.to(DType::f32).to(Device::cpu()).contiguous().to_vec<float>();
  if (a.sizes() != b.sizes() || x.size() != y.size()) return false;
  for (std::size_t i = 0; i < x.size(); ++i)
    if (detail::float_bits(x[i]) != detail::float_bits(y[i]) && !(std::isnan(x[i]) && std::isnan(y[i]))) return false;
  return true;
}

// x.to(f8) from every floating dtype gives the nearest code of x as that dtype holds it (f64
// rounds to f32 first, as the scalar types do), and .to(f32) gives the code's value.
TEST(Float8Tensor, CastsGiveTheNearestCode) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (DType f8 : kFloat8DTypes) {
    const Format& f = format_of(f8);
    const std::vector<float> v = probe_values(f);
    const Tensor x32 = Tensor::from_vec(v, {static_cast<int64_t>(v.size())});
    for (DType src : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
      SCOPED_TRACE(std::string(dtype_name(f8)) + " from " + dtype_name(src));
      const Tensor xs = x32.to(src);
      const std::vector<float> held = xs.to(DType::f32).to_vec<float>();  // what the source dtype holds
      const Tensor q = xs.to(dev).to(f8);
      ASSERT_EQ(q.dtype(), f8);
      EXPECT_EQ(q.nbytes(), v.size());
      const std::vector<float> got = q.to(DType::f32).to(Device::cpu()).to_vec<float>();
      for (std::size_t i = 0; i < v.size(); ++i)
        expect_same_value(got[i], decode(f, reference_code(f, held[i])), "value " + std::to_string(v[i]),
                          !(dev.is_cuda() && (src == DType::f16 || src == DType::bf16)));
    }
  }
}

// From an 8-bit dtype to every dtype: the code's value converted as the scalar conversions do
// (integers truncate and saturate, NaN -> 0; bool is v != 0), and between the two 8-bit dtypes
// through the value.
TEST(Float8Tensor, CastsFromEveryCode) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  std::vector<float> codes(256);
  for (DType f8 : kFloat8DTypes) {
    const Format& f = format_of(f8);
    for (int c = 0; c < 256; ++c) codes[c] = decode(f, static_cast<uint8_t>(c));
    const Tensor q = Tensor::from_vec(codes, {256}).to(dev).to(f8);  // every code, exactly
    const std::vector<double> d = q.to(DType::f64).to(Device::cpu()).to_vec<double>();
    const std::vector<int64_t> i = q.to(DType::i64).to(Device::cpu()).to_vec<int64_t>();
    const std::vector<uint8_t> b = q.to(DType::boolean).to(DType::u8).to(Device::cpu()).to_vec<uint8_t>();
    const std::vector<float> h = q.to(DType::bf16).to(DType::f32).to(Device::cpu()).to_vec<float>();
    const DType other = f8 == DType::f8_e4m3fn ? DType::f8_e5m2 : DType::f8_e4m3fn;
    const std::vector<float> o = q.to(other).to(DType::f32).to(Device::cpu()).to_vec<float>();
    for (int c = 0; c < 256; ++c) {
      const float x = codes[c];
      SCOPED_TRACE(std::string(dtype_name(f8)) + " code " + std::to_string(c));
      expect_same_value(static_cast<float>(d[c]), x, "f64");
      expect_same_value(h[c], static_cast<float>(bfloat16(x)), "bf16", !dev.is_cuda());
      expect_same_value(o[c], decode(format_of(other), reference_code(format_of(other), x)), "other 8-bit");
      EXPECT_EQ(b[c], x != 0.0f ? 1 : 0);  // NaN != 0
      if (std::isnan(x)) EXPECT_EQ(i[c], 0);
      else if (std::isinf(x)) EXPECT_EQ(i[c], x > 0 ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int64_t>::min());
      else EXPECT_EQ(i[c], static_cast<int64_t>(x));
    }
  }
}

// Strided sources and destinations, fills, views and printing.
TEST(Float8Tensor, StridedCopiesFillsAndPrinting) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Generator g(3);
  const Tensor x = Tensor::randn({24, 40}, 0.0, 50.0, TensorOptions(DType::f32, dev), &g);
  for (DType f8 : kFloat8DTypes) {
    SCOPED_TRACE(dtype_name(f8));
    const Tensor want = x.t().contiguous().to(f8).to(DType::f32);
    EXPECT_TRUE(same_values(x.t().to(f8).to(DType::f32), want)) << "transposed source";
    Tensor dst = Tensor::zeros({40, 24}, TensorOptions(f8, dev));
    dst.copy_(x.t());
    EXPECT_TRUE(same_values(dst.to(DType::f32), want)) << "copy_ into f8";
    EXPECT_TRUE(same_values(dst.narrow(1, 3, 5).to(DType::f32), want.narrow(1, 3, 5))) << "a view";
    const Tensor back = Tensor::empty({40, 24}, TensorOptions(DType::bf16, dev)).copy_(dst);
    EXPECT_TRUE(same_values(back.to(DType::f32), want.to(DType::bf16).to(DType::f32))) << "copy_ from f8";
    // Fills round as casts do: e4m3fn saturates, e5m2 overflows to infinity.
    const Tensor big = Tensor::full({3}, 1e6, TensorOptions(f8, dev)).to(DType::f32);
    EXPECT_EQ(big.to(Device::cpu()).to_vec<float>()[0], f8 == DType::f8_e4m3fn ? 448.0f : HUGE_VALF);
    EXPECT_EQ(Tensor::ones({2}, TensorOptions(f8, dev)).to(DType::f32).sum().item<float>(), 2.0f);
    std::ostringstream os;
    os << Tensor::from_vec(std::vector<float>{1.5f, -448.0f}, {2}).to(dev).to(f8);
    EXPECT_NE(os.str().find(dtype_name(f8)), std::string::npos) << os.str();
    EXPECT_NE(os.str().find("448"), std::string::npos) << os.str();
  }
}

// Arithmetic raises naming the dtype and what to do; no promotion with other dtypes.
TEST(Float8Tensor, ArithmeticRaisesNamingTheDtype) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor q = Tensor::ones({4}, TensorOptions(DType::f8_e4m3fn, dev));
  const Tensor y = Tensor::ones({4}, TensorOptions(DType::f32, dev));
  expect_error([&] { (void)(q + q); }, {"f8_e4m3fn", "cast"});
  expect_error([&] { (void)(q * y); }, {"promote_types", "f8_e4m3fn", "f32"});
  expect_error([&] { (void)q.sum(); }, {"f8_e4m3fn"});
  expect_error([&] { (void)-q; }, {"f8_e4m3fn"});
  // Ops that make integer inputs floating (exp, true division) read the exact values in f32.
  EXPECT_EQ(q.exp().dtype(), DType::f32);
  EXPECT_FLOAT_EQ(q.exp().to(Device::cpu()).to_vec<float>()[0], std::exp(1.0f));
  // Moving elements (cat, index_select) keeps the dtype.
  EXPECT_EQ(cat({q, q}, 0).dtype(), DType::f8_e4m3fn);
  EXPECT_EQ(promote_types(DType::f8_e5m2, DType::f8_e5m2), DType::f8_e5m2);
  EXPECT_EQ(dtype_size(DType::f8_e5m2), 1u);
  EXPECT_FALSE(is_floating(DType::f8_e4m3fn));
  EXPECT_TRUE(is_float8(DType::f8_e4m3fn));
}

// Scaled casts: the scale maps each slice's largest magnitude onto the format's largest value;
// to_float8 is round(clamp(x / scale)) with f32 division, from_float8 the code's value * scale.
TEST(Float8Tensor, ScaledCastsPerTensorAndPerChannel) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Generator g(11);
  // Rows of very different magnitudes, one all zero.
  Tensor x = Tensor::randn({6, 48}, 0.0, 1.0, TensorOptions(DType::f32), &g);
  x = x * Tensor::from_vec(std::vector<float>{1e-4f, 1.0f, 30.0f, 1e3f, 0.0f, 7e4f}, {6, 1});
  for (DType f8 : kFloat8DTypes) {
    const Format& f = format_of(f8);
    const double m = float8_max(f8);
    for (bool per_channel : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(f8)) + (per_channel ? " per channel" : " per tensor"));
      const Tensor xd = x.to(dev);
      const Tensor s = per_channel ? float8_scale(xd, f8, 0) : float8_scale(xd, f8);
      EXPECT_EQ(s.sizes(), per_channel ? Shape({6, 1}) : Shape{});
      EXPECT_EQ(s.dtype(), DType::f32);
      const Tensor q = to_float8(xd, f8, s);
      ASSERT_EQ(q.dtype(), f8);
      const Tensor r = from_float8(q, s);
      const std::vector<float> xv = x.to_vec<float>(), sv = s.to(Device::cpu()).expand({6, 48}).contiguous().to_vec<float>();
      const std::vector<float> qv = q.to(DType::f32).to(Device::cpu()).to_vec<float>();
      const std::vector<float> rv = r.to(Device::cpu()).to_vec<float>();
      for (std::size_t i = 0; i < xv.size(); ++i) {
        const float v = std::min(std::max(xv[i] / sv[i], static_cast<float>(-m)), static_cast<float>(m));
        const float code = decode(f, reference_code(f, v));
        expect_same_value(qv[i], code, "q " + std::to_string(i));
        expect_same_value(rv[i], code * sv[i], "x' " + std::to_string(i));
      }
      if (per_channel) {  // each nonzero row reaches the format's largest value; the zero row has scale 1
        const Tensor amax_q = q.to(DType::f32).abs().max({1});
        const std::vector<float> a = amax_q.to(Device::cpu()).to_vec<float>();
        for (int row = 0; row < 6; ++row) EXPECT_EQ(a[row], row == 4 ? 0.0f : static_cast<float>(m)) << row;
        EXPECT_EQ(sv[4 * 48], 1.0f);
      }
    }
    // A scale too small for the values: both formats clamp (no infinity); NaN passes through.
    const Tensor tiny = Tensor::full({}, 1e-6, TensorOptions(DType::f32, dev));
    const Tensor nanx = Tensor::from_vec(std::vector<float>{1.0f, -1.0f, std::numeric_limits<float>::quiet_NaN()}, {3});
    const std::vector<float> c = to_float8(nanx.to(dev), f8, tiny).to(DType::f32).to(Device::cpu()).to_vec<float>();
    EXPECT_EQ(c[0], static_cast<float>(m));
    EXPECT_EQ(c[1], static_cast<float>(-m));
    EXPECT_TRUE(std::isnan(c[2]));
  }
  const Tensor xd = x.to(dev);
  expect_error([&] { (void)to_float8(xd, DType::bf16, float8_scale(xd, DType::f8_e4m3fn)); }, {"to_float8", "bf16"});
  expect_error([&] { (void)from_float8(xd, Tensor::ones({}, TensorOptions(DType::f32, dev))); }, {"from_float8", "f32"});
  expect_error([&] { (void)to_float8(xd, DType::f8_e4m3fn, Tensor::ones({5, 1}, TensorOptions(DType::f32, dev))); },
               {"to_float8", "[5, 1]", "broadcast"});
  expect_error([&] { (void)float8_scale(xd, DType::f8_e5m2, 2); }, {"float8_scale", "dim 2"});
}

// from_float8 of rows wide enough for the vectorised pass (Note [Row dequantisation], 1024 codes
// or more a row) and of an unaligned view beside it: every code of both formats in every row,
// each row with its own scale (one a power of two, others not), into f32 and bf16, against the
// code's value times the scale in f32 (on CUDA a NaN's sign is not kept: the GPU's f32
// multiplication gives the canonical NaN).
TEST(Float8Tensor, DequantizesWideRowsOfEveryCode) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  constexpr int64_t kRows = 5, kCols = 1024 + 256 + 16;
  const std::vector<float> scales = {1.0f, 0.0625f, 3.7f, 1e-3f, 517.25f};
  for (DType f8 : kFloat8DTypes) {
    const Format& f = format_of(f8);
    std::vector<float> codes(kRows * kCols);
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t c = 0; c < kCols; ++c) codes[r * kCols + c] = decode(f, static_cast<uint8_t>((c + 37 * r) % 256));
    const Tensor q = Tensor::from_vec(codes, {kRows, kCols}).to(dev).to(f8);
    const Tensor s = Tensor::from_vec(scales, {kRows, 1}).to(dev);
    // The same codes one byte into a larger buffer: no 16-byte alignment.
    Tensor qu = Tensor::from_vec(std::vector<float>(kRows * kCols + 1, 0.0f), {kRows * kCols + 1})
                    .to(dev)
                    .to(f8)
                    .narrow(0, 1, kRows * kCols);
    qu.copy_(q.reshape({kRows * kCols}));
    for (DType out : {DType::f32, DType::bf16}) {
      for (bool unaligned : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(f8)) + " to " + dtype_name(out) + (unaligned ? ", unaligned" : ""));
        const Tensor src = unaligned ? qu.reshape({kRows, kCols}) : q;
        const Tensor y = from_float8(src, s, out);
        ASSERT_EQ(y.dtype(), out);
        ASSERT_EQ(y.sizes(), Shape({kRows, kCols}));
        const std::vector<float> got = y.to(DType::f32).to(Device::cpu()).to_vec<float>();
        for (int64_t i = 0; i < kRows * kCols; ++i) {
          const float want = codes[i] * scales[i / kCols];
          expect_same_value(got[i], out == DType::bf16 ? static_cast<float>(bfloat16(want)) : want,
                            "element " + std::to_string(i), !dev.is_cuda());
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

}  // namespace
}  // namespace flame::test
