// Offload benchmark: GPU memory saved and step-time cost of each offload (docs/offload.md) on a
// stack of residual MLP blocks (f32, width 2048, 8 blocks, batch 4096), plus the pinned copy
// bandwidth. Rows (BENCH lines; times: CUDA events between back-to-back calls, warm-up, median):
//   offload_pinned_h2d / offload_pinned_d2h    GB/s of a 256 MiB non-blocking pinned copy
//   offload_step_plain                         a training step (forward, backward, SGD) on the GPU
//   offload_step_activations                   the same under OffloadActivations
//   offload_step_weights                       the blocks streamed (StreamedBlocks), SGD on the host
//   offload_step_optimizer                     HostOptimizer (SGD with momentum on the host)
//   offload_fwdbwd_plain / offload_fwdbwd_weights  forward + backward only (no optimizer): the
//                                              cost of streaming without the host update
// Each step row carries peak_mib (the pool's peak allocated bytes over one step, everything live
// counted: parameters, optimizer state, activations, gradients) and saved_mib (the plain step's
// peak minus this one). The PyTorch twin (bench_train_offload_torch.py) prints the rows PyTorch has an
// equivalent for: the pinned copies, the plain step and save_on_cpu(pin_memory=True).
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include "bench_timing.h"
#include "flame/flame.h"
#include "flame/nn.h"
#include "flame/offload.h"

using namespace flame;

namespace {

constexpr int64_t kWidth = 2048, kBlocks = 8, kBatch = 4096;

struct Block : nn::Module {
  std::shared_ptr<nn::Linear> fc;
  explicit Block(int64_t d) { fc = register_module("fc", std::make_shared<nn::Linear>(d, d)); }
  Tensor forward(const Tensor& x) override { return x + fc->forward(x).tanh(); }
};

// SGD with momentum on the optimizer base (the library's optimizers live elsewhere).
class Sgd : public optim::Optimizer {
 public:
  Sgd(const TensorList& params, double lr, double momentum) {
    optim::ParamGroup g;
    g.params = params;
    g.lr = lr;
    g.momentum = momentum;
    groups_.push_back(g);
  }
  void step(const Gradients& grads) override {
    NoGradGuard no_grad;
    for (const auto& group : groups_) {
      for (Tensor p : group.params) {
        Tensor g = grads.try_get(p);
        if (!g.defined()) continue;
        Tensor& buf = buf_[p.impl()];
        if (!buf.defined()) buf = Tensor::zeros(p.sizes(), {p.dtype(), p.device()});
        buf.mul_(group.momentum).add_(g);
        p.sub_(buf * group.lr);
      }
    }
  }
  std::string name() const override { return "Sgd"; }
  StateDict state_dict() const override { return {}; }
  void load_state_dict(const StateDict&) override {}

 private:
  std::map<const TensorImpl*, Tensor> buf_;
};

std::vector<nn::ModulePtr> make_blocks() {
  std::vector<nn::ModulePtr> b;
  for (int64_t i = 0; i < kBlocks; ++i) b.push_back(std::make_shared<Block>(kWidth));
  return b;
}

TensorList params_of(const std::vector<nn::ModulePtr>& blocks) {
  TensorList ps;
  for (const auto& b : blocks) {
    for (const Tensor& p : b->parameters()) ps.push_back(p);
  }
  return ps;
}

// The pool's peak during one step, counting everything live (parameters, optimizer state,
// inputs): what the step needs from the GPU.
double peak_mib_of(const std::function<void()>& step) {
  cuda::synchronize();
  cuda::reset_peak_memory_stats();
  step();
  cuda::synchronize();
  return static_cast<double>(cuda::memory_stats().peak_allocated_bytes) / (1 << 20);
}

void emit_step(const char* name, double ms, double peak, double plain_peak) {
  std::printf("BENCH {\"name\": \"%s\", \"value\": %.4g, \"unit\": \"ms\", \"peak_mib\": %.1f, \"saved_mib\": %.1f}\n",
              name, ms, peak, plain_peak - peak);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 10, warmup = 2;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--reps") reps = std::atoi(argv[i + 1]);
    if (std::string(argv[i]) == "--warmup") warmup = std::atoi(argv[i + 1]);
  }
  if (!cuda_is_available()) {
    std::printf("# bench_train_offload: no CUDA device; nothing to measure\n");
    return 0;
  }
  std::printf("# bench_train_offload: reps %d, warm-up %d, %lld blocks of %lldx%lld f32, batch %lld\n", reps, warmup,
              static_cast<long long>(kBlocks), static_cast<long long>(kWidth), static_cast<long long>(kWidth),
              static_cast<long long>(kBatch));
  const Device dev = Device::cuda(0);

