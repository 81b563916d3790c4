// Linear with fused GEMM epilogues: the bias of F::linear, F::linear_gelu and F::mlp_gelu.
//
// Note [Linear epilogues]
// cuBLASLt can finish a GEMM with a small elementwise step on the tile still in registers. Linear
// uses that for: the bias add of the forward (EPILOGUE_BIAS), bias + gelu_tanh with the
// pre-activation written beside (GELU_AUX_BIAS; GELU_BIAS when no gradient is wanted), the bias
// gradient summed by the weight-gradient GEMM (BGRADB), and for mlp_gelu the hidden layer's
// gelu_tanh' applied by the data-gradient GEMM of the second layer (DGELU; its bias gradient
// still comes from BGRADB, DGELU_BGRAD measured slower). Each saves a pass over an [M, N]
// activation in memory.
//  - Who decides: the backend (Backend::linear_bias_act and friends, backend.h) answers false
//    when it has no fused kernel for the call, before writing anything; the op layer then runs
//    the same math as ordinary ops (matmul, add, gelu, sum). The CPU backend always declines, so
//    the composite is the CPU reference the CUDA kernels are tested against, and f64 gradchecks
//    run through it.
//  - The CUDA rule (src/backend/cuda/epi/linear_epilogue.cu): dtype bf16, f16 or f32 (f32 on TF32
//    tensor cores only when allow_tf32 is set, as matmul); contiguous operands (x after reshape to
//    [rows, in], weight, bias); in_features and out_features multiples of 8 (cuBLASLt's aux leading
//    dimension must be, and every row then starts 16-byte aligned); pointers 16-byte aligned;
//    sizes below 2^31; and cuBLASLt's heuristic offering an algorithm for that epilogue and shape.
//    Anything else composes: odd sizes, f64, transposed or sliced weights.
//  - F::linear with a bias uses the fused forward only when x reshapes to [rows, in] without a
//    copy; otherwise it keeps its strided matmul + add, which needs no copy. Without a bias it
//    is a plain matmul as before. Either way its result and gradients are the same math.
//  - linear_gelu and mlp_gelu are always one op and one autograd node, whichever way they ran.
//    The pre-activation (and for mlp_gelu the hidden activation, unless recompute_hidden asks
//    the backward to redo gelu(pre) instead) is saved in the compute dtype.
//  - Autocast: the three follow linear's policy (low precision, bias included), with the f32
//    weights and biases kept as the node's inputs (below).
//
// Note [Master-weight epilogues]
// Under bf16/f16 autocast a Linear's f32 weight would be cast to the low dtype by a recorded op,
// whose backward casts the low-precision weight gradient back up: two small kernels per weight
// and per bias, every step, and a gradient rounded to bf16 on its way into an f32 store. When the
// weight is f32 and wants a gradient (the trainable master weights of mixed precision), linear,
// linear_gelu and mlp_gelu record one node whose inputs are the f32 weight and bias themselves:
//  - forward: the GEMMs read low-precision copies of the weight and bias, made without a graph
//    and kept across steps (Note [Kept low-precision copies] in src/amp/autocast.cpp; the bias
//    too: cuBLASLt 13's bias epilogues offer no algorithm for an f32 bias beside a bf16 result).
//  - backward: the weight-gradient GEMM writes dW (and its bias-gradient epilogue db) in f32
//    straight from its f32 accumulator; no cast kernels, no bf16 rounding of the gradient. Where
//    the backend declines, the composite computes them in the low dtype and casts up, which is
//    exactly the unfused autocast's result (and what the CPU reference does).
// Hooks on the weight see the same f32 gradient as before; the low-precision copy is internal and
// saved for the data gradient as the cast used to be. A weight that is frozen (no gradient) or
// not f32 takes the ordinary casts.
//
// Note [Residual epilogue]
// linear_add(x, W, c) = x W^T + c (torch.addmm with beta = alpha = 1, any leading dims): the GEMM
// adds c as its C matrix (fused::matmul_add, cuBLASLt's beta = 1), so the sum is rounded once and
// costs no pass of its own. LoRA's output y = base(x) + (s B) A x' is one: the adapter's second
// GEMM adds the base layer's output. c has the output's shape (no broadcasting) and, without
// autocast, the GEMM's dtype; autocast casts it to the low dtype as addmm's policy does. One node
// with inputs {x, W, c}: dx and dW as linear (the master-weight path included), dc = dy. The CPU
// backend declines, and the node then computes x W^T + c with ordinary ops (the reference).
#include <optional>

