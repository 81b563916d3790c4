#include "flame/ops.h"
namespace flame {
Tensor sum(const Tensor& x, const Shape& dims, bool keepdim) { FLAME_FAIL("sum", "not implemented"); }
Tensor mean(const Tensor& x, const Shape& dims, bool keepdim) { FLAME_FAIL("mean", "not implemented"); }
Tensor prod(const Tensor& x, const Shape& dims, bool keepdim) { FLAME_FAIL("prod", "not implemented"); }
Tensor amax(const Tensor& x, const Shape& dims, bool keepdim) { FLAME_FAIL("amax", "not implemented"); }
Tensor amin(const Tensor& x, const Shape& dims, bool keepdim) { FLAME_FAIL("amin", "not implemented"); }
Tensor argmax(const Tensor& x, std::optional<int64_t> dim, bool keepdim) { FLAME_FAIL("argmax", "not implemented"); }
Tensor argmin(const Tensor& x, std::optional<int64_t> dim, bool keepdim) { FLAME_FAIL("argmin", "not implemented"); }
Tensor var(const Tensor& x, const Shape& dims, int64_t correction, bool keepdim) { FLAME_FAIL("var", "not implemented"); }
Tensor std(const Tensor& x, const Shape& dims, int64_t correction, bool keepdim) { FLAME_FAIL("std", "not implemented"); }
Tensor norm(const Tensor& x, double p, const Shape& dims, bool keepdim) { FLAME_FAIL("norm", "not implemented"); }
Tensor logsumexp(const Tensor& x, const Shape& dims, bool keepdim) { FLAME_FAIL("logsumexp", "not implemented"); }
Tensor any(const Tensor& x, const Shape& dims, bool keepdim) { FLAME_FAIL("any", "not implemented"); }
Tensor all(const Tensor& x, const Shape& dims, bool keepdim) { FLAME_FAIL("all", "not implemented"); }
Tensor cumsum(const Tensor& x, int64_t dim) { FLAME_FAIL("cumsum", "not implemented"); }
Tensor softmax(const Tensor& x, int64_t dim) { FLAME_FAIL("softmax", "not implemented"); }
Tensor log_softmax(const Tensor& x, int64_t dim) { FLAME_FAIL("log_softmax", "not implemented"); }
}
