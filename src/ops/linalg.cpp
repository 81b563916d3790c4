// Linear algebra ops: matmul (torch.matmul semantics), bmm, outer.
//
// Note [Matmul lowering]
// Every product is lowered to the backend kernel dst[B, M, N] = a[B, M, K] @ b[B, K, N] (Note
// [Backend seam]) without copying operands: 1-d operands become [1, K] / [K, 1] views, batch dims
// broadcast through expand (batch stride 0), and transposed or sliced operands stay strided views
// (the kernel decides whether it can use their strides). Batch dims are merged into the kernel's
// single batch dim where the strides of both operands allow it; dims that cannot be merged are
// looped here, one kernel call per outer index. When only `a` has batch dims and they merge with
// its rows, the whole product is one [batch*M, K] x [K, N] GEMM (the nn.Linear case). Empty
// results skip the kernel and K = 0 gives zeros, so kernels only see M, N, K, B >= 1.
//
// Note [Matmul batch copies]
// The loop is the exception worth avoiding: per-head views of a packed projection (q of
// qkv.view(B, L, 3, H, D).select(2, 0).transpose(1, 2): strides (L*3HD, D, 3HD, 1)) have batch dims
// B and H that do not merge, and B small GEMMs of H heads each underfill the GPU and pay a launch
// each (an f32 math-path attention spent 4.5 ms of a 35 ms step in 384 such calls where one call
// per product would do). So when dims are left to loop, an operand whose own batch dims do not
// merge is copied to contiguous memory first, the way PyTorch's matmul reshapes, provided the
// copies are small beside the calls they save (at most kCopyBytesPerSavedCall per saved call, a
// few microseconds of copy bandwidth against a launch and an underfilled GEMM) and the operand is
// not broadcast along a batch dim (a copy would materialise the broadcast). Large GEMMs keep the
// loop: their calls fill the GPU and a copy would only add traffic.
#include <optional>

#include "flame/grad_mode.h"
#include "flame/ops.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"
#include "src/ops/linalg_def.h"

