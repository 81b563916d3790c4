// Anomaly mode (flame/anomaly.h): the first op producing NaN/Inf, in forward or backward, raises
// an error naming it. Runs on the test device (FLAME_TEST_DEVICE=cuda: the GPU).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <thread>

#include "flame/anomaly.h"
#include "flame/nn.h"
#include "test_util.h"

namespace flame {
namespace {

using test::expect_error;
using test::test_device;

// Random values in [lo, hi) on the test device, as f32, with `special` written at `at`.
Tensor random_with(const Shape& shape, float lo, float hi, int64_t at, float special, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = dist(rng);
  v[static_cast<std::size_t>(at)] = special;
  return Tensor::from_vec(v, shape, test_device());
}

// The number after `prefix` in msg (-1 when absent).
int number_after(const std::string& msg, const std::string& prefix) {
  const std::size_t at = msg.find(prefix);
  if (at == std::string::npos) return -1;
  return std::atoi(msg.c_str() + at + prefix.size());
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(AnomalyTest, OffByDefault) {
  FLAME_SKIP_IF_NO_DEVICE();
  EXPECT_FALSE(is_anomaly_enabled());
  Tensor x = random_with({3, 5}, 0.5f, 2.f, 7, -1.f, 1).requires_grad_(true);
  Tensor y;
  ASSERT_NO_THROW(y = (x * 2.0).log());
  // The NaN is there, and nothing noticed it.
  EXPECT_TRUE(std::isnan(y.to_vec<float>()[7]));
  EXPECT_NO_THROW(y.sum().backward());
}

TEST(AnomalyTest, ForwardLogOfNegativeNamesOpPositionAndShapes) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = random_with({3, 5}, 0.5f, 2.f, 11, -0.75f, 2).requires_grad_(true);
  DetectAnomalyGuard guard;
  EXPECT_TRUE(is_anomaly_enabled());
  Tensor h = x * 2.0;  // op #1, finite
  const std::string msg = message_of([&] { (void)h.log(); });
  ASSERT_FALSE(msg.empty()) << "log of a negative number passed anomaly mode";
  for (const char* part : {"detect_anomaly", "op log", "op #2", "LogBackward", "NaN", "[3, 5] f32"}) {
    EXPECT_NE(msg.find(part), std::string::npos) << "missing '" << part << "' in: " << msg;
  }
  EXPECT_NE(msg.find(test_device().str()), std::string::npos) << msg;
}

TEST(AnomalyTest, ForwardZeroTimesInfNamesBothInputShapes) {
  FLAME_SKIP_IF_NO_DEVICE();
  const float inf = std::numeric_limits<float>::infinity();
  Tensor a = random_with({4, 6}, -2.f, 2.f, 9, inf, 3);              // needs no gradient
  Tensor b = random_with({6}, 0.5f, 1.5f, 3, 0.f, 4).requires_grad_(true);  // b[3] = 0 meets a[1][3] = inf
  DetectAnomalyGuard guard;
  const std::string msg = message_of([&] { (void)(a * b); });
  ASSERT_FALSE(msg.empty());
  // (b's broadcast is recorded first: expand is op #1.)
  for (const char* part : {"op mul", "op #2", "NaN", "output of [4, 6] f32", "inputs: [4, 6] f32, [6] f32"}) {
    EXPECT_NE(msg.find(part), std::string::npos) << "missing '" << part << "' in: " << msg;
  }
}

TEST(AnomalyTest, ForwardInfIsNamedInf) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = random_with({2, 7}, -1.f, 1.f, 4, 200.f, 5).requires_grad_(true);
  DetectAnomalyGuard guard;
  const std::string msg = message_of([&] { (void)x.exp(); });
  EXPECT_NE(msg.find("op exp"), std::string::npos) << msg;
  EXPECT_NE(msg.find("produced Inf"), std::string::npos) << msg;
}

TEST(AnomalyTest, FiniteGraphGivesTheSameGradients) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = random_with({5, 4}, 0.5f, 2.f, 0, 1.25f, 6).requires_grad_(true);
  Tensor w = random_with({4, 3}, -1.f, 1.f, 0, 0.3f, 7).requires_grad_(true);
  auto run = [&] {
    Tensor loss = (x.log().matmul(w).tanh() * x.sum({1}, true)).sum();
    Gradients g = loss.backward();
    return std::make_pair(g.get(x), g.get(w));
  };
  const auto plain = run();
  std::pair<Tensor, Tensor> checked;
  {
    DetectAnomalyGuard guard;
    ASSERT_NO_THROW(checked = run());
  }
  // The same computation twice: bit-equal on the CPU; a GPU reduction may reassociate.
  const double tol = test_device().is_cpu() ? 0.0 : 1e-6;
  EXPECT_TRUE(test::all_close(checked.first, plain.first, tol, tol));
  EXPECT_TRUE(test::all_close(checked.second, plain.second, tol, tol));
}

