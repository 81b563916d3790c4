// interpolate's bicubic mode, antialiased bilinear / bicubic downsampling and 1-d (3-d input)
// interpolation: values against float64 loops of PyTorch's formulas written here (Keys' cubic
// convolution with A = -0.75 and clamped border taps; the PIL-style normalised filter of support
// 1 or 2 times the downscale factor, A = -0.5), hand-checked cases, float64 gradchecks on the CPU,
// CUDA against the CPU (forward and backward), and the errors of the 3-d / 4-d mode rules.
#include <algorithm>
#include <cmath>
#include <vector>

#include "flame/nn/pool.h"
#include "gradcheck.h"
#include "test_util.h"

namespace flame::test {
namespace {
namespace F = flame::nn::functional;

Tensor rnd(const Shape& s, uint64_t seed) {
  Generator g(seed);
  return Tensor::randn(s, 0.0, 1.0, {DType::f64, Device::cpu()}, &g);
}
std::vector<double> values(const Tensor& t) { return t.to(Device::cpu()).to(DType::f64).contiguous().to_vec<double>(); }

// One dim's resampling matrix M[o][i] (out = M x along that dim), float64.
using Matrix = std::vector<std::vector<double>>;

double source_scale(int64_t in, int64_t out, bool align, double sf) {
  if (align) return out > 1 ? double(in - 1) / double(out - 1) : 0.0;
  return sf > 0 ? 1.0 / sf : double(in) / double(out);
}

Matrix bicubic_matrix(int64_t in, int64_t out, bool align, double sf = 0) {
  const double s = source_scale(in, out, align, sf), A = -0.75;
  auto near = [&](double x) { return ((A + 2) * x - (A + 3)) * x * x + 1; };
  auto far = [&](double x) { return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A; };
  Matrix m(static_cast<std::size_t>(out), std::vector<double>(static_cast<std::size_t>(in), 0.0));
  for (int64_t o = 0; o < out; ++o) {
    const double src = align ? o * s : (o + 0.5) * s - 0.5;
    const double f = std::floor(src), t = src - f;
    const double w[4] = {far(t + 1), near(t), near(1 - t), far(2 - t)};
    for (int k = 0; k < 4; ++k) {
      const int64_t i = std::clamp<int64_t>(static_cast<int64_t>(f) - 1 + k, 0, in - 1);
      m[o][i] += w[k];
    }
  }
  return m;
}

Matrix antialias_matrix(int64_t in, int64_t out, bool align, bool cubic, double sf = 0) {
  const double s = source_scale(in, out, align, sf);
  const double support = (cubic ? 2.0 : 1.0) * std::max(s, 1.0), inv = 1.0 / std::max(s, 1.0);
  auto filter = [&](double x) {
    x = std::fabs(x);
    if (!cubic) return std::max(0.0, 1 - x);
    const double a = -0.5;
    if (x < 1) return ((a + 2) * x - (a + 3)) * x * x + 1;
    return x < 2 ? ((a * x - 5 * a) * x + 8 * a) * x - 4 * a : 0.0;
  };
  Matrix m(static_cast<std::size_t>(out), std::vector<double>(static_cast<std::size_t>(in), 0.0));
  for (int64_t o = 0; o < out; ++o) {
    const double center = s * (o + 0.5);
    const int64_t lo = std::max<int64_t>(static_cast<int64_t>(center - support + 0.5), 0);
    const int64_t hi = std::min<int64_t>(static_cast<int64_t>(center + support + 0.5), in);
    double total = 0;
    for (int64_t i = lo; i < hi; ++i) total += filter((i - center + 0.5) * inv);
    for (int64_t i = lo; i < hi; ++i) m[o][i] = filter((i - center + 0.5) * inv) / (total != 0 ? total : 1);
  }
  return m;
}

Matrix linear_matrix(int64_t in, int64_t out, bool align, double sf = 0) {
  const double s = source_scale(in, out, align, sf);
  Matrix m(static_cast<std::size_t>(out), std::vector<double>(static_cast<std::size_t>(in), 0.0));
  for (int64_t o = 0; o < out; ++o) {
    const double src = std::max(0.0, align ? o * s : (o + 0.5) * s - 0.5);
    const int64_t i0 = std::min<int64_t>(static_cast<int64_t>(src), in - 1), i1 = std::min<int64_t>(i0 + 1, in - 1);
    const double l1 = src - i0;
    m[o][i0] += 1 - l1;
    m[o][i1] += l1;
  }
  return m;
}

// out[n, c] = Mh x[n, c] Mw^T on [N, C, H, W] f64.
Tensor apply(const Tensor& x, const Matrix& mh, const Matrix& mw) {
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t OH = static_cast<int64_t>(mh.size()), OW = static_cast<int64_t>(mw.size());
  const std::vector<double> xv = values(x);
  std::vector<double> out(static_cast<std::size_t>(N * C * OH * OW), 0.0);
  for (int64_t b = 0; b < N * C; ++b)
    for (int64_t oh = 0; oh < OH; ++oh)
      for (int64_t ow = 0; ow < OW; ++ow) {
        double acc = 0;
        for (int64_t ih = 0; ih < H; ++ih) {
          if (mh[oh][ih] == 0) continue;
          double row = 0;
          for (int64_t iw = 0; iw < W; ++iw) row += mw[ow][iw] * xv[(b * H + ih) * W + iw];
          acc += mh[oh][ih] * row;
        }
        out[(b * OH + oh) * OW + ow] = acc;
      }
  return Tensor::from_vec(out, {N, C, OH, OW});
}

::testing::AssertionResult close(const Tensor& got, const Tensor& want, double tol) {
  if (got.sizes() != want.sizes())
    return ::testing::AssertionFailure() << "shape " << ::testing::PrintToString(got.sizes()) << " vs "
                                         << ::testing::PrintToString(want.sizes());
  const std::vector<double> g = values(got), w = values(want);
  for (std::size_t i = 0; i < g.size(); ++i)
    if (!(std::fabs(g[i] - w[i]) <= tol * (1 + std::fabs(w[i]))))
      return ::testing::AssertionFailure() << "[" << i << "] got " << g[i] << ", want " << w[i];
  return ::testing::AssertionSuccess();
}

F::InterpolateOptions opts(const char* mode, F::Size2 size, bool align = false, bool aa = false) {
  return F::InterpolateOptions().with_size(size).with_mode(mode).with_align_corners(align).with_antialias(aa);
}

TEST(InterpolateFilters, HandCheckedValues) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor ramp = Tensor::from_vec(std::vector<double>{0, 1, 2, 3}, {1, 1, 1, 4}).to(dev);
  // Output 3 of 8 reads src = 3.5 / 2 - 0.5 = 1.25: t = 0.25, taps 0..3 with A = -0.75 weights
  // -0.10546875, 0.87890625, 0.26171875, -0.03515625 (by hand), so 1.296875 (A = -0.75 keeps
  // constants exactly but not ramps); output 4 (t = 0.75) takes the mirrored weights: 1.703125.
  const std::vector<double> up = values(F::interpolate(ramp, opts("bicubic", {1, 8})));
  EXPECT_NEAR(up[3], 1.296875, 1e-15);
  EXPECT_NEAR(up[4], 1.703125, 1e-15);
  // Antialiased bilinear 4 -> 2 (support 2, triangle over (i + 1/2 - center) / 2): weights
  // 3/7, 3/7, 1/7 and 1/7, 3/7, 3/7, so the outputs are 5/7 and 16/7. Plain bilinear reads 0.5, 2.5.
  const std::vector<double> aa = values(F::interpolate(ramp, opts("bilinear", {1, 2}, false, true)));
  EXPECT_NEAR(aa[0], 5.0 / 7.0, 1e-15);
  EXPECT_NEAR(aa[1], 16.0 / 7.0, 1e-15);
  const std::vector<double> plain = values(F::interpolate(ramp, opts("bilinear", {1, 2})));
  EXPECT_NEAR(plain[0], 0.5, 1e-15);
  EXPECT_NEAR(plain[1], 2.5, 1e-15);
  // A constant image stays constant under every filter (the weights sum to 1).
  const Tensor flat = Tensor::full({1, 2, 9, 7}, 2.5, {DType::f64, dev});
  for (const char* mode : {"bilinear", "bicubic"})
    for (bool aa_on : {false, true})
      for (bool align : {false, true}) {
        const std::vector<double> v = values(F::interpolate(flat, opts(mode, {4, 11}, align, aa_on)));
        for (double e : v) ASSERT_NEAR(e, 2.5, 1e-13) << mode << " aa " << aa_on << " align " << align;
      }
}

TEST(InterpolateFilters, MatchFloat64Loops) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = rnd({2, 3, 9, 13}, 1);
  struct Case {
    const char* mode;
    bool aa;
    F::Size2 size;
    bool align;
  };
  const Case cases[] = {
      {"bicubic", false, {17, 29}, false}, {"bicubic", false, {17, 29}, true}, {"bicubic", false, {4, 5}, false},
      {"bicubic", false, {4, 5}, true},    {"bicubic", false, {1, 13}, true},  {"bilinear", true, {4, 5}, false},
      {"bilinear", true, {3, 6}, true},    {"bicubic", true, {4, 5}, false},   {"bicubic", true, {2, 3}, true},
      {"bicubic", true, {14, 20}, false},  {"bilinear", true, {14, 20}, false}, {"bicubic", true, {1, 1}, false},
  };
  for (const Case& c : cases) {
    Matrix mh, mw;
    if (c.aa) {
      const bool cubic = std::string(c.mode) == "bicubic";
      mh = antialias_matrix(9, c.size.h, c.align, cubic);
      mw = antialias_matrix(13, c.size.w, c.align, cubic);
    } else {
      mh = bicubic_matrix(9, c.size.h, c.align);
      mw = bicubic_matrix(13, c.size.w, c.align);
    }
    const Tensor want = apply(x, mh, mw);
    for (DType dt : {DType::f64, DType::f32}) {
      const Tensor got = F::interpolate(x.to(dt).to(dev), opts(c.mode, c.size, c.align, c.aa));
      EXPECT_TRUE(close(got, want, dt == DType::f64 ? 1e-12 : 1e-5))  // f32: weights in float, as PyTorch
          << c.mode << " aa " << c.aa << " " << c.size.h << "x" << c.size.w << " align " << c.align << " "
          << dtype_name(dt);
    }
  }
  // scale_factor: the source map uses 1 / scale_factor, as PyTorch.
  const Tensor got = F::interpolate(x.to(dev), F::InterpolateOptions().with_scale(1.7, 0.45).with_mode("bicubic"));
  EXPECT_TRUE(close(got, apply(x, bicubic_matrix(9, 15, false, 1.7), bicubic_matrix(13, 5, false, 0.45)), 1e-12));
  const Tensor got_aa = F::interpolate(
      x.to(dev), F::InterpolateOptions().with_scale(0.45, 0.3).with_mode("bicubic").with_antialias(true));
  EXPECT_TRUE(close(got_aa, apply(x, antialias_matrix(9, 4, false, true, 0.45), antialias_matrix(13, 3, false, true, 0.3)),
                    1e-12));
}

