// Views (zero-copy, strides, errors) and Tensor basics: construction and reads, dtype
// conversion, printing, factories, random generators, type promotion and in-place ops.
#include <cmath>
#include <limits>
#include <numeric>

#include "test_util.h"

namespace flame::test {
namespace {

Tensor iota_f32(const Shape& shape) {
  std::vector<float> v(static_cast<std::size_t>(RefTensor::numel_of(shape)));
  std::iota(v.begin(), v.end(), 0.0f);
  return Tensor::from_vec(v, shape, test_device());
}

std::vector<double> vals(const Tensor& t) { return t.to_vec<double>(); }

// ---------------------------------------------------------------------------------------------
// Zero-copy and write-through
// ---------------------------------------------------------------------------------------------

TEST(Views, ViewOpsShareStorage) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = iota_f32({2, 3, 4});
  const TensorList views = {
      x.reshape({6, 4}),    x.view({4, 6}),           x.transpose(0, 2),        x.permute({1, 2, 0}),
      x.narrow(1, 1, 2),    x.slice(2, 0, 4, 2),      x.select(0, 1),           x.unsqueeze(1),
      x.flatten(),          x.flatten(0, 1),          x.unflatten(2, {2, 2}),   x.unfold(2, 2, 1),
      x.select(1, 0).t(),   x.narrow(0, 0, 1).squeeze(), x.narrow(1, 0, 1).squeeze(1),
      x.select(0, 0).select(0, 0).expand({5, 4}),     x.split(1, 1)[2],          x.chunk(2, 2)[1],
      x.split_with_sizes({1, 2}, 1)[1],               x.contiguous(),           x.to(DType::f32),
  };
  for (std::size_t i = 0; i < views.size(); ++i) {
    EXPECT_TRUE(views[i].shares_storage(x)) << "view " << i << " of shape " << shape_str(views[i].sizes());
  }
  EXPECT_TRUE(x.contiguous().is_same(x));
  EXPECT_TRUE(x.to(DType::f32).is_same(x));
  // Copies do not share.
  EXPECT_FALSE(x.clone().shares_storage(x));
  EXPECT_FALSE(x.transpose(0, 1).contiguous().shares_storage(x));
  EXPECT_FALSE(x.transpose(0, 1).reshape({24}).shares_storage(x));
  EXPECT_FALSE(x.to(DType::f64).shares_storage(x));
  EXPECT_FALSE(x.flip({0}).shares_storage(x));
}

TEST(Views, WritesThroughViewsAreVisibleInTheBase) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = Tensor::zeros({3, 4}, test_device());
  a.select(0, 1).fill_(7);
  EXPECT_EQ(vals(a), (std::vector<double>{0, 0, 0, 0, 7, 7, 7, 7, 0, 0, 0, 0}));
  a.slice(1, 0, 4, 2).copy_(Tensor::from_vec<float>({1, 2, 3, 4, 5, 6}, {3, 2}, test_device()));
  EXPECT_EQ(vals(a), (std::vector<double>{1, 0, 2, 0, 3, 7, 4, 7, 5, 0, 6, 0}));
  // Broadcast copy_ of a row into a transposed view writes a column of the base.
  a.t().narrow(0, 3, 1).copy_(Tensor::from_vec<float>({-1, -2, -3}, {3}, test_device()));
  EXPECT_EQ(vals(a), (std::vector<double>{1, 0, 2, -1, 3, 7, 4, -2, 5, 0, 6, -3}));
  // Through a chain of views, and through a split piece.
  a.reshape({2, 6}).select(1, 1).fill_(9);
  EXPECT_EQ(vals(a), (std::vector<double>{1, 9, 2, -1, 3, 7, 4, 9, 5, 0, 6, -3}));
  a.split(2, 0)[1].zero_();
  EXPECT_EQ(vals(a.select(0, 2)), (std::vector<double>{0, 0, 0, 0}));
  // And in the other direction: the view sees writes to the base.
  Tensor col = a.select(1, 2);
  a.fill_(4);
  EXPECT_EQ(vals(col), (std::vector<double>{4, 4, 4}));
}

TEST(Views, VersionCounterIsSharedAndBumpedByInPlaceWrites) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = Tensor::zeros({3, 4}, test_device());
  Tensor v = a.transpose(0, 1).select(0, 2);
  const uint64_t v0 = a.version();
  EXPECT_EQ(v.version(), v0);
  v.fill_(1);
  EXPECT_EQ(a.version(), v0 + 1);
  EXPECT_EQ(v.version(), v0 + 1);
  v.copy_(Tensor::ones({3}, test_device()));
  EXPECT_EQ(a.version(), v0 + 2);
  a.add_(Tensor::ones({4}, test_device()));
  a.mul_(2.0);
  a.zero_();
  EXPECT_EQ(v.version(), v0 + 5);
  // Out-of-place ops and views do not bump it; copies get their own counter.
  Tensor c = a.clone();
  (void)(a + a);
  (void)a.reshape({12});
  EXPECT_EQ(a.version(), v0 + 5);
  c.fill_(3);
  EXPECT_EQ(a.version(), v0 + 5);
}

// ---------------------------------------------------------------------------------------------
// Geometry: sizes, strides and offsets as PyTorch gives them
// ---------------------------------------------------------------------------------------------

