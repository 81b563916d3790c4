// scaled_dot_product_attention: the math path against a plain-loop reference, float64 gradchecks
// of the math path and of the fused path's CPU reference (including the cuDNN trap routes forced
// on), input validation, and on CUDA the cuDNN fused path against the f32 math path (forward and
// q/k/v gradients), the trap cases, CUDA-graph capture and the O(S) memory bound.
#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <tuple>
#include <string>
#include <vector>

#include "flame/cuda.h"
#include "flame/nn/attention.h"
#include "gradcheck.h"
#include "nn_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {
namespace F = flame::nn::functional;
using F::SdpaBackend;
using F::SdpaBackendGuard;

Tensor rnd(const Shape& shape, uint64_t seed, DType dt = DType::f64, Device dev = Device::cpu()) {
  Generator g(seed);
  return Tensor::randn(shape, 0.0, 1.0, {DType::f64, Device::cpu()}, &g).to(dt).to(dev);
}

Tensor bool_mask(const Shape& shape, uint64_t seed, double p_keep = 0.7) {
  Generator g(seed);
  return Tensor::rand(shape, {DType::f64, Device::cpu()}, &g) < p_keep;
}

// Plain-loop reference on [B, H, L, E] f64 CPU tensors; mask: bool or additive, broadcastable
// [..., L, S]; rows with every key hidden give 0.
Tensor reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal, double scale) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3), S = k.size(2), Ev = v.size(3);
  const std::vector<double> qv = q.contiguous().to_vec<double>(), kv = k.contiguous().to_vec<double>(),
                            vv = v.contiguous().to_vec<double>();
  std::vector<double> mv;
  bool mbool = false;
  if (mask.defined()) {
    mbool = mask.dtype() == DType::boolean;
    mv = mask.to(DType::f64).expand({B, H, L, S}).contiguous().to_vec<double>();
  }
  std::vector<double> out(static_cast<std::size_t>(B * H * L * Ev), 0.0);
  const double ninf = -std::numeric_limits<double>::infinity();
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < L; ++i) {
      std::vector<double> s(static_cast<std::size_t>(S));
      double m = ninf;
      for (int64_t j = 0; j < S; ++j) {
        double a = 0;
        for (int64_t c = 0; c < E; ++c) a += qv[(bh * L + i) * E + c] * kv[(bh * S + j) * E + c];
        a *= scale;
        if (causal && j > i) a = ninf;
        if (mask.defined()) {
          const double mm = mv[(bh * L + i) * S + j];
          a = mbool ? (mm != 0 ? a : ninf) : a + mm;
        }
        s[j] = a;
        m = std::max(m, a);
      }
      if (m == ninf) continue;
      double z = 0;
      for (double& a : s) z += (a = std::exp(a - m));
      for (int64_t j = 0; j < S; ++j)
        for (int64_t c = 0; c < Ev; ++c) out[(bh * L + i) * Ev + c] += s[j] / z * vv[(bh * S + j) * Ev + c];
    }
  return Tensor::from_vec(out, {B, H, L, Ev});
}

// ---------------------------------------------------------------------------------------------
// Math path (device under test) against the loop reference.
// ---------------------------------------------------------------------------------------------
TEST(SdpaMath, MatchesLoopReference) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor q = rnd({2, 3, 5, 4}, 1), k = rnd({2, 3, 7, 4}, 2), v = rnd({2, 3, 7, 6}, 3);
  const Tensor bm = bool_mask({3, 5, 7}, 4);
  const Tensor fm = rnd({2, 1, 5, 7}, 5);
  for (DType dt : {DType::f64, DType::f32}) {
    const double tol = dt == DType::f64 ? 1e-12 : 2e-5;
    auto run = [&](const Tensor& mask, bool causal, std::optional<double> scale) {
      const Tensor m = mask.defined() && mask.dtype() != DType::boolean ? mask.to(dt).to(dev) : mask.defined() ? mask.to(dev) : mask;
      return F::scaled_dot_product_attention(q.to(dt).to(dev), k.to(dt).to(dev), v.to(dt).to(dev), m, 0.0, causal, scale);
    };
    EXPECT_TRUE(close_rel(run({}, false, {}), reference(q, k, v, {}, false, 0.5), tol));
    EXPECT_STREQ(F::sdpa_last_path(), "math");
    EXPECT_TRUE(close_rel(run({}, true, {}), reference(q, k, v, {}, true, 0.5), tol));
    EXPECT_TRUE(close_rel(run(bm, false, 0.3), reference(q, k, v, bm, false, 0.3), tol));
    EXPECT_TRUE(close_rel(run(fm, false, {}), reference(q, k, v, fm, false, 0.5), tol));
  }
}