  {  // pinned copy bandwidth
    const int64_t n = (int64_t{256} << 20) / 4;
    Tensor host = offload::empty_pinned({n});
    host.fill_(1.0f);
    Tensor d = Tensor::empty({n}, dev);
    const double h2d = bench::median_ms(reps, warmup, [&] { d.copy_(host, true); });
    std::printf("BENCH {\"name\": \"offload_pinned_h2d\", \"value\": %.4g, \"unit\": \"GB/s\", \"ms\": %.4f}\n",
                (256.0 * (1 << 20)) / (h2d * 1e-3) / 1e9, h2d);
    const double d2h = bench::median_ms(reps, warmup, [&] { host.copy_(d, true); });
    std::printf("BENCH {\"name\": \"offload_pinned_d2h\", \"value\": %.4g, \"unit\": \"GB/s\", \"ms\": %.4f}\n",
                (256.0 * (1 << 20)) / (d2h * 1e-3) / 1e9, d2h);
    std::fflush(stdout);
  }

  Generator gen(7);
  Tensor x = Tensor::uniform({kBatch, kWidth}, -1.0, 1.0, DType::f32, &gen).to(dev);
  Tensor target = Tensor::uniform({kBatch, kWidth}, -1.0, 1.0, DType::f32, &gen).to(dev);

  // Plain and activation offload: the blocks on the GPU.
  auto blocks = make_blocks();
  for (auto& b : blocks) b->to(dev);
  auto sgd = std::make_unique<Sgd>(params_of(blocks), 1e-3, 0.9);
  auto plain_step = [&](bool offload_acts) {
    Gradients g;
    {
      std::unique_ptr<offload::OffloadActivations> guard;
      if (offload_acts) guard = std::make_unique<offload::OffloadActivations>();
      Tensor h = x;
      for (auto& b : blocks) h = b->forward(h);
      Tensor loss = mse_loss(h, target);
      guard.reset();
      g = loss.backward();
    }
    sgd->step(g);
  };
  {  // forward + backward only: the offloads' cost without the optimizer
    auto fwd_bwd = [&] {
      Tensor h = x;
      for (auto& b : blocks) h = b->forward(h);
      (void)mse_loss(h, target).backward();
    };
    const double peak = peak_mib_of(fwd_bwd);
    emit_step("offload_fwdbwd_plain", bench::median_ms(reps, warmup, fwd_bwd), peak, peak);
  }
  plain_step(false);  // the momentum buffers exist from here on
  const double plain_peak = peak_mib_of([&] { plain_step(false); });
  emit_step("offload_step_plain", bench::median_ms(reps, warmup, [&] { plain_step(false); }), plain_peak, plain_peak);
  const double act_peak = peak_mib_of([&] { plain_step(true); });
  emit_step("offload_step_activations", bench::median_ms(reps, warmup, [&] { plain_step(true); }), act_peak,
            plain_peak);
  sgd.reset();  // its device momentum buffers go

  {  // optimizer-state offload: the same model, SGD state and update on the host
    offload::HostOptimizer host_opt(params_of(blocks), [](const TensorList& m) {
      return std::make_unique<Sgd>(m, 1e-3, 0.9);
    });
    auto step = [&] {
      Tensor h = x;
      for (auto& b : blocks) h = b->forward(h);
      host_opt.step(mse_loss(h, target).backward());
    };
    step();
    const double peak = peak_mib_of(step);
    emit_step("offload_step_optimizer", bench::median_ms(reps, warmup, step), peak, plain_peak);
  }
  blocks.clear();
  cuda::synchronize();

  {  // weight streaming: the blocks in pinned host memory, SGD on the host parameters
    auto sblocks = make_blocks();
    offload::StreamedBlocks streamed(sblocks, dev);
    Sgd host_sgd(streamed.parameters(), 1e-3, 0.9);
    auto step = [&] { host_sgd.step(mse_loss(streamed.forward(x), target).backward()); };
    step();
    const double peak = peak_mib_of(step);
    emit_step("offload_step_weights", bench::median_ms(reps, warmup, step), peak, plain_peak);
    auto fwd_bwd = [&] { (void)mse_loss(streamed.forward(x), target).backward(); };
    const double fb_peak = peak_mib_of(fwd_bwd);
    emit_step("offload_fwdbwd_weights", bench::median_ms(reps, warmup, fwd_bwd), fb_peak, plain_peak);
  }
  return 0;
}
