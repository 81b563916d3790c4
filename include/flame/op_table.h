#pragma once
// Note [Op table]
// The elementwise ops, one row each: everything FLAME generates for an op comes from its row.
//
//   unary:  X(name, Functor, kind, surface, autocast, recompute)
//   binary: X(name, Functor, kind, surface, autocast)
//
//   name       the op's name: the enum entry (backend::UnaryOp::name), the free function
//              flame::name, the Tensor method, and the name in errors, traces and profiles
//   Functor    its scalar function (src/opdef/scalar_math.h), compiled into the CPU loops, the
//              CUDA kernels and flame::compile's generated kernels alike
//   kind       the result dtype: same (the input's; bool rejected where meaningless), floating
//              (integer and bool inputs become f32 first), predicate (bool)
//   surface    fn: `Tensor name(const Tensor&...)` in flame/ops.h and `Tensor::name(...)` are
//              generated from this row; custom: the op has parameters and hand-written entry
//              points (ops.h, tensor.h); internal: no public entry point (gradient helpers, the
//              scalar forms behind add_scalar & co.)
//   autocast   under amp::AutocastGuard: keep (runs in the input's dtype) or f32 (PyTorch's fp32
//              list: the op runs on f32 copies of half-precision inputs) (Note [Autocast policy])
//   recompute  cheap: autograd::RecomputeCheap marks the output as recomputable (one pass over
//              memory, its gradient reads only x); keep: never marked (Note [Recompute cheap])
//
// The gradient of each op is in the derivative table, src/opdef/elementwise_grad.h (Note [One
// derivative table]). docs/design.md, "Adding an elementwise op", walks through a new op: its
// functor, its derivative, its row here, and a row in the test table.

// clang-format off
#define FLAME_UNARY_OPS(X)                                             \
  X(neg,              Neg,             same,      fn,       keep, keep)  \
  X(abs,              Abs,             same,      fn,       keep, keep)  \
  X(sign,             Sign,            same,      fn,       keep, keep)  \
  X(square,           Square,          same,      fn,       keep, keep)  \
  X(relu,             Relu,            same,      fn,       keep, keep)  \
  X(floor,            Floor,           same,      fn,       keep, keep)  \
  X(ceil,             Ceil,            same,      fn,       keep, keep)  \
  X(round,            Round,           same,      fn,       keep, keep)  /* half to even */ \
  X(trunc,            Trunc,           same,      fn,       keep, keep)  \
  X(clamp,            Clamp,           same,      custom,   keep, keep)  \
  X(pow_scalar,       PowScalar,       same,      internal, keep, keep)  \
  X(nan_to_num,       NanToNum,        same,      custom,   keep, keep)  \
  X(add_scalar,       AddScalar,       same,      internal, keep, keep)  \
  X(mul_scalar,       MulScalar,       same,      internal, keep, keep)  \
  X(rsub_scalar,      RsubScalar,      same,      internal, keep, keep)  \
  X(div_scalar,       DivScalar,       floating,  internal, keep, keep)  \
  X(rdiv_scalar,      RdivScalar,      floating,  internal, keep, keep)  \
  X(isnan,            IsNan,           predicate, fn,       keep, keep)  \
  X(isinf,            IsInf,           predicate, fn,       keep, keep)  \
  X(logical_not,      LogicalNot,      predicate, fn,       keep, keep)  \
  X(exp,              Exp,             floating,  fn,       f32,  keep)  \
  X(log,              Log,             floating,  fn,       f32,  keep)  \
  X(log1p,            Log1p,           floating,  fn,       f32,  keep)  \
  X(expm1,            Expm1,           floating,  fn,       f32,  keep)  \
  X(sqrt,             Sqrt,            floating,  fn,       keep, keep)  \
  X(rsqrt,            Rsqrt,           floating,  fn,       f32,  keep)  \
  X(reciprocal,       Reciprocal,      floating,  fn,       f32,  keep)  \
  X(sin,              Sin,             floating,  fn,       keep, keep)  \
  X(cos,              Cos,             floating,  fn,       keep, keep)  \
  X(tanh,             Tanh,            floating,  fn,       keep, keep)  \
  X(sigmoid,          Sigmoid,         floating,  fn,       keep, keep)  \
  X(leaky_relu,       LeakyRelu,       floating,  custom,   keep, cheap) \
  X(gelu,             Gelu,            floating,  custom,   keep, cheap) \
  X(gelu_tanh,        GeluTanh,        floating,  internal, keep, cheap) /* gelu(x, true) */ \
  X(silu,             Silu,            floating,  fn,       keep, cheap) \
  X(softplus,         Softplus,        floating,  custom,   f32,  cheap) \
  X(mish,             Mish,            floating,  fn,       keep, cheap) \
  X(elu,              Elu,             floating,  custom,   keep, cheap) \
  X(hardswish,        Hardswish,       floating,  fn,       keep, cheap) /* x * clamp(x + 3, 0, 6) / 6 */ \
  X(hardsigmoid,      Hardsigmoid,     floating,  fn,       keep, cheap) /* clamp(x + 3, 0, 6) / 6 */ \
  X(softsign,         Softsign,        floating,  fn,       keep, cheap) /* x / (1 + |x|) */ \
  X(gelu_grad,        GeluGrad,        floating,  internal, keep, keep)  \
  X(gelu_tanh_grad,   GeluTanhGrad,    floating,  internal, keep, keep)  \
  X(silu_grad,        SiluGrad,        floating,  internal, keep, keep)  \
  X(mish_grad,        MishGrad,        floating,  internal, keep, keep)  \
  X(softplus_grad,    SoftplusGrad,    floating,  internal, keep, keep)  \
  X(hardswish_grad,   HardswishGrad,   floating,  internal, keep, keep)  \
  X(hardsigmoid_grad, HardsigmoidGrad, floating,  internal, keep, keep)

