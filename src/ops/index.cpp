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
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"
#include "src/ops/index_def.h"

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
  return op_detail::invoke<op_detail::IndexSelectDef>({x, index, dim});
}

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  return op_detail::invoke<op_detail::GatherDef>({x, index, dim});
}

Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  return op_detail::invoke<op_detail::ScatterDef>({x, index, src, dim, false});
}

Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  return op_detail::invoke<op_detail::ScatterDef>({x, index, src, dim, true});
}

Tensor masked_select(const Tensor& x, const Tensor& mask) {
  return op_detail::invoke<op_detail::MaskedSelectDef>({x, mask});
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

namespace {
// embedding as an op definition (Note [Invoke]): one opaque step of a flame::compile trace; the
// rows are an index_select, which records the gradient.
struct EmbeddingCall {
  Tensor weight, index;
};
struct EmbeddingDef : op_detail::OpDefaults<EmbeddingCall> {
  struct Prep {
    Tensor idx;  // the index as i64 on the weight's device
  };
  struct Result {
    Tensor out;
  };
  using Out = Tensor;
  static const char* name(const Args&) { return "embedding"; }
  static TensorList inputs(const Args& a) { return {a.weight, a.index}; }
  static const Tensor& lead(const Args& a) { return a.weight; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.weight = in[0];
    a.index = in[1];
    return a;
  }
  static Prep prepare(const Args& a) {
    check_defined(a.weight, "embedding", "weight");
    FLAME_CHECK(a.weight.dim() == 2, "embedding", "weight must be 2-d [num_embeddings, embedding_dim], got shape ",
                a.weight.sizes());
    Tensor idx = index_arg(a.index, a.weight, "embedding");
    check_range_on_cpu(idx, 0, a.weight.size(0), "embedding", "the weight's rows");
    return {std::move(idx)};
  }
  static Result run(const Args& a, Prep& p) {
    Shape shape = p.idx.sizes();
    shape.push_back(a.weight.size(1));
    return {index_select(a.weight, 0, p.idx.reshape({-1})).reshape(shape)};
  }
  static void record(Result&, const Args&, const Prep&) {}  // index_select and reshape recorded theirs
};
}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& index) { return op_detail::invoke<EmbeddingDef>({weight, index}); }

