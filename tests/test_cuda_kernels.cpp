// CUDA reduction, scan, softmax, matmul and indexing kernels against the CPU reference, on the
// shapes that pick each fast path (rows of 1, 31, 32, 33, 4096, 100000 elements, column and
// strided reductions, split reductions, transposed/broadcast/sliced matmul operands, ...). The
// op-table tests compare every op case on both devices too; these add sizes and layouts. Every case
// skips, with a message, on machines without a GPU. Benchmarks at the end are DISABLED_ (run them
// with --gtest_also_run_disabled_tests on the GPU machine; docs/cuda-kernels.md has the numbers).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <sstream>

#include "test_util.h"

namespace flame::test {
namespace {

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

Device gpu() { return Device::cuda(0); }

// Fresh inputs every run; the seed is printed with any failure.
uint64_t fresh_seed() {
  static std::mt19937_64 rng(std::random_device{}());
  return rng();
}

struct Pair {
  Tensor cpu, gpu;
};
Pair inputs(const InputSpec& spec, uint64_t seed) {
  return {make_input(spec, Device::cpu(), seed), make_input(spec, gpu(), seed)};
}
Pair inputs(const Shape& shape, DType dt, uint64_t seed, Layout layout = Layout::contiguous, double lo = -2.0,
            double hi = 2.0) {
  InputSpec s;
  s.shape = shape;
  s.dtype = dt;
  s.layout = layout;
  s.lo = lo;
  s.hi = hi;
  if (dt == DType::u8 && lo < 0) {  // unsigned: the same number of values, from 0
    s.lo = 0;
    s.hi = hi - lo;
  }
  return inputs(s, seed);
}
// The same host values on both devices.
Pair both(const std::vector<double>& v, const Shape& shape, DType dt) {
  const Tensor c = Tensor::from_vec(v, shape).to(dt);
  return {c, c.to(gpu())};
}

std::string ctx(const std::string& what, const Shape& shape, DType dt, uint64_t seed) {
  std::ostringstream os;
  os << what << " shape [";
  for (std::size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "] " << dtype_name(dt) << " seed " << seed;
  return os.str();
}

const DType kFloats[] = {DType::f32, DType::f64, DType::bf16, DType::f16};
const DType kAll[] = {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8, DType::boolean};

// Tolerance for a sum-like result of `count` terms of magnitude <= 2 in dtype dt (the CUDA kernel
// accumulates f32/half in float, the CPU in double).
double sum_atol(DType dt, int64_t count) {
  if (!is_floating(dt)) return 0.0;
  const double n = static_cast<double>(std::max<int64_t>(count, 1));
  return default_atol(dt) + (dt == DType::f64 ? 1e-13 : 2e-7) * 2.0 * std::sqrt(n) * 8.0;
}

// ---------------------------------------------------------------------------------------------
// Reductions
// ---------------------------------------------------------------------------------------------

void check_reductions(const Pair& x, const Shape& dims, DType dt, const std::string& where) {
  const int64_t count = [&] {
    if (dims.empty()) return x.cpu.numel();
    int64_t c = 1;
    for (int64_t d : dims) c *= x.cpu.size(d);
    return c;
  }();
  const double rt = is_floating(dt) ? std::max(default_rtol(dt), 1e-5) : 0.0;
  SCOPED_TRACE(where);
  EXPECT_TRUE(all_close(sum(x.gpu, dims), sum(x.cpu, dims), rt, sum_atol(dt, count))) << "sum";
  EXPECT_TRUE(all_close(amax(x.gpu, dims), amax(x.cpu, dims), 0, 0)) << "amax";
  EXPECT_TRUE(all_close(amin(x.gpu, dims), amin(x.cpu, dims), 0, 0)) << "amin";
  EXPECT_TRUE(all_close(any(x.gpu, dims), any(x.cpu, dims), 0, 0)) << "any";
  EXPECT_TRUE(all_close(all(x.gpu, dims), all(x.cpu, dims), 0, 0)) << "all";
  if (is_floating(dt)) {
    EXPECT_TRUE(all_close(mean(x.gpu, dims), mean(x.cpu, dims), rt, sum_atol(dt, count) / count + default_atol(dt)))
        << "mean";
  }
  if (dims.size() <= 1) {
    const std::optional<int64_t> d = dims.empty() ? std::nullopt : std::optional<int64_t>(dims[0]);
    EXPECT_TRUE(all_close(argmax(x.gpu, d), argmax(x.cpu, d), 0, 0)) << "argmax";
    EXPECT_TRUE(all_close(argmin(x.gpu, d), argmin(x.cpu, d), 0, 0)) << "argmin";
  }
}

TEST(CudaKernels, ReduceRowsEveryDtypeAndLength) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType dt : kAll) {
    for (int64_t len : {1, 31, 32, 33, 4096, 100000}) {
      const int64_t rows = len >= 4096 ? 3 : 17;
      const uint64_t seed = fresh_seed();
      // Integers in a small range make ties (argmax's first index) common.
      const Pair x = inputs({rows, len}, dt, seed, Layout::contiguous, is_floating(dt) ? -2.0 : -5.0,
                            is_floating(dt) ? 2.0 : 5.0);
      check_reductions(x, {1}, dt, ctx("rows", {rows, len}, dt, seed));
    }
  }
}

TEST(CudaKernels, ReduceProd) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType dt : {DType::f32, DType::f64, DType::i64, DType::i32}) {
    for (int64_t len : {1, 33, 4096}) {
      const uint64_t seed = fresh_seed();
      const bool fl = is_floating(dt);
      const Pair x = inputs({5, len}, dt, seed, Layout::contiguous, fl ? 0.9 : -3.0, fl ? 1.1 : 4.0);
      // Integer products wrap identically (multiplication mod 2^64 is order-free).
      EXPECT_TRUE(all_close(prod(x.gpu, {1}), prod(x.cpu, {1}), fl ? 1e-3 : 0.0, fl ? 1e-30 : 0.0))
          << ctx("prod", {5, len}, dt, seed);
    }
  }
}

