#pragma once
// Gradient rule of the convolutions (src/ops/conv.cpp).
#include "flame/tensor.h"
#include "src/backend/backend.h"

namespace flame::rules {

struct ConvRecord {
  backend::Backend::ConvParams params;
  bool transposed = false;
  bool channels_last = false;  // layout the forward ran in (Note [Conv layouts])
};

// Records the node of y = conv(x, w) + bias (bias may be undefined) when any input needs a gradient.
void conv(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias, const ConvRecord& rec);

}  // namespace flame::rules
