// libtorch's indexing: x[i], x.index({...}) and x.index_put_({...}, v) (include/flame/indexing.h).
//
// Note [Index lists]
// An index list is applied in two stages, as PyTorch does. First the basic entries (integers,
// slices, None, Ellipsis, bool literals) become views: select, slice, unsqueeze, narrow. Tensor
// entries leave their dims in place and are noted with the dim they index in that view (a bool
// mask of k dims notes k dims). Then, if any tensor entry was noted, advanced indexing:
//  - bool masks become integer indices (nonzero, one masked_select per mask dim; this reads the
//    mask's count, a synchronisation on CUDA, as in PyTorch);
//  - the integer indices broadcast to one shape B; negative values count from the end;
//  - the indexed dims are permuted to the front and merged into one, and one index_select with
//    the merged index sum_j idx_j * prod_{l>j} size_l gathers [B..., rest...];
//  - B stays in front when the indexed dims were apart (or a mask and None/ints split them), and
//    moves to where the first indexed dim was when they were adjacent: PyTorch's rule.
// index_put_ applies the same stages to a view of the destination, scatters the values into the
// merged view (a copy when the dims do not merge) and copies that back through the view, so
// autograd sees a scatter and an in-place copy, both recorded ops. Out-of-range indices are
// errors: checked on the host for CPU tensors, and on CUDA turned into an index past the merged
// dim, which index_select / scatter report (Note [Deferred device errors]); no silent wrap into
// a neighbouring row.
#include <algorithm>
#include <numeric>

#include "flame/grad_mode.h"
#include "flame/indexing.h"
#include "flame/ops.h"
#include "src/core/tensor_impl.h"