TEST(Views, StridesMatchPyTorch) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = Tensor::empty({2, 3, 4}, test_device());
  EXPECT_EQ(x.strides(), (Shape{12, 4, 1}));
  const Tensor tr = x.transpose(0, 2);
  EXPECT_EQ(tr.sizes(), (Shape{4, 3, 2}));
  EXPECT_EQ(tr.strides(), (Shape{1, 4, 12}));
  EXPECT_FALSE(tr.is_contiguous());
  EXPECT_EQ(x.permute({2, 0, 1}).strides(), (Shape{1, 12, 4}));
  const Tensor sl = x.slice(1, 1, 3);
  EXPECT_EQ(sl.sizes(), (Shape{2, 2, 4}));
  EXPECT_EQ(sl.strides(), (Shape{12, 4, 1}));
  EXPECT_EQ(sl.storage_offset(), 4);
  const Tensor st = x.slice(2, 1, 4, 2);
  EXPECT_EQ(st.sizes(), (Shape{2, 3, 2}));
  EXPECT_EQ(st.strides(), (Shape{12, 4, 2}));
  EXPECT_EQ(st.storage_offset(), 1);
  EXPECT_EQ(x.slice(0, 5, 9).sizes(), (Shape{0, 3, 4}));  // clamped, as Python slicing
  const Tensor se = x.select(1, -1);
  EXPECT_EQ(se.sizes(), (Shape{2, 4}));
  EXPECT_EQ(se.strides(), (Shape{12, 1}));
  EXPECT_EQ(se.storage_offset(), 8);
  EXPECT_EQ(x.narrow(0, 1, 1).storage_offset(), 12);
  EXPECT_EQ(x.narrow(2, -3, 2).storage_offset(), 1);
  const Tensor ex = Tensor::empty({3, 1}, test_device()).expand({2, 3, 4});
  EXPECT_EQ(ex.sizes(), (Shape{2, 3, 4}));
  EXPECT_EQ(ex.strides(), (Shape{0, 1, 0}));
  EXPECT_EQ(x.unsqueeze(1).strides(), (Shape{12, 12, 4, 1}));
  EXPECT_EQ(x.unsqueeze(3).strides(), (Shape{12, 4, 1, 1}));
  EXPECT_EQ(x.unsqueeze(-1).sizes(), (Shape{2, 3, 4, 1}));
  EXPECT_EQ(x.unsqueeze(0).strides(), (Shape{24, 12, 4, 1}));
  const Tensor uf = x.unfold(2, 2, 1);
  EXPECT_EQ(uf.sizes(), (Shape{2, 3, 3, 2}));
  EXPECT_EQ(uf.strides(), (Shape{12, 4, 1, 1}));
  const Tensor uf2 = x.unfold(1, 2, 2);
  EXPECT_EQ(uf2.sizes(), (Shape{2, 1, 4, 2}));
  EXPECT_EQ(uf2.strides(), (Shape{12, 8, 1, 4}));
  EXPECT_EQ(Tensor::empty({3, 5}, test_device()).t().strides(), (Shape{1, 5}));
  EXPECT_EQ(Tensor::empty({1, 3, 1, 4}, test_device()).squeeze().strides(), (Shape{4, 1}));
  EXPECT_EQ(x.flatten(0, 1).strides(), (Shape{4, 1}));
  EXPECT_EQ(x.unflatten(2, {2, 2}).strides(), (Shape{12, 4, 2, 1}));
  // A view of a transposed tensor that only splits a dim keeps the transposed strides.
  EXPECT_EQ(tr.view({2, 2, 3, 2}).strides(), (Shape{2, 1, 4, 12}));
  // Split pieces are narrow views with offsets.
  const TensorList pieces = x.split(3, 2);
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[1].sizes(), (Shape{2, 3, 1}));
  EXPECT_EQ(pieces[1].storage_offset(), 3);
  EXPECT_EQ(pieces[1].strides(), (Shape{12, 4, 1}));
  // 0-d tensors.
  const Tensor s = Tensor::scalar(2.5, test_device());
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(s.unsqueeze(0).sizes(), (Shape{1}));
  EXPECT_EQ(s.reshape({1, 1}).sizes(), (Shape{1, 1}));
  EXPECT_EQ(s.expand({2, 3}).strides(), (Shape{0, 0}));
  EXPECT_EQ(s.t().dim(), 0);
}

TEST(Views, ViewFailsWhenStridesDoNotAllowAndReshapeCopies) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = iota_f32({3, 4});
  const Tensor xt = x.t();  // [4, 3], strides [1, 4]
  expect_error([&] { (void)xt.view({12}); }, {"view", "[12]", "[4, 3]", "[1, 4]", "reshape"});
  expect_error([&] { (void)x.narrow(1, 0, 2).view({6}); }, {"view", "[6]", "[3, 2]", "[4, 1]"});
  // Every other column of a [3, 4] tensor is evenly spaced in memory: viewable with stride 2.
  EXPECT_EQ(x.slice(1, 0, 4, 2).view({6}).strides(), (Shape{2}));
  EXPECT_EQ(vals(x.slice(1, 0, 4, 2).view({6})), (std::vector<double>{0, 2, 4, 6, 8, 10}));
  expect_error([&] { (void)x.expand({2, 3, 4}).view({24}); }, {"view", "[24]", "[2, 3, 4]"});
  const Tensor r = xt.reshape({12});
  EXPECT_FALSE(r.shares_storage(x));
  EXPECT_TRUE(r.is_contiguous());
  EXPECT_EQ(vals(r), (std::vector<double>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  // reshape keeps a view when it can.
  EXPECT_TRUE(xt.reshape({2, 2, 3}).shares_storage(x));
  EXPECT_TRUE(x.slice(1, 0, 4, 2).reshape({3, 2, 1}).shares_storage(x));
  // flatten of a transposed tensor copies too (through reshape).
  EXPECT_EQ(vals(xt.flatten()), vals(r));
}

// ---------------------------------------------------------------------------------------------
// Errors: each names the op and what is wrong
// ---------------------------------------------------------------------------------------------

TEST(Views, ReshapeErrors) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = Tensor::zeros({3, 4}, test_device());
  expect_error([&] { (void)x.reshape({-1, -1}); }, {"reshape", "only one dimension can be -1", "[-1, -1]"});
  expect_error([&] { (void)x.reshape({5, 3}); }, {"reshape", "[5, 3]", "[3, 4]", "12 elements"});
  expect_error([&] { (void)x.reshape({5, -1}); }, {"reshape", "[5, -1]", "[3, 4]"});
  expect_error([&] { (void)x.reshape({-2, 6}); }, {"reshape", "[-2, 6]"});
  expect_error([&] { (void)x.view({2, 5}); }, {"view", "[2, 5]", "[3, 4]"});
  expect_error([&] { (void)x.view({-1, -1, 2}); }, {"view", "-1"});
  expect_error([&] { (void)Tensor::zeros({0, 3}, test_device()).reshape({0, -1}); }, {"reshape", "[0, -1]"});
  expect_error([&] { (void)x.flatten(1, 0); }, {"flatten", "start_dim"});
  expect_error([&] { (void)x.unflatten(1, {3, 2}); }, {"unflatten", "[3, 2]", "[3, 4]"});
  expect_error([&] { (void)x.unflatten(0, {-1, -1}); }, {"unflatten", "-1"});
  expect_error([&] { (void)x.unflatten(0, {}); }, {"unflatten", "non-empty"});
  expect_error([&] { (void)Tensor::scalar(1.0, test_device()).unflatten(0, {1}); }, {"unflatten", "0-d"});
}

