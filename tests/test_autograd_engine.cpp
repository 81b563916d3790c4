// The backward engine and the rules' bookkeeping: grad_fn names, what nodes save, graph
// lifetimes (hooks, deep chains, threads), precision of rules, no silent higher-order gradients,
// and gradients that pass through add and views without a copy.
#include <atomic>
#include <cmath>
#include <thread>

#include "gradcheck.h"
#include "test_util.h"

namespace flame::test {
namespace {

Tensor leaf(const Shape& shape, uint64_t seed, DType dt = DType::f32) {
  Generator g(seed);
  return Tensor::randn(shape, 0.0, 1.0, {dt, test_device()}, &g).requires_grad_(true);
}

std::size_t bytes_of(const Tensor& t) { return static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype()); }

// Note [Backward order]: the ready node recorded last runs first. A network whose layers each also
// read a side branch of a shared input (a DiT block's adaLN projection of the conditioning) gets
// each layer's parameters complete before the previous layer's, side branch included, rather than
// the side branches after a depth-first walk down the main chain (what DDP's buckets rely on).
TEST(AutogradEngine, ParametersCompleteLayerByLayer) {
  constexpr int kLayers = 4;
  Generator gen(31);
  Tensor c = Tensor::randn({2, 3}, 0.0, 1.0, DType::f32, &gen).requires_grad_(true);
  Tensor x = Tensor::randn({2, 3}, 0.0, 1.0, DType::f32, &gen);
  std::vector<Tensor> main_w, side_w;
  std::vector<std::string> order;
  for (int i = 0; i < kLayers; ++i) {
    main_w.push_back(Tensor::randn({3, 3}, 0.0, 0.5, DType::f32, &gen).requires_grad_(true));
    side_w.push_back(Tensor::randn({3, 3}, 0.0, 0.5, DType::f32, &gen).requires_grad_(true));
    main_w.back().register_post_accumulate_grad_hook([&order, i](const Tensor&) { order.push_back("main" + std::to_string(i)); });
    side_w.back().register_post_accumulate_grad_hook([&order, i](const Tensor&) { order.push_back("side" + std::to_string(i)); });
  }
  Tensor h = x;
  for (int i = 0; i < kLayers; ++i) {
    const Tensor mod = c.silu().matmul(side_w[i]);  // recorded before the layer's main op
    h = h + (h.matmul(main_w[i]) * mod).tanh();
  }
  (void)h.square().sum().backward();
  const std::vector<std::string> want = {"main3", "side3", "main2", "side2", "main1", "side1", "main0", "side0"};
  EXPECT_EQ(order, want);
}

TEST(AutogradEngine, GradFnNamesFollowPyTorch) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = leaf({2, 3}, 1), b = leaf({2, 3}, 2), m = leaf({3, 4}, 3);
  EXPECT_EQ((a * b).grad_fn_name(), "MulBackward");
  EXPECT_EQ((a * 2.0).grad_fn_name(), "MulBackward");
  EXPECT_EQ((a + b).grad_fn_name(), "AddBackward");
  EXPECT_EQ((a - b).grad_fn_name(), "SubBackward");
  EXPECT_EQ((a / b).grad_fn_name(), "DivBackward");
  EXPECT_EQ(a.exp().grad_fn_name(), "ExpBackward");
  EXPECT_EQ(a.relu().grad_fn_name(), "ReluBackward");
  EXPECT_EQ(a.tanh().grad_fn_name(), "TanhBackward");
  EXPECT_EQ(a.sum().grad_fn_name(), "SumBackward");
  EXPECT_EQ(a.mean().grad_fn_name(), "MeanBackward");
  EXPECT_EQ(a.softmax(1).grad_fn_name(), "SoftmaxBackward");
  EXPECT_EQ(a.cumsum(1).grad_fn_name(), "CumsumBackward");
  EXPECT_EQ(a.matmul(m).grad_fn_name(), "MmBackward");
  EXPECT_EQ(a.view({3, 2}).grad_fn_name(), "ViewBackward");
  EXPECT_EQ(a.transpose(0, 1).grad_fn_name(), "TransposeBackward");
  EXPECT_EQ(a.narrow(1, 0, 2).grad_fn_name(), "NarrowBackward");
  EXPECT_EQ(a.flip({0}).grad_fn_name(), "FlipBackward");
  EXPECT_EQ(cat({a, b}, 0).grad_fn_name(), "CatBackward");
}

