// Pooling, interpolation and pixel shuffle (flame/nn/pool.h): forward against naive float64
// references written here from PyTorch's definitions (not from the kernels' geometry code), output
// shapes PyTorch gives, float64 gradchecks on the CPU, CUDA forward and gradients against the CPU
// (f32, bf16, f16), channels-last inputs, and the errors.
#include <cmath>
#include <functional>
#include <limits>
#include <optional>

#include "flame/nn/pool.h"
#include "gradcheck.h"
#include "test_util.h"

namespace flame::test {
namespace {
namespace F = flame::nn::functional;

Tensor rnd(const Shape& s, DType dt = DType::f64, Device dev = Device::cpu(), uint64_t seed = 7) {
  return make_input({s, dt, Layout::contiguous, -2.0, 2.0}, dev, seed);
}
std::vector<double> host(const Tensor& t) { return t.to(Device::cpu()).to(DType::f64).contiguous().to_vec<double>(); }

// ---- naive references on [N, C, H, W] float64 data ----
struct Win {
  int64_t k, s, p, d;
};
int64_t pool_out(int64_t in, Win w, bool ceil_mode) {
  const double v = static_cast<double>(in + 2 * w.p - w.d * (w.k - 1) - 1) / static_cast<double>(w.s);
  int64_t o = static_cast<int64_t>(ceil_mode ? std::ceil(v) : std::floor(v)) + 1;
  if (ceil_mode && (o - 1) * w.s >= in + w.p) --o;
  return o;
}

std::vector<double> ref_max_pool(const std::vector<double>& x, int64_t B, int64_t H, int64_t W, Win wh, Win ww,
                                 bool ceil_mode, std::vector<int64_t>* idx = nullptr) {
  const int64_t OH = pool_out(H, wh, ceil_mode), OW = pool_out(W, ww, ceil_mode);
  std::vector<double> out;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t oh = 0; oh < OH; ++oh)
      for (int64_t ow = 0; ow < OW; ++ow) {
        double m = -std::numeric_limits<double>::infinity();
        int64_t at = -1;
        for (int64_t i = 0; i < wh.k; ++i)
          for (int64_t j = 0; j < ww.k; ++j) {
            const int64_t h = oh * wh.s - wh.p + i * wh.d, w = ow * ww.s - ww.p + j * ww.d;
            if (h < 0 || h >= H || w < 0 || w >= W) continue;
            const double v = x[(b * H + h) * W + w];
            if (at < 0 || v > m) m = v, at = h * W + w;
          }
        out.push_back(m);
        if (idx) idx->push_back(at);
      }
  return out;
}

std::vector<double> ref_avg_pool(const std::vector<double>& x, int64_t B, int64_t H, int64_t W, Win wh, Win ww,
                                 bool ceil_mode, bool count_include_pad, int64_t divisor_override) {
  const int64_t OH = pool_out(H, wh, ceil_mode), OW = pool_out(W, ww, ceil_mode);
  std::vector<double> out;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t oh = 0; oh < OH; ++oh)
      for (int64_t ow = 0; ow < OW; ++ow) {
        double s = 0;
        int64_t inside = 0, padded = 0;  // taps inside the input / inside input + padding
        for (int64_t i = 0; i < wh.k; ++i)
          for (int64_t j = 0; j < ww.k; ++j) {
            const int64_t h = oh * wh.s - wh.p + i, w = ow * ww.s - ww.p + j;
            if (h < H + wh.p && w < W + ww.p) ++padded;
            if (h < 0 || h >= H || w < 0 || w >= W) continue;
            s += x[(b * H + h) * W + w];
            ++inside;
          }
        const int64_t div = divisor_override > 0 ? divisor_override : count_include_pad ? padded : inside;
        out.push_back(s / static_cast<double>(div));
      }
  return out;
}

std::vector<double> ref_adaptive(const std::vector<double>& x, int64_t B, int64_t H, int64_t W, int64_t OH,
                                 int64_t OW, bool is_max) {
  std::vector<double> out;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t oh = 0; oh < OH; ++oh)
      for (int64_t ow = 0; ow < OW; ++ow) {
        const int64_t h0 = static_cast<int64_t>(std::floor(double(oh * H) / double(OH)));
        const int64_t h1 = static_cast<int64_t>(std::ceil(double((oh + 1) * H) / double(OH)));
        const int64_t w0 = static_cast<int64_t>(std::floor(double(ow * W) / double(OW)));
        const int64_t w1 = static_cast<int64_t>(std::ceil(double((ow + 1) * W) / double(OW)));
        double acc = is_max ? -INFINITY : 0.0;
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t w = w0; w < w1; ++w) {
            const double v = x[(b * H + h) * W + w];
            acc = is_max ? std::max(acc, v) : acc + v;
          }
        out.push_back(is_max ? acc : acc / double((h1 - h0) * (w1 - w0)));
      }
  return out;
}

