// The fused cross-entropy path of flame::cross_entropy ([C] and [N, C] logits): values and
// gradients against the composite (log_softmax + gather, written here with public ops) for every
// reduction, ignore_index and label smoothing; float64 gradcheck on the CPU; CUDA against the CPU
// for f32/bf16/f16 on short, odd and vocabulary-sized rows; the forward's peak memory; errors.
#include <cmath>

#include "flame/cuda.h"
#include "gradcheck.h"
#include "test_util.h"

namespace flame::test {
namespace {

Tensor rnd(const Shape& s, DType dt, Device dev, uint64_t seed, double lo = -4.0, double hi = 4.0) {
  return make_input({s, dt, Layout::contiguous, lo, hi}, dev, seed);
}

// Targets in [0, V) with every third one ignored (ignore_index -100) when `with_ignored`.
Tensor make_targets(int64_t n, int64_t v, Device dev, bool with_ignored, uint64_t seed) {
  std::vector<int64_t> t(static_cast<std::size_t>(n));
  uint64_t s = seed * 2654435761u + 1;
  for (int64_t i = 0; i < n; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    t[i] = static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(v));
    if (with_ignored && i % 3 == 1) t[i] = -100;
  }
  return Tensor::from_vec<int64_t>(t, {n}, dev);
}

// PyTorch's definition, from public ops: per row (1-eps)*(-logp[t]) + eps*mean(-logp), 0 where
// ignored; mean divides by the number of counted rows.
Tensor composite(const Tensor& x, const Tensor& t, Reduction r, double eps) {
  const Tensor xf = x.to(x.dtype() == DType::f64 ? DType::f64 : DType::f32);
  const Tensor logp = log_softmax(xf, 1);
  const Tensor valid = ne(t, Tensor::scalar(int64_t{-100}, {DType::i64, t.device()}));
  const Tensor safe = where(valid, t, Tensor::scalar(int64_t{0}, {DType::i64, t.device()}));
  const Tensor nll = neg(gather(logp, 1, safe.unsqueeze(1)).squeeze(1));
  const Tensor smooth = neg(mean(logp, {1}));
  Tensor per = add(mul_scalar(nll, 1.0 - eps), mul_scalar(smooth, eps));
  per = where(valid, per, Tensor::scalar(0.0, {per.dtype(), per.device()}));
  switch (r) {
    case Reduction::none: return per.to(x.dtype());
    case Reduction::sum: return sum(per).to(x.dtype());
    case Reduction::mean: return div(sum(per), sum(valid.to(per.dtype()))).to(x.dtype());
  }
  return {};
}

Tensor grad_wrt(const std::function<Tensor(const Tensor&)>& f, const Tensor& x, const Tensor& gout) {
  Tensor leaf = x.detach().clone().requires_grad_();
  Tensor y = f(leaf);
  BackwardOptions o;
  o.grad_output = gout;
  return y.backward(o).get(leaf);
}

TEST(CrossEntropyFused, MatchesCompositeForEveryOption) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (DType dt : {DType::f64, DType::f32}) {
    const Tensor x = rnd({13, 37}, dt, dev, 3);
    for (bool ignored : {false, true}) {
      const Tensor t = make_targets(13, 37, dev, ignored, 4);
      for (Reduction r : {Reduction::none, Reduction::mean, Reduction::sum}) {
        for (double eps : {0.0, 0.1}) {
          auto fused = [&](const Tensor& v) { return cross_entropy(v, t, r, -100, eps); };
          auto ref = [&](const Tensor& v) { return composite(v, t, r, eps); };
          const double tol = dt == DType::f64 ? 1e-12 : 2e-5;
          const Tensor yf = fused(x), yr = ref(x);
          EXPECT_EQ(yf.dtype(), dt);
          EXPECT_TRUE(all_close(yf, yr, tol, tol)) << dtype_name(dt) << " r" << int(r) << " eps " << eps;
          const Tensor gout = rnd(yr.sizes(), dt, dev, 5, -1, 1);
          EXPECT_TRUE(all_close(grad_wrt(fused, x, gout), grad_wrt(ref, x, gout), tol, tol))
              << "grad " << dtype_name(dt) << " r" << int(r) << " eps " << eps;
        }
      }
    }
  }
}

TEST(CrossEntropyFused, OneDimLogitsAndAllIgnored) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = rnd({9}, DType::f32, dev, 8);
  const Tensor t = Tensor::from_vec<int64_t>({4}, {}, dev);
  const std::vector<float> xv = x.to(Device::cpu()).to_vec<float>();
  double lse = 0;
  for (float v : xv) lse += std::exp(static_cast<double>(v));
  lse = std::log(lse);
  EXPECT_NEAR(cross_entropy(x, t).item<float>(), lse - xv[4], 1e-5);
  EXPECT_EQ(cross_entropy(x, t, Reduction::none).sizes(), Shape{});
  // A mean over only ignored targets is 0/0 (PyTorch gives nan); their gradient is 0.
  const Tensor xs = rnd({3, 5}, DType::f32, dev, 9);
  const Tensor all_ignored = Tensor::from_vec<int64_t>({-100, -100, -100}, {3}, dev);
  EXPECT_TRUE(std::isnan(cross_entropy(xs, all_ignored).item<float>()));
  const Tensor g = grad_wrt([&](const Tensor& v) { return cross_entropy(v, all_ignored, Reduction::sum); }, xs,
                            Tensor::scalar(1.0, {DType::f32, dev}));
  for (float v : g.to(Device::cpu()).to_vec<float>()) EXPECT_EQ(v, 0.0f);
}

