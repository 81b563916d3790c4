// The CUDA backend's copies, elementwise kernels and random numbers against the CPU reference:
// host round trips of every dtype, conversions, views and broadcasting, empty tensors, the Philox
// stream, device errors. Skipped without a GPU.
#include <cstring>
#include <sstream>

#include "test_util.h"

namespace flame::test {
namespace {

const Device kCuda = Device::cuda(0);

// Exact equality of values (NaN matches NaN), shape and dtype.
::testing::AssertionResult same_values(const Tensor& got, const Tensor& want) { return all_close(got, want, 0.0, 0.0); }

TEST(CudaBackend, RoundTripEveryDtype) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType dt : kAllDTypes) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor cpu = make_input({{3, 17, 5}, dt, Layout::contiguous, dt == DType::u8 ? 0.0 : -50.0, 50}, Device::cpu(), 11);
    const Tensor gpu = cpu.to(kCuda);
    ASSERT_TRUE(gpu.device().is_cuda());
    const Tensor back = gpu.to(Device::cpu());
    ASSERT_TRUE(back.device().is_cpu());
    ASSERT_EQ(std::memcmp(back.data_ptr(), cpu.data_ptr(), cpu.nbytes()), 0);
    // A view goes over contiguous first.
    EXPECT_TRUE(same_values(cpu.transpose(0, 2).to(kCuda).to(Device::cpu()), cpu.transpose(0, 2)));
  }
}

TEST(CudaBackend, LargeRoundTripUsesEveryStagingChunk) {
  FLAME_SKIP_IF_NO_CUDA();
  // 84 MB: more than the 64 MiB upload ring and several 16 MiB download chunks.
  const int64_t n = 21'000'037;
  const Tensor cpu = Tensor::arange(0, n, 1, DType::i32);
  const Tensor gpu = cpu.to(kCuda);
  const Tensor doubled = gpu.add(gpu);  // queue work between the copies
  const std::vector<int32_t> back = gpu.to_vec<int32_t>();
  const std::vector<int32_t> twice = doubled.to_vec<int32_t>();
  ASSERT_EQ(back.size(), static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; i += 9973) {
    ASSERT_EQ(back[i], i);
    ASSERT_EQ(twice[i], 2 * i);
  }
  ASSERT_EQ(back[n - 1], n - 1);
  ASSERT_EQ(twice[n - 1], 2 * (n - 1));
}

TEST(CudaBackend, ManySmallUploadsBehindQueuedWork) {
  FLAME_SKIP_IF_NO_CUDA();
  Tensor acc = Tensor::zeros({257}, {DType::f64, kCuda});
  for (int i = 1; i <= 300; ++i) {
    std::vector<double> host(257, static_cast<double>(i));
    acc.add_(Tensor::from_vec(host, {257}, kCuda));
    host.assign(257, -1e9);  // the upload must already be staged: changing the buffer is harmless
  }
  const std::vector<double> v = acc.to_vec<double>();
  for (double x : v) ASSERT_EQ(x, 300.0 * 301.0 / 2.0);
}

TEST(CudaBackend, ConversionsBetweenEveryPairOfDtypes) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType from : kAllDTypes) {
    // Non-negative values: casting negative floats to u8 is undefined in C++ on either device.
    const Tensor cpu = make_input({{5, 33}, from, Layout::contiguous, 0, 120}, Device::cpu(), 21);
    const Tensor gpu = cpu.to(kCuda);
    for (DType to : kAllDTypes) {
      SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + dtype_name(to));
      EXPECT_TRUE(same_values(gpu.to(to), cpu.to(to)));
      // Strided source and destination.
      Tensor dst = Tensor::zeros({33, 5}, {to, kCuda}).t();
      dst.copy_(gpu);
      EXPECT_TRUE(same_values(dst, cpu.to(to)));
    }
  }
}

