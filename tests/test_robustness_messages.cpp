// Errors that the API fuzzer found naming an internal op (or none): each must start with the public
// op the caller used and say what was wrong (docs/testing-robustness.md).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "flame/flame.h"
#include "test_util.h"

namespace flame::test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Expects a flame::Error whose message starts with "op: " and contains every one of `parts`.
void expect_message(const std::function<void()>& fn, const std::string& op, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected flame::Error from " << op;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(op + ": ", 0), 0u) << "the message names the wrong op: " << msg;
    for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "no '" << p << "' in: " << msg;
  }
}

Shape ones_of(std::size_t dims) { return Shape(dims, 1); }

TEST(RobustnessMessages, SeventeenDimsNameTheOpAndShape) {
  const Device d = test_device();
  const std::string shape17 = "[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]";
  expect_message([&] { (void)Tensor::zeros(ones_of(17), d); }, "zeros", {shape17, "17 dims", "at most 16 dims"});
  expect_message([&] { (void)Tensor::randn(ones_of(17), 0.0, 1.0, d); }, "randn", {shape17, "17 dims"});
  const Tensor x = Tensor::ones({1}, d);
  expect_message([&] { (void)x.reshape(ones_of(17)); }, "reshape", {shape17, "at most 16 dims"});
  expect_message([&] { (void)x.view(ones_of(17)); }, "view", {shape17});
  const Tensor x16 = Tensor::ones(ones_of(16), d);
  expect_message([&] { (void)x16.unsqueeze(0); }, "unsqueeze", {shape17});
  expect_message([&] { (void)stack({x16, x16}, 0); }, "stack", {"16 dims", "at most 16 dims"});
  // 16 dims are fine, and take part in a kernel.
  EXPECT_EQ((x16 + 1.0).sum().item<double>(), 2.0);
}

TEST(RobustnessMessages, RandomFactoriesNameThemselvesAndNaN) {
  const Device d = test_device();
  expect_message([&] { (void)Tensor::rand({2}, {DType::i64, d}); }, "rand", {"floating dtype", "i64"});
  expect_message([&] { (void)Tensor::rand({-2}, d); }, "rand", {"negative dimension"});
  expect_message([&] { (void)Tensor::uniform({2}, 1.0, 0.0, d); }, "uniform", {"low (1) must not exceed high (0)"});
  expect_message([&] { (void)Tensor::uniform({2}, kNaN, 1.0, d); }, "uniform", {"low is NaN"});
  expect_message([&] { (void)Tensor::uniform({2}, 0.0, kNaN, d); }, "uniform", {"high is NaN"});
  expect_message([&] { (void)Tensor::randn({2}, 0.0, kNaN, d); }, "randn", {"std is NaN"});
  expect_message([&] { (void)Tensor::randn({2}, kNaN, 1.0, d); }, "randn", {"mean is NaN"});
  expect_message([&] { (void)Tensor::randn({2}, 0.0, -1.0, d); }, "randn", {"std must be non-negative, got -1"});
}

TEST(RobustnessMessages, ReductionsJoinsAndIndexingNameThePublicOp) {
  const Device d = test_device();
  expect_message([&] { (void)Tensor::arange(4, d).mean_all(); }, "mean_all", {"floating input", "i64"});
  expect_message([&] { (void)Tensor().mean_all(); }, "mean_all", {"undefined"});
  // Outputs too large to allocate: the error is the op's, not cat's or empty's.
  const int64_t huge = int64_t{1} << 61;
  const Tensor wide = Tensor::zeros({1, 1}, d).expand({1, huge});
  expect_message([&] { (void)stack({wide, wide}, 0); }, "stack", {"more than the limit"});
  const Tensor idx = Tensor::zeros({2}, {DType::i64, d});
  expect_message([&] { (void)index_select(wide, 0, idx); }, "index_select", {"[2, 2305843009213693952]"});
}

TEST(RobustnessMessages, ViewsOfAnUndefinedTensorNameTheView) {
  const Tensor u;
  expect_message([&] { (void)u.unfold(0, 1, 1); }, "unfold", {"undefined tensor"});
  expect_message([&] { (void)u.unflatten(0, {1, 1}); }, "unflatten", {"undefined tensor"});
  expect_message([&] { (void)u.squeeze(); }, "squeeze", {"undefined tensor"});
  expect_message([&] { (void)u.squeeze(0); }, "squeeze", {"undefined tensor"});
  expect_message([&] { (void)u.flatten(); }, "flatten", {"undefined tensor"});
  expect_message([&] { (void)u.permute({0}); }, "permute", {"undefined tensor"});
}

TEST(RobustnessMessages, CustomForwardReturningNothingNamesTheFunction) {
  const Tensor x = Tensor::ones({3}, test_device()).requires_grad_(true);
  CustomFunction fn{"scaled_sum", [](const TensorList&) { return Tensor(); },
                    [](const TensorList& in, const Tensor&, const Tensor& g) { return TensorList{g.expand(in[0].sizes())}; }};
  expect_message([&] { (void)apply_custom(fn, {x}); }, "scaled_sum",
                 {"forward of custom function 'scaled_sum' returned an undefined tensor"});
  {
    NoGradGuard no_grad;  // without recording as well: the output is never silently undefined
    expect_message([&] { (void)apply_custom(fn, {x}); }, "scaled_sum", {"returned an undefined tensor"});
  }
  fn.name.clear();
  expect_message([&] { (void)apply_custom(fn, {x}); }, "apply_custom", {"(unnamed) returned an undefined tensor"});
  expect_message([&] { (void)checkpoint([](const TensorList&) { return Tensor(); }, {x}); }, "checkpoint",
                 {"returned an undefined tensor"});
}

TEST(RobustnessMessages, CudaInABuildWithoutCudaLeadsWithTheCause) {
#ifdef FLAME_TESTS_BUILT_WITH_CUDA
  GTEST_SKIP() << "this build has CUDA; the message is the one of a CPU-only build";
#else
  expect_message([] { (void)Tensor::ones({2, 3}).to(Device::cuda(0)); }, "to",
                 {"this build has no CUDA support", "f32 tensor of shape [2, 3]", "cuda:0"});
  expect_message([] { (void)Tensor::zeros({4}, Device::cuda(0)); }, "zeros", {"this build has no CUDA support"});
#endif
}

}  // namespace
}  // namespace flame::test
