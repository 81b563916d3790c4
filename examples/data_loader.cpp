// flame::data end to end: a TensorDataset of points (inside or outside a circle), a shuffled
// DataLoader with worker threads and a seeded augmentation, a small classifier trained epoch by
// epoch with range-for, and a resume from the loader's saved state that reproduces the batches
// exactly (docs/data.md).
//
//   data_loader [--epochs N] [--workers W] [--device cpu|cuda] [--idx FILE]
//
// --idx FILE also reads an IDX file (plain or .gz, e.g. Fashion-MNIST's) with data::load_idx.
#include <flame/data.h>
#include <flame/flame.h>
#include <flame/nn.h>
#include <flame/optim/optimizers.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

using namespace flame;

int main(int argc, char** argv) {
  int64_t epochs = 5;
  int workers = 2;
  Device dev = cuda_is_available() ? Device::cuda(0) : Device::cpu();
  std::string idx_path;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--epochs") && i + 1 < argc) epochs = std::stoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--workers") && i + 1 < argc) workers = std::stoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--device") && i + 1 < argc) dev = std::string(argv[++i]) == "cuda" ? Device::cuda(0) : Device::cpu();
    else if (!std::strcmp(argv[i], "--idx") && i + 1 < argc) idx_path = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--epochs N] [--workers W] [--device cpu|cuda] [--idx FILE]\n", argv[0]);
      return 2;
    }
  }
  if (!idx_path.empty()) {
    const Tensor t = data::load_idx(idx_path);
    std::printf("%s: u8 %s, mean %.3f\n", idx_path.c_str(), shape_str(t.sizes()).c_str(),
                t.to(DType::f32).mean().item<float>());
  }

  // 4096 points in [-1, 1]^2; label 1 inside the circle of radius 0.7.
  Generator gen(1);
  const Tensor points = Tensor::uniform({4096, 2}, -1.0, 1.0, DType::f32, &gen);
  const Tensor labels = points.pow(2.0).sum(1).lt(Tensor::scalar(0.49)).to(DType::i64);
  auto dataset = std::make_shared<data::TensorDataset>(points, labels);

  // A seeded augmentation: jitter each batch by noise drawn from its BatchInfo::seed, so the batch
  // at (epoch, batch) is the same in every run and after every resume.
  auto jitter = [](data::Example& batch, const data::BatchInfo& info) {
    Generator g(info.seed);
    batch.data.add_(Tensor::randn(batch.data.sizes(), 0.0, 0.01, DType::f32, &g));
  };
  const data::DataLoaderOptions options{.batch_size = 128, .shuffle = true, .seed = 7, .drop_last = true,
                                        .num_workers = workers, .device = dev};
  data::DataLoader<> loader(dataset, options, {}, jitter);

  nn::Sequential model;
  model.push_back(std::make_shared<nn::Linear>(2, 64));
  model.push_back(std::make_shared<nn::GELU>());
  model.push_back(std::make_shared<nn::Linear>(64, 2));
  model.to(dev);
  optim::AdamW opt(model.parameters(), {.lr = 1e-2});

  data::LoaderState saved;
  for (int64_t epoch = 0; epoch < epochs; ++epoch) {
    Tensor loss_sum = Tensor::zeros({}, {DType::f32, dev});
    Tensor correct = Tensor::zeros({}, {DType::i64, dev});
    for (auto& batch : loader) {  // one epoch: loader.size() batches
      const Tensor logits = model.forward(batch.data);
      const Tensor loss = cross_entropy(logits, batch.target);
      opt.step(loss.backward());
      loss_sum.add_(loss.detach());
      correct.add_(logits.argmax(1).eq(batch.target).to(DType::i64).sum());
      if (epoch == 1 && loader.state().batch == 10) saved = loader.state();  // e.g. for a checkpoint
    }
    std::printf("epoch %lld: loss %.4f, accuracy %.3f (%lld batches)\n", static_cast<long long>(epoch),
                loss_sum.item<float>() / static_cast<float>(loader.size()),
                static_cast<double>(correct.item<int64_t>()) / static_cast<double>(loader.size() * 128),
                static_cast<long long>(loader.size()));
  }

  // Resume: a new loader (here without workers) at the saved state gives the same batches.
  if (epochs < 2) return 0;
  data::DataLoader<> again(dataset, options, {}, jitter);
  loader.load_state(saved);
  again.load_state(saved);
  for (int i = 0; i < 5; ++i) {
    const data::Example a = loader.next(), b = again.next();
    if (a.data.sub(b.data).abs().max().item<float>() != 0.0f || a.target.ne(b.target).any().item<bool>()) {
      std::printf("resume: batch %d differs\n", i);
      return 1;
    }
  }
  std::printf("resume at epoch %lld batch %lld: the same batches\n", static_cast<long long>(saved.epoch),
              static_cast<long long>(saved.batch));
  return 0;
}
