#include "flame/ops.h"
namespace flame {
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) { FLAME_FAIL("index_select", "not implemented"); }
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) { FLAME_FAIL("gather", "not implemented"); }
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) { FLAME_FAIL("scatter", "not implemented"); }
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) { FLAME_FAIL("scatter_add", "not implemented"); }
Tensor masked_select(const Tensor& x, const Tensor& mask) { FLAME_FAIL("masked_select", "not implemented"); }
Tensor take(const Tensor& x, const Tensor& index) { FLAME_FAIL("take", "not implemented"); }
Tensor triu(const Tensor& x, int64_t diagonal) { FLAME_FAIL("triu", "not implemented"); }
Tensor tril(const Tensor& x, int64_t diagonal) { FLAME_FAIL("tril", "not implemented"); }
Tensor one_hot(const Tensor& index, int64_t num_classes) { FLAME_FAIL("one_hot", "not implemented"); }
Tensor embedding(const Tensor& weight, const Tensor& index) { FLAME_FAIL("embedding", "not implemented"); }
std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k, int64_t dim, bool largest,
                               bool sorted) { FLAME_FAIL("topk", "not implemented"); }
std::pair<Tensor, Tensor> sort(const Tensor& x, int64_t dim, bool descending) { FLAME_FAIL("sort", "not implemented"); }
Tensor argsort(const Tensor& x, int64_t dim, bool descending) { FLAME_FAIL("argsort", "not implemented"); }
}
