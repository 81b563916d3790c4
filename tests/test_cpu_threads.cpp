// The CPU backend's fast convolution paths and thread pool (Note [CPU conv] in
// src/backend/cpu/cpu_conv.cpp, Note [CPU threads] in src/backend/cpu/cpu_threads.cpp):
// f32 convolutions (1x1 direct, images batched into one GEMM, several filter-gradient chunks,
// strides, dilation, padding wider than the kernel reach, groups, 1-d/2-d/3-d) against float64
// direct loops, and results that do not depend on flame::cpu::set_num_threads.
#include <cmath>
#include <csignal>
#include <string>
#include <vector>

#include "flame/cpu.h"
#include "flame/nn/conv.h"
#include "flame/nn/norm.h"
#include "test_util.h"

#include <sys/wait.h>
#include <unistd.h>

namespace flame::test {
namespace {

namespace F = flame::nn::functional;

struct Case {
  std::string name;
  int64_t n, c_in, c_out, groups;
  Shape in, kernel, stride, pad, dilation;
};

std::vector<Case> cases() {
  return {
      // 1x1, stride 1, no padding: x is its own cols; groups.
      {"1x1_direct_groups", 6, 4, 6, 2, {5, 7}, {1, 1}, {1, 1}, {0, 0}, {1, 1}},
      // 40 images of 12x12 -> 144 columns each: chunks of 8 images, 5 filter-gradient partials.
      {"batched_chunks", 40, 3, 4, 1, {12, 12}, {3, 3}, {1, 1}, {1, 1}, {1, 1}},
      // Small maps: every image of the batch in one GEMM.
      {"small_map_one_gemm", 9, 4, 8, 2, {3, 4}, {3, 3}, {1, 1}, {1, 1}, {1, 1}},
      {"stride2_pad", 5, 3, 5, 1, {13, 12}, {3, 3}, {2, 2}, {1, 1}, {1, 1}},
      {"stride3_dilation_w", 3, 2, 3, 1, {9, 17}, {2, 3}, {1, 3}, {0, 2}, {1, 2}},
      // Padding wider than the kernel reaches: whole output rows read padding only.
      {"wide_padding", 2, 2, 3, 1, {4, 5}, {2, 2}, {1, 2}, {3, 2}, {1, 1}},
      {"1x1_strided", 4, 3, 2, 1, {7, 6}, {1, 1}, {2, 2}, {0, 0}, {1, 1}},
      {"1d_batched_pad", 30, 2, 3, 1, {9}, {3}, {1}, {2}, {1}},
      {"3d_stride_groups", 4, 2, 4, 2, {5, 4, 6}, {3, 2, 3}, {2, 1, 2}, {1, 0, 1}, {1, 1, 1}},
  };
}

Tensor rand(const Shape& shape, uint64_t seed) {
  Generator g(seed);
  return Tensor::uniform(shape, -1.0, 1.0, {DType::f64, Device::cpu()}, &g).to(DType::f32);
}

Tensor conv(const Case& c, const Tensor& x, const Tensor& w) {
  switch (c.in.size()) {
    case 1: return F::conv1d(x, w, {}, c.stride, c.pad, c.dilation, c.groups);
    case 2: return F::conv2d(x, w, {}, c.stride, c.pad, c.dilation, c.groups);
    default: return F::conv3d(x, w, {}, c.stride, c.pad, c.dilation, c.groups);
  }
}

// y, dx and dw of the convolution for upstream gradient dy, by direct float64 loops.
struct Ref {
  std::vector<double> y, dx, dw;
};

Ref reference(const Case& c, const Tensor& x, const Tensor& w, const Tensor& dy, const Shape& y_shape) {
  const std::vector<double> xv = x.to_vec<double>(), wv = w.to_vec<double>(), gv = dy.to_vec<double>();
  const int64_t nsp = static_cast<int64_t>(c.in.size()), sh = 3 - nsp;
  int64_t in[3] = {1, 1, 1}, k[3] = {1, 1, 1}, s[3] = {1, 1, 1}, p[3] = {0, 0, 0}, d[3] = {1, 1, 1}, out[3] = {1, 1, 1};
  for (int64_t i = 0; i < nsp; ++i) {
    in[sh + i] = c.in[i];
    k[sh + i] = c.kernel[i];
    s[sh + i] = c.stride[i];
    p[sh + i] = c.pad[i];
    d[sh + i] = c.dilation[i];
    out[sh + i] = y_shape[2 + i];
  }
  const int64_t isz = in[0] * in[1] * in[2], osz = out[0] * out[1] * out[2], ksz = k[0] * k[1] * k[2];
  const int64_t cg = c.c_in / c.groups, kg = c.c_out / c.groups;
  Ref r;
  r.y.assign(static_cast<std::size_t>(c.n * c.c_out * osz), 0.0);
  r.dx.assign(xv.size(), 0.0);
  r.dw.assign(wv.size(), 0.0);
  for (int64_t n = 0; n < c.n; ++n)
    for (int64_t ko = 0; ko < c.c_out; ++ko)
      for (int64_t ci = 0; ci < cg; ++ci)
        for (int64_t t = 0; t < ksz; ++t) {
          const int64_t t0 = t / (k[1] * k[2]), t1 = t / k[2] % k[1], t2 = t % k[2];
          const int64_t xc = (ko / kg) * cg + ci, wi = (ko * cg + ci) * ksz + t;
          for (int64_t o = 0; o < osz; ++o) {
            const int64_t o0 = o / (out[1] * out[2]), o1 = o / out[2] % out[1], o2 = o % out[2];
            const int64_t i0 = o0 * s[0] - p[0] + t0 * d[0], i1 = o1 * s[1] - p[1] + t1 * d[1],
                          i2 = o2 * s[2] - p[2] + t2 * d[2];
            if (i0 < 0 || i0 >= in[0] || i1 < 0 || i1 >= in[1] || i2 < 0 || i2 >= in[2]) continue;
            const std::size_t xi = static_cast<std::size_t>((n * c.c_in + xc) * isz + (i0 * in[1] + i1) * in[2] + i2);
            const std::size_t yi = static_cast<std::size_t>((n * c.c_out + ko) * osz + o);
            r.y[yi] += wv[static_cast<std::size_t>(wi)] * xv[xi];
            r.dx[xi] += gv[yi] * wv[static_cast<std::size_t>(wi)];
            r.dw[static_cast<std::size_t>(wi)] += gv[yi] * xv[xi];
          }
        }
  return r;
}

::testing::AssertionResult close(const Tensor& got, const std::vector<double>& want, const char* what) {
  const std::vector<double> g = got.to_vec<double>();
  if (g.size() != want.size()) return ::testing::AssertionFailure() << what << ": " << g.size() << " vs " << want.size();
  double scale = 1;
  for (double v : want) scale = std::max(scale, std::abs(v));
  for (std::size_t i = 0; i < g.size(); ++i)
    if (!(std::abs(g[i] - want[i]) <= 1e-5 * scale))
      return ::testing::AssertionFailure() << what << " element " << i << ": got " << g[i] << ", want " << want[i];
  return ::testing::AssertionSuccess();
}

struct Grads {
  Tensor y, dx, dw;
};

Grads forward_backward(const Case& c, const Tensor& x, const Tensor& w, const Tensor& dy) {
  Tensor xi = x.detach().requires_grad_(true), wi = w.detach().requires_grad_(true);
  Grads r;
  r.y = conv(c, xi, wi);
  BackwardOptions o;
  o.grad_output = dy;
  Gradients g = r.y.backward(o);
  r.dx = g.get(xi);
  r.dw = g.get(wi);
  return r;
}

// Restores the thread count a test changed.
struct ThreadCountGuard {
  int saved = flame::cpu::num_threads();
  ~ThreadCountGuard() { flame::cpu::set_num_threads(saved); }
};

bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.sizes() == b.sizes() && a.to_vec<double>() == b.to_vec<double>();
}

TEST(CpuConvPaths, ForwardAndGradientsMatchFloat64Loops) {
  ThreadCountGuard guard;
  uint64_t seed = 7000;
  for (int threads : {1, 2}) {
    flame::cpu::set_num_threads(threads);
    for (const Case& c : cases()) {
      SCOPED_TRACE(c.name + ", " + std::to_string(threads) + " threads");
      Shape xs{c.n, c.c_in}, ws{c.c_out, c.c_in / c.groups};
      xs.insert(xs.end(), c.in.begin(), c.in.end());
      ws.insert(ws.end(), c.kernel.begin(), c.kernel.end());
      const Tensor x = rand(xs, seed++), w = rand(ws, seed++);
      const Shape ys = conv(c, x, w).sizes();
      const Tensor dy = rand(ys, seed++);
      const Grads got = forward_backward(c, x, w, dy);
      const Ref want = reference(c, x, w, dy, ys);
      EXPECT_TRUE(close(got.y, want.y, "y"));
      EXPECT_TRUE(close(got.dx, want.dx, "dx"));
      EXPECT_TRUE(close(got.dw, want.dw, "dw"));
    }
  }
}

TEST(CpuThreads, ResultsDoNotDependOnTheThreadCount) {
  ThreadCountGuard guard;
  // Large enough to be split: 32 x 32 x 28 x 28 = 802816 elements.
  const Tensor x = rand({32, 32, 28, 28}, 7100), w = rand({32, 32, 3, 3}, 7101);
  const Tensor dy = rand({32, 32, 28, 28}, 7102), gnw = rand({32}, 7103), gnb = rand({32}, 7104);
  const Tensor emb = rand({32, 32, 1, 1}, 7105), a = rand({4, 300, 200}, 7106), b = rand({4, 200, 150}, 7107);
  const Case c{"c", 32, 32, 32, 1, {28, 28}, {3, 3}, {1, 1}, {1, 1}, {1, 1}};
  std::vector<std::vector<Tensor>> runs;
  for (int threads : {1, 2, 3}) {
    flame::cpu::set_num_threads(threads);
    EXPECT_EQ(flame::cpu::num_threads(), threads);
    const Grads g = forward_backward(c, x, w, dy);
    Tensor xi = x.detach().requires_grad_(true), wi = gnw.detach().requires_grad_(true),
           bi = gnb.detach().requires_grad_(true);
    const Tensor gn = F::group_norm(xi, 8, wi, bi);
    BackwardOptions o;
    o.grad_output = dy;
    Gradients gg = gn.backward(o);
    runs.push_back({g.y, g.dx, g.dw, gn, gg.get(xi), gg.get(wi), gg.get(bi), x.silu(), x + emb, x * dy,
                    matmul(a, b), x.transpose(1, 3).contiguous()});
  }
  const char* names[] = {"conv y", "conv dx", "conv dw", "group_norm y", "group_norm dx", "group_norm dw",
                         "group_norm db", "silu", "broadcast add", "mul", "matmul", "strided copy"};
  for (std::size_t r = 1; r < runs.size(); ++r)
    for (std::size_t i = 0; i < runs[0].size(); ++i)
      EXPECT_TRUE(bit_equal(runs[0][i], runs[r][i])) << names[i] << " differs with " << r + 1 << " threads";
  // And the split results are right: silu and the broadcast add against float64.
  const std::vector<double> xv = x.to_vec<double>(), ev = emb.to_vec<double>();
  const std::vector<double> sv = runs[1][7].to_vec<double>(), av = runs[1][8].to_vec<double>();
  for (std::size_t i = 0; i < xv.size(); i += 997) {
    EXPECT_NEAR(sv[i], xv[i] / (1 + std::exp(-xv[i])), 1e-6);
    EXPECT_NEAR(av[i], xv[i] + ev[i / 784], 1e-6);
  }
}

TEST(CpuThreads, SetNumThreadsRejectsBadCounts) {
  ThreadCountGuard guard;
  expect_error([] { flame::cpu::set_num_threads(0); }, {"cpu::set_num_threads", "1 to 1024", "0"});
  flame::cpu::set_num_threads(3);
  EXPECT_EQ(flame::cpu::num_threads(), 3);
}

// A child forked while the pool has workers has none of them: its ops must run (serially), not
// wait forever for the parent's workers. The child arms an alarm, so a hang fails the case.
TEST(CpuThreads, AForkedChildRunsOpsWithoutTheParentsWorkers) {
  ThreadCountGuard guard;
  flame::cpu::set_num_threads(3);
  const Tensor a = Tensor::arange(0, 1 << 18, 1, DType::f64);  // sums exact in double
  (void)(a * 2.0);  // the pool ran a job in the parent
  const pid_t child = fork();
  ASSERT_GE(child, 0) << "fork failed";
  if (child == 0) {
    alarm(20);
    const bool ok = flame::cpu::num_threads() == 1 &&
                    (a * 2.0 + 1.0).sum_all().item<double>() == double(1 << 18) * double((1 << 18) - 1) + double(1 << 18);
    flame::cpu::set_num_threads(2);  // a fresh pool in the child works too
    const bool ok2 = (a + 1.0).sum_all().item<double>() == double(1 << 18) * double((1 << 18) + 1) / 2.0;
    _exit(ok && ok2 ? 0 : 3);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_FALSE(WIFSIGNALED(status)) << "the child died of signal " << WTERMSIG(status)
                                    << (WTERMSIG(status) == SIGALRM ? " (it hung: an op waited for the parent's workers)" : "");
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child computed a wrong sum or kept the parent's thread count";
}

}  // namespace
}  // namespace flame::test
