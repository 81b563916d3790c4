// Gradient checkpointing: every tensor the checkpointed function reads gets its gradient, whether
// it is passed as an input or captured by the lambda (Note [Checkpoint captures]); and the engine
// option it relies on, BackwardOptions::inputs.
#include "gradcheck.h"
#include "test_util.h"

namespace flame::test {
namespace {

Tensor randn64(const Shape& shape, uint64_t seed) {
  Generator g(seed);
  return Tensor::randn(shape, 0.0, 1.0, DType::f64, &g);
}

Tensor leaf(const Shape& shape, uint64_t seed, DType dt = DType::f32) {
  Generator g(seed);
  return Tensor::randn(shape, 0.0, 1.0, {dt, test_device()}, &g).requires_grad_(true);
}

// A 2-layer block whose weights are captured, as a transformer block's are: only x is an input.
TEST(Checkpoint, CapturedWeightsPassGradcheck) {
  TensorList in = {randn64({3, 5}, 1), randn64({5, 4}, 2), randn64({4}, 3), randn64({4, 5}, 4)};
  GradcheckResult r = gradcheck(
      [](const TensorList& v) {
        // Captured by value: the recompute runs during backward, after this function returned.
        Tensor w1 = v[1], b1 = v[2], w2 = v[3];
        auto block = [w1, b1, w2](const TensorList& x) { return (x[0].matmul(w1) + b1).tanh().matmul(w2).sigmoid(); };
        return checkpoint(block, {v[0]});
      },
      in);
  EXPECT_TRUE(r.ok) << r.message;
  EXPECT_EQ(r.checked, 15 + 20 + 4 + 20);
}

// A captured non-leaf (a weight computed outside the block): its gradient goes through its own
// history exactly once, and the block's inner backward does not walk that history itself.
TEST(Checkpoint, CapturedNonLeafGetsGradientOnce) {
  TensorList in = {randn64({2, 3}, 5), randn64({3, 3}, 6), randn64({3}, 7)};
  GradcheckResult r = gradcheck(
      [](const TensorList& v) {
        Tensor w = v[1] * 1.5 + v[2];  // non-leaf, made outside fn
        auto block = [w](const TensorList& x) { return x[0].matmul(w).exp() * w.sum(); };
        return checkpoint(block, {v[0]}) + w.mean();  // w also used outside the checkpoint
      },
      in);
  EXPECT_TRUE(r.ok) << r.message;
}

// Only captured tensors require grad (the input does not): the block still takes part.
TEST(Checkpoint, OnlyCapturedTensorsRequireGrad) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = leaf({4, 6}, 11).detach();
  Tensor w = leaf({6, 3}, 12);
  auto block = [&](const TensorList& in) { return in[0].matmul(w).relu(); };
  Gradients plain = block({x}).square().sum().backward();
  Tensor y = checkpoint(block, {x});
  ASSERT_TRUE(y.requires_grad());
  EXPECT_EQ(y.grad_fn_name(), "CheckpointBackward");
  Gradients ck = y.square().sum().backward();
  ASSERT_TRUE(ck.get(w).defined());
  EXPECT_TRUE(all_close(ck.get(w), plain.get(w), 1e-5, 1e-6));
}

TEST(Checkpoint, DropoutInsideMatchesPlainRun) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor w1 = leaf({6, 6}, 21), w2 = leaf({6, 6}, 22);
  Tensor x = leaf({4, 6}, 23);
  Generator gen(99);
  auto block = [&](const TensorList& in) {  // weights captured, dropout drawn from gen
    Tensor h = in[0].matmul(w1).gelu();
    Tensor mask = Tensor::bernoulli({4, 6}, 0.7, {DType::f32, dev}, &gen);
    return (h * mask / 0.7).matmul(w2).tanh();
  };
  gen.manual_seed(5);
  Gradients plain = block({x}).sum().backward();
  gen.manual_seed(5);
  Tensor y = checkpoint(block, {x}, &gen);
  // Draws after the checkpoint must not change the recompute (the generator is restored).
  (void)Tensor::bernoulli({16}, 0.5, {DType::f32, dev}, &gen);
  Gradients ck = y.sum().backward();
  for (const Tensor& t : {x, w1, w2}) {
    ASSERT_TRUE(ck.get(t).defined());
    EXPECT_TRUE(all_close(ck.get(t), plain.get(t), 1e-5, 1e-6));
  }
}

TEST(Checkpoint, NestedCheckpointsPassGradcheck) {
  TensorList in = {randn64({2, 4}, 31), randn64({4, 4}, 32), randn64({4, 4}, 33), randn64({4}, 34)};
  GradcheckResult r = gradcheck(
      [](const TensorList& v) {
        Tensor w_outer = v[1], w_inner = v[2], b = v[3];
        auto inner = [w_inner, b](const TensorList& x) { return (x[0].matmul(w_inner) + b).tanh(); };
        auto outer = [w_outer, inner](const TensorList& x) {
          Tensor h = x[0].matmul(w_outer).sin();
          return checkpoint(inner, {h}) * h;
        };
        return checkpoint(outer, {v[0]});
      },
      in);
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(Checkpoint, CapturedTensorWrittenBeforeBackwardRaises) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = leaf({3, 4}, 41);
  Tensor w = leaf({4, 4}, 42);
  Tensor y = checkpoint([&](const TensorList& in) { return in[0].matmul(w).tanh(); }, {x});
  {
    NoGradGuard no_grad;
    w.mul_(2.0);
  }
  expect_error([&] { (void)y.sum().backward(); }, {"checkpoint", "modified by an in-place op"});
}

// BackwardOptions::inputs: gradients for the listed tensors only, non-leaves included, and the walk
// stops there (the history behind a listed non-leaf is not visited).
TEST(Checkpoint, BackwardInputsStopsAtListedTensors) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = leaf({5}, 51), w = leaf({5}, 52);
  Tensor h = x.exp();  // non-leaf
  Tensor y = (h * w).sum();
  BackwardOptions o;
  o.inputs = {h};
  o.retain_graph = true;
  Gradients g = y.backward(o);
  EXPECT_EQ(g.size(), 1u);
  ASSERT_TRUE(g.get(h).defined());
  EXPECT_FALSE(g.contains(x));
  EXPECT_FALSE(g.contains(w));
  EXPECT_TRUE(all_close(g.get(h), w.detach(), 1e-6, 1e-6));
  // h's own node was not run: a plain backward afterwards still works (nothing was released).
  Gradients all = y.backward();
  EXPECT_TRUE(all_close(all.get(x), (w * x.exp()).detach(), 1e-5, 1e-6));
}

}  // namespace
}  // namespace flame::test