// Source coordinate of PyTorch's upsample kernels for one dim.
struct Src {
  std::string mode;
  bool align;
  std::optional<double> sf;
};
std::vector<double> ref_interp(const std::vector<double>& x, int64_t B, int64_t H, int64_t W, int64_t OH, int64_t OW,
                               const Src& sh, const Src& sw) {
  auto taps = [](const Src& s, int64_t in, int64_t out, int64_t o) {
    std::vector<std::pair<int64_t, double>> t;
    if (s.mode == "bilinear") {
      double src;
      if (s.align) {
        src = out > 1 ? double(o) * double(in - 1) / double(out - 1) : 0.0;
      } else {
        const double scale = s.sf ? 1.0 / *s.sf : double(in) / double(out);
        src = std::max(0.0, (double(o) + 0.5) * scale - 0.5);
      }
      const int64_t i0 = std::min<int64_t>(static_cast<int64_t>(std::floor(src)), in - 1);
      const int64_t i1 = std::min<int64_t>(i0 + 1, in - 1);
      const double l = src - double(i0);
      t.push_back({i0, 1 - l});
      t.push_back({i1, l});
    } else {
      // PyTorch's CPU 'nearest' copies when out == in and halves when out == 2*in.
      if (s.mode == "nearest" && out == in) return decltype(t){{o, 1.0}};
      if (s.mode == "nearest" && out == 2 * in) return decltype(t){{o / 2, 1.0}};
      const float scale = static_cast<float>(s.sf ? 1.0 / *s.sf : double(in) / double(out));
      const float src = s.mode == "nearest-exact" ? (float(o) + 0.5f) * scale : float(o) * scale;
      t.push_back({std::min<int64_t>(static_cast<int64_t>(std::floor(src)), in - 1), 1.0});
    }
    return t;
  };
  std::vector<double> out;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t oh = 0; oh < OH; ++oh)
      for (int64_t ow = 0; ow < OW; ++ow) {
        double acc = 0;
        for (auto [h, a] : taps(sh, H, OH, oh))
          for (auto [w, c] : taps(sw, W, OW, ow)) acc += a * c * x[(b * H + h) * W + w];
        out.push_back(acc);
      }
  return out;
}

::testing::AssertionResult close_to(const Tensor& got, const std::vector<double>& want, double tol) {
  const std::vector<double> g = host(got);
  if (g.size() != want.size())
    return ::testing::AssertionFailure() << "size " << g.size() << " vs reference " << want.size();
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (!(std::abs(g[i] - want[i]) <= tol * (1 + std::abs(want[i]))))
      return ::testing::AssertionFailure() << "element " << i << ": got " << g[i] << ", want " << want[i];
  }
  return ::testing::AssertionSuccess();
}

double tol_for(DType dt) { return dt == DType::f64 ? 1e-12 : dt == DType::f32 ? 1e-5 : 1e-2; }

// Gradient of sum(f(x) * gout) with respect to x (x is made a leaf here).
Tensor grad_of(const std::function<Tensor(const Tensor&)>& f, const Tensor& x, const Tensor& gout) {
  Tensor leaf = x.detach().clone().requires_grad_();
  Tensor y = f(leaf);
  BackwardOptions o;
  o.grad_output = gout;
  return y.backward(o).get(leaf);
}

// ---- max pooling ----

TEST(Pool, OutputShapesArePyTorchs) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = rnd({2, 3, 7, 6}, DType::f32, test_device());
  EXPECT_EQ(F::max_pool2d(x, 3, 2, 1).sizes(), (Shape{2, 3, 4, 3}));
  EXPECT_EQ(F::max_pool2d(x, 2, 2, 0, 1, true).sizes(), (Shape{2, 3, 4, 3}));
  EXPECT_EQ(F::max_pool2d(x, {3, 2}, {2, 1}, {1, 0}, {1, 2}).sizes(), (Shape{2, 3, 4, 4}));
  // ceil_mode drops a last window that would start in the right padding: 5 + 2*1, k2 s2 -> 3.
  EXPECT_EQ(F::max_pool2d(rnd({1, 1, 5, 5}, DType::f32, test_device()), 2, 2, 1, 1, true).sizes(), (Shape{1, 1, 3, 3}));
  EXPECT_EQ(F::avg_pool2d(x, 3, 2, 1, true).sizes(), (Shape{2, 3, 4, 4}));
  EXPECT_EQ(F::max_pool1d(rnd({2, 3, 9}, DType::f32, test_device()), 4, 3).sizes(), (Shape{2, 3, 2}));
  EXPECT_EQ(F::adaptive_avg_pool2d(x, {5, 1}).sizes(), (Shape{2, 3, 5, 1}));
  EXPECT_EQ(F::max_pool2d(rnd({3, 8, 8}, DType::f32, test_device()), 2).sizes(), (Shape{3, 4, 4}));  // unbatched
}

