// Gradient accumulation fused into a gradient rule (Note [Accumulate base] in
// src/autograd/backward.cpp): a rule that accepts it is handed the pending gradient sum of an
// input and returns that sum plus its own gradient, so the engine's separate add disappears.
//  - AccumIntoEngine.*: on the device under test, through layer_norm / rms_norm (which compose the
//    sum in the rule) and the adaLN ops (the CUDA kernel reads it): gradients with the fusion equal
//    those without it; the vertex's hooks see the complete sum once; retain_graph, accumulate_into,
//    BackwardOptions::inputs and anomaly mode; a sum that is another rule's pass-through (still held
//    by the caller) is never written; an owned one is.
//  - AccumIntoAdaln.*: CUDA only: the DiT block pattern (x -> layer_norm_modulate -> branch and
//    x -> gated_residual) in f32, bf16, the autocast mix, three consumers (the kernel writing the
//    sum in place) and a non-contiguous pending sum, against the float64 CPU reference.
//  - AccumIntoTrace.*: CUDA only: the backward of the DiT pattern runs no add kernel (CUPTI).
//  - AccumIntoLinear.*: the input gradients of Linears that share their input (q, k, v, each with a
//    LoRA adapter's A beside its frozen base; Note [Accumulated input gradients] in
//    src/autograd/rules/input_grad.h): the same gradients with and without the fusion, in f32, bf16
//    under autocast with f32 adapters, and through plain 2-d matmul; on CUDA the sums ride the
//    GEMMs' epilogues and no add kernel runs for them.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "flame/amp.h"
#include "flame/anomaly.h"
#include "flame/nn.h"
#include "flame/profiler.h"
#include "engine_detail.h"
#include "nn_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {

namespace F = nn::functional;
namespace ad = autograd_detail;

// Sets the fusion switch for a scope.
class FusionScope {
 public:
  explicit FusionScope(bool on) : prev_(ad::set_accumulate_base_enabled(on)) {}
  ~FusionScope() { ad::set_accumulate_base_enabled(prev_); }
  FusionScope(const FusionScope&) = delete;
  FusionScope& operator=(const FusionScope&) = delete;

 private:
  bool prev_;
};

// Random values, float64 on the CPU, then in `dt` on `dev`.
Tensor rnd(const Shape& s, uint64_t seed, DType dt, Device dev, double mean = 0.0, double stddev = 1.0) {
  Generator g(seed);
  return Tensor::randn(s, mean, stddev, DType::f64, &g).to(dt).to(dev);
}

using Build = std::function<Tensor(const TensorList& leaves)>;

struct Result {
  TensorList grads;     // one per leaf
  Tensor out;           // the forward output
  uint64_t handed = 0;  // sums handed to rules during the backward
  uint64_t owned = 0;   // ... of which the pass owned
};

// Runs build on fresh leaves (copies of `values`, requiring grad) and backward with `gout`.
Result run(bool fused, const TensorList& values, const Build& build, const Tensor& gout, BackwardOptions opt = {}) {
  FusionScope scope(fused);
  TensorList leaves;
  for (const Tensor& v : values) leaves.push_back(v.detach().clone().requires_grad_());
  Result r;
  r.out = build(leaves);
  opt.grad_output = gout;
  const ad::AccumulateBaseCounts before = ad::accumulate_base_counts();
  Gradients g = r.out.backward(opt);
  const ad::AccumulateBaseCounts after = ad::accumulate_base_counts();
  r.handed = after.handed - before.handed;
  r.owned = after.owned - before.owned;
  for (const Tensor& l : leaves) r.grads.push_back(opt.accumulate_into ? opt.accumulate_into->try_get(l) : g.try_get(l));
  return r;
}

::testing::AssertionResult same_grads(const Result& got, const Result& want, double tol) {
  if (got.grads.size() != want.grads.size()) return ::testing::AssertionFailure() << "gradient counts differ";
  for (std::size_t i = 0; i < got.grads.size(); ++i) {
    if (got.grads[i].defined() != want.grads[i].defined())
      return ::testing::AssertionFailure() << "leaf " << i << ": gradient present in one run only";
    if (!got.grads[i].defined()) continue;
    auto r = close_rel(got.grads[i], want.grads[i], tol);
    if (!r) return r << " (leaf " << i << ")";
  }
  return ::testing::AssertionSuccess();
}

double tol_for(DType dt) { return dt == DType::f64 ? 1e-12 : dt == DType::f32 ? 1e-5 : 3e-2; }

// The residual pattern of a pre-norm block on the generic norms: x feeds the norm (recorded
// first, so its rule runs last) and the residual add.
Tensor norm_residual(const TensorList& l, bool rms) {
  const Tensor x = l[0] * 1.5;  // a non-leaf vertex (leaves are out of scope)
  const int64_t d = x.size(-1);
  const Tensor n = rms ? F::rms_norm(x, {d}, l[1], 1e-5) : F::layer_norm(x, {d}, l[1], l[2], 1e-5);
  return x + n * l[3];
}

