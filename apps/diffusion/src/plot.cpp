// The loss-curve plot and the CSV log (plot.h).
#include "plot.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <sys/stat.h>

namespace flame_diffusion {
namespace {

void put(Image& img, int x, int y, Rgb c) {
  if (x < 0 || y < 0 || x >= img.width || y >= img.height) return;
  uint8_t* p = img.at(x, y);
  p[0] = c.r;
  p[1] = c.g;
  p[2] = c.b;
}

// A line of width `thick` (a square pen), by Bresenham's walk.
void line(Image& img, int x0, int y0, int x1, int y1, Rgb c, int thick = 1) {
  const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
  const int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
  int err = dx + dy;
  const int lo = -(thick - 1) / 2, hi = thick / 2;
  while (true) {
    for (int a = lo; a <= hi; ++a) {
      for (int b = lo; b <= hi; ++b) put(img, x0 + a, y0 + b, c);
    }
    if (x0 == x1 && y0 == y1) break;
    const int e2 = 2 * err;
    if (e2 >= dy) {
      err += dy;
      x0 += sx;
    }
    if (e2 <= dx) {
      err += dx;
      y0 += sy;
    }
  }
}

// A "nice" tick step (1, 2 or 5 x 10^k) giving about `target` intervals over `range`.
double nice_step(double range, int target) {
  const double raw = range / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
}

std::string format_number(double v, double step) {
  if (v == 0) return "0";
  const double a = std::fabs(v);
  char buf[32];
  if (a >= 1e5 || a < 1e-3) {
    // Mantissa and exponent, e.g. 2E-4, 1.5E+6.
    int e = static_cast<int>(std::floor(std::log10(a)));
    double m = v / std::pow(10.0, e);
    if (std::fabs(std::fabs(m) - 10.0) < 1e-9) {
      m /= 10;
      ++e;
    }
    std::snprintf(buf, sizeof buf, std::fabs(m - std::round(m)) < 1e-6 ? "%.0fE%d" : "%.1fE%d", m, e);
    return buf;
  }
  const int decimals = std::max(0, static_cast<int>(std::ceil(-std::log10(step) - 1e-9)));
  std::snprintf(buf, sizeof buf, "%.*f", std::min(decimals, 6), v);
  return buf;
}

}  // namespace

double PlotFrame::px(double x) const {
  const double t = x_max > x_min ? (x - x_min) / (x_max - x_min) : 0.5;
  return left + t * (right - left);
}

double PlotFrame::py(double y) const {
  const double v = log_y ? std::log10(y) : y;
  const double t = y_max > y_min ? (v - y_min) / (y_max - y_min) : 0.5;
  return bottom - t * (bottom - top);
}

std::vector<double> ema_smooth(const std::vector<double>& values, double alpha) {
  std::vector<double> out(values.size());
  double ema = 0, weight = 1;  // weight = alpha^t after t finite values
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      out[i] = values[i];
      continue;
    }
    ema = alpha * ema + (1 - alpha) * values[i];
    weight *= alpha;
    // Debiased (Adam's bias correction): ema_t started at 0 weighs the values by (1 - alpha) alpha^k,
    // k = 0 .. t-1, which sum to 1 - alpha^t.
    out[i] = ema / (1 - weight);
  }
  return out;
}

