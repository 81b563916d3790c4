// Normalisation family: layer_norm, rms_norm, group_norm, batch_norm.
//  - NormCpu.*: forward against formulas written with FLAME ops in f64, PyTorch's conventions
//    (eps defaults, running-stat momentum and unbiased variance), float64 finite-difference
//    gradchecks (with and without affine, odd sizes, non-contiguous input), errors.
//  - NormCuda.*: every dtype, odd and empty shapes, non-contiguous input: forward and all
//    gradients against the CPU reference computed in f64 from the same (rounded) inputs.
#include <cmath>
#include <string>

#include "flame/cuda.h"
#include "flame/nn/norm.h"
#include "gradcheck.h"
#include "nn_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {
namespace F = flame::nn::functional;

Tensor rnd(const Shape& s, uint64_t seed, double mean = 0.0, double stdv = 1.0, DType dt = DType::f64) {
  Generator g(seed);
  return Tensor::randn(s, mean, stdv, {dt}, &g);
}

// ---- references written with FLAME ops (f64) ----
Tensor ref_layer_norm(const Tensor& x, int64_t k, const Tensor& w, const Tensor& b, double eps, bool rms) {
  Shape dims;
  for (int64_t d = x.dim() - k; d < x.dim(); ++d) dims.push_back(d);
  Tensor y;
  if (rms) {
    y = x * (x.square().mean(dims, true) + eps).rsqrt();
  } else {
    const Tensor m = x.mean(dims, true);
    y = (x - m) * ((x - m).square().mean(dims, true) + eps).rsqrt();
  }
  if (w.defined()) y = y * w;
  if (b.defined()) y = y + b;
  return y;
}

Shape channel_param_shape(const Tensor& x) {
  Shape s(static_cast<std::size_t>(x.dim()), 1);
  s[1] = x.size(1);
  return s;
}

Tensor ref_group_norm(const Tensor& x, int64_t groups, const Tensor& w, const Tensor& b, double eps) {
  const Tensor g = x.reshape({x.size(0), groups, -1});
  const Tensor m = g.mean({2}, true);
  Tensor y = ((g - m) * ((g - m).square().mean({2}, true) + eps).rsqrt()).reshape(x.sizes());
  if (w.defined()) y = y * w.reshape(channel_param_shape(x));
  if (b.defined()) y = y + b.reshape(channel_param_shape(x));
  return y;
}

Shape batch_dims(const Tensor& x) {
  Shape d{0};
  for (int64_t i = 2; i < x.dim(); ++i) d.push_back(i);
  return d;
}

Tensor ref_batch_norm(const Tensor& x, const Tensor& mean, const Tensor& var, const Tensor& w, const Tensor& b,
                      double eps) {
  const Shape ps = channel_param_shape(x);
  Tensor y = (x - mean.reshape(ps)) * (var.reshape(ps) + eps).rsqrt();
  if (w.defined()) y = y * w.reshape(ps);
  if (b.defined()) y = y + b.reshape(ps);
  return y;
}

// ---- CPU forward ----

TEST(NormCpu, LayerNormMatchesFormula) {
  for (const auto& [shape, k] : std::vector<std::pair<Shape, int64_t>>{{{5, 7}, 1}, {{3, 4, 6}, 2}, {{2, 1}, 1}}) {
    const Tensor x = rnd(shape, 1, 0.5, 2.0);
    const Shape ns(shape.end() - k, shape.end());
    const Tensor w = rnd(ns, 2), b = rnd(ns, 3);
    EXPECT_TRUE(close_scaled(F::layer_norm(x, ns, w, b, 1e-5), ref_layer_norm(x, k, w, b, 1e-5, false), 1e-12));
    EXPECT_TRUE(close_scaled(F::layer_norm(x, ns), ref_layer_norm(x, k, {}, {}, 1e-5, false), 1e-12));
    EXPECT_TRUE(close_scaled(F::layer_norm(x, ns, w, {}, 0.1), ref_layer_norm(x, k, w, {}, 0.1, false), 1e-12));
  }
}

TEST(NormCpu, RmsNormMatchesFormulaAndDefaultEps) {
  const Tensor x = rnd({6, 9}, 4, 0.3);
  const Tensor w = rnd({9}, 5);
  EXPECT_TRUE(close_scaled(F::rms_norm(x, {9}, w, 1e-6), ref_layer_norm(x, 1, w, {}, 1e-6, true), 1e-12));
  // eps unset is torch.finfo(dtype).eps: visible with tiny inputs.
  const Tensor tiny = rnd({3, 4}, 6) * 1e-5;
  EXPECT_TRUE(close_scaled(F::rms_norm(tiny.to(DType::f32), {4}),
                           ref_layer_norm(tiny, 1, {}, {}, 1.1920928955078125e-07, true), 1e-4));
  EXPECT_TRUE(close_scaled(F::rms_norm(tiny, {4}), ref_layer_norm(tiny, 1, {}, {}, 2.220446049250313e-16, true),
                           1e-10));
}