TEST(CudaKernels, ReduceSplitSingleOutput) {
  FLAME_SKIP_IF_NO_CUDA();
  // A few long rows: each row is split across blocks and combined by a second kernel.
  for (DType dt : {DType::f32, DType::bf16, DType::i32, DType::boolean, DType::f64}) {
    const uint64_t seed = fresh_seed();
    const Pair x = inputs({(int64_t)3 << 20}, dt, seed, Layout::contiguous, -3.0, 3.0);
    check_reductions(x, {}, dt, ctx("all", x.cpu.sizes(), dt, seed));
    const Pair y = inputs({2, 777777}, dt, seed + 1, Layout::contiguous, -3.0, 3.0);
    check_reductions(y, {1}, dt, ctx("2 long rows", y.cpu.sizes(), dt, seed + 1));
  }
}

TEST(CudaKernels, ReduceColumnsAndStrided) {
  FLAME_SKIP_IF_NO_CUDA();
  struct Case {
    Shape shape;
    Shape dims;
    Layout layout;
  };
  const Case cases[] = {
      {{100000, 7}, {0}, Layout::contiguous},     // column path, split over the reduced extent
      {{33, 4096}, {0}, Layout::contiguous},      // column path, many outputs, vector loads
      {{1000, 12}, {0}, Layout::contiguous},      // vector loads of every dtype, split columns
      {{257, 6}, {0}, Layout::contiguous},        // 6 outputs: vector loads for 8-byte types only
      {{7, 3, 64}, {0, 1}, Layout::contiguous},   // two reduced dims that merge, vector loads
      {{4096, 5}, {0}, Layout::contiguous},       // tiny outputs, long columns
      {{64, 32, 17}, {0, 2}, Layout::contiguous}, // two reduced dims that do not merge: general path
      {{9, 40, 31}, {1, 2}, Layout::transposed},  // permuted reduced dims merge after sorting
      {{300, 70}, {1}, Layout::transposed},       // rows along a strided dim
      {{300, 70}, {}, Layout::transposed},        // everything, permuted
      {{50, 61}, {1}, Layout::sliced},            // stride-2 rows
      {{6, 50, 3}, {0}, Layout::expanded},        // stride-0 reduced dim
      {{5, 8}, {0, 1}, Layout::contiguous},
      {{3, 0, 4}, {2}, Layout::contiguous},       // no outputs
  };
  for (const Case& c : cases) {
    for (DType dt : {DType::f32, DType::bf16, DType::i64, DType::boolean}) {
      const uint64_t seed = fresh_seed();
      const Pair x = inputs(c.shape, dt, seed, c.layout, -4.0, 4.0);
      check_reductions(x, c.dims, dt, ctx(std::string("layout ") + layout_name(c.layout), c.shape, dt, seed));
    }
  }
  // Outputs adjacent in memory but not 16-byte aligned (a narrowed view): scalar loads.
  for (DType dt : {DType::f32, DType::bf16}) {
    const uint64_t seed = fresh_seed();
    const Pair x = inputs({300, 12}, dt, seed);
    const Pair n{x.cpu.narrow(1, 1, 8), x.gpu.narrow(1, 1, 8)};
    check_reductions(n, {0}, dt, ctx("narrowed columns", {300, 8}, dt, seed));
  }
  // Empty reduced extents give the identity.
  const Pair e = inputs({4, 0}, DType::f32, 1);
  EXPECT_TRUE(all_close(sum(e.gpu, {1}), sum(e.cpu, {1}), 0, 0));
  EXPECT_TRUE(all_close(prod(e.gpu, {1}), prod(e.cpu, {1}), 0, 0));
  EXPECT_TRUE(all_close(mean(e.gpu, {1}), mean(e.cpu, {1}), 0, 0));
  EXPECT_TRUE(all_close(all(e.gpu, {1}), all(e.cpu, {1}), 0, 0));
}