TEST(AnomalyTest, BackwardSqrtAtZeroNamesNodeAndForwardOp) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = random_with({3, 4}, 0.5f, 2.f, 5, 0.f, 8).requires_grad_(true);
  DetectAnomalyGuard guard;
  Tensor h = x * 3.0;   // op #1
  Tensor s = h.sqrt();  // op #2: sqrt(0) = 0 is finite, its gradient 1 / (2 sqrt(0)) is not
  Tensor loss = s.sum();  // op #3
  const std::string msg = message_of([&] { (void)loss.backward(); });
  ASSERT_FALSE(msg.empty()) << "an infinite gradient passed anomaly mode";
  for (const char* part : {"backward node SqrtBackward", "returned Inf", "input 0", "[3, 4] f32",
                           "forward op sqrt (op #2"}) {
    EXPECT_NE(msg.find(part), std::string::npos) << "missing '" << part << "' in: " << msg;
  }
}

TEST(AnomalyTest, BackwardCustomFunctionReturningNan) {
  FLAME_SKIP_IF_NO_DEVICE();
  CustomFunction bad;
  bad.name = "leaky_square";
  bad.forward = [](const TensorList& in) { return in[0] * in[0]; };
  bad.backward = [](const TensorList& in, const Tensor&, const Tensor& g) -> TensorList {
    // A broken rule: adds 0/0.
    Tensor zero = Tensor::zeros(in[0].sizes(), {in[0].dtype(), in[0].device()});
    return {g * in[0] * 2.0 + zero / zero};
  };
  Tensor x = random_with({2, 3}, 0.5f, 1.5f, 0, 1.f, 9).requires_grad_(true);
  DetectAnomalyGuard guard;
  Tensor y = apply_custom(bad, {x});  // op #1: finite
  Tensor loss = (y * 0.5).sum();      // ops #2, #3
  const std::string msg = message_of([&] { (void)loss.backward(); });
  for (const char* part : {"backward node LeakySquareBackward", "returned NaN", "forward op leaky_square (op #1",
                           "with inputs [2, 3] f32"}) {
    EXPECT_NE(msg.find(part), std::string::npos) << "missing '" << part << "' in: " << msg;
  }
}

TEST(AnomalyTest, NodeRecordedBeforeTheGuardIsStillChecked) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = random_with({6}, 0.5f, 2.f, 2, 0.f, 10).requires_grad_(true);
  Tensor loss = x.sqrt().sum();  // recorded with anomaly mode off
  DetectAnomalyGuard guard;
  const std::string msg = message_of([&] { (void)loss.backward(); });
  EXPECT_NE(msg.find("SqrtBackward"), std::string::npos) << msg;
  EXPECT_NE(msg.find("recorded before anomaly mode was on"), std::string::npos) << msg;
}

TEST(AnomalyTest, GuardsNestAndRestore) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor neg = random_with({4}, 0.5f, 2.f, 1, -1.f, 11).requires_grad_(true);
  Tensor zero = random_with({4}, 0.5f, 2.f, 3, 0.f, 12).requires_grad_(true);
  {
    DetectAnomalyGuard outer;
    Tensor a = neg * 1.5;  // op #1
    {
      DetectAnomalyGuard inner(/*check_forward=*/false);
      EXPECT_TRUE(is_anomaly_enabled());
      EXPECT_FALSE(is_anomaly_check_forward_enabled());
      Tensor b;
      ASSERT_NO_THROW(b = a.log());  // op #2: NaN, forward checks are off here
      // Backward is still checked (sqrt at 0, op #3).
      Tensor s = zero.sqrt();
      const std::string msg = message_of([&] { (void)s.sum().backward(); });
      EXPECT_NE(msg.find("forward op sqrt (op #3"), std::string::npos) << msg;
    }
    EXPECT_TRUE(is_anomaly_check_forward_enabled());
    // The count goes on across the inner guard (past log #2, sqrt #3 and the sum).
    const std::string msg = message_of([&] { (void)a.log(); });
    EXPECT_GE(number_after(msg, "op log (op #"), 5) << msg;
  }
  EXPECT_FALSE(is_anomaly_enabled());
  EXPECT_NO_THROW((void)(neg * 1.5).log());
  // A new outermost guard counts from 1 again.
  DetectAnomalyGuard again;
  const std::string msg = message_of([&] { (void)neg.log(); });
  EXPECT_NE(msg.find("op log (op #1"), std::string::npos) << msg;
}