TEST(NormCpu, GroupNormMatchesFormula) {
  for (const auto& [shape, groups] :
       std::vector<std::pair<Shape, int64_t>>{{{2, 6, 5}, 3}, {{3, 4, 3, 5}, 2}, {{2, 4}, 4}, {{1, 6, 7}, 1}}) {
    const Tensor x = rnd(shape, 7, -1.0, 3.0);
    const Tensor w = rnd({shape[1]}, 8), b = rnd({shape[1]}, 9);
    EXPECT_TRUE(close_scaled(F::group_norm(x, groups, w, b), ref_group_norm(x, groups, w, b, 1e-5), 1e-12));
    EXPECT_TRUE(close_scaled(F::group_norm(x, groups), ref_group_norm(x, groups, {}, {}, 1e-5), 1e-12));
  }
}

TEST(NormCpu, BatchNormTrainingUsesBatchStatsAndUpdatesRunningStats) {
  for (const Shape& shape : std::vector<Shape>{{8, 3}, {4, 3, 5}, {2, 3, 4, 5}}) {
    const Tensor x = rnd(shape, 10, 1.5, 2.0);
    const Tensor w = rnd({3}, 11), b = rnd({3}, 12);
    Tensor rm = rnd({3}, 13), rv = rnd({3}, 14).abs() + 0.5;
    const Tensor rm0 = rm.clone(), rv0 = rv.clone();
    const Tensor y = F::batch_norm(x, rm, rv, w, b, /*training=*/true, /*momentum=*/0.3, 1e-5);
    const Shape dims = batch_dims(x);
    const Tensor bm = x.mean(dims), bv = (x - bm.reshape(channel_param_shape(x))).square().mean(dims);
    EXPECT_TRUE(close_scaled(y, ref_batch_norm(x, bm, bv, w, b, 1e-5), 1e-12));
    const double count = static_cast<double>(x.numel() / 3);
    EXPECT_TRUE(close_scaled(rm, rm0 * 0.7 + bm * 0.3, 1e-12));
    EXPECT_TRUE(close_scaled(rv, rv0 * 0.7 + bv * (0.3 * count / (count - 1)), 1e-12));
    EXPECT_FALSE(rm.requires_grad());
    // Eval: the running statistics normalise and stay as they are.
    const Tensor rm1 = rm.clone();
    const Tensor ye = F::batch_norm(x, rm, rv, w, b, /*training=*/false, 0.3, 1e-3);
    EXPECT_TRUE(close_scaled(ye, ref_batch_norm(x, rm, rv, w, b, 1e-3), 1e-12));
    EXPECT_TRUE(close_scaled(rm, rm1, 0.0));
  }
  // Training without running statistics is allowed (track_running_stats = false).
  const Tensor x = rnd({5, 2, 3}, 15);
  const Shape dims = batch_dims(x);
  const Tensor bm = x.mean(dims), bv = (x - bm.reshape({1, 2, 1})).square().mean(dims);
  EXPECT_TRUE(close_scaled(F::batch_norm(x, {}, {}, {}, {}, true), ref_batch_norm(x, bm, bv, {}, {}, 1e-5), 1e-12));
}

TEST(NormCpu, NonContiguousInputs) {
  const Tensor base = rnd({7, 5}, 16);
  const Tensor x = base.t();  // [5, 7], transposed strides
  EXPECT_TRUE(close_scaled(F::layer_norm(x, {7}), ref_layer_norm(x.contiguous(), 1, {}, {}, 1e-5, false), 1e-12));
  // Channels-last NCHW: a permuted NHWC buffer.
  const Tensor nhwc = rnd({2, 3, 4, 6}, 17);
  const Tensor xc = nhwc.permute({0, 3, 1, 2});  // [2, 6, 3, 4]
  EXPECT_TRUE(close_scaled(F::group_norm(xc, 3), ref_group_norm(xc.contiguous(), 3, {}, {}, 1e-5), 1e-12));
  const Tensor bm = xc.mean({0, 2, 3}), bv = (xc - bm.reshape({1, 6, 1, 1})).square().mean({0, 2, 3});
  EXPECT_TRUE(close_scaled(F::batch_norm(xc, {}, {}, {}, {}, true), ref_batch_norm(xc, bm, bv, {}, {}, 1e-5), 1e-12));
}

TEST(NormCpu, HalfInputsComputeInFloatAndKeepDtype) {
  for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
    const Tensor x = rnd({4, 33}, 18, 0.5, 1.5).to(dt);
    const Tensor w = rnd({33}, 19).to(dt), b = rnd({33}, 20).to(dt);
    const Tensor y = F::layer_norm(x, {33}, w, b);
    EXPECT_EQ(y.dtype(), dt);
    const double tol = dt == DType::bf16 ? 8e-3 : dt == DType::f16 ? 1e-3 : 1e-6;
    EXPECT_TRUE(close_scaled(y, ref_layer_norm(x.to(DType::f64), 1, w.to(DType::f64), b.to(DType::f64), 1e-5, false),
                             tol))
        << dtype_name(dt);
    const Tensor g = F::group_norm(x.reshape({4, 3, 11}), 3, w.narrow(0, 0, 3), b.narrow(0, 0, 3));
    EXPECT_EQ(g.dtype(), dt);
  }
}

