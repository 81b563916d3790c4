// Gradient rules of the indexing family: gradients flow back to the positions that were read.
//
// Note [Saved indices]
// Index tensors (and masks, and sort's indices) are saved as SavedTensors like any other: they
// often alias a buffer the caller refills every step (a token batch, a label vector), and a
// refill before backward would send gradients to the wrong rows without a word. With the version
// check, backward raises instead, naming the op.
#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/ops/index_def.h"

namespace flame::op_detail {
namespace {
// dst of `shape` with `small` (whose sizes are <= shape's) written at the leading corner.
Tensor pad_into(const Tensor& small, const Shape& shape) {
  if (small.sizes() == shape) return small;
  Tensor z = Tensor::zeros(shape, {small.dtype(), small.device()});
  Tensor corner = z;
  for (int64_t k = 0; k < small.dim(); ++k) corner = corner.narrow(k, 0, small.size(k));
  corner.copy_(small);
  return z;
}
}  // namespace

// The record members of the indexing family's op definitions (src/ops/index_def.h).
void IndexSelectDef::record(Result& r, const Args& a, const Prep& p) {
  Tensor& out = r.out;
  const Tensor& x = a.x.get();
  const int64_t dim = p.d;
  const Tensor index = p.idx.dim() == 0 ? p.idx.reshape({1}) : p.idx;
  if (!needs_grad({x})) return;
  const Shape xs = x.sizes();
  SavedTensor sidx(index, "index_select");  // Note [Saved indices]
  flame::record(out, "index_select", {x}, [xs, dim, sidx](const Tensor& g) {
    Tensor idx = sidx.get();
    Tensor z = Tensor::zeros(xs, {g.dtype(), g.device()});
    if (xs.empty()) return TensorList{g.reshape({})};
    Shape view(xs.size(), 1);
    view[dim] = idx.numel();
    return TensorList{scatter_add(z, dim, idx.reshape(view).expand(g.sizes()), g)};
  });
}

void GatherDef::record(Result& r, const Args& a, const Prep& p) {
  Tensor& out = r.out;
  const Tensor &x = a.x.get(), &index = p.idx;
  const int64_t dim = p.d;
  if (!needs_grad({x})) return;
  const Shape xs = x.sizes();
  SavedTensor sidx(index, "gather");  // Note [Saved indices]
  flame::record(out, "gather", {x}, [xs, dim, sidx](const Tensor& g) {
    Tensor idx = sidx.get();
    return TensorList{scatter_add(Tensor::zeros(xs, {g.dtype(), g.device()}), dim, idx, g)};
  });
}

void ScatterDef::record(Result& r, const Args& a, const Prep& p) {
  Tensor& out = r.out;
  const Tensor &x = a.x, &index = p.idx, &src = a.src;
  const int64_t dim = p.d;
  const bool accumulate = a.accumulate;
  if (!needs_grad({x, src})) return;
  const Shape ss = src.sizes();
  SavedTensor sidx(index, accumulate ? "scatter_add" : "scatter");  // Note [Saved indices]
  flame::record(out, accumulate ? "scatter_add" : "scatter", {x, src}, [ss, dim, sidx, accumulate](const Tensor& g) {
    Tensor idx = sidx.get();
    // Overwritten positions pass no gradient to x; src receives the gradient of where it landed.
    Tensor gx = accumulate ? g : scatter(g, dim, idx, Tensor::zeros(idx.sizes(), {g.dtype(), g.device()}));
    return TensorList{gx, pad_into(gather(g, dim, idx), ss)};
  });
}

void MaskedSelectDef::record(Result& r, const Args& a, const Prep& p) {
  Tensor& out = r.out;
  const Tensor& x = a.x;
  const Tensor mask_expanded = a.mask.expand(p.shape);
  if (!needs_grad({x})) return;
  const Shape xs = x.sizes();
  SavedTensor smask(mask_expanded.contiguous(), "masked_select");  // Note [Saved indices]
  flame::record(out, "masked_select", {x}, [xs, smask](const Tensor& g) {
    Tensor mask = smask.get();
    // Element k of the output came from the k-th true position: position p takes g[cumsum(mask)[p] - 1].
    Tensor flat = mask.reshape({-1});
    Tensor zero = Tensor::zeros(mask.sizes(), {g.dtype(), g.device()});
    if (g.numel() == 0) return TensorList{sum_to(zero, xs)};
    Tensor pos = (flat.cumsum(0) - 1).clamp(0, std::nullopt);
    Tensor picked = g.index_select(0, pos).reshape(mask.sizes());
    return TensorList{sum_to(where(mask, picked, zero), xs)};
  });
}

void SortDef::record(Result& r, const Args& a, const Prep& p) {
  Tensor& values = r.out;
  const Tensor &x = a.x, &indices = r.indices;
  const int64_t dim = p.d;
  if (!needs_grad({x}) || !is_floating(values.dtype())) return;
  const Shape xs = x.sizes();
  SavedTensor sidx(indices, "sort");  // Note [Saved indices]: the caller may write the returned indices
  flame::record(values, "sort", {x}, [xs, dim, sidx](const Tensor& g) {
    if (xs.empty()) return TensorList{g};
    Tensor idx = sidx.get();
    return TensorList{scatter(Tensor::zeros(xs, {g.dtype(), g.device()}), dim, idx, g)};
  });
}

}  // namespace flame::op_detail
