#pragma once
// Op definition of the RMS QK-norm fused with the join and the rotary embedding (Note [RMS norm
// rotary] in src/ops/rms_norm_rotary.cpp; Note [Invoke] in src/ops/invoke.h). prepare / run are in
// src/ops/rms_norm_rotary.cpp; record, the gradient rule, in src/autograd/rules/rms_norm_rotary.cpp.
#include <cstdint>

#include "flame/nn/rotary.h"
#include "flame/tensor.h"
#include "src/ops/invoke.h"

namespace flame::op_detail {

struct RmsNormRotaryArgs {
  TensorList parts;    // P tensors [B, S_p, H, D]
  TensorList weights;  // P entries, each undefined or [D]
  Tensor cos, sin;     // [S, D] or both undefined (no rotation)
  double eps = 1e-6;
  nn::functional::RotaryLayout layout = nn::functional::RotaryLayout::interleaved;
};
struct RmsNormRotaryDef : OpDefaults<RmsNormRotaryArgs> {
  struct Prep {
    bool composite = false;  // a weight or a table needs a gradient: ordinary ops, differentiated as written
    TensorList parts, weights;  // as the kernel reads them (contiguous)
    Tensor cos, sin;            // [S, D] contiguous in f32 (f64 for f64 parts), or undefined
  };
  struct Result {
    Tensor out;          // [B, H, S, D] over [B, S, H, D] memory
    bool fused = false;  // the kernel ran (false: the composite did, and recorded its own graph)
  };
  using Out = Tensor;
  static const char* name(const Args&) { return "rms_norm_rotary"; }
  static const Tensor& lead(const Args& a) { return a.parts.front(); }
  static TensorList inputs(const Args& a) {
    TensorList in = a.parts;
    in.insert(in.end(), a.weights.begin(), a.weights.end());
    in.push_back(a.cos);
    in.push_back(a.sin);
    return in;
  }
  static Args with_inputs(Args a, const TensorList& in) {
    const std::size_t n = a.parts.size();
    a.parts.assign(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(n));
    a.weights.assign(in.begin() + static_cast<std::ptrdiff_t>(n), in.begin() + static_cast<std::ptrdiff_t>(2 * n));
    a.cos = in[2 * n];
    a.sin = in[2 * n + 1];
    return a;
  }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
  // Recomputable (Note [Recompute cheap]): attention saves the output; the recipe is the kernel
  // again over the parts, which the op's own node saves anyway. The composite marks nothing here
  // (its own ops mark theirs).
  static constexpr bool recomputable = true;
  static TensorList recipe_inputs(const Args& a, const Prep& p) {
    if (p.composite) return {};
    Args kept = a;
    kept.parts = p.parts;
    kept.weights = p.weights;
    kept.cos = p.cos;  // the tables as the node saves them (f64 copies for f64 parts)
    kept.sin = p.sin;
    return inputs(kept);
  }
  static const Tensor& recipe_output(const Result& r) {
    static const Tensor none;
    return r.fused ? r.out : none;
  }
};

}  // namespace flame::op_detail
