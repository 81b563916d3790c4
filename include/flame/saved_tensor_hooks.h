#pragma once
// Saved-tensor hooks: autograd::SavedTensorHooks, the autograd mechanism activation offload
// (offload::OffloadActivations, flame/offload.h) is built on. Note [Saved tensor hooks] in
// src/autograd/saved_hooks.cpp.
#include <any>
#include <functional>
#include <memory>

#include "flame/tensor.h"

namespace flame::autograd {

// Saved-tensor hooks (like torch.autograd.graph.saved_tensors_hooks): while alive on this
// thread, every tensor an op saves for its backward is handed to `pack`, and only what pack
// returns is kept in the graph; backward calls `unpack` on it to get the tensor back (same shape,
// dtype, device and values; it may be a new tensor). Scoped and nestable: the innermost hooks
// apply. Both run with grad mode off and no hooks active. Not packed: leaves that require grad
// (parameters, alive anyway) and the tensors a checkpoint keeps for their identity. In-place
// checks still apply: a saved tensor written in place after it was saved raises at unpack while
// its original storage is alive. The hooks outlive the scope in the packed tensors they made.
using PackHook = std::function<std::any(const Tensor&)>;
using UnpackHook = std::function<Tensor(const std::any&)>;
class SavedTensorHooks {
 public:
  SavedTensorHooks(PackHook pack, UnpackHook unpack);
  ~SavedTensorHooks();
  SavedTensorHooks(const SavedTensorHooks&) = delete;
  SavedTensorHooks& operator=(const SavedTensorHooks&) = delete;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
  const void* previous_;
};

}  // namespace flame::autograd
