// Gradient rules of the elementwise family (Note [Op list]): the derivative table
// (src/opdef/elementwise_grad.h, Note [One derivative table]) evaluated over tensors, so the rules
// run on every backend. x: the input as computed (after dtype promotion), y: the output, g: dL/dy.
#include <string_view>
#include <cmath>
#include <optional>

#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/autograd/recompute.h"
#include "src/ops/grad_hooks.h"
#include "src/opdef/elementwise_grad.h"
#include "src/ops/elementwise.h"

namespace flame::rules {
using backend::BinaryOp;
using backend::UnaryOp;
using backend::UnaryParams;

namespace {
using opdef::Reads;

// The algebra eager autograd evaluates the derivative table over (Note [One derivative table]):
// values are tensors, constants are 0-dim tensors of the gradient's dtype and device.
struct TensorAlgebra {
  using V = Tensor;
  const Tensor& like;
  Tensor cst(double v) const { return Tensor::scalar(v, {like.dtype(), like.device()}); }
  Tensor mul(const Tensor& a, const Tensor& b) const { return binary_op(BinaryOp::mul, a, b); }
  Tensor neg(const Tensor& a) const { return unary_op(UnaryOp::neg, a, {}); }
  Tensor un(UnaryOp op, const Tensor& x) const { return unary_op(op, x, {}); }
  Tensor unp(UnaryOp op, const Tensor& x, const UnaryParams& p) const { return unary_op(op, x, p); }
  Tensor sc(UnaryOp op, const Tensor& x, double s) const { return scalar_op(op, x, Scalar(s)); }
  Tensor bin(BinaryOp op, const Tensor& a, const Tensor& b) const { return binary_op(op, a, b); }
  Tensor sel(const Tensor& c, const Tensor& a, const Tensor& b) const { return flame::where(c, a, b); }
  Tensor as_float(const Tensor& mask) const { return mask.to(like.dtype()); }
};

// A saved forward value the formula reads; `slot` < 0: the rule did not save it, so the table's
// reads and its formula disagree (a bug in the table, caught by any test of the op's gradient).
Tensor saved_at(const Node& n, int slot, const char* what) {
  FLAME_CHECK(slot >= 0, n.name(), "internal: the derivative formula reads ", what,
              ", which its reads table says it does not (Note [One derivative table])");
  return n.saved(static_cast<std::size_t>(slot));
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
#define FLAME_NAME(name, Functor, kind, ...) \
  case UnaryOp::name: return #Functor "Backward";
    FLAME_UNARY_OPS(FLAME_NAME)
#undef FLAME_NAME
  }
  return "UnaryBackward";
}

const char* binary_name(BinaryOp op) {
  switch (op) {
#define FLAME_NAME(name, Functor, kind, ...) \
  case BinaryOp::name: return #Functor "Backward";
    FLAME_BINARY_OPS(FLAME_NAME)
#undef FLAME_NAME
  }
  return "BinaryBackward";
}

TensorList unary_backward(const Tensor& g, const Node& n) {
  const RuleArgs& a = n.args();
  const auto op = static_cast<UnaryOp>(a.op);
  FLAME_CHECK(opdef::differentiable(op), n.name(), "this op cannot be differentiated (it is itself a gradient)");
  const Reads reads = opdef::unary_reads(op);
  const int slot_x = opdef::reads_x(reads) ? 0 : -1;
  const int slot_y = opdef::reads_y(reads) ? slot_x + 1 : -1;
  UnaryParams p;
  p.a = a.a;
  p.b = a.b;
  p.c = a.c;
  TensorAlgebra B{g};
  std::optional<Tensor> dx = opdef::unary_grad(
      B, op, p, g, [&] { return saved_at(n, slot_x, "x"); }, [&] { return saved_at(n, slot_y, "y"); });
  return {dx ? std::move(*dx) : zeros_like(g)};
}

TensorList binary_backward(const Tensor& g, const Node& n) {
  const RuleArgs& ar = n.args();
  const auto op = static_cast<BinaryOp>(ar.op);
  FLAME_CHECK(opdef::differentiable(op), n.name(), "this op has no gradient");  // comparisons: never recorded
  const bool need_a = ar.need[0], need_b = ar.need[1];
  // Saved slots in order: a (the promoted first operand), b, y, each only when the formula reads it.
  const opdef::BinaryReads r = opdef::binary_reads(op, need_a, need_b);
  const int slot_a = r.a ? 0 : -1;
  const int slot_b = r.b ? int(r.a) : -1;
  const int slot_y = r.y ? int(r.a) + int(r.b) : -1;
  TensorAlgebra B{g};
  auto [ga, gb] = opdef::binary_grad(
      B, op, g, need_a, need_b, [&] { return saved_at(n, slot_a, "a"); }, [&] { return saved_at(n, slot_b, "b"); },
      [&] { return saved_at(n, slot_y, "y"); });
  const std::span<const Node::Edge> e = n.edges();
  return {ga ? sum_to(*ga, e[0].shape) : Tensor(), gb ? sum_to(*gb, e[1].shape) : Tensor()};
}
}  // namespace

