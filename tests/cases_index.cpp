// Op-table cases for the indexing family: index_select, gather, scatter, scatter_add,
// masked_select, take, triu/tril, one_hot, embedding, sort/argsort, topk. References are float64
// loops over row-major values; they never call the code under test.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "op_table.h"

namespace flame::test {
namespace {


const std::vector<DType> kAll = {DType::f32, DType::f64, DType::bf16, DType::f16,
                                 DType::i32, DType::i64, DType::u8,   DType::boolean};

// A data input with a value range that suits its dtype.
InputSpec data(Shape s, DType dt = DType::f32, Layout l = Layout::contiguous) {
  InputSpec sp{std::move(s), dt, l};
  if (dt == DType::u8) sp.lo = 0, sp.hi = 200;
  if (dt == DType::i32 || dt == DType::i64) sp.lo = -1000, sp.hi = 1000;
  return sp;
}
// An index input with values in [lo, hi).
InputSpec idx(Shape s, int64_t lo, int64_t hi, DType dt = DType::i64, Layout l = Layout::contiguous) {
  return InputSpec{std::move(s), dt, l, static_cast<double>(lo), static_cast<double>(hi)};
}
InputSpec mask(Shape s, Layout l = Layout::contiguous) { return InputSpec{std::move(s), DType::boolean, l}; }


int64_t wrap(int64_t d, std::size_t ndim) { return d < 0 ? d + static_cast<int64_t>(std::max<std::size_t>(ndim, 1)) : d; }

// ---- references ----

RefTensor ref_index_select(const RefTensor& x, int64_t dim, const RefTensor& index) {
  dim = wrap(dim, x.shape.size());
  Shape shape = x.shape;
  if (!shape.empty()) shape[dim] = index.numel();
  RefTensor out(shape, x.dtype);
  for (int64_t f = 0; f < out.numel(); ++f) {
    Shape p = out.unravel(f);
    if (!p.empty()) p[dim] = static_cast<int64_t>(index.v[p[dim]]);
    out.v[f] = x.v[x.flat(p)];
  }
  return out;
}

// A multi-index of a (possibly 0-d) index tensor as a multi-index of an n-dim tensor: a 0-d
// index may pair with a 1-d input, where it names element 0.
Shape as_ndim(Shape p, std::size_t n) { return p.size() == n ? p : Shape(n, 0); }

RefTensor ref_gather(const RefTensor& x, int64_t dim, const RefTensor& index) {
  dim = wrap(dim, x.shape.size());
  RefTensor out(index.shape, x.dtype);
  for (int64_t f = 0; f < out.numel(); ++f) {
    Shape p = as_ndim(index.unravel(f), x.shape.size());
    if (!p.empty()) p[dim] = static_cast<int64_t>(index.v[f]);
    out.v[f] = x.v[x.flat(p)];
  }
  return out;
}

// In row-major order of the index; the last write wins, as the CPU kernel documents.
RefTensor ref_scatter(const RefTensor& x, int64_t dim, const RefTensor& index, const RefTensor& src, bool add) {
  dim = wrap(dim, x.shape.size());
  RefTensor out = x;
  for (int64_t f = 0; f < index.numel(); ++f) {
    const Shape p = index.unravel(f);
    Shape q = as_ndim(p, x.shape.size());
    if (!q.empty()) q[dim] = static_cast<int64_t>(index.v[f]);
    const double s = src.v[src.flat(as_ndim(p, src.shape.size()))];
    double& d = out.v[x.flat(q)];
    d = add ? round_to(x.dtype, d + s) : s;
  }
  return out;
}

// Element of `in` (broadcast to `shape`) at multi-index p of `shape`.
double bcast_at(const RefTensor& in, const Shape& shape, const Shape& p) {
  const std::size_t off = shape.size() - in.shape.size();
  int64_t f = 0;
  for (std::size_t d = 0; d < in.shape.size(); ++d) f = f * in.shape[d] + (in.shape[d] == 1 ? 0 : p[d + off]);
  return in.v[f];
}

RefTensor ref_masked_select(const RefTensor& x, const RefTensor& m) {
  const std::size_t n = std::max(x.shape.size(), m.shape.size());
  Shape shape(n);
  for (std::size_t i = 0; i < n; ++i) {
    const int64_t a = i < n - x.shape.size() ? 1 : x.shape[i - (n - x.shape.size())];
    const int64_t b = i < n - m.shape.size() ? 1 : m.shape[i - (n - m.shape.size())];
    shape[i] = a == 1 ? b : a;
  }
  RefTensor grid(shape, x.dtype);
  std::vector<double> picked;
  for (int64_t f = 0; f < grid.numel(); ++f) {
    const Shape p = grid.unravel(f);
    if (bcast_at(m, shape, p) != 0) picked.push_back(bcast_at(x, shape, p));
  }
  RefTensor out({static_cast<int64_t>(picked.size())}, x.dtype);
  out.v = picked;
  return out;
}

RefTensor ref_take(const RefTensor& x, const RefTensor& index) {
  RefTensor out(index.shape, x.dtype);
  for (int64_t f = 0; f < out.numel(); ++f) {
    int64_t i = static_cast<int64_t>(index.v[f]);
    if (i < 0) i += x.numel();
    out.v[f] = x.v[i];
  }
  return out;
}

RefTensor ref_triangle(const RefTensor& x, int64_t diagonal, bool upper) {
  RefTensor out(x.shape, x.dtype);
  const std::size_t nd = x.shape.size();
  for (int64_t f = 0; f < out.numel(); ++f) {
    const Shape p = x.unravel(f);
    const int64_t off = p[nd - 1] - p[nd - 2];
    const bool keep = upper ? off >= diagonal : off <= diagonal;
    out.v[f] = keep ? x.v[f] : 0.0;
  }
  return out;
}

RefTensor ref_one_hot(const RefTensor& index, int64_t classes) {
  if (classes < 0) {
    classes = 0;
    for (double v : index.v) classes = std::max<int64_t>(classes, static_cast<int64_t>(v) + 1);
  }
  Shape shape = index.shape;
  shape.push_back(classes);
  RefTensor out(shape, DType::i64);
  for (int64_t f = 0; f < index.numel(); ++f) out.v[f * classes + static_cast<int64_t>(index.v[f])] = 1.0;
  return out;
}

RefTensor ref_embedding(const RefTensor& w, const RefTensor& index) {
  const int64_t d = w.shape[1];
  Shape shape = index.shape;
  shape.push_back(d);
  RefTensor out(shape, w.dtype);
  for (int64_t f = 0; f < index.numel(); ++f)
    for (int64_t j = 0; j < d; ++j) out.v[f * d + j] = w.v[static_cast<int64_t>(index.v[f]) * d + j];
  return out;
}

// Stable sort of every slice along dim (NaN largest), keeping the first k of each; returns the
// values or the indices.
RefTensor ref_sort(const RefTensor& x, int64_t dim, bool descending, bool want_indices, int64_t k = -1) {
  if (x.shape.empty()) {  // 0-d: the element itself, index 0
    RefTensor out({}, want_indices ? DType::i64 : x.dtype);
    out.v[0] = want_indices ? 0.0 : x.v[0];
    return out;
  }
  dim = wrap(dim, x.shape.size());
  const int64_t n = x.shape[dim];
  if (k < 0) k = n;
  Shape shape = x.shape;
  shape[dim] = k;
  RefTensor out(shape, want_indices ? DType::i64 : x.dtype);
  auto before = [descending](double a, double b) {
    const bool na = std::isnan(a), nb = std::isnan(b);
    if (descending) return na ? !nb : (!nb && a > b);
    return nb ? !na : (!na && a < b);
  };
  for (int64_t f = 0; f < out.numel(); ++f) {
    Shape p = out.unravel(f);
    if (p[dim] != 0) continue;  // one pass per slice, started at its first element
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    auto value = [&](int64_t j) {
      Shape q = p;
      q[dim] = j;
      return x.v[x.flat(q)];
    };
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return before(value(a), value(b)); });
    for (int64_t j = 0; j < k; ++j) {
      Shape q = p;
      q[dim] = j;
      out.v[out.flat(q)] = want_indices ? static_cast<double>(order[j]) : value(order[j]);
    }
  }
  return out;
}