struct MaxCase {
  Shape shape;
  Win h, w;
  bool ceil_mode;
};
const std::vector<MaxCase>& max_cases() {
  static const std::vector<MaxCase> cases = {
      {{2, 3, 7, 9}, {3, 2, 1, 1}, {3, 2, 1, 1}, false}, {{2, 3, 7, 9}, {3, 2, 1, 1}, {3, 2, 1, 1}, true},
      {{1, 2, 8, 11}, {2, 2, 0, 1}, {3, 3, 1, 1}, true}, {{1, 2, 9, 10}, {3, 1, 1, 2}, {2, 2, 1, 3}, false},
      {{2, 1, 5, 5}, {5, 1, 2, 1}, {1, 1, 0, 1}, false}, {{1, 1, 6, 5}, {2, 3, 1, 1}, {4, 2, 2, 1}, true},
  };
  return cases;
}

TEST(Pool, MaxPool2dMatchesReferenceWithIndices) {
  FLAME_SKIP_IF_NO_DEVICE();
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    for (const MaxCase& c : max_cases()) {
      const Tensor x = rnd(c.shape, dt, test_device(), 11);
      auto [y, idx] = F::max_pool2d_with_indices(x, {c.h.k, c.w.k}, {c.h.s, c.w.s}, {c.h.p, c.w.p}, {c.h.d, c.w.d},
                                                 c.ceil_mode);
      std::vector<int64_t> want_idx;
      const auto want = ref_max_pool(host(x), c.shape[0] * c.shape[1], c.shape[2], c.shape[3], c.h, c.w, c.ceil_mode,
                                     &want_idx);
      EXPECT_TRUE(close_to(y, want, 0.0)) << dtype_name(dt) << " " << shape_str(c.shape);  // max is exact
      EXPECT_EQ(idx.dtype(), DType::i64);
      EXPECT_EQ(idx.to(Device::cpu()).to_vec<int64_t>(), want_idx) << shape_str(c.shape);
    }
  }
}

TEST(Pool, MaxPool1dIsTheHeightOnePool) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = rnd({3, 4, 13}, DType::f32, test_device(), 5);
  auto [y, idx] = F::max_pool1d_with_indices(x, 3, 2, 1, 2, true);
  const Win one{1, 1, 0, 1}, w{3, 2, 1, 2};
  std::vector<int64_t> want_idx;
  EXPECT_TRUE(close_to(y, ref_max_pool(host(x), 12, 1, 13, one, w, true, &want_idx), 0.0));
  EXPECT_EQ(idx.to(Device::cpu()).to_vec<int64_t>(), want_idx);
  const Tensor x2 = rnd({4, 10}, DType::f32, test_device(), 6);  // unbatched [C, L]
  EXPECT_TRUE(close_to(F::max_pool1d(x2, 3), ref_max_pool(host(x2), 4, 1, 10, one, {3, 3, 0, 1}, false), 0.0));
}

TEST(Pool, MaxPoolPropagatesNan) {
  FLAME_SKIP_IF_NO_DEVICE();
  std::vector<float> v(16);
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(i);
  v[5] = NAN;
  const Tensor x = Tensor::from_vec<float>(v, {1, 1, 4, 4}, test_device());
  const std::vector<float> y = F::max_pool2d(x, 2).to(Device::cpu()).to_vec<float>();
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_EQ(y[1], 7.0f);
  EXPECT_EQ(y[3], 15.0f);
}

TEST(Pool, EmptyBatchGivesEmptyResultsAndGradients) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = rnd({0, 3, 5, 5}, DType::f32, test_device(), 1);
  EXPECT_EQ(F::max_pool2d(x, 2).sizes(), (Shape{0, 3, 2, 2}));
  EXPECT_EQ(F::avg_pool2d(x, 3, 2, 1).sizes(), (Shape{0, 3, 3, 3}));
  EXPECT_EQ(F::interpolate(x, F::InterpolateOptions().with_scale(2)).sizes(), (Shape{0, 3, 10, 10}));
  const Tensor g = grad_of([](const Tensor& t) { return F::max_pool2d(t, 2); }, x,
                           Tensor::zeros({0, 3, 2, 2}, {DType::f32, test_device()}));
  ASSERT_TRUE(g.defined());
  EXPECT_EQ(g.sizes(), x.sizes());
}

// ---- average and adaptive pooling ----

