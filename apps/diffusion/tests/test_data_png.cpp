// PNG writing (read back with libpng's own reader), sample grids, the loss plot and the CSV log.
#include <png.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "data_test_util.h"
#include "plot.h"
#include "png_image.h"

namespace fd = flame_diffusion;
using fd_test::ScratchDir;
using fd_test::test_device;

namespace {

// Reads a PNG with libpng's simplified API (independent of write_png's progressive writer).
fd::Image read_png(const std::string& path, int expect_channels) {
  png_image im;
  std::memset(&im, 0, sizeof im);
  im.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_file(&im, path.c_str())) {
    ADD_FAILURE() << "libpng cannot read " << path << ": " << im.message;
    return {};
  }
  const bool color = (im.format & PNG_FORMAT_FLAG_COLOR) != 0;
  EXPECT_EQ(color, expect_channels == 3) << path;
  EXPECT_EQ(im.format & PNG_FORMAT_FLAG_ALPHA, 0u) << path;
  im.format = expect_channels == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_GRAY;
  fd::Image out(static_cast<int>(im.width), static_cast<int>(im.height), expect_channels);
  if (!png_image_finish_read(&im, nullptr, out.pixels.data(), 0, nullptr)) {
    ADD_FAILURE() << "libpng cannot decode " << path << ": " << im.message;
  }
  return out;
}

fd::Image random_image(int w, int h, int c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  fd::Image img(w, h, c);
  for (auto& p : img.pixels) p = static_cast<uint8_t>(rng());
  return img;
}

bool is(const fd::Image& img, int x, int y, fd::Rgb c) {
  const uint8_t* p = img.at(x, y);
  return p[0] == c.r && p[1] == c.g && p[2] == c.b;
}

// True when a pixel of colour `c` lies within `r` pixels of (x, y).
bool near_colour(const fd::Image& img, double x, double y, fd::Rgb c, int r) {
  const int cx = static_cast<int>(std::lround(x)), cy = static_cast<int>(std::lround(y));
  for (int dy = -r; dy <= r; ++dy) {
    for (int dx = -r; dx <= r; ++dx) {
      const int px = cx + dx, py = cy + dy;
      if (px >= 0 && py >= 0 && px < img.width && py < img.height && is(img, px, py, c)) return true;
    }
  }
  return false;
}

}  // namespace

TEST(DataPng, GrayAndRgbRoundTripThroughLibpng) {
  ScratchDir dir;
  for (int c : {1, 3}) {
    for (auto [w, h] : {std::pair{37, 23}, std::pair{1, 1}, std::pair{200, 3}}) {
      SCOPED_TRACE(std::to_string(w) + "x" + std::to_string(h) + "x" + std::to_string(c));
      const fd::Image img = random_image(w, h, c, 1000 + w * 7 + c);
      const std::string path = dir.file("img.png");
      fd::write_png(path, img);
      const fd::Image back = read_png(path, c);
      EXPECT_EQ(back.width, w);
      EXPECT_EQ(back.height, h);
      EXPECT_EQ(back.pixels, img.pixels);
      EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
    }
  }
}

