// matmul / bmm / outer: errors, closed forms, and a GEMM larger than the op-table cases checked
// against a double loop written here.
#include <cmath>

#include "test_util.h"

namespace flame::test {
namespace {

// a [M, K] @ b [K, N] in double over the values of a and b.
std::vector<double> double_gemm(const Tensor& a, const Tensor& b) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const std::vector<double> av = a.to_vec<double>(), bv = b.to_vec<double>();
  std::vector<double> out(static_cast<std::size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < n; ++j) out[i * n + j] += av[i * k + p] * bv[p * n + j];
  return out;
}

RefTensor as_ref(Shape shape, std::vector<double> v, DType dt) {
  RefTensor r(std::move(shape), dt);
  r.v = std::move(v);
  return r;
}

TEST(Matmul, ErrorsNameOpShapesAndDtypes) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor a = Tensor::ones({2, 3}, dev), b = Tensor::ones({4, 5}, dev);
  expect_error([&] { matmul(a, b); }, {"matmul", "[2, 3]", "[4, 5]"});
  expect_error([&] { matmul(Tensor::ones({2, 7, 3}, dev), Tensor::ones({2, 4, 5}, dev)); },
               {"matmul", "[2, 7, 3]", "[2, 4, 5]"});
  expect_error([&] { matmul(Tensor::ones({2, 3, 4}, dev), Tensor::ones({3, 4, 5}, dev)); },
               {"matmul", "[2]", "[3]", "not broadcastable"});
  expect_error([&] { matmul(a, Tensor::ones({3, 2}, {DType::f64, dev})); }, {"matmul", "f32", "f64"});
  expect_error([&] { matmul(Tensor::ones({2, 2}, {DType::boolean, dev}), Tensor::ones({2, 2}, {DType::boolean, dev})); },
               {"matmul", "bool"});
  expect_error([&] { matmul(Tensor::scalar(2.0f, dev), Tensor::ones({3}, dev)); }, {"matmul", "[]", "[3]"});
  expect_error([&] { matmul(Tensor::ones({3}, dev), Tensor::ones({4}, dev)); }, {"matmul", "[3]", "[4]"});
  expect_error([&] { bmm(Tensor::ones({2, 3}, dev), Tensor::ones({3, 4}, dev)); }, {"bmm", "3-d", "[2, 3]"});
  expect_error([&] { bmm(Tensor::ones({2, 3, 4}, dev), Tensor::ones({3, 4, 5}, dev)); }, {"bmm", "[2, 3, 4]", "[3, 4, 5]"});
  expect_error([&] { bmm(Tensor::ones({2, 3, 4}, dev), Tensor::ones({2, 3, 5}, dev)); }, {"bmm", "[2, 3, 4]", "[2, 3, 5]"});
  expect_error([&] { bmm(Tensor::ones({2, 3, 4}, dev), Tensor::ones({2, 4, 5}, {DType::f16, dev})); },
               {"bmm", "f32", "f16"});
  expect_error([&] { outer(Tensor::ones({2, 3}, dev), Tensor::ones({3}, dev)); }, {"outer", "[2, 3]"});
}

TEST(Matmul, DeviceMismatchNamesBothDevices) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor a = Tensor::ones({2, 3}), b = Tensor::ones({3, 4}, Device::cuda(0));
  expect_error([&] { matmul(a, b); }, {"matmul", "cpu", "cuda"});
  expect_error([&] { bmm(a.unsqueeze(0), b.unsqueeze(0)); }, {"bmm", "cpu", "cuda"});
}

TEST(Matmul, IdentityLeavesOperandUnchanged) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::i64}) {
    const Tensor x = is_floating(dt) ? Tensor::uniform({7, 9}, -3, 3, {dt, dev}) : Tensor::randint(-9, 9, {7, 9}, {dt, dev});
    const Tensor eye9 = Tensor::eye(9, -1, {dt, dev}), eye7 = Tensor::eye(7, -1, {dt, dev});
    EXPECT_TRUE(all_close(matmul(x, eye9), x, 0, 0)) << dtype_name(dt);
    EXPECT_TRUE(all_close(matmul(eye7, x), x, 0, 0)) << dtype_name(dt);
    EXPECT_TRUE(all_close(matmul(eye9, x.t()), x.t(), 0, 0)) << dtype_name(dt);
  }
}

