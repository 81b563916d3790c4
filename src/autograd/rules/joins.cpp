// Gradient rules of the joins (declared in src/ops/grad_hooks.h). cat and stack: each input
// receives its slice of the output's gradient (a view of it: no copy, nothing saved); flip, repeat
// and pad map the gradient back to the input's geometry.
#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/ops/grad_hooks.h"

namespace flame::rules {

// starts[i]: where input i begins along dim d of out; -1 for a skipped [0] input.
void cat(Tensor& out, const TensorList& tensors, const std::vector<int64_t>& starts, int64_t d) {
  if (!is_floating(out.dtype()) || !needs_grad(tensors)) return;
  Shape lens;
  for (std::size_t i = 0; i < tensors.size(); ++i) lens.push_back(starts[i] < 0 ? 0 : tensors[i].sizes()[d]);
  record(out, "CatBackward", tensors, [starts, lens, d](const Tensor& g) {
    TensorList grads;
    grads.reserve(starts.size());
    for (std::size_t i = 0; i < starts.size(); ++i) {
      // A skipped [0] input gets an empty (defined) gradient, so that what produced it still
      // runs its rule and passes zeros on.
      grads.push_back(starts[i] < 0 ? Tensor::zeros({0}, {g.dtype(), g.device()})
                                    : g.narrow(d, starts[i], lens[i]));
    }
    return grads;
  });
}

void stack(Tensor& out, const TensorList& tensors, int64_t d) {
  if (!is_floating(out.dtype()) || !needs_grad(tensors)) return;
  const std::size_t count = tensors.size();
  record(out, "StackBackward", tensors, [d, count](const Tensor& g) {
    TensorList grads;
    grads.reserve(count);
    for (std::size_t i = 0; i < count; ++i) grads.push_back(g.select(d, static_cast<int64_t>(i)));
    return grads;
  });
}

Tensor& flip(Tensor& out, const Tensor& x, const Shape& dims) {
  if (!is_floating(out.dtype()) || !needs_grad({x})) return out;
  record(out, "flip", TensorList{x}, [dims](const Tensor& g) { return TensorList{g.flip(dims)}; });
  return out;
}

void repeat(Tensor& out, const Tensor& x, const Shape& x_padded, const Shape& repeats) {
  if (!is_floating(out.dtype()) || !needs_grad({x})) return;
  record(out, "repeat", TensorList{x}, [x_shape = x.sizes(), x_padded, repeats](const Tensor& g) {
    if (repeats.empty()) return TensorList{g};  // 0-d
    Shape blocks, repeat_dims;  // g as (repeat, size) pairs; sum over the repeats
    for (std::size_t i = 0; i < repeats.size(); ++i) {
      repeat_dims.push_back(static_cast<int64_t>(blocks.size()));
      blocks.push_back(repeats[i]);
      blocks.push_back(x_padded[i]);
    }
    return TensorList{sum(g.reshape(blocks), repeat_dims).reshape(x_shape)};
  });
}

namespace {
// t with `before` and `after` zeros added along dim d.
Tensor zero_pad_dim(const Tensor& t, int64_t d, int64_t before, int64_t after) {
  if (before == 0 && after == 0) return t;
  Shape pads(2 * static_cast<std::size_t>(t.dim() - d), 0);
  pads[pads.size() - 2] = before;
  pads[pads.size() - 1] = after;
  return flame::pad(t, pads, PadMode::constant, 0.0);
}
}  // namespace

// Note [Join gradients] in src/ops/joins.cpp.
void pad(Tensor& out, const Tensor& x, const Shape& left, const Shape& right, const Shape& crop_lo, const Shape& kept,
         PadMode mode) {
  if (!is_floating(out.dtype()) || !needs_grad({x})) return;
  record(out, "pad", TensorList{x}, [x_shape = x.sizes(), left, right, crop_lo, kept, mode](const Tensor& grad) {
    const int64_t n = static_cast<int64_t>(x_shape.size());
    Tensor g = grad;
    // Undo the padding dim by dim, last first (the forward padded dim 0 first).
    for (int64_t d = n - 1; d >= 0; --d) {
      const int64_t l = left[d], r = right[d], c = kept[d];
      Tensor gi = g.narrow(d, l, c);
      if (mode == PadMode::reflect) {
        if (l > 0) gi = gi + zero_pad_dim(g.narrow(d, 0, l).flip({d}), d, 1, c - 1 - l);
        if (r > 0) gi = gi + zero_pad_dim(g.narrow(d, l + c, r).flip({d}), d, c - 1 - r, 1);
      } else if (mode == PadMode::replicate) {
        if (l > 0) gi = gi + zero_pad_dim(sum(g.narrow(d, 0, l), {d}, true), d, 0, c - 1);
        if (r > 0) gi = gi + zero_pad_dim(sum(g.narrow(d, l + c, r), {d}, true), d, c - 1, 0);
      }
      g = gi;
    }
    // Cropped elements get zero gradient.
    Shape uncrop(2 * static_cast<std::size_t>(n), 0);
    bool cropped = false;
    for (int64_t d = 0; d < n; ++d) {
      uncrop[2 * (n - 1 - d)] = crop_lo[d];
      uncrop[2 * (n - 1 - d) + 1] = x_shape[d] - kept[d] - crop_lo[d];
      cropped = cropped || kept[d] != x_shape[d];
    }
    return TensorList{cropped ? flame::pad(g, uncrop, PadMode::constant, 0.0) : g};
  });
}

}  // namespace flame::rules
