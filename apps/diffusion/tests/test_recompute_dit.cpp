// DiT activation recompute (DiTRecompute, docs/recompute.md): with recompute mlp or all, the loss
// and every parameter gradient equal those of recompute none, and the graph holds fewer bytes.
//  - RecomputeDit.*Cpu: on the CPU (f32, and under bf16 autocast) the recomputes rerun the
//    forward's kernels, so the results are equal bit for bit.
//  - RecomputeDit.MatchesNoneCuda: the same on a GPU when one is present (bf16 autocast: the MLP's
//    recomputed gelu rounds once where the fused forward rounded after the GEMM, so within bf16
//    rounding); skips otherwise.
//  - RecomputeDit.Trainer*: the trainer's flag, in test_recompute_trainer.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <flame/amp.h>

#include "dit.h"
#include "model_test_util.h"

namespace fd = flame_diffusion;
using flame::DType;
using flame::Tensor;

namespace {

struct StepResult {
  double loss = 0;
  std::vector<std::pair<std::string, Tensor>> grads;  // on the CPU, f64
  std::size_t saved_bytes = 0;
};

// One forward/backward of a perturbed dit-tiny (the zero-initialised layers take part) at `level`.
StepResult dit_step(fd::DiTRecompute level, flame::Device dev, std::optional<DType> amp, int64_t batch = 2,
                    int64_t mlp_blocks = -1) {
  fd::DiTConfig cfg = fd::dit_config("dit-tiny");
  cfg.recompute = level;
  cfg.recompute_mlp_blocks = mlp_blocks;
  fd::DiT model(cfg, 5);
  fd_test::perturb(model, 0.05, 6);
  model.to(dev);
  EXPECT_EQ(model.recompute(), level);
  flame::Generator gen(7);
  const Tensor x = fd_test::rand_images(batch, 1, 28, dev, &gen);
  const Tensor t = Tensor::rand({batch}, {DType::f32, dev}, &gen);
  const Tensor y = fd_test::rand_labels(batch, 10, dev, &gen);
  const Tensor target = Tensor::randn({batch, 1, 28, 28}, 0.0, 1.0, {DType::f32, dev}, &gen);
  Tensor loss;
  {
    std::optional<flame::amp::AutocastGuard> ac;
    if (amp) ac.emplace(*amp, dev.type);
    loss = (model.forward(x, t, y).to(DType::f32) - target).square().mean();
  }
  StepResult r;
  r.saved_bytes = flame::autograd_saved_bytes(loss);
  r.loss = loss.item<double>();
  const flame::Gradients g = loss.backward();
  for (auto& [name, p] : model.named_parameters()) {
    const Tensor gr = g.try_get(p);
    EXPECT_TRUE(gr.defined()) << name;
    r.grads.emplace_back(name, gr.defined() ? gr.to(flame::Device::cpu()).to(DType::f64) : Tensor());
  }
  return r;
}

// max |a - b| <= tol * max(1e-12, max |b|) for each gradient (tol 0: equal).
void expect_match(const StepResult& a, const StepResult& b, double tol, const std::string& what) {
  if (tol == 0.0) {
    EXPECT_EQ(a.loss, b.loss) << what;
  } else {
    EXPECT_NEAR(a.loss, b.loss, tol * std::fabs(b.loss)) << what;
  }
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (std::size_t i = 0; i < a.grads.size(); ++i) {
    const Tensor& ga = a.grads[i].second;
    const Tensor& gb = b.grads[i].second;
    if (!ga.defined() || !gb.defined()) continue;
    const double scale = std::max(1e-12, fd_test::max_abs(gb));
    const double diff = fd_test::max_abs_diff(ga, gb);
    EXPECT_LE(diff, tol * scale) << what << ": " << a.grads[i].first << " (max |g| " << scale << ")";
  }
}

int64_t tokens_x_hidden(int64_t batch) {
  const fd::DiTConfig c = fd::dit_config("dit-tiny");
  return batch * c.tokens() * c.hidden;
}

}  // namespace