// The same with the norm from its definition (mean, square, sqrt): the independent reference.
Tensor plain_norm_residual(const TensorList& l, bool rms) {
  const Tensor x = l[0] * 1.5;
  const double eps = 1e-5;
  Tensor n;
  if (rms) {
    n = x / (x.square().mean({-1}, true) + eps).sqrt() * l[1];
  } else {
    const Tensor c = x - x.mean({-1}, true);
    n = c / (c.square().mean({-1}, true) + eps).sqrt() * l[1] + l[2];
  }
  return x + n * l[3];
}

TEST(AccumIntoEngine, NormResidualMatchesUnfused) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (DType dt : {DType::f64, DType::f32}) {
    for (bool rms : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (rms ? " rms_norm" : " layer_norm"));
      const TensorList v = {rnd({3, 5, 24}, 1, dt, dev), rnd({24}, 2, dt, dev, 1.0, 0.2), rnd({24}, 3, dt, dev),
                            rnd({24}, 4, dt, dev)};
      const Tensor gout = rnd({3, 5, 24}, 5, dt, dev);
      const Build b = [rms](const TensorList& l) { return norm_residual(l, rms); };
      const Result fused = run(true, v, b, gout), plain = run(false, v, b, gout);
      EXPECT_EQ(fused.handed, 1u) << "x's pending sum is handed to the norm's rule";
      EXPECT_EQ(plain.handed, 0u);
      EXPECT_TRUE(same_grads(fused, plain, tol_for(dt)));
      // And both against the norm written with plain ops (no norm node) in float64 on the CPU.
      TensorList v64;
      for (const Tensor& t : v) v64.push_back(t.to(DType::f64).to(Device::cpu()));
      const Result ref = run(true, v64, [rms](const TensorList& l) { return plain_norm_residual(l, rms); },
                             gout.to(DType::f64).to(Device::cpu()));
      EXPECT_EQ(ref.handed, 0u);
      EXPECT_TRUE(same_grads(fused, ref, dt == DType::f64 ? 1e-10 : 1e-4));
    }
  }
}

// The DiT block (apps/diffusion/src/dit.cpp): h = gated_residual(x, gate, f(layer_norm_modulate(x,
// shift, scale))) with the modulation as chunks of one projection. On the CPU the adaLN ops
// compose (their layer_norm takes the sum); on CUDA the fused adaLN kernel reads it.
// mod_dtype: the modulation cast to it first (as the DiT's projection under autocast gives it);
// node: receives the grad_fn name of the adaLN output (which path ran).
Tensor dit_block(const TensorList& l, DType mod_dtype, std::string* node = nullptr) {
  const Tensor x = l[0] * 1.25;
  const int64_t d = x.size(-1);
  const Tensor m = l[1].to(mod_dtype);  // [B, 3D]
  const Tensor y = F::layer_norm_modulate(x, m.narrow(1, 0, d), m.narrow(1, d, d), 1e-6);
  if (node) *node = y.grad_fn_name();
  return F::gated_residual(x, m.narrow(1, 2 * d, d), F::linear(y, l[2]));
}
Tensor dit_block_plain(const TensorList& l) { return dit_block(l, l[1].dtype()); }

TEST(AccumIntoEngine, DitPatternMatchesUnfused) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (DType dt : {DType::f64, DType::f32}) {
    if (dt == DType::f64 && dev.is_cuda()) continue;  // the CUDA kernels take f32 and half types
    SCOPED_TRACE(dtype_name(dt));
    const TensorList v = {rnd({2, 7, 32}, 11, dt, dev), rnd({2, 96}, 12, dt, dev, 0.0, 0.5),
                          rnd({32, 32}, 13, dt, dev, 0.0, 0.2)};
    const Tensor gout = rnd({2, 7, 32}, 14, dt, dev);
    const Result fused = run(true, v, dit_block_plain, gout), plain = run(false, v, dit_block_plain, gout);
    EXPECT_EQ(fused.handed, 1u);
    EXPECT_EQ(fused.owned, 0u) << "the gated residual's x-gradient is a pass-through";
    EXPECT_TRUE(same_grads(fused, plain, tol_for(dt)));
  }
}

