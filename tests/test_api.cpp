// The libtorch-facing API points of issue 8 section 6: single-dim reductions, whole-tensor max/min,
// alpha in add/sub, randn with options, in-place writes through temporaries, half-type scalars,
// comparison operators, the literal factory and summarised printing. Compile-time items are
// static_asserts (the file would not compile against the old headers). Runs on the device under test.
#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <regex>
#include <string>
#include <type_traits>

#include "gradcheck.h"
#include "test_util.h"

namespace flame::test {
namespace {

Tensor random(const Shape& shape, uint64_t seed, DType dt = DType::f32) {
  Generator g(seed);
  return Tensor::randn(shape, 0.0, 1.0, {dt, test_device()}, &g);
}

// x[i][j][k] of a contiguous row-major host copy.
double at3(const std::vector<double>& v, const Shape& s, int64_t i, int64_t j, int64_t k) {
  return v[static_cast<std::size_t>((i * s[1] + j) * s[2] + k)];
}

// ---- compile-time API shape (each line failed to compile before) ----
static_assert(std::is_convertible_v<bfloat16, Scalar> && std::is_convertible_v<float16, Scalar>);
static_assert(requires(Tensor x) { x.narrow(0, 0, 1) += 1; });
static_assert(requires(Tensor x, Tensor y) { x.narrow(0, 0, 1) *= y; });
static_assert(requires(Tensor x) { x.narrow(0, 0, 1).sub_(x, 2); });
static_assert(requires(Tensor x) { { x < 1 } -> std::same_as<Tensor>; });
static_assert(requires(Tensor x) { { x == x } -> std::same_as<Tensor>; });
static_assert(requires(Tensor x) { { x.max() } -> std::same_as<Tensor>; });
static_assert(requires(Tensor x) { x.sum(1); x.mean(-1, true); x.var(0, 0, true); });
// A bool is not a dim: x.sum(true) stays a compile error rather than summing dim 1.
template <class D>
concept SumTakesDim = requires(Tensor x, D d) { x.sum(d); };
static_assert(SumTakesDim<int> && SumTakesDim<int64_t> && SumTakesDim<unsigned> && !SumTakesDim<bool>);

// ---- single-dim reductions ----
TEST(Api, SingleDimReductionsMatchShapeForms) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Shape s{3, 4, 5};
  Tensor x = random(s, 1);
  const auto v = x.to_vec<double>();
  // x.sum(1) against a host loop, then every other single-dim form against its Shape form.
  Tensor s1 = x.sum(1);
  ASSERT_EQ(s1.sizes(), (Shape{3, 5}));
  const auto sv = s1.to_vec<double>();
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t k = 0; k < 5; ++k) {
      double ref = 0;
      for (int64_t j = 0; j < 4; ++j) ref += at3(v, s, i, j, k);
      EXPECT_NEAR(sv[static_cast<std::size_t>(i * 5 + k)], ref, 1e-4);
    }
  }
  EXPECT_EQ(x.sum(1, true).sizes(), (Shape{3, 1, 5}));
  EXPECT_EQ(x.mean(-1).sizes(), (Shape{3, 4}));
  EXPECT_TRUE(all_close(x.mean(-1), x.mean({2}), 0, 0));
  EXPECT_TRUE(all_close(x.prod(0, true), x.prod({0}, true), 0, 0));
  EXPECT_TRUE(all_close(x.max(2), x.max({2}), 0, 0));
  EXPECT_TRUE(all_close(x.min(-2, true), x.min({1}, true), 0, 0));
  EXPECT_TRUE(all_close(x.logsumexp(1), x.logsumexp({1}), 0, 0));
  EXPECT_TRUE(all_close(x.var(1), x.var({1}), 0, 0));
  EXPECT_TRUE(all_close(x.var(1, 0, true), x.var({1}, 0, true), 0, 0));
  EXPECT_TRUE(all_close(x.std(-1, 0), x.std({2}, 0), 0, 0));
  Tensor pos = x.gt(Tensor::zeros({}, test_device()));
  EXPECT_TRUE(all_close(pos.any(1), pos.any({1}), 0, 0));
  EXPECT_TRUE(all_close(pos.all(0, true), pos.all({0}, true), 0, 0));
  // Unsigned and narrower integer dims work too.
  EXPECT_TRUE(all_close(x.sum(std::size_t{2}), x.sum({2}), 0, 0));
  EXPECT_TRUE(all_close(x.sum(int8_t{-3}), x.sum({0}), 0, 0));
  expect_error([&] { (void)x.sum(3); }, {"sum", "3"});
}