LossPlot draw_loss_plot(const std::vector<double>& steps, const std::vector<double>& losses, const PlotOptions& o) {
  if (steps.size() != losses.size()) {
    throw std::runtime_error("loss plot: " + std::to_string(steps.size()) + " steps but " +
                             std::to_string(losses.size()) + " losses");
  }
  if (o.width < 200 || o.height < 150 || o.width > 10000 || o.height > 10000) {
    throw std::runtime_error("loss plot: size " + std::to_string(o.width) + "x" + std::to_string(o.height) +
                             " outside 200x150 .. 10000x10000");
  }
  if (!(o.ema >= 0 && o.ema < 1)) throw std::runtime_error("loss plot: ema " + std::to_string(o.ema) + " not in [0, 1)");
  auto drawable = [&](std::size_t i) {
    return std::isfinite(steps[i]) && std::isfinite(losses[i]) && (!o.log_y || losses[i] > 0);
  };
  LossPlot out;
  out.ema = ema_smooth(losses, o.ema);
  PlotFrame& f = out.frame;
  f.log_y = o.log_y;
  double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    if (!drawable(i)) continue;
    xmin = std::min(xmin, steps[i]);
    xmax = std::max(xmax, steps[i]);
    const double y = o.log_y ? std::log10(losses[i]) : losses[i];
    ymin = std::min(ymin, y);
    ymax = std::max(ymax, y);
  }
  if (!(xmin <= xmax)) throw std::runtime_error("loss plot: no finite point to draw" + std::string(o.log_y ? " (log y needs losses > 0)" : ""));
  if (xmax == xmin) {
    xmin -= 1;
    xmax += 1;
  }
  if (ymax == ymin) {
    const double pad = o.log_y ? 0.5 : std::max(std::fabs(ymin) * 0.1, 1e-3);
    ymin -= pad;
    ymax += pad;
  }
  const double ypad = (ymax - ymin) * 0.05;
  f.x_min = xmin;
  f.x_max = xmax;
  f.y_min = ymin - ypad;
  f.y_max = ymax + ypad;
  f.left = 90;
  f.right = o.width - 25;
  f.top = 45;
  f.bottom = o.height - 55;

  Image& img = out.image;
  img = Image(o.width, o.height, 3, 255);

  // Ticks and grid lines. Linear: nice steps. Log: decades, with 2 and 5 between when few.
  std::vector<std::pair<double, std::string>> yticks;  // value (data units), label
  if (o.log_y) {
    const int d0 = static_cast<int>(std::floor(f.y_min)), d1 = static_cast<int>(std::ceil(f.y_max));
    const bool fine = d1 - d0 <= 3;
    for (int d = d0; d <= d1; ++d) {
      for (double m : fine ? std::vector<double>{1, 2, 5} : std::vector<double>{1}) {
        const double v = m * std::pow(10.0, d);
        if (std::log10(v) >= f.y_min && std::log10(v) <= f.y_max) yticks.emplace_back(v, format_number(v, v / 10));
      }
    }
  } else {
    const double step = nice_step(f.y_max - f.y_min, 6);
    for (double v = std::ceil(f.y_min / step) * step; v <= f.y_max + step * 1e-9; v += step) {
      const double snapped = std::fabs(v) < step * 1e-9 ? 0.0 : v;
      yticks.emplace_back(snapped, format_number(snapped, step));
    }
  }
  for (const auto& [v, label] : yticks) {
    const int y = static_cast<int>(std::lround(f.py(v)));
    line(img, f.left + 1, y, f.right, y, kPlotGrid);
    line(img, f.left - 5, y, f.left, y, kPlotAxis);
    draw_text(img, f.left - 9 - text_width(label), y - 3, label, kPlotAxis);
  }
  const double xstep = std::max(nice_step(f.x_max - f.x_min, 8), 1e-300);
  for (double v = std::ceil(f.x_min / xstep) * xstep; v <= f.x_max + xstep * 1e-9; v += xstep) {
    const int x = static_cast<int>(std::lround(f.px(v)));
    line(img, x, f.top, x, f.bottom - 1, kPlotGrid);
    line(img, x, f.bottom, x, f.bottom + 5, kPlotAxis);
    const std::string label = format_number(std::fabs(v) < xstep * 1e-9 ? 0.0 : v, xstep);
    draw_text(img, x - text_width(label) / 2, f.bottom + 9, label, kPlotAxis);
  }

  // The curves: raw (light, thin) under the smoothed one (dark, thick). A non-drawable point
  // breaks the line.
  for (int pass = 0; pass < 2; ++pass) {
    const std::vector<double>& ys = pass == 0 ? losses : out.ema;
    const Rgb color = pass == 0 ? kPlotRaw : kPlotEma;
    bool have = false;
    int px0 = 0, py0 = 0;
    for (std::size_t i = 0; i < ys.size(); ++i) {
      if (!drawable(i) || !std::isfinite(ys[i]) || (o.log_y && ys[i] <= 0)) {
        have = false;
        continue;
      }
      const int x = static_cast<int>(std::lround(f.px(steps[i])));
      const int y = static_cast<int>(std::lround(std::clamp(f.py(ys[i]), double(f.top), double(f.bottom))));
      if (have) line(img, px0, py0, x, y, color, pass == 0 ? 1 : 2);
      else line(img, x, y, x, y, color, pass == 0 ? 1 : 2);
      px0 = x;
      py0 = y;
      have = true;
    }
  }

  // Axes box, title, labels, legend.
  line(img, f.left, f.top, f.left, f.bottom, kPlotAxis);
  line(img, f.left, f.bottom, f.right, f.bottom, kPlotAxis);
  line(img, f.left, f.top, f.right, f.top, kPlotAxis);
  line(img, f.right, f.top, f.right, f.bottom, kPlotAxis);
  draw_text(img, (o.width - text_width(o.title, 2)) / 2, 12, o.title, kPlotAxis, 2);
  draw_text(img, (f.left + f.right - text_width(o.x_label)) / 2, o.height - 22, o.x_label, kPlotAxis);
  const std::string ylab = o.y_label + (o.log_y ? " (LOG)" : "");
  draw_text(img, 8, f.top - 14, ylab, kPlotAxis);
  const std::string raw_label = "RAW", ema_label = "EMA " + format_number(o.ema, 0.01);
  int lx = f.right - text_width(ema_label) - 40;
  line(img, lx, f.top + 12, lx + 20, f.top + 12, kPlotRaw, 1);
  draw_text(img, lx + 26, f.top + 9, raw_label, kPlotAxis);
  line(img, lx, f.top + 26, lx + 20, f.top + 26, kPlotEma, 2);
  draw_text(img, lx + 26, f.top + 23, ema_label, kPlotAxis);
  return out;
}

