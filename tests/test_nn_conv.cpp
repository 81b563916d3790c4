// Convolutions (flame/nn/conv.h): forward against a direct-loop float64 reference on the device
// under test, float64 finite-difference gradient checks on the CPU, CUDA forward and gradients
// against the CPU (dtypes, NCHW and channels-last), memory formats and error messages.
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "flame/nn/conv.h"
#include "gradcheck.h"
#include "test_util.h"

namespace flame::test {
namespace {

namespace F = flame::nn::functional;

// One convolution configuration (per-dim values; size nsp).
struct ConvCase {
  std::string name;
  int64_t nsp = 2;
  bool transposed = false;
  int64_t n = 2, c_in = 3, c_out = 4, groups = 1;
  Shape in, kernel, stride, pad, dilation, out_pad;
  bool bias = true;
  bool same = false;  // padding "same" (pad ignored)
};

Shape fill(int64_t nsp, int64_t v) { return Shape(static_cast<std::size_t>(nsp), v); }

std::vector<ConvCase> cases() {
  std::vector<ConvCase> v;
  v.push_back({"2d_basic", 2, false, 2, 3, 4, 1, {7, 6}, {3, 3}, {1, 1}, {1, 1}, {1, 1}, {0, 0}});
  v.push_back({"2d_stride2_odd", 2, false, 2, 3, 5, 1, {9, 7}, {3, 2}, {2, 2}, {1, 0}, {1, 1}, {0, 0}});
  v.push_back({"2d_dilation_groups", 2, false, 1, 4, 6, 2, {8, 9}, {3, 3}, {1, 2}, {2, 1}, {2, 1}, {0, 0}});
  v.push_back({"2d_depthwise", 2, false, 2, 4, 4, 4, {6, 5}, {3, 3}, {1, 1}, {1, 1}, {1, 1}, {0, 0}});
  v.push_back({"2d_same_even_kernel", 2, false, 2, 3, 2, 1, {5, 6}, {4, 2}, {1, 1}, {0, 0}, {1, 2}, {0, 0}, true, true});
  v.push_back({"1d_stride_dil", 1, false, 3, 2, 3, 1, {11}, {3}, {2}, {2}, {2}, {0}});
  v.push_back({"3d_groups", 3, false, 1, 4, 2, 2, {4, 5, 3}, {2, 3, 2}, {1, 2, 1}, {1, 1, 0}, {1, 1, 2}, {0, 0, 0}});
  v.push_back({"t2d_stride2_outpad", 2, true, 2, 4, 3, 1, {4, 5}, {3, 3}, {2, 2}, {1, 0}, {1, 1}, {1, 0}});
  v.push_back({"t2d_groups_dil", 2, true, 1, 4, 6, 2, {5, 4}, {2, 3}, {1, 2}, {0, 1}, {2, 1}, {0, 1}});
  v.push_back({"t1d", 1, true, 2, 3, 2, 1, {6}, {4}, {3}, {1}, {1}, {2}});
  v.push_back({"t3d", 3, true, 1, 2, 4, 2, {3, 4, 2}, {2, 2, 3}, {2, 1, 1}, {0, 1, 1}, {1, 1, 1}, {1, 0, 0}});
  return v;
}

Shape weight_shape(const ConvCase& c) {
  Shape s = c.transposed ? Shape{c.c_in, c.c_out / c.groups} : Shape{c.c_out, c.c_in / c.groups};
  s.insert(s.end(), c.kernel.begin(), c.kernel.end());
  return s;
}

Shape input_shape(const ConvCase& c, int64_t n) {
  Shape s{n, c.c_in};
  s.insert(s.end(), c.in.begin(), c.in.end());
  return s;
}

Tensor run(const ConvCase& c, const Tensor& x, const Tensor& w, const Tensor& b) {
  if (c.transposed) {
    switch (c.nsp) {
      case 1: return F::conv_transpose1d(x, w, b, c.stride, c.pad, c.out_pad, c.groups, c.dilation);
      case 2: return F::conv_transpose2d(x, w, b, c.stride, c.pad, c.out_pad, c.groups, c.dilation);
      default: return F::conv_transpose3d(x, w, b, c.stride, c.pad, c.out_pad, c.groups, c.dilation);
    }
  }
  const F::Padding pad = c.same ? F::Padding("same") : F::Padding(c.pad);
  switch (c.nsp) {
    case 1: return F::conv1d(x, w, b, c.stride, pad, c.dilation, c.groups);
    case 2: return F::conv2d(x, w, b, c.stride, pad, c.dilation, c.groups);
    default: return F::conv3d(x, w, b, c.stride, pad, c.dilation, c.groups);
  }
}

// Direct loops in double, straight from the definition (independent of im2col and cuDNN).
struct Ref {
  Shape shape;
  std::vector<double> v;
};

Ref reference(const ConvCase& c, const Tensor& x, const Tensor& w, const Tensor& b) {
  const std::vector<double> xv = x.to_vec<double>(), wv = w.to_vec<double>();
  const std::vector<double> bv = b.defined() ? b.to_vec<double>() : std::vector<double>();
  const int64_t nsp = c.nsp, N = x.sizes()[0];
  // Spatial geometry padded to 3 dims.
  int64_t in[3] = {1, 1, 1}, k[3] = {1, 1, 1}, s[3] = {1, 1, 1}, plo[3] = {0, 0, 0}, d[3] = {1, 1, 1}, out[3] = {1, 1, 1};
  const int64_t sh = 3 - nsp;
  for (int64_t i = 0; i < nsp; ++i) {
    in[sh + i] = c.in[i];
    k[sh + i] = c.kernel[i];
    s[sh + i] = c.stride[i];
    d[sh + i] = c.dilation[i];
    plo[sh + i] = c.same ? c.dilation[i] * (c.kernel[i] - 1) / 2 : c.pad[i];
    const int64_t span = c.dilation[i] * (c.kernel[i] - 1) + 1;
    if (c.transposed) {
      out[sh + i] = (c.in[i] - 1) * c.stride[i] - 2 * c.pad[i] + span + c.out_pad[i];
    } else {
      const int64_t padded = c.same ? c.in[i] + c.dilation[i] * (c.kernel[i] - 1) : c.in[i] + 2 * c.pad[i];
      out[sh + i] = (padded - span) / c.stride[i] + 1;
    }
  }
  Ref r;
  r.shape = {N, c.c_out};
  for (int64_t i = 0; i < nsp; ++i) r.shape.push_back(out[sh + i]);
  const int64_t isz = in[0] * in[1] * in[2], osz = out[0] * out[1] * out[2], ksz = k[0] * k[1] * k[2];
  r.v.assign(static_cast<std::size_t>(N * c.c_out * osz), 0.0);
  const int64_t cg = c.c_in / c.groups, kg = c.c_out / c.groups;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < c.groups; ++g)
      for (int64_t ci = 0; ci < cg; ++ci)
        for (int64_t ko = 0; ko < kg; ++ko)
          for (int64_t a = 0; a < k[0]; ++a)
            for (int64_t bb = 0; bb < k[1]; ++bb)
              for (int64_t e = 0; e < k[2]; ++e) {
                const int64_t kidx = (a * k[1] + bb) * k[2] + e;
                // conv: w[g*kg + ko, ci, kidx]; transposed: w[g*cg + ci, ko, kidx]
                const double wgt = c.transposed ? wv[((g * cg + ci) * kg + ko) * ksz + kidx]
                                                : wv[((g * kg + ko) * cg + ci) * ksz + kidx];
                const int64_t xc = g * cg + ci, yc = g * kg + ko;
                if (!c.transposed) {
                  for (int64_t o0 = 0; o0 < out[0]; ++o0)
                    for (int64_t o1 = 0; o1 < out[1]; ++o1)
                      for (int64_t o2 = 0; o2 < out[2]; ++o2) {
                        const int64_t i0 = o0 * s[0] - plo[0] + a * d[0], i1 = o1 * s[1] - plo[1] + bb * d[1],
                                      i2 = o2 * s[2] - plo[2] + e * d[2];
                        if (i0 < 0 || i0 >= in[0] || i1 < 0 || i1 >= in[1] || i2 < 0 || i2 >= in[2]) continue;
                        r.v[((n * c.c_out + yc) * osz) + (o0 * out[1] + o1) * out[2] + o2] +=
                            wgt * xv[(n * c.c_in + xc) * isz + (i0 * in[1] + i1) * in[2] + i2];
                      }
                } else {
                  for (int64_t i0 = 0; i0 < in[0]; ++i0)
                    for (int64_t i1 = 0; i1 < in[1]; ++i1)
                      for (int64_t i2 = 0; i2 < in[2]; ++i2) {
                        const int64_t o0 = i0 * s[0] - plo[0] + a * d[0], o1 = i1 * s[1] - plo[1] + bb * d[1],
                                      o2 = i2 * s[2] - plo[2] + e * d[2];
                        if (o0 < 0 || o0 >= out[0] || o1 < 0 || o1 >= out[1] || o2 < 0 || o2 >= out[2]) continue;
                        r.v[((n * c.c_out + yc) * osz) + (o0 * out[1] + o1) * out[2] + o2] +=
                            wgt * xv[(n * c.c_in + xc) * isz + (i0 * in[1] + i1) * in[2] + i2];
                      }
                }
              }
  if (!bv.empty())
    for (int64_t n = 0; n < N; ++n)
      for (int64_t yc = 0; yc < c.c_out; ++yc)
        for (int64_t o = 0; o < osz; ++o) r.v[(n * c.c_out + yc) * osz + o] += bv[yc];
  return r;
}

Tensor rand(const Shape& shape, uint64_t seed, DType dt, Device dev) {
  Generator g(seed);
  return Tensor::uniform(shape, -1.0, 1.0, {DType::f64, Device::cpu()}, &g).to(dt).to(dev);
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double e : v) m = std::max(m, std::abs(e));
  return m;
}

