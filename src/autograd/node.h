#pragma once
// Graph nodes. Internal to the library; ops record nodes through src/autograd/record.h.
//
// Note [Node saved tensors]
// A node keeps the tensors its rule reads in saved_ (SavedTensor: the data plus its version at
// save time), never hidden in a lambda, so that autograd_saved_bytes() can report what a graph
// holds and release() frees it all. Rules are either a plain function pointer over the node
// (RuleFn: saved tensors and small parameters in the node, no allocation beyond the node) or, for
// one-line view rules and user code, a std::function (BackwardFn) that captures no tensors.
//
// Note [Node storage]
// Recording is on the per-op host path, so a node keeps what it owns inline: its edges and saved
// tensors in SmallVecs (two of each inline, a heap vector only beyond), and each edge's input shape
// in an InlineShape (up to six dims inline). A recorded binary op then costs two heap objects
// besides its output tensor: the node and the output's AutogradMeta. InlineShape converts to
// Shape wherever a rule wants one (`const Shape& s = n.edges()[0].shape;` keeps working).
//
// Note [Graph release]
// A graph is a chain of shared_ptrs (tensor -> meta -> node -> edge meta -> node ...). Freeing
// it by plain destructor recursion takes one stack frame per op and overflows on long chains, so
// ~Node unlinks the chain iteratively: whatever it is the last owner of is moved onto a local
// stack and taken apart there. Shared parts (another graph or tensor still holds them) are left
// to their other owner, whose destructor does the same; use_count() == 1 means no other thread
// can reach the object, so this is race-free.
#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "flame/autograd.h"
#include "src/core/tensor_impl.h"

namespace flame {

class Node;

// A vector of at most N elements inline, on the heap beyond (Note [Node storage]). Only what the
// node needs: append, index, iterate, clear.
template <class T, std::size_t N>
class SmallVec {
 public:
  T& emplace_back() {
    if (heap_.empty() && size_ < N) return inline_[size_++];
    if (heap_.empty()) {  // spill the inline elements first, keeping their order
      heap_.reserve(2 * N);
      for (std::size_t i = 0; i < size_; ++i) heap_.push_back(std::move(inline_[i]));
      for (std::size_t i = 0; i < size_; ++i) inline_[i] = T();
    }
    ++size_;
    return heap_.emplace_back();
  }
  void reserve(std::size_t n) {
    if (n > N) heap_.reserve(n);  // the spill keeps this capacity
  }
  void clear() {
    for (std::size_t i = 0; i < std::min(size_, N); ++i) inline_[i] = T();
    heap_ = std::vector<T>();
    size_ = 0;
  }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T* data() { return heap_.empty() ? inline_.data() : heap_.data(); }
  const T* data() const { return heap_.empty() ? inline_.data() : heap_.data(); }
  T& operator[](std::size_t i) { return data()[i]; }
  const T& operator[](std::size_t i) const { return data()[i]; }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }
  T& back() { return data()[size_ - 1]; }

 private:
  std::array<T, N> inline_{};
  std::vector<T> heap_;  // in use (holding every element) once more than N were added
  std::size_t size_ = 0;
};