TEST(CudaKernels, ArgmaxTiesAndNan) {
  FLAME_SKIP_IF_NO_CUDA();
  // Ties: the first index wins; NaN beats everything, the first NaN wins; max propagates NaN.
  const Pair t = both({1, 3, 3, 2, -1, 3}, {6}, DType::f32);
  EXPECT_EQ(argmax(t.gpu).item<int64_t>(), 1);
  EXPECT_EQ(argmin(t.gpu).item<int64_t>(), 4);
  const Pair n = both({1, kNan, 7, kNan, 9}, {5}, DType::f32);
  EXPECT_EQ(argmax(n.gpu).item<int64_t>(), 1);
  EXPECT_EQ(argmin(n.gpu).item<int64_t>(), 1);
  EXPECT_TRUE(std::isnan(amax(n.gpu).item<double>()));
  EXPECT_TRUE(std::isnan(amin(n.gpu).item<double>()));
  // Long rows (split over blocks) and columns, with planted maxima, minima and NaNs.
  for (DType dt : {DType::f32, DType::bf16, DType::f64}) {
    const int64_t len = 300000;
    std::vector<double> v(static_cast<std::size_t>(2 * len));
    std::mt19937 rng(static_cast<unsigned>(fresh_seed()));
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (double& x : v) x = std::round(u(rng) * 8) / 8;  // many exact ties
    v[200000] = v[250000] = v[299999] = 5;                  // row 0: max ties
    v[10] = v[150001] = -5;                                 // row 0: min ties
    v[len + 123456] = kNan;
    v[len + 200000] = kNan;                                 // row 1: first NaN at 123456
    const Pair x = both(v, {2, len}, dt);
    EXPECT_TRUE(all_close(argmax(x.gpu, 1), argmax(x.cpu, 1), 0, 0)) << dtype_name(dt);
    EXPECT_TRUE(all_close(argmin(x.gpu, 1), argmin(x.cpu, 1), 0, 0)) << dtype_name(dt);
    EXPECT_EQ(argmax(x.gpu, 1).to_vec<int64_t>(), (std::vector<int64_t>{200000, 123456}));
    EXPECT_TRUE(all_close(amax(x.gpu, {1}), amax(x.cpu, {1}), 0, 0));
    const Tensor xt_gpu = x.gpu.t().contiguous().t(), xt_cpu = x.cpu.t().contiguous().t();  // column layout
    EXPECT_TRUE(all_close(argmax(xt_gpu, 1), argmax(xt_cpu, 1), 0, 0));
    const Tensor c_gpu = x.gpu.reshape({len, 2}), c_cpu = x.cpu.reshape({len, 2});  // column reduction
    EXPECT_TRUE(all_close(argmax(c_gpu, 0), argmax(c_cpu, 0), 0, 0));
    EXPECT_TRUE(all_close(argmin(c_gpu, 0), argmin(c_cpu, 0), 0, 0));
  }
}

// ---------------------------------------------------------------------------------------------
// cumsum and softmax
// ---------------------------------------------------------------------------------------------

TEST(CudaKernels, Cumsum) {
  FLAME_SKIP_IF_NO_CUDA();
  struct Case {
    Shape shape;
    int64_t dim;
    Layout layout;
  };
  const Case cases[] = {
      {{3, 1}, 1, Layout::contiguous},        {{5, 31}, 1, Layout::contiguous},
      {{4, 33}, 1, Layout::contiguous},       {{2, 4096}, 1, Layout::contiguous},
      {{2, 100000}, 1, Layout::contiguous},   {{300001}, 0, Layout::contiguous},  // chunked single line
      {{1000, 33}, 0, Layout::contiguous},    {{3, 20000, 2}, 1, Layout::contiguous},
      {{40, 50}, 1, Layout::transposed},      {{40, 50}, 0, Layout::sliced},
      {{7, 9}, 0, Layout::expanded},
  };
  for (const Case& c : cases) {
    for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64, DType::boolean}) {
      const uint64_t seed = fresh_seed();
      const Pair x = inputs(c.shape, dt, seed, c.layout, -3.0, 3.0);
      const int64_t len = c.shape[c.dim];
      const double rt = is_floating(dt) ? default_rtol(dt) : 0.0;
      const Tensor want = cumsum(x.cpu, c.dim);
      // Float accumulation (double for f64) against the CPU's double: the error grows like
      // eps * sqrt(len) * the largest prefix.
      double at = 0.0;
      if (is_floating(dt)) {
        double peak = 0.0;
        for (double v : want.to_vec<double>()) peak = std::max(peak, std::fabs(v));
        at = default_atol(dt) + 8.0 * (dt == DType::f64 ? 2.2e-16 : 1.2e-7) * std::sqrt(double(len)) * peak;
      }
      EXPECT_TRUE(all_close(cumsum(x.gpu, c.dim), want, rt, at))
          << ctx(std::string("cumsum ") + layout_name(c.layout), c.shape, dt, seed);
    }
  }
}

