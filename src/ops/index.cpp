// Indexing ops: index_select, gather, scatter, scatter_add, masked_select, take, triu/tril,
// one_hot, embedding, sort, argsort, topk. Semantics follow PyTorch.
//
// Note [Index tensors]
// Index arguments may be i64 or i32 (anything else is an error naming the op and the dtype). The
// op layer converts them to contiguous i64 and views 0-d operands as 1-d of one element, so the
// kernels only see index tensors that are i64, contiguous and have >= 1 dim. Shape rules are
// checked here; index values are checked by the kernels (the CPU backend on the host before it
// writes, the CUDA backend through Note [Deferred device errors]), so no op waits for the GPU to
// validate indices. Negative indices are errors except in `take`, which wraps -n..n-1 as PyTorch.
// Kernels are not called for empty results; an index into a size-0 dim is rejected here.
//
// Note [Scatter duplicates]
// When several index entries name the same destination, scatter keeps one of the written values:
// the CPU kernel writes in row-major order of the index, so the last one wins; on CUDA the winner
// is unspecified (as in PyTorch). scatter_add sums all of them (on CUDA in unspecified order).
#include <algorithm>
#include <limits>

#include "flame/grad_mode.h"
#include "flame/ops.h"
#include "src/autograd/rules/rules.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"
#include "src/ops/trace_hooks.h"

