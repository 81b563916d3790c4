#pragma once
// Op definition of matmul and bmm (Note [Invoke] in src/ops/invoke.h). prepare / run are in
// src/ops/linalg.cpp; record, the gradient rule, in src/autograd/rules/linalg.cpp.
#include "flame/tensor.h"
#include "src/ops/invoke.h"

namespace flame::op_detail {

struct MatmulArgs {
  const char* op = "matmul";  // "matmul" (torch.matmul's broadcasting) or "bmm" (3-d operands)
  Tensor a, b;
};
struct MatmulDef : OpDefaults<MatmulArgs> {
  struct Prep {};
  struct Result {
    Tensor out;
  };
  using Out = Tensor;
  static constexpr Autocast autocast = Autocast::low;
  static const char* name(const Args& x) { return x.op; }
  static TensorList inputs(const Args& x) { return {x.a, x.b}; }
  static const Tensor& lead(const Args& x) { return x.a; }
  static Args with_inputs(Args x, const TensorList& in) {
    x.a = in[0];
    x.b = in[1];
    return x;
  }
  static Prep prepare(const Args& x);
  static Result run(const Args& x, Prep& p);
  static void record(Result& r, const Args& x, const Prep& p);
};

}  // namespace flame::op_detail
