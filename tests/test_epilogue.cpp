// Linear's fused epilogues (Note [Linear epilogues] in src/ops/linear_epilogue.cpp): F::linear with
// a bias, F::linear_gelu and F::mlp_gelu.
//  - EpilogueLinear*/EpilogueLinearGelu*/EpilogueMlpGelu*: forward and every gradient on the device
//    under test (FLAME_TEST_DEVICE) in f32/bf16/f16 against a float64 CPU reference written here
//    with plain ops (matmul, add, tanh: not the ops under test), from the same rounded inputs;
//    aligned shapes (the fused cuBLASLt path on CUDA) and odd ones (the composite), batched
//    leading dims, non-contiguous inputs, frozen weights, pre-activations near 0 and large.
//  - EpilogueGradcheck.*: float64 finite differences on the CPU.
//  - EpilogueRule.*: which path runs (CUDA only: the node name tells the fused bias GEMM apart).
//  - EpilogueAutocast.*, EpilogueErrors.*.
#include <cmath>

#include "flame/nn.h"
#include "flame/nn/linear_gelu.h"
#include "gradcheck.h"
#include "nn_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {

namespace F = nn::functional;

double tol_for(DType dt) {
  switch (dt) {
    case DType::bf16: return 2e-2;
    case DType::f16: return 4e-3;
    case DType::f32: return 2e-4;  // TF32 may be on for the GEMM
    default: return 1e-10;
  }
}

// gelu with the tanh approximation written with plain ops: independent of the gelu kernels.
Tensor ref_gelu(const Tensor& p) {
  const double k = std::sqrt(2.0 / M_PI);
  return p * 0.5 * (((p + p * p * p * 0.044715) * k).tanh() + 1.0);
}
Tensor ref_dense(const Tensor& x, const Tensor& w, const Tensor& b, bool gelu) {
  Tensor p = x.matmul(w.t());
  if (b.defined()) p = p + b;
  return gelu ? ref_gelu(p) : p;
}

enum class XLayout { contiguous, sliced, transposed };

// The input handed to the op, from the leaf: contiguous, every row a slice of a wider row, or
// the two leading dims swapped (the leaf is stored [lead1, lead0, ..., in] for that).
Tensor shape_input(const Tensor& leaf, XLayout layout, int64_t in) {
  switch (layout) {
    case XLayout::contiguous: return leaf;
    case XLayout::sliced: return leaf.narrow(-1, 1, in);
    case XLayout::transposed: return leaf.transpose(0, 1);
  }
  return leaf;
}
Shape leaf_shape(Shape lead, XLayout layout, int64_t in) {
  if (layout == XLayout::transposed) std::swap(lead[0], lead[1]);
  lead.push_back(layout == XLayout::sliced ? in + 3 : in);
  return lead;
}

struct Result {
  Tensor y;
  std::vector<Tensor> grads;  // of the leaves, in order (undefined where not asked)
};

// Runs fn on leaves (moved to dt on dev); v is the upstream gradient. frozen[i]: no gradient.
Result run(const std::function<Tensor(const TensorList&)>& fn, const TensorList& leaves64, const Tensor& v64,
           DType dt, Device dev, const std::vector<bool>& frozen = {}) {
  TensorList leaves;
  for (std::size_t i = 0; i < leaves64.size(); ++i) {
    if (!leaves64[i].defined()) {
      leaves.push_back(Tensor());
      continue;
    }
    Tensor t = leaves64[i].detach().to(dt).to(dev);  // a fresh leaf even when nothing converts
    if (i >= frozen.size() || !frozen[i]) t.requires_grad_();
    leaves.push_back(t);
  }
  Result r;
  Tensor y = fn(leaves);
  BackwardOptions o;
  o.grad_output = v64.to(y.dtype()).to(dev);
  Gradients g = y.backward(o);
  r.y = y.detach();
  for (const Tensor& t : leaves) r.grads.push_back(t.defined() && t.requires_grad() ? g.try_get(t) : Tensor());
  return r;
}

// Rounds to dt and back, so that the reference sees the device's inputs exactly.
Tensor rounded(const Tensor& t, DType dt) { return t.defined() ? t.to(dt).to(DType::f64) : t; }