#include "flame/grad_mode.h"
#include "flame/nn/linear_gelu.h"
#include "flame/ops.h"
#include "src/ops/autocast_hooks.h"
#include "src/core/grad_state.h"
#include "src/ops/grad_hooks.h"
#include "src/backend/backend.h"
#include "src/backend/fused/linear_epilogue.h"
#include "src/backend/fused/matmul_add.h"
#include "src/core/tensor_impl.h"
#include "src/ops/linear_epilogue.h"

namespace flame {
namespace {

// master: weight (or the copy the GEMMs read) and bias belong to an f32 master weight beside a
// low-precision x (Note [Master-weight epilogues]): the bias may then be f32 or x's dtype.
void check_linear_args(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias,
                       const char* wname = "weight", bool master = false) {
  FLAME_CHECK(x.defined() && weight.defined(), op, "undefined input or ", wname);
  FLAME_CHECK(weight.dim() == 2, op, wname, " must be 2-d [out_features, in_features], got shape ", weight.sizes());
  FLAME_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), op, "input of shape ", x.sizes(),
              " does not end in in_features = ", weight.size(1), " (", wname, " shape ", weight.sizes(), ")");
  FLAME_CHECK(is_floating(x.dtype()), op, "expects floating tensors, got ", dtype_name(x.dtype()));
  FLAME_CHECK(master || x.dtype() == weight.dtype(), op, "input dtype ", dtype_name(x.dtype()), " differs from ",
              wname, " dtype ", dtype_name(weight.dtype()));
  FLAME_CHECK(x.device() == weight.device(), op, "input on ", x.device().str(), ", ", wname, " on ",
              weight.device().str());
  if (bias.defined()) {
    FLAME_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0), op, "bias must have shape [", weight.size(0),
                "], got ", bias.sizes());
    const bool dtype_ok = master ? bias.dtype() == DType::f32 || bias.dtype() == x.dtype() : bias.dtype() == weight.dtype();
    FLAME_CHECK(dtype_ok && bias.device() == weight.device(), op, "bias is ",
                dtype_name(bias.dtype()), " on ", bias.device().str(), ", ", wname, " is ",
                dtype_name(weight.dtype()), " on ", weight.device().str());
  }
}