// |got - want| <= atol + rtol * |want| everywhere; scale-aware atol relative to the largest value.
::testing::AssertionResult close(const Tensor& got, const Shape& shape, const std::vector<double>& want, double rtol,
                                 double atol_rel) {
  if (got.sizes() != shape) return ::testing::AssertionFailure() << "shape " << shape_str(got.sizes()) << " vs " << shape_str(shape);
  const std::vector<double> g = got.to_vec<double>();
  const double atol = atol_rel * std::max(1.0, max_abs(want));
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (!(std::abs(g[i] - want[i]) <= atol + rtol * std::abs(want[i])))
      return ::testing::AssertionFailure() << "element " << i << ": got " << g[i] << ", want " << want[i];
  }
  return ::testing::AssertionSuccess();
}

// Tolerances of a result computed in `dt` (with float accumulation) against a float64 one.
double tol(DType dt) {
  switch (dt) {
    case DType::f64: return 1e-10;
    case DType::f32: return test_device().is_cuda() ? 5e-3 : 1e-5;  // cuDNN may use TF32 for f32
    default: return 2e-2;
  }
}

TEST(ConvForward, MatchesDirectLoops) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  uint64_t seed = 100;
  for (const ConvCase& c : cases()) {
    for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
      SCOPED_TRACE(c.name + " " + dtype_name(dt));
      // Inputs drawn in f64, rounded to dt; the reference reads the rounded values.
      const Tensor x = rand(input_shape(c, c.n), seed++, dt, dev);
      const Tensor w = rand(weight_shape(c), seed++, dt, dev);
      const Tensor b = c.bias ? rand({c.c_out}, seed++, dt, dev) : Tensor();
      const Ref r = reference(c, x, w, b);
      const Tensor y = run(c, x, w, b);
      EXPECT_EQ(y.dtype(), dt);
      EXPECT_TRUE(close(y, r.shape, r.v, tol(dt), tol(dt)));
    }
  }
}

