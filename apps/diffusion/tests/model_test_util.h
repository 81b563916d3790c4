#pragma once
// Helpers shared by the model and diffusion tests: the device under test (FLAME_TEST_DEVICE=cuda
// picks GPU 0, as the framework's own suites), random perturbation of a model's weights (so
// zero-initialised layers take part), and a plain SGD step written with FLAME ops.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <flame/flame.h>
#include <flame/nn.h>

#include "embed.h"

namespace fd_test {

inline flame::Device test_device() {
  const char* e = std::getenv("FLAME_TEST_DEVICE");
  return (e && std::string(e) == "cuda") ? flame::Device::cuda(0) : flame::Device::cpu();
}

#define FD_SKIP_IF_NO_DEVICE()                                                             \
  do {                                                                                     \
    if (::fd_test::test_device().is_cuda() && !::flame::cuda_is_available())               \
      GTEST_SKIP() << "FLAME_TEST_DEVICE=cuda but no CUDA device is available";             \
  } while (0)

// f32 convolutions in full f32 (no TF32 tensor cores, which cuDNN may use by default as PyTorch's
// torch.backends.cudnn.allow_tf32) while alive, for comparisons with references computed in f32
// on the CPU; restores the previous setting.
class ConvTf32Off {
 public:
  ConvTf32Off() : was_(flame::cuda::allow_conv_tf32()) { flame::cuda::set_allow_conv_tf32(false); }
  ~ConvTf32Off() { flame::cuda::set_allow_conv_tf32(was_); }
  ConvTf32Off(const ConvTf32Off&) = delete;
  ConvTf32Off& operator=(const ConvTf32Off&) = delete;

 private:
  bool was_;
};

// Adds N(0, std) noise to every parameter (under no-grad).
inline void perturb(flame::nn::Module& m, double std, uint64_t seed) {
  flame::NoGradGuard no_grad;
  flame::Generator gen(seed);
  for (flame::Tensor p : m.parameters()) {
    p.add_(flame::Tensor::randn(p.sizes(), 0.0, std, {p.dtype(), p.device()}, &gen));
  }
}

// p -= lr * grad for every parameter with a gradient.
inline void sgd_step(flame::nn::Module& m, const flame::Gradients& grads, double lr) {
  flame::NoGradGuard no_grad;
  for (flame::Tensor p : m.parameters()) {
    flame::Tensor g = grads.try_get(p);
    if (g.defined()) p.sub_(g * lr);
  }
}

inline double max_abs(const flame::Tensor& t) { return t.abs().max().item<double>(); }
inline double max_abs_diff(const flame::Tensor& a, const flame::Tensor& b) {
  return (a.to(flame::DType::f64) - b.to(flame::DType::f64).to(a.device())).abs().max().item<double>();
}

// Random images in [-1, 1] and labels in [0, classes).
inline flame::Tensor rand_images(int64_t b, int64_t c, int64_t s, flame::Device d, flame::Generator* gen) {
  return flame::Tensor::uniform({b, c, s, s}, -1.0, 1.0, {flame::DType::f32, d}, gen);
}
inline flame::Tensor rand_labels(int64_t b, int64_t classes, flame::Device d, flame::Generator* gen) {
  return flame::Tensor::randint(0, classes, {b}, {flame::DType::i64, d}, gen);
}

// A fresh, empty directory `<tmp>/<prefix>_<name>_<pid>` (suites may run in parallel and shuffled).
inline std::filesystem::path fresh_temp_dir(const std::string& prefix, const std::string& name) {
  std::filesystem::path d =
      std::filesystem::temp_directory_path() / (prefix + "_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

inline void write_text(const std::filesystem::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
}

// The message of the flame::Error that `fn` raises, or "" when it does not raise.
template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const flame::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace fd_test
