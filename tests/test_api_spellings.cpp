// The spellings a libtorch user types (issue 26 item 3), other than indexing (test_index_api.cpp):
// integer arguments for the convolution and norm layers and their functional forms, printing of
// Shape/DType/Device, Device("cuda:0") parsing, Tensor::from_blob, Tensor::rand(shape, lo, hi),
// the F:: namespace with the activations and losses, one embedding order, and Gradients::get /
// get_or_zeros / set. Each value is checked against an independent computation (host loops or
// closed forms). Runs on the device under test unless a case says otherwise.
#include <cmath>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "flame/nn.h"
#include "test_util.h"

namespace flame::test {
namespace {

Tensor random(const Shape& shape, uint64_t seed, DType dt = DType::f64) {
  Generator g(seed);
  return Tensor::randn(shape, 0.0, 1.0, {dt, test_device()}, &g);
}

// ---- compile-time spellings (each failed to compile before) ----
static_assert(std::is_constructible_v<nn::Conv2d, int, int, int, int, int>);
static_assert(requires(Tensor x, Tensor w) { F::conv2d(x, w, Tensor(), 2, 1); });
static_assert(requires(Tensor x) { F::relu(x); F::softmax(x, 1); F::gelu(x, "tanh"); });
static_assert(requires(Tensor x) { x[0]; x.index({0}); });
static_assert(requires(std::ostream& os) { os << Shape{1, 2} << DType::f32 << Device("cpu"); });
// The readable-error constructor takes part only for arguments that fit no signature.
static_assert(nn::detail::args_bind<3, std::tuple<int64_t, int64_t, const nn::Ints&>, int, int, int>::value);
static_assert(!nn::detail::args_bind<3, std::tuple<int64_t, int64_t, const nn::Ints&>, int, int>::value);
static_assert(!nn::detail::args_bind<3, std::tuple<int64_t, int64_t, const nn::Ints&>, int, int, const char*>::value);

// out[n][o][y][x] of a stride-s, padding-p, groups-1 2-d convolution by loops (f64 host values).
double conv_at(const std::vector<double>& x, const Shape& xs, const std::vector<double>& w, const Shape& ws,
               double bias, int64_t n, int64_t o, int64_t oy, int64_t ox, int64_t s, int64_t p) {
  double acc = bias;
  for (int64_t c = 0; c < ws[1]; ++c)
    for (int64_t ky = 0; ky < ws[2]; ++ky)
      for (int64_t kx = 0; kx < ws[3]; ++kx) {
        const int64_t iy = oy * s - p + ky, ix = ox * s - p + kx;
        if (iy < 0 || ix < 0 || iy >= xs[2] || ix >= xs[3]) continue;
        acc += x[static_cast<std::size_t>(((n * xs[1] + c) * xs[2] + iy) * xs[3] + ix)] *
               w[static_cast<std::size_t>(((o * ws[1] + c) * ws[2] + ky) * ws[3] + kx)];
      }
  return acc;
}

TEST(ApiSpellings, ConvLayersTakeIntegersAsPyTorch) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  auto conv = std::make_shared<nn::Conv2d>(2, 3, 3, 2, 1, 1, 1, true, TensorOptions(DType::f64, dev));
  EXPECT_EQ(conv->kernel_size(), (Shape{3, 3}));
  EXPECT_EQ(conv->stride(), (Shape{2, 2}));
  EXPECT_EQ(conv->padding().sizes, (Shape{1, 1}));
  EXPECT_EQ(conv->weight().sizes(), (Shape{3, 2, 3, 3}));
  const Tensor x = random({2, 2, 5, 6}, 3);
  const Tensor y = conv->forward(x);
  ASSERT_EQ(y.sizes(), (Shape{2, 3, 3, 3}));
  const auto xv = x.to_vec<double>(), wv = conv->weight().to_vec<double>(), bv = conv->bias().to_vec<double>();
  const auto yv = y.to_vec<double>();
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t o = 0; o < 3; ++o)
      for (int64_t oy = 0; oy < 3; ++oy)
        for (int64_t ox = 0; ox < 3; ++ox) {
          const double want = conv_at(xv, x.sizes(), wv, conv->weight().sizes(), bv[o], n, o, oy, ox, 2, 1);
          EXPECT_NEAR(yv[static_cast<std::size_t>(((n * 3 + o) * 3 + oy) * 3 + ox)], want, 1e-12);
        }
  // The functional form takes the same integers, and they mean what the lists mean.
  EXPECT_TRUE(all_close(F::conv2d(x, conv->weight(), conv->bias(), 2, 1), y, 0, 0));
  EXPECT_TRUE(all_close(F::conv2d(x, conv->weight(), conv->bias(), {2, 2}, {1, 1}), y, 0, 0));
  // Mixed int and list arguments, groups, no bias; the other layers.
  auto grouped = std::make_shared<nn::Conv2d>(4, 6, Shape{3, 1}, 1, 0, 1, 2, false);
  EXPECT_EQ(grouped->kernel_size(), (Shape{3, 1}));
  EXPECT_EQ(grouped->weight().sizes(), (Shape{6, 2, 3, 1}));
  EXPECT_FALSE(grouped->bias().defined());
  EXPECT_EQ(nn::Conv1d(2, 4, 5, 2).forward(Tensor::zeros({1, 2, 11})).sizes(), (Shape{1, 4, 4}));
  EXPECT_EQ(nn::Conv3d(1, 2, 3).forward(Tensor::zeros({1, 1, 4, 4, 4})).sizes(), (Shape{1, 2, 2, 2, 2}));
  // (H - 1) * 2 - 2 * 1 + 3 + 1 = 2 H
  EXPECT_EQ(nn::ConvTranspose2d(4, 2, 3, 2, 1, 1).forward(Tensor::zeros({1, 4, 5, 7})).sizes(),
            (Shape{1, 2, 10, 14}));
  EXPECT_EQ(nn::ConvTranspose1d(2, 2, 4, 2, 1).forward(Tensor::zeros({1, 2, 6})).sizes(), (Shape{1, 2, 12}));
  // Bad values name the layer.
  expect_error([] { nn::Conv2d(1, 16, Shape{3, 3, 3}); }, {"Conv2d", "kernel_size"});
  expect_error([] { nn::Conv2d(1, 16, 0); }, {"Conv2d", "kernel_size must be > 0"});
  expect_error([] { nn::ConvTranspose3d(3, 4, 3, 1, 0, 0, 2); }, {"ConvTranspose3d", "groups=2"});
}

