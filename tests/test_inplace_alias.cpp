// In-place mul_/div_ whose operand is the destination or a view of its storage, under autograd:
// gradients match the out-of-place formula, and nothing of the graph outlives its tensors (the
// rule once saved the operand, whose new history ran through that rule: a reference cycle).
#include <memory>

#include "flame/cpu.h"
#include "gradcheck.h"
#include "test_util.h"

namespace flame::test {
namespace {

Tensor values(const Shape& shape, uint64_t seed) {
  Generator g(seed);
  return Tensor::randn(shape, 0.0, 1.0, {DType::f64, test_device()}, &g);
}

// Runs `body` (which builds a graph from w and writes in place) and checks that once its tensors
// are gone, so are the destination, the leaf's impl and every byte the body allocated.
void expect_no_leak(const std::function<Tensor(const Tensor& w)>& body) {
  std::weak_ptr<TensorImpl> dest, leaf;
  const bool on_cpu = test_device().is_cpu();
  const std::size_t before = on_cpu ? cpu::memory_stats().allocated_bytes : 0;
  {
    Tensor w = values({1 << 12}, 7).requires_grad_(true);
    leaf = w.impl_ptr();
    Tensor h = body(w);
    ASSERT_TRUE(h.requires_grad());
    dest = h.impl_ptr();
  }
  EXPECT_TRUE(dest.expired()) << "the destination outlived every handle on it (a reference cycle)";
  EXPECT_TRUE(leaf.expired()) << "the leaf outlived every handle on it (held by a leaked graph)";
  if (on_cpu) EXPECT_EQ(cpu::memory_stats().allocated_bytes, before);
}

TEST(InplaceAlias, SquareInPlaceLeavesNoGraphBehind) {
  FLAME_SKIP_IF_NO_DEVICE();
  expect_no_leak([](const Tensor& w) {
    Tensor h = w * 2.0;
    h.mul_(h);
    return h;
  });
  expect_no_leak([](const Tensor& w) {
    Tensor h = w * 2.0 + 3.0;
    h.view({64, 64}).div_(h.view({64, 64}));
    return h;
  });
  expect_no_leak([](const Tensor& w) {  // a view of another region of the same storage
    Tensor h = w * 2.0 + 3.0;
    h.narrow(0, 0, 2048).mul_(h.narrow(0, 1024, 2048));
    return h;
  });
}

TEST(InplaceAlias, SquareInPlaceLeavesNoGraphBehindAfterBackward) {
  FLAME_SKIP_IF_NO_DEVICE();
  expect_no_leak([](const Tensor& w) {
    Tensor h = w * 2.0;
    h.mul_(h);
    BackwardOptions o;
    o.retain_graph = true;  // saved tensors stay: only the handles' end may free the graph
    Gradients g = h.sum().backward(o);
    EXPECT_TRUE(g.contains(w));
    return h;
  });
}

TEST(InplaceAlias, SquareInPlaceGradientIsTheOutOfPlaceOne) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = values({5, 4}, 1).requires_grad_(true);
  Tensor c = values({5, 4}, 2);
  Tensor h = w * 2.0;
  h.mul_(h);
  EXPECT_EQ(h.grad_fn_name(), "MulBackward");
  Gradients g = (h * c).sum().backward();
  ASSERT_TRUE(g.contains(w));
  NoGradGuard no_grad;
  // d/dw sum(c (2w)^2) = 8 c w.
  EXPECT_TRUE(all_close(g.get(w), c * w.detach() * 8.0, 1e-12, 1e-12));
  EXPECT_TRUE(all_close(h, w.detach() * w.detach() * 4.0, 1e-12, 1e-12));
}

TEST(InplaceAlias, OperandSharingStorageKeepsItsOwnGradient) {
  FLAME_SKIP_IF_NO_DEVICE();
  // x is w's memory without w's history: the operand w (not x's old value) carries the gradient.
  Tensor w = values({4, 3}, 5).requires_grad_(true);
  Tensor x = w.detach();
  Tensor c = values({4, 3}, 6);
  Tensor w_old = w.detach().clone();
  x.mul_(w);
  Gradients g = (x * c).sum().backward();
  ASSERT_TRUE(g.contains(w));
  NoGradGuard no_grad;
  EXPECT_TRUE(all_close(g.get(w), c * w_old, 1e-12, 1e-12));
  EXPECT_TRUE(all_close(x, w_old * w_old, 1e-12, 1e-12));
}

TEST(InplaceAlias, AliasedMulAndDivPassGradcheck) {
  // Finite differences in f64 on the CPU against the recorded in-place ops.
  const Tensor x = Tensor::randn({6, 4}, 0.0, 1.0, {DType::f64, Device::cpu()});
  const auto square = [](const TensorList& in) {
    Tensor h = in[0] * 1.5 + 0.25;
    h.mul_(h);
    return h;
  };
  const auto view_div = [](const TensorList& in) {
    Tensor h = in[0] * in[0] + 2.0;  // positive: a safe divisor
    h.view({4, 6}).div_(h.view({4, 6}));  // all ones, its gradient zero
    Tensor u = in[0] * 0.5 + 3.0;
    u.view({4, 6}).div_(u.view({6, 4}).t());  // the same memory read in another order
    return u + h;
  };
  const auto overlapping_views = [](const TensorList& in) {
    Tensor h = in[0] * in[0] + 1.0;
    h.narrow(0, 0, 3).div_(h.narrow(0, 3, 3));   // another region of the same storage
    h.narrow(0, 1, 4).mul_(h.narrow(0, 2, 4));    // regions that overlap: the old values are read
    return h;
  };
  for (const auto& [name, fn] : {std::pair<const char*, std::function<Tensor(const TensorList&)>>{"square", square},
                                 {"view_div", view_div},
                                 {"overlapping_views", overlapping_views}}) {
    SCOPED_TRACE(name);
    GradcheckResult r = gradcheck(fn, {x});
    EXPECT_TRUE(r.ok) << r.message;
    EXPECT_GT(r.checked, 0);
  }
}

TEST(InplaceAlias, OverlappingViewsReadTheOldValues) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = values({6, 3}, 3).requires_grad_(true);
  Tensor c = values({6, 3}, 4);
  Tensor h = w * 1.0 + 2.0;
  h.narrow(0, 1, 4).mul_(h.narrow(0, 2, 4));
  Gradients g = (h * c).sum().backward();
  NoGradGuard no_grad;
  // Out of place: rows 1..4 become a[i] * a[i + 1] with a = w + 2 (old values).
  Tensor a = w.detach() + 2.0;
  Tensor want_h = a.clone();
  want_h.narrow(0, 1, 4).copy_(a.narrow(0, 1, 4) * a.narrow(0, 2, 4));
  EXPECT_TRUE(all_close(h, want_h, 1e-12, 1e-12));
  // d/da of sum(c h): rows 0 and 5 pass c through; row i in 1..4 gets c[i] a[i+1] instead; rows
  // j in 2..5 also get c[j-1] a[j-1] as the right operand.
  Tensor want_g = c.clone();
  want_g.narrow(0, 1, 4).copy_(c.narrow(0, 1, 4) * a.narrow(0, 2, 4));
  want_g.narrow(0, 2, 4).add_(c.narrow(0, 1, 4) * a.narrow(0, 1, 4));
  EXPECT_TRUE(all_close(g.get(w), want_g, 1e-12, 1e-12));
}

}  // namespace
}  // namespace flame::test