TEST(Api, AmbiguousLookingReductionCallsKeepTheirMeaning) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = random({3, 4}, 2);
  double total = 0;
  for (double e : x.to_vec<double>()) total += e;
  // {} is "all dims" (an int64_t overload would have taken it as dim 0).
  EXPECT_EQ(x.sum({}).dim(), 0);
  EXPECT_NEAR(x.sum({}).item<double>(), total, 1e-4);
  EXPECT_EQ(x.sum().dim(), 0);
  EXPECT_EQ(x.sum({}, true).sizes(), (Shape{1, 1}));
  EXPECT_EQ(x.mean({}).dim(), 0);
  EXPECT_EQ(x.sum({0, 1}).dim(), 0);
  EXPECT_EQ(x.sum({1}).sizes(), (Shape{3}));
  EXPECT_EQ(x.var({}, 0).dim(), 0);
  EXPECT_EQ(flame::sum(x, {}).dim(), 0);
  EXPECT_EQ(flame::amax(x, {}).dim(), 0);
  // Free functions take single dims as well.
  EXPECT_TRUE(all_close(flame::sum(x, 1), x.sum({1}), 0, 0));
  EXPECT_TRUE(all_close(flame::amax(x, -1, true), x.max({1}, true), 0, 0));
  EXPECT_TRUE(all_close(flame::var(x, 0, 0), x.var({0}, 0), 0, 0));
  EXPECT_TRUE(all_close(flame::std(x, 1), x.std({1}), 0, 0));
  EXPECT_TRUE(all_close(flame::mean(x, int64_t{0}, true), x.mean({0}, true), 0, 0));
}

TEST(Api, WholeTensorMaxMin) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = random({5, 7}, 3);
  const auto v = x.to_vec<double>();
  const double mx = *std::max_element(v.begin(), v.end()), mn = *std::min_element(v.begin(), v.end());
  Tensor m = x.max();
  EXPECT_EQ(m.dim(), 0);
  EXPECT_EQ(m.dtype(), DType::f32);
  EXPECT_EQ(m.item<double>(), mx);
  EXPECT_EQ(x.min().item<double>(), mn);
  EXPECT_EQ(x.max({1}).sizes(), (Shape{5}));  // the dims form is unchanged
}

// ---- add/sub with alpha ----
TEST(Api, AddSubWithAlpha) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = random({4, 3}, 4), b = random({4, 3}, 5);
  const auto av = a.to_vec<double>(), bv = b.to_vec<double>();
  const auto add = a.add(b, 2.5).to_vec<double>(), sub = a.sub(b, -3).to_vec<double>();
  const auto fadd = flame::add(a, b, 0.5).to_vec<double>(), fsub = flame::sub(a, b, 4).to_vec<double>();
  for (std::size_t i = 0; i < av.size(); ++i) {
    EXPECT_NEAR(add[i], av[i] + 2.5 * bv[i], 1e-5);
    EXPECT_NEAR(sub[i], av[i] + 3 * bv[i], 1e-5);
    EXPECT_NEAR(fadd[i], av[i] + 0.5 * bv[i], 1e-5);
    EXPECT_NEAR(fsub[i], av[i] - 4 * bv[i], 1e-5);
  }
  // In place: sub_ with alpha, and add_ with alpha agree with the out-of-place forms.
  Tensor c = a.clone();
  c.sub_(b, 1.5);
  EXPECT_TRUE(all_close(c, a.sub(b, 1.5), 1e-6, 1e-6));
  Tensor d = a.clone();
  d.add_(b, -0.75);
  EXPECT_TRUE(all_close(d, a.add(b, -0.75), 1e-6, 1e-6));
  // Broadcasting other.
  Tensor row = random({3}, 6);
  EXPECT_TRUE(all_close(a.add(row, 2), a + row * 2.0, 1e-6, 1e-6));
}

