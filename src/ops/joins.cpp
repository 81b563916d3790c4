// Copies and joins: flip, repeat, split/chunk (views), cat, stack, pad.
//
// Note [Joins on copy]
// These ops need no kernels of their own. Each allocates its output and fills it with the
// backend's strided `copy` (which also converts dtypes) and `fill`, reading its inputs through
// views: narrow() slabs of the output for cat/pad, a stride-0 (expanded) dim for repeat and
// replicate padding, and a negative stride for flip and reflect padding. split/chunk return
// narrow() views and copy nothing. So every backend gets these ops for free, provided its copy
// accepts any strides, negative and zero included (the CPU loops step by signed byte strides).
//
// Note [Join gradients]
// Each op records its node right after allocating the output. The backward formulas use only
// the ops of this file and views (narrow, select, flip, pad, sum), so they run on every backend
// and are themselves differentiable: cat/stack hand each input its slab of the gradient, flip
// flips it back, repeat sums the repeated blocks, pad crops the gradient and (reflect,
// replicate) adds each border back onto the elements it was copied from.
#include <algorithm>
#include <functional>

#include "flame/ops.h"
#include "src/core/grad_state.h"
#include "src/ops/grad_hooks.h"
#include "src/backend/backend.h"
#include "src/core/checked_math.h"
#include "src/core/tensor_impl.h"
#include "flame/grad_mode.h"
#include "src/ops/invoke.h"

