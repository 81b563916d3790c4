#pragma once
// Note [Invoke]
// An op with an op definition runs through invoke<Def>(args), which applies what every op must do
// in one fixed order, so that an op gets each concern by being defined rather than by remembering
// to call it:
//
//   1. autocast    Def::autocast (Autocast::low or f32) and autocast on for the lead input's
//                  device type: the inputs are cast once (Def::with_inputs over the cast tensors)
//                  and the op runs again with nested ops excluded. Casting comes before the checks,
//                  as PyTorch's autocast runs before the kernel's, so dtype checks see the cast
//                  inputs (an f32 input and a bf16 weight are valid under autocast).
//   2. trace       inside flame::compile's tracer (and when Def::traceable(args)), by the
//                  definition's category (Def::trace_kind): `opaque`, one step that replays
//                  invoke<Def> over its inputs (Note [Tracing]), elementwise regions fusing on both
//                  sides of it; `elementwise`, the op runs and Def::trace(tracer, result, args,
//                  prep) then reports it as a node the fused kernels take in (after dispatch).
//   3. validation  Def::prepare(args) checks the arguments (the op's error text names the op, the
//                  shapes, dtypes and values) and works out the kernel's parameters (Def::Prep).
//   4. profiler    allocations from here to the end of the dispatch belong to Def::name(args) in
//                  the memory profiler (profiler_detail::InvokeScope), layout copies and scratch
//                  included.
//   5. dispatch    Def::run(args, prep) runs the kernel into a Def::Result (its outputs and what
//                  the backward will read; an op that keeps state only for a backward, as max
//                  pooling's indices, asks needs_grad, src/core/grad_state.h).
//   6. record      Def::record(result, args, prep): declared by the definition, defined by the
//                  gradient rules (src/autograd/rules), which record a node when an input needs a
//                  gradient; the op layer includes no autograd header (Note [Layers]).
//   7. recompute   under autograd::RecomputeCheap, a definition with `recomputable = true` marks
//                  its output (Def::recipe_output) with a recipe: the op again over the tensors
//                  its kernel read (Def::recipe_inputs), so a node that saves the output keeps the
//                  recipe instead (Note [Recompute cheap]); an empty recipe_inputs or an
//                  undefined recipe_output marks nothing for that call. The elementwise table ops
//                  are marked by their table rows (Note [Op table]).
//   8. finish      Def::finish(result, args, prep): the public result (e.g. the batch dim of an
//                  unbatched input dropped again, through view ops that have their own gradients).
//
// A definition is a struct with static members (OpDefaults<Args> supplies the usual ones):
//   using Args, Prep, Result, Out;            the call's arguments, the kernel's parameters, the
//                                             kernel's outputs, the public result
//   static constexpr Autocast autocast;      or, when the policy depends on the call,
//   static Autocast autocast_of(const Args&);
//   static constexpr TraceKind trace_kind;    opaque (the default) or elementwise; elementwise also
//   static void trace(Tracer&, const Result&, const Args&, const Prep&);
//   static const char* name(const Args&);     static string (errors, traces, the profiler)
//   static TensorList inputs(const Args&);    the tensor arguments, in order
//   static const Tensor& lead(const Args&);   the input whose device type decides autocast
//   static Args with_inputs(const Args&, const TensorList&);   the same call over other tensors
//   static bool traceable(const Args&);       false: the call runs eagerly even while tracing
//   static Prep prepare(const Args&);
//   static Result run(const Args&, Prep&);
//   static void record(Result&, const Args&, const Prep&);    defined in src/autograd/rules
//   static Out finish(Result&&, const Args&, const Prep&);
//   static constexpr bool recomputable;      optional (absent: false); when true also
//   static TensorList recipe_inputs(const Args&, const Prep&);  static const Tensor& recipe_output(const Result&);
//   static Out from_traced(Tensor);           only when Out is not Tensor: the traced result, and
//   static Tensor to_traced(Out);             the tensor a trace step stands for
// Host cost: no allocation or virtual call of its own; one thread-local test per concern when
// autocast, tracing and the memory profiler are off (HostCost.* hold the op paths to their counts).
#include <type_traits>
#include <utility>

#include "flame/tensor.h"
#include "src/core/profiler_context.h"
#include "src/ops/autocast_hooks.h"
#include "src/ops/recompute_hooks.h"
#include "src/ops/trace_hooks.h"

