// Op-table cases for copies and joins: cat, stack, split/chunk pieces, flip, repeat, pad.
// References are float64 loops over row-major multi-indices; they never call the code under test.
#include <algorithm>

#include "op_table.h"

namespace flame::test {
namespace {


// out[idx] = round_to(dt, f(idx)) for every multi-index of `shape`.
RefTensor ref_build(const Shape& shape, DType dt, const std::function<double(const Shape&)>& f) {
  RefTensor r(shape, dt);
  for (int64_t i = 0; i < r.numel(); ++i) r.v[i] = round_to(dt, f(r.unravel(i)));
  return r;
}

double at(const RefTensor& t, const Shape& idx) { return t.v[t.flat(idx)]; }

int64_t wrap(int64_t d, int64_t n) { return d < 0 ? d + n : d; }


bool all_floating(const std::vector<InputSpec>& in) {
  return std::all_of(in.begin(), in.end(), [](const InputSpec& s) { return is_floating(s.dtype); });
}

// ---- cat ----
RefTensor ref_cat(const std::vector<RefTensor>& in, int64_t dim, DType out) {
  // Legacy rule: 1-d inputs of shape [0] do not take part.
  std::vector<const RefTensor*> parts;
  for (const auto& t : in)
    if (!(t.shape.size() == 1 && t.shape[0] == 0)) parts.push_back(&t);
  if (parts.empty()) return RefTensor({0}, out);
  const int64_t d = wrap(dim, static_cast<int64_t>(parts[0]->shape.size()));
  Shape shape = parts[0]->shape;
  shape[d] = 0;
  std::vector<int64_t> starts;
  for (const auto* p : parts) {
    starts.push_back(shape[d]);
    shape[d] += p->shape[d];
  }
  return ref_build(shape, out, [&](const Shape& idx) {
    std::size_t k = parts.size() - 1;
    while (idx[d] < starts[k]) --k;
    Shape j = idx;
    j[d] -= starts[k];
    return at(*parts[k], j);
  });
}

void add_cat(CaseList& cases) {
  struct Def {
    std::vector<InputSpec> in;
    int64_t dim;
    DType out;
  };
  const DType f32 = DType::f32;
  std::vector<Def> defs = {
      {{{{2, 3}, f32}, {{4, 3}, f32}, {{1, 3}, f32}}, 0, f32},
      {{{{3, 2}, DType::f64}, {{3, 5}, DType::f64}}, 1, DType::f64},
      {{{{3, 2}, DType::f64}, {{3, 5}, DType::f64}}, -1, DType::f64},
      {{{{2, 3, 4}, f32}, {{2, 1, 4}, f32}, {{2, 5, 4}, f32}}, 1, f32},
      {{{{3, 5, 7}, f32}, {{3, 5, 2}, f32}}, 2, f32},
      {{{{5}, DType::bf16}, {{3}, DType::bf16}}, 0, DType::bf16},
      {{{{2, 3}, DType::i64, Layout::contiguous, -50, 50}, {{2, 1}, DType::i64, Layout::contiguous, -50, 50}}, 1, DType::i64},
      {{{{2, 2}, DType::boolean}, {{3, 2}, DType::boolean}}, 0, DType::boolean},
      // Mixed dtypes promote (PyTorch: torch.cat type promotion).
      {{{{2, 3}, DType::i64, Layout::contiguous, -9, 9}, {{1, 3}, f32}}, 0, f32},
      {{{{2, 3}, DType::boolean}, {{2, 2}, DType::i64, Layout::contiguous, -9, 9}}, 1, DType::i64},
      {{{{2, 3}, DType::bf16}, {{2, 3}, DType::f16}}, 0, f32},
      {{{{2, 3}, DType::u8, Layout::contiguous, 0, 200}, {{2, 3}, DType::i32, Layout::contiguous, -9, 9}}, 0, DType::i32},
      {{{{2, 3}, f32}, {{2, 3}, DType::f64}, {{2, 3}, DType::bf16}}, 1, DType::f64},
      // Non-contiguous inputs.
      {{{{4, 3}, f32, Layout::transposed}, {{2, 3}, f32, Layout::sliced}, {{3, 3}, f32, Layout::expanded}}, 0, f32},
      {{{{3, 4}, f32, Layout::transposed}, {{3, 2}, f32, Layout::expanded}}, 1, f32},
      // Empty pieces, and the legacy [0] tensor that is skipped whatever the other shapes.
      {{{{0, 3}, f32}, {{2, 3}, f32}, {{0, 3}, f32}}, 0, f32},
      {{{{0}, f32}, {{2, 3}, f32}}, 1, f32},
      {{{{2, 3}, f32}, {{0}, DType::f64}}, 0, DType::f64},
      {{{{0}, f32}, {{0}, f32}}, 0, f32},
      {{{{2, 0}, f32}, {{2, 0}, f32}}, 1, f32},
  };
  for (const Def& d : defs) {
    const int64_t dim = d.dim;
    const DType out = d.out;
    add_case(cases, "cat", d.in, dim_tag(dim),
             [dim](const TensorList& t) { return cat(t, dim); },
             [dim, out](const std::vector<RefTensor>& r) { return ref_cat(r, dim, out); }, all_floating(d.in));
  }
}

// ---- stack ----
void add_stack(CaseList& cases) {
  struct Def {
    std::vector<InputSpec> in;
    int64_t dim;
    DType out;
  };
  const DType f32 = DType::f32;
  std::vector<Def> defs = {
      {{{{2, 3}, f32}, {{2, 3}, f32}, {{2, 3}, f32}}, 0, f32},
      {{{{2, 3}, f32}, {{2, 3}, f32}, {{2, 3}, f32}}, 1, f32},
      {{{{2, 3}, f32}, {{2, 3}, f32}}, 2, f32},
      {{{{2, 3}, f32}, {{2, 3}, f32}}, -1, f32},
      {{{{2, 3}, f32}, {{2, 3}, f32}}, -3, f32},
      {{{{}, DType::f64}, {{}, DType::f64}, {{}, DType::f64}}, 0, DType::f64},
      {{{{5}, DType::i64, Layout::contiguous, -100, 100}, {{5}, DType::i64, Layout::contiguous, -100, 100}}, 1, DType::i64},
      {{{{3, 2}, DType::boolean}, {{3, 2}, DType::boolean}}, 1, DType::boolean},
      {{{{3, 5}, DType::bf16, Layout::transposed}, {{3, 5}, DType::bf16, Layout::sliced}}, 1, DType::bf16},
      {{{{4, 3}, f32, Layout::expanded}, {{4, 3}, DType::i32, Layout::contiguous, -9, 9}}, 0, f32},
      {{{{0, 3}, f32}, {{0, 3}, f32}}, 1, f32},
      {{{{0}, f32}, {{0}, f32}}, 0, f32},
  };
  for (const Def& d : defs) {
    const int64_t dim = d.dim;
    const DType out = d.out;
    add_case(cases, "stack", d.in, dim_tag(dim),
             [dim](const TensorList& t) { return stack(t, dim); },
             [dim, out](const std::vector<RefTensor>& r) {
               const Shape& s = r[0].shape;
               const int64_t n = static_cast<int64_t>(s.size());
               const int64_t d = wrap(dim, n + 1);
               Shape shape = s;
               shape.insert(shape.begin() + d, static_cast<int64_t>(r.size()));
               return ref_build(shape, out, [&](const Shape& idx) {
                 Shape j = idx;
                 j.erase(j.begin() + d);
                 return at(r[idx[d]], j);
               });
             },
             all_floating(d.in));
  }
}

// ---- split, split_with_sizes, chunk: one piece (a view) or all pieces re-joined ----
void add_split(CaseList& cases) {
  struct Def {
    std::string op;
    InputSpec in;
    std::function<TensorList(const Tensor&)> pieces;
    int64_t dim;
    Shape starts;  // where each piece starts along dim, in the reference
    Shape lens;
  };
  const DType f32 = DType::f32;
  std::vector<Def> defs = {
      {"split", {{7, 4}, f32}, [](const Tensor& x) { return x.split(3, 0); }, 0, {0, 3, 6}, {3, 3, 1}},
      {"split", {{4, 7}, DType::f64, Layout::transposed}, [](const Tensor& x) { return x.split(2, -1); }, 1,
       {0, 2, 4, 6}, {2, 2, 2, 1}},
      {"split", {{3, 5}, DType::i64, Layout::sliced, -50, 50}, [](const Tensor& x) { return x.split(5, 1); }, 1,
       {0}, {5}},
      {"split", {{2, 6, 3}, DType::bf16}, [](const Tensor& x) { return x.split(4, 1); }, 1, {0, 4}, {4, 2}},
      {"split_with_sizes", {{6, 3}, f32}, [](const Tensor& x) { return x.split_with_sizes({2, 0, 4}, 0); }, 0,
       {0, 2, 2}, {2, 0, 4}},
      {"split_with_sizes", {{3, 5}, DType::boolean, Layout::expanded},
       [](const Tensor& x) { return x.split_with_sizes({1, 3, 1}, 1); }, 1, {0, 1, 4}, {1, 3, 1}},
      {"chunk", {{7}, f32}, [](const Tensor& x) { return x.chunk(3); }, 0, {0, 3, 6}, {3, 3, 1}},
      // 6 split in 4 chunks: ceil(6/4) = 2 per piece, so only 3 pieces (as PyTorch).
      {"chunk", {{5, 6}, f32, Layout::transposed}, [](const Tensor& x) { return x.chunk(4, 1); }, 1, {0, 2, 4},
       {2, 2, 2}},
      {"chunk", {{5, 2, 3}, DType::f16}, [](const Tensor& x) { return x.chunk(2, 0); }, 0, {0, 3}, {3, 2}},
  };
  for (const Def& d : defs) {
    const int64_t dim = d.dim;
    const Shape starts = d.starts, lens = d.lens;
    const DType dt = d.in.dtype;
    auto pieces = d.pieces;
    // The middle and the last piece, straight from the views.
    std::vector<std::size_t> picks = {lens.size() / 2};
    if (lens.size() - 1 != lens.size() / 2) picks.push_back(lens.size() - 1);
    for (std::size_t k : picks) {
      add_case(
          cases, d.op, {d.in}, "piece" + std::to_string(k) + "_d" + std::to_string(dim) + "_n" + std::to_string(lens.size()),
          [pieces, k, lens](const TensorList& t) {
            TensorList p = pieces(t[0]);
            if (p.size() != lens.size()) throw std::runtime_error("wrong number of pieces: " + std::to_string(p.size()));
            return p[k];
          },
          [dim, starts, lens, k, dt](const std::vector<RefTensor>& r) {
            Shape shape = r[0].shape;
            shape[dim] = lens[k];
            return ref_build(shape, dt, [&](const Shape& idx) {
              Shape j = idx;
              j[dim] += starts[k];
              return at(r[0], j);
            });
          },
          is_floating(dt));
    }
    // All pieces, in reverse order, joined again.
    add_case(
        cases, d.op, {d.in}, "reversed_d" + std::to_string(dim) + "_n" + std::to_string(lens.size()),
        [pieces, dim](const TensorList& t) {
          TensorList p = pieces(t[0]);
          std::reverse(p.begin(), p.end());
          return cat(p, dim);
        },
        [dim, starts, lens, dt](const std::vector<RefTensor>& r) {
          return ref_build(r[0].shape, dt, [&](const Shape& idx) {
            // Position idx[dim] of the reversed concatenation.
            int64_t pos = idx[dim];
            for (int64_t k = static_cast<int64_t>(lens.size()) - 1; k >= 0; --k) {
              if (pos < lens[k]) {
                Shape j = idx;
                j[dim] = starts[k] + pos;
                return at(r[0], j);
              }
              pos -= lens[k];
            }
            return 0.0;
          });
        },
        is_floating(dt));
  }
}

// ---- flip ----
void add_flip(CaseList& cases) {
  struct Def {
    InputSpec in;
    Shape dims;
  };
  const DType f32 = DType::f32;
  std::vector<Def> defs = {
      {{{3, 4, 5}, f32}, {0, 2}},
      {{{3, 4, 5}, f32}, {-1}},
      {{{3, 4, 5}, DType::f64}, {2, 0, 1}},
      {{{3, 4}, f32}, {}},
      {{{7}, DType::i64, Layout::contiguous, -100, 100}, {0}},
      {{{2, 5}, DType::boolean}, {1}},
      {{{4, 3}, DType::bf16, Layout::transposed}, {0}},
      {{{4, 6}, f32, Layout::transposed}, {0, 1}},
      {{{4, 6}, f32, Layout::sliced}, {1}},
      {{{4, 6}, f32, Layout::expanded}, {0, 1}},
      {{{}, f32}, {}},
      {{{}, f32}, {0}},
      {{{2, 0, 3}, f32}, {1, 2}},
      {{{1, 5}, DType::f16}, {0, 1}},
  };
  int serial = 0;
  for (const Def& d : defs) {
    const Shape dims = d.dims;
    const DType dt = d.in.dtype;
    add_case(cases, "flip", {d.in}, "v" + std::to_string(serial++),
             [dims](const TensorList& t) { return t[0].flip(dims); },
             [dims, dt](const std::vector<RefTensor>& r) {
               const int64_t n = static_cast<int64_t>(r[0].shape.size());
               return ref_build(r[0].shape, dt, [&](const Shape& idx) {
                 Shape j = idx;
                 if (n > 0)
                   for (int64_t d : dims) {
                     const int64_t w = wrap(d, n);
                     j[w] = r[0].shape[w] - 1 - idx[w];
                   }
                 return at(r[0], j);
               });
             },
             is_floating(dt));
  }
}

// ---- repeat ----
void add_repeat(CaseList& cases) {
  struct Def {
    InputSpec in;
    Shape repeats;
  };
  const DType f32 = DType::f32;
  std::vector<Def> defs = {
      {{{2, 3}, f32}, {2, 1, 3}},
      {{{2, 3}, f32}, {1, 1}},
      {{{2, 3}, f32}, {3, 2}},
      {{{3}, DType::f64}, {2, 2, 2}},
      {{{}, f32}, {3, 2}},
      {{{}, f32}, {}},
      {{{2, 3}, f32}, {0, 2}},
      {{{2, 0}, f32}, {2, 3}},
      {{{2, 3}, DType::boolean}, {2, 2}},
      {{{2, 3}, DType::i64, Layout::contiguous, -100, 100}, {1, 3}},
      {{{3, 2}, DType::bf16, Layout::transposed}, {2, 1, 2}},
      {{{4, 3}, f32, Layout::sliced}, {2, 2}},
      {{{4, 3}, f32, Layout::expanded}, {1, 2}},
      {{{1, 3, 1}, DType::f16}, {2, 1, 4}},
  };
  int serial = 0;
  for (const Def& d : defs) {
    const Shape reps = d.repeats;
    const DType dt = d.in.dtype;
    add_case(cases, "repeat", {d.in}, "v" + std::to_string(serial++),
             [reps](const TensorList& t) { return t[0].repeat(reps); },
             [reps, dt](const std::vector<RefTensor>& r) {
               const std::size_t m = reps.size(), lead = m - r[0].shape.size();
               Shape shape(m);
               for (std::size_t i = 0; i < m; ++i) shape[i] = reps[i] * (i < lead ? 1 : r[0].shape[i - lead]);
               return ref_build(shape, dt, [&](const Shape& idx) {
                 Shape j(r[0].shape.size());
                 for (std::size_t i = 0; i < j.size(); ++i) j[i] = idx[i + lead] % r[0].shape[i];
                 return at(r[0], j);
               });
             },
             is_floating(dt));
  }
}

// ---- pad ----
// Index into the input for output position p of a dim with left pad `l` (negative: cropping)
// whose kept input range is [kept_lo, kept_hi); -1 for a constant-filled position.
int64_t pad_source(PadMode mode, int64_t p, int64_t l, int64_t kept_lo, int64_t kept_hi) {
  int64_t j = p - l;  // position in the original input
  if (j >= kept_lo && j < kept_hi) return j;
  if (mode == PadMode::constant) return -1;
  if (mode == PadMode::replicate) return j < kept_lo ? kept_lo : kept_hi - 1;
  // reflect about the first/last kept element, without repeating it
  if (j < kept_lo) return 2 * kept_lo - j;
  return 2 * (kept_hi - 1) - j;
}

void add_pad(CaseList& cases) {
  struct Def {
    InputSpec in;
    Shape pads;
    PadMode mode;
    double value = 0.0;
  };
  const DType f32 = DType::f32;
  const PadMode C = PadMode::constant, R = PadMode::reflect, P = PadMode::replicate;
  std::vector<Def> defs = {
      {{{3, 4}, f32}, {1, 2}, C, 0.5},
      {{{3, 4}, f32}, {1, 2, 0, 3}, C, -1.25},
      {{{3, 4}, f32}, {-1, 2}, C, 0.0},
      {{{3, 5}, DType::f64}, {2, -2, -1, 1}, C, 3.0},
      {{{2, 3, 4}, f32}, {1, 1, 1, 1, 1, 1}, C, 7.0},
      {{{3, 4}, DType::i64, Layout::contiguous, -100, 100}, {2, 1}, C, 5.0},
      {{{3, 4}, DType::boolean}, {1, 1, 1, 0}, C, 1.0},
      {{{3, 4}, DType::bf16, Layout::transposed}, {0, 2, 1, 0}, C, 0.75},
      {{{4, 6}, f32, Layout::sliced}, {3, 0}, C, 2.0},
      {{{4, 0}, f32}, {1, 2}, C, 9.0},
      {{{4}, f32}, {0, 0}, C, 9.0},
      {{{3, 4}, f32}, {-2, -2}, C, 1.0},
      {{{3, 5}, f32}, {2, 1}, R},
      {{{3, 5}, f32}, {2, 1, 1, 2}, R},
      {{{3, 5}, f32}, {4, 4}, R},
      {{{2, 3, 5}, DType::f64}, {1, 2, 2, 0, 1, 1}, R},
      {{{4, 6}, f32, Layout::sliced}, {3, 2, 0, 1}, R},
      {{{3, 6}, DType::i64, Layout::contiguous, -100, 100}, {-1, 2}, R},
      {{{4, 5}, DType::bf16, Layout::transposed}, {1, 1, 3, 2}, R},
      {{{3, 4}, f32}, {3, 1, 2, 0}, P},
      {{{2, 3, 4}, DType::f64}, {1, 2, 3, 0, 2, 2}, P},
      {{{1, 3}, f32}, {2, 2, 3, 1}, P},
      {{{4, 5}, f32, Layout::transposed}, {-2, 3, 1, -1}, P},
      {{{4, 5}, f32, Layout::expanded}, {1, 1, 2, 2}, P},
      {{{3, 4}, DType::boolean}, {2, 1}, P},
      {{{3, 4}, DType::f16}, {0, 2}, P},
  };
  int serial = 0;
  for (const Def& d : defs) {
    const Shape pads = d.pads;
    const PadMode mode = d.mode;
    const double value = d.value;
    const DType dt = d.in.dtype;
    const char* mname = mode == C ? "constant" : mode == R ? "reflect" : "replicate";
    add_case(cases, std::string("pad_") + mname, {d.in}, "v" + std::to_string(serial++),
             [pads, mode, value](const TensorList& t) { return pad(t[0], pads, mode, value); },
             [pads, mode, value, dt](const std::vector<RefTensor>& r) {
               const Shape& s = r[0].shape;
               const int64_t n = static_cast<int64_t>(s.size());
               Shape left(n, 0), right(n, 0), shape = s;
               for (std::size_t k = 0; k < pads.size() / 2; ++k) {
                 left[n - 1 - k] = pads[2 * k];
                 right[n - 1 - k] = pads[2 * k + 1];
               }
               for (int64_t d = 0; d < n; ++d) shape[d] = s[d] + left[d] + right[d];
               return ref_build(shape, dt, [&](const Shape& idx) {
                 Shape j(n);
                 for (int64_t d = 0; d < n; ++d) {
                   const int64_t lo = std::max<int64_t>(-left[d], 0), hi = s[d] - std::max<int64_t>(-right[d], 0);
                   j[d] = pad_source(mode, idx[d], left[d], lo, hi);
                   if (j[d] < 0) return value;
                 }
                 return at(r[0], j);
               });
             },
             is_floating(dt));
  }
}

}  // namespace

void add_join_cases(CaseList& cases) {
  add_cat(cases);
  add_stack(cases);
  add_split(cases);
  add_flip(cases);
  add_repeat(cases);
  add_pad(cases);
}

}  // namespace flame::test
