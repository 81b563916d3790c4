// In-place ops under autograd (Note [In-place recording] in src/autograd/rules/inplace.cpp), the
// version checks of index tensors and masks (Note [Saved indices]), and the exact in-place overlap
// check (Note [Internal overlap]).
#include <set>

#include "gradcheck.h"
#include "test_util.h"

namespace flame::test {
namespace {

Tensor leaf(const Shape& shape, uint64_t seed, DType dt = DType::f64) {
  Generator g(seed);
  return Tensor::randn(shape, 0.0, 1.0, {dt, test_device()}, &g).requires_grad_(true);
}

Tensor values(const Shape& shape, uint64_t seed, DType dt = DType::f64) {
  Generator g(seed);
  return Tensor::randn(shape, 0.0, 1.0, {dt, test_device()}, &g);
}

// ---- recording: the destination (and the base of a view destination) joins the graph ----

TEST(AutogradInplace, AddIntoTensorWithoutGradJoinsTheGraph) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = leaf({3, 4}, 1);
  Tensor h = Tensor::zeros({3, 4}, {DType::f64, test_device()});
  h += a;
  EXPECT_TRUE(h.requires_grad());
  EXPECT_FALSE(h.is_leaf());
  EXPECT_EQ(h.grad_fn_name(), "AddBackward");
  Tensor c = values({3, 4}, 2);
  Gradients g = (h * c).sum().backward();
  ASSERT_TRUE(g.contains(a));
  EXPECT_TRUE(all_close(g.get(a), c, 1e-12, 1e-12));
}

TEST(AutogradInplace, CopyIntoNarrowOfBufferJoinsTheGraph) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = leaf({2, 3}, 3);
  Tensor buf = Tensor::zeros({4, 3}, {DType::f64, test_device()});
  Tensor before = buf.narrow(0, 1, 2);  // a view made before the write: rows 1..2
  buf.narrow(0, 0, 2).copy_(a * 2.0);
  EXPECT_TRUE(buf.requires_grad());
  Tensor c = values({4, 3}, 4), d = values({2, 3}, 5), e = values({2, 3}, 6);
  // Reads of the base, of the written view and of the older view all see the new history.
  Tensor loss = (buf * c).sum() + (buf.narrow(0, 0, 2) * d).sum() + (before * e).sum();
  Gradients g = loss.backward();
  ASSERT_TRUE(g.contains(a));
  NoGradGuard ng;
  Tensor want = (c.narrow(0, 0, 2) + d) * 2.0;
  want.narrow(0, 1, 1).add_(e.narrow(0, 0, 1) * 2.0);  // row 1 of buf is row 0 of `before`
  EXPECT_TRUE(all_close(g.get(a), want, 1e-12, 1e-12));
  // And the values were written.
  EXPECT_TRUE(all_close(buf.narrow(0, 0, 2), a.detach() * 2.0, 0, 0));
  EXPECT_TRUE(all_close(buf.narrow(0, 2, 2), Tensor::zeros({2, 3}, {DType::f64, test_device()}), 0, 0));
}

TEST(AutogradInplace, OlderExpandedAndTransposedViewsSeeTheNewHistory) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = leaf({1, 3}, 24);
  Tensor buf = Tensor::zeros({1, 3}, {DType::f64, test_device()});
  Tensor wide = buf.expand({4, 3});     // stride 0: its gradient sums over the 4 rows
  Tensor turned = buf.transpose(0, 1);  // [3, 1]
  buf.copy_(a);
  EXPECT_TRUE(wide.requires_grad());
  Tensor c = values({4, 3}, 25), d = values({3, 1}, 26);
  Gradients g = ((wide * c).sum() + (turned * d).sum()).backward();
  NoGradGuard ng;
  EXPECT_TRUE(all_close(g.get(a), c.sum({0}, true) + d.transpose(0, 1), 1e-12, 1e-12));
}

TEST(AutogradInplace, InPlaceOnNonLeafIsRecorded) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = leaf({5}, 7);
  const Tensor two = Tensor::full({5}, 2.0, {DType::f64, test_device()});
  Tensor y = x * two;  // mul's rule reads only the other operand, so y's storage may be rewritten
  y.add_(1.0);
  y.mul_(3.0);
  y.sub_(x);  // x is read again after y was written: d/dx = 6 - 1
  Gradients g = y.sum().backward();
  EXPECT_TRUE(all_close(g.get(x), Tensor::full({5}, 5.0, {DType::f64, test_device()}), 1e-12, 1e-12));
  EXPECT_TRUE(all_close(y, (x.detach() * 2.0 + 1.0) * 3.0 - x.detach(), 1e-12, 1e-12));
}