TEST(CrossEntropyFused, EmptyBatch) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = Tensor::zeros({0, 5}, {DType::f32, dev});
  const Tensor t = Tensor::zeros({0}, {DType::i64, dev});
  EXPECT_EQ(cross_entropy(x, t, Reduction::none).sizes(), (Shape{0}));
  EXPECT_EQ(cross_entropy(x, t, Reduction::sum).item<float>(), 0.0f);
  EXPECT_TRUE(std::isnan(cross_entropy(x, t).item<float>()));  // 0/0, as PyTorch
}

TEST(CrossEntropyFused, GradcheckFloat64) {
  const Tensor x = rnd({6, 11}, DType::f64, Device::cpu(), 10);
  const Tensor t = make_targets(6, 11, Device::cpu(), true, 11);
  for (double eps : {0.0, 0.25}) {
    for (Reduction r : {Reduction::mean, Reduction::none}) {
      const GradcheckResult g =
          gradcheck([&](const TensorList& in) { return cross_entropy(in[0], t, r, -100, eps); }, {x});
      EXPECT_TRUE(g.ok) << "eps " << eps << ": " << g.message;
    }
  }
  const GradcheckResult g1 = gradcheck(
      [&](const TensorList& in) { return cross_entropy(in[0], Tensor::from_vec<int64_t>({2}, {})); },
      {rnd({7}, DType::f64, Device::cpu(), 12)});
  EXPECT_TRUE(g1.ok) << g1.message;
}

TEST(CrossEntropyFused, NonContiguousLogits) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor base = rnd({21, 8}, DType::f32, dev, 13);
  const Tensor x = base.t();  // [8, 21], column-major
  const Tensor t = make_targets(8, 21, dev, false, 14);
  EXPECT_TRUE(all_close(cross_entropy(x, t, Reduction::none), composite(x.contiguous(), t, Reduction::none, 0.0), 1e-5,
                        1e-5));
}

// ---- CUDA against the CPU ----

TEST(CrossEntropyCuda, MatchesCpuForHalfAndFloatRows) {
  FLAME_SKIP_IF_NO_CUDA();
  struct C {
    int64_t n, v;
  };
  for (C c : {C{7, 5}, C{33, 1000}, C{16, 1003}, C{4, 32000}, C{3, 50257}}) {
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      const Tensor x = rnd({c.n, c.v}, dt, Device::cpu(), 20 + c.v);
      const Tensor t = make_targets(c.n, c.v, Device::cpu(), true, 21);
      const Tensor xc = x.to(Device::cuda()), tc = t.to(Device::cuda());
      for (double eps : {0.0, 0.1}) {
        const Tensor l_cpu = cross_entropy(x, t, Reduction::none, -100, eps);
        const Tensor l_gpu = cross_entropy(xc, tc, Reduction::none, -100, eps);
        const double tol = dt == DType::f32 ? 1e-5 : 1e-2;
        EXPECT_TRUE(all_close(l_gpu, l_cpu, tol, tol)) << c.n << "x" << c.v << " " << dtype_name(dt) << " eps " << eps;
        EXPECT_TRUE(all_close(cross_entropy(xc, tc, Reduction::mean, -100, eps),
                              cross_entropy(x, t, Reduction::mean, -100, eps), tol, tol));
        const Tensor gout = rnd({c.n}, dt, Device::cpu(), 22, -1, 1);
        auto f_cpu = [&](const Tensor& v) { return cross_entropy(v, t, Reduction::none, -100, eps); };
        auto f_gpu = [&](const Tensor& v) { return cross_entropy(v, tc, Reduction::none, -100, eps); };
        const Tensor g_gpu = grad_wrt(f_gpu, xc, gout.to(Device::cuda()));
        EXPECT_EQ(g_gpu.dtype(), dt);
        EXPECT_TRUE(all_close(g_gpu, grad_wrt(f_cpu, x, gout), tol, 1e-3))
            << "grad " << c.n << "x" << c.v << " " << dtype_name(dt);
      }
    }
  }
}

TEST(CrossEntropyCuda, ForwardHoldsNoRowsByClassesTensor) {
  FLAME_SKIP_IF_NO_CUDA();
  const int64_t n = 1024, v = 32000;
  const Tensor x = rnd({n, v}, DType::bf16, Device::cpu(), 30).to(Device::cuda()).requires_grad_();
  const Tensor t = make_targets(n, v, Device::cuda(), false, 31);
  cuda::synchronize();
  const std::size_t before = cuda::memory_stats().allocated_bytes;
  cuda::reset_peak_memory_stats();
  Tensor loss = cross_entropy(x, t);
  cuda::synchronize();
  const std::size_t extra = cuda::memory_stats().peak_allocated_bytes - before;
  // A log-softmax of the logits would be n*v*2 bytes (bf16) or n*v*4 (f32); the fused forward
  // keeps per-row values only.
  EXPECT_LT(extra, static_cast<std::size_t>(n * v * 2 / 8)) << "forward peaked " << extra << " bytes above the inputs";
  Gradients g = loss.backward();
  EXPECT_EQ(g.get(x).sizes(), (Shape{n, v}));
  EXPECT_EQ(g.get(x).dtype(), DType::bf16);
}

TEST(CrossEntropyCuda, OutOfRangeTargetIsReported) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor x = rnd({3, 4}, DType::f32, Device::cuda(), 40);
  expect_error([&] { cross_entropy(x, Tensor::from_vec<int64_t>({0, 9, 1}, {3}, Device::cuda())).item<float>(); },
               {"9"});
}

}  // namespace
}  // namespace flame::test
