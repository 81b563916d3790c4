#pragma once
// flame::nn::Module: the base of every layer and of every model a user writes.
//
// A user subclasses Module, registers parameters, buffers and children in the constructor, and
// keeps typed handles to them as members:
//
//   struct Block : nn::Module {
//     std::shared_ptr<nn::Linear> fc;
//     Tensor scale;
//     Block() {
//       fc = register_module("fc", std::make_shared<nn::Linear>(64, 64));
//       scale = register_parameter("scale", Tensor::ones({64}));
//     }
//     Tensor forward(const Tensor& x) override { return fc->forward(x) * scale; }
//   };
//
// Names, orders and state-dict keys are PyTorch's (docs/nn.md): parameters() walks a module's own
// parameters in registration order and then its children depth-first, giving dotted names such as
// `blocks.3.attn.qkv.weight`. Tensors are shared handles, so the member and the registry hold the
// same TensorImpl; to(device/dtype) rebinds its data in place (Tensor::set_data), which keeps that
// identity, and load_state_dict copies values into the existing tensors.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "flame/state_dict.h"
#include "flame/tensor.h"

namespace flame::nn {

class Module;
using ModulePtr = std::shared_ptr<Module>;

// What load_state_dict found. A mismatch names the key, what the module holds and what came.
struct LoadReport {
  struct Mismatch {
    std::string name;
    Shape expected_shape;
    DType expected_dtype;
    Shape got_shape;
    DType got_dtype;
  };
  std::vector<std::string> missing_keys;
  std::vector<std::string> unexpected_keys;
  std::vector<Mismatch> mismatched;
  bool ok() const { return missing_keys.empty() && unexpected_keys.empty() && mismatched.empty(); }
  std::string to_string() const;  // one line per problem ("" when ok)
};

class Module : public std::enable_shared_from_this<Module> {
 public:
  Module() = default;
  virtual ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // ---- identity and printing ----
  // The type name shown in summaries and errors ("Linear"); a user module should override it.
  virtual std::string name() const { return "Module"; }
  // The text inside the parentheses of this module's summary line ("in_features=4, ...").
  virtual std::string extra_repr() const { return ""; }
  // PyTorch-style multi-line summary of the tree.
  std::string to_string() const;

  // ---- computation ----
  // The default raises: a module either overrides forward or offers its own methods.
  virtual Tensor forward(const Tensor& x);
  // forward(x). While a memory profiler records or anomaly mode is on, allocations and anomalies
  // inside are attributed to this module's path (docs/profiling.md).
  Tensor operator()(const Tensor& x);
  // The attribution operator() gives, for a forward called directly (one taking several inputs):
  // while a CallScope lives, allocations and anomalies are attributed to `module`'s path.
  //   std::pair<Tensor, Tensor> Block::forward(const Tensor& x, const Tensor& c) {
  //     const CallScope scope(*this);
  //     ...
  class CallScope {
   public:
    explicit CallScope(const Module& module);
    ~CallScope();
    CallScope(const CallScope&) = delete;
    CallScope& operator=(const CallScope&) = delete;

   private:
    void* ctx_ = nullptr;  // the thread's profiler context it pushed onto, or null
  };
  // The dotted name from the root this module was first registered under, e.g. "blocks.3.attn"
  // ("" for a root); follows the first parent of a shared module.
  std::string path() const;

  // ---- registration ----
  // Registers `t` as a parameter: it becomes (stays) a leaf requiring a gradient when floating.
  // Returns the handle (the same TensorImpl) so the caller can keep it as a member. An undefined
  // tensor registers nothing (PyTorch's `bias=None`) and is returned as is.
  Tensor register_parameter(const std::string& name, Tensor t, bool requires_grad = true);
  // Registers a buffer (running statistics, masks): part of to() and, when persistent, of the
  // state dict; never given requires_grad.
  Tensor register_buffer(const std::string& name, Tensor t, bool persistent = true);
  template <class T>
  std::shared_ptr<T> register_module(const std::string& name, std::shared_ptr<T> module) {
    static_assert(std::is_base_of_v<Module, T>, "register_module: T must derive from flame::nn::Module");
    register_module_impl(name, std::static_pointer_cast<Module>(module));
    return module;
  }