void expect_matches(const char* what, const std::function<Tensor(const TensorList&)>& op,
                    const std::function<Tensor(const TensorList&)>& ref, const TensorList& leaves64,
                    const Tensor& v64, DType dt, const std::vector<bool>& frozen = {}) {
  const Device dev = test_device();
  TensorList r64;
  for (const Tensor& t : leaves64) r64.push_back(rounded(t, dt));
  const Result want = run(ref, r64, rounded(v64, dt), DType::f64, Device::cpu(), frozen);
  const Result got = run(op, r64, rounded(v64, dt), dt, dev, frozen);
  const double tol = tol_for(dt);
  EXPECT_EQ(got.y.dtype(), dt) << what;
  EXPECT_TRUE(close_scaled(got.y.to(Device::cpu()), want.y, tol)) << what << " forward, " << dtype_name(dt);
  for (std::size_t i = 0; i < want.grads.size(); ++i) {
    const Tensor g = got.grads[i].defined() ? got.grads[i].to(Device::cpu()) : Tensor();
    EXPECT_TRUE(close_scaled(g, want.grads[i], tol)) << what << " gradient of input " << i << ", " << dtype_name(dt);
  }
}

std::vector<DType> dtypes() {
  std::vector<DType> d{DType::f32, DType::bf16, DType::f16};
  if (test_device().is_cpu()) d.push_back(DType::f64);
  return d;
}

struct Case {
  Shape lead;
  int64_t in, out;
};
// Aligned (in, out multiples of 8: the fused path on CUDA) and odd shapes (the composite).
const std::vector<Case>& cases() {
  static const std::vector<Case> c{{{40}, 64, 24}, {{3, 17}, 32, 16}, {{2, 3, 5}, 16, 8},
                                   {{13}, 7, 9},   {{4, 6}, 24, 10},  {{6, 5}, 9, 16}};
  return c;
}

void linear_family_case(bool gelu, bool bias, XLayout layout, DType dt, const Case& c, uint64_t seed,
                        const std::vector<bool>& frozen = {}) {
  const TensorList leaves{randn_f64(leaf_shape(c.lead, layout, c.in), seed),
                          randn_f64({c.out, c.in}, seed + 1, 1.0 / std::sqrt(static_cast<double>(c.in))),
                          bias ? randn_f64({c.out}, seed + 2) : Tensor()};
  Shape ys = c.lead;
  ys.push_back(c.out);
  const Tensor v = randn_f64(ys, seed + 3);
  const int64_t in = c.in;
  auto op = [&](const TensorList& t) {
    const Tensor x = shape_input(t[0], layout, in);
    return gelu ? F::linear_gelu(x, t[1], t[2]) : F::linear(x, t[1], t[2]);
  };
  auto ref = [&](const TensorList& t) { return ref_dense(shape_input(t[0], layout, in), t[1], t[2], gelu); };
  const std::string what = std::string(gelu ? "linear_gelu" : "linear") + (bias ? " bias" : " no-bias") +
                           " lead " + ::testing::PrintToString(c.lead) + " in " + std::to_string(c.in) + " out " +
                           std::to_string(c.out) + " layout " + std::to_string(static_cast<int>(layout));
  expect_matches(what.c_str(), op, ref, leaves, v, dt, frozen);
}

TEST(EpilogueLinear, BiasAndNoBiasMatchReference) {
  FLAME_SKIP_IF_NO_DEVICE();
  uint64_t seed = 100;
  for (DType dt : dtypes())
    for (const Case& c : cases())
      for (bool bias : {true, false}) linear_family_case(false, bias, XLayout::contiguous, dt, c, seed += 10);
}

TEST(EpilogueLinear, NonContiguousInputAndFrozenParameters) {
  FLAME_SKIP_IF_NO_DEVICE();
  uint64_t seed = 200;
  for (DType dt : {DType::f32, DType::bf16}) {
    for (const Case& c : cases()) {
      if (c.lead.size() < 2) continue;
      linear_family_case(false, true, XLayout::sliced, dt, c, seed += 10);
      linear_family_case(false, true, XLayout::transposed, dt, c, seed += 10);
      linear_family_case(false, true, XLayout::contiguous, dt, c, seed += 10, {false, true, false});  // frozen W
      linear_family_case(false, true, XLayout::contiguous, dt, c, seed += 10, {true, false, true});   // W only
    }
  }
}

TEST(EpilogueLinearGelu, MatchesReference) {
  FLAME_SKIP_IF_NO_DEVICE();
  uint64_t seed = 300;
  for (DType dt : dtypes())
    for (const Case& c : cases())
      for (bool bias : {true, false}) linear_family_case(true, bias, XLayout::contiguous, dt, c, seed += 10);
}

TEST(EpilogueLinearGelu, NonContiguousInputAndFrozenParameters) {
  FLAME_SKIP_IF_NO_DEVICE();
  uint64_t seed = 400;
  for (DType dt : {DType::f32, DType::bf16}) {
    for (const Case& c : cases()) {
      if (c.lead.size() < 2) continue;
      linear_family_case(true, true, XLayout::sliced, dt, c, seed += 10);
      linear_family_case(true, true, XLayout::transposed, dt, c, seed += 10);
      linear_family_case(true, true, XLayout::contiguous, dt, c, seed += 10, {false, true, true});  // frozen W, b
      linear_family_case(true, true, XLayout::contiguous, dt, c, seed += 10, {true, false, false});  // W, b only
    }
  }
}

