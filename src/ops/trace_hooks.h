#pragma once
// The op layer's seam to the tracer of flame::compile (Note [Tracing] in src/compile/trace.cpp): the
// op layer owns these declarations, src/compile implements them (so no op includes compile).
// Each hook is one thread-local pointer test when no function is being traced. The tracer pointer,
// trace_new_storage and trace_fail are core's (src/core/trace_seam.h).
#include <functional>
#include <string>

#include "flame/tensor.h"
#include "src/core/trace_seam.h"
#include "src/opdef/op_list.h"

namespace flame::compile_detail {

// Elementwise ops report their result and the operands their kernel read (already cast to the
// compute dtype, not yet broadcast).
void trace_unary(Tracer& t, const Tensor& out, backend::UnaryOp op, const Tensor& in, const backend::UnaryParams& p);
void trace_binary(Tracer& t, const Tensor& out, backend::BinaryOp op, const Tensor& a, const Tensor& b);
void trace_where(Tracer& t, const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);
void trace_cast(Tracer& t, const Tensor& out, const Tensor& in);
// An op that does not fuse but replays eagerly (matmul, reductions, softmax) calls this first
// when tracing: it runs `run(inputs)` with the tracer off (the op's internals stay unseen) and
// records one eager step of the plan that calls `run` again at every replay. `run` must capture
// only values (dims, flags), never tensors: the tensors it reads are `inputs`.
Tensor trace_eager_op(Tracer& t, const char* name, const TensorList& inputs,
                      std::function<Tensor(const TensorList&)> run);

}  // namespace flame::compile_detail