TEST(Pool, AvgPool2dMatchesReference) {
  FLAME_SKIP_IF_NO_DEVICE();
  struct C {
    Shape shape;
    Win h, w;
    bool ceil_mode, include_pad;
    int64_t divisor;
  };
  const std::vector<C> cases = {
      {{2, 3, 7, 9}, {3, 2, 1, 1}, {3, 2, 1, 1}, false, true, 0},  {{2, 3, 7, 9}, {3, 2, 1, 1}, {3, 2, 1, 1}, true, true, 0},
      {{2, 3, 7, 9}, {3, 2, 1, 1}, {3, 2, 1, 1}, true, false, 0},  {{1, 2, 8, 5}, {4, 3, 2, 1}, {2, 1, 1, 1}, true, true, 0},
      {{1, 2, 8, 5}, {4, 3, 2, 1}, {2, 1, 1, 1}, false, false, 0}, {{1, 2, 6, 6}, {3, 3, 0, 1}, {2, 2, 1, 1}, false, true, 5},
  };
  for (DType dt : {DType::f64, DType::f32, DType::f16}) {
    for (const C& c : cases) {
      const Tensor x = rnd(c.shape, dt, test_device(), 3);
      const Tensor y = F::avg_pool2d(x, {c.h.k, c.w.k}, {c.h.s, c.w.s}, {c.h.p, c.w.p}, c.ceil_mode, c.include_pad,
                                     c.divisor > 0 ? std::optional<int64_t>(c.divisor) : std::nullopt);
      const auto want = ref_avg_pool(host(x), c.shape[0] * c.shape[1], c.shape[2], c.shape[3], c.h, c.w, c.ceil_mode,
                                     c.include_pad, c.divisor);
      EXPECT_TRUE(close_to(y, want, tol_for(dt))) << dtype_name(dt) << " " << shape_str(c.shape) << " ceil " << c.ceil_mode;
    }
  }
  const Tensor x1 = rnd({2, 3, 11}, DType::f32, test_device(), 4);
  EXPECT_TRUE(close_to(F::avg_pool1d(x1, 4, 3, 2, true, false),
                       ref_avg_pool(host(x1), 6, 1, 11, {1, 1, 0, 1}, {4, 3, 2, 1}, true, false, 0), 1e-5));
}

TEST(Pool, AdaptivePoolsMatchReference) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = rnd({2, 3, 7, 10}, DType::f32, test_device(), 9);
  for (Shape out : {Shape{3, 4}, Shape{1, 1}, Shape{7, 10}, Shape{9, 13}, Shape{5, 3}}) {
    EXPECT_TRUE(close_to(F::adaptive_avg_pool2d(x, {out[0], out[1]}), ref_adaptive(host(x), 6, 7, 10, out[0], out[1], false),
                         1e-5))
        << shape_str(out);
    EXPECT_TRUE(close_to(F::adaptive_max_pool2d(x, {out[0], out[1]}), ref_adaptive(host(x), 6, 7, 10, out[0], out[1], true),
                         0.0))
        << shape_str(out);
  }
  const Tensor x1 = rnd({2, 5, 13}, DType::f32, test_device(), 2);
  EXPECT_TRUE(close_to(F::adaptive_avg_pool1d(x1, 4), ref_adaptive(host(x1), 10, 1, 13, 1, 4, false), 1e-5));
  EXPECT_TRUE(close_to(F::adaptive_max_pool1d(x1, 6), ref_adaptive(host(x1), 10, 1, 13, 1, 6, true), 0.0));
}

TEST(Pool, ChannelsLastInputGivesTheSameResult) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor nhwc = rnd({2, 7, 9, 5}, DType::f32, test_device(), 12);
  const Tensor cl = nhwc.permute({0, 3, 1, 2});  // NCHW view with channels-last strides
  const Tensor dense = cl.contiguous();
  ASSERT_FALSE(cl.is_contiguous());
  EXPECT_TRUE(all_close(F::max_pool2d(cl, 3, 2, 1), F::max_pool2d(dense, 3, 2, 1), 0, 0));
  EXPECT_TRUE(all_close(F::avg_pool2d(cl, 3, 2, 1, true), F::avg_pool2d(dense, 3, 2, 1, true), 0, 0));
  EXPECT_TRUE(all_close(F::adaptive_avg_pool2d(cl, {3, 4}), F::adaptive_avg_pool2d(dense, {3, 4}), 0, 0));
  const auto bil = F::InterpolateOptions().with_scale(1.7, 2.3).with_mode("bilinear");
  EXPECT_TRUE(all_close(F::interpolate(cl, bil), F::interpolate(dense, bil), 0, 0));
  // Gradients reach the channels-last leaf with its layout.
  Tensor leaf = nhwc.detach().clone().requires_grad_();
  Tensor y = F::max_pool2d(leaf.permute({0, 3, 1, 2}), 2);
  Gradients g = sum(y * y).backward();
  Tensor want_leaf = nhwc.detach().clone().requires_grad_();
  Tensor yd = F::max_pool2d(want_leaf.permute({0, 3, 1, 2}).contiguous(), 2);
  Gradients gd = sum(yd * yd).backward();
  EXPECT_TRUE(all_close(g.get(leaf), gd.get(want_leaf), 0, 0));
}

// ---- gradient checks (float64, CPU) ----

