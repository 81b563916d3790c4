#pragma once
// Scalar math shared by the CPU reference and the CUDA kernels (FLAME_HD). Each functor works on
// the compute type of Note [Compute types]: float, double or int64_t. This header is the single
// place the elementwise formulas live.
//
// Note [Defined integer math]
// Integer compute is int64_t, where overflow would be undefined behaviour. Every integer formula
// here is defined for every input, as PyTorch's results on its usual platforms:
//  - +, -, *, neg, abs, square, pow and the scalar forms wrap modulo 2^64 (two's complement), by
//    computing in uint64_t: INT64_MAX + 1 == INT64_MIN, -INT64_MIN == INT64_MIN, abs(INT64_MIN)
//    == INT64_MIN. Narrower integer dtypes then wrap on the conversion back (modular in C++20).
//  - x / 0 and fmod(x, 0) give 0 (the CPU would trap); x / -1 is a wrapping negation and
//    fmod(x, -1) is 0, so INT64_MIN / -1 and INT64_MIN % -1 never trap.
//  - float -> integer conversion saturates: NaN -> 0, values beyond the integer range -> its
//    minimum or maximum, others truncate toward zero. This is what the GPU's conversion
//    instruction does, so the CPU reference and CUDA agree; PyTorch leaves it platform-defined.
//  - double parameters (scalar operands, clamp bounds) reach integer formulas through the same
//    saturating conversion.
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "flame/float8.h"
#include "flame/half.h"

