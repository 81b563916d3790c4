// libtorch's indexing spellings (issue 26 item 3): x[i], x.index({...}) with ints, Slice, None,
// Ellipsis, bools, bool masks and integer tensors, and x.index_put_({...}, v). Values are checked
// against the closed form of the input (x[i][j][k] = 30 i + 6 j + k) element by element; gradients
// by finite differences (tests/gradcheck.h, f64 on the CPU); the CUDA suite compares with the CPU.
#include <cstdint>
#include <functional>
#include <vector>

#include "gradcheck.h"
#include "test_util.h"

namespace flame::test {
namespace {

using namespace flame::indexing;

// x[i][j][k] = 30 i + 6 j + k, shape [4, 5, 6].
double f(int64_t i, int64_t j, int64_t k) { return static_cast<double>(30 * i + 6 * j + k); }
Tensor grid(Device dev, DType dt = DType::f32) { return Tensor::arange(120, {dt, dev}).view({4, 5, 6}); }

// Python's wrap of a possibly negative index into a dim of size n.
int64_t w(int64_t i, int64_t n) { return i < 0 ? i + n : i; }

// Checks r's shape and every element against want(multi-index).
void expect_values(const Tensor& r, const Shape& shape, const std::function<double(const Shape&)>& want) {
  ASSERT_EQ(r.sizes(), shape);
  const RefTensor ref(shape, DType::f64);
  const std::vector<double> v = r.to_vec<double>();
  for (int64_t e = 0; e < ref.numel(); ++e) {
    const Shape at = ref.unravel(e);
    ASSERT_EQ(v[static_cast<std::size_t>(e)], want(at)) << "at flat element " << e << " of shape " << shape_str(shape);
  }
}

Tensor i64(std::initializer_list<int64_t> v, Device dev) { return Tensor::tensor(v, dev); }
Tensor mask(const std::vector<bool>& v, const Shape& s, Device dev) { return Tensor::from_vec(v, s, dev); }

TEST(IndexApi, BracketSelectsAViewAlongDimZeroAndAssignsThroughIt) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Tensor x = Tensor::arange(24, {DType::f32, dev}).view({4, 6});
  Tensor r = x[1];
  EXPECT_TRUE(r.shares_storage(x));
  expect_values(r, {6}, [](const Shape& a) { return 6.0 + static_cast<double>(a[0]); });
  expect_values(x[-1], {6}, [](const Shape& a) { return 18.0 + static_cast<double>(a[0]); });
  EXPECT_EQ(x[1][2].item<float>(), 8.0f);
  // Assigning to the temporary writes into x, as in libtorch.
  x[1] = Tensor::full({6}, -1.0f, dev);
  x[2] = 5.0;
  x[0][0] = 100;
  const std::vector<float> v = x.to_vec<float>();
  for (int64_t i = 0; i < 24; ++i) {
    const float want = i == 0 ? 100.0f : (i / 6 == 1 ? -1.0f : (i / 6 == 2 ? 5.0f : static_cast<float>(i)));
    EXPECT_EQ(v[static_cast<std::size_t>(i)], want) << i;
  }
  // A named tensor is rebound, not written.
  Tensor named = x[3];
  named = Tensor::zeros({6}, dev);
  EXPECT_EQ(x[3][0].item<float>(), 18.0f);
  expect_error([&] { (void)x[4]; }, {"select", "index 4", "size 4"});
  expect_error([&] { (void)Tensor::scalar(1.0, dev)[0]; }, {"operator[]", "0-d"});
}

TEST(IndexApi, BasicEntriesGiveViewsThatMatchLoops) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor x = grid(test_device());
  Tensor r = x.index({Slice(None, None, 2), -1});
  EXPECT_TRUE(r.shares_storage(x));
  expect_values(r, {2, 6}, [](const Shape& a) { return f(2 * a[0], 4, a[1]); });
  expect_values(x.index({Ellipsis, Slice(-3, None)}), {4, 5, 3},
                [](const Shape& a) { return f(a[0], a[1], 3 + a[2]); });
  expect_values(x.index({None, 0, Slice(1, 4), None}), {1, 3, 1, 6},
                [](const Shape& a) { return f(0, 1 + a[1], a[3]); });
  expect_values(x.index({"...", 2}), {4, 5}, [](const Shape& a) { return f(a[0], a[1], 2); });
  expect_values(x.index({Slice(1, None, 2), Slice(None, -1), Slice(None, None, 4)}), {2, 4, 2},
                [](const Shape& a) { return f(1 + 2 * a[0], a[1], 4 * a[2]); });
  expect_values(x.index({-2, Ellipsis, None}), {5, 6, 1}, [](const Shape& a) { return f(2, a[0], a[1]); });
  EXPECT_EQ(x.index({1, Slice(10, 20)}).sizes(), (Shape{0, 6}));  // out-of-range ends clamp
  EXPECT_EQ(x.index({true}).sizes(), (Shape{1, 4, 5, 6}));
  EXPECT_EQ(x.index({Slice(), false}).sizes(), (Shape{4, 0, 5, 6}));
  EXPECT_TRUE(x.index({}).is_same(x));
}

