#include "flame/ops.h"
namespace flame {
Tensor flip(const Tensor& x, const Shape& dims) { FLAME_FAIL("flip", "not implemented"); }
Tensor repeat(const Tensor& x, const Shape& repeats) { FLAME_FAIL("repeat", "not implemented"); }
TensorList split(const Tensor& x, int64_t split_size, int64_t dim) { FLAME_FAIL("split", "not implemented"); }
TensorList split_with_sizes(const Tensor& x, const Shape& sizes, int64_t dim) { FLAME_FAIL("split_with_sizes", "not implemented"); }
TensorList chunk(const Tensor& x, int64_t chunks, int64_t dim) { FLAME_FAIL("chunk", "not implemented"); }
Tensor cat(const TensorList& tensors, int64_t dim) { FLAME_FAIL("cat", "not implemented"); }
Tensor stack(const TensorList& tensors, int64_t dim) { FLAME_FAIL("stack", "not implemented"); }
Tensor pad(const Tensor& x, const Shape& pads, PadMode mode, double value) { FLAME_FAIL("pad", "not implemented"); }
}
