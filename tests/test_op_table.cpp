// Runs every op-table case on the device under test against its float64 reference, and on CUDA
// against the CPU reference backend.
#include "op_table.h"

namespace flame::test {
namespace {

class OpTable : public ::testing::TestWithParam<OpCase> {};

TensorList make_inputs(const OpCase& c, Device dev) {
  TensorList in;
  for (std::size_t i = 0; i < c.inputs.size(); ++i) in.push_back(make_input(c.inputs[i], dev, 1000 + 17 * i));
  return in;
}

TEST_P(OpTable, MatchesReference) {
  FLAME_SKIP_IF_NO_DEVICE();
  const OpCase& c = GetParam();
  TensorList in = make_inputs(c, test_device());
  std::vector<RefTensor> refs;
  for (const auto& t : in) refs.push_back(to_ref(t));
  const Tensor got = c.run(in);
  ASSERT_EQ(got.device(), test_device());
  const RefTensor want = c.reference(refs);
  const double rtol = c.rtol >= 0 ? c.rtol : default_rtol(want.dtype);
  const double atol = c.atol >= 0 ? c.atol : default_atol(want.dtype);
  EXPECT_TRUE(all_close(got, want, rtol, atol));
}

TEST_P(OpTable, CudaMatchesCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  const OpCase& c = GetParam();
  const Tensor cpu = c.run(make_inputs(c, Device::cpu()));
  const Tensor gpu = c.run(make_inputs(c, Device::cuda(0)));
  ASSERT_TRUE(gpu.device().is_cuda());
  const double rtol = c.rtol >= 0 ? c.rtol : default_rtol(cpu.dtype());
  const double atol = c.atol >= 0 ? c.atol : default_atol(cpu.dtype());
  EXPECT_TRUE(all_close(gpu, cpu, rtol, atol));
}

INSTANTIATE_TEST_SUITE_P(Ops, OpTable, ::testing::ValuesIn(op_table()),
                         [](const ::testing::TestParamInfo<OpCase>& info) { return info.param.name; });

}  // namespace
}  // namespace flame::test
