#pragma once
// Op definitions of the pool family (Note [Invoke] in src/ops/invoke.h): pooling and upsampling over
// an [N, C, H, W] view, and the fused cross-entropy rows. prepare / run / finish are in
// src/ops/pool.cpp and src/ops/cross_entropy.cpp; record, the gradient rules, in
// src/autograd/rules/pool.cpp.
#include <cstdint>
#include <optional>
#include <utility>

#include "flame/nn/pool.h"
#include "flame/tensor.h"
#include "src/backend/backend.h"
#include "src/ops/invoke.h"

namespace flame::op_detail {

// max_pool1d/2d, avg_pool1d/2d, adaptive_{avg,max}_pool1d/2d (1-d runs as 2-d with H = 1; an
// unbatched input gets N = 1). Result: the 4-d output and, for max pools whose input needs a
// gradient or whose caller wants them, the argmax indices.
struct Pool2dArgs {
  const char* op = nullptr;
  int spatial = 2;
  Tensor x;
  backend::PoolMode mode = backend::PoolMode::max;
  bool adaptive = false;
  nn::functional::Size2 k, s, pad, dil{1, 1}, out;
  bool ceil_mode = false, count_include_pad = true, want_indices = false;
  std::optional<int64_t> divisor_override;
};
struct Pool2dDef : OpDefaults<Pool2dArgs> {
  struct Prep {
    Tensor x4;
    backend::Pool2dParams p;
  };
  struct Result {
    Tensor out, indices;
  };
  using Out = std::pair<Tensor, Tensor>;
  static const char* name(const Args& a) { return a.op; }
  static bool traceable(const Args& a) { return !a.want_indices; }
  static Out from_traced(Tensor y) { return {std::move(y), Tensor()}; }
  static Tensor to_traced(const Out& o) { return o.first; }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
  static Out finish(Result&& r, const Args& a, const Prep& p);
};

// interpolate (Note [Interpolate dims] in pool.cpp).
struct Upsample2dArgs {
  Tensor x;
  nn::functional::InterpolateOptions o;
};
struct Upsample2dDef : OpDefaults<Upsample2dArgs> {
  struct Prep {
    Tensor x4;
    backend::Upsample2dParams p;
    bool one_d = false;
  };
  struct Result {
    Tensor out;
  };
  using Out = Tensor;
  static const char* name(const Args&) { return "interpolate"; }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
  static Out finish(Result&& r, const Args& a, const Prep& p);
};

// The per-row losses of logits [N, V] and i64 targets [N] (Note [Fused cross-entropy]).
struct CrossEntropyRowsArgs {
  Tensor logits, target;
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
};
struct CrossEntropyRowsDef : OpDefaults<CrossEntropyRowsArgs> {
  struct Prep {
    Tensor x, t;  // contiguous logits and targets, as the kernel reads them
  };
  struct Result {
    Tensor loss, lse;  // lse: the per-row logsumexp the backward reads
  };
  using Out = Tensor;
  static const char* name(const Args&) { return "cross_entropy"; }
  static TensorList inputs(const Args& a) { return {a.logits, a.target}; }
  static const Tensor& lead(const Args& a) { return a.logits; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.logits = in[0];
    a.target = in[1];
    return a;
  }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
  static Out finish(Result&& r, const Args&, const Prep&) { return std::move(r.loss); }
};

}  // namespace flame::op_detail
