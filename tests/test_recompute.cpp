// Activation recompute (docs/recompute.md).
//  - RecomputeMlpGelu*: F::mlp_gelu(..., recompute_hidden = true) gives the gradients of the
//    default (bit for bit on the CPU in f64, within rounding in bf16/f16 on CUDA, where the fused
//    forward rounds gelu of its f32 accumulator but the backward recomputes gelu of rounded pre),
//    holds exactly h's bytes less (autograd_saved_bytes), also under autocast and with frozen layers.
//  - RecomputeCheap*: autograd::RecomputeCheap marks the outputs of cheap ops (F::layer_norm_modulate)
//    so that a node saving one stores the recipe instead; same gradients, fewer saved bytes, and
//    in-place writes to the recipe's inputs or to the marked tensor after the save still raise;
//    layer_norm and rms_norm; a marked tensor captured by checkpoint() keeps its identity;
//    the unary activations (gelu, silu, ...), a GEGLU's gelu of a chunk view, group_norm before
//    SiLU (also under autocast); an output that needs no gradient is not marked; attention's
//    rotated q and k after per-head RMS norms and the join of two streams (dense transposed views);
//    RecomputeCheap.GraphedStepCuda: the recomputes inside a backward captured by cuda::GraphedStep
//    (replays give the eager, non-recompute gradients; skips without a GPU).
#include <cmath>
#include <functional>
#include <optional>

#include "flame/cpu.h"
#include "flame/cuda.h"
#include "flame/cuda/graph_step.h"
#include "flame/nn.h"
#include "flame/nn/adaln.h"
#include "flame/nn/linear_gelu.h"
#include "flame/recompute.h"
#include "nn_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {

namespace F = nn::functional;

double tol_for(DType dt) {
  switch (dt) {
    case DType::bf16: return 3e-2;
    case DType::f16: return 5e-3;
    case DType::f32: return 2e-4;  // TF32 may be on for the GEMMs
    default: return 0.0;           // f64 on the CPU: the same kernels in the same order
  }
}

// Two runs that differ only in what was saved: equal on the CPU; on CUDA within the reordering of
// atomic sums in backward kernels (a last-bit difference, amplified by one low-precision rounding).
double rerun_tol(DType dt) {
  if (test_device().is_cpu()) return 0.0;
  switch (dt) {
    case DType::bf16: return 1.6e-2;
    case DType::f16: return 2e-3;
    case DType::f32: return 1e-5;
    default: return 1e-12;
  }
}

// Leaves on `dev` in `dt` that require grad (undefined stays undefined; frozen[i]: no grad).
TensorList make_leaves(const TensorList& l64, DType dt, Device dev, const std::vector<bool>& frozen = {}) {
  TensorList out;
  for (std::size_t i = 0; i < l64.size(); ++i) {
    if (!l64[i].defined()) {
      out.push_back(Tensor());
      continue;
    }
    Tensor t = l64[i].to(dt).to(dev);
    if (frozen.empty() || !frozen[i]) t.requires_grad_();
    out.push_back(t);
  }
  return out;
}

// Same shape and the same values bit for bit (read back as double, exact for every dtype here).
::testing::AssertionResult same_values(const Tensor& a, const Tensor& b) {
  if (a.sizes() != b.sizes() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << "shape/dtype " << shape_str(a.sizes()) << " " << dtype_name(a.dtype())
                                         << " vs " << shape_str(b.sizes()) << " " << dtype_name(b.dtype());
  const std::vector<double> x = a.to(Device::cpu()).contiguous().to_vec<double>();
  const std::vector<double> y = b.to(Device::cpu()).contiguous().to_vec<double>();
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!(x[i] == y[i]) && !(std::isnan(x[i]) && std::isnan(y[i])))
      return ::testing::AssertionFailure() << "element " << i << ": " << x[i] << " vs " << y[i];
  }
  return ::testing::AssertionSuccess();
}

struct GraphRun {
  Tensor y;
  TensorList grads;  // per leaf, on the CPU in f64 (undefined where none)
  std::size_t saved_bytes = 0;
};

GraphRun run_graph(const std::function<Tensor(const TensorList&)>& fn, const TensorList& leaves, const Tensor& v64) {
  GraphRun r;
  r.y = fn(leaves);
  r.saved_bytes = autograd_saved_bytes(r.y);
  const Tensor v = v64.to(r.y.dtype()).to(r.y.device());
  const Gradients g = (r.y * v).sum().backward();
  for (const Tensor& l : leaves) {
    const Tensor gi = l.defined() ? g.try_get(l) : Tensor();
    r.grads.push_back(gi.defined() ? gi.to(Device::cpu()).to(DType::f64) : Tensor());
  }
  return r;
}

// The graph of fn built under RecomputeCheap and without it (in that order): {recomputed, default}.
std::pair<GraphRun, GraphRun> run_with_and_without(const std::function<Tensor(const TensorList&)>& fn,
                                                   const TensorList& leaves, const Tensor& v64) {
  auto go = [&](bool cheap) {
    return run_graph(
        [&](const TensorList& l) {
          autograd::RecomputeCheap guard(cheap);
          return fn(l);
        },
        leaves, v64);
  };
  GraphRun rec = go(true);
  return {std::move(rec), go(false)};
}

void expect_same_grads(const GraphRun& a, const GraphRun& b, double tol, const std::string& what) {
  ASSERT_EQ(a.grads.size(), b.grads.size());
  if (tol == 0.0) {
    EXPECT_TRUE(same_values(a.y, b.y)) << what << ": outputs";
  } else {
    EXPECT_TRUE(close_scaled(a.y.to(Device::cpu()).to(DType::f64), b.y.to(Device::cpu()).to(DType::f64), tol)) << what;
  }
  for (std::size_t i = 0; i < a.grads.size(); ++i) {
    ASSERT_EQ(a.grads[i].defined(), b.grads[i].defined()) << what << ": gradient " << i;
    if (!a.grads[i].defined()) continue;
    if (tol == 0.0) {
      EXPECT_TRUE(same_values(a.grads[i], b.grads[i])) << what << ": gradient " << i;
    } else {
      EXPECT_TRUE(close_scaled(a.grads[i], b.grads[i], tol, 1.0)) << what << ": gradient " << i;
    }
  }
}