TEST(DataPng, BadImagesAndPathsRaise) {
  ScratchDir dir;
  const std::string missing = dir.file("no/such/folder/x.png");
  try {
    fd::write_png(missing, random_image(4, 4, 1, 1));
    ADD_FAILURE() << "wrote into a missing folder";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  EXPECT_THROW(fd::write_png(dir.file("a.png"), random_image(4, 4, 2, 1)), std::runtime_error);  // 2 channels
  fd::Image short_pixels = random_image(4, 4, 3, 1);
  short_pixels.pixels.pop_back();
  EXPECT_THROW(fd::write_png(dir.file("b.png"), short_pixels), std::runtime_error);
  EXPECT_THROW(fd::write_png(dir.file("c.png"), fd::Image(0, 4, 1)), std::runtime_error);
  EXPECT_FALSE(std::filesystem::exists(dir.file("a.png")));
}

TEST(DataPng, GridPlacesEveryTileScaledAndPadded) {
  FD_SKIP_IF_NO_DEVICE();
  ScratchDir dir;
  const int64_t n = 7, h = 5, w = 4;
  // Values beyond [-1, 1] too, to see the clamp.
  const flame::Tensor x = flame::Tensor::uniform({n, 1, h, w}, -1.2, 1.2, flame::TensorOptions(test_device()));
  const std::vector<float> v = x.to_vec<float>();
  fd::GridOptions o;
  o.cols = 3;
  o.padding = 2;
  o.scale = 2;
  o.background = 77;
  const fd::Image g = fd::make_grid(x, o);
  ASSERT_EQ(g.channels, 1);
  ASSERT_EQ(g.width, 3 * 8 + 4 * 2);
  ASSERT_EQ(g.height, 3 * 10 + 4 * 2);
  int64_t tile_pixels = 0;
  std::vector<uint8_t> covered(g.pixels.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int x0 = 2 + static_cast<int>(i % 3) * 10, y0 = 2 + static_cast<int>(i / 3) * 12;
    for (int y = 0; y < h * 2; ++y) {
      for (int xx = 0; xx < w * 2; ++xx) {
        const float val = v[(i * h + y / 2) * w + xx / 2];
        ASSERT_EQ(g.at(x0 + xx, y0 + y)[0], fd::to_pixel(val)) << "tile " << i << " at " << xx << "," << y;
        covered[static_cast<std::size_t>((y0 + y) * g.width + x0 + xx)] = 1;
        ++tile_pixels;
      }
    }
  }
  for (std::size_t p = 0; p < g.pixels.size(); ++p) {
    if (!covered[p]) ASSERT_EQ(g.pixels[p], 77) << "padding pixel " << p;
  }
  EXPECT_EQ(tile_pixels, n * h * w * 4);
  EXPECT_EQ(fd::to_pixel(-1.0f), 0);
  EXPECT_EQ(fd::to_pixel(1.0f), 255);
  EXPECT_EQ(fd::to_pixel(0.0f), 128);  // 127.5 rounds up
  EXPECT_EQ(fd::to_pixel(NAN), 0);
  // And through the file.
  fd::save_grid_png(dir.file("grid.png"), x, o);
  EXPECT_EQ(read_png(dir.file("grid.png"), 1).pixels, g.pixels);
  // RGB input keeps its channels.
  const flame::Tensor rgb = flame::Tensor::uniform({2, 3, 3, 3}, -1, 1, flame::TensorOptions(test_device()));
  const fd::Image gr = fd::make_grid(rgb, {.cols = 2, .padding = 0});
  EXPECT_EQ(gr.channels, 3);
  EXPECT_EQ(gr.at(4, 1)[2], fd::to_pixel(rgb.to_vec<float>()[27 + 2 * 9 + 1 * 3 + 1]));
  EXPECT_THROW(fd::make_grid(flame::Tensor::zeros({2, 2, 3, 3})), std::runtime_error);  // 2 channels
  EXPECT_THROW(fd::make_grid(flame::Tensor::zeros({2, 3, 3})), std::runtime_error);     // 3-d
}

TEST(DataPlot, LossCurveIsDrawnWhereTheDataIs) {
  ScratchDir dir;
  std::mt19937_64 rng(5);
  std::normal_distribution<double> noise(0.0, 0.05);
  std::vector<double> steps, losses;
  for (int s = 1; s <= 600; ++s) {
    steps.push_back(s);
    losses.push_back(1.0 / (1.0 + 0.01 * s) * (1 + noise(rng)));
  }
  for (bool log_y : {false, true}) {
    SCOPED_TRACE(log_y ? "log y" : "linear y");
    fd::PlotOptions o;
    o.width = 640;
    o.height = 400;
    o.log_y = log_y;
    const fd::LossPlot plot = fd::draw_loss_plot(steps, losses, o);
    const std::string path = dir.file(log_y ? "log.png" : "lin.png");
    fd::write_png(path, plot.image);
    const fd::Image img = read_png(path, 3);
    ASSERT_EQ(img.width, 640);
    ASSERT_EQ(img.height, 400);
    EXPECT_EQ(img.pixels, plot.image.pixels);
    const fd::PlotFrame& f = plot.frame;
    // The smoothed line passes through its points; the raw one (or the dark line over it) too.
    int raw_hits = 0;
    for (std::size_t i = 0; i < steps.size(); i += 37) {
      EXPECT_TRUE(near_colour(img, f.px(steps[i]), f.py(plot.ema[i]), fd::kPlotEma, 1)) << "EMA at step " << steps[i];
      raw_hits += near_colour(img, f.px(steps[i]), f.py(losses[i]), fd::kPlotRaw, 1) ||
                  near_colour(img, f.px(steps[i]), f.py(losses[i]), fd::kPlotEma, 1);
    }
    EXPECT_GE(raw_hits, 16);  // of 17
    // The dark line is smooth and the curve falls: far above it there is none of its colour.
    int stray = 0;
    for (int x = static_cast<int>(f.px(300)); x < static_cast<int>(f.px(500)); ++x) {
      for (int y = f.top + 40; y < static_cast<int>(f.py(0.6)); ++y) stray += is(img, x, y, fd::kPlotEma);
    }
    EXPECT_EQ(stray, 0);
    // The y range covers the data, and the axes are drawn.
    for (double l : losses) {
      EXPECT_GE(f.py(l), f.top);
      EXPECT_LE(f.py(l), f.bottom);
    }
    EXPECT_TRUE(is(img, f.left, (f.top + f.bottom) / 2, fd::kPlotAxis));
    EXPECT_TRUE(is(img, (f.left + f.right) / 2, f.bottom, fd::kPlotAxis));
  }
  EXPECT_THROW(fd::draw_loss_plot({1, 2}, {1.0}), std::runtime_error);
  EXPECT_THROW(fd::draw_loss_plot({1, 2}, {NAN, INFINITY}), std::runtime_error);
  EXPECT_THROW(fd::draw_loss_plot({1, 2}, {-1.0, 0.0}, {.log_y = true}), std::runtime_error);
  // One point is drawable (the ranges are widened around it).
  const fd::LossPlot one = fd::draw_loss_plot({10}, {0.5});
  EXPECT_TRUE(near_colour(one.image, one.frame.px(10), one.frame.py(0.5), fd::kPlotEma, 1));
}

TEST(DataPlot, FontGlyphsAreDistinctAndDrawn) {
  const std::string chars = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ.,-+:/()[]=%_*'<>";
  std::set<std::vector<uint8_t>> seen;
  for (char c : chars) {
    const uint8_t* g = fd::glyph_rows(c);
    seen.insert(std::vector<uint8_t>(g, g + 7));
  }
  EXPECT_EQ(seen.size(), chars.size()) << "two characters share a glyph";
  EXPECT_EQ(std::vector<uint8_t>(fd::glyph_rows('e'), fd::glyph_rows('e') + 7),
            std::vector<uint8_t>(fd::glyph_rows('E'), fd::glyph_rows('E') + 7));
  fd::Image img(40, 20, 3, 255);
  fd::draw_text(img, 1, 1, "L7", fd::kPlotAxis, 2);
  int dark = 0;
  for (int y = 0; y < img.height; ++y)
    for (int x = 0; x < img.width; ++x) dark += is(img, x, y, fd::kPlotAxis);
  // L: 7 + 4 font pixels; 7: 5 + 6 (one per row below the bar); each 2x2.
  EXPECT_EQ(dark, (11 + 11) * 4);
  EXPECT_EQ(fd::text_width("L7", 2), 22);
}

TEST(DataPlot, CsvLogRoundTripAndAppend) {
  ScratchDir dir;
  const std::string path = dir.file("log.csv");
  {
    fd::CsvLogger log(path);
    log.log(1, 0.75, 1e-4, 2.5, 0.125);
    log.log(2, 0.5, 2e-4, 1.25, 0.25);
    // Flushed per line: readable while the logger is open.
    EXPECT_EQ(fd::read_loss_csv(path).steps.size(), 2u);
  }
  {
    fd::CsvLogger log(path, /*append=*/true);
    log.log(3, 0.25, 3e-4, 0.5, 0.375);
  }
  const fd::LossLog l = fd::read_loss_csv(path);
  EXPECT_EQ(l.steps, (std::vector<double>{1, 2, 3}));
  EXPECT_EQ(l.losses, (std::vector<double>{0.75, 0.5, 0.25}));
  EXPECT_EQ(l.lrs, (std::vector<double>{1e-4, 2e-4, 3e-4}));
  EXPECT_EQ(l.grad_norms, (std::vector<double>{2.5, 1.25, 0.5}));
  EXPECT_EQ(l.seconds, (std::vector<double>{0.125, 0.25, 0.375}));
  // A last line cut short (a killed run) is skipped; a bad line in the middle is an error.
  { std::ofstream(path, std::ios::app) << "4,0.1"; }
  EXPECT_EQ(fd::read_loss_csv(path).steps.size(), 3u);
  { std::ofstream(path, std::ios::app) << "\n5,0.1,1,1,1\n"; }
  EXPECT_THROW(fd::read_loss_csv(path), std::runtime_error);
  EXPECT_THROW((fd::CsvLogger{dir.file("no/dir/log.csv")}), std::runtime_error);
}