// x feeds three consumers: the norm's rule (last) receives a sum this pass made (owned), which
// layer_norm adds into in place.
TEST(AccumIntoEngine, ThreeConsumersHandAnOwnedSum) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList v = {rnd({4, 6, 16}, 21, DType::f32, dev), rnd({16}, 22, DType::f32, dev, 1.0, 0.2),
                        rnd({16}, 23, DType::f32, dev)};
  const Tensor gout = rnd({4, 6, 16}, 24, DType::f32, dev);
  const Build b = [](const TensorList& l) {
    const Tensor x = l[0] * 0.75;
    const Tensor n = F::layer_norm(x, {16}, l[1], l[2]);  // recorded first: its rule runs last
    const Tensor twice = x * 2.0;
    const Tensor s = x.sin();
    return n + twice + s;
  };
  const Result fused = run(true, v, b, gout), plain = run(false, v, b, gout);
  EXPECT_EQ(fused.handed, 1u);
  EXPECT_EQ(fused.owned, 1u) << "two contributions were summed into a buffer of this pass";
  EXPECT_TRUE(same_grads(fused, plain, 1e-5));
}

// The pieces of a chunk (narrow views of one non-leaf) add their gradients into one buffer: the
// first makes it, each later one is handed the sum and adds its region. A piece left unused, a
// piece used twice (its own gradient is a sum first) and a non-contiguous source.
TEST(AccumIntoEngine, ChunkPiecesAddIntoOneBuffer) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (DType dt : {DType::f64, DType::f32}) {
    if (dt == DType::f64 && dev.is_cuda()) continue;
    SCOPED_TRACE(dtype_name(dt));
    const TensorList v = {rnd({4, 12}, 31, dt, dev), rnd({4, 3}, 32, dt, dev)};
    const Tensor gout = rnd({4, 3}, 33, dt, dev);
    const Build all_used = [](const TensorList& l) {
      const TensorList p = (l[0] * 1.5).chunk(4, 1);
      return p[0] * l[1] + p[1].sin() + p[2].square() + p[3];
    };
    const Result fused = run(true, v, all_used, gout), plain = run(false, v, all_used, gout);
    EXPECT_EQ(fused.handed, 3u) << "every piece after the first adds into the sum";
    // The first piece's result is an ordinary gradient to the engine (not known to be this pass's
    // own), so the second piece adds into a copy; the sums the rules return are owned.
    EXPECT_EQ(fused.owned, 2u);
    EXPECT_EQ(plain.handed, 0u);
    EXPECT_TRUE(same_grads(fused, plain, dt == DType::f64 ? 0.0 : 1e-6));
    const Build partial = [](const TensorList& l) {
      const TensorList p = (l[0].t() * 2.0).t().chunk(3, 1);  // a non-contiguous source
      return p[0].narrow(1, 0, 3) * p[0].narrow(1, 1, 3) + p[2].exp().narrow(1, 0, 3);  // p[1] unused
    };
    const Result f2 = run(true, v, partial, gout), p2 = run(false, v, partial, gout);
    EXPECT_GE(f2.handed, 1u);
    EXPECT_TRUE(same_grads(f2, p2, dt == DType::f64 ? 0.0 : 1e-6));
    // Against the gradient written out by hand for the first build (float64 on the CPU).
    if (dt == DType::f64) {
      const Tensor x = v[0].to(Device::cpu()) * 1.5, w = v[1].to(Device::cpu()), g = gout.to(Device::cpu());
      const TensorList p = x.chunk(4, 1);
      const Tensor want = cat({g * w, g * p[1].cos(), g * 2.0 * p[2], g}, 1) * 1.5;
      EXPECT_TRUE(close_rel(fused.grads[0].to(Device::cpu()), want, 1e-12));
    }
  }
}

// A hook on x runs once, on the complete sum (not on the part that waited), in both paths; what
// it returns replaces the gradient for x's history.
TEST(AccumIntoEngine, HookOnXSeesTheFullSumOnce) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList v = {rnd({3, 4, 8}, 31, DType::f32, dev), rnd({8}, 32, DType::f32, dev, 1.0, 0.2),
                        rnd({8}, 33, DType::f32, dev), rnd({8}, 34, DType::f32, dev)};
  const Tensor gout = rnd({3, 4, 8}, 35, DType::f32, dev);
  struct Seen {
    int calls = 0;
    Tensor grad;
  };
  auto with_hook = [](Seen& s) {
    return [&s](const TensorList& l) {
      Tensor x = l[0] * 1.5;
      x.register_hook([&s](const Tensor& g) {
        ++s.calls;
        s.grad = g.clone();
        return g * 3.0;
      });
      const Tensor n = F::layer_norm(x, {8}, l[1], l[2]);
      return x + n * l[3];
    };
  };
  Seen sf, sp;
  const Result fused = run(true, v, with_hook(sf), gout), plain = run(false, v, with_hook(sp), gout);
  EXPECT_EQ(fused.handed, 1u);
  EXPECT_EQ(sf.calls, 1);
  EXPECT_EQ(sp.calls, 1);
  ASSERT_TRUE(sf.grad.defined() && sp.grad.defined());
  EXPECT_TRUE(close_rel(sf.grad, sp.grad, 1e-5));
  // The sum really holds both contributions: it differs from the residual's part (gout) alone.
  EXPECT_FALSE(close_rel(sf.grad, gout, 1e-3));
  EXPECT_TRUE(same_grads(fused, plain, 1e-5));
  EXPECT_TRUE(close_rel(fused.grads[0], sp.grad * 3.0 * 1.5, 1e-5)) << "the hook's result reached the leaf";
}

