// Note [Tracing]
// flame::compile traces by running the function eagerly once with a thread-local Tracer set
// (trace while running: the first call's results are the eager results, autograd included). The
// op layer reports to it through src/ops/trace_hooks.h:
//  - the elementwise family (unary, scalar, binary, where, dtype casts) reports each result with
//    the operands its kernel read: these become ExprNodes of the traced graph;
//  - ops that do not fuse but can be replayed (matmul, sum, mean, softmax) report themselves as
//    one eager step (trace_eager_op), run with the tracer off so that their internals stay unseen;
//  - every new storage is reported with the op that asked for it; in-place writes, host reads and
//    device transfers are reported as reasons the trace cannot be replayed.
// A tensor an elementwise op reads is then one of: a traced value; a function input; a view of
// an input (replayed as the same view of the new input); a tensor made before the call (a
// captured constant such as a parameter, read by reference at every replay); or a tensor on a
// storage made during the call that no hook reported: the output of an op the tracer does not
// record, which makes the whole function fall back to eager with that op's name as the reason.
// So an unsupported op can never be silently baked in as a constant. A replay runs only the
// fused regions: any side effect of the function (an in-place write, a print through to_vec) is a
// fallback reason, never skipped silently.
#include "src/compile/trace.h"

#include "src/core/tensor_impl.h"

namespace flame::compile_detail {

thread_local Tracer* t_tracer = nullptr;

Tracer::Tracer(const TensorList& args, bool grad_mode) : args_(args), grad_mode_(grad_mode) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    const Tensor& t = args[i];
    if (!t.defined()) continue;
    // Inputs may share storage (chunks of one tensor): regions read each through its own
    // pointer. Only a view leaf (below) needs a storage's one input, so shared ones get none.
    const void* st = t.impl()->storage.get();
    if (arg_storage_.count(st)) shared_storage_.insert(st);
    else arg_storage_[st] = static_cast<int>(i);
    LeafSpec leaf;
    leaf.kind = LeafSpec::Kind::arg;
    leaf.arg = static_cast<int>(i);
    add_leaf(t, std::move(leaf));
  }
}

void Tracer::fail(const std::string& reason) {
  if (graph.fail.empty()) graph.fail = reason;
}

int Tracer::add_leaf(const Tensor& t, LeafSpec leaf) {
  graph.leaves.push_back(std::move(leaf));
  ExprNode n;
  n.op = ExprOp::input;
  n.slot = static_cast<int>(graph.leaves.size()) - 1;
  n.dtype = t.dtype();
  n.shape = t.sizes();
  return bind(t, std::move(n));
}

int Tracer::bind(const Tensor& t, ExprNode n) {
  graph.nodes.push_back(std::move(n));
  graph.requires_grad.push_back(t.requires_grad());
  const int id = static_cast<int>(graph.nodes.size()) - 1;
  value_[t.impl()] = id;
  bound_storage_.insert(t.impl()->storage.get());
  keep_.push_back(t);  // keeps the TensorImpl address from being reused while tracing
  return id;
}

int Tracer::resolve(const Tensor& t) {
  auto it = value_.find(t.impl());
  if (it != value_.end()) return it->second;
  if (!graph.fail.empty()) return -1;
  const void* st = t.impl()->storage.get();
  if (auto a = arg_storage_.find(st); a != arg_storage_.end()) {
    if (shared_storage_.count(st)) {
      fail("a view (other than the replayed view ops) of inputs that share storage");
      return -1;
    }
    const Tensor& arg = args_[a->second];
    if (grad_mode_ && arg.requires_grad()) {
      fail("a view of input " + std::to_string(a->second) +
           ", which requires grad (views of inputs are replayed without autograd)");
      return -1;
    }
    LeafSpec leaf;
    leaf.kind = LeafSpec::Kind::arg_view;
    leaf.arg = a->second;
    leaf.sizes = t.sizes();
    leaf.strides = t.strides();
    leaf.offset = t.storage_offset() - arg.storage_offset();
    return add_leaf(t, std::move(leaf));
  }
  if (auto s = new_storage_.find(st); s != new_storage_.end()) {
    if (bound_storage_.count(st)) {
      fail(std::string("a view of an intermediate value (made by '") + s->second +
           "') is not traced (views of inputs and constants are)");
      return -1;
    }
    fail(std::string("'") + s->second + "' is not traced (only elementwise ops, where and casts are; " +
         "a tensor it made is used by the function)");
    return -1;
  }
  LeafSpec leaf;
  leaf.kind = LeafSpec::Kind::constant;
  leaf.constant = t;
  leaf.sizes = t.sizes();
  leaf.strides = t.strides();
  leaf.dtype = t.dtype();
  return add_leaf(t, std::move(leaf));
}

