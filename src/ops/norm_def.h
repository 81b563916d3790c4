#pragma once
// Op definitions of the normalisations (Note [Invoke] in src/ops/invoke.h; Note [Norm kernels] in
// src/ops/norm.cpp): layer_norm and rms_norm over rows, group_norm, batch_norm. prepare / run are
// in src/ops/norm.cpp; record, the gradient rules, in src/autograd/rules/norm.cpp. Under autocast
// they run in f32; layer_norm, rms_norm and group_norm outputs are recomputable (Note [Recompute
// cheap]), batch_norm's are not (it writes the running statistics).
#include <cstdint>
#include <optional>

#include "flame/tensor.h"
#include "src/ops/invoke.h"

namespace flame::op_detail {

// The inputs as the kernels read them (contiguous), and the statistics the backward reads.
struct NormPrep {
  Tensor x, weight, bias;
  double eps = 0;  // layer_norm / rms_norm: the eps the kernel uses (rms_norm's default resolved)
};
struct NormResult {
  Tensor y, mean, rstd;  // mean is undefined for rms_norm
};
// What the norms share: inputs x, weight, bias (either may be undefined), f32 under autocast, y
// the result; the recipe of a recomputable output is the norm again over the inputs it read.
template <class A>
struct NormDefBase : OpDefaults<A> {
  using Prep = NormPrep;
  using Result = NormResult;
  using Out = Tensor;
  static constexpr Autocast autocast = Autocast::f32;
  static TensorList inputs(const A& a) { return {arg(a.x), arg(a.weight), arg(a.bias)}; }
  static A with_inputs(A a, const TensorList& in) {
    set_arg(a.x, in[0]);
    set_arg(a.weight, in[1]);
    set_arg(a.bias, in[2]);
    return a;
  }
  static TensorList recipe_inputs(const A&, const Prep& p) { return {p.x, p.weight, p.bias}; }
  static const Tensor& recipe_output(const Result& r) { return r.y; }
  static Out finish(Result&& r, const A&, const Prep&) { return std::move(r.y); }
};

// layer_norm and rms_norm over the last `dims` dims of x (the wrappers check normalized_shape).
struct NormRowsArgs {
  const char* op = "layer_norm";
  Kept<Tensor> x, weight, bias;  // borrowed from the caller; bias: undefined for rms_norm
  int64_t dims = 1;              // how many trailing dims are normalised
  std::optional<double> eps;  // none: torch.finfo(dtype).eps of x as the kernel gets it (rms_norm)
  bool rms = false;
};
struct NormRowsDef : NormDefBase<NormRowsArgs> {
  static constexpr bool recomputable = true;
  static const char* name(const Args& a) { return a.op; }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
};

struct GroupNormArgs {
  Tensor x, weight, bias;
  int64_t groups = 1;
  double eps = 1e-5;
};
struct GroupNormDef : NormDefBase<GroupNormArgs> {
  static constexpr bool recomputable = true;
  static const char* name(const Args&) { return "group_norm"; }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
};

// batch_norm: the running statistics are arguments but not inputs (autocast leaves them alone and
// the op writes them in place), so it is not traced.
struct BatchNormArgs {
  Tensor x, weight, bias, running_mean, running_var;
  bool training = true;
  double momentum = 0.1, eps = 1e-5;
};
struct BatchNormDef : NormDefBase<BatchNormArgs> {
  static const char* name(const Args&) { return "batch_norm"; }
  static bool traceable(const Args&) { return false; }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
};

}  // namespace flame::op_detail
