#pragma once
// What op functions use to take part in autograd.
//
// Preferred form (Note [Node saved tensors] in node.h): a rule is a plain function over the node,
// the tensors it reads are saved in the node, small parameters go in RuleArgs:
//
//   TensorList exp_backward(const Tensor& g, const Node& n) { return {g * n.saved(0)}; }
//   ...
//   if (needs_grad({x})) {
//     Node& n = record(y, "ExpBackward", {x}, exp_backward, {});
//     n.save(y, /*is_output=*/true);
//   }
//
// Save only what the formula reads, and only for the inputs that need a gradient. The older form,
// record(out, name, inputs, lambda), takes a std::function; its lambda must capture SavedTensors,
// never plain Tensors (a SavedTensor of the output is detached: no reference cycle through the
// output's node), and what it captures is not seen by autograd_saved_bytes().
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <vector>

#include "flame/autograd.h"
#include "src/autograd/node.h"
#include "src/core/grad_state.h"  // needs_grad, the per-thread autograd state

namespace flame {

namespace autograd_detail {
// Note [Accumulate base] (backward.cpp): whether the engine hands pending sums to the rules that
// accept one. On unless the environment sets FLAME_FUSED_GRAD_ACCUMULATION=0; tests and benchmarks
// switch it to compare the two paths. Returns the previous setting.
bool accumulate_base_enabled();
bool set_accumulate_base_enabled(bool on);
// Pending sums handed to rules so far in the process, and how many of them the pass owned (tests).
struct AccumulateBaseCounts {
  uint64_t handed = 0, owned = 0;
};
AccumulateBaseCounts accumulate_base_counts();
// Note [Prepared gradients] (backward.cpp): gradients handed over by Node::prepare so far in the
// process, and how many of them the receiving rule used (tests).
struct PreparedCounts {
  uint64_t prepared = 0, taken = 0;
};
PreparedCounts prepared_counts();
// Note [Gradient row sums] (node.cpp): a rule whose kernel writes a gradient g [..., N] may also
// compute its sums over every dim but the last (f32 [N], from the values before g's rounding) and
// attach them; the rule that consumes g (a Linear whose output it is: its bias gradient) takes
// them instead of summing g again. Taken only while g is the same memory at the same version
// (a hook that replaced or edited it, or a further contribution summed into it, makes the
// consumer sum as usual); thread-local, as a backward pass runs its rules on one thread.
// Producers: the fused adaLN residual backward (src/ops/adaln.cpp) and the packed-QKV attention
// backward on the short-sequence kernels (src/autograd/rules/attention_packed.cpp).
void attach_row_sums(const Tensor& grad, Tensor sums);
Tensor take_row_sums(const Tensor& grad);
struct RowSumCounts {
  uint64_t attached = 0, taken = 0;
};
RowSumCounts row_sum_counts();  // so far in the process (tests)
}  // namespace autograd_detail

// Attaches a node computing the inputs' gradients to `out` (which becomes a non-leaf) and returns
// it, so that the caller can save the tensors its rule reads. `name` must be a static string.
Node& record(Tensor& out, const char* name, std::initializer_list<std::reference_wrapper<const Tensor>> inputs,
             Node::RuleFn rule, RuleArgs args);
// The same over a list of inputs whose length varies by call (one gradient per entry).
Node& record(Tensor& out, const char* name, const TensorList& inputs, Node::RuleFn rule, RuleArgs args);
// The std::function form; `op` may be a plain op name ("index_select"): the node is named
// "IndexSelectBackward".
Node& record(Tensor& out, const char* op, const TensorList& inputs, Node::BackwardFn fn);
// The grad_fn name of an op ("narrow" -> "NarrowBackward"); a name ending in "Backward" is kept.
// The result lives as long as the process; `op` must be a static string.
const char* backward_name(const char* op);
// The same for a name made at run time (a custom function's): always copied into a process-wide set.
const char* intern_backward_name(const std::string& op);

// Sums `grad` down to `shape` (undoing broadcasting); returns grad itself when the shapes match.
Tensor sum_to(const Tensor& grad, const Shape& shape);
// The same for an edge's shape; no Shape is made when grad already has it.
inline Tensor sum_to(const Tensor& grad, const InlineShape& shape) {
  return shape == grad.sizes() ? grad : sum_to(grad, shape.vec());
}

// Debug accounting: bytes of distinct storages held by saved tensors of the graph behind `root`
// (each storage counted once, however many nodes save it). Declared in flame/autograd.h too.
std::size_t autograd_saved_bytes(const Tensor& root);

}  // namespace flame
