// The Gradients store owns its buffers (Note [Gradient ownership] in src/autograd/engine.cpp): no
// two entries share storage, no entry aliases a tensor the caller passed in or still holds, and
// nothing is copied when the store is the only holder. Runs on the device under test.
#include <type_traits>

#include "op_table.h"
#include "test_util.h"

namespace flame::test {
namespace {

Tensor leaf(const Shape& shape, uint64_t seed, DType dt = DType::f32) {
  Generator g(seed);
  return Tensor::randn(shape, 0.0, 1.0, {dt, test_device()}, &g).requires_grad_(true);
}

Tensor snapshot(const Tensor& t) {
  NoGradGuard no_grad;
  return t.detach().clone();
}

TEST(GradOwnership, SumOfSumsGivesSeparateBuffers) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = leaf({3, 4}, 1), b = leaf({3, 4}, 2), c = leaf({3, 4}, 3);
  Gradients g = ((a + b) * c).sum().backward();
  Tensor ga = g.get(a), gb = g.get(b);
  ASSERT_TRUE(ga.defined() && gb.defined());
  EXPECT_FALSE(ga.shares_storage(gb));
  const Tensor gb_before = snapshot(gb), c_before = snapshot(c);
  g.get(a).mul_(0.5);
  EXPECT_TRUE(all_close(g.get(b), gb_before, 0, 0));
  EXPECT_TRUE(all_close(g.get(a), gb_before * 0.5, 1e-6, 1e-7));
  EXPECT_TRUE(all_close(c, c_before, 0, 0));
}

TEST(GradOwnership, ReshapedLeafDoesNotAliasGradOutput) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = leaf({2, 3}, 4);
  Generator gen(5);
  Tensor go = Tensor::randn({6}, 0.0, 1.0, {DType::f32, test_device()}, &gen);
  const Tensor go_before = snapshot(go);
  BackwardOptions o;
  o.grad_output = go;
  Gradients g = x.reshape({6}).backward(o);
  ASSERT_TRUE(g.contains(x));
  EXPECT_FALSE(g.get(x).shares_storage(go));
  g.at(x).mul_(-3.0);
  EXPECT_TRUE(all_close(go, go_before, 0, 0));

  // backward() of a leaf itself: the seed is the caller's tensor.
  BackwardOptions o2;
  o2.grad_output = go.reshape({2, 3});
  Gradients g2 = x.backward(o2);
  EXPECT_FALSE(g2.get(x).shares_storage(go));
}

TEST(GradOwnership, HookResultIsCopiedNotAliased) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = leaf({4}, 6);
  Generator gen(7);
  Tensor kept = Tensor::randn({4}, 0.0, 1.0, {DType::f32, test_device()}, &gen);
  const Tensor kept_before = snapshot(kept);
  x.register_hook([kept](const Tensor&) { return kept; });
  Gradients g = (x * 2.0).sum().backward();
  EXPECT_FALSE(g.get(x).shares_storage(kept));
  EXPECT_TRUE(all_close(g.get(x), kept_before, 0, 0));
  g.at(x).zero_();
  EXPECT_TRUE(all_close(kept, kept_before, 0, 0));
}

TEST(GradOwnership, FreshGradientIsAdoptedWithoutCopy) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = leaf({8, 5}, 8);
  Generator gen(9);
  Tensor x = Tensor::randn({3, 8}, 0.0, 1.0, {DType::f32, test_device()}, &gen);
  const void* seen = nullptr;
  w.register_hook([&seen](const Tensor& g) {
    seen = g.data_ptr();
    return Tensor();
  });
  Gradients g = x.matmul(w).sum().backward();
  ASSERT_NE(seen, nullptr);
  EXPECT_EQ(g.get(w).data_ptr(), seen) << "the matmul's weight gradient was copied into the store";
}

TEST(GradOwnership, AccumulateAddsInPlaceUnlessSomeoneHoldsTheBuffer) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = leaf({5, 2}, 10);
  Generator gen(11);
  Tensor x = Tensor::randn({4, 5}, 0.0, 1.0, {DType::f32, test_device()}, &gen);
  Gradients store;
  BackwardOptions o;
  o.accumulate_into = &store;
  (void)(x.matmul(w)).sum().backward(o);
  const Tensor first = snapshot(store.get(w));
  const void* buffer = store.get(w).data_ptr();
  (void)(x.matmul(w)).sum().backward(o);
  EXPECT_EQ(store.get(w).data_ptr(), buffer) << "accumulation rebound an exclusively held buffer";
  EXPECT_TRUE(all_close(store.get(w), first * 2.0, 1e-6, 1e-6));

  // A handle taken from get() keeps its values: the next accumulation goes to a fresh buffer.
  Tensor held = store.get(w);
  (void)(x.matmul(w)).sum().backward(o);
  EXPECT_TRUE(all_close(held, first * 2.0, 1e-6, 1e-6));
  EXPECT_TRUE(all_close(store.get(w), first * 3.0, 1e-6, 1e-6));
  EXPECT_FALSE(store.get(w).shares_storage(held));
}

TEST(GradOwnership, AccumulatedEntriesStaySeparate) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = leaf({6}, 15), b = leaf({6}, 16);
  Gradients store;
  BackwardOptions o;
  o.accumulate_into = &store;
  for (int step = 0; step < 3; ++step) (void)(a + b).sum().backward(o);
  EXPECT_FALSE(store.get(a).shares_storage(store.get(b)));
  const Tensor three = Tensor::full({6}, 3.0, test_device());
  store.at(a).mul_(2.0);
  EXPECT_TRUE(all_close(store.get(a), three * 2.0, 0, 0));
  EXPECT_TRUE(all_close(store.get(b), three, 0, 0));
}

