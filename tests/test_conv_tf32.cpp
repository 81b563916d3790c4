// The TF32 switch of f32 convolutions (flame::cuda::set_allow_conv_tf32, PyTorch's
// torch.backends.cudnn.allow_tf32): off, a CUDA f32 conv (forward, backward-data and
// backward-filter) meets the f32 error bound against a float64 CPU reference, a bound TF32 does not
// meet; on, it meets the TF32 bound. The default is on, as PyTorch's.
#include <algorithm>
#include <cmath>
#include <vector>

#include "flame/cuda.h"
#include "flame/nn/conv.h"
#include "test_util.h"

namespace flame::test {
namespace {
namespace F = flame::nn::functional;

struct ConvTF32Scope : SwitchScope {
  explicit ConvTF32Scope(bool on) : SwitchScope(cuda::allow_conv_tf32, cuda::set_allow_conv_tf32, on) {}
};

Tensor uniform_f64(const Shape& s, uint64_t seed) {
  Generator g(seed);
  return Tensor::rand(s, {DType::f64, Device::cpu()}, &g) * 2.0 - 1.0;
}

// max over elements of |got - want| / scale, where scale is the same conv of |x| and |w| (the sum
// of the magnitudes of the products each output adds up): the relative error of a dot product.
double worst_ratio(const Tensor& got, const Tensor& want, const Tensor& scale) {
  const std::vector<double> g = got.to(Device::cpu()).to(DType::f64).contiguous().to_vec<double>();
  const std::vector<double> w = want.contiguous().to_vec<double>(), s = scale.contiguous().to_vec<double>();
  double worst = 0;
  for (std::size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::fabs(g[i] - w[i]) / std::max(s[i], 1e-30));
  return worst;
}

TEST(ConvTF32, DefaultIsOnAsPyTorch) {
  EXPECT_TRUE(cuda::allow_conv_tf32());
  ConvTF32Scope off(false);
  EXPECT_FALSE(cuda::allow_conv_tf32());
}

// f32 rounds each product to ~6e-8 relative; 576 of them add up to at most ~1e-6 of the scale on
// random data. TF32 rounds both inputs to 10 mantissa bits (~5e-4 each): errors near 1e-4 of the
// scale, far above the f32 bound and below the TF32 one.
constexpr double kF32Bound = 1e-5, kTF32Bound = 3e-3;

TEST(ConvTF32, SwitchOffGivesF32AccuracyOnCuda) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor x = uniform_f64({4, 64, 20, 20}, 1), w = uniform_f64({64, 64, 3, 3}, 2);
  const Tensor gy = uniform_f64({4, 64, 20, 20}, 3);
  // float64 references on the CPU: y, dx = conv_transpose of gy, dw; and their magnitude scales.
  auto run = [](const Tensor& xi, const Tensor& wi, const Tensor& g) {
    const Tensor xr = xi.detach().requires_grad_(true), wr = wi.detach().requires_grad_(true);
    const Tensor y = F::conv2d(xr, wr, {}, {1}, {1});
    BackwardOptions opt;
    opt.grad_output = g;
    const Gradients gr = y.backward(opt);
    return std::vector<Tensor>{y.detach(), xr.grad(gr), wr.grad(gr)};
  };
  const std::vector<Tensor> ref = run(x, w, gy);
  const std::vector<Tensor> mag = run(x.abs(), w.abs(), gy.abs());
  const Device cuda = Device::cuda(0);
  const char* names[] = {"forward", "backward-data", "backward-filter"};
  for (bool tf32 : {false, true}) {
    ConvTF32Scope scope(tf32);
    const std::vector<Tensor> got =
        run(x.to(DType::f32).to(cuda), w.to(DType::f32).to(cuda), gy.to(DType::f32).to(cuda));
    for (int i = 0; i < 3; ++i) {
      const double r = worst_ratio(got[i], ref[i], mag[i]);
      if (!tf32) {
        EXPECT_LE(r, kF32Bound) << names[i] << " with allow_conv_tf32 off: worst error " << r << " of the scale";
      } else {
        EXPECT_LE(r, kTF32Bound) << names[i] << " with allow_conv_tf32 on: worst error " << r << " of the scale";
      }
    }
  }
}

}  // namespace
}  // namespace flame::test
