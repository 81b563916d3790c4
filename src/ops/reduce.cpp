// Reductions: dim handling, dtype rules, the backend reductions (sum, mean, prod, amax, amin,
// argmax, argmin, any, all, cumsum, softmax) and the composites written with other ops (var, std,
// norm, logsumexp), which every backend gets for free.
//
// Note [Reduce dims]
// Empty dims means all dims; negative dims wrap; a repeated or out-of-range dim is an error naming
// the op. A 0-d input accepts dims {}, {0} and {-1}. The op layer permutes the reduced dims to the
// end of a zero-copy view and asks the backend for a fresh contiguous result holding the kept dims
// only (Backend::reduce); keepdim is then a view of that result with size-1 dims put back.
//
// Note [Reduce dtypes]
// As PyTorch: sum/prod/cumsum of integers or bool give i64, floats keep their dtype; amax/amin keep
// the dtype; argmax/argmin give i64; any/all give bool; mean, var, std, norm, logsumexp, softmax and
// log_softmax need a floating input. The composites run bf16/f16 inputs in f32 and round once at the
// end, as the kernels accumulate half types in float or wider.
#include <algorithm>
#include <cmath>

#include "flame/ops.h"
#include "src/ops/autocast_hooks.h"
#include "src/backend/backend.h"
#include "src/core/tensor_impl.h"
#include "src/ops/reduce_def.h"

