// Autograd for in-place writes: copy_, fill_, the arithmetic in-place ops and clamp_.
//
// Note [In-place recording]
// An in-place op whose destination or source takes part in autograd is recorded with PyTorch's
// semantics, so that no gradient is lost silently:
// - A destination that owns its geometry (not a view) takes a new history: the op is computed
//   out of place from the destination's old value and history (inplace_current), then its values
//   are written into the destination, whose AutogradMeta is replaced by a pass-through node
//   named after the op ("add_", "copy_", ...) over the out-of-place result. `h += a` with `a`
//   requiring grad makes `h` a non-leaf; `y = x * 2; y.add_(1)` keeps `y` in the graph.
// - A destination that is a view of a base (Note [View base]) changes the base: the base takes a
//   "copy_slices" node whose inputs are the base's old history and the new view value; its rule
//   gives the base's old history the gradient with the view's region zeroed, and the new value
//   the gradient of that region. The view takes a fresh "as_strided" history over the base's new
//   one. Other views of the same base, created before the write, notice that their base moved on
//   (base_meta_seen) and regenerate their history from the base the next time an op reads them
//   (refresh_view_history), as PyTorch does. Regeneration writes the view's TensorImpl, so one
//   stale view must not be first read from two threads at once; views made after the write, and
//   views of bases never written in place, are never regenerated.
// - The old value is cloned before an out-of-place op whose rule may read it (its storage is
//   about to be overwritten); add_/sub_ with a tensor skip the clone, their rules read no operand.
//   The clone only happens while recording.
// - PyTorch's errors are kept: a leaf that requires grad (or a view of one) cannot be written in
//   place while grad mode is on; a tensor saved for backward and later overwritten makes backward
//   raise (SavedTensor's version check). Under NoGradGuard nothing is recorded (optimizer steps).
#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/ops/grad_hooks.h"
#include "src/core/tensor_impl.h"

