// Losses: errors, closed forms and the ignore_index / label smoothing rules.
#include <cmath>

#include "test_util.h"

namespace flame::test {
namespace {

Tensor targets(const std::vector<int64_t>& v, const Shape& shape) {
  return Tensor::from_vec<int64_t>(v, shape, test_device());
}

TEST(Loss, PointwiseErrorsNameOpShapesAndDtypes) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = Tensor::ones({2, 3}, dev);
  expect_error([&] { mse_loss(x, Tensor::ones({3, 2}, dev)); }, {"mse_loss", "[2, 3]", "[3, 2]"});
  expect_error([&] { l1_loss(x, Tensor::ones({3}, dev)); }, {"l1_loss", "[2, 3]", "[3]"});
  expect_error([&] { binary_cross_entropy_with_logits(x, Tensor::ones({2, 1}, dev)); },
               {"binary_cross_entropy_with_logits", "[2, 3]", "[2, 1]"});
  expect_error([&] { mse_loss(Tensor::ones({2, 3}, {DType::i64, dev}), x); }, {"mse_loss", "i64", "f32"});
  expect_error([&] { binary_cross_entropy_with_logits(x, Tensor::ones({2, 3}, {DType::boolean, dev})); },
               {"binary_cross_entropy_with_logits", "f32", "bool"});
}

TEST(Loss, ClassLossErrorsNameOpShapesAndDtypes) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor logits = Tensor::zeros({3, 4}, dev);
  expect_error([&] { cross_entropy(logits, targets({0, 1}, {2})); }, {"cross_entropy", "[3, 4]", "[2]", "[3]"});
  expect_error([&] { cross_entropy(logits, targets({0, 1, 2}, {3, 1})); }, {"cross_entropy", "[3, 4]", "[3, 1]"});
  expect_error([&] { cross_entropy(logits, Tensor::zeros({3}, {DType::i32, dev})); }, {"cross_entropy", "i32"});
  expect_error([&] { cross_entropy(Tensor::zeros({3, 4}, {DType::i64, dev}), targets({0, 1, 2}, {3})); },
               {"cross_entropy", "i64", "[3, 4]"});
  expect_error([&] { cross_entropy(Tensor::zeros({}, dev), targets({0}, {})); }, {"cross_entropy", "[]"});
  expect_error([&] { cross_entropy(logits, targets({0, 1, 2}, {3}), Reduction::mean, -100, 1.5); },
               {"cross_entropy", "label_smoothing", "1.5"});
  expect_error([&] { cross_entropy(logits, targets({0, 1, 2}, {3}), Reduction::mean, -100, -0.1); },
               {"cross_entropy", "label_smoothing"});
  expect_error([&] { nll_loss(logits, targets({0}, {1})); }, {"nll_loss", "[3, 4]", "[1]"});
}

TEST(Loss, OutOfRangeTargetIsAnError) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor logits = Tensor::zeros({3, 4}, test_device());
  expect_error([&] { cross_entropy(logits, targets({0, 4, 1}, {3})).to_vec<float>(); }, {"4"});
  expect_error([&] { cross_entropy(logits, targets({0, -1, 1}, {3})).to_vec<float>(); }, {"-1"});
  expect_error([&] { nll_loss(logits, targets({7, 0, 1}, {3})).to_vec<float>(); }, {"7"});
  // -1 is fine once it is the ignore_index.
  EXPECT_NO_THROW(cross_entropy(logits, targets({0, -1, 1}, {3}), Reduction::mean, -1).to_vec<float>());
}

TEST(Loss, ClassLossOnCpuNamesTheOp) {
  // On the CPU the target range is checked by the op itself (elsewhere by the gather kernel).
  const Tensor logits = Tensor::zeros({3, 4});
  expect_error([&] { cross_entropy(logits, Tensor::from_vec<int64_t>({0, 4, 1}, {3})); },
               {"cross_entropy", "target 4", "4 classes", "[3, 4]"});
  expect_error([&] { nll_loss(logits, Tensor::from_vec<int64_t>({0, 1, -3}, {3})); }, {"nll_loss", "target -3"});
}

TEST(Loss, UniformLogitsGiveLogC) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (DType dt : {DType::f32, DType::f64}) {
    const Tensor logits = Tensor::full({5, 7}, 0.3, {dt, dev});
    const Tensor t = targets({0, 6, 3, 2, 1}, {5});
    const double log7 = std::log(7.0);
    const double tol = dt == DType::f64 ? 1e-12 : 1e-6;
    EXPECT_NEAR(cross_entropy(logits, t).item<double>(), log7, tol);
    EXPECT_NEAR(cross_entropy(logits, t, Reduction::sum).item<double>(), 5 * log7, 5 * tol);
    // Smoothing mixes -log p_y with the mean over classes of -log p: both are log C here.
    EXPECT_NEAR(cross_entropy(logits, t, Reduction::mean, -100, 0.3).item<double>(), log7, tol);
    const Tensor none = cross_entropy(logits, t, Reduction::none);
    ASSERT_EQ(none.sizes(), (Shape{5}));
    for (double v : none.to_vec<double>()) EXPECT_NEAR(v, log7, tol);
    EXPECT_EQ(none.dtype(), dt);
  }
}