TEST(PoolGradcheck, MaxAvgAdaptive) {
  const Tensor x = rnd({2, 2, 7, 6}, DType::f64, Device::cpu(), 21);
  auto check = [&](const char* what, std::function<Tensor(const Tensor&)> f, const Tensor& in) {
    const GradcheckResult r = gradcheck([&](const TensorList& t) { return f(t[0]); }, {in});
    EXPECT_TRUE(r.ok) << what << ": " << r.message;
  };
  check("max 3x3 s2 p1", [](const Tensor& t) { return F::max_pool2d(t, 3, 2, 1); }, x);
  check("max ceil dil", [](const Tensor& t) { return F::max_pool2d(t, {2, 3}, {2, 1}, {1, 1}, {2, 1}, true); }, x);
  check("avg ceil pad", [](const Tensor& t) { return F::avg_pool2d(t, 3, 2, 1, true, true); }, x);
  check("avg no pad count", [](const Tensor& t) { return F::avg_pool2d(t, {3, 2}, {2, 3}, {1, 1}, true, false); }, x);
  check("avg divisor", [](const Tensor& t) { return F::avg_pool2d(t, 2, 1, 0, false, true, 3); }, x);
  check("adaptive avg", [](const Tensor& t) { return F::adaptive_avg_pool2d(t, {4, 5}); }, x);
  check("adaptive avg up", [](const Tensor& t) { return F::adaptive_avg_pool2d(t, {9, 8}); }, x);
  check("adaptive max", [](const Tensor& t) { return F::adaptive_max_pool2d(t, {3, 4}); }, x);
  const Tensor x1 = rnd({2, 3, 11}, DType::f64, Device::cpu(), 22);
  check("max1d", [](const Tensor& t) { return F::max_pool1d(t, 3, 2, 1, 2, true); }, x1);
  check("avg1d", [](const Tensor& t) { return F::avg_pool1d(t, 4, 3, 2, true, false); }, x1);
  check("adaptive avg1d", [](const Tensor& t) { return F::adaptive_avg_pool1d(t, 4); }, x1);
}

// ---- interpolation ----

TEST(Upsample, NearestAndBilinearMatchReference) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = rnd({2, 3, 5, 7}, DType::f64, test_device(), 31);
  struct C {
    std::string mode;
    std::optional<bool> align;
    std::optional<F::Size2> size;
    std::optional<std::pair<double, double>> sf;
    bool recompute;
  };
  const std::vector<C> cases = {
      {"nearest", {}, F::Size2{10, 14}, {}, false},          {"nearest", {}, F::Size2{8, 3}, {}, false},
      {"nearest", {}, {}, std::pair{1.7, 2.5}, false},        {"nearest", {}, {}, std::pair{1.7, 2.5}, true},
      {"nearest", {}, {}, std::pair{1.1, 2.0}, false},
      {"nearest-exact", {}, F::Size2{9, 4}, {}, false},       {"nearest-exact", {}, {}, std::pair{2.0, 0.6}, false},
      {"bilinear", false, F::Size2{10, 14}, {}, false},       {"bilinear", true, F::Size2{10, 14}, {}, false},
      {"bilinear", false, F::Size2{3, 4}, {}, false},         {"bilinear", true, F::Size2{1, 5}, {}, false},
      {"bilinear", false, {}, std::pair{1.3, 2.7}, false},    {"bilinear", false, {}, std::pair{1.3, 2.7}, true},
      {"bilinear", true, {}, std::pair{0.7, 1.5}, false},
  };
  for (const C& c : cases) {
    F::InterpolateOptions o;
    o.mode = c.mode;
    o.align_corners = c.align;
    o.size = c.size;
    o.scale_factor = c.sf;
    o.recompute_scale_factor = c.recompute;
    const Tensor y = F::interpolate(x, o);
    const int64_t OH = c.size ? c.size->h : static_cast<int64_t>(std::floor(5 * c.sf->first));
    const int64_t OW = c.size ? c.size->w : static_cast<int64_t>(std::floor(7 * c.sf->second));
    ASSERT_EQ(y.sizes(), (Shape{2, 3, OH, OW})) << c.mode;
    const std::optional<double> sfh = c.sf && !c.recompute ? std::optional(c.sf->first) : std::nullopt;
    const std::optional<double> sfw = c.sf && !c.recompute ? std::optional(c.sf->second) : std::nullopt;
    const bool al = c.align.value_or(false);
    EXPECT_TRUE(close_to(y, ref_interp(host(x), 6, 5, 7, OH, OW, {c.mode, al, sfh}, {c.mode, al, sfw}), 1e-12))
        << c.mode << " align " << al << " recompute " << c.recompute << " out " << OH << "x" << OW;
  }
}

TEST(Upsample, Bf16AndHalfComputeInFloat) {
  FLAME_SKIP_IF_NO_DEVICE();
  for (DType dt : {DType::bf16, DType::f16}) {
    const Tensor x = rnd({2, 4, 6, 5}, dt, test_device(), 32);
    const Tensor y = F::interpolate(x, F::InterpolateOptions().with_scale(2.0).with_mode("bilinear"));
    EXPECT_EQ(y.dtype(), dt);
    const Src s{"bilinear", false, 2.0};
    EXPECT_TRUE(close_to(y, ref_interp(host(x), 8, 6, 5, 12, 10, s, s), 1e-2)) << dtype_name(dt);
  }
}