TEST(Api, AddAlphaDtypeRules) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  // Integer alpha with integer tensors is exact; a narrower b is scaled in the result type (no
  // int32 wrap-around of 2^30 * 8).
  Tensor a = Tensor::from_vec<int64_t>({1, -2, 3}, {3}, dev);
  Tensor b = Tensor::from_vec<int32_t>({int32_t{1} << 30, 5, -7}, {3}, dev);
  Tensor r = a.add(b, 8);
  EXPECT_EQ(r.dtype(), DType::i64);
  EXPECT_EQ(r.to_vec<int64_t>(), (std::vector<int64_t>{1 + (int64_t{1} << 33), 38, -53}));
  // The in-place forms follow the same rules.
  Tensor ai = a.clone();
  ai.add_(b, 8);
  EXPECT_EQ(ai.to_vec<int64_t>(), r.to_vec<int64_t>());
  ai.sub_(b, 8);
  EXPECT_EQ(ai.to_vec<int64_t>(), a.to_vec<int64_t>());
  expect_error([&] { ai.add_(b, 0.5); }, {"add_", "alpha", "0.5"});
  expect_error([&] { ai.sub_(b, 2.5); }, {"sub_", "alpha", "2.5"});
  // Integer alpha with a float tensor.
  Tensor f = Tensor::from_vec<float>({0.5f, 1.5f, -2.f}, {3}, dev);
  EXPECT_EQ(f.add(a, 2).to_vec<float>(), (std::vector<float>{2.5f, -2.5f, 4.f}));
  // A floating alpha with an integral result, and non-bool alpha with bool tensors, are errors.
  expect_error([&] { (void)a.add(b, 0.5); }, {"add", "alpha", "0.5", "i64"});
  expect_error([&] { (void)a.sub(a, 1.5); }, {"sub", "alpha"});
  Tensor m = Tensor::from_vec(std::vector<bool>{true, false, true}, {3}, dev);
  expect_error([&] { (void)m.add(m, 2); }, {"add", "bool"});
  EXPECT_EQ(m.add(m, false).to_vec<bool>(), (std::vector<bool>{true, false, true}));
}

TEST(Api, AddSubAlphaGradients) {
  Generator g(7);
  TensorList in;
  for (int i = 0; i < 3; ++i) in.push_back(Tensor::randn({3, 2}, 0.0, 1.0, DType::f64, &g));
  const GradcheckResult r = gradcheck(
      [](const TensorList& x) { return x[0].add(x[1], 2.5).sub(x[2], -1.5) * x[1]; }, in);
  EXPECT_TRUE(r.ok) << r.message;
  EXPECT_GT(r.checked, 0);
  Tensor x = Tensor::randn({4}, 0.0, 1.0, DType::f64, &g).requires_grad_(true);
  Tensor y = Tensor::randn({4}, 0.0, 1.0, DType::f64, &g).requires_grad_(true);
  Gradients grads = x.sub(y, 3).sum().backward();
  for (double v : grads.get(y).to_vec<double>()) EXPECT_EQ(v, -3.0);
  for (double v : grads.get(x).to_vec<double>()) EXPECT_EQ(v, 1.0);
}

// ---- randn with options ----
TEST(Api, RandnWithOptions) {
  FLAME_SKIP_IF_NO_DEVICE();
  Generator g1(11), g2(11);
  Tensor a = Tensor::randn({4000}, {DType::f64, test_device()}, &g1);
  Tensor b = Tensor::randn({4000}, 0.0, 1.0, {DType::f64, test_device()}, &g2);
  EXPECT_EQ(a.dtype(), DType::f64);
  EXPECT_EQ(a.device(), test_device());
  EXPECT_TRUE(all_close(a, b, 0, 0));  // same draw as the explicit mean/std form
  const auto v = a.to_vec<double>();
  double mean = 0, sq = 0;
  for (double e : v) mean += e;
  mean /= static_cast<double>(v.size());
  for (double e : v) sq += (e - mean) * (e - mean);
  EXPECT_LT(std::fabs(mean), 0.08);
  EXPECT_NEAR(std::sqrt(sq / static_cast<double>(v.size())), 1.0, 0.08);
  // Every spelling of the options still resolves.
  EXPECT_EQ(Tensor::randn({2}, DType::bf16).dtype(), DType::bf16);
  EXPECT_EQ(Tensor::randn({2}, test_device()).device(), test_device());
  EXPECT_EQ(Tensor::randn({2}, 0.0, 1.0, test_device()).dtype(), DType::f32);
  EXPECT_EQ(Tensor::randn({2, 3}).sizes(), (Shape{2, 3}));
  expect_error([] { (void)Tensor::randn({2}, DType::i64); }, {"randn", "i64"});
}

