// Copies and joins: errors and special cases (values are covered by the op table, cases_join.cpp).
#include <numeric>

#include "gradcheck.h"
#include "test_util.h"

namespace flame::test {
namespace {

Tensor iota(const Shape& shape, DType dt = DType::f32) {
  std::vector<double> v(static_cast<std::size_t>(RefTensor::numel_of(shape)));
  std::iota(v.begin(), v.end(), 0.0);
  return Tensor::from_vec(v, shape, test_device()).to(dt);
}

std::vector<double> vals(const Tensor& t) { return t.to_vec<double>(); }

// ---- cat ----

TEST(Cat, Errors) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor a = iota({2, 3});
  expect_error([] { (void)cat({}); }, {"cat", "non-empty"});
  expect_error([&] { (void)cat({a, Tensor::scalar(1.0, test_device())}); }, {"cat", "zero-dimensional", "position 1"});
  expect_error([&] { (void)cat({a, iota({2, 3, 1})}); }, {"cat", "[2, 3]", "[2, 3, 1]", "position 1"});
  expect_error([&] { (void)cat({a, iota({2, 4})}, 0); }, {"cat", "[2, 3]", "[2, 4]", "dim 0"});
  expect_error([&] { (void)cat({a, a, iota({3, 3})}, 1); }, {"cat", "[3, 3]", "position 2", "dim 1"});
  expect_error([&] { (void)cat({a, a}, 2); }, {"cat", "dim 2"});
  expect_error([&] { (void)cat({a, a}, -3); }, {"cat", "dim -3"});
  expect_error([&] { (void)cat({a, Tensor()}); }, {"cat", "position 1", "undefined"});
}

TEST(Cat, DeviceMismatchNamesBothDevices) {
  FLAME_SKIP_IF_NO_CUDA();
  const Tensor c = Tensor::ones({2}, Device::cpu()), g = Tensor::ones({2}, Device::cuda(0));
  expect_error([&] { (void)cat({c, g}); }, {"cat", "cpu", "cuda:0"});
  expect_error([&] { (void)cat({g, g, c}); }, {"cat", "cpu", "cuda:0"});
  expect_error([&] { (void)stack({g, c}); }, {"stack", "cpu", "cuda:0"});
}

TEST(Cat, ResultIsAFreshContiguousCopy) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor a = iota({2, 3});
  const Tensor one = cat({a});
  EXPECT_FALSE(one.shares_storage(a));
  EXPECT_EQ(vals(one), vals(a));
  const Tensor r = cat({a.t(), a.t()}, 1);
  EXPECT_TRUE(r.is_contiguous());
  EXPECT_EQ(r.sizes(), (Shape{3, 4}));
  EXPECT_EQ(vals(r), (std::vector<double>{0, 3, 0, 3, 1, 4, 1, 4, 2, 5, 2, 5}));
  a.fill_(-1);  // the result does not alias its inputs
  EXPECT_EQ(vals(r)[1], 3.0);
}

TEST(Cat, LegacyEmptyTensorsAreSkipped) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor a = iota({2, 3}), e = Tensor::zeros({0}, dev);
  // A [0] tensor takes part neither in the shape check nor in the dim wrap (dim 1 of a 1-d [0]).
  EXPECT_EQ(cat({e, a, e}, 1).sizes(), (Shape{2, 3}));
  EXPECT_EQ(vals(cat({e, a, e}, -1)), vals(a));
  EXPECT_EQ(cat({e, e}).sizes(), (Shape{0}));
  // ... but it does take part in dtype promotion, as in PyTorch.
  EXPECT_EQ(cat({a, Tensor::zeros({0}, {DType::f64, dev})}).dtype(), DType::f64);
  EXPECT_EQ(cat({Tensor::zeros({0}, {DType::i64, dev}), Tensor::zeros({0}, {DType::boolean, dev})}).dtype(),
            DType::i64);
  // Other empty tensors must match like any other.
  EXPECT_EQ(cat({Tensor::zeros({0, 3}, dev), a, Tensor::zeros({0, 3}, dev)}).sizes(), (Shape{2, 3}));
  EXPECT_EQ(cat({Tensor::zeros({2, 0}, dev), a}, 1).sizes(), (Shape{2, 3}));
  expect_error([&] { (void)cat({Tensor::zeros({0, 2}, dev), a}); }, {"cat", "[0, 2]", "[2, 3]"});
  // A 1-d [0] tensor alone with a 1-d tensor: plain concatenation.
  EXPECT_EQ(vals(cat({e, iota({3})})), (std::vector<double>{0, 1, 2}));
}