TEST(IndexApi, IntegerTensorsFollowPyTorchPlacementOfTheIndexedDims) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = grid(dev);
  // One tensor: its shape replaces dim 0.
  const Tensor idx = Tensor::tensor({{0, -1, 2}, {3, 1, -4}}, dev);
  const std::vector<int64_t> iv = {0, -1, 2, 3, 1, -4};
  expect_values(x.index({idx}), {2, 3, 5, 6},
                [&](const Shape& a) { return f(w(iv[a[0] * 3 + a[1]], 4), a[2], a[3]); });
  expect_values(x[idx], {2, 3, 5, 6}, [&](const Shape& a) { return f(w(iv[a[0] * 3 + a[1]], 4), a[2], a[3]); });
  // Adjacent tensors (broadcast [3] with [2, 1] to [2, 3]) keep their place: [4, 2, 3].
  const std::vector<int64_t> v1 = {0, 4, -1}, v2 = {1, -6};
  const Tensor i1 = i64({0, 4, -1}, dev), i2 = Tensor::tensor({{1}, {-6}}, dev);
  expect_values(x.index({Slice(), i1, i2}), {4, 2, 3},
                [&](const Shape& a) { return f(a[0], w(v1[a[2]], 5), w(v2[a[1]], 6)); });
  // Separated by a slice: the broadcast dims go first, [2, 3, 5].
  const std::vector<int64_t> v0 = {3, 0, -2};
  expect_values(x.index({i64({3, 0, -2}, dev), Slice(), i2}), {2, 3, 5},
                [&](const Shape& a) { return f(w(v0[a[1]], 4), a[2], w(v2[a[0]], 6)); });
  // An integer selects first (PyTorch, unlike NumPy): x[1, :, t] is [5, 3].
  const std::vector<int64_t> vt = {5, 0, -1};
  expect_values(x.index({1, Slice(), i64({5, 0, -1}, dev)}), {5, 3},
                [&](const Shape& a) { return f(1, a[0], w(vt[a[1]], 6)); });
  // i32 indices with repeats.
  const Tensor rep = Tensor::tensor({2, 2, 0}, {DType::i32, dev});
  expect_values(x.index({Slice(), Slice(), rep}), {4, 5, 3},
                [&](const Shape& a) { return f(a[0], a[1], a[2] == 2 ? 0 : 2); });
  EXPECT_EQ(x.index({i64({}, dev)}).sizes(), (Shape{0, 5, 6}));
  // A 0-d index tensor indexes like an integer (B = []), as a copy.
  const Tensor r0 = x.index({Slice(), Tensor::scalar(int64_t{-2}, dev)});
  EXPECT_FALSE(r0.shares_storage(x));
  expect_values(r0, {4, 6}, [](const Shape& a) { return f(a[0], 3, a[1]); });
}

TEST(IndexApi, EdgeCasesKeepPyTorchsShapes) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = grid(dev);
  // A mask with no true element selects nothing, in either path.
  EXPECT_EQ(x.index({mask(std::vector<bool>(120, false), {4, 5, 6}, dev)}).sizes(), (Shape{0}));
  EXPECT_EQ(x.index({mask(std::vector<bool>(4, false), {4}, dev)}).sizes(), (Shape{0, 5, 6}));
  Tensor y = x.clone();
  y.index_put_({mask(std::vector<bool>(4, false), {4}, dev)}, Tensor::ones({5, 6}, dev));
  EXPECT_TRUE(same_bits(y, x, "an empty mask writes nothing"));
  // A 0-d tensor: None adds a dim, Ellipsis and {} keep it, an integer is one index too many.
  const Tensor s = Tensor::scalar(3.0, dev);
  EXPECT_EQ(s.index({None}).sizes(), (Shape{1}));
  EXPECT_EQ(s.index({Ellipsis}).sizes(), (Shape{}));
  EXPECT_EQ(s.index({Ellipsis, None, None}).sizes(), (Shape{1, 1}));
  expect_error([&] { (void)s.index({0}); }, {"too many indices", "0 dims"});
  // Slices with steps past the end, and a negative start beyond the size, clamp as Python's.
  expect_values(x.index({Slice(-10, None, 3)}), {2, 5, 6}, [](const Shape& a) { return f(3 * a[0], a[1], a[2]); });
}