// Note [Node saved tensors]: each rule keeps what its formula reads, nothing more.
TEST(AutogradEngine, RulesSaveOnlyWhatTheyRead) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = leaf({64}, 4), b = leaf({64}, 5);
  Tensor frozen = leaf({64}, 6).detach();
  EXPECT_EQ(autograd_saved_bytes(a + b), 0u);
  EXPECT_EQ(autograd_saved_bytes(a - b), 0u);
  EXPECT_EQ(autograd_saved_bytes(-a), 0u);
  EXPECT_EQ(autograd_saved_bytes(a * 3.0), 0u);
  EXPECT_EQ(autograd_saved_bytes(a + 1.0), 0u);
  EXPECT_EQ(autograd_saved_bytes(a / 4.0), 0u);
  EXPECT_EQ(autograd_saved_bytes(a.sum()), 0u);
  EXPECT_EQ(autograd_saved_bytes(a.exp()), bytes_of(a));   // y only
  EXPECT_EQ(autograd_saved_bytes(a.relu()), bytes_of(a));  // y only
  EXPECT_EQ(autograd_saved_bytes(a.sin()), bytes_of(a));   // x only
  // mul keeps the other operand only for an input that needs a gradient.
  EXPECT_EQ(autograd_saved_bytes(a * frozen), bytes_of(frozen));
  EXPECT_EQ(autograd_saved_bytes(frozen * a), bytes_of(frozen));
  EXPECT_EQ(autograd_saved_bytes(a * b), bytes_of(a) + bytes_of(b));
  // A storage saved by two nodes counts once.
  Tensor e = a.exp();
  EXPECT_EQ(autograd_saved_bytes(e * e), bytes_of(e));
}

// matmul -> mul_scalar -> softmax -> matmul: the graph holds the two inputs of each matmul and
// softmax's output, nothing of the scaled scores.
TEST(AutogradEngine, AttentionChainHoldsOnlyWhatFormulasNeed) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor q = leaf({2, 16, 8}, 7), k = leaf({2, 8, 16}, 8), v = leaf({2, 16, 8}, 9);
  Tensor scores = q.matmul(k);
  Tensor p = (scores * 0.125).softmax(-1);
  Tensor out = p.matmul(v);
  const std::size_t need = bytes_of(q) + bytes_of(k) + bytes_of(p) + bytes_of(v);
  EXPECT_EQ(autograd_saved_bytes(out), need);
  // And backward still gives the right answer (closed form through the reference ops).
  Generator g(10);
  Tensor go = Tensor::randn(out.sizes(), 0.0, 1.0, test_device(), &g);
  BackwardOptions o;
  o.grad_output = go;
  Gradients grads = out.backward(o);
  Tensor pd = p.detach();
  Tensor dp = go.matmul(v.detach().transpose(-1, -2));
  Tensor ds = pd * (dp - (dp * pd).sum({-1}, true)) * 0.125;
  EXPECT_TRUE(all_close(grads.get(v), pd.transpose(-1, -2).matmul(go), 1e-4, 1e-5));
  EXPECT_TRUE(all_close(grads.get(q), ds.matmul(k.detach().transpose(-1, -2)), 1e-4, 1e-5));
  EXPECT_TRUE(all_close(grads.get(k), q.detach().transpose(-1, -2).matmul(ds), 1e-4, 1e-5));
}