TEST(AutogradInplace, LeafThatRequiresGradRaisesOutsideNoGrad) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = leaf({3, 2}, 8);
  expect_error([&] { w.add_(1.0); }, {"add_", "a leaf Variable that requires grad is being used in an in-place operation"});
  expect_error([&] { w.copy_(values({3, 2}, 9)); }, {"copy_", "leaf Variable"});
  expect_error([&] { w.narrow(0, 0, 1).mul_(2.0); }, {"mul_", "a view of a leaf Variable that requires grad"});
  const Tensor before = w.detach().clone();
  {
    NoGradGuard ng;  // an optimizer step
    w.sub_(Tensor::full({3, 2}, 0.5, {DType::f64, test_device()}));
  }
  EXPECT_TRUE(w.is_leaf());
  EXPECT_TRUE(all_close(w, before - 0.5, 1e-12, 1e-12));
}

TEST(AutogradInplace, OverwrittenSavedTensorRaisesAtBackward) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = leaf({4}, 10);
  Tensor y = x.exp();  // exp's rule saves its output
  Tensor z = y * 1.0;
  y.add_(1.0);
  expect_error([&] { (void)z.sum().backward(); }, {"modified by an in-place op"});
}

// Gradient checks of every in-place op on whole destinations and on view destinations. The
// destination's base depends on input 0 (so its old history gets the gradient outside the
// written region), the source on input 1.
enum class Dest { whole, narrow, select, transpose, slice_step };
const char* dest_name(Dest d) {
  switch (d) {
    case Dest::whole: return "whole";
    case Dest::narrow: return "narrow";
    case Dest::select: return "select";
    case Dest::transpose: return "transpose";
    case Dest::slice_step: return "slice_step";
  }
  return "?";
}
Tensor dest_of(Tensor& buf, Dest d) {
  switch (d) {
    case Dest::whole: return buf;
    case Dest::narrow: return buf.narrow(0, 1, 2);
    case Dest::select: return buf.select(1, 2);
    case Dest::transpose: return buf.transpose(0, 1);
    case Dest::slice_step: return buf.slice(0, 0, 4, 2);
  }
  return buf;
}
Shape dest_shape(Dest d) {
  switch (d) {
    case Dest::whole: return {4, 3};
    case Dest::narrow: return {2, 3};
    case Dest::select: return {4};
    case Dest::transpose: return {3, 4};
    case Dest::slice_step: return {2, 3};
  }
  return {};
}

using InplaceFn = std::function<void(Tensor& dest, const Tensor& src)>;
struct InplaceCase {
  const char* name;
  InplaceFn fn;
};
std::vector<InplaceCase> inplace_cases() {
  return {
      {"add_", [](Tensor& d, const Tensor& s) { d.add_(s, 0.75); }},
      {"sub_", [](Tensor& d, const Tensor& s) { d.sub_(s); }},
      {"mul_", [](Tensor& d, const Tensor& s) { d.mul_(s); }},
      {"div_", [](Tensor& d, const Tensor& s) { d.div_(s * s + 0.5); }},
      {"copy_", [](Tensor& d, const Tensor& s) { d.copy_(s); }},
      {"fill_", [](Tensor& d, const Tensor&) { d.fill_(0.25); }},
      {"clamp_", [](Tensor& d, const Tensor&) { d.clamp_(-0.4, 0.6); }},
      {"add_scalar_", [](Tensor& d, const Tensor&) { d.add_(1.5); }},
      {"mul_scalar_", [](Tensor& d, const Tensor&) { d.mul_(-2.0); }},
      {"copy_broadcast", [](Tensor& d, const Tensor& s) { d.copy_(s.select(0, 0)); }},
  };
}

