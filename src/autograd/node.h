#pragma once
// Graph nodes. Internal to the library; ops record nodes through src/autograd/record.h.
//
// Note [Node saved tensors]
// A node keeps the tensors its rule reads in saved_ (SavedTensor: the data plus its version at
// save time), never hidden in a lambda, so that autograd_saved_bytes() can report what a graph
// holds and release() frees it all. Rules are either a plain function pointer over the node
// (RuleFn: saved tensors and small parameters in the node, no allocation beyond the node) or, for
// one-line view rules and user code, a std::function (BackwardFn) that captures no tensors.
//
// Note [Graph release]
// A graph is a chain of shared_ptrs (tensor -> meta -> node -> edge meta -> node ...). Freeing
// it by plain destructor recursion takes one stack frame per op and overflows on long chains, so
// ~Node unlinks the chain iteratively: whatever it is the last owner of is moved onto a local
// stack and taken apart there. Shared parts (another graph or tensor still holds them) are left
// to their other owner, whose destructor does the same; use_count() == 1 means no other thread
// can reach the object, so this is race-free.
#include <cstdint>
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

// A tensor a rule reads during backward, with the storage version at save time. Held detached by
// default (a handle outside any graph: no reference cycle through the output's node); Node::save
// holds inputs as they are (their history cannot lead back to the node) and only the node's own
// output detached.
class SavedTensor {
 public:
  SavedTensor() = default;
  explicit SavedTensor(const Tensor& t, const char* op = "", bool detach = true);
  Tensor get() const;  // raises if the storage was written in place since it was saved
  bool defined() const { return tensor_.defined(); }
  const Tensor& raw() const { return tensor_; }  // no version check (for accounting)

 private:
  Tensor tensor_;
  uint64_t version_ = 0;
  const char* op_ = "";
};

// Small parameters of a RuleFn (which operation, which inputs need a gradient, scalars).
struct RuleArgs {
  int op = 0;
  bool need[2] = {false, false};
  double a = 0, b = 0, c = 0;
  int64_t dim = 0;
  int64_t count = 0;
  Shape shape;  // a shape the rule needs besides the inputs' (e.g. keep_shape of a reduction)
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
    mutable int32_t slot = -1;  // engine scratch: the leaf's slot in the running backward
  };
  using BackwardFn = std::function<TensorList(const Tensor& grad)>;
  using RuleFn = TensorList (*)(const Tensor& grad, const Node& node);

  Node(const char* name, const TensorList& inputs, BackwardFn fn);
  Node(const char* name, std::initializer_list<std::reference_wrapper<const Tensor>> inputs, RuleFn rule,
       RuleArgs args);
  ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  const char* name() const { return name_; }
  const std::vector<Edge>& edges() const { return edges_; }
  bool released() const { return released_; }
  TensorList apply(const Tensor& grad);
  void release();  // drops saved tensors (after a backward without retain_graph)

  // Saved tensors (Note [Node saved tensors]); save() returns the slot.
  std::size_t save(const Tensor& t, bool is_output = false);
  Tensor saved(std::size_t i) const { return saved_[i].get(); }
  const std::vector<SavedTensor>& saved_tensors() const { return saved_; }
  const RuleArgs& args() const { return args_; }

  // State of the backward pass walking this node (Note [Backward order] in backward.cpp). A
  // graph's non-leaf part is walked by one backward at a time; threads share only leaves.
  struct Scratch {
    uint64_t run = 0;               // id of the backward that last discovered the node
    int32_t deps = 0;               // contributions still to arrive
    bool owned = false;             // pending is a buffer this backward made (may add in place)
    Tensor pending;                 // sum of the contributions so far
    AutogradMeta* meta = nullptr;   // the vertex (its hooks run on the summed gradient)
  };
  Scratch scratch;

 private:
  void add_edge(const Tensor& t);

  const char* name_;  // static or interned (backward_name): the grad_fn name ("MulBackward")
  std::vector<Edge> edges_;
  std::vector<SavedTensor> saved_;
  BackwardFn fn_;
  RuleFn rule_ = nullptr;
  RuleArgs args_;
  bool released_ = false;
};

}  // namespace flame
