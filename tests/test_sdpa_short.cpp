// FLAME's short-sequence attention kernels (Note [Short-sequence attention] in
// src/backend/cuda/attention/sdpa_short.cu) against the f32 math path: odd and unequal lengths up
// to 256, bf16 and f16, a fused-qkv layout, large scores (the online softmax's rescaling), CUDA
// graph capture; calls they must not take stay on cuDNN. CUDA only.
#include <sstream>
#include <string>

#include "flame/cuda.h"
#include "flame/nn/attention.h"
#include "engine_detail.h"
#include "nn_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {
namespace F = flame::nn::functional;

// Turns the short kernels on (or off) for a scope.
struct ShortAttentionGuard : SwitchScope {
  explicit ShortAttentionGuard(bool on) : SwitchScope(cuda::short_attention, cuda::set_short_attention, on) {}
};

Tensor rnd(const Shape& shape, uint64_t seed, DType dt, double stddev = 1.0) {
  Generator g(seed);
  return Tensor::randn(shape, 0.0, stddev, {DType::f64, Device::cpu()}, &g).to(dt).to(Device::cuda());
}

struct Case {
  DType dt;
  int64_t b, h, l, s;
  double stddev;  // of q and k: larger gives peakier softmax rows
};

std::string case_name(const Case& c) {
  std::ostringstream os;
  os << dtype_name(c.dt) << "_b" << c.b << "h" << c.h << "_l" << c.l << "_s" << c.s
     << (c.stddev != 1.0 ? "_peaky" : "");
  return os.str();
}

using Result = AttentionGrads;

// Forward and backward with a fixed upstream gradient; inputs drawn in the case's dtype, then
// converted to `dt` (so the f32 reference sees the same values).
Result run(const Case& c, DType dt, bool short_kernels) {
  constexpr int64_t d = 64;
  Tensor q = rnd({c.b, c.h, c.l, d}, 1, c.dt, c.stddev).to(dt).requires_grad_();
  Tensor k = rnd({c.b, c.h, c.s, d}, 2, c.dt, c.stddev).to(dt).requires_grad_();
  Tensor v = rnd({c.b, c.h, c.s, d}, 3, c.dt).to(dt).requires_grad_();
  const Tensor gout = rnd({c.b, c.h, c.l, d}, 4, c.dt).to(dt);
  ShortAttentionGuard on(short_kernels);
  return attention_grads(F::scaled_dot_product_attention(q, k, v), gout, q, k, v);
}

void expect_close(const Result& got, const Result& want, double tol, const std::string& what) {
  EXPECT_TRUE(close_rel(got.out, want.out, tol)) << what << " out";
  EXPECT_TRUE(close_rel(got.dq, want.dq, tol)) << what << " dq";
  EXPECT_TRUE(close_rel(got.dk, want.dk, tol)) << what << " dk";
  EXPECT_TRUE(close_rel(got.dv, want.dv, tol)) << what << " dv";
}

// The switch exists in every build; the CPU backend's fused reference never runs the kernels.
TEST(SdpaShortSwitch, TogglesAndTheCpuPathDoesNotCount) {
  const bool before = cuda::short_attention();
  {
    ShortAttentionGuard on(true);
    EXPECT_TRUE(cuda::short_attention());
    const cuda::ShortAttentionStats s0 = cuda::short_attention_stats();
    Generator g(5);
    const Tensor q = Tensor::randn({1, 2, 9, 64}, 0.0, 1.0, {DType::f32, Device::cpu()}, &g);
    F::SdpaBackendGuard fused(F::SdpaBackend::fused);
    (void)F::scaled_dot_product_attention(q, q, q);
    EXPECT_EQ(cuda::short_attention_stats().forward_calls, s0.forward_calls);
    ShortAttentionGuard off(false);
    EXPECT_FALSE(cuda::short_attention());
  }
  EXPECT_EQ(cuda::short_attention(), before);
}

class SdpaShortCuda : public ::testing::TestWithParam<Case> {};