TEST(Loss, IgnoredTargetsAreLeftOutOfTheMean) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor logits = Tensor::from_vec<double>({2, 0, 0, 0, 3, 0, 1, 1, 1}, {3, 3}, dev);
  const Tensor t = targets({0, -100, 2}, {3});
  const double l0 = -(2 - std::log(std::exp(2.0) + 2)), l2 = std::log(3.0);
  const std::vector<double> none = cross_entropy(logits, t, Reduction::none).to_vec<double>();
  EXPECT_NEAR(none[0], l0, 1e-12);
  EXPECT_EQ(none[1], 0.0);
  EXPECT_NEAR(none[2], l2, 1e-12);
  EXPECT_NEAR(cross_entropy(logits, t).item<double>(), (l0 + l2) / 2, 1e-12);
  EXPECT_NEAR(cross_entropy(logits, t, Reduction::sum).item<double>(), l0 + l2, 1e-12);
  // Ignored targets also drop their smoothing term.
  const double eps = 0.2;
  const double s0 = ((2 - std::log(std::exp(2.0) + 2)) * -1 + 2 * std::log(std::exp(2.0) + 2)) / 3;
  const std::vector<double> smooth = cross_entropy(logits, t, Reduction::none, -100, eps).to_vec<double>();
  EXPECT_NEAR(smooth[0], (1 - eps) * l0 + eps * s0, 1e-12);
  EXPECT_EQ(smooth[1], 0.0);
  EXPECT_NEAR(smooth[2], l2, 1e-12);
  // A custom ignore_index.
  EXPECT_NEAR(cross_entropy(logits, targets({0, 1, 2}, {3}), Reduction::mean, 1).item<double>(), (l0 + l2) / 2, 1e-12);
}

TEST(Loss, AllIgnoredMeanIsNan) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor logits = Tensor::randn({2, 3}, 0, 1, test_device());
  const Tensor t = targets({-100, -100}, {2});
  EXPECT_TRUE(std::isnan(cross_entropy(logits, t).item<float>()));
  EXPECT_TRUE(std::isnan(nll_loss(logits, t).item<float>()));
  EXPECT_EQ(cross_entropy(logits, t, Reduction::sum).item<float>(), 0.0f);
}

TEST(Loss, NllOfLogSoftmaxIsCrossEntropy) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor logits = Tensor::randn({6, 5, 3}, 0, 2, {DType::f64, test_device()});
  const Tensor t = Tensor::randint(0, 5, {6, 3}, {DType::i64, test_device()});
  EXPECT_TRUE(all_close(nll_loss(log_softmax(logits, 1), t, Reduction::none), cross_entropy(logits, t, Reduction::none),
                        1e-12, 1e-12));
  // [N, C, d] equals the [N*d, C] layout of the same scores.
  const Tensor flat = logits.permute({0, 2, 1}).reshape({18, 5});
  EXPECT_NEAR(cross_entropy(logits, t).item<double>(), cross_entropy(flat, t.reshape({18})).item<double>(), 1e-12);
}

TEST(Loss, HalfPrecisionKeepsDtype) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor logits = Tensor::full({600, 4}, 1.0, {DType::bf16, test_device()});
  const Tensor t = Tensor::randint(0, 4, {600}, {DType::i64, test_device()});
  const Tensor l = cross_entropy(logits, t);
  EXPECT_EQ(l.dtype(), DType::bf16);
  // 600 equal losses: a bf16 running sum would stall far below 600 * log 4.
  EXPECT_NEAR(l.item<float>(), std::log(4.0), 1e-2);
  EXPECT_NEAR(cross_entropy(logits, t, Reduction::sum).item<float>(), 600 * std::log(4.0), 600 * std::log(4.0) * 8e-3);
}

TEST(Loss, BceWithLogitsIsStableForLargeLogits) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = Tensor::from_vec<float>({100, -100, 100, -100, 0}, {5}, dev);
  const Tensor t = Tensor::from_vec<float>({0, 1, 1, 0, 1}, {5}, dev);
  const std::vector<float> l = binary_cross_entropy_with_logits(x, t, Reduction::none).to_vec<float>();
  EXPECT_FLOAT_EQ(l[0], 100.0f);
  EXPECT_FLOAT_EQ(l[1], 100.0f);
  EXPECT_NEAR(l[2], 0.0f, 1e-30);
  EXPECT_NEAR(l[3], 0.0f, 1e-30);
  EXPECT_FLOAT_EQ(l[4], static_cast<float>(std::log(2.0)));
}

TEST(Loss, MseAndL1ClosedForms) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = Tensor::from_vec<float>({1, 2, 3, 4}, {2, 2}, dev), y = Tensor::from_vec<float>({0, 4, 3, 1}, {2, 2}, dev);
  EXPECT_FLOAT_EQ(mse_loss(x, y).item<float>(), (1 + 4 + 0 + 9) / 4.0f);
  EXPECT_FLOAT_EQ(mse_loss(x, y, Reduction::sum).item<float>(), 14.0f);
  EXPECT_FLOAT_EQ(l1_loss(x, y).item<float>(), (1 + 2 + 0 + 3) / 4.0f);
  EXPECT_EQ(l1_loss(x, y, Reduction::none).sizes(), (Shape{2, 2}));
  EXPECT_EQ(mse_loss(x, y).dim(), 0);
}

}  // namespace
}  // namespace flame::test