TEST(Views, UnflattenChecksTheDimNotTheTotal) {
  FLAME_SKIP_IF_NO_DEVICE();
  // With another dim of size 0 the element counts agree (0 == 0) whatever the sizes; PyTorch
  // still requires the sizes to multiply up to the unflattened dim.
  const Tensor z = Tensor::zeros({0, 6}, test_device());
  expect_error([&] { (void)z.unflatten(1, {2, 2}); }, {"unflatten", "[2, 2]", "[0, 6]"});
  EXPECT_EQ(z.unflatten(1, {2, -1}).sizes(), (Shape{0, 2, 3}));
  EXPECT_EQ(z.unflatten(0, {-1, 5}).sizes(), (Shape{0, 5, 6}));
}

TEST(Views, DimOutOfRangeErrors) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = Tensor::zeros({2, 3}, test_device());
  expect_error([&] { (void)x.transpose(0, 2); }, {"transpose", "dim 2", "2 dims"});
  expect_error([&] { (void)x.transpose(-3, 0); }, {"transpose", "dim -3"});
  expect_error([&] { (void)x.narrow(2, 0, 1); }, {"narrow", "dim 2"});
  expect_error([&] { (void)x.slice(-3, 0, 1); }, {"slice", "dim -3"});
  expect_error([&] { (void)x.select(5, 0); }, {"select", "dim 5"});
  expect_error([&] { (void)x.squeeze(2); }, {"squeeze", "dim 2"});
  expect_error([&] { (void)x.unsqueeze(3); }, {"unsqueeze", "dim 3"});
  expect_error([&] { (void)x.unsqueeze(-4); }, {"unsqueeze", "dim -4"});
  expect_error([&] { (void)x.flatten(0, 2); }, {"flatten", "dim 2"});
  expect_error([&] { (void)x.unfold(2, 1, 1); }, {"unfold", "dim 2"});
  expect_error([&] { (void)x.unflatten(-3, {1, 2}); }, {"unflatten", "dim -3"});
  const Tensor s = Tensor::scalar(1.0, test_device());
  expect_error([&] { (void)s.transpose(0, 1); }, {"transpose", "dim 1", "0 dims"});
  expect_error([&] { (void)s.unfold(1, 1, 1); }, {"unfold", "dim 1"});
  expect_error([&] { (void)s.narrow(0, 0, 1); }, {"narrow", "0-d"});
  expect_error([&] { (void)s.select(0, 0); }, {"select", "0-d"});
  expect_error([&] { (void)s.slice(0, 0, 1); }, {"slice", "0-d"});
}

TEST(Views, PermuteErrors) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = Tensor::zeros({2, 3, 4}, test_device());
  expect_error([&] { (void)x.permute({0, 1}); }, {"permute", "[0, 1]", "[2, 3, 4]"});
  expect_error([&] { (void)x.permute({0, 1, 2, 3}); }, {"permute", "[0, 1, 2, 3]", "[2, 3, 4]"});
  expect_error([&] { (void)x.permute({0, 1, 1}); }, {"permute", "repeated", "[0, 1, 1]"});
  expect_error([&] { (void)x.permute({0, -3, 2}); }, {"permute", "repeated"});
  expect_error([&] { (void)x.permute({0, 1, 3}); }, {"permute", "dim 3"});
  expect_error([&] { (void)Tensor::zeros({2, 3}, test_device()).t().t().reshape({2, 3, 1}).t(); },
               {"t", "[2, 3, 1]"});
}

TEST(Views, NarrowSliceSelectErrors) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = Tensor::zeros({2, 4}, test_device());
  expect_error([&] { (void)x.narrow(1, 2, 3); }, {"narrow", "exceeds", "[2, 4]"});
  expect_error([&] { (void)x.narrow(1, -5, 1); }, {"narrow", "[2, 4]"});
  expect_error([&] { (void)x.narrow(1, 0, -1); }, {"narrow", "[2, 4]"});
  expect_error([&] { (void)x.narrow(1, 5, 0); }, {"narrow", "[2, 4]"});
  EXPECT_EQ(x.narrow(1, 4, 0).sizes(), (Shape{2, 0}));  // start == size with length 0 is fine
  expect_error([&] { (void)x.slice(1, 0, 4, 0); }, {"slice", "step", "0"});
  expect_error([&] { (void)x.slice(1, 0, 4, -1); }, {"slice", "step", "-1"});
  expect_error([&] { (void)x.select(1, 4); }, {"select", "index 4", "[2, 4]"});
  expect_error([&] { (void)x.select(0, -3); }, {"select", "index -3", "[2, 4]"});
  expect_error([&] { (void)Tensor::zeros({0, 2}, test_device()).select(0, 0); }, {"select", "index 0", "[0, 2]"});
  expect_error([&] { (void)x.unfold(1, 5, 1); }, {"unfold", "5", "[2, 4]"});
  expect_error([&] { (void)x.unfold(1, 2, 0); }, {"unfold", "step"});
}

TEST(Views, ExpandErrors) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = Tensor::zeros({2, 3}, test_device());
  expect_error([&] { (void)x.expand({4, 3}); }, {"expand", "[2, 3]", "[4, 3]", "size 2"});
  expect_error([&] { (void)x.expand({2, 1}); }, {"expand", "[2, 3]", "[2, 1]"});
  expect_error([&] { (void)x.expand({3}); }, {"expand", "[3]", "[2, 3]", "fewer dims"});
  expect_error([&] { (void)x.expand({-1, 2, 3}); }, {"expand", "-1", "[-1, 2, 3]"});
  expect_error([&] { (void)Tensor::zeros({1}, test_device()).expand({-2}); }, {"expand", "[-2]"});
  // -1 keeps an existing dim; size-1 dims expand to anything, including 0.
  EXPECT_EQ(x.expand({5, -1, -1}).sizes(), (Shape{5, 2, 3}));
  EXPECT_EQ(Tensor::zeros({1, 3}, test_device()).expand({0, 3}).sizes(), (Shape{0, 3}));
}

