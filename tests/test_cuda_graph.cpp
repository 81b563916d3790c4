// cuda::Graph capture and replay (src/backend/cuda/graph.cu, Note [Graph-private pool],
// Note [Graph-safe RNG], docs/streams.md). Every case skips without a GPU; suite CudaGraph.
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "test_util.h"

namespace flame::test {
namespace {

const Device kCuda = Device::cuda(0);

Tensor random_cpu(const Shape& shape, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  Generator g(seed);
  return Tensor::uniform(shape, lo, hi, {DType::f32, Device::cpu()}, &g);
}

// A two-layer MLP with dropout; the parameters are leaves on the GPU.
struct Mlp {
  Tensor w1, b1, w2, b2;
  explicit Mlp(uint64_t seed) {
    w1 = (random_cpu({16, 32}, seed) * 0.5f).to(kCuda).requires_grad_(true);
    b1 = (random_cpu({32}, seed + 1) * 0.1f).to(kCuda).requires_grad_(true);
    w2 = (random_cpu({32, 8}, seed + 2) * 0.5f).to(kCuda).requires_grad_(true);
    b2 = (random_cpu({8}, seed + 3) * 0.1f).to(kCuda).requires_grad_(true);
  }
};

struct StepOut {
  Tensor loss, gw1, gb1, gw2, gb2;
};

// Forward (matmul, add, relu, dropout from bernoulli + mul, mse loss) and backward.
StepOut step(const Mlp& m, const Tensor& x, const Tensor& y, Generator& gen) {
  const double keep = 0.7;
  Tensor h = (x.matmul(m.w1) + m.b1).relu();
  const Tensor mask = Tensor::bernoulli(h.sizes(), keep, {DType::f32, kCuda}, &gen);
  h = h * mask * static_cast<float>(1.0 / keep);
  const Tensor out = h.matmul(m.w2) + m.b2;
  const Tensor loss = mse_loss(out, y);
  Gradients grads = loss.backward();
  return {loss, grads.get(m.w1), grads.get(m.b1), grads.get(m.w2), grads.get(m.b2)};
}

struct HostStep {
  std::vector<float> loss, gw1, gb1, gw2, gb2;
};
HostStep to_host(const StepOut& s) {
  return {s.loss.to_vec<float>(), s.gw1.to_vec<float>(), s.gb1.to_vec<float>(), s.gw2.to_vec<float>(),
          s.gb2.to_vec<float>()};
}

::testing::AssertionResult close(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= 1e-5f * (1.0f + std::abs(want[i])))) {
      return ::testing::AssertionFailure() << what << "[" << i << "]: " << got[i] << " vs eager " << want[i];
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(CudaGraph, MlpWithDropoutReplaysMatchEagerRunsOfTheSameRngSequence) {
  FLAME_SKIP_IF_NO_CUDA();
  constexpr int kReplays = 5;
  const Mlp mlp(100);
  std::vector<Tensor> xs, ys;
  for (int r = 0; r < kReplays; ++r) {
    xs.push_back(random_cpu({64, 16}, 1000 + r).to(kCuda));
    ys.push_back(random_cpu({64, 8}, 2000 + r).to(kCuda));
  }

  // Eager: kReplays steps from one generator state; each step draws one dropout mask.
  Generator gen(0);
  gen.manual_seed(7);
  std::vector<HostStep> eager;
  for (int r = 0; r < kReplays; ++r) eager.push_back(to_host(step(mlp, xs[r], ys[r], gen)));
  EXPECT_EQ(gen.offset(), static_cast<uint64_t>(kReplays));
  // Different masks per step: two steps on the same data give different losses.
  {
    Generator g2(0);
    g2.manual_seed(7);
    const float l0 = step(mlp, xs[0], ys[0], g2).loss.item<float>();
    const float l1 = step(mlp, xs[0], ys[0], g2).loss.item<float>();
    ASSERT_NE(l0, l1) << "dropout drew the same mask twice";
  }

  // Graph: capture one step on static buffers, then refill them and replay.
  Tensor x_static = Tensor::empty({64, 16}, {DType::f32, kCuda});
  Tensor y_static = Tensor::empty({64, 8}, {DType::f32, kCuda});
  x_static.copy_(xs[0]);
  y_static.copy_(ys[0]);
  gen.manual_seed(7);
  cuda::Graph graph;
  StepOut captured;
  cuda::capture(graph, [&] { captured = step(mlp, x_static, y_static, gen); });
  ASSERT_TRUE(graph.captured());
  EXPECT_EQ(graph.random_offsets_per_replay(), 1u);
  EXPECT_EQ(gen.offset(), 0u) << "the capture itself must not consume random offsets";
  EXPECT_GT(cuda::memory_stats().graph_pool_bytes, 0u);

  for (int r = 0; r < kReplays; ++r) {
    x_static.copy_(xs[r]);
    y_static.copy_(ys[r]);
    graph.replay();
    EXPECT_EQ(gen.offset(), static_cast<uint64_t>(r + 1));
    const HostStep got = to_host(captured);
    EXPECT_TRUE(close(got.loss, eager[r].loss, "loss")) << "replay " << r;
    EXPECT_TRUE(close(got.gw1, eager[r].gw1, "grad w1")) << "replay " << r;
    EXPECT_TRUE(close(got.gb1, eager[r].gb1, "grad b1")) << "replay " << r;
    EXPECT_TRUE(close(got.gw2, eager[r].gw2, "grad w2")) << "replay " << r;
    EXPECT_TRUE(close(got.gb2, eager[r].gb2, "grad b2")) << "replay " << r;
  }

  // Same inputs, two replays: new dropout masks each time.
  x_static.copy_(xs[0]);
  y_static.copy_(ys[0]);
  graph.replay();
  const float a = captured.loss.item<float>();
  graph.replay();
  const float b = captured.loss.item<float>();
  EXPECT_NE(a, b) << "every replay must draw new random numbers";
}

TEST(CudaGraph, HostReadsAndWaitsDuringCaptureRaise) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor x = random_cpu({1000}, 5).to(kCuda);
  const std::vector<float> xv = x.to_vec<float>();
  cuda::Graph graph;
  graph.capture_begin();
  EXPECT_TRUE(cuda::is_capturing(0));
  const Tensor y = x * 3.0f;
  const std::vector<std::string> captured = {"CUDA graph is being captured"};
  expect_error([&] { (void)y.to_vec<float>(); }, {"copy_to_host", "cannot", "CUDA graph is being captured"});
  expect_error([&] { (void)y.sum().item<float>(); }, captured);
  expect_error([&] { (void)y.to(Device::cpu()); }, captured);
  expect_error([&] { cuda::synchronize(); }, {"synchronize", "CUDA graph is being captured"});
  expect_error([&] { (void)Tensor::from_vec(std::vector<float>{1, 2, 3}, {3}, kCuda); },
               {"copy_from_host", "CUDA graph is being captured"});
  expect_error([&] { (void)masked_select(y, y.gt(y)); }, {"masked_select", "CUDA graph is being captured"});
  expect_error([&] { cuda::Stream::current(0).synchronize(); }, {"synchronize", "CUDA graph is being captured"});
  expect_error([&] { cuda::empty_cache(); }, {"empty_cache", "CUDA graph is being captured"});
  // The capture survives the refused calls.
  const Tensor z = y + 1.0f;
  graph.capture_end();
  EXPECT_FALSE(cuda::is_capturing(0));
  graph.replay();
  const std::vector<float> got = z.to_vec<float>();
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], xv[i] * 3.0f + 1.0f) << i;
}

