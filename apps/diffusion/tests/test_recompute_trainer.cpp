// The trainer's --recompute (TrainConfig::recompute, DiTRecompute): the same losses as recompute
// none on the CPU (bit for bit), and under --compile (the whole step captured into a CUDA graph)
// on a GPU, within bf16 rounding; a model with nothing to recompute refuses a level other than
// none. Suite RecomputeDit (the CUDA case skips without a GPU).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>

#include <flame/flame.h>

#include "data_test_util.h"
#include <flame/data/idx.h>
#include "plot.h"
#include "trainer.h"

namespace fd = flame_diffusion;

namespace {

// A synthetic Fashion-MNIST folder of n random images.
std::string write_dataset(const fd_test::ScratchDir& dir, int64_t n) {
  const fd::Dataset d = fd_test::random_dataset(n, 28, 28, 23);
  const std::string folder = dir.file("data");
  std::filesystem::create_directories(folder);
  fd_test::write_bytes(folder + "/train-images-idx3-ubyte", flame::data::encode_idx({n, 28, 28}, d.images));
  fd_test::write_bytes(folder + "/train-labels-idx1-ubyte", flame::data::encode_idx({n}, d.labels));
  return folder;
}

fd::TrainConfig trainer_config(const std::string& data, const std::string& out, const std::string& recompute,
                               bool cuda, int64_t steps) {
  fd::TrainConfig c;
  c.model = "dit-tiny";
  c.steps = steps;
  c.batch = cuda ? 16 : 8;
  c.lr = 1e-3;
  c.data_dir = data;
  c.device = cuda ? "cuda" : "cpu";
  c.amp = cuda ? "bf16" : "off";
  c.compile = cuda;
  c.out = out;
  c.log_every = 1;
  c.sample_every = 0;
  c.ckpt_every = 0;
  c.progress_bar = false;
  c.samples_per_class = 1;
  c.sampling.steps = 2;
  c.recompute = recompute;
  return c;
}

}  // namespace

TEST(RecomputeDit, TrainerFlagCpu) {
  fd_test::ScratchDir dir;
  const std::string data = write_dataset(dir, 32);
  const fd::TrainResult none = fd::train(trainer_config(data, dir.file("none"), "none", false, 3));
  const fd::TrainResult all = fd::train(trainer_config(data, dir.file("all"), "all", false, 3));
  const fd::LossLog ln = fd::read_loss_csv(none.csv), la = fd::read_loss_csv(all.csv);
  ASSERT_EQ(ln.losses.size(), 3u);
  ASSERT_EQ(la.losses.size(), ln.losses.size());
  for (std::size_t i = 0; i < ln.losses.size(); ++i) EXPECT_EQ(la.losses[i], ln.losses[i]) << "step " << i;
  // A UNet has no DiT recompute levels: the run refuses rather than ignoring the flag.
  fd::TrainConfig unet = trainer_config(data, dir.file("unet"), "mlp", false, 1);
  unet.model = "unet-tiny";
  EXPECT_THROW((void)fd::train(unet), std::exception);
  fd::TrainConfig bad = trainer_config(data, dir.file("bad"), "everything", false, 1);
  EXPECT_THROW((void)fd::train(bad), std::exception);
}

TEST(RecomputeDit, TrainerCompiledCuda) {
  if (!flame::cuda_is_available()) GTEST_SKIP() << "no CUDA device: --compile needs a GPU (the CPU case ran)";
  fd_test::ScratchDir dir;
  const std::string data = write_dataset(dir, 96);
  const int64_t steps = 7;  // 3 eager warm-up steps, the capture, then replays
  const fd::TrainResult none = fd::train(trainer_config(data, dir.file("none"), "none", true, steps));
  for (const char* level : {"mlp", "all"}) {
    const fd::TrainResult r = fd::train(trainer_config(data, dir.file(level), level, true, steps));
    EXPECT_EQ(r.graph_replays, steps - 3) << level << ": the step was not captured (see the run's stderr)";
    const fd::LossLog ln = fd::read_loss_csv(none.csv), lr = fd::read_loss_csv(r.csv);
    ASSERT_EQ(lr.losses.size(), ln.losses.size());
    for (std::size_t i = 0; i < ln.losses.size(); ++i)
      EXPECT_NEAR(lr.losses[i], ln.losses[i], 2e-2 * std::abs(ln.losses[i])) << level << " step " << i;
  }
}
