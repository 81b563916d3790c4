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

// dy/dx, multiplied by g by the caller. Undefined: the op has a zero gradient.
Tensor derivative(UnaryOp op, const Tensor& x, const Tensor& y, const UnaryParams& p) {
  switch (op) {
    case UnaryOp::neg: return scalar_like(-1.0, x);
    case UnaryOp::abs: return x.sign();
    case UnaryOp::square: return x * 2.0;
    case UnaryOp::relu: return mask_of(x.gt(scalar_like(0.0, x)), x);
    case UnaryOp::clamp: return mask_of(x.ge(scalar_like(p.a, x)).logical_and(x.le(scalar_like(p.b, x))), x);
    case UnaryOp::pow_scalar: return p.a == 0.0 ? scalar_like(0.0, x) : x.pow(p.a - 1.0) * p.a;
    case UnaryOp::nan_to_num: return mask_of(x.isnan().logical_or(x.isinf()).logical_not(), x);
    case UnaryOp::add_scalar: return scalar_like(1.0, x);
    case UnaryOp::mul_scalar: return scalar_like(p.a, x);
    case UnaryOp::rsub_scalar: return scalar_like(-1.0, x);
    case UnaryOp::div_scalar: return scalar_like(1.0 / p.a, x);
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
    case UnaryOp::elu: return where(x.gt(scalar_like(0.0, x)), scalar_like(1.0, x), y + p.a);
    case UnaryOp::gelu: return unary_op(UnaryOp::gelu_grad, x, p);
    case UnaryOp::gelu_tanh: return unary_op(UnaryOp::gelu_tanh_grad, x, p);
    case UnaryOp::silu: return unary_op(UnaryOp::silu_grad, x, p);
    case UnaryOp::mish: return unary_op(UnaryOp::mish_grad, x, p);
    case UnaryOp::softplus: return unary_op(UnaryOp::softplus_grad, x, p);
    default: return Tensor();  // sign, floor, ceil, round, trunc: zero gradient
  }
}
}  // namespace

void unary(Tensor& out, UnaryOp op, const Tensor& orig, const Tensor& x, const UnaryParams& p) {
  if (!is_floating(out.dtype()) || !needs_grad({orig})) return;
  SavedTensor sx(x, "unary"), sy(out, "unary");
  record(out, "elementwise", {orig}, [op, sx, sy, p](const Tensor& g) {
    Tensor d = derivative(op, sx.get(), sy.get(), p);
    return TensorList{d.defined() ? g * d : zeros_like(g)};
  });
}

void binary(Tensor& out, BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& ac, const Tensor& bc) {
  if (!is_floating(out.dtype()) || !needs_grad({a, b})) return;
  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  SavedTensor sa(ac, "binary"), sb(bc, "binary"), sy(out, "binary");
  const Shape as = a.sizes(), bs = b.sizes();
  record(out, "binary", {a, b}, [=](const Tensor& g) {
    Tensor ga, gb;
    switch (op) {
      case BinaryOp::add: ga = g; gb = g; break;
      case BinaryOp::sub: ga = g; gb = -g; break;
      case BinaryOp::mul:
        if (need_a) ga = g * sb.get();
        if (need_b) gb = g * sa.get();
        break;
      case BinaryOp::div:
        if (need_a) ga = g / sb.get();
        if (need_b) gb = -(g * sy.get() / sb.get());
        break;
      case BinaryOp::pow: {
        Tensor x = sa.get(), e = sb.get();
        if (need_a) ga = g * e * x.pow(e - 1.0);
        // d/de x^e = x^e log x; taken as 0 where x == 0 (as PyTorch).
        if (need_b) gb = where(x.eq(Tensor::scalar(0.0, {x.dtype(), x.device()})), zeros_like(g), g * sy.get() * x.log());
        break;
      }
      case BinaryOp::maximum:
      case BinaryOp::minimum: {
        Tensor x = sa.get(), z = sb.get();
        Tensor a_wins = op == BinaryOp::maximum ? x.gt(z) : x.lt(z);
        Tensor tie = x.eq(z);
        Tensor wa = a_wins.to(g.dtype()) + tie.to(g.dtype()) * 0.5;
        ga = g * wa;
        gb = g * (1.0 - wa);
        break;
      }
      case BinaryOp::atan2: {
        Tensor x = sa.get(), z = sb.get();
        Tensor denom = x * x + z * z;
        ga = g * z / denom;
        gb = -(g * x / denom);
        break;
      }
      case BinaryOp::fmod:
        ga = g;
        if (need_b) gb = -(g * (sa.get() / sb.get()).trunc());
        break;
      default: break;  // comparisons and logical ops produce bool: never recorded
    }
    return TensorList{ga.defined() && need_a ? sum_to(ga, as) : Tensor(), gb.defined() && need_b ? sum_to(gb, bs) : Tensor()};
  });
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