// Pre-activations near 0 (tiny x and bias) and of large magnitude (large bias: gelu saturates
// to 0 and to x, gelu' to 0 and 1).
TEST(EpilogueLinearGelu, NearZeroAndLargePreActivations) {
  FLAME_SKIP_IF_NO_DEVICE();
  for (DType dt : {DType::f32, DType::bf16}) {
    for (double scale : {1e-3, 30.0}) {
      const int64_t in = 32, out = 16;
      const TensorList leaves{randn_f64({24, in}, 501) * (scale < 1 ? scale : 1.0), randn_f64({out, in}, 502, 0.1),
                              randn_f64({out}, 503) * scale};
      const Tensor v = randn_f64({24, out}, 504);
      auto op = [](const TensorList& t) { return F::linear_gelu(t[0], t[1], t[2]); };
      auto ref = [](const TensorList& t) { return ref_dense(t[0], t[1], t[2], true); };
      expect_matches(scale < 1 ? "near zero" : "large", op, ref, leaves, v, dt);
    }
  }
}

TEST(EpilogueMlpGelu, MatchesReference) {
  FLAME_SKIP_IF_NO_DEVICE();
  uint64_t seed = 600;
  struct MlpCase {
    Shape lead;
    int64_t in, hidden, out;
  };
  for (DType dt : dtypes()) {
    for (const MlpCase& c : std::vector<MlpCase>{{{2, 20}, 32, 64, 32}, {{11}, 16, 24, 8}, {{5, 3}, 7, 9, 5}}) {
      for (bool bias : {true, false}) {
        for (int frozen_kind = 0; frozen_kind < 3; ++frozen_kind) {
          seed += 10;
          const TensorList leaves{randn_f64(leaf_shape(c.lead, XLayout::contiguous, c.in), seed),
                                  randn_f64({c.hidden, c.in}, seed + 1, 1.0 / std::sqrt(double(c.in))),
                                  bias ? randn_f64({c.hidden}, seed + 2) : Tensor(),
                                  randn_f64({c.out, c.hidden}, seed + 3, 1.0 / std::sqrt(double(c.hidden))),
                                  bias ? randn_f64({c.out}, seed + 4) : Tensor()};
          Shape ys = c.lead;
          ys.push_back(c.out);
          const Tensor v = randn_f64(ys, seed + 5);
          // 0: all train; 1: first layer frozen (x and layer 2 only); 2: second layer frozen.
          std::vector<bool> frozen(5, false);
          if (frozen_kind == 1) frozen[1] = frozen[2] = true;
          if (frozen_kind == 2) frozen[3] = frozen[4] = true;
          auto op = [](const TensorList& t) { return F::mlp_gelu(t[0], t[1], t[2], t[3], t[4]); };
          auto ref = [](const TensorList& t) {
            return ref_dense(ref_dense(t[0], t[1], t[2], true), t[3], t[4], false);
          };
          expect_matches(("mlp_gelu in " + std::to_string(c.in) + " frozen " + std::to_string(frozen_kind)).c_str(),
                         op, ref, leaves, v, dt, frozen);
        }
      }
    }
  }
}

TEST(EpilogueMlpGelu, EqualsLinearGeluThenLinear) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = randn_f64({8, 16}, 700).to(DType::f32).to(dev);
  const Tensor w1 = randn_f64({32, 16}, 701, 0.25).to(DType::f32).to(dev),
               b1 = randn_f64({32}, 702).to(DType::f32).to(dev);
  const Tensor w2 = randn_f64({16, 32}, 703, 0.2).to(DType::f32).to(dev),
               b2 = randn_f64({16}, 704).to(DType::f32).to(dev);
  EXPECT_TRUE(close_scaled(F::mlp_gelu(x, w1, b1, w2, b2).to(Device::cpu()),
                           F::linear(F::linear_gelu(x, w1, b1), w2, b2).to(Device::cpu()), 1e-5));
}

TEST(EpilogueGradcheck, LinearGeluF64) {
  for (bool bias : {true, false}) {
    const TensorList in{randn_f64({2, 3, 4}, 800), randn_f64({5, 4}, 801, 0.5), bias ? randn_f64({5}, 802) : Tensor()};
    const GradcheckResult r =
        bias ? gradcheck([](const TensorList& t) { return F::linear_gelu(t[0], t[1], t[2]); }, in)
             : gradcheck([](const TensorList& t) { return F::linear_gelu(t[0], t[1]); }, {in[0], in[1]});
    EXPECT_TRUE(r.ok) << r.message;
  }
  // 1-d input.
  const GradcheckResult v = gradcheck([](const TensorList& t) { return F::linear_gelu(t[0], t[1], t[2]); },
                                      {randn_f64({4}, 803), randn_f64({3, 4}, 804), randn_f64({3}, 805)});
  EXPECT_TRUE(v.ok) << v.message;
}