TEST(ConvForward, UnbatchedInputGivesUnbatchedOutput) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = rand({3, 6, 5}, 1, DType::f32, dev), w = rand({2, 3, 3, 3}, 2, DType::f32, dev);
  const Tensor y = F::conv2d(x, w, {}, {1}, {1});
  const Tensor yb = F::conv2d(x.unsqueeze(0), w, {}, {1}, {1});
  ASSERT_EQ(y.sizes(), (Shape{2, 6, 5}));
  EXPECT_TRUE(all_close(y, yb.squeeze(0), 0, 0));
}

TEST(ConvForward, ValidPaddingIsZeroPadding) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = rand({2, 3, 6, 5}, 3, DType::f32, dev), w = rand({4, 3, 2, 3}, 4, DType::f32, dev);
  EXPECT_TRUE(all_close(F::conv2d(x, w, {}, {1}, "valid"), F::conv2d(x, w, {}, {1}, {0}), 0, 0));
}

TEST(ConvLayout, ChannelsLastInputGivesChannelsLastOutputWithSameValues) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (bool transposed : {false, true}) {
    const Tensor x = rand({2, 4, 7, 6}, 5, DType::f32, dev);
    const Tensor w = rand({4, 4, 3, 3}, 6, DType::f32, dev);
    const Tensor b = rand({4}, 7, DType::f32, dev);
    const Tensor xcl = F::to_channels_last(x);
    ASSERT_TRUE(F::is_channels_last(xcl));
    ASSERT_FALSE(F::is_channels_last(x));
    const Tensor y = transposed ? F::conv_transpose2d(x, w, b, {2}, {1}, {1}) : F::conv2d(x, w, b, {2}, {1});
    const Tensor ycl = transposed ? F::conv_transpose2d(xcl, w, b, {2}, {1}, {1}) : F::conv2d(xcl, w, b, {2}, {1});
    EXPECT_TRUE(F::is_channels_last(ycl)) << "strides " << shape_str(ycl.strides());
    EXPECT_TRUE(y.is_contiguous());
    EXPECT_TRUE(all_close(ycl, y, 1e-5, 1e-5));
  }
}