TEST(CudaGraph, PrivatePoolBlocksAreNotHandedToEagerCode) {
  FLAME_SKIP_IF_NO_CUDA();
  const int64_t n = 3 * 1024 + 7;
  Tensor x = random_cpu({n}, 6).to(kCuda);
  const cuda::MemoryStats before = cuda::memory_stats();
  std::set<void*> private_blocks;
  Tensor out;
  {
    cuda::Graph graph;
    cuda::capture(graph, [&] {
      for (int i = 0; i < 4; ++i) {
        Tensor t = x * static_cast<float>(i + 2);  // temporaries freed inside the capture
        private_blocks.insert(t.data_ptr());
      }
      out = (x * 2.0f) + 1.0f;
      private_blocks.insert(out.data_ptr());
    });
    // Eager allocations of the same size never receive a graph block while the graph lives.
    std::vector<Tensor> eager;
    for (int i = 0; i < 16; ++i) {
      eager.push_back(Tensor::full({n}, -5.0f, kCuda));
      EXPECT_EQ(private_blocks.count(eager.back().data_ptr()), 0u) << "eager tensor got a graph block";
    }
    for (int round = 0; round < 3; ++round) {
      x.copy_(random_cpu({n}, 60 + round).to(kCuda));
      const std::vector<float> xv = x.to_vec<float>();
      graph.replay();
      const std::vector<float> got = out.to_vec<float>();
      for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], xv[i] * 2.0f + 1.0f) << "round " << round;
    }
    EXPECT_GT(cuda::memory_stats().graph_pool_bytes, before.graph_pool_bytes);
  }
  // The graph is gone; `out` still holds its block until it is dropped.
  EXPECT_GT(cuda::memory_stats().graph_pool_bytes, before.graph_pool_bytes);
  out = Tensor();
  EXPECT_EQ(cuda::memory_stats().graph_pool_bytes, before.graph_pool_bytes);
}

