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
  const GradcheckResult r = gradcheck(c.run, f64_inputs(c, Device::cpu()));
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
    for (const Tensor& t : in) out.push_back(is_floating(t.dtype()) ? g.get(t) : Tensor());
    return out;
  };
  const TensorList cpu = grads_on(Device::cpu()), gpu = grads_on(Device::cuda(0));
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    if (!cpu[i].defined()) continue;
    ASSERT_TRUE(gpu[i].defined()) << "input " << i;
    EXPECT_TRUE(all_close(gpu[i], cpu[i], 1e-4, 1e-5)) << "input " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, Gradcheck, ::testing::ValuesIn(gradient_cases()),
                         [](const ::testing::TestParamInfo<OpCase>& info) { return info.param.name; });

}  // namespace
}  // namespace flame::test