TEST(InterpolateFilters, OneDimensionalOnThreeDimInputs) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = rnd({2, 3, 11}, 2);
  const Tensor x4 = x.unsqueeze(2);
  const Matrix id = {{1.0}};
  for (bool align : {false, true}) {
    const Tensor y = F::interpolate(x.to(dev), F::InterpolateOptions().with_size(17).with_mode("linear").with_align_corners(align));
    ASSERT_EQ(y.sizes(), (Shape{2, 3, 17}));
    EXPECT_TRUE(close(y, apply(x4, id, linear_matrix(11, 17, align)).squeeze(2), 1e-12)) << "align " << align;
  }
  const Tensor yn = F::interpolate(x.to(dev), F::InterpolateOptions().with_scale(2.0));
  ASSERT_EQ(yn.sizes(), (Shape{2, 3, 22}));
  const std::vector<double> xv = values(x), yv = values(yn);
  for (int64_t i = 0; i < 22; ++i) EXPECT_EQ(yv[i], xv[i / 2]);
  const GradcheckResult r = gradcheck(
      [](const TensorList& t) { return F::interpolate(t[0], F::InterpolateOptions().with_scale(1.6).with_mode("linear")); },
      {x});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(InterpolateFilters, DimAndModeRulesFollowPyTorch) {
  const Tensor x3 = rnd({1, 2, 6}, 3), x4 = rnd({1, 2, 6, 6}, 4);
  expect_error([&] { F::interpolate(x3, F::InterpolateOptions().with_size(4).with_mode("bilinear")); },
               {"interpolate", "bilinear", "4-d", "[1, 2, 6]", "linear"});
  expect_error([&] { F::interpolate(x4, F::InterpolateOptions().with_size(4).with_mode("linear")); },
               {"interpolate", "linear", "3-d", "[1, 2, 6, 6]"});
  expect_error([&] { F::interpolate(x3, F::InterpolateOptions().with_size({2, 4})); },
               {"interpolate", "3-d", "one integer", "(2, 4)"});
  expect_error([&] { F::interpolate(rnd({2, 6}, 5), F::InterpolateOptions().with_size(4)); },
               {"interpolate", "[2, 6]", "unsqueeze"});
  expect_error([&] { F::interpolate(x4, F::InterpolateOptions().with_size(4).with_antialias(true)); },
               {"interpolate", "antialias", "nearest"});
  expect_error([&] { F::interpolate(x3, F::InterpolateOptions().with_size(4).with_mode("linear").with_antialias(true)); },
               {"interpolate", "antialias", "4-d"});
}