TEST(ApiSpellings, PoolLayersTakeAnIntOrAPair) {
  const Tensor x = Tensor::arange(16, DType::f32).view({1, 1, 4, 4});
  // 2x2 windows of the 4x4 ramp: the maximum is each window's bottom-right element.
  const std::vector<float> want = {5, 7, 13, 15};
  EXPECT_EQ(nn::MaxPool2d(2).forward(x).to_vec<float>(), want);
  EXPECT_EQ(nn::MaxPool2d(Shape{2, 2}).forward(x).to_vec<float>(), want);
  EXPECT_EQ(F::max_pool2d(x, Shape{2}).to_vec<float>(), want);
  EXPECT_EQ(nn::AvgPool2d(Shape{2, 4}).forward(x).to_vec<float>(), (std::vector<float>{3.5f, 11.5f}));
  expect_error([] { nn::MaxPool2d(Shape{2, 2, 2}); }, {"Size2", "1 or 2 values", "[2, 2, 2]"});
}

TEST(ApiSpellings, NormLayersTakeAnIntegerShape) {
  nn::LayerNorm ln(6);
  EXPECT_EQ(ln.weight().sizes(), (Shape{6}));
  nn::RMSNorm rms(Shape{2, 3});
  EXPECT_EQ(rms.weight().sizes(), (Shape{2, 3}));
  // LayerNorm(6) normalises the last dim: each row of the output has mean 0 and variance 1.
  Tensor y = ln.forward(random({4, 6}, 9, DType::f32).to(Device::cpu()));
  const auto v = y.to_vec<double>();
  for (int r = 0; r < 4; ++r) {
    double m = 0, q = 0;
    for (int c = 0; c < 6; ++c) m += v[static_cast<std::size_t>(r * 6 + c)] / 6;
    for (int c = 0; c < 6; ++c) q += std::pow(v[static_cast<std::size_t>(r * 6 + c)] - m, 2) / 6;
    EXPECT_NEAR(m, 0.0, 1e-6);
    EXPECT_NEAR(q, 1.0, 1e-3);  // eps = 1e-5 in the denominator
  }
}

TEST(ApiSpellings, ShapeDTypeAndDevicePrint) {
  std::ostringstream os;
  const Tensor x = Tensor::zeros({2, 3}, DType::bf16);
  os << x.sizes() << " " << x.dtype() << " " << x.device() << " " << Device::cuda(1) << " " << Shape{} << " "
     << DType::boolean;
  EXPECT_EQ(os.str(), "[2, 3] bf16 cpu cuda:1 [] bool");
}