TEST(CudaGraph, SharedBlocksFreedDuringCaptureStayWithTheGraph) {
  FLAME_SKIP_IF_NO_CUDA();
  const int64_t n = 2 * 1024 + 11;
  Tensor a = random_cpu({n}, 7).to(kCuda);
  const std::vector<float> av = a.to_vec<float>();
  void* a_block = a.data_ptr();
  cuda::Graph graph;
  Tensor out;
  cuda::capture(graph, [&] {
    out = a + 1.0f;
    a = Tensor();  // the last handle goes while the graph still reads the block on replay
  });
  std::vector<Tensor> eager;
  for (int i = 0; i < 16; ++i) {
    eager.push_back(Tensor::full({n}, 1000.0f, kCuda));
    ASSERT_NE(eager.back().data_ptr(), a_block) << "a block the graph reads was reused";
  }
  graph.replay();
  const std::vector<float> got = out.to_vec<float>();
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], av[i] + 1.0f) << i;
}

TEST(CudaGraph, ReplayOnAnotherStreamAndMisuseErrors) {
  FLAME_SKIP_IF_NO_CUDA();
  Tensor x = random_cpu({4096}, 8).to(kCuda);
  const std::vector<float> xv = x.to_vec<float>();
  cuda::Graph graph;
  expect_error([&] { graph.replay(); }, {"cuda::Graph::replay", "nothing captured"});
  expect_error([&] { graph.capture_end(); }, {"cuda::Graph::capture_end", "no capture"});
  Tensor out;
  cuda::capture(graph, [&] { out = x.exp() * 0.5f; });
  expect_error([&] { graph.capture_begin(); }, {"cuda::Graph::capture_begin", "reset"});
  const cuda::Stream side = cuda::Stream::create(0);
  {
    cuda::StreamGuard guard(side);
    side.wait(cuda::Stream::default_stream(0));
    graph.replay();
    const std::vector<float> got = out.to_vec<float>();  // read on `side`, after the replay
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], std::exp(xv[i]) * 0.5f, 1e-6f * (1 + got[i])) << i;
  }
  // A capture that throws is aborted and leaves no capture state behind.
  cuda::Graph failing;
  EXPECT_THROW(cuda::capture(failing, [&] { (void)x.sum().item<float>(); }), Error);
  EXPECT_FALSE(cuda::is_capturing(0));
  EXPECT_FALSE(failing.captured());
  EXPECT_EQ((x * 2.0f).to_vec<float>()[5], xv[5] * 2.0f);
  graph.reset();
  EXPECT_FALSE(graph.captured());
}

}  // namespace
}  // namespace flame::test