namespace flame {
namespace {

void check_defined(const Tensor& t, const char* op) {
  FLAME_CHECK(t.defined(), op, "got an undefined tensor");
}

// The most dims a backend's strided loops take (the CPU reference's limit, and the most a tensor
// or view may have). repeat()'s (repeat, size) pairs can have twice the input's dims: copy_pairs
// loops over the leading ones.
constexpr int64_t kMaxKernelDims = 16;

// dst (fresh, or a slab of a fresh output) = src converted to dst's dtype; src has dst's shape.
void copy_into(const Tensor& dst, const Tensor& src) {
  if (dst.numel() == 0) return;
  backend::backend_for(dst.device()).copy(dst, src);
}

// out's elements at (sizes, dst_strides, dst_offset) = x's at (sizes, src_strides, src_offset). No view
// has more dims than tensors may (repeat's (repeat, size) pairs can have twice the input's): the
// leading dims beyond that are looped over.
void copy_pairs(const Tensor& out, const Tensor& x, const Shape& sizes, const Shape& dst_strides, int64_t dst_offset,
                const Shape& src_strides, int64_t src_offset) {
  if (static_cast<int64_t>(sizes.size()) <= kMaxKernelDims) {
    copy_into(make_view(out, sizes, dst_strides, dst_offset), make_view(x, sizes, src_strides, src_offset));
    return;
  }
  const Shape inner_sizes(sizes.begin() + 1, sizes.end()), inner_dst(dst_strides.begin() + 1, dst_strides.end()),
      inner_src(src_strides.begin() + 1, src_strides.end());
  for (int64_t i = 0; i < sizes[0]; ++i)
    copy_pairs(out, x, inner_sizes, inner_dst, dst_offset + i * dst_strides[0], inner_src,
               src_offset + i * src_strides[0]);
}

// A view of t with dim d read back to front (a negative stride; see Note [Joins on copy]).
Tensor reversed(const Tensor& t, int64_t d) {
  const int64_t n = t.sizes()[d];
  if (n <= 1) return t;
  Shape st = t.strides();
  const int64_t offset = t.storage_offset() + (n - 1) * st[d];
  st[d] = -st[d];
  return make_view(t, t.sizes(), st, offset);
}

// The most pieces split/chunk return: each is a tensor handle, and a list longer than this is a
// mistaken argument, not a use (it would take gigabytes before the first piece is used).
constexpr int64_t kMaxPieces = int64_t(1) << 24;

void check_piece_count(int64_t pieces, const char* op, const Tensor& x, int64_t d) {
  FLAME_CHECK(pieces <= kMaxPieces, op, "would return ", pieces, " pieces of dim ", d, " of the input of shape ",
              x.sizes(), ", more than the limit of ", kMaxPieces);
}

bool is_legacy_empty(const Tensor& t) { return t.dim() == 1 && t.sizes()[0] == 0; }

}  // namespace

// ---- flip, repeat ----
// Op definitions (Note [Invoke]): opaque steps of a flame::compile trace, gradients in
// src/autograd/rules/joins.cpp (Note [Gradient hooks]).

namespace {

struct FlipCall {
  Tensor x;
  op_detail::Kept<Shape> dims;
};
struct FlipDef : op_detail::OpDefaults<FlipCall> {
  struct Prep {
    Tensor src;  // x read back to front along each flipped dim
  };
  struct Result {
    Tensor out;
  };
  using Out = Tensor;
  static const char* name(const Args&) { return "flip"; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.x = in[0];
    a.dims.keep();
    return a;
  }
  static Prep prepare(const Args& a) {
    check_defined(a.x, "flip");
    const int64_t n = a.x.dim();
    uint32_t seen = 0;  // a tensor has at most 16 dims
    Tensor src = a.x;
    for (int64_t d : a.dims.get()) {
      const int64_t w = wrap_dim(d, n, "flip");  // in [0, max(n, 1))
      FLAME_CHECK(!(seen >> w & 1u), "flip", "dim ", w, " appears more than once in dims ", a.dims.get(),
                  " (input shape ", a.x.sizes(), ")");
      seen |= 1u << w;
      if (n > 0) src = reversed(src, w);
    }
    return {std::move(src)};
  }
  static Result run(const Args& a, Prep& p) {
    Tensor out = make_empty(a.x.sizes(), a.x.dtype(), a.x.device(), "flip");
    copy_into(out, p.src);
    return {std::move(out)};
  }
  static void record(Result& r, const Args& a, const Prep&) { rules::flip(r.out, a.x, a.dims.get()); }
};

struct RepeatCall {
  Tensor x;
  op_detail::Kept<Shape> repeats;
};
struct RepeatDef : op_detail::OpDefaults<RepeatCall> {
  struct Prep {
    Shape in_sizes, in_strides;  // x with leading size-1 dims up to the repeats' length
    Shape out_shape;
  };
  struct Result {
    Tensor out;
  };
  using Out = Tensor;
  static const char* name(const Args&) { return "repeat"; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.x = in[0];
    a.repeats.keep();
    return a;
  }
  static Prep prepare(const Args& a) {
    const Tensor& x = a.x;
    const Shape& repeats = a.repeats.get();
    check_defined(x, "repeat");
    const int64_t n = x.dim(), m = static_cast<int64_t>(repeats.size());
    FLAME_CHECK(m >= n, "repeat", "number of repeats ", repeats,
                " can not be smaller than the number of dims of the input of shape ", x.sizes());
    for (int64_t r : repeats) {
      FLAME_CHECK(r >= 0, "repeat", "repeats must be non-negative, got ", repeats, " (input shape ", x.sizes(), ")");
    }
    Prep p{Shape(m - n, 1), Shape(m - n, 0), Shape(m)};
    p.in_sizes.insert(p.in_sizes.end(), x.sizes().begin(), x.sizes().end());
    p.in_strides.insert(p.in_strides.end(), x.strides().begin(), x.strides().end());
    for (int64_t i = 0; i < m; ++i) {
      p.out_shape[i] = checked_mul(p.in_sizes[i], repeats[i], "repeat", "the output size");
    }
    return p;
  }
  static Result run(const Args& a, Prep& p) {
    const Shape& repeats = a.repeats.get();
    Tensor out = make_empty(p.out_shape, a.x.dtype(), a.x.device(), "repeat");
    if (out.numel() == 0) return {std::move(out)};
    // View the output as (repeat, size) pairs and read x with stride 0 along each repeat dim.
    // Size-1 entries are dropped to keep the dim count low.
    const Shape& out_strides = out.strides();
    Shape sizes, dst_strides, src_strides;
    for (std::size_t i = 0; i < repeats.size(); ++i) {
      if (repeats[i] != 1) {
        sizes.push_back(repeats[i]);
        dst_strides.push_back(p.in_sizes[i] * out_strides[i]);
        src_strides.push_back(0);
      }
      if (p.in_sizes[i] != 1) {
        sizes.push_back(p.in_sizes[i]);
        dst_strides.push_back(out_strides[i]);
        src_strides.push_back(p.in_strides[i]);
      }
    }
    copy_pairs(out, a.x, sizes, dst_strides, 0, src_strides, a.x.storage_offset());
    return {std::move(out)};
  }
  static void record(Result& r, const Args& a, const Prep& p) {
    rules::repeat(r.out, a.x, p.in_sizes, a.repeats.get());
  }
};

}  // namespace

Tensor flip(const Tensor& x, const Shape& dims) { return op_detail::invoke<FlipDef>({x, dims}); }

Tensor repeat(const Tensor& x, const Shape& repeats) { return op_detail::invoke<RepeatDef>({x, repeats}); }

// ---- split, chunk (views) ----

TensorList split(const Tensor& x, int64_t split_size, int64_t dim) {
  check_defined(x, "split");
  FLAME_CHECK(x.dim() > 0, "split", "expects at least a 1-dimensional tensor, got shape ", x.sizes());
  FLAME_CHECK(split_size >= 0, "split", "split_size must be non-negative, got ", split_size);
  const int64_t d = wrap_dim(dim, x.dim(), "split");
  const int64_t n = x.sizes()[d];
  FLAME_CHECK(split_size > 0 || n == 0, "split", "split_size can only be 0 if the dimension size is 0, got dim ",
              d, " of size ", n, " (shape ", x.sizes(), ")");
  const int64_t pieces = split_size == 0 ? 1 : std::max<int64_t>(ceil_div(n, split_size), 1);
  check_piece_count(pieces, "split", x, d);
  TensorList out;
  out.reserve(static_cast<std::size_t>(pieces));
  for (int64_t i = 0; i < pieces; ++i) {
    const int64_t start = i * split_size;
    out.push_back(x.narrow(d, start, std::min(split_size, n - start)));
  }
  return out;
}

TensorList split_with_sizes(const Tensor& x, const Shape& sizes, int64_t dim) {
  check_defined(x, "split_with_sizes");
  FLAME_CHECK(x.dim() > 0, "split_with_sizes", "expects at least a 1-dimensional tensor, got shape ", x.sizes());
  const int64_t d = wrap_dim(dim, x.dim(), "split_with_sizes");
  const int64_t n = x.sizes()[d];
  int64_t total = 0;
  for (int64_t s : sizes) {
    FLAME_CHECK(s >= 0, "split_with_sizes", "split sizes must be non-negative, got ", sizes);
    total = checked_add(total, s, "split_with_sizes", "the sum of the split sizes");
  }
  FLAME_CHECK(total == n, "split_with_sizes", "split sizes ", sizes, " must sum exactly to the size ", n,
              " of dim ", d, " of the input of shape ", x.sizes(), ", but sum to ", total);
  TensorList out;
  out.reserve(sizes.size());
  int64_t start = 0;
  for (int64_t s : sizes) {
    out.push_back(x.narrow(d, start, s));
    start += s;
  }
  return out;
}

TensorList chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  check_defined(x, "chunk");
  FLAME_CHECK(x.dim() > 0, "chunk", "expects at least a 1-dimensional tensor, got shape ", x.sizes());
  FLAME_CHECK(chunks > 0, "chunk", "number of chunks must be positive, got ", chunks);
  const int64_t d = wrap_dim(dim, x.dim(), "chunk");
  const int64_t n = x.sizes()[d];
  // Like PyTorch: pieces of ceil(n / chunks), so there may be fewer than `chunks`; an empty dim
  // gives `chunks` empty pieces.
  if (n == 0) {
    check_piece_count(chunks, "chunk", x, d);
    return split_with_sizes(x, Shape(static_cast<std::size_t>(chunks), 0), d);
  }
  return split(x, ceil_div(n, chunks), d);
}

