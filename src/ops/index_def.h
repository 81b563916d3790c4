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

// Members every indexing definition shares: no autocast, the lead input is x.
struct IndexDefBase {
  static constexpr Autocast autocast = Autocast::none;
  struct Prep {
    Tensor idx;      // the index as the kernel reads it (i64, contiguous)
    int64_t d = 0;   // the wrapped dim
    Shape shape;     // the output's shape (index_select, masked_select's broadcast shape)
  };
  struct Result {
    Tensor out, indices;  // indices: sort's
  };
};

struct IndexSelectDef : IndexDefBase {
  struct Args {
    Tensor x, index;
    int64_t dim = 0;
  };
  using Out = Tensor;
  static const char* name(const Args&) { return "index_select"; }
  static TensorList inputs(const Args& a) { return {a.x, a.index}; }
  static const Tensor& lead(const Args& a) { return a.x; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.x = in[0];
    a.index = in[1];
    return a;
  }
  static bool traceable(const Args&) { return true; }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
  static Out finish(Result&& r, const Args&, const Prep&) { return std::move(r.out); }
};

struct GatherDef : IndexDefBase {
  using Args = IndexSelectDef::Args;
  using Out = Tensor;
  static const char* name(const Args&) { return "gather"; }
  static TensorList inputs(const Args& a) { return {a.x, a.index}; }
  static const Tensor& lead(const Args& a) { return a.x; }
  static Args with_inputs(Args a, const TensorList& in) { return IndexSelectDef::with_inputs(std::move(a), in); }
  static bool traceable(const Args&) { return true; }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
  static Out finish(Result&& r, const Args&, const Prep&) { return std::move(r.out); }
};

struct ScatterDef : IndexDefBase {
  struct Args {
    Tensor x, index, src;
    int64_t dim = 0;
    bool accumulate = false;  // scatter_add
  };
  using Out = Tensor;
  static const char* name(const Args& a) { return a.accumulate ? "scatter_add" : "scatter"; }
  static TensorList inputs(const Args& a) { return {a.x, a.index, a.src}; }
  static const Tensor& lead(const Args& a) { return a.x; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.x = in[0];
    a.index = in[1];
    a.src = in[2];
    return a;
  }
  static bool traceable(const Args&) { return true; }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
  static Out finish(Result&& r, const Args&, const Prep&) { return std::move(r.out); }
};

struct MaskedSelectDef : IndexDefBase {
  struct Args {
    Tensor x, mask;
  };
  using Out = Tensor;
  static const char* name(const Args&) { return "masked_select"; }
  static TensorList inputs(const Args& a) { return {a.x, a.mask}; }
  static const Tensor& lead(const Args& a) { return a.x; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.x = in[0];
    a.mask = in[1];
    return a;
  }
  static bool traceable(const Args&) { return false; }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
  static Out finish(Result&& r, const Args&, const Prep&) { return std::move(r.out); }
};

struct SortDef : IndexDefBase {
  struct Args {
    Tensor x;
    int64_t dim = -1;
    bool descending = false;
  };
  using Out = std::pair<Tensor, Tensor>;
  static const char* name(const Args&) { return "sort"; }
  static TensorList inputs(const Args& a) { return {a.x}; }
  static const Tensor& lead(const Args& a) { return a.x; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.x = in[0];
    return a;
  }
  static bool traceable(const Args&) { return false; }
  static Out from_traced(Tensor) { return {}; }  // never traced
  static Tensor to_traced(const Out& o) { return o.first; }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
  static Out finish(Result&& r, const Args&, const Prep&) { return {std::move(r.out), std::move(r.indices)}; }
};

}  // namespace flame::op_detail
