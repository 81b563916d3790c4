// Autotuning of cuDNN plans for convolution and fused attention (Note [cuDNN autotuning] in
// src/backend/cuda/cudnn_autotune.h, flame::cuda::set_cudnn_autotune).
//  - CudnnTuneSettings.*: the switch and counters of flame/cuda.h (every build).
//  - CudnnTune.*: CUDA only (skip without a GPU). Convolution forward + both backward passes and
//    SDPA forward + backward, with autotuning on and off, against float64 CPU references of the
//    same bf16 inputs; a problem first seen under graph capture runs the heuristic's plan (nothing
//    timed inside the capture), replays correctly, and is tuned by the next eager call.
//    Each case uses sizes no other case uses, so its problems miss the process-wide plan caches.
//  - CudnnHandle.*: a thread whose first cuDNN call is inside a graph capture (Note [cuDNN handle
//    under capture]): SDPA handles are per thread, so a new thread creates one there.
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "flame/cuda.h"
#include "flame/nn.h"
#include "flame/nn/attention.h"
#include "nn_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {

namespace F = nn::functional;

struct AutotuneScope : SwitchScope {
  explicit AutotuneScope(bool on) : SwitchScope(cuda::cudnn_autotune, cuda::set_cudnn_autotune, on) {}
};

constexpr double kTol = 2e-2;  // bf16 operands and outputs against an f64 reference

struct ConvCase {
  Tensor x, w, b, dy;  // bf16 on CUDA
};

ConvCase conv_case(int64_t h, int64_t w, uint64_t seed) {
  const Device dev = Device::cuda();
  ConvCase c;
  c.x = randn_f64({2, 32, h, w}, seed).to(DType::bf16).to(dev);
  c.w = randn_f64({48, 32, 3, 3}, seed + 1, 0.1).to(DType::bf16).to(dev);
  c.b = randn_f64({48}, seed + 2).to(DType::bf16).to(dev);
  c.dy = randn_f64({2, 48, h, w}, seed + 3).to(DType::bf16).to(dev);
  return c;
}

struct ConvResult {
  Tensor y, dx, dw, db;
};

ConvResult conv_step(const Tensor& x0, const Tensor& w0, const Tensor& b0, const Tensor& dy) {
  const Tensor x = x0.detach().requires_grad_(), w = w0.detach().requires_grad_(), b = b0.detach().requires_grad_();
  const Tensor y = F::conv2d(x, w, b, {1}, {1});
  BackwardOptions o;
  o.grad_output = dy;
  Gradients g = y.backward(o);
  return {y.detach(), g.get(x), g.get(w), g.get(b)};
}

void expect_conv_matches_reference(const ConvResult& got, const ConvCase& c, const std::string& what) {
  auto cpu = [](const Tensor& t) { return t.to(Device::cpu()).to(DType::f64); };
  const ConvResult want = conv_step(cpu(c.x), cpu(c.w), cpu(c.b), cpu(c.dy));
  EXPECT_TRUE(close_rel(got.y, want.y, kTol)) << what << ": y";
  EXPECT_TRUE(close_rel(got.dx, want.dx, kTol)) << what << ": dx";
  EXPECT_TRUE(close_rel(got.dw, want.dw, kTol)) << what << ": dw";
  EXPECT_TRUE(close_rel(got.db, want.db, kTol)) << what << ": db";
}

TEST(CudnnTuneSettings, SwitchRoundTripsAndCountersStartClean) {
  const AutotuneScope scope(true);
  EXPECT_TRUE(cuda::cudnn_autotune());
  cuda::set_cudnn_autotune(false);
  EXPECT_FALSE(cuda::cudnn_autotune());
  cuda::set_cudnn_autotune(true);
  EXPECT_TRUE(cuda::cudnn_autotune());
  const cuda::CudnnTuneStats s = cuda::cudnn_tune_stats();
  if (!cuda_is_available()) {  // nothing builds cuDNN plans without a GPU
    EXPECT_EQ(s.tuned_plans, 0u);
    EXPECT_EQ(s.timed_candidates, 0u);
  }
  EXPECT_GE(s.timed_candidates, 2 * s.tuned_plans);  // a tuned problem timed two candidates or more
}

TEST(CudnnTune, ConvolutionTunedAndUntunedMatchReference) {
  FLAME_SKIP_IF_NO_CUDA();
  for (bool on : {true, false}) {
    const AutotuneScope scope(on);
    const ConvCase c = on ? conv_case(19, 23, 100) : conv_case(23, 19, 200);
    const cuda::CudnnTuneStats t0 = cuda::cudnn_tune_stats();
    const ConvResult first = conv_step(c.x, c.w, c.b, c.dy);  // builds (and, on, tunes) three plans
    const cuda::CudnnTuneStats t1 = cuda::cudnn_tune_stats();
    if (on) {
      // cuDNN offers several engines for a bf16 3x3 convolution, so at least the forward is timed.
      EXPECT_GE(t1.tuned_plans, t0.tuned_plans + 1);
      EXPECT_GE(t1.timed_candidates - t0.timed_candidates, 2 * (t1.tuned_plans - t0.tuned_plans));
    } else {
      EXPECT_EQ(t1.tuned_plans, t0.tuned_plans);
      EXPECT_EQ(t1.timed_candidates, t0.timed_candidates);
    }
    expect_conv_matches_reference(first, c, on ? "first call, tuning" : "autotune off");
    const ConvResult again = conv_step(c.x, c.w, c.b, c.dy);  // the cached (tuned) plans
    EXPECT_EQ(cuda::cudnn_tune_stats().tuned_plans, t1.tuned_plans) << "a cached plan was tuned again";
    expect_conv_matches_reference(again, c, on ? "tuned plans" : "autotune off, second call");
  }
}