// ---- cases ----

void add_index_select(CaseList& cases) {
  auto one = [&](InputSpec x, int64_t dim, InputSpec i) {
    const bool diff = is_floating(x.dtype);
    add_case(cases, "index_select", {x, i}, dim_tag(dim),
        [dim](const TensorList& t) { return t[0].index_select(dim, t[1]); },
        [dim](const std::vector<RefTensor>& r) { return ref_index_select(r[0], dim, r[1]); }, diff);
  };
  for (DType dt : kAll) one(data({5, 7}, dt), 0, idx({4}, 0, 5));
  one(data({5, 7}), 1, idx({9}, 0, 7, DType::i32));  // repeats, longer than the dim
  one(data({3, 4, 6}, DType::f64), -1, idx({5}, 0, 6));
  one(data({3, 4, 6}), 1, idx({2}, 0, 4));
  one(data({6, 5}, DType::f32, Layout::transposed), 0, idx({3}, 0, 6));
  one(data({6, 5}, DType::bf16, Layout::transposed), -1, idx({4}, 0, 5));
  one(data({4, 5}, DType::f32, Layout::sliced), 1, idx({6}, 0, 5));
  one(data({4, 5}, DType::i64, Layout::expanded), 0, idx({3}, 0, 4));
  one(data({4, 5}, DType::f32, Layout::expanded), 1, idx({7}, 0, 5));
  one(data({5, 3}), 0, idx({}, 0, 5));   // 0-d index keeps the dim (size 1)
  one(data({}), 0, idx({1}, 0, 1));      // 0-d input
  one(data({5, 0}), 0, idx({3}, 0, 5));  // empty result
  one(data({5, 3}), 0, idx({0}, 0, 5));  // empty index
  one(data({2, 3, 17}, DType::f16), 2, idx({11}, 0, 17));
}

