// Trains a two-layer MLP on a synthetic regression task and prints the falling loss.
// Gradients are written out by hand with FLAME ops (see docs/ for the autograd version).
//
//   mlp_regression [--steps N] [--device cpu|cuda]
#include <flame/flame.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

using namespace flame;

int main(int argc, char** argv) {
  int steps = 400;
  Device dev = cuda_is_available() ? Device::cuda(0) : Device::cpu();
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) steps = std::stoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--device") && i + 1 < argc) {
      dev = std::string(argv[++i]) == "cuda" ? Device::cuda(0) : Device::cpu();
    } else {
      std::fprintf(stderr, "usage: %s [--steps N] [--device cpu|cuda]\n", argv[0]);
      return 2;
    }
  }
  std::printf("FLAME %s: two-layer MLP regression on %s\n", version(), dev.str().c_str());

  Generator gen(42);
  const int64_t n = 1024, in = 16, hidden = 128;
  // Targets: y = sum(sin(x @ A), 1) / 4 + small noise.
  Tensor x = Tensor::randn({n, in}, 0.0, 1.0, dev, &gen);
  Tensor a = Tensor::randn({in, 8}, 0.0, 0.5, dev, &gen);
  Tensor y = x.matmul(a).sin().sum({1}, true) / 4.0 + Tensor::randn({n, 1}, 0.0, 0.01, dev, &gen);

  Tensor w1 = Tensor::randn({in, hidden}, 0.0, 1.0 / std::sqrt(double(in)), dev, &gen);
  Tensor b1 = Tensor::zeros({hidden}, dev);
  Tensor w2 = Tensor::randn({hidden, 1}, 0.0, 1.0 / std::sqrt(double(hidden)), dev, &gen);
  Tensor b2 = Tensor::zeros({1}, dev);
  TensorList params = {w1, b1, w2, b2};
  TensorList velocity;
  for (const Tensor& p : params) velocity.push_back(zeros_like(p));
  const double lr = 0.05, momentum = 0.9;

  for (int step = 0; step <= steps; ++step) {
    // Forward.
    Tensor pre = x.matmul(w1) + b1;
    Tensor h = pre.relu();
    Tensor pred = h.matmul(w2) + b2;
    Tensor diff = pred - y;
    Tensor loss = diff.square().mean();
    // Backward by hand: d(mean((pred - y)^2)) / d pred = 2 (pred - y) / n.
    Tensor dpred = diff * (2.0 / double(n));
    Tensor dw2 = h.t().matmul(dpred);
    Tensor db2 = dpred.sum({0});
    Tensor dpre = dpred.matmul(w2.t()) * pre.gt(Tensor::scalar(0.0, dev)).to(DType::f32);
    Tensor dw1 = x.t().matmul(dpre);
    Tensor db1 = dpre.sum({0});
    TensorList grads = {dw1, db1, dw2, db2};
    // SGD with momentum, in place.
    for (std::size_t i = 0; i < params.size(); ++i) {
      velocity[i].mul_(momentum).add_(grads[i]);
      params[i].add_(velocity[i], -lr);
    }
    if (step % 50 == 0) std::printf("step %4d  loss %.6f\n", step, loss.item<float>());
  }
  return 0;
}