namespace flame {
using backend::ReduceOp;

namespace {

using op_detail::ReducePlan;

void check_defined(const Tensor& x, const char* op) { FLAME_CHECK(x.defined(), op, "got an undefined tensor"); }

void check_floating(const Tensor& x, const char* op) {
  check_defined(x, op);
  FLAME_CHECK(is_floating(x.dtype()), op, "expected a floating input, got ", dtype_name(x.dtype()),
              " (shape ", x.sizes(), ")");
}

ReducePlan plan_reduce(const Tensor& x, const Shape& dims, const char* op) {
  check_defined(x, op);
  const int64_t n = x.dim();
  std::vector<bool> reduced(static_cast<std::size_t>(std::max<int64_t>(n, 1)), dims.empty());
  std::vector<bool> seen(reduced.size(), false);
  for (int64_t d : dims) {
    const int64_t w = wrap_dim(d, n, op);
    FLAME_CHECK(!seen[w], op, "dim ", w, " appears more than once in dims ", dims);
    seen[w] = true;
    reduced[w] = true;
  }
  ReducePlan p;
  Shape tail;
  for (int64_t d = 0; d < n; ++d) {
    const int64_t size = x.sizes()[d];
    if (reduced[d]) {
      tail.push_back(d);
      p.keep_shape.push_back(1);
      p.count *= size;
      if (size == 0 && p.zero_dim < 0) p.zero_dim = d;
    } else {
      p.perm.push_back(d);
      p.out_shape.push_back(size);
      p.keep_shape.push_back(size);
    }
  }
  p.reduce_ndim = static_cast<int64_t>(tail.size());
  p.perm.insert(p.perm.end(), tail.begin(), tail.end());
  return p;
}

// max/min/argmax/argmin have no identity, so an empty reduced extent cannot give a value.
void check_nonzero_extent(const Tensor& x, const ReducePlan& p, const char* op) {
  FLAME_CHECK(p.zero_dim < 0, op, "cannot reduce over dim ", p.zero_dim, " of size 0 (input shape ", x.sizes(),
              "): the operation has no identity");
}

Tensor run_reduce(ReduceOp op, const Tensor& x, const ReducePlan& p, DType out_dtype, bool keepdim) {
  return op_detail::invoke<op_detail::ReduceDef>({op, x, &p, out_dtype, keepdim});
}

DType sum_dtype(DType t) { return is_floating(t) ? t : DType::i64; }

// Note [Reduction definitions]
// The public reductions (sum, mean, prod, amax, amin, argmax, argmin, any, all) are one op
// definition (Note [Invoke]): their dims and dtype rules and checks (prepare), the autocast policy
// (sum and prod in f32, as PyTorch), an opaque step of a flame::compile trace. The kernel call,
// with the gradient rule, is the internal ReduceDef over the plan made here.
struct ReductionCall {
  ReduceOp op = ReduceOp::sum;
  op_detail::Kept<Tensor> x;
  op_detail::Kept<Shape> dims;  // empty: every dim
  bool keepdim = false;
  const char* name = "sum";
};
struct ReductionDef : op_detail::OpDefaults<ReductionCall> {
  struct Prep {
    ReducePlan plan;
    DType out = DType::f32;
  };
  struct Result {
    Tensor out;
  };
  using Out = Tensor;
  static op_detail::Autocast autocast_of(const Args& a) {
    return a.op == ReduceOp::sum || a.op == ReduceOp::prod ? op_detail::Autocast::f32 : op_detail::Autocast::none;
  }
  static const char* name(const Args& a) { return a.name; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.x.set(in[0]);
    a.dims.keep();
    return a;
  }
  static Prep prepare(const Args& a) {
    if (a.op == ReduceOp::mean) check_floating(a.x.get(), a.name);
    Prep p{plan_reduce(a.x.get(), a.dims.get(), a.name)};
    switch (a.op) {
      case ReduceOp::sum:
      case ReduceOp::prod: p.out = sum_dtype(a.x.get().dtype()); break;
      case ReduceOp::mean: p.out = a.x.get().dtype(); break;
      case ReduceOp::max:
      case ReduceOp::min:
        check_nonzero_extent(a.x.get(), p.plan, a.name);
        p.out = a.x.get().dtype();
        break;
      case ReduceOp::argmax:
      case ReduceOp::argmin:
        check_nonzero_extent(a.x.get(), p.plan, a.name);
        p.out = DType::i64;
        break;
      case ReduceOp::any:
      case ReduceOp::all: p.out = DType::boolean; break;
    }
    return p;
  }
  static Result run(const Args& a, Prep& p) { return {run_reduce(a.op, a.x.get(), p.plan, p.out, a.keepdim)}; }
  static void record(Result&, const Args&, const Prep&) {}  // ReduceDef, inside run, recorded the node
};

Tensor reduction(ReduceOp op, const Tensor& x, const Shape& dims, bool keepdim, const char* name) {
  return op_detail::invoke<ReductionDef>({op, x, dims, keepdim, name});
}

Tensor arg_reduce(ReduceOp op, const Tensor& x, std::optional<int64_t> dim, bool keepdim, const char* name) {
  // dim = nullopt reduces every dim in row-major order: the index is into the flattened tensor.
  return reduction(op, x, dim ? Shape{*dim} : Shape{}, keepdim, name);
}

// See Note [Reduce dtypes]: half inputs compute in f32.
Tensor upcast(const Tensor& x) {
  return x.dtype() == DType::bf16 || x.dtype() == DType::f16 ? x.to(DType::f32) : x;
}

Tensor variance(const Tensor& xf, const Shape& dims, int64_t correction, bool keepdim, const ReducePlan& p) {
  // Divisor max(0, N - correction), as PyTorch: a non-positive one gives inf or nan, not an error.
  const double divisor = std::max(0.0, static_cast<double>(p.count) - static_cast<double>(correction));
  const Tensor centered = xf - mean(xf, dims, /*keepdim=*/true);
  return sum(square(centered), dims, keepdim) / divisor;
}

}  // namespace

Tensor sum(const Tensor& x, const Shape& dims, bool keepdim) { return reduction(ReduceOp::sum, x, dims, keepdim, "sum"); }

Tensor mean(const Tensor& x, const Shape& dims, bool keepdim) {
  return reduction(ReduceOp::mean, x, dims, keepdim, "mean");
}

Tensor prod(const Tensor& x, const Shape& dims, bool keepdim) {
  return reduction(ReduceOp::prod, x, dims, keepdim, "prod");
}

Tensor amax(const Tensor& x, const Shape& dims, bool keepdim) {
  return reduction(ReduceOp::max, x, dims, keepdim, "amax");
}

Tensor amin(const Tensor& x, const Shape& dims, bool keepdim) {
  return reduction(ReduceOp::min, x, dims, keepdim, "amin");
}

Tensor argmax(const Tensor& x, std::optional<int64_t> dim, bool keepdim) {
  return arg_reduce(ReduceOp::argmax, x, dim, keepdim, "argmax");
}

Tensor argmin(const Tensor& x, std::optional<int64_t> dim, bool keepdim) {
  return arg_reduce(ReduceOp::argmin, x, dim, keepdim, "argmin");
}

Tensor any(const Tensor& x, const Shape& dims, bool keepdim) { return reduction(ReduceOp::any, x, dims, keepdim, "any"); }

Tensor all(const Tensor& x, const Shape& dims, bool keepdim) { return reduction(ReduceOp::all, x, dims, keepdim, "all"); }

Tensor var(const Tensor& x, const Shape& dims, int64_t correction, bool keepdim) {
  check_floating(x, "var");
  const ReducePlan p = plan_reduce(x, dims, "var");
  return variance(upcast(x), dims, correction, keepdim, p).to(x.dtype());
}

Tensor std(const Tensor& x, const Shape& dims, int64_t correction, bool keepdim) {
  check_floating(x, "std");
  const ReducePlan p = plan_reduce(x, dims, "std");
  return sqrt(variance(upcast(x), dims, correction, keepdim, p)).to(x.dtype());
}

Tensor norm(const Tensor& x, double p, const Shape& dims, bool keepdim) {
  if (amp::detail::should_autocast(x)) {  // Note [Autocast policy]: f32
    amp::detail::AutocastOpScope scope;
    return norm(amp::detail::cast_f32(x), p, dims, keepdim);
  }
  check_floating(x, "norm");
  const ReducePlan plan = plan_reduce(x, dims, "norm");
  const Tensor xf = upcast(x);
  Tensor r;
  if (std::isinf(p)) {
    check_nonzero_extent(x, plan, "norm");  // max/min |x| of nothing is undefined
    r = p > 0 ? amax(abs(xf), dims, keepdim) : amin(abs(xf), dims, keepdim);
  } else if (p == 0.0) {
    const Tensor zero = Tensor::scalar(0.0, {xf.dtype(), xf.device()});
    r = sum(ne(xf, zero).to(xf.dtype()), dims, keepdim);
  } else if (p == 1.0) {
    r = sum(abs(xf), dims, keepdim);
  } else if (p == 2.0) {
    r = sqrt(sum(square(xf), dims, keepdim));
  } else {
    r = pow(sum(pow(abs(xf), Scalar(p)), dims, keepdim), Scalar(1.0 / p));
  }
  return r.to(x.dtype());
}

Tensor logsumexp(const Tensor& x, const Shape& dims, bool keepdim) {
  if (amp::detail::should_autocast(x)) {  // Note [Autocast policy]: f32
    amp::detail::AutocastOpScope scope;
    return logsumexp(amp::detail::cast_f32(x), dims, keepdim);
  }
  check_floating(x, "logsumexp");
  const ReducePlan p = plan_reduce(x, dims, "logsumexp");
  const Tensor xf = upcast(x);
  Tensor r;
  if (xf.numel() == 0) {
    r = log(sum(exp(xf), dims, keepdim));  // an empty extent gives log(0) = -inf
  } else {
    // Subtract the max for stability; an infinite max is replaced by 0 so that a row of -inf
    // gives -inf (not nan) and a +inf entry gives +inf.
    Tensor m = amax(xf, dims, /*keepdim=*/true).detach();  // a constant shift: no gradient through it
    m = masked_fill(m, isinf(m), 0.0);
    r = log(sum(exp(xf - m), dims, /*keepdim=*/true)) + m;
    if (!keepdim) r = r.view(p.out_shape);
  }
  return r.to(x.dtype());
}

Tensor cumsum(const Tensor& x, int64_t dim) { return op_detail::invoke<op_detail::CumsumDef>({"cumsum", x, dim}); }

Tensor softmax(const Tensor& x, int64_t dim) {
  return op_detail::invoke<op_detail::SoftmaxDef>({"softmax", x, dim});
}
Tensor log_softmax(const Tensor& x, int64_t dim) {
  return op_detail::invoke<op_detail::SoftmaxDef>({"log_softmax", x, dim});
}

}  // namespace flame