// retain_graph: the second backward hands the sum again and gives the same gradients.
TEST(AccumIntoEngine, RetainGraphTwice) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList v = {rnd({2, 5, 12}, 41, DType::f32, dev), rnd({12}, 42, DType::f32, dev, 1.0, 0.2),
                        rnd({12}, 43, DType::f32, dev), rnd({12}, 44, DType::f32, dev)};
  const Tensor gout = rnd({2, 5, 12}, 45, DType::f32, dev);
  const Result plain = run(false, v, [](const TensorList& l) { return norm_residual(l, false); }, gout);
  FusionScope on(true);
  TensorList leaves;
  for (const Tensor& t : v) leaves.push_back(t.clone().requires_grad_());
  const Tensor out = norm_residual(leaves, false);
  BackwardOptions opt;
  opt.grad_output = gout;
  opt.retain_graph = true;
  for (int pass = 0; pass < 2; ++pass) {
    SCOPED_TRACE("pass " + std::to_string(pass));
    const uint64_t before = ad::accumulate_base_counts().handed;
    const Gradients g = out.backward(opt);
    EXPECT_EQ(ad::accumulate_base_counts().handed - before, 1u);
    for (std::size_t i = 0; i < leaves.size(); ++i) EXPECT_TRUE(close_rel(g.get(leaves[i]), plain.grads[i], 1e-5));
  }
}

// The first contribution to x is the caller's own grad_output, passed through by the add: it is
// handed, not owned, and must come back unmodified (the rule writes a fresh sum).
TEST(AccumIntoEngine, PassThroughSumIsNotWritten) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList v = {rnd({3, 6, 20}, 51, DType::f32, dev), rnd({20}, 52, DType::f32, dev, 1.0, 0.2),
                        rnd({20}, 53, DType::f32, dev), rnd({20}, 54, DType::f32, dev)};
  const Tensor gout = rnd({3, 6, 20}, 55, DType::f32, dev);
  const Tensor kept = gout.clone();
  const uint64_t version = gout.version();
  const Build b = [](const TensorList& l) { return norm_residual(l, false); };
  const Result fused = run(true, v, b, gout), plain = run(false, v, b, gout);
  EXPECT_EQ(fused.handed, 1u);
  EXPECT_EQ(fused.owned, 0u);
  EXPECT_EQ(gout.version(), version);
  EXPECT_TRUE(close_rel(gout, kept, 0.0)) << "the caller's grad_output was written";
  EXPECT_TRUE(same_grads(fused, plain, 1e-5));
  // The DiT pattern on the device: gated_residual passes the caller's gradient through to x.
  const TensorList vd = {rnd({2, 7, 32}, 56, DType::f32, dev), rnd({2, 96}, 57, DType::f32, dev, 0.0, 0.5),
                         rnd({32, 32}, 58, DType::f32, dev, 0.0, 0.2)};
  const Tensor gd = rnd({2, 7, 32}, 59, DType::f32, dev);
  const Tensor gd_kept = gd.clone();
  const Result df = run(true, vd, dit_block_plain, gd), dp = run(false, vd, dit_block_plain, gd);
  EXPECT_EQ(df.handed, 1u);
  EXPECT_TRUE(close_rel(gd, gd_kept, 0.0)) << "the caller's grad_output was written";
  EXPECT_TRUE(same_grads(df, dp, 1e-5));
}

// BackwardOptions::inputs naming x: the walk stops at x (a leaf of this pass), so no sum is handed;
// anomaly mode checks each rule's own gradient, so it hands none either. Gradients are unchanged.
TEST(AccumIntoEngine, InputsAndAnomalyModeHandNothing) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList v = {rnd({2, 3, 8}, 61, DType::f32, dev), rnd({8}, 62, DType::f32, dev, 1.0, 0.2),
                        rnd({8}, 63, DType::f32, dev), rnd({8}, 64, DType::f32, dev)};
  const Tensor gout = rnd({2, 3, 8}, 65, DType::f32, dev);
  for (bool fused : {true, false}) {
    FusionScope scope(fused);
    TensorList l;
    for (const Tensor& t : v) l.push_back(t.clone().requires_grad_());
    const Tensor x = l[0] * 1.5;
    const Tensor out = x + F::layer_norm(x, {8}, l[1], l[2]) * l[3];
    BackwardOptions opt;
    opt.grad_output = gout;
    opt.inputs = {x};
    opt.retain_graph = true;
    const uint64_t before = ad::accumulate_base_counts().handed;
    const Tensor gx = out.backward(opt).get(x);
    EXPECT_EQ(ad::accumulate_base_counts().handed, before);
    opt.inputs.clear();
    Tensor gx_anomaly;
    {
      DetectAnomalyGuard anomaly;
      const Gradients g = out.backward(opt);
      gx_anomaly = g.get(l[0]);
    }
    EXPECT_EQ(ad::accumulate_base_counts().handed, before);
    EXPECT_TRUE(close_rel(gx_anomaly, gx * 1.5, 1e-5));
    const Tensor gx_full = out.backward(opt).get(l[0]);  // the fused path, when on
    EXPECT_EQ(ad::accumulate_base_counts().handed - before, fused ? 1u : 0u);
    EXPECT_TRUE(close_rel(gx_full, gx * 1.5, 1e-5));
  }
}