TEST(IndexApi, BoolMasksSelectTheTrueElementsInRowMajorOrder) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = grid(dev);
  std::vector<bool> m(120);
  std::vector<double> want;
  for (int64_t e = 0; e < 120; ++e) {
    m[static_cast<std::size_t>(e)] = e % 7 == 3;
    if (e % 7 == 3) want.push_back(static_cast<double>(e));
  }
  const Tensor full = x.index({mask(m, {4, 5, 6}, dev)});
  EXPECT_EQ(full.to_vec<double>(), want);
  EXPECT_EQ(x[mask(m, {4, 5, 6}, dev)].to_vec<double>(), want);  // x[mask], as libtorch
  // A mask over the leading dim: rows 0, 2, 3.
  const Tensor m4 = mask({true, false, true, true}, {4}, dev);
  const std::vector<int64_t> rows = {0, 2, 3};
  expect_values(x.index({m4}), {3, 5, 6}, [&](const Shape& a) { return f(rows[a[0]], a[1], a[2]); });
  // A mask over dim 1.
  const std::vector<int64_t> cols = {1, 3, 4};
  expect_values(x.index({Slice(), mask({false, true, false, true, true}, {5}, dev)}), {4, 3, 6},
                [&](const Shape& a) { return f(a[0], cols[a[1]], a[2]); });
  // A 2-d mask after an integer: the true (j, k) of row 2.
  std::vector<bool> m56(30);
  std::vector<std::pair<int64_t, int64_t>> jk;
  for (int64_t j = 0; j < 5; ++j) {
    for (int64_t k = 0; k < 6; ++k) {
      const bool on = (j + 2 * k) % 5 == 1;
      m56[static_cast<std::size_t>(j * 6 + k)] = on;
      if (on) jk.emplace_back(j, k);
    }
  }
  expect_values(x.index({2, mask(m56, {5, 6}, dev)}), {static_cast<int64_t>(jk.size())},
                [&](const Shape& a) { return f(2, jk[a[0]].first, jk[a[0]].second); });
  // A 0-d mask adds a dim.
  EXPECT_EQ(x.index({Tensor::scalar(true, dev)}).sizes(), (Shape{1, 4, 5, 6}));
  EXPECT_EQ(x.index({Tensor::scalar(false, dev)}).sizes(), (Shape{0, 4, 5, 6}));
  // A mask with an integer tensor, apart: the mask's 3 rows pair with the 3 indices, [3, 5].
  const std::vector<int64_t> ks = {5, -1, 0};
  expect_values(x.index({m4, Slice(), i64({5, -1, 0}, dev)}), {3, 5},
                [&](const Shape& a) { return f(rows[a[0]], a[1], w(ks[a[0]], 6)); });
}

TEST(IndexApi, BadIndexListsRaiseNamingTheProblem) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  const Tensor x = grid(dev);
  expect_error([&] { (void)x.index({4}); }, {"index", "index 4 is out of bounds for dim 0 with size 4"});
  expect_error([&] { (void)x.index({0, -6}); }, {"index -6 is out of bounds for dim 1 with size 5"});
  expect_error([&] { (void)x.index({0, 0, 0, 0}); }, {"too many indices", "3 dims", "indexes 4 dims"});
  expect_error([&] { (void)x.index({Ellipsis, "...", 0}); }, {"at most one Ellipsis"});
  expect_error([&] { (void)x.index({Slice(0, 2, 0)}); }, {"step must be positive, got 0"});
  expect_error([&] { (void)x.index({Slice(0, 2, -1)}); }, {"step must be positive, got -1"});
  expect_error([&] { (void)x.index({Tensor::tensor({1.5}, dev)}); }, {"must be i64, i32 or bool, got f32"});
  expect_error([&] { (void)x.index({mask({true, false, true}, {3}, dev)}); },
               {"mask of shape [3] does not match dim 0", "size 3 vs 4"});
  expect_error([&] { (void)x.index({Tensor()}); }, {"index tensor is undefined"});
  expect_error([] { TensorIndex bad("..x"); }, {"must be \"...\"", "..x"});
  if (dev.is_cpu()) {  // CUDA reports on the next synchronisation (IndexApiCuda)
    expect_error([&] { (void)x.index({Slice(), i64({0, 5}, dev)}); }, {"index 5 is out of bounds", "size 5"});
    expect_error([&] { (void)x.index({i64({-5}, dev)}); }, {"index -5 is out of bounds", "size 4"});
  }
}