TEST(ConvLayout, StridedViewInputIsAccepted) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor big = rand({2, 3, 9, 8}, 8, DType::f32, dev);
  const Tensor x = big.narrow(3, 1, 6).transpose(2, 3);  // neither contiguous nor channels-last
  const Tensor w = rand({2, 3, 3, 3}, 9, DType::f32, dev);
  const Tensor y = F::conv2d(x, w, {}, {1}, {1});
  EXPECT_TRUE(all_close(y, F::conv2d(x.contiguous(), w, {}, {1}, {1}), 0, 0));
}

TEST(ConvForward, EmptyBatchGivesEmptyOutputAndZeroGradients) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = Tensor::zeros({0, 3, 5, 5}, {DType::f32, dev}).requires_grad_(true);
  const Tensor w = rand({4, 3, 3, 3}, 10, DType::f32, dev).requires_grad_(true);
  const Tensor b = rand({4}, 11, DType::f32, dev).requires_grad_(true);
  const Tensor y = F::conv2d(x, w, b, {1}, {1});
  ASSERT_EQ(y.sizes(), (Shape{0, 4, 5, 5}));
  Gradients g = y.sum().backward();
  EXPECT_EQ(g.get(x).sizes(), x.sizes());
  EXPECT_TRUE(all_close(g.get(w), Tensor::zeros(w.sizes(), {DType::f32, dev}), 0, 0));
  EXPECT_TRUE(all_close(g.get(b), Tensor::zeros({4}, {DType::f32, dev}), 0, 0));
}

// ---- float64 gradient checks (CPU) ----

TEST(ConvGradcheck, AllCasesFloat64) {
  uint64_t seed = 500;
  for (const ConvCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const Tensor x = rand(input_shape(c, c.n), seed++, DType::f64, Device::cpu());
    const Tensor w = rand(weight_shape(c), seed++, DType::f64, Device::cpu());
    const Tensor b = rand({c.c_out}, seed++, DType::f64, Device::cpu());
    const GradcheckResult r = gradcheck([&](const TensorList& in) { return run(c, in[0], in[1], in[2]); }, {x, w, b});
    EXPECT_TRUE(r.ok) << r.message;
    EXPECT_GT(r.checked, 0);
  }
}