TEST(CudaBackend, TransposingCopiesOfEveryDtypeAndLayout) {
  FLAME_SKIP_IF_NO_CUDA();
  // Copies whose two sides have their unit strides on different dims take the tiled kernel
  // (Note [Tiled copy]): odd sizes leave partial tiles at both edges, batch dims sit outside,
  // between and inside the tiled dims, and destinations are transposed views too.
  struct Case {
    Shape shape;
    std::vector<int64_t> perm;
  };
  const Case cases[] = {
      {{67, 45}, {1, 0}},              {{3, 40, 33}, {0, 2, 1}},         {{33, 5, 70}, {2, 1, 0}},
      {{2, 17, 3, 19}, {0, 3, 2, 1}},  {{16, 16}, {1, 0}},               {{300, 1, 129}, {2, 1, 0}},
      {{4, 64, 2, 48}, {3, 0, 1, 2}},  {{15, 200}, {1, 0}},  // a side below 16: elementwise path
      // Even sizes and strides: 2-byte types move element pairs (one and two batch dims).
      {{6, 34, 66}, {0, 2, 1}},        {{2, 3, 48, 40}, {1, 0, 3, 2}},
      // Sizes and strides in fours: 1-byte types move 4 x 4 squares (partial tiles at both edges).
      {{68, 132}, {1, 0}},             {{3, 64, 196}, {0, 2, 1}},
  };
  for (const Case& c : cases) {
    for (DType from : kAllDTypes) {
      const Tensor cpu = make_input({c.shape, from, Layout::contiguous, 0, 120}, Device::cpu(), 31);
      const Tensor gpu = cpu.to(kCuda);
      for (DType to : {from, DType::f32, DType::bf16}) {
        std::ostringstream what;
        what << dtype_name(from) << " -> " << dtype_name(to) << " shape";
        for (int64_t d : c.shape) what << ' ' << d;
        SCOPED_TRACE(what.str());
        // Contiguous copy of a permuted view.
        EXPECT_TRUE(same_values(gpu.permute(c.perm).to(to).contiguous(), cpu.permute(c.perm).to(to).contiguous()));
        // A contiguous source written into a permuted destination.
        const Tensor src_cpu = cpu.permute(c.perm).contiguous();
        Tensor dst = Tensor::zeros(c.shape, {to, kCuda}).permute(c.perm);
        dst.copy_(src_cpu.to(kCuda));
        EXPECT_TRUE(same_values(dst, src_cpu.to(to)));
      }
    }
  }
  // A 1-byte source off a 4-byte boundary, or with a row stride not in fours, cannot move squares.
  for (DType dt : {DType::u8, DType::f8_e4m3fn}) {
    const Tensor cpu = make_input({{40, 48}, DType::f32, Layout::contiguous, 0, 120}, Device::cpu(), 34).to(dt);
    const Tensor gpu = cpu.to(kCuda);
    for (int64_t off : {1, 2, 4})
      EXPECT_TRUE(same_values(gpu.narrow(1, off, 40).t().contiguous(), cpu.narrow(1, off, 40).t().contiguous())) << off;
    const Tensor odd = make_input({{40, 42}, DType::f32, Layout::contiguous, 0, 120}, Device::cpu(), 35).to(dt);  // row stride 42
    EXPECT_TRUE(same_values(odd.to(kCuda).narrow(1, 0, 40).t().contiguous(), odd.narrow(1, 0, 40).t().contiguous()));
  }
  // A 2-byte source at an odd element offset, or with odd strides, cannot move pairs.
  for (DType dt : {DType::bf16, DType::f16}) {
    const Tensor cpu = make_input({{40, 42}, dt, Layout::contiguous, 0, 120}, Device::cpu(), 32);
    const Tensor gpu = cpu.to(kCuda);
    EXPECT_TRUE(same_values(gpu.narrow(1, 1, 40).t().contiguous(), cpu.narrow(1, 1, 40).t().contiguous()));
    EXPECT_TRUE(same_values(gpu.narrow(1, 2, 40).t().contiguous(), cpu.narrow(1, 2, 40).t().contiguous()));
    const Tensor odd = make_input({{40, 41}, dt, Layout::contiguous, 0, 120}, Device::cpu(), 33);  // row stride 41
    EXPECT_TRUE(same_values(odd.to(kCuda).narrow(1, 0, 40).t().contiguous(), odd.narrow(1, 0, 40).t().contiguous()));
  }
}