void write_loss_plot(const std::string& path, const std::vector<double>& steps, const std::vector<double>& losses,
                     const PlotOptions& options) {
  write_png(path, draw_loss_plot(steps, losses, options).image);
}

// ---------------------------------------------------------------------------------------------
// CSV log

CsvLogger::CsvLogger(const std::string& path, bool append) : path_(path) {
  struct stat st;
  const bool had_content = append && ::stat(path.c_str(), &st) == 0 && st.st_size > 0;
  file_ = std::fopen(path.c_str(), append ? "a" : "w");
  if (file_ == nullptr) {
    throw std::runtime_error("CSV log " + path + ": cannot open for writing (" + std::strerror(errno) + ")");
  }
  if (!had_content) {
    std::fputs("step,loss,lr,grad_norm,time\n", file_);
    std::fflush(file_);
  }
}

CsvLogger::~CsvLogger() {
  if (file_ != nullptr) std::fclose(file_);
}

void CsvLogger::log(int64_t step, double loss, double lr, double grad_norm, double seconds) {
  if (std::fprintf(file_, "%lld,%.9g,%.9g,%.9g,%.3f\n", static_cast<long long>(step), loss, lr, grad_norm, seconds) < 0 ||
      std::fflush(file_) != 0) {
    throw std::runtime_error("CSV log " + path_ + ": write failed (" + std::strerror(errno) + ")");
  }
}

int64_t truncate_loss_csv(const std::string& path, int64_t last_step) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return 0;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("CSV log " + path + ": cannot open (" + std::strerror(errno) + ")");
  std::string text, line_text;
  int64_t removed = 0;
  bool first = true;
  while (std::getline(in, line_text)) {
    if (first) {
      first = false;
      if (line_text.rfind("step,loss", 0) != 0)
        throw std::runtime_error("CSV log " + path + ": line 1 is not the header step,loss,lr,grad_norm,time");
      text += line_text + "\n";
      continue;
    }
    if (line_text.empty()) continue;
    char* end = nullptr;
    const long long step = std::strtoll(line_text.c_str(), &end, 10);
    // A row cut short by a kill has no ',' after its step: dropped as well.
    if (end == line_text.c_str() || *end != ',' || step > last_step || std::count(line_text.begin(), line_text.end(), ',') != 4) {
      ++removed;
      continue;
    }
    text += line_text + "\n";
  }
  in.close();
  if (removed == 0) return 0;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream outf(tmp, std::ios::binary | std::ios::trunc);
    outf << text;
    outf.flush();
    if (!outf) throw std::runtime_error("CSV log " + tmp + ": write failed (" + std::strerror(errno) + ")");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error("CSV log " + path + ": cannot rename " + tmp + " (" + std::strerror(errno) + ")");
  return removed;
}

LossLog read_loss_csv(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("CSV log " + path + ": cannot open (" + std::strerror(errno) + ")");
  LossLog log;
  std::string line_text;
  int line_no = 0;
  while (std::getline(in, line_text)) {
    ++line_no;
    if (line_no == 1) {
      if (line_text.rfind("step,loss", 0) != 0) {
        throw std::runtime_error("CSV log " + path + ": line 1 is not the header step,loss,lr,grad_norm,time");
      }
      continue;
    }
    if (line_text.empty()) continue;
    double v[5];
    std::istringstream ls(line_text);
    std::string cell;
    int k = 0;
    for (; k < 5 && std::getline(ls, cell, ','); ++k) {
      char* end = nullptr;
      v[k] = std::strtod(cell.c_str(), &end);
      if (end == cell.c_str()) k = 99;  // not a number
    }
    if (k != 5) {
      // A line cut short by a kill while it was written is the only one that may be bad: the last.
      if (in.peek() == std::char_traits<char>::eof()) break;
      throw std::runtime_error("CSV log " + path + ": line " + std::to_string(line_no) + " is not 5 numbers: " + line_text);
    }
    log.steps.push_back(v[0]);
    log.losses.push_back(v[1]);
    log.lrs.push_back(v[2]);
    log.grad_norms.push_back(v[3]);
    log.seconds.push_back(v[4]);
  }
  return log;
}

}  // namespace flame_diffusion