// ---- cat, stack ----

namespace {
// cat's output and where each input starts along its dim (-1: a skipped legacy empty [0] input),
// for cat and for stack over its unsqueezed inputs: `op` is the public name in errors.
struct Joined {
  Tensor out;
  std::vector<int64_t> starts;
  int64_t dim = 0;
};

Joined cat_into(const TensorList& tensors, int64_t dim, const char* op) {
  FLAME_CHECK(!tensors.empty(), op, "expected a non-empty list of tensors");
  const Tensor* first = nullptr;  // the first tensor taking part (legacy empty [0] ones are skipped)
  DType dt = DType::boolean;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    FLAME_CHECK(t.defined(), op, "tensor at position ", i, " is undefined");
    FLAME_CHECK(t.dim() > 0, op, "zero-dimensional tensor (at position ", i, ") cannot be concatenated");
    check_same_device(op, tensors[0], t);
    dt = i == 0 ? t.dtype() : promote_types(dt, t.dtype());
    if (!first && !is_legacy_empty(t)) first = &t;
  }
  if (!first) {  // only [0] tensors: an empty result
    return {make_empty({0}, dt, tensors[0].device(), op), std::vector<int64_t>(tensors.size(), -1), 0};
  }
  const int64_t nd = first->dim();
  const int64_t d = wrap_dim(dim, nd, op);
  Shape out_shape = first->sizes();
  out_shape[d] = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (is_legacy_empty(t)) continue;
    FLAME_CHECK(t.dim() == nd, op, "tensors must have the same number of dims, got shapes ", first->sizes(),
                " and ", t.sizes(), " (position ", i, ")");
    for (int64_t k = 0; k < nd; ++k) {
      FLAME_CHECK(k == d || t.sizes()[k] == first->sizes()[k], op, "sizes of tensors must match except in dim ",
                  d, ", got shapes ", first->sizes(), " and ", t.sizes(), " (position ", i, ")");
    }
    out_shape[d] = checked_add(out_shape[d], t.sizes()[d], op, "the concatenated size");
  }
  Joined j{make_empty(out_shape, dt, first->device(), op), {}, d};
  j.starts.reserve(tensors.size());
  int64_t offset = 0;
  for (const Tensor& t : tensors) {
    if (is_legacy_empty(t)) {
      j.starts.push_back(-1);
      continue;
    }
    const int64_t len = t.sizes()[d];
    j.starts.push_back(offset);
    copy_into(j.out.narrow(d, offset, len), t);
    offset += len;
  }
  return j;
}