int64_t leading_rows(const Tensor& x) {
  int64_t rows = 1;  // counted explicitly: in_features = 0 leaves reshape's -1 ambiguous
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

Shape with_last(const Tensor& x, int64_t last) {
  Shape s(x.sizes().begin(), x.sizes().end() - 1);
  s.push_back(last);
  return s;
}

// Whether autocast hands linear's f32 weight w to the op itself (Note [Master-weight epilogues]):
// x already in a half dtype, w f32 and wanting a gradient, gradients recorded.
bool master_weight(const Tensor& xl, const Tensor& w) {
  return xl.defined() && (xl.dtype() == DType::bf16 || xl.dtype() == DType::f16) && w.defined() && w.dtype() == DType::f32 &&
         w.requires_grad() && grad_enabled();
}
// The low-precision copy of a master weight the GEMMs read, without a graph: the weight's kept
// copy (Note [Kept low-precision copies] in src/amp/autocast.cpp).
Tensor run_copy(const Tensor& w, DType dt) {
  if (!w.defined() || w.dtype() == dt) return w;
  NoGradGuard no_grad;
  return amp::detail::master_low_copy(w);
}

// One dense layer on x2 [rows, in] (contiguous): act(x2 w^T + b) as [rows, out], fused when the
// backend can. pre (when want_pre and gelu) receives the pre-activation. compose = false returns
// an undefined tensor instead of running the composite.
Tensor dense(const char* op, const Tensor& x2, const Tensor& w, const Tensor& b, bool gelu, bool want_pre,
             bool compose, Tensor& pre) {
  const int64_t rows = x2.size(0), out = w.size(0);
  if (rows > 0 && out > 0 && x2.size(1) > 0) {
    Tensor y = make_empty({rows, out}, x2.dtype(), x2.device(), op);
    Tensor p = gelu && want_pre ? make_empty({rows, out}, x2.dtype(), x2.device(), op) : Tensor();
    if (backend::fused::linear_bias_act.try_run(x2.device(), y, p, x2, w, b, gelu)) {
      pre = p;
      return y;
    }
  }
  if (!compose) return Tensor();
  Tensor p = x2.matmul(w.t());
  if (b.defined()) p = p + b;
  if (!gelu) return p;
  if (want_pre) pre = p;
  return p.gelu(/*tanh_approximation=*/true);
}

// linear (gelu = false, fused or nothing, unless w is a master weight) and linear_gelu (always).
// w_run: what the GEMMs read (w, or its low-precision copy when w is a master weight; b is then
// read through its copy too).
Tensor linear_act(const char* op, const Tensor& x, const Tensor& w, const Tensor& b, bool gelu, const Tensor& w_run) {
  const int64_t in = w.size(1), out = w.size(0), rows = leading_rows(x);
  const bool grad = needs_grad({x, w, b});
  const bool master = w_run.dtype() != w.dtype();
  Tensor y, x2, pre;
  {
    NoGradGuard no_grad;
    x2 = x.reshape({rows, in});
    if (!gelu && !master && !x2.is_contiguous()) return Tensor();  // linear keeps its copy-free strided path
    x2 = x2.contiguous();
    y = dense(op, x2, w_run, master ? run_copy(b, w_run.dtype()) : b, gelu, grad, /*compose=*/gelu || master, pre);
    if (!y.defined()) return y;
    y = y.view(with_last(x, out));
  }
  if (grad) rules::linear_epilogue(y, x, w, b, x2, pre, w_run);
  return y;
}

// linear (gelu = false) or linear_gelu under autocast on an f32 master weight (Note [Master-weight
// epilogues]); nullopt when w is not one (the caller casts as usual).
std::optional<Tensor> master_act(const char* op, const Tensor& xl, const Tensor& w, const Tensor& b, bool gelu) {
  if (!master_weight(xl, w)) return std::nullopt;
  check_linear_args(op, xl, w, b, "weight", /*master=*/true);
  return linear_act(op, xl, w, b, gelu, run_copy(w, xl.dtype()));
}

// linear_add's residual: the output's shape, x's dtype and device.
void check_residual(const Tensor& x, const Tensor& w, const Tensor& c) {
  const Shape want = with_last(x, w.size(0));
  FLAME_CHECK(c.sizes() == want, "linear_add", "residual must have the output's shape ", want, " (input ", x.sizes(),
              ", weight ", w.sizes(), "), got ", c.sizes());
  FLAME_CHECK(c.dtype() == x.dtype() && c.device() == x.device(), "linear_add", "residual is ", dtype_name(c.dtype()),
              " on ", c.device().str(), ", input is ", dtype_name(x.dtype()), " on ", x.device().str());
}

// linear_add after its checks (Note [Residual epilogue]); w_run as linear_act's.
Tensor linear_residual(const Tensor& x, const Tensor& w, const Tensor& c, const Tensor& w_run) {
  const int64_t in = w.size(1), out = w.size(0), rows = leading_rows(x);
  Tensor y, x2;
  {
    NoGradGuard no_grad;
    x2 = x.reshape({rows, in}).contiguous();
    const Tensor c2 = c.reshape({rows, out}).contiguous();
    Tensor y2 = make_empty({rows, out}, x.dtype(), x.device(), "linear_add");
    if (!backend::fused::matmul_add.try_run(x.device(), y2, x2, w_run.t(), c2)) y2 = x2.matmul(w_run.t()) + c2;
    y = y2.view(with_last(x, out));
  }
  if (needs_grad({x, w, c})) rules::linear_residual(y, x, w, c, x2, w_run);
  return y;
}

}  // namespace

std::optional<Tensor> detail::linear_bias_fused(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (!bias.defined() || x.device().is_cpu()) return std::nullopt;  // the CPU backend always declines
  Tensor y = linear_act("linear", x, weight, bias, /*gelu=*/false, weight);
  if (!y.defined()) return std::nullopt;
  return y;
}

std::optional<Tensor> detail::linear_master(const Tensor& xl, const Tensor& weight, const Tensor& bias) {
  return master_act("linear", xl, weight, bias, /*gelu=*/false);
}

namespace nn::functional {

Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (amp::detail::should_autocast(x)) {  // Note [Autocast policy]: as linear, bias included
    amp::detail::AutocastOpScope scope;
    const Tensor xl = amp::detail::cast_low(x);
    if (auto y = master_act("linear_gelu", xl, weight, bias, /*gelu=*/true)) return *y;
    return linear_gelu(xl, amp::detail::cast_low(weight), amp::detail::cast_low(bias));
  }
  check_linear_args("linear_gelu", x, weight, bias);
  return linear_act("linear_gelu", x, weight, bias, /*gelu=*/true, weight);
}

