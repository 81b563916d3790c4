// Gradient rules of the elementwise family (Note [Op list]), written with FLAME ops so they run on
// every backend. x: the input as computed (after dtype promotion), y: the output, g: dL/dy.
#include <cmath>

#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/autograd/rules/rules.h"
#include "src/ops/elementwise.h"

namespace flame::rules {
using backend::BinaryOp;
using backend::UnaryOp;
using backend::UnaryParams;

namespace {
Tensor scalar_like(double v, const Tensor& t) { return Tensor::scalar(v, {t.dtype(), t.device()}); }
Tensor mask_of(const Tensor& cond, const Tensor& like) { return cond.to(like.dtype()); }

// What a unary rule reads (Note [Node saved tensors]): x (the input as computed), y (the output).
enum class Reads { none, x, y, xy, not_differentiable };

Reads unary_reads(UnaryOp op) {
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
    case UnaryOp::gelu_grad:
    case UnaryOp::gelu_tanh_grad:
    case UnaryOp::silu_grad:
    case UnaryOp::mish_grad:
    case UnaryOp::softplus_grad:
    case UnaryOp::hardswish_grad:
    case UnaryOp::hardsigmoid_grad:
    case UnaryOp::isnan:
    case UnaryOp::isinf:
    case UnaryOp::logical_not: return Reads::not_differentiable;
    default: return Reads::x;
  }
}

// grad_fn names, PyTorch's spelling without the overload digit. Scalar forms share the tensor
// form's name (x * 2.0 is a MulBackward in PyTorch too).
const char* unary_name(UnaryOp op) {
  switch (op) {
    case UnaryOp::add_scalar: return "AddBackward";
    case UnaryOp::mul_scalar: return "MulBackward";
    case UnaryOp::rsub_scalar: return "RsubBackward";
    case UnaryOp::div_scalar:
    case UnaryOp::rdiv_scalar: return "DivBackward";
    case UnaryOp::pow_scalar: return "PowBackward";
    default: break;
  }
  switch (op) {
#define FLAME_NAME(name, Functor, kind) \
  case UnaryOp::name: return #Functor "Backward";
    FLAME_UNARY_OPS(FLAME_NAME)
#undef FLAME_NAME
  }
  return "UnaryBackward";
}

const char* binary_name(BinaryOp op) {
  switch (op) {
#define FLAME_NAME(name, Functor, kind) \
  case BinaryOp::name: return #Functor "Backward";
    FLAME_BINARY_OPS(FLAME_NAME)
#undef FLAME_NAME
  }
  return "BinaryBackward";
}

// dy/dx, multiplied by g by the caller. Undefined: the op has a zero gradient.
Tensor derivative(UnaryOp op, const Tensor& x, const Tensor& y, const UnaryParams& p) {
  switch (op) {
    case UnaryOp::abs: return x.sign();
    case UnaryOp::square: return x * 2.0;
    case UnaryOp::relu: return mask_of(y.gt(scalar_like(0.0, y)), y);
    case UnaryOp::clamp: return mask_of(x.ge(scalar_like(p.a, x)).logical_and(x.le(scalar_like(p.b, x))), x);
    case UnaryOp::pow_scalar: return p.a == 0.0 ? scalar_like(0.0, x) : x.pow(p.a - 1.0) * p.a;
    case UnaryOp::nan_to_num: return mask_of(x.isnan().logical_or(x.isinf()).logical_not(), x);
    case UnaryOp::rdiv_scalar: return -(y / x);
    case UnaryOp::exp: return y;
    case UnaryOp::log: return x.reciprocal();
    case UnaryOp::log1p: return (x + 1.0).reciprocal();
    case UnaryOp::expm1: return y + 1.0;
    case UnaryOp::sqrt: return (y * 2.0).reciprocal();
    case UnaryOp::rsqrt: return y * y * y * -0.5;
    case UnaryOp::reciprocal: return -(y * y);
    case UnaryOp::sin: return x.cos();
    case UnaryOp::cos: return -x.sin();
    case UnaryOp::tanh: return 1.0 - y * y;
    case UnaryOp::sigmoid: return y * (1.0 - y);
    case UnaryOp::leaky_relu: return where(x.gt(scalar_like(0.0, x)), scalar_like(1.0, x), scalar_like(p.a, x));
    // alpha * exp(x) for x <= 0, from x (as PyTorch): y + alpha cancels to 0 where exp(x) is tiny.
    case UnaryOp::elu: return where(x.gt(scalar_like(0.0, x)), scalar_like(1.0, x), x.exp() * p.a);
    case UnaryOp::gelu: return unary_op(UnaryOp::gelu_grad, x, p);
    case UnaryOp::gelu_tanh: return unary_op(UnaryOp::gelu_tanh_grad, x, p);
    case UnaryOp::silu: return unary_op(UnaryOp::silu_grad, x, p);
    case UnaryOp::mish: return unary_op(UnaryOp::mish_grad, x, p);
    case UnaryOp::softplus: return unary_op(UnaryOp::softplus_grad, x, p);
    case UnaryOp::hardswish: return unary_op(UnaryOp::hardswish_grad, x, p);
    case UnaryOp::hardsigmoid: return unary_op(UnaryOp::hardsigmoid_grad, x, p);
    default: return Tensor();  // sign, floor, ceil, round, trunc: zero gradient
  }
}

TensorList unary_backward(const Tensor& g, const Node& n) {
  const RuleArgs& a = n.args();
  const auto op = static_cast<UnaryOp>(a.op);
  // Gradients that need no saved tensor: no derivative tensor, add_scalar launches nothing.
  switch (op) {
    case UnaryOp::add_scalar: return {g};
    case UnaryOp::neg:
    case UnaryOp::rsub_scalar: return {-g};
    case UnaryOp::mul_scalar: return {g * a.a};
    case UnaryOp::div_scalar: return {g / a.a};
    default: break;
  }
  const Reads reads = unary_reads(op);
  FLAME_CHECK(reads != Reads::not_differentiable, n.name(), "this op cannot be differentiated (it is itself a gradient)");
  Tensor x, y;
  std::size_t slot = 0;
  if (reads == Reads::x || reads == Reads::xy) x = n.saved(slot++);
  if (reads == Reads::y || reads == Reads::xy) y = n.saved(slot++);
  UnaryParams p;
  p.a = a.a;
  p.b = a.b;
  p.c = a.c;
  Tensor d = derivative(op, x, y, p);
  return {d.defined() ? g * d : zeros_like(g)};
}

TensorList binary_backward(const Tensor& g, const Node& n) {
  const RuleArgs& ar = n.args();
  const auto op = static_cast<BinaryOp>(ar.op);
  const bool need_a = ar.need[0], need_b = ar.need[1];
  // Saved slots in order: a (the promoted first operand), b, y, each only when the formula reads it.
  std::size_t slot = 0;
  auto next = [&] { return n.saved(slot++); };
  Tensor ga, gb;
  switch (op) {
    case BinaryOp::add: ga = g; gb = g; break;
    case BinaryOp::sub: ga = g; if (need_b) gb = -g; break;
    case BinaryOp::mul: {
      Tensor sa = need_b ? next() : Tensor();
      Tensor sb = need_a ? next() : Tensor();
      if (need_a) ga = g * sb;
      if (need_b) gb = g * sa;
      break;
    }
    case BinaryOp::div: {
      Tensor b = next();
      if (need_a) ga = g / b;
      if (need_b) gb = -(g * next() / b);
      break;
    }
    case BinaryOp::pow: {
      Tensor x = next(), e = need_a ? next() : Tensor(), y = need_b ? next() : Tensor();
      if (need_a) ga = g * e * x.pow(e - 1.0);
      // d/de x^e = x^e log x; taken as 0 where x == 0 (as PyTorch).
      if (need_b) gb = where(x.eq(Tensor::scalar(0.0, {x.dtype(), x.device()})), zeros_like(g), g * y * x.log());
      break;
    }
    case BinaryOp::maximum:
    case BinaryOp::minimum: {
      Tensor x = next(), z = next();
      Tensor a_wins = op == BinaryOp::maximum ? x.gt(z) : x.lt(z);
      Tensor tie = x.eq(z);
      Tensor wa = a_wins.to(g.dtype()) + tie.to(g.dtype()) * 0.5;
      if (need_a) ga = g * wa;
      if (need_b) gb = g * (1.0 - wa);
      break;
    }
    case BinaryOp::atan2: {
      Tensor x = next(), z = next();
      Tensor denom = x * x + z * z;
      if (need_a) ga = g * z / denom;
      if (need_b) gb = -(g * x / denom);
      break;
    }
    case BinaryOp::fmod:
      ga = g;
      if (need_b) {
        Tensor x = next(), z = next();
        gb = -(g * (x / z).trunc());
      }
      break;
    default: FLAME_FAIL(n.name(), "this op has no gradient");  // comparisons: bool, never recorded
  }
  const std::span<const Node::Edge> e = n.edges();
  return {ga.defined() && need_a ? sum_to(ga, e[0].shape) : Tensor(),
          gb.defined() && need_b ? sum_to(gb, e[1].shape) : Tensor()};
}
}  // namespace