void add_gather(CaseList& cases) {
  auto one = [&](InputSpec x, int64_t dim, InputSpec i) {
    const bool diff = is_floating(x.dtype);
    add_case(cases, "gather", {x, i}, dim_tag(dim), [dim](const TensorList& t) { return t[0].gather(dim, t[1]); },
        [dim](const std::vector<RefTensor>& r) { return ref_gather(r[0], dim, r[1]); }, diff);
  };
  for (DType dt : kAll) one(data({4, 6}, dt), 1, idx({4, 3}, 0, 6));
  one(data({4, 6}), 0, idx({7, 5}, 0, 4));  // index longer than the input along dim
  one(data({3, 4, 5}, DType::f64), -1, idx({2, 4, 7}, 0, 5));
  one(data({3, 4, 5}), 1, idx({3, 2, 5}, 0, 4, DType::i32));
  one(data({5, 6}, DType::f32, Layout::transposed), 1, idx({4, 6}, 0, 6));
  one(data({5, 6}, DType::bf16, Layout::transposed), 0, idx({5, 2}, 0, 5));
  one(data({4, 5}, DType::f32, Layout::sliced), -1, idx({4, 3}, 0, 5));
  one(data({4, 5}, DType::f32, Layout::expanded), 0, idx({2, 5}, 0, 4));
  one(data({4, 5}), 1, idx({4, 5}, 0, 5, DType::i64, Layout::transposed));  // strided index
  one(data({4, 5}), 0, idx({0, 3}, 0, 4));                                   // empty index
  one(data({}), 0, idx({}, 0, 1));                                           // 0-d
  one(data({5}, DType::f64), 0, idx({}, 0, 5));                              // 0-d index into 1-d
}