void Tracer::finish(const TensorList& outputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].defined()) {
      fail("output " + std::to_string(i) + " is an undefined tensor");
      return;
    }
    const int id = resolve(outputs[i]);
    if (id < 0) return;
    graph.outputs.push_back(id);
  }
}

void trace_unary(Tracer& t, const Tensor& out, backend::UnaryOp op, const Tensor& in, const backend::UnaryParams& p) {
  const int a = t.resolve(in);
  if (a < 0) return;
  ExprNode n;
  n.op = ExprOp::unary;
  n.unary = op;
  n.params = p;
  n.a = a;
  n.dtype = out.dtype();
  n.shape = out.sizes();
  t.bind(out, std::move(n));
}

void trace_binary(Tracer& t, const Tensor& out, backend::BinaryOp op, const Tensor& a, const Tensor& b) {
  const int ia = t.resolve(a), ib = t.resolve(b);
  if (ia < 0 || ib < 0) return;
  ExprNode n;
  n.op = ExprOp::binary;
  n.binary = op;
  n.a = ia;
  n.b = ib;
  n.dtype = out.dtype();
  n.shape = out.sizes();
  t.bind(out, std::move(n));
}

void trace_where(Tracer& t, const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  const int ic = t.resolve(cond), ia = t.resolve(a), ib = t.resolve(b);
  if (ic < 0 || ia < 0 || ib < 0) return;
  ExprNode n;
  n.op = ExprOp::where;
  n.a = ia;
  n.b = ib;
  n.c = ic;
  n.dtype = out.dtype();
  n.shape = out.sizes();
  t.bind(out, std::move(n));
}

void trace_cast(Tracer& t, const Tensor& out, const Tensor& in) {
  const int a = t.resolve(in);
  if (a < 0) return;
  ExprNode n;
  n.op = ExprOp::cast;
  n.a = a;
  n.dtype = out.dtype();
  n.shape = out.sizes();
  t.bind(out, std::move(n));
}

Tensor trace_eager_op(Tracer& t, const char* name, const TensorList& inputs,
                      std::function<Tensor(const TensorList&)> run) {
  Tensor out;
  {
    TracerScope off(nullptr);
    out = run(inputs);
  }
  std::vector<int> ids;  // -1: an undefined (optional) operand
  for (const Tensor& x : inputs) {
    if (!x.defined()) {
      ids.push_back(-1);
      continue;
    }
    const int id = t.resolve(x);
    if (id < 0) return out;
    ids.push_back(id);
  }
  if (!t.graph.fail.empty()) return out;
  t.graph.eager_ops.push_back(EagerOp{name, std::move(run), std::move(ids)});
  ExprNode n;
  n.op = ExprOp::eager;
  n.slot = static_cast<int>(t.graph.eager_ops.size()) - 1;
  n.dtype = out.dtype();
  n.shape = out.sizes();
  t.bind(out, std::move(n));
  return out;
}

void trace_new_storage(Tracer& t, const void* storage, const char* op) { t.note_storage(storage, op); }

void trace_fail(Tracer& t, const std::string& reason) { t.fail(reason); }

}  // namespace flame::compile_detail