TEST(NormCpu, EmptyInputs) {
  const Tensor w = rnd({8}, 21).requires_grad_(), b = rnd({8}, 22).requires_grad_();
  const Tensor x = Tensor::zeros({0, 8}, {DType::f64}).requires_grad_();
  const Tensor y = F::layer_norm(x, {8}, w, b);
  EXPECT_EQ(y.sizes(), (Shape{0, 8}));
  Gradients g = y.sum().backward();
  EXPECT_EQ(g.get(x).sizes(), (Shape{0, 8}));
  EXPECT_TRUE(close_scaled(g.get(w), Tensor::zeros({8}, {DType::f64}), 0.0));
  EXPECT_TRUE(close_scaled(g.get(b), Tensor::zeros({8}, {DType::f64}), 0.0));
  EXPECT_EQ(F::group_norm(Tensor::zeros({0, 4, 3}), 2).sizes(), (Shape{0, 4, 3}));
  EXPECT_EQ(F::batch_norm(Tensor::zeros({0, 4}), Tensor::zeros({4}), Tensor::ones({4})).sizes(), (Shape{0, 4}));
}

TEST(NormCpu, ErrorsNameOpShapesAndDtypes) {
  const Tensor x = Tensor::ones({2, 3, 4});
  expect_error([&] { F::layer_norm(x, {3}); }, {"layer_norm", "[3]", "[2, 3, 4]"});
  expect_error([&] { F::layer_norm(x, {4}, Tensor::ones({5})); }, {"layer_norm", "weight", "[4]", "[5]"});
  expect_error([&] { F::layer_norm(x, {4}, Tensor::ones({4}, {DType::f64})); }, {"layer_norm", "f64", "f32"});
  expect_error([&] { F::layer_norm(Tensor::ones({2, 3}, {DType::i64}), {3}); }, {"layer_norm", "i64"});
  expect_error([&] { F::rms_norm(x, {}); }, {"rms_norm", "normalized_shape"});
  expect_error([&] { F::group_norm(x, 2); }, {"group_norm", "num_groups", "3"});
  expect_error([&] { F::group_norm(Tensor::ones({4}), 2); }, {"group_norm", "[4]"});
  expect_error([&] { F::group_norm(x, 3, Tensor::ones({4})); }, {"group_norm", "weight", "[3]", "[4]"});
  expect_error([&] { F::batch_norm(x, {}, {}); }, {"batch_norm", "running_mean", "evaluation"});
  expect_error([&] { F::batch_norm(x, Tensor::zeros({4}), Tensor::ones({4})); }, {"batch_norm", "running_mean", "[3]"});
  expect_error([&] { F::batch_norm(Tensor::ones({1, 3}), {}, {}, {}, {}, true); },
               {"batch_norm", "more than 1 value per channel", "[1, 3]"});
  if (cuda_is_available()) {
    expect_error([&] { F::layer_norm(x, {4}, Tensor::ones({4}, Device::cuda())); }, {"layer_norm", "weight", "cuda"});
  }
}

// ---- CPU gradchecks (float64 finite differences) ----

void expect_gradcheck(const std::function<Tensor(const TensorList&)>& fn, const TensorList& in, const char* what) {
  const GradcheckResult r = gradcheck(fn, in);
  EXPECT_TRUE(r.ok) << what << ": " << r.message;
  EXPECT_GT(r.checked, 0) << what;
}

TEST(NormCpu, LayerNormGradcheck) {
  for (const auto& [shape, k] : std::vector<std::pair<Shape, int64_t>>{{{3, 5}, 1}, {{2, 3, 4}, 2}, {{4, 1}, 1}}) {
    const Shape ns(shape.end() - k, shape.end());
    const Tensor x = rnd(shape, 30, 0.2), w = rnd(ns, 31), b = rnd(ns, 32);
    expect_gradcheck([&](const TensorList& t) { return F::layer_norm(t[0], ns, t[1], t[2], 1e-3); }, {x, w, b},
                     "layer_norm affine");
    expect_gradcheck([&](const TensorList& t) { return F::layer_norm(t[0], ns, {}, {}, 1e-3); }, {x}, "layer_norm");
  }
  // Non-contiguous input: a transposed view.
  const Tensor xt = rnd({5, 3}, 33), w = rnd({5}, 34);
  expect_gradcheck([&](const TensorList& t) { return F::layer_norm(t[0].t(), {5}, t[1]); }, {xt, w},
                   "layer_norm transposed");
}

TEST(NormCpu, RmsNormGradcheck) {
  const Tensor x = rnd({4, 7}, 35, 0.3), w = rnd({7}, 36);
  expect_gradcheck([&](const TensorList& t) { return F::rms_norm(t[0], {7}, t[1], 1e-4); }, {x, w}, "rms_norm affine");
  expect_gradcheck([&](const TensorList& t) { return F::rms_norm(t[0], {7}); }, {x}, "rms_norm");
  const Tensor xt = rnd({3, 2, 5}, 37);
  expect_gradcheck([&](const TensorList& t) { return F::rms_norm(t[0].transpose(0, 2), {2, 3}, t[1]); },
                   {xt, rnd({2, 3}, 38)}, "rms_norm transposed");
}

TEST(NormCpu, GroupNormGradcheck) {
  const Tensor x = rnd({2, 6, 5}, 39, 0.5), w = rnd({6}, 40), b = rnd({6}, 41);
  expect_gradcheck([&](const TensorList& t) { return F::group_norm(t[0], 3, t[1], t[2], 1e-3); }, {x, w, b},
                   "group_norm affine");
  expect_gradcheck([&](const TensorList& t) { return F::group_norm(t[0], 2); }, {x}, "group_norm");
  const Tensor nhwc = rnd({2, 3, 2, 4}, 42);
  expect_gradcheck([&](const TensorList& t) { return F::group_norm(t[0].permute({0, 3, 1, 2}), 2, t[1]); },
                   {nhwc, rnd({4}, 43)}, "group_norm channels-last");
}

