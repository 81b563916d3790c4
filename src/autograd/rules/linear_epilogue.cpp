// Gradient rules of Linear's fused epilogue ops. With d the gradient at the pre-activation
// (d = dy, or dy * gelu_tanh'(pre) for linear_gelu): dx = d W, dW = d^T x, db = column sums of d.
// The backend fuses where it can (Note [Linear epilogues]): d in one elementwise kernel, dW and db
// in one GEMM (bias-gradient epilogue); for mlp_gelu the hidden layer's d comes out of the second
// layer's data-gradient GEMM (dGELU epilogue). f32 master weights (Note [Master-weight epilogues])
// get f32 dW and db from the same GEMM; the saved W is the low-precision copy the forward read.
// Where the backend declines,
// the same formulas run as ordinary ops. Saved: x (as the GEMM read it) when W needs a gradient,
// W when x does (or, for mlp_gelu, when the hidden layer does), and pre.
#include "src/ops/grad_hooks.h"

#include "flame/autograd.h"
#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"
#include "src/ops/elementwise.h"
#include "src/backend/fused/linear_epilogue.h"
#include "src/autograd/rules/input_grad.h"

namespace flame::rules {
namespace {

using backend::UnaryOp;

// dy * gelu_tanh'(pre), fused where the backend can.
Tensor gelu_tanh_grad_of(const Tensor& dy, const Tensor& pre) {
  Tensor d = make_empty(pre.sizes(), pre.dtype(), pre.device());
  if (backend::fused::gelu_tanh_backward.try_run(pre.device(), d, dy, pre)) return d;
  return dy * unary_op(UnaryOp::gelu_tanh_grad, pre, backend::UnaryParams{});
}

// dW = d^T x2 and db = column sums of d, each only when wanted, in the dtypes of w's and b's
// edges: d's, or f32 for master weights (Note [Master-weight epilogues]), straight from the GEMM's
// accumulator where the backend can; else in d's dtype and cast up, as the unfused autocast did.
// sums: d's column sums when a fused kernel already has them (Note [Gradient row sums]), else
// undefined; db is then taken from them.
void weight_and_bias_grads(const Tensor& d, const Tensor& x2, const Node::Edge& we, const Node::Edge& be, Tensor& dw,
                           Tensor& db, const Tensor& sums = Tensor()) {
  const bool need_w = we.meta != nullptr;
  bool need_b = be.meta != nullptr;
  if (need_b && sums.defined()) {
    db = sums.dtype() == be.dtype ? sums : sums.to(be.dtype);
    need_b = false;
  }
  const DType wdt = need_w ? we.dtype : d.dtype(), bdt = need_b ? be.dtype : d.dtype();
  if (need_w && (need_b || wdt != d.dtype())) {
    const int64_t out = d.size(1), in = x2.size(1);
    dw = make_empty({out, in}, wdt, d.device());
    Tensor db_out = need_b ? make_empty({out}, bdt, d.device()) : Tensor();
    if (backend::fused::linear_wgrad_bgrad.try_run(d.device(), dw, db_out, d, x2)) {
      if (need_b) db = db_out;
      return;
    }
  }
  if (need_w) {
    dw = d.t().matmul(x2);
    if (wdt != dw.dtype()) dw = dw.to(wdt);
  }
  if (need_b) {
    db = d.sum({0});
    if (bdt != db.dtype()) db = db.to(bdt);
  }
}

// Saved slots: x2 (args.need[0]), w (args.need[1]), pre (args.op == 1). args.count = rows.
// args.op == 2: the third input is linear_add's residual c (Note [Residual epilogue]): dc = dy.
TensorList linear_epilogue_backward(const Tensor& g, const Node& n) {
  const auto& e = n.edges();
  const bool need_x = e[0].meta != nullptr;
  std::size_t slot = 0;
  const Tensor x2 = n.args().need[0] ? n.saved(slot++) : Tensor();
  const Tensor w = n.args().need[1] ? n.saved(slot++) : Tensor();
  const Tensor pre = n.args().op == 1 ? n.saved(slot++) : Tensor();
  const DType dt = e[0].dtype;  // the GEMMs' dtype (w's may be f32: Note [Master-weight epilogues])
  const int64_t rows = n.args().count, out = e[1].shape[0];
  const Tensor g2 = g.to(dt).reshape({rows, out}).contiguous();
  const Tensor d = pre.defined() ? gelu_tanh_grad_of(g2, pre) : g2;
  const bool residual = n.args().op == 2;
  // Note [Gradient row sums]: the bias gradient of a plain linear may come with g (a residual's
  // gradient is g itself: its sums stay attached for the residual's producer).
  const Tensor sums = !pre.defined() && !residual && e[2].meta ? autograd_detail::take_row_sums(g) : Tensor();
  Tensor dx, dw, db;
  // Note [Accumulated input gradients]: x's other contributions summed in the GEMM's epilogue.
  if (need_x) dx = accumulated_input_grad(n, 0, d, w, e[0].shape.vec());
  weight_and_bias_grads(d, x2, e[1], residual ? Node::Edge{} : e[2], dw, db, sums);
  if (residual && e[2].meta) db = g.dtype() == e[2].dtype ? g : g.to(e[2].dtype);
  return {dx, dw, db};
}

// Inputs {x, w1, b1, w2, b2}. Saved slots: x2 (need w1), w1 (need x), w2 (need anything below
// the second layer), pre (same, or need w2 when recomputing h), h (need w2, unless recomputing:
// args.op == 1). args.count = rows.
TensorList mlp_gelu_backward(const Tensor& g, const Node& n) {
  const auto& e = n.edges();
  auto need = [&](std::size_t i) { return e.size() > i && e[i].meta != nullptr; };
  const bool need_x = need(0), need_w1 = need(1), need_b1 = need(2), need_w2 = need(3), need_b2 = need(4);
  const bool need_hidden = need_x || need_w1 || need_b1;
  const bool recompute = n.args().op == 1;
  std::size_t slot = 0;
  const Tensor x2 = need_w1 ? n.saved(slot++) : Tensor();
  const Tensor w1 = need_x ? n.saved(slot++) : Tensor();
  const Tensor w2 = need_hidden ? n.saved(slot++) : Tensor();
  const Tensor pre = need_hidden || (recompute && need_w2) ? n.saved(slot++) : Tensor();
  const DType dt = e[0].dtype;  // the GEMMs' dtype (the weights' may be f32: Note [Master-weight epilogues])
  const Device dev = e[1].device;
  const int64_t rows = n.args().count, hidden = e[1].shape[0], out = e[3].shape[0];
  const Tensor g2 = g.to(dt).reshape({rows, out}).contiguous();
  Tensor dx, dw1, db1, dw2, db2;
  if (need_w2 || need_b2) {
    // h lives only for this GEMM when recomputed: the same unary kernel as the forward's
    // composite (the fused forward rounds gelu of the f32 accumulator, so low-precision h may
    // differ from it in the last bit).
    const Tensor h = !need_w2     ? Tensor()
                     : recompute ? unary_op(UnaryOp::gelu_tanh, pre, backend::UnaryParams{})
                                 : n.saved(slot++);
    weight_and_bias_grads(g2, h, e[3], e[4], dw2, db2, need_b2 ? autograd_detail::take_row_sums(g) : Tensor());
  }
  if (need_hidden) {
    // d at the hidden pre-activation, (g2 W2) * gelu_tanh'(pre), in one GEMM if possible. db1
    // comes from the dW1 GEMM (BGRADB) rather than from DGELU_BGRAD here: on an H100 the
    // DGELU_BGRAD GEMM of the DiT-S MLP made its forward+backward slower than unfused ops.
    Tensor d = make_empty({rows, hidden}, dt, dev);
    if (!backend::fused::linear_dgelu_bgrad.try_run(dev, d, Tensor(), g2, w2, pre))
      d = gelu_tanh_grad_of(g2.matmul(w2), pre);
    weight_and_bias_grads(d, x2, e[1], e[2], dw1, db1);
    if (need_x) dx = d.matmul(w1).reshape(e[0].shape.vec());
  }
  return {dx, dw1, db1, dw2, db2};
}

}  // namespace

void linear_epilogue(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& x2,
                     const Tensor& pre, const Tensor& w_run) {
  if (!needs_grad({x, w, b})) return;
  RuleArgs args;
  args.op = pre.defined() ? 1 : 0;
  args.need[0] = w.requires_grad();
  args.need[1] = x.requires_grad();
  args.count = x2.size(0);
  Node& n = record(y, pre.defined() ? "LinearGeluBackward" : "AddmmBackward", {x, w, b}, &linear_epilogue_backward,
                   std::move(args));
  if (w.requires_grad()) n.save(x2);
  if (x.requires_grad()) n.save(w_run);
  if (pre.defined()) n.save(pre);
  if (x.requires_grad()) n.accept_accumulate_base(0);  // Note [Accumulated input gradients]
}

void linear_residual(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& c, const Tensor& x2,
                     const Tensor& w_run) {
  if (!needs_grad({x, w, c})) return;
  RuleArgs args;
  args.op = 2;
  args.need[0] = w.requires_grad();
  args.need[1] = x.requires_grad();
  args.count = x2.size(0);
  Node& n = record(y, "AddmmBackward", {x, w, c}, &linear_epilogue_backward, std::move(args));
  if (w.requires_grad()) n.save(x2);
  if (x.requires_grad()) n.save(w_run);
  if (x.requires_grad()) n.accept_accumulate_base(0);  // Note [Accumulated input gradients]
}

void mlp_gelu(Tensor& y, const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
              const Tensor& x2, const Tensor& pre, const Tensor& h, bool recompute_hidden, const Tensor& w1_run,
              const Tensor& w2_run) {
  if (!needs_grad({x, w1, b1, w2, b2})) return;
  const bool need_hidden = x.requires_grad() || w1.requires_grad() || (b1.defined() && b1.requires_grad());
  RuleArgs args;
  args.count = x2.size(0);
  args.op = recompute_hidden ? 1 : 0;
  Node& n = record(y, "MlpGeluBackward", {x, w1, b1, w2, b2}, &mlp_gelu_backward, std::move(args));
  if (w1.requires_grad()) n.save(x2);
  if (x.requires_grad()) n.save(w1_run);
  if (need_hidden) n.save(w2_run);
  if (need_hidden || (recompute_hidden && w2.requires_grad())) n.save(pre);
  if (w2.requires_grad() && !recompute_hidden) n.save(h);
}

}  // namespace flame::rules