// accumulate_into and the post-accumulate hooks of the leaves (DDP's buckets) see the same values.
TEST(AccumIntoEngine, AccumulateIntoAndPostAccumulateHooks) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList v = {rnd({2, 5, 16}, 71, DType::f32, dev), rnd({16}, 72, DType::f32, dev, 1.0, 0.2),
                        rnd({16}, 73, DType::f32, dev), rnd({16}, 74, DType::f32, dev)};
  const Tensor gout = rnd({2, 5, 16}, 75, DType::f32, dev);
  auto twice = [&](bool fused, TensorList& hooked) {
    FusionScope scope(fused);
    TensorList l;
    for (const Tensor& t : v) l.push_back(t.clone().requires_grad_());
    l[0].register_post_accumulate_grad_hook([&hooked](const Tensor& g) { hooked.push_back(g.clone()); });
    Gradients store;
    BackwardOptions opt;
    opt.grad_output = gout;
    opt.accumulate_into = &store;
    for (int i = 0; i < 2; ++i) (void)norm_residual(l, false).backward(opt);
    TensorList out;
    for (const Tensor& t : l) out.push_back(store.get(t));
    return out;
  };
  TensorList hf, hp;
  const TensorList f = twice(true, hf), p = twice(false, hp);
  ASSERT_EQ(hf.size(), 2u);
  ASSERT_EQ(hp.size(), 2u);
  for (std::size_t i = 0; i < f.size(); ++i) EXPECT_TRUE(close_rel(f[i], p[i], 1e-5)) << "leaf " << i;
  for (std::size_t i = 0; i < 2; ++i) EXPECT_TRUE(close_rel(hf[i], hp[i], 1e-5)) << "hook call " << i;
  EXPECT_TRUE(close_rel(hf[1], hf[0] * 2.0, 1e-5)) << "the second call sees the accumulated gradient";
}

// ---- CUDA: the adaLN kernel reads the sum ----

// The DiT pattern against the float64 CPU reference (the composite) and the unfused CUDA path.
void check_dit_cuda(DType xdt, DType mdt, bool autocast, uint64_t seed) {
  SCOPED_TRACE(std::string("x ") + dtype_name(xdt) + " mod " + dtype_name(mdt) + (autocast ? " autocast" : ""));
  const Device dev = Device::cuda();
  const int64_t b = 3, t = 37, d = 64;
  // The branch's weight in the adaLN output's dtype (an f32 parameter under autocast).
  const DType wdt = autocast ? DType::f32 : promote_types(xdt, mdt);
  const DType leaf_mdt = autocast ? DType::f32 : mdt;  // under autocast the block casts it
  const TensorList v = {rnd({b, t, d}, seed, xdt, dev), rnd({b, 3 * d}, seed + 1, leaf_mdt, dev, 0.0, 0.5),
                        rnd({d, d}, seed + 2, wdt, dev, 0.0, 0.2)};
  const Tensor gout = rnd({b, t, d}, seed + 3, xdt, dev);
  std::string node;
  const Build build = [autocast, &node](const TensorList& l) {
    if (!autocast) return dit_block(l, l[1].dtype(), &node);
    amp::AutocastGuard guard(DType::bf16);
    return dit_block(l, DType::bf16, &node);
  };
  const Result fused = run(true, v, build, gout), plain = run(false, v, build, gout);
  // The fused adaLN op takes (x, modulation, output) = (f32, f32, f32), (f32, bf16, bf16: autocast)
  // and (half, same, same); f32 x with a bf16 modulation outside autocast composes (its layer_norm
  // then takes the sum).
  const bool fused_op = !(xdt == DType::f32 && mdt != DType::f32 && !autocast);
  EXPECT_EQ(node, fused_op ? "LayerNormModulateBackward" : "AddBackward");
  // x's sum to the adaLN rule; under autocast the modulation is a cast (not a leaf), so two of its
  // three narrow pieces also take the sum the first left (the narrow rule's region add).
  EXPECT_EQ(fused.handed, autocast ? 3u : 1u);
  EXPECT_EQ(plain.handed, 0u);
  // f32 x: the kernel adds in f32 what the engine would have added in f32 (one rounding each);
  // half x: the fused path rounds once instead of twice.
  EXPECT_TRUE(same_grads(fused, plain, xdt == DType::f32 ? 1e-6 : 2e-2));
  TensorList v64;
  for (const Tensor& x : v) v64.push_back(x.to(DType::f64).to(Device::cpu()));
  const Result ref = run(true, v64, dit_block_plain, gout.to(DType::f64).to(Device::cpu()));
  const double tol = (xdt == DType::f32 && mdt == DType::f32) ? 1e-4 : 4e-2;
  EXPECT_TRUE(same_grads(fused, ref, tol));
}