namespace flame {
namespace {

using indexing::TensorIndex;
using Kind = TensorIndex::Kind;

// A tensor entry after the basic stage: the dim of the view it indexes (its first dim for a mask).
struct Advanced {
  int64_t dim;
  Tensor index;  // i64, or a bool mask over mask.dim() dims
};

struct BasicResult {
  Tensor view;
  std::vector<Advanced> advanced;
};

// Dims of the input an entry consumes.
int64_t consumed_dims(const TensorIndex& e) {
  switch (e.kind()) {
    case Kind::integer:
    case Kind::slice:
      return 1;
    case Kind::tensor:
      return is_bool(e.tensor().dtype()) ? e.tensor().dim() : 1;
    default:
      return 0;
  }
}

const char* kind_name(const TensorIndex& e) {
  switch (e.kind()) {
    case Kind::integer: return "an integer";
    case Kind::slice: return "a Slice";
    case Kind::tensor: return "a tensor";
    default: return "an entry";
  }
}

// The basic stage of Note [Index lists] on x.
BasicResult apply_basic(const Tensor& x, const std::vector<TensorIndex>& indices, const char* op) {
  FLAME_CHECK(x.defined(), op, "called on an undefined tensor");
  int64_t consumed = 0, ellipses = 0;
  for (const TensorIndex& e : indices) {
    if (e.kind() == Kind::tensor) FLAME_CHECK(e.tensor().defined(), op, "an index tensor is undefined");
    consumed += consumed_dims(e);
    ellipses += e.kind() == Kind::ellipsis;
  }
  FLAME_CHECK(ellipses <= 1, op, "an index list may hold at most one Ellipsis, got ", ellipses);
  FLAME_CHECK(consumed <= x.dim(), op, "too many indices for a tensor of ", x.dim(), " dims (shape ", x.sizes(),
              "): the list indexes ", consumed, " dims");
  BasicResult r{x, {}};
  Tensor& y = r.view;
  int64_t d = 0;     // the next dim of y to index
  int64_t in_d = 0;  // the matching dim of x (for messages)
  for (const TensorIndex& e : indices) {
    switch (e.kind()) {
      case Kind::integer: {
        const int64_t n = y.size(d);
        const int64_t i = e.integer();
        FLAME_CHECK(i >= -n && i < n, op, "index ", i, " is out of bounds for dim ", in_d, " with size ", n,
                    " (shape ", x.sizes(), ")");
        y = y.select(d, i < 0 ? i + n : i);
        ++in_d;
        break;
      }
      case Kind::slice: {
        const indexing::Slice& s = e.slice();
        const int64_t step = s.step.value_or(1);
        FLAME_CHECK(step > 0, op, "slice step must be positive, got ", step, " (dim ", in_d, ")");
        const int64_t n = y.size(d);
        y = y.slice(d, s.start.value_or(0), s.stop.value_or(n), step);
        ++d;
        ++in_d;
        break;
      }
      case Kind::none:
        y = y.unsqueeze(d);
        ++d;
        break;
      case Kind::boolean:
        y = y.unsqueeze(d);
        if (!e.boolean()) y = y.narrow(d, 0, 0);
        ++d;
        break;
      case Kind::ellipsis: {
        const int64_t skip = x.dim() - consumed;
        d += skip;
        in_d += skip;
        break;
      }
      case Kind::tensor: {
        Tensor t = e.tensor();
        if (t.device() != x.device()) t = t.to(x.device());  // CPU indices for a CUDA tensor, as PyTorch
        if (is_bool(t.dtype())) {
          if (t.dim() == 0) {  // a 0-d mask: a new dim, kept (size 1) or emptied (size 0)
            y = y.unsqueeze(d);
            t = t.reshape({1});
          }
          for (int64_t k = 0; k < t.dim(); ++k) {
            FLAME_CHECK(t.size(k) == y.size(d + k), op, "the mask of shape ", t.sizes(), " does not match dim ",
                        in_d + k, " of the indexed tensor (shape ", x.sizes(), "): size ", t.size(k), " vs ",
                        y.size(d + k));
          }
          r.advanced.push_back({d, t});
          d += t.dim();
          in_d += e.tensor().dim();
        } else {
          FLAME_CHECK(t.dtype() == DType::i64 || t.dtype() == DType::i32, op,
                      "tensors used as indices must be i64, i32 or bool, got ", dtype_name(t.dtype()));
          r.advanced.push_back({d, t.to(DType::i64)});
          ++d;
          ++in_d;
        }
        break;
      }
    }
  }
  return r;
}

// Integer coordinates of the true elements of a k-dim mask: k i64 tensors of [count] each.
std::vector<Tensor> nonzero_coords(const Tensor& mask) {
  std::vector<Tensor> out;
  for (int64_t k = 0; k < mask.dim(); ++k) {
    Shape s(static_cast<std::size_t>(mask.dim()), 1);
    s[k] = mask.size(k);
    const Tensor coord = Tensor::arange(mask.size(k), mask.device()).view(s);
    out.push_back(masked_select(coord, mask));
  }
  return out;
}

// The advanced stage's plan: the view's indexed dims, their index tensors (broadcast, in range
// and non-negative) and where the broadcast dims go in the result.
struct Plan {
  std::vector<int64_t> dims;    // dims of the view, increasing
  std::vector<Tensor> indices;  // i64, one shape B each
  Shape batch;                  // B
  bool adjacent = true;         // B goes where dims[0] was (else first)
};

Plan make_plan(const Tensor& y, const std::vector<Advanced>& adv, const char* op) {
  Plan p;
  for (const Advanced& a : adv) {
    if (is_bool(a.index.dtype())) {
      const std::vector<Tensor> coords = nonzero_coords(a.index);
      for (int64_t k = 0; k < a.index.dim(); ++k) {
        p.dims.push_back(a.dim + k);
        p.indices.push_back(coords[static_cast<std::size_t>(k)]);
      }
    } else {
      p.dims.push_back(a.dim);
      p.indices.push_back(a.index);
    }
  }
  for (std::size_t j = 1; j < p.dims.size(); ++j) p.adjacent = p.adjacent && p.dims[j] == p.dims[j - 1] + 1;
  p.batch = p.indices[0].sizes();
  for (std::size_t j = 1; j < p.indices.size(); ++j) {
    p.batch = broadcast_shapes(p.batch, p.indices[j].sizes(), op);
  }
  for (std::size_t j = 0; j < p.indices.size(); ++j) {
    const int64_t n = y.size(p.dims[j]);
    Tensor idx = p.indices[j].expand(p.batch);
    if (idx.device().is_cpu()) {
      const Tensor c = idx.contiguous();
      const int64_t* v = c.data<int64_t>();
      for (int64_t i = 0; i < c.numel(); ++i) {
        FLAME_CHECK(v[i] >= -n && v[i] < n, op, "index ", v[i], " is out of bounds for an indexed dim of size ", n,
                    " (shape of the tensor after the basic entries: ", y.sizes(), ")");
      }
    }
    p.indices[j] = where(idx.lt(Tensor::scalar(0, idx.device())), idx.add_scalar(n), idx);
  }
  return p;
}

// sum_j idx_j * prod_{l>j} size_l over the planned dims, flattened: [numel(B)]. On CUDA, a
// component out of its dim's range makes the entry `total` (past the merged dim), which the
// consuming kernel reports (Note [Index lists]).
Tensor merged_index(const Tensor& y, const Plan& p) {
  int64_t total = 1;
  for (int64_t d : p.dims) total *= y.size(d);
  Tensor merged, bad;
  int64_t stride = 1;
  for (std::size_t j = p.dims.size(); j-- > 0;) {
    const Tensor& idx = p.indices[j];
    merged = merged.defined() ? merged + idx * stride : idx * stride;
    if (!idx.device().is_cpu()) {
      const Tensor out = idx.lt(Tensor::scalar(0, idx.device())) | idx.ge(Tensor::scalar(y.size(p.dims[j]), idx.device()));
      bad = bad.defined() ? (bad | out) : out;
    }
    stride *= y.size(p.dims[j]);
  }
  if (bad.defined()) merged = where(bad, Tensor::scalar(total, merged.device()), merged);
  return merged.reshape({-1});
}

// The view with the planned dims first, in order, then the rest: the permutation.
Shape front_permutation(int64_t ndim, const std::vector<int64_t>& dims) {
  Shape perm(dims.begin(), dims.end());
  for (int64_t d = 0; d < ndim; ++d) {
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) perm.push_back(d);
  }
  return perm;
}

// Moves B's dims (first in a [B..., rest...] tensor) to position `at` of the rest.
Shape batch_to(int64_t nb, int64_t nrest, int64_t at) {
  Shape perm;
  for (int64_t i = 0; i < at; ++i) perm.push_back(nb + i);
  for (int64_t i = 0; i < nb; ++i) perm.push_back(i);
  for (int64_t i = at; i < nrest; ++i) perm.push_back(nb + i);
  return perm;
}

Shape inverse_permutation(const Shape& perm) {
  Shape inv(perm.size());
  for (std::size_t i = 0; i < perm.size(); ++i) inv[static_cast<std::size_t>(perm[i])] = static_cast<int64_t>(i);
  return inv;
}

// y with its planned dims merged into one leading dim: [prod sizes, rest...] (a view when the
// strides allow, else a copy), and the rest's sizes.
std::pair<Tensor, Shape> merged_front(const Tensor& y, const Plan& p) {
  Tensor front = y.permute(front_permutation(y.dim(), p.dims));
  const int64_t k = static_cast<int64_t>(p.dims.size());
  Shape rest(front.sizes().begin() + k, front.sizes().end());
  Shape merged{-1};
  merged.insert(merged.end(), rest.begin(), rest.end());
  if (front.numel() == 0) {  // reshape cannot infer -1 beside a zero
    merged[0] = 1;
    for (int64_t d : p.dims) merged[0] *= y.size(d);
  }
  return {front.reshape(merged), rest};
}

// True when the list is one bool mask over the leading dims of the view and nothing advanced
// else: the cases masked_select / where handle without a nonzero.
bool single_leading_mask(const BasicResult& b) {
  return b.advanced.size() == 1 && b.advanced[0].dim == 0 && is_bool(b.advanced[0].index.dtype());
}

// The mask viewed over all of y's dims (trailing size-1 dims), for masked_fill / where.
Tensor mask_over(const Tensor& mask, const Tensor& y) {
  Shape s = mask.sizes();
  s.resize(static_cast<std::size_t>(y.dim()), 1);
  return mask.reshape(s);
}

// value broadcast to the indexed shape (leading size-1 dims beyond it dropped, as PyTorch).
Tensor fit_value(Tensor v, const Shape& shape) {
  while (v.dim() > static_cast<int64_t>(shape.size()) && v.size(0) == 1) v = v.squeeze(0);
  const bool fits = v.dim() <= static_cast<int64_t>(shape.size()) && [&] {
    for (int64_t i = 1; i <= v.dim(); ++i) {
      const int64_t have = v.size(-i), want = shape[shape.size() - static_cast<std::size_t>(i)];
      if (have != want && have != 1) return false;
    }
    return true;
  }();
  FLAME_CHECK(fits, "index_put_", "a value of shape ", v.sizes(), " cannot be broadcast to the indexed shape ",
              shape);
  return v.expand(shape);
}

}  // namespace