TEST(ApiSpellings, DeviceParsesTorchStrings) {
  EXPECT_EQ(Device("cpu"), Device::cpu());
  EXPECT_EQ(Device("cpu:0"), Device::cpu());
  EXPECT_EQ(Device("cuda"), Device::cuda(0));
  EXPECT_EQ(Device("cuda:0"), Device::cuda(0));
  EXPECT_EQ(Device(std::string("cuda:12")), Device::cuda(12));
  EXPECT_EQ(Device("cuda:3").str(), "cuda:3");
  EXPECT_EQ(Device(DeviceType::cuda, 2), Device::cuda(2));
  // Implicit, as libtorch: a string where a Device is taken.
  const Tensor x = Tensor::ones({2});
  EXPECT_TRUE(x.to("cpu").is_same(x));
  for (const char* bad : {"gpu", "CPU", "", "cuda:", "cuda:-1", "cuda:1x", " cuda", "cuda:0 ", "cpu:1", "cuda:99999999999"}) {
    expect_error([&] { Device d(bad); }, {"Device", std::string("cannot parse \"") + bad + "\"", "\"cuda:N\""});
  }
}

TEST(ApiSpellings, FromBlobWrapsCallerMemoryWithoutCopying) {
  std::vector<float> buf = {1, 2, 3, 4, 5, 6};
  Tensor t = Tensor::from_blob(buf.data(), {2, 3}, DType::f32);
  EXPECT_EQ(t.data_ptr(), buf.data());
  EXPECT_EQ(t.sizes(), (Shape{2, 3}));
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.to_vec<float>(), buf);
  EXPECT_EQ(t[1][2].item<float>(), 6.0f);
  t.mul_(2.0);  // writes the caller's buffer
  EXPECT_EQ(buf, (std::vector<float>{2, 4, 6, 8, 10, 12}));
  buf[0] = -1;  // and the tensor reads it
  EXPECT_EQ(t[0][0].item<float>(), -1.0f);
  {  // the options form; the tensor's end frees nothing (the vector still owns and frees it)
    std::vector<double> d = {0.5, 1.5};
    Tensor u = Tensor::from_blob(d.data(), {2}, TensorOptions(DType::f64));
    EXPECT_EQ(u.sum_all().item<double>(), 2.0);
    Tensor grad_leaf = u.detach().requires_grad_(true);
    Gradients g = (grad_leaf * grad_leaf).sum().backward();
    EXPECT_EQ(g.get(grad_leaf).to_vec<double>(), (std::vector<double>{1.0, 3.0}));
  }
  EXPECT_EQ(Tensor::from_blob(nullptr, {0, 3}, DType::f32).numel(), 0);
  expect_error([] { (void)Tensor::from_blob(nullptr, {2}, DType::f32); }, {"from_blob", "null data pointer", "[2]"});
  expect_error([&] { (void)Tensor::from_blob(reinterpret_cast<char*>(buf.data()) + 1, {2}, DType::f32); },
               {"from_blob", "not aligned", "4-byte"});
}

TEST(ApiSpellingsCuda, FromBlobWrapsDeviceMemory) {
  FLAME_SKIP_IF_NO_CUDA();
  Tensor owner = Tensor::zeros({4}, Device::cuda());
  Tensor view = Tensor::from_blob(owner.data_ptr(), {2, 2}, DType::f32, Device("cuda:0"));
  view.fill_(2.5);
  view[1][0] = 7.0;
  EXPECT_EQ(owner.to_vec<float>(), (std::vector<float>{2.5f, 2.5f, 7.0f, 2.5f}));
}

TEST(ApiSpellings, RandWithBoundsIsUniformOnThatRange) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Generator a(21), b(21);
  const Tensor r = Tensor::rand({4000}, -3.0, 5.0, {DType::f64, dev}, &a);
  EXPECT_TRUE(same_bits(r, Tensor::uniform({4000}, -3.0, 5.0, {DType::f64, dev}, &b), "rand(lo, hi) vs uniform"));
  const auto v = r.to_vec<double>();
  double mean = 0;
  for (double e : v) {
    EXPECT_GE(e, -3.0);
    EXPECT_LT(e, 5.0);
    mean += e / 4000;
  }
  EXPECT_NEAR(mean, 1.0, 0.25);  // U(-3, 5): mean 1, std of the mean 8 / sqrt(12 * 4000) = 0.037
}

