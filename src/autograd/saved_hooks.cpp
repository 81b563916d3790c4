// Saved-tensor hooks: autograd::SavedTensorHooks (include/flame/saved_tensor_hooks.h).
//
// Note [Saved tensor hooks]
// A SavedTensor made while hooks are active (a thread-local pointer to the innermost hooks, read
// once per saved tensor) calls pack(t) and keeps a PackedSaved: the hooks (shared, so unpack
// works after the scope ended), pack's result, and a weak reference to t's storage with t's shape.
// The tensor itself is not kept, so its memory goes when nothing else holds it: that is what
// activation offload relies on. get() calls unpack and checks the result's shape and dtype.
// Version checks: the SavedTensor keeps the version at save time; at unpack, if the original
// storage is still alive, its version must still be that one (an in-place write after the save
// raises as without hooks). A storage that is gone cannot have been written since.
// Pack and unpack run with grad mode off (their copies are not part of the graph) and with hooks
// disabled (a tensor saved inside a hook is not packed again).
#include <utility>

#include "flame/saved_tensor_hooks.h"
#include "src/autograd/record.h"

namespace flame {

namespace autograd {
struct SavedTensorHooks::Impl : std::enable_shared_from_this<SavedTensorHooks::Impl> {
  PackHook pack;
  UnpackHook unpack;
};

SavedTensorHooks::SavedTensorHooks(PackHook pack, UnpackHook unpack)
    : impl_(std::make_shared<Impl>()), previous_(autograd_detail::t_saved_hooks) {
  FLAME_CHECK(pack && unpack, "autograd::SavedTensorHooks", "needs both a pack and an unpack function");
  impl_->pack = std::move(pack);
  impl_->unpack = std::move(unpack);
  autograd_detail::t_saved_hooks = impl_.get();
}

SavedTensorHooks::~SavedTensorHooks() { autograd_detail::t_saved_hooks = previous_; }
}  // namespace autograd

namespace autograd_detail {

thread_local const void* t_saved_hooks = nullptr;

struct PackedSaved {
  std::shared_ptr<const autograd::SavedTensorHooks::Impl> hooks;
  std::any value;
  std::weak_ptr<Storage> storage;
  Shape sizes;
  DType dtype = DType::f32;
  Device device;
};

namespace {
// Runs a hook with grad mode off and no hooks active; restores both, also on error.
class HookScope {
 public:
  HookScope() : previous_(t_saved_hooks) { t_saved_hooks = nullptr; }
  ~HookScope() { t_saved_hooks = previous_; }
  HookScope(const HookScope&) = delete;
  HookScope& operator=(const HookScope&) = delete;

 private:
  const void* previous_;
  NoGradGuard no_grad_;
};
}  // namespace

std::shared_ptr<PackedSaved> pack_saved(const Tensor& t) {
  const auto* impl = static_cast<const autograd::SavedTensorHooks::Impl*>(t_saved_hooks);
  auto p = std::make_shared<PackedSaved>();
  p->hooks = impl->shared_from_this();
  p->storage = t.impl()->storage;
  p->sizes = t.sizes();
  p->dtype = t.dtype();
  p->device = t.device();
  HookScope scope;
  p->value = impl->pack(t.detach());
  return p;
}

Tensor unpack_saved(const PackedSaved& p, uint64_t version, const char* op) {
  if (const std::shared_ptr<Storage> st = p.storage.lock()) {
    const uint64_t now = st->version.load();
    FLAME_CHECK(now == version, "backward", "a tensor saved for the gradient of ", op, " (shape ", p.sizes,
                ") was modified by an in-place op: its version is ", now, ", expected ", version);
  }
  Tensor t;
  {
    HookScope scope;
    t = p.hooks->unpack(p.value);
  }
  FLAME_CHECK(t.defined() && t.sizes() == p.sizes && t.dtype() == p.dtype && t.device() == p.device,
              "autograd::SavedTensorHooks", "unpack must return the saved tensor's shape ", p.sizes, ", dtype ",
              dtype_name(p.dtype), " and device ", p.device.str(), "; got ",
              t.defined() ? shape_str(t.sizes()) + " " + dtype_name(t.dtype()) + " " + t.device().str()
                          : std::string("an undefined tensor"),
              " (saved for ", op, ")");
  return t;
}

}  // namespace autograd_detail
}  // namespace flame