Tensor Tensor::operator[](int64_t index) const {
  FLAME_CHECK(defined(), "operator[]", "called on an undefined tensor");
  FLAME_CHECK(dim() > 0, "operator[]", "cannot index a 0-d tensor (use item<T>())");
  return select(0, index);
}

Tensor Tensor::operator[](const Tensor& index) const { return this->index({index}); }

Tensor Tensor::index(const std::vector<indexing::TensorIndex>& indices) const {
  const BasicResult b = apply_basic(*this, indices, "index");
  if (b.advanced.empty()) return b.view;
  const Tensor& y = b.view;
  if (single_leading_mask(b) && b.advanced[0].index.dim() == y.dim()) {
    return flame::masked_select(y, b.advanced[0].index);
  }
  const Plan p = make_plan(y, b.advanced, "index");
  auto [flat, rest] = merged_front(y, p);
  Shape out_shape = p.batch;
  out_shape.insert(out_shape.end(), rest.begin(), rest.end());
  Tensor out = flame::index_select(flat, 0, merged_index(y, p)).reshape(out_shape);
  const int64_t nb = static_cast<int64_t>(p.batch.size());
  if (p.adjacent && p.dims[0] > 0) {
    out = out.permute(batch_to(nb, static_cast<int64_t>(rest.size()), p.dims[0])).contiguous();
  }
  return out;
}