TEST(InterpolateFilters, Gradcheck) {
  const Tensor x = rnd({1, 2, 7, 6}, 5);
  auto check = [&](const char* what, const F::InterpolateOptions& o) {
    const GradcheckResult r = gradcheck([&](const TensorList& t) { return F::interpolate(t[0], o); }, {x});
    EXPECT_TRUE(r.ok) << what << ": " << r.message;
  };
  check("bicubic up", opts("bicubic", {11, 13}));
  check("bicubic up align", opts("bicubic", {11, 13}, true));
  check("bicubic down", opts("bicubic", {3, 4}));
  check("bicubic scale", F::InterpolateOptions().with_scale(1.45, 0.7).with_mode("bicubic"));
  check("bilinear aa down", opts("bilinear", {3, 2}, false, true));
  check("bilinear aa align", opts("bilinear", {4, 3}, true, true));
  check("bicubic aa down", opts("bicubic", {2, 4}, false, true));
  check("bicubic aa up", opts("bicubic", {10, 9}, false, true));
}

TEST(InterpolateFilters, CudaMatchesCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device cuda = Device::cuda(0);
  const Tensor x = rnd({2, 3, 37, 23}, 6).to(DType::f32);
  const Tensor xt = x.transpose(2, 3).contiguous().transpose(2, 3);  // strided input
  struct Case {
    const char* mode;
    bool aa, align;
    F::Size2 size;
  };
  for (const Case c : {Case{"bicubic", false, false, {64, 50}}, Case{"bicubic", false, true, {11, 9}},
                       Case{"bilinear", true, false, {9, 7}}, Case{"bicubic", true, false, {12, 5}},
                       Case{"bicubic", true, true, {50, 30}}}) {
    const F::InterpolateOptions o = opts(c.mode, c.size, c.align, c.aa);
    for (const Tensor& in : {x, xt}) {
      const Tensor xc = in.detach().requires_grad_(true);
      const Tensor xg = in.to(cuda).detach().requires_grad_(true);
      const Tensor yc = F::interpolate(xc, o), yg = F::interpolate(xg, o);
      EXPECT_TRUE(close(yg, yc, 1e-5)) << c.mode << " aa " << c.aa;
      const Tensor g = rnd(yc.sizes(), 7).to(DType::f32);
      BackwardOptions bc, bg;
      bc.grad_output = g;
      bg.grad_output = g.to(cuda);
      const Tensor gc = xc.grad(yc.backward(bc)), gg = xg.grad(yg.backward(bg));
      EXPECT_TRUE(close(gg, gc, 1e-5)) << c.mode << " aa " << c.aa << " backward";
    }
  }
  // bf16 computes in float.
  const Tensor yb = F::interpolate(x.to(DType::bf16).to(cuda), opts("bicubic", {20, 20}, false, true));
  EXPECT_TRUE(close(yb, F::interpolate(x.to(DType::bf16).to(DType::f32), opts("bicubic", {20, 20}, false, true)), 2e-2));
}

}  // namespace
}  // namespace flame::test