TEST(RecomputeDit, ParseAndSetter) {
  EXPECT_EQ(fd::parse_dit_recompute("none"), fd::DiTRecompute::none);
  EXPECT_EQ(fd::parse_dit_recompute("mlp"), fd::DiTRecompute::mlp);
  EXPECT_EQ(fd::parse_dit_recompute("all"), fd::DiTRecompute::all);
  EXPECT_STREQ(fd::dit_recompute_name(fd::DiTRecompute::all), "all");
  try {
    (void)fd::parse_dit_recompute("some");
    ADD_FAILURE() << "no error for an unknown level";
  } catch (const flame::Error& e) {
    EXPECT_NE(std::string(e.what()).find("none, mlp, all"), std::string::npos) << e.what();
  }
  fd::DiT model(fd::dit_config("dit-tiny"), 1);
  EXPECT_EQ(model.recompute(), fd::DiTRecompute::none);
  model.set_recompute(fd::DiTRecompute::mlp);
  EXPECT_EQ(model.recompute(), fd::DiTRecompute::mlp);
  for (auto& b : model.blocks) EXPECT_TRUE(b->mlp->recompute_hidden);
  model.set_recompute(fd::DiTRecompute::none);
  for (auto& b : model.blocks) EXPECT_FALSE(b->mlp->recompute_hidden);

  // mlp:N: the first N blocks only.
  const fd::DiTRecomputeSpec s = fd::parse_dit_recompute_spec("mlp:1");
  EXPECT_EQ(s.level, fd::DiTRecompute::mlp);
  EXPECT_EQ(s.mlp_blocks, 1);
  EXPECT_EQ(fd::dit_recompute_spec_name(s), "mlp:1");
  EXPECT_EQ(fd::parse_dit_recompute_spec("all").level, fd::DiTRecompute::all);
  EXPECT_EQ(fd::parse_dit_recompute_spec("mlp").mlp_blocks, -1);
  model.set_recompute(s);
  ASSERT_GE(model.blocks.size(), 2u);
  for (std::size_t i = 0; i < model.blocks.size(); ++i) EXPECT_EQ(model.blocks[i]->mlp->recompute_hidden, i < 1) << i;
  EXPECT_EQ(fd::dit_recompute_spec_name(model.recompute_spec()), "mlp:1");
  for (const char* bad : {"mlp:", "mlp:x", "mlp:-1", "all:2"}) {
    try {
      (void)fd::parse_dit_recompute_spec(bad);
      ADD_FAILURE() << "no error for " << bad;
    } catch (const flame::Error& e) {
      EXPECT_NE(std::string(e.what()).find("mlp:N"), std::string::npos) << e.what();
    }
  }
  const int64_t depth = static_cast<int64_t>(model.blocks.size());
  try {
    model.set_recompute(fd::DiTRecompute::mlp, depth + 1);
    ADD_FAILURE() << "no error for more blocks than the depth";
  } catch (const flame::Error& e) {
    EXPECT_NE(std::string(e.what()).find("depth"), std::string::npos) << e.what();
  }
  EXPECT_EQ(fd::dit_recompute_spec_name(model.recompute_spec()), "mlp:1");  // unchanged by the refusal
}

// mlp:1 saves exactly one block's hidden activation, with the same loss and gradients.
TEST(RecomputeDit, PartialMlpMatchesNoneCpu) {
  const flame::Device cpu = flame::Device::cpu();
  const StepResult none = dit_step(fd::DiTRecompute::none, cpu, std::nullopt);
  const StepResult one = dit_step(fd::DiTRecompute::mlp, cpu, std::nullopt, 2, 1);
  expect_match(one, none, 0.0, "mlp:1 vs none");
  EXPECT_EQ(none.saved_bytes - one.saved_bytes, static_cast<std::size_t>(tokens_x_hidden(2) * 4 * 4));
}

