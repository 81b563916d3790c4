// Leaf gradients keep the leaf's dense layout (Note [Gradient layout] in src/autograd/engine.cpp):
// a non-overlapping dense leaf (channels-last, transposed) gets a gradient with its own strides,
// any other leaf a contiguous one, and the ownership rules (tests/test_grad_ownership.cpp) hold
// for both. Runs on the device under test; values are checked against the same computation on
// contiguous leaves (whose gradients the op-table gradchecks cover) or closed forms.
#include <string>

#include "flame/nn/conv.h"
#include "test_util.h"

namespace flame::test {
namespace {

namespace F = flame::nn::functional;

Tensor randn_on(const Shape& shape, uint64_t seed, DType dt = DType::f32) {
  Generator g(seed);
  return Tensor::randn(shape, 0.0, 1.0, {dt, test_device()}, &g);
}

// A channels-last tensor (NCHW logical shape, NHWC memory) that is nobody's view: how a
// parameter converted to channels-last looks.
Tensor channels_last_leaf(const Shape& nchw, uint64_t seed, DType dt = DType::f32) {
  NoGradGuard no_grad;
  Tensor nhwc = randn_on({nchw[0], nchw[2], nchw[3], nchw[1]}, seed, dt);
  return nhwc.permute({0, 3, 1, 2}).detach().requires_grad_(true);
}

// A contiguous leaf with t's values.
Tensor contiguous_twin(const Tensor& t) {
  NoGradGuard no_grad;
  return t.detach().contiguous().clone().requires_grad_(true);
}

std::string str(const Shape& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// Strides equal on every dim of size > 1 (size-1 dims may carry any stride).
::testing::AssertionResult same_strides(const Tensor& got, const Tensor& want) {
  if (got.sizes() != want.sizes()) return ::testing::AssertionFailure() << "shape " << str(got.sizes());
  for (int64_t d = 0; d < got.dim(); ++d) {
    if (got.sizes()[d] != 1 && got.strides()[d] != want.strides()[d]) {
      return ::testing::AssertionFailure() << "strides " << str(got.strides()) << ", expected " << str(want.strides());
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(GradLayout, ChannelsLastLeavesThroughConv2d) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = channels_last_leaf({2, 3, 6, 5}, 1), w = channels_last_leaf({4, 3, 3, 3}, 2);
  Tensor b = randn_on({4}, 3).requires_grad_(true);
  ASSERT_FALSE(x.is_contiguous());
  ASSERT_TRUE(F::is_channels_last(x) && F::is_channels_last(w));
  const Tensor r = randn_on({2, 4, 6, 5}, 4);
  Gradients g = (F::conv2d(x, w, b, {1}, {1}) * r).sum().backward();
  Tensor xc = contiguous_twin(x), wc = contiguous_twin(w);
  Gradients gc = (F::conv2d(xc, wc, b, {1}, {1}) * r).sum().backward();
  EXPECT_TRUE(same_strides(g.get(x), x));
  EXPECT_TRUE(same_strides(g.get(w), w));
  EXPECT_FALSE(g.get(w).is_contiguous());
  EXPECT_TRUE(all_close(g.get(x), gc.get(xc), 1e-4, 1e-5));
  EXPECT_TRUE(all_close(g.get(w), gc.get(wc), 1e-4, 1e-5));
  EXPECT_TRUE(all_close(g.get(b), gc.get(b), 1e-4, 1e-5));
}

TEST(GradLayout, ChannelsLastLeafThroughElementwiseOps) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = channels_last_leaf({2, 4, 3, 5}, 5);
  const Tensor c = randn_on({2, 4, 3, 5}, 6);
  // x is used twice, so its contributions are summed before they reach the store.
  Gradients g = (x * x * c + x.exp()).sum().backward();
  Tensor gx = g.get(x);
  ASSERT_TRUE(gx.defined());
  EXPECT_TRUE(same_strides(gx, x));
  NoGradGuard no_grad;
  const Tensor xd = x.detach();
  EXPECT_TRUE(all_close(gx, xd * c * 2.0 + xd.exp(), 1e-5, 1e-6));
}

TEST(GradLayout, TransposedLeafThroughMatmulAndElementwise) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = [] {
    NoGradGuard no_grad;
    return randn_on({7, 5}, 7).t().detach().requires_grad_(true);  // [5, 7], strides {1, 5}
  }();
  ASSERT_EQ(x.strides(), (Shape{1, 5}));
  const Tensor w = randn_on({7, 3}, 8), c = randn_on({5, 7}, 9);
  Gradients g = (x.matmul(w).sum() + (x * c).sum()).backward();
  Tensor gx = g.get(x);
  EXPECT_EQ(gx.strides(), (Shape{1, 5}));
  Tensor xc = contiguous_twin(x);
  Gradients gc = (xc.matmul(w).sum() + (xc * c).sum()).backward();
  EXPECT_TRUE(gc.get(xc).is_contiguous());
  EXPECT_TRUE(all_close(gx, gc.get(xc), 1e-5, 1e-6));
}

TEST(GradLayout, AccumulationOverTwoBackwardsKeepsLayout) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = channels_last_leaf({2, 3, 4, 4}, 10), w = channels_last_leaf({2, 3, 3, 3}, 11);
  const Tensor r1 = randn_on({2, 2, 2, 2}, 12), r2 = randn_on({2, 2, 2, 2}, 13);
  Gradients store;
  BackwardOptions o;
  o.accumulate_into = &store;
  (void)(F::conv2d(x, w) * r1).sum().backward(o);
  const Tensor first = store.get(w).clone();
  (void)(F::conv2d(x, w) * r2).sum().backward(o);
  EXPECT_TRUE(same_strides(store.get(x), x));
  EXPECT_TRUE(same_strides(store.get(w), w));
  Gradients g2 = (F::conv2d(x, w) * r2).sum().backward();
  EXPECT_TRUE(all_close(store.get(w), first + g2.get(w), 1e-4, 1e-5));

  // A handle taken from get() keeps its values: the third sum goes to a fresh buffer, which is
  // still in the leaf's layout.
  Tensor held = store.get(w);
  const Tensor held_before = held.clone();
  (void)(F::conv2d(x, w) * r1).sum().backward(o);
  EXPECT_TRUE(all_close(held, held_before, 0, 0));
  EXPECT_FALSE(store.get(w).shares_storage(held));
  EXPECT_TRUE(same_strides(store.get(w), w));
  EXPECT_TRUE(all_close(store.get(w), held_before + first, 1e-4, 1e-5));
}

TEST(GradLayout, NonDenseLeavesGetContiguousGradients) {
  FLAME_SKIP_IF_NO_DEVICE();
  NoGradGuard setup;
  // A view with gaps (every other column) and an expanded tensor (stride 0).
  Tensor gapped = randn_on({4, 6}, 14).narrow(1, 0, 3).t().detach();  // [3, 4], strides {1, 6}
  Tensor expanded = randn_on({1, 4}, 15).expand({3, 4}).detach();
  ASSERT_FALSE(gapped.is_contiguous());
  gapped.requires_grad_(true);
  expanded.requires_grad_(true);
  const Tensor c = randn_on({3, 4}, 16);
  EnableGradGuard grad_on;
  Gradients g = ((gapped * c).sum() + (expanded * expanded).sum()).backward();
  ASSERT_TRUE(g.get(gapped).defined() && g.get(expanded).defined());
  EXPECT_TRUE(g.get(gapped).is_contiguous());
  EXPECT_TRUE(g.get(expanded).is_contiguous());
  NoGradGuard no_grad;
  EXPECT_TRUE(all_close(g.get(gapped), c, 0, 0));
  EXPECT_TRUE(all_close(g.get(expanded), expanded.detach() * 2.0, 1e-6, 1e-7));
}

TEST(GradLayout, SetAdoptsOnlyAMatchingLayout) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = channels_last_leaf({2, 3, 4, 5}, 17);
  NoGradGuard no_grad;
  // A fresh channels-last tensor handed over as an rvalue: adopted as it is, no copy.
  Tensor fresh = randn_on({2, 4, 5, 3}, 18).permute({0, 3, 1, 2}).detach();
  const Tensor want = fresh.clone();
  const void* bytes = fresh.data_ptr();
  Gradients store;
  store.set(x, std::move(fresh));
  EXPECT_EQ(store.get(x).data_ptr(), bytes);
  EXPECT_TRUE(all_close(store.get(x), want, 0, 0));

