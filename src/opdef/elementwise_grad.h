#pragma once
// Note [One derivative table]
// The gradient formulas of the elementwise family (Note [Op list]), written once. Two consumers
// evaluate them over their own value type:
//  - eager autograd (src/autograd/rules/elementwise.cpp): values are Tensors, each step an op;
//  - flame::compile's fused backward (src/compile/autodiff.cpp, Note [Fused backward]): values
//    are node ids of the backward expression, which becomes one generated kernel.
// A formula is a template over an algebra `A` with a value type `A::V` and these members:
//   V cst(double)                      a constant (the algebra knows its dtype and device)
//   V mul(V, V), V neg(V)
//   V un(UnaryOp, V)                   an elementwise op without parameters
//   V unp(UnaryOp, V, UnaryParams)     one with its parameters (the *_grad ops)
//   V sc(UnaryOp, V, double)           a scalar op (add_scalar, mul_scalar, pow_scalar, ...)
//   V bin(BinaryOp, V, V)              a binary op (arithmetic or comparison)
//   V sel(V cond, V a, V b)            where(cond, a, b)
//   V as_float(V mask)                 a bool value as the gradient's floating dtype
// The forward values a formula reads are passed as callables (x(), y(), a(), b()), called only
// when the formula needs them. What each formula reads is stated beside it (unary_reads,
// binary_reads): eager autograd saves exactly that and nothing more, and a formula that reads
// anything else fails the eager tests (the saved-slot accessor raises).
#include <optional>
#include <utility>

#include "src/opdef/op_list.h"