TEST(EpilogueGradcheck, MlpGeluF64) {
  const GradcheckResult r = gradcheck([](const TensorList& t) { return F::mlp_gelu(t[0], t[1], t[2], t[3], t[4]); },
                                      {randn_f64({3, 4}, 810), randn_f64({6, 4}, 811, 0.5), randn_f64({6}, 812),
                                       randn_f64({2, 6}, 813, 0.5), randn_f64({2}, 814)});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(EpilogueGradcheck, LinearBiasF64) {
  const GradcheckResult r = gradcheck([](const TensorList& t) { return F::linear(t[0], t[1], t[2]); },
                                      {randn_f64({2, 5, 8}, 820), randn_f64({8, 8}, 821), randn_f64({8}, 822)});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(EpilogueLinearGelu, OneNodeAndEmptyShapes) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor w = randn_f64({8, 16}, 830).to(DType::f32).to(dev).requires_grad_();
  const Tensor b = randn_f64({8}, 831).to(DType::f32).to(dev).requires_grad_();
  const Tensor x = randn_f64({4, 16}, 832).to(DType::f32).to(dev);
  const Tensor y = F::linear_gelu(x, w, b);
  EXPECT_EQ(y.grad_fn_name(), "LinearGeluBackward");
  {
    NoGradGuard no_grad;  // inference: no node, no saved pre-activation, same values
    const Tensor yi = F::linear_gelu(x, w, b);
    EXPECT_EQ(yi.grad_fn_name(), "");
    EXPECT_TRUE(close_scaled(yi.to(Device::cpu()), y.detach().to(Device::cpu()), 1e-6));
  }
  // No rows: an empty result, zero weight and bias gradients.
  const Tensor x0 = Tensor::zeros({0, 16}, TensorOptions(DType::f32, dev));
  const Tensor y0 = F::linear_gelu(x0, w, b);
  EXPECT_EQ(y0.sizes(), (Shape{0, 8}));
  Gradients g = y0.sum().backward();
  EXPECT_TRUE(close_scaled(g.get(w).to(Device::cpu()), Tensor::zeros({8, 16}, DType::f64), 0.0));
  EXPECT_TRUE(close_scaled(g.get(b).to(Device::cpu()), Tensor::zeros({8}, DType::f64), 0.0));
}

// Under a bf16 autocast scope linear_gelu runs in bf16 like linear, f32 parameters included, and
// its gradients reach the f32 leaves in f32.
TEST(EpilogueAutocast, LinearGeluFollowsLinearPolicy) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = randn_f64({6, 32}, 900).to(DType::f32).to(dev).requires_grad_();
  const Tensor w = randn_f64({16, 32}, 901, 0.2).to(DType::f32).to(dev).requires_grad_();
  const Tensor b = randn_f64({16}, 902).to(DType::f32).to(dev).requires_grad_();
  Tensor y, y_ref;
  {
    amp::AutocastGuard autocast(DType::bf16, dev.type);
    y = F::linear_gelu(x, w, b);
    y_ref = F::linear(x, w, b).gelu(true);
  }
  EXPECT_EQ(y.dtype(), DType::bf16);
  EXPECT_EQ(y_ref.dtype(), DType::bf16);
  EXPECT_TRUE(close_scaled(y.to(Device::cpu()), y_ref.to(Device::cpu()), 2e-2));
  BackwardOptions keep;
  keep.grad_output = Tensor::ones(y.sizes(), TensorOptions(DType::f32, dev));
  keep.retain_graph = true;  // the autocast casts of the leaves are shared by both results
  Gradients g = y.to(DType::f32).backward(keep);
  EXPECT_EQ(g.get(w).dtype(), DType::f32);
  EXPECT_EQ(g.get(b).dtype(), DType::f32);
  Gradients gr = y_ref.to(DType::f32).sum().backward();
  EXPECT_TRUE(close_scaled(g.get(w).to(Device::cpu()), gr.get(w).to(Device::cpu()), 3e-2));
  EXPECT_TRUE(close_scaled(g.get(b).to(Device::cpu()), gr.get(b).to(Device::cpu()), 3e-2));
  EXPECT_TRUE(close_scaled(g.get(x).to(Device::cpu()), gr.get(x).to(Device::cpu()), 3e-2));
}