// cat and stack: op definitions over a list of tensors (borrowed from the caller).
struct JoinCall {
  op_detail::Kept<TensorList> tensors;
  int64_t dim = 0;
};
struct JoinDefBase : op_detail::OpDefaults<JoinCall> {
  struct Prep {};
  using Result = Joined;
  using Out = Tensor;
  static TensorList inputs(const Args& a) { return a.tensors.get(); }
  static Args with_inputs(Args a, const TensorList& in) {
    a.tensors.set(in);
    return a;
  }
};

struct CatDef : JoinDefBase {
  // Recomputable (Note [Recompute cheap]) where the inputs are mostly marked outputs (the join of
  // attention's per-stream q and k after their norms): cat's node saves nothing, so a recipe
  // holding plain inputs would keep them alive in place of the output.
  static constexpr bool recomputable = true;
  static TensorList recipe_inputs(const Args& a, const Prep&) {
    const TensorList& in = a.tensors.get();
    return autograd_detail::worth_a_recipe(in) ? in : TensorList{};
  }
  static const Tensor& recipe_output(const Result& r) { return r.out; }
  static const char* name(const Args&) { return "cat"; }
  static Prep prepare(const Args&) { return {}; }  // cat_into checks as it goes
  static Result run(const Args& a, Prep&) { return cat_into(a.tensors.get(), a.dim, "cat"); }
  static void record(Result& r, const Args& a, const Prep&) { rules::cat(r.out, a.tensors.get(), r.starts, r.dim); }
};