TEST_P(SdpaShortCuda, MatchesMathAndCudnn) {
  FLAME_SKIP_IF_NO_CUDA();
  const Case c = GetParam();
  const cuda::ShortAttentionStats before = cuda::short_attention_stats();
  const Result got = run(c, c.dt, true);
  const cuda::ShortAttentionStats after = cuda::short_attention_stats();
  EXPECT_EQ(after.forward_calls, before.forward_calls + 1) << "the short forward did not run";
  EXPECT_EQ(after.backward_calls, before.backward_calls + 1) << "the short backward did not run";
  const Result math = run(c, DType::f32, false);
  const double tol = c.dt == DType::bf16 ? 3e-2 : 1e-2;
  expect_close(got, math, tol, case_name(c) + " vs f32 math");
  // cuDNN on the same half inputs: both round P and dS to the input dtype.
  const Result cudnn = run(c, c.dt, false);
  expect_close(got, cudnn, tol, case_name(c) + " vs cuDNN");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SdpaShortCuda,
    ::testing::Values(Case{DType::bf16, 2, 3, 196, 196, 1.0}, Case{DType::f16, 2, 3, 196, 196, 1.0},
                      Case{DType::bf16, 1, 2, 1, 77, 1.0}, Case{DType::bf16, 2, 2, 17, 16, 1.0},
                      Case{DType::bf16, 1, 2, 16, 17, 1.0}, Case{DType::f16, 2, 1, 64, 64, 1.0},
                      Case{DType::bf16, 1, 2, 65, 63, 1.0}, Case{DType::bf16, 1, 2, 255, 256, 1.0},
                      Case{DType::f16, 1, 2, 256, 256, 1.0}, Case{DType::bf16, 1, 2, 100, 37, 1.0},
                      Case{DType::bf16, 3, 5, 49, 200, 1.0}, Case{DType::bf16, 2, 2, 196, 196, 3.0},
                      Case{DType::f16, 1, 3, 130, 250, 3.0}),
    [](const ::testing::TestParamInfo<Case>& i) { return case_name(i.param); });

// A DiT block's layout: q, k, v strided views of one [B, L, 3, H, D] projection, the output in
// [B, L, H, D] memory, the gradients written into one qkv gradient.
TEST(SdpaShortCudaRoutes, PackedQkvOfADitBlock) {
  FLAME_SKIP_IF_NO_CUDA();
  const int64_t B = 2, L = 196, H = 6, D = 64;
  Tensor qkv = rnd({B, L, 3 * H * D}, 9, DType::bf16).requires_grad_();
  const Tensor gout = rnd({B, L, H * D}, 10, DType::bf16);
  auto run_packed = [&](bool short_kernels) {
    ShortAttentionGuard on(short_kernels);
    const Tensor out = F::attention_qkv_packed(qkv, H);
    EXPECT_STREQ(F::sdpa_last_path(), "fused_packed");
    BackwardOptions opt;
    opt.grad_output = gout;
    Gradients g = out.backward(opt);
    return std::pair{out, qkv.grad(g)};
  };
  const cuda::ShortAttentionStats before = cuda::short_attention_stats();
  const auto [out, dqkv] = run_packed(true);
  const cuda::ShortAttentionStats after = cuda::short_attention_stats();
  EXPECT_EQ(after.forward_calls, before.forward_calls + 1);
  EXPECT_EQ(after.backward_calls, before.backward_calls + 1);
  const auto [want_out, want_dqkv] = run_packed(false);
  EXPECT_TRUE(close_rel(out, want_out, 3e-2));
  EXPECT_TRUE(close_rel(dqkv, want_dqkv, 3e-2));
}

