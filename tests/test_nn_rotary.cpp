// nn::functional::rotary_embedding (Note [Rotary embedding] in src/ops/rotary.cpp): the fused
// kernel against a float64 loop, its backward against the composite's and finite differences, the
// composite for learned tables, and the errors.
#include <cmath>
#include <vector>

#include "flame/autograd.h"
#include "flame/compile.h"
#include "flame/nn/rotary.h"
#include "flame/ops.h"
#include "gradcheck.h"
#include "test_util.h"

namespace flame::test {
namespace {

namespace F = nn::functional;
using F::RotaryLayout;

// The pair partner of element e in a row of d (Note: a < b in each pair).
int64_t partner(int64_t e, int64_t d, RotaryLayout layout) {
  if (layout == RotaryLayout::interleaved) return e % 2 == 0 ? e + 1 : e - 1;
  return e < d / 2 ? e + d / 2 : e - d / 2;
}
bool first_of_pair(int64_t e, int64_t d, RotaryLayout layout) {
  return layout == RotaryLayout::interleaved ? e % 2 == 0 : e < d / 2;
}

// out[e] = x[e] cos[s, e] + sign * x[partner] sin[s, e], sign -1 on the first of a pair, as a loop in
// f64 over x [N, S, D] (any leading dims), cos/sin [S, D].
Tensor reference(const Tensor& x, const Tensor& cos, const Tensor& sin, RotaryLayout layout) {
  const int64_t d = x.size(-1), s_len = x.size(-2), rows = x.numel() / d;
  const std::vector<double> xv = x.to(DType::f64, Device::cpu()).contiguous().to_vec<double>();
  const std::vector<double> cv = cos.to(DType::f64, Device::cpu()).contiguous().to_vec<double>();
  const std::vector<double> sv = sin.to(DType::f64, Device::cpu()).contiguous().to_vec<double>();
  std::vector<double> out(xv.size());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = r % s_len;
    for (int64_t e = 0; e < d; ++e) {
      const double sign = first_of_pair(e, d, layout) ? -1.0 : 1.0;
      out[r * d + e] = xv[r * d + e] * cv[s * d + e] + sign * xv[r * d + partner(e, d, layout)] * sv[s * d + e];
    }
  }
  return Tensor::from_vec(out, x.sizes());
}

struct Tables {
  Tensor cos, sin;
};
// A FLUX-like table (angles per pair, each repeated for both members) when `paired`, else an
// arbitrary one (a different value per element: the general contract).
Tables tables(int64_t s, int64_t d, bool paired, Device dev, uint64_t seed) {
  const Tensor theta = make_input({{s, paired ? d / 2 : d}, DType::f64, Layout::contiguous, -3.0, 3.0}, Device::cpu(), seed);
  Tensor t = paired ? theta.unsqueeze(-1).expand({s, d / 2, 2}).reshape({s, d}) : theta;
  return {t.cos().to(DType::f32).to(dev), t.sin().to(DType::f32).to(dev)};
}

// x's gradient through the fused op and through the composite (tables that require a gradient take
// the composite path), for the upstream gradient `seed`; the composite's table gradients too.
struct BackwardPair {
  Tensor fused, composite, dcos;
};
BackwardPair backward_pair(const Tensor& x0, const Tensor& seed, const Tables& t, RotaryLayout layout) {
  const Tensor x = x0.detach().requires_grad_(true);
  const Gradients fused = F::rotary_embedding(x, t.cos, t.sin, layout).backward(BackwardOptions{seed});
  const Tensor xc = x0.detach().requires_grad_(true);
  const Tensor c = t.cos.to(DType::f64).requires_grad_(true), s = t.sin.to(DType::f64).requires_grad_(true);
  const Gradients comp = F::rotary_embedding(xc, c, s, layout).backward(BackwardOptions{seed});
  return {fused.get(x), comp.get(xc), comp.get(c)};
}

TEST(Rotary, ForwardMatchesLoopReference) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (RotaryLayout layout : {RotaryLayout::interleaved, RotaryLayout::half}) {
    for (bool paired : {true, false}) {
      const Tables t = tables(5, 8, paired, dev, 3);
      for (DType dt : {DType::f64, DType::f32, DType::bf16, DType::f16}) {
        SCOPED_TRACE(std::string(layout == RotaryLayout::half ? "half " : "interleaved ") + dtype_name(dt) +
                     (paired ? " paired" : " general"));
        const Tensor x = make_input({{2, 3, 5, 8}, dt, Layout::contiguous}, dev, 7);
        const Tensor got = F::rotary_embedding(x, t.cos, t.sin, layout);
        EXPECT_EQ(got.dtype(), dt);
        EXPECT_TRUE(all_close(got.to(DType::f64), reference(x, t.cos, t.sin, layout), default_rtol(dt),
                              default_atol(dt)));
      }
    }
  }
}