struct StackDef : JoinDefBase {
  static const char* name(const Args&) { return "stack"; }
  static Prep prepare(const Args& a) {
    const TensorList& tensors = a.tensors.get();
    FLAME_CHECK(!tensors.empty(), "stack", "expected a non-empty list of tensors");
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      FLAME_CHECK(tensors[i].defined(), "stack", "tensor at position ", i, " is undefined");
    }
    const Shape& shape = tensors[0].sizes();
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      check_same_device("stack", tensors[0], tensors[i]);
      FLAME_CHECK(tensors[i].sizes() == shape, "stack", "expects each tensor to be equal size, but got ", shape,
                  " at entry 0 and ", tensors[i].sizes(), " at entry ", i);
    }
    // A tensor has at most 16 dims (Note in src/core/tensor.cpp): say so here, not from unsqueeze.
    FLAME_CHECK(shape.size() < 16, "stack", "inputs of shape ", shape, " have ", shape.size(),
                " dims; the stacked result would have one more, and tensors have at most 16 dims");
    return {};
  }
  static Result run(const Args& a, Prep&) {
    const TensorList& tensors = a.tensors.get();
    const int64_t d = wrap_dim(a.dim, tensors[0].dim() + 1, "stack");
    TensorList parts;
    parts.reserve(tensors.size());
    {
      NoGradGuard views_only;  // the parts are read by the copy; stack's own node has the gradient
      for (const Tensor& t : tensors) parts.push_back(t.unsqueeze(d));
    }
    return cat_into(parts, d, "stack");
  }
  static void record(Result& r, const Args& a, const Prep&) { rules::stack(r.out, a.tensors.get(), r.dim); }
};

}  // namespace

Tensor cat(const TensorList& tensors, int64_t dim) { return op_detail::invoke<CatDef>({tensors, dim}); }

Tensor stack(const TensorList& tensors, int64_t dim) { return op_detail::invoke<StackDef>({tensors, dim}); }

// ---- pad ----

