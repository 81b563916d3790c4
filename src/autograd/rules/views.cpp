// Gradient rules of views and copies (declared in src/ops/grad_hooks.h): each maps the output
// gradient back to the input's geometry. Nothing is saved: the lambdas capture shapes and dims
// only. record() turns the op name into the grad_fn name ("narrow" -> "NarrowBackward").
#include "flame/ops.h"
#include "src/autograd/record.h"
#include "src/ops/grad_hooks.h"

namespace flame::rules {

namespace {

// Records out = f(in) with gradient back(g); back captures shapes and dims, never tensors.
template <class F>
Tensor& record_back(Tensor& out, const char* name, const Tensor& in, F&& back) {
  if (!is_floating(out.dtype()) || !needs_grad({in})) return out;
  record(out, name, TensorList{in}, [back = std::forward<F>(back)](const Tensor& g) { return TensorList{back(g)}; });
  return out;
}

// Zeros of `shape` with g written into the region that `region` selects (slice, select).
template <class F>
Tensor place_into(const Tensor& g, const Shape& shape, F&& region) {
  Tensor z = Tensor::zeros(shape, {g.dtype(), g.device()});
  region(z).copy_(g);
  return z;
}

Shape inverse_permutation(const Shape& dims, int64_t n) {
  Shape inv(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) inv[wrap_dim(dims[i], n, "permute")] = i;
  return inv;
}

// Each window i of unfold read x.narrow(d, i*step, size); its gradient adds back there.
Tensor unfold_backward(const Tensor& g, const Shape& xs, int64_t d, int64_t size, int64_t step) {
  Tensor z = Tensor::zeros(xs, {g.dtype(), g.device()});
  if (xs.empty()) return g.reshape({});
  const int64_t n = static_cast<int64_t>(xs.size());
  Shape order;  // g.select(d, i) has x's dims without d, then the window dim: move it to d
  for (int64_t k = 0; k < n - 1; ++k) {
    if (k == d) order.push_back(n - 1);
    order.push_back(k);
  }
  if (d == n - 1) order.push_back(n - 1);
  for (int64_t i = 0; i < g.size(d); ++i) {
    Tensor part = z.narrow(d, i * step, size);
    part.add_(g.select(d, i).permute(order));
  }
  return z;
}

}  // namespace

void view(Tensor& v, const char* name, ViewGrad kind, const Tensor& base, const ViewArgs& a) {
  const Shape xs = base.sizes();
  switch (kind) {
    case ViewGrad::reshape: record_back(v, name, base, [xs](const Tensor& g) { return g.reshape(xs); }); return;
    case ViewGrad::identity: record_back(v, name, base, [](const Tensor& g) { return g; }); return;
    case ViewGrad::transpose:
      record_back(v, name, base, [d0 = a.a, d1 = a.b](const Tensor& g) { return g.transpose(d0, d1); });
      return;
    case ViewGrad::permute:
      record_back(v, name, base, [inv = inverse_permutation(*a.dims, base.dim())](const Tensor& g) { return g.permute(inv); });
      return;
    case ViewGrad::slice:
      record_back(v, name, base, [xs, d = a.a, start = a.b, end = a.c, step = a.d](const Tensor& g) {
        return place_into(g, xs, [&](const Tensor& z) { return z.slice(d, start, end, step); });
      });
      return;
    case ViewGrad::select:
      record_back(v, name, base, [xs, d = a.a, index = a.b](const Tensor& g) {
        return place_into(g, xs, [&](const Tensor& z) { return z.select(d, index); });
      });
      return;
    case ViewGrad::expand: record_back(v, name, base, [xs](const Tensor& g) { return sum_to(g, xs); }); return;
    case ViewGrad::unfold:
      record_back(v, name, base, [xs, d = a.a, size = a.b, step = a.c](const Tensor& g) {
        return unfold_backward(g, xs, d, size, step);
      });
      return;
  }
}

Tensor& copy(Tensor& dst, const char* name, const Tensor& src) {
  return record_back(dst, name, src, [device = src.device(), dtype = src.dtype()](const Tensor& g) {
    const Tensor on_device = g.device() == device ? g : g.to(device);
    return on_device.dtype() == dtype ? on_device : on_device.to(dtype);
  });
}

namespace {
// narrow's gradient: g in x's region [start, start + length) of dim d, zeros elsewhere. It takes
// x's pending gradient sum when there is one (Note [Accumulate base] in
// src/autograd/backward.cpp): the pieces of a chunk or split then add into one buffer (one region
// add each) instead of each making a zero tensor of x's shape that the engine adds up (a fill, a
// copy and an add over the whole of x per piece; a DiT block's six modulation chunks).
TensorList narrow_rule(const Tensor& g, const Node& n) {
  const RuleArgs& a = n.args();
  const int64_t d = a.dim, start = a.count, length = g.size(d);
  const Tensor& base = n.accumulate_base(0);
  if (base.defined()) {
    Tensor sum = n.accumulate_base_owned() ? base : base.clone();
    sum.narrow(d, start, length).add_(g);
    return {sum};
  }
  Tensor z = Tensor::zeros(a.shape, {g.dtype(), g.device()});
  z.narrow(d, start, length).copy_(g);
  return {z};
}
}  // namespace

void narrow(Tensor& v, const Tensor& x, int64_t d, int64_t start) {
  RuleArgs args;
  args.dim = d;
  args.count = start;
  args.shape = x.sizes();
  record(v, "NarrowBackward", {x}, narrow_rule, std::move(args)).accept_accumulate_base(0);
}

}  // namespace flame::rules