TEST(CudnnTune, ConvolutionFirstSeenUnderCaptureTunesEagerlyAfter) {
  FLAME_SKIP_IF_NO_CUDA();
  const AutotuneScope scope(true);
  const ConvCase c = conv_case(17, 29, 300);
  const cuda::CudnnTuneStats t0 = cuda::cudnn_tune_stats();
  cuda::Graph graph;
  ConvResult captured;
  cuda::capture(graph, [&] { captured = conv_step(c.x, c.w, c.b, c.dy); });
  EXPECT_EQ(cuda::cudnn_tune_stats().tuned_plans, t0.tuned_plans) << "candidates were timed inside the capture";
  graph.replay();
  expect_conv_matches_reference(captured, c, "replay of the heuristic's plans");
  const ConvResult eager = conv_step(c.x, c.w, c.b, c.dy);
  EXPECT_GE(cuda::cudnn_tune_stats().tuned_plans, t0.tuned_plans + 1) << "the eager call did not tune";
  expect_conv_matches_reference(eager, c, "eager call after the capture");
  graph.replay();  // the graph keeps the plans it captured
  expect_conv_matches_reference(captured, c, "replay after tuning");
}

TEST(CudnnTune, AttentionTunedAndUntunedMatchReference) {
  FLAME_SKIP_IF_NO_CUDA();
  for (bool on : {true, false}) {
    const AutotuneScope scope(on);
    const int64_t s = on ? 328 : 344;  // kv lengths no other case uses
    const Device dev = Device::cuda();
    const uint64_t seed = on ? 400 : 500;
    const Tensor q = randn_f64({2, 3, 200, 64}, seed).to(DType::bf16).to(dev);
    const Tensor k = randn_f64({2, 3, s, 64}, seed + 1).to(DType::bf16).to(dev);
    const Tensor v = randn_f64({2, 3, s, 64}, seed + 2).to(DType::bf16).to(dev);
    const Tensor dy = randn_f64({2, 3, 200, 64}, seed + 3).to(DType::bf16).to(dev);
    auto step = [&](const Tensor& q0, const Tensor& k0, const Tensor& v0, const Tensor& g0) {
      const Tensor a = q0.detach().requires_grad_(), b = k0.detach().requires_grad_(),
                   c = v0.detach().requires_grad_();
      const Tensor y = F::scaled_dot_product_attention(a, b, c);
      BackwardOptions o;
      o.grad_output = g0;
      Gradients g = y.backward(o);
      return std::vector<Tensor>{y.detach(), g.get(a), g.get(b), g.get(c)};
    };
    const cuda::CudnnTuneStats t0 = cuda::cudnn_tune_stats();
    const std::vector<Tensor> got = step(q, k, v, dy);
    EXPECT_STREQ(F::sdpa_last_path(), "fused");
    const cuda::CudnnTuneStats t1 = cuda::cudnn_tune_stats();
    if (!on) EXPECT_EQ(t1.tuned_plans, t0.tuned_plans);
    EXPECT_GE(t1.timed_candidates - t0.timed_candidates, 2 * (t1.tuned_plans - t0.tuned_plans));
    auto cpu = [](const Tensor& t) { return t.to(Device::cpu()).to(DType::f64); };
    const std::vector<Tensor> want = step(cpu(q), cpu(k), cpu(v), cpu(dy));
    const char* names[] = {"out", "dq", "dk", "dv"};
    for (int i = 0; i < 4; ++i)
      EXPECT_TRUE(close_rel(got[i], want[i], kTol)) << (on ? "autotune on: " : "autotune off: ") << names[i];
  }
}

TEST(CudnnHandle, FirstCallOfANewThreadInsideACapture) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device dev = Device::cuda();
  const Tensor q = randn_f64({2, 2, 136, 64}, 600).to(DType::bf16).to(dev);
  const Tensor k = randn_f64({2, 2, 136, 64}, 601).to(DType::bf16).to(dev);
  const Tensor v = randn_f64({2, 2, 136, 64}, 602).to(DType::bf16).to(dev);
  Tensor captured;
  std::string error;
  std::thread t([&] {
    try {
      cuda::Graph g;
      cuda::capture(g, [&] { captured = F::scaled_dot_product_attention(q, k, v); });
      // The automatic path falls back to the math kernels on a cuDNN error: this must be cuDNN's.
      if (std::string(F::sdpa_last_path()) != "fused") error = std::string("ran the ") + F::sdpa_last_path() + " path";
      g.replay();
      captured = captured.to(Device::cpu());  // before the graph (and its pool) goes
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  t.join();
  ASSERT_TRUE(error.empty()) << error;
  auto cpu = [](const Tensor& x) { return x.to(Device::cpu()).to(DType::f64); };
  EXPECT_TRUE(close_rel(captured, F::scaled_dot_product_attention(cpu(q), cpu(k), cpu(v)), kTol));
}

}  // namespace
}  // namespace flame::test