// The short backward sums dq, dk and dv per column as it writes them; the projection that made
// qkv takes those sums as its bias gradient (Note [Gradient row sums]) instead of summing the qkv
// gradient again. The bias gradient matches cuDNN's route, where the projection sums it itself.
TEST(SdpaShortCudaRoutes, QkvBiasGradientFromTheKernelsColumnSums) {
  FLAME_SKIP_IF_NO_CUDA();
  const int64_t B = 2, L = 196, H = 6, C = H * 64;
  const Tensor x = rnd({B, L, C}, 30, DType::bf16, 0.2);
  Tensor w = rnd({3 * C, C}, 31, DType::bf16, 0.05).requires_grad_();
  Tensor bias = rnd({3 * C}, 32, DType::bf16).requires_grad_();
  const Tensor gout = rnd({B, L, C}, 33, DType::bf16);
  auto bias_grad = [&](bool short_kernels, autograd_detail::RowSumCounts* delta) {
    ShortAttentionGuard on(short_kernels);
    const autograd_detail::RowSumCounts before = autograd_detail::row_sum_counts();
    const Tensor out = F::attention_qkv_packed(F::linear(x, w, bias), H);
    BackwardOptions opt;
    opt.grad_output = gout;
    const Gradients g = out.backward(opt);
    const autograd_detail::RowSumCounts after = autograd_detail::row_sum_counts();
    *delta = {after.attached - before.attached, after.taken - before.taken};
    return std::pair{bias.grad(g), w.grad(g)};
  };
  autograd_detail::RowSumCounts with{}, without{};
  const auto [db, dw] = bias_grad(true, &with);
  const auto [want_db, want_dw] = bias_grad(false, &without);
  EXPECT_EQ(with.attached, 1u);
  EXPECT_EQ(with.taken, 1u) << "the projection did not take the kernels' column sums";
  EXPECT_EQ(without.attached, 0u);
  EXPECT_TRUE(close_rel(db, want_db, 3e-2));
  EXPECT_TRUE(close_rel(dw, want_dw, 3e-2));
}

// What the kernels do not take runs on cuDNN with the switch on: a mask, causal, head dim 128,
// more than 256 keys or queries.
TEST(SdpaShortCudaRoutes, OtherCallsStayOnCudnn) {
  FLAME_SKIP_IF_NO_CUDA();
  ShortAttentionGuard on(true);
  const cuda::ShortAttentionStats before = cuda::short_attention_stats();
  auto fwd_bwd = [](const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal) {
    Tensor qq = q.detach().requires_grad_(), kk = k.detach().requires_grad_(), vv = v.detach().requires_grad_();
    const Tensor out = F::scaled_dot_product_attention(qq, kk, vv, mask, 0.0, causal);
    (void)out.sum().backward();
  };
  const Tensor q = rnd({1, 2, 100, 64}, 20, DType::bf16), k = rnd({1, 2, 100, 64}, 21, DType::bf16);
  const Tensor mask = rnd({1, 1, 100, 100}, 22, DType::bf16);
  fwd_bwd(q, k, k, {}, true);
  fwd_bwd(q, k, k, mask, false);
  const Tensor q128 = rnd({1, 2, 100, 128}, 23, DType::bf16);
  fwd_bwd(q128, q128, q128, {}, false);
  const Tensor long_kv = rnd({1, 2, 257, 64}, 24, DType::bf16);
  fwd_bwd(q, long_kv, long_kv, {}, false);
  fwd_bwd(long_kv, q, q, {}, false);
  const cuda::ShortAttentionStats after = cuda::short_attention_stats();
  EXPECT_EQ(after.forward_calls, before.forward_calls);
  EXPECT_EQ(after.backward_calls, before.backward_calls);
}

// Captured forward and backward replay the short kernels and give the eager values.
TEST(SdpaShortCudaRoutes, GraphCaptureReplaysTheSameValues) {
  FLAME_SKIP_IF_NO_CUDA();
  ShortAttentionGuard on(true);
  const Case c{DType::bf16, 2, 3, 196, 196, 1.0};
  const Result eager = run(c, DType::bf16, true);
  Tensor q = rnd({2, 3, 196, 64}, 1, DType::bf16).requires_grad_();
  Tensor k = rnd({2, 3, 196, 64}, 2, DType::bf16).requires_grad_();
  Tensor v = rnd({2, 3, 196, 64}, 3, DType::bf16).requires_grad_();
  const Tensor gout = rnd({2, 3, 196, 64}, 4, DType::bf16);
  cuda::Graph graph;
  Result got;
  cuda::capture(graph, [&] { got = attention_grads(F::scaled_dot_product_attention(q, k, v), gout, q, k, v); });
  graph.replay();
  cuda::synchronize();
  EXPECT_TRUE(same_bits(got.out, eager.out, "out"));
  EXPECT_TRUE(same_bits(got.dq, eager.dq, "dq"));
  EXPECT_TRUE(same_bits(got.dk, eager.dk, "dk"));
  EXPECT_TRUE(same_bits(got.dv, eager.dv, "dv"));
}

}  // namespace
}  // namespace flame::test
