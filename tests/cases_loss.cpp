// Op-table cases for the losses. References are float64 loops over the inputs' values.
#include <cmath>
#include <limits>

#include "op_table.h"

namespace flame::test {
namespace {

const char* reduction_name(Reduction r) {
  switch (r) {
    case Reduction::none: return "none";
    case Reduction::mean: return "mean";
    case Reduction::sum: return "sum";
  }
  return "?";
}

// Reduces per-element losses (shape `shape`); `count` is the mean's divisor.
RefTensor ref_reduce(const Shape& shape, const std::vector<double>& loss, double count, Reduction r, DType dt) {
  if (r == Reduction::none) {
    RefTensor out(shape, dt);
    for (std::size_t i = 0; i < loss.size(); ++i) out.v[i] = round_to(dt, loss[i]);
    return out;
  }
  double total = 0.0;
  for (double l : loss) total += l;
  RefTensor out({}, dt);
  out.v[0] = round_to(dt, r == Reduction::sum ? total : total / count);
  return out;
}

void set_half_tolerance(OpCase& c, DType dt) {
  if (dt == DType::bf16) c.rtol = c.atol = 2e-2;
  if (dt == DType::f16) c.rtol = c.atol = 5e-3;
}

// ---- pointwise losses ----
void add_pointwise(CaseList& cases) {
  struct Def {
    std::string name;
    std::function<Tensor(const Tensor&, const Tensor&, Reduction)> run;
    std::function<double(double, double)> ref;
    double lo, hi, tlo, thi;  // input and target ranges
  };
  const std::vector<Def> defs = {
      {"mse_loss", [](const Tensor& x, const Tensor& t, Reduction r) { return mse_loss(x, t, r); },
       [](double x, double t) { return (x - t) * (x - t); }, -2, 2, -2, 2},
      {"l1_loss", [](const Tensor& x, const Tensor& t, Reduction r) { return l1_loss(x, t, r); },
       [](double x, double t) { return std::fabs(x - t); }, -2, 2, -2, 2},
      {"binary_cross_entropy_with_logits",
       [](const Tensor& x, const Tensor& t, Reduction r) { return binary_cross_entropy_with_logits(x, t, r); },
       [](double x, double t) {
         // -(t log s(x) + (1 - t) log(1 - s(x))) with log s(x) = -log(1 + e^-x), in a form exact in double.
         const double log_s = x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x));
         const double log_1ms = x >= 0 ? -x - std::log1p(std::exp(-x)) : -std::log1p(std::exp(x));
         return -(t * log_s + (1 - t) * log_1ms);
       },
       -4, 4, 0, 1},
  };
  struct Shapes {
    InputSpec x, t;
  };
  for (const Def& d : defs) {
    auto in = [&](Shape s, DType dt, Layout l = Layout::contiguous) { return InputSpec{s, dt, l, d.lo, d.hi}; };
    auto tg = [&](Shape s, DType dt, Layout l = Layout::contiguous) { return InputSpec{s, dt, l, d.tlo, d.thi}; };
    std::vector<std::pair<Shapes, std::vector<Reduction>>> rows = {
        {{in({3, 5}, DType::f32), tg({3, 5}, DType::f32)}, {Reduction::none, Reduction::mean, Reduction::sum}},
        {{in({3, 5}, DType::f64), tg({3, 5}, DType::f64)}, {Reduction::none, Reduction::mean, Reduction::sum}},
        {{in({3, 5}, DType::bf16), tg({3, 5}, DType::bf16)}, {Reduction::none, Reduction::mean}},
        {{in({4, 3}, DType::f16), tg({4, 3}, DType::f16)}, {Reduction::mean}},
        {{in({2, 3, 4}, DType::f32, Layout::transposed), tg({2, 3, 4}, DType::f32, Layout::sliced)},
         {Reduction::none, Reduction::mean}},
        {{in({4, 3}, DType::f32, Layout::expanded), tg({4, 3}, DType::f32)}, {Reduction::sum}},
        {{in({}, DType::f32), tg({}, DType::f32)}, {Reduction::none, Reduction::mean}},
        {{in({0, 3}, DType::f32), tg({0, 3}, DType::f32)}, {Reduction::none, Reduction::sum}},
        {{in({3, 4}, DType::f32), tg({3, 4}, DType::f64)}, {Reduction::mean}},  // promotes to f64
    };
    if (d.name == "binary_cross_entropy_with_logits") {
      // Large logits: the stable form neither overflows nor loses the linear part.
      InputSpec big = in({6, 5}, DType::f32);
      big.lo = -60;
      big.hi = 60;
      rows.push_back({{big, tg({6, 5}, DType::f32)}, {Reduction::none}});
      big.dtype = DType::f64;
      rows.push_back({{big, tg({6, 5}, DType::f64)}, {Reduction::none}});
    }
    for (const auto& [s, reductions] : rows) {
      for (Reduction r : reductions) {
        OpCase c;
        c.name = case_name(d.name, {s.x, s.t}, reduction_name(r));
        c.inputs = {s.x, s.t};
        auto run = d.run;
        c.run = [run, r](const TensorList& t) { return run(t[0], t[1], r); };
        const DType out = promote_types(s.x.dtype, s.t.dtype);
        auto ref = d.ref;
        c.reference = [ref, r, out](const std::vector<RefTensor>& in) {
          std::vector<double> loss(static_cast<std::size_t>(in[0].numel()));
          for (std::size_t i = 0; i < loss.size(); ++i) {
            // Elementwise parts run in the promoted dtype, rounded at each op as the kernels do.
            loss[i] = ref(round_to(out, in[0].v[i]), round_to(out, in[1].v[i]));
          }
          return ref_reduce(in[0].shape, loss, static_cast<double>(loss.size()), r, out);
        };
        set_half_tolerance(c, out);
        if (out == DType::f32) c.atol = 1e-5;  // a few rounded f32 ops per element
        c.differentiable = true;
        cases.push_back(std::move(c));
      }
    }
  }
}