TEST(Matmul, DotAndOuterClosedForms) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor a = Tensor::from_vec<double>({1, 2, 3}, {3}, dev), b = Tensor::from_vec<double>({4, -5, 6}, {3}, dev);
  const Tensor d = matmul(a, b);
  EXPECT_EQ(d.dim(), 0);
  EXPECT_EQ(d.item<double>(), 12.0);
  EXPECT_TRUE(all_close(outer(a, b), as_ref({3, 3}, {4, -5, 6, 8, -10, 12, 12, -15, 18}, DType::f64), 0, 0));
  // [2, 2] @ [2] and [2] @ [2, 2].
  const Tensor m = Tensor::from_vec<float>({1, 2, 3, 4}, {2, 2}, dev), v = Tensor::from_vec<float>({1, -1}, {2}, dev);
  EXPECT_TRUE(all_close(matmul(m, v), as_ref({2}, {-1, -1}, DType::f32), 0, 0));
  EXPECT_TRUE(all_close(matmul(v, m), as_ref({2}, {-2, -2}, DType::f32), 0, 0));
}

TEST(Matmul, EmptyInnerDimGivesZeros) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  for (DType dt : {DType::f32, DType::bf16, DType::i64}) {
    const Tensor c = matmul(Tensor::empty({3, 0}, {dt, dev}), Tensor::empty({2, 0, 4}, {dt, dev}));
    EXPECT_TRUE(all_close(c, as_ref({2, 3, 4}, std::vector<double>(24, 0.0), dt), 0, 0)) << dtype_name(dt);
  }
  const Tensor e = matmul(Tensor::ones({0, 5}, dev), Tensor::ones({5, 3}, dev));
  EXPECT_EQ(e.sizes(), (Shape{0, 3}));
}

TEST(Matmul, BroadcastBatchMatchesPerSliceProducts) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor a = Tensor::uniform({2, 1, 3, 4}, -1, 1, dev), b = Tensor::uniform({5, 4, 6}, -1, 1, dev);
  const Tensor c = matmul(a, b);
  ASSERT_EQ(c.sizes(), (Shape{2, 5, 3, 6}));
  for (int64_t i = 0; i < 2; ++i) {
    for (int64_t j = 0; j < 5; ++j) {
      const Tensor ai = a.select(0, i).select(0, 0), bj = b.select(0, j);
      EXPECT_TRUE(all_close(c.select(0, i).select(0, j), as_ref({3, 6}, double_gemm(ai, bj), DType::f32), 1e-5, 1e-5));
    }
  }
}