std::vector<DType> mlp_dtypes() {
  if (test_device().is_cpu()) return {DType::f64, DType::f32};
  return {DType::f32, DType::bf16, DType::f16};
}

// ---- F::mlp_gelu(..., recompute_hidden) ----

TEST(RecomputeMlpGelu, GradientsMatchDefault) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  struct Case {
    Shape lead;
    int64_t in, hidden, out;
  };
  uint64_t seed = 100;
  // Aligned sizes take the fused cuBLASLt path on CUDA, odd ones the composite.
  for (const Case& c : std::vector<Case>{{{2, 24}, 32, 64, 32}, {{7}, 5, 9, 3}}) {
    for (DType dt : mlp_dtypes()) {
      for (int frozen_kind = 0; frozen_kind < 3; ++frozen_kind) {
        seed += 10;
        Shape xs = c.lead;
        xs.push_back(c.in);
        const TensorList l64{
            randn_f64(xs, seed), randn_f64({c.hidden, c.in}, seed + 1, 1.0 / std::sqrt(double(c.in))),
            randn_f64({c.hidden}, seed + 2), randn_f64({c.out, c.hidden}, seed + 3, 1.0 / std::sqrt(double(c.hidden))),
            randn_f64({c.out}, seed + 4)};
        Shape ys = c.lead;
        ys.push_back(c.out);
        const Tensor v = randn_f64(ys, seed + 5);
        // 0: all train; 1: first layer frozen; 2: second layer frozen (no dW2: nothing to recompute).
        std::vector<bool> frozen(5, false);
        if (frozen_kind == 1) frozen[1] = frozen[2] = true;
        if (frozen_kind == 2) frozen[3] = frozen[4] = true;
        const TensorList leaves = make_leaves(l64, dt, dev, frozen);
        const GraphRun base = run_graph([](const TensorList& t) { return F::mlp_gelu(t[0], t[1], t[2], t[3], t[4]); },
                                   leaves, v);
        const GraphRun rec = run_graph(
            [](const TensorList& t) { return F::mlp_gelu(t[0], t[1], t[2], t[3], t[4], /*recompute_hidden=*/true); },
            leaves, v);
        const std::string what = std::string(dtype_name(dt)) + " in " + std::to_string(c.in) + " frozen " +
                                 std::to_string(frozen_kind);
        expect_same_grads(rec, base, tol_for(dt), what);
        // h is [rows, hidden] in the compute dtype; held by the default only when w2 trains.
        const int64_t rows = leaves[0].numel() / c.in;
        const std::size_t h_bytes = frozen_kind == 2 ? 0 : static_cast<std::size_t>(rows * c.hidden) * dtype_size(dt);
        EXPECT_EQ(base.saved_bytes - rec.saved_bytes, h_bytes) << what;
      }
    }
  }
}

TEST(RecomputeMlpGelu, GradcheckF64) {
  const TensorList in = make_leaves({randn_f64({3, 4}, 150), randn_f64({6, 4}, 151, 0.5), randn_f64({6}, 152),
                                     randn_f64({2, 6}, 153, 0.5), randn_f64({2}, 154)},
                                    DType::f64, Device::cpu());
  // Finite differences of the forward against the recompute backward.
  const Tensor v = randn_f64({3, 2}, 155);
  const GraphRun r = run_graph(
      [](const TensorList& t) { return F::mlp_gelu(t[0], t[1], t[2], t[3], t[4], true); }, in, v);
  const double eps = 1e-6;
  for (std::size_t i = 0; i < in.size(); ++i) {
    std::vector<double> num(static_cast<std::size_t>(in[i].numel()));
    for (int64_t k = 0; k < in[i].numel(); ++k) {
      auto eval = [&](double delta) {
        NoGradGuard ng;
        TensorList p;
        for (const Tensor& t : in) p.push_back(t.detach().clone());
        Tensor flat = p[i].view({-1});
        flat.narrow(0, k, 1).add_(Tensor::full({1}, delta, TensorOptions(DType::f64)));
        return (F::mlp_gelu(p[0], p[1], p[2], p[3], p[4], true) * v).sum().item<double>();
      };
      num[static_cast<std::size_t>(k)] = (eval(eps) - eval(-eps)) / (2 * eps);
    }
    const std::vector<double> got = r.grads[i].contiguous().to_vec<double>();
    for (std::size_t k = 0; k < num.size(); ++k) EXPECT_NEAR(got[k], num[k], 1e-6) << "input " << i << " elem " << k;
  }
}

TEST(RecomputeMlpGelu, UnderAutocast) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList leaves = make_leaves({randn_f64({4, 16, 32}, 170), randn_f64({64, 32}, 171, 0.2),
                                         randn_f64({64}, 172), randn_f64({32, 64}, 173, 0.15), randn_f64({32}, 174)},
                                        DType::f32, dev);
  const Tensor v = randn_f64({4, 16, 32}, 175);
  auto with = [&](bool recompute) {
    return run_graph(
        [&](const TensorList& t) {
          amp::AutocastGuard ac(DType::bf16, dev.type);
          return F::mlp_gelu(t[0], t[1], t[2], t[3], t[4], recompute);
        },
        leaves, v);
  };
  const GraphRun base = with(false), rec = with(true);
  EXPECT_EQ(rec.y.dtype(), DType::bf16);
  expect_same_grads(rec, base, dev.is_cpu() ? 0.0 : tol_for(DType::bf16), "autocast bf16");
  // h in bf16: 64 rows x 64 hidden x 2 bytes.
  EXPECT_EQ(base.saved_bytes - rec.saved_bytes, std::size_t{64 * 64 * 2});
}