TEST(ApiSpellings, FunctionalNamespaceHasActivationsAndLosses) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = random({3, 4}, 5);
  const auto xv = x.to_vec<double>();
  // Activations: F:: and flame:: are one function; values against closed forms.
  using Unary = Tensor (*)(const Tensor&);
  EXPECT_EQ(static_cast<Unary>(&F::relu), static_cast<Unary>(&flame::relu));
  const auto relu = F::relu(x).to_vec<double>();
  const auto silu = F::silu(x).to_vec<double>();
  for (std::size_t i = 0; i < xv.size(); ++i) {
    EXPECT_EQ(relu[i], std::max(xv[i], 0.0));
    EXPECT_NEAR(silu[i], xv[i] / (1 + std::exp(-xv[i])), 1e-12);
  }
  EXPECT_TRUE(all_close(F::gelu(x, "tanh"), flame::gelu(x, true), 0, 0));
  EXPECT_TRUE(all_close(F::gelu(x, "none"), flame::gelu(x, false), 0, 0));
  EXPECT_TRUE(all_close(F::gelu(x), flame::gelu(x), 0, 0));
  expect_error([&] { (void)F::gelu(x, "fast"); }, {"gelu", "\"none\" or \"tanh\"", "fast"});
  const auto sm = F::softmax(x, 1).to_vec<double>();
  const auto lsm = F::log_softmax(x, -1).to_vec<double>();
  // Losses against loops: cross entropy = mean of logsumexp(row) - row[target].
  const Tensor target = Tensor::tensor({2, 0, 3}, dev);
  const std::vector<int64_t> tv = {2, 0, 3};
  double ce = 0, nll = 0;
  for (int r = 0; r < 3; ++r) {
    double z = 0;
    for (int c = 0; c < 4; ++c) z += std::exp(xv[static_cast<std::size_t>(r * 4 + c)]);
    for (int c = 0; c < 4; ++c) {
      const std::size_t i = static_cast<std::size_t>(r * 4 + c);
      EXPECT_NEAR(sm[i], std::exp(xv[i]) / z, 1e-12);
      EXPECT_NEAR(lsm[i], xv[i] - std::log(z), 1e-12);
    }
    ce += (std::log(z) - xv[static_cast<std::size_t>(r * 4 + tv[r])]) / 3;
    nll += -lsm[static_cast<std::size_t>(r * 4 + tv[r])] / 3;
  }
  EXPECT_NEAR(F::cross_entropy(x, target).item<double>(), ce, 1e-12);
  EXPECT_NEAR(F::nll_loss(F::log_softmax(x, 1), target).item<double>(), nll, 1e-12);
  const Tensor y = random({3, 4}, 6);
  const auto yv = y.to_vec<double>();
  double mse = 0, l1 = 0, bce = 0;
  for (std::size_t i = 0; i < xv.size(); ++i) {
    mse += std::pow(xv[i] - yv[i], 2) / 12;
    l1 += std::abs(xv[i] - yv[i]);
    const double p = 1 / (1 + std::exp(-xv[i])), t = yv[i] > 0 ? 1.0 : 0.0;
    bce -= (t * std::log(p) + (1 - t) * std::log(1 - p)) / 12;
  }
  EXPECT_NEAR(F::mse_loss(x, y).item<double>(), mse, 1e-12);
  EXPECT_NEAR(F::l1_loss(x, y, F::Reduction::sum).item<double>(), l1, 1e-12);
  EXPECT_NEAR(F::binary_cross_entropy_with_logits(x, (y > 0).to(DType::f64)).item<double>(), bce, 1e-12);
  // The ops added for the differential test are there too (closed forms at beta = delta = 1).
  double sl1 = 0;
  const auto hs = F::hardswish(x).to_vec<double>(), hsig = F::hardsigmoid(x).to_vec<double>();
  for (std::size_t i = 0; i < xv.size(); ++i) {
    const double d = std::abs(xv[i] - yv[i]);
    sl1 += (d < 1 ? 0.5 * d * d : d - 0.5) / 12;
    const double r6 = std::min(std::max(xv[i] + 3, 0.0), 6.0);
    EXPECT_NEAR(hs[i], xv[i] * r6 / 6, 1e-12);
    EXPECT_NEAR(hsig[i], r6 / 6, 1e-12);
  }
  EXPECT_NEAR(F::smooth_l1_loss(x, y).item<double>(), sl1, 1e-12);
  EXPECT_NEAR(F::huber_loss(x, y).item<double>(), sl1, 1e-12);  // equal to smooth L1 at beta = delta = 1
  // The layer ops sit beside them.
  EXPECT_TRUE(all_close(F::dropout(x, 0.0), x, 0, 0));
  const Tensor w = random({5, 4}, 7);
  EXPECT_TRUE(all_close(F::linear(x, w), x.matmul(w.t()), 1e-12, 1e-12));
  EXPECT_EQ(F::layer_norm(x, {4}).sizes(), x.sizes());
  EXPECT_EQ(F::pad(x, {1, 1}).sizes(), (Shape{3, 6}));
  EXPECT_EQ(F::one_hot(target, 4).sizes(), (Shape{3, 4}));
}