TEST(ConvGradcheck, ChannelsLastFloat64) {
  const Tensor x = rand({2, 3, 5, 6}, 900, DType::f64, Device::cpu());
  const Tensor w = rand({4, 3, 3, 2}, 901, DType::f64, Device::cpu());
  const GradcheckResult r = gradcheck(
      [](const TensorList& in) { return F::conv2d(F::to_channels_last(in[0]), in[1], {}, {2, 1}, {1}); }, {x, w});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(ConvGradcheck, OnlyRequestedGradientsAreComputed) {
  const Tensor x = rand({1, 2, 5, 5}, 910, DType::f64, Device::cpu());
  const Tensor w = rand({3, 2, 3, 3}, 911, DType::f64, Device::cpu()).requires_grad_(true);
  Gradients g = F::conv2d(x, w, {}, {1}, {1}).sum().backward();
  EXPECT_TRUE(g.contains(w));
  EXPECT_FALSE(g.contains(x));
  // d sum(conv(x, w)) / dw[k, c, i, j] = sum over the windows of x: check one entry by hand.
  const std::vector<double> xv = x.to_vec<double>();
  double want = 0;  // w[0, 1, 0, 0] multiplies x[0, 1, oh - 1, ow - 1] for every output position
  for (int64_t oh = 0; oh < 5; ++oh)
    for (int64_t ow = 0; ow < 5; ++ow)
      if (oh >= 1 && ow >= 1) want += xv[25 + (oh - 1) * 5 + (ow - 1)];
  EXPECT_NEAR(g.get(w).to_vec<double>()[9], want, 1e-12);
}

// ---- CUDA against the CPU reference ----

struct GradSet {
  Tensor y, dx, dw, db;
};

GradSet forward_backward(const ConvCase& c, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& gy,
                         bool cl) {
  Tensor xi = x.detach().requires_grad_(true), wi = w.detach().requires_grad_(true), bi = b.detach().requires_grad_(true);
  Tensor xin = cl ? F::to_channels_last(xi) : xi;
  GradSet s;
  s.y = run(c, xin, wi, bi);
  BackwardOptions o;
  o.grad_output = cl ? F::to_channels_last(gy) : gy;
  Gradients g = s.y.backward(o);
  s.dx = g.get(xi);
  s.dw = g.get(wi);
  s.db = g.get(bi);
  return s;
}

TEST(ConvCuda, ForwardAndGradientsMatchCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  uint64_t seed = 2000;
  for (const ConvCase& c : cases()) {
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      for (bool cl : {false, true}) {
        if (cl && c.nsp == 1) continue;  // no channels-last format for 3-d tensors
        SCOPED_TRACE(c.name + " " + dtype_name(dt) + (cl ? " channels-last" : " contiguous"));
        const Tensor x = rand(input_shape(c, c.n), seed++, dt, Device::cpu());
        const Tensor w = rand(weight_shape(c), seed++, dt, Device::cpu());
        const Tensor b = rand({c.c_out}, seed++, dt, Device::cpu());
        const Tensor y_cpu = run(c, x, w, b);
        const Tensor gy = rand(y_cpu.sizes(), seed++, dt, Device::cpu());
        // CPU oracle in f64 from the same (rounded) values; the CUDA result in dt.
        const GradSet ref = forward_backward(c, x.to(DType::f64), w.to(DType::f64), b.to(DType::f64),
                                             gy.to(DType::f64), false);
        const Device cuda = Device::cuda(0);
        const GradSet got = forward_backward(c, x.to(cuda), w.to(cuda), b.to(cuda), gy.to(cuda), cl);
        const double t = dt == DType::f32 ? 5e-3 : 3e-2;
        if (cl) {
          EXPECT_TRUE(F::is_channels_last(got.y) || got.y.is_contiguous());
        }
        EXPECT_TRUE(close(got.y, ref.y.sizes(), ref.y.to_vec<double>(), t, t)) << "forward";
        EXPECT_TRUE(close(got.dx, ref.dx.sizes(), ref.dx.to_vec<double>(), t, t)) << "grad input";
        EXPECT_TRUE(close(got.dw, ref.dw.sizes(), ref.dw.to_vec<double>(), t, t)) << "grad weight";
        EXPECT_TRUE(close(got.db, ref.db.sizes(), ref.db.to_vec<double>(), t, t)) << "grad bias";
      }
    }
  }
}

