// The memory profiler on a small residual MLP stack: where the peak of one training step went,
// per op and module, and the JSON trace for plotting. Runs on the GPU when there is one.
//
//   memory_profile [--blocks N] [--batch B] [--width D] [--json out.json]
#include <flame/anomaly.h>
#include <flame/flame.h>
#include <flame/nn.h>
#include <flame/profiler.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

using namespace flame;

// blocks.<i>.attn and blocks.<i>.mlp.{0,1,2} are the module paths the profiler reports.
class Block : public nn::Module {
 public:
  Block(int64_t width, TensorOptions opts) {
    attn = register_module("attn", std::make_shared<nn::Linear>(width, width, true, opts));
    mlp = register_module("mlp", std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
                                     std::make_shared<nn::Linear>(width, 4 * width, true, opts),
                                     std::make_shared<nn::GELU>(),
                                     std::make_shared<nn::Linear>(4 * width, width, true, opts)}));
  }
  std::string name() const override { return "Block"; }
  Tensor forward(const Tensor& x) override {
    Tensor h = x + (*attn)(x).tanh();
    return h + (*mlp)(h);
  }
  std::shared_ptr<nn::Linear> attn;
  std::shared_ptr<nn::Sequential> mlp;
};

class Net : public nn::Module {
 public:
  Net(int64_t n, int64_t width, TensorOptions opts) {
    blocks = register_module("blocks", std::make_shared<nn::ModuleList>());
    for (int64_t i = 0; i < n; ++i) blocks->push_back(std::make_shared<Block>(width, opts));
    head = register_module("head", std::make_shared<nn::Linear>(width, 1, true, opts));
  }
  std::string name() const override { return "Net"; }
  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    for (const auto& b : *blocks) h = (*b)(h);
    return (*head)(h);
  }
  std::shared_ptr<nn::ModuleList> blocks;
  std::shared_ptr<nn::Linear> head;
};

int main(int argc, char** argv) {
  int64_t n = 4, batch = 256, width = 256;
  std::string json_path;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--blocks")) n = std::stoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--batch")) batch = std::stoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--width")) width = std::stoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--json")) json_path = argv[i + 1];
  }
  const Device dev = cuda_is_available() ? Device::cuda(0) : Device::cpu();
  Net net(n, width, TensorOptions(dev));
  Tensor x = Tensor::randn({batch, width}, TensorOptions(dev));
  Tensor y = Tensor::randn({batch, 1}, TensorOptions(dev));

  profiler::MemoryProfiler prof;
  prof.start();
  Gradients grads;
  {
    Tensor loss = (net(x) - y).square().mean();
    grads = loss.backward();
  }
  prof.stop();
  std::cout << prof.report(8);
  if (!json_path.empty()) {
    prof.save_json(json_path);
    std::printf("\ntrace written to %s\n", json_path.c_str());
  }

  // Anomaly mode: the first op making a NaN is named with its position and shapes.
  try {
    DetectAnomalyGuard guard;
    Tensor h = (*(*net.blocks)[0])(x);
    (void)h.log().sum();  // log of negative activations: NaN
  } catch (const Error& e) {
    std::printf("\nanomaly mode caught: %s\n", e.what());
  }
  return 0;
}