TEST(UpsampleGradcheck, AllModes) {
  const Tensor x = rnd({2, 2, 5, 4}, DType::f64, Device::cpu(), 41);
  auto check = [&](const char* what, F::InterpolateOptions o) {
    const GradcheckResult r = gradcheck([&](const TensorList& t) { return F::interpolate(t[0], o); }, {x});
    EXPECT_TRUE(r.ok) << what << ": " << r.message;
  };
  check("nearest 2x", F::InterpolateOptions().with_scale(2.0));
  check("nearest odd", F::InterpolateOptions().with_size({7, 3}));
  {
    // floor(23 * 1.04) == 23 and 5 * 2 == 10: the copy / halving maps of legacy nearest.
    const GradcheckResult r = gradcheck(
        [](const TensorList& t) { return F::interpolate(t[0], F::InterpolateOptions().with_scale(1.04, 2.0)); },
        {rnd({1, 2, 23, 5}, DType::f64, Device::cpu(), 42)});
    EXPECT_TRUE(r.ok) << "nearest copy/halve: " << r.message;
  }
  check("nearest-exact 1.6", F::InterpolateOptions().with_scale(1.6, 2.3).with_mode("nearest-exact"));
  check("bilinear 1.7", F::InterpolateOptions().with_scale(1.7, 2.6).with_mode("bilinear"));
  check("bilinear down", F::InterpolateOptions().with_size({3, 3}).with_mode("bilinear"));
  check("bilinear align", F::InterpolateOptions().with_size({9, 7}).with_mode("bilinear").with_align_corners(true));
  check("bilinear recompute",
        F::InterpolateOptions().with_scale(1.5).with_mode("bilinear").with_recompute_scale_factor(true));
}

TEST(Upsample, ErrorsNameTheOp) {
  const Tensor x = rnd({1, 2, 4, 4}, DType::f32);
  expect_error([&] { F::interpolate(x, F::InterpolateOptions().with_mode("trilinear").with_scale(2)); },
               {"interpolate", "trilinear"});
  expect_error([&] { F::interpolate(x, F::InterpolateOptions()); }, {"interpolate", "size", "scale_factor"});
  expect_error([&] { F::interpolate(x, F::InterpolateOptions().with_scale(2).with_align_corners(true)); },
               {"interpolate", "align_corners", "nearest"});
  expect_error([&] { F::interpolate(x, F::InterpolateOptions().with_scale(-1)); }, {"interpolate", "scale_factor"});
  expect_error([&] { F::interpolate(rnd({4, 4}, DType::f32), F::InterpolateOptions().with_scale(2)); },
               {"interpolate", "[4, 4]"});
}

TEST(Pool, ErrorsNameOpAndShapes) {
  const Tensor x = rnd({1, 2, 4, 4}, DType::f32);
  expect_error([&] { F::max_pool2d(x, 3, 1, 2); }, {"max_pool2d", "padding 2", "half"});
  expect_error([&] { F::max_pool2d(x, 5); }, {"max_pool2d", "[1, 2, 4, 4]", "too small"});
  expect_error([&] { F::max_pool2d(x, 0); }, {"max_pool2d", "kernel 0"});
  expect_error([&] { F::max_pool2d(rnd({2, 4}, DType::f32), 2); }, {"max_pool2d", "[2, 4]"});
  expect_error([&] { F::max_pool2d(Tensor::ones({1, 1, 4, 4}, {DType::i64}), 2); }, {"max_pool2d", "i64"});
  expect_error([&] { F::avg_pool2d(x, 2, 2, 0, false, true, 0); }, {"avg_pool2d", "divisor_override"});
  expect_error([&] { F::adaptive_avg_pool2d(x, {0, 2}); }, {"adaptive_avg_pool2d", "output size"});
  expect_error([&] { F::max_pool1d(x, 2); }, {"max_pool1d", "[1, 2, 4, 4]"});
  expect_error([&] { F::pixel_shuffle(rnd({1, 3, 2, 2}, DType::f32), 2); }, {"pixel_shuffle", "3", "4"});
  expect_error([&] { F::pixel_unshuffle(rnd({1, 3, 5, 4}, DType::f32), 2); }, {"pixel_unshuffle", "[1, 3, 5, 4]"});
}

// ---- pixel shuffle ----