TEST(GradOwnership, SetCopiesWhatTheCallerHoldsAndAdoptsRvalues) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor p = leaf({3}, 12);
  Gradients g;
  Tensor mine = Tensor::full({3}, 2.0, {DType::f32, test_device()});
  g.set(p, mine);
  EXPECT_FALSE(g.get(p).shares_storage(mine));
  mine.fill_(5.0);
  EXPECT_TRUE(all_close(g.get(p), Tensor::full({3}, 2.0, {DType::f32, test_device()}), 0, 0));

  Tensor fresh = Tensor::full({3}, 7.0, {DType::f32, test_device()});
  const void* ptr = fresh.data_ptr();
  g.set(p, std::move(fresh));
  EXPECT_EQ(g.get(p).data_ptr(), ptr);

  g.accumulate(p, mine);  // const&: added, never adopted
  EXPECT_TRUE(all_close(g.get(p), Tensor::full({3}, 12.0, {DType::f32, test_device()}), 0, 0));
  EXPECT_FALSE(g.get(p).shares_storage(mine));
}

// entries() is a read-only range: it cannot be cleared or resized behind the index's back.
template <class G>
concept CanClearEntries = requires(G& g) { g.entries().clear(); };
template <class G>
concept CanAssignEntryGrad = requires(G& g, Tensor t) { g.entries()[0].grad = t; };
static_assert(!CanClearEntries<Gradients>, "Gradients::entries() must not expose the indexed vector");
static_assert(!CanAssignEntryGrad<Gradients>, "entries must be edited through at()/set()");

TEST(GradOwnership, EntriesAreAReadOnlyViewInArrivalOrder) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = leaf({2}, 13), b = leaf({3}, 14);
  Gradients g = (a.sum() * 2.0 + b.sum()).backward();
  ASSERT_EQ(g.entries().size(), 2u);
  int found = 0;
  for (const auto& e : g.entries()) {
    if (e.tensor.is_same(a)) {
      found += 1;
      EXPECT_TRUE(all_close(e.grad, Tensor::full({2}, 2.0, test_device()), 0, 0));
    }
    if (e.tensor.is_same(b)) {
      found += 2;
      EXPECT_TRUE(all_close(e.grad, Tensor::full({3}, 1.0, test_device()), 0, 0));
    }
  }
  EXPECT_EQ(found, 3);
  g.erase(a);
  EXPECT_EQ(g.entries().size(), 1u);
  EXPECT_TRUE(g.get(b).defined());
  EXPECT_FALSE(g.contains(a));
}

// For every differentiable op-table case: run backward with a random grad_output, then halve each
// entry in place and check that nothing else moved: no other entry, no input, not grad_output.
TEST(GradOwnership, EditingOneEntryChangesNothingElseForEveryOpFamily) {
  FLAME_SKIP_IF_NO_DEVICE();
  int cases = 0;
  for (const OpCase& c : op_table()) {
    if (!c.differentiable) continue;
    // The f32 rows (as the gradient checks take them), run in f32 so that every case also runs
    // on CUDA; halving is exact in any floating dtype.
    bool f32_row = false;
    for (const InputSpec& s : c.inputs) {
      if (is_floating(s.dtype)) {
        f32_row = s.dtype == DType::f32;
        break;
      }
    }
    if (!f32_row) continue;
    TensorList in;
    for (std::size_t i = 0; i < c.inputs.size(); ++i) {
      Tensor t = make_input(c.inputs[i], test_device(), 2000 + 31 * i).detach();
      if (is_floating(t.dtype())) t.requires_grad_(true);
      in.push_back(t);
    }
    Tensor out = c.run(in);
    if (!out.requires_grad()) continue;
    Generator gen(77);
    Tensor go = Tensor::randn(out.sizes(), 0.0, 1.0, {out.dtype(), out.device()}, &gen);
    BackwardOptions o;
    o.grad_output = go;
    Gradients g = out.backward(o);
    ++cases;
    std::vector<Tensor> grads, before;
    for (const auto& e : g.entries()) grads.push_back(e.grad);
    for (const Tensor& t : grads) before.push_back(snapshot(t));
    std::vector<Tensor> in_before;
    for (const Tensor& t : in) in_before.push_back(snapshot(t));
    const Tensor go_before = snapshot(go);
    for (std::size_t i = 0; i < grads.size(); ++i) {
      for (std::size_t j = 0; j < grads.size(); ++j) {
        EXPECT_TRUE(i == j || !grads[i].shares_storage(grads[j])) << c.name << ": entries " << i << ", " << j;
      }
      EXPECT_FALSE(grads[i].shares_storage(go)) << c.name << ": entry " << i << " aliases grad_output";
      for (const Tensor& t : in) EXPECT_FALSE(grads[i].shares_storage(t)) << c.name << ": entry aliases an input";
    }
    grads.clear();
    const std::size_t n = g.entries().size();
    for (std::size_t k = 0; k < n; ++k) {
      const Tensor key = g.entries()[k].tensor;
      g.at(key).mul_(0.5);
      for (std::size_t j = 0; j < n; ++j) {
        const Tensor want = j <= k ? before[j] * 0.5 : before[j];
        EXPECT_TRUE(all_close(g.entries()[j].grad, want, 0, 0)) << c.name << ": editing entry " << k
                                                                 << " changed entry " << j;
      }
    }
    for (std::size_t i = 0; i < in.size(); ++i) EXPECT_TRUE(all_close(in[i], in_before[i], 0, 0)) << c.name;
    EXPECT_TRUE(all_close(go, go_before, 0, 0)) << c.name << ": grad_output changed";
  }
  EXPECT_GT(cases, 100);
}

}  // namespace
}  // namespace flame::test
