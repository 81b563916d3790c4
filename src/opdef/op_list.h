#pragma once
// Note [Op list]
// The single registry of elementwise ops. Each X(name, Functor, Kind) row generates the backend
// enum, the dispatch switch of every backend and the op-layer dtype rule:
//   same     result has the input dtype (bool inputs rejected where meaningless)
//   floating integer/bool inputs are converted to f32 first
//   predicate result is bool
#include "src/opdef/scalar_math.h"

#define FLAME_UNARY_OPS(X)                 \
  X(neg, Neg, same)                        \
  X(abs, Abs, same)                        \
  X(sign, Sign, same)                      \
  X(square, Square, same)                  \
  X(relu, Relu, same)                      \
  X(floor, Floor, same)                    \
  X(ceil, Ceil, same)                      \
  X(round, Round, same)                    \
  X(trunc, Trunc, same)                    \
  X(clamp, Clamp, same)                    \
  X(pow_scalar, PowScalar, same)           \
  X(nan_to_num, NanToNum, same)            \
  X(add_scalar, AddScalar, same)           \
  X(mul_scalar, MulScalar, same)           \
  X(rsub_scalar, RsubScalar, same)         \
  X(div_scalar, DivScalar, floating)       \
  X(rdiv_scalar, RdivScalar, floating)     \
  X(isnan, IsNan, predicate)               \
  X(isinf, IsInf, predicate)               \
  X(logical_not, LogicalNot, predicate)    \
  X(exp, Exp, floating)                    \
  X(log, Log, floating)                    \
  X(log1p, Log1p, floating)                \
  X(expm1, Expm1, floating)                \
  X(sqrt, Sqrt, floating)                  \
  X(rsqrt, Rsqrt, floating)                \
  X(reciprocal, Reciprocal, floating)      \
  X(sin, Sin, floating)                    \
  X(cos, Cos, floating)                    \
  X(tanh, Tanh, floating)                  \
  X(sigmoid, Sigmoid, floating)            \
  X(leaky_relu, LeakyRelu, floating)       \
  X(gelu, Gelu, floating)                  \
  X(gelu_tanh, GeluTanh, floating)         \
  X(silu, Silu, floating)                  \
  X(softplus, Softplus, floating)          \
  X(mish, Mish, floating)                  \
  X(elu, Elu, floating)                    \
  X(hardswish, Hardswish, floating)        \
  X(hardsigmoid, Hardsigmoid, floating)    \
  X(gelu_grad, GeluGrad, floating)         \
  X(gelu_tanh_grad, GeluTanhGrad, floating) \
  X(silu_grad, SiluGrad, floating)         \
  X(mish_grad, MishGrad, floating)         \
  X(softplus_grad, SoftplusGrad, floating) \
  X(hardswish_grad, HardswishGrad, floating) \
  X(hardsigmoid_grad, HardsigmoidGrad, floating)

#define FLAME_BINARY_OPS(X)                \
  X(add, Add, same)                        \
  X(sub, Sub, same)                        \
  X(mul, Mul, same)                        \
  X(div, Div, floating)                    \
  X(pow, Pow, same)                        \
  X(maximum, Maximum, same)                \
  X(minimum, Minimum, same)                \
  X(atan2, Atan2, floating)                \
  X(fmod, Fmod, same)                      \
  X(eq, Eq, predicate)                     \
  X(ne, Ne, predicate)                     \
  X(lt, Lt, predicate)                     \
  X(le, Le, predicate)                     \
  X(gt, Gt, predicate)                     \
  X(ge, Ge, predicate)                     \
  X(logical_and, LogicalAnd, predicate)    \
  X(logical_or, LogicalOr, predicate)

namespace flame::backend {
#define FLAME_ENUM_ENTRY(name, Functor, kind) name,
enum class UnaryOp { FLAME_UNARY_OPS(FLAME_ENUM_ENTRY) };
enum class BinaryOp { FLAME_BINARY_OPS(FLAME_ENUM_ENTRY) };
#undef FLAME_ENUM_ENTRY
enum class OpKind { same, floating, predicate };
}  // namespace flame::backend