// Note [Math path in query chunks]: without a gradient, more than 2^26 scores run in chunks of query
// rows, with the whole path's result (causal, a per-row bool mask with fully hidden rows, a float
// mask broadcast over the rows); with a gradient the path stays whole.
TEST(SdpaMath, QueryChunksWithoutGradientMatchWhole) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const int64_t L = 8200;  // L * L > 2^26: two chunks
  const Tensor q = rnd({1, 1, L, 8}, 11).to(DType::f32).to(dev), k = rnd({1, 1, L, 8}, 12).to(DType::f32).to(dev),
               v = rnd({1, 1, L, 4}, 13).to(DType::f32).to(dev);
  // A bool mask with two fully hidden rows (3 and L - 2).
  const Tensor row = Tensor::arange(L, {DType::i64, Device::cpu()}).unsqueeze(-1);
  const Tensor hidden = row.eq(Tensor::scalar(3, {DType::i64})).logical_or(row.eq(Tensor::scalar(L - 2, {DType::i64})));
  const Tensor keep = bool_mask({L, L}, 15).logical_and(hidden.logical_not()).to(dev);
  const Tensor fmask = rnd({1, 1, 1, L}, 14).to(DType::f32).to(dev);
  struct Case {
    Tensor mask;
    bool causal;
  };
  for (const Case& c : {Case{{}, true}, Case{keep, false}, Case{fmask, false}}) {
    const Tensor qg = q.detach().requires_grad_(true);
    const Tensor whole = F::scaled_dot_product_attention(qg, k, v, c.mask, 0.0, c.causal);
    EXPECT_STREQ(F::sdpa_last_path(), "math");
    Tensor chunked;
    {
      NoGradGuard no_grad;
      chunked = F::scaled_dot_product_attention(qg, k, v, c.mask, 0.0, c.causal);
    }
    EXPECT_STREQ(F::sdpa_last_path(), "math_chunked");
    EXPECT_TRUE(close_rel(chunked, whole.detach(), 1e-5));
  }
  EXPECT_EQ(F::scaled_dot_product_attention(q.narrow(2, 0, 64), k, v).size(2), 64);
  EXPECT_STREQ(F::sdpa_last_path(), "math");  // 64 x 8200 scores: whole
}

TEST(SdpaMath, LeadingDimsAndBroadcast) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  // [H, L, E] and [L, E] inputs, and k/v broadcast over the batch.
  const Tensor q = rnd({3, 5, 8}, 6), k = rnd({3, 9, 8}, 7), v = rnd({3, 9, 8}, 8);
  const Tensor want = reference(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), {}, false, 1 / std::sqrt(8.0));
  EXPECT_TRUE(close_rel(F::scaled_dot_product_attention(q.to(dev), k.to(dev), v.to(dev)), want.squeeze(0), 1e-12));
  EXPECT_TRUE(close_rel(F::scaled_dot_product_attention(q.select(0, 0).to(dev), k.select(0, 0).to(dev),
                                                      v.select(0, 0).to(dev)),
                        want.squeeze(0).select(0, 0), 1e-12));
  const Tensor q4 = rnd({2, 3, 5, 8}, 9);
  const Tensor got = F::scaled_dot_product_attention(q4.to(dev), k.unsqueeze(0).to(dev), v.unsqueeze(0).to(dev));
  const Tensor want4 = reference(q4, k.unsqueeze(0).expand({2, 3, 9, 8}), v.unsqueeze(0).expand({2, 3, 9, 8}), {},
                                 false, 1 / std::sqrt(8.0));
  EXPECT_TRUE(close_rel(got, want4, 1e-12));
}

TEST(SdpaMath, FullyMaskedRowGivesZeroAndFiniteGradients) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor q = rnd({1, 2, 4, 4}, 10).to(dev).requires_grad_(), k = rnd({1, 2, 6, 4}, 11).to(dev).requires_grad_();
  const Tensor v = rnd({1, 2, 6, 4}, 12).to(dev).requires_grad_();
  std::vector<bool> keep(4 * 6, true);
  for (int j = 0; j < 6; ++j) keep[2 * 6 + j] = false;  // query row 2 sees nothing
  const Tensor mask = Tensor::from_vec(keep, {4, 6}).to(dev);
  const Tensor out = F::scaled_dot_product_attention(q, k, v, mask);
  const std::vector<double> o = out.to(Device::cpu()).contiguous().to_vec<double>();
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 4; ++c) EXPECT_EQ(o[static_cast<std::size_t>((h * 4 + 2) * 4 + c)], 0.0);
  Gradients g = sum(out).backward();
  for (const Tensor& t : {q, k, v}) {
    const std::vector<double> gv = t.grad(g).to(Device::cpu()).to_vec<double>();
    EXPECT_TRUE(std::all_of(gv.begin(), gv.end(), [](double x) { return std::isfinite(x); }));
  }
  const std::vector<double> gq = q.grad(g).to(Device::cpu()).to_vec<double>();
  EXPECT_EQ(gq[2 * 4], 0.0);
}