TEST(CudaBackend, RandomMatchesTheCpuStream) {
  FLAME_SKIP_IF_NO_CUDA();
  const Shape shape{301, 67};
  auto both = [&](auto draw) {
    Generator gc(1234), gg(1234);
    return std::make_pair(draw(Device::cpu(), gc), draw(kCuda, gg));
  };
  {
    // Uniform samples are documented bit for bit (src/backend/cuda/random.cu): no tolerance.
    auto [c, g] = both([&](Device d, Generator& gen) { return Tensor::uniform(shape, -3.0, 5.0, {DType::f32, d}, &gen); });
    EXPECT_TRUE(same_values(g, c));
  }
  {
    auto [c, g] = both([&](Device d, Generator& gen) { return Tensor::uniform(shape, -1.5, 0.25, {DType::f64, d}, &gen); });
    EXPECT_TRUE(same_values(g, c));
  }
  {
    auto [c, g] = both([&](Device d, Generator& gen) { return Tensor::randn(shape, 0.5, 2.0, {DType::f32, d}, &gen); });
    EXPECT_TRUE(all_close(g, c, 1e-6, 1e-6));
  }
  {
    auto [c, g] = both([&](Device d, Generator& gen) { return Tensor::randn(shape, 0.0, 1.0, {DType::f64, d}, &gen); });
    EXPECT_TRUE(all_close(g, c, 1e-12, 1e-12));
  }
  {
    auto [c, g] = both([&](Device d, Generator& gen) { return Tensor::rand(shape, {DType::bf16, d}, &gen); });
    EXPECT_TRUE(same_values(g, c));
  }
  {
    auto [c, g] = both([&](Device d, Generator& gen) { return Tensor::rand(shape, {DType::f16, d}, &gen); });
    EXPECT_TRUE(same_values(g, c));
  }
  for (DType dt : {DType::i64, DType::i32, DType::u8}) {
    SCOPED_TRACE(dtype_name(dt));
    auto [c, g] = both([&, dt](Device d, Generator& gen) { return Tensor::randint(-7 * (dt != DType::u8), 200, shape, {dt, d}, &gen); });
    EXPECT_TRUE(same_values(g, c));
  }
  // Successive draws advance the offset identically on both devices.
  Generator gc(99), gg(99);
  Tensor::rand({10}, Device::cpu(), &gc);
  Tensor::rand({10}, kCuda, &gg);
  EXPECT_TRUE(same_values(Tensor::rand({1000}, kCuda, &gg), Tensor::rand({1000}, Device::cpu(), &gc)));
}

// a op b computed on both devices from identical inputs with the given layouts.
void check_binary(const InputSpec& sa, const InputSpec& sb, uint64_t seed) {
  const Tensor ca = make_input(sa, Device::cpu(), seed), cb = make_input(sb, Device::cpu(), seed + 1);
  const Tensor ga = make_input(sa, kCuda, seed), gb = make_input(sb, kCuda, seed + 1);
  const double rtol = default_rtol(sa.dtype), atol = default_atol(sa.dtype);
  EXPECT_TRUE(all_close(ga.add(gb), ca.add(cb), rtol, atol));
  EXPECT_TRUE(all_close(ga.mul(gb), ca.mul(cb), rtol, atol));
  EXPECT_TRUE(all_close(ga.maximum(gb), ca.maximum(cb), rtol, atol));
  EXPECT_TRUE(same_values(ga.lt(gb), ca.lt(cb)));
  EXPECT_TRUE(all_close(ga.div(gb), ca.div(cb), std::max(rtol, 1e-5), std::max(atol, 1e-5)));
}

TEST(CudaBackend, BinaryOnViewsAndBroadcasts) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType dt : {DType::f32, DType::bf16, DType::f64, DType::i32, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    check_binary({{37, 129}, dt, Layout::transposed, 1, 4}, {{37, 129}, dt, Layout::contiguous, 1, 4}, 1);
    check_binary({{9, 40, 31}, dt, Layout::sliced, 1, 4}, {{9, 40, 31}, dt, Layout::expanded, 1, 4}, 2);
    check_binary({{1000, 3}, dt, Layout::contiguous, 1, 4}, {{3}, dt, Layout::contiguous, 1, 4}, 3);     // row broadcast
    check_binary({{70, 1}, dt, Layout::contiguous, 1, 4}, {{1, 45}, dt, Layout::contiguous, 1, 4}, 4);   // outer product
    check_binary({{4099}, dt, Layout::contiguous, 1, 4}, {{}, dt, Layout::contiguous, 1, 4}, 5);         // 0-d operand
    check_binary({{2, 1, 3, 1, 5}, dt, Layout::contiguous, 1, 4}, {{4, 1, 1, 5}, dt, Layout::contiguous, 1, 4}, 6);
  }
}

TEST(CudaBackend, UnaryOnOddSizesAndMisalignedViews) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    SCOPED_TRACE(dtype_name(dt));
    const double rtol = std::max(default_rtol(dt), 1e-5), atol = std::max(default_atol(dt), 1e-5);
    const Tensor c = make_input({{100003}, dt, Layout::contiguous, -3, 3}, Device::cpu(), 7);
    const Tensor g = c.to(kCuda);
    EXPECT_TRUE(all_close(g.gelu(), c.gelu(), rtol, atol));
    EXPECT_TRUE(all_close(g.exp(), c.exp(), rtol, atol));
    EXPECT_TRUE(all_close(g.sigmoid(), c.sigmoid(), rtol, atol));
    // Offset by one element: pointers no longer 16-byte aligned.
    EXPECT_TRUE(all_close(g.narrow(0, 1, 99999).tanh(), c.narrow(0, 1, 99999).tanh(), rtol, atol));
    EXPECT_TRUE(all_close(g.narrow(0, 3, 7).mul(g.narrow(0, 10, 7)), c.narrow(0, 3, 7).mul(c.narrow(0, 10, 7)), rtol,
                          atol));
  }
}