TEST(RecomputeMlpGelu, RetainGraphRecomputesTwice) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList t = make_leaves({randn_f64({5, 8}, 180), randn_f64({16, 8}, 181, 0.3), randn_f64({16}, 182),
                                    randn_f64({8, 16}, 183, 0.3), randn_f64({8}, 184)},
                                   DType::f32, dev);
  const Tensor loss = F::mlp_gelu(t[0], t[1], t[2], t[3], t[4], true).square().sum();
  BackwardOptions keep;
  keep.retain_graph = true;
  const Gradients g1 = loss.backward(keep);
  const Gradients g2 = loss.backward();
  for (const Tensor& l : t) {
    if (dev.is_cpu()) {
      EXPECT_TRUE(same_values(g1.get(l), g2.get(l)));
    } else {
      EXPECT_TRUE(close_scaled(g1.get(l).to(Device::cpu()), g2.get(l).to(Device::cpu()), rerun_tol(DType::f32), 1.0));
    }
  }
}

// ---- autograd::RecomputeCheap ----

// A DiT-like piece: adaLN-modulate x, then a linear layer and the MLP read the result (each saves
// it for its weight gradient). The modulation is also read by an op that saves it (as gated_residual
// does in a DiT), so that the recipe's inputs are held with or without recompute and the saved
// bytes differ by the two adaLN outputs exactly.
struct AdalnNet {
  TensorList leaves;  // x, mod, w, b, w1, b1, w2, b2
  int64_t B = 3, T = 10, D = 16, H = 32;
  AdalnNet(DType dt, Device dev, uint64_t seed) {
    leaves =
        make_leaves({randn_f64({B, T, D}, seed), randn_f64({B, 4 * D}, seed + 1, 0.5),
                     randn_f64({D, D}, seed + 2, 0.25), randn_f64({D}, seed + 3), randn_f64({H, D}, seed + 4, 0.25),
                     randn_f64({H}, seed + 5), randn_f64({D, H}, seed + 6, 0.2), randn_f64({D}, seed + 7)},
                    dt, dev);
  }
  // y and the adaLN outputs n1, n2.
  Tensor forward(const TensorList& t, Tensor* n1 = nullptr, Tensor* n2 = nullptr, bool recompute_hidden = false) const {
    const TensorList m = t[1].chunk(4, 1);
    const Tensor x = t[0] * 1.0;  // a non-leaf: tests may write it in place
    const Tensor a = F::layer_norm_modulate(x, m[0], m[1], 1e-6);
    const Tensor h = x + F::linear(a, t[2], t[3]);
    const Tensor b = F::layer_norm_modulate(h, m[2], m[3], 1e-6);
    if (n1) *n1 = a;
    if (n2) *n2 = b;
    return F::mlp_gelu(b, t[4], t[5], t[6], t[7], recompute_hidden) + (t[1] * t[1]).sum();
  }
};

std::size_t bytes_of(const Tensor& t) { return static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype()); }

TEST(RecomputeCheap, LayerNormModulateGradientsMatch) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (DType dt : mlp_dtypes()) {
    const AdalnNet net(dt, dev, 300);
    const Tensor v = randn_f64({net.B, net.T, net.D}, 310);
    Tensor n1, n2;
    const GraphRun base = run_graph([&](const TensorList& t) { return net.forward(t, &n1, &n2); }, net.leaves, v);
    const std::size_t n_bytes = bytes_of(n1) + bytes_of(n2);
    n1 = n2 = Tensor();
    const GraphRun rec = run_graph(
        [&](const TensorList& t) {
          autograd::RecomputeCheap guard;
          EXPECT_TRUE(autograd::recompute_cheap_enabled());
          return net.forward(t);
        },
        net.leaves, v);
    EXPECT_FALSE(autograd::recompute_cheap_enabled());  // the guard restored the thread's setting
    // The recipe reruns the forward's kernels on the forward's inputs: the same values.
    expect_same_grads(rec, base, rerun_tol(dt), dtype_name(dt));
    EXPECT_EQ(base.saved_bytes - rec.saved_bytes, n_bytes) << dtype_name(dt);
  }
}

TEST(RecomputeCheap, WithRecomputeHiddenUnderAutocast) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const AdalnNet net(DType::f32, dev, 400);
  const Tensor v = randn_f64({net.B, net.T, net.D}, 410);
  auto go = [&](bool cheap, bool hidden, std::size_t* n_bytes) {
    return run_graph(
        [&](const TensorList& t) {
          autograd::RecomputeCheap guard(cheap);
          amp::AutocastGuard ac(DType::bf16, dev.type);
          Tensor n1, n2;
          Tensor y = net.forward(t, &n1, &n2, hidden);
          EXPECT_EQ(n1.dtype(), DType::bf16);
          if (n_bytes) *n_bytes = bytes_of(n1) + bytes_of(n2);
          return y;
        },
        net.leaves, v);
  };
  std::size_t n_bytes = 0;
  const GraphRun base = go(false, false, &n_bytes);
  const GraphRun hidden = go(false, true, nullptr);
  const GraphRun all = go(true, true, nullptr);
  expect_same_grads(all, hidden, rerun_tol(DType::bf16), "cheap + hidden vs hidden");
  expect_same_grads(all, base, dev.is_cpu() ? 0.0 : tol_for(DType::bf16), "cheap + hidden vs none");
  const std::size_t h_bytes = static_cast<std::size_t>(net.B * net.T * net.H) * 2;
  EXPECT_EQ(base.saved_bytes - hidden.saved_bytes, h_bytes);
  EXPECT_EQ(hidden.saved_bytes - all.saved_bytes, n_bytes);
}