void add_scatter(CaseList& cases) {
  // Plain scatter: index.size(dim) == 1 so no two entries share a destination, and the result does
  // not depend on which duplicate wins (unspecified on CUDA). scatter_add: duplicates on purpose.
  auto one = [&](bool accumulate, InputSpec x, int64_t dim, InputSpec i, InputSpec s) {
    const bool diff = is_floating(x.dtype);
    add_case(cases, accumulate ? "scatter_add" : "scatter", {x, i, s}, dim_tag(dim),
        [dim, accumulate](const TensorList& t) {
          return accumulate ? t[0].scatter_add(dim, t[1], t[2]) : t[0].scatter(dim, t[1], t[2]);
        },
        [dim, accumulate](const std::vector<RefTensor>& r) { return ref_scatter(r[0], dim, r[1], r[2], accumulate); },
        diff);
  };
  for (DType dt : kAll) {
    one(false, data({5, 4}, dt), 0, idx({1, 4}, 0, 5), data({2, 4}, dt));
    one(true, data({5, 4}, dt), 0, idx({6, 4}, 0, 5), data({6, 4}, dt));
  }
  one(false, data({4, 6}), 1, idx({3, 1}, 0, 6), data({3, 2}));
  one(false, data({2, 3, 5}, DType::f64), -1, idx({2, 3, 1}, 0, 5), data({2, 3, 1}, DType::f64));
  one(false, data({4, 5}, DType::f32, Layout::transposed), 0, idx({1, 5}, 0, 4, DType::i32),
      data({3, 5}, DType::f32, Layout::transposed));
  one(false, data({4, 5}, DType::f32, Layout::expanded), 1, idx({4, 1}, 0, 5), data({4, 3}, DType::f32, Layout::sliced));
  one(false, data({}), 0, idx({}, 0, 1), data({}));
  one(false, data({4, 3}), 0, idx({0, 3}, 0, 4), data({2, 3}));
  one(true, data({4, 6}), 1, idx({3, 9}, 0, 6, DType::i32), data({4, 9}));
  one(true, data({3, 4, 5}, DType::f64), -2, idx({3, 7, 5}, 0, 4), data({3, 7, 5}, DType::f64));
  one(true, data({5, 4}, DType::bf16, Layout::transposed), 0, idx({6, 4}, 0, 5),
      data({6, 4}, DType::bf16, Layout::transposed));
  one(true, data({5, 4}, DType::f32, Layout::sliced), 1, idx({5, 6}, 0, 4), data({5, 6}, DType::f32, Layout::expanded));
  one(true, data({5, 0}), 0, idx({2, 0}, 0, 5), data({2, 0}));
  one(true, data({}, DType::i64), 0, idx({}, 0, 1), data({}, DType::i64));

  // Several entries per column with distinct destinations: the index is a column-wise permutation
  // (argsort of random keys), narrowed to 4 of 6 rows.
  for (DType dt : {DType::f32, DType::i32}) {
    std::vector<InputSpec> in = {data({6, 3}, dt), data({6, 3}, DType::f64), data({5, 3}, dt)};
    add_case(cases, "scatter", in, "permutation",
        [](const TensorList& t) { return t[0].scatter(0, t[1].argsort(0).narrow(0, 0, 4), t[2]); },
        [](const std::vector<RefTensor>& r) {
          RefTensor order = ref_sort(r[1], 0, false, true);
          RefTensor index({4, 3}, DType::i64);
          for (int64_t i = 0; i < 4 * 3; ++i) index.v[i] = order.v[i];
          return ref_scatter(r[0], 0, index, r[2], false);
        },
        is_floating(dt));
  }
}

void add_masked_select(CaseList& cases) {
  auto one = [&](InputSpec x, InputSpec m) {
    const bool diff = is_floating(x.dtype);
    add_case(cases, "masked_select", {x, m}, "", [](const TensorList& t) { return t[0].masked_select(t[1]); },
        [](const std::vector<RefTensor>& r) { return ref_masked_select(r[0], r[1]); }, diff);
  };
  for (DType dt : kAll) one(data({4, 5}, dt), mask({4, 5}));
  one(data({4, 5}), mask({5}));
  one(data({4, 5}, DType::f64), mask({4, 1}));
  one(data({1, 5}), mask({3, 1}));  // both broadcast
  one(data({5, 4}, DType::f32, Layout::transposed), mask({5, 4}));
  one(data({3, 6}, DType::bf16, Layout::sliced), mask({6}, Layout::sliced));
  one(data({3, 4}, DType::i64, Layout::expanded), mask({3, 4}, Layout::transposed));
  one(data({2, 3, 7}), mask({2, 1, 7}));
  one(data({0, 5}), mask({5}));
  one(data({}), mask({}));
  one(data({6}), mask({}));
}