Tensor& Tensor::index_put_(const std::vector<indexing::TensorIndex>& indices, const Tensor& value) {
  FLAME_CHECK(value.defined(), "index_put_", "the value is an undefined tensor");
  const BasicResult b = apply_basic(*this, indices, "index_put_");
  Tensor y = b.view;
  const Tensor v = value.device() == device() ? value : value.to(device());
  if (b.advanced.empty()) {
    y.copy_(fit_value(v, y.sizes()));
    return *this;
  }
  if (single_leading_mask(b) && v.numel() == 1) {  // x[mask] = one value: no nonzero needed
    y.copy_(flame::where(mask_over(b.advanced[0].index, y), v.reshape({}).to(dtype()), y));
    return *this;
  }
  const Plan p = make_plan(y, b.advanced, "index_put_");
  auto [flat, rest] = merged_front(y, p);
  // The value in the result's layout (as x.index(indices) would be shaped), then B first.
  const int64_t nb = static_cast<int64_t>(p.batch.size()), nr = static_cast<int64_t>(rest.size());
  Shape bfirst = p.batch;
  bfirst.insert(bfirst.end(), rest.begin(), rest.end());
  Tensor vals;
  if (p.adjacent && p.dims[0] > 0) {
    const Shape perm = batch_to(nb, nr, p.dims[0]);
    Shape result_shape;
    for (int64_t d : perm) result_shape.push_back(bfirst[static_cast<std::size_t>(d)]);
    vals = fit_value(v, result_shape).permute(inverse_permutation(perm));
  } else {
    vals = fit_value(v, bfirst);
  }
  const int64_t n = shape_numel(p.batch, "index_put_");
  if (n == 0) return *this;
  Shape flat_vals{n};
  flat_vals.insert(flat_vals.end(), rest.begin(), rest.end());
  vals = vals.to(dtype()).reshape(flat_vals);
  Shape index_view(static_cast<std::size_t>(nr + 1), 1);
  index_view[0] = n;
  const Tensor idx = merged_index(y, p).view(index_view).expand(flat_vals);
  Tensor front = y.permute(front_permutation(y.dim(), p.dims));
  front.copy_(flame::scatter(flat, 0, idx, vals).view(front.sizes()));  // scatter's result is contiguous
  return *this;
}

Tensor& Tensor::index_put_(const std::vector<indexing::TensorIndex>& indices, Scalar value) {
  FLAME_CHECK(defined(), "index_put_", "called on an undefined tensor");
  return index_put_(indices, Tensor::scalar(value, {dtype(), device()}));
}

}  // namespace flame