TEST(Views, SqueezeOnlyRemovesSizeOneDims) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = Tensor::zeros({1, 3, 1}, test_device());
  EXPECT_EQ(x.squeeze().sizes(), (Shape{3}));
  EXPECT_EQ(x.squeeze(1).sizes(), (Shape{1, 3, 1}));  // not size 1: unchanged, as PyTorch
  EXPECT_EQ(x.squeeze(-1).sizes(), (Shape{1, 3}));
  EXPECT_EQ(Tensor::zeros({0, 1}, test_device()).squeeze().sizes(), (Shape{0}));
  EXPECT_EQ(Tensor::scalar(1, test_device()).squeeze(0).dim(), 0);
}

// ---------------------------------------------------------------------------------------------
// Tensor basics
// ---------------------------------------------------------------------------------------------

TEST(TensorBasics, FromVecToVecItem) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor f = Tensor::from_vec<float>({1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -0.5f}, {2, 3}, dev);
  EXPECT_EQ(f.dtype(), DType::f32);
  EXPECT_EQ(f.device(), dev);
  EXPECT_EQ(f.sizes(), (Shape{2, 3}));
  EXPECT_EQ(f.to_vec<float>(), (std::vector<float>{1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -0.5f}));
  EXPECT_EQ(f.to_vec<int64_t>(), (std::vector<int64_t>{1, -2, 3, 0, 7, 0}));  // truncation
  EXPECT_EQ(f.t().to_vec<double>(), (std::vector<double>{1.5, 0.0, -2.0, 7.0, 3.25, -0.5}));
  const Tensor i = Tensor::from_vec<int64_t>({int64_t{1} << 40, -3}, {2}, dev);
  EXPECT_EQ(i.dtype(), DType::i64);
  EXPECT_EQ(i.to_vec<int64_t>(), (std::vector<int64_t>{int64_t{1} << 40, -3}));
  const Tensor b = Tensor::from_vec(std::vector<bool>{true, false, true}, {3}, dev);
  EXPECT_EQ(b.dtype(), DType::boolean);
  EXPECT_EQ(b.to_vec<bool>(), (std::vector<bool>{true, false, true}));
  EXPECT_EQ(b.to_vec<float>(), (std::vector<float>{1, 0, 1}));
  const Tensor h = Tensor::from_vec<bfloat16>({bfloat16(0.5f), bfloat16(-4.0f)}, {2}, dev);
  EXPECT_EQ(h.dtype(), DType::bf16);
  EXPECT_EQ(h.to_vec<double>(), (std::vector<double>{0.5, -4.0}));
  const Tensor u = Tensor::from_vec<uint8_t>({0, 255}, {2, 1}, dev);
  EXPECT_EQ(u.dtype(), DType::u8);
  EXPECT_EQ(u.to_vec<int32_t>(), (std::vector<int32_t>{0, 255}));
  // item
  EXPECT_EQ(Tensor::scalar(2.5, dev).item<double>(), 2.5);
  EXPECT_EQ(Tensor::from_vec<int32_t>({42}, {1, 1}, dev).item<int64_t>(), 42);
  EXPECT_EQ(f.select(0, 1).select(0, 2).item<float>(), -0.5f);
  expect_error([&] { (void)f.item<float>(); }, {"item", "6 elements", "[2, 3]"});
  expect_error([&] { (void)Tensor::zeros({0}, dev).item<float>(); }, {"item", "0 elements", "[0]"});
  // from_vec checks the count; data<T>() checks the dtype.
  expect_error([&] { (void)Tensor::from_vec<float>({1, 2, 3}, {2, 2}, dev); }, {"from_vec", "3", "[2, 2]"});
  if (dev.is_cpu()) {
    expect_error([&] { (void)f.data<double>(); }, {"data", "f32", "f64"});
  }
  // Empty and 0-d.
  EXPECT_TRUE(Tensor::from_vec<float>({}, {0, 3}, dev).to_vec<float>().empty());
  EXPECT_EQ(Tensor::from_vec<float>({4.0f}, {}, dev).dim(), 0);
}

TEST(TensorBasics, MetadataOfViews) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = Tensor::zeros({2, 3, 4}, {DType::bf16, test_device()});
  EXPECT_EQ(x.dim(), 3);
  EXPECT_EQ(x.numel(), 24);
  EXPECT_EQ(x.element_size(), 2u);
  EXPECT_EQ(x.nbytes(), 48u);
  EXPECT_EQ(x.size(-1), 4);
  EXPECT_EQ(x.stride(0), 12);
  EXPECT_TRUE(x.is_contiguous());
  EXPECT_TRUE(x.unsqueeze(1).is_contiguous());
  EXPECT_TRUE(x.narrow(0, 1, 1).is_contiguous());
  EXPECT_FALSE(x.narrow(1, 1, 1).is_contiguous());
  EXPECT_TRUE(x.slice(1, 0, 0).is_contiguous());  // empty
  expect_error([&] { (void)x.size(3); }, {"size", "dim 3"});
  expect_error([&] { (void)x.stride(-4); }, {"stride", "dim -4"});
}

// size(d)/stride(d) of a 0-d tensor: PyTorch raises ("dimension specified as 0 but tensor has no
// dimensions"). Run in a child process: the current code reads sizes()[0] of an empty vector.
TEST(TensorBasicsDeathTest, SizeOfZeroDimTensorRaises) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto probe = [](bool stride) {
    const Tensor s = Tensor::scalar(1.0);
    try {
      (void)(stride ? s.stride(0) : s.size(0));
    } catch (const Error& e) {
      std::exit(std::string(e.what()).find(stride ? "stride" : "size") == 0 ? 0 : 2);
    }
    std::exit(1);
  };
  EXPECT_EXIT(probe(false), ::testing::ExitedWithCode(0), "") << "size(0) of a 0-d tensor must raise flame::Error";
  EXPECT_EXIT(probe(true), ::testing::ExitedWithCode(0), "") << "stride(0) of a 0-d tensor must raise flame::Error";
}