TEST(ConvCuda, Float64MatchesCpuOrRaisesClearly) {
  FLAME_SKIP_IF_NO_CUDA();
  const ConvCase c = cases()[1];
  const Tensor x = rand(input_shape(c, c.n), 3000, DType::f64, Device::cpu());
  const Tensor w = rand(weight_shape(c), 3001, DType::f64, Device::cpu());
  const Tensor b = rand({c.c_out}, 3002, DType::f64, Device::cpu());
  const Tensor gy = rand(run(c, x, w, b).sizes(), 3003, DType::f64, Device::cpu());
  const GradSet ref = forward_backward(c, x, w, b, gy, false);
  const Device cuda = Device::cuda(0);
  try {
    const GradSet got = forward_backward(c, x.to(cuda), w.to(cuda), b.to(cuda), gy.to(cuda), false);
    EXPECT_TRUE(all_close(got.y, ref.y, 1e-9, 1e-9));
    EXPECT_TRUE(all_close(got.dx, ref.dx, 1e-9, 1e-9));
    EXPECT_TRUE(all_close(got.dw, ref.dw, 1e-9, 1e-9));
  } catch (const Error& e) {
    // cuDNN without a double engine for this graph: the error must name the op and the shapes.
    const std::string m = e.what();
    EXPECT_NE(m.find("conv2d"), std::string::npos) << m;
    EXPECT_NE(m.find("f64"), std::string::npos) << m;
  }
}

TEST(ConvCuda, BenchShapeSmallBatchMatchesCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  // The benchmark's layer (3x3, pad 1, 256 channels) at N=1, 16x16, bf16, channels-last.
  const Tensor x = rand({1, 256, 16, 16}, 4000, DType::bf16, Device::cpu());
  const Tensor w = rand({256, 256, 3, 3}, 4001, DType::bf16, Device::cpu());
  const Tensor y_ref = F::conv2d(x.to(DType::f64), w.to(DType::f64), {}, {1}, {1});
  const Device cuda = Device::cuda(0);
  const Tensor y = F::conv2d(F::to_channels_last(x.to(cuda)), F::to_channels_last(w.to(cuda)), {}, {1}, {1});
  EXPECT_TRUE(F::is_channels_last(y));
  EXPECT_TRUE(close(y, y_ref.sizes(), y_ref.to_vec<double>(), 3e-2, 3e-2));
}

TEST(ConvCuda, EmptyBatchAndMisalignedView) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device cuda = Device::cuda(0);
  const Tensor w = rand({4, 3, 3, 3}, 4100, DType::f32, Device::cpu());
  const Tensor y0 = F::conv2d(Tensor::zeros({0, 3, 5, 5}, {DType::f32, cuda}), w.to(cuda), {}, {1}, {1});
  EXPECT_EQ(y0.sizes(), (Shape{0, 4, 5, 5}));
  // A view starting one element into its storage (not 16-byte aligned).
  const Tensor flat = rand({1 + 2 * 3 * 5 * 5}, 4101, DType::f32, Device::cpu());
  const Tensor x = flat.narrow(0, 1, 2 * 3 * 5 * 5).view({2, 3, 5, 5});
  const Tensor y_cpu = F::conv2d(x, w, {}, {1}, {1});
  const Tensor y = F::conv2d(flat.to(cuda).narrow(0, 1, 150).view({2, 3, 5, 5}), w.to(cuda), {}, {1}, {1});
  EXPECT_TRUE(all_close(y, y_cpu, 5e-3, 5e-3));
}

TEST(ConvCuda, RunsOnTheCurrentStream) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device cuda = Device::cuda(0);
  const Tensor x = rand({2, 8, 9, 7}, 4200, DType::f32, Device::cpu()), w = rand({6, 8, 3, 3}, 4201, DType::f32, Device::cpu());
  const Tensor y_cpu = F::conv2d(x, w, {}, {1}, {1});
  const Tensor xg = x.to(cuda), wg = w.to(cuda);
  const cuda::Stream side = cuda::Stream::create(0);
  const cuda::Stream main = cuda::Stream::current(0);
  Tensor y;
  {
    cuda::StreamGuard guard(side);
    side.wait(main);  // the uploads above were queued on the main stream
    y = F::conv2d(xg, wg, {}, {1}, {1});
  }
  main.wait(side);
  EXPECT_TRUE(all_close(y, y_cpu, 5e-3, 5e-3));
}