namespace flame::op_detail {

// What autocast does to an op's floating inputs (Note [Autocast policy] in src/amp/autocast.cpp).
enum class Autocast { none, low, f32 };

// How flame::compile's tracer sees an op (Note [Tracing] in src/compile/trace.cpp).
enum class TraceKind { opaque, elementwise };

// An argument an op's call borrows from its caller (a tensor, a list of tensors, a shape): the
// plain call holds a pointer (no copy on the per-op path: a Tensor copy is two atomic reference
// count updates); a call kept beyond its caller (the replay of a trace step, autocast's second
// call) owns a copy. with_inputs calls keep() or set().
template <class T>
struct Kept {
  const T* borrowed = nullptr;
  T owned{};
  Kept() = default;
  Kept(const T& v) : borrowed(&v) {}  // NOLINT(google-explicit-constructor): the call's argument
  const T& get() const { return borrowed ? *borrowed : owned; }
  void set(const T& v) {
    owned = v;
    borrowed = nullptr;
  }
  void keep() {
    if (borrowed) {
      owned = *borrowed;
      borrowed = nullptr;
    }
  }
};

// A tensor argument held either way (Tensor or Kept<Tensor>), for code shared by definitions of
// both kinds (OpDefaults, the norms' base).
inline const Tensor& arg(const Tensor& t) { return t; }
inline const Tensor& arg(const Kept<Tensor>& t) { return t.get(); }
inline void set_arg(Tensor& t, const Tensor& v) { t = v; }
inline void set_arg(Kept<Tensor>& t, const Tensor& v) { t.set(v); }

// What a definition inherits unless it declares its own (a static member of the definition hides
// the base's): one tensor input `x`, no autocast, traced, and the result's `out` as the public
// result.
template <class A>
struct OpDefaults {
  using Args = A;
  static constexpr Autocast autocast = Autocast::none;
  static constexpr TraceKind trace_kind = TraceKind::opaque;
  static TensorList inputs(const A& a) { return {arg(a.x)}; }
  static const Tensor& lead(const A& a) { return arg(a.x); }
  static A with_inputs(A a, const TensorList& in) {
    set_arg(a.x, in[0]);
    return a;
  }
  static bool traceable(const A&) { return true; }
  template <class R, class P>
  static Tensor finish(R&& r, const A&, const P&) {
    return std::move(r.out);
  }
};

template <class Def>
constexpr bool kAutocastPerCall = requires(const typename Def::Args& a) { Def::autocast_of(a); };

template <class Def>
typename Def::Out invoke(const typename Def::Args& args) {
  using Out = typename Def::Out;
  if constexpr (kAutocastPerCall<Def> || Def::autocast != Autocast::none) {
    Autocast policy;
    if constexpr (kAutocastPerCall<Def>) {
      policy = Def::autocast_of(args);
    } else {
      policy = Def::autocast;
    }
    if (policy != Autocast::none && amp::detail::should_autocast(Def::lead(args))) {
      amp::detail::AutocastOpScope scope;
      const TensorList in = Def::inputs(args);
      TensorList cast;
      cast.reserve(in.size());
      for (const Tensor& t : in) {
        cast.push_back(!t.defined()                     ? t
                       : policy == Autocast::low        ? amp::detail::cast_low(t)
                                                        : amp::detail::cast_f32(t));
      }
      return invoke<Def>(Def::with_inputs(args, cast));
    }
  }
  if constexpr (Def::trace_kind == TraceKind::opaque) {
    if (auto* tr = compile_detail::active_tracer(); tr && Def::traceable(args)) {
      const TensorList in = Def::inputs(args);
      // The replay keeps the call's values, not its tensors (they are the step's inputs).
      const typename Def::Args values = Def::with_inputs(args, TensorList(in.size()));
      Tensor y = compile_detail::trace_eager_op(*tr, Def::name(args), in, [values](const TensorList& replay_in) {
        if constexpr (std::is_same_v<Out, Tensor>) {
          return invoke<Def>(Def::with_inputs(values, replay_in));
        } else {
          return Def::to_traced(invoke<Def>(Def::with_inputs(values, replay_in)));
        }
      });
      if constexpr (std::is_same_v<Out, Tensor>) {
        return y;
      } else {
        return Def::from_traced(std::move(y));
      }
    }
  }
  typename Def::Prep prep = Def::prepare(args);
  typename Def::Result result;
  {
    profiler_detail::InvokeScope attribution(Def::name(args));
    result = Def::run(args, prep);
  }
  if constexpr (Def::trace_kind == TraceKind::elementwise) {
    if (auto* tr = compile_detail::active_tracer()) Def::trace(*tr, result, args, prep);
  }
  Def::record(result, args, prep);
  if constexpr (requires { requires Def::recomputable; }) {
    if (autograd_detail::should_mark_recomputable()) {
      // The recipe is the op again over the tensors its kernel read (the call's values kept).
      const TensorList in = Def::recipe_inputs(args, prep);
      if (in.empty()) return Def::finish(std::move(result), args, prep);
      const typename Def::Args values = Def::with_inputs(args, TensorList(in.size()));
      autograd_detail::mark_recomputable(Def::recipe_output(result), Def::name(args), in,
                                         [values](const TensorList& replay_in) {
                                           return invoke<Def>(Def::with_inputs(values, replay_in));
                                         });
    }
  }
  return Def::finish(std::move(result), args, prep);
}

}  // namespace flame::op_detail