TEST(RecomputeCheap, InPlaceWriteToRecipeInputRaises) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList t = make_leaves({randn_f64({2, 5, 8}, 500), randn_f64({8, 8}, 501, 0.3)}, DType::f32, dev);
  const Tensor mod_leaf = randn_f64({2, 16}, 502).to(DType::f32).to(dev).requires_grad_();
  autograd::RecomputeCheap guard;
  Tensor mod = mod_leaf * 1.0;  // non-leaf: may be written in place
  const TensorList m = mod.chunk(2, 1);
  const Tensor x = t[0] * 1.0;
  const Tensor loss = F::linear(F::layer_norm_modulate(x, m[0], m[1]), t[1]).square().sum();
  {
    NoGradGuard ng;
    mod.mul_(2.0);  // shift and scale change after the linear layer saved the recipe
  }
  try {
    (void)loss.backward();
    ADD_FAILURE() << "no error for a recipe input written in place";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("autograd::RecomputeCheap"), std::string::npos) << e.what();
  }
  // The same with the input x.
  Tensor x2 = t[0] * 1.0;
  const Tensor loss2 = F::linear(F::layer_norm_modulate(x2, m[0], m[1]), t[1]).square().sum();
  {
    NoGradGuard ng;
    x2.add_(1.0);
  }
  EXPECT_THROW((void)loss2.backward(), Error);
}

TEST(RecomputeCheap, InPlaceWriteToMarkedOutput) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList t =
      make_leaves({randn_f64({2, 5, 8}, 520), randn_f64({2, 16}, 521), randn_f64({8, 8}, 522, 0.3)}, DType::f32, dev);
  const TensorList m = t[1].chunk(2, 1);
  // Written after the save: the backward raises, as for an ordinary saved tensor.
  {
    autograd::RecomputeCheap guard;
    Tensor n = F::layer_norm_modulate(t[0], m[0], m[1]);
    const Tensor loss = F::linear(n, t[2]).square().sum();
    {
      NoGradGuard ng;
      n.add_(1.0);
    }
    EXPECT_THROW((void)loss.backward(), Error);
  }
  // Written before the save: the recipe no longer describes it, so it is saved as is and the
  // gradients are those of the default.
  const auto [rec, base] = run_with_and_without(
      [&](const TensorList& l) {
        const TensorList mm = l[1].chunk(2, 1);
        Tensor n = F::layer_norm_modulate(l[0], mm[0], mm[1]);
        n.mul_(3.0);
        return F::linear(n, l[2]);
      },
      t, randn_f64({2, 5, 8}, 523));
  expect_same_grads(rec, base, rerun_tol(DType::f32), "written before the save");
  EXPECT_EQ(rec.saved_bytes, base.saved_bytes);
}

TEST(RecomputeCheap, DisabledInsideAndOutsideGradMode) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList t =
      make_leaves({randn_f64({2, 5, 8}, 540), randn_f64({2, 16}, 541), randn_f64({8, 8}, 542, 0.3)}, DType::f32, dev);
  const TensorList m = t[1].chunk(2, 1);
  autograd::RecomputeCheap on;
  std::size_t marked = 0, off = 0;
  {
    const Tensor n = F::layer_norm_modulate(t[0], m[0], m[1]);
    marked = autograd_saved_bytes(F::linear(n, t[2]) + (t[1] * t[1]).sum());  // mod saved either way
  }
  {
    autograd::RecomputeCheap inner(false);
    EXPECT_FALSE(autograd::recompute_cheap_enabled());
    const Tensor n = F::layer_norm_modulate(t[0], m[0], m[1]);
    off = autograd_saved_bytes(F::linear(n, t[2]) + (t[1] * t[1]).sum());
  }
  EXPECT_TRUE(autograd::recompute_cheap_enabled());
  EXPECT_EQ(off - marked, std::size_t{2 * 5 * 8 * 4});
  // Grad mode off: nothing to mark (no graph will save it), and the output is an ordinary tensor.
  NoGradGuard ng;
  const Tensor n = F::layer_norm_modulate(t[0], m[0], m[1]);
  EXPECT_FALSE(n.requires_grad());
}

TEST(RecomputeCheap, SlicedViewIsSavedAsIs) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList t =
      make_leaves({randn_f64({2, 5, 8}, 560), randn_f64({2, 16}, 561), randn_f64({4, 4}, 562, 0.3)}, DType::f32, dev);
  const auto [rec, base] = run_with_and_without(
      [&](const TensorList& l) {
        const TensorList mm = l[1].chunk(2, 1);
        const Tensor n = F::layer_norm_modulate(l[0], mm[0], mm[1]);
        return F::linear(n.narrow(2, 2, 4), l[2]);  // a part of the output: not covered by the recipe
      },
      t, randn_f64({2, 5, 4}, 563));
  expect_same_grads(rec, base, rerun_tol(DType::f32), "sliced");
  EXPECT_EQ(rec.saved_bytes, base.saved_bytes);
}

// checkpoint() keeps the tensors its function captures by identity (they key the recompute's
// gradients): a marked output captured that way is held as itself, not as its recipe.
TEST(RecomputeCheap, CheckpointCaptureKeepsIdentity) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList t =
      make_leaves({randn_f64({2, 5, 8}, 580), randn_f64({2, 16}, 581), randn_f64({8, 8}, 582, 0.3)}, DType::f32, dev);
  const auto [rec, base] = run_with_and_without(
      [&](const TensorList& l) {
        const TensorList mm = l[1].chunk(2, 1);
        const Tensor n = F::layer_norm_modulate(l[0], mm[0], mm[1]);
        // n is captured by the lambda (not passed as an input) and also saved by a plain linear.
        const Tensor c = checkpoint([n, w = l[2]](const TensorList& in) { return (F::linear(n, w) * in[0]).tanh(); },
                                    {l[0] * 1.0});
        return c + F::linear(n, l[2]);
      },
      t, randn_f64({2, 5, 8}, 583));
  expect_same_grads(rec, base, rerun_tol(DType::f32), "checkpoint capture");
}

