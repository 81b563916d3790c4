#pragma once
// Op definitions of the indexing family (Note [Invoke] in src/ops/invoke.h): index_select, gather,
// scatter / scatter_add, masked_select and sort. prepare / run are in src/ops/index.cpp; record,
// the gradient rules, in src/autograd/rules/index.cpp. masked_select (its output's size depends
// on the mask's values) and sort (two outputs) are not traced.
#include <cstdint>
#include <utility>

#include "flame/tensor.h"
#include "src/ops/invoke.h"

namespace flame::op_detail {

// What the indexing definitions share: the index as the kernel reads it and the results.
struct IndexPrep {
  Tensor idx;     // the index as the kernel reads it (i64, contiguous)
  int64_t d = 0;  // the wrapped dim
  Shape shape;    // the output's shape (index_select), the broadcast shape (masked_select)
};
struct IndexResult {
  Tensor out, indices;  // indices: sort's
};
template <class A>
struct IndexDefBase : OpDefaults<A> {
  using Prep = IndexPrep;
  using Result = IndexResult;
  using Out = Tensor;
};

// x with an index along dim (index_select, gather).
// The tensors are borrowed from the caller (op_detail::Kept: no reference-count traffic per call).
struct IndexArgs {
  Kept<Tensor> x, index;
  int64_t dim = 0;
};
template <class A>
struct IndexedDefBase : IndexDefBase<A> {
  static TensorList inputs(const A& a) { return {a.x.get(), a.index.get()}; }
  static A with_inputs(A a, const TensorList& in) {
    a.x.set(in[0]);
    a.index.set(in[1]);
    return a;
  }
};

struct IndexSelectDef : IndexedDefBase<IndexArgs> {
  static const char* name(const Args&) { return "index_select"; }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
};

struct GatherDef : IndexedDefBase<IndexArgs> {
  static const char* name(const Args&) { return "gather"; }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
};

struct ScatterArgs {
  Tensor x, index, src;
  int64_t dim = 0;
  bool accumulate = false;  // scatter_add
};
struct ScatterDef : IndexDefBase<ScatterArgs> {
  static const char* name(const Args& a) { return a.accumulate ? "scatter_add" : "scatter"; }
  static TensorList inputs(const Args& a) { return {a.x, a.index, a.src}; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.x = in[0];
    a.index = in[1];
    a.src = in[2];
    return a;
  }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
};

struct MaskedSelectArgs {
  Tensor x, mask;
};
struct MaskedSelectDef : IndexDefBase<MaskedSelectArgs> {
  static const char* name(const Args&) { return "masked_select"; }
  static TensorList inputs(const Args& a) { return {a.x, a.mask}; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.x = in[0];
    a.mask = in[1];
    return a;
  }
  static bool traceable(const Args&) { return false; }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
};

struct SortArgs {
  Tensor x;
  int64_t dim = -1;
  bool descending = false;
};
struct SortDef : IndexDefBase<SortArgs> {
  using Out = std::pair<Tensor, Tensor>;
  static const char* name(const Args&) { return "sort"; }
  static bool traceable(const Args&) { return false; }
  static Out from_traced(Tensor) { return {}; }  // never traced
  static Tensor to_traced(const Out& o) { return o.first; }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
  static Out finish(Result&& r, const Args&, const Prep&) { return {std::move(r.out), std::move(r.indices)}; }
};

}  // namespace flame::op_detail