// A hook that captures its own (non-leaf) tensor must not keep it alive after backward.
TEST(AutogradEngine, HookCapturingItsTensorDoesNotLeak) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = leaf({8}, 11);
  const int64_t before = live_tensor_count();
  {
    Tensor h = x * 2.0;
    int calls = 0;
    h.register_hook([h, &calls](const Tensor& g) {
      ++calls;
      EXPECT_EQ(g.sizes(), h.sizes());
      return g * 3.0;
    });
    Gradients grads = (h * h).sum().backward();
    EXPECT_EQ(calls, 1);
    // d/dx sum((2x)^2) = 8x, times 3 from the hook.
    EXPECT_TRUE(all_close(grads.get(x), x.detach() * 24.0, 1e-5, 1e-5));
  }
  EXPECT_EQ(live_tensor_count(), before);
}

// Freeing a graph unlinks it iteratively: a 300k-op chain does not overflow the stack.
TEST(AutogradEngine, DeepChainReleasesWithoutRecursion) {
  Tensor x = Tensor::randn({2}, 0.0, 1.0, DType::f32).requires_grad_(true);
  const int64_t before = live_tensor_count();
  {
    Tensor y = x;
    for (int i = 0; i < 300000; ++i) y = y + 1.0;
    EXPECT_EQ(y.grad_fn_name(), "AddBackward");
  }  // the whole graph is freed here
  EXPECT_EQ(live_tensor_count(), before);
  // Backward over a long chain is iterative too, and frees the graph as it goes.
  Tensor y = x;
  for (int i = 0; i < 100000; ++i) y = y * 1.0 + 0.5;
  Gradients g = y.sum().backward();
  for (double v : g.get(x).to_vec<double>()) EXPECT_DOUBLE_EQ(v, 1.0);
}

// Two threads build, backprop and free graphs over the same leaf parameters (run this suite under
// ThreadSanitizer, docs/autograd.md): results match a single-threaded run and nothing leaks.
TEST(AutogradEngine, ThreadsSharingLeavesReleaseGraphsSafely) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = leaf({16, 8}, 12), b = leaf({8}, 13);
  Generator gen(14);
  Tensor x = Tensor::randn({4, 16}, 0.0, 1.0, test_device(), &gen);
  Gradients ref = (x.matmul(w) + b).tanh().sum().backward();
  const int64_t before = live_tensor_count();
  std::atomic<int> mismatches{0};
  auto work = [&] {
    for (int it = 0; it < 50; ++it) {
      Tensor y = (x.matmul(w) + b).tanh().sum();
      if (it % 2 == 0) {
        Gradients g = y.backward();
        if (!all_close(g.get(w), ref.get(w), 1e-6, 1e-6) || !all_close(g.get(b), ref.get(b), 1e-6, 1e-6)) {
          ++mismatches;
        }
      }  // odd iterations drop the graph without backward
    }
  };
  std::thread t1(work), t2(work);
  t1.join();
  t2.join();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(live_tensor_count(), before);
}

// cumsum's gradient is a reversed cumulative sum; total - cumsum + g cancels catastrophically.
TEST(AutogradEngine, CumsumBackwardKeepsPrecision) {
  FLAME_SKIP_IF_NO_DEVICE();
  const int64_t n = 257;
  Tensor x = leaf({n}, 15);
  std::vector<float> gv(n);
  Generator gen(16);
  const auto small = Tensor::rand({n}, DType::f32, &gen).to_vec<float>();
  for (int64_t i = 0; i < n; ++i) gv[i] = 1.0f + small[i];
  gv[0] = 3.0e7f;  // a large first gradient: the old formula subtracted two numbers near 3e7
  BackwardOptions o;
  o.grad_output = Tensor::from_vec(gv, {n}, test_device());
  Gradients g = x.cumsum(0).backward(o);
  const auto got = g.get(x).to_vec<double>();
  double suffix = 0;  // reference in double, summed from the end
  for (int64_t i = n - 1; i >= 0; --i) {
    suffix += static_cast<double>(gv[i]);
    if (i > 0) EXPECT_NEAR(got[i], suffix, 1e-4 * suffix) << "at " << i;
  }
}

