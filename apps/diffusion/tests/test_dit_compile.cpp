// DiT::set_fused_elementwise (flame::compile of the blocks' modulate and gated residuals): the
// same forward and gradients as the eager model.
#include <gtest/gtest.h>

#include "dit.h"
#include "model_test_util.h"

namespace fd = flame_diffusion;
using flame::DType;
using flame::Tensor;
using fd_test::test_device;

namespace {

TEST(CompileDit, FusedElementwiseMatchesEager) {
  FD_SKIP_IF_NO_DEVICE();
  const flame::Device dev = test_device();
  fd::DiT eager(fd::dit_config("dit-tiny"), 5), fused(fd::dit_config("dit-tiny"), 5);
  eager.to(dev);
  fused.to(dev);
  fd_test::perturb(eager, 0.05, 11);  // open the adaLN-Zero gates
  fd_test::perturb(fused, 0.05, 11);
  fused.set_fused_elementwise(true);
  flame::Generator gen(6);
  Tensor x = fd_test::rand_images(3, 1, 28, dev, &gen);
  Tensor t = Tensor::rand({3}, {DType::f32, dev}, &gen);
  Tensor y = fd_test::rand_labels(3, 10, dev, &gen);
  Tensor target = Tensor::randn({3, 1, 28, 28}, 0.0, 1.0, {DType::f32, dev}, &gen);
  for (int call = 0; call < 3; ++call) {  // the first call traces, later ones replay
    const Tensor a = eager.forward(x, t, y), b = fused.forward(x, t, y);
    EXPECT_LT(fd_test::max_abs(a - b), 1e-4) << "call " << call;
    flame::Gradients ga = (a - target).square().mean().backward();
    flame::Gradients gb = (b - target).square().mean().backward();
    auto pa = eager.named_parameters(), pb = fused.named_parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (std::size_t i = 0; i < pa.size(); ++i) {
      const Tensor da = ga.get(pa[i].second), db = gb.get(pb[i].second);
      ASSERT_TRUE(db.defined()) << pb[i].first;
      EXPECT_LT(fd_test::max_abs(da - db), 1e-4 + 1e-3 * fd_test::max_abs(da)) << pb[i].first << " call " << call;
    }
  }
}

}  // namespace