TEST(AccumIntoAdaln, DitPatternMatchesCpuReference) {
  FLAME_SKIP_IF_NO_CUDA();
  check_dit_cuda(DType::f32, DType::f32, false, 100);
  check_dit_cuda(DType::f32, DType::bf16, false, 110);  // an f32 sum while the modulation is bf16
  check_dit_cuda(DType::bf16, DType::bf16, false, 120);
  check_dit_cuda(DType::f16, DType::f16, false, 130);
  check_dit_cuda(DType::f32, DType::bf16, true, 140);  // autocast: bf16 modulation and branch, f32 x
}

// Three consumers: the sum handed to the adaLN rule is owned, so the kernel writes into it (base
// and dx are one buffer); D > 512 takes the kernel's wide variant.
TEST(AccumIntoAdaln, OwnedSumWrittenInPlace) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda();
  for (int64_t d : {96, 768}) {
    SCOPED_TRACE("D " + std::to_string(d));
    const TensorList v = {rnd({2, 50, d}, 200 + d, DType::f32, dev),
                          rnd({2, 3 * d}, 201 + d, DType::f32, dev, 0.0, 0.5)};
    const Tensor gout = rnd({2, 50, d}, 202 + d, DType::f32, dev);
    const Build build = [d](const TensorList& l) {
      const Tensor x = l[0] * 1.25;
      const Tensor m = l[1];
      const Tensor y = F::layer_norm_modulate(x, m.narrow(1, 0, d), m.narrow(1, d, d), 1e-6);
      return F::gated_residual(x, m.narrow(1, 2 * d, d), y.square()) + x.sin();
    };
    const Result fused = run(true, v, build, gout), plain = run(false, v, build, gout);
    EXPECT_EQ(fused.handed, 1u);
    EXPECT_EQ(fused.owned, 1u);
    EXPECT_TRUE(same_grads(fused, plain, 1e-6));
    TensorList v64;
    for (const Tensor& x : v) v64.push_back(x.to(DType::f64).to(Device::cpu()));
    const Result ref = run(false, v64, build, gout.to(DType::f64).to(Device::cpu()));
    EXPECT_TRUE(same_grads(fused, ref, 1e-4));
  }
}

// A pending sum the kernel cannot read (a transposed view from x.transpose's rule) is handed and
// added by the rule instead: same gradients.
TEST(AccumIntoAdaln, NonContiguousSumIsComposed) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda();
  const int64_t d = 32;
  const TensorList v = {rnd({2, d, d}, 301, DType::f32, dev), rnd({2, 3 * d}, 302, DType::f32, dev, 0.0, 0.5)};
  const Tensor gout = rnd({2, d, d}, 303, DType::f32, dev);
  const Build build = [d](const TensorList& l) {
    const Tensor x = l[0] * 1.25;
    const Tensor m = l[1];
    const Tensor y = F::layer_norm_modulate(x, m.narrow(1, 0, d), m.narrow(1, d, d), 1e-6);
    return y.square() + (x.transpose(1, 2) * 0.5).contiguous();
  };
  const Result fused = run(true, v, build, gout), plain = run(false, v, build, gout);
  EXPECT_EQ(fused.handed, 1u);
  EXPECT_TRUE(same_grads(fused, plain, 1e-6));
}