TEST(SdpaMath, DropoutIsReproduciblePerSeed) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor q = rnd({2, 2, 6, 4}, 13, DType::f32, dev), k = rnd({2, 2, 6, 4}, 14, DType::f32, dev);
  const Tensor v = rnd({2, 2, 6, 4}, 15, DType::f32, dev);
  Generator g1(7), g2(7), g3(8);
  const Tensor a = F::scaled_dot_product_attention(q, k, v, {}, 0.4, false, {}, &g1);
  const Tensor b = F::scaled_dot_product_attention(q, k, v, {}, 0.4, false, {}, &g2);
  const Tensor c = F::scaled_dot_product_attention(q, k, v, {}, 0.4, false, {}, &g3);
  const Tensor nodrop = F::scaled_dot_product_attention(q, k, v);
  EXPECT_TRUE(close_rel(a, b, 0.0));
  EXPECT_FALSE(close_rel(a, c, 1e-3));
  EXPECT_FALSE(close_rel(a, nodrop, 1e-3));
  EXPECT_TRUE(close_rel(F::scaled_dot_product_attention(q, k, v, {}, 1.0), Tensor::zeros({2, 2, 6, 4}), 0.0));
}

TEST(SdpaMath, RejectsBadInputs) {
  const Tensor q = rnd({1, 2, 3, 4}, 1), k = rnd({1, 2, 5, 4}, 2), v = rnd({1, 2, 5, 6}, 3);
  expect_error([&] { (void)F::scaled_dot_product_attention(q, rnd({1, 2, 5, 3}, 2), v); },
               {"scaled_dot_product_attention", "last dim", "[1, 2, 3, 4]", "[1, 2, 5, 3]"});
  expect_error([&] { (void)F::scaled_dot_product_attention(q, k, rnd({1, 2, 4, 6}, 3)); },
               {"scaled_dot_product_attention", "sequence length"});
  expect_error([&] { (void)F::scaled_dot_product_attention(q, k.to(DType::f32), v); },
               {"scaled_dot_product_attention", "dtype", "f32"});
  expect_error([&] { (void)F::scaled_dot_product_attention(q, k, v, bool_mask({3, 5}, 1), 0.0, true); },
               {"scaled_dot_product_attention", "is_causal"});
  expect_error([&] { (void)F::scaled_dot_product_attention(q, k, v, bool_mask({3, 4}, 1)); },
               {"scaled_dot_product_attention", "attn_mask", "[3, 4]"});
  expect_error([&] { (void)F::scaled_dot_product_attention(q, k, v, rnd({3, 5}, 1, DType::f32)); },
               {"scaled_dot_product_attention", "attn_mask", "f32"});
  expect_error([&] { (void)F::scaled_dot_product_attention(q, k, v, {}, 1.5); }, {"dropout_p", "1.5"});
  expect_error([&] { (void)F::scaled_dot_product_attention(rnd({4}, 1), k, v); }, {"at least 2 dims"});
  expect_error([&] { (void)F::scaled_dot_product_attention(q.to(DType::i64), k.to(DType::i64), v.to(DType::i64)); },
               {"floating"});
  {
    SdpaBackendGuard fused(SdpaBackend::fused);
    expect_error([&] { (void)F::scaled_dot_product_attention(q, k, v, {}, 0.2); }, {"fused path", "dropout"});
  }
}

// ---------------------------------------------------------------------------------------------
// float64 gradchecks (CPU) of the math path.
// ---------------------------------------------------------------------------------------------
void expect_gradcheck(const std::function<Tensor(const TensorList&)>& fn, const TensorList& in) {
  const GradcheckResult r = gradcheck(fn, in);
  EXPECT_TRUE(r.ok) << r.message;
  EXPECT_GT(r.checked, 0);
}

