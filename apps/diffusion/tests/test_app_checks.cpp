// The pieces behind flame-diffusion's handling of bad input, run directories and signals (issue #26,
// item 5), tested directly: strict number parsing and the range messages, edit distances and
// suggestions, the run-directory rules, loss.csv cut back for a resume, the debiased EMA of the loss
// plot, JPEG writing, output-path checks and the stop-signal handler. Suite AppChecks.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#ifdef FLAME_DIFFUSION_HAVE_JPEG
#include <cstdio>
#include <jpeglib.h>
#endif

#include "cli_checks.h"
#include "data_test_util.h"
#include "plot.h"
#include "png_image.h"
#include "run_dir.h"
#include "stop_signal.h"

namespace fd = flame_diffusion;
namespace fs = std::filesystem;
using fd_test::ScratchDir;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

void touch(const std::string& path, const std::string& text = "x") {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

TEST(AppChecks, IntegersAreDecimalAndNeverClamped) {
  EXPECT_EQ(fd::parse_int64("0"), 0);
  EXPECT_EQ(fd::parse_int64("+17"), 17);
  EXPECT_EQ(fd::parse_int64("-3"), -3);
  EXPECT_EQ(fd::parse_int64("9223372036854775807"), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(fd::parse_int64("-9223372036854775808"), std::numeric_limits<int64_t>::min());
  // strtoll would clamp these two to the limits, and read 0x10 as 16 and 010 as 8.
  for (const char* bad : {"9223372036854775808", "99999999999999999999", "-9223372036854775809", "0x10", "1e3",
                          "", "-", "12 ", " 12", "1.0", "١"}) {
    EXPECT_FALSE(fd::parse_int64(bad).has_value()) << bad;
  }
  EXPECT_EQ(fd::parse_int64("010"), 10);
  EXPECT_EQ(fd::parse_finite("2.5e-3"), 2.5e-3);
  for (const char* bad : {"nan", "inf", "-inf", "1e999", "", " 1", "1x", "0x"}) EXPECT_FALSE(fd::parse_finite(bad).has_value()) << bad;
}

TEST(AppChecks, RangeMessagesNameFlagValueAndRange) {
  EXPECT_EQ(fd::check_int("--steps", "5", 1, 10, "an integer from 1 to 10"), "");
  EXPECT_EQ(fd::check_int("--steps", "0", 1, 10, "an integer from 1 to 10"), "--steps must be an integer from 1 to 10 (got 0)");
  EXPECT_EQ(fd::check_int("--steps", "11", 1, 10, "an integer from 1 to 10"), "--steps must be an integer from 1 to 10 (got 11)");
  EXPECT_EQ(fd::check_int("--steps", "99999999999999999999", 1, std::numeric_limits<int64_t>::max(), "a positive integer"),
            "--steps must be a positive integer (got 99999999999999999999, which is outside the 64-bit integer range "
            "-9223372036854775808 .. 9223372036854775807)");
  EXPECT_EQ(fd::check_int("--n", "two", 1, 9, "an integer from 1 to 9"),
            "--n must be an integer from 1 to 9 (got two, which is not a whole number in decimal digits)");
  EXPECT_EQ(fd::check_real("--ema", "1", 0, 1, false, true, "below 1"), "--ema must be below 1 (got 1)");
  EXPECT_EQ(fd::check_real("--ema", "0", 0, 1, false, true, "below 1"), "");
  EXPECT_EQ(fd::check_real("--lr", "0", 0, 1, true, false, "positive"), "--lr must be positive (got 0)");
  EXPECT_EQ(fd::check_real("--lr", "1", 0, 1, true, false, "positive"), "");
  EXPECT_EQ(fd::check_real("--cfg", "-inf", 0, 9, false, false, "from 0 to 9"),
            "--cfg must be from 0 to 9 (got -inf, which is not a finite number)");
}

TEST(AppChecks, EditDistanceAndNearest) {
  EXPECT_EQ(fd::edit_distance("", ""), 0u);
  EXPECT_EQ(fd::edit_distance("abc", ""), 3u);
  EXPECT_EQ(fd::edit_distance("kitten", "sitting"), 3u);  // the textbook case
  EXPECT_EQ(fd::edit_distance("trian", "train"), 1u);     // a swap of neighbours is one edit
  EXPECT_EQ(fd::edit_distance("ca", "abc"), 3u);          // optimal string alignment: no edit of a swapped pair
  EXPECT_EQ(fd::edit_distance("flaw", "lawn"), 2u);
  const std::vector<std::string> cmds = {"train", "finetune", "sample", "export"};
  EXPECT_EQ(fd::nearest("trian", cmds), "train");
  EXPECT_EQ(fd::nearest("sampel", cmds), "sample");
  EXPECT_EQ(fd::nearest("exprot", cmds), "export");
  EXPECT_EQ(fd::nearest("fine-tune", cmds), "finetune");
  EXPECT_FALSE(fd::nearest("xyzzy", cmds).has_value());
  EXPECT_FALSE(fd::nearest("t", cmds).has_value());  // too short to guess from
  EXPECT_EQ(fd::nearest("--stpes", {"--seed", "--steps", "--sample-steps"}), "--steps");
}

// Note [Run directories]: what counts as a run, the refusal, and what --overwrite removes.
TEST(AppChecks, RunDirectoryRulesRemoveOnlyTheTrainersFiles) {
  ScratchDir dir;
  const std::string out = dir.file("run");
  fs::create_directories(out);
  EXPECT_TRUE(fd::run_files(out).empty());
  touch(out + "/notes.txt");
  touch(out + "/loss.csv.bak");
  touch(out + "/checkpoints/ckpt-12.safetensors");         // not 10 digits: not the trainer's
  touch(out + "/checkpoints/mine.safetensors");
  EXPECT_TRUE(fd::run_files(out).empty());
  EXPECT_NO_THROW(fd::prepare_run_dir(out, false, false, "train"));  // nothing of a run: no refusal

  const std::vector<std::string> run = {"checkpoints/.ckpt-0000000020.safetensors.flame-tmp.123.0",
                                        "checkpoints/ckpt-0000000010.safetensors",
                                        "checkpoints/ckpt-0000000020.safetensors",
                                        "lora.safetensors",
                                        "loss.csv",
                                        "loss.png",
                                        "loss.rank1.csv",
                                        "samples.png",
                                        "samples.png.tmp"};
  for (const auto& f : run) touch(out + "/" + f);
  EXPECT_EQ(fd::run_files(out), run);
  try {
    fd::prepare_run_dir(out, false, false, "train");
    ADD_FAILURE() << "no refusal";
  } catch (const fd::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("train: " + out + " already holds a run (checkpoints/.ckpt-"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find(" and 3 more); pass --resume"), std::string::npos) << e.what();
  }
  EXPECT_THROW(fd::prepare_run_dir(out, true, true, "train"), fd::UsageError);
  EXPECT_NO_THROW(fd::prepare_run_dir(out, true, false, "train"));  // --resume: continue, nothing removed
  EXPECT_EQ(fd::run_files(out).size(), run.size());
  fd::prepare_run_dir(out, false, true, "train");
  EXPECT_TRUE(fd::run_files(out).empty());
  for (const char* kept : {"notes.txt", "loss.csv.bak", "checkpoints/ckpt-12.safetensors", "checkpoints/mine.safetensors"})
    EXPECT_TRUE(fs::exists(out + "/" + kept)) << kept;

  // Newest first, temporaries and foreign names left out.
  touch(out + "/checkpoints/ckpt-0000000100.safetensors");
  touch(out + "/checkpoints/ckpt-0000000009.safetensors");
  EXPECT_EQ(fd::checkpoint_files(out + "/checkpoints"),
            (std::vector<std::string>{out + "/checkpoints/ckpt-0000000100.safetensors",
                                      out + "/checkpoints/ckpt-0000000009.safetensors"}));
  EXPECT_TRUE(fd::checkpoint_files(dir.file("none")).empty());
}

TEST(AppChecks, LossCsvIsCutBackToTheResumedStep) {
  ScratchDir dir;
  const std::string path = dir.file("loss.csv");
  EXPECT_EQ(fd::truncate_loss_csv(path, 3), 0);  // no file: nothing to do
  {
    fd::CsvLogger log(path);
    for (int s = 1; s <= 5; ++s) log.log(s, 1.0 / s, 1e-3, 0.5, 0.1 * s);
  }
  std::ofstream(path, std::ios::app) << "6,0.1";  // a row cut short by a kill
  const std::string before = slurp(path);
  EXPECT_EQ(fd::truncate_loss_csv(path, 3), 3);
  const fd::LossLog l = fd::read_loss_csv(path);
  EXPECT_EQ(l.steps, (std::vector<double>{1, 2, 3}));
  EXPECT_NEAR(l.losses[2], 1.0 / 3, 1e-9);  // written with 9 significant digits
  EXPECT_EQ(slurp(path), before.substr(0, before.find("4,")));  // the kept rows byte for byte
  EXPECT_EQ(fd::truncate_loss_csv(path, 3), 0);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  {
    fd::CsvLogger log(path, /*append=*/true);  // the resumed run goes on at step 4
    log.log(4, 0.2, 1e-3, 0.5, 1.0);
  }
  EXPECT_EQ(fd::read_loss_csv(path).steps, (std::vector<double>{1, 2, 3, 4}));
  std::ofstream(dir.file("bad.csv")) << "epoch,loss\n1,2\n";
  EXPECT_THROW(fd::truncate_loss_csv(dir.file("bad.csv"), 0), std::runtime_error);
}

// The plot's smoothed line: m_t = a m_{t-1} + (1 - a) x_t from 0, divided by 1 - a^t.
TEST(AppChecks, LossPlotEmaIsDebiased) {
  const double a = 0.9;
  const std::vector<double> x = {4.0, 2.0, NAN, 1.0, 3.0};
  const std::vector<double> e = fd::ema_smooth(x, a);
  ASSERT_EQ(e.size(), x.size());
  EXPECT_DOUBLE_EQ(e[0], 4.0);                                   // the first value itself, not a^1 of it
  EXPECT_NEAR(e[1], (a * 4.0 + 2.0) / (1 + a), 1e-12);          // weights a and 1, normalised
  EXPECT_TRUE(std::isnan(e[2]));                                // carried, and no step of the average
  EXPECT_NEAR(e[3], (a * a * 4.0 + a * 2.0 + 1.0) / (1 + a + a * a), 1e-12);
  EXPECT_NEAR(e[4], (a * a * a * 4.0 + a * a * 2.0 + a * 1.0 + 3.0) / (1 + a + a * a + a * a * a), 1e-12);
  // A constant series stays at its value from the first point (the biased EMA started at 0 would
  // rise towards it; one started at the first value would be flat at it whatever came next).
  for (double v : fd::ema_smooth(std::vector<double>(50, 0.25), 0.98)) EXPECT_NEAR(v, 0.25, 1e-12);
  const std::vector<double> steps_down = fd::ema_smooth({1.0, 0.0, 0.0}, 0.98);
  EXPECT_NEAR(steps_down[1], 0.98 / 1.98, 1e-12);  // moves at once, not 2% of the way
  EXPECT_EQ(fd::ema_smooth({5.0, 6.0}, 0.0), (std::vector<double>{5.0, 6.0}));
}

TEST(AppChecks, OutputImagePathsAreCheckedBeforeTheWork) {
  ScratchDir dir;
  EXPECT_EQ(fd::image_format_of("a/b.png", "--out"), fd::ImageFormat::png);
  EXPECT_EQ(fd::image_format_of("B.PNG", "--out"), fd::ImageFormat::png);
  const auto expect_message = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "no error; expected " << part;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect_message([&] { fd::check_output_image_path(dir.file("grid.bmp"), "--out"); }, "unsupported image type '.bmp'; write .png, .jpg or .jpeg");
  expect_message([&] { fd::check_output_image_path(dir.file("grid"), "--out"); }, "no file extension");
  expect_message([&] { fd::check_output_image_path(dir.file("no/grid.png"), "--out"); },
                 "the folder " + dir.file("no") + " does not exist");
  fs::create_directories(dir.file("d.png"));
  expect_message([&] { fd::check_output_image_path(dir.file("d.png"), "--out"); }, "is a folder");
  touch(dir.file("f"));
  expect_message([&] { fd::check_output_image_path(dir.file("f/grid.png"), "--out"); }, "is not a folder");
  EXPECT_NO_THROW(fd::check_output_image_path(dir.file("grid.png"), "--out"));
}

#ifdef FLAME_DIFFUSION_HAVE_JPEG
// JPEG through libjpeg, read back with libjpeg's decoder: size, channels, and pixels within the
// loss of quality 95 on a smooth image.
fd::Image read_jpeg(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  EXPECT_NE(f, nullptr);
  jpeg_decompress_struct c;
  jpeg_error_mgr err;
  c.err = jpeg_std_error(&err);
  jpeg_create_decompress(&c);
  jpeg_stdio_src(&c, f);
  jpeg_read_header(&c, TRUE);
  jpeg_start_decompress(&c);
  fd::Image img(static_cast<int>(c.output_width), static_cast<int>(c.output_height), c.output_components);
  while (c.output_scanline < c.output_height) {
    JSAMPROW row = img.at(0, static_cast<int>(c.output_scanline));
    jpeg_read_scanlines(&c, &row, 1);
  }
  jpeg_finish_decompress(&c);
  jpeg_destroy_decompress(&c);
  std::fclose(f);
  return img;
}

TEST(AppChecks, JpegIsRealJpeg) {
  ScratchDir dir;
  for (int channels : {1, 3}) {
    SCOPED_TRACE(channels);
    fd::Image img(40, 24, channels);
    for (int y = 0; y < img.height; ++y)
      for (int x = 0; x < img.width; ++x)
        for (int ch = 0; ch < channels; ++ch) img.at(x, y)[ch] = static_cast<uint8_t>(40 + 3 * x + 2 * y + 20 * ch);
    const std::string path = dir.file(channels == 1 ? "g.jpg" : "c.jpeg");
    fd::write_image(path, img);
    EXPECT_FALSE(fs::exists(path + ".tmp"));
    const std::string bytes = slurp(path);
    ASSERT_GE(bytes.size(), 4u);
    EXPECT_EQ(bytes.substr(0, 3), std::string("\xff\xd8\xff"));
    const fd::Image back = read_jpeg(path);
    ASSERT_EQ(back.width, 40);
    ASSERT_EQ(back.height, 24);
    ASSERT_EQ(back.channels, channels);
    int worst = 0;
    for (std::size_t i = 0; i < img.pixels.size(); ++i) worst = std::max(worst, std::abs(int(img.pixels[i]) - int(back.pixels[i])));
    EXPECT_LE(worst, 10);
  }
  EXPECT_THROW(fd::write_jpeg(dir.file("q.jpg"), fd::Image(4, 4, 1), 0), std::runtime_error);
  EXPECT_THROW(fd::write_jpeg(dir.file("no/q.jpg"), fd::Image(4, 4, 1)), std::runtime_error);
}
#endif

// Note [Graceful stop]: the first signal only sets the flag; a second ends the process by that
// signal at once. Run in a child process, which the signals cannot leave in a bad state for the
// other tests.
TEST(AppChecks, FirstSignalSetsTheFlagSecondEndsTheProcess) {
  for (int sig : {SIGINT, SIGTERM}) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      fd::install_stop_handlers();
      if (fd::stop_signal() != 0) ::_exit(3);
      ::raise(sig);
      if (fd::stop_signal() != sig) ::_exit(4);
      try {
        fd::throw_if_stopped("sampling", "nothing was written");
        ::_exit(5);
      } catch (const fd::Interrupted& e) {
        if (e.exit_status() != 128 + sig || std::string(e.what()) != fd::signal_name(sig) + " during sampling; nothing was written")
          ::_exit(6);
      }
      ::raise(sig);  // the second: the default action
      ::_exit(7);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFSIGNALED(status)) << "exited with " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    if (WIFSIGNALED(status)) {
      EXPECT_EQ(WTERMSIG(status), sig);
    }
  }
  EXPECT_EQ(fd::signal_name(SIGINT), "SIGINT");
  EXPECT_EQ(fd::signal_name(SIGTERM), "SIGTERM");
}

}  // namespace
