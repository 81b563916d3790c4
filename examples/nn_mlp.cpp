// A user-defined module trained with a few steps of plain SGD: subclass nn::Module, register
// children in the constructor, hold them as typed shared_ptr members, and update the parameters
// with ordinary tensor ops under no-grad.
//
//   nn_mlp [--steps N] [--device cpu|cuda]
#include <flame/flame.h>
#include <flame/nn.h>

#include <cstdio>
#include <cstring>
#include <string>

using namespace flame;

struct Mlp : nn::Module {
  std::shared_ptr<nn::Linear> fc1, fc2;
  std::shared_ptr<nn::Dropout> drop;
  Mlp(int64_t in, int64_t hidden, int64_t out) {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(in, hidden));
    drop = register_module("drop", std::make_shared<nn::Dropout>(0.1));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(hidden, out));
  }
  std::string name() const override { return "Mlp"; }
  Tensor forward(const Tensor& x) override { return fc2->forward(drop->forward(fc1->forward(x).gelu())); }
};

int main(int argc, char** argv) {
  int steps = 200;
  Device dev = cuda_is_available() ? Device::cuda(0) : Device::cpu();
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) {
      steps = std::stoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--device") && i + 1 < argc) {
      dev = std::string(argv[++i]) == "cuda" ? Device::cuda(0) : Device::cpu();
    } else {
      std::fprintf(stderr, "usage: %s [--steps N] [--device cpu|cuda]\n", argv[0]);
      return 2;
    }
  }
  manual_seed(0);
  Mlp model(8, 64, 1);
  model.to(dev);
  std::printf("%s\n%lld parameters on %s\n", model.to_string().c_str(),
              static_cast<long long>(model.num_parameters()), dev.str().c_str());

  Generator gen(1);
  const Tensor x = Tensor::randn({512, 8}, 0.0, 1.0, dev, &gen);
  const Tensor y = x.narrow(1, 0, 4).sin().sum({1}, true) * 0.5;  // a smooth target
  const double lr = 0.05;
  for (int step = 0; step <= steps; ++step) {
    const Tensor loss = mse_loss(model(x), y);
    Gradients grads = loss.backward();
    {
      NoGradGuard no_grad;
      for (Tensor& p : model.parameters()) p.sub_(grads.get(p), lr);
    }
    if (step % 50 == 0) std::printf("step %4d  loss %.6f\n", step, loss.item<float>());
  }
  model.eval();
  std::printf("eval loss %.6f\n", mse_loss(model(x), y).item<float>());
  return 0;
}
