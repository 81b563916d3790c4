// Training step of a small pre-norm transformer (4 layers, width 1024, 16 heads, sequence 256,
// batch 16: LayerNorm, fused qkv Linear, scaled_dot_product_attention, output Linear, LayerNorm,
// MLP 1024 -> 4096 -> 1024 with GELU, residuals) in f32 and under bf16 autocast. One step is
// forward, mse loss, backward and a plain SGD update (p -= lr * g with ops, no grad), as its PyTorch
// twin bench/bench_train_amp_torch.py does with torch.autocast. f32 matmuls run without TF32 on
// both sides (FLAME's default, torch.backends.cuda.matmul.allow_tf32 = False, PyTorch's default).
// Prints the two step times (ms); the bf16 line also carries the ratio fp32 / bf16 ("speedup").
//
// FLAME_BENCH_TRACE=1 also lists the kernels of one more step of each kind (the twin prints
// PyTorch's with torch.profiler): where the step's time goes on each side.
//
// Usage: bench_train_amp [--reps N] [--warmup N]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "bench_timing.h"
#include "flame/amp.h"
#include "flame/flame.h"
#include "flame/nn.h"
#include "flame/profiler.h"

using namespace flame;
using flame::bench::median_ms;

namespace {

constexpr int64_t kLayers = 4, kWidth = 1024, kHeads = 16, kSeq = 256, kBatch = 16;

struct Block : nn::Module {
  std::shared_ptr<nn::LayerNorm> ln1, ln2;
  std::shared_ptr<nn::Linear> qkv, proj, fc1, fc2;
  std::shared_ptr<nn::GELU> act;
  explicit Block(TensorOptions o) {
    ln1 = register_module("ln1", std::make_shared<nn::LayerNorm>(Shape{kWidth}, 1e-5, true, true, o));
    qkv = register_module("qkv", std::make_shared<nn::Linear>(kWidth, 3 * kWidth, true, o));
    proj = register_module("proj", std::make_shared<nn::Linear>(kWidth, kWidth, true, o));
    ln2 = register_module("ln2", std::make_shared<nn::LayerNorm>(Shape{kWidth}, 1e-5, true, true, o));
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(kWidth, 4 * kWidth, true, o));
    act = register_module("act", std::make_shared<nn::GELU>());
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(4 * kWidth, kWidth, true, o));
  }
  std::string name() const override { return "Block"; }
  Tensor forward(const Tensor& x) override {
    const int64_t b = x.size(0), s = x.size(1), hd = kWidth / kHeads;
    // [B, S, 3, H, hd] -> three [B, H, S, hd] views
    const Tensor t = qkv->forward(ln1->forward(x)).view({b, s, 3, kHeads, hd});
    const Tensor q = t.select(2, 0).transpose(1, 2), k = t.select(2, 1).transpose(1, 2),
                 v = t.select(2, 2).transpose(1, 2);
    const Tensor a = nn::functional::scaled_dot_product_attention(q, k, v, Tensor(), 0.0, /*is_causal=*/true);
    const Tensor h = x + proj->forward(a.transpose(1, 2).reshape({b, s, kWidth}));
    return h + fc2->forward(act->forward(fc1->forward(ln2->forward(h))));
  }
};

struct Model : nn::Module {
  std::shared_ptr<nn::ModuleList> blocks;
  std::shared_ptr<nn::LayerNorm> ln_f;
  explicit Model(TensorOptions o) {
    blocks = register_module("blocks", std::make_shared<nn::ModuleList>());
    for (int64_t i = 0; i < kLayers; ++i) blocks->push_back(std::make_shared<Block>(o));
    ln_f = register_module("ln_f", std::make_shared<nn::LayerNorm>(Shape{kWidth}, 1e-5, true, true, o));
  }
  std::string name() const override { return "Model"; }
  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    for (const auto& m : blocks->children()) h = m->forward(h);
    return ln_f->forward(h);
  }
};

}  // namespace

int main(int argc, char** argv) {
  int reps = 10, warmup = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--reps") reps = std::max(1, std::atoi(argv[i + 1]));
    else if (a == "--warmup") warmup = std::max(0, std::atoi(argv[i + 1]));
  }
  if (!flame::cuda_is_available()) {
    std::printf("# bench_train_amp: no CUDA device; nothing to measure\n");
    return 0;
  }
  const Device gpu = Device::cuda(0);
  auto stream = static_cast<cudaStream_t>(flame::cuda::current_stream(0));
  flame::cuda::set_allow_tf32(false);
  std::printf("# bench_train_amp: %lld layers, width %lld, %lld heads, seq %lld, batch %lld; TF32 off; reps %d, "
              "warm-up %d\n",
              static_cast<long long>(kLayers), static_cast<long long>(kWidth), static_cast<long long>(kHeads),
              static_cast<long long>(kSeq), static_cast<long long>(kBatch), reps, warmup);
  manual_seed(0);
  Model model({DType::f32, gpu});
  const TensorList params = model.parameters();
  const Tensor x = Tensor::randn({kBatch, kSeq, kWidth}, {DType::f32, gpu});
  const Tensor target = Tensor::randn({kBatch, kSeq, kWidth}, {DType::f32, gpu});
  const double lr = 1e-4;

  auto step = [&](bool autocast) {
    Tensor loss;
    {
      amp::AutocastGuard ac(DType::bf16, DeviceType::cuda);
      amp::AutocastGuard on(autocast, DeviceType::cuda);
      loss = mse_loss(model.forward(x), target);
    }
    const Gradients g = loss.backward();
    NoGradGuard no_grad;
    for (const Tensor& p : params) {
      Tensor q = p;
      q.add_(g.get(p), -lr);
    }
  };
  // The bf16 line carries the fp32/bf16 ratio ("speedup"; the target is >= 1.8).
  const char* names[2] = {"train_step_transformer_fp32", "train_step_transformer_bf16_autocast"};
  double ms[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    try {
      ms[i] = median_ms(stream, reps, warmup, [&] { step(i == 1); });
      if (i == 1 && ms[0] > 0) {
        std::printf("BENCH {\"name\": \"%s\", \"value\": %.4f, \"unit\": \"ms\", \"speedup\": %.3f}\n", names[i],
                    ms[i], ms[0] / ms[i]);
      } else {
        std::printf("BENCH {\"name\": \"%s\", \"value\": %.4f, \"unit\": \"ms\"}\n", names[i], ms[i]);
      }
      if (std::getenv("FLAME_BENCH_TRACE") != nullptr) {
        flame::profiler::KernelTrace trace;
        trace.start();
        step(i == 1);
        trace.stop();
        std::printf("# kernels of one %s step:\n%s", names[i], trace.summary(25, 100).c_str());
      }
    } catch (const std::exception& e) {
      std::printf("BENCH {\"name\": \"%s\", \"error\": \"failed\"}\n# %s\n", names[i], e.what());
    }
    std::fflush(stdout);
  }
  if (ms[0] > 0 && ms[1] > 0) std::printf("# bench_train_amp: bf16 autocast step %.2fx faster than fp32\n", ms[0] / ms[1]);
  return 0;
}
