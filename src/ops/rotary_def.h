#pragma once
// Op definition of the fused rotary embedding (Note [Rotary embedding] in src/ops/rotary.cpp; Note
// [Invoke] in src/ops/invoke.h). prepare / run / finish are in src/ops/rotary.cpp; record, the
// gradient rule, in src/autograd/rules/rotary.cpp.
#include <cstdint>

#include "flame/nn/rotary.h"
#include "flame/tensor.h"
#include "src/ops/invoke.h"

namespace flame::op_detail {

struct RotaryArgs {
  Tensor x, cos, sin;
  nn::functional::RotaryLayout layout = nn::functional::RotaryLayout::interleaved;
};
struct RotaryDef : OpDefaults<RotaryArgs> {
  struct Prep {
    DType compute = DType::f32;  // f32, or f64 for f64 x
    bool composite = false;      // cos or sin need a gradient: ordinary ops, differentiated as written
    Tensor cos, sin;             // [S, D] contiguous in the compute dtype, as the kernel reads them
    Tensor x;                    // x as the kernel reads it (contiguous, or the heads-inner view)
    int64_t heads = 1;           // > 1: x is [B, H, S, D] over [B, S, H, D] memory
  };
  struct Result {
    Tensor out;
    bool fused = false;  // the kernel ran (false: the composite did, and recorded its own graph)
  };
  using Out = Tensor;
  static const char* name(const Args&) { return "rotary_embedding"; }
  static TensorList inputs(const Args& a) { return {a.x, a.cos, a.sin}; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.x = in[0];
    a.cos = in[1];
    a.sin = in[2];
    return a;
  }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
  // Recomputable (Note [Recompute cheap]): attention saves q and k, which are rotary outputs; the
  // recipe is the kernel again over x, cos and sin. The backward saves cos and sin anyway but not
  // x, so it marks only where x is (mostly) marked outputs to fold: q or k after their norm, or a
  // join of them. The composite path marks nothing (its own ops record their graph).
  static constexpr bool recomputable = true;
  static TensorList recipe_inputs(const Args&, const Prep& p) {
    if (p.composite || !autograd_detail::worth_a_recipe({p.x})) return {};
    return {p.x, p.cos, p.sin};
  }
  static const Tensor& recipe_output(const Result& r) {
    static const Tensor none;
    return r.fused ? r.out : none;
  }
};

}  // namespace flame::op_detail