// Per-head views of a packed projection: batch dims (B, H) that do not merge, so matmul copies
// them to contiguous memory for one batched call (Note [Matmul batch copies]); the values, and the
// gradients through that copy, are those of the per-slice products.
TEST(Matmul, UnmergeableBatchViewsMatchPerSliceProducts) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const int64_t B = 3, L = 5, H = 4, D = 6;
  const Tensor qkv = Tensor::uniform({B, L, 3, H, D}, -1, 1, dev);
  const Tensor q = qkv.select(2, 0).transpose(1, 2), k = qkv.select(2, 1).transpose(1, 2);
  ASSERT_FALSE(q.is_contiguous());
  const Tensor c = matmul(q, k.transpose(-2, -1));
  ASSERT_EQ(c.sizes(), (Shape{B, H, L, L}));
  for (int64_t i = 0; i < B; ++i) {
    for (int64_t j = 0; j < H; ++j) {
      const Tensor qi = q.select(0, i).select(0, j).contiguous(), ki = k.select(0, i).select(0, j).t().contiguous();
      EXPECT_TRUE(all_close(c.select(0, i).select(0, j), as_ref({L, L}, double_gemm(qi, ki), DType::f32), 1e-5, 1e-5));
    }
  }
  // Gradients reach the packed tensor through the views as they reach contiguous copies.
  const Tensor gout = Tensor::uniform({B, H, L, L}, -1, 1, dev);
  Tensor x = qkv.clone().requires_grad_();
  const Tensor xq = x.select(2, 0).transpose(1, 2), xk = x.select(2, 1).transpose(1, 2);
  BackwardOptions opt;
  opt.grad_output = gout;
  const Tensor gx = matmul(xq, xk.transpose(-2, -1)).backward(opt).get(x);
  Tensor qc = q.contiguous().requires_grad_(), kc = k.contiguous().requires_grad_();
  const Gradients g = matmul(qc, kc.transpose(-2, -1)).backward(opt);
  EXPECT_TRUE(all_close(gx.select(2, 0).transpose(1, 2), g.get(qc), 1e-5, 1e-5));
  EXPECT_TRUE(all_close(gx.select(2, 1).transpose(1, 2), g.get(kc), 1e-5, 1e-5));
  EXPECT_EQ(gx.select(2, 2).abs().max().item<double>(), 0.0);  // v's third: no gradient
}

TEST(Matmul, LargeF32GemmMatchesDoubleLoop) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor a = Tensor::uniform({129, 257}, -1, 1, dev), b = Tensor::uniform({257, 131}, -1, 1, dev);
  const RefTensor want = as_ref({129, 131}, double_gemm(a, b), DType::f32);
  EXPECT_TRUE(all_close(matmul(a, b), want, 1e-4, 1e-4));
  // The same product from transposed storage of either operand.
  const Tensor at = a.t().contiguous().t(), bt = b.t().contiguous().t();
  EXPECT_TRUE(all_close(matmul(at, b), want, 1e-4, 1e-4));
  EXPECT_TRUE(all_close(matmul(a, bt), want, 1e-4, 1e-4));
  EXPECT_TRUE(all_close(matmul(at, bt), want, 1e-4, 1e-4));
  // Batched with a folded batch ([3, 43, 257] x [257, 131]) reproduces the same rows.
  EXPECT_TRUE(all_close(matmul(a.narrow(0, 0, 129).reshape({3, 43, 257}), b).reshape({129, 131}), want, 1e-4, 1e-4));
}

TEST(Matmul, LargeBf16GemmAccumulatesInFloat) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor a = Tensor::uniform({65, 300}, -1, 1, {DType::bf16, dev});
  const Tensor b = Tensor::uniform({300, 270}, -1, 1, {DType::bf16, dev});
  RefTensor want = as_ref({65, 270}, double_gemm(a, b), DType::bf16);
  // Bf16 rounding of the result dominates; a bf16 accumulator would be far off at K = 300.
  EXPECT_TRUE(all_close(matmul(a, b), want, 1e-2, 2e-2));
}

TEST(Matmul, NanPropagates) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor a = Tensor::from_vec<float>({1, NAN, 2, 3}, {2, 2}, dev);
  const std::vector<float> c = matmul(a, Tensor::ones({2, 2}, dev)).to_vec<float>();
  EXPECT_TRUE(std::isnan(c[0]) && std::isnan(c[1]));
  EXPECT_EQ(c[2], 5.0f);
  EXPECT_EQ(c[3], 5.0f);
}

TEST(Matmul, IntegerProductsAreExact) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  // (2^31 + 1)(2^31 - 1) + 3*5 = 2^62 + 14 needs 63 significant bits: a double accumulator would
  // round it.
  const int64_t p = int64_t{1} << 31;
  const Tensor a = Tensor::from_vec<int64_t>({p + 1, 3}, {1, 2}, dev);
  const Tensor b = Tensor::from_vec<int64_t>({p - 1, 5}, {2, 1}, dev);
  EXPECT_EQ(matmul(a, b).item<int64_t>(), (int64_t{1} << 62) + 14);
}

}  // namespace
}  // namespace flame::test