std::pair<Tensor, Tensor> sort(const Tensor& x, int64_t dim, bool descending) {
  return op_detail::invoke<op_detail::SortDef>({x, dim, descending});
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

namespace flame::op_detail {

IndexPrep IndexSelectDef::prepare(const Args& a) {
  const Tensor& x = a.x.get();
  check_defined(x, "index_select", "input");
  Prep p;
  p.idx = index_arg(a.index.get(), x, "index_select");
  FLAME_CHECK(p.idx.dim() <= 1, "index_select", "index must be 0-d or 1-d, got shape ", p.idx.sizes());
  p.d = wrap_dim(a.dim, x.dim(), "index_select");
  FLAME_CHECK(x.dim() > 0 || p.idx.numel() == 1, "index_select",
              "a 0-d input takes exactly one index, got ", p.idx.numel());
  p.shape = x.sizes();
  if (x.dim() > 0) p.shape[p.d] = p.idx.numel();
  check_not_empty_dim(at_least_1d(x), p.d, p.idx, "index_select");
  return p;
}

IndexResult IndexSelectDef::run(const Args& a, Prep& p) {
  Result r;
  r.out = make_empty(p.shape, a.x.get().dtype(), a.x.get().device(), "index_select");
  if (r.out.numel() > 0) {
    backend::backend_for(a.x.get().device()).index_select(at_least_1d(r.out), at_least_1d(a.x.get()), p.d, at_least_1d(p.idx));
  }
  return r;
}

IndexPrep GatherDef::prepare(const Args& a) {
  const Tensor& x = a.x.get();
  check_defined(x, "gather", "input");
  Prep p;
  p.idx = index_arg(a.index.get(), x, "gather");
  const Tensor& idx = p.idx;
  p.d = wrap_dim(a.dim, x.dim(), "gather");
  FLAME_CHECK(nonempty_dim(idx) == nonempty_dim(x), "gather",
              "index must have as many dims as the input: input ", x.sizes(), ", index ", idx.sizes());
  const Tensor x1 = at_least_1d(x), i1 = at_least_1d(idx);
  if (idx.numel() > 0) {
    for (int64_t k = 0; k < x1.dim(); ++k) {
      FLAME_CHECK(k == p.d || i1.size(k) <= x1.size(k), "gather", "index of shape ", idx.sizes(),
                  " is larger than the input of shape ", x.sizes(), " in dim ", k);
    }
  }
  check_not_empty_dim(x1, p.d, idx, "gather");
  return p;
}

IndexResult GatherDef::run(const Args& a, Prep& p) {
  Result r;
  r.out = make_empty(p.idx.sizes(), a.x.get().dtype(), a.x.get().device(), "gather");
  if (r.out.numel() > 0) {
    backend::backend_for(a.x.get().device()).gather(at_least_1d(r.out), at_least_1d(a.x.get()), p.d, at_least_1d(p.idx));
  }
  return r;
}

IndexPrep ScatterDef::prepare(const Args& a) {
  const Tensor &x = a.x, &src = a.src;
  const char* op = name(a);
  check_defined(x, op, "input");
  check_defined(src, op, "src");
  Prep p;
  p.idx = index_arg(a.index, x, op);
  const Tensor& idx = p.idx;
  check_same_device(op, x, src);
  FLAME_CHECK(src.dtype() == x.dtype(), op, "src dtype ", dtype_name(src.dtype()),
              " does not match the input's dtype ", dtype_name(x.dtype()));
  const int64_t d = p.d = wrap_dim(a.dim, x.dim(), op);
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
  return p;
}

IndexResult ScatterDef::run(const Args& a, Prep& p) {
  Result r;
  {
    NoGradGuard no_grad;  // the clone is an implementation detail; the scatter rule covers both inputs
    r.out = a.x.clone();
  }
  if (p.idx.numel() > 0) {
    backend::backend_for(a.x.device())
        .scatter(at_least_1d(r.out), p.d, at_least_1d(p.idx), at_least_1d(a.src), a.accumulate);
  }
  return r;
}

IndexPrep MaskedSelectDef::prepare(const Args& a) {
  const Tensor &x = a.x, &mask = a.mask;
  check_defined(x, "masked_select", "input");
  check_defined(mask, "masked_select", "mask");
  check_same_device("masked_select", x, mask);
  FLAME_CHECK(is_bool(mask.dtype()), "masked_select", "mask must be bool, got ", dtype_name(mask.dtype()));
  Prep p;
  p.shape = broadcast_shapes(x.sizes(), mask.sizes(), "masked_select");
  return p;
}

IndexResult MaskedSelectDef::run(const Args& a, Prep& p) {
  Result r;
  if (shape_numel(p.shape) == 0) {
    r.out = make_empty({0}, a.x.dtype(), a.x.device(), "masked_select");
    return r;
  }
  const Shape shape = p.shape.empty() ? Shape{1} : p.shape;  // kernels see >= 1 dim
  r.out = backend::backend_for(a.x.device()).masked_select(a.x.expand(shape), a.mask.expand(shape));
  return r;
}

IndexPrep SortDef::prepare(const Args& a) {
  check_defined(a.x, "sort", "input");
  Prep p;
  p.d = wrap_dim(a.dim, a.x.dim(), "sort");
  return p;
}

IndexResult SortDef::run(const Args& a, Prep& p) {
  const Tensor& x = a.x;
  Result r;
  r.out = make_empty(x.sizes(), x.dtype(), x.device(), "sort");
  r.indices = make_empty(x.sizes(), DType::i64, x.device(), "sort");
  if (x.numel() > 0) {
    backend::backend_for(x.device()).sort(at_least_1d(r.out), at_least_1d(r.indices), at_least_1d(x), p.d,
                                          a.descending);
  }
  return r;
}

}  // namespace flame::op_detail
