// Optimizer parameters as PyTorch users reach them: state looked up by the parameter tensor (the
// index is the group order, which need not be the order the tensors were handed over in), and
// non-leaf tensors refused at construction ("can't optimize a non-leaf Tensor").
#include <gtest/gtest.h>

#include "flame/flame.h"
#include "flame/optim/optimizers.h"
#include "test_util.h"

namespace flame::test {
namespace {

Tensor param(const Shape& shape, uint64_t seed) {
  Generator g(seed);
  return Tensor::randn(shape, 0.0, 1.0, {DType::f32, test_device()}, &g).requires_grad_(true);
}

Tensor grad_like(const Tensor& p, uint64_t seed) {
  Generator g(seed);
  return Tensor::randn(p.sizes(), 0.0, 1.0, {p.dtype(), p.device()}, &g);
}

TEST(OptimLookup, StateByTensorFollowsTheTensorNotTheGroupOrder) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = param({3, 4}, 1), b = param({5}, 2), c = param({2, 2}, 3);
  // Handed over as a, b, c, but grouped as {c}, {a, b}: indices are c = 0, a = 1, b = 2.
  optim::AdamOptions o{.lr = 1e-2};
  optim::Adam opt({o.group({c}), o.group({a, b})}, o);
  EXPECT_EQ(opt.param_index(c), 0u);
  EXPECT_EQ(opt.param_index(a), 1u);
  EXPECT_EQ(opt.param_index(b), 2u);
  Gradients grads;
  const Tensor ga = grad_like(a, 11), gb = grad_like(b, 12);
  grads.set(a, ga.clone());
  grads.set(b, gb.clone());
  opt.step(grads);  // c has no gradient: no state, step 0
  // After one step exp_avg = (1 - beta1) g and exp_avg_sq = (1 - beta2) g^2.
  EXPECT_TRUE(all_close(opt.state(a, "exp_avg"), ga * 0.1, 1e-6, 1e-7));
  EXPECT_TRUE(all_close(opt.state(b, "exp_avg_sq"), gb * gb * 0.001, 1e-6, 1e-9));
  EXPECT_TRUE(all_close(opt.state(a, "exp_avg"), opt.state(1, "exp_avg"), 0, 0));
  EXPECT_EQ(opt.param_step(a), 1);
  EXPECT_EQ(opt.param_step(c), 0);
  EXPECT_FALSE(opt.state(c, "exp_avg").defined());
  EXPECT_FALSE(opt.master_weights(a).defined());
}

TEST(OptimLookup, StateOfATensorNotInTheOptimizerNamesIt) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = param({3, 4}, 1), stranger = param({7, 2}, 2);
  optim::SGD opt(TensorList{a});
  expect_error([&] { (void)opt.state(stranger, "momentum_buffer"); },
               {"SGD.state: ", "[7, 2]", "not a parameter of this optimizer", "1 parameters"});
  expect_error([&] { (void)opt.param_step(a.detach()); },
               {"SGD.param_step: ", "shares the storage of parameter 0", "not a view, copy or detach()"});
  expect_error([&] { (void)opt.master_weights(Tensor()); }, {"SGD.master_weights: ", "undefined"});
}

TEST(OptimLookup, NonLeafParameterIsRefusedAtConstruction) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = param({3, 4}, 1);
  Tensor ok = param({2}, 2);
  Tensor scaled = w * 2.0;  // an op's output under grad mode: not a leaf
  ASSERT_FALSE(scaled.is_leaf());
  for (int kind = 0; kind < 3; ++kind) {
    SCOPED_TRACE(kind);
    const TensorList params{ok, scaled};
    const auto build = [&] {
      if (kind == 0) optim::SGD opt(params);
      if (kind == 1) optim::AdamW opt(params);
      if (kind == 2) optim::Adafactor opt(params);
    };
    expect_error(build, {"optimizer: ", "parameter 1", "shape [3, 4]", "MulBackward",
                         "optimizers take leaf tensors; call .detach().requires_grad_()"});
  }
  // The remedy works, and a tensor made under NoGradGuard is a leaf too.
  Tensor fixed = scaled.detach().requires_grad_(true);
  Tensor made;
  {
    NoGradGuard no_grad;
    made = (w * 3.0).requires_grad_(true);
  }
  optim::Adam opt(TensorList{ok, fixed, made});
  EXPECT_EQ(opt.num_params(), 3u);
}

}  // namespace
}  // namespace flame::test