TEST(AutogradInplace, GradcheckEveryOpOnEveryDestination) {
  const Tensor constant = values({4, 3}, 14).to(Device::cpu());
  const Tensor scale = Tensor::full({4, 3}, 1.5, {DType::f64, Device::cpu()});
  int checked = 0;
  for (const InplaceCase& c : inplace_cases()) {
    const std::string name = c.name;
    const bool broadcast = name == "copy_broadcast";
    const bool has_source = name.find("scalar") == std::string::npos && name != "fill_" && name != "clamp_";
    for (Dest d : {Dest::whole, Dest::narrow, Dest::select, Dest::transpose, Dest::slice_step}) {
      Shape ss = dest_shape(d);
      if (broadcast) ss.insert(ss.begin(), 2);  // the source's row 0 is broadcast over the destination
      const Tensor x = values({4, 3}, 11).to(Device::cpu()), s = values(ss, 12).to(Device::cpu());
      // The destination's base requires grad (through input 0); the source is input 1.
      auto through_base = [&](const TensorList& in) {
        Tensor buf = in[0] * scale;  // a binary mul: its rule does not read buf's storage again
        Tensor dst = dest_of(buf, d);
        c.fn(dst, in[1]);
        return buf.square();  // nonlinear, so the values written matter too
      };
      GradcheckResult r = gradcheck(through_base, {x, s});
      EXPECT_TRUE(r.ok) << name << " into " << dest_name(d) << ": " << r.message;
      EXPECT_GT(r.checked, 0);
      ++checked;
      if (!has_source) continue;
      // A base that does not require grad, written from a source that does.
      auto constant_base = [&](const TensorList& in) {
        Tensor buf = constant.clone();
        Tensor dst = dest_of(buf, d);
        c.fn(dst, in[0]);
        return buf * buf.sum();
      };
      GradcheckResult r2 = gradcheck(constant_base, {s});
      EXPECT_TRUE(r2.ok) << name << " into " << dest_name(d) << " of a constant base: " << r2.message;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 10 * 5 + 6 * 5);
}

// ---- every saved index tensor and mask is version-checked ----

// Builds a graph reading `buf` as indices (or a mask), refills buf in place under NoGradGuard
// (as a data loader reusing its batch buffer would), and expects backward to raise naming the op.
void expect_refill_caught(const char* op, const std::function<Tensor(const Tensor& x, const Tensor& buf)>& build,
                          Tensor buf, const Tensor& refill, const Shape& x_shape) {
  Tensor x = leaf(x_shape, 20);
  Tensor y = build(x, buf);
  {
    NoGradGuard ng;
    buf.copy_(refill);
  }
  expect_error([&] { (void)y.sum().backward(); }, {op, "modified by an in-place op"});
}

TEST(AutogradInplace, RefilledIndexBufferRaisesAtBackward) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  auto i64 = [&](std::vector<int64_t> v, Shape s) { return Tensor::from_vec(v, s, dev); };
  expect_refill_caught(
      "index_select", [](const Tensor& x, const Tensor& idx) { return x.index_select(0, idx); }, i64({0, 2}, {2}),
      i64({1, 1}, {2}), {3, 4});
  expect_refill_caught(
      "index_select", [](const Tensor& w, const Tensor& idx) { return embedding(w, idx); }, i64({3, 0, 3}, {3}),
      i64({1, 2, 1}, {3}), {5, 2});
  expect_refill_caught(
      "gather", [](const Tensor& x, const Tensor& idx) { return x.gather(1, idx); }, i64({0, 2, 1, 1}, {2, 2}),
      i64({2, 2, 0, 0}, {2, 2}), {2, 3});
  expect_refill_caught(
      "scatter", [](const Tensor& x, const Tensor& idx) { return x.scatter(1, idx, x.narrow(1, 0, 2) * 2.0); },
      i64({0, 2, 1, 0}, {2, 2}), i64({2, 1, 0, 2}, {2, 2}), {2, 3});
  expect_refill_caught(
      "scatter_add",
      [](const Tensor& x, const Tensor& idx) { return x.scatter_add(1, idx, x.narrow(1, 0, 2) * 2.0); },
      i64({0, 2, 1, 0}, {2, 2}), i64({2, 1, 0, 2}, {2, 2}), {2, 3});
  auto mask = Tensor::from_vec(std::vector<bool>{true, false, true, false, false, true}, {2, 3}, dev);
  auto other = Tensor::from_vec(std::vector<bool>{false, true, false, true, true, false}, {2, 3}, dev);
  expect_refill_caught(
      "masked_select", [](const Tensor& x, const Tensor& m) { return x.masked_select(m); }, mask.clone(), other,
      {2, 3});
  expect_refill_caught(
      "where", [](const Tensor& x, const Tensor& m) { return where(m, x, x * 3.0); }, mask.clone(), other, {2, 3});
  expect_refill_caught(
      "where", [](const Tensor& x, const Tensor& m) { return masked_fill(x, m, 0.5); }, mask.clone(), other, {2, 3});
}

TEST(AutogradInplace, WrittenSortIndicesRaiseAtBackward) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = leaf({6}, 21);
  auto [v, idx] = x.sort(0);
  {
    NoGradGuard ng;
    idx.fill_(0);
  }
  expect_error([&] { (void)v.sum().backward(); }, {"sort", "modified by an in-place op"});
}

TEST(AutogradInplace, TakeKeepsItsOwnIndexSoARefillCannotMisroute) {
  FLAME_SKIP_IF_NO_DEVICE();
  // take converts its index before use: the gradient follows the index as it was at the call.
  Tensor x = leaf({2, 3}, 22);
  Tensor idx = Tensor::from_vec(std::vector<int64_t>{5, 0, -1}, {3}, test_device());
  Tensor y = x.take(idx);
  {
    NoGradGuard ng;
    idx.fill_(1);
  }
  Tensor c = values({3}, 23);
  Gradients g = (y * c).sum().backward();
  const auto cv = c.to_vec<double>();
  std::vector<double> want(6, 0.0);
  want[5] += cv[0];
  want[0] += cv[1];
  want[5] += cv[2];
  EXPECT_TRUE(all_close(g.get(x), Tensor::from_vec(want, {2, 3}, test_device()), 1e-12, 1e-12));
}