namespace flame {
namespace {

void check_operands(const char* op, const Tensor& a, const Tensor& b) {
  FLAME_CHECK(a.defined() && b.defined(), op, "got an undefined tensor");
  check_same_device(op, a, b);
  FLAME_CHECK(a.dtype() == b.dtype(), op, "expected both operands to have the same dtype, got ",
              dtype_name(a.dtype()), " and ", dtype_name(b.dtype()), " (shapes ", a.sizes(), " and ",
              b.sizes(), ")");
  FLAME_CHECK(!is_bool(a.dtype()), op, "not supported for bool tensors (shapes ", a.sizes(), " and ",
              b.sizes(), ")");
}

// The single stride of dims [begin, end) of (sizes, strides) seen as one dim, if they merge.
// Size-1 dims never prevent merging.
std::optional<int64_t> merged_stride(const Shape& sizes, const Shape& strides, std::size_t begin,
                                     std::size_t end) {
  std::optional<int64_t> inner;  // stride of the innermost non-trivial dim seen so far
  int64_t inner_extent = 1;      // product of sizes from that dim inwards
  for (std::size_t d = end; d-- > begin;) {
    if (sizes[d] == 1) continue;
    if (inner && strides[d] != *inner * inner_extent) return std::nullopt;
    if (!inner) inner = strides[d];
    inner_extent *= sizes[d];
  }
  return inner.value_or(1);
}

// Note [Matmul batch copies]: copying an operand is worth it while it moves at most this many bytes
// per kernel call it saves.
constexpr int64_t kCopyBytesPerSavedCall = int64_t{8} << 20;

// dst[batch..., M, N] = a[batch..., M, K] @ b[batch..., K, N]; a and b are already expanded to the
// batch shape. See Note [Matmul lowering].
Tensor batched_matmul(const Tensor& a, const Tensor& b, const Shape& batch, int64_t m, int64_t k, int64_t n) {
  Shape out_shape = batch;
  out_shape.push_back(m);
  out_shape.push_back(n);
  Tensor out = make_empty(out_shape, a.dtype(), a.device(), "matmul");
  if (out.numel() == 0) return out;
  backend::Backend& be = backend::backend_for(a.device());
  if (k == 0) {
    be.fill(out, 0);
    return out;
  }
  const std::size_t nb = batch.size();
  // Batch dims of size > 1, outermost first.
  std::vector<std::size_t> dims;
  for (std::size_t d = 0; d < nb; ++d)
    if (batch[d] != 1) dims.push_back(d);
  // The innermost run of dims that merges for both operands becomes the kernel's batch dim.
  auto merges = [&](std::size_t outer, std::size_t inner) {
    for (const Tensor* t : {&a, &b}) {
      if (t->stride(outer) != t->stride(inner) * batch[inner]) return false;
    }
    return true;
  };
  std::size_t run_begin = dims.size();  // index into dims
  if (!dims.empty()) {
    run_begin = dims.size() - 1;
    while (run_begin > 0 && merges(dims[run_begin - 1], dims[run_begin])) --run_begin;
  }
  if (run_begin > 0) {  // Note [Matmul batch copies]
    int64_t calls = 1;
    for (std::size_t i = 0; i < run_begin; ++i) calls *= batch[dims[i]];
    auto self_merges = [&](const Tensor& t) { return merged_stride(t.sizes(), t.strides(), 0, nb).has_value(); };
    auto broadcast = [&](const Tensor& t) {
      for (std::size_t d : dims)
        if (t.stride(static_cast<int64_t>(d)) == 0) return true;
      return false;
    };
    const bool copy_a = !self_merges(a) && !broadcast(a), copy_b = !self_merges(b) && !broadcast(b);
    const int64_t bytes = static_cast<int64_t>((copy_a ? a.nbytes() : 0) + (copy_b ? b.nbytes() : 0));
    if ((copy_a || copy_b) && bytes <= (calls - 1) * kCopyBytesPerSavedCall) {
      return batched_matmul(copy_a ? a.contiguous() : a, copy_b ? b.contiguous() : b, batch, m, k, n);
    }
  }
  int64_t inner_batch = 1, a_bstride = 0, b_bstride = 0;
  if (run_begin < dims.size()) {
    for (std::size_t i = run_begin; i < dims.size(); ++i) inner_batch *= batch[dims[i]];
    a_bstride = a.stride(dims.back());
    b_bstride = b.stride(dims.back());
  }
  const std::vector<std::size_t> outer(dims.begin(), dims.begin() + static_cast<std::ptrdiff_t>(run_begin));
  const int64_t nd = static_cast<int64_t>(nb);
  const Shape a_strides{a_bstride, a.stride(nd), a.stride(nd + 1)};
  const Shape b_strides{b_bstride, b.stride(nd), b.stride(nd + 1)};
  const Shape dst_strides{m * n, n, 1};
  // Odometer over the outer (unmerged) dims; usually there are none and this runs once.
  std::vector<int64_t> idx(outer.size(), 0);
  int64_t a_off = a.storage_offset(), b_off = b.storage_offset(), dst_off = 0;
  const int64_t dst_chunk = inner_batch * m * n;
  while (true) {
    be.matmul(make_view(out, {inner_batch, m, n}, dst_strides, dst_off),
              make_view(a, {inner_batch, m, k}, a_strides, a_off),
              make_view(b, {inner_batch, k, n}, b_strides, b_off));
    dst_off += dst_chunk;
    std::size_t i = outer.size();
    for (; i-- > 0;) {
      const std::size_t d = outer[i];
      a_off += a.stride(static_cast<int64_t>(d));
      b_off += b.stride(static_cast<int64_t>(d));
      if (++idx[i] < batch[d]) break;
      a_off -= a.stride(static_cast<int64_t>(d)) * batch[d];
      b_off -= b.stride(static_cast<int64_t>(d)) * batch[d];
      idx[i] = 0;
    }
    if (i == static_cast<std::size_t>(-1)) break;
  }
  return out;
}

}  // namespace

namespace {
Tensor matmul_impl(const Tensor& a, const Tensor& b) {
  check_operands("matmul", a, b);
  FLAME_CHECK(a.dim() >= 1 && b.dim() >= 1, "matmul", "both operands need at least 1 dim, got shapes ",
              a.sizes(), " and ", b.sizes());
  const bool a_vec = a.dim() == 1, b_vec = b.dim() == 1;
  const Tensor a2 = a_vec ? a.unsqueeze(0) : a;   // [K] -> [1, K]
  const Tensor b2 = b_vec ? b.unsqueeze(-1) : b;  // [K] -> [K, 1]
  const int64_t m = a2.size(-2), k = a2.size(-1), n = b2.size(-1);
  FLAME_CHECK(b2.size(-2) == k, "matmul", "shapes ", a.sizes(), " and ", b.sizes(),
              " cannot be multiplied (inner sizes ", k, " and ", b2.size(-2), " differ)");
  const Shape a_batch(a2.sizes().begin(), a2.sizes().end() - 2);
  const Shape b_batch(b2.sizes().begin(), b2.sizes().end() - 2);

  // The final shape: broadcast batch, then M unless a was 1-d, then N unless b was 1-d.
  const Shape batch = broadcast_shapes(a_batch, b_batch, "matmul");
  Shape result_shape = batch;
  if (!a_vec) result_shape.push_back(m);
  if (!b_vec) result_shape.push_back(n);

  Tensor out;
  std::optional<int64_t> row_stride;
  if (!a_batch.empty() && b_batch.empty()) row_stride = merged_stride(a2.sizes(), a2.strides(), 0, a_batch.size() + 1);
  if (row_stride) {
    // Fold a's batch dims into its rows: one [batch*M, K] x [K, N] product.
    const int64_t rows = shape_numel(a_batch) * m;
    const Tensor a_rows = make_view(a2, {rows, k}, {*row_stride, a2.stride(-1)}, a2.storage_offset());
    out = batched_matmul(a_rows, b2, {}, rows, k, n);
  } else {
    Shape a_full = batch, b_full = batch;
    a_full.insert(a_full.end(), {m, k});
    b_full.insert(b_full.end(), {k, n});
    out = batched_matmul(a2.expand(a_full), b2.expand(b_full), batch, m, k, n);
  }
  return out.view(result_shape);
}
}  // namespace

}  // namespace flame