TEST(IndexApi, IndexPutWritesExactlyTheIndexedElements) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  auto fresh = [&] { return grid(dev).clone(); };
  {  // basic entries, a scalar
    Tensor y = fresh();
    Tensor& ret = y.index_put_({Slice(), 1}, -1.0);
    EXPECT_TRUE(ret.is_same(y));
    expect_values(y, {4, 5, 6}, [](const Shape& a) { return a[1] == 1 ? -1.0 : f(a[0], a[1], a[2]); });
  }
  {  // basic entries, a broadcast tensor [1, 2] into [5, 2]
    Tensor y = fresh();
    y.index_put_({0, Slice(), Slice(0, 2)}, Tensor::tensor({{7.0f, 8.0f}}, dev));
    expect_values(y, {4, 5, 6}, [](const Shape& a) {
      return a[0] == 0 && a[2] < 2 ? 7.0 + static_cast<double>(a[2]) : f(a[0], a[1], a[2]);
    });
  }
  std::vector<bool> m(120);
  for (int64_t e = 0; e < 120; ++e) m[static_cast<std::size_t>(e)] = e % 4 == 1;
  {  // a full mask, a scalar (the where path)
    Tensor y = fresh();
    y.index_put_({mask(m, {4, 5, 6}, dev)}, 0.5);
    const RefTensor ref({4, 5, 6}, DType::f64);
    expect_values(y, {4, 5, 6}, [&](const Shape& a) {
      return m[static_cast<std::size_t>(ref.flat(a))] ? 0.5 : f(a[0], a[1], a[2]);
    });
  }
  {  // a full mask, one value per true element (the scatter path)
    Tensor y = fresh();
    Tensor vals = Tensor::arange(30, {DType::f32, dev}).neg();
    y.index_put_({mask(m, {4, 5, 6}, dev)}, vals);
    int64_t n = 0;
    std::vector<double> want(120);
    for (int64_t e = 0; e < 120; ++e) want[static_cast<std::size_t>(e)] = m[static_cast<std::size_t>(e)] ? -static_cast<double>(n++) : static_cast<double>(e);
    EXPECT_EQ(y.to_vec<double>(), want);
  }
  {  // a leading mask and a scalar
    Tensor y = fresh();
    y.index_put_({mask({false, true, true, false}, {4}, dev)}, 3);
    expect_values(y, {4, 5, 6}, [](const Shape& a) { return a[0] == 1 || a[0] == 2 ? 3.0 : f(a[0], a[1], a[2]); });
  }
  const Tensor i2 = Tensor::tensor({{1}, {-6}}, dev);  // rows of B: dim 2 at 1 and 0
  const std::vector<int64_t> v2 = {1, 0};
  {  // apart: values shaped [B = 2, 3, 5]
    Tensor y = fresh();
    const std::vector<int64_t> v0 = {3, 0, 2};
    Tensor vals = Tensor::arange(30, {DType::f32, dev}).view({2, 3, 5}).add_scalar(1000);
    y.index_put_({i64({3, 0, -2}, dev), Slice(), i2}, vals);
    expect_values(y, {4, 5, 6}, [&](const Shape& a) {
      for (int64_t p = 0; p < 2; ++p)
        for (int64_t q = 0; q < 3; ++q)
          if (a[0] == v0[q] && a[2] == v2[p]) return 1000.0 + static_cast<double>((p * 3 + q) * 5 + a[1]);
      return f(a[0], a[1], a[2]);
    });
  }
  {  // adjacent: values shaped [4, B = 2, 3], given as f64 (converted)
    Tensor y = fresh();
    const std::vector<int64_t> v1 = {0, 4, 2};
    Tensor vals = Tensor::arange(24, {DType::f64, dev}).view({4, 2, 3}).add_scalar(2000);
    y.index_put_({Slice(), i64({0, -1, 2}, dev), i2}, vals);
    EXPECT_EQ(y.dtype(), DType::f32);
    expect_values(y, {4, 5, 6}, [&](const Shape& a) {
      for (int64_t p = 0; p < 2; ++p)
        for (int64_t q = 0; q < 3; ++q)
          if (a[1] == v1[q] && a[2] == v2[p]) return 2000.0 + static_cast<double>((a[0] * 2 + p) * 3 + q);
      return f(a[0], a[1], a[2]);
    });
  }
  {  // an integer tensor destination, a broadcast value over a mask on dim 1
    Tensor y = Tensor::zeros({2, 3}, {DType::i64, dev});
    y.index_put_({Slice(), mask({true, false, true}, {3}, dev)}, i64({4, 9}, dev));
    EXPECT_EQ(y.to_vec<int64_t>(), (std::vector<int64_t>{4, 0, 9, 4, 0, 9}));
  }
  expect_error([&] { fresh().index_put_({0}, Tensor()); }, {"index_put_", "undefined"});
  expect_error([&] { fresh().index_put_({Slice(), 1}, Tensor::ones({5}, dev)); },
               {"index_put_", "value of shape [5] cannot be broadcast to the indexed shape [4, 6]"});
  expect_error([&] { fresh().index_put_({i64({0, 1, 2}, dev)}, Tensor::ones({2, 5, 6}, dev)); },
               {"index_put_", "value of shape [2, 5, 6] cannot be broadcast to the indexed shape [3, 5, 6]"});
  {  // a leading size-1 dim of the value is dropped, as PyTorch
    Tensor y = fresh();
    y.index_put_({1, 2}, Tensor::full({1, 6}, 9.0f, dev));
    expect_values(y, {4, 5, 6}, [](const Shape& a) { return a[0] == 1 && a[1] == 2 ? 9.0 : f(a[0], a[1], a[2]); });
  }
}

