// Gradient checkpointing on a stack of MLP blocks: peak GPU memory of forward + backward with and
// without checkpoint(), and a check that the gradients are the same.
//
//   checkpoint_memory [--blocks N] [--batch B] [--width D]
#include <flame/flame.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

using namespace flame;

int main(int argc, char** argv) {
  int64_t blocks = 8, batch = 4096, width = 1024;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--blocks")) blocks = std::stoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--batch")) batch = std::stoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--width")) width = std::stoll(argv[i + 1]);
  }
  if (!cuda_is_available()) {
    std::printf("checkpoint_memory: no CUDA device; this example measures GPU memory and needs one\n");
    return 0;
  }
  const Device dev = Device::cuda(0);
  Generator gen(1);
  TensorList params;
  for (int64_t b = 0; b < blocks; ++b) {
    params.push_back(Tensor::randn({width, 4 * width}, 0.0, 1.0 / std::sqrt(double(width)), dev, &gen).requires_grad_());
    params.push_back(Tensor::randn({4 * width, width}, 0.0, 0.5 / std::sqrt(double(4 * width)), dev, &gen).requires_grad_());
  }
  Tensor x = Tensor::randn({batch, width}, 0.0, 1.0, dev, &gen);
  auto block = [](const TensorList& in) { return in[0].matmul(in[1]).gelu().matmul(in[2]) + in[0]; };

  auto run = [&](bool use_checkpoint, Gradients& grads) {
    cuda::synchronize();
    const std::size_t base = cuda::memory_stats().allocated_bytes;
    cuda::reset_peak_memory_stats();
    Tensor h = x;
    for (int64_t b = 0; b < blocks; ++b) {
      TensorList in = {h, params[2 * b], params[2 * b + 1]};
      h = use_checkpoint ? checkpoint(block, in) : block(in);
    }
    Tensor loss = h.square().mean();
    grads = loss.backward();
    cuda::synchronize();
    return static_cast<double>(cuda::memory_stats().peak_allocated_bytes - base) / (1 << 20);
  };
  Gradients plain, ckpt;
  const double peak_plain = run(false, plain);
  const double peak_ckpt = run(true, ckpt);
  double max_diff = 0;
  for (const Tensor& p : params) max_diff = std::max(max_diff, (plain.get(p) - ckpt.get(p)).abs().max_all().item<double>());
  std::printf("MLP stack: %lld blocks, batch %lld, width %lld (f32), %s\n", (long long)blocks, (long long)batch,
              (long long)width, dev.str().c_str());
  std::printf("peak memory above the inputs during forward+backward: plain %.1f MiB, checkpointed %.1f MiB\n",
              peak_plain, peak_ckpt);
  std::printf("activation memory saved: %.1f MiB (%.1fx less); max |grad difference| %.3g\n", peak_plain - peak_ckpt,
              peak_plain / std::max(peak_ckpt, 1e-9), max_diff);
  return max_diff < 1e-3 ? 0 : 1;
}