TEST(TensorBasics, DTypeConversionRoundTrips) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  // bf16 keeps 8 significant bits, f16 11; both round to nearest even.
  const Tensor third = Tensor::from_vec<double>({1.0 / 3.0}, {1}, dev);
  EXPECT_EQ(third.to(DType::bf16).item<double>(), 0.333984375);
  EXPECT_EQ(third.to(DType::f16).item<double>(), 0.333251953125);
  EXPECT_EQ(third.to(DType::f32).item<double>(), static_cast<double>(1.0f / 3.0f));
  const Tensor ties = Tensor::from_vec<float>({1.0f + 0.00390625f, 1.0f + 3 * 0.00390625f, -2.0f - 0.0078125f}, {3}, dev);
  EXPECT_EQ(ties.to(DType::bf16).to_vec<double>(), (std::vector<double>{1.0, 1.015625, -2.0}));
  const Tensor big = Tensor::from_vec<float>({65504.0f, 65520.0f, 1e-8f, -70000.0f}, {4}, dev);
  const std::vector<double> h = big.to(DType::f16).to_vec<double>();
  EXPECT_EQ(h[0], 65504.0);
  EXPECT_TRUE(std::isinf(h[1]) && h[1] > 0);
  EXPECT_EQ(h[2], 0.0);  // below half the smallest subnormal
  EXPECT_TRUE(std::isinf(h[3]) && h[3] < 0);
  EXPECT_EQ(big.to(DType::bf16).to_vec<double>()[1], 65536.0);
  const Tensor nan = Tensor::from_vec<float>({std::numeric_limits<float>::quiet_NaN()}, {1}, dev);
  EXPECT_TRUE(std::isnan(nan.to(DType::bf16).item<double>()));
  EXPECT_TRUE(std::isnan(nan.to(DType::f16).item<double>()));
  // Round trips that are exact.
  const Tensor x = Tensor::from_vec<float>({0.1f, -3.5f, 1e20f, 0.0f}, {2, 2}, dev);
  EXPECT_EQ(x.to(DType::f64).to(DType::f32).to_vec<float>(), x.to_vec<float>());
  const Tensor small_ints = Tensor::from_vec<int64_t>({-256, 255, 0, 7}, {4}, dev);
  EXPECT_EQ(small_ints.to(DType::bf16).to(DType::i64).to_vec<int64_t>(), small_ints.to_vec<int64_t>());
  EXPECT_EQ(small_ints.to(DType::f16).to(DType::i32).to_vec<int32_t>(), (std::vector<int32_t>{-256, 255, 0, 7}));
  // float -> integer truncates toward zero; anything -> bool is (v != 0); integer wraps.
  const Tensor fr = Tensor::from_vec<float>({-1.7f, 2.9f, -0.5f, 0.0f}, {4}, dev);
  EXPECT_EQ(fr.to(DType::i64).to_vec<int64_t>(), (std::vector<int64_t>{-1, 2, 0, 0}));
  EXPECT_EQ(fr.to(DType::boolean).to_vec<bool>(), (std::vector<bool>{true, true, true, false}));
  EXPECT_EQ(Tensor::from_vec<int64_t>({256 + 3, -1}, {2}, dev).to(DType::u8).to_vec<int64_t>(),
            (std::vector<int64_t>{3, 255}));
  EXPECT_EQ(Tensor::from_vec(std::vector<bool>{true, false}, {2}, dev).to(DType::bf16).to_vec<double>(),
            (std::vector<double>{1.0, 0.0}));
  // to(dtype, device) and to(device) on the same device.
  EXPECT_TRUE(x.to(dev).is_same(x));
  const Tensor on_cpu = x.to(DType::f64, Device::cpu());
  EXPECT_EQ(on_cpu.device(), Device::cpu());
  EXPECT_EQ(on_cpu.dtype(), DType::f64);
  // Conversion of a strided view follows logical order.
  EXPECT_EQ(x.t().to(DType::f64).to_vec<double>(), (std::vector<double>{0.1f, 1e20f, -3.5f, 0.0}));
}

TEST(TensorBasics, Printing) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const std::string f = Tensor::from_vec<float>({1.5f, -2.25f, 3.0f, 0.125f}, {2, 2}, dev).to_string();
  for (const char* part : {"tensor(", "1.5000", "-2.2500", "3.0000", "0.1250", "dtype=f32", "[["}) {
    EXPECT_NE(f.find(part), std::string::npos) << f << " lacks " << part;
  }
  const std::string i = Tensor::arange(5, dev).to_string();
  for (const char* part : {"0", "4", "dtype=i64"}) EXPECT_NE(i.find(part), std::string::npos) << i;
  EXPECT_EQ(i.find('.'), std::string::npos) << i;
  const std::string b = Tensor::from_vec(std::vector<bool>{true, false}, {2}, dev).to_string();
  EXPECT_NE(b.find("true"), std::string::npos) << b;
  EXPECT_NE(b.find("false"), std::string::npos) << b;
  EXPECT_NE(b.find("dtype=bool"), std::string::npos) << b;
  const std::string h = Tensor::full({2}, 0.5, {DType::bf16, dev}).to_string();
  EXPECT_NE(h.find("0.5000"), std::string::npos) << h;
  EXPECT_NE(h.find("bf16"), std::string::npos) << h;
  const std::string s = Tensor::scalar(7.0, dev).to_string();
  EXPECT_NE(s.find("7."), std::string::npos) << s;
  EXPECT_EQ(s.find('['), std::string::npos) << s;
  const std::string e = Tensor::zeros({0, 3}, dev).to_string();
  EXPECT_NE(e.find("[]"), std::string::npos) << e;
  EXPECT_NE(e.find("[0, 3]"), std::string::npos) << e;
  // Large tensors are summarised; the stream operator prints the same text.
  const Tensor big = Tensor::arange(5000, dev);
  const std::string bs = big.to_string();
  EXPECT_NE(bs.find("..."), std::string::npos);
  EXPECT_NE(bs.find("4999"), std::string::npos);
  EXPECT_LT(bs.size(), 200u);
  std::ostringstream os;
  os << big;
  EXPECT_EQ(os.str(), bs);
  if (dev.is_cuda()) {
    EXPECT_NE(bs.find("cuda"), std::string::npos) << bs;
  }
}

// ---------------------------------------------------------------------------------------------
// Factories and random numbers
// ---------------------------------------------------------------------------------------------