TEST(ApiSpellings, EmbeddingHasPyTorchsArgumentOrder) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor weight = random({5, 3}, 8);
  const Tensor idx = Tensor::tensor({{4, 0}, {2, 4}}, dev);
  const Tensor e = F::embedding(idx, weight, 4);
  ASSERT_EQ(e.sizes(), (Shape{2, 2, 3}));
  const auto wv = weight.to_vec<double>(), ev = e.to_vec<double>();
  const std::vector<int64_t> iv = {4, 0, 2, 4};
  for (std::size_t r = 0; r < 4; ++r)
    for (std::size_t c = 0; c < 3; ++c) EXPECT_EQ(ev[r * 3 + c], wv[static_cast<std::size_t>(iv[r]) * 3 + c]);
  // The older weight-first spelling gives the same rows.
  EXPECT_TRUE(all_close(flame::embedding(weight, idx), e, 0, 0));
}

TEST(ApiSpellings, GradientsGetFailsAtTheCallForAMissingGradient) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor a = Tensor::ones({2, 3}, dev).requires_grad_(true);
  Tensor frozen = Tensor::ones({4}, {DType::f64, dev});
  Tensor unused = Tensor::ones({5}, dev).requires_grad_(true);
  Gradients g = (a * 2.0).sum().backward();
  EXPECT_EQ(g.get(a).to_vec<float>(), std::vector<float>(6, 2.0f));
  expect_error([&] { (void)g.get(frozen); },
               {"Gradients::get", "f64 tensor of shape [4]", "does not require grad", "get_or_zeros", "contains"});
  expect_error([&] { (void)g.get(unused); }, {"Gradients::get", "f32 tensor of shape [5]", "took no part"});
  expect_error([&] { (void)unused.grad(g); }, {"Gradients::get", "[5]"});
  EXPECT_FALSE(g.try_get(unused).defined());
  const Tensor z = g.get_or_zeros(frozen);
  EXPECT_EQ(z.sizes(), frozen.sizes());
  EXPECT_EQ(z.dtype(), DType::f64);
  EXPECT_EQ(z.device(), dev);
  EXPECT_EQ(z.to_vec<double>(), std::vector<double>(4, 0.0));
  EXPECT_TRUE(g.get_or_zeros(a).is_same(g.get(a)));
  EXPECT_FALSE(g.contains(frozen));  // get_or_zeros stores nothing
}

TEST(ApiSpellings, GradientsSetNeedsNoRequiresGrad) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor p = Tensor::zeros({3}, dev);  // never asked for gradients
  Gradients g;
  g.set(p, Tensor::full({3}, 1.5f, dev));
  EXPECT_FALSE(p.requires_grad());
  EXPECT_TRUE(g.contains(p));
  EXPECT_EQ(g.get(p).to_vec<float>(), std::vector<float>(3, 1.5f));
  g.accumulate(p, Tensor::ones({3}, dev));
  EXPECT_EQ(g.get(p).to_vec<float>(), std::vector<float>(3, 2.5f));
  // The identity holds across backward passes that do use p afterwards.
  p.requires_grad_(true);
  Gradients h = (p * 3.0).sum().backward();
  EXPECT_EQ(h.get(p).to_vec<float>(), std::vector<float>(3, 3.0f));
  EXPECT_TRUE(g.contains(p));
  // A view without autograd state is refused with the reason.
  Tensor base = Tensor::zeros({2, 3}, dev);
  expect_error([&] { g.set(base[0], Tensor::ones({3}, dev)); }, {"Gradients::set", "view", "[3]"});
}

TEST(ApiSpellings, ClipGradNormBothSpellingsScaleAlike) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor a = Tensor::ones({4}, dev).requires_grad_(true);
  Gradients g1 = (a * 3.0).sum().backward(), g2 = (a * 3.0).sum().backward();
  // Global L2 norm of four 3s is 6; max_norm 3 halves every gradient (up to the 1e-6 in the scale).
  const double n1 = clip_grad_norm_(g1, 3.0);
  const Tensor n2 = clip_grad_norm(g2, 3.0);
  EXPECT_DOUBLE_EQ(n1, 6.0);
  EXPECT_EQ(n2.dim(), 0);
  EXPECT_NEAR(n2.item<double>(), 6.0, 1e-6);
  EXPECT_TRUE(all_close(g1.get(a), g2.get(a), 1e-6, 0));
  EXPECT_NEAR(g1.get(a)[0].item<double>(), 1.5, 1e-5);
}

}  // namespace
}  // namespace flame::test
