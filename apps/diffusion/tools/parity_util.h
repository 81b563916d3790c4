#pragma once
// Pieces the parity tools share: the error of an output against a reference, and a median time.
#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <flame/flame.h>

namespace flame_diffusion::tools {

struct ParityError {
  double abs = 0;  // max |got - ref|
  double rel = 0;  // abs / max |ref|
};

// `tool` names the caller in the shape-mismatch error.
inline ParityError parity_error(const flame::Tensor& got, const flame::Tensor& ref, const char* tool) {
  FLAME_CHECK(got.sizes() == ref.sizes(), tool, "output shape ", got.sizes(), " vs reference ", ref.sizes());
  const flame::Tensor g = got.to(flame::DType::f64, flame::Device::cpu());
  const flame::Tensor r = ref.to(flame::DType::f64, flame::Device::cpu());
  ParityError e;
  e.abs = (g - r).abs().max().item<double>();
  e.rel = e.abs / std::max(1e-30, r.abs().max().item<double>());
  return e;
}

// 3 warm-up calls, then the median of 10 timed ones (CUDA events on a GPU, wall clock on the CPU), ms.
inline double median_ms(const std::function<void()>& fn, bool cuda) {
  for (int i = 0; i < 3; ++i) fn();
  if (cuda) flame::cuda::synchronize();
  std::vector<double> t;
  for (int i = 0; i < 10; ++i) {
    if (cuda) {
      flame::cuda::Event a(true), b(true);
      a.record();
      fn();
      b.record();
      b.synchronize();
      t.push_back(a.elapsed_time(b));
    } else {
      const auto s = std::chrono::steady_clock::now();
      fn();
      t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s).count());
    }
  }
  std::sort(t.begin(), t.end());
  return (t[4] + t[5]) / 2;
}

}  // namespace flame_diffusion::tools
