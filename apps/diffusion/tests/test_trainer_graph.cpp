// The trainer's --compile (Note [Compiled training step] in src/trainer.cpp): a few dit-tiny steps
// captured into a CUDA graph equal the eager --no-compile run (losses, weights, EMA, optimizer
// state), and a compiled run resumed from its checkpoint continues like an uninterrupted one.
// Suite TrainerGraph; CUDA only (the cases skip on a machine without a GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <flame/checkpoint.h>
#include <flame/flame.h>
#include <flame/optim/ema.h>
#include <flame/optim/optimizers.h>

#include "data_test_util.h"
#include "embed.h"
#include <flame/data/idx.h>
#include "plot.h"
#include "trainer.h"

namespace fd = flame_diffusion;
using flame::Tensor;

namespace {

// A synthetic Fashion-MNIST folder: n random 28 x 28 images with labels 0..9.
std::string write_dataset(const fd_test::ScratchDir& dir, int64_t n) {
  const fd::Dataset d = fd_test::random_dataset(n, 28, 28, 17);
  const std::string folder = dir.file("data");
  std::filesystem::create_directories(folder);
  fd_test::write_bytes(folder + "/train-images-idx3-ubyte", flame::data::encode_idx({n, 28, 28}, d.images));
  fd_test::write_bytes(folder + "/train-labels-idx1-ubyte", flame::data::encode_idx({n}, d.labels));
  return folder;
}

fd::TrainConfig tiny_config(const std::string& data, const std::string& out, bool compile, int64_t steps,
                            const std::string& schedule = "cosine") {
  fd::TrainConfig c;
  c.model = "dit-tiny";
  c.steps = steps;
  c.batch = 16;
  c.lr = 1e-3;
  c.schedule = schedule;  // cosine: the lr changes every step, so replays must see each value
  c.warmup = 2;
  c.data_dir = data;
  c.device = "cuda";
  c.out = out;
  c.log_every = 1;  // a loss read every step, so the CSVs compare step by step
  c.sample_every = 0;
  c.ckpt_every = 0;
  c.progress_bar = false;
  c.samples_per_class = 1;
  c.sampling.steps = 2;
  c.compile = compile;
  return c;
}

struct RunState {
  std::vector<std::vector<float>> params, shadow, exp_avg;
  std::vector<int64_t> steps;
};

RunState read_state(const std::string& checkpoint) {
  auto model = fd::make_model("dit-tiny", 0);
  flame::optim::AdamW opt(model->parameters(), {});
  flame::optim::EMA ema(model->parameters(), {});
  flame::Checkpoint ck;
  ck.exclude_default_generator();
  ck.add("model", *model);
  ck.add("optimizer", opt);
  ck.add("ema", ema);
  ck.load(checkpoint, {.strict = false});
  RunState s;
  const auto ps = model->parameters();
  for (std::size_t i = 0; i < ps.size(); ++i) {
    s.params.push_back(ps[i].to_vec<float>());
    s.shadow.push_back(ema.shadow()[i].to_vec<float>());
    const Tensor m = opt.state(i, "exp_avg");
    s.exp_avg.push_back(m.defined() ? m.to_vec<float>() : std::vector<float>{});
    s.steps.push_back(opt.param_step(i));
  }
  return s;
}

// bf16 autocast: the two runs share kernels and random streams, so they agree closely; allow for
// a GEMM algorithm or reduction order differing between captured and eager launches.
void expect_close(const RunState& a, const RunState& b, const char* what) {
  ASSERT_EQ(a.params.size(), b.params.size());
  for (std::size_t i = 0; i < a.params.size(); ++i) {
    EXPECT_EQ(a.steps[i], b.steps[i]) << what << " step of param " << i;
    ASSERT_EQ(a.params[i].size(), b.params[i].size());
    for (std::size_t k = 0; k < a.params[i].size(); ++k) {
      ASSERT_NEAR(a.params[i][k], b.params[i][k], 2e-3 * (1.0 + std::abs(b.params[i][k]))) << what << " param " << i << "[" << k << "]";
      ASSERT_NEAR(a.shadow[i][k], b.shadow[i][k], 2e-3 * (1.0 + std::abs(b.shadow[i][k]))) << what << " EMA " << i << "[" << k << "]";
    }
    ASSERT_EQ(a.exp_avg[i].size(), b.exp_avg[i].size());
    // Moments are tiny near zero: compare against the tensor's scale.
    double scale = 1e-12;
    for (float v : b.exp_avg[i]) scale = std::max(scale, static_cast<double>(std::abs(v)));
    for (std::size_t k = 0; k < a.exp_avg[i].size(); ++k)
      ASSERT_NEAR(a.exp_avg[i][k], b.exp_avg[i][k], 2e-2 * scale) << what << " exp_avg " << i << "[" << k << "]";
  }
}

}  // namespace