// ---- in-place writes refuse destinations whose elements overlap, exactly ----

bool overlaps_by_enumeration(const Tensor& t) {
  std::set<int64_t> seen;
  const int64_t n = t.numel();
  for (int64_t f = 0; f < n; ++f) {
    int64_t rest = f, off = 0;
    for (int64_t d = t.dim() - 1; d >= 0; --d) {
      off += (rest % t.size(d)) * t.stride(d);
      rest /= t.size(d);
    }
    if (!seen.insert(off).second) return true;
  }
  return false;
}

TEST(AutogradInplace, UnfoldWithOverlappingWindowsRefusesInPlace) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = values({10}, 30, DType::f32);
  expect_error([&] { x.unfold(0, 3, 1).add_(1.0); }, {"add_", "overlap"});
  expect_error([&] { x.unfold(0, 3, 2).fill_(0.0); }, {"fill_", "overlap"});
  expect_error([&] { x.unfold(0, 4, 2).copy_(Tensor::zeros({4, 4}, test_device())); }, {"copy_", "overlap"});
  expect_error([&] { Tensor::zeros({3, 1}, test_device()).expand({3, 4}).mul_(2.0); }, {"mul_", "overlap"});
  // Strides {3, 2} for sizes {3, 4}: no stride dominates the others' span and none is a small
  // multiple of another, yet offsets 6 = 2 * 3 = 3 * 2 repeat: only an exact check sees it.
  Tensor y = values({13}, 31, DType::f32);
  Tensor tricky = y.unfold(0, 7, 3).slice(1, 0, 7, 2);
  ASSERT_EQ(tricky.sizes(), (Shape{3, 4}));
  expect_error([&] { tricky.add_(1.0); }, {"add_", "overlap"});
}

TEST(AutogradInplace, NonOverlappingStridedViewsAreWritable) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = values({4, 5, 6}, 32, DType::f32);
  const Tensor before = x.clone();
  x.permute({2, 0, 1}).add_(1.0);
  x.slice(1, 0, 5, 2).transpose(0, 2).mul_(2.0);
  Tensor want = before + 1.0;
  want.slice(1, 0, 5, 2).mul_(2.0);
  EXPECT_TRUE(all_close(x, want, 1e-6, 1e-6));
  // Strides {3, 2} for sizes {2, 3}: offsets {0, 2, 4, 3, 5, 7} are distinct although the
  // stride-3 dim does not exceed the span (4) of the stride-2 dim.
  Tensor y = values({8}, 33, DType::f32);
  const Tensor y_before = y.clone();
  Tensor v = y.unfold(0, 5, 3).slice(1, 0, 5, 2);
  ASSERT_EQ(v.sizes(), (Shape{2, 3}));
  v.add_(10.0);
  const auto got = y.to_vec<float>(), old = y_before.to_vec<float>();
  for (int i = 0; i < 8; ++i) {
    const bool written = i == 0 || i == 2 || i == 3 || i == 4 || i == 5 || i == 7;
    EXPECT_NEAR(got[i], old[i] + (written ? 10.0f : 0.0f), 1e-5) << "element " << i;
  }
  // Non-overlapping windows (step >= size).
  Tensor z = values({12}, 34, DType::f32);
  z.unfold(0, 3, 3).zero_();
  EXPECT_TRUE(all_close(z, Tensor::zeros({12}, test_device()), 0, 0));
}

TEST(AutogradInplace, OverlapCheckAgreesWithEnumerationOnRandomWindows) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = Tensor::zeros({96}, test_device());
  Generator gen(35);
  int overlapping = 0, disjoint = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const auto r = Tensor::randint(1, 7, {4}, {DType::i64, Device::cpu()}, &gen).to_vec<int64_t>();
    const int64_t size = r[0], step = r[1], slice_step = 1 + r[2] % 3;
    Tensor v = x.unfold(0, size, step).slice(1, 0, size, slice_step);
    if (r[3] % 2) v = v.transpose(0, 1);
    const bool want = overlaps_by_enumeration(v);
    bool raised = false;
    try {
      v.add_(1.0);
    } catch (const Error&) {
      raised = true;
    }
    EXPECT_EQ(raised, want) << "sizes " << shape_str(v.sizes()) << " strides " << shape_str(v.strides());
    (want ? overlapping : disjoint) += 1;
  }
  EXPECT_GT(overlapping, 20);
  EXPECT_GT(disjoint, 20);
}

}  // namespace
}  // namespace flame::test