TEST(RecomputeCheap, LayerNormAndRmsNorm) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (DType dt : mlp_dtypes()) {
    for (bool rms : {false, true}) {
      const TensorList t = make_leaves({randn_f64({3, 7, 16}, 700), randn_f64({16}, 701), randn_f64({16}, 702),
                                        randn_f64({8, 16}, 703, 0.3), randn_f64({8}, 704)},
                                       dt, dev);
      const auto [rec, base] = run_with_and_without(
          [&](const TensorList& l) {
            const Tensor n = rms ? F::rms_norm(l[0], {16}, l[1], 1e-5) : F::layer_norm(l[0], {16}, l[1], l[2], 1e-5);
            return F::linear(n, l[3], l[4]);
          },
          t, randn_f64({3, 7, 8}, 705));
      const std::string what = std::string(rms ? "rms_norm " : "layer_norm ") + dtype_name(dt);
      expect_same_grads(rec, base, rerun_tol(dt), what);
      // The norm's output goes; its recipe holds x and weight (saved by the norm node anyway) and,
      // for layer_norm, the bias (which nothing else saves).
      const std::size_t y_bytes = 3 * 7 * 16 * dtype_size(dt), b_bytes = rms ? 0 : 16 * dtype_size(dt);
      EXPECT_EQ(base.saved_bytes - rec.saved_bytes, y_bytes - b_bytes) << what;
    }
  }
}

// Chains (Note [Recompute cheap], "Chains"): linear(silu(gelu(x))). Without marking the step saves
// x (gelu's node), gelu's output (SiLU's node) and SiLU's output (the linear's). With it SiLU's
// recipe folds gelu's in: it holds x instead of gelu's output, so only x stays, and the recomputed
// values are the forward's bit for bit.
TEST(RecomputeCheap, ChainsFoldMarkedInputs) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (DType dt : mlp_dtypes()) {
    const TensorList t = make_leaves({randn_f64({4, 6, 16}, 720), randn_f64({8, 16}, 721, 0.3)}, dt, dev);
    const auto [rec, base] = run_with_and_without(
        [&](const TensorList& l) { return F::linear(l[0].gelu().silu(), l[1]); }, t, randn_f64({4, 6, 8}, 722));
    const std::string what = std::string("gelu then silu ") + dtype_name(dt);
    expect_same_grads(rec, base, dev.is_cpu() ? 0.0 : rerun_tol(dt), what);
    EXPECT_EQ(base.saved_bytes - rec.saved_bytes, 2 * bytes_of(t[0])) << what;  // gelu's and SiLU's outputs
  }
}

// An input written in place after the op ran but before a node saves the output: the recipe no
// longer describes the output, so the output is saved as is and the backward succeeds. (Only W
// trains: no adaLN node saves x, so nothing else would notice.)
TEST(RecomputeCheap, InputWrittenBeforeSaveFallsBack) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList w = make_leaves({randn_f64({8, 8}, 590, 0.3)}, DType::f32, dev);
  const auto [rec, base] = run_with_and_without(
      [&](const TensorList& l) {
        Tensor x = randn_f64({2, 5, 8}, 591).to(DType::f32).to(dev);
        const TensorList mm = randn_f64({2, 16}, 592).to(DType::f32).to(dev).chunk(2, 1);
        const Tensor n = F::layer_norm_modulate(x, mm[0], mm[1]);
        x.add_(1.0);
        return F::linear(n, l[0]);
      },
      w, randn_f64({2, 5, 8}, 593));
  expect_same_grads(rec, base, rerun_tol(DType::f32), "input written before the save");
  EXPECT_EQ(rec.saved_bytes, base.saved_bytes);
}

// ---- activations and group_norm (a UNet's GEGLU and GroupNorm -> SiLU) ----

struct Activation {
  const char* name;
  std::function<Tensor(const Tensor&)> fn;
  bool marked;  // its gradient reads x only (relu and tanh save their output themselves)
};

std::vector<Activation> activations() {
  return {{"gelu", [](const Tensor& x) { return x.gelu(); }, true},
          {"gelu_tanh", [](const Tensor& x) { return x.gelu(true); }, true},
          {"silu", [](const Tensor& x) { return x.silu(); }, true},
          {"mish", [](const Tensor& x) { return x.mish(); }, true},
          {"softplus", [](const Tensor& x) { return x.softplus(2.0, 1.5); }, true},
          {"leaky_relu", [](const Tensor& x) { return x.leaky_relu(0.2); }, true},
          {"elu", [](const Tensor& x) { return x.elu(0.7); }, true},
          {"hardswish", [](const Tensor& x) { return hardswish(x); }, true},
          {"hardsigmoid", [](const Tensor& x) { return hardsigmoid(x); }, true},
          {"relu", [](const Tensor& x) { return x.relu(); }, false},
          {"tanh", [](const Tensor& x) { return x.tanh(); }, false}};
}

TEST(RecomputeCheap, UnaryActivations) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (DType dt : mlp_dtypes()) {
    for (const Activation& a : activations()) {
      const TensorList t =
          make_leaves({randn_f64({3, 7, 16}, 800), randn_f64({8, 16}, 801, 0.3), randn_f64({8}, 802)}, dt, dev);
      Tensor act;
      const auto [rec, base] = run_with_and_without(
          [&](const TensorList& l) {
            act = a.fn(l[0] * 1.5);
            return F::linear(act, l[1], l[2]);  // saves act for the weight's gradient
          },
          t, randn_f64({3, 7, 8}, 803));
      const std::string what = std::string(a.name) + " " + dtype_name(dt);
      expect_same_grads(rec, base, rerun_tol(dt), what);
      // The activation's node saves its input anyway: the recipe adds nothing and act goes.
      EXPECT_EQ(base.saved_bytes - rec.saved_bytes, a.marked ? bytes_of(act) : 0) << what;
    }
  }
}