namespace flame::op_detail {

ReduceDef::Result ReduceDef::run(const Args& a, Prep&) {
  const ReducePlan& p = *a.plan;
  Result r;
  r.out = make_empty(p.out_shape, a.out_dtype, a.x.device());
  if (r.out.numel() > 0) backend::backend_for(a.x.device()).reduce(a.op, r.out, a.x.permute(p.perm), p.reduce_ndim);
  return r;
}

// Softmax-family ops run on a 1-d view of a 0-d input so the kernels always see a dim.
SoftmaxDef::Prep SoftmaxDef::prepare(const Args& a) {
  check_floating(a.x, a.op);
  return {wrap_dim(a.dim, a.x.dim(), a.op)};
}

SoftmaxDef::Result SoftmaxDef::run(const Args& a, Prep& p) {
  const Tensor& x = a.x;
  Result r;
  r.out = make_empty(x.sizes(), x.dtype(), x.device());
  if (r.out.numel() == 0) return r;
  auto& be = backend::backend_for(x.device());
  if (x.dim() == 0) {
    be.softmax(r.out.view({1}), x.reshape({1}), 0, SoftmaxDef::log(a));
  } else {
    be.softmax(r.out, x, p.dim, SoftmaxDef::log(a));
  }
  return r;
}

CumsumDef::Prep CumsumDef::prepare(const Args& a) {
  check_defined(a.x, "cumsum");
  return {wrap_dim(a.dim, a.x.dim(), "cumsum")};
}

CumsumDef::Result CumsumDef::run(const Args& a, Prep& p) {
  const Tensor& x = a.x;
  Result r;
  r.out = make_empty(x.sizes(), sum_dtype(x.dtype()), x.device());
  if (r.out.numel() > 0) {
    auto& be = backend::backend_for(x.device());
    if (x.dim() == 0) {
      be.cumsum(r.out.view({1}), x.reshape({1}), 0);
    } else {
      be.cumsum(r.out, x, p.dim);
    }
  }
  return r;
}

}  // namespace flame::op_detail