TEST(SdpaMathGrad, Plain) {
  expect_gradcheck([](const TensorList& x) { return F::scaled_dot_product_attention(x[0], x[1], x[2]); },
                   {rnd({2, 2, 5, 3}, 20), rnd({2, 2, 4, 3}, 21), rnd({2, 2, 4, 2}, 22)});
}
TEST(SdpaMathGrad, CausalOddLengths) {
  expect_gradcheck(
      [](const TensorList& x) { return F::scaled_dot_product_attention(x[0], x[1], x[2], {}, 0.0, true, 0.7); },
      {rnd({1, 2, 7, 3}, 23), rnd({1, 2, 5, 3}, 24), rnd({1, 2, 5, 3}, 25)});
}
TEST(SdpaMathGrad, BoolMask) {
  const Tensor m = bool_mask({2, 1, 5, 6}, 26);
  expect_gradcheck([&](const TensorList& x) { return F::scaled_dot_product_attention(x[0], x[1], x[2], m); },
                   {rnd({2, 2, 5, 3}, 27), rnd({2, 2, 6, 3}, 28), rnd({2, 2, 6, 3}, 29)});
}
TEST(SdpaMathGrad, AdditiveMaskGetsGradientToo) {
  expect_gradcheck([](const TensorList& x) { return F::scaled_dot_product_attention(x[0], x[1], x[2], x[3]); },
                   {rnd({1, 2, 4, 3}, 30), rnd({1, 2, 6, 3}, 31), rnd({1, 2, 6, 4}, 32), rnd({2, 4, 6}, 33)});
}
TEST(SdpaMathGrad, DropoutWithFixedSeed) {
  expect_gradcheck(
      [](const TensorList& x) {
        Generator g(99);  // the same mask on every evaluation
        return F::scaled_dot_product_attention(x[0], x[1], x[2], {}, 0.3, false, {}, &g);
      },
      {rnd({1, 2, 5, 3}, 34), rnd({1, 2, 5, 3}, 35), rnd({1, 2, 5, 3}, 36)});
}
TEST(SdpaMathGrad, SequenceOfOne) {
  expect_gradcheck([](const TensorList& x) { return F::scaled_dot_product_attention(x[0], x[1], x[2]); },
                   {rnd({2, 1, 3}, 37), rnd({2, 1, 3}, 38), rnd({2, 1, 3}, 39)});
  expect_gradcheck(
      [](const TensorList& x) { return F::scaled_dot_product_attention(x[0], x[1], x[2], {}, 0.0, true); },
      {rnd({1, 3}, 40), rnd({4, 3}, 41), rnd({4, 2}, 42)});
}

// ---------------------------------------------------------------------------------------------
// The fused path's contract on the CPU reference (f64): forward against the loop reference,
// gradchecks, and the two cuDNN trap routes forced on.
// ---------------------------------------------------------------------------------------------
struct FusedCase {
  const char* name;
  bool causal;
  int mask;  // 0 none, 1 bool, 2 additive
  F::detail::SdpaRouteOverride routes;
  const char* path;
};

class SdpaFusedRef : public ::testing::TestWithParam<FusedCase> {};

TEST_P(SdpaFusedRef, ForwardAndGradcheck) {
  const FusedCase c = GetParam();
  const Tensor q = rnd({1, 2, 5, 4}, 50), k = rnd({1, 2, 7, 4}, 51), v = rnd({1, 2, 7, 3}, 52);
  Tensor mask;
  if (c.mask == 1) mask = bool_mask({2, 5, 7}, 53, 0.6);
  if (c.mask == 2) mask = rnd({1, 1, 5, 7}, 54);
  SdpaBackendGuard fused(SdpaBackend::fused);
  F::detail::SdpaRouteGuard routes(c.routes);
  auto fn = [&](const TensorList& x) { return F::scaled_dot_product_attention(x[0], x[1], x[2], mask, 0.0, c.causal); };
  // Forward with a gradient wanted (the padded route is taken only then).
  const Tensor out = fn({q.detach().requires_grad_(), k, v});
  EXPECT_STREQ(F::sdpa_last_path(), c.path);
  EXPECT_TRUE(close_rel(out, reference(q, k, v, mask, c.causal, 0.5), 1e-12));
  expect_gradcheck(fn, {q, k, v});
}

INSTANTIATE_TEST_SUITE_P(
    SdpaCpu, SdpaFusedRef,
    ::testing::Values(FusedCase{"plain", false, 0, {}, "fused"}, FusedCase{"causal", true, 0, {}, "fused"},
                      FusedCase{"bool", false, 1, {}, "fused"}, FusedCase{"additive", false, 2, {}, "fused"},
                      FusedCase{"padded_bool", false, 1, {true, 0}, "fused_padded"},
                      FusedCase{"padded_additive", false, 2, {true, 0}, "fused_padded"},
                      FusedCase{"chunked", false, 0, {false, 3}, "fused_chunked"},
                      FusedCase{"chunked_bool", false, 1, {false, 2}, "fused_chunked"},
                      FusedCase{"causal_not_chunked", true, 0, {false, 3}, "fused"}),
    [](const ::testing::TestParamInfo<FusedCase>& i) { return std::string(i.param.name); });