TEST(Cat, PromotesAndConvertsEachInput) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor b = Tensor::from_vec(std::vector<bool>{true, false}, {2}, dev);
  const Tensor i = Tensor::from_vec<int64_t>({7, -8}, {2}, dev);
  const Tensor h = Tensor::from_vec<float>({0.5f, 1.0f / 3.0f}, {2}, dev).to(DType::bf16);
  const Tensor r1 = cat({b, i});
  EXPECT_EQ(r1.dtype(), DType::i64);
  EXPECT_EQ(vals(r1), (std::vector<double>{1, 0, 7, -8}));
  const Tensor r2 = cat({i, h, b});
  EXPECT_EQ(r2.dtype(), DType::bf16);
  EXPECT_EQ(vals(r2), (std::vector<double>{7, -8, 0.5, 0.333984375, 1, 0}));
  const Tensor r3 = cat({h, Tensor::zeros({1}, {DType::f16, dev})});
  EXPECT_EQ(r3.dtype(), DType::f32);
  EXPECT_EQ(vals(r3), (std::vector<double>{0.5, 0.333984375, 0}));
}

TEST(Cat, ManyInputs) {
  FLAME_SKIP_IF_NO_DEVICE();
  TensorList parts;
  std::vector<double> want;
  for (int k = 0; k < 40; ++k) {
    parts.push_back(Tensor::full({1, k % 3}, k, test_device()));
    for (int j = 0; j < k % 3; ++j) want.push_back(k);
  }
  const Tensor r = cat(parts, 1);
  EXPECT_EQ(r.sizes(), (Shape{1, static_cast<int64_t>(want.size())}));
  EXPECT_EQ(vals(r), want);
}

// ---- stack ----

TEST(Stack, ErrorsAndSpecialCases) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor a = iota({2, 3});
  expect_error([] { (void)stack({}); }, {"stack", "non-empty"});
  expect_error([&] { (void)stack({a, iota({3, 2})}); }, {"stack", "[2, 3]", "[3, 2]", "entry 1"});
  expect_error([&] { (void)stack({a, a, iota({2, 3, 1})}); }, {"stack", "[2, 3, 1]", "entry 2"});
  expect_error([&] { (void)stack({a, a}, 3); }, {"stack", "dim 3"});
  expect_error([&] { (void)stack({a, a}, -4); }, {"stack", "dim -4"});
  expect_error([&] { (void)stack({a, Tensor()}); }, {"stack", "position 1"});
  // dim in [-ndim - 1, ndim].
  EXPECT_EQ(stack({a, a}, 2).sizes(), (Shape{2, 3, 2}));
  EXPECT_EQ(stack({a, a}, -3).sizes(), (Shape{2, 2, 3}));
  // 0-d tensors stack into a vector; [0] tensors are not skipped as in cat.
  const Tensor s = stack({Tensor::scalar(1.5, dev), Tensor::scalar(-2.0, dev), Tensor::scalar(3.0, dev)});
  EXPECT_EQ(s.sizes(), (Shape{3}));
  EXPECT_EQ(vals(s), (std::vector<double>{1.5, -2, 3}));
  EXPECT_EQ(stack({Tensor::zeros({0}, dev), Tensor::zeros({0}, dev)}, 1).sizes(), (Shape{0, 2}));
  // Mixed dtypes promote; the result is a copy.
  const Tensor m = stack({Tensor::ones({2}, {DType::i32, dev}), Tensor::full({2}, 0.25, {DType::f64, dev})});
  EXPECT_EQ(m.dtype(), DType::f64);
  EXPECT_EQ(vals(m), (std::vector<double>{1, 1, 0.25, 0.25}));
  EXPECT_FALSE(stack({a}).shares_storage(a));
  EXPECT_EQ(stack({a}).sizes(), (Shape{1, 2, 3}));
}

// ---- split, split_with_sizes, chunk ----