TEST(RecomputeDit, MatchesNoneCpu) {
  const flame::Device cpu = flame::Device::cpu();
  const StepResult none = dit_step(fd::DiTRecompute::none, cpu, std::nullopt);
  const StepResult mlp = dit_step(fd::DiTRecompute::mlp, cpu, std::nullopt);
  const StepResult all = dit_step(fd::DiTRecompute::all, cpu, std::nullopt);
  expect_match(mlp, none, 0.0, "mlp vs none");
  expect_match(all, none, 0.0, "all vs none");
  // mlp: each block's MLP hidden activation [B*T, 4*hidden] f32 is no longer held.
  const fd::DiTConfig c = fd::dit_config("dit-tiny");
  const std::size_t h_bytes = static_cast<std::size_t>(c.depth * tokens_x_hidden(2) * 4 * 4);
  EXPECT_EQ(none.saved_bytes - mlp.saved_bytes, h_bytes);
  // all: the adaLN outputs too (two per block, one in the final layer, [B, T, hidden] f32 each),
  // less the final layer's [B, 2*hidden] modulation, which only its recipe holds on this path, and
  // the SiLU outputs that linear layers save (SiLU(c) of each block and of the final layer, and the
  // timestep MLP's: [B, hidden] f32 each).
  const std::size_t silu_bytes = static_cast<std::size_t>((c.depth + 2) * 2 * c.hidden * 4);
  const std::size_t n_bytes = static_cast<std::size_t>((2 * c.depth + 1) * tokens_x_hidden(2) * 4) + silu_bytes;
  EXPECT_LE(mlp.saved_bytes - all.saved_bytes, n_bytes);
  EXPECT_GE(mlp.saved_bytes - all.saved_bytes, n_bytes - static_cast<std::size_t>(2 * 2 * c.hidden * 4));
}

TEST(RecomputeDit, MatchesNoneUnderAutocastCpu) {
  const flame::Device cpu = flame::Device::cpu();
  const StepResult none = dit_step(fd::DiTRecompute::none, cpu, DType::bf16);
  const StepResult all = dit_step(fd::DiTRecompute::all, cpu, DType::bf16);
  expect_match(all, none, 0.0, "all vs none, bf16 autocast");
  EXPECT_LT(all.saved_bytes, none.saved_bytes);
}

TEST(RecomputeDit, MatchesNoneCuda) {
  if (!flame::cuda_is_available()) GTEST_SKIP() << "no CUDA device: the CUDA part is skipped (the CPU cases ran)";
  const flame::Device dev = flame::Device::cuda(0);
  for (std::optional<DType> amp : {std::optional<DType>(DType::bf16), std::optional<DType>()}) {
    const std::string tag = amp ? " (bf16 autocast)" : " (f32)";
    const StepResult none = dit_step(fd::DiTRecompute::none, dev, amp, 4);
    const StepResult mlp = dit_step(fd::DiTRecompute::mlp, dev, amp, 4);
    const StepResult all = dit_step(fd::DiTRecompute::all, dev, amp, 4);
    // bf16: h recomputed from rounded pre vs the epilogue's h; f32 may use TF32 GEMMs (same
    // algorithm both ways, so only h's rounding differs).
    const double tol = amp ? 3e-2 : 1e-4;
    expect_match(mlp, none, tol, "mlp vs none" + tag);
    expect_match(all, none, tol, "all vs none" + tag);
    // The adaLN recipes rerun the same kernel: all and mlp differ only in what is saved (up to
    // the order of any atomic sums in the backward kernels, which bf16 roundings can amplify).
    expect_match(all, mlp, amp ? 1e-2 : 1e-5, "all vs mlp" + tag);
    EXPECT_LT(mlp.saved_bytes, none.saved_bytes) << tag;
    EXPECT_LT(all.saved_bytes, mlp.saved_bytes) << tag;
    const fd::DiTConfig c = fd::dit_config("dit-tiny");
    const std::size_t elem = amp ? 2 : 4;
    EXPECT_EQ(none.saved_bytes - mlp.saved_bytes, static_cast<std::size_t>(c.depth * tokens_x_hidden(4) * 4) * elem)
        << tag;
    // The fused adaLN node saves x and scale (the modulation) itself: the outputs go, less at
    // most the final layer's modulation where only its recipe holds it (a composed adaLN).
    const std::size_t n_bytes = static_cast<std::size_t>((2 * c.depth + 1) * tokens_x_hidden(4)) * elem;
    // and the SiLU outputs that linear layers save ((depth + 2) of [B, hidden], at most f32).
    const std::size_t silu_bytes = static_cast<std::size_t>((c.depth + 2) * 4 * c.hidden * 4);
    EXPECT_LE(mlp.saved_bytes - all.saved_bytes, n_bytes + silu_bytes) << tag;
    EXPECT_GE(mlp.saved_bytes - all.saved_bytes, n_bytes - static_cast<std::size_t>(4 * 2 * c.hidden * 4)) << tag;
  }
}