TEST(SdpaFusedRefSaved, KeepsNoProbabilities) {
  // The fused node saves q, k, v, out and the stats: far less than the L x S probabilities.
  const Tensor q = rnd({1, 1, 64, 2}, 60).requires_grad_(), k = rnd({1, 1, 64, 2}, 61), v = rnd({1, 1, 64, 2}, 62);
  SdpaBackendGuard fused(SdpaBackend::fused);
  const Tensor out = F::scaled_dot_product_attention(q, k, v);
  EXPECT_LT(autograd_saved_bytes(out), 64u * 64u * 8u / 4u);
  SdpaBackendGuard math(SdpaBackend::math);
  EXPECT_GE(autograd_saved_bytes(F::scaled_dot_product_attention(q, k, v)), 64u * 64u * 8u);
}

TEST(SdpaFusedRefLayouts, ExpandedTransposedAndFewDims) {
  // Operands the kernels cannot read in place (stride-0 batch, transposed heads) are copied; 3-d
  // and 5-d inputs are merged to [B, H, L, E] and back.
  const Tensor q = rnd({3, 5, 2, 4}, 63).transpose(1, 2);  // [3, 2, 5, 4] with heads inside rows
  const Tensor k = rnd({1, 2, 7, 4}, 64).expand({3, 2, 7, 4}), v = rnd({1, 2, 7, 4}, 65).expand({3, 2, 7, 4});
  const Tensor want = reference(q, k, v, {}, true, 0.5);
  SdpaBackendGuard fused(SdpaBackend::fused);
  EXPECT_TRUE(close_rel(F::scaled_dot_product_attention(q, k, v, {}, 0.0, true), want, 1e-12));
  EXPECT_STREQ(F::sdpa_last_path(), "fused");
  EXPECT_TRUE(close_rel(F::scaled_dot_product_attention(q.select(0, 1), k.select(0, 1), v.select(0, 1), {}, 0.0, true),
                        want.select(0, 1), 1e-12));
  const Tensor m = bool_mask({3, 1, 5, 7}, 66).unsqueeze(0);
  const Tensor q5 = q.unsqueeze(0), k5 = k.contiguous().unsqueeze(0), v5 = v.contiguous().unsqueeze(0);
  Tensor want5;
  {
    SdpaBackendGuard math(SdpaBackend::math);
    want5 = F::scaled_dot_product_attention(q5, k5, v5, m);
  }
  EXPECT_TRUE(close_rel(F::scaled_dot_product_attention(q5, k5, v5, m), want5, 1e-12));
}

// ---------------------------------------------------------------------------------------------
// CUDA: the cuDNN fused path against the f32 math path on the same inputs.
// ---------------------------------------------------------------------------------------------
struct CudaCase {
  DType dt;
  int64_t b, h, l, s, d;
  bool causal;
  int mask;  // 0 none, 1 bool [B, 1, L, S], 2 additive [1, H, L, S], 3 bool key padding [B, 1, 1, S]
};

std::string case_name(const CudaCase& c) {
  std::ostringstream os;
  os << dtype_name(c.dt) << "_b" << c.b << "h" << c.h << "_l" << c.l << "_s" << c.s << "_d" << c.d
     << (c.causal ? "_causal" : "") << (c.mask == 1 ? "_bool" : c.mask == 2 ? "_additive" : c.mask == 3 ? "_keypad" : "");
  return os.str();
}

struct FusedVsMath {
  Tensor out, dq, dk, dv;
  const char* path;
};

// Runs fwd + bwd with a fixed upstream gradient on CUDA, with the chosen backend, in `dt`.
FusedVsMath run_cuda(const CudaCase& c, DType dt, SdpaBackend backend, uint64_t seed) {
  const Device dev = Device::cuda();
  // Values pass through the case's dtype first, so the f32 math run sees exactly the same inputs.
  auto input = [&](const Shape& shape, uint64_t sd) { return rnd(shape, sd, c.dt, dev).to(dt); };
  Tensor q = input({c.b, c.h, c.l, c.d}, seed).requires_grad_();
  Tensor k = input({c.b, c.h, c.s, c.d}, seed + 1).requires_grad_();
  Tensor v = input({c.b, c.h, c.s, c.d}, seed + 2).requires_grad_();
  Tensor mask;
  if (c.mask == 1) {
    // Keep the diagonal-ish key 0 visible so no row is fully hidden.
    Tensor m = bool_mask({c.b, 1, c.l, c.s}, seed + 3, 0.6);
    mask = logical_or(m, Tensor::arange(c.s, {DType::i64, Device::cpu()}) == 0).to(dev);
  }
  if (c.mask == 2) mask = input({1, c.h, c.l, c.s}, seed + 3);
  if (c.mask == 3) {
    mask = logical_or(bool_mask({c.b, 1, 1, c.s}, seed + 3, 0.7), Tensor::arange(c.s, {DType::i64, Device::cpu()}) == 0)
               .to(dev);
  }
  const Tensor gout = input({c.b, c.h, c.l, c.d}, seed + 4);
  SdpaBackendGuard guard(backend);
  FusedVsMath r;
  const Tensor out = F::scaled_dot_product_attention(q, k, v, mask, 0.0, c.causal);
  r.path = F::sdpa_last_path();
  const AttentionGrads g = attention_grads(out, gout, q, k, v);
  r.out = g.out;
  r.dq = g.dq;
  r.dk = g.dk;
  r.dv = g.dv;
  return r;
}

