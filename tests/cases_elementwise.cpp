// Op-table cases for elementwise unary, binary, scalar and where ops.
#include <cmath>
#include <limits>

#include "op_table.h"

namespace flame::test {
namespace {

// Half-precision results of composite or fast-varying functions need a looser absolute tolerance
// than the dtype default. f16 keeps 11 significant bits to bf16's 8, so its bound is 8x tighter:
// an f16 kernel with bf16-sized errors fails.
double half_atol(DType dt) {
  if (dt == DType::bf16) return 2e-2;
  if (dt == DType::f16) return 2.5e-3;
  return -1.0;  // the dtype's default
}

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

struct UnaryDef {
  std::string name;
  std::function<Tensor(const Tensor&)> run;
  std::function<double(double)> ref;
  enum Kind { same, floating, predicate } kind;
  double lo = -2.0, hi = 2.0;
};

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double softplus(double x, double beta, double threshold) {
  return x * beta > threshold ? x : std::log1p(std::exp(beta * x)) / beta;
}

std::vector<UnaryDef> unary_defs() {
  using K = UnaryDef::Kind;
  return {
      {"neg", [](const Tensor& x) { return x.neg(); }, [](double x) { return -x; }, K::same},
      {"abs", [](const Tensor& x) { return x.abs(); }, [](double x) { return std::fabs(x); }, K::same},
      {"sign", [](const Tensor& x) { return x.sign(); }, [](double x) { return double((x > 0) - (x < 0)); }, K::same},
      {"square", [](const Tensor& x) { return x.square(); }, [](double x) { return x * x; }, K::same},
      {"relu", [](const Tensor& x) { return x.relu(); }, [](double x) { return x < 0 ? 0.0 : x; }, K::same},
      {"floor", [](const Tensor& x) { return x.floor(); }, [](double x) { return std::floor(x); }, K::same, -5, 5},
      {"ceil", [](const Tensor& x) { return x.ceil(); }, [](double x) { return std::ceil(x); }, K::same, -5, 5},
      {"round", [](const Tensor& x) { return x.round(); }, [](double x) { return std::nearbyint(x); }, K::same, -5, 5},
      {"trunc", [](const Tensor& x) { return x.trunc(); }, [](double x) { return std::trunc(x); }, K::same, -5, 5},
      {"clamp", [](const Tensor& x) { return x.clamp(-0.5, 1.25); },
       [](double x) { return std::min(std::max(x, -0.5), 1.25); }, K::floating},
      {"clamp_min", [](const Tensor& x) { return x.clamp(0.3, std::nullopt); },
       [](double x) { return std::max(x, 0.3); }, K::floating},
      {"pow_scalar", [](const Tensor& x) { return x.pow(2.5); }, [](double x) { return std::pow(x, 2.5); },
       K::floating, 0.1, 3.0},
      {"pow_int", [](const Tensor& x) { return x.pow(3); }, [](double x) { return x * x * x; }, K::same},
      {"exp", [](const Tensor& x) { return x.exp(); }, [](double x) { return std::exp(x); }, K::floating},
      {"log", [](const Tensor& x) { return x.log(); }, [](double x) { return std::log(x); }, K::floating, 0.1, 5},
      {"log1p", [](const Tensor& x) { return x.log1p(); }, [](double x) { return std::log1p(x); }, K::floating, -0.9, 3},
      {"expm1", [](const Tensor& x) { return x.expm1(); }, [](double x) { return std::expm1(x); }, K::floating},
      {"sqrt", [](const Tensor& x) { return x.sqrt(); }, [](double x) { return std::sqrt(x); }, K::floating, 0.01, 9},
      {"rsqrt", [](const Tensor& x) { return x.rsqrt(); }, [](double x) { return 1 / std::sqrt(x); }, K::floating, 0.1, 9},
      {"reciprocal", [](const Tensor& x) { return x.reciprocal(); }, [](double x) { return 1 / x; }, K::floating, 0.25, 4},
      {"sin", [](const Tensor& x) { return x.sin(); }, [](double x) { return std::sin(x); }, K::floating, -4, 4},
      {"cos", [](const Tensor& x) { return x.cos(); }, [](double x) { return std::cos(x); }, K::floating, -4, 4},
      {"tanh", [](const Tensor& x) { return x.tanh(); }, [](double x) { return std::tanh(x); }, K::floating, -4, 4},
      {"sigmoid", [](const Tensor& x) { return x.sigmoid(); }, sigmoid, K::floating, -6, 6},
      {"leaky_relu", [](const Tensor& x) { return x.leaky_relu(0.2); }, [](double x) { return x > 0 ? x : 0.2 * x; },
       K::floating},
      {"gelu", [](const Tensor& x) { return x.gelu(); },
       [](double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }, K::floating, -4, 4},
      {"gelu_tanh", [](const Tensor& x) { return x.gelu(true); },
       [](double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); },
       K::floating, -4, 4},
      {"silu", [](const Tensor& x) { return x.silu(); }, [](double x) { return x * sigmoid(x); }, K::floating, -6, 6},
      {"softplus", [](const Tensor& x) { return x.softplus(); }, [](double x) { return softplus(x, 1, 20); },
       K::floating, -6, 6},
      {"softplus_beta", [](const Tensor& x) { return x.softplus(2.0, 3.0); },
       [](double x) { return softplus(x, 2, 3); }, K::floating, -3, 3},
      {"mish", [](const Tensor& x) { return x.mish(); }, [](double x) { return x * std::tanh(std::log1p(std::exp(x))); },
       K::floating, -5, 5},
      {"elu", [](const Tensor& x) { return x.elu(0.7); }, [](double x) { return x > 0 ? x : 0.7 * std::expm1(x); },
       K::floating, -3, 3},
      {"hardswish", [](const Tensor& x) { return hardswish(x); },
       [](double x) { return x <= -3 ? 0.0 : (x >= 3 ? x : x * (x + 3) / 6); }, K::floating, -5, 5},
      {"softsign", [](const Tensor& x) { return x.softsign(); }, [](double x) { return x / (1 + std::fabs(x)); },
       K::floating, -4, 4},
      {"hardsigmoid", [](const Tensor& x) { return hardsigmoid(x); },
       [](double x) { return x <= -3 ? 0.0 : (x >= 3 ? 1.0 : x / 6 + 0.5); }, K::floating, -5, 5},
      {"isnan", [](const Tensor& x) { return x.log().isnan(); }, [](double x) { return double(x < 0); }, K::predicate},
      // 1 / floor(x) is +-inf for x in [0, 1) (sign from x - 0.5; NaN, not inf, at x = 0.5) and
      // finite elsewhere, in every float dtype: the case fails if isinf answers a constant.
      {"isinf", [](const Tensor& x) { return (x.floor().reciprocal() * (x - 0.5).sign()).isinf(); },
       [](double x) { return double(x >= 0 && x < 1 && x != 0.5); }, K::predicate},
      {"logical_not", [](const Tensor& x) { return x.gt(Tensor::scalar(0.5, x.device())).logical_not(); },
       [](double x) { return double(!(x > 0.5)); }, K::predicate},
      {"add_scalar", [](const Tensor& x) { return x + 3; }, [](double x) { return x + 3; }, K::same},
      {"sub_scalar", [](const Tensor& x) { return x - 2; }, [](double x) { return x - 2; }, K::same},
      {"mul_scalar", [](const Tensor& x) { return x * 3; }, [](double x) { return x * 3; }, K::same},
      {"rsub_scalar", [](const Tensor& x) { return 5 - x; }, [](double x) { return 5 - x; }, K::same},
      {"div_scalar", [](const Tensor& x) { return x / 4; }, [](double x) { return x / 4; }, K::floating},
      {"rdiv_scalar", [](const Tensor& x) { return 2 / x; }, [](double x) { return 2 / x; }, K::floating, 0.5, 3},
      {"mul_float_scalar", [](const Tensor& x) { return x * 0.1; }, [](double x) { return x * 0.1; }, K::floating},
  };
}

DType unary_result(UnaryDef::Kind k, DType in) {
  if (k == UnaryDef::predicate) return DType::boolean;
  if (k == UnaryDef::floating && !is_floating(in)) return DType::f32;
  return in;
}

void add_unary(CaseList& cases) {
  const std::vector<DType> float_types = {DType::f32, DType::f64, DType::bf16, DType::f16};
  for (const UnaryDef& d : unary_defs()) {
    std::vector<InputSpec> specs;
    for (DType dt : float_types) specs.push_back({{3, 5}, dt, Layout::contiguous, d.lo, d.hi});
    // Integer inputs: "same" ops keep the dtype, "floating" ops promote to f32.
    const bool int_ok = d.name != "isnan" && d.name != "isinf" && d.name != "logical_not" &&
                        d.name != "clamp_min" && d.name != "rdiv_scalar";
    if (int_ok) {
      const double lo = d.lo < 0 ? -5 : 1, hi = d.hi < 4 ? 4 : d.hi;
      specs.push_back({{4, 3}, DType::i32, Layout::contiguous, lo, hi});
      specs.push_back({{7}, DType::i64, Layout::contiguous, lo, hi});
      if (d.name != "neg" && d.name != "sign" && d.name != "rsub_scalar" && d.name != "sub_scalar") {
        specs.push_back({{5}, DType::u8, Layout::contiguous, 1, 4});
      }
    }
    // Odd, empty, 0-d and non-contiguous shapes in f32.
    for (const Shape& s : std::vector<Shape>{{}, {0}, {1}, {2, 0, 3}, {2, 3, 17}}) {
      specs.push_back({s, DType::f32, Layout::contiguous, d.lo, d.hi});
    }
    for (Layout l : {Layout::transposed, Layout::sliced, Layout::expanded}) {
      specs.push_back({{4, 6}, DType::f32, l, d.lo, d.hi});
    }
    specs.push_back({{3, 4}, DType::bf16, Layout::transposed, d.lo, d.hi});
    for (const InputSpec& s : specs) {
      OpCase c;
      c.name = case_name(d.name, {s});
      c.inputs = {s};
      auto run = d.run;
      c.run = [run](const TensorList& in) { return run(in[0]); };
      auto ref = d.ref;
      const DType out = unary_result(d.kind, s.dtype);
      c.reference = [ref, out](const std::vector<RefTensor>& in) { return ref_map(in[0], out, ref); };
      // Half-precision inputs into fast-varying functions need a looser absolute tolerance.
      c.atol = half_atol(s.dtype);
      c.differentiable = d.kind != UnaryDef::predicate && is_floating(s.dtype);
      cases.push_back(std::move(c));
    }
  }
}

struct BinaryDef {
  std::string name;
  std::function<Tensor(const Tensor&, const Tensor&)> run;
  std::function<double(double, double)> ref;
  enum Kind { same, floating, predicate } kind;
  double lo = -2.0, hi = 2.0, blo = -2.0, bhi = 2.0;
};

std::vector<BinaryDef> binary_defs() {
  using K = BinaryDef::Kind;
  return {
      {"add", [](const Tensor& a, const Tensor& b) { return a + b; }, [](double a, double b) { return a + b; }, K::same},
      {"sub", [](const Tensor& a, const Tensor& b) { return a - b; }, [](double a, double b) { return a - b; }, K::same},
      {"mul", [](const Tensor& a, const Tensor& b) { return a * b; }, [](double a, double b) { return a * b; }, K::same},
      {"div", [](const Tensor& a, const Tensor& b) { return a / b; }, [](double a, double b) { return a / b; },
       K::floating, -3, 3, 0.5, 3},
      {"pow", [](const Tensor& a, const Tensor& b) { return a.pow(b); },
       [](double a, double b) { return std::pow(a, b); }, K::same, 0.5, 3, 0, 3},
      {"maximum", [](const Tensor& a, const Tensor& b) { return a.maximum(b); },
       [](double a, double b) { return std::max(a, b); }, K::same},
      {"minimum", [](const Tensor& a, const Tensor& b) { return a.minimum(b); },
       [](double a, double b) { return std::min(a, b); }, K::same},
      {"atan2", [](const Tensor& a, const Tensor& b) { return a.atan2(b); },
       [](double a, double b) { return std::atan2(a, b); }, K::floating},
      {"fmod", [](const Tensor& a, const Tensor& b) { return a.fmod(b); },
       [](double a, double b) { return std::fmod(a, b); }, K::same, -7, 7, 1, 3},
      {"eq", [](const Tensor& a, const Tensor& b) { return a.eq(b); }, [](double a, double b) { return double(a == b); },
       K::predicate, -2, 2, -2, 2},
      {"ne", [](const Tensor& a, const Tensor& b) { return a.ne(b); }, [](double a, double b) { return double(a != b); },
       K::predicate, -2, 2, -2, 2},
      {"lt", [](const Tensor& a, const Tensor& b) { return a.lt(b); }, [](double a, double b) { return double(a < b); },
       K::predicate},
      {"le", [](const Tensor& a, const Tensor& b) { return a.le(b); }, [](double a, double b) { return double(a <= b); },
       K::predicate},
      {"gt", [](const Tensor& a, const Tensor& b) { return a.gt(b); }, [](double a, double b) { return double(a > b); },
       K::predicate},
      {"ge", [](const Tensor& a, const Tensor& b) { return a.ge(b); }, [](double a, double b) { return double(a >= b); },
       K::predicate},
      {"logical_and", [](const Tensor& a, const Tensor& b) { return a.logical_and(b); },
       [](double a, double b) { return double(a != 0 && b != 0); }, K::predicate, -1, 2, -1, 2},
      {"logical_or", [](const Tensor& a, const Tensor& b) { return a.logical_or(b); },
       [](double a, double b) { return double(a != 0 || b != 0); }, K::predicate, -1, 2, -1, 2},
  };
}

void add_binary(CaseList& cases) {
  struct Pair {
    InputSpec a, b;
    DType common;
  };
  for (const BinaryDef& d : binary_defs()) {
    auto spec = [&](Shape s, DType dt, Layout l, bool second) {
      InputSpec sp{std::move(s), dt, l, second ? d.blo : d.lo, second ? d.bhi : d.hi};
      if (!is_floating(dt)) {  // integer ranges: keep divisors/exponents meaningful
        sp.lo = std::floor(sp.lo);
        sp.hi = std::ceil(sp.hi);
        if (dt == DType::u8) sp.lo = std::max(sp.lo, 0.0) + (second && d.blo > 0 ? 1 : 0);
      }
      return sp;
    };
    std::vector<Pair> pairs;
    for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64}) {
      pairs.push_back({spec({3, 5}, dt, Layout::contiguous, false), spec({3, 5}, dt, Layout::contiguous, true), dt});
    }
    // Broadcasting, empty, 0-d and non-contiguous operands.
    pairs.push_back({spec({3, 1, 4}, DType::f32, Layout::contiguous, false), spec({5, 1}, DType::f32, Layout::contiguous, true), DType::f32});
    pairs.push_back({spec({}, DType::f32, Layout::contiguous, false), spec({2, 3}, DType::f32, Layout::contiguous, true), DType::f32});
    pairs.push_back({spec({0, 3}, DType::f32, Layout::contiguous, false), spec({3}, DType::f32, Layout::contiguous, true), DType::f32});
    pairs.push_back({spec({4, 6}, DType::f32, Layout::transposed, false), spec({4, 6}, DType::f32, Layout::sliced, true), DType::f32});
    pairs.push_back({spec({4, 6}, DType::f32, Layout::expanded, false), spec({6}, DType::f32, Layout::contiguous, true), DType::f32});
    pairs.push_back({spec({2, 7}, DType::bf16, Layout::transposed, false), spec({7}, DType::bf16, Layout::contiguous, true), DType::bf16});
    // Mixed dtypes follow PyTorch's promotion.
    pairs.push_back({spec({3, 4}, DType::i32, Layout::contiguous, false), spec({3, 4}, DType::f32, Layout::contiguous, true), DType::f32});
    pairs.push_back({spec({3, 4}, DType::bf16, Layout::contiguous, false), spec({3, 4}, DType::f16, Layout::contiguous, true), DType::f32});
    pairs.push_back({spec({3, 4}, DType::f16, Layout::contiguous, false), spec({3, 4}, DType::f64, Layout::contiguous, true), DType::f64});
    pairs.push_back({spec({3, 4}, DType::u8, Layout::contiguous, false), spec({3, 4}, DType::i64, Layout::contiguous, true), DType::i64});
    // A 0-d f64 operand does not widen an f32 tensor; a 0-d float does widen an integer tensor.
    pairs.push_back({spec({3, 4}, DType::f32, Layout::contiguous, false), spec({}, DType::f64, Layout::contiguous, true), DType::f32});
    pairs.push_back({spec({3, 4}, DType::i64, Layout::contiguous, false), spec({}, DType::f64, Layout::contiguous, true), DType::f64});
    for (const Pair& p : pairs) {
      DType out = p.common;
      if (d.kind == BinaryDef::floating && !is_floating(out)) out = DType::f32;
      if (d.kind == BinaryDef::predicate) out = DType::boolean;
      if (d.name == "atan2" && !is_floating(p.common)) continue;  // covered by the float rows
      OpCase c;
      c.name = case_name(d.name, {p.a, p.b});
      c.inputs = {p.a, p.b};
      auto run = d.run;
      c.run = [run](const TensorList& in) { return run(in[0], in[1]); };
      auto ref = d.ref;
      const DType common = p.common;
      const bool int_div = d.name == "fmod" && !is_floating(common);
      c.reference = [ref, out, common, int_div](const std::vector<RefTensor>& in) {
        return ref_zip(in[0], in[1], out, [&](double a, double b) {
          // Operands are first converted to the common dtype (e.g. bf16+f16 -> f32 is exact).
          a = round_to(common, a);
          b = round_to(common, b);
          if (int_div) return b == 0 ? 0.0 : std::fmod(a, b);
          return ref(a, b);
        });
      };
      c.atol = half_atol(p.common);
      c.differentiable = d.kind != BinaryDef::predicate && is_floating(out);
      cases.push_back(std::move(c));
    }
  }
}