// Note [Master-weight epilogues]: under bf16 autocast linear, linear_gelu and mlp_gelu with f32
// weights that want gradients record one node on the f32 leaves. The weight and bias gradients
// arrive in f32: on CUDA straight from the GEMM's f32 accumulator (so within f32 rounding of a
// float64 reference computed from the same bf16 operands, far tighter than a bf16 gradient could
// be); on the CPU, which composes, exactly the unfused autocast's bf16 gradient cast up.
TEST(EpilogueAutocast, MasterWeightsGetF32GradientsFromOneNode) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const bool fused = dev.is_cuda();
  const int64_t M = 48, K = 32, H = 64, N = 16;
  // Every operand and the upstream gradient bf16-exact, so both sides see the same numbers.
  auto leaf = [&](Shape s, uint64_t seed, double scale) {
    return rounded(randn_f64(s, seed, scale), DType::bf16).to(DType::f32).to(dev).requires_grad_();
  };
  for (int kind = 0; kind < 4; ++kind) {  // linear + bias, linear without bias, linear_gelu, mlp_gelu
    SCOPED_TRACE(kind);
    const Tensor x = leaf({M, K}, 980, 1.0), w1 = leaf({H, K}, 981, 0.2), b1 = leaf({H}, 982, 1.0),
                 w2 = leaf({N, H}, 983, 0.2), b2 = leaf({N}, 984, 1.0);
    const bool bias = kind != 1;
    auto fn = [&](const Tensor& xx, const Tensor& a, const Tensor& ab, const Tensor& c, const Tensor& cb) {
      switch (kind) {
        case 0: return F::linear(xx, a, ab);
        case 1: return F::linear(xx, a, Tensor());
        case 2: return F::linear_gelu(xx, a, ab);
        default: return F::mlp_gelu(xx, a, ab, c, cb);
      }
    };
    const int64_t out = kind == 3 ? N : H;
    const Tensor v = rounded(randn_f64({M, out}, 985), DType::bf16).to(DType::f32).to(dev);
    Tensor y;
    {
      amp::AutocastGuard autocast(DType::bf16, dev.type);
      y = fn(x, w1, b1, w2, b2);
    }
    ASSERT_EQ(y.dtype(), DType::bf16);
    if (fused && kind != 1) EXPECT_NE(y.grad_fn_name().find("Backward"), std::string::npos);
    BackwardOptions o;
    o.grad_output = v.to(DType::bf16);
    Gradients g = y.backward(o);
    const TensorList params = kind == 3 ? TensorList{w1, b1, w2, b2} : bias ? TensorList{w1, b1} : TensorList{w1};
    // The unfused autocast, by hand: bf16 copies, bf16 gradients cast up.
    const Tensor xb = x.detach().to(DType::bf16).requires_grad_();
    TensorList pb;
    for (const Tensor& p : params) pb.push_back(p.detach().to(DType::bf16).requires_grad_());
    const Tensor yb = kind == 3 ? fn(xb, pb[0], pb[1], pb[2], pb[3]) : fn(xb, pb[0], bias ? pb[1] : Tensor(), {}, {});
    BackwardOptions ob;
    ob.grad_output = v.to(DType::bf16);
    Gradients gb = yb.backward(ob);
    EXPECT_TRUE(close_scaled(y.detach().to(Device::cpu()), yb.detach().to(Device::cpu()), 1e-2));
    EXPECT_TRUE(close_scaled(g.get(x).to(Device::cpu()), gb.get(xb).to(Device::cpu()), fused ? 2e-2 : 0.0));
    // float64 reference from the same bf16 operands.
    const Tensor x64 = x.detach().to(Device::cpu()).to(DType::f64).requires_grad_();
    TensorList p64;
    for (const Tensor& p : params) p64.push_back(p.detach().to(Device::cpu()).to(DType::f64).requires_grad_());
    Tensor y64;
    if (kind == 3) y64 = ref_dense(ref_dense(x64, p64[0], p64[1], true), p64[2], p64[3], false);
    else y64 = ref_dense(x64, p64[0], bias ? p64[1] : Tensor(), kind == 2);
    BackwardOptions o64;
    o64.grad_output = v.to(Device::cpu()).to(DType::f64);
    Gradients g64 = y64.backward(o64);
    for (std::size_t i = 0; i < params.size(); ++i) {
      SCOPED_TRACE(i);
      const Tensor gi = g.get(params[i]);
      ASSERT_TRUE(gi.defined());
      EXPECT_EQ(gi.dtype(), DType::f32);
      const Tensor unfused = gb.get(pb[i]).to(DType::f32).to(Device::cpu());
      if (!fused) {
        EXPECT_TRUE(close_scaled(gi.to(Device::cpu()), unfused, 0.0));  // the same composite
        continue;
      }
      // Gradients made of bf16 operands only (x and the upstream gradient) are f32-accurate: the
      // plain linear's and mlp_gelu's b2. w2's reads the bf16-rounded hidden activation, and the
      // hidden layer's go through a bf16 gelu' product (as the unfused path's do).
      const bool last = kind < 2 || (kind == 3 && i == 3);
      const double tol = last ? 1e-5 : 2e-2;
      EXPECT_TRUE(close_scaled(gi.to(Device::cpu()), g64.get(p64[i]).to(DType::f32), tol));
      if (last) EXPECT_FALSE(close_scaled(unfused, g64.get(p64[i]).to(DType::f32), 1e-5)) << "bf16-rounded";
    }
  }
  // A frozen f32 weight takes the ordinary casts; its bias still gets an f32 gradient.
  const Tensor x = leaf({M, K}, 990, 1.0), b = leaf({H}, 992, 1.0);
  const Tensor w = rounded(randn_f64({H, K}, 991, 0.2), DType::bf16).to(DType::f32).to(dev);
  Tensor y;
  {
    amp::AutocastGuard autocast(DType::bf16, dev.type);
    y = F::linear(x, w, b);
  }
  Gradients g = y.to(DType::f32).sum().backward();
  EXPECT_EQ(g.get(b).dtype(), DType::f32);
  EXPECT_TRUE(close_scaled(g.get(b).to(Device::cpu()), Tensor::full({H}, static_cast<double>(M), DType::f32), 0.0));
}