void add_take(CaseList& cases) {
  auto one = [&](InputSpec x, InputSpec i) {
    const bool diff = is_floating(x.dtype);
    add_case(cases, "take", {x, i}, "", [](const TensorList& t) { return t[0].take(t[1]); },
        [](const std::vector<RefTensor>& r) { return ref_take(r[0], r[1]); }, diff);
  };
  for (DType dt : kAll) one(data({4, 5}, dt), idx({3, 2}, -20, 20));
  one(data({4, 5}, DType::f32, Layout::transposed), idx({7}, -20, 20, DType::i32));
  one(data({4, 5}, DType::f64, Layout::sliced), idx({2, 2, 3}, -20, 20));
  one(data({3, 4}, DType::f32, Layout::expanded), idx({5, 3}, -12, 12, DType::i64, Layout::transposed));
  one(data({4, 5}), idx({}, -20, 20));
  one(data({}), idx({3}, -1, 1));
  one(data({4, 5}), idx({0}, 0, 20));
  one(data({3, 0}), idx({0, 2}, 0, 1));
}

void add_triangles(CaseList& cases) {
  auto one = [&](bool upper, InputSpec x, int64_t diagonal) {
    const bool diff = is_floating(x.dtype);
    const std::string extra = diagonal < 0 ? "diagm" + std::to_string(-diagonal) : "diag" + std::to_string(diagonal);
    add_case(cases, upper ? "triu" : "tril", {x}, extra,
        [upper, diagonal](const TensorList& t) { return upper ? t[0].triu(diagonal) : t[0].tril(diagonal); },
        [upper, diagonal](const std::vector<RefTensor>& r) { return ref_triangle(r[0], diagonal, upper); }, diff);
  };
  for (bool upper : {true, false}) {
    for (int64_t diagonal : {0, 1, -2, 10, -10}) one(upper, data({5, 7}), diagonal);
    for (DType dt : kAll) {
      if (dt != DType::f32) one(upper, data({6, 4}, dt), upper ? 1 : -1);
    }
    one(upper, data({3, 4, 6}, DType::f64), -1);
    one(upper, data({2, 3, 5, 4}), 2);
    one(upper, data({6, 5}, DType::f32, Layout::transposed), 0);
    one(upper, data({4, 5}, DType::bf16, Layout::sliced), 1);
    one(upper, data({3, 4, 5}, DType::f32, Layout::expanded), -1);
    one(upper, data({0, 3}), 0);
    one(upper, data({3, 0}), 0);
    one(upper, data({2, 0, 4}), 1);
    one(upper, data({7, 3}, DType::f64), 0);
  }
}

void add_one_hot(CaseList& cases) {
  auto one = [&](InputSpec i, int64_t classes) {
    add_case(cases, "one_hot", {i}, classes < 0 ? "infer" : "c" + std::to_string(classes),
        [classes](const TensorList& t) { return one_hot(t[0], classes); },
        [classes](const std::vector<RefTensor>& r) { return ref_one_hot(r[0], classes); }, false);
  };
  one(idx({6}, 0, 5), 5);
  one(idx({2, 3}, 0, 4), -1);
  one(idx({}, 0, 3), 3);
  one(idx({0}, 0, 4), 4);
  one(idx({5}, 0, 7, DType::i32), 9);
  one(idx({3, 4}, 0, 6, DType::i64, Layout::transposed), 6);
  one(idx({2, 3, 5}, 0, 12), -1);
}

void add_embedding(CaseList& cases) {
  auto one = [&](InputSpec w, InputSpec i) {
    const bool diff = is_floating(w.dtype);
    add_case(cases, "embedding", {w, i}, "", [](const TensorList& t) { return embedding(t[0], t[1]); },
        [](const std::vector<RefTensor>& r) { return ref_embedding(r[0], r[1]); }, diff);
  };
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) one(data({7, 4}, dt), idx({2, 3}, 0, 7));
  one(data({5, 3}, DType::f32, Layout::transposed), idx({6}, 0, 5, DType::i32));
  one(data({5, 3}, DType::f32, Layout::sliced), idx({2, 2, 2}, 0, 5));
  one(data({7, 4}), idx({}, 0, 7));
  one(data({7, 4}), idx({0}, 0, 7));
  one(data({7, 0}), idx({3}, 0, 7));
  one(data({4, 6}), idx({3, 5}, 0, 4, DType::i64, Layout::transposed));
}

