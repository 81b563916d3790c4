// Op-table cases for view ops (reshape, view, transpose, t, permute, narrow, slice, select,
// expand, squeeze, unsqueeze, flatten, unflatten, unfold) and the copies contiguous, clone and
// to(dtype). Each reference maps an output multi-index to an input multi-index by hand.
#include "op_table.h"

namespace flame::test {
namespace {

// The input element that output element `idx` shows.
using IndexMap = std::function<Shape(const Shape& idx, const Shape& in_shape)>;

struct ViewDef {
  std::string op;
  InputSpec in;
  std::function<Tensor(const Tensor&)> run;
  std::function<Shape(const Shape& in_shape)> out_shape;
  IndexMap source;
};

// A null source means row-major order is kept: output element f is input element f.
ViewDef flat(std::string op, InputSpec in, std::function<Tensor(const Tensor&)> run, Shape out) {
  return {std::move(op), std::move(in), std::move(run), [out](const Shape&) { return out; }, nullptr};
}

ViewDef mapped(std::string op, InputSpec in, std::function<Tensor(const Tensor&)> run,
               std::function<Shape(const Shape&)> out_shape, IndexMap source) {
  return {std::move(op), std::move(in), std::move(run), std::move(out_shape), std::move(source)};
}

std::vector<ViewDef> view_defs() {
  const DType f32 = DType::f32, f64 = DType::f64, bf16 = DType::bf16, i64 = DType::i64;
  const Layout T = Layout::transposed, S = Layout::sliced, E = Layout::expanded;
  std::vector<ViewDef> d;
  // ---- reshape / view / flatten / unflatten / contiguous / clone: element order is unchanged ----
  d.push_back(flat("reshape", {{3, 4}, f32}, [](const Tensor& x) { return x.reshape({2, 6}); }, {2, 6}));
  d.push_back(flat("reshape", {{3, 4}, f64}, [](const Tensor& x) { return x.reshape({-1, 3}); }, {4, 3}));
  d.push_back(flat("reshape", {{4, 6}, f32, T}, [](const Tensor& x) { return x.reshape({2, 12}); }, {2, 12}));
  d.push_back(flat("reshape", {{4, 6}, f32, S}, [](const Tensor& x) { return x.reshape({24}); }, {24}));
  d.push_back(flat("reshape", {{4, 6}, i64, E}, [](const Tensor& x) { return x.reshape({3, 8}); }, {3, 8}));
  d.push_back(flat("reshape", {{}, f32}, [](const Tensor& x) { return x.reshape({1, 1}); }, {1, 1}));
  d.push_back(flat("reshape", {{1}, f32}, [](const Tensor& x) { return x.reshape({}); }, {}));
  d.push_back(flat("reshape", {{2, 0, 3}, f32}, [](const Tensor& x) { return x.reshape({-1, 3}); }, {0, 3}));
  d.push_back(flat("reshape", {{2, 3, 5}, bf16, T}, [](const Tensor& x) { return x.reshape({6, 5}); }, {6, 5}));
  d.push_back(flat("view", {{2, 3, 4}, f32}, [](const Tensor& x) { return x.view({6, 4}); }, {6, 4}));
  d.push_back(flat("view", {{2, 3, 4}, DType::boolean}, [](const Tensor& x) { return x.view({-1}); }, {24}));
  d.push_back(flat("view", {{4, 6}, f32, S}, [](const Tensor& x) { return x.view({2, 2, 6}); }, {2, 2, 6}));
  d.push_back(flat("view", {{4, 6}, f32, E}, [](const Tensor& x) { return x.view({2, 2, 3, 2}); }, {2, 2, 3, 2}));
  d.push_back(flat("view", {{1, 5, 1}, bf16}, [](const Tensor& x) { return x.view({5, 1, 1, 1}); }, {5, 1, 1, 1}));
  d.push_back(flat("flatten", {{2, 3, 4}, f32}, [](const Tensor& x) { return x.flatten(); }, {24}));
  d.push_back(flat("flatten", {{2, 3, 4}, f64}, [](const Tensor& x) { return x.flatten(1, 2); }, {2, 12}));
  d.push_back(flat("flatten", {{2, 3, 4}, f32}, [](const Tensor& x) { return x.flatten(-3, -2); }, {6, 4}));
  d.push_back(flat("flatten", {{5, 4}, f32, T}, [](const Tensor& x) { return x.flatten(0, 1); }, {20}));
  d.push_back(flat("flatten", {{}, f32}, [](const Tensor& x) { return x.flatten(); }, {1}));
  d.push_back(flat("unflatten", {{4, 6}, f32}, [](const Tensor& x) { return x.unflatten(1, {2, 3}); }, {4, 2, 3}));
  d.push_back(flat("unflatten", {{6, 5}, i64}, [](const Tensor& x) { return x.unflatten(0, {-1, 2}); }, {3, 2, 5}));
  d.push_back(flat("unflatten", {{4, 6}, f32, E}, [](const Tensor& x) { return x.unflatten(-1, {3, 1, 2}); },
                   {4, 3, 1, 2}));
  d.push_back(flat("contiguous", {{4, 6}, f32, T}, [](const Tensor& x) { return x.contiguous(); }, {4, 6}));
  d.push_back(flat("contiguous", {{4, 6}, bf16, S}, [](const Tensor& x) { return x.contiguous(); }, {4, 6}));
  d.push_back(flat("contiguous", {{3, 5}, f32}, [](const Tensor& x) { return x.contiguous(); }, {3, 5}));
  d.push_back(flat("clone", {{4, 6}, f32, E}, [](const Tensor& x) { return x.clone(); }, {4, 6}));
  d.push_back(flat("clone", {{3, 5}, i64, T}, [](const Tensor& x) { return x.clone(); }, {3, 5}));
  d.push_back(flat("clone", {{}, f64}, [](const Tensor& x) { return x.clone(); }, {}));
  d.push_back(flat("clone", {{0, 4}, f32}, [](const Tensor& x) { return x.clone(); }, {0, 4}));

  // ---- transpose / t / permute ----
  auto swap02 = [](const Shape& s) { return Shape{s[2], s[1], s[0]}; };
  d.push_back(mapped("transpose", {{2, 3, 4}, f32}, [](const Tensor& x) { return x.transpose(0, 2); }, swap02,
                     [](const Shape& i, const Shape&) { return Shape{i[2], i[1], i[0]}; }));
  d.push_back(mapped("transpose", {{3, 5}, i64, T}, [](const Tensor& x) { return x.transpose(-1, -2); },
                     [](const Shape& s) { return Shape{s[1], s[0]}; },
                     [](const Shape& i, const Shape&) { return Shape{i[1], i[0]}; }));
  d.push_back(mapped("transpose", {{3, 5}, f32}, [](const Tensor& x) { return x.transpose(1, 1); },
                     [](const Shape& s) { return s; }, [](const Shape& i, const Shape&) { return i; }));
  d.push_back(mapped("t", {{3, 5}, f64}, [](const Tensor& x) { return x.t(); },
                     [](const Shape& s) { return Shape{s[1], s[0]}; },
                     [](const Shape& i, const Shape&) { return Shape{i[1], i[0]}; }));
  d.push_back(mapped("t", {{4, 6}, bf16, S}, [](const Tensor& x) { return x.t(); },
                     [](const Shape& s) { return Shape{s[1], s[0]}; },
                     [](const Shape& i, const Shape&) { return Shape{i[1], i[0]}; }));
  d.push_back(mapped("t", {{7}, f32}, [](const Tensor& x) { return x.t(); }, [](const Shape& s) { return s; },
                     [](const Shape& i, const Shape&) { return i; }));
  d.push_back(mapped("permute", {{2, 3, 4}, f32}, [](const Tensor& x) { return x.permute({2, 0, 1}); },
                     [](const Shape& s) { return Shape{s[2], s[0], s[1]}; },
                     [](const Shape& i, const Shape&) { return Shape{i[1], i[2], i[0]}; }));
  d.push_back(mapped("permute", {{2, 3, 4}, DType::f16}, [](const Tensor& x) { return x.permute({-1, 0, 1}); },
                     [](const Shape& s) { return Shape{s[2], s[0], s[1]}; },
                     [](const Shape& i, const Shape&) { return Shape{i[1], i[2], i[0]}; }));
  d.push_back(mapped("permute", {{4, 6}, f32, E}, [](const Tensor& x) { return x.permute({1, 0}); },
                     [](const Shape& s) { return Shape{s[1], s[0]}; },
                     [](const Shape& i, const Shape&) { return Shape{i[1], i[0]}; }));
  d.push_back(mapped("permute", {{}, f32}, [](const Tensor& x) { return x.permute({}); },
                     [](const Shape& s) { return s; }, [](const Shape& i, const Shape&) { return i; }));

  // ---- narrow / slice / select ----
  d.push_back(mapped("narrow", {{4, 6}, f32}, [](const Tensor& x) { return x.narrow(1, 1, 3); },
                     [](const Shape& s) { return Shape{s[0], 3}; },
                     [](const Shape& i, const Shape&) { return Shape{i[0], i[1] + 1}; }));
  d.push_back(mapped("narrow", {{5, 3}, i64, T}, [](const Tensor& x) { return x.narrow(0, -2, 2); },
                     [](const Shape& s) { return Shape{2, s[1]}; },
                     [](const Shape& i, const Shape&) { return Shape{i[0] + 3, i[1]}; }));
  d.push_back(mapped("narrow", {{4, 6}, f32}, [](const Tensor& x) { return x.narrow(-1, 6, 0); },
                     [](const Shape& s) { return Shape{s[0], 0}; }, [](const Shape& i, const Shape&) { return i; }));
  d.push_back(mapped("slice", {{4, 7}, f32}, [](const Tensor& x) { return x.slice(1, 1, 6, 2); },
                     [](const Shape& s) { return Shape{s[0], 3}; },
                     [](const Shape& i, const Shape&) { return Shape{i[0], 1 + 2 * i[1]}; }));
  d.push_back(mapped("slice", {{5, 3}, f64}, [](const Tensor& x) { return x.slice(0, -3, -1); },
                     [](const Shape& s) { return Shape{2, s[1]}; },
                     [](const Shape& i, const Shape&) { return Shape{i[0] + 2, i[1]}; }));
  d.push_back(mapped("slice", {{2, 8}, f32, S}, [](const Tensor& x) { return x.slice(1, 0, 100, 3); },
                     [](const Shape& s) { return Shape{s[0], 3}; },
                     [](const Shape& i, const Shape&) { return Shape{i[0], 3 * i[1]}; }));
  d.push_back(mapped("slice", {{6, 4}, bf16, T}, [](const Tensor& x) { return x.slice(0, 5, 2, 1); },
                     [](const Shape& s) { return Shape{0, s[1]}; }, [](const Shape& i, const Shape&) { return i; }));
  d.push_back(mapped("slice", {{9, 2}, DType::boolean, E}, [](const Tensor& x) { return x.slice(0, 1, 9, 4); },
                     [](const Shape& s) { return Shape{2, s[1]}; },
                     [](const Shape& i, const Shape&) { return Shape{1 + 4 * i[0], i[1]}; }));
  d.push_back(mapped("select", {{4, 3}, f32}, [](const Tensor& x) { return x.select(0, -1); },
                     [](const Shape& s) { return Shape{s[1]}; },
                     [](const Shape& i, const Shape&) { return Shape{3, i[0]}; }));
  d.push_back(mapped("select", {{2, 3, 4}, i64, T}, [](const Tensor& x) { return x.select(1, 2); },
                     [](const Shape& s) { return Shape{s[0], s[2]}; },
                     [](const Shape& i, const Shape&) { return Shape{i[0], 2, i[1]}; }));
  d.push_back(mapped("select", {{5}, f64}, [](const Tensor& x) { return x.select(0, 2); },
                     [](const Shape&) { return Shape{}; }, [](const Shape&, const Shape&) { return Shape{2}; }));
  d.push_back(mapped("select", {{3, 5}, f32, S}, [](const Tensor& x) { return x.select(-1, -5); },
                     [](const Shape& s) { return Shape{s[0]}; },
                     [](const Shape& i, const Shape&) { return Shape{i[0], 0}; }));

  // ---- expand / squeeze / unsqueeze ----
  d.push_back(mapped("expand", {{3, 1}, f32}, [](const Tensor& x) { return x.expand({2, 3, 4}); },
                     [](const Shape&) { return Shape{2, 3, 4}; },
                     [](const Shape& i, const Shape&) { return Shape{i[1], 0}; }));
  d.push_back(mapped("expand", {{1}, i64}, [](const Tensor& x) { return x.expand({5}); },
                     [](const Shape&) { return Shape{5}; }, [](const Shape&, const Shape&) { return Shape{0}; }));
  d.push_back(mapped("expand", {{}, bf16}, [](const Tensor& x) { return x.expand({2, 3}); },
                     [](const Shape&) { return Shape{2, 3}; }, [](const Shape&, const Shape&) { return Shape{}; }));
  d.push_back(mapped("expand", {{4, 6}, f32, E}, [](const Tensor& x) { return x.expand({2, -1, -1}); },
                     [](const Shape& s) { return Shape{2, s[0], s[1]}; },
                     [](const Shape& i, const Shape&) { return Shape{i[1], i[2]}; }));
  d.push_back(mapped("expand", {{1, 3}, f32}, [](const Tensor& x) { return x.expand({0, 3}); },
                     [](const Shape&) { return Shape{0, 3}; }, [](const Shape& i, const Shape&) { return i; }));
  d.push_back(mapped("expand_as", {{2, 1, 5}, f64, S},
                     [](const Tensor& x) { return x.expand_as(Tensor::empty({3, 2, 4, 5}, x.device())); },
                     [](const Shape&) { return Shape{3, 2, 4, 5}; },
                     [](const Shape& i, const Shape&) { return Shape{i[1], 0, i[3]}; }));
  d.push_back(mapped("squeeze", {{1, 3, 1, 4}, f32}, [](const Tensor& x) { return x.squeeze(); },
                     [](const Shape&) { return Shape{3, 4}; },
                     [](const Shape& i, const Shape&) { return Shape{0, i[0], 0, i[1]}; }));
  d.push_back(mapped("squeeze", {{1, 3, 1, 4}, f32}, [](const Tensor& x) { return x.squeeze(2); },
                     [](const Shape&) { return Shape{1, 3, 4}; },
                     [](const Shape& i, const Shape&) { return Shape{i[0], i[1], 0, i[2]}; }));
  d.push_back(mapped("squeeze", {{3, 4}, f32, T}, [](const Tensor& x) { return x.squeeze(0); },
                     [](const Shape& s) { return s; }, [](const Shape& i, const Shape&) { return i; }));
  d.push_back(mapped("squeeze", {{1, 1}, i64}, [](const Tensor& x) { return x.squeeze(); },
                     [](const Shape&) { return Shape{}; }, [](const Shape&, const Shape&) { return Shape{0, 0}; }));
  d.push_back(mapped("unsqueeze", {{3, 4}, f32, T}, [](const Tensor& x) { return x.unsqueeze(0); },
                     [](const Shape& s) { return Shape{1, s[0], s[1]}; },
                     [](const Shape& i, const Shape&) { return Shape{i[1], i[2]}; }));
  d.push_back(mapped("unsqueeze", {{3, 4}, bf16}, [](const Tensor& x) { return x.unsqueeze(-1); },
                     [](const Shape& s) { return Shape{s[0], s[1], 1}; },
                     [](const Shape& i, const Shape&) { return Shape{i[0], i[1]}; }));
  d.push_back(mapped("unsqueeze", {{3, 4}, f32, S}, [](const Tensor& x) { return x.unsqueeze(1); },
                     [](const Shape& s) { return Shape{s[0], 1, s[1]}; },
                     [](const Shape& i, const Shape&) { return Shape{i[0], i[2]}; }));
  d.push_back(mapped("unsqueeze", {{}, f64}, [](const Tensor& x) { return x.unsqueeze(0); },
                     [](const Shape&) { return Shape{1}; }, [](const Shape&, const Shape&) { return Shape{}; }));

  // ---- unfold: out[..., j, ..., k] = in[..., j * step + k, ...] ----
  d.push_back(mapped("unfold", {{3, 7}, f32}, [](const Tensor& x) { return x.unfold(1, 3, 2); },
                     [](const Shape& s) { return Shape{s[0], 3, 3}; },
                     [](const Shape& i, const Shape&) { return Shape{i[0], 2 * i[1] + i[2]}; }));
  d.push_back(mapped("unfold", {{5}, f64}, [](const Tensor& x) { return x.unfold(0, 2, 1); },
                     [](const Shape&) { return Shape{4, 2}; },
                     [](const Shape& i, const Shape&) { return Shape{i[0] + i[1]}; }));
  d.push_back(mapped("unfold", {{2, 9}, f32, S}, [](const Tensor& x) { return x.unfold(-1, 4, 3); },
                     [](const Shape& s) { return Shape{s[0], 2, 4}; },
                     [](const Shape& i, const Shape&) { return Shape{i[0], 3 * i[1] + i[2]}; }));
  d.push_back(mapped("unfold", {{6, 3}, i64, T}, [](const Tensor& x) { return x.unfold(0, 6, 5); },
                     [](const Shape& s) { return Shape{1, s[1], 6}; },
                     [](const Shape& i, const Shape&) { return Shape{i[2], i[1]}; }));
  d.push_back(mapped("unfold", {{}, f32}, [](const Tensor& x) { return x.unfold(0, 1, 1); },
                     [](const Shape&) { return Shape{1}; }, [](const Shape&, const Shape&) { return Shape{}; }));
  return d;
}

// to(dtype): converted values (floating -> integer truncates toward zero; -> bool is v != 0).
struct ToDef {
  InputSpec in;
  DType to;
};

std::vector<ToDef> to_defs() {
  const DType f32 = DType::f32;
  return {
      {{{3, 5}, f32}, DType::bf16},
      {{{3, 5}, f32}, DType::f16},
      {{{3, 5}, DType::f64}, f32},
      {{{3, 5}, f32, Layout::contiguous, -9, 9}, DType::i64},
      {{{3, 5}, DType::f64, Layout::transposed, -9, 9}, DType::i32},
      {{{3, 5}, DType::i64, Layout::contiguous, -1000, 1000}, f32},
      {{{3, 5}, f32, Layout::sliced, -1, 1}, DType::boolean},
      {{{3, 5}, DType::boolean}, f32},
      {{{3, 5}, DType::boolean, Layout::expanded}, DType::i64},
      {{{3, 5}, DType::i64, Layout::contiguous, -300, 300}, DType::u8},
      {{{3, 5}, DType::i64, Layout::contiguous, -100, 100}, DType::i32},
      {{{3, 5}, DType::bf16, Layout::transposed}, DType::f64},
      {{{3, 5}, DType::f16}, DType::bf16},
      {{{3, 5}, DType::i32, Layout::contiguous, -3000, 3000}, DType::bf16},
      {{{}, DType::f64}, DType::f16},
      {{{0, 3}, f32}, DType::f64},
      {{{3, 5}, f32}, f32},
  };
}

}  // namespace

void add_view_cases(CaseList& cases) {
  int serial = 0;
  for (const ViewDef& d : view_defs()) {
    OpCase c;
    c.name = case_name(d.op, {d.in}, "v" + std::to_string(serial++));
    c.inputs = {d.in};
    auto run = d.run;
    c.run = [run](const TensorList& in) { return run(in[0]); };
    auto out_shape = d.out_shape;
    auto source = d.source;
    c.reference = [out_shape, source](const std::vector<RefTensor>& in) {
      RefTensor r(out_shape(in[0].shape), in[0].dtype);
      for (int64_t f = 0; f < r.numel(); ++f) {
        r.v[f] = source ? in[0].v[in[0].flat(source(r.unravel(f), in[0].shape))] : in[0].v[f];
      }
      return r;
    };
    c.differentiable = is_floating(d.in.dtype);
    cases.push_back(std::move(c));
  }
  for (const ToDef& d : to_defs()) {
    OpCase c;
    c.name = case_name("to", {d.in}, dtype_name(d.to));
    c.inputs = {d.in};
    const DType to = d.to;
    c.run = [to](const TensorList& in) { return in[0].to(to); };
    c.reference = [to](const std::vector<RefTensor>& in) { return ref_map(in[0], to, [](double v) { return v; }); };
    c.differentiable = is_floating(d.in.dtype) && is_floating(to);
    cases.push_back(std::move(c));
  }
}

}  // namespace flame::test