namespace flame {
namespace {

void check_defined(const Tensor& t, const char* op, const char* what) {
  FLAME_CHECK(t.defined(), op, what, " is an undefined tensor");
}

// Validates an index argument and returns it as contiguous i64 (Note [Index tensors]).
Tensor index_arg(const Tensor& index, const Tensor& x, const char* op) {
  check_defined(index, op, "index");
  check_same_device(op, x, index);
  FLAME_CHECK(index.dtype() == DType::i64 || index.dtype() == DType::i32, op,
              "index must be an i64 or i32 tensor, got ", dtype_name(index.dtype()));
  return index.to(DType::i64).contiguous();
}

// A 0-d tensor as a 1-d view of its one element; other tensors unchanged.
Tensor at_least_1d(const Tensor& t) { return t.dim() == 0 ? t.reshape({1}) : t; }
int64_t nonempty_dim(const Tensor& t) { return std::max<int64_t>(t.dim(), 1); }

// The one index check that needs no data: any index into a size-0 dim is out of range.
void check_not_empty_dim(const Tensor& x1, int64_t dim, const Tensor& index, const char* op) {
  FLAME_CHECK(index.numel() == 0 || x1.size(dim) > 0, op, "index is out of bounds for dim ", dim,
              " with size 0 (input shape ", x1.sizes(), ")");
}

// Host-side range check for CPU tensors, where reading the index costs nothing extra; lets
// composite ops (take, embedding, one_hot) name themselves in the error. `index` is i64 contiguous.
void check_range_on_cpu(const Tensor& index, int64_t lo, int64_t hi, const char* op, const char* what) {
  if (!index.device().is_cpu()) return;
  const int64_t* p = index.data<int64_t>();
  for (int64_t i = 0, n = index.numel(); i < n; ++i) {
    FLAME_CHECK(p[i] >= lo && p[i] < hi, op, "index ", p[i], " is out of range for ", what,
                " (expected in [", lo, ", ", hi, "))");
  }
}

Tensor scatter_impl(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src, bool accumulate,
                    const char* op) {
  check_defined(x, op, "input");
  check_defined(src, op, "src");
  Tensor idx = index_arg(index, x, op);
  check_same_device(op, x, src);
  FLAME_CHECK(src.dtype() == x.dtype(), op, "src dtype ", dtype_name(src.dtype()),
              " does not match the input's dtype ", dtype_name(x.dtype()));
  const int64_t d = wrap_dim(dim, x.dim(), op);
  FLAME_CHECK(nonempty_dim(idx) == nonempty_dim(x) && nonempty_dim(src) == nonempty_dim(x), op,
              "index and src must have as many dims as the input: input ", x.sizes(), ", index ",
              idx.sizes(), ", src ", src.sizes());
  const Tensor x1 = at_least_1d(x), i1 = at_least_1d(idx), s1 = at_least_1d(src);
  if (idx.numel() > 0) {
    for (int64_t k = 0; k < x1.dim(); ++k) {
      FLAME_CHECK(i1.size(k) <= s1.size(k), op, "index of shape ", idx.sizes(),
                  " is larger than src of shape ", src.sizes(), " in dim ", k);
      FLAME_CHECK(k == d || i1.size(k) <= x1.size(k), op, "index of shape ", idx.sizes(),
                  " is larger than the input of shape ", x.sizes(), " in dim ", k);
    }
  }
  check_not_empty_dim(x1, d, idx, op);
  Tensor out;
  {
    NoGradGuard no_grad;  // the clone is an implementation detail; the scatter rule covers both inputs
    out = x.clone();
  }
  if (idx.numel() > 0) backend::backend_for(x.device()).scatter(at_least_1d(out), d, i1, s1, accumulate);
  rules::scatter(out, x, d, idx, src, accumulate);
  return out;
}

Tensor triangle(const Tensor& x, int64_t diagonal, bool upper, const char* op) {
  check_defined(x, op, "input");
  FLAME_CHECK(x.dim() >= 2, op, "input must have at least 2 dims, got shape ", x.sizes());
  // keep[i, j] = (j - i >= diagonal) for triu, (j - i <= diagonal) for tril; batched by broadcast.
  const Tensor rows = Tensor::arange(x.size(-2), x.device()).unsqueeze(1);
  const Tensor cols = Tensor::arange(x.size(-1), x.device()).unsqueeze(0);
  const Tensor offset = cols - rows;
  const Tensor diag = Tensor::scalar(diagonal, x.device());
  const Tensor keep = upper ? offset.ge(diag) : offset.le(diag);
  return where(keep, x, Tensor::zeros({}, {x.dtype(), x.device()}));
}

}  // namespace

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  if (auto* tr = compile_detail::active_tracer()) {  // one opaque step of a flame::compile trace
    return compile_detail::trace_eager_op(*tr, "index_select", {x, index},
                                          [dim](const TensorList& in) { return index_select(in[0], dim, in[1]); });
  }
  check_defined(x, "index_select", "input");
  Tensor idx = index_arg(index, x, "index_select");
  FLAME_CHECK(idx.dim() <= 1, "index_select", "index must be 0-d or 1-d, got shape ", idx.sizes());
  const int64_t d = wrap_dim(dim, x.dim(), "index_select");
  FLAME_CHECK(x.dim() > 0 || idx.numel() == 1, "index_select",
              "a 0-d input takes exactly one index, got ", idx.numel());
  Shape shape = x.sizes();
  if (x.dim() > 0) shape[d] = idx.numel();
  const Tensor x1 = at_least_1d(x);
  check_not_empty_dim(x1, d, idx, "index_select");
  Tensor out = make_empty(shape, x.dtype(), x.device(), "index_select");
  if (out.numel() > 0) {
    backend::backend_for(x.device()).index_select(at_least_1d(out), x1, d, at_least_1d(idx));
  }
  rules::index_select(out, x, d, at_least_1d(idx));
  return out;
}

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  if (auto* tr = compile_detail::active_tracer()) {  // one opaque step of a flame::compile trace
    return compile_detail::trace_eager_op(*tr, "gather", {x, index},
                                          [dim](const TensorList& in) { return gather(in[0], dim, in[1]); });
  }
  check_defined(x, "gather", "input");
  Tensor idx = index_arg(index, x, "gather");
  const int64_t d = wrap_dim(dim, x.dim(), "gather");
  FLAME_CHECK(nonempty_dim(idx) == nonempty_dim(x), "gather",
              "index must have as many dims as the input: input ", x.sizes(), ", index ", idx.sizes());
  const Tensor x1 = at_least_1d(x), i1 = at_least_1d(idx);
  if (idx.numel() > 0) {
    for (int64_t k = 0; k < x1.dim(); ++k) {
      FLAME_CHECK(k == d || i1.size(k) <= x1.size(k), "gather", "index of shape ", idx.sizes(),
                  " is larger than the input of shape ", x.sizes(), " in dim ", k);
    }
  }
  check_not_empty_dim(x1, d, idx, "gather");
  Tensor out = make_empty(idx.sizes(), x.dtype(), x.device(), "gather");
  if (out.numel() > 0) backend::backend_for(x.device()).gather(at_least_1d(out), x1, d, i1);
  rules::gather(out, x, d, idx);
  return out;
}

Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  if (auto* tr = compile_detail::active_tracer()) {  // one opaque step of a flame::compile trace
    return compile_detail::trace_eager_op(*tr, "scatter", {x, index, src},
                                          [dim](const TensorList& in) { return scatter(in[0], dim, in[1], in[2]); });
  }
  return scatter_impl(x, dim, index, src, false, "scatter");
}

Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  if (auto* tr = compile_detail::active_tracer()) {  // one opaque step of a flame::compile trace
    return compile_detail::trace_eager_op(*tr, "scatter_add", {x, index, src},
                                          [dim](const TensorList& in) { return scatter_add(in[0], dim, in[1], in[2]); });
  }
  return scatter_impl(x, dim, index, src, true, "scatter_add");
}

