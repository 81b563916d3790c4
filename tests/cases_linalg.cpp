// Op-table cases for matmul, bmm and outer. The reference is a plain float64 triple loop with
// torch.matmul's shape rules (1-d operands, broadcast batch dims) written out independently.
#include <algorithm>

#include "op_table.h"

namespace flame::test {
namespace {

// torch.matmul over RefTensors: 1-d a is [1, K] (that dim dropped), 1-d b is [K, 1] (dropped).
RefTensor ref_matmul(const RefTensor& a, const RefTensor& b, DType out_dtype) {
  const bool a_vec = a.shape.size() == 1, b_vec = b.shape.size() == 1;
  const Shape as = a_vec ? Shape{1, a.shape[0]} : a.shape;
  const Shape bs = b_vec ? Shape{b.shape[0], 1} : b.shape;
  const int64_t m = as[as.size() - 2], k = as.back(), n = bs.back();
  const Shape ab(as.begin(), as.end() - 2), bb(bs.begin(), bs.end() - 2);
  const std::size_t nb = std::max(ab.size(), bb.size());
  // Broadcast batch shape, and each operand's batch dims right-aligned to it.
  Shape batch(nb, 1), abp(nb, 1), bbp(nb, 1);
  for (std::size_t i = 0; i < ab.size(); ++i) abp[nb - ab.size() + i] = ab[i];
  for (std::size_t i = 0; i < bb.size(); ++i) bbp[nb - bb.size() + i] = bb[i];
  for (std::size_t i = 0; i < nb; ++i) batch[i] = abp[i] == 1 ? bbp[i] : abp[i];
  Shape out_shape = batch;
  if (!a_vec) out_shape.push_back(m);
  if (!b_vec) out_shape.push_back(n);
  RefTensor out(out_shape, out_dtype);
  int64_t nbatch = 1;
  for (int64_t s : batch) nbatch *= s;
  for (int64_t f = 0; f < nbatch; ++f) {
    // Batch multi-index of f, then each operand's flat batch index (size-1 dims broadcast).
    Shape idx(nb);
    int64_t rest = f;
    for (std::size_t d = nb; d-- > 0;) {
      idx[d] = rest % batch[d];
      rest /= batch[d];
    }
    int64_t fa = 0, fb = 0;
    for (std::size_t d = 0; d < nb; ++d) {
      fa = fa * abp[d] + (abp[d] == 1 ? 0 : idx[d]);
      fb = fb * bbp[d] + (bbp[d] == 1 ? 0 : idx[d]);
    }
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0.0;
        for (int64_t p = 0; p < k; ++p) acc += a.v[(fa * m + i) * k + p] * b.v[(fb * k + p) * n + j];
        out.v[(f * m + i) * n + j] = round_to(out_dtype, acc);
      }
    }
  }
  return out;
}

int64_t inner_size(const InputSpec& a) { return a.shape.back(); }

// Tolerances: f32 accumulates K products in float; half types round the result.
void set_tolerance(OpCase& c, DType dt, int64_t k) {
  if (dt == DType::f32) {
    c.rtol = 1e-5;
    c.atol = 2e-6 * static_cast<double>(std::max<int64_t>(k, 1));
  } else if (dt == DType::bf16 || dt == DType::f16) {
    c.rtol = 2e-2;
    c.atol = 2e-2;
  }
}