TEST(ConvThreads, ConcurrentCallsFromTwoThreadsAgree) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = rand({2, 4, 8, 8}, 4300, DType::f32, dev), w = rand({4, 4, 3, 3}, 4301, DType::f32, dev);
  const std::vector<double> want = F::conv2d(x, w, {}, {1}, {1}).to_vec<double>();
  std::vector<std::vector<double>> got(2);
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      // A fresh shape per thread as well, so both threads build and look up plans at once.
      const Tensor xt = rand({1 + t, 4, 6, 5}, 4400 + t, DType::f32, dev);
      for (int i = 0; i < 5; ++i) (void)F::conv2d(xt, w, {}, {2}, {1});
      got[t] = F::conv2d(x, w, {}, {1}, {1}).to_vec<double>();
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& g : got) {
    ASSERT_EQ(g.size(), want.size());
    for (std::size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(g[i], want[i], 1e-6 + 1e-6 * std::abs(want[i]));
  }
}

// ---- errors ----

TEST(ConvErrors, BadInputsRaiseNamedErrors) {
  const Device dev = Device::cpu();
  const Tensor x = rand({2, 4, 5, 5}, 1, DType::f32, dev), w = rand({6, 2, 3, 3}, 2, DType::f32, dev);
  expect_error([&] { F::conv2d(x, w, {}, {1}, {0}, {1}, 3); }, {"conv2d", "groups"});
  expect_error([&] { F::conv2d(x, rand({6, 3, 3, 3}, 3, DType::f32, dev)); }, {"conv2d", "channels", "[6, 3, 3, 3]"});
  expect_error([&] { F::conv2d(x, w.to(DType::f64), {}, {1}, {0}, {1}, 2); }, {"conv2d", "f32", "f64"});
  expect_error([&] { F::conv2d(x, rand({6, 2, 7, 3}, 4, DType::f32, dev), {}, {1}, {0}, {1}, 2); },
               {"conv2d", "kernel", "larger"});
  expect_error([&] { F::conv2d(x, w, rand({5}, 5, DType::f32, dev), {1}, {0}, {1}, 2); }, {"conv2d", "bias", "[6]"});
  expect_error([&] { F::conv2d(x, w, {}, {2}, "same", {1}, 2); }, {"conv2d", "same", "strided"});
  expect_error([&] { F::conv2d(x, w, {}, {0}, {0}, {1}, 2); }, {"conv2d", "stride"});
  expect_error([&] { F::conv2d(x, w, {}, {1, 1, 1}, {0}, {1}, 2); }, {"conv2d", "stride", "2"});
  expect_error([&] { F::conv2d(x, w, {}, {1}, {-1}, {1}, 2); }, {"conv2d", "padding"});
  expect_error([&] { F::conv3d(x, w); }, {"conv3d", "weight"});
  expect_error([&] { F::conv2d(x.to(DType::i32), w.to(DType::i32), {}, {1}, {0}, {1}, 2); }, {"conv2d", "floating"});
  expect_error([&] { F::conv2d(x, w, {}, {1}, F::Padding("full")); }, {"conv", "full"});
  expect_error([&] { F::conv_transpose2d(x, rand({4, 3, 3, 3}, 6, DType::f32, dev), {}, {1}, {0}, {1}); },
               {"conv_transpose2d", "output_padding"});
  expect_error([&] { F::conv_transpose2d(x, rand({3, 3, 3, 3}, 7, DType::f32, dev)); },
               {"conv_transpose2d", "channels"});
  if (cuda_is_available()) {
    expect_error([&] { F::conv2d(x.to(Device::cuda(0)), w, {}, {1}, {0}, {1}, 2); }, {"conv2d", "cuda", "cpu"});
  }
}

}  // namespace
}  // namespace flame::test