// The rule (Note [Linear epilogues]): on CUDA, F::linear with a bias on aligned bf16/f16/f32
// operands is one fused GEMM node; odd sizes, f64, a transposed weight or a strided input keep the
// matmul + add composite. Values are right either way.
TEST(EpilogueRule, FusedBiasGemmOnlyWhereTheLayoutAllows) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda();
  auto node_of = [&](const Shape& xs, int64_t in, int64_t out, DType dt, bool transposed_w, bool sliced_x) {
    Tensor x = randn_f64(sliced_x ? Shape{xs[0], in + 2} : xs, 950).to(dt).to(dev);
    if (sliced_x) x = x.narrow(1, 0, in);
    Tensor w = transposed_w ? randn_f64({in, out}, 951).to(dt).to(dev).t() : randn_f64({out, in}, 951).to(dt).to(dev);
    const Tensor b = randn_f64({out}, 952).to(dt).to(dev).requires_grad_();
    const Tensor y = F::linear(x, w, b);
    const Tensor want = ref_dense(x.to(Device::cpu()).to(DType::f64), w.detach().to(Device::cpu()).to(DType::f64),
                                  b.detach().to(Device::cpu()).to(DType::f64), false);
    EXPECT_TRUE(close_scaled(y.detach().to(Device::cpu()), want, tol_for(dt))) << dtype_name(dt);
    return y.grad_fn_name();
  };
  for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
    EXPECT_EQ(node_of({64, 32}, 32, 48, dt, false, false), "AddmmBackward") << dtype_name(dt);
    EXPECT_NE(node_of({64, 33}, 33, 48, dt, false, false), "AddmmBackward") << dtype_name(dt);  // K odd
    EXPECT_NE(node_of({64, 32}, 32, 45, dt, false, false), "AddmmBackward") << dtype_name(dt);  // N odd
    EXPECT_NE(node_of({64, 32}, 32, 48, dt, true, false), "AddmmBackward") << dtype_name(dt);   // W^T view
    EXPECT_NE(node_of({64, 32}, 32, 48, dt, false, true), "AddmmBackward") << dtype_name(dt);   // strided x
  }
  EXPECT_EQ(node_of({7, 32}, 32, 48, DType::bf16, false, false), "AddmmBackward");  // M needs no alignment
  EXPECT_NE(node_of({64, 32}, 32, 48, DType::f64, false, false), "AddmmBackward");
}

// A block of a wider weight's columns (w = W[:, c0:c0 + in], FLUX's single-block proj_out split)
// is read in place by the fused GEMM when its rows stay 16-byte aligned (row stride % 8 == 0 and
// an aligned start); x's gradient comes right through the same strided weight.
TEST(EpilogueRule, ColumnBlockOfAWiderWeightIsReadInPlace) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda();
  for (DType dt : {DType::bf16, DType::f32}) {
    for (int64_t c0 : {16, 1}) {  // 1: a misaligned start, which composes
      SCOPED_TRACE(std::string(dtype_name(dt)) + " c0 " + std::to_string(c0));
      const int64_t M = 40, in = 32, out = 48, wide = 56;
      const Tensor full = randn_f64({out, wide}, 970).to(dt).to(dev);
      const Tensor w = full.narrow(1, c0, in);
      Tensor x = randn_f64({M, in}, 971).to(dt).to(dev).requires_grad_();
      const Tensor b = randn_f64({out}, 972).to(dt).to(dev);
      const Tensor y = F::linear(x, w, b);
      if (c0 == 16) EXPECT_EQ(y.grad_fn_name(), "AddmmBackward");
      else EXPECT_NE(y.grad_fn_name(), "AddmmBackward");
      const Tensor gy = randn_f64({M, out}, 973).to(dt);
      Gradients g = (y * gy.to(dev)).sum().backward();
      const Tensor x64 = x.detach().to(Device::cpu()).to(DType::f64), w64 = w.to(Device::cpu()).to(DType::f64);
      const Tensor want = ref_dense(x64, w64, b.to(Device::cpu()).to(DType::f64), false);
      EXPECT_TRUE(close_scaled(y.detach().to(Device::cpu()), want, tol_for(dt)));
      EXPECT_TRUE(close_scaled(g.get(x).to(Device::cpu()), gy.to(DType::f64).matmul(w64), tol_for(dt)));
    }
  }
}