TEST(NormCpu, BatchNormGradcheck) {
  for (const Shape& shape : std::vector<Shape>{{5, 3}, {3, 2, 5}, {2, 3, 2, 3}}) {
    const Tensor x = rnd(shape, 44, 0.5), w = rnd({shape[1]}, 45), b = rnd({shape[1]}, 46);
    expect_gradcheck([&](const TensorList& t) { return F::batch_norm(t[0], {}, {}, t[1], t[2], true, 0.1, 1e-3); },
                     {x, w, b}, "batch_norm training affine");
    expect_gradcheck([&](const TensorList& t) { return F::batch_norm(t[0], {}, {}, {}, {}, true); }, {x},
                     "batch_norm training");
    const Tensor rm = rnd({shape[1]}, 47), rv = rnd({shape[1]}, 48).abs() + 0.5;
    expect_gradcheck([&](const TensorList& t) { return F::batch_norm(t[0], rm, rv, t[1], t[2], false); }, {x, w, b},
                     "batch_norm eval");
  }
  const Tensor nhwc = rnd({2, 3, 2, 4}, 49);
  expect_gradcheck([&](const TensorList& t) { return F::batch_norm(t[0].permute({0, 3, 1, 2}), {}, {}, t[1], {}, true); },
                   {nhwc, rnd({4}, 50)}, "batch_norm channels-last");
}

TEST(NormCpu, OnlyParameterGradients) {
  // x needs no gradient: the backward still gives weight and bias theirs.
  const Tensor x = rnd({6, 4}, 51);
  const Tensor w = rnd({4}, 52).requires_grad_(), b = rnd({4}, 53).requires_grad_();
  const Tensor v = rnd({6, 4}, 54);
  Gradients g = (F::layer_norm(x, {4}, w, b) * v).sum().backward();
  const Tensor xh = ref_layer_norm(x, 1, {}, {}, 1e-5, false);
  EXPECT_TRUE(close_scaled(g.get(w), (v * xh).sum({0}), 1e-12));
  EXPECT_TRUE(close_scaled(g.get(b), v.sum({0}), 1e-12));
  EXPECT_FALSE(g.contains(x));
  EXPECT_EQ(F::layer_norm(x, {4}, w, b).grad_fn_name(), "LayerNormBackward");
  EXPECT_EQ(F::rms_norm(x, {4}, w).grad_fn_name(), "RmsNormBackward");
}

// ---- CUDA against the CPU reference ----

double cuda_tol(DType dt) {
  switch (dt) {
    case DType::f64: return 1e-10;
    case DType::f32: return 2e-5;
    case DType::f16: return 4e-3;
    default: return 2e-2;
  }
}

struct Run {
  Tensor y, dx, dw, db;
};

// Runs op on x (and w/b when affine) with a random upstream gradient (seed vseed, rounded to
// round_dt, the output's shape); x is made non-contiguous (a transposed copy of its first two
// dims) when asked.
Run run_op(const std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>& op, const Tensor& x0,
           const Tensor& w0, const Tensor& b0, uint64_t vseed, DType round_dt, DType dt, Device dev,
           bool transposed) {
  Tensor x = transposed ? x0.transpose(0, 1).contiguous().to(dt).to(dev).transpose(0, 1) : x0.to(dt).to(dev);
  Tensor xl = x.detach().requires_grad_();
  Tensor xin = xl;
  // Fresh leaves: .to() returns the caller's tensor itself when nothing changes, which must not
  // start requiring grad (the next dtype's .to() would then be recorded).
  Tensor w = w0.defined() ? w0.to(dt).to(dev).detach().requires_grad_() : Tensor();
  Tensor b = b0.defined() ? b0.to(dt).to(dev).detach().requires_grad_() : Tensor();
  Run r;
  r.y = op(xin, w, b);
  BackwardOptions o;
  o.grad_output = rnd(r.y.sizes(), vseed).to(round_dt).to(dt).to(dev);
  Gradients g = r.y.backward(o);
  r.dx = g.get(xl);
  if (w.defined()) r.dw = g.try_get(w);
  if (b.defined()) r.db = g.try_get(b);
  return r;
}

void compare_cuda(const char* what, const std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>& op,
                  const Shape& shape, const Shape& pshape, bool affine, bool transposed, uint64_t seed,
                  double xmean = 0.3) {
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    // Inputs rounded to dt first, so both sides see the same values; the reference runs in f64.
    const Tensor x = rnd(shape, seed, xmean, 1.5).to(dt).to(DType::f64);
    const Tensor w = affine ? rnd(pshape, seed + 1, 1.0, 0.5).to(dt).to(DType::f64) : Tensor();
    const Tensor b = affine ? rnd(pshape, seed + 2).to(dt).to(DType::f64) : Tensor();
    const Run want = run_op(op, x, w, b, seed + 3, dt, DType::f64, Device::cpu(), false);
    const Run got = run_op(op, x, w, b, seed + 3, dt, dt, Device::cuda(), transposed);
    const double tol = cuda_tol(dt);
    const std::string ctx = std::string(what) + " " + dtype_name(dt) + " " + ::testing::PrintToString(shape) +
                            (affine ? " affine" : "") + (transposed ? " transposed" : "");
    EXPECT_EQ(got.y.dtype(), dt) << ctx;
    EXPECT_TRUE(close_scaled(got.y, want.y, tol)) << ctx << " forward";
    EXPECT_TRUE(close_scaled(got.dx, want.dx, 2 * tol, 1.0)) << ctx << " dx";
    EXPECT_TRUE(close_scaled(got.dw, want.dw, 2 * tol, 1.0)) << ctx << " dweight";
    EXPECT_TRUE(close_scaled(got.db, want.db, 2 * tol, 1.0)) << ctx << " dbias";  // undefined for rms_norm
  }
}