// ---- in-place writes through views and temporaries ----
TEST(Api, InPlaceThroughTemporaryViewsWritesTheBase) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = random({4, 3}, 12);
  Tensor y = random({3}, 13);
  const auto before = x.to_vec<double>(), yv = y.to_vec<double>();
  x.narrow(0, 0, 1).add_(1);
  x.narrow(0, 1, 1) += 2;
  x.select(0, 2) *= 3.0;
  x.narrow(0, 3, 1) -= y;
  x.narrow(1, 2, 1).narrow(0, 0, 2).sub_(y.narrow(0, 0, 1), 0.5);  // chained views, alpha
  const auto after = x.to_vec<double>();
  for (int64_t j = 0; j < 3; ++j) {
    const double extra = j == 2 ? -0.5 * yv[0] : 0.0;
    EXPECT_NEAR(after[j], before[j] + 1 + extra, 1e-5);
    EXPECT_NEAR(after[3 + j], before[3 + j] + 2 + extra, 1e-5);
    EXPECT_NEAR(after[6 + j], before[6 + j] * 3, 1e-5);
    EXPECT_NEAR(after[9 + j], before[9 + j] - yv[j], 1e-5);
  }
  // The rvalue operator returns a handle on the same view.
  Tensor v = (x.narrow(0, 0, 2) /= 2.0);
  EXPECT_EQ(v.sizes(), (Shape{2, 3}));
  EXPECT_TRUE(v.shares_storage(x));
  EXPECT_NEAR(x.to_vec<double>()[0], after[0] / 2, 1e-5);
}

// ---- scalars from half types ----
TEST(Api, HalfTypeScalars) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Scalar sb(bfloat16(1.5f)), sh = float16(-2.25f);
  EXPECT_TRUE(sb.is_floating());
  EXPECT_EQ(sb.to_double(), 1.5);
  EXPECT_EQ(sh.to_double(), -2.25);
  Tensor x = random({6}, 14);
  const auto xv = x.to_vec<double>();
  const auto m = (x * float16(2.0f)).to_vec<double>(), a = (bfloat16(0.5f) + x).to_vec<double>();
  for (std::size_t i = 0; i < xv.size(); ++i) {
    EXPECT_NEAR(m[i], 2 * xv[i], 1e-6);
    EXPECT_NEAR(a[i], xv[i] + 0.5, 1e-6);
  }
  // A floating scalar: an integer tensor times bfloat16 promotes to floating.
  Tensor i = Tensor::arange(4, test_device());
  EXPECT_EQ((i * bfloat16(0.5f)).dtype(), DType::f32);
  EXPECT_EQ(Tensor::full({2}, float16(3.0f), {DType::f16, test_device()}).to_vec<float>(),
            (std::vector<float>{3.f, 3.f}));
}

// ---- comparison and logical operators ----
TEST(Api, ComparisonOperatorsGiveBoolTensors) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = random({5, 4}, 15), b = random({5, 4}, 16), row = random({4}, 17);
  const auto av = a.to_vec<double>(), bv = b.to_vec<double>(), rv = row.to_vec<double>();
  Tensor lt = a < b, le = a <= b, gt = a > b, ge = a >= b, eq = a == b, ne = a != b;
  for (const Tensor* t : {&lt, &le, &gt, &ge, &eq, &ne}) {
    EXPECT_EQ(t->dtype(), DType::boolean);
    EXPECT_EQ(t->sizes(), (Shape{5, 4}));
  }
  const auto ltv = lt.to_vec<bool>(), lev = le.to_vec<bool>(), gtv = gt.to_vec<bool>(),
             gev = ge.to_vec<bool>(), eqv = eq.to_vec<bool>(), nev = ne.to_vec<bool>();
  const auto s_lt = (a < 0.25).to_vec<bool>(), s_gt = (0.25 < a).to_vec<bool>(),
             s_ge = (a >= 0.25).to_vec<bool>(), s_le = (0.25 >= a).to_vec<bool>();
  const auto brow = (a > row).to_vec<bool>();
  for (std::size_t i = 0; i < av.size(); ++i) {
    EXPECT_EQ(ltv[i], av[i] < bv[i]);
    EXPECT_EQ(lev[i], av[i] <= bv[i]);
    EXPECT_EQ(gtv[i], av[i] > bv[i]);
    EXPECT_EQ(gev[i], av[i] >= bv[i]);
    EXPECT_EQ(eqv[i], av[i] == bv[i]);
    EXPECT_EQ(nev[i], av[i] != bv[i]);
    EXPECT_EQ(s_lt[i], av[i] < 0.25f);
    EXPECT_EQ(s_gt[i], 0.25f < av[i]);  // mirrored: scalar on the left
    EXPECT_EQ(s_ge[i], av[i] >= 0.25f);
    EXPECT_EQ(s_le[i], 0.25f >= av[i]);
    EXPECT_EQ(brow[i], av[i] > rv[i % 4]);
  }
  for (bool v : (a == a).to_vec<bool>()) EXPECT_TRUE(v);
  for (bool v : (a != a).to_vec<bool>()) EXPECT_FALSE(v);
  EXPECT_TRUE(a.is_same(a));  // identity stays is_same
}