  // A contiguous one (another layout) is copied into the leaf's layout; so is one the caller keeps.
  Tensor contiguous = randn_on({2, 3, 4, 5}, 19);
  const void* cbytes = contiguous.data_ptr();
  const Tensor cwant = contiguous.clone();
  store.set(x, std::move(contiguous));
  EXPECT_NE(store.get(x).data_ptr(), cbytes);
  EXPECT_TRUE(same_strides(store.get(x), x));
  EXPECT_TRUE(all_close(store.get(x), cwant, 0, 0));
  Tensor kept = randn_on({2, 4, 5, 3}, 20).permute({0, 3, 1, 2}).detach();
  store.set(x, kept);
  EXPECT_FALSE(store.get(x).shares_storage(kept));
  EXPECT_TRUE(same_strides(store.get(x), x));
  EXPECT_TRUE(all_close(store.get(x), kept, 0, 0));

  // In-place accumulation into the owned buffer keeps its layout and its bytes.
  const void* owned = store.get(x).data_ptr();
  store.accumulate(x, kept.contiguous());
  EXPECT_EQ(store.get(x).data_ptr(), owned);
  EXPECT_TRUE(same_strides(store.get(x), x));
  EXPECT_TRUE(all_close(store.get(x), kept * 2.0, 1e-6, 1e-7));
}

TEST(GradLayout, ChannelsLastGradientsAreOwnedAndSeparate) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = channels_last_leaf({1, 3, 2, 4}, 21), b = channels_last_leaf({1, 3, 2, 4}, 22);
  Tensor c = randn_on({1, 3, 2, 4}, 23).requires_grad_(true);
  // The add rule hands one tensor to both a and b: the store must not let them share it.
  Gradients g = ((a + b) * c).sum().backward();
  Tensor ga = g.get(a), gb = g.get(b), gc = g.get(c);
  EXPECT_TRUE(same_strides(ga, a));
  EXPECT_TRUE(same_strides(gb, b));
  EXPECT_TRUE(gc.is_contiguous());
  EXPECT_FALSE(ga.shares_storage(gb));
  NoGradGuard no_grad;
  const Tensor gb_before = gb.clone();
  g.at(a).mul_(0.5);
  EXPECT_TRUE(all_close(g.get(b), gb_before, 0, 0));
  EXPECT_TRUE(all_close(g.get(a), c.detach() * 0.5, 1e-6, 1e-7));

  // A leaf's own backward with a grad_output the caller keeps: copied, in the leaf's layout.
  Tensor go = randn_on({1, 3, 2, 4}, 24);
  BackwardOptions o;
  o.grad_output = go;
  Gradients g2 = a.backward(o);
  EXPECT_FALSE(g2.get(a).shares_storage(go));
  EXPECT_TRUE(same_strides(g2.get(a), a));
  EXPECT_TRUE(all_close(g2.get(a), go, 0, 0));
}

TEST(GradLayout, BadStoredShapeStillRaises) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = channels_last_leaf({2, 3, 4, 5}, 25);
  Gradients store;
  expect_error([&] { store.set(x, randn_on({2, 3, 5, 4}, 26)); }, {"Gradients::set", "[2, 3, 5, 4]"});
}

}  // namespace
}  // namespace flame::test
