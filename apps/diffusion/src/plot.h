#pragma once
// The loss curve, drawn by the program itself (no plotting library, no Python): axes, ticks with
// numbers, a title and axis labels in a small built-in bitmap font (font.cpp), the raw loss as a
// light line and an exponential moving average as a dark line, linear or log y, ranges from the
// data. And the CSV log the curve is drawn from.
//
//   CsvLogger log(out + "/log.csv", /*append=*/resuming);
//   log.log(step, loss, lr, grad_norm, seconds);
//   const LossLog l = read_loss_csv(out + "/log.csv");
//   write_loss_plot(out + "/loss.png", l.steps, l.losses, {.log_y = true});
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "png_image.h"

namespace flame_diffusion {

struct Rgb {
  uint8_t r, g, b;
  bool operator==(const Rgb& o) const { return r == o.r && g == o.g && b == o.b; }
};
inline constexpr Rgb kPlotBackground{255, 255, 255};
inline constexpr Rgb kPlotAxis{0, 0, 0};
inline constexpr Rgb kPlotGrid{225, 225, 225};
inline constexpr Rgb kPlotRaw{150, 185, 235};  // the raw loss: light blue
inline constexpr Rgb kPlotEma{15, 40, 130};    // the smoothed loss: dark blue

struct PlotOptions {
  int width = 800, height = 500;
  std::string title = "TRAINING LOSS";
  std::string x_label = "STEP";
  std::string y_label = "LOSS";
  bool log_y = false;   // logarithmic y axis (values <= 0 are left out)
  double ema = 0.98;    // smoothing of the dark line: debiased EMA (ema_smooth)
};

// Where the data lands: the plot area in pixels and the data ranges it shows.
struct PlotFrame {
  int left = 0, top = 0, right = 0, bottom = 0;  // plot area, inclusive pixel bounds
  double x_min = 0, x_max = 1, y_min = 0, y_max = 1;  // y in log10 units when log_y
  bool log_y = false;
  double px(double x) const;  // data x -> pixel column
  double py(double y) const;  // data y (not log) -> pixel row
};

struct LossPlot {
  Image image;  // RGB
  PlotFrame frame;
  std::vector<double> ema;  // the smoothed values drawn
};

// Debiased exponential moving average: m_t = alpha m_{t-1} + (1 - alpha) x_t from m_0 = 0, shown as
// m_t / (1 - alpha^t) (t counts the finite values so far), so the first point is x_1 and the line
// does not start flat at it. Non-finite inputs are carried over unchanged and do not move the average.
std::vector<double> ema_smooth(const std::vector<double>& values, double alpha);

// Draws the curve of `losses` at `steps` (same length, at least one finite point). Raises
// std::runtime_error on mismatched lengths or no drawable point.
LossPlot draw_loss_plot(const std::vector<double>& steps, const std::vector<double>& losses,
                        const PlotOptions& options = {});
void write_loss_plot(const std::string& path, const std::vector<double>& steps, const std::vector<double>& losses,
                     const PlotOptions& options = {});

// Text in the built-in 5x7 bitmap font (font.cpp): digits, A-Z (lower case drawn as upper case),
// space and . , - + : / ( ) [ ] = % _ * ' < > ; anything else is drawn as '?'. Each glyph cell is
// 6x8 font pixels, each font pixel scale x scale image pixels; (x, y) is the top-left corner.
void draw_text(Image& img, int x, int y, const std::string& text, Rgb color, int scale = 1);
int text_width(const std::string& text, int scale = 1);
// The 7 rows of glyph `c` (bit 4 = leftmost column).
const uint8_t* glyph_rows(char c);

// A CSV log: "step,loss,lr,grad_norm,time" and one line per call (the trainer: one per step),
// flushed at once so a crash or a kill loses nothing. append: keep an existing file (a resumed run) and write no second header.
class CsvLogger {
 public:
  explicit CsvLogger(const std::string& path, bool append = false);
  ~CsvLogger();
  CsvLogger(const CsvLogger&) = delete;
  CsvLogger& operator=(const CsvLogger&) = delete;
  void log(int64_t step, double loss, double lr, double grad_norm, double seconds);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

struct LossLog {
  std::vector<double> steps, losses, lrs, grad_norms, seconds;
};
// Keeps the header and the rows of steps <= last_step (and drops a row cut short by a kill): what a
// run resumed at last_step continues, so no step appears twice. Rewrites the file atomically
// (<path>.tmp, renamed) only when a row goes; returns the rows removed (0 for a missing file).
int64_t truncate_loss_csv(const std::string& path, int64_t last_step);
// Reads a CsvLogger file back (for the plot of a resumed run). Raises naming the file and line.
LossLog read_loss_csv(const std::string& path);

}  // namespace flame_diffusion
