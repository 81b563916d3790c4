#pragma once
// Reverse-mode automatic differentiation. See docs/autograd.md.
//
// The graph lives on the tensors: a result of an op whose inputs require gradients holds the op's
// node, and the node holds what its gradient rule needs. There is no global tape or registry, so
// graphs built in different tests or threads never interfere.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flame/random.h"
#include "flame/tensor.h"

namespace flame {

struct AutogradMeta;

// Gradients produced by backward(), keyed by tensor identity (never reused while the store lives).
// Entries are mutable: a trainer may clip, scale or replace them before an optimizer reads them.
class Gradients {
 public:
  Tensor get(const Tensor& t) const;  // undefined Tensor when t received no gradient
  Tensor& at(const Tensor& t);        // mutable access; error when absent
  bool contains(const Tensor& t) const;
  void set(const Tensor& t, const Tensor& grad);         // replaces; shape and device are checked
  void accumulate(const Tensor& t, const Tensor& grad);  // adds (or inserts)
  void erase(const Tensor& t);
  void clear();
  std::size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  // (tensor, gradient) pairs in the order gradients first arrived.
  struct Entry {
    Tensor tensor;
    Tensor grad;
  };
  std::vector<Entry>& entries() { return entries_; }
  const std::vector<Entry>& entries() const { return entries_; }

 private:
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

// Disables graph recording on this thread while alive (thread-local, nestable).
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};
// Re-enables recording inside a NoGradGuard region.
class EnableGradGuard {
 public:
  EnableGradGuard();
  ~EnableGradGuard();
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool prev_;
};
bool grad_enabled();

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
double clip_grad_norm_(Gradients& grads, double max_norm, double norm_type = 2.0);
double clip_grad_norm_(Gradients& grads, const TensorList& params, double max_norm, double norm_type = 2.0);
void clip_grad_value_(Gradients& grads, double clip_value);
// Divides every gradient by the global L2 norm (+ eps).
void normalize_grads_(Gradients& grads, double eps = 1e-6);
// Adds N(0, std^2) noise to every gradient.
void add_grad_noise_(Gradients& grads, double std, Generator* gen = nullptr);

}  // namespace flame