// Finite differences on f64 CPU inputs: reads and writes of every kind.
TEST(IndexApi, GradientsMatchFiniteDifferences) {
  const Device cpu = Device::cpu();
  Generator gen(11);
  const Tensor x = Tensor::randn({4, 5, 3}, 0.0, 1.0, {DType::f64, cpu}, &gen);
  const Tensor dup = i64({0, 2, 0, -1}, cpu);
  const Tensor i1 = i64({0, 4, -1}, cpu), i2 = Tensor::tensor({{1}, {-3}}, cpu);
  std::vector<bool> m(60);
  for (int64_t e = 0; e < 60; ++e) m[static_cast<std::size_t>(e)] = e % 3 != 1;
  const Tensor mk = mask(m, {4, 5, 3}, cpu);
  const Tensor m4 = mask({true, false, true, true}, {4}, cpu);
  struct Case {
    const char* name;
    std::function<Tensor(const TensorList&)> fn;
    TensorList inputs;
  };
  const std::vector<Case> cases = {
      {"basic read", [](const TensorList& in) { return in[0].index({Slice(1, None), -1, None}); }, {x}},
      {"repeated rows", [&](const TensorList& in) { return in[0].index({dup}); }, {x}},
      {"adjacent tensors", [&](const TensorList& in) { return in[0].index({Slice(), i1, i2}); }, {x}},
      {"apart tensors", [&](const TensorList& in) { return in[0].index({i64({3, 0, -2}, cpu), Slice(), i2}); }, {x}},
      {"full mask", [&](const TensorList& in) { return in[0].index({mk}); }, {x}},
      {"leading mask", [&](const TensorList& in) { return in[0].index({m4, 1}); }, {x}},
      {"put basic",
       [](const TensorList& in) {
         Tensor y = in[0] * 1.0;
         y.index_put_({Slice(), 1}, in[1]);
         return y * y;
       },
       {x, Tensor::randn({4, 3}, 0.0, 1.0, {DType::f64, cpu}, &gen)}},
      {"put apart",
       [&](const TensorList& in) {
         Tensor y = in[0] * 1.0;
         y.index_put_({i64({3, 0, -2}, cpu), Slice(), i2}, in[1]);
         return y * y;
       },
       {x, Tensor::randn({2, 3, 5}, 0.0, 1.0, {DType::f64, cpu}, &gen)}},
      {"put adjacent broadcast",
       [&](const TensorList& in) {
         Tensor y = in[0] * 1.0;
         // in[1] [3] broadcasts to [4, 2, 3]; the six (i1, i2) pairs are distinct (with a repeat,
         // which of the written values survives is not differentiable, as in PyTorch)
         y.index_put_({Slice(), i64({0, 4, 2}, cpu), i2}, in[1]);
         return y.exp();
       },
       {x, Tensor::randn({3}, 0.0, 1.0, {DType::f64, cpu}, &gen)}},
      {"put mask scalar",
       [&](const TensorList& in) {
         Tensor y = in[0] * 1.0;
         y.index_put_({mk}, 0.25);
         return y * y;
       },
       {x}},
      {"put mask one value",
       [&](const TensorList& in) {
         Tensor y = in[0] * 1.0;
         y.index_put_({m4}, in[1]);
         return y * y;
       },
       {x, Tensor::randn({1}, 0.0, 1.0, {DType::f64, cpu}, &gen)}},
  };
  for (const Case& c : cases) {
    const GradcheckResult r = gradcheck(c.fn, c.inputs);
    EXPECT_TRUE(r.ok) << c.name << ": " << r.message;
  }
}