TEST(Factories, ConstantFactories) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor z = Tensor::zeros({2, 3}, dev);
  EXPECT_EQ(z.dtype(), DType::f32);
  EXPECT_EQ(z.device(), dev);
  EXPECT_EQ(vals(z), std::vector<double>(6, 0.0));
  EXPECT_EQ(vals(Tensor::ones({4}, {DType::i32, dev})), std::vector<double>(4, 1.0));
  EXPECT_EQ(Tensor::ones({4}, {DType::i32, dev}).dtype(), DType::i32);
  EXPECT_EQ(vals(Tensor::full({2, 2}, -2.5, {DType::f64, dev})), std::vector<double>(4, -2.5));
  EXPECT_EQ(vals(Tensor::full({3}, int64_t{1} << 40, {DType::i64, dev})), std::vector<double>(3, std::ldexp(1.0, 40)));
  EXPECT_EQ(vals(Tensor::full({2}, true, {DType::boolean, dev})), std::vector<double>(2, 1.0));
  EXPECT_EQ(Tensor::full({0, 4}, 1.0, dev).numel(), 0);
  EXPECT_EQ(Tensor::empty({3, 0, 2}, dev).sizes(), (Shape{3, 0, 2}));
  EXPECT_EQ(Tensor::scalar(2.5, dev).dtype(), DType::f32);
  EXPECT_EQ(Tensor::scalar(3, dev).dtype(), DType::i64);
  EXPECT_EQ(Tensor::scalar(true, dev).dtype(), DType::boolean);
  EXPECT_EQ(Tensor::scalar(3, {DType::f16, dev}).item<double>(), 3.0);
  expect_error([&] { (void)Tensor::zeros({2, -1}, dev); }, {"[2, -1]"});
  // *_like factories keep shape, dtype and device.
  const Tensor base = Tensor::zeros({2, 5}, {DType::bf16, dev}).t();
  const Tensor o = ones_like(base);
  EXPECT_EQ(o.sizes(), (Shape{5, 2}));
  EXPECT_EQ(o.dtype(), DType::bf16);
  EXPECT_EQ(vals(full_like(base, 3, DType::i64)), std::vector<double>(10, 3.0));
  EXPECT_EQ(zeros_like(base).device(), dev);
}

TEST(Factories, ArangeInfersDTypeAndLength) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor a = Tensor::arange(5, dev);
  EXPECT_EQ(a.dtype(), DType::i64);
  EXPECT_EQ(vals(a), (std::vector<double>{0, 1, 2, 3, 4}));
  EXPECT_EQ(vals(Tensor::arange(1, 10, 3, dev)), (std::vector<double>{1, 4, 7}));
  EXPECT_EQ(vals(Tensor::arange(1, 11, 3, dev)), (std::vector<double>{1, 4, 7, 10}));
  EXPECT_EQ(vals(Tensor::arange(5, 0, -2, dev)), (std::vector<double>{5, 3, 1}));
  EXPECT_EQ(vals(Tensor::arange(-3, 0, 1, dev)), (std::vector<double>{-3, -2, -1}));
  EXPECT_EQ(Tensor::arange(2, 2, 1, dev).numel(), 0);
  const Tensor f = Tensor::arange(0, 1, 0.25, dev);
  EXPECT_EQ(f.dtype(), DType::f32);
  EXPECT_EQ(vals(f), (std::vector<double>{0, 0.25, 0.5, 0.75}));
  EXPECT_EQ(Tensor::arange(2.5, dev).dtype(), DType::f32);
  EXPECT_EQ(vals(Tensor::arange(2.5, dev)), (std::vector<double>{0, 1, 2}));
  EXPECT_EQ(Tensor::arange(0.0, 1.0, 0.1, dev).numel(), 10);  // ceil((1 - 0) / 0.1)
  EXPECT_EQ(Tensor::arange(1.0, 2.5, 0.5, dev).numel(), 3);
  const Tensor d = Tensor::arange(0, 4, 1, {DType::f64, dev});
  EXPECT_EQ(d.dtype(), DType::f64);
  EXPECT_EQ(vals(d), (std::vector<double>{0, 1, 2, 3}));
  expect_error([&] { (void)Tensor::arange(0, 5, 0, dev); }, {"arange", "step"});
  expect_error([&] { (void)Tensor::arange(0, 5, -1, dev); }, {"arange", "step"});
  expect_error([&] { (void)Tensor::arange(3, 1, 1, dev); }, {"arange"});
}

TEST(Factories, LinspaceAndEye) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor l = Tensor::linspace(0, 1, 5, dev);
  EXPECT_EQ(l.dtype(), DType::f32);
  EXPECT_EQ(vals(l), (std::vector<double>{0, 0.25, 0.5, 0.75, 1}));
  EXPECT_EQ(vals(Tensor::linspace(2, -2, 3, {DType::f64, dev})), (std::vector<double>{2, 0, -2}));
  EXPECT_EQ(vals(Tensor::linspace(3, 9, 1, dev)), (std::vector<double>{3}));
  EXPECT_EQ(Tensor::linspace(0, 1, 0, dev).numel(), 0);
  const std::vector<double> l7 = vals(Tensor::linspace(-1, 1, 7, {DType::f64, dev}));
  for (int i = 0; i < 7; ++i) EXPECT_NEAR(l7[i], -1.0 + i / 3.0, 1e-15);
  expect_error([&] { (void)Tensor::linspace(0, 1, -1, dev); }, {"linspace", "-1"});
  const Tensor e = Tensor::eye(3, -1, dev);
  EXPECT_EQ(e.dtype(), DType::f32);
  EXPECT_EQ(vals(e), (std::vector<double>{1, 0, 0, 0, 1, 0, 0, 0, 1}));
  const Tensor r = Tensor::eye(2, 3, {DType::i64, dev});
  EXPECT_EQ(r.sizes(), (Shape{2, 3}));
  EXPECT_EQ(r.dtype(), DType::i64);
  EXPECT_EQ(vals(r), (std::vector<double>{1, 0, 0, 0, 1, 0}));
  EXPECT_EQ(Tensor::eye(0, -1, dev).sizes(), (Shape{0, 0}));
  expect_error([&] { (void)Tensor::eye(-1, -1, dev); }, {"eye", "-1"});
}

void mean_std(const std::vector<double>& v, double& mean, double& std) {
  mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  double ss = 0;
  for (double x : v) ss += (x - mean) * (x - mean);
  std = std::sqrt(ss / static_cast<double>(v.size() - 1));
}

