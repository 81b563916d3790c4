#pragma once
// Reverse-mode automatic differentiation. See docs/autograd.md.
//
// The graph lives on the tensors: a result of an op whose inputs require gradients holds the op's
// node, and the node holds what its gradient rule needs. There is no global tape or registry, so
// graphs built in different tests or threads never interfere.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flame/grad_mode.h"
#include "flame/random.h"
#include "flame/tensor.h"

namespace flame {

struct AutogradMeta;

// Gradients produced by backward(), keyed by tensor identity (never reused while the store lives).
// Entries are mutable: a trainer may clip, scale or replace them before an optimizer reads them.
//
// The store owns its buffers (docs/autograd.md, "Gradient ownership"): no two entries share
// storage and no entry aliases a tensor the caller holds, so editing one gradient in place never
// moves another or a tensor outside the store. A gradient handed over as an rvalue that nobody
// else holds (no other handle, no other view of its storage) is adopted without a copy; anything
// else is copied. accumulate() adds in place into an entry's buffer while the store is its only
// holder, and into a fresh buffer otherwise (a handle the caller took from get() keeps its values).
// Each buffer is dense in its tensor's layout ("Gradient layout"): a non-overlapping dense tensor
// (channels-last, transposed) gets a gradient with its own strides, any other a contiguous one;
// a gradient in another layout is copied into that layout.
class Gradients {
 public:
  struct Entry {
    Tensor tensor;
    Tensor grad;
  };
  // A read-only range over the entries: iterating it cannot change what the index points at.
  class EntryRange {
   public:
    using const_iterator = std::vector<Entry>::const_iterator;
    const_iterator begin() const { return begin_; }
    const_iterator end() const { return end_; }
    std::size_t size() const { return static_cast<std::size_t>(end_ - begin_); }
    bool empty() const { return begin_ == end_; }
    const Entry& operator[](std::size_t i) const { return begin_[static_cast<std::ptrdiff_t>(i)]; }
    const Entry& front() const { return *begin_; }

   private:
    friend class Gradients;
    EntryRange(const_iterator b, const_iterator e) : begin_(b), end_(e) {}
    const_iterator begin_, end_;
  };

  // The entry's buffer (a handle on it; dense, in t's layout as above). A tensor without a
  // gradient here (it does not require grad, took no part in the backward, or was erased) raises
  // flame::Error naming its shape, dtype and device: test with contains(t), or use get_or_zeros(t)
  // or try_get(t).
  Tensor get(const Tensor& t) const;
  // The entry's buffer, or zeros of t's shape, dtype and device when absent (a fresh tensor, not
  // stored: writing it changes nothing here).
  Tensor get_or_zeros(const Tensor& t) const;
  // The entry's buffer, or an undefined Tensor when absent (for code that skips such tensors).
  Tensor try_get(const Tensor& t) const;
  // Mutable access to an entry's gradient; error when absent. Assigning through it replaces the
  // buffer (the caller then hands that tensor over: prefer set(), which keeps ownership).
  Tensor& at(const Tensor& t);
  bool contains(const Tensor& t) const;
  // Replaces (or inserts) t's gradient; shape and device are checked. Copies `grad` (the caller
  // still holds it); the rvalue form adopts a tensor that nothing else holds. t need not require
  // grad: a leaf that never took part in autograd is given an identity (its requires_grad stays
  // false); only a view that has no autograd state is refused (set its base's gradient instead).
  void set(const Tensor& t, const Tensor& grad);
  void set(const Tensor& t, Tensor&& grad);
  // Adds `grad` to t's gradient (or inserts it, as set() does).
  void accumulate(const Tensor& t, const Tensor& grad);
  void accumulate(const Tensor& t, Tensor&& grad);
  void erase(const Tensor& t);
  void clear();
  std::size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  // (tensor, gradient) pairs in the order gradients first arrived; each gradient is laid out as
  // get() returns it. Edit through at()/set().
  EntryRange entries() const { return EntryRange(entries_.cbegin(), entries_.cend()); }