Tensor masked_select(const Tensor& x, const Tensor& mask) {
  check_defined(x, "masked_select", "input");
  check_defined(mask, "masked_select", "mask");
  check_same_device("masked_select", x, mask);
  FLAME_CHECK(is_bool(mask.dtype()), "masked_select", "mask must be bool, got ", dtype_name(mask.dtype()));
  Shape shape = broadcast_shapes(x.sizes(), mask.sizes(), "masked_select");
  const Shape full = shape;
  if (shape_numel(shape) == 0) {
    Tensor out = make_empty({0}, x.dtype(), x.device(), "masked_select");
    rules::masked_select(out, x, mask.expand(full));
    return out;
  }
  if (shape.empty()) shape = {1};  // kernels see >= 1 dim
  Tensor out = backend::backend_for(x.device()).masked_select(x.expand(shape), mask.expand(shape));
  rules::masked_select(out, x, mask.expand(full));
  return out;
}

Tensor take(const Tensor& x, const Tensor& index) {
  check_defined(x, "take", "input");
  const Tensor idx = index_arg(index, x, "take");
  const int64_t n = x.numel();
  check_range_on_cpu(idx, -n, n, "take", "the flattened input");
  Tensor flat = idx.reshape({-1});
  // Negative indices count from the end. On CUDA an index below -n stays negative after this and
  // index_select reports it.
  flat = where(flat.lt(Tensor::scalar(0, x.device())), flat.add_scalar(n), flat);
  return index_select(x.reshape({-1}), 0, flat).reshape(idx.sizes());
}

Tensor triu(const Tensor& x, int64_t diagonal) { return triangle(x, diagonal, true, "triu"); }
Tensor tril(const Tensor& x, int64_t diagonal) { return triangle(x, diagonal, false, "tril"); }