TEST(Rotary, StridedInputAndBroadcastTables) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tables t = tables(6, 4, false, dev, 5);
  // q as a projection's [B, S, H, D] seen as [B, H, S, D]; tables with leading dims of size 1.
  const Tensor q = make_input({{2, 6, 3, 4}, DType::f32, Layout::contiguous}, dev, 9).transpose(1, 2);
  const Tensor got = F::rotary_embedding(q, t.cos.view({1, 1, 6, 4}), t.sin.view({1, 1, 6, 4}));
  EXPECT_TRUE(all_close(got.to(DType::f64), reference(q, t.cos, t.sin, RotaryLayout::interleaved), 1e-5, 1e-6));
}

// q and k as attention takes them from one projection: [B, H, S, D] over [B, S, H, D] memory. The
// output keeps that layout (no copy) and equals the loop; the backward, given a gradient in the same
// layout (as SDPA's dq is for such q) or a contiguous one, gives the composite's gradient.
TEST(Rotary, HeadsInnerLayoutStaysAndMatches) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (RotaryLayout layout : {RotaryLayout::interleaved, RotaryLayout::half}) {
    for (DType dt : {DType::f64, DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(layout == RotaryLayout::half ? "half " : "interleaved ") + dtype_name(dt));
      const Tables t = tables(6, 8, false, dev, 41);
      const Tensor mem = make_input({{2, 6, 3, 8}, dt, Layout::contiguous}, dev, 42);  // [B, S, H, D]
      const Tensor q = mem.transpose(1, 2);
      const Tensor got = F::rotary_embedding(q, t.cos, t.sin, layout);
      EXPECT_EQ(got.strides(), q.strides());
      EXPECT_TRUE(all_close(got.to(DType::f64), reference(q, t.cos, t.sin, layout), default_rtol(dt), default_atol(dt)));
    }
    const Tables t = tables(6, 8, false, dev, 43);
    const Tensor x0 = make_input({{2, 6, 3, 8}, DType::f64, Layout::contiguous}, dev, 44).transpose(1, 2);
    for (bool strided_grad : {true, false}) {
      SCOPED_TRACE(strided_grad ? "gradient in the heads-inner layout" : "contiguous gradient");
      const Tensor seed_mem = make_input({{2, 6, 3, 8}, DType::f64, Layout::contiguous}, dev, 45);
      const Tensor seed = strided_grad ? seed_mem.transpose(1, 2) : seed_mem.transpose(1, 2).contiguous();
      const BackwardPair b = backward_pair(x0, seed, t, layout);
      EXPECT_TRUE(all_close(b.fused, b.composite, 1e-12, 1e-12));
    }
  }
}

// The fused backward (the kernel's inverse pass) equals the composite's gradient, for general tables
// (cos/sin differ within a pair), and finite differences.
TEST(Rotary, BackwardMatchesCompositeAndFiniteDifferences) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (RotaryLayout layout : {RotaryLayout::interleaved, RotaryLayout::half}) {
    SCOPED_TRACE(layout == RotaryLayout::half ? "half" : "interleaved");
    const Tables t = tables(4, 6, false, dev, 11);
    const Tensor x0 = make_input({{2, 2, 4, 6}, DType::f64, Layout::contiguous}, dev, 12);
    const Tensor seed = make_input({{2, 2, 4, 6}, DType::f64, Layout::contiguous}, dev, 13);
    const BackwardPair b = backward_pair(x0, seed, t, layout);
    EXPECT_TRUE(all_close(b.fused, b.composite, 1e-12, 1e-12));
    // d/dcos[s, e] = sum over rows at position s of g[e] x[e]
    EXPECT_TRUE(all_close(b.dcos, (seed * x0).sum({0, 1}), 1e-12, 1e-12));
  }
  const Tables t = tables(3, 4, false, Device::cpu(), 17);
  for (RotaryLayout layout : {RotaryLayout::interleaved, RotaryLayout::half}) {
    const auto r = gradcheck(
        [&](const TensorList& in) { return F::rotary_embedding(in[0], t.cos, t.sin, layout); },
        {make_input({{2, 3, 4}, DType::f64, Layout::contiguous}, Device::cpu(), 19)});
    EXPECT_TRUE(r.ok) << r.message;
  }
}