// ---- class-index losses ----
struct ClassCase {
  InputSpec scores, target;
  std::vector<Reduction> reductions;
  int64_t ignore_index = -100;
  double smoothing = 0.0;
};

// Per-target losses of scores [C] / [N, C, d...]; log_softmax first when `softmax`.
RefTensor ref_class_loss(const RefTensor& x, const RefTensor& t, Reduction r, int64_t ignore, double eps,
                         bool softmax) {
  const bool one = x.shape.size() == 1;
  const int64_t n = one ? 1 : x.shape[0], classes = one ? x.shape[0] : x.shape[1];
  int64_t rest = 1;
  for (std::size_t d = 2; d < x.shape.size(); ++d) rest *= x.shape[d];
  std::vector<double> loss(static_cast<std::size_t>(n * rest), 0.0);
  double count = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < rest; ++j) {
      auto at = [&](int64_t c) { return x.v[(i * classes + c) * rest + j]; };
      const int64_t y = static_cast<int64_t>(t.v[i * rest + j]);
      if (y == ignore) continue;
      count += 1.0;
      double lse = 0.0;
      if (softmax) {
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t c = 0; c < classes; ++c) mx = std::max(mx, at(c));
        double s = 0.0;
        for (int64_t c = 0; c < classes; ++c) s += std::exp(at(c) - mx);
        lse = mx + std::log(s);
      }
      double smooth = 0.0;
      for (int64_t c = 0; c < classes; ++c) smooth += -(at(c) - lse);
      loss[i * rest + j] = (1 - eps) * -(at(y) - lse) + eps * smooth / static_cast<double>(classes);
    }
  }
  return ref_reduce(t.shape, loss, count, r, x.dtype);
}

void add_class_losses(CaseList& cases) {
  auto sc = [](Shape s, DType dt = DType::f32, Layout l = Layout::contiguous) { return InputSpec{s, dt, l, -3, 3}; };
  auto tg = [](Shape s, int64_t classes, int64_t lo = 0) {
    return InputSpec{s, DType::i64, Layout::contiguous, static_cast<double>(lo), static_cast<double>(classes)};
  };
  const std::vector<Reduction> all = {Reduction::none, Reduction::mean, Reduction::sum};
  const std::vector<ClassCase> rows = {
      {sc({4, 5}), tg({4}, 5), all},
      {sc({4, 5}, DType::f64), tg({4}, 5), all},
      {sc({4, 5}, DType::bf16), tg({4}, 5), {Reduction::none, Reduction::mean}},
      {sc({4, 5}, DType::f16), tg({4}, 5), {Reduction::mean}},
      {sc({4, 5}, DType::f32, Layout::transposed), tg({4}, 5), {Reduction::mean}},
      {sc({3, 4, 5}), tg({3, 5}, 4), {Reduction::none, Reduction::mean}},
      {sc({2, 3, 2, 2}, DType::f64), tg({2, 2, 2}, 3), {Reduction::none, Reduction::sum}},
      {sc({5}), tg({}, 5), {Reduction::none, Reduction::mean}},
      {sc({1, 1}), tg({1}, 1), {Reduction::mean}},
      // Ignored targets (-1 drawn among the classes) and the mean over the counted ones.
      {sc({12, 4}), tg({12}, 4, -1), all, -1},
      {sc({3, 4, 5}, DType::f64), tg({3, 5}, 4, -1), {Reduction::none, Reduction::mean}, -1},
      // Label smoothing, alone and with ignored targets.
      {sc({4, 5}), tg({4}, 5), {Reduction::none, Reduction::mean}, -100, 0.1},
      {sc({12, 4}, DType::f64), tg({12}, 4, -1), all, -1, 0.25},
      {sc({3, 4, 5}), tg({3, 5}, 4), {Reduction::sum}, -100, 1.0},
      {sc({4, 5}, DType::bf16), tg({4}, 5), {Reduction::mean}, -100, 0.1},
      // No targets: none is empty, sum is 0, mean is 0/0.
      {sc({0, 5}), tg({0}, 5), all},
  };
  for (const bool ce : {true, false}) {
    const std::string op = ce ? "cross_entropy" : "nll_loss";
    for (const ClassCase& row : rows) {
      if (!ce && row.smoothing > 0) continue;
      for (Reduction r : row.reductions) {
        OpCase c;
        std::string extra = reduction_name(r);
        if (row.ignore_index != -100) extra += "_ignore";
        if (row.smoothing > 0) extra += "_smooth" + std::to_string(static_cast<int>(row.smoothing * 100));
        c.name = case_name(op, {row.scores, row.target}, extra);
        c.inputs = {row.scores, row.target};
        const int64_t ignore = row.ignore_index;
        const double eps = row.smoothing;
        if (ce) {
          c.run = [r, ignore, eps](const TensorList& t) { return cross_entropy(t[0], t[1], r, ignore, eps); };
        } else {
          c.run = [r, ignore](const TensorList& t) { return nll_loss(t[0], t[1], r, ignore); };
        }
        c.reference = [r, ignore, eps, ce](const std::vector<RefTensor>& in) {
          return ref_class_loss(in[0], in[1], r, ignore, eps, ce);
        };
        set_half_tolerance(c, row.scores.dtype);
        if (row.scores.dtype == DType::f32) c.atol = 1e-5;
        c.differentiable = true;
        cases.push_back(std::move(c));
      }
    }
  }
}

}  // namespace

void add_loss_cases(CaseList& cases) {
  add_pointwise(cases);
  add_class_losses(cases);
}

}  // namespace flame::test