namespace {
// The activations whose output autograd::RecomputeCheap marks (Note [Recompute cheap] in
// src/autograd/recompute.cpp): the op table's `cheap` rows (Note [Op table]). Each is one pass over
// memory to redo, and its gradient reads only x, which its node saves just above: a consumer that
// saves the output (a linear layer's input, the product of a GEGLU) then keeps a recipe that holds
// no bytes of its own. relu, tanh, sigmoid and exp save their output themselves: not marked.
// Returns the op's name (for messages), or null for an op that is not marked.
constexpr const char* recomputable_activation(UnaryOp op) {
  const char* name = nullptr;
  switch (op) {
#define FLAME_RECOMPUTE(name_, Functor, kind, surface, autocast, recompute) \
  case UnaryOp::name_: name = std::string_view(#recompute) == "cheap" ? #name_ : nullptr; break;
    FLAME_UNARY_OPS(FLAME_RECOMPUTE)
#undef FLAME_RECOMPUTE
  }
  if (name == nullptr) return nullptr;
  return opdef::unary_reads(op) == Reads::x ? name : nullptr;
}

// The recipe reruns the op's kernel on the input the node saved (x, after dtype promotion).
void mark_activation(const Tensor& out, UnaryOp op, const char* name, const Tensor& x, const UnaryParams& p) {
  autograd_detail::mark_recomputable(out, name, {x}, [op, p](const TensorList& in) { return unary_op(op, in[0], p); });
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
  const Reads reads = opdef::unary_reads(op);
  if (opdef::reads_x(reads)) n.save(x);
  if (opdef::reads_y(reads)) n.save(out, /*is_output=*/true);
  // One thread-local test while no RecomputeCheap guard is on.
  if (autograd_detail::t_recompute_cheap) [[unlikely]] {
    if (const char* name = recomputable_activation(op)) mark_activation(out, op, name, x, p);
  }
}

void binary(Tensor& out, BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& ac, const Tensor& bc) {
  if (!is_floating(out.dtype()) || !needs_grad({a, b})) return;
  RuleArgs args;
  args.op = static_cast<int>(op);
  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  args.need[0] = need_a;
  args.need[1] = need_b;
  Node& n = record(out, binary_name(op), {a, b}, &binary_backward, std::move(args));
  // Keep exactly what the formula reads, in binary_backward's slot order (a, b, y).
  const opdef::BinaryReads r = opdef::binary_reads(op, need_a, need_b);
  if (r.a) n.save(ac);
  if (r.b) n.save(bc);
  if (r.y) n.save(out, /*is_output=*/true);
}

void where(Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  if (!is_floating(out.dtype()) || !needs_grad({a, b})) return;
  const Shape as = a.sizes(), bs = b.sizes();
  SavedTensor sc(cond, "where");  // Note [Saved indices] (rules/index.cpp): a mask buffer may be refilled
  record(out, "where", {cond, a, b}, [sc, as, bs](const Tensor& g) {
    TensorAlgebra B{g};
    auto [ga, gb] = opdef::where_grad(B, sc.get(), g);
    return TensorList{Tensor(), sum_to(ga, as), sum_to(gb, bs)};
  });
}

}  // namespace flame::rules