TEST(CudaKernels, SoftmaxRowsStridedAndLong) {
  FLAME_SKIP_IF_NO_CUDA();
  struct Case {
    Shape shape;
    int64_t dim;
    Layout layout;
  };
  const Case cases[] = {
      {{7, 1}, 1, Layout::contiguous},      {{5, 31}, 1, Layout::contiguous},   {{4, 32}, 1, Layout::contiguous},
      {{4, 33}, 1, Layout::contiguous},     {{9, 1000}, 1, Layout::contiguous}, {{16, 4096}, 1, Layout::contiguous},
      {{3, 16384}, 1, Layout::contiguous},  {{3, 100000}, 1, Layout::contiguous},  // online (long-row) path
      {{100, 37}, 0, Layout::contiguous},   {{6, 70, 5}, 1, Layout::contiguous},   // strided rows
      {{60, 50}, 1, Layout::transposed},    {{20, 30}, 1, Layout::sliced},
      {{8, 4096}, 0, Layout::expanded},
  };
  for (const Case& c : cases) {
    for (DType dt : kFloats) {
      const uint64_t seed = fresh_seed();
      const Pair x = inputs(c.shape, dt, seed, c.layout, -6.0, 6.0);
      const double rt = std::max(default_rtol(dt), 1e-5), at = default_atol(dt);
      const std::string where = ctx(std::string("softmax ") + layout_name(c.layout), c.shape, dt, seed);
      EXPECT_TRUE(all_close(softmax(x.gpu, c.dim), softmax(x.cpu, c.dim), rt, at)) << where;
      EXPECT_TRUE(all_close(log_softmax(x.gpu, c.dim), log_softmax(x.cpu, c.dim), rt, at * 4)) << where;
    }
  }
  // Special rows: NaN anywhere -> NaN row; all -inf -> NaN; +inf -> NaN (as the CPU reference).
  for (int64_t len : {5, 3000, 50000}) {
    std::vector<double> v(static_cast<std::size_t>(4 * len), 0.5);
    v[1] = kNan;
    for (int64_t i = 0; i < len; ++i) v[len + i] = -kInf;
    v[2 * len + 2] = kInf;
    v[3 * len] = -kInf;
    for (DType dt : {DType::f32, DType::bf16}) {
      const Pair x = both(v, {4, len}, dt);
      EXPECT_TRUE(all_close(softmax(x.gpu, 1), softmax(x.cpu, 1), 1e-5, 1e-6)) << len << " " << dtype_name(dt);
      EXPECT_TRUE(all_close(log_softmax(x.gpu, 1), log_softmax(x.cpu, 1), 1e-5, 1e-6)) << len;
      const Pair xt{x.cpu.t().contiguous(), x.gpu.t().contiguous()};  // same rows along dim 0
      EXPECT_TRUE(all_close(softmax(xt.gpu, 0), softmax(xt.cpu, 0), 1e-5, 1e-6)) << len;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// matmul
// ---------------------------------------------------------------------------------------------

double matmul_tol(DType dt, bool tf32) {
  switch (dt) {
    case DType::f64: return 1e-12;
    case DType::f32: return tf32 ? 2e-3 : 1e-5;
    case DType::bf16: return 1e-2;
    case DType::f16: return 2e-3;
    default: return 0.0;
  }
}

// Element-by-element matmul check against the float64 product of the CPU operands: each element
// must satisfy |got - want| <= tol * (|a| @ |b|) at that element, the error bound of a sum of
// products, so one wrong element fails even in a large matrix (a whole-matrix norm would hide it).
// Integer products must match the CPU's exactly (both wrap).
::testing::AssertionResult matmul_close(const Tensor& got, const Tensor& a_cpu, const Tensor& b_cpu, double tol) {
  if (!is_floating(got.dtype())) return all_close(got, matmul(a_cpu, b_cpu), 0.0, 0.0);
  const Tensor a = a_cpu.to(DType::f64), b = b_cpu.to(DType::f64);
  const Tensor want_t = matmul(a, b);
  if (got.sizes() != want_t.sizes()) {
    return ::testing::AssertionFailure() << "shape " << shape_str(got.sizes()) << " != " << shape_str(want_t.sizes());
  }
  const std::vector<double> g = got.to_vec<double>(), w = want_t.to_vec<double>();
  const std::vector<double> scale = matmul(a.abs(), b.abs()).to_vec<double>();
  int bad = 0;
  std::ostringstream os;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double bound = tol * scale[i];
    if (!(std::fabs(g[i] - w[i]) <= bound) && bad++ < 5) {
      os << "\n  [" << i << "] got " << g[i] << ", expected " << w[i] << " (bound " << bound << ")";
    }
  }
  if (bad) return ::testing::AssertionFailure() << bad << " of " << g.size() << " elements off" << os.str();
  return ::testing::AssertionSuccess();
}

struct TF32Scope : SwitchScope {
  explicit TF32Scope(bool on) : SwitchScope(cuda::allow_tf32, cuda::set_allow_tf32, on) {}
};

TEST(CudaKernels, MatmulLayoutsAndDtypes) {
  FLAME_SKIP_IF_NO_CUDA();
  struct Case {
    int64_t m, k, n;
  };
  const Case sizes[] = {{1, 1, 1}, {7, 13, 5}, {64, 64, 64}, {127, 65, 33}, {1, 300, 17}, {256, 512, 128}};
  const Layout layouts[] = {Layout::contiguous, Layout::transposed, Layout::sliced};
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
    for (bool tf32 : {false, true}) {
      if (tf32 && dt != DType::f32) continue;
      TF32Scope scope(tf32);
      for (const Case& c : sizes) {
        for (Layout la : layouts) {
          for (Layout lb : layouts) {
            const uint64_t seed = fresh_seed();
            const bool fl = is_floating(dt);
            const Pair a = inputs({c.m, c.k}, dt, seed, la, fl ? -1.0 : 0.0, fl ? 1.0 : 4.0);
            const Pair b = inputs({c.k, c.n}, dt, seed + 7, lb, fl ? -1.0 : 0.0, fl ? 1.0 : 4.0);
            const Tensor got = matmul(a.gpu, b.gpu);
            EXPECT_TRUE(matmul_close(got, a.cpu, b.cpu, matmul_tol(dt, tf32)))
                << "matmul " << c.m << "x" << c.k << "x" << c.n << " " << dtype_name(dt) << " tf32 " << tf32 << " "
                << layout_name(la) << "/" << layout_name(lb) << " seed " << seed;
          }
        }
      }
    }
  }
}

TEST(CudaKernels, MatmulBatchedBroadcastAndEmpty) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType dt : {DType::f32, DType::bf16, DType::i64}) {
    const uint64_t seed = fresh_seed();
    const bool fl = is_floating(dt);
    const double lo = fl ? -1.0 : -3.0, hi = fl ? 1.0 : 3.0, tol = matmul_tol(dt, false);
    // bmm, both batched; transposed batch members.
    const Pair a = inputs({6, 33, 20}, dt, seed, Layout::contiguous, lo, hi);
    const Pair b = inputs({6, 20, 45}, dt, seed + 1, Layout::transposed, lo, hi);
    EXPECT_TRUE(matmul_close(bmm(a.gpu, b.gpu), a.cpu, b.cpu, tol)) << "bmm " << dtype_name(dt);
    // b shared by the batch (weights): the batch folds into M.
    const Pair w = inputs({20, 45}, dt, seed + 2, Layout::contiguous, lo, hi);
    EXPECT_TRUE(matmul_close(matmul(a.gpu, w.gpu), a.cpu, w.cpu, tol)) << "fold " << dtype_name(dt);
    const Pair wt = inputs({20, 45}, dt, seed + 3, Layout::transposed, lo, hi);
    EXPECT_TRUE(matmul_close(matmul(a.gpu, wt.gpu), a.cpu, wt.cpu, tol)) << "fold, b^T " << dtype_name(dt);
    // a shared by the batch: batch stride 0 for a.
    const Pair a1 = inputs({33, 20}, dt, seed + 4, Layout::contiguous, lo, hi);
    EXPECT_TRUE(matmul_close(matmul(a1.gpu, b.gpu), a1.cpu, b.cpu, tol)) << "a broadcast " << dtype_name(dt);
    // Broadcast batch dims [4, 1] x [1, 3] and an expanded, non-foldable a.
    const Pair a4 = inputs({4, 1, 9, 20}, dt, seed + 5, Layout::contiguous, lo, hi);
    const Pair b3 = inputs({1, 3, 20, 11}, dt, seed + 6, Layout::contiguous, lo, hi);
    EXPECT_TRUE(matmul_close(matmul(a4.gpu, b3.gpu), a4.cpu, b3.cpu, tol)) << "broadcast " << dtype_name(dt);
    const Pair ae = inputs({5, 9, 20}, dt, seed + 7, Layout::expanded, lo, hi);
    EXPECT_TRUE(matmul_close(matmul(ae.gpu, w.gpu), ae.cpu, w.cpu, tol)) << "expanded a " << dtype_name(dt);
    // Vector forms.
    const Pair v = inputs({20}, dt, seed + 8, Layout::contiguous, lo, hi);
    EXPECT_TRUE(matmul_close(matmul(a.gpu, v.gpu), a.cpu, v.cpu, tol)) << "matrix-vector " << dtype_name(dt);
    EXPECT_TRUE(matmul_close(matmul(v.gpu, w.gpu), v.cpu, w.cpu, tol)) << "vector-matrix " << dtype_name(dt);
  }
  // K = 0 gives zeros; M = 0 gives an empty result.
  const Tensor z = matmul(Tensor::ones({4, 0}, gpu()), Tensor::ones({0, 3}, gpu()));
  EXPECT_EQ(z.to_vec<float>(), std::vector<float>(12, 0.0f));
  EXPECT_EQ(matmul(Tensor::ones({0, 5}, gpu()), Tensor::ones({5, 3}, gpu())).sizes(), (Shape{0, 3}));
}

