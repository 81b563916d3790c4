// A complete training loop: a model, autocast, AdamW over two parameter groups, warmup + cosine
// learning rate, gradient clipping, EMA of the weights, atomic checkpoints and resume.
//
//   training_loop [--steps N] [--device cpu|cuda] [--out DIR] [--resume] [--f16]
//
// Run it twice with --resume and a smaller --steps the first time: the second run continues where
// the first stopped, with the same losses an uninterrupted run prints (docs/training.md).
#include <flame/amp.h>
#include <flame/checkpoint.h>
#include <flame/flame.h>
#include <flame/nn.h>
#include <flame/optim/ema.h>
#include <flame/optim/optimizers.h>
#include <flame/optim/scheduler.h>

#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

using namespace flame;

// A small residual MLP block stack with LayerNorm, the shape of a transformer's MLP half.
struct Block : nn::Module {
  std::shared_ptr<nn::LayerNorm> norm;
  std::shared_ptr<nn::Linear> fc1, fc2;
  explicit Block(int64_t d) {
    norm = register_module("norm", std::make_shared<nn::LayerNorm>(std::vector<int64_t>{d}));
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(d, 4 * d));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(4 * d, d));
  }
  std::string name() const override { return "Block"; }
  Tensor forward(const Tensor& x) override { return x + fc2->forward(fc1->forward(norm->forward(x)).gelu()); }
};

struct Net : nn::Module {
  std::shared_ptr<nn::Linear> inp, out;
  std::shared_ptr<nn::ModuleList> blocks;
  Net(int64_t in, int64_t d, int64_t depth, int64_t outs) {
    inp = register_module("inp", std::make_shared<nn::Linear>(in, d));
    blocks = register_module("blocks", std::make_shared<nn::ModuleList>());
    for (int64_t i = 0; i < depth; ++i) blocks->push_back(std::make_shared<Block>(d));
    out = register_module("out", std::make_shared<nn::Linear>(d, outs));
  }
  std::string name() const override { return "Net"; }
  Tensor forward(const Tensor& x) override {
    Tensor h = inp->forward(x);
    for (auto& b : *blocks) h = b->forward(h);
    return out->forward(h);
  }
};

int main(int argc, char** argv) {
  int64_t steps = 300;
  Device dev = cuda_is_available() ? Device::cuda(0) : Device::cpu();
  std::string out = "runs/training_loop";
  bool resume = false, f16 = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) steps = std::stoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--device") && i + 1 < argc) dev = std::string(argv[++i]) == "cuda" ? Device::cuda(0) : Device::cpu();
    else if (!std::strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
    else if (!std::strcmp(argv[i], "--resume")) resume = true;
    else if (!std::strcmp(argv[i], "--f16")) f16 = true;
    else {
      std::fprintf(stderr, "usage: %s [--steps N] [--device cpu|cuda] [--out DIR] [--resume] [--f16]\n", argv[0]);
      return 2;
    }
  }
  const int64_t total_steps = 300;  // the schedule's length (a resumed run keeps it)
  manual_seed(0);
  Net model(16, 128, 4, 1);
  model.to(dev);

  // Weight decay on matrices only: norms and biases in a group without it.
  TensorList decay, no_decay;
  for (auto& [name, p] : model.named_parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  optim::AdamWOptions o{.lr = 3e-3, .weight_decay = 0.05};
  optim::ParamGroup g2 = o.group(no_decay);
  g2.weight_decay = 0.0;
  optim::AdamW opt({o.group(decay), g2}, o);
  auto sched = optim::warmup_cosine(opt, /*warmup_steps=*/30, total_steps, /*eta_min=*/3e-5);
  optim::EMA ema(model.parameters(), {.decay = 0.99, .warmup = true});
  amp::GradScaler scaler({.enabled = f16});  // f16 needs loss scaling; bf16 does not

  Generator data_gen(7);
  Checkpoint ckpt;
  ckpt.add("model", model).add("optimizer", opt).add("scheduler", *sched).add("ema", ema).add("scaler", scaler);
  ckpt.add_generator("data", data_gen);
  if (resume) {
    if (auto last = latest_checkpoint(out)) {
      ckpt.load(*last);
      std::printf("resumed from %s at step %lld\n", last->c_str(), static_cast<long long>(ckpt.progress().step));
    }
  }

  // Autocast on CUDA (bf16, or f16 with the scaler); the CPU run stays in f32.
  const std::optional<DType> low = dev.is_cuda() ? std::optional<DType>(f16 ? DType::f16 : DType::bf16) : std::nullopt;
  for (int64_t& step = ckpt.progress().step; step < std::min(steps, total_steps);) {
    const Tensor x = Tensor::randn({256, 16}, 0.0, 1.0, dev, &data_gen);
    const Tensor y = (x.narrow(1, 0, 8).sin().sum({1}, true) * 0.3).tanh();
    Tensor loss;
    {
      std::optional<amp::AutocastGuard> ac;
      if (low) ac.emplace(*low, DeviceType::cuda);
      loss = mse_loss(model(x), y);  // the loss runs in f32 under autocast
    }
    Gradients grads = scaler.scale(loss).backward();
    scaler.unscale_(opt, grads);                    // true gradients before clipping
    const double norm = clip_grad_norm_(grads, 1.0);
    scaler.step(opt, grads);                        // skips the step on Inf/NaN (f16)
    scaler.update();
    sched->step();
    ema.update(step);
    ++step;
    if (step % 50 == 0) {
      std::printf("step %4lld  loss %.6f  lr %.2e  grad norm %.3f\n", static_cast<long long>(step),
                  loss.item<float>(), opt.lr(0), norm);
      ckpt.save_rotating(out, /*keep_last=*/2);
    }
  }
  model.eval();
  const Tensor x = Tensor::randn({1024, 16}, 0.0, 1.0, dev, &data_gen);
  const Tensor y = (x.narrow(1, 0, 8).sin().sum({1}, true) * 0.3).tanh();
  const float raw = mse_loss(model(x), y).item<float>();
  float averaged = 0;
  {
    auto swapped = ema.swap_in();  // the EMA weights inside this scope
    averaged = mse_loss(model(x), y).item<float>();
  }
  std::printf("held-out loss %.6f (EMA weights %.6f)\n", raw, averaged);
  return 0;
}
