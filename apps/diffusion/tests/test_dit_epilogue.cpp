// The DiT MLP's fused forms (F::mlp_gelu, or F::linear_gelu for fc1 when fc2 has an adapter):
// same values, gradients and parameter names as the unfused fc2(gelu(fc1(x))); a LoRA-wrapped
// layer keeps its own forward and matches the adapter formula.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "dit.h"
#include "model_test_util.h"

namespace fd = flame_diffusion;
using flame::DType;
using flame::Tensor;
using fd_test::test_device;

namespace {

Tensor unfused(fd::DiTMlp& mlp, const Tensor& x) { return mlp.fc2->forward(mlp.fc1->forward(x).gelu(true)); }

double rel_diff(const Tensor& a, const Tensor& b) {
  const double scale = std::max(fd_test::max_abs(b.to(DType::f64)), 1e-12);
  return fd_test::max_abs_diff(a.to(DType::f64), b.to(DType::f64)) / scale;
}

TEST(EpilogueDiT, MlpParameterNamesUnchanged) {
  fd::DiTMlp mlp(16, 64);
  std::vector<std::string> names;
  for (const auto& [n, p] : mlp.named_parameters()) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}));
}

TEST(EpilogueDiT, FusedMlpMatchesUnfusedValuesAndGradients) {
  FD_SKIP_IF_NO_DEVICE();
  const flame::Device dev = test_device();
  fd::DiTMlp mlp(32, 128);
  mlp.to(dev);
  fd_test::perturb(mlp, 0.05, 11);
  flame::Generator gen(12);
  const Tensor x = Tensor::randn({2, 9, 32}, 0.0, 1.0, {DType::f32, dev}, &gen).requires_grad_();
  const Tensor v = Tensor::randn({2, 9, 32}, 0.0, 1.0, {DType::f32, dev}, &gen);
  const Tensor y = mlp.forward(x);
  const Tensor y_ref = unfused(mlp, x);
  EXPECT_LT(rel_diff(y.detach(), y_ref.detach()), 1e-4);
  flame::BackwardOptions o;
  o.grad_output = v;
  const flame::Gradients g = y.backward(o);
  const flame::Gradients g_ref = y_ref.backward(o);
  EXPECT_LT(rel_diff(g.get(x), g_ref.get(x)), 1e-4);
  for (const auto& [name, p] : mlp.named_parameters()) EXPECT_LT(rel_diff(g.get(p), g_ref.get(p)), 1e-4) << name;
}

TEST(EpilogueDiT, FusedMlpUnderBf16Autocast) {
  FD_SKIP_IF_NO_DEVICE();
  const flame::Device dev = test_device();
  fd::DiTMlp mlp(32, 128);
  mlp.to(dev);
  flame::Generator gen(13);
  const Tensor x = Tensor::randn({4, 8, 32}, 0.0, 1.0, {DType::f32, dev}, &gen);
  Tensor y, y_ref;
  {
    flame::amp::AutocastGuard autocast(DType::bf16, dev.type);
    y = mlp.forward(x);
    y_ref = unfused(mlp, x);
  }
  EXPECT_EQ(y.dtype(), DType::bf16);
  EXPECT_LT(rel_diff(y, y_ref), 3e-2);
}

TEST(EpilogueDiT, LoraFc1KeepsUnfusedPathAndMatchesAdapterFormula) {
  FD_SKIP_IF_NO_DEVICE();
  const flame::Device dev = test_device();
  fd::DiTMlp mlp(16, 64);
  mlp.to(dev);
  flame::nn::LoraOptions lo;
  lo.rank = 4;
  lo.alpha = 8.0;
  mlp.fc1->add_lora(lo);
  fd_test::perturb(mlp, 0.1, 14);  // B leaves zero: the adapter contributes
  flame::Generator gen(15);
  const Tensor x = Tensor::randn({3, 5, 16}, 0.0, 1.0, {DType::f32, dev}, &gen);
  const Tensor y = mlp.forward(x);
  // fc1 with its adapter, written out: x W^T + b + s (x A^T) B^T.
  const auto& f1 = *mlp.fc1;
  const Tensor h = (x.matmul(f1.weight().t()) + f1.bias() +
                    x.matmul(f1.lora_A()->weight().t()).matmul(f1.lora_B()->weight().t()) * f1.lora_scaling())
                       .gelu(true);
  const Tensor want = h.matmul(mlp.fc2->weight().t()) + mlp.fc2->bias();
  EXPECT_LT(rel_diff(y.detach(), want.detach()), 1e-4);
  // The adapter's gradients flow (the fused path would have dropped them).
  const flame::Gradients g = y.sum().backward();
  EXPECT_GT(fd_test::max_abs(g.get(f1.lora_A()->weight())), 0.0);
  EXPECT_GT(fd_test::max_abs(g.get(f1.lora_B()->weight())), 0.0);
  std::vector<std::string> names;
  for (const auto& [n, p] : mlp.named_parameters()) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"fc1.weight", "fc1.bias", "fc1.lora_A.weight", "fc1.lora_B.weight",
                                             "fc2.weight", "fc2.bias"}));
}

TEST(EpilogueDiT, LoraFc2KeepsItsAdapter) {
  FD_SKIP_IF_NO_DEVICE();
  const flame::Device dev = test_device();
  fd::DiTMlp mlp(16, 64);
  mlp.to(dev);
  flame::nn::LoraOptions lo;
  lo.rank = 4;
  mlp.fc2->add_lora(lo);
  fd_test::perturb(mlp, 0.1, 16);
  flame::Generator gen(17);
  const Tensor x = Tensor::randn({2, 7, 16}, 0.0, 1.0, {DType::f32, dev}, &gen);
  const Tensor y = mlp.forward(x);
  EXPECT_LT(rel_diff(y.detach(), unfused(mlp, x).detach()), 1e-4);
  const flame::Gradients g = y.sum().backward();
  EXPECT_GT(fd_test::max_abs(g.get(mlp.fc2->lora_B()->weight())), 0.0);
}

}  // namespace
