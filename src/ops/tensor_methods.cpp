// Tensor's op methods forward to the free functions of ops.h. The plain forwarders are generated:
// the elementwise ones from the op table (flame/op_table.h, whose rows also declare them), the
// others from the lists of method_lists.h (each row must match a declaration in tensor.h: a
// missing one fails to compile); methods with defaults or renamed free functions are written out
// after them.
#include <cmath>

#include "flame/ops.h"
#include "src/ops/alpha.h"
#include "src/ops/method_lists.h"

namespace flame {

#define FLAME_DEFINE_UNARY_METHOD(name, Functor, kind, surface, ...) \
  FLAME_OPT_##surface(Tensor Tensor::name() const { return flame::name(*this); })
#define FLAME_DEFINE_BINARY_METHOD(name, Functor, kind, surface, ...) \
  FLAME_OPT_##surface(Tensor Tensor::name(const Tensor& o) const { return flame::name(*this, o); })
#define FLAME_DEFINE_MATMUL_METHOD(name) \
  Tensor Tensor::name(const Tensor& o) const { return flame::name(*this, o); }
#define FLAME_DEFINE_SCALAR_METHOD(name) \
  Tensor Tensor::name(Scalar s) const { return flame::name(*this, s); }
#define FLAME_DEFINE_REDUCTION_METHOD(method, fn) \
  Tensor Tensor::method(const Shape& dims, bool keepdim) const { return flame::fn(*this, dims, keepdim); }
FLAME_UNARY_OPS(FLAME_DEFINE_UNARY_METHOD)
FLAME_BINARY_OPS(FLAME_DEFINE_BINARY_METHOD)
FLAME_PLAIN_MATMUL_METHODS(FLAME_DEFINE_MATMUL_METHOD)
FLAME_PLAIN_SCALAR_METHODS(FLAME_DEFINE_SCALAR_METHOD)
FLAME_PLAIN_REDUCTION_METHODS(FLAME_DEFINE_REDUCTION_METHOD)
#undef FLAME_DEFINE_UNARY_METHOD
#undef FLAME_DEFINE_BINARY_METHOD
#undef FLAME_DEFINE_MATMUL_METHOD
#undef FLAME_DEFINE_SCALAR_METHOD
#undef FLAME_DEFINE_REDUCTION_METHOD

Tensor Tensor::flip(const Shape& dims) const { return flame::flip(*this, dims); }
Tensor Tensor::repeat(const Shape& repeats) const { return flame::repeat(*this, repeats); }
TensorList Tensor::split(int64_t split_size, int64_t dim) const { return flame::split(*this, split_size, dim); }
TensorList Tensor::split_with_sizes(const Shape& sizes, int64_t dim) const { return flame::split_with_sizes(*this, sizes, dim); }
TensorList Tensor::chunk(int64_t chunks, int64_t dim) const { return flame::chunk(*this, chunks, dim); }
Tensor Tensor::leaky_relu(double negative_slope) const { return flame::leaky_relu(*this, negative_slope); }
Tensor Tensor::gelu(bool tanh_approximation) const { return flame::gelu(*this, tanh_approximation); }
Tensor Tensor::softplus(double beta, double threshold) const { return flame::softplus(*this, beta, threshold); }
Tensor Tensor::elu(double alpha) const { return flame::elu(*this, alpha); }
Tensor Tensor::clamp(std::optional<Scalar> min, std::optional<Scalar> max) const { return flame::clamp(*this, min, max); }
Tensor Tensor::pow(Scalar exponent) const { return flame::pow(*this, exponent); }
Tensor Tensor::nan_to_num(double nan, std::optional<double> posinf, std::optional<double> neginf) const { return flame::nan_to_num(*this, nan, posinf, neginf); }
Tensor Tensor::masked_fill(const Tensor& mask, Scalar value) const { return flame::masked_fill(*this, mask, value); }
Tensor Tensor::argmax(std::optional<int64_t> dim, bool keepdim) const { return flame::argmax(*this, dim, keepdim); }
Tensor Tensor::argmin(std::optional<int64_t> dim, bool keepdim) const { return flame::argmin(*this, dim, keepdim); }
Tensor Tensor::var(const Shape& dims, int64_t correction, bool keepdim) const { return flame::var(*this, dims, correction, keepdim); }
Tensor Tensor::std(const Shape& dims, int64_t correction, bool keepdim) const { return flame::std(*this, dims, correction, keepdim); }
Tensor Tensor::norm(double p, const Shape& dims, bool keepdim) const { return flame::norm(*this, p, dims, keepdim); }
Tensor Tensor::cumsum(int64_t dim) const { return flame::cumsum(*this, dim); }
Tensor Tensor::softmax(int64_t dim) const { return flame::softmax(*this, dim); }
Tensor Tensor::log_softmax(int64_t dim) const { return flame::log_softmax(*this, dim); }
Tensor Tensor::index_select(int64_t dim, const Tensor& index) const { return flame::index_select(*this, dim, index); }
Tensor Tensor::gather(int64_t dim, const Tensor& index) const { return flame::gather(*this, dim, index); }
Tensor Tensor::scatter(int64_t dim, const Tensor& index, const Tensor& src) const { return flame::scatter(*this, dim, index, src); }
Tensor Tensor::scatter_add(int64_t dim, const Tensor& index, const Tensor& src) const { return flame::scatter_add(*this, dim, index, src); }
Tensor Tensor::masked_select(const Tensor& mask) const { return flame::masked_select(*this, mask); }
Tensor Tensor::take(const Tensor& index) const { return flame::take(*this, index); }
Tensor Tensor::triu(int64_t diagonal) const { return flame::triu(*this, diagonal); }
Tensor Tensor::tril(int64_t diagonal) const { return flame::tril(*this, diagonal); }
std::pair<Tensor, Tensor> Tensor::topk(int64_t k, int64_t dim, bool largest, bool sorted) const { return flame::topk(*this, k, dim, largest, sorted); }
std::pair<Tensor, Tensor> Tensor::sort(int64_t dim, bool descending) const { return flame::sort(*this, dim, descending); }
Tensor Tensor::argsort(int64_t dim, bool descending) const { return flame::argsort(*this, dim, descending); }
Tensor Tensor::sum_all() const { return flame::sum(*this); }
Tensor Tensor::mean_all() const {
  FLAME_CHECK(defined(), "mean_all", "called on an undefined tensor");
  FLAME_CHECK(is_floating(dtype()), "mean_all", "expected a floating input, got ", dtype_name(dtype()), " (shape ",
              sizes(), "); convert it first, e.g. x.to(DType::f32).mean_all()");
  return flame::mean(*this);
}
Tensor Tensor::max_all() const { return flame::amax(*this); }
Tensor Tensor::min_all() const { return flame::amin(*this); }

Tensor Tensor::max() const { return flame::amax(*this); }
Tensor Tensor::min() const { return flame::amin(*this); }

// ---- add/sub with alpha, composed from existing ops (no new kernel, gradients for free) ----
namespace {
bool is_unit(Scalar alpha) {
  return alpha.is_floating() ? alpha.to_double() == 1.0 : alpha.to_int() == 1;
}
}  // namespace

Tensor alpha_scaled(const char* op, const Tensor& a, const Tensor& b, Scalar alpha) {
  FLAME_CHECK(a.defined() && b.defined(), op, "got an undefined tensor");
  const DType common = result_type(a, b);
  FLAME_CHECK(is_floating(common) || !alpha.is_floating(), op, "alpha ", alpha.to_double(),
              " is floating but the result type of ", dtype_name(a.dtype()), " and ", dtype_name(b.dtype()),
              " is ", dtype_name(common));
  FLAME_CHECK(!is_bool(common) || alpha.is_bool(), op, "bool inputs take only a bool alpha, got ",
              alpha.to_double());
  if (is_unit(alpha)) return b;
  if (alpha.is_bool()) return zeros_like(b);  // false * b
  // Scale in the result type, so an integer b is not scaled (and wrapped) in its narrower type.
  return flame::mul_scalar(b.to(common), alpha);
}

Tensor add(const Tensor& a, const Tensor& b, Scalar alpha) {
  return flame::add(a, alpha_scaled("add", a, b, alpha));
}
Tensor sub(const Tensor& a, const Tensor& b, Scalar alpha) {
  FLAME_CHECK(!alpha.is_bool(), "sub", "a bool alpha is not supported");
  return flame::sub(a, alpha_scaled("sub", a, b, alpha));
}
Tensor Tensor::add(const Tensor& o, Scalar alpha) const { return flame::add(*this, o, alpha); }
Tensor Tensor::sub(const Tensor& o, Scalar alpha) const { return flame::sub(*this, o, alpha); }
Tensor& Tensor::sub_(const Tensor& o, Scalar alpha) {
  FLAME_CHECK(!alpha.is_bool(), "sub_", "a bool alpha is not supported");
  return sub_(alpha_scaled("sub_", *this, o, alpha));
}

Tensor Tensor::randn(const Shape& shape, TensorOptions opts, Generator* gen) {
  return randn(shape, 0.0, 1.0, opts, gen);
}

// ---- literal factory ----
Tensor Tensor::literal_from_host(const void* host, DType dtype, std::size_t count, const Shape& shape,
                                 TensorOptions opts, std::optional<DType> fallback) {
  const DType target = opts.dtype.value_or(fallback.value_or(dtype));
  // Convert on the host, then move: one upload of the final dtype.
  return from_blob_copy(host, dtype, count, shape).to(target).to(opts.device);
}
Tensor Tensor::cat_literal_planes(const TensorList& planes) {
  for (const Tensor& p : planes) {
    FLAME_CHECK(p.sizes() == planes[0].sizes(), "tensor", "ragged literal: a plane of shape ", p.sizes(),
                " where the first has ", planes[0].sizes());
  }
  return cat(planes, 0);
}

// ---- compound assignment on temporaries (views returned by narrow, select, ...) ----
Tensor operator+=(Tensor&& a, const Tensor& b) { return a.add_(b); }
Tensor operator-=(Tensor&& a, const Tensor& b) { return a.sub_(b); }
Tensor operator*=(Tensor&& a, const Tensor& b) { return a.mul_(b); }
Tensor operator/=(Tensor&& a, const Tensor& b) { return a.div_(b); }
Tensor operator+=(Tensor&& a, Scalar b) { return a.add_(b); }
Tensor operator-=(Tensor&& a, Scalar b) { return a.sub_(b); }
Tensor operator*=(Tensor&& a, Scalar b) { return a.mul_(b); }
Tensor operator/=(Tensor&& a, Scalar b) { return a.div_(b); }

// ---- comparison and logical operators ----
namespace {
// The dtype in which `x op s` is compared: x's own when floating (the scalar rounds to it, as
// PyTorch); otherwise one that holds both exactly (f64 for a floating scalar, i64 for an integer).
DType comparison_dtype(const Tensor& x, Scalar s) {
  if (is_floating(x.dtype())) return x.dtype();
  if (s.is_floating()) return DType::f64;
  if (s.is_bool() && is_bool(x.dtype())) return DType::boolean;
  return DType::i64;
}
template <class Op>
Tensor compare_scalar(const Tensor& x, Scalar s, const char* name, Op op) {
  FLAME_CHECK(x.defined(), name, "got an undefined tensor");
  const DType dt = comparison_dtype(x, s);
  return op(x.to(dt), Tensor::scalar(s, {dt, x.device()}));
}
void check_bool_operands(const char* op, const Tensor& a, const Tensor& b) {
  FLAME_CHECK(a.defined() && b.defined(), op, "got an undefined tensor");
  FLAME_CHECK(is_bool(a.dtype()) && is_bool(b.dtype()), op, "expects bool tensors, got ", dtype_name(a.dtype()),
              " and ", dtype_name(b.dtype()), " (bitwise ops on integers are not provided)");
}
}  // namespace

// a < s compares the tensor with the scalar; s < a is a > s (the mirrored comparison).
#define FLAME_MIRROR_eq eq
#define FLAME_MIRROR_ne ne
#define FLAME_MIRROR_lt gt
#define FLAME_MIRROR_le ge
#define FLAME_MIRROR_gt lt
#define FLAME_MIRROR_ge le
#define FLAME_CONCAT(a, b) a##b
#define FLAME_DEFINE_COMPARISON(op, name)                                                        \
  Tensor operator op(const Tensor& a, const Tensor& b) { return flame::name(a, b); }            \
  Tensor operator op(const Tensor& a, Scalar b) {                                               \
    return compare_scalar(a, b, "operator" #op,                                                 \
                          [](const Tensor& x, const Tensor& y) { return flame::name(x, y); });  \
  }                                                                                             \
  Tensor operator op(Scalar a, const Tensor& b) {                                               \
    return compare_scalar(b, a, "operator" #op, [](const Tensor& x, const Tensor& y) {          \
      return flame::FLAME_CONCAT(FLAME_MIRROR_, name)(x, y);                                    \
    });                                                                                         \
  }
FLAME_COMPARISON_OPERATORS(FLAME_DEFINE_COMPARISON)
#undef FLAME_DEFINE_COMPARISON

Tensor operator!(const Tensor& a) { return flame::logical_not(a); }
Tensor operator&(const Tensor& a, const Tensor& b) {
  check_bool_operands("operator&", a, b);
  return flame::logical_and(a, b);
}
Tensor operator|(const Tensor& a, const Tensor& b) {
  check_bool_operands("operator|", a, b);
  return flame::logical_or(a, b);
}
Tensor operator^(const Tensor& a, const Tensor& b) {
  check_bool_operands("operator^", a, b);
  return flame::ne(a, b);
}

}  // namespace flame