TEST(CudaKernels, MatmulLarge) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
    for (bool tf32 : {false, true}) {
      if (tf32 && dt != DType::f32) continue;
      TF32Scope scope(tf32);
      const uint64_t seed = fresh_seed();
      const Pair a = inputs({512, 1536}, dt, seed, Layout::contiguous, -1.0, 1.0);
      const Pair b = inputs({1536, 640}, dt, seed + 1, Layout::transposed, -1.0, 1.0);
      EXPECT_TRUE(matmul_close(matmul(a.gpu, b.gpu), a.cpu, b.cpu, matmul_tol(dt, tf32))) << dtype_name(dt) << " tf32 " << tf32 << " seed " << seed;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Indexing
// ---------------------------------------------------------------------------------------------

Pair random_index(int64_t n, int64_t limit, uint64_t seed, const Shape& shape = {}) {
  InputSpec s;
  s.shape = shape.empty() ? Shape{n} : shape;
  s.dtype = DType::i64;
  s.lo = 0;
  s.hi = static_cast<double>(limit);
  return inputs(s, seed);
}

TEST(CudaKernels, IndexSelectGather) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType dt : kAll) {
    const uint64_t seed = fresh_seed();
    // Row path (contiguous rows of >= 64 bytes), vectorised when rows are 16-byte multiples.
    for (const Shape& shape : {Shape{50, 64}, Shape{50, 33}, Shape{7, 40, 24}, Shape{1000, 768}}) {
      const Pair x = inputs(shape, dt, seed, Layout::contiguous, -5.0, 5.0);
      for (int64_t dim = 0; dim < static_cast<int64_t>(shape.size()); ++dim) {
        const Pair idx = random_index(37, shape[dim], seed + dim);
        EXPECT_TRUE(all_close(index_select(x.gpu, dim, idx.gpu), index_select(x.cpu, dim, idx.cpu), 0, 0))
            << ctx("index_select dim " + std::to_string(dim), shape, dt, seed);
      }
    }
    const Pair xt = inputs({30, 20}, dt, seed + 9, Layout::transposed, -5.0, 5.0);
    const Pair i1 = random_index(11, 30, seed + 10);
    EXPECT_TRUE(all_close(index_select(xt.gpu, 0, i1.gpu), index_select(xt.cpu, 0, i1.cpu), 0, 0));
    // gather along each dim of a 3-d tensor; the index may be smaller than the source elsewhere.
    const Pair g = inputs({6, 9, 11}, dt, seed + 11, Layout::sliced, -5.0, 5.0);
    for (int64_t dim = 0; dim < 3; ++dim) {
      Shape ishape{4, 7, 5};
      ishape[dim] = 13;
      const Pair gi = random_index(0, g.cpu.size(dim), seed + 12 + dim, ishape);
      EXPECT_TRUE(all_close(gather(g.gpu, dim, gi.gpu), gather(g.cpu, dim, gi.cpu), 0, 0))
          << ctx("gather dim " + std::to_string(dim), ishape, dt, seed);
    }
  }
}