Tensor one_hot(const Tensor& index, int64_t num_classes) {
  check_defined(index, "one_hot", "index");
  const Tensor idx = index_arg(index, index, "one_hot");
  FLAME_CHECK(num_classes >= -1, "one_hot", "num_classes must be -1 (infer) or >= 0, got ", num_classes);
  // Inferring the class count reads the data (a synchronisation on CUDA, as in PyTorch). On CPU the
  // range is checked here too; on CUDA with num_classes given, the scatter kernel reports it.
  if (num_classes == -1 || idx.device().is_cpu()) {
    FLAME_CHECK(num_classes != -1 || idx.numel() > 0, "one_hot",
                "cannot infer the number of classes from an empty index; pass num_classes");
    const std::vector<int64_t> v = idx.to_vec<int64_t>();
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::lowest();
    for (int64_t e : v) {
      lo = std::min(lo, e);
      hi = std::max(hi, e);
    }
    if (!v.empty()) {
      FLAME_CHECK(lo >= 0, "one_hot", "class values must be non-negative, got ", lo);
      FLAME_CHECK(num_classes != -1 || hi < std::numeric_limits<int64_t>::max(), "one_hot", "class value ", hi,
                  " leaves no room for num_classes = max + 1");
      if (num_classes == -1) num_classes = hi + 1;
      FLAME_CHECK(hi < num_classes, "one_hot", "class value ", hi, " is out of range for num_classes ",
                  num_classes);
    }
  }
  Shape shape = idx.sizes();
  shape.push_back(num_classes);
  Tensor out = Tensor::zeros(shape, {DType::i64, idx.device()});
  if (idx.numel() == 0) return out;
  // Scattering ones writes one element per index (instead of comparing every output element) and
  // lets the CUDA kernel report out-of-range classes.
  const Tensor i1 = idx.unsqueeze(-1);
  check_not_empty_dim(out, out.dim() - 1, i1, "one_hot");
  const Tensor ones = Tensor::ones({1}, {DType::i64, idx.device()}).expand(i1.sizes());
  backend::backend_for(idx.device()).scatter(out, out.dim() - 1, i1, ones, false);
  return out;
}

Tensor embedding(const Tensor& weight, const Tensor& index) {
  if (auto* tr = compile_detail::active_tracer()) {  // one opaque step of a flame::compile trace
    return compile_detail::trace_eager_op(*tr, "embedding", {weight, index},
                                          [](const TensorList& in) { return embedding(in[0], in[1]); });
  }
  check_defined(weight, "embedding", "weight");
  FLAME_CHECK(weight.dim() == 2, "embedding", "weight must be 2-d [num_embeddings, embedding_dim], got shape ",
              weight.sizes());
  const Tensor idx = index_arg(index, weight, "embedding");
  check_range_on_cpu(idx, 0, weight.size(0), "embedding", "the weight's rows");
  Shape shape = idx.sizes();
  shape.push_back(weight.size(1));
  return index_select(weight, 0, idx.reshape({-1})).reshape(shape);
}

std::pair<Tensor, Tensor> sort(const Tensor& x, int64_t dim, bool descending) {
  check_defined(x, "sort", "input");
  const int64_t d = wrap_dim(dim, x.dim(), "sort");
  Tensor values = make_empty(x.sizes(), x.dtype(), x.device(), "sort");
  Tensor indices = make_empty(x.sizes(), DType::i64, x.device(), "sort");
  if (x.numel() > 0) {
    backend::backend_for(x.device()).sort(at_least_1d(values), at_least_1d(indices), at_least_1d(x), d,
                                          descending);
  }
  rules::sort_values(values, x, d, indices);
  return {values, indices};
}

Tensor argsort(const Tensor& x, int64_t dim, bool descending) { return sort(x, dim, descending).second; }

std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k, int64_t dim, bool largest, bool sorted) {
  (void)sorted;  // results always come sorted, which satisfies sorted = false as well
  check_defined(x, "topk", "input");
  const int64_t d = wrap_dim(dim, x.dim(), "topk");
  const int64_t n = x.dim() == 0 ? 1 : x.size(d);
  FLAME_CHECK(k >= 0 && k <= n, "topk", "k = ", k, " is out of range for dim ", dim, " of size ", n,
              " (input shape ", x.sizes(), ")");
  // A stable sort puts NaN first when descending (NaN counts as the largest value) and keeps
  // ties in index order, which is exactly topk's contract.
  auto [values, indices] = sort(x, d, largest);
  if (x.dim() == 0 || k == n) return {values, indices};  // 0-d: PyTorch returns the element itself
  return {values.narrow(d, 0, k).contiguous(), indices.narrow(d, 0, k).contiguous()};
}

}  // namespace flame