void add_where(CaseList& cases) {
  for (DType dt : {DType::f32, DType::bf16, DType::i64}) {
    std::vector<InputSpec> in = {{{3, 1}, DType::boolean}, {{3, 4}, dt, Layout::transposed}, {{4}, dt}};
    OpCase c;
    c.name = case_name("where", in);
    c.inputs = in;
    c.run = [](const TensorList& t) { return where(t[0], t[1], t[2]); };
    c.reference = [dt](const std::vector<RefTensor>& r) {
      RefTensor out({3, 4}, dt);
      for (int64_t i = 0; i < 3; ++i)
        for (int64_t j = 0; j < 4; ++j) out.v[i * 4 + j] = r[0].v[i] != 0 ? r[1].v[i * 4 + j] : r[2].v[j];
      return out;
    };
    c.differentiable = is_floating(dt);
    cases.push_back(std::move(c));
  }
  {
    std::vector<InputSpec> in = {{{2, 5}, DType::f32}, {{5}, DType::boolean}};
    OpCase c;
    c.name = case_name("masked_fill", in);
    c.inputs = in;
    c.run = [](const TensorList& t) { return t[0].masked_fill(t[1], -7.5); };
    c.reference = [](const std::vector<RefTensor>& r) {
      return ref_zip(r[0], r[1], DType::f32, [](double x, double m) { return m != 0 ? -7.5 : x; });
    };
    c.differentiable = true;
    cases.push_back(std::move(c));
  }
  {
    std::vector<InputSpec> in = {{{4, 3}, DType::f64, Layout::sliced}};
    OpCase c;
    c.name = case_name("nan_to_num", in);
    c.inputs = in;
    c.run = [](const TensorList& t) {
      // log of negative values gives NaN, 1/(x - x) gives +-inf.
      Tensor x = t[0].log();
      Tensor inf = t[0].sign().div(t[0].sub(t[0]));
      return where(t[0].gt(Tensor::scalar(1.5, t[0].device())), inf, x).nan_to_num(-1.0, 100.0, -100.0);
    };
    c.reference = [](const std::vector<RefTensor>& r) {
      return ref_map(r[0], DType::f64, [](double x) {
        if (x > 1.5) return 100.0;
        return x < 0 ? -1.0 : std::log(x);
      });
    };
    cases.push_back(std::move(c));
  }
}

}  // namespace

void add_elementwise_cases(CaseList& cases) {
  add_unary(cases);
  add_binary(cases);
  add_where(cases);
}

}  // namespace flame::test