TEST(CudaKernels, ScatterAndScatterAdd) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType dt : kAll) {
    const uint64_t seed = fresh_seed();
    const Pair x = inputs({8, 10}, dt, seed, Layout::contiguous, -4.0, 4.0);
    const Pair src = inputs({8, 6}, dt, seed + 1, Layout::transposed, -4.0, 4.0);
    // scatter with distinct indices per row (a random permutation's prefix): deterministic.
    std::vector<int64_t> perm;
    std::mt19937 rng(static_cast<unsigned>(seed));
    for (int r = 0; r < 8; ++r) {
      std::vector<int64_t> p(10);
      for (int i = 0; i < 10; ++i) p[i] = i;
      std::shuffle(p.begin(), p.end(), rng);
      perm.insert(perm.end(), p.begin(), p.begin() + 6);
    }
    const Tensor ic = Tensor::from_vec(perm, {8, 6});
    EXPECT_TRUE(all_close(scatter(x.gpu, 1, ic.to(gpu()), src.gpu), scatter(x.cpu, 1, ic, src.cpu), 0, 0))
        << ctx("scatter", {8, 6}, dt, seed);
    // scatter_add with many duplicates; small integer values make every sum exact in every dtype.
    const Pair idx = random_index(0, 3, seed + 2, {8, 6});
    Pair xi = inputs({8, 10}, dt, seed + 3, Layout::contiguous, -3.0, 4.0);
    Pair si = inputs({8, 6}, dt, seed + 4, Layout::contiguous, -3.0, 4.0);
    if (is_floating(dt)) {  // integers in the destination too: no rounding, any summation order
      xi = {xi.cpu.round(), xi.gpu.round()};
      si = {si.cpu.round(), si.gpu.round()};
    }
    EXPECT_TRUE(all_close(scatter_add(xi.gpu, 1, idx.gpu, si.gpu), scatter_add(xi.cpu, 1, idx.cpu, si.cpu), 0, 0))
        << ctx("scatter_add", {8, 6}, dt, seed);
    const Pair idx0 = random_index(0, 8, seed + 5, {30, 10});
    const Pair s0 = inputs({30, 10}, dt, seed + 6, Layout::contiguous, 0.0, 3.0);
    const Pair s0r = is_floating(dt) ? Pair{s0.cpu.round(), s0.gpu.round()} : s0;
    EXPECT_TRUE(all_close(scatter_add(xi.gpu, 0, idx0.gpu, s0r.gpu), scatter_add(xi.cpu, 0, idx0.cpu, s0r.cpu), 0, 0))
        << ctx("scatter_add dim 0", {30, 10}, dt, seed);
  }
  // Many collisions in f32: equal up to summation order.
  const uint64_t seed = fresh_seed();
  const Pair big = inputs({100000}, DType::f32, seed);
  const Pair bi = random_index(100000, 17, seed + 1);
  const Pair z = inputs({17}, DType::f32, seed + 2);
  EXPECT_TRUE(all_close(scatter_add(z.gpu, 0, bi.gpu, big.gpu), scatter_add(z.cpu, 0, bi.cpu, big.cpu), 1e-4, 1e-2));
}