void expect_fused_matches_math(const CudaCase& c, const char* want_path) {
  const FusedVsMath f = run_cuda(c, c.dt, SdpaBackend::automatic, 100);
  const FusedVsMath m = run_cuda(c, DType::f32, SdpaBackend::math, 100);
  EXPECT_STREQ(f.path, want_path) << case_name(c);
  const double tol = c.dt == DType::bf16 ? 3e-2 : 1e-2;
  EXPECT_TRUE(close_rel(f.out, m.out, tol)) << case_name(c) << " out";
  EXPECT_TRUE(close_rel(f.dq, m.dq, tol)) << case_name(c) << " dq";
  EXPECT_TRUE(close_rel(f.dk, m.dk, tol)) << case_name(c) << " dk";
  EXPECT_TRUE(close_rel(f.dv, m.dv, tol)) << case_name(c) << " dv";
}

class SdpaCuda : public ::testing::TestWithParam<CudaCase> {};

TEST_P(SdpaCuda, FusedMatchesMath) {
  FLAME_SKIP_IF_NO_CUDA();
  const CudaCase c = GetParam();
  const bool padded = c.mask != 0 && (c.l % 128 == 64 || c.s % 128 == 64);
  // cuDNN rejects s_q = s_kv = 1: that shape runs on the math path.
  expect_fused_matches_math(c, c.l == 1 && c.s == 1 ? "math" : padded ? "fused_padded" : "fused");
}

INSTANTIATE_TEST_SUITE_P(
    SdpaShapes, SdpaCuda,
    ::testing::Values(CudaCase{DType::bf16, 2, 4, 128, 128, 64, false, 0}, CudaCase{DType::f16, 2, 4, 128, 128, 64, false, 0},
                      CudaCase{DType::bf16, 1, 2, 256, 256, 128, false, 0},
                      CudaCase{DType::bf16, 2, 2, 77, 77, 64, true, 0}, CudaCase{DType::f16, 1, 2, 1000, 1000, 128, true, 0},
                      CudaCase{DType::bf16, 1, 2, 1, 1, 64, false, 0}, CudaCase{DType::bf16, 2, 2, 1, 77, 64, false, 0},
                      CudaCase{DType::bf16, 1, 2, 1088, 1088, 64, false, 0},
                      CudaCase{DType::bf16, 1, 2, 77, 200, 64, false, 0}, CudaCase{DType::bf16, 1, 2, 200, 77, 128, true, 0},
                      CudaCase{DType::bf16, 2, 2, 77, 100, 64, false, 1}, CudaCase{DType::f16, 1, 2, 256, 256, 128, false, 2},
                      CudaCase{DType::bf16, 2, 2, 1000, 1000, 64, false, 3},
                      CudaCase{DType::bf16, 1, 2, 1088, 1088, 64, false, 2},
                      // Note [cuDNN masked backward at seq % 128 == 64]: these go padded.
                      CudaCase{DType::bf16, 1, 2, 192, 192, 64, false, 1}, CudaCase{DType::bf16, 1, 2, 64, 64, 128, false, 2},
                      CudaCase{DType::f16, 2, 2, 320, 320, 64, false, 3}),
    [](const ::testing::TestParamInfo<CudaCase>& i) { return case_name(i.param); });

// Forward and backward of q, k, v (upstream gradient gout) captured in a CUDA graph and replayed
// once; `path` gets the route the captured forward took.
AttentionGrads captured_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& gout,
                                  const char** path) {
  cuda::Graph graph;
  AttentionGrads got;
  cuda::capture(graph, [&] {
    const Tensor out = F::scaled_dot_product_attention(q, k, v);
    *path = F::sdpa_last_path();
    got = attention_grads(out, gout, q, k, v);
  });
  graph.replay();
  cuda::synchronize();
  return got;
}

