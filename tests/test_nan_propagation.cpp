// NaN inputs to maximum, minimum and clamp propagate, as in PyTorch: the result is NaN wherever an
// operand is NaN (either side, every float dtype), on the device under test and on CUDA.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "test_util.h"

namespace flame::test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Random values with NaN at fixed positions (the first and last element, and every 5th).
std::vector<double> with_nans(int64_t n, uint64_t seed, int phase) {
  Generator gen(seed);
  std::vector<double> v = Tensor::uniform({n}, -2.0, 2.0, DType::f64, &gen).to_vec<double>();
  for (int64_t i = phase; i < n; i += 5) v[i] = kNaN;
  return v;
}

double ref_max(double a, double b) { return std::isnan(a) || std::isnan(b) ? kNaN : std::max(a, b); }
double ref_min(double a, double b) { return std::isnan(a) || std::isnan(b) ? kNaN : std::min(a, b); }

void check_binary_and_clamp(Device dev) {
  const int64_t n = 37;
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    SCOPED_TRACE(std::string(dtype_name(dt)) + " on " + dev.str());
    // NaN in a only, in b only, in both (positions 0, 5, 10... in a; 0, 3, 8... in b).
    std::vector<double> av = with_nans(n, 5, 0), bv = with_nans(n, 6, 3);
    av[1] = kInf;
    bv[2] = -kInf;
    const Tensor a = Tensor::from_vec(av, {n}).to(dt).to(dev), b = Tensor::from_vec(bv, {n}).to(dt).to(dev);
    const std::vector<double> ar = a.to_vec<double>(), br = b.to_vec<double>();  // rounded to dt
    RefTensor want_max({n}, dt), want_min({n}, dt), want_clamp({n}, dt), want_clamp_lo({n}, dt);
    for (int64_t i = 0; i < n; ++i) {
      want_max.v[i] = ref_max(ar[i], br[i]);
      want_min.v[i] = ref_min(ar[i], br[i]);
      want_clamp.v[i] = std::isnan(ar[i]) ? kNaN : std::min(std::max(ar[i], -0.5), 1.25);
      want_clamp_lo.v[i] = std::isnan(ar[i]) ? kNaN : std::max(ar[i], 0.25);
    }
    const double rtol = default_rtol(dt), atol = default_atol(dt);
    EXPECT_TRUE(all_close(a.maximum(b), want_max, 0.0, 0.0)) << "maximum(a, b)";
    EXPECT_TRUE(all_close(b.maximum(a), want_max, 0.0, 0.0)) << "maximum(b, a)";
    EXPECT_TRUE(all_close(a.minimum(b), want_min, 0.0, 0.0)) << "minimum(a, b)";
    EXPECT_TRUE(all_close(b.minimum(a), want_min, 0.0, 0.0)) << "minimum(b, a)";
    EXPECT_TRUE(all_close(a.clamp(-0.5, 1.25), want_clamp, rtol, atol)) << "clamp(a, -0.5, 1.25)";
    EXPECT_TRUE(all_close(a.clamp(0.25, std::nullopt), want_clamp_lo, rtol, atol)) << "clamp(a, min=0.25)";
    // Broadcast NaN: a NaN scalar tensor against a full tensor.
    const Tensor nan0 = Tensor::scalar(kNaN, dev).to(dt);
    for (double v : a.maximum(nan0).to_vec<double>()) EXPECT_TRUE(std::isnan(v)) << "maximum(a, nan)";
    for (double v : nan0.minimum(a).to_vec<double>()) EXPECT_TRUE(std::isnan(v)) << "minimum(nan, a)";
  }
}

TEST(NanPropagation, MaximumMinimumClampOnTheTestDevice) {
  FLAME_SKIP_IF_NO_DEVICE();
  check_binary_and_clamp(test_device());
}

TEST(NanPropagation, MaximumMinimumClampOnCuda) {
  FLAME_SKIP_IF_NO_CUDA();
  check_binary_and_clamp(Device::cuda(0));
}

}  // namespace
}  // namespace flame::test
