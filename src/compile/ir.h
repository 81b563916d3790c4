#pragma once
// The IR of flame::compile: an elementwise expression DAG (Expr) over numbered inputs, the unit
// that becomes one generated kernel (CUDA) or one interpreted run (CPU). See docs/compile.md.
#include <cstdint>
#include <string>
#include <vector>

#include "flame/tensor.h"
#include "src/opdef/op_list.h"

namespace flame::compile_detail {

// `eager` appears only in a traced Graph (an op replayed eagerly, src/compile/trace.h), never in an Expr.
enum class ExprOp : uint8_t { input, constant, unary, binary, where, cast, eager };

// One value of an expression. Operands (a, b, c) are indices of earlier nodes, so a node list is
// always in topological order. Every value has an element dtype; a generated kernel keeps it in
// that dtype's compute type, rounded through the dtype after each op (Note [Rounding] in
// codegen.cpp), which is what the eager ops store between kernels.
struct ExprNode {
  ExprOp op = ExprOp::input;
  DType dtype = DType::f32;
  Shape shape;             // the value's own shape (broadcasts to the expression's shape)
  int a = -1, b = -1, c = -1;
  int slot = -1;           // input: the index of the input tensor
  backend::UnaryOp unary = backend::UnaryOp::neg;
  backend::BinaryOp binary = backend::BinaryOp::add;
  backend::UnaryParams params;
  double value = 0.0;      // constant
};

// A DAG of elementwise values over `num_inputs` tensors, writing `outputs` (node indices), each
// as a contiguous tensor of `shape` (the iteration shape every value broadcasts to).
struct Expr {
  std::vector<ExprNode> nodes;
  std::vector<int> outputs;
  int num_inputs = 0;
  Shape shape;

  int add(ExprNode n) {
    nodes.push_back(std::move(n));
    return static_cast<int>(nodes.size()) - 1;
  }
};

// Name of a node's operation, for messages and kernel comments ("add", "gelu_tanh", "cast").
const char* expr_op_name(const ExprNode& n);

// Runs `e` on `inputs` (one per input slot, broadcastable to e.shape, on one device) and returns
// its outputs: a generated kernel on CUDA (codegen.cpp), the eager CPU kernels node by node
// elsewhere (interp.cpp). Records no autograd history.
TensorList run_expr(const Expr& e, const TensorList& inputs, const std::string& tag);
TensorList interpret_expr(const Expr& e, const TensorList& inputs);
// CUDA only; `tag` names the kernel (counted in the stats). Raises in builds without CUDA.
TensorList launch_expr(const Expr& e, const TensorList& inputs, const std::string& tag);
// What a generated kernel bakes in about one input.
struct OperandLayout {
  DType dtype = DType::f32;
  Shape sizes, strides;
};
std::vector<OperandLayout> layouts_of(const TensorList& inputs);
// The CUDA C++ source of the kernel for `e` with inputs in these layouts (their strides are baked
// in); `kernel_name` receives its extern "C" name. Pure string work: usable without a GPU.
std::string generate_kernel_source(const Expr& e, const std::vector<OperandLayout>& inputs, std::string* kernel_name);

// The reverse-mode derivative of e's single output (Note [Fused backward] in autodiff.cpp): an
// expression over e's inputs plus one more input slot (the output's gradient, slot
// e.num_inputs), with one output per input in `wanted` (its gradient over e.shape, in that input's
// dtype). `reads[i]` says whether the backward reads forward input i. Raises flame::Error naming
// the op for an op with no fused derivative.
Expr derivative_expr(const Expr& e, const std::vector<int>& wanted, const std::vector<DType>& input_dtypes,
                     std::vector<bool>* reads);

}  // namespace flame::compile_detail