TEST(Split, PiecesAreViews) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor x = iota({7, 2});
  TensorList p = x.split(3);
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(p[0].sizes(), (Shape{3, 2}));
  EXPECT_EQ(p[2].sizes(), (Shape{1, 2}));
  for (const Tensor& t : p) EXPECT_TRUE(t.shares_storage(x));
  EXPECT_EQ(p[1].storage_offset(), 6);
  EXPECT_EQ(p[2].storage_offset(), 12);
  p[2].fill_(-1);  // writes through to x
  EXPECT_EQ(vals(x.select(0, 6)), (std::vector<double>{-1, -1}));
  const TensorList q = x.t().split(4, -1);  // along a strided dim
  ASSERT_EQ(q.size(), 2u);
  EXPECT_EQ(q[1].sizes(), (Shape{2, 3}));
  EXPECT_EQ(q[1].strides(), (Shape{1, 2}));
  EXPECT_EQ(q[1].storage_offset(), 8);
  const TensorList w = x.split_with_sizes({0, 5, 2});
  ASSERT_EQ(w.size(), 3u);
  EXPECT_EQ(w[0].sizes(), (Shape{0, 2}));
  EXPECT_EQ(w[2].storage_offset(), 10);
  for (const Tensor& t : x.chunk(3, 1)) EXPECT_TRUE(t.shares_storage(x));
}

TEST(Split, SizesLikePyTorch) {
  FLAME_SKIP_IF_NO_DEVICE();
  auto sizes_along = [](const TensorList& l, int64_t d) {
    Shape s;
    for (const Tensor& t : l) s.push_back(t.size(d));
    return s;
  };
  const Tensor x = iota({6, 5});
  EXPECT_EQ(sizes_along(x.split(2, 1), 1), (Shape{2, 2, 1}));
  EXPECT_EQ(sizes_along(x.split(6), 0), (Shape{6}));
  EXPECT_EQ(sizes_along(x.split(100), 0), (Shape{6}));
  EXPECT_EQ(sizes_along(x.split(1, -1), 1), (Shape{1, 1, 1, 1, 1}));
  // chunk: ceil(n / chunks) per piece, which can give fewer pieces than asked for.
  EXPECT_EQ(sizes_along(x.chunk(4), 0), (Shape{2, 2, 2}));
  EXPECT_EQ(sizes_along(x.chunk(3, 1), 1), (Shape{2, 2, 1}));
  EXPECT_EQ(sizes_along(x.chunk(10, 1), 1), (Shape{1, 1, 1, 1, 1}));
  EXPECT_EQ(sizes_along(x.chunk(1), 0), (Shape{6}));
  EXPECT_EQ(sizes_along(iota({5}).chunk(4), 0), (Shape{2, 2, 1}));
  EXPECT_EQ(sizes_along(iota({7}).chunk(3), 0), (Shape{3, 3, 1}));
  // Empty dims: split gives one empty piece, chunk gives `chunks` empty pieces.
  const Tensor e = Tensor::zeros({0, 3}, test_device());
  EXPECT_EQ(sizes_along(e.split(2), 0), (Shape{0}));
  EXPECT_EQ(sizes_along(e.split(0), 0), (Shape{0}));
  EXPECT_EQ(sizes_along(e.chunk(3), 0), (Shape{0, 0, 0}));
  EXPECT_EQ(sizes_along(e.split_with_sizes({0, 0}), 0), (Shape{0, 0}));
  EXPECT_TRUE(e.split_with_sizes({}).empty());
  // The pieces of a chunk/split put back together give the input.
  EXPECT_EQ(vals(cat(x.chunk(4, 1), 1)), vals(x));
  EXPECT_EQ(vals(cat(x.split_with_sizes({3, 0, 2}, 1), 1)), vals(x));
}

TEST(Split, Errors) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = iota({4, 3});
  const Tensor s = Tensor::scalar(1.0, test_device());
  expect_error([&] { (void)x.split(0); }, {"split", "split_size", "0", "size 4"});
  expect_error([&] { (void)x.split(-1); }, {"split", "split_size", "-1"});
  expect_error([&] { (void)x.split(2, 2); }, {"split", "dim 2"});
  expect_error([&] { (void)s.split(1); }, {"split", "1-dimensional", "[]"});
  expect_error([&] { (void)x.split_with_sizes({2, 1}); }, {"split_with_sizes", "[2, 1]", "4", "[4, 3]"});
  expect_error([&] { (void)x.split_with_sizes({2, 3}, 1); }, {"split_with_sizes", "[2, 3]", "dim 1", "[4, 3]"});
  expect_error([&] { (void)x.split_with_sizes({5, -1}); }, {"split_with_sizes", "non-negative", "[5, -1]"});
  expect_error([&] { (void)s.split_with_sizes({1}); }, {"split_with_sizes", "1-dimensional"});
  expect_error([&] { (void)x.chunk(0); }, {"chunk", "0"});
  expect_error([&] { (void)x.chunk(-2); }, {"chunk", "-2"});
  expect_error([&] { (void)x.chunk(2, -3); }, {"chunk", "dim -3"});
  expect_error([&] { (void)s.chunk(1); }, {"chunk", "1-dimensional"});
}