 private:
  void insert_or_replace(const Tensor& t, Tensor grad, bool adoptable, const char* op);
  void add_into(const Tensor& t, Tensor grad, bool adoptable);
  std::unordered_map<const AutogradMeta*, std::size_t> index_;
  std::vector<Entry> entries_;
};

struct BackwardOptions {
  Tensor grad_output;                    // seed gradient; required when the output is not a scalar
  bool retain_graph = false;             // keep saved tensors for another backward
  Gradients* accumulate_into = nullptr;  // add into this store (micro-batch accumulation)
  // When not empty: gradients only for these tensors (leaves or not, like torch.autograd.grad's
  // inputs); the walk stops at them and does not go on into their history.
  TensorList inputs;
};


// A hook sees the gradient arriving at a tensor during backward; returning a defined tensor
// replaces it (same shape), returning an undefined Tensor keeps it.
using GradHook = std::function<Tensor(const Tensor& grad)>;

// ---- custom ops ----
// A user-defined differentiable op: `forward` runs without recording; `backward` receives the
// gradient of the output and returns one gradient per input (undefined = none).
struct CustomFunction {
  std::string name;
  std::function<Tensor(const TensorList& inputs)> forward;
  std::function<TensorList(const TensorList& inputs, const Tensor& output, const Tensor& grad)> backward;
};
Tensor apply_custom(const CustomFunction& fn, const TensorList& inputs);

// ---- gradient checkpointing ----
// Runs fn without keeping its intermediates; during backward fn is run again (with the random
// generator restored, so dropout masks match) to compute the gradients.
Tensor checkpoint(const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs,
                  Generator* gen = nullptr);

// ---- debugging ----
// Bytes of the distinct storages that the graph behind `root` keeps in saved tensors (what
// backward will read); a storage saved by several nodes counts once.
std::size_t autograd_saved_bytes(const Tensor& root);
// Number of TensorImpls alive in the process (leak checks in tests).
int64_t live_tensor_count();

// ---- gradient tools (on a store; optionally restricted to a parameter list) ----
struct GradStats {
  double global_norm = 0;              // L2 norm over all gradients
  std::vector<double> norms;           // per entry, in entries() order
  double min = 0, max = 0, mean = 0;   // over all elements
  int64_t nan_count = 0, inf_count = 0;
  int64_t numel = 0;
};
GradStats grad_stats(const Gradients& grads);
double global_grad_norm(const Gradients& grads, double norm_type = 2.0);
// Scales all gradients so that their global norm is at most max_norm; returns the norm before.
// clip_grad_norm_ vs clip_grad_norm (below): the same scaling; this one returns the norm as a host
// double (it waits for the device), the other as a 0-d device tensor (no wait, graph-capturable).
// docs/autograd.md, "clip_grad_norm_ and clip_grad_norm", compares them.
double clip_grad_norm_(Gradients& grads, double max_norm, double norm_type = 2.0);
double clip_grad_norm_(Gradients& grads, const TensorList& params, double max_norm, double norm_type = 2.0);
void clip_grad_value_(Gradients& grads, double clip_value);
// Sync-free versions (Note [Device gradient clipping]; docs/graph-step.md): the norm stays on the
// gradients' device as a 0-d tensor (f64 when any gradient is f64, else f32) and nothing waits for
// the GPU, so they can run inside a captured CUDA graph. clip_grad_norm scales every gradient by
// min(1, max_norm / (norm + 1e-6)) on the device with one multi-tensor norm and one multi-tensor
// scale per dtype (torch.nn.utils.clip_grad_norm_(foreach=True, error_if_nonfinite=False): a NaN
// or Inf norm scales the gradients by NaN or 0). norm_type: > 0 or infinity. An empty store gives 0.
Tensor clip_grad_norm(Gradients& grads, double max_norm, double norm_type = 2.0);
Tensor clip_grad_norm(Gradients& grads, const TensorList& params, double max_norm, double norm_type = 2.0);
Tensor grad_norm(const Gradients& grads, double norm_type = 2.0);
// Divides every gradient by the global L2 norm (+ eps).
void normalize_grads_(Gradients& grads, double eps = 1e-6);
// Adds N(0, std^2) noise to every gradient.
void add_grad_noise_(Gradients& grads, double std, Generator* gen = nullptr);

}  // namespace flame
