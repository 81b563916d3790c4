// The CPU path of a fused region: the same Expr that becomes one generated kernel on CUDA is run
// here node by node with the eager backend kernels (no autograd, no tracing), so CI, gradcheck and
// machines without a GPU exercise the traced IR and its generated derivatives. Each node's result
// is stored in its dtype, which is exactly what the generated kernel's rounding reproduces
// (Note [Rounding] in codegen.cpp).
#include "flame/autograd.h"
#include "src/backend/backend.h"
#include "src/compile/ir.h"
#include "src/core/tensor_impl.h"

namespace flame::compile_detail {

TensorList interpret_expr(const Expr& e, const TensorList& inputs) {
  FLAME_CHECK(static_cast<int>(inputs.size()) == e.num_inputs, "compile", "expression of ", e.num_inputs,
              " inputs run on ", inputs.size());
  const Device dev = inputs.empty() ? Device::cpu() : inputs[0].device();
  backend::Backend& be = backend::backend_for(dev);
  std::vector<Tensor> v(e.nodes.size());
  auto operand = [&](int i, const Shape& shape) { return v[i].sizes() == shape ? v[i] : v[i].expand(shape); };
  for (std::size_t i = 0; i < e.nodes.size(); ++i) {
    const ExprNode& n = e.nodes[i];
    if (n.op == ExprOp::input) {
      v[i] = inputs[n.slot];
      continue;
    }
    if (n.op == ExprOp::constant) {
      v[i] = Tensor::full({}, n.value, TensorOptions(n.dtype, dev));
      continue;
    }
    Tensor out = make_empty(n.shape, n.dtype, dev, "compile");
    if (out.numel() > 0) {
      switch (n.op) {
        case ExprOp::unary: be.unary(n.unary, out, operand(n.a, n.shape), n.params); break;
        case ExprOp::binary: be.binary(n.binary, out, operand(n.a, n.shape), operand(n.b, n.shape)); break;
        case ExprOp::where: be.where(out, operand(n.c, n.shape), operand(n.a, n.shape), operand(n.b, n.shape)); break;
        case ExprOp::cast: be.copy(out, operand(n.a, n.shape)); break;
        default: break;
      }
    }
    v[i] = std::move(out);
  }
  TensorList outs;
  for (int o : e.outputs) {
    const Tensor& t = v[o];
    if (t.sizes() == e.shape && t.is_contiguous() && t.impl()->storage != nullptr &&
        e.nodes[o].op != ExprOp::input) {
      outs.push_back(t);
    } else {  // an input or a broadcast value: a fresh dense copy over the iteration shape
      Tensor c = make_empty(e.shape, t.dtype(), dev, "compile");
      if (c.numel() > 0) be.copy(c, operand(o, e.shape));
      outs.push_back(std::move(c));
    }
  }
  return outs;
}

TensorList run_expr(const Expr& e, const TensorList& inputs, const std::string& tag) {
  if (!inputs.empty() && inputs[0].device().is_cuda()) return launch_expr(e, inputs, tag);
  return interpret_expr(e, inputs);
}

}  // namespace flame::compile_detail