TEST(CudaKernels, OutOfRangeIndexRaisesAtNextSync) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor x = Tensor::arange(12, {DType::f32, gpu()}).reshape({4, 3});
  const Tensor bad = Tensor::from_vec(std::vector<int64_t>{0, 5, 2}, {3}, gpu());
  Tensor y;
  EXPECT_NO_THROW(y = index_select(x, 0, bad));  // queued; the check happens on the device
  expect_error([&] { y.to_vec<float>(); }, {"index_select", "5", "4"});
  // The record was cleared: a valid op afterwards works.
  const Tensor ok = Tensor::from_vec(std::vector<int64_t>{3, 0}, {2}, gpu());
  EXPECT_EQ(index_select(x, 0, ok).to_vec<float>(), (std::vector<float>{9, 10, 11, 0, 1, 2}));
  const Tensor neg = Tensor::from_vec(std::vector<int64_t>{0, -1, 1, 2}, {1, 4}, gpu());
  expect_error([&] { gather(x, 1, neg.expand({4, 4}).contiguous()).to_vec<float>(); }, {"gather", "-1", "3"});
  const Tensor big = Tensor::from_vec(std::vector<int64_t>{7}, {1, 1}, gpu());
  expect_error([&] { scatter_add(x, 0, big, Tensor::ones({1, 1}, gpu())).to_vec<float>(); }, {"scatter_add", "7", "4"});
  expect_error([&] { scatter(x, 1, big, Tensor::ones({1, 1}, gpu())).to_vec<float>(); }, {"scatter", "7", "3"});
  EXPECT_EQ(sum(x).item<float>(), 66.0f);
}

TEST(CudaKernels, MaskedSelect) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType dt : {DType::f32, DType::bf16, DType::i64, DType::boolean, DType::u8}) {
    const uint64_t seed = fresh_seed();
    for (Layout l : {Layout::contiguous, Layout::transposed, Layout::sliced}) {
      const Pair x = inputs({300, 33}, dt, seed, l, -5.0, 5.0);
      const Pair m = inputs({300, 33}, DType::boolean, seed + 1, l);
      EXPECT_TRUE(all_close(masked_select(x.gpu, m.gpu), masked_select(x.cpu, m.cpu), 0, 0))
          << ctx(std::string("masked_select ") + layout_name(l), {300, 33}, dt, seed);
    }
    const Pair x = inputs({1000, 33}, dt, seed + 2, Layout::contiguous, -5.0, 5.0);
    const Pair mb = inputs({33}, DType::boolean, seed + 3);  // broadcast mask
    EXPECT_TRUE(all_close(masked_select(x.gpu, mb.gpu), masked_select(x.cpu, mb.cpu), 0, 0));
    const Tensor none_g = Tensor::zeros({1000, 33}, {DType::boolean, gpu()});
    EXPECT_EQ(masked_select(x.gpu, none_g).numel(), 0);
    const Tensor all_g = Tensor::ones({1000, 33}, {DType::boolean, gpu()});
    EXPECT_TRUE(all_close(masked_select(x.gpu, all_g), x.cpu.reshape({-1}), 0, 0));
  }
  const uint64_t seed = fresh_seed();
  const Pair big = inputs({5000001}, DType::f32, seed);
  const Pair bm = inputs({5000001}, DType::boolean, seed + 1);
  EXPECT_TRUE(all_close(masked_select(big.gpu, bm.gpu), masked_select(big.cpu, bm.cpu), 0, 0));
}

TEST(CudaKernels, SortStableWithNanAndSignedZero) {
  FLAME_SKIP_IF_NO_CUDA();
  for (DType dt : kAll) {
    // Block sort (<= 512, <= 2048 per row), segmented radix sort, single-row radix sort.
    for (const Shape& shape :
         {Shape{1}, Shape{31}, Shape{8, 33}, Shape{3, 2000}, Shape{5, 4096}, Shape{100000}, Shape{100, 7}}) {
      for (bool desc : {false, true}) {
        const uint64_t seed = fresh_seed();
        const Pair x = inputs(shape, dt, seed, Layout::contiguous, -6.0, 6.0);
        // Coarse values: many ties, so stability is checked through the indices.
        const Pair xr = is_floating(dt) ? Pair{x.cpu.mul_scalar(2).round(), x.gpu.mul_scalar(2).round()} : x;
        for (int64_t dim = 0; dim < static_cast<int64_t>(shape.size()); ++dim) {
          const auto [vg, ig] = sort(xr.gpu, dim, desc);
          const auto [vc, ic] = sort(xr.cpu, dim, desc);
          const std::string where = ctx("sort dim " + std::to_string(dim) + (desc ? " desc" : ""), shape, dt, seed);
          EXPECT_TRUE(all_close(vg, vc, 0, 0)) << where;
          EXPECT_TRUE(all_close(ig, ic, 0, 0)) << where;
        }
      }
    }
  }
  // NaN last ascending / first descending; -0.0 and 0.0 tie (input order kept), transposed input.
  const std::vector<double> v = {3, kNan, -0.0, 1, 0.0, -kInf, kNan, -0.0, kInf, 1};
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    const Pair x = both(v, {10}, dt);
    for (bool desc : {false, true}) {
      const auto [vg, ig] = sort(x.gpu, 0, desc);
      const auto [vc, ic] = sort(x.cpu, 0, desc);
      EXPECT_EQ(ig.to_vec<int64_t>(), ic.to_vec<int64_t>()) << dtype_name(dt) << " desc " << desc;
      const auto gv = vg.to_vec<double>(), cv = vc.to_vec<double>();
      for (std::size_t i = 0; i < gv.size(); ++i) {
        EXPECT_EQ(std::isnan(gv[i]), std::isnan(cv[i]));
        if (!std::isnan(cv[i])) {
          EXPECT_EQ(std::signbit(gv[i]), std::signbit(cv[i])) << i;  // exact bits kept
        }
      }
    }
  }
  const Pair t = inputs({40, 50}, DType::f32, fresh_seed(), Layout::transposed);
  for (int64_t dim : {0, 1}) {
    const auto [vg, ig] = sort(t.gpu, dim, true);
    const auto [vc, ic] = sort(t.cpu, dim, true);
    EXPECT_TRUE(all_close(vg, vc, 0, 0));
    EXPECT_TRUE(all_close(ig, ic, 0, 0));
  }
}