// Hooks and retain_graph on the CUDA path: the hook sees the kernel's sum once per backward.
TEST(AccumIntoAdaln, HookAndRetainGraph) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda();
  const TensorList v = {rnd({2, 9, 64}, 401, DType::f32, dev), rnd({2, 192}, 402, DType::f32, dev, 0.0, 0.5),
                        rnd({64, 64}, 403, DType::f32, dev, 0.0, 0.2)};
  const Tensor gout = rnd({2, 9, 64}, 404, DType::f32, dev);
  const Result plain = run(false, v, dit_block_plain, gout);
  FusionScope on(true);
  TensorList l;
  for (const Tensor& t : v) l.push_back(t.clone().requires_grad_());
  Tensor x = l[0] * 1.25;
  int calls = 0;
  Tensor seen;
  x.register_hook([&](const Tensor& g) {
    ++calls;
    seen = g.clone();
    return Tensor();
  });
  const int64_t d = 64;
  const Tensor y = F::layer_norm_modulate(x, l[1].narrow(1, 0, d), l[1].narrow(1, d, d), 1e-6);
  const Tensor out = F::gated_residual(x, l[1].narrow(1, 2 * d, d), F::linear(y, l[2]));
  BackwardOptions opt;
  opt.grad_output = gout;
  opt.retain_graph = true;
  for (int pass = 1; pass <= 2; ++pass) {
    const uint64_t before = ad::accumulate_base_counts().handed;
    const Gradients g = out.backward(opt);
    EXPECT_EQ(ad::accumulate_base_counts().handed - before, 1u);
    EXPECT_EQ(calls, pass);
    EXPECT_TRUE(close_rel(seen * 1.25, plain.grads[0], 1e-5));
    for (std::size_t i = 0; i < l.size(); ++i) EXPECT_TRUE(close_rel(g.get(l[i]), plain.grads[i], 1e-6));
  }
}

// Kernels of a trace whose name holds the binary add functor (not AddScalar, ...); adaln (when
// given) counts the adaLN backward kernels.
int add_kernels(const profiler::KernelTrace& trace, int* adaln = nullptr) {
  int n = 0;
  for (const profiler::KernelRecord& r : trace.records()) {
    if (r.kind != profiler::KernelRecord::Kind::kernel) continue;
    if (adaln && r.name.find("adaln_backward") != std::string::npos) ++*adaln;
    for (std::size_t p = r.name.find("::Add"); p != std::string::npos; p = r.name.find("::Add", p + 1)) {
      const char next = p + 5 < r.name.size() ? r.name[p + 5] : ' ';
      if (!std::isalnum(static_cast<unsigned char>(next)) && next != '_') {
        ++n;
        break;
      }
    }
  }
  return n;
}

// One backward of build over copies of v, traced (after a warm-up run): the add kernels (and the
// adaLN backward kernels) it ran, and the leaves' gradients. A non-empty result: why no trace.
std::string traced_backward(bool fused, const TensorList& v, const Build& build, const Tensor& gout, int& adds,
                            int& adaln, Result& res) {
  (void)run(fused, v, build, gout);  // warm: plans and pool
  FusionScope scope(fused);
  TensorList l;
  for (const Tensor& x : v) l.push_back(x.clone().requires_grad_());
  const Tensor out = build(l);
  BackwardOptions opt;
  opt.grad_output = gout;
  cuda::synchronize();
  profiler::KernelTrace trace;
  if (std::string why = start_trace(trace); !why.empty()) return why;
  const Gradients g = out.backward(opt);
  cuda::synchronize();
  trace.stop();
  adds = add_kernels(trace, &adaln);
  for (const Tensor& x : l) res.grads.push_back(g.get(x));
  return std::string();
}

// The point of the fusion: x's gradient in the DiT pattern takes no add kernel (traced through
// CUPTI); without it, the engine's add runs.
TEST(AccumIntoTrace, DitPatternRunsNoAddKernel) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda();
  const int64_t b = 4, t = 64, d = 128;
  // Separate modulation leaves: nothing else in this graph sums gradients.
  const TensorList v = {rnd({b, t, d}, 501, DType::f32, dev), rnd({b, d}, 502, DType::f32, dev, 0.0, 0.5),
                        rnd({b, d}, 503, DType::f32, dev, 0.0, 0.5), rnd({b, d}, 504, DType::f32, dev, 0.0, 0.5),
                        rnd({d}, 505, DType::f32, dev)};
  const Tensor gout = rnd({b, t, d}, 506, DType::f32, dev);
  auto build = [](const TensorList& l) {
    const Tensor x = l[0] * 1.25;
    const Tensor y = F::layer_norm_modulate(x, l[1], l[2], 1e-6);
    return F::gated_residual(x, l[3], y * l[4]);
  };
  struct Count {
    int adds = 0, adaln = 0;
    Result r;
  };
  auto traced = [&](bool fused, Count& c) { return traced_backward(fused, v, build, gout, c.adds, c.adaln, c.r); };
  Count fused, plain;
  const std::string why = traced(true, fused);
  if (!why.empty()) GTEST_SKIP() << "no kernel trace in this build: " << why;
  (void)traced(false, plain);
  EXPECT_EQ(fused.adaln, 1) << "the adaLN backward ran fused";
  EXPECT_EQ(plain.adaln, 1);
  EXPECT_EQ(fused.adds, 0) << "no add kernel for x's gradient";
  EXPECT_EQ(plain.adds, 1) << "without the fusion the engine adds the two contributions";
  EXPECT_TRUE(same_grads(fused.r, plain.r, 1e-6));
}