// A GEGLU (diffusers' feed-forward): [h, gate] = chunk(proj(x)), out = h * gelu(gate). The
// product saves gelu(gate); its recipe reads the gate, a view that the gelu node saves anyway.
TEST(RecomputeCheap, GegluGateOfAChunk) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList t = make_leaves({randn_f64({2, 9, 12}, 820), randn_f64({40, 12}, 821, 0.3), randn_f64({40}, 822),
                                    randn_f64({12, 20}, 823, 0.2), randn_f64({12}, 824)},
                                   DType::f32, dev);
  const Tensor v = randn_f64({2, 9, 12}, 825);
  for (int mode = 0; mode < 3; ++mode) {  // 0: the dtype of the leaves, 1: f64 (CPU) or bf16, 2: bf16 autocast
    const DType dt = mode == 1 ? (dev.is_cpu() ? DType::f64 : DType::bf16) : DType::f32;
    TensorList l0;
    for (const Tensor& x : t) l0.push_back(x.detach().to(dt).requires_grad_());
    Tensor gate_act;
    const auto [rec, base] = run_with_and_without(
        [&](const TensorList& l) {
          std::optional<amp::AutocastGuard> ac;
          if (mode == 2) ac.emplace(DType::bf16, dev.type);
          const TensorList parts = F::linear(l[0], l[1], l[2]).chunk(2, -1);
          gate_act = parts[1].gelu();
          return F::linear(parts[0] * gate_act, l[3], l[4]);
        },
        l0, v);
    const std::string what = "mode " + std::to_string(mode);
    EXPECT_EQ(gate_act.dtype(), mode == 2 ? DType::bf16 : dt) << what;
    expect_same_grads(rec, base, rerun_tol(mode == 0 ? dt : DType::bf16), what);
    EXPECT_EQ(base.saved_bytes - rec.saved_bytes, bytes_of(gate_act)) << what;
  }
}

// GroupNorm -> SiLU -> conv (a ResnetBlock2D). With the conv frozen (a LoRA elsewhere) only SiLU
// saves anything here: the norm's output goes, its recipe adds the bias. With the conv trained it
// saves SiLU's output too, as a recipe that folds the norm's in (Note [Recompute cheap], "Chains"),
// but in its rule's captures, which autograd_saved_bytes does not see: the counted drop is the
// norm's output less its bias either way (ChainsFoldMarkedInputs counts a chain's whole drop).
TEST(RecomputeCheap, GroupNormThenSilu) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (DType dt : mlp_dtypes()) {
    for (bool conv_trains : {false, true}) {
      const TensorList t = make_leaves({randn_f64({2, 8, 5, 3}, 840), randn_f64({8}, 841), randn_f64({8}, 842),
                                        randn_f64({6, 8, 3, 3}, 843, 0.2)},
                                       dt, dev, {false, false, false, !conv_trains});
      Tensor g;
      const auto [rec, base] = run_with_and_without(
          [&](const TensorList& l) {
            g = F::group_norm(l[0] * 1.0, 4, l[1], l[2], 1e-5);
            return F::conv2d(g.silu(), l[3], {}, {1}, {1});
          },
          t, randn_f64({2, 6, 5, 3}, 844));
      const std::string what = std::string(dtype_name(dt)) + (conv_trains ? " conv trains" : " conv frozen");
      expect_same_grads(rec, base, rerun_tol(dt), what);
      const std::size_t bias = 8 * dtype_size(dt);
      EXPECT_EQ(base.saved_bytes - rec.saved_bytes, bytes_of(g) - bias) << what;  // g and SiLU's output: equal sizes
    }
  }
}

// Under autocast the norm runs in f32 and so does the SiLU after it; the conv saves the bf16 copy
// it makes. What goes is the norm's f32 output (less its f32 bias), and the f32 copy of the bf16
// input that the norm computes on is kept as that bf16 input (the widening cast is marked too:
// Note [Recompute cheap], "Chains"), half its bytes.
TEST(RecomputeCheap, GroupNormUnderAutocast) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList t = make_leaves({randn_f64({2, 8, 6, 4}, 860), randn_f64({8}, 861), randn_f64({8}, 862),
                                    randn_f64({4, 8, 1, 1}, 863, 0.3)},
                                   DType::f32, dev);
  Tensor g;
  const auto [rec, base] = run_with_and_without(
      [&](const TensorList& l) {
        amp::AutocastGuard ac(DType::bf16, dev.type);
        g = F::group_norm(l[0].to(DType::bf16) * 1.0, 2, l[1], l[2], 1e-6);
        return F::conv2d(g.silu(), l[3]);
      },
      t, randn_f64({2, 4, 6, 4}, 864));
  EXPECT_EQ(g.dtype(), DType::f32);
  expect_same_grads(rec, base, dev.is_cpu() ? 0.0 : rerun_tol(DType::bf16), "autocast");
  const std::size_t half_of_the_f32_copy = bytes_of(g) / 2;  // x's f32 copy has g's shape and dtype
  EXPECT_EQ(base.saved_bytes - rec.saved_bytes, bytes_of(g) - 8 * 4 + half_of_the_f32_copy);
}

TEST(RecomputeCheap, InPlaceWritesAfterTheSaveRaise) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList t = make_leaves({randn_f64({2, 8, 4, 4}, 880), randn_f64({8}, 881), randn_f64({8}, 882),
                                    randn_f64({5, 8}, 883, 0.3)},
                                   DType::f32, dev);
  autograd::RecomputeCheap guard;
  auto expect_raises = [](const Tensor& loss, const std::string& what) {
    try {
      (void)loss.backward();
      ADD_FAILURE() << what << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("in-place"), std::string::npos) << what << ": " << e.what();
    }
  };
  {  // the activation's output, written after the linear layer saved it
    Tensor s = (t[0] * 1.0).permute({0, 2, 3, 1}).gelu();
    const Tensor loss = F::linear(s, t[3]).square().sum();
    {
      NoGradGuard ng;
      s.mul_(2.0);
    }
    expect_raises(loss, "activation output");
  }
  {  // group_norm's output, written after SiLU saved it
    Tensor g = F::group_norm(t[0] * 1.0, 2, t[1], t[2], 1e-5);
    const Tensor loss = g.silu().sum();
    {
      NoGradGuard ng;
      g.add_(1.0);
    }
    expect_raises(loss, "group_norm output");
  }
  {  // group_norm's input (a recipe input), written after the save
    Tensor x = t[0] * 1.0;
    const Tensor loss = F::group_norm(x, 2, t[1], t[2], 1e-5).silu().sum();
    {
      NoGradGuard ng;
      x.add_(1.0);
    }
    EXPECT_THROW((void)loss.backward(), Error);
  }
}