TEST(PixelShuffle, MatchesDefinitionAndRoundTrips) {
  FLAME_SKIP_IF_NO_DEVICE();
  const int64_t r = 3, C = 2, H = 2, W = 4;
  const Tensor x = rnd({2, C * r * r, H, W}, DType::f32, test_device(), 51);
  const Tensor y = F::pixel_shuffle(x, r);
  ASSERT_EQ(y.sizes(), (Shape{2, C, H * r, W * r}));
  const std::vector<double> xv = host(x), yv = host(y);
  // out[n, c, h*r + i, w*r + j] = in[n, c*r*r + i*r + j, h, w]
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t h = 0; h < H * r; ++h)
        for (int64_t w = 0; w < W * r; ++w) {
          const int64_t ic = c * r * r + (h % r) * r + (w % r);
          ASSERT_EQ(yv[((n * C + c) * H * r + h) * W * r + w], xv[((n * C * r * r + ic) * H + h / r) * W + w / r]);
        }
  EXPECT_TRUE(all_close(F::pixel_unshuffle(y, r), x, 0, 0));
  const Tensor x5 = rnd({2, 3, 8, 3, 5}, DType::f32, test_device(), 52);  // extra leading dims
  EXPECT_TRUE(all_close(F::pixel_unshuffle(F::pixel_shuffle(x5, 2), 2), x5, 0, 0));
  const GradcheckResult g =
      gradcheck([](const TensorList& t) { return F::pixel_shuffle(t[0], 2); }, {rnd({1, 8, 3, 2}, DType::f64)});
  EXPECT_TRUE(g.ok) << g.message;
  const GradcheckResult gu =
      gradcheck([](const TensorList& t) { return F::pixel_unshuffle(t[0], 2); }, {rnd({1, 2, 4, 6}, DType::f64)});
  EXPECT_TRUE(gu.ok) << gu.message;
}

// ---- CUDA against the CPU reference: forward and gradients, every floating dtype ----

struct DevCase {
  const char* name;
  Shape shape;
  std::function<Tensor(const Tensor&)> f;
};
std::vector<DevCase> device_cases() {
  return {
      {"max3x3s2p1", {2, 5, 13, 11}, [](const Tensor& t) { return F::max_pool2d(t, 3, 2, 1); }},
      {"max_ceil_dil", {2, 3, 12, 9}, [](const Tensor& t) { return F::max_pool2d(t, {3, 2}, {2, 2}, {1, 1}, {2, 1}, true); }},
      {"avg3x3s2p1", {2, 5, 13, 11}, [](const Tensor& t) { return F::avg_pool2d(t, 3, 2, 1); }},
      {"avg_ceil_nopad", {2, 3, 12, 9}, [](const Tensor& t) { return F::avg_pool2d(t, {4, 3}, {3, 2}, {2, 1}, true, false); }},
      {"avg_divisor", {1, 4, 8, 8}, [](const Tensor& t) { return F::avg_pool2d(t, 3, 1, 1, false, true, 7); }},
      {"adaptive_avg", {2, 3, 13, 10}, [](const Tensor& t) { return F::adaptive_avg_pool2d(t, {5, 7}); }},
      {"adaptive_max", {2, 3, 13, 10}, [](const Tensor& t) { return F::adaptive_max_pool2d(t, {4, 3}); }},
      {"max1d", {3, 4, 17}, [](const Tensor& t) { return F::max_pool1d(t, 4, 3, 2, 1, true); }},
      {"avg1d", {3, 4, 17}, [](const Tensor& t) { return F::avg_pool1d(t, 3, 2, 1); }},
      {"nearest2x", {2, 3, 9, 7}, [](const Tensor& t) { return F::interpolate(t, F::InterpolateOptions().with_scale(2)); }},
      {"nearest_odd", {2, 3, 9, 7}, [](const Tensor& t) { return F::interpolate(t, F::InterpolateOptions().with_size({13, 5})); }},
      {"nearest_copy", {2, 3, 23, 7},
       [](const Tensor& t) { return F::interpolate(t, F::InterpolateOptions().with_scale(1.04, 2.0)); }},
      {"nearest_exact", {2, 3, 9, 7},
       [](const Tensor& t) { return F::interpolate(t, F::InterpolateOptions().with_scale(1.7, 0.6).with_mode("nearest-exact")); }},
      {"bilinear2x", {2, 3, 9, 7},
       [](const Tensor& t) { return F::interpolate(t, F::InterpolateOptions().with_scale(2).with_mode("bilinear")); }},
      {"bilinear_align", {2, 3, 9, 7},
       [](const Tensor& t) {
         return F::interpolate(t, F::InterpolateOptions().with_size({20, 11}).with_mode("bilinear").with_align_corners(true));
       }},
      {"bilinear_frac", {2, 3, 9, 7},
       [](const Tensor& t) { return F::interpolate(t, F::InterpolateOptions().with_scale(1.37, 0.71).with_mode("bilinear")); }},
      {"pixel_shuffle", {2, 8, 5, 3}, [](const Tensor& t) { return F::pixel_shuffle(t, 2); }},
      // Widths that are whole 16-byte vectors select the vectorised nearest paths (Note [Pool fast
      // paths]): factor 2 x 2, 3 x 4 (f64 falls back: 4 does not divide its 2-element vector),
      // nearest-exact 2 x 2, and 2 x 1.
      {"nearest2x_vec", {2, 3, 5, 16}, [](const Tensor& t) { return F::interpolate(t, F::InterpolateOptions().with_scale(2)); }},
      {"nearest_3x4_vec", {2, 3, 5, 8}, [](const Tensor& t) { return F::interpolate(t, F::InterpolateOptions().with_size({15, 32})); }},
      {"nearest_exact2x_vec", {2, 3, 6, 8},
       [](const Tensor& t) { return F::interpolate(t, F::InterpolateOptions().with_scale(2).with_mode("nearest-exact")); }},
      {"nearest_2x1_vec", {2, 3, 5, 16},
       [](const Tensor& t) { return F::interpolate(t, F::InterpolateOptions().with_scale(2.0, 1.0)); }},
  };
}