TEST(SdpaCudaRoutes, MaskedTrapLengthTakesPaddedRoute) {
  // Note [cuDNN masked backward at seq % 128 == 64]: L = S = 192 with an additive mask goes padded
  // and its dq matches the math path (no NaN).
  FLAME_SKIP_IF_NO_CUDA();
  const CudaCase c{DType::bf16, 1, 2, 192, 192, 64, false, 2};
  const FusedVsMath m = run_cuda(c, DType::f32, SdpaBackend::math, 7);
  const FusedVsMath f = run_cuda(c, DType::bf16, SdpaBackend::automatic, 7);
  EXPECT_STREQ(f.path, "fused_padded");
  EXPECT_TRUE(close_rel(f.dq, m.dq, 3e-2));
}

TEST(SdpaCudaRoutes, GraphCaptureOfLongNonCausalKv) {
  // Note [cuDNN capture of long kv]: captured forward and backward with S = 2048 run over kv chunks.
  FLAME_SKIP_IF_NO_CUDA();
  const CudaCase c{DType::bf16, 1, 2, 256, 2048, 64, false, 0};
  const FusedVsMath m = run_cuda(c, DType::f32, SdpaBackend::math, 11);
  const Device dev = Device::cuda();
  // The same values as run_cuda draws for seed 11.
  Tensor q = rnd({1, 2, 256, 64}, 11, DType::bf16, dev).requires_grad_();
  Tensor k = rnd({1, 2, 2048, 64}, 12, DType::bf16, dev).requires_grad_();
  Tensor v = rnd({1, 2, 2048, 64}, 13, DType::bf16, dev).requires_grad_();
  const Tensor gout = rnd({1, 2, 256, 64}, 15, DType::bf16, dev);
  // Warm up outside the capture (plans and handles are built eagerly).
  {
    F::detail::SdpaRouteGuard chunk({false, 1024});
    BackwardOptions opt;
    opt.grad_output = gout;
    (void)F::scaled_dot_product_attention(q, k, v).backward(opt);
  }
  const char* path = "";
  const AttentionGrads got = captured_attention(q, k, v, gout, &path);
  EXPECT_STREQ(path, "fused_chunked");
  EXPECT_TRUE(close_rel(got.out, m.out, 3e-2));
  EXPECT_TRUE(close_rel(got.dq, m.dq, 3e-2));
  EXPECT_TRUE(close_rel(got.dk, m.dk, 3e-2));
  EXPECT_TRUE(close_rel(got.dv, m.dv, 3e-2));
}

// The real model families' attention: FLUX.1 (24 heads of 128 over 4096 image + 512 text tokens)
// and SD3.5-Large (38 heads of 64 over 4096 + 333, not a multiple of 128), bf16, forward and
// backward against the f32 math path, eagerly and captured in a CUDA graph (as a trainer's
// captured step runs it). PyTorch 2.11's own cuDNN attention faulted on the FLUX shape.
TEST(SdpaCudaRoutes, FluxAndSD35SequencesEagerAndCaptured) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda();
  for (const CudaCase& c : {CudaCase{DType::bf16, 1, 24, 4608, 4608, 128, false, 0},
                            CudaCase{DType::bf16, 1, 38, 4429, 4429, 64, false, 0}}) {
    const FusedVsMath m = run_cuda(c, DType::f32, SdpaBackend::math, 21);
    const FusedVsMath f = run_cuda(c, DType::bf16, SdpaBackend::automatic, 21);
    EXPECT_STRNE(f.path, "math") << case_name(c);
    for (const auto& [got, want, what] : {std::tuple{f.out, m.out, "out"}, std::tuple{f.dq, m.dq, "dq"},
                                          std::tuple{f.dk, m.dk, "dk"}, std::tuple{f.dv, m.dv, "dv"}}) {
      EXPECT_TRUE(close_rel(got, want, 3e-2)) << case_name(c) << " eager " << what << " (" << f.path << ")";
    }
    // The same values as run_cuda draws for seed 21, captured.
    Tensor q = rnd({c.b, c.h, c.l, c.d}, 21, DType::bf16, dev).requires_grad_();
    Tensor k = rnd({c.b, c.h, c.s, c.d}, 22, DType::bf16, dev).requires_grad_();
    Tensor v = rnd({c.b, c.h, c.s, c.d}, 23, DType::bf16, dev).requires_grad_();
    const Tensor gout = rnd({c.b, c.h, c.l, c.d}, 25, DType::bf16, dev);
    {  // plans and handles are built eagerly, outside the capture
      BackwardOptions opt;
      opt.grad_output = gout;
      (void)F::scaled_dot_product_attention(q, k, v).backward(opt);
    }
    const char* path = "";
    const AttentionGrads got = captured_attention(q, k, v, gout, &path);
    EXPECT_STRNE(path, "math") << case_name(c);
    EXPECT_TRUE(close_rel(got.out, m.out, 3e-2)) << case_name(c) << " captured out (" << path << ")";
    EXPECT_TRUE(close_rel(got.dq, m.dq, 3e-2)) << case_name(c) << " captured dq";
    EXPECT_TRUE(close_rel(got.dk, m.dk, 3e-2)) << case_name(c) << " captured dk";
    EXPECT_TRUE(close_rel(got.dv, m.dv, 3e-2)) << case_name(c) << " captured dv";
  }
}

