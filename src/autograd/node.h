#pragma once
// Graph nodes. Internal to the library; ops record nodes through src/autograd/record.h.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flame/autograd.h"
#include "src/core/tensor_impl.h"

namespace flame {

class Node;

// Per-tensor autograd state. Leaves (grad_fn == null) that require grad receive entries in the
// Gradients store; non-leaves pass their gradient on to grad_fn.
struct AutogradMeta {
  bool requires_grad = false;
  std::shared_ptr<Node> grad_fn;
  std::vector<GradHook> hooks;
};

// A recorded op: one output, one gradient per input.
class Node {
 public:
  struct Edge {
    std::shared_ptr<AutogradMeta> meta;  // null: this input needs no gradient
    Tensor leaf;                         // the input itself when it is a leaf (the store's key)
    Shape shape;
    DType dtype = DType::f32;
    Device device;
  };
  using BackwardFn = std::function<TensorList(const Tensor& grad)>;

  Node(std::string name, const TensorList& inputs, BackwardFn fn);
  const std::string& name() const { return name_; }
  const std::vector<Edge>& edges() const { return edges_; }
  bool released() const { return released_; }
  TensorList apply(const Tensor& grad);
  void release();  // drops saved tensors (after a backward without retain_graph)

 private:
  std::string name_;
  std::vector<Edge> edges_;
  BackwardFn fn_;
  bool released_ = false;
};

}  // namespace flame
