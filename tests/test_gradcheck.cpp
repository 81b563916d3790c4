// Gradient checks over the op table: every differentiable case is run in float64 on the CPU and its
// backward() compared with central differences; on CUDA, f32 gradients are compared with the CPU's.
#include "gradcheck.h"
#include "op_table.h"

namespace flame::test {
namespace {

// One check per (op, shapes, layout): the f32 rows of the table, run in f64.
std::vector<OpCase> gradient_cases() {
  std::vector<OpCase> out;
  for (const OpCase& c : op_table()) {
    if (!c.differentiable) continue;
    // Order statistics of an expanded input compare equal copies: a kink, where central
    // differences are meaningless (tie rules are tested in test_autograd.cpp). Casts to a lower
    // precision are steps at the scale of eps (their rule is tested there too).
    auto starts = [&](const char* p) { return c.name.rfind(p, 0) == 0; };
    const bool ties = starts("amax") || starts("amin") || starts("norm_inf") || starts("norm_neginf") ||
                      starts("sort") || starts("topk");
    if (ties && c.name.find("expanded") != std::string::npos) continue;
    if (starts("to_")) continue;
    bool f32_row = false;
    for (const InputSpec& s : c.inputs) {
      if (is_floating(s.dtype)) {
        f32_row = s.dtype == DType::f32;
        break;
      }
    }
    if (f32_row) out.push_back(c);
  }
  return out;
}

TensorList f64_inputs(const OpCase& c, Device dev) {
  TensorList in;
  for (std::size_t i = 0; i < c.inputs.size(); ++i) {
    InputSpec s = c.inputs[i];
    if (is_floating(s.dtype)) s.dtype = DType::f64;
    in.push_back(make_input(s, dev, 1000 + 17 * i));
  }
  return in;
}

class Gradcheck : public ::testing::TestWithParam<OpCase> {};

TEST_P(Gradcheck, MatchesFiniteDifferences) {
  const OpCase& c = GetParam();
  const TensorList in = f64_inputs(c, Device::cpu());
  bool any_elements = false;
  for (const Tensor& t : in) any_elements = any_elements || (is_floating(t.dtype()) && t.numel() > 0);
  if (!any_elements) {
    // Nothing to perturb (gradcheck refuses such a call): backward must still run and give each
    // floating input a gradient of its own shape, or none.
    TensorList xs;
    for (const Tensor& t : in) {
      Tensor x = t.detach();
      if (is_floating(x.dtype())) x.requires_grad_(true);
      xs.push_back(x);
    }
    const Tensor y = c.run(xs);
    ASSERT_TRUE(y.requires_grad());
    BackwardOptions opts;
    opts.grad_output = Tensor::zeros(y.sizes(), {y.dtype(), y.device()});
    Gradients g = y.backward(opts);
    for (const Tensor& x : xs) {
      if (!is_floating(x.dtype())) continue;
      const Tensor gx = g.try_get(x);
      if (gx.defined()) EXPECT_EQ(gx.sizes(), x.sizes());
    }
    return;
  }
  const GradcheckResult r = gradcheck(c.run, in);
  EXPECT_GT(r.checked, 0);
  EXPECT_TRUE(r.ok) << r.message;
}

TEST_P(Gradcheck, CudaGradientsMatchCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  const OpCase& c = GetParam();
  auto grads_on = [&](Device dev) {
    TensorList in;
    for (std::size_t i = 0; i < c.inputs.size(); ++i) {
      Tensor t = make_input(c.inputs[i], dev, 1000 + 17 * i).detach();
      if (is_floating(t.dtype())) t.requires_grad_(true);
      in.push_back(t);
    }
    Tensor y = c.run(in);
    Generator gen(7);
    BackwardOptions opts;
    opts.grad_output = Tensor::randn(y.sizes(), 0.0, 1.0, {y.dtype(), dev}, &gen);
    Gradients g = y.backward(opts);
    TensorList out;
    for (const Tensor& t : in) out.push_back(is_floating(t.dtype()) ? g.try_get(t) : Tensor());
    return out;
  };
  const TensorList cpu = grads_on(Device::cpu()), gpu = grads_on(Device::cuda(0));
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    if (!cpu[i].defined()) continue;
    ASSERT_TRUE(gpu[i].defined()) << "input " << i;
    EXPECT_TRUE(all_close(gpu[i], cpu[i], 1e-4, 1e-5)) << "input " << i;
  }
}

// gradcheck itself must be able to fail: a custom op whose backward is wrong by a factor, by a
// missing term, or by a swapped input, is caught; its correct twin passes.
TEST(GradcheckSelfTest, CatchesWrongBackwardRules) {
  Generator gen(11);
  const Tensor a = Tensor::uniform({3, 4}, -1.0, 1.0, DType::f64, &gen);
  const Tensor b = Tensor::uniform({3, 4}, 0.5, 1.5, DType::f64, &gen);
  auto custom = [](std::function<TensorList(const TensorList&, const Tensor&, const Tensor&)> bwd) {
    CustomFunction f;
    f.name = "mul_sin";
    f.forward = [](const TensorList& in) { return in[0].sin() * in[1]; };  // y = sin(a) * b
    f.backward = std::move(bwd);
    return f;
  };
  const CustomFunction right = custom([](const TensorList& in, const Tensor&, const Tensor& g) {
    return TensorList{g * in[0].cos() * in[1], g * in[0].sin()};
  });
  const CustomFunction doubled = custom([](const TensorList& in, const Tensor&, const Tensor& g) {
    return TensorList{g * in[0].cos() * in[1] * 2.0, g * in[0].sin()};
  });
  const CustomFunction no_chain = custom([](const TensorList& in, const Tensor&, const Tensor& g) {
    return TensorList{g * in[0].cos(), g * in[0].sin()};  // forgets the factor b
  });
  const CustomFunction swapped = custom([](const TensorList& in, const Tensor&, const Tensor& g) {
    return TensorList{g * in[0].sin(), g * in[0].cos() * in[1]};
  });
  const CustomFunction missing = custom([](const TensorList& in, const Tensor&, const Tensor& g) {
    return TensorList{g * in[0].cos() * in[1], Tensor()};  // no gradient for b
  });
  auto check = [&](const CustomFunction& f) {
    return gradcheck([&](const TensorList& in) { return apply_custom(f, in); }, {a, b});
  };
  const GradcheckResult ok = check(right);
  EXPECT_TRUE(ok.ok) << ok.message;
  EXPECT_EQ(ok.checked, 24);
  for (const CustomFunction* wrong : {&doubled, &no_chain, &swapped, &missing}) {
    const GradcheckResult r = check(*wrong);
    EXPECT_FALSE(r.ok) << "a wrong backward passed gradcheck";
    EXPECT_NE(r.message.find("analytic"), std::string::npos) << r.message;
  }
}

TEST(GradcheckSelfTest, NoElementsIsAFailure) {
  const Tensor empty = Tensor::zeros({0, 3}, DType::f64);
  const GradcheckResult r = gradcheck([](const TensorList& in) { return in[0] * 2.0; }, {empty});
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.checked, 0);
  EXPECT_NE(r.message.find("no input element"), std::string::npos) << r.message;
  const Tensor ints = Tensor::arange(0, 4, 1, DType::i64);
  EXPECT_FALSE(gradcheck([](const TensorList& in) { return in[0].to(DType::f64); }, {ints}).ok);
}

INSTANTIATE_TEST_SUITE_P(Ops, Gradcheck, ::testing::ValuesIn(gradient_cases()),
                         [](const ::testing::TestParamInfo<OpCase>& info) { return info.param.name; });

}  // namespace
}  // namespace flame::test