TEST(NormCuda, LayerNormMatchesCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  uint64_t seed = 100;
  for (int64_t cols : {1, 3, 8, 1000, 1024, 4099, 20000}) {
    for (int64_t rows : {1, 7, 130}) {
      if (cols >= 4099 && rows > 7) continue;
      for (bool affine : {true, false}) {
        compare_cuda("layer_norm", [&](const Tensor& x, const Tensor& w, const Tensor& b) {
          return F::layer_norm(x, {cols}, w, b);
        }, {rows, cols}, {cols}, affine, false, seed++);
      }
    }
  }
  compare_cuda("layer_norm", [](const Tensor& x, const Tensor& w, const Tensor& b) {
    return F::layer_norm(x, {96}, w, b);
  }, {9, 96}, {96}, true, /*transposed=*/true, seed++);
  compare_cuda("layer_norm", [](const Tensor& x, const Tensor& w, const Tensor& b) {
    return F::layer_norm(x, {4, 16}, w, b);
  }, {3, 5, 4, 16}, {4, 16}, true, false, seed++);
  compare_cuda("layer_norm", [](const Tensor& x, const Tensor& w, const Tensor& b) {
    return F::layer_norm(x, {64}, w, b);
  }, {0, 64}, {64}, true, false, seed++);
}

TEST(NormCuda, RmsNormMatchesCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  uint64_t seed = 200;
  for (int64_t cols : {1, 3, 1000, 1024, 4099, 20000}) {
    for (int64_t rows : {1, 5, 257}) {
      if (cols >= 4099 && rows > 5) continue;
      for (bool affine : {true, false}) {
        compare_cuda("rms_norm", [&](const Tensor& x, const Tensor& w, const Tensor&) {
          return F::rms_norm(x, {cols}, w, 1e-6);
        }, {rows, cols}, {cols}, affine, false, seed++);
      }
    }
  }
  compare_cuda("rms_norm", [](const Tensor& x, const Tensor& w, const Tensor&) {
    return F::rms_norm(x, {40}, w);
  }, {6, 40}, {40}, true, /*transposed=*/true, seed++);
  compare_cuda("rms_norm", [](const Tensor& x, const Tensor& w, const Tensor&) {
    return F::rms_norm(x, {32}, w);
  }, {0, 32}, {32}, true, false, seed++);
}

TEST(NormCuda, GroupNormMatchesCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  uint64_t seed = 300;
  struct C {
    Shape shape;
    int64_t groups;
  };
  for (const C& c : std::vector<C>{{{2, 6, 5}, 3}, {{3, 8, 4, 4}, 4}, {{2, 32, 16, 16}, 8}, {{1, 4, 1}, 2},
                                   {{5, 6}, 3}, {{2, 4, 4099}, 2}, {{0, 4, 8}, 2},
                                   // 16 and more channels per group: a warp per channel in the backward
                                   {{2, 64, 8, 8}, 4}, {{1, 48, 33}, 2}, {{3, 40, 1}, 1},
                                   // groups of 65536 values: several vectors per thread on a cluster
                                   {{2, 32, 64, 64}, 2}}) {
    for (bool affine : {true, false}) {
      compare_cuda("group_norm", [&](const Tensor& x, const Tensor& w, const Tensor& b) {
        return F::group_norm(x, c.groups, w, b);
      }, c.shape, {c.shape[1]}, affine, false, seed++);
    }
  }
  // Channels-last [N, C, H, W] (a permuted NHWC buffer).
  compare_cuda("group_norm", [](const Tensor& x, const Tensor& w, const Tensor& b) {
    return F::group_norm(x.permute({0, 3, 1, 2}), 4, w, b);
  }, {2, 5, 3, 8}, {8}, true, false, seed++);
  compare_cuda("group_norm", [](const Tensor& x, const Tensor& w, const Tensor& b) {
    return F::group_norm(x, 2, w, b);
  }, {6, 4, 3}, {4}, true, /*transposed=*/true, seed++);
}