// Head dims and dtypes the vectorised CUDA kernel takes (16-byte vectors: D a multiple of 8 bf16 or
// 4 f32 values, twice that for the half layout), several heads in the heads-inner layout as FLUX's
// q and k, forward and backward (the inverse pass), against the loop; and the same rows at an
// address off the 16-byte alignment, which the per-pair kernel takes. On the CPU: the reference.
TEST(Rotary, VectorWidthRowsAndUnalignedRowsMatchTheLoop) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const int64_t b = 1, s = 37, h = 3;
  for (int64_t d : {int64_t{16}, int64_t{128}}) {
    for (RotaryLayout layout : {RotaryLayout::interleaved, RotaryLayout::half}) {
      // One angle per pair (the pair's two places hold it), so the inverse is the rotation by -theta.
      const Tensor theta =
          make_input({{s, d / 2}, DType::f64, Layout::contiguous, -3.0, 3.0}, Device::cpu(), 51 + static_cast<uint64_t>(d));
      const Tensor angles = layout == RotaryLayout::half ? cat({theta, theta}, 1)
                                                         : theta.unsqueeze(-1).expand({s, d / 2, 2}).reshape({s, d});
      const Tables t{angles.cos().to(DType::f32).to(dev), angles.sin().to(DType::f32).to(dev)};
      const Tables inv{t.cos, t.sin.neg()};
      for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
        for (bool unaligned : {false, true}) {
          SCOPED_TRACE(std::string(layout == RotaryLayout::half ? "half " : "interleaved ") + dtype_name(dt) +
                       " D=" + std::to_string(d) + (unaligned ? " unaligned" : ""));
          const int64_t n = b * s * h * d;
          const Tensor flat = make_input({{n + 1}, dt, Layout::contiguous}, dev, 60 + static_cast<uint64_t>(d));
          const Tensor mem = (unaligned ? flat.narrow(0, 1, n) : flat.narrow(0, 0, n)).view({b, s, h, d});
          const Tensor x = mem.transpose(1, 2).requires_grad_(true);  // [B, H, S, D] over [B, S, H, D]
          const Tensor y = F::rotary_embedding(x, t.cos, t.sin, layout);
          EXPECT_TRUE(all_close(y.to(DType::f64), reference(x.detach(), t.cos, t.sin, layout), default_rtol(dt),
                                default_atol(dt)));
          const Tensor seed = make_input({{b, h, s, d}, dt, Layout::contiguous}, dev, 70);
          const Gradients g = y.backward(BackwardOptions{seed});
          EXPECT_TRUE(all_close(g.get(x).to(DType::f64), reference(seed, inv.cos, inv.sin, layout), default_rtol(dt),
                                default_atol(dt)));
        }
      }
    }
  }
}

// The node keeps cos and sin only, not x.
TEST(Rotary, SavesOnlyTheTables) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tables t = tables(16, 8, true, dev, 23);
  const Tensor x = make_input({{4, 2, 16, 8}, DType::f32, Layout::contiguous}, dev, 24).requires_grad_(true);
  const Tensor y = F::rotary_embedding(x, t.cos, t.sin);
  EXPECT_EQ(autograd_saved_bytes(y), 2u * 16 * 8 * sizeof(float));
}

// Inside flame::compile the op replays eagerly between fused regions, with the same result and gradient.
TEST(Rotary, CompiledFunctionMatchesEager) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tables t = tables(5, 4, true, dev, 29);
  auto fn = [&](const TensorList& in) -> TensorList {
    return {F::rotary_embedding(in[0] * 2.0 + 1.0, t.cos, t.sin).silu()};
  };
  CompiledFunction f = compile(fn);
  const Tensor x = make_input({{3, 5, 4}, DType::f32, Layout::contiguous}, dev, 30);
  f({x});
  const TensorList got = f({x});
  EXPECT_EQ(f.fallback_reason(), "");
  EXPECT_TRUE(all_close(got[0], fn({x})[0], 1e-6, 1e-6));
}

TEST(Rotary, ErrorsNameTheProblem) {
  const Tensor x = Tensor::zeros({2, 3, 5});
  const Tensor c = Tensor::zeros({3, 4}), s = Tensor::zeros({3, 4});
  expect_error([&] { F::rotary_embedding(x, Tensor::zeros({3, 5}), Tensor::zeros({3, 5})); },
               {"rotary_embedding", "even", "[2, 3, 5]"});
  expect_error([&] { F::rotary_embedding(Tensor::zeros({2, 3, 4}), Tensor::zeros({2, 4}), s); },
               {"rotary_embedding", "cos must be [S, D] = [3, 4]", "[2, 4]"});
  expect_error([&] { F::rotary_embedding(Tensor::zeros({2, 3, 4}, {DType::i64}), c, s); },
               {"rotary_embedding", "x must be floating", "i64"});
  expect_error([&] { F::rotary_embedding(Tensor::zeros({4}), Tensor::zeros({1, 4}), Tensor::zeros({1, 4})); },
               {"rotary_embedding", "[..., S, D]"});
}

}  // namespace
}  // namespace flame::test