Tensor mlp_gelu(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
                bool recompute_hidden) {
  // Autocast (Note [Autocast policy]: as linear, biases included): each layer's weight either is
  // a master weight (Note [Master-weight epilogues]; the GEMMs read w_run) or is cast as usual.
  Tensor xl = x, w1u = w1, b1u = b1, w2u = w2, b2u = b2, w1r = w1, w2r = w2;
  bool master1 = false, master2 = false;
  std::optional<amp::detail::AutocastOpScope> scope;
  if (amp::detail::should_autocast(x)) {
    scope.emplace();
    xl = amp::detail::cast_low(x);
    auto pick = [&](const Tensor& w, const Tensor& b, Tensor& wu, Tensor& bu, Tensor& wr) {
      if (master_weight(xl, w)) {
        wr = run_copy(w, xl.dtype());
        return true;
      }
      wu = wr = amp::detail::cast_low(w);
      bu = amp::detail::cast_low(b);
      return false;
    };
    master1 = pick(w1, b1, w1u, b1u, w1r);
    master2 = pick(w2, b2, w2u, b2u, w2r);
  }
  check_linear_args("mlp_gelu", xl, w1r, b1u, "w1", master1);
  FLAME_CHECK(w2r.defined() && w2r.dim() == 2 && w2r.size(1) == w1r.size(0), "mlp_gelu",
              "w2 must be 2-d [out_features, ", w1r.size(0), "] to follow w1 of shape ", w1r.sizes(), ", got ",
              w2r.defined() ? w2r.sizes() : Shape{});
  FLAME_CHECK(w2r.dtype() == w1r.dtype() && w2r.device() == w1r.device(), "mlp_gelu", "w2 is ",
              dtype_name(w2r.dtype()), " on ", w2r.device().str(), ", w1 is ", dtype_name(w1r.dtype()), " on ",
              w1r.device().str());
  if (b2u.defined()) {
    FLAME_CHECK(b2u.dim() == 1 && b2u.size(0) == w2r.size(0), "mlp_gelu", "b2 must have shape [", w2r.size(0),
                "], got ", b2u.sizes());
    FLAME_CHECK((b2u.dtype() == w2r.dtype() || (master2 && b2u.dtype() == DType::f32)) && b2u.device() == w2r.device(),
                "mlp_gelu", "b2 is ", dtype_name(b2u.dtype()), " on ", b2u.device().str(), ", w2 is ",
                dtype_name(w2r.dtype()), " on ", w2r.device().str());
  }
  const int64_t in = w1r.size(1), out = w2r.size(0), rows = leading_rows(xl);
  const bool grad = needs_grad({xl, w1u, b1u, w2u, b2u});
  Tensor y, x2, pre, h;
  {
    NoGradGuard no_grad;
    x2 = xl.reshape({rows, in}).contiguous();
    h = dense("mlp_gelu", x2, w1r, run_copy(b1u, w1r.dtype()), /*gelu=*/true, grad, /*compose=*/true, pre);
    Tensor unused;
    y = dense("mlp_gelu", h, w2r, run_copy(b2u, w2r.dtype()), /*gelu=*/false, false, /*compose=*/true, unused)
            .view(with_last(xl, out));
  }
  if (grad) rules::mlp_gelu(y, xl, w1u, b1u, w2u, b2u, x2, pre, h, recompute_hidden, w1r, w2r);
  return y;
}

Tensor linear_add(const Tensor& x, const Tensor& weight, const Tensor& residual) {
  FLAME_CHECK(residual.defined(), "linear_add", "undefined residual");
  if (amp::detail::should_autocast(x)) {  // Note [Autocast policy]: as linear, the residual cast too (addmm)
    amp::detail::AutocastOpScope scope;
    const Tensor xl = amp::detail::cast_low(x);
    const Tensor cl = amp::detail::cast_low(residual);
    if (!master_weight(xl, weight)) return linear_add(xl, amp::detail::cast_low(weight), cl);
    check_linear_args("linear_add", xl, weight, Tensor(), "weight", /*master=*/true);  // Note [Master-weight epilogues]
    check_residual(xl, weight, cl);
    return linear_residual(xl, weight, cl, run_copy(weight, xl.dtype()));
  }
  check_linear_args("linear_add", x, weight, Tensor());
  check_residual(x, weight, residual);
  return linear_residual(x, weight, residual, weight);
}

}  // namespace nn::functional
}  // namespace flame