// The marked output's memory goes back to the allocator once the forward drops it, with the graph
// still alive (a CPU storage lives in its data block: nothing of the recipe may hold it).
TEST(RecomputeCheap, MarkedOutputMemoryIsReleased) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  auto allocated = [&] {
    return dev.is_cpu() ? cpu::memory_stats().allocated_bytes : cuda::memory_stats(dev.index).allocated_bytes;
  };
  const TensorList t = make_leaves({randn_f64({64, 256}, 920), randn_f64({8, 256}, 921, 0.1)}, DType::f32, dev);
  const std::size_t act_bytes = 64 * 256 * 4;
  auto held = [&](bool cheap) {
    const std::size_t before = allocated();
    Tensor y;
    {
      autograd::RecomputeCheap guard(cheap);
      y = F::linear(t[0].silu(), t[1]);  // the linear layer saves silu's output (or its recipe)
    }
    const std::size_t during = allocated() - before;
    const Gradients g = y.sum().backward();
    EXPECT_TRUE(g.get(t[1]).defined());
    return during;
  };
  const std::size_t plain = held(false), cheap = held(true);
  EXPECT_GE(plain - cheap, act_bytes) << "plain " << plain << " cheap " << cheap;
}

// An activation whose output needs no gradient had no node record it: its input would be held by
// the recipe alone, so it is not marked and a consumer saves the output as is.
TEST(RecomputeCheap, OutputWithoutGradientIsNotMarked) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const TensorList w = make_leaves({randn_f64({4, 6}, 900)}, DType::f32, dev);
  const Tensor x = randn_f64({4, 6}, 901).to(DType::f32).to(dev);
  const auto [rec, base] = run_with_and_without(
      [&](const TensorList& l) {
        return (l[0] * x.silu()) + (l[0] * F::group_norm(x.unsqueeze(0), 2, {}, {}, 1e-5).squeeze(0));
      },
      w, randn_f64({4, 6}, 902));
  expect_same_grads(rec, base, rerun_tol(DType::f32), "no gradient");
  EXPECT_EQ(rec.saved_bytes, base.saved_bytes);
  EXPECT_EQ(base.saved_bytes, std::size_t{2 * 4 * 6 * 4});
}

// Attention's q and k as FLUX and SD3.5 make them: each stream's projection, RMS-normed per head,
// joined along the sequence (image + text), seen as [B, H, S, D] (a transposed, dense view) and
// rotated; attention saves the rotated q and k. Under RecomputeCheap the rotary output is a recipe
// that folds the join's and the norms' (the rms_norm nodes save the projections anyway), so the
// saved bytes drop by exactly the rotated q and k, and the gradients are the default's. A text
// stream that needs no gradient (block 0 of FLUX: no adapters on the text projections) is held by
// the join's recipe as it is: still marked while it is under half the join; not when it is larger.
TEST(RecomputeCheap, RotaryOfNormedJoinedHeads) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  F::SdpaBackendGuard fused(F::SdpaBackend::fused);  // saves q, k, v, the output and its statistics
  const int64_t b = 2, h = 2, d = 8, e = h * d;
  struct Case {
    int64_t l, t;       // image and text tokens (t = 0: one stream, no join)
    bool text_trains;  // the text projections need a gradient (marked norms)
    bool marked;       // the rotary outputs are expected to go
  };
  const std::vector<Case> cases = {{6, 0, true, true}, {6, 3, true, true}, {6, 2, false, true}, {3, 6, false, false}};
  // The fused attention's dtypes: on CUDA (cuDNN) bf16 and f16 only.
  const std::vector<DType> dtypes =
      dev.is_cpu() ? std::vector<DType>{DType::f64, DType::f32} : std::vector<DType>{DType::bf16, DType::f16};
  for (DType dt : dtypes) {
    for (const Case& c : cases) {
      const int64_t s = c.l + c.t;
      const TensorList leaves =
          make_leaves({randn_f64({b, c.l, e}, 940), randn_f64({e, e}, 941, 0.3), randn_f64({e, e}, 942, 0.3),
                       randn_f64({e, e}, 943, 0.3), randn_f64({d}, 944), randn_f64({e, e}, 945, 0.3),
                       randn_f64({e, e}, 946, 0.3)},
                      dt, dev, {true, false, false, false, true, !c.text_trains, !c.text_trains});
      const Tensor ctx = randn_f64({b, std::max<int64_t>(c.t, 1), e}, 947).to(dt).to(dev);
      const Tensor ang = randn_f64({s, d}, 948);
      const Tensor cos = ang.cos().to(DType::f32).to(dev), sin = ang.sin().to(DType::f32).to(dev);
      Tensor q_rot;  // of the recomputed run, for the bytes
      auto fn = [&](const TensorList& l) {
        auto heads = [&](const Tensor& x, const Tensor& w, int64_t len, bool norm) {
          const Tensor p = F::linear(x, w).view({b, len, h, d});
          return norm ? F::rms_norm(p, {d}, l[4], 1e-6) : p;
        };
        Tensor q = heads(l[0], l[1], c.l, true), k = heads(l[0], l[2], c.l, true), v = heads(l[0], l[3], c.l, false);
        if (c.t > 0) {
          q = cat({heads(ctx, l[5], c.t, true), q}, 1);
          k = cat({heads(ctx, l[6], c.t, true), k}, 1);
          v = cat({heads(ctx, l[3], c.t, false), v}, 1);
        }
        q = F::rotary_embedding(q.transpose(1, 2), cos, sin, F::RotaryLayout::interleaved);
        k = F::rotary_embedding(k.transpose(1, 2), cos, sin, F::RotaryLayout::interleaved);
        q_rot = q;
        return F::scaled_dot_product_attention(q, k, v.transpose(1, 2));
      };
      const auto [rec, base] = run_with_and_without(fn, leaves, randn_f64({b, h, s, d}, 949));
      const std::string what = std::string(dtype_name(dt)) + " l=" + std::to_string(c.l) + " t=" +
                               std::to_string(c.t) + (c.text_trains ? " text trains" : " text frozen");
      expect_same_grads(rec, base, dev.is_cpu() ? 0.0 : rerun_tol(dt), what);
      const std::size_t qk = 2 * bytes_of(q_rot);
      const std::size_t text_held = c.text_trains ? 0 : 2 * static_cast<std::size_t>(b * c.t * e) * dtype_size(dt);
      EXPECT_EQ(base.saved_bytes - rec.saved_bytes, c.marked ? qk - text_held : 0) << what;
    }
  }
}