// q, k and v of one normalised x, each a frozen base Linear plus a LoRA adapter (A, then B), and
// a plain matmul reading x too: seven contributions to x's gradient, six of them summed by the
// rules. Leaves: x0, then per projection W, b, A, B, then the matmul's M.
Tensor shared_input_linears(const TensorList& l, bool autocast) {
  // A non-leaf vertex, in bf16 under autocast (as a bf16 model's normalised activations are).
  const Tensor x = (l[0] * 1.5).to(autocast ? DType::bf16 : l[0].dtype());
  std::optional<amp::AutocastGuard> ac;
  if (autocast) ac.emplace(DType::bf16, l[0].device().type);
  Tensor out;
  for (int p = 0; p < 3; ++p) {
    const TensorList& w = l;
    const std::size_t o = 1 + 4 * static_cast<std::size_t>(p);
    const Tensor adapter = F::linear(F::linear(x, w[o + 2]), w[o + 3]);
    const Tensor y = (F::linear(x, w[o], w[o + 1]) + adapter).to(DType::f32) * (1.0 + p);
    out = out.defined() ? out + y : y;
  }
  const Tensor m = x.to(autocast ? DType::bf16 : x.dtype()).matmul(l[13].to(autocast ? DType::bf16 : l[13].dtype()));
  return out + m.to(DType::f32).sum({-1}, true);
}

TensorList shared_input_values(DType base, Device dev) {
  const int64_t d = 48, r = 8;
  TensorList v = {rnd({2, 9, d}, 700, DType::f32, dev)};
  for (int p = 0; p < 3; ++p) {
    const uint64_t s = 710 + 10 * static_cast<uint64_t>(p);
    v.push_back(rnd({d, d}, s, base, dev, 0.0, 0.2));
    v.push_back(rnd({d}, s + 1, base, dev));
    v.push_back(rnd({r, d}, s + 2, DType::f32, dev, 0.0, 0.2));  // f32 adapters (master weights)
    v.push_back(rnd({d, r}, s + 3, DType::f32, dev, 0.0, 0.2));
  }
  v.push_back(rnd({d, 5}, 760, base, dev, 0.0, 0.2));
  return v;
}

TEST(AccumIntoLinear, SharedInputGradientsMatchUnfused) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (bool autocast : {false, true}) {
    if (autocast && dev.is_cpu()) continue;  // bf16 GEMMs: the CUDA case
    SCOPED_TRACE(autocast ? "bf16 autocast, f32 adapters" : "f32");
    TensorList v = shared_input_values(autocast ? DType::bf16 : DType::f32, dev);
    const Tensor gout = rnd({2, 9, 48}, 790, DType::f32, dev);
    const Build b = [autocast](const TensorList& l) { return shared_input_linears(l, autocast); };
    const Result fused = run(true, v, b, gout), plain = run(false, v, b, gout);
    // Under autocast every GEMM reads x itself (the base layers' fused bias epilogue, the f32
    // adapters' master-weight GEMMs, the matmul): each contribution after the first is handed the
    // pending sum. A Linear without a bias that runs as reshape + matmul reads a view of x, whose
    // own rule passes its gradient on: that sum stays the engine's.
    if (autocast) EXPECT_EQ(fused.handed, 6u);
    EXPECT_EQ(plain.handed, 0u);
    EXPECT_TRUE(same_grads(fused, plain, autocast ? 3e-2 : 1e-5));
  }
}

// On CUDA, under bf16 autocast with f32 adapters (the LoRA step's precision), the six sums of x's
// gradient are GEMM epilogues: the backward runs no binary add kernel (CUPTI); without the fusion
// the engine's six adds run.
TEST(AccumIntoLinear, SumsRideTheGemmsOnCuda) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda();
  const TensorList v = shared_input_values(DType::bf16, dev);
  const Tensor gout = rnd({2, 9, 48}, 791, DType::f32, dev);
  const Build b = [](const TensorList& l) { return shared_input_linears(l, true); };
  auto traced = [&](bool fused, int& adds, Result& res) {
    int adaln = 0;
    return traced_backward(fused, v, b, gout, adds, adaln, res);
  };
  int fused_adds = -1, plain_adds = -1;
  Result fused, plain;
  const std::string why = traced(true, fused_adds, fused);
  if (!why.empty()) GTEST_SKIP() << "no kernel trace in this build: " << why;
  (void)traced(false, plain_adds, plain);
  EXPECT_EQ(plain_adds - fused_adds, 6) << "the six sums of x's gradient";
  EXPECT_EQ(fused_adds, 0);
  EXPECT_TRUE(same_grads(fused, plain, 3e-2));
}

}  // namespace
}  // namespace flame::test