TEST(Api, ScalarComparisonsAreExact) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  // An int32 tensor against a scalar beyond int32: compared in i64, not wrapped.
  Tensor i = Tensor::from_vec<int32_t>({0, 1, -5}, {3}, dev);
  const int64_t big = int64_t{1} << 32;  // wraps to 0 in int32
  EXPECT_EQ((i == big).to_vec<bool>(), (std::vector<bool>{false, false, false}));
  EXPECT_EQ((i < big).to_vec<bool>(), (std::vector<bool>{true, true, true}));
  // An integer tensor against a fractional scalar is compared as floating.
  EXPECT_EQ((i > 0.5).to_vec<bool>(), (std::vector<bool>{false, true, false}));
  EXPECT_EQ((i <= -4.5).to_vec<bool>(), (std::vector<bool>{false, false, true}));
  // An f64 tensor compares against the double, not a float rounding of it.
  Tensor d = Tensor::from_vec<double>({0.1, 0.2}, {2}, dev);
  EXPECT_EQ((d == 0.1).to_vec<bool>(), (std::vector<bool>{true, false}));
  EXPECT_EQ((d < 0.1).to_vec<bool>(), (std::vector<bool>{false, false}));
}

TEST(Api, LogicalOperatorsOnBoolTensors) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = random({12}, 18), b = random({12}, 19);
  Tensor p = a > 0, q = b > 0;
  const auto pv = p.to_vec<bool>(), qv = q.to_vec<bool>();
  const auto n = (!p).to_vec<bool>(), an = (p & q).to_vec<bool>(), o = (p | q).to_vec<bool>(),
             x = (p ^ q).to_vec<bool>();
  for (std::size_t i = 0; i < pv.size(); ++i) {
    EXPECT_EQ(n[i], !pv[i]);
    EXPECT_EQ(an[i], pv[i] && qv[i]);
    EXPECT_EQ(o[i], pv[i] || qv[i]);
    EXPECT_EQ(x[i], pv[i] != qv[i]);
  }
  Tensor ints = Tensor::arange(12, test_device());
  expect_error([&] { (void)(ints & ints); }, {"operator&", "bool", "i64"});
  expect_error([&] { (void)(p | ints); }, {"operator|", "i64"});
  EXPECT_EQ((!ints).to_vec<bool>()[0], true);  // !x is x == 0 for any dtype
}

// ---- literal factory ----
TEST(Api, TensorLiteralFactory) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor i = Tensor::tensor({1, 2, 3}, dev);
  EXPECT_EQ(i.dtype(), DType::i64);
  EXPECT_EQ(i.sizes(), (Shape{3}));
  EXPECT_EQ(i.device(), dev);
  EXPECT_EQ(i.to_vec<int64_t>(), (std::vector<int64_t>{1, 2, 3}));
  const int64_t big = (int64_t{1} << 60) + 1;  // not representable in double
  EXPECT_EQ(Tensor::tensor({big, -big}).to_vec<int64_t>(), (std::vector<int64_t>{big, -big}));
  Tensor f = Tensor::tensor({1.5, -2.25});  // double literals give f32, as torch.tensor
  EXPECT_EQ(f.dtype(), DType::f32);
  EXPECT_EQ(f.to_vec<float>(), (std::vector<float>{1.5f, -2.25f}));
  Tensor m = Tensor::tensor({{1.f, 2.f}, {3.f, 4.f}}, dev);
  EXPECT_EQ(m.sizes(), (Shape{2, 2}));
  EXPECT_EQ(m.dtype(), DType::f32);
  EXPECT_EQ(m.select(0, 1).to_vec<float>(), (std::vector<float>{3.f, 4.f}));
  Tensor c = Tensor::tensor({{{1, 2}, {3, 4}, {5, 6}}, {{7, 8}, {9, 10}, {11, 12}}}, {DType::f64, dev});
  EXPECT_EQ(c.sizes(), (Shape{2, 3, 2}));
  EXPECT_EQ(c.dtype(), DType::f64);
  EXPECT_EQ(c.select(0, 1).select(0, 2).to_vec<double>(), (std::vector<double>{11, 12}));
  Tensor b = Tensor::tensor({true, false, true}, dev);
  EXPECT_EQ(b.dtype(), DType::boolean);
  EXPECT_EQ(b.to_vec<bool>(), (std::vector<bool>{true, false, true}));
  EXPECT_EQ(Tensor::tensor({0.1}, DType::f64).item<double>(), 0.1);  // no f32 detour
  EXPECT_EQ(Tensor::tensor({bfloat16(0.5f)}).dtype(), DType::bf16);
  expect_error([] { (void)Tensor::tensor({{1, 2}, {3}}); }, {"tensor", "ragged"});
  expect_error([] { (void)Tensor::tensor({{{1}, {2}}, {{3}}}); }, {"tensor", "ragged"});
}