// ---- flip ----

TEST(Flip, ValuesErrorsAndCopies) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = iota({2, 3});
  EXPECT_EQ(vals(x.flip({0})), (std::vector<double>{3, 4, 5, 0, 1, 2}));
  EXPECT_EQ(vals(x.flip({-1})), (std::vector<double>{2, 1, 0, 5, 4, 3}));
  EXPECT_EQ(vals(x.flip({1, 0})), (std::vector<double>{5, 4, 3, 2, 1, 0}));
  EXPECT_EQ(vals(x.flip({0}).flip({0})), vals(x));
  EXPECT_EQ(vals(x.t().flip({1})), (std::vector<double>{3, 0, 4, 1, 5, 2}));
  const Tensor f = x.flip({});
  EXPECT_FALSE(f.shares_storage(x));
  EXPECT_TRUE(x.flip({1}).is_contiguous());
  EXPECT_EQ(vals(f), vals(x));
  EXPECT_EQ(Tensor::scalar(3.0, test_device()).flip({0}).item<double>(), 3.0);
  EXPECT_EQ(Tensor::zeros({0, 2}, test_device()).flip({0, 1}).sizes(), (Shape{0, 2}));
  expect_error([&] { (void)x.flip({0, 0}); }, {"flip", "dim 0", "more than once", "[0, 0]"});
  expect_error([&] { (void)x.flip({1, -1}); }, {"flip", "dim 1", "more than once"});
  expect_error([&] { (void)x.flip({2}); }, {"flip", "dim 2"});
  expect_error([&] { (void)x.flip({-3}); }, {"flip", "dim -3"});
}

// ---- repeat ----

TEST(Repeat, ValuesErrorsAndCopies) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor v = iota({3});
  EXPECT_EQ(vals(v.repeat({2})), (std::vector<double>{0, 1, 2, 0, 1, 2}));
  const Tensor r = v.repeat({2, 1});
  EXPECT_EQ(r.sizes(), (Shape{2, 3}));
  EXPECT_EQ(vals(r), (std::vector<double>{0, 1, 2, 0, 1, 2}));
  EXPECT_EQ(vals(iota({2, 1}).repeat({1, 3})), (std::vector<double>{0, 0, 0, 1, 1, 1}));
  const Tensor same = v.repeat({1});
  EXPECT_FALSE(same.shares_storage(v));
  EXPECT_EQ(vals(same), vals(v));
  EXPECT_EQ(v.repeat({0}).sizes(), (Shape{0}));
  EXPECT_EQ(v.repeat({2, 0}).sizes(), (Shape{2, 0}));
  const Tensor s = Tensor::scalar(4.0, test_device());
  EXPECT_EQ(s.repeat({}).dim(), 0);
  EXPECT_EQ(vals(s.repeat({2, 2})), std::vector<double>(4, 4.0));
  expect_error([&] { (void)iota({2, 3}).repeat({2}); }, {"repeat", "[2]", "[2, 3]"});
  expect_error([&] { (void)v.repeat({2, -1}); }, {"repeat", "non-negative", "[2, -1]"});
}

TEST(Repeat, ManyDims) {
  FLAME_SKIP_IF_NO_DEVICE();
  // 9 dims of size 2, each repeated twice: the interleaved view has 18 dims.
  const Shape shape(9, 2);
  const Tensor x = iota(shape);
  const Tensor r = x.repeat(Shape(9, 2));
  EXPECT_EQ(r.sizes(), Shape(9, 4));
  const std::vector<double> got = vals(r), in = vals(x);
  int bad = 0;
  for (int64_t f = 0; f < static_cast<int64_t>(got.size()); ++f) {
    // Output index digits are base 4; the input digit is each one modulo 2.
    int64_t src = 0, rest = f, scale = 1;
    for (int d = 8; d >= 0; --d) {
      src += (rest % 4) % 2 * scale;
      rest /= 4;
      scale *= 2;
    }
    if (got[f] != in[src] && bad++ < 5) ADD_FAILURE() << "element " << f << ": " << got[f] << " vs " << in[src];
  }
}