TEST(NormCuda, BatchNormMatchesCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  uint64_t seed = 400;
  for (const Shape& shape : std::vector<Shape>{{8, 3}, {4, 5, 7}, {3, 4, 5, 6}, {2, 16, 33, 33}, {64, 1000}}) {
    for (bool affine : {true, false}) {
      compare_cuda("batch_norm train", [](const Tensor& x, const Tensor& w, const Tensor& b) {
        return F::batch_norm(x, {}, {}, w, b, true);
      }, shape, {shape[1]}, affine, false, seed++);
      const Tensor rm = rnd({shape[1]}, seed), rv = rnd({shape[1]}, seed + 1).abs() + 0.5;
      compare_cuda("batch_norm eval", [&](const Tensor& x, const Tensor& w, const Tensor& b) {
        const DType sd = x.dtype() == DType::f64 ? DType::f64 : DType::f32;
        return F::batch_norm(x, rm.to(sd).to(x.device()), rv.to(sd).to(x.device()), w, b, false);
      }, shape, {shape[1]}, affine, false, seed++);
    }
  }
  compare_cuda("batch_norm channels-last", [](const Tensor& x, const Tensor& w, const Tensor& b) {
    return F::batch_norm(x.permute({0, 3, 1, 2}), {}, {}, w, b, true);
  }, {3, 4, 5, 6}, {6}, true, false, seed++);
}

TEST(NormCuda, BatchNormRunningStatsMatchCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor x = rnd({6, 5, 9}, 500, 2.0, 3.0).to(DType::f32);
  Tensor rm_c = rnd({5}, 501).to(DType::f32), rv_c = (rnd({5}, 502).abs() + 0.5).to(DType::f32);
  Tensor rm_g = rm_c.to(Device::cuda()), rv_g = rv_c.to(Device::cuda());
  F::batch_norm(x, rm_c, rv_c, {}, {}, true, 0.2);
  F::batch_norm(x.to(Device::cuda()), rm_g, rv_g, {}, {}, true, 0.2);
  EXPECT_TRUE(close_scaled(rm_g, rm_c, 1e-5));
  EXPECT_TRUE(close_scaled(rv_g, rv_c, 1e-5));
}

// The row backward runs a grid of resident blocks that walk the rows with a stride and prefetch
// the next row (Note [Row backward pipeline]): enough rows for several strides per block, a
// count that leaves the last stride partly empty, and each geometry (a warp per row with many
// rows per block, a 128-thread row slot, a block per row).
TEST(NormCuda, RowsManyStridesMatchCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  uint64_t seed = 700;
  struct C {
    int64_t rows, cols;
  };
  for (const C& c : std::vector<C>{{20011, 64}, {6341, 1024}, {2503, 3000}}) {
    compare_cuda("layer_norm", [&](const Tensor& x, const Tensor& w, const Tensor& b) {
      return F::layer_norm(x, {c.cols}, w, b);
    }, {c.rows, c.cols}, {c.cols}, true, false, seed++);
    compare_cuda("rms_norm", [&](const Tensor& x, const Tensor& w, const Tensor&) {
      return F::rms_norm(x, {c.cols}, w, 1e-6);
    }, {c.rows, c.cols}, {c.cols}, true, false, seed++);
  }
  // Without weight: the pipeline's unit weights.
  compare_cuda("layer_norm", [](const Tensor& x, const Tensor& w, const Tensor& b) {
    return F::layer_norm(x, {1024}, w, b);
  }, {4099, 1024}, {1024}, false, false, seed++);
}

// GroupNorm on a cluster combines per-block statistics (Note [GroupNorm cluster statistics]):
// slices of unequal size (9 vectors over 8 blocks for 2-byte types: 2, 2, 2, 2, 1 and three
// empty ranks), and a big group whose blocks all hold several vectors.
TEST(NormCuda, GroupNormClusterSlicesMatchCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  uint64_t seed = 800;
  for (const Shape& shape : std::vector<Shape>{{2, 6, 24}, {3, 12, 40}, {2, 16, 96, 96}}) {
    for (int64_t groups : {1, 2}) {
      compare_cuda("group_norm", [&](const Tensor& x, const Tensor& w, const Tensor& b) {
        return F::group_norm(x, groups, w, b);
      }, shape, {shape[1]}, true, false, seed++);
    }
  }
}

// Persistent GroupNorm clusters (Note [GroupNorm clusters]) walk more groups than are resident,
// double-buffering their exchanges by group parity: group counts well above the resident
// clusters of an H100 (66 or 33) with a partly empty last round, for one vector per thread with
// mostly idle threads, and for four (the benchmark's 64 Ki-value groups); then data whose mean
// lies far from 0 against the single-exchange statistics.
TEST(NormCuda, GroupNormPersistentClustersMatchCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  uint64_t seed = 900;
  struct C {
    Shape shape;
    int64_t groups;
    double xmean;
  };
  for (const C& c : std::vector<C>{{{9, 64, 16, 16}, 32, 0.3},
                                   {{33, 96, 24, 24}, 24, 0.3},
                                   {{35, 32, 64, 64}, 2, 0.3},
                                   {{5, 32, 32, 32}, 8, 40.0},
                                   {{3, 32, 64, 64}, 2, -25.0}}) {
    compare_cuda("group_norm", [&](const Tensor& x, const Tensor& w, const Tensor& b) {
      return F::group_norm(x, c.groups, w, b);
    }, c.shape, {c.shape[1]}, true, false, seed++, c.xmean);
  }
  // Without affine parameters (no parameter partials in the backward).
  compare_cuda("group_norm", [](const Tensor& x, const Tensor&, const Tensor&) {
    return F::group_norm(x, 16);
  }, {20, 64, 32, 32}, {64}, false, false, seed++);
}