TEST(EpilogueRule, CpuAlwaysComposes) {
  const Tensor x = randn_f64({4, 16}, 960), w = randn_f64({8, 16}, 961).requires_grad_(),
               b = randn_f64({8}, 962).requires_grad_();
  EXPECT_NE(F::linear(x, w, b).grad_fn_name(), "AddmmBackward");
}

// linear_add (Note [Residual epilogue]): x W^T + c against the f64 reference, over the aligned
// shapes the fused GEMM takes on CUDA and the odd ones; strided inputs and residuals (a transposed
// view: the GEMM's C must be contiguous, so it is copied), frozen operands, and one node always.
TEST(EpilogueLinearAdd, MatchesReference) {
  FLAME_SKIP_IF_NO_DEVICE();
  uint64_t seed = 1300;
  for (DType dt : dtypes()) {
    for (const Case& c : cases()) {
      for (XLayout layout : {XLayout::contiguous, XLayout::sliced, XLayout::transposed}) {
        if (layout == XLayout::transposed && c.lead.size() < 2) continue;
        if (layout != XLayout::contiguous && dt != DType::bf16 && dt != DType::f32) continue;
        seed += 10;
        Shape ys = c.lead;
        ys.push_back(c.out);
        // The residual's leaf is stored like x's: swapped leading dims for the transposed layout.
        Shape cs = ys;
        if (layout == XLayout::transposed) std::swap(cs[0], cs[1]);
        const TensorList leaves{randn_f64(leaf_shape(c.lead, layout, c.in), seed),
                                randn_f64({c.out, c.in}, seed + 1, 1.0 / std::sqrt(static_cast<double>(c.in))),
                                randn_f64(cs, seed + 2)};
        const Tensor v = randn_f64(ys, seed + 3);
        const int64_t in = c.in;
        const bool swap = layout == XLayout::transposed;
        auto residual = [swap](const Tensor& t) { return swap ? t.transpose(0, 1) : t; };
        auto op = [&](const TensorList& t) {
          const Tensor y = F::linear_add(shape_input(t[0], layout, in), t[1], residual(t[2]));
          EXPECT_EQ(y.grad_fn_name(), "AddmmBackward");
          return y;
        };
        auto ref = [&](const TensorList& t) {
          return ref_dense(shape_input(t[0], layout, in), t[1], Tensor(), false) + residual(t[2]);
        };
        const std::string what = "linear_add lead " + ::testing::PrintToString(c.lead) + " in " + std::to_string(c.in) +
                                 " out " + std::to_string(c.out) + " layout " + std::to_string(static_cast<int>(layout));
        expect_matches(what.c_str(), op, ref, leaves, v, dt);
        if (layout == XLayout::contiguous && dt == DType::bf16) {
          expect_matches((what + " frozen W").c_str(), op, ref, leaves, v, dt, {false, true, false});
          expect_matches((what + " W only").c_str(), op, ref, leaves, v, dt, {true, false, true});
        }
      }
    }
  }
}

TEST(EpilogueGradcheck, LinearAddF64) {
  const GradcheckResult r = gradcheck([](const TensorList& t) { return F::linear_add(t[0], t[1], t[2]); },
                                      {randn_f64({2, 5, 8}, 830), randn_f64({6, 8}, 831), randn_f64({2, 5, 6}, 832)});
  EXPECT_TRUE(r.ok) << r.message;
  const GradcheckResult v = gradcheck([](const TensorList& t) { return F::linear_add(t[0], t[1], t[2]); },
                                      {randn_f64({8}, 833), randn_f64({3, 8}, 834), randn_f64({3}, 835)});
  EXPECT_TRUE(v.ok) << v.message;
}