// ---- pad ----

TEST(Pad, KnownValues) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor v = iota({4}).add_scalar(1);  // [1, 2, 3, 4]
  EXPECT_EQ(vals(pad(v, {1, 2}, PadMode::constant, 9)), (std::vector<double>{9, 1, 2, 3, 4, 9, 9}));
  EXPECT_EQ(vals(pad(v, {2, 1}, PadMode::reflect)), (std::vector<double>{3, 2, 1, 2, 3, 4, 3}));
  EXPECT_EQ(vals(pad(v, {3, 3}, PadMode::reflect)), (std::vector<double>{4, 3, 2, 1, 2, 3, 4, 3, 2, 1}));
  EXPECT_EQ(vals(pad(v, {2, 1}, PadMode::replicate)), (std::vector<double>{1, 1, 1, 2, 3, 4, 4}));
  // Negative pads crop, in every mode; the padding then applies to the cropped tensor.
  EXPECT_EQ(vals(pad(v, {-1, 2}, PadMode::constant, 0)), (std::vector<double>{2, 3, 4, 0, 0}));
  EXPECT_EQ(vals(pad(v, {-1, 2}, PadMode::replicate)), (std::vector<double>{2, 3, 4, 4, 4}));
  EXPECT_EQ(vals(pad(v, {1, -2}, PadMode::reflect)), (std::vector<double>{2, 1, 2}));
  EXPECT_EQ(pad(v, {-2, -2}).sizes(), (Shape{0}));
  // 2-d reflect (torch.nn.functional.pad(arange(9).view(3, 3), (1, 1, 1, 1), "reflect")).
  EXPECT_EQ(vals(pad(iota({3, 3}), {1, 1, 1, 1}, PadMode::reflect)),
            (std::vector<double>{4, 3, 4, 5, 4, 1, 0, 1, 2, 1, 4, 3, 4, 5, 4, 7, 6, 7, 8, 7, 4, 3, 4, 5, 4}));
  // 2-d replicate corners take the corner element.
  EXPECT_EQ(vals(pad(iota({2, 2}), {1, 1, 1, 0}, PadMode::replicate)),
            (std::vector<double>{0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3}));
  // Padding only a leading dim: the last dim's pair is (0, 0).
  EXPECT_EQ(vals(pad(iota({1, 2}), {0, 0, 1, 0}, PadMode::constant, -1)), (std::vector<double>{-1, -1, 0, 1}));
  // Integer and bool tensors keep their dtype; the value is converted.
  const Tensor pi = pad(iota({2}, DType::i64), {1, 0}, PadMode::constant, 5);
  EXPECT_EQ(pi.dtype(), DType::i64);
  EXPECT_EQ(vals(pi), (std::vector<double>{5, 0, 1}));
  const Tensor pb = pad(Tensor::zeros({2}, {DType::boolean, test_device()}), {0, 1}, PadMode::constant, 1);
  EXPECT_EQ(pb.dtype(), DType::boolean);
  EXPECT_EQ(vals(pb), (std::vector<double>{0, 0, 1}));
  EXPECT_EQ(vals(pad(Tensor::zeros({1}, {DType::boolean, test_device()}), {1, 0}, PadMode::constant, 0.5)),
            (std::vector<double>{1, 0}));
  EXPECT_EQ(vals(pad(iota({1}, DType::i32), {0, 1}, PadMode::constant, -2.7)), (std::vector<double>{0, -2}));
}