namespace flame::opdef {
using backend::BinaryOp;
using backend::UnaryOp;
using backend::UnaryParams;

// What a unary formula reads: x (the op's input as computed, after dtype promotion), y (its output).
enum class Reads { none, x, y, xy };

constexpr bool reads_x(Reads r) { return r == Reads::x || r == Reads::xy; }
constexpr bool reads_y(Reads r) { return r == Reads::y || r == Reads::xy; }

// The *_grad ops and the predicates are themselves gradient formulas or bool-valued: they have no
// derivative (recording one raises, naming the op).
constexpr bool differentiable(UnaryOp op) {
  switch (op) {
    case UnaryOp::gelu_grad:
    case UnaryOp::gelu_tanh_grad:
    case UnaryOp::silu_grad:
    case UnaryOp::mish_grad:
    case UnaryOp::softplus_grad:
    case UnaryOp::hardswish_grad:
    case UnaryOp::hardsigmoid_grad:
    case UnaryOp::isnan:
    case UnaryOp::isinf:
    case UnaryOp::logical_not: return false;
    default: return true;
  }
}

constexpr Reads unary_reads(UnaryOp op) {
  switch (op) {
    case UnaryOp::neg:
    case UnaryOp::add_scalar:
    case UnaryOp::mul_scalar:
    case UnaryOp::rsub_scalar:
    case UnaryOp::div_scalar:
    case UnaryOp::sign:
    case UnaryOp::floor:
    case UnaryOp::ceil:
    case UnaryOp::round:
    case UnaryOp::trunc: return Reads::none;
    case UnaryOp::relu:  // y > 0 exactly where x > 0
    case UnaryOp::exp:
    case UnaryOp::expm1:
    case UnaryOp::sqrt:
    case UnaryOp::rsqrt:
    case UnaryOp::reciprocal:
    case UnaryOp::tanh:
    case UnaryOp::sigmoid: return Reads::y;
    case UnaryOp::rdiv_scalar: return Reads::xy;
    default: return differentiable(op) ? Reads::x : Reads::none;
  }
}

// dL/dx of y = op(x) given g = dL/dy; nullopt: the gradient is zero (sign, floor, ceil, round,
// trunc, x^0). The caller checks differentiable(op) first.
template <class A, class X, class Y>
std::optional<typename A::V> unary_grad(A& B, UnaryOp op, const UnaryParams& p, const typename A::V& g, X x, Y y) {
  using V = typename A::V;
  auto times = [&](const V& d) { return B.mul(g, d); };
  switch (op) {
    case UnaryOp::neg:
    case UnaryOp::rsub_scalar: return B.neg(g);
    case UnaryOp::add_scalar: return g;
    case UnaryOp::mul_scalar: return B.sc(UnaryOp::mul_scalar, g, p.a);
    case UnaryOp::div_scalar: return B.sc(UnaryOp::div_scalar, g, p.a);
    case UnaryOp::sign:
    case UnaryOp::floor:
    case UnaryOp::ceil:
    case UnaryOp::round:
    case UnaryOp::trunc: return std::nullopt;
    case UnaryOp::abs: return times(B.un(UnaryOp::sign, x()));
    case UnaryOp::square: return times(B.sc(UnaryOp::mul_scalar, x(), 2.0));
    case UnaryOp::relu: {
      const V zero = B.cst(0.0);
      return B.sel(B.bin(BinaryOp::gt, y(), zero), g, zero);
    }
    case UnaryOp::clamp: {
      const V xv = x();
      const V inside =
          B.bin(BinaryOp::logical_and, B.bin(BinaryOp::ge, xv, B.cst(p.a)), B.bin(BinaryOp::le, xv, B.cst(p.b)));
      return B.sel(inside, g, B.cst(0.0));
    }
    case UnaryOp::pow_scalar:
      if (p.a == 0.0) return std::nullopt;
      return times(B.sc(UnaryOp::mul_scalar, B.sc(UnaryOp::pow_scalar, x(), p.a - 1.0), p.a));
    case UnaryOp::nan_to_num: {
      const V xv = x();
      const V bad = B.bin(BinaryOp::logical_or, B.un(UnaryOp::isnan, xv), B.un(UnaryOp::isinf, xv));
      return B.sel(bad, B.cst(0.0), g);
    }
    case UnaryOp::rdiv_scalar: return times(B.neg(B.bin(BinaryOp::div, y(), x())));
    case UnaryOp::exp: return times(y());
    case UnaryOp::log: return times(B.un(UnaryOp::reciprocal, x()));
    case UnaryOp::log1p: return times(B.un(UnaryOp::reciprocal, B.sc(UnaryOp::add_scalar, x(), 1.0)));
    case UnaryOp::expm1: return times(B.sc(UnaryOp::add_scalar, y(), 1.0));
    case UnaryOp::sqrt: return times(B.un(UnaryOp::reciprocal, B.sc(UnaryOp::mul_scalar, y(), 2.0)));
    case UnaryOp::rsqrt: {
      const V yv = y();
      return times(B.sc(UnaryOp::mul_scalar, B.mul(B.mul(yv, yv), yv), -0.5));
    }
    case UnaryOp::reciprocal: {
      const V yv = y();
      return times(B.neg(B.mul(yv, yv)));
    }
    case UnaryOp::sin: return times(B.un(UnaryOp::cos, x()));
    case UnaryOp::cos: return times(B.neg(B.un(UnaryOp::sin, x())));
    case UnaryOp::tanh: {
      const V yv = y();
      return times(B.sc(UnaryOp::rsub_scalar, B.mul(yv, yv), 1.0));
    }
    case UnaryOp::sigmoid: {
      const V yv = y();
      return times(B.mul(yv, B.sc(UnaryOp::rsub_scalar, yv, 1.0)));
    }
    case UnaryOp::leaky_relu: return times(B.sel(B.bin(BinaryOp::gt, x(), B.cst(0.0)), B.cst(1.0), B.cst(p.a)));
    // alpha * exp(x) for x <= 0, from x (as PyTorch): y + alpha cancels to 0 where exp(x) is tiny.
    case UnaryOp::elu: {
      const V xv = x();
      return times(B.sel(B.bin(BinaryOp::gt, xv, B.cst(0.0)), B.cst(1.0), B.sc(UnaryOp::mul_scalar, B.un(UnaryOp::exp, xv), p.a)));
    }
    case UnaryOp::gelu: return times(B.unp(UnaryOp::gelu_grad, x(), p));
    case UnaryOp::gelu_tanh: return times(B.unp(UnaryOp::gelu_tanh_grad, x(), p));
    case UnaryOp::silu: return times(B.unp(UnaryOp::silu_grad, x(), p));
    case UnaryOp::mish: return times(B.unp(UnaryOp::mish_grad, x(), p));
    case UnaryOp::softplus: return times(B.unp(UnaryOp::softplus_grad, x(), p));
    case UnaryOp::hardswish: return times(B.unp(UnaryOp::hardswish_grad, x(), p));
    case UnaryOp::hardsigmoid: return times(B.unp(UnaryOp::hardsigmoid_grad, x(), p));
    // 1 / (1 + |x|)^2
    case UnaryOp::softsign:
      return times(B.un(UnaryOp::reciprocal, B.un(UnaryOp::square, B.sc(UnaryOp::add_scalar, B.un(UnaryOp::abs, x()), 1.0))));
    default: return std::nullopt;  // not differentiable: the caller checked differentiable(op)
  }
}

// Binary ops with a gradient (the comparisons and logical ops are bool-valued: none).
constexpr bool differentiable(BinaryOp op) {
  switch (op) {
    case BinaryOp::add:
    case BinaryOp::sub:
    case BinaryOp::mul:
    case BinaryOp::div:
    case BinaryOp::pow:
    case BinaryOp::maximum:
    case BinaryOp::minimum:
    case BinaryOp::atan2:
    case BinaryOp::fmod: return true;
    default: return false;
  }
}

// What a binary formula reads of the operands as computed (a, b, after promotion) and the output y,
// given which operands need a gradient.
struct BinaryReads {
  bool a = false, b = false, y = false;
};
constexpr BinaryReads binary_reads(BinaryOp op, bool need_a, bool need_b) {
  switch (op) {
    case BinaryOp::mul: return {need_b, need_a, false};
    case BinaryOp::div: return {false, true, need_b};
    case BinaryOp::pow: return {true, need_a, need_b};
    case BinaryOp::maximum:
    case BinaryOp::minimum:
    case BinaryOp::atan2: return {true, true, false};
    case BinaryOp::fmod: return {need_b, need_b, false};
    default: return {};  // add, sub
  }
}

// dL/da and dL/db of y = op(a, b) over the broadcast shape (the caller sums each down to its
// operand's shape). Only the gradients asked for are formed; the caller checks differentiable(op).
template <class A, class LA, class LB, class LY>
std::pair<std::optional<typename A::V>, std::optional<typename A::V>> binary_grad(A& B, BinaryOp op,
                                                                                    const typename A::V& g,
                                                                                    bool need_a, bool need_b, LA a,
                                                                                    LB b, LY y) {
  using V = typename A::V;
  std::optional<V> ga, gb;
  switch (op) {
    case BinaryOp::add:
      if (need_a) ga = g;
      if (need_b) gb = g;
      break;
    case BinaryOp::sub:
      if (need_a) ga = g;
      if (need_b) gb = B.neg(g);
      break;
    case BinaryOp::mul:
      if (need_a) ga = B.mul(g, b());
      if (need_b) gb = B.mul(g, a());
      break;
    case BinaryOp::div: {
      const V bv = b();
      if (need_a) ga = B.bin(BinaryOp::div, g, bv);
      if (need_b) gb = B.neg(B.bin(BinaryOp::div, B.mul(g, y()), bv));
      break;
    }
    case BinaryOp::pow: {
      const V av = a();
      if (need_a) {
        const V bv = b();
        ga = B.mul(B.mul(g, bv), B.bin(BinaryOp::pow, av, B.sc(UnaryOp::add_scalar, bv, -1.0)));
      }
      // d/db a^b = a^b log a; taken as 0 where a == 0 (as PyTorch).
      if (need_b) {
        const V zero = B.cst(0.0);
        gb = B.sel(B.bin(BinaryOp::eq, av, zero), zero, B.mul(B.mul(g, y()), B.un(UnaryOp::log, av)));
      }
      break;
    }
    case BinaryOp::maximum:
    case BinaryOp::minimum: {
      const V av = a(), bv = b();
      const V wins = B.bin(op == BinaryOp::maximum ? BinaryOp::gt : BinaryOp::lt, av, bv);
      const V tie = B.bin(BinaryOp::eq, av, bv);
      // A tie splits the gradient evenly (as PyTorch).
      const V wa = B.bin(BinaryOp::add, B.as_float(wins), B.sc(UnaryOp::mul_scalar, B.as_float(tie), 0.5));
      if (need_a) ga = B.mul(g, wa);
      if (need_b) gb = B.mul(g, B.sc(UnaryOp::rsub_scalar, wa, 1.0));
      break;
    }
    case BinaryOp::atan2: {
      const V av = a(), bv = b();
      const V den = B.bin(BinaryOp::add, B.mul(av, av), B.mul(bv, bv));
      if (need_a) ga = B.bin(BinaryOp::div, B.mul(g, bv), den);
      if (need_b) gb = B.neg(B.bin(BinaryOp::div, B.mul(g, av), den));
      break;
    }
    case BinaryOp::fmod:
      if (need_a) ga = g;
      if (need_b) gb = B.neg(B.mul(g, B.un(UnaryOp::trunc, B.bin(BinaryOp::div, a(), b()))));
      break;
    default: break;  // not differentiable: the caller checked differentiable(op)
  }
  return {std::move(ga), std::move(gb)};
}

// where(cond, a, b): the gradient goes to a where cond holds, to b elsewhere.
template <class A>
std::pair<typename A::V, typename A::V> where_grad(A& B, const typename A::V& cond, const typename A::V& g) {
  const typename A::V zero = B.cst(0.0);
  return {B.sel(cond, g, zero), B.sel(cond, zero, g)};
}

}  // namespace flame::opdef