TEST(Factories, RandomStatistics) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Generator g(1234);
  double m, s;
  // 100k samples: the standard error of the mean is 1/sqrt(1e5) ~ 0.0032; allow ~6 of them.
  mean_std(vals(Tensor::randn({100000}, 0.0, 1.0, dev, &g)), m, s);
  EXPECT_NEAR(m, 0.0, 0.02);
  EXPECT_NEAR(s, 1.0, 0.02);
  mean_std(vals(Tensor::randn({250, 400}, 3.0, 2.0, {DType::f64, dev}, &g)), m, s);
  EXPECT_NEAR(m, 3.0, 0.04);
  EXPECT_NEAR(s, 2.0, 0.04);
  const std::vector<double> u = vals(Tensor::rand({100000}, dev, &g));
  mean_std(u, m, s);
  EXPECT_NEAR(m, 0.5, 0.01);
  EXPECT_NEAR(s, std::sqrt(1.0 / 12.0), 0.01);
  EXPECT_GE(*std::min_element(u.begin(), u.end()), 0.0);
  EXPECT_LT(*std::max_element(u.begin(), u.end()), 1.0);
  const std::vector<double> w = vals(Tensor::uniform({10000}, -3.0, -1.0, dev, &g));
  EXPECT_GE(*std::min_element(w.begin(), w.end()), -3.0);
  EXPECT_LT(*std::max_element(w.begin(), w.end()), -1.0);
  const Tensor ri = Tensor::randint(-2, 3, {10000}, dev, &g);
  EXPECT_EQ(ri.dtype(), DType::i64);
  std::vector<int> counts(5, 0);
  for (double x : vals(ri)) {
    ASSERT_GE(x, -2);
    ASSERT_LT(x, 3);
    ++counts[static_cast<int>(x) + 2];
  }
  for (int c : counts) EXPECT_NEAR(c, 2000, 250);
  const std::vector<double> bern = vals(Tensor::bernoulli({20000}, 0.3, dev, &g));
  EXPECT_NEAR(std::accumulate(bern.begin(), bern.end(), 0.0) / 20000.0, 0.3, 0.02);
  expect_error([&] { (void)Tensor::randn({2}, 0.0, 1.0, {DType::i64, dev}, &g); }, {"randn", "i64"});
  expect_error([&] { (void)Tensor::randint(3, 3, {2}, dev, &g); }, {"randint"});
}

TEST(Factories, SameSeedSameValuesAndStateRestore) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Generator a(42), b(42), c(43);
  const std::vector<double> va = vals(Tensor::randn({64}, 0.0, 1.0, dev, &a));
  EXPECT_EQ(va, vals(Tensor::randn({64}, 0.0, 1.0, dev, &b)));
  EXPECT_NE(va, vals(Tensor::randn({64}, 0.0, 1.0, dev, &c)));
  // Consecutive draws differ; each op advances the offset by one.
  EXPECT_EQ(a.offset(), 1u);
  const std::vector<double> va2 = vals(Tensor::randn({64}, 0.0, 1.0, dev, &a));
  EXPECT_NE(va, va2);
  EXPECT_EQ(a.offset(), 2u);
  // Save, draw, restore, draw again: identical.
  const Generator::State st = a.get_state();
  const std::vector<double> r1 = vals(Tensor::rand({3, 7}, dev, &a));
  const std::vector<double> i1 = vals(Tensor::randint(0, 100, {9}, dev, &a));
  a.set_state(st);
  EXPECT_EQ(vals(Tensor::rand({3, 7}, dev, &a)), r1);
  EXPECT_EQ(vals(Tensor::randint(0, 100, {9}, dev, &a)), i1);
  // A copied generator continues the same stream; manual_seed restarts it.
  Generator copy = a;
  EXPECT_EQ(vals(Tensor::rand({5}, dev, &copy)), vals(Tensor::rand({5}, dev, &a)));
  a.manual_seed(42);
  EXPECT_EQ(vals(Tensor::randn({64}, 0.0, 1.0, dev, &a)), va);
  // The default generator, seeded.
  manual_seed(7);
  const std::vector<double> d1 = vals(Tensor::randn({16}, 0.0, 1.0, dev));
  manual_seed(7);
  EXPECT_EQ(vals(Tensor::randn({16}, 0.0, 1.0, dev)), d1);
  // Values depend on the element index, not on the shape the numbers are drawn in.
  Generator p(5), q(5);
  EXPECT_EQ(vals(Tensor::rand({12}, dev, &p)), vals(Tensor::rand({3, 4}, dev, &q)));
}

// ---------------------------------------------------------------------------------------------
// Type promotion
// ---------------------------------------------------------------------------------------------

TEST(Promotion, PromoteTypesTable) {
  using D = DType;
  const D order[] = {D::boolean, D::u8, D::i32, D::i64, D::f16, D::bf16, D::f32, D::f64};
  // PyTorch's torch.promote_types over the dtypes FLAME has (rows and columns in `order`).
  const D table[8][8] = {
      /* bool */ {D::boolean, D::u8, D::i32, D::i64, D::f16, D::bf16, D::f32, D::f64},
      /* u8   */ {D::u8, D::u8, D::i32, D::i64, D::f16, D::bf16, D::f32, D::f64},
      /* i32  */ {D::i32, D::i32, D::i32, D::i64, D::f16, D::bf16, D::f32, D::f64},
      /* i64  */ {D::i64, D::i64, D::i64, D::i64, D::f16, D::bf16, D::f32, D::f64},
      /* f16  */ {D::f16, D::f16, D::f16, D::f16, D::f16, D::f32, D::f32, D::f64},
      /* bf16 */ {D::bf16, D::bf16, D::bf16, D::bf16, D::f32, D::bf16, D::f32, D::f64},
      /* f32  */ {D::f32, D::f32, D::f32, D::f32, D::f32, D::f32, D::f32, D::f64},
      /* f64  */ {D::f64, D::f64, D::f64, D::f64, D::f64, D::f64, D::f64, D::f64},
  };
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 8; ++j) {
      EXPECT_EQ(promote_types(order[i], order[j]), table[i][j])
          << dtype_name(order[i]) << " + " << dtype_name(order[j]) << " gave "
          << dtype_name(promote_types(order[i], order[j])) << ", expected " << dtype_name(table[i][j]);
    }
  }
}