namespace {
struct PadCall {
  Tensor x;
  op_detail::Kept<Shape> pads;
  PadMode mode = PadMode::constant;
  double value = 0.0;
};
struct PadDef : op_detail::OpDefaults<PadCall> {
  struct Prep {
    // Per dim: the non-negative pads, the elements cropped at the start (negative pads crop),
    // the sizes after cropping, the output's sizes; src: x cropped.
    Shape left, right, crop_lo, kept, out_shape;
    Tensor src;
  };
  struct Result {
    Tensor out;
  };
  using Out = Tensor;
  static const char* name(const Args&) { return "pad"; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.x = in[0];
    a.pads.keep();
    return a;
  }
  static Prep prepare(const Args& a) {
    const Tensor& x = a.x;
    const Shape& pads = a.pads.get();
    const PadMode mode = a.mode;
    check_defined(x, "pad");
    const int64_t n = x.dim(), npairs = static_cast<int64_t>(pads.size()) / 2;
    FLAME_CHECK(pads.size() % 2 == 0, "pad", "padding length must be even, got ", pads.size(), " values ", pads);
    FLAME_CHECK(npairs <= n, "pad", "padding ", pads, " has ", npairs,
                " pairs, more than the dims of the input of shape ", x.sizes());
    // pads[2k], pads[2k + 1] apply to dim n - 1 - k. Negative pads crop (first), as in PyTorch.
    Shape left(n, 0), right(n, 0), crop_lo(n), kept(n), out_shape(n);
    Tensor src = x;
    for (int64_t k = 0; k < npairs; ++k) {
      const int64_t d = n - 1 - k;
      left[d] = pads[2 * k];
      right[d] = pads[2 * k + 1];
    }
    for (int64_t d = 0; d < n; ++d) {
      const int64_t size = x.sizes()[d];
      FLAME_CHECK(left[d] >= -size && right[d] >= -size, "pad", "padding ", pads, " crops more than dim ", d,
                  " of size ", size, " (input shape ", x.sizes(), ")");
      const int64_t crop_l = std::max<int64_t>(-left[d], 0), crop_r = std::max<int64_t>(-right[d], 0);
      const int64_t out_size = checked_add(checked_add(size, left[d], "pad", "the padded size"), right[d], "pad",
                                           "the padded size");
      FLAME_CHECK(crop_l <= size - crop_r && out_size >= 0, "pad", "padding ", pads,
                  " crops more than dim ", d, " of size ", size, " (input shape ", x.sizes(), ")");
      crop_lo[d] = crop_l;
      kept[d] = size - crop_l - crop_r;
      out_shape[d] = out_size;
      left[d] = std::max<int64_t>(left[d], 0);
      right[d] = std::max<int64_t>(right[d], 0);
      src = src.narrow(d, crop_l, kept[d]);
      if (left[d] == 0 && right[d] == 0) continue;
      if (mode == PadMode::reflect) {
        FLAME_CHECK(left[d] < kept[d] && right[d] < kept[d], "pad", "reflect padding (", left[d], ", ", right[d],
                    ") must be less than the size ", kept[d], " of dim ", d, " (input shape ", x.sizes(),
                    ", padding ", pads, ")");
      } else if (mode == PadMode::replicate) {
        FLAME_CHECK(kept[d] > 0, "pad", "replicate padding of dim ", d, " needs a non-empty dim (input shape ",
                    x.sizes(), ", padding ", pads, ")");
      }
    }
    return {std::move(left), std::move(right), std::move(crop_lo), std::move(kept), std::move(out_shape),
            std::move(src)};
  }
  static Result run(const Args& a, Prep& p) {
    const int64_t n = a.x.dim();
    const Shape &left = p.left, &right = p.right, &kept = p.kept;
    const PadMode mode = a.mode;
    const double value = a.value;
    const Tensor& x = a.x;
    Tensor out = make_empty(p.out_shape, x.dtype(), x.device(), "pad");
    if (out.numel() == 0) return {std::move(out)};
    const Tensor& src = p.src;
    Tensor interior = out;
    for (int64_t d = 0; d < n; ++d) interior = interior.narrow(d, left[d], kept[d]);
    copy_into(interior, src);

    // Borders dim by dim. At step d, `region` is padded along dims < d and interior along dims > d,
    // so corners get filled from already-padded rows and no uninitialised element is ever read.
    for (int64_t d = 0; d < n; ++d) {
      const int64_t l = left[d], r = right[d], c = kept[d];
      if (l == 0 && r == 0) continue;
      Tensor region = out;
      for (int64_t e = d + 1; e < n; ++e) region = region.narrow(e, left[e], kept[e]);
      const Tensor lo = region.narrow(d, 0, l), hi = region.narrow(d, l + c, r);
      switch (mode) {
        case PadMode::constant: {
          // Integer tensors take the value truncated, bool tensors value != 0 (as fill_ in PyTorch).
          const Scalar v = is_bool(x.dtype()) ? Scalar(value != 0.0) : Scalar(value);
          if (lo.numel() > 0) backend::backend_for(out.device()).fill(lo, v);
          if (hi.numel() > 0) backend::backend_for(out.device()).fill(hi, v);
          break;
        }
        case PadMode::reflect:  // out[l - 1 - k] = out[l + 1 + k], out[l + c + k] = out[l + c - 2 - k]
          copy_into(lo, reversed(region.narrow(d, l + 1, l), d));
          copy_into(hi, reversed(region.narrow(d, l + c - 1 - r, r), d));
          break;
        case PadMode::replicate:
          copy_into(lo, region.narrow(d, l, 1).expand(lo.sizes()));
          copy_into(hi, region.narrow(d, l + c - 1, 1).expand(hi.sizes()));
          break;
      }
    }
    return {std::move(out)};
  }
  // Recorded once the output is written (anomaly mode checks outputs at record time); the narrows
  // of run are plain views of a tensor outside the graph.
  static void record(Result& r, const Args& a, const Prep& p) {
    rules::pad(r.out, a.x, p.left, p.right, p.crop_lo, p.kept, a.mode);
  }
};
}  // namespace

Tensor pad(const Tensor& x, const Shape& pads, PadMode mode, double value) {
  return op_detail::invoke<PadDef>({x, pads, mode, value});
}

}  // namespace flame