namespace flame {

template <class T> struct compute_type { using type = int64_t; };
template <> struct compute_type<float> { using type = float; };
template <> struct compute_type<double> { using type = double; };
template <> struct compute_type<bfloat16> { using type = float; };
template <> struct compute_type<float16> { using type = float; };
template <> struct compute_type<float8_e4m3fn> { using type = float; };
template <> struct compute_type<float8_e5m2> { using type = float; };
template <class T> using compute_t = typename compute_type<T>::type;

// The 16- and 8-bit float storage types: converted through float.
template <class T>
inline constexpr bool is_narrow_float_v = std::is_same_v<T, bfloat16> || std::is_same_v<T, float16> ||
                                          std::is_same_v<T, float8_e4m3fn> || std::is_same_v<T, float8_e5m2>;

// Converts between element and compute types (half and 8-bit float types go through float; bool
// is v != 0; floating -> integer saturates, Note [Defined integer math]).
template <class To, class From>
FLAME_INLINE To convert(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (is_narrow_float_v<From>) {
    return convert<To>(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, bool>) {
    return v != From(0);
  } else if constexpr (is_narrow_float_v<To>) {
    return To(static_cast<float>(v));
  } else if constexpr (std::is_integral_v<To> && std::is_floating_point_v<From>) {
    // Integer limits are exact powers of two in From (min) or round up to one (max), so the
    // comparisons below are exact; in between, the cast truncates a value that fits.
    constexpr To lo = std::numeric_limits<To>::min(), hi = std::numeric_limits<To>::max();
    if (v != v) return To(0);
    if (v <= static_cast<From>(lo)) return lo;
    if (v >= static_cast<From>(hi)) return hi;
    return static_cast<To>(v);
  } else {
    return static_cast<To>(v);
  }
}

namespace math {
#define FLAME_MATH_1(name, fname, dname) \
  FLAME_INLINE float name(float x) { return ::fname(x); } \
  FLAME_INLINE double name(double x) { return ::dname(x); }
FLAME_MATH_1(exp, expf, exp)
FLAME_MATH_1(log, logf, log)
FLAME_MATH_1(log1p, log1pf, log1p)
FLAME_MATH_1(expm1, expm1f, expm1)
FLAME_MATH_1(sqrt, sqrtf, sqrt)
FLAME_MATH_1(sin, sinf, sin)
FLAME_MATH_1(cos, cosf, cos)
FLAME_MATH_1(tanh, tanhf, tanh)
FLAME_MATH_1(erf, erff, erf)
FLAME_MATH_1(floor, floorf, floor)
FLAME_MATH_1(ceil, ceilf, ceil)
FLAME_MATH_1(rint, rintf, rint)
FLAME_MATH_1(trunc, truncf, trunc)
FLAME_MATH_1(fabs, fabsf, fabs)
#undef FLAME_MATH_1
FLAME_INLINE float pow(float a, float b) { return ::powf(a, b); }
FLAME_INLINE double pow(double a, double b) { return ::pow(a, b); }
FLAME_INLINE float atan2(float a, float b) { return ::atan2f(a, b); }
FLAME_INLINE double atan2(double a, double b) { return ::atan2(a, b); }
FLAME_INLINE float fmod(float a, float b) { return ::fmodf(a, b); }
FLAME_INLINE double fmod(double a, double b) { return ::fmod(a, b); }
template <class C>
FLAME_INLINE bool isnan(C x) {
  if constexpr (std::is_floating_point_v<C>) return x != x;
  else return false;
}
template <class C>
FLAME_INLINE bool isinf(C x) {
  if constexpr (std::is_floating_point_v<C>) return x - x != x - x && x == x;
  else return false;
}
// Wrapping integer arithmetic (Note [Defined integer math]); floating types use the operators.
template <class C>
FLAME_INLINE C wrap_add(C a, C b) {
  if constexpr (std::is_integral_v<C>) return static_cast<C>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
  else return a + b;
}
template <class C>
FLAME_INLINE C wrap_sub(C a, C b) {
  if constexpr (std::is_integral_v<C>) return static_cast<C>(static_cast<uint64_t>(a) - static_cast<uint64_t>(b));
  else return a - b;
}
template <class C>
FLAME_INLINE C wrap_mul(C a, C b) {
  if constexpr (std::is_integral_v<C>) return static_cast<C>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
  else return a * b;
}
template <class C>
FLAME_INLINE C wrap_neg(C a) {
  if constexpr (std::is_integral_v<C>) return static_cast<C>(uint64_t(0) - static_cast<uint64_t>(a));
  else return -a;
}
// Integer power by squaring, wrapping; negative exponents are rejected by the op layer except
// for |base| = 1.
FLAME_INLINE int64_t ipow(int64_t base, int64_t e) {
  if (e < 0) return base == 1 ? 1 : (base == -1 ? ((e & 1) ? -1 : 1) : 0);
  int64_t r = 1;
  while (e) {
    if (e & 1) r = wrap_mul(r, base);
    base = wrap_mul(base, base);
    e >>= 1;
  }
  return r;
}
// a / b and a % b for integers, defined for b == 0 (0) and b == -1 (no INT64_MIN trap).
FLAME_INLINE int64_t idiv(int64_t a, int64_t b) { return b == 0 ? 0 : (b == -1 ? wrap_neg(a) : a / b); }
FLAME_INLINE int64_t imod(int64_t a, int64_t b) { return (b == 0 || b == -1) ? 0 : a % b; }
}  // namespace math

namespace backend {
struct UnaryParams {
  double a = 0.0, b = 0.0, c = 0.0;
};
}  // namespace backend

namespace fn {
using backend::UnaryParams;
template <class C>
inline constexpr bool is_fp = std::is_floating_point_v<C>;
// A double parameter in compute type C (saturating for integers, Note [Defined integer math]).
template <class C>
FLAME_INLINE C param(double v) { return convert<C>(v); }

#define FLAME_UNARY_FN(Name, ...)                                       \
  struct Name {                                                         \
    template <class C>                                                  \
    FLAME_INLINE C operator()(C x, const UnaryParams& p) const {        \
      (void)p;                                                          \
      __VA_ARGS__                                                       \
    }                                                                   \
  };
// Ops on floating inputs only (the op layer turns integer inputs into f32 first).
#define FLAME_FLOAT_FN(Name, expr) \
  FLAME_UNARY_FN(Name, if constexpr (is_fp<C>) { return expr; } else { return x; })

FLAME_UNARY_FN(Neg, return math::wrap_neg(x);)
FLAME_UNARY_FN(Abs, if constexpr (is_fp<C>) { return math::fabs(x); } else { return x < 0 ? math::wrap_neg(x) : x; })
FLAME_UNARY_FN(Sign, if constexpr (is_fp<C>) { if (x != x) return x; }
               return static_cast<C>((C(0) < x) - (x < C(0)));)
FLAME_UNARY_FN(Square, return math::wrap_mul(x, x);)
FLAME_UNARY_FN(Relu, return x < C(0) ? C(0) : x;)
FLAME_UNARY_FN(Floor, if constexpr (is_fp<C>) { return math::floor(x); } else { return x; })
FLAME_UNARY_FN(Ceil, if constexpr (is_fp<C>) { return math::ceil(x); } else { return x; })
FLAME_UNARY_FN(Round, if constexpr (is_fp<C>) { return math::rint(x); } else { return x; })
FLAME_UNARY_FN(Trunc, if constexpr (is_fp<C>) { return math::trunc(x); } else { return x; })
// clamp(x, min=a, max=b); NaN stays NaN, min > max gives max (as PyTorch).
FLAME_UNARY_FN(Clamp, if (math::isnan(x)) return x; C lo = param<C>(p.a);
               C hi = param<C>(p.b); x = x < lo ? lo : x; return x > hi ? hi : x;)
FLAME_UNARY_FN(PowScalar, if constexpr (is_fp<C>) { return math::pow(x, static_cast<C>(p.a)); }
               else { return math::ipow(x, param<int64_t>(p.a)); })
FLAME_UNARY_FN(IsNan, return math::isnan(x) ? C(1) : C(0);)
FLAME_UNARY_FN(IsInf, return math::isinf(x) ? C(1) : C(0);)
FLAME_UNARY_FN(LogicalNot, return x == C(0) ? C(1) : C(0);)
// nan_to_num(nan=a, posinf=b, neginf=c)
FLAME_UNARY_FN(NanToNum, if (math::isnan(x)) return static_cast<C>(p.a);
               if (math::isinf(x)) return x > C(0) ? static_cast<C>(p.b) : static_cast<C>(p.c);
               return x;)
// Tensor-scalar arithmetic; the scalar (p.a) stays in the compute type, as PyTorch keeps it.
FLAME_UNARY_FN(AddScalar, return math::wrap_add(x, param<C>(p.a));)
FLAME_UNARY_FN(MulScalar, return math::wrap_mul(x, param<C>(p.a));)
FLAME_UNARY_FN(RsubScalar, return math::wrap_sub(param<C>(p.a), x);)
FLAME_FLOAT_FN(DivScalar, x / static_cast<C>(p.a))
FLAME_FLOAT_FN(RdivScalar, static_cast<C>(p.a) / x)

FLAME_FLOAT_FN(Exp, math::exp(x))
FLAME_FLOAT_FN(Log, math::log(x))
FLAME_FLOAT_FN(Log1p, math::log1p(x))
FLAME_FLOAT_FN(Expm1, math::expm1(x))
FLAME_FLOAT_FN(Sqrt, math::sqrt(x))
FLAME_FLOAT_FN(Rsqrt, C(1) / math::sqrt(x))
FLAME_FLOAT_FN(Reciprocal, C(1) / x)
FLAME_FLOAT_FN(Sin, math::sin(x))
FLAME_FLOAT_FN(Cos, math::cos(x))
FLAME_FLOAT_FN(Tanh, math::tanh(x))
FLAME_FLOAT_FN(Sigmoid, C(1) / (C(1) + math::exp(-x)))
FLAME_FLOAT_FN(LeakyRelu, x > C(0) ? x : x * static_cast<C>(p.a))
FLAME_FLOAT_FN(Gelu, C(0.5) * x * (C(1) + math::erf(x * C(0.70710678118654752440))))
FLAME_FLOAT_FN(GeluTanh, C(0.5) * x *
                             (C(1) + math::tanh(C(0.79788456080286535588) *
                                                (x + C(0.044715) * x * x * x))))
FLAME_FLOAT_FN(Silu, x / (C(1) + math::exp(-x)))
// softplus(beta=a, threshold=b): linear above the threshold, as PyTorch.
FLAME_FLOAT_FN(Softplus, x * static_cast<C>(p.a) > static_cast<C>(p.b)
                             ? x
                             : math::log1p(math::exp(x * static_cast<C>(p.a))) / static_cast<C>(p.a))
FLAME_FLOAT_FN(Mish, x * math::tanh(x > C(20) ? x : math::log1p(math::exp(x))))
FLAME_FLOAT_FN(Softsign, x / (C(1) + math::fabs(x)))  // torch.nn.functional.softsign
FLAME_FLOAT_FN(Elu, x > C(0) ? x : static_cast<C>(p.a) * math::expm1(x))
// hardsigmoid = clamp(x + 3, 0, 6) / 6, hardswish = x * hardsigmoid(x) (PyTorch's); NaN stays NaN.
FLAME_UNARY_FN(Hardsigmoid, if constexpr (is_fp<C>) {
  C t = x + C(3);
  t = t < C(0) ? C(0) : t;
  return (t > C(6) ? C(6) : t) / C(6);
} else { return x; })
FLAME_UNARY_FN(Hardswish, if constexpr (is_fp<C>) {
  C t = x + C(3);
  t = t < C(0) ? C(0) : t;
  return x * (t > C(6) ? C(6) : t) / C(6);
} else { return x; })
// Derivatives dy/dx used by the gradient rules (fused so that backward is one kernel).
FLAME_FLOAT_FN(GeluGrad, C(0.5) * (C(1) + math::erf(x * C(0.70710678118654752440))) +
                             x * C(0.39894228040143267794) * math::exp(C(-0.5) * x * x))
FLAME_UNARY_FN(GeluTanhGrad, if constexpr (is_fp<C>) {
  const C k = C(0.79788456080286535588), c = C(0.044715);
  const C t = math::tanh(k * (x + c * x * x * x));
  return C(0.5) * (C(1) + t) + C(0.5) * x * (C(1) - t * t) * k * (C(1) + C(3) * c * x * x);
} else { return x; })
FLAME_UNARY_FN(SiluGrad, if constexpr (is_fp<C>) {
  const C s = C(1) / (C(1) + math::exp(-x));
  return s * (C(1) + x * (C(1) - s));
} else { return x; })
FLAME_UNARY_FN(MishGrad, if constexpr (is_fp<C>) {
  const C sp = x > C(20) ? x : math::log1p(math::exp(x));
  const C t = math::tanh(sp);
  return t + x * (C(1) - t * t) / (C(1) + math::exp(-x));
} else { return x; })
// softplus'(beta=a, threshold=b) = sigmoid(beta x), 1 above the threshold.
FLAME_FLOAT_FN(SoftplusGrad, x * static_cast<C>(p.a) > static_cast<C>(p.b)
                                 ? C(1)
                                 : C(1) / (C(1) + math::exp(-x * static_cast<C>(p.a))))
// PyTorch's hardswish_backward / hardsigmoid_backward: x/3 + 1/2 on [-3, 3], 1/6 inside (-3, 3).
FLAME_FLOAT_FN(HardswishGrad, x < C(-3) ? C(0) : (x <= C(3) ? x / C(3) + C(0.5) : C(1)))
FLAME_FLOAT_FN(HardsigmoidGrad, x > C(-3) && x < C(3) ? C(1) / C(6) : C(0))
#undef FLAME_FLOAT_FN
#undef FLAME_UNARY_FN

#define FLAME_BINARY_FN(Name, body)                       \
  struct Name {                                           \
    template <class C>                                    \
    FLAME_INLINE C operator()(C a, C b) const { body }    \
  };
FLAME_BINARY_FN(Add, return math::wrap_add(a, b);)
FLAME_BINARY_FN(Sub, return math::wrap_sub(a, b);)
FLAME_BINARY_FN(Mul, return math::wrap_mul(a, b);)
FLAME_BINARY_FN(Div, if constexpr (is_fp<C>) { return a / b; } else { return math::idiv(a, b); })
FLAME_BINARY_FN(Pow, if constexpr (is_fp<C>) { return math::pow(a, b); } else { return math::ipow(a, b); })
FLAME_BINARY_FN(Maximum, if (math::isnan(a) || math::isnan(b)) return math::isnan(a) ? a : b;
                return a > b ? a : b;)
FLAME_BINARY_FN(Minimum, if (math::isnan(a) || math::isnan(b)) return math::isnan(a) ? a : b;
                return a < b ? a : b;)
FLAME_BINARY_FN(Atan2, if constexpr (is_fp<C>) { return math::atan2(a, b); } else { return a; })
FLAME_BINARY_FN(Fmod, if constexpr (is_fp<C>) { return math::fmod(a, b); } else { return math::imod(a, b); })
FLAME_BINARY_FN(Eq, return a == b ? C(1) : C(0);)
FLAME_BINARY_FN(Ne, return a != b ? C(1) : C(0);)
FLAME_BINARY_FN(Lt, return a < b ? C(1) : C(0);)
FLAME_BINARY_FN(Le, return a <= b ? C(1) : C(0);)
FLAME_BINARY_FN(Gt, return a > b ? C(1) : C(0);)
FLAME_BINARY_FN(Ge, return a >= b ? C(1) : C(0);)
FLAME_BINARY_FN(LogicalAnd, return (a != C(0) && b != C(0)) ? C(1) : C(0);)
FLAME_BINARY_FN(LogicalOr, return (a != C(0) || b != C(0)) ? C(1) : C(0);)
#undef FLAME_BINARY_FN
}  // namespace fn
}  // namespace flame