// The lean cluster kernels (Note [GroupNorm lean forward], Note [GroupNorm lean backward])
// against the CPU: the benchmark's layout (16 channels of 4096), many groups per cluster
// (persistent rounds, both parities of the exchange buffers), rank slices rounded to whole warps
// that leave ranks empty (3 channels of 256), more channels than a warp (64 and the maximum 256),
// data whose mean lies far from 0, no affine parameters, parameter gradients only and dx only,
// and shapes the lean backward does not take (spatial sizes not a multiple of 32 vectors: the
// older cluster backward; not a multiple of the vector width: the block kernels).
TEST(NormCuda, GroupNormLeanKernelsMatchCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  struct C {
    Shape shape;
    int64_t groups;
    double xmean;
    bool affine;
  };
  const std::vector<C> cases{{{2, 32, 64, 64}, 2, 0.3, true},   {{9, 64, 16, 16}, 32, 0.3, true},
                             {{3, 24, 16, 16}, 8, 0.3, true},   {{2, 128, 16, 16}, 2, 0.3, true},
                             {{1, 256, 16, 16}, 1, 0.3, true},  {{5, 32, 32, 32}, 8, 40.0, true},
                             {{20, 64, 32, 32}, 16, 0.3, false}, {{2, 6, 24}, 2, 0.3, true},
                             {{2, 4, 4099}, 2, 0.3, true}};
  uint64_t seed = 1000;
  for (const C& c : cases) {
    compare_cuda("group_norm", [&](const Tensor& x, const Tensor& w, const Tensor& b) {
      return F::group_norm(x, c.groups, w, b);
    }, c.shape, {c.shape[1]}, c.affine, false, seed, c.xmean);
    seed += 10;
  }
  // Only the parameter gradients (no dx), then only dx (parameters without grad).
  const Tensor x = rnd({3, 32, 32, 32}, 1100, 0.3, 1.5).to(DType::f32);
  const Tensor v = rnd({3, 32, 32, 32}, 1101).to(DType::f32);
  const Tensor wc = rnd({32}, 1102, 1.0, 0.5).to(DType::f32).requires_grad_();
  const Tensor bc = rnd({32}, 1103).to(DType::f32).requires_grad_();
  const Tensor wg = wc.detach().to(Device::cuda()).requires_grad_();
  const Tensor bg = bc.detach().to(Device::cuda()).requires_grad_();
  BackwardOptions oc, og;
  oc.grad_output = v;
  og.grad_output = v.to(Device::cuda());
  Gradients gc = F::group_norm(x, 4, wc, bc).backward(oc);
  Gradients gg = F::group_norm(x.to(Device::cuda()), 4, wg, bg).backward(og);
  EXPECT_TRUE(close_scaled(gg.get(wg), gc.get(wc), 1e-4)) << "dweight only";
  EXPECT_TRUE(close_scaled(gg.get(bg), gc.get(bc), 1e-4)) << "dbias only";
  const Tensor xc = x.detach().requires_grad_(), xg = x.to(Device::cuda()).requires_grad_();
  Gradients hc = F::group_norm(xc, 4, wc.detach(), bc.detach()).backward(oc);
  Gradients hg = F::group_norm(xg, 4, wg.detach(), bg.detach()).backward(og);
  EXPECT_TRUE(close_scaled(hg.get(xg), hc.get(xc), 1e-4)) << "dx only";
}

TEST(NormCuda, OnlyWeightGradient) {
  FLAME_SKIP_IF_NO_CUDA();
  for (int64_t cols : {1024, 5000}) {
    const Tensor x = rnd({33, cols}, 600).to(DType::f32);
    const Tensor v = rnd({33, cols}, 601).to(DType::f32);
    const Tensor wc = rnd({cols}, 602).to(DType::f32).requires_grad_();
    const Tensor wg = wc.detach().to(Device::cuda()).requires_grad_();
    BackwardOptions oc, og;
    oc.grad_output = v;
    og.grad_output = v.to(Device::cuda());
    Gradients gc = F::layer_norm(x, {cols}, wc).backward(oc);
    Gradients gg = F::layer_norm(x.to(Device::cuda()), {cols}, wg).backward(og);
    EXPECT_TRUE(close_scaled(gg.get(wg), gc.get(wc), 1e-4)) << cols;
  }
}

// The row kernels across their geometries (Note [CUDA norm kernels]): every forward configuration
// (a warp per row with several rows per block, 128 and 256 threads per row, a block per row and
// the long-row kernel), vector and scalar paths, data whose mean lies far from 0 in both
// directions (the forward's one-round shifted sums, Note [Row forward statistics]), no affine
// parameters, and row counts of several backward strides (the grid of equal row steps; 9001
// rows of 64 leave the last step partly empty).
TEST(NormCuda, RowsShapesMatchCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  struct C {
    int64_t rows, cols;
    double xmean;
    bool affine;
  };
  const std::vector<C> cases{{7, 1, 0.3, true},       {130, 3, 0.3, true},     {131, 96, 0.3, true},
                             {131, 1000, 0.3, true},  {131, 1024, 0.3, false}, {130, 1024, 40.0, true},
                             {33, 1152, -25.0, true}, {7, 4099, 0.3, true},    {5, 8192, 0.3, true},
                             {3, 20000, 0.3, true},   {9001, 64, 0.3, true},   {4099, 1024, 0.3, true}};
  uint64_t seed = 1200;
  for (const C& c : cases) {
    compare_cuda("layer_norm", [&](const Tensor& x, const Tensor& w, const Tensor& b) {
      return F::layer_norm(x, {c.cols}, w, b);
    }, {c.rows, c.cols}, {c.cols}, c.affine, false, seed++, c.xmean);
    compare_cuda("rms_norm", [&](const Tensor& x, const Tensor& w, const Tensor&) {
      return F::rms_norm(x, {c.cols}, w, 1e-6);
    }, {c.rows, c.cols}, {c.cols}, c.affine, false, seed++, c.xmean);
  }
}

