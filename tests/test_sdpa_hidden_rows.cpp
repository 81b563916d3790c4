// scaled_dot_product_attention with a mask that hides every key of some query rows
// (Note [SDPA fully hidden rows]): those rows give 0 and pass no gradient on the math path, the
// fused path (its CPU reference here, cuDNN on CUDA) and through the cuDNN routes (padded,
// heads-inner output layout), for bool masks and for float masks whose row is all -inf.
#include <cmath>
#include <limits>
#include <vector>

#include "flame/cuda.h"
#include "flame/nn/attention.h"
#include "nn_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {
namespace F = flame::nn::functional;
using F::SdpaBackend;
using F::SdpaBackendGuard;

// keep[l][s] true everywhere except the listed query rows, which see no key; plus a few hidden
// keys elsewhere so that the mask does something on the other rows too.
Tensor mask_hiding_rows(int64_t L, int64_t S, const std::vector<int64_t>& dead_rows) {
  std::vector<bool> keep(static_cast<std::size_t>(L * S), true);
  for (int64_t i = 0; i < L; ++i) keep[static_cast<std::size_t>(i * S + (i * 3) % S)] = i % 2 == 0;
  for (int64_t r : dead_rows)
    for (int64_t j = 0; j < S; ++j) keep[static_cast<std::size_t>(r * S + j)] = false;
  return Tensor::from_vec(keep, {L, S});
}

struct SdpaRun {
  Tensor out, dq, dk, dv;
};
SdpaRun run_sdpa(const Tensor& q0, const Tensor& k0, const Tensor& v0, const Tensor& mask, const Tensor& gout, SdpaBackend b) {
  SdpaBackendGuard guard(b);
  const Tensor q = q0.detach().requires_grad_(true), k = k0.detach().requires_grad_(true),
               v = v0.detach().requires_grad_(true);
  const Tensor out = F::scaled_dot_product_attention(q, k, v, mask);
  const AttentionGrads g = attention_grads(out, gout, q, k, v);
  return {out.detach(), g.dq, g.dk, g.dv};
}

// Every element of row `r` (dim -2) of t is exactly zero.
::testing::AssertionResult row_is_zero(const Tensor& t, int64_t r) {
  const Tensor row = t.narrow(-2, r, 1).to(Device::cpu()).to(DType::f64).contiguous();
  for (double v : row.to_vec<double>())
    if (v != 0.0) return ::testing::AssertionFailure() << "row " << r << " holds " << v;
  return ::testing::AssertionSuccess();
}

TEST(SdpaHiddenRows, CpuFusedReferenceMatchesMathPath) {
  const int64_t L = 6, S = 9;
  const Tensor q = randn_f64({2, 3, L, 8}, 1), k = randn_f64({2, 3, S, 8}, 2), v = randn_f64({2, 3, S, 8}, 3);
  const Tensor gout = randn_f64({2, 3, L, 8}, 4);
  const Tensor bmask = mask_hiding_rows(L, S, {1, 4});
  const Tensor fmask = masked_fill(randn_f64({L, S}, 5), logical_not(bmask), -std::numeric_limits<double>::infinity());
  for (const Tensor& mask : {bmask, fmask}) {
    const SdpaRun m = run_sdpa(q, k, v, mask, gout, SdpaBackend::math);
    const SdpaRun f = run_sdpa(q, k, v, mask, gout, SdpaBackend::fused);
    EXPECT_STREQ(F::sdpa_last_path(), "fused");
    for (int64_t r : {1, 4}) {
      EXPECT_TRUE(row_is_zero(f.out, r)) << dtype_name(mask.dtype()) << " mask";
      EXPECT_TRUE(row_is_zero(m.out, r));
      EXPECT_TRUE(row_is_zero(f.dq, r));
      EXPECT_TRUE(row_is_zero(m.dq, r));
    }
    EXPECT_TRUE(close_rel(f.out, m.out, 1e-12));
    EXPECT_TRUE(close_rel(f.dq, m.dq, 1e-11));
    EXPECT_TRUE(close_rel(f.dk, m.dk, 1e-11));
    EXPECT_TRUE(close_rel(f.dv, m.dv, 1e-11));
  }
  // dk and dv take nothing from the hidden rows: with only those rows' upstream gradient, both are 0.
  const Tensor dead_rows = Tensor::from_vec(std::vector<bool>{false, true, false, false, true, false}, {L, 1});
  const Tensor only_dead = masked_fill(gout, logical_not(dead_rows), 0.0);
  const SdpaRun f = run_sdpa(q, k, v, bmask, only_dead, SdpaBackend::fused);
  EXPECT_TRUE(close_rel(f.dv, Tensor::zeros({2, 3, S, 8}, DType::f64), 0.0));
  EXPECT_TRUE(close_rel(f.dk, Tensor::zeros({2, 3, S, 8}, DType::f64), 0.0));
}