// Under autocast, an f32 weight that wants a gradient is a master weight (Note [Master-weight
// epilogues]): its gradient comes out f32 from one node, the residual (cast to bf16 as addmm's
// policy does) gets the output's gradient, and the values follow the f64 reference of the same
// bf16 operands. The residual's gradient then sums with its producer's other uses as usual.
TEST(EpilogueAutocast, LinearAddMasterWeight) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const int64_t M = 40, K = 16, N = 32;
  auto leaf = [&](Shape s, uint64_t seed, double scale) {
    return rounded(randn_f64(s, seed, scale), DType::bf16).to(DType::f32).to(dev).requires_grad_();
  };
  const Tensor h = leaf({2, M / 2, K}, 1400, 1.0), w = leaf({N, K}, 1401, 0.25), x = leaf({2, M / 2, N}, 1402, 1.0);
  const Tensor base_w = rounded(randn_f64({N, N}, 1403, 0.2), DType::bf16).to(DType::f32).to(dev);
  const Tensor v = rounded(randn_f64({2, M / 2, N}, 1404), DType::bf16).to(DType::f32).to(dev);
  Tensor y;
  {
    amp::AutocastGuard autocast(DType::bf16, dev.type);
    y = F::linear_add(h, w, F::linear(x, base_w));  // LoRA's shape: B's GEMM adds the frozen base output
  }
  ASSERT_EQ(y.dtype(), DType::bf16);
  EXPECT_EQ(y.grad_fn_name(), "AddmmBackward");
  BackwardOptions o;
  o.grad_output = v.to(DType::bf16);
  Gradients g = y.backward(o);
  EXPECT_EQ(g.get(w).dtype(), DType::f32);
  auto cpu64 = [](const Tensor& t) { return t.detach().to(Device::cpu()).to(DType::f64); };
  const Tensor h64 = cpu64(h), w64 = cpu64(w), x64 = cpu64(x), bw64 = cpu64(base_w), v64 = cpu64(v);
  const Tensor base64 = rounded(ref_dense(x64, bw64, Tensor(), false), DType::bf16);  // the bf16 output added
  EXPECT_TRUE(close_scaled(y.detach().to(Device::cpu()), ref_dense(h64, w64, Tensor(), false) + base64, 1e-2));
  const Tensor v2 = v64.reshape({M, N});
  // w's gradient is made of bf16 operands only (h and the upstream gradient): f32-accurate from the
  // fused GEMM; the CPU's composite makes it in bf16 and casts up, as the unfused autocast does.
  const double wtol = dev.is_cuda() ? 1e-5 : 1e-2;
  EXPECT_TRUE(close_scaled(g.get(w).to(Device::cpu()), v2.t().matmul(h64.reshape({M, K})).to(DType::f32), wtol));
  EXPECT_TRUE(close_scaled(g.get(h).to(Device::cpu()), v64.matmul(w64).to(DType::f32), 1e-2));
  EXPECT_TRUE(close_scaled(g.get(x).to(Device::cpu()), v64.matmul(bw64).to(DType::f32), 1e-2));
}

TEST(EpilogueErrors, NameOpShapesAndDtypes) {
  const Tensor x = randn_f64({4, 16}, 970), w = randn_f64({8, 16}, 971), b = randn_f64({8}, 972);
  expect_error([&] { (void)F::linear_gelu(x, randn_f64({8, 15}, 1), b); }, {"linear_gelu", "in_features = 15"});
  expect_error([&] { (void)F::linear_gelu(x, w, randn_f64({7}, 1)); }, {"linear_gelu", "bias", "[8]"});
  expect_error([&] { (void)F::linear_gelu(x.to(DType::f32), w, b); }, {"linear_gelu", "f32", "f64"});
  expect_error([&] { (void)F::linear_gelu(x.to(DType::i64), w.to(DType::i64), b.to(DType::i64)); },
               {"linear_gelu", "floating", "i64"});
  expect_error([&] { (void)F::mlp_gelu(x, w, b, randn_f64({4, 7}, 1), Tensor()); }, {"mlp_gelu", "w2", "[4, 7]"});
  expect_error([&] { (void)F::mlp_gelu(x, w, b, randn_f64({4, 8}, 1), randn_f64({5}, 2)); }, {"mlp_gelu", "b2", "[4]"});
  expect_error([&] { (void)F::linear_add(x, w, randn_f64({4, 7}, 1)); }, {"linear_add", "residual", "[4, 8]", "[4, 7]"});
  expect_error([&] { (void)F::linear_add(x, w, randn_f64({8}, 1)); }, {"linear_add", "residual", "[4, 8]", "[8]"});
  expect_error([&] { (void)F::linear_add(x, w, randn_f64({4, 8}, 1).to(DType::f32)); }, {"linear_add", "residual", "f32", "f64"});
  expect_error([&] { (void)F::linear_add(x, w, Tensor()); }, {"linear_add", "undefined residual"});
  expect_error([&] { (void)F::linear_add(x, randn_f64({8, 15}, 1), randn_f64({4, 8}, 2)); }, {"linear_add", "in_features = 15"});
}

}  // namespace
}  // namespace flame::test