void add_matmul(CaseList& cases) {
  struct Pair {
    InputSpec a, b;
    std::string extra;
  };
  auto in = [](Shape s, DType dt = DType::f32, Layout l = Layout::contiguous) {
    return InputSpec{std::move(s), dt, l, -1.0, 1.0};
  };
  const Layout T = Layout::transposed, S = Layout::sliced, E = Layout::expanded;
  std::vector<Pair> pairs;
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i64, DType::i32}) {
    InputSpec a = in({3, 4}, dt), b = in({4, 5}, dt);
    if (!is_floating(dt)) a.lo = b.lo = -5, a.hi = b.hi = 5;
    pairs.push_back({a, b, ""});
  }
  const std::vector<Pair> shapes = {
      // 1-d operands.
      {in({7}), in({7}), ""},
      {in({3, 4}), in({4}), ""},
      {in({4}), in({4, 5}), ""},
      {in({4}), in({2, 4, 5}), ""},
      {in({2, 3, 4}), in({4}), ""},
      {in({1}), in({1}), ""},
      // Batched and broadcast batch dims.
      {in({2, 3, 4}), in({2, 4, 5}), ""},
      {in({2, 1, 3, 4}), in({5, 4, 6}), ""},
      {in({3, 4}), in({2, 4, 5}), ""},
      {in({2, 3, 4}), in({4, 5}), ""},
      {in({3, 2, 2, 3, 4}), in({2, 2, 4, 5}), ""},
      {in({1, 3, 4}), in({2, 4, 5}), ""},
      // Transposed, sliced and expanded operands (views, no copies in the op layer).
      {in({3, 4}, DType::f32, T), in({4, 5}), ""},
      {in({3, 4}), in({4, 5}, DType::f32, T), ""},
      {in({3, 4}, DType::f32, T), in({4, 5}, DType::f32, T), ""},
      {in({3, 4}, DType::f32, S), in({4, 5}), ""},
      {in({3, 4}), in({4, 5}, DType::f32, S), ""},
      {in({3, 4}, DType::f32, E), in({4, 5}, DType::f32, E), ""},
      {in({2, 3, 4}, DType::f32, T), in({4, 5}), ""},
      {in({2, 3, 4}, DType::f32, T), in({2, 4, 5}, DType::f32, S), ""},
      {in({2, 3, 4}, DType::f32, E), in({2, 4, 5}, DType::f32, T), ""},
      {in({4}, DType::f32, S), in({4, 5}, DType::f32, T), ""},
      {in({3, 4}, DType::f64, T), in({2, 4, 5}, DType::f64, E), ""},
      {in({3, 4}, DType::bf16, T), in({4, 5}, DType::bf16, S), ""},
      {in({2, 3, 4}, DType::f16, T), in({1, 4, 5}, DType::f16, E), ""},
      // Empty dims: M, N, K (zeros) and batch.
      {in({0, 4}), in({4, 5}), ""},
      {in({3, 0}), in({0, 5}), ""},
      {in({3, 4}), in({4, 0}), ""},
      {in({0}), in({0}), ""},
      {in({0, 3, 4}), in({0, 4, 5}), ""},
      {in({2, 3, 0}), in({0, 5}), ""},
      {in({3, 0}, DType::bf16), in({0, 5}, DType::bf16), ""},
      // Larger than one block of the CPU loops (K > 128, N > 256).
      {in({9, 130}), in({130, 260}), ""},
      {in({5, 130}, DType::bf16), in({130, 260}, DType::bf16, T), ""},
      {in({33, 65}, DType::f64, T), in({65, 17}, DType::f64), ""},
  };
  pairs.insert(pairs.end(), shapes.begin(), shapes.end());
  {
    InputSpec a = in({2, 1, 3, 4}, DType::i64, T), b = in({5, 4, 6}, DType::i64);
    a.lo = b.lo = -5, a.hi = b.hi = 5;
    pairs.push_back({a, b, ""});
  }
  for (const Pair& p : pairs) {
    OpCase c;
    c.name = case_name("matmul", {p.a, p.b}, p.extra);
    c.inputs = {p.a, p.b};
    c.run = [](const TensorList& t) { return matmul(t[0], t[1]); };
    const DType dt = p.a.dtype;
    c.reference = [dt](const std::vector<RefTensor>& r) { return ref_matmul(r[0], r[1], dt); };
    set_tolerance(c, dt, inner_size(p.a));
    c.differentiable = is_floating(dt);
    cases.push_back(std::move(c));
  }
}

void add_bmm(CaseList& cases) {
  auto in = [](Shape s, DType dt = DType::f32, Layout l = Layout::contiguous) {
    return InputSpec{std::move(s), dt, l, -1.0, 1.0};
  };
  const std::vector<std::pair<InputSpec, InputSpec>> pairs = {
      {in({3, 2, 4}), in({3, 4, 5})},
      {in({3, 2, 4}, DType::f64, Layout::transposed), in({3, 4, 5}, DType::f64, Layout::sliced)},
      {in({2, 3, 4}, DType::f32, Layout::expanded), in({2, 4, 5}, DType::f32, Layout::transposed)},
      {in({2, 3, 4}, DType::bf16), in({2, 4, 5}, DType::bf16)},
      {in({0, 3, 4}), in({0, 4, 5})},
      {in({2, 3, 0}), in({2, 0, 5})},
  };
  for (const auto& [a, b] : pairs) {
    OpCase c;
    c.name = case_name("bmm", {a, b});
    c.inputs = {a, b};
    c.run = [](const TensorList& t) { return bmm(t[0], t[1]); };
    const DType dt = a.dtype;
    c.reference = [dt](const std::vector<RefTensor>& r) { return ref_matmul(r[0], r[1], dt); };
    set_tolerance(c, dt, a.shape.back());
    c.differentiable = is_floating(dt);
    cases.push_back(std::move(c));
  }
}

void add_outer(CaseList& cases) {
  const std::vector<std::pair<InputSpec, InputSpec>> pairs = {
      {{{3}, DType::f32}, {{4}, DType::f32}},
      {{{5}, DType::f64, Layout::sliced}, {{2}, DType::f64}},
      {{{3}, DType::i64, Layout::contiguous, -5, 5}, {{4}, DType::i64, Layout::contiguous, -5, 5}},
      {{{0}, DType::f32}, {{4}, DType::f32}},
  };
  for (const auto& [a, b] : pairs) {
    OpCase c;
    c.name = case_name("outer", {a, b});
    c.inputs = {a, b};
    c.run = [](const TensorList& t) { return outer(t[0], t[1]); };
    const DType dt = a.dtype;
    c.reference = [dt](const std::vector<RefTensor>& r) {
      RefTensor out({r[0].shape[0], r[1].shape[0]}, dt);
      for (int64_t i = 0; i < r[0].shape[0]; ++i)
        for (int64_t j = 0; j < r[1].shape[0]; ++j) out.v[i * r[1].shape[0] + j] = round_to(dt, r[0].v[i] * r[1].v[j]);
      return out;
    };
    c.differentiable = is_floating(dt);
    cases.push_back(std::move(c));
  }
}

}  // namespace

void add_linalg_cases(CaseList& cases) {
  add_matmul(cases);
  add_bmm(cases);
  add_outer(cases);
}

}  // namespace flame::test
