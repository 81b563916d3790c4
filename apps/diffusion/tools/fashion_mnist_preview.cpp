// Writes a look at the data and at the plotting: a grid of real Fashion-MNIST images, one row per
// class (as the trainer's sample grids are laid out), and a loss plot of the CSV log given, or of
// a made-up decaying curve when none is.
//   fashion_mnist_preview OUT_DIR [--data DIR] [--per-class N] [--scale S] [--csv LOG.csv]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "data.h"
#include "plot.h"
#include "png_image.h"

namespace fd = flame_diffusion;

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help") {
    std::fprintf(stderr, "usage: fashion_mnist_preview OUT_DIR [--data DIR] [--per-class N] [--scale S] [--csv LOG.csv]\n");
    return 2;
  }
  const std::string out = argv[1];
  std::string data_flag, csv;
  int per_class = 10, scale = 2;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "fashion_mnist_preview: %s needs a value\n", a.c_str());
      return 2;
    }
    if (a == "--data") data_flag = argv[++i];
    else if (a == "--per-class") per_class = std::atoi(argv[++i]);
    else if (a == "--scale") scale = std::atoi(argv[++i]);
    else if (a == "--csv") csv = argv[++i];
    else {
      std::fprintf(stderr, "fashion_mnist_preview: unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  try {
    const fd::Dataset test = fd::Dataset::load(fd::find_data_dir(data_flag), fd::Split::test);
    // Class-major: row c holds the first `per_class` test images of class c.
    std::vector<float> v;
    for (int c = 0; c < 10; ++c) {
      int taken = 0;
      for (int64_t i = 0; i < test.n && taken < per_class; ++i) {
        if (test.labels[i] != c) continue;
        for (int64_t p = 0; p < 784; ++p) v.push_back(test.images[i * 784 + p] / 127.5f - 1.0f);
        ++taken;
      }
    }
    const int64_t n = static_cast<int64_t>(v.size()) / 784;
    const flame::Tensor grid = flame::Tensor::from_vec(v, {n, 1, 28, 28});
    fd::save_grid_png(out + "/fashion_mnist.png", grid, {.cols = per_class, .padding = 2, .scale = scale, .row_labels = fd::fashion_mnist_class_names()});

    std::vector<double> steps, losses;
    if (!csv.empty()) {
      const fd::LossLog l = fd::read_loss_csv(csv);
      steps = l.steps;
      losses = l.losses;
    } else {
      std::mt19937_64 rng(1);
      std::normal_distribution<double> noise(0, 0.08);
      for (int s = 1; s <= 3000; ++s) {
        steps.push_back(s);
        losses.push_back((0.12 + 0.9 * std::exp(-s / 300.0)) * (1 + noise(rng)));
      }
    }
    fd::write_loss_plot(out + "/loss.png", steps, losses);
    fd::write_loss_plot(out + "/loss_log.png", steps, losses, {.log_y = true});
    std::printf("wrote %s/fashion_mnist.png, %s/loss.png, %s/loss_log.png\n", out.c_str(), out.c_str(), out.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist_preview: %s\n", e.what());
    return 1;
  }
  return 0;
}