TEST(AnomalyTest, ForwardOnlyLeavesGradientsUnchecked) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = random_with({7}, 0.5f, 2.f, 6, 0.f, 16).requires_grad_(true);
  Tensor neg = random_with({7}, 0.5f, 2.f, 2, -1.f, 17).requires_grad_(true);
  DetectAnomalyGuard guard(/*check_forward=*/true, /*check_backward=*/false);
  EXPECT_TRUE(is_anomaly_check_forward_enabled());
  EXPECT_FALSE(is_anomaly_check_backward_enabled());
  Gradients g;
  ASSERT_NO_THROW(g = x.sqrt().sum().backward());  // an infinite gradient passes
  EXPECT_TRUE(std::isinf(g.get(x).to_vec<float>()[6]));
  EXPECT_THROW((void)neg.log(), Error);  // the forward is still checked
  {
    DetectAnomalyGuard both;
    EXPECT_TRUE(is_anomaly_check_backward_enabled());
  }
  EXPECT_FALSE(is_anomaly_check_backward_enabled());
}

TEST(AnomalyTest, SetDetectAnomalyAndThreadLocality) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = random_with({5}, 0.5f, 2.f, 4, -2.f, 13).requires_grad_(true);
  set_detect_anomaly(true);
  bool other_thread_threw = true;
  std::thread t([&] {
    try {
      (void)x.log();  // anomaly mode is this thread's own: off here
      other_thread_threw = false;
    } catch (const Error&) {
    }
  });
  t.join();
  EXPECT_FALSE(other_thread_threw);
  EXPECT_THROW((void)x.log(), Error);
  set_detect_anomaly(false);
  EXPECT_NO_THROW((void)x.log());
}

// A module producing NaN: the error names its path in the model.
class LogModule : public nn::Module {
 public:
  std::string name() const override { return "LogModule"; }
  Tensor forward(const Tensor& x) override { return x.log(); }
};

TEST(AnomalyTest, ForwardNamesTheModulePath) {
  FLAME_SKIP_IF_NO_DEVICE();
  auto inner = std::make_shared<nn::Sequential>(
      std::initializer_list<nn::ModulePtr>{std::make_shared<nn::Linear>(4, 3), std::make_shared<LogModule>()});
  nn::Sequential model({std::make_shared<nn::Linear>(5, 4), inner});
  model.to(test_device());
  // Linear outputs of random weights are negative somewhere: log gives NaN inside "1.1".
  Tensor x = Tensor::randn({8, 5}, 0.0, 3.0, TensorOptions(test_device()));
  DetectAnomalyGuard guard;
  const std::string msg = message_of([&] { (void)model(x); });
  EXPECT_NE(msg.find("op log"), std::string::npos) << msg;
  EXPECT_NE(msg.find("in module '1.1'"), std::string::npos) << msg;
}

class SqrtModule : public nn::Module {
 public:
  std::string name() const override { return "SqrtModule"; }
  Tensor forward(const Tensor& x) override { return x.sqrt(); }
};

TEST(AnomalyTest, BackwardNamesTheModuleOfTheForwardOp) {
  FLAME_SKIP_IF_NO_DEVICE();
  nn::Sequential model({std::make_shared<nn::Identity>(), std::make_shared<SqrtModule>()});
  Tensor x = random_with({3, 3}, 0.5f, 2.f, 4, 0.f, 18).requires_grad_(true);
  DetectAnomalyGuard guard;
  Tensor loss = model(x).sum();
  const std::string msg = message_of([&] { (void)loss.backward(); });
  EXPECT_NE(msg.find("backward node SqrtBackward"), std::string::npos) << msg;
  EXPECT_NE(msg.find("in module '1'"), std::string::npos) << msg;
}

TEST(AnomalyTest, CheckFiniteByHand) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor ok = random_with({3, 3}, -1.f, 1.f, 0, 0.5f, 14);
  EXPECT_NO_THROW(check_finite(ok, "weights"));
  EXPECT_NO_THROW(check_finite(Tensor::randint(0, 5, {4}, TensorOptions(test_device())), "ints"));
  Tensor bad = random_with({3, 3}, -1.f, 1.f, 8, std::nanf(""), 15);
  expect_error([&] { check_finite(bad, "weights"); }, {"weights", "[3, 3] f32", "NaN"});
}

}  // namespace
}  // namespace flame