TEST(TrainerGraph, CompiledStepsEqualEagerSteps) {
  if (!flame::cuda_is_available()) GTEST_SKIP() << "no CUDA device: --compile needs a GPU (CPU runs step eagerly)";
  fd_test::ScratchDir dir;
  const std::string data = write_dataset(dir, 96);
  const int64_t steps = 8;  // 3 eager warm-up steps, the capture, then replays
  const fd::TrainResult eager = fd::train(tiny_config(data, dir.file("eager"), false, steps));
  const fd::TrainResult graph = fd::train(tiny_config(data, dir.file("graph"), true, steps));
  EXPECT_EQ(graph.steps_done, steps);
  EXPECT_EQ(graph.graph_replays, steps - 3) << "the step was not captured (see the run's stderr)";
  EXPECT_EQ(eager.graph_replays, 0);
  const fd::LossLog le = fd::read_loss_csv(eager.csv), lg = fd::read_loss_csv(graph.csv);
  ASSERT_EQ(le.losses.size(), static_cast<std::size_t>(steps));
  ASSERT_EQ(lg.losses.size(), le.losses.size());
  for (std::size_t i = 0; i < le.losses.size(); ++i) {
    EXPECT_EQ(lg.steps[i], le.steps[i]);
    EXPECT_NEAR(lg.losses[i], le.losses[i], 1e-2 * std::abs(le.losses[i])) << "step " << le.steps[i];
  }
  expect_close(read_state(graph.last_checkpoint), read_state(eager.last_checkpoint), "compiled vs eager");
}

TEST(TrainerGraph, CompiledResumeContinuesLikeOneRun) {
  if (!flame::cuda_is_available()) GTEST_SKIP() << "no CUDA device: --compile needs a GPU";
  fd_test::ScratchDir dir;
  const std::string data = write_dataset(dir, 96);
  // A constant schedule (after a 2-step warmup): a cosine one depends on --steps, which differs
  // between the split run's two halves and the whole run.
  const fd::TrainResult whole = fd::train(tiny_config(data, dir.file("whole"), true, 10, "constant"));
  fd::TrainConfig first = tiny_config(data, dir.file("split"), true, 5, "constant");
  (void)fd::train(first);
  fd::TrainConfig second = tiny_config(data, dir.file("split"), true, 10, "constant");
  second.resume = true;
  const fd::TrainResult resumed = fd::train(second);
  EXPECT_EQ(resumed.steps_done, 5);
  EXPECT_GT(resumed.graph_replays, 0);
  // Step by step, the resumed half logs the losses of the whole run's last five steps.
  const fd::LossLog lw = fd::read_loss_csv(whole.csv), ls = fd::read_loss_csv(resumed.csv);
  ASSERT_EQ(lw.losses.size(), 10u);
  ASSERT_EQ(ls.losses.size(), 10u);
  for (std::size_t i = 0; i < 10; ++i) EXPECT_NEAR(ls.losses[i], lw.losses[i], 1e-2 * std::abs(lw.losses[i])) << i;
  expect_close(read_state(resumed.last_checkpoint), read_state(whole.last_checkpoint), "resumed vs whole");
}

TEST(TrainerGraph, CompileFlagIsIgnoredOnCpuAndWithAccumulation) {
  // On the CPU the flag changes nothing (the step runs eagerly); the run completes.
  fd_test::ScratchDir dir;
  const std::string data = write_dataset(dir, 48);
  fd::TrainConfig c = tiny_config(data, dir.file("cpu"), true, 3);
  c.device = "cpu";
  c.amp = "off";
  c.batch = 8;
  c.accum = 2;
  const fd::TrainResult r = fd::train(c);
  EXPECT_EQ(r.steps_done, 3);
  EXPECT_EQ(r.graph_replays, 0);
  EXPECT_TRUE(std::isfinite(r.final_loss));
}
