#pragma once
// Dense channels-last layouts of 4-d and 5-d tensors (Note [Conv layouts] in src/ops/conv.cpp),
// shared by the conv ops and the cuDNN backend.
#include "flame/tensor.h"

namespace flame::conv_detail {

// Strides of a dense channels-last tensor (true also for some contiguous ones, e.g. C == 1).
bool dense_channels_last(const Tensor& t);
// Layout of every tensor given to a conv kernel: contiguous, or dense channels-last (and not also
// contiguous).
bool channels_last(const Tensor& t);
// A fresh uninitialised tensor of logical shape `sizes` in the requested layout.
Tensor empty_in_layout(const Shape& sizes, DType dtype, Device device, bool cl);


}  // namespace flame::conv_detail

namespace flame::layout_detail {
// t is [B, H, S, D] over contiguous [B, S, H, D] memory: the heads-transposed view of a projection,
// the layout attention's q, k and v usually have (H and S at least 2).
bool heads_inner(const Tensor& t);
// An uninitialised tensor of t's sizes and dtype on its device, in t's layout when that is
// heads_inner, else contiguous.
Tensor empty_like_heads(const Tensor& t, const char* op);
}  // namespace flame::layout_detail