TEST(Promotion, ResultTypeWithZeroDimOperands) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  auto t = [&](DType dt) { return Tensor::ones({2}, {dt, dev}); };
  auto s = [&](DType dt) { return Tensor::ones({}, {dt, dev}); };
  EXPECT_EQ(result_type(t(DType::f32), s(DType::f64)), DType::f32);
  EXPECT_EQ(result_type(s(DType::f64), t(DType::f16)), DType::f16);
  EXPECT_EQ(result_type(t(DType::i64), s(DType::f64)), DType::f64);
  EXPECT_EQ(result_type(t(DType::i32), s(DType::i64)), DType::i32);
  EXPECT_EQ(result_type(t(DType::u8), s(DType::i64)), DType::u8);
  EXPECT_EQ(result_type(t(DType::boolean), s(DType::i32)), DType::i32);
  EXPECT_EQ(result_type(t(DType::boolean), s(DType::bf16)), DType::bf16);
  EXPECT_EQ(result_type(s(DType::f32), s(DType::f64)), DType::f64);
  EXPECT_EQ(result_type(t(DType::bf16), t(DType::f16)), DType::f32);
  EXPECT_EQ(result_type(t(DType::u8), t(DType::i32)), DType::i32);
  // And through an op.
  EXPECT_EQ((t(DType::bf16) + s(DType::f64)).dtype(), DType::bf16);
  EXPECT_EQ((t(DType::i32) * 2.5).dtype(), DType::f32);
  EXPECT_EQ((t(DType::boolean) + 1).dtype(), DType::i64);
}

// ---------------------------------------------------------------------------------------------
// In-place ops
// ---------------------------------------------------------------------------------------------

TEST(InPlace, BroadcastingAddMulCopy) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor a = Tensor::from_vec<float>({1, 2, 3, 4, 5, 6}, {2, 3}, dev);
  a.add_(Tensor::from_vec<float>({10, 20, 30}, {3}, dev));
  EXPECT_EQ(vals(a), (std::vector<double>{11, 22, 33, 14, 25, 36}));
  a.mul_(Tensor::from_vec<float>({2, -1}, {2, 1}, dev));
  EXPECT_EQ(vals(a), (std::vector<double>{22, 44, 66, -14, -25, -36}));
  a.add_(Tensor::ones({3}, dev), 0.5);
  EXPECT_EQ(vals(a), (std::vector<double>{22.5, 44.5, 66.5, -13.5, -24.5, -35.5}));
  a.sub_(Tensor::scalar(0.5, dev));
  a.div_(Tensor::full({2, 3}, 2.0, dev));
  EXPECT_EQ(vals(a), (std::vector<double>{11, 22, 33, -7, -12.5, -18}));
  // copy_ broadcasts and converts dtype.
  a.copy_(Tensor::from_vec<int64_t>({7, 8, 9}, {3}, dev));
  EXPECT_EQ(a.dtype(), DType::f32);
  EXPECT_EQ(vals(a), (std::vector<double>{7, 8, 9, 7, 8, 9}));
  // Into a strided view.
  a.t().narrow(0, 1, 2).mul_(Tensor::scalar(10, dev));
  EXPECT_EQ(vals(a), (std::vector<double>{7, 80, 90, 7, 80, 90}));
  // Operators and scalar forms.
  Tensor b = Tensor::ones({2}, {DType::i64, dev});
  b += Tensor::from_vec<int64_t>({3, 4}, {2}, dev);
  b *= 3;
  b -= 1;
  EXPECT_EQ(vals(b), (std::vector<double>{11, 14}));
  // f32 += f64 tensor: computed in f64, written back as f32 (PyTorch allows same-category casts).
  Tensor c = Tensor::full({2}, 1.0, dev);
  c += Tensor::from_vec<double>({0.25, 1e-12}, {2}, dev);
  EXPECT_EQ(c.dtype(), DType::f32);
  EXPECT_EQ(vals(c), (std::vector<double>{1.25, 1.0}));
  // An integer tensor may take a bool or integer operand.
  b += Tensor::from_vec(std::vector<bool>{true, false}, {2}, dev);
  EXPECT_EQ(vals(b), (std::vector<double>{12, 14}));
}

TEST(InPlace, OverlappingSourceIsReadBeforeWriting) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = iota_f32({5});
  x.narrow(0, 1, 4).copy_(x.narrow(0, 0, 4));
  EXPECT_EQ(vals(x), (std::vector<double>{0, 0, 1, 2, 3}));
  Tensor y = iota_f32({2, 2});
  y.add_(y.t());
  EXPECT_EQ(vals(y), (std::vector<double>{0, 3, 3, 6}));
  Tensor z = iota_f32({4});
  z.copy_(z.flip({0}));
  EXPECT_EQ(vals(z), (std::vector<double>{3, 2, 1, 0}));
  Tensor w = iota_f32({3});
  w.mul_(w);
  EXPECT_EQ(vals(w), (std::vector<double>{0, 1, 4}));
}

TEST(InPlace, Errors) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  // Writing into an expanded view (several elements share one location).
  Tensor e = Tensor::ones({3}, dev).expand({2, 3});
  expect_error([&] { e.add_(Tensor::ones({2, 3}, dev)); }, {"add", "[2, 3]", "expanded"});
  expect_error([&] { e.fill_(1); }, {"fill_", "expanded"});
  expect_error([&] { e.copy_(Tensor::ones({2, 3}, dev)); }, {"copy_", "expanded"});
  expect_error([&] { e.mul_(2.0); }, {"mul", "expanded"});
  // Integer tensor with a floating operand.
  Tensor i = Tensor::ones({3}, {DType::i64, dev});
  expect_error([&] { i += Tensor::ones({3}, dev); }, {"add", "f32", "i64"});
  expect_error([&] { i.mul_(Tensor::ones({}, {DType::f64, dev})); }, {"mul", "f64", "i64"});
  expect_error([&] { i += 2.5; }, {"add", "f32", "i64"});
  expect_error([&] { i.div_(Tensor::ones({3}, {DType::i64, dev})); }, {"div", "f32", "i64"});
  Tensor bl = Tensor::ones({3}, {DType::boolean, dev});
  expect_error([&] { bl += Tensor::ones({3}, {DType::i64, dev}); }, {"add", "i64", "bool"});
  EXPECT_EQ(vals(i), std::vector<double>(3, 1.0));  // nothing was written
  // The result of broadcasting must keep self's shape.
  Tensor a = Tensor::ones({3}, dev);
  expect_error([&] { a.add_(Tensor::ones({2, 3}, dev)); }, {"add", "[3]", "[2, 3]"});
  expect_error([&] { a.copy_(Tensor::ones({4}, dev)); }, {"copy_", "[4]", "[3]"});
  expect_error([&] { a.mul_(Tensor::ones({2}, dev)); }, {"mul", "[3]", "[2]"});
}

}  // namespace
}  // namespace flame::test