// The row backward's second stage is a programmatic dependent launch on sm_90 (Note [Row backward
// second stage]): captured into a CUDA graph and replayed it gives the eager gradients.
TEST(NormCuda, RowsBackwardUnderGraphCapture) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda();
  Generator g(71);
  const Tensor x0 = Tensor::randn({512, 1024}, 0.5, 2.0, DType::f32, &g).to(DType::bf16).to(dev);
  Tensor w = Tensor::randn({1024}, 1.0, 0.2, DType::f32, &g).to(DType::bf16).to(dev).requires_grad_(true);
  Tensor b = Tensor::randn({1024}, 0.0, 0.2, DType::f32, &g).to(DType::bf16).to(dev).requires_grad_(true);
  const Tensor dy = Tensor::randn({512, 1024}, 0.0, 1.0, DType::f32, &g).to(DType::bf16).to(dev);
  Tensor x = x0.detach().requires_grad_(true);
  BackwardOptions opt;
  opt.grad_output = dy;
  auto run = [&] {
    Gradients gr = F::layer_norm(x, {1024}, w, b).backward(opt);
    return TensorList{gr.get(x), gr.get(w), gr.get(b)};
  };
  const TensorList eager = run();
  cuda::Graph graph;
  TensorList captured;
  cuda::capture(graph, [&] { captured = run(); });
  graph.replay();
  cuda::synchronize();
  ASSERT_EQ(captured.size(), eager.size());
  // A warp per row, slices added in a fixed order (Note [Warp row backward]): bit-identical.
  for (std::size_t i = 0; i < eager.size(); ++i) EXPECT_TRUE(same_bits(captured[i], eager[i], "gradient " + std::to_string(i)));
}

// The warp-per-row backward of 2-byte types (Note [Warp row backward]) at the edges of its two
// configurations (257..512 and 513..1024 columns, rows not filling the last vector of a lane),
// with one side of the gradients not wanted, and its determinism (no atomics: equal bits).
TEST(NormCuda, RowsWarpBackward) {
  FLAME_SKIP_IF_NO_CUDA();
  uint64_t seed = 1400;
  for (int64_t cols : {264, 512, 520, 1000}) {
    for (int64_t rows : {1, 37, 2053}) {
      compare_cuda("layer_norm", [&](const Tensor& x, const Tensor& w, const Tensor& b) {
        return F::layer_norm(x, {cols}, w, b);
      }, {rows, cols}, {cols}, rows != 37, false, seed++);
      compare_cuda("rms_norm", [&](const Tensor& x, const Tensor& w, const Tensor&) {
        return F::rms_norm(x, {cols}, w, 1e-6);
      }, {rows, cols}, {cols}, true, false, seed++);
    }
  }
  const Device dev = Device::cuda();
  for (DType dt : {DType::bf16, DType::f16}) {
    const Tensor x = rnd({3001, 1024}, seed++, 0.3, 1.5).to(dt).to(dev);
    const Tensor w = rnd({1024}, seed++, 1.0, 0.5).to(dt).to(dev).requires_grad_(true);
    const Tensor b = rnd({1024}, seed++).to(dt).to(dev).requires_grad_(true);
    const Tensor dy = rnd({3001, 1024}, seed++).to(dt).to(dev);
    BackwardOptions opt;
    opt.grad_output = dy;
    // x does not require grad: the parameter gradients alone.
    Gradients g1 = F::layer_norm(x, {1024}, w, b).backward(opt);
    Gradients g2 = F::layer_norm(x, {1024}, w, b).backward(opt);
    EXPECT_TRUE(same_bits(g1.get(w), g2.get(w), dtype_name(dt)));
    EXPECT_TRUE(same_bits(g1.get(b), g2.get(b), dtype_name(dt)));
    const Tensor xr = x.detach().requires_grad_(true);
    Gradients g3 = F::layer_norm(xr, {1024}, w, b).backward(opt);
    EXPECT_TRUE(same_bits(g3.get(w), g1.get(w), dtype_name(dt)));
    // The reference of the parameter gradients in f64 on the CPU.
    const Tensor xc = x.to(Device::cpu()).to(DType::f64);
    const Tensor wc = w.detach().to(Device::cpu()).to(DType::f64).requires_grad_(true);
    const Tensor bc = b.detach().to(Device::cpu()).to(DType::f64).requires_grad_(true);
    BackwardOptions oc;
    oc.grad_output = dy.to(Device::cpu()).to(DType::f64);
    Gradients gc = F::layer_norm(xc, {1024}, wc, bc).backward(oc);
    EXPECT_TRUE(close_scaled(g1.get(w), gc.get(wc), 2 * cuda_tol(dt), 1.0)) << dtype_name(dt);
    EXPECT_TRUE(close_scaled(g1.get(b), gc.get(bc), 2 * cuda_tol(dt), 1.0)) << dtype_name(dt);
  }
}

}  // namespace
}  // namespace flame::test