#define FLAME_BINARY_OPS(X)                              \
  X(add,         Add,        same,      fn, keep)          \
  X(sub,         Sub,        same,      fn, keep)          \
  X(mul,         Mul,        same,      fn, keep)          \
  X(div,         Div,        floating,  fn, keep) /* true division: integers give f32 */ \
  X(pow,         Pow,        same,      fn, f32)           \
  X(maximum,     Maximum,    same,      fn, keep)          \
  X(minimum,     Minimum,    same,      fn, keep)          \
  X(atan2,       Atan2,      floating,  fn, keep)          \
  X(fmod,        Fmod,       same,      fn, keep)          \
  X(eq,          Eq,         predicate, fn, keep)          \
  X(ne,          Ne,         predicate, fn, keep)          \
  X(lt,          Lt,         predicate, fn, keep)          \
  X(le,          Le,         predicate, fn, keep)          \
  X(gt,          Gt,         predicate, fn, keep)          \
  X(ge,          Ge,         predicate, fn, keep)          \
  X(logical_and, LogicalAnd, predicate, fn, keep)          \
  X(logical_or,  LogicalOr,  predicate, fn, keep)
// clang-format on

// Generators of the public surface (flame/ops.h, flame/tensor.h): a row whose surface is `fn`
// declares its free function or method, other rows declare nothing.
#define FLAME_OPT_fn(...) __VA_ARGS__
#define FLAME_OPT_custom(...)
#define FLAME_OPT_internal(...)
#define FLAME_DECLARE_UNARY_FN(name, Functor, kind, surface, ...) FLAME_OPT_##surface(Tensor name(const Tensor& x);)
#define FLAME_DECLARE_BINARY_FN(name, Functor, kind, surface, ...) \
  FLAME_OPT_##surface(Tensor name(const Tensor& a, const Tensor& b);)
#define FLAME_DECLARE_UNARY_METHOD(name, Functor, kind, surface, ...) FLAME_OPT_##surface(Tensor name() const;)
#define FLAME_DECLARE_BINARY_METHOD(name, Functor, kind, surface, ...) \
  FLAME_OPT_##surface(Tensor name(const Tensor& o) const;)