// elu's gradient for x <= 0 is alpha * exp(x); from the output (y + alpha) it cancels to zero.
TEST(AutogradEngine, EluBackwardKeepsPrecisionForNegativeInputs) {
  FLAME_SKIP_IF_NO_DEVICE();
  std::vector<float> xv = {-20.0f, -15.0f, -12.5f, -9.0f, 0.5f};
  Tensor x = Tensor::from_vec(xv, {5}, test_device()).requires_grad_(true);
  Gradients g = x.elu(1.5).sum().backward();
  const auto got = g.get(x).to_vec<double>();
  for (std::size_t i = 0; i < xv.size(); ++i) {
    const double want = xv[i] > 0 ? 1.0 : 1.5 * std::exp(static_cast<double>(xv[i]));
    EXPECT_NEAR(got[i], want, 1e-5 * want) << "x = " << xv[i];
  }
}

// Gradients cannot be differentiated again: asking raises instead of returning a partial answer.
TEST(AutogradEngine, HigherOrderGradientsRaise) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = leaf({4}, 17);
  // A backward that re-enables grad mode and reads a tensor requiring grad: the nodes it records
  // would make a partial second-order graph.
  Tensor inner;  // what the custom backward computed, with the history it recorded
  CustomFunction sq{"square_with_grad_mode",
                    [](const TensorList& in) { return in[0] * in[0]; },
                    [&x, &inner](const TensorList&, const Tensor&, const Tensor& g) {
                      EnableGradGuard enable;
                      inner = g * x * 2.0;
                      return TensorList{inner};
                    }};
  Gradients g = apply_custom(sq, {x}).sum().backward();
  Tensor gx = g.get(x);
  ASSERT_TRUE(gx.defined());
  EXPECT_TRUE(all_close(gx, x.detach() * 2.0, 1e-6, 1e-6));
  // The store holds a plain buffer (Note [Gradient ownership]); the recorded history raises.
  EXPECT_FALSE(gx.requires_grad());
  ASSERT_TRUE(inner.requires_grad());
  expect_error([&] { (void)inner.sum().backward(); }, {"higher-order", "MulBackward"});
  // A seed that requires grad would be silently cut off from the result: raise.
  BackwardOptions o;
  o.grad_output = leaf({4}, 18);
  expect_error([&] { (void)(x * 3.0).backward(o); }, {"backward", "higher-order"});
}

// add and same-shape views hand the incoming gradient on as it is (no kernel, no copy), and
// summing several contributions never writes into a tensor the caller passed in.
TEST(AutogradEngine, PassThroughNodesDoNotCopy) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = leaf({3, 4}, 19), w = leaf({3, 4}, 20);
  Tensor h = x * 2.0;
  const void* seen = nullptr;
  h.register_hook([&seen](const Tensor& g) {
    seen = g.data_ptr();
    return Tensor();
  });
  Tensor y = (h + w).view({12}).view({3, 4});
  Generator gen(21);
  Tensor go = Tensor::randn({3, 4}, 0.0, 1.0, test_device(), &gen);
  const auto go_before = go.to_vec<float>();
  BackwardOptions o;
  o.grad_output = go;
  Gradients g = y.backward(o);
  EXPECT_EQ(seen, go.data_ptr());
  EXPECT_TRUE(all_close(g.get(x), go * 2.0, 1e-6, 1e-6));
  // Three uses of x through add: contributions are summed, go itself is never written.
  Tensor z = x + x + x;
  BackwardOptions o2;
  o2.grad_output = go;
  Gradients g2 = z.backward(o2);
  EXPECT_EQ(go.to_vec<float>(), go_before);
  EXPECT_TRUE(all_close(g2.get(x), go * 3.0, 1e-6, 1e-6));
}

// A tensor used many times gets the sum of its contributions, in a graph mixing pass-through and
// computing nodes (the in-place summation of pending gradients).
TEST(AutogradEngine, RepeatedUsesSumCorrectly) {
  TensorList in = {Tensor::randn({3, 2}, 0.0, 1.0, DType::f64)};
  GradcheckResult r = gradcheck(
      [](const TensorList& v) {
        const Tensor& x = v[0];
        Tensor h = x.sin();
        Tensor s = h + h;  // same tensor twice through a pass-through node
        return s * h + h.exp() + (h + x) * x;
      },
      in);
  EXPECT_TRUE(r.ok) << r.message;
}

}  // namespace
}  // namespace flame::test
