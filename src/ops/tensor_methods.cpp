// Tensor's op methods forward to the free functions of ops.h (generated from tensor.h's list).
#include "flame/ops.h"

namespace flame {

Tensor Tensor::flip(const Shape& dims) const { return flame::flip(*this, dims); }
Tensor Tensor::repeat(const Shape& repeats) const { return flame::repeat(*this, repeats); }
TensorList Tensor::split(int64_t split_size, int64_t dim) const { return flame::split(*this, split_size, dim); }
TensorList Tensor::split_with_sizes(const Shape& sizes, int64_t dim) const { return flame::split_with_sizes(*this, sizes, dim); }
TensorList Tensor::chunk(int64_t chunks, int64_t dim) const { return flame::chunk(*this, chunks, dim); }
Tensor Tensor::neg() const { return flame::neg(*this); }
Tensor Tensor::abs() const { return flame::abs(*this); }
Tensor Tensor::sign() const { return flame::sign(*this); }
Tensor Tensor::exp() const { return flame::exp(*this); }
Tensor Tensor::log() const { return flame::log(*this); }
Tensor Tensor::log1p() const { return flame::log1p(*this); }
Tensor Tensor::expm1() const { return flame::expm1(*this); }
Tensor Tensor::sqrt() const { return flame::sqrt(*this); }
Tensor Tensor::rsqrt() const { return flame::rsqrt(*this); }
Tensor Tensor::square() const { return flame::square(*this); }
Tensor Tensor::reciprocal() const { return flame::reciprocal(*this); }
Tensor Tensor::sin() const { return flame::sin(*this); }
Tensor Tensor::cos() const { return flame::cos(*this); }
Tensor Tensor::tanh() const { return flame::tanh(*this); }
Tensor Tensor::sigmoid() const { return flame::sigmoid(*this); }
Tensor Tensor::relu() const { return flame::relu(*this); }
Tensor Tensor::leaky_relu(double negative_slope) const { return flame::leaky_relu(*this, negative_slope); }
Tensor Tensor::gelu(bool tanh_approximation) const { return flame::gelu(*this, tanh_approximation); }
Tensor Tensor::silu() const { return flame::silu(*this); }
Tensor Tensor::softplus(double beta, double threshold) const { return flame::softplus(*this, beta, threshold); }
Tensor Tensor::mish() const { return flame::mish(*this); }
Tensor Tensor::elu(double alpha) const { return flame::elu(*this, alpha); }
Tensor Tensor::floor() const { return flame::floor(*this); }
Tensor Tensor::ceil() const { return flame::ceil(*this); }
Tensor Tensor::round() const { return flame::round(*this); }
Tensor Tensor::trunc() const { return flame::trunc(*this); }
Tensor Tensor::clamp(std::optional<Scalar> min, std::optional<Scalar> max) const { return flame::clamp(*this, min, max); }
Tensor Tensor::pow(Scalar exponent) const { return flame::pow(*this, exponent); }
Tensor Tensor::isnan() const { return flame::isnan(*this); }
Tensor Tensor::isinf() const { return flame::isinf(*this); }
Tensor Tensor::nan_to_num(double nan, std::optional<double> posinf, std::optional<double> neginf) const { return flame::nan_to_num(*this, nan, posinf, neginf); }
Tensor Tensor::logical_not() const { return flame::logical_not(*this); }
Tensor Tensor::add(const Tensor& o) const { return flame::add(*this, o); }
Tensor Tensor::sub(const Tensor& o) const { return flame::sub(*this, o); }
Tensor Tensor::mul(const Tensor& o) const { return flame::mul(*this, o); }
Tensor Tensor::div(const Tensor& o) const { return flame::div(*this, o); }
Tensor Tensor::pow(const Tensor& o) const { return flame::pow(*this, o); }
Tensor Tensor::maximum(const Tensor& o) const { return flame::maximum(*this, o); }
Tensor Tensor::minimum(const Tensor& o) const { return flame::minimum(*this, o); }
Tensor Tensor::atan2(const Tensor& o) const { return flame::atan2(*this, o); }
Tensor Tensor::fmod(const Tensor& o) const { return flame::fmod(*this, o); }
Tensor Tensor::eq(const Tensor& o) const { return flame::eq(*this, o); }
Tensor Tensor::ne(const Tensor& o) const { return flame::ne(*this, o); }
Tensor Tensor::lt(const Tensor& o) const { return flame::lt(*this, o); }
Tensor Tensor::le(const Tensor& o) const { return flame::le(*this, o); }
Tensor Tensor::gt(const Tensor& o) const { return flame::gt(*this, o); }
Tensor Tensor::ge(const Tensor& o) const { return flame::ge(*this, o); }
Tensor Tensor::logical_and(const Tensor& o) const { return flame::logical_and(*this, o); }
Tensor Tensor::logical_or(const Tensor& o) const { return flame::logical_or(*this, o); }
Tensor Tensor::add_scalar(Scalar s) const { return flame::add_scalar(*this, s); }
Tensor Tensor::sub_scalar(Scalar s) const { return flame::sub_scalar(*this, s); }
Tensor Tensor::mul_scalar(Scalar s) const { return flame::mul_scalar(*this, s); }
Tensor Tensor::div_scalar(Scalar s) const { return flame::div_scalar(*this, s); }
Tensor Tensor::masked_fill(const Tensor& mask, Scalar value) const { return flame::masked_fill(*this, mask, value); }
Tensor Tensor::sum(const Shape& dims, bool keepdim) const { return flame::sum(*this, dims, keepdim); }
Tensor Tensor::mean(const Shape& dims, bool keepdim) const { return flame::mean(*this, dims, keepdim); }
Tensor Tensor::prod(const Shape& dims, bool keepdim) const { return flame::prod(*this, dims, keepdim); }
Tensor Tensor::max(const Shape& dims, bool keepdim) const { return flame::amax(*this, dims, keepdim); }
Tensor Tensor::min(const Shape& dims, bool keepdim) const { return flame::amin(*this, dims, keepdim); }
Tensor Tensor::argmax(std::optional<int64_t> dim, bool keepdim) const { return flame::argmax(*this, dim, keepdim); }
Tensor Tensor::argmin(std::optional<int64_t> dim, bool keepdim) const { return flame::argmin(*this, dim, keepdim); }
Tensor Tensor::var(const Shape& dims, int64_t correction, bool keepdim) const { return flame::var(*this, dims, correction, keepdim); }
Tensor Tensor::std(const Shape& dims, int64_t correction, bool keepdim) const { return flame::std(*this, dims, correction, keepdim); }
Tensor Tensor::norm(double p, const Shape& dims, bool keepdim) const { return flame::norm(*this, p, dims, keepdim); }
Tensor Tensor::logsumexp(const Shape& dims, bool keepdim) const { return flame::logsumexp(*this, dims, keepdim); }
Tensor Tensor::any(const Shape& dims, bool keepdim) const { return flame::any(*this, dims, keepdim); }
Tensor Tensor::all(const Shape& dims, bool keepdim) const { return flame::all(*this, dims, keepdim); }
Tensor Tensor::cumsum(int64_t dim) const { return flame::cumsum(*this, dim); }
Tensor Tensor::softmax(int64_t dim) const { return flame::softmax(*this, dim); }
Tensor Tensor::log_softmax(int64_t dim) const { return flame::log_softmax(*this, dim); }
Tensor Tensor::matmul(const Tensor& o) const { return flame::matmul(*this, o); }
Tensor Tensor::bmm(const Tensor& o) const { return flame::bmm(*this, o); }
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
Tensor Tensor::mean_all() const { return flame::mean(*this); }
Tensor Tensor::max_all() const { return flame::amax(*this); }
Tensor Tensor::min_all() const { return flame::amin(*this); }

}  // namespace flame
