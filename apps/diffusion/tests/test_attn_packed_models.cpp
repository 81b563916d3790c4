// The trainer's attention blocks through attention_qkv_packed: DiTAttention and the UNet's
// AttnBlock against the select composite they used before (same weights, same input), forward
// and every gradient. On the CPU the packed route is forced (the fused kernels' CPU reference);
// on CUDA (FLAME_TEST_DEVICE=cuda) the bf16 blocks run cuDNN's packed route against f32 math.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <tuple>

#include "dit.h"
#include "flame/nn/attention.h"
#include "model_test_util.h"
#include "unet.h"

namespace fd = flame_diffusion;
namespace F = flame::nn::functional;
using flame::DType;
using flame::Tensor;
using fd_test::test_device;

namespace {

// Before the packed op: reshape/permute/select, SDPA, merge heads.
Tensor select_attention(const Tensor& qkv, int64_t heads) {
  const int64_t b = qkv.size(0), n = qkv.size(1), d = qkv.size(2) / 3;
  const Tensor p = qkv.reshape({b, n, 3, heads, d / heads}).permute({2, 0, 3, 1, 4});
  const Tensor o = F::scaled_dot_product_attention(p.select(0, 0), p.select(0, 1), p.select(0, 2));
  return o.transpose(1, 2).reshape({b, n, d});
}

struct Outcome {
  Tensor out, dx, dqkv_w, dproj_w, dqkv_b;
  std::string path;
};

// Runs `forward` on a fresh leaf of `x` with a fixed upstream gradient and collects the gradients.
Outcome run(flame::nn::Linear& qkv, flame::nn::Linear& proj, const Tensor& x, const Tensor& gout,
            const std::function<Tensor(const Tensor&)>& forward) {
  Tensor leaf = x.detach().requires_grad_();
  Outcome r;
  r.out = forward(leaf);
  r.path = F::sdpa_last_path();
  flame::BackwardOptions opt;
  opt.grad_output = gout;
  const flame::Gradients g = r.out.backward(opt);
  r.dx = leaf.grad(g);
  r.dqkv_w = qkv.weight().grad(g);
  r.dqkv_b = qkv.bias().grad(g);
  r.dproj_w = proj.weight().grad(g);
  return r;
}

void expect_close(const Outcome& got, const Outcome& want, double tol) {
  for (auto [a, b, what] : {std::tuple{&got.out, &want.out, "out"},
                            {&got.dx, &want.dx, "dx"},
                            {&got.dqkv_w, &want.dqkv_w, "qkv.weight grad"},
                            {&got.dqkv_b, &want.dqkv_b, "qkv.bias grad"},
                            {&got.dproj_w, &want.dproj_w, "proj.weight grad"}}) {
    ASSERT_TRUE(a->defined() && b->defined()) << what;
    const double scale = std::max(1.0, fd_test::max_abs(*b));
    EXPECT_LE(fd_test::max_abs_diff(*a, *b), tol * scale) << what;
    EXPECT_GT(fd_test::max_abs(*b), 0.0) << what;
  }
}

// The packed block against the select composite on the same weights.
using Attend = std::function<Tensor(const Tensor&)>;

// body(block, x, attend): the block's forward with its attention core replaced by `attend`.
template <class Block>
void check_block(Block& blk, const Tensor& x_values, const Tensor& gout_values, int64_t heads,
                 const std::function<Tensor(Block&, const Tensor&, const Attend&)>& body) {
  const flame::Device dev = test_device();
  auto packed = [&](const Tensor& qkv) { return F::attention_qkv_packed(qkv, heads); };
  auto select = [&](const Tensor& qkv) { return select_attention(qkv, heads); };
  if (dev.is_cpu()) {
    blk.to(DType::f64);
    const Tensor x = x_values.to(DType::f64), gout = gout_values.to(DType::f64);
    Outcome want, got;
    {
      F::SdpaBackendGuard math(F::SdpaBackend::math);
      want = run(*blk.qkv, *blk.proj, x, gout, [&](const Tensor& t) { return body(blk, t, select); });
    }
    {
      F::SdpaBackendGuard fused(F::SdpaBackend::fused);
      got = run(*blk.qkv, *blk.proj, x, gout, [&](const Tensor& t) { return blk.forward(t); });
    }
    EXPECT_EQ(got.path, "fused_packed");
    expect_close(got, want, 1e-10);
    return;
  }
  blk.to(DType::bf16, dev);  // weights the bf16 run holds exactly, then widened for the reference
  blk.to(DType::f32);
  Outcome want;
  {
    F::SdpaBackendGuard math(F::SdpaBackend::math);
    const Tensor x = x_values.to(DType::bf16).to(DType::f32).to(dev);
    const Tensor gout = gout_values.to(DType::bf16).to(DType::f32).to(dev);
    want = run(*blk.qkv, *blk.proj, x, gout, [&](const Tensor& t) { return body(blk, t, select); });
  }
  blk.to(DType::bf16);
  const Outcome got = run(*blk.qkv, *blk.proj, x_values.to(DType::bf16).to(dev), gout_values.to(DType::bf16).to(dev),
                          [&](const Tensor& t) { return blk.forward(t); });
  EXPECT_EQ(got.path, "fused_packed");
  expect_close(got, want, 5e-2);  // bf16 weights and activations against f32 math
}

TEST(AttnPackedModels, DiTAttentionMatchesSelectComposite) {
  FD_SKIP_IF_NO_DEVICE();
  flame::Generator gen(5);
  fd::DiTAttention attn(64, 4);  // head dim 16
  fd_test::perturb(attn, 0.05, 6);
  const Tensor x = Tensor::randn({2, 17, 64}, 0.0, 1.0, {DType::f32}, &gen);
  const Tensor gout = Tensor::randn({2, 17, 64}, 0.0, 1.0, {DType::f32}, &gen);
  check_block<fd::DiTAttention>(attn, x, gout, 4,
                                [](fd::DiTAttention& a, const Tensor& t, const Attend& att) {
                                  return a.proj->forward(att(a.qkv->forward(t)));
                                });
}

TEST(AttnPackedModels, UNetAttnBlockMatchesSelectComposite) {
  FD_SKIP_IF_NO_DEVICE();
  flame::Generator gen(7);
  fd::AttnBlock blk(32, 4, 2);  // head dim 16
  fd_test::perturb(blk, 0.05, 8);
  const Tensor x = Tensor::randn({2, 32, 3, 5}, 0.0, 1.0, {DType::f32}, &gen);
  const Tensor gout = Tensor::randn({2, 32, 3, 5}, 0.0, 1.0, {DType::f32}, &gen);
  check_block<fd::AttnBlock>(blk, x, gout, 2, [](fd::AttnBlock& a, const Tensor& t, const Attend& att) {
    const int64_t b = t.size(0), ch = t.size(1), hh = t.size(2), ww = t.size(3);
    const Tensor tokens = a.norm->forward(t).flatten(2).transpose(1, 2);
    const Tensor out = a.proj->forward(att(a.qkv->forward(tokens)));
    return t + out.transpose(1, 2).reshape({b, ch, hh, ww});
  });
}

}  // namespace