// The same q and k through F::rms_norm_rotary (Note [RMS norm rotary]): its node saves the
// projections, and under RecomputeCheap its output is a recipe over them, so the saved bytes drop
// by exactly the rotated q and k (whether the text projections train or not: the node keeps them
// either way), with the default's gradients.
TEST(RecomputeCheap, FusedNormRotaryOutputIsARecipe) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  F::SdpaBackendGuard fused(F::SdpaBackend::fused);
  const int64_t b = 2, h = 2, d = 16, e = h * d, l = 6, t = 3, s = l + t;
  const std::vector<DType> dtypes =
      dev.is_cpu() ? std::vector<DType>{DType::f64, DType::f32} : std::vector<DType>{DType::bf16, DType::f16};
  for (DType dt : dtypes) {
    for (bool text_trains : {true, false}) {
      const TensorList leaves =
          make_leaves({randn_f64({b, l, e}, 960), randn_f64({e, e}, 961, 0.3), randn_f64({e, e}, 962, 0.3),
                       randn_f64({e, e}, 963, 0.3), randn_f64({e, e}, 964, 0.3), randn_f64({e, e}, 965, 0.3)},
                      dt, dev, {true, false, false, false, !text_trains, !text_trains});
      const Tensor ctx = randn_f64({b, t, e}, 966).to(dt).to(dev);
      const Tensor wn = randn_f64({d}, 967).to(dt).to(dev);
      const Tensor ang = randn_f64({s, d}, 968);
      const Tensor cos = ang.cos().to(DType::f32).to(dev), sin = ang.sin().to(DType::f32).to(dev);
      Tensor q_rot;
      auto fn = [&](const TensorList& p) {
        auto proj = [&](const Tensor& x, const Tensor& w, int64_t len) { return F::linear(x, w).view({b, len, h, d}); };
        const Tensor q = F::rms_norm_rotary({proj(ctx, p[4], t), proj(p[0], p[1], l)}, {wn, wn}, 1e-6, cos, sin);
        const Tensor k = F::rms_norm_rotary({proj(ctx, p[5], t), proj(p[0], p[2], l)}, {wn, wn}, 1e-6, cos, sin);
        const Tensor v = cat({proj(ctx, p[3], t), proj(p[0], p[3], l)}, 1).transpose(1, 2);
        q_rot = q;
        return F::scaled_dot_product_attention(q, k, v);
      };
      const auto [rec, base] = run_with_and_without(fn, leaves, randn_f64({b, h, s, d}, 969));
      const std::string what = std::string(dtype_name(dt)) + (text_trains ? " text trains" : " text frozen");
      expect_same_grads(rec, base, dev.is_cpu() ? 0.0 : rerun_tol(dt), what);
      EXPECT_EQ(base.saved_bytes - rec.saved_bytes, 2 * bytes_of(q_rot)) << what;
    }
  }
}

TEST(RecomputeCheap, GraphedStepCuda) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda(0);
  const AdalnNet net(DType::f32, dev, 600);
  const TensorList& p = net.leaves;
  Tensor x = Tensor::empty({net.B, net.T, net.D}, {DType::f32, dev});
  TensorList grads;
  auto grads_of = [&](const Tensor& xin, bool recompute) {
    autograd::RecomputeCheap guard(recompute);
    Tensor loss;
    {
      amp::AutocastGuard ac(DType::bf16, DeviceType::cuda);
      TensorList in = p;
      in[0] = xin;  // x is the step's input, not a parameter
      loss = net.forward(in, nullptr, nullptr, recompute).to(DType::f32).square().mean();
    }
    TensorList params(p.begin() + 1, p.end());
    BackwardOptions bo;
    bo.inputs = params;
    const Gradients g = loss.backward(bo);
    TensorList out;
    for (const Tensor& q : params) out.push_back(g.get(q));
    return out;
  };
  cuda::GraphedStep step([&] { grads = grads_of(x, true); }, {.warmup_steps = 2});
  for (int t = 0; t < 5; ++t) {
    const Tensor xt = randn_f64({net.B, net.T, net.D}, 610 + t).to(DType::f32).to(dev);
    const TensorList ref = grads_of(xt, false);
    cuda::GraphedStep::copy_input(x, xt);
    step();
    EXPECT_EQ(step.captured(), t >= 2) << "step " << t;
    ASSERT_EQ(grads.size(), ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i) {
      EXPECT_TRUE(close_scaled(grads[i].to(Device::cpu()).to(DType::f64), ref[i].to(Device::cpu()).to(DType::f64),
                               tol_for(DType::bf16), 1.0))
          << "step " << t << " gradient " << i;
    }
  }
  EXPECT_EQ(step.replays(), 3);
}

}  // namespace
}  // namespace flame::test
