#pragma once
// The tracer of flame::compile (Note [Tracing] in trace.cpp).
#include <functional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "src/compile/ir.h"
#include "src/ops/trace_hooks.h"

namespace flame::compile_detail {

// Where a traced graph's input node gets its tensor at replay.
struct LeafSpec {
  enum class Kind { arg, arg_view, constant };
  Kind kind = Kind::arg;
  int arg = -1;
  Shape sizes, strides;  // arg_view: geometry, with the offset relative to the argument's
  int64_t offset = 0;
  Tensor constant;       // a tensor made before the call (read by reference); sizes/strides/dtype:
  DType dtype = DType::f32;  // its geometry at trace time (set_data may change it: retrace)
};

// An op replayed eagerly: node `slot` of the graph indexes eager_ops; its operands are `inputs`.
struct EagerOp {
  const char* name = "";
  std::function<Tensor(const TensorList&)> run;
  std::vector<int> inputs;  // node ids
};

// The traced function: one DAG whose input nodes' slots index `leaves` and whose eager nodes'
// slots index `eager_ops`.
struct Graph {
  std::vector<ExprNode> nodes;
  std::vector<bool> requires_grad;  // of each node's tensor at trace time
  std::vector<LeafSpec> leaves;
  std::vector<EagerOp> eager_ops;
  std::vector<int> outputs;
  std::string fail;  // the first reason the function cannot be replayed ("" when it can)
};

class Tracer {
 public:
  Tracer(const TensorList& args, bool grad_mode);
  Graph graph;

  int resolve(const Tensor& t);  // node id of a tensor an op reads; -1 once the trace failed
  int bind(const Tensor& t, ExprNode n);
  void fail(const std::string& reason);
  void note_storage(const void* storage, const char* op) { new_storage_[storage] = op; }
  void finish(const TensorList& outputs);

 private:
  int add_leaf(const Tensor& t, LeafSpec leaf);
  TensorList args_;
  bool grad_mode_;
  std::unordered_map<const void*, int> value_;  // TensorImpl* -> node id
  std::vector<Tensor> keep_;
  std::unordered_map<const void*, int> arg_storage_;
  std::unordered_map<const void*, const char*> new_storage_;
  std::unordered_set<const void*> bound_storage_;  // storages of traced values
  std::unordered_set<const void*> shared_storage_;  // storages two inputs share
};

// Sets the thread's tracer while alive.
class TracerScope {
 public:
  explicit TracerScope(Tracer* t) : prev_(t_tracer) { t_tracer = t; }
  ~TracerScope() { t_tracer = prev_; }
  TracerScope(const TracerScope&) = delete;
  TracerScope& operator=(const TracerScope&) = delete;

 private:
  Tracer* prev_;
};

}  // namespace flame::compile_detail