TEST(Pad, CopiesAndEmptyPads) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = iota({2, 3}).t();
  for (PadMode m : {PadMode::constant, PadMode::reflect, PadMode::replicate}) {
    const Tensor p = pad(x, {}, m);
    EXPECT_FALSE(p.shares_storage(x));
    EXPECT_TRUE(p.is_contiguous());
    EXPECT_EQ(vals(p), vals(x));
    EXPECT_EQ(vals(pad(x, {0, 0, 0, 0}, m)), vals(x));
  }
  const Tensor s = Tensor::scalar(2.0, test_device());
  EXPECT_EQ(pad(s, {}).item<double>(), 2.0);
  // Constant padding of an empty dim is all `value`.
  EXPECT_EQ(vals(pad(Tensor::zeros({2, 0}, test_device()), {1, 1}, PadMode::constant, 3)), std::vector<double>(4, 3.0));
  // Non-padded empty dims give an empty result in every mode.
  EXPECT_EQ(pad(Tensor::zeros({0, 3}, test_device()), {1, 1}, PadMode::reflect).sizes(), (Shape{0, 5}));
  EXPECT_EQ(pad(Tensor::zeros({0, 3}, test_device()), {1, 1}, PadMode::replicate).sizes(), (Shape{0, 5}));
}

TEST(Pad, Errors) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = iota({2, 3});
  expect_error([&] { (void)pad(x, {1, 1, 1}); }, {"pad", "even", "[1, 1, 1]"});
  expect_error([&] { (void)pad(x, {1, 1, 1, 1, 1, 1}); }, {"pad", "[1, 1, 1, 1, 1, 1]", "[2, 3]"});
  expect_error([&] { (void)pad(Tensor::scalar(1.0, test_device()), {1, 1}); }, {"pad", "[1, 1]", "[]"});
  expect_error([&] { (void)pad(x, {3, 0}, PadMode::reflect); }, {"pad", "reflect", "(3, 0)", "size 3", "[2, 3]"});
  expect_error([&] { (void)pad(x, {0, 0, 0, 2}, PadMode::reflect); }, {"pad", "reflect", "size 2", "dim 0"});
  expect_error([&] { (void)pad(x, {-1, 2}, PadMode::reflect); }, {"pad", "reflect", "size 2"});  // after cropping
  expect_error([&] { (void)pad(Tensor::zeros({2, 0}, test_device()), {1, 0}, PadMode::replicate); },
               {"pad", "replicate", "[2, 0]"});
  expect_error([&] { (void)pad(Tensor::zeros({2, 0}, test_device()), {0, 1}, PadMode::reflect); },
               {"pad", "reflect", "[2, 0]"});
  expect_error([&] { (void)pad(x, {-2, -2}); }, {"pad", "crops", "dim 1", "[2, 3]"});
  expect_error([&] { (void)pad(x, {-4, 5}); }, {"pad", "crops", "dim 1"});
  expect_error([&] { (void)pad(Tensor(), {}); }, {"pad", "undefined"});
}

// ---- gradients (float64 finite differences on the CPU) ----

Tensor rnd(const Shape& shape, uint64_t seed) {
  Generator g(seed);
  return Tensor::randn(shape, 0.0, 1.0, DType::f64, &g);
}

// backward() seed of ones (so the test does not depend on sum's gradient).
BackwardOptions ones_seed(const Tensor& y) {
  BackwardOptions o;
  o.grad_output = Tensor::ones(y.sizes(), {y.dtype(), y.device()});
  return o;
}

void expect_gradcheck(const std::string& what, const std::function<Tensor(const TensorList&)>& fn,
                      const TensorList& inputs) {
  const GradcheckResult r = gradcheck(fn, inputs);
  EXPECT_TRUE(r.ok) << what << ": " << r.message;
  EXPECT_GT(r.checked, 0) << what;
}

TEST(JoinGrad, CatAndStack) {
  const TensorList three = {rnd({2, 3}, 1), rnd({1, 3}, 2), rnd({4, 3}, 3)};
  expect_gradcheck("cat dim 0", [](const TensorList& t) { return cat(t, 0); }, three);
  expect_gradcheck("cat dim -1", [](const TensorList& t) { return cat(t, -1); },
                   {rnd({2, 3}, 4), rnd({2, 1}, 5), rnd({2, 2}, 6)});
  expect_gradcheck("cat of strided inputs", [](const TensorList& t) { return cat(t, 1); },
                   {rnd({3, 2}, 7).t(), rnd({2, 9}, 8).slice(1, 0, 9, 2)});
  expect_gradcheck("cat with a skipped [0] tensor", [](const TensorList& t) { return cat({t[0], t[1]}, 1); },
                   {Tensor::zeros({0}, DType::f64), rnd({2, 3}, 9)});
  expect_gradcheck("cat, used twice", [](const TensorList& t) { return cat({t[0], t[1], t[0]}, 0); },
                   {rnd({2, 2}, 10), rnd({1, 2}, 11)});
  expect_gradcheck("stack dim 1", [](const TensorList& t) { return stack(t, 1); },
                   {rnd({2, 3}, 12), rnd({2, 3}, 13), rnd({2, 3}, 14)});
  expect_gradcheck("stack 0-d", [](const TensorList& t) { return stack(t); }, {rnd({}, 15), rnd({}, 16)});
  // An integer input takes part in the forward only.
  Tensor x = rnd({2, 2}, 17).requires_grad_(true);
  const Tensor y = cat({x, Tensor::ones({1, 2}, DType::i64)});
  EXPECT_TRUE(y.requires_grad());
  EXPECT_EQ(y.dtype(), DType::f64);
  const Gradients g = y.backward(ones_seed(y));
  EXPECT_EQ(vals(x.grad(g)), std::vector<double>(4, 1.0));
}

