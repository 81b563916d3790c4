// Safetensors load/save throughput with the GPU (its PyTorch twin: bench_nn_io_torch.py, same
// names, same file size and dtype, same method).
//
// Method: a file of 32 bf16 tensors [4096, 2048] (512 MiB) on local disk; the page cache is warm
// after the first pass, so this measures the host path (mmap reads, pinned staging, DMA) rather
// than the disk. Each timed call is wall clock up to a device synchronize: load = the whole
// load_safetensors(path, cuda); save = save_safetensors of the GPU tensors. One warm-up, then
// the median of 5. Output lines: BENCH {"name": ..., "value": GB/s, "unit": "GB/s", "ms": ...}.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "flame/cuda.h"
#include "flame/flame.h"
#include "flame/io.h"

using namespace flame;

namespace {

constexpr int kTensors = 32;
constexpr int64_t kRows = 4096, kCols = 2048;
constexpr int kReps = 5;

template <class F>
double median_ms(F&& fn) {
  fn();  // warm-up (page cache, pools, pinned buffers)
  std::vector<double> ms;
  for (int r = 0; r < kReps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    cuda::synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void emit(const char* name, double bytes, double ms) {
  std::printf("BENCH {\"name\": \"%s\", \"value\": %.4g, \"unit\": \"GB/s\", \"ms\": %.4f}\n", name,
              bytes / (ms * 1e-3) / 1e9, ms);
  std::fflush(stdout);
}

}  // namespace

int main() {
  if (!cuda_is_available()) {
    std::printf("# bench_nn_io: no CUDA device\n");
    return 0;
  }
  const char* tmp = std::getenv("TMPDIR");
  const std::string path = std::string(tmp ? tmp : "/tmp") + "/flame_bench_io_" + std::to_string(::getpid()) +
                           ".safetensors";
  try {
    StateDict sd;
    for (int i = 0; i < kTensors; ++i) {
      sd.insert("w" + std::to_string(i), Tensor::randn({kRows, kCols}, 0.0, 1.0, Device::cuda()).to(DType::bf16));
    }
    const double bytes = static_cast<double>(sd.nbytes());
    cuda::synchronize();
    emit("safetensors_save_from_cuda_512MiB", bytes, median_ms([&] { io::save_safetensors(path, sd); }));
    emit("safetensors_load_to_cuda_512MiB", bytes, median_ms([&] {
           StateDict back = io::load_safetensors(path, Device::cuda());
           cuda::synchronize();  // the last chunks are still in flight when load returns
         }));
  } catch (const std::exception& e) {
    std::printf("BENCH {\"name\": \"safetensors_load_to_cuda_512MiB\", \"error\": \"see stderr\"}\n");
    std::fprintf(stderr, "bench_nn_io: %s\n", e.what());
    std::remove(path.c_str());
    return 1;
  }
  std::remove(path.c_str());
  return 0;
}
