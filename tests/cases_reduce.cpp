// Op-table cases for reductions (sum, mean, prod, amax, amin, argmax, argmin, var, std, norm,
// logsumexp, any, all) and the along-a-dim ops (cumsum, softmax, log_softmax). References are
// plain float64 loops over the inputs' values.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "op_table.h"

namespace flame::test {
namespace {

using Values = std::vector<double>;
constexpr double kInf = std::numeric_limits<double>::infinity();

int64_t wrap(int64_t d, int64_t ndim) { return d < 0 ? d + std::max<int64_t>(ndim, 1) : d; }

// Groups the input's values by output element (row-major over the reduced dims inside a group)
// and reduces each group with f. Empty dims reduce every dim.
RefTensor ref_reduce(const RefTensor& in, const Shape& dims, bool keepdim, DType out,
                     const std::function<double(const Values&)>& f) {
  const int64_t nd = static_cast<int64_t>(in.shape.size());
  std::vector<bool> reduced(static_cast<std::size_t>(nd), dims.empty());
  for (int64_t d : dims) {
    if (nd > 0) reduced[wrap(d, nd)] = true;
  }
  Shape out_shape;
  for (int64_t d = 0; d < nd; ++d) {
    if (!reduced[d]) out_shape.push_back(in.shape[d]);
    else if (keepdim) out_shape.push_back(1);
  }
  RefTensor r(out_shape, out);
  std::vector<Values> groups(static_cast<std::size_t>(r.numel()));
  for (int64_t i = 0; i < in.numel(); ++i) {
    const Shape idx = in.unravel(i);
    int64_t o = 0;
    for (int64_t d = 0; d < nd; ++d) {
      if (!reduced[d]) o = o * in.shape[d] + idx[d];
    }
    groups[o].push_back(in.v[i]);
  }
  for (int64_t o = 0; o < r.numel(); ++o) r.v[o] = round_to(out, f(groups[o]));
  return r;
}

// Applies f to every line of the input along dim (a 0-d input is one line of length 1).
RefTensor ref_along(const RefTensor& in, int64_t dim, DType out, const std::function<Values(const Values&)>& f) {
  RefTensor r(in.shape, out);
  if (in.shape.empty()) {
    r.v[0] = round_to(out, f({in.v[0]})[0]);
    return r;
  }
  const int64_t d = wrap(dim, static_cast<int64_t>(in.shape.size()));
  int64_t inner = 1;
  for (std::size_t k = d + 1; k < in.shape.size(); ++k) inner *= in.shape[k];
  const int64_t len = in.shape[d];
  const int64_t outer = len == 0 ? 0 : in.numel() / (len * inner);
  for (int64_t a = 0; a < outer; ++a) {
    for (int64_t b = 0; b < inner; ++b) {
      Values line(static_cast<std::size_t>(len));
      for (int64_t i = 0; i < len; ++i) line[i] = in.v[(a * len + i) * inner + b];
      const Values res = f(line);
      for (int64_t i = 0; i < len; ++i) r.v[(a * len + i) * inner + b] = round_to(out, res[i]);
    }
  }
  return r;
}

double ref_sum(const Values& v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}
double ref_mean(const Values& v) { return ref_sum(v) / static_cast<double>(v.size()); }
double ref_var(const Values& v, int64_t correction) {
  const double m = ref_mean(v);
  double ss = 0;
  for (double x : v) ss += (x - m) * (x - m);
  return ss / std::max(0.0, static_cast<double>(v.size()) - static_cast<double>(correction));
}
double ref_norm(const Values& v, double p) {
  if (std::isinf(p)) {
    double best = std::fabs(v[0]);
    for (double x : v) best = p > 0 ? std::max(best, std::fabs(x)) : std::min(best, std::fabs(x));
    return best;
  }
  double s = 0;
  for (double x : v) s += p == 0 ? (x != 0 ? 1.0 : 0.0) : std::pow(std::fabs(x), p);
  return p == 0 ? s : std::pow(s, 1.0 / p);
}
double ref_logsumexp(const Values& v) {
  double m = -kInf;
  for (double x : v) m = std::max(m, x);
  if (std::isinf(m)) m = 0;
  double s = 0;
  for (double x : v) s += std::exp(x - m);
  return std::log(s) + m;
}
// Index of the first extreme element (sign = +1 for argmax, -1 for argmin).
double ref_arg(const Values& v, double sign) {
  std::size_t best = 0;
  for (std::size_t i = 1; i < v.size(); ++i) {
    if (sign * v[i] > sign * v[best]) best = i;
  }
  return static_cast<double>(best);
}

// ---- dims reductions ----

enum class OutRule { same, sum, boolean };  // keep dtype; ints/bool -> i64; bool

struct ReduceDef {
  std::string name;
  std::function<Tensor(const Tensor&, const Shape&, bool)> run;
  std::function<double(const Values&)> ref;
  OutRule rule = OutRule::same;
  bool floating_only = true;  // mean, var, ...: integer inputs are rejected
  bool needs_nonempty = false;  // amax, amin: no identity
  bool differentiable = true;
  double lo = -2.0, hi = 2.0;
  // Optional transform applied to the input in both run (already inside `run`) and reference.
  std::function<double(double)> pre;
};

ReduceDef def(std::string name, std::function<Tensor(const Tensor&, const Shape&, bool)> run,
              std::function<double(const Values&)> ref, OutRule rule = OutRule::same, bool floating_only = true,
              bool needs_nonempty = false) {
  ReduceDef d;
  d.name = std::move(name);
  d.run = std::move(run);
  d.ref = std::move(ref);
  d.rule = rule;
  d.floating_only = floating_only;
  d.needs_nonempty = needs_nonempty;
  return d;
}

std::vector<ReduceDef> reduce_defs() {
  auto relu = [](double x) { return x < 0 ? 0.0 : x; };
  std::vector<ReduceDef> d;
  d.push_back(def("sum", [](const Tensor& x, const Shape& s, bool k) { return x.sum(s, k); }, ref_sum, OutRule::sum,
               false));
  d.push_back(def("mean", [](const Tensor& x, const Shape& s, bool k) { return x.mean(s, k); }, ref_mean));
  {
    ReduceDef p = def("prod", [](const Tensor& x, const Shape& s, bool k) { return x.prod(s, k); },
                [](const Values& v) {
                  double r = 1;
                  for (double x : v) r *= x;
                  return r;
                },
                OutRule::sum, false);
    p.lo = 0.5;
    p.hi = 1.5;
    d.push_back(p);
  }
  d.push_back(def("amax", [](const Tensor& x, const Shape& s, bool k) { return amax(x, s, k); },
               [](const Values& v) { return *std::max_element(v.begin(), v.end()); }, OutRule::same, false, true));
  d.push_back(def("amin", [](const Tensor& x, const Shape& s, bool k) { return x.min(s, k); },
               [](const Values& v) { return *std::min_element(v.begin(), v.end()); }, OutRule::same, false, true));
  d.push_back(def("var", [](const Tensor& x, const Shape& s, bool k) { return x.var(s, 1, k); },
               [](const Values& v) { return ref_var(v, 1); }));
  d.push_back(def("var_c0", [](const Tensor& x, const Shape& s, bool k) { return x.var(s, 0, k); },
               [](const Values& v) { return ref_var(v, 0); }));
  d.push_back(def("std", [](const Tensor& x, const Shape& s, bool k) { return x.std(s, 1, k); },
               [](const Values& v) { return std::sqrt(ref_var(v, 1)); }));
  d.push_back(def("std_c2", [](const Tensor& x, const Shape& s, bool k) { return x.std(s, 2, k); },
               [](const Values& v) { return std::sqrt(ref_var(v, 2)); }));
  d.push_back(def("norm2", [](const Tensor& x, const Shape& s, bool k) { return x.norm(2.0, s, k); },
               [](const Values& v) { return ref_norm(v, 2); }));
  d.push_back(def("norm1", [](const Tensor& x, const Shape& s, bool k) { return x.norm(1.0, s, k); },
               [](const Values& v) { return ref_norm(v, 1); }));
  d.push_back(def("norm3", [](const Tensor& x, const Shape& s, bool k) { return x.norm(3.0, s, k); },
               [](const Values& v) { return ref_norm(v, 3); }));
  d.push_back(def("norm_inf", [](const Tensor& x, const Shape& s, bool k) { return x.norm(INFINITY, s, k); },
               [](const Values& v) { return ref_norm(v, kInf); }, OutRule::same, true, true));
  d.push_back(def("norm_neginf", [](const Tensor& x, const Shape& s, bool k) { return x.norm(-INFINITY, s, k); },
               [](const Values& v) { return ref_norm(v, -kInf); }, OutRule::same, true, true));
  {
    // relu first so that about half the entries are exactly zero.
    ReduceDef n0 = def("norm0", [](const Tensor& x, const Shape& s, bool k) { return x.relu().norm(0.0, s, k); },
                 [](const Values& v) { return ref_norm(v, 0); });
    n0.differentiable = false;
    n0.pre = relu;
    d.push_back(n0);
  }
  {
    ReduceDef l = def("logsumexp", [](const Tensor& x, const Shape& s, bool k) { return x.logsumexp(s, k); },
                ref_logsumexp);
    l.lo = -5;
    l.hi = 5;
    d.push_back(l);
  }
  {
    ReduceDef a = def("any", [](const Tensor& x, const Shape& s, bool k) { return x.any(s, k); },
                [](const Values& v) {
                  bool r = false;
                  for (double x : v) r = r || x != 0;
                  return double(r);
                },
                OutRule::boolean, false);
    a.differentiable = false;
    a.lo = -1;  // integers in [-1, 2): zeros are common
    a.hi = 2;
    d.push_back(a);
    ReduceDef b = a;
    b.name = "all";
    b.run = [](const Tensor& x, const Shape& s, bool k) { return x.all(s, k); };
    b.ref = [](const Values& v) {
      bool r = true;
      for (double x : v) r = r && x != 0;
      return double(r);
    };
    d.push_back(b);
    // Floating inputs with exact zeros (relu) so that any/all see both outcomes.
    for (const char* nm : {"any", "all"}) {
      ReduceDef f = std::string(nm) == "any" ? a : b;
      f.name = std::string(nm) + "_relu";
      auto inner = f.run;
      f.run = [inner](const Tensor& x, const Shape& s, bool k) { return inner(x.relu(), s, k); };
      f.pre = relu;
      f.floating_only = true;
      f.lo = -2;
      f.hi = 0.5;
      d.push_back(f);
    }
  }
  return d;
}

struct ReduceConfig {
  InputSpec spec;
  Shape dims;
  bool keepdim = false;
};

std::string dims_tag(const Shape& dims, bool keepdim) {
  std::string s = "d";
  if (dims.empty()) s += "all";
  for (int64_t d : dims) s += (d < 0 ? "m" + std::to_string(-d) : std::to_string(d));
  if (keepdim) s += "_keep";
  return s;
}

DType out_dtype(OutRule rule, DType in) {
  switch (rule) {
    case OutRule::same: return in;
    case OutRule::sum: return is_floating(in) ? in : DType::i64;
    case OutRule::boolean: return DType::boolean;
  }
  return in;
}

// Tolerances: f32 results leave room for float accumulation (the CUDA kernels); half types use
// their defaults (one rounding of an accurate value).
void set_tolerances(OpCase& c, DType out) {
  if (out == DType::f32) {
    c.rtol = 1e-5;
    c.atol = 2e-5;
  }
}

void add_dim_reductions(CaseList& cases) {
  const std::vector<ReduceConfig> f32_configs = {
      {{{3, 5, 7}}, {}, false},
      {{{3, 5, 7}}, {1}, true},
      {{{3, 5, 7}}, {0, 2}, false},
      {{{3, 5, 7}}, {-1}, false},
      {{{3, 5, 7}}, {-3, -1}, true},
      {{{3, 5, 7}}, {2, 0, 1}, false},
      {{{1, 5}}, {0}, false},
      {{{4, 1, 3}}, {1}, true},
      {{{}}, {}, false},
      {{{}}, {0}, true},
      {{{}}, {-1}, false},
      {{{4, 6}, DType::f32, Layout::transposed}, {0}, false},
      {{{4, 6}, DType::f32, Layout::transposed}, {}, false},
      {{{4, 6}, DType::f32, Layout::sliced}, {1}, true},
      {{{4, 6}, DType::f32, Layout::expanded}, {0}, false},
      {{{3, 4, 5}, DType::f32, Layout::expanded}, {0, 2}, true},
      {{{2, 0, 3}}, {2}, false},     // empty output
      {{{2, 0, 3}}, {1}, false},     // empty reduced extent
      {{{0}}, {}, false},            // empty input, reduce all
      {{{2, 0, 3}}, {0, 1}, true},   // empty reduced extent, keepdim
  };
  const std::vector<ReduceConfig> float_configs = {
      {{{3, 5, 7}}, {1}, false},
      {{{3, 5, 7}}, {}, false},
      {{{5, 6}, DType::f32, Layout::transposed}, {0}, true},
  };
  const std::vector<ReduceConfig> int_configs = {
      {{{3, 5, 7}}, {1}, false},
      {{{4, 6}, DType::f32, Layout::transposed}, {}, false},
  };
  for (const ReduceDef& d : reduce_defs()) {
    std::vector<ReduceConfig> configs;
    for (ReduceConfig c : f32_configs) {
      int64_t extent = 1;
      const int64_t nd = static_cast<int64_t>(c.spec.shape.size());
      for (int64_t k = 0; k < nd; ++k) {
        const bool red = c.dims.empty() || std::find_if(c.dims.begin(), c.dims.end(), [&](int64_t x) {
                                             return wrap(x, nd) == k;
                                           }) != c.dims.end();
        if (red) extent *= c.spec.shape[k];
      }
      if (d.needs_nonempty && extent == 0) continue;  // an error; see test_reduce.cpp
      configs.push_back(c);
    }
    for (DType dt : {DType::f64, DType::bf16, DType::f16}) {
      for (ReduceConfig c : float_configs) {
        c.spec.dtype = dt;
        configs.push_back(c);
      }
    }
    if (!d.floating_only) {
      for (DType dt : {DType::i32, DType::i64, DType::boolean}) {
        for (ReduceConfig c : int_configs) {
          c.spec.dtype = dt;
          configs.push_back(c);
        }
      }
    }
    for (ReduceConfig cfg : configs) {
      cfg.spec.lo = d.lo;
      cfg.spec.hi = d.hi;
      if (!is_floating(cfg.spec.dtype) && d.lo > 0) {  // prod: keep integer products small and non-zero
        cfg.spec.lo = 1;
        cfg.spec.hi = 3;
      }
      if (!is_floating(cfg.spec.dtype) && cfg.spec.lo < -1 && d.rule != OutRule::boolean) {
        cfg.spec.lo = -3;
        cfg.spec.hi = 4;
      }
      if (!is_floating(cfg.spec.dtype) && d.rule == OutRule::boolean) {
        cfg.spec.lo = -1;
        cfg.spec.hi = 2;
      }
      OpCase c;
      c.name = case_name(d.name, {cfg.spec}, dims_tag(cfg.dims, cfg.keepdim));
      c.inputs = {cfg.spec};
      auto run = d.run;
      const Shape dims = cfg.dims;
      const bool keepdim = cfg.keepdim;
      c.run = [run, dims, keepdim](const TensorList& in) { return run(in[0], dims, keepdim); };
      const DType out = out_dtype(d.rule, cfg.spec.dtype);
      auto ref = d.ref;
      auto pre = d.pre;
      c.reference = [ref, pre, dims, keepdim, out](const std::vector<RefTensor>& in) {
        RefTensor x = in[0];
        if (pre) {
          for (double& v : x.v) v = round_to(x.dtype, pre(v));
        }
        return ref_reduce(x, dims, keepdim, out, ref);
      };
      set_tolerances(c, out);
      c.differentiable = d.differentiable && is_floating(cfg.spec.dtype);
      cases.push_back(std::move(c));
    }
  }
}

// ---- argmax / argmin ----

void add_arg_reductions(CaseList& cases) {
  struct ArgConfig {
    InputSpec spec;
    std::optional<int64_t> dim;
    bool keepdim = false;
  };
  const std::vector<ArgConfig> configs = {
      {{{3, 5, 7}}, std::nullopt, false},
      {{{3, 5, 7}}, std::nullopt, true},
      {{{3, 5, 7}}, 1, false},
      {{{3, 5, 7}}, -1, true},
      {{{3, 5, 7}}, 0, false},
      {{{1, 5}}, 0, false},
      {{{}}, std::nullopt, false},
      {{{}}, 0, true},
      {{{4, 6}, DType::f32, Layout::transposed}, 0, false},
      {{{4, 6}, DType::f32, Layout::transposed}, std::nullopt, false},
      {{{4, 6}, DType::f32, Layout::sliced}, 1, false},
      {{{4, 6}, DType::f32, Layout::expanded}, 1, true},
      {{{2, 0, 3}}, 2, false},  // empty output, non-empty extent
      {{{3, 5, 7}, DType::f64}, 1, false},
      {{{3, 5, 7}, DType::bf16}, 2, false},
      {{{5, 6}, DType::f16, Layout::transposed}, 0, false},
      {{{3, 5, 7}, DType::i32, Layout::contiguous, -3, 4}, 1, false},  // ties: first occurrence
      {{{3, 5, 7}, DType::i64, Layout::contiguous, -3, 4}, std::nullopt, false},
      {{{4, 6}, DType::boolean}, 1, false},
  };
  for (const bool is_max : {true, false}) {
    for (const ArgConfig& cfg : configs) {
      OpCase c;
      const std::string tag = cfg.dim ? dims_tag({*cfg.dim}, cfg.keepdim) : (cfg.keepdim ? "dnone_keep" : "dnone");
      c.name = case_name(is_max ? "argmax" : "argmin", {cfg.spec}, tag);
      c.inputs = {cfg.spec};
      const auto dim = cfg.dim;
      const bool keepdim = cfg.keepdim;
      c.run = [is_max, dim, keepdim](const TensorList& in) {
        return is_max ? in[0].argmax(dim, keepdim) : in[0].argmin(dim, keepdim);
      };
      c.reference = [is_max, dim, keepdim](const std::vector<RefTensor>& in) {
        const double sign = is_max ? 1.0 : -1.0;
        // dim = nullopt: index into the flattened tensor (all dims reduced in row-major order).
        return ref_reduce(in[0], dim ? Shape{*dim} : Shape{}, keepdim, DType::i64,
                          [sign](const Values& v) { return ref_arg(v, sign); });
      };
      cases.push_back(std::move(c));
    }
  }
}

// ---- cumsum, softmax, log_softmax ----

Values ref_softmax(const Values& v, bool log) {
  double m = -kInf;
  for (double x : v) m = std::max(m, x);
  double s = 0;
  for (double x : v) s += std::exp(x - m);
  Values r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = log ? (v[i] - m) - std::log(s) : std::exp(v[i] - m) / s;
  return r;
}

void add_along_dim(CaseList& cases) {
  struct AlongConfig {
    InputSpec spec;
    int64_t dim;
  };
  const std::vector<AlongConfig> f32_configs = {
      {{{3, 5, 7}}, 1},
      {{{3, 5, 7}}, -1},
      {{{3, 5, 7}}, 0},
      {{{1, 5}}, 0},
      {{{5, 1}}, 1},
      {{{}}, 0},
      {{{}}, -1},
      {{{4, 6}, DType::f32, Layout::transposed}, 0},
      {{{4, 6}, DType::f32, Layout::transposed}, 1},
      {{{4, 6}, DType::f32, Layout::sliced}, -1},
      {{{4, 6}, DType::f32, Layout::expanded}, 0},
      {{{2, 0, 3}}, 1},
      {{{2, 0, 3}}, 2},
      {{{3, 5, 7}, DType::f64}, 1},
      {{{3, 5, 7}, DType::bf16}, 2},
      {{{3, 5, 7}, DType::f16}, 0},
      {{{5, 6}, DType::bf16, Layout::transposed}, 0},
  };
  const std::vector<AlongConfig> int_configs = {
      {{{3, 5, 7}, DType::i32, Layout::contiguous, -5, 5}, 1},
      {{{4, 6}, DType::i64, Layout::transposed, -5, 5}, 0},
      {{{4, 6}, DType::boolean}, -1},
  };
  for (const std::string op : {"cumsum", "softmax", "log_softmax"}) {
    std::vector<AlongConfig> configs = f32_configs;
    if (op == "cumsum") configs.insert(configs.end(), int_configs.begin(), int_configs.end());
    for (AlongConfig cfg : configs) {
      if (op != "cumsum" && is_floating(cfg.spec.dtype)) {
        cfg.spec.lo = -4;
        cfg.spec.hi = 4;
      }
      OpCase c;
      c.name = case_name(op, {cfg.spec}, dims_tag({cfg.dim}, false));
      c.inputs = {cfg.spec};
      const int64_t dim = cfg.dim;
      const DType in_dt = cfg.spec.dtype;
      const DType out = op == "cumsum" && !is_floating(in_dt) ? DType::i64 : in_dt;
      if (op == "cumsum") {
        c.run = [dim](const TensorList& in) { return in[0].cumsum(dim); };
        c.reference = [dim, out](const std::vector<RefTensor>& in) {
          return ref_along(in[0], dim, out, [](const Values& v) {
            Values r(v.size());
            double s = 0;
            for (std::size_t i = 0; i < v.size(); ++i) r[i] = s += v[i];
            return r;
          });
        };
      } else {
        const bool log = op == "log_softmax";
        c.run = [dim, log](const TensorList& in) { return log ? in[0].log_softmax(dim) : in[0].softmax(dim); };
        c.reference = [dim, out, log](const std::vector<RefTensor>& in) {
          return ref_along(in[0], dim, out, [log](const Values& v) { return ref_softmax(v, log); });
        };
      }
      set_tolerances(c, out);
      c.differentiable = is_floating(in_dt);
      cases.push_back(std::move(c));
    }
  }
}

}  // namespace

void add_reduce_cases(CaseList& cases) {
  add_dim_reductions(cases);
  add_arg_reductions(cases);
  add_along_dim(cases);
}

}  // namespace flame::test