  // ---- traversal (registration order; shared tensors and modules listed once) ----
  TensorList parameters(bool recurse = true) const;
  std::vector<std::pair<std::string, Tensor>> named_parameters(bool recurse = true) const;
  TensorList buffers(bool recurse = true) const;
  std::vector<std::pair<std::string, Tensor>> named_buffers(bool recurse = true) const;
  std::vector<ModulePtr> children() const;
  std::vector<std::pair<std::string, ModulePtr>> named_children() const;
  // This module first (name ""), then every descendant depth-first.
  std::vector<ModulePtr> modules();
  std::vector<std::pair<std::string, ModulePtr>> named_modules();
  // The registered parameter, buffer or child of this module (not recursive); error when absent.
  Tensor parameter(const std::string& name) const;
  Tensor buffer(const std::string& name) const;
  ModulePtr child(const std::string& name) const;
  // Dotted path lookup from this module ("blocks.3.attn"); error naming the first missing part.
  ModulePtr submodule(const std::string& path);
  // Calls fn on every descendant and then on this module (PyTorch's Module.apply order), e.g. a
  // custom init: model.apply([](Module& m) { if (auto* l = dynamic_cast<Linear*>(&m)) ... }).
  Module& apply(const std::function<void(Module&)>& fn);

  // ---- modes ----
  // Sets training mode on this module and every descendant.
  Module& train(bool on = true);
  Module& eval() { return train(false); }
  bool is_training() const { return training_; }
  // requires_grad on every parameter of the subtree; frozen parameters get no gradient buffers.
  Module& requires_grad_(bool on = true);
  int64_t num_parameters(bool trainable_only = false) const;

  // ---- conversion (Note [Parameter identity] in src/core/set_data.cpp) ----
  // Moves every parameter and buffer; each keeps its TensorImpl.
  Module& to(Device device);
  // Converts the floating parameters and buffers (integer ones keep their dtype, as PyTorch).
  Module& to(DType dtype);
  Module& to(DType dtype, Device device);

  // ---- state dicts ----
  // Parameters and persistent buffers, keyed by dotted name, in PyTorch's order. The tensors are
  // detached handles on the module's storage (no copy).
  StateDict state_dict() const;
  // Copies values into the existing tensors (any device; identity kept). strict: any missing or
  // unexpected key or any shape/dtype mismatch raises one Error listing all of them and changes
  // nothing. Non-strict: loads every key that matches and reports the rest.
  LoadReport load_state_dict(const StateDict& dict, bool strict = true);

 protected:
  // Called by train(); a container or a layer with mode-dependent state may extend it.
  virtual void on_train(bool /*on*/) {}
  // For containers: the children in registration order.
  const std::vector<std::pair<std::string, ModulePtr>>& child_slots() const { return children_; }

 private:
  struct TensorSlot {
    std::string name;
    Tensor tensor;
    bool persistent = true;
  };
  void register_module_impl(const std::string& name, ModulePtr module);
  void check_new_name(const std::string& name, const char* op) const;
  void collect_named(std::vector<std::pair<std::string, Tensor>>& out, const std::string& prefix, bool params,
                     bool recurse, std::vector<const void*>& seen) const;
  void collect_modules(std::vector<std::pair<std::string, ModulePtr>>& out, const std::string& prefix,
                       std::vector<const Module*>& seen);
  void collect_state(std::vector<std::pair<std::string, Tensor>>& out, const std::string& prefix) const;
  void print(std::ostream& os, int indent) const;
  void convert(std::optional<DType> dtype, std::optional<Device> device);

  std::vector<TensorSlot> params_;
  std::vector<TensorSlot> buffers_;
  std::vector<std::pair<std::string, ModulePtr>> children_;
  bool training_ = true;
  // The first registration of this module as a child (path()); the parent clears parent_ when
  // it goes first.
  std::string registered_name_;
  Module* parent_ = nullptr;
};

std::ostream& operator<<(std::ostream& os, const Module& m);

}  // namespace flame::nn
