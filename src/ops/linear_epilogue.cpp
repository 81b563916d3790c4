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
//  - Autocast: the three follow linear's policy (low precision, bias included).
#include <optional>

#include "flame/autograd.h"
#include "flame/nn/linear.h"
#include "flame/nn/linear_gelu.h"
#include "flame/ops.h"
#include "src/amp/autocast.h"
#include "src/autograd/record.h"
#include "src/autograd/rules/linear_epilogue.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"
#include "src/ops/linear_epilogue.h"

namespace flame {
namespace {

void check_linear_args(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias,
                       const char* wname = "weight") {
  FLAME_CHECK(x.defined() && weight.defined(), op, "undefined input or ", wname);
  FLAME_CHECK(weight.dim() == 2, op, wname, " must be 2-d [out_features, in_features], got shape ", weight.sizes());
  FLAME_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), op, "input of shape ", x.sizes(),
              " does not end in in_features = ", weight.size(1), " (", wname, " shape ", weight.sizes(), ")");
  FLAME_CHECK(is_floating(x.dtype()), op, "expects floating tensors, got ", dtype_name(x.dtype()));
  FLAME_CHECK(x.dtype() == weight.dtype(), op, "input dtype ", dtype_name(x.dtype()), " differs from ", wname,
              " dtype ", dtype_name(weight.dtype()));
  FLAME_CHECK(x.device() == weight.device(), op, "input on ", x.device().str(), ", ", wname, " on ",
              weight.device().str());
  if (bias.defined()) {
    FLAME_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0), op, "bias must have shape [", weight.size(0),
                "], got ", bias.sizes());
    FLAME_CHECK(bias.dtype() == weight.dtype() && bias.device() == weight.device(), op, "bias is ",
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

// One dense layer on x2 [rows, in] (contiguous): act(x2 w^T + b) as [rows, out], fused when the
// backend can. pre (when want_pre and gelu) receives the pre-activation. compose = false returns
// an undefined tensor instead of running the composite.
Tensor dense(const char* op, const Tensor& x2, const Tensor& w, const Tensor& b, bool gelu, bool want_pre,
             bool compose, Tensor& pre) {
  const int64_t rows = x2.size(0), out = w.size(0);
  backend::Backend& be = backend::backend_for(x2.device());
  if (rows > 0 && out > 0 && x2.size(1) > 0) {
    Tensor y = make_empty({rows, out}, x2.dtype(), x2.device(), op);
    Tensor p = gelu && want_pre ? make_empty({rows, out}, x2.dtype(), x2.device(), op) : Tensor();
    if (be.linear_bias_act(y, p, x2, w, b, gelu)) {
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

// linear (gelu = false, fused or nothing) and linear_gelu (always).
Tensor linear_act(const char* op, const Tensor& x, const Tensor& w, const Tensor& b, bool gelu) {
  const int64_t in = w.size(1), out = w.size(0), rows = leading_rows(x);
  const bool grad = needs_grad({x, w, b});
  Tensor y, x2, pre;
  {
    NoGradGuard no_grad;
    x2 = x.reshape({rows, in});
    if (!gelu && !x2.is_contiguous()) return Tensor();  // linear keeps its copy-free strided path
    x2 = x2.contiguous();
    y = dense(op, x2, w, b, gelu, grad, /*compose=*/gelu, pre);
    if (!y.defined()) return y;
    y = y.view(with_last(x, out));
  }
  if (grad) rules::linear_epilogue(y, x, w, b, x2, pre);
  return y;
}

}  // namespace

std::optional<Tensor> detail::linear_bias_fused(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (!bias.defined() || x.device().is_cpu()) return std::nullopt;  // the CPU backend always declines
  Tensor y = linear_act("linear", x, weight, bias, /*gelu=*/false);
  if (!y.defined()) return std::nullopt;
  return y;
}

namespace nn::functional {

Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (amp::detail::should_autocast(x)) {  // Note [Autocast policy]: as linear, bias included
    amp::detail::AutocastOpScope scope;
    return linear_gelu(amp::detail::cast_low(x), amp::detail::cast_low(weight), amp::detail::cast_low(bias));
  }
  check_linear_args("linear_gelu", x, weight, bias);
  return linear_act("linear_gelu", x, weight, bias, /*gelu=*/true);
}

Tensor mlp_gelu(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
                bool recompute_hidden) {
  if (amp::detail::should_autocast(x)) {  // Note [Autocast policy]: as linear, biases included
    amp::detail::AutocastOpScope scope;
    return mlp_gelu(amp::detail::cast_low(x), amp::detail::cast_low(w1), amp::detail::cast_low(b1),
                    amp::detail::cast_low(w2), amp::detail::cast_low(b2), recompute_hidden);
  }
  check_linear_args("mlp_gelu", x, w1, b1, "w1");
  FLAME_CHECK(w2.defined() && w2.dim() == 2 && w2.size(1) == w1.size(0), "mlp_gelu",
              "w2 must be 2-d [out_features, ", w1.size(0), "] to follow w1 of shape ", w1.sizes(), ", got ",
              w2.defined() ? w2.sizes() : Shape{});
  FLAME_CHECK(w2.dtype() == w1.dtype() && w2.device() == w1.device(), "mlp_gelu", "w2 is ", dtype_name(w2.dtype()),
              " on ", w2.device().str(), ", w1 is ", dtype_name(w1.dtype()), " on ", w1.device().str());
  if (b2.defined()) {
    FLAME_CHECK(b2.dim() == 1 && b2.size(0) == w2.size(0), "mlp_gelu", "b2 must have shape [", w2.size(0), "], got ",
                b2.sizes());
    FLAME_CHECK(b2.dtype() == w2.dtype() && b2.device() == w2.device(), "mlp_gelu", "b2 is ", dtype_name(b2.dtype()),
                " on ", b2.device().str(), ", w2 is ", dtype_name(w2.dtype()), " on ", w2.device().str());
  }
  const int64_t in = w1.size(1), out = w2.size(0), rows = leading_rows(x);
  const bool grad = needs_grad({x, w1, b1, w2, b2});
  Tensor y, x2, pre, h;
  {
    NoGradGuard no_grad;
    x2 = x.reshape({rows, in}).contiguous();
    h = dense("mlp_gelu", x2, w1, b1, /*gelu=*/true, grad, /*compose=*/true, pre);
    Tensor unused;
    y = dense("mlp_gelu", h, w2, b2, /*gelu=*/false, false, /*compose=*/true, unused).view(with_last(x, out));
  }
  if (grad) rules::mlp_gelu(y, x, w1, b1, w2, b2, x2, pre, h, recompute_hidden);
  return y;
}

}  // namespace nn::functional
}  // namespace flame
