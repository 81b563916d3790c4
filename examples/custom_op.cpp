// A user-defined differentiable op: a "straight-through" rounding (forward rounds, backward passes
// the gradient unchanged), used inside a tiny optimisation that autograd drives.
#include <flame/flame.h>

#include <cstdio>

using namespace flame;

int main() {
  const Device dev = cuda_is_available() ? Device::cuda(0) : Device::cpu();
  CustomFunction round_ste{
      "round_ste",
      [](const TensorList& in) { return in[0].round(); },                                   // forward
      [](const TensorList&, const Tensor&, const Tensor& grad) { return TensorList{grad}; }};  // backward

  // Fit w so that round(w) * x matches y = 3x: the plain round() has a zero gradient and would not
  // move w; the straight-through op lets the gradient through.
  Generator gen(0);
  Tensor x = Tensor::randn({64}, 0.0, 1.0, dev, &gen);
  Tensor y = x * 3.0;
  Tensor w = Tensor::full({1}, 0.2, dev).requires_grad_();
  for (int step = 0; step <= 40; ++step) {
    Tensor loss = mse_loss(apply_custom(round_ste, {w}) * x, y);
    Gradients g = loss.backward();
    {
      NoGradGuard no_grad;
      w.sub_(g.get(w) * 0.05);
    }
    if (step % 10 == 0) {
      std::printf("step %2d  w %.3f  round(w) %.0f  loss %.4f\n", step, w.item<float>(), w.round().item<float>(),
                  loss.item<float>());
    }
  }
  return w.round().item<float>() == 3.0f ? 0 : 1;
}