namespace flame::rules {
namespace {

struct Geometry {
  Shape sizes, strides;
  int64_t offset = 0;
};

Geometry geometry_of(const TensorImpl& t) { return {t.sizes, t.strides, t.offset}; }

// A handle on t's storage with geometry g and the given autograd state: nobody's view.
Tensor handle_on(const TensorImpl& t, const Geometry& g, std::shared_ptr<AutogradMeta> meta) {
  auto impl = std::make_shared<TensorImpl>(t.storage, g.sizes, g.strides, g.offset, t.dtype);
  impl->autograd = std::move(meta);
  return Tensor(std::move(impl));
}

// [lo, hi] storage offsets a geometry reaches (strides may be of either sign).
std::pair<int64_t, int64_t> extent(const Geometry& g) {
  int64_t lo = g.offset, hi = g.offset;
  for (std::size_t d = 0; d < g.sizes.size(); ++d) {
    if (g.sizes[d] == 0) return {g.offset, g.offset};
    const int64_t reach = g.strides[d] * (g.sizes[d] - 1);
    (reach < 0 ? lo : hi) += reach;
  }
  return {lo, hi};
}

// Zeroed scratch storage covering the base, with views of the base's and the region's geometry
// (offsets shifted so the scratch starts at the base's lowest element).
struct Scratch {
  Tensor base_view, region;
  Tensor flat;
  int64_t lo = 0;
};
Scratch make_scratch(const Geometry& base, const Geometry& view, DType dtype, Device device) {
  const auto [lo, hi] = extent(base);
  Tensor buf = Tensor::zeros({hi - lo + 1}, {dtype, device});
  return {make_view(buf, base.sizes, base.strides, base.offset - lo),
          make_view(buf, view.sizes, view.strides, view.offset - lo), buf, lo};
}

// Adds g into the scratch positions the region addresses. A region whose elements overlap (an
// expanded view) sums the gradients of the elements sharing a position.
void add_into_region(Scratch& s, const Geometry& view, const Tensor& g) {
  if (!has_internal_overlap(view.sizes, view.strides)) {
    s.region.copy_(g);
    return;
  }
  Tensor offsets = Tensor::scalar(view.offset - s.lo, s.flat.device());
  for (std::size_t d = 0; d < view.sizes.size(); ++d) {
    Shape at(view.sizes.size(), 1);
    at[d] = view.sizes[d];
    offsets = offsets + (Tensor::arange(view.sizes[d], s.flat.device()) * view.strides[d]).reshape(at);
  }
  s.flat.copy_(scatter_add(s.flat, 0, offsets.expand(view.sizes).reshape({-1}), g.reshape({-1})));
}

// A differentiable view with geometry `view` of `base` (a handle on a base's history).
Tensor as_strided_of(const Tensor& base, const Geometry& view) {
  Tensor v = handle_on(*base.impl(), view, nullptr);
  if (!base.requires_grad()) return v;
  const Geometry bg = geometry_of(*base.impl());
  record(v, "as_strided", {base}, [bg, view](const Tensor& g) {
    Scratch s = make_scratch(bg, view, g.dtype(), g.device());
    add_into_region(s, view, g);
    return TensorList{s.base_view.contiguous()};
  });
  return v;
}

// Gives `view` (a view of `base`) a history over the base's present one.
void attach_view_history(TensorImpl& view, TensorImpl& base) {
  view.base_history_seen = base.history_version;
  if (!base.autograd || !base.autograd->requires_grad) {
    view.autograd.reset();
    return;
  }
  Tensor fresh = as_strided_of(handle_on(base, geometry_of(base), base.autograd), geometry_of(view));
  view.autograd = fresh.impl()->autograd;
}

}  // namespace

void regenerate_view_history(const Tensor& t) {
  TensorImpl* impl = t.impl();
  if (impl->base) attach_view_history(*impl, *impl->base);
}

bool inplace_records(const Tensor& self, std::initializer_list<std::reference_wrapper<const Tensor>> sources,
                     const char* op) {
  if (!grad_enabled()) return false;
  refresh_view_history(self);
  const TensorImpl* base = self.impl()->base.get();
  FLAME_CHECK(!(self.is_leaf() && self.requires_grad()), op,
              "a leaf Variable that requires grad is being used in an in-place operation (shape ", self.sizes(),
              "); write it under NoGradGuard, or use the out-of-place op");
  const bool base_grad = base && base->autograd && base->autograd->requires_grad;
  FLAME_CHECK(!(base_grad && !base->autograd->grad_fn), op,
              "a view of a leaf Variable that requires grad is being used in an in-place operation (view of "
              "shape ", self.sizes(), " of a leaf of shape ", base->sizes, "); write it under NoGradGuard");
  if (!is_floating(self.dtype())) return false;  // integer destinations never carry gradients
  bool any = self.requires_grad() || base_grad;
  for (const Tensor& s : sources) any = any || (s.defined() && s.requires_grad());
  return any;
}

Tensor inplace_current(const Tensor& self) {
  refresh_view_history(self);
  const TensorImpl& impl = *self.impl();
  if (!impl.base) return handle_on(impl, geometry_of(impl), impl.autograd);
  const TensorImpl& base = *impl.base;
  return as_strided_of(handle_on(base, geometry_of(base), base.autograd), geometry_of(impl));
}

void inplace_commit(Tensor& self, const Tensor& result, const char* op) {
  FLAME_CHECK(result.sizes() == self.sizes(), op, "internal error: in-place result of shape ", result.sizes(),
              " for a destination of shape ", self.sizes());
  Tensor r = result.dtype() == self.dtype() ? result : result.to(self.dtype());
  if (r.shares_storage(self)) r = r.clone();  // the write must not read what it overwrites
  {
    NoGradGuard no_grad;
    self.copy_(r);  // not recorded: the history is attached below
  }
  TensorImpl& impl = *self.impl();
  if (!impl.base) {
    Tensor h = handle_on(impl, geometry_of(impl), nullptr);
    record(h, op, {r}, [](const Tensor& g) { return TensorList{g}; });
    impl.autograd = h.impl()->autograd;
    ++impl.history_version;  // views of self made before now regenerate their history
    return;
  }
  TensorImpl& base = *impl.base;
  const Geometry bg = geometry_of(base), vg = geometry_of(impl);
  Tensor new_base = handle_on(base, bg, nullptr);
  record(new_base, "copy_slices", {handle_on(base, bg, base.autograd), r}, [bg, vg](const Tensor& g) {
    Scratch s = make_scratch(bg, vg, g.dtype(), g.device());
    s.base_view.copy_(g);
    Tensor g_view = s.region.clone();
    s.region.fill_(0);
    return TensorList{s.base_view.contiguous(), g_view};
  });
  base.autograd = new_base.impl()->autograd;
  ++base.history_version;
  attach_view_history(impl, base);
}

}  // namespace flame::rules