// A shape with up to kInline dims stored inline (Note [Node storage]); converts to Shape.
class InlineShape {
 public:
  static constexpr std::size_t kInline = 6;
  InlineShape() = default;
  InlineShape(const Shape& s) { assign(s); }  // NOLINT: implicit, as a Shape
  InlineShape& operator=(const Shape& s) {
    assign(s);
    return *this;
  }
  operator Shape() const { return Shape(begin(), end()); }  // NOLINT: implicit, used as a Shape
  Shape vec() const { return Shape(begin(), end()); }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const int64_t* data() const { return size_ <= kInline ? dims_ : heap_.data(); }
  const int64_t* begin() const { return data(); }
  const int64_t* end() const { return data() + size_; }
  int64_t operator[](std::size_t i) const { return data()[i]; }
  int64_t at(std::size_t i) const {
    if (i >= size_) throw std::out_of_range("InlineShape::at");
    return data()[i];
  }
  int64_t front() const { return data()[0]; }
  int64_t back() const { return data()[size_ - 1]; }
  friend bool operator==(const InlineShape& a, const Shape& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend bool operator==(const InlineShape& a, const InlineShape& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend std::ostream& operator<<(std::ostream& os, const InlineShape& s) { return os << shape_str(s.vec()); }

 private:
  void assign(const Shape& s) {
    size_ = s.size();
    if (size_ <= kInline) {
      std::copy(s.begin(), s.end(), dims_);
      heap_.clear();
    } else {
      heap_ = s;
    }
  }
  int64_t dims_[kInline] = {};
  std::size_t size_ = 0;
  Shape heap_;  // used only beyond kInline dims
};

namespace amp::detail {
struct LowCopy;  // src/amp/autocast.h: Note [Kept low-precision copies]
}

// Per-tensor autograd state. Leaves (grad_fn == null) that require grad receive entries in the
// Gradients store; non-leaves pass their gradient on to grad_fn.
struct AutogradMeta {
  bool requires_grad = false;
  std::shared_ptr<Node> grad_fn;
  std::vector<GradHook> hooks;
  std::vector<std::function<void(const Tensor&)>> post_accumulate_hooks;  // leaves only
  std::shared_ptr<amp::detail::LowCopy> low_copy;  // an f32 master weight's kept bf16/f16 copy
};

// A tensor a rule reads during backward, with the storage version at save time. Held detached by
// default (a handle outside any graph: no reference cycle through the output's node); Node::save
// holds inputs as they are (their history cannot lead back to the node) and only the node's own
// output detached.
namespace autograd_detail {
struct PackedSaved;  // saved_hooks.cpp: a tensor packed by autograd::SavedTensorHooks
struct RecomputedSaved;  // recompute.cpp: a tensor kept as the recipe that makes it
}

// Note [Saved tensor hooks] (src/autograd/saved_hooks.cpp): while autograd::SavedTensorHooks are
// active on the thread, a new SavedTensor hands its tensor to the pack hook and keeps only what it
// returned (packed_), unless `allow_hooks` is false (a tensor kept for its identity) or the tensor
// is a leaf that requires grad (a parameter: alive anyway). get() then unpacks it; the version
// check still applies while the original storage is alive.
class SavedTensor {
 public:
  SavedTensor() = default;
  explicit SavedTensor(const Tensor& t, const char* op = "", bool detach = true, bool allow_hooks = true);
  Tensor get() const;  // raises if the storage was written in place since it was saved
  // Holds a tensor here (false when empty or packed by hooks: no bytes held on its device).
  bool defined() const { return tensor_.defined(); }
  const Tensor& raw() const { return tensor_; }  // no version check (for accounting); empty when packed
  bool packed() const { return packed_ != nullptr; }
  // Kept as a recipe (Note [Recompute cheap] in src/autograd/recompute.cpp): get() reruns it.
  bool recomputed() const { return recomputed_ != nullptr; }
  // What a recomputed tensor's recipe holds (its inputs; empty otherwise), for accounting.
  TensorList recipe_inputs() const;
  uint64_t saved_version() const { return version_; }  // the storage version at save time

 private:
  Tensor tensor_;
  uint64_t version_ = 0;
  const char* op_ = "";
  std::shared_ptr<autograd_detail::PackedSaved> packed_;
  std::shared_ptr<const autograd_detail::RecomputedSaved> recomputed_;
};

namespace autograd_detail {
// Note [Saved tensor hooks] (saved_hooks.cpp).
extern thread_local const void* t_saved_hooks;  // the innermost active hooks, or null
inline bool saved_hooks_active() { return t_saved_hooks != nullptr; }
std::shared_ptr<PackedSaved> pack_saved(const Tensor& t);
Tensor unpack_saved(const PackedSaved& p, uint64_t version, const char* op);
}  // namespace autograd_detail

// Small parameters of a RuleFn (which operation, which inputs need a gradient, scalars).
struct RuleArgs {
  int op = 0;
  bool need[2] = {false, false};
  double a = 0, b = 0, c = 0;
  int64_t dim = 0;
  int64_t count = 0;
  Shape shape;  // a shape the rule needs besides the inputs' (e.g. keep_shape of a reduction)
};

// A recorded op: one output, one gradient per input.
class Node {
 public:
  struct Edge {
    std::shared_ptr<AutogradMeta> meta;  // null: this input needs no gradient
    Tensor leaf;                         // the input itself when it is a leaf (the store's key)
    InlineShape shape;
    DType dtype = DType::f32;
    Device device;
    mutable int32_t slot = -1;  // engine scratch: the leaf's slot in the running backward
  };
  using BackwardFn = std::function<TensorList(const Tensor& grad)>;
  using RuleFn = TensorList (*)(const Tensor& grad, const Node& node);

  Node(const char* name, const TensorList& inputs, BackwardFn fn);
  Node(const char* name, std::initializer_list<std::reference_wrapper<const Tensor>> inputs, RuleFn rule,
       RuleArgs args);
  Node(const char* name, const TensorList& inputs, RuleFn rule, RuleArgs args);
  ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // When the node was recorded (increasing, process-wide): the backward runs the ready node
  // recorded last first (Note [Backward order] in backward.cpp).
  const uint64_t seq;

  const char* name() const { return name_; }
  std::span<const Edge> edges() const { return {edges_.data(), edges_.size()}; }
  bool released() const { return released_; }
  TensorList apply(const Tensor& grad);
  void release();  // drops saved tensors (after a backward without retain_graph)

  // Saved tensors (Note [Node saved tensors]); save() returns the slot.
  std::size_t save(const Tensor& t, bool is_output = false);
  Tensor saved(std::size_t i) const { return saved_[i].get(); }
  std::span<const SavedTensor> saved_tensors() const { return {saved_.data(), saved_.size()}; }
  const RuleArgs& args() const { return args_; }

  // Note [Accumulate base] (backward.cpp). At record time: the rule accepts, for input i (< 8), the
  // gradient sum already pending on that input's vertex and then returns base + its own gradient.
  void accept_accumulate_base(std::size_t i) { accept_base_ |= static_cast<uint8_t>(1u << i); }
  bool accepts_accumulate_base() const { return accept_base_ != 0; }
  bool accepts_accumulate_base(std::size_t i) const { return i < 8 && (accept_base_ >> i & 1u) != 0; }
  // In the rule: the pending sum the engine handed for input i (undefined when none; then the rule
  // returns its own gradient alone), and whether the pass owns it (the rule may write into it).
  const Tensor& accumulate_base(std::size_t i) const {
    static const Tensor none;
    return scratch.base_input == static_cast<int32_t>(i) ? scratch.base : none;
  }
  bool accumulate_base_owned() const { return scratch.base_owned; }

  // State of the backward pass walking this node (Note [Backward order] in backward.cpp). A
  // graph's non-leaf part is walked by one backward at a time; threads share only leaves.
  struct Scratch {
    uint64_t run = 0;               // id of the backward that last discovered the node
    int32_t deps = 0;               // contributions still to arrive
    bool owned = false;             // pending is a buffer this backward made (may add in place)
    Tensor pending;                 // sum of the contributions so far
    AutogradMeta* meta = nullptr;   // the vertex (its hooks run on the summed gradient)
    // Note [Accumulate base]: set only while the rule runs.
    Tensor base;                    // an input's pending sum handed to the rule
    int32_t base_input = -1;        // which input it belongs to
    bool base_owned = false;        // the pass owns it (the rule may write into it)
    // Note [Prepared gradients]: this node's gradients, computed ahead by another rule of this
    // pass for the gradient tensor prepared_for at version prepared_version.
    mutable TensorList prepared;
    mutable Tensor prepared_for;
    mutable uint64_t prepared_version = 0;
  };
  Scratch scratch;

  // In the rule: whether this node's gradient for input i is the last contribution that input's
  // vertex awaits in the running backward and nothing is pending there (a non-leaf input that is
  // not a stop of the pass; a pending sum must have been handed to this rule as its base).
  bool completes_input(std::size_t i) const;
  // Note [Prepared gradients] (backward.cpp): a rule that computed another node's gradients along
  // with its own (a fused kernel) hands them over with prepare(), naming the tensor it returns for
  // that node's vertex; that node's rule asks take_prepared(grad), which returns them only when
  // grad is still that tensor, unwritten since (no hook replaced or edited it, nothing else was
  // added), and an empty list otherwise (the rule then computes as usual).
  void prepare(TensorList grads, const Tensor& for_grad) const;
  TensorList take_prepared(const Tensor& grad) const;
  RuleFn rule() const { return rule_; }

  // Where the node came from, filled at record time only while anomaly mode or a memory profiler
  // is on (Note [Anomaly mode] in anomaly.cpp): the forward op's index since anomaly mode began
  // (0: recorded outside it) and the module path it ran in (interned; null when none).
  uint64_t anomaly_seq = 0;
  const char* module_path = nullptr;

 private:
  void add_edge(const Tensor& t);

  const char* name_;  // static or interned (backward_name): the grad_fn name ("MulBackward")
  SmallVec<Edge, 2> edges_;         // Note [Node storage]
  SmallVec<SavedTensor, 2> saved_;
  BackwardFn fn_;
  RuleFn rule_ = nullptr;
  RuleArgs args_;
  bool released_ = false;
  uint8_t accept_base_ = 0;  // Note [Accumulate base]: inputs whose rule takes a pending sum
};

}  // namespace flame