// On CUDA: the cuDNN path (bf16) against the CPU math path in f64 on the same values, for the plain
// route, a q split from a fused [B, L, 3, H, E] projection (heads-inner output) and a sequence length
// 64 mod 128 (the padded route with a gradient).
TEST(SdpaHiddenRows, CudaFusedPathGivesZeroRowsAndGradients) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device cuda = Device::cuda(0);
  struct Case {
    int64_t L, S;
    bool packed;
  };
  for (const Case c : {Case{16, 24, false}, Case{16, 16, true}, Case{64, 64, false}}) {
    const int64_t B = 2, H = 2, E = 64;
    const std::vector<int64_t> dead = {3, c.L - 1};
    const Tensor bmask = mask_hiding_rows(c.L, c.S, dead);
    // bf16-representable f64 inputs, so that both sides see the same numbers.
    auto bf = [](const Tensor& t) { return t.to(DType::bf16).to(DType::f64); };
    Tensor q, k, v;
    if (c.packed) {
      const Tensor qkv = bf(randn_f64({B, c.L, 3, H, E}, 11));
      q = qkv.select(2, 0).transpose(1, 2);
      k = qkv.select(2, 1).transpose(1, 2);
      v = qkv.select(2, 2).transpose(1, 2);
    } else {
      q = bf(randn_f64({B, H, c.L, E}, 11));
      k = bf(randn_f64({B, H, c.S, E}, 12));
      v = bf(randn_f64({B, H, c.S, E}, 13));
    }
    const Tensor gout = bf(randn_f64({B, H, c.L, E}, 14));
    const SdpaRun want = run_sdpa(q, k, v, bmask, gout, SdpaBackend::math);
    auto dev = [&](const Tensor& t) { return t.to(DType::bf16).to(cuda); };
    Tensor qd = dev(q), kd = dev(k), vd = dev(v);
    if (c.packed) {  // keep the packed layout on the device
      const Tensor qkv = dev(q.transpose(1, 2).unsqueeze(2).expand({B, c.L, 3, H, E}).contiguous());
      qd = qkv.select(2, 0).transpose(1, 2);
      kd = dev(k);
      vd = dev(v);
    }
    const SdpaRun got = run_sdpa(qd, kd, vd, bmask.to(cuda), dev(gout), SdpaBackend::automatic);
    EXPECT_STRNE(F::sdpa_last_path(), "math") << "L " << c.L;
    for (int64_t r : dead) {
      EXPECT_TRUE(row_is_zero(got.out, r)) << "L " << c.L << " path " << F::sdpa_last_path();
      EXPECT_TRUE(row_is_zero(got.dq, r)) << "L " << c.L;
    }
    EXPECT_TRUE(close_rel(got.out, want.out, 3e-2)) << "L " << c.L;
    EXPECT_TRUE(close_rel(got.dq, want.dq, 5e-2)) << "L " << c.L;
    EXPECT_TRUE(close_rel(got.dk, want.dk, 5e-2)) << "L " << c.L;
    EXPECT_TRUE(close_rel(got.dv, want.dv, 5e-2)) << "L " << c.L;
    // The same call on the CUDA math path (f32) gives the same zero rows.
    const SdpaRun mathc = run_sdpa(q.to(DType::f32).to(cuda), k.to(DType::f32).to(cuda), v.to(DType::f32).to(cuda),
                          bmask.to(cuda), gout.to(DType::f32).to(cuda), SdpaBackend::math);
    for (int64_t r : dead) EXPECT_TRUE(row_is_zero(mathc.out, r));
  }
}

}  // namespace
}  // namespace flame::test