// ---- printing ----
std::vector<double> printed_numbers(const std::string& s) {
  // Skip "tensor(" and the trailing ", dtype=...": only the bracketed values.
  const std::string body = s.substr(s.find('['), s.rfind(']') - s.find('[') + 1);
  static const std::regex number(R"([-+]?(\d+\.\d*|\d+)(e[-+]?\d+)?)");
  std::vector<double> out;
  for (auto it = std::sregex_iterator(body.begin(), body.end(), number); it != std::sregex_iterator(); ++it) {
    out.push_back(std::stod(it->str()));
  }
  return out;
}

TEST(Api, PrintingSummarisesLargeTensorsToTheirEdges) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Shape s{20, 3, 30};  // 1800 elements: dims 0 and 2 are cut, dim 1 is shown whole
  Tensor x = random(s, 20);
  const auto v = x.to_vec<double>();
  const std::string str = x.to_string();
  const auto got = printed_numbers(str);
  std::vector<double> want;
  for (int64_t i : {0, 1, 2, 17, 18, 19}) {
    for (int64_t j = 0; j < 3; ++j) {
      for (int64_t k : {0, 1, 2, 27, 28, 29}) want.push_back(at3(v, s, i, j, k));
    }
  }
  ASSERT_EQ(got.size(), want.size()) << str;
  for (std::size_t n = 0; n < want.size(); ++n) {
    EXPECT_NEAR(got[n], want[n], 5e-5 + 1e-4 * std::fabs(want[n])) << "element " << n << " of\n" << str;
  }
  EXPECT_NE(str.find("..., "), std::string::npos);    // cut rows
  EXPECT_NE(str.find("...,\n"), std::string::npos);   // cut blocks
  // A strided view prints its own elements.
  Tensor t = x.select(1, 1).t();  // [30, 20]
  const auto tg = printed_numbers(t.to_string());
  ASSERT_EQ(tg.size(), 600u);  // 600 elements: not summarised
  EXPECT_NEAR(tg[1], at3(v, s, 1, 1, 0), 1e-4);
}

TEST(Api, PrintingAHugeExpandedViewCopiesOnlyTheEdges) {
  FLAME_SKIP_IF_NO_DEVICE();
  // 2^40 logical elements (8 TiB as doubles): converting the whole tensor cannot succeed.
  Tensor one = Tensor::full({1, 1}, 2.5, test_device());
  Tensor huge = one.expand({int64_t{1} << 20, int64_t{1} << 20});
  const std::string str = huge.to_string();
  const auto got = printed_numbers(str);
  ASSERT_EQ(got.size(), 36u) << str;
  for (double g : got) EXPECT_EQ(g, 2.5);
  // The requires-grad case does not record the gathering.
  Tensor w = random({40, 40}, 21).requires_grad_(true);
  EXPECT_EQ(printed_numbers(w.to_string()).size(), 36u);
}

// ---- generated forwarders agree with the free functions ----
TEST(Api, GeneratedMethodsForwardToFreeFunctions) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = random({3, 4}, 22).abs() + 0.5, y = random({3, 4}, 23);
  EXPECT_TRUE(all_close(x.log(), flame::log(x), 0, 0));
  EXPECT_TRUE(all_close(x.rsqrt(), flame::rsqrt(x), 0, 0));
  EXPECT_TRUE(all_close(x.atan2(y), flame::atan2(x, y), 0, 0));
  EXPECT_TRUE(all_close(x.div_scalar(3), flame::div_scalar(x, 3), 0, 0));
  EXPECT_TRUE(all_close(x.max({1}, true), flame::amax(x, {1}, true), 0, 0));
  EXPECT_TRUE(all_close(x.matmul(y.t()), flame::matmul(x, y.t()), 0, 0));
}

}  // namespace
}  // namespace flame::test