namespace flame::op_detail {

MatmulDef::Prep MatmulDef::prepare(const Args& x) {
  const Tensor &a = x.a, &b = x.b;
  if (x.op[0] == 'b') {  // bmm
    check_operands("bmm", a, b);
    FLAME_CHECK(a.dim() == 3 && b.dim() == 3, "bmm", "expected 3-d operands, got shapes ", a.sizes(), " and ",
                b.sizes());
    FLAME_CHECK(a.size(0) == b.size(0), "bmm", "batch sizes differ: shapes ", a.sizes(), " and ", b.sizes());
    FLAME_CHECK(a.size(2) == b.size(1), "bmm", "shapes ", a.sizes(), " and ", b.sizes(),
                " cannot be multiplied (inner sizes ", a.size(2), " and ", b.size(1), " differ)");
  }
  return {};  // matmul's checks are its shape logic's (matmul_impl)
}

// The kernels run without recording; one node covers the whole product (record: rules/linalg.cpp).
MatmulDef::Result MatmulDef::run(const Args& x, Prep&) {
  NoGradGuard no_grad;
  const Tensor &a = x.a, &b = x.b;
  if (x.op[0] == 'b') return {batched_matmul(a, b, {a.size(0)}, a.size(1), a.size(2), b.size(2))};
  return {matmul_impl(a, b)};
}

}  // namespace flame::op_detail

namespace flame {

Tensor matmul(const Tensor& a, const Tensor& b) { return op_detail::invoke<op_detail::MatmulDef>({"matmul", a, b}); }

Tensor bmm(const Tensor& a, const Tensor& b) { return op_detail::invoke<op_detail::MatmulDef>({"bmm", a, b}); }

Tensor outer(const Tensor& a, const Tensor& b) {
  FLAME_CHECK(a.defined() && b.defined(), "outer", "got an undefined tensor");
  FLAME_CHECK(a.dim() == 1 && b.dim() == 1, "outer", "expected 1-d operands, got shapes ", a.sizes(), " and ",
              b.sizes());
  // An elementwise product: exact, type-promoting and differentiable like mul.
  return mul(a.unsqueeze(1), b.unsqueeze(0));
}

}  // namespace flame