void unary(Tensor& out, UnaryOp op, const Tensor& orig, const Tensor& x, const UnaryParams& p) {
  if (!is_floating(out.dtype()) || !needs_grad({orig})) return;
  RuleArgs args;
  args.op = static_cast<int>(op);
  args.a = p.a;
  args.b = p.b;
  args.c = p.c;
  Node& n = record(out, unary_name(op), {orig}, &unary_backward, std::move(args));
  const Reads reads = unary_reads(op);
  if (reads == Reads::x || reads == Reads::xy) n.save(x);
  if (reads == Reads::y || reads == Reads::xy) n.save(out, /*is_output=*/true);
}

void binary(Tensor& out, BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& ac, const Tensor& bc) {
  if (!is_floating(out.dtype()) || !needs_grad({a, b})) return;
  RuleArgs args;
  args.op = static_cast<int>(op);
  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  args.need[0] = need_a;
  args.need[1] = need_b;
  Node& n = record(out, binary_name(op), {a, b}, &binary_backward, std::move(args));
  // Keep exactly what binary_backward reads, in its slot order.
  switch (op) {
    case BinaryOp::mul:
      if (need_b) n.save(ac);
      if (need_a) n.save(bc);
      break;
    case BinaryOp::div:
      n.save(bc);
      if (need_b) n.save(out, true);
      break;
    case BinaryOp::pow:
      n.save(ac);
      if (need_a) n.save(bc);
      if (need_b) n.save(out, true);
      break;
    case BinaryOp::maximum:
    case BinaryOp::minimum:
    case BinaryOp::atan2:
      n.save(ac);
      n.save(bc);
      break;
    case BinaryOp::fmod:
      if (need_b) {
        n.save(ac);
        n.save(bc);
      }
      break;
    default: break;  // add, sub: nothing
  }
}

void where(Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  if (!is_floating(out.dtype()) || !needs_grad({a, b})) return;
  const Shape as = a.sizes(), bs = b.sizes();
  SavedTensor sc(cond, "where");  // Note [Saved indices] (rules/index.cpp): a mask buffer may be refilled
  record(out, "where", {cond, a, b}, [sc, as, bs](const Tensor& g) {
    Tensor c = sc.get();
    Tensor zero = zeros_like(g);
    return TensorList{Tensor(), sum_to(where(c, g, zero), as), sum_to(where(c, zero, g), bs)};
  });
}

}  // namespace flame::rules