// The same lists on CUDA (CPU index tensors included) against the CPU, values and gradients; a
// bad index, also one that a merged index would have hidden, is reported at the next read.
TEST(IndexApiCuda, MatchesTheCpuAndReportsBadIndices) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device cpu = Device::cpu(), gpu = Device::cuda();
  Generator gen(5);
  const Tensor x = Tensor::randn({4, 5, 6}, 0.0, 1.0, {DType::f32, cpu}, &gen);
  std::vector<bool> m(120);
  for (int64_t e = 0; e < 120; ++e) m[static_cast<std::size_t>(e)] = e % 5 < 2;
  auto lists = [&](Device d) {
    const Tensor i1 = i64({0, 4, -1}, d), i2 = Tensor::tensor({{1}, {-6}}, d);
    return std::vector<std::vector<TensorIndex>>{
        {1, Slice(None, None, 2), None},
        {Slice(), i1, i2},
        {i64({3, 0, -2}, d), Slice(), i2},
        {mask(m, {4, 5, 6}, d)},
        {mask({true, false, true, true}, {4}, d), Slice(1, 3)},
        {Ellipsis, i64({5, 5, 0}, cpu)},  // CPU indices for either tensor
    };
  };
  const auto lc = lists(cpu), lg = lists(gpu);
  for (std::size_t c = 0; c < lc.size(); ++c) {
    Tensor xc = x.detach().requires_grad_(true), xg = x.to(gpu).requires_grad_(true);
    Tensor yc = xc.index(lc[c]), yg = xg.index(lg[c]);
    EXPECT_TRUE(same_bits(yg.to(cpu), yc, "index case " + std::to_string(c)));
    Gradients gc = (yc * yc).sum().backward(), gg = (yg * yg).sum().backward();
    EXPECT_TRUE(all_close(gg.get(xg).to(cpu), gc.get(xc), 1e-6, 1e-6)) << "gradient, case " << c;
    Tensor pc = x.clone(), pg = x.to(gpu);
    pc.index_put_(lc[c], -2.5);
    pg.index_put_(lg[c], -2.5);
    EXPECT_TRUE(same_bits(pg.to(cpu), pc, "index_put_ case " + std::to_string(c)));
  }
  const Tensor xg = x.to(gpu);
  expect_error([&] { (void)xg.index({Slice(), i64({0, 5}, gpu)}).to(cpu); }, {"index_select", "5"});
  // (1, 6) would merge to 1 * 6 + 6 = 12, in range for the merged [5 * 6] dim: still an error.
  expect_error([&] { (void)xg.index({0, i64({1, 1}, gpu), i64({0, 6}, gpu)}).to(cpu); }, {"index_select"});
  Tensor yg = xg.clone();
  expect_error([&] {
    yg.index_put_({i64({0, 9}, gpu)}, 1.0);
    (void)yg.to(cpu);
  }, {"scatter"});
}

}  // namespace
}  // namespace flame::test