TEST(SdpaCudaRoutes, ChunkedEagerMatchesMath) {
  FLAME_SKIP_IF_NO_CUDA();
  F::detail::SdpaRouteGuard chunk({false, 1024});
  expect_fused_matches_math({DType::bf16, 1, 2, 300, 2500, 64, false, 3}, "fused_chunked");
  expect_fused_matches_math({DType::f16, 1, 2, 128, 2048, 128, false, 0}, "fused_chunked");
}

TEST(SdpaCudaRoutes, NonContiguousHeadsLayout) {
  // q, k, v as [B, S, H, D] memory viewed [B, H, S, D] (what a fused qkv projection gives).
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda();
  const Tensor qkv = rnd({2, 77, 3, 4, 64}, 70, DType::bf16, dev);
  const Tensor q = qkv.select(2, 0).transpose(1, 2), k = qkv.select(2, 1).transpose(1, 2), v = qkv.select(2, 2).transpose(1, 2);
  const Tensor f = F::scaled_dot_product_attention(q, k, v, {}, 0.0, true);
  EXPECT_STREQ(F::sdpa_last_path(), "fused");
  const Tensor m = F::scaled_dot_product_attention(q.to(DType::f32), k.to(DType::f32), v.to(DType::f32), {}, 0.0, true);
  EXPECT_TRUE(close_rel(f, m, 3e-2));
  // The output's memory is [B, L, H, D]: merging heads is a free view.
  EXPECT_NO_THROW((void)f.transpose(1, 2).view({2, 77, 4 * 64}));
}

TEST(SdpaCudaRoutes, DropoutMatchesCpuForOneSeed) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor q = rnd({1, 2, 33, 16}, 80, DType::f32), k = rnd({1, 2, 40, 16}, 81, DType::f32),
               v = rnd({1, 2, 40, 16}, 82, DType::f32);
  Generator gc(5), gg(5);
  const Tensor cpu = F::scaled_dot_product_attention(q, k, v, {}, 0.25, false, {}, &gc);
  const Tensor gpu = F::scaled_dot_product_attention(q.to(Device::cuda()), k.to(Device::cuda()), v.to(Device::cuda()), {},
                                                     0.25, false, {}, &gg);
  EXPECT_TRUE(close_rel(gpu, cpu, 1e-5));
  // bf16 with dropout runs on the math path.
  (void)F::scaled_dot_product_attention(q.to(DType::bf16).to(Device::cuda()), k.to(DType::bf16).to(Device::cuda()),
                                        v.to(DType::bf16).to(Device::cuda()), {}, 0.25, false, {}, &gg);
  EXPECT_STREQ(F::sdpa_last_path(), "math");
}

TEST(SdpaCudaRoutes, PeakMemoryDoesNotGrowWithSeqSquared) {
  FLAME_SKIP_IF_NO_CUDA();
  auto peak_for = [](int64_t s) {
    const Device dev = Device::cuda();
    Tensor q = rnd({1, 4, s, 64}, 90, DType::bf16, dev).requires_grad_();
    Tensor k = rnd({1, 4, s, 64}, 91, DType::bf16, dev).requires_grad_();
    Tensor v = rnd({1, 4, s, 64}, 92, DType::bf16, dev).requires_grad_();
    const Tensor gout = rnd({1, 4, s, 64}, 93, DType::bf16, dev);
    cuda::synchronize();
    const std::size_t base = cuda::memory_stats().allocated_bytes;
    cuda::reset_peak_memory_stats();
    BackwardOptions opt;
    opt.grad_output = gout;
    {
      Gradients g = F::scaled_dot_product_attention(q, k, v).backward(opt);
      EXPECT_STREQ(F::sdpa_last_path(), "fused");
    }
    cuda::synchronize();
    return cuda::memory_stats().peak_allocated_bytes - base;
  };
  (void)peak_for(1024);  // plans and workspaces built once
  const std::size_t p1 = peak_for(1024), p4 = peak_for(4096);
  // Scores of one head at S = 4096 in bf16 alone are 32 MiB; x4 heads 128 MiB.
  EXPECT_LT(p4, std::size_t{32} << 20) << "peak at S=4096: " << p4;
  EXPECT_LT(static_cast<double>(p4), 6.0 * static_cast<double>(p1) + (1 << 20))
      << "peak S=1024 " << p1 << ", S=4096 " << p4;
}

}  // namespace
}  // namespace flame::test