void add_sort(CaseList& cases) {
  auto one = [&](InputSpec x, int64_t dim, bool descending) {
    const bool diff = is_floating(x.dtype);
    const std::string extra = dim_tag(dim) + (descending ? "_desc" : "_asc");
    add_case(cases, "sort_values", {x}, extra,
        [dim, descending](const TensorList& t) { return t[0].sort(dim, descending).first; },
        [dim, descending](const std::vector<RefTensor>& r) { return ref_sort(r[0], dim, descending, false); }, diff);
    add_case(cases, "argsort", {x}, extra,
        [dim, descending](const TensorList& t) { return t[0].argsort(dim, descending); },
        [dim, descending](const std::vector<RefTensor>& r) { return ref_sort(r[0], dim, descending, true); }, false);
  };
  for (bool desc : {false, true}) {
    for (DType dt : kAll) one(data({5, 7}, dt), -1, desc);  // bool: many ties, order decided by stability
    one(data({5, 7}), 0, desc);
    one(data({3, 4, 5}, DType::f64), 1, desc);
    one(data({3, 4, 5}), -3, desc);
    one(data({6, 5}, DType::f32, Layout::transposed), -1, desc);
    one(data({6, 5}, DType::f16, Layout::transposed), 0, desc);
    one(data({4, 9}, DType::i32, Layout::sliced), 1, desc);
    one(data({4, 9}, DType::f32, Layout::expanded), 0, desc);  // all ties along dim 0
    one(data({4, 9}, DType::f32, Layout::expanded), 1, desc);
    one(data({1, 33}), -1, desc);
    one(data({0, 4}), 1, desc);
    one(data({4, 0}), 1, desc);
    one(data({}), 0, desc);
  }
}

void add_topk(CaseList& cases) {
  auto one = [&](InputSpec x, int64_t k, int64_t dim, bool largest) {
    const bool diff = is_floating(x.dtype);
    const std::string extra =
        "k" + std::to_string(k) + "_" + dim_tag(dim) + (largest ? "_largest" : "_smallest");
    add_case(cases, "topk_values", {x}, extra,
        [k, dim, largest](const TensorList& t) { return t[0].topk(k, dim, largest).first; },
        [k, dim, largest](const std::vector<RefTensor>& r) { return ref_sort(r[0], dim, largest, false, k); }, diff);
    add_case(cases, "topk_indices", {x}, extra,
        [k, dim, largest](const TensorList& t) { return t[0].topk(k, dim, largest).second; },
        [k, dim, largest](const std::vector<RefTensor>& r) { return ref_sort(r[0], dim, largest, true, k); }, false);
  };
  for (bool largest : {true, false}) {
    for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
      one(data({5, 7}, dt), 3, -1, largest);
    }
    one(data({5, 7}), 2, 0, largest);
    one(data({5, 7}), 0, 1, largest);
    one(data({5, 7}), 7, 1, largest);
    one(data({3, 4, 6}, DType::f64), 4, 1, largest);
    one(data({6, 5}, DType::f32, Layout::transposed), 2, -1, largest);
    one(data({4, 9}, DType::f32, Layout::sliced), 5, 1, largest);
    one(data({4, 9}, DType::f32, Layout::expanded), 3, 0, largest);  // ties: lower index first
    one(data({}), 1, 0, largest);
    one(data({0, 5}), 2, -1, largest);
    one(data({37}), 6, 0, largest);
  }
}

}  // namespace

void add_index_cases(CaseList& cases) {
  add_index_select(cases);
  add_gather(cases);
  add_scatter(cases);
  add_masked_select(cases);
  add_take(cases);
  add_triangles(cases);
  add_one_hot(cases);
  add_embedding(cases);
  add_sort(cases);
  add_topk(cases);
}

}  // namespace flame::test
