#pragma once
// Op definitions of the reduction family (Note [Invoke] in src/ops/invoke.h): the reduction kernel
// call behind sum, mean, prod, amax, amin, argmax, argmin, any and all; softmax and log_softmax;
// cumsum. prepare / run are in src/ops/reduce.cpp; record, the gradient rules, in
// src/autograd/rules/reduce.cpp.
#include <cstdint>

#include "flame/tensor.h"
#include "src/backend/backend.h"
#include "src/ops/invoke.h"

namespace flame::op_detail {

// How a reduction over some dims of x runs: x permuted so that the reduced dims come last.
struct ReducePlan {
  Shape perm;             // kept dims in order, then reduced dims in order
  Shape out_shape;        // the kept dims
  Shape keep_shape;       // the input's shape with each reduced dim set to 1
  int64_t reduce_ndim = 0;
  int64_t count = 1;      // input elements per output element
  int64_t zero_dim = -1;  // a reduced dim of size 0, if any
};

// The reduction kernel over a plan the public op made and checked (its dims, dtype and autocast
// steps are the public op's): internal, so it holds the plan by pointer and is not traced itself.
struct ReduceArgs {
  backend::ReduceOp op = backend::ReduceOp::sum;
  Tensor x;
  const ReducePlan* plan = nullptr;
  DType out_dtype = DType::f32;
  bool keepdim = false;
};
struct ReduceDef : OpDefaults<ReduceArgs> {
  struct Prep {};
  struct Result {
    Tensor out;  // [kept dims]
  };
  using Out = Tensor;
  static const char* name(const Args&) { return "reduce"; }
  static bool traceable(const Args&) { return false; }
  static Prep prepare(const Args&) { return {}; }
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
  static Out finish(Result&& r, const Args& a, const Prep&) {
    return a.keepdim ? r.out.view(a.plan->keep_shape) : std::move(r.out);
  }
};

// softmax and log_softmax along one dim, cumsum along one dim (f32 under autocast; cumsum of
// integers sums in i64).
struct DimArgs {
  const char* op = "softmax";  // softmax, log_softmax or cumsum
  Tensor x;
  int64_t dim = -1;
};
struct DimPrep {
  int64_t dim = 0;  // wrapped
};
struct DimResult {
  Tensor out;
};

struct SoftmaxDef : OpDefaults<DimArgs> {
  using Prep = DimPrep;
  using Result = DimResult;
  using Out = Tensor;
  static constexpr Autocast autocast = Autocast::f32;
  static const char* name(const Args& a) { return a.op; }
  static bool log(const Args& a) { return a.op[0] == 'l'; }  // log_softmax
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
};

struct CumsumDef : OpDefaults<DimArgs> {
  using Prep = DimPrep;
  using Result = DimResult;
  using Out = Tensor;
  static constexpr Autocast autocast = Autocast::f32;
  static const char* name(const Args&) { return "cumsum"; }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
};

}  // namespace flame::op_detail