// ---------------------------------------------------------------------------------------------
// Benchmarks (DISABLED_: run with --gtest_also_run_disabled_tests on the GPU machine)
// ---------------------------------------------------------------------------------------------

// Median-free but warm: seconds per call over `iters` calls after 3 warm-up calls.
template <class F>
double time_it(F&& f, int iters = 20) {
  for (int i = 0; i < 3; ++i) f();
  cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  cuda::synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}

TEST(CudaKernelsBench, DISABLED_Bandwidth) {
  FLAME_SKIP_IF_NO_CUDA();
  const int64_t n = int64_t(64) << 20;
  const Tensor x = Tensor::randn({n}, 0.0, 1.0, {DType::f32, gpu()});
  Tensor y = Tensor::empty({n}, {DType::f32, gpu()});
  const double t_copy = time_it([&] { y.copy_(x); });
  const double copy_bw = 2.0 * n * 4 / t_copy;
  std::printf("[bench] copy f32 64M: %.1f us, %.0f GB/s (read + write)\n", t_copy * 1e6, copy_bw / 1e9);
  auto report = [&](const char* what, double secs, double bytes) {
    std::printf("[bench] %-32s %8.1f us %7.0f GB/s  %5.1f%% of copy\n", what, secs * 1e6, bytes / secs / 1e9,
                100.0 * bytes / secs / copy_bw);
  };
  Tensor s;
  report("sum_all f32 64M", time_it([&] { s = sum(x); }), n * 4.0);
  const Tensor xb = x.to(DType::bf16);
  report("sum_all bf16 64M", time_it([&] { s = sum(xb); }), n * 2.0);
  const Tensor rows = x.reshape({16384, 4096});
  report("sum rows f32 [16384,4096]", time_it([&] { s = sum(rows, {1}); }), n * 4.0);
  report("sum cols f32 [16384,4096] dim0", time_it([&] { s = sum(rows, {0}); }), n * 4.0);
  report("argmax rows f32 [16384,4096]", time_it([&] { s = argmax(rows, 1); }), n * 4.0);
  report("softmax f32 [16384,4096]", time_it([&] { s = softmax(rows, 1); }), n * 8.0);
  report("log_softmax f32 [16384,4096]", time_it([&] { s = log_softmax(rows, 1); }), n * 8.0);
  const Tensor rb = xb.reshape({16384, 4096});
  report("softmax bf16 [16384,4096]", time_it([&] { s = softmax(rb, 1); }), n * 4.0);
  const Tensor r1k = x.reshape({65536, 1024});
  report("softmax f32 [65536,1024]", time_it([&] { s = softmax(r1k, 1); }), n * 8.0);
  report("cumsum f32 [16384,4096]", time_it([&] { s = cumsum(rows, 1); }), n * 8.0);
  const Tensor idx = Tensor::randint(0, 16384, {16384}, {DType::i64, gpu()});
  report("index_select rows f32 [16384,4096]", time_it([&] { s = index_select(rows, 0, idx); }), n * 8.0);
  const Tensor sx = x.narrow(0, 0, 1 << 24);
  std::pair<Tensor, Tensor> srt;
  report("sort f32 16M (1 row)", time_it([&] { srt = sort(sx); }, 5), (1 << 24) * 4.0);
  report("sort f32 [16384,1024] rows", time_it([&] { srt = sort(sx.reshape({16384, 1024}), 1); }, 5), (1 << 24) * 4.0);
}

TEST(CudaKernelsBench, DISABLED_Gemm) {
  FLAME_SKIP_IF_NO_CUDA();
  for (int64_t n : {4096, 8192}) {
    for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
      for (bool tf32 : {false, true}) {
        if (tf32 && dt != DType::f32) continue;
        TF32Scope scope(tf32);
        const Tensor a = Tensor::randn({n, n}, 0.0, 1.0, {dt, gpu()}), b = Tensor::randn({n, n}, 0.0, 1.0, {dt, gpu()});
        Tensor c;
        const double t = time_it([&] { c = matmul(a, b); }, n == 8192 ? 10 : 20);
        std::printf("[bench] matmul %s%s %lld^3: %.3f ms, %.1f TFLOP/s\n", dtype_name(dt), tf32 ? " (tf32)" : "",
                    static_cast<long long>(n), t * 1e3, 2.0 * n * n * n / t / 1e12);
      }
    }
  }
}

}  // namespace
}  // namespace flame::test