TEST(JoinGrad, FlipRepeat) {
  expect_gradcheck("flip", [](const TensorList& t) { return t[0].flip({0, 2}); }, {rnd({2, 3, 4}, 20)});
  expect_gradcheck("flip of a view", [](const TensorList& t) { return t[0].flip({1}); }, {rnd({3, 4}, 21).t()});
  expect_gradcheck("repeat", [](const TensorList& t) { return t[0].repeat({2, 1, 3}); }, {rnd({2, 3}, 22)});
  expect_gradcheck("repeat 0-d", [](const TensorList& t) { return t[0].repeat({3}); }, {rnd({}, 23)});
  expect_gradcheck("repeat x1", [](const TensorList& t) { return t[0].repeat({1, 1}); }, {rnd({3, 2}, 24)});
  // Zero repeats: the gradient is zero, not absent.
  Tensor x = rnd({3}, 25).requires_grad_(true);
  const Tensor y = cat({x.repeat({0}), x * 2.0});
  const Gradients g = y.backward(ones_seed(y));
  EXPECT_EQ(vals(x.grad(g)), std::vector<double>(3, 2.0));
}

// Engine bug found through cat's skipped inputs: when a non-leaf vertex receives no gradient
// (its consumers' rules all returned undefined), the engine drops it without walking its node,
// so the inputs of that node keep a pending dependency and never become ready, even when they
// received gradients along other paths. Expected: x gets the gradient of the second input.
TEST(JoinGrad, EngineUndefinedGradientDoesNotBlockOtherPaths) {
  Tensor x = rnd({3}, 40).requires_grad_(true);
  const Tensor v = x * 3.0;  // a non-leaf that will receive no gradient
  CustomFunction second{"second", [](const TensorList& in) { return in[1].clone(); },
                        [](const TensorList&, const Tensor&, const Tensor& g) { return TensorList{Tensor(), g}; }};
  const Tensor y = apply_custom(second, {v, x});
  const Gradients g = y.backward(ones_seed(y));
  ASSERT_TRUE(x.grad(g).defined()) << "x received a gradient through its direct edge but the store has none";
  EXPECT_EQ(vals(x.grad(g)), std::vector<double>(3, 1.0));
}

TEST(JoinGrad, PadEachMode) {
  for (PadMode m : {PadMode::constant, PadMode::reflect, PadMode::replicate}) {
    const std::string name = m == PadMode::constant ? "constant" : m == PadMode::reflect ? "reflect" : "replicate";
    expect_gradcheck("pad 1-d " + name, [m](const TensorList& t) { return pad(t[0], {2, 1}, m, 0.5); },
                     {rnd({4}, 30)});
    expect_gradcheck("pad 2-d " + name, [m](const TensorList& t) { return pad(t[0], {1, 2, 2, 1}, m, 0.0); },
                     {rnd({3, 4}, 31)});
    expect_gradcheck("pad 3-d " + name, [m](const TensorList& t) { return pad(t[0], {1, 1, 0, 2}, m, 0.0); },
                     {rnd({2, 3, 3}, 32)});
    expect_gradcheck("pad with crop " + name, [m](const TensorList& t) { return pad(t[0], {-1, 2, 1, -1}, m, 0.0); },
                     {rnd({3, 5}, 33)});
    expect_gradcheck("pad of a view " + name, [m](const TensorList& t) { return pad(t[0], {2, 0}, m, 0.0); },
                     {rnd({4, 3}, 34).t()});
  }
}

}  // namespace
}  // namespace flame::test
