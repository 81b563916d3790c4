// Dense channels-last layouts (Note [Conv layouts] in src/ops/conv.cpp): which tensors have one and
// fresh tensors in one. Core: the conv ops and the cuDNN backend both read them.
#include "src/core/memory_format.h"

#include <algorithm>

#include "src/core/tensor_impl.h"

namespace flame::conv_detail {

namespace {
// The permutation [N, C, *sp] -> [N, *sp, C].
Shape to_last_perm(int64_t nd) {
  Shape p{0};
  for (int64_t d = 2; d < nd; ++d) p.push_back(d);
  p.push_back(1);
  return p;
}
}  // namespace

// Strides of a dense channels-last tensor (true also for some contiguous ones, e.g. C == 1).
bool dense_channels_last(const Tensor& t) {
  const int64_t nd = t.dim();
  if (nd < 4 || nd > 5) return false;
  // Dense with C innermost, then the spatial dims, then N; size-1 dims may have any stride.
  const Shape perm = to_last_perm(nd);
  int64_t expected = 1;
  for (int64_t i = nd - 1; i >= 0; --i) {
    const int64_t d = perm[i];
    const int64_t size = t.sizes()[d];
    if (size != 1 && t.strides()[d] != expected) return false;
    expected *= size;
  }
  return true;
}

bool channels_last(const Tensor& t) { return !t.is_contiguous() && dense_channels_last(t); }

Tensor empty_in_layout(const Shape& sizes, DType dtype, Device device, bool cl) {
  const int64_t nd = static_cast<int64_t>(sizes.size());
  if (!cl) return make_empty(sizes, dtype, device, "conv");
  // Channels-last strides: C innermost, then the spatial dims, then N. The tensor owns its
  // storage (not a permuted view), so the autograd store can adopt it as a gradient as it is.
  const Shape perm = to_last_perm(nd);
  Shape strides(sizes.size(), 1);
  int64_t stride = 1;
  for (int64_t i = nd - 1; i >= 0; --i) {
    strides[perm[i]] = stride;
    stride *= std::max<int64_t>(sizes[perm[i]], 1);
  }
  return make_empty_strided(sizes, strides, dtype, device, "conv");
}

}  // namespace flame::conv_detail

namespace flame::layout_detail {

bool heads_inner(const Tensor& t) {
  if (t.dim() != 4 || t.size(1) < 2 || t.size(2) < 2) return false;
  const int64_t h = t.size(1), s = t.size(2), d = t.size(3);
  return t.stride(3) == 1 && t.stride(1) == d && t.stride(2) == h * d && (t.size(0) == 1 || t.stride(0) == s * h * d);
}

Tensor empty_like_heads(const Tensor& t, const char* op) {
  return heads_inner(t) ? make_empty_strided(t.sizes(), t.strides(), t.dtype(), t.device(), op)
                        : make_empty(t.sizes(), t.dtype(), t.device(), op);
}

}  // namespace flame::layout_detail