TEST(PoolCuda, ForwardAndGradientsMatchCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    for (const DevCase& c : device_cases()) {
      const Tensor x = rnd(c.shape, dt, Device::cpu(), 61);
      const Tensor xc = x.to(Device::cuda());
      // Both devices run on the same (rounded) values, so max pools and nearest are exact.
      const Tensor y_cpu = c.f(x), y_gpu = c.f(xc);
      const double tol = dt == DType::f64 ? 1e-12 : dt == DType::f32 ? 1e-5 : 1e-2;
      EXPECT_TRUE(all_close(y_gpu, y_cpu, tol, tol)) << c.name << " " << dtype_name(dt);
      const Tensor gout = rnd(y_cpu.sizes(), dt, Device::cpu(), 62);
      const Tensor g_cpu = grad_of(c.f, x, gout), g_gpu = grad_of(c.f, xc, gout.to(Device::cuda()));
      ASSERT_TRUE(g_gpu.defined() && g_gpu.device().is_cuda()) << c.name;
      EXPECT_TRUE(all_close(g_gpu, g_cpu, tol, tol)) << c.name << " grad " << dtype_name(dt);
    }
  }
}

TEST(PoolCuda, ChannelsLastAndLargePlanes) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor nhwc = rnd({2, 33, 40, 24}, DType::bf16, Device::cpu(), 71);
  const Tensor cl_cpu = nhwc.permute({0, 3, 1, 2}), cl_gpu = nhwc.to(Device::cuda()).permute({0, 3, 1, 2});
  for (const DevCase& c : device_cases()) {
    if (std::string(c.name) == "max1d" || std::string(c.name) == "avg1d") continue;
    EXPECT_TRUE(all_close(c.f(cl_gpu), c.f(cl_cpu), 1e-2, 1e-2)) << c.name;
    const Tensor gout = rnd(c.f(cl_cpu).sizes(), DType::bf16, Device::cpu(), 72);
    EXPECT_TRUE(all_close(grad_of(c.f, cl_gpu, gout.to(Device::cuda())), grad_of(c.f, cl_cpu, gout), 1e-2, 1e-2))
        << c.name << " grad";
  }
}

// The fast paths at the benchmark's kind of shape (several planes, even sizes) and the int64
// indices they write when asked for them (the backward may keep int32 ones internally).
TEST(PoolCuda, FastPathsMatchCpuOnLargerShapes) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor x = rnd({2, 16, 32, 40}, DType::bf16, Device::cpu(), 81);
  const Tensor xc = x.to(Device::cuda());
  const std::vector<DevCase> cases = {
      {"max3x3s2p1", {}, [](const Tensor& t) { return F::max_pool2d(t, 3, 2, 1); }},
      {"max2x2", {}, [](const Tensor& t) { return F::max_pool2d(t, 2); }},
      {"avg3x3s2p1", {}, [](const Tensor& t) { return F::avg_pool2d(t, 3, 2, 1); }},
      {"avg3x3s1p1_nopad", {}, [](const Tensor& t) { return F::avg_pool2d(t, 3, 1, 1, false, false); }},
      {"nearest2x", {}, [](const Tensor& t) { return F::interpolate(t, F::InterpolateOptions().with_scale(2)); }},
      {"nearest4x", {}, [](const Tensor& t) { return F::interpolate(t, F::InterpolateOptions().with_scale(4)); }},
  };
  for (const DevCase& c : cases) {
    const Tensor y_cpu = c.f(x);
    EXPECT_TRUE(all_close(c.f(xc), y_cpu, 1e-2, 1e-2)) << c.name;
    const Tensor gout = rnd(y_cpu.sizes(), DType::bf16, Device::cpu(), 82);
    EXPECT_TRUE(all_close(grad_of(c.f, xc, gout.to(Device::cuda())), grad_of(c.f, x, gout), 1e-2, 1e-2))
        << c.name << " grad";
  }
  for (const Tensor& in : {xc, xc.permute({0, 1, 3, 2})}) {  // fast (contiguous) and generic (strided)
    const Tensor in_cpu = in.to(Device::cpu());
    auto [v, idx] = F::max_pool2d_with_indices(in, 3, 2, 1);
    auto [v_cpu, idx_cpu] = F::max_pool2d_with_indices(in_cpu, 3, 2, 1);
    ASSERT_EQ(idx.dtype(), DType::i64);
    EXPECT_TRUE(all_close(v, v_cpu, 0, 0));
    EXPECT_TRUE(all_close(idx, idx_cpu, 0, 0));
  }
}

}  // namespace
}  // namespace flame::test