TEST(CudaBackend, InPlaceOnAView) {
  FLAME_SKIP_IF_NO_CUDA();
  Tensor c = make_input({{30, 20}, DType::f32, Layout::contiguous}, Device::cpu(), 3);
  Tensor g = c.to(kCuda);
  const Tensor cy = make_input({{20}, DType::f32, Layout::contiguous}, Device::cpu(), 4);
  Tensor cv = c.t().slice(1, 2, 30, 3);
  Tensor gv = g.t().slice(1, 2, 30, 3);
  cv.add_(cy.slice(0, 0, 20).unsqueeze(1));
  gv.add_(cy.to(kCuda).unsqueeze(1));
  cv.mul_(2.5);
  gv.mul_(2.5);
  EXPECT_TRUE(all_close(g, c, 1e-6, 1e-6));
  // fill_ on a strided view leaves the other elements alone.
  c.slice(0, 1, 30, 4).fill_(-7);
  g.slice(0, 1, 30, 4).fill_(-7);
  EXPECT_TRUE(same_values(g, c));
}

TEST(CudaBackend, FillIotaWhereMatchCpu) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType dt : kAllDTypes) {
    SCOPED_TRACE(dtype_name(dt));
    EXPECT_TRUE(same_values(Tensor::full({3, 1001}, 3, {dt, kCuda}), Tensor::full({3, 1001}, 3, dt)));
    EXPECT_TRUE(same_values(Tensor::zeros({0, 4}, {dt, kCuda}), Tensor::zeros({0, 4}, dt)));
    if (dt != DType::boolean) {
      EXPECT_TRUE(same_values(Tensor::arange(0, 250, 1, {dt, kCuda}), Tensor::arange(0, 250, 1, dt)));
    }
    const Tensor cond = make_input({{17, 33}, DType::boolean, Layout::transposed}, Device::cpu(), 5);
    const Tensor a = make_input({{17, 33}, dt, Layout::contiguous, 0, 100}, Device::cpu(), 6);
    const Tensor b = make_input({{33}, dt, Layout::contiguous, 0, 100}, Device::cpu(), 7);
    EXPECT_TRUE(same_values(where(cond.to(kCuda), a.to(kCuda), b.to(kCuda)), where(cond, a, b)));
  }
  EXPECT_TRUE(same_values(Tensor::linspace(-1.0, 2.0, 1001, {DType::f32, kCuda}), Tensor::linspace(-1.0, 2.0, 1001, DType::f32)));
  EXPECT_TRUE(same_values(Tensor::arange(0.5, 30.0, 0.1, {DType::f64, kCuda}), Tensor::arange(0.5, 30.0, 0.1, DType::f64)));
}

TEST(CudaBackend, ZeroSizeTensors) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor e = Tensor::empty({4, 0, 3}, kCuda);
  EXPECT_EQ(e.add(e).sizes(), (Shape{4, 0, 3}));
  EXPECT_EQ(e.exp().numel(), 0);
  EXPECT_EQ(e.to(DType::i64).dtype(), DType::i64);
  EXPECT_EQ(e.to(Device::cpu()).numel(), 0);
  EXPECT_EQ(Tensor::empty({0}).to(kCuda).numel(), 0);
  EXPECT_EQ(e.add(Tensor::ones({3}, kCuda)).sizes(), (Shape{4, 0, 3}));
  Tensor f = e.clone();
  f.fill_(2);
  EXPECT_EQ(Tensor::rand({0, 7}, kCuda).numel(), 0);
  EXPECT_TRUE(e.to_vec<float>().empty());
}

TEST(CudaBackend, CrossDeviceOpNamesBothDevices) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor c = Tensor::ones({3});
  const Tensor g = Tensor::ones({3}, kCuda);
  expect_error([&] { (void)c.add(g); }, {"add", "cpu", "cuda:0"});
  expect_error([&] { (void)g.mul(c); }, {"mul", "cpu", "cuda:0"});
  expect_error([&] { (void)Tensor::ones({2}, Device::cuda(64)); }, {"cuda:64"});
}

TEST(CudaBackend, SynchronizeAfterQueuedWork) {
  FLAME_SKIP_IF_NO_CUDA();
  Tensor x = Tensor::rand({1 << 20}, kCuda);
  for (int i = 0; i < 20; ++i) x = x.mul_scalar(1.0001).add_scalar(0.5);
  EXPECT_NO_THROW(cuda::synchronize());
  EXPECT_GT(x.to_vec<float>()[0], 10.0f);
}

}  // namespace
}  // namespace flame::test
