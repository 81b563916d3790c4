// Trains a two-layer MLP on a synthetic regression task and prints the falling loss: autograd
// (backward()), gradient clipping on the returned Gradients, SGD with momentum under NoGradGuard.
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

  Tensor w1 = Tensor::randn({in, hidden}, 0.0, 1.0 / std::sqrt(double(in)), dev, &gen).requires_grad_();
  Tensor b1 = Tensor::zeros({hidden}, dev).requires_grad_();
  Tensor w2 = Tensor::randn({hidden, 1}, 0.0, 1.0 / std::sqrt(double(hidden)), dev, &gen).requires_grad_();
  Tensor b2 = Tensor::zeros({1}, dev).requires_grad_();
  TensorList params = {w1, b1, w2, b2};
  TensorList velocity;
  for (const Tensor& p : params) velocity.push_back(zeros_like(p));
  const double lr = 0.02, momentum = 0.9;

  for (int step = 0; step <= steps; ++step) {
    Tensor pred = (x.matmul(w1) + b1).relu().matmul(w2) + b2;
    Tensor loss = mse_loss(pred, y);
    Gradients grads = loss.backward();
    clip_grad_norm_(grads, 1.0);  // gradients are plain tensors a trainer may edit
    {
      NoGradGuard no_grad;  // the update itself is not part of the graph
      for (std::size_t i = 0; i < params.size(); ++i) {
        velocity[i].mul_(momentum).add_(grads.get(params[i]));
        params[i].add_(velocity[i], -lr);
      }
    }
    if (step % 50 == 0) std::printf("step %4d  loss %.6f\n", step, loss.item<float>());
  }
  return 0;
}
